"""One of several HTTP front processes (``heron serve --api-server-count N``).

The launcher (:mod:`heron.server.api_servers`) starts it as ``python -m heron.server.api_server``
with its :class:`ApiServerArgs` in the environment (not the command line, which every user can
read: it holds the API key). It attaches to the engine core the launcher started and serves the
listening socket it inherited, beside its siblings. Its standard input is the launcher's pipe:
when the launcher is gone, the front shuts down as on SIGTERM.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
import threading

import msgspec

from heron.engine.core_client import EngineCoreClient, EngineStartupError
from heron.engine.messages import FrontEndpoints
from heron.server.front import ServeOptions, run_front

ARGS_VARIABLE = "HERON_API_SERVER_ARGS"


class ApiServerArgs(msgspec.Struct):
    options: ServeOptions
    endpoints: FrontEndpoints
    core_pid: int
    listen_fd: int  # the shared listening socket, inherited


def _stop_with_the_launcher() -> None:
    """Block until the launcher's pipe closes, then shut this front down (an unbuffered read:
    a buffered one would hold a lock the interpreter's exit waits for)."""
    while os.read(sys.stdin.fileno(), 1):
        pass
    os.kill(os.getpid(), signal.SIGTERM)


def main() -> int:
    args = msgspec.json.decode(os.environ.pop(ARGS_VARIABLE), type=ApiServerArgs)
    level = args.options.log_level.upper()
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("heron").setLevel(min(logging.INFO, logging.getLogger().level))
    threading.Thread(target=_stop_with_the_launcher, name="heron-launcher", daemon=True).start()
    first = args.endpoints.index == 0  # the one that reports what all of them see
    try:
        engine = EngineCoreClient.attach(args.endpoints, args.core_pid)
        listener = socket.socket(fileno=args.listen_fd)
        return run_front(engine, args.options, [listener], args.endpoints.index)
    except EngineStartupError as e:
        if first:
            print(f"heron: error: the engine could not start: {e}", file=sys.stderr)
        return 2
    except ValueError as e:  # a server option the model cannot serve
        if first:
            print(f"heron: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
