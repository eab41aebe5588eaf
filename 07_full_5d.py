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
      -> blocks and the loss's chunks compiled    (this lesson: --compile)
      -> activation recomputation                 (this lesson)
      -> chosen blocks' kept tensors on the host  (07_activation_offload: --offload activations)
      -> the pipeline schedule over the stage     (03)

Lessons 02-06 each teach one technique with data parallelism; what spans two of them lives here:
each seam where two meet (one header per pair of lessons, below parallelize), the composed step
(03's schedule or 01's loop, 06's sharded tail, 05's router biases), recomputation and compile,
and the rules of what does not compose (composition_problems). main() shows the loop's shape:
each step dp's share of the global batch, cut along the sequence for cp, through the step.

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

Beside it: 07_report.py measures the run against each lesson's formulas (the tables below),
07_memory_plan.py says before launch whether a layout fits and which do (--plan), 07_autotune.py
measures the plan's best layouts, each trained by a child torchrun of this file (--autotune),
07_sizing.py proposes the model and tokens a time budget allows (--plan --max-minutes), 07_fp8.py
makes the blocks' matmuls FP8 (--fp8), 07_activation_offload.py keeps chosen blocks' saved tensors in
host memory from their forward until just before their backward (--offload activations). The
optimizer is lesson 06's AdamW (with --offload optimizer 06_zero_offload's: its states in host
memory, its step on the CPU), or with --optimizer muon lesson 06_zero_muon's Muon for the blocks'
matrices (AdamW for the rest), whose Newton-Schulz needs each matrix whole: 06_zero_muon assembles
it from ZeRO's shards on one owner rank, and its seam with tp here joins tp's slices first
(TensorParallelMuon: one all-gather per matrix, the same Newton-Schulz on every tp rank); experts
and pipeline stages need nothing more.
A batch that grows with the tokens trained (--batch-ramp) is this lesson's: each step's size is its
number of micro-batches, which every technique above follows (its section says how). What any real
run needs is the package's: a rank's share built on the meta device (materialise), checkpoints that
resume in any layout (checkpoint: --save-dir, --resume), Hub weights in (hf: --init-from), samples
during training (sample: --sample-every).
Out of scope here: fp16 with loss scaling (bf16 needs none).

Run it:
    torchrun --nproc_per_node=4 07_full_5d.py --dp 2 --tp 2 --zero-stage 1 --recompute full
    torchrun --nproc_per_node=4 07_full_5d.py --dp 2 --tp 2 --zero-stage 1 --recompute selective --dtype bfloat16
    torchrun --nproc_per_node=4 07_full_5d.py --pp 2 --cp 2 --zero-stage 1 --recompute full
    torchrun --nproc_per_node=4 07_full_5d.py --pp 2 --dp 2 --zero-stage 1 --schedule interleaved --virtual-stages 2
    torchrun --nproc_per_node=4 07_full_5d.py --pp 2 --tp 2 --zero-stage 1 --schedule zero-bubble --grad-accum 4
    torchrun --nproc_per_node=4 07_full_5d.py --pp 2 --dp 2 --zero-stage 3 --schedule interleaved --virtual-stages 2
    torchrun --nproc_per_node=4 07_full_5d.py --preset tiny-moe --dp 2 --cp 2 --ep 2 --zero-stage 1
    torchrun --nproc_per_node=2 07_full_5d.py --cp 2 --zero-stage 3 --recompute full --compile
    torchrun --nproc_per_node=4 07_full_5d.py --dp 2 --tp 2 --zero-stage 1 --save-dir ckpt --save-every 10
    torchrun --nproc_per_node=4 07_full_5d.py --pp 2 --dp 2 --global-batch-tokens 8192 --batch-ramp 2048 60000
    torchrun --nproc_per_node=4 07_full_5d.py --dp 2 --tp 2 --zero-stage 1 --optimizer muon
    torchrun --nproc_per_node=4 07_full_5d.py --pp 2 --dp 2 --zero-stage 1 --recompute full --offload activations
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
import math
import sys
from collections.abc import Callable
from contextlib import contextmanager, nullcontext
from dataclasses import replace
from functools import cached_property, lru_cache, partial

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import picotron_like.calibrate as calibration
import picotron_like.checkpoint as checkpoints
import picotron_like.hf as hub
import picotron_like.sample as sampling
from picotron_like import comm
from picotron_like.data import BatchRamp, StepBatch
from picotron_like.lessons import load_lesson
from picotron_like.materialise import ReferenceTensors, materialise_held_parameters
from picotron_like.metrics import BalancingLog, log0
from picotron_like.model import GPT, RMSNorm, SwiGLU, count_parameters
from picotron_like.moe import moe_layers
from picotron_like.run_control import StepMeters, one_after_another
from picotron_like.topology import ConfigError, ProcessGrid, group_rank, group_size, init_distributed, shutdown
from picotron_like.train import (DataParallelModel, RankBatches, StepResult, StepSettings, add_parallel_flags,
                                 add_training_flags, batch_shape, plan_run, train)
from picotron_like.train import build_optimizer as train_optimizer

data_parallel = load_lesson("01_data_parallel")
tensor_parallel = load_lesson("02_tensor_parallel")
pipeline_parallel = load_lesson("03_pipeline_parallel")
zero_bubble = load_lesson("03_zero_bubble")
context_parallel = load_lesson("04_context_parallel")
expert_parallel = load_lesson("05_expert_parallel")
zero = load_lesson("06_zero")
zero_muon = load_lesson("06_zero_muon")
zero_offload = load_lesson("06_zero_offload")
fp8 = load_lesson("07_fp8")
activation_offload = load_lesson("07_activation_offload")
measurement = load_lesson("07_report")
memory_plan = load_lesson("07_memory_plan")
autotune = load_lesson("07_autotune")
sizing = load_lesson("07_sizing")

# ============================================================================ the technique: the plan


def parallelize(cfg, grid: ProcessGrid, args, device, values_to_load: bool = False):
    """This rank's model and, with pp > 1, the pipeline that runs it: one lesson's entry point per
    line, in the order their assumptions need. Each works on whatever the line before produced, a
    whole GPT or one pipeline chunk; the seams where two techniques meet are the next section.
    values_to_load: a checkpoint or a Hub folder gives every value next (nothing is drawn)."""
    shape = batch_shape(args, grid.dp_size)
    precision = zero.precision_from_flags(args.dtype, args.reduce_dtype, device)
    grouped = measurement.uses_grouped_experts(args, cfg, grid.tp_size, precision.param_dtype, device)
    # 03: this rank's pipeline stage, or its v chunks for interleaved 1F1B; the whole GPT at pp = 1.
    # Built on the meta device (shapes, no values) and cut there by the lessons below, so that no
    # rank holds more than its share (the 8b preset whole: 32 GB per rank, 8 ranks per node).
    with torch.device("meta"):
        chunks = (pipeline_parallel.build_stage_chunks(cfg, args.seed, grid.pp_size, grid.pp_rank,
                                                       args.virtual_stages)
                  if grid.pp_size > 1 else [GPT(cfg, seed=args.seed)])
    for chunk in chunks:
        if grid.tp_size > 1:            # 02: attention heads, MLP width and vocabulary over tp
            split_over_tensor_parallel(chunk, grid, cfg, args.sequence_parallel, args.async_tp_dgrad)
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
        # 07_fp8: the blocks' matmuls in FP8, scales as one device's (amaxes over tp, and cp's tokens); on a GPU
        # only the layers whose shapes FP8 speeds up
        fp8.apply_fp8(chunk, fp8.recipe_from_flags(args), grid.tp_group, grid.cp_group if grid.cp_size > 1 else None,
                      fp8.fp8_groups_of_run(cfg, args, shape.micro_batch_size * shape.seq_len // grid.cp_size,
                                            grid.tp_size, device.type == "cuda"))
    # picotron_like.materialise: each parameter the reference's values of what this rank holds of it, on the device
    materialise_held_parameters(chunks, None if values_to_load else ReferenceTensors.of(cfg, args.seed), grid, device)
    # 06: ZeRO over the dp x cp ranks, which hold the same weights (experts: over edp); stage 0 is 01's sum;
    # 06_zero_offload: --offload optimizer, the master and AdamW's states in host memory, the step on the host
    # (experts: their units over edp, 05 x 06; ZeRO-2/3 under a pipeline: reduced once per step, 03 x 06)
    model = wrap_zero(one_module(chunks, grid), grid, args, precision, cfg.n_experts > 0)
    compile_blocks(model.module, args.compile)       # this lesson: inside recomputation and every hook
    apply_recompute(model.module, args.recompute)    # this lesson: inside ZeRO-3's gathers
    if "activations" in args.offload:               # 07_activation_offload: chosen blocks' kept tensors on the host
        activation_offload.offload_activations(chunks, args.offload_blocks, device)
    # 03: the schedule over this rank's chunks
    pipeline = build_pipeline(model, grid, args.schedule, shape, cfg, device, precision, args.sequence_parallel,
                              args.zigzag, args.async_pp_sends)
    if args.schedule == "zero-bubble":               # 03 x 02, 06: every block's weight gradients wait for W
        for chunk in chunks:
            defer_block_weight_gradients(chunk)
            weight_gradients_into_shards(chunk, model)
    return model, pipeline


# ============================================================================ the technique: the seams, where two lessons meet


# ---------------------------------------------------------------------------- 02 x 05: tensor parallelism x experts
# Lesson 02 splits dense layers and refuses experts; an expert must be split after 05 cut the experts over ep,
# with 02's f and g around the experts alone, since the router and the dispatch run whole on every tp rank.


def split_over_tensor_parallel(chunk, grid: ProcessGrid, cfg, sequence_parallel: bool,
                               async_dgrad: bool = True) -> None:
    """tp x experts, the dense half: lesson 02 splits the dense layers; an MoE block's router,
    dispatch and combine stay whole on every tp rank (split_moe_mlp), and its experts are split
    column/row once lesson 05 has cut them over ep (split_experts_over_tensor_parallel).

    Why split every expert, not the tokens: without sequence parallelism the tp ranks hold the
    same tokens. Splitting every expert keeps one routing for all of them and divides the experts'
    weights, gradients, AdamW states and FLOPs by tp, at the price a dense MLP pays: an all-reduce
    of the outputs (here of the rows the experts received) each way. Splitting the tokens instead
    would keep every expert whole on every tp rank, the largest weights of the model tp times over."""
    if cfg.n_experts:
        apply_tensor_parallel_around_experts(chunk, grid.tp_group, async_dgrad)
    else:
        # Sequence parallelism in lesson 02's memory-optimal form (its --save-sequence-shard): a trainer
        # wants the memory, and this lesson's recompute and plan formulas count that form.
        tensor_parallel.apply_tensor_parallel(chunk, grid.tp_group, sequence_parallel, save_sequence_shard=True,
                                              async_dgrad=async_dgrad)


def apply_tensor_parallel_around_experts(chunk, group, async_dgrad: bool = True) -> None:
    """Lesson 02's conversion (without sequence parallelism) of everything but an MoE block's MLP
    half, which split_moe_mlp splits. Lesson 02 refuses experts; composition_problems checks the
    splits this needs instead."""
    tp = tensor_parallel
    if chunk.tok_embeddings is not None:
        chunk.tok_embeddings = tp.VocabParallelEmbedding(chunk.tok_embeddings, group)
    for block in chunk.layers:
        block.attn_norm = tp.TensorParallelRMSNorm(block.attn_norm, group, async_dgrad)
        tp.parallelize_attention(block.attn, group)
        split_moe_mlp(block, group)
    if chunk.norm is not None:
        chunk.norm = tp.TensorParallelRMSNorm(chunk.norm, group, async_dgrad)
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


# ---------------------------------------------------------------------------- 04 x 05: context parallelism x balancing
# A cp rank holds a piece of every sequence, and the auxiliary loss counts choices per whole sequence.


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


# ---------------------------------------------------------------------------- 02 x 04: context parallelism x tensor parallelism
# Both split attention: cp the tokens, tp the heads; each must run among the ranks that hold the other's same part.


def context_parallel_peers(grid: ProcessGrid, args):
    """cp x tp: the attention core lesson 04 replaces receives the heads lesson 02 left this tp
    rank, of the tokens this cp rank holds; its ring (or all-to-all) runs among the ranks of the
    same tp rank, so the two splits never see each other."""
    return context_parallel.ContextParallel.from_grid(grid, args.zigzag, args.ring_kernel)


# ---------------------------------------------------------------------------- 05 x 06: experts x ZeRO
# An expert's weight is held by the edp ranks, not by every dp x cp rank that ZeRO shards over.


class ExpertUnitsOverEdp:
    """ZeRO x experts: lesson 06's ZeRO with each module unit cut in two flat units. An expert
    weight is held by the ranks of its expert-data-parallel group (edp: the dp x cp ranks of the
    same ep rank, lesson 05), not by every dp x cp rank, so a block with experts makes two flat
    units, the dense one sharded over dp x cp and the experts' over edp, each reduced, stepped and
    gathered over its own group (ZeRO-3 gathers and frees them together). Clipping needs no group
    of its own for them at stages 1-3: the dp x cp ranks hold every ep group's experts, and each
    expert's shards over edp, exactly once, so the dp x cp sum counts every expert (under tp, every
    slice of it: the tp sum adds the slices) once; stage 0 sums over ep (counting_every_expert_once).
    Mixed into each of lesson 06's stage classes, stage 0's too: its units whole, all-reduced over
    their own groups."""

    edp_group = ep_group = None

    @cached_property
    def expert_parameters(self) -> set:
        return {p for name, p in self.module.named_parameters() if expert_parallel.is_expert_parameter(name)}

    def flat_units(self, named_params: list) -> list:
        experts = [(name, p) for name, p in named_params if expert_parallel.is_expert_parameter(name)]
        dense = [(name, p) for name, p in named_params if not expert_parallel.is_expert_parameter(name)]
        sharded = self.stage > 0
        return [zero.FlatUnit(params, group_size(group) if sharded else 1, group_rank(group) if sharded else 0, group)
                for params, group in ((dense, self.dp_group), (experts, self.edp_group)) if params]


def wrap_zero(module, grid, args, precision, with_experts: bool):
    """Lesson 06's stage class over dp x cp with the seams' mixins: ZeRO-2/3 under a pipeline
    (PipelinedZeroStage2/3, the next seam), 06_zero_offload's host optimizer, experts over edp
    (ExpertUnitsOverEdp)."""
    pipelined = grid.pp_size > 1 and args.zero_stage >= 2
    offloaded = "optimizer" in args.offload
    stage_class = {0: zero.ZeroDataParallel, 1: zero.ZeroDataParallel, 2: zero.ZeroStage2,
                   3: zero.ZeroStage3}[args.zero_stage]
    if pipelined:
        stage_class = {2: PipelinedZeroStage2, 3: PipelinedZeroStage3}[args.zero_stage]
    if offloaded:
        stage_class = zero_offload.offloaded(stage_class)
    if with_experts:
        stage_class = type(stage_class.__name__, (ExpertUnitsOverEdp, stage_class),
                           {"edp_group": grid.edp_group, "ep_group": grid.ep_group})
    if args.zero_stage == 3:
        return stage_class(module, grid.dp_cp_group, precision, args.reshard_after_forward, args.prefetch)
    return stage_class(module, grid.dp_cp_group, precision, replicate=args.zero_stage == 0,
                       overlap_weight_gather=args.overlap_weight_gather)


def counting_every_expert_once(model, settings: StepSettings) -> StepSettings:
    """05 x 06 at ZeRO-0, the gradient norm. At stage 0 lesson 06 sums the squares over no data
    group: each rank holds every gradient whole. With experts a rank holds the dense gradients
    (the same on every dp x cp rank after their all-reduce) but only its ep rank's experts (the
    same over edp), so lesson 05's rule is added: the sum runs over ep too, each ep rank adding
    its own experts' squares and ep rank 0 alone the dense ones."""
    if model.stage > 0 or not isinstance(model, ExpertUnitsOverEdp) or group_size(model.ep_group) == 1:
        return settings
    counts = settings.counts_toward_norm or (lambda param: True)
    first, experts = group_rank(model.ep_group) == 0, model.expert_parameters
    return replace(settings, norm_groups=(model.ep_group, *settings.norm_groups),
                   counts_toward_norm=lambda param: counts(param) and (first or param in experts))


# ---------------------------------------------------------------------------- 03 x 06: pipeline x ZeRO
# A rank's pipeline chunks are different layers of one model, stepped by one optimizer over one group.


def one_module(chunks: list, grid: ProcessGrid) -> torch.nn.Module:
    """ZeRO x pipeline: a rank's interleaved chunks are different layers sharded over the same
    dp x cp group and stepped by one optimizer, so one ZeRO wrapper holds them all (StageChunks);
    the schedule drives each chunk through a view whose data-parallel switch is that wrapper's
    (PipelineChunk), and each unit is reduced once, in its own chunk's last backward (ZeRO-2/3:
    PipelinedZeroStage2/3 below). The dp x cp group itself is the seam of 01 and 04: cp ranks
    hold the same weights and each computed part of their gradient, so they are summed (ZeRO:
    reduce-scattered) with dp's."""
    return StageChunks(chunks) if grid.pp_size > 1 else chunks[0]


class GradientsReducedOncePerStep:
    """ZeRO-2/3 x pipeline, the gradients. Lesson 06's ZeRO-2 reduce-scatters each unit at every
    micro-batch, which a pipeline's m micro-batches would make m reduce-scatters per unit and step
    (A g Psi), interleaved with the schedule. Here a unit's gradient is accumulated whole over the
    step's micro-batches, as ZeRO-1 accumulates it, in a buffer taken at the unit's first gradient
    of the step, and reduce-scattered once, during its chunk's last backward (under zero-bubble its
    last W: the schedule's switch, PipelineChunk); the whole buffer is freed when that reduction
    completes (one in flight at a time, lesson 06's ZeroStage2), and the shard it lands in when
    the step is over.

    Against ZeRO-1: the same traffic (g Psi reduce-scattered, the weights gathered once), and the
    same gradient bytes at the step's peak (the whole buffers, g Psi'); none between steps (ZeRO-1
    keeps its buffers: during the optimizer step, a checkpoint, the next step's forwards up to each
    unit's first backward). Against lesson 06's ZeRO-2: m times fewer gradient bytes sent, for the
    whole buffers held through the step (06 holds one unit's whole gradient at a time). So ZeRO-2
    under a pipeline buys little; its gradients are what ZeRO-3 under a pipeline uses."""

    def _hold_gradients(self, unit, device) -> None:
        unit.whole_grad = None         # the whole gradient, during the step only
        unit.grad_shard = torch.empty(0, dtype=self.precision.reduce_dtype, device=device)

    def _reduce(self, unit, grads: list[torch.Tensor]) -> None:
        # the step's first gradient written into a new buffer, the later ones added (ZeRO-1's arithmetic)
        if unit.whole_grad is None:
            unit.whole_grad = unit.flatten(grads, self.precision.reduce_dtype)
        else:
            torch._foreach_add_(unit.views(unit.whole_grad), grads)
        if not self.require_backward_grad_sync:
            return                      # not the unit's last micro-batch: accumulate only
        self._finish_in_flight()        # the previous unit's reduction done, its whole buffer freed
        unit.grad_shard = unit.whole_grad.new_empty(unit.shard_numel)
        work = comm.call(comm.reduce_scatter_single, unit.grad_shard, unit.whole_grad, group=unit.group,
                         async_op=True)
        self._in_flight, unit.whole_grad = (work, unit, None, unit.whole_grad), None

    def zero_grad(self, set_to_none: bool = False) -> None:
        """After the step: the shards stepped with are freed too."""
        super().zero_grad(set_to_none)
        for unit in self.units:
            unit.grad_shard = unit.grad_shard.new_empty(0)


class PipelinedZeroStage2(GradientsReducedOncePerStep, zero.ZeroStage2):
    """Lesson 06's ZeRO-2 under a pipeline: gradients reduced once per step (GradientsReducedOncePerStep);
    the weights whole, gathered after the step as at ZeRO-1."""


class PipelinedZeroStage3(GradientsReducedOncePerStep, zero.ZeroStage3):
    """ZeRO-3 x pipeline, the weights. A stage runs m forwards and m backwards of each chunk per
    step, so lesson 06's gather before each forward and again before each backward is 2m gathers
    per unit and step (--reshard-after-forward, the default: two units of a chunk gathered at a time); kept
    gathered (--no-reshard-after-forward) a unit is gathered at its first forward of the step and
    freed after its last backward (the reduction's switch): one gather per unit and step, all of
    the stage's units gathered through it (torchtitan's choice under a pipeline).

    Prefetching stays inside a chunk: under interleaved 1F1B a rank's next computation after its
    chunk's last unit is another chunk's, on another micro-batch, at a time the schedule decides,
    so a unit gathered across chunks would wait, gathered, for it. Every dp x cp rank of a stage
    runs the same program, so their gathers and reductions come in the same order.

    Zero-bubble: a block's weight gradients come in W, long after B, which needs the weights, and
    W does not (dW = dy^T x). Resharded, a block's weights are freed once B has passed them (when
    the gradient of the block's input arrives: the next unit back's hook, or one on a chunk's
    input); W hands its gradients to the shards directly (add_weight_gradients), since autograd
    would check each against its freed parameter's shape."""

    def __init__(self, module, group, precision=zero.Precision(), reshard_after_forward: bool = True,
                 prefetch: bool = True):
        super().__init__(module, group, precision, reshard_after_forward, prefetch)
        self.unit_chunk = chunk_of_each_unit(module)
        self.weight_gradients_in_w = set()    # flat units whose gradients come in zero-bubble's W (a block's dense one)

    def _same_chunk(self, index: int, other: int) -> bool:
        return 0 <= other < len(self.unit_chunk) and self.unit_chunk[other] == self.unit_chunk[index]

    def _wait_for(self, index: int, then_prefetch: int) -> None:
        super()._wait_for(index, then_prefetch if self._same_chunk(index, then_prefetch) else -1)

    def _before_forward(self, index, module, args):
        super()._before_forward(index, module, args)
        first_in_chunk = not self._same_chunk(index, index - 1)
        if self.weight_gradients_in_w and self.reshard_after_forward and first_in_chunk and args[0].requires_grad:
            args[0].register_hook(lambda grad: self._release_after_input_gradient(index))

    def _before_backward(self, index, grad):
        # B has passed the unit after this one: free what waits for W before gathering and prefetching
        if self.reshard_after_forward and self._same_chunk(index, index + 1):
            self._release_after_input_gradient(index + 1)
        super()._before_backward(index, grad)

    def _release_after_input_gradient(self, index: int) -> None:
        for unit in self.unit_groups[index]:
            if unit in self.weight_gradients_in_w:
                unit.release_parameters()

    def _reduce(self, unit, grads: list[torch.Tensor]) -> None:
        super()._reduce(unit, grads)
        if self.reshard_after_forward or self.require_backward_grad_sync:
            unit.release_parameters()       # resharded: until the next gather; kept: until the next step

    def add_weight_gradients(self, pairs) -> None:
        """Zero-bubble's W: one micro-batch's (parameter, gradient) pairs of this rank's blocks,
        into their units as autograd's accumulation would have handed them (every parameter of
        a unit in W has its gradient there)."""
        grads = dict(pairs)
        for unit in self.units:
            if unit.params[0] in grads:
                self._reduce(unit, [grads.pop(param) for param in unit.params])


def chunk_of_each_unit(stage) -> list[int]:
    """Which of a rank's chunks (StageChunks) each of lesson 06's module units lies in: the
    embedding the first, a block its own, the head the last."""
    chunk_of = {id(block): index for index, chunk in enumerate(stage.chunks) for block in chunk.layers}
    return [0 if modules[0] is stage.tok_embeddings else
            len(stage.chunks) - 1 if modules[0] is stage.norm else chunk_of[id(modules[0])]
            for modules in zero.unit_modules(stage)]


class WeightGradientsIntoShards(zero_bubble.PendingWeightGradients):
    """A chunk's W queue whose W hands the gradients to ZeRO-3 under a pipeline (PipelinedZeroStage3)."""

    def weight_gradients(self, micro_batch: int) -> None:
        with torch.no_grad():       # what autograd's accumulation gets: the values, no graph (x is a forward tensor)
            self.sharded.add_weight_gradients(pair for weight_gradient in self.pending.pop(micro_batch)
                                              for pair in weight_gradient.compute())


def weight_gradients_into_shards(chunk, model) -> None:
    """03 x 06 under zero-bubble at ZeRO-3: the chunk's W queue (lesson 03's, given by its pipeline)
    hands its gradients to the shards, and its blocks' dense units are marked as waiting for W."""
    if not isinstance(model, PipelinedZeroStage3):
        return
    chunk.pending_weight_gradients.__class__ = WeightGradientsIntoShards
    chunk.pending_weight_gradients.sharded = model
    blocks = {id(block) for block in chunk.layers}
    for modules, units in zip(zero.unit_modules(model.module), model.unit_groups):
        if id(modules[0]) in blocks:
            model.weight_gradients_in_w |= {unit for unit in units
                                            if not expert_parallel.is_expert_parameter(unit.names[0])}


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
    on exactly when a unit's last micro-batch arrives. positions: this cp rank's tokens' true
    positions (None at cp = 1), which replace the schedule's 0 .. s-1: a cp rank's tokens lie
    elsewhere in the sequence, the same places in every micro-batch."""

    def __init__(self, sharded: "zero.ZeroDataParallel", chunk: torch.nn.Module, positions=None):
        super().__init__()
        self.module, self.positions = chunk, positions
        object.__setattr__(self, "sharded", sharded)    # not a submodule: this chunk's modules are its own

    def forward(self, x, targets=None, positions=None, reduction: str = "mean"):
        return self.module(x, targets, positions if self.positions is None else self.positions, reduction)

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


class WeightsDtypeBoundary:
    """Lesson 03's Pipeline, or its zero-bubble continuation, with a boundary in the weights' dtype:
    03's boundary is float32, the residual stream under autocast, but with bf16 weights (--dtype)
    the residual stream itself is bf16."""

    def __init__(self, *args, boundary_dtype: torch.dtype, **kwargs):
        super().__init__(*args, **kwargs)
        self.boundary_dtype = boundary_dtype


class MicroBatchesOfTheStep:
    """Lesson 03's Pipeline, or its zero-bubble continuation, whose programs follow the batch in
    hand: under a batch-size ramp (--batch-ramp) a step's micro-batch count changes as the batch
    grows, and the schedule's order is built from it (lesson 03's build_programs), again whenever
    the count changes (a validation batch is a full one)."""

    def forward_backward(self, batch: StepBatch):
        self.follow_micro_batches(len(batch.micro_batches))
        return super().forward_backward(batch)

    def forward_only(self, batch: StepBatch):
        self.follow_micro_batches(len(batch.micro_batches))
        return super().forward_only(batch)

    def follow_micro_batches(self, n_micro: int) -> None:
        if n_micro != self.n_micro:
            self.build_programs(n_micro)


class ComposedPipeline(MicroBatchesOfTheStep, WeightsDtypeBoundary, pipeline_parallel.Pipeline):
    pass


class ComposedZeroBubblePipeline(MicroBatchesOfTheStep, WeightsDtypeBoundary, zero_bubble.ZeroBubblePipeline):
    pass


def build_pipeline(model, grid: ProcessGrid, schedule: str, shape, cfg, device,
                   precision, sequence_parallel: bool = False, zigzag: bool = False, async_sends: bool = True):
    """Lesson 03's Pipeline over this rank's chunks, or None without pipeline parallelism. The
    boundary holds this rank's S/cp tokens (S/cp/tp under sequence parallelism) in the weights'
    dtype; each chunk rotates them by their true positions (lesson 04's cut)."""
    if grid.pp_size == 1:
        return None
    b, s, h = pipeline_parallel.activation_shape(cfg, shape)
    tokens = s // grid.cp_size // (grid.tp_size if sequence_parallel else 1)
    positions = (context_parallel.SequenceSplit(grid.cp_size, zigzag).positions(grid.cp_rank, s).to(device)
                 if grid.cp_size > 1 else None)
    chunks = [PipelineChunk(model, chunk, positions) for chunk in model.module.chunks]
    pipeline_class = ComposedZeroBubblePipeline if schedule == "zero-bubble" else ComposedPipeline
    return pipeline_class(chunks, grid, schedule, shape.grad_accum, len(chunks), (b, tokens, h),
                          device, precision.param_dtype, async_sends, boundary_dtype=precision.param_dtype)


# ---------------------------------------------------------------------------- 06_zero_muon x 02, 05, 03: whole matrices
# 06_zero_muon's owner assembles each matrix from the ZeRO shards of its group; under tp that is still this tp rank's
# slice of the matrix, and Newton-Schulz needs it whole. Experts and pipeline stages need nothing of their own.


class TensorParallelMuon(zero_muon.ShardedMuon):
    """Muon x tp: lesson 06_zero_muon's owner of a matrix holds this tp rank's slice of it (lesson 02
    cut column-parallel weights along their rows, row-parallel ones along their columns; an expert's
    gate and up along their rows, its down along its columns). The owner all-gathers the slices
    from its tp peers, orthogonalises the whole matrix and keeps its own slice of the result, and
    the learning rate's shape factor is the whole matrix's. Its peers are the owners of the same
    matrix: the owners follow from the units' layout, the same on every tp rank, so each tp group
    joins the same matrices in the same order. Megatron-LM calls this Muon's "duplicated" tp mode:
    every tp rank runs the same Newton-Schulz (tp times one rank's FLOPs) for one all-gather per
    matrix and nothing sent back; sequence parallelism cuts the tokens, not the weights, and
    changes nothing here.

    Experts x Muon: lesson 06_zero_muon orthogonalises each expert's matrix of a stack on its own,
    and the expert units (over edp, ExpertUnitsOverEdp) are a group of their own, whose owners
    assemble them from the edp ranks' shards. Pipeline x Muon: each stage's optimizer holds its own
    units (one wrapper over an interleaved rank's chunks, StageChunks), so its matrices are whole
    in the stage."""

    def __init__(self, model, settings, grid: ProcessGrid):
        super().__init__(model, settings)
        self.tp_group, self.tp_size, self.tp_rank = grid.tp_group, grid.tp_size, grid.tp_rank
        # the dimension of each matrix (the last two of its parameter) that tp split, by name and by master piece
        self.split_dims = {name: param.tp_split_dim - (len(shape) - 2) for unit in model.units
                           for name, param, shape in zip(unit.names, unit.params, unit.shapes)
                           if getattr(param, "tp_split_dim", None) is not None}
        self.piece_split_dims = {piece.master: self.split_dims[piece.name] for unit in model.units
                                 for piece in unit.pieces if piece.master in self.piece_shapes
                                 and piece.name in self.split_dims}

    def matrix_shape(self, param: torch.Tensor) -> torch.Size:
        shape = list(super().matrix_shape(param))
        if param in self.piece_split_dims:
            shape[self.piece_split_dims[param]] *= self.tp_size
        return torch.Size(shape)

    def whole_matrix(self, matrix, local: torch.Tensor) -> torch.Tensor:
        dim = self.split_dims.get(matrix.name)
        if dim is None:
            return local
        stacked = torch.empty((self.tp_size * local.size(0), local.size(1)), dtype=local.dtype, device=local.device)
        comm.call(comm.all_gather_single, stacked, local.contiguous(), group=self.tp_group)
        return stacked if dim == 0 else torch.cat(stacked.chunk(self.tp_size), dim=1)

    def local_update(self, matrix, result: torch.Tensor) -> torch.Tensor:
        dim = self.split_dims.get(matrix.name)
        return result if dim is None else result.chunk(self.tp_size, dim=dim)[self.tp_rank]


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


def balancing_log(model, pipeline, grid: ProcessGrid):
    """The log of the step's aux and z losses, summed over the ranks holding other tokens (dp x cp)
    and other layers (pp); a model without them logs and reduces nothing."""
    return BalancingLog(measurement.model_parts(model, pipeline),
                        (grid.dp_cp_group, *((grid.pp_group,) if pipeline is not None else ())))


# ============================================================================ the technique: the composed step


def build_optimizer(model, grid: ProcessGrid, args) -> torch.optim.Optimizer:
    """--optimizer adamw: lesson 06's AdamW over this rank's master pieces (--offload optimizer: on
    the host, 06_zero_offload's); muon: lesson 06_zero_muon's Muon for the blocks' matrices (with
    tp's seam: TensorParallelMuon) and AdamW for the rest."""
    if args.optimizer == "adamw" and "optimizer" in args.offload:
        return zero_offload.build_offloaded_optimizer(model, args.lr)
    if args.optimizer == "adamw":
        return zero.build_sharded_optimizer(model, args.lr)
    muon = TensorParallelMuon(model, zero_muon.muon_settings(args), grid)
    rest = [(piece.name, piece.master) for unit in model.units for piece in unit.pieces
            if piece.master not in muon.piece_shapes]
    return zero_muon.MuonWithAdamW(muon, train_optimizer(rest, args.lr))


def step_settings(grid: ProcessGrid, device, precision, max_grad_norm: float, tail: str = "auto") -> StepSettings:
    """Lesson 06's settings, and the groups the norm from ZeRO's shards must also sum over:
    pipeline stages hold different layers (pp), tensor-parallel ranks different slices of them,
    whose replicated gains count once (lesson 02's rule)."""
    pp_groups = (grid.pp_group,) if grid.pp_size > 1 else ()
    tp_groups = (grid.tp_group,) if grid.tp_size > 1 else ()
    tp_counts = tensor_parallel.tp_counts_toward_norm(grid.tp_group) if grid.tp_size > 1 else None
    return replace(zero.step_settings(device, precision, max_grad_norm, tail), norm_groups=(*pp_groups, *tp_groups),
                   counts_toward_norm=tp_counts)


def train_step(model_or_pipeline, optimizer, batch: StepBatch, settings: StepSettings, bias_update_rate: float = 0.0,
               balancing_log=None) -> StepResult:
    """The micro-batches through lesson 03's schedule on this rank's chunks, or lesson 01's loop;
    then lesson 06's sharded tail (at ZeRO-0 with experts its norm counting every expert once:
    counting_every_expert_once); with experts lesson 05's: the balancing losses count the step's
    sequences (count_the_steps_sequences), the router biases move unless the optimizer step was
    skipped (a non-finite norm, the same on every rank), and the aux and z losses go to the log."""
    pipelined = isinstance(model_or_pipeline, pipeline_parallel.Pipeline)
    model = model_or_pipeline.chunks[0].sharded if pipelined else model_or_pipeline
    count_the_steps_sequences(model, batch)         # experts: the step's sequences (a ramp's steps differ)
    if pipelined:
        loss = model_or_pipeline.forward_backward(batch)
        # only the last stage computes the loss: its share is summed over pp, then 06 sums it over dp x cp
        comm.call(dist.all_reduce, loss, group=model_or_pipeline.pp_group)
    else:
        loss = data_parallel.forward_backward(model, batch, settings)
    result = zero.finish_step(model, optimizer, loss, counting_every_expert_once(model, settings))
    if bias_update_rate:
        expert_parallel.update_router_biases(model.module, model.dp_group, bias_update_rate,
                                             result.values["grad_norm"])
    if balancing_log is None:
        return result
    return result.with_extra(balancing_log.step_values())


def evaluate(model_or_pipeline, batch: StepBatch, settings: StepSettings) -> float:
    """The forward-only loss through lesson 03's schedule or lesson 01's loop, the router loads as
    the step left them (lesson 05), ZeRO-3's gathered units released (lesson 06)."""
    pipelined = isinstance(model_or_pipeline, pipeline_parallel.Pipeline)
    # a pipeline's chunks all belong to the one ZeRO-wrapped model
    model = model_or_pipeline.chunks[0].sharded if pipelined else model_or_pipeline
    with expert_parallel.router_loads_kept(model):
        if pipelined:
            loss = pipeline_parallel.evaluate(model_or_pipeline, batch, settings)
            zero.release_gathered(model)        # ZeRO-3's units kept gathered (lesson 06's evaluate)
            return loss
        return zero.evaluate(model_or_pipeline, batch, settings)


@contextmanager
def outside_training(model):
    """A forward outside training (a sample) that leaves the run as it found it: the router loads
    as the step left them (lesson 05), ZeRO-3's gathered units released after (lesson 06)."""
    with expert_parallel.router_loads_kept(model.module):
        yield
    zero.release_gathered(model)


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
    The LM head's loss (picotron_like.loss) compiles its chunk bodies with the same backend: each
    chunk's softmax statistics and gradient in one fused kernel instead of a few float32 passes.
    `backend`: TorchInductor; the tests count compilations with a backend of their own."""
    if enabled:
        for block in model.layers:
            block.forward = torch.compile(block.forward, backend=backend)
        if model.lm_head is not None:
            model.lm_head.loss_settings = replace(model.lm_head.loss_settings, compile_backend=backend)
    return model


# ============================================================================ a batch that grows: --batch-ramp
#
# Early in training a small batch makes nearly the progress per step of a large one, for a fraction
# of its tokens: the critical batch (McCandlish et al. 2018's gradient noise scale), beyond which
# more tokens per step stop buying a larger step, grows as the loss falls. So large runs start with
# a fraction of their batch and grow it: GPT-3 from 32 k tokens over its first 4-12 B tokens,
# DeepSeek-V3 from 3,072 to 15,360 sequences over its first 469 B tokens. picotron_like.data.BatchRamp grows the global batch linearly in the tokens trained,
# and realises each step's size as a number of micro-batches per rank: every tensor keeps its shape
# (no recompilation, no new buffers), only the loop over micro-batches runs longer. What depends on
# that count follows the step's: 01's micro-batch loop (the gradient reduction on the last), 06's
# per-micro-batch ZeRO-2/3 reductions and ZeRO-3 gathers, 03's schedules (MicroBatchesOfTheStep),
# the loss's division by the global batch's targets (StepBatch.n_targets), 05's balancing losses'
# division by the step's sequences (count_the_steps_sequences; the router biases move on the
# step's load, whose sign does not depend on its size; capacity is per sequence), the learning rate's
# progress (counted in tokens: picotron_like.lr_schedule), the time budget's estimate (at the full
# batch: run_control.TimeBudget), the log's tokens/s, the report's traffic. A pipeline needs at
# least pp micro-batches per step to fill, and the interleaved schedule a multiple of pp: the ramp
# rounds each step's count up to that, and says so.


def count_the_steps_sequences(model, batch: StepBatch) -> None:
    """05 x the ramp: lesson 05's balancing losses are shares of the step's means over its sequences,
    a count prepare_balancing fixes; a ramp's steps each have their own, so every step sets it before
    its forward: this rank's rows times the ranks that hold other sequences (the dp x cp group over
    the cp ranks, which hold pieces of the same ones). From the batch's shapes: no device read."""
    layers = moe_layers(model.module)
    if layers:
        rows = sum(micro_batch[0].shape[0] for micro_batch in batch.micro_batches)
        dp = group_size(model.dp_group) // layers[0].batch_share.sequence_shards
        expert_parallel.prepare_balancing(model.module, rows * dp)


def ramp_rounding(grid, args) -> tuple[int, int]:
    """(the least micro-batches per rank a ramp's step may have, the multiple its count rounds up to):
    lesson 03's rules, pp and a multiple of pp for the interleaved schedule; 1 and 1 without a pipeline."""
    if grid.pp == 1:
        return 1, 1
    return grid.pp, grid.pp if args.schedule == "interleaved" else 1


def ramp_of_layout(args, grid, shape, manifest: dict | None = None) -> BatchRamp | None:
    """--batch-ramp START_TOKENS RAMP_TOKENS as this layout realises it (None without the flag),
    continued from the steps a resumed checkpoint recorded."""
    if args.batch_ramp is None:
        return None
    least, multiple = ramp_rounding(grid, args)
    start_tokens, ramp_tokens = args.batch_ramp
    return BatchRamp(start_tokens, ramp_tokens, shape.grad_accum, shape.micro_batch_size * shape.seq_len * grid.dp,
                     least, multiple, history=(manifest or {}).get("ramp_history", ()))


def ramp_problems(cfg, grid, shape, args, world_size: int) -> list[str]:
    """Bad --batch-ramp values, and every micro-batch count the ramp can take checked by lesson 03's rules."""
    start, ramp = args.batch_ramp
    least, multiple = ramp_rounding(grid, args)
    micro_step = shape.micro_batch_size * shape.seq_len * grid.dp
    if start < 1 or ramp < 1:
        return [f"--batch-ramp {start} {ramp}: the first step's tokens and the tokens over which the batch grows "
                f"must both be positive"]
    problems = []
    if start > shape.tokens_per_step:
        problems.append(f"--batch-ramp {start} {ramp}: a first step of {start:,} tokens is larger than the full "
                        f"batch of {shape.tokens_per_step:,}: the ramp grows the batch; start below it")
    if start < least * micro_step:
        pipeline = f" x pp {grid.pp}" if grid.pp > 1 else ""
        problems.append(f"--batch-ramp {start} {ramp}: a first step of {start:,} tokens is less than one micro-batch "
                        f"per dp rank{pipeline}: {shape.micro_batch_size} x {shape.seq_len} tokens x dp {grid.dp}"
                        f"{pipeline} = {least * micro_step:,}; start at that or more")
    if problems or grid.pp == 1:
        return problems
    for count in sorted({least, shape.grad_accum, *range(multiple, shape.grad_accum, multiple)} - set(range(least))):
        try:
            zero_bubble.validate_pipeline_config(grid, world_size, cfg, args.schedule, args.virtual_stages, count,
                                                 f"a --batch-ramp step of {count} micro-batches")
        except ConfigError as error:
            problems.append(str(error).replace("\n  - ", "; "))
    return problems


def describe_ramp(ramp: BatchRamp, args, grid) -> str:
    """The ramp as this layout realises it, in one line: what --batch-ramp asked, how it rounds."""
    start, ramp_tokens = args.batch_ramp
    least, multiple = ramp_rounding(grid, args)
    first = ramp.step_tokens(0)
    rounded = f" (asked {start:,}: rounded up to whole micro-batches)" if first != start else ""
    rule = (f", a multiple of pp {grid.pp} for the interleaved schedule" if multiple > 1
            else f", at least pp {grid.pp}" if least > 1 else "")
    return (f"batch ramp: {first:,} tokens in the first step{rounded}, growing with the tokens trained to "
            f"{ramp.full_tokens:,} after {ramp_tokens:,} (full from step {ramp.full_from()}), in micro-batches of "
            f"{ramp.micro_step_tokens:,} tokens over the dp ranks{rule}")


# ============================================================================ configuration rules


# the model this run trains: the preset with lesson 05's MoE flags, or with --init-from a Hub folder's
model_config = partial(hub.model_config, configure=expert_parallel.moe_config)


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
    zero_muon.validate_muon(args)
    sampling.sample_prompt(args, cfg, grid)
    # lesson 04's rules include the grid's
    context_parallel.validate_context_parallel(grid, world_size, cfg, shape.seq_len, args.zigzag, args.cp_mode)
    if cfg.n_experts:
        # The ep ranks are drawn from the dp x cp ranks (the grid's rule, which names them); to lesson 05's
        # rules those are the ranks holding other tokens.
        ep = expert_degree(args.ep, cfg, grid)
        grid.check_ep(ep)
        expert_parallel.validate_expert_parallel(cfg, ep, grid.dp * grid.cp, args.bias_update_rate)
        uneven = tensor_parallel.split_problems(cfg, grid.tp)
        if uneven:
            raise ConfigError("bad parallel configuration:\n  - " + "\n  - ".join(uneven))
    elif grid.tp > 1:
        tensor_parallel.validate_tensor_parallel(cfg, grid.tp)
    # at pp = 1 too: lesson 03 refuses its interleaving flags there instead of ignoring them; here the
    # micro-batch count is --grad-accum's (lesson 03's own flag is --micro-batches)
    zero_bubble.validate_pipeline_config(grid, world_size, cfg, args.schedule, args.virtual_stages, shape.grad_accum,
                                         "--grad-accum" if args.global_batch_tokens is None else
                                         pipeline_parallel.micro_batch_source(args, shape, grid))
    if args.batch_ramp is not None:
        problems = ramp_problems(cfg, grid, shape, args, world_size)
        if problems:
            raise ConfigError("bad --batch-ramp:\n  - " + "\n  - ".join(problems))
    checkpoints.check_flags(args)
    checkpoints.checkpoint_to_resume(args, cfg, shape)


def composition_problems(cfg, grid, args) -> list[str]:
    """The pairs of techniques this trainer does not combine, and the rules two gain together (Ulysses
    over a tp rank's heads, sequence parallelism over a cp rank's tokens), each with its reason.
    Muon (--optimizer muon) combines with everything but --offload optimizer: with --fp8, whose layers keep their weights
    (a float32 master, weights in the compute dtype; FP8 copies live inside a matmul only), so Muon
    steps the same master with the same gradients; with zero-bubble, whose W's all run before the
    step's tail, where the optimizer steps, as AdamW does."""
    problems = fp8.fp8_problems(cfg, grid, args)
    if args.schedule == "zero-bubble":
        problems += zero_bubble_problems(grid, args)
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
    if args.offload_blocks is not None and "activations" not in args.offload:
        problems.append(f"--offload-blocks {args.offload_blocks} without --offload activations: it chooses the "
                        f"blocks whose activations go to the host; add --offload activations or drop it")
    if "activations" in args.offload:
        problems += activation_offload_problems(args)
    if "optimizer" in args.offload and args.optimizer == "muon":
        problems.append("--offload optimizer with --optimizer muon: Muon's Newton-Schulz is matmuls, tens of "
                        "times slower on a host's cores than on the GPU, and its all-to-alls of the master's "
                        "pieces would run on host tensors; use --optimizer adamw or drop --offload optimizer")
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


def activation_offload_problems(args) -> list[str]:
    """What --offload activations does not compose with here, each with its reason."""
    problems = []
    if args.offload_blocks is not None and args.offload_blocks < 1:
        problems.append(f"--offload-blocks {args.offload_blocks}: the count of each chunk's first blocks to offload "
                        f"must be at least 1; drop --offload activations to offload none")
    if args.schedule == "zero-bubble":
        problems.append("--offload activations with --schedule zero-bubble: B fetches the linears' inputs back and "
                        "they wait on the device in the W queue until W, giving back the memory offload saves; use "
                        "--schedule 1f1b")
    if args.compile:
        problems.append("--offload activations with --compile: a compiled block saves what the compiler's "
                        "partitioner chooses, which the offload's hooks are not proven on; drop --compile")
    return problems


def expert_degree(ep: int | None, cfg, grid) -> int:
    """--ep's default: lesson 05's over the dp x cp ranks that hold other tokens (as many ep ranks
    as those ranks and the experts allow: their greatest common divisor) with experts, else 1."""
    return ep if ep is not None else (math.gcd(grid.dp * grid.cp, cfg.n_experts) if cfg.n_experts else 1)


# ============================================================================ main


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description="Lesson 07: the full 5D-parallel trainer (run with torchrun).",
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_parallel_flags(parser, axes=("dp", "pp", "cp", "tp", "ep"), fill_axis="dp", bucket_flag=False)
    zero.add_zero_flags(parser)
    zero_muon.add_muon_flags(parser)
    sampling.add_sample_flags(parser)
    expert_parallel.add_moe_flags(parser)
    zero_bubble.add_schedule_flags(parser)
    pipeline_parallel.add_async_sends_flag(parser)
    context_parallel.add_context_parallel_flags(parser)
    tensor_parallel.add_async_dgrad_flag(parser)
    add_training_flags(parser, micro_batch_size=4, grad_accum=2, steps=20)
    parser.add_argument("--recompute", choices=measurement.RECOMPUTE_MODES, default="none",
                        help="selective: compute the norms' arithmetic and SwiGLU's silu again in backward (no "
                             "matmul, no collective); full: keep only each block's input and run its forward again")
    parser.add_argument("--compile", action="store_true",
                        help="torch.compile each block's forward and the loss's chunk bodies (the first step compiles: "
                             "~20 s or more on a CPU)")
    fp8.add_fp8_flag(parser)
    parser.add_argument("--offload", nargs="+", choices=("optimizer", "activations"), default=[],
                        help="move to host memory, off the device: optimizer, the float32 master and AdamW's states "
                             "of this rank's shard, stepped on the host's CPU (06_zero_offload); activations, the "
                             "tensors chosen blocks keep for backward (copied out during forward, fetched back one "
                             "block ahead of their backward, over the host link: --plan prints the bandwidth it "
                             "needs)")
    parser.add_argument("--offload-blocks", type=int, default=None, metavar="N",
                        help="with --offload activations: the first N blocks of each pipeline chunk offload their "
                             "kept tensors (a chunk with fewer offloads all); default all but each chunk's last, "
                             "whose backward follows its forward at once, leaving no compute to hide its copies")
    parser.add_argument("--batch-ramp", nargs=2, type=int, default=None, metavar=("START_TOKENS", "RAMP_TOKENS"),
                        help="grow the global batch linearly in the tokens trained: START_TOKENS in the first step, "
                             "the full batch (--global-batch-tokens, or --grad-accum's) after RAMP_TOKENS; each "
                             "step's micro-batches per rank rounded up (a pipeline: at least pp, interleaved: a "
                             "multiple of pp)")
    parser.add_argument("--memory-snapshot", default=None, metavar="FILE",
                        help="CUDA: record the allocator's history over the first steps and write it to "
                             "FILE.rankN.pickle, for https://pytorch.org/memory_viz")
    checkpoints.add_checkpoint_flags(parser)
    hub.add_init_flag(parser)
    memory_plan.add_plan_flags(parser)
    sizing.add_sizing_flags(parser)
    autotune.add_autotune_flags(parser)
    calibration.add_calibrate_flags(parser)
    parser.set_defaults(zero_stage=None,        # follows the layout: layout_defaults
                        optimizer="adamw")      # AdamW unless Muon is asked for (06_zero_muon's default is its subject)
    return layout_defaults(pipeline_parallel.resolve_virtual_stages(parser.parse_args(argv)))


def layout_defaults(args):
    """The defaults that follow the layout, so that every layout the rules accept runs with the
    other flags at their defaults: ZeRO-3, or under a pipeline ZeRO-1 (ZeRO-2/3 there hold the
    gradients whole through the step and ZeRO-3 gathers each unit 2m times or keeps them all
    gathered: PipelinedZeroStage3; --plan says where one is faster). The expert degree follows it
    too (expert_degree)."""
    if args.zero_stage is None:
        args.zero_stage = 1 if args.pp > 1 else 3
    return args


def main(argv=None):
    args = parse_args(argv)
    if args.plan and args.max_minutes is not None:      # 07_sizing: which model and tokens the minutes allow
        return sizing.print_sizing(args, sys.argv[1:] if argv is None else argv, validate, expert_degree,
                                   ramp_of_layout)
    if args.plan:           # 07_memory_plan: no training, no torchrun
        return memory_plan.print_memory_plan(args, validate, expert_degree)
    if args.autotune:       # 07_autotune: the plan's best layouts, each trained by a child torchrun of this file
        return autotune.autotune(args, sys.argv[1:] if argv is None else argv, validate, expert_degree)
    if args.zero_table:
        return print(memory_plan.zero_memory_table(args, (8, 64)))
    if args.calibrate:      # picotron_like.calibrate: this machine's device profile for --plan, no training
        return calibration.calibrate(args)
    plan = plan_run(args, validate, model_config)        # every rule checked before any process group
    manifest = checkpoints.checkpoint_to_resume(args, plan.cfg, plan.shape)
    ramp = ramp_of_layout(args, plan.grid, plan.shape, manifest)     # --batch-ramp: None, or each step's size
    data = plan.batches.with_ramp(ramp)
    device = init_distributed()
    snapshot = measurement.start_memory_history(args.memory_snapshot, device)
    grid = ProcessGrid(plan.grid, ep=expert_degree(args.ep, plan.cfg, plan.grid))     # the five axes' groups
    model, pipeline = parallelize(plan.cfg, grid, args, device,
                                  values_to_load=manifest is not None or args.init_from is not None)
    optimizer = build_optimizer(model, grid, args)
    settings = step_settings(grid, device, model.precision, args.max_grad_norm, args.step_tail)
    log0(f"lesson 07: dp={grid.dp_size} x pp={grid.pp_size} x cp={grid.cp_size} x tp={grid.tp_size}, "
         f"ep={grid.ep_size}, ZeRO-{args.zero_stage}, recompute {args.recompute}, {args.optimizer}"
         + (f" (lr {args.muon_lr} for the blocks' matrices, AdamW's {args.lr} for the rest)"
            if args.optimizer == "muon" else "") + ", "
         f"{count_parameters(plan.cfg)['total']:,} parameters, {plan.shape.tokens_per_step:,} tokens per step")
    if ramp is not None:
        log0(describe_ramp(ramp, args, grid.shape))
    start_step = checkpoints.resume(args, manifest, model, optimizer, grid)
    if manifest is None and args.init_from is not None:     # once a checkpoint exists, it comes first
        hub.init_from_hub(args.init_from, model, grid)
    # the report predicts the metered step (this process's first) for its micro-batch count, the traffic for each step's
    metered_shape = replace(plan.shape, grad_accum=data.grad_accum_at(start_step))
    run = measurement.ComposedRun(model, pipeline, optimizer, plan.cfg, metered_shape, grid, args, data, start_step)
    meters = measurement.ReportMeters.of(run)
    first_steps = measurement.FirstStepsMemory(model, optimizer, device, snapshot=snapshot, first_step=start_step)
    model_or_pipeline = model if pipeline is None else pipeline
    step = first_steps.observe(partial(train_step, model_or_pipeline, optimizer, settings=settings,
                                       bias_update_rate=args.bias_update_rate,
                                       balancing_log=balancing_log(model, pipeline, grid)))
    with meters.every_step or nullcontext():
        # dp: this rank's share of the global batch; cp: its cut of each sequence
        batches = RankBatches(data, grid.dp_rank, device,
                              cut=context_parallel.sequence_cut(grid, args.zigzag), val=plan.val_batches)
        throughput = train(args, optimizer, step, batches,
                           evaluate=partial(evaluate, model_or_pipeline, settings=settings),
                           meters=StepMeters(meters.of_the_metered_step(), step=start_step), cfg=plan.cfg,
                           start_step=start_step,
                           after_step=one_after_another(
                               sampling.training_sampler(args, plan.cfg, grid, model, settings,
                                                         partial(outside_training, model)),
                               checkpoints.checkpoint_saver(args, plan.cfg, plan.shape, grid, model, optimizer, data)))
    model.wait_for_weights()        # the last step's gathers, before the report and the process group's end
    if pipeline is not None:        # the report reads the metered step's schedule
        pipeline.follow_micro_batches(metered_shape.grad_accum)
    measurement.report(run, meters, throughput, device)
    first_steps.report()
    shutdown()


if __name__ == "__main__":
    main()
