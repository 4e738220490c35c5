"""Check --out before any work: a results directory that cannot be written must not cost a run
(the files are written only at the end, after minutes of measuring)."""

from __future__ import annotations

import tempfile
from pathlib import Path

from gmlx.errors import InvalidRequest

# Where `gmlx bench` writes without --out: ./runs, a scratch directory (ignored by this repository's
# .gitignore), never the committed bench_results/ (those are curated runs, each with its README line).
DEFAULT_OUT = Path("runs")


def check_out_dir(out: Path, flag: str = "--out") -> None:
    """`out` is a writable directory, or one that can be created; nothing is created here."""
    path = Path(out).expanduser()
    if path.exists() and not path.is_dir():
        raise InvalidRequest(f"{flag} {str(out)!r} is a file, not a directory; give a directory for the results")
    existing = path
    while not existing.exists():  # the nearest ancestor that exists: where mkdir would start
        existing = existing.parent
    if not existing.is_dir():
        raise InvalidRequest(f"{flag} {str(out)!r} cannot be created: {str(existing)!r} is a file;"
                             " give a directory for the results")
    try:
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as e:
        raise InvalidRequest(f"{flag} {str(out)!r} is not writable ({e.strerror or e} in {str(existing)!r});"
                             " give a directory you can write to") from None
