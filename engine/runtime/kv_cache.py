"""The KV cache, living in the priced `kv.{layer}.k|v` spans.

Every layer has `cells` rows; position p lives in cell p on a full-context layer and in cell
p % cells on a sliding-window layer whose window is shorter than the context (a ring buffer of
min(ctx, window) cells, as priced). Values are stored as the span's dtype (f16/bf16/f32) or as
q8_0 blocks (34 bytes per 32 values, engine/runtime/kv_quant.py).

Attention is order-free over keys (softmax then a weighted sum), so a ring never needs to be
unrolled in decode: after writing position p, every live cell is within the window of p.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.runtime.kv_quant import dequantize_q8_0, quantize_q8_0
from spec.errors import CarveError

DTYPES = {"f16": torch.float16, "bf16": torch.bfloat16, "f32": torch.float32}


@dataclass(slots=True)
class LayerKV:
    k: torch.Tensor  # [cells, K, D] float, or uint8 q8_0 [cells, K*D/32*34]
    v: torch.Tensor | None  # None: the values are the keys' leading dv dims (MLA's latent)
    cells: int
    ring: bool  # sliding-window layer with fewer cells than the context
    window: int  # 0: attends to every earlier position
    n_kv: int
    dk: int
    dv: int


class KVCache:
    """All layers' caches of one session, plus the count of positions written."""

    def __init__(self, layers: dict[int, LayerKV], ctx: int) -> None:
        self.layers = layers
        self.ctx = ctx
        self.n_past = 0  # positions 0..n_past-1 are written (the caller advances it)

    @classmethod
    def from_spans(
        cls, spans: dict[str, torch.Tensor], hp: object, layers: range, ctx: int
    ) -> KVCache:
        """Wrap the loaded ``kv.{i}.k|v`` span views (already typed by the loader) of ``layers``."""
        out = {}
        (n_kv, dk), values = hp.kv_rows()
        dv = values[1] if values is not None else hp.kv_lora_rank
        for i in layers:
            k, v = spans[f"kv.{i}.k"], spans.get(f"kv.{i}.v")
            swa = bool(hp.swa_layers[i]) if hp.swa_layers else False
            window = hp.sliding_window if swa else 0
            cells = k.shape[0] if k.dtype != torch.uint8 else hp.kv_cells(i, ctx)
            out[i] = LayerKV(
                k=k.view(cells, -1) if k.dtype == torch.uint8 else k,
                v=v.view(cells, -1) if v is not None and v.dtype == torch.uint8 else v,
                cells=cells,
                ring=bool(window) and cells < ctx,
                window=window,
                n_kv=n_kv,
                dk=dk,
                dv=dv,
            )
        return cls(out, ctx)

    def reset(self) -> None:
        self.n_past = 0

    def can_rewind_to(self, n: int) -> bool:
        """Whether positions 0..n-1 are still intact (no ring has overwritten them)."""
        return n <= self.n_past and all(
            not L.ring or self.n_past <= L.cells for L in self.layers.values()
        )

    # --- what the models call ---------------------------------------------------------------
    def store_and_fetch(
        self, layer: int, k: torch.Tensor, v: torch.Tensor | None, pos0: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Write k [T, K, D] (and v [T, K, Dv]; None on a layer whose values are the keys'
        leading dims) for positions pos0.. and return (keys, values, mask) to attend."""
        L = self.layers[layer]
        t = k.shape[0]
        end = pos0 + t
        if end > self.ctx:
            raise CarveError(
                f"the context is full ({self.ctx} tokens); raise --ctx or start a new chat"
            )
        if L.ring and t > 1:
            return self._fetch_ring_chunk(L, k, v, pos0)
        self._write(L, k, v, pos0)
        if L.ring:
            n = min(end, L.cells)  # t == 1 here: every live cell is within the window
            keys = self._read(L.k, L, 0, n, L.dk)
            return keys, self._values(L, keys, lambda: self._read(L.v, L, 0, n, L.dv)), None
        keys = self._read(L.k, L, 0, end, L.dk)
        values = self._values(L, keys, lambda: self._read(L.v, L, 0, end, L.dv))
        if t == 1 and (not L.window or end <= L.window):
            return keys, values, None
        q_pos = torch.arange(pos0, end, device=k.device)
        k_pos = torch.arange(0, end, device=k.device)
        return keys, values, _mask(q_pos, k_pos, L.window)

    # --- internals ---------------------------------------------------------------------------
    def _fetch_ring_chunk(
        self, L: LayerKV, k: torch.Tensor, v: torch.Tensor, pos0: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A prefill chunk on a ring layer: the chunk's own writes may overwrite cells its first
        queries still need, so attend over (the past still in the ring) + (the chunk, as it
        reads back from the cache), then write."""
        t = k.shape[0]
        dev = k.device
        first = max(0, pos0 - L.cells + 1)
        past = torch.arange(first, pos0, device=dev)  # positions still needed from the ring
        cells = past % L.cells
        keys = torch.cat((self._gather(L.k, L, cells, L.dk), self._roundtrip(L, k)))
        values = self._values(L, keys, lambda: torch.cat(
            (self._gather(L.v, L, cells, L.dv), self._roundtrip(L, v))))
        q_pos = torch.arange(pos0, pos0 + t, device=dev)
        mask = _mask(q_pos, torch.cat((past, q_pos)), L.window)
        self._write(L, k, v, pos0)
        return keys, values, mask

    def _write(self, L: LayerKV, k: torch.Tensor, v: torch.Tensor, pos0: int) -> None:
        t = k.shape[0]
        if t > L.cells:  # only the last `cells` positions of a long chunk survive in a ring
            k, pos0, t = k[-L.cells :], pos0 + t - L.cells, L.cells
            v = None if v is None else v[-L.cells :]
        c0 = pos0 % L.cells if L.ring else pos0
        n1 = min(t, L.cells - c0)
        for dst, src in ((L.k, k), (L.v, v)):
            if dst is None:  # values that are the keys' leading dims
                continue
            self._store(dst, c0, src[:n1])
            if n1 < t:  # wrapped around the ring
                self._store(dst, 0, src[n1:])

    @staticmethod
    def _values(L: LayerKV, keys: torch.Tensor, read) -> torch.Tensor:
        """The values to attend: read from the layer's own span, or the keys' leading dims."""
        return keys[..., : L.dv] if L.v is None else read()

    @staticmethod
    def _store(dst: torch.Tensor, c0: int, src: torch.Tensor) -> None:
        rows = dst[c0 : c0 + src.shape[0]]
        if dst.dtype == torch.uint8:
            quantize_q8_0(src.reshape(src.shape[0], -1), out=rows)
        else:
            rows.copy_(src.reshape(rows.shape))

    @staticmethod
    def _read(buf: torch.Tensor, L: LayerKV, c0: int, c1: int, d: int) -> torch.Tensor:
        """Cells [c0, c1) as float32 [n, K, d]."""
        if buf.dtype == torch.uint8:
            return dequantize_q8_0(buf[c0:c1].reshape(-1), (c1 - c0, L.n_kv, d))
        return buf[c0:c1].float()

    @staticmethod
    def _gather(buf: torch.Tensor, L: LayerKV, cells: torch.Tensor, d: int) -> torch.Tensor:
        n = cells.numel()
        if buf.dtype == torch.uint8:
            return dequantize_q8_0(buf[cells].reshape(-1), (n, L.n_kv, d))
        return buf[cells].float()

    @staticmethod
    def _roundtrip(L: LayerKV, x: torch.Tensor) -> torch.Tensor:
        """x as it will read back from this layer's cache (what decode would see)."""
        if L.k.dtype == torch.uint8:
            raw = quantize_q8_0(x.reshape(x.shape[0], -1))
            return dequantize_q8_0(raw.reshape(-1), x.shape)
        return x.to(L.k.dtype).float()


def _mask(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int) -> torch.Tensor:
    """bool [T, S]: query at q_pos may see key at k_pos (causal, and within the window)."""
    d = q_pos.unsqueeze(1) - k_pos.unsqueeze(0)
    m = d >= 0
    if window:
        m &= d < window
    return m
