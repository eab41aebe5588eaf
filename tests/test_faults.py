"""What a cluster does to a run, done to one under torchrun: a scheduler's stop signal."""

from __future__ import annotations

import itertools
import json
import os
import re
import resource
import signal
import subprocess
import sys
import time

from picotron_like.lessons import REPO_ROOT
from picotron_like.testing import torchrun_workers_by_rank
from picotron_like.topology import CHECK_COLLECTIVES_ENV, torchrun_workers

RUN = ["--n-layers", "2", "--seq-len", "32", "--micro-batch-size", "2", "--global-batch-tokens", "256", "--seed", "3",
       "--lr", "3e-3", "--warmup-steps", "2", "--dp", "2", "--zero-stage", "1", "--steps", "14"]


def torchrun_07(*flags: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
            str(REPO_ROOT / "07_full_5d.py"), *RUN, *flags]


def losses(path) -> dict[int, float]:
    records = (json.loads(line) for line in path.read_text().splitlines() if line.strip())
    return {record["step"]: record["loss"] for record in records if "grad_norm" in record}


def test_a_stop_signal_to_one_rank_stops_every_rank_after_one_step_with_a_checkpoint_that_resumes_exactly(tmp_path):
    """SIGTERM reaches rank 1 alone, mid-run (a scheduler's signals reach ranks at different
    moments). Every rank stops after the same step, one after the signal was agreed on, writes the
    checkpoint of that step, says so and exits 0; --resume then trains exactly the losses of a run
    that was never stopped. SIGUSR1 (SLURM's --signal=USR1@120) takes the same path. Every run
    checks its collectives at its end (the agreed stop's, the checkpoint's and the resume's included):
    the same on every member of every group."""
    env = dict(os.environ, OMP_NUM_THREADS="1", **{CHECK_COLLECTIVES_ENV: "1"})
    save_dir, log = tmp_path / "checkpoints", tmp_path / "stopped.txt"
    with open(log, "w") as stdout:
        stopped = subprocess.Popen(torchrun_07("--save-dir", str(save_dir), "--metrics", str(tmp_path / "a.jsonl")),
                                   cwd=REPO_ROOT, stdout=stdout, stderr=subprocess.STDOUT, env=env)
        try:
            deadline = time.monotonic() + 150
            while "step    3 |" not in log.read_text() and stopped.poll() is None and time.monotonic() < deadline:
                time.sleep(0.02)
            os.kill(torchrun_workers_by_rank(stopped.pid)[1], signal.SIGTERM)
            stopped.wait(timeout=120)
        finally:
            if stopped.poll() is None:
                for pid in [*torchrun_workers(stopped.pid), stopped.pid]:
                    os.kill(pid, signal.SIGKILL)
    output = log.read_text()
    assert stopped.returncode == 0, output
    found = re.search(r"^stopped after step (\d+): SIGTERM \((\d+) steps left\); the checkpoint took [\d.]+ s: "
                      r"continue with --resume$", output, re.M)
    assert found and 3 <= int(found[1]) < 13 and int(found[2]) == 13 - int(found[1]), output
    last = int(found[1])
    assert sorted(losses(tmp_path / "a.jsonl")) == list(range(last + 1))
    assert (save_dir / f"step_{last + 1:08d}" / "manifest.json").exists()
    assert "Traceback" not in output, output

    subprocess.run(torchrun_07("--save-dir", str(save_dir), "--resume", "--metrics", str(tmp_path / "b.jsonl")),
                   cwd=REPO_ROOT, env=env, check=True, capture_output=True, timeout=180)
    subprocess.run(torchrun_07("--metrics", str(tmp_path / "whole.jsonl")), cwd=REPO_ROOT, env=env, check=True,
                   capture_output=True, timeout=180)
    whole, first, resumed = (losses(tmp_path / name) for name in ("whole.jsonl", "a.jsonl", "b.jsonl"))
    assert first == {step: whole[step] for step in first}
    assert resumed == {step: whole[step] for step in range(last + 1, 14)}


def test_the_stop_agreement_reads_each_signal_and_restores_the_handlers():
    """In one process: either signal is noted, agreed on one step later, and named; the handlers
    a program had before the loop are back after it."""
    from picotron_like.run_control import AgreedStop

    before = signal.getsignal(signal.SIGUSR1)
    with AgreedStop() as stop:
        assert stop.after_step() is False
        os.kill(os.getpid(), signal.SIGUSR1)
        assert stop.after_step() is False           # noted during this step: agreed on at the next
        assert stop.after_step() is True and stop.agreed_signal == "SIGUSR1"
    assert signal.getsignal(signal.SIGUSR1) is before


def test_a_save_dir_that_cannot_be_written_is_refused_before_the_first_step():
    """A path under a file: one error line and exit 2 before anything trains (not 500 steps
    trained and then a traceback at the first checkpoint)."""
    run = subprocess.run(torchrun_07("--save-dir", "/etc/passwd/checkpoints", "--steps", "500"), cwd=REPO_ROOT,
                         capture_output=True, text=True, timeout=120, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert re.search(r"exitcode\s*:\s*2\b", run.stderr), run.stderr
    assert run.stderr.count("error: --save-dir /etc/passwd/checkpoints: not a directory this run can write "
                            "checkpoints in (Not a directory); give a writable directory") == 1, run.stderr
    assert "step    0" not in run.stdout and not re.search(r'File "[^"]*(07_full_5d|picotron_like)', run.stderr)


def test_a_save_that_fails_mid_run_stops_every_rank_with_one_line_and_keeps_the_earlier_checkpoints(tmp_path):
    """The disk fills once the step-2 checkpoint is written (a file size limit put on the running
    ranks: writes past it fail with EFBIG, as they would with ENOSPC). The next save fails on
    every rank at once: one line naming the step and the cause, a non-zero exit, no traceback of
    ours, and every checkpoint written before it complete and loadable."""
    import picotron_like.checkpoint as checkpoints

    save_dir = tmp_path / "checkpoints"
    process = subprocess.Popen(torchrun_07("--save-dir", str(save_dir), "--save-every", "2", "--steps", "400"),
                               cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env=dict(os.environ, OMP_NUM_THREADS="1"))
    try:
        deadline = time.monotonic() + 150
        while not (save_dir / "step_00000002" / "manifest.json").exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        for pid in torchrun_workers(process.pid):
            resource.prlimit(pid, resource.RLIMIT_FSIZE, (64 * 1024, 64 * 1024))
        stdout, stderr = process.communicate(timeout=120)
    finally:
        if process.poll() is None:
            for pid in [*torchrun_workers(process.pid), process.pid]:
                os.kill(pid, signal.SIGKILL)
    assert process.returncode != 0, stdout
    failure = re.findall(r"^error: after step (\d+): .*rank_0000[01]\.pt: could not be written \(\[Errno 27\] File too "
                         r"large\); the checkpoints before it are intact$", stderr, re.M)
    assert len(failure) == 1, stderr[-3000:]
    assert not re.search(r'File "[^"]*(07_full_5d|picotron_like)', stderr), stderr[-3000:]
    done = [step for step, path in checkpoints.list_checkpoints(save_dir) if (path / "manifest.json").exists()]
    failed_step = int(failure[0]) + 1          # "after step N": the checkpoint of N + 1 steps done
    assert 2 in done and all(step < failed_step for step in done), (done, failed_step)
    for step in done:
        exported = checkpoints.export(checkpoints.step_directory(save_dir, step), tmp_path / f"{step}.pt")
        assert exported, step


def test_every_layout_the_rules_accept_runs_with_the_other_flags_at_their_defaults():
    """Lesson 07 on 1 to 8 ranks, every grid of degrees, dense and MoE: a grid that runs with some
    ZeRO stage and expert degree also runs with the defaults (they follow the layout: ZeRO-1
    under a pipeline, the expert degree dividing both the experts and the token ranks). Before,
    --pp 2 (default ZeRO-3) and tiny-moe --dp 3 (default ep 3 of 4 experts) were refused."""
    from picotron_like.lessons import load_lesson
    from picotron_like.topology import ConfigError
    from picotron_like.train import checked_plan

    full_5d = load_lesson("07_full_5d")

    def runs(flags: list[str], world_size: int) -> bool:
        try:
            checked_plan(full_5d.parse_args(flags), full_5d.validate, full_5d.expert_parallel.moe_config, world_size)
            return True
        except ConfigError:
            return False

    checked = 0
    for world_size in range(1, 9):
        divisors = [d for d in range(1, world_size + 1) if world_size % d == 0]
        grids = [(dp, pp, cp, world_size // (dp * pp * cp)) for dp in divisors for pp in divisors for cp in divisors
                 if world_size % (dp * pp * cp) == 0]
        for (dp, pp, cp, tp), preset in itertools.product(grids, ("tiny", "tiny-moe")):
            degrees = ["--preset", preset, "--dp", str(dp), "--pp", str(pp), "--cp", str(cp), "--tp", str(tp)]
            eps = [e for e in divisors if (dp * cp) % e == 0] if preset == "tiny-moe" else [None]
            choices = [["--zero-stage", str(stage), *(["--ep", str(ep)] if ep else [])]
                       for stage in range(4) for ep in eps]
            if any(runs(degrees + choice, world_size) for choice in choices):
                assert runs(degrees, world_size), degrees
                checked += 1
    assert checked > 60


def test_a_killed_rank_restarts_under_torchrun_and_the_job_ends_with_the_uninterrupted_losses(tmp_path):
    """torchrun --max-restarts 1, --resume from the first start on: rank 1 is killed with SIGKILL
    once a checkpoint exists. torchrun stops rank 0 and starts both again; they continue from the
    newest complete checkpoint by themselves, and every step's loss (the last one logged for a
    step that ran twice) equals a run that was never killed."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    save_dir, metrics = tmp_path / "checkpoints", tmp_path / "restarted.jsonl"
    command = torchrun_07("--save-dir", str(save_dir), "--save-every", "2", "--resume", "--metrics", str(metrics))
    command.insert(command.index("--standalone"), "--max-restarts=1")
    job = subprocess.Popen(command, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           env=env)
    try:
        deadline = time.monotonic() + 150
        while not (save_dir / "step_00000004" / "manifest.json").exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        os.kill(torchrun_workers_by_rank(job.pid)[1], signal.SIGKILL)
        output, _ = job.communicate(timeout=240)
    finally:
        if job.poll() is None:
            for pid in [*torchrun_workers(job.pid), job.pid]:
                os.kill(pid, signal.SIGKILL)
    assert job.returncode == 0, output[-4000:]
    assert "--resume: no checkpoint in" in output and re.search(r"^resumed from .*step_000000(0[4-9]|1[0-3]) at step",
                                                               output, re.M), output[-4000:]
    subprocess.run(torchrun_07("--metrics", str(tmp_path / "whole.jsonl")), cwd=REPO_ROOT, env=env, check=True,
                   capture_output=True, timeout=180)
    assert losses(metrics) == losses(tmp_path / "whole.jsonl")


def test_two_torchrun_agents_rendezvous_like_two_nodes_and_train_equal_to_one_device(tmp_path):
    """Two torchrun agents on this machine, --nnodes 2 with a c10d rendezvous (what two nodes run),
    one rank each: lesson 07 at dp 2 gives the losses of lesson 07 on one rank, to float32 rounding."""
    import socket

    env = dict(os.environ, OMP_NUM_THREADS="1")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    agents = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=1",
                                "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{port}", "--rdzv_id=two-nodes",
                                str(REPO_ROOT / "07_full_5d.py"), *RUN, "--steps", "6", "--metrics",
                                str(tmp_path / f"agent{node}.jsonl")],
                               cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
              for node in range(2)]
    outputs = [agent.communicate(timeout=240)[0] for agent in agents]
    assert [agent.returncode for agent in agents] == [0, 0], outputs
    two_nodes = {}
    for node in range(2):                       # rank 0, on whichever agent the rendezvous made it, writes
        path = tmp_path / f"agent{node}.jsonl"
        two_nodes.update(losses(path) if path.exists() else {})
    one_rank = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1",
                str(REPO_ROOT / "07_full_5d.py"), *RUN, "--dp", "1", "--steps", "6",
                "--metrics", str(tmp_path / "one.jsonl")]
    subprocess.run(one_rank, cwd=REPO_ROOT, env=env, check=True, capture_output=True, timeout=180)
    one = losses(tmp_path / "one.jsonl")
    assert sorted(two_nodes) == sorted(one) == list(range(6))
    assert all(abs(two_nodes[step] - one[step]) <= 1e-5 * abs(one[step]) for step in one), (two_nodes, one)
