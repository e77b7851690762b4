"""--split auto: the boundaries that leave the most headroom on the tightest device.

"Headroom" here is the slack before the elastic dequant cache: free - reserve - need, where
need is weights + globals + KV + buffers + overhead + arena rounding (`engine.planning.stage.stage_need`,
exact for every arena mode). The dequant cache then takes what is left above the cache
reserve, so maximising the smallest slack also spreads the cache.

Search: binary search on the slack T. For a given T one pass over the devices decides
feasibility exactly: the cuts each device can end at, given the cuts the previous one can end
at. For an end the latest reachable start is tried first, and where needs grow with the range
(every arena >= 10 MiB: real models) it is the only one that can pass, so a pass costs
O(devices x layers) memoised slack lookups. torch's allocator gives a 1-10 MiB arena a whole
20 MiB segment, so for toy-sized stages a longer range can cost *less*; a miss therefore tries
the earlier starts too (O(devices x layers^2) at worst). Assuming monotone needs here made the
pass miss splits that meet T, so the search could settle on a T its own pass then failed.
The devices that cannot go above the best T are then pinned there and the search repeats for
the rest (lexicographic max-min: every card gets as much headroom as the others allow).
Remaining ties go to the larger total dequant cache among the front-heavy, back-heavy and
memory-proportional splits.

prefer="auto" (the default everywhere: `default_plan`, `carve plan`, `carve chat`, the window):
the one device with the most free memory when the model with the requested context leaves it at
least the cache reserve (a split only adds a hop between devices), else "spread".
prefer="spread": every device (if the model has fewer layers than devices, the smallest are
left out). prefer="fewest": the fewest devices, largest first, whose best split leaves every
one of them at least the cache reserve; devices not needed are *dropped from the Plan*
(a Plan's device holds >= 1 layer), so the engine does not even create a CUDA context there.
When nothing fits, the best split still comes back and `price` says what overflows.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from engine.hardware.devices import DeviceSpec
from engine.planning.carve import ModelIndex, model_index
from engine.planning.plan import MAX_DEVICES, Plan
from engine.planning.stage import StageKey, stage_need
from spec.errors import CarveError

PREFER = ("auto", "spread", "fewest")
GRAIN = 1 << 20  # slack resolution of the search: 1 MiB


def _settings(plan_kw: dict[str, Any]) -> dict[str, Any]:
    # defaults as in engine.planning.plan.Plan
    return {
        "ctx": plan_kw["ctx"],
        "kv_type": plan_kw.get("kv_type", "f16"),
        "chunk": plan_kw.get("prefill_chunk", 512),
        "cache_reserve": plan_kw.get("cache_reserve", 1 << 30),
        "arena": plan_kw.get("arena", "packed"),
        "act_dtype": plan_kw.get("act_dtype", "f32"),
        "logits_rows": plan_kw.get("logits_rows", 1),
    }


class _Search:
    def __init__(
        self,
        idx: ModelIndex,
        devices: Sequence[DeviceSpec],
        settings: dict[str, Any],
        excess: Sequence[int] = (),
        needs: dict[tuple[int, int, int, bool, bool], int] | None = None,
    ) -> None:
        self.idx, self.devices, self.s = idx, list(devices), settings
        self.n = idx.n_layer
        self.excess = list(excess) or [0] * len(self.devices)
        self.avail = [dev.free - dev.reserve - e for dev, e in zip(self.devices, self.excess)]
        # a stage's need does not depend on `excess`: searches over the same devices and
        # settings share it (`needs`), so re-searching with new excesses prices nothing again
        self.needs = {} if needs is None else needs

    def slack(self, d: int, lo: int, hi: int, first: bool, last: bool) -> int:
        key = (d, lo, hi, first, last)
        need = self.needs.get(key)
        if need is None:
            k = StageKey(lo, hi, first, last, self.devices[d], **self.s)
            need = self.needs[key] = stage_need(self.idx, k)
        return self.avail[d] - need

    def min_slack(self, bounds: Sequence[int]) -> int:
        m = len(self.devices)
        return min(self.slack(d, bounds[d], bounds[d + 1], d == 0, d == m - 1) for d in range(m))

    def reach(self, thr: list[int]) -> list[list[int]] | None:
        """Cuts reachable with stage d's slack >= thr[d]: reach[d] lists the boundaries b_d
        (ascending) some valid choice of the first d stages can end at; None if n is not
        reachable. Exact: every reachable start is tried for each end, so a threshold some
        split meets is always found (the binary search in best() relies on it)."""
        m, n, needs = len(self.devices), self.n, self.needs
        reach = [[0]]
        for d in range(m):
            prev, cur, p = reach[-1], [], 0
            first, last = d == 0, d == m - 1
            cap = self.avail[d] - thr[d]  # slack >= thr  <=>  need <= cap
            for hi in [n] if last else range(1, n - (m - 1 - d) + 1):
                while p + 1 < len(prev) and prev[p + 1] < hi:
                    p += 1
                # Latest start first: where needs grow with the range it is the only one that
                # can pass, but toy arenas (module note) can make a longer range cost less,
                # so on a miss the earlier starts are tried too. (Hot loop: needs inlined.)
                for j in range(p, -1, -1) if prev[p] < hi else ():
                    need = needs.get((d, prev[j], hi, first, last))
                    if need is None:
                        need = self.avail[d] - self.slack(d, prev[j], hi, first, last)
                    if need <= cap:
                        cur.append(hi)
                        break
            if not cur:
                return None
            reach.append(cur)
        return reach

    def bounds(self, reach: list[list[int]], thr: list[int], early: bool) -> list[int]:
        """One split through `reach`, walking back from n: `early` gives earlier stages as
        many layers as they can take (each stage starts as late as it can), else the later
        stages take as many as they can."""
        m = len(self.devices)
        out = [self.n]
        for d in range(m - 1, -1, -1):
            hi = out[-1]
            starts = [
                lo
                for lo in reach[d]
                if lo < hi and self.slack(d, lo, hi, d == 0, d == m - 1) >= thr[d]
            ]
            out.append(max(starts) if early else min(starts))  # never empty: reach() is exact
        return out[::-1]

    def greedy(self, thr: list[int], reverse: bool = False) -> list[int] | None:
        """Boundaries meeting every stage's threshold, or None."""
        reach = self.reach(thr)
        return None if reach is None else self.bounds(reach, thr, early=not reverse)

    def best(self) -> tuple[int, list[int]]:
        """(the best smallest slack, boundaries). Lexicographic max-min: once the tightest
        devices are pinned at the best T, the others are raised as far as they go together,
        so a small card does not leave the other cards' layer counts to chance."""
        m = len(self.devices)
        n = self.n
        # Search upward from a split every T up to its own smallest slack admits (memory-
        # proportional). `met` is always a split meeting the current floor, so the search
        # never ends empty-handed.
        met = self.proportional([*range(m), n], [0, *range(n - m + 1, n + 1)])
        floor = self.min_slack(met) // GRAIN
        pinned: list[int | None] = [None] * m
        first_t = floor * GRAIN
        rounds = 0
        while any(p is None for p in pinned):

            def thr(t: int, bump: int = -1) -> list[int]:
                return [
                    p if p is not None else (t + GRAIN if d == bump else t)
                    for d, p in enumerate(pinned)
                ]

            free = [d for d in range(m) if pinned[d] is None]
            # a stage needs >= 0 bytes: no split gives device d more slack than avail[d]
            lo, hi = floor, max(floor, min(self.avail[d] for d in free) // GRAIN)
            while lo < hi:
                mid = (lo + hi + 1) // 2
                found = self.greedy(thr(mid * GRAIN))
                if found is None:
                    hi = mid - 1
                else:
                    lo, met = mid, found
            t = lo * GRAIN
            first_t = t if rounds == 0 else first_t
            rounds += 1
            stuck = [d for d in free if self.greedy(thr(t, bump=d)) is None]
            for d in stuck or free:  # none stuck alone: they block each other, pin them all
                pinned[d] = t
            floor = lo
        final = [p if p is not None else 0 for p in pinned]
        # `met` meets `final` (the thresholds of the last feasible T); reach() is exact, so both
        # greedy walks meet them too, but `met` keeps the answer a valid split regardless.
        front = self.greedy(final) or met
        back = self.greedy(final, reverse=True) or met
        # Any split between the back-first and front-first boundaries may meet the pinned
        # slacks; the one proportional to the devices' memory is the natural tie-breaker
        # (where slack is flat, e.g. coarse chunks, it avoids one-layer stages).
        candidates = [(2, self.proportional(back, front)), (1, front), (0, back), (-1, met)]
        ok = [(pri, b) for pri, b in candidates if self.meets(b, final)]
        best = max(ok, key=lambda c: (*self.cache_score(c[1]), c[0]))
        return first_t, best[1]

    def proportional(self, back: list[int], front: list[int]) -> list[int]:
        """Boundaries proportional to the devices' memory, kept within [back, front] and
        strictly increasing (each device >= 1 layer)."""
        m = len(self.devices)
        avail = [max(d.free - d.reserve, 1) for d in self.devices]
        total, run, out = sum(avail), 0, [0]
        for d in range(m - 1):
            run += avail[d]
            b = min(max(round(self.n * run / total), back[d + 1], out[-1] + 1), front[d + 1])
            out.append(min(b, self.n - (m - 1 - d)))
        return [*out, self.n]

    def meets(self, bounds: list[int], thr: list[int]) -> bool:
        """A valid split (each device >= 1 layer) whose stages all meet their thresholds."""
        m = len(self.devices)
        return all(bounds[d] < bounds[d + 1] for d in range(m)) and all(
            self.slack(d, bounds[d], bounds[d + 1], d == 0, d == m - 1) >= thr[d] for d in range(m)
        )

    def cache_score(self, bounds: list[int]) -> tuple[int]:
        m, reserve = len(self.devices), self.s["cache_reserve"]
        cache = 0
        for d in range(m):
            lo, hi = bounds[d], bounds[d + 1]
            slack = self.slack(d, lo, hi, d == 0, d == m - 1)
            cache += max(0, min(self.cacheable(lo, hi), slack - reserve))
        return (cache,)

    def cacheable(self, lo: int, hi: int) -> int:
        return self.idx.cache_prefix[hi] - self.idx.cache_prefix[lo]


def auto_split(
    model: Any,
    devices: Sequence[DeviceSpec],
    prefer: str = "spread",
    model_path: str | None = None,
    **plan_kw: Any,
) -> Plan:
    """A Plan over `devices` with searched boundaries. plan_kw: ctx (required), kv_type,
    prefill_chunk, cache_reserve, arena, act_dtype, logits_rows (as engine.planning.plan.Plan)."""
    if prefer not in PREFER:
        raise CarveError(f"--prefer: unknown {prefer!r}; use auto, spread or fewest")
    if not devices:
        raise CarveError("--split auto: no devices to split over; name a rig with --gpus")
    if len(devices) > MAX_DEVICES:
        raise CarveError(f"--gpus: Carve plans for 1 to {MAX_DEVICES} devices, got {len(devices)}")
    if "ctx" not in plan_kw:
        raise CarveError("--split auto: needs --ctx")
    idx = model_index(model)
    path = model_path or str(model.paths[0])
    if idx.n_layer < 1:
        raise CarveError(f"--split auto: {path} has no layers to split; check the model file")
    settings = _settings(plan_kw)
    devices = list(devices)

    def plan_for(devs: list[DeviceSpec]) -> tuple[int, Plan]:
        # Search with packed costs (prefix sums: thousands of lookups are cheap); for the other
        # modes, charge each device the rounding its stage showed in that mode and search
        # again, until a split comes back (at most 4 times). The charge follows the stages, so
        # the searches can swing between two splits: each one is scored in the plan's own mode
        # and the best kept (ties: the later, searched with the better-informed charges).
        packed = settings | {"arena": "packed"}
        exact = _Search(idx, devs, settings)
        last = len(devs) - 1
        search = _Search(idx, devs, packed)
        bounds = search.best()[1]
        seen = [bounds]
        for _ in range(4 if settings["arena"] != "packed" else 0):
            excess = [
                search.slack(d, bounds[d], bounds[d + 1], d == 0, d == last)
                + search.excess[d]
                - exact.slack(d, bounds[d], bounds[d + 1], d == 0, d == last)
                for d in range(len(devs))
            ]
            search = _Search(idx, devs, packed, excess, search.needs)
            bounds = search.best()[1]
            if bounds in seen:
                break
            seen.append(bounds)
        scored = [(exact.min_slack(b), i, b) for i, b in enumerate(seen)]
        t, _, bounds = max(scored)
        return t, Plan(path, tuple(devs), tuple(bounds), **plan_kw)

    by_size = _largest_first(devices)
    if prefer == "auto":
        slack, one = plan_for(by_size(1))
        if slack >= settings["cache_reserve"] or len(devices) == 1:
            return one
        prefer = "spread"
    if prefer == "spread":
        keep = by_size(min(len(devices), idx.n_layer))
        return plan_for(keep)[1]
    fallback = plan_for(by_size(1))
    for k in range(1, min(len(devices), idx.n_layer) + 1):
        t, plan = fallback if k == 1 else plan_for(by_size(k))
        if t >= settings["cache_reserve"]:
            return plan
        if t > fallback[0]:
            fallback = (t, plan)
    return fallback[1]  # nothing leaves the reserve: the set with the most slack


def _largest_first(devices: list[DeviceSpec]) -> Callable[[int], list[DeviceSpec]]:
    """k -> the k devices with the most free memory (ties: lower index), in pipeline order."""
    ranked = sorted(range(len(devices)), key=lambda i: (-(devices[i].free - devices[i].reserve), i))

    def pick(k: int) -> list[DeviceSpec]:
        return [devices[i] for i in sorted(ranked[:k])]

    return pick
