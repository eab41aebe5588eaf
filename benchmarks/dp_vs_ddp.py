"""
Lesson 01's data parallelism against PyTorch's DistributedDataParallel, same model, same batches.

    torchrun --standalone --nproc_per_node=4 benchmarks/dp_vs_ddp.py [--preset tiny --seq-len 128 --steps 10]

Prints tokens/s of naive, bucketed (several bucket sizes) and DDP, and the number of all-reduce
calls per step the meter counted for ours. The point is the order of the variants, not the
absolute numbers: bucketing should approach DDP, naive should trail both.
"""

import argparse
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from picotron_like import comm
from picotron_like.data import TokenBatches, builtin_corpus_paths
from picotron_like.lessons import load_lesson
from picotron_like.metrics import log0
from picotron_like.model import GPT
from picotron_like.topology import GridShape, ProcessGrid, init_distributed, shutdown
from picotron_like.train import (StepSettings, add_training_flags, batch_shape, build_optimizer, config_from_flags,
                                 resolve_steps)


def time_steps(step_fn, steps):
    step_fn(0)  # the first step pays one-off costs
    dist.barrier()
    start = time.perf_counter()
    for step in range(1, steps + 1):
        step_fn(step)
    dist.barrier()
    return (time.perf_counter() - start) / steps


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_training_flags(parser, steps=10)
    args = parser.parse_args()
    resolve_steps(args)
    lesson = load_lesson("01_data_parallel")
    device = init_distributed()
    grid = ProcessGrid(GridShape(dp=dist.get_world_size()))
    cfg = config_from_flags(args)
    shape = batch_shape(args, grid.dp_size)
    batches = TokenBatches(args.data or builtin_corpus_paths()[0], shape, seed=args.seed, vocab_size=cfg.vocab_size)
    settings = StepSettings(device, torch.float32, args.max_grad_norm)
    log0(f"{grid.dp_size} ranks, {shape.tokens_per_step} tokens per step, {args.steps} timed steps")

    for mode, bucket_mb in (("naive", 0), ("bucketed", 0.25), ("bucketed", 1.0), ("bucketed", 25.0)):
        model = lesson.wrap_data_parallel(GPT(cfg, seed=args.seed).to(device), grid.dp_group, mode,
                                          int(bucket_mb * 2**20))
        optimizer = build_optimizer(model.module, args.lr)
        comm.meter.reset()
        seconds = time_steps(lambda step: lesson.train_step(
            model, optimizer, batches.step_batch(step, grid.dp_rank), settings), args.steps)
        calls = comm.meter.get("all_reduce", "dp").calls / (args.steps + 1) - 1  # minus the loss average
        log0(f"ours {mode:<9} bucket {bucket_mb:>5} MB: {shape.tokens_per_step / seconds:>9,.0f} tok/s, "
             f"{calls:.0f} gradient all-reduces per step")

    ddp = DistributedDataParallel(GPT(cfg, seed=args.seed).to(device), process_group=comm.process_group(grid.dp_group))
    optimizer = build_optimizer(ddp.module, args.lr)

    def ddp_step(step):
        micro = batches.micro_batches(step, grid.dp_rank)
        for index, (inputs, targets) in enumerate(micro):
            if index < len(micro) - 1:
                with ddp.no_sync():
                    (ddp(inputs.to(device), targets.to(device)) / len(micro)).backward()
            else:
                (ddp(inputs.to(device), targets.to(device)) / len(micro)).backward()
        torch.nn.utils.clip_grad_norm_(ddp.parameters(), args.max_grad_norm)
        optimizer.step()
        optimizer.zero_grad()

    seconds = time_steps(ddp_step, args.steps)
    log0(f"torch DistributedDataParallel (25 MB buckets): {shape.tokens_per_step / seconds:>9,.0f} tok/s")
    shutdown()


if __name__ == "__main__":
    main()
