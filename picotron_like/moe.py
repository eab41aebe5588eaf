"""
The mixture of experts: the FFN of every block of a model with experts (GPTConfig.n_experts > 0).

A mixture-of-experts (MoE) FFN replaces a layer's one SwiGLU MLP by E of them, the "experts", and
sends each token through only k. Parameters grow E-fold, the work per token only k-fold:
Mixtral-8x7B holds 46.7e9 parameters and multiplies each token through 12.9e9 of them. Four parts:

  routing    a linear router scores every expert for every token; the k best are chosen, and
             their outputs are mixed with weights that sum to one (MixtureOfExperts.route);
  dispatch   each expert runs on the tokens that chose it (MixtureOfExperts.expert_compute, a
             plain loop here; lesson 05 plugs in grouped matmuls and expert parallelism);
  capacity   optionally, an expert takes at most C tokens of a sequence, so that its work is
             bounded and known in advance; the overflow is dropped (capacity_mask);
  balancing  nothing in the language-model loss stops the router from sending most tokens to a
             few experts, which then learn everything while the rest starve. Three remedies, each
             usable on its own: an auxiliary loss that penalises imbalance (sequence_aux_loss), a
             z-loss that keeps the router's logits small (router_z_loss), and a per-expert bias on
             the choice, nudged after every step (MixtureOfExperts.update_router_bias).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


class GroupedExperts(nn.Module):
    """E SwiGLU experts held as three stacked 3-D parameters instead of E modules:

        gate_proj, up_proj: [E, ffn_hidden, hidden]        down_proj: [E, hidden, ffn_hidden]

    Expert e is slice [e] of each, laid out like nn.Linear's weight, so it computes exactly what a
    SwiGLU module with those three weights computes. The stacking is for the faster and the
    distributed forms: a grouped matmul takes every expert in one tensor, and expert parallelism
    gives each rank a slice of dim 0 (then E here is the rank's share of the experts).
    """

    def __init__(self, n_experts: int, hidden: int, ffn_hidden: int):
        super().__init__()
        self.gate_proj = nn.Parameter(torch.empty(n_experts, ffn_hidden, hidden))
        self.up_proj = nn.Parameter(torch.empty(n_experts, ffn_hidden, hidden))
        self.down_proj = nn.Parameter(torch.empty(n_experts, hidden, ffn_hidden))
        # A usable start for a layer built on its own; GPT replaces it by reference_init.
        for weight in (self.gate_proj, self.up_proj, self.down_proj):
            nn.init.normal_(weight, std=0.02)

    @property
    def n_experts(self) -> int:
        return self.gate_proj.shape[0]

    def forward(self, x: torch.Tensor, index: int) -> torch.Tensor:
        """Expert `index` applied to tokens x [n, hidden]."""
        hidden = F.silu(F.linear(x, self.gate_proj[index])) * F.linear(x, self.up_proj[index])
        return F.linear(hidden, self.down_proj[index])


@dataclass
class Routing:
    """Where each of n tokens goes (k = experts per token, E = experts), as MixtureOfExperts.route decides.

    expert_ids     [n, k] int64    the chosen experts, best first (column 0 holds the top-1 choice)
    weights        [n, k] float32  how much each choice's output counts: they sum to 1 over a
                                   token's k choices, except that a dropped choice weighs exactly 0
    kept           [n, k] bool     False where capacity dropped the choice (all True when dropless)
    scores         [n, E] float32  every expert's normalised score (each row sums to 1): the P of
                                   the auxiliary loss
    router_logits  [n, E] float32  the router's raw output: what the z-loss keeps small
    """

    expert_ids: torch.Tensor
    weights: torch.Tensor
    kept: torch.Tensor
    scores: torch.Tensor
    router_logits: torch.Tensor


def top_k_experts(selection: torch.Tensor, k: int) -> torch.Tensor:
    """The indices of each row's k largest entries, largest first; of equal entries the lower index wins.

    torch.topk promises no order among ties, and a tie broken one way on one device and another way
    on a second (or in a second layout of the same batch) sends a token to a different expert. A
    stable descending sort makes the choice a function of the values alone.
    """
    return selection.sort(dim=-1, descending=True, stable=True).indices[..., :k]


def expert_capacity(capacity_factor: float, experts_per_token: int, seq_len: int, n_experts: int) -> int:
    """Slots per expert per sequence: ceil(F * k * T / E).

    A sequence of T tokens makes k * T choices; spread evenly, each expert receives k * T / E of
    them. F = 1 allows exactly that much, F = 1.25 a quarter more for imbalance.
    """
    return math.ceil(capacity_factor * experts_per_token * seq_len / n_experts)


def capacity_mask(expert_ids: torch.Tensor, seq_len: int, n_experts: int, capacity: int) -> torch.Tensor:
    """kept [n, k]: which choices find a slot when each expert takes at most `capacity` of a sequence.

    expert_ids [n, k] holds whole sequences of seq_len tokens, one after another. Within a sequence,
    slots go first come, first served in this order (GShard, Switch Transformer):

        the top-1 choices of tokens 0, 1, ..., T-1, then their top-2 choices, then their top-3 ...

    so that no token's first choice is pushed out by another token's second one. Each sequence
    starts with empty experts: what one sequence routes never drops a token of another.
    """
    n, k = expert_ids.shape
    # Every sequence's choices as one row, in the order the slots are handed out: [sequences, k * T].
    queue = expert_ids.view(-1, seq_len, k).transpose(1, 2).reshape(-1, k * seq_len)
    # arrivals[s, j, e]: how many of the first j + 1 choices of sequence s went to expert e; read at
    # j's own expert, it is j's place (1-based) in that expert's queue.
    arrivals = F.one_hot(queue, n_experts).cumsum(dim=1)
    place = arrivals.gather(-1, queue[..., None]).squeeze(-1)
    return (place <= capacity).view(-1, k, seq_len).transpose(1, 2).reshape(n, k)


def looped_expert_compute(tokens: torch.Tensor, routing: Routing, experts: GroupedExperts) -> torch.Tensor:
    """Every token's combined expert output [n, hidden]: the sum over its kept choices of
    weight * expert(token). The reference form of MixtureOfExperts.expert_compute.

    One expert at a time: gather the tokens that chose it, run it, scale each output by its weight,
    add it back at the token's row. Every expert runs, on zero tokens if none chose it, so every
    expert weight receives a gradient (zeros when unused) and a data-parallel gradient bucket never
    waits for a gradient that never comes.
    """
    out = torch.zeros_like(tokens)
    chosen = routing.expert_ids.masked_fill(~routing.kept, -1)  # a dropped choice matches no expert
    for index in range(experts.n_experts):
        rows, slot = (chosen == index).nonzero(as_tuple=True)
        expert_out = experts(tokens[rows], index) * routing.weights[rows, slot, None].type_as(tokens)
        out = out.index_add(0, rows, expert_out)
    return out


def expert_counts(expert_ids: torch.Tensor, n_experts: int, kept: torch.Tensor | None = None) -> torch.Tensor:
    """[E]: how many of the choices `expert_ids` (any shape) name each expert, the `kept` ones only
    when a mask is given. torch.bincount would first read the largest id to the host (on a GPU, a
    wait for the device); adding ones onto E + 1 zeros, the dropped choices onto the extra one,
    keeps everything on the device."""
    if kept is not None:
        expert_ids = expert_ids.masked_fill(~kept, n_experts)
    ids = expert_ids.flatten()
    counts = torch.zeros(n_experts + 1, dtype=torch.long, device=ids.device)
    return counts.index_add_(0, ids, torch.ones_like(ids))[:-1]


def choice_counts(expert_ids: torch.Tensor, n_experts: int) -> torch.Tensor:
    """[sequences, E]: how many tokens of each sequence chose each expert (dropped or not).
    expert_ids: [sequences, tokens, k]."""
    return F.one_hot(expert_ids, n_experts).sum(dim=(1, 2))


def sequence_aux_loss(scores: torch.Tensor, counts: torch.Tensor, seq_len: int, experts_per_token: int) -> torch.Tensor:
    """DeepSeek-V3's sequence-wise balance loss of each sequence, before its coefficient: [sequences].

        f_i = E / (k T) * (the sequence's tokens that chose expert i)
        P_i = the mean over the sequence's T tokens of expert i's normalised score
        loss = sum_i f_i * P_i

    Perfectly balanced choices give every f_i = 1 and a loss of sum_i P_i = 1; an expert chosen
    more often than its share weighs its own score more. The counts f are piecewise constant, so
    the gradient flows through P alone: it lowers the scores of the experts f finds overloaded.
    Per sequence, so the loss does not depend on how a batch is cut into micro-batches or ranks.

    scores: [sequences, t, E]; counts: [sequences, E] over the whole sequence. t = T on one device;
    a rank that holds a chunk of every sequence passes its t < T tokens with the whole sequence's
    counts, and the ranks' results add up to the sequence's loss.
    """
    n_experts = scores.shape[-1]
    f = counts.to(scores.dtype) * (n_experts / (experts_per_token * seq_len))
    p = scores.sum(dim=1) / seq_len
    return (f * p).sum(dim=-1)


def router_z_loss(router_logits: torch.Tensor) -> torch.Tensor:
    """ST-MoE's router z-loss of each token, before its coefficient: logsumexp(logits)^2, [n].

    Large router logits saturate the softmax and round badly (worse in bf16); this penalises their
    size without favouring any expert.
    """
    return router_logits.logsumexp(dim=-1).square()


class _AttachLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, loss):
        ctx.loss_dtype, ctx.loss_device = loss.dtype, loss.device
        return y

    @staticmethod
    def backward(ctx, grad_y):
        return grad_y, torch.ones((), dtype=ctx.loss_dtype, device=ctx.loss_device)


def attach_balancing_loss(y: torch.Tensor, loss: torch.Tensor) -> torch.Tensor:
    """y, unchanged, carrying `loss` [scalar] into the backward pass of whatever y's gradient comes from.

    A balancing loss is born inside a layer deep in the model, but a training step sees only what
    GPT.forward returns: the cross-entropy, which is also what the log should print. Instead of
    threading the loss out through every return value and every pipeline stage boundary, tie it to
    the layer's output: forward returns y as it is; backward passes y's gradient through and gives
    `loss` the gradient 1, exactly what it would receive had it been added to the final objective:

        d(objective + loss) / d(loss) = 1

    So the loss is optimised wherever y's gradient flows, including on a pipeline stage whose
    backward starts from a gradient received from the next stage. The objective's own scaling (its
    mean over tokens, a division by the global target count) does not reach it: the loss must
    arrive already normalised (see BatchShare.sequences_per_step).
    """
    return _AttachLoss.apply(y, loss)


@dataclass(frozen=True)
class BatchShare:
    """Which share of the step's batch a MixtureOfExperts layer sees, so that its balancing losses
    are shares of the step's means and add up over micro-batches and ranks. The default is the
    reference's: the whole batch on one device. A distributed run sets it (layer.batch_share).

    sequences_per_step     the sequences of the whole step; None: those this forward sees. A run
                           that shows the layer part of the batch (a micro-batch, one data-parallel
                           rank's rows) sets the step's count.
    sequence_shards        how many ranks hold a piece of every sequence (context parallelism);
                           1: the layer sees whole sequences.
    whole_sequence_counts  turns the per-sequence choice counts [sequences, E] of the tokens this
                           rank holds into those of the whole sequences (a sum over the ranks that
                           hold them; the counts are constants, so no autograd is needed). Default:
                           the counts unchanged. The aux loss then uses each whole sequence's
                           counts and length, and the ranks' shares add up to the sequence's loss.
    """

    sequences_per_step: int | None = None
    sequence_shards: int = 1
    whole_sequence_counts: Callable[[torch.Tensor], torch.Tensor] = lambda counts: counts


def config_problems(cfg) -> list[str]:
    """What is wrong with the mixture-of-experts options of `cfg` (a GPTConfig), one line each; a
    dense model (n_experts = 0) must leave them at their defaults."""
    if cfg.n_experts < 0:
        return [f"n_experts={cfg.n_experts} must be 0 (dense) or more"]
    if not cfg.n_experts:
        moe_only = {"router": cfg.router != "softmax", "n_shared_experts": cfg.n_shared_experts != 0,
                    "capacity_factor": cfg.capacity_factor is not None,
                    "aux_loss_coef": cfg.aux_loss_coef != 0, "z_loss_coef": cfg.z_loss_coef != 0}
        return [f"{name}={getattr(cfg, name)!r} needs a mixture-of-experts model (n_experts > 0): "
                "pick a preset with experts (e.g. tiny-moe) or drop the option"
                for name, is_set in moe_only.items() if is_set]
    problems = []
    if not 0 < cfg.experts_per_token <= cfg.n_experts:
        problems.append(f"experts_per_token={cfg.experts_per_token} must be in 1..n_experts={cfg.n_experts}")
    if cfg.router not in ("softmax", "sigmoid"):
        problems.append(f"router={cfg.router!r} must be 'softmax' or 'sigmoid'")
    if cfg.n_shared_experts < 0:
        problems.append(f"n_shared_experts={cfg.n_shared_experts} must be 0 or more")
    if cfg.capacity_factor is not None and not (cfg.capacity_factor > 0 and math.isfinite(cfg.capacity_factor)):
        problems.append(f"capacity_factor={cfg.capacity_factor} must be a positive number (or None: dropless)")
    for name in ("aux_loss_coef", "z_loss_coef"):
        value = getattr(cfg, name)
        if not (value >= 0 and math.isfinite(value)):
            problems.append(f"{name}={value} must be 0 (off) or a positive number")
    if cfg.z_loss_coef and cfg.router == "sigmoid":
        problems.append(f"z_loss_coef={cfg.z_loss_coef} applies to the softmax router: the sigmoid "
                        "router scores each expert on its own and has no logsumexp to keep small")
    return problems


class MixtureOfExperts(nn.Module):
    """Top-k routed SwiGLU experts, an optional shared expert, and three ways to balance the load.

        tokens ─► route ─► expert_compute (each token through its kept choices, weighted) ─► + ─► out
                   │                                         shared expert (every token) ─┘
                   └─► aux loss + z-loss, attached to out (attach_balancing_loss)

    Set by whoever trains with the layer:
      expert_compute      the dispatch, called as expert_compute(tokens [n, h], routing, experts)
                          -> [n, h]; default looped_expert_compute
      batch_share         the share of the step's batch this layer sees (a BatchShare); default:
                          all of it
    State outside the optimizer's reach:
      router_bias         [E], moved only by update_router_bias (auxiliary-loss-free balancing)
      expert_load         [E], tokens that chose each expert since the last update_router_bias;
                          every forward adds to it (a forward recomputed by activation
                          checkpointing adds twice)
    Read-outs for the log, not part of the computation:
      last_aux_loss, last_z_loss   the detached balancing losses of the last forward, as they were
                                   added to the objective (0 when disabled); a step's value is their
                                   sum over layers and micro-batches
      last_choices                 (expert_ids, kept) of the last forward's Routing: which experts
                                   its tokens chose, and which choices capacity kept
    """

    def __init__(self, cfg, shared_expert: nn.Module | None = None):
        """`cfg`: the model's GPTConfig. `shared_expert`: DeepSeek's shared expert, a dense MLP every
        token passes through, for what all tokens need, so that the routed experts can specialise
        (None: none); the model builds it (GPT's Block: a SwiGLU n_shared_experts experts wide)."""
        super().__init__()
        self.n_experts = cfg.n_experts
        self.experts_per_token = cfg.experts_per_token
        self.router_kind = cfg.router
        self.capacity_factor = cfg.capacity_factor
        self.aux_loss_coef = cfg.aux_loss_coef
        self.z_loss_coef = cfg.z_loss_coef
        self.router = nn.Linear(cfg.hidden, cfg.n_experts, bias=False)
        self.experts = GroupedExperts(cfg.n_experts, cfg.hidden, cfg.ffn_hidden)
        self.shared_expert = shared_expert
        self.expert_compute = looped_expert_compute
        self.register_buffer("router_bias", torch.zeros(cfg.n_experts))
        self.register_buffer("expert_load", torch.zeros(cfg.n_experts), persistent=False)
        self.batch_share = BatchShare()
        self.last_aux_loss: torch.Tensor | None = None
        self.last_z_loss: torch.Tensor | None = None

    def route(self, tokens: torch.Tensor, seq_len: int) -> Routing:
        """The Routing of tokens [n, hidden]: n / seq_len whole sequences (capacity is per sequence).

        softmax router (Mixtral): p = softmax(logits) over the E experts; choose the k largest of
            p + router_bias; weights = the chosen p, renormalised to sum 1; scores = p.
        sigmoid router (DeepSeek-V3): s = sigmoid(logits), each expert scored on its own; choose
            the k largest of s + router_bias; weights = the chosen s, normalised to sum 1;
            scores = s / sum_j s_j.
        The bias changes which experts are chosen, never how much a chosen one counts: balancing
        moves tokens between experts without distorting what the experts compute.
        """
        # The router runs in float32 even under autocast (Switch Transformer's "selective
        # precision"): a choice between experts can turn on a difference of logits that bf16
        # rounds away.
        with torch.autocast(tokens.device.type, enabled=False):
            logits = self.router(tokens.to(self.router.weight.dtype)).float()
        if self.router_kind == "softmax":
            affinity = scores = logits.softmax(dim=-1)
        else:
            affinity = logits.sigmoid()
            scores = affinity / affinity.sum(dim=-1, keepdim=True)
        expert_ids = top_k_experts(affinity + self.router_bias, self.experts_per_token)
        chosen = affinity.gather(-1, expert_ids)
        # With k = 1 and the softmax router this weight is always 1, and the router learns nothing
        # from the language-model loss (Switch Transformer keeps the raw probability for that case).
        weights = chosen / chosen.sum(dim=-1, keepdim=True)
        kept = torch.ones_like(expert_ids, dtype=torch.bool)
        if self.capacity_factor is not None:
            capacity = expert_capacity(self.capacity_factor, self.experts_per_token, seq_len, self.n_experts)
            kept = capacity_mask(expert_ids, seq_len, self.n_experts, capacity)
            # Not renormalised: a kept choice counts what it would have counted anyway, and the
            # share of a dropped one is simply missing (the residual connection carries the token).
            weights = weights * kept
        return Routing(expert_ids, weights, kept, scores, logits)

    def balancing_losses(self, routing: Routing, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(auxiliary loss, z-loss) of the batch routed, each already multiplied by its coefficient
        (0 when the coefficient is 0) and divided by the step's count: the auxiliary loss is a mean
        over the step's sequences, the z-loss a mean over its tokens. Both count every token routed,
        whether or not its target is masked: the router sees them all. `seq_len` is the number of
        tokens of each sequence the layer sees: all of it, or 1/sequence_shards of it (see
        BatchShare), whose counts whole_sequence_counts completes."""
        share = self.batch_share
        sequences = routing.router_logits.shape[0] // seq_len
        whole_len = seq_len * share.sequence_shards
        step_sequences = sequences if share.sequences_per_step is None else share.sequences_per_step
        aux = z = routing.router_logits.new_zeros(())
        if self.aux_loss_coef:
            counts = share.whole_sequence_counts(
                choice_counts(routing.expert_ids.view(sequences, seq_len, -1), self.n_experts))
            per_sequence = sequence_aux_loss(routing.scores.view(sequences, seq_len, -1), counts, whole_len,
                                             self.experts_per_token)
            aux = self.aux_loss_coef * per_sequence.sum() / step_sequences
        if self.z_loss_coef:
            z = self.z_loss_coef * router_z_loss(routing.router_logits).sum() / (step_sequences * whole_len)
        return aux, z

    def forward(self, x):
        tokens = x.reshape(-1, x.shape[-1])
        seq_len = x.shape[1]
        routing = self.route(tokens, seq_len)
        self.last_choices = (routing.expert_ids, routing.kept)
        with torch.no_grad():
            self.expert_load += expert_counts(routing.expert_ids, self.n_experts)
        out = self.expert_compute(tokens, routing, self.experts)
        if self.shared_expert is not None:
            out = out + self.shared_expert(tokens)
        aux, z = self.balancing_losses(routing, seq_len)
        self.last_aux_loss, self.last_z_loss = aux.detach(), z.detach()
        if self.aux_loss_coef or self.z_loss_coef:
            out = attach_balancing_loss(out, aux + z)
        return out.view_as(x)

    @torch.no_grad()
    def update_router_bias(self, rate: float, load: torch.Tensor) -> None:
        """Auxiliary-loss-free balancing (DeepSeek-V3): after an optimizer step, raise the bias of
        every expert that received fewer tokens than the mean and lower it for those that got more,

            router_bias += rate * sign(mean(load) - load)

        then count afresh (expert_load = 0). `load` [E] is the step's tokens per expert: this
        layer's expert_load on one device; in a distributed run, the sum over every rank that
        routed different tokens, or each replica would move its bias its own way.
        """
        load = load.float()
        self.router_bias += rate * torch.sign(load.mean() - load)
        self.expert_load.zero_()


def is_expert_parameter(name: str) -> bool:
    """The stacked expert weights (layers.N.mlp.experts.*): split over ep and reduced over edp by
    lesson 05, sharded over edp by lesson 06."""
    return ".experts." in name


def moe_layers(model: nn.Module) -> list[MixtureOfExperts]:
    """The model's mixture-of-experts layers, first layer first."""
    return [module for module in model.modules() if isinstance(module, MixtureOfExperts)]

