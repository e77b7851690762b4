"""The planning vocabulary, defined once: KV cache types, arena modes, verdicts and the defaults
of a launch. The engine, both CLIs and the window import these; none restates them.

Each value is a `StrEnum`, so it is its own text in a Plan's JSON, on the command line and in a
combo box, and it compares equal to that text.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from spec.errors import CarveError

MIB = 1 << 20
DEFAULT_CTX = 4096  # tokens, clipped to what the model was trained for
MIN_CTX = 256  # the window's context step and floor
PREFILL_CHUNK = 512  # tokens per prefill step
CACHE_RESERVE = 1 << 30  # bytes kept free after everything; the dequant cache gets the rest


class KvType(StrEnum):
    """How the KV cache stores a cell: f16, or q8_0 (34-byte blocks of 32 values)."""

    F16 = "f16"
    Q8_0 = "q8_0"

    @classmethod
    def parse(cls, text: str) -> KvType:
        try:
            return cls(text)
        except ValueError:
            raise CarveError(
                f"--kv: unknown KV type {text!r}; use one of {', '.join(cls)}"
            ) from None


class ArenaKind(StrEnum):
    PACKED = "packed"  # one arena per device and purpose
    PER_TENSOR = "per-tensor"  # one allocation per span
    CHUNKED = "chunked"  # spans first-fit into N-MiB chunks


@dataclass(frozen=True, slots=True)
class ArenaMode:
    kind: ArenaKind
    chunk: int = 0  # bytes, chunked only

    @property
    def text(self) -> str:
        """The mode as a Plan and --arena write it: "packed", "per-tensor", "chunked:N"."""
        if self.kind is ArenaKind.CHUNKED:
            return f"chunked:{self.chunk // MIB}"
        return str(self.kind)


MAX_CHUNK_MIB = 1 << 20


def parse_arena(text: str) -> ArenaMode:
    """ "packed" | "per-tensor" | "chunked:N" (N MiB, 1..2**20) -> ArenaMode; CarveError naming
    --arena otherwise."""
    t = text.strip().lower()
    if t in (ArenaKind.PACKED, ArenaKind.PER_TENSOR):
        return ArenaMode(ArenaKind(t))
    if t.startswith("chunked:"):
        n = t.partition(":")[2]
        if n.isdigit() and 1 <= int(n) <= MAX_CHUNK_MIB:
            return ArenaMode(ArenaKind.CHUNKED, int(n) * MIB)
    raise CarveError(
        f"--arena: cannot read {text!r}; use packed, per-tensor or chunked:N (N MiB, e.g. chunked:1024)"
    )


# Headroom below this is "tight": a desktop, a second process or a CUDA graph pool can take that
# much; 5 % of an 80 GB card (4 GB) would call good plans tight.
TIGHT = 512 * MIB


class Verdict(StrEnum):
    """A device's verdict, best first; a plan's verdict is its worst device's. "does not run
    here": the runner lacks a kernel for a tensor type the device holds (planning/capability.py),
    which no change of memory terms fixes."""

    FITS = "fits"
    TIGHT = "tight"
    DOES_NOT_FIT = "does not fit"
    DOES_NOT_RUN = "does not run here"

    @classmethod
    def of(cls, headroom: int) -> Verdict:
        """The verdict for `headroom` bytes (free - reserve - total) on a device."""
        return cls.DOES_NOT_FIT if headroom < 0 else cls.TIGHT if headroom < TIGHT else cls.FITS

    @property
    def rank(self) -> int:
        return _RANK[self]

    @property
    def runs(self) -> bool:
        """Whether a launch can go ahead: fits or tight."""
        return self.rank < _RANK[Verdict.DOES_NOT_FIT]


_RANK = {v: i for i, v in enumerate(Verdict)}


def worst_verdict(verdicts: Iterable[str]) -> Verdict | None:
    """The worst of `verdicts` (a device's or a plan's), None when there are none."""
    return max((Verdict(v) for v in verdicts), key=lambda v: v.rank, default=None)


def default_ctx(n_ctx_train: int) -> int:
    """The context a launch gets when none is asked for: DEFAULT_CTX, at most the model's."""
    return min(DEFAULT_CTX, n_ctx_train or DEFAULT_CTX)


def act_dtype_for(devices: Sequence[Any]) -> str:
    """Activations run in f32 on the CPU and in bf16 on GPUs."""
    return "f32" if any(d.is_cpu for d in devices) else "bf16"
