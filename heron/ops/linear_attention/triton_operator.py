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
    scatter of states). A uniform verification step runs its ``q`` tokens per row as ``q``
    such decode steps, writing the states after each token but the last into the reserved
    verification buffers: device metadata only, so its graphs are captured. Prefill and extend
    steps run the whole packed batch through
    :func:`~heron.ops.linear_attention.fla_prefill.chunked_prefill` when the operator is built
    on a CUDA device and fla-core imports; otherwise (the CPU, Triton's interpreter) they take
    the PyTorch chunked path, as verification steps of several query lengths do."""

    backend = "triton"
    builder_class = UniformGatedDeltaNetBuilder

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._verified_rows: torch.Tensor | None = None  # 0, 1, ...: rows of the buffers
        self._chunk_rule = None
        if self.conv_weight.is_cuda:  # built under the platform's device
            self._chunk_rule = load_chunk_rule()
            if self._chunk_rule is not None:
                self._builder = self.builder_class(self.backend, FLA_CHUNK_SIZE)

    def reserve_verification(self, max_rows: int, num_proposals: int, device: torch.device) -> int:
        reserved = super().reserve_verification(max_rows, num_proposals, device)
        self._verified_rows = torch.arange(max_rows, dtype=torch.int32, device=device)
        return reserved + self._verified_rows.nbytes

    def forward(self, mixed_qkv: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        view = self.view
        if view.verifies_uniformly:
            out = self._verify_in_place(mixed_qkv, a, b, view)
        elif view.is_decode:
            n = mixed_qkv.shape[0]
            slots = view.state_slots[:n]
            here = (self.conv_state, self.recurrent_state, slots)
            out = self._decode_step(mixed_qkv, a, b, view.has_initial_state[:n], here, here)
        else:
            return super().forward(mixed_qkv, a, b)
        return out.to(mixed_qkv.dtype)

    def _verify_in_place(
        self, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, view: GatedDeltaNetView
    ) -> torch.Tensor:
        """Every row's tokens as consecutive decode steps (row ``i`` of the step is verifying
        row ``i``), their states chained through the verification buffers: the first token
        reads the slot, each token but the last writes its row of the buffers, the last writes
        the slot. Padded graph rows run on the null slot."""
        n = view.num_reqs
        q = x.shape[0] // n
        self._check_verified(n, q - 1)
        slots, has_state = view.state_slots[:n], view.has_initial_state[:n]
        self._verified_slots[:n].copy_(slots)
        rows = self._verified_rows[:n]
        continues = torch.ones_like(has_state)  # every token after a row's first
        x, a, b = (t.unflatten(0, (n, q)) for t in (x, a, b))
        read = slot = (self.conv_state, self.recurrent_state, slots)
        outs = []
        for t in range(q):
            write = slot
            if t < q - 1:
                write = (self._verified_conv[:, t], self._verified_states[:, t], rows)
            outs.append(self._decode_step(x[:, t], a[:, t], b[:, t], has_state, read, write))
            read, has_state = write, continues
        return torch.stack(outs, 1).flatten(0, 1)

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

    def _decode_step(
        self,
        x: torch.Tensor,
        a: torch.Tensor,
        b: torch.Tensor,
        has_state: torch.Tensor,
        read: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
        write: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    ) -> torch.Tensor:
        """One token per row: the states at ``read`` (conv states, recurrent states, each row's
        place in them) advanced into ``write`` (the same for a decode step)."""
        conv_in, state_in, rows_in = read
        conv_out, state_out, rows_out = write
        conv = causal_conv1d_update(
            x, conv_in, self.conv_weight[:, 0], rows_in, has_state, into=(conv_out, rows_out)
        )
        return gated_delta_decode(
            conv,
            a,
            b,
            self.A_log,
            self.dt_bias,
            state_in,
            rows_in,
            has_state,
            self.spec.num_key_heads,
            into=(state_out, rows_out),
        )
