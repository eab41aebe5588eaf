"""
Lesson 01 — data parallelism in one file.

The problem. One GPU reads one batch at a time. The 1b preset (1.5e9 parameters) trained on 100B
tokens needs about 6 * 1.5e9 * 1e11 = 9e20 FLOPs: 35 days on one H100 at a realistic 30 % of its
989 TFLOP/s bf16 peak, four and a half days on eight of them, if the eight can share the work.

The idea. Give every rank a full copy of the model and a different slice of the batch. Each rank
computes the gradient of its own slice's share of the loss; an all-reduce then sums the shares,
so every rank holds the gradient of the whole batch and takes the same optimizer step. The copies never drift
apart, and the result is the result of one device training on the whole batch.

        rank 0: model copy, batch rows 0..7   ─► grad_0 ┐
        rank 1: model copy, batch rows 8..15  ─► grad_1 ├─ all-reduce (sum)  ─► same grad everywhere
        rank 2: model copy, batch rows 16..23 ─► grad_2 │                       ─► same AdamW step
        rank 3: model copy, batch rows 24..31 ─► grad_3 ┘

The price. Memory: nothing is saved, every rank holds all weights, gradients and optimizer states
(16 bytes per parameter in float32 with AdamW); lesson 06 (ZeRO) removes that redundancy.
Communication: one all-reduce of every gradient per optimizer step. A ring all-reduce of S bytes
over N ranks sends and receives 2 (N-1)/N * S bytes per rank (a reduce-scatter then an
all-gather), almost independent of N: that is why data parallelism scales to thousands of GPUs.
Compute: unchanged per rank, unless the all-reduce waits on the critical path.

Three versions, in the order the field found them:

1. Naive: after backward, all-reduce each parameter's gradient, one blocking call per tensor.
2. Bucketed: group gradients into buckets of a few MB and launch each bucket's all-reduce
   asynchronously the moment its last gradient is ready, while backward still computes the
   earlier layers. Fewer, larger messages, and the communication hides behind compute.
3. Gradient accumulation: with A micro-batches per step, the all-reduce runs only after the last
   one; the earlier micro-batches only add into .grad locally.

Run it:
    torchrun --nproc_per_node=4 01_data_parallel.py                       # CPU, ~30 s
    torchrun --nproc_per_node=4 01_data_parallel.py --mode naive          # compare the comm table
    torchrun --nproc_per_node=8 01_data_parallel.py --preset 125m --seq-len 1024   # one 8-GPU node

What to look for: the loss falls exactly as on one device (the tests prove it to float32
precision); the communication table shows one all-reduce of every gradient byte per step,
measured equal to the formula; the naive mode makes one call per tensor where the bucketed mode
makes a handful.
"""

from __future__ import annotations

import argparse
from functools import partial

import torch
import torch.distributed as dist
from torch import nn

from picotron_like import comm
from picotron_like.data import StepBatch
from picotron_like.metrics import (ActivationMeter, MeteredRun, data_parallel_traffic, log0, log_compute_report,
                                   log_memory_rows, log_traffic_rows, predicted_activation_bytes)
from picotron_like.model import GPT, count_parameters
from picotron_like.topology import GridShape, ProcessGrid, init_distributed, shutdown, validate_parallel_config
from picotron_like.run_control import StepMeters
from picotron_like.train import (DataParallelModel, RankBatches, StepResult, StepSettings, add_parallel_flags,
                                 add_training_flags, autocast_dtype, bucket_bytes_from_flags, build_optimizer,
                                 clip_and_step, default_bucket_bytes, plan_run, train)

# ============================================================================ the technique: naive data parallel


class NaiveDataParallel(nn.Module):
    """All-reduce every parameter's accumulated gradient, one blocking call per tensor.

    Which tensor to reduce is the subtle part. A plain tensor hook (``param.register_hook``)
    sees the gradient of the *current* backward pass before it is added into ``param.grad``. Under
    gradient accumulation that is the last micro-batch's contribution only: averaging it across
    ranks leaves the sum of the earlier micro-batches un-averaged in ``.grad``, every rank then
    steps with a different gradient, and the copies silently drift apart. The hook that fires
    *after* accumulation, ``register_post_accumulate_grad_hook``, hands us the parameter whose
    ``.grad`` holds the sum over all micro-batches: that is the tensor to average.
    """

    def __init__(self, module: nn.Module, dp_group):
        super().__init__()
        self.module = module
        self.dp_group = dp_group
        self.require_backward_grad_sync = True
        for param in module.parameters():
            param.register_post_accumulate_grad_hook(self._all_reduce_grad)

    def _all_reduce_grad(self, param):
        if not self.require_backward_grad_sync:
            return
        # Sum, don't average: each rank's loss is already its share of the global mean (its
        # summed token losses divided by the whole batch's target count, see train_step), so the
        # gradients of the shares add up to the gradient of the mean. Averaging instead would be
        # right only when every rank holds as many targets as every other.
        comm.call(dist.all_reduce, param.grad, group=self.dp_group)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def finish_gradient_synchronization(self):
        """Nothing in flight: every all-reduce already completed inside backward."""


# ============================================================================ the technique: bucketed data parallel


class Bucket:
    """A few parameters whose gradients live side by side in one flat buffer."""

    def __init__(self, params: list[nn.Parameter], device, dtype):
        self.params = params
        self.grads = torch.zeros(sum(p.numel() for p in params), device=device, dtype=dtype)
        offset = 0
        for param in params:
            # .grad becomes a view into the buffer: autograd accumulates into it in place, so the
            # bucket is ready to send without copying a single gradient.
            param.grad = self.grads[offset: offset + param.numel()].view_as(param)
            offset += param.numel()
        self.n_ready = 0
        self.pending = None  # the async all-reduce in flight, if any


class BucketedDataParallel(nn.Module):
    """Gradients in buckets of about `bucket_bytes`, each all-reduced asynchronously when full.

    Buckets are filled in reverse parameter order because backward produces gradients roughly
    from the last layer to the first: the first bucket to fill holds the last layers, and its
    all-reduce runs while autograd is still busy with the earlier ones.

        backward:  layer 3 ─ layer 2 ─ layer 1 ─ layer 0 ─ embedding
        network:          [bucket 0 ......] [bucket 1 ......] [bucket 2] ─► wait ─► step

    The cost of bucketing is a flat buffer of all gradients (the .grad tensors are views into
    it, so no extra memory), and that .grad must never be replaced: ``zero_grad`` zeroes the
    buffers in place instead of setting gradients to None.
    """

    def __init__(self, module: nn.Module, dp_group, bucket_bytes: int | None = None):
        super().__init__()
        self.module = module
        self.dp_group = dp_group
        self.require_backward_grad_sync = True
        params = [p for p in module.parameters() if p.requires_grad]
        if bucket_bytes is None:    # the device's default: 25 MB on CUDA, 1 MB on a CPU
            bucket_bytes = default_bucket_bytes(params[0].device)
        self.buckets = self._fill_buckets(params, bucket_bytes)
        self._bucket_of = {param: bucket for bucket in self.buckets for param in bucket.params}
        for param in self._bucket_of:
            param.register_post_accumulate_grad_hook(self._mark_ready)

    @staticmethod
    def _fill_buckets(params, bucket_bytes):
        buckets, current, current_bytes = [], [], 0
        for param in reversed(params):
            current.append(param)
            current_bytes += param.numel() * param.element_size()
            if current_bytes >= bucket_bytes:
                buckets.append(current)
                current, current_bytes = [], 0
        if current:
            buckets.append(current)
        return [Bucket(group, params[0].device, params[0].dtype) for group in buckets]

    def _mark_ready(self, param):
        if not self.require_backward_grad_sync:
            return
        bucket = self._bucket_of[param]
        bucket.n_ready += 1
        if bucket.n_ready == len(bucket.params):
            self._launch(bucket)

    def _launch(self, bucket):
        # Summed, as in the naive version: each rank's gradient is already its share of the mean.
        bucket.pending = comm.call(dist.all_reduce, bucket.grads, group=self.dp_group, async_op=True)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def finish_gradient_synchronization(self):
        """Wait for every bucket's all-reduce; call after the last micro-batch's backward."""
        for bucket in self.buckets:
            # A bucket whose parameters got no gradient hook this step (a parameter not used in
            # the forward pass) never filled up; reduce it now, or the ranks would disagree.
            if bucket.pending is None:
                self._launch(bucket)
            bucket.pending.wait()
            bucket.pending, bucket.n_ready = None, 0

    def zero_grad(self, set_to_none: bool = False):
        for bucket in self.buckets:
            bucket.grads.zero_()


def wrap_data_parallel(model: nn.Module, dp_group, mode: str, bucket_bytes: int | None = None) -> DataParallelModel:
    """Either wrapper. Both offer what every data-parallel wrapper of the suite offers the step
    (train.DataParallelModel): module, dp_group, require_backward_grad_sync,
    finish_gradient_synchronization and zero_grad."""
    if mode == "naive":
        return NaiveDataParallel(model, dp_group)
    return BucketedDataParallel(model, dp_group, bucket_bytes)


# ============================================================================ the technique: gradient accumulation


def forward_backward(model: DataParallelModel, batch: StepBatch, settings: StepSettings) -> torch.Tensor:
    """Forward and backward of this rank's micro-batches; returns this rank's share of the loss.

    The loss is token-weighted over the global batch: each micro-batch's *summed* token losses
    divided by the number of targets in the whole global batch (every rank, every micro-batch).
    Summed over micro-batches and ranks, that is exactly the mean one device computes over the
    whole batch, even when micro-batches hold different numbers of ignored targets; a mean of
    per-rank means is not, and a rank whose targets are all ignored would make it NaN.

    The all-reduce runs only during the last micro-batch's backward: before it, gradients just
    accumulate locally (require_backward_grad_sync = False), which divides the communication by
    the number of micro-batches.
    """
    n_micro = len(batch.micro_batches)
    loss = torch.zeros((), device=settings.device)
    for index, micro_batch in enumerate(batch.micro_batches):
        model.require_backward_grad_sync = index == n_micro - 1
        with settings.autocast():
            share = model(*(t.to(settings.device) for t in micro_batch), reduction="sum") / batch.n_targets
        share.backward()
        loss += share.detach()
    return loss


def train_step(model: DataParallelModel, optimizer, batch: StepBatch, settings: StepSettings) -> StepResult:
    """One optimizer step over this rank's micro-batches; the loss is that of the global batch."""
    loss = forward_backward(model, batch, settings)
    model.finish_gradient_synchronization()
    grad_norm, skipped = clip_and_step(optimizer, model.parameters(), settings)
    model.zero_grad(set_to_none=False)
    comm.call(dist.all_reduce, loss, group=model.dp_group)
    return StepResult(loss, grad_norm, skipped=skipped)     # tensors: the shared loop reads them a step later


@torch.no_grad()
def evaluate(model, batch: StepBatch, settings: StepSettings) -> float:
    """The global batch's mean loss, without gradients: train_step's forward and loss all-reduce alone.

    No graph is kept, so no backward hook fires and no gradient all-reduce runs; eval() for the
    day the model has layers that behave differently when not training.
    """
    model.eval()
    loss = torch.zeros((), device=settings.device)
    for micro_batch in batch.micro_batches:
        with settings.autocast():
            loss += model(*(t.to(settings.device) for t in micro_batch), reduction="sum").float() / batch.n_targets
    model.train()
    comm.call(dist.all_reduce, loss, group=model.dp_group)
    return loss.item()


# ============================================================================ configuration rules


def validate(cfg, grid: GridShape, shape, args, world_size: int) -> None:
    """Data parallelism alone needs only the grid's rules: dp equal to the world size."""
    validate_parallel_config(grid, world_size)


# ============================================================================ measuring the three challenges


def report(run: MeteredRun, plan) -> None:
    """Lesson 01's report is the rows every lesson shares: the memory of one rank (the whole model,
    one micro-batch's activations), the gradient all-reduce (data_parallel_traffic: every gradient
    byte once per step), and tokens/s."""
    shape = plan.shape
    log_memory_rows(run, "one rank; activations of one micro-batch",
                    predicted_activation_bytes(plan.cfg, shape.micro_batch_size, shape.seq_len))
    log_traffic_rows(run, f"dp={plan.grid.dp}; ring all-reduce sends 2(N-1)/N x payload", technique={},
                     gradients=data_parallel_traffic(run.n_params, next(run.model.parameters()).element_size()))
    log_compute_report(run)


# ============================================================================ main


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description="Lesson 01: data parallelism (run with torchrun).",
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_parallel_flags(parser, axes=("dp",), fill_axis="dp")
    parser.add_argument("--mode", choices=("naive", "bucketed"), default="bucketed",
                        help="naive: one blocking all-reduce per tensor; bucketed: async buckets overlapping backward")
    add_training_flags(parser)
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    plan = plan_run(args, validate)
    device = init_distributed()
    grid = ProcessGrid(plan.grid)
    model = wrap_data_parallel(GPT(plan.cfg, seed=args.seed).to(device), grid.dp_group, args.mode,
                               bucket_bytes_from_flags(args, device))
    optimizer = build_optimizer(model.module, args.lr)
    settings = StepSettings(device, autocast_dtype(args.dtype, device), args.max_grad_norm, tail=args.step_tail)
    shape = plan.shape
    log0(f"lesson 01: data parallel, dp={grid.dp_size}, mode={args.mode}, "
         f"{count_parameters(plan.cfg)['total']:,} parameters, {shape.tokens_per_step:,} tokens per step "
         f"({shape.micro_batch_size} x {shape.seq_len} x {shape.grad_accum} micro-batches x {grid.dp_size} ranks)")

    activations = ActivationMeter(model)
    batches = RankBatches(plan.batches, grid.dp_rank, device, val=plan.val_batches)    # this rank's share
    throughput = train(args, optimizer, partial(train_step, model, optimizer, settings=settings), batches,
                       evaluate=partial(evaluate, model, settings=settings), meters=StepMeters((activations,)),
                       cfg=plan.cfg)
    report(MeteredRun(model.module, optimizer, activations, throughput, plan.cfg, shape.seq_len, grid.dp_size,
                      device, throughput.steps), plan)
    shutdown()


if __name__ == "__main__":
    main()
