"""Lesson 03's zero-bubble schedule through lesson 07's composition, on 8 gloo ranks in one spawn.

dp2 x pp2 x tp2 under ZeRO-1, on the masked batch, three layers over two stages (2 + 1): equal to
one device (losses, gradients before and after clipping, parameters after three AdamW steps, with
clipping acting at every step), every row of the traffic table equal to its formula, and every
collective called exactly as often as the same layout under 1F1B: B and W together run each
backward collective once (tp's f and g stay in B, W has none), and ZeRO reduces each unit once.
The layout gives B's and W's of different micro-batches to the last stage in turn (B0 B1 W0 ...),
where a block whose norm gains reported their gradient in B and its linears in W would start
ZeRO's reduction before its last W (the test fails so if 07 leaves the norms' gains to B). The same
layout under Muon (--optimizer muon), which steps after the schedule's last W as AdamW does: equal
to one device's Muon, stepped with its gradients (test_full_5d.replay), its collectives as 1F1B's.

Experts, cp and tp at once: pp2 x cp2 x tp2 with an MoE (ep2 over dp x cp) under zero-bubble equals
the same run under 1F1B (tests/test_full_5d_expert_composition.py proves that one equal to one
device) to the same tolerances, with the same collective counts.

FP8 (07_fp8.py): pp2 x tp2 under ZeRO-1, three layers (2 + 1), with each recipe, and pp2 x cp2
with rowwise (whose dY scales along the tokens take their amax over cp), under zero-bubble equal
the same layout under 1F1B bit for bit: B runs the undivided FP8 backward's quantisations, dX and
amax all-reduces, W its dW matmul on the FP8 copies B left, each call the same as in 1F1B's one
backward. Every collective is called as often as under 1F1B, the traffic table equals its
formula, and autograd's kept bytes peak as under 1F1B. The control: a W that quantises dY along
the tokens anew, with scales of 1, from the values B's copy stands for, gives other gradients.

What does not compose (sequence parallelism, recomputation, --compile, a single stage) is refused
in one line before any process group.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import replace

import pytest
import torch

from picotron_like.lessons import REPO_ROOT, load_lesson
from picotron_like.testing import run_ranks
from picotron_like.topology import ConfigError, GridShape, ProcessGrid
from picotron_like.train import checked_plan
from test_context_parallel import CFG, SEQ, mask_targets
from test_full_5d import AUX, MOE_CFG, MUON, run
from test_full_5d_composition import assert_equal_to_one_device, tp_shard
from test_full_5d_context_composition import reference
from test_fp8 import CFG as FP8_CFG
from test_zero import PARAM_TOLERANCE, TOLERANCE

CFG3 = replace(CFG, n_layers=3)
MOE_CFG3 = replace(MOE_CFG, n_layers=3)
DENSE_GRID, MOE_GRID = GridShape(dp=2, pp=2, tp=2), GridShape(pp=2, cp=2, tp=2)


def every_run(replayed: list[dict]) -> dict:
    runs = {}
    for schedule in ("1f1b", "zero-bubble"):
        runs[f"dense {schedule}"] = run(ProcessGrid(DENSE_GRID), 1, "none", CFG3, ("--schedule", schedule), SEQ,
                                        mask_targets)
        runs[f"muon {schedule}"] = run(ProcessGrid(DENSE_GRID), 1, "none", CFG3, ("--schedule", schedule, *MUON),
                                       SEQ, mask_targets, replayed)
        runs[f"moe {schedule}"] = run(ProcessGrid(MOE_GRID, ep=2), 1, "none", MOE_CFG3,
                                      (*AUX, "--schedule", schedule))
    return runs


def test_zero_bubble_with_tp_cp_experts_and_zero_1_equals_one_device_and_1f1b():
    """Under AdamW, and under Muon (its step comes after the schedule's last W, as AdamW's: stepped
    with one device's gradients, test_full_5d.replay), equal to one device."""
    expected = {optimizer: reference(CFG3, SEQ, True, optimizer) for optimizer in ("adamw", "muon")}
    per_rank = run_ranks(8, every_run, expected["muon"]["every_clipped_grads"], timeout_s=300)
    for rank, runs in enumerate(per_rank):
        for name, optimizer in (("dense", "adamw"), ("muon", "muon")):
            zero_bubble, one_f_one_b, where = runs[f"{name} zero-bubble"], runs[f"{name} 1f1b"], f"rank={rank} {name}"
            assert_equal_to_one_device(zero_bubble, expected[optimizer], tp_shard(zero_bubble, DENSE_GRID.tp), where)
            table = zero_bubble["predicted_traffic"]
            assert {key: zero_bubble["traffic"].get(key, 0) for key in table} == table, where
            assert not set(zero_bubble["traffic"]) - set(table), where
            assert zero_bubble["calls"] == one_f_one_b["calls"], \
                f"{where}: {zero_bubble['calls']} {one_f_one_b['calls']}"
            # what autograd saves peaks as under 1F1B (the W queue's share is lesson 03's test's)
            assert zero_bubble["kept"] == one_f_one_b["kept"], where

        zero_bubble, one_f_one_b, where = runs["moe zero-bubble"], runs["moe 1f1b"], f"rank={rank} moe"
        assert zero_bubble["calls"] == one_f_one_b["calls"], where
        torch.testing.assert_close(torch.tensor(zero_bubble["losses"]), torch.tensor(one_f_one_b["losses"]),
                                   rtol=0, atol=1e-5, msg=where)
        for key in ("grads", "clipped_grads"):
            for name, grad in zero_bubble[key].items():
                torch.testing.assert_close(grad, one_f_one_b[key][name], **TOLERANCE, msg=f"{where} {key} {name}")
        for name, value in zero_bubble["params"].items():
            torch.testing.assert_close(value, one_f_one_b["params"][name], **PARAM_TOLERANCE, msg=f"{where} {name}")


# every width a matmul sums over a multiple of mxfp8's 32 per tp rank (test_fp8's model), three layers
FP8_CFG3 = replace(FP8_CFG, n_layers=3)
FP8_LAYOUTS = {**{recipe: (GridShape(pp=2, tp=2), recipe) for recipe in ("tensorwise", "rowwise", "mxfp8")},
               "rowwise pp2 x cp2": (GridShape(pp=2, cp=2), "rowwise")}


def unit_scaled_weight_gradient(weight_gradient) -> list:
    """The control's W: dY quantised along the tokens anew, with every scale 1, from the values
    B's FP8 copy stands for (B's scales are what makes dW the undivided backward's)."""
    fp8 = load_lesson("07_fp8")
    unscaled = replace(weight_gradient.recipe, scaled=False)
    grad_output = fp8.quantise(weight_gradient.grad_output_tokens.dequantise(), 0,
                               weight_gradient.recipe.gradient_format, unscaled)
    return [(weight_gradient.weight, fp8.fp8_weight_gradient(grad_output, weight_gradient.input_tokens, unscaled,
                                                             weight_gradient.weight.dtype))]


def every_fp8_run() -> dict:
    runs = {}
    for name, (shape, recipe) in FP8_LAYOUTS.items():
        for schedule in ("1f1b", "zero-bubble"):
            runs[f"{name} {schedule}"] = run(ProcessGrid(shape), 1, "none", FP8_CFG3,
                                             ("--schedule", schedule, "--fp8", recipe))
    fp8_weight_gradient = load_lesson("07_fp8").Fp8WeightGradient
    original, fp8_weight_gradient.compute = fp8_weight_gradient.compute, unit_scaled_weight_gradient
    try:
        runs["control"] = run(ProcessGrid(FP8_LAYOUTS["rowwise"][0]), 1, "none", FP8_CFG3,
                              ("--schedule", "zero-bubble", "--fp8", "rowwise"))
    finally:
        fp8_weight_gradient.compute = original
    return runs


def test_zero_bubble_with_fp8_equals_1f1b_bit_for_bit_with_its_collectives():
    full_5d, memory_plan = load_lesson("07_full_5d"), load_lesson("07_memory_plan")
    for name, (shape, recipe) in FP8_LAYOUTS.items():
        planned = {}
        for schedule in ("1f1b", "zero-bubble"):
            args = full_5d.parse_args(["--pp", "2", "--tp", str(shape.tp), "--cp", str(shape.cp), "--zero-stage", "1",
                                       "--schedule", schedule, "--fp8", recipe, "--seq-len", str(SEQ)])
            full_5d.validate(FP8_CFG3, shape, full_5d.batch_shape(args, 1), args, shape.world_size)   # passes
            planned[schedule] = memory_plan.planned_memory(FP8_CFG3, args, shape, 1, full_5d.batch_shape(args, 1),
                                                           full_5d.zero.Precision(), 0, memory_plan.plan_device(args))
        # ZB-H1's first stage holds as many micro-batches as 1F1B's: the plan says so for zero-bubble too
        assert planned["zero-bubble"] == planned["1f1b"], name
    for rank, runs in enumerate(run_ranks(4, every_fp8_run, timeout_s=300)):
        for name in FP8_LAYOUTS:
            zero_bubble, one_f_one_b, where = runs[f"{name} zero-bubble"], runs[f"{name} 1f1b"], f"rank={rank} {name}"
            assert zero_bubble["losses"] == one_f_one_b["losses"], where
            for key in ("grads", "clipped_grads", "params"):
                for param, value in zero_bubble[key].items():
                    assert torch.equal(value, one_f_one_b[key][param]), f"{where} {key} {param}"
            assert zero_bubble["calls"] == one_f_one_b["calls"], f"{where}: {zero_bubble['calls']} {one_f_one_b['calls']}"
            table = zero_bubble["predicted_traffic"]
            assert zero_bubble["traffic"] == table, where
            assert zero_bubble["kept"] == one_f_one_b["kept"], where
        control, one_f_one_b = runs["control"], runs["rowwise 1f1b"]
        assert control["losses"][0] == one_f_one_b["losses"][0]       # the forwards are the same
        worst = max((grad - one_f_one_b["grads"][param]).abs().max().item() for param, grad in control["grads"].items())
        assert worst > 1e3 * TOLERANCE["atol"], f"rank={rank} control: {worst}"


@pytest.mark.parametrize("argv, message", [
    (["--tp", "2", "--sequence-parallel"], "--sequence-parallel with --schedule zero-bubble"),
    (["--recompute", "full"], "--recompute full with --schedule zero-bubble"),
    (["--recompute", "selective"], "--recompute selective with --schedule zero-bubble"),
    (["--compile"], "--compile with --schedule zero-bubble"),
    (["--pp", "1", "--dp", "8"], "--schedule zero-bubble with --pp 1"),
])
def test_what_zero_bubble_does_not_compose_with_is_refused_in_one_line(argv, message):
    """Before any process group, as plan_run checks a command line; and as a user sees it: one
    `error:` line and exit code 2 from the script itself."""
    full_5d = load_lesson("07_full_5d")
    argv = ["--pp", "2", "--dp", "2", "--zero-stage", "1", "--schedule", "zero-bubble", *argv]
    with pytest.raises(ConfigError, match=re.escape(message)):
        checked_plan(full_5d.parse_args(argv), full_5d.validate, full_5d.expert_parallel.moe_config, 8)
    if argv[-1] == "--compile":
        process = subprocess.run([sys.executable, str(REPO_ROOT / "07_full_5d.py"), *argv], capture_output=True,
                                 text=True, env=dict(os.environ, WORLD_SIZE="8"), cwd=REPO_ROOT, timeout=120)
        assert process.returncode == 2 and process.stderr.startswith("error: ") and message in process.stderr, \
            process.stdout + process.stderr


@pytest.mark.parametrize("argv, source", [
    (["--grad-accum", "3"], "(--grad-accum)"),
    (["--global-batch-tokens", "3072", "--seq-len", "256", "--micro-batch-size", "4"],
     "(--global-batch-tokens 3072 / (4 sequences x 256 tokens x dp 1))"),
])
def test_a_pipelines_micro_batch_count_is_refused_by_lesson_07s_own_flags(argv, source):
    """Lesson 03's rule on the micro-batch count, in 07's words: 07 has no --micro-batches."""
    full_5d = load_lesson("07_full_5d")
    argv = ["--pp", "4", "--schedule", "interleaved", "--n-layers", "8", *argv]
    with pytest.raises(ConfigError, match=re.escape(f"m = 3 micro-batches {source} is fewer than --pp 4")):
        checked_plan(full_5d.parse_args(argv), full_5d.validate, full_5d.expert_parallel.moe_config, 4)
