"""The shared skeleton: memory measured against the formula, the schedule, clipping across ranks,
and every flag checked before a process group exists."""

import argparse
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist

from picotron_like import train
from picotron_like.metrics import ActivationMeter, measured_memory, predicted_activation_bytes, predicted_memory
from picotron_like.model import GPT, count_parameters, get_config
from picotron_like.testing import run_ranks
from picotron_like.topology import validate_parallel_config
from picotron_like.train import build_optimizer, clip_grad_norm_, learning_rate

SMALL = replace(get_config("tiny"), n_layers=3, hidden=96, n_heads=6, n_kv_heads=3, ffn_hidden=256, vocab_size=300)


def token_batch(cfg, batch, seq, seed=0):
    """Separate tensors for inputs and targets, as the data loader hands them out."""
    tokens = torch.randint(0, cfg.vocab_size, (batch, seq + 1), generator=torch.Generator().manual_seed(seed))
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


@pytest.mark.parametrize("cfg, batch, seq", [(get_config("tiny"), 2, 64), (SMALL, 3, 20)])
def test_memory_measured_equals_predicted(cfg, batch, seq):
    """Every byte of the four components is accounted for by the formulas (float32, CPU)."""
    model = GPT(cfg)
    optimizer = build_optimizer(model, 1e-3)
    with ActivationMeter(model) as activations:
        loss = model(*token_batch(cfg, batch, seq))
    loss.backward()
    optimizer.step()
    measured = measured_memory(model, optimizer, activations.peak_bytes)
    predicted = predicted_memory(count_parameters(cfg)["total"], predicted_activation_bytes(cfg, batch, seq))
    assert measured == predicted


def test_activation_meter_under_gradient_accumulation():
    """Accumulating micro-batches keeps one micro-batch's activations alive at a time: the peak is
    one micro-batch's, whatever their number, and nothing stays alive after the last backward."""
    batch, seq, n_micro = 2, 24, 3
    model = GPT(SMALL)
    with ActivationMeter(model) as activations:
        for micro in range(n_micro):
            inputs, targets = token_batch(SMALL, batch, seq, seed=micro)
            (model(inputs, targets, reduction="sum") / (n_micro * targets.numel())).backward()
            assert activations.live_bytes == 0, micro
    assert activations.peak_bytes == predicted_activation_bytes(SMALL, batch, seq)
    assert activations.live_bytes == 0


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


# ----------------------------------------------------------------------------- flags and the run plan


class Stopped(Exception):
    """What plan_run's exit_with_error raises here instead of ending the test process."""


def parse(flags: str):
    """The flags of a lesson composing dp and tp (dp fills the world), as a user types them."""
    parser = argparse.ArgumentParser()
    train.add_parallel_flags(parser, axes=("dp", "tp"), fill_axis="dp")
    train.add_training_flags(parser)
    return parser.parse_args(flags.split())


def plan(flags: str, monkeypatch, world_size: int = 2, seen_shapes=None):
    """plan_run on `flags` in a world of `world_size` ranks; the error it would print, as Stopped."""
    def stop(error):
        raise Stopped(str(error))

    def validate(cfg, grid, shape, args, world):
        if seen_shapes is not None:
            seen_shapes.append(shape)
        validate_parallel_config(grid, world, cfg)

    monkeypatch.setattr(train, "exit_with_error", stop)
    monkeypatch.setenv("WORLD_SIZE", str(world_size))
    return train.plan_run(parse(flags), validate)


@pytest.mark.parametrize("flags, message", [
    ("--steps 0", "--steps 0 must be at least 1"),
    ("--steps -1", "--steps -1 must be at least 1"),
    ("--lr -1", "--lr -1.0 must be a positive number"),
    ("--bucket-mb -1", "--bucket-mb -1.0 must be a positive number"),
    ("--tp 2 --micro-batch-size 0", "--micro-batch-size 0 must be at least 1"),
    ("--sequence-parallel", "--sequence-parallel needs --tp > 1"),
    ("--global-batch-tokens 1000", "global batch of 1000 tokens is not a whole number of micro-steps of "
                                   "micro_batch_size*seq_len*dp = 8*128*2 = 2048 tokens; use 2048 tokens"),
    ("--dp 3", "dp*pp*cp*tp = 3*1*1*1 = 3 but the world size is 2"),
])
def test_each_bad_flag_is_one_clear_line(flags, message, monkeypatch):
    """Checked before any process group exists; one line per problem names the value, the rule and
    what to do instead."""
    with pytest.raises(Stopped) as stopped:
        plan(flags, monkeypatch)
    lines = str(stopped.value).splitlines()
    assert [line for line in lines if message in line] == lines[-1:], lines
    assert len(lines) <= 2, lines


def test_several_bad_flags_are_reported_together(monkeypatch):
    with pytest.raises(Stopped) as stopped:
        plan("--steps 0 --lr -1 --sequence-parallel", monkeypatch)
    assert str(stopped.value).count("\n  - ") == 3


def test_the_lesson_validates_the_batch_shape_that_runs(monkeypatch):
    """With --global-batch-tokens, grad_accum comes from it, not from --grad-accum: the lesson's
    validate sees that shape, and it is the one the batches are cut by."""
    seen = []
    run = plan("--global-batch-tokens 6144 --grad-accum 1 --micro-batch-size 8 --seq-len 128", monkeypatch,
               world_size=2, seen_shapes=seen)
    assert seen == [run.shape] and run.batches.shape == run.shape
    assert (run.grid.dp, run.shape.grad_accum) == (2, 3)
