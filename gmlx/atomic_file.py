"""Write a small text file whole or not at all: a reader sees the old file or the new one, never
half of either (the user config, gmlx/policy/toml_write.py; kept load-time measurements,
gmlx/measured.py)."""

from __future__ import annotations

import os
import tempfile
from contextlib import suppress
from pathlib import Path


def write_atomic(path: Path, text: str) -> None:
    """Write `text` to `path` through a temporary file beside it, renamed over it; through a symlink
    (dotfile managers), keeping the file's mode. OSError when the directory cannot be written."""
    target = Path(path).resolve()
    target.parent.mkdir(parents=True, exist_ok=True)
    mode = target.stat().st_mode & 0o777 if target.exists() else 0o644
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, target)  # atomic on POSIX: readers see the old or the new file
    except BaseException:
        with suppress(OSError):
            os.unlink(tmp)
        raise
