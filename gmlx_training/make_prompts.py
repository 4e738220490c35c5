"""Write gmlx/data/prompts.jsonl: code prompts cut from the default model's held-out files.

Run: ``python -m gmlx_training.make_prompts``. Deterministic for a given Python version and default
model: the held-out files are those `gmlx_training.stdlib_corpus.split_files` puts in validation;
each prompt is a `def` line with up to the next 3 lines of its body, at most 240 characters; a
candidate the default model ends at EOS before its first token (greedy) is skipped for the next one
in the same file, so that every request of `gmlx bench`'s default workload has tokens (two nested
`factory()` definitions in asyncio/streams.py were such prompts). SmolLM2 (`--model smollm2`, the
raw text, greedy) does not end any of the 48 at once either (checked when the file was written;
tests/test_bench_prompts.py checks both).
"""

from __future__ import annotations

import json

from gmlx.data import PROMPTS_FILE
from gmlx_training.stdlib_corpus import corpus_files, read, split_files


def starts_at_eos(lm=None):
    """A predicate: does `lm` (default: the embedded model) end this prompt at EOS before its first
    token, decoding greedily?"""
    from gmlx.config import SamplingParams
    from gmlx.engine.intake import tokenize
    from gmlx.models.loading import load
    from gmlx.engine.oracle import run_scalar

    lm = lm or load(None)

    def check(prompt: str) -> bool:
        out = run_scalar(lm, tokenize(lm, prompt), SamplingParams(max_tokens=1, temperature=0.0), speculative=False)
        return not out.tokens
    return check


def main(count: int = 48, skip=None) -> None:
    skip = skip or starts_at_eos()
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
                text = "\n".join(lines[i : i + 4])[:240] + "\n"
                if skip(text):
                    continue
                prompts.append(text)
                taken += 1
    PROMPTS_FILE.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    print(f"wrote {len(prompts)} prompts to {PROMPTS_FILE}")


if __name__ == "__main__":
    main()
