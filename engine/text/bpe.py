"""Byte-level BPE (GGUF ``tokenizer.ggml.model == "gpt2"``) as a ``tokenizers`` pipeline.

The pre-tokenizer is chosen by ``tokenizer.ggml.pre`` exactly as llama.cpp chooses it
(``src/llama-vocab.cpp``, ``llm_tokenizer_bpe``): a list of regexes, each splitting the pieces the
previous one left, matched and unmatched parts both kept. ``Split(behavior="isolated")`` in
sequence has the same semantics, then ``ByteLevel`` maps bytes to the GPT-2 alphabet.
"""

from __future__ import annotations

from collections.abc import Sequence

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

from spec.errors import CarveError

_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
# llama.cpp spells (?i:'s|...) out as character classes; the meaning is the same.
_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_LLAMA3 = (
    _CONTRACTIONS
    + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = (
    _CONTRACTIONS
    + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# DeepSeek's tokenizers (llama.cpp: LLAMA_VOCAB_PRE_TYPE_DEEPSEEK_LLM / _CODER / DEEPSEEK3_LLM),
# each a sequence of passes: the V2 chat models ("deepseek-llm"), the coder models
# ("deepseek-coder"), V2.5/V3/R1 ("deepseek-v3"). The Greek and letterlike symbols written as
# escapes are ones Unicode normalisation would change (U+1F7D, U+1FBE, U+1FD3, U+1FDB, OHM SIGN,
# KELVIN SIGN): the class means those code points, not their canonical equivalents
_DEEPSEEK_LLM = (
    r"[\r\n]",
    r"\s?[A-Za-zµÀ-ÖØ-öø-ƺƼ-ƿǄ-ʓʕ-ʯͰ-ͳͶͷͻ-ͽͿΆΈ-ΊΌΎ-ΡΣ-ϵϷ-ҁҊ-ԯԱ-ՖႠ-ჅᎠ-Ᏽᏸ-ᏽᲐ-ᲺᲽ-Ჿᴀ-ᴫᵫ-ᵷᵹ-ᶚḀ-ἕἘ-Ἕἠ-ὅὈ-Ὅὐ-ὗὙὛὝὟ-" "\u1f7d"
    r"ᾀ-ᾴᾶ-ᾼ" "\u1fbe" r"ῂ-ῄῆ-ῌῐ-" "\u1fd3" r"ῖ-" "\u1fdb"
    r"ῠ-Ῥῲ-ῴῶ-ῼℂℇℊ-ℓℕℙ-ℝℤ" "\u2126" r"ℨ" "\u212a"
    r"-ℭℯ-ℴℹℼ-ℿⅅ-ⅉⅎↃↄⰀ-ⱻⱾ-ⳤⳫ-ⳮⳲⳳꙀ-ꙭꚀ-ꚛꜢ-ꝯꝱ-ꞇꞋ-ꞎꭰ-ꮿﬀ-ﬆﬓ-ﬗＡ-Ｚａ-ｚ"
    "\U00010400-\U0001044f𐒰-𐓓𐓘-𐓻𐲀-𐲲𐳀-𐳲𑢠-𑣟𞤀-𞥃]+",
    r"\s?[!-/:-~！-／：-～‘-‟　-。]+",
    r"\s+$",
    r"[一-龥ࠀ-一가-퟿]+",
    r"\p{N}+",
)
_DEEPSEEK_CODER = (r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", r"[一-龥ࠀ-一가-퟿]+", r"\p{N}")
_DEEPSEEK_V3 = (
    r"\p{N}{1,3}",
    r"[一-龥぀-ゟ゠-ヿ]+",
    r"""[!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"""
    r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
)
# Kimi K2 (its tokenization_kimi.py pattern, which llama.cpp's "kimi-k2" reproduces): Han runs
# on their own, and letters of other scripts as gpt-4o's cased words ("&&": class intersection)
_KIMI_WORD = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]"
_KIMI_LOWER = r"[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]"
_KIMI_K2 = (
    r"[\p{Han}]+"
    rf"|[^\r\n\p{{L}}\p{{N}}]?{_KIMI_WORD}*{_KIMI_LOWER}+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    rf"|[^\r\n\p{{L}}\p{{N}}]?{_KIMI_WORD}+{_KIMI_LOWER}*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# llama.cpp's fallback for "default" (and a missing pre): four passes, oddly, but that is what
# a "default" file gets there, so it is what it gets here.
_DEFAULT = (r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]")


class PreTok:
    """What a ``tokenizer.ggml.pre`` value means: regex passes and llama.cpp's per-pre flags."""

    def __init__(self, regexes: Sequence[str], ignore_merges: bool = False, add_bos: bool = False):
        self.regexes = tuple(regexes)
        self.ignore_merges = ignore_merges
        self.add_bos = add_bos  # default when the file has no tokenizer.ggml.add_bos_token


_LLAMA3_PRE = PreTok([_LLAMA3], ignore_merges=True, add_bos=True)
PRE: dict[str, PreTok] = {
    "default": PreTok(_DEFAULT),
    **{name: PreTok([_GPT2]) for name in ("gpt-2", "phi-2", "mpt", "olmo", "jais", "trillion")},
    **{
        name: _LLAMA3_PRE
        for name in ("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral")
    },
    "dbrx": PreTok([_LLAMA3]),
    "smaug-bpe": PreTok([_LLAMA3]),
    **{
        name: PreTok([_QWEN2])
        for name in ("qwen2", "deepseek-r1-qwen", "megrez", "stablelm2", "hunyuan")
    },
    **{
        name: PreTok([r"\p{N}", _GPT2])
        for name in ("starcoder", "refact", "command-r", "smollm", "codeshell", "exaone")
    },
    "falcon": PreTok([r"[\p{P}\$\+<=>\^~\|`]+", _GPT2, r"[0-9][0-9][0-9]"]),
    "chatglm-bpe": PreTok([_LLAMA3]),
    "glm4": PreTok([_LLAMA3]),
    "gpt-4o": PreTok([_GPT4O]),
    "minimax-m2": PreTok([_GPT4O]),  # llama.cpp reads MiniMax-M2's as gpt-4o's
    "llama4": PreTok([_GPT4O]),
    "tekken": PreTok([_TEKKEN], ignore_merges=True, add_bos=True),
    "deepseek-llm": PreTok(_DEEPSEEK_LLM),
    "deepseek-coder": PreTok(_DEEPSEEK_CODER),
    "deepseek-v3": PreTok(_DEEPSEEK_V3),
    "kimi-k2": PreTok([_KIMI_K2]),
}


def pre_tokenizer_for(pre: str, where: str) -> PreTok:
    try:
        return PRE[pre or "default"]
    except KeyError:
        raise CarveError(
            f"{where}: tokenizer.ggml.pre '{pre}' is not a pre-tokenizer Carve knows "
            f"(known: {', '.join(sorted(PRE))}); convert the model with a supported tokenizer"
        ) from None


def build_bpe(tokens: Sequence[str], merges: Sequence[str], pre: PreTok) -> Tokenizer:
    """The ``tokenizers`` pipeline without added tokens (the caller adds specials)."""
    vocab = {tok: i for i, tok in enumerate(tokens)}  # a repeated string: the last id wins, as in llama.cpp
    pairs = []
    for merge in merges:
        # llama.cpp splits at the first space after position 0: "Ġ Ġ" -> ("Ġ", "Ġ")
        pos = merge.find(" ", 1)
        if pos > 0:
            pairs.append((merge[:pos], merge[pos + 1 :]))
    model = models.BPE(vocab, pairs, ignore_merges=pre.ignore_merges)
    tok = Tokenizer(model)
    passes = [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in pre.regexes]
    passes.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence(passes)
    tok.decoder = decoders.ByteLevel()
    return tok


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    printable += range(ord("®"), ord("ÿ") + 1)
    table = {b: chr(b) for b in printable}
    n = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + n)
            n += 1
    return table


UNICODE_TO_BYTE: dict[str, int] = {c: b for b, c in _bytes_to_unicode().items()}


def piece_bytes(text: str) -> bytes:
    """A normal BPE token's bytes. A character outside the byte alphabet (a broken vocab) is kept
    as its own UTF-8 rather than dropped."""
    out = bytearray()
    for ch in text:
        b = UNICODE_TO_BYTE.get(ch)
        if b is None:
            out += ch.encode("utf-8")
        else:
            out.append(b)
    return bytes(out)
