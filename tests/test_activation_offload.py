"""07_activation_offload proven: --offload activations changes where kept tensors wait, nothing else.

One spawn of 4 gloo ranks runs each layout with and without the offload, built by 07's parallelize
from its flags: losses, gradient norms, gradients before and after clipping and parameters after
3 steps bit for bit equal (torch.equal: the same operations on the same values, the copies exact);
the kept device bytes at their peak, measured by 07_report's meters as 07's main enters them
(KeptOnDevice), equal to the prediction with the offload and below the run without it; the bytes
copied to the host (HostCopies) equal to the report's prediction, and for dense layouts both equal
to the plan's. A no-op offload (its "host" copy the device tensor itself) is measured keeping
everything: the meter sees through an offload that only pretends. Layouts: ZeRO-0 (the fuzzer's
fixed draw 20) to 3, tp with and without sequence parallelism, cp, 1F1B (at ZeRO-3) and
interleaved pipelines, experts, FP8, bf16, each recompute mode, default and every-block choices.
"""

from __future__ import annotations

import re
from contextlib import contextmanager
from dataclasses import replace
from functools import partial

import torch

from picotron_like.data import BatchShape, TokenBatches, builtin_corpus_paths
from picotron_like.lessons import load_lesson
from picotron_like.testing import run_ranks
from picotron_like.topology import GridShape, ProcessGrid
from test_full_5d import CFG, CPU, INTERLEAVED, MICRO, MOE_CFG, SEED, flags, metered_steps, optimizer_of
from test_zero import gathered, observe_gradients

CFG3 = replace(CFG, n_layers=3)
CFG4 = replace(CFG, n_layers=4)
OFFLOAD = ("--offload", "activations")
# name: (grid, ep, ZeRO stage, model, --recompute, extra flags, --offload-blocks: None for its default)
LAYOUTS = {"dp4 ZeRO-3": (GridShape(dp=4), 1, 3, CFG3, "none", (), None),
           "dp2 x tp2 ZeRO-1 selective": (GridShape(dp=2, tp=2), 1, 1, CFG3, "selective", (), None),
           "dp2 x tp2 SP ZeRO-2 full bf16": (GridShape(dp=2, tp=2), 1, 2, CFG3, "full",
                                             ("--sequence-parallel", "--dtype", "bfloat16"), None),
           "pp2 x dp2 1F1B ZeRO-3": (GridShape(dp=2, pp=2), 1, 3, CFG4, "none", (), None),
           "pp2 x cp2 1F1B ZeRO-1 selective bf16, every block": (GridShape(pp=2, cp=2), 1, 1, CFG4, "selective",
                                                                  ("--dtype", "bfloat16"), 2),
           "pp2 x dp2 interleaved ZeRO-1 full, every block": (GridShape(dp=2, pp=2), 1, 1, CFG4, "full",
                                                              INTERLEAVED, 1),
           "dp2 x cp2 moe ep2 ZeRO-2": (GridShape(dp=2, cp=2), 2, 2, replace(MOE_CFG, n_layers=3), "none",
                                        ("--aux-loss-coef", "0.01"), None),
           "dp2 x tp2 ZeRO-1 fp8 rowwise": (GridShape(dp=2, tp=2), 1, 1, CFG3, "none", ("--fp8", "rowwise"), None)}
NO_OP = "dp4 ZeRO-3"
STEPS = 3


def run(grid: ProcessGrid, stage: int, recompute: str, cfg, extra=()) -> dict:
    """3 steps of 07's train_step, step 0 inside 07_report's meters as 07's main enters them."""
    full_5d, report = load_lesson("07_full_5d"), load_lesson("07_report")
    args = full_5d.parse_args(flags(grid.shape, stage, recompute, extra))
    cfg = full_5d.expert_parallel.moe_config(cfg, args)
    model, pipeline = full_5d.parallelize(cfg, grid, args, CPU)
    optimizer = optimizer_of(model, grid, args)
    seen = observe_gradients(model, optimizer)
    settings = full_5d.step_settings(grid, CPU, model.precision, 1.0)
    data = TokenBatches(builtin_corpus_paths()[0], BatchShape(MICRO, args.seq_len, args.grad_accum, grid.dp_size),
                        seed=SEED, vocab_size=cfg.vocab_size)
    cut = full_5d.context_parallel.sequence_cut(grid, args.zigzag) or (lambda batch: batch)
    meters = report.ReportMeters.of(report.ComposedRun(model, pipeline, optimizer, cfg, data.shape, grid, args, data))
    results, _ = metered_steps(model, pipeline, optimizer, lambda step: cut(data.step_batch(step, grid.dp_rank)),
                               settings, args, full_5d.balancing_log(model, pipeline, grid),
                               lambda step: meters.of_the_metered_step() if step == 0 else (), STEPS)
    predicted = report.predicted_kept_by_mode(model, pipeline, cfg, data.shape, args, grid, meters.routing)
    plan, device = load_lesson("07_memory_plan"), load_lesson("07_memory_plan").plan_device(args)
    kept = partial(report.predicted_kept_activation_bytes, micro_batch=MICRO, seq_len=args.seq_len,
                   recompute=recompute, tp=grid.tp_size, sequence_parallel=args.sequence_parallel, cp=grid.cp_size,
                   compute_dtype=model.precision.param_dtype)
    return {"losses": [r.loss for r in results], "norms": [r.grad_norm for r in results],
            "grads": seen["before"], "clipped_grads": seen["after"],
            "params": gathered(model, lambda unit: unit.master),
            "kept": meters.activations.peak_bytes, "predicted": predicted[recompute],
            "copied": meters.host_copies.bytes,
            "predicted_copied": report.predicted_offload_link_bytes(model, pipeline, cfg, data.shape, args, grid,
                                                                    meters.routing if recompute != "full" else None),
            "planned": plan.planned_activation_bytes(cfg, args, grid.shape, grid.ep_size, data.shape, model.precision,
                                                     grid.pp_rank, device)[0],
            "planned_copied": plan.planned_offload(cfg, args, grid.shape, grid.ep_size, data.shape, model.precision,
                                                   grid.pp_rank, device).link_bytes_per_step,
            "block": kept(replace(cfg, n_layers=2)) - kept(replace(cfg, n_layers=1))}


@contextmanager
def no_op_offload():
    """The offload with its copy out replaced by the device tensor itself: nothing leaves the device."""
    offload = load_lesson("07_activation_offload").ActivationOffload
    to_host = offload.to_host
    offload.to_host = lambda self, device_bytes: device_bytes
    try:
        yield
    finally:
        offload.to_host = to_host


def offload_flags(blocks: int | None) -> tuple:
    return (*OFFLOAD, *(("--offload-blocks", str(blocks)) if blocks is not None else ()))


def every_layout() -> dict:
    runs = {}
    for name, (shape, ep, stage, cfg, recompute, extra, blocks) in LAYOUTS.items():
        grid = ProcessGrid(shape, ep=ep)
        runs[name, "without"] = run(grid, stage, recompute, cfg, extra)
        runs[name, "with"] = run(grid, stage, recompute, cfg, (*extra, *offload_flags(blocks)))
    shape, ep, stage, cfg, recompute, extra, blocks = LAYOUTS[NO_OP]
    with no_op_offload():
        runs[NO_OP, "no-op"] = run(ProcessGrid(shape, ep=ep), stage, recompute, cfg, (*extra, *offload_flags(blocks)))
    return runs


def assert_equal(ours: dict, theirs: dict, where: str) -> None:
    assert ours["losses"] == theirs["losses"] and ours["norms"] == theirs["norms"], where
    for key in ("grads", "clipped_grads", "params"):
        assert ours[key].keys() == theirs[key].keys(), where
        for name in ours[key]:
            assert torch.equal(ours[key][name], theirs[key][name]), f"{where} {key} {name}"


def test_offload_is_bit_equal_and_keeps_the_predicted_device_bytes():
    """Each layout with --offload activations equal bit for bit to the run without (losses, norms,
    gradients before and after clipping, parameters after 3 AdamW steps), every rank's kept device
    bytes measured equal to the prediction with the offload and below the run without; the no-op
    offload measured keeping what the run without keeps (on every rank: ZeRO-3, no pipeline)."""
    for rank, runs in enumerate(run_ranks(4, every_layout, timeout_s=300)):
        for name in LAYOUTS:
            without, offloaded, where = runs[name, "without"], runs[name, "with"], f"rank={rank} {name}"
            assert_equal(offloaded, without, where)
            assert without["kept"] == without["predicted"], where
            if LAYOUTS[name][-1] is None:       # a block kept in each chunk: the peak at a forward's end
                assert offloaded["kept"] == offloaded["predicted"], where
            else:       # every block offloaded: the peak inside a block's forward, its own working tensors
                assert offloaded["predicted"] < offloaded["kept"] <= offloaded["predicted"] + offloaded["block"], where
            assert offloaded["kept"] < without["kept"], where
            assert offloaded["copied"] == offloaded["predicted_copied"] > 0 == without["copied"], where
            # the plan's experts route evenly, not as the step did; its FP8 follows a GPU's shape rule
            if not LAYOUTS[name][3].n_experts and "--fp8" not in LAYOUTS[name][5]:
                assert (offloaded["planned"], offloaded["planned_copied"]) == (offloaded["predicted"],
                                                                               offloaded["copied"]), where
        no_op = runs[NO_OP, "no-op"]
        assert_equal(no_op, runs[NO_OP, "without"], f"rank={rank} no-op")
        assert no_op["kept"] == runs[NO_OP, "without"]["kept"] > runs[NO_OP, "with"]["kept"], f"rank={rank} no-op"


def test_what_offload_refuses_and_its_default_blocks():
    """07 refuses --offload activations with zero-bubble and --compile, and --offload-blocks below 1
    or without the offload, each in one line; by default each chunk's blocks but its last move."""
    full_5d = load_lesson("07_full_5d")

    def problems(*flags) -> list[str]:
        return full_5d.composition_problems(CFG4, GridShape(dp=2, pp=2),
                                            full_5d.parse_args(["--pp", "2", "--dp", "2", *flags]))

    assert problems("--offload", "activations") == []
    refused = {("--schedule", "zero-bubble", "--grad-accum", "4"): "--schedule zero-bubble",
               ("--compile",): "--compile", ("--offload-blocks", "0"): "--offload-blocks 0"}
    for flags, named in refused.items():
        (line,) = problems("--offload", "activations", *flags)
        assert named in line and ("use" in line or "drop" in line), line
    (line,) = problems("--offload-blocks", "2")
    assert "without --offload activations" in line
    offloaded_blocks = load_lesson("07_activation_offload").offloaded_blocks
    assert [offloaded_blocks(n, None) for n in (1, 2, 5)] == [0, 1, 4]
    assert [offloaded_blocks(n, 3) for n in (1, 2, 5)] == [1, 2, 3]


def test_the_plan_fits_the_offload_and_says_when_its_copies_stall(capsys):
    """--plan, 8b at 8192 tokens on 8 H100s as pp 4 x dp 2: 1F1B's first stage does not fit without the
    offload and does with it; without recomputation a block's copies take longer than the next block's
    compute (the step grows by their exposed part, the plan says so); under full recomputation (a
    block keeps its input) every copy hides."""
    full_5d, plan = load_lesson("07_full_5d"), load_lesson("07_memory_plan")
    flags = ["--plan", "--preset", "8b", "--gpus", "8", "--gpu", "H100", "--seq-len", "8192", "--micro-batch-size",
             "1", "--grad-accum", "8", "--pp", "4", "--dp", "2"]

    def planned(*extra):
        args = full_5d.parse_args([*flags, *extra])
        cfg, grid, ep, shape = plan.checked_plan_flags(args, full_5d.validate, full_5d.expert_degree)
        device = plan.plan_device(args)
        precision = plan.zero.precision_from_flags(args.dtype, args.reduce_dtype, torch.device(device.device_type))
        layout = plan.plan_layout(cfg, args, grid, ep, shape, precision, device)
        if "--offload" in extra:
            plan.print_offload(layout, cfg, shape, precision, device)
        return layout, layout.peak_bytes <= device.memory_gib * 2**30 * (1 - plan.PLAN_MARGIN), capsys.readouterr().out

    (without, fits, _), (stalls, fits_offloaded, line) = planned(), planned("--offload", "activations")
    assert not fits and fits_offloaded and "offload" not in without.seconds
    assert stalls.seconds["offload"] > 0 and re.search(r"a block's copy (\S+) ms against the next block's forward "
                                                       r"(\S+) ms and backward (\S+) ms: \S+ ms per step not hidden",
                                                       line)
    copy, forward, backward = map(float, re.search(r"copy (\S+) ms .* forward (\S+) ms and backward (\S+) ms",
                                                   line).groups())
    assert copy > backward > forward
    hidden, _, line = planned("--offload", "activations", "--recompute", "full")
    assert hidden.seconds["offload"] == 0 and line.endswith("every copy hidden\n")
    assert stalls.host["activations (offloaded; the fullest stage)"] > 0
