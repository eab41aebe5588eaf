"""Lesson 07's memory plan (07_memory_plan.py) proven: equal to what a rank holds, component by component.

Small scale, on 4 gloo ranks: six layouts (one interleaved) built by 07's own parallelize() from its own flags
train two steps; the plan's parameters, gradients, master weights and Adam states equal the bytes
of the tensors each rank holds (lesson 06's measured_model_states, after a step: Adam's moments
exist then), its activations the bytes autograd keeps at their peak (ActivationMeter), ZeRO-3's
prefetch window the gathered weights at their peak. The first steps' rows show Adam's states
appearing inside the first optimizer step, and nowhere else.

Real scale, without the hardware: the 8b preset on 8 and 64 GPUs (also with 3 interleaved chunks
per pipeline rank) and Mixtral-8x7B on 64, each rank's share built by lesson 06's build_model on
the meta device from the plan's LaidOutGrid, which knows only its rank (no process group, no
tensor drawn), one meta AdamW step for the optimizer's states;
its model-state bytes equal the plan's for the chosen ranks (first and last pipeline stages).

Every comparison is of integers, exactly: a byte off is a wrong formula.
"""

from __future__ import annotations

import os
import subprocess
import sys
from contextlib import nullcontext
from dataclasses import replace
from functools import partial

import pytest
import torch

import picotron_like.materialise as materialise
from picotron_like.data import BatchShape, TokenBatches, builtin_corpus_paths
from picotron_like.lessons import REPO_ROOT, load_lesson
from picotron_like.metrics import ActivationMeter, GatheredParameterMeter, SavedTensorMeters
from picotron_like.published_profiles import published_profile
from picotron_like.model import get_config
from picotron_like.testing import run_ranks
from picotron_like import comm
from picotron_like.topology import GridShape, ProcessGrid, group_rank

CFG = replace(get_config("tiny"), n_layers=2, hidden=64, n_heads=4, n_kv_heads=2, ffn_hidden=128)
MOE_CFG = replace(get_config("tiny-moe"), n_layers=2, hidden=64, n_heads=4, n_kv_heads=2, ffn_hidden=64)
SEQ, MICRO, GLOBAL_SEQUENCES, LR, SEED = 32, 2, 8, 3e-3, 7
CPU = torch.device("cpu")
STATES = ("parameters", "gradients", "master weights (fp32)", "optimizer states")
# name: (grid, ep, model, flags)
LAYOUTS = {
    "dp2 x tp2 SP ZeRO-1 selective": (GridShape(dp=2, tp=2), 1, CFG,
                                      ("--zero-stage", "1", "--recompute", "selective", "--sequence-parallel")),
    "pp2 x dp2 ZeRO-1 none": (GridShape(dp=2, pp=2), 1, CFG, ("--zero-stage", "1", "--recompute", "none")),
    "dp4 ZeRO-3 full": (GridShape(dp=4), 1, CFG, ("--zero-stage", "3", "--recompute", "full")),
    "dp2 x cp2 ZeRO-2 bf16 none": (GridShape(dp=2, cp=2), 1, CFG,
                                   ("--zero-stage", "2", "--recompute", "none", "--dtype", "bfloat16")),
    "moe dp2 x cp2 ep2 ZeRO-1 full": (GridShape(dp=2, cp=2), 2, MOE_CFG, ("--zero-stage", "1", "--recompute", "full")),
    "pp2 x dp2 interleaved ZeRO-1 selective": (GridShape(dp=2, pp=2), 1, replace(CFG, n_layers=4),
                                               ("--zero-stage", "1", "--recompute", "selective", "--schedule",
                                                "interleaved", "--virtual-stages", "2")),
    # Muon: one float32 momentum per element of the matrices this rank's shards hold, AdamW's two for the rest
    "dp2 x tp2 ZeRO-2 muon": (GridShape(dp=2, tp=2), 1, CFG, ("--zero-stage", "2", "--optimizer", "muon")),
    "moe dp2 x cp2 ep2 ZeRO-3 muon": (GridShape(dp=2, cp=2), 2, MOE_CFG,
                                      ("--zero-stage", "3", "--recompute", "none", "--optimizer", "muon")),
    # experts at ZeRO-0: every unit whole on each rank of its group (dense: dp x cp, experts: edp)
    "moe dp2 x tp2 ep2 ZeRO-0 full": (GridShape(dp=2, tp=2), 2, MOE_CFG, ("--zero-stage", "0", "--recompute", "full")),
    "moe dp2 x cp2 ep2 ZeRO-0 muon": (GridShape(dp=2, cp=2), 2, MOE_CFG,
                                      ("--zero-stage", "0", "--recompute", "full", "--optimizer", "muon")),
    # lesson 07's ZeRO-2/3 under a pipeline: gradients whole through the step; ZeRO-3 resharded within
    # a chunk, or every unit of the stage kept gathered
    "pp2 x dp2 ZeRO-2 none": (GridShape(dp=2, pp=2), 1, CFG, ("--zero-stage", "2", "--recompute", "none")),
    "pp2 x dp2 ZeRO-3 none": (GridShape(dp=2, pp=2), 1, replace(CFG, n_layers=3),
                              ("--zero-stage", "3", "--recompute", "none")),
    "pp2 x dp2 interleaved ZeRO-3 kept": (GridShape(dp=2, pp=2), 1, replace(CFG, n_layers=4),
                                          ("--zero-stage", "3", "--no-reshard-after-forward", "--schedule",
                                           "interleaved", "--virtual-stages", "2")),
}
# Live micro-batches at the peak on each pipeline rank, m = 2: 1F1B's first stage keeps both before
# its first backward, the last one; interleaved (v = 2), rank 0's warm-up runs all four (chunk,
# micro-batch) forwards, rank 1's two, then each forward comes with a backward: three at most.
LIVE = {"1f1b": (2, 1), "interleaved": (4, 3)}


def lesson():
    return load_lesson("07_full_5d")


def memory_plan():
    return load_lesson("07_memory_plan")


def layout_args(grid: GridShape, ep: int, flags) -> object:
    accum = GLOBAL_SEQUENCES // (MICRO * grid.dp)
    return lesson().parse_args(["--dp", str(grid.dp), "--tp", str(grid.tp), "--pp", str(grid.pp), "--cp", str(grid.cp),
                                "--ep", str(ep), "--seq-len", str(SEQ), "--micro-batch-size", str(MICRO),
                                "--grad-accum", str(accum), "--seed", str(SEED), "--lr", str(LR), *flags])


def by_state(planned: dict, args) -> dict:
    """The plan's rows, its optimizer's row (Adam's, or Muon's and Adam's) under STATES' name."""
    row = memory_plan().optimizer_states_row(args)
    return {(STATES[-1] if key == row else key): value for key, value in planned.items()}


class WholeGradientMeter:
    """The bytes of lesson 07's whole gradient buffers under a pipeline (GradientsReducedOncePerStep),
    the one whose reduction is in flight included, sampled at every tensor autograd saves and reads
    back, as GatheredParameterMeter samples the weights."""

    def __init__(self, model):
        self.model, self.peak_bytes = model, 0

    def pack(self, tensor):
        buffers = [unit.whole_grad for unit in self.model.units if unit.whole_grad is not None]
        if self.model._in_flight is not None:
            buffers.append(self.model._in_flight[3])
        self.peak_bytes = max(self.peak_bytes, sum(buffer.nbytes for buffer in buffers))
        return tensor

    unpack = pack


def measure(shape: GridShape, ep: int, cfg, flags) -> dict:
    """Two steps of the layout on this rank: its model states after them, its kept activations
    (or ZeRO-3's gathered weights) at their peak in the first, the first steps' rows, and the plan."""
    full_5d = lesson()
    zero = full_5d.zero
    grid, args = ProcessGrid(shape, ep=ep), layout_args(shape, ep, flags)
    model, pipeline = full_5d.parallelize(cfg, grid, args, CPU)
    optimizer = full_5d.build_optimizer(model, grid, args)
    first_steps = load_lesson("07_report").FirstStepsMemory(model, optimizer, CPU, n_steps=2)
    settings = full_5d.step_settings(grid, CPU, model.precision, 1.0)
    data = TokenBatches(builtin_corpus_paths()[0], BatchShape(MICRO, SEQ, args.grad_accum, shape.dp), seed=SEED,
                        vocab_size=cfg.vocab_size)
    cut = full_5d.context_parallel.sequence_cut(grid, args.zigzag) or (lambda batch: batch)
    meter = (GatheredParameterMeter if args.zero_stage == 3 else ActivationMeter)(model.module)
    whole = WholeGradientMeter(model)       # read only under a pipeline at ZeRO-2/3
    pipelined = shape.pp > 1 and args.zero_stage >= 2
    step = first_steps.observe(partial(full_5d.train_step, model if pipeline is None else pipeline, optimizer,
                                       settings=settings))
    comm.meter.reset()
    for index in range(2):
        with SavedTensorMeters(meter, *[whole] * pipelined) if index == 0 else nullcontext():
            step(cut(data.step_batch(index, grid.dp_rank)))
    states = zero.measured_model_states(model, optimizer)
    place = group_rank(grid.dp_cp_group)
    planned, live = memory_plan().planned_memory(cfg, args, shape, ep, data.shape, model.precision, grid.pp_rank,
                                                 memory_plan().plan_device(args), place)
    muon_traffic = (memory_plan().planned_muon_traffic(cfg, args, shape, ep, grid.pp_rank, place)
                    if args.optimizer == "muon" else {})
    return {"states": dict(zip(STATES, (states.parameters, states.gradients, states.master_weights,
                                        states.optimizer_states))),
            "meter": meter.peak_bytes, "whole gradients": whole.peak_bytes, "first_steps": first_steps.rows, "live": live,
            "planned": by_state(planned, args),
            "muon traffic": {key: comm.meter.traffic[key].payload_bytes for key in muon_traffic},
            "planned muon traffic": {key: 2 * value for key, value in muon_traffic.items()}}


def every_layout() -> dict:
    return {name: measure(*layout) for name, layout in LAYOUTS.items()}


def test_plan_equals_what_each_rank_holds_component_by_component():
    for rank, runs in enumerate(run_ranks(4, every_layout, timeout_s=300)):
        for name, (shape, _, _, flags) in LAYOUTS.items():
            run, where = runs[name], f"rank {rank}, {name}"
            planned = run["planned"]
            assert run["states"] == {key: planned[key] for key in STATES}, where
            if "ZeRO-3" in name:
                assert run["meter"] == planned["gathered weights (ZeRO-3)"] > 0, where
            else:
                assert run["meter"] == planned["activations"] > 0, where
                assert planned["gathered weights (ZeRO-3)"] == 0, where
            whole = planned.get(memory_plan().WHOLE_GRADIENTS, 0)
            assert (whole > 0) == (shape.pp > 1 and ("ZeRO-2" in name or "ZeRO-3" in name)), where
            # interleaved, a chunk's buffers may be freed before another's are taken: the plan's is a bound
            assert run["whole gradients"] == whole if "interleaved" not in name else run["whole gradients"] <= whole, \
                where
            schedule = "interleaved" if "interleaved" in name else "1f1b"
            assert run["live"] == (LIVE[schedule][shape.coords_of(rank)["pp"]] if shape.pp > 1 else 1), where
            phases = dict(run["first_steps"])
            assert phases["built"]["Adam"] == phases["step 0: before optimizer.step"]["Adam"] == 0, where
            for phase in ("step 0: after", "step 1: before optimizer.step", "step 1: after"):
                assert phases[phase]["Adam"] == planned["optimizer states"], f"{where} {phase}"
            assert run["muon traffic"] == run["planned muon traffic"], where
            assert ("muon" in name) == bool(run["planned muon traffic"]), where
            assert len({sample["parameters"] for sample in phases.values()}) == 1, where


# (preset, grid, ep, ZeRO stage, weights, gradients, ranks, virtual stages): the first and the last
# pipeline stage, and a rank inside every other axis.
REAL_SCALE = [
    ("8b", GridShape(dp=8), 1, 1, torch.bfloat16, torch.bfloat16, (5,), 1),
    ("8b", GridShape(dp=2, pp=2, tp=2), 1, 1, torch.bfloat16, torch.float32, (0, 7), 1),
    ("8b", GridShape(tp=8), 1, 0, torch.bfloat16, torch.bfloat16, (3,), 1),
    ("8b", GridShape(dp=8, tp=8), 1, 3, torch.bfloat16, torch.bfloat16, (13,), 1),
    ("8b", GridShape(dp=2, pp=4, cp=2, tp=4), 1, 1, torch.float32, torch.float32, (0, 63), 1),
    ("8b", GridShape(dp=2, pp=4), 1, 1, torch.bfloat16, torch.bfloat16, (0, 7), 3),    # 12 chunks of 32 layers
    ("mixtral-8x7b", GridShape(dp=32, tp=2), 8, 3, torch.bfloat16, torch.bfloat16, (5,), 1),
    ("mixtral-8x7b", GridShape(dp=4, pp=4, cp=2, tp=2), 8, 1, torch.bfloat16, torch.bfloat16, (1, 62), 1),
]


@pytest.mark.parametrize("preset, shape, ep, stage, weights, gradients, ranks, virtual_stages", REAL_SCALE,
                         ids=[f"{case[0]}-{case[1].world_size}gpus-{case[1]}-ZeRO{case[3]}-v{case[7]}"
                              for case in REAL_SCALE])
def test_plan_equals_the_sharded_model_built_on_the_meta_device(preset, shape, ep, stage, weights, gradients, ranks,
                                                                virtual_stages, monkeypatch):
    full_5d = lesson()
    # Only the model is measured: lesson 03's schedule, which needs real process groups to find
    # its neighbours, is not built on the plan's grids without process groups (LaidOutGrid).
    monkeypatch.setattr(full_5d, "build_pipeline", lambda *args, **kwargs: None)

    def drawn(name, *args):     # a full-size model built to be counted: no value may be drawn (8b: minutes)
        raise AssertionError(f"{name} drawn while building on the meta device")
    monkeypatch.setattr(materialise, "reference_init", drawn)
    zero = full_5d.zero
    cfg = get_config(preset)
    precision = zero.Precision(weights, gradients)
    dtypes = {torch.float32: "float32", torch.bfloat16: "bfloat16"}
    args = full_5d.parse_args(["--zero-stage", str(stage), "--seq-len", "4096", "--micro-batch-size", "1",
                               "--grad-accum", "1", "--virtual-stages", str(virtual_stages),
                               "--dtype", dtypes[weights], "--reduce-dtype", dtypes[gradients]])
    batch = BatchShape(1, 4096, 1, shape.dp)
    meta = torch.device("meta")
    for rank in ranks:
        grid = memory_plan().LaidOutGrid(shape, ep=ep, rank=rank)
        with meta:
            model = full_5d.parallelize(cfg, grid, args, meta)[0]
        optimizer = zero.build_sharded_optimizer(model, LR)
        # AdamW creates its moments at its first step, from the parameters it steps: one step on
        # meta gradients makes them, shaped as a real run's (every tensor here is shape only).
        masters = [master for group in optimizer.param_groups for master in group["params"]]
        for master in masters:
            master.grad = torch.zeros_like(master)
        optimizer.step()
        states = zero.measured_model_states(model, optimizer)
        planned = by_state(memory_plan().planned_memory(cfg, args, shape, ep, batch, precision, grid.pp_rank,
                                                        memory_plan().plan_device(args))[0], args)
        measured = dict(zip(STATES, (states.parameters, states.gradients, states.master_weights,
                                     states.optimizer_states)))
        assert measured == {key: planned[key] for key in STATES}, f"rank {rank} ({grid})"
        assert all(param.is_meta for param in model.parameters()), "nothing may be drawn at full size"


def test_on_a_gpu_the_plan_adds_the_allocators_reserve_on_what_a_step_allocates_and_frees():
    """The reserve is the GPU profile's share of every row but the model states (allocated once); a
    profile without one (a CPU's) plans the same rows without it."""
    full_5d, plan = lesson(), memory_plan()
    flags = ["--preset", "8b", "--gpus", "8", "--gpu", "H100", "--seq-len", "4096", "--micro-batch-size", "1",
             "--grad-accum", "8", "--zero-stage", "1", "--recompute", "selective"]
    precision = full_5d.zero.Precision(torch.bfloat16, torch.float32)
    planned = partial(plan.planned_memory, get_config("8b"), full_5d.parse_args(flags), GridShape(dp=8), 1,
                      BatchShape(1, 4096, 8, 8), precision, 0)
    gpu = published_profile("H100")
    memory, without = planned(gpu)[0], planned(replace(gpu, allocator_reserve=0.0))[0]
    reserve = memory.pop(plan.ALLOCATOR_RESERVE_ROW)
    assert memory == without
    states = sum(memory[row] for row in ("parameters", "gradients", "master weights (fp32)", "Adam states (fp32)"))
    assert reserve == round(gpu.allocator_reserve * (sum(memory.values()) - states)) > 0


def test_plan_prints_the_8b_preset_on_one_b300_node_and_refuses_a_bad_layout(capsys):
    full_5d = lesson()
    flags = ["--plan", "--preset", "8b", "--gpus", "8", "--gpu", "B300", "--seq-len", "8192",
             "--micro-batch-size", "1", "--grad-accum", "8", "--zero-stage", "1", "--plan-top", "3"]
    full_5d.main(flags)
    out = capsys.readouterr().out
    bf16_float32_grads = full_5d.zero.Precision(torch.bfloat16, torch.float32)     # --dtype's and --reduce-dtype's
    planned = memory_plan().plan_layout(get_config("8b"), full_5d.parse_args(flags), GridShape(dp=8), 1,
                                        BatchShape(1, 8192, 8, 8), bf16_float32_grads, published_profile("B300"))
    assert f"  {'total':<40}{planned.peak_bytes / 2**30:>8.2f}" in out
    assert "fits:" in out and "assumptions:" in out
    listed = out.split("fastest first")[1].splitlines()[2:5]
    assert len(listed) == 3 and all(line.startswith("  dp") for line in listed), out
    # Two nodes of H100: several ZeRO stages and recompute modes of one grid fit, and only the
    # fastest of each grid is listed, in order.
    full_5d.main(["--plan", "--preset", "8b", "--gpus", "16", "--gpu", "H100", "--gpus-per-node", "8", "--seq-len",
                  "8192", "--micro-batch-size", "1", "--grad-accum", "4", "--tp", "4", "--plan-top", "10"])
    listed = capsys.readouterr().out.split("fastest first")[1].splitlines()[2:12]
    step_seconds = [float(line.split()[-11]) for line in listed]
    names = [line[:26] for line in listed]
    assert step_seconds == sorted(step_seconds) and len(set(names)) == 10, listed
    bad = subprocess.run([sys.executable, str(REPO_ROOT / "07_full_5d.py"), "--plan", "--preset", "8b", "--gpus", "6",
                          "--tp", "4"], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert bad.returncode == 2 and bad.stderr.startswith("error:") and "world size is 6" in bad.stderr, bad.stderr


def test_the_plan_knows_each_gpu_it_plans_for():
    """The GPU's compute capability decides lesson 05's grouped matmul (bf16 on Hopper and newer):
    an A100 plan keeps the loop."""
    plan = memory_plan()
    experts = lesson().expert_parallel
    assert [experts.grouped_mm_fits(MOE_CFG, torch.bfloat16, torch.device("cuda"),
                                    plan.published_profile(gpu).capability)
            for gpu in ("A100-80GB", "H100", "B300")] == [False, True, True]
    assert [plan.published_profile(gpu).capability for gpu in plan.PUBLISHED_GPUS] == [
        plan.PUBLISHED_GPUS[gpu].capability for gpu in plan.PUBLISHED_GPUS]


def test_the_plan_counts_fp8_copies_fp8_gemms_and_the_amax_all_reduces(capsys):
    """--plan --fp8 (07_fp8.py's own formulas): the 1b preset on 2 GPUs at tp 2 keeps its blocks'
    matmul inputs as FP8 copies (kept_bytes_difference less than without, exactly), prices its
    blocks' GEMMs at the profile's float8 rate (and nothing else differently: the difference is
    exactly theirs) and adds tp's amax all-reduces to tp's time. Where the matmuls are emulated
    (an A100; mxfp8 before Blackwell) they count at the bf16 rate; mxfp8 on a B300 (the
    block-scaled kernel, 07_fp8.mx_kernel_runs) at the FP8 rate, as rowwise. All with
    --no-fp8-shape-rule: with the rule, this layer's shapes keep every group in bf16 on a GPU, and
    the plan is bf16's."""
    full_5d, plan = lesson(), memory_plan()
    fp8, cfg = plan.fp8, get_config("1b")
    shape, grid, precision = BatchShape(1, 2048, 4, 1), GridShape(tp=2), full_5d.zero.Precision(torch.bfloat16)

    def planned(recipe: str, gpu: str = "H200", rule: str = "--no-fp8-shape-rule"):
        args = full_5d.parse_args(["--tp", "2", "--seq-len", "2048", "--micro-batch-size", "1", "--grad-accum", "4",
                                   "--fp8", recipe, "--gpu", gpu, rule])
        return plan.plan_layout(cfg, args, grid, 1, shape, precision, plan.published_profile(gpu))

    assert not any(fp8.groups_in_fp8(cfg, "rowwise", 2048, 2, on_cuda=True).values())
    with_rule = planned("rowwise", rule="--fp8-shape-rule")
    assert (with_rule.memory, with_rule.seconds) == (planned("none").memory, planned("none").seconds)

    bf16, rowwise = planned("none"), planned("rowwise")
    saved = fp8.kept_bytes_difference(cfg, "rowwise", 2048, 2, torch.bfloat16, cfg.n_layers)
    assert rowwise.memory["activations"] - bf16.memory["activations"] == saved < 0
    device, gemms = plan.published_profile("H200"), plan.block_gemms(cfg, 2048, 2, 1)
    faster = 4 * cfg.n_layers * (sum(plan.gemm_pass_seconds(device, gemms, "bfloat16"))
                                 - sum(plan.gemm_pass_seconds(device, gemms, "float8")))
    assert bf16.seconds["compute"] - rowwise.seconds["compute"] == pytest.approx(faster, rel=1e-9)
    assert 1.2 < bf16.seconds["compute"] / rowwise.seconds["compute"] < 2
    assert rowwise.seconds["tp"] > bf16.seconds["tp"] > 0
    for recipe, gpu in (("rowwise", "A100-80GB"), ("mxfp8", "H200")):
        assert planned(recipe, gpu).seconds["compute"] == pytest.approx(planned("none", gpu).seconds["compute"],
                                                                        rel=1e-12), (recipe, gpu)
    assert planned("mxfp8", "B300").seconds["compute"] == planned("rowwise", "B300").seconds["compute"] \
        < planned("none", "B300").seconds["compute"]
    full_5d.main(["--plan", "--preset", "1b", "--gpus", "2", "--tp", "2", "--gpu", "H200", "--seq-len", "2048",
                  "--micro-batch-size", "1", "--grad-accum", "4", "--fp8", "rowwise", "--plan-top", "2",
                  "--no-fp8-shape-rule"])
    out = capsys.readouterr().out
    assert f"  {'activations':<40}{rowwise.memory['activations'] / 2**30:>8.2f}" in out
    assert "FP8 rowwise matmuls" in out and "float8 GEMM rate" in out, out
