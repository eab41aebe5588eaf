"""
Lesson 07's sizing: which model, and how many tokens, M minutes on N GPUs should train.

    python 07_full_5d.py --plan --max-minutes 10 --preset 1b --gpus 32 --gpu B300 \
        --seq-len 2048 --micro-batch-size 4 --global-batch-tokens 1048576

The problem. The plan (07_memory_plan.py) answers "does this model fit" and "how fast does it run";
a time-boxed run asks first "what should I train". Train the 1b preset for 10 minutes on 32 B300s
(the command above) and the plan's estimate gives it under 2 B tokens: about one token per
parameter, where a compute-optimal run gives 20. A model of a quarter of its parameters, fed ten
times more tokens per parameter in the same minutes, reaches a lower loss by Chinchilla's fits.

The idea. Chinchilla's rule (picotron_like.compute_optimal: about 20 tokens per parameter for the
lowest loss at a given FLOP budget) applied to the tokens that the minutes hold for each candidate,
by the plan's own estimate of its step time at its fastest layout:

    candidates: the flags' model and its family   g = 1, 2, ... key/value heads, width and depth in
                (picotron_like.compute_optimal)     proportion, vocabulary and head size kept
    each candidate's tokens                         its fastest layout that fits (the plan's ranking),
                                                    steps in the minutes after the time to the first
                                                    step and TimeBudget's margin, times the batch
    the proposal                                    the candidate whose tokens per parameter are
                                                    nearest 20 (on a log scale)

Tokens per parameter fall as the model grows (more parameters, fewer tokens per second), so the
proposal sits where they cross 20: the walk prices the members on both sides of that crossing,
starting from a guess scaled from the flags' model by FLOPs per token, and a few rankings decide
it. More minutes never propose a smaller model (tests/test_sizing.py). The table shows the proposal, its neighbours and
the flags' model; the last line is the command that trains the proposal.

The price. A handful of the plan's rankings (each every layout of --gpus GPUs): seconds for a node,
about half a minute for 32 GPUs. And the rule's limits, printed with it: it is the loss per FLOP,
not per minute; its 20 was fitted on dense models of 70 M to 16 B parameters with their own data
and schedule; it counts tokens never seen before; it says nothing of the batch.

Run it (this CPU, priced by the profile --calibrate measures on it):

    torchrun --nproc_per_node=2 07_full_5d.py --calibrate cpu.json
    python 07_full_5d.py --plan --max-minutes 2 --gpus 2 --device-profile cpu.json

What to look for: the tokens per parameter of the flags' model against the proposal's, and the
time to the first step an assumption takes from the minutes (--time-to-first-step sets what a run
printed).
"""

from __future__ import annotations

import argparse
import math
import os
import shlex
from dataclasses import dataclass

import torch

from picotron_like.data import BatchShape, DataError, TokenBatches, builtin_corpus_paths
from picotron_like.compute_optimal import CHINCHILLA, ComputeOptimalRule, RunTime, family_description, family_member
from picotron_like.device_profile import DeviceProfile
from picotron_like.lessons import load_lesson
from picotron_like.model import PRESETS, GPTConfig, count_parameters, flops_per_token
from picotron_like.topology import ConfigError
from picotron_like.train import MODEL_SHAPE_FLAGS, batch_shape, exit_with_error

memory_plan = load_lesson("07_memory_plan")
autotune = load_lesson("07_autotune")
zero = load_lesson("06_zero")

# What a run loses before its first step ends, when --time-to-first-step is not given: assumptions,
# by device type. On a GPU: RESULTS.md's 1b runs on one H200 (2026-12-04) took about 40 s from
# launch to exit for 10 steps, most of it start-up; more nodes add a rendezvous and NCCL's
# communicators. Compiling: the 1b preset's first compiled step took 10.4 s there; larger models
# and a loss compiled per chunk take longer. On a CPU: 07's tiny preset reaches its first step in
# 3.5 s on 2 ranks here; the family's larger members build for longer; compiling ~20 s cold.
FIRST_STEP_S = {"cuda": 60.0, "cpu": 10.0}
COMPILE_S = {"cuda": 20.0, "cpu": 30.0}

# ============================================================================ the technique: priced for the minutes


@dataclass(frozen=True)
class Sizing:
    """What every candidate is priced against: the device, the precision, the memory a layout may
    fill, the minutes and what a run spends besides its steps, the rule."""

    device: DeviceProfile
    precision: "zero.Precision"
    usable_bytes: float
    budget_s: float
    run_time: RunTime
    rule: ComputeOptimalRule


@dataclass(frozen=True)
class Candidate:
    """One model of the family at its fastest layout that fits (None: none fits), and the steps and
    tokens that the minutes hold for it."""

    kv_heads: int
    cfg: GPTConfig
    layout: "memory_plan.PlannedLayout | None"
    steps: int
    tokens: int

    @property
    def parameters(self) -> int:
        return count_parameters(self.cfg)["total"]

    @property
    def tokens_per_parameter(self) -> float:
        return self.tokens / self.parameters


def priced(cfg: GPTConfig, kv_heads: int, args, sizing: Sizing, validate, ramp_of_layout) -> Candidate:
    """`cfg` at the plan's fastest layout of the flags' batch on --gpus GPUs, and its steps and
    tokens in the minutes at that layout's estimated step time (a batch ramp's first steps at theirs)."""
    fitting = memory_plan.fitting_layouts(cfg, args, sizing.usable_bytes, sizing.precision, sizing.device, validate)
    if not fitting:
        return Candidate(kv_heads, cfg, None, 0, 0)
    fastest = fitting[0]
    ramp = ramp_of_layout(fastest.args, fastest.grid, batch_shape(fastest.args, fastest.grid.dp))
    ramp_s = ramp_step_seconds(cfg, fastest, ramp, sizing) if ramp else ()
    steps = sizing.run_time.steps_in(sizing.budget_s, fastest.step_seconds, ramp_s)
    return Candidate(kv_heads, cfg, fastest, steps, ramp.tokens_before(steps) if ramp else
                     steps * fastest.tokens_per_step)


def ramp_step_seconds(cfg: GPTConfig, fastest, ramp, sizing: Sizing) -> tuple[float, ...]:
    """The estimated seconds of each of a batch ramp's steps before the first full one, on the line
    through the plan's step at the ramp's least micro-batch count and at the full count (a step's
    fixed part, the optimizer and the last reductions, and a slope per micro-batch: the line
    TimeBudget fits to a ramp's measured steps)."""
    full, micro_step = fastest.args.grad_accum, ramp.micro_step_tokens
    least = ramp.step_tokens(0) // micro_step      # the ramp's first step is its smallest
    if least == full:
        return ()
    fewest = argparse.Namespace(**{**vars(fastest.args), "grad_accum": least})
    smallest = memory_plan.plan_layout(cfg, fewest, fastest.grid, fastest.ep, batch_shape(fewest, fastest.grid.dp),
                                       sizing.precision, sizing.device)
    slope = (fastest.step_seconds - smallest.step_seconds) / (full - least)
    return tuple(fastest.step_seconds - slope * (full - ramp.step_tokens(step) // micro_step)
                 for step in range(ramp.full_from()))


def guessed_kv_heads(reference: Candidate, sizing: Sizing, seq_len: int) -> int:
    """Where the walk starts: the member whose tokens per parameter would cross the rule if every
    member ran at the reference's MFU (its tokens/s scaled by FLOPs per token)."""
    seconds_per_flop = reference.layout.step_seconds / (reference.layout.tokens_per_step
                                                        * flops_per_token(reference.cfg, seq_len))
    kv_heads = 1
    while True:
        cfg = family_member(reference.cfg, kv_heads + 1)
        step_s = seconds_per_flop * reference.layout.tokens_per_step * flops_per_token(cfg, seq_len)
        tokens = sizing.run_time.steps_in(sizing.budget_s, step_s) * reference.layout.tokens_per_step
        if tokens < sizing.rule.tokens_for(cfg):
            return kv_heads
        kv_heads += 1


def proposal(base: GPTConfig, args, sizing: Sizing, validate, ramp_of_layout) -> tuple[Candidate, list[Candidate]]:
    """(the proposal, the table's candidates: its neighbours and the flags' model, smallest first).

    The walk finds the largest member whose tokens per parameter reach the rule's (tokens per
    parameter fall as the members grow), then proposes it or the next one up, whichever is nearer
    the rule on a log scale; each member priced once."""
    members: dict[int, Candidate] = {}

    def at(kv_heads: int) -> Candidate:
        if kv_heads not in members:
            members[kv_heads] = priced(family_member(base, kv_heads), kv_heads, args, sizing, validate, ramp_of_layout)
        return members[kv_heads]

    def reaches(kv_heads: int) -> bool:
        return at(kv_heads).tokens_per_parameter >= sizing.rule.tokens_per_parameter

    reference = base.n_kv_heads
    while at(reference).layout is None and reference > 1:      # the flags' model fits no layout: halve it
        reference = max(1, reference // 2)
    kv_heads = guessed_kv_heads(at(reference), sizing, args.seq_len) if at(reference).layout else 1
    if reaches(kv_heads):
        while reaches(kv_heads + 1):
            kv_heads += 1
    else:
        while kv_heads > 1 and not reaches(kv_heads):
            kv_heads -= 1
    nearest = [at(k) for k in (kv_heads, kv_heads + 1)]
    chosen = min(nearest, key=lambda c: sizing.rule.distance(c.tokens_per_parameter))
    shown = {chosen.kv_heads - 1, chosen.kv_heads, chosen.kv_heads + 1, base.n_kv_heads} - {0}
    return chosen, [at(k) for k in sorted(shown)]


# ============================================================================ the technique: the command that trains it


def launch_flags(gpus: int, ranks_per_node: int) -> tuple[list[str], str]:
    """torchrun's flags for --gpus ranks, and what the reader fills in: one node standalone, or
    the same command on every node with a rendezvous at the first node."""
    if gpus <= ranks_per_node:
        return ["--standalone", f"--nproc_per_node={gpus}"], ""
    return (["--nnodes", str(gpus // ranks_per_node), "--nproc_per_node", str(ranks_per_node), "--rdzv_backend",
             "c10d", "--rdzv_endpoint", "HOST:29500", "--rdzv_id", "RUN"],
            " (the same on every node; HOST: the first node's address)")


def model_flags(preset: str, cfg: GPTConfig) -> list[str]:
    """--preset and the shape flags that make `cfg` of it (those that differ from the preset's)."""
    flags = ["--preset", preset]
    for name in MODEL_SHAPE_FLAGS:
        if getattr(cfg, name) != getattr(PRESETS[preset], name):
            flags += [f"--{name.replace('_', '-')}", str(getattr(cfg, name))]
    return flags


def proposal_command(chosen: Candidate, args, argv: list[str], launch: list[str]) -> str:
    """The user's run flags, the proposal's model and layout, and --max-minutes."""
    replaced = {"preset", *MODEL_SHAPE_FLAGS, "max_minutes"} | autotune.flag_dests(add_sizing_flags)
    kept = autotune.without_flags(autotune.run_flags(argv, args), args, replaced)
    return shlex.join(["torchrun", *launch, os.path.relpath(autotune.TRAINER), *kept,
                       *model_flags(args.preset, chosen.cfg), *autotune.layout_flags(chosen.layout),
                       "--max-minutes", f"{args.max_minutes:g}"])


# ============================================================================ configuration rules


def checked_sizing_flags(args, validate, expert_degree):
    """(the flags' model, the Sizing) for --plan --max-minutes, or one `error:` line and exit 2:
    the plan's flags by its own rules, then the sizing's."""
    cfg, _, _, shape = memory_plan.checked_plan_flags(args, validate, expert_degree)
    device = memory_plan.plan_device(args)
    problems = []
    if cfg.n_experts:
        problems.append(f"--preset {args.preset} has experts: the sizing's family and its rule (Chinchilla's, "
                        f"fitted on dense models) are for dense models; plan a dense preset")
    if hasattr(args, "steps"):
        problems.append(f"--steps {args.steps}: with --plan --max-minutes the minutes decide the steps; drop --steps")
    if args.gpus > device.ranks_per_node and args.gpus % device.ranks_per_node:
        problems.append(f"--gpus {args.gpus} is not a whole number of nodes of {device.ranks_per_node}: the "
                        f"command's torchrun starts as many ranks on every node")
    first_step_s = args.time_to_first_step
    if first_step_s is None:
        first_step_s = FIRST_STEP_S[device.device_type] + args.compile * COMPILE_S[device.device_type]
    if not (args.tokens_per_parameter > 0 and math.isfinite(args.tokens_per_parameter)):
        problems.append(f"--tokens-per-parameter {args.tokens_per_parameter:g} must be a positive number")
    if not (0 <= first_step_s < 60 * args.max_minutes):
        given = (f"--time-to-first-step {first_step_s:g}" if args.time_to_first_step is not None else
                 f"the time to the first step assumed on a {device.device_type} run, {first_step_s:g} s "
                 f"(--time-to-first-step),")
        problems.append(f"{given} must be 0 or more and less than the {60 * args.max_minutes:g} s of --max-minutes "
                        f"{args.max_minutes:g}")
    if problems:
        exit_with_error(ConfigError("bad flags:\n  - " + "\n  - ".join(problems)))
    precision = zero.precision_from_flags(args.dtype, args.reduce_dtype, torch.device(device.device_type))
    usable = device.memory_gib * memory_plan.GIB * (1 - memory_plan.PLAN_MARGIN)
    run_time = RunTime(first_step_s, args.val_every, args.val_batches if args.val_every else 0)
    rule = (CHINCHILLA if args.tokens_per_parameter == CHINCHILLA.tokens_per_parameter else
            ComputeOptimalRule(args.tokens_per_parameter, f"--tokens-per-parameter {args.tokens_per_parameter:g} "
                                                          f"(Chinchilla's: {CHINCHILLA.source})"))
    return cfg, shape, Sizing(device, precision, usable, 60 * args.max_minutes, run_time, rule)


# ============================================================================ main


def add_sizing_flags(parser) -> None:
    parser.add_argument("--tokens-per-parameter", type=float, default=CHINCHILLA.tokens_per_parameter, metavar="R",
                        help="with --plan --max-minutes: the compute-optimal tokens per parameter the proposal aims "
                             "at (Chinchilla's, Hoffmann et al. 2022: about 20)")
    parser.add_argument("--time-to-first-step", type=float, default=None, metavar="S",
                        help="with --plan --max-minutes: the seconds a run takes to the end of its first step "
                             "(start-up, building the model, compiling, the step: a run prints it as `time to the "
                             f"first step`); default: {FIRST_STEP_S['cuda']:g} on a GPU, {FIRST_STEP_S['cpu']:g} "
                             f"on a CPU, {COMPILE_S['cuda']:g} and {COMPILE_S['cpu']:g} more with --compile")


def print_sizing(args, argv: list[str], validate, expert_degree, ramp_of_layout) -> None:
    """--plan --max-minutes: the candidates around the proposal, the assumptions, and the command
    that trains the proposal. `argv`: the flags as typed, which the command keeps (less the
    model's, the layout's and the planning's). `validate`, `expert_degree`, `ramp_of_layout`:
    lesson 07's rules, --ep's default and --batch-ramp as a layout realises it, which 07 passes."""
    base, shape, sizing = checked_sizing_flags(args, validate, expert_degree)
    chosen, shown = proposal(base, args, sizing, validate, ramp_of_layout)
    if chosen.layout is None or chosen.steps == 0:
        exit_with_error(ConfigError(
            f"no member of the {args.preset} family trains a step in {args.max_minutes:g} minutes on {args.gpus} x "
            f"{sizing.device.name}: the smallest fits no layout, or its time to the first step and one step are more "
            f"than the minutes"))
    print(f"sizing: {args.max_minutes:g} minutes on {args.gpus} x {sizing.device.name}; the {args.preset} family "
          f"({family_description(base)}); {shape.tokens_per_step:,} tokens per step ({shape.sequences_per_step} "
          f"sequences of {shape.seq_len}); each candidate at its fastest layout that fits, by the plan's estimate")
    print_candidates(shown, chosen, base)
    layout = chosen.layout
    print(f"proposal: {shape_words(chosen.cfg)}: {count_words(chosen.parameters)} parameters, "
          f"{count_words(chosen.tokens)} tokens in {chosen.steps:,} steps ({chosen.tokens_per_parameter:.1f} "
          f"tokens per parameter; the rule's {sizing.rule.tokens_per_parameter:g} would be "
          f"{count_words(sizing.rule.tokens_for(chosen.cfg))}), "
          f"{memory_plan.layout_name(layout)} ZeRO-{layout.args.zero_stage} recompute {layout.args.recompute}, "
          f"estimated {layout.step_seconds:.3f} s per step, {layout.tokens_per_second_per_gpu:,.0f} tokens/s per GPU, "
          f"{layout.mfu:.1%} MFU")
    if chosen.kv_heads == 1 and chosen.tokens_per_parameter < sizing.rule.tokens_per_parameter:
        print("note: the family's smallest member, and still short of the rule's tokens per parameter: the minutes "
              "ask for a smaller model; a smaller head size or fewer query heads per key/value head (--hidden, "
              "--n-heads, --n-kv-heads) give a family that reaches smaller")
    print(data_passes(args, chosen))
    print("assumptions:\n" + "\n".join(f"  - {line}" for line in sizing_assumptions(args, sizing, base, shape)))
    launch, where = launch_flags(args.gpus, sizing.device.ranks_per_node)
    print(f"command{where}:")
    print(proposal_command(chosen, args, argv, launch))


def data_passes(args, chosen: Candidate) -> str:
    """How often the proposal's tokens pass over the flags' training data (its shards' headers give
    their size), since the rule counts tokens never seen before."""
    where = f"--data {args.data}" if args.data is not None else "the built-in corpus"
    try:
        paths = args.data if args.data is not None else builtin_corpus_paths()[0]
        # a batch of one sequence: the shards' sizes are all that is read
        n_tokens = TokenBatches(paths, BatchShape(1, args.seq_len, 1, 1), seed=0).n_tokens
    except DataError as error:
        return f"data: {where} is not readable here ({error}); the rule counts tokens never seen before"
    return (f"data: {where} holds {count_words(n_tokens)} tokens: the proposal passes over it "
            f"{chosen.tokens / n_tokens:.3g} times; the rule counts tokens never seen before (up to about 4 passes "
            f"cost little: Muennighoff et al. 2023, Scaling Data-Constrained Language Models, arXiv:2305.16264)")


def shape_words(cfg: GPTConfig) -> str:
    return (f"{cfg.n_layers} layers, hidden {cfg.hidden} ({cfg.n_heads} heads, {cfg.n_kv_heads} key/value "
            f"head{'s' * (cfg.n_kv_heads > 1)}), "
            f"MLP {cfg.ffn_hidden}")


def print_candidates(shown: list[Candidate], chosen: Candidate, base: GPTConfig) -> None:
    print(f"  {'kv':>3}{'layers':>7}{'hidden':>7}{'heads':>6}{'ffn':>7}{'params':>9}{'steps':>8}{'tokens':>9}"
          f"{'tok/param':>10}  {'layout':<22}{'ZeRO':>4}  {'recompute':<10}{'step s':>8}{'tok/s/GPU':>11}{'MFU':>7}")
    for candidate in shown:
        cfg, layout = candidate.cfg, candidate.layout
        row = (f"  {cfg.n_kv_heads:>3}{cfg.n_layers:>7}{cfg.hidden:>7}{cfg.n_heads:>6}{cfg.ffn_hidden:>7}"
               f"{count_words(candidate.parameters):>9}{candidate.steps:>8,}{count_words(candidate.tokens):>9}"
               f"{candidate.tokens_per_parameter:>10.1f}  ")
        row += (f"{memory_plan.layout_name(layout):<22}{layout.args.zero_stage:>4}  {layout.args.recompute:<10}"
                f"{layout.step_seconds:>8.3f}{layout.tokens_per_second_per_gpu:>11,.0f}{layout.mfu:>7.1%}"
                if layout else "no layout fits")
        print(row + ("  the proposal" if candidate is chosen else "") + ("  the flags' model" if cfg == base else ""))


def count_words(count: float) -> str:
    """A count in three digits and a unit: 131 k, 384 M, 5.63 B."""
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if count >= size:
            return f"{count / size:.3g} {unit}"
    return f"{count:.0f}"


def sizing_assumptions(args, sizing: Sizing, base: GPTConfig, shape) -> list[str]:
    run_time = sizing.run_time
    first = (f"{run_time.first_step_s:g} s to the first step's end (--time-to-first-step)" if
             args.time_to_first_step is not None else
             f"{run_time.first_step_s:g} s to the first step's end, assumed for a {sizing.device.device_type} run"
             + (" with --compile" if args.compile else "") + " (07_sizing.FIRST_STEP_S; a run prints its own as "
             "`time to the first step`: give it with --time-to-first-step S)")
    ramp = (f", reached by --batch-ramp {args.batch_ramp[0]} {args.batch_ramp[1]} as each layout realises it, its "
            f"steps priced on the line through the plan's step at its least and its full micro-batch count"
            if args.batch_ramp is not None else "")
    validation = (f"; a validation every {run_time.val_every} steps and after the last, each {run_time.val_batches} "
                  f"global batches' forward at a third of a step" if run_time.val_every else "")
    return [f"rule: {sizing.rule.source}; the proposal is the candidate whose tokens per parameter are nearest "
            f"{sizing.rule.tokens_per_parameter:g} on a log scale",
            "per minute, not per FLOP: the rule minimises the loss for a budget of FLOPs (C = 6 N D); minutes buy "
            "each candidate the FLOPs its own MFU allows, so each is given the tokens its estimated step time fits, "
            "and the rule is applied to those",
            "the rule's reach: fitted on dense models of 70 M to 16 B parameters on Chinchilla's data and cosine "
            "schedule; a model far smaller, another optimizer or schedule (Muon, WSD) may move the optimum",
            f"the family: {family_description(base)} kept; width, depth and MLP in proportion to "
            f"the key/value heads (picotron_like.compute_optimal.family_member); the vocabulary is the data's",
            f"the minutes: {sizing.budget_s:g} s from the process's start (--max-minutes): {first}; then steps at "
            f"the estimated step time; TimeBudget's two steps of margin at the end{validation}; checkpoints "
            f"(--save-dir) not priced: TimeBudget times the first and keeps to the budget",
            f"the batch: the flags' {shape.tokens_per_step:,} tokens per step for every candidate{ramp}; the rule "
            f"says nothing of it (a small model may train better on a smaller one)",
            f"step time: the plan's estimate on {sizing.device.name} (python 07_full_5d.py --plan with the "
            f"proposal's flags prints its parts and assumptions; --autotune measures them)"]
