"""Tensor-parallel speculative decoding over mx.distributed: every rank runs the same engine over
its shard of the target, in lockstep with rank 0 (cluster.py: the API; replica.py: the engine's
peers, met at its one seam, gmlx/engine/peers.py; channel.py: one exchange per step; shard.py: the
sharded load; watchdog.py: bounded waits)."""

from gmlx.distributed.cluster import LAUNCH_HINT, Cluster, start

__all__ = ["Cluster", "LAUNCH_HINT", "start"]
