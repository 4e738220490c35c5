"""Helpers for tests/test_user_path.py: the README's commands, read from the README itself, run
as a user runs them: the venv's `gmlx` console script in a subprocess, with none of the test
suite's pinning (no GMLX_* variable, no PYTEST_* or OPENBLAS_NUM_THREADS from conftest) and a
fresh HOME (config and cache dirs under it), so the user's own files are never touched and the
first `--model smollm2` really converts the GGUF, as on a new machine. Every wait is bounded."""

from __future__ import annotations

import os
import re
import shlex
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
BIN = Path(sys.executable).parent  # the venv's bin: `gmlx`, `python`, `pip`, as an activated venv has them
GMLX = BIN / "gmlx"
TIMEOUT_S = 300  # per command: generous on a shared 2-core machine, never unbounded
# What conftest (or pytest, or xdist) sets for the suite and a user's shell does not have.
PINNED = ("GMLX_", "PYTEST_", "OPENBLAS_NUM_THREADS", "HYPOTHESIS_PROFILE")


# ---------------------------------------------------------------- the README


def readme_blocks(section: str, lang: str = "bash") -> list[list[str]]:
    """The fenced `lang` blocks of the README section whose heading starts with `section` (a
    heading line such as "## Commands"; None: the text before the first heading), as lists of
    lines. Fails loudly when the section or its blocks are gone: the README changed shape."""
    text = README.read_text()
    if section is None:
        body = text.split("\n## ", 1)[0]
    else:
        m = re.search(rf"^{re.escape(section)}[^\n]*\n(.*?)(?=^## |\Z)", text, re.M | re.S)
        assert m, f"README.md has no section {section!r}"
        body = m.group(1)
    blocks = [b.strip("\n").splitlines() for b in re.findall(rf"^```{lang}\n(.*?)^```", body, re.M | re.S)]
    assert blocks, f"README.md section {section!r} has no ```{lang} block"
    return blocks


def strip_comment(line: str) -> str:
    """The command without its trailing `# comment` (shell rules: a # that starts a word,
    outside quotes)."""
    quote = None
    for i, ch in enumerate(line):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i].rstrip()
    return line.rstrip()


def readme_commands(section: str | None, lang: str = "bash") -> list[str]:
    """Every command line of the section's fenced blocks, comments stripped."""
    return [c for block in readme_blocks(section, lang) for c in map(strip_comment, block) if c]


def readme_command(section: str | None, *, starts: str, contains: str = "", index: int = 0) -> str:
    """The `index`-th command line of the section that starts with `starts` (after `&&`
    chains are split: the last part) and contains `contains`."""
    found = []
    for line in readme_commands(section):
        part = line.split("&&")[-1].strip()
        if part.startswith(starts) and contains in part:
            found.append(part)
    assert len(found) > index, f"README.md section {section!r}: no command starting {starts!r} with {contains!r}"
    return found[index]


def argv(command: str) -> list[str]:
    """A README command line as argv, the program (`gmlx` or `.venv/bin/gmlx`) the venv's script."""
    words = shlex.split(command, comments=True)
    assert words and Path(words[0]).name == "gmlx", command
    return [str(GMLX), *words[1:]]


def with_options(words: list[str], **options) -> list[str]:
    """argv with each `--opt value` replaced (the README's value dropped) or appended; a value
    of True appends the bare flag. Keys: option names with _ for -."""
    out = list(words)
    for key, value in options.items():
        flag = "--" + key.replace("_", "-")
        if flag in out:
            i = out.index(flag)
            del out[i : i + (1 if value is True else 2)]
        out += [flag] if value is True else [flag, str(value)]
    return out


# ---------------------------------------------------------------- the user's environment


def user_env(home: Path, **extra: str) -> dict[str, str]:
    """os.environ without the suite's pinning and the OpenBLAS variables gmlx set in this process (the
    user's process sets its own), HOME and the XDG config/cache dirs under `home`, and the venv's bin
    first on PATH (an activated venv)."""
    from gmlx import blas

    env = {k: v for k, v in os.environ.items() if not k.startswith(PINNED) and k not in blas.variables_set()}
    env |= {"HOME": str(home), "XDG_CONFIG_HOME": str(home / ".config"), "XDG_CACHE_HOME": str(home / ".cache"),
            "PATH": f"{BIN}{os.pathsep}{env.get('PATH', '')}", "VIRTUAL_ENV": str(BIN.parent)}
    return env | extra


@dataclass
class Ran:
    cmd: str
    returncode: int
    stdout: str
    stderr: str
    seconds: float

    def ok(self) -> "Ran":
        assert self.returncode == 0, f"`{self.cmd}` exited {self.returncode} after {self.seconds:.1f} s\n" \
                                     f"stderr:\n{self.stderr[-4000:]}\nstdout:\n{self.stdout[-2000:]}"
        return self


class User:
    """A user's shell: a fresh HOME, a working directory in it, the venv's commands."""

    def __init__(self, home: Path):
        self.home = home
        self.cwd = home / "work"
        self.cwd.mkdir(parents=True, exist_ok=True)
        self.env = user_env(home)

    def run(self, cmd: list[str] | str, *, env: dict[str, str] | None = None, stdin: str | None = None,
            timeout: float = TIMEOUT_S) -> Ran:
        """argv (run directly), or a README line as written (run by bash: redirections,
        `$(...)`), in the user's working directory."""
        run_env = self.env | (env or {})
        shell = isinstance(cmd, str)
        shown = cmd if shell else shlex.join(cmd)
        t0 = time.monotonic()
        try:
            p = subprocess.run(["bash", "-c", cmd] if shell else cmd, cwd=self.cwd, env=run_env, input=stdin,
                               capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired as e:
            raise AssertionError(f"`{shown}` did not end within {timeout} s\nstderr:\n{e.stderr}") from None
        return Ran(shown, p.returncode, p.stdout, p.stderr, time.monotonic() - t0)


# ---------------------------------------------------------------- serve


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(proc: subprocess.Popen, url: str, log: Path, timeout: float = 180.0) -> dict:
    """Until GET /health answers 200 (the model loaded); fails if the server exits first."""
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise AssertionError(f"gmlx serve exited {proc.returncode} before answering /health:\n{log.read_text()}")
        try:
            r = httpx.get(url + "/health", timeout=5)
            if r.status_code == 200:
                return r.json()
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            raise AssertionError(f"gmlx serve did not answer /health within {timeout} s:\n{log.read_text()}")
        time.sleep(0.2)


# ---------------------------------------------------------------- output


def stats_rows(stderr: str) -> dict[str, str]:
    """The `name: value` rows of generate's stats block on stderr (after its ==== line)."""
    block = stderr.rsplit("==========", 1)[-1]
    rows = {}
    for line in block.splitlines():
        if ":" in line:
            k, v = line.split(":", 1)
            rows[k.strip()] = v.strip()
    return rows
