"""Scalar-loop benchmark (issue 2): speculative vs plain, coupled vs greedy drafting, gmlx plain
vs mlx-lm stream_generate, fixed draft lengths K and the adaptive K the engine uses. Interleaved repeats, medians, ratios per repeat.

Run: ``python benchmarks/bench_scalar.py --prompts 8 --max-tokens 128 --repeats 3``
Writes bench_results/<utc>_scalar.json and .md.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import gmlx  # noqa: F401  (OpenBLAS before mlx)
import mlx.core as mx
from mlx_lm.generate import stream_generate
from mlx_lm.sample_utils import make_sampler

from gmlx.config import SamplingParams
from gmlx.data import load_prompts
from gmlx.machine import describe
from gmlx.models.cpu_fused import as_mlx_lm
from gmlx.models.loading import load
from gmlx.drafters.select import select_drafter
from gmlx.decode.scalar import ScalarLane
from gmlx.engine.oracle import decode_alone, make_row

from common import command_line, interleave, summarize, write_result
from common import ratio as common_ratio


def run_gmlx(lm, prompt, params, k, coupled=True, adaptive=False):
    """One request through the scalar loop (k > 0) or plain decode (k == 0); decode rate and stats."""
    row = make_row(lm, prompt, params, eos_ids=set())  # fixed-length generations: same work per arm
    drafter = select_drafter(lm, "mtp") if k else None
    decode_alone(ScalarLane(lm.target, drafter, k, coupled=coupled, adaptive=adaptive), row)
    s = row.stats
    return s.num_generated - 1, s.t_end - s.t_first_token, s.num_drafted, s.num_accepted


@as_mlx_lm()  # mlx-lm's own operations (gmlx/models/cpu_fused.py)
def run_mlx_lm(lm, prompt, params):
    sampler = make_sampler(temp=params.temperature, top_p=params.top_p)
    n, t_first, t_end = 0, None, None
    for r in stream_generate(lm.target.model, lm.tokenizer, prompt, max_tokens=params.max_tokens, sampler=sampler):
        n += 1
        t_end = time.perf_counter()
        if t_first is None:
            t_first = t_end
    return n - 1, t_end - t_first, 0, 0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--ks", default="1,2,3,4")
    ap.add_argument("--out", type=Path, default=Path("bench_results"))
    a = ap.parse_args()
    lm = load()
    prompts = [lm.tokenizer.encode(p) for p in load_prompts()[: a.prompts]]
    ks = [int(x) for x in a.ks.split(",")]
    greedy = SamplingParams(max_tokens=a.max_tokens, seed=0)
    hot = SamplingParams(max_tokens=a.max_tokens, temperature=0.8, seed=0)
    arms = {"plain_greedy": lambda p: run_gmlx(lm, p, greedy, 0),
            "mlx_lm_greedy": lambda p: run_mlx_lm(lm, p, greedy),
            "plain_t0.8": lambda p: run_gmlx(lm, p, hot, 0),
            "spec_t0.8_coupled": lambda p: run_gmlx(lm, p, hot, lm.default_k),
            "spec_t0.8_greedy_drafts": lambda p: run_gmlx(lm, p, hot, lm.default_k, coupled=False),
            "spec_greedy_adaptive": lambda p: run_gmlx(lm, p, greedy, lm.default_k, adaptive=True),
            "spec_t0.8_adaptive": lambda p: run_gmlx(lm, p, hot, lm.default_k, adaptive=True)}
    for k in ks:
        arms[f"spec_greedy_k{k}"] = (lambda kk: lambda p: run_gmlx(lm, p, greedy, kk))(k)
    per_rep = interleave(arms, prompts, a.repeats)
    summary = summarize(per_rep)

    def ratio(x, y):
        return common_ratio(per_rep, x, y)

    ratios = {f"spec_greedy_k{k}/plain_greedy": ratio(f"spec_greedy_k{k}", "plain_greedy") for k in ks}
    ratios["spec_t0.8_coupled/plain_t0.8"] = ratio("spec_t0.8_coupled", "plain_t0.8")
    ratios["spec_t0.8_greedy_drafts/plain_t0.8"] = ratio("spec_t0.8_greedy_drafts", "plain_t0.8")
    ratios["plain_greedy/mlx_lm_greedy"] = ratio("plain_greedy", "mlx_lm_greedy")
    ratios["spec_greedy_adaptive/plain_greedy"] = ratio("spec_greedy_adaptive", "plain_greedy")
    ratios["spec_t0.8_adaptive/plain_t0.8"] = ratio("spec_t0.8_adaptive", "plain_t0.8")
    result = {"benchmark": "scalar", "command": command_line("bench_scalar.py", a),
        "machine": describe(), "model": str(lm.path), "default_k": lm.default_k,
        "prompts": a.prompts, "max_tokens": a.max_tokens, "repeats": a.repeats,
        "summary": summary, "ratios_median_of_repeats": ratios, "per_repeat": per_rep}
    write_result(a.out, "scalar", result)
    print(json.dumps({"summary": summary, "ratios": ratios}, indent=2))
    mx.clear_cache()


if __name__ == "__main__":
    main()
