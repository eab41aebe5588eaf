"""
Lesson 03 — pipeline parallelism in one file: AFAB (GPipe), 1F1B and interleaved 1F1B.

The problem. The 8b preset's 32 layers cost 3.5 GB each with AdamW in float32 (16 bytes per
parameter): 112 GB, more than an 80 GB H100 holds, on every data-parallel rank. Tensor parallelism
(lesson 02) splits every layer but puts collectives on every matmul's critical path, so it must
stay inside a node's NVLink domain.

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
          not m. Pipeline.one_f_one_b writes it out: each receive, compute and send in order.
    interleaved 1F1B: each rank holds v chunks of layers taken round-robin (rank r: chunks r, r+p,
          ...). A micro-batch passes through every rank v times; each pass is v times shorter, so
          the pipeline fills and drains v times faster.

Timelines on 4 stages with 8 micro-batches, printed by the schedule simulator in
picotron_like.pipeline_tools (forward: the micro-batch's digit, backward: its letter, a = 0, a
backward twice as long as a forward, '.': idle):

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
             boundaries, so it moves about v times more for its smaller bubble. A rank waits for
             what it receives before computing on, not for what it sends, which stays in flight
             until the end of the step (NCCL finishes a batch's sends and receives together, so
             only a batch that only sends is left; --no-async-pp-sends waits for every send at once).

Run it:
    torchrun --nproc_per_node=4 03_pipeline_parallel.py --pp 4 --schedule 1f1b          # CPU, ~20 s
    torchrun --nproc_per_node=4 03_pipeline_parallel.py --pp 4 --schedule afab          # compare memory
    torchrun --nproc_per_node=4 03_pipeline_parallel.py --pp 4 --schedule interleaved --virtual-stages 2 --n-layers 8
    torchrun --nproc_per_node=4 03_pipeline_parallel.py --pp 2 --dp 2                   # 2 pipelines, dp x pp

With dp, each pipeline runs the schedule on its own micro-batches and all-reduces its stages'
gradients over dp. Stages that are also tensor- or context-parallel, hold experts or are sharded
by ZeRO are lesson 07's composition: --tp, --cp and --ep here are refused with a line pointing there.

What to look for: the loss falls exactly as on one device (the tests prove it to float32 rounding);
the timeline shows the warm-up, steady state and cool-down; the measured bubble sits next to its
formula (on a CPU with unequal stages it is larger: the formula assumes every stage takes as long);
the memory table shows 1F1B's first stage holding p micro-batches where AFAB holds m; the p2p bytes
equal 2*m*b*s*h per boundary to the byte.
"""

from __future__ import annotations

import argparse
import copy
from collections import OrderedDict
from dataclasses import dataclass, replace
from functools import partial

import torch
import torch.distributed as dist
from torch import nn

from picotron_like import comm
from picotron_like.data import StepBatch
from picotron_like.lessons import load_lesson
from picotron_like.metrics import (ActivationMeter, MeteredRun, log0, log_compute_report, log_memory_rows,
                                   log_traffic_rows, predicted_activation_bytes)
from picotron_like.model import GPT, Block, LMHead, RMSNorm, count_parameters, init_reference_parameters
from picotron_like.pipeline_tools import (PipelineDeadlock, TimelineRecorder, bubble_fraction,
                                          gather_timelines, peak_live_micro_batches, render_timeline,
                                          simulate_pipeline)
from picotron_like.topology import (ConfigError, GridShape, ProcessGrid, init_distributed, shutdown,
                                    validate_parallel_config)
from picotron_like.run_control import StepMeters, step_to_meter
from picotron_like.train import (RankBatches, StepResult, StepSettings, add_parallel_flags, add_training_flags,
                                 autocast_dtype, bucket_bytes_from_flags, build_optimizer, clip_and_step, plan_run,
                                 train)

data_parallel = load_lesson("01_data_parallel")

# ============================================================================ the technique: stages


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


def stage_layers(blocks: dict[int, Block]) -> nn.Sequential:
    """A stage's slice of GPT.layers, registered under the layers' indices in the whole model.

    So a stage holding layers 4-7 names its parameters layers.4.attn.q_proj.weight ..., exactly
    as the reference GPT does: reference_init draws every value from its name, weight decay is
    decided by name, and a test compares a stage with the reference name by name. A Sequential
    because it keeps those names and still iterates, counts and indexes by position as GPT.layers
    does (its own forward is never called: a block also takes the rotary tables).
    """
    return nn.Sequential(OrderedDict((str(index), block) for index, block in blocks.items()))


class PipelineStage(nn.Module):
    """One contiguous piece of the reference GPT, shaped like GPT itself.

    It has GPT's attributes (tok_embeddings, layers, norm, lm_head, cfg), with the
    ones it does not own set to None, and borrows GPT's own embed / rope / head_loss: the model is
    written once.

    forward(x, targets, positions, reduction): x is the token ids on the first stage and the hidden
    states [b, s, h] received from the previous stage otherwise; the result is the loss on the last
    stage (its mean, or with reduction="sum" its sum over the targets) and the hidden states to
    send on otherwise.
    """

    embed = GPT.embed
    rope = GPT.rope
    head_loss = GPT.head_loss

    def __init__(self, cfg, seed: int, layer_ids: range, has_embedding: bool, has_head: bool):
        super().__init__()
        self.cfg = cfg
        self.layer_ids = layer_ids
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden) if has_embedding else None
        self.layers = stage_layers({index: Block(cfg) for index in layer_ids})
        self.norm = RMSNorm(cfg.hidden, cfg.norm_eps) if has_head else None
        self.lm_head = LMHead(cfg.hidden, cfg.vocab_size) if has_head else None    # the loss too (chunked)
        # The names are the reference's, so these are the reference's values for this seed.
        init_reference_parameters(self, seed)

    def forward(self, x, targets=None, positions=None, reduction: str = "mean"):
        h = self.embed(x) if self.tok_embeddings is not None else x
        rope = self.rope(positions)
        for layer in self.layers:
            h = layer(h, rope)
        return self.head_loss(h, targets, reduction) if self.lm_head is not None else h


def build_stage_chunks(cfg, seed: int, pp: int, pp_rank: int, virtual_stages: int = 1) -> list[PipelineStage]:
    """This rank's model chunks: virtual stages pp_rank, pp_rank + pp, pp_rank + 2pp, ...

    With v virtual stages the layers are cut into p*v chunks and dealt round-robin, so a
    micro-batch visits every rank v times (v = 1: one contiguous stage per rank).
    """
    n_stages = pp * virtual_stages
    ranges = stage_layer_ranges(cfg.n_layers, n_stages)
    return [PipelineStage(cfg, seed, ranges[stage], has_embedding=stage == 0, has_head=stage == n_stages - 1)
            for stage in range(pp_rank, n_stages, pp)]


# ============================================================================ the technique: AFAB and 1F1B schedules


@dataclass(frozen=True)
class Action:
    kind: str          # "F" forward, "B" backward
    chunk: int         # which of this rank's model chunks (0 .. v-1)
    micro_batch: int


# A schedule is, for one rank, a list of compute units: a unit is the actions that run back to
# back before the rank communicates again. In AFAB and 1F1B every unit is one action; interleaved
# 1F1B's steady state pairs a forward with a backward (why: see communication_program).


def afab_schedule(pp: int, pp_rank: int, n_micro: int, virtual_stages: int = 1) -> list[tuple[Action, ...]]:
    """GPipe: every forward, then every backward. All m micro-batches' activations stay alive."""
    return ([(Action("F", 0, i),) for i in range(n_micro)]
            + [(Action("B", 0, i),) for i in range(n_micro)])


def one_f_one_b_schedule(pp: int, pp_rank: int, n_micro: int, virtual_stages: int = 1) -> list[tuple[Action, ...]]:
    """1F1B: warm up with p-1-r forwards, then alternate one forward and one backward, then cool down.

    Stage r starts a backward as soon as the first gradient comes back, which frees that
    micro-batch's activations: at most p-r micro-batches are ever alive on stage r. The bubble
    is AFAB's: the pipe still fills and drains once.
    """
    warmup = min(pp - pp_rank - 1, n_micro)
    forwards = [Action("F", 0, i) for i in range(n_micro)]
    backwards = [Action("B", 0, i) for i in range(n_micro)]
    # warm-up: fill the pipe; the first gradient needs p-1-r more forwards downstream to come back
    units = [(forward,) for forward in forwards[:warmup]]
    # steady state: each backward frees a micro-batch, each forward admits the next one
    for forward, backward in zip(forwards[warmup:], backwards):
        units += [(forward,), (backward,)]
    # cool-down: the last warm-up's worth of backwards drain the pipe
    return units + [(backward,) for backward in backwards[n_micro - warmup:]]


# ============================================================================ the technique: interleaved 1F1B


def interleaved_schedule(pp: int, pp_rank: int, n_micro: int, virtual_stages: int) -> list[tuple[Action, ...]]:
    """Interleaved 1F1B (Megatron-LM): micro-batches go through the v chunks in groups of p.

    The k-th forward of a rank runs chunk (k // p) % v on micro-batch (k // (p*v)) * p + k % p:
    p micro-batches through chunk 0, the same p through chunk 1, ..., then the next p. Backwards
    take the chunks in reverse. The warm-up is longer than 1F1B's, (p-1-r)*2 + (v-1)*p forwards,
    so that the first backward's gradient has come all the way back; in the steady state a
    forward and a backward form one unit, and the rank communicates only after both.
    Needs m to be a multiple of p.
    """
    per_round = pp * virtual_stages     # a round: p micro-batches through each of the v chunks

    def forward(k):
        return Action("F", (k % per_round) // pp, (k // per_round) * pp + k % pp)

    def backward(k):
        return Action("B", virtual_stages - 1 - (k % per_round) // pp, (k // per_round) * pp + k % pp)

    total = n_micro * virtual_stages
    warmup = min((pp - pp_rank - 1) * 2 + (virtual_stages - 1) * pp, total)
    units = [(forward(k),) for k in range(warmup)]                                    # warm-up
    units += [(forward(warmup + k), backward(k)) for k in range(total - warmup)]       # steady state
    return units + [(backward(k),) for k in range(total - warmup, total)]              # cool-down


SCHEDULES = {"afab": afab_schedule, "1f1b": one_f_one_b_schedule, "interleaved": interleaved_schedule}


def forward_units(units) -> list[tuple[Action, ...]]:
    """A schedule without its backwards, for a forward-only pass (validation). Every rank keeps its
    forwards in the schedule's order, so the activations still arrive in the order each stage
    expects them; dropping the gradients only removes waits (the simulator checks it)."""
    kept = (tuple(action for action in unit if action.kind == "F") for unit in units)
    return [unit for unit in kept if unit]


# ============================================================================ the technique: point-to-point


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


def action_transfers(action: Action, pp: int, pp_rank: int, n_stages: int) -> tuple[tuple, tuple]:
    """What an action must receive before it runs, and what it sends once it has run.

    A forward of virtual stage s receives its input from stage s-1 and sends its output to s+1; a
    backward receives the gradient of its output from s+1 and sends the gradient of its input to
    s-1. The ends of the pipeline have no neighbour there. Stage s lives on rank s % pp.
    """
    stage, micro_batch = action.chunk * pp + pp_rank, action.micro_batch
    before, after = (stage - 1) % pp, (stage + 1) % pp
    if action.kind == "F":
        needs = (Transfer("recv", before, Message("activation", stage, micro_batch)),) if stage > 0 else ()
        makes = (Transfer("send", after, Message("activation", stage + 1, micro_batch)),) if stage < n_stages - 1 else ()
    else:
        needs = (Transfer("recv", after, Message("gradient", stage, micro_batch)),) if stage < n_stages - 1 else ()
        makes = (Transfer("send", before, Message("gradient", stage - 1, micro_batch)),) if stage > 0 else ()
    return needs, makes


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
    Whether the rule is deadlock-free for a schedule is not assumed: the configuration rules
    simulate every rank's program, with the strictest semantics, before training.
    """
    n_stages = pp * virtual_stages
    program, sends = [], ()
    for unit in units:
        transfers = [action_transfers(action, pp, pp_rank, n_stages) for action in unit]
        receives = tuple(transfer for needs, _ in transfers for transfer in needs)
        if sends or receives:
            program.append(sends + receives)
        program.extend(unit)
        sends = tuple(transfer for _, makes in transfers for transfer in makes)
    if sends:
        program.append(sends)
    return program


# ============================================================================ the technique: running a rank's program


class Pipeline:
    """Runs one rank's part of a schedule: its chunks, its program, its neighbours.

    chunks: this rank's model chunks (PipelineStage), each wrapped for data parallelism (a
    train.DataParallelModel, here lesson 01's): the wrapper's require_backward_grad_sync is
    switched on only for a chunk's last backward of the step.
    activation_shape: the [b, s, h] tensor every boundary carries, known from the configuration, so a
    receiver allocates its buffer without being told the size; boundary_dtype: its dtype.
    async_sends: an exchange waits for what it receives only, and its sends stay in flight until the
    end of the step (exchange says why that is safe); off, it waits for its sends too.
    1F1B runs written out (one_f_one_b: receive, compute, send, as a reader should see it first);
    every other schedule runs its communication program (run_program), the same steps generated
    by communication_program. Both alternate exchange (one batch of transfers) with forward_step /
    backward_step (one action each).
    """

    # The residual stream stays float32 under autocast (only matmul inputs are lowered), so a
    # boundary is float32 at any compute dtype.
    boundary_dtype = torch.float32

    def __init__(self, chunks, grid, schedule: str, n_micro: int, virtual_stages: int, activation_shape,
                 device, compute_dtype=torch.float32, async_sends: bool = True):
        self.chunks, self.schedule, self.virtual_stages = chunks, schedule, virtual_stages
        self.async_sends, self.sends_in_flight, self.sent_in_flight = async_sends, [], []
        self.pp, self.pp_rank, self.pp_group = grid.pp_size, grid.pp_rank, grid.pp_group
        self.peer_ranks = dist.get_process_group_ranks(comm.process_group(grid.pp_group))  # pipeline index -> global rank
        self.n_stages = self.pp * virtual_stages
        self.activation_shape = tuple(activation_shape)
        self.device, self.compute_dtype = device, compute_dtype
        self.build_programs(n_micro)

    def build_programs(self, n_micro: int) -> None:
        """This rank's communication program for n_micro micro-batches, and its forwards' alone
        (validation), from the schedule's compute units."""
        self.n_micro = n_micro
        units = self.schedule_units(n_micro)
        self.program = self.communication_program(units)
        self.forward_program = self.communication_program(forward_units(units))
        # chunk -> the program index of its last backward: where the data-parallel reduction of its
        # gradients is switched on
        self.last_backward = {step.chunk: index for index, step in enumerate(self.program)
                              if isinstance(step, Action) and step.kind == "B"}

    def schedule_units(self, n_micro: int) -> list[tuple[Action, ...]]:
        return SCHEDULES[self.schedule](self.pp, self.pp_rank, n_micro, self.virtual_stages)

    def communication_program(self, units) -> list:
        return communication_program(units, self.pp, self.pp_rank, self.virtual_stages)

    def forward_backward(self, batch: StepBatch) -> torch.Tensor:
        """Forward and backward of every micro-batch, in the schedule's order.

        Returns this rank's share of the loss: on the last stage its micro-batches' summed token
        losses over batch.n_targets, 0 elsewhere. Every rank reads the same micro-batches: the first
        stage uses the inputs, the last the targets. A micro-batch is (inputs, targets).
        """
        loss = self.one_f_one_b(batch) if self.schedule == "1f1b" else self.run_program(batch)
        self.wait_for_sends()
        return loss

    def one_f_one_b(self, batch: StepBatch) -> torch.Tensor:
        """1F1B with one chunk per rank, written out: the warm-up's forwards, the steady state's
        forward-backward pairs, the cool-down's backwards, each one received, computed and sent.

        Each exchange posts what the last computation produced (its send) together with what the
        next one needs (its receive), and waits for both: posting them together is what keeps two
        neighbours from both blocking in a send (communication_program says more). This is the
        order the configuration rules simulated before training (communication_program of
        one_f_one_b_schedule); a test checks that this loop runs exactly that program.
        """
        p, r, m = self.pp, self.pp_rank, len(batch.micro_batches)
        inputs, outputs, grads = {}, {}, {}     # keyed by (stage, micro-batch)
        loss = torch.zeros((), device=self.device)
        sent = ()                               # what the last computation produced, not yet sent

        def receive_compute_send(action: Action):
            nonlocal loss, sent
            needs, makes = action_transfers(action, p, r, n_stages=p)
            if sent or needs:
                self.exchange(sent + needs, inputs, outputs, grads)
            if action.kind == "F":
                loss += self.forward_step(action, batch, inputs, outputs)
            else:                               # the last backward starts the data-parallel reduction
                self.backward_step(action, action.micro_batch == m - 1, inputs, outputs, grads)
            sent = makes

        warmup = min(p - 1 - r, m)
        # warm-up: forwards only; the first gradient comes back after p-1-r more forwards downstream
        for i in range(warmup):
            receive_compute_send(Action("F", 0, i))
        # steady state: each forward admits micro-batch warmup+i, each backward frees micro-batch i
        for i in range(m - warmup):
            receive_compute_send(Action("F", 0, warmup + i))
            receive_compute_send(Action("B", 0, i))
        # cool-down: the backwards of the warm-up's micro-batches drain the pipe
        for i in range(m - warmup, m):
            receive_compute_send(Action("B", 0, i))
        if sent:
            self.exchange(sent, inputs, outputs, grads)
        return loss

    def run_program(self, batch: StepBatch, program=None) -> torch.Tensor:
        """Any schedule, by its communication program: the same steps one_f_one_b writes out,
        generated by communication_program from the schedule's compute units. forward_only runs
        the program of the schedule's forwards alone."""
        inputs, outputs, grads = {}, {}, {}     # keyed by (virtual stage, micro-batch)
        loss = torch.zeros((), device=self.device)
        for index, step in enumerate(self.program if program is None else program):
            if not isinstance(step, Action):
                self.exchange(step, inputs, outputs, grads)
            elif step.kind == "F":
                loss += self.forward_step(step, batch, inputs, outputs)
            else:
                self.backward_step(step, self.last_backward[step.chunk] == index, inputs, outputs, grads)
        return loss

    def forward_only(self, batch: StepBatch) -> torch.Tensor:
        """Forward of every micro-batch and nothing else (validation, under torch.no_grad): the
        schedule's forwards in its own order, with only their activation transfers. Returns this
        rank's share of the loss, as forward_backward does."""
        loss = self.run_program(batch, self.forward_program)
        self.wait_for_sends()
        return loss

    def forward_step(self, action: Action, batch: StepBatch, inputs, outputs):
        stage = action.chunk * self.pp + self.pp_rank
        micro_batch = batch.micro_batches[action.micro_batch]
        tokens, targets = micro_batch[0].to(self.device), micro_batch[1].to(self.device)
        positions = torch.arange(tokens.shape[1], device=self.device)
        x = tokens if stage == 0 else inputs[(stage, action.micro_batch)].requires_grad_()
        with torch.autocast(self.device.type, dtype=self.compute_dtype, enabled=self.compute_dtype != torch.float32):
            out = self.chunks[action.chunk](x, targets, positions, reduction="sum")
        if stage < self.n_stages - 1:
            outputs[(stage, action.micro_batch)] = out
            return 0.0
        # Token-weighted: the summed token losses over the global batch's target count. Summed over
        # micro-batches (no division by m) and ranks, that is the reference's mean over the whole
        # batch, however many targets each micro-batch ignores.
        outputs[(stage, action.micro_batch)] = loss = out / batch.n_targets
        return loss.detach()

    def backward_step(self, action: Action, is_chunks_last: bool, inputs, outputs, grads) -> None:
        stage = action.chunk * self.pp + self.pp_rank
        key = (stage, action.micro_batch)
        # Gradients of a chunk are all-reduced over data parallelism only once, during its last
        # backward of the step; the earlier ones just accumulate into .grad.
        self.chunks[action.chunk].require_backward_grad_sync = is_chunks_last
        # The last stage starts from its loss, every other stage from the gradient its successor sent.
        torch.autograd.backward(outputs.pop(key), grad_tensors=None if stage == self.n_stages - 1 else grads.pop(key))

    def exchange(self, transfers, inputs, outputs, grads) -> None:
        """Post one batch of transfers and wait for what it receives: the next computation reads it.

        What it sends is read by nobody here again (each send is a tensor of its own, never a
        buffer this rank refills), so with async_sends its requests stay in flight while this rank
        computes on, and are waited for at the end of the step (wait_for_sends). Safe: a send
        completes once its receiver posts the matching receive (gloo's and NCCL's rule), and not
        waiting only lets every rank post its later transfers sooner, never later, so the programs
        that the configuration rules simulated with every send waited for cannot hang either. The
        tensors sent are kept until then too: nothing may free or reuse them while they travel."""
        works, sent = self.post(transfers, inputs, outputs, grads)
        if not self.async_sends:
            for work in works:
                work.wait()
            return
        receiving = receiving_requests(transfers, works)
        for work, receives in zip(works, receiving):
            if receives:
                work.wait()
            else:
                self.sends_in_flight.append(work)
        if not all(receiving):
            self.sent_in_flight += sent

    def wait_for_sends(self) -> None:
        """The end of the step: every send still in flight completes (its receiver has posted for it)."""
        for work in self.sends_in_flight:
            work.wait()
        self.sends_in_flight, self.sent_in_flight = [], []

    def post(self, transfers, inputs, outputs, grads) -> tuple[list, list]:
        """Post one batch of transfers in one batch_isend_irecv; returns its requests and the tensors it sends."""
        operations = []
        for transfer in transfers:
            message, peer = transfer.message, self.peer_ranks[transfer.peer]
            if transfer.direction == "recv":
                buffer = torch.empty(self.activation_shape, dtype=self.boundary_dtype, device=self.device)
                (inputs if message.kind == "activation" else grads)[(message.stage, message.micro_batch)] = buffer
                operations.append(comm.P2POp(dist.irecv, buffer, peer, self.pp_group))
                continue
            if message.kind == "activation":
                tensor = outputs[(message.stage - 1, message.micro_batch)].detach()
            else:
                tensor = inputs.pop((message.stage + 1, message.micro_batch)).grad
            if tensor.shape != self.activation_shape or tensor.dtype != self.boundary_dtype:
                # The receiver allocated its buffer from the configuration; a different size would
                # fail far away, or hang, on the other rank.
                raise RuntimeError(f"stage {self.pp_rank} would send a {message.kind} of {tuple(tensor.shape)} "
                                   f"{tensor.dtype}, but its neighbour expects {self.activation_shape} "
                                   f"{self.boundary_dtype}: "
                                   f"pass the boundary shape the chunks produce")
            operations.append(comm.P2POp(dist.isend, tensor.contiguous(), peer, self.pp_group))
        works = comm.call(dist.batch_isend_irecv, operations) if operations else []
        return works, [operation.tensor for operation in operations if operation.op is dist.isend]


def receiving_requests(transfers, works) -> list[bool]:
    """For each request of a batch posted by Pipeline.post, whether it receives something.

    On gloo a batch's requests are its transfers', one each, in order. NCCL runs a batch as one
    group and returns one request for all of it: a batch that receives waits for its sends too
    (they finish together); a batch that only sends is left in flight whole."""
    receives = [transfer.direction == "recv" for transfer in transfers]
    return receives if len(works) == len(receives) else [any(receives)] * len(works)


def train_step(pipeline: Pipeline, optimizer, batch: StepBatch, settings: StepSettings) -> StepResult:
    """One optimizer step of a pipeline-parallel rank; the loss is that of the global batch.

    The shape of lesson 01's train_step: forward and backward of all micro-batches (here by the
    schedule), wait for the data-parallel gradient all-reduce, clip, step. The gradient norm is
    summed over the pipeline group (each stage holds different parameters).
    """
    loss = pipeline.forward_backward(batch)
    for chunk in pipeline.chunks:
        chunk.finish_gradient_synchronization()
    params = [p for chunk in pipeline.chunks for p in chunk.parameters()]
    grad_norm, skipped = clip_and_step(optimizer, params, replace(settings, norm_groups=(pipeline.pp_group,)))
    for chunk in pipeline.chunks:
        chunk.zero_grad(set_to_none=False)
    # Only the last stage computed the loss, each data-parallel rank its own tokens' share: sums
    # over the pipeline and the chunks' gradient-reduction group give every rank the global loss.
    comm.call(dist.all_reduce, loss, group=pipeline.pp_group)
    comm.call(dist.all_reduce, loss, group=pipeline.chunks[0].dp_group)
    return StepResult(loss, grad_norm, skipped=skipped)


@torch.no_grad()
def evaluate(pipeline: Pipeline, batch: StepBatch, settings: StepSettings) -> float:
    """The global batch's mean loss without gradients: train_step's loss, by a forward-only pass
    through the stages (activations still travel point to point, no gradient comes back)."""
    for chunk in pipeline.chunks:
        chunk.eval()
    loss = pipeline.forward_only(batch)
    for chunk in pipeline.chunks:
        chunk.train()
    comm.call(dist.all_reduce, loss, group=pipeline.pp_group)
    comm.call(dist.all_reduce, loss, group=pipeline.chunks[0].dp_group)
    return loss.item()


# ============================================================================ the technique: with data parallelism


def build_model_chunks(cfg, seed: int, grid, device, virtual_stages: int = 1,
                       bucket_bytes: int | None = None) -> list[nn.Module]:
    """This rank's chunks with the reference's weights, each wrapped for data parallelism (lesson 01):
    the rank's dp peers hold the same stage of the other pipelines."""
    chunks = build_stage_chunks(cfg, seed, grid.pp_size, grid.pp_rank, virtual_stages)
    return [data_parallel.BucketedDataParallel(chunk.to(device), grid.dp_group, bucket_bytes) for chunk in chunks]


def activation_shape(cfg, shape) -> tuple[int, int, int]:
    """The tensor crossing every stage boundary: one micro-batch's hidden states, [b, s, h]."""
    return (shape.micro_batch_size, shape.seq_len, cfg.hidden)


# ============================================================================ configuration rules


def validate_pipeline_config(grid: GridShape, world_size: int, cfg, schedule: str, virtual_stages: int,
                             n_micro: int, n_micro_source: str = "--micro-batches") -> None:
    """Raise one ConfigError for a pipeline that cannot run; no collective is used.

    n_micro is the micro-batch count that will run; n_micro_source says which flags gave it.
    """
    validate_parallel_config(grid, world_size)
    problems = pipeline_problems(grid, cfg, schedule, virtual_stages, n_micro, n_micro_source)
    if problems:
        raise ConfigError("bad pipeline configuration:\n  - " + "\n  - ".join(problems))
    refuse_deadlock(pipeline_programs(schedule, grid.pp, n_micro, virtual_stages), schedule, grid.pp, n_micro,
                    virtual_stages)


def pipeline_problems(grid: GridShape, cfg, schedule: str, virtual_stages: int, n_micro: int,
                      n_micro_source: str) -> list[str]:
    """Every rule the layers, the chunks and the micro-batches break for this schedule."""
    problems = []
    if grid.pp > cfg.n_layers:
        problems.append(f"--pp {grid.pp} is more pipeline stages than n_layers={cfg.n_layers}: every stage needs "
                        f"at least one layer; use --pp <= {cfg.n_layers}")
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
            problems.append(f"m = {n_micro} micro-batches ({n_micro_source}) is "
                            f"{'fewer than' if n_micro < grid.pp else 'not a multiple of'} --pp {grid.pp}: the "
                            f"interleaved schedule sends micro-batches through each chunk in groups of pp; "
                            f"use a multiple of {grid.pp}")
    return problems


def refuse_deadlock(programs: list[list], schedule: str, pp: int, n_micro: int, virtual_stages: int) -> None:
    """Simulate every rank's program; a deadlock is a ConfigError, before any rank starts."""
    try:
        simulate_pipeline(programs, virtual_stages=virtual_stages)
    except PipelineDeadlock as error:
        raise ConfigError(f"schedule {schedule} with pp={pp}, m={n_micro}, v={virtual_stages} would "
                          f"deadlock: {error}")


def pipeline_programs(schedule: str, pp: int, n_micro: int, virtual_stages: int = 1) -> list[list]:
    """Every rank's communication program, for the simulator (a rank runs only its own)."""
    return [communication_program(SCHEDULES[schedule](pp, rank, n_micro, virtual_stages), pp, rank, virtual_stages)
            for rank in range(pp)]


def micro_batch_source(args, shape, grid: GridShape) -> str:
    """The flags that gave the micro-batch count (--global-batch-tokens may have set it), for a refusal."""
    if args.global_batch_tokens is None:
        return "--micro-batches"
    return (f"--global-batch-tokens {args.global_batch_tokens} / ({shape.micro_batch_size} sequences x "
            f"{shape.seq_len} tokens x dp {grid.dp})")


def validate(cfg, grid: GridShape, shape, args, world_size: int) -> None:
    """The pipeline's rules for the micro-batch count that will run (shape.grad_accum)."""
    validate_pipeline_config(grid, world_size, cfg, args.schedule, args.virtual_stages, shape.grad_accum,
                             micro_batch_source(args, shape, grid))


# ============================================================================ measuring the three challenges


def bubble_formula(schedule: str, pp: int, n_micro: int, virtual_stages: int = 1) -> float:
    """Idle time / useful compute per stage, for stages that all take equally long."""
    return (pp - 1) / (n_micro * (virtual_stages if schedule == "interleaved" else 1))


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


def predicted_p2p_traffic(pipeline: Pipeline, n_micro: int, element_bytes: int = 4) -> dict:
    """predicted_p2p_bytes of this rank's chunks as traffic-table rows: as many bytes received as sent."""
    p2p = predicted_p2p_bytes(n_micro, pipeline.activation_shape, element_bytes, pipeline.pp, pipeline.pp_rank,
                              pipeline.virtual_stages)
    return {("isend", "pp"): p2p, ("irecv", "pp"): p2p}


def predicted_chunk_activation_bytes(stage: PipelineStage, cfg, micro_batch: int, seq_len: int) -> int:
    """The reference formula for one micro-batch of one chunk's layers (and head, on the last stage).

    The formula counts the int64 token ids (saved by the embedding) and targets (saved by the
    loss) of a whole model; only the first and the last stage hold them.
    """
    has_embedding, has_head = stage.tok_embeddings is not None, stage.lm_head is not None
    whole_model_ids = predicted_activation_bytes(cfg, micro_batch, seq_len, n_layers=len(stage.layer_ids),
                                                 with_head=has_head)
    return whole_model_ids - 8 * micro_batch * seq_len * ((not has_embedding) + (not has_head))


def stage_report_row(pipeline: Pipeline, cfg, shape, activations: ActivationMeter, steps: int) -> torch.Tensor:
    """This rank's numbers for the per-stage table: layers, micro-batches kept by the schedule,
    activation bytes at the schedule's peak and p2p bytes sent per step, each measured and predicted."""
    per_micro_batch = [predicted_chunk_activation_bytes(chunk.module, cfg, shape.micro_batch_size, shape.seq_len)
                       for chunk in pipeline.chunks]
    return torch.tensor([sum(len(chunk.module.layer_ids) for chunk in pipeline.chunks),
                         peak_live_micro_batches(pipeline.program), activations.peak_bytes,
                         peak_live_micro_batches(pipeline.program, per_micro_batch),
                         comm.meter.get("isend", "pp").payload_bytes / steps,
                         predicted_p2p_traffic(pipeline, shape.grad_accum)[("isend", "pp")]], dtype=torch.float64)


def log_bubble_formula(timelines, schedule: str, pp: int, n_micro: int, virtual_stages: int) -> None:
    """The measured bubble next to the schedule's formula."""
    formula = "(p-1)/(v*m)" if schedule == "interleaved" else "(p-1)/m"
    log0(f"bubble (idle / busy): measured {bubble_fraction(timelines):.3f}   formula {formula} = "
         f"{bubble_formula(schedule, pp, n_micro, virtual_stages):.3f}   "
         f"(the formula assumes equal stages, each on its own core)")


def report(run: MeteredRun, pipeline: Pipeline, plan, args, grid, timeline: TimelineRecorder) -> None:
    """The timeline and its bubble, every stage's activations and sends, then the shared rows of
    stage 0's rank: its memory and its traffic (p2p, its stage's gradients over dp, the loss summed
    over pp and dp, the squared norm over pp)."""
    training_traffic = copy.deepcopy(comm.meter)        # before the report's own gathers add to it
    stages = gather_stage_rows(run, pipeline, plan, grid)
    timelines = gather_timelines(timeline.events, grid.pp_group)
    log_timeline(timelines, args, grid.pp_size, plan.shape.grad_accum, pipeline.virtual_stages)
    log_bubble_formula(timelines, args.schedule, grid.pp_size, plan.shape.grad_accum, pipeline.virtual_stages)
    log_stages(run, pipeline, plan, stages, training_traffic)


def gather_stage_rows(run: MeteredRun, pipeline: Pipeline, plan, grid) -> list[torch.Tensor]:
    """Every stage's stage_report_row, on every rank of the pipeline group."""
    row = stage_report_row(pipeline, plan.cfg, plan.shape, run.activations, run.steps)
    stages = [torch.empty_like(row) for _ in range(grid.pp_size)]
    # CPU rows on purpose, after training: on CUDA the group's gloo backend carries them, not NCCL.
    comm.call(dist.all_gather, stages, row, group=grid.pp_group)
    return stages


def log_timeline(timelines, args, pp: int, n_micro: int, virtual_stages: int) -> None:
    log0(f"\n== timeline of step {step_to_meter(args)} ({args.schedule}, pp={pp}, m={n_micro}"
         + (f", v={virtual_stages}" if virtual_stages > 1 else "") + ") ==")
    log0(render_timeline(timelines))
    busy_ms = [sum(end - start for _, start, end in events) * 1e3 for events in timelines]
    log0(f"busy ms per stage: {', '.join(f'{ms:.1f}' for ms in busy_ms)}")


def log_stages(run: MeteredRun, pipeline: Pipeline, plan, stages: list[torch.Tensor], training_traffic) -> None:
    """The per-stage table, then stage 0's rank's memory, traffic and compute rows."""
    cfg, pp, m, v = plan.cfg, len(stages), plan.shape.grad_accum, pipeline.virtual_stages
    log0("\n== every stage: activations at the schedule's peak; p2p sent per step (a boundary carries m "
         "activations forward and m gradients back, b x s x h each) ==")
    log0(f"{'stage':<7}{'layers':>7}{'micro-batches kept':>20}{'measured MB':>13}{'predicted MB':>14}"
         f"{'sent MB':>9}{'predicted':>11}")
    for stage, (layers, kept, *megabytes) in enumerate(r.tolist() for r in stages):
        log0(f"{stage:<7}{int(layers):>7}{int(kept):>20}" + "".join(
            f"{value / 1e6:>{width}.3f}" for value, width in zip(megabytes, (13, 14, 9, 11))))
    if v > 1:
        log0(f"(interleaved: micro-batches are counted per chunk, each 1/{v} of a stage: stage 0 keeps "
             f"{stages[0][1].item() / v:.1f} stages' worth, where 1F1B keeps {pp})")
    log_memory_rows(run, f"stage 0's rank: {run.n_params:,} of {count_parameters(cfg)['total']:,} parameters",
                    int(stages[0][3]))
    log_traffic_rows(run, "rank 0; p2p payload = what this rank sends / receives",
                     predicted_p2p_traffic(pipeline, m), loss_groups=("pp", "dp"), norm_groups=("pp",),
                     meter=training_traffic)
    log_compute_report(run)


# ============================================================================ main

SCHEDULE_HELP = ("with --pp > 1: afab, all forwards then all backwards (GPipe); 1f1b, one forward one backward; "
                 "interleaved, 1f1b over --virtual-stages chunks per rank")


def add_schedule_flags(parser) -> None:
    """--schedule and --virtual-stages (whose default needs resolve_virtual_stages after parsing)."""
    parser.add_argument("--schedule", choices=tuple(SCHEDULES), default="1f1b", help=SCHEDULE_HELP)
    add_virtual_stages_flag(parser)


def add_async_sends_flag(parser) -> None:
    parser.add_argument("--no-async-pp-sends", dest="async_pp_sends", action="store_false",
                        help="wait for each pipeline send at its own exchange, before computing on, instead of "
                             "leaving it in flight until the end of the step")


def add_virtual_stages_flag(parser) -> None:
    parser.add_argument("--virtual-stages", metavar="V", type=int, default=argparse.SUPPRESS,
                        help="model chunks per rank for --schedule interleaved (default: 2 there, else 1)")


def resolve_virtual_stages(args):
    if not hasattr(args, "virtual_stages"):
        args.virtual_stages = 2 if args.schedule == "interleaved" else 1
    return args


def add_micro_batch_flags(parser) -> None:
    """--micro-batches, this lesson's name for --grad-accum, and the shared training flags."""
    parser.add_argument("--micro-batches", dest="grad_accum", metavar="M", type=int, default=argparse.SUPPRESS,
                        help="m, micro-batches per optimizer step and data-parallel rank (same as --grad-accum)")
    add_training_flags(parser, micro_batch_size=4, grad_accum=8, steps=30)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description="Lesson 03: pipeline parallelism (run with torchrun).",
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_parallel_flags(parser, axes=("dp", "pp"), fill_axis="pp")
    add_schedule_flags(parser)
    add_async_sends_flag(parser)
    add_micro_batch_flags(parser)
    return resolve_virtual_stages(parser.parse_args(argv))


def log_header(args, plan, grid) -> None:
    shape = plan.shape
    log0(f"lesson 03: pipeline parallel, {args.schedule}, {plan.grid.picture().splitlines()[0]}, "
         f"{count_parameters(plan.cfg)['total']:,} parameters, {shape.tokens_per_step:,} tokens per step "
         f"({shape.micro_batch_size} x {shape.seq_len} x {shape.grad_accum} micro-batches x {grid.dp_size} dp)")


def main(argv=None):
    args = parse_args(argv)
    plan = plan_run(args, validate)
    device = init_distributed()
    grid = ProcessGrid(plan.grid)
    cfg, shape = plan.cfg, plan.shape
    chunks = build_model_chunks(cfg, args.seed, grid, device, args.virtual_stages,
                                bucket_bytes_from_flags(args, device))
    modules = nn.ModuleList(chunk.module for chunk in chunks)      # what the rank holds, unwrapped
    compute_dtype = autocast_dtype(args.dtype, device)
    pipeline = Pipeline(chunks, grid, args.schedule, shape.grad_accum, args.virtual_stages,
                        activation_shape(cfg, shape), device, compute_dtype, args.async_pp_sends)
    optimizer = build_optimizer(modules, args.lr)
    settings = StepSettings(device, compute_dtype, args.max_grad_norm, tail=args.step_tail)
    log_header(args, plan, grid)

    # Both observe a late step from outside: the saved-tensor hooks and Python's profiler hook on
    # the pipeline's forward_step / backward_step.
    activations, timeline = ActivationMeter(*pipeline.chunks), TimelineRecorder(pipeline, grid.pp_group, device)
    batches = RankBatches(plan.batches, grid.dp_rank, device, val=plan.val_batches)    # this rank's share
    throughput = train(args, optimizer, partial(train_step, pipeline, optimizer, settings=settings), batches,
                       evaluate=partial(evaluate, pipeline, settings=settings),
                       meters=StepMeters((activations, timeline), step=step_to_meter(args)), cfg=cfg)
    report(MeteredRun(modules, optimizer, activations, throughput, cfg, shape.seq_len, grid.shape.world_size,
                      device, throughput.steps), pipeline, plan, args, grid, timeline)
    shutdown()


if __name__ == "__main__":
    main()
