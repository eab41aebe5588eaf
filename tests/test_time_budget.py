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
from picotron_like.lr_schedule import learning_rate, wsd_learning_rate
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
    for step in range(3):
        clock.step()
        budget.note_step(step)
    with budget.timing("checkpoint"):
        clock.now += 3.0
    assert budget.estimate_due() and budget.slowest_step_s() == 2.0 and budget.end_s() == 11.0
    assert budget.planned_steps(3, train.NO_STEP_LIMIT) == 16 and not budget.estimate_due()
    assert budget.planned_steps(3, 10) == 10            # --steps stays the most the run may take
    with budget.timing("validation"):                   # once timed, the validation's own time counts
        clock.now += 0.5
    assert budget.end_s() == 0.5 + 3.0 + 4.0
    spent = []
    for step in range(3, 8):
        clock.step()
        budget.note_step(step)
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
    """Lesson 01 at dp = 2 through the shared loop, each run on a clock its steps move: 1 s a step
    after 5 s of start-up, 30 s budget, validation at the end only. Run 'steady' ends where the
    estimate said; in run 'stall', rank 1's step 8 takes 12 s more, and every rank stops early.
    Under --lr-schedule wsd: 'wsd' runs steadily; in 'wsd sooner' rank 1's step 10 takes 0.75 s
    more, in 'wsd mid-decay' its step 17 0.2 s more. Then three runs resume (a fresh clock, the same
    budget) from what a checkpoint records of the plan (time_budget_settings) after step 9 of 'wsd'
    (stable), step 17 of 'wsd' (mid-decay) and step 12 of 'wsd sooner' (a decay the budget moved)."""
    lesson = load_lesson("01_data_parallel")
    grid = ProcessGrid(GridShape(dp=2))
    paths = builtin_corpus_paths()
    on_rank_1 = dist.get_rank() == 1

    def budgeted_run(stalls: dict, schedule: dict, start_step: int = 0, plan: dict | None = None) -> dict:
        model = lesson.wrap_data_parallel(GPT(CFG, seed=3), grid.dp_group, "bucketed", 64 * 1024)
        optimizer = train.build_optimizer(model.module, 3e-3)
        settings = train.StepSettings(torch.device("cpu"))
        clock, rates, saved, plans = StepClock(5.0, 1.0, stalls if on_rank_1 else {}), [], [], {}

        def step_fn(batch):
            rates.append(optimizer.param_groups[0]["lr"])
            result = lesson.train_step(model, optimizer, batch, settings)
            clock.step()
            return result

        def after_step(step, last):
            saved.append((step, last))
            plans[step] = run_control.time_budget_settings(args)      # what a checkpoint records of the plan

        args = argparse.Namespace(steps=train.NO_STEP_LIMIT, max_minutes=0.5, lr=3e-3, warmup_steps=2, metrics=None,
                                  val_every=1000, val_batches=2, profile=None, **schedule)
        if plan is not None:
            run_control.follow_time_budget(args, plan)
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            batches = train.RankBatches(TokenBatches(paths[0], SHAPE, seed=3, vocab_size=CFG.vocab_size),
                                        grid.dp_rank, torch.device("cpu"),
                                        val=TokenBatches(paths[1], SHAPE, seed=3, vocab_size=CFG.vocab_size))
            train.train(args, optimizer, step_fn, batches, evaluate=partial(lesson.evaluate, model, settings=settings),
                        start_step=start_step, after_step=after_step, clock=clock)
        return {"steps": args.steps, "rates": rates, "saved": saved, "printed": printed.getvalue(), "end": clock.now,
                "plans": plans, "decay_start": getattr(args, "decay_start", None)}

    wsd = {"lr_schedule": "wsd", "decay_share": 0.2}
    outcome = {"steady": budgeted_run({}, {}), "stall": budgeted_run({8: 12.0}, {}),
               "wsd": budgeted_run({}, wsd), "wsd sooner": budgeted_run({10: 1.25}, wsd),
               "wsd mid-decay": budgeted_run({17: 0.2}, wsd)}
    for name, run, step in [("resumed stable", "wsd", 9), ("resumed mid-decay", "wsd", 17),
                            ("resumed moved", "wsd sooner", 12)]:
        outcome[name] = budgeted_run({}, wsd, start_step=step + 1, plan=outcome[run]["plans"][step])
    return outcome


@pytest.fixture(scope="module")
def budgeted():
    """Every rank's budgeted_runs, by run: a list of the ranks' outcomes."""
    ranks = run_ranks(2, budgeted_runs)
    return {name: [rank[name] for rank in ranks] for name in ranks[0]}


def test_every_rank_stops_inside_the_budget_at_the_same_step_with_the_final_validation(budgeted):
    """Steady: after 3 steps the clock says 8 s; the end keeps 2 validation batches as 2 steps and
    two steps of margin, 4 s; (30 - 8 - 4) / 1 = 18 more steps: 21. Every rank runs 21 steps at the
    rates of a 21-step schedule, validates and checkpoints after the last, and ends at 26 s.
    Stall: rank 1 sees step 8 take 13 s; at 5 + 9 + 12 = 26 s, two such steps no longer fit, it asks
    to stop, and both ranks stop after step 9, the one after it (AgreedStop's lag), validated."""
    steady, stall = budgeted["steady"], budgeted["stall"]
    for rank in steady:
        assert rank["steps"] == 21 and rank["end"] == 26.0 <= 30.0
        assert rank["rates"] == [learning_rate(step, 3e-3, 2, 21) for step in range(21)]
        assert rank["saved"] == [(step, step == 20) for step in range(21)]
    assert "time budget: 21 steps fit in 0.5 minutes (1.00 s a step, 4.0 s kept for the end); the learning rate " \
           "decays to step 20\n" in steady[0]["printed"]
    assert re.search(r"step   20 \| val loss \d\.\d{4}\ntime budget: 21 steps, 5,376 tokens in 26\.0 s of 30 s; "
                     r"final val loss \d\.\d{4}\n", steady[0]["printed"]), steady[0]["printed"]
    for rank in stall:
        assert [step for step, last in rank["saved"] if last] == [9] and len(rank["saved"]) == 10
    assert "stopped after step 9: the time budget (11 steps left)" in stall[0]["printed"]
    assert re.search(r"step    9 \| val loss \d\.\d{4}\n", stall[0]["printed"])
    assert steady[1]["printed"] == stall[1]["printed"] == ""


def test_wsd_decays_over_the_budgets_last_share_and_sooner_when_the_steps_slow(budgeted):
    """wsd: the same 21 steps, the decay over their last 20 % of tokens (256 a step): from 16.8
    steps' worth, so step 16 is the first below the peak (it ends at 17 steps' > 16.8) and step
    20 runs at the minimum, 0.1 x the peak.
    Sooner: rank 1's step 10 takes 2.25 s; after it, at 5 + 11 + 1.25 = 17.25 s, with the end
    kept at 4 x 2.25 = 9 s (the margin at the slowest step) and the steps to come at the pace of
    the last ten, 1.125 s: (30 - 17.25 - 9) / 1.125 = 3.3, so 14 steps fit (priced at the slowest
    step, as the end is, one stall would have cut the plan to 13). Agreed after step 11, the plan
    is 14 steps from step 12 on, whose last 20 % (from 11.2) has begun: the decay starts at step
    12 and reaches the minimum at step 13, the last; every rank ends there, validated.
    Mid-decay: rank 1's step 17 takes 1.2 s: at 23.2 s, (30 - 23.2 - 4.8) / 1.02 leaves 19 steps,
    at least one after step 18 when agreed: 20. The decay keeps its start and steepens: step 19,
    the last, at the minimum. Rank 0 prints each plan; the budget holds in every run."""
    def tokens(step):
        return step * SHAPE.tokens_per_step

    for rank in budgeted["wsd"]:
        assert rank["steps"] == 21 and rank["decay_start"] == 0.8 * tokens(21)
        assert rank["rates"] == [wsd_learning_rate(step, 3e-3, 2, 21, 0.8 * tokens(21), tokens_before=tokens)
                                 for step in range(21)]
        assert rank["rates"][15] == 3e-3 > rank["rates"][16] and rank["rates"][20] == pytest.approx(3e-4)
    assert "time budget: 21 steps fit in 0.5 minutes (1.00 s a step, 4.0 s kept for the end); the learning rate " \
           "decays from step 16 to step 20\n" in budgeted["wsd"][0]["printed"]
    for rank in budgeted["wsd sooner"]:
        assert rank["steps"] == 14 and rank["decay_start"] == tokens(12) and rank["end"] <= 30.0
        assert rank["rates"][:12] == budgeted["wsd"][0]["rates"][:12]
        assert rank["rates"][12:] == [wsd_learning_rate(step, 3e-3, 2, 14, tokens(12), tokens_before=tokens)
                                      for step in (12, 13)]
        assert rank["rates"][13] == pytest.approx(3e-4) and rank["saved"][-1] == (13, True)
    assert "time budget: the steps slowed down: 14 steps fit, not 21; the learning rate decays from step 12 to " \
           "step 13\n" in budgeted["wsd sooner"][0]["printed"]
    assert re.search(r"step   13 \| val loss \d\.\d{4}\n", budgeted["wsd sooner"][0]["printed"])
    for rank in budgeted["wsd mid-decay"]:
        assert rank["steps"] == 20 and rank["decay_start"] == 0.8 * tokens(21) and rank["end"] <= 30.0
        assert rank["rates"][:19] == budgeted["wsd"][0]["rates"][:19]
        assert rank["rates"][19] == pytest.approx(3e-4) and budgeted["wsd"][0]["rates"][19] > 3.1e-4
    assert "time budget: the steps slowed down: 20 steps fit, not 21; the learning rate decays from step 16 to " \
           "step 19\n" in budgeted["wsd mid-decay"][0]["printed"]


def test_a_wsd_run_resumes_on_its_schedule_from_the_stable_phase_or_mid_decay(budgeted):
    """What a checkpoint records of the plan (planned steps, where the decay starts) makes a
    resumed run, with a budget of its own, follow the first run's rates to the same last step: from
    the stable phase, mid-decay, and a decay the budget moved earlier (not the share's place)."""
    for name, run, step in [("resumed stable", "wsd", 9), ("resumed mid-decay", "wsd", 17),
                            ("resumed moved", "wsd sooner", 12)]:
        for resumed, first in zip(budgeted[name], budgeted[run]):
            assert "steps fit" not in resumed["printed"]
            assert resumed["rates"] == first["rates"][step + 1:] and resumed["steps"] == first["steps"], name


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
