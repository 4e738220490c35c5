"""Frozen configuration records: sampling, the engine's settings and its A/B switches.

The environment switches are declared and parsed in gmlx/switches.py (docs/design.md §2);
`Switches` holds the engine's four, read from there.
"""

from __future__ import annotations

import math
import numbers
import secrets
from dataclasses import dataclass, field, replace
from typing import Callable

from gmlx import switches
from gmlx.errors import InvalidRequest

MAX_LOGPROBS = 20  # the most top alternatives a request may ask for per token (OpenAI's top_logprobs limit)


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling parameters (names and defaults as in mlx-lm / vLLM).

    temperature 0 is greedy. top_p in (0, 1] (1 = off), top_k >= 0 (0 = off), min_p in [0, 1]
    (0 = off). seed: None draws one at submit time; it is reported in the final record.
    stop: strings that end generation; the matched string is not part of the text.
    ignore_eos: generate past EOS until max_tokens (as vLLM; for fixed-length benchmarks).
    stop_fn: called on the engine thread after each emitted token with (tokens so far, text so
    far); True ends the request ("stop"), an exception ends it with finish reason "error".
    Keep it cheap: it runs inside every round of every request in the batch.
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    max_tokens: int = 256
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False  # as vLLM: keep generating past EOS (fixed-length benchmarks)
    stop_fn: Callable[[list[int], str], bool] | None = None
    # Logits processors (gmlx/processors.py; mlx-lm's make_logits_processors semantics and order:
    # logit_bias, repetition, presence, frequency; then min_tokens). Off at their defaults.
    repetition_penalty: float = 0.0  # multiplicative, sign-aware; 0 or 1 = off
    repetition_context_size: int = 20  # the last N tokens (prompt included) it looks at; 0 = all
    presence_penalty: float = 0.0  # subtracted once from each token in the window; in [-2, 2]
    presence_context_size: int = 20
    frequency_penalty: float = 0.0  # subtracted per occurrence in the window; in [-2, 2]
    frequency_context_size: int = 20
    logit_bias: tuple[tuple[int, float], ...] | dict | None = None  # token id -> bias in [-100, 100]
    min_tokens: int = 0  # EOS is masked until this many tokens were generated
    logprobs: int | None = None  # None: off; N >= 0: the chosen token's logprob and the top N (<= 20)
    prompt_logprobs: int | None = None  # the same for every prompt token after the first (echo)
    # Predicted output (OpenAI's `prediction`): text, or token ids, the answer is expected to
    # resemble (the previous answer, the file being edited). Drafts are copied from it where the
    # output aligns with it (gmlx/drafters/prediction.py); it never changes a token. Text becomes
    # token ids when the request is made (gmlx/engine/intake.py); "" or () means none.
    prediction: str | tuple[int, ...] | None = None

    def __post_init__(self):
        if isinstance(self.logit_bias, dict):  # kept hashable: sorted (token, bias) pairs
            try:
                pairs = tuple(sorted(self.logit_bias.items()))
            except TypeError:
                pairs = tuple(self.logit_bias.items())
            object.__setattr__(self, "logit_bias", pairs)

    @property
    def has_processors(self) -> bool:
        """Whether any logits processor is on (False: the sampler's plain path, zero cost)."""
        return (self.repetition_penalty not in (0, 1) or self.presence_penalty != 0 or self.frequency_penalty != 0
                or bool(self.logit_bias) or self.min_tokens > 0)

    def validated(self) -> "SamplingParams":
        """Check every field; return a copy with a concrete seed and stop as a tuple. Wrong types
        are InvalidRequest too (never a TypeError from deep inside the engine)."""
        if not _is_int(self.max_tokens) or self.max_tokens <= 0:
            raise InvalidRequest(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if not _is_real(self.temperature) or not (0.0 <= self.temperature < math.inf):
            raise InvalidRequest(f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature!r}")
        if not _is_real(self.top_p) or not (0.0 < self.top_p <= 1.0):
            raise InvalidRequest(f"top_p must be in (0, 1] (1 = off), got {self.top_p!r}")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise InvalidRequest(f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        if not _is_real(self.min_p) or not (0.0 <= self.min_p <= 1.0):
            raise InvalidRequest(f"min_p must be in [0, 1] (0 = off), got {self.min_p!r}")
        if not isinstance(self.stop, (str, list, tuple)):
            raise InvalidRequest(f"stop must be a string or a list of strings, got {self.stop!r}")
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        if any(not isinstance(s, str) or s == "" for s in stop):
            raise InvalidRequest("stop strings must be non-empty strings")
        if not isinstance(self.ignore_eos, bool):
            raise InvalidRequest(f"ignore_eos must be True or False, got {self.ignore_eos!r}")
        if self.stop_fn is not None and not callable(self.stop_fn):
            raise InvalidRequest(f"stop_fn must be callable (tokens, text) -> bool, got {self.stop_fn!r}")
        self._validate_processors()
        prediction = _prediction(self.prediction)
        seed = self.seed
        if seed is None:
            seed = secrets.randbits(31)
        elif not _is_int(seed) or seed < 0:
            raise InvalidRequest(f"seed must be an integer >= 0, got {seed!r}")
        return replace(self, seed=seed, stop=stop, prediction=prediction)

    def _validate_processors(self) -> None:
        rp = self.repetition_penalty
        if not _is_real(rp) or not (0.0 <= rp < math.inf):
            raise InvalidRequest(f"repetition_penalty must be a finite number >= 0 (0 or 1 = off), got {rp!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not _is_real(v) or not (-2.0 <= v <= 2.0):
                raise InvalidRequest(f"{name} must be a number in [-2, 2] (0 = off), got {v!r}")
        for name in ("repetition_context_size", "presence_context_size", "frequency_context_size"):
            v = getattr(self, name)
            if not _is_int(v) or v < 0:
                raise InvalidRequest(f"{name} must be an integer >= 0 (0 = the whole context), got {v!r}")
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise InvalidRequest(f"min_tokens must be an integer >= 0, got {self.min_tokens!r}")
        if _is_int(self.max_tokens) and self.min_tokens > self.max_tokens:
            raise InvalidRequest(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        bias = self.logit_bias
        if bias is not None:
            if not isinstance(bias, tuple) or any(not isinstance(p, tuple) or len(p) != 2 for p in bias):
                raise InvalidRequest(f"logit_bias must map token ids to numbers, got {bias!r}")
            for tok, b in bias:
                if not _is_int(tok) or tok < 0:
                    raise InvalidRequest(f"logit_bias keys must be token ids (integers >= 0), got {tok!r}")
                if not _is_real(b) or not (-100.0 <= b <= 100.0):
                    raise InvalidRequest(f"logit_bias values must be numbers in [-100, 100], got {b!r} for token {tok}")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and (not _is_int(v) or not 0 <= v <= MAX_LOGPROBS):
                raise InvalidRequest(f"{name} must be an integer in [0, {MAX_LOGPROBS}] (or None: off), got {v!r}")


def _prediction(p) -> str | tuple[int, ...] | None:
    """A prediction as text or a tuple of token ids (None when empty); anything else is refused."""
    if p is None or isinstance(p, str):
        return p or None
    try:
        ids = tuple(p)
    except TypeError:
        raise InvalidRequest(f"prediction must be text or a list of token ids, got {type(p).__name__}") from None
    odd = [t for t in ids if not _is_int(t) or t < 0]
    if odd:
        raise InvalidRequest(f"prediction token ids must be integers >= 0, got {odd[:5]!r}")
    return tuple(int(t) for t in ids) or None


def _is_int(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)  # numpy integers too; True is no count


def _is_real(x) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


@dataclass(frozen=True)
class Switches:
    """The A/B off switches, read from the environment once. GMLX_MTP_WIDTH_CAP is not kept here:
    the engine re-reads it every round (and validates it at start through its cap decision)."""

    preempt: bool = True
    resume: bool = True
    # GMLX_CONTROL: the online control of K and of plain-vs-speculative per width
    # (gmlx/policy/control.py); off: the configured cap and K alone decide, as before it existed.
    control: bool = field(default_factory=switches.CONTROL.value)
    # GMLX_TREE (opt-in, off by default): the lone request may verify a token tree instead of its
    # draft chain (gmlx/decode/tree_verify.py), where it measures the tree faster than the chain.
    tree: bool = field(default_factory=switches.TREE.value)
    # GMLX_CONTEXT_LOOKUP (on by default): the lone request drafts from its own context where its
    # last tokens recur there, beside the model's drafter (gmlx/drafters/context_lookup.py).
    context_lookup: bool = field(default_factory=switches.CONTEXT_LOOKUP.value)

    @classmethod
    def from_env(cls, environ: dict | None = None) -> "Switches":
        return cls(
            preempt=switches.PREEMPT.value(environ),
            resume=switches.RESUME.value(environ),
            control=switches.CONTROL.value(environ),
            tree=switches.TREE.value(environ),
            context_lookup=switches.CONTEXT_LOOKUP.value(environ),
        )


@dataclass(frozen=True)
class EngineConfig:
    """How the engine decodes. `speculative=None` means: speculate when the model has a drafter."""

    speculative: bool | None = None
    num_draft_tokens: int | None = None  # None: the model's default (measured), else >= 1
    width_cap: int | str | None = None  # CLI flag: N, 0 = uncapped, "off"; None: env, user config, model
    resume_min_remaining: int = 8
    max_queued: int = 256
    prompt_cache_bytes: int = 64 << 20  # 0 disables the prompt cache
    prefill_step_size: int = 512
    drafter: str | None = None  # "mtp" | "draft" | "assistant" | "ngram" | "prediction" | "eagle3"; None: draft model if given, else mtp, else assistant
    draft_model: str | None = None  # a local mlx-lm model directory with the target's tokenizer (eagle3: its checkpoint)

    def validated(self) -> "EngineConfig":
        if self.num_draft_tokens is not None and (not isinstance(self.num_draft_tokens, int) or self.num_draft_tokens < 1):
            raise InvalidRequest(f"num_draft_tokens must be an integer >= 1, got {self.num_draft_tokens!r}")
        cap = self.width_cap
        if cap is not None and not (cap == "off" or (isinstance(cap, int) and not isinstance(cap, bool) and cap >= 0)):
            raise InvalidRequest(f"speculative_width_cap must be an integer >= 0 (0 = uncapped) or 'off', got {cap!r}")
        if self.resume_min_remaining < 0:
            raise InvalidRequest("resume_min_remaining must be >= 0")
        if self.max_queued < 1:
            raise InvalidRequest("max_queued must be >= 1")
        if self.drafter not in (None, "mtp", "draft", "assistant", "ngram", "prediction", "eagle3"):
            raise InvalidRequest(f"drafter must be 'mtp', 'draft', 'assistant', 'ngram', 'prediction' or 'eagle3',"
                                 f" got {self.drafter!r}")
        return self
