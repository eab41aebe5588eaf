"""
Lesson 05 — expert parallelism in one file: mixture-of-experts with all-to-all token dispatch.

The problem. A mixture-of-experts (MoE) layer holds E feed-forward "experts" and sends each token
through only k of them: Mixtral-8x7B holds 46.7e9 parameters but multiplies each token through
12.9e9. The work per token stays small, the weights do not: in float32 with AdamW the experts of
Mixtral alone take 16 bytes x 45e9 = 720 GB, and data parallelism puts all of it on every rank.

The idea. The experts need not live together. Give each of ep ranks E/ep experts (a slice of dim 0
of the stacked expert weights) and send every token to the rank that holds its expert, then back:

      rank 0 (experts 0,1)                                          rank 1 (experts 2,3)
    tokens ─► router ─► sort by expert ─┬─ for experts 0,1 ──────────► stays
                                        └─ for experts 2,3 ── all-to-all ──► rank 1 runs them
    out ◄── weight, add per token ◄─────── results come back ── all-to-all ◄──┘

The ranks that share their experts this way are ranks that already hold different tokens and the
same dense weights: the dp x cp ranks (picotron_like/topology.py). Cut each dp x cp group into
consecutive ep groups; the ranks at the same place of every ep group hold the same experts and
form the expert-data-parallel (edp) group, over which expert gradients are summed, while dense
gradients are still summed over all of dp x cp.

Four steps, in the order this file builds them:
1. Local dispatch on one rank: sort the token-expert assignments by expert, run each expert on
   its contiguous run of rows (a loop, or one grouped matmul), multiply by the routing weight and
   add each result back at its token's row.
2. Expert parallelism: exchange the per-expert token counts, then the tokens, with an uneven
   all-to-all (lesson 04's, with split sizes); run the local experts; send results back. Backward
   is the same exchange reversed.
3. Gradients: expert gradients summed over edp, dense over dp x cp, both normalised as usual by
   the global target count and nothing else. The classic bug divides expert gradients by ep (or
   edp): they would be ep times too small. The gradient norm counts every parameter once.
4. Balancing across ranks: the auxiliary and z losses ride on the layer's output (model.py);
   the auxiliary-loss-free router bias moves with the load summed over every rank routing tokens.
Then composition with lessons 01-04: pipeline stages, context parallelism, and tensor parallelism,
which splits attention as lesson 02 does and every expert column/row (apply_tensor_parallel says
why that and not the tokens).

The price, per MoE layer and micro-batch on a rank that routes n tokens with k choices each (m =
k n assignments when dropless), h hidden, e bytes per element:
    memory      expert weights, gradients and AdamW states / ep: 16 x 3 h f E / ep bytes;
                activations per assignment (moe_layer_activation_bytes): the expert's SwiGLU on
                the r rows received, 16 f + 4 h bytes each, plus dispatch bookkeeping
    all-to-all  forward m rows out and r rows back (r: the rows that arrived for this rank's
                experts), backward the same again: 2 (m + r) h e bytes per rank, plus E int64
                counts; (ep - 1) / ep of it leaves the rank when the routing is balanced
    compute     unchanged per token; the slowest rank is the one whose experts got most tokens

Run it:
    torchrun --nproc_per_node=4 05_expert_parallel.py                       # tiny-moe, ep = 4, CPU ~30 s
    torchrun --nproc_per_node=4 05_expert_parallel.py --ep 2 --router sigmoid --bias-update-rate 1e-3
    torchrun --nproc_per_node=4 05_expert_parallel.py --cp 2 --ep 4 --aux-loss-coef 1e-2
    torchrun --nproc_per_node=4 05_expert_parallel.py --pp 2 --ep 2 --capacity-factor 1.25
    torchrun --nproc_per_node=4 05_expert_parallel.py --tp 2 --ep 2 --shared-experts 1

What to look for: the loss falls as on one device (the tests prove it, gradients and parameters
included); the all-to-all bytes and the activations equal their formulas evaluated on the run's
real routing counts; the tokens-per-expert table shows how unbalanced the router is, and the
expert memory per rank is 1/ep (1/(ep tp) with tensor parallelism).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import math
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from picotron_like import comm
from picotron_like.data import StepBatch
from picotron_like.metrics import (ActivationMeter, add_traffic, log0, log_compute_report, measured_memory, memory_table,
                                   predicted_activation_bytes, predicted_memory, tensor_bytes)
from picotron_like.model import GroupedExperts, Routing, count_parameters, is_expert_parameter, moe_layers
from picotron_like.pipeline_tools import is_transfer_batch
from picotron_like.topology import (ConfigError, GridShape, ProcessGrid, init_distributed, load_lesson, shutdown,
                                    validate_parallel_config)
from picotron_like.train import (StepResult, StepSettings, add_parallel_flags, add_training_flags, autocast_dtype,
                                 build_optimizer, plan_run, train)

data_parallel = load_lesson("01_data_parallel")
tensor_parallel = load_lesson("02_tensor_parallel")
pipeline_parallel = load_lesson("03_pipeline_parallel")
context_parallel = load_lesson("04_context_parallel")

# ============================================================================ the technique: local dispatch


@dataclass
class Dispatch:
    """A batch's kept token-expert assignments, sorted by expert (expert 0's rows first).

    token_rows [m]  the token each assignment belongs to (within an expert: in token order)
    weights    [m]  its combine weight
    counts     [E]  assignments per expert: the lengths of the runs in the sorted order
    """

    token_rows: torch.Tensor
    weights: torch.Tensor
    counts: torch.Tensor


def sort_by_expert(routing: Routing, n_experts: int) -> Dispatch:
    """Flatten the kept [n, k] choices and sort them by expert, stably: an expert then sees its
    tokens in token order, as the reference loop does. A dropped choice is not dispatched at all."""
    rows, slots = routing.kept.nonzero(as_tuple=True)
    expert_ids = routing.expert_ids[rows, slots]
    order = expert_ids.argsort(stable=True)
    return Dispatch(rows[order], routing.weights[rows, slots][order], torch.bincount(expert_ids, minlength=n_experts))


def looped_experts(x: torch.Tensor, counts: list[int], experts: GroupedExperts) -> torch.Tensor:
    """Rows x [m, h] sorted by expert, counts[e] rows for expert e: each expert on its run of rows."""
    return torch.cat([experts(rows, e) for e, rows in enumerate(x.split(counts))])


def grouped_experts(x: torch.Tensor, counts: list[int], experts: GroupedExperts) -> torch.Tensor:
    """The same, each of the three matmuls one grouped matmul over every expert at once.

    torch._grouped_mm(x, w, offs) multiplies rows offs[e-1]:offs[e] of x by w[e]; offsets are
    int32 and cumulative. It ignores autocast (cast by hand to the compute dtype); it wants row
    strides that are multiples of 16 bytes (hidden and ffn_hidden multiples of 4 in float32, of 8
    in bf16: grouped_mm_fits); its backward wants a dense incoming gradient, which it gets here
    (the weighted combine and SwiGLU's product are dense). Experts that received no row are left
    out of the call: on Blackwell (sm_100) the kernel has been reported to give such empty groups
    non-zero weight gradients, and NaNs after a few steps (pytorch issues 172439, 193633); left
    out, their weights get the exact zero gradient of an expert that saw no token.
    """
    dtype = torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else x.dtype
    used = [expert for expert, count in enumerate(counts) if count]     # host integers: no device sync
    offsets = torch.tensor([counts[e] for e in used], device=x.device).cumsum(0).to(torch.int32)

    def matmul(rows, weight):
        if len(used) < len(counts):
            weight = weight[used]
        return torch._grouped_mm(rows.to(dtype), weight.to(dtype).transpose(-2, -1), offs=offsets)

    if not used:    # no row at all: the loop's empty matmuls keep the weights in the graph for their hooks
        return looped_experts(x, counts, experts)
    hidden = F.silu(matmul(x, experts.gate_proj)) * matmul(x, experts.up_proj)
    return matmul(hidden, experts.down_proj)


def grouped_mm_fits(cfg, dtype: torch.dtype, tp: int = 1) -> bool:
    """Whether torch._grouped_mm exists here and accepts this model's row strides (each expert's
    inner width split over tp ranks: ffn_hidden / tp)."""
    element = torch.finfo(dtype).bits // 8
    return hasattr(torch, "_grouped_mm") and all(d * element % 16 == 0 for d in (cfg.hidden, cfg.ffn_hidden // tp))


def uses_grouped_mm(args, cfg, dtype: torch.dtype, tp: int = 1) -> bool:
    """--grouped-mm where it fits this model, its compute dtype and its tp split; looped otherwise."""
    return bool(cfg.n_experts) and args.grouped_mm and grouped_mm_fits(cfg, dtype, tp)


def combine(tokens: torch.Tensor, dispatch: Dispatch, expert_out: torch.Tensor) -> torch.Tensor:
    """Each token's output: the sum of its assignments' expert outputs times their weights."""
    weighted = expert_out * dispatch.weights[:, None].type_as(tokens)
    return torch.zeros_like(tokens).index_add(0, dispatch.token_rows, weighted.type_as(tokens))


def local_expert_compute(tokens: torch.Tensor, routing: Routing, experts: GroupedExperts,
                         run_experts=looped_experts) -> torch.Tensor:
    """MixtureOfExperts.expert_compute on one rank: permute, run, un-permute and weight."""
    dispatch = sort_by_expert(routing, experts.n_experts)
    expert_out = run_experts(tokens[dispatch.token_rows], dispatch.counts.tolist(), experts)
    return combine(tokens, dispatch, expert_out)


# ============================================================================ the technique: expert parallelism


@dataclass(frozen=True)
class ExpertParallel:
    """This rank's place among the ep ranks that share one copy of the experts."""

    group: object
    size: int
    rank: int

    @classmethod
    def from_grid(cls, grid: ProcessGrid) -> "ExpertParallel":
        return cls(grid.ep_group, grid.ep_size, grid.ep_rank)


def shard_experts(model: nn.Module, ep: ExpertParallel, tp_group=None) -> nn.Module:
    """Keep this rank's E/ep experts: rows [rank E/ep, (rank + 1) E/ep) of dim 0 of every stacked
    expert weight, cut from the reference tensor, so the run starts from the reference's values.
    With tensor parallelism, of each of them this tp rank's slice of the inner width, as lesson 02
    splits a SwiGLU: gate and up by rows (dim 1), down by columns (dim 2)."""
    for layer in moe_layers(model):
        local = layer.experts.n_experts // ep.size
        for name, tp_dim in (("gate_proj", 1), ("up_proj", 1), ("down_proj", 2)):
            mine = getattr(layer.experts, name).detach()[ep.rank * local:(ep.rank + 1) * local]
            setattr(layer.experts, name, nn.Parameter(mine.clone()) if tp_group is None
                    else tensor_parallel.take_shard(mine, tp_dim, tp_group))
    return model


def exchange_counts(counts: torch.Tensor, ep: ExpertParallel) -> torch.Tensor:
    """counts [E]: this rank's assignments per expert (expert e lives on rank e // (E/ep)).
    Returns [ep, E/ep]: row s holds how many rows rank s will send for each of this rank's experts.
    The split sizes of the token all-to-all must be known before it starts, hence this first,
    small all-to-all (and, on a GPU, a wait for it: the sizes become Python integers)."""
    received = torch.empty_like(counts)
    comm.call(dist.all_to_all_single, received, counts, group=ep.group)
    return received.view(ep.size, -1)


def expert_parallel_compute(tokens: torch.Tensor, routing: Routing, experts: GroupedExperts, ep: ExpertParallel,
                            run_experts=looped_experts) -> torch.Tensor:
    """MixtureOfExperts.expert_compute across the ep group; `experts` holds this rank's E/ep.

    Sorted by global expert id, the assignments are already grouped by destination rank (rank j
    holds a contiguous block of experts). What arrives is grouped by source rank, then by expert;
    the local experts want it grouped by expert: one permutation there, its inverse on the way back.
    """
    n_local = experts.n_experts
    dispatch = sort_by_expert(routing, n_local * ep.size)
    arriving = exchange_counts(dispatch.counts, ep)                          # [source, local expert]
    # The all-to-all takes its split sizes as host integers: one read of each count table.
    sent_table, arrived_table = dispatch.counts.view(ep.size, n_local).tolist(), arriving.tolist()
    send_splits, receive_splits = [sum(row) for row in sent_table], [sum(row) for row in arrived_table]
    received = context_parallel.AllToAll.apply(tokens[dispatch.token_rows], ep.group, receive_splits, send_splits)
    # Number each arrived row's (source, expert) block expert-major; a stable sort by that number
    # regroups the rows by expert and keeps each block's rows in order.
    block_key = torch.arange(n_local, device=tokens.device) * ep.size + torch.arange(ep.size, device=tokens.device)[:, None]
    by_expert = block_key.flatten().repeat_interleave(arriving.flatten()).argsort(stable=True)
    expert_out = run_experts(received[by_expert], [sum(column) for column in zip(*arrived_table)], experts)
    returned = context_parallel.AllToAll.apply(expert_out[by_expert.argsort()], ep.group, send_splits,
                                               receive_splits)
    return combine(tokens, dispatch, returned)


def tensor_parallel_experts(x: torch.Tensor, counts: list[int], experts: GroupedExperts, run_experts,
                            group) -> torch.Tensor:
    """run_experts on this tp rank's slice of every expert's inner width, between lesson 02's f
    (the rows' gradient is each slice's partial sum: all-reduced in backward) and g (so is the
    output: all-reduced in forward). Outside them everything is whole on every tp rank."""
    x = tensor_parallel.CopyToTensorParallelRegion.apply(x, group)
    return tensor_parallel.ReduceFromTensorParallelRegion.apply(run_experts(x, counts, experts), group)


def apply_expert_parallel(model: nn.Module, ep: ExpertParallel, grouped: bool, tp_group=None) -> nn.Module:
    """Shard the experts and plug the dispatch into every MoE layer's expert_compute seam. At ep = 1
    the local dispatch runs: no all-to-all over a group of one."""
    run_experts = grouped_experts if grouped else looped_experts
    if tp_group is not None:
        run_experts = functools.partial(tensor_parallel_experts, run_experts=run_experts, group=tp_group)
    compute = (functools.partial(local_expert_compute, run_experts=run_experts) if ep.size == 1 else
               functools.partial(expert_parallel_compute, ep=ep, run_experts=run_experts))
    for layer in moe_layers(shard_experts(model, ep, tp_group)):
        layer.expert_compute = compute
    return model


# ============================================================================ the technique: gradients and balancing


class ExpertDataParallel(nn.Module):
    """Lesson 01's bucketed gradient sum, twice: dense parameters over dp x cp, experts over edp.

    A dense weight is replicated on every dp x cp rank and each computed its gradient from its own
    tokens: sum over dp x cp, as lesson 04 does. An expert weight lives on one rank of each ep
    group, and its gradient there already holds the contribution of every token the ep group
    routed to it; the other ep groups routed other tokens to their copy: sum over edp. Every
    rank's loss share is already divided by the global target count (the batch's n_targets), so
    both sums are plain sums. Dividing the expert sum by anything (ep, edp, the tokens the expert
    saw) is the classic expert-parallel bug: the gradient is then ep times off the reference.
    """

    def __init__(self, module: nn.Module, grid: ProcessGrid, bucket_bytes: int):
        super().__init__()
        self.module = module
        self.dp_group = grid.dp_cp_group       # the step sums the loss over every rank holding other tokens
        named = list(module.named_parameters())
        dense = [p for name, p in named if not is_expert_parameter(name)]
        expert = [p for name, p in named if is_expert_parameter(name)]
        # A tuple, not submodules: the parameters belong to `module`; the wrappers only reduce them.
        self.reducers = tuple(data_parallel.BucketedDataParallel(nn.ParameterList(params), group, bucket_bytes)
                              for params, group in ((dense, grid.dp_cp_group), (expert, grid.edp_group)) if params)
        self.expert_parameters = set(expert)

    @property
    def require_backward_grad_sync(self) -> bool:
        return self.reducers[0].require_backward_grad_sync

    @require_backward_grad_sync.setter
    def require_backward_grad_sync(self, value: bool) -> None:
        for reducer in self.reducers:
            reducer.require_backward_grad_sync = value

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def finish_gradient_synchronization(self):
        for reducer in self.reducers:
            reducer.finish_gradient_synchronization()

    def zero_grad(self, set_to_none: bool = False):
        for reducer in self.reducers:
            reducer.zero_grad()


def step_settings(parts, grid: ProcessGrid, device, compute_dtype, max_grad_norm: float) -> StepSettings:
    """The gradient norm counts every parameter once: each ep rank adds the squares of its own
    experts, the dense parameters (identical on every rank after the dp x cp sum) count on ep rank
    0 only, a tp-replicated one on tp rank 0 only (lesson 03's rule), and the sum runs over the tp
    and ep groups (a pipeline's step adds the pp group itself)."""
    tp_groups, tp_counts = pipeline_parallel.norm_settings(grid)
    groups = (*tp_groups, *((grid.ep_group,) if grid.ep_size > 1 else ()))
    if not groups:
        return StepSettings(device, compute_dtype, max_grad_norm)
    experts = set().union(*(part.expert_parameters for part in parts))
    ep_rank = grid.ep_rank

    def counts_toward_norm(p) -> bool:
        return (ep_rank == 0 or p in experts) and (tp_counts is None or tp_counts(p))

    return StepSettings(device, compute_dtype, max_grad_norm, groups, counts_toward_norm)


def sum_over_group(counts: torch.Tensor, group) -> torch.Tensor:
    """MixtureOfExperts.whole_sequence_counts under context parallelism: the choice counts of
    each sequence's chunks, summed over the cp ranks holding them (constants: no autograd)."""
    comm.call(dist.all_reduce, counts, group=group)
    return counts


def prepare_balancing(model: nn.Module, grid: ProcessGrid, sequences_per_step: int) -> nn.Module:
    """Every MoE layer sees part of the step's batch: its balancing losses become shares of the
    step's means (sequences_per_step), and with cp > 1 each rank holds 1/cp of every sequence,
    whose choice counts the aux loss needs whole (model.py's seam does the rest)."""
    for layer in moe_layers(model):
        layer.sequences_per_step = sequences_per_step
        if grid.cp_size > 1:
            layer.sequence_shards = grid.cp_size
            layer.whole_sequence_counts = functools.partial(sum_over_group, group=grid.cp_group)
    return model


@torch.no_grad()
def update_router_biases(parts, group, rate: float) -> None:
    """Auxiliary-loss-free balancing after the optimizer step: every rank that routed different
    tokens must move the bias by the same total load, or the replicas of the router drift apart."""
    for layer in (layer for part in parts for layer in moe_layers(part)):
        load = layer.expert_load.clone()
        comm.call(dist.all_reduce, load, group=group)
        layer.update_router_bias(rate, load)


def train_step(model_or_pipeline, optimizer, batch: StepBatch, settings: StepSettings,
               bias_update_rate: float = 0.0, balancing_log=None) -> StepResult:
    """Lesson 04's step (lesson 01's, or 03's with a pipeline): the dispatch lives inside the
    layers and the gradient sums inside the wrappers. After the optimizer step, the router biases
    move (auxiliary-loss-free balancing); the aux and z losses of the step go to the log."""
    result = context_parallel.train_step(model_or_pipeline, optimizer, batch, settings)
    parts = getattr(model_or_pipeline, "chunks", [model_or_pipeline])
    # A step the shared loop skipped (non-finite gradient norm) moves nothing, the biases included;
    # the norm is global, so every rank makes the same choice and the loads' all-reduce stays matched.
    if bias_update_rate and math.isfinite(result.grad_norm):
        update_router_biases([part.module for part in parts], parts[0].dp_group, bias_update_rate)
    if balancing_log is None:
        return result
    return replace(result, extra=balancing_log.step_values())


def evaluate(model_or_pipeline, batch: StepBatch, settings: StepSettings) -> float:
    """Lesson 04's forward-only loss (01's, or 03's with a pipeline): the language-model loss alone.
    The aux and z balancing losses are training objectives that only backward sees (attached to the
    layers' outputs), so they are not part of the validation loss. Routing adds each forward's
    choices to expert_load; those of validation tokens are taken back out, or the next router-bias
    update would balance on tokens the step never trained on."""
    with router_loads_kept(getattr(model_or_pipeline, "chunks", [model_or_pipeline])):
        return context_parallel.evaluate(model_or_pipeline, batch, settings)


@contextlib.contextmanager
def router_loads_kept(parts):
    """The parts' MoE layers' expert_load as it was before the block: what validation routes is not
    what the step trained on."""
    layers = [layer for part in parts for layer in moe_layers(part)]
    loads = [layer.expert_load.clone() for layer in layers]
    yield
    for layer, load in zip(layers, loads):
        layer.expert_load.copy_(load)


# ============================================================================ the technique: composing with lessons 01-04


def apply_tensor_parallel(model: nn.Module, group) -> nn.Module:
    """Lesson 02's split of the dense layers (embedding, attention, final norm, head), and for the
    experts a choice: each expert split column/row over the tp ranks (shard_experts,
    tensor_parallel_experts) rather than the tokens split among them.

    Why: without sequence parallelism the tp ranks hold the same tokens. Splitting every expert
    keeps one routing for all of them and divides the experts' weights, gradients, AdamW states
    and FLOPs by tp, at the price a dense MLP pays: an all-reduce of the outputs (here of the rows
    the experts received) each way. Splitting the tokens instead would keep every expert whole on
    every tp rank, the largest weights of the model tp times over, and gather the outputs back.
    """
    return tensor_parallel.apply_tensor_parallel(model, group, sequence_parallel=False, split_mlp=split_moe_mlp)


def split_moe_mlp(block, group, norm, column, row) -> None:
    """Lesson 02's `split_mlp` for an MoE block. The router, the dispatch and the combine run whole
    on every tp rank, so they get the reference's gradients as they are: f and g wrap the experts
    alone (apply_expert_parallel), the MoE's norm stays a plain RMSNorm (a TensorParallelRMSNorm's
    f would add up the tp ranks' identical gradients), and a shared expert, split like a dense
    MLP, gets its own f in front."""
    tp = tensor_parallel
    tp.replicated(block.mlp_norm.weight)
    tp.replicated(block.mlp.router.weight)
    if block.mlp.shared_expert is not None:
        tp.parallelize_mlp(block.mlp.shared_expert, group, column, row)
        block.mlp.shared_expert.register_forward_pre_hook(
            lambda module, args: (tp.CopyToTensorParallelRegion.apply(args[0], group),))       # f


def build_model(cfg, seed: int, grid: ProcessGrid, device, grouped: bool, sequences_per_step: int,
                bucket_bytes: int = 2**20, virtual_stages: int = 1) -> list[nn.Module]:
    """This rank's parts (build_parts), their gradients summed over dp x cp and edp."""
    return [ExpertDataParallel(part, grid, bucket_bytes)
            for part in build_parts(cfg, seed, grid, device, grouped, sequences_per_step,
                                    virtual_stages=virtual_stages)]


def build_parts(cfg, seed: int, grid: ProcessGrid, device, grouped: bool, sequences_per_step: int,
                zigzag: bool = True, ring_kernel: str = "fused", virtual_stages: int = 1) -> list[nn.Module]:
    """This rank's parts: reference GPT (or its pipeline stage or stages, lesson 03) -> dense layers split
    over tp (lesson 02) -> context-parallel attention (lesson 04) -> experts sharded over ep (and
    tp) and dispatched -> balancing made global. Unwrapped: lesson 06 shards them with ZeRO."""
    ep = ExpertParallel.from_grid(grid)
    cp = context_parallel.ContextParallel.from_grid(grid, zigzag, ring_kernel) if grid.cp_size > 1 else None
    tp_group = grid.tp_group if grid.tp_size > 1 else None
    parts = context_parallel.build_parts(cfg, seed, grid, device, cp, split_tensors=apply_tensor_parallel,
                                         virtual_stages=virtual_stages)
    parts = [apply_expert_parallel(part, ep, grouped, tp_group) for part in parts]
    return [prepare_balancing(part, grid, sequences_per_step) for part in parts]


# ============================================================================ configuration rules


# flag -> the GPTConfig field it sets; a flag left out keeps the preset's value
MOE_FLAGS = {"router": "router", "shared_experts": "n_shared_experts", "aux_loss_coef": "aux_loss_coef",
             "z_loss_coef": "z_loss_coef", "capacity_factor": "capacity_factor"}


def add_moe_flags(parser) -> None:
    """--ep, the router and the balancing flags, which lesson 07 takes too (moe_config applies them).
    The model's flags default to the preset's values (tiny-moe: softmax, no shared expert, no
    balancing loss, dropless), so a preset stays what it says."""
    parser.add_argument("--ep", type=int, default=None,
                        help="expert-parallel degree, drawn from the dp x cp ranks; default: dp * cp")
    unset = argparse.SUPPRESS
    parser.add_argument("--router", choices=("softmax", "sigmoid"), default=unset,
                        help="softmax top-k (Mixtral) or sigmoid scores (DeepSeek-V3); default: the preset's")
    parser.add_argument("--shared-experts", type=int, default=unset,
                        help="width, in experts, of a shared expert (0: none); default: the preset's")
    parser.add_argument("--aux-loss-coef", type=float, default=unset,
                        help="sequence-wise auxiliary loss (0: off); default: the preset's")
    parser.add_argument("--z-loss-coef", type=float, default=unset,
                        help="router z-loss, softmax router (0: off); default: the preset's")
    parser.add_argument("--capacity-factor", type=float, default=unset,
                        help="tokens per expert per sequence: ceil(F k T / E); default: the preset's (dropless)")
    parser.add_argument("--bias-update-rate", type=float, default=0.0,
                        help="auxiliary-loss-free balancing: router bias step per optimizer step (0: off)")
    parser.add_argument("--grouped-mm", action=argparse.BooleanOptionalAction, default=True,
                        help="run the experts as grouped matmuls (torch._grouped_mm) where available")


def moe_config(cfg, args):
    """The preset with the MoE flags that were given applied (GPTConfig checks their ranges and
    their meaning on a dense preset: a ValueError, which plan_run prints as one error line)."""
    return replace(cfg, **{field: getattr(args, flag) for flag, field in MOE_FLAGS.items() if hasattr(args, flag)})


def validate_expert_parallel(grid: GridShape, world_size: int, cfg, seq_len: int, ep: int, schedule: str = "1f1b",
                             n_micro: int = 1, bias_update_rate: float = 0.0, sequence_parallel: bool = False,
                             virtual_stages: int = 1) -> None:
    """Every rule before any process group: the grid's, ep's, and what is not composed yet."""
    validate_parallel_config(grid, world_size, cfg, seq_len, zigzag=True)
    problems = []
    if not cfg.n_experts:
        problems.append("the model has no experts: lesson 05 needs a mixture-of-experts preset; use --preset tiny-moe")
    elif cfg.n_experts % ep:
        problems.append(f"n_experts={cfg.n_experts} is not divisible by --ep {ep}: each ep rank holds "
                        f"n_experts/ep whole experts; pick an ep that divides {cfg.n_experts}")
    if ep < 1 or (grid.dp * grid.cp) % ep:
        problems.append(f"--ep {ep} does not divide dp*cp = {grid.dp}*{grid.cp} = {grid.dp * grid.cp}: the ep "
                        f"ranks are drawn from the dp x cp ranks; pick an ep that divides {grid.dp * grid.cp}")
    if sequence_parallel:
        problems.append("--sequence-parallel with experts is not composed: the experts are split over tp for "
                        "tokens every tp rank holds whole; drop --sequence-parallel")
    if cfg.n_experts and cfg.capacity_factor is not None and grid.cp > 1:
        problems.append(f"--capacity-factor with --cp {grid.cp} is not supported: capacity is counted per "
                        f"sequence in token order, which would need a prefix sum across the cp chunks; use --cp 1 "
                        f"or drop --capacity-factor")
    if not bias_update_rate >= 0:
        problems.append(f"--bias-update-rate {bias_update_rate} must be 0 (off) or positive")
    if problems:
        raise ConfigError("bad parallel configuration:\n  - " + "\n  - ".join(problems))
    # at pp = 1 too: lesson 03 refuses its interleaving flags there instead of ignoring them
    pipeline_parallel.validate_pipeline_config(grid, world_size, cfg, schedule, virtual_stages, n_micro)


def validate(cfg, grid: GridShape, shape, args, world_size: int) -> None:
    ep = args.ep if args.ep is not None else grid.dp * grid.cp
    validate_expert_parallel(grid, world_size, cfg, shape.seq_len, ep, args.schedule,
                             shape.grad_accum, args.bias_update_rate, args.sequence_parallel, args.virtual_stages)


# ============================================================================ measuring the three challenges


class BalancingLog:
    """The step's enabled balancing losses (aux, z), each summed over layers, micro-batches and
    ranks, for the log line; a disabled one is neither logged nor reduced.

    A forward hook reads each MoE layer's read-outs (last_aux_loss, last_z_loss) after every
    forward; step_values sums them over the ranks that hold other tokens (and other layers)."""

    def __init__(self, parts, groups):
        layers = [layer for part in parts for layer in moe_layers(part)]
        self.names = [name for name, attribute in (("aux", "aux_loss_coef"), ("z", "z_loss_coef"))
                      if any(getattr(layer, attribute) for layer in layers)]
        self.groups, self.totals = groups, torch.zeros(len(self.names))
        for layer in layers if self.names else ():
            layer.register_forward_hook(self._read)

    def _read(self, layer, inputs, output):
        # Lesson 07's full recomputation runs the layer again inside backward, but checkpoint stops
        # once the last tensor backward needs is rebuilt, inside the layer: this hook never fires then.
        if not layer.training:      # a validation forward: not part of any step's objective
            return
        values = {"aux": layer.last_aux_loss, "z": layer.last_z_loss}
        self.totals += torch.stack([values[name] for name in self.names]).detach().cpu()

    def step_values(self) -> dict:
        if not self.names:
            return {}
        totals, self.totals = self.totals, torch.zeros(len(self.names))
        for group in self.groups:
            comm.call(dist.all_reduce, totals, group=group)
        return dict(zip(self.names, totals.tolist()))


@dataclass(frozen=True)
class RoutedCall:
    """One forward of one MoE layer, as the expert_compute seam saw it."""

    layer: int              # index into RoutingMeter.layers (this rank's MoE layers, part by part)
    micro_batch: int        # the layer's forward count since the meter was entered
    counts: torch.Tensor    # [E] kept assignments per (global) expert (on the CPU once the meter is left)
    dropped: int            # assignments dropped by capacity


class RoutingMeter:
    """Every MoE forward's routing counts while entered, read by a wrapper around whatever
    dispatch is plugged into the expert_compute seam: the technique counts nothing itself. The
    counts stay on the rank's device while training runs (no host synchronisation per layer) and
    move to the CPU once, when the meter is left."""

    def __init__(self, parts):
        self.layers = [layer for part in parts for layer in moe_layers(part)]
        self.part_of = [index for index, part in enumerate(parts) for _ in moe_layers(part)]
        self.calls: list[RoutedCall] = []
        self._forwards = [0] * len(self.layers)     # per layer: its forwards recorded so far

    def _recording(self, index, compute):
        def recorded(tokens, routing, experts):
            if not self.layers[index].training:     # validation: its traffic is not the steps' either
                return compute(tokens, routing, experts)
            counts = torch.bincount(routing.expert_ids[routing.kept], minlength=self.layers[index].n_experts)
            self.calls.append(RoutedCall(index, self._forwards[index], counts, (~routing.kept).sum()))
            self._forwards[index] += 1
            return compute(tokens, routing, experts)
        return recorded

    def __enter__(self):
        self._computes = [layer.expert_compute for layer in self.layers]
        for index, layer in enumerate(self.layers):
            layer.expert_compute = self._recording(index, layer.expert_compute)
        return self

    def __exit__(self, *exc):
        for layer, compute in zip(self.layers, self._computes):
            layer.expert_compute = compute
        self.calls = [replace(call, counts=call.counts.cpu(), dropped=int(call.dropped)) for call in self.calls]
        return False


def rows_sent_and_received(meter: RoutingMeter, ep: ExpertParallel) -> tuple[list[int], list[int]]:
    """Per recorded call: m, the assignments this rank dispatched (its kept choices), and r, the
    rows that arrived for its own experts from every ep rank (r = m at ep = 1). The counts are
    all-gathered over the ep group, whose ranks run the same calls in the same order."""
    counts = torch.stack([call.counts for call in meter.calls]).to(torch.int64)      # [calls, E]
    sent = counts.sum(dim=1)
    if ep.size == 1:
        return sent.tolist(), sent.tolist()
    everyone = torch.empty(ep.size * counts.shape[0], counts.shape[1], dtype=torch.int64)
    comm.call(comm.all_gather_single, everyone, counts, group=ep.group)
    for_my_experts = everyone.view(ep.size, *counts.shape).chunk(ep.size, dim=2)[ep.rank]
    return sent.tolist(), for_my_experts.sum(dim=(0, 2)).tolist()


def moe_layer_activation_bytes(cfg, tokens: int, sequences: int, sent: int, received: int, ep: int,
                               grouped: bool, tp: int = 1, element_bytes: int = 4) -> int:
    """Bytes autograd keeps for backward of one MoE layer on one micro-batch of one rank, with
    this file's dispatch (DESIGN rule 9; lesson 07's memory plan uses it).

    The routing decides it: of the micro-batch's n = `tokens` tokens (in `sequences` sequences),
    m = `sent` kept assignments leave for the experts and r = `received` rows arrive for this
    rank's experts (r = m at ep = 1). So the prediction takes a real step's counts as input
    (RoutingMeter, rows_sent_and_received). The layer's input, the norm's output that the router
    keeps, belongs to the dense formula. In bytes, e = `element_bytes` for the tensors in the
    compute dtype (4 in float32, 2 under bf16; the router computes in float32 whatever the dtype):

      per token      the router's scores (softmax or sigmoid output)                  4E
                     the top-k sort's int64 indices (expert_ids are a view of them)    8E
                     the chosen scores and their sum (weights = chosen / sum)         4k + 4
                     capacity: the bool mask of kept choices (weights * kept)          k
                     sigmoid router with the aux loss: the scores' row sums            4
                     z-loss: the router logits and their logsumexp                    4E + 4
                     shared expert: SwiGLU's gate, silu(gate), up, product            4e f_shared / tp
      per sequence   aux loss: f_i                                                    4E
      per m          int64 (token, choice) pairs 16, their order by expert 8, the
                     permuted token rows 8; the combine weight e                      32 + e
                     the expert output back at the token's rank, and weighted         2e h
      per r          the expert's input row; SwiGLU's gate, silu(gate), up, product   e (h + 4f / tp)
                     ep > 1: the permutations into and out of expert order, int64     16
      grouped        the int32 offsets of the rank's E/ep experts                     4E/ep
    With tp > 1 each tp rank holds its 1/tp slice of every expert's inner width (f / tp), and
    everything else whole.
    """
    E, k, h, f = cfg.n_experts, cfg.experts_per_token, cfg.hidden, cfg.ffn_hidden // tp
    e = element_bytes
    per_token = 12 * E + 4 * k + 4 + 4 * e * cfg.n_shared_experts * f
    per_token += (k if cfg.capacity_factor is not None else 0) + (4 * E + 4 if cfg.z_loss_coef else 0)
    per_token += 4 if cfg.router == "sigmoid" and cfg.aux_loss_coef else 0
    per_sequence = 4 * E if cfg.aux_loss_coef else 0
    per_received = e * (h + 4 * f) + (16 if ep > 1 else 0)
    offsets = 4 * E // ep if grouped else 0
    return tokens * per_token + sequences * per_sequence + sent * (32 + e + 2 * e * h) + received * per_received + offsets


def moe_layer_bytes_over_dense(cfg, tokens: int, sequences: int, sent: int, received: int, ep: int,
                               grouped: bool, tp: int = 1, element_bytes: int = 4) -> int:
    """What one MoE layer adds to the dense formula, which counts a dense SwiGLU in its place
    (gate, up, silu(gate) and their product: 4 f / tp elements per token)."""
    return (moe_layer_activation_bytes(cfg, tokens, sequences, sent, received, ep, grouped, tp, element_bytes)
            - 4 * element_bytes * cfg.ffn_hidden // tp * tokens)


def dense_activation_bytes(cfg, micro_batch: int, seq_len: int, cp: int, tp: int, stage=None, cp_mode: str = "ring",
                           sequence_parallel: bool = False) -> int:
    """One micro-batch of this rank's model or pipeline stage with a dense MLP: the reference
    formula, lesson 02's with tp > 1, lesson 03's for a stage, lesson 04's when context-parallel
    attention runs (cp > 1; this lesson's is the ring, lesson 07 also asks for Ulysses)."""
    if cp > 1:
        return context_parallel.predicted_cp_activation_bytes(cfg, micro_batch, seq_len, cp, cp_mode, tp=tp,
                                                              sequence_parallel=sequence_parallel, stage=stage)
    if stage is not None:
        return pipeline_parallel.predicted_chunk_activation_bytes(stage, cfg, micro_batch, seq_len, tp,
                                                                  sequence_parallel)
    if tp > 1:
        return tensor_parallel.predicted_tp_activation_bytes(cfg, micro_batch, seq_len, tp, sequence_parallel)
    return predicted_activation_bytes(cfg, micro_batch, seq_len)


def activation_bytes_by_micro_batch(parts, pipeline, cfg, shape, cp: int, meter: RoutingMeter, ep: ExpertParallel,
                                    grouped: bool, tp: int = 1, dense=None, element_bytes: int = 4) -> dict:
    """This rank's activations per (part, micro-batch) of the metered step: the dense formula
    with each MoE layer's SwiGLU replaced by moe_layer_activation_bytes on that layer's counts. `dense(stage)` gives a part's dense bytes
    (default: dense_activation_bytes) and `element_bytes` the rows' dtype: lesson 07 asks for its
    recompute modes and bf16 that way."""
    micro, tokens = shape.micro_batch_size, shape.micro_batch_size * shape.seq_len // cp
    dense = dense or functools.partial(dense_activation_bytes, cfg, micro, shape.seq_len, cp, tp)
    sizes = {}
    for part_index, part in enumerate(parts):
        part_bytes = dense(part.module if pipeline is not None else None)
        for micro_batch in range(shape.grad_accum):
            sizes[(part_index, micro_batch)] = part_bytes
    for call, sent, received in zip(meter.calls, *rows_sent_and_received(meter, ep)):
        sizes[(meter.part_of[call.layer], call.micro_batch)] += moe_layer_bytes_over_dense(
            cfg, tokens, micro, sent, received, ep.size, grouped, tp, element_bytes)
    return sizes


def schedule_peak(sizes: dict, pipeline) -> int:
    """The most bytes of (part, micro-batch) activations alive at once: the largest micro-batch
    without a pipeline, lesson 03's live micro-batches with one."""
    if pipeline is None:
        return max(sizes.values())
    live = peak = 0
    for step in pipeline.program:
        if not is_transfer_batch(step):
            live += sizes[(step.chunk, step.micro_batch)] * (1 if step.kind == "F" else -1)
            peak = max(peak, live)
    return peak


def predicted_peak_activation_bytes(parts, pipeline, cfg, shape, cp: int, meter: RoutingMeter, ep: ExpertParallel,
                                    grouped: bool, tp: int = 1) -> int:
    """This rank's activations at their peak in the metered step (float32)."""
    return schedule_peak(activation_bytes_by_micro_batch(parts, pipeline, cfg, shape, cp, meter, ep, grouped, tp),
                         pipeline)


def expert_memory_bytes(cfg, ep: int, n_layers: int, tp: int = 1) -> int:
    """Weights of this rank's experts: n_layers x 3 h f E / (ep tp) float32 parameters."""
    return 4 * n_layers * 3 * cfg.hidden * cfg.ffn_hidden * cfg.n_experts // (ep * tp)


def predicted_routed_traffic(meter: RoutingMeter, ep: ExpertParallel, tp: int, hidden: int,
                             element_bytes: int, forward_only: bool = False) -> dict:
    """The bytes that depend on the routing, from the counts of every recorded call: the ep
    all-to-all, 2 (m + r) h e + 8 E (m rows out and r back in forward, the same reversed in
    backward, and the E int64 counts), and with tp > 1 the experts' g (r h e, forward) and f
    (r h float32 gradients, backward). `forward_only`: the forward's share, (m + r) h e + 8 E
    and g's r h e (lesson 07's recomputed forward)."""
    sent, received = rows_sent_and_received(meter, ep)
    passes = 1 if forward_only else 2
    predicted = {}
    if ep.size > 1:
        n_experts = meter.layers[0].n_experts
        predicted[("all_to_all_single", "ep")] = sum(passes * (m + r) * hidden * element_bytes + 8 * n_experts
                                                     for m, r in zip(sent, received))
    if tp > 1:
        predicted[("all_reduce", "tp")] = sum(received) * hidden * (element_bytes + (0 if forward_only else 4))
    return predicted


def log_routing(meter: RoutingMeter, group) -> None:
    counts = torch.zeros(len(meter.layers), meter.layers[0].n_experts, dtype=torch.int64)
    dropped = torch.zeros(1, dtype=torch.int64)
    for call in meter.calls:
        counts[call.layer] += call.counts
        dropped += call.dropped
    comm.call(dist.all_reduce, counts, group=group)
    comm.call(dist.all_reduce, dropped, group=group)
    log0("\n== routing of one step (assignments per expert, summed over every rank routing other tokens) ==")
    log0(f"{'layer':<8}{'min':>8}{'mean':>9}{'max':>8}{'max/mean':>10}")
    for index, row in enumerate(counts.float()):
        log0(f"{index:<8}{row.min():>8.0f}{row.mean():>9.1f}{row.max():>8.0f}{row.max() / row.mean():>10.2f}")
    log0(f"assignments dropped by capacity: {int(dropped)}")


def expert_layer_traffic(cfg, shape, grid: ProcessGrid, n_layers: int, compute_dtype) -> dict:
    """What experts change inside the layers of a dense prediction, routing aside
    (predicted_routed_traffic): the cp sum of the auxiliary loss's int64 counts per sequence, and,
    with tp > 1 and no shared expert, the dense MLP's f and g taken out (an MoE layer's are its
    experts', or its shared expert's, as many as a dense MLP's). Lesson 06 adds it to its own."""
    extra = []
    if grid.cp_size > 1 and cfg.aux_loss_coef:
        extra.append({("all_reduce", "cp"): 8 * cfg.n_experts * shape.micro_batch_size * n_layers * shape.grad_accum})
    if grid.tp_size > 1 and not cfg.n_shared_experts:
        rows = shape.micro_batch_size * shape.seq_len // grid.cp_size * shape.grad_accum * n_layers
        extra.append({("all_reduce", "tp"): -rows * cfg.hidden * (torch.finfo(compute_dtype).bits // 8 + 4)})
    return add_traffic(*extra)


def predicted_step_traffic(parts, pipeline, cfg, shape, grid: ProcessGrid, compute_dtype,
                           bias_update_rate: float) -> dict:
    """Every collective of a step but the routing-dependent ones (predicted_routed_traffic): lesson
    04's prediction (cp ring, tp, pp, the gradient sum, loss and norm scalars) with the expert
    gradients moved from dp x cp to edp, the ep norm scalar, the enabled aux and z log values, the
    router loads of auxiliary-loss-free balancing, and expert_layer_traffic."""
    predicted = context_parallel.predicted_step_traffic(parts, pipeline, cfg, shape, grid, "ring", False,
                                                        compute_dtype)
    expert_bytes = 4 * sum(p.numel() for part in parts for p in part.expert_parameters)
    n_layers = sum(len(part.module.layers) for part in parts)
    extra = [{("all_reduce", "dp_cp"): -expert_bytes, ("all_reduce", "edp"): expert_bytes},
             expert_layer_traffic(cfg, shape, grid, n_layers, compute_dtype),
             balancing_traffic(cfg, n_layers, pipeline is not None, bias_update_rate)]
    if grid.ep_size > 1:
        extra.append({("all_reduce", "ep"): 4})
    return add_traffic(predicted, *extra)


def balancing_traffic(cfg, n_layers: int, pipelined: bool, bias_update_rate: float) -> dict:
    """The step's balancing bookkeeping: BalancingLog's enabled values (aux, z: one float each)
    summed over dp x cp, and over pp when `pipelined`; with auxiliary-loss-free balancing, the
    router loads, E floats per MoE layer, summed over dp x cp."""
    log_values = bool(cfg.aux_loss_coef) + bool(cfg.z_loss_coef)
    traffic = [{("all_reduce", "dp_cp"): 4 * log_values}] if log_values else []
    if pipelined and log_values:
        traffic.append({("all_reduce", "pp"): 4 * log_values})
    if bias_update_rate:
        traffic.append({("all_reduce", "dp_cp"): 4 * cfg.n_experts * n_layers})
    return add_traffic(*traffic)


def report(parts, pipeline, optimizer, plan, grid: ProcessGrid, activations, measured_step: RoutingMeter,
           every_step: RoutingMeter, throughput, device, compute_dtype, grouped: bool, args) -> None:
    cfg, shape, ep = plan.cfg, plan.shape, ExpertParallel.from_grid(grid)
    # What training moved, before the report's own bookkeeping collectives (routing counts) add to it.
    training_traffic = copy.deepcopy(comm.meter)
    modules = nn.ModuleList(part.module for part in parts)
    n_params = sum(p.numel() for p in modules.parameters())
    n_layers = sum(len(module.layers) for module in modules)
    predicted = predicted_peak_activation_bytes(parts, pipeline, cfg, shape, grid.cp_size, measured_step, ep, grouped,
                                                grid.tp_size)
    log0("\n== memory (one rank; activations at their peak in step 0) ==")
    log0(memory_table(measured_memory(modules, optimizer, activations.peak_bytes),
                      predicted_memory(n_params, predicted)))
    log0("predicted activations: the dense formula with each MoE layer's SwiGLU replaced by "
         "moe_layer_activation_bytes, evaluated on step 0's routing counts (rows sent and received per layer "
         "and micro-batch)")
    experts = [p for part in parts for p in part.expert_parameters]
    states = (v for p in experts for v in optimizer.state[p].values() if torch.is_tensor(v) and v.dim() > 0)
    measured = [tensor_bytes(experts), tensor_bytes(p.grad for p in experts if p.grad is not None), tensor_bytes(states)]
    weights = expert_memory_bytes(cfg, ep.size, n_layers, grid.tp_size)
    log0("experts on this rank (3 h f E / (ep tp) per layer), measured / predicted MB: " + ", ".join(
        f"{name} {bytes_ / 1e6:.3f} / {times * weights / 1e6:.3f}"
        for name, bytes_, times in zip(("weights", "gradients", "AdamW states"), measured, (1, 1, 2))))
    element_bytes = torch.finfo(compute_dtype).bits // 8
    routed = predicted_routed_traffic(every_step, ep, grid.tp_size, cfg.hidden, element_bytes)
    log0(f"\n== communication per step (ep={ep.size} drawn from dp x cp = {grid.dp_size} x {grid.cp_size}) ==")
    log0(training_traffic.table(add_traffic(predicted_step_traffic(parts, pipeline, cfg, shape, grid, compute_dtype,
                                                                   args.bias_update_rate),
                                            {key: value / args.steps for key, value in routed.items()}),
                                per=args.steps))
    formulas = {("all_to_all_single", "ep"): "all_to_all_single 2 (sent + received) h e + 8 E",
                ("all_reduce", "tp"): "the experts' tp all-reduces (e + 4) h per row received"}
    if routed:
        log0("predicted from every step's routing counts, per layer and micro-batch: "
             + "; ".join(formulas[key] for key in routed))
    log_routing(measured_step, grid.dp_cp_group)
    log_compute_report(throughput, grid.shape.world_size, cfg, shape.seq_len, device)


# ============================================================================ main


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description="Lesson 05: expert parallelism (run with torchrun).",
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_parallel_flags(parser, axes=("dp", "pp", "cp", "tp"), fill_axis="dp")
    add_moe_flags(parser)
    pipeline_parallel.add_schedule_flags(parser)
    add_training_flags(parser, seq_len=128, micro_batch_size=4, grad_accum=2, steps=20)
    parser.set_defaults(preset="tiny-moe")
    return pipeline_parallel.resolve_virtual_stages(parser.parse_args(argv))


def main(argv=None):
    args = parse_args(argv)
    plan = plan_run(args, validate, moe_config)
    cfg, shape = plan.cfg, plan.shape
    device = init_distributed()
    grid = ProcessGrid(plan.grid, ep=args.ep if args.ep is not None else plan.grid.dp * plan.grid.cp)
    compute_dtype = autocast_dtype(args.dtype, device)
    grouped = uses_grouped_mm(args, cfg, compute_dtype, plan.grid.tp)
    parts = build_model(cfg, args.seed, grid, device, grouped, shape.sequences_per_step, int(args.bucket_mb * 2**20),
                        args.virtual_stages)
    pipeline = context_parallel.build_pipeline(parts, grid, args.schedule, shape, cfg, device, compute_dtype)
    optimizer = build_optimizer(nn.ModuleList(part.module for part in parts), args.lr)
    settings = step_settings(parts, grid, device, compute_dtype, args.max_grad_norm)
    log0(f"lesson 05: expert parallel, ep={grid.ep_size} of dp x cp = {grid.dp_size} x {grid.cp_size} "
         f"(pp={grid.pp_size}, tp={grid.tp_size}), {cfg.n_experts} experts top-{cfg.experts_per_token} "
         f"({cfg.router} router, {'grouped matmuls' if grouped else 'looped experts'}), "
         f"{cfg.n_experts // grid.ep_size} experts per rank{' (each split over tp)' if grid.tp_size > 1 else ''}, "
         f"{count_parameters(cfg)['total']:,} parameters, {shape.tokens_per_step:,} tokens per step")
    log0(grid.shape.picture())

    activations, measured_step, every_step = ActivationMeter(*parts), RoutingMeter(parts), RoutingMeter(parts)
    log_groups = (grid.dp_cp_group, *((grid.pp_group,) if pipeline is not None else ()))
    model_or_pipeline = parts[0] if pipeline is None else pipeline
    step = functools.partial(train_step, model_or_pipeline, optimizer, settings=settings,
                             bias_update_rate=args.bias_update_rate, balancing_log=BalancingLog(parts, log_groups))
    with every_step:
        throughput = train(args, optimizer, step, plan.batches, grid.dp_rank, device,
                           prepare_batch=context_parallel.sequence_cut(grid, zigzag=True),
                           meters=(activations, measured_step),
                           evaluate=functools.partial(evaluate, model_or_pipeline, settings=settings),
                           val_batches=plan.val_batches, cfg=cfg)
    report(parts, pipeline, optimizer, plan, grid, activations, measured_step, every_step, throughput, device,
           compute_dtype, grouped, args)
    shutdown()


if __name__ == "__main__":
    main()
