"""
Which training recipe reaches the lowest validation loss in a fixed time on this machine: today's
(AdamW, cosine decay, a fixed batch) against Muon, warmup-stable-decay and a batch-size ramp, each
alone and all together; and the same recipes at equal tokens.

    python benchmarks/time_budget_recipes.py                 # the full benchmark: about 40 minutes, alone on 2 cores
    python benchmarks/time_budget_recipes.py --quick         # 2 recipes, 1 seed, 24-second budgets: about a minute
    python benchmarks/time_budget_recipes.py --recipes muon wsd --seeds 1     # some recipes (and the baseline)

The corpus: the Python standard library's own source files (every *.py under
sysconfig.get_paths()["stdlib"], sorted, without site-packages and the test suites), tokenized by
`python -m picotron_like.data prepare` with the byte tokenizer, so it needs no download and no
tokenizer file. One file in VAL_FILE_EVERY is held out for validation (no file in both splits),
prepared apart in an order by hash, and cut to a whole number of validation batches: every run is
scored on every validation window, whatever its seed. Written once under --data-dir (data/, which
git ignores) and reused.

The model: lesson 07's tiny preset (0.85 M parameters, the byte vocabulary of 256), one rank,
float32, ZeRO-0, one thread, pinned to one core; two runs at a time, one per core (--cores).

Two comparisons, each recipe on --seeds seeds (the seed draws the initial weights and the batch
order), every run a real `torchrun --nproc_per_node=1 07_full_5d.py` with --metrics and a
validation after its last step:
1. budget: --max-minutes M (default 2, start-up included): the loss per minute;
2. tokens: --steps N, N chosen per recipe and seed so that it trains the tokens the baseline
   reached in the budget (median over its seeds; to the nearest step, from the sizes of the
   recipe's own steps in its budget run, a ramp's too): the loss per token, apart from speed.
The script checks that no run passes over its training data twice (one pass), and says so.

Hyperparameters: each feature's defaults and the project's default learning rates, printed from
lesson 07's own flags; no sweep. A recipe whose flags lesson 07 does not accept is skipped with
its reason. It writes every run to --out (JSON) and prints a markdown table per comparison: the
median validation loss over the seeds, its min-max spread, the change against the baseline.

It ranks recipes at small scale on a CPU: a 0.85 M-parameter model for about a million tokens.
It supports no claim about GPU-scale runs, where the best recipe and its settings may differ.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import hashlib
import io
import json
import os
import platform
import queue
import statistics
import subprocess
import sys
import sysconfig
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from picotron_like.data import main as prepare_command
from picotron_like.data import read_token_shard, write_token_shard
from picotron_like.lessons import REPO_ROOT, load_lesson
from picotron_like.model import count_parameters
from picotron_like.plot import read_metrics
from picotron_like.train import config_from_flags, resolve_decay_share

LESSON = REPO_ROOT / "07_full_5d.py"

# The run every recipe shares: the tiny preset on 4,096-token steps of 4 micro-batches of 8
# sequences of 128 tokens (one core of this 2-core machine, otherwise idle, trained about 10,000
# tokens/s of it: about a million tokens, 250-300 steps, in 2 minutes).
SEQ_LEN, MICRO_BATCH_SIZE, GLOBAL_BATCH_TOKENS = 128, 8, 4096
SEQUENCES_PER_STEP = GLOBAL_BATCH_TOKENS // SEQ_LEN
# 65,536 validation tokens, about 3 s of forward passes at the end of each run (the time budget
# keeps a training step's time for each batch until a validation has been timed: 7 s).
VAL_BATCHES = 16
VAL_FILE_EVERY = 20             # one source file in 20 goes to the validation split
COMMON_FLAGS = ["--preset", "tiny", "--zero-stage", "0", "--seq-len", str(SEQ_LEN),
                "--micro-batch-size", str(MICRO_BATCH_SIZE), "--global-batch-tokens", str(GLOBAL_BATCH_TOKENS),
                "--val-every", str(10**9)]      # validate after the last step only

# The ramp: from one micro-batch (a quarter of the batch) to the full batch over the first 262,144
# tokens, about a quarter of what the baseline trains in 2 minutes. The flag has no default; this
# is the benchmark's choice, not tuned.
RAMP_FLAGS = ["--batch-ramp", str(MICRO_BATCH_SIZE * SEQ_LEN), str(64 * GLOBAL_BATCH_TOKENS)]
# Each recipe is the flags it adds to lesson 07's defaults; "baseline" is today's recipe.
RECIPES = {
    "baseline": [],
    "muon": ["--optimizer", "muon"],
    "wsd": ["--lr-schedule", "wsd"],
    "ramp": RAMP_FLAGS,
    "all": ["--optimizer", "muon", "--lr-schedule", "wsd", *RAMP_FLAGS],
}
BASELINE = "baseline"
# Lesson 07's settings printed for each recipe: those whose names hold one of these words.
SETTINGS_SHOWN = ("optimizer", "lr", "warmup", "decay", "ramp", "muon", "momentum", "nesterov")
# --quick: the first 2 of these recipes lesson 07 accepts, validated on 2 of the batches
QUICK = {"minutes": 0.4, "seeds": 1, "val_batches": 2, "recipes": [BASELINE, "muon", "wsd"]}


# ----------------------------------------------------------------------------- the corpus


@dataclass(frozen=True)
class Corpus:
    train: Path
    val: Path
    train_tokens: int
    val_tokens: int
    train_files: int
    val_files: int
    source: str


def stdlib_sources(stdlib: Path) -> list[Path]:
    """The standard library's *.py files under `stdlib`, sorted by their path below it: not the
    installed packages (site-packages, dist-packages: they differ from machine to machine), not the
    test suites (test, tests, idle_test: some hold deliberately malformed files, and distributions
    often leave them out), not a file that is not UTF-8 (prepare reads UTF-8)."""
    skipped_folders = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}
    files = []
    for path in sorted(stdlib.rglob("*.py"), key=lambda p: p.relative_to(stdlib).as_posix()):
        if skipped_folders.intersection(path.relative_to(stdlib).parts[:-1]):
            continue
        try:
            path.read_bytes().decode("utf-8")
        except UnicodeDecodeError:
            continue
        files.append(path)
    return files


def prepare_corpus(data_dir: Path, stdlib: Path, val_windows: int, seq_len: int = SEQ_LEN) -> Corpus:
    """The train and validation shards of the standard library's sources, prepared once and reused
    while the same files (names and sizes) and the same cut are asked for. The validation shard is
    cut to `val_windows` windows of seq_len tokens (and the one token the last window's target
    needs), so that validation batches covering `val_windows` windows score each exactly once."""
    files = stdlib_sources(stdlib)
    # The shard keeps the head of the validation files: in an order by hash, so that it samples
    # the library's packages rather than the start of the alphabet.
    val_files = sorted(files[::VAL_FILE_EVERY],
                       key=lambda path: hashlib.sha256(path.relative_to(stdlib).as_posix().encode()).hexdigest())
    train_files = [path for index, path in enumerate(files) if index % VAL_FILE_EVERY]
    listing = "\n".join(f"{split} {path.relative_to(stdlib).as_posix()} {path.stat().st_size}"
                        for split, paths in (("train", train_files), ("val", val_files)) for path in paths)
    stem = data_dir / f"stdlib_py{sys.version_info.major}{sys.version_info.minor}"
    train, val, manifest_path = Path(f"{stem}_train.bin"), Path(f"{stem}_val.bin"), Path(f"{stem}.json")
    manifest = {"stdlib": str(stdlib), "files_sha256": hashlib.sha256(listing.encode()).hexdigest(),
                "train_files": len(train_files), "val_files": len(val_files), "val_windows": val_windows,
                "seq_len": seq_len}
    if not (manifest_path.is_file() and json.loads(manifest_path.read_text()) == manifest
            and train.is_file() and val.is_file()):
        for paths, output in ((train_files, train), (val_files, val)):     # `python -m picotron_like.data prepare`
            prepare_command(["prepare", *map(str, paths), str(output), "--tokenizer", "byte"])
        val_tokens = read_token_shard(val)
        needed = val_windows * seq_len + 1
        if val_tokens.size < needed:
            raise SystemExit(f"error: the validation files hold {val_tokens.size} tokens, fewer than the "
                             f"{needed} that {val_windows} windows of {seq_len} need")
        write_token_shard(val, val_tokens[:needed].copy())
        manifest_path.write_text(json.dumps(manifest, indent=1) + "\n")
    return Corpus(train, val, int(read_token_shard(train).size), int(read_token_shard(val).size),
                  len(train_files), len(val_files),
                  f"Python {platform.python_version()}'s standard library sources ({stdlib})")


def tokens_per_pass(corpus: Corpus, seq_len: int = SEQ_LEN) -> int:
    """The tokens one pass over the training windows trains on (data.TokenBatches' windows)."""
    return (corpus.train_tokens - 1) // seq_len * seq_len


# ----------------------------------------------------------------------------- the recipes


def parse_lesson_flags(flags: list[str]):
    """Lesson 07's settings for these flags, or the one-line reason it refuses them."""
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            return load_lesson("07_full_5d").parse_args(flags), None
    except SystemExit:
        lines = [line for line in stderr.getvalue().splitlines() if line.strip()]
        return None, lines[-1].split("error: ", 1)[-1] if lines else "refused"      # argparse's, without its usage


def available_recipes(recipes: dict[str, list[str]]) -> tuple[dict[str, dict], dict[str, str]]:
    """The recipes lesson 07 accepts, each with the settings it runs (SETTINGS_SHOWN, the defaults
    lesson 07 fills in at start-up included; None: a setting the recipe does not use), and the
    refused ones with lesson 07's reason (a feature not yet there)."""
    available, skipped = {}, {}
    for name, flags in recipes.items():
        args, reason = parse_lesson_flags(COMMON_FLAGS + flags)
        if args is None:
            skipped[name] = reason
            continue
        resolve_decay_share(args)
        unused = "muon_" if args.optimizer != "muon" else None      # Muon's settings without Muon
        available[name] = {key: value for key, value in sorted(vars(args).items())
                           if any(word in key for word in SETTINGS_SHOWN) and value is not None
                           and not (unused and key.startswith(unused))}
    return available, skipped


# ----------------------------------------------------------------------------- one run


@dataclass
class Run:
    """One training run: what was asked, and what its metrics file says it did."""

    recipe: str
    comparison: str             # "budget" (--max-minutes) or "tokens" (--steps)
    seed: int
    flags: list
    core: int | None = None
    load_average: float | None = None   # the machine's 1-minute load average when it started
    exit_code: int | None = None
    error: str | None = None
    steps: int | None = None
    tokens: int | None = None
    wall_s: float | None = None         # the torchrun command's, start-up and report included
    train_s: float | None = None        # the steps' own seconds, added up
    val_loss: float | None = None
    final_lr: float | None = None
    planned_steps: int | None = None    # the time budget's estimate, where its schedule ends
    step_tokens: list | None = None     # tokens of each step (a ramp's grow)

    @property
    def name(self) -> str:
        return f"{self.comparison}_{self.recipe}_seed{self.seed}"


def run_command(run: Run) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1", str(LESSON),
            *run.flags]


def execute(run: Run, core: int | None, runs_dir: Path, timeout_s: float) -> Run:
    """Train `run` on one core with one thread and read back its metrics file."""
    metrics, log = runs_dir / f"{run.name}.jsonl", runs_dir / f"{run.name}.log"
    metrics.unlink(missing_ok=True)
    run.flags = [*run.flags, "--metrics", str(metrics)]
    run.core, run.load_average = core, os.getloadavg()[0]
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONPATH=str(REPO_ROOT))
    pinned = ["taskset", "-c", str(core)] if core is not None else []
    started = time.perf_counter()
    with open(log, "w") as output:
        process = subprocess.Popen(pinned + run_command(run), cwd=REPO_ROOT, env=env, stdout=output,
                                   stderr=subprocess.STDOUT)
        try:
            run.exit_code = process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            run.error = f"no end after {timeout_s:.0f} s: stopped"
            process.terminate()         # torchrun passes SIGTERM on to its rank (a session of its own)
            try:
                run.exit_code = process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                process.kill()
                run.exit_code = process.wait()
    run.wall_s = time.perf_counter() - started
    lines = log.read_text(errors="replace").splitlines()
    if run.exit_code != 0 or not metrics.is_file():
        run.error = run.error or next((line for line in lines if line.startswith("error:")),
                                      f"exit code {run.exit_code}, see {log}")
        return run
    records = read_metrics(metrics)
    # A step's tokens are its tokens/s times its seconds (the log's own figures: a ramp's step counts
    # the micro-batches it ran).
    run.step_tokens = [round(record["tokens_per_s"] * record["seconds"]) for record in records]
    run.steps, run.tokens = len(records), sum(run.step_tokens)
    run.train_s = sum(record["seconds"] for record in records)
    run.val_loss, run.final_lr = records[-1].get("val_loss"), records[-1]["lr"]
    run.planned_steps = next((int(line.split()[2]) for line in lines
                              if line.startswith("time budget: ") and " steps fit in " in line), None)
    if run.val_loss is None:
        run.error = "no validation after the last step"
    return run


def execute_all(runs: list[Run], cores: list[int | None], runs_dir: Path, timeout_s: float) -> None:
    """Every run, one per core at a time, in the order given; each finished run is printed."""
    pending: queue.Queue = queue.Queue()
    for run in runs:
        pending.put(run)
    printing = threading.Lock()

    def worker(core):
        while True:
            try:
                run = pending.get_nowait()
            except queue.Empty:
                return
            execute(run, core, runs_dir, timeout_s)
            with printing:
                outcome = (f"val loss {run.val_loss:.4f}, {run.steps} steps, {run.tokens:,} tokens"
                           if run.error is None else f"FAILED: {run.error}")
                print(f"  {run.name:<28} core {core}  load {run.load_average:4.2f}  {run.wall_s:6.1f} s  {outcome}",
                      flush=True)

    workers = [threading.Thread(target=worker, args=(core,)) for core in cores]
    for thread in workers:
        thread.start()
    for thread in workers:
        thread.join()


def steps_for_tokens(step_tokens: list[int], target: int) -> int:
    """The number of steps whose tokens come nearest to `target` (a tie: the more steps, at least
    one), for a run whose steps train `step_tokens` (measured in its budget run; later steps as
    its last, the full batch)."""
    done, steps = 0, 0
    while True:
        tokens = step_tokens[min(steps, len(step_tokens) - 1)]
        if done + tokens >= target:
            return steps + 1 if steps == 0 or done + tokens - target <= target - done else steps
        done, steps = done + tokens, steps + 1


# ----------------------------------------------------------------------------- the table


def summarise(runs: list[Run], comparison: str, recipes: list[str]) -> list[dict]:
    """Per recipe (in `recipes`' order) of one comparison: the median and spread of the final
    validation loss over its seeds, the median tokens, steps and wall seconds, the change of the
    median loss against the baseline's. Failed runs count as missing (`runs` says how many ran)."""
    rows = []
    for recipe in recipes:
        done = [run for run in runs if run.comparison == comparison and run.recipe == recipe and run.error is None]
        asked = [run for run in runs if run.comparison == comparison and run.recipe == recipe]
        if not asked:
            continue
        losses = [run.val_loss for run in done]
        rows.append({"recipe": recipe, "runs": f"{len(done)}/{len(asked)}",
                     "median": statistics.median(losses) if losses else None,
                     "min": min(losses, default=None), "max": max(losses, default=None),
                     "tokens": statistics.median([run.tokens for run in done]) if done else None,
                     "steps": statistics.median([run.steps for run in done]) if done else None,
                     "wall_s": statistics.median([run.wall_s for run in done]) if done else None})
    baseline = next((row["median"] for row in rows if row["recipe"] == BASELINE), None)
    for row in rows:
        row["vs_baseline"] = (row["median"] - baseline if row["median"] is not None and baseline is not None
                              else None)
    return rows


def markdown_table(rows: list[dict]) -> str:
    def number(value, form):
        return "–" if value is None else format(value, form)

    lines = ["| recipe | val loss, median | min – max | vs baseline | tokens | steps | wall s | runs |",
             "|---|---|---|---|---|---|---|---|"]
    for row in rows:
        lines.append(f"| {row['recipe']} | {number(row['median'], '.4f')} | {number(row['min'], '.4f')} – "
                     f"{number(row['max'], '.4f')} | {number(row['vs_baseline'], '+.4f')} | "
                     f"{number(row['tokens'], ',.0f')} | {number(row['steps'], '.0f')} | "
                     f"{number(row['wall_s'], '.0f')} | {row['runs']} |")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- main


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=2.0, help="each budget run's --max-minutes (default: 2)")
    parser.add_argument("--seeds", type=int, default=3, help="seeds per recipe and comparison (default: 3)")
    parser.add_argument("--recipes", nargs="+", choices=list(RECIPES), default=None,
                        help="the recipes to run, the baseline always among them (default: all; with --quick, the "
                             "first 2 lesson 07 accepts of " + ", ".join(QUICK["recipes"]) + ")")
    parser.add_argument("--cores", default="0,1",
                        help="the cores runs are pinned to, one run per core at a time (default: 0,1)")
    parser.add_argument("--quick", action="store_true",
                        help="a check of the script: 24-second budgets, 1 seed, the baseline and one other recipe, "
                             "2 validation batches")
    parser.add_argument("--budget-only", action="store_true",
                        help="the budget comparison alone (to measure again what a change to the time budget moves)")
    parser.add_argument("--data-dir", type=Path, default=REPO_ROOT / "data",
                        help="where the corpus is prepared once (default: data/ in the repository)")
    parser.add_argument("--out", type=Path, default=None,
                        help="the runs as JSON (default: benchmarks/time_budget_recipes.json; with --quick, "
                             "time_budget_recipes_quick.json in --data-dir)")
    args = parser.parse_args(argv)
    if args.quick:
        args.minutes, args.seeds, args.val_batches = QUICK["minutes"], QUICK["seeds"], QUICK["val_batches"]
    else:
        args.val_batches = VAL_BATCHES
    if args.out is None:
        args.out = (args.data_dir / "time_budget_recipes_quick.json" if args.quick
                    else REPO_ROOT / "benchmarks" / "time_budget_recipes.json")
    args.cores = [int(core) for core in args.cores.split(",")]
    return args


def print_setup(args, corpus: Corpus, available: dict, skipped: dict, parameters: int) -> None:
    print(f"{args.date}: {args.command}\n"
          f"corpus: {corpus.source}: {corpus.train_files} files, {corpus.train_tokens:,} training tokens (byte "
          f"tokenizer); {corpus.val_files} others, {corpus.val_tokens:,} validation tokens, every run scored on "
          f"{args.val_batches * GLOBAL_BATCH_TOKENS:,} of them\n"
          f"model and run: lesson 07, {parameters:,} parameters, {' '.join(COMMON_FLAGS)}, 1 rank, 1 thread, runs "
          f"pinned to cores {args.cores}\nrecipes (each feature's defaults, the project's learning rates, no sweep):")
    for name, settings in available.items():
        print(f"  {name:<9} {' '.join(RECIPES[name]) or '(lesson 07 defaults)'}\n            "
              + ", ".join(f"{key} {value}" for key, value in settings.items()))
    for name, reason in skipped.items():
        print(f"  {name:<9} skipped: lesson 07 refuses {' '.join(RECIPES[name])}: {reason}")


def runs_of(args, comparison: str, recipes: list[str], data_flags: list[str], length_of) -> list[Run]:
    """Each recipe on each seed, a round of recipes per seed; `length_of(recipe, seed)`: the flags
    that end the run (None: there is no run, and the Run says why)."""
    runs = []
    for seed in range(args.seeds):
        for recipe in recipes:
            length = length_of(recipe, seed)
            runs.append(Run(recipe, comparison, seed, [*COMMON_FLAGS, *data_flags, *RECIPES[recipe], "--seed",
                                                       str(seed), *(length or [])],
                            error=None if length is not None else "its budget run failed: no steps to measure"))
    return runs


def print_tables(args, runs: list[Run], recipes: list[str], target: int, one_pass: int, parameters: int) -> dict:
    """The one-pass check and a table per comparison; returns the tables' rows."""
    largest = max((run.tokens for run in runs if run.error is None), default=0)
    print(f"\n{args.date}: {args.command} ({(time.perf_counter() - args.started) / 60:.1f} minutes)\n"
          f"one pass: the largest run trained {largest:,} of the {one_pass:,} training tokens ({largest / one_pass:.1%}): "
          + ("no run saw a token twice" if largest <= one_pass else "MORE THAN ONE PASS: the corpus is too small for it"))
    titles = {"budget": f"in a budget of {args.minutes:g} minutes per run (start-up included): the loss per minute",
              "tokens": f"at equal tokens ({target:,} per run): the loss per token"}
    if args.budget_only:
        del titles["tokens"]
    tables = {}
    for comparison, title in titles.items():
        tables[comparison] = summarise(runs, comparison, recipes)
        print(f"\nValidation loss {title}; {args.seeds} seed(s) per recipe:\n\n{markdown_table(tables[comparison])}")
    cut_short = [run.name for run in runs if run.planned_steps is not None and run.steps < run.planned_steps]
    print(f"\nBudget runs stopped before the last step of their schedule (steps slower than the budget's estimate, "
          f"the learning rate not fully decayed): {', '.join(cut_short) or 'none'}")
    print(f"\nThis ranks recipes at small scale on a CPU ({parameters:,} parameters, {target:,} tokens, one core per "
          f"run); it supports no claim about GPU-scale runs.")
    return tables


def equal_token_runs(args, budget_runs: list[Run], recipes: list[str], data_flags: list[str], one_pass: int,
                     target: int, runs_dir: Path) -> list[Run]:
    """The second comparison: each recipe and seed trained for the baseline's median tokens."""
    # A recipe's steps for the target come from its own budget run of the same seed (a ramp's steps
    # grow); without one (it failed) the recipe has no run at equal tokens.
    measured = {(run.recipe, run.seed): run.step_tokens for run in budget_runs if run.error is None}
    print(f"\n2. tokens: {target:,} tokens per run (the baseline's median in the budget), {target / one_pass:.1%} "
          f"of a pass", flush=True)
    token_runs = runs_of(args, "tokens", recipes, data_flags,
                         lambda recipe, seed: ["--steps", str(steps_for_tokens(measured[recipe, seed], target))]
                         if (recipe, seed) in measured else None)
    execute_all([run for run in token_runs if run.error is None], args.cores, runs_dir,
                timeout_s=4 * 60 * args.minutes + 120)
    return token_runs


def main(argv=None):
    args = parse_args(argv)
    args.command = "python benchmarks/time_budget_recipes.py " + " ".join(sys.argv[1:] if argv is None else argv)
    args.started = time.perf_counter()
    args.date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    wanted = dict.fromkeys([BASELINE, *(args.recipes or (QUICK["recipes"] if args.quick else RECIPES))])
    available, skipped = available_recipes({name: RECIPES[name] for name in wanted})
    if BASELINE not in available:
        raise SystemExit(f"error: lesson 07 refuses the baseline's flags: {skipped[BASELINE]}")
    recipes = list(available)[:2] if args.quick and args.recipes is None else list(available)
    parameters = count_parameters(config_from_flags(parse_lesson_flags(COMMON_FLAGS)[0]))["total"]
    corpus = prepare_corpus(args.data_dir, Path(sysconfig.get_paths()["stdlib"]), VAL_BATCHES * SEQUENCES_PER_STEP)
    data_flags = ["--data", str(corpus.train), "--val-data", str(corpus.val), "--val-batches", str(args.val_batches)]
    print_setup(args, corpus, available, skipped, parameters)
    runs_dir = args.data_dir / "time_budget_recipes_runs"
    runs_dir.mkdir(parents=True, exist_ok=True)

    print(f"\n1. budget: --max-minutes {args.minutes:g} per run (logs and metrics in {runs_dir})", flush=True)
    budget_runs = runs_of(args, "budget", recipes, data_flags, lambda recipe, seed: ["--max-minutes", str(args.minutes)])
    execute_all(budget_runs, args.cores, runs_dir, timeout_s=60 * args.minutes + 120)
    baseline_tokens = [run.tokens for run in budget_runs if run.recipe == BASELINE and run.error is None]
    if not baseline_tokens:
        raise SystemExit(f"error: no baseline run ended in the budget, so there is no token count to hold the "
                         f"recipes to; see the logs in {runs_dir}")
    target = int(statistics.median(baseline_tokens))

    one_pass = tokens_per_pass(corpus)
    token_runs = [] if args.budget_only else equal_token_runs(args, budget_runs, recipes, data_flags, one_pass,
                                                               target, runs_dir)
    runs = budget_runs + token_runs
    tables = print_tables(args, runs, recipes, target, one_pass, parameters)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "date": args.date, "command": args.command,
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
                    "torch": torch.__version__},
        "corpus": asdict(corpus) | {"tokens_per_pass": one_pass}, "parameters": parameters,
        "common_flags": COMMON_FLAGS, "recipes": {name: RECIPES[name] for name in recipes}, "settings": available,
        "skipped": skipped, "minutes": args.minutes, "equal_tokens": target, "tables": tables,
        "runs": [asdict(run) for run in runs]}, indent=1, default=str) + "\n")
    print(f"\nall runs: {args.out}")
    if any(run.error is not None for run in runs) or max(run.tokens or 0 for run in runs) > one_pass:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
