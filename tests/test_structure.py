"""Conventions that keep the engine readable: no UI imports, graph builders never sync."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "gmlx"
GRAPH_BUILDERS = ["sampling.py", "drafters/base.py", "drafters/mtp.py", "drafters/draft_model.py",
                  "drafters/assistant.py", "models/adapter.py", "heads/mtp_head.py", "heads/bound.py",
                  "heads/native_mtp.py", "heads/assistant_head.py", "kv.py", "model_cache.py",
                  "recurrent_journal.py"]


def test_engine_never_imports_ui_libraries():
    for f in ROOT.rglob("*.py"):
        src = f.read_text()
        assert not re.search(r"^\s*(import|from)\s+(typer|rich|pandas)\b", src, re.M), f


def test_graph_builders_do_not_sync():
    pattern = re.compile(r"mx\.eval\(|mx\.async_eval\(|\.item\(\)|\.tolist\(\)")
    for name in GRAPH_BUILDERS:
        for i, line in enumerate((ROOT / name).read_text().splitlines(), 1):
            if pattern.search(line):
                assert "# sync:" in line and ("load time" in line or "setter" in line or "state" in line), f"{name}:{i}: {line}"


def test_every_sync_is_commented():
    pattern = re.compile(r"mx\.eval\(|\.item\(\)|\.tolist\(\)")
    for f in ROOT.rglob("*.py"):
        for i, line in enumerate(f.read_text().splitlines(), 1):
            if pattern.search(line) and not line.lstrip().startswith("#"):
                assert "# sync:" in line, f"{f.relative_to(ROOT)}:{i}: {line.strip()}"
