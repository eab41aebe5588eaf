"""What one operation of a training step costs on a device, read from its DeviceProfile.

Three kinds of work make up a step, each priced from the profile's figures and nothing else (no
technique lives here; lesson 07's plan adds the techniques' operations up):

    a matrix multiplication    2 M N K FLOPs at the rate the profile measured for that shape,
                               interpolated in log space over its grid of (M, N, K) points: a
                               tp 8 cut of a small model's layer runs far below the peak
    attention                  the kernel's own FLOPs at the rate of its own points
    an elementwise pass        bytes read and written over the memory bandwidth
    a collective               its algorithm's latency (steps x the link's latency per step) plus
                               its payload x the algorithm's factor over the link's bus bandwidth

Each launched operation costs at least the profile's kernel_overhead_s: on a GPU the host
launches ahead, so an operation takes the longer of its work and its launch; on a CPU the host
does the work, so the two add up. A group sits on the "intra" link when all its ranks share a
node (ranks_per_node consecutive ranks), on "inter" otherwise: a ring that crosses nodes runs at
the pace of its slowest hop, the network, whose bus bandwidth the profile gives per rank (its
NIC); NCCL runs one ring per NIC, so a group with r ranks on each node moves r times that, up to
the bandwidth inside the node.
"""

from __future__ import annotations

import bisect
import math

from picotron_like.device_profile import DeviceProfile

# Bytes on the wire per rank, as a share of the payload (the whole tensor, gathered or reduced),
# for a ring of n ranks: an all-reduce is a reduce-scatter and an all-gather.
WIRE_FACTOR = {"all_reduce": lambda n: 2 * (n - 1) / n, "all_gather": lambda n: (n - 1) / n,
               "reduce_scatter": lambda n: (n - 1) / n, "all_to_all": lambda n: (n - 1) / n, "p2p": lambda n: 1.0}
# Latency steps of each algorithm over n ranks: a ring all-reduce passes 2 (n - 1) messages in
# turn, a (double binary) tree 2 log2 n; gathers and scatters n - 1; an all-to-all's n - 1 sends
# are issued together but each rank still waits for the slowest pair; a send is one.
RING_STEPS = {"all_reduce": lambda n: 2 * (n - 1), "all_gather": lambda n: n - 1, "reduce_scatter": lambda n: n - 1,
              "all_to_all": lambda n: n - 1, "p2p": lambda n: 1}


# Points prepared for interpolation, by the identity of the profile's list (kept alive here, so
# the identity stays its own): a plan prices thousands of operations from the same few lists.
_PREPARED: dict[int, tuple] = {}


def _prepared(points: list[list[float]], rate_at: int, coordinates: tuple[int, ...]) -> tuple:
    key = (id(points), rate_at, coordinates)
    if key not in _PREPARED:
        logs = [tuple(math.log(point[i]) for i in coordinates) for point in points]
        rates = {coords: math.log(point[rate_at]) for coords, point in zip(logs, points)}
        axes = [sorted({coords[i] for coords in logs}) for i in range(len(coordinates))]
        _PREPARED[key] = (points, logs, rates, axes)
    return _PREPARED[key][1:]


def _interpolated_rate(points: list[list[float]], rate_at: int, coordinates: tuple[int, ...],
                       query: tuple[float, ...]) -> float:
    """The rate (point[rate_at]) at `query` (values of point[coordinates]), in log space:
    multilinear over the cell of a product grid that brackets the query (clamped to the grid's
    edges), or, where the points are not such a grid, weighted by inverse squared log distance."""
    logs, rates, axes = _prepared(points, rate_at, coordinates)
    where = tuple(math.log(value) for value in query)
    brackets = []
    for values, x in zip(axes, where):
        x = min(max(x, values[0]), values[-1])
        high = min(bisect.bisect_left(values, x), len(values) - 1)
        low = max(high - 1, 0)
        share = 0.0 if values[high] == values[low] else (x - values[low]) / (values[high] - values[low])
        brackets.append(((values[low], 1 - share), (values[high], share)))
    corners = [[]]
    for bracket in brackets:
        corners = [corner + [end] for corner in corners for end in bracket]
    if all(tuple(value for value, _ in corner) in rates for corner in corners):
        return math.exp(sum(math.prod(weight for _, weight in corner) * rates[tuple(value for value, _ in corner)]
                            for corner in corners))
    weights = [1 / (1e-12 + sum((a - b) ** 2 for a, b in zip(coords, where))) for coords in logs]
    return math.exp(sum(w * rates[coords] for w, coords in zip(weights, logs)) / sum(weights))


def launched(profile: DeviceProfile, work_s: float) -> float:
    """One operation's time: its work and its launch (longer of the two on a GPU, both on a CPU)."""
    if profile.device_type == "cuda":
        return max(work_s, profile.kernel_overhead_s)
    return work_s + profile.kernel_overhead_s


def gemm_rate(profile: DeviceProfile, m: int, n: int, k: int, dtype: str = "bfloat16") -> float:
    """FLOP/s of an (m x k) @ (k x n) product: the profile's points of that dtype (bf16's if it has none)."""
    points = profile.gemm.get(dtype) or profile.gemm.get("bfloat16") or next(iter(profile.gemm.values()))
    return _interpolated_rate(points, 3, (0, 1, 2), (m, n, k))


def gemm_seconds(profile: DeviceProfile, m: int, n: int, k: int, dtype: str = "bfloat16") -> float:
    if min(m, n, k) <= 0:
        return 0.0
    return launched(profile, 2 * m * n * k / gemm_rate(profile, m, n, k, dtype))


def attention_flops(batch_heads: int, q_tokens: int, kv_tokens: int, head_dim: int, causal: bool) -> float:
    """A forward's FLOPs as the kernel does them: q k^T and p v, the masked half skipped if causal
    (over a square block; a block wholly below the diagonal is not causal)."""
    return 4 * batch_heads * q_tokens * kv_tokens * head_dim * (0.5 if causal else 1.0)


def attention_seconds(profile: DeviceProfile, batch_heads: int, q_tokens: int, kv_tokens: int, head_dim: int,
                      causal: bool, dtype: str = "bfloat16", backward: bool = False) -> float:
    """One attention kernel. The backward does 2.5 times the forward's FLOPs (it computes the
    scores again, then dV, dP, dQ, dK: five matmuls to two), at the rate of the same points."""
    points = profile.attention.get(dtype) or next(iter(profile.attention.values()), None)
    flops = attention_flops(batch_heads, q_tokens, kv_tokens, head_dim, causal) * (2.5 if backward else 1.0)
    if not points:      # no attention points: its matmuls at the GEMM rate of the same shapes
        rate = gemm_rate(profile, q_tokens, kv_tokens, head_dim, dtype)
    else:
        key = (id(points), causal)
        if key not in _PREPARED:
            _PREPARED[key] = (points, [p for p in points if bool(p[4]) == causal] or points)
        same = _PREPARED[key][1]
        rate = _interpolated_rate(same, 5, (0, 1, 2, 3), (batch_heads, q_tokens, kv_tokens, head_dim))
    return launched(profile, flops / rate)


def memory_seconds(profile: DeviceProfile, n_bytes: float, launches: int = 1) -> float:
    """Elementwise passes that move `n_bytes` (read and written) in `launches` operations."""
    if launches == 0:
        return 0.0
    return launches * launched(profile, n_bytes / launches / profile.memory_bandwidth)


def nodes_of(ranks: list[int], ranks_per_node: int) -> int:
    return len({rank // ranks_per_node for rank in ranks})


def link_of(ranks: list[int], ranks_per_node: int) -> str:
    return "intra" if nodes_of(ranks, ranks_per_node) == 1 else "inter"


def collective_seconds(profile: DeviceProfile, kind: str, payload_bytes: float, ranks: list[int],
                       calls: int = 1) -> float:
    """`calls` collectives of `kind` (all_reduce, all_gather, reduce_scatter, all_to_all, p2p) over
    the group `ranks` (global ranks: their placement decides the link), moving `payload_bytes` in
    all. Latency: the algorithm's steps, those between nodes at the network's latency per step
    and the others at NVLink's; an all-reduce takes the cheaper of ring and tree (NCCL chooses
    by size). Bandwidth: the payload x the algorithm's factor over the slowest link's bus
    bandwidth (between nodes: one NIC per rank of the group on a node)."""
    n = len(ranks)
    if n == 1 or calls == 0:
        return 0.0
    nodes = nodes_of(ranks, profile.ranks_per_node)
    link = "intra" if nodes == 1 else "inter"
    intra_latency, intra_bus = profile.links["intra"][kind]
    inter_latency, bus = profile.links[link][kind]
    if nodes > 1 and kind != "p2p":    # one ring (channel) per NIC of the group's ranks on a node, at most
        bus = min(intra_bus, bus * (n // nodes))   # NVLink's pace; a send crosses on one NIC
    steps = RING_STEPS[kind]
    if nodes == 1:
        latency = steps(n) * intra_latency
        tree = 2 * math.log2(n) * intra_latency
    else:
        latency = (steps(n) - steps(nodes)) * intra_latency + steps(nodes) * inter_latency
        tree = 2 * math.log2(n / nodes) * intra_latency + 2 * math.log2(nodes) * inter_latency
    if kind == "all_reduce":
        latency = min(latency, tree)
    return calls * latency + payload_bytes * WIRE_FACTOR[kind](n) / bus
