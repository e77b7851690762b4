"""llama.cpp's low-bit file types as `carve gen` mixes: which type each matrix gets.

    q2_k, q3_k_m, iq2_xxs, iq2_m, iq3_xxs, iq3_s, iq3_m, iq4_xs

follow `llama_tensor_get_type` (src/llama-quant.cpp) as llama-quantize applies it with an
importance matrix (how published IQ files are made: llama-quantize refuses IQ2_XXS, IQ2_XS and
IQ1_S without one). Two more are the mixes of the large files this project started from:

    iq2_xxs-q8attn  IQ2_XXS FFN and experts, Q2_K down-projections, Q8_0 attention, shared
                    experts and output (a DeepSeek-class "dynamic" quant)
    iq3_s-bumped    IQ3_S, with every matrix of llama.cpp's "more bits" layers (first and last
                    eighth, every third between) IQ4_XS, and a Q6_K output

The caller (engine.synth.gen.tensor_types) keeps norms, biases and routers F32 and applies the
row-length fallback.
"""

from __future__ import annotations

from collections.abc import Sequence

from spec import quant_types as qt

# the mix -> its type for every matrix no rule changes (llama_model_quantize_impl's default_type)
FILE_TYPES: dict[str, int] = {
    "q2_k": qt.Q2_K, "q3_k_m": qt.Q3_K, "iq2_xxs": qt.IQ2_XXS, "iq2_m": qt.IQ2_S,
    "iq3_xxs": qt.IQ3_XXS, "iq3_s": qt.IQ3_S, "iq3_m": qt.IQ3_S, "iq4_xs": qt.IQ4_XS,
    "iq2_xxs-q8attn": qt.IQ2_XXS, "iq3_s-bumped": qt.IQ3_S,
}
_IQ2_FAMILY = ("iq2_xxs", "iq2_m")  # the IQ1/IQ2 branch of llama_tensor_get_type
_ATTN = ("attn_q", "attn_k", "attn_v", "attn_output", "attn_kv", "attn_q_a", "attn_q_b",
         "attn_k_b", "attn_v_b", "attn_kv_a_mqa", "attn_kv_b")
# llama.cpp's attn_v rule (and its counter) covers deepseek2's legacy attn_kv_b too
_ATTN_V = ("attn_v.weight", "attn_kv_b.weight")


def _is_attn_v(name: str) -> bool:
    return any(v in name for v in _ATTN_V)


def _use_more_bits(i: int, n: int) -> bool:
    # llama.cpp use_more_bits(): first and last eighth, every third between
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def _layer(name: str) -> int:
    return int(name.split(".")[1]) if name.startswith("blk.") else -1


def file_type_types(shape, mix: str, names: Sequence[str], rank: dict[int, int],
                    tied: bool) -> dict[str, int]:
    """Type of each matrix ``names`` (in the file's order of layers, ``rank``) for file type
    ``mix``. ``shape``: engine.synth.shapes.Shape."""
    gqa = shape.n_head // max(1, shape.n_head_kv)
    n_exp = shape.n_expert
    n = shape.n_block
    # llama.cpp counts attn_v and ffn_down tensors in its order of the file's tensors (by
    # layer number, then name)
    order = sorted(names, key=lambda s: rank.get(_layer(s), -1))
    wv = [s for s in order if _is_attn_v(s)]
    down = [s for s in order if "ffn_down" in s]
    i_wv = {s: i for i, s in enumerate(wv)}
    i_down = {s: i for i, s in enumerate(down)}
    out = {}
    for name in names:
        head = name == "output.weight" or (tied and name == "token_embd.weight")
        if mix in ("iq2_xxs-q8attn", "iq3_s-bumped"):
            out[name] = _issue_mix(mix, name, head, rank, n)
            continue
        t = FILE_TYPES[mix]
        layer = _layer(name)
        # MoE files: the ffn_down rule reads the layer from the name (llama.cpp layer_info)
        i_layer = layer if n_exp > 1 else i_down.get(name, 0)
        if head:
            t = qt.Q5_K if mix in (*_IQ2_FAMILY, "iq3_xxs") else qt.Q6_K
        elif name == "token_embd.weight":
            t = {"iq2_xxs": qt.Q2_K, "iq2_m": qt.IQ3_S, "iq3_xxs": qt.IQ3_S}.get(mix, t)
        elif mix in _IQ2_FAMILY:
            # llama.cpp counts ffn_down tensors (experts and shared experts each) against
            # n_layer / 8 (its n_ffn_down is the layer count)
            t = _iq2_family(mix, name, t, gqa, n_exp, i_down.get(name, 0), n)
        elif _is_attn_v(name):
            t = _attn_v(mix, t, gqa, i_wv[name])
            if shape.arch == "llama" and shape.n_layer == 80 and t in (qt.Q3_K, qt.Q4_K):
                t = qt.Q5_K  # LLM_TYPE_70B: attn_v is 8x smaller than attn_q
            if n_exp == 8:
                t = qt.Q8_0
        elif "attn_k.weight" in name:
            t = qt.Q8_0 if n_exp == 8 else qt.IQ2_S if mix == "iq3_xxs" else t
        elif "attn_q.weight" in name:
            t = qt.IQ2_S if mix == "iq3_xxs" else t
        elif "ffn_down" in name:
            t = _ffn_down(mix, t, i_layer, n, n_exp)
        elif "attn_output.weight" in name:
            if n_exp == 8:  # llama.cpp's Mixtral rule, for each of these file types
                t = qt.Q5_K
            else:
                t = {"q2_k": qt.Q3_K, "iq3_xxs": qt.IQ3_S, "q3_k_m": qt.Q4_K,
                     "iq3_m": qt.Q4_K}.get(mix, t)
        out[name] = t
    return out


def _iq2_family(mix: str, name: str, t: int, gqa: int, n_exp: int, i_down: int,
                n_down: int) -> int:
    if _is_attn_v(name):
        if gqa >= 4 or n_exp >= 4:
            return qt.Q4_K
        return qt.IQ3_S if mix == "iq2_m" else qt.Q2_K
    if n_exp == 8 and "attn_k.weight" in name:
        return qt.Q4_K
    if "ffn_down" in name:
        if i_down < n_down // 8:
            return qt.IQ3_S if mix == "iq2_m" else qt.Q2_K
        return t
    if "attn_output.weight" in name:
        if n_exp == 8:
            return qt.Q5_K
        return qt.IQ3_S if mix == "iq2_m" else t
    return t


def _attn_v(mix: str, t: int, gqa: int, i_wv: int) -> int:
    if mix == "q2_k":
        return qt.Q4_K if gqa >= 4 else qt.Q3_K
    if mix == "iq3_xxs":
        return qt.Q4_K if gqa >= 4 else qt.IQ3_XXS  # with an importance matrix
    if mix == "iq3_s" and gqa >= 4:
        return qt.Q4_K
    if mix == "iq3_m":
        return qt.Q4_K
    if mix == "q3_k_m":
        return qt.Q5_K if i_wv < 2 else qt.Q4_K
    if mix == "iq4_xs" and gqa >= 4:
        return qt.Q5_K
    return t


def _ffn_down(mix: str, t: int, i_layer: int, n: int, n_exp: int) -> int:
    if mix == "q2_k":
        return qt.Q3_K
    if mix == "q3_k_m":
        return qt.Q5_K if i_layer < n // 16 else qt.Q4_K  # (Falcon aside: always Q4_K)
    if mix == "iq3_m" and (i_layer < n // 8 or (n_exp == 8 and _use_more_bits(i_layer, n))):
        return qt.Q4_K
    # iq3_xxs with an importance matrix and iq4_xs (its Q5_K bump is for files without one)
    return t


def _issue_mix(mix: str, name: str, head: bool, rank: dict[int, int], n: int) -> int:
    if mix == "iq2_xxs-q8attn":
        if head:
            return qt.Q8_0
        if name == "token_embd.weight":
            return qt.Q2_K
        if "shexp" in name or any(f"{a}." in name for a in _ATTN):
            return qt.Q8_0
        return qt.Q2_K if "ffn_down" in name else qt.IQ2_XXS
    if head:
        return qt.Q6_K
    layer = _layer(name)
    if layer >= 0 and _use_more_bits(rank.get(layer, layer), n):
        return qt.IQ4_XS
    return qt.IQ3_S
