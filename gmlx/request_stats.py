"""Per-request statistics under vLLM's names (each Row carries one).

Nothing here touches the device: every figure is counted on the host from values the loops
already synced for their own work, so statistics cost no extra device sync.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass(slots=True)
class RequestStats:
    prompt_tokens: int = 0
    prefill_tokens: int = 0  # prompt tokens actually run through the target (prompt cache hits skip some)
    num_generated: int = 0
    num_rounds: int = 0  # speculative rounds (rounds that drafted at least one token)
    num_drafted: int = 0
    num_accepted: int = 0
    acceptance_histogram: list[int] = field(default_factory=list)  # [a] = rounds that accepted a drafts
    t_submit: float = field(default_factory=time.perf_counter)
    t_first_token: float | None = None
    t_end: float | None = None
    decision: str = ""  # what the speculation in force ran at the end, and why (gmlx/engine/speculation.py)
    # Predicted outputs (gmlx/drafters/prediction.py), None without one: the prediction's length in
    # tokens; accepted = output tokens that were the aligned prediction's next token; rejected =
    # tokens drafted from the prediction that the verify rejected.
    prediction_tokens: int | None = None
    accepted_prediction_tokens: int = 0
    rejected_prediction_tokens: int = 0

    def record_round(self, drafted: int, accepted: int) -> None:
        assert 0 <= accepted <= drafted
        if drafted == 0:
            return
        self.num_rounds += 1
        self.num_drafted += drafted
        self.num_accepted += accepted
        if len(self.acceptance_histogram) <= drafted:
            self.acceptance_histogram.extend([0] * (drafted + 1 - len(self.acceptance_histogram)))
        self.acceptance_histogram[accepted] += 1

    @property
    def draft_acceptance_rate(self) -> float:
        return self.num_accepted / self.num_drafted if self.num_drafted else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens emitted per speculative round: 1 + accepted drafts per round (vLLM's definition)."""
        return 1.0 + self.num_accepted / self.num_rounds if self.num_rounds else 0.0

    @property
    def ttft_s(self) -> float | None:
        return None if self.t_first_token is None else self.t_first_token - self.t_submit

    @property
    def tokens_per_s(self) -> float | None:
        """Decode rate after the first token: (generated - 1) / (end - first token). None when there
        is no decode interval to measure (fewer than two tokens, or all of them in the first round),
        rather than a rate of 0."""
        if self.t_first_token is None or self.t_end is None or self.num_generated < 2:
            return None
        dt = self.t_end - self.t_first_token
        return (self.num_generated - 1) / dt if dt > 0 else None

    def as_dict(self) -> dict:
        return {
            "prompt_tokens": self.prompt_tokens,
            "prefill_tokens": self.prefill_tokens,
            "num_generated": self.num_generated,
            "num_rounds": self.num_rounds,
            "num_drafted": self.num_drafted,
            "num_accepted": self.num_accepted,
            "draft_acceptance_rate": self.draft_acceptance_rate,
            "mean_acceptance_length": self.mean_acceptance_length,
            "acceptance_histogram": list(self.acceptance_histogram),
            "max_draft_tokens": max(0, len(self.acceptance_histogram) - 1),  # the largest K a round ran
            "speculation": self.decision,
            "ttft_s": self.ttft_s,
            "tokens_per_s": self.tokens_per_s,
            **({} if self.prediction_tokens is None else {
                "prediction_tokens": self.prediction_tokens,
                # a verified token past the end (EOS, a stop string) is not output: never more than it
                "accepted_prediction_tokens": min(self.accepted_prediction_tokens, self.num_generated),
                "rejected_prediction_tokens": self.rejected_prediction_tokens}),
        }
