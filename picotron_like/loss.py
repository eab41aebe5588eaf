"""
The next-token loss: the textbook cross-entropy over logits already made, and the chunked one the
reference model's LM head computes, which never makes them whole (LinearCrossEntropy explains how,
and what it costs).
"""

from __future__ import annotations

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


def loss_chunk_tokens(words: int) -> int:
    """Tokens per chunk: as many as keep a chunk's float32 logits over `words` words under
    LOSS_CHUNK_BYTES, at least one."""
    return max(1, LOSS_CHUNK_BYTES // (4 * words))


class VocabularyStatistics(NamedTuple):
    """Per token, float32 [n], over the words of a weight: the largest logit, the sum of
    exp(logit - that max), and the target's logit (0 where the target is not one of its words)."""

    row_max: torch.Tensor
    sum_exp: torch.Tensor
    target_logit: torch.Tensor


def matmul_dtype(x: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The dtype F.linear(x, weight) would multiply in: autocast's, else the weight's."""
    device_type = x.device.type
    return torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else weight.dtype


def target_rows(targets: torch.Tensor, words: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each target's row of a weight of `words` rows (clamped into it, so that it can always index),
    and whether the target is one of those rows at all (IGNORE_INDEX never is)."""
    has_row = (targets >= 0) & (targets < words)
    return targets.clamp(0, words - 1), has_row


def logit_statistics(inputs: torch.Tensor, weights: torch.Tensor, targets: torch.Tensor) -> VocabularyStatistics:
    """The VocabularyStatistics of the logits inputs [n, h] @ weights [V, h]^T against `targets` [n]
    (rows of weights), made chunk by chunk: each chunk's logits are freed before the next's."""
    rows_of_targets, has_row = target_rows(targets, weights.shape[0])
    row_max, sum_exp, target_logit = (inputs.new_zeros(inputs.shape[0], dtype=torch.float32) for _ in range(3))
    chunk = loss_chunk_tokens(weights.shape[0])
    for start in range(0, inputs.shape[0], chunk):
        rows = slice(start, start + chunk)
        logits = (inputs[rows] @ weights.t()).float()
        row_max[rows] = logits.amax(dim=-1)
        target_logit[rows] = torch.where(has_row[rows], logits.gather(1, rows_of_targets[rows, None])[:, 0], 0.0)
        sum_exp[rows] = logits.sub_(row_max[rows, None]).exp_().sum(dim=-1)
        del logits
    return VocabularyStatistics(row_max, sum_exp, target_logit)


def reduced_loss(stats: VocabularyStatistics, targets: torch.Tensor, reduction: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(the loss, log_sum_exp [n]) from the statistics over the whole vocabulary: the sum over the
    tokens with a target of log_sum_exp - the target's logit, divided by their count for "mean"
    (0 / 0 = NaN when nothing counts, as F.cross_entropy)."""
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction must be 'mean' or 'sum', got {reduction!r}")
    log_sum_exp = stats.row_max + stats.sum_exp.log()
    valid = targets != IGNORE_INDEX
    loss = torch.where(valid, log_sum_exp - stats.target_logit, 0.0).sum()
    return (loss / valid.sum() if reduction == "mean" else loss), log_sum_exp


def token_gradient_scale(grad_loss: torch.Tensor, targets: torch.Tensor, reduction: str) -> torch.Tensor:
    """[n, 1] float32: the gradient of the loss by each token's loss (0 for a token without target)."""
    valid = targets != IGNORE_INDEX
    scale = grad_loss / valid.sum() if reduction == "mean" else grad_loss
    return torch.where(valid, scale.float(), 0.0)[:, None]


def logit_gradients(inputs: torch.Tensor, weights: torch.Tensor, targets: torch.Tensor, log_sum_exp: torch.Tensor,
                    row_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx [n, h], dW [V, h]) in the matmul dtype, chunk by chunk: each chunk's logits made again,
    softmax = exp(z - log_sum_exp), minus one at the target (`targets` as in logit_statistics),
    times row_scale (token_gradient_scale); then dx_chunk = g W and dW += g^T x_chunk."""
    rows_of_targets, has_row = target_rows(targets, weights.shape[0])
    minus_one_at_target = torch.where(has_row, -1.0, 0.0)[:, None]
    grad_inputs = torch.empty_like(inputs)
    grad_weight = torch.zeros_like(weights)
    chunk = loss_chunk_tokens(weights.shape[0])
    for start in range(0, inputs.shape[0], chunk):
        rows = slice(start, start + chunk)
        probs = (inputs[rows] @ weights.t()).float().sub_(log_sum_exp[rows, None]).exp_()
        # scatter_add, not indexing by the rows that hold their target: no host sync on a GPU
        probs.scatter_add_(1, rows_of_targets[rows, None], minus_one_at_target[rows]).mul_(row_scale[rows])
        grad_logits = probs.to(weights.dtype)
        del probs
        torch.mm(grad_logits, weights, out=grad_inputs[rows])
        grad_weight.addmm_(grad_logits.t(), inputs[rows])
        del grad_logits
    return grad_inputs, grad_weight


class LinearCrossEntropy(torch.autograd.Function):
    """loss = sum over tokens t with a target of  log sum_v exp(z_tv) - z_t,target,  z = x W^T,
    computed over chunks of tokens so that no more than one chunk's logits exist at a time.

    forward:  per chunk, z_chunk = x_chunk W^T (in the matmul dtype, then float32), and from it the
              chunk's VocabularyStatistics; the chunk's logits are freed before the next chunk's
              (logit_statistics). Then log_sum_exp = max + log(sum_exp), and the loss (reduced_loss).
              Kept for backward: x (the head's input, which the reference's matmul keeps too), W (a
              parameter), the targets and log_sum_exp, one float32 per token, in place of the
              reference's V per token.
    backward: per chunk again, z_chunk recomputed, softmax = exp(z_chunk - log_sum_exp) (no second
              reduction: log_sum_exp already normalises it), minus one at the target, times the
              loss's gradient; then dx_chunk = g W and dW += g^T x_chunk (logit_gradients).

    The price and the saving, per micro-batch of n tokens, hidden h, V words in W, chunk c:
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
    def forward(ctx, x, weight, targets, reduction: str):
        dtype = matmul_dtype(x, weight)
        with torch.autocast(x.device.type, enabled=False):
            saved = x.to(dtype)
            targets_flat = targets.reshape(-1)
            stats = logit_statistics(saved.reshape(-1, x.shape[-1]), weight.to(dtype), targets_flat)
            loss, log_sum_exp = reduced_loss(stats, targets_flat, reduction)
        ctx.save_for_backward(saved, weight, targets_flat, log_sum_exp)
        ctx.reduction, ctx.input_dtype = reduction, x.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        saved, weight, targets_flat, log_sum_exp = ctx.saved_tensors
        with torch.autocast(saved.device.type, enabled=False):
            grad_inputs, grad_weight = logit_gradients(
                saved.reshape(-1, saved.shape[-1]), weight.to(saved.dtype), targets_flat, log_sum_exp,
                token_gradient_scale(grad_loss, targets_flat, ctx.reduction))
        return grad_inputs.view(saved.shape).to(ctx.input_dtype), grad_weight.to(weight.dtype), None, None


def linear_cross_entropy(x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                         reduction: str = "mean") -> torch.Tensor:
    """The loss of logits x W^T against `targets` (see LinearCrossEntropy), without making them all;
    `reduction` "mean" or "sum", as cross_entropy_loss."""
    return LinearCrossEntropy.apply(x, weight, targets, reduction)
