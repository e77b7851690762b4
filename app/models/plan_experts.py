"""`PlanModel`'s mixture-of-experts placement (it mixes this in): per GPU how many MoE
layers keep their experts in VRAM (None: Auto), where that puts each GPU's first host layer
(the split strip's dashed line, which drags through ``set_host_cut``), the expert-cache slots
and where host experts run. Qt-free, like the model."""

from __future__ import annotations

from typing import Any

from engine.planning.plan import HOST_COMPUTE
from spec.errors import CarveError


class ExpertPlacement:
    """Reads and writes the PlanModel's ``experts_resident``, ``expert_slots`` and
    ``host_compute`` (its ``gguf``, ``split``, ``layout``, ``active_devices`` and
    ``_settings_changed`` too)."""

    gguf: Any
    split: tuple[int, ...]
    layout: Any
    experts_resident: tuple[int, ...] | None
    expert_slots: int
    host_compute: str

    def set_experts_resident(self, counts: tuple[int, ...] | list[int] | None) -> None:
        """Per active GPU, the MoE layers whose experts stay in VRAM; None: Auto."""
        counts = None if counts is None else tuple(int(c) for c in counts)
        if counts != self.experts_resident:
            self.experts_resident = counts
            self._settings_changed()

    def moe_layers(self, stage: int) -> list[int]:
        """The layers of active stage ``stage`` that hold routed experts ([] for a dense model,
        a CPU stage, which keeps everything in its RAM, or a plan that could not be priced:
        the fit check says why)."""
        devices = self.active_devices()
        if self.gguf is None or self.layout is None or not 0 <= stage < len(devices) \
                or devices[stage].index < 0 or len(self.split) != len(devices) + 1:
            return []
        from engine.planning.carve import model_index

        try:
            idx = model_index(self.gguf)
        except CarveError:  # a file the pricer refuses: the fit check says why
            return []
        lo, hi = self.split[stage], self.split[stage + 1]
        # (a model just opened, its split not yet reset to its layers: nothing to show yet)
        return idx.moe_layers(lo, hi) if hi <= len(idx.expert_slot) else []

    def resident_counts(self) -> tuple[int, ...]:
        """Per active stage, the MoE layers whose experts stay in VRAM in the priced plan
        (Auto's choice where the counts are not set)."""
        return tuple(self._resident(i, self.moe_layers(i))
                     for i in range(len(self.active_devices())))

    def _resident(self, stage: int, moe: list[int]) -> int:
        # the priced plan's count for the stage whose MoE layers are ``moe`` (all of them
        # before anything is priced)
        if self.layout is None:
            return len(moe)
        return min(len(moe), self.layout.plan.resident(stage))

    def host_cut(self, stage: int) -> int | None:
        """The first layer of stage ``stage`` whose experts live in host memory (its end when
        none does); None for a stage without MoE layers."""
        moe = self.moe_layers(stage)
        if not moe:
            return None
        r = self._resident(stage, moe)
        return moe[r] if r < len(moe) else self.split[stage + 1]

    def set_host_cut(self, stage: int, value: float) -> int:
        """Keep the experts of stage ``stage``'s MoE layers left of ``value`` in VRAM and the
        rest in host memory: the count snaps to whole MoE layers, the other stages keep theirs
        (Auto's become fixed on a change). Returns where the cut landed (a layer index)."""
        moe = self.moe_layers(stage)
        if not moe:
            raise IndexError(f"stage {stage} has no MoE layers")
        r = sum(1 for layer in moe if layer < round(value))
        counts = list(self.resident_counts())
        if counts[stage] != r:
            counts[stage] = r
            self.set_experts_resident(counts)
        cut = self.host_cut(stage)
        return self.split[stage + 1] if cut is None else cut

    def set_expert_slots(self, n: int) -> None:
        if n != self.expert_slots:
            self.expert_slots = max(0, int(n))
            self._settings_changed()

    def set_host_compute(self, where: str) -> None:
        if where not in (*HOST_COMPUTE, "auto"):
            raise CarveError(f"host compute: unknown {where!r}; use auto, gpu, cpu or both")
        if where != self.host_compute:
            self.host_compute = where
            self._settings_changed()
