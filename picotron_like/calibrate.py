"""Measure the machine a run starts on: its device profile, over the process group (`--calibrate FILE`).

    torchrun --standalone --nproc_per_node=4 <lesson 07> --calibrate cpu.json
    python <lesson 07> --plan --device-profile cpu.json --gpus 4 ...

The step-time model prices a layout from a DeviceProfile (device_profile.py); this module measures
one with the ranks torchrun starts, as they will train: every rank measures at the same time, so
ranks that share cores (4 ranks on 2 cores) are priced at the share of a core each gets.

    GEMMs          (M x K) @ (K x N) for every M, N, K of a list of sizes, from the slivers a tp or
                   cp cut leaves to large products, in each dtype that runs (float32 and bfloat16
                   on a CPU; bfloat16, and FP8 where torch._scaled_mm runs, on a GPU): FLOP/s
    attention      SDPA's forward and backward at a few shapes: the forward's FLOPs (4 b h q kv d,
                   halved under the causal mask, whose masked half the kernel skips) x 3.5 (the
                   backward does 2.5 forwards) over the pair's time
    memory         an elementwise pass (c = a + b) over tensors larger than the caches: bytes
                   read and written per second
    per-op time    a chain of tiny matmuls through autograd, forward and backward, per GEMM the
                   model prices: dispatch, autograd's bookkeeping (and launch), which a small
                   model's step pays thousands of times
    collectives    all_reduce, all_gather, reduce_scatter, all_to_all and p2p (pairs exchanging)
                   over a sweep of sizes, each fitted to latency + bus bytes / bus bandwidth (bus
                   bytes as nccl-tests count them: 2 (n-1)/n of the payload for an all-reduce,
                   (n-1)/n for the others, all of it for p2p), by least squares on the relative
                   error so that small and large sizes count alike, the latency then shared among
                   the algorithm's steps as the model counts them; inside a node, and between
                   nodes over groups of one rank per node (on one host the inter-node figures are
                   the intra-node ones, which `extra` says)
    overlap        an all-reduce started asynchronously while GEMMs run, against the two apart:
                   the share of the all-reduce's time that the GEMMs hide

Rates are of the work, as the step-time model prices an op (picotron_like.step_costs): on a CPU,
where the host does the work after dispatching it, an op's time less the per-op time; on a GPU,
where the host launches ahead, its whole time. Figures are reduced over the ranks: rates, per-op
time and overlap by their median, collective times by the slowest rank's (a collective is over
when its last rank is done). The peak FLOP/s of a CPU is the best GEMM rate measured over whole
calls; of a GPU its published one (metrics' table), or the best measured where its name is not in
the table. Rank 0 writes the file.

One rank has no collective to measure. On one GPU of a kind the published table knows (an H200 lent
alone, say), --calibrate still measures the GPU and takes the links and the overlap from that GPU's
published profile, which the profile's source and `extra` then say; on a CPU, or a GPU the table does
not know, it needs 2 ranks or more.
"""

from __future__ import annotations

import itertools
import os
import re
import socket
import statistics
import subprocess
import time
from dataclasses import dataclass
from functools import partial

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from picotron_like import comm, step_costs
from picotron_like.device_profile import COLLECTIVES, LINKS, DeviceProfile, save_profile
from picotron_like.lessons import REPO_ROOT
from picotron_like.metrics import peak_flops_of_name
from picotron_like.published_profiles import ALLOCATOR_RESERVE, PUBLISHED_GPUS, published_profile
from picotron_like.topology import DEVICE_ENV, ConfigError, init_distributed, shutdown, world_size_from_env
from picotron_like.train import exit_with_error

GIB = 2**30


@dataclass(frozen=True)
class Sweep:
    """What --calibrate measures, and how long it times each figure."""

    gemm_sizes: tuple[int, ...]                     # M, N and K each take every size
    attention: tuple[tuple[int, int, int, bool], ...]   # (batch x heads, tokens, head_dim, causal)
    elementwise_numel: int                          # float32 elements of each of c = a + b's tensors
    collective_bytes: tuple[int, ...]               # each collective's payload sizes
    window_s: float                                 # a compute figure's timed window: each rank calls its op this long
    trials: int                                     # timed windows per compute figure; the median counts
    collective_calls: int                           # timed calls per collective and size; the median counts


def sweep_for(device_type: str, quick: bool) -> Sweep:
    """The sizes for a CPU (a small model's, whose tp 2 cut of hidden 128 is a 64-wide GEMM) or a
    GPU (up to the large products a GPU needs to reach its peak); `quick`: a few of them (tests)."""
    if device_type == "cuda":
        if quick:
            return Sweep((512, 4096), ((32, 1024, 128, True),), 2**26, (2**14, 2**20, 2**26), 0.01, 3, 7)
        return Sweep((256, 1024, 4096, 16384), ((32, 1024, 128, True), (32, 4096, 128, True), (32, 8192, 128, True),
                                                (32, 4096, 128, False)),
                     2**28, tuple(4**k for k in range(6, 15)), 0.03, 3, 15)
    if quick:
        return Sweep((32, 256), ((8, 128, 32, True),), 2**22, (2**12, 2**15, 2**18, 2**21), 0.01, 3, 7)
    return Sweep((16, 64, 256, 1024), ((16, 128, 32, True), (16, 512, 32, True), (16, 512, 64, False)),
                 2**24, tuple(4**k for k in range(5, 13)), 0.03, 3, 15)


# ============================================================================ timing


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def seconds_per_call(fn, device: torch.device, sweep: Sweep) -> float:
    """fn's time per call while every rank calls it: the median over `sweep.trials` windows that
    all ranks start together (a barrier), each at least `sweep.window_s` and 5 calls long. A GPU
    is its rank's alone: the window's average. CPU ranks share cores, and leave the barrier at
    different moments; a rank that runs while another has not started, or has finished, runs
    faster than in a step. So only the calls that end while every rank is calling count."""
    fn()        # the first call pays one-time set-up; the second's time sizes the window
    synchronize(device)
    start = time.perf_counter()
    fn()
    synchronize(device)
    window = max(sweep.window_s, 5 * (time.perf_counter() - start))
    seconds = []
    for _ in range(sweep.trials):
        comm.bookkeeping(dist.barrier)
        if device.type == "cuda":
            start, calls = time.perf_counter(), 0
            while time.perf_counter() - start < window:
                fn()
                calls += 1
            synchronize(device)
            seconds.append((time.perf_counter() - start) / calls)
            continue
        ends = [time.time()]        # the wall clock: one host's ranks share it
        while ends[-1] - ends[0] < window:
            fn()
            ends.append(time.time())
        latest_start, earliest_end = over_ranks([ends[0], -ends[-1]], "max")
        shared = [end for end in ends[1:] if latest_start <= end <= -earliest_end]
        seconds.append((shared[-1] - shared[0]) / (len(shared) - 1) if len(shared) > 2 else
                       (ends[-1] - ends[0]) / (len(ends) - 1))
    return statistics.median(seconds)


def over_ranks(values: list[float], how: str) -> list[float]:
    """Each of this rank's `values` reduced over every rank: "median" or "max"."""
    local = torch.tensor(values, dtype=torch.float64)
    gathered = torch.empty(dist.get_world_size() * len(values), dtype=torch.float64)
    comm.bookkeeping(comm.all_gather_single, gathered, local)
    rows = gathered.view(dist.get_world_size(), len(values)).numpy()
    return (np.median(rows, axis=0) if how == "median" else rows.max(axis=0)).tolist()


# ============================================================================ compute


# The backward of attention does 2.5 times its forward's FLOPs (the scores again, then dV, dP, dQ,
# dK: five matmuls to the forward's two), as the step-time model prices it (step_costs).
ATTENTION_BACKWARD_FLOPS = 2.5


def kernel_overhead(device: torch.device, sweep: Sweep, chain: int = 16) -> float:
    """The time per op a training step pays before any arithmetic, the median rank's: a chain of
    `chain` tiny matmuls (8 x 8) through autograd, forward and backward, over the 3 GEMMs the model
    prices for each (forward, input and weight gradients). Dispatch, autograd's bookkeeping and,
    on a GPU, the launch: about twice a bare op's time on a CPU."""
    weights = [torch.zeros(8, 8, device=device, requires_grad=True) for _ in range(chain)]
    first = torch.zeros(8, 8, device=device)

    def forward_backward():
        x = first
        for weight in weights:
            x = x @ weight
        x.sum().backward()

    return over_ranks([seconds_per_call(forward_backward, device, sweep) / (3 * chain)], "median")[0]


def work_seconds(seconds: float, device: torch.device, overhead_s: float, launches: int = 1) -> float:
    """An op's measured time per call as the step-time model splits it (step_costs.launched): on a
    CPU the host pays each of its `launches` ops' per-op time, then does the work, which is the
    rest; on a GPU the host launches ahead, and the work is the whole time. At least a tenth of the
    time: an op barely longer than its launch shows no rate of its own."""
    if device.type == "cuda":
        return seconds
    return max(seconds - launches * overhead_s, seconds / 10)


def matmul(a: torch.Tensor, b: torch.Tensor):
    return partial(torch.matmul, a, b)


def gemm_points(device: torch.device, dtype: torch.dtype, sweep: Sweep, overhead_s: float,
                product) -> tuple[list[list[float]], float]:
    """([M, N, K, FLOP/s of the work] for every M, N, K of the sweep, the best rate over the whole
    time), the median rank's, of `product`(a, b): a function of no argument that multiplies a (M x K)
    and b (K x N), tensors of `dtype` (matmul, fp8_gemm)."""
    shapes = list(itertools.product(sweep.gemm_sizes, repeat=3))
    work_rates, whole_rates = [], []
    for m, n, k in shapes:
        call = product(torch.randn(m, k, device=device).to(dtype), torch.randn(k, n, device=device).to(dtype))
        seconds = seconds_per_call(call, device, sweep)
        work_rates.append(2 * m * n * k / work_seconds(seconds, device, overhead_s))
        whole_rates.append(2 * m * n * k / seconds)
    rates = over_ranks(work_rates + whole_rates, "median")
    return [[m, n, k, rate] for (m, n, k), rate in zip(shapes, rates)], max(rates[len(shapes):])


def fp8_runs(device: torch.device) -> bool:
    """Whether torch._scaled_mm multiplies float8_e4m3fn tensors on this GPU (Hopper and newer, or Ada)."""
    try:
        fp8_gemm(torch.randn(16, 16, device=device), torch.randn(16, 16, device=device))()
    except (RuntimeError, NotImplementedError):
        return False
    return True


def fp8_gemm(a: torch.Tensor, b: torch.Tensor):
    """a @ b in FP8 (tensorwise scales of 1, a bfloat16 result), as _scaled_mm wants it: b column-major.
    The values are a and b's, cast."""
    one = torch.ones((), device=a.device)
    a8, b8 = a.to(torch.float8_e4m3fn), b.t().contiguous().to(torch.float8_e4m3fn).t()
    return partial(torch._scaled_mm, a8, b8, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)


def attention_points(device: torch.device, dtype: torch.dtype, sweep: Sweep, overhead_s: float) -> list[list]:
    """[batch x heads, q tokens, kv tokens, head_dim, causal, FLOP/s] of SDPA: its forward's FLOPs
    over the time of its forward and backward (two kernels), the backward counted as
    ATTENTION_BACKWARD_FLOPS forwards, so that the model's price of the pair is the time measured."""
    rates = []
    for batch_heads, tokens, head_dim, causal in sweep.attention:
        q, k, v = (torch.randn(1, batch_heads, tokens, head_dim, device=device, dtype=dtype, requires_grad=True)
                   for _ in range(3))
        grad = torch.randn(1, batch_heads, tokens, head_dim, device=device, dtype=dtype)

        def forward_backward(q=q, k=k, v=v, grad=grad, causal=causal):
            out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
            torch.autograd.grad(out, (q, k, v), grad)

        forward = 4 * batch_heads * tokens * tokens * head_dim * (0.5 if causal else 1.0)
        seconds = work_seconds(seconds_per_call(forward_backward, device, sweep), device, overhead_s, launches=2)
        rates.append((1 + ATTENTION_BACKWARD_FLOPS) * forward / seconds)
    return [[batch_heads, tokens, tokens, head_dim, causal, rate]
            for (batch_heads, tokens, head_dim, causal), rate in zip(sweep.attention, over_ranks(rates, "median"))]


def memory_bandwidth(device: torch.device, sweep: Sweep, overhead_s: float) -> float:
    """Bytes read and written per second by c = a + b (float32), the median rank's."""
    a, b, c = (torch.randn(sweep.elementwise_numel, device=device) for _ in range(3))
    seconds = work_seconds(seconds_per_call(partial(torch.add, a, b, out=c), device, sweep), device, overhead_s)
    return over_ranks([3 * 4 * sweep.elementwise_numel / seconds], "median")[0]


# ============================================================================ communication


def bus_factor(kind: str, n: int) -> float:
    """nccl-tests' bus bytes per payload byte: what each rank moves over its link in a ring."""
    return {"all_reduce": 2 * (n - 1) / n, "p2p": 1.0}.get(kind, (n - 1) / n)


def collective_call(kind: str, payload_bytes: int, members: list[int], group, device: torch.device):
    """(fn, payload bytes): one `kind` call on a float32 payload of about `payload_bytes`, divisible
    over the group: all_gather's output, reduce_scatter's and all_to_all's input; p2p: a rank
    exchanges it with its neighbour in pairs (0 with 1, 2 with 3, ...); an odd group's last rank rests.
    Through comm.bookkeeping, as every collective here: a measurement, not metered as training is,
    and still seen by the collective sequence check (PICOTRON_LIKE_CHECK_COLLECTIVES)."""
    n = len(members)
    numel = max(n, payload_bytes // 4 // n * n)
    full, part = torch.randn(numel, device=device), torch.randn(numel // n, device=device)
    if kind == "all_reduce":
        return partial(comm.bookkeeping, dist.all_reduce, full, group=group), 4 * numel
    if kind == "all_gather":
        return partial(comm.bookkeeping, comm.all_gather_single, full, part, group=group), 4 * numel
    if kind == "reduce_scatter":
        return partial(comm.bookkeeping, comm.reduce_scatter_single, part, full, group=group), 4 * numel
    if kind == "all_to_all":
        return partial(comm.bookkeeping, dist.all_to_all_single, torch.empty_like(full), full, group=group), 4 * numel
    position = members.index(dist.get_rank())
    if position ^ 1 >= n:
        return (lambda: None), 4 * numel
    peer, received = members[position ^ 1], torch.empty_like(full)

    def exchange():
        for request in comm.bookkeeping(dist.batch_isend_irecv, [dist.P2POp(dist.isend, full, peer, group),
                                                                 dist.P2POp(dist.irecv, received, peer, group)]):
            request.wait()

    return exchange, 4 * numel


def collective_seconds(fn, device: torch.device, sweep: Sweep) -> float:
    """This rank's median time of one call, after two warm-up calls (every rank makes the same calls)."""
    seconds = []
    for call in range(2 + sweep.collective_calls):
        synchronize(device)
        start = time.perf_counter()
        fn()
        synchronize(device)
        if call >= 2:
            seconds.append(time.perf_counter() - start)
    return statistics.median(seconds)


def fit_latency_bandwidth(bus_bytes: list[float], seconds: list[float]) -> tuple[float, float]:
    """(latency s, bus bytes/s) of t = latency + bus_bytes / bandwidth, least squares on the relative
    error. Too few large sizes to show a bandwidth (a slope <= 0): the best rate seen, latency the
    rest; a negative intercept: none, the line through the origin."""
    x, t = np.asarray(bus_bytes, dtype=float), np.asarray(seconds, dtype=float)
    w = 1 / t
    (latency, per_byte), *_ = np.linalg.lstsq(np.stack([w, x * w], axis=1), np.ones_like(t), rcond=None)
    if per_byte <= 0:
        per_byte = float(np.min(t / x))
        latency = max(0.0, float(np.sum(w**2 * (t - per_byte * x)) / np.sum(w**2)))
    elif latency < 0:
        latency, per_byte = 0.0, float(np.sum(x * w) / np.sum((x * w) ** 2))
    return float(latency), 1 / float(per_byte)


def latency_steps(kind: str, members: list[int], ranks_per_node: int) -> float:
    """How many latencies the step-time model charges one `kind` call over `members`: its price
    (step_costs.collective_seconds) of an empty call where every latency is one second."""
    unit = DeviceProfile(name="one second per step", source="latency_steps", device_type="cpu", memory_gib=1.0,
                         ranks_per_node=ranks_per_node, capability=None, peak_flops={}, gemm={}, attention={},
                         memory_bandwidth=1.0, kernel_overhead_s=0.0,
                         links={link: {name: [1.0, 1.0] for name in COLLECTIVES} for link in LINKS})
    return step_costs.collective_seconds(unit, kind, 0.0, members)


def link_figures(members: list[int], group, device: torch.device, sweep: Sweep,
                 ranks_per_node: int) -> tuple[dict, dict]:
    """({collective: [latency_s per step, bus bytes/s]}, {collective: [[payload bytes, s], ...]})
    over this rank's group; every rank measures its own group at the same time. Times are the
    slowest rank's; the fitted latency of a call is shared among the steps the model counts in it
    (latency_steps), so that the model prices this group's calls as measured."""
    n, measured = len(members), {}
    for kind in COLLECTIVES:
        calls = [collective_call(kind, size, members, group, device) for size in sweep.collective_bytes]
        comm.bookkeeping(dist.barrier)
        times = over_ranks([collective_seconds(fn, device, sweep) for fn, _ in calls], "max")
        measured[kind] = [[payload, seconds] for (_, payload), seconds in zip(calls, times)]
    fitted = {}
    for kind, points in measured.items():
        latency, bus = fit_latency_bandwidth([bus_factor(kind, n) * payload for payload, _ in points],
                                             [seconds for _, seconds in points])
        fitted[kind] = [latency / latency_steps(kind, members, ranks_per_node), bus]
    return fitted, measured


def overlap_share(members: list[int], group, device: torch.device, dtype: torch.dtype, sweep: Sweep) -> float:
    """The share of an all-reduce's time hidden behind GEMMs that run while it is in flight (async):
    (GEMMs alone + all-reduce alone - both together) / all-reduce alone, between 0 and 1, the median
    rank's. The GEMMs are about as long as the all-reduce, so either could hide the other whole."""
    reduce, _ = collective_call("all_reduce", sweep.collective_bytes[-1], members, group, device)
    size = sweep.gemm_sizes[-1] // 2
    gemm = partial(torch.matmul, torch.randn(size, size, device=device).to(dtype),
                   torch.randn(size, size, device=device).to(dtype))
    comm.bookkeeping(dist.barrier)
    apart = collective_seconds(reduce, device, sweep)
    calls = max(1, round(apart / seconds_per_call(gemm, device, sweep)))

    def gemms():
        for _ in range(calls):
            gemm()

    def together():
        handle = reduce.func(*reduce.args, **reduce.keywords, async_op=True)
        gemms()
        handle.wait()

    comm.bookkeeping(dist.barrier)
    alone = collective_seconds(gemms, device, sweep)
    comm.bookkeeping(dist.barrier)
    both = collective_seconds(together, device, sweep)
    return over_ranks([min(1.0, max(0.0, (alone + apart - both) / apart))], "median")[0]


def node_groups(world: int, ranks_per_node: int):
    """(intra members, intra group, inter members, inter group) of this rank: its node's ranks, and
    the ranks of its local index on every node (torchrun numbers a node's ranks contiguously).
    One node: the world, and no inter-node group. Every rank creates every group, in one order."""
    nodes = world // ranks_per_node
    if nodes == 1:
        return list(range(world)), None, None, None
    rank = dist.get_rank()
    intra = [list(range(node * ranks_per_node, (node + 1) * ranks_per_node)) for node in range(nodes)]
    inter = [list(range(local, world, ranks_per_node)) for local in range(ranks_per_node)]
    intra_groups, inter_groups = [dist.new_group(m) for m in intra], [dist.new_group(m) for m in inter]
    node, local = divmod(rank, ranks_per_node)
    return intra[node], intra_groups[node], inter[local], inter_groups[local]


# ============================================================================ the profile


def ranks_per_node() -> int:
    """torchrun's ranks on this node (LOCAL_WORLD_SIZE); the world when started otherwise (one host)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size()))


def cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def commit() -> str:
    """The repository's commit, with "+changes" when its files differ from it; "unknown" outside git."""
    def git(*args):
        return subprocess.run(["git", "-C", str(REPO_ROOT), *args], capture_output=True, text=True, timeout=10)
    try:
        head, status = git("rev-parse", "--short", "HEAD"), git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    if head.returncode:
        return "unknown"
    return head.stdout.strip() + ("+changes" if status.stdout.strip() else "")


def published_stand_in(gpu_name: str, memory_gib: float) -> DeviceProfile | None:
    """The published profile of the GPU called `gpu_name` (its table key as a whole word, the A100s
    told apart by their memory), whose links and overlap stand in for those one rank cannot
    measure; None for a GPU the table does not know."""
    known = [key for key in PUBLISHED_GPUS if re.search(rf"\b{re.escape(key.split('-')[0])}\b", gpu_name)]
    if not known:
        return None
    return published_profile(min(known, key=lambda key: abs(PUBLISHED_GPUS[key].memory_gib - memory_gib)))


def measure_profile(device: torch.device, sweep: Sweep, links_from: DeviceProfile | None = None) -> DeviceProfile:
    """This machine's profile, measured by every rank of the default process group (all must call it).
    With `links_from` (one rank: published_stand_in), its links and overlap are taken, not measured."""
    started = time.perf_counter()
    world, per_node = dist.get_world_size(), ranks_per_node()
    cuda = device.type == "cuda"
    dtypes = (torch.bfloat16,) if cuda else (torch.float32, torch.bfloat16)
    overhead = kernel_overhead(device, sweep)
    gemm, best = {}, {}
    for dtype in dtypes:
        name = str(dtype).removeprefix("torch.")
        gemm[name], best[name] = gemm_points(device, dtype, sweep, overhead, matmul)
    if cuda and fp8_runs(device):
        gemm["float8"], best["float8"] = gemm_points(device, torch.float32, sweep, overhead, fp8_gemm)
    attention = {str(dtype).removeprefix("torch."): attention_points(device, dtype, sweep, overhead)
                 for dtype in dtypes}
    bandwidth = memory_bandwidth(device, sweep, overhead)
    if links_from is not None:
        intra, inter, overlap = links_from.links["intra"], links_from.links["inter"], links_from.overlap
        intra_points = inter_points = {}
        group_sizes = {"intra": links_from.ranks_per_node, "inter": links_from.ranks_per_node}
        inter_note = f"one rank: the links and the overlap are {links_from.name}'s, not measured"
    else:
        intra_members, intra_group, inter_members, inter_group = node_groups(world, per_node)
        intra, intra_points = link_figures(intra_members, intra_group, device, sweep, per_node)
        if inter_members is None:
            inter, inter_points = intra, intra_points
            inter_note = "one host: the inter-node figures are the intra-node ones"
        else:
            inter, inter_points = link_figures(inter_members, inter_group, device, sweep, per_node)
            inter_note = f"{world // per_node} nodes: groups of one rank per node"
        overlap = overlap_share(intra_members, intra_group, device, dtypes[0], sweep)
        group_sizes = {"intra": len(intra_members), "inter": len(inter_members or intra_members)}
    peaks = dict(best)
    if cuda:
        name = torch.cuda.get_device_name(device)
        published = {"bfloat16": peak_flops_of_name(name), "float8": peak_flops_of_name(name, fp8=True)}
        peaks.update({dtype: peak for dtype, peak in published.items() if peak is not None and dtype in peaks})
        memory_gib = torch.cuda.get_device_properties(device).total_memory / GIB
        title = f"{name} x {world} (calibrated)"
    else:
        memory_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / per_node / GIB
        title = f"cpu: {per_node} ranks on {cores()} cores (calibrated)"
    date = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    host, revision = socket.gethostname(), commit()
    extra = {"host": host, "cores": cores(), "ranks": world, "ranks_per_node": per_node, "nodes": world // per_node,
             "threads_per_rank": torch.get_num_threads(), "torch": torch.__version__, "commit": revision,
             "date": date, "sweep": sweep.__dict__ | {"attention": [list(shape) for shape in sweep.attention]},
             "peak": ("the best GEMM rate measured, per dtype" if not cuda else
                      "published for this GPU's name (metrics' table) where known, else the best GEMM rate measured"),
             "best_gemm_flops": best,
             "reduced_over_ranks": "rates, per-op time and overlap: the median rank's; collective times: the "
                                   "slowest rank's",
             "attention_flops": f"the forward's 4 b h q kv d (halved under the causal mask) x "
                                f"{1 + ATTENTION_BACKWARD_FLOPS} over the forward and backward's time",
             "work": "on a CPU a GEMM's, attention's and the elementwise pass's rates leave out the per-op time "
                     "of their ops (the model adds it to each op)",
             "group_sizes": group_sizes,
             "latency": "per step of the collective's algorithm as step_costs counts them (a ring all-reduce "
                        "2 (n - 1) steps, a tree 2 log2 n, the cheaper): the fitted latency of a call over the "
                        "group measured, divided by its steps",
             "inter": inter_note,
             "collective_times": {"intra": intra_points, "inter": inter_points},
             "allocator_reserve": "not measured: on CUDA the published profiles' share (ALLOCATOR_RESERVE in "
                                  "picotron_like/published_profiles.py), on a CPU 0",
             "seconds": round(time.perf_counter() - started, 1)}
    source = f"--calibrate on {host}, {date}, commit {revision}"
    if links_from is not None:
        source += f"; links and overlap from {links_from.name}: {links_from.source}"
    return DeviceProfile(name=title, source=source,
                         device_type=device.type, memory_gib=memory_gib, ranks_per_node=per_node,
                         capability=tuple(torch.cuda.get_device_capability(device)) if cuda else None,
                         peak_flops=peaks, gemm=gemm, attention=attention, memory_bandwidth=bandwidth,
                         kernel_overhead_s=overhead, links={"intra": intra, "inter": inter}, overlap=overlap,
                         extra=extra, allocator_reserve=ALLOCATOR_RESERVE if cuda else 0.0)


def profile_summary(profile: DeviceProfile) -> str:
    """The profile's key figures, a few lines, as --calibrate prints them."""
    extra = profile.extra
    lines = [f"{profile.name}: measured in {extra['seconds']:.0f} s ({extra['ranks']} ranks, "
             f"{extra['threads_per_rank']} thread(s) each, torch {extra['torch']}, commit {extra['commit']})"]
    for dtype, points in profile.gemm.items():
        lines.append(f"  GEMM {dtype}: peak {profile.peak_flops[dtype] / 1e9:,.1f} GFLOP/s per rank; the work of "
                     f"{len(points)} shapes at {min(p[-1] for p in points) / 1e9:,.1f} to "
                     f"{max(p[-1] for p in points) / 1e9:,.1f}")
    for dtype, points in profile.attention.items():
        lines.append(f"  attention {dtype}: " + ", ".join(
            f"{p[0]}x{p[1]}x{p[3]}{' causal' if p[4] else ''} {p[-1] / 1e9:,.1f}" for p in points) + " GFLOP/s")
    lines.append(f"  memory bandwidth {profile.memory_bandwidth / 1e9:,.1f} GB/s per rank, per-op time "
                 f"{profile.kernel_overhead_s * 1e6:,.1f} us, overlap {profile.overlap:.2f}, "
                 f"memory {profile.memory_gib:,.1f} GiB per rank")
    for link, collectives in profile.links.items():
        lines.append(f"  {link} ({extra['group_sizes'][link]} ranks): " + ", ".join(
            f"{kind} {latency * 1e6:,.0f} us per step + bytes / {bus / 1e9:,.2f} GB/s"
            for kind, (latency, bus) in collectives.items()))
    lines.append(f"  ({extra['inter']})")
    return "\n".join(lines)


# ============================================================================ the command


def add_calibrate_flags(parser) -> None:
    parser.add_argument("--calibrate", default=None, metavar="FILE",
                        help="no training: measure this machine with the ranks torchrun starts (GEMMs, attention, "
                             "memory bandwidth, per-op time, each collective's latency and bandwidth, overlap) and "
                             "write the device profile to FILE, for --plan --device-profile FILE")
    parser.add_argument("--calibrate-quick", action="store_true",
                        help="with --calibrate: a few shapes and sizes only (seconds, for tests)")


def one_rank_stand_in() -> DeviceProfile | None:
    """For a run of one rank, before any process group: the published profile of the GPU it will
    run on (published_stand_in), or None on a CPU or a GPU the table does not know."""
    if os.environ.get(DEVICE_ENV) == "cpu" or not torch.cuda.is_available():
        return None
    index = int(os.environ.get("LOCAL_RANK", 0))
    return published_stand_in(torch.cuda.get_device_name(index),
                               torch.cuda.get_device_properties(index).total_memory / GIB)


def calibrate(args) -> None:
    """--calibrate FILE: measure on every rank, rank 0 writes the profile and prints its summary."""
    try:
        folder = os.path.dirname(os.path.abspath(args.calibrate))
        if os.path.isdir(args.calibrate) or not os.access(folder, os.W_OK):
            raise ConfigError(f"--calibrate {args.calibrate}: cannot write a file there")
        links_from = None
        if world_size_from_env() < 2:
            links_from = one_rank_stand_in()
            if links_from is None:
                raise ConfigError("--calibrate measures collectives too: start 2 ranks or more "
                                  "(torchrun --standalone --nproc_per_node=2 ... --calibrate FILE); one rank "
                                  "calibrates only on a GPU the published table knows (" + ", ".join(PUBLISHED_GPUS)
                                  + "), whose links it takes from there")
    except ConfigError as error:
        exit_with_error(error)
    device = init_distributed()
    profile = measure_profile(device, sweep_for(device.type, args.calibrate_quick), links_from)
    if dist.get_rank() == 0:
        save_profile(profile, args.calibrate)
        print(profile_summary(profile))
        print(f"wrote {args.calibrate}: plan with it by --plan --device-profile {args.calibrate}")
    shutdown()
