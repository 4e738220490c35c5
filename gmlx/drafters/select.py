"""Which drafter an engine uses, built from what the model directory (and the caller) provide.

Kinds: "mtp" (an MTP head shipped with the target: gmlx's own or a native checkpoint layout),
"draft" (a separate small model with the target's tokenizer: --draft-model), "assistant" (a
KV-sharing assistant head shipped beside the target), "ngram" (prompt lookup: drafts copied from
the row's own context; needs no files, so any target that can roll back has it), "prediction"
(drafts only from requests' predicted outputs; rows without one draft nothing), "eagle3" (an
EAGLE-3 head in its public checkpoint layout, given as --draft-model PATH: gmlx/heads/eagle3_head.py;
the engine then sees the target through a view that captures the layers the head reads). With no kind
asked for: a draft model when one is given (the caller asked for it), else a shipped EAGLE-3 head
(SmolLM2's GGUF: gmlx/gguf/smollm2.py; `--drafter eagle3` without a path takes it too, and on the
embedded model its own shipped EAGLE-3 head), else the kind the model's config.json names
(`speculative_drafter`: the embedded model names its assistant head, measured faster than its MTP
head), else the MTP head, else the assistant head; never ngram unless named (it pays only where
the output repeats its context, and the model's own drafter, trained for it, is the better default).

Whatever the kind, the engine's drafter is wrapped for predicted outputs (`choose`;
gmlx/drafters/prediction.py): a request with a `prediction` drafts from it where its output aligns
with it, and every other row drafts exactly as the chosen kind does.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

from mlx.utils import tree_flatten

from gmlx.errors import ModelLoadError, NoDrafterError
from gmlx.gguf import smollm2
from gmlx.models import family
from gmlx.models.loading import LoadedModel, default_model_path, no_drafter_message, no_rollback_message
from gmlx.weights import EMBEDDED_EAGLE3
from gmlx.drafters.base import Drafter

KINDS = ("mtp", "draft", "assistant", "ngram", "prediction", "eagle3")
_PROBE = "def f(x):\n    return [x, 'é', 12345]  # the same tokenizer?\n"


def _n_params(module) -> int:
    return sum(v.size for _, v in tree_flatten(module.parameters()))


def check_draft_compatible(lm, draft_lm) -> None:
    """The draft model must tokenize exactly as the target (drafts are token ids)."""
    a = list(lm.tokenizer.encode(_PROBE))
    b = list(draft_lm.tokenizer.encode(_PROBE))
    if a != b:
        raise ModelLoadError(f"the draft model {draft_lm.name!r} does not use the target's tokenizer"
                             f" ({lm.name!r}); pick a draft model of the same family")


@lru_cache(maxsize=4)
def _load_draft(path: str):
    from gmlx.models.loading import load

    return load(path, drafter=False)  # a draft model's own heads are never used


def load_draft_model(path: str | Path):
    """A draft model directory, loaded once per process (bench and sweep build many engines)."""
    return _load_draft(str(Path(path).expanduser().resolve()))


def has_assistant(lm) -> bool:
    from gmlx.heads.assistant_head import CONFIG_FILE, WEIGHTS_FILE

    return (lm.path / CONFIG_FILE).is_file() and (lm.path / WEIGHTS_FILE).is_file()


@lru_cache(maxsize=4)
def _load_assistant(path: str):
    from gmlx.heads.assistant_head import load_assistant

    return load_assistant(path)


def load_assistant_head(lm):
    """The assistant head beside the model (loaded once per process), or None."""
    return _load_assistant(str(Path(lm.path).resolve()))


def available(lm, draft_lm=None) -> list[str]:
    """The drafter kinds this model (and the given draft model) can run."""
    out = []
    if lm.head is not None:
        out.append("mtp")
    if draft_lm is not None:
        out.append("draft")
    if has_assistant(lm):
        out.append("assistant")
    if lm.can_rollback:
        out += ["ngram", "prediction"]
    return out


def can_draft(lm, kind: str | None = None) -> bool:
    """Can this model speculate with the drafter kind asked for (None: its own default)? A model
    drafts with what it ships (an MTP or assistant head); prompt lookup needs nothing shipped."""
    return kind in ("ngram", "prediction") or lm.head is not None or has_assistant(lm)


def default_kind(lm) -> str | None:
    """The kind a model drafts with when none is asked for and no draft model is given: the one its
    config.json names (`speculative_drafter`) where the directory has it (a copy that dropped the
    assistant's files falls back), else its MTP head, else its assistant head; None: neither."""
    if lm.default_drafter is not None and lm.default_drafter in available(lm):
        return lm.default_drafter
    if lm.head is not None:
        return "mtp"
    return "assistant" if has_assistant(lm) else None


def select_drafter(lm, kind: str | None = None, draft_lm=None, prefill_step: int = 512) -> Drafter | None:
    """The drafter of this kind (None: the default order above); None when the model has none."""
    if kind is not None and kind not in KINDS:
        raise NoDrafterError(f"unknown drafter kind {kind!r}; use one of {', '.join(KINDS)}")
    if kind is None:
        if draft_lm is not None:
            kind = "draft"
        else:
            kind = default_kind(lm)
        if kind is None:
            return None
    if kind == "ngram":
        from gmlx.drafters.ngram import NGramDrafter

        return NGramDrafter()
    if kind == "prediction":
        from gmlx.drafters.prediction import PredictionDrafter

        return PredictionDrafter()
    if kind == "eagle3":
        raise NoDrafterError("drafter 'eagle3' needs the EAGLE-3 checkpoint directory (--draft-model PATH)")
    if kind == "draft":
        if draft_lm is None:
            raise NoDrafterError("drafter 'draft' needs a draft model (--draft-model PATH)")
        from gmlx.drafters.draft_model import DraftModelDrafter

        check_draft_compatible(lm, draft_lm)
        # Decode is memory-bound: a step costs about its weights' bytes, relative to the target's.
        cost = max(0.05, _n_params(draft_lm.target.model) / max(1, _n_params(lm.target.model)))
        return DraftModelDrafter(draft_lm.target, step_cost=cost, prefill_step=prefill_step, path=draft_lm.path)
    if kind == "mtp":
        if lm.head is None:
            raise NoDrafterError(no_drafter_message(lm))
        from gmlx.drafters.mtp import MTPDrafter

        return MTPDrafter(lm.head, lm.target.hidden_size)  # lm.head is bound at load
    head = load_assistant_head(lm)
    if head is None:
        raise NoDrafterError(f"{lm.name} has no assistant head (assistant_config.json + assistant_head.safetensors)")
    from gmlx.drafters.assistant import AssistantDrafter

    return AssistantDrafter(head, lm.target)


def cap_key_suffix(drafter: Drafter | None, own: str | None = "mtp") -> str:
    """Calibrated caps are per drafter: the model's default kind (`own`: `default_kind`, the MTP
    head where the model names none) keeps the plain model key, the other kinds add theirs, so a
    cap measured with one drafter never applies to another."""
    if drafter is None or drafter.kind == own:
        return ""
    if drafter.kind == "draft":
        return f"+draft:{Path(drafter.path).resolve() if drafter.path else 'unnamed'}"
    return f"+{drafter.kind}"


def cap_defaults(lm, drafter: Drafter | None) -> dict:
    """The model-and-drafter part of `caps.resolve_cap(...)`: the family default for the drafter
    actually in use (config.json's `speculative_width_cap` was measured with the model's default
    drafter — `speculative_drafter`, else its own head — so it applies to that drafter only) and
    the hard limit of a drafter that serves only `max_width` rows (1: a single-sequence drafter,
    which no setting may raise)."""
    if drafter is None:
        return lm.cap_defaults()
    own = default_kind(lm)
    if drafter.kind == "mtp" and own == "mtp":
        out = lm.cap_defaults()
        kind = lm.drafter_kind or "mtp"
    else:
        kind = "draft-model" if drafter.kind == "draft" else drafter.kind
        measured = lm.config.get("speculative_width_cap") if drafter.kind == lm.default_drafter == own else None
        cap, source = family.default_cap(kind, lm.is_moe, measured)
        out = {"model_default": cap, "model_default_source": source}
    limit, why = family.single_sequence_limit(kind, drafter.max_width == 1)
    if limit is not None:
        out.update(hard_limit=limit, hard_limit_reason=why)
    return out


def with_predictions(drafter: Drafter | None) -> Drafter | None:
    """The drafter wrapped so that requests with a predicted output draft from it (rows without
    one draft exactly as `drafter` does); None stays None (no speculation, predictions unused)."""
    from gmlx.drafters.prediction import PredictionDrafter

    if drafter is None or isinstance(drafter, PredictionDrafter):
        return drafter
    return PredictionDrafter(drafter)


@dataclass
class DrafterChoice:
    """What an engine drafts with, and what follows from it."""

    drafter: Drafter | None
    draft_lm: LoadedModel | None
    cap_defaults: dict  # for caps.resolve_cap
    cap_key_suffix: str  # calibrated caps are stored per drafter
    notices: list[str] = field(default_factory=list)  # said once to the user
    lm: LoadedModel | None = None  # the model as the engine must see it (an EAGLE-3 head's view), else None


def choose(lm, config, draft_model=None, drafter: Drafter | None = None) -> DrafterChoice:
    """The engine's drafter from its config: an explicit `drafter` instance, else the kind asked
    for (or the default order). speculative=True without one is an error; a target that cannot
    roll back decodes plain (an error when speculation was asked for)."""
    draft_model = draft_model if draft_model is not None else config.draft_model
    shipped, by_default = shipped_eagle3(lm)
    if (drafter is None and draft_model is None and config.speculative is not False and shipped is not None
            and (config.drafter == "eagle3" or (config.drafter is None and by_default))):
        return _eagle3(lm, shipped)  # an EAGLE-3 head gmlx trained for this model
    if config.drafter == "eagle3" and drafter is None and config.speculative is not False:
        return _eagle3(lm, draft_model)
    draft_lm = draft_model if draft_model is None or isinstance(draft_model, LoadedModel) else load_draft_model(draft_model)
    if drafter is None and config.speculative is not False:
        drafter = with_predictions(select_drafter(lm, config.drafter, draft_lm, config.prefill_step_size))
    if config.speculative and drafter is None:
        raise NoDrafterError(no_drafter_message(lm))
    notices = []
    if drafter is not None and not lm.can_rollback:
        if config.speculative:
            raise NoDrafterError(no_rollback_message(lm))
        notices.append(no_rollback_message(lm))
        drafter = None
    suffix = cap_key_suffix(drafter, default_kind(lm))
    return DrafterChoice(drafter, draft_lm, cap_defaults(lm, drafter), suffix, notices)


def shipped_eagle3(lm) -> tuple[Path | None, bool]:
    """(the EAGLE-3 head gmlx ships for this model, whether it is the model's default drafter):
    SmolLM2's GGUF conversion drafts with its head by default (it beats the MTP head there);
    the embedded model's is taken when asked for (`--drafter eagle3`)."""
    if (d := smollm2.shipped_eagle3_dir(lm.path)) is not None:
        return d, True
    if lm.path == default_model_path() and (EMBEDDED_EAGLE3 / "config.json").is_file():
        return EMBEDDED_EAGLE3, False
    return None, False


def _eagle3(lm, path) -> DrafterChoice:
    """An EAGLE-3 head from its checkpoint directory: the engine runs on the model's view that
    captures the target layers the head reads (gmlx/heads/eagle3_streams.py)."""
    if path is None or isinstance(path, LoadedModel):
        raise NoDrafterError("drafter 'eagle3' needs the EAGLE-3 checkpoint directory (--draft-model PATH)")
    if not lm.can_rollback:
        raise NoDrafterError(no_rollback_message(lm))
    from gmlx.drafters.eagle3 import load_eagle3

    view, inner = load_eagle3(path, lm)
    drafter = with_predictions(inner)
    return DrafterChoice(drafter, None, cap_defaults(view, drafter), f"+eagle3:{Path(path).resolve()}", lm=view)
