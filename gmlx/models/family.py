"""What a model's structure implies for speculation: its default width cap, MoE, rollback.

Default cap (used when no CLI flag, GMLX_MTP_WIDTH_CAP or user-config entry sets one, see
`gmlx.policy.caps.resolve_cap`), first rule that applies:

1. the model's config.json `speculative_width_cap`: its author measured it    "model default"
2. a routed-expert (MoE) target: 1. A verify forward of W rows x (k+1) tokens routes each
   token to its own experts, so the expert weights read per forward grow with W(k+1) where a
   dense target's stay fixed; on a bandwidth-bound machine batch speculation stops paying
   almost at once. Detected from the loaded modules, not the model name.
3. a separate draft model or a KV-sharing assistant head: 2 (the drafter's own forward is
   a real cost per row, unlike a one-layer MTP head)
4. prompt lookup (ngram): 2. Its drafts cost nothing, but a batch verifies every row at the
   longest row's draft length (a row without a match carries padding), so the forward grows
   with W(k+1) positions, which a CPU pays in full; the gated alternative is double-buffered.
   Measured on this project's 2-core CPU (embedded model, k = 3): width 2 won in most paired
   runs, width 4 lost (x0.8-0.9) even at acceptance 0.6. Predicted outputs alone
   (`--drafter prediction`) likewise: host-only drafts, padded to the longest row.
5. a dense target with an MTP head (gmlx's or the checkpoint's own): 0 = uncapped
6. no drafter: 0 (nothing to cap)                                           "built-in default"

A drafter that can serve only one sequence gets a hard limit of 1 that no setting raises
(`single_sequence_limit`; `gmlx.policy.caps.resolve_cap(hard_limit=...)` applies it with a notice).

Rollback: speculation trims the target's KV cache by the rejected drafts. mlx-lm's hybrid families
keep a recurrent state (`ArraysCache`) in their linear-attention layers; gmlx rolls those back by
capturing the state per position during a verify (gmlx/recurrent.py: Qwen3-Next / Qwen3.5
Gated DeltaNet layers, found from the model). A recurrent layer it cannot capture (Mamba-style
SSM blocks, other delta nets), or any other cache that cannot be trimmed, makes the target decode
plain whatever drafter it ships, with the reason in `rollback_blockers`.
"""

from __future__ import annotations

import mlx.nn as nn
from mlx_lm.models.cache import ArraysCache, make_prompt_cache
from mlx_lm.models.switch_layers import QuantizedSwitchLinear, SwitchLinear

MODEL_DEFAULT = "model default"
BUILT_IN = "built-in default"
MTP_KINDS_PREFIX = ("mtp", "native-mtp")
SEPARATE_KINDS = ("draft-model", "assistant")


def _guess_source(kind: str) -> str:
    return f"family default: {kind.replace('-', ' ')} drafter"


# Drafter kinds whose family default (2) is a guess at the drafter's cost, not a measurement;
# the online control measures instead (gmlx.policy.caps.under_control).
GUESSED_KINDS = (*SEPARATE_KINDS, "ngram", "prediction")
GUESSED_SOURCES = frozenset(_guess_source(k) for k in GUESSED_KINDS)


def default_cap(kind: str | None, is_moe: bool, config_cap) -> tuple[int | str, str]:
    """(cap, where it comes from) for a model when nothing else sets the cap. `config_cap` is
    config.json's `speculative_width_cap` (None when absent); "off" passes through."""
    if config_cap is not None:
        return config_cap, MODEL_DEFAULT
    if kind is None:
        return 0, BUILT_IN
    if is_moe:
        return 1, "family default: routed-expert (MoE) target"
    if kind in GUESSED_KINDS:
        return 2, _guess_source(kind)
    if kind.startswith(MTP_KINDS_PREFIX):
        return 0, "family default: dense target with an MTP head"
    return 0, BUILT_IN


def single_sequence_limit(kind: str | None, single_sequence: bool) -> tuple[int | None, str]:
    """(hard limit, why) for `resolve_cap(hard_limit=..., hard_limit_reason=...)`; (None, "") when
    the drafter serves a batch."""
    if kind is None or not single_sequence:
        return None, ""
    return 1, f"the {kind} drafter serves one sequence at a time"


def is_moe(model: nn.Module) -> bool:
    """Whether any layer routes tokens to experts: mlx-lm's MoE families (mixtral, qwen2_moe,
    qwen3_moe, deepseek_v3, qwen3_next, ...) hold their experts in SwitchLinear (quantized or
    not, inside SwitchGLU/SwitchMLP); a few (dbrx) keep a module list named `experts`."""
    for name, m in model.named_modules():
        if isinstance(m, (SwitchLinear, QuantizedSwitchLinear)) or name.rsplit(".", 1)[-1] == "experts":
            return True
    return False


def rollback_blockers(model: nn.Module) -> list[str]:
    """The target cache kinds that cannot be rolled back, with why (empty: speculation can roll
    back). Recurrent layers gmlx captures (gmlx.models.gated_delta.install) are not blockers."""
    from gmlx.models import gated_delta

    caches = make_prompt_cache(model)
    other = sorted({type(c).__name__ for c in caches if not isinstance(c, ArraysCache) and not c.is_trimmable()})
    return other + gated_delta.install(model)
