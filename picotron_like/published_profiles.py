"""The GPUs the plan knows without measuring them: DeviceProfiles built from published figures.

Each GPU's published figures (its maker's data sheet): memory, dense bf16 and FP8 peaks, HBM
bandwidth, NVLink bandwidth per direction, the network per GPU of the usual HGX node (one NIC per
GPU), the CUDA compute capability. What a data sheet does not say, how close real kernels come
to those figures, is a handful of constants shared by every GPU, each a share of a published
figure or a time, fitted once on the Ultra-Scale Playbook's measured H100 runs of up to 8 nodes
(benchmarks/step_time_vs_published.py --fit prints them; its 16-64-node cells are held out):

    GEMM_PEAK_SHARE       the share of the dense peak a large bf16 GEMM reaches
    GEMM_HALF_RATE_S      the work (in seconds at that rate) at which a GEMM reaches half of it:
                          a small GEMM fills too few of the SMs and waves to reach the peak
    ATTENTION_PEAK_SHARE  the share a flash-attention kernel reaches on long sequences
    HBM_SHARE             the share of the HBM bandwidth an elementwise kernel reaches
    NETWORK_BUS_SHARE     the share of a NIC's bandwidth per direction that a ring crossing nodes
                          reaches, per rank of the group on a node (step_costs.collective_seconds)
    NETWORK_STEP_LATENCY_S  the latency of one network hop of a collective's algorithm
                          (NCCL's tuning model, src/graph/tuning.cc, puts it at 3-14 us by protocol)
    OVERLAP               the share of an overlapped collective's time that compute hides (the
                          rest is contention: the collective's kernels take SMs and memory bandwidth)

The plan's memory is the bytes the caching allocator hands out at the step's peak; the memory a
run needs from the GPU is what the allocator reserves, which is more: it keeps freed blocks to
reuse and cannot always cut a new request from them. ALLOCATOR_RESERVE prices that as a share of
the bytes allocated and freed within a step (activations, the loss, gathered weights, buffers; the
model states are allocated once and do not fragment), fitted on the same cells' measured reserved
memory (the Playbook's figure is torch.cuda.max_memory_reserved, in GiB), apart from the time
constants (--fit searches it on its own, the smallest sum of |log memory ratio|).

and, from measurements others publish: NVLink's bus bandwidth at 80% of its per-direction figure
(nccl-tests on an HGX H100: ~360 GB/s of 450), 2 us per NVLink hop (NCCL's tuning model), 5 us to
launch a kernel. The host beside each GPU (for offloading, to host memory): the DGX system's
memory, its CPUs' PCIe generation and DDR channels, each at an assumed share (HOST_LINK_SHARE,
HOST_MEMORY_SHARE: nothing published here offloads to fit them on). A GH200's host link is its C2C
(450 GB/s per direction), not PCIe: a calibrated profile, or a table row of its own, would say so.

A GEMM's rate is then share x peak x w / (w + w_half), w its work at that rate, and never above
what its operands' bytes allow over the HBM bandwidth (the roofline); the profile carries it as
points over a grid of shapes, as a calibrated profile does, and the plan interpolates between them.
"""

from __future__ import annotations

from typing import NamedTuple

from picotron_like.device_profile import COLLECTIVES, DeviceProfile


class PublishedGPU(NamedTuple):
    memory_gib: int                 # as sold: an H100's 80 GB are 80 x 2^30 bytes (--gpu-memory-gb overrides it)
    capability: tuple[int, int]     # CUDA compute capability: which kernels a run gets (05's grouped matmul)
    bf16_tflops: float              # dense (not 2:4 sparse) tensor-core peak
    fp8_tflops: float | None        # None: no FP8 tensor cores
    hbm_tbps: float                 # HBM bandwidth, TB/s
    nvlink_gbps: float              # per direction and GPU, within a node (HGX board)
    network_gbps: float             # per direction and GPU, to other nodes (one NIC per GPU)
    host_link_gbps: float           # per direction and GPU, to host memory: the host CPU's PCIe x16 (Gen5: 64, Gen4: 32)
    host_memory_tib: float          # the DGX system's host memory per node
    host_memory_gbps: float         # its DDR bandwidth per node: sockets x channels x transfer rate x 8 bytes
    source: str


PUBLISHED_GPUS = {
    "B300": PublishedGPU(288, (10, 3), 2250, 4500, 8.0, 900, 100, 64, 2, 2 * 8 * 6.4 * 8,
                         "NVIDIA HGX B300 data sheet; ConnectX-8 800 Gb/s per GPU; DGX B300: 2 TB, 2 Xeon 6776P "
                         "(PCIe Gen5, 8 channels of DDR5-6400 each)"),
    "B200": PublishedGPU(180, (10, 0), 2250, 4500, 8.0, 900, 50, 64, 2, 2 * 8 * 5.6 * 8,
                         "NVIDIA HGX B200 data sheet; ConnectX-7 400 Gb/s per GPU; DGX B200 user guide: 2 TB, 2 Xeon "
                         "8570 (PCIe Gen5, 8 channels of DDR5-5600 each)"),
    "H200": PublishedGPU(141, (9, 0), 989, 1979, 4.8, 450, 50, 64, 2, 2 * 8 * 4.8 * 8,
                         "NVIDIA H200 SXM data sheet; ConnectX-7 400 Gb/s per GPU; DGX H200: 2 TB, 2 Xeon 8480C "
                         "(PCIe Gen5, 8 channels of DDR5-4800 each)"),
    "H100": PublishedGPU(80, (9, 0), 989, 1979, 3.35, 450, 50, 64, 2, 2 * 8 * 4.8 * 8,
                         "NVIDIA H100 SXM data sheet; 400 Gb/s per GPU; DGX H100: 2 TB, 2 Xeon 8480C (PCIe Gen5, "
                         "8 channels of DDR5-4800 each)"),
    "A100-80GB": PublishedGPU(80, (8, 0), 312, None, 2.039, 300, 25, 32, 2, 2 * 8 * 3.2 * 8,
                              "NVIDIA A100 SXM 80GB data sheet; HDR 200 Gb/s per GPU; DGX A100 640GB: 2 TB, 2 EPYC "
                              "7742 (PCIe Gen4, 8 channels of DDR4-3200 each)"),
    "A100-40GB": PublishedGPU(40, (8, 0), 312, None, 1.555, 300, 25, 32, 1, 2 * 8 * 3.2 * 8,
                              "NVIDIA A100 SXM 40GB data sheet; HDR 200 Gb/s per GPU; DGX A100 320GB: 1 TB, 2 EPYC "
                              "7742 (PCIe Gen4, 8 channels of DDR4-3200 each)"),
}

# Fitted on the Playbook's cells of up to 8 nodes (benchmarks/step_time_vs_published.py --fit,
# from the first guesses 0.75, 5 us, 0.4, 0.5, 0.8, 10 us, 0.8).
GEMM_PEAK_SHARE = 0.75
GEMM_HALF_RATE_S = 2.79e-6
ATTENTION_PEAK_SHARE = 0.318
NETWORK_BUS_SHARE = 0.308
OVERLAP = 0.533
NETWORK_STEP_LATENCY_S = 3.09e-6
HBM_SHARE = 0.622
ALLOCATOR_RESERVE = 0.138
# From measurements others publish, not fitted: nccl-tests' all-reduce bus bandwidth on an HGX
# H100 (~360 GB/s of NVLink's 450), NCCL's per-hop latency on NVLink.
NVLINK_BUS_SHARE = 0.8
NVLINK_STEP_LATENCY_S = 2e-6
KERNEL_LAUNCH_S = 5e-6              # CUDA's launch of one kernel from an eager host (GPU side busy meanwhile)
# The host, assumed rather than fitted (no published run here offloads): a pinned copy reaches about
# 80 % of PCIe's per-direction figure (CUDA's bandwidthTest on Gen5 hosts: ~53 of 64 GB/s), and
# streaming kernels about 70 % of the DDR channels' (STREAM triad on two-socket Xeon servers).
HOST_LINK_SHARE = 0.8
HOST_MEMORY_SHARE = 0.7
# The grid of shapes the profile's points cover, in powers of 4 (the plan interpolates between them).
GRID = [4**i for i in range(2, 10)]


class Constants(NamedTuple):
    """The fitted constants, so that the benchmark's --fit can try others without editing this file."""
    gemm_peak_share: float = GEMM_PEAK_SHARE
    gemm_half_rate_s: float = GEMM_HALF_RATE_S
    attention_peak_share: float = ATTENTION_PEAK_SHARE
    network_bus_share: float = NETWORK_BUS_SHARE
    overlap: float = OVERLAP
    network_step_latency_s: float = NETWORK_STEP_LATENCY_S
    hbm_share: float = HBM_SHARE


def gemm_points(peak: float, hbm: float, constants: Constants) -> list[list[float]]:
    points = []
    for m in GRID:
        for n in GRID:
            for k in GRID:
                work = 2 * m * n * k
                rate = constants.gemm_peak_share * peak
                rate *= work / (work + constants.gemm_half_rate_s * rate)
                roofline = work / (2 * (m * k + k * n + m * n) / hbm)
                points.append([m, n, k, min(rate, roofline)])
    return points


def attention_points(peak: float, constants: Constants) -> list[list[float]]:
    """[batch x heads, q, kv, head_dim, causal, FLOP/s]: the same saturation as a GEMM's over the
    kernel's work, at attention's share of the peak."""
    points = []
    for batch_heads in (1, 16, 256):
        for tokens in GRID[1:]:
            for causal in (0, 1):
                work = 4 * batch_heads * tokens * tokens * 128 * (0.5 if causal else 1.0)
                rate = constants.attention_peak_share * peak
                points.append([batch_heads, tokens, tokens, 128, causal,
                               rate * work / (work + constants.gemm_half_rate_s * rate)])
    return points


def published_profile(name: str, constants: Constants = Constants(),
                      allocator_reserve: float = ALLOCATOR_RESERVE) -> DeviceProfile:
    """The DeviceProfile of a GPU of PUBLISHED_GPUS on an HGX node of 8."""
    gpu = PUBLISHED_GPUS[name]
    peak, hbm = gpu.bf16_tflops * 1e12, gpu.hbm_tbps * 1e12 * constants.hbm_share
    peaks = {"bfloat16": peak, "float32": peak / 2, **({"float8": gpu.fp8_tflops * 1e12} if gpu.fp8_tflops else {})}
    intra = [NVLINK_STEP_LATENCY_S, gpu.nvlink_gbps * 1e9 * NVLINK_BUS_SHARE]
    inter = [constants.network_step_latency_s, gpu.network_gbps * 1e9 * constants.network_bus_share]
    return DeviceProfile(
        name=f"{name} (published)",
        source=f"{gpu.source}; kernels' and links' shares fitted on the Ultra-Scale Playbook's H100 runs "
               f"(picotron_like/published_profiles.py)",
        device_type="cuda", memory_gib=gpu.memory_gib, ranks_per_node=8, capability=gpu.capability,
        peak_flops=peaks,
        gemm={dtype: gemm_points(rate, hbm, constants) for dtype, rate in peaks.items()},
        attention={"bfloat16": attention_points(peak, constants)},
        memory_bandwidth=hbm, kernel_overhead_s=KERNEL_LAUNCH_S,
        links={link: {kind: list(figures) for kind in COLLECTIVES} for link, figures in (("intra", intra),
                                                                                          ("inter", inter))},
        overlap=constants.overlap,
        host_link_bandwidth=gpu.host_link_gbps * 1e9 * HOST_LINK_SHARE,
        host_memory_bandwidth=gpu.host_memory_gbps * 1e9 * HOST_MEMORY_SHARE,
        host_memory_gib=gpu.host_memory_tib * 1024, allocator_reserve=allocator_reserve)
