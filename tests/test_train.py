"""Training helpers: memory measured against the formula, the schedule, clipping across ranks."""

from dataclasses import replace

import pytest
import torch
import torch.distributed as dist

from picotron_like.model import GPT, count_parameters, get_config
from picotron_like.testing import run_ranks
from picotron_like.train import (SavedActivations, build_optimizer, clip_grad_norm_, learning_rate,
                                 measured_memory, predicted_activation_bytes, predicted_memory)


@pytest.mark.parametrize("cfg, batch, seq", [
    (get_config("tiny"), 2, 64),
    (replace(get_config("tiny"), n_layers=3, hidden=96, n_heads=6, n_kv_heads=3, ffn_hidden=256, vocab_size=300), 3, 20),
])
def test_memory_measured_equals_predicted(cfg, batch, seq):
    """Every byte of the four components is accounted for by the formulas (float32, CPU)."""
    model = GPT(cfg)
    optimizer = build_optimizer(model, 1e-3)
    tokens = torch.randint(0, cfg.vocab_size, (batch, seq + 1))
    activations = SavedActivations(model, torch.device("cpu"))
    with activations:
        # Separate tensors for inputs and targets, as the data loader hands them out.
        loss = model(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())
    loss.backward()
    optimizer.step()
    measured = measured_memory(model, optimizer, activations.nbytes)
    predicted = predicted_memory(count_parameters(cfg)["total"], predicted_activation_bytes(cfg, batch, seq))
    assert measured == predicted


def test_learning_rate_schedule():
    lrs = [learning_rate(step, 1.0, warmup_steps=4, total_steps=20) for step in range(24)]
    assert lrs[:4] == [0.25, 0.5, 0.75, 1.0]
    assert lrs[4] == 1.0 and all(a >= b for a, b in zip(lrs[4:], lrs[5:]))
    assert lrs[20] == pytest.approx(0.1) and lrs[23] == pytest.approx(0.1)


def sharded_clipping():
    """A 'model' of one sharded matrix (half per rank) and one replicated vector (on both ranks)."""
    torch.manual_seed(0)
    full_matrix_grad, vector_grad = torch.randn(4, 6), torch.randn(5)
    rank = dist.get_rank()
    shard = torch.nn.Parameter(torch.zeros(2, 6))
    shard.grad = full_matrix_grad[2 * rank: 2 * rank + 2].clone()
    replicated = torch.nn.Parameter(torch.zeros(5))
    replicated.grad = vector_grad.clone()
    norm = clip_grad_norm_([shard, replicated], 1.0, sharded_over=[dist.group.WORLD],
                           counts_toward_norm=lambda p: p is shard or rank == 0)
    return norm, shard.grad, replicated.grad, full_matrix_grad, vector_grad


def test_clipping_uses_the_norm_of_the_whole_model():
    (norm0, shard0, vec0, full_matrix, vector), (norm1, shard1, vec1, _, _) = run_ranks(2, sharded_clipping)
    reference = [torch.nn.Parameter(torch.zeros(4, 6)), torch.nn.Parameter(torch.zeros(5))]
    reference[0].grad, reference[1].grad = full_matrix.clone(), vector.clone()
    expected_norm = torch.nn.utils.clip_grad_norm_(reference, 1.0).item()
    assert norm0 == pytest.approx(expected_norm, rel=1e-6) and norm1 == pytest.approx(expected_norm, rel=1e-6)
    torch.testing.assert_close(torch.cat([shard0, shard1]), reference[0].grad)
    torch.testing.assert_close(vec0, reference[1].grad)
    torch.testing.assert_close(vec1, reference[1].grad)
