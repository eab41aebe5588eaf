"""
Lesson 07 — the full 5D-parallel trainer: every earlier lesson in one run, and activation recomputation.

The problem. Each lesson so far fixes one limit: 01 the time (more ranks, more tokens), 02 a
layer too wide for one device, 03 a model too deep, 04 a sequence too long, 05 experts too many,
06 optimizer states too big. A real pretraining run hits all of them at once, and one more: the
activations that backward needs. With the 8b preset, 4096 tokens per sequence and one sequence
per micro-batch, the blocks save about 27 GB per micro-batch in bf16, however the weights are split.

The idea. Nothing new is parallelised here; the lessons compose, each wrapping the result of the
one before, in the order their assumptions need (parallelize() below is the plan):

    reference GPT, or this rank's pipeline stage  (03)
      -> tensor parallel layers                   (02; experts: 05's own column/row split)
      -> context-parallel attention               (04)
      -> experts sharded over ep and dispatched   (05)
      -> ZeRO over the dp x cp ranks              (06; stage 0 is lesson 01's all-reduce)
      -> activation recomputation                 (this lesson)
      -> the pipeline schedule over the stage     (03)

Activation recomputation (`--recompute full`, Chen et al. 2016). Each block's forward runs inside
torch.utils.checkpoint (non-reentrant): autograd keeps only the block's input, and backward runs
the block's forward again just before its backward. Collectives inside a block (tp's all-reduces,
cp's ring, ep's all-to-alls) run again in that second forward, in the same order on every rank.

    kept per micro-batch   none: L x (11h + 4f + n_heads + 2) per token   full: L x h per token
                           (dense, float32; /cp tokens; a block's input /tp under sequence
                           parallelism) plus, in both, the rotary tables, the embedding's ids
                           and the head's norm, logits' softmax and targets
    extra compute          one more forward of every block: about 4/3 of the blocks' FLOPs
    extra communication    the blocks' forward collectives once more per micro-batch, but the
                           last (checkpoint stops once what backward saved is rebuilt)

At its peak backward holds the kept inputs plus one recomputed block's activations.

Selective recomputation (Megatron, Korthikanti et al. 2022) is not here yet. It would keep the
matmul outputs and recompute the cheap but large parts: the two RMSNorms' normalised copies and
SwiGLU's silu(gate) and product (about 6h + 2f per token of the 11h + 4f). Megatron's classic choice,
recomputing the attention core, saves its s^2 scores and softmax; scaled_dot_product_attention
never stores those (it keeps q, k, v, the output and one log-sum-exp per row), so here it would
save n_heads elements per token and nothing more.

Out of scope: FP8, fp16 with loss scaling (bf16 needs none), zero-bubble pipeline schedules.
Not yet in this version: selective recomputation, the GPU fast paths (fused AdamW, a fused ring
block, --compile), --profile, and the activation formula under a pipeline, with experts or in bf16.

Run it:
    torchrun --nproc_per_node=4 07_full_5d.py --dp 2 --tp 2 --zero-stage 1 --recompute full
    torchrun --nproc_per_node=4 07_full_5d.py --pp 2 --cp 2 --zero-stage 1 --recompute full
    torchrun --nproc_per_node=4 07_full_5d.py --preset tiny-moe --dp 2 --cp 2 --ep 2 --zero-stage 1

What to look for: the activation line, kept bytes measured equal to the formula and the saving
against --recompute none; the traffic table, where recomputation adds the blocks' forward again.
"""

from __future__ import annotations

import argparse
from functools import partial

import torch
from torch.utils.checkpoint import checkpoint

from picotron_like.metrics import ActivationMeter, add_traffic, log0, predicted_activation_bytes
from picotron_like.model import count_parameters
from picotron_like.topology import ConfigError, ProcessGrid, init_distributed, load_lesson, shutdown
from picotron_like.train import batch_shape, plan_run, train

tensor_parallel = load_lesson("02_tensor_parallel")
context_parallel = load_lesson("04_context_parallel")
zero = load_lesson("06_zero")

RECOMPUTE_MODES = ("none", "full")

# ============================================================================ the technique: the plan


def parallelize(cfg, grid: ProcessGrid, args, device):
    """This rank's model and, with pp > 1, the pipeline that runs it, each step a lesson's own code."""
    shape = batch_shape(args, grid.dp_size)
    precision = zero.precision_from_flags(args.dtype, args.reduce_dtype, device)
    # reference GPT or its stage (03) -> tp (02; experts: 05's split) -> cp attention (04)
    # -> experts over ep (05) -> ZeRO over dp x cp (06): lesson 06's build_model composes these
    model = zero.build_model(cfg, args.seed, grid, args.zero_stage, precision, device, args.reshard_after_forward,
                             args.prefetch, args.sequence_parallel, args.cp_mode, args.zigzag,
                             shape.sequences_per_step)
    # activation recomputation, inside every wrapper's hooks (ZeRO-3's gathers stay outside it)
    apply_recompute(model.module, args.recompute)
    # the pipeline schedule over this rank's stage (03), or None
    pipeline = zero.build_pipeline(model, grid, args.schedule, shape, cfg, device, precision,
                                   args.sequence_parallel)
    return model, pipeline


# ============================================================================ the technique: activation recomputation


def recomputed_forward(forward, x, rope):
    """A block's forward under checkpoint: autograd keeps x and the rotary tables, nothing inside.
    cos and sin go in as arguments, not as a tuple, so that checkpoint saves them as tensors for
    the second forward (a tuple would be kept by reference, out of any meter's sight)."""
    cos, sin = rope
    return checkpoint(lambda x, cos, sin: forward(x, (cos, sin)), x, cos, sin, use_reentrant=False)


def apply_recompute(model: torch.nn.Module, mode: str) -> torch.nn.Module:
    """Wrap each block's own forward, not its __call__: the hooks earlier lessons put on a block
    (ZeRO-3 gathers its weights before it, frees them after, gathers them again when its output's
    gradient arrives) fire once around the checkpointed region and not again when backward
    recomputes it, by which time ZeRO-3 has gathered the weights for the backward anyway."""
    if mode == "full":
        for block in model.layers:
            block.forward = partial(recomputed_forward, block.forward)
    return model


# ============================================================================ configuration rules


def validate(cfg, grid, shape, args, world_size: int) -> None:
    """Lesson 06's rules, which include those of 01-05; recomputation adds none of its own."""
    if args.recompute not in RECOMPUTE_MODES:
        raise ConfigError(f"--recompute {args.recompute}: choose one of {', '.join(RECOMPUTE_MODES)}")
    zero.validate(cfg, grid, shape, args, world_size)


# ============================================================================ measuring the three challenges


def predicted_kept_activation_bytes(cfg, micro_batch: int, seq_len: int, recompute: str, tp: int = 1,
                                    sequence_parallel: bool = False, cp: int = 1, cp_mode: str = "ring") -> int:
    """One micro-batch's saved activations on one rank (dense, float32, no pipeline). none: lessons
    04 / 02 / 0's formulas. full: what lies outside the blocks (those formulas with no layer:
    embedding ids, head), the rotary tables once (every block's checkpoint saves the same two) and
    each block's input, b x s/cp tokens x h (/tp under sequence parallelism)."""
    s = seq_len // cp
    if recompute == "none":
        if cp > 1:
            return context_parallel.predicted_cp_activation_bytes(cfg, micro_batch, seq_len, cp, cp_mode, tp=tp,
                                                                  sequence_parallel=sequence_parallel)
        if tp > 1:
            return tensor_parallel.predicted_tp_activation_bytes(cfg, micro_batch, s, tp, sequence_parallel)
        return predicted_activation_bytes(cfg, micro_batch, s)
    if tp > 1:
        outside = tensor_parallel.predicted_tp_activation_bytes(cfg, micro_batch, s, tp, sequence_parallel, n_layers=0)
    else:
        outside = predicted_activation_bytes(cfg, micro_batch, s, n_layers=0) - 4 * s * cfg.head_dim
    block_input = micro_batch * s * cfg.hidden // (tp if sequence_parallel else 1)
    return outside + 4 * (s * cfg.head_dim + cfg.n_layers * block_input)


def predicted_recompute_traffic(cfg, shape, grid: ProcessGrid, n_layers: int, recompute: str, cp_mode: str,
                                sequence_parallel: bool) -> dict:
    """Payload bytes per step that the second forward adds (float32): each block's forward
    collectives that the saved tensors need, once more per micro-batch. Non-reentrant checkpoint
    stops recomputing once the last saved tensor is rebuilt, so the block's last collective (the
    MLP's row-parallel sum, whose output nothing in the block saves) does not run again. tp: the
    attention's row-parallel output (all-reduced, or reduce-scattered with the two norms' outputs
    all-gathered under sequence parallelism); cp ring: cp - 1 K/V blocks; Ulysses: q, k, v out
    and the output back (o_proj saves its input)."""
    if recompute == "none":
        return {}
    runs = n_layers * shape.grad_accum
    tokens = shape.micro_batch_size * shape.seq_len // grid.cp_size
    tp, cp, d = grid.tp_size, grid.cp_size, cfg.head_dim
    extra = []
    if tp > 1:
        row = runs * tokens * cfg.hidden * 4
        extra.append({("all_gather_single", "tp"): 2 * row, ("reduce_scatter_single", "tp"): row}
                     if sequence_parallel else {("all_reduce", "tp"): row})
    if cp > 1 and cp_mode == "ring":
        kv = runs * (cp - 1) * 2 * tokens * cfg.n_kv_heads // tp * d * 4
        extra.append({("isend", "cp"): kv, ("irecv", "cp"): kv})
    elif cp > 1:
        extra.append({("all_to_all_single", "cp"): runs * tokens * (2 * cfg.n_heads + 2 * cfg.n_kv_heads) // tp * d * 4})
    return add_traffic(*extra)


def report(model, pipeline, optimizer, plan, args, grid: ProcessGrid, activations: ActivationMeter, gathered,
           throughput, device) -> None:
    """The activations one micro-batch keeps under --recompute, then lesson 06's report (model
    states, ZeRO-3's gathered weights, traffic with the recomputed forward, compute)."""
    precision = model.precision
    shape, tp, sp = plan.shape, grid.tp_size, args.sequence_parallel
    log0(f"\n== activations (one rank, one micro-batch, --recompute {args.recompute}) ==")
    # The formula covers what it can predict exactly: a dense float32 model without a pipeline.
    # Both meters are saved-tensor hooks, of which only the innermost sees anything: ZeRO-3's run
    # measures its gathered weights (which autograd keeps too, so they would read as activations).
    if args.zero_stage == 3:
        log0("not measured under ZeRO-3 (its step measures the gathered weights)")
    elif pipeline is None and not plan.cfg.n_experts and precision.param_dtype == torch.float32:
        predicted = {mode: predicted_kept_activation_bytes(plan.cfg, shape.micro_batch_size, shape.seq_len, mode, tp,
                                                           sp, grid.cp_size, args.cp_mode) for mode in RECOMPUTE_MODES}
        log0(f"kept for backward: {activations.peak_bytes / 1e6:.3f} MB measured, "
             f"{predicted[args.recompute] / 1e6:.3f} MB predicted; --recompute none {predicted['none'] / 1e6:.3f} MB, "
             f"full {predicted['full'] / 1e6:.3f} MB: {predicted['none'] / predicted['full']:.1f}x less kept")
    else:
        log0(f"kept for backward: {activations.peak_bytes / 1e6:.3f} MB measured (the formula covers dense float32 "
             f"runs without a pipeline)")
    extra = predicted_recompute_traffic(plan.cfg, shape, grid, len(model.module.layers), args.recompute,
                                        args.cp_mode, sp)
    zero.report(model, pipeline, optimizer, plan, args, grid, precision, gathered, throughput, device,
                inner_extra=extra)


# ============================================================================ main


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description="Lesson 07: the full 5D-parallel trainer (run with torchrun).",
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    zero.add_flags(parser)
    parser.add_argument("--recompute", choices=RECOMPUTE_MODES, default="none",
                        help="full: keep only each block's input and run its forward again in backward")
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    plan = plan_run(args, validate)
    device = init_distributed()
    grid = ProcessGrid(plan.grid, ep=zero.expert_degree(args.ep, plan.cfg, plan.grid))
    model, pipeline = parallelize(plan.cfg, grid, args, device)
    optimizer = zero.build_sharded_optimizer(model, args.lr)
    settings = zero.step_settings(grid, device, model.precision, args.max_grad_norm)
    log0(f"lesson 07: dp={grid.dp_size} x pp={grid.pp_size} x cp={grid.cp_size} x tp={grid.tp_size}, "
         f"ep={grid.ep_size}, ZeRO-{args.zero_stage}, recompute {args.recompute}, "
         f"{count_parameters(plan.cfg)['total']:,} parameters, {plan.shape.tokens_per_step:,} tokens per step")
    activations, gathered = ActivationMeter(model.module), zero.GatheredParameterMeter(model.module)
    step = partial(zero.train_step, model if pipeline is None else pipeline, optimizer, settings=settings)
    throughput = train(args, optimizer, step, plan.batches, grid.dp_rank, device,
                       prepare_batch=context_parallel.sequence_cut(grid, args.zigzag),
                       meters=(gathered if args.zero_stage == 3 else activations,))
    report(model, pipeline, optimizer, plan, args, grid, activations, gathered, throughput, device)
    shutdown()


if __name__ == "__main__":
    main()
