"""Rotary position embedding, with every scaling type transformers defines."""

from __future__ import annotations

import torch
from torch import nn
from transformers import PretrainedConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS


class RotaryEmbedding(nn.Module):
    """Applies RoPE (rotate-half layout) to q and k at the given positions.

    The inverse frequencies come from transformers' own initialisers (default, linear, dynamic,
    yarn, longrope, llama3), so every ``rope_scaling`` a config declares means what it means in
    HF. A cos/sin table covers ``max_positions``.

    Configs with per-layer-type parameters (Gemma 3: ``rope_parameters`` keyed by
    ``sliding_attention`` / ``full_attention``) get one table per ``layer_type``.
    """

    def __init__(
        self,
        config: PretrainedConfig,
        head_dim: int,
        max_positions: int,
        layer_type: str | None = None,
    ) -> None:
        super().__init__()
        rope_params = getattr(config, "rope_parameters", None) or {}
        if layer_type is not None:
            rope_params = rope_params[layer_type]
        rope_type = rope_params.get("rope_type", "default")
        if rope_type == "default":
            inv_freq, scaling = _default_inv_freq(rope_params, config, head_dim)
        else:
            if rope_type not in ROPE_INIT_FUNCTIONS:
                raise ValueError(f"unsupported rope_type {rope_type!r}")
            inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu", layer_type=layer_type)
        # Built on the CPU whatever the default device; the model's .to(device) moves it.
        positions = torch.arange(max_positions, dtype=torch.float32, device="cpu")
        freqs = torch.outer(positions, inv_freq.float().cpu())
        self.register_buffer("cos", (freqs.cos() * scaling), persistent=False)
        self.register_buffer("sin", (freqs.sin() * scaling), persistent=False)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [tokens, heads, head_dim], k: [tokens, kv_heads, head_dim]."""
        cos = self.cos[positions.long()].unsqueeze(1)
        sin = self.sin[positions.long()].unsqueeze(1)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


class MRotaryEmbedding(RotaryEmbedding):
    """Interleaved multimodal RoPE (Qwen3-VL): each token has a temporal, height and width
    position, and rotary frequency ``j`` turns with the height position where ``j % 3 == 1``
    (the first ``3 * mrope_section[1]`` of them), the width's where ``j % 3 == 2`` (the
    first ``3 * mrope_section[2]``), else the temporal one (``default_section``: the family's
    section where the config names none, as HF's). Text tokens have three equal
    positions, which is plain RoPE.

    The model sets ``step_positions`` (``[3, tokens]``) before each forward pass that holds a
    multimodal request; None means the view's (text) positions.
    """

    def __init__(
        self,
        config: PretrainedConfig,
        head_dim: int,
        max_positions: int,
        default_section: tuple[int, int, int] = (24, 20, 20),
    ) -> None:
        super().__init__(config, head_dim, max_positions)
        section = config.rope_parameters.get("mrope_section") or default_section
        axis = torch.zeros(self.cos.shape[-1], dtype=torch.long, device="cpu")
        axis[1 : 3 * section[1] : 3] = 1
        axis[2 : 3 * section[2] : 3] = 2
        self.register_buffer("axis", axis, persistent=False)
        self.step_positions: torch.Tensor | None = None

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.step_positions is None:
            return super().forward(positions, q, k)
        index = self.axis.expand(positions.shape[0], -1).unsqueeze(0)  # [1, tokens, freqs]
        step = self.step_positions[:, : positions.shape[0]]
        cos = self.cos[step].gather(0, index)[0].unsqueeze(1)
        sin = self.sin[step].gather(0, index)[0].unsqueeze(1)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


class QKTransform(nn.Module):
    """What happens to q and k between the projection and attention.

    Optional per-head RMS norms (Qwen3's qk-norm), then RoPE at the step's positions. Attention
    operators own it, so a GPU operator can fuse it with the KV-cache write.
    """

    def __init__(
        self,
        rotary: RotaryEmbedding,
        q_norm: nn.Module | None = None,
        k_norm: nn.Module | None = None,
    ) -> None:
        super().__init__()
        self.rotary = rotary
        self.q_norm = q_norm
        self.k_norm = k_norm

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return self.rotary(positions, q, k)


class MLARotary(nn.Module):
    """RoPE over latent attention's rotary dims (queries ``[tokens, heads, rope]``, the shared
    key ``[tokens, 1, rope]``). DeepSeek's checkpoints pair dims ``(2i, 2i + 1)`` (V2 always,
    V3 with ``rope_interleave``): with ``interleaved`` they are put in rotate-half order first,
    the same permutation for queries and keys, so their products are HF's. Outputs are in
    rotate-half order; the fused MLA kernel (``heron.kernels.mla_rope``) computes the same."""

    def __init__(self, rotary: RotaryEmbedding, interleaved: bool) -> None:
        super().__init__()
        self.rotary = rotary
        self.interleaved = interleaved

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.interleaved:
            q = torch.cat([q[..., 0::2], q[..., 1::2]], dim=-1)
            k = torch.cat([k[..., 0::2], k[..., 1::2]], dim=-1)
        return self.rotary(positions, q, k)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = cos.shape[-1]
    x1, x2 = x[..., :half].float(), x[..., half : 2 * half].float()
    rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)
    # Partial rotary: dimensions past the rotated ones pass through unchanged.
    return rotated if x.shape[-1] == 2 * half else torch.cat((rotated, x[..., 2 * half :]), -1)


def _default_inv_freq(
    rope_params: dict, config: PretrainedConfig, head_dim: int
) -> tuple[torch.Tensor, float]:
    base = rope_params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
    rot_dim = int(head_dim * rope_params.get("partial_rotary_factor", 1.0))
    exponent = torch.arange(0, rot_dim, 2, dtype=torch.int64, device="cpu").float() / rot_dim
    return 1.0 / (base**exponent), 1.0
