"""gmlx's small-M sgemm (gmlx/native/small_gemm.c; docs/cpu_kernel.md) against OpenBLAS alone, side
by side: each setting runs in its own process (the kernel is chosen at `import gmlx`:
GMLX_SMALL_GEMM=1 / 0), the two alternating, `--repeats` times.

Parts (`--parts`):
- matmul: a pass of `x @ W.T` over 60 float32 576 x 1536 weights (SmolLM2's MLP shape, 212 MB, more
  than the caches hold) for each row count; the median of 15 passes, ms.
- forward: SmolLM2-135M's forward of T tokens after a 200-token prompt (float32), the median of 12, ms.
- smollm2: `bench_smollm2.py` (plain and the shipped head at width 1, code and chat prompts, greedy,
  float32 and 4-bit), tok/s per arm and the head's speedup over plain in the same process.

`--against REV`: two more settings, git revision REV's gmlx with and without its kernel (its tree
checked out in a temporary worktree, whose gmlx the child processes import): a change to the kernel,
or to how OpenBLAS is loaded, beside what was there before, alternating in the same run.

Run: ``python benchmarks/bench_cpu_kernel.py --repeats 2`` (--parts matmul,forward,smollm2; --smollm2-args
passes bench_smollm2.py's options). Writes bench_results/<utc>_cpu_kernel.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROWS = (1, 2, 3, 4, 6, 8, 12, 16, 32)
TOKENS = (1, 2, 3, 4, 8, 12, 16, 32, 128)

MATMUL = """
import gmlx, json, sys, time, numpy as np, mlx.core as mx
from gmlx import blas
rng = np.random.default_rng(0)
ws = [mx.array((rng.standard_normal((1536, 576)) * 0.02).astype(np.float32)) for _ in range(60)]
mx.eval(ws)  # sync: setup
out = {}
for m in json.loads(sys.argv[1]):
    x = mx.array(rng.standard_normal((m, 576)).astype(np.float32))
    ts = []
    for _ in range(15):
        t = time.perf_counter()
        mx.eval([x @ w.T for w in ws])  # sync: the timed pass
        ts.append(time.perf_counter() - t)
    out[m] = 1e3 * float(np.median(ts))
print(json.dumps({"blas": blas.active_blas(), "ms": out}))
"""

FORWARD = """
import gmlx, json, sys, time, numpy as np, mlx.core as mx
from gmlx import blas
from gmlx.gguf.smollm2 import converted
from gmlx.models.loading import load
from mlx_lm.models.cache import make_prompt_cache
model = load(converted("float32")).target
model = getattr(model, "model", model)
cache = make_prompt_cache(model)
mx.eval(model(mx.array([list(range(100, 300))]), cache=cache))  # sync: the prompt
out = {}
for t_ in json.loads(sys.argv[1]):
    ts = []
    for _ in range(12):
        t = time.perf_counter()
        mx.eval(model(mx.array([[5] * t_]), cache=cache))  # sync: the timed forward
        ts.append(time.perf_counter() - t)
        for c in cache:
            c.trim(t_)
    out[t_] = 1e3 * float(np.median(ts))
print(json.dumps({"blas": blas.active_blas(), "ms": out}))
"""


def users_environment() -> dict:
    """This environment without what gmlx set for OpenBLAS here: each child's gmlx (this tree's or
    --against's) chooses for itself, as in a user's process."""
    from gmlx import blas

    return {k: v for k, v in os.environ.items() if k not in blas.variables_set()}


def child(code: str, arg: str, kernel: bool, root: Path = HERE.parent) -> dict:
    """`code` in a process of its own, importing the gmlx of `root` (this tree, or --against's)."""
    env = {**users_environment(), "GMLX_SMALL_GEMM": "1" if kernel else "0",
           "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", code, arg], env=env, capture_output=True, text=True, check=True,
                         cwd=root)  # (`-c` puts the working directory first on sys.path)
    return json.loads(out.stdout.strip().splitlines()[-1])


def smollm2(args: str, kernel: bool, root: Path = HERE.parent) -> dict:
    """bench_smollm2.py in a process of its own: per cell and prompt kind, plain's and the head's
    tok/s, the head's speedup in that process, and whether every stream was plain's tokens."""
    with tempfile.TemporaryDirectory() as tmp:
        env = {**users_environment(), "GMLX_SMALL_GEMM": "1" if kernel else "0",
               "PYTHONPATH": os.pathsep.join([str(root), str(root / "benchmarks"), os.environ.get("PYTHONPATH", "")])}
        subprocess.run([sys.executable, str(root / "benchmarks" / "bench_smollm2.py"), *args.split(), "--out", tmp],
                       env=env, check=True, capture_output=True, text=True, cwd=root)
        result = json.loads(next(Path(tmp).glob("*_smollm2.json")).read_text())
    cells = {}
    for name, cell in result["cells"].items():
        for kind in ("code", "chat"):
            s = cell["summary"][kind]
            cells[f"{name}/{kind}"] = {arm: {"tok_s": v["tok_s_median"], "speedup": v["speedup_vs_plain"],
                                             "same_tokens": v["same_tokens_as_plain"]} for arm, v in s.items()}
    return {"blas": result["machine"]["blas"], "cells": cells}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--parts", default="matmul,forward,smollm2")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--smollm2-args", default="--dtypes float32,q --temps 0 --arms plain,mtp --max-tokens 64 "
                                              "--repeats 1 --code 2 --chat 2")
    ap.add_argument("--against", metavar="REV", help="also the kernel of this git revision (a temporary worktree)")
    ap.add_argument("--out", type=Path, default=Path("bench_results"))
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        settings = [("openblas", False, HERE.parent), ("kernel", True, HERE.parent)]
        if a.against:
            subprocess.run(["git", "-C", str(HERE.parent), "worktree", "add", "--detach", tmp, a.against], check=True)
            settings += [(f"openblas@{a.against}", False, Path(tmp)), (f"kernel@{a.against}", True, Path(tmp))]
        try:
            run(a, settings)
        finally:
            if a.against:
                subprocess.run(["git", "-C", str(HERE.parent), "worktree", "remove", "--force", tmp], check=False)


def run(a: argparse.Namespace, settings: list[tuple[str, bool, Path]]) -> None:
    sys.path.insert(0, str(HERE.parent))
    sys.path.insert(0, str(HERE))
    import gmlx  # noqa: F401  (OpenBLAS before mlx)
    from gmlx.machine import describe
    from common import command_line, write_result

    runs: dict[str, list] = {}
    for rep in range(a.repeats):
        for tag, kernel, root in settings if rep % 2 == 0 else settings[::-1]:  # alternating order
            for part in a.parts.split(","):
                got = (child(MATMUL, json.dumps(ROWS), kernel, root) if part == "matmul" else
                       child(FORWARD, json.dumps(TOKENS), kernel, root) if part == "forward" else
                       smollm2(a.smollm2_args, kernel, root))
                runs.setdefault(f"{part}/{tag}", []).append(got)
                print(part, tag, json.dumps(got), flush=True)
    summary = {}
    for key, got in runs.items():
        part = key.split("/")[0]
        if part in ("matmul", "forward"):
            summary[key] = {n: statistics.median(g["ms"][n] for g in got) for n in got[0]["ms"]}
        else:
            summary[key] = {cell: {arm: {f: statistics.median(g["cells"][cell][arm][f] for g in got)
                                         for f in ("tok_s", "speedup", "same_tokens")}
                                   for arm in arms} for cell, arms in got[0]["cells"].items()}
    result = {"benchmark": "cpu_kernel", "command": command_line("bench_cpu_kernel.py", a), "machine": describe(),
              "summary": summary, "runs": runs}
    print(json.dumps(summary, indent=1))
    print(f"wrote {write_result(a.out, 'cpu_kernel', result)}")


if __name__ == "__main__":
    main()
