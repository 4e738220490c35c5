"""Two ranks over loopback (MLX's ring backend), against one process.

Every two-rank run starts when this module does (a module fixture), so their start-up overlaps;
each test then waits on its own, with a hard timeout: nothing here can hang. Ports are picked
free by binding port 0.
- the schedule (tests/dist_schedule.py: scalar greedy and seeded, a batch, preempt -> gate ->
  resume, a cancellation, a close with a request live) on two ranks emits, on both, exactly what
  the same schedule emits in one process (tie-aware), with the same transitions;
- `gmlx generate --distributed` under `mlx.launch` prints one result (rank 0's), equal to the
  single-process run;
- a rank killed mid-generation ends the other with a one-line error at once, and a rank that
  hangs (SIGSTOP) ends the other through the watchdog (GMLX_DIST_TIMEOUT);
- launch mistakes are one-line errors: no launcher, a model that cannot shard, a width that does
  not divide the heads.
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gmlx.config import SamplingParams
from gmlx.errors import LaunchError

# One worker runs the whole module (pytest-xdist): its multi-process runs start once, together.
pytestmark = pytest.mark.xdist_group("distributed")

HERE = Path(__file__).resolve().parent
PY = sys.executable
WAIT_S = 300  # a hard bound per run on a loaded 2-core machine (150 s was hit once in a full CI run); a healthy run takes a fraction
PROMPT = "def fibonacci(n):"


def _free_ports() -> list[int]:
    """Eight distinct free loopback ports, the last two consecutive (mlx.launch -p takes the
    first of its ranks' ports), all held until all are chosen so no two runs share one."""
    for _ in range(50):
        socks = []
        try:
            for _ in range(7):
                socks.append(socket.socket())
                socks[-1].bind(("127.0.0.1", 0))
            last = socket.socket()
            socks.append(last)
            last.bind(("127.0.0.1", socks[-2].getsockname()[1] + 1))
            return [s.getsockname()[1] for s in socks]
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no free loopback ports")


def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLX_")}
    return {**env, "PYTHONUNBUFFERED": "1", **extra}


class Pair:
    """Two ranks of one command, started directly (MLX_HOSTFILE, MLX_RANK): the tests can stop
    or kill either."""

    def __init__(self, tmp: Path, ports: list[int], cmd: list[str], **env):
        tmp.mkdir(parents=True, exist_ok=True)
        hosts = tmp / "hosts.json"
        hosts.write_text(json.dumps([[f"127.0.0.1:{p}"] for p in ports]))
        self.lines: list[str] = []  # what rank 0 printed so far
        self.procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=HERE.parent,
                                       env=_env(MLX_HOSTFILE=str(hosts), MLX_RANK=str(r), **env)) for r in range(2)]

    def wait(self, rank: int, timeout: float = WAIT_S) -> tuple[int, str, str]:
        p = self.procs[rank]
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.send_signal(signal.SIGUSR1)  # its stacks, for the message
            time.sleep(1)
            self.kill()
            raise AssertionError(f"rank {rank} did not exit within {timeout} s: {p.communicate()[1][-3000:]}") from None
        return p.returncode, out, err

    def kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Both multi-process runs of this module, started at once."""
    tmp = tmp_path_factory.mktemp("dist")
    ports = _free_ports()
    # A bound on every wait well inside the tests' own: a failure ends a run, it never hangs one.
    schedule = Pair(tmp, ports[0:2], [PY, str(HERE / "dist_schedule.py"), str(tmp), "--then-long"],
                    GMLX_DIST_TIMEOUT="60")
    launcher = subprocess.Popen(
        [str(Path(PY).parent / "mlx.launch"), "--backend", "ring", "-n", "2", "-p", str(ports[6]), "--python", PY,
         "--", "-m", "gmlx_cli.app", "generate", PROMPT, "--max-tokens", "16", "--seed", "3", "--temp", "0.8",
         "--json", "--distributed"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=HERE.parent,
        env={k: v for k, v in _env(GMLX_DIST_TIMEOUT="60").items() if k != "GMLX_ROUND_COSTS"})
    # As a user runs it: the ranks measure the round costs together (their forwards all_sum) and
    # decide with rank 0's figures (the schedule above keeps the suite's fixed estimates).
    serve = Pair(tmp / "serve", ports[2:4], [PY, "-m", "gmlx_cli.app", "serve", "--port", str(ports[4]),
                                             "--log-level", "warning", "--distributed"], GMLX_DIST_TIMEOUT="60")
    yield {"tmp": tmp, "schedule": schedule, "launcher": launcher, "serve": (serve, ports[4])}
    serve.kill()
    schedule.kill()
    if launcher.poll() is None:
        launcher.kill()


def _wait_for_line(pair: Pair, want: str) -> None:
    """Until rank 0 has printed the line `want` (now or before), within WAIT_S."""
    out, deadline = pair.procs[0].stdout, time.monotonic() + WAIT_S
    while want not in pair.lines:
        ready, _, _ = select.select([out], [], [], max(0.0, deadline - time.monotonic()))
        line = out.readline() if ready else ""
        if not line:
            pair.kill()  # (rank 1's words too: when it ended first, rank 0's only say that it did)
            raise AssertionError(f"rank 0 never printed {want!r}: {pair.procs[0].stderr.read()[-3000:]}\n"
                                 f"rank 1 (exit {pair.procs[1].returncode}): {pair.procs[1].stderr.read()[-3000:]}")
        pair.lines.append(line.strip())


def _follower_records(path: Path, n: int) -> dict:
    """Rank 1's streams, once it has written `n` (it handles the last close just after rank 0)."""
    deadline = time.monotonic() + 30
    while True:
        lines = path.read_text().splitlines() if path.exists() else []
        if len(lines) >= n or time.monotonic() > deadline:
            return {(r[0], r[1]): (r[2], r[3]) for r in map(json.loads, lines)}
        time.sleep(0.1)


def test_two_ranks_emit_what_one_process_emits(runs, loaded_lm):
    import dist_schedule
    from gmlx.engine import Engine
    from gmlx.engine.oracle import compare_streams

    ref = dist_schedule.run(loaded_lm, lambda config, switches: Engine(loaded_lm, config, switches=switches))
    _wait_for_line(runs["schedule"], "schedule done")
    data0 = json.loads((runs["tmp"] / "rank0.json").read_text())
    got = {(r[0], r[1]): (r[2], r[3]) for r in data0["records"]}
    follower = _follower_records(runs["tmp"] / "rank1.jsonl", len(got))
    want = {(r[0], r[1]): (r[2], r[3]) for r in ref["records"]}
    assert follower == got  # same computation on both ranks: identical, cancellations and close included
    assert sorted(got) == sorted(want)
    assert data0["transitions"] == ref["transitions"]
    assert {"preempt", "gate", "resume", "capture"} <= set(data0["transitions"][2])
    assert [got[(4, 0)][1], got[(4, 1)][1]] == ["cancelled", "cancelled"]  # one cancel(), one close()
    prompts = [loaded_lm.tokenizer.encode(p) for p in dist_schedule.PROMPTS]
    params = {1: [(0, 0.0, 0), (1, 0.8, 7)], 2: [(2, 0.0, 0), (3, 0.9, 3), (4, 0.7, 11)],
              3: [(0, 0.8, 5), (1, 0.0, 0), (2, 1.0, 9)], 4: [(3, 0.0, 0), (4, 0.8, 2)]}
    for (sid, rid), (tokens, reason) in got.items():
        i, temp, seed = params[sid][rid]
        p = SamplingParams(temperature=temp, seed=seed, top_k=20 if (sid, rid) == (2, 2) else 0, max_tokens=64)
        ref_tokens, ref_reason = want[(sid, rid)]
        if reason == "cancelled":  # cut at the same step in both runs; compare what both emitted
            n = min(len(tokens), len(ref_tokens))
            tokens, ref_tokens = tokens[:n], ref_tokens[:n]
        else:
            assert reason == ref_reason
        cmp = compare_streams(loaded_lm, prompts[i], ref_tokens, tokens, p)
        assert cmp.ok, f"session {sid} request {rid}: differs at token {cmp.position} (margin {cmp.margin})"
    assert data0["stats"]["exchanges"] >= sum(sum(t.values()) for t in ref["transitions"])


def test_cli_generate_under_mlx_launch_prints_rank_0s_result(runs, loaded_lm, capsys):
    from gmlx.engine.oracle import compare_streams
    from gmlx_cli.app import main

    p = runs["launcher"]
    try:
        out, err = p.communicate(timeout=WAIT_S)
    except subprocess.TimeoutExpired:
        p.kill()
        raise AssertionError("mlx.launch did not finish") from None
    assert p.returncode == 0, err
    lines = [ln for ln in out.splitlines() if ln.strip()]
    # mlx.launch exits 0 whatever its ranks did (a rank's failure is a warning on its stderr): the
    # ranks' errors are in `err`
    assert len(lines) == 1, (out, err[-3000:])  # rank 0 prints; the other rank prints nothing
    dist = json.loads(lines[0])
    with pytest.raises(SystemExit) as ex:
        main(["generate", PROMPT, "--max-tokens", "16", "--seed", "3", "--temp", "0.8", "--json"],
             load_model=lambda path: loaded_lm)
    assert ex.value.code == 0
    alone = json.loads(capsys.readouterr().out)
    assert dist["prompt_tokens"] == alone["prompt_tokens"] and dist["seed"] == alone["seed"] == 3
    cmp = compare_streams(loaded_lm, alone["prompt_tokens"], alone["tokens"], dist["tokens"],
                          SamplingParams(temperature=0.8, seed=3, max_tokens=16))
    assert cmp.ok, f"differs at token {cmp.position} (margin {cmp.margin})"


def test_serve_on_two_ranks_answers_as_one_process_and_stops_cleanly(runs, loaded_lm):
    """`gmlx serve --distributed`: rank 0 serves HTTP, rank 1 follows its engine; a seeded
    completion and a greedy stream equal their solo plain decode; SIGTERM to rank 0 ends both, 0."""
    import httpx
    from openai import OpenAI

    from gmlx import Engine, EngineConfig
    from gmlx.engine.intake import tokenize
    from gmlx.engine.oracle import compare_streams

    pair, port = runs["serve"]
    base, deadline = f"http://127.0.0.1:{port}", time.monotonic() + WAIT_S
    while True:
        try:
            if httpx.get(base + "/health", timeout=2).status_code == 200:
                break
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline or any(p.poll() is not None for p in pair.procs):
            pair.kill()
            raise AssertionError(f"the server never answered: {pair.procs[0].stderr.read()[-3000:]}")
        time.sleep(0.2)
    client = OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=WAIT_S)
    ids = tokenize(loaded_lm, PROMPT)
    solo = Engine(loaded_lm, EngineConfig(speculative=False))
    for params, stream in ((SamplingParams(max_tokens=16, temperature=0.8, seed=3), False),
                           (SamplingParams(max_tokens=12, temperature=0.0, seed=0), True)):
        r = client.completions.create(model="gmlx-default", prompt=PROMPT, max_tokens=params.max_tokens,
                                      temperature=params.temperature, seed=params.seed, stream=stream,
                                      extra_body={"return_token_ids": True})
        chunks = list(r) if stream else [r]
        got = [t for c in chunks for t in (c.choices[0].model_extra or {}).get("token_ids") or []]
        ref = solo.generate(ids, params).tokens
        cmp = compare_streams(loaded_lm, ids, ref, got, params)
        assert got and cmp.ok, f"stream={stream}: differs at token {cmp.position} (margin {cmp.margin})"
    solo.close()
    pair.procs[0].send_signal(signal.SIGTERM)
    assert pair.wait(0, timeout=60)[0] == 0
    assert pair.wait(1, timeout=60)[0] == 0  # rank 0 sent it the exit


def test_a_killed_rank_ends_the_other_with_one_line(runs):
    pair = runs["schedule"]  # after its schedule, rank 0 decodes one long request
    _wait_for_line(pair, "schedule done")
    _wait_for_line(pair, "decoding")
    pair.procs[1].send_signal(signal.SIGKILL)
    t0 = time.monotonic()
    code, _, err = pair.wait(0, timeout=30)
    assert time.monotonic() - t0 < 30
    assert code == 1
    lines = [ln for ln in err.splitlines() if ln.startswith("gmlx: error:")]
    # MLX's ring backend names the lost peer, or the liveness connection does (gmlx/distributed/liveness.py)
    assert len(lines) == 1 and ("rank 0 lost the connection to another rank" in lines[0]
                                or "rank 0: rank 1's process ended" in lines[0]), err


def test_the_watchdog_ends_a_stretch_that_outlasts_its_bound():
    from gmlx.distributed.watchdog import Watchdog

    fired = []
    dog = Watchdog(3, 0.2, on_fire=fired.append)
    dog.arm("in step 1 of engine 1")
    dog.disarm()  # a stretch that ended in time
    time.sleep(0.5)
    assert fired == []
    dog.arm("in step 7 of engine 2")
    deadline = time.monotonic() + 10
    while not fired and time.monotonic() < deadline:
        time.sleep(0.05)
    assert fired and "rank 3: no progress for 0.2 s in step 7 of engine 2" in fired[0]


# ---- launch mistakes (no second process needed) ---------------------------------------------
def test_distributed_without_a_launcher_says_how_to_launch(monkeypatch, capsys):
    from gmlx_cli.app import main

    for k in ("MLX_HOSTFILE", "MLX_RANK", "OMPI_COMM_WORLD_SIZE"):
        monkeypatch.delenv(k, raising=False)
    with pytest.raises(SystemExit) as ex:
        main(["generate", PROMPT, "--distributed"])
    assert ex.value.code == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "runs alone" in err[0] and "mlx.launch --backend ring -n 2" in err[0], err


def test_bench_refuses_what_runs_on_rank_0_alone(capsys, tmp_path):
    from gmlx_cli.app import main

    with pytest.raises(SystemExit) as ex:
        main(["bench", "--distributed", "--verify", "--out", str(tmp_path)])
    assert ex.value.code == 1
    assert "--verify run the model outside the engine" in capsys.readouterr().err


def test_a_model_that_cannot_shard_is_named():
    from mlx_lm.utils import _get_classes

    from gmlx.distributed.shard import check_shardable

    config = {"model_type": "gpt2", "n_head": 12}
    with pytest.raises(LaunchError, match=r"model type 'gpt2' \(mlx_lm\.models\.gpt2\) has no tensor-parallel"):
        check_shardable(config, _get_classes(config)[0], 2)


def test_a_width_the_heads_do_not_divide_names_both_numbers(loaded_lm):
    from mlx_lm.utils import _get_classes

    from gmlx.distributed.shard import check_shardable

    config = dict(loaded_lm.config)  # the embedded model: 4 attention heads, 2 key/value heads
    check_shardable(config, _get_classes(config)[0], 2)
    with pytest.raises(LaunchError, match="4 attention heads, which 3 ranks cannot split evenly"):
        check_shardable(config, _get_classes(config)[0], 3)
    with pytest.raises(LaunchError, match="2 key/value heads, which 4 ranks cannot split evenly"):
        check_shardable(config, _get_classes(config)[0], 4)
