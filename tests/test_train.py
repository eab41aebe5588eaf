"""The shared skeleton: memory measured against the formula, the schedule, clipping across ranks,
and every flag checked before a process group exists."""

import argparse
import contextlib
import io
import json
import math
import os
import re
import subprocess
import sys
from dataclasses import replace
from functools import partial

import pytest
import torch
import torch.distributed as dist

from picotron_like import comm, run_control, train
from picotron_like.data import BatchShape, TokenBatches, builtin_corpus_paths
from picotron_like.lessons import REPO_ROOT, load_lesson
from picotron_like.lr_schedule import (decay_start, first_decaying_step, learning_rate, place_decay,
                                      run_learning_rate, wsd_learning_rate)
from picotron_like.metrics import (ActivationMeter, measured_memory, model_flops_utilisation, peak_flops,
                                   predicted_activation_bytes, predicted_memory)
from picotron_like.model import GPT, count_parameters, flops_per_token, get_config
from picotron_like.testing import HostReads, run_ranks
from picotron_like.topology import ConfigError, GridShape, ProcessGrid, validate_parallel_config
from picotron_like.train import build_optimizer, clip_grad_norm_, optimizer_step

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


def test_wsd_holds_the_peak_and_decays_over_the_final_share_to_the_minimum_at_the_last_step():
    """20 steps, warm-up 4, --decay-share 0.2: the peak from step 3 to 15, then 1 - sqrt of the
    decay's progress (step s counts as done at s + 1) from 16, down to 0.1 x the peak at step 19.
    A run shorter than its warm-up still ends at the minimum: the lower of the two rates."""
    lrs = [wsd_learning_rate(step, 1.0, 4, 20, decay_start=0.8 * 20) for step in range(20)]
    assert lrs[:16] == [0.25, 0.5, 0.75] + [1.0] * 13
    assert lrs[16:] == pytest.approx([0.1 + 0.9 * (1 - math.sqrt(done / 4)) for done in (1, 2, 3, 4)])
    assert lrs[16] == pytest.approx(0.55) and lrs[19] == pytest.approx(0.1)
    assert [wsd_learning_rate(step, 1.0, 5, 3, decay_start=0.8 * 3) for step in range(3)] == \
        pytest.approx([0.2, 0.4, 0.1])


def test_the_run_learning_rate_is_cosine_unless_wsd_is_asked_and_a_budget_places_the_decay():
    """run_learning_rate: cosine, bit for bit, by default; wsd from the run's flags. place_decay
    (a time budget's plan from a step on): the share of the plan, or now where that share has
    begun, or, for a decay under way, its own start, the end moved; cosine keeps only the steps."""
    cosine = argparse.Namespace(lr=3e-3, warmup_steps=5, steps=30)
    assert [run_learning_rate(cosine, step) for step in range(30)] == [learning_rate(step, 3e-3, 5, 30)
                                                                       for step in range(30)]
    place_decay(cosine, 3, 12)
    assert (cosine.steps, cosine.planned_steps, getattr(cosine, "decay_start", None)) == (12, 12, None)
    wsd = argparse.Namespace(lr=3e-3, warmup_steps=5, steps=train.NO_STEP_LIMIT, lr_schedule="wsd", decay_share=0.25,
                             decay_start=None)
    assert decay_start(wsd) == 0.75 * train.NO_STEP_LIMIT and run_learning_rate(wsd, 100) == 3e-3
    place_decay(wsd, 3, 40)                                 # the estimate: the last quarter of 40 steps
    assert (wsd.steps, wsd.planned_steps, wsd.decay_start, first_decaying_step(wsd)) == (40, 40, 30.0, 30)
    place_decay(wsd, 23, 32)                                # sooner, before the decay: the last quarter of 32
    assert wsd.decay_start == 24.0
    place_decay(wsd, 27, 30)                                # under way since step 24: it keeps its start
    assert (wsd.steps, wsd.decay_start) == (30, 24.0)
    assert run_learning_rate(wsd, 29) == pytest.approx(3e-4)
    late = argparse.Namespace(lr=3e-3, warmup_steps=0, steps=train.NO_STEP_LIMIT, lr_schedule="wsd", decay_share=0.5)
    place_decay(late, 3, 5)                                 # the share began at 2.5, before the plan: from step 3
    assert late.decay_start == 3.0 and [run_learning_rate(late, step) for step in range(5)][2:] == \
        pytest.approx([3e-3, 3e-3 * (0.1 + 0.9 * (1 - math.sqrt(0.5))), 3e-4])


def test_a_decay_share_outside_its_range_or_without_wsd_is_refused():
    lesson = load_lesson("01_data_parallel")
    for share in ("0", "1.5", "-0.2", "nan"):
        with pytest.raises(ConfigError, match=rf"--decay-share {share.replace('.', '[.]')}\S* must be in \(0, 1\]"):
            train.check_flag_ranges(lesson.parse_args(["--lr-schedule", "wsd", "--decay-share", share]))
    with pytest.raises(ConfigError, match="--decay-share 0.3 with --lr-schedule cosine: cosine decays over the whole "
                                          "run; add --lr-schedule wsd or drop --decay-share"):
        train.check_flag_ranges(lesson.parse_args(["--decay-share", "0.3"]))
    args = lesson.parse_args(["--lr-schedule", "wsd", "--decay-share", "1"])
    train.check_flag_ranges(args)
    for argv, share in [(["--lr-schedule", "wsd"], 0.2), (["--lr-schedule", "wsd", "--decay-share", "1"], 1.0),
                        ([], None)]:
        args = lesson.parse_args(argv)
        train.resolve_decay_share(args)
        assert args.decay_share == share


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
    return norm.item(), shard.grad, replicated.grad, full_matrix_grad, vector_grad


def test_clipping_uses_the_norm_of_the_whole_model():
    (norm0, shard0, vec0, full_matrix, vector), (norm1, shard1, vec1, _, _) = run_ranks(2, sharded_clipping)
    reference = [torch.nn.Parameter(torch.zeros(4, 6)), torch.nn.Parameter(torch.zeros(5))]
    reference[0].grad, reference[1].grad = full_matrix.clone(), vector.clone()
    expected_norm = torch.nn.utils.clip_grad_norm_(reference, 1.0).item()
    assert norm0 == pytest.approx(expected_norm, rel=1e-6) and norm1 == pytest.approx(expected_norm, rel=1e-6)
    torch.testing.assert_close(torch.cat([shard0, shard1]), reference[0].grad)
    torch.testing.assert_close(vec0, reference[1].grad)
    torch.testing.assert_close(vec1, reference[1].grad)


def tail_model(rank: int, n_rows: int = 400, n_cols: int = 500) -> dict:
    """Rank `rank`'s half of a 2 n_rows x n_cols matrix and a vector every rank holds, with the same
    gradients on every call (about 2e5 values each: enough for _foreach_norm's blocked sums to
    differ from the exact ones), each as a parameter with its gradient set."""
    generator = torch.Generator().manual_seed(11)
    full, vector = torch.randn(2 * n_rows, n_cols, generator=generator), torch.randn(700, generator=generator)
    params = {"shard": torch.nn.Parameter(torch.randn(n_rows, n_cols, generator=generator)),
              "vector": torch.nn.Parameter(torch.randn(700, generator=generator))}
    params["shard"].grad = full[rank * n_rows: (rank + 1) * n_rows].clone()
    params["vector"].grad = vector.clone()
    return params


def tail_steps() -> dict:
    """Each rank's figures of the fused tail against the exact one (clip_gradients as the step's
    settings pick it), with both kinds of AdamW; and a rank holding no gradient at all."""
    rank, world = dist.get_rank(), dist.group.WORLD
    out = {}

    def run(tail: str, fused_adamw: bool):
        params = tail_model(rank)
        optimizer = torch.optim.AdamW(params.values(), lr=0.1, fused=fused_adamw, foreach=False if not fused_adamw
                                      else None)
        settings = train.StepSettings(torch.device("cpu"), max_grad_norm=1.0, norm_groups=(world,),
                                      counts_toward_norm=lambda p: p is params["shard"] or rank == 0, tail=tail)
        norm, grad_scale = train.clip_gradients(optimizer, params.values(), settings)
        clipped = {name: p.grad.clone() for name, p in params.items()}
        skipped = optimizer_step(optimizer, norm, grad_scale)
        return dict(norm=norm.item(), grad_scale=grad_scale, clipped=clipped, skipped=skipped.item(),
                    stepped_grads={name: p.grad.clone() for name, p in params.items()},
                    params={name: p.detach().clone() for name, p in params.items()})

    for tail in ("exact", "fused"):
        for fused_adamw in (False, True):
            out[tail, fused_adamw] = run(tail, fused_adamw)
    # The grad_scale path alone, from one norm: AdamW dividing by 1 / factor, against scaling first.
    for fold in (False, True):
        params = tail_model(rank)
        optimizer = torch.optim.AdamW(params.values(), lr=0.1, fused=True)
        norm = train.global_grad_norm([params["shard"].grad] + ([params["vector"].grad] if rank == 0 else []),
                                      torch.device("cpu"), (world,))
        factor = train.clip_factor(norm, 1.0)
        if not fold:
            torch._foreach_mul_([p.grad for p in params.values()], factor)
        optimizer_step(optimizer, norm, factor.reciprocal() if fold else None)
        out["one norm", fold] = {name: p.detach().clone() for name, p in params.items()}
    # A rank without gradients (rank 1 here) still joins the norm's all-reduce, on the step's device.
    comm.meter.reset()
    params = tail_model(rank)
    if rank == 1:
        for p in params.values():
            p.grad = None
    settings = train.StepSettings(torch.device("cpu"), norm_groups=(world,), counts_toward_norm=lambda p: True)
    out["empty"] = train.clip_gradients(torch.optim.AdamW(params.values()), params.values(), settings)[0].item()
    out["empty devices"] = dict(comm.meter.devices)
    return out


def test_the_fused_tail_equals_the_exact_one_and_a_rank_without_gradients_norms_on_the_step_device():
    """The fused tail (forced on the CPU: tail="fused") against the exact one, on two ranks each
    holding half a matrix and a replicated vector counted once. Its norm (_foreach_norm) is the
    exact one within 3e-5 relative, the CPU's own _foreach_norm error (the exact path's is that of
    one device, test_clipping_uses_the_norm_of_the_whole_model); with fused AdamW the clipping is
    folded into the step (a grad_scale, gradients unscaled until AdamW reads them), without it the
    gradients are scaled first; the norm returned is the norm before clipping either way. From one
    norm, AdamW dividing by 1 / factor gives clip-then-step's weights to float32 rounding (g / (1/c)
    and g c differ by an ulp: the weights, of order 1, by an ulp or two). A rank
    holding no gradient norms on the step's device and gets the whole model's norm."""
    ranks = run_ranks(2, tail_steps)
    for out in ranks:
        exact, fused = out["exact", True], out["fused", True]
        assert exact["norm"] > 1.0 and exact["grad_scale"] is None      # clipping acts
        assert fused["norm"] == pytest.approx(exact["norm"], rel=3e-5) and fused["norm"] != exact["norm"]
        assert fused["grad_scale"].item() == pytest.approx(fused["norm"] + 1e-6, rel=1e-6)
        for name, clipped in exact["clipped"].items():
            torch.testing.assert_close(fused["clipped"][name], clipped * exact["norm"], rtol=3e-5, atol=0)
            torch.testing.assert_close(fused["stepped_grads"][name], clipped, rtol=3e-5, atol=0)
        assert out["exact", False]["norm"] == exact["norm"] and out["fused", False]["norm"] == fused["norm"]
        assert out["fused", False]["grad_scale"] is None        # a per-tensor AdamW: scaled first
        for name, clipped in out["fused", False]["clipped"].items():
            torch.testing.assert_close(clipped, exact["clipped"][name], rtol=3e-5, atol=0)
        for result in (exact, fused, out["exact", False], out["fused", False]):
            assert not result["skipped"]
            for name, param in result["params"].items():
                torch.testing.assert_close(param, exact["params"][name], rtol=1e-5, atol=1e-6)
        for name, param in out["one norm", True].items():      # two float32 ulps at the weights' scale (1)
            torch.testing.assert_close(param, out["one norm", False][name], rtol=2**-22, atol=2**-22)
    assert ranks[0]["exact", True]["norm"] == ranks[1]["exact", True]["norm"]
    assert ranks[0]["empty"] == ranks[1]["empty"] > 0
    assert all(out["empty devices"][("all_reduce", "world")] == {"cpu"} for out in ranks)


def test_the_norm_lives_on_the_steps_device_and_the_tail_setting_picks_the_path():
    """A rank whose parameters hold no gradient builds its norm on StepSettings.device, not the
    CPU (on a GPU run a CPU tensor would put its all-reduce on gloo while its peers use NCCL):
    shown here with the meta device, which no gradient is on; without a device it refuses rather
    than guess. "auto" is fused on CUDA only."""
    param = torch.nn.Parameter(torch.zeros(3))
    for tail in ("exact", "fused"):
        settings = train.StepSettings(torch.device("meta"), tail=tail)
        norm, grad_scale = train.clip_gradients(torch.optim.AdamW([param], fused=True), [param], settings)
        assert norm.device.type == "meta" and (grad_scale is None) == (tail == "exact")
    with pytest.raises(ValueError, match="device"):
        clip_grad_norm_([param], 1.0)
    assert train.StepSettings(torch.device("cuda")).fused_tail and not train.StepSettings(torch.device("cpu")).fused_tail
    assert train.StepSettings(torch.device("cpu"), tail="fused").fused_tail
    assert not train.StepSettings(torch.device("cuda"), tail="exact").fused_tail


def test_the_fused_tail_reads_nothing_to_the_host():
    """clip_and_step on the fused tail with fused AdamW: the norm, the clip coefficient (as
    grad_scale) and the skip flag stay tensors the optimizer reads on the device; a non-finite
    gradient still skips the step, and the step leaves no attribute on the optimizer."""
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1, fused=True)
    settings = train.StepSettings(torch.device("cpu"), tail="fused")
    for poisoned in (False, True):
        model(torch.ones(2, 4)).sum().backward()
        if poisoned:
            model.weight.grad[0, 0] = float("inf")
        before = model.weight.detach().clone()
        with HostReads() as reads:
            norm, skipped = train.clip_and_step(optimizer, model.parameters(), settings)
        assert reads.sites == [] and skipped.item() == poisoned
        assert torch.equal(model.weight, before) == poisoned
        optimizer.zero_grad()
    assert not hasattr(optimizer, "found_inf") and not hasattr(optimizer, "grad_scale")


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
        validate_parallel_config(grid, world)

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
    ("--peak-tflops 0", "--peak-tflops 0.0 must be a positive number"),
    ("--n-heads 0", "--n-heads 0 must be at least 1"),
    ("--ffn-hidden -8", "--ffn-hidden -8 must be at least 1"),
    # the model-shape flags together: the config's own rules, naming the flags given
    ("--n-kv-heads 3", "--preset tiny with --n-kv-heads 3: invalid GPTConfig: n_heads=4 is not divisible by "
                       "n_kv_heads=3"),
    ("--hidden 100 --n-heads 4 --n-kv-heads 4", "--preset tiny with --hidden 100 --n-heads 4 --n-kv-heads 4: "
                                                "invalid GPTConfig: head_dim=25 must be even for rotary embeddings"),
    # another lesson's axis: refused with a pointer to lesson 07, --ep too (lesson 05 defines it)
    ("--pp 2", "--pp 2: this lesson teaches its technique with data parallelism alone; pipeline parallelism "
               "composes with it in lesson 07: run 07_full_5d.py with the same flags"),
    ("--ep 2", "--ep 2: this lesson teaches its technique with data parallelism alone; expert parallelism "
               "composes with it in lesson 07: run 07_full_5d.py with the same flags"),
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


SMALL_FLAGS = "--n-layers 3 --hidden 96 --n-heads 6 --n-kv-heads 3 --ffn-hidden 256 --vocab-size 300"


def test_the_model_shape_flags_set_the_model_the_lesson_validates_and_trains(monkeypatch):
    """Each model-shape flag overrides its field of --preset's config; the others keep the preset's."""
    assert plan(SMALL_FLAGS, monkeypatch).cfg == SMALL
    assert plan("--preset 8b --hidden 2048", monkeypatch).cfg == replace(get_config("8b"), hidden=2048)


def test_a_lesson_trains_the_model_its_shape_flags_describe():
    """Lesson 01 under torchrun on 2 ranks with a model given by flags alone: it builds that model
    (its parameter count) and trains it."""
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                          str(REPO_ROOT / "01_data_parallel.py"), *SMALL_FLAGS.split(), "--steps", "2",
                          "--seq-len", "32", "--micro-batch-size", "2"],
                         capture_output=True, text=True, timeout=240, cwd=REPO_ROOT,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert run.returncode == 0, run.stdout + run.stderr
    assert f"{count_parameters(SMALL)['total']:,} parameters" in run.stdout, run.stdout
    assert len(re.findall(r"^step +\d+ \| loss \d+\.\d+", run.stdout, re.M)) == 2, run.stdout


def test_the_plan_states_a_model_no_preset_has(capsys):
    """--plan for the Ultra-Scale Playbook's smallest model (nanotron's shape: 16 layers of width
    2048, 32 heads and as many key/value heads, MLP 8192, Llama 3's vocabulary) from the 8b preset
    and shape flags: it plans that model (its parameter count; the head untied, as every model here)."""
    flags = {"n_layers": 16, "hidden": 2048, "n_heads": 32, "n_kv_heads": 32, "ffn_hidden": 8192}
    load_lesson("07_full_5d").main(["--plan", "--preset", "8b", "--gpus", "1", "--gpu", "H100", "--seq-len", "4096",
                                    "--micro-batch-size", "1", "--grad-accum", "1",
                                    *[word for field, value in flags.items()
                                      for word in (f"--{field.replace('_', '-')}", str(value))]])
    first = capsys.readouterr().out.splitlines()[0]
    total = count_parameters(replace(get_config("8b"), **flags))["total"]
    assert first.startswith(f"memory plan: 8b with --n-layers 16 --hidden 2048 --n-heads 32 --n-kv-heads 32 "
                            f"--ffn-hidden 8192 ({total / 1e9:.2f} B parameters) on 1 x H100"), first


def test_the_lesson_validates_the_batch_shape_that_runs(monkeypatch):
    """With --global-batch-tokens, grad_accum comes from it, not from --grad-accum: the lesson's
    validate sees that shape, and it is the one the batches are cut by."""
    seen = []
    run = plan("--global-batch-tokens 6144 --grad-accum 1 --micro-batch-size 8 --seq-len 128", monkeypatch,
               world_size=2, seen_shapes=seen)
    assert seen == [run.shape] and run.batches.shape == run.shape
    assert (run.grid.dp, run.shape.grad_accum) == (2, 3)


# ----------------------------------------------------------------------------- the loop: skipped steps, metrics, validation

LOOP_CFG = replace(get_config("tiny"), n_layers=2, hidden=64, n_heads=4, n_kv_heads=2, ffn_hidden=128)
LOOP_SHAPE = BatchShape(micro_batch_size=2, seq_len=32, grad_accum=2, dp=2)
NAN_STEP, LOOP_STEPS, VAL_BATCHES = 1, 4, 2


def snapshot(model, optimizer) -> dict:
    """Every parameter and every AdamW state (moments and step count), cloned."""
    state = {name: p.detach().clone() for name, p in model.named_parameters()}
    for index, p in enumerate(model.parameters()):
        for key, value in optimizer.state.get(p, {}).items():
            state[f"adam{index}.{key}"] = value.clone()
    return state


def lesson01_loop(metrics_path, profile_dir):
    """Lesson 01 at dp = 2 through the shared loop: rank 0 poisons one gradient element at step
    NAN_STEP (before the all-reduce, so both ranks receive it); validation runs every 2 steps;
    every rank writes a profiler trace."""
    lesson = load_lesson("01_data_parallel")
    rank = dist.get_rank()
    grid = ProcessGrid(GridShape(dp=2))
    model = lesson.wrap_data_parallel(GPT(LOOP_CFG, seed=3), grid.dp_group, "bucketed", 64 * 1024)
    optimizer = build_optimizer(model.module, 3e-3)
    settings = train.StepSettings(torch.device("cpu"))
    paths = builtin_corpus_paths()
    batches = TokenBatches(paths[0], LOOP_SHAPE, seed=3, vocab_size=LOOP_CFG.vocab_size)
    val_batches = TokenBatches(paths[1], LOOP_SHAPE, seed=3, vocab_size=LOOP_CFG.vocab_size)
    poisoned = next(model.module.parameters())
    seen, step_counter = {}, iter(range(LOOP_STEPS))

    def poison(grad):
        return grad.index_put((torch.zeros(grad.dim(), dtype=torch.long),), torch.tensor(float("nan")))

    def step_fn(batch):
        step = next(step_counter)
        handle = poisoned.register_hook(poison) if step == NAN_STEP and rank == 0 else None
        if step == NAN_STEP:
            seen["before"] = snapshot(model.module, optimizer)
        result = lesson.train_step(model, optimizer, batch, settings)
        if step == NAN_STEP:
            seen["after"] = snapshot(model.module, optimizer)
            seen["grads_zero"] = all(not p.grad.any() for p in model.module.parameters())
            if handle is not None:
                handle.remove()
        return result

    args = argparse.Namespace(steps=LOOP_STEPS, lr=3e-3, warmup_steps=1, metrics=metrics_path if rank == 0 else None,
                              val_every=2, val_batches=VAL_BATCHES, profile=profile_dir)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        throughput = train.train(args, optimizer, step_fn,
                                 train.RankBatches(batches, grid.dp_rank, torch.device("cpu"), val=val_batches),
                                 evaluate=partial(lesson.evaluate, model, settings=settings), cfg=LOOP_CFG)
    # One device on every validation token of the same batches, with the weights the run ended with.
    windows = torch.cat([val_batches.global_batch(index) for index in range(VAL_BATCHES)])
    with torch.no_grad():
        reference_val = GPT(LOOP_CFG, seed=3).eval()
        reference_val.load_state_dict(model.module.state_dict())
        one_device = reference_val(windows[:, :-1], windows[:, 1:]).item()
    distributed_val = train.validation_loss(partial(lesson.evaluate, model, settings=settings),
                                            partial(val_batches.step_batch, dp_rank=grid.dp_rank), VAL_BATCHES)
    return dict(seen=seen, skipped=throughput.skipped_steps, printed=printed.getvalue(), one_device=one_device,
                distributed_val=distributed_val, final=snapshot(model.module, optimizer))


@pytest.fixture(scope="module")
def loop_run(tmp_path_factory):
    """One 2-rank spawn shared by the loop's tests below."""
    metrics_path = tmp_path_factory.mktemp("metrics") / "metrics.jsonl"
    profile_dir = tmp_path_factory.mktemp("profile")
    return run_ranks(2, lesson01_loop, str(metrics_path), str(profile_dir)), metrics_path, profile_dir


def test_a_step_with_a_non_finite_gradient_norm_is_skipped_on_every_rank(loop_run):
    """A NaN in one gradient element of one rank: after the all-reduce every rank's norm is NaN,
    so every rank skips the same step: parameters and AdamW states exactly as before it, gradients
    zeroed; the next steps train on (finite loss, parameters moved, the ranks still identical)."""
    results = loop_run[0]
    for rank, result in enumerate(results):
        before, after = result["seen"]["before"], result["seen"]["after"]
        assert before.keys() == after.keys() and any(key.startswith("adam") for key in before)
        for key in before:
            assert torch.equal(before[key], after[key]), (rank, key)
        assert result["seen"]["grads_zero"], rank
        assert result["skipped"] == 1, rank
        assert any(not torch.equal(after[key], result["final"][key]) for key in after), rank
    for key, value in results[0]["final"].items():
        assert torch.equal(value, results[1]["final"][key]), key
        assert torch.isfinite(value).all(), key
    lines = [line for line in results[0]["printed"].splitlines() if "| loss" in line]
    assert len(lines) == LOOP_STEPS
    assert [("skipped: non-finite grad norm" in line) for line in lines] == [s == NAN_STEP for s in range(LOOP_STEPS)]
    assert "grad norm     nan" in lines[NAN_STEP] and "nan" not in lines[-1]
    assert results[1]["printed"] == ""


def test_the_step_line_shows_the_learning_rate(loop_run):
    lines = [line for line in loop_run[0][0]["printed"].splitlines() if "| loss" in line]
    expected = [learning_rate(step, 3e-3, 1, LOOP_STEPS) for step in range(LOOP_STEPS)]
    assert [line.split("| lr ")[1].split(" |")[0] for line in lines] == [f"{lr:.2e}" for lr in expected]


def test_metrics_file_has_one_json_line_per_step(loop_run):
    results, metrics_path, _ = loop_run
    records = [json.loads(line) for line in metrics_path.read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(LOOP_STEPS))
    assert [r["skipped"] for r in records] == [step == NAN_STEP for step in range(LOOP_STEPS)]
    assert records[NAN_STEP]["grad_norm"] is None   # JSON has no NaN: null
    printed = [line for line in results[0]["printed"].splitlines() if "| loss" in line]
    for record, line in zip(records, printed):
        assert set(record) >= {"loss", "grad_norm", "lr", "tokens_per_s", "seconds", "skipped"}
        assert record["lr"] == learning_rate(record["step"], 3e-3, 1, LOOP_STEPS)
        assert record["tokens_per_s"] == pytest.approx(LOOP_SHAPE.tokens_per_step / record["seconds"])
        assert f"loss {record['loss']:.4f}" in line
        assert record["skipped"] or f"grad norm {record['grad_norm']:7.3f}" in line
    assert [("val_loss" in r) for r in records] == [False, True, False, True]


def test_validation_loss_at_dp2_equals_one_device(loop_run):
    """The same val batches, the same weights: the dp = 2 token-weighted loss (summed token losses
    over the global count, all-reduced) equals one device's mean over every validation token.
    Tolerance: float32 sums of the same ~2000 token losses in another order, a few ulp of ~5."""
    results, metrics_path, _ = loop_run
    for result in results:
        assert result["distributed_val"] == pytest.approx(result["one_device"], rel=1e-6, abs=0)
    last = json.loads(metrics_path.read_text().splitlines()[-1])
    assert last["val_loss"] == pytest.approx(results[0]["one_device"], rel=1e-6, abs=0)
    assert f"val loss {last['val_loss']:.4f}" in results[0]["printed"]


def test_the_step_line_and_metrics_show_what_memory_the_cpu_can_measure(loop_run):
    """On a CPU: the process's peak resident set, named as such, in the line and the metrics; no MFU
    (there is no peak to divide by). The peak only grows: the kernel cannot reset it."""
    results, metrics_path, _ = loop_run
    records = [json.loads(line) for line in metrics_path.read_text().splitlines()]
    lines = [line for line in results[0]["printed"].splitlines() if "| loss" in line]
    rss = [record["max_rss_bytes"] for record in records]
    assert rss == sorted(rss) and rss[0] > 50e6
    for record, line in zip(records, lines):
        assert "mfu" not in record and "MFU" not in line and "max_memory_allocated_bytes" not in record
        assert line.endswith(f" ms | max rss {record['max_rss_bytes'] / 1e9:.2f} GB"), line


def test_the_step_line_on_a_gpu():
    """The step line's shape on CUDA, from the values the loop hands log_step there."""
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        run_control.log_step(3, {"loss": 2.5, "grad_norm": 0.75}, tokens=4096, seconds=0.5, lr=3e-4, mfu=0.4123,
                       memory={"max_memory_allocated_bytes": 12.345e9})
    assert printed.getvalue() == ("step    3 | loss 2.5000 | grad norm   0.750 | lr 3.00e-04 |      8192 tok/s |"
                                  "   500.0 ms | MFU 41.2 % | peak mem 12.35 GB\n")


def test_mfu_needs_a_gpu_and_its_peak():
    cpu = torch.device("cpu")
    assert peak_flops(cpu) is None and peak_flops(cpu, override_tflops=100.0) is None
    flops = flops_per_token(get_config("tiny"), 128)
    assert model_flops_utilisation(1e6, 8, flops, 989e12) == pytest.approx(1e6 / 8 * flops / 989e12)


def test_profile_writes_a_trace_per_rank(loop_run):
    """--profile DIR: one Chrome-trace JSON file per rank (what Perfetto and TensorBoard read), with
    the recorded steps' operators in it."""
    profile_dir = loop_run[2]
    for rank in range(2):
        (trace,) = profile_dir.glob(f"rank{rank}.*.pt.trace.json")
        events = json.loads(trace.read_text())["traceEvents"]
        names = {event.get("name", "") for event in events}
        assert any(name.startswith("ProfilerStep#") for name in names), rank
        assert any("aten::" in name for name in names), rank


def test_validation_flags(monkeypatch):
    """--val-every 0 (the default) builds no validation data; N > 0 uses the built-in val split."""
    assert plan("", monkeypatch).val_batches is None
    run = plan("--val-every 5", monkeypatch)
    assert run.val_batches.paths == [builtin_corpus_paths()[1]] and run.val_batches.shape == run.shape
    with pytest.raises(Stopped, match="--val-every -1 must be 0"):
        plan("--val-every -1", monkeypatch)


# ----------------------------------------------------------------------------- the loss-curve picture


def write_metrics(path, losses, val_every=2):
    with open(path, "w") as file:
        for step, loss in enumerate(losses):
            record = {"step": step, "loss": loss, "grad_norm": None if step == 1 else 1.0}
            if (step + 1) % val_every == 0:
                record["val_loss"] = loss + 0.1
            file.write(json.dumps(record) + "\n")


def test_plot_draws_every_metrics_file(tmp_path):
    pytest.importorskip("matplotlib")
    from picotron_like import plot
    write_metrics(tmp_path / "a.jsonl", [5.0, 4.0, 3.5, 3.2])
    write_metrics(tmp_path / "b.jsonl", [5.1, 4.2, 3.9])
    assert math.isnan(plot.read_metrics(tmp_path / "a.jsonl")[1]["grad_norm"])    # JSON null
    plot.main([str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl"), "-o", str(tmp_path / "loss.png")])
    assert (tmp_path / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_resumed_runs_metrics_give_each_step_once(tmp_path, capsys):
    """Killed mid-line, resumed from step 1's checkpoint: the metrics file goes on on a new line, the
    plot reads each step's last record and skips the half line with a note."""
    from picotron_like import plot
    path = tmp_path / "resumed.jsonl"
    path.write_text('{"step": 0, "loss": 5.0}\n{"step": 1, "loss": 4.0}\n{"step": 2, "lo')
    resumed = run_control.MetricsFile(path, append=True)
    for step, loss in ((1, 4.1), (2, 3.9)):
        resumed.write({"step": step, "loss": loss})
    resumed.close()
    assert [(record["step"], record["loss"]) for record in plot.read_metrics(path)] == [(0, 5.0), (1, 4.1), (2, 3.9)]
    note = f"note: {path}: line 3 is not a step's record (a run killed while writing it?); skipped\n"
    assert capsys.readouterr().err == note


def test_plot_without_matplotlib_says_how_to_install_it(tmp_path, monkeypatch, capsys):
    """matplotlib is an optional extra: without it, one error line naming the install command."""
    from picotron_like import plot
    write_metrics(tmp_path / "a.jsonl", [5.0, 4.0])
    monkeypatch.setitem(sys.modules, "matplotlib", None)     # what `import matplotlib` meets when it is absent
    with pytest.raises(SystemExit) as stopped:
        plot.main([str(tmp_path / "a.jsonl"), "-o", str(tmp_path / "loss.png")])
    assert stopped.value.code == 2
    assert capsys.readouterr().err == 'error: the loss plot needs matplotlib, an optional extra: pip install -e ".[plot]"\n'
    assert not (tmp_path / "loss.png").exists()


def every_data_parallel_wrapper() -> dict:
    """One of each data-parallel wrapper of the suite, on 2 real ranks: is each a DataParallelModel?"""
    data_parallel, expert_parallel = load_lesson("01_data_parallel"), load_lesson("05_expert_parallel")
    zero, full_5d = load_lesson("06_zero"), load_lesson("07_full_5d")
    grid = ProcessGrid(GridShape(dp=2), ep=2)
    cpu, cfg = torch.device("cpu"), get_config("tiny")
    wrappers = {mode: data_parallel.wrap_data_parallel(GPT(cfg), grid.dp_group, mode, 2**20)
                for mode in ("naive", "bucketed")}
    wrappers["experts"] = expert_parallel.build_model(get_config("tiny-moe"), 0, grid, cpu,
                                                      expert_parallel.looped_experts, 4)
    wrappers.update({f"ZeRO-{stage}": zero.wrap_zero(GPT(cfg), grid.dp_group, stage) for stage in range(4)})
    wrappers["pipeline chunk"] = full_5d.PipelineChunk(wrappers["ZeRO-1"], wrappers["ZeRO-1"].module)
    wrappers["a bare GPT"] = GPT(cfg)
    return {name: isinstance(wrapper, train.DataParallelModel) for name, wrapper in wrappers.items()}


def test_every_data_parallel_wrapper_offers_one_interface():
    """The interface is declared once (train.DataParallelModel) and every wrapper the steps drive
    offers all of it, lesson 07's pipeline chunk included; a model that is not wrapped does not."""
    for offered in run_ranks(2, every_data_parallel_wrapper, timeout_s=120):
        assert offered.pop("a bare GPT") is False
        assert all(offered.values()), offered


def test_peaks_match_the_gpu_by_whole_words():
    """A GB200 is not a B200 (2.5 against 2.25 PFLOP/s dense bf16), a PCIe H100 not an SXM one."""
    from picotron_like.metrics import peak_flops_of_name
    assert [peak_flops_of_name(name) / 1e12 for name in
            ("NVIDIA H100 80GB HBM3", "NVIDIA H100 PCIe", "NVIDIA H200", "NVIDIA B200", "NVIDIA GB200",
             "NVIDIA B300 SXM6 AC", "NVIDIA GB300", "NVIDIA A100-SXM4-80GB")] == [989, 756, 989, 2250, 2500, 2250,
                                                                                  2500, 312]
    assert peak_flops_of_name("NVIDIA L4") is None


def test_throughput_leaves_out_the_warm_up_and_the_metered_step():
    """The step a lesson measures from inside (saved-tensor hooks, timers) runs slower: it stays out
    of tokens/s unless it is the only step after the warm-up."""
    from picotron_like.metrics import Throughput
    throughput = Throughput(warmup=1)
    for seconds, metered in ((9.0, False), (1.0, False), (1.0, False), (5.0, True)):
        throughput.record(100, seconds, metered)
    assert throughput.tokens_per_second == 100.0
    only_metered = Throughput(warmup=1)
    for seconds, metered in ((9.0, False), (4.0, True)):
        only_metered.record(100, seconds, metered)
    assert only_metered.tokens_per_second == 25.0


def test_the_first_step_says_how_long_the_start_took(loop_run):
    """One line after the first step: the seconds since the process started, counted from the
    kernel's start time (a process that waits before importing anything counts the wait)."""
    lines = [line for line in loop_run[0][0]["printed"].splitlines() if line.startswith("time to the first step")]
    assert len(lines) == 1 and 0 < float(lines[0].split(": ")[1].split()[0]) < 600, lines
    waited = subprocess.run([sys.executable, "-c", "import time; time.sleep(1.5); "
                             "from picotron_like.run_control import seconds_since_process_start as s; print(s())"],
                            capture_output=True, text=True, check=True, cwd=REPO_ROOT)
    assert 1.5 <= float(waited.stdout) < 60, waited.stdout


def test_a_fused_adamw_skips_a_non_finite_step_on_the_device_without_a_host_read():
    """Lesson 07's AdamW on CUDA is fused: optimizer_step hands it the non-finite flag as a tensor
    (found_inf, as GradScaler does), so clipping and the optimizer step read nothing to the host;
    the step still changes nothing (weights, moments, step count), and its flag, read after it,
    says skipped. The CPU has a fused AdamW too, which shows it here; a finite step then trains as
    usual, and the optimizer is left as it was given (no found_inf behind)."""
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1, fused=True)
    model(torch.ones(2, 4)).sum().backward()
    optimizer.step()        # moments and a step count to keep
    before = {key: value.clone() for key, value in snapshot(model, optimizer).items()}
    model(torch.ones(2, 4)).sum().backward()
    model.weight.grad[0, 0] = float("nan")
    with HostReads() as reads:
        norm = clip_grad_norm_(model.parameters(), 1.0)
        skipped = optimizer_step(optimizer, norm)
    assert reads.sites == [] and skipped.item() and not math.isfinite(norm.item())
    for key, value in snapshot(model, optimizer).items():
        assert torch.equal(value, before[key]), key
    optimizer.zero_grad()
    model(torch.ones(2, 4)).sum().backward()
    skipped = optimizer_step(optimizer, clip_grad_norm_(model.parameters(), 1.0))
    assert not skipped.item() and not torch.equal(model.weight, before["weight"])
    assert not hasattr(optimizer, "found_inf")


def lagged_loop(metrics_path: str) -> dict:
    """Lesson 01 at dp 2 through the shared loop, AdamW fused as lesson 07's on CUDA (the CPU has one
    too), with an extra value for the line (the loss again, a tensor as the balancing losses are).
    Around each step: the host reads seen so far and the step lines printed so far. Then the same
    steps on a second copy of the model outside the loop, each read as soon as it returns."""
    train.adamw_implementation = lambda device: {"fused": True}
    lesson = load_lesson("01_data_parallel")
    grid = ProcessGrid(GridShape(dp=2))
    settings = train.StepSettings(torch.device("cpu"))
    batches = TokenBatches(builtin_corpus_paths()[0], LOOP_SHAPE, seed=3, vocab_size=LOOP_CFG.vocab_size)
    printed, reads, marks = io.StringIO(), HostReads(), []

    def model_and_optimizer():
        model = lesson.wrap_data_parallel(GPT(LOOP_CFG, seed=3), grid.dp_group, "bucketed", 64 * 1024)
        return model, build_optimizer(model.module, 3e-3)

    def mark() -> tuple[int, int]:
        return len(reads.sites), sum("| loss" in line for line in printed.getvalue().splitlines())

    def step_fn(batch):
        marks.append(mark())
        result = lesson.train_step(*looped, batch, settings)
        marks.append(mark())
        return result.with_extra({"again": result.values["loss"]})

    looped = model_and_optimizer()
    args = argparse.Namespace(steps=LOOP_STEPS, lr=3e-3, warmup_steps=1, metrics=metrics_path)
    with contextlib.redirect_stdout(printed), reads:
        train.train(args, looped[1], step_fn, train.RankBatches(batches, grid.dp_rank, torch.device("cpu")))
    marks.append(mark())
    model, optimizer = model_and_optimizer()
    unlagged = []
    for step in range(LOOP_STEPS):
        train.set_learning_rate(optimizer, learning_rate(step, 3e-3, 1, LOOP_STEPS))
        result = lesson.train_step(model, optimizer, batches.step_batch(step, grid.dp_rank), settings)
        unlagged.append((result.loss, result.grad_norm))
    return dict(sites=reads.sites, marks=marks, printed=printed.getvalue(), unlagged=unlagged)


def test_the_loop_reads_a_steps_figures_a_step_late_and_prints_the_same_lines(tmp_path):
    """The loop makes no host read while a step of its own is queued but the lagged read of the
    step before (one, all its figures at once), so on a GPU the host queues step N+1 while the
    device computes step N; step N's line is printed once step N+1 is queued, and the last one at
    the end. The lines and the metrics records are those of each step read at once: same steps,
    same values (the loss, the norm, the extra value), in the same order."""
    results = run_ranks(2, lagged_loop, str(tmp_path / "metrics.jsonl"))
    lagged_read = ("tolist", "run_control.py:read")
    # AgreedStop's flag and the budget's forecast, read at once: a CPU tensor that gloo carries, no device wait
    agreement = ("tolist", "run_control.py:_wait")
    for rank, result in enumerate(results):
        sites, marks = result["sites"], result["marks"]
        reads_at = [count for count, _ in marks]
        for step in range(LOOP_STEPS):
            assert sites[reads_at[2 * step]:reads_at[2 * step + 1]] == [], (rank, step)     # inside the step
            between = sites[reads_at[2 * step + 1]:reads_at[2 * step + 2]]                 # the loop after it
            # step 0: nothing before it to read, no agreement started yet; the last step's line is
            # printed at the end, and the agreement it started is waited for as the loop ends
            expected = [] if step == 0 else [lagged_read, agreement]
            assert between == expected + ([lagged_read, agreement] if step == LOOP_STEPS - 1 else []), (rank, step)
        if rank == 0:       # rank 0 prints: when step N starts, the lines of steps 0 .. N-2 are out
            assert [lines for _, lines in marks[0::2]] == [max(0, step - 1) for step in range(LOOP_STEPS)] + [4]
    lines = [line for line in results[0]["printed"].splitlines() if "| loss" in line]
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    for step, (line, record, (loss, norm)) in enumerate(zip(lines, records, results[0]["unlagged"], strict=True)):
        lr = learning_rate(step, 3e-3, 1, LOOP_STEPS)
        assert line.startswith(f"step {step:>4} | loss {loss:.4f} | grad norm {norm:7.3f} | lr {lr:.2e} | "
                               f"again {loss:.4g} | "), line
        assert (record["step"], record["loss"], record["grad_norm"], record["again"]) == (step, loss, norm, loss)
    assert results[1]["printed"] == "" and results[1]["unlagged"] == results[0]["unlagged"]
