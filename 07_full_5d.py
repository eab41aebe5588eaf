"""
Lesson 07 — the full 5D-parallel trainer: every earlier lesson in one run, and activation recomputation.

The problem. Each lesson so far fixes one limit: 01 the time (more ranks, more tokens), 02 a
layer too wide for one device, 03 a model too deep, 04 a sequence too long, 05 experts too many,
06 optimizer states too big. A real pretraining run hits all of them at once, and one more: the
activations that backward needs. With the 8b preset, 4096 tokens per sequence and one sequence
per micro-batch, the blocks keep about 31 GB per micro-batch in bf16, however the weights are split.

The idea. Nothing new is parallelised here; the lessons compose, each wrapping the result of the
one before, in the order their assumptions need (parallelize() below is the plan):

    reference GPT, or this rank's pipeline chunks (03: a stage, or v for interleaved 1F1B)
      -> tensor parallel layers                   (02; experts: their own column/row split)
      -> context-parallel attention               (04)
      -> experts sharded over ep and dispatched   (05)
      -> ZeRO over the dp x cp ranks              (06; stage 0 is lesson 01's all-reduce)
      -> each block compiled (--compile)          (this lesson)
      -> activation recomputation                 (this lesson)
      -> the pipeline schedule over the stage     (03)

Lessons 02-06 each teach one technique with data parallelism; everything that spans two of them
lives here: each seam where two meet (a function of its own, below parallelize), the composed
step (03's schedule or 01's loop, 06's sharded tail, 05's router biases), the rules of what does
not compose (composition_problems) and the traffic prediction, each lesson's formula added once.

Activation recomputation trades compute for that memory (torch.utils.checkpoint, non-reentrant:
a region keeps only its inputs and runs again when backward first needs something inside it).
`--recompute full` (Chen et al. 2016) makes each block one region: only its input is kept, and
its forward, collectives included, runs again just before its backward. `--recompute selective`
(after Megatron, Korthikanti et al. 2022) recomputes only what is large but cheap: each RMSNorm's
arithmetic and SwiGLU's silu(gate), elementwise work, no matmul, no collective. (Megatron
recomputes the attention core; scaled_dot_product_attention never stores its s^2 scores, so
that would save far less here.)

The price, per micro-batch (dense, float32, per token and layer; /cp tokens, attention's and the
MLP's tensors /tp, the norms' only under sequence parallelism):
    kept         none 9h + 2 n_kv d + 4f + n_heads + 2 elements; selective 2(h + 1) + f fewer; full h
                 (8b, 4096 tokens, bf16: none 31.8 GB, selective 21.6 GB, full 3.3 GB)
    compute      selective: the norms' and silu's elementwise work again; full: one more forward
                 of every block, about 4/3 of the blocks' FLOPs
    traffic      selective: none; full: the blocks' forward collectives once more (but each
                 block's last), and with experts every forward all-to-all of the dispatch

Around the composition, what a real run needs: `--plan` (07_memory_plan.py: will a layout fit,
and which layouts do, before launch), checkpoints that resume in any layout (--save-dir,
--resume), the GPU fast paths (flash attention, a fused ring block, fused AdamW, --compile).
FP8 matmuls: --fp8 (07_fp8.py). Lesson 03's zero-bubble schedule (03_zero_bubble.py, --schedule
zero-bubble) with tp, cp, experts, FP8 and ZeRO-0/1: every block's weight gradients wait for W
(defer_block_weight_gradients).
Out of scope here: fp16 with loss scaling (bf16 needs none).

Run it:
    torchrun --nproc_per_node=4 07_full_5d.py --dp 2 --tp 2 --zero-stage 1 --recompute full
    torchrun --nproc_per_node=4 07_full_5d.py --dp 2 --tp 2 --zero-stage 1 --recompute selective --dtype bfloat16
    torchrun --nproc_per_node=4 07_full_5d.py --pp 2 --cp 2 --zero-stage 1 --recompute full
    torchrun --nproc_per_node=4 07_full_5d.py --pp 2 --dp 2 --zero-stage 1 --schedule interleaved --virtual-stages 2
    torchrun --nproc_per_node=4 07_full_5d.py --pp 2 --tp 2 --zero-stage 1 --schedule zero-bubble --grad-accum 4
    torchrun --nproc_per_node=4 07_full_5d.py --preset tiny-moe --dp 2 --cp 2 --ep 2 --zero-stage 1
    torchrun --nproc_per_node=2 07_full_5d.py --cp 2 --zero-stage 3 --recompute full --compile
    torchrun --nproc_per_node=4 07_full_5d.py --dp 2 --tp 2 --zero-stage 1 --save-dir ckpt --save-every 10
    torchrun --nproc_per_node=2 07_full_5d.py --dp 2 --zero-stage 3 --save-dir ckpt --resume   # 4 -> 2 ranks
    python 07_full_5d.py --plan --preset 8b --gpus 8 --gpu B300 --seq-len 8192 --micro-batch-size 1 --grad-accum 8

What to look for: the activation table, the run's mode measured equal to its prediction and every
mode's prediction with its saving against none; the traffic table, where full recomputation adds
the blocks' forward collectives again and selective adds none.

More: docs/07_full_5d.md (the seams and refusals, each mode's bytes derived, the fast paths, the
plan); docs/running.md (checkpoints, faults, large runs).
"""

from __future__ import annotations

import argparse
import copy
import itertools
import math
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from dataclasses import asdict, astuple, dataclass, replace
from functools import lru_cache, partial

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import picotron_like.checkpoint as checkpoints
import picotron_like.hf as hub
import picotron_like.sample as sampling
from picotron_like import comm
from picotron_like.data import StepBatch
from picotron_like.lessons import load_lesson
from picotron_like.metrics import (ActivationMeter, BalancingLog, GatheredParameterMeter, MeteredRun, ModelStates,
                                    RoutingMeter, SavedTensorMeters, add_traffic, log0, log_compute_report,
                                    predicted_activation_bytes, step_bookkeeping_traffic)
from picotron_like.model import GPT, RMSNorm, SwiGLU, count_parameters, reference_init
from picotron_like.moe import moe_layers
from picotron_like.pipeline_tools import is_transfer_batch, peak_live_micro_batches
from picotron_like.topology import ConfigError, ProcessGrid, group_rank, group_size, init_distributed, shutdown
from picotron_like.run_control import AfterStep, StepMeters, follow_time_budget
from picotron_like.train import (DataParallelModel, RankBatches, StepResult, StepSettings, add_parallel_flags,
                                 add_training_flags, batch_shape, exit_with_error, plan_run, traffic_not_counted, train)

data_parallel = load_lesson("01_data_parallel")
tensor_parallel = load_lesson("02_tensor_parallel")
pipeline_parallel = load_lesson("03_pipeline_parallel")
zero_bubble = load_lesson("03_zero_bubble")
context_parallel = load_lesson("04_context_parallel")
expert_parallel = load_lesson("05_expert_parallel")
zero = load_lesson("06_zero")
fp8 = load_lesson("07_fp8")

RECOMPUTE_MODES = ("none", "selective", "full")

# ============================================================================ the technique: the plan


def parallelize(cfg, grid: ProcessGrid, args, device, values_to_load: bool = False):
    """This rank's model and, with pp > 1, the pipeline that runs it: one lesson's entry point per
    line, in the order their assumptions need. Each works on whatever the line before produced, a
    whole GPT or one pipeline chunk; the seams where two techniques meet are the next section.
    values_to_load: a checkpoint or a Hub folder gives every value next (nothing is drawn)."""
    shape = batch_shape(args, grid.dp_size)
    precision = zero.precision_from_flags(args.dtype, args.reduce_dtype, device)
    grouped = uses_grouped_experts(args, cfg, grid.tp_size, precision.param_dtype, device)
    # 03: this rank's pipeline stage, or its v chunks for interleaved 1F1B; the whole GPT at pp = 1.
    # Built on the meta device (shapes, no values) and cut there by the lessons below, so that no
    # rank holds more than its share (the 8b preset whole: 32 GB per rank, 8 ranks per node).
    with torch.device("meta"):
        chunks = (pipeline_parallel.build_stage_chunks(cfg, args.seed, grid.pp_size, grid.pp_rank,
                                                       args.virtual_stages)
                  if grid.pp_size > 1 else [GPT(cfg, seed=args.seed)])
    for chunk in chunks:
        if grid.tp_size > 1:            # 02: attention heads, MLP width and vocabulary over tp
            split_over_tensor_parallel(chunk, grid, cfg, args.sequence_parallel)
        if grid.cp_size > 1:            # 04: each attention core over the cp ranks' parts of the sequence
            context_parallel.apply_context_parallel(chunk, context_parallel_peers(grid, args), args.cp_mode)
        if cfg.n_experts:               # 05: the experts over ep, dispatched by all-to-all; balancing global
            expert_parallel.apply_expert_parallel(chunk, expert_parallel.ExpertParallel.from_grid(grid),
                                                  expert_runner(grouped, grid))
            expert_parallel.prepare_balancing(chunk, shape.sequences_per_step)
            if grid.tp_size > 1:        # tp x experts: each of this rank's experts split over tp
                split_experts_over_tensor_parallel(chunk, grid.tp_group)
            if grid.cp_size > 1:        # cp x balancing: the aux loss counts whole sequences
                count_choices_over_context_parallel(chunk, grid.cp_group)
        # 07_fp8: the blocks' matmuls in FP8, scales as one device's (amaxes over tp, and cp's tokens)
        fp8.apply_fp8(chunk, args.fp8, grid.tp_group, grid.cp_group if grid.cp_size > 1 else None)
    # this lesson: each parameter the reference's values of what this rank holds of it, on the device
    materialise_held_parameters(chunks, None if values_to_load else ReferenceTensors.of(cfg, args.seed), grid, device)
    # 06: ZeRO over the dp x cp ranks, which hold the same weights (experts: over edp); stage 0 is 01's sum
    model = (wrap_zero_with_experts(one_module(chunks, grid), grid, args, precision) if cfg.n_experts else
             zero.wrap_zero(one_module(chunks, grid), grid.dp_cp_group, args.zero_stage, precision,
                            args.reshard_after_forward, args.prefetch))
    compile_blocks(model.module, args.compile)       # this lesson: inside recomputation and every hook
    apply_recompute(model.module, args.recompute)    # this lesson: inside ZeRO-3's gathers
    # 03: the schedule over this rank's chunks
    pipeline = build_pipeline(model, grid, args.schedule, shape, cfg, device, precision, args.sequence_parallel)
    if args.schedule == "zero-bubble":               # 03 x 02, 06: every block's weight gradients wait for W
        for chunk in chunks:
            defer_block_weight_gradients(chunk)
    return model, pipeline


# ============================================================================ the technique: the seams, where two lessons meet


def split_over_tensor_parallel(chunk, grid: ProcessGrid, cfg, sequence_parallel: bool) -> None:
    """tp x experts, the dense half: lesson 02 splits the dense layers; an MoE block's router,
    dispatch and combine stay whole on every tp rank (split_moe_mlp), and its experts are split
    column/row once lesson 05 has cut them over ep (split_experts_over_tensor_parallel).

    Why split every expert, not the tokens: without sequence parallelism the tp ranks hold the
    same tokens. Splitting every expert keeps one routing for all of them and divides the experts'
    weights, gradients, AdamW states and FLOPs by tp, at the price a dense MLP pays: an all-reduce
    of the outputs (here of the rows the experts received) each way. Splitting the tokens instead
    would keep every expert whole on every tp rank, the largest weights of the model tp times over."""
    if cfg.n_experts:
        apply_tensor_parallel_around_experts(chunk, grid.tp_group)
    else:
        # Sequence parallelism in lesson 02's memory-optimal form (its --save-sequence-shard): a trainer
        # wants the memory, and this lesson's recompute and plan formulas count that form.
        tensor_parallel.apply_tensor_parallel(chunk, grid.tp_group, sequence_parallel, save_sequence_shard=True)


def apply_tensor_parallel_around_experts(chunk, group) -> None:
    """Lesson 02's conversion (without sequence parallelism) of everything but an MoE block's MLP
    half, which split_moe_mlp splits. Lesson 02 refuses experts; composition_problems checks the
    splits this needs instead."""
    tp = tensor_parallel
    if chunk.tok_embeddings is not None:
        chunk.tok_embeddings = tp.VocabParallelEmbedding(chunk.tok_embeddings, group)
    for block in chunk.layers:
        block.attn_norm = tp.TensorParallelRMSNorm(block.attn_norm, group)
        tp.parallelize_attention(block.attn, group)
        split_moe_mlp(block, group)
    if chunk.norm is not None:
        chunk.norm = tp.TensorParallelRMSNorm(chunk.norm, group)
    if chunk.lm_head is not None:
        chunk.lm_head = tp.VocabParallelHead(chunk.lm_head, group)


def split_moe_mlp(block, group) -> None:
    """An MoE block's MLP half over tp. The router, the dispatch and the combine run whole on
    every tp rank, so they get the reference's gradients as they are: f and g wrap the experts
    alone (tensor_parallel_experts), the MoE's norm stays a plain RMSNorm (a TensorParallelRMSNorm's
    f would add up the tp ranks' identical gradients), and a shared expert, split like a dense
    MLP, gets its own f in front."""
    tp = tensor_parallel
    tp.replicated(block.mlp_norm.weight)
    tp.replicated(block.mlp.router.weight)
    if block.mlp.shared_expert is not None:
        tp.parallelize_mlp(block.mlp.shared_expert, group)
        block.mlp.shared_expert.register_forward_pre_hook(
            lambda module, args: (tp.CopyToTensorParallelRegion.apply(args[0], group),))       # f


def attention_of_one_rank(cfg, tp: int, n_layers: int):
    """Attention as one rank of a tp x pp layout holds it, for lesson 04's formulas: its n_layers
    layers, n_heads / tp heads and n_kv_heads / tp kv-heads of the same head_dim (hidden / tp
    keeps it). Lesson 04 counts the attention of the model it is given."""
    return replace(cfg, hidden=cfg.hidden // tp, n_heads=cfg.n_heads // tp, n_kv_heads=cfg.n_kv_heads // tp,
                   n_layers=n_layers)


def experts_per_tp_rank(cfg, tp: int):
    """The experts as one tp rank holds them: every expert's inner width ffn_hidden / tp (a shared
    expert's too). Lesson 05's formulas and its grouped-matmul check read them from this config."""
    return replace(cfg, ffn_hidden=cfg.ffn_hidden // tp)


def uses_grouped_experts(args, cfg, tp: int, dtype, device, capability=None) -> bool:
    """--grouped-mm where lesson 05's grouped matmul runs fast for the experts as a tp rank holds
    them: what the model is built with, and what the report and the memory plan (for its GPU) predict with."""
    return bool(cfg.n_experts) and args.grouped_mm and expert_parallel.grouped_mm_fits(
        experts_per_tp_rank(cfg, tp), dtype, device, capability)


def expert_runner(grouped: bool, grid: ProcessGrid):
    """Lesson 05's run_experts, looped or grouped, and with tp > 1 inside lesson 02's f and g."""
    run_experts = expert_parallel.grouped_experts if grouped else expert_parallel.looped_experts
    return partial(tensor_parallel_experts, run_experts=run_experts, group=grid.tp_group) if grid.tp_size > 1 \
        else run_experts


def tensor_parallel_experts(x: torch.Tensor, counts: list[int], experts, run_experts, group) -> torch.Tensor:
    """run_experts on this tp rank's slice of every expert's inner width, between lesson 02's f
    (the rows' gradient is each slice's partial sum: all-reduced in backward) and g (so is the
    output: all-reduced in forward). Outside them everything is whole on every tp rank: the
    all-to-all sends the same rows from every tp rank of an ep group's ranks."""
    x = tensor_parallel.CopyToTensorParallelRegion.apply(x, group)
    return tensor_parallel.ReduceFromTensorParallelRegion.apply(run_experts(x, counts, experts), group)


def split_experts_over_tensor_parallel(chunk, group) -> None:
    """tp x experts, the experts' half: of each of the E/ep experts lesson 05 left this rank, this
    tp rank's slice of the inner width, as lesson 02 splits a SwiGLU: gate and up by rows (dim 1 of
    the stacked weights), down by columns (dim 2)."""
    for layer in moe_layers(chunk):
        for name, tp_dim in (("gate_proj", 1), ("up_proj", 1), ("down_proj", 2)):
            setattr(layer.experts, name, tensor_parallel.take_shard(getattr(layer.experts, name).detach(), tp_dim,
                                                                    group))


def sum_over_group(counts: torch.Tensor, group) -> torch.Tensor:
    comm.call(dist.all_reduce, counts, group=group)
    return counts


def count_choices_over_context_parallel(chunk, group) -> None:
    """cp x balancing: each cp rank holds 1/cp of every sequence, and the auxiliary loss needs each
    sequence's choice counts whole: the layers' BatchShare sums them over the cp ranks (constants, no
    autograd) before the loss divides them."""
    for layer in moe_layers(chunk):
        layer.batch_share = replace(layer.batch_share, sequence_shards=group_size(group),
                                    whole_sequence_counts=partial(sum_over_group, group=group))


def context_parallel_peers(grid: ProcessGrid, args):
    """cp x tp: the attention core lesson 04 replaces receives the heads lesson 02 left this tp
    rank, of the tokens this cp rank holds; its ring (or all-to-all) runs among the ranks of the
    same tp rank, so the two splits never see each other."""
    return context_parallel.ContextParallel.from_grid(grid, args.zigzag, args.ring_kernel)


def one_module(chunks: list, grid: ProcessGrid) -> torch.nn.Module:
    """ZeRO x pipeline: a rank's interleaved chunks are different layers sharded over the same
    dp x cp group and stepped by one optimizer, so one ZeRO wrapper holds them all (StageChunks);
    the schedule drives each chunk through a view whose data-parallel switch is that wrapper's
    (PipelineChunk), and each unit is reduced once, in its own chunk's last backward: ZeRO-0/1,
    whose gradients stay whole through the step (composition_problems says why not 2/3). The dp x cp group itself is the seam of 01 and 04: cp ranks hold the same weights
    and each computed part of their gradient, so they are summed (ZeRO: reduce-scattered) with dp's."""
    return StageChunks(chunks) if grid.pp_size > 1 else chunks[0]


class ExpertUnitsOverEdp:
    """ZeRO x experts: lesson 06's ZeRO with each module unit cut in two flat units. An expert
    weight is held by the ranks of its expert-data-parallel group (edp: the dp x cp ranks of the
    same ep rank, lesson 05), not by every dp x cp rank, so a block with experts makes two flat
    units, the dense one sharded over dp x cp and the experts' over edp, each reduced, stepped and
    gathered over its own group (ZeRO-3 gathers and frees them together). Clipping needs no group
    of its own for them: the dp x cp ranks hold every ep group's experts, and each expert's shards
    over edp, exactly once, so the dp x cp sum counts every expert (under tp, every slice of it:
    the tp sum adds the slices) once. Mixed into each of lesson 06's stage classes."""

    edp_group = None

    def flat_units(self, named_params: list) -> list:
        experts = [(name, p) for name, p in named_params if expert_parallel.is_expert_parameter(name)]
        dense = [(name, p) for name, p in named_params if not expert_parallel.is_expert_parameter(name)]
        sharded = self.stage > 0
        return [zero.FlatUnit(params, group_size(group) if sharded else 1, group_rank(group) if sharded else 0, group)
                for params, group in ((dense, self.dp_group), (experts, self.edp_group)) if params]


def wrap_zero_with_experts(module, grid, args, precision):
    """Lesson 06's wrap_zero over dp x cp, its stage's class with ExpertUnitsOverEdp mixed in."""
    stage_class = {0: zero.ZeroDataParallel, 1: zero.ZeroDataParallel, 2: zero.ZeroStage2,
                   3: zero.ZeroStage3}[args.zero_stage]
    with_experts = type(stage_class.__name__, (ExpertUnitsOverEdp, stage_class), {"edp_group": grid.edp_group})
    if args.zero_stage == 3:
        return with_experts(module, grid.dp_cp_group, precision, args.reshard_after_forward, args.prefetch)
    return with_experts(module, grid.dp_cp_group, precision, **({"replicate": True} if args.zero_stage == 0 else {}))


class StageChunks(torch.nn.Module):
    """This rank's pipeline chunks (lesson 03: one, or v for the interleaved schedule) as one
    module for ZeRO. The chunks are different layers of one model on one rank, sharded over the
    same dp x cp group and stepped by the same optimizer, so one wrapper holds all their units.
    To ZeroDataParallel, and to every meter that reads a stage, this looks like one stage: the
    first chunk's embedding, every chunk's blocks under their layer indices (the reference's
    parameter names), the last chunk's head. It has no forward: the schedule runs each chunk
    through its PipelineChunk."""

    def __init__(self, chunks: list[torch.nn.Module]):
        super().__init__()
        self.chunks = tuple(chunks)     # a tuple is not registered: each block is named once, below
        self.tok_embeddings = chunks[0].tok_embeddings
        self.layers = pipeline_parallel.stage_layers({name: block for chunk in chunks
                                                      for name, block in chunk.layers.named_children()})
        self.norm, self.lm_head = chunks[-1].norm, chunks[-1].lm_head


class PipelineChunk(torch.nn.Module, DataParallelModel):
    """One chunk as lesson 03's Pipeline drives it, a data-parallel model of its own: forward runs
    the chunk; the data-parallel switch the schedule sets before each backward (on for a chunk's
    last one), the group, the wait and the zeroing are the one ZeRO wrapper's. One switch serves
    every chunk: a unit's gradients arrive only during its own chunk's backward, so the switch is
    on exactly when a unit's last micro-batch arrives."""

    def __init__(self, sharded: "zero.ZeroDataParallel", chunk: torch.nn.Module):
        super().__init__()
        self.module = chunk
        object.__setattr__(self, "sharded", sharded)    # not a submodule: this chunk's modules are its own

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    @property
    def require_backward_grad_sync(self) -> bool:
        return self.sharded.require_backward_grad_sync

    @require_backward_grad_sync.setter
    def require_backward_grad_sync(self, value: bool) -> None:
        self.sharded.require_backward_grad_sync = value

    @property
    def dp_group(self):
        return self.sharded.dp_group

    def finish_gradient_synchronization(self) -> None:
        self.sharded.finish_gradient_synchronization()

    def zero_grad(self, set_to_none: bool = False) -> None:
        self.sharded.zero_grad(set_to_none)


def build_pipeline(model, grid: ProcessGrid, schedule: str, shape, cfg, device,
                   precision, sequence_parallel: bool = False):
    """Lesson 03's Pipeline over this rank's chunks, or None without pipeline parallelism. The
    boundary holds this rank's S/cp tokens (S/cp/tp under sequence parallelism) in the weights'
    dtype: with bf16 weights the residual stream itself is bf16."""
    if grid.pp_size == 1:
        return None
    b, s, h = pipeline_parallel.activation_shape(cfg, shape)
    tokens = s // grid.cp_size // (grid.tp_size if sequence_parallel else 1)
    chunks = [PipelineChunk(model, chunk) for chunk in model.module.chunks]
    pipeline_class = zero_bubble.ZeroBubblePipeline if schedule == "zero-bubble" else pipeline_parallel.Pipeline
    return pipeline_class(chunks, grid, schedule, shape.grad_accum, len(chunks), (b, tokens, h),
                          device, precision.param_dtype, boundary_dtype=precision.param_dtype)


# ============================================================================ the technique: zero-bubble's W through the composition
#
# Lesson 03's zero-bubble schedule (03_zero_bubble.py) splits each backward into B (the gradient of
# the stage's input, which the previous stage waits for) and W (the weights' gradients, run later in
# the bubble): its linears leave (x, dy) in the chunk's W queue during B, and W computes dW = dy^T x.
# Two seams:
#
#   03 x 02  lesson 02's column- and row-parallel linears defer their dW the same way. f and g, the
#            all-reduces over tp, stay in B, where the input's gradient needs them, and W has no
#            collective: B and W together issue exactly 1F1B's collectives (a test counts them).
#   03 x 06  ZeRO (stage 0 too) counts the gradients that arrive for a unit and reduces the unit
#            when every parameter's has come. If a block's norm gains got theirs in B and its
#            linears in W, the B's of later micro-batches would mix with earlier W's in that count,
#            which would close a unit halfway through a W, and on the step's last B start its
#            reduction before its last W ran. So every parameter of a block gets its gradient in
#            W: the norms' gains too (B: dx_hat = dy g; W: dg = sum over tokens of dy * x_hat).
#            The embedding, the head (its chunked loss computes dW inside its own backward) and the
#            routed experts (a unit of their own, over edp) get all theirs in B. Each unit's
#            reduction starts when its last gradient has come: a block's at its chunk's last W.
#   03 x 07_fp8  an FP8 layer's B quantises dY, computes dX and runs every amax all-reduce; it
#            leaves the FP8 copies of X and dY (along the tokens) for W, whose one FP8 matmul is
#            the undivided backward's dW (07_fp8.deferring_fp8_class): equal to 1F1B bit for bit.
#
# What does not compose is refused (zero_bubble_problems): a layer whose backward makes dW
# itself (lesson 02's sequence-parallel linears), recomputation (what it recomputes in B would wait
# in the W queue), and --compile (the W queue is filled inside backward).


class GainDeferringGradient(torch.autograd.Function):
    """y = x_hat * g, a norm's gain on its normalised input, whose backward is B alone: dx_hat = dy g
    now, (x_hat, dy) left in `pending` for W. The gain comes in inside a tuple, as lesson 03's
    linear takes its weight: no autograd edge, so B runs none of the gain's hooks."""

    @staticmethod
    def forward(ctx, normalised, gain: tuple, pending):
        ctx.gain, ctx.pending = gain[0], pending
        ctx.save_for_backward(normalised)
        return normalised * ctx.gain

    @staticmethod
    def backward(ctx, grad_output):
        (normalised,) = ctx.saved_tensors
        ctx.pending.keep(GainGradient(ctx.gain, None, normalised, grad_output))
        return grad_output * ctx.gain, None, None


class GainGradient(zero_bubble.WeightGradient):
    """A norm's W for one micro-batch: dg = sum over tokens of dy * x_hat, what autograd's product
    rule gives the gain in one device's backward."""

    def compute(self) -> list[tuple[torch.nn.Parameter, torch.Tensor]]:
        return [(self.weight, (self.grad_output * self.input).flatten(0, -2).sum(0).to(self.weight.dtype))]


class NormDeferringGain:
    """A block's RMSNorm, or lesson 02's tp norm with its f after it, whose gain's gradient waits for W."""

    def forward(self, x):
        x32 = x.float()     # RMSNorm's arithmetic, in float32 as there; only the gain's product differs
        normalised = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        out = GainDeferringGradient.apply(normalised, (self.weight,), self.pending_weight_gradients).type_as(x)
        enter = getattr(self, "enter_region", None)
        return out if enter is None else enter(out)


class ColumnLinearDeferringWeightGradient(tensor_parallel.ColumnParallelLinear):
    def forward(self, x):
        return zero_bubble.LinearDeferringWeightGradient.apply(x, (self.weight, self.bias),
                                                               self.pending_weight_gradients)


class RowLinearDeferringWeightGradient(tensor_parallel.RowParallelLinear):
    def forward(self, x):
        partial_sums = zero_bubble.LinearDeferringWeightGradient.apply(x, (self.weight, None),
                                                                       self.pending_weight_gradients)
        out = self.exit_region(partial_sums)
        return out if self.bias is None else out + self.bias


# what zero-bubble swaps in: lesson 03's deferring nn.Linear, these for lesson 02's layers and the norms,
# and for each of those linears in FP8 (07_fp8's class of it) the FP8 layer whose dW waits for W
DEFERRED_LINEARS = {**zero_bubble.DEFERRED_LINEARS,
                    tensor_parallel.ColumnParallelLinear: ColumnLinearDeferringWeightGradient,
                    tensor_parallel.RowParallelLinear: RowLinearDeferringWeightGradient}
DEFERRED_LINEARS |= {fp8.fp8_class(linear): fp8.deferring_fp8_class(linear) for linear in DEFERRED_LINEARS}
DEFERRED_NORMS = {norm: type(NormDeferringGain.__name__ + norm.__name__, (NormDeferringGain, norm), {})
                  for norm in (RMSNorm, tensor_parallel.TensorParallelRMSNorm)}


def defer_block_weight_gradients(chunk) -> None:
    """03 x 02, 06: once lesson 03's ZeroBubblePipeline has given the chunk its W queue (and deferred
    its nn.Linear layers), lesson 02's linears, their FP8 forms and the blocks' norms defer their
    weight gradients to it too, so that every parameter of a block, outside the routed experts, gets
    its gradient in W (checked: a parameter left to B would break ZeRO's count)."""
    pending = chunk.pending_weight_gradients
    for module in chunk.modules():
        if type(module) in DEFERRED_LINEARS:
            module.__class__ = DEFERRED_LINEARS[type(module)]
            module.pending_weight_gradients = pending
    deferring = (*DEFERRED_LINEARS.values(), *DEFERRED_NORMS.values())
    for block in chunk.layers:
        for norm in (block.attn_norm, block.mlp_norm):
            norm.__class__ = DEFERRED_NORMS[type(norm)]
            norm.pending_weight_gradients = pending
        in_w = {id(module.weight) for module in block.modules() if type(module) in deferring}
        in_b = [name for name, param in block.named_parameters()
                if id(param) not in in_w and not expert_parallel.is_expert_parameter(name)]
        if in_b:
            raise RuntimeError(f"zero-bubble: {', '.join(in_b)} would get its gradient in B and the rest of its "
                               f"block in W, which ZeRO's count of a unit's gradients cannot tell apart")


def model_parts(model, pipeline) -> list[torch.nn.Module]:
    """What the routing meters and lesson 05's formulas take as a rank's parts: with a pipeline its chunks
    (each PipelineChunk's .module one stage of lesson 03), else the model."""
    return list(pipeline.chunks) if pipeline is not None else [model]


def balancing_log(model, pipeline, grid: ProcessGrid):
    """The log of the step's aux and z losses, summed over the ranks holding other tokens (dp x cp)
    and other layers (pp); a model without them logs and reduces nothing."""
    return BalancingLog(model_parts(model, pipeline),
                        (grid.dp_cp_group, *((grid.pp_group,) if pipeline is not None else ())))


# ============================================================================ the technique: the composed step


def step_settings(grid: ProcessGrid, device, precision, max_grad_norm: float) -> StepSettings:
    """Lesson 06's settings, and the groups the norm from ZeRO's shards must also sum over:
    pipeline stages hold different layers (pp), tensor-parallel ranks different slices of them,
    whose replicated gains count once (lesson 02's rule)."""
    pp_groups = (grid.pp_group,) if grid.pp_size > 1 else ()
    tp_groups = (grid.tp_group,) if grid.tp_size > 1 else ()
    tp_counts = tensor_parallel.tp_counts_toward_norm(grid.tp_group) if grid.tp_size > 1 else None
    return replace(zero.step_settings(device, precision, max_grad_norm), norm_groups=(*pp_groups, *tp_groups),
                   counts_toward_norm=tp_counts)


def train_step(model_or_pipeline, optimizer, batch: StepBatch, settings: StepSettings, bias_update_rate: float = 0.0,
               balancing_log=None) -> StepResult:
    """The micro-batches through lesson 03's schedule on this rank's chunks, or lesson 01's loop;
    then lesson 06's sharded tail; with experts lesson 05's: the router biases move unless the
    optimizer step was skipped (a non-finite norm, the same on every rank), and the aux and z
    losses go to the log."""
    if isinstance(model_or_pipeline, pipeline_parallel.Pipeline):
        model = model_or_pipeline.chunks[0].sharded
        loss = model_or_pipeline.forward_backward(batch)
        # only the last stage computes the loss: its share is summed over pp, then 06 sums it over dp x cp
        comm.call(dist.all_reduce, loss, group=model_or_pipeline.pp_group)
    else:
        model = model_or_pipeline
        loss = data_parallel.forward_backward(model, batch, settings)
    result = zero.finish_step(model, optimizer, loss, settings)
    if bias_update_rate:
        expert_parallel.update_router_biases([model.module], model.dp_group, bias_update_rate,
                                             result.values["grad_norm"])
    if balancing_log is None:
        return result
    return result.with_extra(balancing_log.step_values())


def evaluate(model_or_pipeline, batch: StepBatch, settings: StepSettings) -> float:
    """The forward-only loss through lesson 03's schedule or lesson 01's loop, the router loads as
    the step left them (lesson 05), ZeRO-3's gathered units released (lesson 06)."""
    pipelined = isinstance(model_or_pipeline, pipeline_parallel.Pipeline)
    with expert_parallel.router_loads_kept(getattr(model_or_pipeline, "chunks", [model_or_pipeline])):
        if pipelined:
            return pipeline_parallel.evaluate(model_or_pipeline, batch, settings)
        return zero.evaluate(model_or_pipeline, batch, settings)


# ============================================================================ the technique: activation recomputation


def recomputed_forward(forward, x, rope):
    """A block's forward under checkpoint: autograd keeps x and the rotary tables, nothing inside.
    cos and sin go in as arguments, not as a tuple, so that checkpoint saves them as tensors for
    the second forward (a tuple would be kept by reference, out of any meter's sight)."""
    cos, sin = rope
    return checkpoint(lambda x, cos, sin: forward(x, (cos, sin)), x, cos, sin, use_reentrant=False)


class RecomputedNormalisation:
    """A norm's arithmetic under checkpoint: it keeps its input, and backward computes 1/rms and
    the normalised copy again. The entry into lesson 02's tensor-parallel region that a tp norm
    adds after it (enter_region) stays outside: under sequence parallelism that entry is an
    all-gather, which the second forward would otherwise send again."""

    def forward(self, x):
        normalised = checkpoint(RMSNorm.forward, self, x, use_reentrant=False)
        enter = getattr(self, "enter_region", None)
        return normalised if enter is None else enter(normalised)


def silu_product(gate, up):
    return F.silu(gate) * up


class RecomputedSwiGLUProduct:
    """SwiGLU's elementwise middle under checkpoint: gate and up (the matmuls' outputs) stay kept,
    silu(gate) is computed again in backward. Its product stays too: down_proj keeps it as its
    input, and only recomputing down_proj itself, a matmul, could drop it."""

    def forward(self, x):
        return self.down_proj(checkpoint(silu_product, self.gate_proj(x), self.up_proj(x), use_reentrant=False))


@lru_cache(maxsize=None)
def recomputed_class(recomputation: type, module_class: type) -> type:
    """`module_class` with `recomputation`'s forward: one class per kind of module (a plain norm,
    lesson 02's tp norms), shared by every block. A class, not a forward set on each instance:
    torch.compile guards on the forward it calls, and one per instance would make every block a
    new compilation (after 8, Dynamo gives up and runs the rest eagerly)."""
    return type(recomputation.__name__ + module_class.__name__, (recomputation, module_class), {})


def recompute_inside(module: torch.nn.Module, recomputation: type) -> None:
    module.__class__ = recomputed_class(recomputation, type(module))


def apply_recompute(model: torch.nn.Module, mode: str) -> torch.nn.Module:
    """full: wrap each block's own forward, not its __call__: the hooks earlier lessons put on a
    block (ZeRO-3 gathers its weights before it, frees them after, gathers them again when its
    output's gradient arrives) fire once around the checkpointed region and not again when
    backward recomputes it, by which time ZeRO-3 has gathered the weights for the backward anyway.
    selective: inside every block, the two norms and each SwiGLU's product (a dense MLP's, a
    shared expert's); the matmuls, the attention core and the routed experts keep what they save."""
    for block in model.layers:
        if mode == "full":
            block.forward = partial(recomputed_forward, block.forward)
        elif mode == "selective":
            recompute_inside(block.attn_norm, RecomputedNormalisation)
            recompute_inside(block.mlp_norm, RecomputedNormalisation)
            for mlp in (block.mlp, getattr(block.mlp, "shared_expert", None)):
                if isinstance(mlp, SwiGLU):
                    recompute_inside(mlp, RecomputedSwiGLUProduct)
    return model


# ============================================================================ the technique: compiling each block


def compile_blocks(model: torch.nn.Module, enabled: bool, backend: str | Callable = "inductor") -> torch.nn.Module:
    """--compile: torch.compile each block's own forward (TorchInductor fuses its elementwise
    operations, the norms, rotary, SwiGLU, residual adds, into a few kernels). Applied before
    recomputation, so that what is compiled is the block's math alone: full recomputation's
    checkpoint and ZeRO-3's gather hooks wrap it from outside, in eager code, exactly as they wrap
    an uncompiled block. Selective recomputation's checkpoints lie inside the block: the compiler
    traces them into the block's graph and recomputes what they mark. A collective inside a block
    (tp's all-reduces, cp's ring, ep's all-to-alls) splits the compiled code, and runs eagerly in
    between. Every block runs the same code on same-shaped tensors, so all share one compilation
    (recomputation keeps it so: apply_recompute changes classes, not each block's functions).
    `backend`: TorchInductor; the tests count compilations with a backend of their own."""
    if enabled:
        for block in model.layers:
            block.forward = torch.compile(block.forward, backend=backend)
    return model


# ============================================================================ the technique: materialising the rank's share


@dataclass(frozen=True)
class ReferenceTensors:
    """The reference GPT's tensors as reference_init defines them: the config and seed that give
    their values, and each one's whole shape."""

    cfg: object
    seed: int
    shapes: dict

    @classmethod
    def of(cls, cfg, seed: int) -> "ReferenceTensors":
        return cls(cfg, seed, checkpoints.reference_shapes(cfg))

    def box(self, name: str, offsets: tuple, shape) -> torch.Tensor:
        """Elements [offsets, offsets + shape) of tensor `name`, on the CPU. The whole tensor is
        drawn and dropped: its generator's one stream defines every value, a slice cannot be drawn
        alone."""
        whole = reference_init(name, self.shapes[name], self.cfg, self.seed)
        held = whole[tuple(slice(start, start + size) for start, size in zip(offsets, shape))]
        # A copy of the slice alone lets the whole tensor go.
        return held.clone(memory_format=torch.contiguous_format) if held.numel() < whole.numel() else held


def materialise_held_parameters(chunks: list, reference: ReferenceTensors | None, grid: ProcessGrid,
                                device) -> None:
    """Give the chunks, built on the meta device and cut there by lessons 02-05 and 07_fp8, their
    values on `device`: each parameter those of the box of the reference tensor it holds
    (reference_offsets, the rule checkpoints reshard by), each buffer the reference's zeros
    (an MoE layer's router_bias and expert_load). The run starts from exactly the parameters of a
    model built whole and then cut (tests/test_full_5d_materialise.py), but a rank never holds
    its whole stage, on the host or on the device.

    Speed: reference_init draws a tensor on one CPU thread (1e8 normals ~0.75 s), each from a
    generator of its own, and torch releases the GIL while it draws: a pool draws as many
    tensors at once as this rank has cores (drawing_threads). The host holds the whole tensors
    being drawn, one per thread. With no `reference` (a run that resumes, or starts from a Hub
    folder, and so overwrites every value next) nothing is drawn: the parameters hold NaN until
    loaded, so that one the load missed would make the first loss NaN instead of training unnoticed.

    Identity: torch.utils.swap_tensors gives each parameter object its values and keeps the
    object, which the modules and the lessons' wrappers refer to, but it drops what the earlier
    lessons attached to it: attributes (02's tp_split_dim and tp_replicated) and gradient hooks
    (02's sum over tp of a replicated gain's gradient under sequence parallelism) stay with the
    meta tensor. Both are put back (put_values_in). ZeRO (06) attaches its hooks after this."""
    if torch.device(device).type == "meta":
        return      # a model built to be counted (07_memory_plan's tests): shapes only, nothing to draw
    named = [(name, param) for chunk in chunks for name, param in chunk.named_parameters()]
    if reference is None:       # made on the device itself: nothing to draw, nothing to copy
        for _, param in named:
            put_values_in(param, torch.full_like(param, float("nan"), device=device))
    else:
        def held_values(name: str, param) -> torch.Tensor:
            return reference.box(name, reference_offsets(name, param, param.shape, grid), param.shape)

        # The pool only draws on the CPU; the copies to the device stay on this thread, whose current
        # CUDA device is the rank's (init_distributed set it), so no other thread touches CUDA.
        with ThreadPoolExecutor(drawing_threads()) as pool:
            for (_, param), values in zip(named, pool.map(held_values, *zip(*named))):
                put_values_in(param, values.to(device))
    for buffer in (buffer for chunk in chunks for buffer in chunk.buffers()):
        torch.utils.swap_tensors(buffer, torch.zeros_like(buffer, device=device))


def put_values_in(param: torch.nn.Parameter, values: torch.Tensor) -> None:
    """`param`, a meta tensor, holds `values` from now on, with its attributes and gradient hooks."""
    attributes, gradient_hooks = dict(param.__dict__), param._backward_hooks
    torch.utils.swap_tensors(param, torch.nn.Parameter(values, requires_grad=param.requires_grad))
    param.__dict__.update(attributes)
    if gradient_hooks:
        param._backward_hooks = gradient_hooks      # the setter registers them on the new tensor


def drawing_threads() -> int:
    """This rank's share of the cores it may run on: a node's ranks draw at the same time."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, cores // int(os.environ.get("LOCAL_WORLD_SIZE", 1)))


# ============================================================================ the technique: checkpoints


def master_pieces(model):
    """Each piece of a parameter in this rank's master shards (lesson 06), as (unit, name, shape,
    start, master): the piece holds elements [start, start + master.numel()) of the (row-major)
    parameter `name` of shape `shape`, as this rank holds that parameter. Padding is left out."""
    for unit in model.units:
        shapes = dict(zip(unit.names, unit.shapes))
        offsets = dict(zip(unit.names, itertools.accumulate((shape.numel() for shape in unit.shapes), initial=0)))
        for piece in unit.pieces:
            if piece.param is not None:
                yield unit, piece.name, shapes[piece.name], unit.start + piece.lo - offsets[piece.name], piece.master


def reference_slices(model, grid: ProcessGrid) -> list[checkpoints.HeldSlice]:
    """What this rank holds, each tensor as a slice of the reference GPT's tensor of the same
    name: the layout's description, from which picotron_like.checkpoint saves, and reshards into
    any other layout.

    Names: every lesson keeps the reference's (03 numbers a stage's layers as the whole model).
    Boxes: reference_offsets. Elements: lesson 06's master shards hold a flat range of each box
    (master_pieces). Replicas are written
    once: a norm gain every tp rank holds (by tp rank 0), a unit ZeRO-0 keeps whole on each rank
    of its group (by the group's rank 0), the router biases (by dp, cp and tp rank 0)."""
    slices = []
    for unit, name, shape, start, master in master_pieces(model):
        param = unit.params[unit.names.index(name)]
        offsets = reference_offsets(name, param, shape, grid)
        whole_on_every_rank = unit.shard_numel == unit.padded_numel and group_size(unit.group) > 1
        write = ((grid.tp_rank == 0 or not getattr(param, "tp_replicated", False))
                 and (not whole_on_every_rank or group_rank(unit.group) == 0))
        slices.append(checkpoints.HeldSlice(name, offsets, tuple(shape), start, start + master.numel(),
                                            master, write))
    persistent = model.module.state_dict().keys()
    first_replica = grid.dp_rank == grid.cp_rank == grid.tp_rank == 0
    for name, buffer in model.module.named_buffers():
        if name in persistent:
            slices.append(checkpoints.HeldSlice(name, (0,) * buffer.dim(), tuple(buffer.shape), 0, buffer.numel(),
                                                buffer, first_replica))
    return slices


def reference_offsets(name: str, param, shape, grid: ProcessGrid) -> tuple[int, ...]:
    """Where this rank's tensor `name`, of `shape` as the rank holds it, begins in the reference
    tensor of that name: lesson 02 cut a split parameter into tp equal parts along its
    tp_split_dim, tp rank r keeping part r; lesson 05 gave ep rank r experts [r E/ep, (r+1) E/ep)
    along dim 0."""
    offsets = [0] * len(shape)
    if getattr(param, "tp_split_dim", None) is not None:
        offsets[param.tp_split_dim] = grid.tp_rank * shape[param.tp_split_dim]
    if expert_parallel.is_expert_parameter(name):
        offsets[0] = grid.ep_rank * shape[0]
    return tuple(offsets)


def run_identity(args, shape) -> dict:
    """What a checkpoint's run and the resuming run must share for the data to continue where it
    stopped: TokenBatches reads step s's windows at [s G, (s+1) G) of a stream its seed orders."""
    return {"seed": args.seed, "seq_len": shape.seq_len, "sequences_per_step": shape.sequences_per_step}


def run_settings(args, precision) -> dict:
    """What a resuming run may change, but is told about when it does (resume's notes): the
    learning-rate schedule (with a time budget's planned steps: follow_time_budget), clipping, the
    dtypes the weights and gradients are held in, the data."""
    return {"lr": args.lr, "warmup_steps": args.warmup_steps, "steps": args.steps,
            "max_minutes": args.max_minutes, "planned_steps": getattr(args, "planned_steps", None),
            "max_grad_norm": args.max_grad_norm, "bias_update_rate": args.bias_update_rate,
            "data": args.data or "the built-in corpus",
            "dtype": str(precision.param_dtype).removeprefix("torch."),
            "reduce_dtype": str(precision.reduce_dtype).removeprefix("torch.")}


def checkpoint_to_resume(args, cfg, shape) -> dict | None:
    """The manifest of --resume's checkpoint, checked against this run (None: start at step 0).
    Called before any process group (validate): a bad checkpoint is one error line. Refuses too a
    run that would later overwrite a checkpoint in --save-dir, or has no step left to train."""
    manifest = None
    if args.resume is not None:
        directory = checkpoints.resolve(args.resume, args.save_dir)
        if directory is not None:
            manifest = checkpoints.read_manifest(directory, cfg, run_identity(args, shape))
            follow_time_budget(args, manifest.get("settings", {}))
    start = manifest["step"] if manifest else 0
    if manifest and start >= args.steps:
        raise checkpoints.CheckpointError(f"{manifest['directory']}: already at step {start}, --steps {args.steps}: "
                                          f"nothing left to train; raise --steps")
    saved = checkpoints.list_checkpoints(args.save_dir) if args.save_dir else []
    later = [path for step, path in saved if step > start]
    if later:
        raise checkpoints.CheckpointError(f"{later[-1]}: this run starts at step {start} and would overwrite it; "
                                          f"resume from it (--resume), or choose another --save-dir")
    return manifest


def resume(manifest, model, optimizer, grid: ProcessGrid, settings: dict) -> int:
    """Load the checkpoint into this rank's slices, whatever layout wrote it, then every weight
    from the master (ZeRO's all-gathers); returns the step to continue from (0: no checkpoint).
    Says which of this run's `settings` (run_settings) and model fields differ from the writer's."""
    if manifest is None:
        return 0
    try:
        checkpoints.load(manifest, reference_slices(model, grid), optimizer)
    except checkpoints.CheckpointError as error:     # a damaged file, found by whichever rank read it
        exit_with_error(error)
    model.publish_master()
    layout = ", ".join(f"{key} {value}" for key, value in manifest["layout"].items())
    log0(f"resumed from {manifest['directory']} at step {manifest['step']} (written with {layout})")
    for difference in checkpoints.unpinned_differences(manifest, settings):
        log0(f"note: {difference}: this run's applies from step {manifest['step']}")
    return manifest["step"]


def checkpoint_saver(args, cfg, shape, grid: ProcessGrid, model, optimizer):
    """train()'s after_step: a checkpoint every --save-every steps and after the last, the run's
    or the one all ranks agreed to stop after on a scheduler's signal (None without --save-dir)."""
    if args.save_dir is None:
        return None
    try:
        checkpoints.check_shared(args.save_dir)     # every node sees it; writable was checked in validate
    except checkpoints.CheckpointError as error:
        exit_with_error(error)
    slices = reference_slices(model, grid)
    info = {"model": asdict(cfg), "run": run_identity(args, shape),
            "layout": {"dp": grid.dp_size, "pp": grid.pp_size, "cp": grid.cp_size, "tp": grid.tp_size,
                       "ep": grid.ep_size, "zero_stage": args.zero_stage, "virtual_stages": args.virtual_stages}}

    def due(step: int, last: bool) -> bool:
        return last or bool(args.save_every and (step + 1) % args.save_every == 0)

    def save(step: int, last: bool) -> None:
        info["settings"] = run_settings(args, model.precision)     # a time budget plans its steps late
        checkpoints.save(args.save_dir, step + 1, slices, optimizer, info, args.keep_last)

    return AfterStep(due, save)


# ============================================================================ the technique: Hugging Face weights in


def add_init_flag(parser) -> None:
    parser.add_argument("--init-from", default=None, metavar="HF_DIR",
                        help="continued pretraining: start from a Hugging Face Llama or Mixtral folder (config.json "
                             "and safetensors), each rank reading only its slices; the model is the one config.json "
                             "describes (no --preset, --n-layers); a checkpoint that --resume finds comes first")


def model_config(cfg, args):
    """The model this run trains: the preset with lesson 05's MoE flags applied, or with
    --init-from the model its config.json describes (picotron_like.hf refuses what the reference
    GPT cannot express), refused where the flags ask for another model. The balancing and
    capacity flags stay free: they change how the model trains, not what its weights mean."""
    if args.init_from is None:
        return expert_parallel.moe_config(cfg, args)
    written = hub.read_config(args.init_from)
    configured = expert_parallel.moe_config(written, args)
    asked = [flag for flag, given in (("--preset", args.preset != "tiny"), ("--n-layers", args.n_layers is not None))
             if given]
    asked += [f"{field} {getattr(configured, field)!r} where the folder has {getattr(written, field)!r}"
              for field in ("router", "n_shared_experts") if getattr(configured, field) != getattr(written, field)]
    if asked:
        raise ConfigError(f"--init-from {args.init_from} with {', '.join(asked)}: the model is the one its config.json "
                          f"describes; drop those flags")
    return configured


def init_from_hub(directory, model, grid: ProcessGrid) -> None:
    """The starting weights from a Hub folder: each rank reads the slices it holds (reference_slices,
    the description a checkpoint reshards by), then every weight from the master (ZeRO's all-gathers).
    The optimizer starts afresh: continued pretraining, at step 0 of this run's schedule."""
    hub.load_slices(directory, reference_slices(model, grid))
    model.publish_master()
    log0(f"initial weights from {directory}")


# ============================================================================ configuration rules


def validate(cfg, grid, shape, args, world_size: int) -> None:
    """What the composition refuses (composition_problems), then each lesson's own rules: 06's,
    04's (which include the grid's), 05's with experts (ep drawn from dp x cp) and then lesson 02's
    even splits, or else all of 02's with tp > 1 (lesson 02 refuses experts: their tp split is
    this lesson's seam), and 03's; the
    checkpoint flags and the checkpoint --resume names; --sample-every's. All before any process group
    (recomputation and compiling add none)."""
    problems = composition_problems(cfg, grid, args)
    if problems:
        raise ConfigError("bad configuration:\n  - " + "\n  - ".join(problems))
    zero.validate_zero(args.dtype, args.reduce_dtype)
    sample_prompt(args, cfg, grid)
    # lesson 04's rules include the grid's
    context_parallel.validate_context_parallel(grid, world_size, cfg, shape.seq_len, args.zigzag, args.cp_mode)
    if cfg.n_experts:
        expert_parallel.validate_expert_parallel(cfg, expert_degree(args.ep, cfg, grid), grid.dp * grid.cp,
                                                 args.bias_update_rate, f"dp*cp = {grid.dp}*{grid.cp}")
        uneven = tensor_parallel.split_problems(cfg, grid.tp)
        if uneven:
            raise ConfigError("bad parallel configuration:\n  - " + "\n  - ".join(uneven))
    elif grid.tp > 1:
        tensor_parallel.validate_tensor_parallel(cfg, grid.tp)
    # at pp = 1 too: lesson 03 refuses its interleaving flags there instead of ignoring them
    zero_bubble.validate_pipeline_config(grid, world_size, cfg, args.schedule, args.virtual_stages, shape.grad_accum)
    checkpoints.check_flags(args)
    checkpoint_to_resume(args, cfg, shape)


def composition_problems(cfg, grid, args) -> list[str]:
    """The pairs of techniques this trainer does not combine, and the rules two gain together (Ulysses
    over a tp rank's heads, sequence parallelism over a cp rank's tokens), each with its reason."""
    problems = fp8.fp8_problems(cfg, grid, args)
    if args.schedule == "zero-bubble":
        problems += zero_bubble_problems(grid, args)
    if grid.pp > 1 and args.zero_stage >= 2:
        problems.append(f"--pp {grid.pp} with --zero-stage {args.zero_stage}: ZeRO-2/3 under a pipeline "
                        f"reduce-scatter (and ZeRO-3 re-gathers) at every micro-batch of the schedule, which 1F1B "
                        f"interleaves: DeepSpeed refuses them; use --zero-stage 0 or 1, or --pp 1")
    if cfg.n_experts and args.zero_stage == 0:
        problems.append(f"n_experts={cfg.n_experts} with --zero-stage 0: experts without sharding are lesson 05; "
                        f"use --zero-stage 1, 2 or 3")
    if not cfg.n_experts and args.ep not in (None, 1):
        problems.append(f"--ep {args.ep} with a dense preset: there are no experts to spread; use --ep 1 or "
                        f"--preset tiny-moe")
    if not cfg.n_experts and args.bias_update_rate:
        problems.append(f"--bias-update-rate {args.bias_update_rate} with a dense preset: there are no routers to "
                        f"balance; drop it or use --preset tiny-moe")
    if args.cp_mode == "ulysses" and grid.tp > 1:
        for field in ("n_heads", "n_kv_heads"):
            heads = getattr(cfg, field) // grid.tp
            if heads % grid.cp:
                problems.append(f"{field}={getattr(cfg, field)} gives {heads} heads per tp rank, not divisible "
                                f"by --cp {grid.cp}: Ulysses gives each cp rank whole heads of its tp rank; use "
                                f"--cp-mode ring or a cp that divides {heads}")
    if args.sequence_parallel and (args.seq_len // grid.cp) % grid.tp:
        chunks = context_parallel.SequenceSplit(grid.cp, args.zigzag).n_chunks
        problems.append(f"--seq-len {args.seq_len} leaves {args.seq_len // grid.cp} tokens per cp rank, not "
                        f"divisible by --tp {grid.tp}: sequence parallelism splits each cp rank's tokens over tp; "
                        f"use a multiple of {math.lcm(chunks, grid.cp * grid.tp)}")
    if cfg.n_experts and args.cp_mode != "ring":
        problems.append(f"--cp-mode {args.cp_mode} with experts: this trainer composes experts with ring "
                        f"attention; use --cp-mode ring")
    if cfg.n_experts and args.sequence_parallel:
        problems.append("--sequence-parallel with experts is not composed: the experts are split over tp for "
                        "tokens every tp rank holds whole; drop --sequence-parallel")
    if cfg.n_experts and cfg.capacity_factor is not None and grid.cp > 1:
        problems.append(f"--capacity-factor with --cp {grid.cp} is not supported: capacity is counted per "
                        f"sequence in token order, which would need a prefix sum across the cp chunks; use --cp 1 "
                        f"or drop --capacity-factor")
    return problems


def zero_bubble_problems(grid, args) -> list[str]:
    """What lesson 03's zero-bubble schedule does not compose with here, each with its reason (--fp8
    composes: an FP8 layer's dW waits for W too, DEFERRED_LINEARS)."""
    problems = []
    if grid.pp == 1:
        problems.append("--schedule zero-bubble with --pp 1: there is no pipeline bubble to fill; use --pp 2 or more")
    if args.sequence_parallel:
        problems.append("--sequence-parallel with --schedule zero-bubble: lesson 02's sequence-parallel linears "
                        "compute their weight gradient inside their own backward, from the input they gather again, "
                        "so there is no W to defer; drop --sequence-parallel or use --schedule 1f1b")
    if args.recompute != "none":
        problems.append(f"--recompute {args.recompute} with --schedule zero-bubble: what B recomputes would wait in "
                        f"the W queue until W, giving back the memory recomputation saves; use --recompute none or "
                        f"--schedule 1f1b")
    if args.compile:
        problems.append("--compile with --schedule zero-bubble: the deferred layers fill the W queue from inside "
                        "backward, which a compiled block's backward would not run; drop --compile or use "
                        "--schedule 1f1b")
    return problems


def expert_degree(ep: int | None, cfg, grid) -> int:
    """--ep's default: lesson 05's over the dp x cp ranks that hold other tokens (as many ep ranks
    as those ranks and the experts allow: their greatest common divisor) with experts, else 1."""
    return ep if ep is not None else (math.gcd(grid.dp * grid.cp, cfg.n_experts) if cfg.n_experts else 1)


# ============================================================================ measuring the three challenges


def predicted_kept_activation_bytes(cfg, micro_batch: int, seq_len: int, recompute: str, tp: int = 1,
                                    sequence_parallel: bool = False, cp: int = 1, stage=None,
                                    compute_dtype: torch.dtype = torch.float32) -> int:
    """One micro-batch of this rank's model, or of its pipeline stage `stage`, with dense MLPs (a
    model with experts: lesson 05 then swaps each MoE layer's SwiGLU for its routed bytes).

    --recompute none is the earlier lessons' float32 formula (dense_activation_bytes: 03's for a
    stage, 02's, or the reference's, over the S/cp tokens of a cp rank). Its difference between two
    layers and one is one block; the rest (embedding ids, rotary tables, head) no mode changes. Per block and token, in
    elements, with T_n the tokens a norm sees (/tp under sequence parallelism):
      none       the earlier formula's block
      selective  that, less each norm's 1/rms and normalised copy (2 (h + 1) per T_n) and
                 silu(gate) (f / tp; with experts the shared expert's, f_shared / tp)
      full       the block's input, h per T_n
    In the compute dtype e (2 bytes under bf16) autograd keeps every such element in e bytes but
    those computed in float32 on purpose: a norm's float32 input copy, 1/rms and normalised copy
    (2h + 1; under selective the norm keeps its input itself, in e) and attention's log-sum-exp
    (n_heads / tp per token). Outside the blocks only the head's matmul input is in e."""
    h, e = cfg.hidden, compute_dtype.itemsize
    tokens = micro_batch * seq_len // cp
    norm_tokens = tokens // tp if sequence_parallel else tokens
    swiglu_inner = (cfg.n_shared_experts if cfg.n_experts else 1) * cfg.ffn_hidden // tp
    layers = cfg.n_layers if stage is None else len(stage.layer_ids)

    def none(cfg, stage=None):
        return dense_activation_bytes(cfg, micro_batch, seq_len, cp, tp, stage, sequence_parallel)

    block = none(replace(cfg, n_layers=2)) - none(replace(cfg, n_layers=1))
    outside = none(cfg, stage) - layers * block
    if stage is None or stage.lm_head is not None:
        outside -= (4 - e) * h * norm_tokens
    log_sum_exp = cfg.n_heads // tp * tokens
    elements, in_float32 = {
        "none": (block // 4, 2 * (2 * h + 1) * norm_tokens + log_sum_exp),
        "selective": (block // 4 - 2 * (h + 1) * norm_tokens - swiglu_inner * tokens, log_sum_exp),
        "full": (h * norm_tokens, 0)}[recompute]
    return outside + layers * (e * elements + (4 - e) * in_float32)


def dense_activation_bytes(cfg, micro_batch: int, seq_len: int, cp: int, tp: int, stage=None,
                           sequence_parallel: bool = False) -> int:
    """One micro-batch of this rank's model or pipeline stage with a dense MLP, in float32, over
    its seq_len / cp tokens: with tp > 1 lesson 02's formula (which knows stages), else lesson 03's
    for a stage or the reference's for the whole model. Context-parallel attention, ring or
    Ulysses, keeps what the reference keeps for those tokens (lesson 04)."""
    tokens = seq_len // cp
    if tp > 1:
        where = {} if stage is None else dict(n_layers=len(stage.layer_ids),
                                              with_embedding=stage.tok_embeddings is not None,
                                              with_head=stage.lm_head is not None)
        return tensor_parallel.predicted_tp_activation_bytes(cfg, micro_batch, tokens, tp, sequence_parallel,
                                                             save_sequence_shard=True, **where)
    if stage is not None:
        return pipeline_parallel.predicted_chunk_activation_bytes(stage, cfg, micro_batch, tokens)
    return predicted_activation_bytes(cfg, micro_batch, tokens)


def routing_at(routing, pipeline, n_micro: int, kind: str):
    """Under --recompute full every MoE layer dispatches twice per micro-batch in the metered step:
    in the forward, and again when backward recomputes its block. The meter numbers a layer's
    calls in the order they came, which is the order of its chunk's forward and backward actions
    on this rank (lesson 01: F then B for each micro-batch; with a pipeline, lesson 03's program,
    in which an interleaved rank's chunks take turns), the same in every step of a meter over
    several. Returns a copy of the meter holding the calls made at the `kind` actions ("F": the
    forwards; "B": the recomputed forwards), numbered by their micro-batch."""

    def actions(chunk: int) -> list[tuple[str, int]]:
        if pipeline is None:
            return [(action, micro_batch) for micro_batch in range(n_micro) for action in "FB"]
        return [(step.kind, step.micro_batch) for step in pipeline.program
                if not is_transfer_batch(step) and step.chunk == chunk]

    by_chunk = {chunk: actions(chunk) for chunk in set(routing.part_of)}
    kept = copy.copy(routing)
    kept.calls = []
    for call in routing.calls:
        chunk_actions = by_chunk[routing.part_of[call.layer]]
        action, micro_batch = chunk_actions[call.micro_batch % len(chunk_actions)]
        if action == kind:
            kept.calls.append(replace(call, micro_batch=micro_batch))
    return kept


def predicted_peak_kept_bytes(recompute: str, model, pipeline, cfg, shape, args, grid: ProcessGrid, routing) -> int:
    """This rank's kept activations at their peak in the metered step under `recompute`: each
    micro-batch's bytes (with experts, lesson 05's on the step's routing counts, for the experts
    as a tp rank holds them; under full a block keeps its input only, whatever the routing), then
    their peak over lesson 03's program."""

    def dense(stage):
        kept = predicted_kept_activation_bytes(cfg, shape.micro_batch_size, shape.seq_len, recompute, grid.tp_size,
                                               args.sequence_parallel, grid.cp_size, stage,
                                               model.precision.param_dtype)
        layers = cfg.n_layers if stage is None else len(stage.layer_ids)
        return kept + fp8.kept_bytes_difference(cfg, args.fp8, shape.micro_batch_size * shape.seq_len // grid.cp_size,
                                                grid.tp_size, model.precision.param_dtype, layers, recompute,
                                                args.sequence_parallel)

    parts = model_parts(model, pipeline)
    sizes = {(index, micro_batch): dense(part.module if pipeline is not None else None)
             for index, part in enumerate(parts) for micro_batch in range(shape.grad_accum)}
    if cfg.n_experts and recompute != "full":     # each MoE layer's bytes over the dense formula, on its counts
        experts, dtype = experts_per_tp_rank(cfg, grid.tp_size), model.precision.param_dtype
        ep, micro = expert_parallel.ExpertParallel.from_grid(grid), shape.micro_batch_size
        grouped = uses_grouped_experts(args, cfg, grid.tp_size, dtype, model.units[0].master.device)
        for call, sent, received in zip(routing.calls, *expert_parallel.rows_sent_and_received(routing, ep)):
            sizes[(routing.part_of[call.layer], call.micro_batch)] += expert_parallel.moe_layer_bytes_over_dense(
                experts, micro * shape.seq_len // grid.cp_size, micro, sent, received, ep.size, grouped, dtype.itemsize)
    # the micro-batches run one after another without a pipeline; lesson 03's program says which live at once
    if pipeline is None:
        return max(sizes.values())
    return peak_live_micro_batches(pipeline.program, micro_batch_sizes=sizes)


def predicted_kept_by_mode(model, pipeline, cfg, shape, args, grid: ProcessGrid, routing) -> dict[str, int]:
    """Every mode's prediction for this run's metered step, whichever mode ran (`routing`: its
    RoutingMeter, or None without experts; under full its recomputed calls are left out)."""
    if routing is not None and args.recompute == "full":
        routing = routing_at(routing, pipeline, shape.grad_accum, "F")
    return {mode: predicted_peak_kept_bytes(mode, model, pipeline, cfg, shape, args, grid, routing)
            for mode in RECOMPUTE_MODES}


def predicted_recompute_traffic(cfg, shape, grid: ProcessGrid, n_layers: int, recompute: str, cp_mode: str,
                                sequence_parallel: bool, element_bytes: int = 4, recomputed=None,
                                steps: int = 1) -> dict:
    """Payload bytes per step that the second forward adds, each message in the weights' dtype
    (the residual stream's: `element_bytes`). selective: nothing, its checkpoints hold local
    arithmetic only (a tp norm's entry into its region stays outside). full: each block's forward
    collectives that the saved tensors need, once more per micro-batch. Non-reentrant checkpoint
    stops recomputing once the last saved tensor is rebuilt, so the block's last collective (the
    MLP's row-parallel sum, whose output nothing in the block saves) does not run again. tp: the
    attention's row-parallel output (all-reduced, or reduce-scattered with the two norms' outputs
    all-gathered under sequence parallelism); cp ring: cp - 1 K/V blocks; Ulysses: q, k, v out
    and the output back (o_proj saves its input). With experts (`recomputed`: the RoutingMeter of
    the recomputed calls of `steps` steps, routing_at's "B"; their mean per step), the MLP's
    collectives do run again, since combine saves the expert outputs that came back: every
    dispatch's forward all-to-alls, the counts, the rows out and back, (m + r) h e + 8 E, and
    under tp the experts' g, r h e (lesson 05's forward share; a shared expert's row-parallel sum
    comes after combine and does not run again), and under cp the auxiliary loss's cp sum of its
    counts, 8 E per sequence."""
    if recompute != "full":
        return {}
    runs = n_layers * shape.grad_accum
    tokens = shape.micro_batch_size * shape.seq_len // grid.cp_size
    tp, cp, d = grid.tp_size, grid.cp_size, cfg.head_dim
    extra = []
    if tp > 1:
        row = runs * tokens * cfg.hidden * element_bytes
        extra.append({("all_gather_single", "tp"): 2 * row, ("reduce_scatter_single", "tp"): row}
                     if sequence_parallel else {("all_reduce", "tp"): row})
    if cp > 1 and cp_mode == "ring":
        kv = runs * (cp - 1) * 2 * tokens * cfg.n_kv_heads // tp * d * element_bytes
        extra.append({("isend", "cp"): kv, ("irecv", "cp"): kv})
    elif cp > 1:
        extra.append({("all_to_all_single", "cp"):
                      runs * tokens * (2 * cfg.n_heads + 2 * cfg.n_kv_heads) // tp * d * element_bytes})
    if cp > 1 and cfg.n_experts and cfg.aux_loss_coef:     # the auxiliary loss's int64 counts per sequence
        extra.append({("all_reduce", "cp"): runs * 8 * cfg.n_experts * shape.micro_batch_size})
    if recomputed is not None:
        routed = routed_traffic(recomputed, grid, cfg.hidden, element_bytes, forward_only=True)
        extra.append({key: value / steps for key, value in routed.items()})
    return add_traffic(*extra)


def forwards_and_recompute_traffic(model, pipeline, cfg, shape, args, grid: ProcessGrid, routing,
                                   steps: int = 1) -> tuple:
    """What lesson 06's traffic prediction takes from this lesson: with experts (`routing`, a
    RoutingMeter over `steps` steps, else None), the routing of the forwards (under --recompute
    full without the recomputed calls, routing_at's "F"), and predicted_recompute_traffic, per step."""
    full = routing is not None and args.recompute == "full"
    extra = predicted_recompute_traffic(cfg, shape, grid, len(model.module.layers), args.recompute, args.cp_mode,
                                        args.sequence_parallel, model.precision.param_dtype.itemsize,
                                        routing_at(routing, pipeline, shape.grad_accum, "B") if full else None, steps)
    return (routing_at(routing, pipeline, shape.grad_accum, "F") if full else routing), extra


def predicted_pipeline_traffic(pipeline, precision, n_micro: int) -> dict:
    """Lesson 03's p2p bytes of this rank's stage (boundaries in the weights' dtype), and the
    loss and norm scalars the step sums over pp."""
    if pipeline is None:
        return {}
    return add_traffic(pipeline_parallel.predicted_p2p_traffic(pipeline, n_micro, precision.param_dtype.itemsize),
                       step_bookkeeping_traffic(loss_groups=("pp",), norm_groups=("pp",)))


def predicted_inner_traffic(model, cfg, shape, grid: ProcessGrid, cp_mode: str,
                            sequence_parallel: bool, precision, routing=None, steps: int = 1):
    """What tensor, context and expert parallelism move inside this rank's layers, which ZeRO
    leaves as it is: lessons 02 and 04's formulas, with experts also lesson 05's, whose traffic
    depends on the routing: `routing` is a RoutingMeter over `steps` steps' forwards, and the
    result their mean. The formulas count a float32 residual stream; with bf16 weights the stream
    is bf16, and with experts but no meter the routing is unknown: None then, and the table shows
    '-' for those rows."""
    has_experts = bool(cfg.n_experts)
    if precision.param_dtype != torch.float32 or (has_experts and routing is None):
        return None
    module, tp = model.module, grid.tp_size
    n_layers, micro, n_micro = len(module.layers), shape.micro_batch_size, shape.grad_accum
    predicted = [context_parallel.predicted_cp_traffic(attention_of_one_rank(cfg, tp, n_layers), micro, shape.seq_len,
                                                       grid.cp_size, cp_mode, n_micro, 4)]
    if tp > 1:
        predicted.append(tensor_parallel.predicted_tp_traffic(
            cfg, micro, shape.seq_len // grid.cp_size, n_micro, tp, sequence_parallel, torch.float32,
            n_layers, with_embedding=module.tok_embeddings is not None, with_head=module.lm_head is not None,
            save_sequence_shard=True))
    if has_experts:
        routed = routed_traffic(routing, grid, cfg.hidden, 4)
        predicted += [expert_layer_traffic(cfg, shape, grid, n_layers, torch.float32),
                      {key: value / steps for key, value in routed.items()}]
    return add_traffic(*predicted)


def routed_traffic(routing, grid: ProcessGrid, hidden: int, element_bytes: int, forward_only: bool = False) -> dict:
    """The bytes that depend on the routing, from the counts of every call `routing` recorded:
    lesson 05's all-to-all, and with tp > 1 the experts' g (r h e, forward) and f (r h float32
    gradients, backward) around the r rows this rank's experts received (tp x experts).
    `forward_only`: the forward's share (the recomputed forward): of the all-to-all, the counts and
    the m rows out and r back, (m + r) h e + 8 E, lesson 05's bytes less the backward's rows."""
    ep = expert_parallel.ExpertParallel.from_grid(grid)
    predicted = [expert_parallel.predicted_routed_traffic(routing, ep, hidden, element_bytes)]
    if not ((forward_only and ep.size > 1) or grid.tp_size > 1):
        return predicted[0]
    # the same condition on every rank: the counts' gather over ep runs on all of them or none
    sent, received = expert_parallel.rows_sent_and_received(routing, ep)
    if forward_only and ep.size > 1:
        predicted.append({("all_to_all_single", "ep"): -(sum(sent) + sum(received)) * hidden * element_bytes})
    if grid.tp_size > 1:
        predicted.append({("all_reduce", "tp"): sum(received) * hidden * (element_bytes + (0 if forward_only else 4))})
    return add_traffic(*predicted)


def expert_layer_traffic(cfg, shape, grid: ProcessGrid, n_layers: int, compute_dtype) -> dict:
    """What experts change inside the layers of a dense prediction, routing aside (routed_traffic):
    the cp sum of the auxiliary loss's int64 counts per sequence (cp x balancing), and, with tp > 1
    and no shared expert, the dense MLP's f and g taken out (an MoE layer's are its experts', or
    its shared expert's, as many as a dense MLP's)."""
    extra = []
    if grid.cp_size > 1 and cfg.aux_loss_coef:
        extra.append({("all_reduce", "cp"): 8 * cfg.n_experts * shape.micro_batch_size * n_layers * shape.grad_accum})
    if grid.tp_size > 1 and not cfg.n_shared_experts:
        rows = shape.micro_batch_size * shape.seq_len // grid.cp_size * shape.grad_accum * n_layers
        extra.append({("all_reduce", "tp"): -rows * cfg.hidden * (torch.finfo(compute_dtype).bits // 8 + 4)})
    return add_traffic(*extra)


def balancing_traffic(cfg, n_layers: int, pipelined: bool, bias_update_rate: float) -> dict:
    """Lesson 05's balancing bookkeeping over the dp x cp ranks, and the logged aux and z values
    summed over pp too when `pipelined` (each stage holds other layers)."""
    log_values = bool(cfg.aux_loss_coef) + bool(cfg.z_loss_coef)
    return add_traffic(expert_parallel.balancing_traffic(cfg, n_layers, bias_update_rate, "dp_cp"),
                       {("all_reduce", "pp"): 4 * log_values} if pipelined and log_values else {})


@dataclass(frozen=True)
class ZeroUnits:
    """ZeRO x experts in lesson 06's formulas: each module unit's dense parameters, sharded over
    the n = dp x cp ranks, and its experts', sharded over edp (ExpertUnitsOverEdp). From a built
    model (of), or in the memory plan from its unit counts; a dense model's experts are zeros."""

    dense: list[int]
    experts: list[int]
    n: int
    edp: int

    @classmethod
    def of(cls, model, grid: ProcessGrid) -> "ZeroUnits":
        """A built model's units: a flat unit over the model's dp x cp group is dense, one over edp experts."""
        def counts(dense: bool) -> list[int]:
            return [sum(unit.numel for unit in units if (unit.group is model.dp_group) == dense)
                    for units in model.unit_groups]

        n = grid.dp_size * grid.cp_size
        return cls(counts(dense=True), counts(dense=False), n, n // grid.ep_size)

    def model_states(self, stage: int, precision) -> ModelStates:
        dense = zero.predicted_model_states(self.dense, self.n, stage, precision)
        experts = zero.predicted_model_states(self.experts, self.edp, stage, precision)
        return ModelStates(*(a + b for a, b in zip(astuple(dense), astuple(experts))))

    def traffic(self, stage: int, precision, n_micro: int, reshard_after_forward: bool) -> dict:
        """ZeRO's collectives per step over dp x cp and, with experts, over edp."""
        return add_traffic(*(zero.predicted_zero_traffic(counts, n, stage, precision, n_micro, reshard_after_forward,
                                                         group)
                             for counts, n, group in ((self.dense, self.n, "dp_cp"), (self.experts, self.edp, "edp"))
                             if any(counts)))

    def gathered_peak(self, precision, reshard_after_forward: bool, prefetch: bool) -> int:
        """ZeRO-3 gathers a block's dense and expert units together, each padded over its own group."""
        return zero.predicted_gathered_peak([(zero.padded(dense, self.n) + zero.padded(experts, self.edp))
                                             * precision.param_dtype.itemsize
                                             for dense, experts in zip(self.dense, self.experts)],
                                            reshard_after_forward, prefetch)


def predicted_step_traffic(model, pipeline, cfg, shape, args, grid: ProcessGrid,
                           precision, routing=None, steps: int = 1, inner_extra: dict | None = None) -> dict:
    """Every row of the report's traffic table, per step, each lesson's formula added up once: ZeRO's
    (06), the pipeline's (03), the balancing's (05) and, where predicted_inner_traffic predicts
    them (`routing` and `steps` as there), tp's, cp's and ep's, with `inner_extra` added to those
    (the recomputed forward's); else none of them."""
    norm_groups = (("dp_cp",) if model.stage else ()) + (("tp",) if grid.tp_size > 1 else ())
    predicted = add_traffic(ZeroUnits.of(model, grid).traffic(model.stage, precision, shape.grad_accum,
                                                              args.reshard_after_forward),
                            step_bookkeeping_traffic(loss_groups=("dp_cp",), norm_groups=norm_groups),
                            predicted_pipeline_traffic(pipeline, precision, shape.grad_accum),
                            balancing_traffic(cfg, len(model.module.layers), pipeline is not None,
                                              args.bias_update_rate))
    inner = predicted_inner_traffic(model, cfg, shape, grid, args.cp_mode, args.sequence_parallel, precision,
                                    routing, steps)
    if inner is None:
        return {key: value for key, value in predicted.items() if key[1] not in ("tp", "cp", "ep")}
    fp8_traffic = fp8.predicted_fp8_traffic(cfg, args.fp8, shape.micro_batch_size * shape.seq_len // grid.cp_size,
                                            grid.tp_size, shape.grad_accum, len(model.module.layers), args.recompute,
                                            args.sequence_parallel, grid.cp_size)
    return add_traffic(predicted, inner, inner_extra or {}, fp8_traffic)


def report(model, pipeline, optimizer, plan, args, grid: ProcessGrid, activations: ActivationMeter, gathered,
           routing, throughput, device, every_step=None) -> None:
    """The activations this rank keeps for backward at their peak in the metered step, measured for
    the run's --recompute and predicted for every mode (with experts on the metered step's
    `routing`); lesson 06's model states and ZeRO-3's gathered weights; the traffic of every
    lesson's collectives next to predicted_step_traffic (with the recomputed forward, with experts
    on `every_step`'s routing); the compute report."""
    precision, shape = model.precision, plan.shape
    with traffic_not_counted():     # the predictions' gathers of routing counts are no training traffic
        predicted = predicted_kept_by_mode(model, pipeline, plan.cfg, shape, args, grid, routing)
        forwards, extra = forwards_and_recompute_traffic(model, pipeline, plan.cfg, shape, args, grid, every_step,
                                                         throughput.steps)
    where = f"pipeline stage {grid.pp_rank} of {grid.pp_size}, " if pipeline is not None else ""
    log0(f"\n== activations kept for backward (one rank, {where}at their peak in the measured step; "
         f"compute dtype {str(precision.param_dtype).removeprefix('torch.')}) ==")
    log0(f"{'--recompute':<14}{'measured MB':>13}{'predicted MB':>14}{'saved vs none':>15}")
    for mode in RECOMPUTE_MODES:
        measured = f"{activations.peak_bytes / 1e6:.3f}" if mode == args.recompute else "-"
        saved = f"{100 * (1 - predicted[mode] / predicted['none']):.1f} %" if mode != "none" else "-"
        log0(f"{mode:<14}{measured:>13}{predicted[mode] / 1e6:>14.3f}{saved:>15}")
    if args.compile:
        log0("(--compile: compiled blocks keep what the compiler's partitioner chooses; the predictions are eager's)")
    if args.schedule == "zero-bubble":
        log0("(zero-bubble: measured is what autograd saves, without the inputs and output gradients waiting in "
             "the W queue; predicted counts each micro-batch whole from its F to its W, more than W keeps)")
    if extra:
        log0("the recomputed forward's collectives, in the traffic below, predicted per step"
             + (" (with experts: on every step's routing)" if every_step is not None else "") + ", MB: "
             + ", ".join(f"{op} {group} {value / 1e6:.4f}" for (op, group), value in sorted(extra.items())))
    units = ZeroUnits.of(model, grid)
    experts = f", experts over edp = {units.edp}" if any(units.experts) else ""
    zero.log_model_states(model, optimizer, f"{where}ZeRO-{model.stage} over {units.n} ranks{experts}; weights "
                          f"{precision.param_dtype}, gradients {precision.reduce_dtype}",
                          units.model_states(model.stage, precision), gathered,
                          units.gathered_peak(precision, args.reshard_after_forward, args.prefetch))
    log0(f"\n== communication per step ({shape.grad_accum} micro-batches) ==")
    with traffic_not_counted():     # the prediction's gathers of routing counts are no training traffic
        predicted = predicted_step_traffic(model, pipeline, plan.cfg, shape, args, grid, precision, forwards,
                                           throughput.steps, extra)
    log0(comm.meter.table(predicted, per=throughput.steps))   # fewer steps when resumed
    log_compute_report(MeteredRun(model.module, optimizer, activations, throughput, plan.cfg, shape.seq_len,
                                  grid.shape.world_size, device, throughput.steps))
    if args.fp8 != "none":
        fp8.log_fp8_compute(plan.cfg, args.fp8, shape.seq_len, throughput.tokens_per_second, grid.shape.world_size,
                            device, throughput.peak_flops)


class FirstStepsMemory:
    """What this rank holds after each phase of its first steps, observed from outside: the step
    function and the optimizer's step are wrapped, nothing inside them counts. Everywhere: the
    bytes of the tensors the model and optimizer hold, by role (lesson 06's measured_model_states);
    on CUDA also the caching allocator's allocated bytes, its peak during the step, and its
    reserved bytes. With `snapshot` (CUDA, recording since start_memory_history), PyTorch's
    allocator history up to the end of those steps is written there, for pytorch.org/memory_viz.
    A run resumed at `first_step` numbers its rows from there; its first row holds the checkpoint."""

    def __init__(self, model, optimizer, device, n_steps: int = 3, snapshot: str | None = None, first_step: int = 0):
        self.model, self.optimizer, self.device, self.n_steps = model, optimizer, device, n_steps
        self.snapshot = snapshot if device.type == "cuda" else None
        self.first_step = first_step
        self.rows = [("built" if first_step == 0 else f"built, resumed at step {first_step}", self._sample())]
        self.steps_seen = 0
        self._step = optimizer.step
        optimizer.step = self._observed_optimizer_step

    def _sample(self) -> dict:
        states = zero.measured_model_states(self.model, self.optimizer)
        sample = {"parameters": states.parameters, "gradients": states.gradients, "master": states.master_weights,
                  "Adam": states.optimizer_states, "total": states.total}
        if self.device.type == "cuda":
            sample.update(allocated=torch.cuda.memory_allocated(self.device),
                          peak=torch.cuda.max_memory_allocated(self.device),
                          reserved=torch.cuda.memory_reserved(self.device))
        return sample

    def _observed_optimizer_step(self, *args, **kwargs):
        if self.steps_seen < self.n_steps:
            self.rows.append((f"step {self.first_step + self.steps_seen}: before optimizer.step", self._sample()))
        return self._step(*args, **kwargs)

    def observe(self, step_fn):
        """step_fn, sampled after each of the first n_steps steps (the snapshot written after the last)."""
        def observed(batch):
            if self.steps_seen >= self.n_steps:
                return step_fn(batch)
            if self.device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(self.device)
            result = step_fn(batch)
            self.rows.append((f"step {self.first_step + self.steps_seen}: after", self._sample()))
            self.steps_seen += 1
            if self.steps_seen == self.n_steps:
                self._write_snapshot()
            return result
        return observed

    def _write_snapshot(self) -> None:
        """Write the history once and stop recording: what follows the first steps repeats them."""
        if self.snapshot:
            torch.cuda.memory._dump_snapshot(self.snapshot)
            torch.cuda.memory._record_memory_history(enabled=None)
            log0(f"allocator history written to {self.snapshot} (one file per rank; open it at "
                 f"https://pytorch.org/memory_viz)")
            self.snapshot = None

    def report(self) -> None:
        """The rows (rank 0's) and what they show; a run shorter than n_steps writes its snapshot here."""
        self._write_snapshot()
        columns = list(self.rows[0][1])
        log0("\n== memory over the first steps (rank 0, MB) ==")
        log0(f"{'phase':<34}" + "".join(f"{name:>12}" for name in columns))
        for phase, sample in self.rows:
            log0(f"{phase:<34}" + "".join(f"{sample[name] / 1e6:>12.3f}" for name in columns))
        adam = ("Adam's two float32 moments appear inside the first optimizer.step(): AdamW creates its states "
                "lazily, so\nuntil then a run holds 8 bytes per master element less than in every later step."
                if self.first_step == 0 else
                "Adam's two float32 moments came back with the checkpoint, before the first step: every row "
                "holds them.")
        log0(adam + " ZeRO allocates its\ngradient buffers when it builds its units (a plain PyTorch model gets "
                    "its .grad at the first backward);\nthe per-parameter gradients autograd writes live only "
                    "until their unit is flattened and reduced.")
        if self.device.type == "cuda":
            log0("On CUDA, 'peak' is the step's high-water mark (activations included). The caching allocator "
                 "reserves\nblocks during the first step and keeps them: 'reserved' grows at step "
                 f"{self.first_step} and then stays, so the first\nstep is the one to watch for out-of-memory.")


def start_memory_history(path: str | None, device) -> str | None:
    """--memory-snapshot: start recording the allocator's history (CUDA only), before the model is
    built; one file per rank (FILE.rankN.pickle). Returns this rank's path, or None."""
    if path is None:
        return None
    if device.type != "cuda":
        log0("--memory-snapshot: the allocator history is a CUDA feature; nothing is recorded on the CPU")
        return None
    torch.cuda.memory._record_memory_history(max_entries=100_000)
    stem = path.removesuffix(".pickle")
    return f"{stem}.rank{torch.distributed.get_rank()}.pickle"


# ============================================================================ the technique: samples during training


def add_sample_flags(parser) -> None:
    parser.add_argument("--sample-every", type=int, default=0,
                        help="every N steps and after the last, rank 0 prints what the model writes after "
                             "--sample-prompt (0: never); layouts without --pp and --cp")
    parser.add_argument("--sample-prompt", default="\n", help="with --sample-every: the text to continue")
    parser.add_argument("--sample-tokens", type=int, default=32, help="with --sample-every: tokens to write")


def sample_prompt(args, cfg, grid) -> tuple | None:
    """--sample-every's (tokenizer, prompt ids): the tokenizer recorded beside --data (see
    picotron_like.sample), or None when off; a ConfigError before any process group otherwise.
    The layout must give every rank the logits of a whole sequence from its own forward: a
    pipeline's last stage alone computes logits, in micro-batches of the schedule's shape, and
    context parallelism holds a piece of each sequence per rank. Those are refused."""
    if not args.sample_every:
        return None
    problems = [f"--{flag} {value} must be 1 or more" for flag, value in
                (("sample-every", args.sample_every), ("sample-tokens", args.sample_tokens)) if value < 1]
    problems += [f"--sample-every with --{axis} {degree}: {why}; sample a checkpoint instead (python -m "
                 f"picotron_like.sample SAVE_DIR), or drop --sample-every" for axis, degree, why in
                 (("pp", grid.pp, "only the last pipeline stage computes logits"),
                  ("cp", grid.cp, "each rank holds a piece of every sequence")) if degree > 1]
    if problems:
        raise ConfigError("bad sample flags:\n  - " + "\n  - ".join(problems))
    tokenizer = sampling.sample_tokenizer(sampling.recorded_tokenizer(args.data or sampling.BUILTIN_CORPUS),
                                          cfg.vocab_size)
    return tokenizer, sampling.prompt_ids(tokenizer, args.sample_prompt)


def sample_text(model, grid: ProcessGrid, settings: StepSettings, tokenizer, prompt: list[int],
                choice: sampling.Sampling) -> str:
    """What the model writes after `prompt`, through the layout's own forward: every rank runs it
    on the same tokens (ZeRO-3 gathers, tp's and ep's collectives need every rank), the tp ranks
    put their vocabulary slices of the logits together, and every rank picks the next token with
    picotron_like.sample's rule and a generator of its own, never torch's global one: the
    training's random streams are not touched. No KV cache: the layers are the layout's, and a
    short sample is a few forwards of one sequence. The sequence is padded after its end to one
    length, a multiple of tp (sequence parallelism splits it): causal attention keeps the padding
    from every position before it, and --compile sees one shape. eval(): the MoE meters and the
    balancing log record training forwards only; router_loads_kept leaves the bias update alone."""
    ids, generator = list(prompt), torch.Generator().manual_seed(choice.seed)
    length = math.ceil((len(prompt) + choice.max_new_tokens) / grid.tp_size) * grid.tp_size
    model.eval()
    with torch.no_grad(), traffic_not_counted(), expert_parallel.router_loads_kept([model.module]):
        for _ in range(choice.max_new_tokens):
            tokens = torch.zeros(1, length, dtype=torch.long)
            tokens[0, :len(ids)] = torch.tensor(ids)
            with settings.autocast():
                logits = model(tokens.to(settings.device))[0, len(ids) - 1].contiguous()
            if grid.tp_size > 1:
                slices = [torch.empty_like(logits) for _ in range(grid.tp_size)]
                dist.all_gather(slices, logits, group=grid.tp_group)
                logits = torch.cat(slices)
            token = torch.tensor([sampling.next_token(logits, choice, generator, tokenizer.vocab_size)],
                                 device=settings.device)
            # Every rank computed the same logits and draws the same number; rank 0's token is
            # sent anyway, so that a last-bit difference between replicas can never give the
            # ranks of one tp group different tokens to run.
            dist.broadcast(token, src=0)
            ids.append(int(token))
    model.train()
    zero.release_gathered(model)                # as zero.evaluate: a step starts from shards
    return tokenizer.decode(ids[len(prompt):])


def training_sampler(args, cfg, grid: ProcessGrid, model, settings: StepSettings):
    """train()'s after_step for --sample-every (None when off): rank 0 prints one line."""
    prompt = sample_prompt(args, cfg, grid.shape)
    if prompt is None:
        return None
    choice = sampling.Sampling(args.sample_tokens, temperature=0.8, top_k=40, seed=args.seed)

    def due(step: int, last: bool) -> bool:
        return last or (step + 1) % args.sample_every == 0

    def sample(step: int, last: bool) -> None:
        text = sample_text(model, grid, settings, *prompt, choice)
        log0(f"step {step:>4} | sample: {args.sample_prompt + text!r}")

    return AfterStep(due, sample)


def one_after_another(*hooks: AfterStep | None) -> AfterStep | None:
    """train()'s after_step: each hook given (None: absent) in turn, where it is due."""
    hooks = [hook for hook in hooks if hook is not None]

    def due(step: int, last: bool) -> bool:
        return any(hook.due(step, last) for hook in hooks)

    def run(step: int, last: bool) -> None:
        for hook in hooks:
            hook(step, last)

    return AfterStep(due, run) if hooks else None


# ============================================================================ main


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description="Lesson 07: the full 5D-parallel trainer (run with torchrun).",
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_parallel_flags(parser, axes=("dp", "pp", "cp", "tp", "ep"), fill_axis="dp", bucket_flag=False)
    zero.add_zero_flags(parser)
    add_sample_flags(parser)
    expert_parallel.add_moe_flags(parser)
    zero_bubble.add_schedule_flags(parser)
    context_parallel.add_context_parallel_flags(parser)
    add_training_flags(parser, micro_batch_size=4, grad_accum=2, steps=20)
    parser.add_argument("--recompute", choices=RECOMPUTE_MODES, default="none",
                        help="selective: compute the norms' arithmetic and SwiGLU's silu again in backward (no "
                             "matmul, no collective); full: keep only each block's input and run its forward again")
    parser.add_argument("--compile", action="store_true",
                        help="torch.compile each block's forward (the first step compiles: ~20 s or more on a CPU)")
    fp8.add_fp8_flag(parser)
    parser.add_argument("--memory-snapshot", default=None, metavar="FILE",
                        help="CUDA: record the allocator's history over the first steps and write it to "
                             "FILE.rankN.pickle, for https://pytorch.org/memory_viz")
    checkpoints.add_checkpoint_flags(parser)
    add_init_flag(parser)
    add_plan_flags(parser)
    parser.set_defaults(zero_stage=None)        # follows the layout: layout_defaults
    return layout_defaults(pipeline_parallel.resolve_virtual_stages(parser.parse_args(argv)))


def layout_defaults(args):
    """The defaults that follow the layout, so that every layout the rules accept runs with the
    other flags at their defaults: ZeRO-3, or under a pipeline ZeRO-1 (composition_problems says
    why not 2 or 3). The expert degree follows it too (expert_degree)."""
    if args.zero_stage is None:
        args.zero_stage = 1 if args.pp > 1 else 3
    return args


def add_plan_flags(parser) -> None:
    parser.add_argument("--plan", action="store_true",
                        help="no training, no torchrun: print this layout's memory per rank on --gpus GPUs, whether "
                             "it fits, and the layouts that fit, fastest first (the layout from the usual flags)")
    parser.add_argument("--gpus", type=int, default=8, help="with --plan: the number of GPUs (the world size)")
    parser.add_argument("--gpu", default="B300",
                        help="with --plan: the GPU, whose memory, peak FLOP/s and bandwidths 07_memory_plan.GPUS "
                             "gives: B300, B200, H200, H100, A100-80GB, A100-40GB")
    parser.add_argument("--gpu-memory-gb", type=float, default=None,
                        help="with --plan: the GPU's memory in GiB, instead of the table's")
    parser.add_argument("--gpus-per-node", type=int, default=8,
                        help="with --plan: GPUs joined by NVLink; groups that span nodes use the network")
    parser.add_argument("--plan-top", type=int, default=10, help="with --plan: how many fitting layouts to list")
    parser.add_argument("--zero-table", action="store_true",
                        help="no training, no torchrun: print --preset's model states per GPU on 8 and 64 GPUs at "
                             "every ZeRO stage and precision policy (lesson 06's formula, data parallelism alone)")


def main(argv=None):
    args = parse_args(argv)
    if args.plan:
        load_lesson("07_memory_plan").print_memory_plan(args)
        return
    if args.zero_table:
        print(load_lesson("07_memory_plan").zero_memory_table(args.preset, (8, 64)))
        return
    plan = plan_run(args, validate, model_config)
    manifest = checkpoint_to_resume(args, plan.cfg, plan.shape)
    device = init_distributed()
    snapshot = start_memory_history(args.memory_snapshot, device)
    grid = ProcessGrid(plan.grid, ep=expert_degree(args.ep, plan.cfg, plan.grid))
    model, pipeline = parallelize(plan.cfg, grid, args, device,
                                  values_to_load=manifest is not None or args.init_from is not None)
    optimizer = zero.build_sharded_optimizer(model, args.lr)
    settings = step_settings(grid, device, model.precision, args.max_grad_norm)
    log0(f"lesson 07: dp={grid.dp_size} x pp={grid.pp_size} x cp={grid.cp_size} x tp={grid.tp_size}, "
         f"ep={grid.ep_size}, ZeRO-{args.zero_stage}, recompute {args.recompute}, "
         f"{count_parameters(plan.cfg)['total']:,} parameters, {plan.shape.tokens_per_step:,} tokens per step")
    start_step = resume(manifest, model, optimizer, grid, run_settings(args, model.precision))
    if args.resume is not None and manifest is None:    # a restarted job's first start, say
        where = args.save_dir if args.resume == "latest" else args.resume
        log0(f"--resume: no checkpoint in {where} yet: starting from step 0")
    if manifest is None and args.init_from is not None:     # once a checkpoint exists, it comes first
        init_from_hub(args.init_from, model, grid)
    activations, gathered = ActivationMeter(model.module), GatheredParameterMeter(model.module)
    # With experts: the metered step's routing (kept activations) and every step's (traffic).
    parts = model_parts(model, pipeline)
    # every_step folds a layer's calls by the step (its forwards per step: twice under full recompute)
    calls_per_step = plan.shape.grad_accum * (2 if args.recompute == "full" else 1)
    routing, every_step = ((RoutingMeter(parts), RoutingMeter(parts, calls_per_step))
                           if plan.cfg.n_experts else (None, None))
    model_or_pipeline = model if pipeline is None else pipeline
    first_steps = FirstStepsMemory(model, optimizer, device, snapshot=snapshot, first_step=start_step)
    step = first_steps.observe(partial(train_step, model_or_pipeline, optimizer, settings=settings,
                                       bias_update_rate=args.bias_update_rate,
                                       balancing_log=balancing_log(model, pipeline, grid)))
    with every_step or nullcontext():
        # dp: this rank's share of the global batch; cp: its cut of each sequence
        batches = RankBatches(plan.batches, grid.dp_rank, device,
                              cut=context_parallel.sequence_cut(grid, args.zigzag), val=plan.val_batches)
        meters = StepMeters((SavedTensorMeters(activations, gathered), *([routing] if routing else [])),
                            step=start_step)
        throughput = train(args, optimizer, step, batches,
                           evaluate=partial(evaluate, model_or_pipeline, settings=settings),
                           meters=meters, cfg=plan.cfg, start_step=start_step,
                           after_step=one_after_another(training_sampler(args, plan.cfg, grid, model, settings),
                                                        checkpoint_saver(args, plan.cfg, plan.shape, grid, model,
                                                                         optimizer)))
    report(model, pipeline, optimizer, plan, args, grid, activations, gathered, routing, throughput, device,
           every_step)
    first_steps.report()
    shutdown()


if __name__ == "__main__":
    main()
