"""Experts with every other axis, through lesson 07's composition, against one device: ep drawn
from dp x cp, every expert split over tp, MoE layers in pipeline stages (1F1B and interleaved),
under ZeRO-1, 2 and 3.

These proofs lived in lesson 05's tests while lesson 05 composed the other lessons; since 07 is the
only lesson that composes, they build the model with 07's parallelize() and step it with 07's
composed train_step. The one-device reference is lesson 05's teacher-forced one
(tests/test_expert_parallel.py: every token routed where the distributed run routed it, and a
choice the reference would have made differently allowed only at a float32 tie). Each run also
checks lesson 07's formulas against its meters on every rank: the activations kept at step 0's
peak (on that step's routing counts), every row of the traffic table over the run (the
all-to-all's and the experts' tp all-reduces on each step's counts) and ZeRO's model states.
Two run under a batch-size ramp, and the report's own prediction for a ramped run is checked too.

Tolerances are lesson 05's.
"""

from __future__ import annotations

import functools
from dataclasses import asdict, dataclass, replace

import pytest

from picotron_like import comm
from picotron_like.data import BatchRamp
from picotron_like.lessons import load_lesson
from picotron_like.metrics import ActivationMeter, RoutingMeter, add_traffic
from picotron_like.testing import SEQUENCES_CHECKED, HostReads, masked_step_batch, run_ranks, train_reference
from picotron_like.topology import GridShape, ProcessGrid
from picotron_like import train as train_module
from picotron_like.train import checked_plan
from test_expert_parallel import (ADAM_EPS, BALANCED, CPU, LR, MAX_GRAD_NORM, MICRO, SEED, SEQ, STEPS, Variant,
                                  assert_equals_reference, batches, forced_reference, mask_targets, record_choices)
from test_full_5d import MUON, metered_steps, muon_optimizer, optimizer_of
from test_zero import gathered, observe_gradients


@dataclass(frozen=True)
class ComposedVariant(Variant):
    zero_stage: int = 1
    virtual_stages: int = 1          # > 1: lesson 03's interleaved schedule, several chunks per pipeline rank
    optimizer: str = "adamw"         # muon: test_full_5d's MUON flags, stepped with one device's gradients (replay)
    ramp: tuple = ()                 # --batch-ramp START_TOKENS RAMP_TOKENS: each step of its own size
    schedule: str = ""               # a pipeline's --schedule other than 1F1B (or interleaved: virtual_stages)
    reshard: bool = True             # ZeRO-3's --reshard-after-forward


SIGMOID_AUX = (("router", "sigmoid"), ("aux_loss_coef", 1e-2))
VARIANTS = [
    # cp pairs inside an ep group (ep = 2 of dp x cp = 4), and ep spanning both (ep = 4)
    ComposedVariant(GridShape(dp=2, cp=2), 2, (*SIGMOID_AUX, ("n_shared_experts", 1)), bias_update_rate=1e-3,
                    grouped=False),
    ComposedVariant(GridShape(dp=2, cp=2), 4, BALANCED, bias_update_rate=1e-3, masked=True, zero_stage=3),
    # two pipeline stages, 1F1B; then interleaved with two chunks of one layer per pipeline rank
    ComposedVariant(GridShape(dp=2, pp=2), 2, BALANCED, bias_update_rate=1e-3),
    ComposedVariant(GridShape(dp=2, pp=2), 2, (*BALANCED, ("n_layers", 4)), bias_update_rate=1e-3,
                    virtual_stages=2),
    # ZeRO-2/3 under a pipeline (lesson 07's PipelinedZeroStage2/3), experts' units over edp: zero-bubble
    # resharded (the experts' gradients in B, the rest of a block's in W), interleaved resharded within a
    # chunk and kept gathered, 1F1B and interleaved at ZeRO-2
    ComposedVariant(GridShape(dp=2, pp=2), 2, BALANCED, zero_stage=3, schedule="zero-bubble"),
    ComposedVariant(GridShape(dp=2, pp=2), 2, (*BALANCED, ("n_layers", 4)), virtual_stages=2, zero_stage=3),
    ComposedVariant(GridShape(dp=2, pp=2), 2, (*BALANCED, ("n_layers", 4)), virtual_stages=2, zero_stage=2),
    ComposedVariant(GridShape(dp=2, pp=2), 2, (*BALANCED, ("n_layers", 5)), virtual_stages=2, zero_stage=3,
                    reshard=False),
    ComposedVariant(GridShape(dp=2, pp=2), 2, SIGMOID_AUX, bias_update_rate=1e-3, zero_stage=2),
    # every expert (and the shared one) split over tp = 2, of dp = 2 and of cp = 2
    ComposedVariant(GridShape(dp=2, tp=2), 2, (*BALANCED, ("n_shared_experts", 1)), zero_stage=2),
    ComposedVariant(GridShape(cp=2, tp=2), 2, SIGMOID_AUX, bias_update_rate=1e-3, grouped=False, masked=True),
    # Muon: each expert's matrix on its own, assembled over edp = 2 (ZeRO-1); and joined over tp (ZeRO-2)
    ComposedVariant(GridShape(dp=2, cp=2), 2, (*SIGMOID_AUX, ("n_shared_experts", 1)), bias_update_rate=1e-3,
                    optimizer="muon"),
    ComposedVariant(GridShape(dp=2, tp=2), 2, (*BALANCED, ("n_shared_experts", 1)), zero_stage=2, optimizer="muon"),
    # A batch-size ramp (--batch-ramp): each step's balancing losses are shares of its own sequences.
    # dp2 x tp2 (1 then 2 micro-batches per rank): aux and z losses, the router bias, capacity per
    # sequence; pp2 x cp2 1F1B (2, 3, then 4): the sigmoid router, its bias, the aux loss counted over cp.
    ComposedVariant(GridShape(dp=2, tp=2), 2, (*BALANCED, ("capacity_factor", 1.0)), bias_update_rate=1e-3,
                    ramp=(128, 200)),
    ComposedVariant(GridShape(pp=2, cp=2), 2, SIGMOID_AUX, bias_update_rate=1e-3, ramp=(128, 300)),
    # ZeRO-0, lesson 01's all-reduce, the dense units over dp x cp and the experts' over edp, the norm's
    # squares of the experts summed over ep: dp2 (ep2) with two pipeline stages, dp2 x tp2 (every
    # expert and the shared one split over tp), dp2 x cp2 with ep2 (edp 2) and ep4 (edp 1)
    ComposedVariant(GridShape(dp=2, pp=2), 2, BALANCED, bias_update_rate=1e-3, zero_stage=0),
    ComposedVariant(GridShape(dp=2, tp=2), 2, (*BALANCED, ("n_shared_experts", 1)), zero_stage=0),
    ComposedVariant(GridShape(dp=2, cp=2), 2, SIGMOID_AUX, bias_update_rate=1e-3, masked=True, zero_stage=0),
    ComposedVariant(GridShape(dp=2, cp=2), 4, BALANCED, grouped=False, zero_stage=0),
]


def composed_run(variant: ComposedVariant, replayed: list[dict] | None = None) -> dict:
    """STEPS steps as lesson 07's main runs them: step 0 metered (activations), each step's
    routing counted, the choices recorded for the teacher-forced reference; under Muon stepped
    with the one-device run's gradients `replayed`."""
    full_5d = load_lesson("07_full_5d")
    zero = full_5d.zero
    grid = ProcessGrid(variant.shape, ep=variant.ep)
    data = batches(grid.dp_size)
    shape = variant.shape
    args = full_5d.parse_args([
        "--dp", str(shape.dp), "--pp", str(shape.pp), "--cp", str(shape.cp), "--tp", str(shape.tp),
        "--ep", str(variant.ep), "--zero-stage", str(variant.zero_stage), "--seq-len", str(SEQ),
        "--micro-batch-size", str(MICRO), "--grad-accum", str(data.shape.grad_accum), "--seed", str(SEED),
        "--lr", str(LR), "--bias-update-rate", str(variant.bias_update_rate),
        *(["--schedule", "interleaved", "--virtual-stages", str(variant.virtual_stages)]
          if variant.virtual_stages > 1 else []),
        *(["--schedule", variant.schedule] if variant.schedule else []),
        *([] if variant.reshard else ["--no-reshard-after-forward"]),
        *([] if variant.grouped else ["--no-grouped-mm"]), *(MUON if variant.optimizer == "muon" else []),
        *(["--batch-ramp", *map(str, variant.ramp)] if variant.ramp else [])])
    data = data.with_ramp(full_5d.ramp_of_layout(args, grid.shape, data.shape))
    shapes = [replace(data.shape, grad_accum=data.grad_accum_at(step)) for step in range(STEPS)]
    model, pipeline = full_5d.parallelize(variant.cfg, grid, args, CPU)
    optimizer = optimizer_of(model, grid, args, replayed)
    seen = observe_gradients(model, optimizer)
    settings = full_5d.step_settings(grid, CPU, model.precision, MAX_GRAD_NORM)
    log = full_5d.balancing_log(model, pipeline, grid)
    choices, step_of = {}, [0]
    record_choices([model], grid, data, choices, step_of)
    cut = full_5d.context_parallel.sequence_cut(grid, args.zigzag) or (lambda batch: batch)
    step_batch = functools.partial(masked_step_batch, data, mask_targets=mask_targets) if variant.masked \
        else data.step_batch
    parts = load_lesson("07_report").model_parts(model, pipeline)
    activations = ActivationMeter(model.module)
    routings = [RoutingMeter(parts) for _ in range(STEPS)]
    comm.meter.reset()

    def batch_of_step(step: int):
        step_of[0] = step       # record_choices files the step's expert choices under it
        return cut(step_batch(step, grid.dp_rank))

    results, biases = metered_steps(model, pipeline, optimizer, batch_of_step, settings, args, log,
                                    lambda step: ([activations] if step == 0 else []) + [routings[step]], STEPS)
    traffic = {key: value.payload_bytes for key, value in comm.meter.traffic.items()}   # before the gathers below
    if pipeline is not None:
        pipeline.follow_micro_batches(shapes[0].grad_accum)     # step 0's schedule, as 07's main() before the report
    return {"grads": seen["before"], "clipped_grads": seen["after"], "losses": [r.loss for r in results],
            "norms": [r.grad_norm for r in results], "aux": [r.extra.get("aux", 0.0) for r in results],
            "z": [r.extra.get("z", 0.0) for r in results], "biases": biases, "choices": choices,
            "ep_rank": grid.ep_rank, "tp_rank": grid.tp_rank,
            "split_dims": {name: getattr(p, "tp_split_dim", None) for name, p in model.module.named_parameters()},
            "kept": activations.peak_bytes,
            "predicted_kept": load_lesson("07_report").predicted_kept_by_mode(model, pipeline, variant.cfg, shapes[0], args, grid,
                                                             routings[0])["none"],
            "traffic": traffic,
            "predicted_traffic": add_traffic(*(load_lesson("07_report").predicted_step_traffic(model, pipeline, variant.cfg, shape,
                                                                              args, grid, model.precision, routing)
                                               for shape, routing in zip(shapes, routings))),
            "ramp_history": data.ramp.realised_history(STEPS) if data.ramp is not None else None,
            "states": asdict(zero.measured_model_states(model, optimizer)),
            "predicted_states": asdict(load_lesson("07_report").ZeroUnits.of(model, grid, args.optimizer).model_states(
                                                                                      model.stage,
                                                                                      model.precision)),
            "params": gathered(model, lambda unit: unit.master)}


def reference_batches(variant: ComposedVariant, run: dict):
    """One device's steps: under a ramp, sized as the layout realised them (its history), each step
    a different number of sequences; checked to train more than one size."""
    if not variant.ramp:
        return batches(1)
    sizes = [tokens for tokens, steps in run["ramp_history"] for _ in range(steps)]
    assert sizes[0] == variant.ramp[0] and len(set(sizes)) > 1 and sizes == sorted(sizes), (variant, sizes)
    one_device = batches(1)
    return one_device.with_ramp(BatchRamp(*variant.ramp, one_device.shape.grad_accum, MICRO * SEQ,
                                          history=run["ramp_history"]))


def ramped_report_traffic() -> dict:
    """07's report under a batch-size ramp with experts, pipelined and fully recomputed (pp2 x cp2
    1F1B: 2, 3, then 4 micro-batches per step, each layer's forward routed twice per micro-batch):
    its every-step routing meter (ReportMeters.every_step) entered around the steps as 07's main
    enters it, and the traffic table's prediction (predicted_run_traffic) over the steps, beside the
    bytes the meter counted."""
    full_5d, report = load_lesson("07_full_5d"), load_lesson("07_report")
    grid = ProcessGrid(GridShape(pp=2, cp=2), ep=2)
    data = batches(grid.dp_size)
    args = full_5d.parse_args(["--pp", "2", "--cp", "2", "--ep", "2", "--seq-len", str(SEQ), "--micro-batch-size",
                               str(MICRO), "--grad-accum", str(data.shape.grad_accum), "--seed", str(SEED),
                               "--recompute", "full", "--bias-update-rate", "1e-3", "--batch-ramp", "128", "300"])
    cfg = ComposedVariant(grid.shape, 2, BALANCED).cfg
    data = data.with_ramp(full_5d.ramp_of_layout(args, grid.shape, data.shape))
    model, pipeline = full_5d.parallelize(cfg, grid, args, CPU)
    optimizer = full_5d.build_optimizer(model, grid, args)
    settings = full_5d.step_settings(grid, CPU, model.precision, MAX_GRAD_NORM)
    run = report.ComposedRun(model, pipeline, optimizer, cfg, replace(data.shape, grad_accum=data.grad_accum_at(0)),
                             grid, args, data)
    meters = report.ReportMeters.of(run)
    cut = full_5d.context_parallel.sequence_cut(grid, args.zigzag)
    comm.meter.reset()
    with meters.every_step:
        for step in range(STEPS):
            full_5d.train_step(pipeline, optimizer, cut(data.step_batch(step, grid.dp_rank)), settings,
                               args.bias_update_rate, full_5d.balancing_log(model, pipeline, grid))
    traffic = {key: value.payload_bytes for key, value in comm.meter.traffic.items()}
    with train_module.traffic_not_counted():
        _, predicted = report.predicted_run_traffic(run, meters.every_step, STEPS)
    return {"traffic": traffic, "predicted": {key: value * STEPS for key, value in predicted.items()},
            "counts": report.micro_batches_of_steps(run, STEPS)}


def every_variant(replays: dict) -> dict:
    return {**{variant: composed_run(variant, replays.get(variant)) for variant in VARIANTS},
            "ramped report": ramped_report_traffic()}


def make_optimizer(variant: ComposedVariant):
    return muon_optimizer if variant.optimizer == "muon" else None


@pytest.fixture(scope="module")
def composed_training():
    """Every variant's run on 4 ranks; under Muon stepped with the gradients of the one-device run
    (not teacher-forced: the forcing needs the run's routing, and with no routing choice at a tie
    the forced run is the same run)."""
    replays = {variant: train_reference(variant.cfg, SEED, batches(1), STEPS, LR, MAX_GRAD_NORM,
                                        mask_targets=mask_targets if variant.masked else None,
                                        bias_update_rate=variant.bias_update_rate, adam_eps=ADAM_EPS,
                                        make_optimizer=make_optimizer(variant))["every_clipped_grads"]
               for variant in VARIANTS if variant.optimizer == "muon"}
    return run_ranks(4, every_variant, replays, timeout_s=500, checks=SEQUENCES_CHECKED)


def test_experts_with_every_axis_equal_one_device_and_the_formulas(composed_training):
    """ep = 2 and 4 over dp x cp = 2 x 2 (ZeRO-1 and ZeRO-3), ep = 2 with two pipeline stages
    (1F1B, and interleaved with two chunks per rank; and at ZeRO-2 and ZeRO-3 under zero-bubble
    and interleaved, resharded and kept gathered, the interleaved chunks uneven), ep = 2 with every expert split over tp = 2,
    of dp = 2 (ZeRO-2) and of cp = 2, and two under a batch-size ramp: softmax and sigmoid routers,
    aux / z losses, the shared expert (split over tp too), router bias, capacity, masked targets.
    On every rank: gradients before and after clipping, losses, norms, balancing losses, router
    biases and parameters equal the teacher-forced one-device reference's (this rank's slices);
    the kept activations at step 0's peak, every collective's bytes and ZeRO's model states equal
    lesson 07's predictions; and the report's own prediction for a ramped, pipelined, fully
    recomputed run (ramped_report_traffic) equals its bytes."""
    for variant in VARIANTS:
        reference = forced_reference(variant, composed_training, make_optimizer=make_optimizer(variant),
                                     reference_batches=reference_batches(variant, composed_training[0][variant]))
        print(f"{variant}: {reference['flips']} routing choices forced at rounding-level ties")
        for rank, results in enumerate(composed_training):
            run, where = results[variant], f"rank {rank} {variant}"
            assert_equals_reference(run, reference, variant, where)
            if variant.schedule != "zero-bubble":   # what waits in W's queue no saved-tensor meter sees (07's report)
                assert run["kept"] == run["predicted_kept"], where
            assert {key: run["traffic"].get(key, 0) for key in run["predicted_traffic"]} == run["predicted_traffic"], \
                where
            assert set(run["traffic"]) <= set(run["predicted_traffic"]), where
            assert run["states"] == run["predicted_states"], where
            if variant.shape.pp > 1:
                assert ("isend", "pp") in run["traffic"], "the stages must run lesson 03's schedule"
        if variant.bias_update_rate:
            assert any(b.abs().sum() > 0 for b in reference["router_biases"][-1].values())
    for rank, results in enumerate(composed_training):
        run = results["ramped report"]
        assert run["counts"] == {2: 1, 3: 1, 4: 1}, run["counts"]
        assert ("all_to_all_single", "ep") in run["traffic"] and set(run["traffic"]) <= set(run["predicted"]), rank
        for key, predicted in run["predicted"].items():
            assert run["traffic"].get(key, 0) == pytest.approx(predicted, rel=1e-12, abs=1e-9), (rank, key)



def host_reads_of_two_steps() -> list:
    """Lesson 07's MoE step at dp 2 x ep 2 (2 layers, 2 micro-batches), bias balancing and the aux
    loss on, the every-step routing meter entered as 07's main enters it, AdamW fused as on CUDA
    (the CPU has a fused AdamW too, so the step's skip of a non-finite norm is decided on the
    device): each step's host reads."""
    train_module.adamw_implementation = lambda device: {"fused": True}
    full_5d = load_lesson("07_full_5d")
    argv = ["--preset", "tiny-moe", "--dp", "2", "--ep", "2", "--n-layers", "2", "--seq-len", str(SEQ),
            "--micro-batch-size", str(MICRO), "--grad-accum", "2", "--bias-update-rate", "1e-3",
            "--aux-loss-coef", "1e-2"]
    args = full_5d.parse_args(argv)
    plan = checked_plan(args, full_5d.validate, full_5d.model_config, 2)
    grid = ProcessGrid(plan.grid, ep=full_5d.expert_degree(args.ep, plan.cfg, plan.grid))
    model, pipeline = full_5d.parallelize(plan.cfg, grid, args, CPU)
    optimizer = full_5d.zero.build_sharded_optimizer(model, args.lr)
    settings = full_5d.step_settings(grid, CPU, model.precision, args.max_grad_norm)
    step = functools.partial(full_5d.train_step, model, optimizer, settings=settings,
                             bias_update_rate=args.bias_update_rate,
                             balancing_log=full_5d.balancing_log(model, pipeline, grid))
    reads = []
    with RoutingMeter(load_lesson("07_report").model_parts(model, pipeline), plan.shape.grad_accum):
        for index in range(2):
            with HostReads() as counter:
                step(plan.batches.step_batch(index, grid.dp_rank))
            reads.append(counter.sites)
    return reads


def test_a_composed_moe_step_reads_to_the_host_once_per_layer_and_micro_batch_and_nothing_more():
    """What a GPU would wait for in one optimizer step of 07 with experts: the all-to-all's split
    sizes, once per layer and micro-batch (2 x 2), and nothing else. Clipping, the skip of a
    non-finite step and the router biases' update decide on the device; the step's figures (the
    loss, the gradient norm, the balancing losses) stay there for the shared loop, which reads
    them a step later (test_train); the routing meter, the router's load count and the balancing
    log's sums stay there too (each used to read once per layer and micro-batch)."""
    split = ("tolist", "05_expert_parallel.py:expert_parallel_compute")
    for rank, steps in enumerate(run_ranks(2, host_reads_of_two_steps)):
        for sites in steps:
            assert sites == [split] * 4, (rank, sites)
