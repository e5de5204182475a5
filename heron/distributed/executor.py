"""The engine's runner when the model spans several ranks: rank 0 runs in the engine's own
process and drives the workers.

The engine schedules once per step and calls this runner as it calls a ``ModelRunner``. Each
call is broadcast to the workers first, as one message on the control channel (a gloo group
in host memory: the step plan is plain data), then run here; every rank then runs the same
step on its own shard, the layers' collectives join them, and every rank samples the same
tokens from the same gathered logits with the same seeded generators, so the ranks' request
states never diverge and nothing flows back but rank 0's result.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from heron.cache.layout import CacheLayout
from heron.cache.spec import CacheSpec
from heron.config import ModelConfig
from heron.distributed.rendezvous import Rendezvous, host_store, join, min_over_ranks
from heron.execution.cuda_graph import CudaGraphRunner
from heron.execution.model_runner import LaunchedStep, ModelRunner
from heron.execution.step_plan import DeviceDrafts, StepPlan
from heron.loader.update import WeightSource, apply_update, plan_update
from heron.lora.config import LoRAConfig
from heron.lora.request import LoRARequest
from heron.metadata import StepMetaPlan
from heron.parallel import SINGLE, TensorParallel
from heron.platforms import Platform
from heron.pooler_config import PoolerConfig

# How long rank 0 waits for a worker whose collective failed to exit (to name its exit code),
# and for the workers to exit after a shutdown.
_EXIT_WAIT_S = 10.0


class WorkerDiedError(RuntimeError):
    """A tensor-parallel rank is gone; the engine cannot step any more."""


@dataclass(frozen=True)
class RunnerArgs:
    """What every rank builds its runner from (rank 0 sends it to the workers)."""

    model_config: ModelConfig
    block_size: int
    attention_backend: str
    seed: int
    lora: LoRAConfig | None = None
    pooling: PoolerConfig | None = None  # a pooling model's

    def build(self, platform: Platform, tp: TensorParallel = SINGLE) -> ModelRunner:
        return ModelRunner(
            self.model_config,
            platform,
            self.block_size,
            self.attention_backend,
            self.seed,
            tp,
            lora=self.lora,
            pooling=self.pooling,
        )


def make_model_runner(
    tensor_parallel_size: int, args: RunnerArgs, platform: Platform
) -> ModelRunner | TensorParallelRunner:
    """A plain runner for one rank, else rank 0 of a tensor-parallel group."""
    if tensor_parallel_size == 1:
        return args.build(platform)
    return TensorParallelRunner(tensor_parallel_size, args, platform)


class TensorParallelRunner:
    """Rank 0 of ``size`` ranks: the workers of this host are started here (one process
    each, ``python -m heron.distributed.worker``) unless torchrun's environment says they are
    launched elsewhere. A worker that exits is reported by rank (:class:`WorkerDiedError`);
    after that every call raises the same error."""

    def __init__(self, size: int, args: RunnerArgs, platform: Platform) -> None:
        if dist.is_initialized():
            raise ValueError(
                "this process already belongs to a torch.distributed group (another "
                "tensor-parallel engine?); shut that engine down first (LLM.shutdown, or drop it)"
            )
        rv = Rendezvous.from_env()
        _check_devices(platform, size, rv)
        self._ranks = _Ranks()
        store = None
        if rv is None:
            rv, store = host_store(size)
            for rank in range(1, size):
                self._workers[rank] = _start_worker(rv.for_rank(rank), platform.device.type)
        elif rv.world_size != size or rv.rank != 0:
            raise ValueError(
                f"tensor_parallel_size={size}, but the environment says rank {rv.rank} of "
                f"{rv.world_size}: run the engine on rank 0 and "
                "`python -m heron.distributed.launch` with the same arguments on every rank"
            )
        try:
            self.tp, self.control = join(rv, platform.device.type, self._check_workers, store)
            with self._guarded():
                dist.broadcast_object_list([args], src=0, group=self.control)
            self.local = args.build(platform, self.tp)
        except BaseException:
            self._ranks.stop_workers(kill=True)
            raise
        self._ranks.control = self.control
        # Not an atexit hook holding the runner: a dropped runner releases the ranks at once.
        self._release = weakref.finalize(self, self._ranks.release)

    @property
    def _workers(self) -> dict[int, subprocess.Popen]:
        return self._ranks.workers

    # What the engine and the CLI read of the runner: rank 0's.
    @property
    def cache(self) -> CacheLayout:
        return self.local.cache

    @property
    def cache_specs(self) -> list[CacheSpec]:
        return self.local.cache_specs

    @property
    def plan(self) -> StepMetaPlan:
        return self.local.plan

    @property
    def graphs(self) -> CudaGraphRunner | None:
        return self.local.graphs

    @property
    def model(self) -> nn.Module:
        return self.local.model

    @property
    def device(self) -> torch.device:
        return self.local.device

    def add_lora(self, request: LoRARequest) -> None:
        """Checked here first (a bad adapter is refused before any worker reads it)."""
        self.local.add_lora(request)
        with self._call("add_lora", request):
            pass

    def remove_lora(self, lora_int_id: int) -> None:
        with self._call("remove_lora", lora_int_id):
            self.local.remove_lora(lora_int_id)

    def reserve_verification(self, max_rows: int, num_proposals: int) -> int:
        with self._call("reserve_verification", max_rows, num_proposals):
            return self.local.reserve_verification(max_rows, num_proposals)

    def kv_cache_budget(self, utilization: float, num_tokens: int) -> int:
        """The smallest rank's budget: the pool (the same on every rank) must fit them all."""
        with self._call("kv_cache_budget", utilization, num_tokens):
            return min_over_ranks(self.local.kv_cache_budget(utilization, num_tokens), self.control)

    def allocate_kv_cache(self, num_blocks: list[int]) -> None:
        with self._call("allocate_kv_cache", num_blocks):
            self.local.allocate_kv_cache(num_blocks)

    @property
    def verify_graph_max_batch(self) -> int:
        return self.local.verify_graph_max_batch

    def capture_graphs(
        self, max_batch: int, verify_query_len: int = 1, verify_max_batch: int = 0
    ) -> None:
        with self._call("capture_graphs", max_batch, verify_query_len, verify_max_batch):
            self.local.capture_graphs(max_batch, verify_query_len, verify_max_batch)

    def launch(
        self,
        plan: StepPlan,
        previous: LaunchedStep | None = None,
        drafts: DeviceDrafts | None = None,
    ) -> LaunchedStep:
        """``ModelRunner.launch`` on every rank; ``drafts`` must be None (the scheduler gives
        a tensor-parallel target its proposals in the plan, which the workers receive)."""
        if drafts is not None:
            raise ValueError("a tensor-parallel target takes its proposals in the plan")
        with self._call("launch", plan, previous is not None):
            return self.local.launch(plan, previous)

    def update_weights(self, source: WeightSource, also: Sequence[nn.Module] = ()) -> int:
        """``ModelRunner.update_weights`` on every rank, each writing its own shards; ``also``
        (an MTP head) lives on rank 0 only. Rank 0 checks the update first (naming a bad
        tensor), the workers their shards; nothing is written unless every rank agrees."""
        models = [self.local.model, *also]
        routes = plan_update(models, source.read())
        with self._call("update_weights", source.only(routes[0].names)):
            if not min_over_ranks(1, self.control):
                raise ValueError(
                    "a tensor-parallel rank refused the weight update (its log says why); "
                    "no weight was written"
                )
            apply_update(models, routes, source.read)
        return sum(len(route.names) for route in routes)

    # Sleep mode: rank 0's runner as a ModelRunner's (its weights are released together with a
    # draft's or MTP head's, which may share tensors); the workers' whole sleep in one call.
    def release_device_state(self) -> None:
        self.local.release_device_state()

    def restore_kv_cache(self) -> None:
        self.local.restore_kv_cache()

    def rebuild_graphs(self) -> None:
        self.local.rebuild_graphs()

    def sleep_workers(self, level: int) -> None:
        """Every worker releases its device state and weights (:class:`WorkerSleep`)."""
        with self._call("sleep", level):
            pass

    def wake_workers(self, tags: list[str]) -> None:
        with self._call("wake_up", tags):
            pass

    def shutdown(self) -> None:
        """Release the ranks (:meth:`_Ranks.release`) now; once only."""
        self._release()

    @contextlib.contextmanager
    def _call(self, name: str, *args: object) -> Iterator[None]:
        """Send call ``name`` to the workers, then run rank 0's part in the ``with`` body."""
        if self._ranks.dead is not None:
            raise self._ranks.dead
        if not self._release.alive:
            raise RuntimeError("the tensor-parallel runner was shut down")
        self._check_workers()
        with self._guarded():
            dist.broadcast_object_list([(name, args)], src=0, group=self.control)
            yield

    @contextlib.contextmanager
    def _guarded(self) -> Iterator[None]:
        """A collective that fails because a worker died raises :class:`WorkerDiedError`."""
        try:
            yield
        except RuntimeError as e:
            if isinstance(e, WorkerDiedError):
                raise
            deadline = time.monotonic() + _EXIT_WAIT_S * bool(self._workers)
            while True:
                self._check_workers(cause=e)
                if time.monotonic() >= deadline:
                    break
                time.sleep(0.05)
            if not self._workers:  # launched by torchrun: no process here to look at
                self._ranks.dead = WorkerDiedError(f"a tensor-parallel rank failed: {e}")
                raise self._ranks.dead from e
            raise

    def _check_workers(self, cause: BaseException | None = None) -> None:
        """Raise :class:`WorkerDiedError` naming the first worker that exited."""
        for rank, proc in self._workers.items():
            code = proc.poll()
            if code is not None:
                self._ranks.dead = WorkerDiedError(
                    f"tensor-parallel worker rank {rank} exited with code {code}; "
                    "the engine stopped"
                )
                self._ranks.stop_workers(kill=True)
                raise self._ranks.dead from cause


@dataclass(eq=False)
class _Ranks:
    """What rank 0 holds beyond its own process: the workers it started and the process
    group. Kept apart from the runner, so that a weak finalizer releases them when the runner
    is dropped without holding the runner alive (or at exit)."""

    workers: dict[int, subprocess.Popen] = field(default_factory=dict)
    control: dist.ProcessGroup | None = None
    dead: WorkerDiedError | None = None

    def release(self) -> None:
        """Tell the workers to exit and wait for them (killed if they do not); leave the
        process group, so that another tensor-parallel engine may form one."""
        if self.dead is None:
            with contextlib.suppress(RuntimeError):
                dist.broadcast_object_list([("shutdown", ())], src=0, group=self.control)
        self.stop_workers(kill=False)
        dist.destroy_process_group()

    def stop_workers(self, kill: bool) -> None:
        for proc in self.workers.values():
            if kill and proc.poll() is None:
                proc.kill()
            try:
                proc.wait(timeout=_EXIT_WAIT_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            if proc.stdin is not None:
                proc.stdin.close()


def _start_worker(rv: Rendezvous, device_type: str) -> subprocess.Popen:
    """A worker process for rank ``rv.rank``; its standard input is a pipe from this process,
    so it exits when this process does, however that happens."""
    payload = json.dumps({"rendezvous": asdict(rv), "device_type": device_type})
    # This process's import path, as multiprocessing's spawn passes it: the worker imports
    # the same heron (the environment is inherited otherwise, NCCL's settings included).
    env = os.environ | {"PYTHONPATH": os.pathsep.join(sys.path)}
    return subprocess.Popen(
        [sys.executable, "-m", "heron.distributed.worker", payload], stdin=subprocess.PIPE, env=env
    )


def _check_devices(platform: Platform, size: int, rv: Rendezvous | None) -> None:
    """Rank ``r`` of a host drives its GPU ``r`` (torchrun's ``LOCAL_RANK``): rank 0 must be
    on GPU 0, and a host starting its own workers needs a GPU for each."""
    device = platform.device
    if device.type != "cuda":
        return
    local_rank = 0 if rv is None else rv.local_rank
    if device.index != local_rank:
        raise ValueError(
            f"with tensor parallelism rank 0 runs on cuda:{local_rank}, not {device}; "
            "choose the GPUs with CUDA_VISIBLE_DEVICES"
        )
    if rv is None and torch.cuda.device_count() < size:
        raise ValueError(
            f"tensor_parallel_size={size} needs {size} GPUs; this host has "
            f"{torch.cuda.device_count()}"
        )
