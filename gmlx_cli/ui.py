"""Small rendering helpers shared by the commands: messages, key/value blocks, versions.

Streams are looked up at call time (never bound at import), so tests that swap sys.stdout /
sys.stderr (click's CliRunner) see everything.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from importlib import metadata
from typing import TextIO

PROG = "gmlx"


def one_line(message: str) -> str:
    """Collapse a message to one line: the boundary promises exactly one line per error."""
    return " ".join(str(message).split()) or "(no message)"


def error(message: str) -> None:
    print(f"{PROG}: error: {one_line(message)}", file=sys.stderr, flush=True)


def notice(message: str) -> None:
    print(f"{PROG}: notice: {one_line(message)}", file=sys.stderr, flush=True)


def version_of(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "not installed"


def kv_block(rows: Sequence[tuple[str, str]], *, title: str | None = None, file: TextIO | None = None) -> None:
    """Print aligned `key: value` rows; a rich table on a terminal, plain text otherwise.

    Plain text when piped keeps the output greppable and free of escape codes.
    """
    out = file or sys.stdout
    if out.isatty():
        from rich.console import Console
        from rich.table import Table

        table = Table(title=title, show_header=False, box=None, title_justify="left", pad_edge=False)
        table.add_column(style="bold cyan", no_wrap=True)
        table.add_column(overflow="fold")
        for key, value in rows:
            table.add_row(key, value)
        Console(file=out, highlight=False).print(table)
        return
    if title:
        print(title, file=out)
    width = max((len(k) for k, _ in rows), default=0)
    for key, value in rows:
        print(f"{key + ':':<{width + 1}} {value}", file=out)
    out.flush()
