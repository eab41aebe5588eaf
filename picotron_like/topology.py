"""
Start-up and the process grid.

Every rank of a 5D-parallel run has coordinates (dp, pp, cp, tp). Ranks are laid out with tp
fastest, then cp, then pp, then dp slowest:

    rank = ((dp_rank * pp + pp_rank) * cp + cp_rank) * tp + tp_rank

The order is a bandwidth decision, not a convention: consecutive ranks share a node, so the axis
that talks most (tp: several all-reduces per layer) stays on the fastest links (NVLink), and the axis
that talks least (dp: one gradient reduction per step) is the one that crosses nodes.

For every axis a rank belongs to one process group: the ranks that differ from it only along that
axis. One more group joins dp and cp: context-parallel ranks hold replicas of the same weights,
so their gradients are reduced together with the data-parallel ones.

Expert parallelism (lesson 05) reuses the dp x cp ranks for its experts instead of adding ranks, so
the grid itself stays four-dimensional. The dp x cp ranks hold different tokens and the same dense
weights; cut them (in rank order) into consecutive groups of ep, and each such expert-parallel
group shares one copy of the experts, each member holding E/ep of them. The members at the same
place of every ep group hold the same experts: that complement is the expert-data-parallel group,
over which expert gradients are summed. With dp x cp = 4 ranks a b c d and ep = 2:

    ep groups  [a b] [c d]        a and c hold experts 0..E/2-1, b and d the others
    edp groups [a c] [b d]

Bad degrees are caught by ``validate_parallel_config`` (and each lesson's own rules) before any
process group exists: every
rank reads the same arguments and the same environment, so every rank raises the same error and
none is left waiting in a collective.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from picotron_like import comm

AXES = ("dp", "pp", "cp", "tp")

TIMEOUT_ENV = "PICOTRON_LIKE_TIMEOUT_S"
DEFAULT_TIMEOUT_S = 30 * 60
"""How long a collective waits for a rank that has not joined it before failing. Long on purpose:
a healthy run keeps its peers waiting for minutes at times (the first step under --compile, each
rank building a large model, a checkpoint written before the collective that agrees it is done),
and a watchdog that fires then kills a good run. A dead rank is not found by this timeout: torchrun's
agent watches its ranks and stops the others as soon as one exits (and tells the agents of the other
nodes through the rendezvous), and gloo fails a collective at once when a peer's connection closes;
a test kills a rank under torchrun and sees the run gone in seconds. What is left to the timeout is
a rank alive but stuck (a deadlock, a hung file system): PICOTRON_LIKE_TIMEOUT_S shortens it."""


class ConfigError(ValueError):
    """A parallel configuration that cannot run; the message names the value, the rule and the fix."""


# ----------------------------------------------------------------------------- the grid, as arithmetic

@dataclass(frozen=True)
class GridShape:
    dp: int = 1
    pp: int = 1
    cp: int = 1
    tp: int = 1

    @property
    def world_size(self) -> int:
        return self.dp * self.pp * self.cp * self.tp

    def rank_of(self, dp: int = 0, pp: int = 0, cp: int = 0, tp: int = 0) -> int:
        return ((dp * self.pp + pp) * self.cp + cp) * self.tp + tp

    def coords_of(self, rank: int) -> dict[str, int]:
        rank, tp = divmod(rank, self.tp)
        rank, cp = divmod(rank, self.cp)
        dp, pp = divmod(rank, self.pp)
        return {"dp": dp, "pp": pp, "cp": cp, "tp": tp}

    def group_ranks(self, axes: tuple[str, ...]) -> list[list[int]]:
        """All groups of ranks that differ only along `axes`, each sorted, in a fixed order.

        Every rank must create every group in the same order (``dist.new_group`` is collective),
        so the whole list is computed, not only the caller's group.
        """
        groups: dict[tuple, list[int]] = {}
        for rank in range(self.world_size):
            coords = self.coords_of(rank)
            key = tuple(coords[a] for a in AXES if a not in axes)
            groups.setdefault(key, []).append(rank)
        return list(groups.values())

    def ep_group_ranks(self, ep: int) -> list[list[int]]:
        """The expert-parallel groups: every dp x cp group, in rank order, cut into consecutive
        runs of `ep` ranks. Consecutive, because neighbouring ranks share a node: the all-to-all
        that carries tokens to their experts then stays on the fastest links when it can."""
        self.check_ep(ep)
        return [members[i: i + ep] for members in self.group_ranks(("dp", "cp"))
                for i in range(0, len(members), ep)]

    def edp_group_ranks(self, ep: int) -> list[list[int]]:
        """The expert-data-parallel groups: the members at the same place of every ep group of one
        dp x cp group; they hold the same experts and see different tokens."""
        self.check_ep(ep)
        return [members[i::ep] for members in self.group_ranks(("dp", "cp")) for i in range(ep)]

    def check_ep(self, ep: int) -> None:
        """The rule every layout with experts obeys: the ep groups cut each dp x cp group evenly."""
        if ep < 1 or (self.dp * self.cp) % ep:
            raise ConfigError(f"--ep {ep} does not divide dp*cp = {self.dp}*{self.cp} = {self.dp * self.cp}: "
                              f"expert parallelism splits the dp x cp ranks into groups of ep; "
                              f"pick an ep that divides {self.dp * self.cp}")

    def picture(self) -> str:
        """The grid as text: one line per (dp, pp) pair, ranks laid out as cp rows of tp columns."""
        lines = [f"grid dp={self.dp} x pp={self.pp} x cp={self.cp} x tp={self.tp} "
                 f"= {self.world_size} ranks (tp fastest)"]
        for dp in range(self.dp):
            for pp in range(self.pp):
                rows = [" ".join(f"{self.rank_of(dp, pp, cp, tp):>3}" for tp in range(self.tp))
                        for cp in range(self.cp)]
                lines.append(f"  dp={dp} pp={pp}:  " + "  |  ".join(f"[{row} ]" for row in rows))
        lines.append("  inside [ ]: the tp group; across | : the cp ring; rows: pipeline stages")
        return "\n".join(lines)


def validate_parallel_config(grid: GridShape, world_size: int) -> None:
    """Raise one ConfigError listing every rule the grid breaks (no collectives used): each degree at
    least 1, their product the world size. What an axis needs of the model or the sequence (heads
    divisible by tp, a layer per stage, tokens per cp rank) is its lesson's rule."""
    problems = []
    for axis in AXES:
        if getattr(grid, axis) < 1:
            problems.append(f"--{axis} {getattr(grid, axis)} must be at least 1")
    if grid.world_size != world_size:
        problems.append(
            f"dp*pp*cp*tp = {grid.dp}*{grid.pp}*{grid.cp}*{grid.tp} = {grid.world_size} but the world "
            f"size is {world_size}: launch with --nproc_per_node={grid.world_size} or change the degrees")
    if problems:
        raise ConfigError("bad parallel configuration:\n  - " + "\n  - ".join(problems))


# ----------------------------------------------------------------------------- start-up

def backend_for(device: torch.device) -> str:
    """The default process group's backend for a rank computing on `device`.

    On CUDA the group gets two backends: NCCL moves the tensors that live on the GPU (every
    collective of the training step), gloo the ones that live on the CPU (the small bookkeeping
    the reports gather at the end). With NCCL alone, a CPU tensor in a collective is an error;
    torch.distributed picks the backend per call from the tensor's device.
    """
    return "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"


# Set to "1" to check, at the end of a torchrun script (shutdown), that every member of every group
# issued the same collectives and, on CUDA, that none of the step's ran on a CPU tensor
# (picotron_like.testing.collective_sequences_checked says what is compared). Off by default: it
# records every call in Python and gathers the records at the end.
CHECK_COLLECTIVES_ENV = "PICOTRON_LIKE_CHECK_COLLECTIVES"

# Set to "1" to give every axis a process group of its own, even where another axis has the same
# members (as before they were shared): one NCCL communicator per axis, so that a GPU run can time
# what sharing saves at start-up and in memory. The meters name traffic by axis either way.
GROUP_PER_AXIS_ENV = "PICOTRON_LIKE_GROUP_PER_AXIS"

# Set to "cpu" to run on the CPU over gloo on a machine that has GPUs: the test suite does, since
# its multi-rank proofs start more ranks than a machine has GPUs (and NCCL refuses two ranks on one).
DEVICE_ENV = "PICOTRON_LIKE_DEVICE"


def rank_device(local_rank: int, cuda_devices: int, requested: str | None = None) -> torch.device:
    """The device a rank computes on: GPU number LOCAL_RANK where CUDA has GPUs, else the CPU.

    `requested` ("cpu" or "cuda"; None: whichever exists) comes from PICOTRON_LIKE_DEVICE. A node
    with fewer GPUs than ranks is an error, not a second rank silently put on GPU 0.
    """
    if requested not in (None, "", "cpu", "cuda"):
        raise ConfigError(f"{DEVICE_ENV}={requested}: expected cpu or cuda")
    if requested == "cpu" or (not requested and cuda_devices == 0):
        return torch.device("cpu")
    if cuda_devices == 0:
        raise ConfigError(f"{DEVICE_ENV}=cuda but no CUDA device is visible")
    if local_rank >= cuda_devices:
        raise ConfigError(f"local rank {local_rank} has no GPU: this node has {cuda_devices}, one per rank is needed "
                          f"(lower --nproc_per_node, or set {DEVICE_ENV}=cpu to run on the CPU over gloo)")
    return torch.device("cuda", local_rank)


def init_distributed(init_method: str | None = None, rank: int | None = None,
                     world_size: int | None = None, timeout_s: float | None = None,
                     device_type: str | None = None) -> torch.device:
    """Create the default process group (see backend_for); returns this rank's device.

    With no arguments it reads torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR).
    One GPU per local rank (rank_device); `device_type` or PICOTRON_LIKE_DEVICE=cpu keeps a rank on
    the CPU. A finite timeout turns a collective that some rank never joins into an error on the
    others instead of a hang (collective_timeout_s: DEFAULT_TIMEOUT_S unless set).
    """
    timeout_s = collective_timeout_s() if timeout_s is None else timeout_s
    requested = device_type or os.environ.get(DEVICE_ENV)
    cuda_devices = torch.cuda.device_count() if requested != "cpu" and torch.cuda.is_available() else 0
    device = rank_device(int(os.environ.get("LOCAL_RANK", 0)), cuda_devices, requested)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    store = None
    if init_method is None and "TORCHELASTIC_RESTART_COUNT" in os.environ:    # started by torchrun
        rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        store = restart_store(rank, world_size, timedelta(seconds=timeout_s))
    dist.init_process_group(backend_for(device), init_method=init_method, store=store,
                            rank=-1 if rank is None else rank,
                            world_size=-1 if world_size is None else world_size,
                            timeout=timedelta(seconds=timeout_s),
                            device_id=device if device.type == "cuda" else None)
    if os.environ.get(CHECK_COLLECTIVES_ENV) == "1":
        from picotron_like.testing import CollectiveLog     # the test harness, loaded only when asked
        comm.meter.log = CollectiveLog(device.type)
    return device


def restart_store(rank: int, world_size: int, timeout: timedelta):
    """torchrun's rendezvous store with this start's own key space.

    torchrun --max-restarts starts every rank again with the same store (its agent's), and
    torch's env:// start-up (2.13) writes the ranks' gloo addresses under the same keys in every
    start: a restarted rank can read an address of the start before, of a process that is gone,
    and fail to connect. Prefixing the keys with the restart count (TORCHELASTIC_RESTART_COUNT)
    gives each start its own."""
    restart = os.environ["TORCHELASTIC_RESTART_COUNT"]
    # The agent hosts the store when it says so; otherwise rank 0 does, as env:// would.
    hosted_by_agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size,
                          is_master=not hosted_by_agent and rank == 0, timeout=timeout)
    return dist.PrefixStore(f"picotron_like/start_{restart}", store)


def collective_timeout_s() -> float:
    """PICOTRON_LIKE_TIMEOUT_S, or DEFAULT_TIMEOUT_S; a value that is not a positive number is one
    ConfigError, raised before any process group exists."""
    value = os.environ.get(TIMEOUT_ENV, str(DEFAULT_TIMEOUT_S))
    try:
        seconds = float(value)
    except ValueError:
        seconds = float("nan")
    if not seconds > 0:
        raise ConfigError(f"{TIMEOUT_ENV}={value} must be a positive number of seconds "
                          f"(default {DEFAULT_TIMEOUT_S})")
    return seconds


def world_size_from_env() -> int:
    """The world size torchrun announced, readable before any process group exists."""
    if "WORLD_SIZE" not in os.environ:
        raise ConfigError("WORLD_SIZE is not set: launch lessons with torchrun, e.g. "
                          "torchrun --nproc_per_node=4 01_data_parallel.py")
    return int(os.environ["WORLD_SIZE"])


def torchrun_workers(parent: int) -> list[int]:
    """The worker processes of the torchrun whose pid is `parent` (its children, read from /proc).
    torchrun starts each worker in a session of its own, so killing torchrun's process group would
    leave them running: whoever kills a run (a test, --autotune's timeout) kills these."""
    children = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as file:
                if int(file.read().rsplit(")", 1)[1].split()[1]) == parent:
                    children.append(int(entry))
        except (FileNotFoundError, ProcessLookupError):
            continue
    return children


@dataclass(frozen=True)
class GroupLayout:
    """A process group as one rank sees it, without the group: its place in it and the group's size.

    Cutting a rank's share of a model (which rows of a tensor-parallel weight, which experts,
    which shard of a ZeRO unit) needs nothing more, so the builders accept one wherever they take
    a group (group_rank, group_size): the memory plan builds a full-size model's shares on the
    meta device for any rank of any layout, without launching a single process.
    """

    rank: int
    size: int


def group_rank(group) -> int:
    return group.rank if isinstance(group, GroupLayout) else dist.get_rank(comm.process_group(group))


def group_size(group) -> int:
    return group.size if isinstance(group, GroupLayout) else dist.get_world_size(comm.process_group(group))


class ProcessGrid:
    """This rank's coordinates, its neighbours and the process group of every axis (an
    comm.AxisGroup: axes with the same members share one process group)."""

    def __init__(self, shape: GridShape, ep: int = 1):
        if not dist.is_initialized():
            raise RuntimeError("ProcessGrid needs an initialised default process group (init_distributed)")
        if shape.world_size != dist.get_world_size():
            raise ConfigError(f"grid {shape} needs {shape.world_size} ranks, world size is {dist.get_world_size()}")
        self.lay_out(shape, ep, dist.get_rank())
        comm.meter.reset()      # the start-up barriers (see _create_group_of) are not training traffic

    def lay_out(self, shape: GridShape, ep: int, rank: int) -> None:
        """Coordinates, groups (one _create_group_of per axis, in the same order on every rank) and
        neighbours of `rank` in the layout."""
        ep_ranks = shape.ep_group_ranks(ep)     # raises ConfigError, before any group, if ep does not fit
        self.shape, self.rank = shape, rank
        self.process_groups: dict[tuple, object] = {}     # members (with GROUP_PER_AXIS_ENV: axis, members) -> group
        self.shared_groups = os.environ.get(GROUP_PER_AXIS_ENV) != "1"
        coords = shape.coords_of(self.rank)
        self.dp_rank, self.pp_rank, self.cp_rank, self.tp_rank = (coords[a] for a in AXES)
        self.dp_size, self.pp_size, self.cp_size, self.tp_size = shape.dp, shape.pp, shape.cp, shape.tp

        self.tp_group = self._create_groups(("tp",), "tp")
        self.cp_group = self._create_groups(("cp",), "cp")
        self.pp_group = self._create_groups(("pp",), "pp")
        self.dp_group = self._create_groups(("dp",), "dp")
        self.dp_cp_group = self._create_groups(("dp", "cp"), "dp_cp")
        self.ep_group = self._create_group_of(ep_ranks, "ep")
        self.edp_group = self._create_group_of(shape.edp_group_ranks(ep), "edp")
        self.ep_size = ep
        self.ep_rank = next(ranks for ranks in ep_ranks if self.rank in ranks).index(self.rank)

        def neighbour(axis, step):
            moved = dict(coords, **{axis: (coords[axis] + step) % getattr(shape, axis)})
            return shape.rank_of(**moved)

        self.pp_prev_rank = neighbour("pp", -1) if self.pp_rank > 0 else None
        self.pp_next_rank = neighbour("pp", +1) if self.pp_rank < shape.pp - 1 else None
        self.cp_prev_rank, self.cp_next_rank = neighbour("cp", -1), neighbour("cp", +1)
        self.is_first_stage = self.pp_rank == 0
        self.is_last_stage = self.pp_rank == shape.pp - 1

    def _create_groups(self, axes, name):
        return self._create_group_of(self.shape.group_ranks(axes), name)

    def _create_group_of(self, all_ranks: list[list[int]], name: str) -> comm.AxisGroup:
        for ranks in all_ranks:
            # One process group per distinct member set: an axis whose groups have the members of
            # an earlier axis's (dp x cp when cp = 1 is dp) reuses them, and a group of every rank
            # is the default group. Every rank calls new_group for every new set, in the same order
            # (it is collective): all_ranks and the sets made so far are the same on every rank.
            if self._group_key(ranks, name) not in self.process_groups:
                whole_world = self.shared_groups and len(ranks) == self.shape.world_size
                self.process_groups[self._group_key(ranks, name)] = (dist.group.WORLD if whole_world
                                                                     else dist.new_group(ranks))
        mine = comm.AxisGroup(self.process_groups[self._group_key(next(r for r in all_ranks if self.rank in r), name)],
                              name)
        # A group's first operation must include all of its ranks (NCCL sets up its communicator
        # then, among whoever takes part). Without this barrier the first operation on a pipeline
        # group of 3 or more stages is a send between two neighbours, and the stage left out
        # would later join a communicator the others built without it.
        comm.call(dist.barrier, group=mine)
        return mine

    def _group_key(self, ranks: list[int], name: str) -> tuple:
        return tuple(ranks) if self.shared_groups else (name, *ranks)

    def communicators(self) -> int:
        """How many process groups this rank belongs to, the default group included: one per
        distinct member set of its axes (so one communicator each on NCCL)."""
        return len({id(group) for members, group in self.process_groups.items() if self.rank in members}
                   | {id(dist.group.WORLD)})

    def __repr__(self):
        return (f"rank {self.rank}: dp={self.dp_rank} pp={self.pp_rank} cp={self.cp_rank} "
                f"tp={self.tp_rank} ep={self.ep_rank}")


def shutdown(exit_code: int = 0) -> None:
    """Leave a torchrun script without the interpreter's teardown.

    A gloo background thread can abort the process while Python tears down ("terminate called
    without an active exception", SIGABRT), even after destroy_process_group: a known PyTorch
    problem that would turn a good run into a failed one at random. So: wait for every rank,
    destroy the group, flush what we printed, and exit at once with os._exit. A run that records its
    collectives (PICOTRON_LIKE_CHECK_COLLECTIVES=1) checks them first: a mismatch is one error
    (rank 0 says where) and exit code 1.
    """
    log, comm.meter.log = comm.meter.log, None
    if dist.is_initialized() and log is not None and exit_code == 0:
        try:
            log.check()
        except AssertionError as mismatch:
            if dist.get_rank() == 0:
                print(f"error: {mismatch}", file=sys.stderr, flush=True)
            exit_code = 1
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(exit_code)
