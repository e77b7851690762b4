"""engine/text/tokenizer.py on tiny synthetic vocabularies: the rules that the real models in
test_tokenizer_parity.py do not reach (space prefix, byte fallback, llama.cpp's pre-tokenizer
table, special-token typing, cache reuse, errors)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from engine.text import tokenizer as tokenizer_mod
from engine.text.bpe import PRE, _bytes_to_unicode, build_bpe
from engine.text.spm import spm_merge_ids
from engine.text.tokenizer import CONTROL, NORMAL, USER_DEFINED, Tokenizer
from spec.errors import CarveError

BYTE = 6


@dataclass
class FakeModel:
    metadata: dict[str, Any]
    paths: tuple[Path, ...] = field(default_factory=lambda: (Path("tiny.gguf"),))


@pytest.fixture(autouse=True)
def tmp_cache(tmp_path, monkeypatch) -> Path:
    cache = tmp_path / "tok-cache"
    monkeypatch.setattr(tokenizer_mod, "tokenizer_cache_dir", lambda: cache)
    return cache


def spm_meta(add_space_prefix: bool | None = None, **extra) -> dict[str, Any]:
    """<unk> <s> </s>, 256 byte tokens, then pieces with scores: longer = better."""
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [2, CONTROL, CONTROL] + [BYTE] * 256
    pieces = ["▁", "h", "e", "l", "o", "w", "r", "d", "he", "ll", "hell", "hello", "▁hello",
              "▁w", "▁wor", "▁worl", "or", "wor", "world", "▁world", "<", ">", "x"]  # fmt: skip
    tokens += pieces
    types += [NORMAL] * len(pieces)
    tokens += ["<turn>", "<tag>"]
    types += [CONTROL, USER_DEFINED]
    scores = [0.0] * 259 + [-10.0 + len(p) + i * 1e-3 for i, p in enumerate(pieces)] + [0.0, 0.0]
    meta = {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.scores": scores,
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.unknown_token_id": 0,
    }
    if add_space_prefix is not None:
        meta["tokenizer.ggml.add_space_prefix"] = add_space_prefix
    meta.update(extra)
    return meta


def bpe_meta(pre: str = "qwen2", **extra) -> dict[str, Any]:
    alphabet = [c for _, c in sorted(_bytes_to_unicode().items())]
    merges = ["h e", "l l", "he ll", "hell o", "Ġ w", "o r", "Ġw or", "Ġwor l", "Ġworl d"]
    tokens = alphabet + ["he", "ll", "hell", "hello", "Ġw", "or", "Ġwor", "Ġworl", "Ġworld"]
    types = [NORMAL] * len(tokens)
    tokens += ["<|im_start|>", "<|im_end|>", "<tool>", "<|eot_id|>"]
    types += [CONTROL, CONTROL, USER_DEFINED, NORMAL]  # eot typed normal: llama.cpp overrides
    meta = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": pre,
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.bos_token_id": len(tokens) - 4,
        "tokenizer.ggml.eos_token_id": len(tokens) - 3,
    }
    meta.update(extra)
    return meta


def ids_of(meta: dict[str, Any], *texts: str) -> list[int]:
    return [meta["tokenizer.ggml.tokens"].index(t) for t in texts]


# ---- SentencePiece ----------------------------------------------------------------------


def test_spm_space_prefix_follows_llama_cpp():
    meta = spm_meta()  # no add_space_prefix key: llama.cpp's default for "llama" is true
    tok = Tokenizer.from_model(FakeModel(meta))
    assert tok.add_bos and tok.add_space_prefix
    assert tok.encode("hello world") == [1, *ids_of(meta, "▁hello", "▁world")]
    # every fragment after a special token gets the prefix again
    assert tok.encode("hello<turn>world", add_bos=False) == ids_of(meta, "▁hello", "<turn>", "▁world")
    assert tok.decode(tok.encode("hello world")) == "<s> hello world"
    assert tok.decode(tok.encode("hello world", add_bos=False)) == "hello world"


def test_spm_without_space_prefix_like_gemma():
    meta = spm_meta(add_space_prefix=False)
    tok = Tokenizer.from_model(FakeModel(meta))
    assert tok.encode("hello world", add_bos=False) == ids_of(meta, "hello", "▁world")


def test_spm_byte_fallback_and_stream_decoder():
    meta = spm_meta(add_space_prefix=False)
    tok = Tokenizer.from_model(FakeModel(meta))
    ids = tok.encode("h🦩", add_bos=False)
    byte_ids = [3 + b for b in "🦩".encode()]  # <0xF0> is id 3 + 0xF0
    assert ids == [*ids_of(meta, "h"), *byte_ids]
    dec = tok.stream_decoder()
    assert [dec.push(i) for i in ids] == ["h", "", "", "", "🦩"]
    assert dec.flush() == ""
    assert tok.decode(ids) == "h🦩"


def test_stream_decoder_never_emits_broken_text():
    tok = Tokenizer.from_model(FakeModel(spm_meta(add_space_prefix=False)))
    dec = tok.stream_decoder()
    # a lead byte, then a byte that can never continue it, then an unfinished sequence
    out = [dec.push(3 + b) for b in (0xF0, 0x41, 0xE2, 0x82)]
    assert out == ["", "\ufffdA", "", ""]
    assert dec.flush() == "\ufffd"


def test_spm_merges_follow_scores():
    # "hell"+"o" and "he"+"llo"... only splits whose halves are tokens; best score first
    meta = spm_meta()
    pairs = spm_merge_ids(meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.scores"])
    tokens = meta["tokenizer.ggml.tokens"]
    merged = [tokens[a] + tokens[b] for a, b in pairs]
    scores = [meta["tokenizer.ggml.scores"][tokens.index(m)] for m in merged]
    assert scores == sorted(scores, reverse=True)
    assert ("hell", "o") in [(tokens[a], tokens[b]) for a, b in pairs]


def test_spm_merges_cached_and_rebuilt_when_damaged(tmp_cache, monkeypatch):
    meta = spm_meta()
    Tokenizer.from_model(FakeModel(meta))
    (cached,) = tmp_cache.glob("*.spm-merges.npy")
    calls = []
    real = tokenizer_mod.spm_merge_ids
    monkeypatch.setattr(tokenizer_mod, "spm_merge_ids", lambda *a: calls.append(1) or real(*a))
    Tokenizer.from_model(FakeModel(meta))
    assert calls == []  # reused
    cached.write_bytes(b"not an npy file")
    tok = Tokenizer.from_model(FakeModel(meta))
    assert calls == [1]  # derived again, and correct
    assert tok.encode("hello", add_bos=False) == ids_of(meta, "▁hello")
    np.load(cached)  # and the cache holds a valid file again


def test_cache_key_changes_with_the_vocabulary(tmp_cache):
    Tokenizer.from_model(FakeModel(spm_meta()))
    other = spm_meta()
    other["tokenizer.ggml.scores"] = [s * 2 for s in other["tokenizer.ggml.scores"]]
    Tokenizer.from_model(FakeModel(other))
    assert len(list(tmp_cache.glob("*.spm-merges.npy"))) == 2


# ---- byte-level BPE ---------------------------------------------------------------------


def test_bpe_ids_specials_and_file_rules():
    meta = bpe_meta()
    tok = Tokenizer.from_model(FakeModel(meta))
    assert tok.add_bos is False  # qwen2 pre, no add_bos key: llama.cpp's default
    assert tok.encode("hello world") == ids_of(meta, "hello", "Ġworld")
    start, end, tool = ids_of(meta, "<|im_start|>", "<|im_end|>", "<tool>")
    assert tok.encode("<|im_start|>hello<|im_end|>") == [start, *ids_of(meta, "hello"), end]
    plain = tok.encode("<|im_start|><tool>", parse_special=False)
    assert start not in plain and tool in plain  # user-defined tokens stay whole, as llama.cpp
    assert tok.decode(plain) == "<|im_start|><tool>"


def test_bpe_end_of_turn_tokens_by_text():
    meta = bpe_meta()
    tok = Tokenizer.from_model(FakeModel(meta))
    (eot,) = ids_of(meta, "<|eot_id|>")
    assert tok.eot_ids == {eot, tok.eos_id}
    assert tok.is_control(eot)  # typed normal in the file; llama.cpp forces control
    assert tok.encode("x<|eot_id|>", add_bos=False)[-1] == eot
    assert tok.decode([eot], skip_special=True) == ""


def test_bpe_add_bos_from_file_and_llama3_default():
    assert Tokenizer.from_model(FakeModel(bpe_meta(pre="llama-bpe"))).add_bos is True
    meta = bpe_meta(pre="llama-bpe", **{"tokenizer.ggml.add_bos_token": False})
    tok = Tokenizer.from_model(FakeModel(meta))
    assert tok.add_bos is False
    assert tok.encode("hello", add_bos=True)[0] == tok.bos_id


@pytest.mark.parametrize(
    ("pre", "pieces"),
    [
        ("qwen2", ["Hello", "Ġworld", "1", "2", "3", "4", "ĠĠ", "Ġx"]),
        ("llama-bpe", ["Hello", "Ġworld", "123", "4", "ĠĠ", "Ġx"]),
        ("gpt-2", ["Hello", "Ġworld", "1234", "ĠĠ", "Ġx"]),
        # llama.cpp's "default": punctuation first, then gpt-2, digits, then runs of 3 digits
        ("default", ["Hello", "Ġworld", "123", "4", "ĠĠ", "Ġx"]),
    ],
)
def test_pre_tokenizer_table(pre, pieces):
    hf = build_bpe(["a"], [], PRE[pre])
    text = "Hello world1234   x"
    got = [p for p, _ in hf.pre_tokenizer.pre_tokenize_str(text)]
    assert got == pieces


@pytest.mark.parametrize(
    ("pre", "text", "pieces"),
    [
        # digits in threes, CJK and kana runs alone, a punctuation mark leading a word
        ("deepseek-v3", "DeepSeek-V3 12345 是一个模型。カタカナ!",
         ["DeepSeek", "-V", "3", " ", "123", "45", " ", "是一个模型", "。", "カタカナ", "!"]),
        # DeepSeek LLM: letter runs (with a space before), then punctuation, then its fifth
        # pass's U+0800..U+4E00 range takes the KELVIN SIGN out of " \u212a". Its letter class
        # ends a range at the KELVIN SIGN itself: read as "K" (its canonical twin) that range
        # would run from U+004B and make "_{}" letters, so "a_b{c}" would stay one piece
        ("deepseek-llm", "\u1fbe\u1fbe \u212a a_b{c} 7,8\n\u4e16\u754c",
         ["\u1fbe\u1fbe", " ", "\u212a", " a", "_", "b", "{", "c", "}", " ", "7", ",", "8", "\n",
          "\u4e16\u754c"]),
        ("deepseek-coder", "x1 = foo(2)\n", ["x", "1", " =", " foo", "(", "2", ")", "\n"]),
        # Kimi K2: Han runs alone (a space before one stays its own piece), cased words
        ("kimi-k2", "mixed 中文 and CamelCase I'll 12345",
         ["mixed", " ", "中文", " and", " Camel", "Case", " I'll", " ", "123", "45"]),
    ],
)
def test_deepseek_pre_tokenizers(pre, text, pieces):
    hf = build_bpe(["a"], [], PRE[pre])
    got = [p for p, _ in hf.pre_tokenizer.pre_tokenize_str(text)]
    byte_level = _bytes_to_unicode()
    assert got == ["".join(byte_level[b] for b in p.encode()) for p in pieces]


def test_deepseek_passes_split_as_llama_cpp_reads_them():
    # llama.cpp applies each pass to the pieces the previous one left, keeping matched and
    # unmatched parts: the same passes through the `regex` module agree with ours on mixed text
    import regex
    from tokenizers import Regex, pre_tokenizers

    texts = ["Hello, world! 12345 foo_bar(x)=y;\n\n  indented\tTab",
             "DeepSeek-V3 是一个模型。日本語のテキスト、カタカナ!",
             "def f(a,b):\r\n    return a**2+b//3  # ok?", "Ünïcödé ΑΒΓ δ 𐐀𐐁 9876543210 ½ ٣",
             "   trailing   ", "x.y.z 3.14159 $100 \u1f7d \u1fd3 \u1fdb \u2126 \u212a \u1fbe",
             "mixed 中文 and English, I'll say they're right; CamelCaseIdentifier 你好，世界。"]

    def passes(regexes, text):
        pieces = [text]
        for r in regexes:
            out = []
            for p in pieces:
                pos = 0
                for m in regex.finditer(r, p, flags=regex.V1):  # V1: "&&" intersects classes
                    out += [p[pos:m.start()]] if m.start() > pos else []
                    out += [m.group()] if m.end() > m.start() else []
                    pos = m.end()
                out += [p[pos:]] if pos < len(p) else []
            pieces = out
        return pieces

    for pre in ("deepseek-llm", "deepseek-coder", "deepseek-v3", "kimi-k2"):
        seq = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in PRE[pre].regexes])
        for text in texts:
            assert [p for p, _ in seq.pre_tokenize_str(text)] == passes(PRE[pre].regexes, text)


def test_unknown_pre_is_a_carve_error():
    with pytest.raises(CarveError, match=r"tiny.gguf.*tokenizer.ggml.pre 'mystery'"):
        Tokenizer.from_model(FakeModel(bpe_meta(pre="mystery")))


def test_unsupported_model_and_empty_vocab():
    with pytest.raises(CarveError, match="'bert' is not supported"):
        Tokenizer.from_model(FakeModel({**bpe_meta(), "tokenizer.ggml.model": "bert"}))
    with pytest.raises(CarveError, match="no tokenizer.ggml.tokens"):
        Tokenizer.from_model(FakeModel({**bpe_meta(), "tokenizer.ggml.tokens": []}))


def test_decode_out_of_range_id():
    tok = Tokenizer.from_model(FakeModel(bpe_meta()))
    with pytest.raises(CarveError, match="outside the vocabulary"):
        tok.decode([10**6])


@pytest.mark.parametrize(("meta", "says"), [
    (lambda m: {"tokenizer.ggml.tokens": list(range(len(m["tokenizer.ggml.tokens"])))},
     "tokenizer.ggml.tokens must be an array of strings"),
    (lambda m: {"tokenizer.ggml.merges": [1, 2]}, "tokenizer.ggml.merges must be an array of"),
    (lambda m: {"tokenizer.ggml.token_type": ["x"] * len(m["tokenizer.ggml.tokens"])},
     "tokenizer.ggml.token_type must be an array of whole numbers"),
    # merges naming a piece the vocabulary lacks: the tokenizer library refuses, in a sentence
    (lambda m: {"tokenizer.ggml.merges": ["zz qq", *m["tokenizer.ggml.merges"]]},
     r"the tokenizer cannot be built .*Token `zz` out of vocabulary.*inconsistent"),
    (lambda m: {"tokenizer.ggml.tokens": ["a"] * len(m["tokenizer.ggml.tokens"])},
     "the tokenizer cannot be built"),
])
def test_inconsistent_vocabularies_are_one_sentence(meta, says):
    """Arrays of the wrong type, merges of pieces the vocabulary lacks: once a ValueError,
    TypeError or the library's bare Exception out of the engine's load."""
    base = bpe_meta()
    with pytest.raises(CarveError, match=says) as err:
        Tokenizer.from_model(FakeModel({**base, **meta(base)}))
    assert str(err.value).startswith("tiny.gguf: ") and "\n" not in str(err.value)


def test_spm_scores_must_be_numbers():
    with pytest.raises(CarveError, match="tokenizer.ggml.scores must be an array of numbers"):
        Tokenizer.from_model(FakeModel(spm_meta(**{"tokenizer.ggml.scores": ["high"] * 284})))
