"""
Lesson 07's autotune: measure the plan's best layouts before betting a run on the estimate.

    python 07_full_5d.py --autotune --gpus 8 --preset 8b --seq-len 8192 --micro-batch-size 1 --grad-accum 8

The plan (07_memory_plan.py) knows to the byte what fits, but its step time is a model: kernels
that run below the peak on small shapes, collectives that hide or do not, an allocator that slows
down at the memory limit. Ranking layouts by it can put a layout first that a practitioner would
measure before running. A few minutes of measuring settle it: the plan's best K layouts that fit
(--autotune-top; each grid's fastest ZeRO stage and recompute mode, as the plan lists them) each
run as a child process of their own,

    torchrun --standalone --nproc_per_node=N 07_full_5d.py <your flags> <the layout's flags>
             --steps S --metrics FILE

under a timeout, an equal share of --autotune-minutes (--max-minutes stays the training budget),
so that a layout that runs out of memory, is refused or hangs costs one row, not the tuning: its
whole process tree is killed (torchrun starts each rank in a session of its own). Each child's
--metrics records give its step time: the median over the steps after the first WARMUP_STEPS,
which pay one-off costs (allocations, NCCL's communicators, compilation) and are no sample of the
steady state. The table puts each layout's measured tokens/s per GPU, MFU (on a GPU of known
peak) and peak memory next to the plan's estimate; --autotune-out keeps it as JSON, with each
child's log beside it; the last line is the fastest layout's command.

Peak memory is rank 0's, as its metrics record it: on CUDA what the caching allocator reserved at
its peak (the plan's figure, its estimated reserve included, less its margin for the CUDA context
and NCCL's buffers), on a CPU the process's peak resident size (the interpreter and torch's
libraries included). The plan's figure is the
fullest rank's, which under a pipeline may be another stage than rank 0's.

On a CPU machine the children train on the CPU with gloo (about a minute:
`python 07_full_5d.py --autotune --gpus 4 --preset tiny --autotune-top 3`). On a cluster, run the
same command on every node with torchrun's rendezvous flags in --autotune-torchrun, which replace
`--standalone --nproc_per_node=N` (say `--nnodes 4 --nproc_per_node 8 --node-rank K --master-addr
HOST --master-port 29500`): every node walks the same layouts in the same order under the same
timeouts, so each child's rendezvous meets all nodes. The node that holds rank 0 writes the
metrics: its table is the report, the others' rows say where to read it, and the command it
prints last is every node's, each with its own --node-rank.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shlex
import signal
import statistics
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch

import picotron_like.calibrate as calibration
import picotron_like.checkpoint as checkpoints
import picotron_like.sample as sampling
from picotron_like.lessons import load_lesson
from picotron_like.topology import ConfigError, torchrun_workers
from picotron_like.train import batch_shape, exit_with_error, model_name

memory_plan = load_lesson("07_memory_plan")
zero = load_lesson("06_zero")

# The trainer the children run. It is started, never loaded: lesson 07 loads this file.
TRAINER = Path(__file__).with_name("07_full_5d.py")
# Steps each child runs before the timed ones: the first pays the allocations, NCCL's
# communicators, a compilation; the next can still wait for what the first queued.
WARMUP_STEPS = 2

# ============================================================================ the technique: a layout as a child run


@dataclass(frozen=True)
class Trial:
    """One layout to measure: the plan's view of it, the flags that make 07 run it, its time limit."""

    planned: "memory_plan.PlannedLayout"
    flags: list[str]
    timeout_s: float

    @property
    def name(self) -> str:
        args = self.planned.args
        return f"{memory_plan.layout_name(self.planned)} ZeRO-{args.zero_stage} {args.recompute}"


def layout_flags(planned) -> list[str]:
    """07's flags for a planned layout: its grid, expert degree, ZeRO stage, recompute mode,
    schedule and micro-batches per step (the same global batch as the user's flags)."""
    grid, args = planned.grid, planned.args
    flags = {"--dp": grid.dp, "--pp": grid.pp, "--cp": grid.cp, "--tp": grid.tp, "--ep": planned.ep,
             "--zero-stage": args.zero_stage, "--recompute": args.recompute, "--schedule": args.schedule,
             "--grad-accum": args.grad_accum}
    if args.schedule == "interleaved":
        flags["--virtual-stages"] = args.virtual_stages
    return [word for flag, value in flags.items() for word in (flag, str(value))] \
        + ["--sequence-parallel"] * args.sequence_parallel


def without_flags(argv: list[str], args, dests: set[str]) -> list[str]:
    """`argv` less the flags whose destinations are `dests`, with their values, typed as
    `--flag value` or `--flag=value`. A word is a flag's value as argparse reads it: a switch
    (a bool in `args`) takes none, and a word starting with "--" is the next flag unless it holds
    a space (a quoted list of flags, as --autotune-torchrun takes)."""
    kept, index = [], 0
    while index < len(argv):
        word = argv[index]
        name = word.split("=", 1)[0]
        dest = name.removeprefix("--").replace("-", "_")
        index += 1
        if not (name.startswith("--") and dest in dests):
            kept.append(word)
        elif "=" not in word and not isinstance(getattr(args, dest, None), bool) and index < len(argv) \
                and (not argv[index].startswith("--") or " " in argv[index]):
            index += 1
    return kept


def flag_dests(add_flags) -> set[str]:
    """The destinations of the flags `add_flags(parser)` adds (those with a default)."""
    parser = argparse.ArgumentParser()
    add_flags(parser)
    return set(vars(parser.parse_args([])))


# What a layout sets (the children get the trial's own), and what only this planning run reads.
LAYOUT_DESTS = {"dp", "pp", "cp", "tp", "ep", "zero_stage", "recompute", "sequence_parallel", "schedule",
                "virtual_stages", "grad_accum", "global_batch_tokens"}


def run_flags(argv: list[str], args) -> list[str]:
    """The user's flags for a training run of any layout: the model, the batch, the data, the
    run's own (checkpoints, budget), without the layout and the planning flags."""
    planning = flag_dests(memory_plan.add_plan_flags) | flag_dests(add_autotune_flags) \
        | flag_dests(calibration.add_calibrate_flags)
    return without_flags(argv, args, LAYOUT_DESTS | planning)


def trial_flags(argv: list[str], args) -> list[str]:
    """run_flags less what a measuring run must not do: write checkpoints or samples, validate,
    profile, keep to a budget or step count of its own, or write metrics elsewhere."""
    side_effects = {"steps", "metrics", "max_minutes", "val_every", "profile", "memory_snapshot"}
    side_effects |= flag_dests(checkpoints.add_checkpoint_flags) | flag_dests(sampling.add_sample_flags)
    return without_flags(run_flags(argv, args), args, side_effects)


def torchrun_flags(args) -> list[str]:
    """How the children start: --autotune-torchrun's flags, or all ranks on this host."""
    if args.autotune_torchrun is not None:
        return shlex.split(args.autotune_torchrun)
    return ["--standalone", f"--nproc_per_node={args.gpus}"]


def run_child(command: list[str], log_path: Path, timeout_s: float) -> int | None:
    """Run `command` with its output in `log_path`: its exit code, or None when it ran past
    `timeout_s`. Its whole process tree is killed then, and when this process is interrupted."""
    with open(log_path, "w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            return process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return None
        finally:
            if process.poll() is None:
                kill_torchrun(process)


def kill_torchrun(process: subprocess.Popen) -> None:
    """Kill a torchrun and its ranks. Each rank leads a session of its own, so killing torchrun's
    process group alone would leave them running; torchrun is stopped first, so that it starts
    no rank (a restart) between the reading of its ranks and their killing."""
    signal_group(process.pid, signal.SIGSTOP)
    for rank in torchrun_workers(process.pid):
        signal_group(rank, signal.SIGKILL)      # a rank's own children too (compile workers)
    signal_group(process.pid, signal.SIGKILL)
    process.wait()


def signal_group(leader: int, signum: int) -> None:
    """Send `signum` to the process group that `leader` leads, unless it has just ended."""
    try:
        os.killpg(leader, signum)
    except ProcessLookupError:
        pass


def failure_reason(returncode: int | None, log: str, timeout_s: float) -> str:
    """Why a child gave no timed steps, in one line: a timeout, running out of memory, its
    `error:` line (a refusal), or its exit code with the first exception its ranks raised."""
    if returncode is None:
        return f"timed out after {timeout_s:.0f} s"
    lines = log.splitlines()
    memory = [line.strip() for line in lines if "out of memory" in line.lower()]
    if memory:
        return f"out of memory: {memory[0]}"
    errors = [index for index, line in enumerate(lines) if line.startswith("error: ")]
    if errors:
        first = errors[0]
        rest = [line.strip() for line in lines[first + 1:first + 4] if line.startswith("  ")]
        return " ".join([lines[first].removeprefix("error: "), *rest])
    # a rank's exception comes before torchrun's own (ChildFailedError), which only says a rank failed
    raised = [found.group(0).strip() for found in map(EXCEPTION.search, lines)
              if found and not found.group(0).startswith("ChildFailedError")]
    return f"exit code {returncode}" + (f": {raised[0]}" if raised else "")


# an exception's last line, after any prefix torchrun gives a rank's output ("[rank1]: ")
EXCEPTION = re.compile(r"\b[A-Za-z_]*(Error|Exception):( .*)?$")


def read_metrics(metrics_path: Path) -> list[dict]:
    """A child's --metrics records, one per step (a step's last), in step order; none if it wrote none."""
    records = {}
    for line in metrics_path.read_text().splitlines() if metrics_path.exists() else []:
        if line.strip():
            record = json.loads(line)
            records[record["step"]] = record
    return [records[step] for step in sorted(records)]


# A child that ran on a node without rank 0: its ranks write no metrics (the multi-node case).
ELSEWHERE = "measured on the node with rank 0: read its table"
# rank 0's memory as a step record has it: the allocator's reserved peak on CUDA, the peak resident size on a CPU
MEMORY_FIELDS = ("max_memory_reserved_bytes", "max_rss_bytes")


def measurement(records: list[dict], tokens_per_step: int, world_size: int) -> dict | None:
    """The median step time over the steps after the warm-up, as tokens/s per GPU and MFU (when
    the child's device has a peak), and the peak memory over every step; None without a timed step."""
    timed = [record for record in records if record["step"] >= WARMUP_STEPS]
    if not timed:
        return None
    seconds = statistics.median(record["seconds"] for record in timed)
    mfu = [record["mfu"] for record in timed if "mfu" in record]
    field = next((field for field in MEMORY_FIELDS if field in records[0]), None)
    return {"step_s": seconds, "tokens_per_s_per_gpu": tokens_per_step / seconds / world_size,
            "mfu": statistics.median(mfu) if len(mfu) == len(timed) else None, "timed_steps": len(timed),
            "peak_memory_bytes": max(record[field] for record in records) if field else None, "memory_field": field}


def estimate(planned) -> dict:
    """The plan's figures for a layout, in the units the table measures."""
    return {"step_s": planned.step_seconds, "tokens_per_s_per_gpu": planned.tokens_per_second_per_gpu,
            "mfu": planned.mfu, "peak_memory_bytes": planned.peak_bytes}


def measure(trial: Trial, child_flags: list[str], launch: list[str], steps: int, runs: Path) -> dict:
    """Run one trial as a child and read its metrics: a row of the table, measured or failed."""
    args = trial.planned.args
    stem = f"{memory_plan.layout_name(trial.planned).replace(' ', '_')}_zero{args.zero_stage}_{args.recompute}"
    metrics_path, log_path = runs / f"{stem}.metrics.jsonl", runs / f"{stem}.log"
    metrics_path.unlink(missing_ok=True)
    command = [sys.executable, "-m", "torch.distributed.run", *launch, str(TRAINER), *child_flags, *trial.flags,
               "--steps", str(steps), "--metrics", str(metrics_path)]
    returncode = run_child(command, log_path, trial.timeout_s)
    measured = measurement(read_metrics(metrics_path), batch_shape(args, trial.planned.grid.dp).tokens_per_step,
                           trial.planned.grid.world_size)
    if returncode == 0 and measured is not None:
        reason = None
    elif returncode == 0 and not metrics_path.exists():
        reason = ELSEWHERE
    elif returncode == 0:
        reason = f"no step after the first {WARMUP_STEPS} to time"
    else:
        reason = failure_reason(returncode, log_path.read_text(errors="replace"), trial.timeout_s)
    return {"layout": trial.name, "log": str(log_path),
            "measured": measured if reason is None else None, "failure": reason}


# ============================================================================ configuration rules


def checked_autotune_flags(args, validate, expert_degree):
    """(the device the plan prices, the trials in the plan's order) for the flags, or one `error:`
    line and exit 2: the plan's flags by its own rules, then the autotune's, then a layout list
    that fits nothing."""
    cfg, grid, ep, shape = memory_plan.checked_plan_flags(args, validate, expert_degree)
    try:
        problems = []
        if args.autotune_top < 1:
            problems.append(f"--autotune-top {args.autotune_top} must be at least 1: the number of layouts to measure")
        if not (args.autotune_minutes > 0 and math.isfinite(args.autotune_minutes)):
            problems.append(f"--autotune-minutes {args.autotune_minutes} must be a positive number: the time the "
                            f"children may take together")
        if args.autotune_steps <= WARMUP_STEPS:
            problems.append(f"--autotune-steps {args.autotune_steps} must be more than the {WARMUP_STEPS} warm-up "
                            f"steps, which are not timed")
        if args.autotune_torchrun is not None:
            try:
                shlex.split(args.autotune_torchrun)
            except ValueError as error:
                problems.append(f"--autotune-torchrun {args.autotune_torchrun!r}: {error}")
        if problems:
            raise ConfigError("bad flags:\n  - " + "\n  - ".join(problems))
        device = memory_plan.plan_device(args)
        # priced for the device: --dtype auto is bf16 on a GPU
        precision = zero.precision_from_flags(args.dtype, args.reduce_dtype, torch.device(device.device_type))
        capacity = device.memory_gib * memory_plan.GIB
        usable = capacity * (1 - memory_plan.PLAN_MARGIN)
        fitting = memory_plan.fitting_layouts(cfg, args, usable, precision, device, validate)
        if not fitting:
            raise ConfigError(f"no layout of {args.gpus} x {device.name} fits this batch ({shape.sequences_per_step} "
                              f"sequences of {shape.seq_len} per step, micro-batch {shape.micro_batch_size}) in "
                              f"{usable / memory_plan.GIB:.3g} GiB ({1 - memory_plan.PLAN_MARGIN:.0%} of "
                              f"{capacity / memory_plan.GIB:.3g} GiB): see --plan's memory per rank; lower "
                              f"--micro-batch-size, use more GPUs or a GPU with more memory")
    except ConfigError as error:
        exit_with_error(error)
    chosen = memory_plan.fastest_per_grid(fitting)[:args.autotune_top]
    timeout_s = args.autotune_minutes * 60 / len(chosen)
    return device, [Trial(planned, layout_flags(planned), timeout_s) for planned in chosen]


# ============================================================================ main


def add_autotune_flags(parser) -> None:
    parser.add_argument("--autotune", action="store_true",
                        help="no training: run the plan's best --autotune-top layouts that fit on --gpus ranks, each "
                             "as a child torchrun of 07 for --autotune-steps steps, and print their measured "
                             "tokens/s, MFU and peak memory next to the plan's estimate, then the fastest's command")
    parser.add_argument("--autotune-top", type=int, default=4, metavar="K",
                        help="with --autotune: how many layouts to measure (the plan's first K grids)")
    parser.add_argument("--autotune-minutes", type=float, default=15.0,
                        help="with --autotune: the time all children may take, shared equally: each one's timeout")
    parser.add_argument("--autotune-steps", type=int, default=8,
                        help=f"with --autotune: steps each child trains; the first {WARMUP_STEPS} are not timed")
    parser.add_argument("--autotune-out", default="autotune.json", metavar="FILE",
                        help="with --autotune: the table as JSON; the children's logs and metrics go to FILE's "
                             "name without .json + '_runs/'")
    parser.add_argument("--autotune-torchrun", default=None, metavar="FLAGS",
                        help="with --autotune: torchrun's flags for the children, instead of --standalone "
                             "--nproc_per_node=--gpus: on a cluster, the rendezvous of the same command on every node")


def autotune(args, argv: list[str], validate, expert_degree) -> None:
    """--autotune: measure the plan's best layouts as children of their own and print the table,
    the fastest layout's command last. `argv`: the flags as typed, which the children and the
    command line get, less the layout's and the planning's. `validate`, `expert_degree`: lesson
    07's rules, which 07 passes (no sibling loads 07)."""
    device, trials = checked_autotune_flags(args, validate, expert_degree)
    out = Path(args.autotune_out)
    runs = out.with_name(out.name.removesuffix(".json") + "_runs")
    report = Report(out, {"model": model_name(args), "gpus": args.gpus, "estimates_for": device.name,
                          "steps": args.autotune_steps, "warmup_steps": WARMUP_STEPS})
    try:        # written before the first child starts, so that a path that cannot be written costs nothing
        runs.mkdir(parents=True, exist_ok=True)
        report.write()
    except OSError as error:
        exit_with_error(ConfigError(f"--autotune-out {out}: cannot write it or {runs}/ ({error.strerror or error})"))
    print(f"autotune: {model_name(args)}, {len(trials)} layouts of {args.gpus} ranks, {args.autotune_steps} steps "
          f"each (the first {WARMUP_STEPS} not timed), at most {trials[0].timeout_s:.0f} s each; estimates for "
          f"{device.name}; the children's logs in {runs}/")
    measure_all(trials, args, argv, runs, report)
    ran = [row for row in report.rows if row["measured"] is not None]
    if all(row["failure"] == ELSEWHERE for row in report.rows):
        return print("this node holds no rank 0: the node that does prints the report and the fastest command")
    if not ran:
        print(f"error: no layout ran its timed steps (each row says why; the logs are in {runs}/)", file=sys.stderr)
        sys.exit(1)
    fastest = max(ran, key=lambda row: row["measured"]["tokens_per_s_per_gpu"])
    report.write(fastest)
    print(f"fastest measured: {fastest['layout']}, {fastest['measured']['tokens_per_s_per_gpu']:,.0f} tokens/s "
          f"per GPU (the table in {out}); its command:")
    print(fastest["command"])


@dataclass
class Report:
    """The table as JSON in `path`: the run's `header`, the rows, the fastest layout and its command."""

    path: Path
    header: dict
    rows: list[dict] = field(default_factory=list)

    def add(self, row: dict) -> None:
        """A row, written at once: an interrupted tuning keeps what it measured."""
        self.rows.append(row)
        self.write()

    def write(self, fastest: dict | None = None) -> None:
        self.path.write_text(json.dumps({**self.header, "rows": self.rows, "fastest": fastest and fastest["layout"],
                                         "command": fastest and fastest["command"]}, indent=1) + "\n")


def measure_all(trials: list[Trial], args, argv: list[str], runs: Path, report: Report) -> None:
    """Each trial in turn, whatever became of the one before: the table's rows, printed and added
    to `report` as they come."""
    launch, child_flags = torchrun_flags(args), trial_flags(argv, args)
    print(TABLE_HEADER)
    for trial in trials:
        command = shlex.join(["torchrun", *launch, os.path.relpath(TRAINER), *run_flags(argv, args), *trial.flags])
        report.add({**measure(trial, child_flags, launch, args.autotune_steps, runs), "command": command,
                    "estimated": estimate(trial.planned)})
        print(table_row(report.rows[-1]), flush=True)


TABLE_HEADER = (f"  {'':<30}{'---------- estimated ----------':>31}  {'----------- measured -----------':>32}\n"
                f"  {'layout':<30}{'tok/s/GPU':>13}{'MFU':>8}{'GiB':>10}  {'tok/s/GPU':>13}{'MFU':>8}{'peak GiB':>11}"
                f"  result")


def table_row(row: dict) -> str:
    estimated, measured = row["estimated"], row["measured"] or {}

    def number(value, form: str) -> str:
        return "-" if value is None else format(value, form)

    memory = measured.get("peak_memory_bytes")
    return (f"  {row['layout']:<30}{number(estimated['tokens_per_s_per_gpu'], ',.0f'):>13}"
            f"{number(estimated['mfu'], '.1%'):>8}{estimated['peak_memory_bytes'] / 2**30:>10.2f}  "
            f"{number(measured.get('tokens_per_s_per_gpu'), ',.0f'):>13}{number(measured.get('mfu'), '.1%'):>8}"
            f"{number(memory / 2**30 if memory else None, '.2f'):>11}  {row['failure'] or 'ok'}")
