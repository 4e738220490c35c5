"""Host cost of a decode round: gmlx against mlx-lm where compute is nearly free, side by side.

A micro model (random llama, 2 layers, d=64, the embedded tokenizer; built here) computes almost
nothing, so its decode speed is the engine's host cost per round; the embedded model shows the
same arms where compute matters. Arms, interleaved in one run (medians of per-repeat ratios):

  width 1     gmlx plain (Engine, engine thread, read from its stream) vs mlx-lm stream_generate
  width W     gmlx plain batch vs mlx-lm BatchGenerator (W requests submitted together)
  speculation gmlx scalar speculative vs gmlx plain (micro: the target as its own draft model,
              so every draft is accepted and the ratio is the host's ceiling; embedded: its MTP head;
              smollm2-f32 / smollm2-q: the shipped EAGLE-3 head drafting K = 3 every round, on
              held-out code questions in the chat template: a speculative round's own costs)

Every arm is timed as its consumer sees tokens: from the first token to the last (prefill and
the first token excluded), greedy, EOS ignored, fixed length. Then a per-round breakdown of the
engine's host time in microseconds (gmlx.trace), one traced run per gmlx arm.

Run: ``python benchmarks/bench_host.py --tokens 256 --repeats 5``
Writes bench_results/<utc>_host.json.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import gmlx  # noqa: F401  (OpenBLAS before mlx)
from mlx_lm import stream_generate
from mlx_lm.generate import BatchGenerator
from mlx_lm.sample_utils import make_sampler

from gmlx import Engine, EngineConfig, SamplingParams
from gmlx.data import load_prompts
from gmlx import trace
from gmlx.machine import describe
from gmlx.models.cpu_fused import as_mlx_lm
from gmlx.models.loading import load
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the micro model, shared with the tests
from micro import make_micro_model  # noqa: E402

from common import command_line, write_result


def consumer_rate(times: list[float]) -> float:
    """Tokens per second from the first token the consumer saw to the last."""
    return (len(times) - 1) / (times[-1] - times[0]) if len(times) > 1 and times[-1] > times[0] else 0.0


def gmlx_streams(eng: Engine, prompts: list[list[int]], n: int) -> float:
    """Submit every prompt at once; read the streams as a consumer would (in turn: the last stream
    is read as its tokens arrive, so the last time stamp is when the last token came out)."""
    params = SamplingParams(max_tokens=n, seed=0, ignore_eos=True)
    streams = [eng.submit(p, params) for p in prompts]
    first, last, count = None, None, 0
    for s in streams:
        for _ in s:
            now = time.perf_counter()
            first = now if first is None else first
            last, count = now, count + 1
    return (count - len(prompts)) / (last - first) if last > first else 0.0


@as_mlx_lm()  # mlx-lm's own operations (gmlx/models/cpu_fused.py)
def mlx_stream(lm, prompt: list[int], n: int) -> float:
    times = [time.perf_counter() for _ in stream_generate(lm.target.model, lm.tokenizer, prompt, max_tokens=n,
                                                         sampler=make_sampler(0.0))]
    return consumer_rate(times)


@as_mlx_lm()  # mlx-lm's own operations (gmlx/models/cpu_fused.py)
def mlx_batch(lm, prompts: list[list[int]], n: int) -> float:
    gen = BatchGenerator(lm.target.model, stop_tokens=None, completion_batch_size=len(prompts),
                         prefill_batch_size=min(len(prompts), 8))
    gen.insert(prompts, max_tokens=[n] * len(prompts))
    first, last, count, done = None, None, 0, 0
    while done < len(prompts):
        got = gen.next_generated()
        now = time.perf_counter()
        first = now if first is None else first
        last, count = now, count + len(got)
        done += sum(r.finish_reason is not None for r in got)
    gen.close()
    return (count - len(prompts)) / (last - first) if last > first else 0.0


def model_for(name: str, tmp: Path):
    """(model, draft model, prompts) for a --models name."""
    if name == "micro":
        lm = load(make_micro_model(tmp / "micro"), drafter=False)
        return lm, lm, [lm.tokenizer.encode(p) for p in load_prompts()[:16]]  # the target drafts for itself
    if name.startswith("smollm2"):
        from gmlx.gguf.smollm2 import converted
        from bench_matrix import CODE_ASKS

        lm = load(converted("float32" if name == "smollm2-f32" else "q"))
        chat = [list(lm.tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True))
                for q in CODE_ASKS]
        return lm, None, chat * 4
    lm = load()
    return lm, None, [lm.tokenizer.encode(p) for p in load_prompts()[:16]]


def arms_for(name: str, lm, draft_model, prompts: list[list[int]], widths: list[int], n: int) -> dict:
    plain = Engine(lm, EngineConfig(speculative=False))
    spec = Engine(lm, EngineConfig(num_draft_tokens=3) if name.startswith("smollm2") else EngineConfig(),
                  draft_model=draft_model)
    arms = {f"{name}/w1/gmlx_plain": lambda: gmlx_streams(plain, prompts[:1], n),
            f"{name}/w1/mlx_lm_stream": lambda: mlx_stream(lm, prompts[0], n),
            f"{name}/w1/gmlx_spec": lambda: gmlx_streams(spec, prompts[:1], n)}
    for w in widths:
        ps = [prompts[i % len(prompts)] for i in range(w)]
        arms[f"{name}/w{w}/gmlx_plain"] = (lambda ps=ps: gmlx_streams(plain, ps, n))
        arms[f"{name}/w{w}/mlx_lm_batch"] = (lambda ps=ps: mlx_batch(lm, ps, n))
    return {"arms": arms, "engines": {"plain": plain, "spec": spec}}


def interleaved(arms: dict, repeats: int) -> dict[str, list[float]]:
    for fn in arms.values():  # warm up: kernels, allocator caches, the engine threads
        fn()
    out: dict[str, list[float]] = {k: [] for k in arms}
    for rep in range(repeats):
        for name in (list(arms) if rep % 2 == 0 else list(reversed(arms))):
            out[name].append(arms[name]())
        print(f"rep {rep}: " + "  ".join(f"{k.split('/', 1)[1]} {v[-1]:.0f}" for k, v in out.items()), flush=True)
    return out


def ratio(reps: dict, a: str, b: str) -> float:
    return statistics.median(x / y for x, y in zip(reps[a], reps[b]))


def breakdown(eng: Engine, prompts: list[list[int]], n: int) -> dict:
    """One traced run: mean host microseconds per round, by phase."""
    with trace.recording() as rec:
        gmlx_streams(eng, prompts, n)
    return rec.summary()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--widths", default="4,16")
    ap.add_argument("--models", default="micro,embedded")
    ap.add_argument("--out", default="bench_results")
    args = ap.parse_args()
    widths = [int(w) for w in args.widths.split(",") if w]
    result = {"machine": describe(), "command": command_line("bench_host.py", args), "models": {}}
    tmp = Path(tempfile.mkdtemp(prefix="gmlx-micro-"))
    for name in args.models.split(","):
        lm, draft, prompts = model_for(name, tmp)
        built = arms_for(name, lm, draft, prompts, widths, args.tokens)
        reps = interleaved(built["arms"], args.repeats)
        ratios = {"w1 gmlx_plain / mlx_lm_stream": ratio(reps, f"{name}/w1/gmlx_plain", f"{name}/w1/mlx_lm_stream"),
                  "w1 gmlx_spec / gmlx_plain": ratio(reps, f"{name}/w1/gmlx_spec", f"{name}/w1/gmlx_plain")}
        for w in widths:
            ratios[f"w{w} gmlx_plain / mlx_lm_batch"] = ratio(reps, f"{name}/w{w}/gmlx_plain", f"{name}/w{w}/mlx_lm_batch")
        engines = built["engines"]
        result["models"][name] = {
            "tok_s_median": {k.split("/", 1)[1]: statistics.median(v) for k, v in reps.items()},
            "tok_s": {k.split("/", 1)[1]: v for k, v in reps.items()},
            "ratios": ratios,
            "breakdown_us_per_round": {"w1 plain": breakdown(engines["plain"], prompts[:1], args.tokens),
                                       "w1 spec": breakdown(engines["spec"], prompts[:1], args.tokens),
                                       f"w{widths[-1]} plain": breakdown(engines["plain"], prompts[:widths[-1]],
                                                                         args.tokens)},
        }
        for eng in engines.values():
            eng.close()
        for k, v in ratios.items():
            print(f"{name}: {k} = {v:.3f}")
    print("wrote", write_result(Path(args.out), "host", result))


if __name__ == "__main__":
    main()
