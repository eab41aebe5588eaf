"""Lesson 06 proven equal: ZeRO stages 0-3 on real gloo ranks against one device, and PyTorch's own.

Every rank trains on its slice of the same global batches; the reference trains one GPT on the
whole global batch. Gradients are compared whole: the test gathers each unit's gradient shards
(outside the communication meter) once synchronised (before clipping) and as the optimizer steps
(after clipping). float32 tolerances are lesson 01's: the same sums in a different order differ by a
few ulp (1e-6 absolute on gradients of order 1e-2..1e0); parameters after AdamW within 1e-2 lr.
Both runs use AdamW with eps = 1e-4 (ADAM_EPS), as lesson 02's tests do: Adam moves a weight by
about lr whatever its gradient's size, and a gradient at float32's rounding floor (1e-10 next to
typical 1e-3, measured on this data) has its sign decided by the summation order; eps between the
floor and the typical gradient keeps real updates Adam-like and damps only that noise.

bf16 mixed precision is compared with a one-device run in the same regime (bf16 weights under
autocast, float32 master and Adam, gradients reduced in `reduce_dtype`): see test_bf16_*.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import asdict, replace

import pytest
import torch
import torch.distributed as dist

from picotron_like import comm, train
from picotron_like.data import BatchShape, TokenBatches, builtin_corpus_paths
from picotron_like.lessons import REPO_ROOT, load_lesson
from picotron_like.metrics import GatheredParameterMeter, SavedTensorMeters, add_traffic, step_bookkeeping_traffic
from picotron_like.model import GPT, get_config
from picotron_like.testing import run_ranks, train_reference
from picotron_like.topology import GridShape, ProcessGrid
from picotron_like.train import StepSettings, build_optimizer, clip_grad_norm_

CFG = replace(get_config("tiny"), n_layers=2, hidden=64, n_heads=4, n_kv_heads=2, ffn_hidden=128)
MOE_CFG = replace(get_config("tiny-moe"), n_layers=2, hidden=64, n_heads=4, n_kv_heads=2, ffn_hidden=64)
SEQ, MICRO, GLOBAL_SEQUENCES, STEPS, LR, SEED = 32, 2, 12, 3, 3e-3, 7
MAX_GRAD_NORM = 1.0  # the reference's norms are above it: clipping acts on every step (asserted)
TOLERANCE = dict(rtol=0, atol=1e-6)
PARAM_TOLERANCE = dict(rtol=0, atol=1e-2 * LR)
ADAM_EPS = 1e-4
CPU = torch.device("cpu")
FP32 = dict(param_dtype=torch.float32, reduce_dtype=torch.float32)
STAGES = [(0, True, True), (1, True, True), (2, True, True), (3, True, True), (3, False, True), (3, True, False)]


def batches(dp: int) -> TokenBatches:
    shape = BatchShape(MICRO, SEQ, GLOBAL_SEQUENCES // (MICRO * dp), dp)
    return TokenBatches(builtin_corpus_paths()[0], shape, seed=SEED, vocab_size=CFG.vocab_size)


def lesson():
    return load_lesson("06_zero")


# ----------------------------------------------------------------------------- inspecting shards from outside


def gathered(model, shard_of) -> dict:
    """{parameter name: whole tensor} from every unit's shards (`shard_of(unit)`), gathered as
    bookkeeping so that the communication meter counts only the technique."""
    whole = {}
    for unit in model.units:
        shard = shard_of(unit)
        if unit.shard_numel == unit.padded_numel:
            flat = shard.clone()
        else:
            flat = shard.new_empty(unit.padded_numel)
            comm.bookkeeping(comm.all_gather_single, flat, shard.contiguous(), group=unit.group)
        offset = 0
        for name, shape in zip(unit.names, unit.shapes):
            whole[name] = flat[offset: offset + shape.numel()].view(shape).float()
            offset += shape.numel()
    return whole


def observe_gradients(model, optimizer) -> dict:
    seen = {}
    finish = model.finish_gradient_synchronization

    def finish_then_snapshot():
        finish()
        seen.setdefault("before", gathered(model, lambda unit: unit.grad_shard))

    def snapshot_before_step(*_):      # clipped where the optimizer steps: on the host under --offload optimizer
        seen.setdefault("after", gathered(model, lambda unit: getattr(unit, "host_grad", unit.grad_shard)))

    model.finish_gradient_synchronization = finish_then_snapshot
    optimizer.register_step_pre_hook(snapshot_before_step)
    return seen


def zero_run(grid_shape: GridShape, stage: int, reshard: bool = True, prefetch: bool = True,
             precision=FP32, grid=None, cfg=CFG, overlap: bool = True, tail: str = "auto", flags=()) -> dict:
    """Train STEPS steps; return what the equality tests compare, the measured model states with
    their formula, ZeRO-3's gathered peak with its prediction, and the traffic with its formula.
    Dense on data parallelism alone: lesson 06 as its main() builds it. Any other layout (tp, cp,
    pp, experts): through lesson 07's parallelize and composed step, where ZeRO meets the other
    axes (tests/test_full_5d_composition.py); with pp > 1 the rank's stage runs lesson 03's 1F1B.
    overlap: ZeRO-1/2's weight all-gathers left running into the next forward (lesson 06's default),
    or waited for in the step; "weights" are the module's own after the last step's gathers, and
    "in_flight" counts, at each micro-batch's first unit (after ZeRO's own hook), the module units
    whose gathers are still running. flags: more of lesson 07's (a pipeline's --schedule)."""
    zero = lesson()
    grid = grid or ProcessGrid(grid_shape)
    precision = zero.Precision(**precision)
    data = batches(grid.dp_size)
    alone = grid_shape == GridShape(dp=grid_shape.dp) and not cfg.n_experts
    if alone:
        model = zero.wrap_zero(GPT(cfg, seed=SEED), grid.dp_cp_group, stage, precision, reshard, prefetch, overlap)
        pipeline, settings, step = None, zero.step_settings(CPU, precision, MAX_GRAD_NORM), zero.train_step
    else:
        full_5d = load_lesson("07_full_5d")
        args = composed_args(grid, stage, reshard, prefetch, precision, data.shape, overlap, flags)
        model, pipeline = full_5d.parallelize(cfg, grid, args, CPU)
        settings, step = full_5d.step_settings(grid, CPU, precision, MAX_GRAD_NORM), full_5d.train_step
    settings = replace(settings, tail=tail)
    optimizer = zero.build_sharded_optimizer(model, LR)
    for group in optimizer.param_groups:
        group["eps"] = ADAM_EPS
    seen = observe_gradients(model, optimizer)
    in_flight = []      # at each step's first forward: the units' gathers still running
    zero.unit_modules(model.module)[0][0].register_forward_pre_hook(
        lambda module, args: in_flight.append(len(model._weight_gathers)))
    split = context_split(grid)
    comm.meter.reset()
    meter = GatheredParameterMeter(model.module)
    results = []
    for step_index in range(STEPS):
        batch = data.step_batch(step_index, grid.dp_rank)
        if split is not None:
            batch = split(batch)
        with SavedTensorMeters(meter) if step_index == 0 else torch.enable_grad():
            results.append(step(model if pipeline is None else pipeline, optimizer, batch, settings))
    model.wait_for_weights()        # as main() does before its report
    n, n_micro = grid.dp_size * grid.cp_size, data.shape.grad_accum
    norm_groups = (("dp_cp",) if stage else ()) + (("tp",) if grid.tp_size > 1 else ())
    if alone:       # lesson 06's formulas on its units' sizes, as its report applies them
        counts = [unit.numel for unit in model.units]
        zero_traffic = zero.predicted_zero_traffic(counts, n, stage, precision, n_micro, reshard, "dp_cp")
        predicted_peak = zero.predicted_gathered_peak(
            [zero.padded(count, n) * precision.param_dtype.itemsize for count in counts], reshard, prefetch)
    else:           # lesson 07's sum of them: dense units over dp x cp, experts over edp
        units = load_lesson("07_report").ZeroUnits.of(model, grid)
        zero_traffic = units.traffic(stage, precision, n_micro, reshard)
        predicted_peak = units.gathered_peak(precision, reshard, prefetch)
    predicted = add_traffic(zero_traffic, step_bookkeeping_traffic(loss_groups=("dp_cp",), norm_groups=norm_groups))
    # tp's and cp's own traffic, from lessons 02 and 04's formulas (float32 dense runs; None otherwise)
    inner = None if alone else load_lesson("07_report").predicted_inner_traffic(model, cfg, data.shape, grid, "ring", False, precision)
    predicted = add_traffic(predicted, inner or {})
    # Dense: the formula from the model's shape alone. Experts: from the flat units' sizes, per group.
    predicted_states = units.model_states(stage, precision) if cfg.n_experts else \
        zero.predicted_model_states(load_lesson("07_memory_plan").unit_parameter_counts(
            cfg, grid.tp_size, grid.pp_size, grid.pp_rank), n, stage,
                                    precision)
    if grid.pp_size > 1 and stage >= 2:     # 07's ZeRO-2/3 under a pipeline hold no gradient between steps
        predicted_states = replace(predicted_states, gradients=0)
    params = gathered(model, lambda unit: unit.master)
    weights = {name: param.detach().clone() for name, param in model.module.named_parameters()}
    return {"grads": seen["before"], "clipped_grads": seen["after"], "params": params, "weights": weights,
            "in_flight": in_flight, "n_units": len(model.unit_groups),
            "losses": [r.loss for r in results], "norms": [r.grad_norm for r in results],
            "states": asdict(zero.measured_model_states(model, optimizer)),
            "predicted_states": asdict(predicted_states),
            "peak": meter.peak_bytes,
            "predicted_peak": predicted_peak if stage == 3 else meter.peak_bytes,
            "traffic": {key: value.payload_bytes for key, value in comm.meter.traffic.items()},
            "predicted": {key: STEPS * value for key, value in predicted.items()},
            "inner_predicted": inner is not None}


def composed_args(grid, stage: int, reshard: bool, prefetch: bool, precision, shape, overlap: bool = True,
                  flags=()):
    """Lesson 07's flags for this layout and ZeRO setting, with the defaults lesson 06's own
    build used before the composition moved to 07 (looped experts, fused zigzag ring)."""
    dtypes = {torch.float32: "float32", torch.bfloat16: "bfloat16"}
    return load_lesson("07_full_5d").parse_args([
        "--dp", str(grid.dp_size), "--tp", str(grid.tp_size), "--pp", str(grid.pp_size), "--cp", str(grid.cp_size),
        "--ep", str(grid.ep_size), "--zero-stage", str(stage), "--seed", str(SEED),
        "--dtype", dtypes[precision.param_dtype], "--reduce-dtype", dtypes[precision.reduce_dtype],
        "--micro-batch-size", str(shape.micro_batch_size), "--seq-len", str(shape.seq_len),
        "--grad-accum", str(shape.grad_accum), "--no-grouped-mm",
        *([] if reshard else ["--no-reshard-after-forward"]), *([] if prefetch else ["--no-prefetch"]),
        *([] if overlap else ["--no-overlap-weight-gather"]), *flags])


def context_split(grid):
    if grid.cp_size == 1:
        return None
    cp = load_lesson("04_context_parallel")
    return lambda batch: cp.context_parallel_batch(batch, cp.SequenceSplit(grid.cp_size, True), grid.cp_rank)


def assert_equal(result: dict, reference: dict, where: str, names=None) -> None:
    """Every parameter, or `names` (a pipeline stage's)."""
    names = list(names or reference["params"])
    for key in ("grads", "clipped_grads"):
        for name in names:
            torch.testing.assert_close(result[key][name], reference[key][name], **TOLERANCE,
                                       msg=f"{where} {key} {name}")
    for key in ("losses", "norms"):
        torch.testing.assert_close(torch.tensor(result[key]), torch.tensor(reference[key]), rtol=0, atol=1e-5,
                                   msg=f"{where} {key}")
    for name in names:
        torch.testing.assert_close(result["params"][name], reference["params"][name], **PARAM_TOLERANCE,
                                   msg=f"{where} param {name}")


def assert_formulas(result: dict, where: str) -> None:
    assert result["states"] == result["predicted_states"], where
    assert result["peak"] == result["predicted_peak"], where
    # On the dp x cp group (and edp): ZeRO's traffic and the step's bookkeeping; on tp and cp, their
    # lessons' formulas where they apply (float32, dense: predicted_inner_traffic). ep's traffic
    # depends on the routing: lesson 05's tests check it.
    inner_groups = ("tp", "cp") if result["inner_predicted"] else ()

    def on_dp_cp(traffic):
        return {key: value for key, value in traffic.items() if key[1] in ("dp_cp", "edp", *inner_groups)}

    assert on_dp_cp(result["traffic"]) == on_dp_cp(result["predicted"]), where


@pytest.fixture(scope="module")
def reference():
    result = train_reference(CFG, SEED, batches(1), STEPS, LR, MAX_GRAD_NORM, adam_eps=ADAM_EPS)
    assert min(result["norms"]) > MAX_GRAD_NORM, "clipping must act, or the clipped gradients prove nothing"
    return result


# ----------------------------------------------------------------------------- fp32: every stage at dp = 2 and 3


def every_stage():
    shape = GridShape(dp=dist.get_world_size())
    grid = ProcessGrid(shape)
    runs = {f"stage {s} reshard={r} prefetch={p}": zero_run(shape, s, r, p, grid=grid) for s, r, p in STAGES}
    for stage in (1, 2):
        runs[f"stage {stage} no overlap"] = zero_run(shape, stage, grid=grid, overlap=False)
    return runs


def assert_overlap_changes_only_the_timing(overlapped: dict, waited: dict, where: str) -> None:
    """ZeRO-1/2 with the weights' all-gathers overlapped with the next forward against the step
    waiting for them: the same losses, norms, gradients before and after clipping, master and
    gathered weights, bit for bit, and the same collectives. Overlapped, each step after the first
    reaches its first unit with every later unit's gather still running (the first unit's own was
    waited for by ZeRO's hook, run before the test's); waited for, none."""
    for key in ("losses", "norms", "traffic", "states"):
        assert overlapped[key] == waited[key], f"{where} {key}"
    for key in ("grads", "clipped_grads", "params", "weights"):
        for name, tensor in waited[key].items():
            assert torch.equal(overlapped[key][name], tensor), f"{where} {key} {name}"
    micro = len(overlapped["in_flight"]) // STEPS
    later_units = overlapped["n_units"] - 1
    assert overlapped["in_flight"] == [0] * micro + ([later_units] + [0] * (micro - 1)) * (STEPS - 1), where
    assert set(waited["in_flight"]) == {0}, where


@pytest.mark.parametrize("dp", [2, 3])
def test_every_stage_equals_one_device_and_its_formulas(dp, reference):
    """Losses, step-0 gradients before and after clipping, parameters after AdamW; model states
    byte for byte, ZeRO-3's gathered peak, and the traffic of each collective, against formulas.
    dp = 3 pads every unit (no unit's size is a multiple of 3)."""
    for rank, variants in enumerate(run_ranks(dp, every_stage, timeout_s=240)):
        for variant, result in variants.items():
            assert_equal(result, reference, f"dp={dp} rank={rank} {variant}")
            assert_formulas(result, f"dp={dp} rank={rank} {variant}")
        for stage in (1, 2):
            overlapped = variants[f"stage {stage} reshard=True prefetch=True"]
            assert_overlap_changes_only_the_timing(overlapped, variants[f"stage {stage} no overlap"],
                                                   f"dp={dp} rank={rank} stage {stage}")
            for name, weight in overlapped["weights"].items():     # float32: the weights are the master
                assert torch.equal(weight, overlapped["params"][name]), f"dp={dp} rank={rank} {name}"
    if dp == 3:
        assert any(count % 3 for count in load_lesson("07_memory_plan").unit_parameter_counts(CFG)), \
            "padding must be exercised"
        peaks = {v: r["peak"] for v, r in variants.items()}
        assert peaks["stage 3 reshard=True prefetch=False"] < peaks["stage 3 reshard=True prefetch=True"] \
            < peaks["stage 3 reshard=False prefetch=True"]


# ----------------------------------------------------------------------------- bf16, PyTorch's FSDP2 and ZeRO-1


BF16 = dict(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
BF16_FP32_GRADS = dict(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def bf16_reference(reduce_dtype) -> dict:
    """One device in the mixed-precision regime: bf16 weights under bf16 autocast, gradients cast
    to `reduce_dtype`, a float32 master copy stepped by the same AdamW, copied back to bf16."""
    model = GPT(CFG, seed=SEED)
    master = {name: p.detach().clone() for name, p in model.named_parameters()}
    model.to(torch.bfloat16)
    optimizer = build_optimizer(list(master.items()), LR)
    for group in optimizer.param_groups:
        group["eps"] = ADAM_EPS
    data, losses, grads = batches(1), [], None
    for step in range(STEPS):
        window = data.global_batch(step)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(window[:, :-1], window[:, 1:])
        loss.backward()
        for name, p in model.named_parameters():
            master[name].grad = p.grad.to(reduce_dtype).float()
            p.grad = None
        grads = grads or {name: m.grad.clone() for name, m in master.items()}
        clip_grad_norm_(master.values(), MAX_GRAD_NORM)
        optimizer.step()
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.copy_(master[name])
        losses.append(loss.item())
    return {"losses": losses, "grads": grads, "params": {n: m.detach().clone() for n, m in master.items()}}


def relative_error(actual: dict, expected: dict) -> float:
    """The whole model's gradient (or parameter change) error as one norm ratio."""
    diff = sum(float((actual[n] - expected[n]).pow(2).sum()) for n in expected)
    return (diff / sum(float(t.pow(2).sum()) for t in expected.values())) ** 0.5


def master_accumulates_small_updates() -> dict:
    """ZeRO-1 in bf16 with lr = 1e-3: each AdamW update of a norm gain (1.0, whose bf16 neighbours
    are 2^-8 below and 2^-7 above) is about lr, under half a bf16 step: the bf16 weight cannot move
    by itself, the float32 master does, and after enough steps the bf16 weight follows."""
    zero = lesson()
    grid = ProcessGrid(GridShape(dp=dist.get_world_size()))
    model = zero.wrap_zero(GPT(CFG, seed=SEED), grid.dp_group, 1, zero.Precision(**BF16))
    optimizer = zero.build_sharded_optimizer(model, 1e-3)
    settings = zero.step_settings(CPU, zero.Precision(**BF16), MAX_GRAD_NORM)
    gain = model.module.layers[0].attn_norm.weight
    data, after = batches(grid.dp_size), []
    for step in range(12):
        zero.train_step(model, optimizer, data.step_batch(step % STEPS, grid.dp_rank), settings)
        model.wait_for_weights()    # the gain is read outside a forward
        after.append((gain.detach().float().clone(), gathered(model, lambda unit: unit.master)["layers.0.attn_norm.weight"]))
    return {"after": after, "bf16_alone": float((torch.ones(4, dtype=torch.bfloat16) - 1e-3).float()[0])}


def fsdp2_run(reshard_after_forward: bool) -> dict:
    """The same training with PyTorch's FSDP2 (fully_shard per block and on the root), accumulation
    with set_requires_gradient_sync. FSDP2 averages gradients over ranks (a divide factor of 1 needs
    PREMUL_SUM, which gloo lacks), so each share is scaled by the world size first: at dp = 2 both
    the scaling and the division are exact in floating point."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = GPT(CFG, seed=SEED)
    for block in model.layers:
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard_after_forward)
    optimizer = build_optimizer(model, LR)
    for group in optimizer.param_groups:
        group["eps"] = ADAM_EPS
    data, losses, grads = batches(dist.get_world_size()), [], None
    for step in range(STEPS):
        batch = data.step_batch(step, dist.get_rank())
        loss = torch.zeros(())
        for index, micro_batch in enumerate(batch.micro_batches):
            model.set_requires_gradient_sync(index == len(batch.micro_batches) - 1)
            share = model(*micro_batch, reduction="sum") / batch.n_targets
            (share * dist.get_world_size()).backward()
            loss += share.detach()
        grads = grads or {n: p.grad.full_tensor() for n, p in model.named_parameters()}
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_GRAD_NORM)
        optimizer.step()
        optimizer.zero_grad()
        dist.all_reduce(loss)
        losses.append(loss.item())
    return {"losses": losses, "grads": grads, "params": {n: p.full_tensor() for n, p in model.named_parameters()}}


def zero_redundancy_optimizer_run() -> dict:
    """PyTorch's ZeRO-1: ZeroRedundancyOptimizer over lesson 01's gradient all-reduce."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    data_parallel = load_lesson("01_data_parallel")
    model = data_parallel.wrap_data_parallel(GPT(CFG, seed=SEED), dist.group.WORLD, "bucketed", 2**20)
    groups = build_optimizer(model.module, LR).param_groups
    optimizer = ZeroRedundancyOptimizer([{"params": g["params"], "weight_decay": g["weight_decay"]} for g in groups],
                                        optimizer_class=torch.optim.AdamW, lr=LR, betas=(0.9, 0.95), eps=ADAM_EPS,
                                        foreach=False)
    data, settings = batches(dist.get_world_size()), StepSettings(CPU, max_grad_norm=MAX_GRAD_NORM)
    losses = [data_parallel.train_step(model, optimizer, data.step_batch(step, dist.get_rank()), settings).loss
              for step in range(STEPS)]
    return {"losses": losses, "params": {n: p.detach().clone() for n, p in model.module.named_parameters()}}


def mixed_precision_and_pytorch():
    shape = GridShape(dp=dist.get_world_size())
    grid = ProcessGrid(shape)
    runs = {f"bf16 stage {s}": zero_run(shape, s, precision=BF16, grid=grid) for s in range(4)}
    runs["bf16 stage 1 no overlap"] = zero_run(shape, 1, precision=BF16, grid=grid, overlap=False)
    runs["bf16 fp32-grads stage 2"] = zero_run(shape, 2, precision=BF16_FP32_GRADS, grid=grid)
    runs["bf16 fp32-grads stage 3 kept"] = zero_run(shape, 3, False, precision=BF16_FP32_GRADS, grid=grid)
    runs["ours stage 3"] = zero_run(shape, 3, grid=grid)
    runs["ours stage 3 kept"] = zero_run(shape, 3, False, grid=grid)
    runs["fsdp2 reshard"] = fsdp2_run(True)
    runs["fsdp2 kept"] = fsdp2_run(False)
    runs["zero redundancy optimizer"] = zero_redundancy_optimizer_run()
    runs["master"] = master_accumulates_small_updates()
    train.adamw_implementation = lambda device: {"fused": True}     # lesson 07's AdamW on CUDA; the CPU has one
    runs["fused tail stage 1"] = zero_run(shape, 1, grid=grid, tail="fused")
    return runs


# bf16 carries 8 significant bits: one rounding is off by at most u = 2^-8 relative. A gradient here
# is rounded once on one device (the bf16 matmul's float32 sum, rounded to bf16) and once more per
# reduction on ranks (each rank's partial sum, then the sum of the parts in reduce_dtype): the
# whole gradient agrees with the one-device one within 2u in norm (measured: 0.8u-1.03u at dp = 2).
# Losses are computed in float32 from bf16 logits of the same bf16 weights: within u relative
# (measured < 1e-5). The weights' change after 3 AdamW steps, compared as a whole in norm: Adam's
# update m / sqrt(v) is a ratio of two gradient statistics, each off by up to 2u: within 4u
# (measured 0.5u-0.7u). A wrong scale, a lost micro-batch or a stale shard is off by 10 % or more.
BF16_ROUNDING = 2.0**-8


def parameter_change_error(params: dict, reference: dict) -> float:
    initial = dict(GPT(CFG, seed=SEED).named_parameters())
    return relative_error({n: params[n].float() - initial[n].detach() for n in reference},
                          {n: p - initial[n].detach() for n, p in reference.items()})


def test_mixed_precision_and_against_pytorch(reference):
    """One spawn at dp = 2: bf16 at every stage (and fp32 gradients) against the one-device bf16
    regime, formulas byte for byte; the fp32 master keeping updates bf16 cannot hold; our ZeRO-3
    equal to FSDP2 (resharding and keeping weights gathered) and our ZeRO-1 to
    ZeroRedundancyOptimizer's, all of them equal to one device; ZeRO-1 with the fused tail too."""
    regimes = {torch.bfloat16: bf16_reference(torch.bfloat16), torch.float32: bf16_reference(torch.float32)}
    for rank, runs in enumerate(run_ranks(2, mixed_precision_and_pytorch, timeout_s=300)):
        for name, result in runs.items():
            where = f"rank={rank} {name}"
            if name.startswith("bf16"):
                expected = regimes[torch.float32 if "fp32-grads" in name else torch.bfloat16]
                assert relative_error(result["grads"], expected["grads"]) < 2 * BF16_ROUNDING, where
                torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(expected["losses"]),
                                           rtol=BF16_ROUNDING, atol=0, msg=where)
                assert parameter_change_error(result["params"], expected["params"]) < 4 * BF16_ROUNDING, where
                assert_formulas(result, where)
            elif name.startswith("ours"):
                assert_equal(result, reference, where)
                assert_formulas(result, where)
        assert_overlap_changes_only_the_timing(runs["bf16 stage 1"], runs["bf16 stage 1 no overlap"], f"rank={rank}")
        for name, weight in runs["bf16 stage 1"]["weights"].items():    # gathered: the master's bf16 cast
            assert torch.equal(weight, runs["bf16 stage 1"]["params"][name].to(torch.bfloat16)), name
        for ours, theirs in (("ours stage 3", "fsdp2 reshard"), ("ours stage 3 kept", "fsdp2 kept")):
            for key in ("losses", "grads"):
                expected = reference[key] if key == "grads" else torch.tensor(reference[key])
                actual = runs[theirs][key] if key == "grads" else torch.tensor(runs[theirs][key])
                torch.testing.assert_close(actual, expected, rtol=0, atol=1e-5 if key == "losses" else 1e-6)
                torch.testing.assert_close(runs[ours][key] if key == "grads" else torch.tensor(runs[ours][key]),
                                           actual, rtol=0, atol=1e-5 if key == "losses" else 1e-6)
            for name, param in runs[theirs]["params"].items():
                torch.testing.assert_close(runs[ours]["params"][name], param, **PARAM_TOLERANCE, msg=name)
        # The fused tail (forced here; CUDA's default) on ZeRO-1's shards with fused AdamW: the same
        # gradients before clipping, the norm within 3e-5 relative (the CPU's _foreach_norm error),
        # the clipping done inside AdamW (grad_scale), the weights after it as one device's.
        fused = runs["fused tail stage 1"]
        for name in reference["grads"]:
            torch.testing.assert_close(fused["grads"][name], reference["grads"][name], **TOLERANCE, msg=name)
        torch.testing.assert_close(torch.tensor(fused["norms"]), torch.tensor(reference["norms"]), rtol=3e-5, atol=0)
        torch.testing.assert_close(torch.tensor(fused["losses"]), torch.tensor(reference["losses"]), rtol=0, atol=1e-5)
        for name, param in reference["params"].items():
            torch.testing.assert_close(fused["params"][name], param, **PARAM_TOLERANCE, msg=name)
        assert_formulas(fused, f"rank={rank} fused tail")
        ours_zero1 = runs["zero redundancy optimizer"]
        torch.testing.assert_close(torch.tensor(ours_zero1["losses"]), torch.tensor(reference["losses"]),
                                   rtol=0, atol=1e-5)
        for name, param in reference["params"].items():
            torch.testing.assert_close(ours_zero1["params"][name], param, **PARAM_TOLERANCE, msg=name)

        # The master holds what bf16 cannot: after one step of ~1e-3 the bf16 gain is still 1.0 (as
        # 1 - 1e-3 rounded to bf16 is), the master is not; a few steps later the bf16 gain has moved.
        master = runs["master"]
        assert master["bf16_alone"] == 1.0
        (first_bf16, first_master), (last_bf16, last_master) = master["after"][0], master["after"][-1]
        assert torch.all(first_bf16 == 1.0) and (first_master - 1.0).abs().max() > 5e-4
        assert (last_bf16 != 1.0).float().mean() > 0.5
        torch.testing.assert_close(last_bf16, last_master.to(torch.bfloat16).float(), rtol=0, atol=0)


# ----------------------------------------------------------------------------- the accumulation, bit for bit


@pytest.mark.parametrize("precision", [FP32, BF16_FP32_GRADS, BF16])
def test_accumulation_gives_the_bits_a_zeroed_buffer_and_flat_copies_gave(precision):
    """The gradient buffer after three micro-batches, bit for bit as the path it replaced made it
    (each micro-batch's gradients flattened into a zeroed copy in the reduce dtype, added to a
    zeroed buffer): the first micro-batch written into the buffer, the later ones added in place,
    zero_grad only a flag. One rank, ZeRO-0, nothing reduced; random gradients of every shape
    (none is -0.0, the one value whose sign the old path's 0 + g changed)."""
    zero = lesson()
    model = zero.wrap_zero(GPT(CFG, seed=SEED), None, 0, zero.Precision(**precision))
    model.require_backward_grad_sync = False
    generator = torch.Generator().manual_seed(1)
    for step in range(2):
        expected = {id(unit): torch.zeros_like(unit.grad_buffer) for unit in model.units}
        for micro_batch in range(3):
            for unit in model.units:
                grads = [torch.randn(p.shape, generator=generator).to(precision["param_dtype"]) for p in unit.params]
                flat = torch.zeros(unit.padded_numel, dtype=precision["reduce_dtype"])
                torch.cat([g.reshape(-1) for g in grads], out=flat[: unit.numel])
                expected[id(unit)] += flat
                model._reduce(unit, grads)
        for unit in model.units:
            bits = torch.int32 if unit.grad_buffer.dtype == torch.float32 else torch.int16
            assert torch.equal(unit.grad_buffer.view(bits), expected[id(unit)].view(bits)), (step, unit.names[0])
        model.zero_grad()


# ----------------------------------------------------------------------------- the script


def launch_lesson(*flags: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
         str(REPO_ROOT / "06_zero.py"), *flags],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"),
        cwd=REPO_ROOT)


def test_torchrun_script_trains_and_refuses_bad_configurations():
    """The lesson as a user runs it (ZeRO-3, bf16 with fp32 master): loss falling, model states and
    traffic equal to the formulas, the gathered peak equal to its prediction. Three bad
    configurations at the same time: one `error:` line each, exit code 2, no traceback."""
    run = launch_lesson("--steps", "12", "--seq-len", "64", "--dtype", "bfloat16")
    bad = {"pipeline": launch_lesson("--pp", "2", "--dp", "1"),
           "reduce": launch_lesson("--dtype", "float32", "--reduce-dtype", "bfloat16"),
           "degrees": launch_lesson("--dp", "3")}
    stdout, stderr = run.communicate(timeout=300)
    assert run.returncode == 0, stdout + stderr
    losses = [float(x) for x in re.findall(r"^step +\d+ \| loss (\d+\.\d+) \| grad norm", stdout, re.M)]
    assert len(losses) == 12 and sum(losses[-3:]) / 3 < losses[0] - 0.5, stdout
    rows = re.findall(r"^(?:parameters|gradients|master_weights|optimizer_states|total) +(\S+) +(\S+)$", stdout, re.M)
    assert len(rows) == 5 and all(measured == predicted for measured, predicted in rows), stdout
    assert re.search(r"gathered weights at the peak: (\S+) MB measured, \1 MB predicted", stdout), stdout
    comm_rows = re.findall(r"^\S+ +dp +\S+ +(\S+) +(\S+) +\S+$", stdout, re.M)
    assert len(comm_rows) == 3 and all(m == p for m, p in comm_rows), stdout
    outputs = {name: process.communicate(timeout=120) for name, process in bad.items()}
    for name, process in bad.items():
        err = outputs[name][1]
        assert process.returncode != 0 and err.count("error: ") == 1, (name, err)
        assert re.search(r"exitcode\s*:\s*2\b", err) and "Traceback" not in err.split("error: ")[0], err
    assert "--pp 2: this lesson teaches its technique with data parallelism alone; pipeline parallelism " \
           "composes with it in lesson 07" in outputs["pipeline"][1]
    assert "--reduce-dtype bfloat16 with --dtype float32" in outputs["reduce"][1]
    assert "dp*pp*cp*tp = 3*1*1*1 = 3 but the world size is 2" in outputs["degrees"][1]
