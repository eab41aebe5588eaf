"""Lesson 07 proven: the composed trainer equal to one device, and recomputation changing nothing but memory.

One spawn of 4 gloo ranks runs several layouts, each with --recompute none, selective and full,
built by 07's own parallelize() from its own flags. Recomputation repeats the same float
operations in the same order, so selective, full and none agree to rounding (lesson 06's
tolerances: 1e-6 on gradients before and after clipping, 1e-5 on losses, 1e-2 lr on parameters
after AdamW). Dense float32 layouts are also compared with the one-device reference; the experts'
layouts and the bf16 ones with their none run (tests/test_full_5d_expert_composition.py proves
experts with every axis equal to one device, lesson 06's tests the bf16 regime), and 07 with lesson
05's router and balancing flags on dp 4 with lesson 05 itself. Activations kept for backward, at their peak in a step (a pipeline stage's, a
layout with experts on its step's routing, bf16), and the recomputed forward's traffic are
compared with their formulas byte for byte, and so is every row of the report's traffic table.
Two layouts run lesson 03's interleaved schedule (two chunks per pipeline rank, one ZeRO wrapper
over both), dense against one device and with experts against its none run.
One process measures the alternative selective recomputation that lesson 07's docstring
rejects: the attention core.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from contextlib import ExitStack
from dataclasses import replace
from functools import partial

import pytest
import torch
from torch.utils.checkpoint import checkpoint

import picotron_like.checkpoint as checkpoints
from picotron_like import comm
from picotron_like.data import BatchRamp, BatchShape, TokenBatches, builtin_corpus_paths
from picotron_like.lessons import REPO_ROOT, load_lesson
from picotron_like.metrics import (ActivationMeter, BalancingLog, GatheredParameterMeter, RoutingMeter, SavedTensorMeters,
                                   add_traffic)
from picotron_like.model import GPT, get_config
from picotron_like.testing import masked_step_batch, run_ranks, train_reference
from picotron_like.topology import GridShape, ProcessGrid
from picotron_like.train import batch_shape, build_optimizer
from test_zero import ADAM_EPS, PARAM_TOLERANCE, TOLERANCE, gathered, observe_gradients

CFG = replace(get_config("tiny"), n_layers=2, hidden=64, n_heads=4, n_kv_heads=2, ffn_hidden=128)
MOE_CFG = replace(get_config("tiny-moe"), n_layers=2, hidden=64, n_heads=4, n_kv_heads=2, ffn_hidden=64)
CFG4 = replace(CFG, n_layers=4)     # pp 2 x 2 virtual stages: one layer per chunk
SEQ, MICRO, GLOBAL_SEQUENCES, STEPS, LR, SEED, MAX_GRAD_NORM = 32, 2, 8, 3, 3e-3, 7, 1.0
CPU = torch.device("cpu")
MODES = ("none", "selective", "full")
BF16 = ("--dtype", "bfloat16")
INTERLEAVED = ("--schedule", "interleaved", "--virtual-stages", "2")
AUX = ("--aux-loss-coef", "0.01")
# Lesson 05's router and balancing flags through 07's: DeepSeek-V3's sigmoid router, a shared
# expert, the auxiliary loss and auxiliary-loss-free bias balancing.
MOE_FLAGS = ("--router", "sigmoid", "--shared-experts", "1", *AUX, "--bias-update-rate", "1e-3")
# name: (grid, ep, ZeRO stage, model, extra flags)
LAYOUTS = {"dp2 x tp2 ZeRO-1": (GridShape(dp=2, tp=2), 1, 1, CFG, ()),
           "dp2 x tp2 SP ZeRO-2": (GridShape(dp=2, tp=2), 1, 2, CFG, ("--sequence-parallel",)),
           "pp2 x cp2 ZeRO-1": (GridShape(pp=2, cp=2), 1, 1, CFG, ()),
           "dp4 ZeRO-3": (GridShape(dp=4), 1, 3, CFG, ()),
           "dp2 x cp2 moe ep2 ZeRO-1": (GridShape(dp=2, cp=2), 2, 1, MOE_CFG, AUX),
           "dp2 x cp2 moe ep2 ZeRO-1 bf16": (GridShape(dp=2, cp=2), 2, 1, MOE_CFG, (*AUX, *BF16)),
           "dp2 x cp2 moe ep2 ZeRO-1 sigmoid, shared, bias": (GridShape(dp=2, cp=2), 2, 1, MOE_CFG, MOE_FLAGS),
           "pp2 x tp2 SP ZeRO-1 bf16": (GridShape(pp=2, tp=2), 1, 1, CFG, ("--sequence-parallel", *BF16)),
           "pp2 x dp2 interleaved ZeRO-1": (GridShape(dp=2, pp=2), 1, 1, CFG4, INTERLEAVED),
           "pp2 x dp2 moe ep2 interleaved ZeRO-1": (GridShape(dp=2, pp=2), 2, 1, replace(MOE_CFG, n_layers=4),
                                                     (*INTERLEAVED, *AUX))}
# --optimizer muon at AdamW's lr, so that the parameters' tolerance (1e-2 lr) means the same for both
MUON = ("--optimizer", "muon", "--muon-lr", str(LR))
# A batch-size ramp (--batch-ramp), run with --recompute none: a batch of 1,024 tokens reached after
# 1,500 from 256, each step's micro-batches per rank rounded up by the layout (pp 2: at least 2;
# interleaved: a multiple of 2), so three steps train three sizes, each layout's own: dp 2 (ZeRO-2's
# and ZeRO-3's per-micro-batch reductions and gathers, over dp x cp), pp 2 (1F1B) and interleaved.
RAMP = ("--global-batch-tokens", "1024", "--batch-ramp", "256", "1500")
RAMP_LAYOUTS = {"dp2 x cp2 ZeRO-2 ramp": (GridShape(dp=2, cp=2), 1, 2, CFG, RAMP),
                "dp2 x cp2 ZeRO-3 ramp": (GridShape(dp=2, cp=2), 1, 3, CFG, RAMP),
                "pp2 x cp2 ZeRO-1 ramp": (GridShape(pp=2, cp=2), 1, 1, CFG, RAMP),
                "pp2 x dp2 interleaved ZeRO-1 ramp": (GridShape(dp=2, pp=2), 1, 1, CFG4, (*INTERLEAVED, *RAMP))}
# This layout also runs once with --ring-kernel plain (lesson 04's blocks spelled out) instead of fused.
PLAIN_RING = "pp2 x cp2 ZeRO-1"
# Lesson 05's flags once more on dp 4 (lesson 05 is data parallelism alone), run by 07 (--recompute
# none) and by lesson 05 itself on the same ranks.
LESSON_05_LAYOUT = (GridShape(dp=4), 2, 1, MOE_CFG, MOE_FLAGS)


def lesson():
    return load_lesson("07_full_5d")


def flags(grid: GridShape, stage: int, recompute: str, extra=(), seq_len: int = SEQ) -> list[str]:
    accum = GLOBAL_SEQUENCES // (MICRO * grid.dp)
    return ["--dp", str(grid.dp), "--tp", str(grid.tp), "--pp", str(grid.pp), "--cp", str(grid.cp),
            "--zero-stage", str(stage), "--recompute", recompute, "--seq-len", str(seq_len), "--micro-batch-size",
            str(MICRO), "--grad-accum", str(accum), "--seed", str(SEED), "--lr", str(LR), *extra]


def muon_optimizer(model) -> torch.optim.Optimizer:
    """The one-device reference's optimizer under MUON's flags: lesson 06_zero_muon's Muon for the
    blocks' matrices, AdamW for the rest."""
    zero_muon = load_lesson("06_zero_muon")
    return zero_muon.build_muon_optimizer(model, LR, zero_muon.MuonSettings(lr=LR))


def held_part(model, grid: ProcessGrid):
    """local(full, name): the part of the reference tensor `name` this rank holds (its experts, then
    its tp shard)."""
    split_dims = {name: getattr(param, "tp_split_dim", None) for name, param in model.module.named_parameters()}

    def local(full: torch.Tensor, name: str) -> torch.Tensor:
        mine = full.chunk(grid.ep_size, dim=0)[grid.ep_rank] if ".mlp.experts." in name else full
        return mine if split_dims[name] is None else mine.chunk(grid.tp_size, dim=split_dims[name])[grid.tp_rank]
    return local


def replay(model, optimizer, clipped_grads: list[dict], local) -> None:
    """Before each step every master piece's gradient replaced by its part of the one-device run's
    clipped gradient of that step (`local(full, name)`: the part this rank holds). Why: Muon's
    Newton-Schulz iteration works in bf16 with a slope of 3.4 at zero per iteration, so a float32
    rounding difference in a gradient that flips one bf16 rounding of the momentum grows, over 3
    free steps, to 0.06 lr in some parameters (measured on dp 4 alone, where only lesson 06_zero_muon
    runs). Fed the one device's gradients, the distributed step must give the one device's bits:
    each layout's optimizer is proven exactly, its gradients against one device at step 0 and its
    losses at every step (tests/test_zero_muon.py replays the same way)."""
    pieces = list(checkpoints.master_pieces(model))
    steps = iter(clipped_grads)

    def with_reference_gradients(*_):
        grads = next(steps)
        for _, name, _, start, master in pieces:
            master.grad = local(grads[name], name).reshape(-1)[start: start + master.numel()].clone()

    optimizer.register_step_pre_hook(with_reference_gradients)


def optimizer_of(model, grid: ProcessGrid, args, replayed: list[dict] | None = None) -> torch.optim.Optimizer:
    """07's optimizer for the flags (build_optimizer), AdamW's eps ADAM_EPS (test_zero's reason);
    `replayed`: the one-device run's clipped gradients of every step, which Muon steps with (replay)."""
    optimizer = lesson().build_optimizer(model, grid, args)
    for group in optimizer.param_groups:
        if "eps" in group:
            group["eps"] = ADAM_EPS
    if replayed is not None:
        replay(model, optimizer, replayed, held_part(model, grid))
    return optimizer


def run(grid: ProcessGrid, stage: int, recompute: str, cfg, extra=(), seq_len: int = SEQ,
        mask_targets=None, replayed: list[dict] | None = None) -> dict:
    """Three steps as 07's main runs them, step 0 metered (activations; with experts, every step's
    routing), with lesson 05's router and balancing flags applied to `cfg` (moe_config); on
    sequences of seq_len tokens, the targets masked by `mask_targets` if given (masked_step_batch);
    under Muon stepped with the one-device run's gradients `replayed` (replay); under --batch-ramp
    each step of its own size (07's ramp_of_layout), predicted for its own count."""
    full_5d = lesson()
    args = full_5d.parse_args(flags(grid.shape, stage, recompute, extra, seq_len))
    cfg = full_5d.expert_parallel.moe_config(cfg, args)
    model, pipeline = full_5d.parallelize(cfg, grid, args, CPU)
    optimizer = optimizer_of(model, grid, args, replayed)
    seen = observe_gradients(model, optimizer)
    settings = full_5d.step_settings(grid, CPU, model.precision, MAX_GRAD_NORM)
    full = BatchShape(MICRO, seq_len, batch_shape(args, grid.dp_size).grad_accum, grid.dp_size)
    data = TokenBatches(builtin_corpus_paths()[0], full, seed=SEED, vocab_size=cfg.vocab_size)
    data = data.with_ramp(full_5d.ramp_of_layout(args, grid.shape, full))
    step_batch = partial(masked_step_batch, data, mask_targets=mask_targets) if mask_targets else data.step_batch
    cut = full_5d.context_parallel.sequence_cut(grid, args.zigzag) or (lambda batch: batch)
    activations, weights = ActivationMeter(model.module), GatheredParameterMeter(model.module)
    # With experts, each step's routing counts: step 0's for the kept activations, every step's
    # for the recomputed forward's traffic.
    routings = ([RoutingMeter(load_lesson("07_report").model_parts(model, pipeline)) for _ in range(STEPS)]
                if cfg.n_experts else [])
    routing = routings[0] if routings else None
    log = full_5d.balancing_log(model, pipeline, grid)
    comm.meter.reset()
    results, biases = metered_steps(
        model, pipeline, optimizer, lambda step: cut(step_batch(step, grid.dp_rank)), settings, args, log,
        lambda step: ([SavedTensorMeters(activations, weights)] if step == 0 else []) + routings[step:step + 1])
    traffic = {key: value.payload_bytes for key, value in comm.meter.traffic.items()}
    calls = {key: value.calls for key, value in comm.meter.traffic.items()}
    shapes = [replace(data.shape, grad_accum=data.grad_accum_at(step)) for step in range(STEPS)]
    shape = shapes[0]       # the metered step's
    if pipeline is not None:
        pipeline.follow_micro_batches(shape.grad_accum)     # its schedule, as 07's main() before the report
    # Each step's prediction as the report makes it (07's recomputed forward in lesson 06's table),
    # with experts on that step's routing, for its micro-batch count.
    forwards_and_extra = [load_lesson("07_report").forwards_and_recompute_traffic(model, pipeline, cfg, shapes[step],
                                                                                  args, grid,
                                                                                  routings[step] if routings else None)
                          for step in range(STEPS)]
    return {"grads": seen["before"], "clipped_grads": seen["after"], "params": gathered(model, lambda u: u.master),
            "losses": [r.loss for r in results], "norms": [r.grad_norm for r in results], "tp_rank": grid.tp_rank,
            "calls": calls,
            "split_dims": {name: getattr(p, "tp_split_dim", None) for name, p in model.module.named_parameters()},
            "aux": [r.extra.get("aux") for r in results], "biases": biases, "kept": activations.peak_bytes, "traffic": traffic, "gathered": weights.peak_bytes,
            "predicted_gathered": load_lesson("07_report").ZeroUnits.of(model, grid).gathered_peak(
                model.precision, model.reshard_after_forward, model.prefetch) if stage == 3 else None,
            "ring_kernels": {block.attn.attention_core.keywords["cp"].ring_kernel for block in model.module.layers}
            if grid.cp_size > 1 and args.cp_mode == "ring" else set(),
            "predicted_kept": load_lesson("07_report").predicted_kept_by_mode(model, pipeline, cfg, shape, args, grid, routing),
            "predicted_extra": add_traffic(*(extra for _, extra in forwards_and_extra)),
            "predicted_traffic": add_traffic(*(load_lesson("07_report").predicted_step_traffic(
                model, pipeline, cfg, step_shape, args, grid, model.precision, forwards, 1, extra)
                for step_shape, (forwards, extra) in zip(shapes, forwards_and_extra))),
            "ramp_history": data.ramp.realised_history(STEPS) if data.ramp is not None else None}


def metered_steps(model, pipeline, optimizer, batch_of_step, settings, args, log, meters_of_step,
                  steps: int = STEPS) -> tuple[list, list]:
    """`steps` of 07's train_step as its main runs them, step s inside the meters meters_of_step(s):
    their results, and the router biases after each."""
    full_5d = lesson()
    results, biases = [], []
    for step in range(steps):
        with ExitStack() as metered:
            for meter in meters_of_step(step):
                metered.enter_context(meter)
            results.append(full_5d.train_step(model if pipeline is None else pipeline, optimizer, batch_of_step(step),
                                              settings, args.bias_update_rate, log))
        biases.append({name: bias.clone() for name, bias in model.module.named_buffers()
                       if name.endswith("router_bias")})
    return results, biases


def lesson_05_run(grid: ProcessGrid, extra) -> dict:
    """Lesson 05's own run of the same flags on the same ranks (its ExpertDataParallel, its step
    with the router-bias update and the balancing log): what 07 must equal with lesson 05's flags."""
    expert_parallel = lesson().expert_parallel
    args = expert_parallel.parse_args(["--dp", str(grid.dp_size), "--ep", str(grid.ep_size), "--seq-len", str(SEQ),
                                       "--micro-batch-size", str(MICRO), "--grad-accum",
                                       str(GLOBAL_SEQUENCES // (MICRO * grid.dp_size)), *extra])
    cfg = expert_parallel.moe_config(MOE_CFG, args)
    data = TokenBatches(builtin_corpus_paths()[0], BatchShape(MICRO, SEQ, args.grad_accum, grid.dp_size), seed=SEED,
                        vocab_size=cfg.vocab_size)
    model = expert_parallel.build_model(cfg, SEED, grid, CPU, expert_parallel.looped_experts,
                                        data.shape.sequences_per_step)
    optimizer = build_optimizer(model.module, LR)
    for group in optimizer.param_groups:
        group["eps"] = ADAM_EPS
    settings = expert_parallel.step_settings(model, grid, CPU, torch.float32, MAX_GRAD_NORM)
    log = BalancingLog([model], (grid.dp_group,))
    results, biases = [], []
    for step in range(STEPS):
        results.append(expert_parallel.train_step(model, optimizer, data.step_batch(step, grid.dp_rank), settings,
                                                  args.bias_update_rate, log))
        biases.append({name: bias.clone() for name, bias in model.module.named_buffers()
                       if name.endswith("router_bias")})
    return {"losses": [r.loss for r in results], "aux": [r.extra.get("aux") for r in results], "biases": biases,
            "params": {name: p.detach().clone() for name, p in model.module.named_parameters()}}


def every_layout() -> dict:
    runs = {}
    for name, (shape, ep, stage, cfg, extra) in LAYOUTS.items():
        grid = ProcessGrid(shape, ep=ep)
        for recompute in MODES:
            runs[name, recompute] = run(grid, stage, recompute, cfg, extra)
    shape, ep, stage, cfg, extra = LESSON_05_LAYOUT
    runs["lesson 05 flags", "07"] = run(ProcessGrid(shape, ep=ep), stage, "none", cfg, extra)
    runs["lesson 05 flags", "lesson 05"] = lesson_05_run(ProcessGrid(shape, ep=ep), extra)
    shape, ep, stage, cfg, extra = LAYOUTS[PLAIN_RING]
    runs[PLAIN_RING, "plain ring"] = run(ProcessGrid(shape, ep=ep), stage, "none", cfg,
                                         (*extra, "--ring-kernel", "plain"))
    for name, (shape, ep, stage, cfg, extra) in RAMP_LAYOUTS.items():
        runs[name, "none"] = run(ProcessGrid(shape, ep=ep), stage, "none", cfg, extra)
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


def test_layouts_equal_one_device_with_each_recompute_mode():
    """Each layout: selective == none and full == none (gradients before and after clipping,
    losses, norms, parameters after 3 AdamW steps); dense float32 ones == one device (a stage's
    parameters on pipeline ranks; tp ranks hold shards, so their losses and norms); the kept
    activations at their peak equal to the formula in every mode (ZeRO-3 too, where the same hook
    measures the gathered weights, equal to lesson 06's formula), every run predicting the same bytes for each mode, full <
    selective < none; the recomputed forward's extra traffic equal to its formula: none under
    selective, on any group, and tp's, cp's and, with experts, ep's under full (on each step's
    routing); every row of the report's traffic table equal to its prediction, experts' tp, cp and
    ep rows too (float32; on each step's routing). --ring-kernel plain reaches lesson 04's ring
    through 06's flags, and equals one device and the fused kernel's losses. Lesson 05's router and
    balancing flags on dp 4 (ep 2): 07 equal to lesson 05 itself (losses, aux losses, the router
    biases of every step bit for bit, parameters)."""
    one_device = TokenBatches(builtin_corpus_paths()[0], BatchShape(MICRO, SEQ, GLOBAL_SEQUENCES // MICRO, 1),
                              seed=SEED, vocab_size=CFG.vocab_size)
    references = {cfg: train_reference(cfg, SEED, one_device, STEPS, LR, MAX_GRAD_NORM, adam_eps=ADAM_EPS)
                  for cfg in (CFG, CFG4)}
    reference = references[CFG]
    assert min(reference["norms"]) > MAX_GRAD_NORM, "clipping must act, or the clipped gradients prove nothing"
    for rank, runs in enumerate(run_ranks(4, every_layout, timeout_s=300)):
        for name, (shape, _, stage, cfg, extra) in LAYOUTS.items():
            none, where = runs[name, "none"], f"rank={rank} {name}"
            for recompute in ("selective", "full"):
                assert_close(runs[name, recompute], none, f"{where} {recompute} vs none")
                # Full recomputation routes every token twice per step: the logged aux loss and the
                # bias update (a sign of the load's difference from its mean) must not change.
                if none["aux"][0] is not None:
                    assert runs[name, recompute]["aux"] == pytest.approx(none["aux"], rel=1e-6), f"{where} {recompute}"
                for ours, theirs in zip(runs[name, recompute]["biases"], none["biases"]):
                    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours), where
            if cfg in references and "--dtype" not in extra and shape.tp == 1:
                assert_close(none, references[cfg], f"{where} vs one device")
            elif cfg in references and "--dtype" not in extra:     # tp ranks hold shards: their losses
                torch.testing.assert_close(torch.tensor(none["losses"]), torch.tensor(references[cfg]["losses"]),
                                           rtol=0, atol=1e-5)
            predicted = none["predicted_kept"]
            assert predicted["full"] < predicted["selective"] < predicted["none"], where
            for recompute in MODES:
                run_ = runs[name, recompute]
                assert run_["predicted_kept"] == predicted, f"{where} {recompute}"
                assert run_["kept"] == predicted[recompute], f"{where} {recompute}: {run_['kept']} measured"
                if stage == 3:      # the two meters observed the same step through one hook
                    assert run_["gathered"] == run_["predicted_gathered"], f"{where} {recompute}"
                added = {key: run_["traffic"].get(key, 0) - none["traffic"].get(key, 0) for key in run_["traffic"]
                         if key[1] in ("tp", "cp", "ep")}
                assert {key: value for key, value in added.items() if value} == run_["predicted_extra"], where
                # Every row of the report's traffic table: measured == predicted. Only bf16 leaves
                # tp's, cp's and ep's unpredicted (lesson 06: their formulas count a float32 stream).
                table = run_["predicted_traffic"]
                assert {key: run_["traffic"].get(key, 0) for key in table} == table, f"{where} {recompute}"
                unpredicted = set(run_["traffic"]) - set(table)
                assert not unpredicted if "--dtype" not in extra else {key[1] for key in unpredicted} <= {
                    "tp", "cp", "ep"}, f"{where} {recompute}: {unpredicted}"
        ours, theirs, where = runs["lesson 05 flags", "07"], runs["lesson 05 flags", "lesson 05"], f"rank={rank} 05"
        torch.testing.assert_close(torch.tensor(ours["losses"]), torch.tensor(theirs["losses"]), rtol=0, atol=1e-5)
        assert ours["aux"] == pytest.approx(theirs["aux"], rel=1e-5) and all(theirs["aux"]), (ours["aux"], theirs["aux"])
        assert any(bias.abs().sum() > 0 for bias in theirs["biases"][-1].values()), "the biases must move"
        for step, (mine, lesson_05s) in enumerate(zip(ours["biases"], theirs["biases"])):
            assert all(torch.equal(mine[name], lesson_05s[name]) for name in lesson_05s), f"{where} step {step}"
        for name, value in theirs["params"].items():
            torch.testing.assert_close(ours["params"][name], value, **PARAM_TOLERANCE, msg=f"{where} param {name}")
        plain, fused, where = runs[PLAIN_RING, "plain ring"], runs[PLAIN_RING, "none"], f"rank={rank} {PLAIN_RING}"
        assert plain["ring_kernels"] == {"plain"} and fused["ring_kernels"] == {"fused"}, where
        assert_close(plain, reference, f"{where} plain ring kernel vs one device")
        torch.testing.assert_close(torch.tensor(plain["losses"]), torch.tensor(fused["losses"]), rtol=0, atol=1e-5,
                                   msg=where)
        check_ramps(runs, rank)


def check_ramps(runs: dict, rank: int) -> None:
    """Each ramped layout equals one device fed the same batches, step by step (a ramp whose
    history is the layout's: losses, norms, gradients before and after clipping, parameters after
    3 steps); its three steps train three sizes; its kept activations (step 0's count) and every
    row of its traffic table (each step's count) equal their formulas."""
    for name, (_, _, _, cfg, _) in RAMP_LAYOUTS.items():
        ramped, where = runs[name, "none"], f"rank={rank} {name}"
        sizes = [tokens for tokens, steps in ramped["ramp_history"] for _ in range(steps)]
        assert len(set(sizes)) == STEPS and sizes[0] == 256 and sizes == sorted(sizes), (where, sizes)
        one_device = TokenBatches(builtin_corpus_paths()[0], BatchShape(MICRO, SEQ, 1024 // (MICRO * SEQ), 1),
                                  seed=SEED, vocab_size=cfg.vocab_size)
        one_device = one_device.with_ramp(BatchRamp(256, 1500, 1024 // (MICRO * SEQ), MICRO * SEQ,
                                                    history=ramped["ramp_history"]))
        reference = train_reference(cfg, SEED, one_device, STEPS, LR, MAX_GRAD_NORM, adam_eps=ADAM_EPS)
        assert min(reference["norms"]) > MAX_GRAD_NORM, "clipping must act, or the clipped gradients prove nothing"
        assert_close(ramped, reference, f"{where} vs one device")
        assert ramped["kept"] == ramped["predicted_kept"]["none"], where
        table = ramped["predicted_traffic"]
        assert {key: ramped["traffic"].get(key, 0) for key in table} == table and set(ramped["traffic"]) <= set(table), \
            where


def measured_kept_bytes(recompute: str, dtype: torch.dtype) -> int:
    """One micro-batch of the reference GPT (bf16: weights in bf16 under autocast, as lesson 06
    keeps them), loss summed as a training step asks for it, its kept activations under 07's mode
    or under "attention core": Megatron's
    selective choice, each block's attention core checkpointed."""
    model = GPT(CFG, seed=SEED).to(dtype)
    if recompute == "attention core":
        for block in model.layers:
            block.attn.attention_core = partial(checkpoint, block.attn.attention_core, use_reentrant=False)
    else:
        lesson().apply_recompute(model, recompute)
    generator = torch.Generator().manual_seed(SEED)
    inputs, targets = (torch.randint(CFG.vocab_size, (MICRO, SEQ), generator=generator) for _ in range(2))
    with ActivationMeter(model) as meter, torch.autocast("cpu", dtype, enabled=dtype != torch.float32):
        model(inputs, targets, reduction="sum").backward()
    return meter.peak_bytes


def test_selective_recomputes_what_saves_most_for_no_matmul():
    """On one process, in float32 and bf16: each mode keeps what the formula says, and the
    measured saving of 07's selective choice (the norms' 1/rms and normalised copies and SwiGLU's
    silu(gate), per token and layer 2 (4 (2h + 1) - e h) + e f bytes) against Megatron's
    (checkpointing the attention core, which here drops only its output and log-sum-exp, e h +
    4 n_heads bytes: SDPA keeps K and V un-repeated and no scores, and the core's inputs stay kept
    as its checkpoint). docs/07_full_5d.md quotes these two numbers."""
    h, f = CFG.hidden, CFG.ffn_hidden
    token_layers = MICRO * SEQ * CFG.n_layers
    for dtype in (torch.float32, torch.bfloat16):
        e = dtype.itemsize
        kept = {mode: measured_kept_bytes(mode, dtype) for mode in (*MODES, "attention core")}
        for mode in MODES:
            assert kept[mode] == load_lesson("07_report").predicted_kept_activation_bytes(CFG, MICRO, SEQ, mode,
                                                                          compute_dtype=dtype), (dtype, mode)
        selective, core = kept["none"] - kept["selective"], kept["none"] - kept["attention core"]
        assert selective == token_layers * (2 * (4 * (2 * h + 1) - e * h) + e * f), dtype
        assert core == token_layers * (e * h + 4 * CFG.n_heads), dtype
        assert selective > core, dtype


def test_torchrun_script_trains_and_refuses_bad_configurations():
    """The lesson as a user runs it (dp2 x tp2, ZeRO-1, recompute full): loss falling, kept
    activations measured equal to the formula and every mode predicted, every traffic row equal
    to its prediction; bad configurations refused in one line, before any process group."""
    process = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4",
         str(REPO_ROOT / "07_full_5d.py"), "--dp", "2", "--tp", "2", "--zero-stage", "1", "--recompute", "full",
         "--steps", "10", "--seq-len", "64"],
        capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"), cwd=REPO_ROOT, timeout=300)
    stdout = process.stdout
    assert process.returncode == 0, stdout + process.stderr
    losses = [float(x) for x in re.findall(r"^step +\d+ \| loss (\d+\.\d+)", stdout, re.M)]
    assert len(losses) == 10 and sum(losses[-3:]) / 3 < losses[0] - 0.5, stdout
    kept = {mode: (measured, predicted) for mode, measured, predicted
            in re.findall(r"^(none|selective|full) +(\S+) +(\S+) +\S+(?: %)?$", stdout, re.M)}
    assert list(kept) == ["none", "selective", "full"], stdout
    assert kept["full"][0] == kept["full"][1] and kept["none"][0] == kept["selective"][0] == "-", stdout
    rows = re.findall(r"^\S+ +(?:dp_cp|tp) +\S+ +(\S+) +(\S+) +\S+$", stdout, re.M)
    assert len(rows) == 4 and all(measured == predicted for measured, predicted in rows), stdout

    full_5d = lesson()
    for argv, message in [(["--tp", "3"], "world size"),
                          (["--tp", "2", "--schedule", "interleaved"], "interleaving needs a pipeline"),
                          (["--tp", "2", "--bias-update-rate", "1e-3"], "there are no routers to balance"),
                          (["--tp", "2", "--aux-loss-coef", "0.01"], "needs a mixture-of-experts model"),
                          (["--pp", "2", "--zero-stage", "1", "--schedule", "interleaved", "--virtual-stages", "3"],
                           "every chunk needs a layer")]:
        args = full_5d.parse_args(argv)
        grid = GridShape(dp=2, pp=args.pp, tp=args.tp)
        try:
            cfg = full_5d.expert_parallel.moe_config(get_config(args.preset), args)   # as plan_run configures it
            full_5d.validate(cfg, grid, BatchShape(4, 128, 2, 2), args, 4)
        except Exception as error:  # noqa: BLE001 - the message is what is checked
            assert message in str(error), (argv, str(error))
        else:
            raise AssertionError(f"{argv} must be refused")
