"""Describe the machine and software a measurement ran on (recorded with every result)."""

from __future__ import annotations

import functools
import os
import platform
import subprocess
from importlib import metadata
from pathlib import Path

from gmlx import blas


@functools.cache  # read once: the engine asks for the machine key every round
def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def version(pkg: str) -> str | None:
    try:
        return metadata.version(pkg)
    except metadata.PackageNotFoundError:
        return None


def git_commit(cwd: Path | None = None) -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             cwd=cwd or Path(__file__).resolve().parent, timeout=5)
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def accelerator() -> str:
    """The device MLX computes on, with its name: "Device(gpu, 0) NVIDIA H200", "Device(cpu, 0) AMD EPYC"
    (a GPU run's results must say so: the same code measures very differently there)."""
    import mlx.core as mx

    try:
        name = mx.device_info().get("device_name", "")
    except Exception:  # noqa: BLE001 - an MLX without device_info: the device alone
        name = ""
    return f"{mx.default_device()} {name}".strip()


def describe() -> dict:
    return {
        "cpu": cpu_name(),
        "device": accelerator(),
        "cores": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "blas": blas.active_blas(),
        "mlx": version("mlx"),
        "mlx_lm": version("mlx-lm"),
        "mlx_cuda": version("mlx-cuda-13") or version("mlx-cuda-12"),
        "gmlx": version("gmlx"),
        "git_commit": git_commit(),
        "load_avg_1m": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
    }
