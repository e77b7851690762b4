"""SentencePiece-style vocabularies (GGUF ``tokenizer.ggml.model == "llama"``: llama 2, mistral,
gemma) as a ``tokenizers`` BPE pipeline.

llama.cpp's SPM tokenizer (``llm_tokenizer_spm_session``) starts from single characters and
repeatedly merges the adjacent pair whose concatenation is a vocabulary token with the highest
*score*, leftmost first on ties; what never forms a token falls back to ``<0xNN>`` byte tokens.
That is BPE whose merge ranks are the scores of the merged tokens, so the merge list is derived
here once: every split of every token into two tokens, ranked by the whole token's score.

Spaces become ``▁``. With ``tokenizer.ggml.add_space_prefix`` (llama.cpp's default for this
model type; gemma sets it false) every text fragment — the first, and each one after a special
token — gets a leading ``▁``, so a ``Prepend`` normalizer, which ``tokenizers`` runs per fragment
between added tokens, reproduces it.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from tokenizers import Tokenizer, decoders, models, normalizers

SPACE = "\u2581"  # ▁


def spm_merge_ids(tokens: Sequence[str], scores: Sequence[float]) -> np.ndarray:
    """Every (left, right) token-id pair whose concatenation is a token, best score first.
    Returns int32 ``[n_merges, 2]``."""
    vocab = {tok: i for i, tok in enumerate(tokens)}  # a repeated string: the last id wins
    ranked: list[tuple[float, int, int, int, int]] = []
    for tok, i in vocab.items():
        if len(tok) < 2:
            continue
        score = float(scores[i])
        for cut in range(1, len(tok)):
            left = vocab.get(tok[:cut])
            if left is None:
                continue
            right = vocab.get(tok[cut:])
            if right is not None:
                # different tokens never tie when scores are distinct (they are in the files
                # we know); equal-score splits of one token: the longer left half first
                ranked.append((-score, i, -cut, left, right))
    ranked.sort()
    pairs = np.array([(left, right) for *_, left, right in ranked], dtype=np.int32)
    return pairs.reshape(-1, 2)


def build_spm(
    tokens: Sequence[str], merges: list[tuple[str, str]], unk: str | None, add_space_prefix: bool
) -> Tokenizer:
    """The ``tokenizers`` pipeline without added tokens (the caller adds specials);
    ``merges`` from :func:`spm_merge_ids`, as strings."""
    vocab = {tok: i for i, tok in enumerate(tokens)}
    model = models.BPE(
        vocab,
        merges,
        unk_token=unk,
        fuse_unk=True,
        byte_fallback=True,
    )
    tok = Tokenizer(model)
    steps = [normalizers.Prepend(SPACE)] if add_space_prefix else []
    steps.append(normalizers.Replace(" ", SPACE))
    tok.normalizer = normalizers.Sequence(steps)
    tok.decoder = decoders.Sequence(
        [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
        + ([decoders.Strip(" ", 1, 0)] if add_space_prefix else [])
    )
    return tok


def byte_token_value(text: str) -> int | None:
    """``<0x0A>`` -> 10; anything else -> None."""
    if len(text) == 6 and text.startswith("<0x") and text.endswith(">"):
        try:
            return int(text[3:5], 16)
        except ValueError:
            return None
    return None
