"""What `gmlx sweep-cap` recommends from its per-width summary (gmlx_cli/bench/sweep_results.py):
the speculative width cap, why (in the terms of the table), and a lone request's own K.

A cap speculates at every batch width up to it, so it is the largest width below which speculation
never lost; width 1 (one request runs the scalar lane, which the cap never gates) calibrates the
lone request's K instead.
"""

from __future__ import annotations

from gmlx.policy import user_config


def recommend(summary: list[dict], margin: float) -> int | str:
    """The largest W with speedup >= margin at every measured batch width <= W; "off" when the
    smallest batch width already loses (distinct from 0, which means uncapped). Width 1 does not
    bound the cap (one request runs the scalar lane, which the cap never gates); it calibrates the
    lone request's own K instead (`lone_request_k`)."""
    cap: int | str = user_config.OFF
    for row in sorted(summary, key=lambda r: r["width"]):
        if row["width"] < 2:
            continue
        if not row["speedup"] >= margin:  # NaN loses too
            break
        cap = row["width"]
    return cap


def _x(speedup: float) -> str:
    return f"{speedup:.2f}x" if speedup == speedup else "an unmeasured speedup"  # NaN: no paired ratio


def explain(summary: list[dict], margin: float, cap: int | str) -> str:
    """Why `recommend` chose `cap`, in the terms of the table: the first batch width that lost (its
    speedup against the margin), and any wider one that won but lies beyond that loss."""
    batch = sorted((r for r in summary if r["width"] >= 2), key=lambda r: r["width"])
    if not batch:
        return ("no batch width >= 2 was measured (width 1 runs the scalar loop, which the cap does not gate);"
                " add wider batches to --widths")
    lost = next((r for r in batch if not r["speedup"] >= margin), None)
    if lost is None:
        return f"speculation beat plain by the {margin:g}x margin at every measured width up to {cap}"
    why = f"at width {lost['width']} speculation ran at {_x(lost['speedup'])} plain, below the {margin:g}x margin"
    if cap != user_config.OFF:
        why = f"speculation won at every width up to {cap}; {why}"
    later = [r for r in batch if r["width"] > lost["width"] and r["speedup"] >= margin]
    if later:
        won = ", ".join(f"{r['width']} ({_x(r['speedup'])})" for r in later)
        why += (f"; width{'s' if len(later) > 1 else ''} {won} won, but a cap speculates at every width up to it,"
                f" so none can be kept without width {lost['width']}")
    return why


def lone_request_k(summary: list[dict], margin: float) -> dict[int, int]:
    """Width 1 is a lone request's own calibration: its best K where speculation won there by the
    margin, else 0 (the engine then decodes lone requests plain on this machine)."""
    one = next((r for r in summary if r["width"] == 1), None)
    if one is None:
        return {}
    return {1: one["best_k"] if one["speedup"] >= margin else 0}


def at_cap(width: int, cap: int | str, k_by_width: dict[int, int] | None = None) -> str:
    """What runs at this width under `cap` and the per-width K (the table's "at cap" column)."""
    if width < 2:  # one request: the scalar lane, speculating unless width 1 was calibrated plain
        return "plain" if (k_by_width or {}).get(1) == 0 else "scalar"
    return "spec" if cap != user_config.OFF and width <= cap else "plain"
