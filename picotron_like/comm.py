"""
The communication meter: every collective a lesson issues goes through ``comm.call``.

    handle = comm.call(dist.all_reduce, bucket, group=dp_group, async_op=True)

The line still shows the real ``torch.distributed`` call and its arguments; ``call`` only counts it
(one call, the size of its message, the axis) and then makes it. At the end of a run
each lesson prints what was counted next to what its formula predicted.

The grid's groups are ``AxisGroup`` handles: an axis's name beside its process group. Axes with the
same members share one process group (one communicator), and the meter still reports each
collective under the axis the lesson named; ``call`` passes torch the process group itself.

Two sizes are recorded per call:

- ``payload`` — the size of the logical message: the tensor reduced by an all-reduce, the full
  tensor an all-gather produces or a reduce-scatter consumes, what a send sends. This is what
  the analytic formulas in the lessons speak about.
- ``sent`` — the bytes this rank puts on the wire if the collective runs as a ring, the algorithm
  NCCL and gloo use for large messages: an all-reduce of S bytes over n ranks sends 2(n-1)/n * S
  (a reduce-scatter then an all-gather, each (n-1)/n * S). It is a model of the wire, derived
  from the measured payload, not a packet capture.

Collectives that serve the run's control rather than the technique (agreed stops, the time
budget, checkpoint agreement) go through ``bookkeeping``: not counted, but, like every call here,
recorded when a test checks that every member of each group issued the same collectives
(``picotron_like.testing.collective_sequences_checked``).

``AllToAll`` is the one collective with its own autograd rule here: an uneven all-to-all whose
backward is the all-to-all with the split sizes swapped. Ulysses (lesson 04) and the expert
dispatch (lesson 05) both use it, so it lives with the meter rather than in either lesson.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist

# torch 2.13 renamed the single-tensor collectives: all_gather_into_tensor became
# all_gather_single and reduce_scatter_tensor became reduce_scatter_single, and the old names now
# print a FutureWarning on every call. Older releases (a GPU image often ships one) have only the
# old names. Lessons call these two aliases, which are the real torch.distributed functions.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_KIND_NAMES = {"all_gather_into_tensor": "all_gather_single", "reduce_scatter_tensor": "reduce_scatter_single"}

_group_names: dict = {}


@dataclass(frozen=True, eq=False)
class AxisGroup:
    """One axis's process group as the grid hands it out: the group, and the axis's name.

    Axes whose members are the same ranks (dp and dp x cp when cp = 1, edp and dp x cp when
    ep = 1) share one process group, so one communicator, not one each (on NCCL each costs GPU
    memory and start-up time). The handle keeps their traffic apart in the meter: ``call``
    reports a collective under the name of the handle it was given and hands torch the group.
    """

    process_group: Any
    name: str


def process_group(group):
    """The torch process group behind an axis handle (torch's own functions take only the group)."""
    return group.process_group if isinstance(group, AxisGroup) else group


def name_group(group, name: str) -> None:
    """Give a process group the name the meter reports it under (the grid's axes carry theirs)."""
    _group_names[group] = name


def group_name(group) -> str:
    if isinstance(group, AxisGroup):
        return group.name
    if group is None or group is dist.group.WORLD:
        return "world"
    return _group_names.get(group, "unnamed")


class P2POp(dist.P2POp):
    """torch's P2POp on an axis handle: built on the handle's process group (torch resolves the peer
    there), and it keeps the axis name for the meter."""

    def __init__(self, op, tensor, peer: int, group, tag: int = 0):
        super().__init__(op, tensor, peer, process_group(group), tag)
        self.axis = group


@dataclass
class Traffic:
    calls: int = 0
    payload_bytes: int = 0
    sent_bytes: float = 0.0


def _nbytes(tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _device_of(args):
    """The device of a collective's first tensor argument (a list of tensors counts by its first)."""
    for arg in args:
        if isinstance(arg, (list, tuple)) and arg:
            arg = arg[0]
        if hasattr(arg, "device"):
            return arg.device
    return None


def _measure(kind: str, args, kwargs, n: int) -> tuple[int, float]:
    """(payload bytes, bytes this rank sends on a ring) of one collective call."""
    ring = (n - 1) / n
    if kind == "all_reduce":
        payload = _nbytes(args[0])
        return payload, 2 * ring * payload
    if kind == "all_gather_single":
        payload = _nbytes(args[0])              # the gathered output
        return payload, ring * payload
    if kind == "reduce_scatter_single":
        payload = _nbytes(args[1])              # the full input
        return payload, ring * payload
    if kind == "all_gather":
        payload = n * _nbytes(args[1])
        return payload, ring * payload
    if kind == "all_to_all_single":
        payload = _nbytes(args[1])              # the input this rank scatters
        splits = kwargs.get("input_split_sizes")
        if splits is None:
            return payload, ring * payload
        own = splits[dist.get_rank(kwargs.get("group"))]
        return payload, payload * (1 - own / max(sum(splits), 1))
    if kind in ("broadcast", "send", "isend"):
        payload = _nbytes(args[0])
        return payload, float(payload)
    if kind in ("recv", "irecv"):
        return _nbytes(args[0]), 0.0
    if kind == "barrier":
        return 0, 0.0
    raise ValueError(f"the communication meter does not know how to size {kind!r}")


class CommMeter:
    """Counts every call by (kind, group). Also keeps, per group, the kind of its first operation,
    and the devices each (kind, group) moved tensors on: the two facts a GPU run depends on and a
    CPU test can check (a group's first operation must include all its ranks; NCCL moves only
    tensors on the rank's GPU)."""

    def __init__(self):
        self.traffic: dict[tuple[str, str], Traffic] = defaultdict(Traffic)
        self.first_operation: dict[str, str] = {}
        self.devices: dict[tuple[str, str], set[str]] = defaultdict(set)
        # A testing.CollectiveLog while a test checks that every group's members issue the same
        # collectives (testing.collective_sequences_checked); None otherwise: one test per call.
        self.log = None

    def record(self, kind: str, group, payload: int, sent: float, device=None) -> None:
        name = group_name(group)
        entry = self.traffic[(kind, name)]
        entry.calls += 1
        entry.payload_bytes += payload
        entry.sent_bytes += sent
        self.first_operation.setdefault(name, kind)
        if device is not None:
            self.devices[(kind, name)].add(str(device))

    def call(self, collective, *args, **kwargs):
        """Count `collective(*args, **kwargs)`, then run it and return what it returns."""
        if self.log is not None:
            self.log.add(collective, args, kwargs)
        if collective is dist.batch_isend_irecv:
            for op in args[0]:
                kind = op.op.__name__
                payload, sent = _measure(kind, (op.tensor,), {}, 2)
                self.record(kind, getattr(op, "axis", op.group), payload, sent, op.tensor.device)
            return collective(*args, **kwargs)
        group = kwargs.get("group")
        if isinstance(group, AxisGroup):
            kwargs["group"] = group.process_group
        kind = _KIND_NAMES.get(collective.__name__, collective.__name__)
        payload, sent = _measure(kind, args, kwargs, dist.get_world_size(kwargs.get("group")))
        self.record(kind, group, payload, sent, _device_of(args))
        return collective(*args, **kwargs)

    def reset(self) -> None:
        """Forget the traffic (a lesson resets after start-up); first operations stay known."""
        self.traffic.clear()
        self.devices.clear()

    def get(self, kind: str, group: str) -> Traffic:
        """A snapshot (a copy) of the traffic counted so far for one kind of call on one group."""
        return replace(self.traffic.get((kind, group), Traffic()))

    def table(self, predicted: dict[tuple[str, str], float] | None = None, per: int = 1) -> str:
        """Counted traffic, divided by `per` (e.g. the number of steps), beside predicted payloads."""
        predicted = predicted or {}
        rows = [f"{'collective':<22}{'group':<8}{'calls':>8}{'payload MB':>13}{'predicted MB':>14}"
                f"{'sent/rank MB':>14}"]
        for key in sorted(set(self.traffic) | set(predicted)):
            kind, group = key
            entry = self.traffic.get(key, Traffic())
            guess = f"{predicted[key] / 1e6:>14.4f}" if key in predicted else f"{'-':>14}"
            rows.append(f"{kind:<22}{group:<8}{entry.calls / per:>8.1f}{entry.payload_bytes / per / 1e6:>13.4f}"
                        f"{guess}{entry.sent_bytes / per / 1e6:>14.4f}")
        return "\n".join(rows)


meter = CommMeter()
call = meter.call


def bookkeeping(collective, *args, **kwargs):
    """Run a collective of the run's control (an agreed stop, the time budget, a checkpoint's
    agreement): not counted, since the meter reports the technique, but seen by the sequence check
    like every other, since each member of its group must issue it too. These run on CPU tensors,
    through gloo beside NCCL, between steps."""
    if meter.log is not None:
        meter.log.add(collective, args, kwargs, bookkeeping=True)
    if "group" in kwargs:
        kwargs["group"] = process_group(kwargs["group"])
    return collective(*args, **kwargs)


# ---------------------------------------------------------------------------- a differentiable all-to-all


class AllToAll(torch.autograd.Function):
    """Slice j of dim 0 goes to rank j; the slice from rank j lands at index j of dim 0.

    Even by default (dim 0 cut into group-size equal slices). With split sizes, slice j of the
    input holds input_splits[j] rows and the output receives output_splits[j] rows from rank j
    (lesson 04's Ulysses attention exchanges even slices of heads; lesson 05 sends each rank the
    tokens routed to its experts, a different number each time).
    The exchange is its own inverse with the split sizes swapped, so backward is the same
    all-to-all on the gradient.
    """

    @staticmethod
    def forward(ctx, x, group, output_splits=None, input_splits=None):
        ctx.group, ctx.splits = group, (input_splits, output_splits)
        return _all_to_all(x, group, output_splits, input_splits)

    @staticmethod
    def backward(ctx, d_out):
        return _all_to_all(d_out, ctx.group, *ctx.splits), None, None, None


def _all_to_all(x, group, output_splits, input_splits):
    # Contiguous first: all_to_all_single cuts dim 0 of the raw memory, and empty_like of a
    # permuted view would inherit its permuted strides.
    x = x.contiguous()
    out = torch.empty_like(x) if output_splits is None else x.new_empty((sum(output_splits), *x.shape[1:]))
    call(dist.all_to_all_single, out, x, output_split_sizes=output_splits, input_split_sizes=input_splits,
         group=group)
    return out
