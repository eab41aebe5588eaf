"""
Lesson 07's memory plan: will a model fit a layout, and which layout to pick, before anything is launched.

    python 07_full_5d.py --plan --preset 8b --gpus 8 --gpu B300 --seq-len 8192 --micro-batch-size 1 --grad-accum 8

Booking 8 x B300 for a run that dies at its first step of an out-of-memory error is the expensive
way to find out. Every byte a rank of lesson 07's trainer holds has a formula in the lesson that
owns it, so the plan adds them up for any layout of the usual flags on --gpus GPUs, no process
group, no GPU:

    parameters, gradients,        lesson 06's formula (predicted_model_states) on its unit counts
    master weights, Adam states   (unit_parameter_counts: the stage's units, tp's slices, experts
                                  over ep, sharded over dp x cp or, for experts, edp)
    activations                   lesson 07's per micro-batch (recompute mode, compute dtype, the
                                  stage), times the micro-batches lesson 03's schedule keeps live;
                                  with experts lesson 05's per-layer bytes for balanced routing;
                                  with --fp8 the blocks' matmul inputs as FP8 copies (07_fp8.py)
    gathered weights (ZeRO-3)     lesson 06's prefetch window
    communication buffers         estimated here: ZeRO's flattened gradients in flight, a pipeline
                                  boundary's tensors, ring attention's K/V blocks

It prints them for the fullest rank (the pipeline stage that holds most), the verdict against 90%
of the GPU's memory (the rest: CUDA context, NCCL, allocator fragmentation), and every layout that
fits the same global batch, ranked by an estimated step time: compute at half the GPU's peak,
recomputation's extra forward, lesson 03's bubble, and the communication nothing hides, from the
lessons' traffic formulas at NVLink or network bandwidth; its assumptions are printed with it.
With --fp8 the blocks' matmuls count at the GPU's FP8 peak (where they run on FP8 tensor cores)
and tp's all-reduces of the amaxes join tp's traffic.

Proven (tests/test_memory_plan.py): at small scale on CPU the plan equals the bytes each rank
holds, component by component (model states, activations, ZeRO-3's window), for several layouts,
stages and recompute modes; at real scale its model states equal those of the sharded 8b model on
8 and 64 GPUs and of Mixtral-8x7B on 64, built rank by rank on the meta device by lesson 06's own
build_model from a grid that knows only the rank (LaidOutGrid): nothing is drawn.
The communication buffers and the step time are estimates, and say so.
"""

from __future__ import annotations

import argparse
import itertools
from collections import defaultdict
from dataclasses import dataclass
from functools import lru_cache, partial
from typing import NamedTuple

import torch

from picotron_like.lessons import load_lesson
from picotron_like.loss import loss_chunk_tokens
from picotron_like.metrics import add_traffic, loss_transient_parts, peak_flops_of_name
from picotron_like.model import count_parameters, flops_per_token
from picotron_like.pipeline_tools import peak_live_micro_batches
from picotron_like.topology import ConfigError, GridShape, GroupLayout, ProcessGrid
from picotron_like.train import (batch_shape, check_flag_ranges, config_from_flags, exit_with_error, grid_from_args,
                                 model_name)

tensor_parallel = load_lesson("02_tensor_parallel")
pipeline_parallel = load_lesson("03_pipeline_parallel")
context_parallel = load_lesson("04_context_parallel")
expert_parallel = load_lesson("05_expert_parallel")
zero = load_lesson("06_zero")
zero_bubble = load_lesson("03_zero_bubble")
fp8 = load_lesson("07_fp8")
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


class GPU(NamedTuple):
    """What the plan assumes of a GPU (HGX boards; a PCIe card has less of the first three)."""

    memory_gib: int                 # as sold: an H100's 80 GB are 80 x 2^30 bytes (--gpu-memory-gb overrides it)
    nvlink_gbps: int                # per direction, within a node
    network_gbps: int               # per direction and GPU, to other nodes
    capability: tuple[int, int]     # CUDA compute capability: which kernels a run gets (05's grouped matmul)


GPUS = {"B300": GPU(288, 900, 100, (10, 3)), "B200": GPU(180, 900, 50, (10, 0)), "H200": GPU(141, 450, 50, (9, 0)),
        "H100": GPU(80, 450, 50, (9, 0)), "A100-80GB": GPU(80, 300, 25, (8, 0)), "A100-40GB": GPU(40, 300, 25, (8, 0))}
# The plan keeps this share of a GPU free: the CUDA context and kernel workspaces (1-2 GiB),
# NCCL's buffers, and the blocks the caching allocator holds but cannot hand out (fragmentation).
PLAN_MARGIN = 0.10
GIB = 2**30


def unit_parameter_counts(cfg, tp: int = 1, pp: int = 1, pp_rank: int = 0, ep: int = 1,
                          experts: bool = False, virtual_stages: int = 1) -> list[int]:
    """Parameters of each unit on one tp rank of pipeline rank `pp_rank`: the embedding (first
    stage), the blocks of its stage (of its v chunks, interleaved), the head (last stage, which
    is always on the last rank); norm gains stay whole under tp. With
    experts (lesson 05's split), a block's dense unit holds the attention, the norms, the router
    (whole on every tp rank) and the shared expert (split like a dense MLP); experts=True counts
    each unit's routed experts instead: E/ep of them, each split over tp (none in embedding, head)."""
    h, hd = cfg.hidden, cfg.head_dim
    swiglu = 3 * h * cfg.ffn_hidden
    if experts:
        block, embedding, head = cfg.n_experts * swiglu // (ep * tp), 0, 0
    else:
        mlp = cfg.n_shared_experts * swiglu // tp + h * cfg.n_experts if cfg.n_experts else swiglu // tp
        block = (2 * h * cfg.n_heads * hd + 2 * h * cfg.n_kv_heads * hd) // tp + mlp + 2 * h
        embedding, head = cfg.vocab_size * h // tp, h + h * cfg.vocab_size // tp
    ranges = pipeline_parallel.stage_layer_ranges(cfg.n_layers, pp * virtual_stages)
    n_blocks = sum(len(ranges[stage]) for stage in range(pp_rank, pp * virtual_stages, pp))
    return [embedding] * (pp_rank == 0) + [block] * n_blocks + [head] * (pp_rank == pp - 1)


@lru_cache(maxsize=None)
def stage_outline(cfg, pp: int, pp_rank: int, virtual_stages: int = 1) -> tuple:
    """Lesson 03's chunks of pipeline rank `pp_rank` (its stage, or its v interleaved chunks),
    built on the meta device: their layers and whether they hold the embedding and the head,
    which is what the formulas read from them (no tensor is drawn)."""
    with torch.device("meta"):
        return tuple(pipeline_parallel.build_stage_chunks(cfg, 0, pp, pp_rank, virtual_stages))


@lru_cache(maxsize=None)
def pipeline_program(schedule: str, pp: int, n_micro: int, pp_rank: int, virtual_stages: int = 1) -> list:
    # lesson 03's schedules and zero-bubble's, as lesson 07 runs them
    return zero_bubble.pipeline_programs(schedule, pp, n_micro, virtual_stages)[pp_rank]


def planned_activation_bytes(cfg, args, grid: GridShape, ep: int, shape, precision, pp_rank: int) -> tuple[int, int]:
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
                                               GPUS[args.gpu].capability)

    def one_micro_batch(stage) -> int:
        kept = measurement.predicted_kept_activation_bytes(cfg, micro, shape.seq_len, args.recompute, tp,
                                                           args.sequence_parallel, grid.cp, stage,
                                                           precision.param_dtype)
        layers = cfg.n_layers if stage is None else len(stage.layer_ids)
        # --fp8: FP8 copies of the blocks' matmul inputs instead of bf16 ones (07_fp8.py)
        kept += fp8.kept_bytes_difference(cfg, args.fp8, micro * shape.seq_len // grid.cp, tp, precision.param_dtype,
                                          layers, args.recompute, args.sequence_parallel)
        if cfg.n_experts and args.recompute != "full":
            tokens = micro * shape.seq_len // grid.cp
            routed = cfg.experts_per_token * tokens
            kept += layers * expert_parallel.moe_layer_bytes_over_dense(experts, tokens, micro, routed, routed, ep,
                                                                        grouped, e)
        return kept

    sizes = [one_micro_batch(stage) for stage in chunks]
    if grid.pp == 1:
        return sizes[0], 1
    program = pipeline_program(args.schedule, grid.pp, shape.grad_accum, pp_rank, args.virtual_stages)
    return peak_live_micro_batches(program, sizes), peak_live_micro_batches(program)


def planned_buffer_bytes(cfg, args, grid: GridShape, shape, precision, flat_units: list[int]) -> int:
    """Communication buffers at the backward's peak, an estimate (the CPU cannot measure them):
    ZeRO flattens each unit's gradients (g bytes) from autograd's per-parameter ones (p bytes) to
    reduce them, one unit at a time at stages 0-1; at stages 2-3 the previous unit's buffer and its
    reduced shard are still in flight meanwhile. A pipeline stage receives one activation and one
    gradient at the boundary; ring attention holds the K/V block it computes on and the one arriving."""
    p, g = precision.param_dtype.itemsize, precision.reduce_dtype.itemsize
    largest = max(flat_units)
    n = 1 if args.zero_stage == 0 else grid.dp * grid.cp
    buffers = largest * (p + g) + (largest * g + largest // n * g if args.zero_stage >= 2 else 0)
    tokens = shape.micro_batch_size * shape.seq_len // grid.cp
    if grid.pp > 1:
        buffers += 2 * p * tokens * cfg.hidden // (grid.tp if args.sequence_parallel else 1)
    if grid.cp > 1 and args.cp_mode == "ring":
        buffers += 2 * 2 * tokens * cfg.n_kv_heads // grid.tp * cfg.head_dim * p
    return buffers


def planned_loss_parts(cfg, args, grid: GridShape, shape, precision, pp_rank: int) -> dict[str, int]:
    """The chunked loss's backward on a rank that holds the LM head (the last pipeline stage; none
    on the others), by part: metrics.loss_transient_parts for its tokens (b s / cp, the whole
    sequence under sequence parallelism, which gathers it again for the head) and its vocabulary
    slice V / tp, in the weights' dtype, on a GPU. It comes at the start of a micro-batch's
    backward, when the activations counted above are all alive: the step's peak, together with them."""
    if pp_rank != grid.pp - 1:
        return {}
    tokens = shape.micro_batch_size * shape.seq_len // grid.cp
    return loss_transient_parts(tokens, cfg.hidden, cfg.vocab_size // grid.tp, precision.param_dtype,
                                regathered_input=args.sequence_parallel)


def zero_units(cfg, args, grid: GridShape, ep: int, pp_rank: int):
    """Pipeline stage `pp_rank`'s units as lesson 07's ZeroUnits: their dense parameters over dp x
    cp and their experts over edp = dp x cp / ep (unit_parameter_counts)."""
    dense = unit_parameter_counts(cfg, grid.tp, grid.pp, pp_rank, virtual_stages=args.virtual_stages)
    experts = unit_parameter_counts(cfg, grid.tp, grid.pp, pp_rank, ep, True, args.virtual_stages)
    return measurement.ZeroUnits(dense, experts, grid.dp * grid.cp, grid.dp * grid.cp // ep)


def planned_memory(cfg, args, grid: GridShape, ep: int, shape, precision, pp_rank: int) -> tuple[dict, int]:
    """Pipeline stage `pp_rank`'s bytes per rank by component (every rank of a stage holds the
    same), and the micro-batches live at the activations' peak. Model states: lesson 06's formula
    on its unit counts (experts over edp); gathered weights: ZeRO-3's prefetch window (06)."""
    units = zero_units(cfg, args, grid, ep, pp_rank)
    states = units.model_states(args.zero_stage, precision)
    gathered = (units.gathered_peak(precision, args.reshard_after_forward, args.prefetch)
                if args.zero_stage == 3 else 0)
    activations, live = planned_activation_bytes(cfg, args, grid, ep, shape, precision, pp_rank)
    memory = {"parameters": states.parameters, "gradients": states.gradients,
              "master weights (fp32)": states.master_weights, "Adam states (fp32)": states.optimizer_states,
              "activations": activations,
              "loss's backward (chunked)": sum(planned_loss_parts(cfg, args, grid, shape, precision, pp_rank).values()),
              "gathered weights (ZeRO-3)": gathered,
              "communication buffers (estimated)": planned_buffer_bytes(
                  cfg, args, grid, shape, precision, [count for count in units.dense + units.experts if count])}
    return memory, live


# ============================================================================ the technique: the step-time estimate

# The estimate's assumptions, printed with it (plan_assumptions).
MATMUL_EFFICIENCY = 0.5          # of the GPU's dense bf16 peak (FP8's for --fp8's matmuls), for the model's FLOPs
RECOMPUTE_COST = {"none": 0.0, "selective": 0.02, "full": 1 / 3}   # of the step's compute


def group_bandwidth(grid: GridShape, groups: list[list[int]], gpu: str, gpus_per_node: int) -> float:
    """Bytes/s a rank of these groups sends at: NVLink when each group sits inside one node, else the network."""
    nvlink, network = GPUS[gpu].nvlink_gbps, GPUS[gpu].network_gbps
    inside = all(len({rank // gpus_per_node for rank in members}) == 1 for members in groups)
    return (nvlink if inside else network) * 1e9


def wire_bytes(traffic: dict, n: int) -> float:
    """A ring's bytes per rank for payloads by (collective, group): an all-reduce sends 2 (n-1)/n
    of its payload, a gather, scatter or all-to-all (n-1)/n, a send all of it."""
    ring = (n - 1) / n
    factors = {"all_reduce": 2 * ring, "all_gather_single": ring, "reduce_scatter_single": ring,
               "all_to_all_single": ring, "isend": 1.0}
    return sum(payload * factors.get(kind, 0.0) for (kind, _), payload in traffic.items())


def estimated_step_seconds(cfg, args, grid: GridShape, ep: int, shape, precision, gpu: str, gpus_per_node: int,
                           pp_rank: int) -> dict:
    """Step time by cause (see plan_assumptions): the model's FLOPs on this rank at a fixed share of
    the GPU's peak; recomputation's extra forward; lesson 03's bubble; the communication that
    nothing hides, by the lessons' traffic formulas for this stage, at its group's bandwidth."""
    layout = LaidOutGrid(grid, ep, rank=grid.rank_of(pp=pp_rank))
    compute = compute_seconds_per_token(cfg, shape.seq_len, args.fp8, gpu) * shape.tokens_per_step / grid.world_size
    recompute = compute * RECOMPUTE_COST[args.recompute]
    bubble = (compute + recompute) * pipeline_parallel.bubble_formula(args.schedule, grid.pp, shape.grad_accum,
                                                                      args.virtual_stages)
    chunks = stage_outline(cfg, grid.pp, pp_rank, args.virtual_stages)
    n_layers = sum(len(chunk.layer_ids) for chunk in chunks)
    micro, m, e, tp, cp = shape.micro_batch_size, shape.grad_accum, precision.param_dtype.itemsize, grid.tp, grid.cp
    bandwidth = partial(group_bandwidth, grid, gpu=gpu, gpus_per_node=gpus_per_node)
    exposed = 0.0
    recomputed = measurement.predicted_recompute_traffic(cfg, shape, layout, n_layers, args.recompute,
                                                         args.cp_mode, args.sequence_parallel, e)

    def on_axis(traffic: dict, axis: str) -> dict:
        return {key: value for key, value in add_traffic(traffic, recomputed).items() if key[1] == axis}

    # --fp8: the amaxes' all-reduces over tp and cp, sequence parallelism's FP8 all-gather (07_fp8.py)
    fp8_traffic = fp8.predicted_fp8_traffic(cfg, args.fp8, micro * shape.seq_len // cp, tp, m, n_layers,
                                            args.recompute, args.sequence_parallel, cp)
    fp8_on = {axis: {key: value for key, value in fp8_traffic.items() if key[1] == axis} for axis in ("tp", "cp")}

    if tp > 1:      # on the critical path: every block waits for its all-reduces (lesson 02's, chunk by chunk)
        traffic = add_traffic(*(tensor_parallel.predicted_tp_traffic(
            cfg, micro, shape.seq_len // cp, m, tp, args.sequence_parallel, precision.param_dtype,
            save_sequence_shard=True, stage=chunk) for chunk in chunks))
        tp_traffic = add_traffic(on_axis(traffic, "tp"), fp8_on["tp"])
        exposed += wire_bytes(tp_traffic, tp) / bandwidth(grid.group_ranks(("tp",)))
    if fp8_on["cp"]:    # the scales along the tokens wait for their amax over cp
        exposed += wire_bytes(fp8_on["cp"], cp) / bandwidth(grid.group_ranks(("cp",)))
    if cp > 1 and args.cp_mode == "ulysses":    # the ring hides its sends behind each block's attention
        traffic = context_parallel.predicted_cp_traffic(measurement.attention_of_one_rank(cfg, tp, n_layers), micro,
                                                        shape.seq_len, cp, "ulysses", m, e)
        exposed += wire_bytes(on_axis(traffic, "cp"), cp) / bandwidth(grid.group_ranks(("cp",)))
    if cfg.n_experts and ep > 1:    # lesson 05's 2 (m + r) h e per MoE forward, m = r = k T (balanced)
        routed = cfg.experts_per_token * micro * shape.seq_len // cp
        traffic = {("all_to_all_single", "ep"): m * n_layers * 4 * routed * cfg.hidden * e}
        exposed += wire_bytes(traffic, ep) / bandwidth(grid.ep_group_ranks(ep))
    if grid.dp * cp > 1:
        exposed += exposed_zero_seconds(cfg, args, grid, ep, precision, m, compute, pp_rank, bandwidth)
    if grid.pp > 1:
        boundary = micro * shape.seq_len // cp // (tp if args.sequence_parallel else 1) * cfg.hidden
        sent = pipeline_parallel.predicted_p2p_bytes(m, (boundary,), e, grid.pp, pp_rank, args.virtual_stages)
        exposed += sent / bandwidth(grid.group_ranks(("pp",)))
    return {"compute": compute, "recompute": recompute, "bubble": bubble, "communication": exposed}


def compute_seconds_per_token(cfg, seq_len: int, recipe: str, gpu: str) -> float:
    """One token's model FLOPs at MATMUL_EFFICIENCY of the GPU's peak; with --fp8, the share that
    07_fp8 runs as FP8 matmuls at the FP8 peak where they run on FP8 tensor cores (tensorwise and
    rowwise from sm_89), the rest at bf16's. The quantisations' elementwise passes are not counted."""
    flops, bf16_peak = flops_per_token(cfg, seq_len), peak_flops_of_name(gpu)
    fp8_flops = fp8.fp8_matmul_flops_per_token(cfg) if recipe != "none" else 0
    fp8_peak = (peak_flops_of_name(gpu, fp8=True) if fp8.runs_on_fp8_tensor_cores(recipe, GPUS[gpu].capability)
                else bf16_peak)
    return ((flops - fp8_flops) / bf16_peak + fp8_flops / fp8_peak) / MATMUL_EFFICIENCY


def exposed_zero_seconds(cfg, args, grid: GridShape, ep: int, precision, m: int, compute: float, pp_rank: int,
                         bandwidth) -> float:
    """Lesson 06's traffic over dp x cp (experts: over edp) for stage `pp_rank`, less what the
    step hides: the gradient reduction behind backward, ZeRO-3's gathers behind compute."""
    n = grid.dp * grid.cp
    traffic = zero_units(cfg, args, grid, ep, pp_rank).traffic(args.zero_stage, precision, m, args.reshard_after_forward)
    groups = {"dp_cp": (n, grid.group_ranks(("dp", "cp"))), "edp": (n // ep, grid.edp_group_ranks(ep))}
    seconds = defaultdict(float)
    for (kind, group), payload in traffic.items():
        size, members = groups[group]
        seconds[kind] += wire_bytes({(kind, group): payload}, size) / bandwidth(members)
    backward = 2 / 3 * compute
    # Gradients reduce during backward: at stages 0-1 the last micro-batch's only, at 2-3 every one's.
    reduce_window = backward / m if args.zero_stage <= 1 else backward
    exposed = max(0.0, seconds.get("all_reduce", 0.0) + seconds.get("reduce_scatter_single", 0.0) - reduce_window)
    # ZeRO-3 prefetches each unit's gather behind the unit before it; stages 1-2 gather after the step.
    gather = seconds.get("all_gather_single", 0.0)
    return exposed + (max(0.0, gather - compute) if args.zero_stage == 3 else gather)


def plan_assumptions(gpu: str, gpus_per_node: int, recipe: str = "none") -> list[str]:
    nvlink, network = GPUS[gpu].nvlink_gbps, GPUS[gpu].network_gbps
    return [f"compute: the model's FLOPs (6 N per token + attention) at {MATMUL_EFFICIENCY:.0%} of {gpu}'s dense bf16 "
            f"peak, shared evenly by the ranks (zigzag balances cp's causal work)",
            *([fp8_assumption(gpu, recipe)] if recipe != "none" else []),
            f"recompute: full +{RECOMPUTE_COST['full']:.0%} (the blocks' forward again), selective "
            f"+{RECOMPUTE_COST['selective']:.0%} (elementwise norms and silu, bound by memory bandwidth)",
            "bubble: lesson 03's (pp - 1) / m of the compute ((pp - 1) / (v m) interleaved), stages of equal time",
            f"communication: ring wire bytes at {nvlink} GB/s within a node of {gpus_per_node}, {network} GB/s "
            f"per GPU between nodes; tp, Ulysses, ep and pp exposed, ring attention hidden, gradient reduction "
            f"hidden behind backward (stages 0-1: the last micro-batch's), ZeRO-3's gathers behind compute, "
            f"ZeRO-1/2's gather after the step exposed",
            "experts: balanced routing (every expert receives k T / E of the tokens)"]


def fp8_assumption(gpu: str, recipe: str) -> str:
    matmuls = f"--fp8 {recipe}: the blocks' attention and MLP matmuls (07_fp8.fp8_matmul_flops_per_token) "
    if not fp8.runs_on_fp8_tensor_cores(recipe, GPUS[gpu].capability):
        return (matmuls + f"at the bf16 rate: lesson 07 emulates them on {gpu} (float32 matmuls of dequantised "
                           f"values, slower than that); their memory and traffic are planned as they are")
    return (matmuls + f"at {MATMUL_EFFICIENCY:.0%} of {gpu}'s dense FP8 peak "
                       f"({peak_flops_of_name(gpu, fp8=True) / 1e12:,.0f} TFLOP/s), the quantisations (elementwise, "
                       f"memory-bound) not counted; tp's all-reduces of the amaxes counted")


# ============================================================================ the technique: the layouts that fit


@dataclass(frozen=True)
class PlannedLayout:
    """One layout's memory on the fullest rank (its pipeline stage `pp_rank`), component by
    component in bytes, and its estimated step time in seconds by cause."""

    grid: GridShape
    ep: int
    args: argparse.Namespace
    pp_rank: int
    memory: dict
    live_micro_batches: int
    seconds: dict

    @property
    def peak_bytes(self) -> int:
        return sum(self.memory.values())


def plan_layout(cfg, args, grid: GridShape, ep: int, shape, precision, gpu: str, gpus_per_node: int) -> PlannedLayout:
    """The layout's memory on its fullest pipeline stage (with pp = 1, every rank holds the same)
    and its step time on its slowest, which every stage waits for."""
    stages = [planned_memory(cfg, args, grid, ep, shape, precision, pp_rank) for pp_rank in range(grid.pp)]
    pp_rank = max(range(grid.pp), key=lambda rank: sum(stages[rank][0].values()))
    seconds = max((estimated_step_seconds(cfg, args, grid, ep, shape, precision, gpu, gpus_per_node, rank)
                   for rank in range(grid.pp)), key=lambda parts: sum(parts.values()))
    memory, live = stages[pp_rank]
    return PlannedLayout(grid, ep, args, pp_rank, memory, live, seconds)


def candidate_layouts(cfg, args, world_size: int, gpus_per_node: int, validate):
    """Every layout of `world_size` ranks that lesson 07's `validate` accepts, for the same global batch (the
    flags' sequences per step) and micro-batch size: each grid (tp within a node), ZeRO stage,
    recompute mode, sequence parallelism with tp, and with experts each ep that divides dp x cp.
    Pipelines run 1F1B, interleaved 1F1B over two chunks per rank, and the flags' schedule."""
    sequences = batch_shape(args, grid_from_args(args, world_size).dp).sequences_per_step
    divisors = [d for d in range(1, world_size + 1) if world_size % d == 0]
    for tp, pp, cp in itertools.product(divisors, repeat=3):
        if world_size % (tp * pp * cp) or tp > gpus_per_node:
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


def fitting_layouts(cfg, args, usable: float, precision, gpu: str, validate) -> list[PlannedLayout]:
    """Every candidate layout whose fullest rank fits in `usable` bytes, fastest first (the lighter
    one first when two tie)."""
    fitting = []
    for grid, ep, candidate_args, shape in candidate_layouts(cfg, args, args.gpus, args.gpus_per_node, validate):
        candidate = plan_layout(cfg, candidate_args, grid, ep, shape, precision, gpu, args.gpus_per_node)
        if candidate.peak_bytes <= usable:
            fitting.append(candidate)
    return sorted(fitting, key=lambda c: (sum(c.seconds.values()), c.peak_bytes))


def fastest_per_grid(fitting: list[PlannedLayout]) -> list[PlannedLayout]:
    """One layout per grid, its fastest ZeRO stage and recompute mode, in the order of `fitting`."""
    best = {}
    for candidate in fitting:
        best.setdefault(layout_name(candidate), candidate)
    return list(best.values())


# ============================================================================ configuration rules


def checked_plan_flags(args, validate, expert_degree):
    """(model, grid, ep, batch shape) of the flags, checked by lesson 07's own rules on --gpus
    ranks, or one `error:` line and exit 2."""
    try:
        if args.gpu not in GPUS:
            raise ConfigError(f"--gpu {args.gpu}: the plan knows {', '.join(GPUS)}; pick the closest and set its "
                              f"memory with --gpu-memory-gb")
        check_flag_ranges(args)
        if args.gpus < 1 or args.gpus_per_node < 1 or (args.gpu_memory_gb is not None and args.gpu_memory_gb <= 0):
            raise ConfigError("--gpus, --gpus-per-node and --gpu-memory-gb must be positive")
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
                        help="no training, no torchrun: print the model's states per GPU on 8 and 64 GPUs at "
                             "every ZeRO stage and precision policy (lesson 06's formula, data parallelism alone)")


def print_memory_plan(args, validate, expert_degree) -> None:
    """--plan: this layout's memory per rank, whether it fits, and the layouts that fit, fastest
    first. `validate` and `expert_degree`: lesson 07's rules and --ep's default, which 07 passes
    (the plan never loads 07: 07 loads the plan)."""
    cfg, grid, ep, shape = checked_plan_flags(args, validate, expert_degree)
    gpu = args.gpu
    # The plan is for the GPU: --dtype auto is bf16 there.
    precision = zero.precision_from_flags(args.dtype, args.reduce_dtype, torch.device("cuda"))
    capacity = (args.gpu_memory_gb if args.gpu_memory_gb is not None else GPUS[gpu].memory_gib) * GIB
    usable = capacity * (1 - PLAN_MARGIN)
    planned = plan_layout(cfg, args, grid, ep, shape, precision, gpu, args.gpus_per_node)
    print(f"memory plan: {model_name(args)} ({count_parameters(cfg)['total'] / 1e9:.2f} B parameters) on {args.gpus} x "
          f"{gpu} ({capacity / GIB:.0f} GiB each; planned to {1 - PLAN_MARGIN:.0%} of it: {usable / GIB:.1f} GiB)")
    schedule = (f"{args.schedule}" + (f" over {args.virtual_stages} virtual stages" if args.virtual_stages > 1 else "")
                + ", " if grid.pp > 1 else "")
    fp8_part = f"FP8 {args.fp8} matmuls, " if args.fp8 != "none" else ""
    print(f"layout: dp={grid.dp} x pp={grid.pp} x cp={grid.cp} x tp={grid.tp}, ep={ep}, {schedule}ZeRO-{args.zero_stage}, "
          f"recompute {args.recompute}, {fp8_part}weights {str(precision.param_dtype).removeprefix('torch.')}, "
          f"gradients {str(precision.reduce_dtype).removeprefix('torch.')}, "
          f"seq {shape.seq_len} x micro-batch {shape.micro_batch_size} x {shape.grad_accum} micro-batches x dp "
          f"{grid.dp} = {shape.tokens_per_step:,} tokens per step")
    if shape.seq_len != cfg.seq_len:
        print(f"note: {args.preset} is sized for --seq-len {cfg.seq_len}")
    print_planned_memory(planned, usable)
    print_peak_makeup(planned, cfg, shape, precision)
    by_mode = {mode: planned_activation_bytes(cfg, argparse.Namespace(**{**vars(args), "recompute": mode}), grid, ep,
                                              shape, precision, planned.pp_rank)[0]
               for mode in measurement.RECOMPUTE_MODES}
    print("activations by --recompute: " + ", ".join(f"{mode} {size / GIB:.2f} GiB" for mode, size in by_mode.items()))
    fitting = fitting_layouts(cfg, args, usable, precision, gpu, validate)
    print(f"\n{len(fitting)} layouts of {args.gpus} GPUs fit this batch ({shape.sequences_per_step} sequences of "
          f"{shape.seq_len} per step, micro-batch {shape.micro_batch_size}); each grid's fastest, fastest first, "
          f"by the estimate below:")
    print_layout_table(fastest_per_grid(fitting)[:args.plan_top])
    assumptions = plan_assumptions(gpu, args.gpus_per_node, args.fp8)
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


def print_peak_makeup(planned: PlannedLayout, cfg, shape, precision) -> None:
    """Which tensors the total counts, and when they are all alive at once."""
    loss = planned_loss_parts(cfg, planned.args, planned.grid, shape, precision, planned.pp_rank)
    parts = ["the model states", f"the kept activations of {planned.live_micro_batches} micro-batch"
             + ("es" if planned.live_micro_batches > 1 else "")]
    if loss:
        chunk = min(shape.micro_batch_size * shape.seq_len // planned.grid.cp,
                    loss_chunk_tokens(cfg.vocab_size // planned.grid.tp))
        parts.append(f"the loss's backward (the head's dW {loss['dW'] / GIB:.2f} GiB, dx {loss['dx'] / GIB:.2f} GiB, "
                     f"the logits of one chunk of {chunk} tokens {loss['chunk'] / GIB:.2f} GiB)")
    if planned.memory["gathered weights (ZeRO-3)"]:
        parts.append("ZeRO-3's gathered units")
    when = ("at the start of a micro-batch's backward, in the LM head" if loss else
            "when the schedule holds the most micro-batches (this stage holds no LM head)")
    print(f"the peak, {when}: " + ", ".join(parts) + ", and the communication buffers")


def print_layout_table(layouts: list[PlannedLayout]) -> None:
    print(f"  {'layout':<24}{'ZeRO':>5}  {'recompute':<10}{'GiB':>7}{'step s':>9}{'compute':>9}{'recomp':>8}"
          f"{'bubble':>8}{'comm':>8}")
    for layout in layouts:
        s = layout.seconds
        print(f"  {layout_name(layout):<24}{layout.args.zero_stage:>5}  {layout.args.recompute:<10}"
              f"{layout.peak_bytes / GIB:>7.1f}{sum(s.values()):>9.3f}{s['compute']:>9.3f}{s['recompute']:>8.3f}"
              f"{s['bubble']:>8.3f}{s['communication']:>8.3f}")


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
