"""Memory-bound GEMV-style linear for few rows: ``y = x @ weight.T (+ bias)``.

At decode time a linear layer multiplies a handful of activation rows by a weight matrix that is
read once from HBM, so its speed is the weight's bytes over the memory bandwidth. cuBLAS picks
GEMM tiles built for many rows and reaches a fraction of that bandwidth on the small projections
of a 1B-class model; this kernel streams the weight instead.

Each program owns ``BLOCK_N`` output columns for every row of ``x`` (rows padded to a power of
two ``M_PAD`` and masked) and one range of ``K``: it loads ``[BLOCK_N, BLOCK_K]`` tiles of the
weight with wide loads along ``K`` and multiplies them by the matching chunk of ``x``, with a
broadcast multiply and a sum (few rows) or ``tl.dot`` on the swapped product
``weight_tile @ x_chunk.T`` (``M_PAD >= 16``), accumulating in fp32.

When the output has too few column blocks to fill the GPU (``N = 1024`` for an o or down
projection), ``K`` is split over ``SPLIT_K`` programs per column block. Each stores its fp32
partial sums to a workspace, then takes a ticket from a per-column-block counter; the program
that takes the last ticket adds the partials in split order (deterministic: the same order
whatever the arrival order), writes the output and resets the counter to zero for the next call.
The counters live in a per-device buffer that is allocated zeroed once and never freed, so one
launch does the whole call, with no host sync, and the call can be captured in a CUDA graph
(calls on one stream only: two streams running split calls at once would share counters).

A LoRA layer's one-token step adds its update where the output is stored (``lora=``): each
program loads its adapter's ``B`` rows for its columns and streams the weight before it waits
for the shrink kernel launched just before it (which started it early), then adds the token's
shrunk vector times those rows: the shrink runs while the weight streams, and the step launches
no expand kernel. (More tokens take ``lora_gemv``, which does the shrink too.)
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import torch
import triton
import triton.language as tl

from heron.kernels.activation import ACTIVATIONS, gated, gated_activation
from heron.kernels.pdl import multiprocessor_count, pdl_launch, wait_for_previous_kernel

#: The largest row count the kernel is meant for; bigger inputs are done ``MAX_M`` rows at a time.
MAX_M = 64
#: Up to this many rows the configuration rule serves any shape; past it, only shapes with a
#: measured entry (where the kernel beat cuBLAS on an H200) take the kernel (see ``serves``).
RULE_MAX_M = 16


@triton.jit
def _finish(acc, b_ptr, y_ptr, offs_m, offs_n, n_mask, out_mask, stride_ym, HAS_BIAS: tl.constexpr):
    """Adds the bias to the fp32 tile ``acc`` [M_PAD, BLOCK_N] and stores it in ``y``'s dtype."""
    if HAS_BIAS:
        b = tl.load(b_ptr + offs_n, mask=n_mask, other=0.0)
        acc += b.to(tl.float32)[None, :]
    y_ptrs = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def _lora_b_rows(lb_ptr, lslot_ptr, offs_n, n_mask, L_R, stride_lb_s, stride_lb_n,
                 L_BLOCK_R: tl.constexpr):  # fmt: skip
    """The one row's slot's ``B`` rows for the tile's columns, ``[BLOCK_N, L_BLOCK_R]``: loaded
    before the weight is streamed, they arrive while it is."""
    ranks = tl.arange(0, L_BLOCK_R)
    slot = tl.load(lslot_ptr).to(tl.int64)
    return tl.load(
        lb_ptr + slot * stride_lb_s + offs_n[:, None] * stride_lb_n + ranks[None, :],
        mask=n_mask[:, None] & (ranks[None, :] < L_R),
        other=0.0,
    )


@triton.jit
def _lora_update(acc, ls_ptr, b, offs_m, L_R, L_SPLITS, stride_ls_split,
                 L_BLOCK_R: tl.constexpr, L_SPLITS_PAD: tl.constexpr):  # fmt: skip
    """``acc`` [M_PAD, BLOCK_N] with row 0's update ``sum(shrunk) B^T`` added: ``b`` from
    ``_lora_b_rows``, the shrink's partial sums ``[L_SPLITS, L_R]`` loaded here."""
    ranks = tl.arange(0, L_BLOCK_R)
    splits = tl.arange(0, L_SPLITS_PAD)
    shrunk = tl.load(
        ls_ptr + splits[:, None] * stride_ls_split + ranks[None, :],
        mask=(splits[:, None] < L_SPLITS) & (ranks[None, :] < L_R),
        other=0.0,
    )
    delta = tl.sum(b.to(tl.float32) * tl.sum(shrunk, axis=0)[None, :], axis=1)
    return acc + tl.where(offs_m[:, None] == 0, delta[None, :], 0.0)


@triton.jit
def _tile(x_ptr, w_ptr, pid_n, pid_k, M, N, K, stride_xm, k_per_split,
          M_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):  # fmt: skip
    """Program ``(pid_n, pid_k)``'s rows, columns, K offsets, their masks, its K range and its
    first weight and x tiles' pointers."""
    offs_m = tl.arange(0, M_PAD)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    # int64 row offsets: N * K can pass 2**31 for a large vocabulary times a wide hidden size.
    w_ptrs = w_ptr + tl.cast(offs_n, tl.int64)[:, None] * K + offs_k[None, :]
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :]
    return offs_m, offs_n, offs_k, offs_m < M, offs_n < N, k_start, k_end, w_ptrs, x_ptrs


@triton.jit
def _load_tile(ptrs, n_mask, k_mask, EVEN_N: tl.constexpr, EVEN_K: tl.constexpr):
    """A weight tile [BLOCK_N, BLOCK_K], masked only where the shape needs it."""
    if EVEN_K:
        if EVEN_N:
            w = tl.load(ptrs)
        else:
            w = tl.load(ptrs, mask=n_mask[:, None], other=0.0)
    else:
        w = tl.load(ptrs, mask=n_mask[:, None] & k_mask[None, :], other=0.0)
    return w


@triton.jit
def _load_tiles(w_ptrs, x_ptrs, k, k_end, offs_k, m_mask, n_mask,
                EVEN_N: tl.constexpr, EVEN_K: tl.constexpr):  # fmt: skip
    """The weight tile (in x's dtype) and x tile at ``k``, and the K and x masks they took."""
    k_mask = (k + offs_k) < k_end
    if EVEN_K:
        x_mask = m_mask[:, None]
    else:
        x_mask = m_mask[:, None] & k_mask[None, :]
    w = _load_tile(w_ptrs + k, n_mask, k_mask, EVEN_N, EVEN_K).to(x_ptrs.dtype.element_ty)
    x = tl.load(x_ptrs + k, mask=x_mask, other=0.0)
    return w, x, k_mask, x_mask


@triton.jit
def _split_sum(acc, part_ptr, cnt_ptr, pid_n, pid_k, split_k, M, N, offs_m, offs_n, out_mask):
    """Stores this program's fp32 partial sums ``acc`` [M_PAD, BLOCK_N] of its column block
    (workspace ``[split_k, M, N]``) and takes the block's ticket. The program that takes the
    last one gets every split's sums added in split order (the same result whatever the order
    of arrival) and hands the ticket back for the next call: ``(sums, whether it was last)``."""
    part_ptrs = part_ptr + (pid_k * M + offs_m)[:, None] * N + offs_n[None, :]
    tl.store(part_ptrs, acc, mask=out_mask)
    # Every thread's partial store is done before the ticket (release) is taken.
    tl.debug_barrier()
    last = tl.atomic_add(cnt_ptr + pid_n, 1, sem="acq_rel", scope="gpu") == split_k - 1
    if last:
        acc = tl.zeros_like(acc)
        for s in range(0, split_k):
            p_ptrs = part_ptr + (s * M + offs_m)[:, None] * N + offs_n[None, :]
            acc += tl.load(p_ptrs, mask=out_mask, other=0.0, cache_modifier=".cg")
        tl.store(cnt_ptr + pid_n, 0)
    return acc, last


@triton.jit
def _accumulate(acc, w, x, USE_DOT: tl.constexpr, DOT_PREC: tl.constexpr):
    """``acc`` plus the tile's products: ``w @ x.T`` ([BLOCK_N, M_PAD]) with ``USE_DOT``, else
    ``x @ w.T`` ([M_PAD, BLOCK_N]) as a broadcast multiply and a sum."""
    if USE_DOT:
        acc = tl.dot(w, tl.trans(x), acc=acc, input_precision=DOT_PREC)
    else:
        acc += tl.sum(x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)
    return acc


@triton.jit
def _accumulate_scaled(acc, w, x, s, USE_DOT: tl.constexpr, DOT_PREC: tl.constexpr):
    """``acc`` plus the tile's products times ``s`` [BLOCK_N], the scale of each weight row's
    block that this tile lies in."""
    part = _accumulate(tl.zeros_like(acc), w, x, USE_DOT, DOT_PREC)
    if USE_DOT:
        acc += part * s[:, None]
    else:
        acc += part * s[None, :]
    return acc


@triton.jit
def _gemv_kernel(
    x_ptr,
    w_ptr,
    b_ptr,
    s_ptr,
    y_ptr,
    part_ptr,
    cnt_ptr,
    u_ptr,
    ls_ptr,
    lb_ptr,
    lslot_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_um,
    stride_ym,
    k_per_split,
    stride_sn,
    L_R,
    L_SPLITS,
    stride_ls_split,
    stride_lb_s,
    stride_lb_n,
    ACT: tl.constexpr,  # 0: x as given; else x = act(x) * u (ACTIVATIONS), u often x[:, K:]
    # 0: y = x @ w.T; else w is [2N, K], [gate; up], and y = act(x @ gate.T) * (x @ up.T)
    GATED_OUT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    # 0: w in x's dtype; 1: FP8 w times s[n] (per output channel, in the epilogue); 2: FP8 w
    # times s[n // SCALE_BN, k // SCALE_BK] (per block, per tile: BLOCK_K divides SCALE_BK)
    SCALE: tl.constexpr,
    SCALE_BN: tl.constexpr,
    SCALE_BK: tl.constexpr,
    # > 0: add the one row's LoRA update (``_lora_update``), ranks padded to L_BLOCK_R
    L_BLOCK_R: tl.constexpr,
    L_SPLITS_PAD: tl.constexpr,
    HAS_SPLIT: tl.constexpr,
    EVEN_N: tl.constexpr,
    EVEN_K: tl.constexpr,
    USE_DOT: tl.constexpr,
    DOT_PREC: tl.constexpr,
    M_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    if L_BLOCK_R == 0:
        wait_for_previous_kernel(USE_PDL)
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_m, offs_n, offs_k, m_mask, n_mask, k_start, k_end, w_ptrs, x_ptrs = _tile(
        x_ptr, w_ptr, pid_n, pid_k, M, N, K, stride_xm, k_per_split, M_PAD, BLOCK_N, BLOCK_K
    )
    u_ptrs = u_ptr + offs_m[:, None] * stride_um + offs_k[None, :]
    if USE_DOT:
        acc = tl.zeros([BLOCK_N, M_PAD], dtype=tl.float32)
    else:
        acc = tl.zeros([M_PAD, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros_like(acc)  # with GATED_OUT: the up rows' products
    if L_BLOCK_R > 0:
        lora_b = _lora_b_rows(
            lb_ptr, lslot_ptr, offs_n, n_mask, L_R, stride_lb_s, stride_lb_n, L_BLOCK_R
        )
    for k in tl.range(k_start, k_end, BLOCK_K, num_stages=NUM_STAGES):
        w, x, k_mask, x_mask = _load_tiles(
            w_ptrs, x_ptrs, k, k_end, offs_k, m_mask, n_mask, EVEN_N, EVEN_K
        )
        if ACT != 0:
            # Rounded to the input dtype, as an unfused activation kernel would store it.
            up = tl.load(u_ptrs + k, mask=x_mask, other=0.0)
            x = gated(x, up, ACT, x_ptr.dtype.element_ty).to(x_ptr.dtype.element_ty)
        if SCALE == 2:
            s_ptrs = s_ptr + (offs_n // SCALE_BN) * stride_sn + k // SCALE_BK
            acc = _accumulate_scaled(
                acc, w, x, tl.load(s_ptrs, mask=n_mask, other=0.0), USE_DOT, DOT_PREC
            )
        else:
            acc = _accumulate(acc, w, x, USE_DOT, DOT_PREC)
        if GATED_OUT != 0:
            w_up = _load_tile(w_ptrs + tl.cast(N, tl.int64) * K + k, n_mask, k_mask, EVEN_N, EVEN_K)
            w_up = w_up.to(x_ptr.dtype.element_ty)
            if SCALE == 2:
                s_ptrs = s_ptr + ((offs_n + N) // SCALE_BN) * stride_sn + k // SCALE_BK
                acc_up = _accumulate_scaled(
                    acc_up, w_up, x, tl.load(s_ptrs, mask=n_mask, other=0.0), USE_DOT, DOT_PREC
                )
            else:
                acc_up = _accumulate(acc_up, w_up, x, USE_DOT, DOT_PREC)
    if L_BLOCK_R > 0:
        # The kernel before this one is the shrink of this x, which started this one once its
        # own wait had returned: x was complete then, and only the shrunk sums are waited for.
        wait_for_previous_kernel(USE_PDL)
    if USE_DOT:
        acc = tl.trans(acc)
        acc_up = tl.trans(acc_up)
    if SCALE == 1:
        acc *= tl.load(s_ptr + offs_n, mask=n_mask, other=0.0)[None, :]
        if GATED_OUT != 0:
            acc_up *= tl.load(s_ptr + N + offs_n, mask=n_mask, other=0.0)[None, :]
    if GATED_OUT != 0:
        # Each half rounded as the unfused product stores it (bias included), then the
        # activation as the unfused activation kernel computes it.
        dtype = y_ptr.dtype.element_ty
        if HAS_BIAS:
            acc += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
            acc_up += tl.load(b_ptr + N + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        acc = gated(acc.to(dtype), acc_up.to(dtype), GATED_OUT, dtype)

    out_mask = m_mask[:, None] & n_mask[None, :]
    if HAS_SPLIT:
        total, last = _split_sum(
            acc, part_ptr, cnt_ptr, pid_n, pid_k, tl.num_programs(1), M, N, offs_m, offs_n,
            out_mask,
        )  # fmt: skip
        if last:
            if L_BLOCK_R > 0:
                total = _lora_update(
                    total, ls_ptr, lora_b, offs_m, L_R, L_SPLITS, stride_ls_split, L_BLOCK_R,
                    L_SPLITS_PAD,
                )  # fmt: skip
            _finish(total, b_ptr, y_ptr, offs_m, offs_n, n_mask, out_mask, stride_ym, HAS_BIAS)
    else:
        if L_BLOCK_R > 0:
            acc = _lora_update(
                acc, ls_ptr, lora_b, offs_m, L_R, L_SPLITS, stride_ls_split, L_BLOCK_R, L_SPLITS_PAD
            )
        _finish(acc, b_ptr, y_ptr, offs_m, offs_n, n_mask, out_mask, stride_ym,
                HAS_BIAS and GATED_OUT == 0)  # fmt: skip


class GemvConfig(tuple):
    """``(use_dot, block_n, block_k, num_warps, num_stages, split_k)`` for one launch."""

    __slots__ = ()

    def __new__(cls, use_dot, block_n, block_k, num_warps, num_stages, split_k):
        return super().__new__(cls, (use_dot, block_n, block_k, num_warps, num_stages, split_k))

    use_dot = property(lambda self: self[0])
    block_n = property(lambda self: self[1])
    block_k = property(lambda self: self[2])
    num_warps = property(lambda self: self[3])
    num_stages = property(lambda self: self[4])
    split_k = property(lambda self: self[5])


#: The measured launch configurations (``benchmarks/tune_gemv.py --write``): per device name,
#: per ``(M_PAD, N, K)``. Shapes without an entry, and fp32, take ``_default_config``.
TUNED_PATH = Path(__file__).parent / "configs" / "gemv.json"
_FIELDS = ["use_dot", "block_n", "block_k", "num_warps", "num_stages", "split_k"]
_ABOUT = (
    "Measured launch configurations of heron.kernels.gemv (benchmarks/tune_gemv.py --write): "
    "per device name (torch.cuda.get_device_name), per 'rows padded to a power of two,N,K' of "
    "the weight's [N, K]. Timed in bf16 with the weights cold in HBM, in CUDA-graph replays; "
    "they serve fp16 too. A device name ending in ' fp8' holds the entries timed over FP8 "
    "weights (tune_gemv.py --fp8); FP8 shapes without one take the 16-bit entry. Shapes "
    "without an entry take the rule in gemv._default_config."
)
#: The suffix of a device's table of FP8-weight entries.
FP8_TABLE = " fp8"

Table = dict[tuple[int, int, int], GemvConfig]


def read_tuned(path: Path = TUNED_PATH) -> dict[str, Table]:
    """Each device name's measured configurations in the data file at ``path``."""
    data = json.loads(path.read_text())
    assert data["fields"] == _FIELDS, f"{path}: fields {data['fields']}"
    return {
        device: {tuple(map(int, key.split(","))): GemvConfig(*cfg) for key, cfg in table.items()}
        for device, table in data["devices"].items()
    }


def write_tuned(tables: dict[str, Table], path: Path = TUNED_PATH) -> None:
    """Writes ``tables`` (as :func:`read_tuned` returns them) to ``path``, an entry a line."""
    devices = []
    for device, table in sorted(tables.items()):
        rows = [
            f'   "{m},{n},{k}": {json.dumps(list(cfg))}' for (m, n, k), cfg in sorted(table.items())
        ]
        devices.append(f"  {json.dumps(device)}: {{\n" + ",\n".join(rows) + "\n  }")
    path.write_text(
        f'{{\n "about": {json.dumps(_ABOUT)},\n "fields": {json.dumps(_FIELDS)},\n'
        ' "devices": {\n' + ",\n".join(devices) + "\n }\n}\n"
    )


@functools.cache
def _tables() -> dict[str, Table]:
    return read_tuned()


_TUNED: dict[tuple[torch.device, bool], Table] = {}


def _tuned(device: torch.device, fp8: bool = False) -> Table:
    """The measured configurations for ``device``'s model (none off CUDA), read once: over
    16-bit weights, or with ``fp8`` over FP8 ones."""
    table = _TUNED.get((device, fp8))
    if table is None:
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
        table = _TUNED[device, fp8] = _tables().get(name + (FP8_TABLE if fp8 else ""), {})
    return table


def _measured(key: tuple[int, int, int], device: torch.device, fp8: bool) -> GemvConfig | None:
    """The measured configuration of ``key``: for an FP8 weight its own entry, else the
    16-bit weight's."""
    return (_tuned(device, True).get(key) if fp8 else None) or _tuned(device).get(key)


_CONFIG_CACHE: dict[tuple, GemvConfig] = {}
_COUNTERS: dict[torch.device, torch.Tensor] = {}
_RETIRED: list[torch.Tensor] = []


#: Shared memory a program's tile pipeline may take (an H200 SM has 227 KiB; the rule's 64 rows
#: in 4 stages of 64 x 256 bf16 tiles asked for 256 KiB and did not launch).
_PIPELINE_BYTES = 192 * 1024


def _m_pad(m: int) -> int:
    return triton.next_power_of_2(max(1, m))


def _default_config(
    m_pad: int, n: int, k: int, elem_size: int, num_sms: int, gated: bool = False
) -> GemvConfig:
    """One wave of long-running programs that stream their slab through a multi-stage pipeline.

    One row with few column blocks: broadcast-multiply programs of 8 columns over all of ``K``
    (16 for a gated input when 8 would make more than two programs per SM). Otherwise
    ``tl.dot`` on ``weight_tile @ x.T`` (rows padded to 16; the broadcast form spills registers
    from 4 rows up), 64 columns a program (32 when that leaves fewer programs than about 0.7
    per SM), ``K`` split while the programs fit in one wave and each keeps two tiles. A gated
    input (a down projection: few columns, a long ``K``) splits ``K`` until the programs fill
    at least one wave, in 128-wide tiles: what the measured winners of Qwen3-0.6B, Gemma-3-1B
    and Llama-3-8B share, where the one-wave rule read at half the bandwidth or less. Tiles
    hold half as many fp32 elements, to stay within shared memory (``_config`` also caps the
    pipeline's depth, see ``_fit_pipeline``).
    """
    wide = elem_size <= 2
    if m_pad == 1 and k >= 1024:
        for block_n in (8, 16) if gated else (8,):
            if triton.cdiv(n, block_n) <= 2 * num_sms:
                return GemvConfig(False, block_n, 1024 if wide else 512, 4, 3, 1)
    block_k = min(256 if wide else 128, max(16, triton.next_power_of_2(k)))
    if gated:
        block_k = min(block_k, 128)
        n_blocks, split = triton.cdiv(n, 64), 1
        while n_blocks * split < num_sms and k // (split * 2) >= 2 * block_k:
            split *= 2
        return GemvConfig(True, 64, block_k, 4, 3, split)
    block_n = 64 if triton.cdiv(n, 64) * 4 >= num_sms else 32
    n_blocks = triton.cdiv(n, block_n)
    stages = 4 if wide else 3
    if n_blocks >= 4 * num_sms:  # an lm_head: many waves, short tiles pipelined 3 deep
        block_k, stages = min(block_k, 128), 3
    split = 1
    while n_blocks * split * 2 <= num_sms and k // (split * 2) >= 2 * block_k:
        split *= 2
    return GemvConfig(True, block_n, block_k, 4, stages, split)


def _config(
    m_pad: int,
    n: int,
    k: int,
    elem_size: int,
    device: torch.device,
    gated: bool = False,
    gated_out: bool = False,
    fp8: bool = False,
) -> GemvConfig:
    """The launch configuration of an ``[m_pad, k] x [n, k]^T`` product (``gated``: with a
    gated input; ``gated_out``: gated in the epilogue, ``n`` the gate and up rows together;
    ``fp8``: over an FP8 weight)."""
    key = (m_pad, n, k, elem_size, device, gated, gated_out, fp8)
    cfg = _CONFIG_CACHE.get(key)
    if cfg is None:
        cfg = _measured((m_pad, n, k), device, fp8) if elem_size == 2 else None
        cfg = cfg or _default_config(m_pad, n, k, elem_size, multiprocessor_count(device), gated)
        if gated_out:  # the epilogue needs each program's whole K: no split
            cfg = GemvConfig(*cfg[:5], 1)
        cfg = _fit_pipeline(cfg, m_pad, elem_size, gated, gated_out)
        _CONFIG_CACHE[key] = cfg
    return cfg


def _fit_pipeline(
    cfg: GemvConfig, m_pad: int, elem_size: int, gated: bool, gated_out: bool = False
) -> GemvConfig:
    """``cfg`` with no more stages than ``_PIPELINE_BYTES`` hold: a stage is an x tile (two,
    gate and up, for a gated input; rows padded to 16 for ``tl.dot``) and a weight tile (two
    for a gated output)."""
    rows = max(16, m_pad) if cfg.use_dot else m_pad
    x_tiles, w_tiles = (2 if gated else 1), (2 if gated_out else 1)
    stage_bytes = (x_tiles * rows + w_tiles * cfg.block_n) * cfg.block_k * elem_size
    stages = max(1, min(cfg.num_stages, _PIPELINE_BYTES // stage_bytes))
    if stages == cfg.num_stages:
        return cfg
    return GemvConfig(cfg.use_dot, cfg.block_n, cfg.block_k, cfg.num_warps, stages, cfg.split_k)


def _counters(device: torch.device, n_blocks: int) -> torch.Tensor:
    """The per-device split-K tickets: zeroed once, reset to zero by every call, never freed."""
    buf = _COUNTERS.get(device)
    if buf is None or buf.numel() < n_blocks:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                "linear_small_m: run a split-K call of this shape once before CUDA-graph capture"
            )
        buf = torch.zeros(max(8192, n_blocks), dtype=torch.int32, device=device)
        # Keep the old buffer alive: graphs captured earlier still point at it.
        _COUNTERS[device] = buf
        _RETIRED.append(buf)
    return buf


def _split_layout(n: int, k: int, cfg: GemvConfig) -> tuple[int, int, int]:
    """``(K per program, programs per column block, column blocks)`` of ``cfg`` over an
    ``[n, k]`` weight: ``K`` split in whole tiles (the last split may be shorter, and fewer
    splits than asked may cover ``K``)."""
    k_per_split = triton.cdiv(triton.cdiv(k, cfg.split_k), cfg.block_k) * cfg.block_k
    return k_per_split, triton.cdiv(k, k_per_split), triton.cdiv(n, cfg.block_n)


def _launch(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    out: torch.Tensor,
    cfg: GemvConfig,
    act: int = 0,
    gated_out: int = 0,
    w_scale: torch.Tensor | None = None,
    w_block: tuple[int, int] | None = None,
    up: torch.Tensor | None = None,
    lora: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> None:
    M = x.shape[0]
    N, K = weight.shape
    if gated_out:
        assert cfg.split_k == 1, "a gated output needs each program's whole K"
        N //= 2
    m_pad = _m_pad(M)
    if cfg.use_dot:
        m_pad = max(16, m_pad)
    k_per_split, split, n_blocks = _split_layout(N, K, cfg)
    if split > 1:
        part = torch.empty(split * M * N, dtype=torch.float32, device=x.device)
        cnt = _counters(x.device, n_blocks)
    else:
        part = cnt = out
    if up is None:  # a gated input lies in x as [gate | up]
        up = x[:, K:] if act else x
    if lora is None:  # (pointers the kernel never reads)
        lora, lora_args, l_block_r, l_splits_pad = (out, out, out), (0,) * 5, 0, 1
    else:
        shrunk, lora_b, _ = lora
        lora_args = (lora_b.shape[2], shrunk.shape[1], shrunk.stride(1), *lora_b.stride()[:2])
        l_block_r = triton.next_power_of_2(lora_b.shape[2])
        l_splits_pad = triton.next_power_of_2(shrunk.shape[1])
    _gemv_kernel[(n_blocks, split)](
        x,
        weight,
        bias if bias is not None else weight,
        w_scale if w_scale is not None else weight,
        out,
        part,
        cnt,
        up,
        *lora,
        M,
        N,
        K,
        x.stride(0),
        up.stride(0),
        out.stride(0),
        k_per_split,
        w_scale.stride(0) if w_block else 0,
        *lora_args,
        ACT=act,
        GATED_OUT=gated_out,
        HAS_BIAS=bias is not None,
        SCALE=0 if w_scale is None else 2 if w_block else 1,
        SCALE_BN=w_block[0] if w_block else 1,
        SCALE_BK=w_block[1] if w_block else 1,
        L_BLOCK_R=l_block_r,
        L_SPLITS_PAD=l_splits_pad,
        HAS_SPLIT=split > 1,
        EVEN_N=N % cfg.block_n == 0,
        EVEN_K=K % k_per_split == 0,
        USE_DOT=cfg.use_dot,
        DOT_PREC="ieee" if x.dtype == torch.float32 else "tf32",
        M_PAD=m_pad,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        NUM_STAGES=cfg.num_stages,
        num_warps=cfg.num_warps,
        **pdl_launch(x.device),
    )


def serves(m: int, n: int, k: int, device: torch.device, fp8: bool = False) -> bool:
    """Whether an ``[m, k] x [n, k]^T`` product (in half precision; ``fp8``: over an FP8
    weight) on ``device`` should take this kernel rather than the vendor's: up to
    ``RULE_MAX_M`` rows any shape, up to ``MAX_M`` rows the shapes measured faster here (the
    device's tuned entries; a gated input has the key of its plain product, ``k`` the weight's
    width)."""
    return m <= RULE_MAX_M or (m <= MAX_M and _measured((_m_pad(m), n, k), device, fp8) is not None)


def linear_small_m(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    act: str | None = None,
    gated_out: str | None = None,
    w_scale: torch.Tensor | None = None,
    w_block: tuple[int, int] | None = None,
    up: torch.Tensor | None = None,
    lora: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """``x @ weight.T (+ bias)`` for few rows of ``x`` [M, K]; ``weight`` is [N, K] row-major.

    With ``act`` (a key of ``ACTIVATIONS``) ``x`` is ``[M, 2K]`` laid out as ``[gate | up]`` and
    the product is ``(act(gate) * up) @ weight.T``: a gated MLP's activation fused into its down
    projection; given ``up`` [M, K] apart, ``x`` [M, K] is the gate alone. With ``gated_out``
    (a key of ``ACTIVATIONS``) ``weight`` (and ``bias``) stack ``[gate; up]``, ``2N`` rows, and
    the result is ``act(x @ gate.T) * (x @ up.T)`` [M, N]: the activation in the epilogue of a
    gated MLP's gate_up projection, rounded as the unfused product and activation would round. With ``w_scale`` the weight is FP8 E4M3 and stands for
    ``weight * w_scale``: fp32 ``[N]`` per output row (applied in the epilogue), or, with
    ``w_block = (bn, bk)`` (powers of two), ``[ceil(N / bn), ceil(K / bk)]`` per block. With
    ``lora = (shrunk, b, slots)`` the one row of ``x`` gains its LoRA update ``shrunk[0].sum(0)
    @ b[slots[0]].T`` in the epilogue (``shrunk`` [1, splits, R] fp32 partial sums as
    ``lora.lora_shrink`` made them in the launch just before this one, ``b`` [S, N, R]; not
    with an activation). Accumulates in fp32 and returns ``x.dtype`` (bf16, fp16 or fp32).
    Rows of ``x`` and ``out`` may be strided (unit last stride). Meant for ``M <= MAX_M``;
    larger ``M`` runs ``MAX_M`` rows per launch. No host sync: capturable in a CUDA graph once
    each shape has run eagerly.
    """
    packed = act is not None and up is None
    width = weight.shape[1] * (2 if packed else 1) if weight.dim() == 2 else -1
    if x.dim() != 2 or x.shape[1] != width or (gated_out and (act or weight.shape[0] % 2)):
        raise ValueError(f"linear_small_m: shapes {tuple(x.shape)} x {tuple(weight.shape)}")
    if up is not None and (act is None or up.shape != x.shape or up.stride(1) != 1):
        raise ValueError(f"linear_small_m: up {tuple(up.shape)} must be the gate's shape")
    if lora is not None:
        _check_lora(lora, x, weight.shape[0], bool(act or gated_out))
    if bias is not None and bias.dtype != x.dtype:
        raise ValueError("linear_small_m: x and bias must share a dtype")
    _check_weight(x, weight, w_scale, w_block)
    if x.stride(1) != 1:
        x = x.contiguous()
    if not weight.is_contiguous():
        raise ValueError("linear_small_m: weight must be contiguous [N, K]")
    if bias is not None and not bias.is_contiguous():
        bias = bias.contiguous()
    M = x.shape[0]
    N, K = weight.shape
    n_out = N // 2 if gated_out else N
    if out is None:
        out = torch.empty((M, n_out), dtype=x.dtype, device=x.device)
    elif out.shape != (M, n_out) or out.dtype != x.dtype or out.stride(1) != 1:
        raise ValueError("linear_small_m: out must be [M, N] in x's dtype with unit last stride")
    if M == 0 or N == 0:
        return out
    if K == 0:
        product = (bias if bias is not None else weight.new_zeros(N)).expand(M, N)
        return out.copy_(gated_activation(product, gated_out) if gated_out else product)
    for start in range(0, M, MAX_M):
        rows = slice(start, min(M, start + MAX_M))
        m_pad = _m_pad(rows.stop - rows.start)
        cfg = _config(
            m_pad, N, K, x.element_size(), x.device, act is not None, bool(gated_out),
            w_scale is not None,
        )  # fmt: skip
        if w_block and cfg.block_k > w_block[1]:  # a tile lies in one block of scales
            cfg = GemvConfig(cfg[0], cfg[1], w_block[1], *cfg[3:])
        _launch(
            x[rows],
            weight,
            bias,
            out[rows],
            cfg,
            ACTIVATIONS[act] if act else 0,
            ACTIVATIONS[gated_out] if gated_out else 0,
            w_scale,
            w_block,
            up[rows] if up is not None else None,
            lora,  # (one row: the only chunk)
        )
    return out


def _check_lora(
    lora: tuple[torch.Tensor, torch.Tensor, torch.Tensor], x: torch.Tensor, n: int, activated: bool
) -> None:
    """Raises unless ``lora`` is an update the epilogue adds to ``x``'s one row, of ``n``
    columns: ``x`` as the shrink read it (a copy made here would be read before the kernel's
    wait)."""
    shrunk, b, slots = lora
    m = x.shape[0]
    if (
        activated
        or m != 1
        or x.stride(1) != 1
        or shrunk.dim() != 3
        or shrunk.shape[0] != m
        or shrunk.dtype != torch.float32
        or shrunk.stride(2) != 1
        or b.dim() != 3
        or b.shape[1:] != (n, shrunk.shape[2])
        or b.stride(2) != 1
        or slots.shape != (m,)
    ):
        raise ValueError(
            f"linear_small_m: a LoRA update of shrunk {tuple(shrunk.shape)} {shrunk.dtype}, "
            f"B {tuple(b.shape)} and slots {tuple(slots.shape)} does not fit one row of {n} "
            f"columns ({m} rows; or it comes with an activation)"
        )


def _check_weight(
    x: torch.Tensor,
    weight: torch.Tensor,
    w_scale: torch.Tensor | None,
    w_block: tuple[int, int] | None,
) -> None:
    """Raises unless ``weight`` is in ``x``'s dtype, or FP8 with scales of a known layout."""
    if w_scale is None:
        if weight.dtype != x.dtype or w_block is not None:
            raise ValueError("linear_small_m: x and weight must share a dtype (or pass w_scale)")
        return
    n, k = weight.shape
    if w_block is None:
        expected = (n,)
    elif all(b > 0 and b & (b - 1) == 0 for b in w_block):
        expected = (-(-n // w_block[0]), -(-k // w_block[1]))
    else:
        raise ValueError(f"linear_small_m: w_block {w_block} is not two powers of two")
    if (
        weight.dtype != torch.float8_e4m3fn
        or w_scale.dtype != torch.float32
        or tuple(w_scale.shape) != expected
        or not w_scale.is_contiguous()
    ):
        raise ValueError(
            f"linear_small_m: a scaled weight is float8_e4m3fn with contiguous fp32 scales of "
            f"shape {expected}; got {weight.dtype} and {w_scale.dtype} {tuple(w_scale.shape)}"
        )
