"""Lesson 07 proven on every axis at once: dp x pp x cp x tp = 2 x 2 x 2 x 2 on 16 gloo ranks, a
mixture-of-experts model with its experts over ep = 2, ZeRO-1 and full recomputation, equal to
one device; and odd mixes on 6 ranks (dp = 3: every flat ZeRO unit padded, shards of unequal
content) with ZeRO-2 and ZeRO-3 and each recompute mode, equal to one device too.

One spawn of 16 ranks holds every 16-rank check (a spawn of 16 processes on a two-core machine
costs more than the training itself). Routing flips are handled as in lesson 05's tests (see
tests/test_expert_parallel.py): the one-device reference is teacher-forced to the experts the
distributed run chose, and asserts that wherever its own choice would have differed, the top-k
margin was a float32 tie. Recomputation runs each block's forward, and so each router, twice per
micro-batch; only the first forward's choices are recorded (the second runs inside the backward
pass, where autograd's engine has a current graph task).

Tolerances are lesson 05's (gradients 1e-6, losses and norms 1e-5, parameters 1e-2 * lr).
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.distributed as dist

from picotron_like import train as train_module
from picotron_like.data import BatchShape, TokenBatches, builtin_corpus_paths
from picotron_like.lessons import load_lesson
from picotron_like.testing import SEQUENCES_CHECKED, run_ranks, train_reference
from picotron_like.topology import GridShape, ProcessGrid
from test_expert_parallel import (BALANCED, CPU, LR, MAX_GRAD_NORM, MICRO, PARAM_TOLERANCE, SEED, SEQ, STEPS,
                                  TOLERANCE, Variant, batches, forced_reference, record_choices)
from test_zero import ADAM_EPS, CFG, gathered, observe_gradients
from test_full_5d import MUON, muon_optimizer, optimizer_of

ALL_AXES = Variant(GridShape(dp=2, pp=2, cp=2, tp=2), 2, (*BALANCED, ("n_shared_experts", 1)))


def recording_first_forwards(model, grid, data, choices: dict, step_of: list) -> None:
    """Lesson 05's test recorder on this model's MoE layers, blind to recomputed forwards."""
    layers = [module for module in model.module.modules() if hasattr(module, "expert_compute")]
    originals = [layer.expert_compute for layer in layers]
    record_choices([model], grid, data, choices, step_of)
    for layer, original in zip(layers, originals):
        recording = layer.expert_compute

        def first_forward_only(*args, recording=recording, original=original):
            recomputing = torch._C._current_graph_task_id() != -1
            return (original if recomputing else recording)(*args)
        layer.expert_compute = first_forward_only


def every_axis_run(variant: Variant) -> dict:
    full_5d = load_lesson("07_full_5d")
    zero = full_5d.zero
    grid = ProcessGrid(variant.shape, ep=variant.ep)
    data = batches(grid.dp_size)
    shape = data.shape
    args = full_5d.parse_args(["--dp", "2", "--pp", "2", "--cp", "2", "--tp", "2", "--ep", str(variant.ep),
                               "--zero-stage", "1", "--recompute", "full", "--seq-len", str(SEQ),
                               "--micro-batch-size", str(MICRO), "--grad-accum", str(shape.grad_accum),
                               "--seed", str(SEED), "--lr", str(LR)])
    model, pipeline = full_5d.parallelize(variant.cfg, grid, args, CPU)
    assert pipeline is not None
    optimizer = zero.build_sharded_optimizer(model, LR)
    for group in optimizer.param_groups:
        group["eps"] = ADAM_EPS     # forced_reference's (lesson 05's tests)
    seen = observe_gradients(model, optimizer)
    settings = full_5d.step_settings(grid, CPU, zero.Precision(), MAX_GRAD_NORM)
    cut = full_5d.context_parallel.sequence_cut(grid, args.zigzag)
    choices, step_of = {}, [0]
    recording_first_forwards(model, grid, data, choices, step_of)
    results = []
    for step in range(STEPS):
        step_of[0] = step
        results.append(full_5d.train_step(pipeline, optimizer, cut(data.step_batch(step, grid.dp_rank)), settings))
    module_params = dict(model.module.named_parameters())
    return {variant: {"choices": choices}, "grads": seen["before"], "clipped_grads": seen["after"],
            "params": gathered(model, lambda unit: unit.master), "losses": [r.loss for r in results],
            "norms": [r.grad_norm for r in results], "ep_rank": grid.ep_rank, "tp_rank": grid.tp_rank,
            "split_dims": {name: getattr(p, "tp_split_dim", None) for name, p in module_params.items()}}


def test_every_axis_at_once_equals_one_device():
    """16 ranks, each one place in dp x pp x cp x tp with experts over ep: its gradients before and
    after clipping, its parameters after 3 AdamW steps (its stage's, its tp shard, its experts)
    equal the one-device reference's slices; losses and norms equal on every rank."""
    expert_parallel = load_lesson("05_expert_parallel")
    per_rank = run_ranks(16, every_axis_run, ALL_AXES, timeout_s=540, checks=SEQUENCES_CHECKED)
    reference = forced_reference(ALL_AXES, per_rank)
    names_seen = set()
    for rank, result in enumerate(per_rank):
        where = f"rank={rank} dp2 x pp2 x cp2 x tp2 ep2 ZeRO-1 recompute full"

        def local(full: torch.Tensor, name: str, tp_local=tp_shard(result, ALL_AXES.shape.tp)) -> torch.Tensor:
            """The rank's experts of an expert parameter (ep), then its tp shard."""
            mine = full.chunk(ALL_AXES.ep, dim=0)[result["ep_rank"]] if expert_parallel.is_expert_parameter(name) \
                else full
            return tp_local(mine, name)

        assert_equal_to_one_device(result, reference, local, where)
        names_seen.update(result["params"])
    assert names_seen == set(reference["params"]), "every reference parameter is held by some rank"


# ----------------------------------------------------------------------------- odd mixes on 6 ranks

ODD_SEQUENCES = 12                # a global batch that dp = 2 and dp = 3 both cut into micro-batches of 2
ODD_SEQ = 48                      # zigzag cuts a sequence into 2 * cp chunks: a multiple of 4 and of 6
# name: (grid, ZeRO stage, recompute, extra flags)
ODD_LAYOUTS = {"dp3 x tp2 SP ZeRO-2 selective": (GridShape(dp=3, tp=2), 2, "selective", ("--sequence-parallel",)),
               "dp3 x cp2 ZeRO-3 full": (GridShape(dp=3, cp=2), 3, "full", ()),
               "dp3 x cp2 ulysses ZeRO-2 none": (GridShape(dp=3, cp=2), 2, "none", ("--cp-mode", "ulysses")),
               "dp3 x pp2 ZeRO-1 selective": (GridShape(dp=3, pp=2), 1, "selective", ()),
               "dp2 x cp3 ZeRO-3 selective": (GridShape(dp=2, cp=3), 3, "selective", ()),
               # Muon (06_zero_muon, 07's tp join) over shards that cut its matrices unevenly
               "dp3 x tp2 SP ZeRO-2 muon": (GridShape(dp=3, tp=2), 2, "none", ("--sequence-parallel", *MUON)),
               "dp3 x tp2 ZeRO-3 muon": (GridShape(dp=3, tp=2), 3, "none", MUON)}
# lesson 07's ZeRO-2/3 under a pipeline over three uneven stages (4 layers: 2 + 1 + 1), as ODD_LAYOUTS
UNEVEN_CFG = replace(CFG, n_layers=4)
UNEVEN_STAGES = {"dp2 x pp3 ZeRO-3 1f1b": (GridShape(dp=2, pp=3), 3, "none", ()),
                 "dp2 x pp3 ZeRO-3 kept zero-bubble": (GridShape(dp=2, pp=3), 3, "none",
                                                       ("--no-reshard-after-forward", "--schedule", "zero-bubble")),
                 "dp2 x pp3 ZeRO-2 afab": (GridShape(dp=2, pp=3), 2, "selective", ("--schedule", "afab"))}
NAN_STEP = 1        # the step whose gradient a NaN poisons in the non-finite runs
NON_FINITE = (("muon", "exact"), ("adamw", "exact"), ("muon", "on device"))     # on device last: it patches AdamW


def odd_data(dp: int) -> TokenBatches:
    return TokenBatches(builtin_corpus_paths()[0], BatchShape(MICRO, ODD_SEQ, ODD_SEQUENCES // (MICRO * dp), dp),
                        seed=SEED, vocab_size=CFG.vocab_size)


def odd_layout_args(grid_shape: GridShape, stage: int, recompute: str, extra):
    return load_lesson("07_full_5d").parse_args([
        "--dp", str(grid_shape.dp), "--pp", str(grid_shape.pp), "--cp", str(grid_shape.cp), "--tp", str(grid_shape.tp),
        "--zero-stage", str(stage), "--recompute", recompute, "--seq-len", str(ODD_SEQ), "--micro-batch-size",
        str(MICRO), "--grad-accum", str(odd_data(grid_shape.dp).shape.grad_accum), "--seed", str(SEED), "--lr",
        str(LR), *extra])


def odd_layout_run(grid_shape: GridShape, stage: int, recompute: str, extra, replayed=None, cfg=CFG) -> dict:
    full_5d = load_lesson("07_full_5d")
    zero = full_5d.zero
    grid = ProcessGrid(grid_shape)
    data = odd_data(grid.dp_size)
    args = odd_layout_args(grid_shape, stage, recompute, extra)
    model, pipeline = full_5d.parallelize(cfg, grid, args, CPU)
    optimizer = optimizer_of(model, grid, args, replayed)
    seen = observe_gradients(model, optimizer)
    settings = full_5d.step_settings(grid, CPU, zero.Precision(), MAX_GRAD_NORM)
    cut = full_5d.context_parallel.sequence_cut(grid, args.zigzag) or (lambda batch: batch)
    results = [full_5d.train_step(model if pipeline is None else pipeline, optimizer,
                               cut(data.step_batch(step, grid.dp_rank)), settings) for step in range(STEPS)]
    return {"grads": seen["before"], "clipped_grads": seen["after"], "params": gathered(model, lambda u: u.master),
            "losses": [r.loss for r in results], "norms": [r.grad_norm for r in results], "tp_rank": grid.tp_rank,
            "split_dims": {name: getattr(p, "tp_split_dim", None) for name, p in model.module.named_parameters()}}


def non_finite_run(optimizer: str, tail: str) -> dict:
    """dp3 x tp2 under `optimizer`, ZeRO-1 (units padded), a NaN in rank 0's gradient shard at
    NAN_STEP: each step's skip flag, and the master weights and optimizer states after every step.
    `tail`: "exact" (the CPU's: the host reads the norm and steps or not) or "on device" (AdamW
    fused, as on CUDA: Muon and AdamW get found_inf and keep their states where it is 1)."""
    if tail == "on device":
        train_module.adamw_implementation = lambda device: {"fused": True}
    full_5d = load_lesson("07_full_5d")
    grid = ProcessGrid(GridShape(dp=3, tp=2))
    data = odd_data(grid.dp_size)
    args = odd_layout_args(grid.shape, 1, "none", MUON if optimizer == "muon" else ())
    model, _ = full_5d.parallelize(CFG, grid, args, CPU)
    optimizer = optimizer_of(model, grid, args)
    settings = full_5d.step_settings(grid, CPU, model.precision, MAX_GRAD_NORM)
    finish, step_of, results, states = model.finish_gradient_synchronization, [0], [], []

    def finish_then_poison():
        finish()
        if step_of[0] == NAN_STEP and dist.get_rank() == 0:
            model.units[0].grad_shard[0] = float("nan")

    model.finish_gradient_synchronization = finish_then_poison
    for step in range(STEPS):
        step_of[0] = step
        results.append(full_5d.train_step(model, optimizer, data.step_batch(step, grid.dp_rank), settings))
        states.append([unit.master.clone() for unit in model.units]
                      + [value.clone() for state in optimizer.state.values() for value in state.values()])
    return {"skipped": [result.skipped for result in results], "states": states,
            "amp": train_module.supports_amp_scaling(optimizer)}


def every_odd_layout(replays: dict) -> dict:
    runs = {name: odd_layout_run(*layout, replays.get(name)) for name, layout in ODD_LAYOUTS.items()}
    runs.update({name: odd_layout_run(*layout, cfg=UNEVEN_CFG) for name, layout in UNEVEN_STAGES.items()})
    original = train_module.adamw_implementation
    try:
        runs.update({f"non-finite {optimizer} {tail}": non_finite_run(optimizer, tail)
                     for optimizer, tail in NON_FINITE})
    finally:
        train_module.adamw_implementation = original
    return runs


def tp_shard(result: dict, tp: int):
    """The reference tensor as this rank holds it: of a tensor-parallel parameter, its tp shard."""
    def local(full: torch.Tensor, parameter: str) -> torch.Tensor:
        split_dim = result["split_dims"][parameter]
        return full if split_dim is None else full.chunk(tp, dim=split_dim)[result["tp_rank"]]
    return local


def assert_equal_to_one_device(result: dict, reference: dict, local, where: str) -> None:
    """Losses, norms, gradients before and after clipping and parameters after AdamW equal one
    device's: of each parameter the rank holds, `local(reference tensor, name)`."""
    for key in ("losses", "norms"):
        torch.testing.assert_close(torch.tensor(result[key]), torch.tensor(reference[key]), rtol=0, atol=1e-5,
                                   msg=f"{where} {key}")
    for key in ("grads", "clipped_grads"):
        for parameter, grad in result[key].items():
            torch.testing.assert_close(grad, local(reference[key][parameter], parameter), **TOLERANCE,
                                       msg=f"{where} {key} {parameter}")
    for parameter, value in result["params"].items():
        torch.testing.assert_close(value, local(reference["params"][parameter], parameter), **PARAM_TOLERANCE,
                                   msg=f"{where} param {parameter}")


def test_odd_degrees_with_zero_2_and_3_and_each_recompute_mode_equal_one_device():
    """6 ranks, five layouts with dp or cp = 3, ZeRO-1/2/3, ring and Ulysses, and recompute none,
    selective and full, and ZeRO-2/3 under a pipeline of three uneven stages (1F1B resharded,
    zero-bubble kept gathered, AFAB at ZeRO-2): each rank's gradients before and after clipping, its parameters after 3
    AdamW steps (its stage's, its tp shard) and every loss and norm equal one device's. Under Muon,
    dp3 x tp2 with ZeRO-2 (sequence parallel) and ZeRO-3, stepped with one device's gradients
    (test_full_5d.replay), the same against one device's Muon. And Muon's non-finite skip: a NaN
    in one rank's gradient shard skips that step on every rank, master weights and every optimizer
    state (Muon's momentum, AdamW's moments) as they were, on the exact tail and with the skip
    decided on the device; the next step steps (AdamW's too: ZeRO-1's padding, scaled by NaN in the
    skipped step, is zeroed again)."""
    references = {optimizer: train_reference(CFG, SEED, odd_data(1), STEPS, LR, MAX_GRAD_NORM, adam_eps=ADAM_EPS,
                                             make_optimizer=muon_optimizer if optimizer == "muon" else None)
                  for optimizer in ("adamw", "muon")}
    assert min(references["adamw"]["norms"]) > MAX_GRAD_NORM, "clipping must act, or clipped gradients prove nothing"
    muon = {name for name, (*_, extra) in ODD_LAYOUTS.items() if "muon" in extra}
    replays = {name: references["muon"]["every_clipped_grads"] for name in muon}
    uneven = train_reference(UNEVEN_CFG, SEED, odd_data(1), STEPS, LR, MAX_GRAD_NORM, adam_eps=ADAM_EPS)
    for rank, runs in enumerate(run_ranks(6, every_odd_layout, replays, timeout_s=400, checks=SEQUENCES_CHECKED)):
        for name, (grid_shape, *_) in ODD_LAYOUTS.items():
            result = runs[name]
            assert_equal_to_one_device(result, references["muon" if name in muon else "adamw"],
                                       tp_shard(result, grid_shape.tp), f"rank={rank} {name}")
        for name in UNEVEN_STAGES:
            assert_equal_to_one_device(runs[name], uneven, lambda full, _: full, f"rank={rank} {name}")
        for optimizer, tail in NON_FINITE:
            run, where = runs[f"non-finite {optimizer} {tail}"], f"rank={rank} non-finite {optimizer} {tail}"
            assert run["skipped"] == [step == NAN_STEP for step in range(STEPS)], where
            assert run["amp"] == (tail == "on device"), where
            before, after, then = run["states"][NAN_STEP - 1: NAN_STEP + 2]
            assert len(before) == len(after) and all(torch.equal(a, b) for a, b in zip(before, after)), where
            assert not all(torch.equal(a, b) for a, b in zip(after, then)), where
