"""
Lesson 03's zero-bubble schedule (ZB-H1) against its 1F1B and PyTorch's own schedules, in one torchrun run.

    torchrun --standalone --nproc_per_node=2 benchmarks/zero_bubble.py                      # ~2 min on 2 cores
    torchrun --standalone --nproc_per_node=2 benchmarks/zero_bubble.py --micro-batches 8 --repeats 9

pp = the world size (2: more ranks than cores would time the machine's scheduler, not the
schedule; lesson 03's simulator shows pp = 4). For each micro-batch count m, four variants train the
same reference GPT (same preset, seed, weights, micro-batches and token-weighted loss; the script
checks that they report the same loss before timing them):

  ours 1f1b              lesson 03's Pipeline, one stage per rank, in lesson 01's wrapper over a
                         one-rank data-parallel group (what lesson 03 runs with --dp 1)
  ours zero-bubble       the same with --schedule zero-bubble: the stages' linears defer dW to W
                         (build_model_chunks), ZB-H1's order
  torch Schedule1F1B     torch.distributed.pipelining on the same stage modules (the last one
                         returning logits, the loss in the schedule's loss_fn), scale_grads=False
  torch ScheduleZBVZeroBubble  torch's zero-bubble: two stages per rank in a V (rank r holds stages
                         r and 2p-1-r of the model cut in 2p), each backward split in input and
                         weight gradients by torch's own autograd graph surgery

Timed as benchmarks/tp_pp_vs_torch.py times (its time_variants): one step's forward and backward
of all micro-batches, gradients zeroed first, no optimizer step; warm-up untimed; the variants take
turns; the median over --repeats of rank 0's wall clock, and the CPU time summed over the ranks.

The bubble: --repeats more steps of each variant with every compute action timed from outside (lesson
03's TimelineRecorder for ours; the same observer of torch's PipelineStage.forward_one_chunk,
backward_one_chunk and backward_weight_one_chunk), then idle / busy per rank as lesson 03 reports
it (pipeline_tools.bubble_fraction, the median over those steps), next to the formulas from their
mean action times: 1F1B's (p-1)/m, and ZB-H1's (p-1)(T_F+T_B-T_W)/(m(T_F+T_B+T_W)). On 2 busy
cores a rank that waits gives its core to the other, so idle time also absorbs the machine's other work.
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from picotron_like import comm
from picotron_like.data import BatchShape, TokenBatches, builtin_corpus_paths
from picotron_like.lessons import load_lesson
from picotron_like.loss import cross_entropy_loss
from picotron_like.metrics import CallObserver, log0
from picotron_like.model import get_config
from picotron_like.pipeline_tools import RecordedAction, TimelineRecorder, bubble_fraction, gather_timelines
from picotron_like.topology import GridShape, ProcessGrid, init_distributed, shutdown

sys.path.insert(0, str(Path(__file__).resolve().parent))
import tp_pp_vs_torch as timing  # noqa: E402  (the timing, loss check and stage wrapper of the 1F1B comparison)

pipeline_parallel = load_lesson("03_pipeline_parallel")
zero_bubble = load_lesson("03_zero_bubble")
CPU = torch.device("cpu")
SEED = timing.SEED


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="tiny", help="model shape from picotron_like.model.PRESETS")
    parser.add_argument("--seq-len", type=int, default=128, help="tokens per sequence")
    parser.add_argument("--micro-batch-size", type=int, default=4, help="sequences per micro-batch")
    parser.add_argument("--micro-batches", type=int, nargs="+", default=[4, 8], help="micro-batch counts m to run")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps per variant before timing")
    parser.add_argument("--steps", type=int, default=2, help="timed steps per variant and repetition")
    parser.add_argument("--repeats", type=int, default=5, help="repetitions; the median is reported")
    parser.add_argument("--profile", action="store_true", help=argparse.SUPPRESS)   # time_variants reads it
    return parser.parse_args()


# ----------------------------------------------------------------------------- the variants


def ours(cfg, grid, schedule: str, shape: BatchShape):
    """Lesson 03's pipeline as its main builds it at --dp 1 (zero-bubble: 03_zero_bubble.py's, whose
    linears defer their weight gradients)."""
    chunks = pipeline_parallel.build_model_chunks(cfg, SEED, grid, CPU, 1, 25 * 2**20)
    pipeline_class = zero_bubble.ZeroBubblePipeline if schedule == "zero-bubble" else pipeline_parallel.Pipeline
    pipeline = pipeline_class(chunks, grid, schedule, shape.grad_accum, 1,
                              (shape.micro_batch_size, shape.seq_len, cfg.hidden), CPU)
    return timing.pipeline_step(pipeline), lambda: TimelineRecorder(pipeline, grid.pp_group, CPU)


def torch_schedule(cfg, grid, schedule_class, stage_indices: list[int], n_stages: int, shape: BatchShape):
    """torch.distributed.pipelining on this rank's stages of the model cut in n_stages (lesson 03's
    PipelineStage modules, the last returning logits); the first and last stage are fed the inputs and
    targets, wherever they live."""
    from torch.distributed.pipelining import PipelineStage

    ranges = pipeline_parallel.stage_layer_ranges(cfg.n_layers, n_stages)
    modules = [pipeline_parallel.PipelineStage(cfg, SEED, ranges[index], has_embedding=index == 0,
                                               has_head=index == n_stages - 1) for index in stage_indices]
    stages = [PipelineStage(timing.LogitsStage(module, shape.seq_len), index, n_stages, CPU,
                            group=comm.process_group(grid.pp_group))
              for index, module in zip(stage_indices, modules)]
    n_targets = [0]  # the current step's global target count, read by loss_fn

    def loss_fn(logits, targets):
        return cross_entropy_loss(logits, targets, reduction="sum") / n_targets[0]

    multi = len(stages) > 1
    schedule = schedule_class(stages if multi else stages[0], shape.grad_accum, loss_fn=loss_fn, scale_grads=False)
    first, last = 0 in stage_indices, n_stages - 1 in stage_indices

    def step(batch):
        for module in modules:
            timing.gradients_to_none(module)
        n_targets[0] = batch.n_targets
        losses, feed = [], {}
        if last:
            feed = {"target": torch.cat([targets for _, targets in batch.micro_batches]), "losses": losses}
        inputs = (torch.cat([tokens for tokens, _ in batch.micro_batches]),) if first else ()
        schedule.step(*inputs, **feed)
        return torch.stack(losses).sum().detach() if losses else torch.zeros(())
    return step, lambda: StageTimeline(stages, grid.pp_group)


class StageTimeline:
    """Lesson 03's TimelineRecorder for torch's stages: their per-action methods timed from outside
    while entered (CallObserver, Python's profiler hook: nothing of the stages is replaced), each
    call an F, a B (a whole backward, or ZBV's input half) or a W, by the rank's chunk; a barrier of
    the group starts every rank's clock together."""

    methods = {"forward_one_chunk": "F", "backward_one_chunk": "B", "backward_weight_one_chunk": "W"}

    def __init__(self, stages, group):
        self.stages, self.group, self.events = stages, group, []

    def _chunk(self, frame):
        """Which of this rank's stages the call runs on, or None for another object's."""
        return next((chunk for chunk, stage in enumerate(self.stages) if frame.f_locals.get("self") is stage), None)

    def _started(self, frame) -> None:
        if self._chunk(frame) is not None:
            self._running.append(time.perf_counter())

    def _ended(self, frame) -> None:
        chunk = self._chunk(frame)
        if chunk is not None:
            action = RecordedAction(self.methods[frame.f_code.co_name], chunk,
                                    frame.f_locals[frame.f_code.co_varnames[1]])
            self.events.append((action, self._running.pop() - self._t0, time.perf_counter() - self._t0))

    def __enter__(self):
        dist.barrier(group=comm.process_group(self.group))
        self.events, self._running, self._t0 = [], [], time.perf_counter()
        self._calls = CallObserver([getattr(type(stage), name) for stage in self.stages for name in self.methods],
                                   on_call=self._started, on_return=self._ended)
        self._calls.__enter__()
        return self

    def __exit__(self, *exc):
        return self._calls.__exit__(*exc)


# ----------------------------------------------------------------------------- the bubble


def measured_bubble(recorder_of_step, step_fn, batch, group, formula: str, repeats: int) -> str:
    """`repeats` steps, each under the recorder: the median of their idle / busy per rank (averaged
    over the ranks), the mean F, B and W times over all of them, and `formula` ("1f1b",
    "zero-bubble" or None) evaluated for those times."""
    bubbles, events = [], []
    for _ in range(repeats):
        with recorder_of_step() as recorder:
            step_fn(batch)
        timelines = gather_timelines(recorder.events, group)
        bubbles.append(bubble_fraction(timelines))
        events += [event for rank_events in timelines for event in rank_events]
    pp, m = len(timelines), len(batch.micro_batches)

    def mean_ms(kind):
        durations = [end - start for action, start, end in events if action.kind == kind]
        return sum(durations) / len(durations) * 1e3 if durations else 0.0

    t_f, t_b, t_w = mean_ms("F"), mean_ms("B"), mean_ms("W")
    predicted = {"1f1b": f"(p-1)/m = {(pp - 1) / m:.3f}",
                 "zero-bubble": f"(p-1)(T_F+T_B-T_W)/(m(T_F+T_B+T_W)) = "
                                f"{zero_bubble.zero_bubble_formula(pp, m, t_f, t_b, t_w):.3f}"}.get(formula, "-")
    return f"{statistics.median(bubbles):.3f}  formula {predicted}  (F {t_f:.1f}, B {t_b:.1f}, W {t_w:.1f} ms)"


FORMULA = {"ours 1f1b": "1f1b", "ours zero-bubble": "zero-bubble", "torch Schedule1F1B": "1f1b"}


def run(cfg, m: int, args) -> None:
    from torch.distributed.pipelining import Schedule1F1B, ScheduleZBVZeroBubble

    grid = ProcessGrid(GridShape(pp=dist.get_world_size()))
    p, r = grid.pp_size, grid.pp_rank
    shape = BatchShape(args.micro_batch_size, args.seq_len, m, 1)
    batches = TokenBatches(builtin_corpus_paths()[0], shape, seed=SEED, vocab_size=cfg.vocab_size)
    built = {"ours 1f1b": ours(cfg, grid, "1f1b", shape),
             "ours zero-bubble": ours(cfg, grid, "zero-bubble", shape),
             "torch Schedule1F1B": torch_schedule(cfg, grid, Schedule1F1B, [r], p, shape),
             "torch ScheduleZBVZeroBubble": torch_schedule(cfg, grid, ScheduleZBVZeroBubble, [r, 2 * p - 1 - r],
                                                           2 * p, shape)}
    variants = {name: step for name, (step, _) in built.items()}
    first = batches.step_batch(0, 0)
    losses = {name: timing.global_loss(step, first, grid.pp_group, False) for name, step in variants.items()}
    timing.check_same_loss(losses, [("ours 1f1b", name) for name in variants if name != "ours 1f1b"])
    times = timing.time_variants(variants, batches, args)
    bubbles = {name: measured_bubble(recorder, step, first, grid.pp_group, FORMULA.get(name), args.repeats)
               for name, (step, recorder) in built.items()}
    log0(f"\npp={p}, m={m} micro-batches of {args.micro_batch_size} x {args.seq_len} tokens")
    log0(f"{'variant':<29}{'loss (step 0)':>14}{'ms / step':>11}{'(min - max)':>18}{'CPU ms, all ranks':>19}"
         f"   bubble (idle / busy), median of --repeats steps")
    for name in variants:
        t = times[name]
        spread = f"({t['min'] * 1e3:.1f} - {t['max'] * 1e3:.1f})"
        log0(f"{name:<29}{losses[name]:>14.6f}{t['median'] * 1e3:>11.1f}{spread:>18}{t['cpu'] * 1e3:>19.1f}"
             f"   {bubbles[name]}")
    for ours_name, theirs in (("ours zero-bubble", "ours 1f1b"), ("ours 1f1b", "torch Schedule1F1B"),
                              ("ours zero-bubble", "torch ScheduleZBVZeroBubble")):
        log0(f"ratio {ours_name} / {theirs}: {times[ours_name]['median'] / times[theirs]['median']:.3f} step time, "
             f"{times[ours_name]['cpu'] / times[theirs]['cpu']:.3f} CPU time")


def main():
    args = parse_args()
    init_distributed()
    torch.manual_seed(SEED)
    cfg = get_config(args.preset)
    log0(f"{dist.get_world_size()} ranks, {torch.get_num_threads()} thread(s) each; preset {args.preset}, "
         f"{cfg.n_layers} layers, hidden {cfg.hidden}; {args.warmup} warm-up steps, median of {args.repeats} x "
         f"{args.steps} timed steps; forward + backward, no optimizer step")
    timing.log_load_average("at the start")
    for m in args.micro_batches:
        run(cfg, m, args)
    timing.log_load_average("at the end")
    shutdown()


if __name__ == "__main__":
    main()
