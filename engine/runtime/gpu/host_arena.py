"""A GPU stage's host arenas (DESIGN.md "Experts in host memory"): checked against the host RAM
available before anything is allocated, allocated one pageable allocation per arena and pinned
in place with cudaHostRegister (so that the pinned bytes are exactly the priced ones), their
expert tensors read in the CPU's own layouts where the CPU computes them, and every block scale
checked. engine/runtime/gpu/host.py runs the experts that live there.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from engine.planning.host import CPU_PREFIX, HOST_PURPOSES, tensor_cpu_layout
from engine.runtime.models import cpu_experts
from spec.errors import CarveError

log = logging.getLogger("carve.engine")


def check_host(layout: Any) -> None:
    """Before anything is allocated: CarveError when the host RAM available now cannot take
    what the plan pins there (the machine's memory changed since the plan was priced)."""
    host = getattr(layout, "host", None)
    if host is None:
        return
    from engine.hardware.devices import cpu_spec
    from engine.planning.layout import human

    now = cpu_spec()
    avail = now.free - host.device.reserve
    if host.pinned > avail:
        raise CarveError(
            f"host RAM: the plan pins {human(host.pinned)} of experts and buffers in host "
            f"memory and {human(avail)} is available now ({human(host.device.free)} when it "
            "was priced); re-plan (carve plan, or Auto in the window) or free memory")


def new_host_arena(nbytes: int, pin: bool) -> tuple[torch.Tensor, bool]:
    """One host allocation of ``nbytes`` and whether it is pinned. ``pin``: register it with
    the driver (a GPU stage with CUDA); a refusal (the OS's locked-memory limit) leaves it
    pageable, says so once in the log, and costs the same bytes."""
    buf = torch.empty(nbytes, dtype=torch.uint8)
    if not pin or nbytes == 0:
        return buf, False
    code = torch.cuda.cudart().cudaHostRegister(buf.data_ptr(), nbytes, 0)
    if int(code) != 0:
        log.warning("pinning %d bytes of host experts was refused (cudaHostRegister error %s): "
                    "they stay in pageable memory and copies to the GPU run slower",
                    nbytes, int(code))
        return buf, False
    return buf, True


def unpin(buf: torch.Tensor) -> None:
    """Undo `new_host_arena`'s registration (before the memory is freed)."""
    torch.cuda.cudart().cudaHostUnregister(buf.data_ptr())


def allocate_host(dl: Any, pin: bool, arenas: list[tuple[torch.Tensor, bool]],
                  spans: dict[str, torch.Tensor], dtypes: dict[str, torch.dtype]) -> None:
    """The DeviceLayout's host arenas, each one host allocation (pinned where ``pin``), every
    span a view into it (typed for the buffers, raw bytes for the experts). ``arenas``: the
    caller's list of (allocation, pinned), filled as it goes, so that a failure midway leaves
    the caller holding (and able to unpin) every one already made."""

    for a in dl.arenas:
        if a.purpose not in HOST_PURPOSES:
            continue
        buf, pinned = new_host_arena(a.nbytes, pin)
        arenas.append((buf, pinned))
        for s in a.spans:
            raw = buf[s.offset:s.offset + s.nbytes]
            if a.purpose != "host_experts":
                raw = raw.view(dtypes[s.dtype]).view(s.shape)
            spans[s.name] = raw


def check_scales(model: Any, names: list[str], spans: dict[str, torch.Tensor]) -> None:
    """CarveError naming a host expert tensor with a block whose scale is inf or NaN (a
    damaged file), read by the CPU where it lies (the stage's device scan reads only its own
    memory)."""
    from carve_kernels.scale_scan import first_bad_block

    for name in names:
        info = model.tensor(name)
        if len(info.shape) >= 2 and first_bad_block(spans[name], info.ggml_type) is not None:
            raise bad_scale(model, name)


def bad_scale(model: Any, name: str) -> CarveError:
    from spec import quant_types as qt

    info = model.tensor(name)
    return CarveError(
        f"{model.paths[info.shard]}: tensor {name} has a block whose "
        f"{qt.type_name(info.ggml_type)} scale is not finite (inf or NaN): the file is "
        "damaged; download or convert it again")


def load_cpu_layouts(model: Any, names: list[str], spans: dict[str, torch.Tensor],
                     host_compute: str, cancelled: Callable[[], bool] | None = None
                     ) -> tuple[list[str], int]:
    """host_compute "cpu": read the host expert tensors of ``names`` that have a CPU layout
    (`tensor_cpu_layout`) from the file into their spans in that layout, checking every
    block's scale on the way; returns (the names to load as the file has them, file bytes
    read). Spans "cpu.<name>" (host_compute "both") are left out: `fill_cpu_copies` makes
    them from the file's bytes once those are loaded."""
    from carve_kernels.scale_scan import first_bad_block

    plain, done = [], 0
    for name in names:
        if name.startswith(CPU_PREFIX):
            continue
        info = model.tensor(name)
        shape = tuple(int(d) for d in info.shape)
        if host_compute != "cpu" or tensor_cpu_layout(name, info.ggml_type, shape) == "file":
            plain.append(name)
            continue

        def check(raw: torch.Tensor, info: Any = info, name: str = name) -> None:
            if first_bad_block(raw, info.ggml_type) is not None:
                raise bad_scale(model, name)

        done += cpu_experts.load_packed(model, name, spans[name], cancelled, check)
    return plain, done


def fill_cpu_copies(model: Any, names: list[str], spans: dict[str, torch.Tensor],
                    cancelled: Callable[[], bool] | None = None) -> None:
    """host_compute "both": each span "cpu.<name>" of ``names`` made from tensor <name>'s
    file bytes, already in its own host span (checked by then)."""
    for span_name in names:
        if not span_name.startswith(CPU_PREFIX):
            continue
        if cancelled is not None and cancelled():
            raise CarveError("load cancelled")
        name = span_name.removeprefix(CPU_PREFIX)
        info = model.tensor(name)
        m = cpu_experts.host_matrix(model, name, spans[span_name], spans["hbuf.dequant"])
        assert isinstance(m, cpu_experts.PackedExperts), "a cpu. span holds a CPU layout"
        m.fill(spans[name], info.ggml_type, 0)
