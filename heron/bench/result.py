"""A benchmark's result as a JSON file: what was run, on what, and what it measured.

``{"bench", "command", "commit", "dirty", "date", "device", "versions", "config",
"metrics"}`` (``bench``: the ``heron bench`` subcommand); each
metric is ``{"name", "value", "unit"}`` with ``"floor"`` (same unit) where the figure has a
bandwidth floor. ``scripts/benchmarks_md.py`` makes BENCHMARKS.md's tables from such files.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import shlex
import subprocess
import sys
from dataclasses import asdict, dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

import heron


@dataclass
class Metric:
    name: str
    value: float
    unit: str
    floor: float | None = None  # the value's bandwidth floor, in its unit
    note: str | None = None  # what a reader must know to read the value

    def describe(self) -> str:
        floor = (
            ""
            if self.floor is None
            else f" ({self.value / self.floor:.2f}x floor {self.floor:.3f})"
        )
        value = f"{self.value:,.0f}" if self.value == int(self.value) else f"{self.value:,.3f}"
        note = "" if self.note is None else f"; {self.note}"
        return f"{self.name}: {value} {self.unit}{floor}{note}"


def git_commit() -> tuple[str | None, bool]:
    """The commit of the source tree ``heron`` is imported from, and whether it has
    uncommitted changes (None where it is not a git checkout)."""
    root = Path(heron.__file__).resolve().parents[1]
    try:
        sha = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        status = subprocess.run(
            ["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True, text=True, check=True,
        ).stdout  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        return None, False
    return sha, bool(status.strip())


def device_name(device: str) -> str:
    """The GPU's name for a CUDA device, else the host's processor."""
    import torch

    if device.startswith("cuda") and torch.cuda.is_available():
        count = torch.cuda.device_count()
        return torch.cuda.get_device_name(device) + (f" (of {count})" if count > 1 else "")
    return f"CPU {platform.machine()}, {os.cpu_count()} cores"


def versions() -> dict[str, str | None]:
    import torch

    out: dict[str, str | None] = {"heron": heron.__version__, "python": platform.python_version()}
    for package in ("torch", "triton", "transformers"):
        try:
            out[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            out[package] = None
    out["cuda"] = torch.version.cuda
    return out


def command_line(argv: list[str] | None = None) -> str:
    """The command as typed: ``heron bench ...``."""
    return shlex.join(["heron", *(sys.argv[1:] if argv is None else argv)])


def result(
    bench: str,
    device: str,
    config: dict[str, Any],
    metrics: list[Metric],
    argv: list[str] | None = None,
    commit: str | None = None,
) -> dict[str, Any]:
    """The result; ``commit`` where git cannot tell the source tree's (else it is asked)."""
    commit, dirty = (commit, None) if commit else git_commit()
    return {
        "bench": bench,
        "command": command_line(argv),
        "commit": commit,
        "dirty": dirty,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": device_name(device),
        "versions": versions(),
        "config": config,
        "metrics": [asdict(m) for m in metrics],
    }


def write(path: str | Path, data: dict[str, Any]) -> None:
    Path(path).write_text(json.dumps(data, indent=2, default=str) + "\n")
