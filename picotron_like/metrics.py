"""
Measuring the three challenges: memory, communication and compute, each next to its formula.

Nothing here is a parallelism technique, and no technique counts anything for it: the meters
observe a run from outside. Communication is counted by ``picotron_like.comm`` (every collective
goes through ``comm.call``); the rest is here:

- ``ActivationMeter``: the bytes autograd keeps alive for backward, at their peak, through a
  saved-tensors hook;
- ``GatheredParameterMeter``: the weights a sharded run (ZeRO-3) holds gathered, at their peak,
  through the same hook;
- ``measured_memory`` / ``predicted_memory`` / ``memory_table``: weights, gradients, optimizer
  states and activations, counted from the tensors a rank holds and predicted by formula;
  ``ModelStates``: weights, gradients, float32 master and AdamW's states, the model states ZeRO
  shards (lesson 06 measures and predicts them);
- ``RoutingMeter``: what the MoE layers' routers chose, per layer and forward (the counts the
  expert formulas of memory and traffic take as input), read at the model's expert_compute seam;
- ``BalancingLog``: the MoE layers' balancing losses (aux, z) of a step, summed over the ranks, for
  the step's log line;
- ``step_bookkeeping_traffic``: the two float32 scalars every training step all-reduces (its loss
  and its gradient norm), so that no report adds them by hand;
- ``Throughput`` and ``log_compute_report``: tokens per second, and on a known GPU the MFU;
- ``StepMemory``: each step's peak memory (CUDA), or the process's peak resident set (CPU);
- ``MeteredRun`` with ``log_memory_rows``, ``log_traffic_rows`` and ``log_compute_report``: the
  rows every lesson's report shares (weights, gradients, optimizer states, activations, the data-
  parallel gradient reduction and the step's scalars, tokens/s), printed the same way everywhere,
  so that a lesson's own report adds only its technique's rows.
"""

from __future__ import annotations

import re
import statistics
import sys
import time
import weakref
from collections import defaultdict
from dataclasses import dataclass, fields, replace
from functools import partial

import torch
import torch.distributed as dist

from picotron_like import comm
from picotron_like.loss import LossSettings, loss_chunk_shape, loss_chunk_tokens
from picotron_like.model import GPTConfig, flops_per_token
from picotron_like.moe import expert_counts, moe_layers


def is_rank0() -> bool:
    """Rank 0, or no process group at all: who prints and writes files."""
    return not dist.is_initialized() or dist.get_rank() == 0


def log0(*parts) -> None:
    """Print on rank 0 only (or when no process group exists)."""
    if is_rank0():
        print(*parts, flush=True)


# ----------------------------------------------------------------------------- memory: activations


class _SavedForBackward:
    """What autograd stores in place of a saved tensor: it lives exactly as long as the graph does."""

    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor):
        self.tensor = tensor


class ActivationMeter:
    """The bytes autograd keeps alive for backward on this rank: live now, and at their peak.

    Inside ``with meter:``, every tensor saved for backward is handed to autograd wrapped in a small
    holder, and the holder's death (when backward frees that part of the graph) is watched. The
    live bytes are the storages of the holders still alive, each storage counted once (many saved
    tensors are views of one storage); parameters are saved too (a linear layer keeps its weight)
    but they are not activations, so they are left out. The peak is what a schedule really keeps:
    one micro-batch with gradient accumulation, p micro-batches on 1F1B's first pipeline stage.
    It counts tensors, not allocator blocks, so it reads the same on CPU and CUDA. The parameters'
    storages are looked up when each tensor is saved, not once: ZeRO-3 points its parameters at a
    freshly gathered buffer for every unit it computes, and those weights are not activations either.
    """

    def __init__(self, *modules: torch.nn.Module):
        self.parameters = [p for m in modules for p in m.parameters()]
        self._live: dict[int, list[int]] = {}    # storage address -> [holders alive, bytes]
        self.live_bytes = 0
        self.peak_bytes = 0

    def pack(self, tensor):
        holder = _SavedForBackward(tensor)
        self.count_until(tensor, holder)
        return holder

    def count_until(self, tensor, owner) -> None:
        """Count the tensor's storage (once, however many of its views are saved) until `owner` dies;
        a parameter's storage is no activation."""
        storage = tensor.untyped_storage()
        address = storage.data_ptr()
        if address not in {p.untyped_storage().data_ptr() for p in self.parameters}:
            entry = self._live.get(address)
            if entry is None:
                entry = self._live[address] = [0, storage.nbytes()]
                self.live_bytes += entry[1]
                self.peak_bytes = max(self.peak_bytes, self.live_bytes)
            entry[0] += 1
            weakref.finalize(owner, self._release, address)

    def _release(self, address: int) -> None:
        entry = self._live[address]
        entry[0] -= 1
        if entry[0] == 0:
            del self._live[address]
            self.live_bytes -= entry[1]

    @staticmethod
    def unpack(holder):
        return holder.tensor

    def __enter__(self):
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self._hooks.__exit__(*exc)
        return False


class CallObserver:
    """The calls of chosen functions, observed from outside through Python's profiler hook
    (sys.setprofile, the hook cProfile uses): while entered, `on_call(frame)` runs as one of
    `functions` starts on this thread and `on_return(frame)` as it returns, the frame's arguments
    readable in frame.f_locals. Nothing is replaced or wrapped. An observer entered while another
    is hands every event on to it, so several observe one step together (exit in reverse order)."""

    def __init__(self, functions, on_call=None, on_return=None):
        self.codes = {function.__code__ for function in functions}
        self.on_call, self.on_return = on_call, on_return

    def _profile(self, frame, event, arg):
        if self._previous is not None:
            self._previous(frame, event, arg)
        if frame.f_code in self.codes:
            if event == "call" and self.on_call is not None:
                self.on_call(frame)
            elif event == "return" and self.on_return is not None:
                self.on_return(frame)

    def __enter__(self):
        self._previous = sys.getprofile()
        sys.setprofile(self._profile)
        return self

    def __exit__(self, *exc):
        sys.setprofile(self._previous)
        return False


class SavedTensorMeters:
    """Several saved-tensor meters observing one step together. Autograd runs only the innermost
    saved_tensors_hooks, so two meters entered one inside the other would leave the outer one
    blind; this one hook hands each saved tensor to every meter's `pack` in turn, and back through
    their `unpack` in reverse order (a meter may wrap what it is given, as ActivationMeter does)."""

    def __init__(self, *meters):
        self.meters = meters

    def _pack(self, tensor):
        for meter in self.meters:
            tensor = meter.pack(tensor)
        return tensor

    def _unpack(self, packed):
        for meter in reversed(self.meters):
            packed = meter.unpack(packed)
        return packed

    def __enter__(self):
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self._hooks.__exit__(*exc)
        return False


class GatheredParameterMeter:
    """The bytes of the storages the model's parameters point into, sampled at every tensor autograd
    saves (forward) and reads back (backward): from outside, what a sharded run (ZeRO-3, lesson 06)
    has gathered while computing, each gathered unit counted as its whole padded buffer. A
    saved-tensor meter: entered through SavedTensorMeters, alone or beside an ActivationMeter."""

    def __init__(self, module: torch.nn.Module):
        self.params = list(module.parameters())
        self.peak_bytes = 0

    def pack(self, tensor):
        storages = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in self.params}
        self.peak_bytes = max(self.peak_bytes, sum(storages.values()))
        return tensor

    unpack = pack


def predicted_activation_bytes(cfg: GPTConfig, micro_batch: int, seq_len: int, n_layers: int | None = None,
                               with_head: bool = True, element_bytes: int = 4) -> int:
    """Bytes autograd saves for one micro-batch of the dense reference model in float32 on CPU.

    Per token and layer, in elements:
      two RMSNorms, each: input, 1/rms, normalised input, output        2 * (3h + 1)
      attention: q, k and v (kv heads only), output, log-sum-exp         2h + 2 n_kv d + n_heads
      o_proj input (the heads re-laid out as one row)                     h
      SwiGLU: gate, silu(gate), up, their product                         4f
    plus once per micro-batch the rotary cos/sin tables (s * head_dim), the final norm (3h + 1 per
    token, its output the LM head's input) and the chunked loss's log-sum-exp (1 per token: the
    logits are never kept, loss.LinearCrossEntropy), and the int64 token ids and targets.
    A model with experts saves per-expert copies instead of the 4f term; the formula covers
    dense models only.
    """
    layers = cfg.n_layers if n_layers is None else n_layers
    tokens = micro_batch * seq_len
    h, f = cfg.hidden, cfg.ffn_hidden
    kv = 2 * cfg.n_kv_heads * cfg.head_dim
    elements = layers * tokens * (9 * h + kv + 4 * f + cfg.n_heads + 2) + seq_len * cfg.head_dim
    if with_head:
        elements += tokens * (3 * h + 2)
    return element_bytes * elements + 8 * tokens * 2


def loss_transient_parts(tokens: int, hidden: int, vocab_slice: int, dtype=torch.float32,
                         regathered_input: bool = False, matmul_scratch_bytes: int = 0, device_type: str = "cpu",
                         settings: LossSettings = LossSettings()) -> dict[str, int]:
    """What the chunked loss's backward (loss.LinearCrossEntropy) holds at its peak besides what
    forward kept, in bytes, for n = `tokens` tokens over a vocabulary slice of V words of the LM head,
    hidden h, its weights stored and multiplied in `dtype` (e bytes: float32, or bf16 as lessons 06
    and 07 keep them), on a device of `device_type` (its chunk budget), run as `settings` say: by
    words, blocks of n x b logits; by tokens, chunks of c x V (l logits either way):
      "dW"      the head's weight gradient, until autograd adds it into .grad          V h e
      "dx"      the gradient of the head's input; under sequence parallelism saving     n h e
                the shard, the input gathered again beside it                          (2 n h e)
      "chunk"   eager: one block's recomputed logits in float32, beside their product   l 4 in float32,
                in e (or beside the gradient cast back to e)                           l (4 + e) else
                or, if larger, l e beside what the matmuls dW = g^T x and dx = g W
                allocate for themselves, `matmul_scratch_bytes` (cuBLAS: nothing; the
                CPU's oneDNN packs its bf16 operands: a copy of W on some CPUs, less
                where bf16 is native); compiled: the gradient written over the product  l e + scratch
      "targets" the loss's float32 gradient and each token's scale (float32), and      4 n + 4, and
                by words each target's column in the block (int64) and whether it lies  12 n by words,
                there (float32); by tokens, each target's index in the slice (int64),   13 n by tokens
                whether it lies in the slice (a mask) and whether it is a word there
                (float32)
    This comes at the start of backward, while every activation is still alive: with a large
    vocabulary, the step's peak. tests/test_loss_memory.py measures it on the CPU allocator (the
    loss summed, as a training step asks for it): to the byte in float32, eager and compiled
    (tests/test_loss_kernels.py); in bf16, with the bare matmuls' allocations measured on the same
    CPU, up to some KiB of oneDNN scratch."""
    e = dtype.itemsize
    rows, cols = loss_chunk_shape(tokens, vocab_slice, device_type, settings)
    logits = rows * cols
    if settings.compile_backend is not None:
        chunk = logits * e + matmul_scratch_bytes
    elif e == 4:
        chunk = logits * 4
    else:
        chunk = max(logits * (4 + e), logits * e + matmul_scratch_bytes)
    return {"dW": vocab_slice * hidden * e, "dx": tokens * hidden * e * (1 + regathered_input),
            "chunk": chunk, "targets": 4 * tokens + 4 + (12 if settings.by_words(tokens, vocab_slice) else 13) * tokens}


def predicted_loss_transient_bytes(*args, **kwargs) -> int:
    """The sum of loss_transient_parts (same arguments)."""
    return sum(loss_transient_parts(*args, **kwargs).values())


# ----------------------------------------------------------------------------- memory: the four components


@dataclass
class MemoryReport:
    weights: int
    gradients: int
    optimizer_states: int
    activations: int

    @property
    def total(self) -> int:
        return self.weights + self.gradients + self.optimizer_states + self.activations


@dataclass
class ModelStates:
    """What a rank holds for the model, by role, with mixed precision's float32 master apart from
    the weights it computes with: the states ZeRO shards (lesson 06 measures and predicts them)."""

    parameters: int
    gradients: int
    master_weights: int
    optimizer_states: int

    @property
    def total(self) -> int:
        return self.parameters + self.gradients + self.master_weights + self.optimizer_states


def tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def optimizer_state_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The optimizer's per-parameter states (AdamW's two moments), without its scalar step counts."""
    return [value for state in optimizer.state.values() for value in state.values()
            if torch.is_tensor(value) and value.dim() > 0]


def measured_memory(model: torch.nn.Module, optimizer: torch.optim.Optimizer, activations: int) -> MemoryReport:
    """Weights, gradients and optimizer states counted from the tensors this rank holds."""
    params = list(model.parameters())
    return MemoryReport(weights=tensor_bytes(params),
                        gradients=tensor_bytes(p.grad for p in params if p.grad is not None),
                        optimizer_states=tensor_bytes(optimizer_state_tensors(optimizer)),
                        activations=activations)


def predicted_memory(n_params: int, activations: int, param_bytes: int = 4) -> MemoryReport:
    """The textbook prediction: float32 weights and gradients, AdamW's two moments per parameter."""
    return MemoryReport(weights=n_params * param_bytes, gradients=n_params * param_bytes,
                        optimizer_states=2 * n_params * 4, activations=activations)


def memory_table(measured, predicted, title: str = "memory per rank") -> str:
    """A row per field of a memory dataclass (MemoryReport, ModelStates) and its total,
    measured next to predicted, in MB."""
    rows = [f"{title:<22}{'measured MB':>13}{'predicted MB':>14}"]
    for field in [*(f.name for f in fields(predicted)), "total"]:
        rows.append(f"{field:<22}{getattr(measured, field) / 1e6:>13.3f}{getattr(predicted, field) / 1e6:>14.3f}")
    return "\n".join(rows)


def storage_bytes(tensors, seen: set[int]) -> int:
    """The bytes of the storages behind `tensors`, each storage counted once over every call with
    the same `seen` (a flat buffer and the views into it are one allocation). A storage is told
    apart by its identity, not its address: on the meta device every storage has address 0."""
    total = 0
    for tensor in tensors:
        storage = tensor.untyped_storage()
        if storage.nbytes() and storage._cdata not in seen:
            seen.add(storage._cdata)
            total += storage.nbytes()
    return total


# ----------------------------------------------------------------------------- communication


def data_parallel_traffic(n_params: int, grad_bytes: int = 4, group: str = "dp") -> dict[tuple[str, str], int]:
    """Bytes per step of lesson 01's gradient reduction: one all-reduce of every gradient byte over
    the ranks that hold other tokens (`group`: dp, or dp x cp under context parallelism)."""
    return {("all_reduce", group): n_params * grad_bytes}


def step_bookkeeping_traffic(loss_groups=(), norm_groups=()) -> dict[tuple[str, str], int]:
    """Bytes per step of the two float32 scalars a training step all-reduces besides its technique:
    the loss, summed over `loss_groups`, and the squared gradient norm, summed over `norm_groups`
    (group names as the meter reports them)."""
    traffic = defaultdict(int)
    for group in (*loss_groups, *norm_groups):
        traffic[("all_reduce", group)] += 4
    return dict(traffic)


def step_traffic(technique: dict, gradients: dict, loss_groups=("dp",), norm_groups=()) -> dict:
    """A step's every collective: the technique's, the gradient reduction's, the two scalars'."""
    return add_traffic(technique, gradients, step_bookkeeping_traffic(loss_groups, norm_groups))


def add_traffic(*predictions: dict) -> dict:
    """Sum several predicted-traffic dictionaries key by key."""
    total = defaultdict(int)
    for prediction in predictions:
        for key, value in prediction.items():
            total[key] += value
    return dict(total)


# ----------------------------------------------------------------------------- mixture of experts: routing and balancing


@dataclass(frozen=True)
class RoutedCall:
    """One forward of one MoE layer, as its expert_compute seam saw it."""

    layer: int              # index into RoutingMeter.layers (the MoE layers of its parts, part by part)
    micro_batch: int        # the layer's forward count since the meter was made (folded: modulo the period)
    counts: torch.Tensor    # [E] kept assignments per expert (on the CPU once the meter is left)
    dropped: int            # assignments dropped by capacity
    n_calls: int = 1        # forwards summed into this one (a folding meter's)


class RoutingMeter:
    """Every training forward's routing counts, per MoE layer, while entered: a forward hook on
    each layer reads the choices its forward left (last_choices, moe.py), so neither the layer nor
    the dispatch counts anything for the meter. The hook is always called, also when a forward
    stops early: activation checkpointing's recomputation stops as soon as backward has what it
    needs, and a recomputed forward's routing is part of the step's work. The counts stay on the
    device while training runs (no host synchronisation per layer) and move to the CPU once, when
    the meter is left.

    `parts`: the modules holding the layers (a model, or a rank's pipeline chunks: part_of says
    which holds each). With a `period` (a layer's forwards per step), a meter over a whole run
    folds: a layer's n-th forward adds its counts into call n % period, so it holds layers x
    period calls whatever the number of steps, each the sum of n_calls forwards' counts, which
    is all that formulas linear in the counts need."""

    def __init__(self, parts, period: int | None = None):
        self.layers = [layer for part in parts for layer in moe_layers(part)]
        self.part_of = [index for index, part in enumerate(parts) for _ in moe_layers(part)]
        self.period = period
        self.calls: list[RoutedCall] = []
        self._forwards = [0] * len(self.layers)     # per layer: its forwards recorded so far
        self._slots: dict[tuple[int, int], RoutedCall] = {}     # (layer, micro_batch) -> its call
        self._hooks = []

    def _after_forward(self, index: int, layer, inputs, output) -> None:
        if layer.training:      # a validation forward is no step's work
            expert_ids, kept = layer.last_choices
            self._record(index, expert_counts(expert_ids, layer.n_experts, kept), (~kept).sum())

    def _record(self, index: int, counts: torch.Tensor, dropped: torch.Tensor) -> None:
        forward = self._forwards[index]
        self._forwards[index] += 1
        slot = (index, forward % self.period if self.period else forward)
        known = self._slots.get(slot)
        self._slots[slot] = RoutedCall(*slot, counts, dropped) if known is None else replace(
            known, counts=known.counts + counts, dropped=known.dropped + dropped, n_calls=known.n_calls + 1)

    def __enter__(self):
        self._hooks = [layer.register_forward_hook(partial(self._after_forward, index), always_call=True)
                       for index, layer in enumerate(self.layers)]
        return self

    def __exit__(self, *exc):
        for hook in self._hooks:
            hook.remove()
        self.calls = [replace(call, counts=call.counts.cpu(), dropped=int(call.dropped))
                      for call in self._slots.values()]
        return False


class BalancingLog:
    """The step's enabled balancing losses (aux, z), each summed over layers, micro-batches and
    ranks, for the log line; a disabled one is neither logged nor reduced.

    A forward hook reads each MoE layer's read-outs (last_aux_loss, last_z_loss) after every
    training forward of the layers in `parts` (a model, or a rank's pipeline chunks); step_values
    sums them over `groups`: the ranks that hold other tokens, and those that hold other layers."""

    def __init__(self, parts, groups):
        layers = [layer for part in parts for layer in moe_layers(part)]
        self.names = [name for name, attribute in (("aux", "aux_loss_coef"), ("z", "z_loss_coef"))
                      if any(getattr(layer, attribute) for layer in layers)]
        # summed and reduced on the model's device; the shared loop reads them with the step's figures
        self.device = next(parts[0].parameters()).device if parts else torch.device("cpu")
        self.groups, self.totals = groups, torch.zeros(len(self.names), device=self.device)
        for layer in layers if self.names else ():
            layer.register_forward_hook(self._read)

    def _read(self, layer, inputs, output):
        # Full recomputation runs the layer again inside backward, but non-reentrant checkpoint stops
        # once the last tensor backward needs is rebuilt, inside the layer: this hook never fires then.
        if not layer.training:      # a validation forward: not part of any step's objective
            return
        values = {"aux": layer.last_aux_loss, "z": layer.last_z_loss}
        self.totals += torch.stack([values[name] for name in self.names]).detach()

    def step_values(self) -> dict[str, torch.Tensor]:
        """The step's sums, 0-dim tensors on the model's device (StepResult's extra values)."""
        if not self.names:
            return {}
        totals, self.totals = self.totals, torch.zeros(len(self.names), device=self.device)
        for group in self.groups:
            comm.call(dist.all_reduce, totals, group=group)
        return dict(zip(self.names, totals.unbind()))


# ----------------------------------------------------------------------------- compute

# Dense bf16 tensor-core peak of the GPUs the README names, in FLOP/s, for MFU (SXM parts; a
# PCIe card or a power-capped one peaks lower: --peak-tflops gives the right number).
# Dense (not 2:4 sparse) bf16 peaks per GPU, by the model word in the name CUDA reports ("NVIDIA
# H100 80GB HBM3", "NVIDIA GB200"): whole words, so a GB200 is not taken for a B200. The PCIe H100
# runs slower clocks than the SXM board.
PEAK_BF16_FLOPS = {"H100 PCIe": 756e12, "H100": 989e12, "H200": 989e12, "GB200": 2500e12, "B200": 2250e12,
                   "GB300": 2500e12, "B300": 2250e12, "A100": 312e12}
# The dense FP8 (e4m3/e5m2) peaks of the same GPUs, twice bf16's on each; an A100 has no FP8 tensor
# cores. Lesson 07's --fp8 runs only its blocks' matmuls at this rate.
PEAK_FP8_FLOPS = {"H100 PCIe": 1513e12, "H100": 1979e12, "H200": 1979e12, "GB200": 5000e12, "B200": 4500e12,
                  "GB300": 5000e12, "B300": 4500e12}
MFU_CONVENTION = ("model FLOPs 6N + 12*layers*seq*heads*head_dim per token: causal attention counted in full, "
                  "recomputation not counted")


def peak_flops_of_name(name: str, fp8: bool = False) -> float | None:
    """The table's peak (bf16's, or FP8's with `fp8`) for a GPU's name, the first key found in it
    as whole words; None if none is."""
    table = PEAK_FP8_FLOPS if fp8 else PEAK_BF16_FLOPS
    return next((peak for key, peak in table.items() if re.search(rf"\b{re.escape(key)}\b", name)), None)


def median_milliseconds(step, device: torch.device, warmup: int = 1, timed: int = 10) -> float:
    """The median time of step() in milliseconds over `timed` calls after `warmup` untimed ones:
    each call between two CUDA events on a GPU (the host may run ahead), by the host's clock
    elsewhere. For the GPU benchmarks' rows (benchmarks/gpu_*.py)."""
    for _ in range(warmup):
        step()
    times = []
    for _ in range(timed):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            began = time.perf_counter()
            step()
            times.append(1e3 * (time.perf_counter() - began))
    return statistics.median(times)


def peak_flops(device: torch.device, override_tflops: float | None = None) -> float | None:
    """The device's peak FLOP/s for MFU: `override_tflops` (--peak-tflops) or the table's entry for
    the GPU's name; None on a CPU or an unknown GPU, where no MFU is printed."""
    if device.type != "cuda":
        return None
    if override_tflops is not None:
        return override_tflops * 1e12
    return peak_flops_of_name(torch.cuda.get_device_name(device))


def model_flops_utilisation(tokens_per_s: float, n_ranks: int, model_flops_per_token: int, peak: float) -> float:
    """The fraction of the devices' peak that the model's own FLOPs use: every rank shares the tokens."""
    return tokens_per_s / n_ranks * model_flops_per_token / peak


class StepMemory:
    """The memory of one step, as far as the device lets it be measured.

    CUDA: the peak of allocated tensor memory during the step on this rank (the allocator's
    counter, reset when the step starts): weights, gradients, optimizer states and activations,
    without the allocator's cached blocks. CPU: no such counter exists; the peak resident set
    size of the whole process since it started is what the kernel reports (it includes the Python
    interpreter and torch's libraries, and it never goes down), so that is what is shown, by name.
    """

    def __init__(self, device: torch.device):
        self.device = device

    def start_step(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)

    def read(self) -> dict[str, int]:
        """On CUDA {"max_memory_allocated_bytes": ..., "max_memory_reserved_bytes": ...} (the step's peak of
        the tensors' bytes, and of what the caching allocator holds for them: the GPU memory a run
        needs), {"max_rss_bytes": ...} where the OS reports it, {} otherwise. Call once the step's work is
        queued: the CUDA allocator counts on the host, as it hands out memory, so the reading needs no
        wait for the device."""
        if self.device.type == "cuda":
            return {"max_memory_allocated_bytes": torch.cuda.max_memory_allocated(self.device),
                    "max_memory_reserved_bytes": torch.cuda.max_memory_reserved(self.device)}
        try:
            import resource
        except ImportError:         # Windows: no getrusage
            return {}
        # ru_maxrss is in kilobytes on Linux and in bytes on macOS.
        scale = 1 if sys.platform == "darwin" else 1024
        return {"max_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale}


class Throughput:
    """Tokens per second over the steps after the first `warmup` (which pay one-off costs), leaving
    out the steps a lesson measured from inside (hooks slow them) unless nothing else is left."""

    def __init__(self, warmup: int = 1):
        self.warmup = warmup
        self.steps = 0
        self.tokens = 0
        self.seconds = 0.0
        self.skipped_steps = 0   # steps whose gradient norm was not finite (set by train.train)
        self.peak_flops = None   # the device's peak FLOP/s for MFU, --peak-tflops included (set by train.train)
        self.metered_tokens, self.metered_seconds = 0, 0.0   # the metered steps' after the warm-up

    def record(self, tokens: int, seconds: float, metered: bool = False) -> None:
        self.steps += 1
        if self.steps <= self.warmup:
            return
        if metered:
            self.metered_tokens += tokens
            self.metered_seconds += seconds
        else:
            self.tokens += tokens
            self.seconds += seconds

    @property
    def tokens_per_second(self) -> float:
        tokens, seconds = ((self.tokens, self.seconds) if self.seconds
                           else (self.metered_tokens, self.metered_seconds))
        return tokens / seconds if seconds else float("nan")


# ----------------------------------------------------------------------------- the rows every report shares


@dataclass
class MeteredRun:
    """What a lesson's report reads once training is over: this rank's model (the module whose
    parameters the rank holds, not a wrapper) and optimizer, the meters that watched the steps,
    and the run's size. Every lesson builds one; the shared rows below read only it."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    activations: ActivationMeter | None     # None where a lesson's memory rows are its own (06: model states)
    throughput: Throughput
    cfg: GPTConfig
    seq_len: int
    n_ranks: int            # every rank of the run: they share the tokens of tokens/s
    device: torch.device
    steps: int

    @property
    def n_params(self) -> int:
        return sum(p.numel() for p in self.model.parameters())


def log_memory_rows(run: MeteredRun, title: str, predicted_activations: int,
                    predicted_params: int | None = None) -> None:
    """The memory section: weights, gradients, AdamW's states (counted from the tensors this rank
    holds) and activations (the meter's peak), each next to its formula. `predicted_params`: what
    the lesson's technique says this rank holds (default: what it does hold, so that only the
    bytes per parameter are being checked)."""
    params = run.n_params if predicted_params is None else predicted_params
    log0(f"\n== memory ({title}) ==")
    log0(memory_table(measured_memory(run.model, run.optimizer, run.activations.peak_bytes),
                      predicted_memory(params, predicted_activations)))


def log_traffic_rows(run: MeteredRun, title: str, technique: dict, gradients: dict | None = None,
                     loss_groups=("dp",), norm_groups=(), meter: comm.CommMeter | None = None) -> None:
    """The communication section: every collective the run counted per step, next to the sum of
    the technique's own prediction (`technique`), the gradient reduction (`gradients`; default
    lesson 01's all-reduce of this rank's gradients over dp) and the step's two scalars.
    `meter`: a copy of the counts taken before the report's own bookkeeping collectives ran."""
    gradients = data_parallel_traffic(run.n_params) if gradients is None else gradients
    predicted = step_traffic(technique, gradients, loss_groups, norm_groups)
    log0(f"\n== communication per step ({title}) ==")
    log0((meter or comm.meter).table(predicted, per=run.steps))


def log_compute_report(run: MeteredRun) -> None:
    """The compute section: tokens/s, and on a known GPU the MFU.

    MFU (model FLOPs utilisation) divides the FLOPs the model needs per token (flops_per_token)
    by the GPU's peak: work a technique adds (recomputation, idle bubbles, communication) lowers
    it instead of counting as useful. Every rank shares the tokens, whatever it computes of them.
    """
    throughput, n_ranks = run.throughput, run.n_ranks
    tokens_per_s = throughput.tokens_per_second
    log0("\n== compute ==")
    log0(f"tokens/s (all ranks): {tokens_per_s:,.0f}   per rank: {tokens_per_s / n_ranks:,.0f}")
    peak = throughput.peak_flops or peak_flops(run.device)
    if peak:
        mfu = model_flops_utilisation(tokens_per_s, n_ranks, flops_per_token(run.cfg, run.seq_len), peak)
        log0(f"MFU: {100 * mfu:.1f} % of {peak / 1e12:.0f} TFLOP/s dense bf16 peak per GPU ({MFU_CONVENTION})")
