"""
The next-token loss: the textbook cross-entropy over logits already made, and the chunked one the
reference model's LM head computes, which never makes them whole (LinearCrossEntropy explains how,
and what it costs).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F


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
# step's peak. The loss below (the model's LMHead calls it) never holds more than one chunk of
# tokens' logits: it computes the head's matmul and the loss chunk by chunk, keeps one float32
# number per token (the log-sum-exp), and recomputes each chunk's logits in backward.
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

