"""How the engine runs a model, as data: `RunnerOptions`, read from the environment once when the
engine process (`engine.runtime.server`) or `carve bench` starts, then handed down to the
session, the GPU stages and the kernels. Nothing below those entry points reads the environment.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from spec import launch
from spec import quant_types as qt
from spec.errors import CarveError

RUNNERS = ("auto", "torch")
SWITCH = {"1": True, "0": False}
# kernels on trial (CARVE_TRIAL): written and checked, not yet measured to win on a GPU
TRIALS = {
    "q2k_rows": "Q2_K's row body for decode GEMVs in GGUF order (carve_kernels/gemv_lowbit.py)",
    "q8_0_rows": "Q8_0's row body for decode GEMVs in GGUF order, on int8 x "
                 "(carve_kernels/gemv_dot.py)",
    "l2_last": "CARVE_L2_PREFETCH's lines marked evict-last (carve_kernels/l2.py)",
    "iq4nl_experts": "decode's IQ4_NL experts on int8 x (carve_kernels/gemv_q8_blocks.py "
                     "iq4nl_q8_rows_dot): the fallback of the 2-3 bit types on rows that are no "
                     "whole 256-value blocks (GLM-4.5-Air's 1408-value down experts)",
}
# the trials that put a type's row body in quant_matmul.ROW_BODY_TYPES
ROW_TRIALS = {"q2k_rows": qt.Q2_K, "q8_0_rows": qt.Q8_0}


@dataclass(frozen=True, slots=True)
class RunnerOptions:
    """Which runner executes a plan, and which kernels the Triton GPU runner launches.

    Set by environment variables (unset or empty: the default):

    ``CARVE_RUNNER``: ``auto`` (default) or ``torch``. ``auto`` runs a plan whose layers are all
        on CUDA GPUs, of an architecture the Triton runner runs, on the Triton GPU runner
        (engine/runtime/gpu/), and every other plan on the torch engine
        (engine/runtime/models/); ``torch`` runs every plan on the torch engine.
    ``CARVE_Q8X``: ``1`` (default) or ``0``. On, decode's T-layout GEMVs multiply an int8 copy
        of their input (written by the norm or the GLU before them) with integer dot products,
        as llama.cpp rounds activations; off, they read the bf16 activations (slower).
    ``CARVE_EXPERT_Q8``: ``1`` (default) or ``0``. On (with ``CARVE_Q8X``), decode's routed
        experts of the types carve_kernels/gemv_q8.py has a body for multiply the int8 copies of the
        normed row and of their GLU outputs; off, they read the bf16 activations (to compare).
    ``CARVE_T_LAYOUT``: ``1`` (default) or ``0``. On, the load repacks the large quantized
        matrices (carve_kernels/gemv_t.py decides which types) into the T layout that decode's
        GEMVs read fastest; off, every matrix stays in GGUF order (carve_kernels/quant_matmul.py).
    ``CARVE_ATTN_Q8``: ``1`` (default) or ``0``. On (with ``CARVE_Q8X``), decode's attention
        writes an int8 copy of its output for an attn_output of the types
        engine/runtime/gpu/matrices.py ``ATTN_Q8_TYPES`` names (the IQ types), which then
        multiplies it in the T layout; off, such an attn_output reads the bf16 output (to
        compare).
    ``CARVE_PDL``: ``1`` (default) or ``0``. On, the kernels launch with programmatic
        dependent launch on GPUs of compute capability 9.0 and later (carve_kernels/pdl.py), so that
        each may start while the one before it finishes; off, each waits for the one before.
    ``CARVE_PREFILL_GRAPH``: ``1`` (default) or ``0``. On, a prefill chunk, padded to the next
        power of two from 8 rows (at most the plan's chunk), runs its layers by replaying that
        length's CUDA graph per stage, captured at the load's warm-up
        (engine/runtime/gpu/stage_graph.py ``forward_chunk``); off, every chunk launches its
        kernels from Python at its own length.
    ``CARVE_TRIAL``: empty (default), ``all``, or a comma-separated list of the names in
        ``TRIALS``: kernels written and checked against references but not yet adopted (not
        yet measured to win on a GPU), switched on for measuring them through the engine
        and ``carve bench`` before they are.
    ``CARVE_EXPERT_TILES``: empty (default) or ``TYPE/PART=ROWS,BLOCKS,WARPS`` entries
        separated by ``;`` (``Q4_K/glu=32,4,8;Q6_K/down=16,1,2``): decode's int8-x expert
        GEMV tiles (carve_kernels/moe_decode_q8.py ``EXPERT_Q8_CONFIG``) for a type (Q4_K, Q6_K,
        MXFP4, Q5_0, Q3_K, Q8_0; IQ4_NL with its trial) and part (glu: gate/up, down), so
        that a tile a kernel sweep found (``benchmarks.device_check --moe``) is measured in
        the step before it is adopted.
    ``CARVE_T_TILES``: empty (default) or ``PART=WARPS,PROGRAMS[,ROWS]`` entries separated by
        ``;`` (``qkv=4,1056;one=8,2112;attn=2,2112,128``): decode's T-layout GEMV launches
        (carve_kernels/gemv_t.py ``T_TUNE``) for a part (qkv: the q/k/v launch, one: a single
        matrix such as ffn_down, attn: the attn_output launch, which otherwise takes one's,
        glu: the gate/up pair) with that many warps a program and about that many programs
        (each row tile's blocks split fewer ways), at most the 2112 the scratch is priced for,
        and rows a program 128 or 256 (the row tiles the scratch is priced for; q/k/v's only
        128; default the type's), so that a config is measured in the step before it is
        adopted.
    ``CARVE_L2_PREFETCH``: empty or 0 (default: off) or MiB a layer: decode pulls that much
        of each dense layer's gate and up T matrices into L2 from a stream of its own while
        the layer's attention half runs, and of the next layer's attention matrices and
        router while a MoE layer's experts run (engine/runtime/gpu/stage_dense.py
        ``_l2_ffn``, ``_l2_next``), so that it is measured in the step before it is adopted.
    """

    runner: str = "auto"  # CARVE_RUNNER
    q8x: bool = True  # CARVE_Q8X
    expert_q8: bool = True  # CARVE_EXPERT_Q8
    attn_q8: bool = True  # CARVE_ATTN_Q8
    t_layout: bool = True  # CARVE_T_LAYOUT
    pdl: bool = True  # CARVE_PDL
    prefill_graph: bool = True  # CARVE_PREFILL_GRAPH
    trials: frozenset[str] = frozenset()  # CARVE_TRIAL
    expert_tiles: tuple[tuple[int, str, tuple[int, int, int]], ...] = ()  # CARVE_EXPERT_TILES
    t_tiles: tuple[tuple[str, tuple[int, int, int]], ...] = ()  # CARVE_T_TILES
    l2_prefetch: int = 0  # CARVE_L2_PREFETCH, MiB a layer

    def __post_init__(self) -> None:
        if self.runner not in RUNNERS:
            raise CarveError(f"runner {self.runner!r}: use one of {', '.join(RUNNERS)}")
        unknown = set(self.trials) - set(TRIALS)
        if unknown:
            raise CarveError(f"trial {', '.join(sorted(unknown))}: use {', '.join(TRIALS)}")

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> RunnerOptions:
        """The options ``environ`` sets; a value outside the accepted ones is a CarveError
        naming the variable and what it accepts."""
        runner = environ.get("CARVE_RUNNER", "").strip() or "auto"
        if runner not in RUNNERS:
            raise CarveError(f"CARVE_RUNNER={runner}: use {' or '.join(RUNNERS)}")
        return cls(runner=runner, q8x=_switch(environ, "CARVE_Q8X"),
                   expert_q8=_switch(environ, "CARVE_EXPERT_Q8"),
                   attn_q8=_switch(environ, "CARVE_ATTN_Q8"),
                   t_layout=_switch(environ, "CARVE_T_LAYOUT"), pdl=_switch(environ, "CARVE_PDL"),
                   prefill_graph=_switch(environ, "CARVE_PREFILL_GRAPH"),
                   trials=_trials(environ), expert_tiles=_expert_tiles(environ),
                   t_tiles=_t_tiles(environ), l2_prefetch=_l2_prefetch(environ))

    def apply(self) -> None:
        """Set what these options switch for the whole process (the entry points call it once,
        after reading them): the trials that are module tables of the kernels."""
        bodies = {t for name, t in ROW_TRIALS.items() if name in self.trials}
        if bodies:
            from carve_kernels import quant_matmul

            quant_matmul.ROW_BODY_TYPES = quant_matmul.ROW_BODY_TYPES | bodies
        if self.trials:
            from carve_kernels import gemv_q8, moe_decode_q8

            experts = {t for name, types in gemv_q8.Q8_TRIAL_TYPES.items()
                       if name in self.trials for t in types}
            if experts:
                moe_decode_q8.Q8_ON_TRIAL = frozenset(experts)
        if self.expert_tiles:
            from carve_kernels import moe_decode_q8

            moe_decode_q8.EXPERT_Q8_CONFIG = {**moe_decode_q8.EXPERT_Q8_CONFIG,
                                              **{(t, part): cfg
                                                 for t, part, cfg in self.expert_tiles}}
        if self.t_tiles:
            from carve_kernels import gemv_t

            gemv_t.T_TUNE = {**gemv_t.T_TUNE, **dict(self.t_tiles)}


def _trials(environ: Mapping[str, str]) -> frozenset[str]:
    value = environ.get("CARVE_TRIAL", "").strip()
    if value == "all":
        return frozenset(TRIALS)
    names = frozenset(n.strip() for n in value.split(",") if n.strip())
    unknown = names - set(TRIALS)
    if unknown:
        raise CarveError(f"CARVE_TRIAL={value}: use all or a comma-separated list of "
                         f"{', '.join(TRIALS)}")
    return names


# the types and parts decode's int8-x expert GEMVs have tiles for (carve_kernels/gemv_q8.py)
TILE_TYPES = {"Q4_K": qt.Q4_K, "Q6_K": qt.Q6_K, "MXFP4": qt.MXFP4, "Q3_K": qt.Q3_K,
              "Q5_0": qt.Q5_0, "IQ4_NL": qt.IQ4_NL, "Q8_0": qt.Q8_0}  # Q3_K, IQ4_NL, Q8_0: trials
TILE_PARTS = ("glu", "down")


def _entries(environ: Mapping[str, str], name: str, *counts: int):
    # the ``KEY=N,N,...`` entries of variable ``name`` separated by ``;``: (entry, KEY, its
    # integers where they are as many as one of ``counts``, else the first count's zeros)
    for entry in (e.strip() for e in environ.get(name, "").split(";")):
        if not entry:
            continue
        key, _, cfg = (v.strip() for v in entry.partition("="))
        try:
            nums = tuple(int(v) for v in cfg.split(","))
        except ValueError:
            nums = ()
        yield entry, key, nums if len(nums) in counts else (0,) * counts[0]


def _expert_tiles(environ: Mapping[str, str]) -> tuple:
    out = []
    for entry, what, (r, b, w) in _entries(environ, "CARVE_EXPERT_TILES", 3):
        name, _, part = (v.strip() for v in what.partition("/"))
        ok = (name in TILE_TYPES and part in TILE_PARTS
              and all(v > 0 and v & (v - 1) == 0 for v in (r, b, w)) and w <= 16
              and r >= (32 if part == "glu" else 16))
        if not ok:
            raise CarveError(
                f"CARVE_EXPERT_TILES entry {entry!r}: use TYPE/PART=ROWS,BLOCKS,WARPS with TYPE "
                f"one of {', '.join(TILE_TYPES)}, PART glu or down, powers of two (warps at "
                "most 16, rows at least 32 for glu and 16 for down)")
        out.append((TILE_TYPES[name], part, (r, b, w)))
    return tuple(out)


T_PARTS = ("qkv", "one", "attn", "glu")
# the row tiles a T launch may take: those engine/planning/buffers.py prices the splits'
# scratch for (q/k/v's launch at T_CONFIG only)
T_ROWS = (launch.T_CONFIG[0], launch.T_CONFIG_LOWBIT[0])


def _t_tiles(environ: Mapping[str, str]) -> tuple:
    out = []
    for entry, part, nums in _entries(environ, "CARVE_T_TILES", 2, 3):
        w, n, r = (*nums, 0)[:3]
        rows_ok = T_ROWS[:1] if part == "qkv" else T_ROWS
        if (part not in T_PARTS or not 0 < w <= 16 or w & (w - 1)
                or not 0 < n <= launch.T_CONFIG[2] or (len(nums) == 3 and r not in rows_ok)):
            raise CarveError(
                f"CARVE_T_TILES entry {entry!r}: use PART=WARPS,PROGRAMS[,ROWS] with PART one "
                f"of {', '.join(T_PARTS)}, WARPS a power of two up to 16, PROGRAMS from 1 to "
                f"{launch.T_CONFIG[2]} and ROWS {' or '.join(map(str, T_ROWS))} (qkv "
                f"{T_ROWS[0]}): the splits the scratch is priced for")
        out.append((part, (w, n, r)))
    return tuple(out)


def _l2_prefetch(environ: Mapping[str, str]) -> int:
    value = environ.get("CARVE_L2_PREFETCH", "").strip()
    if not value:
        return 0
    if not value.isdigit() or int(value) > 1024:
        raise CarveError(f"CARVE_L2_PREFETCH={value}: use a whole number of MiB a layer from 0 "
                         "(off, the default) to 1024")
    return int(value)


def _switch(environ: Mapping[str, str], name: str) -> bool:
    # a switch that is on unless set to 0
    value = environ.get(name, "").strip()
    if not value:
        return True
    if value not in SWITCH:
        raise CarveError(f"{name}={value}: use 1 (on, the default) or 0 (off)")
    return SWITCH[value]
