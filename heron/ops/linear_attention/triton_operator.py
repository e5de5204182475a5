"""The gated-delta-rule operator with Heron's Triton decode kernels (state updated in place, for
decode and uniform verification steps) and, on CUDA with fla-core installed, the batched chunked
prefill of ``fla_prefill``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from heron import envs
from heron.kernels.gated_delta import gdn_decode
from heron.kernels.gated_delta_fused import fused_decode_applies, fused_gdn_decode
from heron.layers.norm import GatedRMSNorm
from heron.ops.linear_attention.builder import GatedDeltaNetView, UniformGatedDeltaNetBuilder
from heron.ops.linear_attention.fla_prefill import FLA_CHUNK_SIZE, chunked_prefill, load_chunk_rule
from heron.ops.linear_attention.operator import GatedDeltaNet

#: Whether decode and uniform verification steps given the layer's norm run the one fused
#: launch of ``gated_delta_fused`` (where its state tile fits) instead of the two decode kernels
#: and the norm's; ``HERON_GDN_FUSED=0`` turns it off (to compare the two).
FUSED_DECODE = envs.gdn_fused_decode()
#: The most value heads per key head that take the fused launch: one program runs a key head's
#: value heads one after another, and with two it is slower at batch 1 than the unfused ones.
FUSED_MAX_VALUE_HEADS_PER_KEY = 1


class TritonGatedDeltaNet(GatedDeltaNet):
    """Decode steps in launches that read and write each row's slot in place (no gather or
    scatter of states): given the layer's norm, one that fuses it
    (:func:`~heron.kernels.gated_delta_fused.fused_gdn_decode`), otherwise the conv's and the
    rule's. A uniform verification step runs its ``q`` tokens per row through the
    same launches (row ``i`` of the step is verifying row ``i``), which write the states
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
        spec = self.spec
        per_key = spec.num_value_heads // spec.num_key_heads
        self._fuses_norm = (
            FUSED_DECODE
            and per_key <= FUSED_MAX_VALUE_HEADS_PER_KEY
            and fused_decode_applies(spec.key_dim, spec.value_dim)
        )
        self._chunk_rule = None
        if self.conv_weight.is_cuda:  # built under the platform's device
            self._chunk_rule = load_chunk_rule()
            if self._chunk_rule is not None:
                self._builder = self.builder_class(self.backend, FLA_CHUNK_SIZE)

    def forward(
        self,
        mixed_qkv: torch.Tensor,
        a: torch.Tensor,
        b: torch.Tensor,
        gate: torch.Tensor | None = None,
        norm: GatedRMSNorm | None = None,
    ) -> torch.Tensor:
        if norm is None or not self._fuses_norm or not self._in_place:
            return super().forward(mixed_qkv, a, b, gate, norm)
        return self._run_in_place(
            fused_gdn_decode, x=mixed_qkv, gate=gate, a=a, b=b, norm_weight=norm.weight,
            eps=norm.eps,
        )  # fmt: skip

    def _rule(self, mixed_qkv: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        if not self._in_place:
            return super()._rule(mixed_qkv, a, b)
        return self._run_in_place(gdn_decode, x=mixed_qkv, a=a, b=b)

    @property
    def _in_place(self) -> bool:
        """Whether this step runs on the in-place decode kernels (decode, uniform verification)."""
        return self.view.verifies_uniformly or self.view.is_decode

    def _run_in_place(self, kernel: Callable[..., torch.Tensor], **inputs: Any) -> torch.Tensor:
        """``kernel`` (``gdn_decode`` or ``fused_gdn_decode``) on the step's ``inputs``, in place
        in the rows' slots: of a decode step, or of a uniform verification step with the buffers
        for the states after each token of a row but the last (for
        :meth:`verified_state_copies`)."""
        view, kept = self.view, None
        n = inputs["x"].shape[0]
        if view.verifies_uniformly:
            q, n = n // view.num_reqs, view.num_reqs
            self._check_verified(n, q - 1)
            kept = (self._verified_conv[:n, : q - 1], self._verified_states[:n, : q - 1])
        return kernel(
            conv_weight=self.conv_weight[:, 0],
            A_log=self.A_log,
            dt_bias=self.dt_bias,
            conv_state=self.conv_state,
            state=self.recurrent_state,
            slots=view.state_slots[:n],
            has_state=view.has_initial_state[:n],
            num_key_heads=self.spec.num_key_heads,
            kept=kept,
            **inputs,
        )

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
