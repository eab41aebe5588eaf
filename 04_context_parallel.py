"""
Lesson 04 — context parallelism in one file: ring attention (with zigzag balancing) and Ulysses.

The problem. Activations grow with the sequence. Training the 8B shape on one 131,072-token
sequence saves about 900 GB of activations for backward in bf16 (``predicted_activation_bytes``
of the 8b preset): six H200s' worth of memory for one sequence, before a single weight. Data,
tensor and pipeline parallelism split the batch, the matrices and the layers, but every rank
still holds every token of its sequence.

The idea. Split the sequence. Everything in a transformer but attention is per token (embeddings,
norms, projections, the MLP, the loss), so a rank holding 1/cp of the tokens computes it alone.
Only attention talks, since a query attends to every earlier token's keys and values.

Ring attention. The cp ranks form a ring. Each holds its queries and one K/V block; at every step
it passes its K/V block to the next rank and, while it travels, attends over the block it holds.
After cp steps every query has seen every key:

        step 0          step 1          step 2          step 3        (cp = 4, "Q_r x KV_j")
    r0: Q0 x KV0  ──►  Q0 x KV3  ──►  Q0 x KV2  ──►  Q0 x KV1          each K/V block moves to the
    r1: Q1 x KV1  ──►  Q1 x KV0  ──►  Q1 x KV3  ──►  Q1 x KV2          next rank (one row down) per
    r2: Q2 x KV2  ──►  Q2 x KV1  ──►  Q2 x KV0  ──►  Q2 x KV3          step; its send hides behind
    r3: Q3 x KV3  ──►  Q3 x KV2  ──►  Q3 x KV1  ──►  Q3 x KV0          the current block's math

Each block returns its output and log-sum-exp (lse), merged exactly by the online-softmax rule
    lse = log(exp(lse_a) + exp(lse_b))    out = out_a * exp(lse_a - lse) + out_b * exp(lse_b - lse)
Backward recomputes each block from the saved lse and passes dK/dV around the ring to its owner.

Causal balance. Split contiguously, the last rank does cp times the first one's work and the ring
waits for it. The zigzag split cuts 2·cp chunks and gives rank i chunks i and 2·cp−1−i:

    contiguous, cp=4:   r0 [0 1] r1 [2 3] r2 [4 5] r3 [6 7]     blocks computed  1 : 2 : 3 : 4
    zigzag,     cp=4:   r0 [0 7] r1 [1 6] r2 [2 5] r3 [3 4]     chunk pairs      9 : 9 : 9 : 9

Ulysses (DeepSpeed). Re-shard instead: one all-to-all turns "all heads of my tokens" into "my heads
of all tokens", attention runs unchanged, a second all-to-all turns the output back. It needs the
head and kv-head counts divisible by cp.

The price, per layer and micro-batch of b sequences of S tokens, n_kv kv-heads of size d, e bytes:
    memory      activations of S/cp tokens per rank (+ one K/V block in flight for the ring)
    ring        forward (cp−1) K/V blocks of 2·b·(S/cp)·n_kv·d·e bytes, backward as many again
                plus cp float32 dK/dV blocks: ~2·b·S·n_kv·d·e per rank whatever cp, hidden
                behind attention compute, which grows with (S/cp)².
    Ulysses     4 all-to-alls of 2·b·(S/cp)·(2·n_heads + 2·n_kv)·d·e bytes per rank in all:
                shrinks as 1/cp, but attention cannot start before it arrives.
    gradients   every rank holds every weight: one all-reduce over the dp × cp ranks per step.

Run it:
    torchrun --nproc_per_node=4 04_context_parallel.py --cp 4                        # CPU, ~30 s
    torchrun --nproc_per_node=4 04_context_parallel.py --cp 4 --no-zigzag            # imbalance
    torchrun --nproc_per_node=4 04_context_parallel.py --cp 2 --dp 2 --cp-mode ulysses
    torchrun --nproc_per_node=3 04_context_parallel.py --cp 3 --seq-len 252          # odd: 6 zigzag chunks
    torchrun --nproc_per_node=8 04_context_parallel.py --cp 8 --preset 1b --seq-len 32768 --micro-batch-size 1

The lesson takes --cp and --dp (gradients summed by lesson 01's all-reduce over dp × cp), with
--cp-mode, --zigzag/--no-zigzag and --ring-kernel {fused,plain}; --tp and --pp are refused with a
line pointing to lesson 07, which composes context parallelism with the other axes.

What to look for: the loss falls as on one device (the tests prove equality to float32 precision);
activation memory per rank is that of S/cp tokens; the ring's bytes per step equal the formula;
the per-rank attention work is cp:1 unbalanced with --no-zigzag and flat with the zigzag split.

More: docs/04_context_parallel.md (derivations, the fused kernel, the loss, composition).
"""
from __future__ import annotations

import argparse
import functools
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from picotron_like import comm
from picotron_like.data import StepBatch
from picotron_like.lessons import load_lesson
from picotron_like.metrics import (ActivationMeter, CallObserver, MeteredRun, data_parallel_traffic, log0,
                                   log_compute_report, log_memory_rows, log_traffic_rows, predicted_activation_bytes)
from picotron_like.model import GPT, Attention, causal_attention, count_parameters
from picotron_like.topology import (ConfigError, GridShape, ProcessGrid, init_distributed, shutdown,
                                    validate_parallel_config)
from picotron_like.run_control import StepMeters
from picotron_like.train import (RankBatches, StepSettings, add_parallel_flags, add_training_flags, autocast_dtype,
                                 bucket_bytes_from_flags, build_optimizer, plan_run, train)

data_parallel = load_lesson("01_data_parallel")

# ============================================================================ the technique: splitting the sequence


@dataclass(frozen=True)
class SequenceSplit:
    """Which tokens of a sequence each cp rank holds: chunks of seq_len / n_chunks tokens.

    Contiguous: cp chunks, rank i holds chunk i. Zigzag: 2·cp chunks, rank i holds chunks i and
    2·cp−1−i. A rank's tokens are its chunks side by side, in that order. At cp = 1 there is
    nothing to balance and the one rank holds the whole sequence, zigzag or not: cutting it in two
    chunks anyway would drop the last token of an odd-length sequence.
    """

    cp: int
    zigzag: bool

    @property
    def n_chunks(self) -> int:
        return 2 * self.cp if self.zigzag and self.cp > 1 else self.cp

    def chunk_ids(self, cp_rank: int) -> tuple[int, ...]:
        return (cp_rank, self.n_chunks - 1 - cp_rank) if self.n_chunks > self.cp else (cp_rank,)

    def positions(self, cp_rank: int, seq_len: int) -> torch.Tensor:
        """The true positions of this rank's tokens: what RoPE must rotate them by."""
        chunk = seq_len // self.n_chunks
        return torch.cat([torch.arange(c * chunk, (c + 1) * chunk) for c in self.chunk_ids(cp_rank)])

    def shard(self, tokens: torch.Tensor, cp_rank: int) -> torch.Tensor:
        """This rank's columns of a [batch, seq_len] tensor (inputs or targets)."""
        return tokens.index_select(1, self.positions(cp_rank, tokens.shape[1]))

    def rank_order(self) -> list[int]:
        """Chunk ids in the order the ranks' tokens line up when gathered rank after rank."""
        return [c for rank in range(self.cp) for c in self.chunk_ids(rank)]


def context_parallel_batch(batch: StepBatch, split: SequenceSplit, cp_rank: int) -> StepBatch:
    """This rank's share of a step's batch: each micro-batch becomes (inputs, targets, positions)
    of this rank's tokens, which the step hands to the model as model(*micro_batch); GPT.forward
    rotates each token by its true position.

    Inputs and targets are cut at the same positions, so every token keeps its own next token as
    target, even the last token of a chunk, whose target is the first token of the next chunk.
    n_targets stays the count of the whole global batch: each rank's summed token losses divided
    by it is exactly its share of the one-device mean, whatever its own tokens hold.
    """
    return StepBatch([(split.shard(inputs, cp_rank), split.shard(targets, cp_rank),
                       split.positions(cp_rank, inputs.shape[1])) for inputs, targets in batch.micro_batches],
                     batch.n_targets)


def sequence_cut(grid, zigzag: bool):
    """RankBatches' cut for this cp rank (context_parallel_batch), or None at cp = 1,
    where every rank holds whole sequences and there is nothing to cut."""
    if grid.cp_size == 1:
        return None
    return functools.partial(context_parallel_batch, split=SequenceSplit(grid.cp_size, zigzag), cp_rank=grid.cp_rank)


RING_KERNELS = ("fused", "plain")


@dataclass(frozen=True)
class ContextParallel:
    """What an attention core needs to talk to its cp peers."""

    group: object
    size: int
    rank: int
    prev_rank: int            # global ranks, as torch.distributed's point-to-point calls want them
    next_rank: int
    split: SequenceSplit
    # How the ring computes one block (RING_KERNELS; see "one block in one fused kernel"). Fused by
    # default: it is the fast path and never holds a block's scores in memory. Plain spells the
    # block out; it is the reference the fused kernel is proven equal to, and what a reader follows.
    ring_kernel: str = "fused"

    @classmethod
    def from_grid(cls, grid: ProcessGrid, zigzag: bool, ring_kernel: str = "fused") -> "ContextParallel":
        return cls(grid.cp_group, grid.cp_size, grid.cp_rank, grid.cp_prev_rank, grid.cp_next_rank,
                   SequenceSplit(grid.cp_size, zigzag), ring_kernel)


# ============================================================================ the technique: attention of one block
#
# Queries are viewed as [b, kv_heads, group, s, d] and K/V as [b, kv_heads, 1, s, d]: broadcasting
# pairs every query head with its kv head, so grouped-query K/V are never repeated, neither in
# memory nor on the wire. Scores and softmax statistics are float32 even when the matmuls run in
# bf16: the lse is what merges blocks, and it must not carry bf16 rounding into every output.


def grouped_by_kv_head(t: torch.Tensor, n_kv: int) -> torch.Tensor:
    """[b, heads, s, d] -> [b, kv_heads, heads / kv_heads, s, d]: each kv head's query heads together."""
    b, n_heads, s, d = t.shape
    return t.reshape(b, n_kv, n_heads // n_kv, s, d)


def attention_block(q, k, v, causal: bool):
    """softmax(q k^T / sqrt(d)) v over one K/V block: (output, lse), both float32.

    causal: the block is on the diagonal (queries and keys are the same chunk), so query i sees
    keys 0..i of it. Otherwise the whole block is visible.
    """
    scores = (q @ k.transpose(-1, -2)).float() / math.sqrt(q.shape[-1])
    if causal:
        scores = scores.masked_fill(_above_diagonal(scores), float("-inf"))
    lse = scores.logsumexp(dim=-1)
    probs = (scores - lse.unsqueeze(-1)).exp()
    return (probs.to(v.dtype) @ v).float(), lse


def attention_block_backward(q, k, v, d_out, lse, delta, causal: bool):
    """Gradients (dq, dk, dv) of one block, recomputing its probabilities from the final lse.

    With the lse of the *whole* row (not just this block's), exp(scores - lse) is the true
    attention probability, so the usual softmax backward applies block by block:
        dv = P^T dO      dP = dO V^T      dS = P * (dP - delta)      dq = dS K / sqrt(d)      dk = dS^T Q / sqrt(d)
    with delta = rowsum(dO * O), the same for every block of a row.
    """
    scale = 1.0 / math.sqrt(q.shape[-1])
    scores = (q @ k.transpose(-1, -2)).float() * scale
    if causal:
        scores = scores.masked_fill(_above_diagonal(scores), float("-inf"))
    probs = (scores - lse.unsqueeze(-1)).exp()
    d_v = (probs.to(q.dtype).transpose(-1, -2) @ d_out).float().sum(dim=2)
    d_probs = (d_out @ v.transpose(-1, -2)).float()
    d_scores = (probs * (d_probs - delta.unsqueeze(-1))).to(q.dtype)
    d_q = (d_scores @ k).float() * scale
    d_k = (d_scores.transpose(-1, -2) @ q).float().sum(dim=2) * scale
    return d_q, d_k, d_v


def _above_diagonal(scores):
    rows, cols = scores.shape[-2:]
    return torch.ones(rows, cols, dtype=torch.bool, device=scores.device).triu(1)


def merge_blocks(out, lse, block_out, block_lse):
    """The online-softmax merge of two partial attention results over disjoint key sets."""
    new_lse = torch.logaddexp(lse, block_lse)
    out = out * (lse - new_lse).exp().unsqueeze(-1) + block_out * (block_lse - new_lse).exp().unsqueeze(-1)
    return out, new_lse


def visible_blocks(split: SequenceSplit, query_rank: int, key_rank: int, chunk: int):
    """(query slice, key slice, causal) for every chunk pair with something visible.

    Chunk ids are positions in the sequence, so visibility is a comparison: a query chunk sees an
    earlier key chunk fully, its own chunk causally, and a later one not at all (skipped: this is
    where the contiguous split's imbalance comes from, and where the zigzag split evens it out).
    """
    blocks = []
    for qi, q_chunk in enumerate(split.chunk_ids(query_rank)):
        for ki, k_chunk in enumerate(split.chunk_ids(key_rank)):
            if k_chunk <= q_chunk:
                blocks.append((slice(qi * chunk, (qi + 1) * chunk), slice(ki * chunk, (ki + 1) * chunk),
                               k_chunk == q_chunk))
    return blocks


# ============================================================================ the technique: ring attention


def ring_pass(send: torch.Tensor, cp: ContextParallel):
    """Start sending `send` to the next rank and receiving the previous rank's tensor of the same
    shape; returns a function that waits for both and returns what arrived.

    Both go in one batch_isend_irecv: with NCCL, a send and a receive issued one by one between
    the same pair of ranks (cp = 2: next and previous are the same rank) can each wait for the
    other and deadlock; batched, they are posted together.
    """
    received = torch.empty_like(send)
    requests = comm.call(dist.batch_isend_irecv, [comm.P2POp(dist.isend, send, cp.next_rank, cp.group),
                                                  comm.P2POp(dist.irecv, received, cp.prev_rank, cp.group)])

    def wait() -> torch.Tensor:
        for request in requests:
            request.wait()
        return received

    return wait


def kv_blocks_around_the_ring(kv: torch.Tensor, cp: ContextParallel):
    """Yield (owner's cp rank, K/V block) for the cp blocks of the ring, this rank's own first.

    The next block starts travelling before the caller computes on the current one, and is waited
    for only after: the overlap that hides the ring's communication behind attention's math.
    """
    for step in range(cp.size):
        arriving = ring_pass(kv, cp) if step < cp.size - 1 else None
        yield (cp.rank - step) % cp.size, kv
        if arriving is not None:
            kv = arriving()


class RingAttention(torch.autograd.Function):
    """Causal attention of this rank's queries over the K/V of the whole cp ring.

    Saved for backward: q, k, v, the output and the lse, all of S/cp tokens. Nothing of the
    other ranks is kept; backward fetches their K/V around the ring again. Each block is computed
    by the fused kernel or the plain functions (cp.ring_kernel).
    """

    @staticmethod
    def forward(ctx, q, k, v, cp: ContextParallel):
        ctx.fused = cp.ring_kernel == "fused" and fused_kernel_runs(q.device, q.dtype)
        block_attention = fused_attention_block if ctx.fused else attention_block
        grouped_q = grouped_by_kv_head(q, k.shape[1])
        chunk = q.shape[2] // len(cp.split.chunk_ids(cp.rank))
        out = torch.zeros(grouped_q.shape, dtype=torch.float32, device=q.device)
        lse = torch.full(grouped_q.shape[:-1], float("-inf"), device=q.device)
        kv = torch.stack((k, v)).unsqueeze(3)                 # one message per step: [2, b, n_kv, 1, s, d]
        for source, block in kv_blocks_around_the_ring(kv, cp):
            for rows, cols, causal in visible_blocks(cp.split, cp.rank, source, chunk):
                block_out, block_lse = block_attention(grouped_q[..., rows, :], block[0][..., cols, :],
                                                       block[1][..., cols, :], causal)
                out[..., rows, :], lse[..., rows] = merge_blocks(out[..., rows, :], lse[..., rows],
                                                                 block_out, block_lse)
        out = out.to(q.dtype).reshape(q.shape)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.cp = cp
        return out

    @staticmethod
    def backward(ctx, d_out):
        q, k, v, out, lse = ctx.saved_tensors
        cp, n_kv = ctx.cp, k.shape[1]
        chunk = q.shape[2] // len(cp.split.chunk_ids(cp.rank))
        grouped_q, d_out = grouped_by_kv_head(q, n_kv), grouped_by_kv_head(d_out.to(q.dtype), n_kv)
        out = grouped_by_kv_head(out, n_kv)
        delta = None if ctx.fused else (d_out.float() * out.float()).sum(dim=-1)
        d_q = torch.zeros(grouped_q.shape, dtype=torch.float32, device=q.device)
        # dK/dV of a block travel one step behind the block itself: each rank adds the gradient
        # its queries give the block it holds to the running sum that arrived from the previous
        # rank, and passes it on. After cp steps the sum has visited every rank and arrives,
        # complete, at the block's owner. Float32 on the wire: cp partial gradients summed in
        # bf16 would lose the small ones.
        d_kv_arriving = None
        for source, block in kv_blocks_around_the_ring(torch.stack((k, v)).unsqueeze(3), cp):
            d_kv = torch.zeros((2, *k.shape), dtype=torch.float32, device=q.device)
            for rows, cols, causal in visible_blocks(cp.split, cp.rank, source, chunk):
                block_q, block_k, block_v = grouped_q[..., rows, :], block[0][..., cols, :], block[1][..., cols, :]
                if ctx.fused:       # the kernel computes delta itself, from the final output
                    block_dq, block_dk, block_dv = fused_attention_block_backward(
                        block_q, block_k, block_v, d_out[..., rows, :], out[..., rows, :], lse[..., rows], causal)
                else:
                    block_dq, block_dk, block_dv = attention_block_backward(
                        block_q, block_k, block_v, d_out[..., rows, :], lse[..., rows], delta[..., rows], causal)
                d_q[..., rows, :] += block_dq
                d_kv[0][..., cols, :] += block_dk
                d_kv[1][..., cols, :] += block_dv
            if d_kv_arriving is not None:
                d_kv += d_kv_arriving()
            d_kv_arriving = ring_pass(d_kv, cp) if cp.size > 1 else None
        if d_kv_arriving is not None:
            d_kv = d_kv_arriving()
        return d_q.reshape(q.shape).to(q.dtype), d_kv[0].to(k.dtype), d_kv[1].to(v.dtype), None


def ring_attention(q, k, v, cp: ContextParallel):
    """Drop-in Attention.attention_core: q [b, heads, S/cp, d], k/v [b, kv_heads, S/cp, d]."""
    return RingAttention.apply(q, k, v, cp)


# ============================================================================ the technique: one block in one fused kernel
#
# attention_block spells a block out and pays for it: its scores, (S/cp)^2 float32 numbers per head,
# are built in memory, masked, exponentiated and multiplied. A flash-attention kernel computes the
# same output and lse tile by tile, without ever holding the scores. Its backward takes the lse
# and the output it is given instead of its own: handed the ring's final lse and output for these
# rows, it computes P = exp(scores - final lse) and delta = rowsum(dO * final O), which are exactly
# what attention_block_backward uses. So the ring merges fused blocks as it merges plain ones.
# PyTorch exposes these kernels as aten ops (those F.scaled_dot_product_attention dispatches to,
# but returning the lse): on the CPU in float32 and bf16, on CUDA (FlashAttention-2) in bf16 and
# fp16 only, so a float32 run on CUDA keeps the plain blocks. Both take grouped-query K/V as they
# are (kv-head j serves query heads j*group .. j*group+group-1) and sum dK/dV over each group.


def fused_kernel_runs(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether a flash kernel exists for tensors of this device and dtype."""
    return device.type == "cpu" or (device.type == "cuda" and dtype in (torch.bfloat16, torch.float16))


def flash_forward(q, k, v, causal: bool):
    """(output, lse) from the device's flash kernel: q [b, heads, s_q, d], k/v [b, kv_heads, s_k, d]."""
    if q.device.type == "cuda":
        return torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal)[:2]
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal)


def flash_backward(d_out, q, k, v, out, lse, causal: bool):
    """(dq, dk, dv) from the device's flash kernel, given the output and lse that the probabilities
    and delta are to be computed from; lse [b, heads, s_q], contiguous (the kernels assume it)."""
    if q.device.type == "cuda":
        # None for the cumulative sequence lengths selects the dense (not variable-length) kernel;
        # without dropout it reads neither the maximum lengths nor the random-number state.
        no_rng_state = torch.empty(0, dtype=torch.int64, device=q.device)
        return torch.ops.aten._scaled_dot_product_flash_attention_backward(
            d_out, q, k, v, out, lse, None, None, q.shape[2], k.shape[2], 0.0, causal, no_rng_state, no_rng_state)
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(d_out, q, k, v, out, lse, 0.0, causal)


def fused_attention_block(q, k, v, causal: bool):
    """attention_block in one kernel call: the same arguments (q [b, kv_heads, group, s, d], k/v
    [b, kv_heads, 1, s, d]) and the same results (output and lse, float32)."""
    b, n_kv, group, s, d = q.shape
    out, lse = flash_forward(q.reshape(b, n_kv * group, s, d), k.squeeze(2), v.squeeze(2), causal)
    return out.float().reshape(q.shape), lse.reshape(q.shape[:-1])


def fused_attention_block_backward(q, k, v, d_out, out, lse, causal: bool):
    """attention_block_backward in one kernel call: the same (dq, dk, dv), from the final output of
    these rows instead of their delta (the kernel computes delta from it)."""
    b, n_kv, group, s, d = q.shape
    d_out, by_head, out = (t.reshape(b, n_kv * group, s, d) for t in (d_out, q, out))
    d_q, d_k, d_v = flash_backward(d_out, by_head, k.squeeze(2), v.squeeze(2), out,
                                   lse.reshape(b, n_kv * group, s).contiguous(), causal)
    return d_q.float().reshape(q.shape), d_k.float(), d_v.float()


# ============================================================================ the technique: Ulysses all-to-all


def _reorder_chunks(x, order: list[int], n_chunks: int):
    """Permute the chunks of x's sequence dim (2) into `order`."""
    if order == sorted(order):
        return x
    chunks = x.chunk(n_chunks, dim=2)
    return torch.cat([chunks[i] for i in order], dim=2)


def ulysses_attention(q, k, v, cp: ContextParallel):
    """Drop-in Attention.attention_core: sequence-split in, all-to-all to head-split, the
    reference causal attention on whole sequences, all-to-all back to sequence-split.

        before: rank r has every head of tokens T_r       [b, heads, S/cp, d]
        after:  rank r has heads H_r of every token       [b, heads/cp, S, d]
    """
    b, n_heads, s, d = q.shape
    n_kv = k.shape[1]

    def per_destination(t):               # [b, heads, s, d] -> [b, cp, heads/cp, s, d]
        return t.reshape(b, cp.size, t.shape[1] // cp.size, s, d)

    # q, k and v in one message: destination j gets its q heads, then its k and v heads.
    packed = torch.cat([per_destination(q), per_destination(k), per_destination(v)], dim=2).movedim(1, 0)
    received = comm.AllToAll.apply(packed, cp.group)                     # [source rank, b, heads/cp, s, d]
    whole = received.movedim(0, 2).reshape(b, -1, cp.size * s, d)   # tokens of rank 0, then rank 1, ...
    # Gathered rank after rank, the zigzag chunks are out of order; causal attention needs them
    # in sequence order.
    rank_order = cp.split.rank_order()
    true_order = sorted(range(len(rank_order)), key=rank_order.__getitem__)
    whole = _reorder_chunks(whole, true_order, len(rank_order))
    heads, kv_heads = n_heads // cp.size, n_kv // cp.size
    q_heads, k_heads, v_heads = whole.split([heads, kv_heads, kv_heads], dim=1)
    out = _reorder_chunks(causal_attention(q_heads, k_heads, v_heads), rank_order, len(rank_order))
    back = comm.AllToAll.apply(out.reshape(b, heads, cp.size, s, d).movedim(2, 0), cp.group)
    return back.movedim(0, 1).reshape(b, n_heads, s, d)


# ============================================================================ the technique: plugging into the model


CP_MODES = {"ring": ring_attention, "ulysses": ulysses_attention}


def apply_context_parallel(model: torch.nn.Module, cp: ContextParallel, mode: str = "ring") -> torch.nn.Module:
    """Replace the attention core of every Attention in `model` (whatever holds Attention modules)
    with the context-parallel one.

    Nothing else changes: every other layer is per token and runs on this rank's S/cp tokens as
    it is. The gradients then need one more thing, done by the caller: a sum over the dp × cp
    ranks (build_model).
    """
    core = functools.partial(CP_MODES[mode], cp=cp)
    for module in model.modules():
        if isinstance(module, Attention):
            module.attention_core = core
    return model


def build_model(cfg, seed: int, grid: ProcessGrid, cp: ContextParallel, mode: str, device,
                bucket_bytes: int | None = None) -> torch.nn.Module:
    """The reference GPT with context-parallel attention cores, wrapped in lesson 01's bucketed data
    parallel over the dp × cp group instead of dp alone.

    Needed even at dp = 1. Each cp rank holds a full copy of the weights but computes only part
    of their gradient: the MLP weights' gradient from its own S/cp tokens, the K/V projections'
    from the dK/dV its ring brought home. Each rank's loss is its share of the global batch's
    mean (its summed token losses over the global target count, see context_parallel_batch), the
    shares add up to that mean, and so the gradient is the plain sum of the ranks' gradients:
    exactly what lesson 01's wrappers compute. Averaging instead (a mean of the cp ranks' means)
    would be right only if every rank held as many valid targets as every other; with masked
    targets one rank's part of a sequence may hold none at all. Skip the reduction and the cp
    copies step with different partial gradients and drift apart from the first step.

    Context parallelism adds nothing to the step itself: lesson 01's train_step and evaluate run
    as they are. The batch holds this rank's tokens and the global target count; the step sums
    the loss shares over the wrapper's dp × cp group, which gives the global batch's mean, and
    every cp rank then holds the same gradients, as dp replicas do (clipping needs no rule).
    """
    model = apply_context_parallel(GPT(cfg, seed=seed).to(device), cp, mode)
    return data_parallel.wrap_data_parallel(model, grid.dp_cp_group, "bucketed", bucket_bytes)


# ============================================================================ configuration rules


def validate_context_parallel(grid: GridShape, world_size: int, cfg, seq_len: int, zigzag: bool, mode: str) -> None:
    """Every rule, before any process group exists: the grid's, the sequence cut into whole parts
    (2·cp of them for the zigzag split), and Ulysses' heads."""
    validate_parallel_config(grid, world_size)
    problems = []
    parts = 2 * grid.cp if zigzag else grid.cp
    if grid.cp > 1 and seq_len % parts:
        problems.append(f"--seq-len {seq_len} is not divisible by {parts} "
                        f"({'2*cp for the zigzag split' if zigzag else 'cp'}); use a multiple of {parts}")
    problems += [f"{field}={getattr(cfg, field)} is not divisible by --cp {grid.cp}: Ulysses gives each cp rank "
                 f"whole heads; use --cp-mode ring or a cp that divides {getattr(cfg, field)}"
                 for field in ("n_heads", "n_kv_heads") if mode == "ulysses" and getattr(cfg, field) % grid.cp]
    if problems:
        raise ConfigError("bad parallel configuration:\n  - " + "\n  - ".join(problems))


def validate(cfg, grid: GridShape, shape, args, world_size: int) -> None:
    """plan_run's hook: this lesson's rules."""
    validate_context_parallel(grid, world_size, cfg, shape.seq_len, args.zigzag, args.cp_mode)


# ============================================================================ measuring the three challenges


class AttentionWork:
    """Query-key scores this rank's attention forward passes compute, counted from outside.

    While entered, Python's profiler hook (CallObserver) reports every call of the functions that
    compute scores, attention_block or fused_attention_block (the ring) and causal_attention
    (Ulysses), and the meter reads the call's q and k. A call over queries [..., s_q, d] and keys
    [..., s_k, d] counts every query-key pair; a diagonal block counts in full, as the plain
    function computes it whole and then masks it (a flash kernel skips the tiles above the
    diagonal; the count, like predicted_attention_work, ignores that).
    """

    def __init__(self):
        self.scores = 0
        self._calls = CallObserver((attention_block, fused_attention_block, causal_attention), on_call=self._count)

    def _count(self, frame) -> None:
        q, k = frame.f_locals["q"], frame.f_locals["k"]
        self.scores += q.shape[:-1].numel() * k.shape[-2]

    def __enter__(self):
        self._calls.__enter__()
        return self

    def __exit__(self, *exc):
        return self._calls.__exit__(*exc)


def predicted_cp_traffic(cfg, micro_batch: int, seq_len: int, cp: int, mode: str, n_micro: int,
                         element_bytes: int = 4) -> dict:
    """Payload bytes per optimizer step on the cp group, by (collective, group), for the model's
    n_layers layers and its heads."""
    tokens, d = micro_batch * seq_len // cp, cfg.head_dim
    per_step = cfg.n_layers * n_micro
    if mode == "ring":
        if cp == 1:
            return {}       # a ring of one: its own block, nothing passed
        kv_block = 2 * tokens * cfg.n_kv_heads * d
        # forward: cp-1 K/V blocks; backward: cp-1 K/V blocks again and cp float32 dK/dV blocks
        p2p = per_step * (2 * (cp - 1) * kv_block * element_bytes + cp * kv_block * 4)
        return {("isend", "cp"): p2p, ("irecv", "cp"): p2p}
    # forward: q, k, v out and the output back; backward: the same two in reverse (at cp = 1 the
    # all-to-alls still run, over a group of one, and send nothing off the rank)
    return {("all_to_all_single", "cp"):
            per_step * 2 * tokens * (2 * cfg.n_heads + 2 * cfg.n_kv_heads) * d * element_bytes}


def predicted_attention_work(cfg, micro_batch: int, seq_len: int, cp: int, zigzag: bool, cp_rank: int,
                             n_micro: int, mode: str = "ring") -> int:
    """Query-key scores one rank's attention forward computes per optimizer step.

    A diagonal (causal) block is computed whole and then masked, so it counts in full.
    Contiguous ring, chunk c = S/cp: rank r computes r full blocks and its diagonal, (r+1)·c².
    Zigzag ring, chunk c = S/2cp: 3 chunk pairs on its own block, 2 on each of the cp−1 others,
    (2·cp+1)·c² on every rank. Ulysses: heads/cp heads over the whole sequence, S².
    """
    per_head = micro_batch * n_micro * cfg.n_layers * cfg.n_heads
    if mode == "ulysses":
        return per_head * seq_len ** 2 // cp
    if zigzag and cp > 1:
        return per_head * (2 * cp + 1) * (seq_len // (2 * cp)) ** 2
    return per_head * (cp_rank + 1) * (seq_len // cp) ** 2


def gather_attention_work(scores: int, cp: ContextParallel) -> list[int]:
    """Every cp rank's count, on every rank. A CPU tensor: report bookkeeping, which the default
    group hands to gloo on a GPU node."""
    work = torch.tensor([scores], dtype=torch.float64)
    everyone = torch.empty(cp.size, dtype=torch.float64)
    comm.call(comm.all_gather_single, everyone, work, group=cp.group)
    return [int(w) for w in everyone.tolist()]


def log_memory(run: MeteredRun, shape, cp_size: int, mode: str) -> None:
    seq, micro, tokens = shape.seq_len, shape.micro_batch_size, shape.seq_len // cp_size
    # Either mode keeps what the reference attention keeps for its S/cp tokens: the ring its own
    # q, k, v, output and lse (the other ranks' K/V are fetched again in backward), Ulysses q, k and
    # v as views of the one buffer the all-to-all delivered them in, as large as the three.
    log_memory_rows(run, f"one rank; a micro-batch here is {micro} x {tokens} tokens",
                    predicted_activation_bytes(run.cfg, micro, tokens))
    log0(f"the same micro-batch on one device (seq {seq}): "
         f"{predicted_activation_bytes(run.cfg, micro, seq) / 1e6:.3f} MB predicted; per cp rank, that of "
         f"seq/cp = {tokens} tokens")


def log_communication(run: MeteredRun, shape, grid: ProcessGrid, mode: str, compute_dtype) -> None:
    """The cp traffic, and lesson 01's gradient all-reduce over dp x cp: the cp ranks hold other
    tokens of the same sequences, so their gradients are shares of one sum too."""
    cfg, cp, n_micro = run.cfg, grid.cp_size, shape.grad_accum
    kv_bytes = torch.finfo(compute_dtype).bits // 8
    log_traffic_rows(run, f"cp={cp} {mode}; gradients over dp x cp = {grid.dp_size} x {cp}",
                     predicted_cp_traffic(cfg, shape.micro_batch_size, shape.seq_len, cp, mode, n_micro, kv_bytes),
                     data_parallel_traffic(run.n_params, group="dp_cp"), loss_groups=("dp_cp",))
    kv_block = 2 * shape.micro_batch_size * (shape.seq_len // cp) * cfg.n_kv_heads * cfg.head_dim
    if mode == "ring":
        log0(f"ring, per layer and micro-batch: cp-1 = {cp - 1} K/V blocks of {kv_block * kv_bytes / 1e3:.1f} kB "
             f"forward, {cp - 1} again backward, and cp = {cp} float32 dK/dV blocks of "
             f"{kv_block * 4 / 1e3:.1f} kB; x {cfg.n_layers} layers x {n_micro} micro-batches")
    other = "ulysses" if mode == "ring" else "ring"
    other_bytes = sum(v for (kind, _), v in predicted_cp_traffic(cfg, shape.micro_batch_size, shape.seq_len, cp, other,
                                                                 n_micro, kv_bytes).items()
                      if kind != "irecv")
    log0(f"the {other} mode would move {other_bytes / 1e6:.4f} MB payload per step here (formula; Ulysses "
         f"needs heads and kv-heads divisible by cp)")


def log_attention_work(attention_work: AttentionWork, cp: ContextParallel, cfg, shape, mode: str, zigzag: bool) -> None:
    """Measured on one step (the meter is entered for one), next to the formula."""
    work = gather_attention_work(attention_work.scores, cp)
    predicted = [predicted_attention_work(cfg, shape.micro_batch_size, shape.seq_len, cp.size, zigzag, r,
                                          shape.grad_accum, mode) for r in range(cp.size)]
    log0(f"\n== attention work per cp rank (query-key scores computed per step, {mode}, "
         f"{'zigzag' if zigzag else 'contiguous'}) ==")
    log0("cp rank   " + "".join(f"{r:>12}" for r in range(cp.size)))
    log0("measured  " + "".join(f"{w:>12.4g}" for w in work))
    log0("predicted " + "".join(f"{w:>12.4g}" for w in predicted))
    log0(f"max/min = {max(work) / max(min(work), 1):.2f} (every step waits for the busiest rank)")


def report(run: MeteredRun, plan, args, grid: ProcessGrid, cp: ContextParallel, attention_work: AttentionWork,
           compute_dtype) -> None:
    log_memory(run, plan.shape, cp.size, args.cp_mode)
    log_communication(run, plan.shape, grid, args.cp_mode, compute_dtype)
    log_attention_work(attention_work, cp, plan.cfg, plan.shape, args.cp_mode, args.zigzag)
    log_compute_report(run)


# ============================================================================ main


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description="Lesson 04: context parallelism (run with torchrun).",
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_parallel_flags(parser, axes=("dp", "cp"), fill_axis="cp")
    add_context_parallel_flags(parser)
    add_training_flags(parser, seq_len=256, micro_batch_size=4, grad_accum=2, steps=20)
    return parser.parse_args(argv)


def add_context_parallel_flags(parser) -> None:
    """This lesson's flags."""
    parser.add_argument("--cp-mode", choices=tuple(CP_MODES), default="ring",
                        help="ring: K/V blocks around a ring of p2p sends; ulysses: all-to-all to heads and back")
    parser.add_argument("--zigzag", action=argparse.BooleanOptionalAction, default=True,
                        help="zigzag split (rank i holds chunks i and 2cp-1-i) balancing causal work; "
                             "--no-zigzag: contiguous split")
    parser.add_argument("--ring-kernel", choices=RING_KERNELS, default="fused",
                        help="fused: each K/V block in one flash-attention kernel (CPU: float32 and bf16; CUDA: "
                             "bf16 and fp16, float32 runs plain); plain: the block's scores spelled out, the reference")


def main(argv=None):
    args = parse_args(argv)
    plan = plan_run(args, validate)
    device = init_distributed()
    grid = ProcessGrid(plan.grid)
    cp = ContextParallel.from_grid(grid, args.zigzag, args.ring_kernel)
    compute_dtype = autocast_dtype(args.dtype, device)
    model = build_model(plan.cfg, args.seed, grid, cp, args.cp_mode, device, bucket_bytes_from_flags(args, device))
    optimizer = build_optimizer(model.module, args.lr)
    settings = StepSettings(device, compute_dtype, args.max_grad_norm, tail=args.step_tail)
    shape = plan.shape
    log0(f"lesson 04: context parallel, cp={cp.size} ({args.cp_mode}, {'zigzag' if args.zigzag else 'contiguous'} "
         f"split), {count_parameters(plan.cfg)['total']:,} parameters, seq {shape.seq_len} = "
         f"{shape.seq_len // cp.size} tokens per rank, {shape.tokens_per_step:,} tokens per step")
    log0(grid.shape.picture())

    activations, attention_work = ActivationMeter(model), AttentionWork()
    step = functools.partial(data_parallel.train_step, model, optimizer, settings=settings)
    # dp: this rank's share of the global batch; cp: its cut of each sequence
    batches = RankBatches(plan.batches, grid.dp_rank, device, cut=sequence_cut(grid, args.zigzag),
                          val=plan.val_batches)
    throughput = train(args, optimizer, step, batches,
                       evaluate=functools.partial(data_parallel.evaluate, model, settings=settings),
                       meters=StepMeters((activations, attention_work)), cfg=plan.cfg)
    run = MeteredRun(model.module, optimizer, activations, throughput, plan.cfg, plan.shape.seq_len,
                     grid.shape.world_size, device, throughput.steps)
    report(run, plan, args, grid, cp, attention_work, compute_dtype)
    shutdown()


if __name__ == "__main__":
    main()
