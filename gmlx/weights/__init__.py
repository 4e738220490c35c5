"""The weights gmlx ships: the embedded default model with its drafters (an EAGLE-3 head among
them), and the heads trained for SmolLM2-135M-Instruct's GGUF: an MTP head and an EAGLE-3 head (package data: pyproject.toml
lists them for the wheel)."""

from __future__ import annotations

from pathlib import Path

DEFAULT_MODEL = Path(__file__).resolve().parent / "default_model"
SMOLLM2_HEAD = Path(__file__).resolve().parent / "smollm2"
SMOLLM2_EAGLE3 = SMOLLM2_HEAD / "eagle3"
EMBEDDED_EAGLE3 = DEFAULT_MODEL / "eagle3"
