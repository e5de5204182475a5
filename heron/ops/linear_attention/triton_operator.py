"""The gated-delta-rule operator with Heron's Triton decode kernels (state updated in place)."""

from __future__ import annotations

import torch

from heron.kernels.gated_delta import causal_conv1d_update, gated_delta_decode
from heron.ops.linear_attention.builder import GatedDeltaNetView
from heron.ops.linear_attention.operator import GatedDeltaNet


class TritonGatedDeltaNet(GatedDeltaNet):
    """Decode steps in two launches that read and write each row's slot in place (no gather or
    scatter of states); prefill and extend steps take the PyTorch chunked path."""

    backend = "triton"

    def forward(self, mixed_qkv: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        view = self.view
        if not view.is_decode:
            return super().forward(mixed_qkv, a, b)
        return self._decode_in_place(mixed_qkv, a, b, view).to(mixed_qkv.dtype)

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
