"""
Lesson 06 — ZeRO: sharding the optimizer states, the gradients and the parameters, in one file.

The problem. Lesson 01 gives every rank a full copy of everything. With AdamW and bf16 mixed
precision that is 16 bytes per parameter (2 for the bf16 weights, 2 for their gradients, 4 for the
float32 master weights, 8 for Adam's two moments): the 8b preset needs 128 GB of model states per
rank before a single activation, however many ranks share the work. Yet every data-parallel rank
holds the *same* optimizer states and takes the *same* step: N copies of work one copy could do.

The idea (ZeRO, Rajbhandari et al. 2019). Cut the model states into N shards and let each of the
N data-parallel ranks, which hold the same weights, keep one. Three stages, each sharding one more thing:

    stage   what each rank keeps whole      what it keeps 1/N of        bytes per parameter (bf16)
    0       weights, grads, master, Adam    -                           2 + 2 + 12          (lesson 01)
    1       weights, grads                  master, Adam                2 + 2 + 12/N
    2       weights                         grads, master, Adam         2 + 14/N
    3       -                               weights, grads, master,Adam 16/N

The units. Parameters are grouped into units that follow the model's structure: the embedding,
each block, the head (final norm + LM head). Each unit is one flat buffer padded to a multiple
of N and cut into N contiguous shards; rank r owns elements [r S, (r+1) S) of every unit:

        unit "block 3" (flat, padded):  [ attn_norm | q | k | v | o | mlp_norm | gate | up | down |pad]
                                        |<--- rank 0 --->|<--- rank 1 --->|<--- rank 2 --->|

A flat buffer (DeepSpeed, FSDP1) rather than FSDP2's per-parameter dim-0 shards: one call per
unit on one contiguous buffer, at most N-1 elements of padding. A shard then cuts parameters at
arbitrary places, so the optimizer sees it as *pieces*, one view per parameter it touches, each in
its parameter's weight-decay group: decay stays exactly per parameter.

The code follows the stages: ZeRO-1 (whole gradients reduce-scattered once per step, AdamW on this
rank's pieces of the float32 master, the updated shards all-gathered while the next step's forward
runs, each unit's gather waited for just before that unit's forward), then what ZeRO-2 changes (a
reduce-scatter at every micro-batch into the gradient shard), then what ZeRO-3 adds (each unit
gathered just before its forward and again for its backward, freed after, the next one
prefetched); then mixed precision (bf16 weights beside a float32 master), in a section of its
own. Clipping sums each shard's squares over the ranks.

The price. With bytes per parameter p (weights) and g (gradients), m = 4 for a float32 master
beside bf16 weights (0 in float32: the weights are the master), Psi' the parameter count padded
per unit, and A micro-batches per step (a ring sends (N-1)/N of a payload per rank):

    model states per rank                      communication per step (payload)
    stage 0: (p + g + m + 8) Psi'              all-reduce g Psi
    stage 1: (p + g) Psi' + (m + 8) Psi'/N     reduce-scatter g Psi + all-gather p Psi
    stage 2: p Psi' + (g + m + 8) Psi'/N       reduce-scatter A g Psi + all-gather p Psi
    stage 3: (p + g + m + 8) Psi'/N            reduce-scatter A g Psi + all-gather 2 A p Psi

bf16/bf16 gives the paper's 2+2+12, 2+2+12/N, 2+14/N, 16/N; fp32 gradients make ZeRO-2 2 + 16/N
(fp16 is out of scope: it needs loss scaling, bf16 does not). ZeRO-3 sends A p Psi less when units
stay gathered from forward to backward. This lesson shards a dense model over data parallelism
alone; lesson 07 composes ZeRO with experts, pipelines and the other axes (--tp, --pp,
--cp and MoE presets here are refused with a line pointing there).

Run it:
    torchrun --nproc_per_node=4 06_zero.py                                  # ZeRO-3, fp32, CPU
    torchrun --nproc_per_node=4 06_zero.py --zero-stage 1 --dtype bfloat16  # bf16 + fp32 master
    torchrun --nproc_per_node=3 06_zero.py --zero-stage 2                   # every unit padded to 3 shards
    torchrun --nproc_per_node=8 06_zero.py --preset 1b --seq-len 1024       # one 8-GPU node

What to look for: the model-state table, measured equal to the stage's formula byte for byte;
ZeRO-3's peak of gathered weights, two units with prefetch; the traffic next to its formula.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, replace
from functools import partial

import torch
import torch.distributed as dist
from torch import nn

from picotron_like import comm
from picotron_like.data import StepBatch
from picotron_like.lessons import load_lesson
from picotron_like.metrics import (GatheredParameterMeter, MeteredRun, ModelStates, SavedTensorMeters,
                                   data_parallel_traffic, log0, log_compute_report, log_traffic_rows, memory_table,
                                   optimizer_state_tensors, storage_bytes)
from picotron_like.model import GPT, count_parameters
from picotron_like.topology import (ConfigError, GridShape, ProcessGrid, group_rank, group_size, init_distributed,
                                    shutdown, validate_parallel_config)
from picotron_like.run_control import StepMeters
from picotron_like.train import (RankBatches, StepResult, StepSettings, add_parallel_flags, add_training_flags,
                                 autocast_dtype, build_optimizer, clip_gradients, optimizer_step, plan_run, train)

data_parallel = load_lesson("01_data_parallel")

# ============================================================================ the technique: units and their shards


@dataclass(frozen=True)
class Precision:
    """FSDP2's MixedPrecisionPolicy in two fields: the weights' dtype (compute and all-gather) and
    the gradients' dtype (accumulation and reduction). The master weights and Adam are float32."""

    param_dtype: torch.dtype = torch.float32
    reduce_dtype: torch.dtype = torch.float32


class Piece:
    """The part of one parameter (or of the padding) that falls inside this rank's shard."""

    def __init__(self, name: str, param, lo: int, hi: int):
        self.name, self.param, self.lo, self.hi = name, param, lo, hi


def padded(count: int, n_shards: int) -> int:
    """A unit's elements once padded to a multiple of its shard count."""
    return -(-count // n_shards) * n_shards


class FlatUnit:
    """The parameters of one module-sized unit as one flat buffer, padded to a multiple of
    `n_shards` and cut into that many contiguous shards; this rank owns shard `shard_rank` of the
    ranks of `group`, the ranks that hold the same parameters."""

    def __init__(self, named_params: list[tuple[str, nn.Parameter]], n_shards: int, shard_rank: int, group):
        self.group = group
        self.names = [name for name, _ in named_params]
        self.params = [param for _, param in named_params]
        self.shapes = [param.shape for param in self.params]
        self.numel = sum(param.numel() for param in self.params)
        self.padded_numel = padded(self.numel, n_shards)
        self.shard_numel = self.padded_numel // n_shards
        self.start = shard_rank * self.shard_numel
        self.n_ready = 0
        self.pieces = self._pieces()

    def _pieces(self) -> list[Piece]:
        pieces, offset, end = [], 0, self.start + self.shard_numel
        for name, param in zip(self.names, self.params):
            lo, hi = max(offset, self.start), min(offset + param.numel(), end)
            if lo < hi:
                pieces.append(Piece(name, param, lo - self.start, hi - self.start))
            offset += param.numel()
        if end > self.numel:
            pieces.append(Piece("padding", None, max(self.numel, self.start) - self.start, self.shard_numel))
        return pieces

    def flatten(self, tensors, dtype) -> torch.Tensor:
        """`tensors` (one per parameter, in order) in one padded flat tensor of `dtype`: each element
        written once, only the padding zeroed."""
        flat = torch.empty(self.padded_numel, dtype=dtype, device=tensors[0].device)
        torch.cat([t.reshape(-1) for t in tensors], out=flat[: self.numel])
        flat[self.numel:].zero_()
        return flat

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Each parameter's slice of `flat`, in the parameter's shape."""
        offsets = [0]
        for shape in self.shapes:
            offsets.append(offsets[-1] + shape.numel())
        return [flat[lo: hi].view(shape) for lo, hi, shape in zip(offsets, offsets[1:], self.shapes)]

    def use_flat_parameters(self, flat: torch.Tensor) -> None:
        """Point every parameter at its slice of `flat`: the module computes with them in place."""
        for param, view in zip(self.params, self.views(flat)):
            param.data = view

    def release_parameters(self) -> None:
        """Drop the gathered weights; autograd's saved references see the next gather's data."""
        for param in self.params:
            param.data = param.data.new_empty(0)

    def shard(self, flat: torch.Tensor) -> torch.Tensor:
        return flat[self.start: self.start + self.shard_numel]


def unit_modules(model: nn.Module) -> list[list[nn.Module]]:
    """The units in forward order: the embedding, each block, the head (final norm and LM head)."""
    units = [[model.tok_embeddings]] if getattr(model, "tok_embeddings", None) is not None else []
    units += [[block] for block in model.layers]
    if getattr(model, "lm_head", None) is not None:
        units.append([model.norm, model.lm_head])
    return units


# ============================================================================ the technique: ZeRO-1, the optimizer states sharded


class ZeroDataParallel(nn.Module):
    """ZeRO-1: data parallelism over `group` with the float32 master weights and AdamW's states
    sharded. Every rank keeps the whole weights and accumulates whole gradients, as in lesson 01;
    during the step's last backward each unit's gradient buffer is reduce-scattered, so a rank
    receives the summed gradient of its own shard only, steps its shard of the master, and the
    updated shards are all-gathered back into every rank's weights.

    It is lesson 01's data-parallel wrapper to its callers: `.module`, `.dp_group`,
    `.require_backward_grad_sync`, `.finish_gradient_synchronization()` and `.zero_grad()`; the
    step's tail (finish_step) hands the summed shard to the master (`.gradients_to_master()`),
    clips it and steps through `.step`. `replicate=True` is ZeRO stage 0: one shard, the buffers
    all-reduced, nothing gathered; lesson 01 with a float32 master, kept instead of lesson 01's
    wrapper because checkpoints and bf16 weights read the units of every stage the same way.

    Gradients: every parameter has a post-accumulate hook; when all of a unit's parameters hold
    this micro-batch's gradient, they are added into the unit's flat buffer (in the reduce dtype)
    and dropped. On the last micro-batch the unit's reduction starts at once, while autograd still
    computes the units before it; each unit reduces its own buffer in place, so every unit's
    reduction may be in flight together. The step's first micro-batch writes the buffer instead of
    adding to it, so zero_grad zeroes nothing: it marks the buffers as holding no gradient.

    Weights: the step ends with every unit's all-gather started, none waited for. A forward
    pre-hook on each unit waits for that unit's gather alone, just before it computes, so the
    later units' gathers run while the earlier ones compute (Megatron's overlap of the parameter
    all-gather with the forward):

        step:     AdamW  gather(u0) gather(u1) gather(u2) ...      (started, in flight)
        forward:  wait(u0) [u0 fwd] wait(u1) [u1 fwd] wait(u2) ...

    A forward of any kind (validation, a sample) waits the same way; whatever reads the weights
    otherwise (a checkpoint, the end of the run) calls wait_for_weights() first.
    `overlap_weight_gather=False` waits for every gather inside the step instead.
    """

    stage = 1

    def __init__(self, module: nn.Module, group, precision: Precision = Precision(), replicate: bool = False,
                 overlap_weight_gather: bool = True):
        super().__init__()
        if replicate:
            self.stage = 0
        self.module, self.dp_group, self.precision = module, group, precision
        self.require_backward_grad_sync = True
        names = {param: name for name, param in module.named_parameters()}
        self.unit_groups = [self.flat_units([(names[p], p) for m in modules for p in m.parameters()])
                            for modules in unit_modules(module)]
        self.units = [unit for units in self.unit_groups for unit in units]
        if sum(len(unit.params) for unit in self.units) != len(names):
            raise ConfigError("every parameter must belong to exactly one unit (embedding, block or head)")
        self._reductions = []       # this step's reductions in flight
        self._weight_gathers = {}   # module unit index -> its flat units' all-gathers in flight
        for unit in self.units:
            self._shard_states(unit)
            for param in unit.params:
                param.register_post_accumulate_grad_hook(partial(self._grad_ready, unit))
        # Stage 0 gathers nothing, and ZeRO-3 gathers each unit before its forward anyway.
        self.overlap_weight_gather = overlap_weight_gather and self.stage in (1, 2)
        if self.overlap_weight_gather:
            for index, modules in enumerate(unit_modules(module)):
                modules[0].register_forward_pre_hook(partial(self._gathered_before_forward, index))

    def flat_units(self, named_params: list) -> list[FlatUnit]:
        """A module unit's flat units: one, over the data-parallel group, with a shard per rank
        (stage 0: one shard, the whole unit)."""
        sharded = self.stage > 0
        return [FlatUnit(named_params, group_size(self.dp_group) if sharded else 1,
                         group_rank(self.dp_group) if sharded else 0, self.dp_group)]

    def _shard_states(self, unit: FlatUnit) -> None:
        """The unit's weights, its float32 master shard and its gradient buffer."""
        values = unit.flatten([p.detach() for p in unit.params], torch.float32)
        unit.master = master_weights(self._hold_weights(unit, values), unit.shard(values))
        for piece in unit.pieces:
            piece.master = unit.master[piece.lo: piece.hi]
        self._hold_gradients(unit, values.device)

    def _hold_weights(self, unit: FlatUnit, values: torch.Tensor) -> torch.Tensor:
        """The whole flat weights in the weights' dtype, which the parameters point into; returns
        this rank's shard of them."""
        unit.flat_params = values.to(self.precision.param_dtype)
        unit.use_flat_parameters(unit.flat_params)
        return unit.shard(unit.flat_params)

    def _hold_gradients(self, unit: FlatUnit, device) -> None:
        """A whole gradient buffer (its padding zero: no gradient reaches it, a sum of zeros is
        zero, and each step's first gradient zeroes it again); its shard is where this rank's
        summed gradient lands."""
        unit.grad_buffer = torch.zeros(unit.padded_numel, dtype=self.precision.reduce_dtype, device=device)
        unit.grad_views = unit.views(unit.grad_buffer)
        unit.grad_shard = unit.shard(unit.grad_buffer)
        unit.has_grad = False       # whether a micro-batch of this step has written its gradient yet

    def _grad_ready(self, unit: FlatUnit, param) -> None:
        unit.n_ready += 1
        if unit.n_ready == len(unit.params):
            unit.n_ready = 0
            grads = [p.grad for p in unit.params]
            for param in unit.params:
                param.grad = None
            self._reduce(unit, grads)

    def _reduce(self, unit: FlatUnit, grads: list[torch.Tensor]) -> None:
        # The step's first gradient is written straight into the buffer, cast to the reduce dtype on
        # the way (one pass: no zeroed buffer to add it to, no flat copy); later micro-batches add
        # theirs in place, parameter by parameter. Each element sees the same float additions as
        # a zeroed buffer plus flat copies would give it, in the same order: the same bits, but for
        # a gradient of -0.0, which stays -0.0 where 0 + -0.0 made +0.0 (equal numbers).
        if unit.has_grad:
            torch._foreach_add_(unit.grad_views, grads)
        else:
            torch.cat([grad.reshape(-1) for grad in grads], out=unit.grad_buffer[: unit.numel])
            # The padding too: no gradient reaches it, but a step skipped for a non-finite norm
            # scaled it by NaN, and left so every later norm would be NaN.
            unit.grad_buffer[unit.numel:].zero_()
            unit.has_grad = True
        # Summed, never averaged: each rank's loss is its share of the global batch's mean (train_step).
        if not self.require_backward_grad_sync:
            return                  # an earlier micro-batch of the step: accumulate only
        if self.stage == 0:
            work = comm.call(dist.all_reduce, unit.grad_buffer, group=unit.group, async_op=True)
        else:
            # In place: this rank's shard of the buffer receives the sum of every rank's shard.
            work = comm.call(comm.reduce_scatter_single, unit.grad_shard, unit.grad_buffer, group=unit.group,
                             async_op=True)
        self._reductions.append(work)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def finish_gradient_synchronization(self) -> None:
        for work in self._reductions:
            work.wait()
        self._reductions.clear()

    def gradients_to_master(self) -> None:
        """This rank's summed gradient shard as the float32 gradients of its master pieces (in
        float32 a view, no copy; in bf16 one cast per unit, not one per piece), which clipping
        scales and AdamW steps with."""
        for unit in self.units:
            grad_shard = unit.grad_shard.to(torch.float32)
            for piece in unit.pieces:
                piece.master.grad = grad_shard[piece.lo: piece.hi]

    def step(self, optimizer, grad_norm: torch.Tensor, grad_scale: torch.Tensor | None = None) -> torch.Tensor:
        """AdamW on this rank's shard of the float32 master unless the norm is not finite
        (optimizer_step: returns whether it skipped; `grad_scale`, the fused tail's clipping),
        its gradients dropped after (they are rebuilt from the shard each step), then every
        rank's weights updated: their all-gathers started, and waited for here only without the
        overlap."""
        self.wait_for_weights()     # a unit no forward ran since the last step: its gather reads the master
        skipped = optimizer_step(optimizer, grad_norm, grad_scale)
        optimizer.zero_grad()
        self._start_weight_gathers()
        if not self.overlap_weight_gather:
            self.wait_for_weights()
        return skipped

    def _publish(self, unit: FlatUnit):
        """Cast the updated master into this rank's shard of the weights, then start gathering every
        shard in place; returns the all-gather in flight (stage 0 has one shard: None, nothing to gather)."""
        owner = unit.shard(unit.flat_params)
        if owner.data_ptr() != unit.master.data_ptr():
            owner.copy_(unit.master)
        if self.stage == 0:
            return None
        return comm.call(comm.all_gather_single, unit.flat_params, owner, group=unit.group, async_op=True)

    def _start_weight_gathers(self) -> None:
        """Every unit's weights from the master, gathers left in flight, kept by module unit."""
        for index, units in enumerate(self.unit_groups):
            gathers = [work for work in map(self._publish, units) if work is not None]
            if gathers:
                self._weight_gathers[index] = gathers

    def _gathered_before_forward(self, index: int, module, args) -> None:
        """Module unit `index` whole before it computes: its own gathers waited for, the later
        units' left running (on a GPU, wait() orders the compute stream after the gather: the host
        does not block)."""
        for work in self._weight_gathers.pop(index, ()):
            work.wait()

    def wait_for_weights(self) -> None:
        """Every unit's weights whole: each gather still in flight waited for. A forward waits unit
        by unit by itself; anything else that reads the weights or the master calls this first."""
        for index in list(self._weight_gathers):
            self._gathered_before_forward(index, None, None)

    def zero_grad(self, set_to_none: bool = False) -> None:
        """The next step's first micro-batch overwrites the gradients: nothing to zero."""
        for unit in self.units:
            unit.has_grad = False

    def publish_master(self) -> None:
        """Every rank's weights from the master, gathered before it returns: after a checkpoint or
        a Hub folder loaded the master."""
        self._start_weight_gathers()
        self.wait_for_weights()


def build_sharded_optimizer(model: ZeroDataParallel, lr: float) -> torch.optim.AdamW:
    """The shared AdamW over this rank's pieces: each piece takes its own parameter's name, so
    the same name rule puts it in the decayed or the undecayed group (padding stays zero)."""
    return build_optimizer([(piece.name, piece.master) for unit in model.units for piece in unit.pieces], lr)


# ============================================================================ the technique: ZeRO-2, the gradients sharded too


class ZeroStage2(ZeroDataParallel):
    """ZeRO-1 with the gradients sharded too: a rank keeps only its shard of each unit's gradient.

    Whole gradients cannot wait for the step's last micro-batch any more, so each unit's gradient
    is reduce-scattered as soon as it is complete, at every micro-batch, and added into this rank's
    shard; its flat copy is freed when the reduction finishes. Each reduction in flight needs such
    a copy, so one is in flight at a time: at most one unit's whole gradient is alive.

    Under gradient accumulation that is a real trade-off. Reduce-scattering at every micro-batch
    keeps gradients at Psi/N per rank but sends them A times per step (A micro-batches): a payload
    of A Psi, against Psi for ZeRO-1, which accumulates whole gradients first and so holds their
    full 2 Psi bytes (bf16) through the step.
    """

    stage = 2
    _in_flight = None       # (work, unit, partial shard, flat gradient) of the reduction running

    def _hold_gradients(self, unit: FlatUnit, device) -> None:
        unit.grad_shard = torch.zeros(unit.shard_numel, dtype=self.precision.reduce_dtype, device=device)
        unit.has_grad = False

    def _reduce(self, unit: FlatUnit, grads: list[torch.Tensor]) -> None:
        # The step's first reduction lands in the shard itself (nothing to zero, nothing to add);
        # later ones land beside it and are added when they finish.
        self._finish_in_flight()
        flat_grad = unit.flatten(grads, self.precision.reduce_dtype)
        partial_shard = torch.empty_like(unit.grad_shard) if unit.has_grad else None
        work = comm.call(comm.reduce_scatter_single, unit.grad_shard if partial_shard is None else partial_shard,
                         flat_grad, group=unit.group, async_op=True)
        unit.has_grad = True
        self._in_flight = (work, unit, partial_shard, flat_grad)

    def _finish_in_flight(self) -> None:
        if self._in_flight is not None:
            work, unit, partial_shard, _ = self._in_flight
            work.wait()
            if partial_shard is not None:
                unit.grad_shard += partial_shard
            self._in_flight = None

    def finish_gradient_synchronization(self) -> None:
        self._finish_in_flight()


# ============================================================================ the technique: ZeRO-3, the weights sharded too


class ZeroStage3(ZeroStage2):
    """ZeRO-2 with the weights sharded too: they live as shards, and each unit is gathered just in time.

        forward:   gather(u0)  [u0 fwd | gather(u1)]  free(u0)  [u1 fwd | gather(u2)]  free(u1) ...
        backward:  ... [u2 bwd | gather(u1)] reduce-scatter(u2) free(u2)  [u1 bwd | gather(u0)] ...

    A unit's gather is started (prefetched) when the unit before it starts computing, so at most
    two units are gathered at once. Backward needs a unit's weights again: a hook on the unit's
    output fires when that output's gradient arrives, just before the unit's backward, and gathers
    it. `reshard_after_forward=False` keeps units gathered from forward to backward (FSDP2's
    option): one all-gather per unit and micro-batch less, the whole model's weights at the peak.
    """

    stage = 3

    def __init__(self, module: nn.Module, group, precision: Precision = Precision(),
                 reshard_after_forward: bool = True, prefetch: bool = True):
        super().__init__(module, group, precision)
        self.reshard_after_forward, self.prefetch = reshard_after_forward, prefetch
        for index, modules in enumerate(unit_modules(module)):
            modules[0].register_forward_pre_hook(partial(self._before_forward, index))
            modules[-1].register_forward_hook(partial(self._after_forward, index))

    def _hold_weights(self, unit: FlatUnit, values: torch.Tensor) -> torch.Tensor:
        """Only this rank's shard of the weights; the parameters point at nothing until a gather."""
        unit.param_shard = unit.shard(values).to(self.precision.param_dtype).clone()
        unit.pending = None     # the all-gather in flight, if any
        unit.release_parameters()
        return unit.param_shard

    def _gather(self, index: int) -> None:
        """Start gathering the flat units of module unit `index` (those not gathered or on their
        way). The parameters point at the buffer at once: that is when its memory is taken."""
        if not 0 <= index < len(self.unit_groups):
            return
        for unit in self.unit_groups[index]:
            if unit.pending is not None or unit.params[0].numel() > 0:
                continue
            flat = torch.empty(unit.padded_numel, dtype=unit.param_shard.dtype, device=unit.param_shard.device)
            unit.pending = comm.call(comm.all_gather_single, flat, unit.param_shard, group=unit.group, async_op=True)
            unit.use_flat_parameters(flat)

    def _wait_for(self, index: int, then_prefetch: int) -> None:
        """Module unit `index` gathered and ready; then, with prefetch, the gather of the unit that
        computes next (`then_prefetch`: the next one in forward, the one before in backward) started."""
        self._gather(index)
        for unit in self.unit_groups[index]:
            if unit.pending is not None:
                unit.pending.wait()
                unit.pending = None
        if self.prefetch:
            self._gather(then_prefetch)

    def _before_forward(self, index, module, args):
        self._wait_for(index, then_prefetch=index + 1)

    def _after_forward(self, index, module, args, output):
        if self.reshard_after_forward:
            for unit in self.unit_groups[index]:
                unit.release_parameters()
        if torch.is_grad_enabled() and output.requires_grad:
            output.register_hook(partial(self._before_backward, index))

    def _before_backward(self, index, grad):
        self._wait_for(index, then_prefetch=index - 1)

    def _reduce(self, unit: FlatUnit, grads: list[torch.Tensor]) -> None:
        """The unit's gradient is on its way: its gathered weights are freed until the next forward."""
        super()._reduce(unit, grads)
        unit.release_parameters()

    def _publish(self, unit: FlatUnit) -> None:
        """Only the shard changes: the next forward gathers it."""
        if unit.param_shard.data_ptr() != unit.master.data_ptr():
            unit.param_shard.copy_(unit.master)


# ============================================================================ the technique: mixed precision


def master_weights(weights_shard: torch.Tensor, float32_shard: torch.Tensor) -> torch.Tensor:
    """The float32 master of this rank's shard, which AdamW steps. `--dtype bfloat16` keeps the
    weights in bf16 (what the model computes with and ZeRO-3 all-gathers: half the bytes) and a
    float32 copy here, with float32 Adam states, so that an update below bf16's resolution near a
    weight (2^-8 relative) still accumulates; each step casts the master back into the weights
    (_publish). In float32 the weights' own shard is the master: no copy. The gradients are
    accumulated and reduced in Precision.reduce_dtype (`--reduce-dtype`)."""
    return weights_shard if weights_shard.dtype == torch.float32 else float32_shard.clone()


def precision_from_flags(dtype: str, reduce_dtype: str, device) -> Precision:
    param_dtype = autocast_dtype(dtype, device)
    reduce = param_dtype if reduce_dtype == "auto" else getattr(torch, reduce_dtype)
    return Precision(param_dtype, reduce)


# ============================================================================ the technique: a ZeRO step


def wrap_zero(module: nn.Module, group, stage: int, precision: Precision = Precision(),
              reshard_after_forward: bool = True, prefetch: bool = True,
              overlap_weight_gather: bool = True) -> ZeroDataParallel:
    """`module` in its compute dtype's place: cast nothing beforehand, the units do it.
    reshard_after_forward and prefetch are ZeRO-3's, overlap_weight_gather ZeRO-1/2's."""
    if stage == 3:
        return ZeroStage3(module, group, precision, reshard_after_forward, prefetch)
    if stage == 2:
        return ZeroStage2(module, group, precision, overlap_weight_gather=overlap_weight_gather)
    return ZeroDataParallel(module, group, precision, replicate=stage == 0, overlap_weight_gather=overlap_weight_gather)


def clip_sharded_gradients(model: ZeroDataParallel, optimizer, settings: StepSettings):
    """The shared gradient clipping (train.clip_gradients) on this rank's master pieces: each rank
    sums the squares of its own gradient shard, an all-reduce over the shard group (and lesson
    07's other axes: settings.norm_groups) sums the ranks, and every rank scales its pieces by the
    same factor (or, on the fused tail, hands 1 / factor to the optimizer: the grad_scale it
    returns beside the norm). Whether a piece counts is asked of its parameter; padding's gradient
    is zero."""
    counts = settings.counts_toward_norm or (lambda param: True)
    param_of = {piece.master: piece.param for unit in model.units for piece in unit.pieces}
    groups = settings.norm_groups if model.stage == 0 else (model.dp_group, *settings.norm_groups)
    return clip_gradients(optimizer, param_of, replace(
        settings, norm_groups=groups,
        counts_toward_norm=lambda master: param_of[master] is None or counts(param_of[master])))


def train_step(model: ZeroDataParallel, optimizer, batch: StepBatch, settings: StepSettings) -> StepResult:
    """Lesson 01's micro-batch loop (forward, backward: the units reduce as their gradients arrive),
    then the sharded tail."""
    loss = data_parallel.forward_backward(model, batch, settings)
    return finish_step(model, optimizer, loss, settings)


def finish_step(model: ZeroDataParallel, optimizer, loss: torch.Tensor, settings: StepSettings) -> StepResult:
    """The sharded tail of a step: the last reductions waited for, the norm from the shards, the
    step on the master shard, the weights published, and this rank's loss share summed over the
    data-parallel group."""
    model.finish_gradient_synchronization()
    model.gradients_to_master()
    grad_norm, grad_scale = clip_sharded_gradients(model, optimizer, settings)
    skipped = model.step(optimizer, grad_norm, grad_scale)
    model.zero_grad()
    comm.call(dist.all_reduce, loss, group=model.dp_group)
    return StepResult(loss, grad_norm, skipped=skipped)     # tensors: the shared loop reads them a step later


def evaluate(model: ZeroDataParallel, batch: StepBatch, settings: StepSettings) -> float:
    """Lesson 01's forward-only loss. ZeRO-3's hooks gather each unit before its forward and free
    it after, gradients or not; kept gathered (--no-reshard-after-forward), the units are freed
    here instead, where backward would have freed them: a step starts from shards, and validation
    leaves the run as it found it."""
    loss = data_parallel.evaluate(model, batch, settings)
    release_gathered(model)
    return loss


def release_gathered(model: ZeroDataParallel) -> None:
    """After a forward without backward: ZeRO-3's units freed (lower stages never gather)."""
    if isinstance(model, ZeroStage3):
        for unit in model.units:
            unit.release_parameters()


def step_settings(device, precision: Precision, max_grad_norm: float, tail: str = "auto") -> StepSettings:
    """Autocast in the weights' dtype (a no-op on bf16 weights' matmuls, the float32 norms and loss
    as in the reference); the norm's sum over the shards is clip_sharded_gradients' own."""
    return StepSettings(device, precision.param_dtype, max_grad_norm, tail=tail)


# ============================================================================ configuration rules


def validate_zero(dtype: str, reduce_dtype: str) -> None:
    """ZeRO's own rule, before any process group exists."""
    if dtype == "float32" and reduce_dtype == "bfloat16":
        raise ConfigError("bad ZeRO configuration: --reduce-dtype bfloat16 with --dtype float32 rounds float32 "
                          "gradients to 8 bits for nothing; use --dtype bfloat16 or --reduce-dtype float32")


def validate(cfg, grid: GridShape, shape, args, world_size: int) -> None:
    """plan_run's hook: the grid's rules, a dense model (lesson 07 composes ZeRO with experts), ZeRO's."""
    validate_parallel_config(grid, world_size)
    if cfg.n_experts:
        raise ConfigError(f"n_experts={cfg.n_experts}: this lesson shards a dense model; ZeRO with experts (their "
                          f"units over edp) is lesson 07's composition: run 07_full_5d.py with the same flags")
    validate_zero(args.dtype, args.reduce_dtype)


# ============================================================================ measuring the three challenges


def measured_model_states(model: ZeroDataParallel, optimizer) -> ModelStates:
    """The bytes of every storage this rank holds, each counted once, in the first role it has:
    weights (whole or shard), gradients (buffers and any .grad), master, Adam's moments."""
    seen: set[int] = set()
    params = list(model.module.parameters())
    shards = [unit.param_shard for unit in model.units if model.stage == 3]
    grads = [p.grad for p in params if p.grad is not None] + [unit.grad_shard for unit in model.units]
    return ModelStates(storage_bytes(params + shards, seen), storage_bytes(grads, seen),
                       storage_bytes((unit.master for unit in model.units), seen),
                       storage_bytes(optimizer_state_tensors(optimizer), seen))


def predicted_model_states(unit_counts: list[int], n: int, stage: int, precision: Precision) -> ModelStates:
    """The stage's formula (the module docstring's table) for units of `unit_counts` parameters,
    each padded to a multiple of the shard count (1 at stage 0)."""
    shards = 1 if stage == 0 else n
    total = sum(padded(count, shards) for count in unit_counts)
    p, g = precision.param_dtype.itemsize, precision.reduce_dtype.itemsize
    master = 4 if precision.param_dtype != torch.float32 else 0
    return ModelStates(parameters=p * (total // shards if stage == 3 else total),
                       gradients=g * (total // shards if stage >= 2 else total),
                       master_weights=master * total // shards, optimizer_states=8 * total // shards)


def predicted_zero_traffic(unit_counts: list[int], n: int, stage: int, precision: Precision, n_micro: int,
                           reshard_after_forward: bool, group: str) -> dict:
    """Payload bytes per step of ZeRO's collectives on the group the meter calls `group` (the
    module docstring's table)."""
    shards = 1 if stage == 0 else n
    total = sum(padded(count, shards) for count in unit_counts)
    p, g = precision.param_dtype.itemsize, precision.reduce_dtype.itemsize
    if stage == 0:
        return data_parallel_traffic(total, g, group)      # lesson 01's all-reduce
    scatters = 1 if stage == 1 else n_micro
    gathers = 1 if stage < 3 else n_micro * (2 if reshard_after_forward else 1)
    return {("reduce_scatter_single", group): scatters * g * total,
            ("all_gather_single", group): gathers * p * total}


def predicted_gathered_peak(unit_bytes: list[int], reshard_after_forward: bool = True, prefetch: bool = True) -> int:
    """ZeRO-3's most gathered weight bytes, from each module unit's bytes once gathered (padded):
    two neighbouring units with prefetch, one without, all of them when units stay gathered from
    forward to backward."""
    if not reshard_after_forward:
        return sum(unit_bytes)
    if not prefetch:
        return max(unit_bytes)
    return max([*unit_bytes, *(a + b for a, b in zip(unit_bytes, unit_bytes[1:]))])


def log_model_states(model: ZeroDataParallel, optimizer, title: str, predicted: ModelStates,
                     gathered: GatheredParameterMeter, predicted_peak: int) -> None:
    """ZeRO's own memory rows: the model states this rank holds next to `predicted` and, at stage
    3, the peak of gathered weights next to `predicted_peak`."""
    log0(f"\n== memory (one rank; {title}) ==")
    log0(memory_table(measured_model_states(model, optimizer), predicted, "model states per rank"))
    if model.stage == 3:
        largest = max(unit.numel for unit in model.units) * model.precision.param_dtype.itemsize
        log0(f"gathered weights at the peak: {gathered.peak_bytes / 1e6:.3f} MB measured, "
             f"{predicted_peak / 1e6:.3f} MB predicted (largest flat unit {largest / 1e6:.3f} MB)")


def report(model: ZeroDataParallel, run: MeteredRun, gathered: GatheredParameterMeter, n_micro: int) -> None:
    """The model states (and ZeRO-3's gathered peak), the traffic per step and the compute report,
    each next to its formula applied to the units' parameter counts."""
    n, stage, precision = group_size(model.dp_group), model.stage, model.precision
    counts, group = [unit.numel for unit in model.units], comm.group_name(model.dp_group)
    reshard, prefetch = (model.reshard_after_forward, model.prefetch) if stage == 3 else (True, True)
    peak = predicted_gathered_peak([padded(count, n) * precision.param_dtype.itemsize for count in counts],
                                   reshard, prefetch)
    log_model_states(model, run.optimizer, f"ZeRO-{stage} over {n} ranks; weights {precision.param_dtype}, "
                     f"gradients {precision.reduce_dtype}", predicted_model_states(counts, n, stage, precision),
                     gathered, peak)
    # ZeRO's reduce-scatters and all-gathers take the place of lesson 01's gradient all-reduce
    log_traffic_rows(run, f"{n_micro} micro-batches", technique={},
                     gradients=predicted_zero_traffic(counts, n, stage, precision, n_micro, reshard, group),
                     loss_groups=(group,), norm_groups=(group,) if stage else ())
    log_compute_report(run)


# ============================================================================ main


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description="Lesson 06: ZeRO stages 0-3 (run with torchrun).",
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_parallel_flags(parser, axes=("dp",), fill_axis="dp", bucket_flag=False)
    add_zero_flags(parser)
    add_training_flags(parser, micro_batch_size=4, grad_accum=2, steps=20)
    return parser.parse_args(argv)


def add_zero_flags(parser) -> None:
    """This lesson's flags."""
    parser.add_argument("--zero-stage", type=int, choices=(0, 1, 2, 3), default=3,
                        help="0: replicate (lesson 01); 1: shard Adam; 2: and gradients; 3: and weights (lesson 07: "
                             "3, or 1 under a pipeline, unless given)")
    # float32 by default, as torchtitan does: summing micro-batches' and ranks' gradients in bf16 keeps
    # 8 bits of mantissa, so small contributions vanish into large ones; bf16 halves the bytes reduced.
    parser.add_argument("--reduce-dtype", choices=("auto", "float32", "bfloat16"), default="float32",
                        help="gradient accumulation and reduction dtype; auto: that of --dtype, which here "
                             "is also the dtype the weights are held and gathered in (fp32 master kept)")
    parser.add_argument("--reshard-after-forward", action=argparse.BooleanOptionalAction, default=True,
                        help="ZeRO-3: free each unit after its forward and gather it again for backward")
    parser.add_argument("--prefetch", action=argparse.BooleanOptionalAction, default=True,
                        help="ZeRO-3: start gathering the next unit while this one computes")
    parser.add_argument("--overlap-weight-gather", action=argparse.BooleanOptionalAction, default=True,
                        help="ZeRO-1/2: leave the updated weights' all-gathers running after the step, each unit's "
                             "waited for just before its next forward; off: the step waits for them all")


def main(argv=None):
    args = parse_args(argv)
    plan = plan_run(args, validate)
    device = init_distributed()
    grid = ProcessGrid(plan.grid)
    precision = precision_from_flags(args.dtype, args.reduce_dtype, device)
    model = wrap_zero(GPT(plan.cfg, seed=args.seed).to(device), grid.dp_group, args.zero_stage, precision,
                      args.reshard_after_forward, args.prefetch, args.overlap_weight_gather)
    optimizer = build_sharded_optimizer(model, args.lr)
    settings = step_settings(device, precision, args.max_grad_norm, args.step_tail)
    log0(f"lesson 06: ZeRO-{args.zero_stage} over dp = {grid.dp_size} ranks, {len(model.units)} units, "
         f"weights {precision.param_dtype}, gradients {precision.reduce_dtype}, "
         f"{count_parameters(plan.cfg)['total']:,} parameters, {plan.shape.tokens_per_step:,} tokens per step")

    gathered = GatheredParameterMeter(model.module)
    batches = RankBatches(plan.batches, grid.dp_rank, device, val=plan.val_batches)    # this rank's share
    throughput = train(args, optimizer, partial(train_step, model, optimizer, settings=settings), batches,
                       evaluate=partial(evaluate, model, settings=settings),
                       meters=StepMeters((SavedTensorMeters(gathered),)), cfg=plan.cfg)
    model.wait_for_weights()        # the last step's gathers, before the report and the process group's end
    report(model, MeteredRun(model.module, optimizer, None, throughput, plan.cfg, plan.shape.seq_len, grid.dp_size,
                             device, throughput.steps), gathered, plan.shape.grad_accum)
    shutdown()


if __name__ == "__main__":
    main()
