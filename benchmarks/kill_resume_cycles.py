"""
Killed at any moment, a run resumes to the run that was never killed: counted over many kills.

Each cycle starts lesson 07 under torchrun (2 ranks, ZeRO-2, a checkpoint every step, the last 2
kept) in a fresh directory, kills every process with SIGKILL at a random moment (mid-step, mid-save
or mid-deletion: like a node lost), then resumes with --resume until the run is done, which may
take several kills when --kills-per-cycle > 1. A cycle counts as equal when the final checkpoint's
parameters (exported) equal those of one uninterrupted run bit for bit. The claim holds only if
every cycle is equal.

    python benchmarks/kill_resume_cycles.py                    # 20 cycles, one kill each
    python benchmarks/kill_resume_cycles.py --cycles 5 --kills-per-cycle 3
"""

import argparse
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import picotron_like.checkpoint as checkpoints  # noqa: E402  (the repository root first)
from picotron_like.topology import torchrun_workers  # noqa: E402

RUN = ["--n-layers", "2", "--seq-len", "32", "--micro-batch-size", "2", "--global-batch-tokens", "256", "--seed", "3",
       "--lr", "3e-3", "--warmup-steps", "2", "--dp", "2", "--zero-stage", "2", "--steps", "12", "--save-every", "1",
       "--keep-last", "2"]


def torchrun(save_dir: Path, resume: bool) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
            str(ROOT / "07_full_5d.py"), *RUN, "--save-dir", str(save_dir), *(["--resume"] if resume else [])]


def run_to_the_end(save_dir: Path) -> None:
    if (checkpoints.step_directory(save_dir, 12) / "manifest.json").exists():
        return                                  # the kill came after the run had finished
    run = subprocess.run(torchrun(save_dir, resume=True), cwd=ROOT, capture_output=True, text=True,
                         env=dict(os.environ, OMP_NUM_THREADS="1"))
    if run.returncode != 0:
        errors = [line for line in run.stderr.splitlines() if "error" in line.lower() and not line.startswith("W")]
        raise SystemExit(f"resuming {save_dir} failed (exit {run.returncode}):\n" + "\n".join(errors[:20]))


def kill_at_random(save_dir: Path, rng: random.Random) -> int:
    """Start (or resume) the run and SIGKILL all of it once a random checkpoint step has come and a
    random part of a step has passed; returns that checkpoint step."""
    done = [step for step, _ in checkpoints.list_checkpoints(save_dir)]
    target = rng.randint((max(done) if done else 0) + 1, 11)
    process = subprocess.Popen(torchrun(save_dir, resume=bool(done)), cwd=ROOT, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL, env=dict(os.environ, OMP_NUM_THREADS="1"))
    deadline = time.monotonic() + 300
    while not checkpoints.step_directory(save_dir, target).exists() and process.poll() is None \
            and time.monotonic() < deadline:
        time.sleep(0.005)
    time.sleep(rng.uniform(0, 0.05))            # anywhere in the next step or save
    for pid in [*torchrun_workers(process.pid), process.pid]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    process.wait()
    return target


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cycles", type=int, default=20)
    parser.add_argument("--kills-per-cycle", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0, help="of the kill moments")
    args = parser.parse_args()
    rng = random.Random(args.seed)
    work = Path(tempfile.mkdtemp(prefix="kill_resume_"))
    start = time.monotonic()
    try:
        run_to_the_end(work / "uninterrupted")
        reference = checkpoints.export(work / "uninterrupted", work / "uninterrupted.pt")
        equal = 0
        for cycle in range(args.cycles):
            save_dir = work / f"cycle_{cycle}"
            kills = [kill_at_random(save_dir, rng) for _ in range(args.kills_per_cycle)]
            run_to_the_end(save_dir)
            final = checkpoints.export(save_dir, work / f"cycle_{cycle}.pt")
            same = final.keys() == reference.keys() and all(torch.equal(final[k], reference[k]) for k in final)
            equal += same
            print(f"cycle {cycle}: killed after checkpoints {kills}: {'equal' if same else 'DIFFERENT'}", flush=True)
            shutil.rmtree(save_dir)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"{equal} of {args.cycles} cycles ({args.kills_per_cycle} SIGKILL each, at random moments) ended equal "
          f"to the uninterrupted run, bit for bit, in {time.monotonic() - start:.0f} s")
    sys.exit(0 if equal == args.cycles else 1)


if __name__ == "__main__":
    main()
