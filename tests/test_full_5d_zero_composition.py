"""ZeRO with every other axis, through lesson 07's composition: tp, cp, pp and experts, each against
one device or the technique's own lesson on the same ranks (experts with ZeRO and a third axis:
tests/test_full_5d_expert_composition.py).

These proofs lived in lesson 06's tests while lesson 06 composed the other lessons; since 07 is the
only lesson that composes, they build the model with 07's parallelize() and step it with 07's
composed train_step (tests/test_zero.py's zero_run does that for every layout but data parallelism
alone). Tolerances are lesson 06's (tests/test_zero.py).
"""

from __future__ import annotations

import re
from dataclasses import replace

import pytest
import torch

from picotron_like.lessons import load_lesson
from picotron_like.model import GPT
from picotron_like.testing import SEQUENCES_CHECKED, run_ranks
from picotron_like.topology import GridShape, ProcessGrid
from picotron_like.train import StepSettings, build_optimizer
from test_zero import (ADAM_EPS, BF16, BF16_ROUNDING, CFG, CPU, LR, MAX_GRAD_NORM, MOE_CFG, PARAM_TOLERANCE, SEED,
                       SEQ, STEPS, TOLERANCE, assert_equal, assert_formulas, assert_overlap_changes_only_the_timing,
                       batches, bf16_reference, parameter_change_error, reference, relative_error, zero_run)

__all__ = ["reference"]     # the one-device fixture, shared with lesson 06's tests


def tensor_parallel_baseline(grid) -> dict:
    """Lessons 02 + 01 on the same grid: the tensor-parallel shards this rank holds, trained with
    the all-reduce (their equality to one device is lesson 02's proof)."""
    data_parallel, tensor_parallel = load_lesson("01_data_parallel"), load_lesson("02_tensor_parallel")
    module = tensor_parallel.apply_tensor_parallel(GPT(CFG, seed=SEED), grid.tp_group, False)
    model = data_parallel.wrap_data_parallel(module, grid.dp_group, "bucketed", 2**20)
    optimizer = build_optimizer(module, LR)
    for group in optimizer.param_groups:
        group["eps"] = ADAM_EPS
    seen = {}
    optimizer.register_step_pre_hook(
        lambda *_: seen.setdefault("clipped_grads", {n: p.grad.clone() for n, p in module.named_parameters()}) and None)
    settings = StepSettings(CPU, max_grad_norm=MAX_GRAD_NORM, norm_groups=(grid.tp_group,),
                            counts_toward_norm=tensor_parallel.tp_counts_toward_norm(grid.tp_group))
    data = batches(grid.dp_size)
    results = [data_parallel.train_step(model, optimizer, data.step_batch(step, grid.dp_rank), settings)
               for step in range(STEPS)]
    return {"losses": [r.loss for r in results], "norms": [r.grad_norm for r in results],
            "clipped_grads": seen["clipped_grads"],
            "params": {n: p.detach().clone() for n, p in module.named_parameters()}}


def expert_parallel_baseline(grid) -> dict:
    """Lesson 05 on the same ranks: ExpertDataParallel (dense gradients summed over dp, experts over
    edp) with looped experts, as lesson 05's main builds it; its equality to one device is lesson
    05's proof."""
    expert_parallel = load_lesson("05_expert_parallel")
    data = batches(grid.dp_size)
    model = expert_parallel.build_model(MOE_CFG, SEED, grid, CPU, expert_parallel.looped_experts,
                                        data.shape.sequences_per_step)
    optimizer = build_optimizer(model.module, LR)
    for group in optimizer.param_groups:
        group["eps"] = ADAM_EPS
    seen = {}
    optimizer.register_step_pre_hook(lambda *_: seen.setdefault(
        "clipped_grads", {n: p.grad.clone() for n, p in model.module.named_parameters()}) and None)
    settings = expert_parallel.step_settings(model, grid, CPU, torch.float32, MAX_GRAD_NORM)
    results = [expert_parallel.train_step(model, optimizer, data.step_batch(step, grid.dp_rank), settings)
               for step in range(STEPS)]
    return {"losses": [r.loss for r in results], "norms": [r.grad_norm for r in results],
            "clipped_grads": seen["clipped_grads"],
            "params": {n: p.detach().clone() for n, p in model.module.named_parameters()}}


# lesson 07's ZeRO-2/3 under a pipeline (PipelinedZeroStage2/3), pp 2 x dp 2 over three micro-batches:
# name: (ZeRO stage, --reshard-after-forward, --schedule, more flags); interleaved, uneven and with experts
# elsewhere
PIPELINED = {"pp ZeRO-2 1f1b": (2, True, "1f1b"), "pp ZeRO-2 zero-bubble": (2, True, "zero-bubble"),
             "pp ZeRO-3 afab": (3, True, "afab"), "pp ZeRO-3 1f1b": (3, True, "1f1b"),
             "pp ZeRO-3 zero-bubble": (3, True, "zero-bubble"), "pp ZeRO-3 kept afab": (3, False, "afab"),
             "pp ZeRO-3 kept zero-bubble": (3, False, "zero-bubble"),
             "pp ZeRO-3 1f1b optimizer offloaded": (3, True, "1f1b", "--offload", "optimizer")}


def composed():
    tp_grid, cp_grid = ProcessGrid(GridShape(dp=2, tp=2)), ProcessGrid(GridShape(dp=2, cp=2))
    ep_grid, pp_grid = ProcessGrid(GridShape(dp=4), ep=2), ProcessGrid(GridShape(dp=2, pp=2))
    runs = {"tp baseline": tensor_parallel_baseline(tp_grid), "ep baseline": expert_parallel_baseline(ep_grid)}
    for stage in (0, 1):
        runs[f"pp stage {stage}"] = zero_run(pp_grid.shape, stage, grid=pp_grid)
    for name, (stage, reshard, schedule, *flags) in PIPELINED.items():
        runs[name] = zero_run(pp_grid.shape, stage, reshard, grid=pp_grid, flags=("--schedule", schedule, *flags))
    runs["pp bf16 stage 1"] = zero_run(pp_grid.shape, 1, precision=BF16, grid=pp_grid)
    runs["pp stage 1 no overlap"] = zero_run(pp_grid.shape, 1, grid=pp_grid, overlap=False)
    for stage in (1, 2, 3):
        runs[f"tp stage {stage}"] = zero_run(tp_grid.shape, stage, grid=tp_grid)
        runs[f"cp stage {stage}"] = zero_run(cp_grid.shape, stage, grid=cp_grid)
    for stage in (0, 1, 2, 3):
        runs[f"ep stage {stage}"] = zero_run(ep_grid.shape, stage, grid=ep_grid, cfg=MOE_CFG)
    return runs


def assert_equal_to_baseline(run: dict, baseline: dict, where: str) -> None:
    for key in ("losses", "norms"):
        torch.testing.assert_close(torch.tensor(run[key]), torch.tensor(baseline[key]), rtol=0, atol=1e-5, msg=where)
    for name, grad in baseline["clipped_grads"].items():
        torch.testing.assert_close(run["clipped_grads"][name], grad, **TOLERANCE, msg=f"{where} {name}")
    for name, param in baseline["params"].items():
        torch.testing.assert_close(run["params"][name], param, **PARAM_TOLERANCE, msg=f"{where} {name}")


def test_composes_with_tensor_context_pipeline_and_expert_parallelism(reference):
    """dp 2 x tp 2: ZeRO shards each tensor-parallel shard over dp (the norm from the shards adds the tp
    group and counts replicated gains once), equal to lessons 02 + 01 on the same ranks; dp 2 x cp 2:
    ZeRO over the four dp x cp ranks, equal to one device; pp 2 x dp 2: lesson 03's 1F1B over three
    micro-batches, each stage's optimizer states sharded over its dp ranks (ZeRO-1; stage 0 too),
    equal to one device, and in bf16 to the one-device bf16 regime, its weight all-gathers overlapped
    with the next forward equal to them waited for in the step; and at ZeRO-2 and ZeRO-3 (resharded
    or kept gathered) under AFAB, 1F1B and zero-bubble, each unit reduce-scattered once per step and
    gathered 2 m times or once, equal to one device; dp 4 with ep 2 (tiny-moe): dense
    units sharded over dp, expert units over edp = 2 (at ZeRO-0 each all-reduced whole over its
    group, the norm summing the experts' squares over ep), equal to lesson 05 on the same ranks (the same
    routing, so no teacher forcing is needed: lesson 05's tests prove it equal to one device).
    Formulas byte for byte in all of them. Experts with ZeRO and each other axis together (cp with
    ZeRO-3, tp with ZeRO-2, pp with ZeRO-1) are tests/test_full_5d_expert_composition.py's."""
    bf16 = bf16_reference(torch.bfloat16)
    covered = {stage: set() for stage in (0, 1)}     # parameter names over both pipeline stages
    for rank, runs in enumerate(run_ranks(4, composed, timeout_s=300, checks=SEQUENCES_CHECKED)):
        for stage in (0, 1):
            run, where = runs[f"pp stage {stage}"], f"rank={rank} pp stage {stage}"
            assert ("isend", "pp") in run["traffic"], "the stages must run lesson 03's schedule"
            assert_equal(run, reference, where, names=run["params"])
            assert_formulas(run, where)
            covered[stage] |= set(run["params"])
        for name, (stage, reshard, *_) in PIPELINED.items():
            run, where = runs[name], f"rank={rank} {name}"
            assert_equal(run, reference, where, names=run["params"])
            if "offloaded" in name:     # its host-side states are 06_zero_offload's tests'; its collectives ZeRO-3's
                assert run["traffic"] == runs["pp ZeRO-3 1f1b"]["traffic"], where
            else:
                assert_formulas(run, where)
            gathers = run["traffic"][("all_gather_single", "dp_cp")]
            # resharded, ZeRO-3 gathers each unit 2 m = 6 times per step; kept gathered, and ZeRO-2, once
            assert gathers == (6 if stage == 3 and reshard else 1) * runs["pp stage 1"]["traffic"][
                ("all_gather_single", "dp_cp")], where
            assert run["traffic"][("reduce_scatter_single", "dp_cp")] == runs["pp stage 1"]["traffic"][
                ("reduce_scatter_single", "dp_cp")], where
        assert_overlap_changes_only_the_timing(runs["pp stage 1"], runs["pp stage 1 no overlap"], f"rank={rank} pp")
        run, where = runs["pp bf16 stage 1"], f"rank={rank} pp bf16 stage 1"
        expected = {key: {name: bf16[key][name] for name in run["params"]} for key in ("grads", "params")}
        assert relative_error(run["grads"], expected["grads"]) < 2 * BF16_ROUNDING, where
        torch.testing.assert_close(torch.tensor(run["losses"]), torch.tensor(bf16["losses"]),
                                   rtol=BF16_ROUNDING, atol=0, msg=where)
        assert parameter_change_error(run["params"], expected["params"]) < 4 * BF16_ROUNDING, where
        assert_formulas(run, where)
        for stage in (1, 2, 3):
            where = f"rank={rank} stage {stage}"
            assert_equal(runs[f"cp stage {stage}"], reference, f"{where} cp")
            assert_formulas(runs[f"cp stage {stage}"], f"{where} cp")
            assert_formulas(runs[f"tp stage {stage}"], f"{where} tp")
            torch.testing.assert_close(torch.tensor(runs[f"tp stage {stage}"]["losses"]),
                                       torch.tensor(reference["losses"]), rtol=0, atol=1e-5)
            assert_equal_to_baseline(runs[f"tp stage {stage}"], runs["tp baseline"], f"{where} tp")
        for stage in (0, 1, 2, 3):
            ep_run, where = runs[f"ep stage {stage}"], f"rank={rank} stage {stage}"
            assert any(key[1] == "edp" for key in ep_run["traffic"]), "the experts must be reduced over edp"
            assert_formulas(ep_run, f"{where} ep")
            assert_equal_to_baseline(ep_run, runs["ep baseline"], f"{where} ep")
    assert all(names == set(reference["params"]) for names in covered.values()), "the stages hold every parameter"


@pytest.mark.parametrize("cfg, grid, stage, ep, extra, message", [
    (MOE_CFG, GridShape(dp=4), 1, 3, [], "--ep 3 does not divide dp*cp = 4*1 = 4"),
    (CFG, GridShape(dp=2), 1, 2, [], "--ep 2 with a dense preset"),
    (MOE_CFG, GridShape(dp=2, tp=2), 1, 2, ["--sequence-parallel"], "--sequence-parallel with experts"),
    (MOE_CFG, GridShape(dp=2, cp=2), 1, 2, ["--capacity-factor", "1.25"], "--capacity-factor with --cp 2"),
    # lesson 02's even splits, which 07 checks itself with experts (lesson 02 refuses MoE models)
    (replace(MOE_CFG, ffn_hidden=66), GridShape(dp=2, tp=4), 1, 2, [], "ffn_hidden=66 is not divisible by --tp 4"),
])
def test_expert_configurations_refused_in_one_line(cfg, grid, stage, ep, extra, message):
    """What ZeRO does not compose with experts, what 07 does not compose of experts
    with tp and cp, and lessons 05's and 02's own rules, in lesson 07's checks before any process group."""
    full_5d = load_lesson("07_full_5d")
    args = full_5d.parse_args(["--dp", str(grid.dp), "--pp", str(grid.pp), "--tp", str(grid.tp), "--cp", str(grid.cp),
                               "--zero-stage", str(stage), "--ep", str(ep), "--seq-len", str(SEQ), *extra])
    cfg = full_5d.expert_parallel.moe_config(cfg, args) if cfg.n_experts else cfg
    shape = full_5d.batch_shape(args, grid.dp)
    with pytest.raises(Exception, match=re.escape(message)):
        full_5d.validate(cfg, grid, shape, args, grid.world_size)
