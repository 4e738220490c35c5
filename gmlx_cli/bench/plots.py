"""The PNG figures of bench and sweep-cap (matplotlib, headless: files only)."""

from __future__ import annotations

import math
from pathlib import Path

import pandas as pd


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on a server, no window from a CLI
    import matplotlib.pyplot as plt

    return plt


def bench_series(cells: pd.DataFrame) -> dict[str, pd.DataFrame]:
    """What the bench figure draws, per arm: concurrency, aggregate tok/s (the cells' own column,
    as the summary and the files have it) and TTFT p50 in ms."""
    out = {}
    for arm, df in cells.groupby("arm", sort=False):
        df = df.sort_values("concurrency")
        out[arm] = pd.DataFrame({"concurrency": df.concurrency.to_numpy(),
                                 "aggregate_tokens_per_s": df.aggregate_tokens_per_s.to_numpy(),
                                 "ttft_p50_ms": df.ttft_p50_s.to_numpy() * 1000})
    return out


def plot_bench(cells: pd.DataFrame, path: Path) -> Path:
    plt = _pyplot()
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for arm, df in bench_series(cells).items():
        a.plot(df.concurrency, df.aggregate_tokens_per_s, marker="o", label=arm)
        b.plot(df.concurrency, df.ttft_p50_ms, marker="o", label=arm)
    a.set(xlabel="concurrency", ylabel="aggregate tokens/s", title="throughput")
    b.set(xlabel="concurrency", ylabel="TTFT p50 (ms)", title="time to first token")
    return _save(plt, fig, (a, b), sorted(cells.concurrency.unique()), path)


def _save(plt, fig, axes, ticks: list, path: Path, rect=(0, 0, 1, 1)) -> Path:
    """Log-2 x axes ticked at the measured points, grid and legend; write the PNG (`rect`: the
    part of the figure the axes may fill, the rest kept for a caption)."""
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_xticks(ticks, [str(t) for t in ticks])
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout(rect=rect)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_sweep(summary: list[dict], cap, margin: float, path: Path, why: str | None = None) -> Path:
    """Speedup per width and K against the margin; the recommended cap and, as the caption, why
    (the same sentence the command prints). cap None: no recommendation (interrupted)."""
    import textwrap

    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.6))
    widths = [r["width"] for r in summary]
    for k in sorted({k for r in summary for k in r["spec"]}):
        ax.plot(widths, [r["spec"].get(k, {}).get("speedup", math.nan) for r in summary], marker="o", label=f"K={k}")
    ax.axhline(1.0, color="grey", lw=1)
    ax.axhline(margin, color="grey", ls=":", lw=1, label=f"margin {margin:g}")
    lost = [r for r in summary if r["width"] >= 2 and not r["speedup"] >= margin]
    if lost:  # the first batch width that lost bounds the cap
        ax.plot([lost[0]["width"]], [lost[0]["speedup"]], "x", color="tab:red", ms=12, mew=2,
                label=f"first loss: width {lost[0]['width']}")
    if cap is not None and cap != "off":
        ax.axvline(cap, color="tab:red", ls="--", label=f"recommended cap {cap}")
    head = "no recommendation (interrupted)" if cap is None else f"recommended cap {cap}"
    caption = head + (f": {why}" if why else "")
    fig.text(0.01, 0.01, "\n".join(textwrap.wrap(caption, 110)), fontsize=7, va="bottom")
    ax.set(xlabel="batch width", ylabel="speculative / plain tokens/s", title="speedup vs width")
    return _save(plt, fig, (ax,), widths, path, rect=(0, 0.08, 1, 1))
