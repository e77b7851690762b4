"""GPU memory taken by another process between the fit check and the load (needs a CUDA GPU):
a plan made while the GPU had room, then a second process takes all but 256 MiB less than the
plan needs, then the real engine process loads it. The load is refused before its first
allocation in one sentence naming the device and the bytes short; once the other process is
gone the same engine loads the plan; and once the engine exits NVML's used memory is back to
what it was before.

    python -m pytest -q tests/engine/test_gpu_memory_taken.py     # on the GPU machine
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

torch = pytest.importorskip("torch")

from engine.process import protocol as p  # noqa: E402
from engine.process.client import EngineProcess  # noqa: E402
from spec.errors import CarveError  # noqa: E402

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
MIB = 1 << 20

# the other process: takes all the GPU's free memory but KEEP bytes, says so, holds it until
# its stdin closes
BLOCKER = """
import sys, torch
index, keep = int(sys.argv[1]), int(sys.argv[2])
torch.cuda.set_device(index)
free, _ = torch.cuda.mem_get_info(index)
held = torch.empty(max(0, free - keep), dtype=torch.uint8, device=f"cuda:{index}")
torch.cuda.synchronize(index)
print("held", held.numel(), flush=True)
sys.stdin.read()
"""


def nvml_used(cuda_index: int) -> int:
    from engine.hardware import devices

    (snap,) = [d for d in devices.snapshot() if d.cuda_index == cuda_index]
    return snap.used


def engine_used(cuda_index: int, pid: int) -> int | None:
    from engine.hardware import devices

    (snap,) = [d for d in devices.snapshot() if d.cuda_index == cuda_index]
    return next((q.used for q in snap.processes if q.pid == pid), None)


def settle(cuda_index: int, target: int, slack: int = 32 * MIB, timeout: float = 15) -> int:
    """NVML used once it is within ``slack`` of ``target`` (the driver frees a context late)."""
    deadline = time.monotonic() + timeout
    while abs((used := nvml_used(cuda_index)) - target) > slack and time.monotonic() < deadline:
        time.sleep(0.2)
    return used


def test_memory_taken_after_planning_is_refused_naming_the_device_and_bytes(tmp_path):
    from app.cli_chat import build_plan
    from engine.planning.price import price
    from engine.synth.gen import write_model

    # arenas of hundreds of MiB: well above the few MiB the driver keeps back from any one
    # allocation, so that the other process can leave less than the plan needs
    path = write_model(tmp_path / "small.gguf", "qwen2-0.5b", "q4_k_m")[0]
    plan = build_plan(path, "auto", 4096, "f16")  # priced and fitting now
    cuda = plan.devices[0].index
    need = price(plan).devices[0].total  # the arenas and the runtime overhead
    keep = need - min(need // 2, 256 * MIB)
    env = {**os.environ, "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}  # the engine's numbering
    before = nvml_used(cuda)
    with EngineProcess() as engine:
        engine.wait_for(p.Ready, timeout=120)
        other = subprocess.Popen([sys.executable, "-c", BLOCKER, str(cuda), str(keep)], env=env,
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        try:
            assert other.stdout.readline().startswith("held"), "the other process took nothing"
            engine.send(p.Load(plan.to_json()))
            with pytest.raises(CarveError) as err:
                engine.wait_for(p.Loaded, timeout=300)
        finally:
            other.stdin.close()
            other.wait(timeout=60)
        msg = str(err.value)
        assert msg.startswith(f"cuda:{cuda} ("), msg
        assert "another process took memory since the check" in msg, msg
        assert " short; " in msg and "the plan needs" in msg and "\n" not in msg, msg
        # refused before its first allocation: the engine holds its CUDA context, no arena
        own = engine_used(cuda, engine.pid)
        if own is not None:  # NVML shows per-process use (not in every container)
            assert own < need - price(plan).devices[0].allocated // 2, (own, need)
        # the memory is back: the same engine loads the same plan now
        engine.send(p.Load(plan.to_json()))
        loaded = engine.wait_for(p.Loaded, timeout=300)
        assert loaded.devices[0]["allocated"] == loaded.devices[0]["priced"]
        engine.send(p.Unload())
        engine.wait_for(p.Unloaded, timeout=60)
    after = settle(cuda, before)
    assert abs(after - before) <= 32 * MIB, (before, after)
