"""--max-minutes: the shared loop ends inside a time budget, its learning rate decaying to the step the
budget allows, every rank stopping after the same step, the final validation and checkpoint written.

The decisions are tested with an injected clock (exact numbers, on real gloo ranks); one real run of
lesson 07 shows the budget held on a real clock, the checkpoint carrying the plan, and a resumed run
following it."""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import subprocess
import sys
from dataclasses import replace
from functools import partial

import pytest
import torch
import torch.distributed as dist

from picotron_like import run_control, train
from picotron_like.data import BatchShape, TokenBatches, builtin_corpus_paths
from picotron_like.lessons import REPO_ROOT, load_lesson
from picotron_like.model import GPT, get_config
from picotron_like.testing import run_ranks
from picotron_like.topology import ConfigError, GridShape, ProcessGrid

CFG = replace(get_config("tiny"), n_layers=2, hidden=64, n_heads=4, n_kv_heads=2, ffn_hidden=128)
SHAPE = BatchShape(micro_batch_size=2, seq_len=32, grad_accum=2, dp=2)


class StepClock:
    """Seconds since the process started, moved by the steps themselves: `start` before the first,
    `per_step` per step, and `stall` more on the steps listed for this rank (a slow step)."""

    def __init__(self, start: float, per_step: float, stalls: dict[int, float]):
        self.now, self.per_step, self.stalls, self.steps = start, per_step, stalls, 0

    def __call__(self) -> float:
        return self.now

    def step(self) -> None:
        self.now += self.per_step + self.stalls.get(self.steps, 0.0)
        self.steps += 1


def test_the_estimate_fits_the_steps_the_time_left_allows():
    """60 s budget; 10 s of start-up, then steps of 2 s (the first 5 s: compiling, say). After the
    three steps the estimate follows and a 3 s checkpoint, 10 + 5 + 2 + 2 + 3 = 22 s have gone; the
    end keeps the final validation (2 batches: as long as 2 steps until one is timed), a checkpoint
    and two steps: 4 + 3 + 4 = 11 s. (60 - 22 - 11) / 2 = 13.5: 13 more steps, 16 in all. A later
    step of 17 s spends it."""
    clock = StepClock(10.0, 2.0, {0: 3.0, 5: 15.0})
    budget = run_control.TimeBudget(1.0, clock, val_batches=2)
    for _ in range(3):
        clock.step()
        budget.note_step()
    with budget.timing("checkpoint"):
        clock.now += 3.0
    assert budget.estimate_due() and budget.slowest_step_s() == 2.0 and budget.end_s() == 11.0
    assert budget.planned_steps(3, train.NO_STEP_LIMIT) == 16 and not budget.estimate_due()
    assert budget.planned_steps(3, 10) == 10            # --steps stays the most the run may take
    with budget.timing("validation"):                   # once timed, the validation's own time counts
        clock.now += 0.5
    assert budget.end_s() == 0.5 + 3.0 + 4.0
    spent = []
    for _ in range(3, 8):
        clock.step()
        budget.note_step()
        spent.append(budget.spent())
    assert spent == [False, False, True, True, True]   # step 5 took 17 s: 43.5 + 0.5 + 3 + 2 * 17 > 60


def test_steps_default_to_the_lessons_unless_a_budget_decides():
    lesson = load_lesson("01_data_parallel")
    for argv, steps in [([], 30), (["--steps", "7"], 7), (["--max-minutes", "2"], train.NO_STEP_LIMIT),
                        (["--max-minutes", "2", "--steps", "7"], 7)]:
        args = lesson.parse_args(argv)
        train.resolve_steps(args)
        assert args.steps == steps, argv
    with pytest.raises(ConfigError, match="--max-minutes 0.0 must be a positive number"):
        train.check_flag_ranges(lesson.parse_args(["--max-minutes", "0"]))


def budgeted_runs() -> dict:
    """Lesson 01 at dp = 2 through the shared loop, twice, each on a clock its steps move: 1 s a
    step after 5 s of start-up, 30 s budget, validation at the end only. Run 'steady' ends where the
    estimate said; in run 'stall', rank 1's step 8 takes 12 s more, and every rank stops early."""
    lesson = load_lesson("01_data_parallel")
    grid = ProcessGrid(GridShape(dp=2))
    paths = builtin_corpus_paths()
    outcome = {}
    for name, stalls in [("steady", {}), ("stall", {8: 12.0} if dist.get_rank() == 1 else {})]:
        model = lesson.wrap_data_parallel(GPT(CFG, seed=3), grid.dp_group, "bucketed", 64 * 1024)
        optimizer = train.build_optimizer(model.module, 3e-3)
        settings = train.StepSettings(torch.device("cpu"))
        clock, rates, saved = StepClock(5.0, 1.0, stalls), [], []

        def step_fn(batch):
            rates.append(optimizer.param_groups[0]["lr"])
            result = lesson.train_step(model, optimizer, batch, settings)
            clock.step()
            return result

        args = argparse.Namespace(steps=train.NO_STEP_LIMIT, max_minutes=0.5, lr=3e-3, warmup_steps=2, metrics=None,
                                  val_every=1000, val_batches=2, profile=None)
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            batches = train.RankBatches(TokenBatches(paths[0], SHAPE, seed=3, vocab_size=CFG.vocab_size),
                                        grid.dp_rank, torch.device("cpu"),
                                        val=TokenBatches(paths[1], SHAPE, seed=3, vocab_size=CFG.vocab_size))
            train.train(args, optimizer, step_fn, batches, evaluate=partial(lesson.evaluate, model, settings=settings),
                        after_step=lambda step, last: saved.append((step, last)), clock=clock)
        outcome[name] = {"steps": args.steps, "rates": rates, "saved": saved, "printed": printed.getvalue(),
                         "end": clock.now}
    return outcome


def test_every_rank_stops_inside_the_budget_at_the_same_step_with_the_final_validation():
    """Steady: after 3 steps the clock says 8 s; the end keeps 2 validation batches as 2 steps and
    two steps of margin, 4 s; (30 - 8 - 4) / 1 = 18 more steps: 21. Every rank runs 21 steps at the
    rates of a 21-step schedule, validates and checkpoints after the last, and ends at 26 s.
    Stall: rank 1 sees step 8 take 13 s; at 5 + 9 + 12 = 26 s, two such steps no longer fit, it asks
    to stop, and both ranks stop after step 9, the one after it (AgreedStop's lag), validated."""
    steady, stall = zip(*[(rank["steady"], rank["stall"]) for rank in run_ranks(2, budgeted_runs)])
    for rank in steady:
        assert rank["steps"] == 21 and rank["end"] == 26.0 <= 30.0
        assert rank["rates"] == [train.learning_rate(step, 3e-3, 2, 21) for step in range(21)]
        assert rank["saved"] == [(step, step == 20) for step in range(21)]
    assert "time budget: 21 steps fit in 0.5 minutes (1.00 s a step, 4.0 s kept for the end)" in steady[0]["printed"]
    assert re.search(r"step   20 \| val loss \d\.\d{4}\ntime budget: 21 steps, 5,376 tokens in 26\.0 s of 30 s; "
                     r"final val loss \d\.\d{4}\n", steady[0]["printed"]), steady[0]["printed"]
    for rank in stall:
        assert [step for step, last in rank["saved"] if last] == [9] and len(rank["saved"]) == 10
    assert "stopped after step 9: the time budget (11 steps left)" in stall[0]["printed"]
    assert re.search(r"step    9 \| val loss \d\.\d{4}\n", stall[0]["printed"])
    assert steady[1]["printed"] == stall[1]["printed"] == ""


def test_a_real_budget_holds_and_a_resumed_run_follows_its_plan(tmp_path):
    """Lesson 07 on two ranks with a 12-second budget on the real clock: it says how many steps fit,
    ends inside the budget with its validation and its last checkpoint, whose manifest carries the
    plan. Resumed from a mid-run checkpoint, with a budget of its own, a run ends at the same
    planned step with exactly the same losses: the learning-rate schedule is the first run's."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    common = ["--n-layers", "2", "--seq-len", "32", "--micro-batch-size", "2", "--val-every", "1000"]

    def run_07(*flags):
        return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                               str(REPO_ROOT / "07_full_5d.py"), *common, *flags],
                              cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=120)

    first = run_07("--max-minutes", "0.2", "--save-dir", str(tmp_path / "a"), "--save-every", "5",
                   "--metrics", str(tmp_path / "a.jsonl"))
    assert first.returncode == 0, first.stdout + first.stderr
    planned = int(re.search(r"^time budget: (\d+) steps fit in 0\.2 minutes", first.stdout, re.M)[1])
    done = re.search(r"^time budget: (\d+) steps, [\d,]+ tokens in ([\d.]+) s of 12 s; final val loss \d", first.stdout,
                     re.M)
    assert done and float(done[2]) <= 12.0, first.stdout
    steps = int(done[1])
    assert 6 <= steps <= planned, first.stdout
    manifest = json.loads((tmp_path / "a" / f"step_{steps:08d}" / "manifest.json").read_text())
    assert manifest["settings"]["planned_steps"] == planned and manifest["settings"]["max_minutes"] == 0.2

    def losses(path):
        return {record["step"]: record["loss"] for record in map(json.loads, path.read_text().splitlines())}

    resumed = run_07("--max-minutes", "1", "--resume", str(tmp_path / "a" / "step_00000005"),
                     "--save-dir", str(tmp_path / "b"), "--metrics", str(tmp_path / "b.jsonl"))
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert "steps fit" not in resumed.stdout            # no estimate of its own: the first run's plan
    first_losses, resumed_losses = losses(tmp_path / "a.jsonl"), losses(tmp_path / "b.jsonl")
    assert sorted(resumed_losses) == list(range(5, planned))
    assert {step: first_losses[step] for step in range(5, steps)} == {step: resumed_losses[step]
                                                                      for step in range(5, steps)}
