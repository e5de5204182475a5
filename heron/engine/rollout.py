"""What an RL trainer drives between rollouts: sleep and wake-up, weight updates in place,
pause and resume (vLLM's and SGLang's interfaces)."""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch

from heron.distributed.weight_sync import WeightUpdateGroup
from heron.engine.deltas import RequestDelta
from heron.engine.sleep_mode import SleepMode, reset_prefix_caches
from heron.layers.fp8 import Fp8Scheme
from heron.loader.update import WeightSource

#: pause_generation's modes: abort the unfinished requests, or keep them (and new ones) queued.
PAUSE_MODES = ("abort", "keep")


class RolloutControl:
    """An engine's sleep state, pause state and weight updates. Each action that changes
    memory or weights first stops the requests (or refuses while any is unfinished) and
    settles the engine, so no step is in flight and no runner holds a row."""

    def __init__(self, engine: Any) -> None:
        """``engine``: the :class:`~heron.engine.llm_engine.LLMEngine` this controls."""
        # Weak: the engine owns this; a strong reference back would make a cycle that keeps a
        # dropped engine, and its tensor-parallel workers, alive until the cycle collector runs.
        self._engine = weakref.proxy(engine)
        runners = [engine.runner] + ([engine.draft_runner] if engine.draft_runner else [])
        caches = [engine.kv_cache] + ([engine.proposer.kv_cache] if engine.draft_runner else [])
        self._caches = caches
        self._sleep = SleepMode(runners, caches) if engine.config.enable_sleep_mode else None
        self.paused: str | None = None  # a PAUSE_MODES entry while paused
        self._weight_group: WeightUpdateGroup | None = None  # a trainer's, once joined

    # ------------------------------------------------------------------ sleep

    @property
    def is_sleeping(self) -> bool:
        return self._sleep is not None and self._sleep.is_sleeping

    def sleep(self, level: int = 1, abort: bool = False) -> list[RequestDelta]:
        """Release the device memory (level 1: weights to host memory, KV caches discarded;
        level 2: both discarded). Refused while requests are unfinished, unless ``abort``
        (their final deltas are returned)."""
        sleep = self._sleep_mode()
        sleep.check_can_sleep(level)
        deltas = self._stop_requests("sleep", abort)
        sleep.sleep(level)
        return deltas

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        """Restore ``tags`` (``"weights"``, ``"kv_cache"``; None: all released)."""
        if isinstance(tags, str):
            raise ValueError(f"wake_up tags must be a list, got the string {tags!r}")
        self._sleep_mode().wake_up(tags)

    def check_accepts_requests(self) -> None:
        """Refuse new requests while asleep, after a level-2 wake-up before the weights were
        loaded, and while paused in ``abort`` mode."""
        if self._sleep is not None:
            self._sleep.check_awake("run requests")
            if self._sleep.weights_discarded:
                raise RuntimeError(
                    "cannot run requests: level-2 sleep discarded the weights; load them with "
                    "update_weights() or reload_weights() first"
                )
        if self.paused == "abort":
            raise RuntimeError("cannot run requests: generation is paused; resume_generation()")

    def _sleep_mode(self) -> SleepMode:
        if self._sleep is None:
            raise RuntimeError("sleep mode is off: build the engine with enable_sleep_mode=True")
        return self._sleep

    # --------------------------------------------------------- weight updates

    def update_weights(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], draft: bool = False
    ) -> int:
        """Write ``(name, tensor)`` pairs in the checkpoint's naming (the target's, its MTP
        head's included; ``draft``: the draft model's) into the weights in place, checked
        before any is written; resets the prefix caches. Returns the tensors written."""
        return self._update(WeightSource(list(named_tensors)), "update weights", draft)

    def reload_weights(self, path: str | Path | None = None, draft: bool = False) -> int:
        """Re-read a checkpoint directory (None: the model's own) into the weights in place."""
        if path is None:
            engine = self._engine
            path = engine.draft_runner.model_config.path if draft else engine.model_config.path
        path = Path(path)
        if not path.is_dir():
            raise ValueError(f"reload_weights: {path} is not a checkpoint directory")
        return self._update(WeightSource(path=str(path)), "reload weights", draft)

    def init_weight_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        backend: str = "nccl",
    ) -> None:
        """Join a trainer's weight update group (the trainer is rank 0, this engine
        ``rank_offset``); blocks until every rank has joined. A later call replaces it."""
        self.close_weight_update_group()
        self._weight_group = WeightUpdateGroup(
            master_address,
            master_port,
            rank_offset,
            world_size,
            backend,
            self._engine.platform.device,
        )

    def close_weight_update_group(self) -> None:
        """Leave the trainer's group, if joined (before the process exits)."""
        if self._weight_group is not None:
            self._weight_group.close()
        self._weight_group = None

    def update_weights_from_distributed(
        self,
        names: Sequence[str],
        dtypes: Sequence[str],
        shapes: Sequence[Sequence[int]],
        draft: bool = False,
    ) -> int:
        """Receive one chunk of tensors the trainer broadcasts (one per name, in order) and
        write them as :meth:`update_weights` does. Every tensor is received before any check,
        so a refused chunk leaves the trainer free to go on."""
        if self._weight_group is None:
            raise RuntimeError("no weight update group: call init_weight_update_group() first")
        return self.update_weights(self._weight_group.receive(names, dtypes, shapes), draft)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block; refused (False) while requests hold blocks."""
        return all([cache.reset_prefix_cache() for cache in self._caches])

    def _update(self, source: WeightSource, action: str, draft: bool) -> int:
        """Write ``source`` into the target (with its MTP head) or the draft model, on every
        tensor-parallel rank, once the engine allows it."""
        engine = self._engine
        scheme = engine.model_config.quantization
        # (FP8 quantised at load is quantised again; weights stored quantised are not)
        requantized = isinstance(scheme, Fp8Scheme) and not scheme.from_checkpoint
        if scheme is not None and not requantized:
            raise ValueError(
                f"cannot {action}: weights held as {scheme.describe()} are not updated in place"
            )
        method = engine.config.speculative.method if engine.config.speculative else None
        if draft and method != "draft_model":
            raise ValueError(f"cannot {action} of a draft model: the engine runs none")
        if self._sleep is not None and "weights" in self._sleep.released:
            raise RuntimeError(f"cannot {action}: the weights are asleep; wake_up(['weights'])")
        self._stop_requests(action, abort=False)
        if draft:
            written = engine.draft_runner.update_weights(source)
        else:
            mtp = [engine.draft_runner.model] if method == "mtp" else []
            written = engine.runner.update_weights(source, mtp)
        self._weights_changed()
        return written

    def _weights_changed(self) -> None:
        """The cached blocks hold the old weights' KV: forget them."""
        reset_prefix_caches(self._caches)
        if self._sleep is not None:
            self._sleep.weights_discarded = False

    # ---------------------------------------------------------- pause, resume

    def pause_generation(self, mode: str = "abort") -> list[RequestDelta]:
        """Stop stepping: ``abort`` the unfinished requests (their final deltas are returned;
        new ones are refused until resumed), or ``keep`` them (and new ones) waiting."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause mode must be one of {', '.join(PAUSE_MODES)}, got {mode!r}")
        if self.paused is not None:
            raise RuntimeError(f"generation is paused already ({self.paused!r})")
        deltas = self._stop_requests("pause", abort=True) if mode == "abort" else []
        if mode == "keep":
            deltas = self._engine.settle()
        self.paused = mode
        return deltas

    def resume_generation(self) -> None:
        if self.paused is None:
            raise RuntimeError("generation is not paused")
        self.paused = None

    # ----------------------------------------------------------------- shared

    def _stop_requests(self, action: str, abort: bool) -> list[RequestDelta]:
        """Abort every unfinished request (or refuse ``action`` while any is), then settle
        the engine; the aborted requests' final deltas."""
        engine = self._engine
        unfinished = engine.unfinished_request_ids()
        if unfinished and not abort:
            raise RuntimeError(
                f"cannot {action}: {len(unfinished)} requests are unfinished; abort them first"
                + (" (abort=True)" if action == "sleep" else "")
            )
        deltas = [engine.abort_request(request_id) for request_id in unfinished]
        engine.settle()
        return deltas
