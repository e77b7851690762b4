"""Dequantization throughput per GGUF type: `python -m benchmarks.bench_dequant [--mb N] [--dtype bf16]`.

Prints MB/s of *input* bytes (what the loader reads from the file) and Melem/s of output, for a
[rows, 4096]-shaped tensor of random well-formed blocks of each type, plus (with --model) the whole
model file as the CPU loader would dequantize it.
"""

from __future__ import annotations

import argparse
import math
import time

import numpy as np
import torch

from carve_kernels.dequant import SUPPORTED_TYPES, dequantize_to
from spec import quant_types as qt

DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}


def random_blocks(ggml_type: int, n_elements: int, rng: np.random.Generator) -> np.ndarray:
    """Random raw bytes of ``n_elements`` values of ``ggml_type`` with finite, small f16 scales."""
    q = qt.quant(ggml_type)
    n_blocks = n_elements // q.block_size
    if ggml_type in (qt.F32, qt.F16, qt.BF16):
        vals = rng.standard_normal(n_elements, dtype=np.float32)
        if ggml_type == qt.F16:
            return vals.astype(np.float16).view(np.uint8)
        if ggml_type == qt.BF16:
            return (vals.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
        return vals.view(np.uint8)
    blocks = rng.integers(0, 256, size=(n_blocks, q.type_size), dtype=np.uint8)
    for off in qt.f16_fields(ggml_type):
        scale = (rng.standard_normal(n_blocks) * 0.01).astype(np.float16)
        blocks[:, off : off + 2] = scale.view(np.uint8).reshape(n_blocks, 2)
    return blocks.reshape(-1)


def _time(fn, min_s: float = 0.5) -> tuple[float, float]:
    """Seconds per call: (wall, CPU of this process). On a shared machine the wall figure
    includes time spent waiting for a core; the CPU figure does not."""
    fn()  # warm
    n, t0, c0 = 0, time.perf_counter(), time.process_time()
    while True:
        fn()
        n += 1
        dt = time.perf_counter() - t0
        if dt >= min_s:
            return dt / n, (time.process_time() - c0) / n


def bench_types(mb: float, dtype: torch.dtype, cols: int = 4096) -> None:
    rng = np.random.default_rng(0)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, output {dtype}")
    print(f"{'type':7} {'in MB':>7} {'MB/s in':>9} {'Melem/s':>9} {'MB/s per CPU-s':>15}")
    for t in SUPPORTED_TYPES:
        q = qt.quant(t)
        rows = max(1, int(mb * 1e6 / (cols / q.block_size * q.type_size)))
        raw = torch.from_numpy(random_blocks(t, rows * cols, rng))
        out = torch.empty(rows, cols, dtype=dtype)
        shape = (cols, rows)
        s, cpu = _time(
            lambda raw=raw, t=t, out=out, shape=shape: dequantize_to(raw, t, shape, dtype, out)
        )
        mb = raw.numel() / 1e6
        print(f"{q.name:7} {mb:7.1f} {mb / s:9.0f} {rows * cols / 1e6 / s:9.0f} {mb / cpu:15.0f}")


def bench_model(path: str, dtype: torch.dtype) -> None:
    import gguf

    reader = gguf.GGUFReader(path)
    total_in = total_out = 0
    t0, c0 = time.perf_counter(), time.process_time()
    for t in reader.tensors:
        shape = tuple(int(s) for s in t.shape)
        raw = np.asarray(t.data).view(np.uint8).reshape(-1)
        dequantize_to(raw, int(t.tensor_type), shape, dtype)
        total_in += raw.size
        total_out += math.prod(shape)
    s, cpu = time.perf_counter() - t0, time.process_time() - c0
    print(
        f"{path}: {len(reader.tensors)} tensors, {total_in / 1e6:.0f} MB in {s:.2f} s "
        f"({cpu:.2f} CPU-s) = {total_in / 1e6 / s:.0f} MB/s in, "
        f"{total_out / 1e6 / s:.0f} Melem/s ({dtype})"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.bench_dequant", description=__doc__)
    ap.add_argument("--mb", type=float, default=16.0, help="input megabytes per type")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="f32")
    ap.add_argument("--model", help="also dequantize every tensor of this GGUF file")
    args = ap.parse_args(argv)
    bench_types(args.mb, DTYPES[args.dtype])
    if args.model:
        bench_model(args.model, DTYPES[args.dtype])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
