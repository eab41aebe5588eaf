"""The reference GPT: shapes, attention semantics, determinism, and the parameter/FLOP formulas."""

import math
from dataclasses import replace

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from picotron_like.model import (GPT, PRESETS, GPTConfig, count_parameters, flops_per_token, get_config,
                                 reference_init)

TINY = replace(get_config("tiny"), n_layers=2)


def explicit_attention(q, k, v):
    """Causal attention written out: query head i reads K/V head i // (heads / kv_heads)."""
    group = q.shape[1] // k.shape[1]
    seq = q.shape[2]
    out = torch.empty_like(q)
    mask = torch.ones(seq, seq, dtype=torch.bool).tril()
    for head in range(q.shape[1]):
        scores = q[:, head] @ k[:, head // group].transpose(-1, -2) / math.sqrt(q.shape[-1])
        out[:, head] = scores.masked_fill(~mask, float("-inf")).softmax(-1) @ v[:, head // group]
    return out


def test_shapes_and_loss():
    model = GPT(TINY, seed=0)
    tokens = torch.randint(0, TINY.vocab_size, (3, 16))
    assert model(tokens).shape == (3, 16, TINY.vocab_size)
    loss = model(tokens, tokens)
    assert loss.shape == () and math.isfinite(loss.item())
    # An untrained model is close to uniform over the vocabulary.
    assert abs(loss.item() - math.log(TINY.vocab_size)) < 0.1


def test_grouped_query_attention_matches_explicit_formula():
    assert TINY.n_kv_heads < TINY.n_heads
    model = GPT(TINY, seed=1)
    tokens = torch.randint(0, TINY.vocab_size, (2, 12))
    expected = model(tokens)
    for layer in model.layers:
        layer.attn.attention_core = explicit_attention
    torch.testing.assert_close(model(tokens), expected, rtol=1e-5, atol=1e-5)
    assert model.layers[0].attn.k_proj.weight.shape == (TINY.n_kv_heads * TINY.head_dim, TINY.hidden)


def test_causal_future_tokens_do_not_change_the_past():
    model = GPT(TINY, seed=2)
    tokens = torch.randint(0, TINY.vocab_size, (1, 10))
    changed = tokens.clone()
    changed[0, 6:] = (changed[0, 6:] + 1) % TINY.vocab_size
    torch.testing.assert_close(model(tokens)[:, :6], model(changed)[:, :6])
    assert not torch.allclose(model(tokens)[:, 6:], model(changed)[:, 6:])


def test_positions_are_explicit_rotations():
    """Shifting every position by the same offset leaves attention unchanged (RoPE is relative)."""
    model = GPT(TINY, seed=3)
    tokens = torch.randint(0, TINY.vocab_size, (1, 8))
    shifted = model(tokens, positions=torch.arange(8) + 100)
    torch.testing.assert_close(model(tokens), shifted, rtol=1e-4, atol=1e-4)


def test_initialisation_is_a_function_of_seed_and_name():
    a, b, c = GPT(TINY, seed=5), GPT(TINY, seed=5), GPT(TINY, seed=6)
    for (name, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(pa, pb), name
        assert torch.equal(pa, reference_init(name, pa.shape, TINY, seed=5)), name
        if not name.endswith("norm.weight"):
            assert not torch.equal(pa, pc), name
    q0, q1 = a.layers[0].attn.q_proj.weight, a.layers[1].attn.q_proj.weight
    assert not torch.equal(q0, q1)
    # Residual-stream projections start smaller, so the residual does not grow with depth.
    assert a.layers[0].attn.o_proj.weight.std() < 0.7 * q0.std()


@pytest.mark.parametrize("cfg", [TINY, get_config("tiny-moe"), replace(TINY, n_kv_heads=4, vocab_size=300)])
def test_parameter_count_formula(cfg):
    model = GPT(cfg)
    assert count_parameters(cfg)["total"] == sum(p.numel() for p in model.parameters())
    assert count_parameters(cfg)["embedding"] == model.tok_embeddings.weight.numel()


def test_parameter_count_of_real_shapes():
    # The 8b preset has the shape of Llama 3 8B, published as 8.03e9 parameters.
    assert count_parameters(PRESETS["8b"])["total"] == pytest.approx(8.03e9, rel=0.002)
    assert count_parameters(PRESETS["1b"])["total"] == pytest.approx(1.50e9, rel=0.01)  # untied head


@pytest.mark.parametrize("cfg", [TINY, get_config("tiny-moe")])
def test_flops_formula_equals_counted_flops(cfg):
    """6N + 12 L s h per token equals the matmul FLOPs torch counts in forward + backward.

    The attention core is swapped for the explicit formula because FlopCounterMode does not count
    the fused CPU attention kernel; the explicit one is plain matmuls.
    """
    model = GPT(cfg, seed=0)
    for layer in model.layers:
        layer.attn.attention_core = explicit_attention
    batch, seq = 2, 32
    tokens = torch.randint(0, cfg.vocab_size, (batch, seq))
    with FlopCounterMode(display=False) as counter:
        model(tokens, tokens).backward()
    assert counter.get_total_flops() == flops_per_token(cfg, seq) * batch * seq


def test_mixture_of_experts_routes_each_token_to_k_experts():
    cfg = get_config("tiny-moe")
    moe = GPT(cfg, seed=0).layers[0].mlp
    tokens = torch.randn(5, cfg.hidden)
    weights, expert_ids = moe.route(tokens)
    assert expert_ids.shape == (5, cfg.experts_per_token)
    torch.testing.assert_close(weights.sum(-1), torch.ones(5))
    expected = torch.stack([
        sum(w * moe.experts[e](tokens[i]) for w, e in zip(weights[i], expert_ids[i].tolist()))
        for i in range(5)])
    out = moe(tokens[None])[0]
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
    out.sum().backward()
    assert all(p.grad is not None for p in moe.parameters())  # unused experts get zeros, not None


def test_bad_config_is_one_clear_error():
    with pytest.raises(ValueError, match="n_heads=4 is not divisible by n_kv_heads=3"):
        GPTConfig(n_kv_heads=3)
    with pytest.raises(ValueError, match="unknown model preset 'huge'"):
        get_config("huge")
