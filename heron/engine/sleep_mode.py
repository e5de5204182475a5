"""Sleep mode: an engine's device memory given up between rollouts (a trainer uses it) and
taken back in stages.

Level 1 copies the weights to host memory and discards the KV caches; level 2 discards both
(a weight update or reload fills them after wake-up). Everything that read the released
tensors is released too and rebuilt after wake-up, rather than kept at fixed virtual
addresses: the CUDA graphs, their builders' buffers and the metadata views (see
docs/architecture.md, "Sleep mode and weight updates"). The prefix caches (recurrent-state
checkpoints and the draft's included) are reset with the memory they describe.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from heron.cache.coordinator import KVCacheCoordinator
from heron.distributed.executor import TensorParallelRunner
from heron.execution.model_runner import ModelRunner
from heron.execution.sleep import ReleasedWeights

#: What :meth:`SleepMode.wake_up` restores, by name.
SLEEP_TAGS = ("weights", "kv_cache")


def reset_prefix_caches(caches: Sequence[KVCacheCoordinator]) -> None:
    """Forget every cached block (their KV is gone or was computed by other weights); the
    caller made sure no request holds blocks."""
    for cache in caches:
        if not cache.reset_prefix_cache():
            raise RuntimeError("KV blocks are still held with no request running (a leak)")


class SleepMode:
    """The sleep state of an engine's runners (the target's, and a draft's or MTP head's)
    and of their caches' block pools."""

    def __init__(
        self,
        runners: Sequence[ModelRunner | TensorParallelRunner],
        caches: Sequence[KVCacheCoordinator],
    ) -> None:
        self._runners = list(runners)
        # Rank 0 of several: its workers sleep and wake with it.
        self._tensor_parallel = [r for r in runners if isinstance(r, TensorParallelRunner)]
        self._caches = list(caches)
        self._weights: ReleasedWeights | None = None
        self._asleep: set[str] = set()
        # After a level-2 wake-up the weights are zeros until an update fills them.
        self.weights_discarded = False

    @property
    def is_sleeping(self) -> bool:
        """Whether anything (weights or KV caches) is still released."""
        return bool(self._asleep)

    def check_awake(self, action: str) -> None:
        """Refuse ``action`` (running requests, updating weights) while asleep."""
        if self._asleep:
            raise RuntimeError(
                f"cannot {action}: the engine is sleeping ({', '.join(sorted(self._asleep))} "
                "released); call wake_up() first"
            )

    @property
    def released(self) -> frozenset[str]:
        """The tags still released."""
        return frozenset(self._asleep)

    def check_can_sleep(self, level: int) -> None:
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level!r}")
        if self._asleep:
            raise RuntimeError("the engine is sleeping already; call wake_up() first")

    def sleep(self, level: int) -> None:
        """Release the device memory; the engine has no request left."""
        self.check_can_sleep(level)
        reset_prefix_caches(self._caches)
        for runner in self._runners:
            runner.release_device_state()
        self._weights = ReleasedWeights([r.model for r in self._runners], keep=level == 1)
        for runner in self._tensor_parallel:
            runner.sleep_workers(level)
        self._asleep = set(SLEEP_TAGS)
        _empty_device_cache(self._runners)

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        """Restore ``tags`` (None: everything still released); the graphs are recaptured
        once both the weights and the KV caches are back."""
        wanted = set(SLEEP_TAGS if tags is None else tags)
        unknown = wanted - set(SLEEP_TAGS)
        if unknown:
            raise ValueError(
                f"wake_up tags must be among {', '.join(SLEEP_TAGS)}, got {sorted(unknown)}"
            )
        if tags is None:
            wanted &= self._asleep
        awake = wanted - self._asleep
        if not self._asleep or awake:
            raise RuntimeError(
                f"cannot wake up {', '.join(sorted(awake or wanted))}: "
                + ("the engine is not sleeping" if not self._asleep else "it is awake already")
            )
        if "weights" in wanted:
            self._weights.restore()
            self.weights_discarded = not self._weights.kept
            self._weights = None
        if "kv_cache" in wanted:
            for runner in self._runners:
                runner.restore_kv_cache()
        for runner in self._tensor_parallel:
            runner.wake_workers(sorted(wanted))
        self._asleep -= wanted
        if not self._asleep:
            for runner in self._runners:
                runner.rebuild_graphs()


def _empty_device_cache(runners: Sequence[ModelRunner]) -> None:
    """Give the allocator's cached blocks back to the device (what ``mem_get_info`` sees)."""
    if any(r.device.type == "cuda" for r in runners):
        torch.cuda.empty_cache()
