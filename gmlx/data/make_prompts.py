"""Write gmlx/data/prompts.jsonl: code prompts cut from the default model's held-out files.

Run: ``python -m gmlx.data.make_prompts``. Deterministic for a given Python version: the
held-out files are those `gmlx.training.train_default.split_files` puts in validation; each
prompt is a `def` line with up to the next 3 lines of its body, at most 240 characters.
"""

from __future__ import annotations

import json

from gmlx.data import PROMPTS_FILE
from gmlx.training.train_default import corpus_files, read, split_files


def main(count: int = 48) -> None:
    _, val = split_files(corpus_files())
    prompts: list[str] = []
    per_file = max(1, count // len(val) + 1)
    for f in val:
        lines = read(f).splitlines()
        taken = 0
        for i, line in enumerate(lines):
            if taken >= per_file or len(prompts) >= count:
                break
            if line.lstrip().startswith("def ") and line.rstrip().endswith(":"):
                text = "\n".join(lines[i : i + 4])[:240]
                prompts.append(text + "\n")
                taken += 1
    PROMPTS_FILE.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    print(f"wrote {len(prompts)} prompts to {PROMPTS_FILE}")


if __name__ == "__main__":
    main()
