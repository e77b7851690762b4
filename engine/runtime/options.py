"""How the engine runs a model, as data: `RunnerOptions`, read from the environment once when the
engine process (`engine.runtime.server`) or `carve bench` starts, then handed down to the
session, the GPU stages and the kernels. Nothing below those entry points reads the environment.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from spec import quant_types as qt
from spec.errors import CarveError

RUNNERS = ("auto", "torch")
SWITCH = {"1": True, "0": False}
# kernels on trial (CARVE_TRIAL): written and checked, not yet measured to win on a GPU
TRIALS = {
    "q2k_rows": "Q2_K's row body for decode GEMVs in GGUF order (carve_kernels/gemv_lowbit.py)",
    "q8_0_rows": "Q8_0's row body for decode GEMVs in GGUF order, on int8 x "
                 "(carve_kernels/gemv_dot.py)",
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
    ``CARVE_PDL``: ``1`` (default) or ``0``. On, the kernels launch with programmatic
        dependent launch on GPUs of compute capability 9.0 and later (carve_kernels/pdl.py), so that
        each may start while the one before it finishes; off, each waits for the one before.
    ``CARVE_TRIAL``: empty (default), ``all``, or a comma-separated list of the names in
        ``TRIALS``: kernels written and checked against references but not yet adopted (not
        yet measured to win on a GPU), switched on for measuring them through the engine
        and ``carve bench`` before they are.
    """

    runner: str = "auto"  # CARVE_RUNNER
    q8x: bool = True  # CARVE_Q8X
    expert_q8: bool = True  # CARVE_EXPERT_Q8
    t_layout: bool = True  # CARVE_T_LAYOUT
    pdl: bool = True  # CARVE_PDL
    trials: frozenset[str] = frozenset()  # CARVE_TRIAL

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
                   t_layout=_switch(environ, "CARVE_T_LAYOUT"), pdl=_switch(environ, "CARVE_PDL"),
                   trials=_trials(environ))

    def apply(self) -> None:
        """Set what these options switch for the whole process (the entry points call it once,
        after reading them): the trials that are module tables of the kernels."""
        bodies = {t for name, t in ROW_TRIALS.items() if name in self.trials}
        if bodies:
            from carve_kernels import quant_matmul

            quant_matmul.ROW_BODY_TYPES = quant_matmul.ROW_BODY_TYPES | bodies


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


def _switch(environ: Mapping[str, str], name: str) -> bool:
    # a switch that is on unless set to 0
    value = environ.get(name, "").strip()
    if not value:
        return True
    if value not in SWITCH:
        raise CarveError(f"{name}={value}: use 1 (on, the default) or 0 (off)")
    return SWITCH[value]
