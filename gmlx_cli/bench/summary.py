"""The per-cell summary `gmlx bench` prints: narrow tables (each fits 80 columns) and the notes
under them, from the cells and requests tables (gmlx_cli/bench/results.py)."""

from __future__ import annotations

import pandas as pd

from gmlx.finish import FinishReason
from gmlx_cli.bench.results import TRANSITIONS

PARTIAL_MARK = "*"
SUMMARY_TITLES = ("summary per cell: latency (ms) and throughput (tok/s)", "summary per cell: speculation",
                  "summary per cell: achieved against ideal")


def summary_tables(cells: pd.DataFrame) -> list[tuple[str, list[str], list[list]]]:
    """The printed per-cell summary as narrow tables (each fits 80 columns with the longest arm
    name): times in ms; acceptance (vLLM's draft_acceptance_rate and mean_acceptance_length, named
    so in the files) is `-` wherever nothing was drafted. A partial cell's arm carries a `*`; a
    `rej` column appears where a server refused requests (HTTP 429). A server's cells (bench --url)
    have no transitions, and no speculation table when it exposes no acceptance counters."""
    def arm(c) -> str:
        return c.arm + (PARTIAL_MARK if c.partial else "")

    rejected = "rejected" in cells.columns and bool(cells.rejected.any())
    timing = (["arm", "conc", "TTFT\np50", "TTFT\np95", "ITL\np50", "ITL\np95", "req\ntok/s", "agg\ntok/s"]
              + (["rej"] if rejected else []),
              [[arm(c), c.concurrency, c.ttft_p50_s * 1e3, c.ttft_p95_s * 1e3, c.itl_p50_s * 1e3, c.itl_p95_s * 1e3,
                c.tokens_per_s_p50, c.aggregate_tokens_per_s] + ([c.rejected] if rejected else [])
               for c in cells.itertuples()])
    tables = [(SUMMARY_TITLES[0], *timing)]
    engine = all(t in cells.columns for t in TRANSITIONS)
    if engine or cells.draft_acceptance_rate.notna().any():
        shown = TRANSITIONS if engine else ()
        tables.append((SUMMARY_TITLES[1], ["arm", "conc", "accept\nrate", "mean\nacc len", *shown],
                       [[arm(c), c.concurrency, c.draft_acceptance_rate, c.mean_acceptance_length,
                         *(getattr(c, t) for t in shown)] for c in cells.itertuples()]))
    if "ideal_speedup" in cells.columns:
        vs = [[arm(c), c.concurrency, c.speedup_vs_plain, c.ideal_speedup, c.achieved_over_ideal]
              for c in cells.itertuples() if c.ideal_speedup == c.ideal_speedup]  # NaN: nothing to compare
        if vs:
            tables.append((SUMMARY_TITLES[2], ["arm", "conc", "speedup\nvs plain", "ideal\nspeedup",
                                               "achieved\n/ideal"], vs))
    return tables


def _ids_by_cells(cells: pd.DataFrame, requests: pd.DataFrame, mask) -> dict[tuple, list[str]]:
    """request ids -> the cells where exactly those match `mask` (a boolean Series over requests)."""
    out: dict[tuple, list[str]] = {}
    for c in cells.itertuples():
        mine = requests[(requests.arm == c.arm) & (requests.concurrency == c.concurrency) & mask]
        if len(mine):
            out.setdefault(tuple(sorted(set(mine.request_id))), []).append(f"{c.arm} c={c.concurrency}")
    return out


def summary_notes(cells: pd.DataFrame, requests: pd.DataFrame) -> list[str]:
    """Lines under the summary: the legend, partial cells, requests that ended at EOS first, and
    requests a server refused."""
    served = "speculative" not in cells.columns
    notes = ["req tok/s: median per request after its first token",
             "agg tok/s: tokens / (last end - first submit), every request counted however it ended"]
    if not served:
        notes.append("accept rate, mean acc len: `-` where nothing was drafted")
    elif cells.draft_acceptance_rate.notna().any():
        notes.append("accept rate, mean acc len: the server's /metrics counters across each cell (exact while"
                     " nothing else uses it)")
    else:
        notes.append("acceptance: unknown (the server's /metrics has no spec_decode counters)")
    if cells.partial.any():
        notes.append(f"{PARTIAL_MARK} partial: interrupted before every request and repeat of the cell finished")
    for ids, where in _ids_by_cells(cells, requests, requests.eos_first).items():
        n, scope = len(ids), "every cell" if len(where) == len(cells) else ", ".join(where)
        notes.append(f"request{'s' if n > 1 else ''} {', '.join(map(str, ids))} ended at EOS before"
                     f" {'their' if n > 1 else 'its'} first token ({scope}): no TTFT or tok/s, left out of those")
    for ids, where in _ids_by_cells(cells, requests, requests.finish_reason == FinishReason.REJECTED).items():
        n, scope = len(ids), "every cell" if len(where) == len(cells) else ", ".join(where)
        notes.append(f"request{'s' if n > 1 else ''} {', '.join(map(str, ids))} rejected by the server (HTTP 429)"
                     f" ({scope}): no tokens; in the span, not in TTFT or tok/s")
    return notes
