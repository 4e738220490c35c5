"""Validate a request at the API boundary, before any engine state changes."""

from __future__ import annotations

import numbers
from dataclasses import replace

from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer

from gmlx.config import SamplingParams
from gmlx.errors import InvalidRequest
from gmlx.models.loading import LoadedModel
from gmlx.row import Row


def tokenize(lm: LoadedModel, prompt: str | list[int]) -> list[int]:
    if isinstance(prompt, str):
        if prompt == "":
            raise InvalidRequest("the prompt is empty")
        ids = list(lm.tokenizer.encode(prompt, add_special_tokens=True))
        if not ids:
            raise InvalidRequest("the prompt encodes to no tokens")
        return ids
    try:
        items = list(prompt)
    except TypeError:
        raise InvalidRequest(f"a prompt must be a string or a list of token ids, got {type(prompt).__name__}") from None
    # int(1.7) would silently decode another token: only integers are token ids
    odd = [t for t in items if not isinstance(t, numbers.Integral) or isinstance(t, bool)]
    if odd:
        raise InvalidRequest(f"prompt token ids must be integers, got {odd[:5]!r}")
    ids = [int(t) for t in items]
    if not ids:
        raise InvalidRequest("the prompt is empty")
    vocab = lm.target.vocab_size
    bad = [t for t in ids if not 0 <= t < vocab]
    if bad:
        raise InvalidRequest(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
    return ids


def make_row(lm: LoadedModel, prompt: str | list[int], params: SamplingParams | None) -> Row:
    """A validated Row (rid unset). Raises InvalidRequest; changes nothing."""
    if params is not None and not isinstance(params, SamplingParams):
        raise InvalidRequest(f"params must be a gmlx.SamplingParams, got {type(params).__name__}")
    params = (params or SamplingParams()).validated()
    ids = tokenize(lm, prompt)
    if params.logit_bias:
        vocab = lm.target.vocab_size
        odd = [t for t, _ in params.logit_bias if t >= vocab]
        if odd:
            raise InvalidRequest(f"logit_bias keys {odd[:5]} are not token ids: the vocabulary is [0, {vocab})")
    ctx = lm.context_length
    if ctx is not None and len(ids) >= ctx:
        raise InvalidRequest(f"the prompt has {len(ids)} tokens; the model's context is {ctx} tokens")
    if ctx is not None and len(ids) + params.max_tokens > ctx:
        raise InvalidRequest(
            f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) exceeds the model's context of"
            f" {ctx} tokens; lower max_tokens to at most {ctx - len(ids)}"
        )
    eos = frozenset() if params.ignore_eos else frozenset(lm.eos_ids)
    if params.prediction is not None:
        params = replace(params, prediction=prediction_ids(lm, params.prediction))
    row = Row(rid=-1, prompt=ids, params=params, eos_ids=eos, detokenizer=keeping_spaces(lm.tokenizer.detokenizer))
    if params.prediction is not None:
        row.stats.prediction_tokens = len(params.prediction)
    return row


class _BPEKeepingSpaces(BPEStreamingDetokenizer):
    def _maybe_trim_space(self, current_text):
        return current_text


def keeping_spaces(detokenizer):
    """mlx-lm's byte-level BPE detokenizer drops the space that begins the first generated token
    (" Paris" -> "Paris"), so a client's prompt + completion loses a space; the text of those
    tokens, as the tokenizer decodes them, keeps it (as vLLM and OpenAI return it). Byte-level BPE
    spells the space out as a byte, so nothing else changes; SentencePiece detokenizers are kept
    as mlx-lm makes them."""
    if type(detokenizer) is BPEStreamingDetokenizer:
        detokenizer.__class__ = _BPEKeepingSpaces
    return detokenizer


def prediction_ids(lm: LoadedModel, prediction: str | tuple[int, ...]) -> tuple[int, ...] | None:
    """A predicted output as token ids: text is encoded as the output would be (no special
    tokens); ids must be in the vocabulary."""
    if isinstance(prediction, str):
        return tuple(int(t) for t in lm.tokenizer.encode(prediction, add_special_tokens=False)) or None
    vocab = lm.target.vocab_size
    bad = [t for t in prediction if not 0 <= t < vocab]
    if bad:
        raise InvalidRequest(f"prediction token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
    return tuple(prediction) or None
