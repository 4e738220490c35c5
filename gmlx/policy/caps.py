"""The speculative width cap (and per-width K) for a model on this machine, by precedence.

Role: decide `speculative_width_cap` — speculate in the batch loop only while width <= cap —
from, highest first:

    1. the CLI flag                      source "cli"
    2. GMLX_MTP_WIDTH_CAP (the caller re-reads it every round and passes it in)
                                         source "env GMLX_MTP_WIDTH_CAP"
    3. the user config file              source "user config <path>"
    4. the model's default: config.json's value (source "model default") or, without one,
       its family's default (`gmlx.models.family.default_cap`: source "family default: ...")
    5. 0 = uncapped (right for a dense target with an MTP head)
                                         source "built-in default"
    A drafter that serves one sequence clamps whatever was decided to a hard limit (1) that no
    setting raises; `CapDecision.notice` then says so.

Cap values: N > 0 speculates while width <= N (width == N speculates); 0 = uncapped; "off" =
never speculate in the batch loop (not even at width 1, e.g. a preempted request drained to one
row). `CapDecision.cap` holds "off" as None. The scalar loop (one request, never preempted) is
not governed by the cap: it always speculates when the model has a drafter.

The user config file (its path, format and invariants): gmlx/policy/user_config.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from gmlx.models import family
from gmlx.policy import admission
from gmlx.policy.user_config import OFF, Cap, parse_cap, read_user_entry


@dataclass(frozen=True)
class CapDecision:
    """The cap in force and where it came from. cap: None = off, 0 = uncapped, N = width <= N."""

    cap: int | None
    source: str
    k_by_width: tuple[tuple[int, int], ...] = ()  # from the user config, whatever set the cap
    notice: str | None = None  # set when a hard limit overrode the value from `source`

    def allows(self, width: int) -> bool:
        """Whether the batch loop may speculate at this width (the scalar loop never asks): the
        rule admission plans with (`gmlx.policy.admission.allows`), on this decision's cap."""
        if width < 1:
            raise ValueError(f"width must be >= 1, got {width}")
        return admission.allows(self.cap, width)

    def num_draft_tokens(self, width: int, default: int) -> int:
        """K measured at the largest width <= `width`, else `default` (an explicit K wins over both).
        Width 1 is the lone request's own entry (0: it decodes plain); batches look at widths >= 2."""
        k = default
        for w, kw in self.k_by_width:  # sorted by width
            if w <= width and (w > 1 or width == 1):
                k = kw
        return k

    @property
    def text(self) -> str:
        return OFF if self.cap is None else "0 = uncapped" if self.cap == 0 else str(self.cap)

    def __str__(self) -> str:
        return f"{self.text} ({self.source})"


# A drafter family's default cap (gmlx.models.family.GUESSED_KINDS) is a guess made for engines
# that cannot measure: a drafter kind's usual cost. The online control measures what each width buys, so
# under it that guess would only forbid widths where speculation pays (a prompt-lookup drafter at
# width 4 gaining 1.3x over plain behind a cap of 2). Not dropped: a routed-expert target's cap
# (a verify's cost there grows with the rows' distinct experts, which the load probe at width 1
# does not see), the model's own config.json value (measured with its head), a cap someone set
# (flag, env, user config) and a drafter's hard limit.
def under_control(defaults: dict) -> dict:
    """`defaults` (the model-and-drafter part of `resolve_cap`) for an engine whose online control
    decides: a drafter family's guessed cap becomes uncapped, said in the source."""
    source = defaults.get("model_default_source", "")
    if source not in family.GUESSED_SOURCES:
        return defaults
    return {**defaults, "model_default": 0,
            "model_default_source": f"the online control decides per width ({source} {defaults['model_default']} not applied)"}


def resolve_cap(*, cli_cap: Cap | None, env_cap: int | None, model_key: str, model_default: Cap | None,
                machine: str | None = None, path: str | Path | None = None,
                model_default_source: str = "model default", hard_limit: int | None = None,
                hard_limit_reason: str = "") -> CapDecision:
    """Apply the precedence in the module docstring. The file is re-read only when it changed.

    `model_default_source` names where `model_default` came from (`LoadedModel.cap_source`);
    `hard_limit` (with its reason) is a ceiling no setting raises (a single-sequence drafter)."""
    entry = read_user_entry(model_key, machine=machine, path=path)  # read even when overridden: K
    k = entry.k_by_width if entry is not None else ()

    def decided(value: Cap, source: str) -> CapDecision:
        cap = parse_cap(value, f"{source} (the model's config.json)" if source == "model default" else source)
        return CapDecision(cap=None if cap == OFF else cap, source=source, k_by_width=k)

    if cli_cap is not None:
        d = decided(cli_cap, "cli")
    elif env_cap is not None:
        d = decided(env_cap, "env GMLX_MTP_WIDTH_CAP")
    elif entry is not None and entry.cap is not None:
        d = decided(entry.cap, f"user config {entry.path}")
    elif model_default is not None:
        d = decided(model_default, model_default_source)
    else:
        d = decided(0, "built-in default")
    if hard_limit is None or d.cap is None or 0 < d.cap <= hard_limit:  # off is below any limit
        return d
    why = hard_limit_reason or "the drafter's hard limit"
    return CapDecision(cap=hard_limit, source=f"hard limit: {why}", k_by_width=k,
                       notice=f"{why}: speculative_width_cap {d.text} from {d.source} is lowered to {hard_limit};"
                              " no setting can raise it")
