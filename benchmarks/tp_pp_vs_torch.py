"""
Lesson 02's tensor parallelism and lesson 03's pipeline against PyTorch's own, in one torchrun run.

    torchrun --standalone --nproc_per_node=2 benchmarks/tp_pp_vs_torch.py                 # ~1 min on 2 cores
    torchrun --standalone --nproc_per_node=2 benchmarks/tp_pp_vs_torch.py --seq-len 256 --repeats 3
    torchrun --standalone --nproc_per_node=4 benchmarks/tp_pp_vs_torch.py --n-kv-heads 4 --micro-batches 8
    torchrun --standalone --nproc_per_node=2 benchmarks/tp_pp_vs_torch.py --only tp --profile

tp = pp = the world size. Every variant trains the same reference GPT (same preset, seed and initial
weights) on the same micro-batches of the same steps, with the same loss: each micro-batch adds its
summed token losses divided by the global batch's target count (StepBatch.n_targets), so a step's
loss is the token-weighted mean over the batch. The script checks that the variants of a pair
report the same loss before it times them.

What each side shards:
  tensor parallel, ours       lesson 02's apply_tensor_parallel, sequence_parallel=False: q/k/v/gate/up
                              column-parallel, o_proj/down row-parallel, the embedding split by
                              vocabulary (masked lookup + all-reduce), the LM head column-parallel
                              with the vocab-parallel cross-entropy (3 all-reduces of b*s floats);
                              norms replicated.
  tensor parallel, torch      torch.distributed.tensor.parallel.parallelize_module on a DeviceMesh
                              over the same gloo group, the same cut: ColwiseParallel for
                              q/k/v/gate/up, RowwiseParallel for o_proj/down, RowwiseParallel
                              (vocabulary-split rows, replicated output) for the embedding,
                              ColwiseParallel with Shard(-1) logits for the LM head and the loss
                              under loss_parallel(); norms replicated. Like with like.
  torch, blocks only          the plan of tests/test_tensor_parallel.py: the blocks as above, the
                              embedding, final norm and LM head replicated and computed whole on every
                              rank (no head or loss collectives, tp times the head's FLOPs).
                              Printed for reference; its ratio is not like with like.
  pipeline, ours              lesson 03's build_stage_chunks (contiguous layer ranges, the first
                              stage with the embedding, the last with the norm, head and loss), each
                              chunk in lesson 01's BucketedDataParallel over a data-parallel group
                              of one rank (what lesson 03 runs with --dp 1), Pipeline with the
                              "1f1b" or "afab" schedule; forward_backward + finish_gradient_synchronization.
  pipeline, torch             the same stage modules (the last one returning logits, the loss in
                              the schedule's loss_fn) in torch.distributed.pipelining.PipelineStage,
                              run by Schedule1F1B or ScheduleGPipe (= AFAB), scale_grads=False
                              (the loss is already divided by the global target count).

What is timed: one optimizer step's forward and backward passes over all micro-batches, with
gradients zeroed at its start (ours pipeline: the wrappers' finish_gradient_synchronization too);
no gradient clipping and no optimizer step, on either side. They are not what is being compared,
and would add costs of their own (AdamW over DTensor parameters pays DTensor's dispatch on every
tensor; this script does not measure that). The loss check's
step and `--warmup` more steps run first and are not timed (torch's pipeline infers shapes on its
first step, DTensor caches its sharding decisions).
Then, `--repeats` times, every variant in turn: barrier, `--steps` steps, barrier; the time per
step is rank 0's wall clock over that block, which includes waiting for the slowest rank. The
variants take turns so that a change in the machine's load hits all of them alike; the figure
printed is the median over the repetitions, with the fastest and slowest repetition. Ratio =
ours / torch (below 1: ours is faster). A second column sums the CPU time of a step over the ranks
(all threads, gloo's included; time spent waiting for a neighbour costs none): the work each side
does, far less disturbed by other jobs on the machine than the wall clock.

--profile adds, on rank 0, torch.profiler's top operators for one more step of each variant.
"""

import argparse
import os
import statistics
import time
from contextlib import nullcontext

import torch
import torch.distributed as dist
from torch import nn

from picotron_like import comm
from picotron_like.data import BatchShape, TokenBatches, builtin_corpus_paths
from picotron_like.lessons import load_lesson
from picotron_like.loss import cross_entropy_loss
from picotron_like.metrics import log0
from picotron_like.model import GPT, get_config
from picotron_like.topology import GridShape, ProcessGrid, init_distributed, shutdown

data_parallel = load_lesson("01_data_parallel")
tensor_parallel = load_lesson("02_tensor_parallel")
pipeline_parallel = load_lesson("03_pipeline_parallel")

SEED = 0


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="tiny", help="model shape from picotron_like.model.PRESETS")
    parser.add_argument("--n-layers", type=int, default=None,
                        help="override the preset's number of layers (at least the world size, for the pipeline)")
    parser.add_argument("--n-kv-heads", type=int, default=None,
                        help="override the preset's key/value heads (tp must divide them: tiny has 2, so "
                             "tp = 4 needs --n-kv-heads 4)")
    parser.add_argument("--seq-len", type=int, default=128, help="tokens per sequence")
    parser.add_argument("--micro-batch-size", type=int, default=4, help="sequences per micro-batch")
    parser.add_argument("--micro-batches", type=int, default=4, help="micro-batches per step")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps per variant before timing")
    parser.add_argument("--steps", type=int, default=2, help="timed steps per variant and repetition")
    parser.add_argument("--repeats", type=int, default=5, help="repetitions; the median is reported")
    parser.add_argument("--only", choices=("tp", "pp"), default=None, help="run one of the two comparisons")
    parser.add_argument("--profile", action="store_true",
                        help="print torch.profiler's top operators for one step of each variant (rank 0)")
    return parser.parse_args()


def gradients_to_none(module: nn.Module) -> None:
    for param in module.parameters():
        param.grad = None


# ----------------------------------------------------------------------------- tensor parallel


def ours_tensor_parallel(cfg, tp_group):
    model = tensor_parallel.apply_tensor_parallel(GPT(cfg, seed=SEED), tp_group, sequence_parallel=False)

    def step(batch):
        gradients_to_none(model)
        loss = torch.zeros(())
        for inputs, targets in batch.micro_batches:
            micro_loss = model(inputs, targets, reduction="sum") / batch.n_targets
            micro_loss.backward()
            loss += micro_loss.detach()
        return loss
    return step


def torch_tensor_parallel(cfg, tp_group, shard_embedding_and_head: bool):
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel, loss_parallel,
                                                   parallelize_module)

    model = GPT(cfg, seed=SEED)
    mesh = DeviceMesh.from_group(comm.process_group(tp_group), "cpu", mesh_dim_names=("tp",))
    plan = {}
    for index in range(cfg.n_layers):
        for name in ("attn.q_proj", "attn.k_proj", "attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
            plan[f"layers.{index}.{name}"] = ColwiseParallel()
        for name in ("attn.o_proj", "mlp.down_proj"):
            plan[f"layers.{index}.{name}"] = RowwiseParallel()
    if shard_embedding_and_head:
        plan["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate())
        plan["lm_head"] = ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)
    parallelize_module(model, mesh, plan)
    # loss_parallel: F.cross_entropy on logits sharded by vocabulary, forward and backward.
    loss_context = loss_parallel if shard_embedding_and_head else nullcontext

    def step(batch):
        gradients_to_none(model)
        loss = torch.zeros(())
        for inputs, targets in batch.micro_batches:
            with loss_context():
                # the logits, then the loss: loss_parallel hooks F.cross_entropy, which the model's own
                # chunked loss (inside its LM head) does not call
                micro_loss = cross_entropy_loss(model(inputs), targets, reduction="sum") / batch.n_targets
                micro_loss.backward()
            micro_loss = micro_loss.detach()
            loss += micro_loss.full_tensor() if hasattr(micro_loss, "full_tensor") else micro_loss
        return loss
    return step


# ----------------------------------------------------------------------------- pipeline parallel


def ours_pipeline(cfg, grid, schedule: str, shape: BatchShape):
    # One 25 MB bucket holds a tiny stage's gradients: one all-reduce on the one-rank data-parallel
    # group per step, the least lesson 03 does with --dp 1.
    chunks = [data_parallel.BucketedDataParallel(chunk, grid.dp_group, 25 * 2**20)
              for chunk in pipeline_parallel.build_stage_chunks(cfg, SEED, grid.pp_size, grid.pp_rank)]
    pipeline = pipeline_parallel.Pipeline(chunks, grid, schedule, shape.grad_accum, 1,
                                          (shape.micro_batch_size, shape.seq_len, cfg.hidden), torch.device("cpu"))
    return pipeline_step(pipeline)


def pipeline_step(pipeline):
    """One forward and backward of every micro-batch through lesson 03's pipeline, its chunks'
    gradient reductions waited for; no optimizer step (the timing compares schedules)."""
    def step(batch):
        for chunk in pipeline.chunks:
            chunk.zero_grad()
        loss = pipeline.forward_backward(batch)
        for chunk in pipeline.chunks:
            chunk.finish_gradient_synchronization()
        return loss.detach()
    return step


class LogitsStage(nn.Module):
    """A lesson-03 stage as torch.distributed.pipelining wants it: one input in, and out of the
    last stage the logits (the schedule's loss_fn computes the loss)."""

    def __init__(self, stage, seq_len: int):
        super().__init__()
        self.stage = stage
        self.register_buffer("positions", torch.arange(seq_len), persistent=False)

    def forward(self, x):
        return self.stage(x, None, self.positions)


def torch_pipeline(cfg, grid, schedule_class, shape: BatchShape):
    from torch.distributed.pipelining import PipelineStage

    (chunk,) = pipeline_parallel.build_stage_chunks(cfg, SEED, grid.pp_size, grid.pp_rank)
    stage = PipelineStage(LogitsStage(chunk, shape.seq_len), grid.pp_rank, grid.pp_size, torch.device("cpu"),
                          group=comm.process_group(grid.pp_group))
    n_targets = [0]  # the current step's global target count, read by loss_fn

    def loss_fn(logits, targets):
        return cross_entropy_loss(logits, targets, reduction="sum") / n_targets[0]

    schedule = schedule_class(stage, shape.grad_accum, loss_fn=loss_fn, scale_grads=False)

    def step(batch):
        gradients_to_none(chunk)
        n_targets[0] = batch.n_targets
        losses = []
        if grid.is_first_stage:
            schedule.step(torch.cat([inputs for inputs, _ in batch.micro_batches]))
        elif grid.is_last_stage:
            schedule.step(target=torch.cat([targets for _, targets in batch.micro_batches]), losses=losses)
        else:
            schedule.step()
        return torch.stack(losses).sum().detach() if losses else torch.zeros(())
    return step


# ----------------------------------------------------------------------------- timing


def global_loss(step_fn, batch, group, replicated: bool) -> float:
    """The step's loss as the whole group sees it: one rank's copy (tp), or the sum over stages (pp)."""
    loss, group = step_fn(batch).reshape(1).clone(), comm.process_group(group)
    if replicated and dist.get_rank(group) != 0:
        loss.zero_()
    dist.all_reduce(loss, group=group)
    return loss.item()


def time_variants(variants: dict, batches: TokenBatches, args) -> dict[str, dict[str, float]]:
    """Per variant, seconds per step: the median wall clock over the repetitions (with its min and
    max), and the median CPU time of a step summed over the ranks (every thread of every process,
    gloo's included). The variants take turns within every repetition."""
    step_batches = [batches.step_batch(step, 0) for step in range(args.warmup + args.steps)]
    for step_fn in variants.values():
        for batch in step_batches[:args.warmup]:
            step_fn(batch)
    wall = {name: [] for name in variants}
    cpu = {name: [] for name in variants}
    for _ in range(args.repeats):
        for name, step_fn in variants.items():
            dist.barrier()
            start, start_cpu = time.perf_counter(), time.process_time()
            for batch in step_batches[args.warmup:]:
                step_fn(batch)
            cpu_seconds = time.process_time() - start_cpu
            dist.barrier()
            wall[name].append((time.perf_counter() - start) / args.steps)
            cpu[name].append(cpu_seconds / args.steps)
    if args.profile:
        for name, step_fn in variants.items():
            profile_step(name, step_fn, step_batches[-1])
    results = {}
    for name in variants:
        # Waiting for a neighbour costs wall time but no CPU time: the CPU column is the work itself,
        # much less disturbed than the wall clock by other jobs on the machine.
        cpu_sum = torch.tensor(statistics.median(cpu[name]), dtype=torch.float64)
        dist.all_reduce(cpu_sum)
        results[name] = {"median": statistics.median(wall[name]), "min": min(wall[name]), "max": max(wall[name]),
                         "cpu": cpu_sum.item()}
    return results


def profile_step(name: str, step_fn, batch) -> None:
    from torch.profiler import ProfilerActivity, profile

    dist.barrier()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step_fn(batch)
    dist.barrier()
    log0(f"\n-- profile of one step: {name} (rank 0) --")
    log0(prof.key_averages().table(sort_by="cpu_time_total", row_limit=18, max_name_column_width=60))


def compare(title: str, pairs, variants: dict, losses: dict, batches, args) -> None:
    times = time_variants(variants, batches, args)
    log0(f"\n{title}")
    log0(f"{'variant':<24} {'loss (step 0)':>13} {'ms / step':>10} {'(min - max)':>17} {'CPU ms / step, all ranks':>25}")
    for name in variants:
        t = times[name]
        spread = f"({t['min'] * 1e3:.1f} - {t['max'] * 1e3:.1f})"
        log0(f"{name:<24} {losses[name]:>13.6f} {t['median'] * 1e3:>10.1f} {spread:>17} {t['cpu'] * 1e3:>25.1f}")
    for ours, theirs in pairs:
        log0(f"ratio {ours} / {theirs}: {times[ours]['median'] / times[theirs]['median']:.3f} step time, "
             f"{times[ours]['cpu'] / times[theirs]['cpu']:.3f} CPU time")


def check_same_loss(losses: dict, pairs) -> None:
    for ours, theirs in pairs:
        # float32 sums of the same terms in a different order: agreement to 1e-5 relative
        if abs(losses[ours] - losses[theirs]) > 1e-5 * abs(losses[theirs]):
            raise RuntimeError(f"{ours} and {theirs} disagree on the loss: {losses[ours]} vs {losses[theirs]}")


def run_tensor_parallel(cfg, batches, args) -> None:
    grid = ProcessGrid(GridShape(tp=dist.get_world_size()))
    variants = {"ours (lesson 02)": ours_tensor_parallel(cfg, grid.tp_group),
                "torch (same plan)": torch_tensor_parallel(cfg, grid.tp_group, True),
                "torch (blocks only)": torch_tensor_parallel(cfg, grid.tp_group, False)}
    pairs = [("ours (lesson 02)", "torch (same plan)"), ("ours (lesson 02)", "torch (blocks only)")]
    first = batches.step_batch(0, 0)
    losses = {name: global_loss(step_fn, first, grid.tp_group, True) for name, step_fn in variants.items()}
    check_same_loss(losses, pairs)
    compare(f"tensor parallel, tp={grid.tp_size}", pairs, variants, losses, batches, args)


def run_pipeline(cfg, shape, batches, args) -> None:
    from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe

    grid = ProcessGrid(GridShape(pp=dist.get_world_size()))
    variants = {"ours 1f1b (lesson 03)": ours_pipeline(cfg, grid, "1f1b", shape),
                "torch Schedule1F1B": torch_pipeline(cfg, grid, Schedule1F1B, shape),
                "ours afab (lesson 03)": ours_pipeline(cfg, grid, "afab", shape),
                "torch ScheduleGPipe": torch_pipeline(cfg, grid, ScheduleGPipe, shape)}
    pairs = [("ours 1f1b (lesson 03)", "torch Schedule1F1B"), ("ours afab (lesson 03)", "torch ScheduleGPipe")]
    first = batches.step_batch(0, 0)
    losses = {name: global_loss(step_fn, first, grid.pp_group, False) for name, step_fn in variants.items()}
    check_same_loss(losses, pairs)
    compare(f"pipeline parallel, pp={grid.pp_size}, {shape.grad_accum} micro-batches", pairs, variants, losses,
            batches, args)


def log_load_average(when: str) -> None:
    # Ranks share the machine's cores with whatever else runs: the figures mean little without it.
    log0("load average " + when + ": " + ", ".join(f"{value:.2f}" for value in os.getloadavg()) + " (1, 5, 15 min)")


def main():
    args = parse_args()
    init_distributed()
    torch.manual_seed(SEED)
    cfg = get_config(args.preset, n_layers=args.n_layers, n_kv_heads=args.n_kv_heads)
    shape = BatchShape(args.micro_batch_size, args.seq_len, args.micro_batches, 1)
    batches = TokenBatches(builtin_corpus_paths()[0], shape, seed=SEED, vocab_size=cfg.vocab_size)
    log0(f"{dist.get_world_size()} ranks, {torch.get_num_threads()} thread(s) each; preset {args.preset}, "
         f"{cfg.n_layers} layers, hidden {cfg.hidden}, {cfg.n_heads} heads, {cfg.n_kv_heads} kv heads, "
         f"vocab {cfg.vocab_size}; {args.micro_batches} micro-batches "
         f"of {args.micro_batch_size} x {args.seq_len} tokens per step; {args.warmup} warm-up steps, "
         f"median of {args.repeats} x {args.steps} timed steps; forward + backward, no optimizer step")
    log_load_average("at the start")
    if args.only in (None, "tp"):
        run_tensor_parallel(cfg, batches, args)
    if args.only in (None, "pp"):
        run_pipeline(cfg, shape, batches, args)
    log_load_average("at the end")
    shutdown()


if __name__ == "__main__":
    main()
