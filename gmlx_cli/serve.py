"""`gmlx serve`: parse -> engine -> the OpenAI-compatible server (gmlx/serve/) until SIGINT/SIGTERM."""

from __future__ import annotations

import logging
from typing import Annotated

import typer

from gmlx import blas
from gmlx.config import EngineConfig
from gmlx.errors import GmlxError, InvalidRequest
from gmlx_cli import dist, ui
from gmlx_cli.loader import loader
from gmlx_cli.options import (DebugOpt, DistributedOpt, DrafterOpt, DraftModelOpt, ModelOpt, NumDraftOpt,
                              SpeculativeOpt, WidthCapOpt, check_no_speculative)

_SERVER = "Server"
HostOpt = Annotated[str, typer.Option("--host", help="Address to listen on (127.0.0.1: this machine only; 0.0.0.0:"
                                      " every interface).", rich_help_panel=_SERVER)]
PortOpt = Annotated[int, typer.Option("--port", help="TCP port (0: any free port).", rich_help_panel=_SERVER)]
ApiKeyOpt = Annotated[
    str | None, typer.Option("--api-key", envvar="GMLX_API_KEY", help="Require `Authorization: Bearer KEY` on /v1"
                             " (also GMLX_API_KEY, which keeps the key out of the process list).", show_default=False,
                             rich_help_panel=_SERVER)]
ServedNameOpt = Annotated[
    str | None, typer.Option("--served-model-name", help="The model id clients send and /v1/models lists. Default:"
                             " the model's name.", show_default=False, rich_help_panel=_SERVER)]
MaxQueuedOpt = Annotated[int, typer.Option("--max-queued", help="Requests waiting for the engine at most; more get"
                                           " 429 with Retry-After.", rich_help_panel=_SERVER)]
LogLevelOpt = Annotated[str, typer.Option("--log-level", help="uvicorn's log level: critical, error, warning, info,"
                                          " debug (info logs every request).", rich_help_panel=_SERVER)]
_LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


class MissingExtra(GmlxError):
    """The web dependencies are not installed."""


def serve(
    ctx: typer.Context,
    model: ModelOpt = None,
    host: HostOpt = "127.0.0.1",
    port: PortOpt = 8000,
    api_key: ApiKeyOpt = None,
    served_model_name: ServedNameOpt = None,
    max_queued: MaxQueuedOpt = EngineConfig.max_queued,
    num_draft_tokens: NumDraftOpt = None,
    draft_model: DraftModelOpt = None,
    drafter: DrafterOpt = None,
    speculative: SpeculativeOpt = None,
    speculative_width_cap: WidthCapOpt = None,
    log_level: LogLevelOpt = "info",
    distributed: DistributedOpt = False,
    debug: DebugOpt = False,  # noqa: ARG001 - read by the error boundary
) -> None:
    """Serve the model over an OpenAI-compatible HTTP API: /v1/completions, /v1/chat/completions, /v1/models,
    /health, /metrics. Ctrl-C (or SIGTERM) ends live streams with a finish reason and exits 0."""
    try:
        from gmlx.serve import create_app
        from gmlx.serve.server import Server, bind
    except ImportError as e:
        raise MissingExtra(f"gmlx serve needs the web dependencies ({e.name} is missing): {ui.install_extra('serve')}")
    if log_level not in _LOG_LEVELS:
        raise InvalidRequest(f"--log-level must be one of {', '.join(_LOG_LEVELS)}; got {log_level!r}")
    if api_key is not None and not api_key.strip():
        raise InvalidRequest("--api-key is empty; give a key or leave the option out")
    if not 0 <= port <= 65535:
        raise InvalidRequest(f"--port must be in 0..65535, got {port}")
    check_no_speculative(speculative, drafter=drafter, draft_model=draft_model, num_draft_tokens=num_draft_tokens)
    config = EngineConfig(speculative=speculative, num_draft_tokens=num_draft_tokens, drafter=drafter,
                          draft_model=str(draft_model) if draft_model else None, width_cap=speculative_width_cap,
                          max_queued=max_queued).validated()
    blas.warn_if_reference()
    cluster = dist.join(distributed)  # --distributed: rank 0 serves, the other ranks follow its engine
    leader = cluster is None or cluster.leader
    sock = bind(host, port) if leader else None  # a taken port is an error before the (slow) model load
    engine = None
    try:
        lm = dist.load(cluster, model, loader(ctx))  # the other ranks follow rank 0 in here until it ends
        logging.getLogger("transformers").setLevel(logging.ERROR)  # the engine checks prompt lengths itself
        from gmlx.engine import Engine  # mlx-lm: imported when serving, not for --help

        engine = cluster.engine(lm, config) if cluster else Engine(lm, config)
        engine.service.start()  # now, not at the first request: an idle rank 0 beats to the other ranks
        for line in engine.notices:
            ui.notice(line)
        app = create_app(engine, model_name=served_model_name, api_key=api_key)
        mode = engine.spec.summary()
        where = f"http://{host}:{sock.getsockname()[1]}/v1"
        ui.notice(f"serving {app.state.api.model_name} ({mode}) on {where}" + (" (API key required)" if api_key else ""))
        Server(app, log_level=log_level).serve_socket(sock)
    finally:
        if sock is not None:
            sock.close()
        if engine is not None:
            engine.close()
