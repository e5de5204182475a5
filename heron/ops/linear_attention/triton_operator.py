"""The gated-delta-rule operator with Heron's Triton decode kernels (state updated in place) and,
on CUDA with fla-core installed, the batched chunked prefill of ``fla_prefill``."""

from __future__ import annotations

import torch

from heron.kernels.gated_delta import causal_conv1d_update, gated_delta_decode
from heron.ops.linear_attention.builder import GatedDeltaNetBuilder, GatedDeltaNetView
from heron.ops.linear_attention.fla_prefill import FLA_CHUNK_SIZE, chunked_prefill, load_chunk_rule
from heron.ops.linear_attention.operator import GatedDeltaNet


class TritonGatedDeltaNet(GatedDeltaNet):
    """Decode steps in two launches that read and write each row's slot in place (no gather or
    scatter of states). Prefill and extend steps run the whole packed batch through
    :func:`~heron.ops.linear_attention.fla_prefill.chunked_prefill` when the operator is built
    on a CUDA device and fla-core imports; otherwise (the CPU, Triton's interpreter) they take
    the PyTorch chunked path."""

    backend = "triton"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._chunk_rule = None
        if self.conv_weight.is_cuda:  # built under the platform's device
            self._chunk_rule = load_chunk_rule()
            if self._chunk_rule is not None:
                self._builder = GatedDeltaNetBuilder(self.backend, FLA_CHUNK_SIZE)

    def forward(self, mixed_qkv: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        view = self.view
        if not view.is_decode:
            return super().forward(mixed_qkv, a, b)
        return self._decode_in_place(mixed_qkv, a, b, view).to(mixed_qkv.dtype)

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
        self, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, view: GatedDeltaNetView
    ) -> torch.Tensor:
        n = x.shape[0]
        slots, has_state = view.state_slots[:n], view.has_initial_state[:n]
        conv_out = causal_conv1d_update(
            x, self.conv_state, self.conv_weight[:, 0], slots, has_state
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
        )
