"""The device check, as far as a CPU can check it: its 8-GPU self-check launches only layouts the
lessons accept, and its comparison passes runs equal to one device and fails the others; its FP8
rows are their bf16 twins with --fp8, and its table compares the two."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys

import pytest

from picotron_like.lessons import REPO_ROOT, load_lesson
from picotron_like.train import checked_plan

SCRIPT = REPO_ROOT / "benchmarks" / "gpu_check.sh"


def equal_runs() -> list[tuple[str, int, str, list[str]]]:
    """(name, world size, lesson file, flags) of every run of the self-check, variables expanded."""
    text = SCRIPT.read_text()
    variables = {}
    for name, value in re.findall(r'^\s*(same|dense|moe)="([^"]*)"', text, re.M):
        variables[name] = re.sub(r"\$(\w+)", lambda m: variables[m.group(1)], value)
    runs = []
    for launcher, name, rest in re.findall(r"^\s*(?:CUDA_VISIBLE_DEVICES=0 )?(eight|four|one_gpu) (equal-\S+) (.*)$",
                                           text, re.M):
        words = shlex.split(re.sub(r"\$(\w+)", lambda m: variables[m.group(1)], rest))
        if launcher == "one_gpu":
            words = words[1:]       # one_gpu NAME TIMEOUT SCRIPT ...
        runs.append((name, {"eight": 8, "four": 4, "one_gpu": 1}[launcher], words[0], words[1:]))
    return runs


def test_the_self_check_covers_every_lesson_and_launches_only_accepted_layouts():
    runs = equal_runs()
    assert {lesson for _, _, lesson, _ in runs} == {f"{n:02d}_{name}.py" for n, name in (
        (1, "data_parallel"), (2, "tensor_parallel"), (3, "pipeline_parallel"), (4, "context_parallel"),
        (5, "expert_parallel"), (6, "zero"), (7, "full_5d"))}
    for name, world_size, lesson_file, flags in runs:
        lesson = load_lesson(lesson_file.removesuffix(".py"))
        args = lesson.parse_args(flags)
        configure = getattr(lesson, "moe_config", None) or getattr(getattr(lesson, "expert_parallel", None),
                                                                   "moe_config", None)
        plan = checked_plan(args, lesson.validate, configure, world_size)     # raises on a refused layout
        # the same global batch as its one-GPU reference: 8 sequences of 1024 tokens, float32
        assert plan.shape.tokens_per_step == 8 * 1024 and args.dtype == "float32", name


def metrics_of(lesson: str, ranks: int, directory, *flags: str):
    path = directory / f"{lesson}-{ranks}.metrics.jsonl"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}",
               str(REPO_ROOT / f"{lesson}.py"), "--steps", "3", "--seq-len", "64", "--micro-batch-size", "2",
               "--global-batch-tokens", "512", "--metrics", str(path), *flags]
    run = subprocess.run(command, capture_output=True, text=True, timeout=180, cwd=REPO_ROOT,
                         env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert run.returncode == 0, run.stdout + run.stderr
    return path


def compare(*paths, rtol: str = "1e-4"):
    return subprocess.run([sys.executable, str(REPO_ROOT / "benchmarks" / "equal_to_one_device.py"), "--rtol", rtol,
                           *map(str, paths)], capture_output=True, text=True, timeout=60)


def test_the_comparison_passes_a_run_equal_to_one_device_and_fails_others(tmp_path):
    """Lesson 01 on 2 gloo ranks against lesson 07 on one: equal (to ~1e-7 here). A copy with one
    loss moved by 1e-3, and one missing a step, fail; the exit code says so."""
    reference = metrics_of("07_full_5d", 1, tmp_path)
    run = metrics_of("01_data_parallel", 2, tmp_path)
    moved, short = tmp_path / "moved.metrics.jsonl", tmp_path / "short.metrics.jsonl"
    records = [json.loads(line) for line in run.read_text().splitlines()]
    records[1]["loss"] *= 1 + 1e-3
    moved.write_text("\n".join(json.dumps(r) for r in records))
    short.write_text("\n".join(json.dumps(r) for r in records[:2]))
    equal = compare(reference, run)
    assert equal.returncode == 0 and re.search(r"^01_data_parallel-2 +3 .* pass$", equal.stdout, re.M), equal.stdout
    unequal = compare(reference, run, moved, short)
    assert unequal.returncode == 1, unequal.stdout
    assert re.search(r"^moved +3 +1\.0\de-03 .* FAIL$", unequal.stdout, re.M), unequal.stdout
    assert re.search(r"^short +2 .* FAIL$", unequal.stdout, re.M), unequal.stdout


def test_the_device_check_is_valid_bash_and_ranks_lesson_07s_step_first():
    assert subprocess.run(["bash", "-n", str(SCRIPT)]).returncode == 0
    rows = re.findall(r"^\s*(?:run|one_gpu) ([\w-]+) \d+ ", SCRIPT.read_text(), re.M)
    assert rows[0] == "07-1b-compile", rows
    assert "tests-gloo-on-gpu-machine" not in rows       # a CPU proves the gloo tests


def test_every_script_the_device_check_runs_exists():
    scripts = set(re.findall(r"python3 (?:-m pytest -q -k cuda )?((?:benchmarks|tests)/\w+\.py)", SCRIPT.read_text()))
    assert "benchmarks/gpu_loss.py" in scripts
    missing = [script for script in scripts if not (REPO_ROOT / script).exists()]
    assert not missing, missing


def twin_rows(variant: str) -> dict[str, tuple[list[str], list[str]]]:
    """Each run of lesson 07 in the device check whose name matches the regex `variant`: (its flags,
    its twin's: the run named without it), $b1 expanded."""
    text = SCRIPT.read_text()
    b1 = re.search(r'^b1="([^"]*)"', text, re.M).group(1)
    flags = {name: shlex.split(value.replace("$b1", b1))
             for name, value in re.findall(r'^\s*\[(07-[\w-]+)\]="([^"]*)"', text, re.M)}
    return {name: (words, flags[re.sub(variant, "", name)]) for name, words in flags.items()
            if re.search(variant, name)}


def fp8_rows() -> dict[str, tuple[list[str], list[str]]]:
    """Each FP8 run and its bf16 twin (without "-fp8-RECIPE", and "-all": --no-fp8-shape-rule)."""
    return twin_rows(r"-fp8-[a-z0-9]+(-all)?")


def test_each_fp8_row_is_its_bf16_twin_with_fp8_and_the_table_compares_them(tmp_path):
    """The FP8 rows (rowwise, and mxfp8 on MX GPUs) differ from their bf16 twin by --fp8 alone (and
    --no-fp8-shape-rule for a row named "-all", every linear in FP8) and
    lesson 07 accepts them on one GPU; the table divides an FP8 run's tokens/s by its twin's
    (here two short CPU runs of the tiny preset, named as the script names them)."""
    full_5d, rows = load_lesson("07_full_5d"), fp8_rows()
    assert {words[words.index("--fp8") + 1] for words, _ in rows.values()} == {"rowwise", "mxfp8"}
    for name, (words, twin) in rows.items():
        at = words.index("--fp8")
        every_linear = ["--no-fp8-shape-rule"] if name.endswith("-all-compile") else []
        assert words[:at] + words[at + 2:] == twin + every_linear, name
        checked_plan(full_5d.parse_args(words), full_5d.validate, None, 1)     # raises on a refused layout
    runs = {"07-t": [], "07-t-fp8-rowwise": ["--fp8", "rowwise"]}
    for name, flags in runs.items():
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1",
                   str(REPO_ROOT / "07_full_5d.py"), "--steps", "4", "--seq-len", "64", "--micro-batch-size", "2",
                   "--global-batch-tokens", "256", "--metrics", str(tmp_path / f"{name}.metrics.jsonl"), *flags]
        run = subprocess.run(command, capture_output=True, text=True, timeout=180, cwd=REPO_ROOT,
                             env=dict(os.environ, OMP_NUM_THREADS="1"))
        assert run.returncode == 0, run.stdout + run.stderr
    plan = subprocess.run([sys.executable, str(REPO_ROOT / "07_full_5d.py"), "--plan", "--gpus", "1", "--gpu", "H100",
                           "--steps", "4", "--seq-len", "64", "--micro-batch-size", "2", "--global-batch-tokens", "256"],
                          capture_output=True, text=True, timeout=120, cwd=REPO_ROOT, check=True).stdout
    (tmp_path / "07-t.plan.txt").write_text(plan)
    (tmp_path / "07-t-fp8-rowwise.calibrated.plan.txt").write_text(plan)       # as if from a calibrated profile
    table = subprocess.run([sys.executable, str(REPO_ROOT / "benchmarks" / "gpu_check_table.py"), str(tmp_path)],
                           capture_output=True, text=True, timeout=60, check=True).stdout
    tokens = {line.split()[0]: float(line.split()[1].replace(",", "")) for line in table.splitlines()[1:]}
    ratio = re.search(r"^07-t-fp8-rowwise +[\d,]+ +([\d.]+)x", table, re.M)
    expected = tokens["07-t-fp8-rowwise"] / tokens["07-t"]        # of the printed, rounded tokens/s
    assert ratio and float(ratio.group(1)) == pytest.approx(expected, abs=0.006), table
    assert re.search(r"^07-t +[\d,]+ +- ", table, re.M), table
    # the step-time model's estimate for the run's own layout, and measured over it
    planned = float(re.search(r"estimated: [\d.]+ s, ([\d,]+) tokens/s per GPU", plan).group(1).replace(",", ""))
    row = re.search(r"^07-t +.* ([\d,]+) +([\d.]+) +-$", table, re.M)
    assert row and float(row.group(1).replace(",", "")) == planned, table
    assert float(row.group(2)) == pytest.approx(tokens["07-t"] / planned, abs=0.006), table
    calibrated = re.search(r"^07-t-fp8-rowwise +.* - +- +([\d.]+)$", table, re.M)
    assert calibrated and float(calibrated.group(1)) == pytest.approx(tokens["07-t-fp8-rowwise"] / planned,
                                                                      abs=0.006), table


def offload_rows() -> dict[str, tuple[list[str], list[str]]]:
    """Each offload run and its twin without "-offload-WHAT"."""
    return twin_rows(r"-offload-[a-z]+$")


def test_each_offload_row_is_its_twin_with_offload_and_the_table_holds_their_losses_together(tmp_path):
    """The two offload rows differ from their twin by `--offload WHAT` alone, run before the budget
    can cut the list, and lesson 07 accepts them on one GPU; the table passes an offload run whose
    every loss is within its tolerance of the twin's and fails one that is not (metrics files
    written here: the comparison is arithmetic)."""
    full_5d, rows = load_lesson("07_full_5d"), offload_rows()
    assert {words[words.index("--offload") + 1] for words, _ in rows.values()} == {"optimizer", "activations"}
    for name, (words, twin) in rows.items():
        at = words.index("--offload")
        assert words[:at] + words[at + 2:] == twin, name
        checked_plan(full_5d.parse_args(words), full_5d.validate, None, 1)     # raises on a refused layout
    ranked = re.findall(r"^\s*(?:PICOTRON\w+=1 )?(?:run|one_gpu) ([\w-]+) \d+ |^for name in ([\w\s-]+);",
                        SCRIPT.read_text(), re.M)
    order = [name for row, loop in ranked for name in (row.split() if row else loop.split())]
    for name in rows:       # each with its twin, ahead of the NCCL checks' row
        twin = re.sub(r"-offload-[a-z]+$", "", name)
        assert max(order.index(name), order.index(twin)) < order.index("07-collectives-checked"), order

    def write(name: str, losses: list[float]) -> None:
        records = [{"step": i, "loss": loss, "tokens_per_s": 1000.0 + i, "max_memory_allocated_bytes": 2**30}
                   for i, loss in enumerate(losses)]
        (tmp_path / f"{name}.metrics.jsonl").write_text("\n".join(json.dumps(r) for r in records))

    write("07-t", [4.0, 3.0, 2.0])
    write("07-t-offload-optimizer", [4.0, 3.0 * (1 + 4e-3), 2.0])      # within 5e-3
    write("07-t-offload-activations", [4.0, 3.0, 2.0 * (1 + 2e-3)])    # beyond 1e-3
    table = subprocess.run([sys.executable, str(REPO_ROOT / "benchmarks" / "gpu_check_table.py"), str(tmp_path)],
                           capture_output=True, text=True, timeout=60, check=True).stdout
    assert re.search(r"^07-t-offload-optimizer +07-t +3 +4\.00e-03 +5e-03 +pass$", table, re.M), table
    assert re.search(r"^07-t-offload-activations +07-t +3 +2\.00e-03 +1e-03 +FAIL$", table, re.M), table
    assert re.search(r"^07-t-offload-optimizer +[\d,]+ +1\.00x", table, re.M), table


def test_the_table_sets_the_allocated_and_reserved_peaks_beside_the_plans(tmp_path):
    """A run's peak allocated memory is set beside the plan's total less its allocator's reserve, and
    its peak reserved memory beside the plan's total (metrics and plan output written here)."""
    records = [{"step": i, "loss": 3.0, "tokens_per_s": 1000.0, "max_memory_allocated_bytes": 10 * 2**30,
                "max_memory_reserved_bytes": 12 * 2**30} for i in range(3)]
    (tmp_path / "07-x.metrics.jsonl").write_text("\n".join(json.dumps(r) for r in records))
    (tmp_path / "07-x.plan.txt").write_text("  allocator's reserve (estimated)             1.50\n"
                                            "  total                                      13.00\n")
    table = subprocess.run([sys.executable, str(REPO_ROOT / "benchmarks" / "gpu_check_table.py"), str(tmp_path)],
                           capture_output=True, text=True, timeout=60, check=True).stdout
    assert re.search(r"^07-x +1,000 +- +\S+ +10\.00 +11\.50 +12\.00 +13\.00 +3 +3\.0000", table, re.M), table
