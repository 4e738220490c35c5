"""Draft-model benchmark (issue 6): gmlx with a draft model vs mlx-lm's speculative_generate_step
with the same draft model, same prompts, interleaved; tokens/s and acceptance at greedy and
T = 0.8. Plain decode of both is measured alongside as the reference.

Both sides generate exactly --max-tokens per prompt (EOS ignored) with the same number of draft
tokens per round. mlx-lm drafts K every round (greedy drafts when T = 0, drafts sampled from the
draft model's own noise when T > 0); gmlx's scalar loop drafts up to K (adaptive) with the
target's noise (coupled). Acceptance = accepted drafts / drafted; mlx-lm's drafted count is
rounds x K, where a round ends at each token not from the draft.

Run: ``python benchmarks/bench_draft.py --draft-model gmlx/weights/default_model/draft``
Writes bench_results/<utc>_draft.json.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import gmlx  # noqa: F401  (OpenBLAS before mlx)
import mlx.core as mx
from mlx_lm.generate import generate_step, speculative_generate_step
from mlx_lm.sample_utils import make_sampler

from gmlx import Engine, EngineConfig, SamplingParams
from gmlx.data import load_prompts
from gmlx.machine import describe
from gmlx.models.cpu_fused import as_mlx_lm
from gmlx.models.loading import default_model_path, load

from common import command_line, interleave, summarize, write_result
from common import ratio as common_ratio


def run_gmlx(engine: Engine, prompt: list[int], params: SamplingParams):
    rec = engine.generate(prompt, params)
    s, n = rec.stats, len(rec.tokens) - 1  # decode rate after the first token, as mlx-lm's side
    return n, n / s["tokens_per_s"], s["num_drafted"], s["num_accepted"]


@as_mlx_lm()  # mlx-lm's own operations (gmlx/models/cpu_fused.py)
def run_mlx_lm(lm, draft, prompt: list[int], params: SamplingParams, k: int | None):
    sampler = make_sampler(temp=params.temperature, top_p=params.top_p)
    p = mx.array(prompt, dtype=mx.int32)
    if k:
        it = speculative_generate_step(p, lm.target.model, draft.target.model, num_draft_tokens=k,
                                       max_tokens=params.max_tokens, sampler=sampler)
    else:
        it = generate_step(p, lm.target.model, max_tokens=params.max_tokens, sampler=sampler)
    n, from_draft, rounds, t_first = 0, 0, 0, None
    for item in it:
        n += 1
        if n == 1:
            t_first = time.perf_counter()
        if k:
            from_draft += bool(item[2])
            rounds += not item[2]
    t_end = time.perf_counter()
    return n - 1, t_end - t_first, rounds * (k or 0), from_draft


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--draft-model", type=Path, default=default_model_path() / "draft")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--out", type=Path, default=Path("bench_results"))
    a = ap.parse_args()
    lm, draft = load(), load(a.draft_model)
    prompts = [lm.tokenizer.encode(p) for p in load_prompts()[: a.prompts]]
    spec = Engine(lm, EngineConfig(drafter="draft", num_draft_tokens=a.k, prompt_cache_bytes=0), draft_model=draft)
    plain = Engine(lm, EngineConfig(speculative=False, prompt_cache_bytes=0))
    arms = {}
    for name, temp in (("greedy", 0.0), ("t0.8", 0.8)):
        params = SamplingParams(max_tokens=a.max_tokens, temperature=temp, seed=0, ignore_eos=True)
        arms[f"gmlx_draft_{name}"] = (lambda pp: lambda p: run_gmlx(spec, p, pp))(params)
        arms[f"mlx_lm_draft_{name}"] = (lambda pp: lambda p: run_mlx_lm(lm, draft, p, pp, a.k))(params)
        arms[f"gmlx_plain_{name}"] = (lambda pp: lambda p: run_gmlx(plain, p, pp))(params)
        arms[f"mlx_lm_plain_{name}"] = (lambda pp: lambda p: run_mlx_lm(lm, draft, p, pp, None))(params)
    per_rep = interleave(arms, prompts, a.repeats)
    summary = summarize(per_rep)

    def ratio(x, y):
        return common_ratio(per_rep, x, y)

    ratios = {}
    for t in ("greedy", "t0.8"):
        ratios[f"gmlx_draft_{t}/mlx_lm_draft_{t}"] = ratio(f"gmlx_draft_{t}", f"mlx_lm_draft_{t}")
        ratios[f"gmlx_draft_{t}/gmlx_plain_{t}"] = ratio(f"gmlx_draft_{t}", f"gmlx_plain_{t}")
        ratios[f"mlx_lm_draft_{t}/mlx_lm_plain_{t}"] = ratio(f"mlx_lm_draft_{t}", f"mlx_lm_plain_{t}")
    result = {"benchmark": "draft-model", "command": command_line("bench_draft.py", a),
        "machine": describe(), "model": str(lm.path), "draft_model": str(draft.path), "k": a.k,
        "prompts": a.prompts, "max_tokens": a.max_tokens, "repeats": a.repeats,
        "summary": summary, "ratios_median_of_repeats": ratios, "per_repeat": per_rep}
    write_result(a.out, "draft", result)
    print(json.dumps({"summary": summary, "ratios": ratios}, indent=2))
    spec.close()
    plain.close()


if __name__ == "__main__":
    main()
