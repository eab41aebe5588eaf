"""
Lesson 03 — pipeline parallelism in one file: AFAB (GPipe), 1F1B and interleaved 1F1B.

The problem. The 8b preset has 32 layers of 218M parameters each. With AdamW in float32 a layer
costs 16 bytes per parameter, 3.5 GB, so the layers alone need 112 GB: more than an 80 GB H100
holds, and data parallelism does not help, since every data-parallel rank holds all of it. Tensor
parallelism (lesson 02) splits every layer, but it puts collectives on the critical path of every
matmul, so it must stay inside a node's NVLink domain.

The idea. Cut the model by depth. Rank r of p holds a contiguous slice of the layers (a stage);
the first stage also holds the embedding, the last one the final norm, the head and the loss.
A micro-batch's activations flow forward from stage to stage, its gradients flow back:

    stage 0: [embedding, layers 0-7 ] ──activations──► stage 1: [layers 8-15] ──► ... ──► stage 3: [layers 24-31,
                                      ◄──gradients───                         ◄── ...              norm, head, loss]

Only the boundary tensors cross ranks: b*s*h numbers per micro-batch and boundary, each way.
But a stage can only work when the micro-batch reaches it, so the batch is cut into m micro-batches
that follow each other down the pipe. The schedule decides the order in which every stage runs
the forward (F) and backward (B) of its micro-batches. This lesson builds three:

    AFAB (GPipe): all forwards, then all backwards. Simple; keeps m micro-batches of activations.
    1F1B: after a warm-up of p-1-r forwards, stage r alternates one forward and one backward, then
          cools down. Same bubble as AFAB, but at most p-r micro-batches alive: memory bounded by p,
          not m.
    interleaved 1F1B: each rank holds v chunks of layers taken round-robin (rank r: chunks r, r+p,
          ...). A micro-batch passes through every rank v times; each pass is v times shorter, so
          the pipeline fills and drains v times faster.

Timelines on 4 stages with 8 micro-batches, printed by this file's simulator (forward: the
micro-batch's digit, backward: its letter, a = 0, a backward twice as long as a forward, '.': idle):

    AFAB         stage 0 |01234567.........aabbccddeeffgghh|
                 stage 1 |.01234567......aabbccddeeffgghh..|
                 stage 2 |..01234567...aabbccddeeffgghh....|
                 stage 3 |...01234567aabbccddeeffgghh......|

    1F1B         stage 0 |0123......aa4bb5cc6dd7ee.ff.gg.hh|     warm-up, steady state, cool-down;
                 stage 1 |.012....aa3bb4cc5dd6ee7ff.gg.hh..|     same length as AFAB, but stage 0
                 stage 2 |..01..aa2bb3cc4dd5ee6ff7gg.hh....|     never holds more than 4
                 stage 3 |...0aa1bb2cc3dd4ee5ff6gg7hh......|     micro-batches (AFAB: 8)

    interleaved  stage 0 |0123012345......6aa7bb4cc5dd6aa7bbcc.ddee..ffgghheeffgghh|   v = 2, at twice
    (v = 2)      stage 1 |.01230123....4aa5bb6cc7dd4aa5bb6cc7ddee.ffgg.hheeffgghh..|   the resolution:
                 stage 2 |..012301..2aa3bb4cc5dd6aa7bb4cc5dd6ee7ffgg.hheeffgghh....|   each chunk is half
                 stage 3 |...01230aa1bb2cc3dd4aa5bb6cc7dd4ee5ff6gg7hheeffgghh......|   a stage

The price. With m micro-batches on p stages, forward+backward time t per micro-batch and stage:
    compute: the bubble, idle time while the pipe fills and drains: (p-1) * t per stage, so
             bubble / useful work = (p-1)/m for AFAB and 1F1B, and (p-1)/(v*m) interleaved.
    memory:  weights, gradients and optimizer states / p (roughly: embedding and head sit at the
             ends); activations: m micro-batches of one stage for AFAB, at most p for 1F1B.
    communication: per step 2*m*b*s*h elements across each of the p-1 boundaries (activations
             forward, gradients back), point to point between neighbours; interleaving has p*v-1
             boundaries, so it moves about v times more for its smaller bubble.

Run it:
    torchrun --nproc_per_node=4 03_pipeline_parallel.py --pp 4 --schedule 1f1b          # CPU, ~20 s
    torchrun --nproc_per_node=4 03_pipeline_parallel.py --pp 4 --schedule afab          # compare memory
    torchrun --nproc_per_node=4 03_pipeline_parallel.py --pp 4 --schedule interleaved --virtual-stages 2 --n-layers 8
    torchrun --nproc_per_node=8 03_pipeline_parallel.py --pp 2 --tp 2 --dp 2            # 3D parallel

What to look for: the loss falls exactly as on one device (the tests prove it to float32 rounding);
the timeline shows the warm-up, steady state and cool-down; the measured bubble sits next to its
formula (on a CPU with unequal stages it is larger: the formula assumes every stage takes as long);
the memory table shows 1F1B's first stage holding p micro-batches where AFAB holds m; the p2p bytes
equal 2*m*b*s*h per boundary to the byte.
"""

from __future__ import annotations

import argparse
import time
import weakref
from collections import defaultdict
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from picotron_like import comm
from picotron_like.model import GPT, Block, RMSNorm, count_parameters, cross_entropy_loss, get_config
from picotron_like.model import init_reference_parameters
from picotron_like.topology import (ConfigError, GridShape, ProcessGrid, init_distributed, load_lesson, shutdown,
                                    validate_parallel_config, world_size_from_env)
from picotron_like.train import (Throughput, add_training_flags, autocast_dtype, build_batches, build_optimizer,
                                 clip_grad_norm_, exit_with_error, learning_rate, log0, log_step, measured_memory,
                                 memory_table, log_compute_report, predicted_activation_bytes, predicted_memory,
                                 set_learning_rate)

data_parallel = load_lesson("01_data_parallel")
tensor_parallel = load_lesson("02_tensor_parallel")

SCHEDULES = ("afab", "1f1b", "interleaved")

# ----------------------------------------------------------------------------- 1. stages


def stage_layer_ranges(n_layers: int, n_stages: int) -> list[range]:
    """Contiguous layer ranges, as even as possible; the first n_layers % n_stages stages get one more.

    The extra layers go to the front because the last stage already carries the final norm, the
    head and the loss: with a 128k vocabulary the head's matmul costs as much as one or two layers.
    (The first stage carries the embedding, but a lookup costs almost nothing.)
    """
    base, extra = divmod(n_layers, n_stages)
    ranges, start = [], 0
    for stage in range(n_stages):
        size = base + (stage < extra)
        ranges.append(range(start, start + size))
        start += size
    return ranges


class StageLayers(nn.Module):
    """A stage's slice of GPT.layers, registered under the layers' indices in the whole model.

    So a stage holding layers 4-7 names its parameters layers.4.attn.q_proj.weight ..., exactly
    as the reference GPT does: reference_init draws every value from its name, weight decay is
    decided by name, and a test compares a stage with the reference name by name.
    """

    def __init__(self, blocks: dict[int, Block]):
        super().__init__()
        for index, block in blocks.items():
            self.add_module(str(index), block)

    def __iter__(self):
        return iter(self._modules.values())

    def __len__(self):
        return len(self._modules)

    def __getitem__(self, position: int) -> Block:
        return list(self._modules.values())[position]


class PipelineStage(nn.Module):
    """One contiguous piece of the reference GPT, shaped like GPT itself.

    It has GPT's attributes (tok_embeddings, layers, norm, lm_head, cross_entropy, cfg), with the
    ones it does not own set to None, and borrows GPT's own embed / rope / head_loss: the model is
    written once, and lesson 02's apply_tensor_parallel converts a stage like a whole GPT.

    forward(x, targets, positions): x is the token ids on the first stage and the hidden states
    [b, s, h] received from the previous stage otherwise; the result is the loss on the last stage
    and the hidden states to send on otherwise.
    """

    embed = GPT.embed
    rope = GPT.rope
    head_loss = GPT.head_loss

    def __init__(self, cfg, seed: int, layer_ids: range, has_embedding: bool, has_head: bool):
        super().__init__()
        self.cfg = cfg
        self.layer_ids = layer_ids
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden) if has_embedding else None
        self.layers = StageLayers({index: Block(cfg) for index in layer_ids})
        self.norm = RMSNorm(cfg.hidden, cfg.norm_eps) if has_head else None
        self.lm_head = nn.Linear(cfg.hidden, cfg.vocab_size, bias=False) if has_head else None
        self.cross_entropy = cross_entropy_loss
        # The names are the reference's, so these are the reference's values for this seed.
        init_reference_parameters(self, seed)

    def forward(self, x, targets=None, positions=None):
        h = self.embed(x) if self.tok_embeddings is not None else x
        rope = self.rope(positions)
        for layer in self.layers:
            h = layer(h, rope)
        return self.head_loss(h, targets) if self.lm_head is not None else h


def build_stage_chunks(cfg, seed: int, pp: int, pp_rank: int, virtual_stages: int = 1) -> list[PipelineStage]:
    """This rank's model chunks: virtual stages pp_rank, pp_rank + pp, pp_rank + 2pp, ...

    With v virtual stages the layers are cut into p*v chunks and dealt round-robin, so a
    micro-batch visits every rank v times (v = 1: one contiguous stage per rank).
    """
    n_stages = pp * virtual_stages
    ranges = stage_layer_ranges(cfg.n_layers, n_stages)
    return [PipelineStage(cfg, seed, ranges[stage], has_embedding=stage == 0, has_head=stage == n_stages - 1)
            for stage in range(pp_rank, n_stages, pp)]


# ----------------------------------------------------------------------------- 2. schedules


@dataclass(frozen=True)
class Action:
    kind: str          # "F" forward or "B" backward
    chunk: int         # which of this rank's model chunks (0 .. v-1)
    micro_batch: int


# A schedule is, for one rank, a list of compute units: one or two actions that run back to back
# before the rank communicates again (section 3).


def afab_schedule(pp: int, pp_rank: int, n_micro: int, virtual_stages: int = 1) -> list[tuple[Action, ...]]:
    """GPipe: every forward, then every backward. All m micro-batches' activations stay alive."""
    return ([(Action("F", 0, i),) for i in range(n_micro)]
            + [(Action("B", 0, i),) for i in range(n_micro)])


def one_f_one_b_schedule(pp: int, pp_rank: int, n_micro: int, virtual_stages: int = 1) -> list[tuple[Action, ...]]:
    """1F1B: warm up with p-1-r forwards, then alternate forward and backward, then cool down.

    Stage r starts a backward as soon as the first gradient comes back, which frees that
    micro-batch's activations: at most p-r micro-batches are ever alive on stage r. The bubble
    is AFAB's: the pipe still fills and drains once.
    """
    warmup = min(pp - pp_rank - 1, n_micro)
    units = [(Action("F", 0, i),) for i in range(warmup)]
    for i in range(n_micro - warmup):
        units += [(Action("F", 0, warmup + i),), (Action("B", 0, i),)]
    return units + [(Action("B", 0, i),) for i in range(n_micro - warmup, n_micro)]


def interleaved_schedule(pp: int, pp_rank: int, n_micro: int, virtual_stages: int) -> list[tuple[Action, ...]]:
    """Interleaved 1F1B (Megatron-LM): micro-batches go through the v chunks in groups of p.

    The k-th forward of a rank runs chunk (k // p) % v on micro-batch (k // (p*v)) * p + k % p:
    p micro-batches through chunk 0, the same p through chunk 1, ..., then the next p. Backwards
    take the chunks in reverse. The warm-up is longer than 1F1B's, (p-1-r)*2 + (v-1)*p forwards,
    so that the first backward's gradient has come all the way back; in the steady state a
    forward and a backward form one unit, and the rank communicates only after both (the
    communication rule that keeps this schedule free of deadlocks, see section 3).
    Needs m to be a multiple of p.
    """
    total = n_micro * virtual_stages

    def forward(k):
        return Action("F", (k % (pp * virtual_stages)) // pp, (k // (pp * virtual_stages)) * pp + k % pp)

    def backward(k):
        return Action("B", virtual_stages - 1 - (k % (pp * virtual_stages)) // pp,
                      (k // (pp * virtual_stages)) * pp + k % pp)

    warmup = min((pp - pp_rank - 1) * 2 + (virtual_stages - 1) * pp, total)
    units = [(forward(k),) for k in range(warmup)]
    units += [(forward(warmup + k), backward(k)) for k in range(total - warmup)]
    return units + [(backward(k),) for k in range(total - warmup, total)]


SCHEDULE_BUILDERS = {"afab": afab_schedule, "1f1b": one_f_one_b_schedule, "interleaved": interleaved_schedule}


def bubble_formula(schedule: str, pp: int, n_micro: int, virtual_stages: int = 1) -> float:
    """Idle time / useful compute per stage, for stages that all take equally long."""
    return (pp - 1) / (n_micro * (virtual_stages if schedule == "interleaved" else 1))


# ----------------------------------------------------------------------------- 3. point-to-point


@dataclass(frozen=True)
class Message:
    kind: str          # "activation" (forward) or "gradient" (backward)
    stage: int         # the virtual stage that consumes it
    micro_batch: int


@dataclass(frozen=True)
class Transfer:
    direction: str     # "send" or "recv"
    peer: int          # the other rank's index in the pipeline group
    message: Message


def communication_program(units, pp: int, pp_rank: int, virtual_stages: int = 1) -> list:
    """The schedule with its communication: Actions, and between them tuples of Transfers.

    The rule: between two compute units, one batch of transfers holds what the previous unit
    produced (sends) and what the next unit needs (receives). Every rank waits for its whole
    batch before computing again. Batching the send with the receive is what prevents the
    classic deadlock: stage r sending its activation to r+1 while r+1 sends a gradient to r,
    both blocked in send because neither has posted its receive. In a batch both directions are
    posted together (NCCL runs them as one group), so they complete together.
    What a unit is matters: in interleaved 1F1B's steady state a forward and a backward form one
    unit (Megatron-LM's order); communicating after each of them instead deadlocks.
    Whether the rule is deadlock-free for a schedule is not assumed: simulate_pipeline checks
    it, with the strictest semantics, for every rank of every configuration before training.
    """
    n_stages = pp * virtual_stages
    program, sends = [], []
    for unit in units:
        receives = []
        for action in unit:
            stage = action.chunk * pp + pp_rank
            if action.kind == "F" and stage > 0:
                receives.append(Transfer("recv", (stage - 1) % pp, Message("activation", stage, action.micro_batch)))
            if action.kind == "B" and stage < n_stages - 1:
                receives.append(Transfer("recv", (stage + 1) % pp, Message("gradient", stage, action.micro_batch)))
        if sends or receives:
            program.append(tuple(sends + receives))
        sends = []
        for action in unit:
            stage = action.chunk * pp + pp_rank
            program.append(action)
            if action.kind == "F" and stage < n_stages - 1:
                sends.append(Transfer("send", (stage + 1) % pp, Message("activation", stage + 1, action.micro_batch)))
            if action.kind == "B" and stage > 0:
                sends.append(Transfer("send", (stage - 1) % pp, Message("gradient", stage - 1, action.micro_batch)))
    if sends:
        program.append(tuple(sends))
    return program


def pipeline_programs(schedule: str, pp: int, n_micro: int, virtual_stages: int = 1) -> list[list]:
    """Every rank's communication program (each rank builds all of them to simulate them)."""
    build = SCHEDULE_BUILDERS[schedule]
    return [communication_program(build(pp, rank, n_micro, virtual_stages), pp, rank, virtual_stages)
            for rank in range(pp)]


class PipelineDeadlock(RuntimeError):
    """The programs of a schedule would hang or exchange the wrong tensors."""


def simulate_pipeline(programs, forward_time: float = 1.0, backward_time: float = 2.0,
                      virtual_stages: int = 1) -> list[list[tuple[Action, float, float]]]:
    """Run every rank's program on a model clock; return each rank's (action, start, end) events.

    A batch of transfers completes only when each of its transfers has met its partner on the
    peer (a send its receive, in the order they were posted): the strictest semantics a
    backend can have (NCCL may make a large send wait for its receive; gloo is more forgiving).
    Two failures are caught: no rank can move (a deadlock), and the k-th message from a to b is
    not the one b expects as its k-th (it would silently receive the wrong tensor: NCCL has no
    tags to tell them apart). A chunk's action takes 1/v of a whole stage's time.
    """
    n = len(programs)
    position, clock = [0] * n, [0.0] * n
    events = [[] for _ in range(n)]
    posted = defaultdict(list)   # (src, dst, "send" or "recv") -> [(message, time posted)], in posting order
    waiting = {}                 # rank -> (program position, [(partner's queue, index in it, message)])

    def post(rank, transfers):
        mine = []
        for transfer in transfers:
            link = (rank, transfer.peer) if transfer.direction == "send" else (transfer.peer, rank)
            queue = posted[link + (transfer.direction,)]
            queue.append((transfer.message, clock[rank]))
            partner = "recv" if transfer.direction == "send" else "send"
            mine.append((link + (partner,), len(queue) - 1, transfer.message))
        return mine

    def completion_time(rank):
        """When the rank's posted batch completes, or None while a partner is missing."""
        done_at = clock[rank]
        for partner_queue, index, message in waiting[rank][1]:
            if len(posted[partner_queue]) <= index:
                return None
            partner_message, partner_time = posted[partner_queue][index]
            if partner_message != message:
                raise PipelineDeadlock(f"rank {rank} expects {message} but message number {index} on that "
                                       f"link is {partner_message}")
            done_at = max(done_at, partner_time)
        return done_at

    while any(position[rank] < len(programs[rank]) for rank in range(n)):
        moved = False
        for rank in range(n):
            while position[rank] < len(programs[rank]):
                step = programs[rank][position[rank]]
                if isinstance(step, Action):
                    duration = (forward_time if step.kind == "F" else backward_time) / virtual_stages
                    events[rank].append((step, clock[rank], clock[rank] + duration))
                    clock[rank] += duration
                else:
                    if waiting.get(rank, (None,))[0] != position[rank]:
                        waiting[rank] = (position[rank], post(rank, step))
                        moved = True
                    done_at = completion_time(rank)
                    if done_at is None:
                        break
                    clock[rank] = done_at
                position[rank] += 1
                moved = True
        if not moved:
            stuck = {rank: programs[rank][position[rank]] for rank in range(n) if position[rank] < len(programs[rank])}
            raise PipelineDeadlock(f"no rank can move; waiting at: {stuck}")
    return events


def peak_live_micro_batches(program, chunk_sizes=None) -> int:
    """The most (chunk, micro-batch) pairs whose activations are kept between their F and B.

    With chunk_sizes (e.g. each chunk's activation bytes for one micro-batch), the peak of their
    sum instead of their count.
    """
    live = peak = 0
    for step in program:
        if isinstance(step, Action):
            size = 1 if chunk_sizes is None else chunk_sizes[step.chunk]
            live += size if step.kind == "F" else -size
            peak = max(peak, live)
    return peak


# ----------------------------------------------------------------------------- 4. running a schedule on real ranks


class SavedForBackward:
    """What autograd stores in place of a saved tensor: it lives exactly as long as the graph does."""

    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor):
        self.tensor = tensor


class LiveActivations:
    """Bytes that autograd keeps alive for backward on this rank, now and at their peak.

    Every tensor saved for backward is handed to autograd inside a small holder, and a weak
    reference to the holder is kept: the holder dies when its micro-batch's backward frees the
    graph. The live bytes are the storages of the holders still alive (each storage once;
    parameters excluded, they are not activations). So this measures what the schedule keeps,
    on any device, and not what something else happens to hold (the token ids of the batch).
    """

    def __init__(self, modules):
        self.parameter_storages = {p.untyped_storage().data_ptr() for m in modules for p in m.parameters()}
        self.saved = []
        self.peak_bytes = 0

    def _pack(self, tensor):
        holder = SavedForBackward(tensor)
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in self.parameter_storages:
            self.saved.append((weakref.ref(holder), storage.data_ptr(), storage.nbytes()))
        return holder

    def recording(self):
        return torch.autograd.graph.saved_tensors_hooks(self._pack, lambda holder: holder.tensor)

    def update_peak(self) -> None:
        self.saved = [entry for entry in self.saved if entry[0]() is not None]
        live = sum(dict((ptr, nbytes) for _, ptr, nbytes in self.saved).values())
        self.peak_bytes = max(self.peak_bytes, live)


class Recorder:
    """What this rank computed and when: (action, start, end) in seconds from a common start."""

    def __init__(self, pp_group):
        self.pp_group = pp_group
        self.events = []

    def start(self) -> None:
        # Every stage starts its clock as the barrier releases it, so the rows line up across
        # processes and machines without sharing a clock.
        comm.call(dist.barrier, group=self.pp_group)
        self.events, self.t0 = [], time.perf_counter()

    def record(self, action: Action, start: float, end: float) -> None:
        self.events.append((action, start - self.t0, end - self.t0))


class Pipeline:
    """Runs one rank's part of a schedule: its chunks, its program, its neighbours.

    chunks: this rank's model chunks (PipelineStage, or after lesson 02 their tensor-parallel
    versions), each wrapped for data parallelism (lesson 01): the wrapper's
    require_backward_grad_sync is switched on only for a chunk's last backward of the step.
    activation_shape: the [b, s, h] tensor every boundary carries, known from the configuration, so a
    receiver allocates its buffer without being told the size.
    """

    def __init__(self, chunks, grid, schedule: str, n_micro: int, virtual_stages: int, activation_shape,
                 device, compute_dtype=torch.float32, activation_dtype=torch.float32):
        self.chunks, self.schedule, self.n_micro, self.virtual_stages = chunks, schedule, n_micro, virtual_stages
        self.pp, self.pp_rank, self.pp_group = grid.pp_size, grid.pp_rank, grid.pp_group
        self.peer_ranks = dist.get_process_group_ranks(grid.pp_group)  # pipeline index -> global rank
        self.n_stages = self.pp * virtual_stages
        self.activation_shape, self.activation_dtype = tuple(activation_shape), activation_dtype
        self.device, self.compute_dtype = device, compute_dtype
        self.program = pipeline_programs(schedule, self.pp, n_micro, virtual_stages)[self.pp_rank]
        self.last_backward = {}
        for index, step in enumerate(self.program):
            if isinstance(step, Action) and step.kind == "B":
                self.last_backward[step.chunk] = index
        self.activations = LiveActivations(chunks)
        self.peak_live_micro_batches = 0

    def stage_of(self, chunk: int) -> int:
        return chunk * self.pp + self.pp_rank

    def forward_backward(self, micro_batches, recorder: Recorder | None = None) -> torch.Tensor:
        """Forward and backward of every micro-batch; returns the mean loss (last stage; 0 elsewhere).

        Every rank reads the same micro-batches: the first stage uses the inputs, the last the
        targets. A micro-batch is (inputs, targets) or (inputs, targets, positions).
        """
        inputs, outputs, grads = {}, {}, {}     # keyed by (virtual stage, micro-batch)
        loss_sum = torch.zeros((), device=self.device)
        if recorder is not None:
            recorder.start()
        for index, step in enumerate(self.program):
            if isinstance(step, Action):
                started = time.perf_counter()
                if step.kind == "F":
                    loss_sum += self._forward(step, micro_batches[step.micro_batch], inputs, outputs)
                else:
                    self._backward(step, index, inputs, outputs, grads)
                if recorder is not None:
                    recorder.record(step, started, time.perf_counter())
            else:
                self._exchange(step, inputs, outputs, grads)
        return loss_sum / self.n_micro

    def _forward(self, action, batch, inputs, outputs) -> torch.Tensor:
        stage = self.stage_of(action.chunk)
        tokens, targets = batch[0].to(self.device), batch[1].to(self.device)
        # Positions come from the data, not from x: under sequence parallelism x holds s/tp tokens
        # but the rotary tables cover the whole sequence.
        positions = batch[2].to(self.device) if len(batch) > 2 else torch.arange(tokens.shape[1], device=self.device)
        x = tokens if stage == 0 else inputs[(stage, action.micro_batch)].requires_grad_()
        with self.activations.recording(), torch.autocast(self.device.type, dtype=self.compute_dtype,
                                                          enabled=self.compute_dtype != torch.float32):
            out = self.chunks[action.chunk](x, targets, positions)
        self.activations.update_peak()
        if stage == self.n_stages - 1:
            # Divide by m, as lesson 01's train_step does: the accumulated gradient is then the
            # gradient of the mean loss, as on one device. (Forgetting it, or dividing the
            # received gradients again on the other stages, scales the gradient by m.)
            outputs[(stage, action.micro_batch)] = out / self.n_micro
            self.peak_live_micro_batches = max(self.peak_live_micro_batches, len(outputs))
            return out.detach()
        outputs[(stage, action.micro_batch)] = out
        self.peak_live_micro_batches = max(self.peak_live_micro_batches, len(outputs))
        return torch.zeros((), device=self.device)

    def _backward(self, action, program_index, inputs, outputs, grads) -> None:
        stage = self.stage_of(action.chunk)
        key = (stage, action.micro_batch)
        # Gradients of a chunk are all-reduced over data parallelism only once, during its last
        # backward of the step; the earlier ones just accumulate into .grad.
        self.chunks[action.chunk].require_backward_grad_sync = self.last_backward[action.chunk] == program_index
        out = outputs.pop(key)
        torch.autograd.backward(out, grad_tensors=None if stage == self.n_stages - 1 else grads.pop(key))

    def _exchange(self, transfers, inputs, outputs, grads) -> None:
        operations = []
        for transfer in transfers:
            message = transfer.message
            peer = self.peer_ranks[transfer.peer]
            if transfer.direction == "send":
                if message.kind == "activation":
                    tensor = outputs[(message.stage - 1, message.micro_batch)].detach()
                else:
                    tensor = inputs.pop((message.stage + 1, message.micro_batch)).grad
                if tensor.shape != self.activation_shape or tensor.dtype != self.activation_dtype:
                    # The receiver allocated its buffer from the configuration; a different size
                    # would fail far away, or hang, on the other rank.
                    raise RuntimeError(f"stage {self.pp_rank} would send a {message.kind} of {tuple(tensor.shape)} "
                                       f"{tensor.dtype}, but its neighbour expects {self.activation_shape} "
                                       f"{self.activation_dtype}: pass the boundary shape the chunks produce")
                operations.append(dist.P2POp(dist.isend, tensor.contiguous(), peer, self.pp_group))
            else:
                buffer = torch.empty(self.activation_shape, dtype=self.activation_dtype, device=self.device)
                (inputs if message.kind == "activation" else grads)[(message.stage, message.micro_batch)] = buffer
                operations.append(dist.P2POp(dist.irecv, buffer, peer, self.pp_group))
        for work in comm.call(dist.batch_isend_irecv, operations):
            work.wait()


def train_step(pipeline: Pipeline, optimizer, micro_batches, max_grad_norm: float, dp_group,
               norm_groups=(), counts_toward_norm=None, recorder: Recorder | None = None) -> float:
    """One optimizer step of a pipeline-parallel rank; returns the mean loss, the same on every rank.

    The shape of lesson 01's train_step: forward and backward of all micro-batches (here by the
    schedule), wait for the data-parallel gradient all-reduce, clip, step. The gradient norm is
    summed over the pipeline group (each stage holds different parameters) and over `norm_groups`
    (the tp group when stages are tensor-parallel).
    """
    loss = pipeline.forward_backward(micro_batches, recorder)
    for chunk in pipeline.chunks:
        chunk.finish_gradient_synchronization()
    params = [p for chunk in pipeline.chunks for p in chunk.parameters()]
    clip_grad_norm_(params, max_grad_norm, (pipeline.pp_group,) + tuple(norm_groups), counts_toward_norm)
    optimizer.step()
    for chunk in pipeline.chunks:
        chunk.zero_grad(set_to_none=False)
    # Only the last stage computed the loss: a sum over the pipeline group hands it to every stage.
    comm.call(dist.all_reduce, loss, group=pipeline.pp_group)
    comm.call(dist.all_reduce, loss, group=dp_group)
    return loss.item() / dist.get_world_size(dp_group)


# ----------------------------------------------------------------------------- 5. the timeline and the bubble


def bubble_fraction(timelines) -> float:
    """Measured idle / busy time, averaged over the stages.

    The step lasts from the common start to the end of the last action on any stage; a stage is
    idle whenever it is not computing (waiting for a neighbour, or done early).
    """
    span = max(end for events in timelines for _, _, end in events)
    fractions = []
    for events in timelines:
        busy = sum(end - start for _, start, end in events)
        fractions.append((span - busy) / busy)
    return sum(fractions) / len(fractions)


def render_timeline(timelines, width: int = 96) -> str:
    """One row per stage; forward: the micro-batch's digit, backward: its letter (a = 0), '.': idle."""
    span = max(end for events in timelines for _, _, end in events)
    rows = []
    for stage, events in enumerate(timelines):
        cells = ["."] * width
        for action, start, end in events:
            symbol = str(action.micro_batch % 10) if action.kind == "F" else chr(ord("a") + action.micro_batch % 26)
            first = round(start / span * width)
            for column in range(first, min(max(round(end / span * width), first + 1), width)):
                cells[column] = symbol
        rows.append(f"stage {stage} |{''.join(cells)}|")
    return "\n".join(rows)


def gather_timelines(recorder: Recorder, pp_group) -> list[list[tuple[Action, float, float]]]:
    """Every stage's events on every rank of the pipeline group (all stages have equally many)."""
    rows = torch.tensor([[action.kind == "F", action.chunk, action.micro_batch, start, end]
                         for action, start, end in recorder.events], dtype=torch.float64)
    gathered = [torch.empty_like(rows) for _ in range(dist.get_world_size(pp_group))]
    comm.call(dist.all_gather, gathered, rows, group=pp_group)
    return [[(Action("F" if forward else "B", int(chunk), int(micro)), start, end)
             for forward, chunk, micro, start, end in rows.tolist()] for rows in gathered]


# ----------------------------------------------------------------------------- 6. configuration


def validate_pipeline_config(grid: GridShape, world_size: int, cfg, schedule: str, virtual_stages: int,
                             n_micro: int) -> None:
    """Raise one ConfigError for a pipeline that cannot run; no collective is used."""
    validate_parallel_config(grid, world_size, cfg)
    problems = []
    if virtual_stages < 1:
        problems.append(f"--virtual-stages {virtual_stages} must be at least 1")
    if schedule != "interleaved" and virtual_stages != 1:
        problems.append(f"--virtual-stages {virtual_stages} needs --schedule interleaved; "
                        f"{schedule} runs one chunk per rank (use --virtual-stages 1)")
    if schedule == "interleaved":
        if grid.pp < 2:
            problems.append(f"--schedule interleaved with --pp {grid.pp}: interleaving needs a pipeline; use --pp >= 2")
        if grid.pp * virtual_stages > cfg.n_layers:
            problems.append(f"--pp {grid.pp} x --virtual-stages {virtual_stages} = {grid.pp * virtual_stages} chunks "
                            f"but n_layers={cfg.n_layers}: every chunk needs a layer; use fewer virtual stages "
                            f"or more layers (--n-layers)")
        if n_micro % grid.pp:
            problems.append(f"--micro-batches {n_micro} is {'fewer than' if n_micro < grid.pp else 'not a multiple of'} "
                            f"--pp {grid.pp}: the interleaved schedule sends micro-batches through each chunk in "
                            f"groups of pp; use a multiple of {grid.pp}")
    if problems:
        raise ConfigError("bad pipeline configuration:\n  - " + "\n  - ".join(problems))
    pipeline_programs_checked(schedule, grid.pp, n_micro, virtual_stages)


def pipeline_programs_checked(schedule: str, pp: int, n_micro: int, virtual_stages: int) -> None:
    """Refuse a schedule whose programs would deadlock: simulated before any rank waits on another."""
    try:
        simulate_pipeline(pipeline_programs(schedule, pp, n_micro, virtual_stages), virtual_stages=virtual_stages)
    except PipelineDeadlock as error:
        raise ConfigError(f"schedule {schedule} with pp={pp}, m={n_micro}, v={virtual_stages} would deadlock: {error}")


# ----------------------------------------------------------------------------- main


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description="Lesson 03: pipeline parallelism (run with torchrun).",
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--pp", type=int, default=None, help="pipeline stages (default: world size / (dp * tp))")
    parser.add_argument("--schedule", choices=SCHEDULES, default="1f1b",
                        help="afab: all forwards then all backwards (GPipe); 1f1b: one forward one backward; "
                             "interleaved: 1f1b over --virtual-stages chunks per rank")
    parser.add_argument("--virtual-stages", type=int, default=None,
                        help="model chunks per rank for --schedule interleaved (default 2 there, else 1)")
    parser.add_argument("--micro-batches", dest="grad_accum", metavar="M", type=int, default=argparse.SUPPRESS,
                        help="m, micro-batches per optimizer step and data-parallel rank (same as --grad-accum)")
    parser.add_argument("--n-layers", type=int, default=None, help="override the preset's number of layers")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel degree inside each stage (lesson 02)")
    parser.add_argument("--sequence-parallel", action="store_true", help="with --tp: Megatron sequence parallelism")
    parser.add_argument("--dp", type=int, default=1, help="data-parallel degree (lesson 01's bucketed all-reduce)")
    parser.add_argument("--bucket-mb", type=float, default=1.0, help="data-parallel gradient bucket size in MB")
    add_training_flags(parser, micro_batch_size=4, grad_accum=8, steps=30)
    args = parser.parse_args(argv)
    if args.virtual_stages is None:
        args.virtual_stages = 2 if args.schedule == "interleaved" else 1
    return args


def configure(args, world_size: int):
    """The model config and grid the flags describe, validated before any process group exists."""
    cfg = get_config(args.preset, n_layers=args.n_layers)
    pp = args.pp or max(1, world_size // (args.dp * args.tp))
    grid = GridShape(dp=args.dp, pp=pp, tp=args.tp)
    validate_pipeline_config(grid, world_size, cfg, args.schedule, args.virtual_stages, args.grad_accum)
    if args.tp > 1:
        tensor_parallel.validate_tensor_parallel(cfg, args.tp, args.seq_len, args.sequence_parallel)
    return cfg, grid


def build_model_chunks(cfg, seed: int, grid, device, virtual_stages: int = 1, sequence_parallel: bool = False,
                       bucket_bytes: int = 2**20) -> list[nn.Module]:
    """This rank's chunks: reference weights, then tensor-parallel (tp > 1), then data-parallel."""
    chunks = [chunk.to(device) for chunk in build_stage_chunks(cfg, seed, grid.pp_size, grid.pp_rank, virtual_stages)]
    if grid.tp_size > 1:
        chunks = [tensor_parallel.apply_tensor_parallel(chunk, grid.tp_group, sequence_parallel) for chunk in chunks]
    return [data_parallel.BucketedDataParallel(chunk, grid.dp_group, bucket_bytes) for chunk in chunks]


def activation_shape(cfg, shape, grid, sequence_parallel: bool) -> tuple[int, int, int]:
    """The tensor crossing every stage boundary: [b, s, h], or [b, s/tp, h] under sequence parallelism."""
    seq = shape.seq_len // grid.tp_size if sequence_parallel else shape.seq_len
    return (shape.micro_batch_size, seq, cfg.hidden)


def norm_settings(grid):
    """Extra groups and the replicated-parameter rule for gradient clipping (tensor parallelism)."""
    if grid.tp_size == 1:
        return (), None
    return (grid.tp_group,), tensor_parallel.tp_counts_toward_norm(grid.tp_group)


def predicted_p2p_bytes(n_micro: int, boundary_shape, element_bytes: int, pp: int, pp_rank: int,
                        virtual_stages: int) -> int:
    """Bytes this rank sends per step (and, by symmetry, receives).

    Each of its v chunks sends m activations forward unless it is the last virtual stage, and m
    gradients backward unless it is the first.
    """
    n_stages = pp * virtual_stages
    stages = range(pp_rank, n_stages, pp)
    messages = sum((stage < n_stages - 1) + (stage > 0) for stage in stages) * n_micro
    return messages * element_bytes * torch.Size(boundary_shape).numel()


def predicted_chunk_activation_bytes(stage: PipelineStage, cfg, micro_batch: int, seq_len: int, tp: int = 1,
                                     sequence_parallel: bool = False) -> int:
    """The reference formula for one micro-batch of one chunk's layers (and head, on the last stage).

    The formula counts the int64 token ids (saved by the embedding) and targets (saved by the
    loss) of a whole model; only the first and the last stage hold them. A tensor-parallel chunk
    saves 1/tp of most of it: lesson 02's formula, which knows stages, says how much.
    """
    has_embedding, has_head = stage.tok_embeddings is not None, stage.lm_head is not None
    if tp > 1:
        return tensor_parallel.predicted_tp_activation_bytes(
            cfg, micro_batch, seq_len, tp, sequence_parallel, n_layers=len(stage.layer_ids),
            with_embedding=has_embedding, with_head=has_head)
    whole_model_ids = predicted_activation_bytes(cfg, micro_batch, seq_len, n_layers=len(stage.layer_ids),
                                                 with_head=has_head)
    return whole_model_ids - 8 * micro_batch * seq_len * ((not has_embedding) + (not has_head))


def predicted_tp_traffic(pipeline: Pipeline, cfg, shape, tp: int, sequence_parallel: bool) -> dict:
    """Lesson 02's tp traffic per step, for the layers (and embedding, head) of this rank's chunks."""
    if tp == 1:
        return {}
    total = defaultdict(int)
    for chunk in pipeline.chunks:
        stage = chunk.module
        for key, value in tensor_parallel.predicted_tp_traffic(
                cfg, shape.micro_batch_size, shape.seq_len, shape.grad_accum, tp, sequence_parallel,
                pipeline.compute_dtype, n_layers=len(stage.layer_ids), with_embedding=stage.tok_embeddings is not None,
                with_head=stage.lm_head is not None).items():
            total[key] += value
    total[("all_reduce", "tp")] += 4   # the gradient norm, summed over the tp shards
    return dict(total)


def stage_report_rows(pipeline: Pipeline, cfg, shape, steps: int, tp: int, sequence_parallel: bool) -> torch.Tensor:
    """This rank's numbers for the per-stage table: layers, live micro-batches, activation bytes, p2p."""
    per_micro_batch = [predicted_chunk_activation_bytes(chunk.module, cfg, shape.micro_batch_size, shape.seq_len,
                                                        tp, sequence_parallel) for chunk in pipeline.chunks]
    sent = comm.meter.get("isend", "pp").payload_bytes / steps
    return torch.tensor([sum(len(chunk.module.layer_ids) for chunk in pipeline.chunks),
                         pipeline.peak_live_micro_batches, peak_live_micro_batches(pipeline.program),
                         pipeline.activations.peak_bytes, peak_live_micro_batches(pipeline.program, per_micro_batch),
                         sent], dtype=torch.float64)


def report(pipeline, optimizer, cfg, shape, args, grid, throughput, recorder, device):
    pp, m, v = grid.pp_size, shape.grad_accum, pipeline.virtual_stages
    boundary = pipeline.activation_shape
    boundary_bytes = 2 * m * torch.Size(boundary).numel() * 4
    modules = nn.ModuleList(chunk.module for chunk in pipeline.chunks)
    n_params = sum(p.numel() for p in modules.parameters())
    # Per step: this rank's p2p; its stage's gradients all-reduced over dp (plus the 4-byte loss);
    # over pp the 4-byte gradient norm and the 4-byte loss.
    predicted = {("isend", "pp"): predicted_p2p_bytes(m, boundary, 4, pp, grid.pp_rank, v),
                 ("irecv", "pp"): predicted_p2p_bytes(m, boundary, 4, pp, grid.pp_rank, v),
                 ("all_reduce", "dp"): n_params * 4 + 4, ("all_reduce", "pp"): 8}
    for key, value in predicted_tp_traffic(pipeline, cfg, shape, grid.tp_size, args.sequence_parallel).items():
        predicted[key] = predicted.get(key, 0) + value
    comm_table = comm.meter.table(predicted, per=args.steps)
    mine = stage_report_rows(pipeline, cfg, shape, args.steps, grid.tp_size, args.sequence_parallel)
    stages = [torch.empty_like(mine) for _ in range(pp)]
    comm.call(dist.all_gather, stages, mine, group=grid.pp_group)
    timelines = gather_timelines(recorder, grid.pp_group)

    log0(f"\n== timeline of the last step ({args.schedule}, pp={pp}, m={m}" + (f", v={v}" if v > 1 else "") + ") ==")
    log0(render_timeline(timelines))
    busy_ms = [sum(end - start for _, start, end in events) * 1e3 for events in timelines]
    log0(f"busy ms per stage: {', '.join(f'{ms:.1f}' for ms in busy_ms)}")
    formula = "(p-1)/(v*m)" if args.schedule == "interleaved" else "(p-1)/m"
    log0(f"bubble (idle / busy): measured {bubble_fraction(timelines):.3f}   formula {formula} = "
         f"{bubble_formula(args.schedule, pp, m, v):.3f}   (the formula assumes equal stages, each on its own core)")

    log0("\n== memory ==")
    log0(f"{'stage':<7}{'layers':>7}{'live micro-batches':>20}{'schedule bound':>16}{'activations MB':>16}"
         f"{'predicted MB':>14}")
    for stage, row in enumerate(stages):
        layers, live, bound, measured_bytes, predicted_bytes, _ = row.tolist()
        log0(f"{stage:<7}{int(layers):>7}{int(live):>20}{int(bound):>16}{measured_bytes / 1e6:>16.3f}"
             f"{predicted_bytes / 1e6:>14.3f}")
    if v > 1:
        log0(f"(interleaved: live micro-batches are counted per chunk, each 1/{v} of a stage: stage 0 keeps "
             f"{stages[0][1].item() / v:.1f} stages' worth, where 1F1B keeps {pp})")
    log0(f"stage 0's rank ({n_params:,} of {count_parameters(cfg)['total']:,} parameters):")
    log0(memory_table(measured_memory(modules, optimizer, pipeline.activations.peak_bytes),
                      predicted_memory(n_params, int(stages[0][4]))))

    log0("\n== communication per step (rank 0; p2p payload = what this rank sends / receives) ==")
    log0(comm_table)
    total_sent = sum(row[5].item() for row in stages)
    log0(f"p2p over the whole pipeline: {pp * v - 1} boundaries x 2*m*b*s*h*4 bytes = {pp * v - 1} x "
         f"2*{m}*{'*'.join(map(str, boundary))}*4 = {(pp * v - 1) * boundary_bytes / 1e6:.4f} MB predicted, "
         f"{total_sent / 1e6:.4f} MB measured (sum of every stage's sends)")

    log_compute_report(throughput, grid.shape.world_size, cfg, shape.seq_len, device)


def main(argv=None):
    args = parse_args(argv)
    try:
        world_size = world_size_from_env()
        cfg, grid_shape = configure(args, world_size)
        batches, shape = build_batches(args, grid_shape.dp, cfg.vocab_size)
    except (ConfigError, ValueError) as error:
        exit_with_error(error)

    device = init_distributed()
    grid = ProcessGrid(grid_shape)
    chunks = build_model_chunks(cfg, args.seed, grid, device, args.virtual_stages, args.sequence_parallel,
                                int(args.bucket_mb * 2**20))
    optimizer = build_optimizer(nn.ModuleList(chunk.module for chunk in chunks), args.lr)
    pipeline = Pipeline(chunks, grid, args.schedule, shape.grad_accum, args.virtual_stages,
                        activation_shape(cfg, shape, grid, args.sequence_parallel), device,
                        autocast_dtype(args.dtype, device))
    norm_groups, counts_toward_norm = norm_settings(grid)
    log0(f"lesson 03: pipeline parallel, {args.schedule}, {grid_shape.picture().splitlines()[0]}, "
         f"{count_parameters(cfg)['total']:,} parameters, {shape.tokens_per_step:,} tokens per step "
         f"({shape.micro_batch_size} x {shape.seq_len} x {shape.grad_accum} micro-batches x {grid_shape.dp} dp)")

    throughput, recorder = Throughput(), Recorder(grid.pp_group)
    for step in range(args.steps):
        set_learning_rate(optimizer, learning_rate(step, args.lr, args.warmup_steps, args.steps))
        throughput.start_step()
        loss = train_step(pipeline, optimizer, batches.micro_batches(step, grid.dp_rank), args.max_grad_norm,
                          grid.dp_group, norm_groups, counts_toward_norm,
                          recorder if step == args.steps - 1 else None)
        log_step(step, loss, shape.tokens_per_step, throughput.end_step(shape.tokens_per_step, device))

    report(pipeline, optimizer, cfg, shape, args, grid, throughput, recorder, device)
    shutdown()


if __name__ == "__main__":
    main()
