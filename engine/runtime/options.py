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
    ``CARVE_T_LAYOUT``: ``1`` (default) or ``0``. On, the load repacks the large quantized
        matrices (kernels/gemv_t.py decides which types) into the T layout that decode's
        GEMVs read fastest; off, every matrix stays in GGUF order (kernels/quant_matmul.py).
    ``CARVE_PDL``: ``1`` (default) or ``0``. On, the kernels launch with programmatic
        dependent launch on GPUs of compute capability 9.0 and later (kernels/pdl.py), so that
        each may start while the one before it finishes; off, each waits for the one before.
    """

    runner: str = "auto"  # CARVE_RUNNER
    q8x: bool = True  # CARVE_Q8X
    t_layout: bool = True  # CARVE_T_LAYOUT
    pdl: bool = True  # CARVE_PDL

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
                   t_layout=_switch(environ, "CARVE_T_LAYOUT"), pdl=_switch(environ, "CARVE_PDL"))


def _switch(environ: Mapping[str, str], name: str) -> bool:
    value = environ.get(name, "").strip()
    if not value:
        return True  # every switch is on by default
    if value not in SWITCH:
        raise CarveError(f"{name}={value}: use 1 (on, the default) or 0 (off)")
    return SWITCH[value]
