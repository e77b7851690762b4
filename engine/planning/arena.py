"""How spans become allocations, and what each allocation really costs, per arena mode.

- `packed`: one arena per device and purpose; spans laid end to end, each starting on a
  256-byte boundary. The only waste is that alignment padding.
- `per-tensor`: one allocation per span, through torch's CUDA caching allocator.
- `chunked:N`: spans placed first-fit into N-MiB chunks; a span larger than N MiB gets a chunk
  of its own, exactly its (aligned) size.

On a GPU every arena is then one `torch.empty` through the caching allocator, so what the
device really gives up is the allocator's segments: `CachingAllocatorModel` replays torch's
rules (c10/cuda/CUDACachingAllocator.cpp, default settings: no expandable segments, no
max_split_size) over the arenas in Layout order, which is the order the engine allocates them.
On the CPU an arena costs exactly its size.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Sequence

from engine.planning.layout import Arena, Span
from engine.planning.rules import ArenaKind, ArenaMode

ALIGN = 256

# torch caching allocator constants (CUDACachingAllocator.cpp); DESIGN.md measured them on an H200.
MIN_BLOCK = 512  # every block is a multiple of this
SMALL_SIZE = 1 << 20  # requests <= 1 MiB come from the small pool
SMALL_BUFFER = 2 << 20  # small pool segments are 2 MiB
MIN_LARGE_ALLOC = 10 << 20  # requests in (1 MiB, 10 MiB) get a 20 MiB segment
LARGE_BUFFER = 20 << 20
ROUND_LARGE = 2 << 20  # requests >= 10 MiB: segment rounded up to 2 MiB

# (name, nbytes, dtype, shape): a span before it has an offset
Request = tuple[str, int, str, tuple[int, ...]]


def align_up(n: int, a: int = ALIGN) -> int:
    return -(-n // a) * a


def packed(name: str, purpose: str, requests: Iterable[Request]) -> Arena | None:
    """All requests in one arena, each span on a 256-byte boundary; None when empty."""
    spans = []
    off = 0
    for rname, nbytes, dtype, shape in requests:
        spans.append(Span(rname, purpose, off, nbytes, dtype, shape))
        off += -(-nbytes // ALIGN) * ALIGN
    return Arena(name, purpose, off, tuple(spans)) if spans else None


def per_tensor(purpose: str, requests: Iterable[Request]) -> list[Arena]:
    """One arena (= one allocation) per request, named after it."""
    return [
        Arena(rname, purpose, nbytes, (Span(rname, purpose, 0, nbytes, dtype, shape),))
        for rname, nbytes, dtype, shape in requests
    ]


def first_fit(sizes: Iterable[int], chunk: int) -> tuple[list[tuple[int, int]], list[int]]:
    """Place sizes first-fit into `chunk`-byte chunks: ((chunk no, offset) per size, chunk sizes).
    A size above `chunk` gets a chunk of its own, exactly its aligned size."""
    where: list[tuple[int, int]] = []
    used: list[int] = []
    sizes_out: list[int] = []
    open_: list[int] = []  # chunks that can still take the smallest span (ALIGN bytes)
    for nbytes in sizes:
        size = align_up(max(nbytes, 1))
        if size > chunk:
            where.append((len(used), 0))
            used.append(size)
            sizes_out.append(size)
            continue
        for pos, k in enumerate(open_):
            if sizes_out[k] - used[k] >= size:
                break
        else:
            k = len(used)
            used.append(0)
            sizes_out.append(chunk)
            open_.append(k)
            pos = len(open_) - 1
        where.append((k, used[k]))
        used[k] += size
        if sizes_out[k] - used[k] < ALIGN:
            del open_[pos]
    return where, sizes_out


def chunked(name: str, purpose: str, requests: Sequence[Request], chunk: int) -> list[Arena]:
    """First-fit into `chunk`-byte arenas, in request order; oversize spans get their own."""
    where, sizes = first_fit((r[1] for r in requests), chunk)
    spans: list[list[Span]] = [[] for _ in sizes]
    for (k, off), (rname, nbytes, dtype, shape) in zip(where, requests, strict=True):
        spans[k].append(Span(rname, purpose, off, nbytes, dtype, shape))
    return [Arena(f"{name}.{k}", purpose, sizes[k], tuple(s)) for k, s in enumerate(spans)]


def allocation_sizes(mode: ArenaMode, sizes: Sequence[int]) -> list[int]:
    """The allocations `arrange` makes for requests of these sizes (no spans built)."""
    if not sizes:
        return []
    if mode.kind == ArenaKind.PACKED:
        return [sum(-(-n // ALIGN) * ALIGN for n in sizes)]
    if mode.kind == ArenaKind.PER_TENSOR:
        return list(sizes)
    return first_fit(sizes, mode.chunk)[1]


def arrange(mode: ArenaMode, name: str, purpose: str, requests: Sequence[Request]) -> list[Arena]:
    if mode.kind == ArenaKind.PACKED:
        a = packed(name, purpose, requests)
        return [a] if a is not None else []
    if mode.kind == ArenaKind.PER_TENSOR:
        return per_tensor(purpose, requests)
    return chunked(name, purpose, requests, mode.chunk)


def round_block(size: int) -> int:
    """torch `round_size`: blocks are multiples of 512 bytes, at least 512."""
    return MIN_BLOCK if size < MIN_BLOCK else -(-size // MIN_BLOCK) * MIN_BLOCK


def segment_size(size: int) -> int:
    """torch `get_allocation_size`: the cudaMalloc a fresh request of `size` bytes triggers."""
    if size <= SMALL_SIZE:
        return SMALL_BUFFER
    if size < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return -(-size // ROUND_LARGE) * ROUND_LARGE


class CachingAllocatorModel:
    """Replays torch's caching allocator for a sequence of allocations that are never freed.

    Two pools (small: blocks <= 1 MiB; large: the rest). A request takes the best-fitting free
    block of its pool (smallest size, then lowest address) or a new segment; the block is split
    when the remainder is >= 512 B (small pool) or > 1 MiB (large pool), otherwise the whole
    block is handed out. `reserved` is the sum of segments, what `torch.cuda.memory_reserved`
    and NVML `used` show.
    """

    def __init__(self) -> None:
        self.reserved = 0
        self.allocated = 0  # sum of handed-out blocks (torch `memory_allocated`)
        self._free: dict[bool, list[tuple[int, int]]] = {True: [], False: []}  # (size, addr)
        self._addr = 0

    def malloc(self, nbytes: int) -> int:
        """Allocate; returns the block size handed out."""
        if nbytes == 0:  # torch hands out a null pointer for empty tensors
            return 0
        size = round_block(nbytes)
        small = size <= SMALL_SIZE
        free = self._free[small]
        i = bisect.bisect_left(free, (size, -1))
        if i < len(free):
            bsize, addr = free.pop(i)
        else:
            bsize = segment_size(size)
            addr = self._addr
            self._addr += bsize
            self.reserved += bsize
        remaining = bsize - size
        if remaining >= MIN_BLOCK if small else remaining > SMALL_SIZE:
            bisect.insort(free, (remaining, addr + size))
            bsize = size
        self.allocated += bsize
        return bsize


def reserved_bytes(sizes: Iterable[int], on_gpu: bool) -> int:
    """What a device gives up for allocations of these sizes, made in this order."""
    if not on_gpu:
        return sum(sizes)
    model = CachingAllocatorModel()
    for n in sizes:
        model.malloc(n)
    return model.reserved


def device_bytes(arenas: Sequence[Arena], on_gpu: bool) -> int:
    """What a device gives up for these arenas, allocated in this order."""
    return reserved_bytes((a.nbytes for a in arenas), on_gpu)
