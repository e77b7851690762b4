"""Model shapes for synthetic GGUFs: tensor tables and metadata as llama.cpp's converter writes.

Real shapes (qwen2-0.5b, qwen2-7b, llama3-8b, qwen2-32b, llama-70b) for speed and memory work,
and tiny ones (every matrix row a multiple of 256, so every quant type fits) for tests.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.gguf.writer import ARR, BOOL, F32, I32, STR, U32, MetaItem


@dataclass(frozen=True, slots=True)
class Shape:
    arch: str  # llama | qwen2 | qwen3 | gemma3
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    n_ff: int
    n_vocab: int
    head_dim: int = 0  # 0: n_embd // n_head
    tied_embeddings: bool = False
    n_ctx: int = 32768
    rope_base: float = 1e6
    rms_eps: float = 1e-6
    sliding_window: int = 0  # gemma3: local layers' window

    @property
    def hd(self) -> int:
        return self.head_dim or self.n_embd // self.n_head


SHAPES: dict[str, Shape] = {
    # the demo file's shape: Qwen2.5-0.5B ties its embeddings, but the demo GGUF (and the
    # 463 MiB llama.cpp reference run) carries its own output.weight, so this one does too
    "qwen2-0.5b": Shape("qwen2", 24, 896, 14, 2, 4864, 151936),
    "qwen2-0.5b-tied": Shape("qwen2", 24, 896, 14, 2, 4864, 151936, tied_embeddings=True),
    "qwen2-7b": Shape("qwen2", 28, 3584, 28, 4, 18944, 152064),
    "llama3-8b": Shape("llama", 32, 4096, 32, 8, 14336, 128256, n_ctx=8192, rope_base=5e5,
                       rms_eps=1e-5),
    "qwen2-32b": Shape("qwen2", 64, 5120, 40, 8, 27648, 152064),
    "llama-70b": Shape("llama", 80, 8192, 64, 8, 28672, 128256, n_ctx=8192, rope_base=5e5,
                       rms_eps=1e-5),
    # tiny test shapes: small, but 256-aligned rows so K-types fit every matrix
    "llama-tiny": Shape("llama", 4, 256, 4, 2, 512, 512, n_ctx=2048, rope_base=1e4,
                        rms_eps=1e-5),
    "qwen2-tiny": Shape("qwen2", 4, 256, 4, 2, 512, 512, tied_embeddings=True, n_ctx=2048),
    "qwen3-tiny": Shape("qwen3", 4, 256, 4, 2, 512, 512, head_dim=128, n_ctx=2048),
    "gemma3-tiny": Shape("gemma3", 6, 256, 2, 1, 512, 512, head_dim=128, tied_embeddings=True,
                         n_ctx=2048, sliding_window=64),
}


def tensor_table(s: Shape) -> list[tuple[str, tuple[int, ...]]]:
    """(name, GGUF dims with ne0 first) in the order llama.cpp's converter writes them."""
    q, kv = s.n_head * s.hd, s.n_head_kv * s.hd
    out: list[tuple[str, tuple[int, ...]]] = [("token_embd.weight", (s.n_embd, s.n_vocab))]
    for i in range(s.n_layer):
        b = f"blk.{i}."
        layer = [
            ("attn_norm.weight", (s.n_embd,)),
            ("attn_q.weight", (s.n_embd, q)),
            ("attn_k.weight", (s.n_embd, kv)),
            ("attn_v.weight", (s.n_embd, kv)),
            ("attn_output.weight", (q, s.n_embd)),
            ("ffn_norm.weight", (s.n_embd,)),
            ("ffn_gate.weight", (s.n_embd, s.n_ff)),
            ("ffn_up.weight", (s.n_embd, s.n_ff)),
            ("ffn_down.weight", (s.n_ff, s.n_embd)),
        ]
        if s.arch == "qwen2":
            layer += [("attn_q.bias", (q,)), ("attn_k.bias", (kv,)), ("attn_v.bias", (kv,))]
        if s.arch in ("qwen3", "gemma3"):
            layer += [("attn_q_norm.weight", (s.hd,)), ("attn_k_norm.weight", (s.hd,))]
        if s.arch == "gemma3":
            layer += [("post_attention_norm.weight", (s.n_embd,)),
                      ("post_ffw_norm.weight", (s.n_embd,))]
        out += [(b + n, d) for n, d in layer]
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
              "q2_k": 10, "q3_k": 11, "q4_k": 14, "q4_k_m": 15, "q5_k": 16, "q6_k": 18,
              "iq2_xxs": 19, "iq2_xs": 20, "iq3_xxs": 23, "iq1_s": 24, "iq4_nl": 25,
              "iq3_s": 26, "iq2_s": 28, "iq4_xs": 30, "iq1_m": 31, "bf16": 32, "tq1_0": 36,
              "tq2_0": 37}


def metadata(s: Shape, mix: str) -> list[MetaItem]:
    a = s.arch
    meta: list[MetaItem] = [
        ("general.architecture", STR, a),
        ("general.type", STR, "model"),
        ("general.name", STR, f"carve synthetic {a} {s.n_layer}L {s.n_embd} {mix}"),
        (f"{a}.block_count", U32, s.n_layer),
        (f"{a}.context_length", U32, s.n_ctx),
        (f"{a}.embedding_length", U32, s.n_embd),
        (f"{a}.feed_forward_length", U32, s.n_ff),
        (f"{a}.attention.head_count", U32, s.n_head),
        (f"{a}.attention.head_count_kv", U32, s.n_head_kv),
        (f"{a}.rope.freq_base", F32, s.rope_base),
        (f"{a}.attention.layer_norm_rms_epsilon", F32, s.rms_eps),
    ]
    if s.head_dim or a in ("qwen3", "gemma3"):
        meta += [(f"{a}.attention.key_length", U32, s.hd),
                 (f"{a}.attention.value_length", U32, s.hd)]
    if a == "llama":
        meta.append((f"{a}.vocab_size", U32, s.n_vocab))
        meta.append((f"{a}.rope.dimension_count", U32, s.hd))
    if s.sliding_window:
        meta.append((f"{a}.attention.sliding_window", U32, s.sliding_window))
    if mix.lower() in _FILE_TYPE:
        meta.append(("general.file_type", U32, _FILE_TYPE[mix.lower()]))
    tokens, types, merges = vocab(s.n_vocab)
    eos = s.n_vocab - 1  # <|im_end|>
    meta += [
        ("tokenizer.ggml.model", STR, "gpt2"),
        ("tokenizer.ggml.pre", STR, "qwen2" if a.startswith("qwen") else "llama-bpe"),
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
