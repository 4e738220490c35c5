"""`gmlx serve`: an OpenAI-compatible HTTP server on the engine (Starlette + uvicorn).

The only part of gmlx that imports a web framework; `import gmlx` never imports it (install the
`serve` extra: `pip install "gmlx[serve]"`). Parts: openai_wire.py (requests, validation),
chat_wire.py (chat messages, tools, template kwargs), api_error.py (OpenAI's error object),
prediction_wire.py (predicted outputs), responses.py (bodies, chunks, server-sent events),
bridge.py (engine streams -> the event loop), prometheus.py (metrics), app.py (routes), server.py
(uvicorn, signals), loadgen.py (a load generator over HTTP for the load test and benchmark).
"""

from gmlx.serve.app import create_app
from gmlx.serve.server import Background, run

__all__ = ["Background", "create_app", "run"]
