"""The gated-delta-rule operator with Heron's Triton decode kernels (state updated in place, for
decode and uniform verification steps) and, on CUDA with fla-core installed, the batched chunked
prefill of ``fla_prefill``."""

from __future__ import annotations

import torch

from heron.kernels.gated_delta import causal_conv1d_update, gated_delta_decode
from heron.ops.linear_attention.builder import GatedDeltaNetView, UniformGatedDeltaNetBuilder
from heron.ops.linear_attention.fla_prefill import FLA_CHUNK_SIZE, chunked_prefill, load_chunk_rule
from heron.ops.linear_attention.operator import GatedDeltaNet


class TritonGatedDeltaNet(GatedDeltaNet):
    """Decode steps in two launches that read and write each row's slot in place (no gather or
    scatter of states). A uniform verification step runs its ``q`` tokens per row through the
    same two launches (row ``i`` of the step is verifying row ``i``), which write the states
    after each token but the last into the reserved verification buffers: device metadata
    only, so its graphs are captured; padded graph rows run on the null slot. Prefill and extend
    steps run the whole packed batch through
    :func:`~heron.ops.linear_attention.fla_prefill.chunked_prefill` when the operator is built
    on a CUDA device and fla-core imports; otherwise (the CPU, Triton's interpreter) they take
    the PyTorch chunked path, as verification steps of several query lengths do."""

    backend = "triton"
    builder_class = UniformGatedDeltaNetBuilder

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._chunk_rule = None
        if self.conv_weight.is_cuda:  # built under the platform's device
            self._chunk_rule = load_chunk_rule()
            if self._chunk_rule is not None:
                self._builder = self.builder_class(self.backend, FLA_CHUNK_SIZE)

    def forward(self, mixed_qkv: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        view = self.view
        if view.verifies_uniformly:
            n = view.num_reqs
            q = mixed_qkv.shape[0] // n
            self._check_verified(n, q - 1)
            self._verified_slots[:n].copy_(view.state_slots[:n])
            kept = (self._verified_conv[:n, : q - 1], self._verified_states[:n, : q - 1])
            out = self._decode_in_place(mixed_qkv, a, b, view, n, kept)
        elif view.is_decode:
            out = self._decode_in_place(mixed_qkv, a, b, view, mixed_qkv.shape[0])
        else:
            return super().forward(mixed_qkv, a, b)
        return out

    def _extend(
        self, x: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, view: GatedDeltaNetView
    ) -> torch.Tensor:
        if self._chunk_rule is None or view.num_proposed_host is not None:
            # (a verification step keeps each token's state: the PyTorch path does)
            return super()._extend(x, g, beta, view)
        return chunked_prefill(
            self._chunk_rule,
            x,
            g,
            beta,
            self.conv_weight[:, 0],
            self.conv_state,
            self.recurrent_state,
            self.spec.num_key_heads,
            view,
        )

    def _decode_in_place(
        self,
        x: torch.Tensor,
        a: torch.Tensor,
        b: torch.Tensor,
        view: GatedDeltaNetView,
        n: int,
        kept: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """The ``n`` rows' tokens (one each, or ``q`` with ``kept``: the buffers for the conv
        and recurrent states after each token but the last) in place in their slots."""
        slots, has_state = view.state_slots[:n], view.has_initial_state[:n]
        conv_kept, state_kept = kept if kept is not None else (None, None)
        conv_out = causal_conv1d_update(
            x, self.conv_state, self.conv_weight[:, 0], slots, has_state, conv_kept
        )
        return gated_delta_decode(
            conv_out,
            a,
            b,
            self.A_log,
            self.dt_bias,
            self.recurrent_state,
            slots,
            has_state,
            self.spec.num_key_heads,
            state_kept,
            x.dtype,
        )
