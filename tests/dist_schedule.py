"""A fixed schedule of engine sessions, run by tests/test_distributed.py twice: in one process
(the reference) and on two ranks over loopback (`python tests/dist_schedule.py OUT` in each rank,
MLX_HOSTFILE / MLX_RANK set). Steps are driven by the caller, so both runs see the same arrivals
at the same steps: scalar greedy and seeded, a batch, a preempt that gates over cap 2 and
resumes, a cancellation and a close with a request still live.

Rank 0 writes OUT/rank0.json (its finished streams: session, rid, tokens, finish reason; its
transition counts per session; its communication statistics) and prints "schedule done"; the
other rank appends each stream it finishes to OUT/rank1.jsonl as it goes.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

if __name__ == "__main__":  # run as a script: the package is installed, the tests dir is not a package
    sys.path.insert(0, str(Path(__file__).resolve().parent))

import gmlx  # noqa: F401,E402  (loads OpenBLAS before mlx)
from gmlx.config import EngineConfig, SamplingParams, Switches  # noqa: E402

PROMPTS = ["def fibonacci(n):\n", "import os\n\nclass Config:\n", "for i in range(10):\n", "x = [", "# parse\n"]


def _p(max_tokens, temperature=0.0, seed=0, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed, ignore_eos=True, **kw)


def run(lm, new_engine) -> dict:
    """The schedule, on engines built by `new_engine(config, switches)`; returns what rank 0 saw."""
    ids = [lm.tokenizer.encode(p) for p in PROMPTS]
    records, transitions = [], []

    def session(config, body):
        engine, streams = new_engine(config, Switches(preempt=True, resume=True)), []
        sid = len(transitions) + 1

        def drain(steps=None):
            n = 0
            while engine.has_work and (steps is None or n < steps):
                engine.step()
                n += 1
            for s in [s for s in streams if s.done]:
                records.append([sid, s.request_id, list(s.result.tokens), s.result.finish_reason])
                streams.remove(s)

        def submit(i, params):
            streams.append(engine.submit(ids[i], params, start=False))
            return streams[-1]

        if body(submit, drain):
            drain()
        engine.close()
        drain(0)
        transitions.append({t.value: n for t, n in engine.counters.transitions.items() if n})

    def scalar(submit, drain):  # one request at a time: the scalar loop, greedy then seeded
        submit(0, _p(12))
        drain()
        submit(1, _p(12, 0.8, seed=7))
        return True

    def batch(submit, drain):  # three at once: a batch, greedy and seeded rows side by side
        submit(2, _p(10))
        submit(3, _p(10, 0.9, seed=3))
        submit(4, _p(10, 0.7, seed=11, top_k=20))
        return True

    def preempt(submit, drain):  # a long request, then two waiters: preempt, gate over cap 2, resume
        submit(0, _p(28, 0.8, seed=5))
        drain(steps=3)
        submit(1, _p(6))
        submit(2, _p(6, 1.0, seed=9))
        return True

    def cancel_close(submit, drain):  # one cancelled mid-flight, one still live at close()
        doomed = submit(3, _p(30))
        submit(4, _p(30, 0.8, seed=2))
        drain(steps=2)
        doomed.cancel()
        drain(steps=3)
        return False

    session(EngineConfig(), scalar)
    session(EngineConfig(), batch)
    session(EngineConfig(width_cap=2, resume_min_remaining=4), preempt)
    session(EngineConfig(), cancel_close)
    return {"records": records, "transitions": transitions}


def run_long(lm, cluster) -> None:
    """One long request, for the test that kills a rank mid-way: "decoding" is printed once rank 0
    has run a few steps."""
    engine = cluster.engine(lm, EngineConfig())
    engine.submit(lm.tokenizer.encode(PROMPTS[0]), _p(900), start=False)
    steps = 0
    while engine.has_work:
        engine.step()
        steps += 1
        if steps == 3:
            print("decoding", flush=True)


def main(out: Path, then_long: bool = False) -> int:
    """The schedule; with `then_long`, once it is written ("schedule done"), one long request."""
    import faulthandler
    import signal

    from gmlx.distributed import start

    faulthandler.register(signal.SIGUSR1, all_threads=True)  # a test that times out asks for the stacks
    cluster = start()
    lm = cluster.load(None)
    if not cluster.leader:
        with open(out / f"rank{cluster.rank}.jsonl", "w") as f:
            def seen(sid, r):
                f.write(json.dumps([sid, r.request_id, list(r.tokens), r.finish_reason]) + "\n")
                f.flush()

            cluster.on_replica_finish = seen
            return cluster.follow(lm)
    with cluster:
        result = run(lm, lambda config, switches: cluster.engine(lm, config, switches=switches))
        (out / "rank0.json").write_text(json.dumps({**result, "stats": cluster.stats}))
        print("schedule done", flush=True)
        if then_long:
            run_long(lm, cluster)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(Path(sys.argv[1]), then_long="--then-long" in sys.argv[2:]))
