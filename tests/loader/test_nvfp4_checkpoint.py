"""compressed-tensors NVFP4 (``nvfp4-pack-quantized``, what llm-compressor's NVFP4 schemes
write) held as FP4 codes with their FP8 scales and global scales: the kernels against the
library's own dequantisation in fp32 (ragged shapes, interpreted; lowered for sm_90), and the
whole model against HF on the library's dequantised weights, on the CPU's path and on the
kernels."""

from __future__ import annotations

import pytest
import torch
import transformers as tf
from triton_lowering import check_lowering
from wna16_checkpoints import SHAPE, count_kernel_rows, nvfp4_tensors, write_checkpoint

from heron import LLM, SamplingParams
from heron.kernels.wna16 import wna16_linear
from heron.layers.linear import Linear
from heron.layers.wna16 import WNA16Scheme

from tiny_models import check_greedy_and_logprobs, greedy_tokens, hf_greedy, hf_on_weights

PROMPTS = [list(range(10, 40)), [5, 6, 7, 8, 9]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def held(tensors, scheme: WNA16Scheme):
    """A checkpoint matrix's tensors in the layer's layout: words, FP8 scales, global [N]."""
    n = tensors["weight_packed"].shape[0]
    global_scale = scheme.convert("global_scale", tensors["weight_global_scale"]).expand(n)
    return (
        scheme.convert("qweight", tensors["weight_packed"]),
        tensors["weight_scale"],
        global_scale.contiguous(),
    )


SCHEME = WNA16Scheme("compressed-tensors", 4, 16, False, scale_dtype=torch.float8_e4m3fn, fp4=True)


@pytest.mark.parametrize("m", [1, 3, 12])  # the GEMV, and the GEMM past 8 rows
@pytest.mark.parametrize("n,k", [(48, 96), (40, 160), (64, 128)])  # K tails, odd tiles
def test_kernels_match_the_librarys_dequantisation(m, n, k):
    g = torch.Generator().manual_seed(n + k)
    tensors, deq, _ = nvfp4_tensors(torch.randn(n, k, generator=g) * 0.1)
    qweight, scales, global_scale = held(tensors, SCHEME)
    x, bias = torch.randn(m, k, generator=g), torch.randn(n, generator=g)
    want = x @ deq.t() + bias
    got = wna16_linear(x, qweight, scales, None, 4, 16, bias, global_scale)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def nvfp4_launches() -> None:
    """Decode and prefill launches of the Qwen3-8B down projection's shape in bf16."""
    n, k = 4096, 12288
    qweight = torch.empty(n, k // 8, dtype=torch.int32)
    scales = torch.empty(n, k // 16, dtype=torch.float8_e4m3fn)
    for m in (1, 64):
        x = torch.empty(m, k, dtype=torch.bfloat16)
        wna16_linear(x, qweight, scales, None, 4, 16, None, torch.empty(n))


def test_kernels_lower_for_sm90():
    assert check_lowering(
        "loader.test_nvfp4_checkpoint:nvfp4_launches",
        "heron.kernels.wna16:_wna16_gemv_kernel",
        "heron.kernels.wna16:_wna16_gemm_kernel",
    )


@pytest.fixture(scope="module")
def nvfp4(tmp_path_factory):
    """A Qwen3 (q, k, v each with its own global scale in one packed layer) in NVFP4, and
    HF's model on the weights the library dequantises."""
    from tiny_models import save_random_model

    root = tmp_path_factory.mktemp("nvfp4")
    src = save_random_model(tf.Qwen3Config(**SHAPE, head_dim=32), root / "dense")
    weights = write_checkpoint(src, root / "q", "nvfp4-pack-quantized")
    return root / "q", hf_on_weights(src, weights)


def test_checkpoint_loads_packed_and_equals_hf(nvfp4, capsys):
    from heron.cli import main

    path, hf = nvfp4
    llm = LLM(str(path), max_model_len=128)
    layers = [m for m in llm.engine.runner.model.modules() if isinstance(m, Linear)]
    assert len(layers) == 2 * 4 and all(m.weight is None and m.wna16.fp4 for m in layers)
    for m in layers:  # 4 bits a weight, an FP8 scale per 16
        assert m.qweight.shape == (m.out_features, m.in_features // 8)
        assert m.scales.dtype == torch.float8_e4m3fn
    check_greedy_and_logprobs(llm, hf, PROMPTS, GREEDY)
    assert main(["plan", "--model", str(path)]) == 0
    assert (
        "compressed-tensors nvfp4 weights (FP4 E2M1, FP8 scales per 16" in capsys.readouterr().out
    )


def test_kernels_through_the_model_equal_hf(nvfp4, monkeypatch):
    calls = count_kernel_rows(monkeypatch)
    path, hf = nvfp4
    llm = LLM(str(path), max_model_len=128, enable_prefix_caching=False)
    prompts, params = (
        [PROMPTS[0][:12]],
        SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True),
    )
    assert greedy_tokens(llm, prompts, params) == hf_greedy(hf, prompts, params.max_tokens)
    rows = [r for r, _ in calls]
    assert max(rows) > 8 and min(rows) == 1  # both kernels ran
    assert (1, "act") in calls  # decode's down projection applied the activation as it loaded
