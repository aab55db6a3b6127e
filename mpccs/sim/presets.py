"""Hardware presets for the simulator, built from link specifications.

Every usable rate is ``nominal x efficiency`` where the nominal rate comes
from the link's specification and the efficiency from its documented
protocol overhead (header bytes per payload). Nothing here is fitted to a
published collective benchmark: the point of the presets is to *predict*
busbw and compare it afterwards with what nccl-tests users publish
(docs/simulator.md, "Validation").

Units in this file: GB/s (1e9 bytes/s) per direction and microseconds, the
way datasheets print them. :mod:`mpccs.sim.fabric` converts to bytes/s and
seconds.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Optional

# --- documented protocol efficiencies -------------------------------------
# NVLink: a packet is 1..18 128-bit flits (WikiChip, "NVLink"); a 256-byte
# write is one header flit plus 16 data flits.
NVLINK_EFF = 256 / (256 + 16)
# PCIe Gen3+: 256-byte max payload, 4 B framing token + 16 B 4DW header +
# 4 B LCRC per TLP, and ~2.5% of the link for DLLPs (ACK, flow control).
PCIE_EFF = 256 / (256 + 24) * 0.975
# RoCEv2 with a 4096-byte MTU: 82 B per packet on the wire (preamble+IFG 20,
# Ethernet 14 + FCS 4, IPv4 20, UDP 8, BTH 12, ICRC 4).
ROCE_EFF = 4096 / (4096 + 82)
# DDR5: no protocol overhead is published; we take STREAM-class efficiency.
DRAM_EFF = 0.80  # assumption, see docs/simulator.md "Limits"

# PCIe x16 data rate per direction after 128b/130b encoding, GB/s.
PCIE_GEN4_X16 = 16 * 16 * 128 / 130 / 8
PCIE_GEN5_X16 = 32 * 16 * 128 / 130 / 8


@dataclass(frozen=True)
class Link:
    """One link class: nominal per-direction rate and protocol efficiency."""

    nominal_GBps: float
    efficiency: float = 1.0
    source: str = ""

    @property
    def usable_GBps(self) -> float:
        return self.nominal_GBps * self.efficiency


# How the scale-up plane moves bytes between two GPUs of one domain.
UP_KINDS = (
    "switch",       # NVSwitch-like: non-blocking, one port per GPU
    "mesh",         # full mesh of point-to-point links (MI300X xGMI)
    "pcie-p2p",     # peer-to-peer over PCIe: the GPU's own x16 link
    "host-staged",  # no P2P: copy through host memory (write + read)
)


@dataclass(frozen=True)
class Preset:
    """One cluster type: a scale-up domain and its scale-out attachment."""

    name: str
    description: str
    gpus_per_domain: int
    up_kind: str
    up_port: Link               # per GPU per direction (per pair for "mesh")
    up_latency_us: float        # per transfer step, post to completion
    nic: Link                   # one NIC port, per direction
    gpus_per_nic: int
    out_latency_us: float
    gpu_pcie: Link              # the GPU's own PCIe link
    nic_pcie: Optional[Link] = None   # the NIC's PCIe link, if it may bind
    host_memory: Optional[Link] = None  # per domain, for host-staged copies
    mesh_aggregate: Optional[Link] = None  # per GPU, all mesh links together
    # Per rank, crossed by both planes (CPU cores that run both transports,
    # one PCIe switch port in front of GPU and NIC); None = none.
    both_planes: Optional[Link] = None
    out_oversubscription: float = 1.0  # >1: scale-out core narrower than NICs
    copy_GBps: float = float("inf")     # local copies (prologue/epilogue)
    reduce_GBps: float = float("inf")   # receiver reduction; inf = fused
    op_overhead_us: float = 0.0         # launch cost per collective
    chunk_overhead_us: dict = field(default_factory=dict)  # per plane
    sources: tuple[str, ...] = ()

    def __post_init__(self):
        if self.up_kind not in UP_KINDS:
            raise ValueError(f"up_kind must be one of {UP_KINDS}, got {self.up_kind!r}")
        if self.gpus_per_domain % self.gpus_per_nic:
            raise ValueError("gpus_per_domain must be a multiple of gpus_per_nic")
        if self.up_kind == "host-staged" and self.host_memory is None:
            raise ValueError("host-staged scale-up needs host_memory")

    def with_(self, **changes) -> "Preset":
        return replace(self, **changes)


# NCCL src/graph/tuning.cc hardware latencies for the Simple protocol, ring:
# NVLink 3.4 us per step, network 14 us per step; base 8.4 us per collective.
NCCL_NVLINK_STEP_US = 3.4
NCCL_NET_STEP_US = 14.0
NCCL_RING_BASE_US = 8.4

CX7_400G = Link(50.0, ROCE_EFF, "ConnectX-7 400 Gb/s, RoCEv2 4096-B MTU")
HDR_200G = Link(25.0, ROCE_EFF, "ConnectX-6 HDR 200 Gb/s, same header overhead")
GEN5_X16 = Link(PCIE_GEN5_X16, PCIE_EFF, "PCIe Gen5 x16, 256-B MPS TLPs")
GEN4_X16 = Link(PCIE_GEN4_X16, PCIE_EFF, "PCIe Gen4 x16, 256-B MPS TLPs")

HGX_H100 = Preset(
    name="h100",
    description="HGX H100: 8 GPUs on NVSwitch (NVLink4), 1x 400G NIC per GPU",
    gpus_per_domain=8,
    up_kind="switch",
    up_port=Link(450.0, NVLINK_EFF, "NVLink4: 18 links x 25 GB/s per direction"),
    up_latency_us=NCCL_NVLINK_STEP_US,
    nic=CX7_400G,
    gpus_per_nic=1,
    out_latency_us=NCCL_NET_STEP_US,
    gpu_pcie=GEN5_X16,
    nic_pcie=GEN5_X16,
    copy_GBps=3350.0 / 2,  # HBM3 3.35 TB/s, a copy reads and writes
    op_overhead_us=NCCL_RING_BASE_US,
    sources=(
        "NVIDIA H100 datasheet: NVLink 900 GB/s bidirectional (18 links)",
        "NVIDIA ConnectX-7 datasheet: 400 Gb/s, PCIe Gen5 x16",
        "NCCL src/graph/tuning.cc: per-step latencies (Simple protocol)",
    ),
)

HGX_A100 = Preset(
    name="a100",
    description="HGX A100: 8 GPUs on NVSwitch (NVLink3), 1x 200G HDR NIC per GPU",
    gpus_per_domain=8,
    up_kind="switch",
    up_port=Link(300.0, NVLINK_EFF, "NVLink3: 12 links x 25 GB/s per direction"),
    up_latency_us=NCCL_NVLINK_STEP_US,
    nic=HDR_200G,
    gpus_per_nic=1,
    out_latency_us=NCCL_NET_STEP_US,
    gpu_pcie=GEN4_X16,
    nic_pcie=GEN4_X16,
    copy_GBps=2039.0 / 2,  # A100 80GB HBM2e
    op_overhead_us=NCCL_RING_BASE_US,
    sources=(
        "NVIDIA A100 datasheet: NVLink 600 GB/s bidirectional (12 links)",
        "NVIDIA ConnectX-6 datasheet: HDR 200 Gb/s, PCIe Gen4 x16",
    ),
)

GB200_NVL72 = Preset(
    name="gb200",
    description="GB200 NVL72: 72-GPU NVLink5 domain, 1x 400G NIC per GPU",
    gpus_per_domain=72,
    up_kind="switch",
    up_port=Link(900.0, NVLINK_EFF, "NVLink5: 18 links x 50 GB/s per direction"),
    up_latency_us=NCCL_NVLINK_STEP_US,
    nic=CX7_400G,
    gpus_per_nic=1,
    out_latency_us=NCCL_NET_STEP_US,
    gpu_pcie=GEN5_X16,
    nic_pcie=GEN5_X16,
    copy_GBps=8000.0 / 2,  # B200 HBM3e 8 TB/s
    op_overhead_us=NCCL_RING_BASE_US,
    sources=(
        "NVIDIA GB200 NVL72 datasheet: 1.8 TB/s NVLink per GPU, 72-GPU domain",
        "ConnectX-7 400 Gb/s per GPU (ConnectX-8 800G in GB300: use a TOML)",
    ),
)

MI300X = Preset(
    name="mi300x",
    description="MI300X platform: 8 GPUs, full xGMI mesh (7 x 64 GB/s), 1x 400G NIC per GPU",
    gpus_per_domain=8,
    up_kind="mesh",
    # No public xGMI packet efficiency: we assume NVLink-like flit overhead.
    up_port=Link(64.0, NVLINK_EFF, "xGMI: 64 GB/s per direction per GPU pair (assumed flit efficiency)"),
    mesh_aggregate=Link(448.0, NVLINK_EFF, "7 links x 64 GB/s per GPU"),
    up_latency_us=NCCL_NVLINK_STEP_US,
    nic=CX7_400G,
    gpus_per_nic=1,
    out_latency_us=NCCL_NET_STEP_US,
    gpu_pcie=GEN5_X16,
    nic_pcie=GEN5_X16,
    copy_GBps=5300.0 / 2,
    op_overhead_us=NCCL_RING_BASE_US,
    sources=("AMD Instinct MI300X platform datasheet: 896 GB/s aggregate xGMI, 128 GB/s per link bidirectional",),
)

# PCIe servers, L40S class: 8 GPUs on PCIe Gen4 x16, one EPYC socket with
# 12 DDR5-4800 channels, 2 x 400G NICs per server (one per 4 GPUs), NICs
# behind the same PCIe switches as their GPUs (GPUDirect RDMA).
_PCIE_COMMON = dict(
    gpus_per_domain=8,
    up_latency_us=NCCL_NVLINK_STEP_US,
    nic=CX7_400G,
    gpus_per_nic=4,
    out_latency_us=NCCL_NET_STEP_US,
    gpu_pcie=GEN4_X16,
    nic_pcie=GEN5_X16,
    host_memory=Link(12 * 38.4, DRAM_EFF, "12 x DDR5-4800 channels (EPYC 9004), STREAM-class efficiency"),
    copy_GBps=864.0 / 2,  # L40S GDDR6 864 GB/s
    op_overhead_us=NCCL_RING_BASE_US,
    sources=(
        "NVIDIA L40S datasheet: PCIe Gen4 x16, no NVLink",
        "AMD EPYC 9004: 12 DDR5-4800 channels per socket",
    ),
)

PCIE_P2P = Preset(
    name="pcie-p2p",
    description="PCIe server (L40S class), P2P through PCIe switches; both planes share each GPU's x16 link",
    up_kind="pcie-p2p",
    up_port=GEN4_X16,
    **_PCIE_COMMON,
)

PCIE_HOST_STAGED = Preset(
    name="pcie-shm",
    description="PCIe server (L40S class) without P2P: GPU-to-GPU copies staged through host memory",
    up_kind="host-staged",
    up_port=GEN4_X16,
    **_PCIE_COMMON,
)

PRESETS: dict[str, Preset] = {
    p.name: p for p in (HGX_H100, HGX_A100, GB200_NVL72, PCIE_P2P, PCIE_HOST_STAGED, MI300X)
}

# Published nccl-tests all_reduce busbw, single node, ring (anchors.md).
PUBLISHED_ALLREDUCE_BUSBW_GBps = {"h100": 370.0, "a100": 230.0}


def get_preset(name: str) -> Preset:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown preset {name!r}; known: {', '.join(PRESETS)}") from None


# --- custom clusters from TOML ---------------------------------------------
_LINK_FIELDS = {"up_port", "nic", "gpu_pcie", "nic_pcie", "host_memory", "mesh_aggregate", "both_planes"}
_PRESET_FIELDS = {f.name for f in fields(Preset)}


def _link_from_toml(value) -> Link:
    if isinstance(value, (int, float)):
        return Link(float(value))
    unknown = set(value) - {"nominal_GBps", "efficiency", "source"}
    if unknown:
        raise ValueError(f"unknown link keys {sorted(unknown)}")
    return Link(float(value["nominal_GBps"]), float(value.get("efficiency", 1.0)), value.get("source", ""))


def preset_from_dict(data: dict) -> Preset:
    """Build a preset from a mapping; ``base`` names a preset to start from."""
    data = dict(data)
    base = data.pop("base", None)
    unknown = set(data) - _PRESET_FIELDS
    if unknown:
        raise ValueError(f"unknown preset keys {sorted(unknown)}")
    values = {k: (_link_from_toml(v) if k in _LINK_FIELDS and v is not None else v) for k, v in data.items()}
    if "sources" in values:
        values["sources"] = tuple(values["sources"])
    if base is not None:
        return replace(get_preset(base), **values)
    return Preset(**values)


def load_toml(path) -> Preset:
    """A custom cluster, e.g.::

        base = "h100"            # optional: start from a preset
        name = "h100-2nic"
        gpus_per_nic = 1
        nic = { nominal_GBps = 100.0, efficiency = 0.98 }
    """
    try:
        import tomllib
    except ImportError:  # Python 3.10: the same parser, as a package
        import tomli as tomllib
    with open(path, "rb") as fh:
        return preset_from_dict(tomllib.load(fh))
