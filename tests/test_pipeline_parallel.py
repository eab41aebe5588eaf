"""Lesson 03 proven: pipeline-parallel training on real gloo ranks against one device.

Equality. Every pipelined run (AFAB, 1F1B, interleaved, and zero-bubble from the lesson's continuation
03_zero_bubble.py; pp = 2, 3 and 4; with and without dp)
trains the reference GPT on the same global batches as one device. A stage runs exactly
the reference's float operations on each micro-batch; what differs is the order of a few sums (the
loss summed token by token and then over micro-batches and ranks, the data-parallel gradient sum,
the gradient norm summed per stage and then over the pipeline). Those reorderings cost a few ulp:
1e-6 absolute on gradients of order 1e-2..1e0 and 1e-5 on losses of order 5 leave room for that
and nothing else, while a wrongly scaled gradient (the micro-batch count applied twice or not at
all) is off by a factor of m and fails by orders of magnitude. Parameters after AdamW are compared
in units of the learning rate (1e-2 * lr): Adam normalises each element's step, so an element
whose gradient is rounding noise (|g| ~ 1e-9, known to ~1e-3 relative) would move by a large
fraction of lr m / sqrt(v) ~ +-1 whatever its size. Both runs therefore use AdamW's eps = 1e-6
instead of 1e-8: an element whose gradient is below ~1e-6 then moves by lr * g / eps, so rounding
noise of 1e-9 moves it by 1e-3 * lr, while a real error (a skipped step, a gradient from the wrong
micro-batch) still moves parameters by ~lr. With eps = 1e-8, 2 of the 8192 elements of one matrix
were 2 % of lr apart after 3 steps although every step-0 gradient agreed to 1e-9.

Clipping. The masked dp x pp runs clip at a max-norm far below the gradient norm, so every step's
gradient is scaled by max_norm / norm: the norm (summed over stages) is compared with the
reference's to 1e-6 relative, and the clipped gradients with the reference's clipped ones. (Lesson
07's tests prove pipeline stages that are also tensor-parallel: tests/test_full_5d_pipeline_composition.py.)

Masked targets. Runs on batches whose micro-batches ignore different numbers of targets (one
micro-batch all of them) equal the reference's mean over the targets that count: the loss is
token-weighted over the global batch, not a mean of per-micro-batch or per-rank means.

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

import itertools
import os
import re
import subprocess
import sys
from dataclasses import replace
from functools import partial

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

from picotron_like import comm
from picotron_like.data import BatchShape, StepBatch, TokenBatches, builtin_corpus_paths
from picotron_like.lessons import REPO_ROOT, load_lesson
from picotron_like.loss import cross_entropy_loss
from picotron_like.metrics import ActivationMeter, data_parallel_traffic, step_traffic
from picotron_like.model import GPT, get_config
from picotron_like.pipeline_tools import (PipelineDeadlock, TimelineRecorder, bubble_fraction, gather_timelines,
                                          peak_live_micro_batches, render_timeline, simulate_pipeline)
from picotron_like.testing import ignore_targets, masked_step_batch, run_ranks, train_reference
from picotron_like.topology import ConfigError, GridShape, ProcessGrid
from picotron_like.train import StepSettings, build_optimizer

lesson = load_lesson("03_pipeline_parallel")
zero_bubble = load_lesson("03_zero_bubble")

BASE = replace(get_config("tiny"), hidden=64, n_heads=4, n_kv_heads=2, ffn_hidden=128)
CFG_8 = replace(BASE, n_layers=8)          # pp=4 x v=2: one layer per chunk
CFG_5 = replace(BASE, n_layers=5)          # pp=2: 3 + 2 layers, 2+1+1+1 interleaved; pp=3: 2 + 2 + 1
SEQ, STEPS, LR, SEED = 16, 3, 3e-3, 7
# pp=4 runs 8 micro-batches of 2 sequences; dp=2 x pp=2 runs 4 of 1 sequence on each dp rank.
GLOBAL_SEQUENCES = {8: 16, 5: 8}
TOLERANCE = dict(rtol=0, atol=1e-6)
PARAM_TOLERANCE = dict(rtol=0, atol=1e-2 * LR)
# Far below the gradient norms (~1 to 5): clipping scales every step of the runs that use it.
SMALL_MAX_NORM = 0.05
CPU = torch.device("cpu")


def batches(micro: int, n_micro: int, dp: int) -> TokenBatches:
    return TokenBatches(builtin_corpus_paths()[0], BatchShape(micro, SEQ, n_micro, dp), seed=SEED,
                        vocab_size=BASE.vocab_size)


# Targets ignored in a different number on every sequence, all of them on sequence 5: with one
# sequence per micro-batch and dp = 2 x m = 4, a different number on every micro-batch and rank,
# and nothing to learn on dp rank 1's second micro-batch.
MASK_TARGETS = partial(ignore_targets, ignored_rows=(5,))


ADAM_EPS = 1e-6


def optimizer_for(model):
    """AdamW as the lessons build it, with the larger eps explained in the module docstring."""
    optimizer = build_optimizer(model, LR)
    for group in optimizer.param_groups:
        group["eps"] = ADAM_EPS
    return optimizer


@pytest.fixture(scope="module")
def references():
    """One device, the whole global batch at once, keyed by (n_layers, max_grad_norm, masked)."""
    # One thread, as the ranks use: on two shared cores torch's default of one thread per core
    # makes these small runs 10-50x slower whenever anything else is running.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    runs = {(cfg.n_layers, norm, masked): train_reference(cfg, SEED, batches(GLOBAL_SEQUENCES[cfg.n_layers], 1, 1),
                                                          STEPS, LR, norm, adam_eps=ADAM_EPS,
                                                          mask_targets=MASK_TARGETS if masked else None)
            for cfg, norm, masked in ((CFG_5, 1.0, False), (CFG_8, 1.0, False), (CFG_5, SMALL_MAX_NORM, True))}
    torch.set_num_threads(threads)
    return runs


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
        timelines = simulate_pipeline(programs, virtual_stages=v)
        where = f"{schedule} pp={pp} m={m} v={v}"
        for rank, events in enumerate(timelines):
            done = sorted((a.kind, a.chunk, a.micro_batch) for a, _, _ in events)
            assert done == sorted((k, c, i) for k in "FB" for c in range(v) for i in range(m)), where
        assert bubble_fraction(timelines) == pytest.approx(lesson.bubble_formula(schedule, pp, m, v)), where
        peaks = [peak_live_micro_batches(program) for program in programs]
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
    with pytest.raises(PipelineDeadlock, match="no rank can move"):
        simulate_pipeline(programs, virtual_stages=v)


@pytest.mark.parametrize("grid, cfg, schedule, v, m, message", [
    (GridShape(pp=8), CFG_5, "1f1b", 1, 8, r"--pp 8 is more pipeline stages than n_layers=5"),
    (GridShape(pp=4), CFG_8, "interleaved", 2, 2, r"m = 2 micro-batches \(--micro-batches\) is fewer than --pp 4"),
    (GridShape(pp=4), CFG_8, "interleaved", 2, 6, r"m = 6 micro-batches \(--micro-batches\) is not a multiple of"),
    (GridShape(pp=4), CFG_5, "interleaved", 2, 8, r"4 x --virtual-stages 2 = 8 chunks but n_layers=5"),
    (GridShape(pp=2), CFG_5, "1f1b", 2, 4, r"--virtual-stages 2 needs --schedule interleaved"),
])
def test_bad_configurations_fail_with_one_clear_line(grid, cfg, schedule, v, m, message):
    with pytest.raises(ConfigError, match=message):
        lesson.validate_pipeline_config(grid, grid.world_size, cfg, schedule, v, m)


def test_bad_configuration_stops_the_script_before_any_collective():
    """Impossible flags: one `error:` line, exit code 2, no process group, no hang. Three runs as one
    process with torchrun's variables set (it stands for every rank, and cannot hang), and the
    issue's command under torchrun itself: the micro-batch count that --global-batch-tokens gives
    (384 / (4 x 32) = 3) is validated, where it used to pass and die in an IndexError after start-up."""
    script = str(REPO_ROOT / "03_pipeline_parallel.py")
    env = dict(os.environ, WORLD_SIZE="4", RANK="0")
    commands = [([sys.executable, script, "--pp", "4", "--schedule", "interleaved", "--micro-batches", "2"], env),
                ([sys.executable, script, "--pp", "4", "--global-batch-tokens", "1000"], env),
                ([sys.executable, script, "--pp", "2", "--tp", "2"], env),
                ([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", script,
                  "--pp", "2", "--schedule", "interleaved", "--n-layers", "4", "--global-batch-tokens", "384",
                  "--micro-batch-size", "4", "--seq-len", "32"], None)]
    processes = [subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                  cwd=REPO_ROOT) for command, env in commands]
    *alone, (_, launched) = [process.communicate(timeout=120) for process in processes]
    # The third: tensor-parallel stages are lesson 07's composition, refused with a pointer there.
    for process, (_, stderr), message in zip(processes[:3], alone,
                                             ("m = 2 micro-batches (--micro-batches) is fewer than --pp 4",
                                              "is not a whole number of micro-steps", "lesson 07")):
        assert process.returncode == 2, stderr
        assert stderr.count("error: ") == 1 and message in stderr and "Traceback" not in stderr, stderr
    # Under torchrun: the launcher fails (its own traceback reports the child), rank 0 exited with 2
    # after printing one line, and nothing in the lesson raised.
    assert processes[3].returncode != 0, launched
    assert launched.count("error: ") == 1, launched
    assert ("m = 3 micro-batches (--global-batch-tokens 384 / (4 sequences x 32 tokens x dp 1)) is not a multiple "
            "of --pp 2") in launched, launched
    assert re.search(r"exitcode\s*: 2 ", launched) and "03_pipeline_parallel.py\", line" not in launched, launched


# ----------------------------------------------------------------------------- equality on real ranks


class RecordedSteps(TimelineRecorder):
    """The steps a pipeline runs, in order, seen from outside: the timeline recorder's wrapping of
    the per-step methods, extended to each exchange, so that its events read as a communication
    program (each exchange's transfers, each action)."""

    methods = ("exchange", "forward_step", "backward_step")

    @property
    def steps(self) -> list:
        return [step for step, _, _ in self.events]


def keep_first_step_gradients(optimizer, chunks, store):
    """The gradients (after clipping) the optimizer is about to apply at its first step."""
    def hook(opt, args, kwargs):
        if not store:
            store.update({name: p.grad.clone() for chunk in chunks for name, p in chunk.module.named_parameters()})
    optimizer.register_step_pre_hook(hook)


def pipeline_run(cfg, grid_shape, schedule, v, micro, n_micro, max_grad_norm=1.0, masked=False, async_sends=True):
    """Step-0 gradients (before and after clipping), per-step losses and gradient norms, final parameters,
    and the schedule's measurements, every one observed from outside the pipeline."""
    grid = ProcessGrid(grid_shape)
    chunks = lesson.build_model_chunks(cfg, SEED, grid, CPU, v, bucket_bytes=64 * 1024)
    optimizer = optimizer_for(nn.ModuleList(chunk.module for chunk in chunks))
    data = batches(micro, n_micro, grid_shape.dp)

    def step_batch(step):
        if masked:
            return masked_step_batch(data, step, grid.dp_rank, MASK_TARGETS)
        return data.step_batch(step, grid.dp_rank)

    boundary = lesson.activation_shape(cfg, data.shape)
    if schedule == "zero-bubble":     # 03_zero_bubble.py: its Pipeline, and its meter of what waits for W
        pipeline = zero_bubble.ZeroBubblePipeline(chunks, grid, schedule, n_micro, v, boundary, CPU,
                                                  async_sends=async_sends)
        meter = zero_bubble.KeptActivationMeter(pipeline)
    else:
        pipeline = lesson.Pipeline(chunks, grid, schedule, n_micro, v, boundary, CPU, async_sends=async_sends)
        meter = ActivationMeter(*pipeline.chunks)

    with meter as activations, RecordedSteps(pipeline, grid.pp_group, CPU) as ran, CountedFlops() as flops:
        pipeline.forward_backward(step_batch(0))
    for chunk in chunks:
        chunk.finish_gradient_synchronization()
    grads = {name: p.grad.clone() for chunk in chunks for name, p in chunk.module.named_parameters()}
    for chunk in chunks:
        chunk.zero_grad()

    clipped = {}
    keep_first_step_gradients(optimizer, chunks, clipped)
    comm.meter.reset()
    settings = StepSettings(CPU, torch.float32, max_grad_norm)
    results = [lesson.train_step(pipeline, optimizer, step_batch(step), settings) for step in range(STEPS)]
    named = [(name, p) for chunk in chunks for name, p in chunk.module.named_parameters()]
    return {"losses": [r.loss for r in results], "norms": [r.grad_norm for r in results],
            "grads": grads, "clipped": clipped,
            "params": {name: p.detach().clone() for name, p in named},
            # every collective of the training steps, per step, and the devices its tensors lived on
            "traffic": {key: entry.payload_bytes / STEPS for key, entry in comm.meter.traffic.items()},
            # the report's rows: p2p, the stage's gradients over dp, the loss over pp and dp, the norm over pp
            "predicted_traffic": step_traffic(lesson.predicted_p2p_traffic(pipeline, data.shape.grad_accum),
                                              data_parallel_traffic(sum(p.numel() for _, p in named)),
                                              loss_groups=("pp", "dp"), norm_groups=("pp",)),
            "devices": dict(comm.meter.devices),
            "sent": comm.meter.get("isend", "pp").payload_bytes / STEPS,
            "boundary_elements": torch.Size(boundary).numel(),
            # saved for backward; kept between actions (the W queues too: zero-bubble's meter)
            "peak_bytes": getattr(activations, "peak_saved_bytes", activations.peak_bytes),
            "kept_bytes": activations.peak_bytes,
            "flops": flops.total,
            "chunk_bytes": [lesson.predicted_chunk_activation_bytes(chunk.module, cfg, micro, SEQ) for chunk in chunks],
            "program": pipeline.program, "ran": ran.steps,
            "pp_rank": grid.pp_rank, "dp_rank": grid.dp_rank}


class CountedFlops(TorchDispatchMode):
    """The FLOPs of every matmul and attention call that runs, backward included, by torch's own
    formulas (torch.utils.flop_counter's, without its module tracking, which autograd.grad trips)."""

    def __init__(self):
        super().__init__()
        self.total = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func._overloadpacket in flop_registry:
            self.total += flop_registry[func._overloadpacket](*args, **(kwargs or {}), out_val=out)
        return out


def spec(cfg, grid, schedule, v, micro, n_micro, **options):
    return dict(cfg=cfg, grid_shape=grid, schedule=schedule, v=v, micro=micro, n_micro=n_micro, **options)


# pp=4 (m=8) and dp=2 x pp=2 on 5 layers (uneven split), every schedule; and dp=2 x pp=2 on masked
# targets. The dp=2 x pp=2 micro-batches hold one sequence each: their token ids are views of one
# shared buffer, which the activation measurement rightly counts once, so only the pp=4 runs (two
# sequences per micro-batch) compare activation bytes with the formula.
FOUR_RANK_RUNS = {
    **{f"pp4 {s}": spec(CFG_8, GridShape(pp=4), s, v, micro=2, n_micro=8, measure_bytes=True)
       for s, v in (("afab", 1), ("1f1b", 1), ("interleaved", 2))},
    **{f"dp2pp2 {s}": spec(CFG_5, GridShape(dp=2, pp=2), s, v, micro=1, n_micro=4)
       for s, v in (("afab", 1), ("1f1b", 1), ("interleaved", 2))},
    **{f"dp2pp2 {s} masked, clipped": spec(CFG_5, GridShape(dp=2, pp=2), s, v, micro=1, n_micro=4, masked=True,
                                           max_grad_norm=SMALL_MAX_NORM)
       for s, v in (("1f1b", 1), ("interleaved", 2), ("zero-bubble", 1))},
    # the path async sends replace: each send waited for at its own exchange
    "pp4 interleaved, sends waited": spec(CFG_8, GridShape(pp=4), "interleaved", 2, micro=2, n_micro=8,
                                          async_sends=False),
}
# An odd layout: 3 stages over 5 layers (2 + 2 + 1).
THREE_RANK_RUNS = {**{f"pp3 {s}": spec(CFG_5, GridShape(pp=3), s, 1, micro=2, n_micro=4, measure_bytes=True)
                      for s in ("afab", "1f1b", "zero-bubble")},
                   **{f"pp3 {s}, sends waited": spec(CFG_5, GridShape(pp=3), s, 1, micro=2, n_micro=4, async_sends=False)
                      for s in ("1f1b", "zero-bubble")}}
def run_all(specs):
    return {label: pipeline_run(**{k: v for k, v in spec.items() if k != "measure_bytes"})
            for label, spec in specs.items()}


def reference_for(spec, references):
    return references[(spec["cfg"].n_layers, spec.get("max_grad_norm", 1.0), spec.get("masked", False))]


def assert_equal_to_reference(result, reference, max_grad_norm, where):
    torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(reference["losses"]), rtol=0, atol=1e-5,
                               msg=f"{where} losses")
    # The norm of the whole model, every parameter element counted once (its square summed over
    # stages). At step 0 (the same parameters) only a few ulp of reordering separate it from the
    # reference's; leaving out a stage moves it by far more. Later steps start from parameters that already differ by
    # the rounding of the earlier AdamW steps (measured up to 1.6e-6 relative after two).
    assert result["norms"][0] == pytest.approx(reference["norms"][0], rel=1e-6, abs=0), f"{where} grad norm"
    assert result["norms"] == pytest.approx(reference["norms"], rel=1e-5, abs=0), f"{where} grad norms"
    # Clipping multiplies the gradients by max_norm / norm: their rounding scales with them, and so
    # does the tolerance.
    scale = min(1.0, max_grad_norm / (reference["norms"][0] + 1e-6))
    for name, grad in result["grads"].items():
        torch.testing.assert_close(grad, reference["grads"][name], **TOLERANCE, msg=f"{where} grad {name}")
        torch.testing.assert_close(result["clipped"][name], reference["clipped_grads"][name], rtol=0,
                                   atol=TOLERANCE["atol"] * scale, msg=f"{where} clipped grad {name}")
    for name, param in result["params"].items():
        torch.testing.assert_close(param, reference["params"][name], **PARAM_TOLERANCE, msg=f"{where} param {name}")


def check_runs(per_rank, specs, references):
    """Every rank of every run: equal to one device; every collective measured as the report
    predicts, on the rank's device; p2p and activations as the formulas say."""
    for label, spec in specs.items():
        results = [runs[label] for runs in per_rank]
        pp, v, m = spec["grid_shape"].pp, spec["v"], spec["n_micro"]
        reference = reference_for(spec, references)
        assert min(reference["norms"]) > spec.get("max_grad_norm", 1.0), f"{label}: clipping must act"
        names = set()
        for rank, result in enumerate(results):
            where = f"{label} rank={rank}"
            # What ran is the program the configuration rules simulated: for 1F1B, the loop that
            # writes it out (Pipeline.one_f_one_b) sends and receives exactly as it says.
            assert result["ran"] == list(result["program"]), where
            assert_equal_to_reference(result, reference, spec.get("max_grad_norm", 1.0), where)
            names |= set(result["params"])
            assert result["traffic"] == result["predicted_traffic"], where
            # The hot path (p2p buffers, gradient buckets, losses, norms) on the rank's device:
            # every collective of training recorded a device, and it was this rank's.
            assert set(result["devices"]) == set(result["traffic"]), where
            assert set().union(*result["devices"].values()) == {"cpu"}, where
        assert names == set(reference["params"]), f"{label}: some parameter has no stage"
        waited = per_rank[0].get(f"{label}, sends waited")
        for runs in per_rank if waited is not None else ():
            assert_equal_bit_for_bit(runs[label], runs[f"{label}, sends waited"], f"{label} rank {runs[label]['pp_rank']}")
        # p2p over the pipeline: 2*m*b*s*h*4 bytes per boundary, measured to the byte
        one_pipeline = [r for r in results if r["dp_rank"] == 0]
        assert sum(r["sent"] for r in one_pipeline) == (pp * v - 1) * 2 * m * results[0]["boundary_elements"] * 4
        if not spec.get("measure_bytes"):
            continue
        for result in one_pipeline:
            r = result["pp_rank"]
            where = f"{label} stage {r}"
            # Activation bytes, measured by the saved-tensor hooks, are the reference formula's bytes
            # of one micro-batch of each chunk, summed over the micro-batches the schedule keeps alive:
            # AFAB m, 1F1B p - r.
            if spec["schedule"] != "zero-bubble":     # which keeps more than autograd's saved tensors: see below
                assert result["peak_bytes"] == peak_live_micro_batches(result["program"], result["chunk_bytes"]), where
            # Zero-bubble's B frees what autograd saved as 1F1B's backward does (what W needs is kept elsewhere).
            kept = {"afab": m, "1f1b": min(pp - r, m), "zero-bubble": min(pp - r, m)}.get(spec["schedule"])
            if kept is not None:
                assert result["peak_bytes"] == kept * result["chunk_bytes"][0], where


def assert_equal_bit_for_bit(async_sends, waited, where):
    """Leaving sends in flight changes when a rank waits, not what it computes: the same losses,
    gradients, parameters and traffic to the last bit."""
    assert async_sends["losses"] == waited["losses"] and async_sends["norms"] == waited["norms"], where
    assert async_sends["traffic"] == waited["traffic"] and async_sends["ran"] == waited["ran"], where
    for key in ("grads", "clipped", "params"):
        assert async_sends[key].keys() == waited[key].keys(), where
        for name, tensor in async_sends[key].items():
            assert torch.equal(tensor, waited[key][name]), f"{where} {key} {name}"


def test_receiving_requests_wait_for_receives_and_leave_sends_in_flight():
    """gloo returns a request per transfer: only the receives' are waited for. NCCL returns one
    request for a batch: waited for if the batch receives anything, else left in flight."""
    send, recv = (lesson.Transfer(direction, 1, lesson.Message("activation", 1, 0)) for direction in ("send", "recv"))
    assert lesson.receiving_requests((send, recv, send), ["w1", "w2", "w3"]) == [False, True, False]
    assert lesson.receiving_requests((send, recv), ["group"]) == [True]
    assert lesson.receiving_requests((send, send), ["group"]) == [False]


def test_pipeline_schedules_equal_one_device(references):
    per_rank = run_ranks(4, run_all, FOUR_RANK_RUNS, timeout_s=300)
    check_runs(per_rank, FOUR_RANK_RUNS, references)
    # AFAB's first stage keeps all m = 8 micro-batches, 1F1B's pp = 4.
    assert per_rank[0]["pp4 afab"]["peak_bytes"] == 2 * per_rank[0]["pp4 1f1b"]["peak_bytes"]


def test_three_stages_over_an_uneven_split_equal_one_device(references):
    per_rank = run_ranks(3, run_all, THREE_RANK_RUNS, timeout_s=240)
    assert [len({n.split(".")[1] for n in r["pp3 1f1b"]["params"] if n.startswith("layers.")})
            for r in per_rank] == [2, 2, 1]
    check_runs(per_rank, THREE_RANK_RUNS, references)
    assert_zero_bubble_keeps_and_computes_what_1f1b_does([r["pp3 zero-bubble"] for r in per_rank],
                                                         [r["pp3 1f1b"] for r in per_rank])


def assert_zero_bubble_keeps_and_computes_what_1f1b_does(zero_bubble, one_f_one_b):
    """ZB-H1's two promises, measured on every stage of one step.

    Memory: what a stage keeps between actions counts the saved tensors and the inputs and output
    gradients waiting in the W queues (KeptActivationMeter). The first stage peaks at 1F1B's first
    stage's bytes exactly; later stages hold back W's and keep more than their 1F1B selves, never
    more than that peak. Work: B + W is every backward operation once, so each stage's FLOPs equal
    1F1B's (a W that recomputed part of backward would add some; see the test after this one)."""
    kept = [result["kept_bytes"] for result in zero_bubble]
    kept_by_1f1b = [result["kept_bytes"] for result in one_f_one_b]
    assert kept_by_1f1b == [result["peak_bytes"] for result in one_f_one_b]       # 1F1B: nothing queued
    assert kept[0] == kept_by_1f1b[0] == max(kept_by_1f1b), (kept, kept_by_1f1b)
    assert all(mine > theirs for mine, theirs in zip(kept[1:], kept_by_1f1b[1:])), (kept, kept_by_1f1b)
    assert max(kept) == max(kept_by_1f1b), (kept, kept_by_1f1b)
    assert [result["flops"] for result in zero_bubble] == [result["flops"] for result in one_f_one_b]


def test_weight_gradients_split_off_without_computing_anything_twice():
    """The FLOP counter behind the equal-work check can fail: splitting one backward naively, by
    autograd.grad for the input and then again for the weights, recomputes the input gradients
    inside the stage; the deferred linears' B + W compute each matmul once, as one backward does."""
    def stage_flops(split: str) -> int:
        stage = lesson.build_stage_chunks(CFG_5, SEED, 2, 1)[0]
        pending = zero_bubble.defer_weight_gradients(stage) if split == "deferred" else None
        x = torch.randn(2, SEQ, CFG_5.hidden, requires_grad=True)
        targets = torch.randint(0, CFG_5.vocab_size, (2, SEQ))
        with CountedFlops() as flops:
            loss = stage(x, targets, torch.arange(SEQ))
            if split == "none":
                loss.backward()
            elif split == "naive":
                torch.autograd.grad(loss, x, retain_graph=True)
                torch.autograd.grad(loss, list(stage.parameters()))
            else:
                with pending.input_gradient(0):
                    loss.backward()
                pending.weight_gradients(0)
        return flops.total

    whole, deferred, naive = stage_flops("none"), stage_flops("deferred"), stage_flops("naive")
    assert deferred == whole < naive, (whole, deferred, naive)


def test_zero_bubble_schedule_simulated():
    """ZB-H1 on the simulator's clock, with B and W of their own durations: every action once, each
    micro-batch's W after its B; the bubble (p-1)(T_F + T_B - T_W) / (m (T_F + T_B + T_W)) wherever
    m >= p and W takes no longer than F or B, below 1F1B's with the same backward (B + W); no stage ever
    keeps more micro-batches between F and W than 1F1B's first stage keeps (min(p, m))."""
    times = ((1, 1, 1), (1, 1.2, 0.8), (1, 2, 0.5), (1, 0.8, 0.8), (1.5, 1, 1))
    for (t_f, t_b, t_w), pp in itertools.product(times, range(2, 7)):
        for m in range(1, 3 * pp + 1):
            programs = zero_bubble.pipeline_programs("zero-bubble", pp, m)
            timelines = simulate_pipeline(programs, t_f, t_b, weight_time=t_w)
            where = f"pp={pp} m={m} times={t_f, t_b, t_w}"
            for events in timelines:
                order = [(a.kind, a.micro_batch) for a, _, _ in events]
                assert sorted(order) == sorted((k, i) for k in "FBW" for i in range(m)), where
                assert all(order.index(("B", i)) < order.index(("W", i)) for i in range(m)), where
            assert [peak_live_micro_batches(program) for program in programs] == [min(pp, m)] * pp, where
            if m < pp:
                continue
            measured = bubble_fraction(timelines)
            assert measured == pytest.approx(zero_bubble.zero_bubble_formula(pp, m, t_f, t_b, t_w)), where
            one_f_one_b = simulate_pipeline(lesson.pipeline_programs("1f1b", pp, m), t_f, t_b + t_w)
            assert measured < bubble_fraction(one_f_one_b), where


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

    def forward(self, x, targets=None, positions=None, reduction="mean"):
        arrival = 0.0 if self.first else x.flatten()[0].item()
        x = torch.zeros(1, 2, 4) if self.first else x
        end = self.clock.run(arrival, 1.0 / self.v)
        h = StampBackward.apply(x * self.weight, self.clock, 2.0 / self.v, self.last)
        stamped = h - h.detach() + end            # the value is the time, the gradient flows as through h
        return stamped.sum() if self.last else stamped


def ticked_timelines(grid, schedule, v, n_micro):
    """Run a schedule on ticking chunks; return every stage's (action, start tick, end tick)."""
    clock = StageClock()
    n_stages = grid.pp_size * v
    chunks = [TickingChunk(clock, stage == 0, stage == n_stages - 1, v)
              for stage in range(grid.pp_rank, n_stages, grid.pp_size)]
    pipeline = lesson.Pipeline(chunks, grid, schedule, n_micro, v, (1, 2, 4), CPU)
    batch = StepBatch([(torch.zeros(1, 2, dtype=torch.long),) * 2] * n_micro, n_targets=2 * n_micro)
    # The recorder wraps the pipeline's per-action methods from outside: it knows which action ran
    # (in program order), the clock when in ticks.
    with TimelineRecorder(pipeline, grid.pp_group, CPU) as recorder:
        pipeline.forward_backward(batch)
    events = [(action, start, end) for (action, _, _), (start, end) in zip(recorder.events, clock.intervals)]
    assert "forward_step" not in vars(pipeline), "the recorder must leave the pipeline as it found it"
    return gather_timelines(events, grid.pp_group)


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
    stage = PipelineStage(LogitsStage(chunk), grid.pp_rank, grid.pp_size, CPU,
                          group=comm.process_group(grid.pp_group))
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

    batch = batches(1, 8, 1).step_batch(0, 0)
    torch_results = {name: torch_pipelining_losses(grid, cls, batch.micro_batches)
                     for name, cls in (("gpipe", ScheduleGPipe), ("1f1b", Schedule1F1B))}
    chunks = lesson.build_model_chunks(CFG_8, SEED, grid, CPU)
    ours = lesson.Pipeline(chunks, grid, "1f1b", 8, 1, (1, SEQ, CFG_8.hidden), CPU).forward_backward(batch)
    our_grads = {name: p.grad.clone() for name, p in chunks[0].module.named_parameters()}
    return bubbles, {"torch": torch_results, "ours": (ours.item(), our_grads)}


def test_bubble_and_torch_pipelining():
    per_rank = run_ranks(4, bubble_and_torch_runs, timeout_s=240)
    timelines = per_rank[0][0]
    measured = {schedule: bubble_fraction(timeline) for schedule, timeline in timelines.items()}
    for schedule, v in (("afab", 1), ("1f1b", 1), ("interleaved", 2)):
        assert measured[schedule] == pytest.approx(lesson.bubble_formula(schedule, 4, 8, v), abs=1e-9), \
            f"{schedule}: measured {measured[schedule]:.4f}\n{render_timeline(timelines[schedule])}"
    assert measured["interleaved"] < measured["1f1b"] / 1.9

    # Same stages, same micro-batches: PyTorch's GPipe and 1F1B give our loss and gradients. Their
    # loss is the last stage's list of per-micro-batch means and their gradients are scaled by 1/m
    # (scale_grads=True); every micro-batch here counts the same number of targets, so that is our
    # token-weighted loss.
    for rank, (_, checks) in enumerate(per_rank):
        our_loss, our_grads = checks["ours"]
        for name, (losses, grads) in checks["torch"].items():
            if rank == 3:
                assert sum(losses) / len(losses) == pytest.approx(our_loss, abs=1e-5), name
            for param_name, grad in grads.items():
                torch.testing.assert_close(grad, our_grads[param_name], **TOLERANCE,
                                           msg=f"torch {name} rank {rank} grad {param_name}")


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
    for line in ("timeline of step ", "bubble (idle / busy): measured", "p2p sent per step", "tokens/s"):
        assert line in run.stdout, run.stdout
    # the per-stage table: stage, layers, micro-batches kept, activations and sends measured / predicted
    stages = re.findall(r"^(\d) +\d+ +\d+ +(\S+) +(\S+) +(\S+) +(\S+)$", run.stdout, re.M)
    assert [stage for stage, *_ in stages] == ["0", "1"], run.stdout
    assert all(kept == predicted_kept and sent == predicted_sent
               for _, kept, predicted_kept, sent, predicted_sent in stages), run.stdout
