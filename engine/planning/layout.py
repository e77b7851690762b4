"""The Layout: every allocation the engine will make, per device (DESIGN.md "The one rule").

`engine.planning.price.price` writes it; the loader executes it and decides nothing. The engine
allocates each device's arenas in the order listed, one allocation per Arena.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, overload

from engine.hardware.devices import DeviceSpec
from engine.planning.host import HOST_PURPOSES, HostLayout
from engine.planning.plan import Plan
from engine.planning.rules import Verdict, worst_verdict

# allocated by the engine on the device (a stage's host arenas, engine.planning.host.HOST_PURPOSES,
# come after these, in pinned host memory)
PURPOSES = ("weights", "globals", "kv", "buffers", "expert_cache", "dequant_cache")
# the bill's terms (bytes requested): the routed experts are allocated in the weights arena
# (spans of purpose "weights") and billed beside the dense weights
TERMS = ("weights", "experts", "globals", "kv", "buffers", "expert_cache", "dequant_cache")


@dataclass(frozen=True, slots=True)
class Span:
    name: str  # GGUF tensor name, "kv.{layer}.k|v", "buf.<name>", "dq.<tensor name>"
    purpose: str
    offset: int  # bytes from the start of its arena
    nbytes: int
    dtype: str  # "f16" | "bf16" | "f32" | "uint8" | GGUF type name for raw weights ("Q4_K")
    shape: tuple[int, ...]

    def to_json(self) -> list[Any]:
        return [self.name, self.purpose, self.offset, self.nbytes, self.dtype, list(self.shape)]

    @classmethod
    def from_json(cls, d: list[Any]) -> Span:
        return cls(d[0], d[1], d[2], d[3], d[4], tuple(d[5]))


@dataclass(frozen=True, slots=True)
class Arena:
    name: str
    purpose: str
    nbytes: int  # the size of the one allocation
    spans: tuple[Span, ...]

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "purpose": self.purpose,
            "nbytes": self.nbytes,
            "spans": [s.to_json() for s in self.spans],
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Arena:
        return cls(
            d["name"], d["purpose"], d["nbytes"], tuple(Span.from_json(s) for s in d["spans"])
        )


class LazyArenas(Sequence[Arena]):
    """A device's arenas, built on first use. Pricing a drag needs only the byte counts, which
    come from prefix sums; the thousands of Span objects are built when something reads them
    (the loader, --json, a test) — and then they are exactly what the counts were made of."""

    __slots__ = ("_build", "_items")

    def __init__(self, build: Callable[[], Sequence[Arena]]) -> None:
        self._build: Callable[[], Sequence[Arena]] | None = build
        self._items: tuple[Arena, ...] | None = None

    def _get(self) -> tuple[Arena, ...]:
        if self._items is None:
            assert self._build is not None
            self._items = tuple(self._build())
            self._build = None
        return self._items

    @overload
    def __getitem__(self, i: int) -> Arena: ...
    @overload
    def __getitem__(self, i: slice) -> tuple[Arena, ...]: ...
    def __getitem__(self, i: int | slice) -> Arena | tuple[Arena, ...]:
        return self._get()[i]

    def __len__(self) -> int:
        return len(self._get())

    def __iter__(self) -> Iterator[Arena]:
        return iter(self._get())

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Sequence) and tuple(self) == tuple(other)

    def __hash__(self) -> int:
        return hash(self._get())

    def __repr__(self) -> str:
        return f"LazyArenas({len(self)} arenas)" if self._items is None else repr(self._items)


@dataclass(frozen=True)
class DeviceLayout:
    device: DeviceSpec
    layers: tuple[int, int]  # [lo, hi)
    first: bool
    last: bool
    arenas: Sequence[Arena]  # a tuple, or LazyArenas (built on first read)
    terms: dict[str, int]  # purpose -> bytes requested, plus "overhead" and "rounding"
    allocated: int  # what the engine allocates: the arenas as the allocator rounds them
    total: int  # allocated + overhead
    headroom: int  # free - reserve - total
    verdict: Verdict
    advice: str = ""
    overhead_source: str = ""  # "default" or the calibration record it came from
    # bytes the stage pins in host memory (its host arenas; terms "host_experts" and
    # "host_buffers"), outside `allocated`
    host: int = 0

    @property
    def device_arenas(self) -> list[Arena]:
        """The arenas allocated on the device itself, in order (not the pinned host ones)."""
        return [a for a in self.arenas if a.purpose not in HOST_PURPOSES]

    @property
    def host_arenas(self) -> list[Arena]:
        return [a for a in self.arenas if a.purpose in HOST_PURPOSES]

    def span(self, name: str) -> tuple[Arena, Span]:
        for a in self.arenas:
            for s in a.spans:
                if s.name == name:
                    return a, s
        raise KeyError(name)

    def to_json(self) -> dict[str, Any]:
        return {
            "device": self.device.to_json(),
            "layers": list(self.layers),
            "first": self.first,
            "last": self.last,
            "arenas": [a.to_json() for a in self.arenas],
            "terms": self.terms,
            "allocated": self.allocated,
            "total": self.total,
            "headroom": self.headroom,
            "verdict": self.verdict,
            "advice": self.advice,
            "overhead_source": self.overhead_source,
            "host": self.host,
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> DeviceLayout:
        return cls(
            DeviceSpec.from_json(d["device"]),
            tuple(d["layers"]),
            d["first"],
            d["last"],
            tuple(Arena.from_json(a) for a in d["arenas"]),
            dict(d["terms"]),
            d["allocated"],
            d["total"],
            d["headroom"],
            Verdict(d["verdict"]),
            d.get("advice", ""),
            d.get("overhead_source", ""),
            d.get("host", 0),
        )


@dataclass(frozen=True)
class Layout:
    plan: Plan
    devices: tuple[DeviceLayout, ...]
    # layers the file declares but the model does not run (GLM's next-token prediction):
    # neither priced nor loaded
    skipped_layers: int = 0
    skipped_bytes: int = 0
    host: HostLayout | None = None  # pinned host memory, when a stage keeps experts there

    def skipped_line(self) -> str:
        """The bill's line for what the file holds and no device gets, or ""."""
        n = self.skipped_layers
        if not n:
            return ""
        layers = "layer" if n == 1 else "layers"
        return f"skipped: {n} next-token-prediction {layers}, {human(self.skipped_bytes)}"

    @property
    def fits(self) -> bool:
        return self.verdict.runs

    @property
    def verdict(self) -> Verdict:
        host = [self.host.verdict] if self.host is not None else []
        worst = worst_verdict([*(d.verdict for d in self.devices), *host])
        assert worst is not None, "a Layout has at least one device"
        return worst

    def bottleneck(self) -> str:
        """One sentence naming what keeps the plan from fitting (VRAM of a device, host RAM),
        or "" when it fits."""
        if self.verdict.runs:
            return ""
        over = [d for d in self.devices if d.verdict == Verdict.DOES_NOT_FIT]
        parts = [f"VRAM of {d.device.label} (over by {human(-d.headroom)})" for d in over]
        if self.host is not None and self.host.verdict == Verdict.DOES_NOT_FIT:
            parts.append(f"host RAM (over by {human(-self.host.headroom)})")
        if not parts:
            return ""
        return "does not fit: the bottleneck is " + " and ".join(parts)

    def to_json(self) -> dict[str, Any]:
        return {
            "plan": self.plan.to_json(),
            "devices": [d.to_json() for d in self.devices],
            "verdict": self.verdict,
            "skipped": {"layers": self.skipped_layers, "bytes": self.skipped_bytes},
            "host": None if self.host is None else self.host.to_json(),
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Layout:
        skipped = d.get("skipped", {})
        return cls(
            Plan.from_json(d["plan"]),
            tuple(DeviceLayout.from_json(x) for x in d["devices"]),
            skipped.get("layers", 0),
            skipped.get("bytes", 0),
            HostLayout.from_json(d["host"]) if d.get("host") else None,
        )


def human(n: int) -> str:
    """Bytes for people: "23.99 GiB", "612.0 MiB", "4.0 KiB" (binary units, as NVML reports)."""
    sign, n = ("-" if n < 0 else ""), abs(n)
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return (
                f"{sign}{n / size:.2f} {unit}" if unit == "GiB" else f"{sign}{n / size:.1f} {unit}"
            )
    return f"{sign}{n} B"
