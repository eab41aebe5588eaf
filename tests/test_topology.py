"""The process grid: coordinates, groups on real ranks, neighbours, and the grid's validation rules."""

import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist

from picotron_like import comm
from picotron_like.lessons import REPO_ROOT
from picotron_like.testing import run_ranks, torchrun_workers_by_rank
from picotron_like.topology import (DEFAULT_TIMEOUT_S, GROUP_PER_AXIS_ENV, TIMEOUT_ENV, ConfigError, GridShape,
                                    ProcessGrid, backend_for, collective_timeout_s, rank_device, torchrun_workers,
                                    validate_parallel_config)

LAYOUTS = [GridShape(dp=2, pp=2, cp=2, tp=1), GridShape(dp=1, pp=2, cp=1, tp=4), GridShape(dp=2, pp=1, cp=2, tp=2),
           GridShape(dp=8)]


@pytest.mark.parametrize("shape", LAYOUTS)
def test_coordinates_round_trip_with_tp_fastest(shape):
    ranks = [shape.rank_of(**shape.coords_of(rank)) for rank in range(shape.world_size)]
    assert ranks == list(range(shape.world_size))
    # tp varies fastest, dp slowest.
    assert shape.coords_of(1)["tp"] == (1 if shape.tp > 1 else 0)
    assert shape.coords_of(shape.world_size - 1) == {"dp": shape.dp - 1, "pp": shape.pp - 1,
                                                      "cp": shape.cp - 1, "tp": shape.tp - 1}


def test_groups_of_known_layouts():
    dp2_pp2_cp2 = GridShape(dp=2, pp=2, cp=2, tp=1)
    assert dp2_pp2_cp2.group_ranks(("cp",)) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert dp2_pp2_cp2.group_ranks(("pp",)) == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert dp2_pp2_cp2.group_ranks(("dp",)) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert dp2_pp2_cp2.group_ranks(("dp", "cp")) == [[0, 1, 4, 5], [2, 3, 6, 7]]
    pp2_tp4 = GridShape(dp=1, pp=2, cp=1, tp=4)
    assert pp2_tp4.group_ranks(("tp",)) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert pp2_tp4.group_ranks(("pp",)) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert pp2_tp4.group_ranks(("dp",)) == [[r] for r in range(8)]
    picture = pp2_tp4.picture()
    assert "dp=0 pp=1:  [  4   5   6   7 ]" in picture


def test_expert_groups_cut_each_dp_x_cp_group_into_consecutive_runs():
    """ep groups: consecutive members of a dp x cp group in rank order; edp groups: the members at
    the same place of each ep group. Together they tile every dp x cp group exactly once."""
    shape = GridShape(dp=2, pp=2, cp=2, tp=1)       # dp x cp groups [0 1 4 5] and [2 3 6 7]
    assert shape.ep_group_ranks(2) == [[0, 1], [4, 5], [2, 3], [6, 7]]
    assert shape.edp_group_ranks(2) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert shape.ep_group_ranks(4) == [[0, 1, 4, 5], [2, 3, 6, 7]]
    assert shape.edp_group_ranks(4) == [[0], [1], [4], [5], [2], [3], [6], [7]]
    assert shape.ep_group_ranks(1) == [[r] for r in (0, 1, 4, 5, 2, 3, 6, 7)]
    assert shape.edp_group_ranks(1) == shape.group_ranks(("dp", "cp"))
    with_tp = GridShape(dp=2, cp=2, tp=2)           # dp x cp groups [0 2 4 6] and [1 3 5 7]
    assert with_tp.ep_group_ranks(2) == [[0, 2], [4, 6], [1, 3], [5, 7]]
    assert with_tp.edp_group_ranks(2) == [[0, 4], [2, 6], [1, 5], [3, 7]]
    for ep in (1, 2, 4):
        for members in shape.group_ranks(("dp", "cp")):
            ep_groups = [g for g in shape.ep_group_ranks(ep) if g[0] in members]
            edp_groups = [g for g in shape.edp_group_ranks(ep) if g[0] in members]
            assert sorted(sum(ep_groups, [])) == sorted(members) == sorted(sum(edp_groups, []))
            # every ep group meets every edp group of its dp x cp group in exactly one rank
            assert all(len(set(a) & set(b)) == 1 for a in ep_groups for b in edp_groups)


@pytest.mark.parametrize("ep", [3, 8, 0])
def test_ep_must_divide_dp_x_cp(ep):
    with pytest.raises(ConfigError, match=f"--ep {ep} does not divide dp\\*cp = 2\\*2 = 4"):
        GridShape(dp=2, cp=2, pp=2).ep_group_ranks(ep)


def check_process_groups():
    """On 8 real ranks: each axis group holds exactly the ranks the arithmetic says, and axes with
    the same members share one process group."""
    report = {}
    for shape, ep in zip(LAYOUTS, (4, 1, 2, 8)):
        grid = ProcessGrid(shape, ep=ep)
        expected = [(shape.group_ranks(axes), group) for axes, group in (
            (("tp",), grid.tp_group), (("cp",), grid.cp_group), (("pp",), grid.pp_group),
            (("dp",), grid.dp_group), (("dp", "cp"), grid.dp_cp_group))]
        expected += [(shape.ep_group_ranks(ep), grid.ep_group), (shape.edp_group_ranks(ep), grid.edp_group)]
        for all_ranks, group in expected:
            members = torch.zeros(shape.world_size)
            members[dist.get_rank()] = 1
            comm.call(dist.all_reduce, members, group=group)
            mine = [ranks for ranks in all_ranks if dist.get_rank() in ranks][0]
            assert members.nonzero().flatten().tolist() == mine, (shape, all_ranks)
            if group is grid.ep_group:
                assert mine.index(dist.get_rank()) == grid.ep_rank
        report[str(shape)] = (grid.pp_prev_rank, grid.pp_next_rank, grid.cp_prev_rank, grid.cp_next_rank,
                              grid.is_first_stage, grid.is_last_stage)
        report["communicators", str(shape)] = grid.communicators()
    # Every call above went through the meter under its axis name.
    report["groups"] = sorted({group for (_, group) in comm.meter.traffic})
    os.environ[GROUP_PER_AXIS_ENV] = "1"        # the switch: one group per axis, as before sharing
    grid = ProcessGrid(LAYOUTS[3], ep=8)
    del os.environ[GROUP_PER_AXIS_ENV]
    report["communicators per axis"] = grid.communicators()
    report["distinct per axis"] = len({id(comm.process_group(group)) for group in (
        grid.tp_group, grid.cp_group, grid.pp_group, grid.dp_group, grid.dp_cp_group, grid.ep_group, grid.edp_group)})
    return report


def test_process_groups_on_real_ranks():
    results = run_ranks(8, check_process_groups, timeout_s=120)
    assert results[0]["groups"] == ["cp", "dp", "dp_cp", "edp", "ep", "pp", "tp"]
    # dp=2 pp=2 cp=2: rank 3 = (dp 0, pp 1, cp 1): previous stage rank 1, last stage, cp ring 3 -> 2 -> 3.
    assert results[3][str(LAYOUTS[0])] == (1, None, 2, 2, False, True)
    # pp=2 tp=4: rank 5 = (pp 1, tp 1): previous stage is rank 1.
    assert results[5][str(LAYOUTS[1])] == (1, None, 5, 5, False, True)
    assert results[0][str(LAYOUTS[1])] == (None, 4, 0, 0, True, False)
    # One process group per distinct member set, the default group counted (7 axes + it was 8):
    # dp2 pp2 cp2 ep4: ep is dp x cp, edp and tp are the rank alone: singleton, cp, pp, dp, dp x cp, world.
    # pp2 tp4 ep1: cp, dp, dp x cp, ep and edp are all the rank alone: singleton, tp, pp, world.
    # dp2 cp2 tp2 ep2: ep is cp, edp is dp, pp the rank alone: singleton, tp, cp, dp, dp x cp, world.
    # dp8 ep8: dp, dp x cp and ep are every rank, so the default group itself: singleton, world.
    for result in results:
        assert [result["communicators", str(shape)] for shape in LAYOUTS] == [6, 4, 6, 2]
        # PICOTRON_LIKE_GROUP_PER_AXIS=1: every axis its own group (7), and the default group
        assert (result["communicators per axis"], result["distinct per axis"]) == (8, 7)


def first_operations_of_a_pipeline_grid():
    """On 3 ranks, pp = 3: start the grid, then the first pipeline send, stage 0 to stage 1 only."""
    grid = ProcessGrid(GridShape(pp=3))
    if grid.pp_rank < 2:
        peer = grid.pp_next_rank if grid.is_first_stage else grid.pp_prev_rank
        op = dist.isend if grid.is_first_stage else dist.irecv
        for work in comm.call(dist.batch_isend_irecv, [comm.P2POp(op, torch.ones(4), peer, grid.pp_group)]):
            work.wait()
    return dict(comm.meter.first_operation), sorted(comm.meter.traffic)


def test_every_group_starts_with_an_operation_of_all_its_ranks():
    """A group's first operation must include all of its ranks (NCCL builds its communicator then):
    with pp = 3 the first pipeline send leaves stage 2 out, so the grid must have used each group
    before, with a barrier."""
    results = run_ranks(3, first_operations_of_a_pipeline_grid, timeout_s=60)
    for rank, (first_operation, traffic) in enumerate(results):
        assert first_operation == {group: "barrier" for group in ("tp", "cp", "pp", "dp", "dp_cp", "ep", "edp")}, rank
        # The start-up barriers are not training traffic: the meter forgets them.
        assert traffic == {0: [("isend", "pp")], 1: [("irecv", "pp")], 2: []}[rank]


def test_backend_for_a_device():
    """NCCL for the GPU's tensors with gloo beside it for CPU tensors; gloo alone on a CPU."""
    assert backend_for(torch.device("cuda", 0)) == "cpu:gloo,cuda:nccl"
    assert backend_for(torch.device("cuda", 3)) == "cpu:gloo,cuda:nccl"
    assert backend_for(torch.device("cpu")) == "gloo"



def test_rank_device_one_gpu_per_local_rank_and_the_cpu_on_request():
    """GPU LOCAL_RANK where CUDA has GPUs; the CPU where it has none or PICOTRON_LIKE_DEVICE=cpu asks
    (the suite's proofs, on a GPU machine too); a rank beyond the node's GPUs is one clear error,
    not a second rank on GPU 0 that NCCL refuses later."""
    assert rank_device(0, 0) == torch.device("cpu")
    assert rank_device(3, 8) == torch.device("cuda", 3)
    assert rank_device(3, 8, "cpu") == torch.device("cpu")
    assert rank_device(7, 8, "cuda") == torch.device("cuda", 7)
    with pytest.raises(ConfigError, match="local rank 2 has no GPU: this node has 2"):
        rank_device(2, 2)
    with pytest.raises(ConfigError, match="no CUDA device is visible"):
        rank_device(0, 0, "cuda")
    with pytest.raises(ConfigError, match="expected cpu or cuda"):
        rank_device(0, 1, "gpu")

# The grid's own rules. What an axis needs of the model or the sequence (heads divisible by tp, a
# layer per stage, whole sequence parts per cp rank) is its lesson's, tested there.
@pytest.mark.parametrize("shape, world, message", [
    (GridShape(dp=3), 4, "dp*pp*cp*tp = 3*1*1*1 = 3 but the world size is 4"),
    (GridShape(dp=0), 0, "--dp 0 must be at least 1"),
])
def test_each_validation_rule_names_value_and_fix(shape, world, message):
    with pytest.raises(ConfigError) as error:
        validate_parallel_config(shape, world)
    assert message in str(error.value)


def test_several_violations_are_reported_together():
    with pytest.raises(ConfigError) as error:
        validate_parallel_config(GridShape(dp=0, tp=2), 3)
    assert str(error.value).count("\n  - ") == 2


def test_valid_configs_pass():
    validate_parallel_config(GridShape(dp=2, pp=2, cp=2, tp=1), 8)
    validate_parallel_config(GridShape(pp=2, tp=2), 4)


def test_the_collective_timeout_is_long_and_set_by_one_variable(monkeypatch):
    """Long by default (a compiling or checkpointing peer is not a dead one); a bad value is one
    ConfigError before any process group."""
    monkeypatch.delenv(TIMEOUT_ENV, raising=False)
    assert collective_timeout_s() == DEFAULT_TIMEOUT_S >= 30 * 60
    monkeypatch.setenv(TIMEOUT_ENV, "90")
    assert collective_timeout_s() == 90
    for bad in ("0", "-5", "soon", "nan"):
        monkeypatch.setenv(TIMEOUT_ENV, bad)
        with pytest.raises(ConfigError, match=f"{TIMEOUT_ENV}={bad} must be a positive number"):
            collective_timeout_s()


def test_a_killed_rank_ends_the_run_in_seconds_despite_the_long_timeout(tmp_path):
    """torchrun, 2 ranks of lesson 01 at the default (30-minute) collective timeout; rank 1 killed
    with SIGKILL mid-training. Rank 0 must not wait for the timeout: the whole run is gone well
    within 60 s, with a non-zero exit, and torchrun's report names the lost rank and its signal."""
    log = tmp_path / "stdout.txt"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
               str(REPO_ROOT / "01_data_parallel.py"), "--steps", "100000", "--seq-len", "32",
               "--micro-batch-size", "2", "--val-every", "0"]
    env = {key: value for key, value in os.environ.items() if key != TIMEOUT_ENV}
    with open(log, "w") as stdout:
        process = subprocess.Popen(command, cwd=REPO_ROOT, stdout=stdout, stderr=subprocess.PIPE, text=True,
                                   env=dict(env, OMP_NUM_THREADS="1"))
        try:
            deadline = time.monotonic() + 120
            while "step    3 |" not in log.read_text() and process.poll() is None and time.monotonic() < deadline:
                time.sleep(0.05)
            assert process.poll() is None, log.read_text()
            os.kill(torchrun_workers_by_rank(process.pid)[1], signal.SIGKILL)
            killed_at = time.monotonic()
            _, stderr = process.communicate(timeout=60)
            gone_after = time.monotonic() - killed_at
        finally:
            if process.poll() is None:
                for pid in [*torchrun_workers(process.pid), process.pid]:
                    os.kill(pid, signal.SIGKILL)
                process.wait()
    assert process.returncode != 0
    assert gone_after < 60, gone_after
    assert re.search(r"rank\s*:\s*1\b", stderr) and "Signal 9 (SIGKILL)" in stderr, stderr[-3000:]
    assert not torchrun_workers(process.pid)

