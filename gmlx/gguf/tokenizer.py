"""Tokenizer files for a converted GGUF model, built by transformers' GGUF tokenizer converter.

A GGUF file has no tokenizer.json: the vocabulary, merges, special ids and chat template are
metadata under llama.cpp's key names. transformers converts those to a `tokenizers` tokenizer;
we feed it the metadata `mx.load` already returned, grouped as its mapping expects, rather than
call its own file reader (which imports torch).
"""

from __future__ import annotations

import json
from pathlib import Path

from gmlx.gguf.reader import GGUFError

# llama.cpp's pre-tokenizers that transformers' converter leaves at GPT-2's split, written as the
# original models' tokenizer.json have them. "smollm": digits split one by one before GPT-2's split
# (llama.cpp: "\p{N}" then the GPT-2 regex; HF's SmolLM tokenizer: Digits(individual) + ByteLevel).
_PRE_TOKENIZERS = {
    "smollm": lambda pt: pt.Sequence([pt.Digits(individual_digits=True),
                                      pt.ByteLevel(add_prefix_space=False, use_regex=True)]),
}
_EOS_KEYS = ("eos_token_id", "eot_token_id", "eom_token_id")  # each ends a turn (llama.cpp's end-of-generation set)


def eos_ids(meta: dict) -> list[int]:
    """The ids that end generation: EOS, and the end-of-turn / end-of-message ids some files add."""
    ids = [int(meta[f"tokenizer.ggml.{k}"]) for k in _EOS_KEYS if f"tokenizer.ggml.{k}" in meta]
    return list(dict.fromkeys(ids))


def _converter():
    """transformers' GGUF metadata names and tokenizer converter (`integrations.gguf`, transformers
    >= 5.18). 5.17 and before keep an older converter elsewhere that builds another tokenizer
    (byte fallback, no pre-tokenizer type), so an older transformers is an error, never a fallback."""
    try:
        from transformers.integrations.gguf.gguf_tokenizer_mapping import (
            GGUF_TOKENIZER_MAPPING,
            convert_gguf_tokenizer,
        )
    except ImportError:
        import transformers

        raise GGUFError(f"transformers {transformers.__version__} cannot build a GGUF file's tokenizer as gmlx"
                        " needs; run `pip install -U 'transformers>=5.18,<6'`") from None
    return GGUF_TOKENIZER_MAPPING, convert_gguf_tokenizer


def write_tokenizer(meta: dict, out: Path, context_length: int | None) -> None:
    """Write tokenizer.json and tokenizer_config.json (chat template, special tokens) into `out`."""
    from tokenizers import pre_tokenizers

    GGUF_TOKENIZER_MAPPING, convert_gguf_tokenizer = _converter()

    grouped = {
        group: {name: meta[f"tokenizer.{key}"] for key, name in renames.items() if f"tokenizer.{key}" in meta}
        for group, renames in GGUF_TOKENIZER_MAPPING.items()
    }
    tok_dict, tok_config = grouped["tokenizer"], grouped["tokenizer_config"]
    if "tokens" not in tok_dict:
        raise GGUFError("the GGUF file has no vocabulary (tokenizer.ggml.tokens)")
    try:
        backend, _ = convert_gguf_tokenizer(meta.get("general.architecture", ""), tok_dict)
    except (ValueError, KeyError) as e:
        raise GGUFError(f"transformers could not build the tokenizer: {e}") from None
    pre = _PRE_TOKENIZERS.get(tok_dict.get("pre_tokenizer_type"))
    if pre is not None:
        backend.pre_tokenizer = pre(pre_tokenizers)
    backend.save(str(out / "tokenizer.json"))

    tokens = tok_dict["tokens"]

    def token(key: str) -> str | None:
        i = meta.get(f"tokenizer.ggml.{key}")
        return tokens[int(i)] if i is not None and 0 <= int(i) < len(tokens) else None

    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": token("bos_token_id"),
        "eos_token": token("eos_token_id"),
        "unk_token": token("unknown_token_id"),
        "pad_token": token("padding_token_id"),
        "add_bos_token": bool(tok_config.get("add_bos_token", tok_dict.get("tokenizer_type") == "llama")),
        "add_eos_token": bool(tok_config.get("add_eos_token", False)),
        "clean_up_tokenization_spaces": False,
    }
    if context_length:
        config["model_max_length"] = int(context_length)
    if tok_config.get("chat_template"):
        config["chat_template"] = tok_config["chat_template"]
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
