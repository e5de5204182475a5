"""Which of a model's layers hold quantised weights under a scheme (FP8, or packed integer
weights): the scheme's ``skips`` and the model's ``full_precision_modules`` stay dense."""

from __future__ import annotations

from torch import nn

from heron.layers.linear import Linear
from heron.layers.moe import ClampedSwiGLUExperts, ExpertBank, SparseMoE, SwiGLUExperts
from heron.layers.mxfp4 import Mxfp4Scheme
from heron.layers.quantization import WeightScheme
from heron.layers.routing import TopKRouter
from heron.layers.wna16 import WNA16Scheme


def fp8_linears(model: nn.Module, scheme: WeightScheme) -> list[Linear]:
    """Every :class:`Linear` of ``model`` except MoE routers (tiny, and their logits pick the
    experts), the modules the scheme skips and, under packed integer schemes, shared-expert
    gates (one output, which GPTQ and AWQ writers leave unquantised). Embeddings and the LM
    head are not ``Linear`` and stay in full precision.

    A skip fragment matches a module by its name here or by a checkpoint name it packs
    (``q_proj`` of ``qkv_proj``); a packed module some of whose shards match is an error, as
    one matrix cannot mix formats. The model's own ``full_precision_modules`` are skipped too
    (layers its family's FP8 checkpoints store unquantised).
    """
    packed: dict[str, tuple[str, str]] = getattr(model, "packed_modules", {})
    integer = isinstance(scheme, WNA16Scheme)
    gates = {
        id(m.shared_expert_gate) for m in model.modules() if integer and isinstance(m, SparseMoE)
    }
    out = []
    for name, module in model.named_modules():
        if not isinstance(module, Linear) or isinstance(module, TopKRouter) or id(module) in gates:
            continue
        parts = name.split(".")
        sources = [
            ".".join(parts[:-1] + [ckpt]) for ckpt, (into, _) in packed.items() if into == parts[-1]
        ] or [name]
        if not _skipped(model, scheme, name, sources):
            out.append(module)
    return out


def fp8_expert_banks(model: nn.Module, scheme: WeightScheme) -> list[SwiGLUExperts]:
    """Every bank of SwiGLU experts of ``model`` (gpt-oss's input-major clamped experts stay in
    full precision) but those the scheme skips, matched as :func:`fp8_linears` matches: by the
    bank's name or an expert's checkpoint names (``experts.0.down_proj``), all or none."""
    out = []
    for name, module in model.named_modules():
        if isinstance(module, SwiGLUExperts):
            sources = [f"{name}.0.{ckpt}" for ckpt in module.per_expert_names]
            if not _skipped(model, scheme, name, sources):
                out.append(module)
    return out


def mxfp4_expert_banks(model: nn.Module, scheme: Mxfp4Scheme) -> dict[str, ClampedSwiGLUExperts]:
    """gpt-oss's expert banks of ``model`` by name, but those the scheme skips; a model with other
    experts, or none, cannot hold an MXFP4 checkpoint (an error naming it)."""
    banks = {n: m for n, m in model.named_modules() if isinstance(m, ExpertBank)}
    other = [n for n, m in banks.items() if not isinstance(m, ClampedSwiGLUExperts)]
    if other or not banks:
        raise ValueError(
            f"mxfp4 checkpoints hold gpt-oss's experts; {type(model).__name__} has "
            + (f"other experts ({other[0]})" if other else "no experts")
        )
    return {n: m for n, m in banks.items() if not scheme.skips(n)}


def _skipped(model: nn.Module, scheme: WeightScheme, name: str, sources: list[str]) -> bool:
    """Whether module ``name``, which holds checkpoint modules ``sources`` in one format,
    stays in full precision; raises if the scheme skips some of them only."""
    own = tuple(getattr(model, "full_precision_modules", ()))
    skipped = [scheme.skips(source) or any(f in source for f in own) for source in sources]
    if any(skipped) and not all(skipped):
        raise ValueError(
            f"{name}: the quantisation scheme skips some of the checkpoint matrices it packs "
            f"({', '.join(s for s, k in zip(sources, skipped, strict=True) if k)}), not all"
        )
    return all(skipped)
