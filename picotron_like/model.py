"""
The reference GPT: the single-device ground truth every lesson is proven equal to.

A Llama-style decoder, small enough to read in one sitting:

    tokens ─► embedding ─► [ RMSNorm ─► attention ─► + ─► RMSNorm ─► SwiGLU MLP ─► + ] × n_layers
                                (RoPE, causal, GQA)   │                 (or MoE)     │
                                                      residual                       residual
           ─► RMSNorm ─► lm_head ─► logits ─► cross-entropy

Three seams let later lessons parallelise this model without editing this file:

- every weight matrix is its own ``nn.Linear`` attribute (``q_proj``, ``gate_proj``, ...), so
  tensor parallelism (lesson 02) swaps them for column- and row-parallel layers;
- ``GPT.forward`` is three calls (``embed``, the layers, ``head_loss``) over an ``nn.ModuleList``,
  so pipeline parallelism (lesson 03) can give each stage a slice of the layers;
- the attention core is a replaceable function (``Attention.attention_core``) that receives
  K/V *before* they are repeated for grouped-query attention, so context parallelism (lesson 04) can
  pass fewer bytes around its ring; the loss is a replaceable function too (``GPT.cross_entropy``),
  so lesson 02 can plug in a vocab-parallel loss.

Initialisation is a pure function of (seed, parameter name): ``reference_init`` draws every tensor
from its own generator. A sharded layer that owns rows 64..127 of ``layers.3.attn.q_proj.weight``
draws the full tensor the same way and keeps its slice, so a distributed run starts from exactly
the reference parameters, whatever the construction order or the number of ranks.

The two formulas used for MFU and memory predictions live here too: ``count_parameters`` and
``flops_per_token`` (6 FLOPs per matmul parameter per token, plus the attention term).
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass, replace

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
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    init_std: float = 0.02

    @property
    def head_dim(self) -> int:
        return self.hidden // self.n_heads

    def __post_init__(self):
        problems = []
        if self.hidden % self.n_heads:
            problems.append(f"hidden={self.hidden} is not divisible by n_heads={self.n_heads}")
        if self.n_heads % self.n_kv_heads:
            problems.append(f"n_heads={self.n_heads} is not divisible by n_kv_heads={self.n_kv_heads}")
        if self.head_dim % 2:
            problems.append(f"head_dim={self.head_dim} must be even for rotary embeddings")
        if self.n_experts and not 0 < self.experts_per_token <= self.n_experts:
            problems.append(f"experts_per_token={self.experts_per_token} must be in 1..n_experts={self.n_experts}")
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

    K and V arrive un-repeated; each group of heads // kv_heads query heads shares one K/V head.
    """
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


class Attention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.head_dim = cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden, cfg.n_heads * cfg.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.hidden, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.hidden, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.hidden, bias=False)
        self.attention_core = causal_attention

    def forward(self, x, rope):
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        # Head counts and sequence length are read off the projections, not the config: under
        # tensor parallelism a rank holds only some heads, and under sequence parallelism the
        # projection's output covers more tokens than its input.
        batch, seq = q.shape[:2]
        q, k, v = (t.view(batch, seq, -1, self.head_dim).transpose(1, 2) for t in (q, k, v))
        cos, sin = rope
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out = self.attention_core(q, k, v)
        return self.o_proj(out.transpose(1, 2).reshape(batch, seq, -1))


class SwiGLU(nn.Module):
    def __init__(self, hidden: int, ffn_hidden: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, ffn_hidden, bias=False)
        self.up_proj = nn.Linear(hidden, ffn_hidden, bias=False)
        self.down_proj = nn.Linear(ffn_hidden, hidden, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MixtureOfExperts(nn.Module):
    """Top-k routed SwiGLU experts, dropless: every token reaches its k experts.

    The gate weights are the softmax over all experts, renormalised over the chosen k.
    Every expert runs even on zero tokens, so every parameter always receives a gradient (zeros
    when unused) and data-parallel gradient buckets never wait for a gradient that never comes.
    """

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.experts_per_token = cfg.experts_per_token
        self.router = nn.Linear(cfg.hidden, cfg.n_experts, bias=False)
        self.experts = nn.ModuleList(SwiGLU(cfg.hidden, cfg.ffn_hidden) for _ in range(cfg.n_experts))

    def route(self, tokens):
        """(gate weights [n, k], expert ids [n, k]) for tokens [n, hidden]."""
        probs = self.router(tokens).float().softmax(dim=-1)
        weights, expert_ids = probs.topk(self.experts_per_token, dim=-1)
        return weights / weights.sum(dim=-1, keepdim=True), expert_ids

    def forward(self, x):
        tokens = x.reshape(-1, x.shape[-1])
        weights, expert_ids = self.route(tokens)
        out = torch.zeros_like(tokens)
        for index, expert in enumerate(self.experts):
            token_rows, slot = (expert_ids == index).nonzero(as_tuple=True)
            expert_out = expert(tokens[token_rows]) * weights[token_rows, slot, None].type_as(tokens)
            out = out.index_add(0, token_rows, expert_out)
        return out.view_as(x)


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.hidden, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.hidden, cfg.norm_eps)
        self.mlp = MixtureOfExperts(cfg) if cfg.n_experts else SwiGLU(cfg.hidden, cfg.ffn_hidden)

    def forward(self, x, rope):
        x = x + self.attn(self.attn_norm(x), rope)
        return x + self.mlp(self.mlp_norm(x))


# A target equal to IGNORE_INDEX (padding, a prompt the model should not learn to write) adds
# nothing to the loss and is not counted in its denominator.
IGNORE_INDEX = -100


def cross_entropy_loss(logits: torch.Tensor, targets: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """Next-token loss over the tokens whose target is not IGNORE_INDEX, computed in float32.

    reduction "mean" divides by the number of such targets (the reference); "sum" does not, so
    that a distributed step can divide by the count of the *global* batch instead (train.py).
    """
    return F.cross_entropy(logits.float().flatten(0, -2), targets.flatten(), ignore_index=IGNORE_INDEX,
                           reduction=reduction)


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig, seed: int = 0):
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.hidden, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.hidden, cfg.vocab_size, bias=False)
        self.cross_entropy = cross_entropy_loss
        init_reference_parameters(self, seed)

    def embed(self, tokens):
        return self.tok_embeddings(tokens)

    def rope(self, positions):
        return rotary_tables(positions, self.cfg.head_dim, self.cfg.rope_theta)

    def head_loss(self, h, targets=None, reduction: str = "mean"):
        """Final norm and LM head; the loss if targets are given (see cross_entropy_loss), else the logits."""
        logits = self.lm_head(self.norm(h))
        return logits if targets is None else self.cross_entropy(logits, targets, reduction=reduction)

    def forward(self, tokens, targets=None, positions=None, reduction: str = "mean"):
        if positions is None:
            positions = torch.arange(tokens.shape[1], device=tokens.device)
        h, rope = self.embed(tokens), self.rope(positions)
        for layer in self.layers:
            h = layer(h, rope)
        return self.head_loss(h, targets, reduction)


# ----------------------------------------------------------------------------- initialisation

def reference_init(name: str, shape, cfg: GPTConfig, seed: int) -> torch.Tensor:
    """The reference value of parameter `name` (as named in GPT.named_parameters()), in float32.

    Norm weights start at one. Every other tensor is normal(0, init_std) drawn from a generator
    seeded by (seed, name); the two projections that write into the residual stream (o_proj,
    down_proj) are scaled down by sqrt(2 * n_layers) so the residual's variance does not grow
    with depth (the GPT-2 recipe).
    """
    if name.endswith("norm.weight"):
        return torch.ones(shape)
    std = cfg.init_std
    if name.endswith(("o_proj.weight", "down_proj.weight")):
        std /= math.sqrt(2 * cfg.n_layers)
    generator = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    return torch.empty(shape).normal_(0.0, std, generator=generator)


@torch.no_grad()
def init_reference_parameters(model: nn.Module, seed: int) -> None:
    for name, param in model.named_parameters():
        param.copy_(reference_init(name, param.shape, model.cfg, seed))


# ----------------------------------------------------------------------------- formulas

def count_parameters(cfg: GPTConfig) -> dict[str, int]:
    """Parameter counts by kind. 'matmul_active' is what a token multiplies through (top-k experts
    only); it is the N of the 6N FLOPs rule, which leaves out embeddings (a lookup) and norms."""
    h, hd = cfg.hidden, cfg.head_dim
    attention = h * cfg.n_heads * hd * 2 + h * cfg.n_kv_heads * hd * 2
    expert = 3 * h * cfg.ffn_hidden
    if cfg.n_experts:
        ffn_total = cfg.n_experts * expert + h * cfg.n_experts
        ffn_active = cfg.experts_per_token * expert + h * cfg.n_experts
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
    }


def flops_per_token(cfg: GPTConfig, seq_len: int) -> int:
    """Training FLOPs per token: forward (2 per multiply-add) plus backward (twice the forward).

    6 * N for the weight matmuls, plus 12 * n_layers * seq_len * (n_heads * head_dim) for the two
    attention matmuls (q k^T and p v). The attention term counts the full s x s score matrix, the
    usual convention for MFU, although a causal kernel can skip the masked half.
    """
    attention_term = 12 * cfg.n_layers * seq_len * cfg.n_heads * cfg.head_dim
    return 6 * count_parameters(cfg)["matmul_active"] + attention_term
