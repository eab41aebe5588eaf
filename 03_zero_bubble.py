"""
Lesson 03, continued: zero-bubble pipelining (ZB-H1), each backward split in two to fill the bubble.

    torchrun --nproc_per_node=2 03_zero_bubble.py --pp 2 --micro-batches 8    # CPU, ~20 s: the bubble next to 1F1B's
    torchrun --nproc_per_node=4 03_zero_bubble.py --pp 2 --dp 2               # two pipelines, dp x pp

The problem. Lesson 03's 1F1B idles (p-1)(T_F + T_B) per stage and step while the pipe fills and
drains, however the forwards and backwards are ordered: a stage's backward of micro-batch i needs
the gradient from the stage after it, which needs that stage's backward first.

The idea. A backward is two computations with different customers: B, the gradient of the stage's
input, which the previous stage waits for, and W, the gradients of the stage's weights, which
nobody needs before the optimizer step. Run B at once and W later, in the time the stage would
otherwise sit idle (Qi et al. 2023, "Zero Bubble Pipeline Parallelism"; ZB-H1 is their schedule
with 1F1B's memory). On 4 stages with 8 micro-batches, F, B and W one unit each (the simulator in
picotron_like.pipeline_tools; forward: the digit, B: the letter, W: its capital, '.': idle):

    1F1B         stage 0 |0123......aa4bb5cc6dd7ee.ff.gg.hh|     33 units (the backward is B + W)
                 stage 1 |.012....aa3bb4cc5dd6ee7ff.gg.hh..|
                 stage 2 |..01..aa2bb3cc4dd5ee6ff7gg.hh....|
                 stage 3 |...0aa1bb2cc3dd4ee5ff6gg7hh......|

    zero-bubble  stage 0 |0123...aA4bB5cC6dD7eEfFgGhH|           27 units: stage r holds r W's back,
    (ZB-H1)      stage 1 |.012..a3bA4cB5dC6eD7fEgFhGH|           so gradients go upstream sooner,
                 stage 2 |..01.a2b3cA4dB5eC6fD7gEhFGH|           and the W's fill the cool-down
                 stage 3 |...0a1b2c3dA4eB5fC6gD7hEFGH|

In a transformer almost all of W is the linear layers' dW = dy^T x, so that is what this file
splits off: a linear layer's backward computes dx now and leaves (x, dy) in its chunk's W queue.
Everything else is lesson 03: the same stages, the same point-to-point exchange, the same
communication program with one more rule (a W talks to nobody, so B's gradient is sent while W
computes).

The price.
    compute: none extra; every backward operation still runs once (a test counts the FLOPs). The
             bubble per stage falls from (p-1)/m to (p-1)(T_F + T_B - T_W) / (m (T_F + T_B + T_W)),
             a third of it when the three take as long; exact when m >= p and W is no longer than
             F or B, so that every W fits a gap.
    memory:  a micro-batch stays alive from its F to its W, but after B it keeps only the linears'
             inputs and output gradients; stage r never holds more than p micro-batches, 1F1B's
             first stage's peak.
    communication: none extra. What does not split this way (a layer whose backward makes dW
             itself: lesson 02's sequence-parallel linears, lesson 05's experts, a recomputed
             block) keeps its whole backward in B; lesson 07 refuses those with zero-bubble.

What to look for: the loss falls exactly as on one device, equal to 1F1B's; the measured bubble
sits next to the formula from the run's own mean F, B and W times and next to 1F1B's; the memory
table counts what waits in the W queues (which no saved-tensor hook sees), the first stage at
1F1B's peak. On a CPU where two ranks share cores the step gets no faster: an idle rank already
lends its core to the other one (benchmarks/zero_bubble.py measures it).
"""

from __future__ import annotations

import argparse
import copy
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from picotron_like import comm
from picotron_like.lessons import load_lesson
from picotron_like.metrics import ActivationMeter, CallObserver, MeteredRun, log0
from picotron_like.pipeline_tools import SendsInFlight, TimelineRecorder, bubble_fraction, gather_timelines
from picotron_like.topology import (ConfigError, GridShape, ProcessGrid, init_distributed, shutdown,
                                    validate_parallel_config)
from picotron_like.run_control import StepMeters, step_to_meter
from picotron_like.train import (RankBatches, StepSettings, add_parallel_flags, autocast_dtype, bucket_bytes_from_flags,
                                 build_optimizer, plan_run, train)

pipeline_parallel = load_lesson("03_pipeline_parallel")
Action = pipeline_parallel.Action


# ============================================================================ the technique: B and W, one backward in two
#
# A linear layer's backward, split (dW costs as many FLOPs as the layer's forward):
#
#     linear forward:   y  = x W^T                  keeps x
#     B (now):          dx = dy W                   keeps x and dy for W, sends dx upstream
#     W (when told):    dW = dy^T x                 accumulates into W.grad, frees x and dy
#
# How, and why this way: each linear layer's backward computes dx and hands (x, dy) to the chunk's
# PendingWeightGradients; W turns them into dW later. The alternative, splitting the autograd graph
# (autograd.grad for the input, then again for the weights), runs the part of backward that both
# need twice unless the graph is cut at every weight's consumer; the explicit layer does every
# backward operation exactly once (a test counts the FLOPs against 1F1B's). Everything else (norm
# gains, the embedding, the attention core) keeps its ordinary backward inside B.


class LinearDeferringWeightGradient(torch.autograd.Function):
    """y = x W^T + b whose backward is B alone: dx now, (x, dy) left in `pending` for W.

    The weight and bias come in inside a tuple, so autograd draws no edge to them: B must not touch
    them at all, because autograd would still run their post-accumulate hooks with no gradient, and
    the data-parallel wrappers would count them ready before W. Under autocast the matmul runs in
    the autocast dtype as F.linear's would, and x and W are kept in that dtype, so W computes dW
    from the very tensors the undivided backward would have used."""

    @staticmethod
    def forward(ctx, x, weight_and_bias: tuple, pending: "PendingWeightGradients"):
        weight, bias = weight_and_bias
        if torch.is_autocast_enabled(x.device.type):
            dtype = torch.get_autocast_dtype(x.device.type)
            x, weight_used = x.to(dtype), weight.to(dtype)
        else:
            weight_used = weight
        ctx.save_for_backward(x, weight_used)
        ctx.weight, ctx.bias, ctx.pending = weight, bias, pending
        return F.linear(x, weight_used, None if bias is None else bias.to(weight_used.dtype))

    @staticmethod
    def backward(ctx, grad_output):
        x, weight_used = ctx.saved_tensors
        ctx.pending.keep(WeightGradient(ctx.weight, ctx.bias, x, grad_output))
        return grad_output @ weight_used if ctx.needs_input_grad[0] else None, None, None


@dataclass(frozen=True)
class WeightGradient:
    """One linear layer's W for one micro-batch: what B left behind."""
    weight: nn.Parameter
    bias: nn.Parameter | None
    input: torch.Tensor
    grad_output: torch.Tensor

    def compute(self) -> list[tuple[nn.Parameter, torch.Tensor]]:
        grad_output = self.grad_output.flatten(0, -2)
        grads = [(self.weight, (grad_output.t() @ self.input.flatten(0, -2)).to(self.weight.dtype))]
        if self.bias is not None:
            grads.append((self.bias, grad_output.sum(0).to(self.bias.dtype)))
        return grads


class PendingWeightGradients:
    """A chunk's W queue: the micro-batches whose B has run and whose W has not."""

    def __init__(self):
        self.pending: dict[int, list[WeightGradient]] = {}
        self.collecting = None          # the micro-batch whose B is running

    @contextmanager
    def input_gradient(self, micro_batch: int):
        """B: while autograd runs the chunk's backward, its linears leave their W here."""
        self.pending[micro_batch], self.collecting = [], micro_batch
        try:
            yield
        finally:
            self.collecting = None

    def keep(self, weight_gradient: WeightGradient) -> None:
        if self.collecting is None:
            # A backward outside a zero-bubble B would drop these weights' gradients silently.
            raise RuntimeError("a linear layer deferring its weight gradient ran backward outside a zero-bubble B")
        self.pending[self.collecting].append(weight_gradient)

    def weight_gradients(self, micro_batch: int) -> None:
        """W: every deferred dW of the micro-batch, accumulated into .grad through autograd (one call),
        so that the data-parallel wrappers' post-accumulate hooks fire exactly as in a backward."""
        pairs = [pair for weight_gradient in self.pending.pop(micro_batch) for pair in weight_gradient.compute()]
        if pairs:
            params, grads = zip(*pairs)
            torch.autograd.backward(params, grads)


class DeferredWeightGradientLinear(nn.Linear):
    """nn.Linear whose weight gradient waits for W (defer_weight_gradients converts a stage's linears)."""

    def forward(self, x):
        return LinearDeferringWeightGradient.apply(x, (self.weight, self.bias), self.pending_weight_gradients)


DEFERRED_LINEARS = {nn.Linear: DeferredWeightGradientLinear}


def defer_weight_gradients(stage: nn.Module) -> PendingWeightGradients:
    """Make a stage's linear layers defer their weight gradients to one W queue, stage.pending_weight_gradients.

    Only the class changes (DEFERRED_LINEARS): the parameters, their names and the hooks on them stay."""
    pending = stage.pending_weight_gradients = PendingWeightGradients()
    for module in stage.modules():
        if type(module) in DEFERRED_LINEARS:
            module.__class__ = DEFERRED_LINEARS[type(module)]
            module.pending_weight_gradients = pending
    return pending


# ============================================================================ the technique: the ZB-H1 schedule


def zero_bubble_schedule(pp: int, pp_rank: int, n_micro: int, virtual_stages: int = 1) -> list[tuple[Action, ...]]:
    """ZB-H1: 1F1B's order with each backward split into B and W, and W moved into the bubble.

    Stage r warms up as in 1F1B; in the steady state each B is followed by the W of the micro-batch
    r places back (stage r holds back r W's: the last stage, which starts the backward chain, runs
    its B's p-1 W's ahead and so sends gradients upstream sooner); in the cool-down, where 1F1B's
    stages wait for gradients, each B is followed by one pending W and the rest close the step.
    A micro-batch stays alive from its F to its W, and stage r never has more than p alive:
    1F1B's first stage's peak. With m >= p and W no longer than F or B, the bubble is (p-1)(T_F + T_B - T_W)
    per stage, where 1F1B's is (p-1)(T_F + T_B + T_W).
    """
    warmup = min(pp - pp_rank - 1, n_micro)
    forwards = [Action("F", 0, i) for i in range(n_micro)]
    input_grads = [Action("B", 0, i) for i in range(n_micro)]
    weight_grads = iter([Action("W", 0, i) for i in range(n_micro)])
    # warm-up: 1F1B's, p-1-r forwards
    units = [(forward,) for forward in forwards[:warmup]]
    # steady state: F, B, and from the (r+1)-th pair on, the W of the micro-batch r places back
    for i, (forward, input_grad) in enumerate(zip(forwards[warmup:], input_grads)):
        units += [(forward,), (input_grad,)]
        if i >= pp_rank:
            units.append((next(weight_grads),))
    # cool-down: each B, then one pending W while the next gradient travels; the rest at the end
    for input_grad in input_grads[n_micro - warmup:]:
        units += [(input_grad,), (next(weight_grads),)]
    return units + [(weight_grad,) for weight_grad in weight_grads]


SCHEDULES = {**pipeline_parallel.SCHEDULES, "zero-bubble": zero_bubble_schedule}


def communication_program(units, pp: int, pp_rank: int, virtual_stages: int = 1) -> list:
    """Lesson 03's communication program with one more rule, for W: a W talks to nobody, so the
    sends of the B before it are posted before it (a SendsInFlight batch) and travel while it
    computes, instead of waiting on the critical path; the next batch waits for them too.
    Without W's it is lesson 03's program."""
    n_stages = pp * virtual_stages
    program, sends, sends_in_flight = [], (), False
    for unit in units:
        if unit[0].kind == "W":
            if sends:
                program.append(SendsInFlight(sends))
                sends, sends_in_flight = (), True
            program.extend(unit)
            continue
        transfers = [pipeline_parallel.action_transfers(action, pp, pp_rank, n_stages) for action in unit]
        receives = tuple(transfer for needs, _ in transfers for transfer in needs)
        if sends or receives:
            program.append(sends + receives)
            sends_in_flight = False
        program.extend(unit)
        sends = tuple(transfer for _, makes in transfers for transfer in makes)
    if sends or sends_in_flight:
        program.append(sends)
    return program


def pipeline_programs(schedule: str, pp: int, n_micro: int, virtual_stages: int = 1) -> list[list]:
    """Every rank's communication program for any of SCHEDULES, for the simulator."""
    return [communication_program(SCHEDULES[schedule](pp, rank, n_micro, virtual_stages), pp, rank, virtual_stages)
            for rank in range(pp)]


class ZeroBubblePipeline(pipeline_parallel.Pipeline):
    """Lesson 03's Pipeline that also runs W: every B inside its chunk's W queue, every W from it.

    Each chunk's nn.Linear layers are converted here to defer their weight gradients
    (defer_weight_gradients), each chunk with a W queue of its own. ZB-H1 is 1F1B's order with each
    backward split: its forwards, without B's and W's, are 1F1B's forward-only program (for
    validation), and its program is lesson 03's with one more rule for W. The data-parallel switch
    is on for each chunk's last B (lesson 03's rule) and its last W: the norms' and embedding's
    gradients are complete after the one, the linears' after the other. The sends before a W
    travel while it computes (communication_program)."""

    def __init__(self, chunks, grid, schedule: str, n_micro: int, virtual_stages: int, *args, **kwargs):
        for chunk in chunks:
            defer_weight_gradients(chunk.module)
        super().__init__(chunks, grid, schedule, n_micro, virtual_stages, *args, **kwargs)
        self.pending_weight_gradients = [chunk.module.pending_weight_gradients for chunk in chunks]

    def build_programs(self, n_micro: int) -> None:
        super().build_programs(n_micro)
        self.last_weight_gradients = {step.chunk: step for step in self.program
                                      if isinstance(step, Action) and step.kind == "W"}

    def schedule_units(self, n_micro: int) -> list[tuple[Action, ...]]:
        return SCHEDULES[self.schedule](self.pp, self.pp_rank, n_micro, self.virtual_stages)

    def communication_program(self, units) -> list:
        return communication_program(units, self.pp, self.pp_rank, self.virtual_stages)

    def backward_step(self, action, is_chunks_last: bool, inputs, outputs, grads) -> None:
        pending = self.pending_weight_gradients[action.chunk]
        if action.kind == "W":      # the weight gradients the micro-batch's B left in the queue
            self.chunks[action.chunk].require_backward_grad_sync = action == self.last_weight_gradients[action.chunk]
            pending.weight_gradients(action.micro_batch)
            return
        with pending.input_gradient(action.micro_batch):
            super().backward_step(action, is_chunks_last, inputs, outputs, grads)

    def exchange(self, transfers, inputs, outputs, grads) -> None:
        """With lesson 03's async_sends every send stays in flight until the end of the step, these
        too; without, a SendsInFlight batch's sends stay in flight until the next batch, which
        waits for them with its own."""
        if self.async_sends:
            return super().exchange(transfers, inputs, outputs, grads)
        works, _ = self.post(transfers, inputs, outputs, grads)
        if isinstance(transfers, SendsInFlight):
            self.sends_in_flight += works
            return
        for work in self.sends_in_flight + works:
            work.wait()
        self.sends_in_flight = []


# ============================================================================ configuration rules


def validate_pipeline_config(grid: GridShape, world_size: int, cfg, schedule: str, virtual_stages: int,
                             n_micro: int, n_micro_source: str = "--micro-batches") -> None:
    """Lesson 03's rules for any of SCHEDULES, zero-bubble's program (W's included) simulated."""
    if schedule != "zero-bubble":
        pipeline_parallel.validate_pipeline_config(grid, world_size, cfg, schedule, virtual_stages, n_micro,
                                                   n_micro_source)
        return
    validate_parallel_config(grid, world_size)
    problems = pipeline_parallel.pipeline_problems(grid, cfg, schedule, virtual_stages, n_micro, n_micro_source)
    if problems:
        raise ConfigError("bad pipeline configuration:\n  - " + "\n  - ".join(problems))
    pipeline_parallel.refuse_deadlock(pipeline_programs(schedule, grid.pp, n_micro, virtual_stages), schedule,
                                      grid.pp, n_micro, virtual_stages)


def validate(cfg, grid: GridShape, shape, args, world_size: int) -> None:
    """plan_run's hook: lesson 03's rules, for the schedule and micro-batch count that will run."""
    validate_pipeline_config(grid, world_size, cfg, args.schedule, args.virtual_stages, shape.grad_accum,
                             pipeline_parallel.micro_batch_source(args, shape, grid))


# ============================================================================ measuring the three challenges


def zero_bubble_formula(pp: int, n_micro: int, forward_time: float, input_grad_time: float,
                        weight_time: float) -> float:
    """ZB-H1's idle / busy per stage, from the times of F, B and W: each of the p-1 steps of the
    fill and drain costs T_F + T_B - T_W, where 1F1B's costs T_F + T_B + T_W (its whole backward).
    Exact on the simulator's clock for m >= p when W is no longer than F or B (every W fits a gap)."""
    step = forward_time + input_grad_time + weight_time
    return (pp - 1) * (forward_time + input_grad_time - weight_time) / (n_micro * step)


class KeptActivationMeter(ActivationMeter):
    """The activations a rank keeps between its actions, zero-bubble's W queues included.

    An ActivationMeter sees what autograd saves. Once B has run, autograd has let go of each
    linear's input, but the W queue still holds it, and the output gradient beside it, until W:
    memory no saved-tensor hook sees. This meter also reads the queues as every forward, B and W
    returns (reported by Python's profiler hook, CallObserver), counts each storage once with the
    saved ones, and keeps the peak of the sum as the meter's peak_bytes (what lesson 03's report
    prints); peak_saved_bytes is the saved tensors' alone, what a plain ActivationMeter reads."""

    def __init__(self, pipeline: ZeroBubblePipeline):
        super().__init__(*pipeline.chunks)
        self.pipeline, self.peak_saved_bytes = pipeline, 0
        self._actions = CallObserver((type(pipeline).forward_step, type(pipeline).backward_step),
                                     on_return=self._after_action)

    def pack(self, tensor):
        holder = super().pack(tensor)
        self.peak_saved_bytes = max(self.peak_saved_bytes, self.live_bytes)
        return holder

    def kept_bytes(self) -> int:
        queued = {}
        for pending in self.pipeline.pending_weight_gradients:
            for weight_gradient in (wg for waiting in pending.pending.values() for wg in waiting):
                for storage in (weight_gradient.input.untyped_storage(), weight_gradient.grad_output.untyped_storage()):
                    queued[storage.data_ptr()] = storage.nbytes()
        return self.live_bytes + sum(nbytes for address, nbytes in queued.items() if address not in self._live)

    def _after_action(self, frame) -> None:
        if frame.f_locals.get("self") is self.pipeline:
            self.peak_bytes = max(self.peak_bytes, self.kept_bytes())

    def __enter__(self):
        self._actions.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        super().__exit__(*exc)
        return self._actions.__exit__(*exc)


def log_zero_bubble_formula(timelines, pp: int, n_micro: int) -> None:
    """The measured bubble next to ZB-H1's formula from this run's own mean F, B and W times, and next
    to what 1F1B's formula gives for the same times (its backward is B + W): this file's report
    prints it where lesson 03's prints its own bubble line."""
    def mean_ms(kind):
        durations = [end - start for events in timelines for action, start, end in events if action.kind == kind]
        return sum(durations) / len(durations) * 1e3

    t_f, t_b, t_w = mean_ms("F"), mean_ms("B"), mean_ms("W")
    log0(f"mean ms: F {t_f:.2f}, B {t_b:.2f}, W {t_w:.2f}")
    log0(f"bubble (idle / busy): measured {bubble_fraction(timelines):.3f}   formula (p-1)(T_F+T_B-T_W)/(m(T_F+T_B+T_W)) "
         f"= {zero_bubble_formula(pp, n_micro, t_f, t_b, t_w):.3f}   1F1B's (p-1)/m = {(pp - 1) / n_micro:.3f}   "
         f"(exact when m >= p, W is no longer than F or B, and every stage has a core of its own)")
    log0("(in the table below, measured counts the inputs and output gradients waiting for W; predicted counts "
         "each micro-batch whole from its F to its W, more than W keeps)")


# ============================================================================ main


def add_schedule_flags(parser, names=tuple(SCHEDULES), default: str = "1f1b") -> None:
    """Lesson 03's --schedule with zero-bubble among its choices, and its --virtual-stages."""
    parser.add_argument("--schedule", choices=names, default=default,
                        help=pipeline_parallel.SCHEDULE_HELP + "; zero-bubble (03_zero_bubble.py), 1f1b with each "
                             "backward split into input and weight gradients, the latter moved into the bubble (ZB-H1)")
    pipeline_parallel.add_virtual_stages_flag(parser)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description="Lesson 03, continued: zero-bubble pipeline parallelism (run with "
                                                 "torchrun).", formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_parallel_flags(parser, axes=("dp", "pp"), fill_axis="pp")
    add_schedule_flags(parser, ("zero-bubble",), "zero-bubble")
    pipeline_parallel.add_async_sends_flag(parser)
    pipeline_parallel.add_micro_batch_flags(parser)
    return pipeline_parallel.resolve_virtual_stages(parser.parse_args(argv))


def report(run: MeteredRun, pipeline: ZeroBubblePipeline, plan, args, grid, timeline: TimelineRecorder) -> None:
    """Lesson 03's report with this schedule's bubble line."""
    pp, m, v = grid.pp_size, plan.shape.grad_accum, pipeline.virtual_stages
    training_traffic = copy.deepcopy(comm.meter)        # before the report's own gathers add to it
    stages = pipeline_parallel.gather_stage_rows(run, pipeline, plan, grid)
    timelines = gather_timelines(timeline.events, grid.pp_group)
    pipeline_parallel.log_timeline(timelines, args, pp, m, v)
    log_zero_bubble_formula(timelines, pp, m)
    pipeline_parallel.log_stages(run, pipeline, plan, stages, training_traffic)


def main(argv=None):
    """Lesson 03's run (dp x pp) with --schedule zero-bubble: its stages, step and report, this file's
    Pipeline, W and measures."""
    args = parse_args(argv)
    plan = plan_run(args, validate)
    device = init_distributed()
    grid = ProcessGrid(plan.grid)
    cfg, shape = plan.cfg, plan.shape
    chunks = pipeline_parallel.build_model_chunks(cfg, args.seed, grid, device, args.virtual_stages,
                                                  bucket_bytes_from_flags(args, device))
    modules = nn.ModuleList(chunk.module for chunk in chunks)      # what the rank holds, unwrapped
    compute_dtype = autocast_dtype(args.dtype, device)
    pipeline = ZeroBubblePipeline(chunks, grid, args.schedule, shape.grad_accum, args.virtual_stages,
                                  pipeline_parallel.activation_shape(cfg, shape), device, compute_dtype,
                                  args.async_pp_sends)
    optimizer = build_optimizer(modules, args.lr)
    settings = StepSettings(device, compute_dtype, args.max_grad_norm, tail=args.step_tail)
    pipeline_parallel.log_header(args, plan, grid)

    activations, timeline = KeptActivationMeter(pipeline), TimelineRecorder(pipeline, grid.pp_group, device)
    batches = RankBatches(plan.batches, grid.dp_rank, device, val=plan.val_batches)    # this rank's share
    throughput = train(args, optimizer, partial(pipeline_parallel.train_step, pipeline, optimizer, settings=settings),
                       batches, evaluate=partial(pipeline_parallel.evaluate, pipeline, settings=settings),
                       meters=StepMeters((activations, timeline), step=step_to_meter(args)), cfg=cfg)
    report(MeteredRun(modules, optimizer, activations, throughput, cfg, shape.seq_len, grid.shape.world_size,
                      device, throughput.steps), pipeline, plan, args, grid, timeline)
    shutdown()


if __name__ == "__main__":
    main()
