"""Lesson 07's --batch-ramp without process groups: the ramp's steps (picotron_like.data.BatchRamp),
the token stream they read, the learning rate's progress in tokens, the time budget's estimate at the
full batch, and the refusals. The ramped runs equal to one device are in tests/test_full_5d.py (dp 2,
pp 2, interleaved); a checkpoint taken mid-ramp resumed in another layout in tests/test_checkpoint.py."""

from __future__ import annotations

import argparse
import os

import pytest
import torch

from picotron_like import run_control
from picotron_like.data import BatchRamp, BatchShape, TokenBatches, builtin_corpus_paths
from picotron_like.lessons import load_lesson
from picotron_like.lr_schedule import learning_rate, run_learning_rate, wsd_learning_rate
from picotron_like.topology import ConfigError
from picotron_like.train import checked_plan


def test_the_ramp_grows_linearly_in_tokens_rounded_up_to_whole_micro_batches():
    """Full batch 8 micro-batches of 64 tokens (512), from 100 tokens over 1,000: step 0 asks 100,
    gets 2 micro-batches (128); then 100 + 412 x 128 / 1000 = 152.7 -> 192; 100 + 412 x 320 / 1000
    = 231.8 -> 256; 100 + 412 x 576 / 1000 = 337.3 -> 384; 495.5 -> 512, the full batch, which it
    stays. A pipeline's rule: at least 4 micro-batches (256 tokens), a multiple of 4 (interleaved,
    pp 4): 152.7 -> 256, 310.9 -> 512."""
    ramp = BatchRamp(100, 1000, 8, 64)
    sizes = [ramp.step_tokens(step) for step in range(8)]
    assert sizes == [128, 192, 256, 384, 512, 512, 512, 512]
    assert [ramp.tokens_before(step) for step in range(5)] == [0, 128, 320, 576, 960]
    assert ramp.tokens_before(10) == sum(sizes[:5]) + 5 * 512 and ramp.full_from() == 4
    assert ramp.realised_history(7) == [[128, 1], [192, 1], [256, 1], [384, 1], [512, 3]]
    pipelined = BatchRamp(100, 1000, 8, 64, min_micro_batches=4, multiple=4)
    assert [pipelined.step_tokens(step) for step in range(4)] == [256, 256, 512, 512]


def test_a_resumed_ramp_continues_from_the_tokens_its_checkpoint_trained_in_its_own_rounding():
    """A run resumed after 3 steps of a ramp with 64-token micro-batches, in a layout with 256-token
    ones, reads from the same 576 tokens trained and rounds the steps that follow its own way."""
    written = BatchRamp(100, 1000, 8, 64)
    resumed = BatchRamp(100, 1000, 2, 256, history=written.realised_history(3))
    assert resumed.tokens_before(3) == written.tokens_before(3) == 576
    assert [resumed.step_tokens(step) for step in range(3, 6)] == [512, 512, 512]    # 337 -> 512, then full
    assert [written.step_tokens(step) for step in range(3, 6)] == [384, 512, 512]


def test_a_ramped_stream_reads_the_same_windows_in_the_same_order_cut_at_each_steps_size():
    """Step k starts where the tokens trained before it end: the ramped global batches, laid end to
    end, are the stream of one sequence per step; dp 2's two shares of a step are the global batch
    cut in two; every target of a step counts (n_targets = its tokens)."""
    path = builtin_corpus_paths()[0]
    shape = BatchShape(micro_batch_size=2, seq_len=16, grad_accum=4, dp=2)
    ramped = TokenBatches(path, shape, seed=5).with_ramp(BatchRamp(70, 400, 4, 64))
    one_by_one = TokenBatches(path, BatchShape(1, 16, 1, 1), seed=5)
    steps = 5
    sequences = ramped.tokens_before(steps) // 16
    assert torch.equal(torch.cat([ramped.global_batch(step) for step in range(steps)]),
                       torch.cat([one_by_one.global_batch(index) for index in range(sequences)]))
    for step in range(steps):
        counts = ramped.grad_accum_at(step)
        assert ramped.step_tokens(step) == counts * 64 and ramped.epoch_at(step) == 0
        shares = [ramped.step_batch(step, rank) for rank in range(2)]
        assert all(len(share.micro_batches) == counts and share.n_targets == counts * 64 for share in shares)
        rows = torch.cat([torch.cat([inputs for inputs, _ in share.micro_batches]) for share in shares])
        assert torch.equal(rows, ramped.global_batch(step)[:, :-1])
    assert [ramped.grad_accum_at(step) for step in range(steps)] == [2, 3, 4, 4, 4]


def test_the_learning_rate_counts_tokens_bit_for_bit_the_steps_under_a_fixed_batch():
    """Cosine's and WSD's progress in tokens: under a fixed batch of T tokens the same rates as in
    steps, bit for bit; under a ramp, the decay spread over the tokens (the ramp's small steps move
    it less than a full one)."""
    for total, warmup in [(20, 4), (7, 0), (31, 5), (1000, 37)]:
        for step in range(total + 2):
            assert learning_rate(step, 3e-3, warmup, total, tokens_before=lambda k: 4096 * k) == \
                learning_rate(step, 3e-3, warmup, total)
    ramp = BatchRamp(100, 1000, 8, 64)
    args = argparse.Namespace(lr=1.0, warmup_steps=0, steps=12, lr_schedule="cosine")
    rates = [run_learning_rate(args, step, ramp.tokens_before) for step in range(12)]
    assert rates == [learning_rate(step, 1.0, 0, 12, tokens_before=ramp.tokens_before) for step in range(12)]
    progress = ramp.tokens_before(3) / ramp.tokens_before(12)       # 576 of 4,544 tokens: 3 of 12 steps
    assert rates[3] == pytest.approx(0.1 + 0.45 * (1 + torch.cos(torch.tensor(torch.pi * progress)).item()))
    assert rates[3] > learning_rate(3, 1.0, 0, 12)
    wsd = argparse.Namespace(lr=1.0, warmup_steps=0, steps=12, lr_schedule="wsd", decay_share=0.2)
    assert [run_learning_rate(wsd, step, ramp.tokens_before) for step in range(12)] == \
        [wsd_learning_rate(step, 1.0, 0, 12, 0.8 * ramp.tokens_before(12), tokens_before=ramp.tokens_before)
         for step in range(12)]


class Clock:
    def __init__(self, now: float):
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_the_time_budget_estimates_a_full_step_not_from_the_ramps_small_ones():
    """Steps of 1 s plus 0.5 s per micro-batch, on a ramp of 2, 2, 3, 4, 4, 5, 6, 7, then 8
    micro-batches: after the first three (the first's 5 s of one-off costs left out), the slope
    between 2 and 3 micro-batches is 0.5 s and a full step 1 + 0.5 x 8 = 5 s, where the small
    steps' seconds per micro-batch (1 s) would say 8 s. The end keeps two full steps; the ramp's
    steps still to come count at their own size (3 + 3 + 3.5 + 4 + 4.5 s), then full ones: after
    9.5 s, 120 s leave 120 - 9.5 - 10 - 18 = 82.5 s, 16 full steps: 8 + 16 = 24 steps."""
    path = builtin_corpus_paths()[0]
    data = TokenBatches(path, BatchShape(2, 16, 8, 2), seed=5).with_ramp(BatchRamp(100, 2000, 8, 64))
    assert [data.grad_accum_at(step) for step in range(9)] == [2, 2, 3, 4, 4, 5, 6, 7, 8] and data.full_from() == 8
    clock = Clock(0.0)
    budget = run_control.TimeBudget(2.0, clock, data=data)
    for step, seconds in enumerate([5.0, 2.0, 2.5]):
        clock.now += seconds
        budget.note_step(step)
    assert budget.seconds_per_micro_batch() == 0.5 and budget.slowest_step_s() == 5.0
    assert budget.end_s() == 10.0 and budget.step_seconds(4) == 3.0
    assert budget.planned_steps(3, 10**9) == 24
    fixed = run_control.TimeBudget(2.0, Clock(0.0), data=TokenBatches(path, BatchShape(2, 16, 8, 2), seed=5))
    for step, seconds in enumerate([5.0, 2.0, 2.5]):
        fixed.clock.now += seconds
        fixed.note_step(step)
    assert fixed.slowest_step_s() == 2.5        # without a ramp: the slowest step but the first, as before


def plan_07(*flags: str, world_size: int = 4):
    """07's plan of a 4-layer tiny model under `flags` on `world_size` ranks; WORLD_SIZE set only
    meanwhile (a later test's subprocess must not inherit it)."""
    full_5d = load_lesson("07_full_5d")
    before = os.environ.get("WORLD_SIZE")
    os.environ["WORLD_SIZE"] = str(world_size)
    try:
        args = full_5d.parse_args(["--n-layers", "4", "--seq-len", "32", "--micro-batch-size", "2",
                                   "--global-batch-tokens", "1024", *flags])
        return checked_plan(args, full_5d.validate, full_5d.model_config, world_size), args
    finally:
        if before is None:
            del os.environ["WORLD_SIZE"]
        else:
            os.environ["WORLD_SIZE"] = before


@pytest.mark.parametrize("flags, message", [
    (("--batch-ramp", "2048", "100"), "a first step of 2,048 tokens is larger than the full batch of 1,024"),
    (("--batch-ramp", "0", "100"), "--batch-ramp 0 100: the first step's tokens and the tokens over which the "
                                   "batch grows must both be positive"),
    (("--batch-ramp", "100", "-5"), "must both be positive"),
    (("--pp", "2", "--batch-ramp", "100", "1000"), "a first step of 100 tokens is less than one micro-batch per dp "
                                                   "rank x pp 2: 2 x 32 tokens x dp 2 x pp 2 = 256"),
])
def test_bad_ramps_are_refused_before_any_process_group(flags, message):
    with pytest.raises(ConfigError, match="bad --batch-ramp") as refused:
        plan_07(*flags)
    assert message in str(refused.value)


def test_a_ramp_with_experts_plans():
    """Experts compose with a ramp (each step's balancing losses count its own sequences: 07's
    count_the_steps_sequences; proven in tests/test_full_5d_expert_composition.py): no refusal."""
    plan, args = plan_07("--preset", "tiny-moe", "--aux-loss-coef", "1e-2", "--batch-ramp", "512", "1000")
    assert load_lesson("07_full_5d").ramp_of_layout(args, plan.grid, plan.shape).step_tokens(0) == 512


def test_a_good_ramp_plans_and_says_how_it_rounds():
    """Interleaved on pp 2 x dp 2, micro-batches of 128 tokens over the dp ranks: 300 tokens asked,
    3 micro-batches per rank, rounded up to 4, a multiple of pp: 512 in the first step; then 485.3
    -> 512, 670.7 -> 768 and the full 1,024. Said in one line."""
    full_5d = load_lesson("07_full_5d")
    plan, args = plan_07("--pp", "2", "--schedule", "interleaved", "--batch-ramp", "300", "2000")
    ramp = full_5d.ramp_of_layout(args, plan.grid, plan.shape)
    assert [ramp.step_tokens(step) for step in range(4)] == [512, 512, 768, 1024]
    assert full_5d.describe_ramp(ramp, args, plan.grid) == (
        "batch ramp: 512 tokens in the first step (asked 300: rounded up to whole micro-batches), growing with the "
        "tokens trained to 1,024 after 2,000 (full from step 3), in micro-batches of 128 tokens over the dp ranks, a "
        "multiple of pp 2 for the interleaved schedule")
