"""What a step-time estimate knows of a machine: a device profile, published or measured.

A profile holds figures, not formulas: the achieved FLOP/s of matrix multiplications over a grid
of shapes, of attention, the memory bandwidth an elementwise kernel reaches, the host time each
launched operation costs, and each collective's latency and bus bandwidth inside a node and
between nodes. The step-time model (lesson 07's plan) reads them; `--calibrate` measures them on
the machine it runs on and writes them to a JSON file that `--plan --device-profile FILE` reads;
the GPUs of the built-in table (published_profiles.published_profile) carry figures derived
from published ones, their source stated in the profile. picotron_like.step_costs reads a
profile: a link's latency is per step of the collective's algorithm (a ring all-reduce of n
ranks takes 2 (n - 1) steps), so that one figure describes a link whatever the group size.

The file is JSON, one object with the fields of DeviceProfile. A link's entry maps each
collective (all_reduce, all_gather, reduce_scatter, all_to_all, p2p) to [latency_s,
bus_bytes_per_s]: the bus bandwidth as nccl-tests define it, so that one figure describes the
link whatever the group size (the algorithm's factor, 2 (n-1)/n for a ring all-reduce, is the
model's). A GEMM point is [M, N, K, flop_per_s] for an (M x K) @ (K x N) product; an attention
point is [batch_x_heads, q_tokens, kv_tokens, head_dim, causal, flop_per_s], FLOPs counted as the
kernel does its work (a causal kernel skips the masked half), the rate of its forward (the model
prices the backward as 2.5 times the forward's FLOPs at that rate).
"""

from __future__ import annotations

import json
import math
from dataclasses import MISSING, asdict, dataclass, field, fields

FORMAT = "picotron_like device profile 1"
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "p2p")
LINKS = ("intra", "inter")


@dataclass(frozen=True)
class DeviceProfile:
    name: str                               # "H100 (published)", "cpu: 4 ranks on 2 cores (calibrated)"
    source: str                             # where the figures come from: a publication, or the run that measured them
    device_type: str                        # "cuda" or "cpu"
    memory_gib: float                       # per rank (a GPU's memory; on a CPU, the host's share of each rank)
    ranks_per_node: int                     # ranks joined by the fast link (NVLink; one host's ranks on a CPU)
    capability: tuple[int, int] | None      # CUDA compute capability (which kernels a run gets); None on a CPU
    peak_flops: dict[str, float]            # dense FLOP/s by dtype name: "bfloat16", "float8", "float32"
    gemm: dict[str, list[list[float]]]      # by dtype name: [M, N, K, achieved FLOP/s]
    attention: dict[str, list[list[float]]]  # by dtype name: [batch x heads, q tokens, kv tokens, head_dim, causal, FLOP/s]
    memory_bandwidth: float                 # bytes/s (read + written) an elementwise kernel reaches
    kernel_overhead_s: float                # host time per launched operation (dispatch and launch, eager)
    links: dict[str, dict[str, list[float]]]  # "intra" / "inter" -> collective -> [latency_s, bus bytes/s]
    overlap: float = 1.0                    # share of an overlapped collective's time that compute hides
    extra: dict = field(default_factory=dict)  # what the measuring run recorded beside (host, cores, ranks, commit)
    # The host beside the device (0: none apart, as on a CPU, where the device's memory is the host's):
    host_link_bandwidth: float = 0.0        # bytes/s per direction between one rank's device and host memory (PCIe, C2C)
    host_memory_bandwidth: float = 0.0      # bytes/s (read + written) the node's CPUs reach in host memory, all ranks'
    host_memory_gib: float = 0.0            # host memory per node
    # The caching allocator's reserve beyond the bytes the plan counts, as a share of those allocated
    # and freed within a step (activations, the loss, gathered weights, buffers): CUDA's allocator
    # keeps freed blocks for reuse and cannot always cut a new request from them, so it reserves more
    # than the allocated peak. 0 on a CPU, whose allocator returns what is freed.
    allocator_reserve: float = 0.0


class ProfileError(ValueError):
    """A profile file that cannot be read or is not a device profile: one line, naming the file."""


def save_profile(profile: DeviceProfile, path: str) -> None:
    with open(path, "w") as file:
        json.dump({"format": FORMAT, **asdict(profile)}, file, indent=1)
        file.write("\n")


def load_profile(path: str) -> DeviceProfile:
    """The profile in `path`, checked field by field, or a ProfileError that says what is wrong."""
    try:
        with open(path) as file:
            raw = json.load(file)
    except OSError as error:
        raise ProfileError(f"--device-profile {path}: cannot read it ({error.strerror or error})") from None
    except json.JSONDecodeError as error:
        raise ProfileError(f"--device-profile {path}: not JSON ({error.msg} at line {error.lineno}); "
                           f"write one with --calibrate") from None
    if not isinstance(raw, dict) or raw.get("format") != FORMAT:
        raise ProfileError(f"--device-profile {path}: not a device profile (its \"format\" must be {FORMAT!r}); "
                           f"write one with --calibrate")
    raw.pop("format")
    names = set(DeviceProfile.__dataclass_fields__)
    optional = {spec.name for spec in fields(DeviceProfile)
                if spec.default is not MISSING or spec.default_factory is not MISSING}
    missing = sorted(name for name in names if name not in raw and name not in optional)
    if missing or set(raw) - names:
        raise ProfileError(f"--device-profile {path}: " + (f"missing {', '.join(missing)}" if missing else
                                                           f"unknown fields {', '.join(sorted(set(raw) - names))}"))
    if raw["capability"] is not None:
        raw["capability"] = tuple(raw["capability"])
    profile = DeviceProfile(**raw)
    problem = profile_problem(profile)
    if problem:
        raise ProfileError(f"--device-profile {path}: {problem}")
    return profile


def profile_problem(profile: DeviceProfile) -> str | None:
    """What makes `profile` unusable, in a few words, or None."""

    def positive(value) -> bool:
        return isinstance(value, (int, float)) and math.isfinite(value) and value > 0

    if profile.device_type not in ("cuda", "cpu"):
        return f"device_type {profile.device_type!r} is neither 'cuda' nor 'cpu'"
    if not positive(profile.memory_gib) or not isinstance(profile.ranks_per_node, int) or profile.ranks_per_node < 1:
        return "memory_gib and ranks_per_node must be positive"
    if not positive(profile.memory_bandwidth) or not (positive(profile.kernel_overhead_s)
                                                      or profile.kernel_overhead_s == 0):
        return "memory_bandwidth must be positive and kernel_overhead_s not negative"
    host = (profile.host_link_bandwidth, profile.host_memory_bandwidth, profile.host_memory_gib)
    if not all(isinstance(value, (int, float)) and math.isfinite(value) and value >= 0 for value in host):
        return "host_link_bandwidth, host_memory_bandwidth and host_memory_gib must be 0 (no host apart) or more"
    if not 0 <= profile.overlap <= 1:
        return f"overlap {profile.overlap} is not a share between 0 and 1"
    if not (isinstance(profile.allocator_reserve, (int, float)) and 0 <= profile.allocator_reserve <= 1):
        return f"allocator_reserve {profile.allocator_reserve} is not a share between 0 and 1"
    if not profile.gemm or any(len(point) != 4 or not all(positive(value) for value in point)
                               for points in profile.gemm.values() for point in points):
        return "gemm needs, for at least one dtype, points [M, N, K, FLOP/s] of positive numbers"
    if any(len(point) != 6 or not positive(point[-1]) for points in profile.attention.values() for point in points):
        return "an attention point is [batch x heads, q tokens, kv tokens, head_dim, causal, FLOP/s]"
    for link in LINKS:
        collectives = profile.links.get(link)
        if collectives is None or set(collectives) != set(COLLECTIVES):
            return f"links[{link!r}] must give each of {', '.join(COLLECTIVES)}"
        if any(len(pair) != 2 or not (positive(pair[0]) or pair[0] == 0) or not positive(pair[1])
               for pair in collectives.values()):
            return f"links[{link!r}]: each collective is [latency_s >= 0, bus bytes/s > 0]"
    return None
