"""ZeRO-Offload proven (06_zero_offload.py): every ZeRO stage with its optimizer on the host equal to
the same stage without offload, and its model states where the prediction puts them.

On a CPU host and device are the same memory and the host's AdamW is the device's (the per-tensor
loop): the offloaded run performs the very float operations of lesson 06's, on copies held
elsewhere, so losses, norms, gradients before and after clipping, the master and the weights must
agree bit for bit, every step. The fused tail (the GPU's: fused AdamW taking the clipping as its
grad_scale, here fused on the CPU, as the host's AdamW is on a GPU run) likewise, against lesson
06's fused tail. Memory: the meter splits the storages the run holds into device and host side by
which tensors hold them; the device side must fall to the prediction (the master and Adam's
moments gone) and the host side hold them with the staging. Lesson 06 itself, and an offload that
moves nothing, must fail that prediction.
"""

from __future__ import annotations

from dataclasses import asdict

import pytest
import torch
import torch.distributed as dist

import picotron_like.checkpoint as checkpoints
from picotron_like import train
from picotron_like.data import BatchShape, TokenBatches, builtin_corpus_paths
from picotron_like.lessons import load_lesson
from picotron_like.model import GPT, get_config
from picotron_like.testing import run_ranks
from picotron_like.topology import ConfigError, GridShape, ProcessGrid
from picotron_like.train import batch_shape, checked_plan
from test_full_5d import CFG4, INTERLEAVED, MICRO as MICRO_07, MOE_CFG, SEQ as SEQ_07, optimizer_of
from test_full_5d import flags as full_5d_flags
from test_zero import ADAM_EPS, BF16, BF16_FP32_GRADS, CFG, CPU, FP32, LR, MAX_GRAD_NORM, SEED, STEPS, batches, gathered


def lessons():
    return load_lesson("06_zero"), load_lesson("06_zero_offload")


def nothing_moved(stage_class):
    """An offload that keeps every tensor where lesson 06 put it and only names them host tensors."""
    zero, offload = lessons()

    class NothingMoved(offload.OptimizerOffload, stage_class):
        def _shard_states(self, unit):
            stage_class._shard_states(self, unit)
            unit.host_grad, unit.host_weights, unit.gradient_copied = unit.grad_shard, unit.master, None

    return NothingMoved


def offload_run(grid, stage: int, precision: dict, offload, tail: str = "auto") -> dict:
    """STEPS steps of lesson 06's train_step; offload: False (lesson 06), True (the lesson's
    offload) or a stage class to wrap with (nothing_moved). Returns what the tests compare, each
    step's gradients whole before clipping (the reduced device shards) and after (the master's, as
    the optimizer steps with them), and the model states by side with their predictions."""
    zero, lesson = lessons()
    precision = zero.Precision(**precision)
    module = GPT(CFG, seed=SEED)
    if offload is True:
        model = lesson.wrap_zero_offloaded(module, grid.dp_group, stage, precision)
    elif offload:
        model = offload(module, grid.dp_group, precision, replicate=stage == 0)
    else:
        model = zero.wrap_zero(module, grid.dp_group, stage, precision)
    optimizer = (lesson.build_offloaded_optimizer(model, LR) if offload else zero.build_sharded_optimizer(model, LR))
    for group in optimizer.param_groups:
        group["eps"] = ADAM_EPS
    before, after = [], []
    finish = model.finish_gradient_synchronization

    def finish_then_snapshot():
        finish()
        before.append(gathered(model, lambda unit: unit.grad_shard))

    model.finish_gradient_synchronization = finish_then_snapshot
    optimizer.register_step_pre_hook(lambda *_: after.append(gathered(
        model, lambda unit: torch.cat([piece.master.grad for piece in unit.pieces]))))
    settings = zero.step_settings(torch.device("cpu"), precision, MAX_GRAD_NORM, tail)
    data = batches(grid.dp_size)
    results = [zero.train_step(model, optimizer, data.step_batch(step, grid.dp_rank), settings) for step in range(STEPS)]
    model.wait_for_weights()
    counts, n = [unit.numel for unit in model.units], grid.dp_size
    return {"losses": [r.loss for r in results], "norms": [r.grad_norm for r in results],
            "grads": before, "clipped_grads": after,
            "params": gathered(model, lambda unit: unit.master),
            "weights": {name: p.detach().clone() for name, p in model.module.named_parameters()},
            "measured": lesson.measured_placement(model, optimizer),
            "predicted": lesson.predicted_placement(counts, n, stage, precision, True),
            "predicted_without": lesson.predicted_placement(counts, n, stage, precision, False),
            "fused": bool(optimizer.defaults.get("fused"))}


# dp 2: every stage in float32 and bf16; dp 3 (every unit padded): every stage once, in turn float32
# and the two bf16 regimes. The offload that moves nothing at dp 2, the fused tail at dp 3.
CASES = {2: [(stage, name) for stage in range(4) for name in ("fp32", "bf16")],
         3: [(0, "fp32"), (1, "bf16"), (2, "bf16 fp32-grads"), (3, "fp32")]}
PRECISIONS = {"fp32": FP32, "bf16": BF16, "bf16 fp32-grads": BF16_FP32_GRADS}


def every_stage_with_and_without():
    dp = dist.get_world_size()
    grid = ProcessGrid(GridShape(dp=dp))
    runs = {}
    for stage, name in CASES[dp]:
        for offload in (False, True):
            runs[(stage, name, offload)] = offload_run(grid, stage, PRECISIONS[name], offload)
    if dp == 2:
        zero, _ = lessons()
        runs["nothing moved"] = offload_run(grid, 1, FP32, nothing_moved(zero.ZeroDataParallel))
    else:
        train.adamw_implementation = lambda device: {"fused": True}     # the GPU's AdamW; the CPU has one
        for offload in (False, True):
            runs[("fused", offload)] = offload_run(grid, 3, BF16_FP32_GRADS, offload, tail="fused")
    return runs


def assert_same_run(offloaded: dict, alone: dict, where: str) -> None:
    for key in ("losses", "norms"):
        assert offloaded[key] == alone[key], f"{where} {key}"
    for key in ("grads", "clipped_grads"):
        assert len(offloaded[key]) == len(alone[key]) == STEPS, f"{where} {key}"
        for step, (mine, theirs) in enumerate(zip(offloaded[key], alone[key])):
            for name, tensor in theirs.items():
                assert torch.equal(mine[name], tensor), f"{where} step {step} {key} {name}"
    for key in ("params", "weights"):
        for name, tensor in alone[key].items():
            assert torch.equal(offloaded[key][name], tensor), f"{where} {key} {name}"


@pytest.mark.parametrize("dp", [2, 3])
def test_offload_equals_zero_and_moves_the_optimizer_states(dp):
    """dp = 3 pads every unit. Bit for bit against lesson 06 at every stage, in float32 and bf16;
    the device side at the prediction, 12 bytes per element of the shard moved to the host."""
    for rank, runs in enumerate(run_ranks(dp, every_stage_with_and_without, timeout_s=240)):
        for stage, name in CASES[dp]:
            where = f"dp={dp} rank={rank} stage {stage} {name}"
            offloaded, alone = runs[(stage, name, True)], runs[(stage, name, False)]
            assert_same_run(offloaded, alone, where)
            assert min(alone["norms"]) > MAX_GRAD_NORM, "clipping must act, or the clipped gradients prove nothing"
            assert offloaded["measured"] == offloaded["predicted"], where
            assert alone["measured"] == alone["predicted_without"], where
            device, host = offloaded["predicted"]
            without, _ = offloaded["predicted_without"]
            assert without.total - device.total == without.master_weights + without.optimizer_states > 0, where
            assert host.master_weights + host.optimizer_states == 12 * host.master_weights // 4, where
            # lesson 06 measured as the offload would be: its device side is not the offload's
            assert alone["measured"][0] != offloaded["predicted"][0], where
        if dp == 2:
            moved_nothing = runs["nothing moved"]
            assert moved_nothing["measured"][0] != moved_nothing["predicted"][0], "a no-op offload must fail the meter"
        else:
            assert runs[("fused", True)]["fused"] and runs[("fused", False)]["fused"]
            assert_same_run(runs[("fused", True)], runs[("fused", False)], f"dp={dp} rank={rank} fused tail")


# ----------------------------------------------------------------------------- lesson 07: --offload optimizer


# name: (grid, ep, ZeRO stage, model, extra flags): each of 07's seams once, run with and without
# --offload optimizer; "dp2 x tp2 ZeRO-1" also resumes, with offload, a checkpoint written without,
# and without, one written with.
FULL_5D_LAYOUTS = {"dp2 x tp2 ZeRO-3": (GridShape(dp=2, tp=2), 1, 3, CFG, ()),
                   "dp2 x tp2 ZeRO-1": (GridShape(dp=2, tp=2), 1, 1, CFG, ()),
                   "pp2 x dp2 ZeRO-1": (GridShape(dp=2, pp=2), 1, 1, CFG, ()),
                   "pp2 x dp2 zero-bubble ZeRO-1": (GridShape(dp=2, pp=2), 1, 1, CFG, ("--schedule", "zero-bubble")),
                   "pp2 x dp2 interleaved ZeRO-1": (GridShape(dp=2, pp=2), 1, 1, CFG4, INTERLEAVED),
                   "pp2 x dp2 afab ZeRO-0": (GridShape(dp=2, pp=2), 1, 0, CFG, ("--schedule", "afab")),
                   "pp2 x dp2 ZeRO-2": (GridShape(dp=2, pp=2), 1, 2, CFG, ()),
                   "pp2 x dp2 zero-bubble ZeRO-3 kept": (GridShape(dp=2, pp=2), 1, 3, CFG,
                                                         ("--schedule", "zero-bubble", "--no-reshard-after-forward")),
                   "pp2 x dp2 interleaved ZeRO-3 bf16": (GridShape(dp=2, pp=2), 1, 3, CFG4,
                                                         (*INTERLEAVED, "--dtype", "bfloat16")),
                   "dp2 x cp2 ZeRO-2 bf16": (GridShape(dp=2, cp=2), 1, 2, CFG, ("--dtype", "bfloat16")),
                   "dp4 moe ep2 ZeRO-2": (GridShape(dp=4), 2, 2, MOE_CFG, ()),
                   "dp2 x tp2 moe ZeRO-0": (GridShape(dp=2, tp=2), 1, 0, MOE_CFG, ()),
                   "dp2 x tp2 fp8 ZeRO-1": (GridShape(dp=2, tp=2), 1, 1, CFG, ("--fp8", "tensorwise")),
                   # both offloads: --offload optimizer activations against --offload activations
                   "dp2 x tp2 ZeRO-3 activations offloaded": (GridShape(dp=2, tp=2), 1, 3, CFG,
                                                              ("--offload", "activations"))}
RESUMED = "dp2 x tp2 ZeRO-1"
CFG_8B = get_config("8b")
SAVED_AT = 2


def full_5d_run(name: str, offload: bool, save_dir=None, resume_from=None) -> dict:
    """STEPS steps of 07's train_step on the layout `name` (FULL_5D_LAYOUTS), as its main builds it;
    with save_dir a checkpoint after step SAVED_AT; with resume_from, a run that loads it and
    trains on from there."""
    full_5d = load_lesson("07_full_5d")
    shape, ep, stage, cfg, extra = FULL_5D_LAYOUTS[name]
    grid = ProcessGrid(shape, ep=ep)
    flags = list(extra)
    if offload:         # one --offload flag names every choice
        flags = (flags[:flags.index("--offload") + 1] + ["optimizer"] + flags[flags.index("--offload") + 1:]
                 if "--offload" in flags else [*flags, "--offload", "optimizer"])
    args = full_5d.parse_args(full_5d_flags(shape, stage, "none", flags))
    cfg = full_5d.expert_parallel.moe_config(cfg, args)
    model, pipeline = full_5d.parallelize(cfg, grid, args, CPU, values_to_load=resume_from is not None)
    optimizer = optimizer_of(model, grid, args)
    settings = full_5d.step_settings(grid, CPU, model.precision, MAX_GRAD_NORM)
    data = TokenBatches(builtin_corpus_paths()[0], BatchShape(MICRO_07, SEQ_07, batch_shape(args, grid.dp_size).grad_accum,
                                                              grid.dp_size), seed=SEED, vocab_size=cfg.vocab_size)
    cut = full_5d.context_parallel.sequence_cut(grid, args.zigzag) or (lambda batch: batch)
    start = 0
    if resume_from is not None:
        manifest = checkpoints.read_manifest(checkpoints.step_directory(resume_from, SAVED_AT), cfg)
        checkpoints.load(manifest, checkpoints.reference_slices(model, grid), optimizer)
        model.publish_master()
        start = SAVED_AT
    log = full_5d.balancing_log(model, pipeline, grid)
    results = []
    for step in range(start, STEPS):
        results.append(full_5d.train_step(model if pipeline is None else pipeline, optimizer,
                                          cut(data.step_batch(step, grid.dp_rank)), settings, args.bias_update_rate,
                                          log))
        if save_dir is not None and step + 1 == SAVED_AT:
            model.wait_for_weights()
            info = {"model": asdict(cfg), "layout": {}, "run": {}, "settings": {}}
            checkpoints.save(save_dir, SAVED_AT, checkpoints.reference_slices(model, grid), optimizer, info)
    model.wait_for_weights()
    plan, lesson = load_lesson("07_memory_plan"), load_lesson("06_zero_offload")
    device, host = lesson.measured_placement(model, optimizer)
    planned, _ = plan.planned_memory(cfg, args, shape, ep, data.shape, model.precision, grid.pp_rank,
                                     plan.plan_device(args))
    planned_host = plan.planned_host_memory(cfg, args, shape, ep, model.precision, grid.pp_rank)
    return {"losses": [r.loss for r in results], "norms": [r.grad_norm for r in results],
            "params": gathered(model, lambda unit: unit.master),
            "weights": {n: p.detach().clone() for n, p in model.module.named_parameters()},
            "offloaded": isinstance(model, lesson.OptimizerOffload),
            "device": (device.parameters, device.gradients, device.master_weights, device.optimizer_states),
            "planned device": (planned["parameters"], planned["gradients"], planned.get("master weights (fp32)", 0),
                               planned.get("Adam states (fp32)", 0)),
            "host": (host.parameters, host.gradients, host.master_weights, host.optimizer_states),
            "planned host": tuple(planned_host.get(row, 0) for row in (
                "weights' shard (pinned staging)", "gradient shard (pinned staging)", "master weights (fp32)",
                "Adam states (fp32)"))}


def every_full_5d_layout(save_dir) -> dict:
    """Every layout with and without offload; RESUMED's two runs each save a checkpoint, which a run
    of the other kind resumes."""
    runs = {(name, offload): full_5d_run(name, offload, save_dir / str(offload) if name == RESUMED else None)
            for name in FULL_5D_LAYOUTS for offload in (False, True)}
    for offload in (False, True):
        runs["resumed", offload] = full_5d_run(RESUMED, offload, resume_from=save_dir / str(not offload))
    return runs


def test_07_offload_equals_07_without_and_checkpoints_cross_between_them(tmp_path):
    """Bit for bit, as in lesson 06's test: each seam of 07 (tp, pp under every schedule, cp,
    experts over edp, FP8) with its optimizer on the host against the same layout without; a
    checkpoint of a run without offload resumed with it, and one with offload resumed without,
    each equal to the run that never stopped.
    The plan (07_memory_plan) of each layout: its device bytes those the run holds on the device
    (the measure of lesson 06_zero_offload), its host bytes those on the host, with offload and
    without (where the host holds nothing)."""
    for rank, runs in enumerate(run_ranks(4, every_full_5d_layout, tmp_path, timeout_s=300)):
        for name in FULL_5D_LAYOUTS:
            offloaded, alone, where = runs[(name, True)], runs[(name, False)], f"rank={rank} {name}"
            assert offloaded["offloaded"] and not alone["offloaded"], where
            for run in (offloaded, alone):
                assert run["device"] == run["planned device"] and run["host"] == run["planned host"], where
            assert offloaded["host"][2] > 0 and alone["host"] == (0, 0, 0, 0), where
            assert offloaded["losses"] == alone["losses"] and offloaded["norms"] == alone["norms"], where
            for key in ("params", "weights"):
                for param, tensor in alone[key].items():
                    assert torch.equal(offloaded[key][param], tensor), f"{where} {key} {param}"
        for offload in (False, True):
            resumed, through, where = runs["resumed", offload], runs[(RESUMED, offload)], f"rank={rank} resumed"
            assert resumed["losses"] == through["losses"][SAVED_AT:], f"{where} offload={offload}"
            for param, tensor in through["params"].items():
                assert torch.equal(resumed["params"][param], tensor), f"{where} offload={offload} {param}"


def test_the_plan_moves_the_optimizer_to_the_host_and_checks_the_node(capsys):
    """--plan --offload optimizer on one node of H100s for the 8b preset: the device holds exactly
    the master and Adam's moments less (12 bytes per element of the shard), the host holds them
    beside its staging; the node's ranks' host bytes are checked against the DGX system's memory
    (or --node-host-memory-gb); the step pays the host step and the copies instead of the device's
    optimizer tail. Muon with offload is one error line."""
    full_5d, plan = load_lesson("07_full_5d"), load_lesson("07_memory_plan")
    flags = ["--plan", "--preset", "8b", "--gpus", "8", "--gpu", "H100", "--seq-len", "4096", "--micro-batch-size",
             "1", "--grad-accum", "8", "--dtype", "bfloat16", "--zero-stage", "3", "--plan-top", "1"]
    on_device, offloaded = full_5d.parse_args(flags), full_5d.parse_args([*flags, "--offload", "optimizer"])
    precision = full_5d.zero.Precision(torch.bfloat16, torch.float32)
    h100 = plan.plan_device(offloaded)
    kept, moved = (plan.plan_layout(CFG_8B, args, GridShape(dp=8), 1, BatchShape(1, 4096, 8, 8),
                                    precision, h100) for args in (on_device, offloaded))
    host = moved.host
    assert kept.peak_bytes - moved.peak_bytes == host["master weights (fp32)"] + host["Adam states (fp32)"] > 0
    assert host["Adam states (fp32)"] == 2 * host["master weights (fp32)"] == 2 * host["gradient shard (pinned staging)"]
    assert host["weights' shard (pinned staging)"] * 2 == host["master weights (fp32)"] and not kept.host
    units = plan.zero_units(CFG_8B, offloaded, GridShape(dp=8), 1, 0)
    micro = plan.micro_batch_seconds(CFG_8B, offloaded, GridShape(dp=8), 1,
                                     BatchShape(1, 4096, 8, 8), precision, h100, 0)
    parts = plan.offload_seconds(units, offloaded, precision, h100, micro)
    assert parts["host step"] > parts["to device"] > 0
    full_5d.main([*flags, "--offload", "optimizer"])
    out = capsys.readouterr().out
    assert f"  {'total':<40}{moved.host_bytes / 2**30:>8.2f}" in out
    assert f"host memory per node: 8 ranks x {moved.host_bytes / 2**30:.2f} GiB" in out and "2048 GiB" in out
    assert "fits," in out and "of which the offloaded optimizer's" in out and "--offload optimizer: the master" in out
    small_node = full_5d.parse_args([*flags, "--offload", "optimizer", "--node-host-memory-gb", "100"])
    plan.print_planned_host_memory(moved, small_node, h100)
    assert "(--node-host-memory-gb), planned to 90% of it: does not fit" in capsys.readouterr().out
    with pytest.raises(ConfigError, match="--offload optimizer with --optimizer muon"):
        checked_plan(full_5d.parse_args(["--dp", "8", "--offload", "optimizer", "--optimizer", "muon"]),
                     full_5d.validate, full_5d.expert_parallel.moe_config, 8)
