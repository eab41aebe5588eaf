"""The collective sequence check (picotron_like.testing.collective_sequences_checked) catches what
NCCL would not, on real gloo ranks, and torch's TORCH_DISTRIBUTED_DEBUG=DETAIL catches part of it.

Each diverged case below is one gloo accepts without a word (the same bytes, another reduce op, a
receive longer than the send), so the run ends and only the check can tell; NCCL would sum
garbage or hang. The composition tests and the layout fuzzer run the check on every layout.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.distributed as dist

from picotron_like import comm
from picotron_like.testing import CollectiveMismatch, collective_sequences_checked, run_ranks, sequence_mismatches


def _transfer(tensor, peer, sending: bool, group=None):
    op = dist.P2POp(dist.isend if sending else dist.irecv, tensor, peer, group)
    for work in comm.call(dist.batch_isend_irecv, [op]):
        work.wait()


def diverged_cases(rank: int, group=None) -> dict:
    """Each case as a function of this rank (two ranks): the same bytes as another dtype and count,
    another reduce op, all-to-all splits that are not transposes (rank 1 expects 4 rows where
    rank 0 sends 3), a receive of 4 elements where 3 are sent."""
    return {
        "numel": lambda: comm.call(dist.all_reduce, torch.ones(4) if rank == 0 else torch.ones(8, dtype=torch.bfloat16),
                                   group=group),
        "op": lambda: comm.call(dist.all_reduce, torch.ones(4), op=dist.ReduceOp.SUM if rank == 0 else dist.ReduceOp.MAX,
                                group=group),
        "splits": lambda: comm.AllToAll.apply(torch.ones(6, 2), group, [3, 4] if rank == 0 else [4, 2],
                                              [3, 3] if rank == 0 else [4, 2]),
        "p2p": lambda: _transfer(torch.ones(3) if rank == 0 else torch.empty(4), 1 - rank, rank == 0, group),
    }


def correct_and_diverged_sequences() -> dict:
    rank, other = dist.get_rank(), 1 - dist.get_rank()
    # Every kind of call, uneven all-to-all and a bookkeeping collective included, issued alike.
    with collective_sequences_checked() as log:
        x = torch.ones(6)
        comm.call(dist.all_reduce, x)
        comm.call(dist.broadcast, x, src=0)
        comm.call(comm.all_gather_single, torch.empty(12), x)
        comm.call(comm.reduce_scatter_single, torch.empty(3), x)
        comm.AllToAll.apply(torch.ones(3 if rank == 0 else 5, 5), None, [1, 3] if rank == 0 else [2, 2],
                            [1, 2] if rank == 0 else [3, 2])
        _transfer(x, other, rank == 0)
        comm.bookkeeping(dist.all_reduce, torch.ones(1), op=dist.ReduceOp.MAX)
    caught = {}
    # The four silent divergences, and a collective that bypasses comm (the same on every rank).
    cases = {**diverged_cases(rank), "bypass": lambda: dist.all_reduce(torch.ones(2))}
    for name, issue in cases.items():
        try:
            with collective_sequences_checked():
                comm.call(dist.barrier)         # a common first call: the cases differ at call 1
                issue()
        except CollectiveMismatch as error:
            caught[name] = str(error)
    # torch's own check: a group made under DETAIL is wrapped, and each collective first compares
    # op type, dtypes and shapes over a gloo group of its own.
    dist.set_debug_level(dist.DebugLevel.DETAIL)
    wrapped = dist.new_group([0, 1])
    dist.set_debug_level(dist.DebugLevel.OFF)
    detail = {}
    for name in ("op", "splits", "p2p", "numel"):      # numel last: the one DETAIL stops
        try:
            diverged_cases(rank, wrapped)[name]()
            detail[name] = "silent"
        except RuntimeError as error:
            detail[name] = str(error).splitlines()[0]
    return {"gathered": log.gathered, "caught": caught, "detail": detail}


@pytest.fixture(scope="module")
def results():
    return run_ranks(2, correct_and_diverged_sequences, timeout_s=90)


def test_diverged_collectives_are_caught_and_a_correct_sequence_passes(results):
    for name, message in results[0]["caught"].items():
        print(f"--- {name}\n{message}")
    caught = results[0]["caught"]
    world = "group world (ranks 0, 1) at call 1:\n"
    assert caught["numel"].startswith(f"collective sequences differ on {world}  rank 0: all_reduce float32 x4 op=SUM "
                                      f"on cpu at test_collective_sequences.py:"), caught["numel"]
    assert "\n  rank 1: all_reduce bfloat16 x8 op=SUM on cpu at test_collective_sequences.py:" in caught["numel"]
    assert "rank 0: all_reduce float32 x4 op=SUM" in caught["op"] and "rank 1: all_reduce float32 x4 op=MAX" in caught["op"]
    assert caught["splits"].startswith(f"all-to-all splits are not transposes on group world (ranks 0, 1) at call 1: "
                                       f"rank 0 sends 3 rows to rank 1 (its input_split_sizes[1]) but rank 1 expects 4 "
                                       f"from it (its output_split_sizes[0])\n"), caught["splits"]
    assert caught["p2p"].startswith("point-to-point transfers differ on group world from rank 0 to rank 1 at transfer 0:"
                                    "\n  rank 0 sends    isend float32 x3"), caught["p2p"]
    assert "\n  rank 1 receives irecv float32 x4" in caught["p2p"]
    assert caught["bypass"] == ("rank 0: torch numbered 2 calls on group world (ranks 0, 1) where comm saw 1: some "
                                "collective bypassed comm.call and comm.bookkeeping, and this check\n"
                                "rank 1: torch numbered 2 calls on group world (ranks 0, 1) where comm saw 1: some "
                                "collective bypassed comm.call and comm.bookkeeping, and this check")
    assert set(results[1]["caught"]) == set(caught), "every rank raises"
    # DETAIL stops a mismatch of dtype or shape before it runs, and lets the other three through.
    for result in results:
        assert result["detail"]["numel"].startswith("Detected mismatch between collectives on ranks")
        assert {name: result["detail"][name] for name in ("op", "splits", "p2p")} == dict.fromkeys(("op", "splits", "p2p"),
                                                                                                    "silent")


def test_a_cuda_run_may_move_cpu_tensors_only_in_bookkeeping(results):
    """On recorded logs: told that the run's device is CUDA, the check names each rank's first
    collective of the step on a CPU tensor (gloo would take it while the peers wait in NCCL, as
    an empty rank's gradient-norm all-reduce would), and passes the bookkeeping ones."""
    logs = results[0]["gathered"]
    assert sequence_mismatches(logs, "cpu") == []
    problems = sequence_mismatches(logs, "cuda")
    print("\n".join(problems))
    assert problems[0].startswith("rank 0 moves a CPU tensor in a CUDA run on group world at call 0: all_reduce "
                                  "float32 x6 op=SUM on cpu at test_collective_sequences.py:"), problems
    assert len(problems) == 4, "each rank's collectives and its transfers"
    on_gpu = [{"names": log["names"],
               "sequences": {key: [call if call.bookkeeping else replace(call, device="cuda") for call in calls]
                             for key, calls in log["sequences"].items()},
               "transfers": {key: [replace(call, device="cuda") for call in calls]
                             for key, calls in log["transfers"].items()}} for log in logs]
    assert sequence_mismatches(on_gpu, "cuda") == []
