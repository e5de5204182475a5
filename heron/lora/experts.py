"""LoRAExperts: the low-rank updates of a bank of experts, for every adapter slot at once."""

from __future__ import annotations

import torch

from heron.layers.moe import SwiGLUExperts
from heron.lora.adapter import EXPERT_STACKS, LoRAPair
from heron.lora.builder import LoRABuilder, LoRAView
from heron.lora.config import LoRAConfig
from heron.lora.layer import shrink_expand
from heron.metadata import MetadataOperator


class LoRAExperts(MetadataOperator):
    """Each routed (token, expert) pair's update of its expert's ``gate_up_proj`` and
    ``down_proj`` under its token's adapter, as PEFT's ``target_parameters`` writes them.

    The tables hold slot ``s``'s expert ``e`` at entry ``s * E + e`` (slot 0: zeros), so the
    linear layers' token-indexed shrink and expand serve the pairs, indexed by entry
    (``lora_a_gate_up`` ``[slots * E, max_rank, hidden]``, ``lora_b_gate_up`` ``[slots * E,
    2I, max_rank]``, likewise for down). Under tensor parallelism a rank holds its
    intermediate features: its rows of the gate/up B, its columns of the down A."""

    def __init__(self, layer_name: str, bank: SwiGLUExperts, config: LoRAConfig) -> None:
        super().__init__(layer_name)
        self.num_experts = bank.num_experts
        self.hidden = bank.down_proj.shape[1]
        self.inter_start, self.inter = bank.inter_start, bank.intermediate_size
        self.full_inter = bank.full_intermediate_size
        # (act-order packed experts hold their rows reordered: known once the weights load)
        self._act_order = lambda: bank.input_perm is not None
        entries = (config.max_loras + 1) * self.num_experts
        r, h, i = config.max_lora_rank, self.hidden, self.inter
        for name, shape in (
            ("lora_a_gate_up", (entries, r, h)),
            ("lora_b_gate_up", (entries, 2 * i, r)),
            ("lora_a_down", (entries, r, i)),
            ("lora_b_down", (entries, h, r)),
        ):
            self.register_buffer(name, torch.zeros(shape), persistent=False)
        self.kernels = bank.kernels
        self._builder = LoRABuilder(config.max_loras, config.max_lora_rank)

    def metadata_builder(self) -> LoRABuilder:
        return self._builder

    def _shapes(self, stack: str) -> tuple[int, int]:
        """(in, out) features of one expert's matrix in ``stack``, unsharded."""
        if stack == "gate_up_proj":
            return self.hidden, 2 * self.full_inter
        return self.full_inter, self.hidden

    def check(self, part: str | None, pair: LoRAPair) -> str | None:
        """Why ``pair`` cannot update stack ``part`` (None: it can)."""
        if part not in EXPERT_STACKS:
            return f"the experts have no stack {part!r}"
        if self._act_order():
            return "the experts are act-order packed integers (desc_act): LoRA is not served"
        e, (n_in, n_out) = self.num_experts, self._shapes(part)
        a, b = tuple(pair.a.shape), tuple(pair.b.shape)
        if pair.a.dim() != 3 or a[0] != e or b[0] != e or a[2] != n_in or b[1] != n_out:
            return f"lora_A {a} / lora_B {b} do not fit {e} experts' {n_in} -> {n_out} projections"
        return None

    def set_slot(self, slot: int, pairs: dict[str | None, LoRAPair]) -> None:
        """Slot ``slot`` holds ``pairs`` (by stack; a stack without one: nothing), this rank's
        intermediate features of each."""
        entries = slice(slot * self.num_experts, (slot + 1) * self.num_experts)
        start, n, whole = self.inter_start, self.inter, self.full_inter
        for stack in EXPERT_STACKS:
            a = getattr(self, f"lora_a_{stack.removesuffix('_proj')}")[entries]
            b = getattr(self, f"lora_b_{stack.removesuffix('_proj')}")[entries]
            a.zero_()
            b.zero_()
            pair = pairs.get(stack)
            if pair is None:
                continue
            r = pair.a.shape[1]
            if stack == "gate_up_proj":  # [gate | up]: this rank's rows of each half
                a[:, :r].copy_(pair.a)
                gate, up = (
                    pair.b[:, start : start + n],
                    pair.b[:, whole + start : whole + start + n],
                )
                b[:, :, :r].copy_(torch.cat([gate, up], dim=1))
            else:
                a[:, :r].copy_(pair.a[:, :, start : start + n])
                b[:, :, :r].copy_(pair.b)

    def pair_entries(self, indices: torch.Tensor) -> torch.Tensor | None:
        """Each routed pair's table entry (``indices`` [T, k], pairs in order ``t * k + j``);
        None where no token of the step uses an adapter."""
        view: LoRAView = self.view
        if view.token_slots is None:
            return None
        slots = view.token_slots.repeat_interleave(indices.shape[1])
        return (slots * self.num_experts + indices.flatten()).to(torch.int32)

    def gate_up(self, x: torch.Tensor, entries: torch.Tensor) -> torch.Tensor:
        """The gate/up updates of rows ``x`` [n, hidden] (fp32 [n, 2I])."""
        y = x.new_zeros(x.shape[0], 2 * self.inter, dtype=torch.float32)
        return shrink_expand(self.kernels, x, self.lora_a_gate_up, self.lora_b_gate_up, entries, y)

    def down(self, h: torch.Tensor, entries: torch.Tensor) -> torch.Tensor:
        """The down updates of rows ``h`` [n, I] (fp32 [n, hidden]; a part summed over the
        ranks with the experts' outputs)."""
        y = h.new_zeros(h.shape[0], self.hidden, dtype=torch.float32)
        return shrink_expand(self.kernels, h, self.lora_a_down, self.lora_b_down, entries, y)
