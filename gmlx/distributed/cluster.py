"""A distributed run: the group of ranks, this rank's shard, and the engines they run together.

Launch every rank with `mlx.launch` (or mpirun) and the same command line; then, in each:

    cluster = gmlx.distributed.start()          # LaunchError when this process runs alone
    lm = cluster.load(path)                      # this rank's shard of the target
    if not cluster.leader:
        raise SystemExit(cluster.follow(lm))     # serve rank 0's engines until it says exit
    engine = cluster.engine(lm, config)          # rank 0: an Engine; submit(), step(), close()
    ...
    cluster.finish()                             # the other ranks exit (code 0)

Rank 0 may build many engines in turn (gmlx bench does, one per run); each starts a session on
every rank ("hello") and ends it at close(). Nothing but rank 0's messages drives the others.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import replace
from pathlib import Path

import mlx.core as mx

from gmlx.config import EngineConfig, Switches
from gmlx.distributed import messages
from gmlx.distributed.channel import Channel, PeerLost, fatal
from gmlx.distributed.liveness import Liveness
from gmlx.distributed.watchdog import Watchdog
from gmlx.errors import GmlxError, LaunchError, ReplicaDivergence
from gmlx.models.loading import LoadedModel
from gmlx.switches import DIST_TIMEOUT

LAUNCH_HINT = ("launch every rank with mlx.launch, e.g. `mlx.launch --backend ring -n 2 --python $(which python)"
               " -- -m gmlx_cli.app generate PROMPT --distributed` (across machines: --hostfile hosts.json)")


def start(backend: str = "any") -> "Cluster":
    """Join the group this process was launched into (a one-line LaunchError when it runs alone)."""
    timeout = DIST_TIMEOUT.value()  # a bad value is an error before any rank waits on another
    group = mx.distributed.init(strict=False, backend=backend)
    if group.size() < 2:
        raise LaunchError(f"--distributed needs 2 or more processes, but this one runs alone; {LAUNCH_HINT}")
    return Cluster(group, timeout)


class Cluster:
    def __init__(self, group, timeout_s: float):
        self.group = group
        self.rank, self.size = group.rank(), group.size()
        self.channel = Channel(group)
        self.watchdog = Watchdog(self.rank, timeout_s)
        self.on_replica_finish = None  # called with (session, FinalRecord) as a follower's engine finishes one
        self._sids = itertools.count(1)
        self.watchdog.arm("connecting the ranks")
        try:
            Liveness(self.channel).start()
        except Exception as e:  # noqa: BLE001
            fatal(self.describe(e, "connecting the ranks"))
        self.watchdog.disarm()

    @property
    def leader(self) -> bool:
        return self.rank == 0

    @property
    def stats(self) -> dict:
        return {"rank": self.rank, "ranks": self.size, **self.channel.stats.as_dict()}

    def load(self, path: str | Path | None = None) -> LoadedModel:
        from gmlx.distributed.shard import load_sharded

        try:
            return load_sharded(path, self.group)
        except LaunchError:
            self.channel.closed = True  # every rank learnt it in the same exchange: nothing more to say
            raise

    # ---- rank 0 ---------------------------------------------------------------------------
    def engine(self, lm: LoadedModel, config: EngineConfig | None = None, *, switches: Switches | None = None,
               draft_model: LoadedModel | str | Path | None = None, drafter=None):
        """A new engine on every rank (rank 0 only). A draft model is loaded by every rank from
        the same path; a drafter object lives in one process and cannot be replicated."""
        from gmlx.distributed.replica import Replica

        if not self.leader:
            raise LaunchError(f"rank {self.rank} follows rank 0's engines; only rank 0 builds them")
        if drafter is not None:
            raise LaunchError("a drafter object lives in one process and cannot be replicated; give --drafter or"
                              " --draft-model instead")
        config = config or EngineConfig()
        if draft_model is not None:
            path = draft_model.path if isinstance(draft_model, LoadedModel) else draft_model
            config = replace(config, draft_model=str(path))
        sid = next(self._sids)
        replica = Replica(lm, config, switches=switches, cluster=self, sid=sid)
        engine = replica.engine
        self.send(messages.hello(sid, engine.config, engine.switches, messages.fingerprint(lm)),
                  f"starting engine {sid}")
        self.channel.position = replica.position
        replica.agree_round_costs()
        return engine

    def send(self, msg: dict, what: str) -> None:
        """Rank 0: one exchange outside a step (hello, close, exit)."""
        self.watchdog.arm(what)
        try:
            self.channel.exchange(msg)
        except Exception as e:  # noqa: BLE001 - a lost rank, a divergence: this rank cannot go on
            fatal(self.describe(e, what))
        self.watchdog.disarm()

    def finish(self, code: int = 0) -> None:
        """Rank 0: the run is over; every other rank exits with `code`. Idempotent."""
        if self.leader and not self.channel.closed:
            self.send({"k": messages.EXIT, "code": code}, "ending the run")
            self.channel.closed = True

    def __enter__(self) -> "Cluster":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.finish(0 if exc_type is None else 1)

    # ---- the other ranks ------------------------------------------------------------------
    def follow(self, lm: LoadedModel) -> int:
        """Serve rank 0's engines until it ends the run; returns the exit code rank 0 sent."""
        replica = None
        while True:
            self.watchdog.arm("waiting for rank 0's next message")
            try:
                msg = self.channel.exchange(None)
            except Exception as e:  # noqa: BLE001
                fatal(self.describe(e, "waiting for rank 0"))
            kind = msg["k"]
            if kind == messages.STEP:
                replica.follow(msg)
                time.sleep(msg.get("nap", 0))  # rank 0 is idle: wait here, not spinning in the next exchange
            elif kind == messages.HELLO:
                replica = self._replica(lm, msg)
                replica.agree_round_costs()
            elif kind == messages.COSTS:
                replica.follow_costs(msg)
            elif kind == messages.CLOSE:
                replica.end()
                replica = None
            else:
                self.watchdog.disarm()
                self.channel.closed = True
                return int(msg["code"])

    def _replica(self, lm: LoadedModel, msg: dict):
        from gmlx.distributed.replica import Replica

        if msg["model"] != messages.fingerprint(lm):
            fatal(f"distributed: rank {self.rank} loaded another model than rank 0 (config, drafter head or K"
                  " differ); give every rank the same model directory")
        config, switches = messages.config_of(msg)
        try:
            replica = Replica(lm, config, switches=switches, cluster=self, sid=msg["sid"])
        except GmlxError as e:
            fatal(f"rank {self.rank}: {e}")
        self.channel.position = replica.position
        return replica

    # ---- messages -------------------------------------------------------------------------
    def describe(self, e: BaseException, where: str) -> str:
        """One line for a failure that ends this rank."""
        if isinstance(e, ReplicaDivergence):
            return f"distributed: rank {self.rank}, {where}: {e}"
        text = str(e)
        ring = isinstance(e, RuntimeError) and ("[ring]" in text or "connection" in text.lower())
        if isinstance(e, PeerLost) or ring:
            return (f"distributed: rank {self.rank} lost the connection to another rank {where} ({e}); that rank"
                    " died or its host went away: its own output names why")
        return f"distributed: rank {self.rank} failed {where}: {type(e).__name__}: {e}"
