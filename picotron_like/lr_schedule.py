"""
The learning rate over a run: a linear warm-up, then cosine decay (the default) or warmup-stable-decay.

    cosine (--lr-schedule cosine)          wsd (--lr-schedule wsd --decay-share 0.2)
    lr |  .--.__                           lr |  .-------------------.
       | /      ``--.__                       | /                     `.
       |/              ``--.___ min           |/                        `-.__ min
       +------------------------> step        +--------------------------|---> step
                                                        stable            decay: the last 20 %

Cosine decays over the whole run, so its shape depends on where the run ends from the first step
on. WSD (warmup-stable-decay: MiniCPM, Hu et al. 2024) holds the peak and decays over the final
share of the run only: everything before the decay is the same whatever the length, which is what
a time budget needs, since the budget knows the run's end only after its first steps
(run_control.TimeBudget), and may learn on the way that the end comes sooner.

The decay's shape is 1 - sqrt(x) over the decay's progress x (0 -> 1), to the same minimum as cosine
(MIN_LR_RATIO of the peak), reached at the run's last step. Hägele et al. 2024 ("Scaling laws and
compute-optimal training beyond fixed training durations") compare cool-down shapes and lengths:
1 - sqrt beats linear, and a cool-down of about 20 % of the run matches cosine's loss while one of
5-10 % falls short of it; MiniCPM decays over about 10 %, modded-nanogpt's Muon runs over 40-45 %.
DEFAULT_DECAY_SHARE is 0.2, the share Hägele et al. found to match cosine.

Progress is counted in tokens trained, the warm-up in steps. Under a fixed batch the two are
proportional and the rates are the same, bit for bit (Python divides integers correctly rounded:
(k - w) T / ((n - w) T) is (k - w) / (n - w)). Under a batch-size ramp (data.BatchRamp) the early
steps train fewer tokens each: counted in steps they would spend a cosine's decay, or a WSD run's
share, on little data. So the decay follows the data, as Megatron-LM's sample-based schedules do
under its batch ramp; the warm-up stays in optimizer updates (--warmup-steps), which is what it
protects: Adam's first, badly estimated moments. `tokens_before(step)` (TokenBatches') gives the
tokens trained before a step; without it, steps count.

Where the decay lies is a setting of the run (args.decay_start, in tokens trained): placed from
the share of the planned run, or later, where the time budget plans the run's end only once that
share has begun (place_decay). A checkpoint records it with the planned steps, so a resumed run
follows the same schedule (run_control.follow_time_budget).
"""

from __future__ import annotations

import math
from collections.abc import Callable

MIN_LR_RATIO = 0.1              # both schedules end at this fraction of the peak
DEFAULT_DECAY_SHARE = 0.2       # wsd: the final share of the run spent decaying (module docstring: why)
LR_SCHEDULES = ("cosine", "wsd")


def steps_counted(step: int) -> int:
    """The run's position when nothing else counts it: the step itself."""
    return step


def learning_rate(step: int, max_lr: float, warmup_steps: int, total_steps: int,
                  min_lr_ratio: float = MIN_LR_RATIO, tokens_before: Callable[[int], int] = steps_counted) -> float:
    """Linear warm-up to max_lr, then cosine decay to min_lr_ratio * max_lr at total_steps, its
    progress in tokens_before's units from the warm-up's end (module docstring)."""
    if step < warmup_steps:
        return max_lr * (step + 1) / warmup_steps
    at = tokens_before
    progress = min(1.0, (at(step) - at(warmup_steps)) / max(1, at(total_steps) - at(warmup_steps)))
    min_lr = min_lr_ratio * max_lr
    return min_lr + 0.5 * (max_lr - min_lr) * (1.0 + math.cos(math.pi * progress))


def wsd_learning_rate(step: int, max_lr: float, warmup_steps: int, total_steps: int, decay_start: float,
                      min_lr_ratio: float = MIN_LR_RATIO, tokens_before: Callable[[int], int] = steps_counted) -> float:
    """Warmup-stable-decay: the peak after a linear warm-up, then from `decay_start` (in
    tokens_before's units) 1 - sqrt of the decay's progress down to min_lr_ratio * max_lr at the
    run's last step, total_steps - 1. Step s counts as done at its end (tokens_before(s + 1)), so
    the last step runs at the minimum. A decay that reaches into the warm-up (a run a few steps
    long) takes the lower of the two: the run still ends at the minimum."""
    warm = (step + 1) / warmup_steps if step < warmup_steps else 1.0
    done, end = tokens_before(step + 1), tokens_before(total_steps)
    if done <= decay_start:
        progress = 0.0
    elif step + 1 >= total_steps:
        progress = 1.0
    else:
        progress = (done - decay_start) / (end - decay_start)
    min_lr = min_lr_ratio * max_lr
    return min(max_lr * warm, min_lr + (max_lr - min_lr) * (1.0 - math.sqrt(progress)))


def decay_start(args, tokens_before: Callable[[int], int] = steps_counted) -> float:
    """Where the run's wsd decay starts, in tokens_before's units: where a time budget placed it
    (place_decay), else before the final --decay-share of the run's --steps."""
    placed = getattr(args, "decay_start", None)
    return placed if placed is not None else (1.0 - args.decay_share) * tokens_before(args.steps)


def run_learning_rate(args, step: int, tokens_before: Callable[[int], int] = steps_counted) -> float:
    """The learning rate of `step` under the run's flags: --lr-schedule, --lr, --warmup-steps,
    --steps (a time budget's planned steps), and wsd's decay (decay_start)."""
    if getattr(args, "lr_schedule", "cosine") == "wsd":
        return wsd_learning_rate(step, args.lr, args.warmup_steps, args.steps, decay_start(args, tokens_before),
                                 tokens_before=tokens_before)
    return learning_rate(step, args.lr, args.warmup_steps, args.steps, tokens_before=tokens_before)


def place_decay(args, first_step: int, steps: int, tokens_before: Callable[[int], int] = steps_counted) -> None:
    """The run now ends after `steps` steps, a plan that applies from `first_step` on (a time
    budget's estimate, or its forecast of an earlier end): args.steps and, under wsd, where the
    decay starts, so that it reaches the minimum at the new last step.

    A decay already under way (step first_step - 1 was decaying) keeps its start and steepens to
    the new end: its rate falls, never rises again. Otherwise it covers the --decay-share of the
    new plan, or, where that share has begun already, starts now: a run never ends undecayed.
    """
    if getattr(args, "lr_schedule", "cosine") == "wsd":
        started, now = decay_start(args, tokens_before), tokens_before(first_step)
        share_start = (1.0 - args.decay_share) * tokens_before(steps)
        args.decay_start = started if now > started else max(share_start, float(now))
    args.steps = args.planned_steps = steps


def first_decaying_step(args, tokens_before: Callable[[int], int] = steps_counted) -> int:
    """The first step whose rate is below the peak's under wsd: the first to end past decay_start
    (a bisection: the tokens trained only grow)."""
    start, low, high = decay_start(args, tokens_before), 0, args.steps - 1
    while low < high:
        middle = (low + high) // 2
        low, high = (middle + 1, high) if tokens_before(middle + 1) <= start else (low, middle)
    return low
