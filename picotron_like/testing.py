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

The other side of every equality test is here too: ``train_reference`` trains one GPT on one
device; ``ignore_targets`` and ``masked_step_batch`` give both sides the same masked targets.
"""

from __future__ import annotations

import faulthandler
import multiprocessing
import os
import pickle
import queue as queue_module
import shutil
import tempfile
import time
import traceback
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode

from picotron_like.lessons import REPO_ROOT
from picotron_like.topology import torchrun_workers

_context = multiprocessing.get_context("forkserver")
_context.set_forkserver_preload(["torch", "torch.distributed", "numpy", "picotron_like.model"])


class RankFailure(AssertionError):
    """One or more ranks raised, died or hung; the message holds every rank's report."""


def _rank_entry(fn, rank, world_size, workdir, timeout_s, args, kwargs, results):
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
        init_distributed(f"file://{workdir}/store", rank, world_size, timeout_s=max(timeout_s - 10.0, 5.0),
                         device_type="cpu")
        # Pickle here with the plain pickler: the queue's pickler would move tensors through shared
        # memory that this process must keep alive, and it is about to exit.
        results.put((rank, "ok", pickle.dumps(fn(*args, **kwargs))))
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))
    finally:
        faulthandler.cancel_dump_traceback_later()
        results.close()
        results.join_thread()
        # Skip interpreter teardown, where gloo's background thread can abort the process.
        os._exit(0)


def run_ranks(world_size: int, fn, *args, timeout_s: float = 120.0, **kwargs) -> list:
    """Run fn(*args, **kwargs) on `world_size` gloo ranks; return the results in rank order."""
    workdir = tempfile.mkdtemp(prefix="picotron_ranks_")
    results = _context.Queue()
    processes = [
        _context.Process(target=_rank_entry, args=(fn, rank, world_size, workdir, timeout_s, args, kwargs, results),
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
                    adam_eps: float | None = None, mask_targets=None, bias_update_rate: float = 0.0) -> dict:
    """The ground truth of the equality tests: one GPT on one device, each step's whole global batch
    in one piece, its loss the mean over every target of that batch that is not IGNORE_INDEX.

    Returns the loss of every step, the gradients of step 0 before clipping ("grads") and after it
    ("clipped_grads") and those of the last step ("last_grads", "last_clipped_grads"), the parameters after the last step, and the gradient norm of every step (so a
    test can check that clipping acted). `adam_eps` overrides AdamW's eps for tests that must damp
    rounding noise (see their docstrings); the distributed run under test must then use the same.
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
    optimizer = build_optimizer(model, lr)
    if adam_eps is not None:
        for group in optimizer.param_groups:
            group["eps"] = adam_eps
    moe = moe_layers(model)
    losses, norms, grads, clipped_grads = [], [], {}, {}
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
            "last_clipped_grads": last_clipped_grads, "params": params, "norms": norms,
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
    M, A = batches.shape.micro_batch_size, batches.shape.grad_accum
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
