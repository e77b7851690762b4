"""--split auto: the boundaries that leave the most headroom on the tightest device.

"Headroom" here is the slack before the elastic dequant cache: free - reserve - need, where
need is weights + globals + KV + buffers + overhead + arena rounding (`engine.price.stage_need`,
exact for every arena mode). The dequant cache then takes what is left above the cache
reserve, so maximising the smallest slack also spreads the cache.

Search: binary search on the slack T; for a given T a greedy pass decides feasibility exactly
(each device in turn takes the most layers it can hold with slack >= T, leaving one layer for
every later device) — taking more layers early never hurts later devices, because a stage's
need only shrinks when its range does. The devices that cannot go above the best T are pinned
there and the search repeats for the rest (lexicographic max-min: every card gets as much
headroom as the others allow). Remaining ties go to the larger total dequant cache between the
front-first and back-first greedy splits.

prefer="spread": every device (if the model has fewer layers than devices, the smallest are
left out). prefer="fewest": the fewest devices, largest first, whose best split leaves every
one of them at least the cache reserve; devices not needed are *dropped from the Plan*
(a Plan's device holds >= 1 layer), so the engine does not even create a CUDA context there.
When nothing fits, the best split still comes back and `price` says what overflows.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from engine.devices import DeviceSpec
from engine.errors import CarveError
from engine.plan import MAX_DEVICES, Plan
from engine.price import ModelIndex, StageKey, model_index, stage_need

PREFER = ("spread", "fewest")
GRAIN = 1 << 20  # slack resolution of the search: 1 MiB


def _settings(plan_kw: dict[str, Any]) -> dict[str, Any]:
    # defaults as in engine.plan.Plan
    return {"ctx": plan_kw["ctx"], "kv_type": plan_kw.get("kv_type", "f16"),
            "chunk": plan_kw.get("prefill_chunk", 512), "cache_reserve": plan_kw.get("cache_reserve", 1 << 30),
            "arena": plan_kw.get("arena", "packed"), "act_dtype": plan_kw.get("act_dtype", "f32"),
            "logits_rows": plan_kw.get("logits_rows", 1)}


class _Search:
    def __init__(self, idx: ModelIndex, devices: Sequence[DeviceSpec], settings: dict[str, Any]) -> None:
        self.idx, self.devices, self.s = idx, list(devices), settings
        self.n = idx.n_layer
        self.memo: dict[tuple[int, int, int, bool, bool], int] = {}

    def slack(self, d: int, lo: int, hi: int, first: bool, last: bool) -> int:
        key = (d, lo, hi, first, last)
        v = self.memo.get(key)
        if v is None:
            dev = self.devices[d]
            need = stage_need(self.idx, StageKey(lo, hi, first, last, dev, **self.s))
            v = self.memo[key] = dev.free - dev.reserve - need
        return v

    def greedy(self, thr: list[int], reverse: bool = False) -> list[int] | None:
        """Boundaries with stage d's slack >= thr[d], or None. Front-first or back-first."""
        m, n = len(self.devices), self.n
        order = range(m - 1, -1, -1) if reverse else range(m)
        cut = n if reverse else 0
        bounds = [cut]
        for step, d in enumerate(order):
            first, last = d == 0, d == m - 1
            left = m - 1 - step  # devices still to place after this one
            if step == m - 1:  # the final device takes everything that is left
                lo, hi = (0, cut) if reverse else (cut, n)
                if hi <= lo or self.slack(d, lo, hi, first, last) < thr[d]:
                    return None
                bounds.append(0 if reverse else n)
                break

            def ok(size: int, d: int = d, first: bool = first, last: bool = last, cut: int = cut) -> bool:
                lo, hi = (cut - size, cut) if reverse else (cut, cut + size)
                return self.slack(d, lo, hi, first, last) >= thr[d]

            most = (cut - left) if reverse else (n - left - cut)
            if most < 1 or not ok(1):
                return None
            a, b = 1, most  # largest size with ok(size): need grows with the range
            while a < b:
                mid = (a + b + 1) // 2
                a, b = (mid, b) if ok(mid) else (a, mid - 1)
            cut = cut - a if reverse else cut + a
            bounds.append(cut)
        return bounds[::-1] if reverse else bounds

    def best(self) -> tuple[int, list[int]]:
        """(the best smallest slack, boundaries). Lexicographic max-min: once the tightest
        devices are pinned at the best T, the others are raised as far as they go together,
        so a small card does not leave the other cards' layer counts to chance."""
        m = len(self.devices)
        # Every stage's range is a subset of the whole model, so no slack is below the worst
        # device's slack for holding everything: the greedy always succeeds there.
        floor = min(self.slack(d, 0, self.n, True, True) for d in range(m)) // GRAIN - 1
        top = max(d.free - d.reserve for d in self.devices) // GRAIN + 1
        pinned: list[int | None] = [None] * m
        first_t = None
        while any(p is None for p in pinned):
            def thr(t: int, bump: int = -1) -> list[int]:
                return [p if p is not None else (t + GRAIN if d == bump else t)
                        for d, p in enumerate(pinned)]

            lo, hi = floor, top
            while lo < hi:
                mid = (lo + hi + 1) // 2
                lo, hi = (mid, hi) if self.greedy(thr(mid * GRAIN)) is not None else (lo, mid - 1)
            t = lo * GRAIN
            first_t = t if first_t is None else first_t
            free = [d for d in range(m) if pinned[d] is None]
            stuck = [d for d in free if self.greedy(thr(t, bump=d)) is None]
            for d in stuck or free:  # none stuck alone: they block each other, pin them all
                pinned[d] = t
            floor = lo
        final = [p if p is not None else 0 for p in pinned]
        front, back = self.greedy(final), self.greedy(final, reverse=True)
        assert first_t is not None and front is not None and back is not None
        # Any split between the back-first and front-first boundaries may meet the pinned
        # slacks; the one proportional to the devices' memory is the natural tie-breaker
        # (where slack is flat, e.g. coarse chunks, it avoids one-layer stages).
        candidates = [(2, self.proportional(front, back)), (1, front), (0, back)]
        ok = [(pri, b) for pri, b in candidates if b is not None and self.meets(b, final)]
        best = max(ok, key=lambda c: (*self.cache_score(c[1]), c[0]))
        return first_t, best[1]

    def proportional(self, front: list[int], back: list[int]) -> list[int] | None:
        avail = [max(d.free - d.reserve, 1) for d in self.devices]
        total, run, out = sum(avail), 0, [0]
        for d in range(len(avail) - 1):
            run += avail[d]
            b = min(max(round(self.n * run / total), back[d + 1]), front[d + 1])
            if b <= out[-1]:
                return None
            out.append(b)
        return out + [self.n] if out[-1] < self.n else None

    def meets(self, bounds: list[int], thr: list[int]) -> bool:
        m = len(self.devices)
        return all(self.slack(d, bounds[d], bounds[d + 1], d == 0, d == m - 1) >= thr[d] for d in range(m))

    def cache_score(self, bounds: list[int]) -> tuple[int, int]:
        m, reserve = len(self.devices), self.s["cache_reserve"]
        cache = total = 0
        for d in range(m):
            lo, hi = bounds[d], bounds[d + 1]
            slack = self.slack(d, lo, hi, d == 0, d == m - 1)
            cache += max(0, min(self.cacheable(lo, hi), slack - reserve))
            total += slack
        return cache, total

    def cacheable(self, lo: int, hi: int) -> int:
        return self.idx.cache_prefix[hi] - self.idx.cache_prefix[lo]


def auto_split(model: Any, devices: Sequence[DeviceSpec], prefer: str = "spread",
               model_path: str | None = None, **plan_kw: Any) -> Plan:
    """A Plan over `devices` with searched boundaries. plan_kw: ctx (required), kv_type,
    prefill_chunk, cache_reserve, arena, act_dtype, logits_rows (as engine.plan.Plan)."""
    if prefer not in PREFER:
        raise CarveError(f"--prefer: unknown {prefer!r}; use spread or fewest")
    if not devices:
        raise CarveError("--split auto: no devices to split over; name a rig with --gpus")
    if len(devices) > MAX_DEVICES:
        raise CarveError(f"--gpus: Carve plans for 1 to {MAX_DEVICES} devices, got {len(devices)}")
    if "ctx" not in plan_kw:
        raise CarveError("--split auto: needs --ctx")
    idx = model_index(model)
    path = model_path or str(model.paths[0])
    settings = _settings(plan_kw)
    devices = list(devices)

    def plan_for(devs: list[DeviceSpec]) -> tuple[int, Plan]:
        search = _Search(idx, devs, settings)
        t, bounds = search.best()
        return t, Plan(path, tuple(devs), tuple(bounds), **plan_kw)

    by_size = _largest_first(devices)
    if prefer == "spread":
        keep = by_size(min(len(devices), idx.n_layer))
        return plan_for(keep)[1]
    fallback = None
    for k in range(1, min(len(devices), idx.n_layer) + 1):
        t, plan = plan_for(by_size(k))
        if t >= settings["cache_reserve"]:
            return plan
        if fallback is None or t > fallback[0]:
            fallback = (t, plan)
    assert fallback is not None
    return fallback[1]  # nothing leaves the reserve: the set with the most slack


def _largest_first(devices: list[DeviceSpec]) -> Callable[[int], list[DeviceSpec]]:
    """k -> the k devices with the most free memory (ties: lower index), in pipeline order."""
    ranked = sorted(range(len(devices)), key=lambda i: (-(devices[i].free - devices[i].reserve), i))

    def pick(k: int) -> list[DeviceSpec]:
        return [devices[i] for i in sorted(ranked[:k])]

    return pick
