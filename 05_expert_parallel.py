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
same dense weights: the data-parallel ranks (lesson 07 adds the cp ranks, which hold other parts
of the same sequences: picotron_like/topology.py). Cut the dp ranks into consecutive ep groups;
the ranks at the same place of every ep group hold the same experts and form the
expert-data-parallel (edp) group, over which expert gradients are summed, while dense gradients
are still summed over all of dp.

Four steps, in the order this file builds them:
1. Local dispatch on one rank: sort the token-expert assignments by expert, run each expert on
   its contiguous run of rows (a loop, or one grouped matmul), multiply by the routing weight and
   add each result back at its token's row.
2. Expert parallelism: exchange the per-expert token counts, then the tokens, with an uneven
   all-to-all (lesson 04's, with split sizes); run the local experts; send results back. Backward
   is the same exchange reversed.
3. Gradients: expert gradients summed over edp, dense over dp, both normalised as usual by
   the global target count and nothing else. The classic bug divides expert gradients by ep (or
   edp): they would be ep times too small. The gradient norm counts every parameter once.
4. Balancing across ranks: the auxiliary and z losses ride on the layer's output (moe.py);
   the auxiliary-loss-free router bias moves with the load summed over every rank routing tokens.
Lesson 07 composes experts with the other axes: ep drawn from dp x cp, every expert split over
tp, the MoE layers inside pipeline stages.

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
    torchrun --nproc_per_node=4 05_expert_parallel.py --ep 2 --aux-loss-coef 1e-2 --capacity-factor 1.25
    torchrun --nproc_per_node=4 05_expert_parallel.py --ep 4 --shared-experts 1 --z-loss-coef 1e-3

What to look for: the loss falls as on one device (the tests prove it, gradients and parameters
included); the all-to-all bytes and the activations equal their formulas evaluated on the run's
real routing counts; the tokens-per-expert table shows how unbalanced the router is, and the
expert memory per rank is 1/ep.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import copy
import functools
import math
from dataclasses import dataclass, replace
from fractions import Fraction

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from picotron_like import comm
from picotron_like.data import StepBatch
from picotron_like.lessons import load_lesson
from picotron_like.metrics import (ActivationMeter, BalancingLog, MeteredRun, RoutingMeter, add_traffic, data_parallel_traffic, log0,
                                   log_compute_report, log_memory_rows, log_traffic_rows, predicted_activation_bytes,
                                   tensor_bytes)
from picotron_like.model import GPT, count_parameters
from picotron_like.moe import GroupedExperts, Routing, expert_counts, is_expert_parameter, moe_layers
from picotron_like.topology import (ConfigError, GridShape, ProcessGrid, init_distributed, shutdown,
                                    validate_parallel_config)
from picotron_like.run_control import StepMeters
from picotron_like.train import (RankBatches, StepResult, StepSettings, add_parallel_flags, add_training_flags,
                                 autocast_dtype, bucket_bytes_from_flags, build_optimizer, plan_run, train)

data_parallel = load_lesson("01_data_parallel")

# ============================================================================ the technique: local dispatch


@dataclass
class Dispatch:
    """A batch's token-expert assignments, sorted by expert (expert 0's rows first).

    token_rows [m]  the token each assignment belongs to (within an expert: in token order)
    weights    [m]  its combine weight
    counts     [E]  kept assignments per expert: the lengths of the runs in the sorted order; the
                    dropped ones, if any, come after all of them, until kept() cuts them off
    """

    token_rows: torch.Tensor
    weights: torch.Tensor
    counts: torch.Tensor

    def kept(self, n_kept: int) -> "Dispatch":
        """The first n_kept assignments: the kept ones, once the host has read the counts (copies,
        so that backward keeps n_kept rows, not every choice's)."""
        if n_kept == len(self.token_rows):
            return self
        return Dispatch(self.token_rows[:n_kept].clone(), self.weights[:n_kept].clone(), self.counts)


def sort_by_expert(routing: Routing, n_experts: int) -> Dispatch:
    """Flatten the [n, k] choices and sort them by expert, stably: an expert then sees its tokens
    in token order, as the reference loop does. A dropped choice sorts last, as expert E, and is
    cut off (Dispatch.kept) with the counts that the caller reads to the host anyway, as the sizes
    of its runs or of its all-to-all: selecting the kept ones first (nonzero) would make the host
    wait for the device once more, to learn how many there are."""
    k = routing.expert_ids.shape[1]
    expert_ids = routing.expert_ids.masked_fill(~routing.kept, n_experts).flatten()
    order = expert_ids.argsort(stable=True)
    return Dispatch(order // k, routing.weights.flatten()[order], expert_counts(expert_ids, n_experts + 1)[:-1])


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


def grouped_mm_fits(cfg, dtype: torch.dtype, device: torch.device = torch.device("cpu"),
                    capability: tuple[int, int] | None = None) -> bool:
    """Whether torch._grouped_mm is the fast path here: it exists, takes this model's row strides,
    and has its kernel for `dtype` on `device`. On CUDA that kernel is bf16 on compute capability
    9.0 (Hopper) and newer; for another dtype or an older GPU torch falls back to a slow loop over
    the groups with a host sync, or refuses, depending on its version, and looped_experts is then
    the better path. On the CPU it runs in every dtype (the tests prove it in float32).
    `capability`, the GPU's (major, minor), is read from the device unless given (the memory
    plan passes that of the GPU it plans for)."""
    element = torch.finfo(dtype).bits // 8
    if not (hasattr(torch, "_grouped_mm") and all(d * element % 16 == 0 for d in (cfg.hidden, cfg.ffn_hidden))):
        return False
    if device.type != "cuda":
        return True
    return dtype == torch.bfloat16 and (capability or torch.cuda.get_device_capability(device)) >= (9, 0)


def combine(tokens: torch.Tensor, dispatch: Dispatch, expert_out: torch.Tensor) -> torch.Tensor:
    """Each token's output: the sum of its assignments' expert outputs times their weights."""
    weighted = expert_out * dispatch.weights[:, None].type_as(tokens)
    return torch.zeros_like(tokens).index_add(0, dispatch.token_rows, weighted.type_as(tokens))


def local_expert_compute(tokens: torch.Tensor, routing: Routing, experts: GroupedExperts,
                         run_experts=looped_experts) -> torch.Tensor:
    """MixtureOfExperts.expert_compute on one rank: permute, run, un-permute and weight."""
    dispatch = sort_by_expert(routing, experts.n_experts)
    counts = dispatch.counts.tolist()       # the host's one read: the experts' runs of rows
    dispatch = dispatch.kept(sum(counts))
    expert_out = run_experts(tokens[dispatch.token_rows], counts, experts)
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


def shard_experts(model: nn.Module, ep: ExpertParallel) -> nn.Module:
    """Keep this rank's E/ep experts: rows [rank E/ep, (rank + 1) E/ep) of dim 0 of every stacked
    expert weight, cut from the reference tensor, so the run starts from the reference's values."""
    for layer in moe_layers(model):
        local = layer.experts.n_experts // ep.size
        for name in ("gate_proj", "up_proj", "down_proj"):
            mine = getattr(layer.experts, name).detach()[ep.rank * local:(ep.rank + 1) * local]
            setattr(layer.experts, name, nn.Parameter(mine.clone()))
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
    # The all-to-all takes its split sizes as host integers: the host's one read, both tables at once.
    sent_table, arrived_table = torch.stack([dispatch.counts.view(ep.size, n_local), arriving]).tolist()
    send_splits, receive_splits = [sum(row) for row in sent_table], [sum(row) for row in arrived_table]
    dispatch = dispatch.kept(sum(send_splits))
    received = comm.AllToAll.apply(tokens[dispatch.token_rows], ep.group, receive_splits, send_splits)
    # Number each arrived row's (source, expert) block expert-major; a stable sort by that number
    # regroups the rows by expert and keeps each block's rows in order.
    block_key = torch.arange(n_local, device=tokens.device) * ep.size + torch.arange(ep.size, device=tokens.device)[:, None]
    by_expert = block_key.flatten().repeat_interleave(arriving.flatten(), output_size=sum(receive_splits))
    by_expert = by_expert.argsort(stable=True)
    expert_out = run_experts(received[by_expert], [sum(column) for column in zip(*arrived_table)], experts)
    returned = comm.AllToAll.apply(expert_out[by_expert.argsort()], ep.group, send_splits,
                                               receive_splits)
    return combine(tokens, dispatch, returned)


def apply_expert_parallel(model: nn.Module, ep: ExpertParallel, run_experts=looped_experts) -> nn.Module:
    """Shard the experts and plug the dispatch into every MoE layer's expert_compute seam;
    `run_experts` (looped_experts or grouped_experts) runs this rank's experts on their rows. At
    ep = 1 the local dispatch runs: no all-to-all over a group of one."""
    compute = (functools.partial(local_expert_compute, run_experts=run_experts) if ep.size == 1 else
               functools.partial(expert_parallel_compute, ep=ep, run_experts=run_experts))
    for layer in moe_layers(shard_experts(model, ep)):
        layer.expert_compute = compute
    return model


# ============================================================================ the technique: gradients and balancing


class ExpertDataParallel(nn.Module):
    """Lesson 01's bucketed gradient sum, twice: dense parameters over dp, experts over edp.

    A dense weight is replicated on every dp rank and each computed its gradient from its own
    tokens: sum over dp, as lesson 01 does. An expert weight lives on one rank of each ep group,
    and its gradient there already holds the contribution of every token the ep group routed to
    it; the other ep groups routed other tokens to their copy: sum over edp. Every rank's loss
    share is already divided by the global target count (the batch's n_targets), so both sums
    are plain sums. Dividing the expert sum by anything (ep, edp, the tokens the expert saw) is
    the classic expert-parallel bug: the gradient is then ep times off the reference.
    """

    def __init__(self, module: nn.Module, grid: ProcessGrid, bucket_bytes: int | None):
        super().__init__()
        self.module = module
        self.dp_group = grid.dp_group          # the step sums the loss over every rank holding other tokens
        named = list(module.named_parameters())
        dense = [p for name, p in named if not is_expert_parameter(name)]
        expert = [p for name, p in named if is_expert_parameter(name)]
        # A tuple, not submodules: the parameters belong to `module`; the wrappers only reduce them.
        self.reducers = tuple(data_parallel.BucketedDataParallel(nn.ParameterList(params), group, bucket_bytes)
                              for params, group in ((dense, grid.dp_group), (expert, grid.edp_group)) if params)
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


def step_settings(model: ExpertDataParallel, grid: ProcessGrid, device, compute_dtype,
                  max_grad_norm: float) -> StepSettings:
    """The gradient norm counts every parameter once: each ep rank adds the squares of its own
    experts, the dense parameters (identical on every rank after the dp sum) count on ep rank 0
    only, and the sum runs over the ep group."""
    if grid.ep_size == 1:
        return StepSettings(device, compute_dtype, max_grad_norm)
    experts, ep_rank = model.expert_parameters, grid.ep_rank
    return StepSettings(device, compute_dtype, max_grad_norm, (grid.ep_group,),
                        lambda p: ep_rank == 0 or p in experts)


def prepare_balancing(model: nn.Module, sequences_per_step: int) -> nn.Module:
    """Every MoE layer sees part of the step's batch: its balancing losses become shares of the
    step's means over all sequences_per_step sequences (the layer's moe.BatchShare)."""
    for layer in moe_layers(model):
        layer.batch_share = replace(layer.batch_share, sequences_per_step=sequences_per_step)
    return model


@torch.no_grad()
def update_router_biases(model: nn.Module, group, rate: float, grad_norm: torch.Tensor) -> None:
    """Auxiliary-loss-free balancing after the optimizer step: every rank that routed different
    tokens must move the bias by the same total load, or the replicas of the router drift apart.

    A step optimizer_step skipped (a non-finite `grad_norm`, the same on every rank) moves no
    bias and keeps counting its load, as if it had not run. That is decided on the device (the
    rate times 0 or 1), so the host waits for nothing."""
    stepped = torch.isfinite(grad_norm)
    for layer in moe_layers(model):
        load = layer.expert_load.clone()
        comm.call(dist.all_reduce, load, group=group)
        counted = layer.expert_load.clone()
        layer.update_router_bias(rate * stepped, load)
        layer.expert_load.copy_(torch.where(stepped, layer.expert_load, counted))


def train_step(model: ExpertDataParallel, optimizer, batch: StepBatch, settings: StepSettings,
               bias_update_rate: float = 0.0, balancing_log: BalancingLog | None = None) -> StepResult:
    """Lesson 01's step: the dispatch lives inside the layers and the gradient sums inside the
    wrapper. After the optimizer step, the router biases move (auxiliary-loss-free balancing);
    the aux and z losses of the step go to the log."""
    result = data_parallel.train_step(model, optimizer, batch, settings)
    if bias_update_rate:
        update_router_biases(model.module, model.dp_group, bias_update_rate, result.values["grad_norm"])
    return result if balancing_log is None else result.with_extra(balancing_log.step_values())


def evaluate(model: ExpertDataParallel, batch: StepBatch, settings: StepSettings) -> float:
    """Lesson 01's forward-only loss: the language-model loss alone. The aux and z balancing
    losses are training objectives that only backward sees (attached to the layers' outputs), so
    they are not part of the validation loss. Routing adds each forward's choices to
    expert_load; those of validation tokens are taken back out, or the next router-bias update
    would balance on tokens the step never trained on."""
    with router_loads_kept(model):
        return data_parallel.evaluate(model, batch, settings)


@contextlib.contextmanager
def router_loads_kept(model: nn.Module):
    """The model's MoE layers' expert_load as it was before the block: what validation routes is not
    what the step trained on."""
    layers = moe_layers(model)
    loads = [layer.expert_load.clone() for layer in layers]
    yield
    for layer, load in zip(layers, loads):
        layer.expert_load.copy_(load)


def build_model(cfg, seed: int, grid: ProcessGrid, device, run_experts, sequences_per_step: int,
                bucket_bytes: int | None = None) -> ExpertDataParallel:
    """The reference GPT, its experts sharded over ep and dispatched, balancing made global, its
    gradients summed over dp and edp."""
    model = apply_expert_parallel(GPT(cfg, seed=seed).to(device), ExpertParallel.from_grid(grid), run_experts)
    return ExpertDataParallel(prepare_balancing(model, sequences_per_step), grid, bucket_bytes)


# ============================================================================ configuration rules


# flag -> the GPTConfig field it sets; a flag left out keeps the preset's value
MOE_FLAGS = {"router": "router", "shared_experts": "n_shared_experts", "aux_loss_coef": "aux_loss_coef",
             "z_loss_coef": "z_loss_coef", "capacity_factor": "capacity_factor"}


def add_moe_flags(parser) -> None:
    """--ep, the router and the balancing flags (moe_config applies them).
    The model's flags default to the preset's values (tiny-moe: softmax, no shared expert, no
    balancing loss, dropless), so a preset stays what it says."""
    parser.add_argument("--ep", type=int, default=None,
                        help="expert-parallel degree, drawn from the ranks holding other tokens (lesson 05: dp; "
                             "lesson 07: dp x cp); default: as many of them as divide the experts too (their gcd)")
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


def validate_expert_parallel(cfg, ep: int, token_ranks: int, bias_update_rate: float = 0.0) -> None:
    """This lesson's rules, before any process group: experts to spread, ep dividing them and the
    `token_ranks` it is drawn from (the dp ranks)."""
    problems = []
    if not cfg.n_experts:
        problems.append("the model has no experts: lesson 05 needs a mixture-of-experts preset; use --preset tiny-moe")
    elif cfg.n_experts % ep:
        problems.append(f"n_experts={cfg.n_experts} is not divisible by --ep {ep}: each ep rank holds "
                        f"n_experts/ep whole experts; pick an ep that divides {cfg.n_experts}")
    if ep < 1 or token_ranks % ep:
        problems.append(f"--ep {ep} does not divide dp = {token_ranks}: the ep ranks are drawn from the "
                        f"ranks holding other tokens; pick an ep that divides {token_ranks}")
    if not bias_update_rate >= 0:
        problems.append(f"--bias-update-rate {bias_update_rate} must be 0 (off) or positive")
    if problems:
        raise ConfigError("bad parallel configuration:\n  - " + "\n  - ".join(problems))


def expert_degree(args, cfg, grid: GridShape) -> int:
    """--ep, by default as many ep ranks as the experts and the dp ranks allow: their greatest common
    divisor (dp itself when it divides n_experts), so that every layout of the rules runs."""
    return args.ep if args.ep is not None else math.gcd(grid.dp, cfg.n_experts)


def validate(cfg, grid: GridShape, shape, args, world_size: int) -> None:
    validate_parallel_config(grid, world_size)
    validate_expert_parallel(cfg, expert_degree(args, cfg, grid), grid.dp, args.bias_update_rate)


# ============================================================================ measuring the three challenges


def rows_sent_and_received(routing: RoutingMeter, ep: ExpertParallel) -> tuple[list[int], list[int]]:
    """Per call the meter recorded: m, the assignments this rank dispatched (its kept choices), and
    r, the rows that arrived for its own experts from every ep rank (r = m at ep = 1). The counts
    are all-gathered over the ep group, whose ranks run the same calls in the same order."""
    counts = torch.stack([call.counts for call in routing.calls]).to(torch.int64)      # [calls, E]
    sent = counts.sum(dim=1)
    if ep.size == 1:
        return sent.tolist(), sent.tolist()
    everyone = torch.empty(ep.size * counts.shape[0], counts.shape[1], dtype=torch.int64)
    comm.call(comm.all_gather_single, everyone, counts, group=ep.group)
    for_my_experts = everyone.view(ep.size, *counts.shape).chunk(ep.size, dim=2)[ep.rank]
    return sent.tolist(), for_my_experts.sum(dim=(0, 2)).tolist()


def moe_layer_activation_bytes(cfg, tokens: int, sequences: int, sent: int, received: int, ep: int,
                               grouped: bool, element_bytes: int = 4) -> int:
    """Bytes autograd keeps for backward of one MoE layer on one micro-batch of one rank, with
    this file's dispatch (DESIGN rule 9).

    The routing decides it: of the micro-batch's n = `tokens` tokens (in `sequences` sequences),
    m = `sent` kept assignments leave for the experts and r = `received` rows arrive for this
    rank's experts (r = m at ep = 1). So the prediction takes a real step's counts as input
    (RoutingMeter, rows_sent_and_received). The layer's input, the norm's output that the router
    keeps, belongs to the dense formula. In bytes, e = `element_bytes` for the tensors in the
    compute dtype (4 in float32, 2 under bf16; the router computes in float32 whatever the dtype):

      per token      the router's scores (softmax or sigmoid output)                  4E
                     the top-k sort's int64 indices (expert_ids are a view of them)    8E
                     its k choices' order by expert (int64; dropped choices too)      8k
                     the chosen scores and their sum (weights = chosen / sum)         4k + 4
                     capacity: the bool mask of kept choices (weights * kept)          k
                     sigmoid router with the aux loss: the scores' row sums            4
                     z-loss: the router logits and their logsumexp                    4E + 4
                     shared expert: SwiGLU's gate, silu(gate), up, product            4e f_shared
      per sequence   aux loss: f_i                                                    4E
      per m          the kept choices' token rows, int64; the combine weight          8 + e
                     the expert output back at the token's rank, and weighted         2e h
      per r          the expert's input row; SwiGLU's gate, silu(gate), up, product   e (h + 4f)
                     ep > 1: the permutations into and out of expert order, int64     16
      grouped        the int32 offsets of the rank's E/ep experts                     4E/ep
    """
    E, k, h, f = cfg.n_experts, cfg.experts_per_token, cfg.hidden, cfg.ffn_hidden
    e = element_bytes
    per_token = 12 * E + 12 * k + 4 + 4 * e * cfg.n_shared_experts * f
    per_token += (k if cfg.capacity_factor is not None else 0) + (4 * E + 4 if cfg.z_loss_coef else 0)
    per_token += 4 if cfg.router == "sigmoid" and cfg.aux_loss_coef else 0
    per_sequence = 4 * E if cfg.aux_loss_coef else 0
    per_received = e * (h + 4 * f) + (16 if ep > 1 else 0)
    offsets = 4 * E // ep if grouped else 0
    return tokens * per_token + sequences * per_sequence + sent * (8 + e + 2 * e * h) + received * per_received + offsets


def moe_layer_bytes_over_dense(cfg, tokens: int, sequences: int, sent: int, received: int, ep: int,
                               grouped: bool, element_bytes: int = 4) -> int:
    """What one MoE layer adds to the dense formula, which counts a dense SwiGLU in its place
    (gate, up, silu(gate) and their product: 4 f elements per token)."""
    return (moe_layer_activation_bytes(cfg, tokens, sequences, sent, received, ep, grouped, element_bytes)
            - 4 * element_bytes * cfg.ffn_hidden * tokens)


def predicted_peak_activation_bytes(cfg, shape, routing: RoutingMeter, ep: ExpertParallel, grouped: bool) -> int:
    """This rank's activations at their peak in the step `routing` recorded (float32): the dense
    formula of one micro-batch with each MoE layer's SwiGLU replaced by its routed bytes, at the
    micro-batch that kept most (lesson 01 runs one micro-batch's forward and backward at a time)."""
    micro = shape.micro_batch_size
    extra = collections.Counter()
    for call, sent, received in zip(routing.calls, *rows_sent_and_received(routing, ep)):
        extra[call.micro_batch] += moe_layer_bytes_over_dense(cfg, micro * shape.seq_len, micro, sent, received,
                                                              ep.size, grouped)
    return predicted_activation_bytes(cfg, micro, shape.seq_len) + max(extra.values())


def predicted_routed_traffic(routing: RoutingMeter, ep: ExpertParallel, hidden: int, element_bytes: int) -> dict:
    """The ep all-to-all's bytes, from the counts of every call `routing` recorded: 2 (m + r) h e +
    8 E (m rows out and r back in forward, the same reversed in backward, and the E int64 counts)."""
    if ep.size == 1:
        return {}
    n_experts = routing.layers[0].n_experts
    return {("all_to_all_single", "ep"): sum(2 * (m + r) * hidden * element_bytes + 8 * n_experts * call.n_calls
                                             for call, m, r in zip(routing.calls, *rows_sent_and_received(routing, ep)))}


def balancing_traffic(cfg, n_layers: int, bias_update_rate: float) -> dict:
    """The step's balancing bookkeeping, summed over the ranks holding other tokens (dp):
    BalancingLog's enabled values (aux, z: one float each), and with
    auxiliary-loss-free balancing the router loads, E floats per MoE layer."""
    log_values = bool(cfg.aux_loss_coef) + bool(cfg.z_loss_coef)
    return add_traffic({("all_reduce", "dp"): 4 * log_values} if log_values else {},
                       {("all_reduce", "dp"): 4 * cfg.n_experts * n_layers} if bias_update_rate else {})


def predicted_traffic(module: nn.Module, grid: ProcessGrid, routing: RoutingMeter, bias_update_rate: float,
                      steps: int) -> dict:
    """A step's collectives as the pieces metrics.step_traffic adds up (the report prints them; the
    tests add them up the same way): the technique's, the ep all-to-all and the balancing
    bookkeeping; the gradients', lesson 01's all-reduce with the experts' share moved from dp to edp; the
    loss over dp and the gradient norm over ep. The all-to-all is the mean over the `steps` steps
    whose routing `routing` counted: a Fraction, exact, so the tests compare it with counted bytes."""
    ep = ExpertParallel.from_grid(grid)
    routed = predicted_routed_traffic(routing, ep, module.cfg.hidden, 4)
    expert_bytes = 4 * sum(p.numel() for name, p in module.named_parameters() if is_expert_parameter(name))
    return dict(technique=add_traffic({key: Fraction(value, steps) for key, value in routed.items()},
                                      balancing_traffic(module.cfg, len(module.layers), bias_update_rate)),
                gradients=add_traffic(data_parallel_traffic(sum(p.numel() for p in module.parameters())),
                                      {("all_reduce", "dp"): -expert_bytes, ("all_reduce", "edp"): expert_bytes}),
                loss_groups=("dp",), norm_groups=("ep",) if ep.size > 1 else ())


def log_expert_memory(run: MeteredRun, ep: int) -> None:
    """The experts this rank holds, measured, next to 3 h f E / ep float32 weights per layer."""
    experts = [p for name, p in run.model.named_parameters() if is_expert_parameter(name)]
    states = (v for p in experts for v in run.optimizer.state[p].values() if torch.is_tensor(v) and v.dim() > 0)
    measured = [tensor_bytes(experts), tensor_bytes(p.grad for p in experts if p.grad is not None), tensor_bytes(states)]
    weights = 4 * len(run.model.layers) * 3 * run.cfg.hidden * run.cfg.ffn_hidden * run.cfg.n_experts // ep
    log0("experts on this rank (3 h f E / ep per layer), measured / predicted MB: " + ", ".join(
        f"{name} {bytes_ / 1e6:.3f} / {times * weights / 1e6:.3f}"
        for name, bytes_, times in zip(("weights", "gradients", "AdamW states"), measured, (1, 1, 2))))


def log_routing(routing: RoutingMeter, group) -> None:
    """Assignments per expert in the step `routing` recorded, summed over the ranks holding other tokens."""
    counts = torch.zeros(len(routing.layers), routing.layers[0].n_experts, dtype=torch.int64)
    for call in routing.calls:
        counts[call.layer] += call.counts
    dropped = torch.tensor([sum(call.dropped for call in routing.calls)])
    comm.call(dist.all_reduce, counts, group=group)
    comm.call(dist.all_reduce, dropped, group=group)
    log0("\n== routing of one step (assignments per expert, summed over every rank routing other tokens) ==")
    log0(f"{'layer':<8}{'min':>8}{'mean':>9}{'max':>8}{'max/mean':>10}")
    for index, row in enumerate(counts.float()):
        log0(f"{index:<8}{row.min():>8.0f}{row.mean():>9.1f}{row.max():>8.0f}{row.max() / row.mean():>10.2f}")
    log0(f"assignments dropped by capacity: {int(dropped)}")


def report(run: MeteredRun, plan, args, grid: ProcessGrid, step_routing: RoutingMeter, every_step: RoutingMeter,
           grouped: bool) -> None:
    """The shared rows with the experts' own: activations on step 0's routing (`step_routing`), the
    experts' memory, the all-to-all on every step's routing (`every_step`), the routing table."""
    ep = ExpertParallel.from_grid(grid)
    training_traffic = copy.deepcopy(comm.meter)    # before the report's own gathers of routing counts
    log_memory_rows(run, "one rank; activations at their peak in step 0",
                    predicted_peak_activation_bytes(run.cfg, plan.shape, step_routing, ep, grouped))
    log0("predicted activations: the dense formula with each MoE layer's SwiGLU replaced by "
         "moe_layer_activation_bytes, evaluated on step 0's routing counts (rows sent and received per layer "
         "and micro-batch)")
    log_expert_memory(run, ep.size)
    log_traffic_rows(run, f"ep={ep.size} of dp = {grid.dp_size}", meter=training_traffic,
                     **predicted_traffic(run.model, grid, every_step, args.bias_update_rate, run.steps))
    if ep.size > 1:
        log0("all_to_all_single predicted from every step's routing counts, per layer and micro-batch: "
             "2 (sent + received) h e + 8 E")
    log_routing(step_routing, grid.dp_group)
    log_compute_report(run)


# ============================================================================ main


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description="Lesson 05: expert parallelism (run with torchrun).",
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_parallel_flags(parser, axes=("dp", "ep"), fill_axis="dp")
    add_moe_flags(parser)
    add_training_flags(parser, seq_len=128, micro_batch_size=4, grad_accum=2, steps=20)
    parser.set_defaults(preset="tiny-moe")
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    plan = plan_run(args, validate, moe_config)
    cfg, shape = plan.cfg, plan.shape
    device = init_distributed()
    grid = ProcessGrid(plan.grid, ep=expert_degree(args, plan.cfg, plan.grid))
    compute_dtype = autocast_dtype(args.dtype, device)
    grouped = args.grouped_mm and grouped_mm_fits(cfg, compute_dtype, device)
    model = build_model(cfg, args.seed, grid, device, grouped_experts if grouped else looped_experts,
                        shape.sequences_per_step, bucket_bytes_from_flags(args, device))
    optimizer = build_optimizer(model.module, args.lr)
    settings = replace(step_settings(model, grid, device, compute_dtype, args.max_grad_norm), tail=args.step_tail)
    log0(f"lesson 05: expert parallel, ep={grid.ep_size} of dp = {grid.dp_size}, {cfg.n_experts} experts "
         f"top-{cfg.experts_per_token} ({cfg.router} router, {'grouped matmuls' if grouped else 'looped experts'}), "
         f"{cfg.n_experts // grid.ep_size} experts per rank, {count_parameters(cfg)['total']:,} parameters, "
         f"{shape.tokens_per_step:,} tokens per step")
    log0(grid.shape.picture())

    activations, step_routing = ActivationMeter(model), RoutingMeter([model])
    every_step = RoutingMeter([model], period=shape.grad_accum)     # folded: fixed size however long the run
    step = functools.partial(train_step, model, optimizer, settings=settings, bias_update_rate=args.bias_update_rate,
                             balancing_log=BalancingLog([model], (grid.dp_group,)))
    with every_step:
        batches = RankBatches(plan.batches, grid.dp_rank, device, val=plan.val_batches)    # this rank's share
        throughput = train(args, optimizer, step, batches,
                           evaluate=functools.partial(evaluate, model, settings=settings),
                           meters=StepMeters((activations, step_routing)), cfg=cfg)
    run = MeteredRun(model.module, optimizer, activations, throughput, cfg, shape.seq_len, grid.shape.world_size,
                     device, throughput.steps)
    report(run, plan, args, grid, step_routing, every_step, grouped)
    shutdown()


if __name__ == "__main__":
    main()
