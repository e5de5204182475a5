"""Applies a host-filled token bitmask to logits on their device, without waiting for it."""

from __future__ import annotations

import torch


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Sets ``logits[i, j]`` to ``-inf`` (in place) where bit ``j`` of ``bitmask[i]`` is 0.

    ``bitmask`` is xgrammar's packed int32 mask in host memory, one row per logits row; it is
    copied to the device from pinned memory so the host does not wait. Columns past the mask's
    width (a model vocabulary wider than the mask) are masked too.
    """
    import xgrammar as xgr  # only grammar rows need it; see heron.structured.grammar

    if logits.is_cuda:
        bitmask = bitmask.pin_memory().to(logits.device, non_blocking=True)
    width = min(logits.shape[-1], bitmask.shape[-1] * 32)
    xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=width)
    if width < logits.shape[-1]:
        logits[:, width:] = float("-inf")
