"""What every loaded session does the same way on top of its own ``forward``: prefill in chunks
of the priced size, the NaN hunt that names a layer, logits from a fresh cache, generation,
rewinding the cache. `Session` (torch op table) and `GpuSession` (Triton runner) differ only in
how one chunk runs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from engine.runtime.generate import GenerationStats, generate
from engine.runtime.models.layers import NonFinite
from spec.errors import CarveError


class ChunkedSession:
    """Needs ``plan``, ``kv`` (n_past, reset, can_rewind_to), ``tokens`` and
    ``forward(ids, pos0, rows, check) -> float32 logits | None``; a checked forward raises
    `engine.runtime.models.layers.NonFinite` at the first layer whose output is not finite."""

    plan: Any
    kv: Any
    tokens: list[int]

    def forward(self, ids: list[int], pos0: int, rows: str = "last",
                check: bool = False) -> torch.Tensor | None:
        raise NotImplementedError

    def _check_context(self, n: int) -> None:
        if n > self.plan.ctx:
            raise CarveError(
                f"the prompt is {n} tokens but the context is {self.plan.ctx}; raise --ctx or "
                f"shorten the prompt (older turns can be dropped)"
            )

    def prefill(self, ids: list[int], all_rows: bool) -> torch.Tensor:
        """Append ``ids`` to the cache in chunks of plan.prefill_chunk; logits of every row or of
        the last row."""
        self._check_context(self.kv.n_past + len(ids))
        chunk = self.plan.prefill_chunk
        out = []
        for c in range(0, len(ids), chunk):
            part = ids[c:c + chunk]
            rows = "all" if all_rows else ("last" if c + chunk >= len(ids) else "none")
            logits = self.forward(part, self.kv.n_past, rows)
            if logits is not None:
                # a "last" row may live in a buffer the next forward reuses
                out.append(logits if all_rows else logits.clone())
            self.kv.n_past += len(part)
            self.tokens.extend(part)
        logits = torch.cat(out) if len(out) > 1 else out[0]
        self.check_finite(logits)
        return logits

    def check_finite(self, logits: torch.Tensor) -> None:
        """Cheap test at the end of a pass; when it fails, re-run the cached tokens with a
        per-layer check to name where NaN/inf first appears."""
        if not bool(torch.isfinite(logits).all()):
            self.name_non_finite()

    def name_non_finite(self) -> None:
        """Raise CarveError naming where NaN/inf first appears: re-run the cached tokens with a
        check after every layer (the cache is reset)."""
        tokens = list(self.tokens)
        self.reset()
        where = "the output head"
        try:
            for c in range(0, len(tokens), self.plan.prefill_chunk):
                part = tokens[c:c + self.plan.prefill_chunk]
                self.forward(part, c, "none", check=True)
                self.kv.n_past += len(part)
        except NonFinite as nf:
            where = f"layer {nf.layer}"
        finally:
            self.reset()
        raise CarveError(
            f"{self.plan.model}: the model produced NaN/inf, first in {where} "
            f"(activations {self.plan.act_dtype}); the file may be damaged, or try act_dtype f32"
        )

    @torch.inference_mode()
    def logits(self, ids: list[int]) -> torch.Tensor:
        """[len(ids), n_vocab] float32 logits from a fresh cache."""
        if not ids:
            raise CarveError("logits: the token list is empty")
        self.reset()
        return self.prefill(list(ids), all_rows=True)

    @torch.inference_mode()
    def generate(self, prompt_ids: list[int], params: Any, stop_ids: set[int],
                 on_token: Callable[[int], bool]) -> GenerationStats:
        """Prefill ``prompt_ids`` (reusing the cached prefix it shares with the last call), then
        sample until a stop token, params.max_tokens, the context's end, or on_token -> False."""
        return generate(self, list(prompt_ids), params, set(stop_ids), on_token)

    def rewind(self, n: int) -> bool:
        """Keep the first n cached tokens if the cache still holds them intact."""
        if not self.kv.can_rewind_to(n):
            return False
        self.kv.n_past = n
        del self.tokens[n:]
        return True

    def reset(self) -> None:
        self.kv.reset()
        self.tokens.clear()
