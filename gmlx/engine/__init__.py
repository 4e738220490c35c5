"""The engine: one step at a time (engine.py), as a thread-safe service (service.py), over the
Row record (row.py), request intake, streams and metrics."""

from gmlx.engine.engine import Engine

__all__ = ["Engine"]
