"""What the online control runs at a width, and why (gmlx/policy/control.py decides it)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Choice:
    """What the control runs at a width, and why (said to the user: generate, bench, serve)."""

    k: int  # 0: plain
    gain: float  # predicted tokens/s relative to plain decoding (1.0 for plain)
    alpha: float
    plain_s: float | None  # the plain round time used (measured or derived)
    round_s: float | None  # the chosen k's round time (measured or derived); None: plain
    measured: bool  # both times measured here (not the cost model's figures)
    exploring: bool = False
    window: bool = False  # a plain round of the once-only plain measurement (speculation stays chosen)
    best_spec: tuple[int, float] | None = None  # the best K >= 1 and its predicted gain (why plain)
    from_width: int | None = None  # nothing measured here: predicted from that width's round times
    doubt: float = 0.0  # the best K's predicted gain's relative standard error (measured figures)
    drain: float = 1.0  # the share of the steady gain left once the draining batch's tail is charged
    ratio: float | None = None  # the chosen k's T(k) / T(0) from pairs (see Pairs) or the load probe
    probe: bool = False  # the lone request's T(k) / T(0) from the load probe (nothing paired yet)
    tried: bool = False  # a new lone request's try of K=1 while plain is in force (thresholds.LONE_TRY)

    @property
    def speculates(self) -> bool:
        """Drafts are in force (a plain window's overlay keeps the K chosen; its plain rounds run
        mid-request, or at a lone request's tail)."""
        return self.k > 0 or self.window

    @property
    def reason(self) -> str:
        src = ("measured" if self.measured else f"width {self.from_width}'s round times" if self.from_width
               else "load probe's round costs" if self.probe else "cost model")
        if self.drain < 0.995:  # the rows' budgets end together: speculating spreads their finish
            src += f", rows finishing apart cost {100 * (1 - self.drain):.0f} %"
        if self.window:
            return "measuring plain rounds beside speculative ones at this width (their costs paired)"
        if self.tried:
            return (f"trying K={self.k} on this request's own rounds (plain in force: {self.gain:.2f}x predicted"
                    f" on earlier requests' acceptance {self.alpha:.2f})")
        if self.exploring:
            return f"trying K={self.k} again (plain for a while; acceptance {self.alpha:.2f})"
        if self.k == 0:
            alt = ""
            if self.best_spec:
                k, g = self.best_spec
                noise = f" ± {g * self.doubt:.2f} (within noise)" if g >= 1.0 and self.doubt else ""
                alt = f"best K={k} predicted {g:.2f}x{noise}, "
            return f"plain: {alt}acceptance {self.alpha:.2f} ({src})"
        times = (f", round {self.ratio:.2f}x a plain one's{'' if self.probe else ', paired'}" if self.ratio else
                 f", round {1e3 * self.round_s:.1f} ms vs plain {1e3 * self.plain_s:.1f} ms"
                 if self.round_s and self.plain_s else "")
        return f"K={self.k}: {self.gain:.2f}x predicted ({src}{times}, acceptance {self.alpha:.2f})"
