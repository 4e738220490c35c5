"""Load this rank's shard of the target: mlx-lm's tensor parallelism (`model.shard(group)`).

mlx-lm's `shard` splits every attention block by heads (q/k/v projections "all-to-sharded", the
output projection "sharded-to-all", which all_sums) and every MLP by its hidden units, so each
rank holds 1/N of the layers' weights and of the KV cache, and every rank ends each layer with the
full hidden state. The embedding, the final norm and the LM head stay whole on every rank, and so
does what gmlx adds beside the model: the MTP head (one small layer fed the full hidden state) or
a draft model is replicated. The KV-sharing assistant head reads the target's cached K/V, which
sharding splits across ranks, so it is refused (gmlx/distributed/replica.py).

Everything that can be checked from config.json is checked before any weight is read, and every
rank learns whether every other rank passed, so a rank never waits in a collective for a rank
that already gave up.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx

from gmlx.errors import GmlxError, LaunchError
from gmlx.models.loading import LoadedModel, check_model_dir, default_model_path, load


def model_dir(path: str | Path | None) -> Path:
    """The directory a load of `path` reads (a GGUF file: its converted cache directory)."""
    if path is None:
        return default_model_path()
    p = Path(path).expanduser()
    if p.suffix.lower() == ".gguf" and not p.is_dir():
        from gmlx.gguf.convert import cached_conversion

        return cached_conversion(p)
    return p


def model_class(config: dict):
    """mlx-lm's Model class for this config (its `shard` / `pipeline` methods say what it supports)."""
    from mlx_lm.utils import _get_classes

    try:
        return _get_classes(config)[0]
    except (ValueError, KeyError) as e:
        raise LaunchError(f"mlx-lm cannot load model type {config.get('model_type')!r}: {e}") from None


def check_shardable(config: dict, model_cls, world: int) -> None:
    """A one-line LaunchError when `world` ranks cannot split this model by tensor parallelism."""
    kind = config.get("model_type", "?")
    if not hasattr(model_cls, "shard"):
        pipeline = " (it offers only pipeline parallelism, which gmlx does not run)" if _has_pipeline(model_cls) else ""
        raise LaunchError(f"model type {kind!r} ({model_cls.__module__}) has no tensor-parallel `shard` method in"
                          f" mlx-lm{pipeline}; --distributed needs one (llama, mistral, qwen2, qwen3, deepseek_v3, ...)")
    text = {**config, **config.get("text_config", {})}
    heads = text.get("num_attention_heads")
    checks = [("attention heads", heads), ("key/value heads", text.get("num_key_value_heads", heads)),
              ("MLP hidden units (intermediate_size)", text.get("intermediate_size"))]
    for what, n in checks:
        if isinstance(n, int) and n % world:
            raise LaunchError(f"the model has {n} {what}, which {world} ranks cannot split evenly; launch a number"
                              f" of ranks that divides {n}")


def _has_pipeline(model_cls) -> bool:
    """Whether the model's module has a backbone with mlx-lm's pipeline mixin."""
    import importlib

    try:
        from mlx_lm.models.pipeline import PipelineMixin
    except ImportError:
        return False
    module = importlib.import_module(model_cls.__module__)
    return any(isinstance(c, type) and issubclass(c, PipelineMixin) and c is not PipelineMixin
               for c in vars(module).values())


def agree(group, failed: bool) -> int:
    """Every rank says whether it failed; returns how many did (0: all may go on)."""
    out = mx.distributed.all_sum(mx.array([int(failed)], dtype=mx.int32), group=group)
    return int(out.item())  # sync: no rank loads weights while another has given up


def load_sharded(path: str | Path | None, group) -> LoadedModel:
    """This rank's shard of the model at `path` (default: the embedded model)."""
    world = group.size()
    error: GmlxError | None = None
    try:
        p = model_dir(path)
        check_model_dir(p)
        config = json.loads((p / "config.json").read_text())
        check_shardable(config, model_class(config), world)
    except GmlxError as e:
        error = e
    failed = agree(group, error is not None)
    if error is not None:
        raise error
    if failed:
        raise LaunchError(f"rank {group.rank()}: another rank could not use the model (its error names why)")
    return load(path, prepare=lambda model: model.shard(group))
