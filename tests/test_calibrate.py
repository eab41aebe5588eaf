"""--calibrate (picotron_like/calibrate.py) proven on real gloo ranks: the profile it writes is one
load_profile accepts, its figures are plausible for a CPU (positive, latencies under a second,
rates under bounds no CPU core reaches), and it refuses what it cannot run before any process group.
--plan --device-profile prices with that file, and refuses a file it cannot use in one line.
No assertion depends on this machine's speed: the figures are bounded, not compared."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from picotron_like.calibrate import fit_latency_bandwidth
from picotron_like.device_profile import COLLECTIVES, LINKS, load_profile
from picotron_like.lessons import REPO_ROOT, load_lesson

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


@pytest.mark.parametrize("command, message", [
    (["--calibrate", "{tmp}"], "--calibrate {tmp}: cannot write a file there"),
    (["--calibrate", "{tmp}/cpu.json"], "WORLD_SIZE is not set"),
])
def test_calibrate_refuses_what_it_cannot_run_in_one_line(tmp_path, command, message):
    """A folder for FILE, or no torchrun: one error line, exit 2, before any process group."""
    done = run([sys.executable, LESSON, *[part.format(tmp=tmp_path) for part in command]])
    assert done.returncode == 2 and done.stderr.startswith("error:"), done.stderr
    assert message.format(tmp=tmp_path) in done.stderr and len(done.stderr.splitlines()) == 1, done.stderr


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
