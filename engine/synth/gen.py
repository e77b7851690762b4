"""Synthetic GGUF models of real shapes with random, well-formed quantized blocks.

Speed and memory do not depend on weight values, so a 7B/32B/70B-shaped file of random blocks
is as good as a real one for GPU work, and it is written at disk speed: tensor data streams
from a small per-type pool of random blocks whose scale fields were set explicitly (random
bytes there could be inf/NaN and poison every benchmark), sized so every type's weights have
an RMS of about 0.02 like trained matrices.

    python -m engine.synth.gen --shape qwen2-7b --mix q4_k_m -o FILE [--split N]
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from engine.gguf.writer import GGUFSink, MetaItem, split_names, tensor_bytes
from engine.synth.contents import llama3_factors, longrope_factors, metadata, tensor_table
from engine.synth.file_types import FILE_TYPES, file_type_types
from engine.synth.shapes import SHAPES, Shape
from spec.errors import CarveError
from spec.quant_types import (
    BY_NAME,
    F16,
    F32,
    MXFP4,
    Q4_K,
    Q5_K,
    Q6_K,
    Q8_0,
    QUANT,
    SCALE_FIELDS,
    quant,
    type_name,
)

__all__ = ["MIXES", "SHAPES", "Shape", "main", "tensor_types", "write_model"]

MIXES = ("q4_k_m", "q5_k_m", "mxfp4_moe", *FILE_TYPES, *sorted(BY_NAME), *(f"pure-{t}" for t in FILE_TYPES
                                                                    if t in BY_NAME))

# llama.cpp's fallback when a row length is not a multiple of 256 (llama_tensor_get_type):
# K, IQ and TQ types that cannot tile the row become a 32-block type of similar size.
# (Q8_K is no storage type in llama.cpp; Q8_0 is our choice for it.)
_FALLBACK = {10: 20, 11: 20, 12: 6, 13: 7, 14: 8, 16: 20, 17: 20, 18: 20, 19: 20,
             21: 20, 22: 20, 23: 20, 29: 20, 34: 2, 35: 2, 15: 8}


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


def _stays_float(name: str, dims: Sequence[int]) -> bool:
    # llama.cpp quantizes only 2-D and 3-D "*weight" tensors, never norms or the expert router
    # (the converter writes routers as F32 whatever the output type)
    return (len(dims) == 1 or not name.endswith("weight") or "_norm.weight" in name
            or "ffn_gate_inp.weight" in name)


def tensor_types(shape: Shape, mix: str, layer_order: Sequence[int] | None = None,
                 ) -> dict[str, int]:
    """GGML type per tensor name for a mix: "q4_k_m" or "q5_k_m" (llama.cpp's rules), "mxfp4_moe" (MXFP4
    experts, Q8_0 elsewhere), one of llama.cpp's low-bit file types ("q2_k", "iq2_xxs", ...:
    engine/synth/file_types.py) or one type for all matrices (any other type name, or
    "pure-<type>" for a type whose name is also a file type's). Norms, biases and routers are
    F32.

    llama.cpp applies its layer rule to a counter of attn_v / ffn_down tensors in the order the
    source file lists them, not to the layer number; ``layer_order`` gives that order when it
    is not 0..n-1 (files whose layers were sorted as strings: 0, 1, 10, 11, ...). In a MoE file
    the ffn_down rule reads the layer from the tensor's name instead (experts and shared experts
    alike), over every declared layer (NextN included)."""
    mix = mix.lower()
    pure = BY_NAME.get(mix.removeprefix("pure-")) if mix.startswith("pure-") else None
    if mix not in ("q4_k_m", "q5_k_m", "mxfp4_moe") and mix not in BY_NAME and mix not in FILE_TYPES \
            and pure is None:
        raise CarveError(f"unknown --mix {mix!r}: choose q4_k_m, q5_k_m, mxfp4_moe, a llama.cpp file "
                         f"type ({', '.join(FILE_TYPES)}) or a tensor type "
                         "such as q8_0")
    out: dict[str, int] = {}
    tied = shape.tied_embeddings
    n = shape.n_block
    rank = {layer: i for i, layer in enumerate(layer_order or range(n))}
    eight = shape.n_expert == 8  # llama.cpp's Mixtral rules key on exactly 8 experts
    table = tensor_table(shape)
    by_file_type = file_type_types(
        shape, mix, [nm for nm, d in table if not _stays_float(nm, d)], rank, tied
    ) if mix in FILE_TYPES else {}
    for name, dims in table:
        if _stays_float(name, dims):
            out[name] = F32
            continue
        head = name == "output.weight" or (tied and name == "token_embd.weight")
        if pure is not None:
            t = pure
        elif mix in FILE_TYPES:
            t = by_file_type[name]
        elif mix == "mxfp4_moe":
            t = MXFP4 if len(dims) == 3 and dims[2] > 1 and not head else Q8_0
        elif mix not in ("q4_k_m", "q5_k_m"):
            t = BY_NAME[mix]
        elif head:
            # llama.cpp gives the output projection Q6_K, and with tied embeddings the
            # token embedding *is* the output projection
            t = Q6_K
        else:
            t = _k_m(shape, name, rank, n, eight, Q4_K if mix == "q4_k_m" else Q5_K)
        out[name] = _fit(t, dims[0])
    return out


def _k_m(shape: Shape, name: str, rank: dict[int, int], n: int, eight: bool, base: int) -> int:
    """llama.cpp's Q4_K_M (``base`` Q4_K) or Q5_K_M (Q5_K) choice for one layer matrix
    (llama_tensor_get_type: the two share their attn_v and ffn_down rules)."""
    layer = int(name.split(".")[1]) if name.startswith("blk.") else 0
    # deepseek2's legacy attn_kv_b (values and the no-RoPE keys) takes attn_v's rule, as
    # llama.cpp counts and treats it (its split attn_k_b / attn_v_b take the base type)
    if name.endswith(("attn_v.weight", "attn_kv_b.weight")):
        t = Q6_K if _use_more_bits(rank[layer], n) else base
        if t == Q4_K and shape.arch == "llama" and shape.n_layer == 80:
            # llama.cpp: a 70B's 8 KV heads make attn_v 8x smaller than attn_q, so it
            # gets Q5_K for almost no size (LLM_TYPE_70B branch of llama_tensor_get_type)
            t = Q5_K
        return Q8_0 if eight else t
    if name.endswith("attn_qkv.weight"):  # phi3's fused q/k/v: one step up (llama.cpp)
        return Q5_K if base == Q4_K else Q6_K
    if name.endswith("attn_k.weight") and eight:
        return Q8_0
    if name.endswith("attn_output.weight") and eight:
        return Q5_K
    if "ffn_down" in name:
        i = layer if shape.n_expert > 1 else rank[layer]
        return Q6_K if _use_more_bits(i, n) else base
    return base


_POOL_BYTES = 16 << 20
_TARGET_RMS = 0.02  # about what trained 7B-class matrices hold
# types gguf.quants cannot dequantize: d-field value that gives about _TARGET_RMS
_D_FALLBACK = {9: _TARGET_RMS / 74, 15: _TARGET_RMS / 74, 41: _TARGET_RMS}


def _d_factor(ggml_type: int, blocks: np.ndarray) -> float:
    """Factor that brings blocks whose scale fields are ~1 to _TARGET_RMS. Every format here
    is linear in its scale fields taken together (w = d*a - dmin*b), so one factor fits all."""
    try:
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        w = dequantize(blocks[:64].reshape(-1), GGMLQuantizationType(ggml_type))
    except NotImplementedError:
        return _D_FALLBACK.get(ggml_type, _TARGET_RMS / 64)
    rms = float(np.sqrt(np.mean(np.square(w, dtype=np.float64))))
    return _TARGET_RMS / rms if rms > 0 else 1.0


# Random bytes give the types with a min or offset (Q4_K, Q5_K, Q2_K, Q4_1, Q5_1) a mean about
# as large as their spread, the mins unrelated to the scales. Trained weights quantize to rows of
# mean near zero; a mean that large makes every matrix add the same offset to its outputs, until
# every token's hidden state points one way and a router sends every token to the same experts
# (measured: a synthetic Qwen3-30B-A3B routed 512 random tokens to the same 8 of 128). So each
# min is tied to its scale: dmin m = c d sc for the K-quants (c the middle of q's range), and
# Q4_1 / Q5_1's m = -c d.
_K_CENTER = {12: 7.5, 13: 15.5, 10: 1.5}  # Q4_K, Q5_K, Q2_K
_MIN_OFFSET = {3: -7.5, 7: -15.5}  # Q4_1, Q5_1


def _center(ggml_type: int, blocks: np.ndarray) -> None:
    """Make ``blocks`` (uint8 [n, type_size], d and dmin / m already set) zero-mean as
    described above; other types are left as they are."""
    def half(off: int) -> np.ndarray:
        return blocks[:, off:off + 2].copy().view(np.float16).astype(np.float32)

    def put(off: int, v: np.ndarray) -> None:
        blocks[:, off:off + 2] = v.astype(np.float16).view(np.uint8).reshape(-1, 2)

    if ggml_type in (12, 13):  # scales[12] at 4: sc0-3 | m0-3 | sc4-7 low nibbles, m4-7 high
        sc = blocks[:, 4:16]
        sc[:, 4:8] = sc[:, 0:4]
        lo = sc[:, 8:12] & 0x0F
        sc[:, 8:12] = lo | (lo << 4)
        put(2, _K_CENTER[ggml_type] * half(0))
    elif ggml_type == 10:  # scales[16] at 0: sc low nibble, m high
        lo = blocks[:, 0:16] & 0x0F
        blocks[:, 0:16] = lo | (lo << 4)
        put(82, _K_CENTER[10] * half(80))
    elif ggml_type in _MIN_OFFSET:
        put(2, _MIN_OFFSET[ggml_type] * half(0))
    elif ggml_type == 35:  # TQ2_0: qs[64] of 2-bit codes q - 1; 3 is no ternary value: 3 -> 1
        qs = blocks[:, 0:64]
        three = (qs >> 1) & qs & 0x55
        qs &= ~(three << 1) & 0xFF


def _block_pool(ggml_type: int, kind: str, rng: np.random.Generator,
                max_bytes: int = _POOL_BYTES) -> np.ndarray:
    """uint8 array of whole blocks (or elements) to cycle through for one tensor class."""
    q = QUANT[ggml_type]
    n_blocks = max(1, min(max_bytes, _POOL_BYTES) // q.type_size)
    if q.block_size == 1:
        n = n_blocks
        if ggml_type in (0, 1, 28, 30):  # float types: norms near 1, the rest small normals
            sigma = 0.02 if kind != "w" else _TARGET_RMS
            vals = rng.normal(1.0 if kind == "norm" else 0.0, sigma, n).astype(np.float32)
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
    fields = SCALE_FIELDS.get(ggml_type, ())
    linear = [(off, how) for off, how in fields if how in ("f16", "f32")]
    for off, how in linear:  # scales ~U(0.5, 1.5) first, then one factor to the target RMS
        width = 2 if how == "f16" else 4
        u = rng.uniform(0.5, 1.5, n_blocks).astype(np.float16 if width == 2 else np.float32)
        blocks[:, off : off + width] = u.view(np.uint8).reshape(-1, width)
    _center(ggml_type, blocks)
    if linear:
        factor = _d_factor(ggml_type, blocks)
        for off, how in linear:
            dt = np.float16 if how == "f16" else np.float32
            width = np.dtype(dt).itemsize
            d = blocks[:, off : off + width].copy().view(dt).astype(np.float32) * factor
            blocks[:, off : off + width] = d.astype(dt).view(np.uint8).reshape(-1, width)
    for off, how in fields:
        if how == "e8m0":  # MXFP4: d = 2**(e - 128) in gguf's half convention
            blocks[:, off] = rng.integers(119, 122, n_blocks, dtype=np.uint8)
        elif how == "ue4m3":  # NVFP4: four e4m3 scales of 2**-6 .. 2**-5
            blocks[:, off : off + 4] = rng.integers(0x08, 0x10, (n_blocks, 4), dtype=np.uint8)
        elif how == "iq1m":
            sc = blocks[:, off : off + 8].copy().view(np.uint16)  # [n_blocks, 4]
            d = rng.uniform(0.5, 1.5, n_blocks).astype(np.float16).view(np.uint16)
            for j in range(4):
                sc[:, j] = (sc[:, j] & 0x0FFF) | (((d >> (4 * j)) & 0xF) << 12)
            blocks[:, off : off + 8] = sc.view(np.uint8)
            factor = _d_factor(ggml_type, blocks)
            d = (d.view(np.float16).astype(np.float32) * factor).astype(np.float16)
            d = d.view(np.uint16)
            for j in range(4):
                sc[:, j] = (sc[:, j] & 0x0FFF) | (((d >> (4 * j)) & 0xF) << 12)
            blocks[:, off : off + 8] = sc.view(np.uint8)
    return blocks.reshape(-1)


def _kind(name: str) -> str:
    return "norm" if "norm" in name else "bias" if name.endswith(".bias") else "w"


def write_model(path: str | Path, shape: str | Shape, mix: str | None = None, split: int = 1,
                seed: int = 0, edit: Callable[[list[MetaItem]], list[MetaItem]] | None = None,
                ) -> list[Path]:
    """Write a synthetic model (one file, or ``split`` shards named like gguf-split's) and
    return the paths written. Tensor data streams from pools: memory stays ~100 MiB.
    ``edit`` may rewrite the metadata list (tests use it for odd keys and broken models)."""
    sh = SHAPES[shape] if isinstance(shape, str) else shape
    mix = mix or sh.mix
    types = tensor_types(sh, mix)
    table = tensor_table(sh)
    meta = metadata(sh, mix)
    if edit is not None:
        meta = edit(meta)
    rng = np.random.default_rng(seed)
    pools: dict[tuple[int, str], np.ndarray] = {}
    largest: dict[tuple[int, str], int] = {}  # tiny models need tiny pools
    for name, dims in table:
        key = (types[name], _kind(name))
        largest[key] = max(largest.get(key, 0), tensor_bytes(types[name], dims))

    def payload(name: str, ggml_type: int, nbytes: int):
        if name in ("rope_freqs.weight", "rope_factors_long.weight",
                    "rope_factors_short.weight"):  # the factors themselves, not random values
            values = (llama3_factors(sh.hd, sh.rope_base, *sh.llama3_rope)
                      if name == "rope_freqs.weight"
                      else longrope_factors(sh)[0 if "long" in name else 1])
            yield np.asarray(values, np.float16 if ggml_type == F16 else np.float32).tobytes()
            return
        key = (ggml_type, _kind(name))
        if key not in pools:
            pools[key] = _block_pool(ggml_type, key[1], rng, largest[key])
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
    try:
        sink.write(payload)
    except BaseException as err:
        for p in paths:  # no half-written model that looks finished
            p.unlink(missing_ok=True)
        if isinstance(err, OSError):
            raise CarveError(f"{err.filename or paths[0]}: cannot write ({err.strerror}); "
                             "choose another -o or free disk space") from None
        raise
    return paths


def main(argv: list[str] | None = None, prog: str = "python -m engine.synth.gen") -> int:
    ap = argparse.ArgumentParser(
        prog=prog, description="Write a synthetic GGUF of a real shape with random, "
        "well-formed quantized blocks.")
    ap.add_argument("--shape", help="one of: " + ", ".join(SHAPES))
    ap.add_argument("--list", action="store_true", help="print the shapes and their sizes")
    ap.add_argument("--mix", help="q4_k_m, q5_k_m, mxfp4_moe, a llama.cpp low-bit file type (q2_k, "
                    "q3_k_m, iq2_xxs, iq2_m, iq3_xxs, iq3_s, iq3_m, iq4_xs, iq2_xxs-q8attn, "
                    "iq3_s-bumped) or one tensor type (q8_0, f16, pure-iq2_xxs, ...); "
                    "default: the mix the shape's published files use")
    ap.add_argument("-o", "--output", help="output .gguf path")
    ap.add_argument("--split", type=int, default=1, help="write N shards (gguf-split names)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    try:
        if args.list:
            _print_shapes(args.mix)
            return 0
        if args.shape is None or args.output is None:
            raise CarveError("--shape and -o are needed (--list prints the shapes)")
        if args.shape not in SHAPES:
            raise CarveError(f"unknown --shape {args.shape!r}: choose one of {', '.join(SHAPES)}")
        t0 = time.perf_counter()
        mix = args.mix or SHAPES[args.shape].mix
        paths = write_model(args.output, args.shape, mix, args.split, args.seed)
        dt = time.perf_counter() - t0
    except CarveError as err:
        print(f"carve: {err}", file=sys.stderr)
        return 2
    total = sum(p.stat().st_size for p in paths)
    for p in paths:
        print(f"wrote {p} ({_size(p.stat().st_size)})")
    print(f"{args.shape} {mix}: {len(paths)} file(s), {_size(total)} in {dt:.1f} s "
          f"({total / max(dt, 1e-9) / 1e9:.2f} GB/s)")
    return 0


def model_bytes(shape: Shape, mix: str | None = None) -> int:
    """Tensor bytes of the file `write_model` would write (the size without writing it)."""
    types = tensor_types(shape, mix or shape.mix)
    return sum(tensor_bytes(types[n], d) for n, d in tensor_table(shape))


def _print_shapes(mix: str | None) -> None:
    for name, sh in SHAPES.items():
        if mix is not None:
            tensor_types(sh, mix)  # an unknown mix fails before anything is printed
        moe = (f", {sh.n_expert} experts of {sh.n_ff_exp} ({sh.n_expert_used} used)"
               if sh.n_expert else "")
        print(f"{name:18} {sh.arch:8} {sh.n_layer:3} layers, hidden {sh.n_embd:5}, heads "
              f"{sh.n_head}/{sh.n_head_kv}, FFN {sh.n_ff:5}{moe}, vocab {sh.n_vocab:6}"
              f"{', tied' if sh.tied_embeddings else ''}: {mix or sh.mix} "
              f"{_size(model_bytes(sh, mix))}")


def _size(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


if __name__ == "__main__":
    sys.exit(main())
