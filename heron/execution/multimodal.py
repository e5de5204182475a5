"""A multimodal model's per-step inputs: the placeholder tokens' encoder features (computed
once per image and kept in the encoder cache while requests need them), and, as the model
needs them, M-RoPE positions or the key limits of image tokens that see their whole image."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch

from heron.execution.request_state import RequestState
from heron.execution.step_plan import StepPlan
from heron.multimodal.encoder_cache import EncoderCache
from heron.multimodal.inputs import ImageItem, MultimodalStep


class MultimodalInputs:
    """Runs the encoder for the images whose placeholders fall in a step's chunks and hands
    the model their features, with every token's M-RoPE positions (a model with
    ``mrope_positions``) or key limits (a model with ``images_attend_whole``)."""

    def __init__(self, model: torch.nn.Module, device: torch.device) -> None:
        self.model = model
        self.device = device
        self.cache = EncoderCache()
        self.mrope = hasattr(model, "mrope_positions")
        self.whole_images = getattr(model, "images_attend_whole", False)
        self._positions: dict[str, tuple[np.ndarray, int]] = {}  # request -> prompt's, delta

    def forget(self, request_id: str, finished: bool) -> None:
        """A finished or preempted request lets go of its images (a preempted one holds them
        again when its recomputation reaches them)."""
        self.cache.release(request_id)
        if finished:
            self._positions.pop(request_id, None)

    def prepare(self, plan: StepPlan, states: Mapping[str, RequestState]) -> MultimodalStep | None:
        """None where the step needs nothing beside its tokens (no request has images, or,
        without M-RoPE, none reaches a placeholder): the step may then replay a graph."""
        if not any(states[request_id].images for request_id in plan.request_ids):
            return None
        positions = []
        segments: list[tuple[str, ImageItem, int, int, int]] = []  # request, image, a, b, row
        row = 0
        for request_id, c, n in zip(plan.request_ids, plan.num_computed, plan.num_new):
            state = states[request_id]
            if self.mrope:
                positions.append(self._step_positions(state, c, n))
            for item in state.images:
                if item.overlaps(c, c + n):
                    lo, hi = max(c, item.offset), min(c + n, item.end)
                    segments.append(
                        (request_id, item, lo - item.offset, hi - item.offset, row + lo - c)
                    )
            row += n
        step_positions = None
        if positions:
            step_positions = torch.from_numpy(np.concatenate(positions, axis=1)).to(self.device)
        if not segments:
            return MultimodalStep(step_positions) if self.mrope else None
        self._encode([item for _, item, *_ in segments])
        rows, features = [], []
        for request_id, item, a, b, first in segments:
            self.cache.hold(request_id, item.content_hash)
            features.append(self.cache[item.content_hash][a:b])
            rows.append(torch.arange(first, first + b - a))
        for request_id, item, _, b, _ in segments:
            if b == item.length:  # its last placeholder is in this step
                self.cache.release(request_id, item.content_hash)
        key_limits = self._key_limits(plan, segments) if self.whole_images else None
        return MultimodalStep(
            step_positions, torch.cat(rows).to(self.device), torch.cat(features), key_limits
        )

    def _key_limits(
        self, plan: StepPlan, segments: list[tuple[str, ImageItem, int, int, int]]
    ) -> torch.Tensor:
        """Each token's last visible position: its own, or its image's last token. The
        scheduler never ends a chunk inside such an image, so those keys are in the step."""
        limits = np.concatenate(
            [np.arange(c, c + n) for c, n in zip(plan.num_computed, plan.num_new)]
        )
        for request_id, item, a, b, first in segments:
            if b != item.length:
                raise RuntimeError(
                    f"request {request_id!r}: the step ends inside an image whose tokens "
                    "attend to the whole image"
                )
            limits[first : first + b - a] = item.end - 1
        return torch.from_numpy(limits.astype(np.int32)).to(self.device)

    def _step_positions(self, state: RequestState, c: int, n: int) -> np.ndarray:
        """M-RoPE positions of the request's tokens ``c .. c + n``."""
        prompt, delta = self._prompt_positions(state)
        index = np.arange(c, c + n)
        step = np.broadcast_to(index + delta, (3, n)).copy()
        in_prompt = index < prompt.shape[1]
        step[:, in_prompt] = prompt[:, index[in_prompt]]
        return step

    def _prompt_positions(self, state: RequestState) -> tuple[np.ndarray, int]:
        known = self._positions.get(state.request_id)
        if known is None:
            known = self.model.mrope_positions(state.images, state.num_prompt_tokens)
            self._positions[state.request_id] = known
        return known

    def _encode(self, items: list[ImageItem]) -> None:
        """The encoder over the images not in the cache (each once)."""
        missing = {item.content_hash: item for item in items if item.content_hash not in self.cache}
        if missing:
            for h, output in zip(missing, self.model.encode(list(missing.values()))):
                self.cache.put(h, output)
