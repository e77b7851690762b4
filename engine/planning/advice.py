"""When a stage does not fit: the term that overflows and the single changes that fit it
(a smaller context, q8_0 KV, moving a boundary k layers, keeping fewer MoE layers' experts
in VRAM when host RAM can take the rest)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from engine.planning.capability import gpu_why_not
from engine.planning.carve import ModelIndex
from engine.planning.layout import DeviceLayout, human
from engine.planning.plan import Plan
from engine.planning.rules import KvType, Verdict
from engine.planning.stage import fits, host_bytes, kv_q8_0_fits, stage_key

# The term named as overflowing is the one that crosses the free memory when terms are added in
# this order: what the model and runtime impose first, the KV cache (sized by --ctx/--kv, the
# knobs a user turns) last — so "KV cache does not fit" means a smaller context would help.
_ORDER = (
    "overhead", "weights", "experts", "globals", "buffers", "expert_cache", "rounding", "kv"
)
_LABEL = {
    "overhead": "the runtime overhead",
    "weights": "weights",
    "experts": "experts",
    "globals": "globals",
    "kv": "KV cache",
    "buffers": "activation buffers",
    "expert_cache": "the expert cache",
    "rounding": "arena rounding",
}


def advise(
    plan: Plan, idx: ModelIndex, stages: list[DeviceLayout], host: Any = None
) -> list[DeviceLayout]:
    """For each stage that does not fit: the term that overflows and the changes that fit it.
    ``host``: the host memory (a DeviceSpec) experts moved out of VRAM would be pinned in."""
    out = []
    for i, s in enumerate(stages):
        if s.verdict != Verdict.DOES_NOT_FIT:
            out.append(s)
            continue
        k = stage_key(plan, i)
        dev = k.device
        avail = dev.free - dev.reserve
        run = 0
        term = _ORDER[-1]
        for term in _ORDER:
            run += s.terms[term]
            if run > avail:
                break
        tips = []
        if k.ctx > 256 and fits(idx, replace(k, ctx=256)):
            lo_c, hi_c = 1, (k.ctx - 1) // 256  # in units of 256 tokens
            while lo_c < hi_c:
                mid = (lo_c + hi_c + 1) // 2
                lo_c, hi_c = (
                    (mid, hi_c) if fits(idx, replace(k, ctx=mid * 256)) else (lo_c, mid - 1)
                )
            tips.append(f"--ctx {lo_c * 256}")
        if (k.kv_type == KvType.F16 and kv_q8_0_fits(idx.hp)
                and fits(idx, replace(k, kv_type=KvType.Q8_0))):
            tips.append("--kv q8_0")
        move = _boundary_move(plan, idx, i)
        if move:
            tips.append(move)
        if host is not None:
            to_host = _experts_to_host(plan, idx, stages, i, host)
            if to_host:
                tips.append(to_host)
        what = f"{_LABEL[term]} ({human(s.terms[term])})"
        advice = f"over by {human(-s.headroom)}: {what} does not fit in {human(avail)} free"
        advice += (
            "; fits with " + ", or ".join(tips)
            if tips
            else "; no single change fits it: add a GPU, use a smaller quant or a larger card"
        )
        out.append(replace(s, advice=advice))
    return out


def _boundary_move(plan: Plan, idx: ModelIndex, i: int) -> str:
    """The smallest shift of one of stage i's boundaries that makes it and the neighbour fit."""
    lo, hi = plan.split[i], plan.split[i + 1]
    n = len(plan.devices)
    for k in range(1, hi - lo):
        if i > 0:  # the previous device takes layers [lo, lo + k)
            a = stage_key(plan, i - 1, hi=lo + k)
            b = stage_key(plan, i, lo=lo + k)
            if fits(idx, a) and fits(idx, b):
                return (
                    f"--split boundary {i} moved +{k} ({lo} -> {lo + k}: "
                    f"{plan.devices[i - 1].label} takes {k} layer{'s' * (k > 1)})"
                )
        if i < n - 1:  # the next device takes layers [hi - k, hi)
            a = stage_key(plan, i, hi=hi - k)
            b = stage_key(plan, i + 1, lo=hi - k)
            if fits(idx, a) and fits(idx, b):
                return (
                    f"--split boundary {i + 1} moved -{k} ({hi} -> {hi - k}: "
                    f"{plan.devices[i + 1].label} takes {k} layer{'s' * (k > 1)})"
                )
    return ""


def _experts_to_host(
    plan: Plan, idx: ModelIndex, stages: list[DeviceLayout], i: int, host: Any
) -> str:
    """The most MoE layers' experts stage i can keep in VRAM and fit, when host RAM can take
    the others beside what the other stages pin there; "" when none can."""
    k = stage_key(plan, i)
    if k.device.is_cpu or gpu_why_not(plan, idx.hp) is not None:  # the torch engine keeps them
        return ""
    moe = len(idx.moe_layers(k.lo, k.hi))
    room = host.free - host.reserve - sum(s.host for j, s in enumerate(stages) if j != i)
    for r in range(min(k.resident, moe) - 1, -1, -1):
        kr = replace(k, resident=r)
        if fits(idx, kr):
            pinned = host_bytes(idx, kr)
            if pinned > room:
                return ""
            counts = [min(plan.resident(j), len(idx.moe_layers(*plan.stages()[j])))
                      for j in range(len(plan.devices))]
            counts[i] = r
            return (
                f"--experts-resident {','.join(map(str, counts))} ({k.device.label} keeps {r} "
                f"of its {moe} MoE layers' experts in VRAM, {human(pinned)} pinned in host RAM "
                f"of {human(host.free - host.reserve)} available)"
            )
    return ""
