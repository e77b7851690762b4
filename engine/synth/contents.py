"""What a synthetic GGUF of a shape (engine/synth/shapes.py) holds: its tensor table and its
metadata as llama.cpp's converter writes them for the architecture, RoPE factor tables, and the
small byte-level BPE vocabulary with a ChatML template that every synthetic file carries."""

from __future__ import annotations

import math

from engine.gguf.writer import ARR, BOOL, F32, I32, STR, U32, MetaItem
from engine.synth.shapes import Shape

_QK_NORM = ("qwen3", "gemma3", "qwen3moe", "dots1")
# q/k RMSNorm weights over each token's whole projected q and k (all heads), not per head
_QK_NORM_WHOLE = ("minimax-m2",)
_POST_ATTN_FFN_NORM = ("gpt-oss", "glm4moe")  # the FFN's pre-norm is named post_attention_norm


def longrope_factors(s: Shape) -> tuple[list[float], list[float]]:
    """Synthetic LongRoPE factor sets (long, short) for ``s``: rising from 1 over the rotated
    pairs to the shape's largest long factor, the short ones a quarter of the way."""
    n = (s.rope_dim or s.hd) // 2
    top = s.longrope[1]
    long = [1.0 + (top - 1.0) * i / max(1, n - 1) for i in range(n)]
    return long, [1.0 + (f - 1.0) / 4 for f in long]


def _mla_attention(s: Shape) -> list[tuple[str, tuple[int, ...]]]:
    """deepseek2's attention as the converter writes it: q (whole, or through its low-rank
    pair), the latent KV projection and its norm, its decompression (attn_kv_b, or split and
    k transposed: attn_k_b / attn_v_b, one sheet a head), the output projection."""
    e, h, nope, rope, v = s.n_embd, s.n_head, s.qk_nope_dim, s.qk_rope_dim, s.v_head_dim
    out: list[tuple[str, tuple[int, ...]]] = [("attn_norm.weight", (e,))]
    if s.q_lora_rank:
        out += [("attn_q_a.weight", (e, s.q_lora_rank)),
                ("attn_q_a_norm.weight", (s.q_lora_rank,)),
                ("attn_q_b.weight", (s.q_lora_rank, h * (nope + rope)))]
    else:
        out.append(("attn_q.weight", (e, h * (nope + rope))))
    out += [("attn_kv_a_mqa.weight", (e, s.kv_lora_rank + rope)),
            ("attn_kv_a_norm.weight", (s.kv_lora_rank,))]
    if s.mla_legacy:
        out.append(("attn_kv_b.weight", (s.kv_lora_rank, h * (nope + v))))
    else:
        out += [("attn_k_b.weight", (nope, s.kv_lora_rank, h)),
                ("attn_v_b.weight", (s.kv_lora_rank, v, h))]
    return out + [("attn_output.weight", (h * v, e))]


def _attention(s: Shape) -> list[tuple[str, tuple[int, ...]]]:
    if s.mla:
        return _mla_attention(s)
    q, kv = s.n_head * s.hd, s.n_head_kv * s.hd
    if s.arch == "phi3":  # q, k and v as the rows of one matrix
        return [("attn_norm.weight", (s.n_embd,)), ("attn_qkv.weight", (s.n_embd, q + 2 * kv)),
                ("attn_output.weight", (q, s.n_embd))]
    return [
        ("attn_norm.weight", (s.n_embd,)),
        ("attn_q.weight", (s.n_embd, q)),
        ("attn_k.weight", (s.n_embd, kv)),
        ("attn_v.weight", (s.n_embd, kv)),
        ("attn_output.weight", (q, s.n_embd)),
    ]


def _attention_extras(s: Shape) -> list[tuple[str, tuple[int, ...]]]:
    q, kv = s.n_head * s.hd, s.n_head_kv * s.hd
    out: list[tuple[str, tuple[int, ...]]] = []
    if s.arch in ("qwen2", "glm4moe", "gpt-oss"):
        out += [("attn_q.bias", (q,)), ("attn_k.bias", (kv,)), ("attn_v.bias", (kv,))]
    if s.arch == "gpt-oss":
        out += [("attn_output.bias", (s.n_embd,)), ("attn_sinks.weight", (s.n_head,))]
    if s.arch in _QK_NORM_WHOLE:
        out += [("attn_q_norm.weight", (q,)), ("attn_k_norm.weight", (kv,))]
    elif s.arch in _QK_NORM or s.qk_norm:
        out += [("attn_q_norm.weight", (s.hd,)), ("attn_k_norm.weight", (s.hd,))]
    return out


def _ffn(s: Shape, i: int) -> list[tuple[str, tuple[int, ...]]]:
    e = s.n_embd
    norm = "post_attention_norm" if s.arch in _POST_ATTN_FFN_NORM else "ffn_norm"
    out: list[tuple[str, tuple[int, ...]]] = [(f"{norm}.weight", (e,))]
    if s.arch == "phi3":  # gate and up as the two halves of ffn_up's rows
        return out + [("ffn_up.weight", (e, 2 * s.n_ff)), ("ffn_down.weight", (s.n_ff, e))]
    if not s.is_moe_layer(i):
        return out + [("ffn_gate.weight", (e, s.n_ff)), ("ffn_up.weight", (e, s.n_ff)),
                      ("ffn_down.weight", (s.n_ff, e))]
    n, f = s.n_expert, s.n_ff_exp
    out.append(("ffn_gate_inp.weight", (e, n)))  # the router
    if s.arch == "gpt-oss":
        out.append(("ffn_gate_inp.bias", (n,)))
    if (s.arch in ("glm4moe", "minimax-m2", "dots1", "ernie4_5-moe")
            or (s.mla and s.expert_gating == 2)):
        out.append(("exp_probs_b.bias", (n,)))  # selection bias (e_score_correction_bias)
    # the converters stack each projection's experts into one 3-D tensor: down, gate, up
    out += [("ffn_down_exps.weight", (f, e, n)), ("ffn_gate_exps.weight", (e, f, n)),
            ("ffn_up_exps.weight", (e, f, n))]
    if s.arch == "gpt-oss":
        out += [("ffn_down_exps.bias", (e, n)), ("ffn_gate_exps.bias", (f, n)),
                ("ffn_up_exps.bias", (f, n))]
    if s.n_expert_shared:
        sf = f * s.n_expert_shared
        out += [("ffn_gate_shexp.weight", (e, sf)), ("ffn_up_shexp.weight", (e, sf)),
                ("ffn_down_shexp.weight", (sf, e))]
    return out


def llama3_factors(head_dim: int, base: float, factor: float, low: float, high: float,
                   orig_ctx: int) -> list[float]:
    """llama-3.1's RoPE scaling as per-pair frequency factors (rope_freqs.weight), the way the
    converter computes them from the config: pairs whose wavelength is below orig_ctx / high
    keep their frequency (1), those above orig_ctx / low are divided by ``factor``, and those
    between by a factor that moves smoothly from one to the other."""
    out = []
    for i in range(0, head_dim, 2):
        wavelength = 2 * math.pi * base ** (i / head_dim)
        if wavelength < orig_ctx / high:
            out.append(1.0)
        elif wavelength > orig_ctx / low:
            out.append(factor)
        else:
            smooth = (orig_ctx / wavelength - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return out


def tensor_table(s: Shape) -> list[tuple[str, tuple[int, ...]]]:
    """(name, GGUF dims with ne0 first) in the order llama.cpp's converter writes them. A
    NextN layer (glm4moe) is a whole MoE layer plus its own projection and norms."""
    out: list[tuple[str, tuple[int, ...]]] = [("token_embd.weight", (s.n_embd, s.n_vocab))]
    if s.llama3_rope[0]:
        out.append(("rope_freqs.weight", (s.hd // 2,)))
    if s.longrope[0]:
        out += [("rope_factors_long.weight", ((s.rope_dim or s.hd) // 2,)),
                ("rope_factors_short.weight", ((s.rope_dim or s.hd) // 2,))]
    for i in range(s.n_block):
        layer = _attention(s) + _ffn(s, i) + _attention_extras(s)
        if s.arch == "gemma3":
            layer += [("post_attention_norm.weight", (s.n_embd,)),
                      ("post_ffw_norm.weight", (s.n_embd,))]
        if i >= s.n_layer:  # NextN: the optional vocabulary-sized copies are left out
            layer += [("nextn.eh_proj.weight", (2 * s.n_embd, s.n_embd)),
                      ("nextn.enorm.weight", (s.n_embd,)), ("nextn.hnorm.weight", (s.n_embd,)),
                      ("nextn.shared_head_norm.weight", (s.n_embd,))]
        out += [(f"blk.{i}.{n}", d) for n, d in layer]
    out.append(("output_norm.weight", (s.n_embd,)))
    if not s.tied_embeddings:
        out.append(("output.weight", (s.n_embd, s.n_vocab)))
    return out


def _bytes_to_unicode() -> list[str]:
    # GPT-2's byte -> printable character table (the byte-level BPE alphabet)
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return [chr(c) for c in cs]


_MERGES = ["Ġ t", "h e", "i n", "Ġ a", "r e", "o n", "Ġt he", "e r", "Ġ s", "a t", "Ġ w",
           "o u", "e n", "Ġ c", "i s", "Ġ o", "i t", "Ġ b", "e s", "Ġ f"]
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + "
    "message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def vocab(n_vocab: int) -> tuple[list[str], list[int], list[str]]:
    """A small byte-level BPE vocabulary padded to n_vocab: tokens, token types, merges.
    Byte tokens and a few merges make real text encodable; fillers are plain unreachable
    tokens (type NORMAL, so tokenizers do not treat 150k of them as special)."""
    tokens = _bytes_to_unicode() + [m.replace(" ", "") for m in _MERGES]
    n_fill = n_vocab - len(tokens) - len(SPECIALS)
    if n_fill < 0:
        raise ValueError(f"vocabulary of {n_vocab} is smaller than the synthetic base vocabulary")
    tokens += [f"<|synth_{i}|>" for i in range(n_fill)] + SPECIALS
    types = [1] * (n_vocab - len(SPECIALS)) + [3] * len(SPECIALS)  # NORMAL, CONTROL
    return tokens, types, list(_MERGES)


# general.file_type: llama.cpp's llama_ftype for the mix (a single K type is its _S variant)
_FILE_TYPE = {"f32": 0, "f16": 1, "q4_0": 2, "q4_1": 3, "q8_0": 7, "q5_0": 8, "q5_1": 9,
              "q2_k": 10, "q3_k": 11, "q4_k": 14, "q4_k_m": 15, "q5_k": 16, "q5_k_m": 17,
              "q6_k": 18,
              "iq2_xxs": 19, "iq2_xs": 20, "iq3_xxs": 23, "iq1_s": 24, "iq4_nl": 25,
              "iq3_s": 26, "iq2_s": 28, "iq4_xs": 30, "iq1_m": 31, "bf16": 32, "tq1_0": 36,
              "tq2_0": 37, "mxfp4_moe": 38, "q3_k_m": 12, "iq3_m": 27, "iq2_m": 29,
              "iq2_xxs-q8attn": 19, "iq3_s-bumped": 26}


def _deepseek2_metadata(s: Shape) -> list[MetaItem]:
    """The keys llama.cpp's DeepseekV2Model converter adds (the common ones, the YaRN type,
    factor and original context and the expert counts are written with every arch's)."""
    a, nope, rope = s.arch, s.qk_nope_dim, s.qk_rope_dim
    meta: list[MetaItem] = [(f"{a}.leading_dense_block_count", U32, s.n_layer_dense_lead),
                            (f"{a}.vocab_size", U32, s.n_vocab)]
    if s.q_lora_rank:
        meta.append((f"{a}.attention.q_lora_rank", U32, s.q_lora_rank))
    meta.append((f"{a}.attention.kv_lora_rank", U32, s.kv_lora_rank))
    if s.mla_legacy:  # per-head keys and values (the pre-2025 converter)
        meta += [(f"{a}.attention.key_length", U32, nope + rope),
                 (f"{a}.attention.value_length", U32, s.v_head_dim)]
    else:  # one latent "head" (MQA) of kv_lora (+ rope for keys); the per-head sizes as _mla
        meta += [(f"{a}.attention.key_length", U32, s.kv_lora_rank + rope),
                 (f"{a}.attention.value_length", U32, s.kv_lora_rank),
                 (f"{a}.attention.key_length_mla", U32, nope + rope),
                 (f"{a}.attention.value_length_mla", U32, s.v_head_dim)]
    meta += [(f"{a}.expert_shared_count", U32, s.n_expert_shared),
             (f"{a}.expert_weights_scale", F32, s.expert_weights_scale),
             (f"{a}.expert_weights_norm", BOOL, s.expert_weights_norm),
             (f"{a}.expert_gating_func", U32, s.expert_gating)]
    if s.expert_groups[0]:
        meta += [(f"{a}.expert_group_count", U32, s.expert_groups[0]),
                 (f"{a}.expert_group_used_count", U32, s.expert_groups[1])]
    meta.append((f"{a}.rope.dimension_count", U32, rope))
    if s.yarn[0] and s.mscale_all_dim:  # the converter writes mscale_all_dim times 0.1
        meta.append((f"{a}.rope.scaling.yarn_log_multiplier", F32, 0.1 * s.mscale_all_dim))
    return meta


def metadata(s: Shape, mix: str) -> list[MetaItem]:
    a = s.arch
    meta: list[MetaItem] = [
        ("general.architecture", STR, a),
        ("general.type", STR, "model"),
        ("general.name", STR, f"carve synthetic {a} {s.n_layer}L {s.n_embd} {mix}"),
        (f"{a}.block_count", U32, s.n_block),
        (f"{a}.context_length", U32, s.n_ctx),
        (f"{a}.embedding_length", U32, s.n_embd),
        (f"{a}.feed_forward_length", U32, s.n_ff),
        (f"{a}.attention.head_count", U32, s.n_head),
        (f"{a}.attention.head_count_kv", U32, s.n_head_kv),
        (f"{a}.rope.freq_base", F32, s.rope_base),
        (f"{a}.attention.layer_norm_rms_epsilon", F32, s.rms_eps),
    ]
    if s.head_dim or a in _QK_NORM:
        meta += [(f"{a}.attention.key_length", U32, s.hd),
                 (f"{a}.attention.value_length", U32, s.hd)]
    if a == "llama":
        meta.append((f"{a}.vocab_size", U32, s.n_vocab))
        meta.append((f"{a}.rope.dimension_count", U32, s.hd))
    if s.sliding_window:
        meta.append((f"{a}.attention.sliding_window", U32, s.sliding_window))
    if s.rope_dim:
        meta.append((f"{a}.rope.dimension_count", U32, s.rope_dim))
    if s.longrope[0]:  # as the converter writes LongRoPE
        orig = s.longrope[0]
        meta += [(f"{a}.rope.scaling.original_context_length", U32, orig),
                 (f"{a}.rope.scaling.attn_factor", F32,
                  math.sqrt(1 + math.log(s.n_ctx / orig) / math.log(orig)))]
    if s.yarn[0]:
        meta += [(f"{a}.rope.scaling.type", STR, "yarn"),
                 (f"{a}.rope.scaling.factor", F32, s.yarn[0]),
                 (f"{a}.rope.scaling.original_context_length", U32, s.yarn[1])]
    if s.n_expert:
        meta += [(f"{a}.expert_count", U32, s.n_expert),
                 (f"{a}.expert_used_count", U32, s.n_expert_used)]
        if a not in ("llama", "ernie4_5-moe"):
            meta.append((f"{a}.expert_feed_forward_length", U32, s.n_ff_exp))
    if a == "ernie4_5-moe":  # Ernie4_5MoeModel's keys, in its order (moe_layer_interval 1 only)
        meta += [(f"{a}.interleave_moe_layer_step", U32, 1),
                 (f"{a}.leading_dense_block_count", U32, s.n_layer_dense_lead),
                 (f"{a}.expert_feed_forward_length", U32, s.n_ff_exp),
                 (f"{a}.expert_shared_count", U32, s.n_expert_shared)]
        if s.n_expert_shared:  # the converter: intermediate_size // num_key_value_heads, which
            # is the shared experts' width (n_ff_exp * n_shared) in the published models
            meta.append((f"{a}.expert_shared_feed_forward_length", U32,
                         s.n_ff_exp * s.n_expert_shared))
    if a == "glm4moe":  # as llama.cpp's Glm4MoeModel converter writes them
        meta += [(f"{a}.expert_shared_count", U32, s.n_expert_shared),
                 (f"{a}.leading_dense_block_count", U32, s.n_layer_dense_lead),
                 (f"{a}.expert_gating_func", U32, 2),  # sigmoid
                 (f"{a}.expert_weights_scale", F32, s.expert_weights_scale),
                 (f"{a}.expert_weights_norm", BOOL, True),
                 (f"{a}.nextn_predict_layers", U32, s.n_nextn)]
    if a == "deepseek2":
        meta += _deepseek2_metadata(s)
    if a == "minimax-m2":  # TextModel's gating and vocabulary keys (MiniMaxM2Model adds the rest)
        meta += [(f"{a}.expert_gating_func", U32, s.expert_gating),
                 (f"{a}.vocab_size", U32, s.n_vocab)]
    if a == "dots1":  # Dots1Model's keys (over Qwen2MoeModel's), then the vocabulary size
        meta += [(f"{a}.leading_dense_block_count", U32, s.n_layer_dense_lead),
                 (f"{a}.expert_shared_count", U32, s.n_expert_shared),
                 (f"{a}.expert_weights_scale", F32, s.expert_weights_scale),
                 (f"{a}.expert_weights_norm", BOOL, s.expert_weights_norm),
                 (f"{a}.expert_gating_func", U32, s.expert_gating),
                 (f"{a}.vocab_size", U32, s.n_vocab)]
    if mix.lower() in _FILE_TYPE:
        meta.append(("general.file_type", U32, _FILE_TYPE[mix.lower()]))
    tokens, types, merges = vocab(s.n_vocab)
    eos = s.n_vocab - 1  # <|im_end|>
    meta += [
        ("tokenizer.ggml.model", STR, "gpt2"),
        ("tokenizer.ggml.pre", STR, "qwen2" if a.startswith("qwen") or a == "dots1"
         else "deepseek-v3" if a == "deepseek2" else "minimax-m2" if a == "minimax-m2"
         else "llama-bpe"),
        ("tokenizer.ggml.tokens", ARR, (STR, tokens)),
        ("tokenizer.ggml.token_type", ARR, (I32, types)),
        ("tokenizer.ggml.merges", ARR, (STR, merges)),
        ("tokenizer.ggml.bos_token_id", U32, s.n_vocab - 3),
        ("tokenizer.ggml.eos_token_id", U32, eos),
        ("tokenizer.ggml.padding_token_id", U32, s.n_vocab - 3),
        ("tokenizer.ggml.add_bos_token", BOOL, False),
        ("tokenizer.chat_template", STR, CHATML),
        ("general.quantization_version", U32, 2),
    ]
    return meta
