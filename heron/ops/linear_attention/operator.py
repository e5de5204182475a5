"""The gated-delta-rule (GDN) operator: causal conv1d over ``[q|k|v]``, gating, the delta rule
over each request's recurrent state, in place in its state slot."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from heron.cache.recurrent import RecurrentStateSpec
from heron.layers.norm import GatedRMSNorm
from heron.metadata import MetadataOperator, ModelBuildContext, StepMetadataError
from heron.ops.linear_attention.builder import GatedDeltaNetBuilder, GatedDeltaNetView
from heron.ops.linear_attention.reference import (
    causal_conv1d,
    causal_conv1d_step,
    chunked_gated_delta_rule,
    gated_delta_step,
    prepare_qk,
)


@dataclass(frozen=True)
class GatedDeltaNetSpec:
    """The per-layer configuration of a gated-delta-rule operator."""

    num_key_heads: int
    num_value_heads: int
    key_dim: int  # per head
    value_dim: int  # per head
    conv_kernel: int
    state_dtype: torch.dtype = torch.float32

    def __post_init__(self) -> None:
        if self.num_value_heads % self.num_key_heads:
            raise ValueError(
                f"num_value_heads ({self.num_value_heads}) must be a multiple of num_key_heads "
                f"({self.num_key_heads})"
            )

    @property
    def conv_dim(self) -> int:
        """Channels of ``[q|k|v]``."""
        return 2 * self.num_key_heads * self.key_dim + self.num_value_heads * self.value_dim


class GatedDeltaNet(MetadataOperator):
    """From the projected ``[q|k|v]``, ``a`` and ``b`` of a step to the rule's output.

    The model's module owns (and loads) the convolution weight ``[conv_dim, 1, kernel]``,
    ``A_log`` and ``dt_bias``; the operator reads them. Per token: ``beta = sigmoid(b)``,
    ``g = -exp(A_log) * softplus(a + dt_bias)`` in fp32, q and k L2-normalised and repeated
    from the key heads to the value heads. The conv state and the recurrent state of each row
    live in its slot of this layer's cache and are updated in place; a row without a saved
    state starts from zeros whatever its slot holds.

    This is the PyTorch path (any device); decode rows run batched, prefill rows one request
    at a time in the chunked form.
    """

    backend = "reference"
    builder_class: type[GatedDeltaNetBuilder] = GatedDeltaNetBuilder

    def __init__(
        self,
        layer_name: str,
        spec: GatedDeltaNetSpec,
        conv_weight: torch.Tensor,
        A_log: torch.Tensor,
        dt_bias: torch.Tensor,
        build_context: ModelBuildContext | None = None,
    ) -> None:
        super().__init__(layer_name, build_context)
        self.spec = spec
        self.conv_weight, self.A_log, self.dt_bias = conv_weight, A_log, dt_bias
        self._cache_spec = RecurrentStateSpec(
            1,
            torch.get_default_dtype(),
            spec.conv_dim,
            spec.conv_kernel,
            spec.num_value_heads,
            spec.key_dim,
            spec.value_dim,
            spec.state_dtype,
        )
        self._builder = self.builder_class(self.backend)
        self.conv_state: torch.Tensor | None = None  # [slots, conv_dim, kernel - 1]
        self.recurrent_state: torch.Tensor | None = None  # [slots, heads, key_dim, value_dim]
        # A verification step's states after each token of a verifying row but its last, by
        # the row's place among the step's verifying rows: [rows, proposals, *state shape],
        # kept until the step's tokens are accepted. Reserved once (reserve_verification), so
        # graphs capture them and the memory budget counts them.
        self._verified_conv: torch.Tensor | None = None
        self._verified_states: torch.Tensor | None = None

    @property
    def cache_spec(self) -> RecurrentStateSpec:
        return self._cache_spec

    def bind_cache(self, cache: tuple[torch.Tensor, torch.Tensor] | None) -> None:
        self.conv_state, self.recurrent_state = cache if cache is not None else (None, None)

    def metadata_builder(self) -> GatedDeltaNetBuilder:
        return self._builder

    def forward(
        self,
        mixed_qkv: torch.Tensor,
        a: torch.Tensor,
        b: torch.Tensor,
        gate: torch.Tensor | None = None,
        norm: GatedRMSNorm | None = None,
    ) -> torch.Tensor:
        """mixed_qkv: [tokens, conv_dim]; a, b: [tokens, value_heads] -> [tokens, value_heads,
        value_dim] in ``mixed_qkv``'s dtype; with the layer's ``norm`` and its ``gate`` (``z``,
        [tokens, value_heads * value_dim]), the gated norm of that output (which a backend may
        fuse into its kernels)."""
        out = self._rule(mixed_qkv, a, b)
        return out if norm is None else norm(out, gate.reshape(out.shape))

    def _rule(self, mixed_qkv: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """The rule's output of :meth:`forward`, before the norm."""
        if self.conv_state is None:
            raise StepMetadataError(f"layer {self.layer_name!r} has no state cache bound")
        view = self.view
        beta = b.float().sigmoid()
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias.float())
        if view.is_decode:
            out = self._decode(mixed_qkv, g, beta, view)
        else:
            out = self._extend(mixed_qkv, g, beta, view)
        return out.to(mixed_qkv.dtype)

    def _split(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The convolved ``[q|k|v]`` [..., conv_dim] as heads, q and k repeated to value heads."""
        s = self.spec
        key_size = s.num_key_heads * s.key_dim
        q, k, v = x.split([key_size, key_size, s.num_value_heads * s.value_dim], dim=-1)
        lead = x.shape[:-1]
        repeat = s.num_value_heads // s.num_key_heads
        q, k = (
            t.reshape(*lead, s.num_key_heads, s.key_dim).repeat_interleave(repeat, dim=-2)
            for t in (q, k)
        )
        return q, k, v.reshape(*lead, s.num_value_heads, s.value_dim)

    def _decode(
        self, x: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, view: GatedDeltaNetView
    ) -> torch.Tensor:
        """One token per row, all rows at once (no host synchronisation: graph-capturable)."""
        n = x.shape[0]
        slots = view.state_slots[:n].long()
        keep = view.has_initial_state[:n]
        conv_state = torch.where(keep[:, None, None], self.conv_state[slots], 0)
        conv_out, conv_state = causal_conv1d_step(x, self.conv_weight[:, 0], conv_state)
        self.conv_state.index_copy_(0, slots, conv_state.to(self.conv_state.dtype))
        q, k, v = self._split(conv_out)
        q, k = prepare_qk(q, k)
        state = torch.where(keep[:, None, None, None], self.recurrent_state[slots].float(), 0)
        out, state = gated_delta_step(q, k, v.float(), g, beta, state)
        self.recurrent_state.index_copy_(0, slots, state.to(self.recurrent_state.dtype))
        return out

    def _extend(
        self, x: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, view: GatedDeltaNetView
    ) -> torch.Tensor:
        """Request by request: the conv and the chunked rule, each from the row's saved state;
        a row that verifies proposals token by token (:meth:`_verify_row`)."""
        out = x.new_empty(x.shape[0], self.spec.num_value_heads, self.spec.value_dim)
        starts, weight = view.query_start_host, self.conv_weight[:, 0]
        proposed = view.num_proposed_host
        if proposed is not None:
            self._check_verified(int(np.count_nonzero(proposed)), int(proposed.max()))
        verifying = 0
        for i in range(view.num_reqs):
            rows = slice(int(starts[i]), int(starts[i + 1]))
            slot, keep = view.state_slots[i].long(), view.has_initial_state[i]
            if proposed is not None and proposed[i]:
                out[rows] = self._verify_row(x[rows], g[rows], beta[rows], slot, keep, verifying)
                verifying += 1
                continue
            conv_out, conv_state = causal_conv1d(
                x[rows], weight, torch.where(keep, self.conv_state[slot], 0)
            )
            self.conv_state[slot] = conv_state.to(self.conv_state.dtype)
            q, k, v = self._split(conv_out)
            state = torch.where(keep, self.recurrent_state[slot].float(), 0)
            out[rows], state = chunked_gated_delta_rule(q, k, v, g[rows], beta[rows], state)
            self.recurrent_state[slot] = state.to(self.recurrent_state.dtype)
        return out

    def reserve_verification(self, max_rows: int, num_proposals: int, device: torch.device) -> int:
        """Buffers for the intermediate states of verification steps of up to ``max_rows``
        verifying rows of ``num_proposals`` proposals each; returns their bytes."""
        spec = self._cache_spec
        conv, state = spec.allocate(max_rows * num_proposals, device)
        self._verified_conv = conv.unflatten(0, (max_rows, num_proposals))
        self._verified_states = state.unflatten(0, (max_rows, num_proposals))
        return max_rows * num_proposals * spec.bytes_per_block

    def _check_verified(self, num_rows: int, num_proposed: int) -> None:
        held = self._verified_states
        if held is None or held.shape[0] < num_rows or held.shape[1] < num_proposed:
            room = "none" if held is None else f"{held.shape[0]} rows of {held.shape[1]}"
            raise StepMetadataError(
                f"layer {self.layer_name!r}: a verification step of {num_rows} rows of "
                f"{num_proposed} proposals, reserved for {room} (reserve_verification)"
            )

    def _verify_row(
        self,
        x: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        slot: torch.Tensor,
        keep: torch.Tensor,
        row: int,
    ) -> torch.Tensor:
        """A verifying row's tokens as consecutive decode steps (the same arithmetic and
        rounding of the states as :meth:`_decode`, so an accepted token's state is the one plain
        decoding reaches); the states after each token but the last go to ``row`` of the
        verification states (its place among the step's verifying rows), for
        :meth:`verified_state_copies`, the last to its slot."""
        weight = self.conv_weight[:, 0]
        conv_state = torch.where(keep, self.conv_state[slot], 0)[None]
        state = torch.where(keep, self.recurrent_state[slot], 0)[None]
        outs = []
        for t in range(x.shape[0]):
            conv_out, conv_state = causal_conv1d_step(x[t : t + 1], weight, conv_state)
            conv_state = conv_state.to(self.conv_state.dtype)
            q, k, v = self._split(conv_out)
            q, k = prepare_qk(q, k)
            out, state = gated_delta_step(
                q, k, v.float(), g[t : t + 1], beta[t : t + 1], state.float()
            )
            state = state.to(self.recurrent_state.dtype)
            outs.append(out)
            if t < x.shape[0] - 1:
                self._verified_conv[row, t] = conv_state[0]
                self._verified_states[row, t] = state[0]
        self.conv_state[slot] = conv_state[0]
        self.recurrent_state[slot] = state[0]
        return torch.cat(outs)

    def verified_state_copies(
        self, slot: int, row: int, position: int
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``(destination, source)`` views that put into entry ``slot`` (the row's slot, or a
        checkpoint), after a verification step, the state its verifying row ``row`` (its place
        among the step's verifying rows) reached after its token ``position`` (0: its last
        token; ``j``: the ``j``-th proposal after it; never its final token, whose state is in
        the slot). The runner copies every layer's in one ``torch._foreach_copy_`` call."""
        return [
            (self.conv_state[slot], self._verified_conv[row, position]),
            (self.recurrent_state[slot], self._verified_states[row, position]),
        ]
