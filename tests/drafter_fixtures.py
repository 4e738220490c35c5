"""Drafters for the oracle tests: the target itself as its own draft model (greedy acceptance
must then be total, which proves the draft cache is rolled back exactly), a random tiny llama
with the target's tokenizer (mostly rejected drafts), and the shipped assistant head."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten

from gmlx.models.loading import default_model_path, load

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def random_draft_dir(dest: Path, layers: int = 2, hidden: int = 64, seed: int = 0) -> Path:
    """A random llama with the embedded model's tokenizer, as an mlx-lm model directory."""
    from mlx_lm.models import llama

    src = default_model_path()
    cfg = json.loads((src / "config.json").read_text())
    cfg.update(hidden_size=hidden, num_hidden_layers=layers, intermediate_size=2 * hidden, num_attention_heads=2,
               num_key_value_heads=1)
    for k in ("speculative_width_cap", "num_draft_tokens"):
        cfg.pop(k, None)
    mx.random.seed(seed)
    model = llama.Model(llama.ModelArgs.from_dict(cfg))
    dest.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(dest / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (dest / "config.json").write_text(json.dumps(cfg))
    for f in TOKENIZER_FILES:
        if (src / f).exists():
            shutil.copy(src / f, dest / f)
    return dest


def draft_lm(kind: str, lm, tmp_factory):
    if kind == "draft-self":
        return lm
    if kind == "draft-random":
        return load(random_draft_dir(tmp_factory.mktemp("draft") / "random"))
    if kind == "draft-shipped":
        return load(default_model_path() / "draft")
    return None


def random_assistant(lm, seed: int = 0):
    """An untrained assistant head for the target (drafts mostly rejected; the stream must not care)."""
    from gmlx.heads.assistant_head import AssistantConfig, AssistantHead
    from gmlx.drafters.assistant import AssistantDrafter

    mx.random.seed(seed)
    head = AssistantHead(AssistantConfig.for_target(lm.config, intermediate_size=256))
    mx.eval(head.parameters())  # sync: materialise the random weights once
    return AssistantDrafter(head, lm.target)
