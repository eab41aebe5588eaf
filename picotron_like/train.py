"""
Training helpers shared by every lesson: nothing here is a parallelism technique.

- ``build_optimizer`` and ``learning_rate``: AdamW with decoupled weight decay on matrices only, a
  linear warm-up and a cosine decay;
- ``clip_grad_norm_``: gradient clipping whose norm is the norm of the *whole* model's gradient even
  when each rank holds only part of it;
- ``log0``, ``Throughput``: rank-0 printing and tokens per second (and MFU on CUDA);
- ``SavedActivations``, ``memory_report``: the four components of training memory (weights,
  gradients, optimizer states, activations), measured, next to the formula's prediction.
"""

from __future__ import annotations

import math
import os
import sys
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from picotron_like import comm
from picotron_like.data import BatchShape, TokenBatches, builtin_corpus_paths
from picotron_like.model import GPTConfig, flops_per_token

# ----------------------------------------------------------------------------- optimisation


def build_optimizer(model: torch.nn.Module, lr: float, weight_decay: float = 0.1,
                    betas=(0.9, 0.95)) -> torch.optim.AdamW:
    """AdamW; weight decay applies to matrices (linear and embedding weights), not to norm gains.

    The split is decided by each parameter's name, not its shape, so that a shard of a matrix is
    decayed exactly like the full matrix on one device.
    """
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        (no_decay if name.endswith("norm.weight") else decay).append(param)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    # foreach=False keeps the update a plain per-tensor loop on every backend, so a sharded run
    # performs the same float operations on each slice as the reference does on the whole tensor.
    return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=1e-8, foreach=False)


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


def clip_grad_norm_(params, max_norm: float, sharded_over=(), counts_toward_norm=None) -> float:
    """Scale gradients so that the global gradient norm is at most max_norm; return that norm.

    The global norm squared is the sum of squares over every *distinct* parameter element of the
    model. A rank holding a shard contributes its shard's sum of squares, and the contributions
    are summed over the groups the parameters are split across (`sharded_over`: e.g. the tp and
    pp groups). A parameter replicated inside such a group (a norm gain under tensor
    parallelism) must be counted once, not once per rank: `counts_toward_norm(p)` returns False
    on the ranks whose copy should be skipped. Data-parallel replicas need no reduction at all:
    after the gradient all-reduce their gradients are identical.
    """
    params = [p for p in params if p.grad is not None]
    counted = [p for p in params if counts_toward_norm is None or counts_toward_norm(p)]
    device = params[0].grad.device if params else torch.device("cpu")
    norm_sq = torch.zeros((), dtype=torch.float32, device=device)
    for p in counted:
        norm_sq += p.grad.detach().float().pow(2).sum()
    for group in sharded_over:
        comm.call(dist.all_reduce, norm_sq, group=group)
    total_norm = norm_sq.sqrt().item()
    if total_norm > max_norm:
        scale = max_norm / (total_norm + 1e-6)
        for p in params:
            p.grad.mul_(scale)
    return total_norm


# ----------------------------------------------------------------------------- logging and speed

def is_rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def log0(*parts) -> None:
    if is_rank0():
        print(*parts, flush=True)


# Dense bf16 tensor-core peak of the GPUs the README names, in FLOP/s, for MFU.
PEAK_BF16_FLOPS = {"H100": 989e12, "H200": 989e12, "B200": 2250e12, "B300": 2250e12, "A100": 312e12}


def peak_flops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in PEAK_BF16_FLOPS.items() if key in name), None)


class Throughput:
    """Tokens per second over the steps after the first `warmup` (which pay one-off costs)."""

    def __init__(self, warmup: int = 1):
        self.warmup = warmup
        self.steps = 0
        self.tokens = 0
        self.seconds = 0.0
        self._start = None

    def start_step(self) -> None:
        self._start = time.perf_counter()

    def end_step(self, tokens: int, device: torch.device) -> float:
        """Close the step; returns its duration in seconds."""
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        elapsed = time.perf_counter() - self._start
        self.steps += 1
        if self.steps > self.warmup:
            self.tokens += tokens
            self.seconds += elapsed
        return elapsed

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds else float("nan")


def log_compute_report(throughput: Throughput, n_ranks: int, cfg: GPTConfig, seq_len: int,
                       device: torch.device) -> None:
    """The compute part of every lesson's report: tokens/s, and on a known GPU the MFU.

    MFU (model FLOPs utilisation) divides the FLOPs the model needs per token (flops_per_token)
    by the GPU's peak: work a technique adds (recomputation, idle bubbles, communication) lowers
    it instead of counting as useful. Every rank shares the tokens, whatever it computes of them.
    """
    tokens_per_s = throughput.tokens_per_second
    log0("\n== compute ==")
    log0(f"tokens/s (all ranks): {tokens_per_s:,.0f}   per rank: {tokens_per_s / n_ranks:,.0f}")
    peak = peak_flops(device)
    if peak:
        mfu = tokens_per_s / n_ranks * flops_per_token(cfg, seq_len) / peak
        log0(f"MFU: {100 * mfu:.1f} % of {peak / 1e12:.0f} TFLOP/s bf16 peak per GPU")


def log_step(step: int, loss: float, tokens: int, seconds: float) -> None:
    log0(f"step {step:>4} | loss {loss:.4f} | {tokens / seconds:>9.0f} tok/s | {seconds * 1e3:>7.1f} ms")


# ----------------------------------------------------------------------------- memory

class SavedActivations:
    """Measures the bytes autograd keeps alive between forward and backward.

    On CPU there is no allocator to ask, so every tensor saved for backward passes through a hook
    and the storages it lives in are summed once each (many saved tensors are views of one
    storage). Parameters are saved too (a linear layer keeps its weight) but they are not
    activations, so they are left out. On CUDA the allocator's growth over the forward pass is
    the measurement.
    """

    def __init__(self, model: torch.nn.Module, device: torch.device):
        self.device = device
        self.parameter_storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self.storages: dict[int, int] = {}
        self.nbytes = 0

    def _pack(self, tensor):
        ptr = tensor.untyped_storage().data_ptr()
        if ptr not in self.parameter_storages and ptr not in self.storages:
            self.storages[ptr] = tensor.untyped_storage().nbytes()
        return tensor

    def __enter__(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self._allocated_before = torch.cuda.memory_allocated(self.device)
        else:
            self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda tensor: tensor)
            self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.nbytes = torch.cuda.memory_allocated(self.device) - self._allocated_before
        else:
            self._hooks.__exit__(*exc)
            self.nbytes = sum(self.storages.values())
        return False


def predicted_activation_bytes(cfg: GPTConfig, micro_batch: int, seq_len: int, n_layers: int | None = None,
                               with_head: bool = True, element_bytes: int = 4) -> int:
    """Bytes autograd saves for one micro-batch of the dense reference model in float32 on CPU.

    Per token and layer, in elements:
      two RMSNorms, each: input, 1/rms, normalised input, output        2 * (3h + 1)
      attention: q, k and v (repeated to every head), output, log-sum-exp  4h + n_heads
      o_proj input (the heads re-laid out as one row)                     h
      SwiGLU: gate, silu(gate), up, their product                         4f
    plus once per micro-batch the rotary cos/sin tables (s * head_dim), the final norm and the
    log-softmax of the logits (3h + 1 + V per token) with the loss's float32 normaliser (one
    scalar), and the int64 token ids and targets.
    A model with experts saves per-expert copies instead of the 4f term; the formula covers
    dense models only.
    """
    layers = cfg.n_layers if n_layers is None else n_layers
    tokens = micro_batch * seq_len
    h, f = cfg.hidden, cfg.ffn_hidden
    elements = layers * tokens * (11 * h + 4 * f + cfg.n_heads + 2) + seq_len * cfg.head_dim
    if with_head:
        elements += tokens * (3 * h + 1 + cfg.vocab_size) + 1
    return element_bytes * elements + 8 * tokens * 2


@dataclass
class MemoryReport:
    weights: int
    gradients: int
    optimizer_states: int
    activations: int

    @property
    def total(self) -> int:
        return self.weights + self.gradients + self.optimizer_states + self.activations


def tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def measured_memory(model: torch.nn.Module, optimizer: torch.optim.Optimizer, activations: int) -> MemoryReport:
    """Weights, gradients and optimizer states counted from the tensors this rank holds."""
    params = list(model.parameters())
    states = [value for state in optimizer.state.values() for value in state.values()
              if torch.is_tensor(value) and value.dim() > 0]
    return MemoryReport(weights=tensor_bytes(params),
                        gradients=tensor_bytes(p.grad for p in params if p.grad is not None),
                        optimizer_states=tensor_bytes(states),
                        activations=activations)


def predicted_memory(n_params: int, activations: int, param_bytes: int = 4) -> MemoryReport:
    """The textbook prediction: float32 weights and gradients, AdamW's two moments per parameter."""
    return MemoryReport(weights=n_params * param_bytes, gradients=n_params * param_bytes,
                        optimizer_states=2 * n_params * 4, activations=activations)


def memory_table(measured: MemoryReport, predicted: MemoryReport) -> str:
    rows = [f"{'memory per rank':<22}{'measured MB':>13}{'predicted MB':>14}"]
    for field in ("weights", "gradients", "optimizer_states", "activations", "total"):
        rows.append(f"{field:<22}{getattr(measured, field) / 1e6:>13.3f}{getattr(predicted, field) / 1e6:>14.3f}")
    return "\n".join(rows)


# ----------------------------------------------------------------------------- the flags every lesson shares

def add_training_flags(parser, seq_len: int = 128, micro_batch_size: int = 8, grad_accum: int = 2,
                       steps: int = 30) -> None:
    """Model, data and optimisation flags; each lesson adds the flags of its own technique."""
    parser.add_argument("--preset", default="tiny", help="model shape from picotron_like.model.PRESETS")
    parser.add_argument("--data", default=None,
                        help="token shard(s), a path or glob in the llm.c .bin layout; default: the built-in corpus")
    parser.add_argument("--seq-len", type=int, default=seq_len, help="tokens per sequence")
    parser.add_argument("--micro-batch-size", type=int, default=micro_batch_size,
                        help="sequences per micro-batch on each data-parallel rank")
    parser.add_argument("--grad-accum", type=int, default=grad_accum,
                        help="micro-batches per optimizer step (ignored if --global-batch-tokens is given)")
    parser.add_argument("--global-batch-tokens", type=int, default=None,
                        help="tokens per optimizer step over all ranks; sets --grad-accum from it")
    parser.add_argument("--steps", type=int, default=steps, help="optimizer steps")
    parser.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
    parser.add_argument("--warmup-steps", type=int, default=5, help="linear warm-up steps")
    parser.add_argument("--max-grad-norm", type=float, default=1.0, help="gradient clipping threshold")
    parser.add_argument("--seed", type=int, default=0, help="seed of the initial weights and the batch order")
    parser.add_argument("--dtype", choices=("auto", "float32", "bfloat16"), default="auto",
                        help="compute dtype under autocast; auto: bfloat16 on CUDA, float32 on CPU")


def autocast_dtype(flag: str, device: torch.device) -> torch.dtype:
    if flag == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, flag)


def build_batches(args, dp: int, vocab_size: int):
    """The TokenBatches and BatchShape the flags describe (the built-in corpus unless --data)."""
    if args.global_batch_tokens is not None:
        shape = BatchShape.from_global_batch_tokens(args.global_batch_tokens, args.micro_batch_size,
                                                    args.seq_len, dp)
    else:
        shape = BatchShape(args.micro_batch_size, args.seq_len, args.grad_accum, dp)
    paths = args.data if args.data is not None else builtin_corpus_paths()[0]
    return TokenBatches(paths, shape, seed=args.seed, vocab_size=vocab_size), shape


def exit_with_error(error: Exception) -> None:
    """Print a configuration error once (rank 0) and stop every rank with exit code 2.

    Every rank found the same error from the same flags before any collective, so no rank waits
    for another: each can simply leave. The other ranks leave a moment later than rank 0:
    torchrun stops all ranks as soon as the first one exits, and it must not stop rank 0 before
    the message is out.
    """
    if os.environ.get("RANK", "0") == "0":
        print(f"error: {error}", file=sys.stderr, flush=True)
    else:
        time.sleep(2.0)
    sys.stdout.flush()
    os._exit(2)
