"""`--distributed`: a command's side of gmlx.distributed. Every rank runs the same command line
(mlx.launch starts them); rank 0 runs the command, the other ranks load their shard and follow
rank 0's engines until it ends the run, printing nothing but errors."""

from __future__ import annotations

import typer

_cluster = None  # this process's group (MLX's is process-wide too); ended by finish()


def join(distributed: bool):
    """The cluster this process was launched into, or None without --distributed."""
    global _cluster
    if not distributed:
        return None
    from gmlx.distributed import start

    _cluster = start()
    return _cluster


def load(cluster, model, load_alone):
    """Rank 0: its shard of the model. The other ranks follow rank 0 and never return here."""
    if cluster is None:
        return load_alone(model)
    lm = cluster.load(model)
    if not cluster.leader:
        raise typer.Exit(cluster.follow(lm))
    return lm


def finish(code: int) -> None:
    """Called once the command returned (gmlx_cli.app.main): rank 0 lets the others exit."""
    global _cluster
    cluster, _cluster = _cluster, None
    if cluster is not None:
        cluster.finish(code)
