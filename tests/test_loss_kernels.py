"""How the chunked loss runs (loss.LossSettings, issue 37 item 1) and SDPA's backend priority
(model.attention_backends, item 3), proven on the CPU.

The loss, one process, float32, torch.testing's float32 tolerances (rtol 1.3e-6, atol 1e-5):
- the fused chunk bodies, uncompiled, against the eager ones, in float32 and bf16: the same
  arithmetic (the target's one subtracted by a comparison of columns instead of a scatter);
- backward by words and by tokens against the textbook loss, chunked several ways;
- the fused bodies through TorchInductor against the eager ones, loss and every gradient, on one
  small shape (forward chunks of 16 tokens, backward blocks of 128 words): each body compiles to
  one kernel; the gradient's writes over the logits in place, so that the compiled backward's
  transient equals the formula's (loss_transient_parts with compile_backend) to the byte;
- lesson 07's compile step sets the LM head's backend (Dynamo's "eager" backend, seconds).
Attention: on a CPU attention_backends changes nothing (the same output bit for bit), and the CUDA
branch, entered on the CPU, sets torch's priority to cuDNN, flash, efficient, math and restores it
(--attention-priority torch leaves torch's).
The device check's scripts (benchmarks/gpu_loss.py, gpu_attention.py) run in their tiny CPU mode.
"""

from __future__ import annotations

import importlib.util
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from picotron_like import loss as loss_module
from picotron_like.lessons import load_lesson
from picotron_like.loss import (IGNORE_INDEX, LossSettings, chunk_logit_gradient, chunk_logit_gradient_fused,
                                chunk_statistics, chunk_statistics_fused, cross_entropy_loss, linear_cross_entropy)
from picotron_like.metrics import predicted_loss_transient_bytes
from picotron_like.model import CUDA_ATTENTION_PRIORITY, GPT, attention_backends, causal_attention, get_config

SEED = 5


def problem(tokens: int, words: int, hidden: int = 16):
    """Inputs [tokens, hidden] and a weight [words, hidden] that need gradients, and targets with
    every fifth one ignored."""
    generator = torch.Generator().manual_seed(SEED)
    inputs = torch.randn(tokens, hidden, generator=generator).requires_grad_()
    weight = torch.randn(words, hidden, generator=generator).requires_grad_()
    targets = torch.randint(words, (tokens,), generator=generator)
    targets[::5] = IGNORE_INDEX
    return inputs, weight, targets


def loss_and_gradients(inputs, weight, targets, settings: LossSettings, textbook: bool = False):
    inputs.grad = weight.grad = None
    loss = (cross_entropy_loss(inputs @ weight.t(), targets, "sum") if textbook else
            linear_cross_entropy(inputs, weight, targets, "sum", settings))
    loss.backward()
    return loss.detach(), inputs.grad, weight.grad


@pytest.fixture
def chunk_bytes():
    """LOSS_CHUNK_BYTES for the test to set, restored after it."""
    kept = loss_module.LOSS_CHUNK_BYTES
    yield
    loss_module.LOSS_CHUNK_BYTES = kept


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
def test_fused_bodies_do_the_eager_ones_arithmetic(dtype):
    generator = torch.Generator().manual_seed(SEED)
    logits = (4 * torch.randn(12, 40, generator=generator)).to(dtype)
    cols = torch.randint(40, (12,), generator=generator)
    has_target = torch.rand(12, generator=generator) < 0.7
    for eager, fused in zip(chunk_statistics(logits.clone(), cols, has_target),
                            chunk_statistics_fused(logits.clone(), cols, has_target), strict=True):
        torch.testing.assert_close(fused, eager)
    log_sum_exp = torch.logsumexp(logits.float(), dim=-1)
    minus_one, scale = torch.where(has_target, -1.0, 0.0), torch.rand(12, 1, generator=generator)
    torch.testing.assert_close(chunk_logit_gradient_fused(logits.clone(), log_sum_exp, cols, minus_one, scale),
                               chunk_logit_gradient(logits.clone(), log_sum_exp, cols, minus_one, scale))


def test_settings_choose_the_backward_and_refuse_a_bad_one():
    assert LossSettings().by_words(8192, 128256) and not LossSettings().by_words(8192, 4096)
    assert LossSettings(backward="tokens").by_words(8, 128256) is False
    assert LossSettings(backward="words").by_words(8192, 16)
    with pytest.raises(ValueError, match="backward must be"):
        LossSettings(backward="vocabulary")


def test_backward_by_words_and_by_tokens_equal_the_textbook_loss(chunk_bytes):
    """Blocks of 7 tokens' worth of logits (a short last one), and one chunk."""
    tokens, words = 64, 200
    inputs, weight, targets = problem(tokens, words)
    expected = loss_and_gradients(inputs, weight, targets, LossSettings(), textbook=True)
    for chunk in (7, tokens):
        loss_module.LOSS_CHUNK_BYTES = 4 * words * chunk
        for backward in ("words", "tokens"):
            got = loss_and_gradients(inputs, weight, targets, LossSettings(backward=backward))
            for name, value, reference in zip(("loss", "dx", "dW"), got, expected, strict=True):
                torch.testing.assert_close(value, reference, msg=lambda m: f"{backward} {chunk}: {name}: {m}")


def test_compiled_bodies_equal_eager_ones_and_hold_the_formula_bytes(chunk_bytes):
    import torch._inductor.config
    torch._inductor.config.compile_threads = 1      # one small graph each: a pool of workers costs more
    tokens, words, hidden = 64, 512, 16
    loss_module.LOSS_CHUNK_BYTES = 4 * words * 16   # forward: 4 chunks of 16 tokens; backward: 4 blocks of 128 words
    inputs, weight, targets = problem(tokens, words, hidden)
    eager = loss_and_gradients(inputs, weight, targets, LossSettings())
    settings = LossSettings(compile_backend="inductor")
    compiled = loss_and_gradients(inputs, weight, targets, settings)
    for name, value, reference in zip(("loss", "dx", "dW"), compiled, eager, strict=True):
        torch.testing.assert_close(value, reference, msg=lambda m: f"{name}: {m}")
    from tests.test_loss_memory import allocator_peak     # the allocator's record, as there
    loss = linear_cross_entropy(inputs, weight, targets, "sum", settings)
    assert allocator_peak(loss.backward) == predicted_loss_transient_bytes(tokens, hidden, words, settings=settings)


def test_the_compile_step_compiles_the_loss_bodies_with_the_blocks_backend():
    full_5d = load_lesson("07_full_5d")
    cfg = replace(get_config("tiny"), n_layers=1)
    tokens = torch.randint(cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(SEED))
    results = []
    for compiled in (False, True):
        model = full_5d.compile_blocks(GPT(cfg, seed=SEED), compiled, backend="eager")
        assert model.lm_head.loss_settings.compile_backend == ("eager" if compiled else None)
        loss = model(tokens, tokens)
        loss.backward()
        results.append((loss.detach(), model.lm_head.weight.grad))
    torch.testing.assert_close(results[1], results[0])


def test_attention_priority_is_cudas_alone():
    generator = torch.Generator().manual_seed(SEED)
    q, k, v = (torch.randn(2, heads, 8, 16, generator=generator) for heads in (4, 2, 2))
    plain = causal_attention(q, k, v)
    before = torch._C._get_sdp_priority_order()
    with attention_backends("cpu"):
        assert torch._C._get_sdp_priority_order() == before
    with attention_backends("cuda", "torch"):                      # --attention-priority torch
        assert torch._C._get_sdp_priority_order() == before
    with pytest.raises(ValueError, match="attention priority must be one of"):
        attention_backends("cuda", "flash")
        assert torch.equal(causal_attention(q, k, v), plain)
    with attention_backends("cuda"):
        order = torch._C._get_sdp_priority_order()
        assert order[:len(CUDA_ATTENTION_PRIORITY)] == [int(backend) for backend in CUDA_ATTENTION_PRIORITY]
        assert torch.equal(causal_attention(q, k, v), plain)      # a CPU tensor keeps the CPU's kernel
    assert torch._C._get_sdp_priority_order() == before
    with attention_backends("cuda", "torch"):                      # --attention-priority torch
        assert torch._C._get_sdp_priority_order() == before
    with pytest.raises(ValueError, match="attention priority must be one of"):
        attention_backends("cuda", "flash")


def run_script(name: str, capsys) -> list[str]:
    """benchmarks/<name>.py's main in --tiny mode (what a CPU without a GPU runs): its lines."""
    spec = importlib.util.spec_from_file_location(name, Path(__file__).resolve().parent.parent / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.main(["--tiny"])
    return capsys.readouterr().out.splitlines()


def test_the_gpu_loss_script_runs_tiny_one_line_per_row(capsys):
    header, *rows = run_script("gpu_loss", capsys)
    assert header.startswith("loss: T=128 V=1024 h=32 float32 on cpu (tiny)")
    assert [row.split("  ")[1].strip() for row in rows] == [
        "full logits (F.cross_entropy)", "chunked, before issue 37 (eager, by tokens, 256 MiB)", "chunked eager",
        "chunked compiled"]
    losses = {row.rsplit("loss ", 1)[1] for row in rows}
    assert len(losses) == 1 and all(" ms  peak n/a on a CPU" in row for row in rows), rows


def test_the_gpu_attention_script_runs_tiny_one_line_per_backend(capsys):
    header, *rows = run_script("gpu_attention", capsys)
    assert header.startswith("attention: batch 1 x seq 64, 4 heads over 2 K/V heads of 16, causal, float32 on cpu")
    assert [row.split()[0] for row in rows] == [backend.name for backend in CUDA_ATTENTION_PRIORITY] + ["priority"] * 2
    assert "not available" in rows[0] and rows[1].endswith(" ms")
    assert all(row.endswith("(no priority on a CPU)") for row in rows[-2:])
