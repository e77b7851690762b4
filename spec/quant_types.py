"""ggml tensor types: block size and bytes per block, keyed by the type id stored in GGUF files.

Our own copy of ``gguf.constants.GGML_QUANT_SIZES`` (a test holds them equal) so that the GUI can
price a model without importing the gguf package and its numpy-heavy quant code.
"""

from __future__ import annotations

from typing import NamedTuple

from spec.errors import CarveError


class QuantType(NamedTuple):
    name: str
    block_size: int  # elements per block
    type_size: int  # bytes per block


# ggml type id -> QuantType. Ids 4, 5 (Q4_2/Q4_3) and 31..33 (Q4_0_4_4 etc.) were removed upstream.
QUANT: dict[int, QuantType] = {
    0: QuantType("F32", 1, 4),
    1: QuantType("F16", 1, 2),
    2: QuantType("Q4_0", 32, 18),
    3: QuantType("Q4_1", 32, 20),
    6: QuantType("Q5_0", 32, 22),
    7: QuantType("Q5_1", 32, 24),
    8: QuantType("Q8_0", 32, 34),
    9: QuantType("Q8_1", 32, 40),
    10: QuantType("Q2_K", 256, 84),
    11: QuantType("Q3_K", 256, 110),
    12: QuantType("Q4_K", 256, 144),
    13: QuantType("Q5_K", 256, 176),
    14: QuantType("Q6_K", 256, 210),
    15: QuantType("Q8_K", 256, 292),
    16: QuantType("IQ2_XXS", 256, 66),
    17: QuantType("IQ2_XS", 256, 74),
    18: QuantType("IQ3_XXS", 256, 98),
    19: QuantType("IQ1_S", 256, 50),
    20: QuantType("IQ4_NL", 32, 18),
    21: QuantType("IQ3_S", 256, 110),
    22: QuantType("IQ2_S", 256, 82),
    23: QuantType("IQ4_XS", 256, 136),
    24: QuantType("I8", 1, 1),
    25: QuantType("I16", 1, 2),
    26: QuantType("I32", 1, 4),
    27: QuantType("I64", 1, 8),
    28: QuantType("F64", 1, 8),
    29: QuantType("IQ1_M", 256, 56),
    30: QuantType("BF16", 1, 2),
    34: QuantType("TQ1_0", 256, 54),
    35: QuantType("TQ2_0", 256, 66),
    39: QuantType("MXFP4", 32, 17),
    40: QuantType("NVFP4", 64, 36),
    41: QuantType("Q1_0", 128, 18),
}

# name (any case) -> type id, for command lines and mixes ("q4_k", "Q6_K", "bf16")
BY_NAME: dict[str, int] = {q.name.lower(): tid for tid, q in QUANT.items()}

F32, F16, BF16 = 0, 1, 30
Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 = 2, 3, 6, 7, 8
Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, Q8_K = 10, 11, 12, 13, 14, 15
IQ2_XXS, IQ2_XS, IQ3_XXS, IQ1_S, IQ4_NL, IQ3_S, IQ2_S, IQ4_XS = 16, 17, 18, 19, 20, 21, 22, 23
IQ1_M, MXFP4 = 29, 39


def quant(ggml_type: int) -> QuantType:
    """The QuantType of a type id; CarveError for an id this build does not know."""
    try:
        return QUANT[ggml_type]
    except KeyError:
        raise CarveError(
            f"unknown ggml tensor type {ggml_type}: the file needs a newer Carve"
        ) from None


def type_name(ggml_type: int) -> str:
    """"Q4_K" for 12; "type 99" for an unknown id (names are for display, never raise)."""
    q = QUANT.get(ggml_type)
    return q.name if q else f"type {ggml_type}"


def type_id(name: str) -> int:
    """Type id of a name such as "q4_k" or "F16"; CarveError listing the choices otherwise."""
    try:
        return BY_NAME[name.lower()]
    except KeyError:
        choices = ", ".join(sorted(BY_NAME))
        raise CarveError(f"unknown tensor type {name!r}: choose one of {choices}") from None


def tensor_nbytes(ggml_type: int, n_elements: int) -> int:
    """Bytes of a tensor of ``n_elements`` values stored as ``ggml_type`` (whole blocks)."""
    q = quant(ggml_type)
    if n_elements % q.block_size:
        raise CarveError(
            f"{n_elements} elements is not a whole number of {q.name} blocks of {q.block_size}"
        )
    return n_elements // q.block_size * q.type_size


# Where each block type keeps its scale fields (ggml-common.h): (byte offset, kind), f16 = a
# half-float d/dmin. Random payloads need finite, small values there (random bits make inf/NaN).
SCALE_FIELDS: dict[int, tuple[tuple[int, str], ...]] = {
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


def f16_fields(ggml_type: int) -> tuple[int, ...]:
    """Byte offsets of a block's half-float scale fields."""
    return tuple(off for off, kind in SCALE_FIELDS.get(ggml_type, ()) if kind == "f16")
