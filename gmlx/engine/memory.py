"""The engine at rest: wait until it has no work, and the MLX memory it holds then (what a run's
requests leaked, with the prompt cache reported apart). The load generator measures with it."""

from __future__ import annotations

import gc
import time

import mlx.core as mx

from gmlx.engine.engine import Engine


def settle(eng: Engine, timeout: float = 30.0) -> None:
    """Wait (bounded) until the engine has no work: retirement into the prompt cache is done."""
    deadline = time.monotonic() + timeout
    while eng.has_work:
        if time.monotonic() > deadline:
            raise TimeoutError(f"the engine still had work {timeout} s after the last stream ended")
        time.sleep(0.005)


def memory_now(eng: Engine) -> dict:
    """Active memory with nothing in flight: the prompt cache (bounded by its budget, and meant
    to outlive requests) is reported, then emptied, so what remains is what requests leaked."""
    settle(eng)
    gc.collect()
    mx.clear_cache()
    held = {"active_with_prompt_cache": mx.get_active_memory(),
            "prompt_cache_bytes": eng.prompt_cache.nbytes if eng.prompt_cache else 0,
            "prompt_cache_entries": len(eng.prompt_cache) if eng.prompt_cache else 0}
    if eng.prompt_cache is not None:
        eng.prompt_cache.clear()
    gc.collect()
    mx.clear_cache()
    return {"active": mx.get_active_memory(), **held}
