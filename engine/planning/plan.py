"""The Plan: everything a launch is, before anything is allocated (DESIGN.md "The one rule").

Checks that need no model happen here, each naming its option; checks that need the model
(last boundary == n_layer, ctx <= n_ctx_train) happen in `engine.planning.price.price`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

from engine.hardware.devices import DeviceSpec
from engine.planning.rules import CACHE_RESERVE, PREFILL_CHUNK, ArenaKind, KvType, parse_arena
from spec.errors import CarveError

if TYPE_CHECKING:
    from engine.gguf.reader import FileStamp

ACT_DTYPES = ("f32", "bf16", "f16")
MAX_DEVICES = 8
ALL_RESIDENT = 1 << 30  # "every MoE layer of the stage keeps its experts in VRAM"
HOST_COMPUTE = ("gpu", "cpu", "both")


def _per_device(flag: str, counts: Any, n: int) -> tuple[int, ...]:
    """One count per device, each 0 or more; () means the default for every device."""
    try:
        out = tuple(int(c) for c in counts)
    except (TypeError, ValueError):
        raise CarveError(f"{flag}: expected whole numbers, one per device, got {counts!r}") from None
    if out and len(out) != n:
        raise CarveError(f"{flag}: {n} device(s) need {n} counts, got {len(out)}: "
                         f"{','.join(map(str, out))}")
    if any(c < 0 for c in out):
        raise CarveError(f"{flag}: counts must be 0 or more, got {','.join(map(str, out))}")
    return out


def parse_counts(flag: str, text: str) -> tuple[int, ...]:
    """ "40,48" -> (40, 48): a command line's per-device counts; CarveError naming ``flag``."""
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise CarveError(
            f"{flag}: cannot read {text!r}; give whole numbers, one per device, like 40,48"
        ) from None


@dataclass(frozen=True, slots=True)
class Plan:
    model: str  # path of the GGUF (any shard)
    devices: tuple[DeviceSpec, ...]
    # len(devices)+1 boundaries, split[0] = 0, split[-1] = n_layer; stage i runs
    # [split[i], split[i+1]). Strictly increasing: a device in a plan holds >= 1 layer; a
    # device that should hold nothing is left out of the plan (see engine/planning/split.py).
    split: tuple[int, ...]
    ctx: int
    kv_type: KvType = KvType.F16
    prefill_chunk: int = PREFILL_CHUNK
    cache_reserve: int = CACHE_RESERVE  # bytes kept free; the dequant cache gets the rest
    arena: str = ArenaKind.PACKED.value  # "packed" | "per-tensor" | "chunked:N" (N MiB)
    act_dtype: str = "f32"  # CPU "f32"; GPU "bf16"
    # Rows of logits the last stage keeps: 1 for chat (last token only), prefill_chunk for
    # perplexity (every position). Sizes buf.logits.
    logits_rows: int = 1
    # Mixture-of-experts placement, per device (DESIGN.md "Experts in host memory"): how many
    # of its stage's MoE layers keep their routed experts in VRAM, counted from the stage's
    # first MoE layer; the stage's other (last) MoE layers keep them in pinned host memory and
    # the CPU computes them. () or a count >= the stage's MoE layers: all in VRAM.
    experts_resident: tuple[int, ...] = ()
    # per device: VRAM slots of the expert cache, one slot one expert (gate, up and down) of
    # one layer, sized for the stage's largest; () : none
    expert_slots: tuple[int, ...] = ()
    # the host memory pinned experts are priced against (cpu_spec(): MemAvailable when the plan
    # was made; a simulated rig's stated RAM); None: read live when the plan is priced
    host: DeviceSpec | None = None
    # where a host layer's experts run: "gpu" (copied over PCIe into VRAM: the chosen experts
    # in decode, the whole layer in prefill, through a priced staging span), "cpu" (the CPU
    # computes them in place, from its own layouts; nothing more in VRAM) or "both" (decode
    # splits each token's experts between the CPU, from its layouts, and the GPU, over PCIe;
    # prefill copies the file's bytes in: host memory holds both)
    host_compute: str = "gpu"
    # the model's files as they were when the plan was made (engine.gguf.reader.FileStamp, one
    # per shard): the engine refuses a plan whose file changed since (`check_identity`); ()
    # (plans written before, plans built by hand): not checked
    identity: tuple[FileStamp, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "devices", tuple(self.devices))
        object.__setattr__(self, "split", tuple(int(b) for b in self.split))
        n = len(self.devices)
        if not 1 <= n <= MAX_DEVICES:
            raise CarveError(f"--gpus: a plan needs 1 to {MAX_DEVICES} devices, got {n}")
        if any(d.is_cpu for d in self.devices) and n > 1:
            raise CarveError("--gpus: the CPU runs a model alone; do not mix 'cpu' with GPUs")
        if len(self.split) != n + 1:
            raise CarveError(
                f"--split: {n} device(s) need {n + 1} boundaries (0,...,n_layer), "
                f"got {len(self.split)}: {','.join(map(str, self.split))}"
            )
        if self.split[0] != 0:
            raise CarveError(f"--split: the first boundary must be 0, got {self.split[0]}")
        for i in range(n):
            if self.split[i + 1] <= self.split[i]:
                raise CarveError(
                    f"--split: boundaries must increase ({self.split[i]} then {self.split[i + 1]} "
                    f"leaves {self.devices[i].label} no layers); drop that device instead"
                )
        if self.ctx <= 0:
            raise CarveError(f"--ctx: must be a positive number of tokens, got {self.ctx}")
        object.__setattr__(self, "kv_type", KvType.parse(self.kv_type))
        if self.prefill_chunk <= 0:
            raise CarveError(f"--prefill-chunk: must be positive, got {self.prefill_chunk}")
        if self.cache_reserve < 0:
            raise CarveError(f"--cache-reserve: must be 0 or more, got {self.cache_reserve}")
        if self.act_dtype not in ACT_DTYPES:
            raise CarveError(
                f"act_dtype: unknown {self.act_dtype!r}; use one of {', '.join(ACT_DTYPES)}"
            )
        if not 1 <= self.logits_rows <= max(self.prefill_chunk, 1):
            raise CarveError(
                f"logits_rows: must be 1..prefill_chunk ({self.prefill_chunk}), got {self.logits_rows}"
            )
        parse_arena(self.arena)  # raises CarveError naming --arena
        if self.host_compute not in HOST_COMPUTE:
            raise CarveError(
                f"--host-compute: unknown {self.host_compute!r}; use gpu, cpu or both")
        for flag, name in (("--experts-resident", "experts_resident"),
                           ("--expert-slots", "expert_slots")):
            counts = _per_device(flag, getattr(self, name), n)
            object.__setattr__(self, name, counts)
            if counts and self.devices[0].is_cpu:
                raise CarveError(
                    f"{flag}: a CPU plan keeps every expert in system RAM already; leave it out")
        if self.host_compute != "gpu" and any(self.expert_slots):
            raise CarveError(
                "--expert-slots: the slots feed decode's host experts to the GPU's kernels, and "
                f"with --host-compute {self.host_compute} the CPU computes them from layouts of "
                "its own; leave --expert-slots out or use --host-compute gpu")

    def resident(self, i: int) -> int:
        """MoE layers of stage i whose experts stay in VRAM (a large number: all)."""
        return self.experts_resident[i] if self.experts_resident else ALL_RESIDENT

    def slots(self, i: int) -> int:
        return self.expert_slots[i] if self.expert_slots else 0

    @property
    def n_layer(self) -> int:
        return self.split[-1]

    def stages(self) -> list[tuple[int, int]]:
        return [(self.split[i], self.split[i + 1]) for i in range(len(self.devices))]

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {f.name: getattr(self, f.name) for f in fields(self)}
        out["devices"] = [d.to_json() for d in self.devices]
        out["split"] = list(self.split)
        out["experts_resident"] = list(self.experts_resident)
        out["expert_slots"] = list(self.expert_slots)
        out["host"] = None if self.host is None else self.host.to_json()
        out["identity"] = [s.to_json() for s in self.identity]
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any] | str) -> Plan:
        if isinstance(data, str):
            try:
                data = json.loads(data)
            except ValueError as exc:
                raise CarveError(f"plan: not valid JSON: {exc}") from None
        if not isinstance(data, dict):
            raise CarveError("plan: expected a JSON object")
        try:
            kw = {f.name: data[f.name] for f in fields(cls) if f.name in data}
            kw["devices"] = tuple(DeviceSpec.from_json(d) for d in data["devices"])
            kw["split"] = tuple(data["split"])
            for name in ("experts_resident", "expert_slots"):
                kw[name] = tuple(data.get(name) or ())
            kw["host"] = DeviceSpec.from_json(data["host"]) if data.get("host") else None
            if data.get("identity"):
                from engine.gguf.reader import FileStamp

                kw["identity"] = tuple(FileStamp.from_json(s) for s in data["identity"])
            else:
                kw["identity"] = ()
            return cls(**kw)
        except (KeyError, TypeError, ValueError) as exc:
            raise CarveError(f"plan: missing or malformed field {exc}") from None

    def check_identity(self, stamps: tuple[FileStamp, ...]) -> None:
        """CarveError naming the file and what changed when the model's files as read now
        (``stamps``, GGUFModel.stamps) are not the ones this plan was made for: a size or a
        header (metadata, tensor table) that differs. A file rewritten with the same size and
        header (only its time differs) still loads: everything the plan priced is the same."""
        if not self.identity:
            return
        fix = "re-plan (reopen the model)"
        if len(stamps) != len(self.identity):
            raise CarveError(f"{self.model}: the model now has {len(stamps)} file(s), the plan was "
                             f"made for {len(self.identity)}; {fix}")
        for was, now in zip(self.identity, stamps):
            if was.size != now.size:
                raise CarveError(f"{now.name}: the file changed since the plan was made ({was.size} "
                                 f"bytes then, {now.size} now): another model or a partial copy; "
                                 f"{fix}")
            if was.header_sha256 != now.header_sha256:
                raise CarveError(f"{now.name}: the file changed since the plan was made (its header, "
                                 f"the metadata and tensor table, differs: another model of the "
                                 f"same size); {fix}")
