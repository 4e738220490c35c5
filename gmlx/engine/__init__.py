"""The engine: one step at a time (engine.py) over the two decode lanes (lanes.py), as a
thread-safe service (service.py), meeting any other process that runs it at one seam (peers.py);
over the Row record (gmlx/row.py), request intake, streams and metrics; the stream oracle (oracle.py)."""

__all__ = ["Engine"]


def __getattr__(name: str):
    """`Engine` on first use: engine.py pulls in mlx-lm, which the light modules here (stream,
    metrics, intake) do not need."""
    if name == "Engine":
        from gmlx.engine.engine import Engine

        return Engine
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
