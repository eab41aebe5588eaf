"""
Tools for pipeline schedules: a simulator that proves a schedule cannot deadlock, the live
micro-batches and the bubble of a schedule, and the timeline of a real run, recorded from outside.

None of this is the technique (lesson 03 is), and the package imports no lesson, so the tools are
duck-typed on what lesson 03 builds:

- an *action* has ``.kind`` ("F" forward, "B" backward, or with the backward split in two "B" the
  input gradient and "W" the weight gradients), ``.chunk`` (which of the rank's model chunks runs
  it) and ``.micro_batch``;
- a rank's *program* is a list of actions and *transfer batches*; a transfer batch is a tuple
  (an action never is) of transfers, each with ``.direction`` ("send" or "recv"), ``.peer`` (the
  other rank's index in the pipeline group) and ``.message`` (what is sent, compared with ==);
- a *timeline* is, for each stage, a list of (action, start, end).
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass

import torch
import torch.distributed as dist

from picotron_like import comm
from picotron_like.metrics import CallObserver
from picotron_like.topology import group_size


def is_transfer_batch(step) -> bool:
    return isinstance(step, tuple)


class SendsInFlight(tuple):
    """A transfer batch of sends that is posted but not waited for: the rank computes on (the
    zero-bubble schedule's W, which needs nothing from anyone) and the next batch waits for these
    sends together with its own transfers."""


# ----------------------------------------------------------------------------- the simulator


class PipelineDeadlock(RuntimeError):
    """The programs of a schedule would hang or exchange the wrong tensors."""


def simulate_pipeline(programs, forward_time: float = 1.0, backward_time: float = 2.0,
                      virtual_stages: int = 1, weight_time: float = 1.0) -> list[list[tuple[object, float, float]]]:
    """Run every rank's program on a model clock; return each rank's (action, start, end) events.

    A batch of transfers completes only when each of its transfers has met its partner on the
    peer (a send its receive, in the order they were posted): the strictest semantics a
    backend can have (NCCL may make a large send wait for its receive; gloo is more forgiving).
    Two failures are caught: no rank can move (a deadlock), and the k-th message from a to b is
    not the one b expects as its k-th (it would silently receive the wrong tensor: NCCL has no
    tags to tell them apart). A chunk's action takes 1/v of a whole stage's time. A "W" action
    takes weight_time; a program that splits its backwards passes the B part as backward_time. A
    SendsInFlight batch is posted without waiting; the rank's next batch waits for it as well.
    """
    durations = {"F": forward_time, "B": backward_time, "W": weight_time}
    n = len(programs)
    position, clock = [0] * n, [0.0] * n
    events = [[] for _ in range(n)]
    posted = defaultdict(list)   # (src, dst, "send" or "recv") -> [(message, time posted)], in posting order
    waiting = {}                 # rank -> (program position, [(partner's queue, index in it, message)])
    in_flight = defaultdict(list)  # rank -> what its SendsInFlight posted, waited for by its next batch

    def post(rank, transfers):
        mine = []
        for transfer in transfers:
            link = (rank, transfer.peer) if transfer.direction == "send" else (transfer.peer, rank)
            queue = posted[link + (transfer.direction,)]
            queue.append((transfer.message, clock[rank]))
            partner = "recv" if transfer.direction == "send" else "send"
            mine.append((link + (partner,), len(queue) - 1, transfer.message))
        return mine

    def completion_time(rank):
        """When the rank's posted batch completes, or None while a partner is missing."""
        done_at = clock[rank]
        for partner_queue, index, message in waiting[rank][1]:
            if len(posted[partner_queue]) <= index:
                return None
            partner_message, partner_time = posted[partner_queue][index]
            if partner_message != message:
                raise PipelineDeadlock(f"rank {rank} expects {message} but message number {index} on that "
                                       f"link is {partner_message}")
            done_at = max(done_at, partner_time)
        return done_at

    while any(position[rank] < len(programs[rank]) for rank in range(n)):
        moved = False
        for rank in range(n):
            while position[rank] < len(programs[rank]):
                step = programs[rank][position[rank]]
                if not is_transfer_batch(step):
                    duration = durations[step.kind] / virtual_stages
                    events[rank].append((step, clock[rank], clock[rank] + duration))
                    clock[rank] += duration
                elif isinstance(step, SendsInFlight):
                    in_flight[rank] += post(rank, step)
                else:
                    if waiting.get(rank, (None,))[0] != position[rank]:
                        waiting[rank] = (position[rank], post(rank, step) + in_flight.pop(rank, []))
                        moved = True
                    done_at = completion_time(rank)
                    if done_at is None:
                        break
                    clock[rank] = done_at
                position[rank] += 1
                moved = True
        if not moved:
            stuck = {rank: programs[rank][position[rank]] for rank in range(n) if position[rank] < len(programs[rank])}
            raise PipelineDeadlock(f"no rank can move; waiting at: {stuck}")
    return events


def peak_live_micro_batches(program, chunk_sizes=None, micro_batch_sizes=None) -> int:
    """The most (chunk, micro-batch) pairs whose activations a program keeps between their F and B
    (in a program that splits its backwards: between F and W, whose inputs B leaves behind).

    With chunk_sizes (e.g. each chunk's activation bytes for one micro-batch), the peak of their
    sum instead of their count; with micro_batch_sizes, {(chunk, micro_batch): bytes}, the same
    for micro-batches of different sizes (experts: each micro-batch's own routing).
    """
    live = peak = 0
    actions = [step for step in program if not is_transfer_batch(step)]
    frees = "W" if any(action.kind == "W" for action in actions) else "B"
    for step in actions:
        if step.kind in ("F", frees):
            if micro_batch_sizes is not None:
                size = micro_batch_sizes[(step.chunk, step.micro_batch)]
            else:
                size = 1 if chunk_sizes is None else chunk_sizes[step.chunk]
            live += size if step.kind == "F" else -size
            peak = max(peak, live)
    return peak


# ----------------------------------------------------------------------------- timelines and the bubble


def bubble_fraction(timelines) -> float:
    """Measured idle / busy time, averaged over the stages.

    The step lasts from the common start to the end of the last action on any stage; a stage is
    idle whenever it is not computing (waiting for a neighbour, or done early).
    """
    span = max(end for events in timelines for _, _, end in events)
    fractions = []
    for events in timelines:
        busy = sum(end - start for _, start, end in events)
        fractions.append((span - busy) / busy)
    return sum(fractions) / len(fractions)


def render_timeline(timelines, width: int = 96) -> str:
    """One row per stage; forward: the micro-batch's digit, backward (B): its letter (a = 0), weight
    gradients (W): its capital letter, '.': idle."""
    span = max(end for events in timelines for _, _, end in events)
    rows = []
    for stage, events in enumerate(timelines):
        cells = ["."] * width
        for action, start, end in events:
            letter = chr(ord("a") + action.micro_batch % 26)
            symbol = {"F": str(action.micro_batch % 10), "B": letter, "W": letter.upper()}[action.kind]
            first = round(start / span * width)
            for column in range(first, min(max(round(end / span * width), first + 1), width)):
                cells[column] = symbol
        rows.append(f"stage {stage} |{''.join(cells)}|")
    return "\n".join(rows)


@dataclass(frozen=True)
class RecordedAction:
    """An action as a timeline gathered from other ranks holds it."""

    kind: str
    chunk: int
    micro_batch: int


class TimelineRecorder:
    """Times a pipeline's compute actions from outside: (action, start, end) in seconds.

    While entered, Python's profiler hook (metrics.CallObserver) reports every call of the
    pipeline's per-action methods (by default ``forward_step`` and ``backward_step`` of its class,
    whose first argument is the action): the pipeline itself keeps no clock and nothing of it is
    replaced. Entering waits on a barrier of the pipeline group, so every stage starts its clock as
    the barrier releases it and the rows line up across processes and machines without sharing a
    clock. On CUDA each action is synchronised, or the clock would time the kernel launches
    instead of the kernels.
    """

    methods = ("forward_step", "backward_step")

    def __init__(self, pipeline, group, device: torch.device):
        self.pipeline, self.group, self.device = pipeline, group, device
        self.events = []

    def _synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _started(self, frame) -> None:
        if frame.f_locals.get("self") is self.pipeline:
            self._synchronize()
            self._running.append((frame.f_locals[frame.f_code.co_varnames[1]], time.perf_counter()))

    def _ended(self, frame) -> None:
        if frame.f_locals.get("self") is self.pipeline:
            self._synchronize()
            action, start = self._running.pop()
            self.events.append((action, start - self._t0, time.perf_counter() - self._t0))

    def __enter__(self):
        comm.call(dist.barrier, group=self.group)
        self.events, self._running, self._t0 = [], [], time.perf_counter()
        self._calls = CallObserver([getattr(type(self.pipeline), name) for name in self.methods],
                                   on_call=self._started, on_return=self._ended)
        self._calls.__enter__()
        return self

    def __exit__(self, *exc):
        return self._calls.__exit__(*exc)


def gather_timelines(events, group) -> list[list[tuple[RecordedAction, float, float]]]:
    """Every stage's (action, start, end) events on every rank of the pipeline group, in stage order
    (every stage of a schedule runs equally many actions, so the rows have one shape)."""
    # CPU tensors on purpose: this is report bookkeeping after training. On CUDA the default group
    # is "cpu:gloo,cuda:nccl", so gloo carries it and NCCL (which refuses CPU tensors) is kept for
    # the training step's tensors, which all live on the rank's device.
    rows = torch.tensor([["FBW".index(action.kind), action.chunk, action.micro_batch, start, end]
                         for action, start, end in events], dtype=torch.float64)
    gathered = [torch.empty_like(rows) for _ in range(group_size(group))]
    comm.call(dist.all_gather, gathered, rows, group=group)
    return [[(RecordedAction("FBW"[int(kind)], int(chunk), int(micro)), start, end)
             for kind, chunk, micro, start, end in stage_rows.tolist()] for stage_rows in gathered]
