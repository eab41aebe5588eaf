"""Lesson 07 proven on every axis at once: dp x pp x cp x tp = 2 x 2 x 2 x 2 on 16 gloo ranks, a
mixture-of-experts model with its experts over ep = 2, ZeRO-1 and full recomputation, equal to
one device.

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

import torch

from picotron_like.testing import run_ranks
from picotron_like.topology import GridShape, ProcessGrid, load_lesson
from test_expert_parallel import (BALANCED, CPU, LR, MAX_GRAD_NORM, MICRO, PARAM_TOLERANCE, SEED, SEQ, STEPS,
                                  TOLERANCE, Variant, batches, forced_reference, record_choices)
from test_zero import gathered, observe_gradients

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
    seen = observe_gradients(model, optimizer)
    settings = zero.step_settings(grid, CPU, zero.Precision(), MAX_GRAD_NORM)
    cut = full_5d.context_parallel.sequence_cut(grid, args.zigzag)
    choices, step_of = {}, [0]
    recording_first_forwards(model, grid, data, choices, step_of)
    results = []
    for step in range(STEPS):
        step_of[0] = step
        results.append(zero.train_step(pipeline, optimizer, cut(data.step_batch(step, grid.dp_rank)), settings))
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
    per_rank = run_ranks(16, every_axis_run, ALL_AXES, timeout_s=540)
    reference = forced_reference(ALL_AXES, per_rank)
    names_seen = set()
    for rank, result in enumerate(per_rank):
        where = f"rank={rank} dp2 x pp2 x cp2 x tp2 ep2 ZeRO-1 recompute full"

        def local(full: torch.Tensor, name: str) -> torch.Tensor:
            mine = full.chunk(ALL_AXES.ep, dim=0)[result["ep_rank"]] if expert_parallel.is_expert_parameter(name) \
                else full
            split_dim = result["split_dims"][name]
            return mine if split_dim is None else mine.chunk(ALL_AXES.shape.tp, dim=split_dim)[result["tp_rank"]]

        for key in ("losses", "norms"):
            torch.testing.assert_close(torch.tensor(result[key]), torch.tensor(reference[key]), rtol=0, atol=1e-5,
                                       msg=f"{where} {key}")
        for key in ("grads", "clipped_grads"):
            for name, grad in result[key].items():
                torch.testing.assert_close(grad, local(reference[key][name], name), **TOLERANCE,
                                           msg=f"{where} {key} {name}")
        for name, param in result["params"].items():
            torch.testing.assert_close(param, local(reference["params"][name], name), **PARAM_TOLERANCE,
                                       msg=f"{where} param {name}")
        names_seen.update(result["params"])
    assert names_seen == set(reference["params"]), "every reference parameter is held by some rank"
