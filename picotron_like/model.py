"""
The reference GPT: the single-device ground truth every lesson is proven equal to.

A Llama-style decoder, small enough to read in one sitting:

    tokens ─► embedding ─► [ RMSNorm ─► attention ─► + ─► RMSNorm ─► SwiGLU MLP ─► + ] × n_layers
                                (RoPE, causal, GQA)   │                 (or MoE)     │
                                                      residual                       residual
           ─► RMSNorm ─► lm_head ─► logits ─► cross-entropy

Four seams let later lessons parallelise this model without editing this file:

- every weight matrix is its own ``nn.Linear`` attribute (``q_proj``, ``gate_proj``, ...), so
  tensor parallelism (lesson 02) swaps them for column- and row-parallel layers;
- ``GPT.forward`` is three calls (``embed``, the layers, ``head_loss``) over an ``nn.ModuleList``,
  so pipeline parallelism (lesson 03) can give each stage a slice of the layers;
- the attention core is a replaceable function (``Attention.attention_core``) that receives
  K/V *before* they are repeated for grouped-query attention, so context parallelism (lesson 04) can
  pass fewer bytes around its ring; the LM head computes the loss itself, chunk by chunk
  (``LMHead``, ``linear_cross_entropy``), so lesson 02 swaps in a head split by vocabulary;
- a mixture-of-experts layer routes its tokens (``MixtureOfExperts.route``) and hands them to a
  replaceable dispatch (``MixtureOfExperts.expert_compute``) over experts stacked in 3-D
  parameters, so expert parallelism (lesson 05) can send tokens to the ranks that hold their
  experts. The MoE section below explains routing, capacity and load balancing.

Initialisation is a pure function of (seed, parameter name): ``reference_init`` draws every tensor
from its own generator. A sharded layer that owns rows 64..127 of ``layers.3.attn.q_proj.weight``
draws the full tensor the same way and keeps its slice, so a distributed run starts from exactly
the reference parameters, whatever the construction order or the number of ranks. Stacked expert
weights ``[n_experts, ...]`` are drawn whole in the same way; an expert-parallel rank keeps its
experts' slice of dim 0.

Generating text runs each new token alone against the keys and values of the positions before it,
kept per layer in a ``KVCache`` (``GPT.forward_cached``; picotron_like.sample uses it).

The two formulas used for MFU and memory predictions live here too: ``count_parameters`` and
``flops_per_token`` (6 FLOPs per matmul parameter per token, plus the attention term).
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 256
    seq_len: int = 128          # the training sequence length the presets are sized for
    n_layers: int = 4
    hidden: int = 128           # d_model
    n_heads: int = 4
    n_kv_heads: int = 2         # < n_heads: grouped-query attention
    ffn_hidden: int = 384       # SwiGLU inner width
    n_experts: int = 0          # 0: dense MLP; > 0: mixture-of-experts FFN in every layer
    experts_per_token: int = 2  # top-k routing
    # The mixture-of-experts options (see MixtureOfExperts); a dense model must leave them alone.
    router: str = "softmax"                 # "softmax" (Mixtral) or "sigmoid" (DeepSeek-V3)
    n_shared_experts: int = 0               # width, in experts, of a dense SwiGLU every token passes through
    capacity_factor: float | None = None    # None: dropless; F: each expert takes ceil(F k T / E) per sequence
    aux_loss_coef: float = 0.0              # sequence-wise auxiliary balance loss (0: off)
    z_loss_coef: float = 0.0                # router z-loss, softmax router only (0: off)
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    init_std: float = 0.02

    @property
    def head_dim(self) -> int:
        return self.hidden // self.n_heads

    def _moe_problems(self) -> list[str]:
        if self.n_experts < 0:
            return [f"n_experts={self.n_experts} must be 0 (dense) or more"]
        if not self.n_experts:
            moe_only = {"router": self.router != "softmax", "n_shared_experts": self.n_shared_experts != 0,
                        "capacity_factor": self.capacity_factor is not None,
                        "aux_loss_coef": self.aux_loss_coef != 0, "z_loss_coef": self.z_loss_coef != 0}
            return [f"{name}={getattr(self, name)!r} needs a mixture-of-experts model (n_experts > 0): "
                    "pick a preset with experts (e.g. tiny-moe) or drop the option"
                    for name, is_set in moe_only.items() if is_set]
        problems = []
        if not 0 < self.experts_per_token <= self.n_experts:
            problems.append(f"experts_per_token={self.experts_per_token} must be in 1..n_experts={self.n_experts}")
        if self.router not in ("softmax", "sigmoid"):
            problems.append(f"router={self.router!r} must be 'softmax' or 'sigmoid'")
        if self.n_shared_experts < 0:
            problems.append(f"n_shared_experts={self.n_shared_experts} must be 0 or more")
        if self.capacity_factor is not None and not (self.capacity_factor > 0 and math.isfinite(self.capacity_factor)):
            problems.append(f"capacity_factor={self.capacity_factor} must be a positive number (or None: dropless)")
        for name in ("aux_loss_coef", "z_loss_coef"):
            value = getattr(self, name)
            if not (value >= 0 and math.isfinite(value)):
                problems.append(f"{name}={value} must be 0 (off) or a positive number")
        if self.z_loss_coef and self.router == "sigmoid":
            problems.append(f"z_loss_coef={self.z_loss_coef} applies to the softmax router: the sigmoid "
                            "router scores each expert on its own and has no logsumexp to keep small")
        return problems

    def __post_init__(self):
        problems = []
        if self.hidden % self.n_heads:
            problems.append(f"hidden={self.hidden} is not divisible by n_heads={self.n_heads}")
        if self.n_heads % self.n_kv_heads:
            problems.append(f"n_heads={self.n_heads} is not divisible by n_kv_heads={self.n_kv_heads}")
        if self.head_dim % 2:
            problems.append(f"head_dim={self.head_dim} must be even for rotary embeddings")
        problems += self._moe_problems()
        if problems:
            raise ValueError("invalid GPTConfig: " + "; ".join(problems))


# Shapes, not trained checkpoints. "tiny" trains in seconds on a laptop CPU; the others reproduce
# well-known shapes so the memory and FLOP formulas can be read at real scale (the 125m shape is
# GPT-2 small with SwiGLU and an untied head over the GPT-2 vocabulary padded to 50304).
PRESETS: dict[str, GPTConfig] = {
    "tiny": GPTConfig(),
    "tiny-moe": GPTConfig(n_experts=4, experts_per_token=2, ffn_hidden=192),
    "125m": GPTConfig(vocab_size=50304, seq_len=1024, n_layers=12, hidden=768, n_heads=12,
                      n_kv_heads=12, ffn_hidden=2048),
    # Mixtral-8x7B's shape: published as 46.7e9 parameters, 12.9e9 active per token.
    "mixtral-8x7b": GPTConfig(vocab_size=32000, seq_len=4096, n_layers=32, hidden=4096, n_heads=32,
                              n_kv_heads=8, ffn_hidden=14336, n_experts=8, experts_per_token=2,
                              rope_theta=1e6),
    # Llama-3.2-1B's blocks and vocabulary, but its LM head is a weight of its own: 1.50e9 parameters
    # where Llama-3.2-1B, whose head is the embedding's transpose, has 1.24e9. Tying them under a
    # pipeline would need the first and the last stage to sum the shared weight's gradient.
    "1b": GPTConfig(vocab_size=128256, seq_len=2048, n_layers=16, hidden=2048, n_heads=32,
                    n_kv_heads=8, ffn_hidden=8192, rope_theta=500000.0),
    "8b": GPTConfig(vocab_size=128256, seq_len=8192, n_layers=32, hidden=4096, n_heads=32,
                    n_kv_heads=8, ffn_hidden=14336, rope_theta=500000.0),
}


def get_config(preset: str, **overrides) -> GPTConfig:
    if preset not in PRESETS:
        raise ValueError(f"unknown model preset {preset!r}; choose one of {', '.join(PRESETS)}")
    return replace(PRESETS[preset], **{k: v for k, v in overrides.items() if v is not None})


# ----------------------------------------------------------------------------- building blocks

class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        # Normalise in float32 even under bf16 autocast: the mean of squares loses too much
        # precision in 8 mantissa bits.
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * self.weight).type_as(x)


def rotary_tables(positions: torch.Tensor, head_dim: int, theta: float):
    """cos/sin of each position's rotation angles, shape [seq, head_dim // 2].

    Positions are passed in, not assumed to be 0..s-1: a context-parallel rank holds tokens from
    the middle of the sequence and must rotate them by their true positions.
    """
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=positions.device).float() / head_dim)
    angles = positions.float()[:, None] * inv_freq[None, :]
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x[i], x[i + d/2]) of each head by the position's angle. x: [b, heads, s, d]."""
    first, second = x.float().chunk(2, dim=-1)
    rotated = torch.cat((first * cos - second * sin, first * sin + second * cos), dim=-1)
    return rotated.type_as(x)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal softmax(q k^T / sqrt(d)) v. q: [b, heads, s, d]; k, v: [b, kv_heads, s, d].

    K and V stay un-repeated: each group of heads // kv_heads query heads shares one K/V head, and
    the kernel pairs them itself (enable_gqa). Repeating them first, as Llama's reference code
    does, would keep heads // kv_heads copies of K and V for backward (4x for the 8b preset).
    """
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=k.shape[1] != q.shape[1])


class KVCache:
    """One layer's keys and values of the positions a sequence has so far, for generating text: the
    next token then runs through the model alone, its query attending to the keys kept here,
    instead of the whole sequence running again for every token (n tokens cost n positions of
    work, not n^2 / 2). Memory: 2 * n_kv_heads * head_dim * max_len elements per layer and
    sequence, allocated at the first append in the keys' own dtype, device and head count (a
    tensor-parallel rank's share of the heads too)."""

    def __init__(self, max_len: int):
        self.max_len, self.length = max_len, 0
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keep the new positions' k, v [b, kv_heads, s, d]; return those of every position so far."""
        if self.keys is None:
            self.keys = k.new_zeros(*k.shape[:2], self.max_len, k.shape[3])
            self.values = torch.zeros_like(self.keys)
        end = self.length + k.shape[2]
        if end > self.max_len:
            raise ValueError(f"KVCache holds {self.max_len} positions; {end} were given")
        self.keys[:, :, self.length:end], self.values[:, :, self.length:end] = k, v
        self.length = end
        return self.keys[:, :, :end], self.values[:, :, :end]


def cached_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """causal_attention for the last s = q.shape[2] of the P positions in k, v: query i sits at
    position P - s + i and sees the positions up to its own. SDPA's is_causal aligns the mask to
    the top left (query i sees keys 0..i), right only when s = P, so the mask is spelled out."""
    new, total = q.shape[2], k.shape[2]
    visible = torch.arange(total, device=q.device) <= torch.arange(total - new, total, device=q.device)[:, None]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=visible, enable_gqa=k.shape[1] != q.shape[1])


class Attention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.head_dim = cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden, cfg.n_heads * cfg.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.hidden, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.hidden, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.hidden, bias=False)
        self.attention_core = causal_attention

    def forward(self, x, rope, kv_cache: KVCache | None = None):
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        # Head counts and sequence length are read off the projections, not the config: under
        # tensor parallelism a rank holds only some heads, and under sequence parallelism the
        # projection's output covers more tokens than its input.
        batch, seq = q.shape[:2]
        q, k, v = (t.view(batch, seq, -1, self.head_dim).transpose(1, 2) for t in (q, k, v))
        cos, sin = rope
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out = self.attention_core(q, k, v) if kv_cache is None else cached_attention(q, *kv_cache.append(k, v))
        return self.o_proj(out.transpose(1, 2).reshape(batch, seq, -1))


class SwiGLU(nn.Module):
    def __init__(self, hidden: int, ffn_hidden: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, ffn_hidden, bias=False)
        self.up_proj = nn.Linear(hidden, ffn_hidden, bias=False)
        self.down_proj = nn.Linear(ffn_hidden, hidden, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


# ----------------------------------------------------------------------------- mixture of experts
#
# A mixture-of-experts (MoE) FFN replaces a layer's one SwiGLU MLP by E of them, the "experts", and
# sends each token through only k. Parameters grow E-fold, the work per token only k-fold:
# Mixtral-8x7B holds 46.7e9 parameters and multiplies each token through 12.9e9 of them. Four parts:
#
#   routing    a linear router scores every expert for every token; the k best are chosen, and
#              their outputs are mixed with weights that sum to one (MixtureOfExperts.route);
#   dispatch   each expert runs on the tokens that chose it (MixtureOfExperts.expert_compute, a
#              plain loop here; lesson 05 plugs in grouped matmuls and expert parallelism);
#   capacity   optionally, an expert takes at most C tokens of a sequence, so that its work is
#              bounded and known in advance; the overflow is dropped (capacity_mask);
#   balancing  nothing in the language-model loss stops the router from sending most tokens to a
#              few experts, which then learn everything while the rest starve. Three remedies, each
#              usable on its own: an auxiliary loss that penalises imbalance (sequence_aux_loss), a
#              z-loss that keeps the router's logits small (router_z_loss), and a per-expert bias on
#              the choice, nudged after every step (MixtureOfExperts.update_router_bias).


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
    arrive already normalised (see MixtureOfExperts.sequences_per_step).
    """
    return _AttachLoss.apply(y, loss)


class MixtureOfExperts(nn.Module):
    """Top-k routed SwiGLU experts, an optional shared expert, and three ways to balance the load.

        tokens ─► route ─► expert_compute (each token through its kept choices, weighted) ─► + ─► out
                   │                                         shared expert (every token) ─┘
                   └─► aux loss + z-loss, attached to out (attach_balancing_loss)

    Set by whoever trains with the layer:
      expert_compute      the dispatch, called as expert_compute(tokens [n, h], routing, experts)
                          -> [n, h]; default looped_expert_compute
      sequences_per_step  None: the batch this layer sees is the step's whole batch (the
                          reference). A run that shows the layer part of the batch (a micro-batch,
                          one data-parallel rank's rows) sets the number of sequences in the whole
                          step: each part's balancing loss is then its share of the step's mean,
                          and the shares add up over micro-batches and ranks.
      sequence_shards     1: the layer sees whole sequences. A run that cuts every sequence over
                          several ranks (context parallelism) sets how many ranks hold a piece,
      whole_sequence_counts  and a function that turns the per-sequence choice counts
                          [sequences, E] of the tokens this rank holds into those of the whole
                          sequences (a sum over the ranks holding them; the counts are constants,
                          so no autograd is needed). Default: the counts unchanged. The aux loss
                          then uses each whole sequence's counts and length, and the ranks'
                          shares add up to the sequence's loss.
    State outside the optimizer's reach:
      router_bias         [E], moved only by update_router_bias (auxiliary-loss-free balancing)
      expert_load         [E], tokens that chose each expert since the last update_router_bias;
                          every forward adds to it (a forward recomputed by activation
                          checkpointing adds twice)
    Read-outs for the log, not part of the computation:
      last_aux_loss, last_z_loss   the detached balancing losses of the last forward, as they were
                                   added to the objective (0 when disabled); a step's value is their
                                   sum over layers and micro-batches
    """

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_experts = cfg.n_experts
        self.experts_per_token = cfg.experts_per_token
        self.router_kind = cfg.router
        self.capacity_factor = cfg.capacity_factor
        self.aux_loss_coef = cfg.aux_loss_coef
        self.z_loss_coef = cfg.z_loss_coef
        self.router = nn.Linear(cfg.hidden, cfg.n_experts, bias=False)
        self.experts = GroupedExperts(cfg.n_experts, cfg.hidden, cfg.ffn_hidden)
        # DeepSeek's shared expert: a dense SwiGLU every token passes through, for what all tokens
        # need, so that the routed experts can specialise.
        self.shared_expert = (SwiGLU(cfg.hidden, cfg.n_shared_experts * cfg.ffn_hidden)
                              if cfg.n_shared_experts else None)
        self.expert_compute = looped_expert_compute
        self.register_buffer("router_bias", torch.zeros(cfg.n_experts))
        self.register_buffer("expert_load", torch.zeros(cfg.n_experts), persistent=False)
        self.sequences_per_step: int | None = None
        self.sequence_shards = 1
        self.whole_sequence_counts: Callable[[torch.Tensor], torch.Tensor] = lambda counts: counts
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
        tokens of each sequence the layer sees: all of it, or 1/sequence_shards of it (see the
        class docstring), whose counts whole_sequence_counts completes."""
        sequences = routing.router_logits.shape[0] // seq_len
        whole_len = seq_len * self.sequence_shards
        step_sequences = sequences if self.sequences_per_step is None else self.sequences_per_step
        aux = z = routing.router_logits.new_zeros(())
        if self.aux_loss_coef:
            counts = self.whole_sequence_counts(
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


# ----------------------------------------------------------------------------- the model

class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.hidden, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.hidden, cfg.norm_eps)
        self.mlp = MixtureOfExperts(cfg) if cfg.n_experts else SwiGLU(cfg.hidden, cfg.ffn_hidden)

    def forward(self, x, rope, kv_cache: KVCache | None = None):
        x = x + self.attn(self.attn_norm(x), rope, kv_cache)
        return x + self.mlp(self.mlp_norm(x))


# A target equal to IGNORE_INDEX (padding, a prompt the model should not learn to write) adds
# nothing to the loss and is not counted in its denominator.
IGNORE_INDEX = -100


def cross_entropy_loss(logits: torch.Tensor, targets: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """Next-token loss over the tokens whose target is not IGNORE_INDEX, computed in float32, from
    logits already made: the textbook form, which the chunked loss below is proven equal to.

    reduction "mean" divides by the number of such targets (the reference); "sum" does not, so
    that a distributed step can divide by the count of the *global* batch instead (train.py).
    """
    return F.cross_entropy(logits.float().flatten(0, -2), targets.flatten(), ignore_index=IGNORE_INDEX,
                           reduction=reduction)


# ----------------------------------------------------------------------------- the loss, chunked

# The textbook loss above needs the logits of every token at once, and autograd keeps their float32
# log-softmax for backward: 4 V bytes per token, 0.5 MB at Llama 3's V = 128,256, 4 GiB for one
# 8192-token sequence. Backward then makes two more such tensors (the gradients of the
# log-probabilities and of the logits) while every activation of the model is still alive, the
# step's peak. The LM head below never holds more than one chunk of tokens' logits: it computes
# the head's matmul and the loss chunk by chunk, keeps one float32 number per token (the
# log-sum-exp), and recomputes each chunk's logits in backward.
#
# A chunk holds as many tokens as keep its float32 logits under LOSS_CHUNK_BYTES. On a GPU that is
# a few hundred tokens of Llama 3's vocabulary, a matmul still large enough to run at full speed;
# a tiny CPU model fits in one chunk.
LOSS_CHUNK_BYTES = 256 * 2**20


def loss_chunk_tokens(vocab_slice: int) -> int:
    """Tokens per chunk: as many as keep a chunk's float32 logits over `vocab_slice` words under
    LOSS_CHUNK_BYTES, at least one."""
    return max(1, LOSS_CHUNK_BYTES // (4 * vocab_slice))


class VocabularyStatistics(NamedTuple):
    """Per token, float32 [n], over the words of one vocabulary slice (all of them on one device):
    the largest logit, the sum of exp(logit - that max), and the target's logit (0 where the target
    is not in the slice). Lesson 02 combines the slices of the tp ranks into the whole vocabulary's."""

    row_max: torch.Tensor
    sum_exp: torch.Tensor
    target_logit: torch.Tensor


@dataclass(frozen=True)
class ChunkedLoss:
    """How linear_cross_entropy computes: the reduction ("mean" or "sum", as cross_entropy_loss),
    the first word of this weight's vocabulary slice, and two hooks for tensor parallelism (lesson
    02): `combine` turns this slice's statistics into the whole vocabulary's (None: the weight holds
    every word), `restore_input` gives back the input to multiply from the one kept for backward
    (None: the input itself is kept)."""

    reduction: str = "mean"
    vocab_start: int = 0
    combine: Callable[[VocabularyStatistics], VocabularyStatistics] | None = None
    restore_input: Callable[[torch.Tensor], torch.Tensor] | None = None


def matmul_dtype(x: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The dtype F.linear(x, weight) would multiply in: autocast's, else the weight's."""
    device_type = x.device.type
    return torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else weight.dtype


class LinearCrossEntropy(torch.autograd.Function):
    """loss = sum over tokens t with a target of  log sum_v exp(z_tv) - z_t,target,  z = x W^T,
    computed over chunks of tokens so that no more than one chunk's logits exist at a time.

    forward:  per chunk, z_chunk = x_chunk W^T (in the matmul dtype, then float32), and from it the
              chunk's VocabularyStatistics; the chunk's logits are freed before the next chunk's.
              Then log_sum_exp = max + log(sum_exp), and the loss. Kept for backward: x (the head's
              input, which the reference's matmul keeps too), W (a parameter), the targets and
              log_sum_exp, one float32 per token, in place of the reference's V per token.
    backward: per chunk again, z_chunk recomputed, softmax = exp(z_chunk - log_sum_exp) (no second
              reduction: log_sum_exp already normalises it), minus one at the target, times the
              loss's gradient; then dx_chunk = g W and dW += g^T x_chunk.

    The price and the saving, per micro-batch of n tokens, hidden h, vocabulary slice V, chunk c:
      FLOPs: the head's forward matmul once more in backward, 2 n h V on top of its 6 n h V
             (a third more for the head, about 2% of an 8b step's FLOPs; MFU counts model FLOPs
             and leaves it out, as it leaves out recomputed blocks)
      bytes kept: 4 per token instead of 4 V (V = 128,256: 0.5 MB per token saved)
      bytes in flight: one chunk, c V (4 + e) with matmul dtype e != float32 (the product and its
             float32 copy), plus dW, dx and W in the matmul dtype: predicted_loss_transient_bytes
             (metrics) counts them, and the memory plan adds them to the step's peak.
    Recomputing rather than keeping the chunk's gradient from forward (what fused kernels such as
    Liger's do) keeps dW out of the forward: with gradient accumulation or a pipeline schedule the
    weight gradient of every live micro-batch would otherwise wait for its backward.

    Equal to cross_entropy_loss on the whole logits up to float32 rounding (tests/test_loss_memory.py).
    dW is summed chunk by chunk in the matmul dtype, then cast to W's (as autocast's matmul makes it
    in the matmul dtype): exact in float32; in bf16 one rounding per chunk where one matmul rounds once.
    """

    @staticmethod
    def forward(ctx, x, kept, weight, targets, how: ChunkedLoss):
        dtype = matmul_dtype(x, weight)
        with torch.autocast(x.device.type, enabled=False):
            saved = kept.to(dtype)
            inputs = (saved if kept is x else x.to(dtype)).reshape(-1, x.shape[-1])
            weights = weight.to(dtype)
            targets_flat = targets.reshape(-1)
            local, in_slice = slice_targets(targets_flat, how.vocab_start, weight.shape[0])
            row_max, sum_exp, target_logit = (inputs.new_zeros(inputs.shape[0], dtype=torch.float32)
                                              for _ in range(3))
            chunk = loss_chunk_tokens(weight.shape[0])
            for start in range(0, inputs.shape[0], chunk):
                rows = slice(start, start + chunk)
                logits = (inputs[rows] @ weights.t()).float()
                row_max[rows] = logits.amax(dim=-1)
                target_logit[rows] = torch.where(in_slice[rows], logits.gather(1, local[rows, None])[:, 0], 0.0)
                sum_exp[rows] = logits.sub_(row_max[rows, None]).exp_().sum(dim=-1)
                del logits
            stats = VocabularyStatistics(row_max, sum_exp, target_logit)
            if how.combine is not None:
                stats = how.combine(stats)
            log_sum_exp = stats.row_max + stats.sum_exp.log()
            valid = targets_flat != IGNORE_INDEX
            loss = torch.where(valid, log_sum_exp - stats.target_logit, 0.0).sum()
        ctx.save_for_backward(saved, weight, targets_flat, log_sum_exp)
        ctx.how, ctx.dtype, ctx.input_shape, ctx.input_dtype = how, dtype, x.shape, x.dtype
        # "mean" divides by this call's count (0 / 0 = NaN when nothing counts, as F.cross_entropy).
        return loss / valid.sum() if how.reduction == "mean" else loss

    @staticmethod
    def backward(ctx, grad_loss):
        saved, weight, targets_flat, log_sum_exp = ctx.saved_tensors
        how, dtype = ctx.how, ctx.dtype
        with torch.autocast(saved.device.type, enabled=False):
            inputs = (saved if how.restore_input is None else how.restore_input(saved)).reshape(-1, saved.shape[-1])
            weights = weight.to(dtype)
            local, in_slice = slice_targets(targets_flat, how.vocab_start, weight.shape[0])
            valid = targets_flat != IGNORE_INDEX
            scale = grad_loss / valid.sum() if how.reduction == "mean" else grad_loss
            row_scale = torch.where(valid, scale.float(), 0.0)[:, None]
            minus_one_at_target = torch.where(in_slice, -1.0, 0.0)[:, None]
            grad_inputs = torch.empty_like(inputs)
            grad_weight = torch.zeros_like(weights)
            chunk = loss_chunk_tokens(weight.shape[0])
            for start in range(0, inputs.shape[0], chunk):
                rows = slice(start, start + chunk)
                probs = (inputs[rows] @ weights.t()).float().sub_(log_sum_exp[rows, None]).exp_()
                # scatter_add, not indexing by the rows that hold their target: no host sync on a GPU
                probs.scatter_add_(1, local[rows, None], minus_one_at_target[rows]).mul_(row_scale[rows])
                grad_logits = probs.to(dtype)
                del probs
                torch.mm(grad_logits, weights, out=grad_inputs[rows])
                grad_weight.addmm_(grad_logits.t(), inputs[rows])
                del grad_logits
        return grad_inputs.view(ctx.input_shape).to(ctx.input_dtype), None, grad_weight.to(weight.dtype), None, None


def slice_targets(targets: torch.Tensor, vocab_start: int, vocab_slice: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each target's row in this vocabulary slice (clamped into it, so that it can always index),
    and whether the target is in the slice at all (IGNORE_INDEX never is)."""
    local = targets - vocab_start
    in_slice = (local >= 0) & (local < vocab_slice)
    return local.clamp(0, vocab_slice - 1), in_slice


def linear_cross_entropy(x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                         how: ChunkedLoss = ChunkedLoss(), kept: torch.Tensor | None = None) -> torch.Tensor:
    """The loss of logits x W^T against `targets` (see LinearCrossEntropy), without making them all.
    `kept`: what backward keeps in place of x when how.restore_input rebuilds x from it."""
    if how.reduction not in ("mean", "sum"):
        raise ValueError(f"reduction must be 'mean' or 'sum', got {how.reduction!r}")
    return LinearCrossEntropy.apply(x, x if kept is None else kept, weight, targets, how)


class LMHead(nn.Linear):
    """The vocabulary projection. Without targets it returns the logits (sampling, tests); with
    targets it returns the loss through linear_cross_entropy, the logits never made whole. The loss
    is computed inside this module's call so that whatever wraps a module's call (ZeRO-3 gathers a
    unit's weights around it) wraps the loss's use of the weight too."""

    def __init__(self, hidden: int, vocab_size: int):
        super().__init__(hidden, vocab_size, bias=False)

    def forward(self, x, targets=None, reduction: str = "mean"):
        if targets is None:
            return super().forward(x)
        return linear_cross_entropy(x, self.weight, targets, ChunkedLoss(reduction))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig, seed: int = 0):
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.hidden, cfg.norm_eps)
        self.lm_head = LMHead(cfg.hidden, cfg.vocab_size)
        init_reference_parameters(self, seed)

    def embed(self, tokens):
        return self.tok_embeddings(tokens)

    def rope(self, positions):
        return rotary_tables(positions, self.cfg.head_dim, self.cfg.rope_theta)

    def head_loss(self, h, targets=None, reduction: str = "mean"):
        """Final norm and LM head: the loss if targets are given (see LMHead), else the logits."""
        return self.lm_head(self.norm(h), targets, reduction)

    def forward(self, tokens, targets=None, positions=None, reduction: str = "mean"):
        if positions is None:
            positions = torch.arange(tokens.shape[1], device=tokens.device)
        h, rope = self.embed(tokens), self.rope(positions)
        for layer in self.layers:
            h = layer(h, rope)
        return self.head_loss(h, targets, reduction)

    @torch.no_grad()
    def forward_cached(self, tokens, kv_caches: list[KVCache]):
        """The logits [b, s, vocab] of tokens [b, s] at the s positions after those the caches (one
        per layer) hold, which keep these too: a prompt once, then each new token alone. Equal to
        forward() over the whole sequence at these positions (tests/test_sample.py)."""
        start = kv_caches[0].length
        h, rope = self.embed(tokens), self.rope(torch.arange(start, start + tokens.shape[1], device=tokens.device))
        for layer, cache in zip(self.layers, kv_caches, strict=True):
            h = layer(h, rope, cache)
        return self.head_loss(h)


# ----------------------------------------------------------------------------- initialisation

def reference_init(name: str, shape, cfg: GPTConfig, seed: int) -> torch.Tensor:
    """The reference value of parameter `name` (as named in GPT.named_parameters()), in float32.

    Norm weights start at one. Every other tensor is normal(0, init_std) drawn from a generator
    seeded by (seed, name); the projections that write into the residual stream (o_proj, and
    down_proj: the dense MLP's, the shared expert's and the stacked experts' ``experts.down_proj``)
    are scaled down by sqrt(2 * n_layers) so the residual's variance does not grow with depth
    (the GPT-2 recipe). Drawn on the CPU whatever the device a model is made on (lesson 07 makes
    its chunks on the GPU): the same values everywhere.
    """
    if name.endswith("norm.weight"):
        return torch.ones(shape, device="cpu")
    std = cfg.init_std
    if name.removesuffix(".weight").endswith(("o_proj", "down_proj")):
        std /= math.sqrt(2 * cfg.n_layers)
    generator = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    return torch.empty(shape, device="cpu").normal_(0.0, std, generator=generator)


@torch.no_grad()
def init_reference_parameters(model: nn.Module, seed: int) -> None:
    """Every parameter set to its reference value. A model built on the meta device (under
    ``with torch.device("meta"):``) has shapes and no values: nothing is drawn, so a full-size
    model's shares can be built and counted without the memory of the full tensors."""
    for name, param in model.named_parameters():
        if not param.is_meta:
            param.copy_(reference_init(name, param.shape, model.cfg, seed))


# ----------------------------------------------------------------------------- formulas

def count_parameters(cfg: GPTConfig) -> dict[str, int]:
    """Parameter counts by kind.

    'matmul_active' is what one token multiplies through: attention, the router, its k routed
    experts, the shared expert and the LM head. It is the N of the 6N FLOPs rule, which leaves out
    embeddings (a lookup) and norms; a model's published "active parameters" add the embedding.
    'experts' is the routed experts' stacked weights over all layers: what expert parallelism splits.
    """
    h, hd = cfg.hidden, cfg.head_dim
    attention = h * cfg.n_heads * hd * 2 + h * cfg.n_kv_heads * hd * 2
    expert = 3 * h * cfg.ffn_hidden
    if cfg.n_experts:
        always = h * cfg.n_experts + cfg.n_shared_experts * expert   # router, shared expert
        ffn_total = cfg.n_experts * expert + always
        ffn_active = cfg.experts_per_token * expert + always
    else:
        ffn_total = ffn_active = expert
    norms = (2 * cfg.n_layers + 1) * h
    embedding = cfg.vocab_size * h
    head = h * cfg.vocab_size
    total = embedding + cfg.n_layers * (attention + ffn_total) + norms + head
    return {
        "total": total,
        "embedding": embedding,
        "matmul_active": cfg.n_layers * (attention + ffn_active) + head,
        "experts": cfg.n_layers * cfg.n_experts * expert,
    }


def flops_per_token(cfg: GPTConfig, seq_len: int) -> int:
    """Training FLOPs per token: forward (2 per multiply-add) plus backward (twice the forward).

    6 * N for the weight matmuls, plus 12 * n_layers * seq_len * (n_heads * head_dim) for the two
    attention matmuls (q k^T and p v). The attention term counts the full s x s score matrix, the
    usual convention for MFU, although a causal kernel can skip the masked half. With experts it
    counts k experts per token, the dropless work: in capacity mode every dropped choice saves
    6 * 3 * hidden * ffn_hidden FLOPs of it.
    """
    attention_term = 12 * cfg.n_layers * seq_len * cfg.n_heads * cfg.head_dim
    return 6 * count_parameters(cfg)["matmul_active"] + attention_term
