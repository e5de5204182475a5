"""Mixture-of-experts routing: which ``top_k`` experts each token goes to, and their weights.

``Routing`` holds one family's rule (the semantics of HF transformers' routers, which the tests
hold it to) and ``TopKRouter`` is the router's linear layer that applies it:

- ``softmax`` (Qwen2/Qwen3-MoE, Qwen3-Next, Qwen3.5-MoE, DeepSeek-V2): a softmax over all
  experts in fp32, the top-k probabilities, renormalised to sum to one if ``renormalize``
  (``norm_topk_prob``); with ``num_groups > 1`` only the ``topk_groups`` groups whose best
  expert scores highest are eligible (DeepSeek-V2's ``group_limited_greedy``);
- ``softmax_of_topk`` (gpt-oss): the top-k logits, then a softmax over those alone;
- ``sigmoid`` (DeepSeek-V3): sigmoid scores; experts are chosen by score plus the router's
  ``e_score_correction_bias``, among the ``topk_groups`` groups whose two best biased scores sum
  highest, and weighted by their unbiased scores (renormalised if ``renormalize``).

Every rule then multiplies the weights by ``scaling`` (``routed_scaling_factor``). All of it is
plain torch on the device, without a host sync, so CUDA graphs capture it; the Triton kernel set
does it in one launch (``heron.kernels.moe_route``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from heron.kernels import TORCH_KERNELS, LayerKernels
from heron.layers.linear import Linear

SCORINGS = ("softmax", "softmax_of_topk", "sigmoid")


@dataclass(frozen=True)
class Routing:
    """One family's routing rule (see the module docstring)."""

    top_k: int
    scoring: str = "softmax"
    renormalize: bool = False
    num_groups: int = 1
    topk_groups: int = 1
    scaling: float = 1.0
    fp32_logits: bool = False  # router product in fp32 (DeepSeek), else in the model's dtype

    def __post_init__(self) -> None:
        if self.scoring not in SCORINGS:
            raise ValueError(f"routing scoring {self.scoring!r} is not one of {SCORINGS}")
        if self.top_k < 1:
            raise ValueError(f"routing top_k must be at least 1, got {self.top_k}")
        if not 1 <= self.topk_groups <= self.num_groups:
            raise ValueError(
                f"routing topk_groups must be in [1, num_groups={self.num_groups}], "
                f"got {self.topk_groups}"
            )
        if self.scoring == "softmax_of_topk" and self.num_groups > 1:
            raise ValueError("routing scoring 'softmax_of_topk' takes no expert groups")

    def rule(self) -> dict:
        """The fields that say how experts are chosen and weighted (``route_topk``'s)."""
        fields = dataclasses.asdict(self)
        del fields["fp32_logits"]
        return fields

    @classmethod
    def qwen(cls, config: PretrainedConfig) -> Routing:
        """Qwen2-MoE, Qwen3-MoE, Qwen3-Next and Qwen3.5-MoE (whose config has no
        ``norm_topk_prob``: it always renormalises)."""
        return cls(
            config.num_experts_per_tok, "softmax", bool(getattr(config, "norm_topk_prob", True))
        )

    @classmethod
    def deepseek_v2(cls, config: PretrainedConfig) -> Routing:
        """DeepSeek-V2: ``topk_method`` greedy or group_limited_greedy; HF applies no
        ``norm_topk_prob`` here."""
        method = config.topk_method
        if method not in ("greedy", "group_limited_greedy"):
            raise ValueError(f"DeepSeek-V2 topk_method {method!r} is not supported")
        grouped = method == "group_limited_greedy"
        return cls(
            config.num_experts_per_tok,
            "softmax",
            num_groups=config.n_group if grouped else 1,
            topk_groups=config.topk_group if grouped else 1,
            scaling=config.routed_scaling_factor,
            fp32_logits=True,
        )

    @classmethod
    def deepseek_v3(cls, config: PretrainedConfig) -> Routing:
        """DeepSeek-V3 (and R1, Kimi-K2): sigmoid scores with the correction bias."""
        return cls(
            config.num_experts_per_tok,
            "sigmoid",
            renormalize=bool(config.norm_topk_prob),
            num_groups=config.n_group,
            topk_groups=config.topk_group,
            scaling=config.routed_scaling_factor,
            fp32_logits=True,
        )

    def select(
        self, logits: torch.Tensor, correction_bias: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(weights, indices)`` [T, top_k] from router ``logits`` [T, E]; the weights in
        the logits' dtype."""
        if self.scoring == "softmax_of_topk":
            top, indices = logits.topk(self.top_k, dim=-1)
            return torch.softmax(top, dim=-1), indices
        if self.scoring == "softmax":
            scores = torch.softmax(logits, dim=-1, dtype=torch.float32)
            choice = self._eligible(scores, lambda g: g.max(dim=-1).values, 0.0)
        else:
            scores = logits.float().sigmoid()
            biased = scores if correction_bias is None else scores + correction_bias.float()
            top2_sum = lambda g: g.topk(2, dim=-1).values.sum(dim=-1)  # noqa: E731
            choice = self._eligible(biased, top2_sum, float("-inf"))
        indices = choice.topk(self.top_k, dim=-1).indices
        weights = scores.gather(1, indices)
        if self.renormalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return (weights * self.scaling).to(logits.dtype), indices

    def _eligible(
        self,
        choice: torch.Tensor,
        group_score: Callable[[torch.Tensor], torch.Tensor],
        fill: float,
    ) -> torch.Tensor:
        """``choice`` [T, E] with the experts outside each token's best ``topk_groups`` groups
        set to ``fill``; ``group_score`` maps the grouped choice [T, G, E/G] to [T, G]."""
        if self.num_groups == 1:
            return choice
        grouped = choice.view(choice.shape[0], self.num_groups, -1)
        best = group_score(grouped).topk(self.topk_groups, dim=-1).indices
        keep = torch.zeros(grouped.shape[:2], dtype=torch.bool, device=choice.device)
        keep.scatter_(1, best, True)
        return grouped.masked_fill(~keep[..., None], fill).view_as(choice)


class TopKRouter(Linear):
    """The router's linear layer (``[E, hidden]``, a bias where the family has one) and its
    ``Routing``; DeepSeek-V3's ``e_score_correction_bias`` [E] is a parameter beside them.

    ``forward`` returns ``(weights, indices)`` [T, top_k].
    """

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        routing: Routing,
        bias: bool = False,
        kernels: LayerKernels = TORCH_KERNELS,
    ) -> None:
        super().__init__(hidden_size, num_experts, bias, kernels)
        if routing.top_k > num_experts:
            raise ValueError(f"routing top_k must be at most {num_experts}, got {routing.top_k}")
        if num_experts % routing.num_groups:
            raise ValueError(
                f"{num_experts} experts do not split into {routing.num_groups} equal groups"
            )
        self.routing = routing
        if routing.fp32_logits:  # kept in fp32 (exact for a 16-bit checkpoint): no cast a step
            self.weight = nn.Parameter(self.weight.data.float(), requires_grad=False)
            if self.bias is not None:
                self.bias = nn.Parameter(self.bias.data.float(), requires_grad=False)
        self.e_score_correction_bias = (
            nn.Parameter(torch.empty(num_experts), requires_grad=False)
            if routing.scoring == "sigmoid"
            else None
        )

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.routing.fp32_logits and self.kernels.router_logits is not None:
            logits = self.kernels.router_logits(x, self.weight, self.bias)
        elif self.routing.fp32_logits:
            logits = F.linear(x.float(), self.weight, self.bias)
        else:
            logits = super().forward(x)
        if self.kernels.route_topk is None:
            return self.routing.select(logits, self.e_score_correction_bias)
        return self.kernels.route_topk(logits, self.e_score_correction_bias, **self.routing.rule())
