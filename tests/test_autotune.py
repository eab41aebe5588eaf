"""--autotune (07_autotune.py): the plan's best layouts, each trained by a real torchrun child of
07 on CPU ranks, measured, written to JSON, the fastest's command last; a failing child is a row
with its reason; bad input is one line."""

import dataclasses
import json
import os
import re
import shlex
import subprocess
import sys

from picotron_like.device_profile import save_profile
from picotron_like.lessons import REPO_ROOT, load_lesson
from picotron_like.model import count_parameters, get_config
from picotron_like.published_profiles import published_profile
from picotron_like.train import plan_run

# A tiny model on 4 ranks; --dp 4 (the user's own layout) and --save-dir (a run's own output)
# must give way to each layout's flags and stay out of the children, and --hidden must reach them.
USER_FLAGS = ["--preset", "tiny", "--n-layers", "2", "--hidden", "64", "--seq-len", "32", "--micro-batch-size", "2",
              "--grad-accum", "2", "--dp", "4"]


def autotune_command(tmp_path, *flags: str) -> list[str]:
    return [sys.executable, str(REPO_ROOT / "07_full_5d.py"), "--autotune", "--gpus", "4", *USER_FLAGS,
            "--autotune-out", str(tmp_path / "tuned.json"), *flags]


def test_autotune_measures_the_best_layouts_and_prints_the_fastest_command_last(tmp_path, monkeypatch):
    """Two layouts, each a torchrun child of 4 ranks: every row measured (tokens/s > 0 after the
    warm-up, rank 0's peak memory) or failed with a reason, next to the plan's estimate by
    --device-profile's device; the last line is the fastest row's command, which lesson 07
    accepts as the layout of that row."""
    save_dir, profile = tmp_path / "checkpoints", tmp_path / "h100.json"
    save_profile(dataclasses.replace(published_profile("H100"), name="an H100 from a file"), str(profile))
    run = subprocess.run(autotune_command(tmp_path, "--autotune-top", "2", "--autotune-steps", "4",
                                          "--save-dir", str(save_dir), "--device-profile", str(profile)),
                         capture_output=True, text=True, timeout=300, cwd=REPO_ROOT)
    assert run.returncode == 0, run.stdout + run.stderr
    report = json.loads((tmp_path / "tuned.json").read_text())
    assert len(report["rows"]) == 2 and report["warmup_steps"] == 2
    assert report["estimates_for"] == "an H100 from a file"     # the plan priced the layouts with the profile
    for row in report["rows"]:
        assert row["estimated"]["peak_memory_bytes"] > 0, row
        if row["failure"] is None:
            assert row["measured"]["tokens_per_s_per_gpu"] > 0 and row["measured"]["timed_steps"] == 2, row
            assert row["measured"]["peak_memory_bytes"] > 0, row
        else:
            assert row["measured"] is None and row["failure"], row
    measured = [row for row in report["rows"] if row["measured"]]
    assert measured, report
    fastest = max(measured, key=lambda row: row["measured"]["tokens_per_s_per_gpu"])
    lines = run.stdout.splitlines()
    assert lines[-1] == fastest["command"] == report["command"], run.stdout
    for row in report["rows"]:      # the table's rows, in the plan's order
        assert any(line.strip().startswith(row["layout"]) for line in lines), (row["layout"], run.stdout)
    # the children trained the user's model and wrote no checkpoint (the flags' check made the directory)
    expected = f"{count_parameters(get_config('tiny', n_layers=2, hidden=64))['total']:,} parameters"
    assert expected in open(fastest["log"]).read()
    assert list(save_dir.iterdir()) == []

    launcher, flags = shlex.split(lines[-1])[:3], shlex.split(lines[-1])[4:]
    assert launcher == ["torchrun", "--standalone", "--nproc_per_node=4"], lines[-1]
    assert "--save-dir" in flags and flags.count("--dp") == 1, lines[-1]
    assert not {"--autotune", "--autotune-top", "--device-profile", "--gpus"} & set(flags), lines[-1]
    monkeypatch.setenv("WORLD_SIZE", "4")
    full_5d = load_lesson("07_full_5d")
    plan = plan_run(full_5d.parse_args(flags), full_5d.validate, full_5d.model_config)
    grid = plan.grid
    name = " ".join([f"dp{grid.dp}"] + [f"{axis}{getattr(grid, axis)}" for axis in ("pp", "cp", "tp")
                                        if getattr(grid, axis) > 1])
    assert fastest["layout"].startswith(name + " "), (fastest["layout"], name)


def test_a_layout_that_times_out_or_is_refused_is_a_row_with_its_reason(tmp_path):
    """One child past its time limit (killed with all its ranks), then one refused by lesson 07
    (--tp 3 over the layout's degrees): each is a row saying why, and the first did not stop the
    second."""
    full_5d = load_lesson("07_full_5d")
    autotune = full_5d.autotune
    argv = ["--autotune", "--gpus", "4", *USER_FLAGS, "--autotune-top", "1"]
    args = full_5d.parse_args(argv)
    _, [trial] = autotune.checked_autotune_flags(args, full_5d.validate, full_5d.expert_degree)
    # Steps enough that the first child is still training when its 8 s run out, however fast the
    # machine (a few steps of the tiny model can end within 8 s on a quiet one); the second is
    # refused before its first step whatever the count.
    args.autotune_steps = 100_000
    trials = [dataclasses.replace(trial, timeout_s=8.0),
              dataclasses.replace(trial, flags=[*trial.flags, "--tp", "3"], timeout_s=240.0)]
    runs = tmp_path / "runs"
    runs.mkdir()
    report = autotune.Report(tmp_path / "tuned.json", {})
    autotune.measure_all(trials, args, argv, runs, report)
    rows = report.rows
    assert [row["failure"] for row in rows][0] == "timed out after 8 s", rows
    assert re.match(r"bad parallel configuration: - dp\*pp\*cp\*tp = [\d*]+ = \d+ but the world size is 4",
                    rows[1]["failure"]), rows
    assert all(row["measured"] is None for row in rows)
    assert json.loads((tmp_path / "tuned.json").read_text())["rows"] == rows
    # nothing of the killed child lives on: torchrun, its ranks and their children
    alive = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as file:
                if str(runs).encode() in file.read():
                    alive.append(pid)
        except OSError:
            continue
    assert alive == []


def test_bad_input_is_one_error_line_before_any_child():
    """A K of 0, a time limit of 0, a layout list that fits nothing: exit 2, one `error:` line, no child."""
    cases = {("--autotune-top", "0"): "--autotune-top 0 must be at least 1",
             ("--autotune-minutes", "0"): "--autotune-minutes 0.0 must be a positive number",
             ("--gpu-memory-gb", "0.001"): "no layout of 4 x B300 (published) fits this batch (16 sequences of 32 "
                                           "per step, micro-batch 2) in 0.0009 GiB (90% of 0.001 GiB)"}
    runs = {flags: subprocess.Popen([sys.executable, str(REPO_ROOT / "07_full_5d.py"), "--autotune", "--gpus", "4",
                                     *USER_FLAGS, "--autotune-out", os.devnull + "/never.json", *flags],
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO_ROOT)
            for flags in cases}
    for flags, words in cases.items():
        stdout, stderr = runs[flags].communicate(timeout=120)
        assert runs[flags].returncode == 2, (flags, stdout, stderr)
        assert stderr.count("error: ") == 1 and words in stderr and "Traceback" not in stderr, (flags, stderr)
        assert stdout == "", (flags, stdout)


def test_a_failed_childs_reason_is_one_line():
    """What a row says of a child that gave no timed steps, read off its output as torchrun leaves it."""
    reason = load_lesson("07_autotune").failure_reason
    assert reason(None, "step 0 | loss 5.5\n", 12.4) == "timed out after 12 s"
    out_of_memory = ("[rank1]: Traceback (most recent call last):\n"
                     "[rank1]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB\n"
                     "torch.distributed.elastic.multiprocessing.errors.ChildFailedError:\n")
    assert reason(1, out_of_memory, 60) == ("out of memory: [rank1]: torch.OutOfMemoryError: CUDA out of memory. "
                                            "Tried to allocate 2.00 GiB")
    refused = "error: bad configuration:\n  - first rule\n  - second rule\nW1206 torchrun's own line\n"
    assert reason(1, refused, 60) == "bad configuration: - first rule - second rule"
    raised = ("Traceback (most recent call last):\n[rank0]: RuntimeError: a rank's own failure\n"
              "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: \n")
    assert reason(1, raised, 60) == "exit code 1: RuntimeError: a rank's own failure"
