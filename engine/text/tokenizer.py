"""The model's own tokenizer, rebuilt from GGUF metadata on the ``tokenizers`` library.

Behaviour follows llama.cpp (``src/llama-vocab.cpp``), the program these files are made for:
special tokens are cut out of the text before anything else (control tokens only when
``parse_special``; user-defined tokens always), add-BOS/EOS come from the file with llama.cpp's
per-tokenizer defaults, and end-of-generation ids are the EOS, EOT and EOM ids plus the
end-of-turn tokens llama.cpp recognises by their text.

What is slow to build is cached under ``<cache>/carve/tokenizers/`` by a content hash of every
metadata value the pipeline depends on, so an edited file never reuses a stale entry. That is
only the SentencePiece merge list (derived from the scores, seconds in Python). Byte-level BPE
takes its merges straight from the file: building it from the metadata (0.3 s for Qwen's 151k
merges on the 2-core CI machine) is faster than ``tokenizers`` reading its own saved JSON
(0.5-0.7 s), so a cached JSON would only slow the second open down.
"""

from __future__ import annotations

import codecs
import hashlib
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np
from tokenizers import AddedToken
from tokenizers import Tokenizer as HFTokenizer

from engine.gguf.demo import cache_dir
from engine.text.bpe import build_bpe, pre_tokenizer_for
from engine.text.bpe import piece_bytes as bpe_piece_bytes
from engine.text.spm import SPACE, build_spm, byte_token_value, spm_merge_ids
from spec.errors import CarveError

# Bump when the way a pipeline is built changes: old cache entries then stop matching.
BUILD_VERSION = "carve-tokenizer-1"

# GGUF token types (gguf.TokenType)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

# Texts llama.cpp treats as end of generation whatever the file says (llama-vocab.cpp).
EOG_TEXTS = frozenset(
    {
        "<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|eom_id|>",
        "<EOT>", "_<EOT>", "<|end_of_text|>", "<end_of_utterance>",
        # FIM pad / repo / file-separator tokens also end generation there.
        "<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "<|fim_repo|>", "<|repo_name|>",
        "<fim-repo>", "<REPO>", "<reponame>", "<|file_sep|>",
    }
)  # fmt: skip


class _HasMetadata(Protocol):
    metadata: dict[str, Any]
    paths: tuple[Path, ...]


def tokenizer_cache_dir() -> Path:
    return cache_dir() / "tokenizers"


class Tokenizer:
    """Encode/decode exactly as the model's authors (and llama.cpp) do."""

    def __init__(self, hf: HFTokenizer, meta: dict[str, Any], where: str) -> None:
        self._hf = hf
        self._where = where
        self.vocab_type = "bpe" if meta["tokenizer.ggml.model"] == "gpt2" else "spm"
        self._tokens: Sequence[str] = meta["tokenizer.ggml.tokens"]
        self._types = _token_types(meta)
        self.n_vocab = len(self._tokens)
        self.add_space_prefix = self.vocab_type == "spm" and bool(
            meta.get("tokenizer.ggml.add_space_prefix", True)
        )
        if self.vocab_type == "bpe":
            default_bos = pre_tokenizer_for(_pre(meta), where).add_bos
        else:
            default_bos = True
        self.add_bos: bool = bool(meta.get("tokenizer.ggml.add_bos_token", default_bos))
        self.add_eos: bool = bool(meta.get("tokenizer.ggml.add_eos_token", False))
        default_bos_id, default_eos_id = (11, 11) if self.vocab_type == "bpe" else (1, 2)
        self.bos_id: int | None = _id(meta, "bos_token_id", self.n_vocab, default_bos_id)
        self.eos_id: int | None = _id(meta, "eos_token_id", self.n_vocab, default_eos_id)
        self.pad_id: int | None = _id(meta, "padding_token_id", self.n_vocab, None)
        self.eot_ids: set[int] = _eog_ids(meta, self._tokens, self.n_vocab, self.eos_id)
        for i in self.eot_ids:  # llama.cpp forces end-of-turn tokens to control type
            self._types[i] = CONTROL
        if self.add_bos and self.bos_id is None:
            raise CarveError(f"{where}: the file asks for a BOS token but has no bos_token_id")
        self._pieces: dict[tuple[int, bool], bytes] = {}

    # ---- construction -------------------------------------------------------------------

    @classmethod
    def from_model(cls, model: _HasMetadata) -> Tokenizer:
        """Build (or load from the cache) the tokenizer of an opened GGUF."""
        meta = model.metadata
        where = model.paths[0].name if model.paths else "model"
        kind = meta.get("tokenizer.ggml.model")
        if kind not in ("gpt2", "llama"):
            raise CarveError(
                f"{where}: tokenizer.ggml.model '{kind}' is not supported (Carve reads 'gpt2' "
                "byte-level BPE and 'llama' SentencePiece vocabularies)"
            )
        if not meta.get("tokenizer.ggml.tokens"):
            raise CarveError(f"{where}: the file has no tokenizer.ggml.tokens; it cannot be chatted with")
        if kind == "gpt2":
            pre_tokenizer_for(_pre(meta), where)  # unknown pre: fail before any work
            if not meta.get("tokenizer.ggml.merges"):
                raise CarveError(f"{where}: a 'gpt2' tokenizer without tokenizer.ggml.merges")
        _check_arrays(meta, where)
        try:
            hf = _build(meta, where)
        except CarveError:
            raise
        except Exception as err:  # noqa: BLE001 - the tokenizer library's own refusal
            reason = " ".join(str(err).split())
            raise CarveError(f"{where}: the tokenizer cannot be built from the file's "
                             f"vocabulary ({reason}); the file is inconsistent") from None
        return cls(hf, meta, where)

    # ---- encoding -----------------------------------------------------------------------

    def encode(self, text: str, add_bos: bool | None = None, parse_special: bool = True) -> list[int]:
        """Token ids of ``text``. ``add_bos=None`` follows the file (and its add-EOS rule);
        ``False`` adds neither BOS nor EOS, like llama.cpp's ``add_special=false``."""
        add_special = add_bos is not False
        bos = self.add_bos if add_bos is None else add_bos
        # encode_special_tokens=True makes control tokens plain text; user-defined tokens are
        # added as non-special and stay whole, as llama.cpp keeps them.
        self._hf.encode_special_tokens = not parse_special
        try:
            ids = self._hf.encode(text, add_special_tokens=False).ids
        finally:
            self._hf.encode_special_tokens = False
        if bos:
            if self.bos_id is None:
                raise CarveError(f"{self._where}: no BOS token in this vocabulary")
            ids.insert(0, self.bos_id)
        if add_special and self.add_eos and self.eos_id is not None:
            ids.append(self.eos_id)
        return ids

    # ---- decoding -----------------------------------------------------------------------

    def piece(self, token_id: int, special: bool = True) -> bytes:
        """The bytes one token stands for (llama.cpp ``token_to_piece``). Control tokens render
        their text only when ``special``; unused tokens render nothing."""
        key = (token_id, special)
        cached = self._pieces.get(key)
        if cached is not None:
            return cached
        if not 0 <= token_id < self.n_vocab:
            raise CarveError(f"token id {token_id} is outside the vocabulary (0..{self.n_vocab - 1})")
        text = self._tokens[token_id]
        kind = int(self._types[token_id])
        if kind in (CONTROL, UNKNOWN):
            out = text.encode("utf-8") if special else b""
        elif self.vocab_type == "bpe":
            if kind == USER_DEFINED:
                out = text.encode("utf-8")
            elif kind == NORMAL:
                out = bpe_piece_bytes(text)
            else:
                out = b""
        else:
            value = byte_token_value(text) if kind == BYTE else None
            if value is not None:
                out = bytes([value])
            elif kind in (NORMAL, USER_DEFINED):
                out = text.replace(SPACE, " ").encode("utf-8")
            else:
                out = b""
        self._pieces[key] = out
        return out

    def decode(self, ids: Iterable[int], skip_special: bool = False) -> str:
        """Text of ``ids``; bytes that are not valid UTF-8 become U+FFFD."""
        ids = list(ids)
        data = b"".join(self.piece(i, not skip_special) for i in ids)
        if self.add_space_prefix and ids and data.startswith(b" "):
            # the space the encoder prepended (llama.cpp detokenize / HF Strip decoder)
            data = data[1:]
        return data.decode("utf-8", errors="replace")

    def stream_decoder(self, skip_special: bool = False) -> StreamDecoder:
        return StreamDecoder(self, skip_special)

    def token_text(self, token_id: int) -> str:
        """The vocabulary string of one token (``Ġhello``, ``▁hello``, ``<|im_end|>``)."""
        return self._tokens[token_id]

    def is_control(self, token_id: int) -> bool:
        return int(self._types[token_id]) in (CONTROL, UNKNOWN)


class StreamDecoder:
    """Turns generated ids into text as they come. ``push`` returns only whole characters: the
    first bytes of a character split across tokens (an emoji in two byte tokens) are held until
    the rest arrives; bytes that can never form a character come out as U+FFFD."""

    def __init__(self, tokenizer: Tokenizer, skip_special: bool = False) -> None:
        self._tok = tokenizer
        self._special = not skip_special
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        return self._utf8.decode(self._tok.piece(token_id, self._special))

    def flush(self) -> str:
        """What is still held at the end of a stream (an unfinished character -> U+FFFD)."""
        return self._utf8.decode(b"", final=True)


# ---- metadata helpers ----------------------------------------------------------------------


_ARRAYS = (("tokens", str, "strings"), ("merges", str, "strings"),
           ("token_type", int, "whole numbers"), ("scores", (int, float), "numbers"))


def _check_arrays(meta: dict[str, Any], where: str) -> None:
    """The vocabulary arrays hold what their keys say (a GGUF array may hold any one type)."""
    for key, kind, what in _ARRAYS:
        values = meta.get(f"tokenizer.ggml.{key}")
        if values is None:
            continue
        if not isinstance(values, (list, tuple)) or any(
                not isinstance(v, kind) or isinstance(v, bool) for v in values):
            raise CarveError(f"{where}: tokenizer.ggml.{key} must be an array of {what}; "
                             "the file is inconsistent")


def _pre(meta: dict[str, Any]) -> str:
    return str(meta.get("tokenizer.ggml.pre") or "default")


def _token_types(meta: dict[str, Any]) -> np.ndarray:
    n = len(meta["tokenizer.ggml.tokens"])
    types = meta.get("tokenizer.ggml.token_type")
    if types is None or len(types) != n:
        return np.full(n, NORMAL, dtype=np.int32)
    return np.array(types, dtype=np.int32)


def _id(meta: dict[str, Any], key: str, n_vocab: int, default: int | None) -> int | None:
    value = meta.get(f"tokenizer.ggml.{key}")
    if value is None or not 0 <= int(value) < n_vocab:
        return default if default is not None and default < n_vocab else None
    return int(value)


def _eog_ids(meta: dict[str, Any], tokens: Sequence[str], n: int, eos: int | None) -> set[int]:
    ids = {i for i, text in enumerate(tokens) if text in EOG_TEXTS}
    for key in ("eot_token_id", "eom_token_id"):
        value = _id(meta, key, n, None)
        if value is not None:
            ids.add(value)
    if eos is not None:
        ids.add(eos)
    return ids


def content_hash(meta: dict[str, Any]) -> str:
    """sha256 over every metadata value the built pipeline depends on."""
    h = hashlib.sha256(BUILD_VERSION.encode())
    kind = str(meta.get("tokenizer.ggml.model"))
    tokens = meta["tokenizer.ggml.tokens"]
    h.update(f"\0{kind}\0{_pre(meta)}\0{len(tokens)}\0".encode())
    h.update(str(bool(meta.get("tokenizer.ggml.add_space_prefix", True))).encode())
    h.update("\0".join(tokens).encode("utf-8", "surrogatepass"))
    h.update(_token_types(meta).tobytes())
    if kind == "gpt2":
        merges = meta.get("tokenizer.ggml.merges") or []
        h.update(f"\0{len(merges)}\0".encode())
        h.update("\0".join(merges).encode("utf-8", "surrogatepass"))
    else:
        scores = meta.get("tokenizer.ggml.scores")
        if scores is not None:
            h.update(np.asarray(scores, dtype=np.float32).tobytes())
        h.update(str(meta.get("tokenizer.ggml.unknown_token_id")).encode())
    return h.hexdigest()[:32]


def _build(meta: dict[str, Any], where: str) -> HFTokenizer:
    tokens = meta["tokenizer.ggml.tokens"]
    types = _token_types(meta)
    for i, text in enumerate(tokens):
        if text in EOG_TEXTS:
            types[i] = CONTROL
    if meta["tokenizer.ggml.model"] == "gpt2":
        hf = build_bpe(tokens, meta["tokenizer.ggml.merges"], pre_tokenizer_for(_pre(meta), where))
    else:
        unk_id = _id(meta, "unknown_token_id", len(tokens), 0)
        unk = tokens[unk_id] if unk_id is not None else None
        add_prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
        hf = build_spm(tokens, _cached_spm_merges(meta), unk, add_prefix)
    # llama.cpp cuts out control, unknown and user-defined tokens before the tokenizer proper.
    user = [AddedToken(tokens[i], special=False, normalized=False)
            for i in np.flatnonzero(types == USER_DEFINED)]  # fmt: skip
    special = [AddedToken(tokens[i], special=True, normalized=False)
               for i in np.flatnonzero((types == CONTROL) | (types == UNKNOWN))]  # fmt: skip
    hf.add_tokens(user)
    hf.add_special_tokens(special)
    return hf


def _cached_spm_merges(meta: dict[str, Any]) -> list[tuple[str, str]]:
    """The SentencePiece merge list, from the cache (token-id pairs, .npy) or derived and stored."""
    tokens = meta["tokenizer.ggml.tokens"]
    path = tokenizer_cache_dir() / f"{content_hash(meta)}.spm-merges.npy"
    pairs = None
    if path.is_file():
        try:
            pairs = np.load(path, allow_pickle=False)
            if pairs.ndim != 2 or pairs.shape[1] != 2 or pairs.size and pairs.max() >= len(tokens):
                pairs = None
        except (OSError, ValueError):  # truncated or foreign: derive again
            pairs = None
    if pairs is None:
        scores = meta.get("tokenizer.ggml.scores")
        if scores is None or len(scores) != len(tokens):
            scores = [0.0] * len(tokens)
        pairs = spm_merge_ids(tokens, scores)
        _save_atomically(path, pairs)
    left, right = pairs[:, 0].tolist(), pairs[:, 1].tolist()
    return [(tokens[a], tokens[b]) for a, b in zip(left, right)]


def _save_atomically(path: Path, pairs: np.ndarray) -> None:
    """Best effort: a read-only cache costs the next open time, not correctness."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.partial")
        with tmp.open("wb") as f:
            np.save(f, pairs, allow_pickle=False)
        os.replace(tmp, path)
    except OSError:
        pass

