"""What rolling back a hybrid target's recurrent state costs (issue 21), and what a hybrid target
then gains with a drafter that agrees.

1. verify: a verify forward of k+1 tokens at width W (k = 1..4, W = 1..8) on a tiny hybrid
   (Qwen3-Next layout: 6 Gated DeltaNet layers + 2 attention layers, random weights; and the
   same in the Qwen3.5 layout), after a 64-token context, with
   - base: mlx-lm's ArraysCache in the recurrent layers (mlx-lm's own forward: nothing kept, no
     rollback possible) and the ragged KV trimmed per row, and
   - capture: gmlx's RecurrentCache (the capture forward, gmlx/recurrent.py) and every layer
     trimmed per row, rows keeping different counts (row b rejects (b + 1) mod (k + 1): the
     per-row gather runs whenever W > 1) -- the whole price of an exact rollback.
   Arms interleaved in every repeat; the figure is the median over repeats of capture / base,
   each repeat the mean of a few calls per arm.
2. scalar loop: the same target with its MTP head whose drafts are replaced by the target's own
   greedy stream (a drafter that always agrees; the head still runs, so a draft step costs one
   head step), k = 1..4, against plain decoding, interleaved; achieved speedup next to the
   ideal the cost model predicts from the probe's measured costs (gmlx/decode/probe.py, which
   times verify forwards on the target's own caches, capture included; run once in every repeat,
   the median of its figures): ideal = (k + 1) / (verify[k] + k * draft). Prompts interleave the
   arms one by one, the order alternating; speedup = median over repeats of spec / plain.
3. batch loop: W = 2, 4 requests together (cap 0, k = 3), each row's drafts its own greedy stream
   (the MTP head running per row), against the same requests plain; decode tokens/s after the
   first step; ideal from the probe's costs at that width.

Run:  python benchmarks/bench_hybrid.py
Writes bench_results/<utc>_hybrid.json and .md (machine from gmlx.machine.describe()).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import gmlx  # noqa: F401  (OpenBLAS before mlx)
import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten
from mlx_lm.models.cache import ArraysCache

from gmlx import Engine, EngineConfig
from gmlx.config import SamplingParams, Switches
from gmlx.drafters.mtp import MTPDrafter
from gmlx.engine.metrics import EventKind
from gmlx.models.forward import prefill
from gmlx.decode.probe import measure
from gmlx.decode.scalar import ScalarLane
from gmlx.kv import RaggedKVCache
from gmlx.model_cache import make_ragged_cache, trim_rows
from gmlx.machine import describe
from gmlx.models.loading import default_model_path, load
from gmlx.recurrent import RecurrentCache
from gmlx.engine.oracle import decode_alone, make_row

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the scripted drafter, shared with the tests
from doubles import ScriptedDrafter  # noqa: E402
from common import command_line, write_result  # noqa: E402

VOCAB = 2048  # the embedded model's tokenizer
QN = {"model_type": "qwen3_next", "hidden_size": 512, "num_hidden_layers": 8, "intermediate_size": 1024,
      "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 64, "linear_num_value_heads": 8,
      "linear_num_key_heads": 4, "linear_key_head_dim": 64, "linear_value_head_dim": 64, "linear_conv_kernel_dim": 4,
      "num_experts": 0, "num_experts_per_tok": 0, "decoder_sparse_step": 1, "shared_expert_intermediate_size": 0,
      "mlp_only_layers": [], "moe_intermediate_size": 0, "rms_norm_eps": 1e-6, "vocab_size": VOCAB,
      "rope_theta": 10000.0, "partial_rotary_factor": 0.25, "max_position_embeddings": 4096,
      "full_attention_interval": 4, "tie_word_embeddings": False, "num_nextn_predict_layers": 1}
Q35_TEXT = {k: v for k, v in QN.items() if k not in ("model_type", "num_experts", "num_experts_per_tok",
                                                      "decoder_sparse_step", "shared_expert_intermediate_size",
                                                      "mlp_only_layers", "moe_intermediate_size", "rope_theta",
                                                      "partial_rotary_factor", "num_nextn_predict_layers")}
Q35_TEXT.update(model_type="qwen3_5_text", mtp_num_hidden_layers=1,
                rope_parameters={"type": "default", "mrope_section": [4, 4, 8], "rope_theta": 10000.0,
                                 "partial_rotary_factor": 0.25})
FAMILIES = {"qwen3_next": QN, "qwen3_5": {"model_type": "qwen3_5", "text_config": Q35_TEXT}}


def _random(module, seed: int) -> dict:
    flat = {}
    for i, (k, v) in enumerate(tree_flatten(module.parameters())):
        r = mx.random.normal(v.shape, key=mx.random.key(seed * 1009 + i))
        flat[k] = (1.0 + 0.1 * r) if k.endswith("norm.weight") else (0.05 * r if v.ndim > 1 else 0.1 * r)
    return flat


def write_checkpoint(path: Path, family: str, seed: int = 0) -> Path:
    """A tiny hybrid with a native MTP head, in mlx-lm's names (the head's tensors apart, as a
    dense checkpoint keeps them out of mlx-lm's strict load)."""
    from mlx_lm.models import qwen3_5, qwen3_next

    config = FAMILIES[family]
    mod = qwen3_next if family == "qwen3_next" else qwen3_5
    model = mod.Model(mod.ModelArgs.from_dict(config))
    path.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(path / "model.safetensors"), _random(model, seed))
    args = model.args if family == "qwen3_next" else model.language_model.args
    layer = (qwen3_next.Qwen3NextDecoderLayer(args, 3) if family == "qwen3_next" else qwen3_5.DecoderLayer(args, 3))
    d = int(args.hidden_size)
    head = {f"mtp.layers.0.{k}": v for k, v in _random(layer, seed + 1).items()}
    for i, name in enumerate(("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm")):
        head[f"mtp.{name}.weight"] = 1.0 + 0.1 * mx.random.normal((d,), key=mx.random.key(seed + 10 + i))
    head["mtp.fc.weight"] = 0.05 * mx.random.normal((d, 2 * d), key=mx.random.key(seed + 20))
    mx.save_safetensors(str(path / "mtp.safetensors"), head)
    (path / "config.json").write_text(json.dumps({"eos_token_id": 0, **config}))
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(default_model_path() / f, path / f)
    return path


# -- 1. the verify forward with and without capture -------------------------------------------
def _caches(target, width: int, context: list[int], capture: bool) -> list:
    cache = make_ragged_cache(target.model, width)
    prefill(target, cache, [context] * width, 512, want_hidden=False)
    if capture:
        return cache
    out = []
    for c in cache:
        if isinstance(c, RecurrentCache):
            a = ArraysCache(len(c.cache))
            a.cache = list(c.cache)
            out.append(a)
        else:
            out.append(c)
    return out


def verify_overhead(target, widths, ks, reps: int, inner: int) -> list[dict]:
    context = [(7 * i + 3) % VOCAB for i in range(64)]
    rows = []
    for w in widths:
        base_c, ours_c = _caches(target, w, context, False), _caches(target, w, context, True)
        mx.eval([c.state for c in base_c + ours_c])  # sync: the context, before timing
        pre = [list(c.cache) if isinstance(c, ArraysCache) else None for c in base_c]
        for k in ks:
            x = mx.array([[(11 * j + 5) % VOCAB for j in range(k + 1)]] * w, dtype=mx.int32)
            ns = np.array([(b + 1) % (k + 1) for b in range(w)])

            def base():
                logits, h = target(x, base_c)
                mx.eval(logits, h, [c.state for c in base_c])  # sync: the timed forward
                trim_rows([c for c in base_c if isinstance(c, RaggedKVCache)], ns)
                t = time.perf_counter(), time.process_time()
                for c, p in zip(base_c, pre):  # untimed: put the pre-round state back
                    if p is not None:
                        c.cache = list(p)
                trim_rows([c for c in base_c if isinstance(c, RaggedKVCache)], k + 1 - ns)
                return t

            def ours():
                logits, h = target(x, ours_c)
                mx.eval(logits, h)  # sync: the timed forward
                trim_rows(ours_c, ns)
                mx.eval([c.state for c in ours_c])  # sync: the rolled-back state
                t = time.perf_counter(), time.process_time()
                trim_rows(ours_c, k + 1 - ns)  # untimed: back to the context
                mx.eval([c.state for c in ours_c])
                return t

            def timed(fn):
                wall = cpu = 0.0
                for _ in range(inner):
                    t0, c0 = time.perf_counter(), time.process_time()
                    t1, c1 = fn()  # the end of the timed part (the state's restoring is not timed)
                    wall += t1 - t0
                    cpu += max(c1 - c0, 0.0)
                return wall / inner, cpu / inner

            timed(base), timed(ours)  # warm-up
            got = {base: [], ours: []}
            for r in range(reps):
                for f in ((base, ours) if r % 2 == 0 else (ours, base)):
                    got[f].append(timed(f))
            bw, bc = zip(*got[base])
            ow, oc = zip(*got[ours])
            ratio = statistics.median(o / b for o, b in zip(ow, bw))
            row = {"width": w, "k": k, "base_ms": 1e3 * statistics.median(bw), "capture_ms": 1e3 * statistics.median(ow),
                   "capture_over_base": ratio, "added_pct": 100 * (ratio - 1),
                   "added_pct_fastest": 100 * (min(ow) / min(bw) - 1),
                   "added_pct_cpu": 100 * (statistics.median(oc) / statistics.median(bc) - 1)}
            print(f"W={w} k={k}: base {row['base_ms']:.2f} ms capture {row['capture_ms']:.2f} ms: added "
                  f"{row['added_pct']:+.1f} % (median of paired ratios), {row['added_pct_fastest']:+.1f} % (fastest),"
                  f" {row['added_pct_cpu']:+.1f} % (process CPU time)", flush=True)
            rows.append(row)
    return rows


# -- 2. the scalar loop with a drafter that agrees -------------------------------------------
def agreeing_speedups(lm, ks, reps: int, prompts: list[list[int]], max_tokens: int) -> list[dict]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, seed=0)
    refs = {}
    for p in prompts:
        row = decode_alone(ScalarLane(lm.target, None, 1), make_row(lm, p, params, eos_ids=set()))
        refs[tuple(p)] = row.tokens

    def run(k: int, p: list[int]) -> tuple[int, float]:
        ref = refs[tuple(p)]
        script = (lambda pr, rf: lambda pos, kk: (rf[pos - len(pr): pos - len(pr) + kk] + [0] * kk)[:kk])(p, ref)
        drafter = ScriptedDrafter(lm.head, lm.target, script) if k else None
        row = decode_alone(ScalarLane(lm.target, drafter, k, adaptive=False, may_go_plain=False),
                           make_row(lm, p, params, eos_ids=set()))
        assert row.tokens == ref, "an agreeing drafter changed the stream"
        return row.stats.num_generated - 1, row.stats.t_end - row.stats.t_first_token

    arms = [0] + list(ks)
    for k in arms:  # warm-up
        run(k, prompts[0])
    per = {k: [] for k in arms}  # per repeat: tokens/s over all prompts
    probes = []
    for r in range(reps):
        tot = {k: [0, 0.0] for k in arms}
        for i, p in enumerate(prompts):  # arms interleaved prompt by prompt, the order alternating
            for k in (arms if (r + i) % 2 == 0 else arms[::-1]):
                n, dt = run(k, p)
                tot[k][0] += n
                tot[k][1] += dt
        for k in arms:
            per[k].append(tot[k][0] / tot[k][1])
        # the cost model's figures, measured by the engine's own probe in every repeat (it keeps the
        # fastest of its interleaved turns); the ideal below takes their median over repeats
        probes.append(measure(lm.target, ScriptedDrafter(lm.head, lm.target, lambda pos, kk: [0] * kk), max(ks)))
    out = []
    for k in ks:
        verify = statistics.median(c.verify_cost(k) for c in probes)
        draft = statistics.median(c.draft for c in probes)
        ideal = (k + 1) / (verify + k * draft)
        achieved = statistics.median(s / b for s, b in zip(per[k], per[0]))
        best = max(per[k]) / max(per[0])  # fastest repeat of each arm: what the probe's fastest-of-N costs assume
        row = {"k": k, "plain_tok_s": statistics.median(per[0]), "spec_tok_s": statistics.median(per[k]),
               "speedup": achieved, "speedup_fastest": best, "verify_k": verify, "draft": draft,
               "ideal": ideal, "achieved_over_ideal": achieved / ideal, "fastest_over_ideal": best / ideal}
        print(f"k={k}: speedup {achieved:.2f}x (fastest repeats {best:.2f}x), ideal {ideal:.2f}x (verify "
              f"{verify:.2f}, draft {draft:.3f}): {achieved / ideal:.2f} of ideal "
              f"({best / ideal:.2f} fastest)", flush=True)
        out.append(row)
    return out


class _AgreeingRows(MTPDrafter):
    """The MTP head runs per row as in real drafting; each row's drafts are replaced by its own
    greedy reference stream (a drafter that always agrees, in the batch loop)."""

    def __init__(self, head, d_model: int, refs: dict):
        super().__init__(head, d_model)
        self.refs = refs  # tuple(prompt) -> greedy stream
        self.rows = {}  # id(state) -> rows, in the batch's order

    def _keep(self, st, rows):
        self.rows = {id(st): list(rows)}
        return st

    def start(self, rows, pres):
        return self._keep(super().start(rows, pres), rows)

    def merge(self, a, b):
        rows = self.rows[id(a)] + self.rows[id(b)]
        return self._keep(super().merge(a, b), rows)

    def filter(self, st, keep):
        rows = [self.rows[id(st)][i] for i in keep]
        return self._keep(super().filter(st, keep), rows)

    def capture(self, rows, hidden, targets):
        return self._keep(super().capture(rows, hidden, targets), rows)

    def draft(self, st, k, pick, target_cache):
        rows = self.rows[id(st)]
        real = super().draft(st, k, pick, target_cache)
        if any(tuple(r.prompt) not in self.refs for r in rows):  # the probe's rows: the head's own drafts
            return real
        forced = []
        for r, pos in zip(rows, pick.first_positions):
            ref, i = self.refs[tuple(r.prompt)], int(pos) - len(r.prompt)
            forced.append((ref[i: i + k] + [0] * k)[:k])
        return mx.array(forced, dtype=mx.int32) + 0 * real


def agreeing_batches(lm, widths, k: int, reps: int, max_tokens: int) -> list[dict]:
    """W requests decoding together (cap 0: every round speculates at k), each row's drafts its own
    greedy stream, against the same W requests decoded plain; decode tokens/s after the first step."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, seed=0)
    out = []
    for w in widths:
        prompts = [[(17 * i + 5 * j + 2) % VOCAB for j in range(20 + 4 * i)] for i in range(w)]
        refs = {tuple(p): decode_alone(ScalarLane(lm.target, None, 1), make_row(lm, p, params, eos_ids=set())).tokens
                for p in prompts}

        def run(spec: bool) -> float:
            cfg = EngineConfig(width_cap=0, num_draft_tokens=k if spec else None, speculative=spec,
                               prompt_cache_bytes=0)
            drafter = _AgreeingRows(lm.head, lm.target.hidden_size, refs) if spec else None
            eng = Engine(lm, cfg, switches=Switches(preempt=True, resume=True, control=False), drafter=drafter)
            streams = [eng.submit(p, params, start=False) for p in prompts]
            first = sum(n for e in eng.step() if e.kind is EventKind.ROUND for *_, n in e.rows)
            t0 = time.perf_counter()
            while eng.has_work:
                eng.step()
            dt = time.perf_counter() - t0
            recs = [s.wait(5) for s in streams]
            eng.close()
            assert all(r.tokens == refs[tuple(p)] for r, p in zip(recs, prompts)), "an agreeing drafter moved a token"
            return (sum(len(r.tokens) for r in recs) - first) / dt

        run(False), run(True)  # warm-up
        plain, spec = [], []
        for r in range(reps):
            for s_ in ((False, True) if r % 2 == 0 else (True, False)):
                (spec if s_ else plain).append(run(s_))
        probes = [measure(lm.target, _AgreeingRows(lm.head, lm.target.hidden_size, {}), k, width=w)
                  for _ in range(3)]
        verify = statistics.median(c.verify_cost(k) for c in probes)
        draft = statistics.median(c.draft for c in probes)
        ideal = (k + 1) / (verify + k * draft)
        speedup = statistics.median(a / b for a, b in zip(spec, plain))
        row = {"width": w, "k": k, "plain_tok_s": statistics.median(plain), "spec_tok_s": statistics.median(spec),
               "speedup": speedup, "verify_k": verify, "draft": draft, "ideal": ideal,
               "achieved_over_ideal": speedup / ideal}
        print(f"batch W={w} k={k}: speedup {speedup:.2f}x, ideal {ideal:.2f}x (verify {verify:.2f}, draft "
              f"{draft:.3f}): {speedup / ideal:.2f} of ideal", flush=True)
        out.append(row)
    return out


def markdown(result: dict) -> str:
    lines = [f"# bench_hybrid ({result['utc']})", "", f"`{result['command']}`", "",
             "machine: " + ", ".join(f"{k} {v}" for k, v in result["machine"].items()), ""]
    for fam, r in result["families"].items():
        lines += [f"## {fam}: verify forward, capture + per-row rollback vs mlx-lm's forward", "",
                  "| width | k | base ms | capture ms | added (median of paired ratios) | fastest | process CPU |",
                  "|---|---|---|---|---|---|---|"]
        lines += [f"| {x['width']} | {x['k']} | {x['base_ms']:.2f} | {x['capture_ms']:.2f} | {x['added_pct']:+.1f} % | "
                  f"{x['added_pct_fastest']:+.1f} % | {x['added_pct_cpu']:+.1f} % |" for x in r["verify"]]
        if r.get("scalar"):
            lines += ["", f"## {fam}: scalar loop, a drafter that agrees (greedy)", "",
                      "| k | plain tok/s | spec tok/s | speedup | verify[k] | draft | ideal | of ideal |",
                      "|---|---|---|---|---|---|---|---|"]
            lines += [f"| {x['k']} | {x['plain_tok_s']:.1f} | {x['spec_tok_s']:.1f} | {x['speedup']:.2f}x | "
                      f"{x['verify_k']:.2f} | {x['draft']:.3f} | {x['ideal']:.2f}x | {x['achieved_over_ideal']:.2f} |"
                      for x in r["scalar"]]
        if r.get("batch"):
            lines += ["", f"## {fam}: batch loop, each row's drafter agrees (greedy, cap 0)", "",
                      "| width | k | plain tok/s | spec tok/s | speedup | verify[k] | draft | ideal | of ideal |",
                      "|---|---|---|---|---|---|---|---|---|"]
            lines += [f"| {x['width']} | {x['k']} | {x['plain_tok_s']:.1f} | {x['spec_tok_s']:.1f} | {x['speedup']:.2f}x | "
                      f"{x['verify_k']:.2f} | {x['draft']:.3f} | {x['ideal']:.2f}x | {x['achieved_over_ideal']:.2f} |"
                      for x in r["batch"]]
        lines.append("")
    return "\n".join(lines)


def rewrite_markdown(path: Path) -> None:
    """The .md of an existing result (its .json), e.g. after the table format changed."""
    path.with_suffix(".md").write_text(markdown(json.loads(path.read_text())) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--families", default="qwen3_next,qwen3_5")
    ap.add_argument("--ks", default="1,2,3,4")
    ap.add_argument("--widths", default="1,2,4,8")
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--inner", type=int, default=4)
    ap.add_argument("--scalar-reps", type=int, default=3)
    ap.add_argument("--scalar-prompts", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--batch-widths", default="2,4")
    ap.add_argument("--batch-k", type=int, default=3)
    ap.add_argument("--batch-reps", type=int, default=3)
    ap.add_argument("--out", type=Path, default=Path("bench_results"))
    a = ap.parse_args()
    ks = [int(x) for x in a.ks.split(",")]
    widths = [int(x) for x in a.widths.split(",")]
    result = {"benchmark": "hybrid", "command": command_line("bench_hybrid.py", a), "machine": describe(),
              "utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "configs": FAMILIES, "families": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for fam in a.families.split(","):
            lm = load(write_checkpoint(Path(tmp) / fam, fam))
            assert lm.has_drafter and lm.can_rollback, lm.rollback_blockers
            print(f"== {fam}", flush=True)
            fam_out = {"verify": verify_overhead(lm.target, widths, ks, a.reps, a.inner)}
            if a.scalar_reps:
                prompts = [[(13 * i + 7 * j + 1) % VOCAB for j in range(24 + 8 * i)] for i in range(a.scalar_prompts)]
                fam_out["scalar"] = agreeing_speedups(lm, ks, a.scalar_reps, prompts, a.max_tokens)
            if a.batch_reps and a.batch_widths:
                fam_out["batch"] = agreeing_batches(lm, [int(x) for x in a.batch_widths.split(",")], a.batch_k,
                                                    a.batch_reps, a.max_tokens)
            result["families"][fam] = fam_out
    path = write_result(a.out, "hybrid", result)
    path.with_suffix(".md").write_text(markdown(result) + "\n")
    print(f"wrote {path} and {path.with_suffix('.md')}")


if __name__ == "__main__":
    main()
