"""linear_small_m against torch's F.linear: tiny shapes everywhere (the Triton interpreter on the
CPU), the bf16 decode shapes of a Qwen3-0.6B-class model and CUDA-graph replay on a GPU."""

from __future__ import annotations

import itertools
from functools import partial

import pytest
import torch
import torch.nn.functional as F
from triton_lowering import check_lowering

from heron.kernels import gemv as triton_gemv
from heron.kernels.gemv import ACTIVATIONS, MAX_M, GemvConfig, _launch, linear_small_m
from heron.layers.activation import GeluTanhAndMul, SigmoidAndMul, SiluAndMul

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# Every device's measured configurations, and the H200's (which the rule's shapes are held to).
TUNED = {key: cfg for table in triton_gemv.read_tuned().values() for key, cfg in table.items()}
H200 = triton_gemv.read_tuned()["NVIDIA H200"]
TOL = {torch.float32: 1e-5, torch.float16: 1e-2}

# Forced configs that reach every branch at tiny sizes: split-K with the last-program reduction,
# K tails inside a split, column tails, and the tl.dot path.
FORCED = [
    GemvConfig(False, 16, 128, 4, 1, 2),
    GemvConfig(False, 32, 64, 4, 1, 3),
    GemvConfig(True, 16, 64, 4, 1, 2),
    GemvConfig(True, 64, 128, 4, 2, 1),
]


def _rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y.float() - ref).abs().max() / ref.abs().max().clamp_min(1e-6)).item()


def _inputs(m, n, k, dtype, strided, bias, device=DEVICE):
    g = torch.Generator().manual_seed(m * 1000 + n * 10 + k)
    x = torch.randn(m, 2 * k if strided else k, generator=g).to(dtype).to(device)
    x = x[:, 1 : k + 1] if strided else x
    w = torch.randn(n, k, generator=g).to(dtype).to(device)
    b = torch.randn(n, generator=g).to(dtype).to(device) if bias else None
    return x, w, b


def _reference(x, w, b):
    return F.linear(x.float(), w.float(), None if b is None else b.float())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("m", [1, 3, 8])
@pytest.mark.parametrize("n", [64, 96])
@pytest.mark.parametrize("k", [128, 320])
def test_matches_f_linear(dtype, m, n, k):
    for bias, strided in [(False, False), (True, True)]:
        x, w, b = _inputs(m, n, k, dtype, strided, bias)
        assert x.stride(1) == 1 and (not strided or x.stride(0) == 2 * k)
        y = linear_small_m(x, w, b)
        assert y.shape == (m, n) and y.dtype == dtype
        assert _rel_err(y, _reference(x, w, b)) < TOL[dtype]


@pytest.mark.parametrize("cfg", FORCED, ids=lambda c: "-".join(map(str, c)))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_forced_configs(cfg, dtype):
    for m, n, k in [(1, 96, 320), (3, 64, 128), (8, 96, 320)]:
        x, w, b = _inputs(m, n, k, dtype, strided=True, bias=True)
        out = torch.full((m, n), float("nan"), dtype=dtype, device=DEVICE)
        _launch(x, w, b, out, cfg)
        assert _rel_err(out, _reference(x, w, b)) < TOL[dtype]
        # Tickets are handed back: a second split call gives the same result.
        again = torch.empty_like(out)
        _launch(x, w, b, again, cfg)
        assert torch.equal(out, again)


def _lora_update(n: int, dtype: torch.dtype, slot: int, rank: int = 12, splits: int = 3):
    """A LoRA update of one row as the epilogue takes it: fp32 partial sums ``[1, splits,
    rank]``, ``B`` tables of four slots (slot 0 zero), the row's slot; and the update."""
    g = torch.Generator().manual_seed(n + slot)
    shrunk = torch.randn(1, splits, rank, generator=g).to(DEVICE)
    b = torch.randn(4, n, rank, generator=g).to(dtype).to(DEVICE)
    b[0] = 0
    slots = torch.tensor([slot], dtype=torch.int32, device=DEVICE)
    return (shrunk, b, slots), shrunk[0].sum(0) @ b[slot].float().T


@pytest.mark.parametrize("cfg", FORCED, ids=lambda c: "-".join(map(str, c)))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_lora_update_in_the_epilogue(cfg, dtype):
    """The row's LoRA update (its slot's B; slot 0, nothing) added where the product is stored:
    in one program's epilogue, or after the split-K reduction; more rows, or an input the
    kernel would copy, are refused."""
    for m, n, k, slot in [(1, 96, 320, 2), (1, 64, 128, 0), (1, 96, 320, 1)]:
        x, w, b = _inputs(m, n, k, dtype, strided=True, bias=True)
        lora, update = _lora_update(n, dtype, slot)
        out = torch.full((m, n), float("nan"), dtype=dtype, device=DEVICE)
        _launch(x, w, b, out, cfg, lora=lora)
        assert _rel_err(out, _reference(x, w, b) + update) < TOL[dtype]
    got = linear_small_m(x, w, b, lora=lora)  # (the public entry point: the rule's config)
    assert _rel_err(got, _reference(x, w, b) + update) < TOL[dtype]
    with pytest.raises(ValueError, match="LoRA update"):
        linear_small_m(x.expand(2, -1), w, lora=lora)
    with pytest.raises(ValueError, match="LoRA update"):  # (a copy would be read before the wait)
        linear_small_m(torch.cat([x, x], 1)[:, ::2], w, lora=lora)


def test_every_measured_config_computes_the_product():
    """Each measured configuration, at its row count less one (a masked row), on columns and a
    K that end in partial tiles, plain and with a gated input, against F.linear (fp32 in the
    interpreter, where ``tl.dot`` is exact)."""
    for cfg, m_pad in sorted({(cfg, m) for (m, _, _), cfg in TUNED.items()}):
        m, n = max(1, m_pad - 1), cfg.block_n + 3
        k = cfg.block_k * cfg.split_k + 5
        for act in (None, "silu"):
            x, w, _ = _inputs(m, n, 2 * k if act else k, torch.float32, strided=False, bias=False)
            w = w[:, :k].contiguous()
            out = torch.full((m, n), float("nan"), device=DEVICE)
            _launch(x, w, None, out, cfg, ACTIVATIONS[act] if act else 0)
            ref = _gated_reference(x, w, None, act) if act else _reference(x, w, None)
            assert _rel_err(out, ref) < 1e-5, (cfg, m_pad, act)


def test_gated_rule_matches_the_measured_down_projections():
    """For a gated input the rule's programs have the shape of the winners measured on an
    H200 (132 SMs) for Qwen3-0.6B, Gemma-3-1B and Llama-3-8B down projections: the same kind
    of program, column width and K split at every row count (tile depth and stages may
    differ), so models without measured entries start from the same shape."""
    from heron.kernels.gemv import _default_config

    shapes = [(1024, 3072), (1152, 6912), (4096, 14336)]
    for (n, k), m in itertools.product(shapes, (2, 4, 8, 16)):
        rule, measured = _default_config(m, n, k, 2, 132, gated=True), H200[(m, n, k)]
        assert (rule.use_dot, rule.block_n, rule.split_k) == (
            measured.use_dot,
            measured.block_n,
            measured.split_k,
        ), (m, n, k)
    for n, k in [(1024, 3072), (4096, 14336)]:  # one row: Gemma's measured split is its own
        assert _default_config(1, n, k, 2, 132, gated=True) == H200[(1, n, k)]


@pytest.mark.parametrize("m_pad", [16, 32, 64])
@pytest.mark.parametrize("k,n", [(1024, 4096), (2048, 1024), (1024, 151936)])
def test_pipeline_fits_in_shared_memory(m_pad, k, n):
    """The x tiles (two for a gated input) and weight tile, times the stages, stay within the
    pipeline budget (the rule's 64 rows of Qwen3's qkv once asked for 256 KiB and failed to
    launch); up to 16 rows the rule's configurations keep their depth."""
    from heron.kernels.gemv import _PIPELINE_BYTES, _default_config, _fit_pipeline

    for gated in (False, True):
        rule = _default_config(m_pad, n, k, 2, 132, gated)
        cfg = _fit_pipeline(rule, m_pad, 2, gated)
        assert cfg[:4] == rule[:4] and cfg.split_k == rule.split_k
        assert cfg.num_stages == rule.num_stages or m_pad > 16
        x_rows = (2 if gated else 1) * m_pad
        assert cfg.num_stages * (x_rows + cfg.block_n) * cfg.block_k * 2 <= _PIPELINE_BYTES


def test_serves_the_rule_s_rows_and_measured_shapes_beyond(monkeypatch):
    """Up to RULE_MAX_M rows every shape takes the kernel; up to MAX_M only shapes with a
    measured entry (for the device) for their padded row count; past MAX_M none."""
    rule, cpu = triton_gemv.RULE_MAX_M, torch.device("cpu")
    monkeypatch.setitem(triton_gemv._TUNED, (cpu, False), {(2 * rule, 96, 320): FORCED[0]})
    serves = lambda m, n, k: triton_gemv.serves(m, n, k, cpu)
    assert serves(1, 64, 128) and serves(rule, 64, 128)
    assert not serves(rule + 1, 64, 128)
    assert serves(rule + 1, 96, 320) and serves(2 * rule, 96, 320)
    assert not serves(2 * rule + 1, 96, 320)  # pads to another row count
    assert not serves(MAX_M + 1, 96, 320)


def test_fp8_weights_take_their_own_entries_else_the_16_bit_ones(monkeypatch):
    rule, cpu = triton_gemv.RULE_MAX_M, torch.device("cpu")
    m_pad = 2 * rule
    plain = {(m_pad, 96, 320): FORCED[0], (m_pad, 64, 128): FORCED[1]}
    monkeypatch.setitem(triton_gemv._TUNED, (cpu, False), plain)
    monkeypatch.setitem(triton_gemv._TUNED, (cpu, True), {(m_pad, 96, 320): FORCED[2]})
    monkeypatch.setattr(triton_gemv, "_CONFIG_CACHE", {})
    fitted = lambda cfg: triton_gemv._fit_pipeline(cfg, m_pad, 2, False)
    config = lambda n, k, fp8: triton_gemv._config(m_pad, n, k, 2, cpu, fp8=fp8)
    assert config(96, 320, True) == fitted(FORCED[2])
    assert config(96, 320, False) == fitted(FORCED[0])
    assert config(64, 128, True) == fitted(FORCED[1])
    assert triton_gemv.serves(m_pad, 64, 128, cpu, fp8=True)
    assert not triton_gemv.serves(m_pad, 32, 128, cpu, fp8=True)


def test_the_tuned_table_is_keyed_by_device_and_round_trips(tmp_path):
    """The data file names each device's entries; the CPU (the interpreter) has none, so it
    takes the rule; writing what was read gives the same table."""
    assert triton_gemv._tuned(torch.device("cpu")) == {}
    assert all(isinstance(cfg, GemvConfig) for cfg in H200.values())
    copy = tmp_path / "gemv.json"
    triton_gemv.write_tuned(triton_gemv.read_tuned(), copy)
    assert triton_gemv.read_tuned(copy) == triton_gemv.read_tuned()


def test_out_argument_and_large_m():
    m = MAX_M + 3
    x, w, b = _inputs(m, 64, 128, torch.float32, strided=False, bias=True)
    buf = torch.zeros(m, 2 * 64, device=DEVICE)
    out = buf[:, :64]
    y = linear_small_m(x, w, b, out=out)
    assert y.data_ptr() == out.data_ptr()
    assert _rel_err(out, _reference(x, w, b)) < 1e-5
    assert torch.all(buf[:, 64:] == 0)


def _gated_reference(gate_up, w, b, act):
    """Unfused, as PyTorch rounds it: the activation, then its product with up, each rounded to
    the input dtype; then the matrix product."""
    gate, up = gate_up.float().chunk(2, dim=-1)
    return _reference((_activation(gate, act, gate_up.dtype) * up).to(gate_up.dtype), w, b)


def _activation(gate, act, dtype):
    """``act(gate)`` in fp32, rounded to ``dtype`` as PyTorch's activation in ``dtype`` is."""
    functions = {"silu": F.silu, "gelu_tanh": partial(F.gelu, approximate="tanh")}
    return functions.get(act, torch.sigmoid)(gate).to(dtype).float()


@pytest.mark.parametrize("act", list(ACTIVATIONS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_fused_gated_activation(act, dtype):
    """(act(gate) * up) @ W.T with the activation applied while loading the input, through the
    plain and the split-K (forced) configurations, with up beside the gate or apart (strided);
    the activation modules name their kernel."""
    modules = (SiluAndMul, GeluTanhAndMul, SigmoidAndMul)
    assert {m.fused_name for m in modules} == set(ACTIVATIONS)
    for m, n, k in [(1, 64, 128), (3, 96, 320)]:
        gate_up, w, b = _inputs(m, n, 2 * k, dtype, strided=False, bias=True)
        w = w[:, :k].contiguous()
        ref = _gated_reference(gate_up, w, b, act)
        assert _rel_err(linear_small_m(gate_up, w, b, act=act), ref) < TOL[dtype]
        for cfg in (FORCED[0], FORCED[2]):
            out = torch.empty(m, n, dtype=dtype, device=DEVICE)
            _launch(gate_up, w, b, out, cfg, ACTIVATIONS[act])
            assert _rel_err(out, ref) < TOL[dtype]
        gate, up = gate_up[:, :k], gate_up[:, k:]  # rows strided, as views of one tensor
        assert _rel_err(linear_small_m(gate, w, b, act=act, up=up), ref) < TOL[dtype]
    with pytest.raises(ValueError, match="gate's shape"):
        linear_small_m(gate, w, b, act=act, up=up[:, 1:])
    with pytest.raises(ValueError, match="shapes"):
        linear_small_m(gate_up[:, :k], w, b, act=act)  # the input must hold gate and up


def _gated_out_reference(x, w, b, act):
    """Unfused, as PyTorch rounds it: the gate_up product rounded to the input dtype, then
    the activation (rounded) times up."""
    gate, up = _reference(x, w, b).to(x.dtype).float().chunk(2, dim=-1)
    return _activation(gate, act, x.dtype) * up


@pytest.mark.parametrize("act", list(ACTIVATIONS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_gated_activation_in_the_epilogue(act, dtype):
    """act(x @ gate.T) * (x @ up.T) from a [gate; up] weight, with the activation in the
    epilogue, through the rule's configurations and forced ones (unsplit: the epilogue needs
    all of K)."""
    for m, n, k in [(1, 64, 128), (3, 96, 320), (17, 64, 128)]:
        x, w, b = _inputs(m, 2 * n, k, dtype, strided=True, bias=True)
        ref = _gated_out_reference(x, w, b, act)
        assert _rel_err(linear_small_m(x, w, b, gated_out=act), ref) < TOL[dtype]
        for cfg in (GemvConfig(*FORCED[1][:5], 1), FORCED[3]):
            out = torch.empty(m, n, dtype=dtype, device=DEVICE)
            _launch(x, w, b, out, cfg, gated_out=ACTIVATIONS[act])
            assert _rel_err(out, ref) < TOL[dtype]
    with pytest.raises(ValueError, match="shapes"):
        linear_small_m(x, w[1:].contiguous(), gated_out=act)  # gate and up: an even count


# bf16 decode shapes of a Qwen3-0.6B-class model: qkv, o, gate_up, down, lm_head.
SHAPES = [(1024, 4096), (2048, 1024), (1024, 6144), (3072, 1024), (1024, 151936)]


@pytest.mark.gpu
@pytest.mark.parametrize("k,n", SHAPES)
def test_gpu_bf16_real_shapes(k, n):
    for m in sorted({1, 2, 4, 8, 16, 32, MAX_M}):
        for bias in (False, True):
            x, w, b = _inputs(m, n, k, torch.bfloat16, strided=True, bias=bias, device="cuda")
            y = linear_small_m(x, w, b)
            assert _rel_err(y, _reference(x, w, b)) < 1e-2, (m, bias)


@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k", sorted(TUNED), ids=lambda v: str(v))
def test_gpu_bf16_every_measured_entry(m, n, k):
    """Each measured configuration computes its product, at its padded row count and one
    row fewer (masked rows)."""
    for rows in sorted({max(1, m - 1), m}):
        x, w, _ = _inputs(rows, n, k, torch.bfloat16, strided=False, bias=False, device="cuda")
        assert _rel_err(linear_small_m(x, w), _reference(x, w, None)) < 1e-2, rows


@pytest.mark.gpu
@pytest.mark.parametrize("act", list(ACTIVATIONS))
@pytest.mark.parametrize("k,n", [(3072, 1024), (6912, 1152)])  # Qwen3-0.6B, Gemma-3-1B down
def test_gpu_bf16_fused_down_projection(act, k, n):
    for m in (1, 4, MAX_M):
        gate_up, w, _ = _inputs(m, n, 2 * k, torch.bfloat16, False, False, device="cuda")
        w = w[:, :k].contiguous()
        got = linear_small_m(gate_up, w, act=act)
        assert _rel_err(got, _gated_reference(gate_up, w, None, act)) < 1e-2, m


@pytest.mark.gpu
@pytest.mark.parametrize("act", list(ACTIVATIONS))
@pytest.mark.parametrize("k,n", [(1024, 6144), (1152, 13824)])  # Qwen3-0.6B, Gemma-3-1B gate_up
def test_gpu_bf16_gated_gate_up_projection(act, k, n):
    for m in (1, 16, 33, MAX_M):
        x, w, _ = _inputs(m, n, k, torch.bfloat16, False, False, device="cuda")
        got = linear_small_m(x, w, gated_out=act)
        assert _rel_err(got, _gated_out_reference(x, w, None, act)) < 1e-2, m


@pytest.mark.gpu
@pytest.mark.parametrize("k,n", [(1024, 4096), (2048, 1024), (3072, 1024)])
def test_gpu_cuda_graph_replay(k, n):
    for m in sorted({1, 4, 16, MAX_M}):
        x, w, b = _inputs(m, n, k, torch.bfloat16, strided=False, bias=False, device="cuda")
        static_x = x.clone()
        out = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
        linear_small_m(static_x, w, out=out)  # eager warm-up compiles and allocates
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            linear_small_m(static_x, w, out=out)
        for _ in range(3):
            static_x.copy_(torch.randn_like(static_x))
            graph.replay()
            torch.cuda.synchronize()
            eager = linear_small_m(static_x, w)
            assert torch.equal(out, eager)
            assert _rel_err(out, _reference(static_x, w, None)) < 1e-2


def gemv_launches() -> None:
    """Every measured configuration, with and without a gated input or output (one row: with a
    LoRA update), and the rule's gated configurations for some shapes without entries (for
    the lowering test)."""
    from heron.kernels import gemv as g

    g._TUNED[torch.device("cpu")] = TUNED  # the recorded launches are CPU tensors
    for m, n, k in TUNED:
        for act in (None, "gelu_tanh"):
            x = torch.empty(m, 2 * k if act else k, dtype=torch.bfloat16)
            g.linear_small_m(x, torch.empty(n, k, dtype=torch.bfloat16), act=act)
        if n % 2 == 0:  # as a [gate; up] weight, the activation in the epilogue
            x = torch.empty(m, k, dtype=torch.bfloat16)
            g.linear_small_m(x, torch.empty(n, k, dtype=torch.bfloat16), gated_out="silu")
        if m == 1:  # with a LoRA update in the epilogue
            x = torch.empty(m, k, dtype=torch.bfloat16)
            lora = (
                torch.empty(m, 8, 48),
                torch.empty(9, n, 48, dtype=torch.bfloat16),
                torch.empty(m, dtype=torch.int32),
            )
            g.linear_small_m(x, torch.empty(n, k, dtype=torch.bfloat16), lora=lora)
    # The rule's gated configurations for shapes without measured entries (Qwen2.5-7B's down,
    # a mid-size and a tiny one), through the public entry point.
    for (n, k), m in itertools.product([(3584, 18944), (2048, 8192), (64, 320)], (1, 3, 16)):
        x = torch.empty(m, 2 * k, dtype=torch.bfloat16)
        g.linear_small_m(x, torch.empty(n, k, dtype=torch.bfloat16), act="silu")


def test_every_measured_configuration_lowers_for_hopper():
    """Triton's compiler accepts every launch variant of the measured configurations (which
    the interpreter alone would not prove)."""
    assert check_lowering(
        "layers.test_triton_gemv:gemv_launches", "heron.kernels.gemv:_gemv_kernel"
    )
