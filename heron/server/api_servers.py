"""``heron serve --api-server-count N``: N HTTP front processes on one port, one engine core.

As vLLM's and uvicorn's workers do, this launcher binds the listening socket and hands it to
every front (:mod:`heron.server.api_server`), so the kernel spreads connections over the fronts.
Each front binds its own pair of ZMQ sockets; the core (started here) connects to all of them and
sends each request's outputs back to the front that sent it.

The launcher only supervises. A signal (SIGTERM, or Ctrl-C: the fronts run in their own
sessions, so only the launcher gets it) stops the fronts, which end their requests, then the
core. A front that dies stops the whole server; a core that dies makes every front answer its
requests with 503 and exit, and the server with them (exit status 1), as a single front does.

``/metrics``: the request metrics of every front are summed by prometheus_client's
multiprocess mode (``PROMETHEUS_MULTIPROC_DIR``, a directory made here: each front writes its
counters and histograms to files there, and a scrape of any front reads them all); the engine
gauges come from the core's stats snapshots, which every front receives.
"""

from __future__ import annotations

import logging
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from contextlib import suppress

import msgspec

from heron.config import EngineConfig
from heron.engine.core_launch import CoreProcess, front_endpoints, remove_sockets
from heron.server.api_server import ARGS_VARIABLE, ApiServerArgs
from heron.server.front import ServeOptions

logger = logging.getLogger(__name__)

# How long a front gets to end its streams after SIGTERM (uvicorn's graceful 30 s, and some).
FRONT_STOP_S = 35.0
# Exit status of a front whose engine could not start (it printed why).
STARTUP_FAILED = 2


def serve_with_api_servers(
    config: EngineConfig, options: ServeOptions, count: int, listener: socket.socket
) -> int:
    """Run ``count`` fronts on ``listener`` and the core until a signal; returns the exit
    code."""
    listener.set_inheritable(True)
    metrics_dir = tempfile.mkdtemp(prefix="heron-metrics-")
    endpoints = front_endpoints(count)
    core = CoreProcess(config, options.log_level, endpoints)
    fronts = []
    try:
        env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": metrics_dir}
        for front in endpoints:
            args = ApiServerArgs(options, front, core.pid, listener.fileno())
            env[ARGS_VARIABLE] = msgspec.json.encode(args).decode()
            fronts.append(
                subprocess.Popen(
                    [sys.executable, "-m", "heron.server.api_server"],
                    env=env,
                    stdin=subprocess.PIPE,
                    pass_fds=[listener.fileno()],
                    start_new_session=True,
                )
            )
        listener.close()  # the fronts hold it
        logger.info(
            "starting %d API server processes (%s) on http://%s:%d (OpenAI API under /v1) and "
            "the engine core process %d",
            count,
            ", ".join(str(f.pid) for f in fronts),
            options.host,
            options.port,
            core.pid,
        )
        return _supervise(core, fronts)
    finally:
        _stop(core, fronts)
        remove_sockets(endpoints[0])
        shutil.rmtree(metrics_dir, ignore_errors=True)


def _supervise(core: CoreProcess, fronts: list[subprocess.Popen]) -> int:
    """Wait for a signal (0) or a front's exit (its start-up failure's 2, else 1)."""
    wake_read, wake_write = os.pipe()
    os.set_blocking(wake_write, False)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: os.write(wake_write, b"\0"))
    front_fds = {os.pidfd_open(f.pid): f for f in fronts}
    watched = [wake_read, core.exit_fd, *front_fds]
    try:
        while True:
            ready = select.select(watched, [], [])[0]
            if wake_read in ready:
                return 0
            if core.exit_fd in ready:
                watched.remove(core.exit_fd)
                logger.warning("the engine core process exited with code %s", core.proc.wait())
            exited = [front_fds[fd] for fd in ready if fd in front_fds]
            if exited:
                code = exited[0].wait()
                if code == STARTUP_FAILED:  # they all stop, the first having said why
                    for front in fronts:
                        with suppress(subprocess.TimeoutExpired):
                            front.wait(FRONT_STOP_S)
                    return STARTUP_FAILED
                logger.error(
                    "API server process %d exited with code %d; stopping the server",
                    exited[0].pid,
                    code,
                )
                return 1
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_IGN)  # stopping already: a second signal changes nothing
        for fd in (wake_read, wake_write, *front_fds):
            os.close(fd)


def _stop(core: CoreProcess, fronts: list[subprocess.Popen]) -> None:
    """Stop the fronts (they end their requests), then the core; kill what does not stop."""
    for front in fronts:
        if front.poll() is None:
            front.terminate()
    for front in fronts:
        try:
            front.wait(FRONT_STOP_S)
        except subprocess.TimeoutExpired:
            logger.warning("API server process %d did not stop; killing it", front.pid)
            front.kill()
            front.wait()
        front.stdin.close()
    core.close()  # its standard input: the core exits
    if not core.stop(timeout=30):
        logger.warning("the engine core did not stop within 30 s; killed it")
