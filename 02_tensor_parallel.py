"""
Lesson 02 — tensor parallelism in one file: Megatron-style layers, sequence parallelism, a vocab-parallel loss.

The problem. Data parallelism gives every rank the whole model. The 8b preset (Llama-3-8B's shape)
needs 16 bytes per parameter for float32 master weights, gradients and AdamW's two moments:
128 GB, plus about 56 GB of bf16 activations for one 8192-token sequence. No single GPU holds
184 GB, however many of them join the data-parallel group.

The idea. Split every weight matrix across the `tp` ranks of one node, so that each rank stores and
multiplies 1/tp of it. A linear layer Y = X A^T can be cut two ways:

    column-parallel: A cut by output rows,  rank i computes Y_i = X A_i^T    (a slice of Y's columns)
    row-parallel:    A cut by input columns, rank i computes X_i A_i^T        (a partial sum of all of Y)

A column layer's output slice is exactly the input slice a row layer needs, so column-then-row
talks only at its two ends: an MLP (and attention, split by heads) costs one all-reduce forward
and one backward, in the conjugate operators f and g:

               f                                                              g
    X ───── identity ──┬── X·gate_0, X·up_0 ─► silu(.)*(.) ─► ·down_0 ──┐     all-reduce ─► Y
            (backward: │                                                ├──── (backward:
            all-reduce)└── X·gate_1, X·up_1 ─► silu(.)*(.) ─► ·down_1 ──┘      identity)

The embedding and the LM head are split by vocabulary, and the logits are never gathered: the
loss all-reduces three numbers per token (max, sum of exponentials, target logit) instead.

Sequence parallelism (--sequence-parallel). Between blocks the activations, and the RMSNorms'
work, are replicated on every tp rank. Cut each all-reduce into its reduce-scatter and its
all-gather, and keep those regions split along the sequence:

    [b, s/tp, h] ─► RMSNorm ─► all-gather ─► column ─► ... ─► row ─► reduce-scatter ─► [b, s/tp, h]

The column layers keep the gathered sequence for their weight gradients. The refinement
(--save-sequence-shard, as Megatron-LM's code does) keeps only this rank's s/tp tokens of it and
gathers them again in backward, once per norm: then every activation of a block is divided by tp.

Async dgrad (on; --no-async-tp-dgrad turns it off). In backward each column layer makes its input's
gradient and leaves its weight's gradient to the norm's f, which starts its all-reduce (under
sequence parallelism, reduce-scatter) and makes those weight gradients while it travels, as
Megatron-LM's async dgrad does: the same collectives and products, overlapped instead of in turn.

The price (per micro-batch of b sequences of s tokens, L layers, hidden h, vocabulary V):
    memory:  weights, gradients, optimizer states / tp (norm gains replicated); a block's
             activations / tp, except the norms' 2(3h + 1) elements per token and layer, which stay
             replicated: --sequence-parallel divides their 2(2h + 1), --save-sequence-shard the
             column layers' 2h too. The loss keeps one float32 per token and makes the logits one
             chunk of tokens at a time, over V/tp words (VocabParallelCrossEntropy).
    communication: (4L + 2) all-reduces of b*s*h; with --sequence-parallel the same volume as
             (4L + 2) all-gathers and (4L + 2) reduce-scatters, and 2L + 1 all-reduces of h (norm
             gains); --save-sequence-shard adds 2L + 1 backward all-gathers of b*s*h. The loss: 3
             all-reduces of b*s.
    compute: the same FLOPs split tp ways, but every collective sits on the critical path: tp
             needs NVLink's bandwidth and stays inside a node.

Run it:
    torchrun --nproc_per_node=4 02_tensor_parallel.py --tp 2 --dp 2                      # CPU, ~30 s
    torchrun --nproc_per_node=4 02_tensor_parallel.py --tp 2 --dp 2 --sequence-parallel
    torchrun --nproc_per_node=4 02_tensor_parallel.py --tp 2 --dp 2 --sequence-parallel --save-sequence-shard
    torchrun --nproc_per_node=8 02_tensor_parallel.py --tp 8 --preset 1b --seq-len 2048 --sequence-parallel \
        --save-sequence-shard

The lesson takes --tp and --dp (the tp groups are replicas joined by lesson 01's bucketed
all-reduce; --bucket-mb sets its bucket size); --pp and --cp are refused with a line pointing to
lesson 07, which composes every axis.

What to look for: the loss falls as on one device (the tests prove equality to float32 rounding);
the tp rows of the communication table equal the formula to the byte; --sequence-parallel turns
the all-reduces into all-gathers and reduce-scatters of the same volume, and the activations per
rank fall from the report's "off" prediction to its "plain" one; --save-sequence-shard adds one
backward all-gather per norm and takes them down to "saving the shard".

More: docs/02_tensor_parallel.md (derivations, the full price, when tp pays).
"""

from __future__ import annotations

import argparse
from functools import partial

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from picotron_like import comm
from picotron_like.lessons import load_lesson
from picotron_like.loss import (LossSettings, VocabularyStatistics, logit_gradients, logit_statistics, loss_chunk_shape,
                                matmul_dtype, reduced_loss, token_gradient_scale)
from picotron_like.metrics import (ActivationMeter, MeteredRun, log0, log_compute_report, log_memory_rows,
                                   log_traffic_rows)
from picotron_like.model import GPT, RMSNorm, SwiGLU, count_parameters
from picotron_like.topology import (ConfigError, GridShape, ProcessGrid, group_rank, group_size, init_distributed,
                                    shutdown, validate_parallel_config)
from picotron_like.run_control import StepMeters
from picotron_like.train import (RankBatches, StepSettings, add_parallel_flags, add_training_flags, autocast_dtype,
                                 bucket_bytes_from_flags, build_optimizer, plan_run, train)

data_parallel = load_lesson("01_data_parallel")

# ============================================================================ the technique: tensor parallelism


def all_reduced(x, group):
    """The sum over the group, of a copy: an in-place all-reduce would change a tensor autograd still
    holds (an input it saved, or a gradient it hands to another branch of the graph too)."""
    x = x.clone(memory_format=torch.contiguous_format)
    comm.call(dist.all_reduce, x, group=group)
    return x


def start_all_reduce(x, group):
    """all_reduced, started: returns a function that waits for the sum and returns it."""
    x = x.clone(memory_format=torch.contiguous_format)
    work = comm.call(dist.all_reduce, x, group=group, async_op=True)

    def wait():
        work.wait()
        return x
    return wait


class CopyToTensorParallelRegion(torch.autograd.Function):
    """f: identity forward, all-reduce backward.

    Every rank feeds the same X to its slice of the next layer, so dL/dX is the sum of every
    slice's contribution: the backward pass must add them up. With `in_flight` (a
    WeightGradientsInFlight, the async dgrad section below), the all-reduce travels while the
    weight gradients that the column layers reading X left there are computed.
    """

    @staticmethod
    def forward(ctx, x, group, in_flight=None):
        ctx.group, ctx.in_flight = group, in_flight
        return x

    @staticmethod
    def backward(ctx, grad):
        if ctx.in_flight is None:
            return all_reduced(grad, ctx.group), None, None
        return ctx.in_flight.beside(start_all_reduce(grad, ctx.group)), None, None


class ReduceFromTensorParallelRegion(torch.autograd.Function):
    """g: all-reduce forward, identity backward.

    Each rank holds a partial sum of the output; after the all-reduce every rank holds the whole
    output, and the gradient of a sum with respect to each of its terms is the gradient itself.
    """

    @staticmethod
    def forward(ctx, x, group):
        return all_reduced(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def take_shard(full: torch.Tensor, dim: int, group) -> nn.Parameter:
    """This rank's contiguous 1/tp slice of a reference tensor along `dim`, as a new parameter.

    Slicing the reference weight (not drawing a new one) makes the tp run start from exactly the
    single-device model's parameters. `tp_split_dim` records the cut so that shards can be put
    back together (checkpoints, tests).
    """
    rank, tp = group_rank(group), group_size(group)
    shard = nn.Parameter(full.detach().chunk(tp, dim=dim)[rank].clone())
    shard.tp_split_dim = dim
    return shard


def replicated(param: nn.Parameter) -> nn.Parameter:
    """Mark a parameter every tp rank holds whole, so the gradient norm counts it once."""
    param.tp_replicated = True
    return param


class ColumnParallelLinear(nn.Module):
    """Y_i = X A_i^T + b_i: this rank's slice of the output features.

    The input must already be in the tensor-parallel region: the norm in front of the layer
    applies f (TensorParallelRMSNorm), once for q, k and v (or gate and up), which share one input.
    Megatron fuses q/k/v into one matrix for the same reason; one f for three layers is one
    all-reduce backward instead of three.
    """

    def __init__(self, full: nn.Linear, group):
        super().__init__()
        self.weight = take_shard(full.weight, 0, group)
        self.bias = take_shard(full.bias, 0, group) if full.bias is not None else None

    def forward(self, x):
        in_flight = getattr(x, "weight_gradients_in_flight", None)     # async dgrad (its section below)
        if in_flight is not None:
            return LinearLeavingWeightGradient.apply(x, (self.weight, self.bias), in_flight)
        return F.linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """Y = sum_i X_i A_i^T + b: this rank's slice of the input features, partial sums reduced over tp.

    The bias is added once, after the reduction (added before it, it would be summed tp times).
    """

    def __init__(self, full: nn.Linear, group):
        super().__init__()
        self.group = group
        self.weight = take_shard(full.weight, 1, group)
        self.bias = None if full.bias is None else replicated(nn.Parameter(full.bias.detach().clone()))

    def forward(self, x):
        out = self.exit_region(F.linear(x, self.weight))
        return out if self.bias is None else out + self.bias

    def exit_region(self, partial_sums):
        return ReduceFromTensorParallelRegion.apply(partial_sums, self.group)      # g


class TensorParallelRMSNorm(RMSNorm):
    """The RMSNorm in front of a block's column-parallel layers (or of the LM head): it applies f.

    The norm is where those layers take their shared input, so it is where the entry operator
    goes. The gain is replicated: every rank normalises the whole activation. `async_dgrad`: f's
    backward all-reduce travels while those layers' weight gradients are computed (its section below).
    """

    def __init__(self, norm: RMSNorm, group, async_dgrad: bool = True):
        super().__init__(norm.weight.shape[0], norm.eps)
        self.group, self.async_dgrad = group, async_dgrad
        self.weight = replicated(nn.Parameter(norm.weight.detach().clone()))

    def forward(self, x):
        return self.enter_region(super().forward(x))

    def enter_region(self, x):
        in_flight = weight_gradients_in_flight(self)
        return handed_to_readers(CopyToTensorParallelRegion.apply(x, self.group, in_flight), in_flight)   # f


def parallelize_attention(attn, group, column=ColumnParallelLinear, row=RowParallelLinear) -> None:
    """Heads split across ranks: q, k, v column-parallel, o_proj row-parallel.

    The projections' rows are laid out head by head, so a contiguous slice of rows is a set of
    whole heads; query heads [r*H/tp, (r+1)*H/tp) and key/value heads [r*KV/tp, (r+1)*KV/tp) are
    exactly the heads whose groups match under grouped-query attention. Attention reads its head
    count off the projections and its core (``attention_core``) is left alone.
    """
    attn.q_proj = column(attn.q_proj, group)
    attn.k_proj = column(attn.k_proj, group)
    attn.v_proj = column(attn.v_proj, group)
    attn.o_proj = row(attn.o_proj, group)


def parallelize_mlp(mlp: SwiGLU, group, column=ColumnParallelLinear, row=RowParallelLinear) -> None:
    """SwiGLU's inner width split: gate and up column-parallel, down row-parallel.

    silu(gate) * up is elementwise, so each rank applies it to its own slice of the inner width.
    """
    mlp.gate_proj = column(mlp.gate_proj, group)
    mlp.up_proj = column(mlp.up_proj, group)
    mlp.down_proj = row(mlp.down_proj, group)


class VocabParallelEmbedding(nn.Module):
    """Rank r owns the embedding rows of token ids [r*V/tp, (r+1)*V/tp).

    Each rank looks up the ids that fall in its slice and writes zeros for the others; summing
    over tp (g) gives every token its row.
    """

    def __init__(self, full: nn.Embedding, group):
        super().__init__()
        self.group = group
        self.weight = take_shard(full.weight, 0, group)
        self.vocab_start = group_rank(group) * self.weight.shape[0]

    def forward(self, tokens):
        local_ids = tokens - self.vocab_start
        outside = (local_ids < 0) | (local_ids >= self.weight.shape[0])
        rows = F.embedding(local_ids.masked_fill(outside, 0), self.weight)
        return self.exit_region(rows.masked_fill(outside.unsqueeze(-1), 0.0))

    def exit_region(self, rows):
        return ReduceFromTensorParallelRegion.apply(rows, self.group)               # g


def combine_vocabulary_slices(stats: VocabularyStatistics, group) -> VocabularyStatistics:
    """The whole vocabulary's statistics from each tp rank's slice's, exactly: three all-reduces of
    one float32 per token. The max is the max of the slices' maxima; each slice's sum of
    exponentials was taken against its own max m_r, so it is rescaled to the global max M before
    the sum, sum_r exp(m_r - M) * sum_exp_r; the target's logit is found on exactly one rank and
    is 0 on the others, so it is a sum."""
    row_max = stats.row_max.clone()
    comm.call(dist.all_reduce, row_max, op=dist.ReduceOp.MAX, group=group)
    sum_exp = stats.sum_exp * (stats.row_max - row_max).exp()
    comm.call(dist.all_reduce, sum_exp, group=group)
    target_logit = stats.target_logit.clone()
    comm.call(dist.all_reduce, target_logit, group=group)
    return VocabularyStatistics(row_max, sum_exp, target_logit)


class VocabParallelCrossEntropy(torch.autograd.Function):
    """The reference's chunked loss (loss.LinearCrossEntropy) with W split by vocabulary: each rank
    makes the statistics of its V/tp words chunk by chunk (logit_statistics), and
    combine_vocabulary_slices makes them the whole vocabulary's with three all-reduces of one
    number per token, once after the last chunk (not per chunk); the loss follows from them as on
    one device. The gradient is softmax - onehot, local to each rank's slice, so backward needs no
    communication of its own: dW is this rank's rows, and dx a partial sum over the slices, which
    the norm's f (or sequence parallelism's gather) in front of the head sums over tp.

    `kept` is what backward keeps in place of the input x, and `restore_input` rebuilds x from it:
    x itself and None, except for the shard-saving head (below), which keeps its s/tp tokens.
    """

    @staticmethod
    def forward(ctx, x, kept, weight, targets, reduction: str, vocab_start: int, group, restore_input,
                settings: LossSettings):
        dtype = matmul_dtype(x, weight)
        with torch.autocast(x.device.type, enabled=False):
            saved = kept.to(dtype)
            inputs = (saved if kept is x else x.to(dtype)).reshape(-1, x.shape[-1])
            targets_flat = targets.reshape(-1)
            stats = logit_statistics(inputs, weight.to(dtype), targets_flat - vocab_start, settings)
            loss, log_sum_exp = reduced_loss(combine_vocabulary_slices(stats, group), targets_flat, reduction)
        ctx.save_for_backward(saved, weight, targets_flat, log_sum_exp)
        ctx.reduction, ctx.vocab_start, ctx.restore_input = reduction, vocab_start, restore_input
        ctx.settings = settings
        ctx.input_shape, ctx.input_dtype = x.shape, x.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        saved, weight, targets_flat, log_sum_exp = ctx.saved_tensors
        with torch.autocast(saved.device.type, enabled=False):
            inputs = saved if ctx.restore_input is None else ctx.restore_input(saved)
            grad_inputs, grad_weight = logit_gradients(
                inputs.reshape(-1, inputs.shape[-1]), weight.to(saved.dtype), targets_flat - ctx.vocab_start,
                log_sum_exp, token_gradient_scale(grad_loss, targets_flat, ctx.reduction), ctx.settings)
        return (grad_inputs.view(ctx.input_shape).to(ctx.input_dtype), None, grad_weight.to(weight.dtype),
                None, None, None, None, None, None)


class VocabParallelHead(ColumnParallelLinear):
    """The LM head split by vocabulary: rank r owns the rows of words [r*V/tp, (r+1)*V/tp).

    Without targets it returns this rank's slice of the logits. With targets, the loss without
    ever gathering the logits (VocabParallelCrossEntropy): loss_t = log sum_v exp(z_tv) - z_t,target,
    and each rank holds V/tp of the z_tv. `loss_settings`: how its loss runs, as LMHead's.
    """

    loss_settings = LossSettings()

    def __init__(self, full: nn.Linear, group):
        super().__init__(full, group)
        self.group, self.vocab_start = group, group_rank(group) * self.weight.shape[0]

    def forward(self, x, targets=None, reduction: str = "mean"):
        if targets is None:
            return super().forward(x)
        return VocabParallelCrossEntropy.apply(x, x, self.weight, targets, reduction, self.vocab_start, self.group,
                                               None, self.loss_settings)


# The five layer types a conversion swaps in; sequence parallelism (the next sections) swaps in
# subclasses instead, and nothing else changes.
TENSOR_PARALLEL_LAYERS = (VocabParallelEmbedding, TensorParallelRMSNorm, ColumnParallelLinear, RowParallelLinear,
                          VocabParallelHead)


def apply_tensor_parallel(model, tp_group, sequence_parallel: bool, save_sequence_shard: bool = False,
                          async_dgrad: bool = True):
    """Turn a reference GPT into its tensor-parallel version, in place, and return it.

    Its parameters hold the full reference weights (the same on every rank of the tp group); every
    sharded layer keeps its slice of them, and the full tensors are released as the modules are
    swapped. Modules are swapped, never edited, so parameter names stay the same: the embedding,
    the norms, q/k/v/gate/up, o_proj/down and the head become this section's five layer types
    (TENSOR_PARALLEL_LAYERS; with sequence parallelism SEQUENCE_PARALLEL_LAYERS, saving the shard
    SHARD_SAVING_LAYERS). GPT.forward keeps its signature; with sequence parallelism the embedding
    returns this rank's [b, s/tp, h], the blocks take and return it, and the final norm gathers the
    sequence before the head. Raises ConfigError (before any collective) for a dimension tp does not
    divide or a mixture of experts; the sequence length is checked by validate_tensor_parallel.
    `async_dgrad`: the norms' f overlaps its collective with the column layers' weight gradients.
    """
    validate_tensor_parallel(model.cfg, group_size(tp_group))
    embedding, norm, column, row, head = (TENSOR_PARALLEL_LAYERS if not sequence_parallel else
                                          SHARD_SAVING_LAYERS if save_sequence_shard else SEQUENCE_PARALLEL_LAYERS)
    if model.tok_embeddings is not None:
        model.tok_embeddings = embedding(model.tok_embeddings, tp_group)
    for block in model.layers:
        block.attn_norm = norm(block.attn_norm, tp_group, async_dgrad)
        parallelize_attention(block.attn, tp_group, column, row)
        block.mlp_norm = norm(block.mlp_norm, tp_group, async_dgrad)
        parallelize_mlp(block.mlp, tp_group, column, row)
    if model.norm is not None:
        model.norm = norm(model.norm, tp_group, async_dgrad)
    if model.lm_head is not None:
        model.lm_head = head(model.lm_head, tp_group)
    return model


def tp_counts_toward_norm(tp_group):
    """For clip_grad_norm_: count replicated parameters (norm gains) on tp rank 0 only."""
    first = group_rank(tp_group) == 0
    return lambda param: first or not getattr(param, "tp_replicated", False)


# ============================================================================ the technique: sequence parallelism

# Sequence parallelism splits f and g in halves along the sequence (dim 1 of [batch, seq, hidden]).
# Collectives gather and scatter along the first dimension, so the sequence is moved to the front
# around each call (one copy each way; Megatron keeps activations [seq, batch, hidden] throughout
# to avoid it, a layout our reference model does not use).


def start_all_gather_sequence(x, group):
    """Start gathering [b, s/tp, h] from each rank into [b, s, h] (rank order = sequence order).

    Returns a function that waits for the result and returns it, so that the caller can compute
    something else while the all-gather travels.
    """
    shard = x.transpose(0, 1).contiguous()
    full = shard.new_empty((group_size(group) * shard.shape[0], *shard.shape[1:]))
    work = comm.call(comm.all_gather_single, full, shard, group=group, async_op=True)

    def wait():
        work.wait()
        return full.transpose(0, 1).contiguous()
    return wait


def all_gather_sequence(x, group):
    """[b, s/tp, h] on each rank -> [b, s, h] on every rank."""
    return start_all_gather_sequence(x, group)()


def start_reduce_scatter_sequence(x, group):
    """Start reducing partial sums [b, s, h] from each rank so that rank r holds tokens
    [r*s/tp, (r+1)*s/tp) of the sum; returns a function that waits for them and returns them."""
    tp = group_size(group)
    if x.shape[1] % tp:
        # Checked on every rank from the same shape, before the collective, so no rank waits alone.
        raise ConfigError(f"sequence length {x.shape[1]} is not divisible by tp={tp}: sequence "
                          f"parallelism splits it evenly; use a --seq-len that is a multiple of {tp}")
    full = x.transpose(0, 1).contiguous()
    shard = full.new_empty((full.shape[0] // tp, *full.shape[1:]))
    work = comm.call(comm.reduce_scatter_single, shard, full, group=group, async_op=True)

    def wait():
        work.wait()
        return shard.transpose(0, 1).contiguous()
    return wait


def reduce_scatter_sequence(x, group):
    """Partial sums [b, s, h] on each rank -> rank r holds tokens [r*s/tp, (r+1)*s/tp) of the sum."""
    return start_reduce_scatter_sequence(x, group)()


class ReduceScatterToSequenceParallelRegion(torch.autograd.Function):
    """SP's g: reduce-scatter the sequence forward, all-gather the gradient backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return reduce_scatter_sequence(x, group)

    @staticmethod
    def backward(ctx, grad):
        return all_gather_sequence(grad, ctx.group), None


class GatherFromSequenceParallelRegion(torch.autograd.Function):
    """SP's f: all-gather the sequence forward, reduce-scatter the gradient backward.

    The gradient that arrives here is the sum of the input gradients of every column layer that
    read the gathered sequence (autograd adds them up), so one reduce-scatter serves q, k and v.
    With `in_flight`, as f: the reduce-scatter travels while their weight gradients are computed.
    """

    @staticmethod
    def forward(ctx, x, group, in_flight=None):
        ctx.group, ctx.in_flight = group, in_flight
        return all_gather_sequence(x, group)

    @staticmethod
    def backward(ctx, grad):
        if ctx.in_flight is None:
            return reduce_scatter_sequence(grad, ctx.group), None, None
        return ctx.in_flight.beside(start_reduce_scatter_sequence(grad, ctx.group)), None, None


def sum_gradient_over_tp(param: nn.Parameter, group) -> None:
    """Make `param`'s gradient the sum over the tp ranks, once per backward pass.

    Under sequence parallelism a replicated parameter used on the sequence-split activations (a
    norm gain, a row-parallel bias) sees only s/tp tokens per rank, so its gradient is a partial
    sum. A tensor hook runs before the gradient is added into .grad, so the sum is taken per
    micro-batch and gradient accumulation and data parallelism work on the full gradient.
    """
    param.register_hook(partial(all_reduced, group=group))


# The four layer types with the sequence-parallel entry and exit. Between blocks, and inside the
# norms, each rank now holds its s/tp tokens only. The column layers are tensor parallelism's own:
# they multiply the gathered sequence and keep it, [b, s, h] per norm on every tp rank, for their
# weight gradient (the next section keeps only this rank's tokens of it).


class SequenceParallelEmbedding(VocabParallelEmbedding):
    """Sums the vocabulary slices by a reduce-scatter, so the embedding already returns this rank's
    s/tp tokens: GPT.forward needs no extra call to enter the split region."""

    def exit_region(self, rows):
        return ReduceScatterToSequenceParallelRegion.apply(rows, self.group)


class SequenceParallelRMSNorm(TensorParallelRMSNorm):
    """Normalises this rank's s/tp tokens, then all-gathers the whole sequence for the
    column-parallel layers after it. The gain saw s/tp tokens here, so its gradient is summed over tp."""

    def __init__(self, norm: RMSNorm, group, async_dgrad: bool = True):
        super().__init__(norm, group, async_dgrad)
        sum_gradient_over_tp(self.weight, group)

    def enter_region(self, x):
        in_flight = weight_gradients_in_flight(self)
        return handed_to_readers(GatherFromSequenceParallelRegion.apply(x, self.group, in_flight), in_flight)  # SP's f


class SequenceParallelRowLinear(RowParallelLinear):
    """Ends the region by a reduce-scatter: this rank keeps its s/tp tokens of the sum. The bias is
    added to those tokens only, so its gradient is summed over tp."""

    def __init__(self, full: nn.Linear, group):
        super().__init__(full, group)
        if self.bias is not None:
            sum_gradient_over_tp(self.bias, group)

    def exit_region(self, partial_sums):
        return ReduceScatterToSequenceParallelRegion.apply(partial_sums, self.group)


SEQUENCE_PARALLEL_LAYERS = (SequenceParallelEmbedding, SequenceParallelRMSNorm, ColumnParallelLinear,
                            SequenceParallelRowLinear, VocabParallelHead)


# ============================================================================ the technique: saving the sequence shard

# The plain form's column layers keep the gathered sequence until their backward: [b, s, h] per
# norm, replicated on every tp rank, the one thing a block keeps that tp does not divide. Keep only
# this rank's [b, s/tp, h] instead and all-gather it once more in backward, as Megatron-LM's linear
# layers do under sequence parallelism. The trade-off, per micro-batch:
#   memory saved: the column layers' kept input / tp, (2L + 1) * b*s*h * (tp - 1)/tp elements per rank
#   price:        one more all-gather of b*s*h per norm (2L + 1) in backward, started before the
#                 input gradient's matmul so that it travels while that runs


class SequenceRegather:
    """Backward's all-gather of one norm's output, made once for all the column layers that read it.

    q, k and v (gate and up) each need the whole sequence for their weight gradient, and they
    read the same input: the first of them to run backward starts the all-gather, the others
    reuse its result, and the last of them (`readers` counts them in forward) drops it, so the
    gathered sequence lives for that stretch of the backward pass only.
    """

    def __init__(self, group):
        self.group, self.readers, self.wait, self.full = group, 0, None, None

    def start(self, shard):
        if self.wait is None and self.full is None:
            self.wait = start_all_gather_sequence(shard, self.group)

    def result(self):
        if self.full is None:
            self.full, self.wait = self.wait(), None
        full, self.readers = self.full, self.readers - 1
        if self.readers == 0:
            self.full = None
        return full

    def gathered(self, shard):
        """start and result at once, for a reader with nothing to compute while the gather travels."""
        self.start(shard)
        return self.result()


class SequenceParallelInput:
    """What the column-parallel layers after a norm receive when they save the shard.

    `shard` is the norm's output, this rank's s/tp tokens; `full` is the whole sequence, gathered
    once in forward for every layer that reads it; `regather` gathers it once again in backward.
    A layer multiplies `full` but keeps only `shard` for backward, so the gathered sequence is
    freed once the layers that read it have run instead of living until their backward: that is
    what makes every activation of a block 1/tp.
    """

    def __init__(self, shard, group, in_flight=None):
        self.shard, self.regather, self.in_flight = shard, SequenceRegather(group), in_flight
        self.full = GatherFromSequenceParallelRegion.apply(shard, group, in_flight)


class LinearSavingSequenceShard(torch.autograd.Function):
    """Y = X A^T + b on the gathered sequence X, keeping only this rank's tokens of X for backward.

    forward:  Y from `full`; saves `shard` (and A, a parameter, not an activation).
    backward: start gathering X again (only the first layer of a region sends anything), compute
              dX = dY A while it travels, then wait for X and compute dA = dY^T X, db = sum dY.
    dX is the gradient of `full`: autograd sums it over the layers that read `full`, and the
    region's entry reduce-scatters the sum. Under autocast the matmuls run in the dtype of Y, as
    F.linear's would, and each gradient is cast back to its tensor's dtype.
    """

    @staticmethod
    def forward(ctx, full, shard, regather, weight, bias):
        regather.readers += 1
        ctx.regather, ctx.bias_dtype = regather, None if bias is None else bias.dtype
        ctx.save_for_backward(shard, weight)
        return F.linear(full, weight, bias)

    @staticmethod
    def backward(ctx, grad):
        shard, weight = ctx.saved_tensors
        ctx.regather.start(shard)
        grad_input = (grad @ weight.to(grad.dtype)).to(shard.dtype)
        full = ctx.regather.result()
        grad = grad.reshape(-1, grad.shape[-1])
        grad_weight = (grad.t() @ full.reshape(-1, full.shape[-1]).to(grad.dtype)).to(weight.dtype)
        grad_bias = None if ctx.bias_dtype is None else grad.sum(0).to(ctx.bias_dtype)
        return grad_input, None, None, grad_weight, grad_bias


class ShardSavingRMSNorm(SequenceParallelRMSNorm):
    """Hands the column layers after it a SequenceParallelInput: the gathered sequence to multiply
    and this rank's tokens of it to keep."""

    def enter_region(self, x):
        return SequenceParallelInput(x, self.group, weight_gradients_in_flight(self))


class ShardSavingColumnLinear(ColumnParallelLinear):
    """Multiplies the gathered sequence, keeps this rank's tokens of it for backward."""

    def forward(self, x: SequenceParallelInput):
        return linear_saving_sequence_shard(x, self.weight, self.bias)


class ShardSavingVocabParallelHead(VocabParallelHead):
    """The head's slice of the logits from the gathered sequence; its loss keeps only this rank's
    tokens of its input too, and gathers them again at the start of its backward."""

    def forward(self, x: SequenceParallelInput, targets=None, reduction: str = "mean"):
        if targets is None:
            return linear_saving_sequence_shard(x, self.weight, self.bias)
        x.regather.readers += 1
        return VocabParallelCrossEntropy.apply(x.full, x.shard, self.weight, targets, reduction, self.vocab_start,
                                               self.group, x.regather.gathered, self.loss_settings)


SHARD_SAVING_LAYERS = (SequenceParallelEmbedding, ShardSavingRMSNorm, ShardSavingColumnLinear,
                       SequenceParallelRowLinear, ShardSavingVocabParallelHead)


# ============================================================================ the technique: async dgrad

# A column layer's backward makes two products: dX = dY A, the input's gradient, which the norm's f
# then sums over tp (all-reduce; under sequence parallelism, reduce-scatter), and dA = dY^T X, the
# weight's, which no other rank waits for. Autograd makes both in the layer's own node, so f's
# collective starts only once every layer reading the norm has made both: link and GPU take turns.
# Megatron-LM's async dgrad reorders them (as here): each column layer makes dX only and leaves
# (X, dY) behind; f starts its collective on their sum at once, makes the dA while it travels,
# then waits. The same collectives, bytes and products, in another order. A layer that makes its
# dA itself (lesson 07's FP8 layers, the head's loss, zero-bubble's layers that leave dA for W)
# simply leaves nothing: f then waits for its collective as before. On by default; off
# (--no-async-tp-dgrad, async_dgrad=False) is the order above, which the device check measures.


class WeightGradientsInFlight:
    """The weight gradients that the column layers reading one norm's output (one forward) leave
    for its f, which makes them while its collective travels.

    They reach .grad through autograd, in one backward call of their own made inside f's backward,
    so that the data-parallel wrappers' post-accumulate hooks run as in the layers' own backward.
    (So torch.autograd.grad, which returns gradients instead of accumulating them, would not see
    them: the lessons train with backward.)"""

    def __init__(self):
        self.kept = []

    def keep(self, weight, bias, x, grad_output) -> None:
        self.kept.append((weight, bias, x, grad_output))

    def beside(self, wait):
        """Make every kept weight gradient while the collective that `wait` waits for travels, then
        wait for it and return its result."""
        params, grads = [], []
        for weight, bias, x, grad_output in self.kept:
            grad_output = grad_output.reshape(-1, grad_output.shape[-1])
            params.append(weight)
            grads.append((grad_output.t() @ x.reshape(-1, x.shape[-1]).to(grad_output.dtype)).to(weight.dtype))
            if bias is not None:
                params.append(bias)
                grads.append(grad_output.sum(0).to(bias.dtype))
        self.kept = []
        if params:
            torch.autograd.backward(params, grads)
        return wait()


def weight_gradients_in_flight(norm) -> WeightGradientsInFlight | None:
    """What a tp norm's f hands the column layers after it for one forward: a fresh
    WeightGradientsInFlight, or None with async dgrad off or where no backward follows (no_grad)."""
    return WeightGradientsInFlight() if norm.async_dgrad and torch.is_grad_enabled() else None


def handed_to_readers(x, in_flight):
    """The norm's output, marked with `in_flight` for the column layers that read it."""
    if in_flight is not None:
        x.weight_gradients_in_flight = in_flight
    return x


class LinearLeavingWeightGradient(torch.autograd.Function):
    """A column layer's Y = X A^T + b whose backward makes dX and leaves (X, dY) in `in_flight`.

    The weight and bias come in inside a tuple, so autograd draws no edge to them: their hooks run
    when f accumulates their gradients, not here with none. Under autocast the matmul runs in the
    autocast dtype, as F.linear's would, and X is kept in it, so dA is made from the very tensors
    F.linear's backward would use."""

    @staticmethod
    def forward(ctx, x, weight_and_bias: tuple, in_flight: WeightGradientsInFlight):
        weight, bias = weight_and_bias
        x_used, weight_used = x, weight
        if torch.is_autocast_enabled(x.device.type):
            dtype = torch.get_autocast_dtype(x.device.type)
            x_used, weight_used = x.to(dtype), weight.to(dtype)
        ctx.save_for_backward(x_used, weight_used)
        ctx.weight, ctx.bias, ctx.in_flight, ctx.input_dtype = weight, bias, in_flight, x.dtype
        return F.linear(x_used, weight_used, None if bias is None else bias.to(weight_used.dtype))

    @staticmethod
    def backward(ctx, grad_output):
        x_used, weight_used = ctx.saved_tensors
        ctx.in_flight.keep(ctx.weight, ctx.bias, x_used, grad_output)
        return (grad_output @ weight_used).to(ctx.input_dtype), None, None


class LinearSavingShardLeavingWeightGradient(torch.autograd.Function):
    """LinearSavingSequenceShard whose backward leaves dA for f: it gathers X again and makes dX
    while the all-gather travels, as there, and leaves (X, dY) in `in_flight`. The weight and bias
    come in inside a tuple, as in LinearLeavingWeightGradient."""

    @staticmethod
    def forward(ctx, full, shard, regather, weight_and_bias: tuple, in_flight: WeightGradientsInFlight):
        weight, bias = weight_and_bias
        regather.readers += 1
        ctx.regather, ctx.in_flight, ctx.weight, ctx.bias = regather, in_flight, weight, bias
        ctx.save_for_backward(shard, weight)
        return F.linear(full, weight, bias)

    @staticmethod
    def backward(ctx, grad):
        shard, weight = ctx.saved_tensors
        ctx.regather.start(shard)
        grad_input = (grad @ weight.to(grad.dtype)).to(shard.dtype)
        ctx.in_flight.keep(ctx.weight, ctx.bias, ctx.regather.result(), grad)
        return grad_input, None, None, None, None


def linear_saving_sequence_shard(x: SequenceParallelInput, weight, bias):
    """A shard-saving column layer's output: its dA made by itself, or left for f (async dgrad)."""
    if x.in_flight is None:
        return LinearSavingSequenceShard.apply(x.full, x.shard, x.regather, weight, bias)
    return LinearSavingShardLeavingWeightGradient.apply(x.full, x.shard, x.regather, (weight, bias), x.in_flight)


# ============================================================================ configuration rules


def validate_tensor_parallel(cfg, grid: GridShape | int, seq_len: int | None = None,
                             sequence_parallel: bool = False, world_size: int | None = None) -> None:
    """Raise one ConfigError listing every rule the grid and tensor parallelism break; no collectives.

    `grid` is the whole grid, or just the tp degree. The grid's own rules (degrees, world size)
    come from validate_parallel_config; tensor parallelism adds its splits, dense MLPs, and with
    sequence parallelism a sequence split evenly.
    """
    grid = GridShape(tp=grid) if isinstance(grid, int) else grid
    problems = []
    try:
        validate_parallel_config(grid, grid.world_size if world_size is None else world_size)
    except ConfigError as error:
        problems += str(error).split("\n  - ")[1:]
    problems += split_problems(cfg, grid.tp)
    if cfg.n_experts:
        problems.append(f"n_experts={cfg.n_experts}: this lesson splits dense SwiGLU MLPs; experts are "
                        f"spread over ranks by expert parallelism (lesson 05); use a dense preset")
    if sequence_parallel and seq_len is not None and seq_len % grid.tp:
        problems.append(f"--seq-len {seq_len} is not divisible by --tp {grid.tp}: sequence parallelism "
                        f"splits the sequence evenly; use a multiple of {grid.tp}")
    if problems:
        raise ConfigError("bad parallel configuration:\n  - " + "\n  - ".join(problems))


def split_problems(cfg, tp: int) -> list[str]:
    """Every dimension tensor parallelism cuts must cut evenly: heads, kv-heads, the hidden and
    MLP widths, the vocabulary."""
    return [f"{field}={getattr(cfg, field)} is not divisible by --tp {tp}: tensor parallelism splits it evenly; "
            f"pick a tp that divides {getattr(cfg, field)}"
            for field in ("n_heads", "n_kv_heads", "hidden", "ffn_hidden", "vocab_size") if getattr(cfg, field) % tp]


def validate(cfg, grid: GridShape, shape, args, world_size: int) -> None:
    """For plan_run: the grid's rules and tensor parallelism's, on the sequence length that will run."""
    if args.save_sequence_shard and not args.sequence_parallel:
        raise ConfigError("bad flags:\n  - --save-sequence-shard refines sequence parallelism: add "
                          "--sequence-parallel or drop --save-sequence-shard")
    validate_tensor_parallel(cfg, grid, shape.seq_len, args.sequence_parallel, world_size)


# Sequence parallelism's three forms, as apply_tensor_parallel's and the formulas' keywords.
SEQUENCE_PARALLEL_FORMS = {"off": dict(sequence_parallel=False), "plain": dict(sequence_parallel=True),
                           "saving the shard": dict(sequence_parallel=True, save_sequence_shard=True)}


# ============================================================================ measuring the three challenges


def tp_parameter_count(cfg, tp: int) -> int:
    """Parameters one tp rank holds: every matrix / tp, the norm gains whole."""
    norms = (2 * cfg.n_layers + 1) * cfg.hidden
    return (count_parameters(cfg)["total"] - norms) // tp + norms


def stage_parts(cfg, stage: nn.Module | None) -> tuple[int, bool, bool]:
    """What the formulas below count: the layers, whether the embedding and the head are there. The
    whole GPT's (stage None), or a pipeline stage's that apply_tensor_parallel split (it works on
    either): a stage may lack the embedding or the head."""
    if stage is None:
        return cfg.n_layers, True, True
    return len(stage.layers), stage.tok_embeddings is not None, stage.lm_head is not None


def predicted_tp_traffic(cfg, micro_batch: int, seq_len: int, n_micro: int, tp: int, sequence_parallel: bool,
                         compute_dtype=torch.float32, save_sequence_shard: bool = False,
                         stage: nn.Module | None = None) -> dict:
    """Payload bytes on the tp group per optimizer step: n_micro micro-batches through a GPT, or
    through a pipeline stage (stage_parts).

    Per micro-batch, with N = b*s*h: the embedding's g, 2 per layer forward (after o_proj and
    down_proj), 2 per layer backward (the norms' f), and the head's f backward: 4L + 2 messages of N.
    Under autocast the row-parallel outputs (and their gradients) travel in the compute dtype; the
    embedding and the norms produce float32. The loss adds 3 all-reduces of b*s float32. Under
    sequence parallelism each message becomes an all-gather and a reduce-scatter, and the 2L + 1
    norm gains' gradients (h float32 each) are summed; saving the shard, the column layers gather
    each norm's output again in backward (2L + 1 more all-gathers of N, float32).
    """
    layers, with_embedding, with_head = stage_parts(cfg, stage)
    N = micro_batch * seq_len * cfg.hidden
    n_norms = 2 * layers + with_head
    row_bytes = 2 * layers * N * (torch.finfo(compute_dtype).bits // 8)  # o_proj and down_proj outputs
    fp32_bytes = (n_norms + with_embedding) * N * 4                       # the norms' outputs, the embedding
    loss = 3 * micro_batch * seq_len * 4 * with_head
    if not sequence_parallel:
        # forward: embedding + row outputs; backward: the norms' f (g's backward is free)
        per_micro = {("all_reduce", "tp"): fp32_bytes + row_bytes + loss}
    else:
        # every message above moves once as an all-gather and once as a reduce-scatter; saving the
        # shard, the column layers' weight gradients gather each norm's output once more
        per_micro = {("all_gather_single", "tp"): fp32_bytes + row_bytes + n_norms * N * 4 * save_sequence_shard,
                     ("reduce_scatter_single", "tp"): fp32_bytes + row_bytes,
                     ("all_reduce", "tp"): loss + n_norms * cfg.hidden * 4}
    return {key: n_micro * value for key, value in per_micro.items() if value}


def predicted_tp_activation_bytes(cfg, micro_batch: int, seq_len: int, tp: int, sequence_parallel: bool,
                                  save_sequence_shard: bool = False, stage: nn.Module | None = None) -> int:
    """Bytes autograd saves for one micro-batch on one tp rank (float32, dense model), for a whole
    GPT or a pipeline stage (stage_parts), with the loss summed as a training step asks for it.

    Per token and layer, in elements:
      two RMSNorms, each: input, 1/rms, normalised input (/tp with SP)    2 * (2h + 1)
      their outputs, the column layers' input for their weight gradients
      (/tp with SP saving the shard; plain SP keeps the gathered sequence) 2 * h
      attention: q, k and v (kv heads only), output, log-sum-exp     (2h + 2 n_kv d + n_heads) / tp
      o_proj input and SwiGLU's gate, silu(gate), up, product             (h + 4f) / tp
    so with sequence parallelism saving the shard everything a block saves is divided by tp. Plus
    the rotary tables (s * head_dim); the embedding's int64 local ids and one-byte mask per token;
    the head's final norm and input (as a block's norm), the loss's log-sum-exp (one float32 per
    token, whatever V and tp: VocabParallelCrossEntropy) and its int64 targets.
    """
    layers, with_embedding, with_head = stage_parts(cfg, stage)
    tokens = micro_batch * seq_len
    h, f = cfg.hidden, cfg.ffn_hidden
    # Integers throughout, so that the prediction is exact: sequence parallelism needs s % tp == 0
    # and the grid rules make h, f, n_heads, n_kv_heads and V multiples of tp.
    norm_tokens = tokens // tp if sequence_parallel else tokens      # the tokens a norm sees here
    kept_tokens = norm_tokens if save_sequence_shard else tokens     # ... and its output's, kept
    norm = (2 * h + 1) * norm_tokens + h * kept_tokens
    split = 2 * h + 2 * cfg.n_kv_heads * cfg.head_dim + cfg.n_heads + h + 4 * f
    float_elements = layers * (2 * norm + tokens * split // tp) + with_head * (norm + tokens)
    float_elements += seq_len * cfg.head_dim if layers else 0
    other_bytes = tokens * ((8 + 1) * with_embedding + 8 * with_head)     # int64 ids and a mask; int64 targets
    return 4 * float_elements + other_bytes


def report(run: MeteredRun, plan, form: str, compute_dtype) -> None:
    """The shared rows with this lesson's formulas (a tp rank's parameters and activations, the tp
    collectives) for sequence parallelism's `form` (a key of SEQUENCE_PARALLEL_FORMS), and what
    tensor parallelism changes: the parameters and the logits per rank."""
    cfg, shape, tp, keywords = plan.cfg, plan.shape, plan.grid.tp, SEQUENCE_PARALLEL_FORMS[form]
    b, s, n_params = shape.micro_batch_size, shape.seq_len, tp_parameter_count(cfg, tp)
    log_memory_rows(run, f"one rank; activations of one micro-batch; tp={tp}, sequence parallelism {form}",
                    predicted_tp_activation_bytes(cfg, b, s, tp, **keywords), n_params)
    log0(f"parameters on this rank: {run.n_params:,} measured, {n_params:,} predicted "
         f"(of {count_parameters(cfg)['total']:,})")
    if s % tp == 0:
        log0("activations predicted per rank, sequence parallelism " + ", ".join(
            f"{name} {predicted_tp_activation_bytes(cfg, b, s, tp, **other) / 1e6:.3f} MB"
            for name, other in SEQUENCE_PARALLEL_FORMS.items()))
    tokens, words = loss_chunk_shape(b * s, cfg.vocab_size // tp, run.device.type, run.model.lm_head.loss_settings)
    log0(f"float32 logits at a time: one chunk of {tokens} tokens x {words} words of the vocab slice, "
         f"{tokens * words * 4 / 1e6:.3f} MB per rank; the micro-batch's gathered would be "
         f"{b * s * cfg.vocab_size * 4 / 1e6:.3f} MB")
    log_traffic_rows(run, f"b={b}, s={s}, h={cfg.hidden}, L={cfg.n_layers}, {shape.grad_accum} micro-batches",
                     predicted_tp_traffic(cfg, b, s, shape.grad_accum, tp, compute_dtype=compute_dtype, **keywords),
                     norm_groups=("tp",))
    log_compute_report(run)


# ============================================================================ main


def add_async_dgrad_flag(parser) -> None:
    parser.add_argument("--no-async-tp-dgrad", dest="async_tp_dgrad", action="store_false",
                        help="make each column layer's weight gradient before the norm's backward all-reduce "
                             "(reduce-scatter) over tp starts, instead of while it travels (async dgrad)")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description="Lesson 02: tensor parallelism (run with torchrun).",
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_parallel_flags(parser, axes=("dp", "tp"), fill_axis="dp", tp=2)
    parser.add_argument("--save-sequence-shard", action="store_true", help="with --sequence-parallel: column "
                        "layers keep their input's s/tp tokens, all-gather them again in backward (memory-optimal)")
    add_async_dgrad_flag(parser)
    add_training_flags(parser, micro_batch_size=4, steps=20)
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    plan = plan_run(args, validate)
    device = init_distributed()
    grid = ProcessGrid(plan.grid)
    form = "saving the shard" if args.save_sequence_shard else "plain" if args.sequence_parallel else "off"
    module = apply_tensor_parallel(GPT(plan.cfg, seed=args.seed).to(device), grid.tp_group,
                                   **SEQUENCE_PARALLEL_FORMS[form], async_dgrad=args.async_tp_dgrad)
    # The tp groups are data-parallel replicas of each other: lesson 01's bucketed all-reduce.
    model = data_parallel.wrap_data_parallel(module, grid.dp_group, "bucketed", bucket_bytes_from_flags(args, device))
    optimizer = build_optimizer(module, args.lr)
    settings = StepSettings(device, autocast_dtype(args.dtype, device), args.max_grad_norm,
                            norm_groups=(grid.tp_group,), counts_toward_norm=tp_counts_toward_norm(grid.tp_group),
                            tail=args.step_tail)
    log0(f"lesson 02: tensor parallel, tp={grid.tp_size} x dp={grid.dp_size}, sequence parallelism {form}, "
         f"async dgrad {'on' if args.async_tp_dgrad else 'off'}, "
         f"{count_parameters(plan.cfg)['total']:,} parameters, {plan.shape.tokens_per_step:,} tokens per step")
    log0(grid.shape.picture())

    activations = ActivationMeter(model)
    # Validation is lesson 01's forward-only pass: the vocab-parallel loss reduces over tp inside it.
    batches = RankBatches(plan.batches, grid.dp_rank, device, val=plan.val_batches)    # tp ranks: the same
    throughput = train(args, optimizer, partial(data_parallel.train_step, model, optimizer, settings=settings),
                       batches, evaluate=partial(data_parallel.evaluate, model, settings=settings),
                       meters=StepMeters((activations,)), cfg=plan.cfg)
    report(MeteredRun(module, optimizer, activations, throughput, plan.cfg, plan.shape.seq_len, grid.shape.world_size,
                      device, throughput.steps), plan, form, settings.compute_dtype)
    shutdown()


if __name__ == "__main__":
    main()
