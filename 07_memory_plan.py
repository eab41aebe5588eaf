"""
Lesson 07's memory plan: will a model fit a layout, and which layout to pick, before anything is launched.

    python 07_full_5d.py --plan --preset 8b --gpus 8 --gpu B300 --seq-len 8192 --micro-batch-size 1 --grad-accum 8

Booking 8 x B300 for a run that dies at its first step of an out-of-memory error is the expensive
way to find out. Every byte a rank of lesson 07's trainer holds has a formula in the lesson that
owns it, so the plan adds them up for any layout of the usual flags on --gpus GPUs, no process
group, no GPU:

    parameters, gradients,        lesson 06's formula (predicted_model_states) on its unit counts
    master weights, Adam states   (unit_parameter_counts: the stage's units, tp's slices, experts
                                  over ep, sharded over dp x cp or, for experts, edp); under
                                  --optimizer muon one float32 momentum per element of the
                                  matrices a rank's shards hold (06_zero_muon's, from the units'
                                  shapes: PlannedExchange), AdamW's two for the rest
    activations                   lesson 07's per micro-batch (recompute mode, compute dtype, the
                                  stage), times the micro-batches lesson 03's schedule keeps live;
                                  with experts lesson 05's per-layer bytes for balanced routing;
                                  with --fp8 the blocks' matmul inputs as FP8 copies (07_fp8.py)
    gathered weights (ZeRO-3)     lesson 06's prefetch window (under a pipeline within a chunk, or
                                  the stage's units kept gathered: lesson 07's PipelinedZeroStage3)
    gradients, whole in the step  under a pipeline, ZeRO-2/3's gradients accumulated whole until
                                  their one reduction per step (lesson 07's PipelinedZeroStage2/3)
    communication buffers         estimated here: a unit's gradients on their way into ZeRO's
                                  buffers (flat copies in flight at stages 2-3), a pipeline
                                  boundary's tensors, ring attention's K/V blocks

It prints them for the fullest rank (the pipeline stage that holds most), the verdict against 90%
of the GPU's memory (the rest: CUDA context, NCCL, allocator fragmentation), and every layout that
fits the same global batch, ranked by an estimated step time, with the tokens/s per GPU and the
MFU the step line would print. The estimate prices every operation of a stage's micro-batch from
a device profile (picotron_like.step_costs: each GEMM of the layout's split at the rate measured
for its shape, attention by its kernel, elementwise passes by bytes over memory bandwidth, each
collective by its algorithm's latency and bytes over its group's link), adds recomputation's
extra forward and lesson 03's bubble, and overlaps communication only where the code does; its
assumptions are printed with it. The profile is --gpu's published one
(picotron_like/published_profiles.py), its kernels' and links' shares fitted on the Ultra-Scale
Playbook's measured runs (benchmarks/step_time_vs_published.py checks it against all of them).
With --fp8 the blocks' matmuls count at the profile's FP8 rate (where they run on FP8 tensor
cores; on a GPU only those 07_fp8's shape rule keeps in FP8, the others and the router and routed
experts at bf16's), their quantisations are elementwise passes (fp8_quantisation_seconds) and
tp's all-reduces of the amaxes join tp's traffic. With --optimizer muon the step adds what
Muon's does, unoverlapped (muon_seconds): the busiest owner's Newton-Schulz on its whole matrices,
its joins over tp, and the two all-to-alls that carry the matrices to their owners and back.

Proven (tests/test_memory_plan.py): at small scale on CPU the plan equals the bytes each rank
holds, component by component (model states, activations, ZeRO-3's window), for several layouts,
stages and recompute modes, and under Muon its states and the bytes of its all-to-alls and tp
joins (planned_muon_traffic) equal the meter's; at real scale its model states equal those of the sharded 8b model on
8 and 64 GPUs and of Mixtral-8x7B on 64, built rank by rank on the meta device by lesson 06's own
build_model from a grid that knows only the rank (LaidOutGrid): nothing is drawn.
The communication buffers and the step time are estimates, and say so.
"""

from __future__ import annotations

import argparse
import copy
import itertools
import math
from collections import Counter
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import NamedTuple

import torch

from picotron_like.lessons import load_lesson
from picotron_like.loss import LossSettings, loss_chunk_shape, loss_chunk_tokens
from picotron_like import comm, step_costs
from picotron_like.device_profile import DeviceProfile, ProfileError, load_profile
from picotron_like.metrics import add_traffic, loss_transient_parts
from picotron_like.model import count_parameters, flops_per_token
from picotron_like.pipeline_tools import peak_live_micro_batches
from picotron_like.published_profiles import PUBLISHED_GPUS, published_profile
from picotron_like.topology import ConfigError, GridShape, GroupLayout, ProcessGrid
from picotron_like.train import (batch_shape, check_flag_ranges, config_from_flags, exit_with_error, grid_from_args,
                                 model_name)

tensor_parallel = load_lesson("02_tensor_parallel")
pipeline_parallel = load_lesson("03_pipeline_parallel")
context_parallel = load_lesson("04_context_parallel")
expert_parallel = load_lesson("05_expert_parallel")
zero = load_lesson("06_zero")
zero_muon = load_lesson("06_zero_muon")
zero_offload = load_lesson("06_zero_offload")
zero_bubble = load_lesson("03_zero_bubble")
fp8 = load_lesson("07_fp8")
activation_offload = load_lesson("07_activation_offload")
measurement = load_lesson("07_report")

# ============================================================================ the technique: the memory plan


class LaidOutGrid(ProcessGrid):
    """One rank of a layout, as the lessons' builders and formulas see a ProcessGrid, with no
    process group: each group is a GroupLayout, the rank's place in it and its size, which is all
    that cutting a rank's share of a model needs. So the plan reads any rank of any layout, and
    builds its share on the meta device, without launching a single process."""

    def __init__(self, shape: GridShape, ep: int, rank: int):
        self.lay_out(shape, ep, rank)

    def _create_group_of(self, all_ranks: list[list[int]], name: str) -> GroupLayout:
        members = next(ranks for ranks in all_ranks if self.rank in ranks)
        return GroupLayout(members.index(self.rank), len(members))


# The plan keeps this share of a GPU free: the CUDA context and kernel workspaces (1-2 GiB), NCCL's
# buffers (both outside PyTorch's allocator), and the spread of the allocator's reserve around its
# estimate (planned_memory's last row: the Playbook's runs reserved 0 to 0.58 of their transient
# bytes beyond the peak, where the estimate takes one fitted share; benchmarks/RESULTS.md).
PLAN_MARGIN = 0.10
GIB = 2**30


def unit_parameter_layouts(cfg, tp: int = 1, pp: int = 1, pp_rank: int = 0, ep: int = 1,
                           experts: bool = False, virtual_stages: int = 1) -> list[list[tuple[str, tuple]]]:
    """The units of one tp rank of pipeline rank `pp_rank`, parameter by parameter in the order
    lesson 06 flattens them, as (the reference's name, the shape this rank holds): the embedding
    (first stage), the blocks of its stage (of its v chunks, interleaved), the head (last stage,
    which is always on the last rank); norm gains stay whole under tp, the other weights are cut
    as lesson 02 cuts them. With experts (lesson 05's split), a block's dense unit holds the
    attention, the norms, the router (whole on every tp rank) and the shared expert (split like a
    dense MLP); experts=True gives each unit's routed experts instead: E/ep of them, each split
    over tp (none in embedding, head)."""
    h, hd, f = cfg.hidden, cfg.head_dim, cfg.ffn_hidden

    def swiglu(prefix: str, width: int, stacked: tuple = (), suffix: str = ".weight") -> list:
        """gate and up, width/tp by h; down, h by width/tp (each a stack of `stacked` for experts)"""
        if not width:
            return []
        return [(f"{prefix}.gate_proj{suffix}", (*stacked, width // tp, h)),
                (f"{prefix}.up_proj{suffix}", (*stacked, width // tp, h)),
                (f"{prefix}.down_proj{suffix}", (*stacked, h, width // tp))]

    def block(layer: int) -> list:
        name = f"layers.{layer}"
        if experts:
            return swiglu(f"{name}.mlp.experts", f * bool(cfg.n_experts), (cfg.n_experts // ep,), "")
        mlp = ([(f"{name}.mlp.router.weight", (cfg.n_experts, h))]
               + swiglu(f"{name}.mlp.shared_expert", cfg.n_shared_experts * f) if cfg.n_experts
               else swiglu(f"{name}.mlp", f))
        return [(f"{name}.attn_norm.weight", (h,)), (f"{name}.attn.q_proj.weight", (cfg.n_heads * hd // tp, h)),
                (f"{name}.attn.k_proj.weight", (cfg.n_kv_heads * hd // tp, h)),
                (f"{name}.attn.v_proj.weight", (cfg.n_kv_heads * hd // tp, h)),
                (f"{name}.attn.o_proj.weight", (h, cfg.n_heads * hd // tp)), (f"{name}.mlp_norm.weight", (h,)), *mlp]

    ranges = pipeline_parallel.stage_layer_ranges(cfg.n_layers, pp * virtual_stages)
    layers = sorted(layer for stage in range(pp_rank, pp * virtual_stages, pp) for layer in ranges[stage])
    embedding = [] if experts else [("tok_embeddings.weight", (cfg.vocab_size // tp, h))]
    head = [] if experts else [("norm.weight", (h,)), ("lm_head.weight", (cfg.vocab_size // tp, h))]
    return [embedding] * (pp_rank == 0) + [block(layer) for layer in layers] + [head] * (pp_rank == pp - 1)


def unit_parameter_counts(cfg, tp: int = 1, pp: int = 1, pp_rank: int = 0, ep: int = 1,
                          experts: bool = False, virtual_stages: int = 1) -> list[int]:
    """Parameters of each unit on one tp rank of pipeline rank `pp_rank` (unit_parameter_layouts)."""
    return [sum(math.prod(shape) for _, shape in unit)
            for unit in unit_parameter_layouts(cfg, tp, pp, pp_rank, ep, experts, virtual_stages)]


@lru_cache(maxsize=None)
def stage_outline(cfg, pp: int, pp_rank: int, virtual_stages: int = 1) -> tuple:
    """Lesson 03's chunks of pipeline rank `pp_rank` (its stage, or its v interleaved chunks),
    built on the meta device: their layers and whether they hold the embedding and the head,
    which is what the formulas read from them (no tensor is drawn)."""
    with torch.device("meta"):
        return tuple(pipeline_parallel.build_stage_chunks(cfg, 0, pp, pp_rank, virtual_stages))


def pipeline_program(schedule: str, pp: int, n_micro: int, pp_rank: int, virtual_stages: int = 1) -> list:
    return pipeline_programs(schedule, pp, n_micro, virtual_stages)[pp_rank]


@lru_cache(maxsize=None)
def pipeline_programs(schedule: str, pp: int, n_micro: int, virtual_stages: int) -> list:
    # lesson 03's schedules and zero-bubble's, as lesson 07 runs them: every rank's at once, once
    return zero_bubble.pipeline_programs(schedule, pp, n_micro, virtual_stages)


def planned_activation_bytes(cfg, args, grid: GridShape, ep: int, shape, precision, pp_rank: int,
                             device: DeviceProfile) -> tuple[int, int]:
    """(kept bytes at the schedule's peak, micro-batches live then) on pipeline rank `pp_rank`:
    one micro-batch of each of its chunks by this lesson's formula (recompute mode, compute dtype,
    the chunk's layers), walked over lesson 03's program; with experts lesson 05's per-layer bytes
    for balanced routing: each of the k T assignments of the T tokens goes to an expert that
    receives k T / E, so capacity drops none and every ep rank receives as many rows as it sends
    (a skewed router keeps more on its busiest rank). Interleaved, a live micro-batch is one
    (chunk, micro-batch) pair."""
    chunks = stage_outline(cfg, grid.pp, pp_rank, args.virtual_stages) if grid.pp > 1 else (None,)
    e, tp, micro = precision.param_dtype.itemsize, grid.tp, shape.micro_batch_size
    experts = measurement.experts_per_tp_rank(cfg, tp)
    grouped = measurement.uses_grouped_experts(args, cfg, tp, precision.param_dtype, torch.device("cuda"),
                                               device.capability)

    def one_micro_batch(stage) -> int:
        kept = measurement.predicted_kept_activation_bytes(cfg, micro, shape.seq_len, args.recompute, tp,
                                                           args.sequence_parallel, grid.cp, stage,
                                                           precision.param_dtype)
        layers = cfg.n_layers if stage is None else len(stage.layer_ids)
        # --fp8: FP8 copies of the blocks' matmul inputs instead of bf16 ones (07_fp8.py)
        tokens = micro * shape.seq_len // grid.cp
        kept += fp8.kept_bytes_difference(cfg, args.fp8, tokens, tp, precision.param_dtype, layers, args.recompute,
                                          args.sequence_parallel,
                                          fp8.fp8_groups_of_run(cfg, args, tokens, tp, device.capability is not None))
        if cfg.n_experts and args.recompute != "full":
            tokens = micro * shape.seq_len // grid.cp
            routed = cfg.experts_per_token * tokens
            kept += layers * expert_parallel.moe_layer_bytes_over_dense(experts, tokens, micro, routed, routed, ep,
                                                                        grouped, e)
        # --offload activations: the chunk's offloaded blocks wait in host memory (07_activation_offload)
        return kept - planned_offload_of_chunk(cfg, args, grid, ep, shape, precision, stage, device).off_device

    sizes = [one_micro_batch(stage) for stage in chunks]
    held = sum(planned_offload_of_chunk(cfg, args, grid, ep, shape, precision, stage, device).held
               for stage in chunks)
    if grid.pp == 1:
        return sizes[0] + held, 1
    program = pipeline_program(args.schedule, grid.pp, shape.grad_accum, pp_rank, args.virtual_stages)
    return peak_live_micro_batches(program, sizes) + held, peak_live_micro_batches(program)


class ChunkOffload(NamedTuple):
    """--offload activations in one chunk, per micro-batch: bytes off the device, bytes in host memory,
    one offloaded block's (the most the device holds of them at once, estimated: one in flight out in
    forward, one fetched ahead in backward), and what stays on the device all the same (an MoE layer's
    last choices, which the layer holds; once, not per micro-batch)."""

    off_device: int = 0
    host: int = 0
    one_block: int = 0
    held: int = 0
    blocks: int = 0


def planned_offload_of_chunk(cfg, args, grid: GridShape, ep: int, shape, precision, stage, device) -> ChunkOffload:
    """07_report's offloaded_activation_bytes for the chunk's offloaded blocks, with 07_fp8's FP8 copies and,
    with experts, lesson 05's bytes of each offloaded MoE layer for balanced routing (planned_activation_bytes)."""
    if "activations" not in args.offload:
        return ChunkOffload()
    layers = cfg.n_layers if stage is None else len(stage.layer_ids)
    blocks = activation_offload.offloaded_blocks(layers, args.offload_blocks)
    e, tp, micro = precision.param_dtype.itemsize, grid.tp, shape.micro_batch_size
    tokens = micro * shape.seq_len // grid.cp
    off_device, host = measurement.offloaded_activation_bytes(cfg, micro, shape.seq_len, args.recompute, tp,
                                                             args.sequence_parallel, grid.cp, stage,
                                                             precision.param_dtype, blocks)
    per_block = fp8.kept_bytes_difference(cfg, args.fp8, tokens, tp, precision.param_dtype, 1, args.recompute,
                                          args.sequence_parallel,
                                          fp8.fp8_groups_of_run(cfg, args, tokens, tp, device.capability is not None))
    held = 0
    if cfg.n_experts and args.recompute != "full":
        routed = cfg.experts_per_token * tokens
        grouped = measurement.uses_grouped_experts(args, cfg, tp, precision.param_dtype, torch.device("cuda"),
                                                   device.capability)
        per_block += expert_parallel.moe_layer_bytes_over_dense(measurement.experts_per_tp_rank(cfg, tp), tokens,
                                                                micro, routed, routed, ep, grouped, e)
        held = blocks * tokens * (8 * cfg.n_experts + (cfg.experts_per_token if cfg.capacity_factor is not None else 0))
    one_block = (host + blocks * per_block) // blocks if blocks else 0
    return ChunkOffload(off_device + blocks * per_block, host + blocks * per_block, one_block, held, blocks)


class PlannedOffload(NamedTuple):
    """--offload activations on one pipeline rank: host memory at its peak, the bytes each way over the
    host link per step, the offloaded blocks per step (each copied out and back), and the largest
    block's bytes (what the device holds of them at once, estimated: one in flight)."""

    host_peak: int
    link_bytes_per_step: int
    blocks_per_step: int
    one_block: int


def planned_offload(cfg, args, grid: GridShape, ep: int, shape, precision, pp_rank: int, device) -> PlannedOffload:
    """The chunks' offloads walked over lesson 03's program as planned_activation_bytes walks the kept bytes."""
    chunks = stage_outline(cfg, grid.pp, pp_rank, args.virtual_stages) if grid.pp > 1 else (None,)
    offloads = [planned_offload_of_chunk(cfg, args, grid, ep, shape, precision, stage, device) for stage in chunks]
    hosts = [offload.host for offload in offloads]
    host_peak = hosts[0] if grid.pp == 1 else peak_live_micro_batches(
        pipeline_program(args.schedule, grid.pp, shape.grad_accum, pp_rank, args.virtual_stages), hosts)
    return PlannedOffload(host_peak, shape.grad_accum * sum(hosts),
                          shape.grad_accum * sum(offload.blocks for offload in offloads),
                          max(offload.one_block for offload in offloads))


def planned_buffer_bytes(cfg, args, grid: GridShape, shape, precision, flat_units: list[int]) -> int:
    """Communication buffers at the backward's peak, an estimate (the CPU cannot measure them):
    autograd's per-parameter gradients of one unit (p bytes) until ZeRO takes them: at stages 0-1
    straight into the unit's gradient buffer (counted with the model states), at stages 2-3 into a
    flat copy to reduce-scatter (g bytes), while the previous unit's copy and its reduced shard are
    still in flight (under a pipeline into their whole buffers, as at stage 1). A pipeline stage receives one activation and one gradient at the boundary;
    ring attention holds the K/V block it computes on and the one arriving."""
    p, g = precision.param_dtype.itemsize, precision.reduce_dtype.itemsize
    largest = max(flat_units)
    n = grid.dp * grid.cp
    # (under a pipeline ZeRO-2/3 reduce the whole buffers, counted apart: no flat copies)
    buffers = largest * p + (2 * largest * g + largest // n * g if args.zero_stage >= 2 and grid.pp == 1 else 0)
    tokens = shape.micro_batch_size * shape.seq_len // grid.cp
    if grid.pp > 1:
        buffers += 2 * p * tokens * cfg.hidden // (grid.tp if args.sequence_parallel else 1)
    if grid.cp > 1 and args.cp_mode == "ring":
        buffers += 2 * 2 * tokens * cfg.n_kv_heads // grid.tp * cfg.head_dim * p
    return buffers


def planned_loss_parts(cfg, args, grid: GridShape, shape, precision, pp_rank: int,
                       device: DeviceProfile) -> dict[str, int]:
    """The chunked loss's backward on a rank that holds the LM head (the last pipeline stage; none
    on the others), by part: metrics.loss_transient_parts for its tokens (b s / cp, the whole
    sequence under sequence parallelism, which gathers it again for the head) and its vocabulary
    slice V / tp, in the weights' dtype, with the device's chunk budget, its bodies compiled under
    --compile. It comes at the start of a micro-batch's backward, when the activations counted
    above are all alive: the step's peak, together with them."""
    if pp_rank != grid.pp - 1:
        return {}
    tokens = shape.micro_batch_size * shape.seq_len // grid.cp
    return loss_transient_parts(tokens, cfg.hidden, cfg.vocab_size // grid.tp, precision.param_dtype,
                                regathered_input=args.sequence_parallel, device_type=device.device_type,
                                settings=planned_loss_settings(args))


def planned_loss_settings(args) -> LossSettings:
    """How a run with these flags runs its loss: its chunk bodies compiled under --compile."""
    return LossSettings(compile_backend="inductor" if args.compile else None)


def zero_units(cfg, args, grid: GridShape, ep: int, pp_rank: int, place: int | None = None):
    """Pipeline stage `pp_rank`'s units as lesson 07's ZeroUnits: their dense parameters over dp x
    cp and their experts over edp = dp x cp / ep (unit_parameter_counts); under Muon, the matrices'
    elements that the rank at `place` of its dp x cp group holds (None: the rank that holds fewest,
    whose AdamW states make it the fullest)."""
    dense = unit_parameter_counts(cfg, grid.tp, grid.pp, pp_rank, virtual_stages=args.virtual_stages)
    experts = unit_parameter_counts(cfg, grid.tp, grid.pp, pp_rank, ep, True, args.virtual_stages)
    n = grid.dp * grid.cp
    muon = 0
    if args.optimizer == "muon":
        exchanges = planned_exchanges(cfg, args, grid, ep, pp_rank)
        muon = min(muon_elements_at(exchanges, ep, where) for where in ([place] if place is not None else range(n)))
    chunks = measurement.units_per_chunk(stage_outline(cfg, grid.pp, pp_rank, args.virtual_stages)) \
        if grid.pp > 1 else ()
    return measurement.ZeroUnits(dense, experts, n, n // ep, muon, chunks)


@lru_cache(maxsize=None)
def muon_elements_at(exchanges: tuple, ep: int, place: int) -> int:
    """The matrices' elements the rank at `place` of its dp x cp group holds (stage_exchanges')."""
    return zero_muon.muon_elements_held(at_place(exchanges, ep, place))


# ---------------------------------------------------------------------------- Muon's matrices in the plan


@dataclass(frozen=True)
class PlannedUnit:
    """A flat unit as lesson 06_zero_muon reads its layout: its parameters' names and shapes (as
    one tp rank holds them) and how lesson 06 cuts it."""

    names: tuple
    shapes: tuple
    shard_numel: int
    padded_numel: int


class PlannedExchange(zero_muon.MatrixExchange):
    """Lesson 06_zero_muon's exchange over one group of a planned layout, from its units' shapes
    alone (the matrices, what each rank holds of them, their owners; nothing held, so no `mine`),
    as the rank at `rank` of the group, which the meter calls `name`, sees it."""

    def __init__(self, units: list[PlannedUnit], n: int, rank: int, name: str):
        self.group, self.n, self.rank = comm.AxisGroup(None, name), n, rank
        self.replicated = all(unit.shard_numel == unit.padded_numel for unit in units)
        self.matrices = zero_muon.balanced_owners([matrix for _, _, matrix in zero_muon.hidden_matrices(units, n)],
                                                  n)


def planned_exchanges(cfg, args, grid: GridShape, ep: int, pp_rank: int) -> list[PlannedExchange]:
    """Stage `pp_rank`'s exchanges as the first rank of its dp x cp group sees them: its dense units'
    matrices over dp x cp, its experts' over edp (at_place moves them to another rank)."""
    return stage_exchanges(cfg, grid, ep, pp_rank, args.virtual_stages, args.zero_stage)


@lru_cache(maxsize=None)
def stage_exchanges(cfg, grid: GridShape, ep: int, pp_rank: int, virtual_stages: int, zero_stage: int) -> tuple:
    # once per layout and stage: the plan asks for every candidate's recompute modes and tp options
    exchanges = []
    for experts, size, name in ((False, grid.dp * grid.cp, "dp_cp"), (True, grid.dp * grid.cp // ep, "edp")):
        shards = 1 if zero_stage == 0 else size
        units = [PlannedUnit(tuple(name for name, _ in unit), tuple(torch.Size(shape) for _, shape in unit),
                             zero.padded(sum(math.prod(shape) for _, shape in unit), shards) // shards,
                             zero.padded(sum(math.prod(shape) for _, shape in unit), shards))
                 for unit in unit_parameter_layouts(cfg, grid.tp, grid.pp, pp_rank, ep, experts, virtual_stages)
                 if unit]
        if units:
            exchanges.append(PlannedExchange(units, size, 0, name))
    return tuple(exchanges)


def at_place(exchanges: list[PlannedExchange], ep: int, place: int) -> list[PlannedExchange]:
    """The exchanges as the rank at `place` of its dp x cp group sees them: the dense one at that
    rank, the experts' at place // ep (a dp x cp group's ep groups are runs of ep ranks, so its edp
    groups take every ep-th: lesson 05's ProcessGrid)."""
    moved = []
    for exchange in exchanges:
        exchange = copy.copy(exchange)
        exchange.rank = place if exchange.group.name == "dp_cp" else place // ep
        moved.append(exchange)
    return moved


def planned_muon_traffic(cfg, args, grid: GridShape, ep: int, pp_rank: int, place: int) -> dict:
    """Under Muon, the payload bytes per step of the rank at `place` of its dp x cp group of stage
    `pp_rank`: 06_zero_muon's two all-to-alls over each group (predicted_muon_traffic), and
    lesson 07's join over tp of each matrix it owns (every one is split when tp > 1), the whole
    matrix gathered in bf16: what 07_report predicts from a built model, from the flags alone."""
    exchanges = at_place(planned_exchanges(cfg, args, grid, ep, pp_rank), ep, place)
    joined = sum(2 * grid.tp * matrix.numel for exchange in exchanges for _, matrix in exchange.owned(exchange.rank))
    return add_traffic(zero_muon.predicted_muon_traffic(exchanges),
                       {("all_gather_single", "tp"): joined} if grid.tp > 1 and joined else {})


def optimizer_states_row(args) -> str:
    """The memory row of the optimizer's states: AdamW's two moments, or Muon's one momentum for its
    matrices beside AdamW's two for the rest."""
    return "Adam states (fp32)" if args.optimizer == "adamw" else "Muon momentum, Adam states (fp32)"


WHOLE_GRADIENTS = "gradients, whole in the step"     # ZeRO-2/3 under a pipeline
ALLOCATOR_RESERVE_ROW = "allocator's reserve (estimated)"  # CUDA's caching allocator, beyond the peak


def planned_memory(cfg, args, grid: GridShape, ep: int, shape, precision, pp_rank: int,
                   device: DeviceProfile, place: int | None = None) -> tuple[dict, int]:
    """Pipeline stage `pp_rank`'s bytes per rank by component (every rank of a stage holds the
    same, but under Muon its optimizer states: those of the rank at `place` of its dp x cp group,
    by default the fullest), and the micro-batches live at the activations' peak. Model
    states: lesson 06's formula on its unit counts (experts over edp); gathered weights: ZeRO-3's
    prefetch window (06); under a pipeline ZeRO-2/3's gradients, whole from each unit's first
    gradient of the step to its reduction (lesson 07's PipelinedZeroStage2/3), a row of their own;
    on a GPU the caching allocator's reserve beyond all these (the device profile's share of what a
    step allocates and frees: every row but the model states)."""
    units = zero_units(cfg, args, grid, ep, pp_rank, place)
    offload = "optimizer" in args.offload
    states = units.placement(args.zero_stage, precision)[0] if offload else units.model_states(args.zero_stage, precision)
    gathered = (units.gathered_peak(precision, args.reshard_after_forward, args.prefetch)
                if args.zero_stage == 3 else 0)
    activations, live = planned_activation_bytes(cfg, args, grid, ep, shape, precision, pp_rank, device)
    whole = units.whole_gradients(args.zero_stage, precision)
    memory = {"parameters": states.parameters, "gradients": states.gradients,
              **({} if offload else {"master weights (fp32)": states.master_weights,
                                     optimizer_states_row(args): states.optimizer_states}),
              "activations": activations,
              "loss's backward (chunked)": sum(planned_loss_parts(cfg, args, grid, shape, precision, pp_rank,
                                                                  device).values()),
              "gathered weights (ZeRO-3)": gathered,
              **({WHOLE_GRADIENTS: whole} if whole else {}),
              "communication buffers (estimated)": planned_buffer_bytes(
                  cfg, args, grid, shape, precision, [count for count in units.dense + units.experts if count])}
    if "activations" in args.offload:
        memory["offloaded block in flight (estimated)"] = planned_offload(cfg, args, grid, ep, shape, precision,
                                                                          pp_rank, device).one_block
    if device.allocator_reserve:
        # what a step allocates and frees again leaves freed blocks the caching allocator keeps but
        # cannot always reuse (published_profiles)
        memory[ALLOCATOR_RESERVE_ROW] = round(device.allocator_reserve * transient_bytes(memory, args))
    return memory, live


def transient_bytes(memory: dict, args) -> int:
    """The rows of planned_memory's `memory` that a step allocates and frees again: all but the model
    states (allocated once) and the allocator's reserve (a share of these)."""
    steady = {"parameters", "gradients", "master weights (fp32)", optimizer_states_row(args), ALLOCATOR_RESERVE_ROW}
    return sum(size for name, size in memory.items() if name not in steady)


def planned_host_memory(cfg, args, grid: GridShape, ep: int, precision, pp_rank: int) -> dict:
    """Under --offload optimizer, stage `pp_rank`'s host bytes per rank by component
    (06_zero_offload's formula on its units: the master, Adam's moments, the pinned staging of the
    gradient shard and of the weights' shard), and the float32 copy of bf16 gradients that the
    host step makes while it runs; without offload, none."""
    if "optimizer" not in args.offload:
        return {}
    host = zero_units(cfg, args, grid, ep, pp_rank).placement(args.zero_stage, precision)[1]
    g = precision.reduce_dtype.itemsize
    return {"master weights (fp32)": host.master_weights, "Adam states (fp32)": host.optimizer_states,
            "gradient shard (pinned staging)": host.gradients, "weights' shard (pinned staging)": host.parameters,
            "gradients as fp32 (during the step)": host.gradients * 4 // g if g != 4 else 0}


def planned_activations_on_host(cfg, args, grid: GridShape, ep: int, shape, precision, device) -> dict:
    """Under --offload activations the offloaded blocks' bytes in host memory at their peak, on the stage
    that holds most there (1F1B's first: the most micro-batches live); without it, none."""
    if "activations" not in args.offload:
        return {}
    return {"activations (offloaded; the fullest stage)": max(
        planned_offload(cfg, args, grid, ep, shape, precision, rank, device).host_peak for rank in range(grid.pp))}


# ============================================================================ the technique: the step-time estimate
# A layout's step on its slowest pipeline stage, operation by operation, each priced from the
# device's profile by picotron_like.step_costs (GEMMs by their shape, attention by its kernel,
# elementwise passes by bytes, collectives by latency and bus bandwidth on their group's link),
# then overlapped only where the code overlaps: see plan_assumptions, printed with the plan.

# Elementwise traffic per element (elements read and written, in the weights' dtype, and launched
# kernels) of one block's forward, eager and under --compile (Inductor fuses each chain into one
# kernel that reads its inputs once and writes its outputs once); the backward moves twice that.
ELEMENTWISE_PASSES = {
    # part:     (eager,  compiled)
    "norm":     ((4, 5), (1, 1)),    # RMSNorm: x read, statistics, y written; compiled: fused with the residual add
    "residual": ((3, 1), (3, 0)),    # x + f(x): two read, one written
    "rotary":   ((4, 6), (2, 1)),    # q and k: read, rotated halves, written back
    "swiglu":   ((5, 2), (3, 1)),    # silu(gate) read and written, times up: two read, one written
}
# The chunked loss, per logit: the float32 logits written and read for the maximum and the sum of
# exponentials (forward), and again for softmax minus the target (backward), its gradient in e.
LOSS_FLOAT32_PASSES = (3, 4)
# Compiled (loss.LossSettings), per logit in e: read for the maximum and again for the sum
# (forward); read, and the gradient written over it (backward); one kernel each.
LOSS_COMPILED_PASSES = (2, 2)
# The step's tail per parameter of this rank's shard, float32, as a GPU runs it (--step-tail's
# fused path): the gradient norm's one read (_foreach_norm); fused AdamW reading parameter,
# gradient and two moments and writing all four (the gradient divided by the clipping's
# grad_scale); the weights' cast back (4 read, e written).
OPTIMIZER_BYTES = 4 + 8 * 4 + 4
# The same tail on the host (--offload optimizer), per element of the shard, in float32: the
# norm's read of the gradient, fused AdamW reading and writing parameter, gradient and two moments
# (the casts of bf16 weights and gradients are offload_seconds').
HOST_OPTIMIZER_BYTES = 4 + 8 * 4
OPTIMIZER_KERNELS_PER_UNIT = 12  # foreach AdamW over one unit's pieces, the norm, the cast
# A micro-batch's gradients into their unit's buffer at ZeRO-0/1: the step's first written (read,
# written), each later one added (gradient and buffer read, buffer written); at ZeRO-2/3 each one
# flattened into a copy to reduce-scatter (read, written).
FIRST_ACCUMULATE_BYTES = 2 * 4
ACCUMULATE_BYTES = 3 * 4


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@lru_cache(maxsize=None)
def group_of(grid: GridShape, axes: tuple, rank: int) -> list[int]:
    """The global ranks of `rank`'s group along `axes` (("ep", ep) and ("edp", ep): the grid's
    expert groups), whose placement on nodes prices its collectives."""
    groups = {"ep": grid.ep_group_ranks, "edp": grid.edp_group_ranks}
    all_groups = groups[axes[0]](axes[1]) if axes[0] in groups else grid.group_ranks(axes)
    return next(members for members in all_groups if rank in members)


def hidden_behind(comm: float, compute: float, overlap: float) -> float:
    """What a collective adds to a step when it runs beside `compute` seconds of work: its part
    beyond that work, and of the part beside it, the share contention does not hide."""
    return max(0.0, comm - compute) + (1 - overlap) * min(comm, compute)


def block_gemms(cfg, tokens: int, tp: int, ep: int) -> list[tuple[int, int, int]]:
    """One block's forward matmuls on a tp rank, (M, N, K) for (M x K) @ (K x N): the
    projections of the whole sequence (sequence parallelism gathers it first), the MLP's, or the
    experts' (balanced routing: each of this rank's E / ep experts receives k T ep / E rows) and
    the shared expert's."""
    h, d = cfg.hidden, cfg.head_dim
    gemms = [(tokens, cfg.n_heads * d // tp, h), (tokens, cfg.n_kv_heads * d // tp, h),
             (tokens, cfg.n_kv_heads * d // tp, h), (tokens, h, cfg.n_heads * d // tp)]
    if not cfg.n_experts:
        return gemms + [(tokens, cfg.ffn_hidden // tp, h)] * 2 + [(tokens, h, cfg.ffn_hidden // tp)]
    rows = max(1, cfg.experts_per_token * tokens * ep // cfg.n_experts)
    experts = ([(rows, cfg.ffn_hidden // tp, h)] * 2 + [(rows, h, cfg.ffn_hidden // tp)]) * (cfg.n_experts // ep)
    shared = cfg.n_shared_experts * cfg.ffn_hidden // tp
    return gemms + [(tokens, cfg.n_experts, h)] + experts + ([(tokens, shared, h)] * 2 + [(tokens, h, shared)]) * (
        shared > 0)


def block_gemm_groups(cfg, n_gemms: int) -> list[str | None]:
    """07_fp8's group (07_fp8.GROUPS) of each of block_gemms' matmuls; None for those --fp8 never
    converts (the router, the routed experts)."""
    attention, mlp = ["qkv"] * 3 + ["o"], ["gate_up", "gate_up", "down"]
    if not cfg.n_experts:
        return attention + mlp
    shared = mlp if cfg.n_shared_experts else []
    return attention + [None] * (n_gemms - len(attention) - len(shared)) + shared


def gemm_pass_seconds(device, gemms, dtype: str) -> tuple[float, float]:
    """(forward, backward) of these matmuls: the backward's input gradient (M x N) @ (N x K) and
    weight gradient (K x M) @ (M x N), each priced by its own shape."""
    forward = sum(step_costs.gemm_seconds(device, m, n, k, dtype) for m, n, k in gemms)
    backward = sum(step_costs.gemm_seconds(device, m, k, n, dtype) + step_costs.gemm_seconds(device, k, n, m, dtype)
                   for m, n, k in gemms)
    return forward, backward


def attention_pass_seconds(cfg, device, micro: int, seq_len: int, tp: int, cp: int, cp_mode: str,
                           dtype: str) -> tuple[float, float]:
    """(forward, backward) of one block's attention kernels on a rank. Ring (zigzag): cp kernels
    of the rank's s / cp queries, one causal against its own keys, cp - 1 against half of another
    rank's block; Ulysses: one causal kernel of the whole sequence over heads / cp."""
    heads = micro * cfg.n_heads // tp
    if cp > 1 and cp_mode == "ulysses":
        kernels = [(heads // cp, seq_len, seq_len, True)]
    else:
        block = seq_len // cp
        kernels = [(heads, block, block, True)] + [(heads, block, block // 2, False)] * (cp - 1)
    return tuple(sum(step_costs.attention_seconds(device, bh, q, kv, cfg.head_dim, causal, dtype, backward)
                     for bh, q, kv, causal in kernels) for backward in (False, True))


def block_elementwise(cfg, tokens: int, tp: int, sequence_parallel: bool, e: int, compiled: bool) -> \
        tuple[float, int]:
    """(bytes, kernels) of one block's forward elementwise passes: two norms and two residual adds
    over the rank's tokens (a tp shard of them under sequence parallelism), rotary on q and k,
    SwiGLU's product over the rank's MLP width."""
    local = tokens // tp if sequence_parallel else tokens
    width = (cfg.experts_per_token * cfg.ffn_hidden + cfg.n_shared_experts * cfg.ffn_hidden
             if cfg.n_experts else cfg.ffn_hidden) // tp
    counts = {"norm": 2 * local * cfg.hidden, "residual": 2 * local * cfg.hidden,
              "rotary": tokens * (cfg.n_heads + cfg.n_kv_heads) * cfg.head_dim // tp, "swiglu": tokens * width}
    passes = {part: ELEMENTWISE_PASSES[part][compiled] for part in counts}
    return (sum(count * passes[part][0] * e for part, count in counts.items()),
            sum(kernels * (2 if part in ("norm", "residual") else 1) for part, (_, kernels) in passes.items()))


class MicroBatchSeconds(NamedTuple):
    """One micro-batch through one pipeline stage, by part: what the per-step sums add up."""
    forward: float              # GEMMs and attention
    backward: float
    elementwise: float          # forward and backward
    recompute: float
    tp: float                   # tp's collectives, on the critical path
    cp: float                   # cp's exposed rest
    ep: float                   # the experts' all-to-alls
    pp: float                   # the boundary's sends and receives

    @property
    def total(self) -> float:
        return sum(self)


def micro_batch_seconds(cfg, args, grid: GridShape, ep: int, shape, precision, device, pp_rank: int) -> \
        MicroBatchSeconds:
    """One micro-batch's work on pipeline rank `pp_rank` (its v chunks when interleaved)."""
    micro, seq, tp, cp = shape.micro_batch_size, shape.seq_len, grid.tp, grid.cp
    tokens, e, dtype = micro * seq // cp, precision.param_dtype.itemsize, dtype_name(precision.param_dtype)
    chunks = stage_outline(cfg, grid.pp, pp_rank, args.virtual_stages)
    layers = sum(len(chunk.layer_ids) for chunk in chunks)
    with_embedding, with_head = any(chunk.tok_embeddings is not None for chunk in chunks), \
        any(chunk.lm_head is not None for chunk in chunks)
    fp8_rate = (args.fp8 != "none" and device.capability is not None
                and fp8.runs_on_fp8_tensor_cores(args.fp8, device.capability) and "float8" in device.gemm)
    # --fp8: the groups of linears it converts (on a GPU those the shape rule keeps: 07_fp8.groups_in_fp8) at
    # the float8 rate; the router, the routed experts and the groups kept in bf16 at the compute dtype's
    in_fp8 = fp8.fp8_groups_of_run(cfg, args, tokens, tp, device.capability is not None)
    gemms = block_gemms(cfg, tokens, tp, ep)
    at_fp8 = [fp8_rate and group is not None and in_fp8[group] for group in block_gemm_groups(cfg, len(gemms))]
    gemm_f, gemm_b = (a + b for a, b in zip(
        gemm_pass_seconds(device, [g for g, fast in zip(gemms, at_fp8) if fast], "float8"),
        gemm_pass_seconds(device, [g for g, fast in zip(gemms, at_fp8) if not fast], dtype)))
    attn_f, attn_b = attention_pass_seconds(cfg, device, micro, seq, tp, cp, args.cp_mode, dtype)
    elem_bytes, elem_kernels = block_elementwise(cfg, tokens, tp, args.sequence_parallel, e, args.compile)
    elem_f = step_costs.memory_seconds(device, elem_bytes, elem_kernels)
    forward, backward, elementwise = layers * (gemm_f + attn_f), layers * (gemm_b + attn_b), 3 * layers * elem_f
    if fp8_rate:
        elementwise += layers * fp8_quantisation_seconds(cfg, args, tokens, tp, e, in_fp8, device)
    recompute = {"none": 0.0, "selective": layers * elem_f * 2 / 3,     # the norms' and silu's share, again
                 "full": layers * (gemm_f + attn_f + elem_f)}[args.recompute]
    if with_head:       # the chunked loss: each chunk's logits in forward, again in backward, then dx and dW
        words = cfg.vocab_size // tp
        chunk = min(tokens, loss_chunk_tokens(words, device.device_type))
        n_chunks = -(-tokens // chunk)
        head_f, head_b = gemm_pass_seconds(device, [(chunk, words, cfg.hidden)], dtype)
        forward += n_chunks * head_f
        backward += n_chunks * (head_f + head_b)
        logits = chunk * words
        elementwise += n_chunks * (
            step_costs.memory_seconds(device, logits * sum(LOSS_COMPILED_PASSES) * e, 2) if args.compile else
            step_costs.memory_seconds(device, logits * (sum(LOSS_FLOAT32_PASSES) * 4 + 2 * e), 12))
    if with_embedding:  # a gather forward, a scatter-add of the rows' gradients backward
        elementwise += step_costs.memory_seconds(device, 4 * tokens * cfg.hidden * e, 3)

    def collective(kind: str, payload: float, axes: tuple[str, ...], calls: int) -> float:
        ranks = group_of(grid, axes, grid.rank_of(pp=pp_rank))
        return step_costs.collective_seconds(device, kind, payload, ranks, calls)

    names = {"all_reduce": "all_reduce", "all_gather_single": "all_gather", "reduce_scatter_single": "reduce_scatter",
             "all_to_all_single": "all_to_all", "isend": "p2p"}
    tp_seconds = 0.0
    if tp > 1:          # lesson 02's bytes; calls: 4 per block and the embedding's and head's, and the norms'
        # Lesson 02 counts a float32 residual stream (autocast); with weights of e bytes the stream,
        # and so every message, is e bytes (07_report.predicted_inner_traffic says the same).
        residual_share = e / 4
        traffic = add_traffic({key: value * residual_share for key, value in add_traffic(*(
            tensor_parallel.predicted_tp_traffic(cfg, micro, seq // cp, 1, tp, args.sequence_parallel, torch.float32,
                                                 save_sequence_shard=True, stage=chunk) for chunk in chunks)).items()},
                              fp8_traffic_on(cfg, args, shape, grid, layers, "tp", device.capability is not None))
        messages = 4 * layers + with_embedding + with_head
        calls = ({"all_gather_single": messages + 2 * layers + with_head, "reduce_scatter_single": messages,
                  "all_reduce": 3 * with_head + 1} if args.sequence_parallel
                 else {"all_reduce": messages + 3 * with_head})
        if args.recompute == "full":    # the blocks' forward collectives again (07's recompute traffic)
            traffic = add_traffic(traffic, {key: value / shape.grad_accum for key, value in
                                            measurement.predicted_recompute_traffic(
                                                cfg, shape, LaidOutGrid(grid, ep, grid.rank_of(pp=pp_rank)), layers,
                                                "full", args.cp_mode, args.sequence_parallel, e).items()
                                            if key[1] == "tp"})
        tp_seconds = sum(collective(names[kind], payload, ("tp",), calls.get(kind, 2 * layers))
                         for (kind, _), payload in traffic.items())
        if args.async_tp_dgrad and args.schedule != "zero-bubble":
            # lesson 02's async dgrad: each norm's backward collective (f: an all-reduce, a
            # reduce-scatter under sequence parallelism) travels while its column layers make their
            # weight gradients (attention's Q, K, V; the MLP's gate and up; experts leave none to overlap)
            one_f = collective("reduce_scatter" if args.sequence_parallel else "all_reduce",
                               tokens * cfg.hidden * e, ("tp",), 1)
            # (07_fp8's layers make their weight gradients in their own backward and leave none: no overlap there)
            for group, columns in [("qkv", gemms[0:3])] + ([("gate_up", gemms[4:6])] if not cfg.n_experts else []):
                if in_fp8[group]:
                    continue
                wgrad = sum(step_costs.gemm_seconds(device, k, n, m, dtype) for m, n, k in columns)
                tp_seconds -= layers * (one_f - hidden_behind(one_f, wgrad, device.overlap))
    cp_seconds = 0.0
    if cp > 1:
        kv_block = 2 * tokens * cfg.n_kv_heads // tp * cfg.head_dim * e
        if args.cp_mode == "ring":      # each K/V block's send hides behind the attention of the block before
            send = collective("p2p", kv_block, ("cp",), 1)
            block_f, block_b = attn_f / cp, attn_b / cp
            cp_seconds = layers * (cp - 1) * (hidden_behind(send, block_f, device.overlap)
                                           + hidden_behind(2 * send, block_b, device.overlap))
        else:
            traffic = context_parallel.predicted_cp_traffic(measurement.attention_of_one_rank(cfg, tp, layers), micro,
                                                            seq, cp, "ulysses", 1, e)
            cp_seconds = sum(collective(names[kind], payload, ("cp",), 8 * layers)
                             for (kind, _), payload in traffic.items() if kind in names)
        amaxes = fp8_traffic_on(cfg, args, shape, grid, layers, "cp", device.capability is not None)
        cp_seconds += sum(collective("all_reduce", payload, ("cp",), layers) for payload in amaxes.values())
    ep_seconds = 0.0
    if cfg.n_experts and ep > 1:        # lesson 05's 2 (m + r) h e per MoE forward, m = r = k T (balanced)
        routed = cfg.experts_per_token * tokens
        ranks = group_of(grid, ("ep", ep), grid.rank_of(pp=pp_rank))
        ep_seconds = step_costs.collective_seconds(device, "all_to_all", layers * 4 * routed * cfg.hidden * e, ranks,
                                                   4 * layers)
    pp_seconds = 0.0
    if grid.pp > 1:     # lesson 03's transfers: a stage waits for what it receives, and for its sends
        boundary = tokens // (tp if args.sequence_parallel else 1) * cfg.hidden
        sent = pipeline_parallel.predicted_p2p_bytes(1, (boundary,), e, grid.pp, pp_rank, args.virtual_stages)
        messages = sent // (boundary * e)
        transfer = collective("p2p", sent, ("pp",), messages)      # as many received as sent
        # Sends left in flight (lesson 03's default) cost only contention's share of their time. On
        # NCCL one request covers a batch's sends and receives, and 1F1B's batches mostly receive
        # too: there the sends are priced as waited for.
        in_flight = args.async_pp_sends and device.device_type != "cuda"
        pp_seconds = transfer * (1 + (1 - device.overlap if in_flight else 1))
    return MicroBatchSeconds(forward, backward, elementwise, recompute, tp_seconds, cp_seconds, ep_seconds, pp_seconds)


def fp8_quantisation_seconds(cfg, args, tokens: int, tp: int, e: int, in_fp8: dict, device) -> float:
    """One block's FP8 quantisations, forward and backward, for the groups in FP8 (07_fp8: a group's
    input quantised once for its layers): X and W forward; dY twice (both layouts), W and X again
    backward. Eager, a chain of kernels whose full passes move about abs 2e + amax e + divide e + 4
    + clamp 8 + cast 5 bytes per element (and 12 more for a bf16 input's two float32 casts), 10
    kernels (12); compiled (--compile, --fp8-fused-quantise), the amax and the cast: 2e + 1 bytes
    in 2 kernels."""
    compiled = args.compile and args.fp8_fused_quantise
    per_element = 2 * e + 1 if compiled else 4 * e + 17 + (12 if e == 2 else 0)
    kernels = 2 if compiled else (12 if e == 2 else 10)
    seconds = 0.0
    for group, (rows, inputs, outputs) in fp8.group_gemm_shapes(cfg, tokens, tp).items():
        if in_fp8.get(group):
            for elements in (rows * inputs, outputs * inputs, rows * outputs, rows * outputs, outputs * inputs,
                             rows * inputs):
                seconds += step_costs.memory_seconds(device, elements * per_element, kernels)
    return seconds


def fp8_traffic_on(cfg, args, shape, grid: GridShape, layers: int, axis: str, on_gpu: bool) -> dict:
    """--fp8's amax all-reduces (and sequence parallelism's FP8 gathers) of one micro-batch on `axis`
    (07_fp8.py), for the groups it converts on a GPU (`on_gpu`: its shape rule) or a CPU."""
    tokens = shape.micro_batch_size * shape.seq_len // grid.cp
    traffic = fp8.predicted_fp8_traffic(cfg, args.fp8, tokens, grid.tp, 1, layers, args.recompute,
                                        args.sequence_parallel, grid.cp,
                                        fp8.fp8_groups_of_run(cfg, args, tokens, grid.tp, on_gpu))
    return {key: value for key, value in traffic.items() if key[1] == axis}


def zero_timeline(compute: list[float], gathers: list[float], reduces: list[float]) -> tuple[float, float]:
    """One pass over the units on one communication stream, in the order the code issues it: a
    unit's gather is started when the unit before it starts (ZeRO-3's prefetch; the first one at
    once), its reduction when its own compute ends. Returns (the compute's waits for gathers,
    the reductions' tail after the last unit's compute)."""
    clock = stream = 0.0
    ready = [0.0] * len(compute)
    if compute:
        stream = ready[0] = gathers[0]
    for i, seconds in enumerate(compute):
        clock = max(clock, ready[i])
        if i + 1 < len(compute):
            stream = ready[i + 1] = max(stream, clock) + gathers[i + 1]
        clock += seconds
        stream = max(stream, clock) + reduces[i]
    return clock - sum(compute), max(0.0, stream - clock)


def gathers_before_forward(forward: list[float], gathers: list[float]) -> float:
    """ZeRO-1/2's overlapped weight gathers: all started at the step's end, one after another on
    the stream; each unit's forward of the next step waits for its own. Returns the forward's waits
    (the first unit's whole gather at least: nothing computes before it)."""
    clock = ready = 0.0
    for seconds, gather in zip(forward, gathers):
        ready += gather
        clock = max(clock, ready) + seconds
    return clock - sum(forward)


def zero_seconds(cfg, args, grid: GridShape, ep: int, precision, device, pp_rank: int,
                 micro: MicroBatchSeconds, m: int) -> tuple[float, float]:
    """(exposed communication, optimizer tail) of lesson 06 over dp x cp (experts over edp) on
    stage `pp_rank`, unit by unit on the group's link. Reductions start as each unit's backward
    ends (stages 0-1 in the last micro-batch only, 2-3 in every one, whose tail the next
    micro-batch's forward hides; under a pipeline 2-3 in the last only); ZeRO-3 gathers each unit
    behind the unit before it, forward and (resharded) backward (under a pipeline kept gathered:
    before the first forward only); stages 1-2 gather the weights after the step, behind the next
    step's first forward (or with --no-overlap-weight-gather waiting for them)."""
    units = zero_units(cfg, args, grid, ep, pp_rank)
    rank = grid.rank_of(pp=pp_rank)
    dense_ranks = group_of(grid, ("dp", "cp"), rank)
    expert_ranks = group_of(grid, ("edp", ep), rank)
    p, g = precision.param_dtype.itemsize, precision.reduce_dtype.itemsize
    stage = args.zero_stage

    def unit_seconds(kind: str, element_bytes: int) -> list[float]:
        return [step_costs.collective_seconds(device, kind, dense * element_bytes, dense_ranks)
                + step_costs.collective_seconds(device, kind, experts * element_bytes, expert_ranks)
                for dense, experts in zip(units.dense, units.experts)]

    reduces = unit_seconds("all_reduce" if stage == 0 else "reduce_scatter", g)
    gathers = unit_seconds("all_gather", p)
    # compute shares by the units' matmul weights (the embedding's backward is a scatter: none)
    weights = [0 if (i == 0 and pp_rank == 0) else dense + experts
               for i, (dense, experts) in enumerate(zip(units.dense, units.experts))]
    share = [w / sum(weights) for w in weights]
    forward = [micro.forward * s for s in share]
    backward = [(micro.backward + micro.recompute) * s for s in share][::-1]
    none = [0.0] * len(share)
    # under a pipeline, ZeRO-2/3 reduce once per step (lesson 07's PipelinedZeroStage2/3), and ZeRO-3 kept
    # gathered gathers each unit once, before the step's first forward
    reduced_every_micro_batch = stage >= 2 and grid.pp == 1
    forward_gathers = (1 if grid.pp > 1 and not args.reshard_after_forward else m) if stage == 3 else 0
    backward_gathers = m if stage == 3 and args.reshard_after_forward else 0
    exposed = 0.0
    if stage == 3:
        waits, _ = zero_timeline(forward, gathers, none)
        exposed += forward_gathers * waits
    back_gathers = gathers[::-1] if backward_gathers else none
    waits, tail = zero_timeline(backward, back_gathers, reduces[::-1])
    if reduced_every_micro_batch:   # every micro-batch reduces; all but the last hide their tail behind the next forward
        exposed += (m - 1) * (waits + hidden_behind(tail, micro.forward, 1.0))
    elif backward_gathers:          # under a pipeline every backward gathers, the last one reduces
        exposed += (m - 1) * zero_timeline(backward, back_gathers, none)[0]
    exposed += waits + tail
    communication = (sum(reduces) * (m if reduced_every_micro_batch else 1)
                     + sum(gathers) * (forward_gathers + backward_gathers))
    if stage in (1, 2) and args.overlap_weight_gather:
        exposed += gathers_before_forward(forward, gathers)
        communication += sum(gathers)
    # of the part the timeline hides behind compute, contention still adds (1 - overlap)
    exposed += (1 - device.overlap) * max(0.0, communication - exposed)
    if stage in (1, 2) and not args.overlap_weight_gather:
        exposed += sum(gathers)
    # the loss's and the gradient norm's small all-reduces over the whole grid's data ranks
    exposed += 2 * step_costs.collective_seconds(device, "all_reduce", 8, dense_ranks)
    shard = sum(zero.padded(dense, units.n) // (units.n if stage else 1)
                + zero.padded(experts, units.edp) // (units.edp if stage else 1)
                for dense, experts in zip(units.dense, units.experts))
    local = sum(units.dense) + sum(units.experts)
    later = FIRST_ACCUMULATE_BYTES if reduced_every_micro_batch else ACCUMULATE_BYTES
    offloaded = "optimizer" in args.offload and device.host_link_bandwidth > 0
    optimizer = (sum(offload_seconds(units, args, precision, device, micro).values()) if offloaded else
                 step_costs.memory_seconds(device, shard * OPTIMIZER_BYTES, OPTIMIZER_KERNELS_PER_UNIT * len(share)))
    tail = (optimizer
            + step_costs.memory_seconds(device, local * FIRST_ACCUMULATE_BYTES, len(share))
            + (m - 1) * step_costs.memory_seconds(device, local * later, 3 * len(share)))
    return exposed, tail


def offload_seconds(units, args, precision, device, micro: MicroBatchSeconds) -> dict:
    """--offload optimizer on a device with a host link, what the step adds for it (in place of
    the device's optimizer tail): the host step, AdamW's bytes per element of the shard
    (HOST_OPTIMIZER_BYTES, and the casts of bf16 gradients and weights) over the node's host
    memory bandwidth, which the node's ranks share, stepping at once; the gradient shards' copies
    to the host, behind the last micro-batch's backward but for what it cannot hide and the last
    unit's copy, which follows the last reduction; the weights' shards back, before the gathers
    (ZeRO-1/2) or the next forward (ZeRO-3, ZeRO-0) can start: nothing overlaps them."""
    stage, p, g = args.zero_stage, precision.param_dtype.itemsize, precision.reduce_dtype.itemsize
    shards = [zero.padded(dense, units.n) // (units.n if stage else 1)
              + zero.padded(experts, units.edp) // (units.edp if stage else 1)
              for dense, experts in zip(units.dense, units.experts)]
    per_element = HOST_OPTIMIZER_BYTES + (4 + p if p != 4 else 0) + (g + 4 if g != 4 else 0)
    ranks = ranks_on_a_node(args, device)
    down = g * sum(shards) / device.host_link_bandwidth
    last_unit = g * shards[0] / device.host_link_bandwidth
    return {"host step": per_element * sum(shards) * ranks / device.host_memory_bandwidth,
            "to host": max(last_unit, down - micro.backward - micro.recompute),
            "to device": p * sum(shards) / device.host_link_bandwidth}


def ranks_on_a_node(args, device) -> int:
    """The ranks that share one host: a node's, or all of them on fewer GPUs than a node."""
    return min(args.gpus, device.ranks_per_node)


# tp's row-parallel matrices (lesson 02 splits their columns); every other hidden matrix is column-parallel
ROW_PARALLEL = ("o_proj", "down_proj")


def newton_schulz_seconds(device, shape: tuple[int, int]) -> float:
    """06_zero_muon's Newton-Schulz of one whole matrix: per iteration, for m x n with m <= n, the
    GEMMs X X^T (m x n by n x m), A A (m x m) and (b A + c A^2) X (m x m by m x n), in bf16 at the
    profile's rate for each shape (the addmm's additions ride along)."""
    m, n = sorted(shape)
    return zero_muon.NS_STEPS * sum(step_costs.gemm_seconds(device, *gemm, "bfloat16")
                                    for gemm in ((m, m, n), (m, m, m), (m, n, m)))


def muon_seconds(cfg, args, grid: GridShape, ep: int, device, pp_rank: int) -> dict:
    """Under Muon, what its step adds on stage `pp_rank`, by the step-time table's part, none of
    it overlapped (the step waits for each): per group (dense over dp x cp, then experts over edp),
    the two all-to-alls of the rank that sends most ("dp"), and the busiest owner's Newton-Schulz
    on its whole matrices ("compute") and joins over tp ("tp": each owned matrix all-gathered whole
    in bf16)."""
    seconds = {"compute": 0.0, "tp": 0.0, "dp": 0.0}
    if args.optimizer != "muon":
        return seconds
    rank = grid.rank_of(pp=pp_rank)
    for exchange in planned_exchanges(cfg, args, grid, ep, pp_rank):
        most_sent, owned_shapes = exchange_work(exchange, grid.tp)
        ns = {shape: newton_schulz_seconds(device, shape) for shape in set().union(*owned_shapes)}
        work = [sum(count * ns[shape] for shape, count in shapes.items()) for shapes in owned_shapes]
        busiest = max(range(exchange.n), key=lambda owner: work[owner])
        ranks = group_of(grid, ("dp", "cp") if exchange.group.name == "dp_cp" else ("edp", ep), rank)
        seconds["dp"] += step_costs.collective_seconds(device, "all_to_all", most_sent, ranks, 2)
        seconds["compute"] += work[busiest]
        if grid.tp > 1:
            joined = sum(2 * math.prod(shape) * count for shape, count in owned_shapes[busiest].items())
            seconds["tp"] += step_costs.collective_seconds(device, "all_gather", joined, group_of(grid, ("tp",), rank),
                                                           sum(owned_shapes[busiest].values()))
    return seconds


@lru_cache(maxsize=None)
def exchange_work(exchange: PlannedExchange, tp: int) -> tuple[int, list[Counter]]:
    """(the most bytes a rank of the group sends in Muon's two all-to-alls, each owner's whole
    matrices as {shape: count}): the whole shape undoes lesson 02's split, rows for the
    column-parallel matrices, columns for the row-parallel ones (ROW_PARALLEL)."""
    sent, owned = [0] * exchange.n, [Counter() for _ in range(exchange.n)]
    for matrix in exchange.matrices:
        for other in range(exchange.n):
            sent[other] += 2 * zero_muon.span(exchange.to_owner(matrix, other))
            sent[matrix.owner] += 2 * zero_muon.span(exchange.to_holder(matrix, other))
        split = 1 if any(part in matrix.name for part in ROW_PARALLEL) else 0
        owned[matrix.owner][tuple(size * (tp if dim == split else 1) for dim, size in enumerate(matrix.shape))] += 1
    return max(sent), owned


def estimated_step_seconds(cfg, args, grid: GridShape, ep: int, shape, precision, device, pp_rank: int) -> dict:
    """Step time of pipeline rank `pp_rank` by cause (see plan_assumptions): m micro-batches of
    its work, lesson 03's bubble over that work, the data-parallel communication the step leaves
    exposed, the optimizer's tail (under Muon with its Newton-Schulz and its exchanges)."""
    m = shape.grad_accum
    micro = micro_batch_seconds(cfg, args, grid, ep, shape, precision, device, pp_rank)
    bubble = m * micro.total * pipeline_parallel.bubble_formula(args.schedule, grid.pp, m, args.virtual_stages)
    dp, optimizer = zero_seconds(cfg, args, grid, ep, precision, device, pp_rank, micro, m)
    muon = muon_seconds(cfg, args, grid, ep, device, pp_rank)
    offload = ({"offload": offload_timing(cfg, args, grid, ep, shape, precision, device, pp_rank, micro).exposed}
               if "activations" in args.offload else {})
    return {"compute": m * (micro.forward + micro.backward) + muon["compute"],
            "elementwise": m * micro.elementwise + optimizer, "recompute": m * micro.recompute, "bubble": bubble,
            "tp": m * micro.tp + muon["tp"], "cp ep": m * (micro.cp + micro.ep), "pp": m * micro.pp,
            "dp": dp + muon["dp"], **offload}


class OffloadTiming(NamedTuple):
    """--offload activations on one pipeline rank, per step: its blocks copied (each out and back),
    one block's copy each way, the compute it hides behind (the next block's forward, out; its
    backward, back) and the part of the copies left exposed."""

    blocks_per_step: int
    copy: float
    forward: float
    backward: float
    exposed: float


def offload_timing(cfg, args, grid: GridShape, ep: int, shape, precision, device, pp_rank: int,
                   micro: MicroBatchSeconds) -> OffloadTiming:
    """On a GPU a block's copy out runs on its side stream behind the next block's forward (its GEMMs
    and attention), its copy back behind the next block's backward (recomputation included): what a
    copy takes beyond that, per offloaded block and direction, is exposed (the stage's blocks taken as
    equal, the copy at the host link's bandwidth per direction). Without a host link apart (a CPU,
    whose host memory is the device's) the copies are made at once, each byte read and written at the
    memory bandwidth, all of it exposed."""
    offload = planned_offload(cfg, args, grid, ep, shape, precision, pp_rank, device)
    if not offload.blocks_per_step:
        return OffloadTiming(0, 0.0, 0.0, 0.0, 0.0)
    block_bytes = offload.link_bytes_per_step / offload.blocks_per_step
    chunks = stage_outline(cfg, grid.pp, pp_rank, args.virtual_stages) if grid.pp > 1 else ()
    layers = sum(len(stage.layer_ids) for stage in chunks) if chunks else cfg.n_layers
    forward, backward = micro.forward / layers, (micro.backward + micro.recompute) / layers
    if not device.host_link_bandwidth:
        copy = 2 * block_bytes / device.memory_bandwidth
        return OffloadTiming(offload.blocks_per_step, copy, forward, backward, offload.blocks_per_step * 2 * copy)
    copy = block_bytes / device.host_link_bandwidth
    return OffloadTiming(offload.blocks_per_step, copy, forward, backward,
                         offload.blocks_per_step * (max(0.0, copy - forward) + max(0.0, copy - backward)))


def slowest_stage_seconds(cfg, args, grid: GridShape, ep: int, shape, precision, device) -> dict:
    """The step's parts on its slowest pipeline stage, which every stage waits for."""
    return max((estimated_step_seconds(cfg, args, grid, ep, shape, precision, device, rank)
                for rank in range(grid.pp)), key=lambda parts: sum(parts.values()))


def plan_assumptions(device, recipe: str = "none", optimizer: str = "adamw", offload=()) -> list[str]:
    intra, inter = device.links["intra"]["all_reduce"], device.links["inter"]["all_reduce"]
    offload_line = [f"--offload optimizer: the master and Adam's moments of each rank's shard in host memory, "
                    f"in place of the device's optimizer tail the host step (fused AdamW's {HOST_OPTIMIZER_BYTES} "
                    f"bytes per element and the casts, over {device.host_memory_bandwidth / 1e9:.0f} GB/s of host "
                    f"memory shared by a node's ranks, each on its share of the cores, unoverlapped: the device "
                    f"waits for it) and the copies over "
                    f"the host link ({device.host_link_bandwidth / 1e9:.0f} GB/s per direction and rank): the "
                    f"gradient shards' behind the last micro-batch's backward but the last unit's, the weights' "
                    f"back unoverlapped, before the gathers or the next forward"
                    if device.host_link_bandwidth else
                    "--offload optimizer: the device is the host (no link apart): the step is priced as without"] \
        if "optimizer" in offload else []
    fp8_line = [f"--fp8 {recipe}: the blocks' matmuls at the profile's float8 GEMM rate where they run on FP8 "
                f"tensor cores and the shape rule keeps them in FP8 (07_fp8; the layout line says which stay bf16), "
                f"else at the bf16 rate (emulated); each quantisation (X and W forward, dY twice, W and X "
                f"backward) an elementwise pass, one fused kernel pair under --compile; tp's all-reduces of the "
                f"amaxes counted"] \
        if recipe != "none" else []
    muon_line = ["--optimizer muon: one float32 momentum per element of the blocks' matrices, AdamW's two "
                 "moments for the rest; its step adds, unoverlapped, per group (dense units over dp x cp, experts "
                 "over edp) the busiest owner's Newton-Schulz on its whole matrices (5 iterations of 3 bf16 GEMMs at "
                 "the profile's rates) and joins over tp (all-gathers of the whole matrices in bf16), and the two "
                 "all-to-alls of the rank that sends most (06_zero_muon's owners, from the layout); its elementwise "
                 "passes are counted as AdamW's"] if optimizer == "muon" else []
    activations_line = ["--offload activations: the offloaded blocks' kept bytes off the device (one block in flight "
                        "counted), in host memory per micro-batch live; each block's copy out hidden behind the next "
                        "block's forward, its copy back behind the next block's backward (GEMMs and attention), at "
                        "the host link's bandwidth per direction; the rest of each copy exposed, in the step time (no "
                        "column of its own)"] if "activations" in offload else []
    reserve_line = [f"memory: the caching allocator reserves {device.allocator_reserve:.1%} of the bytes a step "
                    f"allocates and frees (all but the model states) beyond the peak (fitted on the Playbook's "
                    f"measured reserved memory, where runs reserved about 0 to 58% of them; the plan's "
                    f"{PLAN_MARGIN:.0%} margin absorbs part of that spread)"] if device.allocator_reserve else []
    return [f"device: {device.name}, from {device.source}",
            "compute: every GEMM of the layout's split (QKV, out-projection, MLP or experts, the LM head in the loss's "
            "chunks; forward, input and weight gradients) at the profile's measured rate for its shape, attention at "
            "its kernel's (the backward 2.5 x the forward's FLOPs), each operation at least one launch "
            f"({device.kernel_overhead_s * 1e6:.0f} us)",
            *fp8_line,
            *muon_line,
            *offload_line,
            *activations_line,
            f"elementwise: norms, rotary, SwiGLU, residuals, the loss's passes over the logits, the optimizer's tail "
            f"by bytes over {device.memory_bandwidth / 1e12:.2f} TB/s",
            "recompute: full runs the blocks' forward again, selective the norms' and SwiGLU's elementwise share",
            "bubble: lesson 03's (pp - 1) / m of a stage's step ((pp - 1) / (v m) interleaved), stages of equal time",
            f"collectives: latency per algorithm step ({intra[0] * 1e6:.0f} us in a node of {device.ranks_per_node}, "
            f"{inter[0] * 1e6:.0f} us between nodes; ring or tree all-reduce, whichever is cheaper) plus payload x "
            f"the ring's factor over the bus bandwidth ({intra[1] / 1e9:.0f} GB/s in a node; across nodes "
            f"{inter[1] / 1e9:.0f} GB/s per rank of the group on each node, one NIC each; placement by the grid's "
            f"rank order)",
            f"overlap as the code does it: tp's, Ulysses', ep's collectives and pp's receives on the critical path, "
            f"except tp's backward all-reduce (sequence parallel: reduce-scatter) behind its column layers' weight "
            f"gradients (--no-async-tp-dgrad: on it) and, on a CPU's gloo, pp's sends left in flight (on NCCL a "
            f"batch that receives waits for its sends too); ring attention's sends behind one block's attention; "
            f"gradient reductions unit by unit behind the rest of the backward (ZeRO 0-1: the last micro-batch's; "
            f"2-3: every one's, behind the next forward too, but under a pipeline the last one's); ZeRO-3's gather of a "
            f"unit behind the unit before it (under a pipeline, kept gathered: once per step); "
            f"ZeRO-1/2's weight all-gathers behind the next step's "
            f"first forward, each unit's waited for before it (--no-overlap-weight-gather: in the step); "
            f"of each overlapped collective's time {1 - device.overlap:.0%} is still added (contention)",
            "experts: balanced routing (every expert receives k T / E of the tokens)",
            *reserve_line]


# ============================================================================ the technique: the layouts that fit


@dataclass(frozen=True)
class PlannedLayout:
    """One layout's memory on the fullest rank (its pipeline stage `pp_rank`), component by
    component in bytes, and its estimated step time in seconds by cause, with what the step line
    would print: tokens/s per GPU and MFU (model.flops_per_token over the device's dense peak of
    the weights' dtype, metrics.MFU_CONVENTION)."""

    grid: GridShape
    ep: int
    args: argparse.Namespace
    pp_rank: int
    memory: dict
    live_micro_batches: int
    seconds: dict
    tokens_per_step: int
    model_flops_per_token: int
    peak_flops: float
    host: dict              # --offload optimizer: the fullest rank's host bytes by component (else empty)

    @property
    def peak_bytes(self) -> int:
        return sum(self.memory.values())

    @property
    def host_bytes(self) -> int:
        return sum(self.host.values())

    @property
    def step_seconds(self) -> float:
        return sum(self.seconds.values())

    @property
    def tokens_per_second_per_gpu(self) -> float:
        return self.tokens_per_step / self.step_seconds / self.grid.world_size

    @property
    def mfu(self) -> float:
        return self.tokens_per_second_per_gpu * self.model_flops_per_token / self.peak_flops


def plan_layout(cfg, args, grid: GridShape, ep: int, shape, precision, device: DeviceProfile) -> PlannedLayout:
    """The layout's memory on its fullest pipeline stage (with pp = 1, every rank holds the same)
    and its step time on its slowest, which every stage waits for."""
    stages = [planned_memory(cfg, args, grid, ep, shape, precision, pp_rank, device) for pp_rank in range(grid.pp)]
    pp_rank = max(range(grid.pp), key=lambda rank: sum(stages[rank][0].values()))
    memory, live = stages[pp_rank]
    peak = device.peak_flops.get(dtype_name(precision.param_dtype), device.peak_flops.get("bfloat16"))
    return PlannedLayout(grid, ep, args, pp_rank, memory, live,
                         slowest_stage_seconds(cfg, args, grid, ep, shape, precision, device),
                         shape.tokens_per_step, flops_per_token(cfg, shape.seq_len), peak,
                         planned_host_memory(cfg, args, grid, ep, precision, pp_rank)
                         | planned_activations_on_host(cfg, args, grid, ep, shape, precision, device))


def candidate_layouts(cfg, args, world_size: int, ranks_per_node: int, validate):
    """Every layout of `world_size` ranks that lesson 07's `validate` accepts, for the same global batch (the
    flags' sequences per step) and micro-batch size: each grid (tp within two nodes, as the
    Ultra-Scale Playbook found best for 80 B on 64 nodes, priced on the network), ZeRO stage,
    recompute mode, sequence parallelism with tp, and with experts each ep that divides dp x cp.
    Pipelines run 1F1B, interleaved 1F1B over two chunks per rank, and the flags' schedule."""
    sequences = batch_shape(args, grid_from_args(args, world_size).dp).sequences_per_step
    divisors = [d for d in range(1, world_size + 1) if world_size % d == 0]
    for tp, pp, cp in itertools.product(divisors, repeat=3):
        if world_size % (tp * pp * cp) or tp > 2 * ranks_per_node:
            continue
        grid = GridShape(dp=world_size // (tp * pp * cp), pp=pp, cp=cp, tp=tp)
        if sequences % (grid.dp * args.micro_batch_size):
            continue
        accum = sequences // (grid.dp * args.micro_batch_size)
        schedules = dict.fromkeys([(args.schedule, args.virtual_stages), ("1f1b", 1), ("interleaved", 2)]) \
            if pp > 1 else [("1f1b", 1)]
        for ep in [d for d in divisors if (grid.dp * cp) % d == 0 and cfg.n_experts % d == 0] if cfg.n_experts else [1]:
            for stage, sequence_parallel, (schedule, virtual_stages) in itertools.product(
                    range(4), (False, True) if tp > 1 else (False,), schedules):
                candidate = argparse.Namespace(**{**vars(args), "dp": grid.dp, "tp": tp, "pp": pp, "cp": cp, "ep": ep,
                                                  "zero_stage": stage, "sequence_parallel": sequence_parallel,
                                                  "grad_accum": accum, "global_batch_tokens": None,
                                                  "schedule": schedule, "virtual_stages": virtual_stages})
                shape = batch_shape(candidate, grid.dp)
                try:
                    validate(cfg, grid, shape, candidate, world_size)
                except (ConfigError, ValueError):
                    continue
                for recompute in measurement.RECOMPUTE_MODES:
                    yield grid, ep, argparse.Namespace(**{**vars(candidate), "recompute": recompute}), shape


def layout_name(planned: PlannedLayout) -> str:
    grid, args = planned.grid, planned.args
    parts = [f"dp{grid.dp}"] + [f"{axis}{getattr(grid, axis)}" for axis in ("pp", "cp", "tp")
                                if getattr(grid, axis) > 1]
    parts += [f"v{args.virtual_stages}"] * (args.virtual_stages > 1)
    parts += [f"ep{planned.ep}"] * (planned.ep > 1) + ["sp"] * args.sequence_parallel
    return " ".join(parts)


def fitting_layouts(cfg, args, usable: float, precision, device: DeviceProfile, validate) -> list[PlannedLayout]:
    """Every candidate layout whose fullest rank fits in `usable` bytes, fastest first (the lighter
    one first when two tie)."""
    fitting = []
    host_usable = node_host_memory(args, device) * (1 - PLAN_MARGIN)
    for grid, ep, candidate_args, shape in candidate_layouts(cfg, args, args.gpus, device.ranks_per_node, validate):
        candidate = plan_layout(cfg, candidate_args, grid, ep, shape, precision, device)
        if candidate.peak_bytes <= usable and (not host_usable or
                                               candidate.host_bytes * ranks_on_a_node(args, device) <= host_usable):
            fitting.append(candidate)
    return sorted(fitting, key=lambda c: (c.step_seconds, c.peak_bytes))


def fastest_per_grid(fitting: list[PlannedLayout]) -> list[PlannedLayout]:
    """One layout per grid, its fastest ZeRO stage and recompute mode, in the order of `fitting`."""
    best = {}
    for candidate in fitting:
        best.setdefault(layout_name(candidate), candidate)
    return list(best.values())


# ============================================================================ configuration rules


def plan_device(args) -> DeviceProfile:
    """The device the plan prices: --device-profile's (a machine --calibrate measured: its memory
    per rank, ranks per node and figures), or --gpu's published profile on nodes of
    --gpus-per-node; with --gpu-memory-gb's memory if given. An unusable profile file is one
    `error:` line and exit 2."""
    if args.device_profile is not None:
        try:
            device = load_profile(args.device_profile)
        except ProfileError as error:
            exit_with_error(error)
    else:
        device = replace(published_profile(args.gpu), ranks_per_node=args.gpus_per_node)
    return replace(device, memory_gib=args.gpu_memory_gb if args.gpu_memory_gb is not None else device.memory_gib)


def checked_plan_flags(args, validate, expert_degree):
    """(model, grid, ep, batch shape) of the flags, checked by lesson 07's own rules on --gpus
    ranks, or one `error:` line and exit 2."""
    try:
        if args.gpu not in PUBLISHED_GPUS:
            raise ConfigError(f"--gpu {args.gpu}: the plan knows {', '.join(PUBLISHED_GPUS)}; pick the closest and "
                              f"set its memory with --gpu-memory-gb")
        check_flag_ranges(args)
        if args.gpus < 1 or args.gpus_per_node < 1 or (args.gpu_memory_gb is not None and args.gpu_memory_gb <= 0):
            raise ConfigError("--gpus, --gpus-per-node and --gpu-memory-gb must be positive")
        if args.node_host_memory_gb is not None and args.node_host_memory_gb <= 0:
            raise ConfigError(f"--node-host-memory-gb {args.node_host_memory_gb} must be positive")
        cfg = expert_parallel.moe_config(config_from_flags(args), args)
        grid = grid_from_args(args, args.gpus)
        ep = expert_degree(args.ep, cfg, grid)
        shape = batch_shape(args, grid.dp)
        validate(cfg, grid, shape, args, args.gpus)
    except (ConfigError, ValueError) as error:
        exit_with_error(error)
    return cfg, grid, ep, shape


# ============================================================================ main


def add_plan_flags(parser) -> None:
    parser.add_argument("--plan", action="store_true",
                        help="no training, no torchrun: print this layout's memory per rank on --gpus GPUs, whether "
                             "it fits, and the layouts that fit, fastest first (the layout from the usual flags); "
                             "with --max-minutes M instead the model and tokens M minutes allow (07_sizing.py)")
    parser.add_argument("--gpus", type=int, default=8, help="with --plan: the number of GPUs (the world size)")
    parser.add_argument("--gpu", default="B300",
                        help="with --plan: the GPU, whose published profile (picotron_like/published_profiles.py) "
                             "gives: " + ", ".join(PUBLISHED_GPUS))
    parser.add_argument("--gpu-memory-gb", type=float, default=None,
                        help="with --plan: the GPU's memory in GiB, instead of the table's")
    parser.add_argument("--gpus-per-node", type=int, default=8,
                        help="with --plan: GPUs joined by NVLink; groups that span nodes use the network")
    parser.add_argument("--device-profile", default=None, metavar="FILE",
                        help="with --plan or --autotune: price with this device profile (written by --calibrate) "
                             "instead of --gpu's published one: its memory per rank, ranks per node, GEMM and "
                             "attention rates, memory bandwidth, per-op time, collectives' latencies and bandwidths")
    parser.add_argument("--plan-top", type=int, default=10, help="with --plan: how many fitting layouts to list")
    parser.add_argument("--node-host-memory-gb", type=float, default=None,
                        help="with --plan and --offload optimizer: a node's host memory in GiB, against which the "
                             "node's ranks' host bytes are checked (default: the GPU's DGX system's, e.g. 2048 for "
                             "a DGX H100; a device profile's host_memory_gib)")
    parser.add_argument("--zero-table", action="store_true",
                        help="no training, no torchrun: print the model's states per GPU on 8 and 64 GPUs at "
                             "every ZeRO stage and precision policy (lesson 06's formula, data parallelism alone)")


def print_memory_plan(args, validate, expert_degree) -> None:
    """--plan: this layout's memory per rank, whether it fits, and the layouts that fit, fastest
    first. `validate` and `expert_degree`: lesson 07's rules and --ep's default, which 07 passes
    (the plan never loads 07: 07 loads the plan)."""
    cfg, grid, ep, shape = checked_plan_flags(args, validate, expert_degree)
    device = plan_device(args)
    # The plan is for the device: --dtype auto is bf16 on a GPU.
    precision = zero.precision_from_flags(args.dtype, args.reduce_dtype, torch.device(device.device_type))
    capacity = device.memory_gib * GIB
    usable = capacity * (1 - PLAN_MARGIN)
    planned = plan_layout(cfg, args, grid, ep, shape, precision, device)
    print(f"memory plan: {model_name(args)} ({count_parameters(cfg)['total'] / 1e9:.2f} B parameters) on "
          f"{args.gpus} x {device.name} ({capacity / GIB:.0f} GiB each; planned to {1 - PLAN_MARGIN:.0%} of it: "
          f"{usable / GIB:.1f} GiB)")
    schedule = (f"{args.schedule}" + (f" over {args.virtual_stages} virtual stages" if args.virtual_stages > 1 else "")
                + ", " if grid.pp > 1 else "")
    in_fp8 = fp8.fp8_groups_of_run(cfg, args, shape.micro_batch_size * shape.seq_len // grid.cp, grid.tp,
                                   device.capability is not None)
    fp8_part = (f"FP8 {args.fp8} matmuls, {fp8.bf16_linears_line(cfg, in_fp8, cfg.n_layers)}, "
                if args.fp8 != "none" else "")
    muon_part = "Muon (AdamW for the rest), " if args.optimizer == "muon" else ""
    print(f"layout: dp={grid.dp} x pp={grid.pp} x cp={grid.cp} x tp={grid.tp}, ep={ep}, {schedule}ZeRO-{args.zero_stage}, "
          f"recompute {args.recompute}, {fp8_part}{muon_part}weights {str(precision.param_dtype).removeprefix('torch.')}, "
          f"gradients {str(precision.reduce_dtype).removeprefix('torch.')}, "
          f"seq {shape.seq_len} x micro-batch {shape.micro_batch_size} x {shape.grad_accum} micro-batches x dp "
          f"{grid.dp} = {shape.tokens_per_step:,} tokens per step")
    if shape.seq_len != cfg.seq_len:
        print(f"note: {args.preset} is sized for --seq-len {cfg.seq_len}")
    print_planned_memory(planned, usable)
    print_planned_host_memory(planned, args, device)
    print_peak_makeup(planned, cfg, shape, precision, device)
    by_mode = {mode: planned_activation_bytes(cfg, argparse.Namespace(**{**vars(args), "recompute": mode}), grid, ep,
                                              shape, precision, planned.pp_rank, device)[0]
               for mode in measurement.RECOMPUTE_MODES}
    print("activations by --recompute: " + ", ".join(f"{mode} {size / GIB:.2f} GiB" for mode, size in by_mode.items()))
    print(f"step time of this layout, estimated: {planned.step_seconds:.3f} s, "
          f"{planned.tokens_per_second_per_gpu:,.0f} tokens/s per GPU, {planned.mfu:.1%} MFU")
    if "optimizer" in args.offload and device.host_link_bandwidth:
        units = zero_units(cfg, args, grid, ep, planned.pp_rank)
        micro = micro_batch_seconds(cfg, args, grid, ep, shape, precision, device, planned.pp_rank)
        parts = offload_seconds(units, args, precision, device, micro)
        print(f"of which the offloaded optimizer's (stage {planned.pp_rank}, in the elementwise part): "
              + ", ".join(f"{name} {1e3 * value:.1f} ms" for name, value in parts.items())
              + " exposed")
    if "activations" in args.offload:
        print_offload(planned, cfg, shape, precision, device)
    if args.optimizer == "muon":
        muon = muon_seconds(cfg, args, grid, ep, device, planned.pp_rank)
        print(f"of which Muon's step (stage {planned.pp_rank}): Newton-Schulz {1e3 * muon['compute']:.1f} ms on the "
              f"busiest owner, its all-to-alls {1e3 * muon['dp']:.1f} ms, the joins over tp {1e3 * muon['tp']:.1f} ms")
    fitting = fitting_layouts(cfg, args, usable, precision, device, validate)
    print(f"\n{len(fitting)} layouts of {args.gpus} GPUs fit this batch ({shape.sequences_per_step} sequences of "
          f"{shape.seq_len} per step, micro-batch {shape.micro_batch_size}); each grid's fastest, fastest first, "
          f"by the estimate below:")
    print_layout_table(fastest_per_grid(fitting)[:args.plan_top])
    assumptions = plan_assumptions(device, args.fp8, args.optimizer, args.offload)
    print("assumptions:\n" + "\n".join(f"  - {line}" for line in assumptions))


def print_planned_memory(planned: PlannedLayout, usable: float) -> None:
    """The fullest rank's bytes by component, their total, and the verdict against `usable`."""
    grid = planned.grid
    where = f"pipeline stage {planned.pp_rank} of {grid.pp}, " if grid.pp > 1 else ""
    live = f"{planned.live_micro_batches} micro-batch{'es' if planned.live_micro_batches > 1 else ''}"
    if planned.args.virtual_stages > 1:
        live += f" of its {planned.args.virtual_stages} chunks"
    print(f"\nper rank ({where}the fullest rank; activations of {live} live at the peak)")
    print(f"  {'component':<40}{'GiB':>8}")
    for name, size in planned.memory.items():
        print(f"  {name:<40}{size / GIB:>8.2f}")
    total = planned.peak_bytes
    print(f"  {'total':<40}{total / GIB:>8.2f}")
    print(f"fits: {total / GIB:.1f} of {usable / GIB:.1f} GiB, {(usable - total) / GIB:.1f} GiB to spare"
          if total <= usable else f"does not fit: {total / GIB:.1f} GiB, {(total - usable) / GIB:.1f} GiB over "
                                  f"the {usable / GIB:.1f} GiB planned")


def node_host_memory(args, device: DeviceProfile) -> float:
    """A node's host memory in bytes: --node-host-memory-gb, or the device profile's (0: unknown)."""
    return (args.node_host_memory_gb if args.node_host_memory_gb is not None else device.host_memory_gib) * GIB


def print_planned_host_memory(planned: PlannedLayout, args, device: DeviceProfile) -> None:
    """Under --offload: the fullest rank's host bytes by component, a node's (its ranks
    each as full: a bound under a pipeline, whose stages differ), and the verdict against the
    node's host memory, planned to the same share as the device's."""
    if not planned.host:
        return
    print(f"\nhost memory per rank (--offload {' '.join(args.offload)}: off the device, in the node's memory)")
    print(f"  {'component':<40}{'GiB':>8}")
    for name, size in planned.host.items():
        print(f"  {name:<40}{size / GIB:>8.2f}")
    print(f"  {'total':<40}{planned.host_bytes / GIB:>8.2f}")
    ranks, capacity = ranks_on_a_node(args, device), node_host_memory(args, device)
    per_node = ranks * planned.host_bytes
    if not capacity:
        print(f"host memory per node: {ranks} ranks x {planned.host_bytes / GIB:.2f} GiB = {per_node / GIB:.1f} GiB "
              f"(this profile states no host memory: --node-host-memory-gb checks it)")
        return
    usable = capacity * (1 - PLAN_MARGIN)
    source = "--node-host-memory-gb" if args.node_host_memory_gb is not None else f"{device.name}'s system"
    verdict = (f"fits, {(usable - per_node) / GIB:.1f} GiB to spare" if per_node <= usable else
               f"does not fit, {(per_node - usable) / GIB:.1f} GiB over")
    print(f"host memory per node: {ranks} ranks x {planned.host_bytes / GIB:.2f} GiB = {per_node / GIB:.1f} GiB of "
          f"{capacity / GIB:.0f} GiB ({source}), planned to {1 - PLAN_MARGIN:.0%} of it: {verdict}")


def print_peak_makeup(planned: PlannedLayout, cfg, shape, precision, device: DeviceProfile) -> None:
    """Which tensors the total counts, and when they are all alive at once."""
    loss = planned_loss_parts(cfg, planned.args, planned.grid, shape, precision, planned.pp_rank, device)
    parts = ["the model states", f"the kept activations of {planned.live_micro_batches} micro-batch"
             + ("es" if planned.live_micro_batches > 1 else "")]
    if loss:
        tokens, words = loss_chunk_shape(shape.micro_batch_size * shape.seq_len // planned.grid.cp,
                                         cfg.vocab_size // planned.grid.tp, device.device_type,
                                         planned_loss_settings(planned.args))
        parts.append(f"the loss's backward (the head's dW {loss['dW'] / GIB:.2f} GiB, dx {loss['dx'] / GIB:.2f} GiB, "
                     f"the logits of one chunk, {tokens} tokens x {words} words, {loss['chunk'] / GIB:.2f} GiB)")
    if planned.memory["gathered weights (ZeRO-3)"]:
        parts.append("ZeRO-3's gathered units")
    if WHOLE_GRADIENTS in planned.memory:
        parts.append("the gradients accumulated whole (ZeRO-2/3 under a pipeline)")
    when = ("at the start of a micro-batch's backward, in the LM head" if loss else
            "when the schedule holds the most micro-batches (this stage holds no LM head)")
    reserve = ("; beyond them, the caching allocator's reserve" if ALLOCATOR_RESERVE_ROW in planned.memory
               else "")
    print(f"the peak, {when}: " + ", ".join(parts) + ", and the communication buffers" + reserve)


def print_offload(planned: PlannedLayout, cfg, shape, precision, device: DeviceProfile) -> None:
    """--offload activations on the pipeline stage whose copies are least hidden: the host-link bandwidth
    they need per step at the step time estimated without them, next to the link's, and where each copy
    must hide (one block's copy against the next block's forward and backward), so that a stall shows
    before launch (their host memory: print_planned_host_memory)."""
    args, grid = planned.args, planned.grid
    timings = {rank: offload_timing(cfg, args, grid, planned.ep, shape, precision, device, rank,
                                    micro_batch_seconds(cfg, args, grid, planned.ep, shape, precision, device, rank))
               for rank in range(grid.pp)}
    rank = max(timings, key=lambda rank: (timings[rank].exposed, timings[rank].copy))
    timing, offload = timings[rank], planned_offload(cfg, args, grid, planned.ep, shape, precision, rank, device)
    compute_step = planned.step_seconds - planned.seconds.get("offload", 0.0)
    link = (f"the host link's {device.host_link_bandwidth / 1e9:.0f} GB/s per direction"
            if device.host_link_bandwidth else "no host link apart (copies in the device's own memory, made at once)")
    verdict = (f"{1e3 * timing.exposed:.1f} ms per step not hidden on this stage, in its step time" if timing.exposed
               else "every copy hidden")
    print(f"activation offload (stage {rank}): {offload.blocks_per_step} blocks per step, "
          f"{offload.link_bytes_per_step / 1e9:.2f} GB each way, {offload.link_bytes_per_step / compute_step / 1e9:.1f} "
          f"GB/s over the {compute_step:.3f} s step estimated without the copies, against {link}; a block's copy "
          f"{1e3 * timing.copy:.1f} ms against the next block's forward {1e3 * timing.forward:.1f} ms and backward "
          f"{1e3 * timing.backward:.1f} ms: {verdict}")


def print_layout_table(layouts: list[PlannedLayout]) -> None:
    """Each layout's memory, step time, what the step line would print (tokens/s per GPU, MFU) and
    the step's parts in seconds: compute (GEMMs, attention), elementwise (and the optimizer),
    recomputation, the bubble, and the exposed rest of each axis's communication."""
    parts = ("compute", "elementwise", "recompute", "bubble", "tp", "cp ep", "pp", "dp")
    labels = ("compute", "elemw", "recomp", "bubble", "tp", "cp ep", "pp", "dp")
    print(f"  {'layout':<24}{'ZeRO':>5}  {'recompute':<10}{'GiB':>7}{'step s':>9}{'tok/s/GPU':>11}{'MFU':>7}"
          + "".join(f"{label:>9}" for label in labels))
    for layout in layouts:
        print(f"  {layout_name(layout):<24}{layout.args.zero_stage:>5}  {layout.args.recompute:<10}"
              f"{layout.peak_bytes / GIB:>7.1f}{layout.step_seconds:>9.3f}{layout.tokens_per_second_per_gpu:>11,.0f}"
              f"{layout.mfu:>7.1%}" + "".join(f"{layout.seconds[part]:>9.3f}" for part in parts))


def zero_memory_table(args, gpu_counts=(8, 64)) -> str:
    """--zero-table: lesson 06's model states per GPU in GB for the flags' model over data
    parallelism alone, at every ZeRO stage and precision policy (padding included, activations not)."""
    try:
        check_flag_ranges(args)
        counts = unit_parameter_counts(config_from_flags(args))
    except (ConfigError, ValueError) as error:
        exit_with_error(error)
    policies = {"bf16 / bf16 grads": zero.Precision(torch.bfloat16, torch.bfloat16),
                "bf16 / fp32 grads": zero.Precision(torch.bfloat16, torch.float32),
                "fp32": zero.Precision(torch.float32, torch.float32)}
    header = f"{'policy':<20}{'stage':>6}" + "".join(f"{f'{n} GPUs GB':>12}" for n in gpu_counts)
    rows = [f"{model_name(args)}: {sum(counts) / 1e9:.2f} B parameters, model states per GPU", header]
    for name, precision in policies.items():
        for stage in range(4):
            sizes = [zero.predicted_model_states(counts, n, stage, precision).total / 1e9 for n in gpu_counts]
            rows.append(f"{name:<20}{stage:>6}" + "".join(f"{size:>12.1f}" for size in sizes))
    return "\n".join(rows)
