"""How the engine runs a model, as data: `RunnerOptions`, read from the environment once when the
engine process (`engine.runtime.server`) or `carve bench` starts, then handed down to the
session, the GPU stages and the kernels. Nothing below those entry points reads the environment.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from spec.errors import CarveError

RUNNERS = ("auto", "torch")
SWITCH = {"1": True, "0": False}


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
        experts of the types kernels/gemv_q8.py has a body for multiply the int8 copies of the
        normed row and of their GLU outputs; off, they read the bf16 activations (to compare).
    ``CARVE_T_LAYOUT``: ``1`` (default) or ``0``. On, the load repacks the large quantized
        matrices (kernels/gemv_t.py decides which types) into the T layout that decode's
        GEMVs read fastest; off, every matrix stays in GGUF order (kernels/quant_matmul.py).
    ``CARVE_PDL``: ``1`` (default) or ``0``. On, the kernels launch with programmatic
        dependent launch on GPUs of compute capability 9.0 and later (kernels/pdl.py), so that
        each may start while the one before it finishes; off, each waits for the one before.
    ``CARVE_ROW_BODY_TRIAL``: ``0`` (default) or ``1``. On, decode's GEMVs also run the bodies
        written but not yet adopted (``kernels.quant_matmul.ROW_BODY_TRIAL``) for their types,
        with decode's int8 copy of x, and decode's routed experts the int8-x bodies not yet
        adopted (``kernels.moe_decode.Q8_EXPERT_TRIAL``: MXFP4), and decode norms q and k per
        head inside the RoPE and cache-store launch (qwen3, qwen3moe, gemma3): for measuring
        them through the engine before they are.
    """

    runner: str = "auto"  # CARVE_RUNNER
    q8x: bool = True  # CARVE_Q8X
    expert_q8: bool = True  # CARVE_EXPERT_Q8
    t_layout: bool = True  # CARVE_T_LAYOUT
    pdl: bool = True  # CARVE_PDL
    row_body_trial: bool = False  # CARVE_ROW_BODY_TRIAL

    def __post_init__(self) -> None:
        if self.runner not in RUNNERS:
            raise CarveError(f"runner {self.runner!r}: use one of {', '.join(RUNNERS)}")

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> RunnerOptions:
        """The options ``environ`` sets; a value outside the accepted ones is a CarveError
        naming the variable and what it accepts."""
        runner = environ.get("CARVE_RUNNER", "").strip() or "auto"
        if runner not in RUNNERS:
            raise CarveError(f"CARVE_RUNNER={runner}: use {' or '.join(RUNNERS)}")
        return cls(runner=runner, q8x=_switch(environ, "CARVE_Q8X"),
                   expert_q8=_switch(environ, "CARVE_EXPERT_Q8"),
                   t_layout=_switch(environ, "CARVE_T_LAYOUT"), pdl=_switch(environ, "CARVE_PDL"),
                   row_body_trial=_switch(environ, "CARVE_ROW_BODY_TRIAL", default=False))

    def apply(self) -> None:
        """Set what these options switch for the whole process (the entry points call it once,
        after reading them): the trial bodies join ``quant_matmul.ROW_BODY_TYPES``."""
        if self.row_body_trial:
            from kernels import quant_matmul

            quant_matmul.ROW_BODY_TYPES = quant_matmul.ROW_BODY_TYPES | quant_matmul.ROW_BODY_TRIAL


def _switch(environ: Mapping[str, str], name: str, default: bool = True) -> bool:
    value = environ.get(name, "").strip()
    if not value:
        return default
    if value not in SWITCH:
        on, off = ("on, the default", "off") if default else ("on", "off, the default")
        raise CarveError(f"{name}={value}: use 1 ({on}) or 0 ({off})")
    return SWITCH[value]
