"""Synthetic GGUF models of real shapes with random, well-formed quantized blocks.

Speed and memory do not depend on weight values, so a 7B/32B/70B-shaped file of random blocks
is as good as a real one for GPU work, and it is written at disk speed: tensor data streams
from a small per-type pool of random blocks whose scale fields were set to small finite f16
values (random bytes there could be inf/NaN and poison every benchmark).

    python -m engine.synth --shape qwen2-7b --mix q4_k_m -o FILE [--split N]
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from engine.errors import CarveError
from engine.gguf_write import GGUFSink, MetaItem, split_names
from engine.quant_types import BY_NAME, F32, Q4_K, Q6_K, QUANT, quant, type_name
from engine.synth_shapes import SHAPES, Shape, metadata, tensor_table

__all__ = ["MIXES", "SHAPES", "Shape", "main", "tensor_types", "write_model"]

MIXES = ("q4_k_m", *sorted(BY_NAME))

# llama.cpp's fallback when a row length is not a multiple of 256 (llama_tensor_get_type):
# K and IQ types that cannot tile the row are replaced by a 32-block type of similar size.
_FALLBACK = {10: 20, 11: 20, 12: 6, 13: 7, 14: 8, 16: 20, 17: 20, 18: 20, 19: 20,
             21: 20, 22: 20, 23: 20, 29: 20, 34: 8, 35: 8, 15: 8}


def _use_more_bits(i: int, n: int) -> bool:
    # llama.cpp src/llama-quant.cpp use_more_bits(): first and last eighth, every third between
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def _fit(ggml_type: int, ne0: int) -> int:
    if ne0 % quant(ggml_type).block_size == 0:
        return ggml_type
    fallback = _FALLBACK.get(ggml_type)
    if fallback is not None and ne0 % quant(fallback).block_size == 0:
        return fallback
    raise CarveError(
        f"tensor type {type_name(ggml_type)} cannot store rows of {ne0} values: choose another --mix"
    )


def tensor_types(shape: Shape, mix: str) -> dict[str, int]:
    """GGML type per tensor name for a mix: "q4_k_m" (llama.cpp's rule) or one type for all
    matrices. 1-D tensors (norms, biases) are always F32."""
    mix = mix.lower()
    if mix != "q4_k_m" and mix not in BY_NAME:
        raise CarveError(f"unknown --mix {mix!r}: choose q4_k_m or a tensor type such as q8_0")
    out: dict[str, int] = {}
    tied = shape.tied_embeddings
    for name, dims in tensor_table(shape):
        if len(dims) == 1:
            out[name] = F32
            continue
        if mix != "q4_k_m":
            out[name] = _fit(BY_NAME[mix], dims[0])
            continue
        t = Q4_K
        if name == "output.weight" or (tied and name == "token_embd.weight"):
            # llama.cpp gives the output projection Q6_K, and with tied embeddings the
            # token embedding *is* the output projection
            t = Q6_K
        elif name.endswith(("attn_v.weight", "ffn_down.weight")):
            layer = int(name.split(".")[1])
            if _use_more_bits(layer, shape.n_layer):
                t = Q6_K
        out[name] = _fit(t, dims[0])
    return out


# Where each block type keeps its scales, so random payloads get finite small values there:
# (byte offset, kind). f16 = a half float d/dmin.
_SCALES: dict[int, tuple[tuple[int, str], ...]] = {
    2: ((0, "f16"),), 3: ((0, "f16"), (2, "f16")), 6: ((0, "f16"),), 7: ((0, "f16"), (2, "f16")),
    8: ((0, "f16"),), 9: ((0, "f16"), (2, "f16")),
    10: ((80, "f16"), (82, "f16")),  # Q2_K: scales[16] qs[64] d dmin
    11: ((108, "f16"),),  # Q3_K: hmask[32] qs[64] scales[12] d
    12: ((0, "f16"), (2, "f16")), 13: ((0, "f16"), (2, "f16")),  # Q4_K/Q5_K: d dmin ...
    14: ((208, "f16"),),  # Q6_K: ql[128] qh[64] scales[16] d
    15: ((0, "f32"),),  # Q8_K: float d, qs[256], bsums[16]
    16: ((0, "f16"),), 17: ((0, "f16"),), 18: ((0, "f16"),), 19: ((0, "f16"),),
    20: ((0, "f16"),), 21: ((0, "f16"),), 22: ((0, "f16"),), 23: ((0, "f16"),),
    29: ((48, "iq1m"),),  # IQ1_M: the f16 d is spread over the top nibbles of scales[4] u16
    34: ((52, "f16"),), 35: ((64, "f16"),),  # TQ1_0 / TQ2_0: d last
    39: ((0, "e8m0"),),  # MXFP4: one shared exponent byte
    40: ((0, "ue4m3"),),  # NVFP4: four e4m3 sub-block scales
    41: ((0, "f16"),),
}

_POOL_BYTES = 16 << 20


def _scale_values(rng: np.random.Generator, n: int) -> np.ndarray:
    # weights come out O(0.01..0.1) for every type: d * quant (<= 127 * 63 for Q6_K scales)
    return rng.uniform(2e-5, 2e-4, n).astype(np.float16)


def _block_pool(ggml_type: int, kind: str, rng: np.random.Generator) -> np.ndarray:
    """uint8 array of whole blocks (or elements) to cycle through for one tensor class."""
    q = QUANT[ggml_type]
    n_blocks = max(1, _POOL_BYTES // q.type_size)
    if q.block_size == 1:
        n = n_blocks
        if ggml_type in (0, 1, 28, 30):  # float types: norms near 1, the rest small normals
            vals = rng.normal(1.0 if kind == "norm" else 0.0, 0.02, n).astype(np.float32)
            if ggml_type == 1:
                return vals.astype(np.float16).view(np.uint8)
            if ggml_type == 30:
                return (vals.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
            if ggml_type == 28:
                return vals.astype(np.float64).view(np.uint8)
            return vals.view(np.uint8)
        return np.frombuffer(rng.bytes(n * q.type_size), dtype=np.uint8).copy()
    blocks = np.frombuffer(rng.bytes(n_blocks * q.type_size), dtype=np.uint8).copy()
    blocks = blocks.reshape(n_blocks, q.type_size)
    for off, how in _SCALES.get(ggml_type, ()):
        if how == "f16":
            blocks[:, off : off + 2] = _scale_values(rng, n_blocks).view(np.uint8).reshape(-1, 2)
        elif how == "f32":
            d = _scale_values(rng, n_blocks).astype(np.float32)
            blocks[:, off : off + 4] = d.view(np.uint8).reshape(-1, 4)
        elif how == "e8m0":
            blocks[:, off] = rng.integers(118, 122, n_blocks, dtype=np.uint8)
        elif how == "ue4m3":
            blocks[:, off : off + 4] = rng.integers(0x18, 0x30, (n_blocks, 4), dtype=np.uint8)
        elif how == "iq1m":
            sc = blocks[:, off : off + 8].copy().view(np.uint16)  # [n_blocks, 4]
            d = _scale_values(rng, n_blocks).view(np.uint16)
            for j in range(4):
                sc[:, j] = (sc[:, j] & 0x0FFF) | (((d >> (4 * j)) & 0xF) << 12)
            blocks[:, off : off + 8] = sc.view(np.uint8)
    return blocks.reshape(-1)


def write_model(path: str | Path, shape: str | Shape, mix: str = "q4_k_m", split: int = 1,
                seed: int = 0, edit: Callable[[list[MetaItem]], list[MetaItem]] | None = None,
                ) -> list[Path]:
    """Write a synthetic model (one file, or ``split`` shards named like gguf-split's) and
    return the paths written. Tensor data streams from pools: memory stays ~100 MiB.
    ``edit`` may rewrite the metadata list (tests use it for odd keys and broken models)."""
    sh = SHAPES[shape] if isinstance(shape, str) else shape
    types = tensor_types(sh, mix)
    table = tensor_table(sh)
    meta = metadata(sh, mix)
    if edit is not None:
        meta = edit(meta)
    rng = np.random.default_rng(seed)
    pools: dict[tuple[int, str], np.ndarray] = {}

    def payload(name: str, ggml_type: int, nbytes: int):
        kind = "norm" if "norm" in name else "bias" if name.endswith(".bias") else "w"
        key = (ggml_type, kind)
        if key not in pools:
            pools[key] = _block_pool(ggml_type, kind, rng)
        pool = memoryview(pools[key])
        unit = QUANT[ggml_type].type_size
        pos = int(rng.integers(0, len(pool) // unit)) * unit  # tensors differ in their start
        left = nbytes
        while left:
            take = min(left, len(pool) - pos)
            yield pool[pos : pos + take]
            left -= take
            pos = 0

    paths = split_names(Path(path), split)
    sink = GGUFSink(meta, [(n, d, types[n]) for n, d in table], paths)
    sink.write(payload)
    return paths


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m engine.synth", description=__doc__.split("\n")[0])
    ap.add_argument("--shape", required=True, help="one of: " + ", ".join(SHAPES))
    ap.add_argument("--mix", default="q4_k_m", help="q4_k_m or one tensor type (q8_0, f16, ...)")
    ap.add_argument("-o", "--output", required=True, help="output .gguf path")
    ap.add_argument("--split", type=int, default=1, help="write N shards (gguf-split names)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    try:
        if args.shape not in SHAPES:
            raise CarveError(f"unknown --shape {args.shape!r}: choose one of {', '.join(SHAPES)}")
        t0 = time.perf_counter()
        paths = write_model(args.output, args.shape, args.mix, args.split, args.seed)
        dt = time.perf_counter() - t0
    except CarveError as err:
        print(f"carve: {err}", file=sys.stderr)
        return 2
    total = sum(p.stat().st_size for p in paths)
    for p in paths:
        print(f"wrote {p} ({p.stat().st_size / 2**30:.2f} GiB)")
    print(f"{args.shape} {args.mix}: {len(paths)} file(s), {total / 2**30:.2f} GiB "
          f"in {dt:.1f} s ({total / dt / 1e9:.2f} GB/s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
