"""What `gmlx bench` shows and writes: the summary tables on screen first (should writing the
files fail, what was measured is still there), then CSV / JSON / PNG in --out; the verdict of
--verify last."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import typer

from gmlx.config import EngineConfig
from gmlx.errors import GmlxError
from gmlx_cli import ui
from gmlx_cli.bench import ideal
from gmlx_cli.bench.live import print_table


class VerificationFailed(GmlxError):
    """A stream differed from its solo plain run beyond a floating-point near-tie."""


def report(lm, runs: list, arms: list, config: EngineConfig, out: Path, human, json_output: bool,
           interrupted: bool, verdict: tuple | None, *, options: dict, seed: int, seed_drawn: bool, repeats: int,
           meta_config: dict) -> None:
    """The summary tables on screen, then the files; exit 130 when interrupted, 1 on a mismatch."""
    from gmlx_cli.bench import results, summary  # pandas: only when a command needs it

    req_df = results.requests_frame(runs)
    cell_df = results.cells_frame(runs, req_df, repeats)
    if not interrupted:
        ideal.annotate_cells(cell_df, lm, config)
    meta = results.metadata(command="bench", model=lm.name, model_path=str(lm.path), seed=seed, seed_drawn=seed_drawn,
                            interrupted=interrupted, options=options, config=meta_config)
    payload = {"meta": meta, "cells": results.records(cell_df),
               "requests": results.records(req_df), "runs": results.run_aggregates(runs, req_df),
               "transitions": results.transitions_by_arm(runs)}
    if verdict is not None:
        payload["verify"] = {"checked": verdict[0], "near_ties": verdict[1], "mismatches": verdict[2]}
    # The summary first: should writing the files fail, what was measured is still on screen.
    tables = summary.summary_tables(cell_df)
    for i, table in enumerate(tables):
        print_table(*table, human, notes=summary.summary_notes(cell_df, req_df) if i == len(tables) - 1 else ())
    write_files(out, payload, req_df, cell_df, human, json_output, interrupted)
    if verdict is not None:
        for line in verdict[2]:
            print(f"mismatch: {line}", file=sys.stderr)
        print(f"verify: {verdict[0]} streams checked, {len(verdict[2])} mismatches, {verdict[1]} near-ties",
              file=human, flush=True)
        if verdict[2]:
            raise VerificationFailed(f"{len(verdict[2])} of {verdict[0]} streams differ from a solo plain run"
                                     " (listed above)")


def write_files(out: Path, payload: dict, req_df, cell_df, human, json_output: bool, interrupted: bool) -> dict:
    """bench-<stamp>.json / -requests.csv / -cells.csv / .png in `out`, their paths said; with
    --json the payload on stdout; exit 130 when interrupted (the partial results are kept)."""
    from gmlx_cli.bench import plots, results

    paths = results.write_tables(out, "bench", payload, {"requests": req_df, "cells": cell_df})
    if len(cell_df):
        paths["png"] = plots.plot_bench(cell_df, paths["json"].with_suffix(".png"))
    print("results: " + ", ".join(str(p) for p in paths.values()), file=human, flush=True)
    if json_output:
        sys.stdout.write(json.dumps(payload) + "\n")
        sys.stdout.flush()
    if interrupted:
        # typer turns a KeyboardInterrupt into a silent exit 130; say what was kept.
        ui.error(f"interrupted; partial results written to {paths['json']}")
        raise typer.Exit(130)
    return paths
