"""A fixed schedule of engine sessions, run by tests/test_distributed.py twice: in one process
(the reference) and on two ranks over loopback (`python tests/dist_schedule.py OUT` in each rank,
MLX_HOSTFILE / MLX_RANK set). Steps are driven by the caller, so both runs see the same arrivals
at the same steps: scalar greedy and seeded, a batch, a preempt that gates over cap 2 and
resumes, a cancellation and a close with a request still live.

Each rank writes OUT/rank{R}.json: its finished streams (session, rid, tokens, finish reason),
rank 0's transition counts per session, and its communication statistics.
"""

from __future__ import annotations

import json
import os
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
        submit(0, _p(20))
        drain()
        submit(1, _p(20, 0.8, seed=7))
        return True

    def batch(submit, drain):  # three at once: a batch, greedy and seeded rows side by side
        submit(2, _p(16))
        submit(3, _p(16, 0.9, seed=3))
        submit(4, _p(16, 0.7, seed=11, top_k=20))
        return True

    def preempt(submit, drain):  # a long request, then two waiters: preempt, gate over cap 2, resume
        submit(0, _p(40, 0.8, seed=5))
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


def main(out: Path) -> int:
    from gmlx.distributed import start

    import time
    t0 = time.perf_counter()
    cluster = start()
    t1 = time.perf_counter()
    lm = cluster.load(None)
    t2 = time.perf_counter()
    print("start", t1 - t0, "load", t2 - t1, file=sys.stderr)
    if not cluster.leader:
        seen = []
        cluster.on_replica_finish = lambda sid, r: seen.append([sid, r.request_id, list(r.tokens), r.finish_reason])
        code = cluster.follow(lm)
        (out / f"rank{cluster.rank}.json").write_text(json.dumps({"records": seen, "stats": cluster.stats}))
        return code
    with cluster:
        result = run(lm, lambda config, switches: cluster.engine(lm, config, switches=switches))
    print("run", time.perf_counter() - t2, file=sys.stderr)
    (out / "rank0.json").write_text(json.dumps({**result, "stats": cluster.stats}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(Path(sys.argv[1])))
