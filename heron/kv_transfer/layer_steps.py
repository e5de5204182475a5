"""The layer step counter a layerwise connector waits on.

Each cache owner records a step right after its forward (its KV written): the counter on the
device goes up by one and is copied into pinned host memory by a non-blocking copy. Both are
plain stream operations, so a captured CUDA graph records them too and every replay repeats
them: decode graphs stay whole. A saver thread polls the host copy; once it reads ``n``, the
first ``n`` layer steps since the counter started were written (steps follow in stream order).
"""

from __future__ import annotations

import time

import torch


class LayerSteps:
    """Counts cache owners' forwards over every step: after step ``s`` (from 0) of a model
    with ``num_layers`` cache owners, layer ``l``'s record makes the count
    ``s * num_layers + l + 1``."""

    def __init__(self, num_layers: int, device: torch.device) -> None:
        self.num_layers = num_layers
        self._counter = torch.zeros(1, dtype=torch.int64, device=device)
        self._host = torch.zeros(1, dtype=torch.int64, pin_memory=device.type == "cuda")

    def record(self) -> None:
        """One more layer written (stream operations only: capturable)."""
        self._counter.add_(1)
        self._host.copy_(self._counter, non_blocking=True)

    @property
    def count(self) -> int:
        """The host copy: layer steps known written."""
        return int(self._host[0])

    def settled(self) -> int:
        """The count once every record queued so far has landed (a device wait): the next
        forward's layer ``l`` then makes it ``settled() + l + 1``."""
        if self._counter.is_cuda:
            torch.cuda.current_stream(self._counter.device).synchronize()
        return self.count

    def wait_for(self, count: int, timeout_s: float, poll_s: float = 1e-4) -> bool:
        """Wait until ``count`` layer steps are written; False if ``timeout_s`` passed first."""
        deadline = time.monotonic() + timeout_s
        while self.count < count:
            if time.monotonic() > deadline:
                return False
            time.sleep(poll_s)
        return True
