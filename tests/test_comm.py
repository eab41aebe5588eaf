"""The communication meter sizes each kind of call as its docstring says, on real ranks."""

import pytest
import torch
import torch.distributed as dist

from picotron_like import comm
from picotron_like.testing import run_ranks


def every_kind_of_call():
    rank, n = dist.get_rank(), dist.get_world_size()
    comm.name_group(None, "world")
    x = torch.ones(10)                      # 40 bytes
    comm.call(dist.all_reduce, x)
    comm.call(dist.broadcast, x, src=0)
    gathered = torch.empty(10 * n)
    comm.call(comm.all_gather_single, gathered, x)
    scattered = torch.empty(10)
    comm.call(comm.reduce_scatter_single, scattered, torch.ones(10 * n))
    # Uneven all-to-all: rank r sends r + 1 rows to every peer.
    splits_in = [rank + 1] * n
    splits_out = [peer + 1 for peer in range(n)]
    received = torch.empty(sum(splits_out))
    comm.call(dist.all_to_all_single, received, torch.ones(sum(splits_in)),
              output_split_sizes=splits_out, input_split_sizes=splits_in)
    peer = (rank + 1) % n
    ops = [dist.P2POp(dist.isend, x, peer), dist.P2POp(dist.irecv, torch.empty(10), (rank - 1) % n)]
    for work in comm.call(dist.batch_isend_irecv, ops):
        work.wait()
    counted = {key: (t.calls, t.payload_bytes, t.sent_bytes) for key, t in comm.meter.traffic.items()}
    return counted, comm.meter.first_operation, dict(comm.meter.devices)


def test_meter_sizes_match_the_ring_model():
    n = 4
    results = run_ranks(n, every_kind_of_call)
    ring = (n - 1) / n
    for rank, (counted, first_operation, devices) in enumerate(results):
        # The two facts a GPU run depends on: the group's first operation, and where each kind of
        # call found its tensors (NCCL takes only tensors on the rank's GPU).
        assert first_operation == {"world": "all_reduce"}
        assert devices == {key: {"cpu"} for key in counted}
        assert counted[("all_reduce", "world")] == (1, 40, pytest.approx(2 * ring * 40))
        assert counted[("broadcast", "world")] == (1, 40, 40)
        assert counted[("all_gather_single", "world")] == (1, 40 * n, pytest.approx(ring * 40 * n))
        assert counted[("reduce_scatter_single", "world")] == (1, 40 * n, pytest.approx(ring * 40 * n))
        sent_elsewhere = (rank + 1) * (n - 1) * 4
        assert counted[("all_to_all_single", "world")] == (1, (rank + 1) * n * 4, pytest.approx(sent_elsewhere))
        assert counted[("isend", "world")] == (1, 40, 40)
        assert counted[("irecv", "world")] == (1, 40, 0)
