"""
The reference GPT: the single-device ground truth every lesson is proven equal to.

A Llama-style decoder, small enough to read in one sitting:

    tokens ─► embedding ─► [ RMSNorm ─► attention ─► + ─► RMSNorm ─► SwiGLU MLP ─► + ] × n_layers
                                (RoPE, causal, GQA)   │                 (or MoE)     │
                                                      residual                       residual
           ─► RMSNorm ─► lm_head ─► logits ─► cross-entropy

Three parts live in modules of their own, each named for what it is: the chunked cross-entropy
the LM head computes (picotron_like.loss), the mixture of experts that replaces the MLP when the
config has experts (picotron_like.moe), and the KV cache for generating text
(picotron_like.kv_cache).

Four seams let later lessons parallelise this model without editing this file:

- every weight matrix is its own ``nn.Linear`` attribute (``q_proj``, ``gate_proj``, ...), so
  tensor parallelism (lesson 02) swaps them for column- and row-parallel layers;
- ``GPT.forward`` is three calls (``embed``, the layers, ``head_loss``) over an ``nn.ModuleList``,
  so pipeline parallelism (lesson 03) can give each stage a slice of the layers;
- the attention core is a replaceable function (``Attention.attention_core``) that receives
  K/V *before* they are repeated for grouped-query attention, so context parallelism (lesson 04) can
  pass fewer bytes around its ring; the LM head computes the loss itself, chunk by chunk
  (``LMHead``), so lesson 02 swaps in a head split by vocabulary;
- a mixture-of-experts layer routes its tokens and hands them to a replaceable dispatch
  (``MixtureOfExperts.expert_compute``) over experts stacked in 3-D parameters, so expert
  parallelism (lesson 05) can send tokens to the ranks that hold their experts.

Initialisation is a pure function of (seed, parameter name): ``reference_init`` draws every tensor
from its own generator. A sharded layer that owns rows 64..127 of ``layers.3.attn.q_proj.weight``
draws the full tensor the same way and keeps its slice, so a distributed run starts from exactly
the reference parameters, whatever the construction order or the number of ranks. Stacked expert
weights ``[n_experts, ...]`` are drawn whole in the same way; an expert-parallel rank keeps its
experts' slice of dim 0.

The two formulas used for MFU and memory predictions live here too: ``count_parameters`` and
``flops_per_token`` (6 FLOPs per matmul parameter per token, plus the attention term).
"""

from __future__ import annotations

import inspect
import math
import zlib
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from picotron_like import moe
from picotron_like.kv_cache import KVCache, cached_attention
from picotron_like.loss import LossSettings, linear_cross_entropy

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
    # The mixture-of-experts options (see picotron_like.moe); a dense model must leave them alone.
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

    def __post_init__(self):
        problems = []
        if self.hidden % self.n_heads:
            problems.append(f"hidden={self.hidden} is not divisible by n_heads={self.n_heads}")
        if self.n_heads % self.n_kv_heads:
            problems.append(f"n_heads={self.n_heads} is not divisible by n_kv_heads={self.n_kv_heads}")
        if self.head_dim % 2:
            problems.append(f"head_dim={self.head_dim} must be even for rotary embeddings")
        problems += moe.config_problems(self)
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


# On CUDA, SDPA's kernels in the order torchtitan pins them: cuDNN's (the fastest on H100 and later
# where it takes the shape), FlashAttention-2, the memory-efficient one, then the math fallback.
# torch's own order is flash, efficient, math, then cuDNN: after math, which takes every shape, so
# cuDNN never runs. A CPU has its own two (a flash kernel for the CPU and math) and keeps torch's.
CUDA_ATTENTION_PRIORITY = (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                           SDPBackend.MATH)


ATTENTION_PRIORITIES = ("cudnn", "torch")     # --attention-priority


def attention_backends(device_type: str, priority: str = "cudnn") -> AbstractContextManager:
    """The context a run enters once around its steps (train.train): with `priority` "cudnn", SDPA's
    order CUDA_ATTENTION_PRIORITY on CUDA, where torch's sdpa_kernel takes one (set_priority,
    torch 2.6 and later); nothing elsewhere, or with "torch" (torch's own order). Around the steps,
    not inside causal_attention: a compiled block reads the priority when it is traced, and
    sdpa_kernel inside a compiled region has broken compilation and its cache (pytorch issues
    155898 and 194007)."""
    if priority not in ATTENTION_PRIORITIES:
        raise ValueError(f"attention priority must be one of {ATTENTION_PRIORITIES}, got {priority!r}")
    if (device_type != "cuda" or priority == "torch"
            or "set_priority" not in inspect.signature(sdpa_kernel).parameters):
        return nullcontext()
    return sdpa_kernel(list(CUDA_ATTENTION_PRIORITY), set_priority=True)


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


# ----------------------------------------------------------------------------- the model

def feed_forward(cfg: GPTConfig) -> nn.Module:
    """A block's FFN: one SwiGLU MLP, or a mixture of experts (picotron_like.moe) with DeepSeek's
    shared expert, a SwiGLU n_shared_experts experts wide, when the config asks for one."""
    if not cfg.n_experts:
        return SwiGLU(cfg.hidden, cfg.ffn_hidden)
    shared = SwiGLU(cfg.hidden, cfg.n_shared_experts * cfg.ffn_hidden) if cfg.n_shared_experts else None
    return moe.MixtureOfExperts(cfg, shared)


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.hidden, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.hidden, cfg.norm_eps)
        self.mlp = feed_forward(cfg)

    def forward(self, x, rope, kv_cache: KVCache | None = None):
        x = x + self.attn(self.attn_norm(x), rope, kv_cache)
        return x + self.mlp(self.mlp_norm(x))


class LMHead(nn.Linear):
    """The vocabulary projection. Without targets it returns the logits (sampling, tests); with
    targets it returns the loss through linear_cross_entropy, the logits never made whole. The loss
    is computed inside this module's call so that whatever wraps a module's call (ZeRO-3 gathers a
    unit's weights around it) wraps the loss's use of the weight too. `loss_settings`: how the loss
    runs (eager by default; lesson 07's --compile compiles its chunk bodies)."""

    loss_settings = LossSettings()

    def __init__(self, hidden: int, vocab_size: int):
        super().__init__(hidden, vocab_size, bias=False)

    def forward(self, x, targets=None, reduction: str = "mean"):
        if targets is None:
            return super().forward(x)
        return linear_cross_entropy(x, self.weight, targets, reduction, self.loss_settings)


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
