"""The training corpus of the embedded default model and its drafters: the Python standard library.

Corpus: every ``.py`` file of this interpreter's standard library (``sysconfig`` stdlib path),
excluding ``test/``, ``tests/``, ``idlelib/`` and ``site-packages``; sorted by path, so the
selection is fixed for a given Python version. Every 20th file is held out for validation.
Tokenizer: byte-level BPE (HF ``tokenizers``), vocab 2048 (train_default's ``--vocab``).
Batches: random windows of the encoded token stream.
"""

from __future__ import annotations

import sysconfig
from pathlib import Path

from gmlx import blas

blas.ensure_loaded()

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

from gmlx_training.model_card import EOS, EXCLUDE_DIRS  # noqa: E402


def corpus_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for p in sorted(root.rglob("*.py")):
        rel = p.relative_to(root)
        if any(part in EXCLUDE_DIRS for part in rel.parts):
            continue
        files.append(p)
    return files


def split_files(files: list[Path]) -> tuple[list[Path], list[Path]]:
    val = [f for i, f in enumerate(files) if i % 20 == 7]
    train = [f for i, f in enumerate(files) if i % 20 != 7]
    return train, val


def read(f: Path) -> str:
    return f.read_text(encoding="utf-8", errors="replace")


def train_tokenizer(texts: list[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def encode_all(tok, texts: list[str]) -> np.ndarray:
    eos = tok.token_to_id(EOS)
    ids: list[int] = []
    for enc in tok.encode_batch(texts):
        ids.extend(enc.ids)
        ids.append(eos)
    return np.array(ids, dtype=np.int32)


def batches(data: np.ndarray, batch: int, seq: int, rng: np.random.Generator):
    span = seq + 3
    while True:
        starts = rng.integers(0, len(data) - span, size=batch)
        yield mx.array(np.stack([data[s : s + span] for s in starts]))
