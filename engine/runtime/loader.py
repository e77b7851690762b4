"""Executes a Layout: one allocation per arena, spans as views, weights copied from the file.

The loader decides nothing (DESIGN.md "The one rule"): sizes, offsets, dtypes and which
matrices get a dequant-cache copy all come from `engine.planning.price.price`. Every allocation goes
through an allocator that records (device, arena, bytes), so a test can hold what was allocated
equal to what was priced, byte for byte.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from carve_kernels.dequant import dequantize_to
from carve_kernels.scale_scan import first_bad_block
from engine.runtime.models.ops import QExperts, QWeight
from spec import quant_types as qt
from spec.errors import CarveError

Progress = Callable[[str, int, int, float], None]  # stage, done, total, bytes/s
COPY_CHUNK = 16 << 20  # bytes per copy step: bounds the time between cancellation checks

SPAN_DTYPES = {
    "f16": torch.float16,
    "bf16": torch.bfloat16,
    "f32": torch.float32,
    "i64": torch.int64,
    "i32": torch.int32,
    "uint8": torch.uint8,
}


@dataclass(frozen=True, slots=True)
class Allocation:
    device: str
    arena: str
    nbytes: int


class RecordingAllocator:
    """Allocates arenas as uint8 tensors and records each one; `free_all` drops them."""

    def __init__(self) -> None:
        self.records: list[Allocation] = []
        self._live: list[torch.Tensor] = []

    def alloc(self, device: torch.device, arena: str, nbytes: int) -> torch.Tensor:
        if device.type == "cuda" and not torch.cuda.is_available():
            # not a matter of memory: no advice about the context or the split can help
            why = ("this torch is a CPU-only build" if torch.version.cuda is None
                   else "torch finds no NVIDIA driver or GPU")
            raise CarveError(
                f"{device}: {why} (torch {torch.__version__}); plan for the CPU (--gpus cpu, "
                f"or \"This machine\" in the window when it has no GPU), or install the NVIDIA "
                f"driver and torch's CUDA build"
            )
        try:
            buf = torch.empty(nbytes, dtype=torch.uint8, device=device)
        except (RuntimeError, MemoryError) as exc:  # torch.OutOfMemoryError is a RuntimeError
            raise CarveError(
                f"{device}: could not allocate arena {arena} ({nbytes / 2**20:.1f} MiB): "
                f"{str(exc).splitlines()[0] if str(exc) else type(exc).__name__}; lower --ctx, "
                f"raise --cache-reserve or move layers to another device"
            ) from None
        self.records.append(Allocation(str(device), arena, nbytes))
        self._live.append(buf)
        return buf

    @property
    def live_bytes(self) -> int:
        return sum(b.numel() for b in self._live)

    def free_all(self) -> None:
        self._live.clear()


def torch_device(spec: Any) -> torch.device:
    """The torch device of a DeviceSpec (index -1 is the CPU)."""
    return torch.device("cpu") if spec.index < 0 else torch.device("cuda", spec.index)


@dataclass
class LoadedStage:
    """One device's share of the model, as views into its arenas."""

    device: torch.device
    layers: tuple[int, int]
    first: bool
    last: bool
    spans: dict[str, torch.Tensor] = field(default_factory=dict)  # span name -> typed view
    tensors: dict[str, Any] = field(default_factory=dict)  # GGUF name -> QWeight | float tensor


def span_view(buf: torch.Tensor, span: Any) -> torch.Tensor:
    """The span's bytes in ``buf``, typed as priced (raw GGUF weights stay uint8)."""
    raw = buf[span.offset : span.offset + span.nbytes]
    dt = SPAN_DTYPES.get(span.dtype)
    if dt is None or dt == torch.uint8:
        return raw
    return raw.view(dt).view(tuple(span.shape))


def load_layout(
    layout: Any,
    model: Any,
    allocator: RecordingAllocator,
    on_progress: Progress | None = None,
    cancelled: Callable[[], bool] | None = None,
) -> list[LoadedStage]:
    """Allocate every arena of ``layout``, copy the weights of ``model`` into their spans and
    fill the dequant cache. On cancellation or any error everything allocated is freed and
    CarveError is raised."""
    try:
        return _load(layout, model, allocator, on_progress or _quiet, cancelled or _never)
    except BaseException:
        allocator.free_all()
        raise


def _load(layout, model, allocator, on_progress, cancelled) -> list[LoadedStage]:
    stages: list[LoadedStage] = []
    copies: list[tuple[LoadedStage, Any, torch.Tensor]] = []  # weight spans to fill
    dq: list[tuple[LoadedStage, Any]] = []
    for dl in layout.devices:
        dev = torch_device(dl.device)
        st = LoadedStage(dev, tuple(dl.layers), dl.first, dl.last)
        for arena in dl.arenas:
            buf = allocator.alloc(dev, arena.name, arena.nbytes)
            for span in arena.spans:
                view = span_view(buf, span)
                st.spans[span.name] = view
                if span.purpose in ("weights", "globals"):
                    copies.append((st, span, view))
                elif span.purpose == "dequant_cache":
                    dq.append((st, span))
        stages.append(st)

    total = sum(s.nbytes for _, s, _ in copies)
    meter = _Meter("weights", total, on_progress)
    for st, span, view in copies:
        info = model.tensor(span.name)
        if info.nbytes != span.nbytes:
            raise CarveError(
                f"{model.paths[info.shard]}: tensor {span.name} has {info.nbytes} bytes but the "
                f"layout priced {span.nbytes}; re-price the plan for this file"
            )
        for a in range(0, info.nbytes, COPY_CHUNK):
            if cancelled():
                raise CarveError("load cancelled")
            b = min(info.nbytes, a + COPY_CHUNK)
            _read_piece(model, info, a, view[a:b])  # pread: a file cut short is an error, not SIGBUS
            meter.add(b - a)
        # the copy just read (never the file's map: a file cut short since would SIGBUS there)
        # for a non-finite scale
        if len(info.shape) >= 2 and first_bad_block(view, info.ggml_type) is not None:
            raise CarveError(
                f"{model.paths[info.shard]}: tensor {span.name} has a block whose "
                f"{qt.type_name(info.ggml_type)} scale is not finite (inf or NaN): the file is "
                "damaged; download or convert it again")

    for st in stages:
        _bind_tensors(st, model)

    meter = _Meter("dequant cache", sum(s.nbytes for _, s in dq), on_progress)
    for st, span in dq:
        if cancelled():
            raise CarveError("load cancelled")
        name = span.name.removeprefix("dq.")
        w = st.tensors.get(name)
        if not isinstance(w, (QWeight, QExperts)):
            raise CarveError(f"layout: dequant-cache span {span.name} has no matrix {name} on {st.device}")
        out = st.spans[span.name]
        dequantize_to(w.raw, w.ggml_type, w.gguf_shape, out.dtype, out=out)
        w.cached = out if isinstance(w, QWeight) else out.view(w.n_expert, w.rows, w.cols)
        meter.add(span.nbytes)
    return stages


def _bind_tensors(st: LoadedStage, model: Any) -> None:
    """GGUF name -> what the models take: QWeight for matrices, float32 views for vectors."""
    scratch = st.spans.get("buf.dequant")
    for name, view in st.spans.items():
        if name.startswith(("kv.", "buf.", "dq.")):
            continue
        info = model.tensor(name)
        shape = tuple(int(s) for s in info.shape)
        dims = [s for s in shape if s != 1] or [1]
        if len(shape) == 3 and name.endswith(".weight"):
            # experts [n_expert, rows, cols]: GGUF shape (cols, rows, n_expert)
            _check_mxfp4(model, info, view)
            st.tensors[name] = QExperts(name, view, info.ggml_type, shape[2], shape[1], shape[0],
                                        None, scratch)
        elif len(shape) == 2 and name.endswith(".bias") and info.ggml_type == qt.F32:
            # one bias row per expert (gpt-oss): [n_expert, rows]
            st.tensors[name] = view.view(torch.float32).view(shape[1], shape[0])
        elif len(shape) >= 2 and len(dims) >= 2:
            if len(dims) > 2:
                raise CarveError(f"tensor {name} has {len(dims)} dimensions; the engine runs 2-D matrices only")
            _check_mxfp4(model, info, view)
            st.tensors[name] = QWeight(name, view, info.ggml_type, shape[1], shape[0], None, scratch)
        elif info.ggml_type == qt.F32:
            st.tensors[name] = view.view(torch.float32)
        else:
            # Norm weights and biases are F32 in every converter's output; a rare F16 one costs
            # a few KiB outside the arenas.
            from carve_kernels.dequant import dequantize

            st.tensors[name] = dequantize(view, info.ggml_type, shape).reshape(-1)


def _check_mxfp4(model: Any, info: Any, view: torch.Tensor) -> None:
    """Refuse an MXFP4 tensor with a block scale of 0xFF: E8M0's NaN in the OCP MX format
    (ggml would read it as 2^127, whose products overflow float32)."""
    if info.ggml_type != qt.MXFP4:
        return
    scales = view.view(-1, 17)[:, 0]  # a block: one E8M0 scale byte, then 16 bytes of nibbles
    step = COPY_CHUNK  # blocks per look: bounds the temporary on a file of many GiB
    for b0 in range(0, scales.numel(), step):
        bad = (scales[b0 : b0 + step] == 0xFF).nonzero()
        if not bad.numel():
            continue
        block = b0 + int(bad[0, 0])
        raise CarveError(
            f"{model.paths[info.shard]}: tensor {info.name} has a non-finite MXFP4 block scale "
            f"(0xFF, block {block}); the file is damaged or not MXFP4 as ggml writes it"
        )


def _read_piece(model: Any, info: Any, start: int, dst: torch.Tensor) -> None:
    """The tensor's bytes from ``start`` into ``dst`` (uint8), read from the file."""
    if dst.device.type == "cpu":
        model.read_into(info, start, memoryview(dst.numpy()))
        return
    host = torch.empty(dst.numel(), dtype=torch.uint8)
    model.read_into(info, start, memoryview(host.numpy()))
    dst.copy_(host)


class _Meter:
    def __init__(self, stage: str, total: int, on_progress: Progress) -> None:
        self.stage, self.total, self.cb = stage, total, on_progress
        self.done = 0
        self.t0 = time.perf_counter()
        self.last = 0.0
        on_progress(stage, 0, total, 0.0)

    def add(self, n: int) -> None:
        self.done += n
        now = time.perf_counter()
        if now - self.last >= 0.1 or self.done >= self.total:
            self.last = now
            self.cb(self.stage, self.done, self.total, self.done / max(now - self.t0, 1e-9))


def _quiet(stage: str, done: int, total: int, rate: float) -> None:
    pass


def _never() -> bool:
    return False
