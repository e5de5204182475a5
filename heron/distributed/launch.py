"""The entry point of every rank under torchrun (or any launcher that sets its environment):

    torchrun --nnodes 2 --node-rank R --nproc-per-node 1 --master-addr HOST0 --master-port P \\
        -m heron.distributed.launch generate --model DIR -tp 2 --prompt "..."

Rank 0 runs the ``heron`` command (``generate``, ``chat``, ``serve``, ``plan``); every other
rank becomes a worker of its engine and takes its model and settings from rank 0.
"""

from __future__ import annotations

import sys

from heron.cli import build_parser, engine_config
from heron.cli import main as cli_main
from heron.distributed.rendezvous import Rendezvous
from heron.distributed.worker import run_worker
from heron.platforms import resolve_device


def main(argv: list[str] | None = None) -> int:
    rv = Rendezvous.from_env()
    if rv is None:
        print(
            "heron.distributed.launch: RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT are not "
            "set; run it under torchrun",
            file=sys.stderr,
        )
        return 2
    if rv.rank == 0:
        return cli_main(argv)
    config = engine_config(build_parser().parse_args(argv))
    if config.tensor_parallel_size != rv.world_size:
        print(
            f"heron.distributed.launch: --tensor-parallel-size {config.tensor_parallel_size} "
            f"but WORLD_SIZE={rv.world_size}",
            file=sys.stderr,
        )
        return 2
    run_worker(rv, resolve_device(config.device).type)
    return 0


if __name__ == "__main__":
    sys.exit(main())
