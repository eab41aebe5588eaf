"""Checkpoints proven: lesson 07 resumed exactly in its own layout, closely in others, after kill -9, and
damaged checkpoints refused.

One spawn of 4 gloo ranks trains a base run (dp2 x tp2, ZeRO-1) that saves at step 2 and 4, then
resumes its step-2 checkpoint in the same layout and in three others (pp 2; dp 4 with ZeRO-3;
cp 2 with ZeRO-0); an interleaved run (pp 2 x dp 2, two chunks per rank) resumes in its own
layout and with pp 4, dp 1, one chunk per rank and ZeRO-0; and a mixture-of-experts run (dp 4, ep 4, router biases moved away from zero
so that only the checkpoint can bring them back) resumed with tp 2, ep 2 and ZeRO-3, and at ZeRO-0 with
cp 2, ep 2, whose own checkpoint resumes back at dp 4, ep 4, ZeRO-1; and a Muon run
(dp 2 x tp 2, ZeRO-1) resumed with pp 2 x dp 2, its momentum resharded. The same
layout must give the uninterrupted run's losses bit for bit: the same float operations on the
same values. Another layout sums in another order: the losses agree to 1e-5, the tolerance of
every equality test of the suite against one device. A torchrun run killed with SIGKILL resumes
(on 2 ranks, with the other checks of a world size of 2) and ends with the exact parameters of a
run never killed; the 4-rank checkpoint also resumes on 2 ranks.
"""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from contextlib import redirect_stdout
from dataclasses import replace

import pytest
import torch

import picotron_like.checkpoint as checkpoints
from picotron_like.lessons import REPO_ROOT, load_lesson
from picotron_like.model import GPT
from picotron_like.moe import moe_layers
from picotron_like.testing import run_ranks
from picotron_like.topology import ProcessGrid, torchrun_workers
from picotron_like.train import RankBatches, plan_run, train

CPU = torch.device("cpu")
COMMON = ["--n-layers", "2", "--seq-len", "32", "--micro-batch-size", "2", "--global-batch-tokens", "256",
          "--seed", "3", "--lr", "3e-3", "--warmup-steps", "2"]
BASE = ["--dp", "2", "--tp", "2", "--zero-stage", "1"]
OTHER_LAYOUTS = {"pp 2 (dp 2, tp 1)": ["--pp", "2", "--dp", "2", "--zero-stage", "1"],
                 "ZeRO-3 (dp 4, tp 1)": ["--dp", "4", "--zero-stage", "3"],
                 "ZeRO-0 (cp 2, dp 2)": ["--cp", "2", "--dp", "2", "--zero-stage", "0"],
                 "pp 2 ZeRO-3 kept gathered (dp 2)": ["--pp", "2", "--dp", "2", "--zero-stage", "3",
                                                      "--no-reshard-after-forward"]}
# Written under a pipeline at ZeRO-3 (lesson 07's PipelinedZeroStage3), resumed in its own layout and in
# dp 4 with ZeRO-1
PIPELINED_ZERO_BASE = ["--pp", "2", "--dp", "2", "--zero-stage", "3"]
PIPELINED_ZERO_OTHER = ["--dp", "4", "--zero-stage", "1"]
MOE_BASE = ["--preset", "tiny-moe", "--dp", "4", "--ep", "4", "--zero-stage", "1"]
MOE_OTHER = ["--preset", "tiny-moe", "--dp", "2", "--tp", "2", "--ep", "2", "--zero-stage", "3"]
# Experts at ZeRO-0 (dp 2 x cp 2, ep 2: the experts whole over edp 2): the ZeRO-1 checkpoint resumed
# there for two steps, saving each; its first one resumed back in MOE_BASE's layout for the second.
MOE_ZERO_0 = ["--preset", "tiny-moe", "--dp", "2", "--cp", "2", "--ep", "2", "--zero-stage", "0"]
# Interleaved (lesson 03's schedule, two chunks per pipeline rank; four layers for four chunks),
# resumed in the same layout and with the chunks, pp and dp all changed.
INTERLEAVED_BASE = ["--n-layers", "4", "--pp", "2", "--dp", "2", "--zero-stage", "1", "--schedule", "interleaved",
                    "--virtual-stages", "2"]
INTERLEAVED_OTHER = ["--n-layers", "4", "--pp", "4", "--dp", "1", "--zero-stage", "0"]
# A batch-size ramp (lesson 07's --batch-ramp) over a larger batch, 256 -> 1,024 tokens after 1,500:
# its steps train 256, 512, 768, then 1,024 tokens; the checkpoint after step 1 is mid-ramp, resumed
# in its own layout and in dp 4 with ZeRO-3 (one micro-batch per rank: 256 tokens).
RAMP = ["--global-batch-tokens", "1024", "--batch-ramp", "256", "1500"]
RAMP_OTHER = ["--dp", "4", "--zero-stage", "3"]
KILL_RUN = ["--dp", "2", "--zero-stage", "2", "--steps", "8", "--save-every", "1", "--keep-last", "2"]
# Muon (at AdamW's lr) written at dp 2 x tp 2 with ZeRO-1, its momentum resharded into pp 2 x dp 2
MUON = ["--optimizer", "muon", "--muon-lr", "3e-3"]
MUON_OTHER = ["--pp", "2", "--dp", "2", "--zero-stage", "1", *MUON]
CROSS_LAYOUT = dict(rtol=0, atol=1e-5)   # the suite's loss tolerance against one device
# One resume reads the checkpoint as if a run with another learning rate and rope_theta had written
# it (edited in its manifest after reading): a resuming run may change both, and is told so.
NOTED, WRITTEN_ELSEWHERE = "pp 2 (dp 2, tp 1)", {"settings": {"lr": 1e-3}, "model": {"rope_theta": 5e5}}


def lesson():
    return load_lesson("07_full_5d")


def trainer(argv: list[str], world_size: int, router_bias: bool = False, written: dict | None = None) -> dict:
    """07's main() without the process group, the report and the exit; returns each step's loss
    and gradient norm, what resuming printed and the first steps' rows (their Adam bytes).
    `router_bias`: set the MoE layers' biases to a pattern before training. `written`: manifest
    sections to change before resuming, as if a run with those values had written the checkpoint."""
    os.environ["WORLD_SIZE"] = str(world_size)
    full_5d = lesson()
    args = full_5d.parse_args([*COMMON, *argv])
    plan = plan_run(args, full_5d.validate, full_5d.expert_parallel.moe_config)
    manifest = checkpoints.checkpoint_to_resume(args, plan.cfg, plan.shape)
    data = plan.batches.with_ramp(full_5d.ramp_of_layout(args, plan.grid, plan.shape, manifest))
    for section, values in (written or {}).items():
        manifest[section].update(values)
    grid = ProcessGrid(plan.grid, ep=full_5d.expert_degree(args.ep, plan.cfg, plan.grid))
    # as main() does: a resumed run draws no initial values (they hold NaN until the checkpoint's
    # arrive, so a value the load missed would show in the losses compared below)
    model, pipeline = full_5d.parallelize(plan.cfg, grid, args, CPU, values_to_load=manifest is not None)
    if router_bias:
        for layer in moe_layers(model.module):
            layer.router_bias.copy_(torch.linspace(-0.3, 0.3, layer.n_experts))
    optimizer = full_5d.build_optimizer(model, grid, args)
    settings = full_5d.step_settings(grid, CPU, model.precision, args.max_grad_norm)
    with redirect_stdout(io.StringIO()) as resume_log:
        start_step = checkpoints.resume(args, manifest, model, optimizer, grid)
    first_steps = load_lesson("07_report").FirstStepsMemory(model, optimizer, CPU, first_step=start_step)
    results = []

    def step(batch):
        results.append(full_5d.train_step(model if pipeline is None else pipeline, optimizer, batch, settings))
        return results[-1]

    batches = RankBatches(data, grid.dp_rank, CPU, cut=full_5d.context_parallel.sequence_cut(grid, args.zigzag))
    train(args, optimizer, first_steps.observe(step), batches, start_step=start_step,
          after_step=checkpoints.checkpoint_saver(args, plan.cfg, plan.shape, grid, model, optimizer, data))
    return {"losses": [r.loss for r in results], "norms": [r.grad_norm for r in results], "start": start_step,
            "step_tokens": [data.step_tokens(step) for step in range(start_step, args.steps)],
            "tokens_before": data.tokens_before(start_step),
            "resume_log": resume_log.getvalue().splitlines(),
            "first_steps": [(phase, sample["Adam"]) for phase, sample in first_steps.rows]}


def four_rank_runs(directory: str) -> dict:
    base, moe = f"{directory}/base", f"{directory}/moe"
    runs = {"base": trainer([*BASE, "--steps", "4", "--save-every", "2", "--save-dir", base], 4),
            "same layout": trainer([*BASE, "--steps", "4", "--resume", f"{base}/step_00000002"], 4)}
    for name, layout in OTHER_LAYOUTS.items():
        runs[name] = trainer([*layout, "--steps", "4", "--resume", f"{base}/step_00000002"], 4,
                             written=WRITTEN_ELSEWHERE if name == NOTED else None)
    interleaved = f"{directory}/interleaved"
    runs["interleaved base"] = trainer([*INTERLEAVED_BASE, "--steps", "4", "--save-every", "2", "--save-dir",
                                        interleaved], 4)
    for name, layout in (("interleaved same layout", INTERLEAVED_BASE), ("interleaved other", INTERLEAVED_OTHER)):
        runs[name] = trainer([*layout, "--steps", "4", "--resume", f"{interleaved}/step_00000002"], 4)
    ramp = f"{directory}/ramp"
    runs["ramp base"] = trainer([*RAMP, *BASE, "--steps", "5", "--save-every", "2", "--save-dir", ramp], 4)
    for name, layout in (("ramp same layout", BASE), ("ramp other", RAMP_OTHER)):
        runs[name] = trainer([*RAMP, *layout, "--steps", "5", "--resume", f"{ramp}/step_00000002"], 4)
    runs["moe base"] = trainer([*MOE_BASE, "--steps", "3", "--save-every", "2", "--save-dir", moe], 4, router_bias=True)
    runs["moe other"] = trainer([*MOE_OTHER, "--steps", "3", "--resume", f"{moe}/step_00000002"], 4)
    runs["moe zero-0"] = trainer([*MOE_ZERO_0, "--steps", "4", "--resume", f"{moe}/step_00000002", "--save-every",
                                  "1", "--save-dir", f"{directory}/moe_zero_0"], 4)
    runs["moe from zero-0"] = trainer([*MOE_BASE, "--steps", "4", "--resume",
                                       f"{directory}/moe_zero_0/step_00000003"], 4)
    pipelined = f"{directory}/pipelined"
    runs["pipelined base"] = trainer([*PIPELINED_ZERO_BASE, "--steps", "4", "--save-every", "2", "--save-dir",
                                      pipelined], 4)
    for name, layout in (("pipelined same layout", PIPELINED_ZERO_BASE), ("pipelined other", PIPELINED_ZERO_OTHER)):
        runs[name] = trainer([*layout, "--steps", "4", "--resume", f"{pipelined}/step_00000002"], 4)
    muon = f"{directory}/muon"
    runs["muon base"] = trainer([*BASE, *MUON, "--steps", "4", "--save-every", "2", "--save-dir", muon], 4)
    runs["muon other"] = trainer([*MUON_OTHER, "--steps", "4", "--resume", f"{muon}/step_00000002"], 4)
    return runs


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    directory = tmp_path_factory.mktemp("checkpoints")
    return directory, run_ranks(4, four_rank_runs, str(directory), timeout_s=300)[0]


def test_resume_in_the_same_layout_is_bit_exact_and_in_others_close(saved):
    """Same layout: the losses and gradient norms of steps 2-3 equal the uninterrupted run's
    exactly. pp 2, ZeRO-3 with tp 1, ZeRO-0 with cp 2, pp 2 at ZeRO-3 kept gathered, and experts over ep 2
    with tp 2 and ZeRO-3 (from ep 4, ZeRO-1, the router biases in the checkpoint only): to float32
    rounding; so are experts at ZeRO-0 (cp 2, ep 2) resumed from that checkpoint, and their own
    checkpoint resumed back at ep 4, ZeRO-1 (losses and norms). The
    interleaved run: exactly in its own layout, to rounding with its virtual stages, pp, dp and
    ZeRO stage changed. Written at pp 2 x dp 2 with ZeRO-3: exactly in its own layout, to rounding
    at dp 4 with ZeRO-1. Muon's run resumed with pp 2 x dp 2: to rounding. Resuming
    prints one note per setting or model field that differs from the checkpoint's, and none when
    nothing does; the first steps' memory rows carry the real step numbers and the restored Adam
    states from the first row on."""
    _, runs = saved
    base = runs["base"]
    same_log, noted_log = runs["same layout"]["resume_log"], runs[NOTED]["resume_log"]
    assert len(same_log) == 1 and same_log[0].startswith("resumed from "), same_log
    assert noted_log[0].startswith("resumed from ") and noted_log[1:] == [
        "note: model rope_theta 500000.0 in the checkpoint, 10000.0 in this run: this run's applies from step 2",
        "note: --lr 0.001 in the checkpoint, 0.003 in this run: this run's applies from step 2"], noted_log
    phases, adam = zip(*runs["same layout"]["first_steps"])
    assert phases == ("built, resumed at step 2", "step 2: before optimizer.step", "step 2: after",
                      "step 3: before optimizer.step", "step 3: after"), phases
    assert len(set(adam)) == 1 and adam[0] > 0, adam
    assert [phase for phase, _ in base["first_steps"]][:2] == ["built", "step 0: before optimizer.step"]
    assert runs["same layout"]["start"] == 2 and len(runs["same layout"]["losses"]) == 2
    assert runs["same layout"]["losses"] == base["losses"][2:], (runs["same layout"], base)
    assert runs["same layout"]["norms"] == base["norms"][2:]
    for name in OTHER_LAYOUTS:
        torch.testing.assert_close(torch.tensor(runs[name]["losses"]), torch.tensor(base["losses"][2:]),
                                   **CROSS_LAYOUT, msg=name)
        torch.testing.assert_close(torch.tensor(runs[name]["norms"]), torch.tensor(base["norms"][2:]),
                                   rtol=1e-5, atol=0, msg=name)
    moe_base, moe_other = runs["moe base"], runs["moe other"]
    torch.testing.assert_close(torch.tensor(moe_other["losses"]), torch.tensor(moe_base["losses"][2:]), **CROSS_LAYOUT)
    moe_zero_0, moe_from_zero_0 = runs["moe zero-0"], runs["moe from zero-0"]
    torch.testing.assert_close(torch.tensor(moe_zero_0["losses"][:1]), torch.tensor(moe_base["losses"][2:]),
                               **CROSS_LAYOUT)
    torch.testing.assert_close(torch.tensor(moe_zero_0["norms"][:1]), torch.tensor(moe_base["norms"][2:]), rtol=1e-5,
                               atol=0)
    assert moe_from_zero_0["start"] == 3 and len(moe_from_zero_0["losses"]) == 1, moe_from_zero_0
    torch.testing.assert_close(torch.tensor(moe_from_zero_0["losses"]), torch.tensor(moe_zero_0["losses"][1:]),
                               **CROSS_LAYOUT)
    torch.testing.assert_close(torch.tensor(moe_from_zero_0["norms"]), torch.tensor(moe_zero_0["norms"][1:]),
                               rtol=1e-5, atol=0)
    interleaved, same, other = (runs[f"interleaved {name}"] for name in ("base", "same layout", "other"))
    assert same["losses"] == interleaved["losses"][2:] and same["norms"] == interleaved["norms"][2:], same
    torch.testing.assert_close(torch.tensor(other["losses"]), torch.tensor(interleaved["losses"][2:]), **CROSS_LAYOUT)
    torch.testing.assert_close(torch.tensor(other["norms"]), torch.tensor(interleaved["norms"][2:]), rtol=1e-5, atol=0)
    pipelined, same, other = (runs[f"pipelined {name}"] for name in ("base", "same layout", "other"))
    assert same["losses"] == pipelined["losses"][2:] and same["norms"] == pipelined["norms"][2:], same
    torch.testing.assert_close(torch.tensor(other["losses"]), torch.tensor(pipelined["losses"][2:]), **CROSS_LAYOUT)
    torch.testing.assert_close(torch.tensor(other["norms"]), torch.tensor(pipelined["norms"][2:]), rtol=1e-5, atol=0)
    muon_base, muon_other = runs["muon base"], runs["muon other"]
    assert len(muon_other["resume_log"]) == 1, muon_other["resume_log"]     # Muon's settings as written: no note
    torch.testing.assert_close(torch.tensor(muon_other["losses"]), torch.tensor(muon_base["losses"][2:]), **CROSS_LAYOUT)
    torch.testing.assert_close(torch.tensor(muon_other["norms"]), torch.tensor(muon_base["norms"][2:]), rtol=1e-5,
                               atol=0)


def test_a_checkpoint_taken_mid_ramp_resumes_on_the_ramp_in_any_layout(saved):
    """The ramped run's steps train 256, 512, 768, 1,024, 1,024 tokens; its checkpoint after 512
    records them, and a run resumed from it, in its own layout or in dp 4 with ZeRO-3, starts 768
    tokens into the data with a step of 768 tokens, then full ones: its own layout's losses and
    norms bit for bit the uninterrupted run's, the other's to rounding."""
    directory, runs = saved
    base = runs["ramp base"]
    assert base["step_tokens"] == [256, 512, 768, 1024, 1024]
    manifest = json.loads((directory / "ramp" / "step_00000002" / "manifest.json").read_text())
    assert manifest["ramp_history"] == [[256, 1], [512, 1]] and manifest["run"]["batch_ramp"] == [256, 1500]
    for name in ("ramp same layout", "ramp other"):
        resumed = runs[name]
        assert resumed["start"] == 2 and resumed["tokens_before"] == 768, name
        assert resumed["step_tokens"] == [768, 1024, 1024], name
    assert runs["ramp same layout"]["losses"] == base["losses"][2:]
    assert runs["ramp same layout"]["norms"] == base["norms"][2:]
    torch.testing.assert_close(torch.tensor(runs["ramp other"]["losses"]), torch.tensor(base["losses"][2:]),
                               **CROSS_LAYOUT)


def test_export_loads_into_the_reference_gpt_with_the_same_loss(saved, tmp_path, monkeypatch):
    """The step-2 checkpoint as one state dict: GPT loads it strictly, and its loss on step 2's
    global batch is the loss the base run logged at step 2 (computed with the same weights)."""
    directory, runs = saved
    out = tmp_path / "model.pt"
    checkpoints.main(["export", str(directory / "base" / "step_00000002"), str(out)])
    manifest = checkpoints.read_manifest(directory / "base" / "step_00000002")
    model = GPT(manifest["cfg"], seed=0)
    model.load_state_dict(torch.load(out, weights_only=True), strict=True)
    monkeypatch.setenv("WORLD_SIZE", "4")
    plan = plan_run(lesson().parse_args([*COMMON, *BASE]), lesson().validate)
    window = plan.batches.global_batch(2)
    with torch.no_grad():
        loss = model(window[:, :-1], window[:, 1:]).item()
    assert abs(loss - runs["base"]["losses"][2]) < 1e-5, (loss, runs["base"]["losses"][2])


def damaged_copy(source, target, damage) -> str:
    shutil.copytree(source, target)
    damage(target)
    return str(target)


def test_damaged_checkpoints_are_refused_with_one_line(saved, tmp_path, monkeypatch, capsys):
    """Torn (no manifest), truncated, foreign (another format; a rank file of another step with
    the same size), another model shape, another global batch: each refused with a line naming the
    file and the problem, by the checks every rank makes before any collective (read_manifest) or,
    for contents, when the file is read. A writer's leftover .partial directory is never a
    candidate; a run that would overwrite a newer checkpoint, or has no step left, is refused, and
    so is an AdamW checkpoint resumed under Muon and the reverse (one line, in 07's validate)."""
    directory, _ = saved
    good = directory / "base" / "step_00000002"
    cfg = checkpoints.read_manifest(good)["cfg"]

    def truncate(path):
        with open(path / "rank_00001.pt", "r+b") as file:
            file.truncate(1000)

    cases = {
        "torn": (lambda path: (path / "manifest.json").unlink(), "manifest.json: missing: the checkpoint is torn"),
        "truncated": (truncate, "rank_00001.pt: truncated or replaced: 1000 bytes, the manifest says"),
        "foreign": (lambda path: (path / "manifest.json").write_text(json.dumps({"format": "safetensors index"})),
                    "manifest.json: foreign: not a picotron_like checkpoint manifest"),
        "gone": (lambda path: (path / "rank_00003.pt").unlink(), "rank_00003.pt: missing: the checkpoint is torn"),
    }
    for name, (damage, message) in cases.items():
        path = damaged_copy(good, tmp_path / name, damage)
        with pytest.raises(checkpoints.CheckpointError) as refused:
            checkpoints.read_manifest(path, cfg)
        assert str(refused.value).startswith(f"{path}/{message}") and "\n" not in str(refused.value), name

    with pytest.raises(checkpoints.CheckpointError, match="model shape differs: hidden 128 in the checkpoint, 64 here"):
        checkpoints.read_manifest(good, replace(cfg, hidden=64))
    with pytest.raises(checkpoints.CheckpointError, match=r"sequences_per_step 8, this run has 16: the data would"):
        checkpoints.read_manifest(good, cfg, {"sequences_per_step": 16})

    # Same size, other contents: only the sha256 can tell, checked when the file is read.
    swapped = damaged_copy(good, tmp_path / "swapped", lambda path: shutil.copy(
        directory / "base" / "step_00000004" / "rank_00001.pt", path / "rank_00001.pt"))
    checkpoints.read_manifest(swapped, cfg)
    with pytest.raises(SystemExit) as exit_code:
        checkpoints.main(["export", swapped, str(tmp_path / "never.pt")])
    assert exit_code.value.code == 2
    assert capsys.readouterr().err == (f"error: {swapped}/rank_00001.pt: contents differ from the manifest's sha256: "
                                       f"a file from another checkpoint, or damaged\n")
    assert not (tmp_path / "never.pt").exists()
    # Under torchrun the rank that reads the file finds it; every rank stops, rank 0 prints the line once.
    resumed = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                              str(REPO_ROOT / "07_full_5d.py"), *COMMON, "--dp", "2", "--zero-stage", "3",
                              "--resume", swapped], cwd=REPO_ROOT, capture_output=True, text=True, timeout=180,
                             env=dict(os.environ, OMP_NUM_THREADS="1"))
    # torchrun reports the exit with a traceback of its own; none of ours may reach the user.
    assert re.search(r"exitcode\s*:\s*2\b", resumed.stderr), resumed.stderr
    assert not re.search(r'File "[^"]*(07_full_5d|picotron_like)', resumed.stderr), resumed.stderr
    assert resumed.stderr.count(f"error: {swapped}/rank_00001.pt: contents differ") == 1, resumed.stderr

    # The trainer's own rules: a leftover .partial is ignored, overwriting and finished runs refused.
    (directory / "base" / "step_00000009.partial").mkdir()
    assert checkpoints.resolve("latest", directory / "base") == directory / "base" / "step_00000004"
    full_5d = lesson()
    monkeypatch.setenv("WORLD_SIZE", "4")
    for argv, message in [(["--steps", "6", "--save-dir", str(directory / "base")],
                           "step_00000004: this run starts at step 0 and would overwrite it"),
                          (["--steps", "4", "--save-dir", str(directory / "base"), "--resume"],
                           "step_00000004: already at step 4, --steps 4: nothing left to train"),
                          (["--steps", "6", *MUON, "--resume", str(good)],
                           "step_00000002: written with --optimizer adamw, this run has --optimizer muon: the "
                           "optimizer states differ; resume with --optimizer adamw, or start afresh in another "
                           "--save-dir"),
                          (["--steps", "6", "--resume", str(directory / "muon" / "step_00000002")],
                           "step_00000002: written with --optimizer muon, this run has --optimizer adamw")]:
        args = full_5d.parse_args([*COMMON, *BASE, *argv])
        plan_shape = plan_run(full_5d.parse_args([*COMMON, *BASE]), full_5d.validate).shape
        with pytest.raises(checkpoints.CheckpointError, match=message):
            checkpoints.checkpoint_to_resume(args, cfg, plan_shape)


def two_rank_runs(four_rank_checkpoint: str, killed: str, uninterrupted: str) -> dict:
    return {"killed, resumed": trainer([*KILL_RUN, "--save-dir", killed, "--resume"], 2),
            "never killed": trainer([*KILL_RUN, "--save-dir", uninterrupted], 2),
            "world size 4 -> 2": trainer(["--tp", "2", "--zero-stage", "1", "--steps", "4", "--resume",
                                          four_rank_checkpoint], 2)}


def test_killed_run_resumes_to_the_same_parameters_and_four_ranks_resume_on_two(saved, tmp_path):
    """torchrun (2 ranks, ZeRO-2, a checkpoint every step, the last 2 kept) killed with SIGKILL,
    every process at once, once step 3's checkpoint exists: mid-step, mid-save or mid-deletion; a
    .partial directory may be left. --resume continues from the newest complete checkpoint; the
    final checkpoint's parameters (exported) equal those of a run never killed, exactly. The
    4-rank base checkpoint resumes on 2 ranks (tp 2)."""
    directory, runs = saved
    killed, uninterrupted = tmp_path / "killed", tmp_path / "uninterrupted"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
               str(REPO_ROOT / "07_full_5d.py"), *COMMON, *KILL_RUN, "--save-dir", str(killed)]
    process = subprocess.Popen(command, cwd=REPO_ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                               env=dict(os.environ, OMP_NUM_THREADS="1"))
    deadline = time.monotonic() + 180
    while not (killed / "step_00000003").exists() and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    for pid in [*torchrun_workers(process.pid), process.pid]:     # as a lost node: every process at once
        os.kill(pid, signal.SIGKILL)
    process.wait()
    done = [step for step, path in checkpoints.list_checkpoints(killed)]
    assert 3 <= max(done) < 8, f"the kill must land mid-run: checkpoints {done}"

    results = run_ranks(2, two_rank_runs, str(directory / "base" / "step_00000002"), str(killed),
                        str(uninterrupted), timeout_s=240)[0]
    assert results["killed, resumed"]["start"] == max(done)
    assert [step for step, _ in checkpoints.list_checkpoints(uninterrupted)] == [7, 8]     # --keep-last 2
    resumed = checkpoints.export(killed, tmp_path / "resumed.pt")
    never_killed = checkpoints.export(uninterrupted, tmp_path / "never_killed.pt")
    assert resumed.keys() == never_killed.keys()
    for name in resumed:
        assert torch.equal(resumed[name], never_killed[name]), name
    assert results["killed, resumed"]["losses"] == results["never killed"]["losses"][max(done):]
    torch.testing.assert_close(torch.tensor(results["world size 4 -> 2"]["losses"]),
                               torch.tensor(runs["base"]["losses"][2:]), **CROSS_LAYOUT)


def test_a_flipped_byte_in_any_file_is_refused_naming_the_file(saved, tmp_path):
    """One bit flipped in the middle of the manifest or of any rank file: the checkpoint is refused
    with a line that starts with that file's path, by the manifest check before any collective
    (the manifest carries its own checksum: a flipped digit still parses) or, for a rank file,
    by its sha256 when it is read (here: by export, which reads every file)."""
    directory, _ = saved
    good = directory / "base" / "step_00000002"
    for victim in sorted(path.name for path in good.iterdir()):
        copy = tmp_path / victim
        shutil.copytree(good, copy)
        with open(copy / victim, "r+b") as file:
            size = file.seek(0, os.SEEK_END)
            file.seek(size // 2)
            byte = file.read(1)
            file.seek(size // 2)
            file.write(bytes([byte[0] ^ 1]))
        with pytest.raises(checkpoints.CheckpointError) as refused:
            checkpoints.export(copy, tmp_path / f"{victim}.pt")
        assert str(refused.value).startswith(f"{copy / victim}: "), (victim, str(refused.value))
        assert not (tmp_path / f"{victim}.pt").exists()


def test_a_writer_killed_before_the_rename_leaves_the_previous_checkpoint_the_newest(saved, tmp_path):
    """What a writer killed after its last rank file and manifest, before the rename, leaves on
    disk: a complete step_N.partial. It is never a candidate: --resume takes the newest complete
    checkpoint (save() clears such leftovers when it next starts). --keep-last counts complete
    checkpoints only, and keeps the newest, so it never leaves none to load."""
    directory, _ = saved
    save_dir = tmp_path / "run"
    shutil.copytree(directory / "base" / "step_00000002", save_dir / "step_00000002")
    shutil.copytree(directory / "base" / "step_00000004", save_dir / "step_00000006.partial")
    assert [step for step, _ in checkpoints.list_checkpoints(save_dir)] == [2]
    assert checkpoints.resolve("latest", save_dir) == save_dir / "step_00000002"
    checkpoints.read_manifest(checkpoints.resolve("latest", save_dir))
    for keep_last in (1, 2):
        checkpoints.prune(save_dir, keep_last)
        assert [step for step, _ in checkpoints.list_checkpoints(save_dir)] == [2], keep_last
    shutil.copytree(directory / "base" / "step_00000004", save_dir / "step_00000004")
    checkpoints.prune(save_dir, 1)
    assert [step for step, _ in checkpoints.list_checkpoints(save_dir)] == [4]
    checkpoints.export(save_dir / "step_00000004", tmp_path / "newest.pt")
