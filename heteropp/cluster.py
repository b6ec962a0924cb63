"""Chip types, links and a cluster description (``cluster.yaml``).

A cluster names chip types; each has a count, memory, chips per node, a TP limit, its
intra-node (TP collective) and HBM bandwidth, its affinity-NIC bandwidth, and either
measured per-TP-size layer timings or a spec to derive them (sustained TFLOPS, or a measured
homogeneous throughput to calibrate against). ``links`` gives the bandwidth and latency
between nodes of one cluster and between clusters (each chip type sits in its own cluster).

Units in YAML: memory in GB (1e9 bytes), bandwidth in GB/s, latency in microseconds, times
in milliseconds. Inside the code everything is bytes, bytes/s and seconds.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from diutil.datasheets.links import GB, FleetLinks, LinkSpec

# Measured extras of the pipeline's ends per micro-batch (ms): the embedding on the first stage,
# the final norm, head and loss on the last. Optional in layer_times_ms; `ditorch profile` writes them.
END_TIME_KEYS = ("embed_fwd", "embed_bwd", "head_fwd", "head_bwd")
# What a stage does once whatever its layers (ms): its forward's work outside the layers and the
# ends, per micro-batch (the position tables it computes for all its layers), and its update's
# fixed part, per step (launches, the norm's synchronisation). Optional; `ditorch profile` writes them.
STAGE_TIME_KEYS = ("stage_fwd", "stage_update")
# A layer's and a stage's update under ZeRO-1 (what a stage at DP > 1 runs), with the whole
# buffer as the slice: the per-layer part shrinks with DP. Optional; `ditorch profile` writes them.
ZERO1_UPDATE_KEYS = ("zero1_update", "zero1_stage_update")
# What layer_times_ms[tp] may hold (fwd and bwd are required).
MEASURED_TIME_KEYS = ("fwd", "bwd", "recompute", "update", *STAGE_TIME_KEYS, *ZERO1_UPDATE_KEYS, *END_TIME_KEYS)


@dataclasses.dataclass(frozen=True)
class Calibration:
    """A measured homogeneous run the chip's sustained speed is derived from (Table 6)."""

    tgs: float  # tokens per chip per second
    pp: int
    dp: int
    tp: int
    recompute: bool
    gbs_tokens: int


@dataclasses.dataclass(frozen=True)
class ChipSpec:
    """One chip type of the cluster."""

    name: str
    count: int
    memory: float  # bytes per chip
    chips_per_node: int
    tp_max: int
    intra_node_bandwidth: float  # bytes/s per chip for TP collectives
    hbm_bandwidth: float  # bytes/s
    nic_bandwidth: float  # bytes/s of the chip's affinity NIC
    usable_memory_fraction: float = 0.9
    effective_tflops: float | None = None
    calibration: Calibration | None = None
    measured_ms: dict | None = None  # {tp: {key: ms for key in MEASURED_TIME_KEYS}}
    peak_tflops: float | None = None  # nominal, for reporting MFU only
    activation_mb: dict | None = None  # measured {tp: MiB one micro-batch leaves per layer}
    # The emulation time scale the layer times were measured under (`ditorch profile --time-scale`);
    # runs of a plan use it too. None: not an emulated measurement.
    emulated_time_scale: float | None = None
    # What `ditorch profile` measured the layer times as (its PROFILER_VERSION), so a cache of
    # profiles can tell one from an older measurement. None: not written by the profiler.
    profiler_version: int | None = None
    # A chip profile (a catalog part such as H100, or H2's A-D) whose datasheet gives the layer
    # times by the roofline (heteropp/roofline.py), with no profiling.
    datasheet: str | None = None
    # Where the figures come from: "datasheet: ..." or "measured: ..." (`ditorch profile` writes it).
    source: str | None = None

    def __post_init__(self) -> None:
        def positive(field: str, value: Any, integer: bool = False) -> None:
            ok = isinstance(value, int) if integer else isinstance(value, (int, float))
            if not ok or isinstance(value, bool) or value <= 0:
                kind = "a positive integer" if integer else "a positive number"
                raise ValueError(f"chip {self.name!r}: {field} must be {kind}, got {value!r}")

        positive("count", self.count, integer=True)
        positive("memory", self.memory)
        positive("chips_per_node", self.chips_per_node, integer=True)
        positive("tp_max", self.tp_max, integer=True)
        if self.tp_max & (self.tp_max - 1):
            raise ValueError(f"chip {self.name!r}: tp_max must be a power of two, got {self.tp_max}")
        for f in ("intra_node_bandwidth", "hbm_bandwidth", "nic_bandwidth"):
            positive(f, getattr(self, f))
        if not 0 < self.usable_memory_fraction <= 1:
            raise ValueError(
                f"chip {self.name!r}: usable_memory_fraction must be in (0, 1], got {self.usable_memory_fraction!r}"
            )
        sources = [s for s in ("effective_tflops", "calibration", "measured_ms", "datasheet")
                   if getattr(self, s) is not None]
        if len(sources) != 1:
            raise ValueError(
                f"chip {self.name!r}: give exactly one of effective_tflops, calibrate, layer_times_ms, datasheet "
                f"(got {sources or 'none'})"
            )

    @property
    def usable_memory(self) -> float:
        return self.memory * self.usable_memory_fraction

    def tp_sizes(self) -> list[int]:
        """Allowed TP sizes: powers of two up to TP_MAX (and no wider than a node)."""
        limit = min(self.tp_max, self.chips_per_node)
        return [1 << k for k in range(limit.bit_length()) if (1 << k) <= limit]

    def activation_per_layer(self, tp: int) -> float | None:
        """Measured bytes one micro-batch leaves per layer at ``tp`` (None: use the formula)."""
        if self.activation_mb is None or tp not in self.activation_mb:
            return None
        return self.activation_mb[tp] * 2**20

    def with_count(self, count: int) -> "ChipSpec":
        return dataclasses.replace(self, count=count)

    def to_dict(self) -> dict:
        """The YAML form (GB, GB/s, ms) that ``from_dict`` reads back."""
        d = {
            "count": self.count, "memory_gb": round(self.memory / GB, 9), "chips_per_node": self.chips_per_node,
            "tp_max": self.tp_max, "intra_node_gbps": round(self.intra_node_bandwidth / GB, 9),
            "hbm_gbps": round(self.hbm_bandwidth / GB, 9), "nic_gbps": round(self.nic_bandwidth / GB, 9),
            "usable_memory_fraction": self.usable_memory_fraction,
        }
        if self.effective_tflops is not None:
            d["effective_tflops"] = self.effective_tflops
        if self.calibration is not None:
            d["calibrate"] = dataclasses.asdict(self.calibration)
        if self.measured_ms is not None:
            d["layer_times_ms"] = {tp: dict(t) for tp, t in self.measured_ms.items()}
        if self.peak_tflops is not None:
            d["peak_tflops"] = self.peak_tflops
        if self.activation_mb is not None:
            d["activation_mb"] = dict(self.activation_mb)
        if self.emulated_time_scale is not None:
            d["emulated_time_scale"] = self.emulated_time_scale
        if self.profiler_version is not None:
            d["profiler_version"] = self.profiler_version
        if self.datasheet is not None:
            d["datasheet"] = self.datasheet
        if self.source is not None:
            d["source"] = self.source
        return d

    @classmethod
    def from_dict(cls, name: str, d: dict) -> "ChipSpec":
        where = f"chip {name!r}"
        _check_keys(
            d,
            {
                "count", "memory_gb", "chips_per_node", "tp_max", "intra_node_gbps", "hbm_gbps", "nic_gbps",
                "usable_memory_fraction", "effective_tflops", "calibrate", "layer_times_ms", "peak_tflops",
                "activation_mb", "emulated_time_scale", "profiler_version", "datasheet", "source",
            },
            {"count"} if "datasheet" in d else
            {"count", "memory_gb", "chips_per_node", "intra_node_gbps", "hbm_gbps", "nic_gbps"},
            where,
        )
        if "datasheet" in d:
            d = {**datasheet_defaults(d["datasheet"], where), **d}
        calibration = None
        if "calibrate" in d:
            c = d["calibrate"]
            _check_keys(c, {"tgs", "pp", "dp", "tp", "recompute", "gbs_tokens"},
                        {"tgs", "pp", "dp", "tp", "gbs_tokens"}, f"{where} calibrate")
            calibration = Calibration(
                tgs=float(c["tgs"]), pp=int(c["pp"]), dp=int(c["dp"]), tp=int(c["tp"]),
                recompute=bool(c.get("recompute", False)), gbs_tokens=parse_tokens(c["gbs_tokens"]),
            )
        measured = None
        if "layer_times_ms" in d:
            measured = {}
            for tp, times in d["layer_times_ms"].items():
                _check_keys(times, set(MEASURED_TIME_KEYS), {"fwd", "bwd"},
                            f"{where} layer_times_ms[{tp}]")
                measured[int(tp)] = {k: float(v) for k, v in times.items()}
        return cls(
            name=name,
            count=d["count"],
            memory=float(d["memory_gb"]) * GB,
            chips_per_node=d["chips_per_node"],
            tp_max=d.get("tp_max", d["chips_per_node"]),
            intra_node_bandwidth=float(d["intra_node_gbps"]) * GB,
            hbm_bandwidth=float(d["hbm_gbps"]) * GB,
            nic_bandwidth=float(d["nic_gbps"]) * GB,
            usable_memory_fraction=float(d.get("usable_memory_fraction", 0.9)),
            effective_tflops=None if "effective_tflops" not in d else float(d["effective_tflops"]),
            calibration=calibration,
            measured_ms=measured,
            peak_tflops=None if "peak_tflops" not in d else float(d["peak_tflops"]),
            activation_mb=None if "activation_mb" not in d else _activation_mb(d["activation_mb"], where),
            emulated_time_scale=None if "emulated_time_scale" not in d else _time_scale(d["emulated_time_scale"], where),
            profiler_version=None if "profiler_version" not in d else _profiler_version(d["profiler_version"], where),
            datasheet=None if "datasheet" not in d else str(d["datasheet"]),
            source=None if "source" not in d else str(d["source"]),
        )


def datasheet_defaults(part: Any, where: str) -> dict:
    """A chip entry's figures from the chip profile ``part`` names (the catalog, H2's A-D or
    $DITORCH_PROFILE_FILE): what the entry does not state itself."""
    from diutil.datasheets.chips import known_profiles

    profiles = known_profiles()
    if not isinstance(part, str) or part not in profiles:
        raise ValueError(f"{where}: datasheet {part!r} is not a known chip; known: {', '.join(sorted(profiles))}")
    p = profiles[part]
    sheet = p.datasheet
    return {
        "memory_gb": p.memory_gb * (1 << 30) / GB,
        "chips_per_node": p.chips_per_node,
        "intra_node_gbps": p.intra_node_gbps or _A100_INTRA_NODE_GBPS * p.relative_speed,
        "hbm_gbps": sheet.memory_bytes_per_s / GB,
        "nic_gbps": p.nic_gbps or _A100_NIC_GBPS,
        "peak_tflops": sheet.peak("bf16") / 1e12,
        "source": f"datasheet: {p.source or p.description or part}",
    }


# Links of a part whose profile does not state them (H2's A-D): the A100's (docs/device.md).
_A100_INTRA_NODE_GBPS = 300.0
_A100_NIC_GBPS = 25.0


def _profiler_version(value: Any, where: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{where}: profiler_version must be a positive integer, got {value!r}")
    return value


@dataclasses.dataclass(frozen=True)
class ClusterSpec:
    """Chip types (in the order given) and the links between nodes and between clusters."""

    chips: tuple[ChipSpec, ...]
    inter_node: LinkSpec
    inter_cluster: LinkSpec
    name: str = "cluster"

    def __post_init__(self) -> None:
        if not self.chips:
            raise ValueError("cluster: no chip types given")
        names = [c.name for c in self.chips]
        if len(set(names)) != len(names):
            raise ValueError(f"cluster: duplicate chip type names in {names}")
        scales = {c.name: c.emulated_time_scale for c in self.chips if c.emulated_time_scale is not None}
        if len(set(scales.values())) > 1:
            raise ValueError(f"cluster: chips were profiled under different emulation time scales {scales}; "
                             f"their layer times do not compare: profile them all with the same --time-scale")
        sheets = sorted(c.name for c in self.chips if c.datasheet is not None)
        if scales and sheets and any(s != 1.0 for s in scales.values()):
            raise ValueError(f"cluster: chips {sorted(scales)} were measured on emulated chips run at time scale "
                             f"{next(iter(scales.values())):g}, chips {sheets} are datasheets (the chips' own time); "
                             f"a run of the plan would run the first that many times slower: plan them apart, or "
                             f"profile every chip type")

    @property
    def emulated_time_scale(self) -> float | None:
        """The time scale its chips were profiled under (None: no emulated measurement)."""
        return next((c.emulated_time_scale for c in self.chips if c.emulated_time_scale is not None), None)

    def chip(self, name: str) -> ChipSpec:
        for c in self.chips:
            if c.name == name:
                return c
        raise KeyError(f"unknown chip type {name!r}; this cluster has {[c.name for c in self.chips]}")

    @property
    def total_chips(self) -> int:
        return sum(c.count for c in self.chips)

    def link_between(self, a: str, b: str) -> LinkSpec:
        """Stages of one chip type talk over the node network, others cross clusters."""
        return self.inter_node if a == b else self.inter_cluster

    def link_shared(self, a: str, b: str) -> bool:
        """Whether stages on chip types ``a`` and ``b`` talk over the one cross-cluster link
        that every DP replica shares (per direction), rather than each replica's own NICs."""
        return a != b

    @property
    def fleet_links(self) -> FleetLinks:
        """The links as the shared link model has them (diutil/datasheets/links.py): each chip
        type is a DC of its own, its nodes joined by ``inter_node``, the DCs by ``inter_cluster``."""
        return FleetLinks({"inter_node": self.inter_node, "inter_cluster": self.inter_cluster},
                          dcs=frozenset(c.name for c in self.chips))

    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "chips": {c.name: c.to_dict() for c in self.chips},
            "links": {"inter_node": self.inter_node.to_dict(), "inter_cluster": self.inter_cluster.to_dict()},
        }

    @classmethod
    def from_dict(cls, d: dict, where: str = "cluster") -> "ClusterSpec":
        _check_keys(d, {"name", "chips", "links"}, {"chips", "links"}, where)
        chips, links = d["chips"], d["links"]
        if not isinstance(chips, dict):
            raise ValueError(f"{where}: 'chips' must map chip type names to their specs")
        _check_keys(links, {"inter_node", "inter_cluster"}, {"inter_node", "inter_cluster"}, f"{where} links")
        return cls(
            chips=tuple(ChipSpec.from_dict(str(n), c) for n, c in chips.items()),
            inter_node=LinkSpec.from_dict(links["inter_node"], f"{where} links.inter_node"),
            inter_cluster=LinkSpec.from_dict(links["inter_cluster"], f"{where} links.inter_cluster"),
            name=str(d.get("name", "cluster")),
        )

    @classmethod
    def from_yaml(cls, path: str | Path) -> "ClusterSpec":
        import yaml

        path = Path(path)
        with open(path) as f:
            d = yaml.safe_load(f)
        if not isinstance(d, dict):
            raise ValueError(f"{path}: expected a mapping with 'chips' and 'links'")
        _refuse_emulated_profile_file(d, path)
        if "parts" in d:
            d = _fleet_of_parts(d, path)
        # a cluster may take its chip types from library files (one, or a list: e.g. one file
        # per chip written by `ditorch profile`) and only set counts
        if "chip_library" in d:
            files = d["chip_library"] if isinstance(d["chip_library"], list) else [d["chip_library"]]
            lib_chips: dict = {}
            lib_links = None
            for name in files:
                with open(path.parent / name) as f:
                    library = yaml.safe_load(f) or {}
                _refuse_emulated_profile_file(library, path.parent / name)
                if not isinstance(library, dict) or not isinstance(library.get("chips"), dict):
                    raise ValueError(f"{path}: chip library {name} has no 'chips' mapping")
                lib_chips.update(library["chips"])
                lib_links = lib_links or library.get("links")
            counts = d.get("counts") or {}
            if not isinstance(counts, dict) or not counts:
                raise ValueError(f"{path}: 'chip_library' needs 'counts' mapping chip type -> number of chips")
            unknown = sorted(set(counts) - set(lib_chips))
            if unknown:
                raise ValueError(f"{path}: counts name unknown chip type(s) {unknown}; library has {sorted(lib_chips)}")
            d = {
                "name": d.get("name", path.stem),
                "chips": {n: dict(lib_chips[n], count=counts[n]) for n in counts},
                "links": d.get("links", lib_links),
            }
        d.setdefault("name", path.stem)
        return cls.from_dict(d, where=str(path))


def _fleet_of_parts(d: dict, path: Path) -> dict:
    """``{parts: {H100: 16, MI300X: 8}, links: ...}``: a fleet named by chip profiles (catalog
    parts) and counts, planned from their datasheets. Links, when not given, are each part's
    NIC bandwidth (the slowest of the fleet) at 5 us inside a cluster and 20 us between."""
    _check_keys(d, {"name", "parts", "links", "tp_max"}, {"parts"}, str(path))
    parts = d["parts"]
    if not isinstance(parts, dict) or not parts:
        raise ValueError(f"{path}: 'parts' must map chip profile names (e.g. H100) to chip counts")
    tp_max = d.get("tp_max")
    chips = {}
    for name, count in parts.items():
        if not isinstance(count, int) or isinstance(count, bool) or count < 1:
            raise ValueError(f"{path}: parts[{name!r}] must be a positive number of chips, got {count!r}")
        chips[str(name)] = {"datasheet": str(name), "count": count, **({"tp_max": tp_max} if tp_max else {})}
    links = d.get("links")
    if links is None:
        nic = min(datasheet_defaults(str(n), str(path))["nic_gbps"] for n in parts)
        links = {"inter_node": {"bandwidth_gbps": nic, "latency_us": 5},
                 "inter_cluster": {"bandwidth_gbps": nic, "latency_us": 20}}
    return {"name": d.get("name", path.stem), "chips": chips, "links": links}


def _refuse_emulated_profile_file(d: Any, path: Path) -> None:
    if isinstance(d, dict) and "emulated_chips" in d and "chips" not in d:
        raise ValueError(f"{path}: this is an emulated chip profile file (top-level 'emulated_chips', read through "
                         f"DITORCH_PROFILE_FILE), not a cluster or chip library; those hold a top-level 'chips' "
                         f"mapping (see docs/heteropp.md)")


def _activation_mb(d: Any, where: str) -> dict[int, float]:
    if not isinstance(d, dict) or not d:
        raise ValueError(f"{where}: activation_mb must map TP sizes to MiB per layer and micro-batch, got {d!r}")
    out = {}
    for tp, mb in d.items():
        if not isinstance(mb, (int, float)) or isinstance(mb, bool) or mb < 0:
            raise ValueError(f"{where}: activation_mb[{tp}] must be a number >= 0, got {mb!r}")
        out[int(tp)] = float(mb)
    return out


def parse_tokens(value: Any) -> int:
    """'2M' -> 2 * 2**20 tokens (binary multipliers, so 2M / 4096 = 512 sequences)."""
    if isinstance(value, bool):
        raise ValueError(f"expected a token count like 2097152 or '2M', got {value!r}")
    if isinstance(value, int):
        n = value
    else:
        text = str(value).strip().upper()
        mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        digits = text[:-1] if text[-1:] in "KMG" else text
        try:
            n = int(float(digits) * mult)
        except ValueError:
            raise ValueError(f"expected a token count like 2097152 or '2M', got {value!r}") from None
    if n <= 0:
        raise ValueError(f"token count must be positive, got {value!r}")
    return n


def _time_scale(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 1 <= value < float("inf"):
        raise ValueError(f"{where}: emulated_time_scale must be a number >= 1, got {value!r}")
    return float(value)


def _check_keys(d: Any, allowed: set, required: set, where: str) -> None:
    if not isinstance(d, dict):
        raise ValueError(f"{where}: expected a mapping, got {type(d).__name__}")
    unknown = sorted(set(d) - allowed)
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {unknown}; expected some of {sorted(allowed)}")
    missing = sorted(required - set(d))
    if missing:
        raise ValueError(f"{where}: missing key(s) {missing}")
