"""The engine core process as a front holds it: started by this process, or watched.

Every front binds its own two sockets (:class:`FrontEndpoints`) and the core connects to all of
them, so the core and the fronts may start in any order. The process that starts the core
(:class:`CoreProcess`: ``heron serve``'s front, or the launcher of several fronts) can wait for
it and kill it, and holds its standard input: the core exits when that pipe closes. A front that
a launcher started only watches the core (:class:`WatchedCore`), through a pidfd.
"""

from __future__ import annotations

import gc
import os
import select
import shutil
import subprocess
import sys
import tempfile

import msgspec

from heron.config import EngineConfig
from heron.engine.messages import CoreArgs, FrontEndpoints


def freeze_start_up_heap() -> None:
    """Move what start-up made (model, tokenizer, graphs, the importers' objects), which lives
    as long as the process, out of the collector's sight: a full collection then no longer
    walks it, a pause that a step would wait out (vLLM's engine process does the same). The
    core and every front call it once started."""
    gc.collect()
    gc.freeze()


def front_endpoints(count: int) -> list[FrontEndpoints]:
    """Socket addresses for ``count`` fronts, in a new directory (see :func:`remove_sockets`)."""
    directory = tempfile.mkdtemp(prefix="heron-core-")
    return [
        FrontEndpoints(i, f"ipc://{directory}/input-{i}", f"ipc://{directory}/output-{i}")
        for i in range(count)
    ]


def remove_sockets(endpoints: FrontEndpoints) -> None:
    """Remove the directory of the sockets (of every front)."""
    directory = os.path.dirname(endpoints.input_address.removeprefix("ipc://"))
    shutil.rmtree(directory, ignore_errors=True)


class CoreProcess:
    """The core, started here for these fronts."""

    def __init__(self, config: EngineConfig, log_level: str, fronts: list[FrontEndpoints]) -> None:
        args = CoreArgs(config, fronts, log_level)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "heron.engine.core_process", msgspec.json.encode(args).decode()],
            stdin=subprocess.PIPE,
        )
        self.pid = self.proc.pid
        self.exit_fd = os.pidfd_open(self.pid)  # readable once the core has exited

    @property
    def running(self) -> bool:
        return self.proc.poll() is None

    @property
    def exit_code(self) -> int | None:
        return self.proc.returncode

    def stop(self, timeout: float | None) -> bool:
        """Wait up to ``timeout`` seconds for the core to exit, then kill it; False if killed."""
        try:
            self.proc.wait(timeout)
            return True
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            return False

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()

    def close(self) -> None:
        """Close the core's standard input (it exits, if it still runs) and the pidfd."""
        self.proc.stdin.close()
        os.close(self.exit_fd)


class WatchedCore:
    """A core another process started: whether it runs, but not its exit code."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.exit_fd = os.pidfd_open(pid)

    @property
    def running(self) -> bool:
        return not select.select([self.exit_fd], [], [], 0)[0]

    exit_code = None  # only the parent can read it

    def close(self) -> None:
        os.close(self.exit_fd)
