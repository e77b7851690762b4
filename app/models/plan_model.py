"""The launch being edited: model, devices, split boundaries and settings, re-priced on every change.

Qt-free (napari's ``components/dims.py`` habit): widgets mirror it and only write back through its
setters. Snapping a dragged boundary to a whole layer happens here, not in the view, so the view,
the keyboard and a test all get the same answer. Every setter re-prices at once through
``engine.planning.price.price`` (pure arithmetic, ~ms) and emits ``events.layout``.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from app.models.events import Events
from app.models.plan_experts import ExpertPlacement
from engine.planning.plan import HOST_COMPUTE
from engine.planning.rules import (
    CACHE_RESERVE,
    DEFAULT_CTX,
    MIN_CTX,
    PREFILL_CHUNK,
    ArenaKind,
    KvType,
    Verdict,
    act_dtype_for,
    parse_arena,
)
from spec.errors import CarveError


@dataclass(frozen=True, slots=True)
class Fix:
    """A one-click change that makes the plan fit (or fit better); ``apply`` mutates the model."""

    label: str
    apply: Callable[[], None]


def _default_pricer(plan: Any, model: Any) -> Any:
    from engine.planning.price import price

    return price(plan, model)


class PlanModel(ExpertPlacement):
    """Editable launch configuration; ``layout`` is always the price of the current ``plan()``."""

    def __init__(self, pricer: Callable[[Any, Any], Any] | None = None) -> None:
        self.events = Events("model", "devices", "split", "settings", "layout")
        self._pricer = pricer or _default_pricer
        self.gguf: Any = None
        self.hparams: Any = None
        self.devices: tuple[Any, ...] = ()
        self.excluded: frozenset[int] = frozenset()
        self.split: tuple[int, ...] = ()
        self.ctx = DEFAULT_CTX
        self.kv_type = KvType.F16
        self.prefill_chunk = PREFILL_CHUNK
        self.cache_reserve = CACHE_RESERVE
        self.arena = str(ArenaKind.PACKED)
        # mixture-of-experts placement: per active GPU, the MoE layers whose experts stay in
        # VRAM (None: Auto, engine.planning.defaults.place_experts), and expert-cache slots
        self.experts_resident: tuple[int, ...] | None = None
        self.expert_slots = 0
        # where host-memory experts run (Plan.host_compute): "gpu" reads the routed ones over
        # PCIe, "cpu" computes them where they lie (no expert-cache slots then), "both" splits
        # decode's between them; "auto": default_plan's choice (`auto_host_compute`)
        self.host_compute = "auto"
        # which devices a new model or rig runs on (engine.planning.split's `prefer`): "auto"
        # keeps a model that fits on one GPU on one; "spread" (one click away) uses them all
        self.prefer = "auto"
        self.layout: Any = None
        self.error = ""
        self.price_ms = 0.0

    # -- what is being planned ---------------------------------------------------------------
    @property
    def n_layer(self) -> int:
        # the layers the model runs (a GLM file's NextN layer is declared but never run)
        return int(self.hparams.n_layer_run) if self.hparams is not None else 0

    @property
    def max_ctx(self) -> int:
        return int(self.hparams.n_ctx_train) if self.hparams is not None else 131072

    def set_model(self, gguf: Any, hparams: Any) -> None:
        self.gguf, self.hparams = gguf, hparams
        self.ctx = max(MIN_CTX, min(self.ctx, self.max_ctx))
        self.events.model.emit(gguf)
        excluded = self.excluded
        self._choose_devices()
        if self.excluded != excluded:
            self.events.devices.emit(self.devices)

    def open_model(self, path: str) -> None:
        """Read the GGUF header (fast) and plan for it. Raises CarveError on a bad file."""
        from engine.gguf.hparams import HParams
        from engine.gguf.reader import GGUFModel

        gguf = GGUFModel.open(path)
        self.set_model(gguf, HParams.from_model(gguf))

    def set_devices(self, devices: list[Any] | tuple[Any, ...]) -> None:
        """Replace the candidate devices (a new NVML view or a simulated rig); resets the split
        unless the devices are the same cards as before (a live refresh of free memory)."""
        devices = tuple(devices)
        same_cards = [(d.index, d.name, d.total) for d in devices] == [
            (d.index, d.name, d.total) for d in self.devices
        ]
        self.devices = devices
        if same_cards:
            self.reprice()
            return
        self._choose_devices()
        self.events.devices.emit(devices)

    def active_devices(self) -> tuple[Any, ...]:
        return tuple(d for i, d in enumerate(self.devices) if i not in self.excluded)

    def set_excluded(self, position: int, excluded: bool) -> None:
        """Leave the device at ``position`` (in ``devices``) out of the plan, or bring it back."""
        new = set(self.excluded)
        (new.add if excluded else new.discard)(position)
        if len(new) >= len(self.devices) or frozenset(new) == self.excluded:
            return  # at least one device stays in
        self.excluded = frozenset(new)
        self._reset_split()
        self.events.devices.emit(self.devices)

    def pick_devices(self, prefer: str) -> None:
        """Auto ("auto": one GPU when the model fits on one, else all) or Spread ("spread": every
        GPU): which devices run the model and its boundaries, by the split search's rule; the
        choice holds for the next model or rig until the other is picked."""
        self.prefer = prefer
        excluded = self.excluded
        self._choose_devices()
        if self.excluded != excluded:
            self.events.devices.emit(self.devices)

    def _choose_devices(self) -> None:
        """Every device a candidate again; the split search (``self.prefer``) leaves out those
        it does not need. Re-prices whether or not the boundaries moved."""
        self.excluded = frozenset()
        split = self.split
        found = self._search(self.devices, self.prefer)
        if found is not None:
            chosen, bounds = found
            self.excluded = frozenset(i for i, d in enumerate(self.devices) if d not in chosen)
            self.set_split(bounds)
        else:
            self._reset_split()
        if self.split == split:  # the same boundaries on other devices: set_split priced nothing
            self.reprice()

    # -- split -------------------------------------------------------------------------------
    def _reset_split(self) -> None:
        n_dev = len(self.active_devices())
        if self.hparams is None or n_dev == 0:
            self.split = ()
            self.events.split.emit(self.split)
            self.reprice()
            return
        if not self.auto_split():
            self.set_split(even_split(self.n_layer, n_dev))

    def set_split(self, split: tuple[int, ...] | list[int]) -> None:
        split = tuple(int(b) for b in split)
        if split == self.split:
            return
        self.split = split
        self.events.split.emit(split)
        self.reprice()

    def boundary_bounds(self, i: int) -> tuple[int, int]:
        """Where inner boundary ``i`` (1..n_dev-1) may go: every stage keeps at least one layer."""
        return self.split[i - 1] + 1, self.split[i + 1] - 1

    def set_boundary(self, i: int, value: float) -> int:
        """Move inner boundary ``i`` to ``value`` snapped to a whole layer within its bounds;
        returns the snapped value. Re-prices only when the snapped boundary moved."""
        if not 0 < i < len(self.split) - 1:
            raise IndexError(f"boundary {i} is not an inner boundary of {self.split}")
        lo, hi = self.boundary_bounds(i)
        snapped = int(min(max(round(value), lo), hi))
        if snapped != self.split[i]:
            split = list(self.split)
            split[i] = snapped
            self.set_split(split)
        return snapped

    def nudge_boundary(self, i: int, delta: int) -> int:
        return self.set_boundary(i, self.split[i] + delta)

    def auto_split(self) -> bool:
        """Take the split search's boundaries (most headroom on the tightest device); False if
        it could not (no search available, or nothing fits) — the split is then left as it was."""
        found = self.searched_split()
        if found is None:
            return False
        self.set_split(found)
        return True

    def searched_split(self) -> tuple[int, ...] | None:
        """``engine.planning.split.auto_split``'s boundaries over the active devices, or None."""
        devices = self.active_devices()
        found = self._search(devices, "spread")
        if found is None or found[0] != devices:
            return None  # the search left a device out (more devices than layers)
        return found[1]

    def _search(self, devices: tuple[Any, ...], prefer: str
                ) -> tuple[tuple[Any, ...], tuple[int, ...]] | None:
        """(the devices the split search keeps, their boundaries), or None."""
        if self.gguf is None or not devices:
            return None
        try:
            from engine.planning.split import auto_split

            found = auto_split(
                self.gguf, devices, prefer=prefer, ctx=self.ctx, kv_type=self.kv_type,
                prefill_chunk=self.prefill_chunk, cache_reserve=self.cache_reserve,
                arena=self.arena, act_dtype=self.act_dtype(devices),
            )
        except (ImportError, CarveError):
            return None
        chosen, split = tuple(found.devices), tuple(found.split)
        return (chosen, split) if valid_split(split, self.n_layer, len(chosen)) else None

    # -- settings ----------------------------------------------------------------------------
    def set_ctx(self, ctx: int) -> None:
        ctx = int(min(max(ctx, MIN_CTX), self.max_ctx))
        if ctx != self.ctx:
            self.ctx = ctx
            self._settings_changed()

    def set_kv_type(self, kv_type: str) -> None:
        kv_type = KvType.parse(kv_type)
        if kv_type != self.kv_type:
            self.kv_type = kv_type
            self._settings_changed()

    def set_prefill_chunk(self, chunk: int) -> None:
        chunk = int(max(16, chunk))
        if chunk != self.prefill_chunk:
            self.prefill_chunk = chunk
            self._settings_changed()

    def set_cache_reserve(self, nbytes: int) -> None:
        nbytes = int(max(0, nbytes))
        if nbytes != self.cache_reserve:
            self.cache_reserve = nbytes
            self._settings_changed()

    def set_arena(self, arena: str) -> None:
        arena = parse_arena(arena).text
        if arena != self.arena:
            self.arena = arena
            self._settings_changed()

    def _settings_changed(self) -> None:
        self.events.settings.emit()
        self.reprice()

    # -- pricing -----------------------------------------------------------------------------
    def act_dtype(self, devices: tuple[Any, ...] | None = None) -> str:
        return act_dtype_for(self.active_devices() if devices is None else devices)

    def plan(self, **changes: Any) -> Any:
        """The Plan as edited now (with optional field overrides, ``devices`` among them), or
        None if nothing to plan."""
        devices = tuple(changes.pop("devices", self.active_devices()))
        split = tuple(changes.pop("split", self.split))
        if self.gguf is None or not devices or len(split) != len(devices) + 1:
            return None
        from engine.planning.defaults import default_plan

        fields = {
            "split": split,
            "ctx": self.ctx,
            "kv_type": self.kv_type,
            "prefill_chunk": self.prefill_chunk,
            "cache_reserve": self.cache_reserve,
            "arena": self.arena,
            # the slots feed the GPU's kernels: a plan whose CPU computes host experts has none
            "expert_slots": (self.expert_slots,) if self.expert_slots
            and self.host_compute in ("gpu", "auto") else (),
            "host_compute": self.host_compute,
        }
        resident = self.experts_resident
        if resident is not None and len(resident) == len(devices):  # else: Auto
            fields["experts_resident"] = resident
        fields.update(changes)
        return default_plan(self.gguf, devices, **fields)

    def price_plan(self, plan: Any) -> Any:
        return self._pricer(plan, self.gguf)

    def reprice(self) -> None:
        plan = self.plan()
        self.layout, self.error = None, ""
        if plan is not None:
            start = time.perf_counter()
            try:
                self.layout = self.price_plan(plan)
            except CarveError as err:
                self.error = str(err)
            self.price_ms = (time.perf_counter() - start) * 1e3
        self.events.layout.emit(self.layout)

    def verdict(self) -> str:
        """The plan's verdict (its worst device's), "" when nothing is priced."""
        if self.layout is None:
            return Verdict.DOES_NOT_FIT if self.error else ""
        return self.layout.verdict

    def reason(self) -> str:
        """Why the plan does not run here (the runner, the tensor type it has no kernel for and
        what would run it), "" when it runs."""
        if self.layout is None:
            return ""
        return next((d.advice for d in self.layout.devices if d.verdict == Verdict.DOES_NOT_RUN),
                    "")

    def fixes(self) -> list[Fix]:
        """One-click changes that make a plan that does not fit, fit. Tried by pricing (each
        price is ~ms), so a suggested change is one the pricing model has already checked."""
        if self.layout is None or self.verdict() != Verdict.DOES_NOT_FIT:
            return []
        fixes: list[Fix] = []
        if self.kv_type == KvType.F16 and self._fits(kv_type=KvType.Q8_0):
            fixes.append(Fix("Use q8_0 KV cache", lambda: self.set_kv_type(KvType.Q8_0)))
        ctx = self._largest_fitting_ctx()
        if ctx is not None:
            fixes.append(Fix(f"Set context to {ctx:,}", lambda c=ctx: self.set_ctx(c)))
        found = self.searched_split() if len(self.active_devices()) > 1 else None
        if found is not None and found != self.split and self._fits(split=found):
            fixes.append(Fix("Rebalance the split (Auto)", lambda s=found: self.set_split(s)))
        spread = self._search(self.devices, "spread") if self.excluded else None
        if spread is not None and self._fits(devices=spread[0], split=spread[1]):
            fixes.append(Fix("Spread over every GPU", lambda: self.pick_devices("spread")))
        return fixes

    def _fits(self, **changes: Any) -> bool:
        plan = self.plan(**changes)
        try:
            layout = self.price_plan(plan)
        except CarveError:
            return False
        return layout.verdict.runs  # every device and the host line

    def _largest_fitting_ctx(self) -> int | None:
        if not self._fits(ctx=MIN_CTX):
            return None
        lo, hi = MIN_CTX // MIN_CTX, self.ctx // MIN_CTX  # in units of MIN_CTX; lo fits, hi not
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if self._fits(ctx=mid * MIN_CTX) else (lo, mid)
        return lo * MIN_CTX

    def rounding_by_arena(self, modes: tuple[str, ...]) -> dict[str, int]:
        """Arena rounding waste (bytes, all devices) the current plan would have in each mode."""
        out: dict[str, int] = {}
        for mode in modes:
            plan = self.plan(arena=mode)
            if plan is None:
                continue
            try:
                layout = self.price_plan(plan)
            except CarveError:
                continue
            out[mode] = sum(d.terms.get("rounding", 0) for d in layout.devices)
        return out

    # -- presets -----------------------------------------------------------------------------
    def settings(self) -> dict[str, Any]:
        """The launch configuration as plain JSON-able values (what a preset stores)."""
        return {
            "ctx": self.ctx,
            "kv_type": self.kv_type,
            "prefill_chunk": self.prefill_chunk,
            "cache_reserve": self.cache_reserve,
            "arena": self.arena,
            "split": list(self.split),
            "excluded": sorted(self.excluded),
            "experts_resident": None if self.experts_resident is None
            else list(self.experts_resident),
            "expert_slots": self.expert_slots,
            "host_compute": self.host_compute,
        }

    def apply_settings(self, data: dict[str, Any]) -> None:
        """Restore a preset; values that no longer apply (another rig, a shorter model) are
        dropped rather than forced."""
        with self.events.layout.blocked():
            if "ctx" in data:
                self.set_ctx(int(data["ctx"]))
            if data.get("kv_type") in tuple(KvType):
                self.set_kv_type(data["kv_type"])
            if "prefill_chunk" in data:
                self.set_prefill_chunk(int(data["prefill_chunk"]))
            if "cache_reserve" in data:
                self.set_cache_reserve(int(data["cache_reserve"]))
            try:
                self.set_arena(str(data.get("arena", self.arena)))
            except CarveError:
                pass
            resident = data.get("experts_resident")
            self.set_experts_resident(None if resident is None else tuple(resident))
            self.set_expert_slots(int(data.get("expert_slots", 0)))
            if data.get("host_compute") in (*HOST_COMPUTE, "auto"):
                self.set_host_compute(data["host_compute"])
            excluded = frozenset(int(i) for i in data.get("excluded", ()))
            in_range = all(0 <= i < len(self.devices) for i in excluded)
            if excluded != self.excluded and in_range and len(excluded) < len(self.devices):
                self.excluded = excluded
                self.events.devices.emit(self.devices)
            split = tuple(int(b) for b in data.get("split", ()))
            if valid_split(split, self.n_layer, len(self.active_devices())):
                self.set_split(split)
            elif len(self.split) != len(self.active_devices()) + 1:
                self.set_split(even_split(self.n_layer, len(self.active_devices())))
        self.reprice()


def even_split(n_layer: int, n_dev: int) -> tuple[int, ...]:
    """Boundaries giving each device n_layer/n_dev layers (the first ones get the remainder)."""
    if n_dev <= 0:
        return ()
    base, extra = divmod(n_layer, n_dev)
    bounds = [0]
    for i in range(n_dev):
        bounds.append(bounds[-1] + base + (1 if i < extra else 0))
    return tuple(bounds)


def valid_split(split: tuple[int, ...], n_layer: int, n_dev: int) -> bool:
    return (
        len(split) == n_dev + 1
        and split[0] == 0
        and split[-1] == n_layer
        and all(a < b for a, b in itertools.pairwise(split))
    )
