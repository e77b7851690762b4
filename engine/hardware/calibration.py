"""Runtime overhead per device: measured once by the engine, remembered, else a stated default.

The engine measures what a device loses outside our arenas (CUDA context, cuBLAS workspace,
CUDA graph pools, Triton modules) at start and calls `remember`; pricing reads the record for
the same (GPU name, driver, torch version). Records live in `calibration.json` in Carve's
config folder (`config_dir`, which the window's presets share).

Default without a record: what a launch took on an H200 (torch 2.11, driver 580), split by the
load timeline's NVML marks (`carve bench --engine`): the CUDA context as the fit check creates
it 524 MiB, kernel modules loaded on first use while the weights load and the stage is built
(torch's and Triton's) 162 MiB, the warm-up's cuBLAS handle, workspace and GEMM kernels 94 MiB
(those three the same for the Qwen2 0.5B and 7B and the Qwen3-30B-A3B shapes on 2026-12-01),
and the CUDA graphs: decode's 2 MiB then; with the prefill graphs (2026-12-04: one per chunk
length, and their capture stream) the whole overhead measured 820, 824 and 830 MiB on those
three shapes (820 and 824 again on 0.5B and 7B the same week), so the graphs' part is taken as
45 MiB: the whole within 5 MiB of each of the three.
The CPU device has no such overhead: 0.
"""

from __future__ import annotations

import functools
import json
import os
import time
from importlib import metadata
from pathlib import Path
from typing import Any

from engine.hardware.devices import DeviceSpec, driver_version

MIB = 1 << 20
DEFAULT_PARTS = {"cuda_context": 524 * MIB, "kernel_modules": 162 * MIB, "cublas": 94 * MIB,
                 "cuda_graphs": 45 * MIB}
DEFAULT_OVERHEAD = sum(DEFAULT_PARTS.values())
DEFAULT_SOURCE = (f"default ({DEFAULT_OVERHEAD // MIB} MiB measured on an H200: " + " + ".join(
    f"{k.replace('_', ' ')} {v // MIB}" for k, v in DEFAULT_PARTS.items()) + ")")

_cache: dict[str, Any] = {"path": None, "mtime": None, "records": [], "checked": 0.0}


def config_dir() -> Path:
    """Carve's config folder: ``$CARVE_CONFIG_DIR``, else ``$XDG_CONFIG_HOME/carve``, else
    ``~/.config/carve``. Calibration records and the window's presets both live here."""
    if os.environ.get("CARVE_CONFIG_DIR"):
        return Path(os.environ["CARVE_CONFIG_DIR"])
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "carve"


def path() -> Path:
    return config_dir() / "calibration.json"


@functools.cache
def torch_version() -> str:
    """The installed torch's version without importing it (the GUI never imports torch)."""
    try:
        return metadata.version("torch")
    except metadata.PackageNotFoundError:
        return ""


def _records() -> list[dict[str, Any]]:
    # Pricing asks per stage, thousands of times in a split search: look at the file at most
    # once a second (and whenever the config dir changes), not on every call.
    p = path()
    now = time.monotonic()
    if _cache["path"] == p and now - _cache["checked"] < 1.0:
        return _cache["records"]
    try:
        mtime = p.stat().st_mtime_ns
    except OSError:
        mtime = None
    if mtime is None:
        recs: list[dict[str, Any]] = []
    elif _cache["path"] == p and _cache["mtime"] == mtime:
        recs = _cache["records"]
    else:
        try:
            data = json.loads(p.read_text())
            recs = [
                r
                for r in data.get("records", [])
                if isinstance(r, dict) and isinstance(r.get("overhead"), int) and r["overhead"] >= 0
            ]
        except (OSError, ValueError, AttributeError):
            recs = []  # a damaged file means "not calibrated", never a failed plan
    _cache.update(path=p, mtime=mtime, records=recs, checked=now)
    return recs


def overhead_for(device: DeviceSpec) -> tuple[int, str]:
    """(bytes, source) for a device. A live GPU needs a record for its exact name, driver and
    torch version; a simulated card takes the newest record for its name and torch version."""
    if device.is_cpu:
        return 0, "cpu: none"
    tv = torch_version()
    drv = "" if device.simulated else driver_version()
    best = None
    for r in _records():
        if r.get("gpu") != device.name or r.get("torch") != tv:
            continue
        if not device.simulated and r.get("driver") != drv:
            continue
        if best is None or r.get("measured", "") >= best.get("measured", ""):
            best = r
    if best is None:
        return DEFAULT_OVERHEAD, DEFAULT_SOURCE
    return best["overhead"], f"calibrated {best.get('measured', '')} (driver {best.get('driver')})"


def remember(
    gpu: str, driver: str, torch: str, overhead: int, parts: dict[str, int] | None = None
) -> None:
    """Store a measured overhead; replaces the record for the same (gpu, driver, torch)."""
    p = path()
    recs = [
        r
        for r in _records()
        if (r.get("gpu"), r.get("driver"), r.get("torch")) != (gpu, driver, torch)
    ]
    recs.append(
        {
            "gpu": gpu,
            "driver": driver,
            "torch": torch,
            "overhead": int(overhead),
            "parts": parts or {},
            "measured": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }
    )
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_suffix(".tmp")
    tmp.write_text(json.dumps({"records": recs}, indent=1))
    tmp.replace(p)  # atomic: a reader never sees half a file
    _cache["path"] = None  # read it again on the next price
