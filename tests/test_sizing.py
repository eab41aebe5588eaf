"""--plan --max-minutes (07_sizing.py, picotron_like.compute_optimal): the family of shapes, the steps
that the minutes hold, a proposal that never shrinks as the minutes grow, every assumption printed,
a printed command that 07 accepts and runs as printed, and bad values refused before any work.

The CPU cases price with this machine's profile as benchmarks/step_time_vs_cpu.py had --calibrate
measure it (2 ranks on 2 cores), so the proposal is one this CPU can run."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys

import pytest

from picotron_like.compute_optimal import CHINCHILLA, RunTime, family_member
from picotron_like.lessons import REPO_ROOT, load_lesson
from picotron_like.model import PRESETS, count_parameters
from picotron_like.train import checked_plan, config_from_flags

ASSUMPTIONS = ("rule:", "per minute, not per FLOP:", "the rule's reach:", "the family:", "the minutes:", "the batch:",
               "step time:")


class Stopped(Exception):
    """What exit_with_error raises here instead of ending the test process."""


@pytest.fixture(scope="module")
def cpu_profile(tmp_path_factory):
    profile = json.loads((REPO_ROOT / "benchmarks" / "step_time_vs_cpu.json").read_text())["measured"]["profiles"]["2"]
    path = tmp_path_factory.mktemp("profile") / "cpu.json"
    path.write_text(json.dumps(profile))
    return str(path)


def cpu_flags(profile: str, minutes: float) -> list[str]:
    return ["--plan", "--max-minutes", f"{minutes:g}", "--gpus", "2", "--device-profile", profile]


@pytest.mark.parametrize("preset", [name for name, cfg in PRESETS.items() if not cfg.n_experts])
def test_a_family_keeps_the_vocabulary_head_size_and_proportions_and_grows_with_its_kv_heads(preset):
    base = PRESETS[preset]
    assert family_member(base, base.n_kv_heads) is base
    members = [family_member(base, kv_heads) for kv_heads in range(1, 3 * base.n_kv_heads + 1)]
    for member in members:
        assert (member.vocab_size, member.head_dim, member.n_heads // member.n_kv_heads) == (
            base.vocab_size, base.head_dim, base.n_heads // base.n_kv_heads)
        assert member.ffn_hidden % 64 == 0 and abs(member.ffn_hidden / member.hidden - base.ffn_hidden / base.hidden) \
            <= 32 / member.hidden
        assert abs(member.hidden / member.n_layers - base.hidden / base.n_layers) <= base.hidden / base.n_layers / 2 \
            or member.n_layers == 1
    sizes = [count_parameters(member)["total"] for member in members]
    assert sizes == sorted(sizes) and len(set(sizes)) == len(sizes)


@pytest.mark.parametrize("run_time", [RunTime(60.0), RunTime(7.5, val_every=10, val_batches=4)])
def test_the_steps_are_the_most_that_fit_the_budget(run_time):
    for budget_s in (1.0, 61.0, 600.0, 3600.0):
        for step_s in (0.013, 0.3, 2.0):
            steps = run_time.steps_in(budget_s, step_s)
            assert steps == 0 or run_time.seconds(steps, step_s) <= budget_s
            assert run_time.seconds(steps + 1, step_s) > budget_s
    assert [run_time.steps_in(budget, 0.3) for budget in (100, 200, 400)] == sorted(
        run_time.steps_in(budget, 0.3) for budget in (100, 200, 400))


def test_more_minutes_never_propose_a_smaller_model_and_the_proposal_is_nearest_the_rule(cpu_profile):
    full_5d = load_lesson("07_full_5d")
    sizing = full_5d.sizing
    proposed = []
    for minutes in (0.25, 1, 4, 16, 64):
        args = full_5d.parse_args(cpu_flags(cpu_profile, minutes))
        base, _, priced_for = sizing.checked_sizing_flags(args, full_5d.validate, full_5d.expert_degree)
        chosen, shown = sizing.proposal(base, args, priced_for, full_5d.validate, full_5d.ramp_of_layout)
        assert chosen in shown and all(CHINCHILLA.distance(chosen.tokens_per_parameter)
                                       <= CHINCHILLA.distance(other.tokens_per_parameter) for other in shown)
        proposed.append(chosen.parameters)
    assert proposed == sorted(proposed) and len(set(proposed)) >= 3, proposed
    # a rule that asks more tokens per parameter proposes a model no larger, and the rule's figure is printed
    args = full_5d.parse_args(cpu_flags(cpu_profile, 64) + ["--tokens-per-parameter", "80"])
    base, _, priced_for = sizing.checked_sizing_flags(args, full_5d.validate, full_5d.expert_degree)
    assert priced_for.rule.tokens_per_parameter == 80 and "--tokens-per-parameter 80" in priced_for.rule.source
    assert sizing.proposal(base, args, priced_for, full_5d.validate, full_5d.ramp_of_layout)[0].parameters < proposed[4]


def test_the_proposal_prints_every_assumption_and_a_command_that_runs_as_printed(cpu_profile, capsys, tmp_path):
    full_5d = load_lesson("07_full_5d")
    full_5d.main(cpu_flags(cpu_profile, 2))
    lines = capsys.readouterr().out.splitlines()
    assumptions = lines[lines.index("assumptions:") + 1:lines.index("command:")]
    assert [line.removeprefix("  - ").split(":")[0] + ":" for line in assumptions] == list(ASSUMPTIONS), lines
    assert any(line.startswith("proposal: ") for line in lines) and any(line.startswith("data: ") for line in lines)
    chosen_row = next(line for line in lines if line.endswith("the proposal") or "the proposal  " in line)
    words = shlex.split(lines[-1])
    assert words[:4] == ["torchrun", "--standalone", "--nproc_per_node=2", "07_full_5d.py"], words
    args = full_5d.parse_args(words[4:])
    assert args.max_minutes == 2 and not args.plan
    cfg = config_from_flags(args)
    assert f"{cfg.n_kv_heads:>5}{cfg.n_layers:>7}{cfg.hidden:>7}" in chosen_row, (chosen_row, cfg)
    checked_plan(args, full_5d.validate, full_5d.model_config, world_size=2)     # 07's own rules, as at its start
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", *words[1:3], str(REPO_ROOT / words[3]),
                           *words[4:], "--steps", "1"], capture_output=True, text=True, timeout=300, cwd=tmp_path,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"{count_parameters(cfg)['total']:,} parameters" in done.stdout and "step    0 | loss" in done.stdout
    # a quarter of a minute holds too few tokens even for the family's smallest member: said so
    full_5d.main(cpu_flags(cpu_profile, 0.25))
    assert "note: the family's smallest member, and still short of the rule's" in capsys.readouterr().out


def test_a_batch_ramp_trains_more_smaller_steps_in_the_same_minutes(cpu_profile, capsys):
    """--batch-ramp: the ramp's first steps are priced at their own micro-batch counts (cheaper than a
    full step, dearer per token: each pays the step's fixed part), the tokens counted through the ramp,
    and the command carries the ramp."""
    full_5d = load_lesson("07_full_5d")
    sizing = full_5d.sizing
    flags = cpu_flags(cpu_profile, 1) + ["--preset", "tiny", "--n-layers", "2", "--hidden", "64", "--n-heads", "2",
                                         "--n-kv-heads", "1", "--ffn-hidden", "192", "--grad-accum", "8"]
    candidates = []
    for ramp in ([], ["--batch-ramp", "2048", "200000"]):
        args = full_5d.parse_args(flags + ramp)
        base, _, priced_for = sizing.checked_sizing_flags(args, full_5d.validate, full_5d.expert_degree)
        candidates.append(sizing.priced(base, base.n_kv_heads, args, priced_for, full_5d.validate,
                                        full_5d.ramp_of_layout))
    plain, ramped = candidates
    assert plain.layout.step_seconds == ramped.layout.step_seconds
    assert ramped.steps > plain.steps and ramped.tokens < plain.tokens, (plain, ramped)
    layout = ramped.layout
    ramp = full_5d.ramp_of_layout(layout.args, layout.grid, full_5d.batch_shape(layout.args, layout.grid.dp))
    assert ramped.tokens == ramp.tokens_before(ramped.steps) and ramp.full_from() < ramped.steps
    full_5d.main(flags + ["--batch-ramp", "2048", "200000"])
    lines = capsys.readouterr().out.splitlines()
    assert "--batch-ramp 2048 200000" in lines[-1] and any("reached by --batch-ramp 2048 200000" in line
                                                           for line in lines), lines


@pytest.mark.parametrize("flags, message", [
    (["--max-minutes", "0"], "--max-minutes 0.0 must be a positive number"),
    (["--max-minutes", "-3"], "--max-minutes -3.0 must be a positive number"),
    (["--max-minutes", "10", "--gpus", "0"], "--gpus, --gpus-per-node and --gpu-memory-gb must be positive"),
    (["--max-minutes", "10", "--gpus", "12"], "--gpus 12 is not a whole number of nodes of 8"),
    (["--max-minutes", "10", "--preset", "tiny-moe"], "--preset tiny-moe has experts"),
    (["--max-minutes", "10", "--steps", "5"], "--steps 5: with --plan --max-minutes the minutes decide the steps"),
    (["--max-minutes", "10", "--tokens-per-parameter", "0"], "--tokens-per-parameter 0 must be a positive number"),
    (["--max-minutes", "1", "--time-to-first-step", "60"], "--time-to-first-step 60 must be 0 or more and less than "
                                                           "the 60 s of --max-minutes 1"),
    (["--max-minutes", "0.5"], "the time to the first step assumed on a cuda run, 60 s (--time-to-first-step), must "
                               "be 0 or more and less than the 30 s of --max-minutes 0.5"),
])
def test_bad_values_are_refused_before_any_work(flags, message, monkeypatch):
    full_5d = load_lesson("07_full_5d")

    def stop(error):
        raise Stopped(str(error))

    monkeypatch.setattr(full_5d.memory_plan, "exit_with_error", stop)
    monkeypatch.setattr(full_5d.sizing, "exit_with_error", stop)
    monkeypatch.setattr(full_5d.sizing, "proposal", None)      # no candidate may be priced
    with pytest.raises(Stopped) as refused:
        full_5d.main(["--plan", *flags])
    assert message in str(refused.value), str(refused.value)


def test_a_refusal_is_one_error_line_and_exit_code_2():
    done = subprocess.run([sys.executable, str(REPO_ROOT / "07_full_5d.py"), "--plan", "--max-minutes", "0"],
                          capture_output=True, text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 2 and done.stderr.startswith("error: bad flags:"), done.stderr
    assert done.stderr.splitlines()[1:] == ["  - --max-minutes 0.0 must be a positive number"], done.stderr
