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

import pytest
import torch
import torch.distributed as dist

from picotron_like import train
from picotron_like.lessons import load_lesson
from picotron_like.model import GPT
from picotron_like.testing import run_ranks
from picotron_like.topology import GridShape, ProcessGrid
from test_zero import ADAM_EPS, BF16, BF16_FP32_GRADS, CFG, FP32, LR, MAX_GRAD_NORM, SEED, STEPS, batches, gathered


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
