"""Validation in lessons 02-07 proven equal to one device: each lesson's evaluate(batch), the one its
main() hands the shared loop, gives the loss the one-device reference computes over every
validation token of the same batches.

One spawn of 4 gloo ranks runs every layout in turn on the same ranks: 02's tensor parallelism with
sequence parallelism (the vocab-parallel loss), 03's forward-only interleaved pipeline, 04's ring
attention inside a pipeline, 05's experts over ep (the balancing losses are not part of the
validation loss: the reference's forward returns the cross-entropy alone), 06's ZeRO-3 with its
units kept gathered after forward, through 07's parallelize() with recomputation, and 07's
interleaved pipeline under ZeRO-1. A last layout
trains through the shared loop with validation after every step and must still equal one device.

Tolerances: at the initial weights, the same float32 sums in another order (split matmuls, ring
merges, sums over ranks) move a loss of ~5.7 by a few ulp: rel 1e-6, as lesson 02's loss tests.
After AdamW steps, the losses' tolerance of lessons 03-06's training tests: 1e-5 absolute.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
from dataclasses import replace
from functools import partial

import pytest
import torch

from picotron_like import comm, train
from picotron_like.data import BatchShape, TokenBatches, builtin_corpus_paths
from picotron_like.lessons import load_lesson
from picotron_like.metrics import BalancingLog, RoutingMeter
from picotron_like.model import GPT, get_config
from picotron_like.moe import moe_layers
from picotron_like.pipeline_tools import simulate_pipeline
from picotron_like.testing import run_ranks, train_reference
from picotron_like.topology import GridShape, ProcessGrid

CFG = replace(get_config("tiny"), n_layers=2, hidden=64, n_heads=4, n_kv_heads=2, ffn_hidden=128)
CFG4 = replace(CFG, n_layers=4)      # interleaved: pp 2 x 2 virtual stages, a layer each
MOE_CFG = replace(get_config("tiny-moe"), n_layers=2, hidden=64, n_heads=4, n_kv_heads=2, ffn_hidden=64,
                  aux_loss_coef=1e-2, z_loss_coef=1e-3)
SEQ, MICRO, GLOBAL_SEQUENCES, VAL_BATCHES, SEED, LR, ADAM_EPS = 32, 2, 8, 2, 7, 3e-3, 1e-4
CPU = torch.device("cpu")
SETTINGS = train.StepSettings(CPU)


def val_batches(dp: int) -> TokenBatches:
    shape = BatchShape(MICRO, SEQ, GLOBAL_SEQUENCES // (MICRO * dp), dp)
    return TokenBatches(builtin_corpus_paths()[1], shape, seed=SEED, vocab_size=CFG.vocab_size)


def one_device_val_loss(cfg, params: dict | None = None) -> float:
    """The reference: one GPT, every validation token of the VAL_BATCHES global batches at once."""
    data = val_batches(1)
    windows = torch.cat([data.global_batch(index) for index in range(VAL_BATCHES)])
    model = GPT(cfg, seed=SEED).eval()
    if params is not None:
        model.load_state_dict(params, strict=False)
    with torch.no_grad():
        return model(windows[:, :-1], windows[:, 1:]).item()


def traffic():
    return {key: (entry.calls, entry.payload_bytes) for key, entry in comm.meter.traffic.items()}


def validate(evaluate, grid: ProcessGrid, cut=None) -> float:
    """The shared loop's validation of `evaluate`, and proof that its traffic stays out of the
    meter (the reports compare training's traffic with its formula)."""
    before = traffic()
    with train.traffic_not_counted():
        rank_batches = train.RankBatches(val_batches(grid.dp_size), grid.dp_rank, CPU, cut=cut)
        loss = train.validation_loss(evaluate, rank_batches.step_batch, VAL_BATCHES)
        assert traffic() != before, "validation runs collectives"
    assert traffic() == before
    return loss


def tensor_parallel_layout() -> float:
    """Lesson 02's main: dp 2 x tp 2 with sequence parallelism, 01's evaluate on 02's model."""
    tp, dp = load_lesson("02_tensor_parallel"), load_lesson("01_data_parallel")
    grid = ProcessGrid(GridShape(dp=2, tp=2))
    module = tp.apply_tensor_parallel(GPT(CFG, seed=SEED), grid.tp_group, sequence_parallel=True)
    model = dp.wrap_data_parallel(module, grid.dp_group, "bucketed", 2**20)
    return validate(partial(dp.evaluate, model, settings=SETTINGS), grid)


def pipeline_layout() -> float:
    """Lesson 03's main: dp 2 x pp 2, interleaved with 2 chunks per rank, forward only."""
    pp = load_lesson("03_pipeline_parallel")
    grid = ProcessGrid(GridShape(dp=2, pp=2))
    shape = val_batches(2).shape
    chunks = pp.build_model_chunks(CFG4, SEED, grid, CPU, virtual_stages=2)
    pipeline = pp.Pipeline(chunks, grid, "interleaved", shape.grad_accum, 2, pp.activation_shape(CFG4, shape), CPU)
    return validate(partial(pp.evaluate, pipeline, settings=SETTINGS), grid)


def context_parallel_layout() -> float:
    """Lesson 04's main: dp 2 x cp 2, ring attention, the sequences cut zigzag."""
    cp_lesson = load_lesson("04_context_parallel")
    grid = ProcessGrid(GridShape(dp=2, cp=2))
    cp = cp_lesson.ContextParallel.from_grid(grid, zigzag=True)
    model = cp_lesson.build_model(CFG, SEED, grid, cp, "ring", CPU)
    return validate(partial(load_lesson("01_data_parallel").evaluate, model, settings=SETTINGS), grid,
                    cp_lesson.sequence_cut(grid, zigzag=True))


def expert_parallel_layout() -> tuple[float, bool]:
    """Lesson 05's main: dp 4 with experts over ep 2, grouped, aux and z losses on. Validation must
    leave the routing state alone: the load the router biases balance on, the balancing-loss log,
    and the every-step routing meter that predicts the all-to-all traffic."""
    moe = load_lesson("05_expert_parallel")
    grid = ProcessGrid(GridShape(dp=4), ep=2)
    shape = val_batches(4).shape
    model = moe.build_model(MOE_CFG, SEED, grid, CPU, moe.grouped_experts, shape.sequences_per_step)
    loads = [layer.expert_load.clone() for layer in moe_layers(model)]
    log, routing = BalancingLog([model], (grid.dp_group,)), RoutingMeter([model])
    with routing:
        loss = validate(partial(moe.evaluate, model, settings=SETTINGS), grid)
    untouched = (all(torch.equal(layer.expert_load, load) for layer, load in zip(moe_layers(model), loads))
                 and not log.totals.any() and not routing.calls)
    return loss, untouched


def full_5d_args(grid: GridShape, *flags: str) -> argparse.Namespace:
    accum = GLOBAL_SEQUENCES // (MICRO * grid.dp)
    return load_lesson("07_full_5d").parse_args(
        ["--dp", str(grid.dp), "--tp", str(grid.tp), "--pp", str(grid.pp), "--cp", str(grid.cp), "--seq-len", str(SEQ),
         "--micro-batch-size", str(MICRO), "--grad-accum", str(accum), "--seed", str(SEED), "--lr", str(LR), *flags])


def zero3_layout() -> tuple[float, bool]:
    """Lessons 06 and 07's main: dp 4, ZeRO-3 keeping units gathered from forward to backward,
    recomputation on. With no backward to free them, evaluate does: a step starts from shards."""
    full_5d = load_lesson("07_full_5d")
    grid = ProcessGrid(GridShape(dp=4))
    args = full_5d_args(grid.shape, "--zero-stage", "3", "--no-reshard-after-forward", "--recompute", "full")
    model, _ = full_5d.parallelize(CFG, grid, args, CPU)
    loss = validate(partial(full_5d.evaluate, model, settings=SETTINGS), grid)
    return loss, all(param.numel() == 0 for unit in model.units for param in unit.params)


def interleaved_zero_layout() -> float:
    """Lesson 07's main: pp 2 x dp 2 interleaved (two chunks per rank under one ZeRO-1 wrapper),
    selective recomputation; the forward-only program through each chunk's PipelineChunk."""
    full_5d = load_lesson("07_full_5d")
    grid = ProcessGrid(GridShape(dp=2, pp=2))
    args = full_5d_args(grid.shape, "--zero-stage", "1", "--recompute", "selective", "--schedule", "interleaved",
                        "--virtual-stages", "2")
    _, pipeline = full_5d.parallelize(CFG4, grid, args, CPU)
    return validate(partial(full_5d.evaluate, pipeline, settings=SETTINGS), grid)


def trained_with_validation(metrics_path: str) -> None:
    """07 through the shared loop: dp 2 x tp 2, ZeRO-2, two steps (at the peak learning rate: one
    warm-up step, no decay yet), validation after each, the values in the --metrics file."""
    full_5d = load_lesson("07_full_5d")
    zero = full_5d.zero
    grid = ProcessGrid(GridShape(dp=2, tp=2))
    args = full_5d_args(grid.shape, "--zero-stage", "2", "--steps", "2", "--warmup-steps", "1",
                        "--val-every", "1", "--val-batches", str(VAL_BATCHES), "--metrics", metrics_path)
    model, _ = full_5d.parallelize(CFG, grid, args, CPU)
    optimizer = zero.build_sharded_optimizer(model, LR)
    for group in optimizer.param_groups:
        group["eps"] = ADAM_EPS
    settings = full_5d.step_settings(grid, CPU, model.precision, args.max_grad_norm)
    data = TokenBatches(builtin_corpus_paths()[0], val_batches(2).shape, seed=SEED, vocab_size=CFG.vocab_size)
    with contextlib.redirect_stdout(io.StringIO()):
        train.train(args, optimizer, partial(full_5d.train_step, model, optimizer, settings=settings),
                    train.RankBatches(data, grid.dp_rank, CPU, val=val_batches(2)),
                    evaluate=partial(full_5d.evaluate, model, settings=settings), cfg=CFG)


def every_layout(metrics_path: str) -> dict:
    results = {"02 dp2 x tp2 SP": tensor_parallel_layout(), "03 dp2 x pp2 interleaved": pipeline_layout(),
               "04 dp2 x cp2 ring": context_parallel_layout(), "05 dp4 ep2": expert_parallel_layout(),
               "06/07 dp4 ZeRO-3 kept gathered": zero3_layout(), "07 pp2 x dp2 interleaved": interleaved_zero_layout()}
    trained_with_validation(metrics_path)
    return results


def test_every_lessons_validation_equals_one_device(tmp_path):
    metrics_path = tmp_path / "metrics.jsonl"
    runs = run_ranks(4, every_layout, str(metrics_path), timeout_s=120)
    dense, moe = one_device_val_loss(CFG), one_device_val_loss(MOE_CFG)
    for rank, result in enumerate(runs):
        for name in ("02 dp2 x tp2 SP", "04 dp2 x cp2 ring"):
            assert result[name] == pytest.approx(dense, rel=1e-6, abs=0), (rank, name)
        for name in ("03 dp2 x pp2 interleaved", "07 pp2 x dp2 interleaved"):
            assert result[name] == pytest.approx(one_device_val_loss(CFG4), rel=1e-6, abs=0), (rank, name)
        loss, untouched = result["05 dp4 ep2"]
        assert loss == pytest.approx(moe, rel=1e-6, abs=0) and untouched, rank
        loss, released = result["06/07 dp4 ZeRO-3 kept gathered"]
        assert loss == pytest.approx(dense, rel=1e-6, abs=0) and released, rank

    one_device = TokenBatches(builtin_corpus_paths()[0], BatchShape(MICRO, SEQ, GLOBAL_SEQUENCES // MICRO, 1),
                              seed=SEED, vocab_size=CFG.vocab_size)
    reference = {steps: train_reference(CFG, SEED, one_device, steps, LR, adam_eps=ADAM_EPS) for steps in (1, 2)}
    records = [json.loads(line) for line in metrics_path.read_text().splitlines()]
    # The steps after a validation still equal one device: validation changed nothing in the run.
    torch.testing.assert_close(torch.tensor([r["loss"] for r in records]), torch.tensor(reference[2]["losses"]),
                               rtol=0, atol=1e-5)
    torch.testing.assert_close(torch.tensor([r["val_loss"] for r in records]),
                               torch.tensor([one_device_val_loss(CFG, reference[steps]["params"]) for steps in (1, 2)]),
                               rtol=0, atol=1e-5)


@pytest.mark.parametrize("schedule, pp, n_micro, virtual_stages", [
    ("afab", 2, 3, 1), ("1f1b", 4, 4, 1), ("1f1b", 4, 8, 1), ("1f1b", 3, 2, 1), ("interleaved", 2, 4, 2),
    ("interleaved", 4, 8, 2), ("interleaved", 4, 4, 3)])
def test_forward_only_programs_cannot_deadlock(schedule, pp, n_micro, virtual_stages):
    """Lesson 03's forward-only program (validation) for each schedule: every rank runs each of its
    chunks' m forwards once, no backward, and the simulator finds every transfer matched."""
    lesson = load_lesson("03_pipeline_parallel")
    programs = []
    for rank in range(pp):
        units = lesson.forward_units(lesson.SCHEDULES[schedule](pp, rank, n_micro, virtual_stages))
        programs.append(lesson.communication_program(units, pp, rank, virtual_stages))
    events = simulate_pipeline(programs, virtual_stages=virtual_stages)
    for rank_events in events:
        actions = sorted((action.chunk, action.micro_batch) for action, _, _ in rank_events)
        assert all(action.kind == "F" for action, _, _ in rank_events)
        assert actions == [(chunk, micro) for chunk in range(virtual_stages) for micro in range(n_micro)]
