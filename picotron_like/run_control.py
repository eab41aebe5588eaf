"""
Run control: what a real run adds around the loop, each a small object that train() calls at one
named place, so that the loop itself reads as nanoGPT's and picotron's.

- LaggedStepLog: one line per step, printed a step late so that the host never waits for the
  device (StepFigures copies a step's figures to the host without waiting; LoggedStep is what is
  known of a step until then), with its memory, MFU, the --metrics file (MetricsFile) and
  the throughput; log_step is the line itself;
- StepMeters: the lesson's meters, entered around one step;
- RunControl: whether the run ends after this step: an agreed stop on a scheduler's signal
  (AgreedStop), a lost peer (PeerLost), the --max-minutes budget (TimeBudget, which also places
  wsd's decay: lr_schedule.place_decay; follow_time_budget for a resumed run, step_to_meter for a
  lesson that meters a late step);
- AfterStep: work after some steps (checkpoints, samples); step_profiler: --profile's trace;
  seconds_since_process_start: the clock a time budget and the first step's line count by.
"""

from __future__ import annotations

import json
import math
import os
import signal
import sys
import time
from collections.abc import Callable
from contextlib import ExitStack, contextmanager, nullcontext
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity

from picotron_like import comm
from picotron_like.data import TokenBatches
from picotron_like.lr_schedule import first_decaying_step, place_decay
from picotron_like.metrics import StepMemory, Throughput, is_rank0, log0, model_flops_utilisation, peak_flops
from picotron_like.model import GPTConfig, flops_per_token


# ----------------------------------------------------------------------------- the step's line, a step late


class LaggedStepLog:
    """Step N's line is printed once step N+1 is queued: the host reads step N's figures while the
    device computes step N+1, so it never waits for one step to end before queueing the next.
    (Printing each line at its step's end would make the host wait for the device every step: the
    device then idles while the host queues the next step's kernels.) Lines the loop prints in
    between (say) wait behind the pending line, and flush() prints it at once where what follows
    needs it (a checkpoint, the end): the output reads as if each line came at its step's end, the
    same lines in the same order.

    It keeps what a line needs: the step's clock and figures (StepFigures), this rank's memory
    (StepMemory), the MFU given the model's `cfg` on a GPU of known peak (or --peak-tflops), and
    the note when a step starts a new pass over `data`. The --metrics file's record is written
    with the line (appended to from `start_step` on, in a resumed run); Throughput and the count of
    skipped steps are kept there too, since they need the step's seconds and flag. Leaving the
    block (an error included) prints what is pending and closes the metrics file."""

    def __init__(self, args, data: TokenBatches, device: torch.device, cfg: GPTConfig | None = None,
                 start_step: int = 0):
        self.data, self.device = data, device
        self.tokens_trained = 0         # by the steps of this process (a ramp's steps differ in size)
        self.throughput = Throughput()
        self.throughput.peak_flops = peak_flops(device, getattr(args, "peak_tflops", None))
        self.model_flops = flops_per_token(cfg, data.shape.seq_len) if cfg is not None else None
        self.n_ranks = dist.get_world_size() if dist.is_initialized() else 1
        self.metrics = MetricsFile(getattr(args, "metrics", None), append=start_step > 0)
        self.memory = StepMemory(device)
        self.first_step, self.data_pass, self.steps = start_step, data.epoch_at(start_step), 0
        self.final_val_loss: float | None = None
        self.pending: LoggedStep | None = None
        self.notes: list[str] = []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.flush()
        self.metrics.close()
        return False

    def start(self, step: int, lr: float) -> None:
        """A step's work is about to be queued: start its clock and memory counters."""
        if self.data.epoch_at(step) > self.data_pass:
            self.data_pass = self.data.epoch_at(step)
            self.say(f"note: step {step} starts pass {self.data_pass + 1} over the data ({self.data.n_tokens:,} "
                     f"tokens): every window again, in a new order")
        self.memory.start_step()
        started_s = seconds_since_process_start() if step == self.first_step else None
        self.current = (step, lr, started_s, StepFigures(self.device))
        self.steps += 1
        self.tokens_trained += self.data.step_tokens(step)

    def queued(self, values: dict, metered: bool) -> None:
        """The step's work is queued: its `values` (a StepResult's) start for the host, and the
        step before's line is printed."""
        step, lr, started_s, figures = self.current
        figures.copy(values)
        logged = LoggedStep(step, lr, figures, self.memory.read(), metered, self.data.step_tokens(step), started_s)
        self.flush()
        self.pending = logged

    def validated(self, val_loss: float) -> None:
        """The validation after the pending step: in its record, and on a line after its line."""
        self.pending.val_loss = self.final_val_loss = val_loss
        self.say(f"step {self.pending.step:>4} | val loss {val_loss:.4f}")

    def say(self, message: str) -> None:
        """Print a line after the pending step's line."""
        if self.pending is None:
            log0(message)
        else:
            self.notes.append(message)

    def flush(self) -> None:
        """Print the pending step's line (waiting for its figures) and what was said after it."""
        if self.pending is not None:
            self._print(self.pending)
            self.pending = None
        for note in self.notes:
            log0(note)
        self.notes.clear()

    def _print(self, logged: LoggedStep) -> None:
        values, seconds = logged.figures.read()
        skipped = bool(values.pop("skipped"))
        loss, grad_norm = values.pop("loss"), values.pop("grad_norm")
        tokens = logged.tokens
        self.throughput.record(tokens, seconds, logged.metered)
        self.throughput.skipped_steps += skipped
        mfu = (model_flops_utilisation(tokens / seconds, self.n_ranks, self.model_flops,
                                       self.throughput.peak_flops)
               if self.model_flops is not None and self.throughput.peak_flops else None)
        log_step(logged.step, {"loss": loss, "grad_norm": grad_norm, **values}, tokens, seconds, logged.lr,
                 skipped, mfu, logged.memory)
        if logged.started_s is not None:
            log0(f"time to the first step: {logged.started_s + seconds:.1f} s since this process started "
                 f"(imports, start-up, building and sharding the model, this step)")
        self.metrics.write({"step": logged.step, "loss": loss, "grad_norm": grad_norm, "lr": logged.lr,
                            "tokens_per_s": tokens / seconds, "seconds": seconds, "skipped": skipped,
                            **({"mfu": mfu} if mfu is not None else {}), **logged.memory, **values,
                            **({"val_loss": logged.val_loss} if logged.val_loss is not None else {})})


@dataclass
class LoggedStep:
    """What the loop knows of a step when its work is queued; its figures reach the host later."""

    step: int
    lr: float
    figures: StepFigures
    memory: dict                        # StepMemory's reading (the allocator's counters are the host's own)
    metered: bool                       # the meters watched it (Throughput keeps it apart)
    tokens: int                         # its global batch's (a batch-size ramp's steps differ)
    started_s: float | None = None      # the run's first step: seconds since the process started, at its start
    val_loss: float | None = None       # the validation after it, if one ran


class StepFigures:
    """One step's figures on their way to the host, and the step's duration, without making the
    host wait for the device: on a GPU, two timing events around the step's work and a copy of its
    values into page-locked memory are queued behind it, and read() waits for them only when
    called, a step later, while the device computes the next step. On a CPU the work is done when
    the step returns: the values are at hand and the host clock times the step."""

    def __init__(self, device: torch.device):
        """Start the step's clock (before its first operation is queued)."""
        self.device, self.on_gpu = device, device.type == "cuda"
        if self.on_gpu:
            self.started, self.finished = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            self.started.record()
        else:
            self.started = time.perf_counter()

    def copy(self, values: dict) -> None:
        """Stop the clock and start copying `values` (tensors, numbers) to the host."""
        if self.on_gpu:
            self.finished.record()
        else:
            self.seconds = time.perf_counter() - self.started
        self.names = list(values)
        self.numbers = {name: float(value) for name, value in values.items() if not isinstance(value, torch.Tensor)}
        tensors = [value for value in values.values() if isinstance(value, torch.Tensor)]
        # float64 holds every float32 and bfloat16 value and every Python float exactly
        stacked = (torch.stack([t.detach().reshape(()).to(self.device, torch.float64) for t in tensors]) if tensors
                   else torch.zeros(0, dtype=torch.float64))
        if self.on_gpu:
            self.host = torch.empty(len(tensors), dtype=torch.float64, pin_memory=True)
            self.host.copy_(stacked, non_blocking=True)
            self.copied = torch.cuda.Event()
            self.copied.record()
        else:
            self.host = stacked

    def read(self) -> tuple[dict[str, float], float]:
        """The values, in the order given, and the step's seconds: a wait, on a GPU, for the step's end."""
        if self.on_gpu:
            self.copied.synchronize()
            self.seconds = self.started.elapsed_time(self.finished) / 1e3
        copied = iter(self.host.tolist())
        return {name: self.numbers[name] if name in self.numbers else next(copied) for name in self.names}, self.seconds


# How each StepMemory reading is named in the step line: what it measures, not just "memory".
_MEMORY_LABELS = {"max_memory_allocated_bytes": "peak mem", "max_memory_reserved_bytes": "reserved",
                  "max_rss_bytes": "max rss"}


def log_step(step: int, figures: dict[str, float], tokens: int, seconds: float, lr: float | None = None,
             skipped: bool = False, mfu: float | None = None, memory: dict | None = None) -> None:
    """One step's line: `figures` holds its loss, its gradient norm and the values a lesson adds."""
    figures = dict(figures)
    loss, grad_norm = figures.pop("loss"), figures.pop("grad_norm")
    extra = "".join(f"{name} {value:.4g} | " for name, value in figures.items())
    lr_part = f"lr {lr:.2e} | " if lr is not None else ""
    skip_part = "skipped: non-finite grad norm | " if skipped else ""
    mfu_part = f" | MFU {100 * mfu:4.1f} %" if mfu is not None else ""
    memory_part = "".join(f" | {_MEMORY_LABELS[key]} {value / 1e9:.2f} GB" for key, value in (memory or {}).items())
    log0(f"step {step:>4} | loss {loss:.4f} | grad norm {grad_norm:7.3f} | {skip_part}{lr_part}"
         f"{extra}{tokens / seconds:>9.0f} tok/s | {seconds * 1e3:>7.1f} ms{mfu_part}{memory_part}")


def _json_number(value):
    """JSON has no NaN or infinity: a non-finite float is written as null."""
    return value if not isinstance(value, float) or math.isfinite(value) else None


class MetricsFile:
    """One JSON object per line and step, written by rank 0 only (every rank holds the same values).
    A resumed run appends; a run killed while writing a line left half of one, so the resumed run
    starts on a new line; its records of the steps after its checkpoint follow the old ones, and
    readers keep a step's last record (picotron_like.plot)."""

    def __init__(self, path, append: bool = False):
        self.file = open(path, "a" if append else "w", encoding="utf-8") if path is not None and is_rank0() else None
        if self.file is not None and self.file.tell() > 0:
            with open(path, "rb") as written:
                written.seek(-1, os.SEEK_END)
                if written.read(1) != b"\n":
                    self.file.write("\n")

    def write(self, record: dict) -> None:
        if self.file is not None:
            self.file.write(json.dumps({key: _json_number(value) for key, value in record.items()}) + "\n")
            self.file.flush()

    def close(self) -> None:
        if self.file is not None:
            self.file.close()


# ----------------------------------------------------------------------------- the meters of one step


@dataclass(frozen=True)
class StepMeters:
    """Meters (context managers: activation meters, timeline recorders) entered around one step
    only, `step`: they observe the technique from outside and cost nothing on other steps."""

    meters: tuple = ()
    step: int = 0

    def watch(self, step: int) -> bool:
        return bool(self.meters) and step == self.step

    @contextmanager
    def watching(self, step: int):
        with ExitStack() as watched:
            for meter in self.meters if self.watch(step) else ():
                watched.enter_context(meter)
            yield


# ----------------------------------------------------------------------------- where the run ends


class RunControl:
    """Whether the run ends after this step, asked once after each: every rank agrees on a
    scheduler's signal (AgreedStop), leaves at once when a peer is lost (PeerLost), and, with
    --max-minutes, keeps to the time budget (TimeBudget: it sets args.steps once, early, then asks
    for a stop if the end no longer fits). Under --lr-schedule wsd the budget also forecasts, each
    step, how many steps still fit; when the ranks agree that fewer do than planned, the run ends
    sooner and its decay moves with the end (place_decay): a wsd run never ends undecayed. (Cosine
    keeps its plan and may stop early: 94 % of the way through, its rate has fallen 99 % of the
    way to the minimum, WSD's with a 0.2 share only 84 %.) `timing(work)` times a validation or a
    checkpoint, the work the budget must keep room for at the end."""

    def __init__(self, args, clock: Callable[[], float], val_batches: int, data: TokenBatches):
        self.args, self.stop, self.data = args, AgreedStop(), data
        self.budget = (TimeBudget(args.max_minutes, clock, val_batches,
                                  planned=getattr(args, "planned_steps", None) is not None, data=data)
                       if getattr(args, "max_minutes", None) is not None else None)
        self.decays_early = getattr(args, "lr_schedule", "cosine") == "wsd"
        self.checkpoint_s = 0.0

    def __enter__(self):
        self.stop.__enter__()
        return self

    def __exit__(self, *exc):
        return self.stop.__exit__(*exc)

    def after_step(self, step: int, log: "LaggedStepLog") -> bool:
        """Whether every rank stops after this step (a signal, the budget); the budget's estimate
        is said on `log` when it is made."""
        args, budget = self.args, self.budget
        self.checkpoint_s = 0.0
        if budget is not None:
            budget.note_step(step)
            if budget.estimate_due():
                place_decay(args, step + 1, budget.planned_steps(step + 1, args.steps), self.data.tokens_before)
                full = " of the full batch" if self.data.ramp is not None else ""
                log.say(f"time budget: {args.steps} steps fit in {args.max_minutes:g} minutes "
                        f"({budget.slowest_step_s():.2f} s a step{full}, {budget.end_s():.1f} s kept for the end); "
                        f"the learning rate decays {self._decay_in_words()}")
            elif budget.spent():
                self.stop.request_stop()
            elif self.decays_early and budget.forecasts():
                self.stop.propose_steps(budget.steps_that_fit(step + 1))
        try:
            stopping = self.stop.after_step()
        except PeerLost as error:
            # This step's line is not printed: under NCCL its work may wait for the lost rank forever.
            print(f"error: rank {dist.get_rank()}: {error}", file=sys.stderr, flush=True)
            sys.stdout.flush()
            os._exit(1)     # no shutdown(): its barrier would wait for the lost rank
        if self.stop.agreed_steps < args.steps and not stopping:
            self._end_sooner(step, log)
        return stopping

    def _end_sooner(self, step: int, log: "LaggedStepLog") -> None:
        """Every rank's forecast, agreed one step late (AgreedStop), says fewer steps fit than
        planned: the run ends sooner, at least one step after this one (the end's margin of two
        steps covers the step the agreement lagged), its decay reaching the minimum there."""
        steps = max(int(self.stop.agreed_steps), step + 2)
        if steps < self.args.steps:
            planned = self.args.steps
            place_decay(self.args, step + 1, steps, self.data.tokens_before)
            log.say(f"time budget: the steps slowed down: {steps} steps fit, not {planned}; the learning rate "
                    f"decays {self._decay_in_words()}")

    def _decay_in_words(self) -> str:
        last = self.args.steps - 1
        if not self.decays_early:
            return f"to step {last}"
        return f"from step {first_decaying_step(self.args, self.data.tokens_before)} to step {last}"

    @property
    def signalled(self) -> bool:
        """Whether the ranks agreed on a scheduler's signal (its grace period is short)."""
        return self.stop.agreed_signal.startswith("SIG")

    @contextmanager
    def timing(self, work: str):
        started = time.perf_counter()
        with self.budget.timing(work) if self.budget is not None else nullcontext():
            yield
        if work == "checkpoint":
            self.checkpoint_s = time.perf_counter() - started

    def stopped(self, step: int, saves: bool) -> None:
        log0(f"stopped after step {step}: {self.stop.agreed_signal} ({self.args.steps - step - 1} steps left)"
             + (f"; the checkpoint took {self.checkpoint_s:.1f} s: continue with --resume" if saves else ""))

    def summary(self, log: "LaggedStepLog") -> None:
        """The time budget's last line: what fitted in it."""
        if self.budget is not None:
            log0(f"time budget: {log.steps} steps, {log.tokens_trained:,} tokens in "
                 f"{self.budget.clock():.1f} s of {self.budget.budget_s:.0f} s"
                 + (f"; final val loss {log.final_val_loss:.4f}" if log.final_val_loss is not None else ""))


class PeerLost(RuntimeError):
    """A rank died: the run stops at once, without a checkpoint (nothing could agree on one)."""


class AgreedStop:
    """Stop every rank after the same step when any of them is told to stop, without making a
    step wait for the others to agree.

    Schedulers warn a job before they end it: SLURM sends SIGTERM (and with --signal=USR1@120,
    SIGUSR1 two minutes before), Kubernetes SIGTERM, torchrun passes its own SIGTERM on to its
    ranks. The signal reaches the ranks at different moments, maybe in different steps, so a rank
    cannot stop when it sees it: the others would wait for it in their next collective. Instead a
    handler only notes it, and the ranks agree: after each step, each starts an all-reduce (MAX) of
    its note, a CPU tensor over gloo, asynchronously, and reads the result one step later, when it
    has long arrived. All ranks read the same result at the same step, so they all stop after the
    step in which it arrives: one step after the signal, the price of never holding a step up for
    the agreement (a scheduler's grace period must cover one step and a checkpoint).

    A dead peer is not waited for either: torchrun sends SIGTERM to the ranks left when one dies,
    and their agreeing all-reduce then fails at once (gloo sees the peer's connection closed), which
    raises PeerLost instead of a checkpoint that could never complete.

    A rank's TimeBudget asks for a stop the same way (request_stop), with a code below every
    signal's number: the MAX of the notes names a signal when there was one, and a signal's stop
    skips the final validation that a budget's stop runs (a grace period is short).
    """

    SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
    TIME_BUDGET = 0.5                           # a note below every signal number (they start at 1)

    def __init__(self):
        self.note = 0.0                         # a signal's number, TIME_BUDGET, or 0: nothing noted
        self.agreed_signal = ""                 # once agreed: the signal's name, or "the time budget"
        self.steps_that_fit = math.inf          # this rank's time budget's forecast (propose_steps)
        self.agreed_steps = math.inf            # the fewest steps any rank's forecast allowed, agreed
        self._agreeing = None                   # (flag tensor, work) started after the previous step

    def __enter__(self):
        self._previous = {number: signal.signal(number, self._note) for number in self.SIGNALS}
        return self

    def __exit__(self, *exc):
        if self._agreeing is not None and exc[0] is None:
            self._wait()                        # leave no collective in flight behind the loop
        for number, handler in self._previous.items():
            signal.signal(number, handler)
        return False

    def _note(self, number, frame) -> None:
        self.note = max(self.note, number)

    def request_stop(self) -> None:
        """This rank's time budget is spent: stop every rank after the same step (a signal outranks it)."""
        self.note = max(self.note, self.TIME_BUDGET)

    def propose_steps(self, steps: int) -> None:
        """This rank's time budget foresees that the run fits in `steps` steps: every rank reads
        the fewest any rank proposed (agreed_steps) at the same step, one step later."""
        self.steps_that_fit = steps

    def _wait(self) -> bool:
        flag, work = self._agreeing
        self._agreeing = None
        if work is not None:
            try:
                work.wait()
            except RuntimeError as error:
                raise PeerLost(f"a peer is gone ({str(error).splitlines()[0]}): stopping without a checkpoint; "
                               f"resume from the last one") from None
        agreed, fewest_negated = flag.tolist()
        self.agreed_steps = -fewest_negated
        if agreed:
            self.agreed_signal = "the time budget" if agreed == self.TIME_BUDGET else signal.Signals(int(agreed)).name
        return bool(agreed)

    def after_step(self) -> bool:
        """Whether every rank stops after this step: some rank was signalled before the previous
        step ended. Starts the agreement that the next step's call reads."""
        stop = self._wait() if self._agreeing is not None else False
        # One all-reduce agrees on both: the MAX of the notes, and the MAX of the negated forecasts,
        # which is the fewest steps (float64: a step count above 2**24 stays exact).
        flag = torch.tensor([self.note, -self.steps_that_fit], dtype=torch.float64)
        work = comm.bookkeeping(dist.all_reduce, flag, op=dist.ReduceOp.MAX, async_op=True) \
            if dist.is_initialized() else None
        self._agreeing = (flag, work)
        return stop


class TimeBudget:
    """--max-minutes M: the run ends inside M minutes from its process's start, with its final
    validation and checkpoint written, and the learning rate decays to the step where it ends.

    The schedule needs that step before the decay starts, so it is estimated once, early: after
    this process's first ESTIMATE_AFTER steps, rank 0 takes the slowest of them but the first
    (which carries one-off costs: allocations, compiling, the first collective of each group), and
    fits as many such steps as the time left allows after what the end costs: the final
    validation (as long as --val-batches steps until one has been timed: a validation batch is one
    global batch's forward, a fraction of a step), a checkpoint (as long as the slowest written so
    far) and two steps of margin (a stop agreed now takes effect one step later: AgreedStop).
    Rank 0's number is broadcast, so every rank sets the same args.steps, and a checkpoint stores
    it: a resumed run follows the same schedule (follow_time_budget) instead of estimating anew.

    An estimate can be wrong: steps slow down, the first checkpoint takes longer than nothing. So
    after it every rank checks each step whether two more steps and the end still fit, and if not
    asks AgreedStop to stop every rank after the same step: the budget holds, and the run ends
    before the schedule's last step (its final learning rate not yet at the minimum; it says so).
    Under wsd it also forecasts, each step, how many steps still fit (steps_that_fit), so that the
    run can end sooner with its decay finished, before such a stop is needed (RunControl). That
    forecast prices the steps still to come at the pace of the last PACE_STEPS (their mean, once
    that many are measured), not at the slowest step so far: the slowest only grows, so one stall
    (a checkpoint's flush, a busy neighbour) would cut the plan for good, and on a shared machine a
    run lost a fifth of its minutes that way (benchmarks/time_budget_recipes.py); the end's margin
    of two steps stays at the slowest, and spent() still stops a run the pace misjudged.
    `clock()` gives the seconds since the process started; tests pass their own.

    Under a batch-size ramp (`data`'s BatchRamp) the first steps are smaller than the rest, and
    time per token measured on them overstates a full step's (a step's fixed costs, the optimizer,
    the gradient reduction and a pipeline's fill and drain, are shared by fewer tokens). So a step
    is modelled as fixed seconds plus seconds per micro-batch (seconds_per_micro_batch: fitted to
    the steps measured); each measured step, moved to another count by that slope, gives a step of
    that count, and the slowest of them counts (step_seconds): for the full batch, for the end's
    margin, and for each of the ramp's steps still to come. Without a ramp every count is the full
    one and that is the slowest step measured, as above.
    """

    ESTIMATE_AFTER = 3
    PACE_STEPS = 10

    def __init__(self, minutes: float, clock: Callable[[], float], val_batches: int = 0, planned: bool = False,
                 data: TokenBatches | None = None):
        self.budget_s, self.clock = 60.0 * minutes, clock
        self.validation_s = None        # the slowest final validation's measured seconds (None: not yet run)
        self.val_batches = val_batches  # 0: the run does not validate
        self.save_s = 0.0               # the slowest checkpoint's measured seconds
        self.step_s: list[float] = []   # this process's step times, by the clock
        self.step_micro_batches: list[int] = []     # and each step's micro-batches per rank
        self.data = data                # the steps' sizes (None: every step the same)
        self.full_micro_batches = 1 if data is None else data.shape.grad_accum
        self.planned = planned          # the estimate is made (or a resumed run follows its checkpoint's)
        self.last_mark = clock()

    def note_step(self, step: int) -> None:
        now = self.clock()
        self.step_s.append(now - self.last_mark)
        self.step_micro_batches.append(self.micro_batches(step))
        self.last_mark = now

    def micro_batches(self, step: int) -> int:
        return 1 if self.data is None else self.data.grad_accum_at(step)

    def _measured(self) -> list[tuple[int, float]]:
        """(micro-batches, seconds) of this process's steps but the first (one-off costs), or the first alone."""
        measured = list(zip(self.step_micro_batches, self.step_s))
        return measured[1:] or measured

    def seconds_per_micro_batch(self) -> float:
        """The slope of seconds over micro-batches per step, by least squares over the measured
        steps, at least 0 and at most the least seconds per micro-batch measured (the fixed part
        cannot be negative). With one count measured: that bound, all of a step's time per micro-batch."""
        measured = self._measured()
        bound = min(seconds / count for count, seconds in measured)
        counts = [count for count, _ in measured]
        mean_count = sum(counts) / len(counts)
        spread = sum((count - mean_count) ** 2 for count in counts)
        if spread == 0:
            return bound
        mean_s = sum(seconds for _, seconds in measured) / len(measured)
        slope = sum((count - mean_count) * (seconds - mean_s) for count, seconds in measured) / spread
        return min(bound, max(0.0, slope))

    def step_seconds(self, micro_batches: int) -> float:
        """A step of `micro_batches` per rank: the slowest measured step moved to that count."""
        slope = self.seconds_per_micro_batch()
        return max(seconds + slope * (micro_batches - count) if count != micro_batches else seconds
                   for count, seconds in self._measured())

    def pace_s(self, micro_batches: int) -> float:
        """A step of `micro_batches` still to come: the mean of the last PACE_STEPS measured steps,
        each moved to that count; before that many are measured, the slowest (step_seconds)."""
        measured = self._measured()[-self.PACE_STEPS:]
        if len(measured) < self.PACE_STEPS:
            return self.step_seconds(micro_batches)
        slope = self.seconds_per_micro_batch()
        return sum(seconds + slope * (micro_batches - count) for count, seconds in measured) / len(measured)

    @contextmanager
    def timing(self, work: str):
        """Time a validation or a checkpoint, for the cost of the end; the next step's time starts after it."""
        started = self.clock()
        yield
        self.last_mark = self.clock()
        if work == "validation":
            self.validation_s = max(self.validation_s or 0.0, self.last_mark - started)
        else:
            self.save_s = max(self.save_s, self.last_mark - started)

    def slowest_step_s(self) -> float:
        """A full step's seconds (step_seconds)."""
        return self.step_seconds(self.full_micro_batches)

    def end_s(self) -> float:
        """What must still fit after the last step: the final validation and checkpoint, two steps."""
        validation = self.validation_s if self.validation_s is not None else self.val_batches * self.slowest_step_s()
        return validation + self.save_s + 2 * self.slowest_step_s()

    def forecasts(self) -> bool:
        """Whether this rank's forecast (steps_that_fit) is worth agreeing on: the plan is made,
        and this process has run enough steps that the slowest is not its first (a resumed run's
        first step compiles and allocates: it would cut the plan short)."""
        return self.planned and len(self.step_s) >= self.ESTIMATE_AFTER

    def estimate_due(self) -> bool:
        return not self.planned and len(self.step_s) == self.ESTIMATE_AFTER

    def steps_that_fit(self, steps_done: int) -> int:
        """How many steps the run can have, by this rank's clock: those done, and as many more as
        fit in the time left after the end's (end_s), each at the pace (pace_s): a ramp's smaller
        steps one by one, then full steps."""
        left_s = self.budget_s - self.clock() - self.end_s()
        step = steps_done
        if self.data is not None and step < self.data.full_from():
            # the pace once, as a line: each of the ramp's steps at fixed + slope x its count
            slope = self.seconds_per_micro_batch()
            fixed = self.pace_s(0)
            while step < self.data.full_from():
                left_s -= fixed + slope * self.micro_batches(step)
                if left_s < 0:
                    return step
                step += 1
        return step + max(0, math.floor(left_s / self.pace_s(self.full_micro_batches)))

    def planned_steps(self, steps_done: int, max_steps: int) -> int:
        """The run's number of steps, rank 0's estimate, the same on every rank; at least the steps
        already done, at most `max_steps` (--steps)."""
        estimate = torch.tensor([min(max_steps, self.steps_that_fit(steps_done))])
        if dist.is_initialized():
            comm.bookkeeping(dist.broadcast, estimate, src=0)
        self.planned = True
        return int(estimate.item())

    def spent(self) -> bool:
        """Whether the next two steps and the end no longer fit (this rank's view)."""
        return self.planned and self.clock() + self.end_s() > self.budget_s


def step_to_meter(args) -> int:
    """A late step, for a lesson that meters one well after the warm-up: the last, or under a time
    budget, whose last step is not known before it runs, the first after its estimate."""
    return args.steps - 1 if getattr(args, "max_minutes", None) is None else TimeBudget.ESTIMATE_AFTER


def time_budget_settings(args) -> dict:
    """What a checkpoint records of a time budget's plan: the steps it planned, and where it
    placed wsd's decay (None: not planned yet, or not placed by a budget)."""
    return {"planned_steps": getattr(args, "planned_steps", None), "decay_start": getattr(args, "decay_start", None)}


def follow_time_budget(args, written_settings: dict) -> None:
    """A run resumed with --max-minutes ends where its first run's plan said when the checkpoint
    was written after the estimate, with the same learning-rate schedule (TimeBudget; under wsd,
    the decay where the plan placed it, in the stable phase or mid-decay alike)."""
    planned = written_settings.get("planned_steps")
    if getattr(args, "max_minutes", None) is not None and planned is not None:
        args.steps, args.planned_steps = planned, planned
        args.decay_start = written_settings.get("decay_start")


# ----------------------------------------------------------------------------- after a step; the profiler; the clock


@dataclass(frozen=True)
class AfterStep:
    """Work after some of the steps (a checkpoint, a sample): `run(step, last)` on the steps
    `due(step, last)` names. train() prints the step's line before it (the line lags a step
    otherwise: LaggedStepLog), so the output keeps its order and a checkpoint's step is on record.
    A plain function given to train() as after_step counts as due after every step."""

    due: Callable[[int, bool], bool]
    run: Callable[[int, bool], None]

    def __call__(self, step: int, last: bool) -> None:
        if self.due(step, last):
            self.run(step, last)


def one_after_another(*hooks: AfterStep | None) -> AfterStep | None:
    """train()'s after_step: each hook given (None: absent) in turn, where it is due."""
    hooks = [hook for hook in hooks if hook is not None]

    def due(step: int, last: bool) -> bool:
        return any(hook.due(step, last) for hook in hooks)

    def run(step: int, last: bool) -> None:
        for hook in hooks:
            hook(step, last)

    return AfterStep(due, run) if hooks else None


def step_profiler(directory, steps: int, device: torch.device) -> torch.profiler.profile | None:
    """--profile DIR: a torch.profiler trace of a few steps, one file per rank in DIR
    (rank<N>.<time>.pt.trace.json), which Perfetto and TensorBoard's profiler plugin open.

    It skips the first step (one-off costs: allocations, the first collective of each group),
    warms up on the next and records up to three; a shorter run records what it has. CPU activity
    always, the CUDA kernels too on a GPU. (PyTorch's profiler library itself prints a
    "profiler_start" and a "profiler_stop" line per rank on stderr: they are not errors.)
    """
    if directory is None:
        return None
    wait = 1 if steps >= 3 else 0
    warmup = 1 if steps - wait >= 2 else 0
    active = min(3, steps - wait - warmup)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    rank = dist.get_rank() if dist.is_initialized() else 0
    return torch.profiler.profile(
        activities=activities, schedule=torch.profiler.schedule(wait=wait, warmup=warmup, active=active, repeat=1),
        on_trace_ready=torch.profiler.tensorboard_trace_handler(str(directory), worker_name=f"rank{rank}"))


_IMPORTED_AT = time.time()


def seconds_since_process_start() -> float:
    """Wall-clock seconds since this process started, from the kernel's record of it (Linux), else
    since this module was imported. In a time-boxed run the minutes before the first step count."""
    try:
        with open("/proc/self/stat") as stat, open("/proc/stat") as system:
            started_ticks = int(stat.read().rsplit(")", 1)[1].split()[19])
            boot = next(int(line.split()[1]) for line in system if line.startswith("btime "))
        return time.time() - (boot + started_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError, StopIteration):
        return time.time() - _IMPORTED_AT
