"""lm-evaluation-harness against `gmlx serve`, with speculation on and off: the scores, and every
sample's logprobs and generations, must be identical (the exactness claim, checked by a client
that does not know gmlx).

    python benchmarks/lm_eval_serve.py --lm-eval /path/to/venv/bin/lm_eval --docs 40

lm-eval is not a gmlx dependency (it pulls datasets, pandas, scikit-learn, ...): install it in a
venv of its own with transformers for the tokenizer (`pip install lm-eval transformers`) and pass
its `lm_eval` with --lm-eval. Everything is local and offline: two small tasks are built here from
the Python standard library's source (what the embedded model was trained on) and handed to
lm-eval with --include_path:

- gmlx_code_mc (multiple_choice, loglikelihood through `echo` + `logprobs`): 12 lines of a module,
  then its true next line against 3 lines of other modules; acc, acc_norm;
- gmlx_code_gen (generate_until "\\n", greedy): the same contexts and the next line's first words; the
  rest of that line, exact_match (the prompt ends inside the line: a code tokenizer merges a newline
  with the next indentation, so a prompt ending at a bare newline is one the model never saw;
  leading whitespace is ignored, since gmlx's text, as mlx-lm's detokenizer, drops the first
  token's leading space).

Each arm starts `gmlx serve` on a free loopback port (speculative: --num-draft-tokens K, which
speculates whatever the measured costs say; plain: --no-speculative), runs lm-eval's
local-completions model on both tasks with --num-concurrent requests in flight (the batch loop),
stops the server, and reads lm-eval's results and samples. Written: bench_results/<utc>_lm_eval.json
and .md (machine, versions, commands, the scores per arm, the per-sample comparison).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
MODULES = ["textwrap.py", "shlex.py", "fractions.py", "statistics.py", "difflib.py", "heapq.py", "bisect.py",
           "string.py", "csv.py", "json/encoder.py", "json/decoder.py", "argparse.py", "calendar.py",
           "configparser.py", "dataclasses.py", "enum.py", "functools.py", "gettext.py", "glob.py", "ipaddress.py"]
CONTEXT_LINES = 12


def source_lines(name: str) -> list[str]:
    return (Path(sysconfig.get_paths()["stdlib"]) / name).read_text().splitlines()


def usable(line: str) -> bool:
    s = line.strip()
    return 12 <= len(s) <= 80 and not s.startswith(("#", '"', "'")) and s.isascii()


def build_docs(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    files = {m: source_lines(m) for m in MODULES}
    docs = []
    while len(docs) < n:
        m = rng.choice(MODULES)
        lines = files[m]
        i = rng.randrange(CONTEXT_LINES, len(lines))
        if not usable(lines[i]) or not all(len(x) < 100 for x in lines[i - CONTEXT_LINES:i]):
            continue
        indent = len(lines[i]) - len(lines[i].lstrip())
        others = [x for o in MODULES if o != m for x in files[o][::7]
                  if usable(x) and len(x) - len(x.lstrip()) == indent]
        spaces = [j for j in range(indent + 1, len(lines[i]) // 2 + 4) if lines[i][j] == " "]
        if len(others) < 3 or not spaces:
            continue
        choices = rng.sample(others, 3) + [lines[i]]
        rng.shuffle(choices)
        context = "\n".join(lines[i - CONTEXT_LINES:i]) + "\n"
        split = spaces[-1]  # the generation task continues the line from a word boundary
        docs.append({"context": context, "choices": choices, "label": choices.index(lines[i]),
                     "gen_context": context + lines[i][:split], "gen_target": lines[i][split:],
                     "source": f"{m}:{i + 1}"})
    return docs


def write_tasks(d: Path, docs: list[dict]) -> None:
    data = d / "code.jsonl"
    data.write_text("".join(json.dumps(x) + "\n" for x in docs))
    common = f"dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\ntest_split: test\n"
    (d / "gmlx_code_mc.yaml").write_text(
        "task: gmlx_code_mc\n" + common + "doc_to_text: \"{{context}}\"\noutput_type: multiple_choice\ndoc_to_choice: \"{{choices}}\"\n"
        "doc_to_target: \"{{label}}\"\ntarget_delimiter: \"\"\n"
        "metric_list:\n  - metric: acc\n  - metric: acc_norm\n")
    (d / "gmlx_code_gen.yaml").write_text(
        "task: gmlx_code_gen\n" + common + "doc_to_text: \"{{gen_context}}\"\noutput_type: generate_until\n"
        "doc_to_target: \"{{gen_target}}\"\n"
        "generation_kwargs:\n  until: [\"\\n\"]\n  max_gen_toks: 40\n  do_sample: false\n  temperature: 0\n"
        "metric_list:\n  - metric: exact_match\n    regexes_to_ignore: [\"^\\\\s+\"]\n")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve(args_: list[str], log: Path, start_s: float = 180) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [str(Path(sys.executable).parent / "gmlx"), "serve", "--port", str(port), "--log-level", "warning", *args_]
    proc = subprocess.Popen(cmd, stdout=open(log, "wb"), stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + start_s
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    stop(proc)
    raise SystemExit(f"gmlx serve did not start: {shlex.join(cmd)}\n{log.read_text(errors='replace')[-2000:]}")


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)


def run_arm(name: str, serve_args: list[str], args, tasks: Path, work: Path) -> dict:
    from gmlx.models.loading import default_model_path

    proc, url = serve(serve_args, work / f"{name}.serve.log")
    out = work / name
    try:
        model_args = ",".join([f"base_url={url}/v1/completions", "model=gmlx-default",
                               f"tokenizer={default_model_path()}", "tokenizer_backend=huggingface",
                               "tokenized_requests=True", f"num_concurrent={args.concurrency}", "max_retries=1",
                               "max_length=1000", "timeout=600"])
        cmd = [args.lm_eval, "--model", "local-completions", "--model_args", model_args,
               "--tasks", "gmlx_code_mc,gmlx_code_gen", "--include_path", str(tasks), "--log_samples",
               "--output_path", str(out), "--batch_size", "1"]
        t0 = time.perf_counter()
        env = os.environ | {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_HOME": str(work / "hf"),
                            "OPENAI_API_KEY": "none"}
        r = subprocess.run(cmd, capture_output=True, text=True, env=env)
        wall = time.perf_counter() - t0
        if r.returncode != 0:
            raise SystemExit(f"lm-eval failed ({name}): {shlex.join(cmd)}\n{r.stderr[-3000:]}")
        metrics = httpx.get(url + "/metrics", timeout=10).text
    finally:
        stop(proc)
    results_file = max(out.rglob("results_*.json"), key=lambda p: p.stat().st_mtime)
    res = json.loads(results_file.read_text())
    samples = {}
    for f in out.rglob("samples_*.jsonl"):
        task = "gmlx_code_mc" if "gmlx_code_mc" in f.name else "gmlx_code_gen"
        samples[task] = [json.loads(x) for x in f.read_text().splitlines()]
    drafted = sum(float(x.split()[-1]) for x in metrics.splitlines()
                  if x.startswith("gmlx:spec_decode_num_draft_tokens_total"))
    return {"command": shlex.join(cmd), "serve_args": serve_args, "wall_s": wall, "results": res["results"],
            "samples": samples, "draft_tokens": drafted}


def compare(a: dict, b: dict, tol: float) -> dict:
    """Per sample: the multiple-choice logprobs within tol and the same is_greedy; generations equal."""
    out = {"mc_samples": 0, "mc_max_abs_diff": 0.0, "mc_greedy_flags_differ": 0, "gen_samples": 0,
           "gen_differ": 0, "gen_differ_docs": []}
    key = lambda s: s["doc_id"]  # noqa: E731
    for x, y in zip(sorted(a["samples"]["gmlx_code_mc"], key=key), sorted(b["samples"]["gmlx_code_mc"], key=key)):
        for rx, ry in zip(x["resps"], y["resps"]):
            (lx, gx), (ly, gy) = rx[0], ry[0]
            out["mc_max_abs_diff"] = max(out["mc_max_abs_diff"], abs(float(lx) - float(ly)))
            out["mc_greedy_flags_differ"] += str(gx) != str(gy)
        out["mc_samples"] += 1
    for x, y in zip(sorted(a["samples"]["gmlx_code_gen"], key=key), sorted(b["samples"]["gmlx_code_gen"], key=key)):
        out["gen_samples"] += 1
        if x["resps"] != y["resps"]:
            out["gen_differ"] += 1
            out["gen_differ_docs"].append(x["doc_id"])
    out["ok"] = out["mc_max_abs_diff"] <= tol and out["gen_differ"] == 0 and out["mc_greedy_flags_differ"] == 0
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lm-eval", required=True, help="lm-eval's CLI (lm_eval) in its own venv")
    p.add_argument("--docs", type=int, default=40)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--num-draft-tokens", type=int, default=3)
    p.add_argument("--tol", type=float, default=1e-3)
    p.add_argument("--out", type=Path, default=ROOT / "bench_results")
    args = p.parse_args()

    import gmlx  # noqa: F401  (OpenBLAS before mlx)
    from common import write_result

    from gmlx_cli import ui

    work = Path(tempfile.mkdtemp(prefix="gmlx-lm-eval-"))
    tasks = work / "tasks"
    tasks.mkdir()
    docs = build_docs(args.docs, args.seed)
    write_tasks(tasks, docs)
    arms = {"speculative": run_arm("speculative", ["--num-draft-tokens", str(args.num_draft_tokens)], args, tasks, work),
            "plain": run_arm("plain", ["--no-speculative"], args, tasks, work)}
    cmp = compare(arms["speculative"], arms["plain"], args.tol)
    scores = {name: {task: {k: v for k, v in r["results"][task].items() if not k.startswith("alias")}
                     for task in ("gmlx_code_mc", "gmlx_code_gen")} for name, r in arms.items()}
    identical = scores["speculative"] == scores["plain"]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout.strip()
    lm_eval_version = subprocess.run([str(Path(args.lm_eval).parent / "python"), "-c",
                                      "import importlib.metadata as m; print(m.version('lm_eval'))"],
                                     capture_output=True, text=True).stdout.strip()
    result = {"kind": "lm_eval_serve", "commit": commit, "machine": {"cpus": os.cpu_count(),
              "load_avg": os.getloadavg()}, "versions": {"mlx": ui.version_of("mlx"), "mlx-lm": ui.version_of("mlx-lm"),
              "lm-eval": lm_eval_version}, "args": {k: str(v) for k, v in vars(args).items()},
              "docs": args.docs, "scores": scores, "identical_scores": identical, "comparison": cmp,
              "arms": {n: {k: v for k, v in r.items() if k not in ("samples", "results")} for n, r in arms.items()}}
    path = write_result(args.out, "lm_eval", result)
    md = [f"# lm-eval against gmlx serve, speculation on and off ({path.stem})", "",
          f"commit {commit}; lm-eval {lm_eval_version}; mlx {result['versions']['mlx']}; {args.docs} docs per task;"
          f" {args.concurrency} requests in flight", "",
          "| arm | gmlx_code_mc acc | acc_norm | gmlx_code_gen exact_match | draft tokens | wall s |", "|---|---|---|---|---|---|"]
    for name, r in arms.items():
        mc, gen = scores[name]["gmlx_code_mc"], scores[name]["gmlx_code_gen"]
        md.append(f"| {name} | {mc.get('acc,none')} | {mc.get('acc_norm,none')} | {gen.get('exact_match,none')} |"
                  f" {r['draft_tokens']:.0f} | {r['wall_s']:.1f} |")
    md += ["", f"identical scores: **{identical}**; per sample: {cmp['mc_samples']} multiple-choice docs, max |logprob"
           f" diff| {cmp['mc_max_abs_diff']:.2e}, greedy flags differing {cmp['mc_greedy_flags_differ']};"
           f" {cmp['gen_samples']} generations, {cmp['gen_differ']} differing", ""]
    path.with_suffix(".md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    print(f"wrote {path} and {path.with_suffix('.md')}")
    sys.exit(0 if identical and cmp["ok"] else 1)


if __name__ == "__main__":
    main()
