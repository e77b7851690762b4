"""Random, well-formed GGUF weights as torch tensors, for kernel checks and GPU benchmarks.

Random bytes are valid quantized data except in the f16 scale fields (random bits there can be
inf/NaN), so those fields get small finite values. Speed does not depend on weight values.
Built with torch alone so that the device check needs no GGUF file and no gguf package.
"""

from __future__ import annotations

import math

import torch

from spec import quant_types as qt

# the largest value of a block in units of its d (scale field times value), where not ~8
SPANS = {qt.Q4_K: 63.0 * 8, qt.Q5_K: 63.0 * 16, qt.Q6_K: 127.0 * 32, qt.Q2_K: 45.0,
         qt.Q3_K: 128.0, qt.IQ4_NL: 127.0, qt.IQ4_XS: 127.0 * 32, qt.IQ2_XXS: 43 * 3.9,
         qt.IQ2_XS: 43 * 3.9, qt.IQ2_S: 43 * 3.9, qt.IQ3_XXS: 62 * 7.8, qt.IQ3_S: 15.0 * 31,
         qt.IQ1_S: 17.0, qt.IQ1_M: 17.0}


def random_weight(ggml_type: int, rows: int, cols: int, device: torch.device | str = "cpu",
                  generator: torch.Generator | None = None, scale: float = 0.02) -> torch.Tensor:
    """uint8 [rows, row_bytes] holding a random ``ggml_type`` matrix of ``rows`` x ``cols``."""
    q = qt.quant(ggml_type)
    if cols % q.block_size:
        raise ValueError(f"{q.name} rows need a multiple of {q.block_size} values, got {cols}")
    nblk = cols // q.block_size
    if ggml_type in (qt.F16, qt.BF16):
        dt = torch.float16 if ggml_type == qt.F16 else torch.bfloat16
        vals = torch.randn(rows, cols, generator=generator, device=device) * scale
        return vals.to(dt).view(torch.uint8).view(rows, cols * 2)
    raw = torch.randint(0, 256, (rows, nblk, q.type_size), dtype=torch.uint8,
                        generator=generator, device=device)
    # K-type sub-block scales reach 63 and Q6_K's int8 scales 127, the IQ types' sub-block
    # scales times their values up to SPANS: shrink d to match
    span = SPANS.get(ggml_type, 8.0)
    for off in qt.f16_fields(ggml_type):
        d = (torch.rand(rows, nblk, generator=generator, device=device) + 0.5) * (scale / span)
        raw[:, :, off:off + 2] = d.to(torch.float16).view(torch.uint8).view(rows, nblk, 2)
    if ggml_type == qt.IQ1_M:
        # the f16 d is spread over the top nibbles of the four scale words (bytes 49, 51, 53, 55)
        d = (torch.rand(rows, nblk, generator=generator, device=device) + 0.5) * (scale / span)
        d16 = d.to(torch.float16).view(torch.int16).to(torch.int32) & 0xFFFF
        for j in range(4):
            nib = ((d16 >> (4 * j)) & 15).to(torch.uint8) << 4
            raw[:, :, 49 + 2 * j] = (raw[:, :, 49 + 2 * j] & 15) | nib
    if ggml_type == qt.MXFP4:
        # the E8M0 exponent byte: 2^(e - 128) per doubled e2m1 step (up to 12), near ``scale``
        e = 128 + round(math.log2(scale / 12))
        raw[:, :, 0] = torch.randint(e - 2, e + 1, (rows, nblk), dtype=torch.uint8,
                                     generator=generator, device=device)
    return raw.view(rows, nblk * q.type_size)
