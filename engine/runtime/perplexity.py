"""Perplexity the way llama.cpp's `llama-perplexity` computes it (tools/perplexity, the default
non-overlapping mode), so the figures compare with llama.cpp's:

- the text is tokenized with BOS when the model's vocabulary adds one;
- it is cut into ``n_chunk = len(tokens) // n_ctx`` windows of exactly ``n_ctx`` tokens (the
  tail is dropped), each evaluated from an empty cache;
- when the model adds BOS, each window's first token is replaced by BOS for the evaluation;
- only the second half of each window is scored: logits at positions n_ctx/2 .. n_ctx-2
  predict tokens n_ctx/2+1 .. n_ctx-1, so every scored token has at least n_ctx/2 of context;
- PPL = exp(mean NLL); the ± is ppl * sqrt(var(NLL) / (count - 1)).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from spec.errors import CarveError


@dataclass(frozen=True, slots=True)
class PerplexityResult:
    value: float  # final estimate
    stderr: float  # ± as llama.cpp prints it
    chunks: int
    scored: int  # tokens scored
    running: tuple[float, ...]  # the estimate after each chunk, as llama.cpp prints them


def perplexity(
    session: Any,
    tokens: list[int],
    n_ctx: int,
    bos_id: int | None,
    on_chunk: Callable[[int, int, float, float], None] | None = None,
) -> PerplexityResult:
    """Perplexity of ``tokens`` (already tokenized, with BOS if the model adds it) in windows of
    ``n_ctx``. ``bos_id``: the BOS id when the model adds BOS, else None. ``on_chunk(i, n,
    running_ppl, running_stderr)`` after each window (it may raise to stop)."""
    if n_ctx < 4 or n_ctx % 2:
        raise CarveError(f"--ctx: perplexity needs an even context of at least 4 tokens, got {n_ctx}")
    if n_ctx > session.plan.ctx:
        raise CarveError(
            f"--ctx: {n_ctx} is larger than the loaded context {session.plan.ctx}; load with "
            f"--ctx {n_ctx} or more"
        )
    if len(tokens) < 2 * n_ctx:
        raise CarveError(
            f"the text is {len(tokens)} tokens; perplexity at --ctx {n_ctx} needs at least "
            f"{2 * n_ctx} (use a longer text or a smaller --ctx)"
        )
    n_chunk = len(tokens) // n_ctx
    first = n_ctx // 2
    nll = nll2 = 0.0
    count = 0
    running = []
    for i in range(n_chunk):
        window = list(tokens[i * n_ctx : (i + 1) * n_ctx])
        if bos_id is not None:
            window[0] = bos_id
        logits = session.logits(window)  # [n_ctx, n_vocab] float32
        lp = torch.log_softmax(logits[first : n_ctx - 1].double(), dim=-1)
        target = torch.tensor(tokens[i * n_ctx + first + 1 : (i + 1) * n_ctx])
        v = -lp.gather(1, target.unsqueeze(1)).squeeze(1)
        nll += float(v.sum())
        nll2 += float((v * v).sum())
        count += v.numel()
        ppl, err = _estimate(nll, nll2, count)
        running.append(ppl)
        if on_chunk is not None:
            on_chunk(i + 1, n_chunk, ppl, err)
    ppl, err = _estimate(nll, nll2, count)
    return PerplexityResult(ppl, err, n_chunk, count, tuple(running))


def _estimate(nll: float, nll2: float, count: int) -> tuple[float, float]:
    """exp(mean NLL) and llama-perplexity's ± from the running sums."""
    mean = nll / count
    ppl = math.exp(mean)
    var = nll2 / count - mean * mean
    return ppl, ppl * math.sqrt(var / (count - 1)) if var > 0 and count > 1 else 0.0


def main(argv: list[str] | None = None) -> int:
    """`python -m engine.runtime.perplexity MODEL FILE --ctx N`: load MODEL for the CPU and print
    the running and final estimate, as llama-perplexity does."""
    import argparse
    import sys
    from pathlib import Path

    from engine.gguf.hparams import HParams
    from engine.gguf.reader import GGUFModel
    from engine.hardware.devices import cpu_spec
    from engine.planning.plan import Plan
    from engine.runtime.session import Session
    from engine.text.tokenizer import Tokenizer

    p = argparse.ArgumentParser(prog="python -m engine.runtime.perplexity")
    p.add_argument("model")
    p.add_argument("file")
    p.add_argument("--ctx", type=int, default=512)
    a = p.parse_args(argv)
    try:
        try:
            text = Path(a.file).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise CarveError(f"{a.file}: cannot read it as UTF-8 text ({exc})") from None
        model = GGUFModel.open(a.model)
        tok = Tokenizer.from_model(model)
        tokens = tok.encode(text, parse_special=False)  # llama-perplexity: specials as text
        n = HParams.from_model(model).n_layer_run
        chunk = min(a.ctx, 512)
        plan = Plan(model=a.model, devices=(cpu_spec(),), split=(0, n), ctx=a.ctx,
                    prefill_chunk=chunk, cache_reserve=0, logits_rows=chunk)
        sess = Session.load(plan)
        with torch.inference_mode():
            r = perplexity(sess, tokens, a.ctx, tok.bos_id if tok.add_bos else None,
                           lambda i, n, v, _: print(f"[{i}/{n}] {v:.4f}", flush=True))
    except CarveError as exc:
        print(f"perplexity: {exc}", file=sys.stderr)
        return 2
    print(f"Final estimate: PPL = {r.value:.4f} +/- {r.stderr:.5f} "
          f"({len(tokens)} tokens, {r.chunks} chunks of {a.ctx}, {r.scored} scored)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
