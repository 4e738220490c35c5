"""Quantized targets: speculative vs plain on the embedded model converted by mlx-lm (4 and 8 bits).

The model is converted here (`mlx_lm.convert -q`, its MTP head files copied beside it, as users do),
then one request at a time, greedy, EOS ignored, fixed length, timed as its consumer sees tokens
(first token to last). Arms, interleaved in one run (medians of per-repeat ratios to plain):

  plain          Engine(speculative=False): one decode step per token, on the path the target
                 measured faster at load (quantized kernels or the dequantized twin)
  plain_q        the same with GMLX_DEQUANTIZED_DECODE=0: quantized one-token steps (mlx-lm's kernels)
  auto           Engine(): the engine's own choice for a lone request (cost model on the measured
                 round costs: speculate, or decode plain when speculation cannot pay)
  spec_twin      Engine(num_draft_tokens=K): always speculate; verify through the dequantized twin
  spec_no_twin   the same with GMLX_DEQUANTIZED_VERIFY=0 at load: verify through the quantized matmul
  mlx_lm         mlx-lm's stream_generate on the quantized model

Run: ``python benchmarks/bench_quantized.py --bits 4,8 --tokens 200 --repeats 3``
Writes bench_results/<utc>_quantized.json.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
from pathlib import Path

import gmlx  # noqa: F401  (OpenBLAS before mlx)
from mlx_lm import convert

from bench_host import consumer_rate, mlx_stream
from common import command_line, write_result
from gmlx import Engine, EngineConfig, SamplingParams
from gmlx.data import load_prompts
from gmlx.machine import describe
from gmlx.models.loading import default_model_path, load


def quantize(bits: int, root: Path) -> Path:
    out = root / f"q{bits}"
    convert(str(default_model_path()), mlx_path=str(out), quantize=True, q_bits=bits, q_group_size=64)
    for f in ("mtp_config.json", "mtp_head.safetensors"):
        shutil.copy(default_model_path() / f, out / f)
    return out


def one_request(eng: Engine, prompt: list[int], n: int) -> tuple[float, int, int]:
    """(consumer tokens/s, drafted, accepted) for one request read as it streams."""
    import time

    stream = eng.submit(prompt, SamplingParams(max_tokens=n, seed=0, ignore_eos=True))
    times = [time.perf_counter() for _ in stream]
    s = stream.result.stats
    return consumer_rate(times), s["num_drafted"], s["num_accepted"]


def load_with(path: Path, var: str, value: str):
    os.environ[var] = value
    try:
        return load(path)
    finally:
        del os.environ[var]


def bench_bits(path: Path, prompts: list[list[int]], n: int, repeats: int, k: int) -> dict:
    lm = load(path)
    lm_q_steps = load_with(path, "GMLX_DEQUANTIZED_DECODE", "0")
    lm_no_twin = load_with(path, "GMLX_DEQUANTIZED_VERIFY", "0")
    engines = {"plain": Engine(lm, EngineConfig(speculative=False)),
               "plain_q": Engine(lm_q_steps, EngineConfig(speculative=False)), "auto": Engine(lm, EngineConfig()),
               "spec_twin": Engine(lm, EngineConfig(num_draft_tokens=k)),
               "spec_no_twin": Engine(lm_no_twin, EngineConfig(num_draft_tokens=k))}
    arms = {name: (lambda p, e=e: one_request(e, p, n)) for name, e in engines.items()}
    arms["mlx_lm"] = lambda p: (mlx_stream(lm, p, n), 0, 0)
    for fn in arms.values():  # warm up
        fn(prompts[0])
    reps: dict[str, list[dict]] = {a: [] for a in arms}
    for rep in range(repeats):
        for name in (list(arms) if rep % 2 == 0 else list(reversed(arms))):
            runs = [arms[name](p) for p in prompts]
            reps[name].append({"tok_s": statistics.median(r[0] for r in runs), "drafted": sum(r[1] for r in runs),
                               "accepted": sum(r[2] for r in runs)})
        print(f"rep {rep}: " + "  ".join(f"{a} {v[-1]['tok_s']:.0f}" for a, v in reps.items()), flush=True)
    lone = engines["auto"].scalar
    out = {"tok_s_median": {a: statistics.median(r["tok_s"] for r in v) for a, v in reps.items()},
           "vs_plain": {a: statistics.median(x["tok_s"] / y["tok_s"] for x, y in zip(v, reps["plain"]))
                        for a, v in reps.items()},
           "acceptance": {a: (sum(r["accepted"] for r in v) / d if (d := sum(r["drafted"] for r in v)) else None)
                          for a, v in reps.items()},
           "auto_round_costs": repr(lone.round_costs()), "k": k, "decode_on_twin": lm.target.decode_on_twin,
           "reps": reps}
    for e in engines.values():
        e.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bits", default="4,8")
    ap.add_argument("--tokens", type=int, default=200)
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--out", default="bench_results")
    args = ap.parse_args()
    result = {"machine": describe(), "command": command_line("bench_quantized.py", args), "models": {}}
    root = Path(tempfile.mkdtemp(prefix="gmlx-q-"))
    for bits in (int(b) for b in args.bits.split(",")):
        path = quantize(bits, root)
        prompts = [load(path, drafter=False).tokenizer.encode(p) for p in load_prompts()[:args.prompts]]
        r = result["models"][f"q{bits}"] = bench_bits(path, prompts, args.tokens, args.repeats, args.k)
        print(f"q{bits}: " + "  ".join(f"{a}/plain {v:.3f}" for a, v in r["vs_plain"].items()), flush=True)
    shutil.rmtree(root, ignore_errors=True)
    print("wrote", write_result(Path(args.out), "quantized", result))


if __name__ == "__main__":
    main()
