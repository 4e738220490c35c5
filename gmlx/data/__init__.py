"""Shipped prompt sets: held-out code prompts from the validation split of the default model."""

from __future__ import annotations

import json
from pathlib import Path

PROMPTS_FILE = Path(__file__).resolve().parent / "prompts.jsonl"


def load_prompts(path: Path | None = None) -> list[str]:
    """The shipped held-out prompts (one JSON object per line with a "prompt" key)."""
    p = path or PROMPTS_FILE
    return [json.loads(line)["prompt"] for line in p.read_text().splitlines() if line.strip()]
