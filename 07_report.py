"""
Lesson 07's measurement: the three challenges of the composed run, each measured next to its
prediction, and the formulas those predictions add up (07_memory_plan.py predicts with the same
ones before launch).

    memory      the activations kept for backward at their peak in the metered step, measured for
                the run's --recompute and predicted for every mode; lesson 06's model states over
                ZeRO's dense and expert units; ZeRO-3's gathered weights; the first steps' bytes
    traffic     every lesson's collectives per step, each lesson's formula added up once
                (predicted_step_traffic), next to what comm's meter counted
    compute     tokens/s and, on CUDA, MFU (FP8's attainable peak with --fp8)

Each observes the run from outside: saved-tensor hooks, the routing meter, the optimizer's step
hooks, comm's meter. Nothing here changes what the run computes.
"""

from __future__ import annotations

import copy
import itertools
from dataclasses import astuple, dataclass, field, replace
from functools import partial

import torch

from picotron_like import comm
from picotron_like.lessons import load_lesson
from picotron_like.metrics import (ActivationMeter, CallObserver, GatheredParameterMeter, MeteredRun, ModelStates,
                                   RoutedCall, RoutingMeter, SavedTensorMeters, add_traffic, log0, log_compute_report,
                                   predicted_activation_bytes, step_bookkeeping_traffic)
from picotron_like.pipeline_tools import is_transfer_batch, peak_live_micro_batches
from picotron_like.topology import ProcessGrid
from picotron_like.train import traffic_not_counted

tensor_parallel = load_lesson("02_tensor_parallel")
pipeline_parallel = load_lesson("03_pipeline_parallel")
context_parallel = load_lesson("04_context_parallel")
expert_parallel = load_lesson("05_expert_parallel")
zero = load_lesson("06_zero")
zero_muon = load_lesson("06_zero_muon")
zero_offload = load_lesson("06_zero_offload")
fp8 = load_lesson("07_fp8")
activation_offload = load_lesson("07_activation_offload")

RECOMPUTE_MODES = ("none", "selective", "full")

# ============================================================================ the composition as the formulas see one rank


def attention_of_one_rank(cfg, tp: int, n_layers: int):
    """Attention as one rank of a tp x pp layout holds it, for lesson 04's formulas: its n_layers
    layers, n_heads / tp heads and n_kv_heads / tp kv-heads of the same head_dim (hidden / tp
    keeps it). Lesson 04 counts the attention of the model it is given."""
    return replace(cfg, hidden=cfg.hidden // tp, n_heads=cfg.n_heads // tp, n_kv_heads=cfg.n_kv_heads // tp,
                   n_layers=n_layers)


def experts_per_tp_rank(cfg, tp: int):
    """The experts as one tp rank holds them: every expert's inner width ffn_hidden / tp (a shared
    expert's too). Lesson 05's formulas and its grouped-matmul check read them from this config."""
    return replace(cfg, ffn_hidden=cfg.ffn_hidden // tp)


def uses_grouped_experts(args, cfg, tp: int, dtype, device, capability=None) -> bool:
    """--grouped-mm where lesson 05's grouped matmul runs fast for the experts as a tp rank holds
    them: what the model is built with, and what the report and the memory plan (for its GPU) predict with."""
    return bool(cfg.n_experts) and args.grouped_mm and expert_parallel.grouped_mm_fits(
        experts_per_tp_rank(cfg, tp), dtype, device, capability)


def model_parts(model, pipeline) -> list[torch.nn.Module]:
    """What the routing meters and lesson 05's formulas take as a rank's parts: with a pipeline its chunks
    (each PipelineChunk's .module one stage of lesson 03), else the model."""
    return list(pipeline.chunks) if pipeline is not None else [model]



# ============================================================================ measuring the three challenges


def predicted_kept_activation_bytes(cfg, micro_batch: int, seq_len: int, recompute: str, tp: int = 1,
                                    sequence_parallel: bool = False, cp: int = 1, stage=None,
                                    compute_dtype: torch.dtype = torch.float32) -> int:
    """One micro-batch of this rank's model, or of its pipeline stage `stage`, with dense MLPs (a
    model with experts: lesson 05 then swaps each MoE layer's SwiGLU for its routed bytes).

    --recompute none is the earlier lessons' float32 formula (dense_activation_bytes: 03's for a
    stage, 02's, or the reference's, over the S/cp tokens of a cp rank). Its difference between two
    layers and one is one block; the rest (embedding ids, rotary tables, head) no mode changes. Per block and token, in
    elements, with T_n the tokens a norm sees (/tp under sequence parallelism):
      none       the earlier formula's block
      selective  that, less each norm's 1/rms and normalised copy (2 (h + 1) per T_n) and
                 silu(gate) (f / tp; with experts the shared expert's, f_shared / tp)
      full       the block's input, h per T_n
    In the compute dtype e (2 bytes under bf16) autograd keeps every such element in e bytes but
    those computed in float32 on purpose: a norm's float32 input copy, 1/rms and normalised copy
    (2h + 1; under selective the norm keeps its input itself, in e) and attention's log-sum-exp
    (n_heads / tp per token). Outside the blocks only the head's matmul input is in e."""
    h, e = cfg.hidden, compute_dtype.itemsize
    tokens = micro_batch * seq_len // cp
    norm_tokens = tokens // tp if sequence_parallel else tokens
    swiglu_inner = (cfg.n_shared_experts if cfg.n_experts else 1) * cfg.ffn_hidden // tp
    layers = cfg.n_layers if stage is None else len(stage.layer_ids)

    def none(cfg, stage=None):
        return dense_activation_bytes(cfg, micro_batch, seq_len, cp, tp, stage, sequence_parallel)

    block = none(replace(cfg, n_layers=2)) - none(replace(cfg, n_layers=1))
    outside = none(cfg, stage) - layers * block
    if stage is None or stage.lm_head is not None:
        outside -= (4 - e) * h * norm_tokens
    log_sum_exp = cfg.n_heads // tp * tokens
    elements, in_float32 = {
        "none": (block // 4, 2 * (2 * h + 1) * norm_tokens + log_sum_exp),
        "selective": (block // 4 - 2 * (h + 1) * norm_tokens - swiglu_inner * tokens, log_sum_exp),
        "full": (h * norm_tokens, 0)}[recompute]
    return outside + layers * (e * elements + (4 - e) * in_float32)


def offloaded_activation_bytes(cfg, micro_batch: int, seq_len: int, recompute: str, tp: int = 1,
                               sequence_parallel: bool = False, cp: int = 1, stage=None,
                               compute_dtype: torch.dtype = torch.float32, offloaded: int = 0) -> tuple[int, int]:
    """(the bytes a chunk's first `offloaded` blocks take off the device, the bytes they put in host
    memory) for one micro-batch with dense MLPs (07_activation_offload; with experts each offloaded
    MoE layer's routed bytes move too). Each block's kept bytes (predicted_kept_activation_bytes's
    block) move, and each block copies the rotary tables it saves, which leave the device only with
    the chunk's last block. A chunk that receives its input (a pipeline stage but the first's) keeps
    it where its first block saves it as it is: under recomputation (the checkpoint's input), and
    in float32, where the norm's float32 copy is the input itself."""
    if not offloaded:
        return 0, 0
    kept = partial(predicted_kept_activation_bytes, micro_batch=micro_batch, seq_len=seq_len, recompute=recompute,
                   tp=tp, sequence_parallel=sequence_parallel, cp=cp, compute_dtype=compute_dtype)
    block = kept(replace(cfg, n_layers=2)) - kept(replace(cfg, n_layers=1))
    rotary = 4 * seq_len // cp * cfg.head_dim
    layers = cfg.n_layers if stage is None else len(stage.layer_ids)
    received = stage is not None and stage.tok_embeddings is None and (recompute != "none" or
                                                                      compute_dtype == torch.float32)
    input_bytes = compute_dtype.itemsize * cfg.hidden * micro_batch * seq_len // cp // (
        tp if sequence_parallel else 1) if received else 0
    off_device = offloaded * block - input_bytes + (rotary if offloaded == layers else 0)
    return off_device, offloaded * (block + rotary) - input_bytes


def dense_activation_bytes(cfg, micro_batch: int, seq_len: int, cp: int, tp: int, stage=None,
                           sequence_parallel: bool = False) -> int:
    """One micro-batch of this rank's model or pipeline stage with a dense MLP, in float32, over
    its seq_len / cp tokens: with tp > 1 lesson 02's formula (which knows stages), else lesson 03's
    for a stage or the reference's for the whole model. Context-parallel attention, ring or
    Ulysses, keeps what the reference keeps for those tokens (lesson 04)."""
    tokens = seq_len // cp
    if tp > 1:
        return tensor_parallel.predicted_tp_activation_bytes(cfg, micro_batch, tokens, tp, sequence_parallel,
                                                             save_sequence_shard=True, stage=stage)
    if stage is not None:
        return pipeline_parallel.predicted_chunk_activation_bytes(stage, cfg, micro_batch, tokens)
    return predicted_activation_bytes(cfg, micro_batch, tokens)


def routing_at(routing, pipeline, n_micro: int, kind: str):
    """Under --recompute full every MoE layer dispatches twice per micro-batch in the metered step:
    in the forward, and again when backward recomputes its block. The meter numbers a layer's
    calls in the order they came, which is the order of its chunk's forward and backward actions
    on this rank (lesson 01: F then B for each micro-batch; with a pipeline, lesson 03's program,
    in which an interleaved rank's chunks take turns), the same in every step of a meter over
    several. Returns a copy of the meter holding the calls made at the `kind` actions ("F": the
    forwards; "B": the recomputed forwards), numbered by their micro-batch."""

    def actions(chunk: int) -> list[tuple[str, int]]:
        if pipeline is None:
            return [(action, micro_batch) for micro_batch in range(n_micro) for action in "FB"]
        return [(step.kind, step.micro_batch) for step in pipeline.program
                if not is_transfer_batch(step) and step.chunk == chunk]

    by_chunk = {chunk: actions(chunk) for chunk in set(routing.part_of)}
    kept = copy.copy(routing)
    kept.calls = []
    for call in routing.calls:
        chunk_actions = by_chunk[routing.part_of[call.layer]]
        action, micro_batch = chunk_actions[call.micro_batch % len(chunk_actions)]
        if action == kind:
            kept.calls.append(replace(call, micro_batch=micro_batch))
    return kept


def on_cuda(model) -> bool:
    """Whether this rank's model lives on a GPU, where 07_fp8's shape rule keeps small GEMMs in bf16."""
    return next(model.module.parameters()).device.type == "cuda"


def offloaded_of_chunk(chunk, args) -> int:
    """How many of a chunk's first blocks --offload activations moves to the host (0 without it)."""
    return (activation_offload.offloaded_blocks(len(chunk.layers), args.offload_blocks)
            if "activations" in args.offload else 0)


def offloaded_blocks_of(chunk, args) -> list:
    return list(chunk.layers)[:offloaded_of_chunk(chunk, args)]


def predicted_peak_kept_bytes(recompute: str, model, pipeline, cfg, shape, args, grid: ProcessGrid, routing) -> int:
    """This rank's kept activations at their peak in the metered step under `recompute`: each
    micro-batch's bytes (with experts, lesson 05's on the step's routing counts, for the experts
    as a tp rank holds them; under full a block keeps its input only, whatever the routing), then
    their peak over lesson 03's program."""

    def dense(stage, chunk):
        kept = predicted_kept_activation_bytes(cfg, shape.micro_batch_size, shape.seq_len, recompute, grid.tp_size,
                                               args.sequence_parallel, grid.cp_size, stage,
                                               model.precision.param_dtype)
        layers = cfg.n_layers if stage is None else len(stage.layer_ids)
        tokens = shape.micro_batch_size * shape.seq_len // grid.cp_size
        offloaded = offloaded_of_chunk(chunk, args)
        off_device, _ = offloaded_activation_bytes(cfg, shape.micro_batch_size, shape.seq_len, recompute, grid.tp_size,
                                                   args.sequence_parallel, grid.cp_size, stage,
                                                   model.precision.param_dtype, offloaded)
        return kept - off_device + fp8.kept_bytes_difference(
            cfg, args.fp8, tokens, grid.tp_size, model.precision.param_dtype, layers - offloaded, recompute,
            args.sequence_parallel, fp8.fp8_groups_of_run(cfg, args, tokens, grid.tp_size, on_cuda(model)))

    parts = model_parts(model, pipeline)
    sizes = {(index, micro_batch): dense(part.module if pipeline is not None else None, part.module)
             for index, part in enumerate(parts) for micro_batch in range(shape.grad_accum)}
    if cfg.n_experts and recompute != "full":     # each MoE layer's bytes over the dense formula, on its counts
        experts, dtype = experts_per_tp_rank(cfg, grid.tp_size), model.precision.param_dtype
        ep, micro = expert_parallel.ExpertParallel.from_grid(grid), shape.micro_batch_size
        grouped = uses_grouped_experts(args, cfg, grid.tp_size, dtype, model.units[0].master.device)
        on_host = {id(block.mlp) for part in parts for block in offloaded_blocks_of(part.module, args)}
        for call, sent, received in zip(routing.calls, *expert_parallel.rows_sent_and_received(routing, ep)):
            if id(routing.layers[call.layer]) not in on_host:
                sizes[(routing.part_of[call.layer], call.micro_batch)] += expert_parallel.moe_layer_bytes_over_dense(
                    experts, micro * shape.seq_len // grid.cp_size, micro, sent, received, ep.size, grouped,
                    dtype.itemsize)
        # An offloaded MoE layer's choices of its latest forward stay on the device all the same: the layer holds
        # them (last_choices, for the routing meter and the router-bias update): the top-k sort's int64 indices,
        # 8 E per token, and under a capacity the kept mask, k per token.
        held = len(on_host) * micro * shape.seq_len // grid.cp_size * (
            8 * cfg.n_experts + (cfg.experts_per_token if cfg.capacity_factor is not None else 0))
    else:
        held = 0
    # the micro-batches run one after another without a pipeline; lesson 03's program says which live at once
    if pipeline is None:
        return max(sizes.values()) + held
    return peak_live_micro_batches(pipeline.program, micro_batch_sizes=sizes) + held


def predicted_offload_link_bytes(model, pipeline, cfg, shape, args, grid: ProcessGrid, routing) -> int:
    """--offload activations: the bytes this rank's offloaded blocks copy to the host in the metered
    step, each coming back once (so as many each way): per chunk and micro-batch offloaded_activation_bytes's
    host bytes with the FP8 copies' difference of each offloaded block, and with experts each offloaded
    MoE layer's bytes over the dense formula on the step's routing."""
    micro, tokens = shape.micro_batch_size, shape.micro_batch_size * shape.seq_len // grid.cp_size
    dtype, parts, total = model.precision.param_dtype, model_parts(model, pipeline), 0
    for part in parts:
        offloaded = offloaded_of_chunk(part.module, args)
        _, host = offloaded_activation_bytes(cfg, micro, shape.seq_len, args.recompute, grid.tp_size,
                                             args.sequence_parallel, grid.cp_size,
                                             part.module if pipeline is not None else None, dtype, offloaded)
        total += shape.grad_accum * (host + fp8.kept_bytes_difference(
            cfg, args.fp8, tokens, grid.tp_size, dtype, offloaded, args.recompute, args.sequence_parallel,
            fp8.fp8_groups_of_run(cfg, args, tokens, grid.tp_size, on_cuda(model))))
    if cfg.n_experts and args.recompute != "full":
        experts, ep = experts_per_tp_rank(cfg, grid.tp_size), expert_parallel.ExpertParallel.from_grid(grid)
        grouped = uses_grouped_experts(args, cfg, grid.tp_size, dtype, model.units[0].master.device)
        on_host = {id(block.mlp) for part in parts for block in offloaded_blocks_of(part.module, args)}
        calls = zip(routing.calls, *expert_parallel.rows_sent_and_received(routing, ep))
        total += sum(expert_parallel.moe_layer_bytes_over_dense(experts, tokens, micro, sent, received, ep.size,
                                                                grouped, dtype.itemsize)
                     for call, sent, received in calls if id(routing.layers[call.layer]) in on_host)
    return total


def predicted_kept_by_mode(model, pipeline, cfg, shape, args, grid: ProcessGrid, routing) -> dict[str, int]:
    """Every mode's prediction for this run's metered step, whichever mode ran (`routing`: its
    RoutingMeter, or None without experts; under full its recomputed calls are left out)."""
    if routing is not None and args.recompute == "full":
        routing = routing_at(routing, pipeline, shape.grad_accum, "F")
    return {mode: predicted_peak_kept_bytes(mode, model, pipeline, cfg, shape, args, grid, routing)
            for mode in RECOMPUTE_MODES}


def predicted_recompute_traffic(cfg, shape, grid: ProcessGrid, n_layers: int, recompute: str, cp_mode: str,
                                sequence_parallel: bool, element_bytes: int = 4, recomputed=None,
                                steps: int = 1) -> dict:
    """Payload bytes per step that the second forward adds, each message in the weights' dtype
    (the residual stream's: `element_bytes`). selective: nothing, its checkpoints hold local
    arithmetic only (a tp norm's entry into its region stays outside). full: each block's forward
    collectives that the saved tensors need, once more per micro-batch. Non-reentrant checkpoint
    stops recomputing once the last saved tensor is rebuilt, so the block's last collective (the
    MLP's row-parallel sum, whose output nothing in the block saves) does not run again. tp: the
    attention's row-parallel output (all-reduced, or reduce-scattered with the two norms' outputs
    all-gathered under sequence parallelism); cp ring: cp - 1 K/V blocks; Ulysses: q, k, v out
    and the output back (o_proj saves its input). With experts (`recomputed`: the RoutingMeter of
    the recomputed calls of `steps` steps, routing_at's "B"; their mean per step), the MLP's
    collectives do run again, since combine saves the expert outputs that came back: every
    dispatch's forward all-to-alls, the counts, the rows out and back, (m + r) h e + 8 E, and
    under tp the experts' g, r h e (lesson 05's forward share; a shared expert's row-parallel sum
    comes after combine and does not run again), and under cp the auxiliary loss's cp sum of its
    counts, 8 E per sequence."""
    if recompute != "full":
        return {}
    runs = n_layers * shape.grad_accum
    tokens = shape.micro_batch_size * shape.seq_len // grid.cp_size
    tp, cp, d = grid.tp_size, grid.cp_size, cfg.head_dim
    extra = []
    if tp > 1:
        row = runs * tokens * cfg.hidden * element_bytes
        extra.append({("all_gather_single", "tp"): 2 * row, ("reduce_scatter_single", "tp"): row}
                     if sequence_parallel else {("all_reduce", "tp"): row})
    if cp > 1 and cp_mode == "ring":
        kv = runs * (cp - 1) * 2 * tokens * cfg.n_kv_heads // tp * d * element_bytes
        extra.append({("isend", "cp"): kv, ("irecv", "cp"): kv})
    elif cp > 1:
        extra.append({("all_to_all_single", "cp"):
                      runs * tokens * (2 * cfg.n_heads + 2 * cfg.n_kv_heads) // tp * d * element_bytes})
    if cp > 1 and cfg.n_experts and cfg.aux_loss_coef:     # the auxiliary loss's int64 counts per sequence
        extra.append({("all_reduce", "cp"): runs * 8 * cfg.n_experts * shape.micro_batch_size})
    if recomputed is not None:
        routed = routed_traffic(recomputed, grid, cfg.hidden, element_bytes, forward_only=True)
        extra.append({key: value / steps for key, value in routed.items()})
    return add_traffic(*extra)


def forwards_and_recompute_traffic(model, pipeline, cfg, shape, args, grid: ProcessGrid, routing,
                                   steps: int = 1) -> tuple:
    """What lesson 06's traffic prediction takes from 07's recomputation: with experts (`routing`, a
    RoutingMeter over `steps` steps, else None), the routing of the forwards (under --recompute
    full without the recomputed calls, routing_at's "F"), and predicted_recompute_traffic, per step."""
    full = routing is not None and args.recompute == "full"
    extra = predicted_recompute_traffic(cfg, shape, grid, len(model.module.layers), args.recompute, args.cp_mode,
                                        args.sequence_parallel, model.precision.param_dtype.itemsize,
                                        routing_at(routing, pipeline, shape.grad_accum, "B") if full else None, steps)
    return (routing_at(routing, pipeline, shape.grad_accum, "F") if full else routing), extra


def predicted_pipeline_traffic(pipeline, precision, n_micro: int) -> dict:
    """Lesson 03's p2p bytes of this rank's stage (boundaries in the weights' dtype), and the
    loss and norm scalars the step sums over pp."""
    if pipeline is None:
        return {}
    return add_traffic(pipeline_parallel.predicted_p2p_traffic(pipeline, n_micro, precision.param_dtype.itemsize),
                       step_bookkeeping_traffic(loss_groups=("pp",), norm_groups=("pp",)))


def predicted_inner_traffic(model, cfg, shape, grid: ProcessGrid, cp_mode: str,
                            sequence_parallel: bool, precision, routing=None, steps: int = 1):
    """What tensor, context and expert parallelism move inside this rank's layers, which ZeRO
    leaves as it is: lessons 02 and 04's formulas, with experts also lesson 05's, whose traffic
    depends on the routing: `routing` is a RoutingMeter over `steps` steps' forwards, and the
    result their mean. The formulas count a float32 residual stream; with bf16 weights the stream
    is bf16, and with experts but no meter the routing is unknown: None then, and the table shows
    '-' for those rows."""
    has_experts = bool(cfg.n_experts)
    if precision.param_dtype != torch.float32 or (has_experts and routing is None):
        return None
    module, tp = model.module, grid.tp_size
    n_layers, micro, n_micro = len(module.layers), shape.micro_batch_size, shape.grad_accum
    predicted = [context_parallel.predicted_cp_traffic(attention_of_one_rank(cfg, tp, n_layers), micro, shape.seq_len,
                                                       grid.cp_size, cp_mode, n_micro, 4)]
    if tp > 1:
        predicted.append(tensor_parallel.predicted_tp_traffic(
            cfg, micro, shape.seq_len // grid.cp_size, n_micro, tp, sequence_parallel, torch.float32,
            save_sequence_shard=True, stage=module))
    if has_experts:
        routed = routed_traffic(routing, grid, cfg.hidden, 4)
        predicted += [expert_layer_traffic(cfg, shape, grid, n_layers, torch.float32),
                      {key: value / steps for key, value in routed.items()}]
    return add_traffic(*predicted)


def routed_traffic(routing, grid: ProcessGrid, hidden: int, element_bytes: int, forward_only: bool = False) -> dict:
    """The bytes that depend on the routing, from the counts of every call `routing` recorded:
    lesson 05's all-to-all, and with tp > 1 the experts' g (r h e, forward) and f (r h float32
    gradients, backward) around the r rows this rank's experts received (tp x experts).
    `forward_only`: the forward's share (the recomputed forward): of the all-to-all, the counts and
    the m rows out and r back, (m + r) h e + 8 E, lesson 05's bytes less the backward's rows."""
    ep = expert_parallel.ExpertParallel.from_grid(grid)
    predicted = [expert_parallel.predicted_routed_traffic(routing, ep, hidden, element_bytes)]
    if not ((forward_only and ep.size > 1) or grid.tp_size > 1):
        return predicted[0]
    # the same condition on every rank: the counts' gather over ep runs on all of them or none
    sent, received = expert_parallel.rows_sent_and_received(routing, ep)
    if forward_only and ep.size > 1:
        predicted.append({("all_to_all_single", "ep"): -(sum(sent) + sum(received)) * hidden * element_bytes})
    if grid.tp_size > 1:
        predicted.append({("all_reduce", "tp"): sum(received) * hidden * (element_bytes + (0 if forward_only else 4))})
    return add_traffic(*predicted)


def expert_layer_traffic(cfg, shape, grid: ProcessGrid, n_layers: int, compute_dtype) -> dict:
    """What experts change inside the layers of a dense prediction, routing aside (routed_traffic):
    the cp sum of the auxiliary loss's int64 counts per sequence (cp x balancing), and, with tp > 1
    and no shared expert, the dense MLP's f and g taken out (an MoE layer's are its experts', or
    its shared expert's, as many as a dense MLP's)."""
    extra = []
    if grid.cp_size > 1 and cfg.aux_loss_coef:
        extra.append({("all_reduce", "cp"): 8 * cfg.n_experts * shape.micro_batch_size * n_layers * shape.grad_accum})
    if grid.tp_size > 1 and not cfg.n_shared_experts:
        rows = shape.micro_batch_size * shape.seq_len // grid.cp_size * shape.grad_accum * n_layers
        extra.append({("all_reduce", "tp"): -rows * cfg.hidden * (torch.finfo(compute_dtype).bits // 8 + 4)})
    return add_traffic(*extra)


def balancing_traffic(cfg, n_layers: int, pipelined: bool, bias_update_rate: float) -> dict:
    """Lesson 05's balancing bookkeeping over the dp x cp ranks, and the logged aux and z values
    summed over pp too when `pipelined` (each stage holds other layers)."""
    log_values = bool(cfg.aux_loss_coef) + bool(cfg.z_loss_coef)
    # Lesson 05's sums run over its ranks holding other tokens, dp; here those are the dp x cp ranks.
    over_dp_cp = {(operation, "dp_cp"): count for (operation, _), count
                  in expert_parallel.balancing_traffic(cfg, n_layers, bias_update_rate).items()}
    return add_traffic(over_dp_cp,
                       {("all_reduce", "pp"): 4 * log_values} if pipelined and log_values else {})


@dataclass(frozen=True)
class ZeroUnits:
    """ZeRO x experts in lesson 06's formulas: each module unit's dense parameters, sharded over
    the n = dp x cp ranks, and its experts', sharded over edp (ExpertUnitsOverEdp). From a built
    model (of), or in the memory plan from its unit counts; a dense model's experts are zeros.
    `muon`: the elements of Muon's matrices in this rank's shards, whose one float32 momentum
    replaces AdamW's two moments (0 under AdamW). Under a pipeline, `chunk_units`: the module
    units of each of the rank's chunks, in order (lesson 07's ZeRO-2/3 under a pipeline:
    PipelinedZeroStage2/3, whose formulas differ from lesson 06's); empty without one."""

    dense: list[int]
    experts: list[int]
    n: int
    edp: int
    muon: int = 0
    chunk_units: tuple = ()

    @classmethod
    def of(cls, model, grid: ProcessGrid, optimizer: str = "adamw") -> "ZeroUnits":
        """A built model's units: a flat unit over the model's dp x cp group is dense, one over edp
        experts; under Muon (`optimizer`), the matrices' elements its shards hold."""
        def counts(dense: bool) -> list[int]:
            return [sum(unit.numel for unit in units if (unit.group is model.dp_group) == dense)
                    for units in model.unit_groups]

        n = grid.dp_size * grid.cp_size
        muon = zero_muon.muon_elements_held(zero_muon.matrix_exchanges(model)) if optimizer == "muon" else 0
        chunks = units_per_chunk(model.module.chunks) if grid.pp_size > 1 else ()
        return cls(counts(dense=True), counts(dense=False), n, n // grid.ep_size, muon, chunks)

    def reduced_once_per_step(self, stage: int) -> bool:
        """ZeRO-2/3 under a pipeline: gradients accumulated whole and reduce-scattered once per step."""
        return stage >= 2 and bool(self.chunk_units)

    def model_states(self, stage: int, precision) -> ModelStates:
        """Between steps: under a pipeline ZeRO-2/3 hold no gradient then (whole_gradients: in the step)."""
        dense = zero.predicted_model_states(self.dense, self.n, stage, precision)
        experts = zero.predicted_model_states(self.experts, self.edp, stage, precision)
        states = ModelStates(*(a + b for a, b in zip(astuple(dense), astuple(experts))))
        states = replace(states, optimizer_states=states.optimizer_states - 4 * self.muon)
        return replace(states, gradients=0) if self.reduced_once_per_step(stage) else states

    def whole_gradients(self, stage: int, precision) -> int:
        """Under a pipeline, ZeRO-2/3's gradient buffers held whole from each unit's first gradient
        of the step to its reduction: every unit padded over its group, at the step's peak."""
        if not self.reduced_once_per_step(stage):
            return 0
        return precision.reduce_dtype.itemsize * sum(zero.padded(dense, self.n) + zero.padded(experts, self.edp)
                                                     for dense, experts in zip(self.dense, self.experts))

    def placement(self, stage: int, precision) -> tuple[ModelStates, ModelStates]:
        """Under --offload optimizer: (device side, host side), 06_zero_offload's formula on each group's
        units (under a pipeline ZeRO-2/3 hold no gradient on the device between steps, as model_states)."""
        sides = [zero_offload.predicted_placement(counts, n, stage, precision, True)
                 for counts, n in ((self.dense, self.n), (self.experts, self.edp)) if any(counts)]
        device, host = (ModelStates(*(sum(values) for values in zip(*(astuple(side[i]) for side in sides))))
                        for i in (0, 1))
        return (replace(device, gradients=0) if self.reduced_once_per_step(stage) else device), host

    def traffic(self, stage: int, precision, n_micro: int, reshard_after_forward: bool) -> dict:
        """ZeRO's collectives per step over dp x cp and, with experts, over edp. Under a pipeline,
        ZeRO-2/3 reduce-scatter once per step (g Psi, as ZeRO-1) and ZeRO-2 gathers once (p Psi);
        ZeRO-3 gathers each unit before each micro-batch's forward and backward (2 m p Psi) or,
        kept gathered through the step, once (p Psi)."""
        if not self.reduced_once_per_step(stage):
            return add_traffic(*(zero.predicted_zero_traffic(counts, n, stage, precision, n_micro,
                                                             reshard_after_forward, group)
                                 for counts, n, group in self.groups()))
        gathers = 2 * n_micro if stage == 3 and reshard_after_forward else 1
        return add_traffic(*({key: value * (gathers if key[0] == "all_gather_single" else 1)
                              for key, value in zero.predicted_zero_traffic(counts, n, 1, precision, 1, True,
                                                                            group).items()}
                             for counts, n, group in self.groups()))

    def groups(self) -> list[tuple]:
        return [(counts, n, group) for counts, n, group in ((self.dense, self.n, "dp_cp"),
                                                             (self.experts, self.edp, "edp")) if any(counts)]

    def gathered_peak(self, precision, reshard_after_forward: bool, prefetch: bool) -> int:
        """ZeRO-3 gathers a block's dense and expert units together, each padded over its own group;
        under a pipeline it prefetches within a chunk only, and kept gathered holds every unit of
        the stage."""
        unit_bytes = [(zero.padded(dense, self.n) + zero.padded(experts, self.edp)) * precision.param_dtype.itemsize
                      for dense, experts in zip(self.dense, self.experts)]
        if not reshard_after_forward:
            return sum(unit_bytes)
        bounds = list(itertools.accumulate(self.chunk_units or (len(unit_bytes),), initial=0))
        return max(zero.predicted_gathered_peak(unit_bytes[lo:hi], reshard_after_forward, prefetch)
                   for lo, hi in zip(bounds, bounds[1:]))


def units_per_chunk(chunks) -> tuple:
    """The module units (lesson 06's: embedding, blocks, head) of each of a rank's pipeline chunks."""
    return tuple(len(chunk.layers) + (chunk.tok_embeddings is not None) + (chunk.lm_head is not None)
                 for chunk in chunks)


def predicted_muon_traffic(model, grid: ProcessGrid, optimizer: str) -> dict:
    """Under Muon, per step: 06_zero_muon's two all-to-alls on each group the units shard over, and
    lesson 07's join over tp (TensorParallelMuon): each matrix this rank owns that tp split,
    all-gathered in bf16 (its payload the whole matrix)."""
    if optimizer != "muon":
        return {}
    exchanges = zero_muon.matrix_exchanges(model)
    split = {name for unit in model.units for name, param in zip(unit.names, unit.params)
             if getattr(param, "tp_split_dim", None) is not None}
    joined = sum(2 * grid.tp_size * matrix.numel for exchange in exchanges
                 for _, matrix in exchange.owned(exchange.rank) if matrix.name in split)
    return add_traffic(zero_muon.predicted_muon_traffic(exchanges),
                       {("all_gather_single", comm.group_name(grid.tp_group)): joined} if joined else {})


def predicted_step_traffic(model, pipeline, cfg, shape, args, grid: ProcessGrid,
                           precision, routing=None, steps: int = 1, inner_extra: dict | None = None) -> dict:
    """Every row of the report's traffic table, per step, each lesson's formula added up once: ZeRO's
    (06), Muon's (06_zero_muon and its tp join), the pipeline's (03), the balancing's (05) and,
    where predicted_inner_traffic predicts them (`routing` and `steps` as there), tp's, cp's and
    ep's, with `inner_extra` added to those (the recomputed forward's); else none of them."""
    # the norm's sum: over the shards of dp x cp, or at ZeRO-0 with experts over ep (each ep rank's own experts)
    norm_groups = ((("dp_cp",) if model.stage else ("ep",) if cfg.n_experts and grid.ep_size > 1 else ())
                   + (("tp",) if grid.tp_size > 1 else ()))
    predicted = add_traffic(ZeroUnits.of(model, grid).traffic(model.stage, precision, shape.grad_accum,
                                                              args.reshard_after_forward),
                            step_bookkeeping_traffic(loss_groups=("dp_cp",), norm_groups=norm_groups),
                            predicted_pipeline_traffic(pipeline, precision, shape.grad_accum),
                            balancing_traffic(cfg, len(model.module.layers), pipeline is not None,
                                              args.bias_update_rate))
    inner = predicted_inner_traffic(model, cfg, shape, grid, args.cp_mode, args.sequence_parallel, precision,
                                    routing, steps)
    muon = predicted_muon_traffic(model, grid, args.optimizer)
    if inner is None:
        return add_traffic({key: value for key, value in predicted.items() if key[1] not in ("tp", "cp", "ep")}, muon)
    tokens = shape.micro_batch_size * shape.seq_len // grid.cp_size
    fp8_traffic = fp8.predicted_fp8_traffic(cfg, args.fp8, tokens, grid.tp_size, shape.grad_accum,
                                            len(model.module.layers), args.recompute, args.sequence_parallel,
                                            grid.cp_size, fp8.fp8_groups_of_run(cfg, args, tokens, grid.tp_size,
                                                                                on_cuda(model)))
    return add_traffic(predicted, inner, inner_extra or {}, fp8_traffic, muon)


@dataclass(frozen=True)
class ComposedRun:
    """One rank's composed run as the report reads it: what parallelize built, the model and step
    shape it trains, its layout and its flags."""

    model: object
    pipeline: object
    optimizer: torch.optim.Optimizer
    cfg: object
    shape: object           # the metered step's: under a batch-size ramp, its micro-batch count
    grid: ProcessGrid
    args: object
    data: object = None     # the run's TokenBatches: each step's micro-batch count (a ramp's differ)
    first_step: int = 0     # this process's first step, the metered one


class RoutingOfEachStep(RoutingMeter):
    """Every step's routing, folded by the step as RoutingMeter's period folds it, where a step's
    calls are its own: a batch-size ramp changes a step's micro-batch count. A layer's call is
    numbered by its place in its step and kept apart by the step's count, so that routing_at finds
    its action in that count's schedule (under --recompute full: whether it was recomputed).
    `micro_batches_at(step)`: a step's count; a layer's calls walk the steps from `first_step`,
    `calls_per_micro_batch` per micro-batch (2 under full recomputation)."""

    def __init__(self, parts, micro_batches_at, calls_per_micro_batch: int, first_step: int):
        super().__init__(parts)
        self.micro_batches_at, self.calls_per_micro_batch = micro_batches_at, calls_per_micro_batch
        self._places = [(first_step, 0)] * len(self.layers)    # per layer: its step, and its calls in it

    def _record(self, index: int, counts: torch.Tensor, dropped: torch.Tensor) -> None:
        step, place = self._places[index]
        count = self.micro_batches_at(step)
        last = place + 1 == count * self.calls_per_micro_batch
        self._places[index] = (step + 1, 0) if last else (step, place + 1)
        slot = (index, count, place)
        known = self._slots.get(slot)
        self._slots[slot] = RoutedCall(index, place, counts, dropped) if known is None else replace(
            known, counts=known.counts + counts, dropped=known.dropped + dropped, n_calls=known.n_calls + 1)

    def of_count(self, count: int) -> RoutingMeter:
        """The calls of the steps of `count` micro-batches (once the meter is left)."""
        meter = copy.copy(self)
        meter.calls = [call for (_, of_count, _), call in zip(self._slots, self.calls) if of_count == count]
        return meter


class HostCopies:
    """The bytes --offload activations copies to the host while entered: observed at each call of the
    offload's to_host, whose argument is the storage's bytes (each comes back once: as many each way)."""

    def __init__(self):
        self.bytes = 0

    def copied(self, device_bytes: torch.Tensor) -> None:
        self.bytes += device_bytes.numel()


class KeptOnDevice(ActivationMeter):
    """ActivationMeter, which also sees what offloaded blocks save (07_activation_offload): autograd
    runs only the innermost saved-tensor hooks, the offload's inside a chosen block, so those tensors
    reach this meter through a CallObserver on the offload's pack. Each is counted from its save until
    its storage is freed on the device, not when the offload lets go of it: an offload that kept a
    device copy would measure as keeping it."""

    def saved_in_offloaded_block(self, tensor: torch.Tensor) -> None:
        self.count_until(tensor, tensor.untyped_storage())


@dataclass(frozen=True)
class ReportMeters:
    """What the report measures of the training steps: the kept activations and ZeRO-3's gathered
    weights of the metered step, and with experts its routing and every step's (the traffic)."""

    activations: KeptOnDevice
    gathered: GatheredParameterMeter
    routing: RoutingMeter | None = None
    every_step: RoutingOfEachStep | None = None
    offloaded: bool = False         # --offload activations: the offload's pack and copies observed (sys.setprofile)
    host_copies: HostCopies = field(default_factory=HostCopies)

    @classmethod
    def of(cls, run: ComposedRun) -> "ReportMeters":
        parts = model_parts(run.model, run.pipeline)
        # every_step folds a layer's calls by the step (its forwards per micro-batch: two under full recompute)
        routing = (RoutingMeter(parts), RoutingOfEachStep(parts, partial(micro_batches_at, run),
                                                          2 if run.args.recompute == "full" else 1, run.first_step)
                   ) if run.cfg.n_experts else (None, None)
        return cls(KeptOnDevice(run.model.module), GatheredParameterMeter(run.model.module), *routing,
                   offloaded="activations" in run.args.offload)

    def of_the_metered_step(self) -> tuple:
        """What train() enters for the metered step alone (every_step is entered around the loop); the
        saved-tensor meters see what offloaded blocks save through an observer of the offload's pack."""
        offload = activation_offload.ActivationOffload
        offloaded = CallObserver((offload.pack, offload.to_host), on_call=self._inside_the_offload)
        return (SavedTensorMeters(self.activations, self.gathered), *([offloaded] if self.offloaded else []),
                *([self.routing] if self.routing else []))

    def _inside_the_offload(self, frame) -> None:
        if frame.f_code is activation_offload.ActivationOffload.to_host.__code__:
            return self.host_copies.copied(frame.f_locals["device_bytes"])
        tensor = frame.f_locals["tensor"]
        self.activations.saved_in_offloaded_block(tensor)
        self.gathered.pack(tensor)


def report(run: ComposedRun, meters: ReportMeters, throughput, device) -> None:
    """The activations this rank keeps for backward at their peak in the metered step, measured for
    the run's --recompute and predicted for every mode (with experts on the metered step's
    routing); lesson 06's model states and ZeRO-3's gathered weights; the traffic of every
    lesson's collectives next to predicted_step_traffic (with the recomputed forward, with experts
    on every step's routing); the compute report."""
    model, pipeline, grid, args, shape = run.model, run.pipeline, run.grid, run.args, run.shape
    precision = model.precision
    with traffic_not_counted():     # the predictions' gathers of routing counts are no training traffic
        predicted = predicted_kept_by_mode(model, pipeline, run.cfg, shape, args, grid, meters.routing)
        extra, predicted_traffic = predicted_run_traffic(run, meters.every_step, throughput.steps)
    where = f"pipeline stage {grid.pp_rank} of {grid.pp_size}, " if pipeline is not None else ""
    log0(f"\n== activations kept for backward (one rank, {where}at their peak in the measured step; "
         f"compute dtype {str(precision.param_dtype).removeprefix('torch.')}) ==")
    log0(f"{'--recompute':<14}{'measured MB':>13}{'predicted MB':>14}{'saved vs none':>15}")
    for mode in RECOMPUTE_MODES:
        measured = f"{meters.activations.peak_bytes / 1e6:.3f}" if mode == args.recompute else "-"
        saved = f"{100 * (1 - predicted[mode] / predicted['none']):.1f} %" if mode != "none" else "-"
        log0(f"{mode:<14}{measured:>13}{predicted[mode] / 1e6:>14.3f}{saved:>15}")
    if meters.offloaded:
        blocks = sorted({offloaded_of_chunk(part.module, args) for part in model_parts(model, pipeline)})
        kept_all = copy.copy(args)
        kept_all.offload = [kind for kind in args.offload if kind != "activations"]
        with traffic_not_counted():
            link = predicted_offload_link_bytes(model, pipeline, run.cfg, shape, args, grid, meters.routing
                                                if args.recompute != "full" else None)
            without = predicted_kept_by_mode(model, pipeline, run.cfg, shape, kept_all, grid, meters.routing)
        chosen = ("the first block of each chunk keeps its tensors" if blocks == [1] else
                  f"the first {' or '.join(map(str, blocks))} blocks of each chunk keep theirs")
        log0(f"(--offload activations: {chosen} in host memory; the rows count what stays on the device, "
             f"{args.recompute} {without[args.recompute] / 1e6:.3f} MB predicted without the offload; copied to the "
             f"host in the measured step and back, each way: {meters.host_copies.bytes / 1e6:.3f} MB measured, "
             f"{link / 1e6:.3f} MB predicted)")
    if args.compile:
        log0("(--compile: compiled blocks keep what the compiler's partitioner chooses; the predictions are eager's)")
    if args.schedule == "zero-bubble":
        log0("(zero-bubble: measured is what autograd saves, without the inputs and output gradients waiting in "
             "the W queue; predicted counts each micro-batch whole from its F to its W, more than W keeps)")
    if extra:
        log0("the recomputed forward's collectives, in the traffic below, predicted per step"
             + (" (with experts: on every step's routing)" if meters.every_step is not None else "") + ", MB: "
             + ", ".join(f"{op} {group} {value / 1e6:.4f}" for (op, group), value in sorted(extra.items())))
    units = ZeroUnits.of(model, grid, args.optimizer)
    experts = f", experts over edp = {units.edp}" if any(units.experts) else ""
    experts += f", Muon's momentum for {units.muon:,} of its elements" if units.muon else ""
    title = (f"{where}ZeRO-{model.stage} over {units.n} ranks{experts}; weights {precision.param_dtype}, gradients "
             f"{precision.reduce_dtype}")
    peak = units.gathered_peak(precision, args.reshard_after_forward, args.prefetch)
    if isinstance(model, zero_offload.OptimizerOffload):     # --offload optimizer: each side apart
        zero_offload.log_placement(model, run.optimizer, f"{title}; optimizer offloaded to the host",
                                   units.placement(model.stage, precision), meters.gathered, peak)
    else:
        zero.log_model_states(model, run.optimizer, title, units.model_states(model.stage, precision),
                              meters.gathered, peak)
    log0(f"\n== communication per step ({counts_in_words(micro_batches_of_steps(run, throughput.steps))}) ==")
    log0(comm.meter.table(predicted_traffic, per=throughput.steps))   # fewer steps when resumed
    log_compute_report(MeteredRun(model.module, run.optimizer, meters.activations, throughput, run.cfg,
                                  shape.seq_len, grid.shape.world_size, device, throughput.steps))
    if args.fp8 != "none":
        fp8.log_fp8_compute(run.cfg, args.fp8, shape.seq_len, throughput.tokens_per_second, grid.shape.world_size,
                            device, throughput.peak_flops,
                            fp8.fp8_groups_of_run(run.cfg, args, shape.micro_batch_size * shape.seq_len // grid.cp_size,
                                                  grid.tp_size, device.type == "cuda"))


def predicted_run_traffic(run: ComposedRun, every_step: RoutingOfEachStep | None, steps: int) -> tuple[dict, dict]:
    """(the recomputed forward's traffic, every row of the traffic table), per step, over this
    process's `steps` steps: each micro-batch count the steps ran (one, unless a batch-size ramp
    grew it) predicted for its steps, on their routing (experts) and in their schedule (pipeline),
    and the mean over the steps taken. The pipeline is left following the metered step's count."""
    model, pipeline, shape = run.model, run.pipeline, run.shape
    counts, extras, predicted = micro_batches_of_steps(run, steps), {}, {}
    for count, count_steps in counts.items():
        if pipeline is not None:
            pipeline.follow_micro_batches(count)    # routing_at reads the schedule of the count
        count_shape, routing = replace(shape, grad_accum=count), every_step and every_step.of_count(count)
        forwards, extras[count] = forwards_and_recompute_traffic(model, pipeline, run.cfg, count_shape, run.args,
                                                                 run.grid, routing, count_steps)
        predicted[count] = predicted_step_traffic(model, pipeline, run.cfg, count_shape, run.args, run.grid,
                                                  model.precision, forwards, count_steps, extras[count])
    if pipeline is not None:
        pipeline.follow_micro_batches(shape.grad_accum)
    return mean_over_steps(extras, counts), mean_over_steps(predicted, counts)


def micro_batches_at(run: ComposedRun, step: int) -> int:
    """Micro-batches per rank of step `step` (a batch-size ramp's grow)."""
    return run.shape.grad_accum if run.data is None else run.data.grad_accum_at(step)


def micro_batches_of_steps(run: ComposedRun, steps: int) -> dict[int, int]:
    """{micro-batches per rank: the steps of that count} of this process's `steps` steps."""
    counts = {}
    for step in range(run.first_step, run.first_step + steps):
        count = micro_batches_at(run, step)
        counts[count] = counts.get(count, 0) + 1
    return counts


def mean_over_steps(per_count: dict[int, dict], counts: dict[int, int]) -> dict:
    """Traffic predicted per step for each micro-batch count, as the mean over the steps run
    (`counts`: micro_batches_of_steps); one count's as it is."""
    if len(counts) == 1:
        return per_count[next(iter(counts))]
    total = sum(counts.values())
    return add_traffic(*({key: value * counts[count] / total for key, value in traffic.items()}
                         for count, traffic in per_count.items()))


def counts_in_words(counts: dict[int, int]) -> str:
    """'4 micro-batches', or under a batch-size ramp the mean over steps of several counts."""
    if len(counts) == 1:
        return f"{next(iter(counts))} micro-batches"
    runs = [f"{steps} of {count}" for count, steps in sorted(counts.items())]
    return f"the mean of {sum(counts.values())} steps: {runs[0]} micro-batches, {', '.join(runs[1:])}"


class FirstStepsMemory:
    """What this rank holds after each phase of its first steps, observed from outside: the step
    function is wrapped, and a step pre-hook samples before the optimizer's step; nothing inside
    them counts. Everywhere: the bytes of the tensors the model and optimizer hold, by role
    (lesson 06's measured_model_states); on CUDA also the caching allocator's allocated bytes,
    its peak during the step, and its reserved bytes. With `snapshot` (CUDA, recording since start_memory_history), PyTorch's
    allocator history up to the end of those steps is written there, for pytorch.org/memory_viz.
    A run resumed at `first_step` numbers its rows from there; its first row holds the checkpoint."""

    def __init__(self, model, optimizer, device, n_steps: int = 3, snapshot: str | None = None, first_step: int = 0):
        self.model, self.optimizer, self.device, self.n_steps = model, optimizer, device, n_steps
        self.snapshot = snapshot if device.type == "cuda" else None
        self.first_step = first_step
        self.rows = [("built" if first_step == 0 else f"built, resumed at step {first_step}", self._sample())]
        self.steps_seen = 0
        self._before_step = optimizer.register_step_pre_hook(self._before_optimizer_step)

    def _sample(self) -> dict:
        states = zero.measured_model_states(self.model, self.optimizer)
        sample = {"parameters": states.parameters, "gradients": states.gradients, "master": states.master_weights,
                  "Adam": states.optimizer_states, "total": states.total}
        if self.device.type == "cuda":
            sample.update(allocated=torch.cuda.memory_allocated(self.device),
                          peak=torch.cuda.max_memory_allocated(self.device),
                          reserved=torch.cuda.memory_reserved(self.device))
        return sample

    def _before_optimizer_step(self, optimizer, args, kwargs) -> None:
        self.rows.append((f"step {self.first_step + self.steps_seen}: before optimizer.step", self._sample()))

    def observe(self, step_fn):
        """step_fn, sampled after each of the first n_steps steps (the snapshot written after the last)."""
        def observed(batch):
            if self.steps_seen >= self.n_steps:
                return step_fn(batch)
            if self.device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(self.device)
            result = step_fn(batch)
            self.rows.append((f"step {self.first_step + self.steps_seen}: after", self._sample()))
            self.steps_seen += 1
            if self.steps_seen == self.n_steps:
                self._before_step.remove()
                self._write_snapshot()
            return result
        return observed

    def _write_snapshot(self) -> None:
        """Write the history once and stop recording: what follows the first steps repeats them."""
        if self.snapshot:
            torch.cuda.memory._dump_snapshot(self.snapshot)
            torch.cuda.memory._record_memory_history(enabled=None)
            log0(f"allocator history written to {self.snapshot} (one file per rank; open it at "
                 f"https://pytorch.org/memory_viz)")
            self.snapshot = None

    def report(self) -> None:
        """The rows (rank 0's) and what they show; a run shorter than n_steps writes its snapshot here."""
        self._write_snapshot()
        columns = list(self.rows[0][1])
        log0("\n== memory over the first steps (rank 0, MB) ==")
        log0(f"{'phase':<34}" + "".join(f"{name:>12}" for name in columns))
        for phase, sample in self.rows:
            log0(f"{phase:<34}" + "".join(f"{sample[name] / 1e6:>12.3f}" for name in columns))
        muon = isinstance(self.optimizer, zero_muon.MuonWithAdamW)
        states, creator, per_element = (
            ("Muon's momentum and Adam's two moments (float32)", "Muon and AdamW create their", "4 (Muon's) or 8 bytes")
            if muon else ("Adam's two float32 moments", "AdamW creates its", "8 bytes"))
        adam = (f"{states} appear inside the first optimizer.step(): {creator} states "
                f"lazily, so\nuntil then a run holds {per_element} per master element less than in every later step."
                if self.first_step == 0 else
                f"{states} came back with the checkpoint, before the first step: every row holds them.")
        log0(adam + " ZeRO allocates its\ngradient buffers when it builds its units (a plain PyTorch model gets "
                    "its .grad at the first backward);\nthe per-parameter gradients autograd writes live only "
                    "until their unit is flattened and reduced.")
        if self.device.type == "cuda":
            log0("On CUDA, 'peak' is the step's high-water mark (activations included). The caching allocator "
                 "reserves\nblocks during the first step and keeps them: 'reserved' grows at step "
                 f"{self.first_step} and then stays, so the first\nstep is the one to watch for out-of-memory.")


def start_memory_history(path: str | None, device) -> str | None:
    """--memory-snapshot: start recording the allocator's history (CUDA only), before the model is
    built; one file per rank (FILE.rankN.pickle). Returns this rank's path, or None."""
    if path is None:
        return None
    if device.type != "cuda":
        log0("--memory-snapshot: the allocator history is a CUDA feature; nothing is recorded on the CPU")
        return None
    torch.cuda.memory._record_memory_history(max_entries=100_000)
    stem = path.removesuffix(".pickle")
    return f"{stem}.rank{torch.distributed.get_rank()}.pickle"
