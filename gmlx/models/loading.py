"""Load a target model (and its drafter) from a local directory. Never touches a hub.

A model directory is mlx-lm's format: config.json, *.safetensors, tokenizer files. gmlx adds,
optionally beside them: `mtp_config.json` + `mtp_head.safetensors` (an MTP head, see
`gmlx.models.mtp`), and defaults in config.json: `speculative_width_cap`, `num_draft_tokens`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx

from gmlx.errors import ModelLoadError
from gmlx.models.adapter import Target
from gmlx.models.mtp import MTPConfig, MTPHead

DEFAULT_K = 3  # when a model ships no measured default
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tiktoken.model")


def default_model_path() -> Path:
    """The embedded default model's directory (shipped inside the package)."""
    return Path(__file__).resolve().parent / "default_model"


@dataclass
class LoadedModel:
    path: Path
    name: str
    target: Target
    tokenizer: object  # mlx_lm TokenizerWrapper
    head: MTPHead | None
    config: dict
    default_k: int
    default_cap: int | None
    context_length: int | None

    @property
    def has_drafter(self) -> bool:
        return self.head is not None

    @property
    def eos_ids(self) -> set[int]:
        return set(self.tokenizer.eos_token_ids)


def check_model_dir(path: Path) -> None:
    if not path.exists():
        raise ModelLoadError(f"model path {str(path)!r} does not exist (gmlx loads local directories only)")
    if not path.is_dir():
        raise ModelLoadError(f"model path {str(path)!r} is not a directory")
    missing = []
    if not (path / "config.json").is_file():
        missing.append("config.json")
    if not any(path.glob("*.safetensors")):
        missing.append("*.safetensors weights")
    if not any((path / f).is_file() for f in _TOKENIZER_FILES):
        missing.append("tokenizer files (tokenizer.json or tokenizer.model)")
    if missing:
        raise ModelLoadError(f"{str(path)!r} is not an mlx-lm model directory: missing {', '.join(missing)}")


def load_head(path: Path) -> MTPHead | None:
    cfg_file, w_file = path / "mtp_config.json", path / "mtp_head.safetensors"
    if not cfg_file.is_file() or not w_file.is_file():
        return None
    head = MTPHead(MTPConfig.from_dict(json.loads(cfg_file.read_text())))
    head.load_weights(str(w_file), strict=True)
    head.eval()
    mx.eval(head.parameters())  # sync: materialise weights at load time
    return head


def load(path: str | Path | None = None) -> LoadedModel:
    """Load a local mlx-lm model directory (default: the embedded model) and its MTP head, if any."""
    import mlx_lm

    p = Path(path).expanduser() if path is not None else default_model_path()
    check_model_dir(p)
    try:
        model, tokenizer, config = mlx_lm.load(str(p), return_config=True)
    except (ValueError, FileNotFoundError, KeyError, OSError) as e:
        raise ModelLoadError(f"could not load {str(p)!r} with mlx-lm: {e}") from None
    target = Target(model)
    target.check()
    head = load_head(p)
    ctx = config.get("max_position_embeddings")
    return LoadedModel(
        path=p, name=p.name if path is not None else "gmlx-default", target=target, tokenizer=tokenizer,
        head=head, config=config, default_k=int(config.get("num_draft_tokens", DEFAULT_K)),
        default_cap=config.get("speculative_width_cap"), context_length=int(ctx) if ctx else None,
    )
