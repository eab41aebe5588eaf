"""Lesson 03 proven: pipeline-parallel training on real gloo ranks against one device.

Equality. Every pipelined run (AFAB, 1F1B, interleaved; pp = 2 and 4; with dp and with dp x tp)
trains the reference GPT on the same global batches as one device. A stage runs exactly the
reference's float operations on each micro-batch; what differs is the order of a few sums (the
gradient accumulated over micro-batches, the data-parallel average, the gradient norm summed
per stage and then over the pipeline). Those reorderings cost a few ulp: 1e-6 absolute on
gradients of order 1e-2..1e0 and 1e-5 on losses of order 5 leave room for that and nothing else,
while a wrongly scaled gradient (the micro-batch count applied twice or not at all) is off by a
factor of m and fails by orders of magnitude. Parameters after AdamW are compared in units of
the learning rate (1e-2 * lr): Adam normalises each element's step, so an element whose gradient
is rounding noise (|g| ~ 1e-9, known to ~1e-3 relative) would move by a large fraction of lr
m / sqrt(v) ~ +-1 whatever its size. Both runs therefore use AdamW's eps = 1e-6 instead of 1e-8:
an element whose gradient is below ~1e-6 then moves by lr * g / eps, so rounding noise of 1e-9 moves
it by 1e-3 * lr, while a real error (a skipped step, a gradient from the wrong micro-batch) still
moves parameters by ~lr. With eps = 1e-8, 2 of the 8192 elements of one matrix were 2 % of lr apart
after 3 steps although every step-0 gradient agreed to 1e-9.

The bubble. Measured on real ranks running the real executor, with stages of uniform work counted
in ticks instead of seconds: the tensors a stage sends carry the tick at which they were produced
(section "the bubble" below). Wall-clock time cannot be the yardstick on two shared cores: with
the same code, sleeping stages of 25 ms measured 0.29 for interleaved 1F1B (formula 0.1875) at a
load average of 7, and 0.44 at 11, because every action needs a core to wake up on. Ticks make the
measurement exact (margin 1e-9) and still catch what matters: an executor that runs the program in
the wrong order, waits where it need not, or serialises stages shows a larger bubble. The
simulator's timelines are checked against the same formulas for many more (pp, m, v).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist
from torch import nn

from picotron_like import comm
from picotron_like.data import BatchShape, DataError, TokenBatches, builtin_corpus_paths
from picotron_like.model import GPT, cross_entropy_loss, get_config
from picotron_like.testing import run_ranks, train_reference
from picotron_like.topology import REPO_ROOT, ConfigError, GridShape, ProcessGrid, load_lesson
from picotron_like.train import build_optimizer

lesson = load_lesson("03_pipeline_parallel")

BASE = replace(get_config("tiny"), hidden=64, n_heads=4, n_kv_heads=2, ffn_hidden=128)
CFG_8 = replace(BASE, n_layers=8)          # pp=4 x v=2: one layer per chunk
CFG_5 = replace(BASE, n_layers=5)          # pp=2: 3 + 2 layers, and 2+1+1+1 interleaved
SEQ, STEPS, LR, SEED = 16, 3, 3e-3, 7
# pp=4 runs 8 micro-batches of 2 sequences; dp=2 x pp=2 runs 4 of 1 sequence on each dp rank.
GLOBAL_SEQUENCES = {8: 16, 5: 8}
TOLERANCE = dict(rtol=0, atol=1e-6)
PARAM_TOLERANCE = dict(rtol=0, atol=1e-2 * LR)
CPU = torch.device("cpu")


def batches(micro: int, n_micro: int, dp: int) -> TokenBatches:
    return TokenBatches(builtin_corpus_paths()[0], BatchShape(micro, SEQ, n_micro, dp), seed=SEED,
                        vocab_size=BASE.vocab_size)


ADAM_EPS = 1e-6


def optimizer_for(model):
    """AdamW as the lessons build it, with the larger eps explained in the module docstring."""
    optimizer = build_optimizer(model, LR)
    for group in optimizer.param_groups:
        group["eps"] = ADAM_EPS
    return optimizer


def reference_run(cfg):
    """One device, the whole global batch at once: losses, step-0 gradients, final parameters."""
    reference = train_reference(cfg, SEED, batches(GLOBAL_SEQUENCES[cfg.n_layers], 1, 1), STEPS, LR,
                                adam_eps=ADAM_EPS)
    return reference["losses"], reference["grads"], reference["params"]


@pytest.fixture(scope="module")
def references():
    return {cfg.n_layers: reference_run(cfg) for cfg in (CFG_5, CFG_8)}


# ----------------------------------------------------------------------------- pure checks, no ranks


def test_stages_hold_exactly_the_reference_parameters():
    assert [list(r) for r in lesson.stage_layer_ranges(5, 2)] == [[0, 1, 2], [3, 4]]
    assert [len(r) for r in lesson.stage_layer_ranges(10, 4)] == [3, 3, 2, 2]
    reference = dict(GPT(CFG_5, seed=SEED).named_parameters())
    seen = {}
    pp, v = 2, 2
    for rank in range(pp):
        chunks = lesson.build_stage_chunks(CFG_5, SEED, pp, rank, v)
        # round-robin: rank 0 holds virtual stages 0 and 2, rank 1 holds 1 and 3
        assert [list(c.layer_ids) for c in chunks] == ([[0, 1], [3]] if rank == 0 else [[2], [4]])
        assert (chunks[0].tok_embeddings is not None) == (rank == 0)
        assert (chunks[-1].lm_head is not None) == (rank == pp - 1)
        for chunk in chunks:
            for name, param in chunk.named_parameters():
                assert name not in seen, f"{name} on two stages"
                seen[name] = param
                assert torch.equal(param, reference[name]), name
    assert set(seen) == set(reference)


def test_schedules_complete_without_deadlock_and_match_the_bubble_formula():
    """Every rank's program, simulated with rendezvous sends, for many pp, m and v."""
    cases = [(s, pp, m, 1) for s in ("afab", "1f1b") for pp in range(1, 9) for m in range(1, 13)]
    cases += [("interleaved", pp, m, v) for pp in range(2, 9) for v in range(2, 5) for m in range(pp, 3 * pp + 1, pp)]
    for schedule, pp, m, v in cases:
        programs = lesson.pipeline_programs(schedule, pp, m, v)
        timelines = lesson.simulate_pipeline(programs, virtual_stages=v)
        where = f"{schedule} pp={pp} m={m} v={v}"
        for rank, events in enumerate(timelines):
            done = sorted((a.kind, a.chunk, a.micro_batch) for a, _, _ in events)
            assert done == sorted((k, c, i) for k in "FB" for c in range(v) for i in range(m)), where
        assert lesson.bubble_fraction(timelines) == pytest.approx(lesson.bubble_formula(schedule, pp, m, v)), where
        peaks = [lesson.peak_live_micro_batches(program) for program in programs]
        if schedule == "afab":
            assert peaks == [m] * pp, where
        if schedule == "1f1b":
            assert peaks == [min(pp - r, m) for r in range(pp)], where


def test_simulator_catches_a_deadlocking_rule():
    """The simulator is the proof of the no-deadlock claim, so it must be able to fail: communicating
    after every action (instead of after each forward+backward unit) deadlocks interleaved 1F1B."""
    pp, m, v = 4, 8, 2
    programs = [lesson.communication_program([(a,) for unit in lesson.interleaved_schedule(pp, r, m, v) for a in unit],
                                             pp, r, v) for r in range(pp)]
    with pytest.raises(lesson.PipelineDeadlock, match="no rank can move"):
        lesson.simulate_pipeline(programs, virtual_stages=v)


@pytest.mark.parametrize("grid, cfg, schedule, v, m, message", [
    (GridShape(pp=8), CFG_5, "1f1b", 1, 8, r"--pp 8 is more pipeline stages than n_layers=5"),
    (GridShape(pp=4), CFG_8, "interleaved", 2, 2, r"--micro-batches 2 is fewer than --pp 4"),
    (GridShape(pp=4), CFG_8, "interleaved", 2, 6, r"--micro-batches 6 is not a multiple of --pp 4"),
    (GridShape(pp=4), CFG_5, "interleaved", 2, 8, r"4 x --virtual-stages 2 = 8 chunks but n_layers=5"),
    (GridShape(pp=2), CFG_5, "1f1b", 2, 4, r"--virtual-stages 2 needs --schedule interleaved"),
])
def test_bad_configurations_fail_with_one_clear_line(grid, cfg, schedule, v, m, message):
    with pytest.raises(ConfigError, match=message):
        lesson.validate_pipeline_config(grid, grid.world_size, cfg, schedule, v, m)


def test_bad_configuration_stops_the_script_before_any_collective():
    """Without torchrun and with impossible flags: exit code 2, one message, no process group, no hang."""
    env = dict(os.environ, WORLD_SIZE="4", RANK="0")
    script = str(REPO_ROOT / "03_pipeline_parallel.py")
    runs = [subprocess.run([sys.executable, script, *flags], env=env, capture_output=True, text=True, timeout=60)
            for flags in (["--pp", "4", "--schedule", "interleaved", "--micro-batches", "2"],
                          ["--pp", "4", "--global-batch-tokens", "1000"])]
    for run, message in zip(runs, ("--micro-batches 2 is fewer than --pp 4", "is not a whole number of micro-steps")):
        assert run.returncode == 2, run.stderr
        assert message in run.stderr and "Traceback" not in run.stderr, run.stderr
    with pytest.raises(DataError):  # the same rule, as the lesson's batch builder raises it
        BatchShape.from_global_batch_tokens(1000, 4, 128, 1)


# ----------------------------------------------------------------------------- equality on real ranks


def gather_full(param, tensor, grid):
    """The whole tensor of a tensor-parallel shard (lesson 02 marks the dimension it cut)."""
    dim = getattr(param, "tp_split_dim", None)
    if grid.tp_size == 1 or dim is None:
        return tensor.detach().clone()
    pieces = [torch.empty_like(tensor) for _ in range(grid.tp_size)]
    dist.all_gather(pieces, tensor.detach().contiguous(), group=grid.tp_group)
    return torch.cat(pieces, dim=dim)


def pipeline_run(cfg, grid_shape, schedule, v, micro, n_micro, sequence_parallel=False):
    """Step-0 gradients, per-step losses, final parameters and the schedule's measurements."""
    grid = ProcessGrid(grid_shape)
    chunks = lesson.build_model_chunks(cfg, SEED, grid, CPU, v, sequence_parallel, bucket_bytes=64 * 1024)
    optimizer = optimizer_for(nn.ModuleList(chunk.module for chunk in chunks))
    data = batches(micro, n_micro, grid_shape.dp)
    boundary = lesson.activation_shape(cfg, data.shape, grid, sequence_parallel)
    pipeline = lesson.Pipeline(chunks, grid, schedule, n_micro, v, boundary, CPU)

    pipeline.forward_backward(data.micro_batches(0, grid.dp_rank))
    for chunk in chunks:
        chunk.finish_gradient_synchronization()
    grads = {name: p.grad.clone() for chunk in chunks for name, p in chunk.module.named_parameters()}
    for chunk in chunks:
        chunk.zero_grad()

    comm.meter.reset()
    norm_groups, counts_toward_norm = lesson.norm_settings(grid)
    losses = [lesson.train_step(pipeline, optimizer, data.micro_batches(step, grid.dp_rank), 1.0, grid.dp_group,
                                norm_groups, counts_toward_norm) for step in range(STEPS)]
    tp_traffic = {key: comm.meter.get(*key).payload_bytes / STEPS
                  for key in (("all_reduce", "tp"), ("all_gather_single", "tp"), ("reduce_scatter_single", "tp"))}
    sent = comm.meter.get("isend", "pp").payload_bytes / STEPS
    received = comm.meter.get("irecv", "pp").payload_bytes / STEPS
    named = [(name, p) for chunk in chunks for name, p in chunk.module.named_parameters()]
    return {"losses": losses,
            "grads": {name: gather_full(p, grads[name], grid) for name, p in named},
            "params": {name: gather_full(p, p, grid) for name, p in named},
            "sent": sent, "received": received,
            "predicted_sent": lesson.predicted_p2p_bytes(n_micro, boundary, 4, grid.pp_size, grid.pp_rank, v),
            "boundary_elements": torch.Size(boundary).numel(),
            "peak_live": pipeline.peak_live_micro_batches, "peak_bytes": pipeline.activations.peak_bytes,
            "chunk_bytes": [lesson.predicted_chunk_activation_bytes(chunk.module, cfg, micro, SEQ, grid.tp_size,
                                                                    sequence_parallel) for chunk in chunks],
            "program": pipeline.program,
            "tp_traffic": {key: value for key, value in tp_traffic.items() if value},
            "predicted_tp_traffic": lesson.predicted_tp_traffic(pipeline, cfg, data.shape, grid.tp_size,
                                                                sequence_parallel),
            "pp_rank": grid.pp_rank, "tp_rank": grid.tp_rank, "dp_rank": grid.dp_rank}


def four_rank_runs():
    """One spawn: pp=4 (m=8) and dp=2 x pp=2 on 5 layers (uneven split)."""
    runs = {}
    for schedule, v in (("afab", 1), ("1f1b", 1), ("interleaved", 2)):
        runs[("pp4", schedule)] = pipeline_run(CFG_8, GridShape(pp=4), schedule, v, micro=2, n_micro=8)
        runs[("dp2pp2", schedule)] = pipeline_run(CFG_5, GridShape(dp=2, pp=2), schedule, v, micro=1, n_micro=4)
    return runs


def assert_equal_to_reference(result, reference, where):
    ref_losses, ref_grads, ref_params = reference
    torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(ref_losses), rtol=0, atol=1e-5,
                               msg=f"{where} losses")
    for name, grad in result["grads"].items():
        torch.testing.assert_close(grad, ref_grads[name], **TOLERANCE, msg=f"{where} grad {name}")
    for name, param in result["params"].items():
        torch.testing.assert_close(param, ref_params[name], **PARAM_TOLERANCE, msg=f"{where} param {name}")


def test_pipeline_schedules_equal_one_device(references):
    per_rank = run_ranks(4, four_rank_runs, timeout_s=300)
    for (setup, schedule), _ in per_rank[0].items():
        cfg_layers, pp, m = (8, 4, 8) if setup == "pp4" else (5, 2, 4)
        v = 2 if schedule == "interleaved" else 1
        results = [runs[(setup, schedule)] for runs in per_rank]
        names = set()
        for rank, result in enumerate(results):
            where = f"{setup} {schedule} rank={rank}"
            assert_equal_to_reference(result, references[cfg_layers], where)
            names |= set(result["params"])
            # p2p bytes: measured to the byte, and over the pipeline 2*m*b*s*h*4 per boundary
            assert result["sent"] == result["received"] == result["predicted_sent"], where
        assert names == set(references[cfg_layers][2]), f"{setup} {schedule}: some parameter has no stage"
        one_pipeline = [r for r in results if r["dp_rank"] == 0]
        assert sum(r["sent"] for r in one_pipeline) == (pp * v - 1) * 2 * m * results[0]["boundary_elements"] * 4
        # live micro-batches per stage, counted while the schedule runs
        programs = lesson.pipeline_programs(schedule, pp, m, v)
        for result in one_pipeline:
            r = result["pp_rank"]
            expected = {"afab": m, "1f1b": min(pp - r, m)}.get(schedule, lesson.peak_live_micro_batches(programs[r]))
            assert result["peak_live"] == expected, f"{setup} {schedule} stage {r}"
        # Activation bytes, measured by the saved-tensor hooks, are the reference formula's bytes of
        # one micro-batch of each chunk, summed over the micro-batches the schedule keeps alive.
        # (pp4 only: with one sequence per micro-batch the dp2pp2 token ids are views of one
        # shared buffer, which the measurement rightly counts once.)
        if setup == "pp4":
            for result in one_pipeline:
                program = programs[result["pp_rank"]]
                assert result["peak_bytes"] == lesson.peak_live_micro_batches(program, result["chunk_bytes"]), \
                    f"{setup} {schedule} stage {result['pp_rank']}"
    # AFAB's first stage keeps all m = 8 micro-batches, 1F1B's pp = 4.
    assert per_rank[0][("pp4", "afab")]["peak_bytes"] == 2 * per_rank[0][("pp4", "1f1b")]["peak_bytes"]


# ----------------------------------------------------------------------------- the bubble, and PyTorch's own pipelining


class StageClock:
    """A rank's logical clock: compute takes fixed ticks, waiting for a neighbour jumps ahead."""

    def __init__(self):
        self.now, self.intervals = 0.0, []

    def run(self, arrival: float, ticks: float) -> float:
        start = max(self.now, arrival)
        self.now = start + ticks
        self.intervals.append((start, self.now))
        return self.now


class StampBackward(torch.autograd.Function):
    """Identity on the graph; the backward runs the clock and stamps the gradient with the time."""

    @staticmethod
    def forward(ctx, x, clock, ticks, is_last):
        ctx.clock, ctx.ticks, ctx.is_last = clock, ticks, is_last
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        # The gradient received from the next stage carries the time it was sent; the last stage's
        # comes from its own loss, without waiting for anyone.
        arrival = 0.0 if ctx.is_last else grad.flatten()[0].item()
        return torch.full_like(grad, ctx.clock.run(arrival, ctx.ticks)), None, None, None


class TickingChunk(nn.Module):
    """A stage of uniform work measured in ticks (forward 1/v, backward 2/v), not in seconds.

    Its tensors carry time: the activation it sends is filled with the tick its forward ended,
    the gradient with the tick its backward ended, and a stage starts a computation at the later
    of its own clock and the arrival time. So the real executor, with its real p2p order and waits,
    produces the timeline a perfectly quiet machine would, whatever else the cores are doing.
    """

    def __init__(self, clock: StageClock, first: bool, last: bool, virtual_stages: int):
        super().__init__()
        self.clock, self.first, self.last, self.v = clock, first, last, virtual_stages
        self.weight = nn.Parameter(torch.ones(()))

    def forward(self, x, targets=None, positions=None):
        arrival = 0.0 if self.first else x.flatten()[0].item()
        x = torch.zeros(1, 2, 4) if self.first else x
        end = self.clock.run(arrival, 1.0 / self.v)
        h = StampBackward.apply(x * self.weight, self.clock, 2.0 / self.v, self.last)
        stamped = h - h.detach() + end            # the value is the time, the gradient flows as through h
        return stamped.mean() if self.last else stamped


def ticked_timelines(grid, schedule, v, n_micro):
    """Run a schedule on ticking chunks; return every stage's (action, start tick, end tick)."""
    clock = StageClock()
    n_stages = grid.pp_size * v
    chunks = [TickingChunk(clock, stage == 0, stage == n_stages - 1, v)
              for stage in range(grid.pp_rank, n_stages, grid.pp_size)]
    pipeline = lesson.Pipeline(chunks, grid, schedule, n_micro, v, (1, 2, 4), CPU)
    recorder = lesson.Recorder(grid.pp_group)
    pipeline.forward_backward([(torch.zeros(1, 2, dtype=torch.long),) * 2] * n_micro, recorder)
    # The recorder knows which action ran (in program order), the clock when in ticks.
    recorder.events = [(action, start, end) for (action, _, _), (start, end) in zip(recorder.events, clock.intervals)]
    return lesson.gather_timelines(recorder, grid.pp_group)


class LogitsStage(nn.Module):
    """Our stage as torch.distributed.pipelining wants it: one input, logits out of the last stage."""

    def __init__(self, stage):
        super().__init__()
        self.stage = stage

    def forward(self, x):
        return self.stage(x, None, torch.arange(SEQ))


def torch_pipelining_losses(grid, schedule_class, micro_batches):
    from torch.distributed.pipelining import PipelineStage

    chunk = lesson.build_stage_chunks(CFG_8, SEED, grid.pp_size, grid.pp_rank)[0]
    stage = PipelineStage(LogitsStage(chunk), grid.pp_rank, grid.pp_size, CPU, group=grid.pp_group)
    schedule = schedule_class(stage, len(micro_batches), loss_fn=cross_entropy_loss)
    inputs = torch.cat([batch[0] for batch in micro_batches])
    targets = torch.cat([batch[1] for batch in micro_batches])
    losses = []
    if grid.is_first_stage:
        schedule.step(inputs)
    elif grid.is_last_stage:
        schedule.step(target=targets, losses=losses)
    else:
        schedule.step()
    return [loss.item() for loss in losses], {name: p.grad.clone() for name, p in chunk.named_parameters()}


def bubble_and_torch_runs():
    grid = ProcessGrid(GridShape(pp=4))
    bubbles = {schedule: ticked_timelines(grid, schedule, v, 8)
               for schedule, v in (("afab", 1), ("1f1b", 1), ("interleaved", 2))}
    from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe

    micro_batches = batches(1, 8, 1).micro_batches(0, 0)
    torch_results = {name: torch_pipelining_losses(grid, cls, micro_batches)
                     for name, cls in (("gpipe", ScheduleGPipe), ("1f1b", Schedule1F1B))}
    chunks = lesson.build_model_chunks(CFG_8, SEED, grid, CPU)
    ours = lesson.Pipeline(chunks, grid, "1f1b", 8, 1, (1, SEQ, CFG_8.hidden), CPU).forward_backward(micro_batches)
    our_grads = {name: p.grad.clone() for name, p in chunks[0].module.named_parameters()}
    return bubbles, {"torch": torch_results, "ours": (ours.item(), our_grads)}


def test_bubble_and_torch_pipelining():
    per_rank = run_ranks(4, bubble_and_torch_runs, timeout_s=240)
    timelines = per_rank[0][0]
    measured = {schedule: lesson.bubble_fraction(timeline) for schedule, timeline in timelines.items()}
    for schedule, v in (("afab", 1), ("1f1b", 1), ("interleaved", 2)):
        assert measured[schedule] == pytest.approx(lesson.bubble_formula(schedule, 4, 8, v), abs=1e-9), \
            f"{schedule}: measured {measured[schedule]:.4f}\n{lesson.render_timeline(timelines[schedule])}"
    assert measured["interleaved"] < measured["1f1b"] / 1.9

    # Same stages, same micro-batches: PyTorch's GPipe and 1F1B give our loss and gradients. Their
    # loss is the last stage's list of per-micro-batch losses; gradients are scaled by 1/m
    # (scale_grads=True), as ours are.
    for rank, (_, checks) in enumerate(per_rank):
        our_loss, our_grads = checks["ours"]
        for name, (losses, grads) in checks["torch"].items():
            if rank == 3:
                assert sum(losses) / len(losses) == pytest.approx(our_loss, abs=1e-5), name
            for param_name, grad in grads.items():
                torch.testing.assert_close(grad, our_grads[param_name], **TOLERANCE,
                                           msg=f"torch {name} rank {rank} grad {param_name}")


# ----------------------------------------------------------------------------- 3D: dp x pp x tp


def three_d_runs():
    return {sp: pipeline_run(CFG_5, GridShape(dp=2, pp=2, tp=2), "1f1b", 1, micro=1, n_micro=4,
                             sequence_parallel=sp) for sp in (False, True)}


def test_dp_pp_tp_equal_one_device(references):
    per_rank = run_ranks(8, three_d_runs, timeout_s=300)
    for rank, runs in enumerate(per_rank):
        for sp, result in runs.items():
            where = f"dp2 x pp2 x tp2 sp={sp} rank={rank}"
            assert_equal_to_reference(result, references[5], where)
            # measured = predicted: p2p, lesson 02's tp traffic for this stage's layers, activations
            assert result["sent"] == result["predicted_sent"], where
            assert result["tp_traffic"] == result["predicted_tp_traffic"], where
            assert result["peak_bytes"] == lesson.peak_live_micro_batches(result["program"], result["chunk_bytes"]), where


# ----------------------------------------------------------------------------- the script


def test_script_trains_under_torchrun():
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4",
               str(REPO_ROOT / "03_pipeline_parallel.py"), "--pp", "2", "--dp", "2", "--schedule", "interleaved",
               "--micro-batches", "4", "--micro-batch-size", "2", "--seq-len", "64", "--steps", "8",
               "--warmup-steps", "2"]
    run = subprocess.run(command, capture_output=True, text=True, timeout=240, cwd=REPO_ROOT)
    assert run.returncode == 0, run.stdout + run.stderr
    losses = [float(x) for x in re.findall(r"loss (\d+\.\d+)", run.stdout)]
    assert len(losses) == 8 and losses[-1] < losses[0] - 0.5, run.stdout
    for line in ("timeline of the last step", "bubble (idle / busy): measured", "p2p over the whole pipeline",
                 "tokens/s"):
        assert line in run.stdout, run.stdout
