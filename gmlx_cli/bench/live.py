"""The live view of a bench run and the summary tables, rendered with Rich.

The view is built from engine `Event`s only (rounds, transitions, finishes; the mlx-lm baselines
synthesise the same events), plus the submit times the workload driver reports, so it can never
slow the engine down with queries or syncs, and it is testable without a terminal: feed events,
read `header()` / `rows()` / `render()`. On a terminal it is a Rich Live panel that repaints at
most 10 times a second; elsewhere (a pipe, a CI log) it prints plain lines: one per finished
request and one per run.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TextIO

from gmlx.engine.metrics import Event, EventKind
from gmlx.finish import FinishReason
from gmlx.policy.admission import Mode, Round

# ROUND event modes (the round kind) -> the loop state a user knows from docs/design.md §2.
_ROUND_STATE = {Round.SCALAR: Mode.SCALAR, Round.SPECULATIVE: Mode.BATCHED, Round.CAPTURE: Mode.BATCHED,
                Round.PLAIN: Mode.GATED, Round.PLAIN_LAST: Mode.GATED}  # others (bench --url's) as named
_REFRESH_S = 0.1


@dataclass
class _Req:
    rid: int
    t_submit: float
    state: str = "queued"
    tokens: int = 0
    drafted: int = 0
    accepted: int = 0
    spec_rounds: int = 0
    t_first: float | None = None
    t_last: float | None = None


class LiveView:
    def __init__(self, total: int, file: TextIO | None = None, *, rich: bool | None = None, clock=time.perf_counter,
                 max_rows: int = 16):
        self.file = file or sys.stdout
        self.rich = self.file.isatty() if rich is None else rich
        self.total, self.completed, self.clock, self.max_rows = total, 0, clock, max_rows
        self.label, self.cap, self.speculative, self.engine = "", "-", True, True
        self._reqs: dict[int, _Req] = {}
        self._live = None
        self._last_paint = 0.0
        self._reset()

    def _reset(self) -> None:
        self._reqs.clear()
        self.t0 = self.clock()
        self.tokens, self.mode, self.width = 0, "Idle", 0
        self.k, self.switches, self.decision = 0, 0, ""  # the last round's K; the online control's switches
        self.final: tuple[int, float] | None = None  # (tokens, aggregate tok/s) of the run, once it ended
        self.transitions = {"preempt": 0, "gate": 0, "resume": 0, "capture": 0}

    # -- lifecycle ---------------------------------------------------------------------------
    def __enter__(self) -> "LiveView":
        if self.rich:
            from rich.console import Console
            from rich.live import Live

            self._live = Live(self.render(), console=Console(file=self.file), auto_refresh=False)
            self._live.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self._live is not None:
            self._live.update(self.render(), refresh=True)
            self._live.__exit__(*exc)
            self._live = None

    def begin(self, label: str, *, speculative: bool = True, cap: str = "-", engine: bool = True) -> None:
        """A new run (one arm at one concurrency, one repeat): per-run figures start over.
        `engine` False: a server (bench --url), whose mode, cap and transitions are not seen here."""
        self.label, self.speculative, self.cap, self.engine = label, speculative, cap, engine
        self._reset()
        if not self.rich:
            self._line(f"== {label}" + (f" (cap {cap})" if engine else ""))
        self._paint(force=True)

    def end(self, outcomes: Sequence | None = None) -> None:
        """The run is over. With its outcomes, the line says the run's tokens and aggregate tok/s as
        the summary and the files compute them (gmlx_cli.bench.driver.run_aggregate: every request's
        end counts); without, the running figures from the events."""
        if outcomes is not None:
            from gmlx_cli.bench.driver import run_aggregate

            self.final = run_aggregate(outcomes)
        tokens, tps = self.final or (self.tokens, self.aggregate_tps())
        if not self.rich:
            self._line(f"   {self.label}: {tokens} tokens, {_fmt_rate(tps)} tok/s aggregate"
                       + (f", transitions {self._transitions_text()}" if self.engine else ""))
        self._paint(force=True)

    # -- inputs --------------------------------------------------------------------------------
    def submitted(self, rid: int, _t: float | None = None) -> None:
        self._reqs[rid] = _Req(rid, self.clock())

    def on_event(self, ev: Event) -> None:
        now = self.clock()
        if ev.kind is EventKind.ROUND:
            state = _ROUND_STATE.get(ev.round, ev.round)
            if state == Mode.GATED and not self.speculative:
                state = "plain"  # an engine without speculation is not "gated": it never arms
            self.mode, self.width = state.capitalize(), ev.width
            self.k = max((row[1] for row in ev.rows), default=0)
            for rid, drafted, accepted, n in ev.rows:
                r = self._reqs.setdefault(rid, _Req(rid, now))
                r.state, r.tokens = state, r.tokens + n
                r.drafted, r.accepted, r.spec_rounds = r.drafted + drafted, r.accepted + accepted, r.spec_rounds + (drafted > 0)
                if n:
                    r.t_first = r.t_first if r.t_first is not None else now
                    r.t_last = now
                self.tokens += n
        elif ev.kind is EventKind.DECISION:  # the control switched a width: say it under the header
            self.switches += 1
            self.decision = f"width {ev.width}: {ev.reason}"
            if not self.rich:
                self._line(f"   control: {self.decision}")
        elif ev.kind is EventKind.TRANSITION and ev.transition in self.transitions:
            self.transitions[ev.transition] += 1
        elif ev.kind is EventKind.FINISH:
            r = self._reqs.pop(ev.rid, None)
            self.completed += 1
            if not self.rich and r is not None:
                line = " ".join(f"{k} {v}" for k, v in zip(_COLUMNS, self._row(r, now)) if k != "state")
                self._line("   " + line + (_NO_TOKEN.get(ev.reason, _NO_TOKEN[None]) if r.tokens == 0 else ""))
        self._paint()

    # -- what is shown -------------------------------------------------------------------------
    def aggregate_tps(self) -> float:
        dt = self.clock() - self.t0
        return self.tokens / dt if dt > 0 else 0.0

    def _transitions_text(self) -> str:
        return " ".join(f"{k} {v}" for k, v in self.transitions.items())

    def header(self) -> str:
        tps = self.final[1] if self.final else self.aggregate_tps()
        if not self.engine:  # a server: only what a client sees
            return f"{self.label}  in flight {len(self._reqs)}  {_fmt_rate(tps)} tok/s"
        return (f"{self.label}  mode {self.mode}  width {self.width}  K {self.k}  cap {self.cap}  "
                f"{_fmt_rate(tps)} tok/s  {self._transitions_text()}"
                + (f"  control switches {self.switches} ({self.decision})" if self.switches else ""))

    def _row(self, r: _Req, now: float) -> tuple[str, ...]:
        acc = f"{r.accepted / r.drafted:.0%}" if r.drafted else "-"
        mal = f"{1 + r.accepted / r.spec_rounds:.2f}" if r.spec_rounds else "-"
        span = (r.t_last or now) - r.t_first if r.t_first is not None else 0.0
        tps = f"{(r.tokens - 1) / span:.1f}" if r.tokens > 1 and span > 0 else "-"
        ttft = f"{(r.t_first - r.t_submit) * 1000:.0f}ms" if r.t_first is not None else "-"
        return (str(r.rid), r.state, str(r.tokens), acc, mal, tps, ttft)

    def rows(self) -> list[tuple[str, ...]]:
        """One row per active request: id, state, tokens, acceptance, mean accepted length, tok/s, TTFT."""
        now = self.clock()
        return [self._row(r, now) for r in list(self._reqs.values())[: self.max_rows]]

    def render(self):
        from rich.console import Group
        from rich.progress_bar import ProgressBar
        from rich.table import Table
        from rich.text import Text

        table = Table(box=None, pad_edge=False, header_style="bold cyan")
        for name in _COLUMNS:
            table.add_column(name, justify="left" if name in ("state",) else "right")
        for row in self.rows():
            table.add_row(*row)
        hidden = len(self._reqs) - self.max_rows
        bar = Table.grid(padding=(0, 1))
        bar.add_row(ProgressBar(total=max(self.total, 1), completed=self.completed, width=40),
                    Text(f"{self.completed}/{self.total} requests"))
        parts = [Text(self.header(), style="bold"), table]
        if hidden > 0:
            parts.append(Text(f"... {hidden} more"))
        return Group(*parts, bar)

    def _paint(self, force: bool = False) -> None:
        if self._live is None:
            return
        now = self.clock()
        if force or now - self._last_paint >= _REFRESH_S:
            self._last_paint = now
            self._live.update(self.render(), refresh=True)

    def _line(self, text: str) -> None:
        print(text, file=self.file, flush=True)


_COLUMNS = ("id", "state", "tokens", "accept", "mean len", "tok/s", "TTFT")
# A finished request without a token, by finish reason (the FINISH event's `reason`, where the
# driver knows it: bench --url); the engine's own FINISH events carry none.
_NO_TOKEN = {None: " (finished before its first token)",
             FinishReason.STOP: " (ended at EOS before its first token)",
             FinishReason.REJECTED: " (rejected by the server: HTTP 429)",
             FinishReason.ERROR: " (failed before its first token)",
             FinishReason.CANCELLED: " (cancelled before its first token)",
             FinishReason.LENGTH: " (finished before its first token)"}


def _fmt_rate(v: float) -> str:
    return "-" if v != v else f"{v:.1f}"


def rich_table(title: str, columns: Sequence[str], rows: Sequence[Sequence[object]]):
    """A summary table for a terminal: no rules between columns (narrow); a header may hold a
    line break; a cell that still does not fit folds onto a second line rather than being cut."""
    from rich.table import Table

    table = Table(title=title, title_justify="left", header_style="bold cyan", box=None, pad_edge=False,
                  padding=(0, 1))
    for i, c in enumerate(columns):
        table.add_column(c, justify="left" if i == 0 else "right", overflow="fold")
    for row in rows:
        table.add_row(*(_fmt(v) for v in row))
    return table


def print_table(title: str, columns: Sequence[str], rows: Sequence[Sequence[object]], file: TextIO | None = None,
                notes: Sequence[str] = ()) -> None:
    """A summary table: Rich on a terminal, aligned plain text otherwise (greppable, no escapes);
    `notes` are printed under it as they are."""
    out = file or sys.stdout
    if out.isatty():
        from rich.console import Console

        console = Console(file=out, highlight=False)
        console.print(rich_table(title, columns, rows))
        for line in notes:
            console.print(line, markup=False)
        return
    cells = [[_fmt(v) for v in row] for row in rows]
    heads = [str(c).split("\n") for c in columns]
    depth = max(len(h) for h in heads)
    heads = [[""] * (depth - len(h)) + h for h in heads]  # a one-line header sits on the last line
    widths = [max(*(len(x) for x in h), *(len(r[i]) for r in cells)) for i, h in enumerate(heads)]
    print(title, file=out)
    for r in [[h[d] for h in heads] for d in range(depth)] + cells:  # the first column (a name) left
        line = "  ".join(v.ljust(w) if i == 0 else v.rjust(w) for i, (v, w) in enumerate(zip(r, widths)))
        print(line.rstrip(), file=out)
    for line in notes:
        print(line, file=out)
    out.flush()


def _fmt(v: object) -> str:
    if v is None or (isinstance(v, float) and v != v):
        return "-"
    if isinstance(v, float):  # three significant digits, at most one decimal, none past 1000
        return f"{v:.3g}" if abs(v) < 10 else f"{v:.1f}" if abs(v) < 1000 else f"{v:.0f}"
    return str(v)
