"""
The training skeleton every lesson shares: nothing here is a parallelism technique.

A lesson's ``main()`` reads as its table of contents because everything else lives here:

    args = parse_args(argv)                        # add_training_flags + add_parallel_flags + its own
    plan = plan_run(args, validate)                # every flag checked before any process group
    device = init_distributed(); grid = ProcessGrid(plan.grid)
    model, optimizer = <the lesson's technique>
    throughput = train(args, optimizer, step_fn, plan.batches, grid.dp_rank, device)
    report(...); shutdown()

- flags: ``add_training_flags`` (model, data, optimisation) and ``add_parallel_flags`` (the
  degrees of the grid), checked by ``check_flag_ranges``; ``plan_run`` turns them into the model
  shape, the grid and the batches, and stops every rank with one ``error:`` line if they cannot run;
- optimisation: ``build_optimizer`` (AdamW), ``learning_rate`` (warm-up, cosine),
  ``clip_grad_norm_``, whose norm is that of the *whole* model even when each rank holds a part,
  and ``optimizer_step``, which skips a step whose norm is not finite;
- the step contract: every lesson's ``train_step(model, optimizer, batch, settings) -> StepResult``,
  with ``batch`` a ``data.StepBatch`` and ``settings`` a ``StepSettings``; the loss is summed over
  tokens and divided by the global batch's target count (``StepBatch.n_targets``);
- ``train``: the loop (learning rate, step, one log line per step, printed a step late so that the
  host never waits for the device: ``LaggedStepLog``; throughput), which also counts the
  skipped steps, writes ``--metrics``,
  runs ``--val-every`` validation through a lesson's ``evaluate(batch) -> float``, logs each
  step's memory and MFU, and traces a few steps with ``--profile``.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import signal
import sys
import time
from collections.abc import Callable
from contextlib import ExitStack, contextmanager, nullcontext
from dataclasses import dataclass, replace
from typing import Any, Protocol, runtime_checkable

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity

from picotron_like import comm
from picotron_like.data import BatchShape, StepBatch, TokenBatches, builtin_corpus_paths
from picotron_like.metrics import StepMemory, Throughput, is_rank0, log0, model_flops_utilisation, peak_flops
from picotron_like.model import GPTConfig, flops_per_token, get_config
from picotron_like.topology import AXES, ConfigError, GridShape, collective_timeout_s, world_size_from_env

# ----------------------------------------------------------------------------- optimisation


def build_optimizer(model, lr: float, weight_decay: float = 0.1,
                    betas=(0.9, 0.95)) -> torch.optim.AdamW:
    """AdamW; weight decay applies to matrices (linear and embedding weights), not to norm gains.

    The split is decided by each parameter's name, not its shape, so that a shard of a matrix is
    decayed exactly like the full matrix on one device. `model` is a module, or (name, tensor)
    pairs (lesson 06 hands over the pieces of its shards, each named after its parameter).
    """
    decay, no_decay = [], []
    for name, param in model.named_parameters() if isinstance(model, torch.nn.Module) else model:
        (no_decay if name.endswith("norm.weight") else decay).append(param)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    device = next(iter(decay + no_decay), torch.empty(0)).device
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


def learning_rate(step: int, max_lr: float, warmup_steps: int, total_steps: int,
                  min_lr_ratio: float = 0.1) -> float:
    """Linear warm-up to max_lr, then cosine decay to min_lr_ratio * max_lr at total_steps."""
    if step < warmup_steps:
        return max_lr * (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    min_lr = min_lr_ratio * max_lr
    return min_lr + 0.5 * (max_lr - min_lr) * (1.0 + math.cos(math.pi * progress))


def set_learning_rate(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


def clip_grad_norm_(params, max_norm: float, sharded_over=(), counts_toward_norm=None) -> torch.Tensor:
    """Scale gradients so that the global gradient norm is at most max_norm; return that norm (a
    0-dim float32 tensor on the gradients' device).

    The global norm squared is the sum of squares over every *distinct* parameter element of the
    model. A rank holding a shard contributes its shard's sum of squares, and the contributions
    are summed over the groups the parameters are split across (`sharded_over`: e.g. the tp and
    pp groups). A parameter replicated inside such a group (a norm gain under tensor
    parallelism) must be counted once, not once per rank: `counts_toward_norm(p)` returns False
    on the ranks whose copy should be skipped. Data-parallel replicas need no reduction at all:
    after the gradient all-reduce their gradients are identical.

    Nothing here makes the host wait for the GPU: the factor min(1, max_norm / (norm + 1e-6)) is
    computed and applied on the device (times 1 changes no bit when the norm is below max_norm),
    and the norm goes on as a tensor, to optimizer_step and the step's StepResult. (A non-finite
    norm makes the factor 0 or NaN: optimizer_step skips that step.)
    """
    params = [p for p in params if p.grad is not None]
    counted = [p for p in params if counts_toward_norm is None or counts_toward_norm(p)]
    device = params[0].grad.device if params else torch.device("cpu")
    norm_sq = torch.zeros((), dtype=torch.float32, device=device)
    for p in counted:
        norm_sq += p.grad.detach().float().pow(2).sum()
    for group in sharded_over:
        comm.call(dist.all_reduce, norm_sq, group=group)
    total_norm = norm_sq.sqrt()
    factor = (max_norm / (total_norm + 1e-6)).clamp(max=1.0)
    if params:
        torch._foreach_mul_([p.grad for p in params], factor)
    return total_norm


def optimizer_step(optimizer: torch.optim.Optimizer, grad_norm: torch.Tensor) -> torch.Tensor:
    """The optimizer's step, skipped when the gradient norm is not finite (an overflow, a bad
    batch); returns whether it was skipped, a bool tensor on the norm's device, unread.

    A skipped step must change nothing: one NaN in a gradient would turn every weight and every
    AdamW moment into NaN, and zeroing the gradients is not enough (AdamW would still decay the
    weights and move the moments). The norm is global (summed over every group the parameters are
    split across, identical on data-parallel replicas after the gradient all-reduce), so every
    rank decides the same and no collective is added. Every train_step calls this in place of
    `optimizer.step()`, and hands the flag on in its StepResult.

    The interface is PyTorch's own, the one its GradScaler uses: an optimizer that declares
    `_step_supports_amp_scaling` (AdamW with fused=True, lesson 07's on CUDA) finds the flag as a
    float tensor in its `found_inf` attribute during `step()` and leaves weights, moments and
    step count as they were where it is 1: the device decides and the host reads nothing. Any
    other optimizer (the exact per-tensor loop of the CPU proofs) is asked on the host, a read of
    the norm. An optimizer added later (a host-offloaded AdamW, Muon) implements the same: set the
    attribute and honour `found_inf` in its step to keep the host out, or be asked on the host.
    (`grad_scale`, the attribute's twin, stays unset: clipping has already scaled the gradients,
    in place, in one multi-tensor kernel.)
    """
    skipped = ~torch.isfinite(grad_norm)
    if getattr(optimizer, "_step_supports_amp_scaling", False):
        optimizer.found_inf = skipped.float()
        try:
            optimizer.step()
        finally:
            del optimizer.found_inf
    elif not skipped.item():
        optimizer.step()
    return skipped


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
    ranks (see clip_grad_norm_); data parallelism alone splits nothing.
    """

    device: torch.device
    compute_dtype: torch.dtype = torch.float32
    max_grad_norm: float = 1.0
    norm_groups: tuple = ()
    counts_toward_norm: Callable | None = None

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


def add_training_flags(parser, seq_len: int = 128, micro_batch_size: int = 8, grad_accum: int = 2,
                       steps: int = 30) -> None:
    """Model, data and optimisation flags; each lesson adds the flags of its own technique."""
    parser.add_argument("--preset", default="tiny", help="model shape from picotron_like.model.PRESETS")
    parser.add_argument("--n-layers", type=int, default=None, help="override the preset's number of layers")
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
    parser.add_argument("--max-grad-norm", type=float, default=1.0, help="gradient clipping threshold")
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
        parser.add_argument("--bucket-mb", type=float, default=1.0,
                            help="data-parallel gradient bucket size in MB (PyTorch DDP uses 25)")


# (flag, the rule it must satisfy, the rule in words). Checked before anything else runs, so a
# negative learning rate or a zero step count is one line, not a traceback from deep in torch.
_FLAG_RULES = [
    ("steps", lambda v: v >= 1, "at least 1"),
    ("lr", lambda v: v > 0 and math.isfinite(v), "a positive number"),
    ("warmup_steps", lambda v: v >= 0, "0 or more"),
    ("max_grad_norm", lambda v: v > 0 and math.isfinite(v), "a positive number"),
    ("seq_len", lambda v: v >= 1, "at least 1"),
    ("micro_batch_size", lambda v: v >= 1, "at least 1"),
    ("grad_accum", lambda v: v >= 1, "at least 1"),
    ("global_batch_tokens", lambda v: v >= 1, "at least 1"),
    ("seed", lambda v: v >= 0, "0 or more"),
    ("n_layers", lambda v: v >= 1, "at least 1"),
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
    collective_timeout_s()      # a bad PICOTRON_LIKE_TIMEOUT_S is one line too, not a failed init
    grid = grid_from_args(args, world_size)
    cfg = get_config(args.preset, n_layers=args.n_layers)
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


# How each StepMemory reading is named in the step line: what it measures, not just "memory".
_MEMORY_LABELS = {"max_memory_allocated_bytes": "peak mem", "max_rss_bytes": "max rss"}


def log_step(step: int, result: StepResult, tokens: int, seconds: float, lr: float | None = None,
             skipped: bool = False, mfu: float | None = None, memory: dict | None = None) -> None:
    extra = "".join(f"{name} {value:.4g} | " for name, value in result.extra.items())
    lr_part = f"lr {lr:.2e} | " if lr is not None else ""
    skip_part = "skipped: non-finite grad norm | " if skipped else ""
    mfu_part = f" | MFU {100 * mfu:4.1f} %" if mfu is not None else ""
    memory_part = "".join(f" | {_MEMORY_LABELS[key]} {value / 1e9:.2f} GB" for key, value in (memory or {}).items())
    log0(f"step {step:>4} | loss {result.loss:.4f} | grad norm {result.grad_norm:7.3f} | {skip_part}{lr_part}"
         f"{extra}{tokens / seconds:>9.0f} tok/s | {seconds * 1e3:>7.1f} ms{mfu_part}{memory_part}")


_IMPORTED_AT = time.time()


def seconds_since_process_start() -> float:
    """Wall-clock seconds since this process started, from the kernel's record of it (Linux), else
    since this module was imported. In a time-boxed run the minutes before the first step count."""
    try:
        with open("/proc/self/stat") as stat, open("/proc/stat") as system:
            started_ticks = int(stat.read().rsplit(")", 1)[1].split()[19])
            boot = next(int(line.split()[1]) for line in system if line.startswith("btime "))
        return time.time() - (boot + started_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError, StopIteration):
        return time.time() - _IMPORTED_AT


def step_profiler(directory, steps: int, device: torch.device) -> torch.profiler.profile | None:
    """--profile DIR: a torch.profiler trace of a few steps, one file per rank in DIR
    (rank<N>.<time>.pt.trace.json), which Perfetto and TensorBoard's profiler plugin open.

    It skips the first step (one-off costs: allocations, the first collective of each group),
    warms up on the next and records up to three; a shorter run records what it has. CPU activity
    always, the CUDA kernels too on a GPU. (PyTorch's profiler library itself prints a
    "profiler_start" and a "profiler_stop" line per rank on stderr: they are not errors.)
    """
    if directory is None:
        return None
    wait = 1 if steps >= 3 else 0
    warmup = 1 if steps - wait >= 2 else 0
    active = min(3, steps - wait - warmup)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    rank = dist.get_rank() if dist.is_initialized() else 0
    return torch.profiler.profile(
        activities=activities, schedule=torch.profiler.schedule(wait=wait, warmup=warmup, active=active, repeat=1),
        on_trace_ready=torch.profiler.tensorboard_trace_handler(str(directory), worker_name=f"rank{rank}"))


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


def validation_loss(evaluate: Callable, val_batches: TokenBatches, n_batches: int, dp_rank: int,
                    prepare_batch: Callable | None = None, device: torch.device = torch.device("cpu")) -> float:
    """The token-weighted mean loss over the first n_batches global batches of the validation data.

    `evaluate(batch)` returns one global batch's mean loss over its targets, the same on every
    rank (as a train_step's loss); weighting each by its target count makes the result the mean
    over every validation token, as one device would compute it on all of them at once.
    """
    total, targets = 0.0, 0
    for index in range(n_batches):
        batch = val_batches.step_batch(index, dp_rank)
        device_batch = on_device(batch if prepare_batch is None else prepare_batch(batch), device)
        total += evaluate(device_batch) * batch.n_targets
        targets += batch.n_targets
    return total / targets


def _json_number(value):
    """JSON has no NaN or infinity: a non-finite float is written as null."""
    return value if not isinstance(value, float) or math.isfinite(value) else None


class MetricsFile:
    """One JSON object per line and step, written by rank 0 only (every rank holds the same values).
    A resumed run appends; a run killed while writing a line left half of one, so the resumed run
    starts on a new line; its records of the steps after its checkpoint follow the old ones, and
    readers keep a step's last record (picotron_like.plot)."""

    def __init__(self, path, append: bool = False):
        self.file = open(path, "a" if append else "w", encoding="utf-8") if path is not None and is_rank0() else None
        if self.file is not None and self.file.tell() > 0:
            with open(path, "rb") as written:
                written.seek(-1, os.SEEK_END)
                if written.read(1) != b"\n":
                    self.file.write("\n")

    def write(self, record: dict) -> None:
        if self.file is not None:
            self.file.write(json.dumps({key: _json_number(value) for key, value in record.items()}) + "\n")
            self.file.flush()

    def close(self) -> None:
        if self.file is not None:
            self.file.close()


class PeerLost(RuntimeError):
    """A rank died: the run stops at once, without a checkpoint (nothing could agree on one)."""


class AgreedStop:
    """Stop every rank after the same step when any of them is told to stop, without making a
    step wait for the others to agree.

    Schedulers warn a job before they end it: SLURM sends SIGTERM (and with --signal=USR1@120,
    SIGUSR1 two minutes before), Kubernetes SIGTERM, torchrun passes its own SIGTERM on to its
    ranks. The signal reaches the ranks at different moments, maybe in different steps, so a rank
    cannot stop when it sees it: the others would wait for it in their next collective. Instead a
    handler only notes it, and the ranks agree: after each step, each starts an all-reduce (MAX) of
    its note, a CPU tensor over gloo, asynchronously, and reads the result one step later, when it
    has long arrived. All ranks read the same result at the same step, so they all stop after the
    step in which it arrives: one step after the signal, the price of never holding a step up for
    the agreement (a scheduler's grace period must cover one step and a checkpoint).

    A dead peer is not waited for either: torchrun sends SIGTERM to the ranks left when one dies,
    and their agreeing all-reduce then fails at once (gloo sees the peer's connection closed), which
    raises PeerLost instead of a checkpoint that could never complete.

    A rank's TimeBudget asks for a stop the same way (request_stop), with a code below every
    signal's number: the MAX of the notes names a signal when there was one, and a signal's stop
    skips the final validation that a budget's stop runs (a grace period is short).
    """

    SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
    TIME_BUDGET = 0.5                           # a note below every signal number (they start at 1)

    def __init__(self):
        self.note = 0.0                         # a signal's number, TIME_BUDGET, or 0: nothing noted
        self.agreed_signal = ""                 # once agreed: the signal's name, or "the time budget"
        self._agreeing = None                   # (flag tensor, work) started after the previous step

    def __enter__(self):
        self._previous = {number: signal.signal(number, self._note) for number in self.SIGNALS}
        return self

    def __exit__(self, *exc):
        if self._agreeing is not None and exc[0] is None:
            self._wait()                        # leave no collective in flight behind the loop
        for number, handler in self._previous.items():
            signal.signal(number, handler)
        return False

    def _note(self, number, frame) -> None:
        self.note = max(self.note, number)

    def request_stop(self) -> None:
        """This rank's time budget is spent: stop every rank after the same step (a signal outranks it)."""
        self.note = max(self.note, self.TIME_BUDGET)

    def _wait(self) -> bool:
        flag, work = self._agreeing
        self._agreeing = None
        if work is not None:
            try:
                work.wait()
            except RuntimeError as error:
                raise PeerLost(f"a peer is gone ({str(error).splitlines()[0]}): stopping without a checkpoint; "
                               f"resume from the last one") from None
        agreed = flag.item()
        if agreed:
            self.agreed_signal = "the time budget" if agreed == self.TIME_BUDGET else signal.Signals(int(agreed)).name
        return bool(agreed)

    def after_step(self) -> bool:
        """Whether every rank stops after this step: some rank was signalled before the previous
        step ended. Starts the agreement that the next step's call reads."""
        stop = self._wait() if self._agreeing is not None else False
        flag = torch.tensor([self.note], dtype=torch.float32)
        # Not through comm.call: the communication meter reports the technique, not bookkeeping.
        work = dist.all_reduce(flag, op=dist.ReduceOp.MAX, async_op=True) if dist.is_initialized() else None
        self._agreeing = (flag, work)
        return stop


class TimeBudget:
    """--max-minutes M: the run ends inside M minutes from its process's start, with its final
    validation and checkpoint written, and the learning rate decays to the step where it ends.

    The schedule needs that step before the decay starts, so it is estimated once, early: after
    this process's first ESTIMATE_AFTER steps, rank 0 takes the slowest of them but the first
    (which carries one-off costs: allocations, compiling, the first collective of each group), and
    fits as many such steps as the time left allows after what the end costs: the final
    validation (as long as --val-batches steps until one has been timed: a validation batch is one
    global batch's forward, a fraction of a step), a checkpoint (as long as the slowest written so
    far) and two steps of margin (a stop agreed now takes effect one step later: AgreedStop).
    Rank 0's number is broadcast, so every rank sets the same args.steps, and a checkpoint stores
    it: a resumed run follows the same schedule (follow_time_budget) instead of estimating anew.

    An estimate can be wrong: steps slow down, the first checkpoint takes longer than nothing. So
    after it every rank checks each step whether two more steps and the end still fit, and if not
    asks AgreedStop to stop every rank after the same step: the budget holds, and the run ends
    before the schedule's last step (its final learning rate not yet at the minimum; it says so).
    `clock()` gives the seconds since the process started; tests pass their own.
    """

    ESTIMATE_AFTER = 3

    def __init__(self, minutes: float, clock: Callable[[], float], val_batches: int = 0, planned: bool = False):
        self.budget_s, self.clock = 60.0 * minutes, clock
        self.validation_s = None        # the slowest final validation's measured seconds (None: not yet run)
        self.val_batches = val_batches  # 0: the run does not validate
        self.save_s = 0.0               # the slowest checkpoint's measured seconds
        self.step_s: list[float] = []   # this process's step times, by the clock
        self.planned = planned          # the estimate is made (or a resumed run follows its checkpoint's)
        self.last_mark = clock()

    def note_step(self) -> None:
        now = self.clock()
        self.step_s.append(now - self.last_mark)
        self.last_mark = now

    @contextmanager
    def timing(self, work: str):
        """Time a validation or a checkpoint, for the cost of the end; the next step's time starts after it."""
        started = self.clock()
        yield
        self.last_mark = self.clock()
        if work == "validation":
            self.validation_s = max(self.validation_s or 0.0, self.last_mark - started)
        else:
            self.save_s = max(self.save_s, self.last_mark - started)

    def slowest_step_s(self) -> float:
        return max(self.step_s[1:] or self.step_s)

    def end_s(self) -> float:
        """What must still fit after the last step: the final validation and checkpoint, two steps."""
        validation = self.validation_s if self.validation_s is not None else self.val_batches * self.slowest_step_s()
        return validation + self.save_s + 2 * self.slowest_step_s()

    def estimate_due(self) -> bool:
        return not self.planned and len(self.step_s) == self.ESTIMATE_AFTER

    def planned_steps(self, steps_done: int, max_steps: int) -> int:
        """The run's number of steps, rank 0's estimate, the same on every rank; at least the steps
        already done, at most `max_steps` (--steps)."""
        left_s = self.budget_s - self.clock() - self.end_s()
        estimate = torch.tensor([min(max_steps, steps_done + max(0, math.floor(left_s / self.slowest_step_s())))])
        if dist.is_initialized():
            dist.broadcast(estimate, src=0)     # not metered: bookkeeping, not the technique
        self.planned = True
        return int(estimate.item())

    def spent(self) -> bool:
        """Whether the next two steps and the end no longer fit (this rank's view)."""
        return self.planned and self.clock() + self.end_s() > self.budget_s


def step_to_meter(args) -> int:
    """A late step, for a lesson that meters one well after the warm-up: the last, or under a time
    budget, whose last step is not known before it runs, the first after its estimate."""
    return args.steps - 1 if getattr(args, "max_minutes", None) is None else TimeBudget.ESTIMATE_AFTER


def follow_time_budget(args, written_settings: dict) -> None:
    """A run resumed with --max-minutes ends where its first run's estimate said, with the same
    learning-rate schedule (TimeBudget), when the checkpoint was written after that estimate."""
    planned = written_settings.get("planned_steps")
    if getattr(args, "max_minutes", None) is not None and planned is not None:
        args.steps, args.planned_steps = planned, planned


class StepFigures:
    """One step's figures on their way to the host, and the step's duration, without making the
    host wait for the device: on a GPU, two timing events around the step's work and a copy of its
    values into page-locked memory are queued behind it, and read() waits for them only when
    called, a step later, while the device computes the next step. On a CPU the work is done when
    the step returns: the values are at hand and the host clock times the step."""

    def __init__(self, device: torch.device):
        """Start the step's clock (before its first operation is queued)."""
        self.device, self.on_gpu = device, device.type == "cuda"
        if self.on_gpu:
            self.started, self.finished = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            self.started.record()
        else:
            self.started = time.perf_counter()

    def copy(self, values: dict) -> None:
        """Stop the clock and start copying `values` (tensors, numbers) to the host."""
        if self.on_gpu:
            self.finished.record()
        else:
            self.seconds = time.perf_counter() - self.started
        self.names = list(values)
        self.numbers = {name: float(value) for name, value in values.items() if not isinstance(value, torch.Tensor)}
        tensors = [value for value in values.values() if isinstance(value, torch.Tensor)]
        # float64 holds every float32 and bfloat16 value and every Python float exactly
        stacked = (torch.stack([t.detach().reshape(()).to(self.device, torch.float64) for t in tensors]) if tensors
                   else torch.zeros(0, dtype=torch.float64))
        if self.on_gpu:
            self.host = torch.empty(len(tensors), dtype=torch.float64, pin_memory=True)
            self.host.copy_(stacked, non_blocking=True)
            self.copied = torch.cuda.Event()
            self.copied.record()
        else:
            self.host = stacked

    def read(self) -> tuple[dict[str, float], float]:
        """The values, in the order given, and the step's seconds: a wait, on a GPU, for the step's end."""
        if self.on_gpu:
            self.copied.synchronize()
            self.seconds = self.started.elapsed_time(self.finished) / 1e3
        copied = iter(self.host.tolist())
        return {name: self.numbers[name] if name in self.numbers else next(copied) for name in self.names}, self.seconds


@dataclass
class LoggedStep:
    """What the loop knows of a step when its work is queued; its figures reach the host later."""

    step: int
    lr: float
    figures: StepFigures
    memory: dict                        # StepMemory's reading (the allocator's counters are the host's own)
    metered: bool                       # the meters watched it (Throughput keeps it apart)
    started_s: float | None = None      # the run's first step: seconds since the process started, at its start
    val_loss: float | None = None       # the validation after it, if one ran


class LaggedStepLog:
    """Step N's line is printed once step N+1 is queued: the host reads step N's figures while the
    device computes step N+1, so it never waits for one step to end before queueing the next.
    (Printing each line at its step's end would make the host wait for the device every step: the
    device then idles while the host queues the next step's kernels.) Lines the loop prints in
    between (say) wait behind the pending line, and flush() prints it at once where what follows
    needs it (a checkpoint, the end): the output reads as if each line came at its step's end, the
    same lines in the same order. The metrics file's record is written with the line; Throughput
    and the count of skipped steps are kept there too, since they need the step's seconds and flag.
    Leaving the block (an error included) prints what is pending."""

    def __init__(self, throughput: Throughput, metrics: "MetricsFile", tokens: int,
                 mfu_of: Callable[[float], float | None]):
        self.throughput, self.metrics, self.tokens, self.mfu_of = throughput, metrics, tokens, mfu_of
        self.pending: LoggedStep | None = None
        self.notes: list[str] = []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.flush()
        return False

    def add(self, logged: LoggedStep) -> None:
        """A step's work is queued: print the step before it."""
        self.flush()
        self.pending = logged

    def say(self, message: str) -> None:
        """Print a line after the pending step's line."""
        if self.pending is None:
            log0(message)
        else:
            self.notes.append(message)

    def flush(self) -> None:
        """Print the pending step's line (waiting for its figures) and what was said after it."""
        if self.pending is not None:
            self._print(self.pending)
            self.pending = None
        for note in self.notes:
            log0(note)
        self.notes.clear()

    def _print(self, logged: LoggedStep) -> None:
        values, seconds = logged.figures.read()
        skipped = bool(values.pop("skipped"))
        loss, grad_norm = values.pop("loss"), values.pop("grad_norm")
        self.throughput.record(self.tokens, seconds, logged.metered)
        self.throughput.skipped_steps += skipped
        mfu = self.mfu_of(seconds)
        log_step(logged.step, StepResult(loss, grad_norm, values), self.tokens, seconds, logged.lr, skipped, mfu,
                 logged.memory)
        if logged.started_s is not None:
            log0(f"time to the first step: {logged.started_s + seconds:.1f} s since this process started "
                 f"(imports, start-up, building and sharding the model, this step)")
        self.metrics.write({"step": logged.step, "loss": loss, "grad_norm": grad_norm, "lr": logged.lr,
                            "tokens_per_s": self.tokens / seconds, "seconds": seconds, "skipped": skipped,
                            **({"mfu": mfu} if mfu is not None else {}), **logged.memory, **values,
                            **({"val_loss": logged.val_loss} if logged.val_loss is not None else {})})


@dataclass(frozen=True)
class AfterStep:
    """Work after some of the steps (a checkpoint, a sample): `run(step, last)` on the steps
    `due(step, last)` names. train() prints the step's line before it (the line lags a step
    otherwise: LaggedStepLog), so the output keeps its order and a checkpoint's step is on record.
    A plain function given to train() as after_step counts as due after every step."""

    due: Callable[[int, bool], bool]
    run: Callable[[int, bool], None]

    def __call__(self, step: int, last: bool) -> None:
        if self.due(step, last):
            self.run(step, last)


def train(args, optimizer, step_fn: Callable, batches: TokenBatches, dp_rank: int, device: torch.device,
          prepare_batch: Callable | None = None, meters=(), meter_step: int = 0,
          evaluate: Callable | None = None, val_batches: TokenBatches | None = None,
          cfg: GPTConfig | None = None, start_step: int = 0,
          after_step: Callable[[int, bool], None] | None = None,
          clock: Callable[[], float] = seconds_since_process_start) -> Throughput:
    """The loop every lesson shares: learning rate, one step, one log line; returns the throughput
    (with `.skipped_steps`, the steps whose gradient norm was not finite).

    step_fn(batch) runs one optimizer step on a data.StepBatch and returns a StepResult (a
    lesson's train_step with its model, optimizer and settings bound). `prepare_batch(batch)`
    reshapes the batch first when a lesson needs it (context parallelism cuts each sequence).
    `meters` are context managers (activation meters, timeline recorders) entered around step
    `meter_step` only: they observe the technique from outside and cost nothing on other steps.
    With --val-every N > 0 and a lesson's `evaluate(batch) -> float` (the global batch's mean
    loss, no gradients), the loss over --val-batches batches of `val_batches` is logged every N
    steps and after the last one, its collectives left out of the communication meter. With
    --metrics FILE, rank 0 writes each step's values there. Each step also logs this rank's memory
    (StepMemory) and, given the model's `cfg` on a GPU of known peak (or --peak-tflops), its MFU;
    --profile DIR records a few steps with torch.profiler (step_profiler). A resumed run starts
    at `start_step` (the learning rate and the data follow from the step alone) and appends to the
    metrics file; `after_step(step, last)` runs after each step an AfterStep says it is due (a
    plain function: every step), once the step is logged (checkpoints: `last` is true for the
    run's final step, also when the ranks agreed to stop early: AgreedStop). A step's line and
    record come once the next step is queued (LaggedStepLog): the loop reads nothing to the host
    while a step of its own is queued but the figures of the step before.
    With --max-minutes the run ends inside its time budget (TimeBudget; `clock` reads the seconds
    since the process started).
    """
    throughput = Throughput()
    tokens = batches.shape.tokens_per_step
    val_every = getattr(args, "val_every", 0) if evaluate is not None and val_batches is not None else 0
    metrics = MetricsFile(getattr(args, "metrics", None), append=start_step > 0)
    memory = StepMemory(device)
    throughput.peak_flops = peak_flops(device, getattr(args, "peak_tflops", None))
    n_ranks = dist.get_world_size() if dist.is_initialized() else 1
    model_flops = flops_per_token(cfg, batches.shape.seq_len) if cfg is not None else None
    profiler = step_profiler(getattr(args, "profile", None), args.steps - start_step, device)
    budget = (TimeBudget(args.max_minutes, clock, args.val_batches if val_every else 0,
                         planned=getattr(args, "planned_steps", None) is not None)
              if getattr(args, "max_minutes", None) is not None else None)
    final_val_loss = None
    if after_step is not None and not isinstance(after_step, AfterStep):
        after_step = AfterStep(lambda step, last: True, after_step)    # a plain function: after every step

    def mfu_of(seconds: float) -> float | None:
        return (model_flops_utilisation(tokens / seconds, n_ranks, model_flops, throughput.peak_flops)
                if model_flops is not None and throughput.peak_flops else None)

    with AgreedStop() as stop, \
            LaggedStepLog(throughput, metrics, tokens, mfu_of) as log, \
            profiler if profiler is not None else nullcontext():
        data_pass = batches.epoch_at(start_step)
        step = start_step
        while step < args.steps:
            lr = learning_rate(step, args.lr, args.warmup_steps, args.steps)
            set_learning_rate(optimizer, lr)
            if batches.epoch_at(step) > data_pass:
                data_pass = batches.epoch_at(step)
                log.say(f"note: step {step} starts pass {data_pass + 1} over the data ({batches.n_tokens:,} tokens): "
                        f"every window again, in a new order")
            batch = batches.step_batch(step, dp_rank)
            if prepare_batch is not None:
                batch = prepare_batch(batch)
            batch = on_device(batch, device)
            memory.start_step()
            metered = bool(meters) and step == meter_step
            started_s = seconds_since_process_start() if step == start_step else None
            figures = StepFigures(device)
            with ExitStack() as observing:
                for meter in meters if metered else ():
                    observing.enter_context(meter)
                result = step_fn(batch)
            figures.copy(result.values)
            log.add(LoggedStep(step, lr, figures, memory.read(), metered, started_s))   # prints the step before
            if budget is not None:
                budget.note_step()
                if budget.estimate_due():
                    args.steps = args.planned_steps = budget.planned_steps(step + 1, args.steps)
                    log.say(f"time budget: {args.steps} steps fit in {args.max_minutes:g} minutes "
                            f"({budget.slowest_step_s():.2f} s a step, {budget.end_s():.1f} s kept for the end); "
                            f"the learning rate decays to step {args.steps - 1}")
                elif budget.spent():
                    stop.request_stop()
            try:
                stopping = stop.after_step()
            except PeerLost as error:
                # This step's line is not printed: under NCCL its work may wait for the lost rank forever.
                print(f"error: rank {dist.get_rank()}: {error}", file=sys.stderr, flush=True)
                sys.stdout.flush()
                os._exit(1)     # no shutdown(): its barrier would wait for the lost rank
            last = stopping or step == args.steps - 1
            # The final validation is skipped only on a scheduler's signal: its grace period is short.
            if val_every and ((step + 1) % val_every == 0 or (last and not stop.agreed_signal.startswith("SIG"))):
                with traffic_not_counted(), budget.timing("validation") if budget else nullcontext():
                    log.pending.val_loss = final_val_loss = validation_loss(evaluate, val_batches, args.val_batches,
                                                                            dp_rank, prepare_batch, device)
                log.say(f"step {step:>4} | val loss {final_val_loss:.4f}")
            acting = after_step is not None and after_step.due(step, last)
            if acting or last:
                log.flush()     # this step's line now: it comes before its checkpoint, and at the end
            if profiler is not None:
                profiler.step()
            started = time.perf_counter()
            if acting:
                try:
                    with budget.timing("checkpoint") if budget else nullcontext():
                        after_step.run(step, last)
                except ConfigError as error:    # a checkpoint every rank agreed has failed (a full disk)
                    exit_with_error(f"after step {step}: {error}; the checkpoints before it are intact")
            if stopping:
                log0(f"stopped after step {step}: {stop.agreed_signal} ({args.steps - step - 1} steps left)"
                     + (f"; the checkpoint took {time.perf_counter() - started:.1f} s: continue with --resume"
                        if after_step is not None else ""))
            step += 1
            if stopping:
                break
    if budget is not None:
        log0(f"time budget: {step - start_step} steps, {(step - start_step) * tokens:,} tokens in "
             f"{budget.clock():.1f} s of {budget.budget_s:.0f} s"
             + (f"; final val loss {final_val_loss:.4f}" if final_val_loss is not None else ""))
    metrics.close()
    return throughput
