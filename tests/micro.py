"""Micro models: random llama weights with the embedded model's tokenizer, built on the fly.

A 2-layer, d=64 model computes almost nothing, so decoding it measures the engine's own host cost
per round (Python, graph building, dispatch, synchronisation): the regime of small and medium
models on a GPU, which a CPU otherwise hides behind its slow matmuls. Random weights are no
language model; they serve only for timing and for exactness checks that need no quality.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import gmlx  # noqa: F401  (OpenBLAS before mlx: benchmarks import this module too)
import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.models import llama

from gmlx.models.loading import default_model_path

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def make_micro_model(out: Path, *, layers: int = 2, d: int = 64, heads: int = 2, kv_heads: int = 1,
                     seed: int = 0) -> Path:
    """Write an mlx-lm llama directory with random weights and the embedded tokenizer to `out`."""
    src = default_model_path()
    cfg = json.loads((src / "config.json").read_text())
    for key in ("speculative_width_cap", "num_draft_tokens"):
        cfg.pop(key, None)
    cfg.update(hidden_size=d, num_hidden_layers=layers, intermediate_size=4 * d, num_attention_heads=heads,
               num_key_value_heads=kv_heads, max_position_embeddings=4096)
    return write_random_model(out, cfg, llama, seed)


def write_random_model(out: Path, cfg: dict, family, seed: int = 0) -> Path:
    """An mlx-lm directory at `out`: `cfg` as config.json, the embedded model's tokenizer, and the
    random weights of `family.Model` (an mlx-lm model module) drawn with `seed`."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    for name in _TOKENIZER_FILES:
        shutil.copy(default_model_path() / name, out / name)
    mx.random.seed(seed)
    model = family.Model(family.ModelArgs.from_dict(cfg))
    mx.save_safetensors(str(out / "model.safetensors"), dict(tree_flatten(model.parameters())))
    return out
