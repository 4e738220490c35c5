"""The arms of an in-process benchmark and the matrix that runs them.

An arm is one way to serve the workload: the engine as configured (or one side of the
PREEMPT/RESUME A/B: switches passed to a fresh Engine per run, never the process environment, so
arms cannot leak into each other), the same engine without speculation, mlx-lm's BatchGenerator or
stream_generate. Arms alternate (ABBA) within every cell so that drift on a shared machine hits
them alike (docs/design.md §8). A `Run` is one arm at one concurrency, one repeat: what `gmlx
bench`, `bench --url` and `sweep-cap --validate` measure and report alike.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field, replace

from gmlx.config import EngineConfig, Switches
from gmlx.engine import Engine
from gmlx_cli.bench.baselines import MlxBatchBackend, MlxStreamBackend
from gmlx_cli.bench.driver import Backend, EngineBackend, drive


@dataclass(frozen=True)
class Arm:
    name: str
    backend: str = "gmlx"  # gmlx | mlx-lm-batch | mlx-lm-stream | http (bench --url)
    speculative: bool = True
    preempt: bool = True
    resume: bool = True


@dataclass
class Run:
    arm: Arm
    concurrency: int
    repeat: int
    cap: str = "-"
    outcomes: list = field(default_factory=list)
    transitions: dict = field(default_factory=dict)
    complete: bool = False  # False: interrupted (or still running); its cell is marked partial
    server_spec: dict | None = None  # bench --url: what the run added to the server's spec_decode counters


def plan_arms(ab: str | None, baselines: list[str], env: Switches, has_drafter: bool) -> list[Arm]:
    base = Arm("gmlx", speculative=has_drafter, preempt=env.preempt, resume=env.resume)
    if ab == "preempt":
        arms = [replace(base, name=f"gmlx-preempt{int(p)}", preempt=p) for p in (True, False)]
    elif ab == "resume":
        arms = [replace(base, name=f"gmlx-resume{int(r)}", resume=r) for r in (True, False)]
    elif ab == "both":
        arms = [replace(base, name=f"gmlx-preempt{int(p)}-resume{int(r)}", preempt=p, resume=r)
                for p, r in itertools.product((True, False), repeat=2)]
    else:
        arms = [base]
    if "plain" in baselines:
        arms.append(replace(base, name="gmlx-plain", speculative=False))
    if "mlx-lm" in baselines:
        arms += [Arm("mlx-lm-batch", "mlx-lm-batch", False), Arm("mlx-lm-stream", "mlx-lm-stream", False)]
    return arms


def make_backend(lm, arm: Arm, config: EngineConfig, concurrency: int, ignore_eos: bool,
                 new_engine=Engine) -> tuple[Backend, str]:
    """A fresh backend for one run, and the cap it runs under (for the view and the tables).
    `new_engine`: Engine, or a cluster's (--distributed: the same engine on every rank)."""
    if arm.backend == "mlx-lm-batch":
        return MlxBatchBackend(lm, ignore_eos, concurrency), "-"
    if arm.backend == "mlx-lm-stream":
        return MlxStreamBackend(lm, ignore_eos), "-"
    engine = new_engine(lm, replace(config, speculative=arm.speculative),
                        switches=Switches(preempt=arm.preempt, resume=arm.resume))
    return EngineBackend(engine), engine.cap_in_force.text if arm.speculative else "-"


def run_matrix(lm, arms, requests, ids, concurrencies, repeats, config, view, runs, ignore_eos=False,
               new_engine=Engine) -> list[Run]:
    """Every (concurrency, repeat) runs every arm, in ABBA order. Each run is appended to `runs`
    before it starts, so an interrupt leaves the caller the partial one too."""
    for c in concurrencies:
        for rep in range(repeats):
            for arm in arms if rep % 2 == 0 else arms[::-1]:
                backend, cap = make_backend(lm, arm, config, c, ignore_eos, new_engine)
                run = Run(arm, c, rep, cap)
                runs.append(run)
                view.begin(f"{arm.name} c={c} rep {rep}", speculative=arm.speculative, cap=cap)
                try:
                    drive(backend, requests, ids, c, view.on_event, view.submitted, done=run.outcomes)
                    run.complete = True
                finally:
                    run.transitions = backend.transitions()
                view.end(run.outcomes)
    return runs


