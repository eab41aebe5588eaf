"""
Lesson 05's experts looped against grouped (torch._grouped_mm), and the all-to-all share of the
step, at several expert-parallel degrees in one torchrun run.

    torchrun --standalone --nproc_per_node=4 benchmarks/moe_grouped_vs_loop.py          # tiny-moe, ~1 min on 2 cores
    torchrun --standalone --nproc_per_node=4 benchmarks/moe_grouped_vs_loop.py --ep-degrees 2 4 --rounds 5
    torchrun --standalone --nproc_per_node=8 benchmarks/moe_grouped_vs_loop.py --preset tiny-moe --n-layers 8 \
        --seq-len 1024 --dtype bfloat16                                                  # on GPUs

Every flag of 05_expert_parallel.py is accepted and means what it means there (preset, batch shape,
--dp, router, balancing, --dtype; `python 05_expert_parallel.py --help`), except --ep and
--grouped-mm, which this script sets itself: the ep degrees come from --ep-degrees (default: every
power of two that divides dp and the number of experts; at world size 4, dp = 4 and ep = 1, 2, 4),
and each degree runs twice, looped experts and grouped matmuls. Each variant is the lesson's own:
its build_model, step_settings and train_step, as its main() calls them. Not included: the lesson's log line and its aux / z log all-reduce (balancing_log), which
are reporting, not training. The learning rate stays at --lr (the lesson's warm-up and decay are
irrelevant to the time of a step).

What is timed. All variants are built first. Each runs --warmup untimed steps, then, --rounds
times, every variant in turn runs --steps-per-round steps, so that a change in the machine's load
hits all of them alike. Every step: barrier, clock, the step, (CUDA: synchronize), barrier, clock;
the step time is rank 0's wall clock, which includes waiting for the slowest rank. The table shows
the median over all timed steps and the fastest and slowest step. All variants train on the same
batches in the same order; the loss of their last step is printed as a check that they did the
same work (looped and grouped at one ep agree to rounding; a different ep may differ by a routing
flip).

The all-to-all share: comm.call, through which the lesson makes every collective, is wrapped while
the variants run, and the time spent inside all_to_all_single calls on an "ep" group (the counts
exchange and the token exchanges, forward and backward) is summed per step and rank. On CUDA the
wrapper synchronizes before and after each such call, so the time is the collective's and not the
queued work before it (the lesson already waits for the counts each layer, so this adds little).
The figure is averaged over the ranks; the share is that time over the step time, median over the
steps. It is the time a rank spends in the call, waiting for its peers included: on a loaded
machine, or with unbalanced routing, waiting dominates the transfer.

The CPU column sums the CPU time of a step over the ranks (all threads, gloo's included): the work
each variant does, far less disturbed by other jobs on the machine than the wall clock.
"""

import argparse
import functools
import statistics
import time

import torch
import torch.distributed as dist

from picotron_like import comm
from picotron_like.lessons import load_lesson
from picotron_like.metrics import log0
from picotron_like.topology import ProcessGrid, init_distributed, shutdown
from picotron_like.train import autocast_dtype, bucket_bytes_from_flags, build_optimizer, plan_run

lesson = load_lesson("05_expert_parallel")


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ep-degrees", type=int, nargs="+", default=None,
                        help="expert-parallel degrees to compare; default: powers of two dividing dp and E")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per variant")
    parser.add_argument("--steps-per-round", type=int, default=3, help="timed steps per variant and round")
    parser.add_argument("--rounds", type=int, default=3, help="rounds; each runs every variant in turn")
    bench, lesson_argv = parser.parse_known_args()
    return bench, lesson.parse_args(lesson_argv)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class AllToAllTimer:
    """Wraps comm.call while entered: seconds spent inside all_to_all_single on an "ep" group."""

    def __init__(self, device: torch.device):
        self.device, self.seconds = device, 0.0

    def __enter__(self):
        self._call, comm.call = comm.call, self._timed
        return self

    def __exit__(self, *exc):
        comm.call = self._call
        return False

    def _timed(self, collective, *args, **kwargs):
        if collective is not dist.all_to_all_single or comm.group_name(kwargs.get("group")) != "ep":
            return self._call(collective, *args, **kwargs)
        synchronize(self.device)
        start = time.perf_counter()
        result = self._call(collective, *args, **kwargs)
        synchronize(self.device)
        self.seconds += time.perf_counter() - start
        return result


class Variant:
    """One ep degree with looped or grouped experts, built as lesson 05's main() builds it."""

    def __init__(self, plan, grid: ProcessGrid, grouped: bool, device, compute_dtype, args):
        self.ep, self.grouped, self.grid = grid.ep_size, grouped, grid
        self.batches, self.next_step = plan.batches, 0
        cfg, shape = plan.cfg, plan.shape
        run_experts = lesson.grouped_experts if grouped else lesson.looped_experts
        model = lesson.build_model(cfg, args.seed, grid, device, run_experts, shape.sequences_per_step,
                                   bucket_bytes_from_flags(args, device))
        optimizer = build_optimizer(model.module, args.lr)
        settings = lesson.step_settings(model, grid, device, compute_dtype, args.max_grad_norm)
        self.step_fn = functools.partial(lesson.train_step, model, optimizer, settings=settings,
                                         bias_update_rate=args.bias_update_rate)
        self.wall, self.cpu, self.all_to_all, self.loss = [], [], [], None

    def run(self, steps: int, timer: AllToAllTimer, device, record: bool = True) -> None:
        for _ in range(steps):
            batch = self.batches.step_batch(self.next_step, self.grid.dp_rank)
            self.next_step += 1
            dist.barrier()
            timer.seconds, wall, cpu = 0.0, time.perf_counter(), time.process_time()
            self.loss = self.step_fn(batch).loss
            synchronize(device)
            cpu = time.process_time() - cpu
            dist.barrier()
            if record:
                self.wall.append(time.perf_counter() - wall)
                self.cpu.append(cpu)
                self.all_to_all.append(timer.seconds)

    def summary(self, world_size: int) -> dict:
        """Rank 0's wall clock; CPU time summed and all-to-all time averaged over the ranks."""
        per_rank = torch.tensor([self.cpu, self.all_to_all], dtype=torch.float64)
        dist.all_reduce(per_rank)
        cpu, all_to_all = per_rank[0].tolist(), (per_rank[1] / world_size).tolist()
        return {"wall": statistics.median(self.wall), "fastest": min(self.wall), "slowest": max(self.wall),
                "cpu": statistics.median(cpu), "all_to_all": statistics.median(all_to_all),
                "share": statistics.median(a / w for a, w in zip(all_to_all, self.wall)), "loss": self.loss}


def default_ep_degrees(plan) -> list[int]:
    ranks, degrees = plan.grid.dp, [1]
    while ranks % (degrees[-1] * 2) == 0 and plan.cfg.n_experts % (degrees[-1] * 2) == 0:
        degrees.append(degrees[-1] * 2)
    return degrees


def plans_by_ep(args, degrees) -> dict:
    """The lesson's plan_run and validate for each degree: a bad one is one error line before any group."""
    plans = {}
    for ep in degrees:
        plans[ep] = plan_run(argparse.Namespace(**{**vars(args), "ep": ep}), lesson.validate, lesson.moe_config)
    return plans


def table(rows) -> str:
    lines = [f"{'ep':>3}  {'experts':<8}{'step ms':>9}{'fastest':>9}{'slowest':>9}{'CPU ms':>9}"
             f"{'a2a ms':>9}{'a2a share':>11}{'loop/grouped':>14}{'last loss':>11}"]
    looped_wall = {}
    for variant, s in rows:
        if not variant.grouped:
            looped_wall[variant.ep] = s["wall"]
        paired = variant.grouped and variant.ep in looped_wall
        ratio = f"{looped_wall[variant.ep] / s['wall']:>14.2f}" if paired else f"{'':>14}"
        lines.append(f"{variant.ep:>3}  {'grouped' if variant.grouped else 'looped':<8}{s['wall'] * 1e3:>9.1f}"
                     f"{s['fastest'] * 1e3:>9.1f}{s['slowest'] * 1e3:>9.1f}{s['cpu'] * 1e3:>9.1f}"
                     f"{s['all_to_all'] * 1e3:>9.1f}{s['share']:>11.1%}{ratio}{s['loss']:>11.4f}")
    return "\n".join(lines)


def main():
    bench, args = parse_args()
    first = plans_by_ep(args, [1])[1]
    degrees = bench.ep_degrees or default_ep_degrees(first)
    plans = plans_by_ep(args, degrees)
    device = init_distributed()
    compute_dtype = autocast_dtype(args.dtype, device)
    cfg, shape = first.cfg, first.shape
    modes = (False, True) if lesson.grouped_mm_fits(cfg, compute_dtype, device) else (False,)
    variants = []
    for ep in degrees:
        grid = ProcessGrid(plans[ep].grid, ep=ep)
        variants += [Variant(plans[ep], grid, grouped, device, compute_dtype, args) for grouped in modes]
    timed = bench.rounds * bench.steps_per_round
    log0(f"lesson 05, {dist.get_world_size()} ranks ({plans[degrees[0]].grid}), {cfg.n_experts} experts "
         f"top-{cfg.experts_per_token}, {cfg.n_layers} layers, hidden {cfg.hidden}, ffn {cfg.ffn_hidden}, "
         f"{shape.tokens_per_step:,} tokens per step, {device.type} {str(compute_dtype).removeprefix('torch.')}, "
         f"{torch.get_num_threads()} threads per rank; ep = {degrees}; {bench.warmup} warm-up + {timed} timed "
         f"steps per variant ({bench.rounds} rounds of {bench.steps_per_round})")
    if len(modes) == 1:
        log0("torch._grouped_mm is missing, does not fit this shape or has no fast kernel for this dtype and GPU "
             "(lesson 05's grouped_mm_fits): looped only")
    with AllToAllTimer(device) as timer:
        for variant in variants:
            variant.run(bench.warmup, timer, device, record=False)
        for _ in range(bench.rounds):
            for variant in variants:
                variant.run(bench.steps_per_round, timer, device)
    rows = [(variant, variant.summary(dist.get_world_size())) for variant in variants]
    log0("\nper step: median wall ms on rank 0 (fastest, slowest), CPU ms summed over ranks, time inside the ep "
         "all-to-all calls averaged over ranks and its share of the step")
    log0(table(rows))
    shutdown()


if __name__ == "__main__":
    main()
