"""The T layout's bytes (carve_kernels/gemv_t.py has the layout and the GEMVs that read it): how
many 4-byte words of each type's block go to the word planes and which bytes form the tail
plane; ``repack`` from GGUF rows (the loader, slab by slab) and ``unpack`` / ``unpack_rows``
back (checks, and the rows a prefill chunk dequantizes). Byte copies only, no temporaries."""

from __future__ import annotations

import torch

from spec import quant_types as qt

# words (4 bytes) per block that go to the word planes, and tail bytes per block that go to a
# plane of their own after them (Q6_K's f16 d: its 210-byte block is 52 words and 2 bytes; the
# grid IQ types' f16 d, at the start of their blocks: HEAD)
WORDS = {qt.Q4_K: 36, qt.Q5_K: 44, qt.Q6_K: 52, qt.Q2_K: 21, qt.Q3_K: 27, qt.Q8_0: 8,
         qt.IQ4_XS: 34, qt.IQ2_XXS: 16, qt.IQ2_XS: 18, qt.IQ2_S: 20, qt.IQ3_XXS: 24, qt.IQ3_S: 27,
         qt.IQ1_S: 12, qt.IQ1_M: 14}
TAIL = {qt.Q4_K: 0, qt.Q5_K: 0, qt.Q6_K: 2, qt.Q2_K: 0, qt.Q3_K: 2, qt.Q8_0: 2, qt.IQ4_XS: 0,
        qt.IQ2_XXS: 2, qt.IQ2_XS: 2, qt.IQ2_S: 2, qt.IQ3_XXS: 2, qt.IQ3_S: 2, qt.IQ1_S: 2,
        qt.IQ1_M: 0}
BLOCK_BYTES = {qt.Q4_K: 144, qt.Q5_K: 176, qt.Q6_K: 210, qt.Q2_K: 84, qt.Q3_K: 110, qt.Q8_0: 34,
               qt.IQ4_XS: 136, qt.IQ2_XXS: 66, qt.IQ2_XS: 74, qt.IQ2_S: 82, qt.IQ3_XXS: 98,
               qt.IQ3_S: 110, qt.IQ1_S: 50, qt.IQ1_M: 56}
# types whose gate/up launch reads both matrices' words in the same step
PAIRED = frozenset({qt.Q4_K, qt.Q5_K})
# types whose tail is at the start of the block (the grid IQ types' f16 d): the words are the
# bytes after it
HEAD = {qt.IQ2_XXS: 2, qt.IQ2_XS: 2, qt.IQ2_S: 2, qt.IQ3_XXS: 2, qt.IQ3_S: 2, qt.IQ1_S: 2,
        qt.Q8_0: 2}
# values per block where not 256
BLOCK_VALUES = {qt.Q8_0: 32}


def _cut(ggml_type: int) -> tuple[slice, slice]:
    """(the word bytes, the tail bytes) of a block of ``ggml_type``."""
    w, head = WORDS[ggml_type] * 4, HEAD.get(ggml_type, 0)
    if head:
        return slice(head, head + w), slice(0, head)
    return slice(0, w), slice(w, BLOCK_BYTES[ggml_type])


def _planes(t: torch.Tensor, ggml_type: int, rows: int):
    """(word planes as bytes [nb, W, rows, 4], tail plane [nb, rows, tail] or None) of T."""
    w, tail = WORDS[ggml_type], TAIL[ggml_type]
    nb = t.numel() // (rows * BLOCK_BYTES[ggml_type])
    words = t[: nb * w * rows * 4].view(nb, w, rows, 4)
    rest = t[nb * w * rows * 4:].view(nb, rows, tail) if tail else None
    return words, rest


def repack(w: torch.Tensor, ggml_type: int, out: torch.Tensor | None = None,
           rows: slice | None = None) -> torch.Tensor:
    """GGUF rows ``w`` (uint8 [rows, row_bytes]) -> the T layout, as uint8 of the same size.
    With ``out`` (the whole matrix's T bytes) and ``rows`` (the rows ``w`` holds), fills just
    those rows: the loader repacks a matrix slab by slab. Byte copies only, no temporaries."""
    bb = BLOCK_BYTES[ggml_type]
    n = w.shape[0]
    nb = w.shape[1] // bb
    if w.shape[1] != nb * bb:
        raise ValueError(f"{qt.type_name(ggml_type)} row of {w.shape[1]} bytes is not whole blocks")
    wd, tail = WORDS[ggml_type], TAIL[ggml_type]
    body, rest_b = _cut(ggml_type)
    src = w.view(n, nb, bb)
    if out is None:
        out = torch.empty(w.numel(), dtype=torch.uint8, device=w.device)
        rows, total = slice(0, n), n
    else:
        rows = rows or slice(0, n)
        total = out.numel() // (nb * bb)
    words, rest = _planes(out, ggml_type, total)
    words[:, :, rows, :].copy_(src[:, :, body].view(n, nb, wd, 4).permute(1, 2, 0, 3))
    if tail:
        rest[:, rows, :].copy_(src[:, :, rest_b].permute(1, 0, 2))
    return out


def unpack(t: torch.Tensor, ggml_type: int, rows: int) -> torch.Tensor:
    """The T layout back to GGUF rows (uint8 [rows, row_bytes]); for checks."""
    words = _planes(t, ggml_type, rows)[0]
    out = torch.empty(rows, words.shape[0] * BLOCK_BYTES[ggml_type], dtype=torch.uint8,
                      device=t.device)
    return unpack_rows(t, ggml_type, rows, 0, rows, out)


def unpack_rows(t: torch.Tensor, ggml_type: int, rows: int, r0: int, r1: int,
                out: torch.Tensor) -> torch.Tensor:
    """Rows [r0, r1) of a T-layout matrix of ``rows`` rows back in GGUF order into ``out``
    (uint8, >= (r1 - r0) x row_bytes); byte copies, no temporaries."""
    words, rest = _planes(t, ggml_type, rows)
    nb, wd = words.shape[0], words.shape[1]
    bb = BLOCK_BYTES[ggml_type]
    body, rest_b = _cut(ggml_type)
    o = out[: (r1 - r0) * nb * bb].view(r1 - r0, nb, bb)
    o[:, :, body].view(r1 - r0, nb, wd, 4).copy_(words[:, :, r0:r1, :].permute(2, 0, 1, 3))
    if rest is not None:
        o[:, :, rest_b].copy_(rest[:, r0:r1, :].permute(1, 0, 2))
    return o.view(r1 - r0, nb * bb)
