"""
Lesson 06's ZeRO stages against PyTorch's FSDP2 and DDP: step time and peak memory, one torchrun run.

    torchrun --standalone --nproc_per_node=4 benchmarks/zero_vs_fsdp.py              # ~2 min on 2 cores
    torchrun --standalone --nproc_per_node=8 benchmarks/zero_vs_fsdp.py --preset 1b --seq-len 2048 \\
        --micro-batch-size 2 --grad-accum 2 --steps 5 --repeats 3                    # one 8-GPU node

Every variant trains the same reference GPT (same preset, seed and initial weights) with AdamW
(build_optimizer's), clipping at --max-grad-norm, on the same micro-batches, with the same
token-weighted loss; dp = the world size. The script checks that every variant reports the same
loss on its first step (float32) before it trusts the times.

    ours DDP          lesson 01's BucketedDataParallel (25 MB buckets), AdamW on every rank
    torch DDP         DistributedDataParallel, gradient_as_bucket_view=True (no second gradient copy)
    ours ZeRO-0..3    lesson 06: wrap_zero(stage); ZeRO-3 with prefetch, without, and kept gathered
    FSDP2             fully_shard on every block and on the root, reshard_after_forward True / False,
                      accumulation with set_requires_gradient_sync (as lesson 06's test does)

What is timed: whole optimizer steps (forward and backward of every micro-batch, the gradient
reduction, clipping, the optimizer step, zeroing). Each round builds every variant in turn, runs
--warmup untimed steps, then --steps timed steps between barriers, measures the memory of one more
step, and drops the variant before the next is built: variants take turns, so a change in the
machine's load hits them alike, and only one variant's memory exists at a time. Printed: the median
over the rounds of rank 0's wall time per step (fastest and slowest round beside it), the CPU time
of a step summed over the ranks (waiting costs none: the work, much less disturbed by other jobs),
and the ratios to FSDP2 with the same resharding (ZeRO-3, prefetch) or to FSDP2 kept gathered
(ZeRO-0..2 and DDP, which keep the weights whole as well).

Peak memory per rank:
  CUDA   torch.cuda.max_memory_allocated over the measured step, minus what was allocated before
         the variant was built: everything the variant holds and allocates (activations, buckets,
         communication buffers, the allocator's rounding included).
  CPU    there is no allocator to ask, so the model states are measured as lesson 06 does: the bytes
         of every storage held once the gradients are reduced, at the optimizer step (weights or
         their shards, gradients or their shards, float32 master, Adam's moments), each storage
         counted once; plus, for the variants whose weights are sharded (ZeRO-3, FSDP2), the most
         gathered weight bytes alive at once, sampled at every tensor autograd saves (forward) and
         reads back (backward). Not counted on CPU: activations (the same for every variant), the
         per-parameter gradients autograd produces before a hook moves them into a flat buffer or a
         reduce-scatter, the reduce-scatter's input, and torch DDP's and FSDP2's internal buffers.
"""

import argparse
import gc
import os
import statistics
import time
from contextlib import nullcontext

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from picotron_like import comm
from picotron_like.data import TokenBatches, builtin_corpus_paths
from picotron_like.lessons import load_lesson
from picotron_like.metrics import log0
from picotron_like.model import GPT
from picotron_like.topology import GridShape, ProcessGrid, init_distributed, shutdown
from picotron_like.train import (StepSettings, add_training_flags, autocast_dtype, batch_shape, build_optimizer,
                                 config_from_flags, resolve_steps)

data_parallel = load_lesson("01_data_parallel")
zero = load_lesson("06_zero")


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_training_flags(parser, seq_len=128, micro_batch_size=4, grad_accum=2, steps=3)
    parser.add_argument("--reduce-dtype", choices=("auto", "float32", "bfloat16"), default="float32",
                        help="gradient reduction dtype of ZeRO and FSDP2 (auto: that of --dtype); lesson 06's default")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps per variant and round")
    parser.add_argument("--repeats", type=int, default=3, help="rounds; the median is reported")
    parser.add_argument("--only", nargs="*", default=None, help="run only the variants whose name contains one of these")
    args = parser.parse_args()
    resolve_steps(args)
    return args


# ----------------------------------------------------------------------------- storages, counted once


def local(tensor):
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def storage_bytes(tensors, seen: set) -> int:
    total = 0
    for tensor in tensors:
        storage = local(tensor).untyped_storage()
        if storage.nbytes() and storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total


def plain_model_states(module, optimizer) -> int:
    """Weights (their local shards for DTensors), gradients and the optimizer's tensors."""
    seen, params = set(), list(module.parameters())
    states = [v for state in optimizer.state.values() for v in state.values() if torch.is_tensor(v) and v.dim()]
    return (storage_bytes(params, seen) + storage_bytes([p.grad for p in params if p.grad is not None], seen)
            + storage_bytes(states, seen))


def fsdp2_gather_buffers(module) -> list:
    """FSDP2's all-gather buffers: a unit's flat all-gather output while the gather is pending (a
    prefetch), then its per-parameter outputs (freed by resizing their storage to 0), which FSDP2
    swaps into the modules only when the unit computes: the modules alone would miss a prefetch.
    These are FSDP2 internals (torch 2.13): a benchmark may look, a lesson would not."""
    buffers = []
    for sub in module.modules():
        state = sub._get_fsdp_state() if hasattr(sub, "_get_fsdp_state") else None
        for group in getattr(state, "_fsdp_param_groups", []):
            buffers += [t for fsdp_param in group.fsdp_params for t in fsdp_param.all_gather_outputs]
            if group._all_gather_result is not None:
                buffers.append(group._all_gather_result.all_gather_output)
    return buffers


class GatheredWeights:
    """The most bytes of whole (not DTensor, not empty) weights alive at once, sampled at every
    saved and reused activation: what the modules point at (FSDP2 swaps its unsharded parameters
    in for compute, lesson 06's ZeRO-3 points them into gathered unit buffers) and FSDP2's
    all-gather outputs, each storage counted once."""

    def __init__(self, module):
        self.module, self.modules = module, list(module.modules())
        self.peak_bytes = 0

    def _sample(self, tensor):
        params = fsdp2_gather_buffers(self.module)
        for module in self.modules:
            params += [p for p in module._parameters.values() if p is not None and not hasattr(p, "to_local")]
        self.peak_bytes = max(self.peak_bytes, storage_bytes(params, set()))
        return tensor

    def __enter__(self):
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._sample, self._sample)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self._hooks.__exit__(*exc)
        return False


# ----------------------------------------------------------------------------- the variants


class Variant:
    """A built model: `step(batch) -> loss`, `states()` (CPU model-state bytes at the optimizer step),
    the module to sample gathered weights on, and whether its weights are sharded."""

    def __init__(self, step, module, optimizer, states, sharded: bool):
        self.step, self.module, self.sharded = step, module, sharded
        self.states_bytes = 0

        def record(*_):
            self.states_bytes = states()
        optimizer.register_step_post_hook(record)


def ours_ddp(cfg, args, grid, device, compute_dtype):
    model = data_parallel.wrap_data_parallel(GPT(cfg, seed=args.seed).to(device), grid.dp_group, "bucketed", 25 * 2**20)
    optimizer = build_optimizer(model.module, args.lr)
    settings = StepSettings(device, compute_dtype, args.max_grad_norm)
    return Variant(lambda batch: data_parallel.train_step(model, optimizer, batch, settings).loss, model.module,
                   optimizer, lambda: plain_model_states(model.module, optimizer), sharded=False)


def ours_zero(stage, reshard=True, prefetch=True):
    def build(cfg, args, grid, device, compute_dtype):
        precision = zero.precision_from_flags(args.dtype, args.reduce_dtype, device)
        model = zero.wrap_zero(GPT(cfg, seed=args.seed).to(device), grid.dp_group, stage, precision, reshard, prefetch)
        optimizer = zero.build_sharded_optimizer(model, args.lr)
        settings = zero.step_settings(device, precision, args.max_grad_norm)
        return Variant(lambda batch: zero.train_step(model, optimizer, batch, settings).loss, model.module, optimizer,
                       lambda: zero.measured_model_states(model, optimizer).total, sharded=stage == 3)
    return build


def torch_step(model, optimizer, args, device, compute_dtype, before_micro_batch):
    """The reference step for PyTorch's wrappers: both average gradients over the ranks, so each
    share of the global mean is scaled by the world size first (exact at a power of two)."""
    world = dist.get_world_size()

    def step(batch):
        loss = torch.zeros((), device=device)
        for index, micro_batch in enumerate(batch.micro_batches):
            last = index == len(batch.micro_batches) - 1
            with before_micro_batch(last), torch.autocast(device.type, dtype=compute_dtype,
                                                          enabled=compute_dtype != torch.float32):
                share = model(*(t.to(device) for t in micro_batch), reduction="sum") / batch.n_targets
            (share * world).backward()
            loss += share.detach().float()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
        optimizer.step()
        optimizer.zero_grad()
        dist.all_reduce(loss)
        return loss.item()
    return step


def torch_ddp(cfg, args, grid, device, compute_dtype):
    model = DistributedDataParallel(GPT(cfg, seed=args.seed).to(device), process_group=comm.process_group(grid.dp_group),
                                    gradient_as_bucket_view=True)
    optimizer = build_optimizer(model.module, args.lr)
    no_sync = lambda last: nullcontext() if last else model.no_sync()  # noqa: E731
    return Variant(torch_step(model, optimizer, args, device, compute_dtype, no_sync), model.module, optimizer,
                   lambda: plain_model_states(model.module, optimizer), sharded=False)


def fsdp2(reshard: bool):
    def build(cfg, args, grid, device, compute_dtype):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        precision = zero.precision_from_flags(args.dtype, args.reduce_dtype, device)
        policy = MixedPrecisionPolicy(param_dtype=precision.param_dtype, reduce_dtype=precision.reduce_dtype)
        mesh = init_device_mesh(device.type, (dist.get_world_size(),))
        model = GPT(cfg, seed=args.seed).to(device)
        for block in model.layers:
            fully_shard(block, mesh=mesh, reshard_after_forward=reshard, mp_policy=policy)
        fully_shard(model, mesh=mesh, reshard_after_forward=reshard, mp_policy=policy)
        optimizer = build_optimizer(model, args.lr)

        def sync(last):
            model.set_requires_gradient_sync(last)
            return nullcontext()
        # FSDP2 computes in param_dtype itself: no autocast on top.
        return Variant(torch_step(model, optimizer, args, device, torch.float32, sync), model, optimizer,
                       lambda: plain_model_states(model, optimizer), sharded=True)
    return build


VARIANTS = {
    "ours DDP (lesson 01)": ours_ddp,
    "torch DDP": torch_ddp,
    "ours ZeRO-0": ours_zero(0),
    "ours ZeRO-1": ours_zero(1),
    "ours ZeRO-2": ours_zero(2),
    "ours ZeRO-3": ours_zero(3),
    "ours ZeRO-3 no prefetch": ours_zero(3, prefetch=False),
    "ours ZeRO-3 kept gathered": ours_zero(3, reshard=False),
    "FSDP2 reshard": fsdp2(True),
    "FSDP2 kept gathered": fsdp2(False),
}
# What each variant's ratio is taken against: FSDP2 at the same weight memory.
AGAINST = {name: "FSDP2 reshard" if name in ("ours ZeRO-3", "ours ZeRO-3 no prefetch") else "FSDP2 kept gathered"
           for name in VARIANTS}


# ----------------------------------------------------------------------------- timing and memory


def synchronize(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_round(build, cfg, args, grid, device, compute_dtype, batches, first_step: int) -> dict:
    """Build, warm up, time --steps steps, measure one more; the variant is dropped on return."""
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
    variant = build(cfg, args, grid, device, compute_dtype)
    step = first_step
    first_loss = variant.step(batches.step_batch(step, grid.dp_rank))
    for step in range(first_step + 1, first_step + args.warmup):
        variant.step(batches.step_batch(step, grid.dp_rank))
    synchronize(device)
    dist.barrier()
    start, start_cpu = time.perf_counter(), time.process_time()
    for step in range(step + 1, step + 1 + args.steps):
        variant.step(batches.step_batch(step, grid.dp_rank))
    synchronize(device)
    dist.barrier()
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - start_cpu
    with GatheredWeights(variant.module) as gathered:
        variant.step(batches.step_batch(step + 1, grid.dp_rank))
    synchronize(device)
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device) - before
    else:
        peak = variant.states_bytes + (gathered.peak_bytes if variant.sharded else 0)
    del variant
    gc.collect()
    return {"seconds": seconds / args.steps, "cpu": cpu_seconds / args.steps, "peak": peak, "loss": first_loss}


def summed_over_ranks(value: float) -> float:
    total = torch.tensor(value, dtype=torch.float64)
    dist.all_reduce(total)
    return total.item()


def log_load_average(when: str) -> None:
    log0("load average " + when + ": " + ", ".join(f"{value:.2f}" for value in os.getloadavg()) + " (1, 5, 15 min)")


def main():
    args = parse_args()
    device = init_distributed()
    grid = ProcessGrid(GridShape(dp=dist.get_world_size()))
    cfg = config_from_flags(args)
    shape = batch_shape(args, grid.dp_size)
    batches = TokenBatches(args.data or builtin_corpus_paths()[0], shape, seed=args.seed, vocab_size=cfg.vocab_size)
    compute_dtype = autocast_dtype(args.dtype, device)
    variants = {name: build for name, build in VARIANTS.items()
                if args.only is None or any(word in name for word in args.only)}
    log0(f"{args.preset}: {sum(p.numel() for p in GPT(cfg).parameters()):,} parameters, dp = {grid.dp_size} "
         f"({device.type}), {shape.tokens_per_step:,} tokens per step ({shape.grad_accum} micro-batches of "
         f"{shape.micro_batch_size} x {shape.seq_len} per rank), compute {compute_dtype}, {args.repeats} rounds of "
         f"{args.warmup} warm-up + {args.steps} timed steps")
    log_load_average("at the start")
    results = {name: [] for name in variants}
    steps_per_round = args.warmup + args.steps + 1
    for round_index in range(args.repeats):
        for name, build in variants.items():
            results[name].append(run_round(build, cfg, args, grid, device, compute_dtype, batches,
                                           round_index * steps_per_round))
    log_load_average("at the end")

    summary = {}
    for name, rounds in results.items():
        times = [r["seconds"] for r in rounds]
        summary[name] = {"median": statistics.median(times), "fastest": min(times), "slowest": max(times),
                         "cpu": summed_over_ranks(statistics.median(r["cpu"] for r in rounds)),
                         "peak": max(r["peak"] for r in rounds), "loss": rounds[0]["loss"]}
    memory = "peak MB (cuda allocator)" if device.type == "cuda" else "peak MB (states + gathered)"
    log0(f"\n{'variant':<27}{'first loss':>11}{'ms / step':>11}{'(fastest - slowest)':>22}{'CPU ms':>9}"
         f"{memory:>29}{'against':>22}{'time ratio':>11}{'CPU ratio':>10}{'memory ratio':>13}")
    for name, s in summary.items():
        theirs = summary.get(AGAINST[name])
        ratios = ""
        if theirs is not None and theirs is not s:
            ratios = (f"{AGAINST[name]:>22}{s['median'] / theirs['median']:>11.3f}{s['cpu'] / theirs['cpu']:>10.3f}"
                      f"{s['peak'] / theirs['peak']:>13.3f}")
        spread = f"({s['fastest'] * 1e3:.1f} - {s['slowest'] * 1e3:.1f})"
        log0(f"{name:<27}{s['loss']:>11.6f}{s['median'] * 1e3:>11.1f}{spread:>22}{s['cpu'] * 1e3:>9.1f}"
             f"{s['peak'] / 1e6:>29.3f}{ratios}")
    losses = {round(s["loss"], 5) for s in summary.values()}
    if compute_dtype == torch.float32 and len(losses) > 1:
        log0(f"warning: the variants' first losses differ ({sorted(losses)}): they did not train alike")
    shutdown()


if __name__ == "__main__":
    main()
