"""Encoder outputs by image content hash, each kept while some request still needs it."""

from __future__ import annotations

from collections import defaultdict

import torch


class EncoderCache:
    """An image's encoder output is computed once and shared by every request holding its
    hash; a request holds it from the step that first reaches its placeholders to the step
    that passes them (or until it finishes, is aborted or preempted), and the output is freed
    as soon as no request holds it. The cache is thus bounded by the images of the requests
    in flight."""

    def __init__(self) -> None:
        self._outputs: dict[str, torch.Tensor] = {}
        self._holders: dict[str, set[str]] = defaultdict(set)  # hash -> request ids
        self._held: dict[str, set[str]] = defaultdict(set)  # request id -> hashes
        self.num_encoded = 0  # images run through the encoder (misses)

    def __contains__(self, content_hash: str) -> bool:
        return content_hash in self._outputs

    def __len__(self) -> int:
        return len(self._outputs)

    def __getitem__(self, content_hash: str) -> torch.Tensor:
        return self._outputs[content_hash]

    def put(self, content_hash: str, output: torch.Tensor) -> None:
        self._outputs[content_hash] = output
        self.num_encoded += 1

    def hold(self, request_id: str, content_hash: str) -> None:
        self._holders[content_hash].add(request_id)
        self._held[request_id].add(content_hash)

    def release(self, request_id: str, content_hash: str | None = None) -> None:
        """``request_id`` no longer needs ``content_hash``'s output (None: any); an output no
        request holds is freed."""
        held = self._held.get(request_id)
        if not held:
            return
        for h in [content_hash] if content_hash is not None else list(held):
            held.discard(h)
            holders = self._holders.get(h)
            if holders is not None:
                holders.discard(request_id)
                if not holders:
                    del self._holders[h]
                    self._outputs.pop(h, None)
        if not held:
            del self._held[request_id]

    @property
    def num_holders(self) -> int:
        """Requests holding an output (0 once every request is finished)."""
        return len(self._held)
