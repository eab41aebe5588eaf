"""--calibrate (picotron_like/calibrate.py) proven on real gloo ranks: the profile it writes is one
load_profile accepts, its figures are plausible for a CPU (positive, latencies under a second,
rates under bounds no CPU core reaches), and it refuses what it cannot run before any process group.
--plan --device-profile prices with that file, and refuses a file it cannot use in one line.
No assertion depends on this machine's speed: the figures are bounded, not compared."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from picotron_like.calibrate import Sweep, fit_latency_bandwidth, measure_profile, published_stand_in
from picotron_like.device_profile import COLLECTIVES, LINKS, ProfileError, load_profile, save_profile
from picotron_like.lessons import REPO_ROOT, load_lesson
from picotron_like.published_profiles import ALLOCATOR_RESERVE, published_profile
from picotron_like.testing import run_ranks

LESSON = str(REPO_ROOT / "07_full_5d.py")


def run(command: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=240,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory):
    """(path, torchrun's stdout) of the quick sweep on 2 gloo ranks, for the tests below."""
    path = tmp_path_factory.mktemp("calibrated") / "cpu.json"
    done = run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", LESSON,
                "--calibrate", str(path), "--calibrate-quick"])
    assert done.returncode == 0, done.stderr
    return path, done.stdout


def test_calibrate_on_two_ranks_writes_a_plausible_profile(calibrated):
    """The quick sweep on 2 gloo ranks under torchrun: rank 0 writes the file and prints its summary."""
    path, stdout = calibrated
    assert f"wrote {path}" in stdout and "one host: the inter-node figures are the intra-node ones" in stdout
    profile = load_profile(str(path))
    assert profile.device_type == "cpu" and profile.capability is None and profile.ranks_per_node == 2
    assert set(profile.gemm) == set(profile.attention) == set(profile.peak_flops) == {"float32", "bfloat16"}
    assert all(len(points) == 8 for points in profile.gemm.values())         # 2 sizes for each of M, N, K
    rates = [point[-1] for points in [*profile.gemm.values(), *profile.attention.values()] for point in points]
    assert all(0 < rate < 1e13 for rate in rates)                             # under 10 TFLOP/s per rank
    assert profile.peak_flops == profile.extra["best_gemm_flops"]                 # a CPU's peak: the best measured
    assert all(0 < peak < 1e13 for peak in profile.peak_flops.values())
    assert 1e6 < profile.memory_bandwidth < 1e12 and 0 < profile.kernel_overhead_s < 1e-2
    assert 0 <= profile.overlap <= 1 and 0 < profile.memory_gib < 1e5
    for link in LINKS:
        assert set(profile.links[link]) == set(COLLECTIVES)
        assert all(0 <= latency < 1 and 1e5 < bus < 1e12 for latency, bus in profile.links[link].values())
    assert profile.links["inter"] == profile.links["intra"]
    extra = profile.extra
    assert extra["ranks"] == 2 and extra["nodes"] == 1 and extra["threads_per_rank"] == 1
    assert {"host", "cores", "torch", "commit", "date", "collective_times"} <= set(extra)
    assert all(len(times) == 4 for times in extra["collective_times"]["intra"].values())


def test_the_plan_prices_with_a_calibrated_profile(calibrated, capsys):
    """--plan --device-profile: the machine is the profile's (its name, memory and ranks per node),
    the estimate's assumptions name it, and the layouts are priced from it (CPU: float32)."""
    path, _ = calibrated
    profile = load_profile(str(path))
    load_lesson("07_full_5d").main(["--plan", "--device-profile", str(path), "--gpus", "4", "--dp", "2", "--tp", "2"])
    out = capsys.readouterr().out
    assert f"on 4 x {profile.name} ({profile.memory_gib:.0f} GiB each" in out, out
    assert "weights float32, gradients float32" in out, out
    assert f"  - device: {profile.name}, from {profile.source}" in out, out
    assert f"in a node of {profile.ranks_per_node}," in out, out
    listed = out.split("fastest first")[1].splitlines()[2:]
    assert listed[0].startswith("  dp"), out


@pytest.mark.parametrize("content, message", [
    (None, "cannot read it"),
    ("{not json", "not JSON"),
    ('{"format": "something else"}', "not a device profile"),
])
def test_the_plan_refuses_a_profile_it_cannot_use_in_one_line(tmp_path, content, message):
    """An unreadable, non-JSON or wrong-format --device-profile: one error line, exit 2."""
    path = tmp_path / "profile.json"
    if content is not None:
        path.write_text(content)
    done = run([sys.executable, LESSON, "--plan", "--device-profile", str(path), "--gpus", "2"])
    assert done.returncode == 2 and done.stderr.startswith(f"error: --device-profile {path}: {message}"), done.stderr
    assert len(done.stderr.splitlines()) == 1, done.stderr


def test_a_profile_carries_the_allocators_reserve_and_one_without_it_has_none(tmp_path):
    """A GPU's profile carries the caching allocator's reserve (a share); a file written before the field
    existed loads with none (a CPU's 0), and a share outside [0, 1] is refused in one line."""
    path = tmp_path / "h100.json"
    save_profile(published_profile("H100"), str(path))
    assert load_profile(str(path)).allocator_reserve == ALLOCATOR_RESERVE > 0
    raw = json.loads(path.read_text())
    del raw["allocator_reserve"]
    path.write_text(json.dumps(raw))
    assert load_profile(str(path)).allocator_reserve == 0
    path.write_text(json.dumps({**raw, "allocator_reserve": 2}))
    with pytest.raises(ProfileError, match=r"allocator_reserve 2 is not a share between 0 and 1$"):
        load_profile(str(path))


@pytest.mark.parametrize("command, message", [
    (["--calibrate", "{tmp}"], "--calibrate {tmp}: cannot write a file there"),
    (["--calibrate", "{tmp}/cpu.json"], "WORLD_SIZE is not set"),
])
def test_calibrate_refuses_what_it_cannot_run_in_one_line(tmp_path, command, message):
    """A folder for FILE, or no torchrun: one error line, exit 2, before any process group."""
    done = run([sys.executable, LESSON, *[part.format(tmp=tmp_path) for part in command]])
    assert done.returncode == 2 and done.stderr.startswith("error:"), done.stderr
    assert message.format(tmp=tmp_path) in done.stderr and len(done.stderr.splitlines()) == 1, done.stderr


def measure_one_rank(sweep, links_from):
    return measure_profile(torch.device("cpu"), sweep, links_from)


def test_one_rank_calibrates_on_a_known_gpu_with_its_published_links(tmp_path):
    """A GPU lent alone (one rank) has no collective to measure: --calibrate measures the device and
    takes the links and the overlap from the published profile of its kind, saying so. The stand-in
    is found by the GPU's name (the A100s by their memory); a CPU, or an unknown GPU, gets none and
    must start 2 ranks. The one-rank path runs here on a gloo world of one, with the H200's links."""
    assert published_stand_in("NVIDIA H200", 140.0).name == "H200 (published)"
    assert published_stand_in("NVIDIA A100-SXM4-40GB", 39.4).name == "A100-40GB (published)"
    assert published_stand_in("NVIDIA A100-SXM4-80GB", 79.2).name == "A100-80GB (published)"
    assert published_stand_in("NVIDIA GeForce RTX 4090", 24.0) is None
    h200 = published_profile("H200")
    sweep = Sweep(gemm_sizes=(16, 64), attention=((2, 64, 16, True),), elementwise_numel=2**16,
                  collective_bytes=(1024,), window_s=0.005, trials=1, collective_calls=2)
    profile = run_ranks(1, measure_one_rank, sweep, h200)[0]
    assert profile.links == h200.links and profile.overlap == h200.overlap
    assert "links and overlap from H200 (published)" in profile.source
    assert profile.extra["inter"] == "one rank: the links and the overlap are H200 (published)'s, not measured"
    assert all(rate > 0 for point in profile.gemm["float32"] for rate in point[-1:])
    done = run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1", LESSON,
                "--calibrate", str(tmp_path / "cpu.json")])
    assert done.returncode != 0 and not (tmp_path / "cpu.json").exists(), done.stdout + done.stderr
    assert "error: --calibrate measures collectives too: start 2 ranks or more" in done.stderr, done.stderr
    assert "one rank calibrates only on a GPU the published table knows (B300, " in done.stderr, done.stderr


def test_the_fit_recovers_latency_and_bandwidth():
    """Exact points give back their line; sizes too small to show a bandwidth give the best rate
    seen; a line through the origin gives no negative latency."""
    sizes = [1e3, 1e4, 1e5, 1e6, 1e7]
    latency, bandwidth = fit_latency_bandwidth(sizes, [50e-6 + size / 2e9 for size in sizes])
    assert latency == pytest.approx(50e-6, rel=1e-9) and bandwidth == pytest.approx(2e9, rel=1e-9)
    latency, bandwidth = fit_latency_bandwidth([1e3, 1e4], [2e-3, 1e-3])
    assert bandwidth == pytest.approx(1e4 / 1e-3) and latency >= 0
    latency, bandwidth = fit_latency_bandwidth(sizes, [size / 1e9 - 1e-7 for size in sizes])
    assert latency == 0 and 0.9e9 < bandwidth < 1.1e9
