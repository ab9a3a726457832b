"""Hardware data table: accelerators, the nodes they ship in, and this machine (``cpu-local``).

Only data lives here; ``cluster.py`` turns a row into a :class:`ClusterSpec`. Every figure
carries a comment naming its source. Units are in the field names: FLOP/s, bytes, bytes/s,
seconds.

Conventions and assumptions (apply to every GPU row):

* Peak FLOP/s are *dense* figures (no structured sparsity) for the SXM form factor.
  ``float32`` is the plain FP32 (CUDA core) rate and TF32 is recorded under ``"tfloat32"``;
  ``default_precision`` says which rate XLA's default matmul precision runs a dtype at (TF32
  for float32 on A100, H100 and H200: 5.3-5.5x the FP32 rate measured on the lent H100 and
  H200, ``benchmarks/results/gpu-*.md``), and the presets price that dtype at that rate.
  Elementwise float32 work is memory-bound on these parts, so one rate per dtype suffices.
* Memory sizes are the marketed GB read as GiB (an "80GB" A100 reports 81,920 MiB in
  ``nvidia-smi``); the planner is expected to keep its own head-room for the runtime.
* Links are *nominal* one-direction bandwidths; ``cluster.py`` derates them by
  :data:`NVLINK_EFFICIENCY` / :data:`NETWORK_EFFICIENCY` (what ring collectives typically
  reach on large messages) to get an effective bus bandwidth for the α-β model.
* The host network figure is the aggregate of all NICs of one node; each device gets an equal
  share (all devices of a host talk across hosts at once in SPMD programs).
* Matmuls are priced at ``peak x`` the fraction ``kernel_efficiency.json`` gives for the
  call's size where the table has the kind and dtype (``efficiency.py``), else at
  ``peak x achieved_fraction`` (1 where no measurement calibrates it); memory bandwidth at
  the datasheet figure x the table's bandwidth fraction.
* α (latency per collective) values are assumptions, not vendor figures: a few µs inside a
  node over NVLink/NVSwitch, ~10 µs over InfiniBand/EFA with GPUDirect, ~30 µs over TCP.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Mapping

GB = 1e9  # vendor bandwidths are decimal
GiB = 2.0**30
TFLOPS = 1e12
GBIT = 1e9 / 8  # bytes/s in one Gbit/s

NVLINK_EFFICIENCY = 0.8  # assumption: NCCL ring all-reduce bus bandwidth / nominal NVLink
NETWORK_EFFICIENCY = 0.8  # assumption: achieved / nominal line rate between hosts


@dataclasses.dataclass(frozen=True)
class DeviceKind:
    """One accelerator model in the node it is usually deployed in.

    Attributes:
      name: canonical kind used in preset names, e.g. ``"A100-80GB"``.
      match: regular expressions (case-insensitive, ``re.search``) that recognise the
        ``jax.Device.device_kind`` string of this model, e.g. ``"NVIDIA A100-SXM4-80GB"``.
      peak_flops: dense peak FLOP/s per dtype name.
      memory_bytes: device memory (HBM), bytes.
      memory_bandwidth_bytes_per_s: HBM bandwidth, bytes/s.
      intra_host_bytes_per_s: nominal one-direction device-to-device bandwidth inside a node.
      intra_host_alpha_s: assumed latency of one collective inside a node, seconds.
      host_network_bytes_per_s: nominal one-direction bandwidth out of one node (all NICs).
      inter_host_alpha_s: assumed latency of one collective across nodes, seconds.
      devices_per_node: devices in the reference node.
      node: the reference node the link figures come from.
      achieved_fraction: per dtype name, a fixed fraction of ``peak_flops`` a training
        step's matmuls sustain, for kinds and dtypes ``kernel_efficiency.json`` lacks; dtypes
        without an entry in either are priced at the datasheet peak (not calibrated).
      default_precision: per dtype name, the ``peak_flops`` entry XLA's default matmul
        precision runs it at (``{"float32": "tfloat32"}`` where float32 dots use TF32).
    """

    name: str
    match: tuple[str, ...]
    peak_flops: Mapping[str, float]
    memory_bytes: float
    memory_bandwidth_bytes_per_s: float
    intra_host_bytes_per_s: float
    intra_host_alpha_s: float
    host_network_bytes_per_s: float
    inter_host_alpha_s: float
    devices_per_node: int
    node: str
    achieved_fraction: Mapping[str, float] = dataclasses.field(default_factory=dict)
    default_precision: Mapping[str, str] = dataclasses.field(default_factory=dict)

    def default_precision_flops(self) -> dict[str, float]:
        """Dense peak FLOP/s per dtype at XLA's default precision (float32 at the TF32 rate
        where ``default_precision`` says so)."""
        return {d: self.peak_flops[self.default_precision.get(d, d)] for d in self.peak_flops}

    def sustained_flops(self, curved: Collection[str] = ()) -> dict[str, float]:
        """FLOP/s per dtype the cost model prices matmuls at: the default-precision peak,
        times ``achieved_fraction`` for dtypes not in `curved` (those with a size curve,
        which gives their fraction per call)."""
        return {d: v * (1.0 if d in curved else self.achieved_fraction.get(d, 1.0))
                for d, v in self.default_precision_flops().items()}


# --- NVIDIA V100 -------------------------------------------------------------------------------
# NVIDIA V100 Tensor Core GPU datasheet (2020), V100 SXM2 column:
#   7.8 TFLOPS FP64, 15.7 TFLOPS FP32, 125 TFLOPS Tensor (FP16 in, FP32 accumulate),
#   16 or 32 GB HBM2 at 900 GB/s, NVLink 300 GB/s (6 NVLink 2.0 links, both directions).
# V100 has no bfloat16 units: XLA runs bf16 matmuls at the FP32 rate.
_V100_FLOPS = {
    "float64": 7.8 * TFLOPS,
    "float32": 15.7 * TFLOPS,
    "float16": 125.0 * TFLOPS,
    "bfloat16": 15.7 * TFLOPS,
}
_V100_NVLINK = 150 * GB  # 300 GB/s bidirectional -> 150 GB/s per direction (datasheet above)

V100_16GB = DeviceKind(
    name="V100-16GB",
    match=(r"V100.*16\s*GB",),
    peak_flops=_V100_FLOPS,
    memory_bytes=16 * GiB,  # datasheet: 16 GB HBM2
    memory_bandwidth_bytes_per_s=900 * GB,  # datasheet: 900 GB/s
    intra_host_bytes_per_s=_V100_NVLINK,
    intra_host_alpha_s=5e-6,  # assumption (NVLink, hybrid cube-mesh)
    # Alpa's testbed, AWS p3.16xlarge (Amazon EC2 P3 instance page): 8x V100-16GB with
    # NVLink, 25 Gbps network per instance (Alpa paper, OSDI'22 §8: "25 Gbps" across nodes).
    host_network_bytes_per_s=25 * GBIT,
    inter_host_alpha_s=30e-6,  # assumption (TCP over 25 GbE, no GPUDirect RDMA)
    devices_per_node=8,
    node="AWS p3.16xlarge",
    # FP16 matmul efficiency: kernel_efficiency.json (Megatron-LM's single-GPU run, Shoeybi
    # et al. 2019 §5.1, as tests/test_gpu_calibration.py checks).
)

V100_32GB = dataclasses.replace(
    V100_16GB,
    name="V100-32GB",
    match=(r"V100.*32\s*GB",),
    memory_bytes=32 * GiB,  # datasheet: 32 GB HBM2
    # AWS p3dn.24xlarge (Amazon EC2 P3 instance page): 8x V100-32GB, 100 Gbps network.
    host_network_bytes_per_s=100 * GBIT,
    inter_host_alpha_s=15e-6,  # assumption (EFA)
    node="AWS p3dn.24xlarge",
)

# --- NVIDIA A100 -------------------------------------------------------------------------------
# NVIDIA A100 Tensor Core GPU datasheet (2021), SXM columns:
#   9.7 TFLOPS FP64 (19.5 FP64 Tensor Core, used by DGEMM), 19.5 TFLOPS FP32,
#   156 TFLOPS TF32, 312 TFLOPS BF16 / FP16 (dense), 624 TOPS INT8 (dense),
#   40GB HBM2 at 1,555 GB/s; 80GB HBM2e at 2,039 GB/s; NVLink 600 GB/s (third gen, both
#   directions) through NVSwitch.
_A100_FLOPS = {
    "float64": 19.5 * TFLOPS,
    "float32": 19.5 * TFLOPS,
    "tfloat32": 156.0 * TFLOPS,
    "bfloat16": 312.0 * TFLOPS,
    "float16": 312.0 * TFLOPS,
    "int8": 624.0 * TFLOPS,
}
_A100_NVLINK = 300 * GB  # 600 GB/s bidirectional -> 300 GB/s per direction

A100_40GB = DeviceKind(
    name="A100-40GB",
    match=(r"A100.*40\s*GB",),
    peak_flops=_A100_FLOPS,
    memory_bytes=40 * GiB,  # datasheet: 40GB HBM2
    memory_bandwidth_bytes_per_s=1555 * GB,  # datasheet: 1,555 GB/s
    intra_host_bytes_per_s=_A100_NVLINK,
    intra_host_alpha_s=5e-6,  # assumption (NVSwitch)
    # AWS p4d.24xlarge (Amazon EC2 P4 instance page): 8x A100-40GB, 400 Gbps EFA.
    host_network_bytes_per_s=400 * GBIT,
    inter_host_alpha_s=15e-6,  # assumption (EFA with GPUDirect RDMA)
    devices_per_node=8,
    node="AWS p4d.24xlarge",
    default_precision={"float32": "tfloat32"},  # XLA:GPU default precision on Ampere+
)

A100_80GB = dataclasses.replace(
    A100_40GB,
    name="A100-80GB",
    # "A100 80GB PCIe" / "A100-SXM4-80GB"; a bare "A100" without size is not matched on purpose.
    match=(r"A100.*80\s*GB",),
    memory_bytes=80 * GiB,  # datasheet: 80GB HBM2e
    memory_bandwidth_bytes_per_s=2039 * GB,  # datasheet: 2,039 GB/s (SXM)
    # NVIDIA DGX A100 datasheet (2020): 8x single-port ConnectX-6 200 Gb/s HDR InfiniBand
    # for compute traffic, i.e. 200 Gbps per GPU, 1.6 Tbps per node.
    host_network_bytes_per_s=8 * 200 * GBIT,
    inter_host_alpha_s=10e-6,  # assumption (HDR InfiniBand with GPUDirect RDMA)
    node="NVIDIA DGX A100",
)

# --- NVIDIA H100 -------------------------------------------------------------------------------
# NVIDIA H100 Tensor Core GPU datasheet (2023), H100 SXM column (tensor figures are quoted
# "with sparsity"; dense = half): 34 TFLOPS FP64 (67 FP64 Tensor Core), 67 TFLOPS FP32,
# 494.5 TFLOPS TF32, 989.5 TFLOPS BF16 / FP16, 1,979 TOPS INT8 / FP8, 80GB HBM3 at
# 3.35 TB/s, NVLink 900 GB/s (fourth gen, both directions).
H100_80GB = DeviceKind(
    name="H100-80GB",
    # SXM figures; "NVIDIA H100 80GB HBM3" is the SXM part. The PCIe card (H100 PCIe,
    # 2 TB/s HBM2e, 756 TFLOPS BF16) is slower and also matches: an overestimate, noted here.
    match=(r"H100",),
    peak_flops={
        "float64": 67.0 * TFLOPS,
        "float32": 67.0 * TFLOPS,
        "tfloat32": 494.5 * TFLOPS,
        "bfloat16": 989.5 * TFLOPS,
        "float16": 989.5 * TFLOPS,
        "float8_e4m3fn": 1979.0 * TFLOPS,
        "float8_e5m2": 1979.0 * TFLOPS,
        "int8": 1979.0 * TFLOPS,
    },
    memory_bytes=80 * GiB,  # datasheet: 80GB HBM3
    memory_bandwidth_bytes_per_s=3350 * GB,  # datasheet: 3.35 TB/s
    intra_host_bytes_per_s=450 * GB,  # 900 GB/s bidirectional -> 450 GB/s per direction
    intra_host_alpha_s=5e-6,  # assumption (NVSwitch)
    # AWS p5.48xlarge (Amazon EC2 P5 instance page): 8x H100, 3,200 Gbps EFA; NVIDIA DGX H100
    # datasheet: 8x 400 Gb/s ConnectX-7 (also 3.2 Tbps per node).
    host_network_bytes_per_s=3200 * GBIT,
    inter_host_alpha_s=10e-6,  # assumption (EFA / NDR InfiniBand with GPUDirect RDMA)
    devices_per_node=8,
    node="AWS p5.48xlarge / NVIDIA DGX H100",
    # benchmarks/results/gpu-NVIDIA-H100-80GB-HBM3.md: default-precision float32 8192^3 matmul
    # at 368.5 TFLOP/s, precision=HIGHEST at 50.4.
    default_precision={"float32": "tfloat32"},
)

# --- NVIDIA H200 -------------------------------------------------------------------------------
# NVIDIA H200 Tensor Core GPU datasheet (2024), H200 SXM column: the H100's compute rates
# (67 TFLOPS FP32, 989 TFLOPS TF32 / 1,979 BF16 / FP16 "with sparsity", i.e. the H100 figures
# above when dense), 141GB HBM3e at 4.8 TB/s, NVLink 900 GB/s. `jax.Device.device_kind` reads
# "NVIDIA H200"; nvidia-smi reports 143,771 MiB on the SXM part.
H200_141GB = dataclasses.replace(
    H100_80GB,
    name="H200-141GB",
    match=(r"H200",),
    memory_bytes=141 * GiB,  # datasheet: 141GB HBM3e
    memory_bandwidth_bytes_per_s=4800 * GB,  # datasheet: 4.8 TB/s
    # AWS p5e.48xlarge (Amazon EC2 P5 instance page): 8x H200, 3,200 Gbps EFA.
    node="AWS p5e.48xlarge / NVIDIA DGX H200",
)

DEVICE_KINDS: dict[str, DeviceKind] = {
    k.name: k for k in (V100_16GB, V100_32GB, A100_40GB, A100_80GB, H100_80GB, H200_141GB)
}


# --- this machine: cpu-local -------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class MeasuredHost:
    """Whole-host figures measured on the development machine (shared by all emulated devices).

    ``cluster.py`` divides compute, memory and memory bandwidth by the number of emulated
    devices: in an SPMD program all of them run at once on the same cores.
    """

    peak_flops: Mapping[str, float]  # FLOP/s of the whole host
    memory_bytes: float  # host RAM, bytes
    memory_bandwidth_bytes_per_s: float  # whole host, bytes/s
    collective_alpha_s: float  # seconds
    collective_beta_s_per_byte: float  # seconds/byte
    measured: str


# Measured 2026-11-22 on the dev box (2-core "Intel(R) Xeon(R) Processor" VM with AVX-512 and
# AMX-BF16, 24,683,656 kB RAM per /proc/meminfo), jax 0.10.2 with jax_num_cpu_devices=8,
# machine shared with other jobs (expect ±30%). Method:
#   * FLOP/s: 1024x1024 @ 1024x1024 matmul, jax.jit on one device (float32/bfloat16/float16)
#     and numpy (float64); best of 7 runs after a warm-up, 2*n^3 FLOPs.
#     Results: f32 316 GFLOP/s (numpy f32: 346), bf16 277, f16 286, f64 163.
#   * memory bandwidth: np.copyto of a 64 MiB float64 array, best of 7, counting read + write:
#     24.7 GB/s.
#   * collectives: jax.shard_map psum over all 8 devices of 4 B .. 4 MiB float32 vectors, best
#     of 15, least-squares fit of t = α + 2(n-1)/n·S·β: α ≈ 256 µs (an 8-byte psum alone:
#     285-340 µs), β ≈ 6.5e-10 s/B (≈ 1.5 GB/s); 16 MiB was far slower (cache-bound) and left out.
# The profiler (cost_model.profiler) replaces these with a fresh measurement of the live devices.
CPU_LOCAL = MeasuredHost(
    peak_flops={
        "float32": 316e9,
        "bfloat16": 277e9,
        "float16": 286e9,
        "float64": 163e9,
    },
    memory_bytes=24_683_656 * 1024,
    memory_bandwidth_bytes_per_s=24.7 * GB,
    collective_alpha_s=300e-6,
    collective_beta_s_per_byte=6.5e-10,
    measured="2026-11-22, 2-core Xeon VM, jax 0.10.2, 8 emulated CPU devices (see devices.py)",
)
CPU_LOCAL_DEVICES = 8  # the device count cpu-local stands for (tests/conftest.py)
