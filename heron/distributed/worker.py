"""A tensor-parallel worker (every rank but 0): it joins the group, builds its runner from
what rank 0 sends, then runs each call rank 0 broadcasts, in order, until told to stop.

``python -m heron.distributed.worker '{"rendezvous": {...}, "device_type": "cpu"}'`` is how
rank 0 starts the workers of its host; torchrun-launched ranks enter through
``heron.distributed.launch``.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import threading

import torch
import torch.distributed as dist

from heron.distributed.rendezvous import Rendezvous, join, min_over_ranks
from heron.execution.model_runner import LaunchedStep, ModelRunner
from heron.execution.step_plan import StepPlan
from heron.loader.update import WeightSource, apply_update, plan_update
from heron.platforms import platform_for

logger = logging.getLogger(__name__)


class Worker:
    """The calls rank 0's ``TensorParallelRunner`` makes, on this rank's runner.

    Steps are read in launch order, as the engine reads them, so the tokens each rank samples
    join its request states in the same order: a step whose tokens stay on the device is read
    when the next one is launched, after it if the engine passed it as the step in flight,
    before it if the engine had read it already.
    """

    def __init__(self, runner: ModelRunner, control: dist.ProcessGroup) -> None:
        self.runner = runner
        self.control = control
        self._unread: LaunchedStep | None = None

    def reserve_verification(self, max_rows: int, num_proposals: int) -> None:
        self.runner.reserve_verification(max_rows, num_proposals)

    def kv_cache_budget(self, utilization: float, num_tokens: int) -> None:
        min_over_ranks(self.runner.kv_cache_budget(utilization, num_tokens), self.control)

    def allocate_kv_cache(self, num_blocks: list[int]) -> None:
        self.runner.allocate_kv_cache(num_blocks)

    def capture_graphs(self, max_batch: int, verify_query_len: int, verify_max_batch: int) -> None:
        self.runner.capture_graphs(max_batch, verify_query_len, verify_max_batch)

    def launch(self, plan: StepPlan, with_previous: bool) -> None:
        previous, self._unread = self._unread, None
        if previous is not None and not with_previous:
            previous.result()
            previous = None
        step = self.runner.launch(plan, previous)
        if previous is not None:
            previous.result()
        if step.is_ready:
            step.result()
        else:
            self._unread = step

    def update_weights(self, source: WeightSource) -> None:
        """Check this rank's shards, agree with the others, then write them."""
        model = [self.runner.model]
        try:
            routes = plan_update(model, source.read())
        except ValueError:
            logger.exception("weight update refused")
            routes = None
        if min_over_ranks(int(routes is not None), self.control) and routes is not None:
            apply_update(model, routes, source.read)


CALLS = (
    "reserve_verification",
    "kv_cache_budget",
    "allocate_kv_cache",
    "capture_graphs",
    "launch",
    "update_weights",
)


def run_worker(rv: Rendezvous, device_type: str) -> None:
    """Join, build, then serve rank 0's calls until ``shutdown``."""
    tp, control = join(rv, device_type)
    box: list = [None]
    dist.broadcast_object_list(box, src=0, group=control)
    device = torch.device("cuda", rv.local_rank) if device_type == "cuda" else torch.device("cpu")
    worker = Worker(box[0].build(platform_for(device), tp), control)
    while True:
        dist.broadcast_object_list(box, src=0, group=control)
        name, args = box[0]
        if name == "shutdown":
            break
        if name not in CALLS:
            raise ValueError(f"unknown call {name!r} from rank 0")
        getattr(worker, name)(*args)
    dist.destroy_process_group()


def _exit_with_parent() -> None:
    """Standard input is a pipe from rank 0's process: end of file means it is gone."""
    while os.read(sys.stdin.fileno(), 4096):  # unbuffered: holds no lock at shutdown
        pass
    os._exit(1)


def main() -> int:
    spec = json.loads(sys.argv[1])
    rv = Rendezvous(**spec["rendezvous"])
    logging.basicConfig(
        level="WARNING", format=f"%(levelname)s rank {rv.rank} %(name)s: %(message)s"
    )
    threading.Thread(target=_exit_with_parent, daemon=True).start()
    # Ctrl-C reaches the whole process group; rank 0 decides how the workers stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        run_worker(rv, spec["device_type"])
    except Exception:
        logger.exception("tensor-parallel worker rank %d failed", rv.rank)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
