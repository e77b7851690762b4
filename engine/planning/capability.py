"""Which runner will execute a plan, and whether it can run every tensor each device holds.

A device whose stage holds a tensor of a type its runner has no kernel for gets the verdict
"does not run here" and a reason naming the type, a tensor of it, the runner, and what would run
it — before anything is allocated, in the window, `carve plan` and the engine alike.

The runner rule is the pure part of the engine's (engine/runtime/gpu/session.py `why_not`, which
adds the checks only a torch process can make): a plan with every layer on GPUs, of an
architecture the GPU runner runs, runs on the Triton GPU runner; any other on the torch engine.
A plan for simulated GPUs is priced as the GPU runner would run it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from engine.gguf.hparams import FACTOR_TENSORS
from engine.planning.carve import ModelIndex
from engine.planning.layout import DeviceLayout
from engine.planning.plan import Plan
from engine.planning.rules import Verdict
from spec.quant_types import F32, type_name
from spec.runners import RUNNERS, TORCH, TRITON, TRITON_ARCHS, Runner

F32_MATRICES = ("ffn_gate_inp.weight", "_exps.bias")  # routers, gpt-oss's expert biases


def gpu_why_not(plan: Plan, hp: Any) -> str | None:
    """None when the GPU runner runs `plan` (as far as a plan can tell), else why the torch
    engine does."""
    if any(d.is_cpu for d in plan.devices):
        return "the plan places layers on the CPU"
    if hp.arch not in TRITON_ARCHS:
        return f"the Triton runner runs {'/'.join(TRITON_ARCHS)} models, not {hp.arch}"
    if getattr(hp, "kv_lora_rank", 0):
        dims = (hp.rope_dim,)  # latent attention (carve_kernels/latent.py): any other width
    else:
        dims = (hp.head_dim, hp.head_dim_v, getattr(hp, "rope_dim", 0) or hp.head_dim)
    odd = next((d for d in dims if d & (d - 1)), None)
    if odd is not None:  # Phi-3.5-mini's heads of 96, Phi-4-mini's 96 rotated dims
        return (f"the Triton attention and RoPE kernels take power-of-two head dims, and this "
                f"model's heads have {odd}")
    return None


def runner_for(plan: Plan, idx: ModelIndex) -> Runner:
    """The runner that will execute `plan`."""
    return TRITON if gpu_why_not(plan, idx.hp) is None else TORCH


def _f32_only(runner: Runner, t: Any) -> bool:
    # the GPU runner reads vectors (norms, biases, sinks) and expert routers and per-expert
    # biases (carve_kernels/moe.py) as F32 where they lie; RoPE factors it reads on the host,
    # as F32, F16 or BF16
    return runner is TRITON and (len(t.shape) < 2 or t.name.endswith(F32_MATRICES)) and (
        t.name not in FACTOR_TENSORS)


def _runs(runner: Runner, t: Any) -> bool:
    if _f32_only(runner, t):
        return t.ggml_type == F32
    if runner is TRITON and t.name in FACTOR_TENSORS:
        return True
    return t.ggml_type in runner.types


_MISSING: OrderedDict[tuple[int, str], tuple[tuple[tuple[Any, ...], ...], tuple[Any, ...]]] = (
    OrderedDict()
)


def _missing(idx: ModelIndex, runner: Runner) -> tuple[tuple[tuple[Any, ...], ...], tuple[Any, ...]]:
    """Per layer, then of the non-layer tensors: those `runner` cannot run (once per model)."""
    key = (idx.token, runner.name)
    hit = _MISSING.get(key)
    if hit is None:
        per = tuple(tuple(t for t in ts if not _runs(runner, t)) for ts in idx.layer_tensors)
        glob = {id(t): t for t in idx.first_globals + idx.shared + idx.last_globals}
        hit = per, tuple(t for t in glob.values() if not _runs(runner, t))
        _MISSING[key] = hit
        while len(_MISSING) > 16:
            _MISSING.popitem(last=False)
    return hit


def reason(runner: Runner, tensors: Sequence[Any]) -> str:
    """ "IQ4_XS (blk.0.ffn_down.weight and 27 more) has no GPU kernel: run on the CPU engine
    (--gpus cpu) or use a file without it", a clause per type, in file order."""
    by_type: dict[tuple[int, bool], list[str]] = {}
    for t in tensors:
        by_type.setdefault((t.ggml_type, _f32_only(runner, t)), []).append(t.name)
    clauses = []
    for (tid, f32_only), names in by_type.items():
        more = f" and {len(names) - 1} more" if len(names) > 1 else ""
        others = [r for r in RUNNERS.values() if r is not runner and tid in r.types]
        fix = (
            f"{others[0].elsewhere} or use a file without it"
            if others
            else "no runner of this Carve runs it; use a file without it"
        )
        lacks = ("where the GPU runner reads F32 (norms, biases, routers)" if f32_only
                 else runner.lacks)
        clauses.append(f"{type_name(tid)} ({names[0]}{more}) {lacks}: {fix}")
    return "; ".join(clauses)


def _host_experts(plan: Plan, idx: ModelIndex, stages: Sequence[DeviceLayout],
                  runner: Runner) -> list[DeviceLayout]:
    """"Does not run here" on each stage that places experts in host memory when the plan runs
    on the torch engine: only the Triton GPU runner computes or caches host experts."""
    if runner is not TORCH or not any(s.host for s in stages):
        return list(stages)
    why = gpu_why_not(plan, idx.hp) or "the torch runner was asked for"
    advice = (f"experts in host memory run on the Triton GPU runner, and this plan runs on the "
              f"torch engine ({why}): keep every MoE layer's experts in VRAM "
              "(--experts-resident at each GPU's MoE layer count, or leave it to Auto)")
    return [replace(s, verdict=Verdict.DOES_NOT_RUN, advice=advice) if s.host else s
            for s in stages]


def check(
    plan: Plan, idx: ModelIndex, stages: Sequence[DeviceLayout], runner: Runner | None = None
) -> list[DeviceLayout]:
    """`stages` with "does not run here" and its reason on each device holding a tensor that
    `runner` (default: the one `runner_for` picks) cannot run."""
    runner = runner if runner is not None else runner_for(plan, idx)
    stages = _host_experts(plan, idx, stages, runner)
    per, glob = _missing(idx, runner)
    if not glob and not any(per):
        return list(stages)
    out = []
    for s in stages:
        lo, hi = s.layers
        held = {id(t) for t in idx.first_globals} if s.first else set()
        held |= {id(t) for t in idx.shared}
        if s.last:
            held |= {id(t) for t in idx.last_globals}
        bad = [t for ts in per[lo:hi] for t in ts] + [t for t in glob if id(t) in held]
        out.append(replace(s, verdict=Verdict.DOES_NOT_RUN, advice=reason(runner, bad)) if bad else s)
    return out
