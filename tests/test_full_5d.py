"""Lesson 07 proven: the composed trainer equal to one device, and recomputation changing nothing but memory.

One spawn of 4 gloo ranks runs several layouts, each with --recompute none and full, built by
07's own parallelize() from its own flags. Recomputation repeats the same float operations in the
same order, so full and none agree to float32 rounding (lesson 06's tolerances: 1e-6 on gradients
before and after clipping, 1e-5 on losses, 1e-2 lr on parameters after AdamW). Dense layouts are
also compared with the one-device reference; the experts' layout with its none run, which lesson
06's tests prove equal to lesson 05 and so to one device. Activations kept for backward and the
recomputed forward's traffic are compared with their formulas byte for byte.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import replace

import torch

from picotron_like import comm
from picotron_like.data import BatchShape, TokenBatches, builtin_corpus_paths
from picotron_like.metrics import ActivationMeter
from picotron_like.model import get_config
from picotron_like.testing import run_ranks, train_reference
from picotron_like.topology import REPO_ROOT, GridShape, ProcessGrid, load_lesson
from test_zero import ADAM_EPS, PARAM_TOLERANCE, TOLERANCE, gathered, observe_gradients

CFG = replace(get_config("tiny"), n_layers=2, hidden=64, n_heads=4, n_kv_heads=2, ffn_hidden=128)
MOE_CFG = replace(get_config("tiny-moe"), n_layers=2, hidden=64, n_heads=4, n_kv_heads=2, ffn_hidden=64)
SEQ, MICRO, GLOBAL_SEQUENCES, STEPS, LR, SEED, MAX_GRAD_NORM = 32, 2, 8, 3, 3e-3, 7, 1.0
CPU = torch.device("cpu")
# name: (grid, ep, ZeRO stage, model, extra flags)
LAYOUTS = {"dp2 x tp2 ZeRO-1": (GridShape(dp=2, tp=2), 1, 1, CFG, ()),
           "dp2 x tp2 SP ZeRO-2": (GridShape(dp=2, tp=2), 1, 2, CFG, ("--sequence-parallel",)),
           "pp2 x cp2 ZeRO-1": (GridShape(pp=2, cp=2), 1, 1, CFG, ()),
           "dp4 ZeRO-3": (GridShape(dp=4), 1, 3, CFG, ()),
           "dp2 x cp2 moe ep2 ZeRO-1": (GridShape(dp=2, cp=2), 2, 1, MOE_CFG, ())}


def lesson():
    return load_lesson("07_full_5d")


def flags(grid: GridShape, stage: int, recompute: str, extra=()) -> list[str]:
    accum = GLOBAL_SEQUENCES // (MICRO * grid.dp)
    return ["--dp", str(grid.dp), "--tp", str(grid.tp), "--pp", str(grid.pp), "--cp", str(grid.cp),
            "--zero-stage", str(stage), "--recompute", recompute, "--seq-len", str(SEQ), "--micro-batch-size",
            str(MICRO), "--grad-accum", str(accum), "--seed", str(SEED), "--lr", str(LR), *extra]


def run(grid: ProcessGrid, stage: int, recompute: str, cfg, extra=()) -> dict:
    full_5d = lesson()
    zero = full_5d.zero
    args = full_5d.parse_args(flags(grid.shape, stage, recompute, extra))
    model, pipeline = full_5d.parallelize(cfg, grid, args, CPU)
    optimizer = zero.build_sharded_optimizer(model, LR)
    for group in optimizer.param_groups:
        group["eps"] = ADAM_EPS
    seen = observe_gradients(model, optimizer)
    settings = zero.step_settings(grid, CPU, zero.Precision(), MAX_GRAD_NORM)
    data = TokenBatches(builtin_corpus_paths()[0], BatchShape(MICRO, SEQ, args.grad_accum, grid.dp_size), seed=SEED,
                        vocab_size=cfg.vocab_size)
    cut = full_5d.context_parallel.sequence_cut(grid, args.zigzag) or (lambda batch: batch)
    meter = ActivationMeter(model.module)
    comm.meter.reset()
    results = []
    for step in range(STEPS):
        with meter if step == 0 else torch.enable_grad():
            results.append(zero.train_step(model if pipeline is None else pipeline, optimizer,
                                           cut(data.step_batch(step, grid.dp_rank)), settings))
    shape = data.shape
    return {"grads": seen["before"], "clipped_grads": seen["after"], "params": gathered(model, lambda u: u.master),
            "losses": [r.loss for r in results], "norms": [r.grad_norm for r in results],
            "kept": meter.peak_bytes, "pipeline": pipeline is not None,
            "predicted_kept": full_5d.predicted_kept_activation_bytes(cfg, MICRO, SEQ, recompute, grid.tp_size,
                                                                       args.sequence_parallel, grid.cp_size),
            "traffic": {key: value.payload_bytes for key, value in comm.meter.traffic.items()},
            "predicted_extra": {key: STEPS * value for key, value in full_5d.predicted_recompute_traffic(
                cfg, shape, grid, len(model.module.layers), recompute, "ring", args.sequence_parallel).items()}}


def every_layout() -> dict:
    runs = {}
    for name, (shape, ep, stage, cfg, extra) in LAYOUTS.items():
        grid = ProcessGrid(shape, ep=ep)
        for recompute in ("none", "full"):
            runs[name, recompute] = run(grid, stage, recompute, cfg, extra)
    return runs


def assert_close(run: dict, expected: dict, where: str) -> None:
    for key in ("grads", "clipped_grads"):
        for name in run[key]:
            torch.testing.assert_close(run[key][name], expected[key][name], **TOLERANCE, msg=f"{where} {key} {name}")
    for key in ("losses", "norms"):
        torch.testing.assert_close(torch.tensor(run[key]), torch.tensor(expected[key]), rtol=0, atol=1e-5, msg=where)
    for name in run["params"]:
        torch.testing.assert_close(run["params"][name], expected["params"][name], **PARAM_TOLERANCE,
                                   msg=f"{where} param {name}")


def test_layouts_equal_one_device_with_and_without_recomputation():
    """Each layout: full == none (gradients before and after clipping, losses, norms, parameters
    after 3 AdamW steps); dense ones == one device (a stage's parameters on pipeline ranks; tp
    ranks hold shards, so their losses and norms); kept activations equal to the formula without a
    pipeline (ZeRO-0 to 2) and smaller under full; the recomputed forward's extra traffic on tp and
    cp equal to its formula."""
    one_device = TokenBatches(builtin_corpus_paths()[0], BatchShape(MICRO, SEQ, GLOBAL_SEQUENCES // MICRO, 1),
                              seed=SEED, vocab_size=CFG.vocab_size)
    reference = train_reference(CFG, SEED, one_device, STEPS, LR, MAX_GRAD_NORM, adam_eps=ADAM_EPS)
    assert min(reference["norms"]) > MAX_GRAD_NORM, "clipping must act, or the clipped gradients prove nothing"
    for rank, runs in enumerate(run_ranks(4, every_layout, timeout_s=240)):
        for name, (shape, _, stage, cfg, _) in LAYOUTS.items():
            none, full, where = runs[name, "none"], runs[name, "full"], f"rank={rank} {name}"
            assert_close(full, none, f"{where} full vs none")
            if cfg is CFG and shape.tp == 1:
                assert_close(none, reference, f"{where} vs one device")
            elif cfg is CFG:
                torch.testing.assert_close(torch.tensor(none["losses"]), torch.tensor(reference["losses"]),
                                           rtol=0, atol=1e-5)
            if cfg is CFG and not none["pipeline"] and stage < 3:
                assert none["kept"] == none["predicted_kept"] and full["kept"] == full["predicted_kept"], where
            assert full["kept"] < none["kept"], where
            added = {key: full["traffic"].get(key, 0) - none["traffic"].get(key, 0)
                     for key in full["traffic"] if key[1] in ("tp", "cp")}
            if cfg is CFG:
                assert {k: v for k, v in added.items() if v} == full["predicted_extra"], where


def test_torchrun_script_trains_and_refuses_bad_configurations():
    """The lesson as a user runs it (dp2 x tp2, ZeRO-1, recompute full): loss falling, kept
    activations equal to the formula, every traffic row equal to its prediction; bad
    configurations refused in one line, before any process group."""
    process = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4",
         str(REPO_ROOT / "07_full_5d.py"), "--dp", "2", "--tp", "2", "--zero-stage", "1", "--recompute", "full",
         "--steps", "10", "--seq-len", "64"],
        capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"), cwd=REPO_ROOT, timeout=300)
    stdout = process.stdout
    assert process.returncode == 0, stdout + process.stderr
    losses = [float(x) for x in re.findall(r"^step +\d+ \| loss (\d+\.\d+)", stdout, re.M)]
    assert len(losses) == 10 and sum(losses[-3:]) / 3 < losses[0] - 0.5, stdout
    assert re.search(r"kept for backward: (\S+) MB measured, \1 MB predicted", stdout), stdout
    rows = re.findall(r"^\S+ +(?:dp_cp|tp) +\S+ +(\S+) +(\S+) +\S+$", stdout, re.M)
    assert len(rows) == 4 and all(measured == predicted for measured, predicted in rows), stdout

    full_5d = lesson()
    for argv, message in [(["--pp", "2", "--zero-stage", "2"], "--pp 2 with --zero-stage 2"),
                          (["--tp", "3"], "world size"),
                          (["--preset", "tiny-moe", "--zero-stage", "0", "--ep", "2"], "--zero-stage 0: experts")]:
        args = full_5d.parse_args(argv)
        grid = GridShape(dp=2, pp=args.pp, tp=args.tp)
        try:
            full_5d.validate(get_config(args.preset), grid, BatchShape(4, 128, 2, 2), args, 4)
        except Exception as error:  # noqa: BLE001 - the message is what is checked
            assert message in str(error), (argv, str(error))
        else:
            raise AssertionError(f"{argv} must be refused")
