"""
Lesson 01 — data parallelism in one file.

The problem. One GPU reads one batch at a time. The 1b preset (1.5e9 parameters) trained on 100B
tokens needs about 6 * 1.5e9 * 1e11 = 9e20 FLOPs: 35 days on one H100 at a realistic 30 % of its
989 TFLOP/s bf16 peak, four and a half days on eight of them, if the eight can share the work.

The idea. Give every rank a full copy of the model and a different slice of the batch. Each rank
computes the gradient of its own slice; an all-reduce then averages the gradients, so every rank
holds the gradient of the whole batch and takes the same optimizer step. The copies never drift
apart, and the result is the result of one device training on the whole batch.

        rank 0: model copy, batch rows 0..7   ─► grad_0 ┐
        rank 1: model copy, batch rows 8..15  ─► grad_1 ├─ all-reduce (mean) ─► same grad everywhere
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
from contextlib import nullcontext

import torch
import torch.distributed as dist
from torch import nn

from picotron_like import comm
from picotron_like.model import GPT, count_parameters, get_config
from picotron_like.topology import (ConfigError, GridShape, ProcessGrid, init_distributed, shutdown,
                                    validate_parallel_config, world_size_from_env)
from picotron_like.train import (SavedActivations, Throughput, add_training_flags, autocast_dtype,
                                 build_batches, build_optimizer, clip_grad_norm_, exit_with_error,
                                 learning_rate, log0, log_step, measured_memory, memory_table,
                                 log_compute_report, predicted_activation_bytes, predicted_memory,
                                 set_learning_rate)

# ----------------------------------------------------------------------------- 1. naive data parallel


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
        self.dp_size = dist.get_world_size(dp_group)
        self.require_backward_grad_sync = True
        for param in module.parameters():
            param.register_post_accumulate_grad_hook(self._all_reduce_grad)

    def _all_reduce_grad(self, param):
        if not self.require_backward_grad_sync:
            return
        # Average, don't sum: each rank's loss is the mean over its own slice, and the reference
        # is the mean over the whole batch. gloo has no AVG reduction, so divide, then sum.
        param.grad.div_(self.dp_size)
        comm.call(dist.all_reduce, param.grad, group=self.dp_group)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def finish_gradient_synchronization(self):
        """Nothing in flight: every all-reduce already completed inside backward."""


# ----------------------------------------------------------------------------- 2. bucketed data parallel


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

    def __init__(self, module: nn.Module, dp_group, bucket_bytes: int = 25 * 2**20):
        super().__init__()
        self.module = module
        self.dp_group = dp_group
        self.dp_size = dist.get_world_size(dp_group)
        self.require_backward_grad_sync = True
        self.buckets = self._fill_buckets([p for p in module.parameters() if p.requires_grad], bucket_bytes)
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
        bucket.grads.div_(self.dp_size)
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


def wrap_data_parallel(model: nn.Module, dp_group, mode: str, bucket_bytes: int) -> nn.Module:
    if mode == "naive":
        return NaiveDataParallel(model, dp_group)
    return BucketedDataParallel(model, dp_group, bucket_bytes)


# ----------------------------------------------------------------------------- 3. one training step


def train_step(model, optimizer, micro_batches, max_grad_norm, device, compute_dtype,
               activation_meter=None, norm_groups=(), counts_toward_norm=None) -> float:
    """One optimizer step over this rank's micro-batches; returns the loss averaged over all ranks.

    Each micro-batch is a tuple of model arguments, (inputs, targets) here; later lessons add
    positions. The all-reduce runs only during the last micro-batch's backward: before it,
    gradients just accumulate locally (require_backward_grad_sync = False), which divides the
    communication by the number of micro-batches. Dividing each micro-batch's loss by their
    number makes the accumulated gradient the gradient of the mean loss, as on one device.
    `norm_groups` and `counts_toward_norm` tell gradient clipping how the parameters are sharded
    (see clip_grad_norm_); data parallelism alone shards nothing.
    """
    n_micro = len(micro_batches)
    loss_sum = torch.zeros((), device=device)
    for index, batch in enumerate(micro_batches):
        model.require_backward_grad_sync = index == n_micro - 1
        batch = [tensor.to(device) for tensor in batch]
        measure = activation_meter if activation_meter is not None and index == 0 else nullcontext()
        with torch.autocast(device.type, dtype=compute_dtype, enabled=compute_dtype != torch.float32), measure:
            loss = model(*batch)
        (loss / n_micro).backward()
        loss_sum += loss.detach()
    model.finish_gradient_synchronization()
    clip_grad_norm_(model.parameters(), max_grad_norm, norm_groups, counts_toward_norm)
    optimizer.step()
    model.zero_grad(set_to_none=False)
    mean_loss = loss_sum / n_micro
    comm.call(dist.all_reduce, mean_loss, group=model.dp_group)
    return mean_loss.item() / model.dp_size


# ----------------------------------------------------------------------------- main


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description="Lesson 01: data parallelism (run with torchrun).",
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--dp", type=int, default=None, help="data-parallel degree (default: the world size)")
    parser.add_argument("--mode", choices=("naive", "bucketed"), default="bucketed",
                        help="naive: one blocking all-reduce per tensor; bucketed: async buckets overlapping backward")
    parser.add_argument("--bucket-mb", type=float, default=1.0,
                        help="bucket size in MB for --mode bucketed (PyTorch DDP uses 25)")
    add_training_flags(parser)
    return parser.parse_args(argv)


def predicted_dp_traffic(n_params: int, grad_bytes: int, steps: int) -> dict:
    """Per run: one all-reduce of every gradient byte per step, plus the 4-byte loss average."""
    return {("all_reduce", "dp"): steps * (n_params * grad_bytes + 4)}


def report(model, optimizer, cfg, shape, throughput, activations, device, steps, dp):
    n_params = sum(p.numel() for p in model.parameters())
    grad_bytes = next(model.parameters()).element_size()
    predicted_activations = predicted_activation_bytes(cfg, shape.micro_batch_size, shape.seq_len)
    log0("\n== memory (one rank; activations of one micro-batch) ==")
    log0(memory_table(measured_memory(model, optimizer, activations.nbytes),
                      predicted_memory(n_params, predicted_activations)))
    log0(f"\n== communication per step (dp={dp}; ring all-reduce sends 2(N-1)/N x payload) ==")
    log0(comm.meter.table(predicted_dp_traffic(n_params, grad_bytes, 1), per=steps))
    log_compute_report(throughput, dp, cfg, shape.seq_len, device)


def main(argv=None):
    args = parse_args(argv)
    try:
        world_size = world_size_from_env()
        dp = args.dp or world_size
        cfg = get_config(args.preset)
        validate_parallel_config(GridShape(dp=dp), world_size, cfg)
        batches, shape = build_batches(args, dp, cfg.vocab_size)
    except (ConfigError, ValueError) as error:
        exit_with_error(error)

    device = init_distributed()
    grid = ProcessGrid(GridShape(dp=dp))
    torch.manual_seed(args.seed)
    model = wrap_data_parallel(GPT(cfg, seed=args.seed).to(device), grid.dp_group, args.mode,
                               int(args.bucket_mb * 2**20))
    optimizer = build_optimizer(model.module, args.lr)
    compute_dtype = autocast_dtype(args.dtype, device)
    log0(f"lesson 01: data parallel, dp={dp}, mode={args.mode}, {count_parameters(cfg)['total']:,} parameters, "
         f"{shape.tokens_per_step:,} tokens per step ({shape.micro_batch_size} x {shape.seq_len} x "
         f"{shape.grad_accum} micro-batches x {dp} ranks)")

    throughput, activations = Throughput(), SavedActivations(model, device)
    for step in range(args.steps):
        set_learning_rate(optimizer, learning_rate(step, args.lr, args.warmup_steps, args.steps))
        throughput.start_step()
        loss = train_step(model, optimizer, batches.micro_batches(step, grid.dp_rank), args.max_grad_norm,
                          device, compute_dtype, activations if step == 0 else None)
        log_step(step, loss, shape.tokens_per_step, throughput.end_step(shape.tokens_per_step, device))

    report(model, optimizer, cfg, shape, throughput, activations, device, args.steps, dp)
    shutdown()


if __name__ == "__main__":
    main()
