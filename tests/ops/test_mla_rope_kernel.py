"""The fused MLA RoPE + latent norm + latent-write kernel against the operator's torch path
(which the DeepSeek parity tests hold to HF): DeepSeek's interleaved pairs and rotate-half
order, the latent strided as the projection leaves it, with and without its norm, tokens
at scattered positions written to shuffled slots of a NaN-filled cache that must stay NaN
elsewhere. Runs under the interpreter on the CPU."""

from __future__ import annotations

import pytest
import torch
import transformers as tf

from heron.kernels.mla_rope import mla_rope_latent_write
from heron.layers.norm import RMSNorm
from heron.layers.rotary import MLARotary, RotaryEmbedding

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0")


@pytest.mark.parametrize("normed", [False, True])
@pytest.mark.parametrize("interleaved", [True, False])
def test_fused_rope_and_write_equal_the_torch_path(interleaved, normed):
    gen = torch.Generator().manual_seed(0)
    tokens, heads, nope, rope, lora, block_size = 5, 3, 16, 8, 32, 4
    config = tf.DeepseekV3Config(qk_rope_head_dim=rope, max_position_embeddings=64)
    rotary = MLARotary(RotaryEmbedding(config, rope, 64), interleaved).to(DEVICE)
    q = torch.randn(tokens, heads, nope + rope, generator=gen).to(DEVICE)
    projected = torch.randn(tokens, lora + rope, generator=gen).to(DEVICE)
    latent, k_rope = projected.split([lora, rope], dim=-1)  # k_rope strided, as in the model
    norm = RMSNorm(lora, 1e-6).to(DEVICE)
    norm.weight.data.normal_(1.0, 0.3, generator=gen.manual_seed(1))
    stored = norm(latent) if normed else latent
    positions = torch.tensor([0, 7, 3, 63, 20], dtype=torch.int32, device=DEVICE)
    slots = torch.tensor([9, 2, 30, 17, 4], dtype=torch.int32, device=DEVICE)
    cache = torch.full((8, block_size, lora + rope), float("nan"), device=DEVICE)

    want_q_rope, want_k = rotary(positions, q[..., nope:], k_rope.view(tokens, 1, rope))
    want = cache.clone().view(-1, lora + rope)
    want[slots.long()] = torch.cat([stored, want_k.view(tokens, rope)], dim=-1)
    got_q = q.clone()
    mla_rope_latent_write(got_q, latent, k_rope, positions, slots, rotary.rotary.cos,
                          rotary.rotary.sin, cache, nope, interleaved,
                          norm.weight if normed else None, norm.eps)  # fmt: skip
    torch.testing.assert_close(got_q[..., :nope], q[..., :nope], rtol=0, atol=0)
    torch.testing.assert_close(got_q[..., nope:], want_q_rope, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(
        cache.view(-1, lora + rope), want, rtol=1e-6, atol=1e-6, equal_nan=True
    )
