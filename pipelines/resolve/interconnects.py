"""The links a multi-GPU plan moves bytes over, as data beside the card profiles (`pipelines.gpu_profiles`).

Three links per card: between the GPUs of one node (NVLink on SXM cards, else PCIe through the host), from a GPU to
its host (PCIe: what CPU offload copies over), and between nodes (the network a node of those cards usually has).
Each figure is the vendor's spec-sheet number as printed, with its source; the plan uses one direction of it (a
ring all-gather or reduce-scatter sends and receives at once, each direction at half of a bidirectional figure),
times `COLLECTIVE_EFFICIENCY`. None of these is measured here: they are what the plan assumes until a cluster is.

Between nodes a collective over every GPU is limited by each GPU's share of its node's network (a ring crosses the
network once per node boundary, and the rail-optimised DGX layout gives each GPU its own NIC), so the plan takes the
slower of the NVLink share and the network share per GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

GB = 10**9  # vendors state link rates in decimal units


@dataclass(frozen=True)
class Link:
    """One link: `bytes_per_s` in one direction (per GPU within a node; per node between nodes), and its source."""

    name: str
    bytes_per_s: float
    source: str


def _bidirectional(name: str, gb_per_s: float, source: str) -> Link:
    """A link the data sheet states as a bidirectional total (NVLink, PCIe): one direction is half."""
    return Link(f"{name} ({gb_per_s:g} GB/s both ways)", gb_per_s * GB / 2, source)


def _network(name: str, nics: int, gbit_per_s: float, source: str) -> Link:
    """A node's network: `nics` ports of `gbit_per_s` each, per direction (full duplex)."""
    return Link(f"{name} ({nics} x {gbit_per_s:g} Gb/s)", nics * gbit_per_s * GB / 8, source)


_A100 = "NVIDIA A100 data sheet (nvidia.com/en-us/data-center/a100): NVLink 600 GB/s, PCIe Gen4 64 GB/s"
_H100 = "NVIDIA H100 data sheet (nvidia.com/en-us/data-center/h100): SXM NVLink 900 GB/s, PCIe Gen5 128 GB/s"
_H200 = "NVIDIA H200 data sheet (nvidia.com/en-us/data-center/h200): SXM NVLink 900 GB/s, PCIe Gen5 128 GB/s"
_L4 = "NVIDIA L4 data sheet (nvidia.com/en-us/data-center/l4): PCIe Gen4 x16 64 GB/s, no NVLink"
_A10 = "NVIDIA A10 data sheet (nvidia.com/en-us/data-center/products/a10-gpu): PCIe Gen4 64 GB/s"
_T4 = "NVIDIA T4 data sheet (nvidia.com/en-us/data-center/tesla-t4): PCIe Gen3 x16 32 GB/s"
_4090 = "NVIDIA GeForce RTX 4090 specifications: PCIe Gen4 x16 (64 GB/s both ways), no NVLink"
_PCIE4 = ("PCIe Gen4", 64.0)

# Between the GPUs of one node.
WITHIN_NODE: dict[str, Link] = {
    "A100-40GB": _bidirectional("NVLink 3", 600, _A100),
    "A100-80GB": _bidirectional("NVLink 3", 600, _A100),
    "H100-80GB": _bidirectional("NVLink 4", 900, _H100),
    "H200": _bidirectional("NVLink 4", 900, _H200),
    "L4": _bidirectional(*_PCIE4, _L4),
    "A10G": _bidirectional(*_PCIE4, _A10),
    "T4": _bidirectional("PCIe Gen3", 32, _T4),
    "RTX4090": _bidirectional(*_PCIE4, _4090),
}
# From each GPU to its host (CPU offload's copies).
TO_HOST: dict[str, Link] = {
    "A100-40GB": _bidirectional(*_PCIE4, _A100),
    "A100-80GB": _bidirectional(*_PCIE4, _A100),
    "H100-80GB": _bidirectional("PCIe Gen5", 128, _H100),
    "H200": _bidirectional("PCIe Gen5", 128, _H200),
    "L4": WITHIN_NODE["L4"],
    "A10G": WITHIN_NODE["A10G"],
    "T4": WITHIN_NODE["T4"],
    "RTX4090": WITHIN_NODE["RTX4090"],
}
_DGX_A100 = "NVIDIA DGX A100 data sheet: 8 x single-port ConnectX-6 200 Gb/s HDR InfiniBand for the compute fabric"
_DGX_H100 = "NVIDIA DGX H100/H200 data sheets: 8 x ConnectX-7 400 Gb/s NDR InfiniBand (4 x OSFP, 2 ports each)"
_AWS = "AWS EC2 accelerated-computing instance pages: g6.48xlarge (8 x L4), g5.48xlarge (8 x A10G), g4dn.metal " \
       "(8 x T4): 100 Gb/s network"  # fmt: skip
# A node's network to the other nodes, as the usual node of that card has it.
BETWEEN_NODES: dict[str, Link] = {
    "A100-40GB": _network("HDR InfiniBand", 8, 200, _DGX_A100),
    "A100-80GB": _network("HDR InfiniBand", 8, 200, _DGX_A100),
    "H100-80GB": _network("NDR InfiniBand", 8, 400, _DGX_H100),
    "H200": _network("NDR InfiniBand", 8, 400, _DGX_H100),
    "L4": _network("Ethernet", 1, 100, _AWS),
    "A10G": _network("Ethernet", 1, 100, _AWS),
    "T4": _network("Ethernet", 1, 100, _AWS),
    "RTX4090": _network("Ethernet", 1, 25, "assumed: a workstation's 25 GbE port (no vendor node exists)"),
}
# What share of a link's one-way rate NCCL's ring collectives reach (their bus bandwidth). An assumption, not
# measured here: nccl-tests' bus bandwidth is the figure to measure it by on a real node.
COLLECTIVE_EFFICIENCY = 0.8
# Host-side AdamW for CPU offload, parameters updated per second per worker: an assumption (torch's AdamW on a few
# host cores), unmeasured; it matters only where many weights train (full fine-tuning), not for LoRA.
HOST_OPTIMIZER_PARAMS_PER_S = 2e8


def links_for(card: str) -> tuple[Link, Link, Link]:
    """Within a node, to the host, between nodes, for a card profile's name."""
    return WITHIN_NODE[card], TO_HOST[card], BETWEEN_NODES[card]
