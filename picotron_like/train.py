"""
The training skeleton every lesson shares: nothing here is a parallelism technique.

A lesson's ``main()`` reads as its table of contents because everything else lives here:

    args = parse_args(argv)                        # add_training_flags + add_parallel_flags + its own
    plan = plan_run(args, validate)                # every flag checked before any process group
    device = init_distributed(); grid = ProcessGrid(plan.grid)
    model, optimizer = <the lesson's technique>
    batches = RankBatches(plan.batches, grid.dp_rank, device, val=plan.val_batches)   # this rank's share
    throughput = train(args, optimizer, step_fn, batches, evaluate)
    report(...); shutdown()

- flags: ``add_training_flags`` (model, data, optimisation) and ``add_parallel_flags`` (the
  degrees of the grid), checked by ``check_flag_ranges``; ``plan_run`` turns them into the model
  shape, the grid and the batches, and stops every rank with one ``error:`` line if they cannot run;
- optimisation: ``build_optimizer`` (AdamW), the learning rate (``lr_schedule``: warm-up, then
  cosine or warmup-stable-decay), and the
  step's tail ``clip_and_step``: ``clip_grad_norm_``, whose norm is that of the *whole* model even
  when each rank holds a part, and ``optimizer_step``, which skips a step whose norm is not
  finite (on CUDA the clipping folded into fused AdamW);
- the step contract: every lesson's ``train_step(model, optimizer, batch, settings) -> StepResult``,
  with ``batch`` a ``data.StepBatch`` and ``settings`` a ``StepSettings``; the loss is summed over
  tokens and divided by the global batch's target count (``StepBatch.n_targets``);
- ``train``: the loop (learning rate, this rank's batch from ``RankBatches``, the step, log,
  validate, save); what a real run adds around it (the lagged log line, metrics, meters, agreed
  stops, the time budget, the profiler) are small objects in ``run_control``, each called at one
  place in the loop.
"""

from __future__ import annotations

import argparse
import copy
import math
import os
import sys
import time
from collections.abc import Callable
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, replace
from typing import Any, Protocol, runtime_checkable

import torch
import torch.distributed as dist

from picotron_like import comm
from picotron_like.data import BatchShape, StepBatch, TokenBatches, builtin_corpus_paths
from picotron_like.lr_schedule import DEFAULT_DECAY_SHARE, LR_SCHEDULES, run_learning_rate
from picotron_like.metrics import Throughput
from picotron_like.model import ATTENTION_PRIORITIES, GPTConfig, attention_backends, get_config
from picotron_like.run_control import (AfterStep, LaggedStepLog, RunControl, StepMeters, seconds_since_process_start,
                                       step_profiler)
from picotron_like.topology import AXES, ConfigError, GridShape, collective_timeout_s, world_size_from_env

# ----------------------------------------------------------------------------- optimisation


def build_optimizer(model, lr: float, weight_decay: float = 0.1,
                    betas=(0.9, 0.95), device: torch.device | None = None) -> torch.optim.AdamW:
    """AdamW; weight decay applies to matrices (linear and embedding weights), not to norm gains.

    The split is decided by each parameter's name, not its shape, so that a shard of a matrix is
    decayed exactly like the full matrix on one device. `model` is a module, or (name, tensor)
    pairs (lesson 06 hands over the pieces of its shards, each named after its parameter).
    `device`: the run's device, whose implementation steps them (adamw_implementation); by default
    the parameters' own (they differ where the optimizer's tensors live in host memory).
    """
    decay, no_decay = [], []
    for name, param in model.named_parameters() if isinstance(model, torch.nn.Module) else model:
        (no_decay if name.endswith("norm.weight") else decay).append(param)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    device = device or next(iter(decay + no_decay), torch.empty(0)).device
    return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=1e-8, **adamw_implementation(device))


def adamw_implementation(device: torch.device) -> dict:
    """AdamW's keyword for how it runs over the tensors: fused on CUDA, a plain loop elsewhere.

    foreach=False updates one tensor at a time with ordinary tensor operations, so a sharded run
    performs the same float operations on each slice as the reference does on the whole tensor:
    the CPU proofs rely on it. On CUDA that loop launches several small kernels per tensor, one
    Python call each; fused=True updates all tensors in one multi-tensor kernel. Its arithmetic
    is elementwise too, so a shard still steps as its slice of the whole tensor would.
    """
    return {"fused": True} if torch.device(device).type == "cuda" else {"foreach": False}


def set_learning_rate(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """Every group at the schedule's rate `lr`; a group with an "lr_ratio" (Muon's, whose peak is
    its own) at that multiple of it."""
    for group in optimizer.param_groups:
        group["lr"] = lr * group["lr_ratio"] if "lr_ratio" in group else lr


def global_grad_norm(grads: list[torch.Tensor], device: torch.device, sharded_over=(),
                     foreach: bool = False) -> torch.Tensor:
    """The norm of `grads` summed over the groups the parameters are split across (`sharded_over`),
    a 0-dim float32 tensor on `device`.

    `device` is the step's device, not the gradients': a rank that holds no gradient (nothing of
    the model falls in its shards) still joins the all-reduce, and on a GPU run its tensor must be
    on the GPU, where its peers' are (a CPU tensor would send it through gloo while they use NCCL).

    The exact path adds each tensor's sum of squares in float32, one tensor at a time: the CPU
    proofs compare it with one device's norm to float32 rounding. `foreach` takes every tensor's
    norm in one multi-tensor kernel (`_foreach_norm`) and sums their squares: a few kernels in all,
    where the exact path launches three per tensor and writes each square out; on a CPU its
    blocked sums differ from the exact ones by ~2e-5 relative for a million values.
    """
    if foreach and grads:
        norms = torch._foreach_norm(grads, 2, dtype=torch.float32)
        norm_sq = torch.stack(norms).to(device).pow(2).sum()
    else:
        norm_sq = torch.zeros((), dtype=torch.float32, device=device)
        for grad in grads:
            norm_sq += grad.detach().float().pow(2).sum()
    for group in sharded_over:
        comm.call(dist.all_reduce, norm_sq, group=group)
    return norm_sq.sqrt()


def clip_factor(grad_norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    """min(1, max_norm / (norm + 1e-6)), on the device: times 1 changes no bit when the norm is
    below max_norm. A non-finite norm makes it 0 or NaN: optimizer_step skips that step."""
    return (max_norm / (grad_norm + 1e-6)).clamp(max=1.0)


def clip_grad_norm_(params, max_norm: float, sharded_over=(), counts_toward_norm=None,
                    device: torch.device | None = None, foreach: bool = False) -> torch.Tensor:
    """Scale gradients so that the global gradient norm is at most max_norm; return that norm (a
    0-dim float32 tensor on `device`, by default the gradients').

    The global norm squared is the sum of squares over every *distinct* parameter element of the
    model. A rank holding a shard contributes its shard's sum of squares, and the contributions
    are summed over the groups the parameters are split across (`sharded_over`: e.g. the tp and
    pp groups). A parameter replicated inside such a group (a norm gain under tensor
    parallelism) must be counted once, not once per rank: `counts_toward_norm(p)` returns False
    on the ranks whose copy should be skipped. Data-parallel replicas need no reduction at all:
    after the gradient all-reduce their gradients are identical.

    Nothing here makes the host wait for the GPU: the factor (clip_factor) is computed and applied
    on the device, and the norm goes on as a tensor, to optimizer_step and the step's StepResult.
    A train_step calls this through clip_gradients, which passes the step's device (a rank with no
    gradients must name it: see global_grad_norm) and may leave the scaling to the optimizer.
    """
    params = [p for p in params if p.grad is not None]
    counted = [p.grad for p in params if counts_toward_norm is None or counts_toward_norm(p)]
    if device is None:
        if not params:
            raise ValueError("clip_grad_norm_ on a rank without gradients needs the step's device")
        device = params[0].grad.device
    total_norm = global_grad_norm(counted, device, sharded_over, foreach)
    if params:
        # on the gradients' device: an optimizer offloaded to the host holds them in host memory
        torch._foreach_mul_([p.grad for p in params], clip_factor(total_norm, max_norm).to(params[0].grad.device))
    return total_norm


def optimizer_step(optimizer: torch.optim.Optimizer, grad_norm: torch.Tensor,
                   grad_scale: torch.Tensor | None = None) -> torch.Tensor:
    """The optimizer's step, skipped when the gradient norm is not finite (an overflow, a bad
    batch); returns whether it was skipped, a bool tensor on the norm's device, unread.

    A skipped step must change nothing: one NaN in a gradient would turn every weight and every
    AdamW moment into NaN, and zeroing the gradients is not enough (AdamW would still decay the
    weights and move the moments). The norm is global (summed over every group the parameters are
    split across, identical on data-parallel replicas after the gradient all-reduce), so every
    rank decides the same and no collective is added. Every train_step calls this in place of
    `optimizer.step()` (most through clip_and_step), and hands the flag on in its StepResult.

    The interface is PyTorch's own, the one its GradScaler uses: an optimizer that declares
    `_step_supports_amp_scaling` (AdamW with fused=True, every lesson's on CUDA) finds the flag as
    a float tensor in its `found_inf` attribute during `step()` and leaves weights, moments and
    step count as they were where it is 1: the device decides and the host reads nothing. Its
    twin `grad_scale`, when given, is a float tensor the optimizer divides every gradient by
    inside its kernel before using it (and writes the quotient back into .grad): GradScaler's
    unscaling, here the clipping (clip_gradients gives 1 / clip_factor). Any other optimizer (the
    exact per-tensor loop of the CPU proofs) is asked on the host, a read of the norm, and takes
    no grad_scale. An optimizer added later (a host-offloaded AdamW, Muon) implements the same:
    set the attribute and honour `found_inf` and `grad_scale` in its step to keep the host out,
    or be asked on the host.
    """
    skipped = ~torch.isfinite(grad_norm)
    if supports_amp_scaling(optimizer):
        optimizer.found_inf = skipped.float()
        if grad_scale is not None:
            optimizer.grad_scale = grad_scale
        try:
            optimizer.step()
        finally:
            del optimizer.found_inf
            if grad_scale is not None:
                del optimizer.grad_scale
    elif grad_scale is not None:
        raise ValueError(f"{type(optimizer).__name__} does not take a grad_scale: scale the gradients before it")
    elif not skipped.item():
        optimizer.step()
    return skipped


def supports_amp_scaling(optimizer: torch.optim.Optimizer) -> bool:
    """Whether the optimizer honours `found_inf` and `grad_scale` in its step (PyTorch's flag)."""
    return getattr(optimizer, "_step_supports_amp_scaling", False)


def clip_gradients(optimizer: torch.optim.Optimizer, params, settings: "StepSettings") -> tuple[torch.Tensor,
                                                                                                 torch.Tensor | None]:
    """Clipping as the step's settings say; returns (the global norm before clipping, the
    grad_scale that optimizer_step must hand the optimizer, or None where the gradients are
    already scaled), tensors on the step's device, unread. `params` hold the gradients;
    settings.norm_groups and settings.counts_toward_norm say how they are split over ranks
    (clip_grad_norm_).

    settings.fused_tail picks how. Exact (the CPU proofs): per-tensor sums of squares, then the
    gradients scaled in place: they are read three times and written once before the optimizer
    reads them again. Fused (CUDA): one `_foreach_norm`, and where the optimizer takes a
    grad_scale (fused AdamW) no scaling pass at all: the optimizer divides by 1 / clip_factor as
    it reads each gradient (for a finite norm below max_norm, a division by exactly 1).
    """
    params = [p for p in params if p.grad is not None]
    if not (settings.fused_tail and supports_amp_scaling(optimizer)):
        return clip_grad_norm_(params, settings.max_grad_norm, settings.norm_groups, settings.counts_toward_norm,
                               settings.device, foreach=settings.fused_tail), None
    counts = settings.counts_toward_norm
    grad_norm = global_grad_norm([p.grad for p in params if counts is None or counts(p)], settings.device,
                                 settings.norm_groups, foreach=True)
    return grad_norm, clip_factor(grad_norm, settings.max_grad_norm).reciprocal()


def clip_and_step(optimizer: torch.optim.Optimizer, params, settings: "StepSettings") -> tuple[torch.Tensor,
                                                                                                torch.Tensor]:
    """The step's tail once the gradients are summed: clip_gradients, then optimizer_step;
    returns (the norm before clipping, whether the step was skipped), unread."""
    grad_norm, grad_scale = clip_gradients(optimizer, params, settings)
    return grad_norm, optimizer_step(optimizer, grad_norm, grad_scale)


# ----------------------------------------------------------------------------- the step contract


@runtime_checkable
class DataParallelModel(Protocol):
    """What a data-parallel wrapper offers the code that trains through it, and all that code may
    use: lesson 01's micro-batch loop and step, lesson 03's schedule, lesson 06's sharded step,
    lesson 07's composed step. Lesson 01's wrappers, lesson 05's, lesson 06's ZeRO stages and
    lesson 07's pipeline chunks (each under one ZeRO wrapper) each implement it.

    Calling it runs the wrapped model's forward. require_backward_grad_sync False makes the next
    backward only accumulate gradients locally (an earlier micro-batch of the step); True makes it
    also start their reduction over dp_group, which finish_gradient_synchronization waits for.
    zero_grad clears the accumulated gradients for the next step.
    """

    module: Any                         # the wrapped model (a GPT, or a pipeline stage)
    dp_group: Any                       # the ranks whose gradients it sums, and whose losses the step sums
    require_backward_grad_sync: bool

    def __call__(self, *args, **kwargs): ...

    def finish_gradient_synchronization(self) -> None: ...

    def zero_grad(self, set_to_none: bool = False) -> None: ...


@dataclass(frozen=True)
class StepSettings:
    """What a train_step needs besides the model, the optimizer and the batch.

    norm_groups and counts_toward_norm tell gradient clipping how the parameters are split over
    ranks (see clip_grad_norm_); data parallelism alone splits nothing. tail is how the step's
    tail clips and steps (clip_gradients, --step-tail): "exact", "fused", or "auto" (fused on CUDA).
    """

    device: torch.device
    compute_dtype: torch.dtype = torch.float32
    max_grad_norm: float = 1.0
    norm_groups: tuple = ()
    counts_toward_norm: Callable | None = None
    tail: str = "auto"

    @property
    def fused_tail(self) -> bool:
        return self.tail == "fused" or (self.tail == "auto" and self.device.type == "cuda")

    def autocast(self):
        """The forward pass's mixed-precision context (a no-op in float32)."""
        return torch.autocast(self.device.type, dtype=self.compute_dtype,
                              enabled=self.compute_dtype != torch.float32)


class StepResult:
    """A step's figures: the global batch's mean loss over its targets (the same on every rank), the
    whole model's gradient norm before clipping, whether the optimizer skipped the step (a
    non-finite norm: optimizer_step), and more values for the log line ({"aux": ...}).

    A train_step hands them over as it has them, tensors on the device (a number works too): on a
    GPU they are still being computed when the step returns, and the step reads nothing to the
    host. `values` holds them as given. Reading `.loss`, `.grad_norm`, `.skipped` or `.extra`
    makes the host wait for them (the tests read them so); the shared loop instead copies them to
    the host without waiting and reads them one step later (StepFigures, LaggedStepLog).
    """

    def __init__(self, loss, grad_norm, extra: dict | None = None, skipped=False):
        self.values = {"loss": loss, "grad_norm": grad_norm, "skipped": skipped, **(extra or {})}
        self.extra_names = tuple(extra or {})

    @property
    def loss(self) -> float:
        return float(self.values["loss"])

    @property
    def grad_norm(self) -> float:
        return float(self.values["grad_norm"])

    @property
    def skipped(self) -> bool:
        return bool(self.values["skipped"])

    @property
    def extra(self) -> dict[str, float]:
        return {name: float(self.values[name]) for name in self.extra_names}

    def with_extra(self, extra: dict) -> "StepResult":
        return StepResult(self.values["loss"], self.values["grad_norm"], extra, self.values["skipped"])


# ----------------------------------------------------------------------------- the flags every lesson shares


def add_model_flags(parser) -> None:
    """--preset and the model-shape flags over it (config_from_flags builds the model they describe)."""
    parser.add_argument("--preset", default="tiny", help="model shape from picotron_like.model.PRESETS")
    parser.add_argument("--n-layers", type=int, default=None, help="override the preset's number of layers")
    parser.add_argument("--hidden", type=int, default=None, help="override the preset's model width (d_model)")
    parser.add_argument("--n-heads", type=int, default=None,
                        help="override the preset's attention heads (they must divide --hidden)")
    parser.add_argument("--n-kv-heads", type=int, default=None,
                        help="override the preset's key/value heads (they must divide --n-heads; equal: no "
                             "grouped-query attention)")
    parser.add_argument("--ffn-hidden", type=int, default=None,
                        help="override the preset's MLP width (SwiGLU's inner width; each expert's with experts)")
    parser.add_argument("--vocab-size", type=int, default=None,
                        help="override the preset's vocabulary (the data's tokens must be below it)")


def add_training_flags(parser, seq_len: int = 128, micro_batch_size: int = 8, grad_accum: int = 2,
                       steps: int = 30) -> None:
    """Model, data and optimisation flags; each lesson adds the flags of its own technique."""
    add_model_flags(parser)
    parser.add_argument("--data", default=None,
                        help="token shard(s), a path or glob in the llm.c .bin layout; default: the built-in corpus")
    parser.add_argument("--seq-len", type=int, default=seq_len, help="tokens per sequence")
    parser.add_argument("--micro-batch-size", type=int, default=micro_batch_size,
                        help="sequences per micro-batch on each data-parallel rank")
    parser.add_argument("--grad-accum", type=int, default=grad_accum,
                        help="micro-batches per optimizer step (ignored if --global-batch-tokens is given)")
    parser.add_argument("--global-batch-tokens", type=int, default=None,
                        help="tokens per optimizer step over all ranks; sets --grad-accum from it")
    parser.add_argument("--steps", type=int, default=argparse.SUPPRESS,
                        help=f"optimizer steps (default: {steps}; with --max-minutes: no limit but the budget's)")
    parser.add_argument("--max-minutes", type=float, default=None,
                        help="a time budget: stop at the last step that fits in M minutes from the process's "
                             "start, the final validation and checkpoint included; the learning rate decays to it")
    parser.set_defaults(default_steps=steps)
    parser.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
    parser.add_argument("--warmup-steps", type=int, default=5, help="linear warm-up steps")
    parser.add_argument("--lr-schedule", choices=LR_SCHEDULES, default="cosine",
                        help="after the warm-up: cosine, a decay over the whole run to 0.1 x --lr; wsd "
                             "(warmup-stable-decay), the peak held, then 1 - sqrt down to 0.1 x --lr over the run's "
                             "final --decay-share (with --max-minutes: of the steps the budget plans, started sooner "
                             "if the steps slow down)")
    parser.add_argument("--decay-share", type=float, default=None,
                        help=f"with --lr-schedule wsd: the final share of the run over which the learning rate "
                             f"decays, in (0, 1] (default: {DEFAULT_DECAY_SHARE})")
    parser.set_defaults(decay_start=None)       # where a time budget placed wsd's decay (lr_schedule.place_decay)
    parser.add_argument("--max-grad-norm", type=float, default=1.0, help="gradient clipping threshold")
    parser.add_argument("--step-tail", choices=("auto", "exact", "fused"), default="auto",
                        help="how the step clips and updates: exact: per-tensor norms, gradients scaled before "
                             "the optimizer (the CPU proofs); fused: one multi-tensor norm, the clipping done "
                             "inside fused AdamW (grad_scale); auto: fused on CUDA, exact elsewhere")
    parser.add_argument("--attention-priority", choices=ATTENTION_PRIORITIES, default="cudnn",
                        help="the order in which SDPA tries its kernels on CUDA: cudnn: cuDNN, flash, efficient, "
                             "math (torchtitan's); torch: torch's own (flash, efficient, math, cuDNN); a CPU keeps "
                             "torch's")
    parser.add_argument("--seed", type=int, default=0, help="seed of the initial weights and the batch order")
    parser.add_argument("--dtype", choices=("auto", "float32", "bfloat16"), default="auto",
                        help="compute dtype under autocast; auto: bfloat16 on CUDA, float32 on CPU")
    parser.add_argument("--metrics", default=None,
                        help="file to which rank 0 writes one JSON line per step (loss, grad_norm, lr, ...)")
    parser.add_argument("--val-every", type=int, default=0,
                        help="validation loss every N steps and after the last (0: off; lessons that provide it)")
    parser.add_argument("--val-data", default=None,
                        help="validation token shard(s), a path or glob; default: the built-in corpus's val split")
    parser.add_argument("--val-batches", type=int, default=2,
                        help="global batches of validation data, the same ones at every validation")
    parser.add_argument("--profile", default=None, metavar="DIR",
                        help="write a torch.profiler trace of a few steps per rank to DIR (Perfetto, TensorBoard)")
    parser.add_argument("--peak-tflops", type=float, default=None,
                        help="the GPU's peak dense bf16 TFLOP/s for MFU; default: from its name (A100, H100, H200, "
                             "B200, B300); MFU is shown on CUDA only")


_TECHNIQUE = {"dp": "data parallelism", "tp": "tensor parallelism", "pp": "pipeline parallelism",
              "cp": "context parallelism", "ep": "expert parallelism"}
_AXIS_HELP = {
    "dp": "data-parallel degree (lesson 01)",
    "tp": "tensor-parallel degree: ranks sharing each layer (lesson 02)",
    "pp": "pipeline stages (lesson 03)",
    "cp": "context-parallel degree: ranks sharing each sequence (lesson 04)",
}


def add_parallel_flags(parser, axes: tuple[str, ...], fill_axis: str, bucket_flag: bool = True,
                       **defaults: int) -> None:
    """--dp / --tp / --pp / --cp for the axes a lesson composes, --sequence-parallel with tp, and
    --bucket-mb with dp (unless `bucket_flag` is False: lesson 06 reduces per unit, not per bucket).
    The `fill_axis` (the lesson's own) takes the ranks the others leave. The other axes' flags are
    accepted but hidden, so that check_flag_ranges refuses them with a line pointing to lesson 07
    rather than argparse with "unrecognized arguments"; so is --ep, which lesson 05 defines (with
    its experts' other flags) and names in `axes`, as 07 does."""
    for axis in AXES:
        if axis == fill_axis:
            help_text = f"{_AXIS_HELP[axis]}; default: the world size / the other degrees"
            parser.add_argument(f"--{axis}", type=int, default=None, help=help_text)
        else:
            parser.add_argument(f"--{axis}", type=int, default=defaults.get(axis, 1),
                                help=_AXIS_HELP[axis] if axis in axes else argparse.SUPPRESS)
    if "ep" not in axes:
        parser.add_argument("--ep", type=int, default=1, help=argparse.SUPPRESS)
    parser.set_defaults(fill_axis=fill_axis, lesson_axes=axes)
    if "tp" in axes:
        parser.add_argument("--sequence-parallel", action="store_true",
                            help="with --tp > 1: split norms and the residual stream along the sequence (Megatron-SP)")
    if "dp" in axes and bucket_flag:
        parser.add_argument("--bucket-mb", type=float, default=None,
                            help="data-parallel gradient bucket size in MB; default: 25 on CUDA (PyTorch DDP's), "
                                 "1 on a CPU (default_bucket_bytes)")


def default_bucket_bytes(device) -> int:
    """Lessons 01-05's gradient bucket when --bucket-mb is not given, decided here alone.

    CUDA: 25 MB, PyTorch DDP's default. A bucket is one NCCL call a step, and a call costs a
    launch and some latency whatever its size: 1 MB cuts the 125m preset's 650 MB of float32
    gradients into 86 all-reduces (about one per weight matrix), 25 MB into 14, each large enough
    to run near the link's bandwidth. Elsewhere (gloo on a CPU): 1 MB, so that the tiny test
    models still cut into several buckets and the tests keep their bucket counts."""
    return 25 * 2**20 if torch.device(device).type == "cuda" else 2**20


def bucket_bytes_from_flags(args, device) -> int:
    """--bucket-mb in bytes, or the device's default (default_bucket_bytes) when it is not given."""
    return default_bucket_bytes(device) if args.bucket_mb is None else int(args.bucket_mb * 2**20)


# The flags that override a field of --preset's GPTConfig, each named as the field it sets.
MODEL_SHAPE_FLAGS = ("n_layers", "hidden", "n_heads", "n_kv_heads", "ffn_hidden", "vocab_size")


def model_shape_flags(args) -> str:
    """The model-shape flags given, as typed ("--hidden 2048 --n-layers 16"; "" when none)."""
    return " ".join(f"--{field.replace('_', '-')} {getattr(args, field)}" for field in MODEL_SHAPE_FLAGS
                    if getattr(args, field, None) is not None)


def model_name(args) -> str:
    """The model the flags describe, in words: the preset, and the shape flags given over it."""
    return " with ".join(filter(None, (args.preset, model_shape_flags(args))))


def config_from_flags(args) -> GPTConfig:
    """--preset's model with the model-shape flags given over it, or one ConfigError naming the
    flags when together they describe a model GPTConfig cannot build (heads that do not divide the
    width, an odd head size)."""
    given = {field: getattr(args, field) for field in MODEL_SHAPE_FLAGS if getattr(args, field, None) is not None}
    try:
        return get_config(args.preset, **given)
    except ValueError as error:
        if not given:
            raise
        raise ConfigError(f"--preset {model_name(args)}: {error}") from None


# (flag, the rule it must satisfy, the rule in words). Checked before anything else runs, so a
# negative learning rate or a zero step count is one line, not a traceback from deep in torch.
_FLAG_RULES = [
    ("steps", lambda v: v >= 1, "at least 1"),
    ("lr", lambda v: v > 0 and math.isfinite(v), "a positive number"),
    ("warmup_steps", lambda v: v >= 0, "0 or more"),
    ("decay_share", lambda v: 0 < v <= 1, "in (0, 1]: the final share of the run that decays"),
    ("max_grad_norm", lambda v: v > 0 and math.isfinite(v), "a positive number"),
    ("seq_len", lambda v: v >= 1, "at least 1"),
    ("micro_batch_size", lambda v: v >= 1, "at least 1"),
    ("grad_accum", lambda v: v >= 1, "at least 1"),
    ("global_batch_tokens", lambda v: v >= 1, "at least 1"),
    ("seed", lambda v: v >= 0, "0 or more"),
    *((field, lambda v: v >= 1, "at least 1") for field in MODEL_SHAPE_FLAGS),
    ("bucket_mb", lambda v: v > 0 and math.isfinite(v), "a positive number"),
    ("val_every", lambda v: v >= 0, "0 (off) or more"),
    ("val_batches", lambda v: v >= 1, "at least 1"),
    ("peak_tflops", lambda v: v > 0 and math.isfinite(v), "a positive number"),
    ("max_minutes", lambda v: v > 0 and math.isfinite(v), "a positive number"),
    *((axis, lambda v: v >= 1, "at least 1") for axis in AXES),
]


def check_flag_ranges(args) -> None:
    """Raise one ConfigError naming every numeric flag outside its range (None means 'not given')."""
    problems = []
    for name, rule, words in _FLAG_RULES:
        value = getattr(args, name, None)
        if value is not None and not rule(value):
            problems.append(f"--{name.replace('_', '-')} {value} must be {words}")
    for axis in (*AXES, "ep"):
        if axis not in getattr(args, "lesson_axes", (*AXES, "ep")) and getattr(args, axis, 1) != 1:
            problems.append(f"--{axis} {getattr(args, axis)}: this lesson teaches its technique with data "
                            f"parallelism alone; {_TECHNIQUE[axis]} composes with it "
                            f"in lesson 07: run 07_full_5d.py with the same flags")
    if getattr(args, "decay_share", None) is not None and getattr(args, "lr_schedule", "cosine") != "wsd":
        problems.append(f"--decay-share {args.decay_share} with --lr-schedule {args.lr_schedule}: cosine decays over "
                        f"the whole run; add --lr-schedule wsd or drop --decay-share")
    if getattr(args, "sequence_parallel", False) and getattr(args, "tp", 1) == 1:
        problems.append("--sequence-parallel needs --tp > 1: it splits what tensor parallelism leaves "
                        "replicated; add --tp 2 (or more) or drop --sequence-parallel")
    if problems:
        raise ConfigError("bad flags:\n  - " + "\n  - ".join(problems))


# --max-minutes without --steps: the budget decides where the run ends, so nothing else limits it.
NO_STEP_LIMIT = 10**9


def resolve_steps(args) -> None:
    """--steps as given; else the lesson's default, or with --max-minutes no limit but the budget."""
    if getattr(args, "steps", None) is None:
        args.steps = args.default_steps if getattr(args, "max_minutes", None) is None else NO_STEP_LIMIT


def resolve_decay_share(args) -> None:
    """--decay-share as given; under wsd without it, the default share (lr_schedule.DEFAULT_DECAY_SHARE)."""
    if getattr(args, "lr_schedule", "cosine") == "wsd" and args.decay_share is None:
        args.decay_share = DEFAULT_DECAY_SHARE


def grid_from_args(args, world_size: int) -> GridShape:
    """The grid the degree flags describe; the lesson's own axis gets whatever ranks are left."""
    degrees = {axis: getattr(args, axis, 1) for axis in AXES}
    fill = args.fill_axis
    if degrees[fill] is None:
        others = math.prod(d for axis, d in degrees.items() if axis != fill)
        degrees[fill] = max(1, world_size // others)
    return GridShape(**degrees)


def batch_shape(args, dp: int) -> BatchShape:
    """How a step's batch is cut, from --global-batch-tokens when given, else --grad-accum."""
    if args.global_batch_tokens is not None:
        return BatchShape.from_global_batch_tokens(args.global_batch_tokens, args.micro_batch_size,
                                                   args.seq_len, dp)
    return BatchShape(args.micro_batch_size, args.seq_len, args.grad_accum, dp)


def autocast_dtype(flag: str, device: torch.device) -> torch.dtype:
    if flag == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, flag)


@dataclass(frozen=True)
class RunPlan:
    """What the flags describe, validated: the model shape, the grid, how batches are cut, the data
    (and the validation data when --val-every asks for it)."""

    cfg: GPTConfig
    grid: GridShape
    shape: BatchShape
    batches: TokenBatches
    val_batches: TokenBatches | None = None


def plan_run(args, validate: Callable[[GPTConfig, GridShape, BatchShape, object, int], None],
             configure: Callable[[GPTConfig, object], GPTConfig] | None = None) -> RunPlan:
    """Everything the flags describe, checked before any process group exists (checked_plan).
    Every rank reads the same flags and finds the same error, so each prints nothing but rank 0's
    one `error:` line and leaves: no rank waits in a collective."""
    try:
        return checked_plan(args, validate, configure, world_size_from_env())
    except (ConfigError, ValueError) as error:
        exit_with_error(error)


def checked_plan(args, validate: Callable[[GPTConfig, GridShape, BatchShape, object, int], None],
                 configure: Callable[[GPTConfig, object], GPTConfig] | None, world_size: int) -> RunPlan:
    """The run the flags describe in a world of `world_size` ranks, or the ConfigError (or
    ValueError) that plan_run prints.

    `configure(cfg, args)`, if given, is the lesson's flags applied to the preset (lesson 05's
    router and balancing flags); `validate(cfg, grid, shape, args, world_size)` is the lesson's own
    rules. Both see what will actually run (the model as configured, the batch shape with grad_accum
    derived from --global-batch-tokens), so what is validated is what trains.
    """
    check_flag_ranges(args)
    resolve_steps(args)
    resolve_decay_share(args)
    collective_timeout_s()      # a bad PICOTRON_LIKE_TIMEOUT_S is one line too, not a failed init
    grid = grid_from_args(args, world_size)
    cfg = config_from_flags(args)
    if configure is not None:
        cfg = configure(cfg, args)
    shape = batch_shape(args, grid.dp)
    validate(cfg, grid, shape, args, world_size)
    paths = args.data if args.data is not None else builtin_corpus_paths()[0]
    batches = TokenBatches(paths, shape, seed=args.seed, vocab_size=cfg.vocab_size)
    val_batches = None
    if getattr(args, "val_every", 0):
        val_paths = args.val_data if args.val_data is not None else builtin_corpus_paths()[1]
        val_batches = TokenBatches(val_paths, shape, seed=args.seed, vocab_size=cfg.vocab_size)
    return RunPlan(cfg, grid, shape, batches, val_batches)


def exit_with_error(error: Exception) -> None:
    """Print a configuration error once (rank 0) and stop every rank with exit code 2.

    Every rank found the same error from the same flags before any collective, so no rank waits
    for another: each can simply leave. But torchrun stops all ranks as soon as the first one
    exits, and it must not stop rank 0 before the message is out: on a loaded machine rank 0 may
    still be importing torch when rank 1 has found the error. So the other ranks wait for rank 0
    (torchrun ends them the moment rank 0 leaves) and, should it never leave, give up after a minute.
    """
    if os.environ.get("RANK", "0") == "0":
        print(f"error: {error}", file=sys.stderr, flush=True)
    else:
        time.sleep(60.0)
    sys.stdout.flush()
    os._exit(2)


# ----------------------------------------------------------------------------- the loop
@contextmanager
def traffic_not_counted():
    """Leave the collectives run inside out of the communication meter: every lesson's report
    compares the traffic of its training steps with their formula, and validation is not training."""
    traffic, devices = copy.deepcopy(comm.meter.traffic), copy.deepcopy(comm.meter.devices)
    try:
        yield
    finally:
        comm.meter.traffic.clear()
        comm.meter.traffic.update(traffic)
        comm.meter.devices.clear()
        comm.meter.devices.update(devices)


def on_device(batch: StepBatch, device: torch.device) -> StepBatch:
    """The step's micro-batches on the GPU, copied from page-locked host memory without waiting.
    Copying from ordinary (pageable) memory makes the host wait until the GPU has finished all the
    work queued before the copy: once per micro-batch, the host could not queue the next forward
    while the last backward runs. A copy from pinned memory is queued like a kernel. On a CPU the
    batch stays as it is (the lessons' own .to(device) is then a no-op on a GPU too)."""
    if device.type != "cuda":
        return batch
    return replace(batch, micro_batches=[tuple(t.pin_memory().to(device, non_blocking=True) for t in micro_batch)
                                         for micro_batch in batch.micro_batches])


@dataclass(frozen=True)
class RankBatches:
    """This rank's batches: for each step, its data-parallel share of the global batch (`dp_rank`
    of TokenBatches' split), cut along the sequence where a lesson splits it (`cut`: lesson 04's
    context parallelism, None elsewhere), on the rank's device; the validation batches (`val`)
    the same way. A lesson's main() builds it: what this rank trains on, in one line."""

    train: TokenBatches
    dp_rank: int
    device: torch.device
    cut: Callable[[StepBatch], StepBatch] | None = None
    val: TokenBatches | None = None

    def step_batch(self, step: int) -> StepBatch:
        return self._rank_share(self.train, step)

    def val_batch(self, index: int) -> StepBatch:
        return self._rank_share(self.val, index)

    def _rank_share(self, batches: TokenBatches, index: int) -> StepBatch:
        batch = batches.step_batch(index, self.dp_rank)
        return on_device(batch if self.cut is None else self.cut(batch), self.device)


def validation_loss(evaluate: Callable[[StepBatch], float], val_batch: Callable[[int], StepBatch],
                    n_batches: int) -> float:
    """The token-weighted mean loss over the first n_batches global batches of the validation data
    (`val_batch(index)`: this rank's share of one, as RankBatches.val_batch gives it).

    `evaluate(batch)` returns one global batch's mean loss over its targets, the same on every
    rank (as a train_step's loss); weighting each by its target count makes the result the mean
    over every validation token, as one device would compute it on all of them at once.
    """
    total, targets = 0.0, 0
    for index in range(n_batches):
        batch = val_batch(index)
        total += evaluate(batch) * batch.n_targets
        targets += batch.n_targets
    return total / targets


def train(args, optimizer, step_fn: Callable[[StepBatch], StepResult], batches: RankBatches,
          evaluate: Callable[[StepBatch], float] | None = None, meters: StepMeters = StepMeters(),
          cfg: GPTConfig | None = None, start_step: int = 0, after_step: AfterStep | Callable | None = None,
          clock: Callable[[], float] = seconds_since_process_start) -> Throughput:
    """The loop every lesson shares: learning rate, this rank's batch, the lesson's step, log,
    validate, save. Returns the throughput (with `.skipped_steps`: StepResult.skipped).

    step_fn(batch) is a lesson's train_step with its model, optimizer and settings bound. `meters`
    watch one step (StepMeters). With --val-every N > 0, a lesson's `evaluate(batch) -> float`
    (the global batch's mean loss, no gradients) gives the loss over --val-batches batches of
    `batches.val` every N steps and after the last, its collectives left out of the communication
    meter. `cfg` gives the log its MFU (LaggedStepLog). A resumed run starts at `start_step` (the
    learning rate and the data follow from the step alone). `after_step` runs where an AfterStep
    says it is due (a plain function: every step), once the step's line is out (checkpoints:
    `last` is true for the run's final step, also when the ranks agreed to stop early). `clock`
    reads the seconds since the process started, for --max-minutes (RunControl). On CUDA the loop
    runs inside SDPA's backend priority (model.attention_backends, --attention-priority).
    """
    validating = evaluate is not None and batches.val is not None and getattr(args, "val_every", 0) > 0
    if after_step is not None and not isinstance(after_step, AfterStep):
        after_step = AfterStep(lambda step, last: True, after_step)    # a plain function: after every step
    log = LaggedStepLog(args, batches.train, batches.device, cfg, start_step)
    control = RunControl(args, clock, args.val_batches if validating else 0, batches.train)
    profiler = step_profiler(getattr(args, "profile", None), args.steps - start_step, batches.device)
    priority = attention_backends(batches.device.type, getattr(args, "attention_priority", "cudnn"))
    with control, log, profiler or nullcontext(), priority:
        for step in range(start_step, args.steps):      # a time budget may lower args.steps: `last` ends it
            lr = run_learning_rate(args, step, batches.train.tokens_before)    # --lr-schedule, by tokens trained
            set_learning_rate(optimizer, lr)
            batch = batches.step_batch(step)            # dp: this rank's share of the global batch; cp: its cut
            log.start(step, lr)                         # the step's clock and memory
            with meters.watching(step):
                result = step_fn(batch)                 # the lesson's step: forward, backward, reduce, update
            log.queued(result.values, meters.watch(step))   # prints the step before: the host never waits
            stopping = control.after_step(step, log)    # a signal or the time budget, agreed by every rank
            last = stopping or step == args.steps - 1
            # The final validation is skipped only on a scheduler's signal: its grace period is short.
            if validating and ((step + 1) % args.val_every == 0 or (last and not control.signalled)):
                with traffic_not_counted(), control.timing("validation"):
                    log.validated(validation_loss(evaluate, batches.val_batch, args.val_batches))
            saving = after_step is not None and after_step.due(step, last)
            if saving or last:
                log.flush()     # this step's line now: it comes before its checkpoint, and at the end
            if profiler is not None:
                profiler.step()
            if saving:
                try:
                    with control.timing("checkpoint"):
                        after_step.run(step, last)
                except ConfigError as error:    # a checkpoint every rank agreed has failed (a full disk)
                    exit_with_error(f"after step {step}: {error}; the checkpoints before it are intact")
            if stopping:
                control.stopped(step, saves=after_step is not None)
            if last:
                break
    control.summary(log)
    return log.throughput
