"""
Lesson 06, continued: ZeRO-Offload, the optimizer's float32 states in host memory and its step on the CPU.

    torchrun --nproc_per_node=4 06_zero_offload.py                          # ZeRO-3, offloaded, CPU, ~20 s
    torchrun --nproc_per_node=4 06_zero_offload.py --offload none           # lesson 06 as it was, to compare
    torchrun --nproc_per_node=3 06_zero_offload.py --zero-stage 1 --dtype bfloat16
    torchrun --nproc_per_node=8 06_zero_offload.py --preset 1b --dtype bfloat16 --seq-len 1024   # one 8-GPU node

The problem. Of ZeRO's 16 bytes per parameter (lesson 06), 12 are the float32 master weights and
AdamW's two moments, which only the optimizer step reads, once per step. A 70B model's are 840 GB:
ZeRO-3 over the 8 GPUs of one node still leaves 16 x 70e9 / 8 = 140 GB per 80 GB GPU before a
single activation. The node's host memory (2 TB on a DGX H100) sits next to it, idle.

The idea (ZeRO-Offload, Ren et al. 2021). Keep on the GPU only what forward and backward use: the
weights and the gradients, as much of each as the ZeRO stage keeps. Move the master and Adam's
moments of this rank's shard to host memory and run the step there, on the CPU, where it is one
pass over memory:

        GPU (device)                                      CPU (host, pinned)
        weights (bf16) ... backward ... reduce-scatter(u) ---- gradient shard of u ---->  g shard
                                                            (side stream, during the rest of backward)
                                                                                  AdamW(master, m, v)
        shard of the weights  <------------ the updated shard, cast to bf16 -----------  master
        all-gather (ZeRO-1/2), or the next forward's gather (ZeRO-3)

Each unit's summed gradient shard is copied out as soon as its reduction completes: on a GPU on a
stream of its own with non_blocking into pinned memory, so the copy overlaps the units still in
backward, and an event recorded after it is waited for before the host reads it. The step is
torch's CPU AdamW (fused where the run's device is a GPU: one multi-threaded pass over every
tensor) through the same optimizer interface as every other lesson, clipping included: the norm's
sum over the ranks runs on a device tensor, the factor and the skip flag go to the host with the
norm, which the host step waits for anyway. The updated master is cast to the weights' dtype on
the host and copied into this rank's shard of the device weights, before the all-gather that
publishes them (ZeRO-1/2), into the weight shard that the next forward gathers (ZeRO-3), into the
whole weights (ZeRO-0).

The price. Per parameter on the device: lesson 06's stage formula less the master and Adam's
(m + 8) / N. On the host, per rank: 12 / N (float32 master + two moments) and pinned staging for
the gradient shard (g / N) and the bf16 weights' shard (2 / N; none in float32, where the master
is what is copied). Per step and rank over the host link (PCIe, or a GH200's C2C): g Psi'/N down
(the gradient shard) and p Psi'/N up (the weights' shard): 2 x 17.5 GB for a 70B model with bf16
weights and gradients on 8 ranks, ~0.3 s each way at a PCIe 5 x16's 64 GB/s, the way down hidden
behind backward, the way up before the gathers. And the host step: fused AdamW reads and writes
the master, the gradient and both moments, the norm reads the gradient, bf16 gradients and
weights are cast on the way: about 48 bytes per parameter over the node's host memory, 3.4 TB for
the 70B model, ~8 s at the ~430 GB/s a two-socket DDR5-4800 node streams, against ~130 s of GPU
compute for a step of a million tokens: worth it when the model does not fit otherwise, a loss
when it does. Lesson 07's plan counts all three.

What to look for: the device-side model states, measured from the tensors the run holds, fall to
the prediction, and the host-side ones hold the difference (12 / N per parameter); the losses, the
gradients and the weights the same as --offload none's, bit for bit on a CPU (there host and device
are the same memory: the proof is of the numerics and of which tensor holds what); the host step's
time next to the link's bytes.
"""

from __future__ import annotations

import argparse
import os
import time
from dataclasses import replace
from functools import partial

import torch
from torch import nn

from picotron_like import comm
from picotron_like.lessons import load_lesson
from picotron_like.metrics import (GatheredParameterMeter, MeteredRun, ModelStates, SavedTensorMeters, log0,
                                   log_compute_report, log_traffic_rows, memory_table, optimizer_state_tensors,
                                   storage_bytes)
from picotron_like.model import GPT, count_parameters
from picotron_like.run_control import StepMeters
from picotron_like.topology import ProcessGrid, group_size, init_distributed, shutdown
from picotron_like.train import (RankBatches, add_parallel_flags, add_training_flags, build_optimizer, plan_run,
                                 train)

zero = load_lesson("06_zero")

# ============================================================================ the technique: the optimizer's states on the host


class OptimizerOffload:
    """Mixed into any of lesson 06's stage classes: the float32 master of this rank's shard (and
    so AdamW's moments, made like it) in host memory, the gradient shard copied out as each unit's
    reduction completes, the step on the host, the weights' shard copied back.

    Host tensors per flat unit: `master` (float32), `host_grad` (the reduced shard in the reduce
    dtype, which the master's gradients view or are cast from) and `host_weights` (the master cast
    to the weights' dtype: what crosses the link back; the master itself in float32). On a GPU they
    are pinned, so that the copies are DMA transfers that run beside the compute stream, and the
    process takes its share of the host's cores for the step (host_threads)."""

    def __init__(self, module: nn.Module, *args, **kwargs):
        self.device = next(module.parameters()).device
        # The gradient copies' own stream: the compute stream goes on with backward meanwhile.
        self.copy_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        if self.device.type == "cuda":
            torch.set_num_threads(host_threads())
        self._copies = []       # on a CPU: units whose gradient shard is copied once the reductions are waited for
        super().__init__(module, *args, **kwargs)

    def host_tensor(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """Host memory, pinned when the device is a GPU (pinning needs CUDA)."""
        return torch.empty(numel, dtype=dtype, device="cpu", pin_memory=self.device.type == "cuda")

    def _shard_states(self, unit) -> None:
        """Lesson 06's states, then the master moved to the host (in float32 it was the weights'
        own shard: now a copy of it) and the staging tensors beside it."""
        super()._shard_states(unit)
        master = self.host_tensor(unit.shard_numel, torch.float32)
        unit.master = master.copy_(unit.master)
        for piece in unit.pieces:
            piece.master = unit.master[piece.lo: piece.hi]
        unit.host_grad = self.host_tensor(unit.shard_numel, self.precision.reduce_dtype)
        unit.host_weights = (unit.master if self.precision.param_dtype == torch.float32 else
                             self.host_tensor(unit.shard_numel, self.precision.param_dtype))
        unit.gradient_copied = None     # the copy's event, on a GPU

    # ---------------------------------------------------------------- gradients: device -> host, during backward

    def _reduce(self, unit, grads) -> None:
        super()._reduce(unit, grads)
        if not self.require_backward_grad_sync:
            return                      # an earlier micro-batch: the shard is not final yet
        if self.stage < 2:
            self._gradient_to_host(unit, self._reductions[-1])
        else:                           # ZeRO-2/3: final once _finish_in_flight has added it up
            unit.final_reduction_in_flight = True

    def _finish_in_flight(self) -> None:
        finishing = self._in_flight[1] if self._in_flight is not None else None
        super()._finish_in_flight()
        if finishing is not None and getattr(finishing, "final_reduction_in_flight", False):
            finishing.final_reduction_in_flight = False
            self._gradient_to_host(finishing)

    def _gradient_to_host(self, unit, reduction=None) -> None:
        """Copy the unit's summed gradient shard to the host once `reduction` (or, ZeRO-2/3, the
        compute stream's addition of the last one) is done. On a CPU the copy waits for the step's
        tail, where the reductions are waited for anyway: nothing runs beside backward there."""
        if self.copy_stream is None:
            self._copies.append(unit)
            return
        self.copy_stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.copy_stream):
            if reduction is not None:
                reduction.wait()        # the copy stream waits for the collective, the compute stream does not
            unit.host_grad.copy_(unit.grad_shard, non_blocking=True)
            unit.gradient_copied = torch.cuda.Event()
            unit.gradient_copied.record()

    def gradients_to_master(self) -> None:
        """The host's gradient shards, once their copies are done, as the float32 gradients of the
        master pieces (a view in float32, one cast per unit otherwise)."""
        for unit in self._copies:
            unit.host_grad.copy_(unit.grad_shard)
        self._copies.clear()
        for unit in self.units:
            if unit.gradient_copied is not None:
                unit.gradient_copied.synchronize()
                unit.gradient_copied = None
            grad = unit.host_grad.to(torch.float32)
            for piece in unit.pieces:
                piece.master.grad = grad[piece.lo: piece.hi]

    # ---------------------------------------------------------------- the step on the host, the weights back

    def step(self, optimizer, grad_norm: torch.Tensor, grad_scale: torch.Tensor | None = None) -> torch.Tensor:
        """Lesson 06's step with the norm (and the fused tail's grad_scale) on the host, beside the
        tensors the host's AdamW steps: its found_inf and grad_scale must be where its params are.
        The host waits for the device here: the step cannot start before the norm is known."""
        host = torch.device("cpu")
        return super().step(optimizer, grad_norm.to(host), None if grad_scale is None else grad_scale.to(host))

    def _publish(self, unit):
        """The master cast to the weights' dtype on the host (p bytes cross the link, not 4), copied
        into this rank's shard of the device weights; then, at ZeRO-1/2, that shard all-gathered
        (ZeRO-3's next forward gathers it, ZeRO-0 holds the whole unit).

        non_blocking from pinned memory: the copy is queued on the compute stream, ahead of the
        all-gather and the forward that read it. The host writes host_weights again only in the
        next step, after waiting for the next backward's gradient copies, which that stream
        orders after this copy."""
        held = unit.param_shard if self.stage == 3 else unit.shard(unit.flat_params)
        if unit.host_weights is not unit.master:
            unit.host_weights.copy_(unit.master)
        held.copy_(unit.host_weights, non_blocking=True)
        if self.stage in (0, 3):
            return None
        return comm.call(comm.all_gather_single, unit.flat_params, held, group=unit.group, async_op=True)


def host_threads() -> int:
    """The host step's threads on a GPU run: the cores this process may use, shared by the node's
    ranks. torchrun gives each rank OMP_NUM_THREADS=1 unless told otherwise, which would leave the
    host's AdamW on one core, far from the memory bandwidth a socket's cores reach together."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, cores // int(os.environ.get("LOCAL_WORLD_SIZE", "1")))


def offloaded(stage_class: type) -> type:
    """`stage_class` (one of lesson 06's, or one with lesson 07's seams mixed in) with its optimizer offloaded."""
    return type(f"Offloaded{stage_class.__name__}", (OptimizerOffload, stage_class), {})


def wrap_zero_offloaded(module: nn.Module, group, stage: int, precision=zero.Precision(),
                        reshard_after_forward: bool = True, prefetch: bool = True,
                        overlap_weight_gather: bool = True):
    """Lesson 06's wrap_zero, its stage's class offloaded."""
    if stage == 3:
        return offloaded(zero.ZeroStage3)(module, group, precision, reshard_after_forward, prefetch)
    if stage == 2:
        return offloaded(zero.ZeroStage2)(module, group, precision, overlap_weight_gather=overlap_weight_gather)
    return offloaded(zero.ZeroDataParallel)(module, group, precision, replicate=stage == 0,
                                            overlap_weight_gather=overlap_weight_gather)


def build_offloaded_optimizer(model: OptimizerOffload, lr: float) -> torch.optim.AdamW:
    """Lesson 06's AdamW over the host's master pieces, in the implementation of the run's device:
    on a GPU run fused=True on the host's tensors (torch has a fused CPU AdamW since 2.4), on a CPU
    run the per-tensor loop lesson 06 steps with, so that the two runs compare bit for bit."""
    return build_optimizer([(piece.name, piece.master) for unit in model.units for piece in unit.pieces], lr,
                           device=model.device)


# ============================================================================ measuring the three challenges


def host_tensors(model) -> list[torch.Tensor]:
    """The tensors the offload keeps in host memory (none without it): the units' master and
    staging tensors; on a GPU only those whose memory is the CPU's."""
    if not isinstance(model, OptimizerOffload):
        return []
    held = [t for unit in model.units for t in (unit.master, unit.host_grad, unit.host_weights)]
    return [t for t in held if t.device.type == "cpu"]


def storage_id(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage()._cdata


def measured_placement(model, optimizer) -> tuple[ModelStates, ModelStates]:
    """(device side, host side) of every storage the wrapper and its optimizer hold, each counted
    once in its first role (weights, gradients, master, Adam's moments), as lesson 06's
    measured_model_states counts them. Host-side: the host tensors' storages (host_tensors) and
    the gradients and states the optimizer keeps for them (made like their parameter); the rest
    is the device's. A master left sharing the device weights' storage would count as host-side
    weights and leave the device side short of its prediction."""
    host = {storage_id(t) for t in host_tensors(model)}
    masters = [piece.master for unit in model.units for piece in unit.pieces]
    for master in masters:
        if storage_id(master) in host:
            extra = [master.grad] if master.grad is not None else []
            extra += [v for v in optimizer.state.get(master, {}).values() if torch.is_tensor(v) and v.dim() > 0]
            host.update(storage_id(t) for t in extra)
    offload = isinstance(model, OptimizerOffload)
    staged_weights = [u.host_weights for u in model.units if offload and u.host_weights is not u.master]
    weights = [*model.module.parameters(), *(u.param_shard for u in model.units if model.stage == 3), *staged_weights]
    gradients = [*(p.grad for p in model.module.parameters()), *(u.grad_shard for u in model.units),
                 *(getattr(u, "grad_buffer", None) for u in model.units),
                 *(u.host_grad for u in model.units if offload), *(m.grad for m in masters)]
    gradients = [t for t in gradients if t is not None]     # dropped after the step, or ZeRO-2/3's (no buffer)
    roles = (weights, gradients, [u.master for u in model.units], optimizer_state_tensors(optimizer))
    seen, device_side, host_side = set(), [], []
    for tensors in roles:
        device_side.append(storage_bytes([t for t in tensors if storage_id(t) not in host], seen))
        host_side.append(storage_bytes([t for t in tensors if storage_id(t) in host], seen))
    return ModelStates(*device_side), ModelStates(*host_side)


def predicted_placement(unit_counts: list[int], n: int, stage: int, precision, offload: bool
                        ) -> tuple[ModelStates, ModelStates]:
    """(device side, host side) per rank: lesson 06's formula, with offload its master and Adam's
    moments (12 bytes per element of the shard, the master a copy even in float32) on the host
    beside the staging for the gradient shard (g) and the weights' shard (p, but none in float32)."""
    states = zero.predicted_model_states(unit_counts, n, stage, precision)
    if not offload:
        return states, ModelStates(0, 0, 0, 0)
    shard = sum(zero.padded(count, 1 if stage == 0 else n) for count in unit_counts) // (1 if stage == 0 else n)
    p, g = precision.param_dtype.itemsize, precision.reduce_dtype.itemsize
    staging = 0 if precision.param_dtype == torch.float32 else p * shard
    return (replace(states, master_weights=0, optimizer_states=0),
            ModelStates(parameters=staging, gradients=g * shard, master_weights=4 * shard, optimizer_states=8 * shard))


def predicted_link_bytes(unit_counts: list[int], n: int, stage: int, precision) -> dict[str, int]:
    """Bytes per step and rank over the host link: the gradient shard down, the weights' shard up."""
    shard = sum(zero.padded(count, 1 if stage == 0 else n) for count in unit_counts) // (1 if stage == 0 else n)
    return {"device to host": precision.reduce_dtype.itemsize * shard,
            "host to device": precision.param_dtype.itemsize * shard}


class HostStepTimer:
    """The optimizer step's wall time, through the optimizer's own step hooks (entered for the
    run, removed by close()): offloaded, the host step, which the device waits for."""

    def __init__(self, optimizer):
        self.seconds, self.steps, self._started = 0.0, 0, None
        self._hooks = (optimizer.register_step_pre_hook(self._start), optimizer.register_step_post_hook(self._stop))

    def _start(self, *_):
        self._started = time.perf_counter()

    def _stop(self, *_):
        self.seconds += time.perf_counter() - self._started
        self.steps += 1

    def close(self) -> None:
        for hook in self._hooks:
            hook.remove()


def log_placement(model, optimizer, title: str, predicted: tuple[ModelStates, ModelStates],
                  gathered: GatheredParameterMeter, predicted_peak: int) -> None:
    """The model states this rank holds on each side, measured next to `predicted` (device, host);
    at ZeRO-3 the peak of gathered weights next to `predicted_peak` (lesson 06's rows)."""
    device, host = measured_placement(model, optimizer)
    log0(f"\n== memory (one rank; {title}) ==")
    log0(memory_table(device, predicted[0], "device side"))
    log0(memory_table(host, predicted[1], "host side"))
    if model.stage == 3:
        log0(f"gathered weights at the peak: {gathered.peak_bytes / 1e6:.3f} MB measured, "
             f"{predicted_peak / 1e6:.3f} MB predicted")


def report(model, run: MeteredRun, gathered: GatheredParameterMeter, n_micro: int, timer: HostStepTimer) -> None:
    """Lesson 06's report with the model states split by where they live, the host link's bytes
    and the optimizer step's time."""
    n, stage, precision = group_size(model.dp_group), model.stage, model.precision
    counts, group = [unit.numel for unit in model.units], comm.group_name(model.dp_group)
    offload = isinstance(model, OptimizerOffload)
    reshard, prefetch = (model.reshard_after_forward, model.prefetch) if stage == 3 else (True, True)
    peak = zero.predicted_gathered_peak([zero.padded(c, n) * precision.param_dtype.itemsize for c in counts],
                                        reshard, prefetch)
    log_placement(model, run.optimizer, f"ZeRO-{stage} over {n} ranks, weights {precision.param_dtype}, gradients "
                  f"{precision.reduce_dtype}, optimizer {'offloaded to the host' if offload else 'on the device'}",
                  predicted_placement(counts, n, stage, precision, offload), gathered, peak)
    if offload:     # (on a GPU the device's own step runs asynchronously: its host time would say nothing)
        link = predicted_link_bytes(counts, n, stage, precision)
        log0("host link per step (predicted): " + ", ".join(f"{way} {b / 1e6:.3f} MB" for way, b in link.items()))
        log0(f"host step: {1e3 * timer.seconds / max(timer.steps, 1):.2f} ms per step (measured over {timer.steps} "
             f"steps: AdamW on the host's {sum(unit.shard_numel for unit in model.units):,} elements)")
    log_traffic_rows(run, f"{n_micro} micro-batches", technique={},
                     gradients=zero.predicted_zero_traffic(counts, n, stage, precision, n_micro, reshard, group),
                     loss_groups=(group,), norm_groups=(group,) if stage else ())
    log_compute_report(run)


# ============================================================================ main


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description="Lesson 06, continued: ZeRO-Offload (run with torchrun).",
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_parallel_flags(parser, axes=("dp",), fill_axis="dp", bucket_flag=False)
    zero.add_zero_flags(parser)
    parser.add_argument("--offload", choices=("optimizer", "none"), default="optimizer",
                        help="optimizer: the float32 master and AdamW's states in host memory, the step on the CPU; "
                             "none: lesson 06 as it is")
    add_training_flags(parser, micro_batch_size=4, grad_accum=2, steps=20)
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    plan = plan_run(args, zero.validate)
    device = init_distributed()
    grid = ProcessGrid(plan.grid)
    precision = zero.precision_from_flags(args.dtype, args.reduce_dtype, device)
    wrap = wrap_zero_offloaded if args.offload == "optimizer" else zero.wrap_zero
    model = wrap(GPT(plan.cfg, seed=args.seed).to(device), grid.dp_group, args.zero_stage, precision,
                 args.reshard_after_forward, args.prefetch, args.overlap_weight_gather)
    optimizer = (build_offloaded_optimizer(model, args.lr) if args.offload == "optimizer" else
                 zero.build_sharded_optimizer(model, args.lr))
    settings = zero.step_settings(device, precision, args.max_grad_norm, args.step_tail)
    log0(f"lesson 06 (offload): ZeRO-{args.zero_stage} over dp = {grid.dp_size} ranks, optimizer "
         f"{'on the host' if args.offload == 'optimizer' else 'on the device'}, weights {precision.param_dtype}, "
         f"gradients {precision.reduce_dtype}, {count_parameters(plan.cfg)['total']:,} parameters, "
         f"{plan.shape.tokens_per_step:,} tokens per step")

    gathered, timer = GatheredParameterMeter(model.module), HostStepTimer(optimizer)
    batches = RankBatches(plan.batches, grid.dp_rank, device, val=plan.val_batches)    # this rank's share
    throughput = train(args, optimizer, partial(zero.train_step, model, optimizer, settings=settings), batches,
                       evaluate=partial(zero.evaluate, model, settings=settings),
                       meters=StepMeters((SavedTensorMeters(gathered),)), cfg=plan.cfg)
    model.wait_for_weights()        # the last step's gathers, before the report and the process group's end
    timer.close()
    report(model, MeteredRun(model.module, optimizer, None, throughput, plan.cfg, plan.shape.seq_len, grid.dp_size,
                             device, throughput.steps), gathered, plan.shape.grad_accum, timer)
    shutdown()


if __name__ == "__main__":
    main()
