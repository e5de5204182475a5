"""Timers and bandwidth floors, the one place every benchmark takes them from.

A floor is the time a step cannot beat on this device: the bytes it must read (weights once,
the KV cache or recurrent state of every request) over the measured copy bandwidth. A figure's
"multiple of the floor" is its time over that.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from typing import Any

import torch

from heron.bench.shapes import Shape


def synchronize(device: torch.device | str) -> None:
    """Wait for the device's queued work (host timers around device work need it)."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def copy_bandwidth(device: torch.device | str = "cuda") -> float:
    """Measured device copy bandwidth in bytes/s (read + write of a 2 GiB buffer), timed with
    CUDA events after a warm-up."""
    src = torch.empty(1 << 30, dtype=torch.int16, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        dst.copy_(src)
    end.record()
    torch.cuda.synchronize(device)
    return 10 * 2 * src.numel() * 2 / (start.elapsed_time(end) / 1e3)


def device_time_us(launch: Callable[[Any], Any], items: Sequence[Any], reps: int = 10) -> float:
    """Device µs per item of ``launch(item)``: run eagerly once (compiling), then captured as
    one CUDA graph over all ``items`` and replayed ``reps`` times between CUDA events. Items
    are copies of the operands large enough together to overflow the L2 cache, so each call
    reads its operands from HBM as in a real step (eager timing of microsecond kernels would
    measure the host's launches instead)."""
    for item in items:
        launch(item)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for item in items:
            launch(item)
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (reps * len(items))


def steady_decode_ms(token_times: list[list[float]]) -> float:
    """Mean decode time per step while every request decodes, from each request's token times
    (seconds, as the caller of ``LLMEngine.step`` sees them): the window starts when the last
    request got its first token (before that, prefill chunks of the others share the steps)
    and ends when the first request got its last one (after that, the batch shrinks). Each
    request's (last - first) / (n - 1) over its tokens in that window is averaged."""
    start = max(times[0] for times in token_times)
    end = min(times[-1] for times in token_times)
    per_step = []
    for times in token_times:
        window = [t for t in times if start <= t <= end]
        if len(window) > 1:
            per_step.append((window[-1] - window[0]) / (len(window) - 1))
    if not per_step:
        raise ValueError("no two steps in which every request decodes: generate more tokens")
    return statistics.mean(per_step) * 1e3


def median_of(runs: list[float]) -> tuple[float, str | None]:
    """The median of repeated runs, and their spread as a note (None for one run)."""
    if len(runs) == 1:
        return runs[0], None
    return statistics.median(runs), f"median of {len(runs)} runs, {min(runs):.4g}–{max(runs):.4g}"


def percentiles(values: list[float]) -> tuple[float, float, float]:
    """p50, p90, p99 (the value itself for fewer than two)."""
    if len(values) < 2:
        v = values[0] if values else float("nan")
        return v, v, v
    q = statistics.quantiles(values, n=100, method="inclusive")
    return q[49], q[89], q[98]


def step_bytes(
    shape: Shape,
    batch: int,
    context: float,
    experts_read: float = 0.0,
    weight_bytes: float = 2,
    kv_bytes: int = 2,
    tp: int = 1,
    expert_bytes: float | None = None,
) -> float:
    """Bytes one GPU of ``tp`` must read in a decode step of ``batch`` requests at ``context``
    tokens: its share of the weights (``weight_bytes`` per element of the projections and
    experts; embeddings, LM head and routers bf16; of an MoE layer, its router, shared experts
    and ``experts_read`` routed experts), of the KV cache (``kv_bytes`` per element; a sliding
    layer reads at most its window; a rank holds one KV head at least) and, for gated-delta
    layers, of the recurrent and conv state, read and written. ``expert_bytes`` (gpt-oss: its
    MXFP4 experts) is a routed expert's per element where it differs from ``weight_bytes``."""
    c = shape.fields
    d, layers, vocab = c["hidden_size"], c["num_hidden_layers"], c["vocab_size"]
    if shape.family == "mla":
        return _mla_bytes(c, batch, context, experts_read, weight_bytes, tp)
    h, kv, hd = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
    kv_share = max(kv // tp, 1)
    head = 2 * vocab * d  # the LM head (the tied or untied embedding table)
    if shape.family == "hybrid":
        return _hybrid_bytes(c, batch, context, experts_read, weight_bytes, kv_bytes, tp)
    attention = d * (h + 2 * kv) * hd + h * hd * d
    routers, expert_bytes = 0, weight_bytes if expert_bytes is None else expert_bytes
    if shape.family in ("moe", "gpt-oss"):
        width = c["moe_intermediate_size" if shape.family == "moe" else "intermediate_size"]
        mlp = experts_read * 3 * d * width * expert_bytes / weight_bytes
        routers = 2 * layers * c.get("num_experts", c.get("num_local_experts")) * d
        if shape.family == "gpt-oss":  # and the experts' biases, in bf16 like the routers
            routers += 2 * layers * experts_read * (2 * width + d)
    else:
        mlp = 3 * d * c["intermediate_size"]
    weights = weight_bytes * layers * (attention + mlp) + head
    window = c.get("sliding_window")
    period = 2 if shape.family == "gpt-oss" else 6  # Gemma 3: five sliding layers to one full
    read = sum(
        min(context, window) if window is not None and (i + 1) % period else context
        for i in range(layers)
    )
    cache = batch * read * 2 * kv_share * hd * kv_bytes
    return weights / tp + routers + cache


def _hybrid_bytes(c, batch, context, experts_read, weight_bytes, kv_bytes, tp) -> float:
    """Qwen3.5: three gated-delta-rule layers to one gated full-attention layer."""
    d, h, kv, hd = (
        c["hidden_size"],
        c["num_attention_heads"],
        c["num_key_value_heads"],
        c["head_dim"],
    )
    hk, hv = c["linear_num_key_heads"], c["linear_num_value_heads"]
    dk, dv = c["linear_key_head_dim"], c["linear_value_head_dim"]
    width = c["linear_conv_kernel_dim"]
    conv_dim = 2 * hk * dk + hv * dv
    num_full = c["num_hidden_layers"] // 4
    num_gdn = c["num_hidden_layers"] - num_full
    routers = 0
    if "num_experts" in c:
        expert = 3 * d * c["moe_intermediate_size"]
        shared = 3 * d * c["shared_expert_intermediate_size"] + d
        mlp = experts_read * expert + shared
        routers = c["num_hidden_layers"] * c["num_experts"] * d
    else:
        mlp = 3 * d * c["intermediate_size"]
    full = d * (2 * h + 2 * kv) * hd + h * hd * d + mlp  # q_proj carries the gate
    gdn = d * (conv_dim + hv * dv + 2 * hv) + conv_dim * width + hv * dv * d
    weights = weight_bytes * (num_full * full + num_gdn * (gdn + mlp)) + 2 * c["vocab_size"] * d
    cache = batch * context * num_full * 2 * max(kv // tp, 1) * hd * kv_bytes
    # Read and written every step: the fp32 recurrent state and the bf16 conv state.
    state = num_gdn * (hv * dk * dv * 4 + conv_dim * (width - 1) * 2) / tp
    return weights / tp + 2 * routers + cache + 2 * batch * state


def _mla_bytes(c, batch, context, experts_read, weight_bytes, tp) -> float:
    """DeepSeek: latent attention (``kv_b_proj``, absorbed, stays bf16; a rank holds the whole
    of ``q_a_proj``, ``kv_a_proj_with_mqa``, the routers and the bf16 latent cache)."""
    d, h, lora = c["hidden_size"], c["num_attention_heads"], c["kv_lora_rank"]
    rope, nope, v, q_lora = (
        c["qk_rope_head_dim"],
        c["qk_nope_head_dim"],
        c["v_head_dim"],
        c["q_lora_rank"],
    )
    q_a = 0 if q_lora is None else d * q_lora
    q = d * h * (nope + rope) if q_lora is None else q_lora * h * (nope + rope)
    kv_b = lora * h * (nope + v)
    layers, dense = c["num_hidden_layers"], c["first_k_dense_replace"]
    expert = 3 * d * c["moe_intermediate_size"]
    experts = (experts_read + c["n_shared_experts"]) * expert
    mlps = dense * 3 * d * c["intermediate_size"] + (layers - dense) * experts
    routers = (layers - dense) * c["n_routed_experts"] * d
    sharded = weight_bytes * (layers * (q + h * v * d) + mlps) + 2 * (
        layers * kv_b + c["vocab_size"] * d
    )
    replicated = weight_bytes * layers * (q_a + d * (lora + rope)) + 2 * routers
    latent = batch * context * layers * (lora + rope) * 2
    return sharded / tp + replicated + latent


def has_experts(shape: Shape) -> bool:
    """Whether a step reads only the experts its routing touches (which must be counted)."""
    return any(k in shape.fields for k in ("num_experts", "n_routed_experts", "num_local_experts"))
