"""
Run a function on N real gloo ranks from a test, and fail fast instead of hanging.

    results = run_ranks(4, check_data_parallel, mode="bucketed", timeout_s=90)

Each rank is a separate process joined to a real gloo process group (rendezvous through a file,
so no port is needed). The function runs on every rank; its return values come back as a list
indexed by rank. If any rank raises, every rank's traceback is put into one RankFailure
raised in the test; if some rank never finishes, the test fails with a timeout, and the
stack of each unfinished rank (dumped by faulthandler inside the rank just before the deadline)
shows where it was stuck.

Processes come from a forkserver that has already imported torch: forking from it costs
milliseconds, where starting a fresh interpreter costs seconds of `import torch` per rank on a
two-core machine. Forking the pytest process itself would be faster still but unsafe, because
its OpenMP thread pool does not survive a fork.

``run_ranks(..., checks=SEQUENCES_CHECKED)`` also checks that every member of every group issued
the same collectives (collective_sequences_checked): what NCCL needs and does not check.

The other side of every equality test is here too: ``train_reference`` trains one GPT on one
device; ``ignore_targets`` and ``masked_step_batch`` give both sides the same masked targets.
"""

from __future__ import annotations

import faulthandler
import math
import multiprocessing
import os
import pickle
import queue as queue_module
import shutil
import sys
import tempfile
import time
import traceback
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

from picotron_like import comm
from picotron_like.lessons import REPO_ROOT
from picotron_like.topology import torchrun_workers

_context = multiprocessing.get_context("forkserver")
_context.set_forkserver_preload(["torch", "torch.distributed", "numpy", "picotron_like.model"])


class RankFailure(AssertionError):
    """One or more ranks raised, died or hung; the message holds every rank's report."""


def _rank_entry(call: bytes, rank, world_size, workdir, timeout_s, results, checks):
    import torch

    from picotron_like.topology import init_distributed

    # One thread per rank: the ranks share the machine's cores, and torch's default of one thread
    # per core makes N ranks fight over them (10-20x slower on two cores).
    torch.set_num_threads(1)
    stack_dump = open(Path(workdir) / f"stack_rank{rank}.txt", "w")
    faulthandler.dump_traceback_later(max(timeout_s - 3.0, 1.0), file=stack_dump)
    try:
        # The gloo timeout is shorter than the test's, so a rank waiting on a collective that a
        # crashed peer never joins raises its own error before the test gives up on it.
        # The proofs run on the CPU everywhere, on a GPU machine too: they start more ranks than it
        # has GPUs, and what they prove is the arithmetic, which gloo on the CPU shows exactly.
        if checks.distributed_debug_detail:
            dist.set_debug_level(dist.DebugLevel.DETAIL)
        init_distributed(f"file://{workdir}/store", rank, world_size, timeout_s=max(timeout_s - 10.0, 5.0),
                         device_type="cpu")
        fn, args, kwargs = pickle.loads(call)
        with collective_sequences_checked() if checks.sequences else nullcontext():
            value = fn(*args, **kwargs)
        # Pickle here with the plain pickler: the queue's pickler would move tensors through shared
        # memory that this process must keep alive, and it is about to exit.
        results.put((rank, "ok", pickle.dumps(value)))
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))
    finally:
        faulthandler.cancel_dump_traceback_later()
        results.close()
        results.join_thread()
        # Skip interpreter teardown, where gloo's background thread can abort the process.
        os._exit(0)


@dataclass(frozen=True)
class RankChecks:
    """What run_ranks checks beyond fn's own assertions. `sequences`: every member of every group
    issues the same collectives (collective_sequences_checked around fn). `distributed_debug_detail`:
    torch's TORCH_DISTRIBUTED_DEBUG=DETAIL, which wraps every group so that each collective first
    compares its op type, dtypes and shapes across the group (see collective_sequences_checked for
    what it misses and what it costs)."""

    sequences: bool = False
    distributed_debug_detail: bool = False


SEQUENCES_CHECKED = RankChecks(sequences=True)

def run_ranks(world_size: int, fn, *args, timeout_s: float = 120.0, checks: RankChecks = RankChecks(),
              **kwargs) -> list:
    """Run fn(*args, **kwargs) on `world_size` gloo ranks, each with its own copy of the arguments;
    return the results in rank order."""
    # The call goes to the ranks pickled by value, as their results come back. Handed to Process as
    # it is, multiprocessing's pickler would share each tensor's storage through a file descriptor
    # of its own, and the forkserver passes fewer than 252 to a new process ("ValueError: too many
    # fds": three of the fuzzer's Muon draws on six ranks, every step's gradients of each, were 459).
    call = pickle.dumps((fn, args, kwargs))
    workdir = tempfile.mkdtemp(prefix="picotron_ranks_")
    results = _context.Queue()
    processes = [
        _context.Process(target=_rank_entry, args=(call, rank, world_size, workdir, timeout_s, results, checks),
                         daemon=True)
        for rank in range(world_size)
    ]
    for process in processes:
        process.start()

    outcomes: dict[int, tuple[str, object]] = {}
    deadline = time.monotonic() + timeout_s
    first_error_at = None
    try:
        while len(outcomes) < world_size:
            now = time.monotonic()
            # After a first error, give the other ranks a moment to report theirs, then stop:
            # they are usually stuck waiting for the failed rank and would only time out.
            if now > deadline or (first_error_at is not None and now > first_error_at + 3.0):
                break
            try:
                rank, status, value = results.get(timeout=0.2)
                outcomes[rank] = (status, value)
                if status == "error" and first_error_at is None:
                    first_error_at = time.monotonic()
            except queue_module.Empty:
                for rank, process in enumerate(processes):
                    if rank not in outcomes and process.exitcode not in (None, 0):
                        outcomes[rank] = ("error", f"rank {rank} died with exit code {process.exitcode}")
                        first_error_at = first_error_at or time.monotonic()
        for rank, process in enumerate(processes):
            if rank not in outcomes and not process.is_alive() and process.exitcode not in (None, 0):
                outcomes[rank] = ("error", f"rank {rank} died with exit code {process.exitcode}")
    finally:
        for process in processes:
            if process.is_alive():
                process.kill()
        for process in processes:
            process.join(timeout=5)
        stacks = {rank: (Path(workdir) / f"stack_rank{rank}.txt").read_text()
                  for rank in range(world_size) if (Path(workdir) / f"stack_rank{rank}.txt").exists()}
        shutil.rmtree(workdir, ignore_errors=True)

    errors = {rank: value for rank, (status, value) in outcomes.items() if status == "error"}
    missing = [rank for rank in range(world_size) if rank not in outcomes]
    if errors or missing:
        report = [f"--- rank {rank} raised:\n{text}" for rank, text in sorted(errors.items())]
        if missing:
            reason = "stopped after another rank failed" if errors else f"did not finish within {timeout_s:.0f} s"
            report.append(f"--- ranks {missing} {reason}")
            report += [f"--- rank {rank} stack at the deadline:\n{stacks[rank]}"
                       for rank in missing if stacks.get(rank, "").strip()]
        raise RankFailure(f"{fn.__name__} failed on {world_size} ranks\n" + "\n".join(report))
    return [pickle.loads(outcomes[rank][1]) for rank in range(world_size)]


def train_reference(cfg, seed: int, batches, steps: int, lr: float, max_grad_norm: float = 1.0,
                    adam_eps: float | None = None, mask_targets=None, bias_update_rate: float = 0.0,
                    make_optimizer=None) -> dict:
    """The ground truth of the equality tests: one GPT on one device, each step's whole global batch
    in one piece, its loss the mean over every target of that batch that is not IGNORE_INDEX.

    Returns the loss of every step, the gradients of step 0 before clipping ("grads") and after it
    ("clipped_grads"), those of the last step ("last_grads", "last_clipped_grads") and every step's
    clipped ones ("every_clipped_grads"), the parameters after the last step, and the gradient norm
    of every step (so a test can check that clipping acted). `make_optimizer(model)` builds the
    optimizer (default: the shared AdamW at `lr`). `adam_eps` overrides AdamW's eps (its groups':
    those with an "eps") for tests that must damp rounding noise (see their docstrings); the
    distributed run under test must then use the same.
    `mask_targets(step, targets)` returns a step's global targets with some set to IGNORE_INDEX
    (e.g. ``ignore_targets``); the distributed run then trains on ``masked_step_batch``.

    With experts, the balancing losses are optimised with the cross-entropy (attached inside the
    model) and returned per step, summed over layers ("aux_losses", "z_losses"); after each
    optimizer step every MoE layer moves its router bias by `bias_update_rate` (0: never) from its
    own load, and "router_biases" holds each step's biases after that move ({buffer name: tensor}).
    """
    from picotron_like.model import GPT
    from picotron_like.moe import moe_layers
    from picotron_like.train import build_optimizer, clip_grad_norm_, optimizer_step

    model = GPT(cfg, seed=seed)
    optimizer = build_optimizer(model, lr) if make_optimizer is None else make_optimizer(model)
    if adam_eps is not None:
        for group in optimizer.param_groups:
            if "eps" in group:
                group["eps"] = adam_eps
    moe = moe_layers(model)
    losses, norms, grads, clipped_grads, every_clipped_grads = [], [], {}, {}, []
    aux_losses, z_losses, router_biases = [], [], []
    for step in range(steps):
        window = batches.global_batch(step)
        targets = window[:, 1:] if mask_targets is None else mask_targets(step, window[:, 1:].clone())
        loss = model(window[:, :-1], targets)
        loss.backward()
        if step == 0:
            grads = {name: p.grad.clone() for name, p in model.named_parameters()}
        last_grads = {name: p.grad.clone() for name, p in model.named_parameters()}
        norm = clip_grad_norm_(model.parameters(), max_grad_norm)
        norms.append(norm.item())
        if step == 0:
            clipped_grads = {name: p.grad.clone() for name, p in model.named_parameters()}
        last_clipped_grads = {name: p.grad.clone() for name, p in model.named_parameters()}
        every_clipped_grads.append(last_clipped_grads)
        optimizer_step(optimizer, norm)
        optimizer.zero_grad()
        losses.append(loss.item())
        aux_losses.append(sum((layer.last_aux_loss.item() for layer in moe), 0.0))
        z_losses.append(sum((layer.last_z_loss.item() for layer in moe), 0.0))
        if bias_update_rate:
            for layer in moe:
                layer.update_router_bias(bias_update_rate, layer.expert_load)
        router_biases.append({name: b.clone() for name, b in model.named_buffers() if name.endswith("router_bias")})
    params = {name: p.detach().clone() for name, p in model.named_parameters()}
    return {"losses": losses, "grads": grads, "clipped_grads": clipped_grads, "last_grads": last_grads,
            "last_clipped_grads": last_clipped_grads, "every_clipped_grads": every_clipped_grads, "params": params,
            "norms": norms,
            "aux_losses": aux_losses, "z_losses": z_losses, "router_biases": router_biases}


def ignore_targets(step: int, targets, ignored_rows=()):
    """Mask a step's global targets [sequences, seq_len] the way fine-tuning data does.

    Row r ignores its first (3 r + 5 step) % seq_len targets, as if they were a prompt: every rank and
    every micro-batch then holds a different number of targets, and the numbers change each step.
    The rows in `ignored_rows` ignore every target (a micro-batch of padding). Returns `targets`,
    masked in place. Bind `ignored_rows` with functools.partial to pass it as `mask_targets`.
    """
    from picotron_like.loss import IGNORE_INDEX

    seq_len = targets.shape[1]
    for row in range(targets.shape[0]):
        targets[row, : (3 * row + 5 * step) % seq_len] = IGNORE_INDEX
    targets[list(ignored_rows)] = IGNORE_INDEX
    return targets


def masked_step_batch(batches, step: int, dp_rank: int, mask_targets):
    """``batches.step_batch(step, dp_rank)`` cut from the global batch whose targets
    `mask_targets(step, targets)` masked: the same rows and micro-batches, and n_targets counted
    over the whole masked global batch, as the reference (train_reference) sees it."""
    from picotron_like.data import StepBatch
    from picotron_like.loss import IGNORE_INDEX

    targets = mask_targets(step, batches.global_batch(step)[:, 1:].clone())
    M, A = batches.shape.micro_batch_size, batches.grad_accum_at(step)     # a batch-size ramp's count
    first = dp_rank * M * A     # this rank's rows of the global batch, as TokenBatches cuts them
    # A copy per micro-batch, as TokenBatches hands out: a view would keep the whole global batch's
    # targets alive in what autograd saves (the activation meters count storages).
    micro_batches = [(inputs, targets[first + a * M: first + (a + 1) * M].clone())
                     for a, (inputs, _) in enumerate(batches.micro_batches(step, dp_rank))]
    return StepBatch(micro_batches, int((targets != IGNORE_INDEX).sum()))


def torchrun_workers_by_rank(parent: int) -> dict[int, int]:
    """torchrun_workers keyed by the RANK torchrun gave each (read from its environment), so that a
    test can signal one chosen rank."""
    ranks = {}
    for pid in torchrun_workers(parent):
        with open(f"/proc/{pid}/environ") as file:
            environment = dict(entry.split("=", 1) for entry in file.read().split("\0") if "=" in entry)
        ranks[int(environment["RANK"])] = pid
    return ranks


class HostReads(TorchFunctionMode):
    """Counts, while entered, the calls that make the host wait for a GPU's work to finish: reads
    of values (item, tolist, a tensor used as a Python bool or number, a copy to the CPU) and
    operations whose output size depends on the values (nonzero, bincount, unique, a boolean mask,
    repeat_interleave without its output_size). On a CPU nothing waits, but the same calls are made
    in the same places: counting them tells what a GPU would wait for, without a GPU
    (benchmarks/count_host_syncs.py counts the real waits on one). The optimizers' own reads are
    left out: they read their step counters, which live on the CPU unless the optimizer is fused,
    and a fused one (lesson 07 on CUDA) reads nothing. `sites` holds each call as (function,
    "file:function" of the innermost code of this repository that made it)."""

    VALUE_READS = {"item", "tolist", "numpy", "cpu", "__bool__", "__int__", "__float__", "__index__", "nonzero",
                   "argwhere", "bincount", "unique", "unique_consecutive", "masked_select"}

    def __init__(self):
        super().__init__()
        self.sites: list[tuple[str, str]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if (name in self.VALUE_READS or self._sized_by_values(name, args, kwargs)) and args \
                and isinstance(args[0], torch.Tensor):
            stack = traceback.extract_stack()[:-1]
            if f"torch{os.sep}optim{os.sep}" not in stack[-1].filename:
                ours = [frame for frame in stack if frame.filename.startswith(str(REPO_ROOT))
                        and "site-packages" not in frame.filename and not frame.filename.endswith("testing.py")]
                self.sites.append((name, f"{Path(ours[-1].filename).name}:{ours[-1].name}" if ours else "?"))
        return func(*args, **kwargs)

    @staticmethod
    def _sized_by_values(name: str, args, kwargs) -> bool:
        if name == "repeat_interleave":
            repeats = args[1] if len(args) > 1 else kwargs.get("repeats")
            return isinstance(repeats, torch.Tensor) and kwargs.get("output_size") is None
        if name == "__getitem__":
            index = args[1] if len(args) > 1 else None
            parts = index if isinstance(index, tuple) else (index,)
            return any(isinstance(part, torch.Tensor) and part.dtype == torch.bool for part in parts)
        return False


# ----------------------------------------------------------------------------- the collective sequence check


class CollectiveMismatch(AssertionError):
    """Members of a group issued different collectives: under NCCL a silent corruption or a hang."""


@dataclass(frozen=True)
class Collective:
    """One collective as one rank issued it (comm.call or comm.bookkeeping). The members of its
    group must issue the same `agreed` at the same position of the group's sequence; an
    all-to-all's `sizes` is its elements per row, and its splits must instead be transposes (what
    rank i sends to rank j is what j expects from i); a point-to-point transfer pairs with its
    peer's, in order."""

    kind: str
    dtypes: tuple[str, ...]
    sizes: tuple[int, ...]          # elements of each tensor argument (a list of tensors: their sum)
    detail: str                     # the reduce op, a broadcast's source
    device: str | None              # the tensors' device type; None for a barrier
    bookkeeping: bool               # comm.bookkeeping: CPU tensors beside NCCL by design
    site: str                       # the innermost file:line of this repository that issued it
    splits: tuple | None = None     # all-to-all: (input splits, output splits) in group-rank order
    peer: int | None = None         # point-to-point: the peer's global rank

    @property
    def agreed(self) -> tuple:
        return self.kind, self.dtypes, self.sizes, self.detail, self.device

    def __str__(self) -> str:
        text = f"{self.kind} {'/'.join(self.dtypes) or '-'} x{'/'.join(map(str, self.sizes)) or '-'}"
        if self.splits is not None:
            text += f" (elements per row) input splits {list(self.splits[0])} output splits {list(self.splits[1])}"
        text += f"{' ' + self.detail if self.detail else ''} on {self.device or '-'} at {self.site}"
        return text + (" (bookkeeping)" if self.bookkeeping else "")


_OPTIONS_NOT_AGREED = {"group", "async_op", "output_split_sizes", "input_split_sizes"}
_REDUCING = {"all_reduce", "reduce_scatter_single", "reduce_scatter"}


class CollectiveLog:
    """Every collective this rank issued while a check is on, per process group (its members and
    torch's name for it: one communicator), and each point-to-point transfer per (group, sender,
    receiver). Filled by comm's call path; `check()` gathers every rank's log and compares."""

    def __init__(self, run_device: str = "cpu"):
        self.run_device = run_device        # "cuda": the step's collectives must move no CPU tensor
        self.sequences: dict[tuple, list[Collective]] = {}
        self.transfers: dict[tuple, list[Collective]] = {}     # ("send" | "recv", group key, src, dst)
        self.names: dict[tuple, str] = {}
        self.gathered: list[dict] = []      # every rank's log, once checked
        self._keys: dict = {}
        # torch numbers each group's collectives (gloo and NCCL alike): the count since now must
        # equal what went through comm, or some collective bypassed it and escaped the check.
        self._numbered_from = {group: group._get_sequence_number_for_group() for group in _process_groups()}

    def _key(self, group) -> tuple:
        """(torch's name of the process group, its members): one communicator. Axes that share it
        (comm.AxisGroup) share its sequence, as they share its order on NCCL; `names` joins theirs."""
        key, name = self._key_of(comm.process_group(group)), comm.group_name(group)
        if name not in self.names.get(key, "").split("/"):
            self.names[key] = f"{self.names[key]}/{name}" if key in self.names else name
        return key

    def _key_of(self, process_group) -> tuple:
        process_group = dist.group.WORLD if process_group is None else process_group
        if process_group not in self._keys:
            self._keys[process_group] = (process_group.group_name, tuple(dist.get_process_group_ranks(process_group)))
        return self._keys[process_group]

    def add(self, collective, args, kwargs, bookkeeping: bool = False) -> None:
        if collective is dist.batch_isend_irecv:
            for op in args[0]:
                self._add_transfer(op.op.__name__, op.tensor, op.peer, getattr(op, "axis", op.group), bookkeeping)
            return
        kind = comm._KIND_NAMES.get(collective.__name__, collective.__name__)
        group = kwargs.get("group")
        if kind in ("send", "isend", "recv", "irecv"):
            peer = args[1] if len(args) > 1 else kwargs.get("dst", kwargs.get("src"))
            self._add_transfer(kind, args[0], peer, group, bookkeeping)
            return
        described = [_describe(arg) for arg in args if isinstance(arg, (torch.Tensor, list, tuple))]
        options = {name: value for name, value in kwargs.items() if name not in _OPTIONS_NOT_AGREED}
        if kind in _REDUCING:
            options.setdefault("op", dist.ReduceOp.SUM)
        options.update((f"arg{index}", arg) for index, arg in enumerate(args)
                       if not isinstance(arg, (torch.Tensor, list, tuple)) and kind != "all_to_all_single")
        detail = " ".join(f"{name}={getattr(value, 'name', value)}" for name, value in sorted(options.items()))
        splits = None
        if kind == "all_to_all_single":
            output, input_ = args[0], args[1]
            n = dist.get_world_size(comm.process_group(group))
            given_out = args[2] if len(args) > 2 else kwargs.get("output_split_sizes")
            given_in = args[3] if len(args) > 3 else kwargs.get("input_split_sizes")
            splits = (tuple(given_in or [input_.shape[0] // n] * n), tuple(given_out or [output.shape[0] // n] * n))
            described = [(str(input_.dtype).removeprefix("torch."), math.prod(input_.shape[1:]), input_.device.type)]
        key = self._key(group)
        self.sequences.setdefault(key, []).append(Collective(
            kind, tuple(d[0] for d in described), tuple(d[1] for d in described), detail,
            described[0][2] if described else None, bookkeeping, _call_site(), splits))

    def _add_transfer(self, kind, tensor, peer, group, bookkeeping) -> None:
        key, me = self._key(group), dist.get_rank()
        sending = kind in ("send", "isend")
        transfer = Collective(kind, (str(tensor.dtype).removeprefix("torch."),), (tensor.numel(),), "",
                              tensor.device.type, bookkeeping, _call_site(), peer=peer)
        self.transfers.setdefault(("send" if sending else "recv", key, *((me, peer) if sending else (peer, me))),
                                  []).append(transfer)

    def check(self) -> None:
        """Gather every rank's log (a collective over the world: every rank calls it) and raise
        CollectiveMismatch on every rank if any group's members disagree; rank 0's message says
        where."""
        bypassed = self._bypassed()
        self.gathered = [None] * dist.get_world_size()
        dist.all_gather_object(self.gathered, {"sequences": self.sequences, "transfers": self.transfers,
                                               "names": self.names, "bypassed": bypassed})
        problems = sequence_mismatches(self.gathered, self.run_device)
        if problems:
            raise CollectiveMismatch("\n".join(problems) if dist.get_rank() == 0 else
                                     "the ranks' collective sequences differ: rank 0's error says where")

    def _bypassed(self) -> list[str]:
        """The groups on which torch numbered more (or fewer) calls than this log holds."""
        seen = {}
        for key, calls in self.sequences.items():
            seen[key] = seen.get(key, 0) + sum(_TORCH_CALLS.get(call.kind, 1) for call in calls)
        for (_, key, *_), transfers in self.transfers.items():
            seen[key] = seen.get(key, 0) + len(transfers)
        found = []
        for group in _process_groups():
            numbered = group._get_sequence_number_for_group() - self._numbered_from.get(group, 0)
            key = self._key_of(group)
            if numbered != seen.get(key, 0):
                name = self.names.get(key, comm.group_name(group))
                found.append(f"rank {dist.get_rank()}: torch numbered {numbered} calls on group {name} "
                             f"(ranks {', '.join(map(str, key[1]))}) where comm saw {seen.get(key, 0)}: some "
                             f"collective bypassed comm.call and comm.bookkeeping, and this check")
        return found


# The object collectives are two calls each: the sizes of the pickled objects, then the bytes.
_TORCH_CALLS = {"all_gather_object": 2, "broadcast_object_list": 2}


def _process_groups() -> list:
    """This rank's process groups (torch's registry: a private name, present since torch 1.13)."""
    return list(dist.distributed_c10d._world.pg_map)


def _describe(arg) -> tuple[str, int, str | None]:
    """(dtype, elements, device type) of a tensor argument; a list counts its tensors' elements
    together, or its objects (all_gather_object, broadcast_object_list)."""
    if isinstance(arg, torch.Tensor):
        return str(arg.dtype).removeprefix("torch."), arg.numel(), arg.device.type
    tensors = [item for item in arg if isinstance(item, torch.Tensor)]
    if not tensors:
        return "object", len(arg), None
    return str(tensors[0].dtype).removeprefix("torch."), sum(t.numel() for t in tensors), tensors[0].device.type


def _call_site() -> str:
    """The innermost file:line of this repository's own code that issued the collective."""
    frame = sys._getframe(2)
    while frame is not None:
        filename = frame.f_code.co_filename
        if filename.startswith(_REPO) and not filename.endswith(_SKIPPED_FILES):
            return f"{Path(filename).name}:{frame.f_lineno}"
        frame = frame.f_back
    return "?"


_REPO = str(REPO_ROOT)
_SKIPPED_FILES = (f"picotron_like{os.sep}comm.py", f"picotron_like{os.sep}testing.py")


def sequence_mismatches(logs: list[dict], run_device: str = "cpu") -> list[str]:
    """What is wrong in the ranks' gathered logs (CollectiveLog.check), at most one line-block per
    group: the first position where a member's collective differs from the lowest member's, an
    all-to-all whose splits are not transposes, a point-to-point transfer its peer does not
    match; and, when the run's device is "cuda", a collective of the step (not bookkeeping) that
    moved CPU tensors (gloo would take it while its peers wait in NCCL)."""
    problems = [problem for log in logs for problem in log.get("bypassed", [])]
    names = {key: name for log in logs for key, name in log["names"].items()}
    for key in sorted({key for log in logs for key in log["sequences"]}):
        members, where = key[1], f"group {names[key]} (ranks {', '.join(map(str, key[1]))})"
        sequences = {rank: logs[rank]["sequences"].get(key, []) for rank in members}
        first = members[0]
        for position in range(max(len(sequence) for sequence in sequences.values())):
            issued = {rank: sequence[position] if position < len(sequence) else None
                      for rank, sequence in sequences.items()}
            odd = next((rank for rank in members
                        if (issued[rank] and issued[rank].agreed) != (issued[first] and issued[first].agreed)), None)
            if odd is not None:
                problems.append(f"collective sequences differ on {where} at call {position}:\n"
                                + _issued_line(first, issued[first], sequences[first])
                                + _issued_line(odd, issued[odd], sequences[odd]))
                break
            if issued[first].splits is not None:
                wrong = _not_transposed(members, issued)
                if wrong:
                    problems.append(f"all-to-all splits are not transposes on {where} at call {position}: {wrong}\n"
                                    + "".join(_issued_line(rank, issued[rank], []) for rank in members))
                    break
    for (_, key, src, dst), sent in sorted(((k, v) for log in logs for k, v in log["transfers"].items()
                                                    if k[0] == "send"), key=lambda item: item[0][1:]):
        received = logs[dst]["transfers"].get(("recv", key, src, dst), [])
        for position in range(max(len(sent), len(received))):
            ours = sent[position] if position < len(sent) else None
            theirs = received[position] if position < len(received) else None
            if ours is None or theirs is None or (ours.dtypes, ours.sizes) != (theirs.dtypes, theirs.sizes):
                problems.append(f"point-to-point transfers differ on group {names[key]} from rank {src} to rank "
                                f"{dst} at transfer {position}:\n  rank {src} sends    {ours or 'nothing'}\n"
                                f"  rank {dst} receives {theirs or 'nothing'}")
                break
    if run_device == "cuda":
        for rank, log in enumerate(logs):
            streams = [(key, sequence) for key, sequence in sorted(log["sequences"].items())]
            streams += [(key[1], sequence) for key, sequence in sorted(log["transfers"].items())]
            for key, sequence in streams:
                on_cpu = next(((position, call) for position, call in enumerate(sequence)
                               if call.device == "cpu" and not call.bookkeeping), None)
                if on_cpu:
                    problems.append(f"rank {rank} moves a CPU tensor in a CUDA run on group {names[key]} at call "
                                    f"{on_cpu[0]}: {on_cpu[1]}; gloo would run it while the group's other ranks "
                                    f"wait in NCCL")
    return problems


def _issued_line(rank: int, collective: Collective | None, sequence: list) -> str:
    return f"  rank {rank}: {collective or f'nothing (its sequence ends after {len(sequence)} calls)'}\n"


def _not_transposed(members: tuple, issued: dict) -> str:
    for i, sender in enumerate(members):
        for j, receiver in enumerate(members):
            sends, expects = issued[sender].splits[0][j], issued[receiver].splits[1][i]
            if sends != expects:
                return (f"rank {sender} sends {sends} rows to rank {receiver} (its input_split_sizes[{j}]) but rank "
                        f"{receiver} expects {expects} from it (its output_split_sizes[{i}])")
    return ""


@contextmanager
def collective_sequences_checked(run_device: str = "cpu"):
    """Record every collective issued inside, then check that every member of every group issued
    the same ones (CollectiveLog.check): every rank enters and leaves it together. Left by an
    exception, it checks nothing (the other ranks may be waiting in a collective).

    Why: NCCL trusts each rank. A member that reduces another count or dtype, with another op,
    sends all-to-all splits its peers do not expect, or issues one collective more, makes NCCL
    sum garbage or hang; gloo raises on some of these (a size it did not expect) and lets the
    others through (the same bytes as another dtype, another reduce op, a receive longer than
    its send: tests/test_collective_sequences.py). The check compares, per communicator and in
    order: kind, dtypes, element counts, the reduce op and a broadcast's source; all-to-all
    splits as transposes (rank i's input_split_sizes[j] == rank j's output_split_sizes[i]);
    each send with its peer's receive. It counts against torch's own numbering of each group's
    calls, so a collective that bypasses comm is reported too. With `run_device` "cuda" it also
    fails a collective that moved CPU tensors outside comm.bookkeeping: on a `cpu:gloo,cuda:nccl`
    group gloo would run it while the peers wait in NCCL (an empty rank's gradient norm).

    torch's TORCH_DISTRIBUTED_DEBUG=DETAIL (RankChecks(distributed_debug_detail=True), or
    `tools/fuzz_layouts.py --detail`) wraps each group so that every collective first gathers a
    fingerprint (op type, dtypes, shapes, devices) over a gloo group and raises on the first
    mismatch, before the collective runs: it catches a wrong count, dtype or an extra barrier
    where it happens, with a traceback, and works under NCCL too, where the mismatch would
    otherwise hang. It does not compare the reduce op, all-to-all splits (uneven shapes are
    legal) or point-to-point transfers. It compares each group's call numbers too, and gloo
    numbers transfers: on a pipeline of 3 or more stages, where a middle stage posts more
    transfers than the ends, it fails a correct run at its next collective on the pipeline group
    (measured; tools/fuzz_layouts.py --detail leaves those draws out). And it costs a gloo
    all-gather and a host wait per collective (a 4 KB all-reduce on two CPU ranks: 4.2x the
    time, measured), so it serves a debugging run, not a GPU run that is timed. This check costs
    a Python record per call and one gather at the end."""
    log, previous = CollectiveLog(run_device), comm.meter.log
    comm.meter.log = log
    try:
        yield log
    finally:
        comm.meter.log = previous
    log.check()
