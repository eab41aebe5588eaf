"""
Lesson 07's FP8 training: the blocks' matmuls in 8-bit floats, forward and backward, proven.

    torchrun --nproc_per_node=2 07_fp8.py                                   # CPU, ~40 s: every recipe vs none
    torchrun --nproc_per_node=4 07_full_5d.py --dp 2 --tp 2 --fp8 rowwise   # in the trainer

The problem. On every GPU since the H100 a matmul of 8-bit floats runs at twice the rate of
bf16 (an H100: 989 TFLOP/s bf16, 1979 FP8; a B300: 2.25 and 4.5 PFLOP/s), and an 8-bit copy of a
tensor is half a bf16 one. But 8 bits hold little: the two formats the hardware multiplies are

    format     bits (sign, exponent, mantissa)   largest   smallest normal  smallest subnormal  spacing
    e4m3fn     1, 4, 3   (no inf; one NaN code)   448       2^-6             2^-9                2^-3 relative
    e5m2       1, 5, 2   (IEEE-like, with inf)    57344     2^-14            2^-16               2^-2 relative

(spacing: between 2^e and 2^(e+1) the values step by 2^(e-m), one eighth of 2^e for e4m3). A
weight of the tiny preset is about 0.02, an activation about 1, a gradient 1e-5..1e-3: cast
straight to e4m3, the gradients flush to zero (below 2^-10 everything does) and the weights keep
one or two significant bits. Hence the scale.

The idea. Multiply in 8 bits what a scale s has moved into the format's range, and multiply s
back in after the matmul, where it is one multiplication per output (or per row, or per block):

    x_fp8 = cast(clamp(x / s, -max, max))       s = 2^ceil(log2(amax / max))
    X W^T ~ (X_fp8 s_X)(W_fp8 s_W)^T = (X_fp8 W_fp8^T) * s_X s_W      (the kernel: torch._scaled_mm)

s is a power of two: x / s then only moves the exponent, exactly, so the one error is the cast's,
and amax / s lies in (max/2, max]: the largest value lands in the top binade, nothing saturates.
Three recipes differ only in how many values share one amax, and so one s:
    tensorwise   one s per tensor                          (the Transformer Engine's and torchao's first)
    rowwise      one s per row of the left operand and per column of the right: per token and
                 per output feature in the forward, each s a product kept outside the sum
    mxfp8        one s per block of 32 consecutive elements along the reduction dimension, stored
                 as float8_e8m0fnu (an 8-bit exponent, the OCP MX format Blackwell multiplies)
A finer grain follows the values more closely, but with power-of-two scales a value in the format's
normal range rounds the same under any scale (dividing by 2^k moves only its exponent): the scale
picks which 2^18 of magnitudes e4m3 covers, and the recipes differ only for values more than 2^15
below their scale's amax (an outlier feature's neighbours), which a coarse scale pushes into the
subnormals or flushes to zero. tests/test_fp8.py shows it both ways. The matmuls of one linear layer Y = X W^T:

    forward       Y  = X   W^T    reduction over K (in features)    X, W in e4m3
    input grad    dX = dY  W      reduction over N (out features)   dY in the gradient format
    weight grad   dW = dY^T X     reduction over T (tokens)

Each operand is scaled along its own reduction dimension (rowwise: one s per index of the other
dimension; mxfp8: blocks along it), so the backward quantises again: dY twice (per token, per
feature), W along N, and X along T. The gradient format: e5m2 for tensorwise, whose one scale must
span every row of a gradient (rows that differ by 2^20 are common: e5m2 spans 2^32, e4m3 2^18);
e4m3 for rowwise and mxfp8, whose scale follows each row or block, where range matters less than
the extra mantissa bit (half the rounding error). torchao makes the same choice.

What saturates: nothing, with scales from the current amax (amax / s <= max). A value beyond the
format's max becomes inf when cast to e5m2 (torch 2.13's CPU cast clamps e4m3fn, which has no inf,
to 448), so the quantiser clamps first, in both formats: the control without scales (test_fp8.py's
negative control) shows what clamping and flushing to zero do to training.
The error bound (used by the tests, derived, not fitted): rounding to nearest with m mantissa bits,

    |x - dequantised(x)| <= max(2^-(m+1) |x|, 2^(e_min - m - 1) s)      e4m3: m = 3, e_min = -6

the relative half-spacing above the smallest normal, half the subnormal spacing below it.

What stays in bf16, and why: the embedding (a lookup, no matmul), the LM head (its logits feed a
softmax over the vocabulary, where FP8's 6% steps move the loss itself; torchao and the
Transformer Engine leave it too), the router (a tiny matmul whose argmax picks experts: a flipped
choice costs more than FP8 saves), the routed experts (grouped matmuls of uneven groups: FP8
grouped GEMMs are a kernel of their own, not taught here), the attention core (SDPA) and the norms.
On a GPU also the blocks' linears whose shapes FP8 does not speed up (the shape rule, from torchao's
H100 crossover shapes: rowwise keeps in bf16 any layer of at most 2048 in-features, which is every one
of the 1b preset's but down, at 8,192 tokens; "where FP8 pays", below). The report says how many.

With tensor parallelism (lesson 02) the scales must be one device's: a tensor split over the tp
ranks takes its amax over all of them (an all-reduce MAX of one number, tensorwise), rowwise the
amax along a reduction dimension that the layer splits (row-parallel layers split K: the forward's
X and W; column-parallel layers split N: the input gradient's dY and W), and an mxfp8 block never
straddles two ranks' shards (every split dimension a multiple of 32 per rank: a configuration
rule). Under sequence parallelism (lesson 02's shard-saving form, which lesson 07 runs) a column
layer keeps only this rank's tokens: their FP8 copy is scaled along the tokens with the amax over
tp, and backward all-gathers that copy (1 byte per element) instead of the shard. Under context
parallelism (lesson 04) a rank holds part of each sequence's tokens, so the scales along the tokens
(the weight gradient's X and dY) take their amax over cp as well, and mxfp8's blocks of 32 tokens
lie within one rank's piece of a sequence (a rule). With ZeRO-3
(lesson 06) the weight is quantised after the gather, in the forward and again in the backward,
from the full-precision weight ZeRO gathered: the same bytes on every layout. Under lesson 03's
zero-bubble schedule a layer's backward splits where it divides: B quantises dY, computes dX and
runs every all-reduce; W multiplies the FP8 copies of dY and X that B left, later.

The price, per linear layer of a block and micro-batch of T tokens:
    compute     the matmuls' 6 T N K FLOPs at the FP8 rate (2x bf16 on H100/H200/B200/B300), with
                fast accumulation where torchao's recipes allow it (RECIPES); the quantisations are
                elementwise passes (amax, scale, cast) over X, W and dY: 2 in the forward, 4 in the
                backward, memory-bound: ten kernels each eager, one or two compiled (--compile)
    memory      kept for the weight gradient: X in FP8 (1 byte per element, shared by the layers
                that read one input: q, k, v; gate, up) instead of X in the compute dtype, plus
                its scales: 4 bytes (tensorwise), 4 K (rowwise: one per in-feature), T K / 32
                (mxfp8: one e8m0 byte per block of tokens). The weights stay as they were
                (float32 master, bf16 copy): FP8 copies of them live only inside a matmul.
    traffic     tensorwise: one float per split tensor's amax; rowwise: one per row of a split
                reduction; mxfp8: none. Sequence parallelism's backward all-gather of the kept
                tokens moves T K bytes (mxfp8: + T K / 32) instead of 4 T K

Proven (tests/test_fp8.py): each recipe's error within the bound, no inf or NaN, mxfp8's scales
exact powers of two; the FP8 linear's forward and backward equal a float32 emulation bit for bit;
50 steps of training within a bound of bf16's loss, a control without scales rejected by the same
check; dp x tp (with and without sequence parallelism) and cp x tp equal to one device, and a
row-parallel layer with outlier features, or a sequence-parallel column layer with outlier tokens,
equal to it only with the tp all-reduce of the amaxes (cp x tp: one device's codes only with the
all-reduce over cp); the kept activation bytes equal the formula; zero-bubble equal to 1F1B bit
for bit (tests/test_full_5d_zero_bubble.py); the compiled quantisation one kernel where eager runs
ten, equal to it bit for bit; the shape rule's choice forced on the CPU (some groups bf16) equal to
one device with the same groups, its traffic and kept bytes the formulas'. On CPU the tensorwise and rowwise matmuls run through
torch._scaled_mm's CPU kernel; mxfp8 is emulated (dequantise, float32 matmul), as it is on CUDA
GPUs without MX tensor cores. On Blackwell (sm_100+) mxfp8 goes to
torch._scaled_mm's block-scaled kernel (mx_kernel_runs, swizzled_block_scales); no GPU has run that
path yet: benchmarks/fp8_mx_kernel_check.py compares it with the emulation where one has it.
A recipe whose kernel this GPU lacks (mxfp8 before Blackwell, any recipe before sm_89) is refused
before the run with one error naming the faster choice (rowwise, or bf16), unless --fp8-emulate.

Each speed-up has a switch, so that a GPU run can measure it against what it replaces:
--no-fp8-fast-accum, --no-fp8-fused-quantise (under --compile), --no-fp8-shape-rule; and
benchmarks/gpu_fp8_linear.py times every linear of the 1b and 8b presets both ways beside bf16.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, replace
from functools import lru_cache, partial

import torch
import torch.distributed as dist

from picotron_like import comm
from picotron_like.data import BatchShape, TokenBatches, builtin_corpus_paths
from picotron_like.lessons import load_lesson
from picotron_like.metrics import (ActivationMeter, add_traffic, log0, model_flops_utilisation, peak_flops_of_name,
                                   predicted_activation_bytes)
from picotron_like.model import GPT, SwiGLU, count_parameters, flops_per_token
from picotron_like.topology import (DEVICE_ENV, ConfigError, GridShape, ProcessGrid, init_distributed, rank_device,
                                   shutdown)
from picotron_like.train import (StepSettings, add_model_flags, build_optimizer, check_flag_ranges, config_from_flags,
                                 exit_with_error, model_name)

data_parallel = load_lesson("01_data_parallel")
tensor_parallel = load_lesson("02_tensor_parallel")

FP8_CHOICES = ("none", "tensorwise", "rowwise", "mxfp8")

# ============================================================================ the technique: formats and scales


@dataclass(frozen=True)
class Fp8Format:
    dtype: torch.dtype
    mantissa_bits: int
    min_normal_exponent: int

    @property
    def max(self) -> float:
        return torch.finfo(self.dtype).max


E4M3 = Fp8Format(torch.float8_e4m3fn, 3, -6)
E5M2 = Fp8Format(torch.float8_e5m2, 2, -14)
MX_BLOCK = 32


GEMMS = ("output", "grad_input", "grad_weight")         # Y = X W^T, dX = dY W, dW = dY^T X


@dataclass(frozen=True)
class Recipe:
    """How the scales are grained, in which format the gradients go, which of the three GEMMs
    accumulate fast (`fast_accum`, on CUDA: below) and whether the quantisation runs as compiled
    functions (`compiled`: under --compile, below). `scaled=False` is the negative control: every
    scale 1, values clamped to the format (nobody trains that way)."""

    name: str
    gradient_format: Fp8Format
    scaled: bool = True
    fast_accum: frozenset = frozenset()
    compiled: bool = False

    @property
    def block(self) -> int | None:
        return MX_BLOCK if self.name == "mxfp8" else None


# use_fast_accum, per GEMM, as torchao's recipes choose it. Hopper's FP8 tensor cores sum their products
# in an accumulator of about 14 significant bits (DeepSeek-V3's report, section 3.3.2, measured ~2 % error
# at K = 4096); without fast accumulation the kernel promotes the partial sums into float32 at intervals,
# which costs time. Tensorwise: fast for the forward alone (torchao's default), whose error is one more
# rounding of a new activation; the gradients keep float32 accumulation, since dW sums over every token of
# the micro-batch (8,192 terms and more, where a 14-bit sum drops the small ones) and dX's error reaches
# every layer below. Rowwise: all three fast, because the rowwise kernels behind torch._scaled_mm are only
# fast with it (torchao's reason for its rowwise recipe). mxfp8: none (torchao's MX path sets none).
# On the CPU torch._scaled_mm accepts and ignores the flag (tests/test_fp8.py: bit for bit the same).
RECIPES = {"tensorwise": Recipe("tensorwise", E5M2, fast_accum=frozenset({"output"})),
           "rowwise": Recipe("rowwise", E4M3, fast_accum=frozenset(GEMMS)),
           "mxfp8": Recipe("mxfp8", E4M3)}


@dataclass
class Quantised:
    """An FP8 tensor and the scales that give back its values: value = data * scale, with `scale`
    a float32 scalar (tensorwise), a column or row of float32 (rowwise: amax taken along `axis`),
    or one float8_e8m0fnu per block of 32 along `axis` (mxfp8: shape [.., n / 32, ..])."""

    data: torch.Tensor
    scale: torch.Tensor
    axis: int
    block: int | None

    def dequantise(self) -> torch.Tensor:
        scale = self.scale.float()
        if self.block is not None:       # each block's scale over its 32 elements along `axis`
            scale = scale.repeat_interleave(self.block, dim=self.axis)
        return self.data.float() * scale

    def t(self) -> "Quantised":
        return Quantised(self.data.t(), self.scale.t() if self.scale.dim() else self.scale, 1 - self.axis,
                         self.block)


def power_of_two_scale(amax: torch.Tensor, fmt: Fp8Format) -> torch.Tensor:
    """The smallest power of two s with amax / s <= the format's max. An all-zero tensor (or
    block) gets s = 2^-126, float32's smallest normal, which e8m0 holds too, and stays zeros."""
    floor = torch.finfo(torch.float32).tiny * fmt.max
    return torch.exp2(torch.ceil(torch.log2(amax.clamp(min=floor) / fmt.max)))


def amax_over_shards(amax: torch.Tensor, group) -> torch.Tensor:
    """The amax of a tensor (or of its rows) that the ranks of `group` hold in pieces: the largest
    of theirs, so every rank scales with one device's amax."""
    comm.call(dist.all_reduce, amax, op=dist.ReduceOp.MAX, group=group)
    return amax


# The quantisation's arithmetic, in three pure functions (no collective inside): amax_along, then
# cast_with_amax, or both at once (scaled_cast) where no amax crosses ranks, and block_cast for mxfp8.
# `axis` None: one amax for the whole tensor (tensorwise).


def amax_along(t: torch.Tensor, axis: int | None) -> torch.Tensor:
    x = t.float().abs()
    return x.amax() if axis is None else x.amax(dim=axis, keepdim=True)


def cast_with_amax(t: torch.Tensor, amax: torch.Tensor, fmt: Fp8Format) -> tuple[torch.Tensor, torch.Tensor]:
    scale = power_of_two_scale(amax, fmt)
    return (t.float() / scale).clamp(-fmt.max, fmt.max).to(fmt.dtype), scale


def scaled_cast(t: torch.Tensor, axis: int | None, fmt: Fp8Format) -> tuple[torch.Tensor, torch.Tensor]:
    return cast_with_amax(t, amax_along(t, axis), fmt)


def block_cast(t: torch.Tensor, axis: int, fmt: Fp8Format) -> tuple[torch.Tensor, torch.Tensor]:
    """mxfp8: an amax and a scale per block of 32 along `axis`, the scales as e8m0."""
    blocks = t.float().unflatten(axis, (t.shape[axis] // MX_BLOCK, MX_BLOCK))
    scale = power_of_two_scale(blocks.abs().amax(dim=axis + 1), fmt)
    data = (blocks / scale.unsqueeze(axis + 1)).clamp(-fmt.max, fmt.max).flatten(axis, axis + 1)
    return data.to(fmt.dtype), scale.to(torch.float8_e8m0fnu)


# Eager, each quantisation is a chain of separate kernels (abs, amax, clamp, divide, log2, ceil, exp2,
# divide, clamp, cast: 10 for a float32 input, counted in tests/test_fp8.py; 12 for a bf16 one, cast to
# float32 twice), most of them a pass over the whole tensor. Compiled, TorchInductor fuses each function
# above into one kernel on the CPU (the reduction and the cast as two loops of one kernel; on CUDA, Triton
# needs a kernel more where the amax spans the whole tensor or a column). Under --compile, Dynamo traces a
# block's FP8 layers into the block's graph (at tp = cp = 1: one graph per block, no break), and the compiled
# functions inline there; wherever a layer runs outside a compiled graph (a graph break around a
# collective, tp's and cp's amax all-reduces), they run compiled on their own. dynamic=True: one compilation
# per function, axis and format serves every layer's shape.
EAGER = {"amax_along": amax_along, "cast_with_amax": cast_with_amax, "scaled_cast": scaled_cast,
         "block_cast": block_cast}
COMPILED = {}       # filled by compile_quantisation, once, when a recipe asks for it (compiling costs seconds)


def compile_quantisation() -> dict:
    """The compiled twins of EAGER, made on first use (torch.compile compiles on each one's first call)."""
    if not COMPILED:
        COMPILED.update({name: torch.compile(function, dynamic=True) for name, function in EAGER.items()})
    return COMPILED


def quantise(t: torch.Tensor, axis: int, fmt: Fp8Format, recipe: Recipe, shards_group=()) -> Quantised:
    """t (2-D) in `fmt` with `recipe`'s scales for a matmul that sums over `axis`. `shards_group`:
    the groups (tp, cp or both) whose ranks hold other elements that the scale's amax spans (the
    caller knows which: Fp8Layer.groups_for), else empty."""
    if not recipe.scaled:
        return Quantised(t.float().clamp(-fmt.max, fmt.max).to(fmt.dtype), torch.ones((), device=t.device), axis,
                         None)
    run = compile_quantisation() if recipe.compiled else EAGER
    if recipe.block is not None:
        return Quantised(*run["block_cast"](t, axis, fmt), axis, recipe.block)
    amax_axis = None if recipe.name == "tensorwise" else axis
    if not shards_group:
        return Quantised(*run["scaled_cast"](t, amax_axis, fmt), axis, None)
    amax = run["amax_along"](t, amax_axis)
    for group in shards_group:          # a MAX over tp, then over cp: the MAX over both
        amax = amax_over_shards(amax, group)
    return Quantised(*run["cast_with_amax"](t, amax, fmt), axis, None)


# ============================================================================ the technique: the FP8 matmul


def has_scaled_mm(recipe: Recipe, device: torch.device) -> bool:
    """torch._scaled_mm multiplies tensorwise and rowwise FP8 on the CPU and on CUDA from sm_89
    (Ada, Hopper), and mxfp8 on CUDA where mx_kernel_runs; elsewhere scaled_matmul emulates it."""
    if not recipe.scaled or device.type not in ("cpu", "cuda"):
        return False
    if device.type == "cpu":
        return recipe.block is None
    capability = torch.cuda.get_device_capability(device)
    if recipe.block is not None:
        return mx_kernel_runs(capability, str(torch.__version__), torch.version.cuda)
    return runs_on_fp8_tensor_cores(recipe.name, capability)


def runs_on_fp8_tensor_cores(recipe: str, capability: tuple[int, int]) -> bool:
    """Whether `recipe`'s matmuls run on the FP8 tensor cores of a GPU of this compute capability
    (so at its FP8 peak): tensorwise and rowwise from sm_89, mxfp8 from sm_100 (Blackwell's MX
    tensor cores; with a torch that has the kernel, mx_kernel_runs)."""
    return capability >= ((10, 0) if recipe == "mxfp8" else (8, 9)) and recipe in RECIPES


def version_numbers(version: str) -> tuple[int, int]:
    """(major, minor) of a version string: "2.11.0+cu130" -> (2, 11), "12.8" -> (12, 8)."""
    major, minor = version.split("+")[0].split(".")[:2]
    return int(major), int(minor)


def mx_kernel_runs(capability: tuple[int, int], torch_version: str, cuda_version: str | None) -> bool:
    """Whether torch._scaled_mm multiplies mxfp8 (e4m3 codes, an e8m0 scale per 32 along K) on a GPU
    of this compute capability, with this torch built against this CUDA: cuBLAS's block-scaled kernel
    runs on Blackwell's MX tensor cores (sm_100 and later), torch calls it when both scales are
    float8_e8m0fnu from 2.7 on, and cuBLAS has it from CUDA 12.8. A CPU build (no CUDA) has none."""
    return (capability >= (10, 0) and cuda_version is not None and version_numbers(torch_version) >= (2, 7)
            and version_numbers(cuda_version) >= (12, 8))


def swizzled_block_scales(scale: torch.Tensor) -> torch.Tensor:
    """A [rows, K / 32] matrix of e8m0 scales in the layout the block-scaled kernel reads (torch's
    SWIZZLE_32_4_4, cuBLAS's block scaling factors layout), flattened: padded to tiles of 128 rows by
    4 blocks, the tiles row after row, and within a tile the 512 bytes ordered by (row % 32, row // 32,
    block), so that the scales of the rows one warp multiplies lie side by side. The padding's bytes
    scale rows and blocks the matmul does not have."""
    rows, blocks = scale.shape
    padded = torch.zeros(-(-rows // 128) * 128, -(-blocks // 4) * 4, dtype=torch.uint8, device=scale.device)
    padded[:rows, :blocks] = scale.view(torch.uint8)
    # [row tile, row // 32 in the tile, row % 32, block tile, block % 4] -> tiles, then (row % 32, row // 32, block)
    tiles = padded.view(padded.shape[0] // 128, 4, 32, padded.shape[1] // 4, 4).permute(0, 3, 2, 1, 4)
    return tiles.reshape(-1).view(torch.float8_e8m0fnu)


def mx_scaled_mm(a: Quantised, b: Quantised, out_dtype: torch.dtype) -> torch.Tensor:
    """a [M, K] @ b [K, N], both mxfp8 with blocks along K (a's scales [M, K / 32], b's [K / 32, N]),
    through the block-scaled kernel: a row-major, b column-major, each operand's scales as rows of
    K / 32 in the swizzled layout; the kernel writes bf16."""
    out = torch._scaled_mm(a.data.contiguous(), b.data.t().contiguous().t(), scale_a=swizzled_block_scales(a.scale),
                           scale_b=swizzled_block_scales(b.scale.t().contiguous()), out_dtype=torch.bfloat16)
    return out.to(out_dtype)


def scaled_matmul(a: Quantised, b: Quantised, recipe: Recipe, out_dtype: torch.dtype, gemm: str) -> torch.Tensor:
    """a [M, K] @ b [K, N] times their scales, in out_dtype; `gemm` (one of GEMMS) says which of the
    layer's three it is, for the recipe's fast accumulation. With the kernel: a row-major, b
    column-major (cuBLASLt's layout; copies only where they are not). Emulated: the values each
    FP8 element and scale stand for, multiplied in float32, which is what the CPU kernel does too
    (test_fp8.py: equal bit for bit)."""
    with torch.autocast(a.data.device.type, enabled=False):
        if not has_scaled_mm(recipe, a.data.device):
            return (a.dequantise() @ b.dequantise()).to(out_dtype)
        if recipe.block is not None:
            return mx_scaled_mm(a, b, out_dtype)
        # CUDA's rowwise kernel writes bf16 only; the CPU's writes any float dtype
        kernel_dtype = torch.bfloat16 if a.data.is_cuda and recipe.name == "rowwise" else out_dtype
        scale_a, scale_b = a.scale, b.scale
        if a.data.device.type == "cpu" and scale_a.dim() == 0:
            # torch 2.13's CPU kernel multiplies e4m3 x e4m3 with one scale each ~1000x slower than with
            # a scale per row and column (measured: 1-4 s against 2 ms for 512 x 128 x 384); the same
            # numbers per row and per column give the same result (test_fp8.py)
            scale_a, scale_b = scale_a.expand(a.data.shape[0], 1), scale_b.expand(1, b.data.shape[1])
        # the scales as dense tensors: a transposed [1, N] row is contiguous to torch but strided to the kernel
        out = torch._scaled_mm(a.data.contiguous(), b.data.t().contiguous().t(),
                               scale_a=scale_a.contiguous().flatten().view(scale_a.shape),
                               scale_b=scale_b.contiguous().flatten().view(scale_b.shape), out_dtype=kernel_dtype,
                               use_fast_accum=gemm in recipe.fast_accum)
        return out.to(out_dtype)


# ============================================================================ the technique: the FP8 linear layer


@dataclass(frozen=True)
class Fp8Layer:
    """One linear layer's FP8 settings: the recipe, which of its weight's dimensions lesson 02
    split over `tp_group` (0: column-parallel, N split; 1: row-parallel, K split; None: whole),
    and `cp_group`, whose ranks hold the other tokens of the same sequences (lesson 04), or None."""

    recipe: Recipe
    tp_group: object = None
    split_dim: int | None = None
    cp_group: object = None

    def groups_for(self, tp_split: set[int], axis: int, token_dim: int | None = 0) -> tuple:
        """The groups over which an operand's amax must be taken, given the dimensions `tp_split`
        of it that tp splits and its `token_dim`, which cp splits (None: the weight has none):
        tensorwise every group that splits a dimension, rowwise those that split its reduction
        `axis`; mxfp8 none (its blocks lie within one rank's part: fp8_problems)."""
        if not self.recipe.scaled or self.recipe.block is not None:
            return ()
        splits = [(dim, self.tp_group) for dim in sorted(tp_split) if self.tp_group is not None]
        if token_dim is not None and self.cp_group is not None:
            splits.append((token_dim, self.cp_group))
        return tuple(group for dim, group in splits if self.recipe.name == "tensorwise" or dim == axis)


class SharedInputQuantisation:
    """One input quantised once for all the layers that read it (q, k and v; gate and up), as
    lesson 02's SequenceRegather gathers once for them: the same X with the same scales gives the
    same FP8 copies, so they share one forward operand and one kept copy for the weight gradient
    (kept once, not once per layer). The first reader of a new X quantises; the last drops it."""

    def __init__(self, readers: int):
        self.readers, self.source, self.result, self.left = readers, None, None, 0

    def of(self, x: torch.Tensor, quantise_input):
        if torch.compiler.is_compiling():       # the compiler removes the repeats itself
            return quantise_input(x)
        if self.source is not x:
            self.source, self.result, self.left = x, quantise_input(x), self.readers
        result = self.result
        self.left -= 1
        if self.left == 0:
            self.source = self.result = None
        return result


def quantised_input(x2d: torch.Tensor, layer: Fp8Layer) -> tuple[Quantised, Quantised]:
    """X [T, K] for the forward (scaled along K) and the copy kept for the weight gradient
    (scaled along T); tensorwise, one scale serves both, so they are one tensor."""
    tp_split = {1} if layer.split_dim == 1 else set()        # row-parallel: K split
    forward = quantise(x2d, 1, E4M3, layer.recipe, layer.groups_for(tp_split, 1))
    if layer.recipe.name == "tensorwise" or not layer.recipe.scaled:
        return forward, forward
    return forward, quantise(x2d, 0, E4M3, layer.recipe, layer.groups_for(tp_split, 0))


def forward_matmul(x_forward: Quantised, weight: torch.Tensor, layer: Fp8Layer, out_dtype) -> torch.Tensor:
    """Y = X W^T over K, the weight scaled along K (its in-features: split by a row-parallel layer)."""
    w_split = {layer.split_dim} if layer.split_dim is not None else set()
    w = quantise(weight, 1, E4M3, layer.recipe, layer.groups_for(w_split, 1, token_dim=None))
    return scaled_matmul(x_forward, w.t(), layer.recipe, out_dtype, "output")


def fp8_input_gradient(grad: torch.Tensor, weight: torch.Tensor, layer: Fp8Layer, x_dtype) -> tuple:
    """dX = dY W over N (2-D), and dY quantised along T for the weight gradient (tensorwise: the
    same copy, one scale serves both). Every collective of the backward (the amaxes over tp and cp)
    is here, so zero-bubble's B runs them all and its W, fp8_weight_gradient alone, none."""
    recipe = layer.recipe
    dy = grad.reshape(-1, grad.shape[-1])
    fmt = recipe.gradient_format if recipe.scaled else E5M2
    dy_split = {1} if layer.split_dim == 0 else set()          # column-parallel: N split
    w_split = {layer.split_dim} if layer.split_dim is not None else set()
    dy_rows = quantise(dy, 1, fmt, recipe, layer.groups_for(dy_split, 1))
    w_columns = quantise(weight, 0, E4M3, recipe, layer.groups_for(w_split, 0, token_dim=None))
    grad_input = scaled_matmul(dy_rows, w_columns, recipe, x_dtype, "grad_input")
    dy_tokens = dy_rows if recipe.name == "tensorwise" or not recipe.scaled else \
        quantise(dy, 0, fmt, recipe, layer.groups_for(dy_split, 0))
    return grad_input, dy_tokens


def fp8_weight_gradient(dy_tokens: Quantised, x_tokens: Quantised, recipe: Recipe, dtype) -> torch.Tensor:
    """dW = dY^T X over T, from dY and X each quantised along the tokens."""
    return scaled_matmul(dy_tokens.t(), x_tokens, recipe, dtype, "grad_weight")


def fp8_gradients(grad: torch.Tensor, weight: torch.Tensor, layer: Fp8Layer, x_dtype, x_tokens) -> tuple:
    """dX and dW of the undivided backward, each operand quantised along its reduction dimension;
    `x_tokens()` returns the kept copy of X scaled along T, asked for between the two (where a
    shard-saving layer waits for the all-gather that travelled while dX was computed)."""
    grad_input, dy_tokens = fp8_input_gradient(grad, weight, layer, x_dtype)
    return grad_input, fp8_weight_gradient(dy_tokens, x_tokens(), layer.recipe, weight.dtype)


class Fp8Matmuls(torch.autograd.Function):
    """Y = X W^T with all three matmuls in FP8 (module docstring): forward over K, the input
    gradient over N, the weight gradient over T. Keeps X's FP8 copy scaled along T and the weight
    itself (a parameter, not an activation: under ZeRO-3 the one gathered again for backward)."""

    @staticmethod
    def forward(ctx, x, weight, layer: Fp8Layer, shared: SharedInputQuantisation, out_dtype):
        x_forward, x_kept = shared.of(x, partial(_quantised_input_2d, layer=layer))
        y = forward_matmul(x_forward, weight, layer, out_dtype)
        ctx.save_for_backward(x_kept.data, x_kept.scale, weight)
        ctx.layer, ctx.x_shape, ctx.x_dtype, ctx.kept_axis = layer, x.shape, x.dtype, x_kept.axis
        return y.view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad):
        data, scale, weight = ctx.saved_tensors
        x_kept = Quantised(data, scale, ctx.kept_axis, ctx.layer.recipe.block)
        grad_input, grad_weight = fp8_gradients(grad, weight, ctx.layer, ctx.x_dtype, lambda: x_kept)
        return grad_input.view(ctx.x_shape), grad_weight, None, None, None


def _quantised_input_2d(x: torch.Tensor, layer: Fp8Layer) -> tuple[Quantised, Quantised]:
    return quantised_input(x.reshape(-1, x.shape[-1]), layer)


def output_dtype(x: torch.Tensor) -> torch.dtype:
    """What F.linear would return: autocast's dtype where it is on, else the input's."""
    device = x.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype


class Fp8Forward:
    """A linear layer's forward with its matmul in FP8: the plain nn.Linear, lesson 02's column
    layer, or its row layer (whose exit_region, g, sums the partial outputs over tp)."""

    def forward(self, x):
        y = self.fp8_matmul(x)
        exit_region = getattr(self, "exit_region", None)
        y = y if exit_region is None else exit_region(y)
        return y if self.bias is None else y + self.bias

    def fp8_matmul(self, x):
        """X W^T (lesson 07's zero-bubble swaps in one whose backward leaves dW for W)."""
        if isinstance(x, tensor_parallel.SequenceParallelInput):      # lesson 02's shard-saving column layer
            return Fp8MatmulsSavingSequenceShard.apply(x.full, self.weight, self.fp8, quantised_once(x, self.fp8),
                                                       output_dtype(x.full))
        return Fp8Matmuls.apply(x, self.weight, self.fp8, self.fp8_input, output_dtype(x))


@lru_cache(maxsize=None)
def fp8_class(module_class: type) -> type:
    """`module_class` with Fp8Forward's forward: one class per kind of layer, shared by every block
    (a forward set on each instance would make torch.compile compile every block anew)."""
    return type("Fp8" + module_class.__name__, (Fp8Forward, module_class), {})


def to_fp8(linears: list, recipe: Recipe, tp_group, cp_group=None) -> None:
    """Layers that read one input: each gets FP8's forward, and all share one quantisation of it."""
    shared = SharedInputQuantisation(len(linears))
    for linear in linears:
        split_dim = getattr(linear.weight, "tp_split_dim", None)
        linear.fp8 = Fp8Layer(recipe, tp_group if split_dim is not None else None, split_dim, cp_group)
        linear.fp8_input = shared
        linear.__class__ = fp8_class(type(linear))


def fp8_linear_groups(block) -> list[list]:
    """A block's linear layers that go to FP8, grouped by the input they read (named in GROUPS):
    attention's q, k, v and o; a dense MLP's (or an MoE's shared expert's) gate, up and down. The
    router and the routed experts stay (module docstring)."""
    attn = block.attn
    groups = [[attn.q_proj, attn.k_proj, attn.v_proj], [attn.o_proj]]
    mlp = block.mlp if isinstance(block.mlp, SwiGLU) else getattr(block.mlp, "shared_expert", None)
    if mlp is not None:
        groups += [[mlp.gate_proj, mlp.up_proj], [mlp.down_proj]]
    return groups


GROUPS = {"qkv": 3, "o": 1, "gate_up": 2, "down": 1}       # fp8_linear_groups' groups: name -> linears


def apply_fp8(model, recipe: str | Recipe, tp_group=None, cp_group=None, in_fp8: dict | None = None):
    """The blocks' linear layers of `model` (a GPT, a pipeline chunk, after lesson 02's split:
    their weights' tp_split_dim says how) with FP8 matmuls by `recipe` (a name of RECIPES, or a
    Recipe: recipe_from_flags), in place; "none" leaves the model as it is. `cp_group`: with context
    parallelism (lesson 04), the ranks that hold the other tokens of this rank's sequences, over
    which the scales along the tokens take their amax. `in_fp8`: which GROUPS go to FP8 (the shape
    rule, groups_in_fp8); None: all. Call it before ZeRO (06), recomputation and compiling (07),
    which all wrap the layers from outside. Returns the model."""
    if recipe == "none":
        return model
    recipe = RECIPES[recipe] if isinstance(recipe, str) else recipe
    if recipe.compiled:
        compile_quantisation()
    for block in model.layers:
        for name, linears in zip(GROUPS, fp8_linear_groups(block)):
            if in_fp8 is None or in_fp8[name]:
                to_fp8(linears, recipe, tp_group, cp_group)
    return model


# ============================================================================ the technique: where FP8 pays

# FP8 halves a GEMM's time at best, and pays for it with the quantisations: elementwise passes over X, W
# and dY (memory-bound), whose cost grows with M K + K N + M N while the GEMM's saving grows with M K N.
# So small GEMMs lose. The rule (on CUDA; on the CPU every group stays FP8, so that the proofs prove every
# layer): torchao's auto-filter for its recipes (torchao/float8: _auto_filter_for_recipe, thresholds
# from its per-shape speedup tables of float8_roofline.py, measured on an H100), applied as torchao
# applies it to an nn.Linear, whose weight is [out, in]:
#     tensorwise  bf16 where out <= 4096 and in <= 1024
#     rowwise     bf16 where in <= 2048, or out <= 1024, or in <= 4096 and out <= 2048
#     mxfp8       no published table: every group FP8
# and, ours, the tokens: a micro-batch of at most 1024 tokens on the rank stays bf16 (M is the weight
# gradient's reduction dimension, the role in-features play in the forward; 1024 is the smallest
# threshold torchao sets on a dimension). The shapes are a tp rank's. A group of layers that read one
# input (q, k, v; gate, up) shares that input's quantisation, so it is judged as one GEMM of the
# group's summed width, a fused QKV or gate-up projection. For the 1b preset at 8,192 tokens: rowwise
# keeps q, k, v, o, gate and up in bf16 (its hidden of 2048 is torchao's in-features threshold) and down in
# FP8; tensorwise all FP8; the 8b preset all FP8 either way. benchmarks/gpu_fp8_linear.py measures each
# linear against bf16 and prints the rule's choice beside it. Switch: --no-fp8-shape-rule.


def group_gemm_shapes(cfg, tokens: int, tp: int) -> dict[str, tuple[int, int, int]]:
    """(tokens, in-features, out-features) of each group's forward GEMM on a tp rank (GROUPS)."""
    h, d = cfg.hidden, cfg.head_dim
    shapes = {"qkv": (tokens, h, (cfg.n_heads + 2 * cfg.n_kv_heads) * d // tp), "o": (tokens, cfg.n_heads * d // tp, h)}
    if not cfg.n_experts or cfg.n_shared_experts:
        f = (cfg.n_shared_experts if cfg.n_experts else 1) * cfg.ffn_hidden // tp
        shapes |= {"gate_up": (tokens, h, 2 * f), "down": (tokens, f, h)}
    return shapes


def fp8_pays(recipe: str, tokens: int, in_features: int, out_features: int) -> bool:
    """The shape rule above: whether a GEMM of this shape runs faster in FP8 by `recipe` on a GPU."""
    if tokens <= 1024:
        return False
    if recipe == "tensorwise":
        return not (out_features <= 4096 and in_features <= 1024)
    if recipe == "rowwise":
        return not (in_features <= 2048 or out_features <= 1024 or (in_features <= 4096 and out_features <= 2048))
    return True


def groups_in_fp8(cfg, recipe: str, tokens: int, tp: int, on_cuda: bool, shape_rule: bool = True) -> dict[str, bool]:
    """Which GROUPS of every block run in FP8: all on the CPU or without the rule, else those whose
    shape (a tp rank's, `tokens` per micro-batch) pays."""
    return {name: recipe != "none" and (not (on_cuda and shape_rule) or fp8_pays(recipe, *shape))
            for name, shape in group_gemm_shapes(cfg, tokens, tp).items()}


def fp8_groups_of_run(cfg, args, tokens: int, tp: int, on_cuda: bool) -> dict[str, bool]:
    """groups_in_fp8 for lesson 07's flags (--fp8, --fp8-shape-rule)."""
    return groups_in_fp8(cfg, args.fp8, tokens, tp, on_cuda, args.fp8_shape_rule)


def recipe_from_flags(args) -> Recipe | str:
    """--fp8's recipe with its switches: --no-fp8-fast-accum (no GEMM accumulates fast) and, under
    --compile, --fp8-fused-quantise (the quantisation as compiled functions); "none" as it is."""
    if args.fp8 == "none":
        return "none"
    recipe = RECIPES[args.fp8]
    return replace(recipe, fast_accum=recipe.fast_accum if args.fp8_fast_accum else frozenset(),
                   compiled=args.compile and args.fp8_fused_quantise)


def bf16_linears_line(cfg, in_fp8: dict[str, bool], n_layers: int) -> str:
    """How many of the blocks' FP8-capable linears the shape rule keeps in bf16, and which."""
    kept = [name for name, fp8 in in_fp8.items() if not fp8]
    total = sum(GROUPS[name] for name in in_fp8) * n_layers
    if not kept:
        return f"all {total} of the blocks' linears in FP8"
    names = ", ".join(NAMES_OF_GROUP[name] for name in kept)
    return (f"the shape rule keeps {sum(GROUPS[name] for name in kept) * n_layers} of the blocks' {total} "
            f"linears in bf16 ({names})")


NAMES_OF_GROUP = {"qkv": "q, k, v", "o": "o", "gate_up": "gate, up", "down": "down"}


# ============================================================================ the technique: with sequence parallelism

# Lesson 07 runs sequence parallelism in lesson 02's memory-optimal form: a column-parallel layer
# multiplies the gathered sequence and keeps only this rank's tokens of it, gathering them again in
# backward. In FP8 the forward operand is the gathered sequence scaled along K, as without sequence
# parallelism (a token's scales are its own, and every tp rank holds the whole token); the copy kept
# for the weight gradient is this rank's tokens scaled along T, whose scales span every rank's
# tokens: their amax is taken over tp (rowwise: one float per in-feature; tensorwise: one), and an
# mxfp8 block of 32 tokens must lie within one rank's part (a configuration rule). Backward gathers
# that FP8 copy, 1 byte per element (and mxfp8's scales, one byte per 32), where lesson 02 gathers
# the shard in its own dtype: a quarter of float32's bytes, half of bf16's.


class Fp8SequenceRegather:
    """Backward's all-gather of the kept FP8 copy of this rank's tokens, once for all the layers
    that read one input (q, k, v; gate, up): lesson 02's SequenceRegather for the codes and, for
    mxfp8, for the block scales, each moved as bytes (gloo has no float8 types)."""

    def __init__(self, group, blocks: bool):
        self.codes = tensor_parallel.SequenceRegather(group)
        self.scales = tensor_parallel.SequenceRegather(group) if blocks else None

    def add_reader(self) -> None:
        for regather in (self.codes, self.scales):
            if regather is not None:
                regather.readers += 1

    def start(self, kept: Quantised, sequences: int) -> None:
        """Start gathering every rank's copy; as [sequences, tokens, K], lesson 02's gather puts
        each sequence's tokens back in order."""
        self.codes.start(as_sequence_bytes(kept.data, sequences))
        if self.scales is not None:
            self.scales.start(as_sequence_bytes(kept.scale, sequences))

    def result(self, kept: Quantised) -> Quantised:
        """Every rank's tokens, scaled along T: the scales are the kept copy's (one device's after
        the amax all-reduce), or for mxfp8 every rank's blocks' gathered with the codes."""
        data = self.codes.result().flatten(0, 1).view(kept.data.dtype)
        scale = kept.scale if self.scales is None else self.scales.result().flatten(0, 1).view(kept.scale.dtype)
        return Quantised(data, scale, 0, kept.block)


def as_sequence_bytes(t: torch.Tensor, sequences: int) -> torch.Tensor:
    return t.view(torch.uint8).view(sequences, -1, t.shape[-1])


def quantised_sequence_input(full: torch.Tensor, shard: torch.Tensor, layer: Fp8Layer) -> tuple:
    """The gathered sequence [T, K] scaled along K for the forward, this rank's tokens [T / tp, K]
    scaled along T for the weight gradient (tp splits the tokens: their amax spans the tp group, and
    the cp group where cp splits them too), and the all-gather that brings every rank's copy back."""
    forward = quantise(full.reshape(-1, full.shape[-1]), 1, E4M3, layer.recipe, layer.groups_for(set(), 1))
    kept = quantise(shard.reshape(-1, shard.shape[-1]), 0, E4M3, layer.recipe, layer.groups_for({0}, 0))
    return forward, kept, Fp8SequenceRegather(layer.tp_group, kept.block is not None)


def quantised_once(x, layer: Fp8Layer) -> tuple:
    """quantised_sequence_input of one norm's output (a SequenceParallelInput), made by the first
    layer that reads it and kept on it for the others (q, k, v; gate, up): one quantisation, one
    amax all-reduce and one all-gather per norm output. The norm makes a new object every forward,
    so this holds under --compile too, where SharedInputQuantisation quantises per layer."""
    if not hasattr(x, "fp8_quantised"):
        with torch.no_grad():
            x.fp8_quantised = quantised_sequence_input(x.full, x.shard, layer)
    return x.fp8_quantised


class Fp8MatmulsSavingSequenceShard(torch.autograd.Function):
    """Fp8Matmuls for lesson 02's shard-saving column layer (its LinearSavingSequenceShard in FP8):
    multiplies the gathered sequence `full` (quantised: quantised_once's), keeps the FP8 copy of this
    rank's tokens, and in backward gathers every rank's copy while the input gradient is computed."""

    @staticmethod
    def forward(ctx, full, weight, layer: Fp8Layer, quantised: tuple, out_dtype):
        x_forward, x_kept, regather = quantised
        regather.add_reader()
        y = forward_matmul(x_forward, weight, layer, out_dtype)
        ctx.save_for_backward(x_kept.data, x_kept.scale, weight)
        ctx.layer, ctx.regather, ctx.x_shape, ctx.x_dtype = layer, regather, full.shape, full.dtype
        return y.view(*full.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad):
        data, scale, weight = ctx.saved_tensors
        kept = Quantised(data, scale, 0, ctx.layer.recipe.block)
        ctx.regather.start(kept, ctx.x_shape[0])
        grad_input, grad_weight = fp8_gradients(grad, weight, ctx.layer, ctx.x_dtype,
                                                lambda: ctx.regather.result(kept))
        return grad_input.view(ctx.x_shape), grad_weight, None, None, None


# ============================================================================ the technique: with zero-bubble's W

# Lesson 03's zero-bubble schedule (03_zero_bubble.py) splits each backward in two: B, the gradient
# of the input, which the previous stage waits for, now; W, the weights' gradients, later in the
# bubble. An FP8 layer splits where its backward already divides: B runs fp8_input_gradient (dY
# quantised along N and along T, W along N, dX, and every amax all-reduce among them) and leaves in
# the chunk's W queue the two FP8 copies that dW = dY^T X multiplies: X's, kept since the forward,
# and dY's along T (1 byte per element each, where lesson 03's linear leaves x and dy in the compute
# dtype). W runs fp8_weight_gradient: one matmul, no collective. Every quantisation and matmul runs
# once, the very calls of the undivided backward, so a step equals 1F1B's bit for bit
# (tests/test_full_5d_zero_bubble.py). Lesson 07 swaps these layers in (its DEFERRED_LINEARS).


@dataclass(frozen=True)
class Fp8WeightGradient:
    """One FP8 layer's W for one micro-batch, lesson 03's WeightGradient in FP8: what B left."""

    weight: torch.nn.Parameter
    grad_output_tokens: Quantised
    input_tokens: Quantised
    recipe: Recipe

    def compute(self) -> list[tuple[torch.nn.Parameter, torch.Tensor]]:
        return [(self.weight, fp8_weight_gradient(self.grad_output_tokens, self.input_tokens, self.recipe,
                                                  self.weight.dtype))]


class Fp8MatmulsDeferringWeightGradient(torch.autograd.Function):
    """Fp8Matmuls whose backward is B alone: dX now, the FP8 copies dW needs left in `pending` for
    W. The weight comes in inside a tuple, as lesson 03's deferring linear takes it: no autograd
    edge, so B runs none of its hooks and the data-parallel wrappers count its gradient in W."""

    @staticmethod
    def forward(ctx, x, weight: tuple, layer: Fp8Layer, shared: SharedInputQuantisation, out_dtype, pending):
        x_forward, x_kept = shared.of(x, partial(_quantised_input_2d, layer=layer))
        (ctx.weight,) = weight
        y = forward_matmul(x_forward, ctx.weight, layer, out_dtype)
        ctx.save_for_backward(x_kept.data, x_kept.scale)
        ctx.layer, ctx.pending, ctx.x_shape, ctx.x_dtype, ctx.kept_axis = layer, pending, x.shape, x.dtype, x_kept.axis
        return y.view(*x.shape[:-1], ctx.weight.shape[0])

    @staticmethod
    def backward(ctx, grad):
        data, scale = ctx.saved_tensors
        x_kept = Quantised(data, scale, ctx.kept_axis, ctx.layer.recipe.block)
        grad_input, dy_tokens = fp8_input_gradient(grad, ctx.weight, ctx.layer, ctx.x_dtype)
        ctx.pending.keep(Fp8WeightGradient(ctx.weight, dy_tokens, x_kept, ctx.layer.recipe))
        return grad_input.view(ctx.x_shape), None, None, None, None, None


class DeferringFp8Matmul:
    """An FP8 layer's matmul whose weight gradient waits for W, in the queue that lesson 03's
    defer_weight_gradients gives the layer (sequence parallelism's layers never come here: lesson
    07 refuses them with zero-bubble)."""

    def fp8_matmul(self, x):
        return Fp8MatmulsDeferringWeightGradient.apply(x, (self.weight,), self.fp8, self.fp8_input, output_dtype(x),
                                                       self.pending_weight_gradients)


@lru_cache(maxsize=None)
def deferring_fp8_class(module_class: type) -> type:
    """fp8_class(module_class) with DeferringFp8Matmul's matmul: what zero-bubble swaps in for it."""
    fp8_layer = fp8_class(module_class)
    return type("Deferring" + fp8_layer.__name__, (DeferringFp8Matmul, fp8_layer), {})


# ============================================================================ configuration rules


def fp8_problems(cfg, grid, args, gpu: GpuBuild | None = None) -> list[str]:
    """The recipe's kernel on the GPU (emulation_problem; `gpu`: this_ranks_gpu() unless given;
    --plan prices other machines' GPUs and checks none), then mxfp8's block rule (every other
    recipe composes with every layout lesson 07 runs): every dimension a matmul sums over, as one
    rank holds it, a multiple of 32, so that a block never straddles two ranks' parts: tp's shards
    of the features; cp's pieces of a sequence (zigzag: two per rank) and, under sequence
    parallelism, a tp rank's part of those tokens, each a run of one sequence's tokens."""
    recipe = getattr(args, "fp8", "none")
    if recipe == "none":
        return []
    if not getattr(args, "plan", False):
        problem = emulation_problem(recipe, gpu or this_ranks_gpu(), getattr(args, "fp8_emulate", False))
        if problem:
            return [problem]
    if recipe != "mxfp8":
        return []
    tp, d = grid.tp, cfg.head_dim
    widths = {"hidden": cfg.hidden, "n_heads * head_dim / tp": cfg.n_heads * d // tp,
              "n_kv_heads * head_dim / tp": cfg.n_kv_heads * d // tp,
              "micro-batch-size * seq-len (tokens)": args.micro_batch_size * args.seq_len}
    if grid.cp > 1:
        pieces = 2 * grid.cp if getattr(args, "zigzag", False) else grid.cp
        widths[f"seq-len / {pieces} (a piece of a sequence that a cp rank holds)"] = args.seq_len // pieces
    if getattr(args, "sequence_parallel", False):
        kept = args.seq_len // (grid.cp * tp)
        widths["seq-len / (cp * tp) (the tokens of a sequence that a tp rank keeps)"] = kept
    if not cfg.n_experts or cfg.n_shared_experts:
        widths["ffn_hidden / tp"] = (cfg.n_shared_experts if cfg.n_experts else 1) * cfg.ffn_hidden // tp
    return [f"--fp8 mxfp8: {name} = {value} is not a multiple of {MX_BLOCK}: mxfp8 scales blocks of "
            f"{MX_BLOCK} along every dimension a matmul sums over; use another size or --fp8 rowwise"
            for name, value in widths.items() if value % MX_BLOCK]


@dataclass(frozen=True)
class GpuBuild:
    """What decides which FP8 kernels torch._scaled_mm has: the GPU's compute capability and torch's build."""

    capability: tuple[int, int]
    torch_version: str
    cuda_version: str | None


def this_ranks_gpu() -> GpuBuild | None:
    """The GPU this rank will train on (topology.rank_device's choice: LOCAL_RANK's, unless
    PICOTRON_LIKE_DEVICE=cpu), read before any process group; None where it trains on the CPU."""
    requested = os.environ.get(DEVICE_ENV)
    if requested == "cpu" or not torch.cuda.is_available():
        return None
    device = rank_device(int(os.environ.get("LOCAL_RANK", 0)), torch.cuda.device_count(), requested)
    if device.type != "cuda":
        return None
    return GpuBuild(torch.cuda.get_device_capability(device), str(torch.__version__), torch.version.cuda)


def emulation_problem(recipe: str, gpu: GpuBuild | None, allow_emulation: bool) -> str | None:
    """--fp8 `recipe` on a GPU whose torch._scaled_mm lacks its kernel runs scaled_matmul's float32
    emulation, several times slower than bf16: refused before the run, naming the fastest choice
    that runs there (rowwise on sm_89+, else bf16), unless --fp8-emulate asks for it. The CPU
    emulates mxfp8 for the proofs: no GPU, no problem."""
    if recipe == "none" or gpu is None or allow_emulation:
        return None
    runs = (mx_kernel_runs(gpu.capability, gpu.torch_version, gpu.cuda_version) if recipe == "mxfp8"
            else runs_on_fp8_tensor_cores(recipe, gpu.capability))
    if runs:
        return None
    faster = "--fp8 rowwise" if runs_on_fp8_tensor_cores("rowwise", gpu.capability) else "--fp8 none (bf16)"
    return (f"--fp8 {recipe}: this GPU (sm_{gpu.capability[0]}{gpu.capability[1]}, torch {gpu.torch_version}, CUDA "
            f"{gpu.cuda_version}) has no {recipe} kernel, and its float32 emulation runs slower than bf16; use "
            f"{faster}, or add --fp8-emulate to run the emulation anyway")


def add_fp8_flag(parser) -> None:
    parser.add_argument("--fp8", choices=FP8_CHOICES, default="none",
                        help="the blocks' linear layers with FP8 matmuls (07_fp8.py): tensorwise, rowwise or mxfp8 "
                             "scales (mxfp8 emulated on the CPU; on a GPU without the recipe's kernel refused "
                             "unless --fp8-emulate)")
    parser.add_argument("--fp8-emulate", action="store_true",
                        help="run --fp8's float32 emulation on a GPU that lacks the recipe's kernel (slower than "
                             "bf16: for checking numerics, not for speed)")
    parser.add_argument("--fp8-fast-accum", action=argparse.BooleanOptionalAction, default=True,
                        help="CUDA: torch._scaled_mm's fast accumulation in the GEMMs the recipe allows "
                             "(tensorwise: the forward; rowwise: all three)")
    parser.add_argument("--fp8-fused-quantise", action=argparse.BooleanOptionalAction, default=True,
                        help="with --compile: each quantisation as a compiled function (fused kernels) where "
                             "an FP8 layer runs outside its block's compiled graph; off: a chain of eager kernels "
                             "there")
    parser.add_argument("--fp8-shape-rule", action=argparse.BooleanOptionalAction, default=True,
                        help="CUDA: keep in bf16 the blocks' linears whose shapes FP8 does not speed up "
                             "(torchao's H100 crossover shapes; the CPU keeps every one in FP8)")


# ============================================================================ measuring the three challenges


def error_bound(quantised: Quantised, fmt: Fp8Format, values: torch.Tensor) -> torch.Tensor:
    """Each element's bound on |x - dequantised x| (module docstring): half a spacing of the
    format, relative above its smallest normal, absolute (times the scale) below it."""
    scale = Quantised(torch.ones_like(quantised.data, dtype=torch.float32), quantised.scale, quantised.axis,
                      quantised.block).dequantise()
    m = fmt.mantissa_bits
    return torch.maximum(values.abs() * 2.0 ** -(m + 1), scale * 2.0 ** (fmt.min_normal_exponent - m - 1))


def kept_scale_bytes(recipe: str, tokens: int, width: int) -> int:
    """The scales of one kept FP8 copy of X [tokens, width], scaled along the tokens."""
    return {"tensorwise": 4, "rowwise": 4 * width, "mxfp8": tokens // MX_BLOCK * width}[recipe]


def kept_bytes_difference(cfg, recipe: str, tokens: int, tp: int, compute_dtype: torch.dtype,
                          n_layers: int, recompute: str = "none", sequence_parallel: bool = False,
                          in_fp8: dict | None = None) -> int:
    """What --fp8 changes in one micro-batch's kept activations (lesson 07's formula plus this):
    per block, each input read only by FP8 layers is kept as an FP8 copy (1 byte) and its scales
    instead of in the compute dtype (e bytes): attention's input (h, read by q, k, v), o_proj's (n_heads
    d / tp), a dense MLP's input (h) and down_proj's (f / tp); with sequence parallelism the column
    layers' inputs (h) are this rank's tokens / tp, as lesson 02 keeps them. An MoE's shared expert
    adds an FP8 copy of its input (the router and the experts keep the input itself) and swaps
    down_proj's. A group the shape rule keeps in bf16 (`in_fp8`: groups_in_fp8; None: all FP8)
    changes nothing. Full recomputation keeps each block's input alone: no change."""
    if recipe == "none" or recompute == "full":
        return 0
    e, h, d = compute_dtype.itemsize, cfg.hidden, cfg.head_dim
    column_tokens = tokens // tp if sequence_parallel else tokens
    inputs = {"qkv": (h, True, column_tokens), "o": (cfg.n_heads * d // tp, True, tokens)}
    if not cfg.n_experts:
        inputs |= {"gate_up": (h, True, column_tokens), "down": (cfg.ffn_hidden // tp, True, tokens)}
    elif cfg.n_shared_experts:
        inputs |= {"gate_up": (h, False, tokens), "down": (cfg.n_shared_experts * cfg.ffn_hidden // tp, True, tokens)}
    per_block = sum(kept * width * (1 - e * replaced) + kept_scale_bytes(recipe, kept, width)
                    for name, (width, replaced, kept) in inputs.items() if in_fp8 is None or in_fp8[name])
    return n_layers * per_block


def group_flops_per_token(cfg) -> dict[str, int]:
    """Training FLOPs per token of each of a block's GROUPS (6 per weight per token)."""
    h, d = cfg.hidden, cfg.head_dim
    flops = {"qkv": 6 * h * (cfg.n_heads + 2 * cfg.n_kv_heads) * d, "o": 6 * cfg.n_heads * d * h}
    if not cfg.n_experts or cfg.n_shared_experts:
        f = (cfg.n_shared_experts if cfg.n_experts else 1) * cfg.ffn_hidden
        flops |= {"gate_up": 6 * 2 * h * f, "down": 6 * f * h}
    return flops


def fp8_matmul_flops_per_token(cfg, in_fp8: dict | None = None) -> int:
    """Training FLOPs per token of the matmuls --fp8 runs in FP8: every block's attention
    projections and dense (or shared-expert) MLP, less the groups the shape rule keeps in bf16
    (`in_fp8`); the rest (embedding, head, router, routed experts, attention's core) stays at the
    bf16 rate."""
    return cfg.n_layers * sum(flops for name, flops in group_flops_per_token(cfg).items()
                              if in_fp8 is None or in_fp8[name])


def attainable_peak_flops(bf16_peak: float, fp8_peak: float, fp8_share: float) -> float:
    """The FLOP/s at best of a model whose FLOPs are `fp8_share` FP8 matmuls and the rest bf16
    work, each part at its own peak: seconds per FLOP add up, so the two rates combine harmonically
    (a model 75 % FP8 on an H100 peaks at 1/(0.25/989 + 0.75/1979) = 1,583 TFLOP/s, not 1,979)."""
    return 1 / ((1 - fp8_share) / bf16_peak + fp8_share / fp8_peak)


def log_fp8_compute(cfg, recipe: str, seq_len: int, tokens_per_s: float, n_ranks: int, device: torch.device,
                    bf16_peak: float | None, in_fp8: dict | None = None) -> None:
    """Below lesson 07's MFU line, which divides by the bf16 peak so that runs with and without
    --fp8 compare: which linears the shape rule kept in bf16 (`in_fp8`: groups_in_fp8), the share
    of the model's FLOPs that `recipe` runs as FP8 matmuls, and on a GPU whose FP8 peak metrics
    knows, the MFU against the peak that mix attains (attainable_peak_flops)."""
    in_fp8 = in_fp8 or dict.fromkeys(group_flops_per_token(cfg), True)
    log0(f"--fp8 {recipe}: {bf16_linears_line(cfg, in_fp8, cfg.n_layers)}")
    share = fp8_matmul_flops_per_token(cfg, in_fp8) / flops_per_token(cfg, seq_len)
    line = f"--fp8 {recipe}: its FP8 matmuls are {share:.0%} of the model's FLOPs"
    fp8_peak = peak_flops_of_name(torch.cuda.get_device_name(device), fp8=True) if device.type == "cuda" else None
    if not (bf16_peak and fp8_peak):
        log0(line + ("" if device.type == "cuda" else " (a CPU has no FP8 peak: no MFU)"))
        return
    if not has_scaled_mm(RECIPES[recipe], device):
        log0(line + ", emulated on this GPU (float32 matmuls of the dequantised values, --fp8-emulate): no FP8 "
                    "peak applies")
        return
    attainable = attainable_peak_flops(bf16_peak, fp8_peak, share)
    mfu = model_flops_utilisation(tokens_per_s, n_ranks, flops_per_token(cfg, seq_len), attainable)
    log0(line + f", at a {fp8_peak / 1e12:,.0f} TFLOP/s FP8 peak: MFU {100 * mfu:.1f} % of the "
         f"{attainable / 1e12:,.0f} TFLOP/s that mix attains at best (the MFU above: of the bf16 peak)")


def predicted_amax_traffic(cfg, recipe: str, tokens: int, tp: int, n_micro: int, n_layers: int,
                           recompute: str = "none", sequence_parallel: bool = False, cp: int = 1,
                           in_fp8: dict | None = None) -> dict:
    """The all-reduce MAX bytes per step that keep the scales one device's under tp and cp (float32
    amaxes; `tokens`: one micro-batch's tokens on this rank, seq / cp per sequence). Over tp,
    tensorwise: a column layer's (q, k, v, gate, up) W forward, dY and W backward; a row layer's
    (o, down) X and W forward, W backward: one float each. rowwise: a row layer's X (T floats) and W
    (N) forward, a column layer's dY (T) and W (K) backward. With sequence parallelism, the kept
    copy of each block norm's output (this rank's tokens): one float (tensorwise) or h (rowwise) in
    the forward. Over cp, whose ranks split the tokens: each input's scales along T in the forward
    (rowwise: its K as the rank holds it; tensorwise: one float, and one more for the kept tokens
    under sequence parallelism), each layer's dY along T in the backward (rowwise: its N; tensorwise:
    one). Full recomputation sends the forward's again. Groups kept in bf16 (`in_fp8`) send none."""
    if recipe not in ("tensorwise", "rowwise"):
        return {}
    h, d = cfg.hidden, cfg.head_dim
    fp8 = {name: in_fp8 is None or in_fp8[name] for name in group_flops_per_token(cfg)}
    mlp = fp8.get("gate_up", False), fp8.get("down", False)
    f = (cfg.n_shared_experts if cfg.n_experts else 1) * cfg.ffn_hidden
    # (N, K) of the whole layer, for each column and each row layer of a block that runs in FP8
    column = ([(cfg.n_heads * d, h), (cfg.n_kv_heads * d, h), (cfg.n_kv_heads * d, h)] * fp8["qkv"]
              + [(f, h)] * 2 * mlp[0])
    row = [(h, cfg.n_heads * d)] * fp8["o"] + [(h, f)] * mlp[1]
    forwards, traffic = (2 if recompute == "full" else 1), {}
    if tp > 1:
        if recipe == "tensorwise":
            forward, backward = len(column) + 2 * len(row), 2 * len(column) + len(row)
        else:
            forward, backward = sum(tokens + n for n, _ in row), sum(tokens + k for _, k in column)
        if sequence_parallel:       # attention's norm and the MLP's: the kept tokens' amax spans the tp ranks
            forward += (fp8["qkv"] + mlp[0]) * (1 if recipe == "tensorwise" else h)
        if forward or backward:
            traffic[("all_reduce", "tp")] = 4 * (forwards * forward + backward) * n_layers * n_micro
    if cp > 1:
        # the in-features of each input (attention's, o_proj's, the MLP's, down_proj's), the out-features
        # of each layer, as a tp rank holds them: a column layer splits N, a row layer K
        inputs = [h] * fp8["qkv"] + [cfg.n_heads * d // tp] * fp8["o"] + [h] * mlp[0] + [f // tp] * mlp[1]
        outputs = [n // tp for n, _ in column] + [n for n, _ in row]
        if recipe == "tensorwise":
            forward, backward = len(inputs) + (fp8["qkv"] + mlp[0]) * sequence_parallel, len(outputs)
        else:
            forward, backward = sum(inputs), sum(outputs)
        if forward or backward:
            traffic[("all_reduce", "cp")] = 4 * (forwards * forward + backward) * n_layers * n_micro
    return traffic


def predicted_fp8_traffic(cfg, recipe: str, tokens: int, tp: int, n_micro: int, n_layers: int,
                          recompute: str = "none", sequence_parallel: bool = False, cp: int = 1,
                          in_fp8: dict | None = None) -> dict:
    """What --fp8 changes in tp's and cp's traffic per step: the amaxes' all-reduces
    (predicted_amax_traffic) and, with sequence parallelism, the all-gather of each block norm's
    output in backward, which moves the kept FP8 copy (1 byte per element, and mxfp8's scales: one
    per 32) where lesson 02 counts 4 bytes per element; for the groups in FP8 (`in_fp8`)."""
    traffic = predicted_amax_traffic(cfg, recipe, tokens, tp, n_micro, n_layers, recompute, sequence_parallel, cp,
                                     in_fp8)
    if recipe == "none" or tp == 1 or not sequence_parallel:
        return traffic
    norms = sum(in_fp8 is None or in_fp8.get(name, False) for name in ("qkv", "gate_up"))
    gathered = tokens * cfg.hidden
    fp8_bytes = gathered + (gathered // MX_BLOCK if recipe == "mxfp8" else 0)
    if not norms:
        return traffic
    return add_traffic(traffic, {("all_gather_single", "tp"): norms * n_layers * n_micro * (fp8_bytes - 4 * gathered)})


def quantisation_errors(model, batch_tokens) -> dict:
    """For each recipe, the worst |x - dequantised x| / bound over the blocks' weights and their
    inputs in one forward, observed by hooks on the model's linear layers (<= 1: within the bound)."""
    inputs = {}
    hooks = [linear.register_forward_pre_hook(lambda module, args, name=name: inputs.setdefault(name, args[0]))
             for block in model.layers for group in fp8_linear_groups(block) for linear in group
             for name in [id(linear)]]
    with torch.no_grad():
        model(batch_tokens)
    for hook in hooks:
        hook.remove()
    linears = {id(linear): linear for block in model.layers for g in fp8_linear_groups(block) for linear in g}
    worst = {}
    for name, recipe in RECIPES.items():
        ratios = []
        for key, x in inputs.items():
            for tensor in (x.reshape(-1, x.shape[-1]), linears[key].weight.detach()):
                q = quantise(tensor, 1, E4M3, recipe)
                ratios.append(((q.dequantise() - tensor.float()).abs() / error_bound(q, E4M3, tensor.float())).max())
        worst[name] = max(ratios).item()
    return worst


# ============================================================================ main


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description="Lesson 07's FP8: every recipe trained on data-parallel ranks "
                                                 "(run with torchrun)",
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_model_flags(parser)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def train_recipe(cfg, recipe: str, batches: TokenBatches, grid: ProcessGrid, args, device) -> dict:
    """`args.steps` steps of lesson 01's data parallelism on `recipe`'s model: each step's loss, and
    the kept activations of the first micro-batch, measured."""
    model = data_parallel.wrap_data_parallel(apply_fp8(GPT(cfg, seed=args.seed).to(device), recipe),
                                             grid.dp_group, "bucketed", 25 * 2**20)
    optimizer = build_optimizer(model.module, args.lr)
    settings = StepSettings(device)
    losses = []
    for step in range(args.steps):
        losses.append(data_parallel.train_step(model, optimizer, batches.step_batch(step, grid.dp_rank),
                                               settings).loss)
    meter = ActivationMeter(model.module)
    inputs, targets = batches.step_batch(0, grid.dp_rank).micro_batches[0]
    with meter:
        model.module(inputs.to(device), targets.to(device)).backward()
    model.module.zero_grad()
    return {"losses": losses, "kept": meter.peak_bytes, "model": model.module}


def report(cfg, runs: dict, args, tokens: int) -> None:
    baseline = predicted_activation_bytes(cfg, args.micro_batch_size, args.seq_len)
    log0(f"\n{'--fp8':<12}{'loss first':>11}{'last':>9}{'vs none':>9}{'kept MB':>10}{'predicted':>11}")
    for recipe, run in runs.items():
        predicted = baseline + kept_bytes_difference(cfg, recipe, tokens, 1, torch.float32, cfg.n_layers)
        losses = run["losses"]
        log0(f"{recipe:<12}{losses[0]:>11.4f}{losses[-1]:>9.4f}{losses[-1] - runs['none']['losses'][-1]:>+9.4f}"
             f"{run['kept'] / 1e6:>10.3f}{predicted / 1e6:>11.3f}")
    log0("(kept: float32 here; each FP8 copy of a layer's input is 1 byte where float32 keeps 4, bf16 2)")
    inputs, _ = TokenBatches(builtin_corpus_paths()[0], BatchShape(args.micro_batch_size, args.seq_len, 1, 1),
                             seed=args.seed, vocab_size=cfg.vocab_size).step_batch(0, 0).micro_batches[0]
    worst = quantisation_errors(runs["none"]["model"], inputs)
    log0("\nworst quantisation error of the blocks' weights and inputs (e4m3), as a share of its bound: "
         + ", ".join(f"{name} {ratio:.3f}" for name, ratio in worst.items()))
    log0(f"FP8 share of the model's training FLOPs: "
         f"{fp8_matmul_flops_per_token(cfg) / (6 * count_parameters(cfg)['matmul_active']):.0%} of the matmuls'")


def main(argv=None):
    args = parse_args(argv)
    try:
        check_flag_ranges(args)
        cfg = config_from_flags(args)
        # every recipe, mxfp8 emulated where the GPU lacks its kernel: this lesson compares their numerics
        problems = fp8_problems(cfg, GridShape(), argparse.Namespace(**{**vars(args), "fp8": "mxfp8",
                                                                         "fp8_emulate": True}))
        if problems:
            raise ConfigError("bad configuration:\n  - " + "\n  - ".join(problems))
    except (ConfigError, ValueError) as error:
        exit_with_error(error)
    device = init_distributed()
    dp = dist.get_world_size()
    grid = ProcessGrid(GridShape(dp=dp))
    batches = TokenBatches(builtin_corpus_paths()[0], BatchShape(args.micro_batch_size, args.seq_len, 1, dp),
                           seed=args.seed, vocab_size=cfg.vocab_size)
    log0(f"lesson 07, FP8: dp={dp}, {model_name(args)}, {args.steps} steps of {dp * args.micro_batch_size} x "
         f"{args.seq_len} tokens per recipe, float32 elsewhere (compute and master weights)")
    runs = {recipe: train_recipe(cfg, recipe, batches, grid, args, device) for recipe in FP8_CHOICES}
    report(cfg, runs, args, args.micro_batch_size * args.seq_len)
    shutdown()


if __name__ == "__main__":
    main()
