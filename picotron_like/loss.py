"""
The next-token loss: the textbook cross-entropy over logits already made, and the chunked one the
reference model's LM head computes, which never makes them whole (LinearCrossEntropy explains how,
and what it costs).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Callable, NamedTuple

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
# step's peak. The loss below (the model's LMHead calls it) never holds more than one chunk's
# logits: it computes the head's matmul and the loss chunk by chunk, keeps one float32 number per
# token (the log-sum-exp), and recomputes each chunk's logits in backward.
#
# A chunk holds as many logits as fit in a byte budget in float32, the budget chosen by the
# device. The CPU's, LOSS_CHUNK_BYTES, keeps a tiny model in one chunk and a large vocabulary's
# chunks at a few hundred tokens: its matmuls reach full speed at far smaller shapes than a GPU's,
# and its memory is the whole host's. A GPU's, LOSS_CHUNK_BYTES_CUDA, is four times that: a forward
# chunk of c tokens reads the whole weight (V h e bytes, 525 MB at the 1b preset) for 2 c h V FLOPs,
# c FLOPs per byte, and an H100 needs about 300 (989 TFLOP/s over 3.35 TB/s) before the matmul and
# not the weight's reads sets the time: 256 MiB gives c = 523 at V = 128,256, less than twice that,
# 1 GiB gives 2093. Backward then runs 4 blocks where it would run 16 (each rewrites the input's
# gradient once, below). The price: 1 GiB of float32 logits at the step's peak (0.5 GiB compiled,
# 1.5 GiB eager beside their bf16 product), under 2% of an 80 GB GPU.
LOSS_CHUNK_BYTES = 256 * 2**20
LOSS_CHUNK_BYTES_CUDA = 2**30


@dataclass(frozen=True)
class LossSettings:
    """How the chunked loss runs. Every choice gives the same loss and gradients up to float32
    rounding (tests/test_loss_memory.py, tests/test_loss_kernels.py); they differ in time and bytes.

    compile_backend: None runs each chunk's body eagerly, a few elementwise kernels over its float32
        logits; a torch.compile backend ("inductor") fuses each body into one kernel over the
        matmul's logits in their own dtype (LinearCrossEntropy counts the bytes). Lesson 07's
        --compile sets it on the LM head, with the blocks' backend.
    backward: "words" walks the weight's rows in blocks and writes each block's dW once, adding
        the block's part of dx (n h, the smaller when n < V) into it; "tokens" walks the tokens in
        chunks and adds each chunk's part of dW into it, reading and writing all V h of it once per
        chunk (the only backward before issue 37: kept so that a device check can time the two);
        "auto" takes the one that rewrites the smaller gradient: words when the micro-batch has
        fewer tokens than the weight has words.
    chunk_bytes: the budget of one chunk's float32 logits; None: the device's (loss_chunk_bytes).
        benchmarks/gpu_loss.py gives the CPU's on a GPU to time the loss as it ran before issue 37."""

    compile_backend: str | Callable | None = None
    backward: str = "auto"
    chunk_bytes: int | None = None

    def __post_init__(self):
        if self.backward not in ("auto", "words", "tokens"):
            raise ValueError(f"backward must be 'auto', 'words' or 'tokens', got {self.backward!r}")

    def by_words(self, tokens: int, words: int) -> bool:
        """Whether backward walks the words (see `backward`) for `tokens` tokens over `words` words."""
        return tokens < words if self.backward == "auto" else self.backward == "words"


def loss_chunk_bytes(device_type: str = "cpu", settings: LossSettings = LossSettings()) -> int:
    """The byte budget of one chunk's float32 logits on a device of this type (or the settings')."""
    if settings.chunk_bytes is not None:
        return settings.chunk_bytes
    return LOSS_CHUNK_BYTES_CUDA if device_type == "cuda" else LOSS_CHUNK_BYTES


def loss_chunk_tokens(words: int, device_type: str = "cpu", settings: LossSettings = LossSettings()) -> int:
    """Tokens per forward chunk: as many as keep a chunk's float32 logits over `words` words within
    the budget, at least one."""
    return max(1, loss_chunk_bytes(device_type, settings) // (4 * words))


def loss_block_words(tokens: int, words: int, device_type: str = "cpu", settings: LossSettings = LossSettings()) -> int:
    """Words per backward block (by words, below): as many as keep the float32 logits of `tokens`
    tokens over them within the budget, at least one, at most `words`."""
    return min(words, max(1, loss_chunk_bytes(device_type, settings) // (4 * tokens)))


def loss_chunk_shape(tokens: int, words: int, device_type: str = "cpu",
                     settings: LossSettings = LossSettings()) -> tuple[int, int]:
    """(tokens, words) of the largest block of logits the loss's backward makes at once."""
    if settings.by_words(tokens, words):
        return tokens, loss_block_words(tokens, words, device_type, settings)
    return min(tokens, loss_chunk_tokens(words, device_type, settings)), words


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


# ----------------------------------------------------------------------------- the chunk bodies
# What each chunk does between its matmuls, in two forms. The eager one works in place on the
# chunk's float32 logits, so that a chunk never holds more than those beside the matmul's product
# (tests/test_loss_memory.py counts it to the byte). The fused one is written for TorchInductor:
# pure elementwise code and reductions, the target picked by comparing column numbers instead of a
# scatter, so that each body compiles to one kernel and no float32 copy of the logits exists.


def chunk_statistics(logits: torch.Tensor, target_cols: torch.Tensor, has_target: torch.Tensor):
    """(max, sum of exp(logit - max), the target's logit or 0) per row of `logits` [c, w], each
    float32 [c]; `target_cols` [c] each target's column (clamped), `has_target` whether it is one."""
    logits = logits.float()
    row_max = logits.amax(dim=-1)
    target_logit = torch.where(has_target, logits.gather(1, target_cols[:, None])[:, 0], 0.0)
    sum_exp = logits.sub_(row_max[:, None]).exp_().sum(dim=-1)
    return row_max, sum_exp, target_logit


def chunk_statistics_fused(logits: torch.Tensor, target_cols: torch.Tensor, has_target: torch.Tensor):
    """chunk_statistics without a float32 copy of the logits (for torch.compile)."""
    row_max = logits.float().amax(dim=-1)
    target_logit = torch.where(has_target, logits.gather(1, target_cols[:, None])[:, 0].float(), 0.0)
    sum_exp = (logits.float() - row_max[:, None]).exp().sum(dim=-1)
    return row_max, sum_exp, target_logit


def chunk_logit_gradient(logits: torch.Tensor, log_sum_exp: torch.Tensor, target_cols: torch.Tensor,
                         minus_one: torch.Tensor, row_scale: torch.Tensor) -> torch.Tensor:
    """In place, and returned: logits [c, w] become the loss's gradient by them, in their dtype:
    softmax = exp(logit - log_sum_exp) (log_sum_exp [c] already normalises it), plus `minus_one`
    [c] (-1, or 0 for a row whose target is not among these words) at column `target_cols` [c],
    times `row_scale` [c, 1] (token_gradient_scale)."""
    probs = logits.float().sub_(log_sum_exp[:, None]).exp_()
    # scatter_add, not indexing by the rows that hold their target: no host sync on a GPU
    probs.scatter_add_(1, target_cols[:, None], minus_one[:, None]).mul_(row_scale)
    return logits.copy_(probs)


def chunk_logit_gradient_fused(logits: torch.Tensor, log_sum_exp: torch.Tensor, target_cols: torch.Tensor,
                               minus_one: torch.Tensor, row_scale: torch.Tensor) -> torch.Tensor:
    """chunk_logit_gradient as one elementwise pass (for torch.compile): read once, written once."""
    probs = (logits.float() - log_sum_exp[:, None]).exp()
    columns = torch.arange(logits.shape[1], device=logits.device)
    probs = torch.where(columns == target_cols[:, None], probs + minus_one[:, None], probs)
    return logits.copy_(probs * row_scale)


class ChunkBodies(NamedTuple):
    """A pair of chunk bodies: the forward's statistics and the backward's gradient by the logits."""

    statistics: Callable
    logit_gradient: Callable


EAGER_BODIES = ChunkBodies(chunk_statistics, chunk_logit_gradient)


@lru_cache(maxsize=None)
def compiled_bodies(backend: str | Callable) -> ChunkBodies:
    """The fused bodies through torch.compile with `backend`, made once per backend. Compiled for
    any shape (dynamic): the last chunk is shorter, and tp's slices and the budgets change the rest."""
    return ChunkBodies(torch.compile(chunk_statistics_fused, backend=backend, dynamic=True),
                       torch.compile(chunk_logit_gradient_fused, backend=backend, dynamic=True))


def chunk_bodies(settings: LossSettings) -> ChunkBodies:
    """The bodies the settings ask for: eager, or compiled with their backend."""
    return EAGER_BODIES if settings.compile_backend is None else compiled_bodies(settings.compile_backend)


# ----------------------------------------------------------------------------- forward and backward


def logit_statistics(inputs: torch.Tensor, weights: torch.Tensor, targets: torch.Tensor,
                     settings: LossSettings = LossSettings()) -> VocabularyStatistics:
    """The VocabularyStatistics of the logits inputs [n, h] @ weights [V, h]^T against `targets` [n]
    (rows of weights), made chunk by chunk of tokens: each chunk's logits are freed before the next's."""
    rows_of_targets, has_row = target_rows(targets, weights.shape[0])
    row_max, sum_exp, target_logit = (inputs.new_zeros(inputs.shape[0], dtype=torch.float32) for _ in range(3))
    statistics = chunk_bodies(settings).statistics
    chunk = loss_chunk_tokens(weights.shape[0], inputs.device.type, settings)
    for start in range(0, inputs.shape[0], chunk):
        rows = slice(start, start + chunk)
        row_max[rows], sum_exp[rows], target_logit[rows] = statistics(
            inputs[rows] @ weights.t(), rows_of_targets[rows], has_row[rows])
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
                    row_scale: torch.Tensor, settings: LossSettings = LossSettings()
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx [n, h], dW [V, h]) in the matmul dtype, the logits made again block by block (`targets`
    as in logit_statistics, row_scale from token_gradient_scale): by words or by tokens
    (LossSettings.backward)."""
    if settings.by_words(inputs.shape[0], weights.shape[0]):
        return logit_gradients_by_words(inputs, weights, targets, log_sum_exp, row_scale, settings)
    return logit_gradients_by_tokens(inputs, weights, targets, log_sum_exp, row_scale, settings)


def logit_gradients_by_words(inputs, weights, targets, log_sum_exp, row_scale, settings: LossSettings):
    """Per block of b words W_b: g = the gradient by the logits x W_b^T [n, b]; dW_b = g^T x,
    written once into its rows of dW; dx += g W_b. Bytes beyond the matmuls' own: dx [n, h] read
    and written once per block after the first, against by tokens' V h per chunk after the first."""
    logit_gradient = chunk_bodies(settings).logit_gradient
    grad_inputs, grad_weight = torch.empty_like(inputs), torch.empty_like(weights)
    block = loss_block_words(inputs.shape[0], weights.shape[0], inputs.device.type, settings)
    for start in range(0, weights.shape[0], block):
        words = slice(start, start + block)
        width = min(block, weights.shape[0] - start)
        target_cols = targets - start
        minus_one = torch.where((target_cols >= 0) & (target_cols < width), -1.0, 0.0)
        grad_logits = logit_gradient(inputs @ weights[words].t(), log_sum_exp, target_cols.clamp_(0, width - 1),
                                     minus_one, row_scale)
        torch.mm(grad_logits.t(), inputs, out=grad_weight[words])
        if start == 0:
            torch.mm(grad_logits, weights[words], out=grad_inputs)
        else:   # addmm with out=, not addmm_: the same kernel, and FlopCounterMode counts it
            torch.addmm(grad_inputs, grad_logits, weights[words], out=grad_inputs)
        del grad_logits, target_cols, minus_one
    return grad_inputs, grad_weight


def logit_gradients_by_tokens(inputs, weights, targets, log_sum_exp, row_scale, settings: LossSettings):
    """Per chunk of c tokens x_c: g = the gradient by the logits x_c W^T [c, V]; dx_c = g W,
    written once; dW += g^T x_c, all V h of dW read and written once per chunk."""
    logit_gradient = chunk_bodies(settings).logit_gradient
    rows_of_targets, has_row = target_rows(targets, weights.shape[0])
    minus_one_at_target = torch.where(has_row, -1.0, 0.0)
    grad_inputs, grad_weight = torch.empty_like(inputs), torch.zeros_like(weights)
    chunk = loss_chunk_tokens(weights.shape[0], inputs.device.type, settings)
    for start in range(0, inputs.shape[0], chunk):
        rows = slice(start, start + chunk)
        grad_logits = logit_gradient(inputs[rows] @ weights.t(), log_sum_exp[rows], rows_of_targets[rows],
                                     minus_one_at_target[rows], row_scale[rows])
        torch.mm(grad_logits, weights, out=grad_inputs[rows])
        grad_weight.addmm_(grad_logits.t(), inputs[rows])
        del grad_logits
    return grad_inputs, grad_weight


class LinearCrossEntropy(torch.autograd.Function):
    """loss = sum over tokens t with a target of  log sum_v exp(z_tv) - z_t,target,  z = x W^T,
    computed over chunks so that no more than one chunk's logits exist at a time.

    forward:  per chunk of tokens, z_chunk = x_chunk W^T (in the matmul dtype), and from it the
              chunk's VocabularyStatistics; the chunk's logits are freed before the next chunk's
              (logit_statistics). Then log_sum_exp = max + log(sum_exp), and the loss (reduced_loss).
              Kept for backward: x (the head's input, which the reference's matmul keeps too), W (a
              parameter), the targets and log_sum_exp, one float32 per token, in place of the
              reference's V per token.
    backward: per block of words (or chunk of tokens, LossSettings.backward), the block's logits
              recomputed, softmax = exp(z - log_sum_exp) (no second reduction: log_sum_exp already
              normalises it), minus one at the target, times the loss's gradient, written over the
              logits; then the block's dW written once and its part of dx added (logit_gradients).

    The price and the saving, per micro-batch of n tokens, hidden h, V words in W, e bytes per
    element of the matmul dtype, k chunks (as many as the device's budget of float32 logits needs,
    loss_chunk_bytes: 4 at the 1b preset's n = 8192 on a GPU):
      FLOPs: the head's forward matmul once more in backward, 2 n h V on top of its 6 n h V
             (a third more for the head, about 2% of an 8b step's FLOPs; MFU counts model FLOPs
             and leaves it out, as it leaves out recomputed blocks)
      bytes kept: 4 per token instead of 4 V (V = 128,256: 0.5 MB per token saved)
      bytes moved besides the matmuls': per logit, eager about 32 forward and 38 backward in bf16
             (each body's float32 passes), compiled 6 and 6 (the product written, then read by one
             fused kernel, which writes the gradient over it); and the gradient summed over
             blocks: by words dx, 2 n h e per block after the first, by tokens dW, 2 V h e per
             chunk after the first (1b, k = 4: 0.2 GB against 3.2 GB, and 16 GB at the CPU's
             budget of 16 chunks)
      bytes in flight: one chunk's logits, c V or n b of them, (4 + e) each eager with e != 4
             (the product and its float32 copy), e compiled (the gradient over the product), plus
             dW, dx and W in the matmul dtype: predicted_loss_transient_bytes (metrics) counts
             them, and the memory plan adds them to the step's peak.
    Recomputing rather than keeping the chunk's gradient from forward (what fused kernels such as
    Liger's do) keeps dW out of the forward: with gradient accumulation or a pipeline schedule the
    weight gradient of every live micro-batch would otherwise wait for its backward.

    Equal to cross_entropy_loss on the whole logits up to float32 rounding (tests/test_loss_memory.py),
    whichever LossSettings. The gradient summed over blocks is summed in the matmul dtype, then cast
    to the input's or W's (as autocast's matmul makes it in the matmul dtype): exact in float32; in
    bf16 one rounding per block where one matmul rounds once (dx by words, dW by tokens).
    """

    @staticmethod
    def forward(ctx, x, weight, targets, reduction: str, settings: LossSettings):
        dtype = matmul_dtype(x, weight)
        with torch.autocast(x.device.type, enabled=False):
            saved = x.to(dtype)
            targets_flat = targets.reshape(-1)
            stats = logit_statistics(saved.reshape(-1, x.shape[-1]), weight.to(dtype), targets_flat, settings)
            loss, log_sum_exp = reduced_loss(stats, targets_flat, reduction)
        ctx.save_for_backward(saved, weight, targets_flat, log_sum_exp)
        ctx.reduction, ctx.input_dtype, ctx.settings = reduction, x.dtype, settings
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        saved, weight, targets_flat, log_sum_exp = ctx.saved_tensors
        with torch.autocast(saved.device.type, enabled=False):
            grad_inputs, grad_weight = logit_gradients(
                saved.reshape(-1, saved.shape[-1]), weight.to(saved.dtype), targets_flat, log_sum_exp,
                token_gradient_scale(grad_loss, targets_flat, ctx.reduction), ctx.settings)
        return grad_inputs.view(saved.shape).to(ctx.input_dtype), grad_weight.to(weight.dtype), None, None, None


def linear_cross_entropy(x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                         reduction: str = "mean", settings: LossSettings = LossSettings()) -> torch.Tensor:
    """The loss of logits x W^T against `targets` (see LinearCrossEntropy), without making them all;
    `reduction` "mean" or "sum", as cross_entropy_loss; `settings` how it runs (LossSettings)."""
    return LinearCrossEntropy.apply(x, weight, targets, reduction, settings)
