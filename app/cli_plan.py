"""`carve plan`: price a launch per GPU and say whether it fits, before anything is allocated.

    carve plan MODEL.gguf --gpus auto|RIG --ctx N --split 0,14,29,38,48|auto --prefer auto|spread|fewest
               --kv f16|q8_0 --cache-reserve MiB --arena packed|per-tensor|chunked:N
               --prefill-chunk N [--reserve MiB] [--json]
               --experts-resident auto|N,N --expert-slots N[,N] --host-compute auto|gpu|cpu|both
               --host-ram SIZE

With --gpus auto and no NVIDIA GPU, it plans for this machine's CPU (system RAM), which is
where the engine would run, and says so; --gpus RIG plans for GPUs you do not have.
Exit status: 0 fits (or tight), 1 does not fit, 2 bad input or does not run here (the runner
that would run the plan has no kernel for a tensor type of the file). Never imports torch.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import replace
from typing import Any, NoReturn

from engine.planning.host import PCIE_SHARE
from engine.planning.layout import Layout, human
from engine.planning.plan import HOST_COMPUTE
from engine.planning.rules import (
    CACHE_RESERVE,
    DEFAULT_CTX,
    PREFILL_CHUNK,
    TIGHT,
    KvType,
    Verdict,
)
from spec.errors import CarveError

MIB = 1 << 20


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line, exit 2, no usage dump
        raise CarveError(f"plan: {message} (see carve plan --help)")


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="carve plan", description="Price a launch per GPU and say whether it fits.")
    p.add_argument("model", help="GGUF file (any shard of a split set)")
    p.add_argument(
        "--gpus", default="auto", help='"auto", "cpu", "4x24GiB", "rtx4090,rtx4090,a6000"'
    )
    p.add_argument(
        "--ctx", type=int, help=f"context tokens (default {DEFAULT_CTX}, at most the model's)"
    )
    p.add_argument("--split", default="auto", help='boundaries "0,14,29,48" or "auto"')
    p.add_argument(
        "--prefer",
        default="auto",
        choices=("auto", "spread", "fewest"),
        help="--split auto: one GPU when the model fits on one, else all (auto); all GPUs "
        "(spread); or the fewest that fit",
    )
    p.add_argument("--kv", default=str(KvType.F16), help=f"KV cache type: {' or '.join(KvType)}")
    p.add_argument(
        "--cache-reserve",
        type=int,
        default=CACHE_RESERVE // MIB,
        metavar="MiB",
        help=f"MiB kept free after everything; the dequant cache gets the rest ({CACHE_RESERVE // MIB})",
    )
    p.add_argument(
        "--reserve",
        type=int,
        default=0,
        metavar="MiB",
        help="MiB to leave untouched on every GPU (desktop, other apps)",
    )
    p.add_argument("--arena", default="packed", help="packed | per-tensor | chunked:N (MiB)")
    p.add_argument("--prefill-chunk", type=int, default=PREFILL_CHUNK, metavar="N")
    add_expert_args(p)
    p.add_argument(
        "--host-ram",
        metavar="SIZE",
        help='host RAM to price pinned experts against, e.g. "64GiB" (default: what this '
        "machine has available now)",
    )
    p.add_argument("--json", action="store_true", help="print the Layout as JSON")
    return p


def add_expert_args(p: argparse.ArgumentParser) -> None:
    """The mixture-of-experts placement flags `carve plan`, `carve chat` and `carve serve`
    share (`expert_settings` reads them)."""
    p.add_argument(
        "--experts-resident",
        default="auto",
        metavar="auto|N,N",
        help="per GPU, how many of its MoE layers keep their experts in VRAM (its first ones; "
        "the rest in pinned host memory; --host-compute: where they run); auto: all when that fits, else "
        "the most that fit",
    )
    p.add_argument(
        "--expert-slots",
        default="",
        metavar="N[,N]",
        help="per GPU (one number: every GPU), VRAM slots of the expert cache, one expert each",
    )
    p.add_argument(
        "--host-compute",
        default="auto",
        choices=(*HOST_COMPUTE, "auto"),
        help="where experts in host memory run: gpu (decode gathers the routed ones over "
        "PCIe, prefill copies a layer's whole, into a staging span), cpu (computed in host "
        "memory, from the CPU's own layouts) or both (decode splits each token's experts "
        "between the CPU and the GPU, the share timed at load; prefill copies them to the "
        "GPU); auto: both where this machine's native CPU kernel reads every host layer's "
        "experts from the file's bytes (no more host RAM than gpu), else gpu",
    )


def expert_settings(args: argparse.Namespace) -> dict[str, Any]:
    """default_plan's keywords from `add_expert_args`' flags."""
    from engine.planning.plan import parse_counts

    text = args.experts_resident.strip().lower()
    resident = None if text == "auto" else parse_counts("--experts-resident", text)
    slots = parse_counts("--expert-slots", args.expert_slots) if args.expert_slots.strip() else ()
    return {"experts_resident": resident, "expert_slots": slots,
            "host_compute": args.host_compute}


def _host(text: str | None) -> Any:
    """--host-ram SIZE as the host memory a plan is priced against; None: this machine's."""
    if text is None:
        return None
    from engine.hardware.devices import DeviceSpec
    from engine.hardware.rigs import parse_size

    size = parse_size("--host-ram", text)
    return DeviceSpec(-1, f"{text} host RAM (stated)", size, size, simulated=True)


def _devices(gpus: str, reserve: int) -> tuple[list[Any], str]:
    from engine.hardware.devices import cpu_spec, no_gpu_reason
    from engine.hardware.rigs import parse_rig

    devices = parse_rig(gpus, reserve)
    note = ""
    if not devices and gpus.strip().lower() in ("", "auto"):
        # GPUs NVML sees but CUDA_VISIBLE_DEVICES hides leave no reason from NVML
        reason = no_gpu_reason().split(":")[0] or "no NVIDIA GPU visible to CUDA"
        devices = [cpu_spec(reserve)]
        note = (
            f"{reason} — planning for cpu (system RAM); --gpus RIG plans for GPUs you do not have"
        )
    return devices, note


def _split(text: str) -> tuple[int, ...] | None:
    if text.strip().lower() == "auto":
        return None
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise CarveError(
            f"--split: cannot read {text!r}; give boundaries like 0,14,29,48 or auto"
        ) from None


def build_layout(args: argparse.Namespace) -> tuple[Layout, Any, str]:
    from engine.planning.defaults import default_plan
    from engine.planning.price import open_model, price

    for name, value in (("--cache-reserve", args.cache_reserve), ("--reserve", args.reserve)):
        if value < 0:
            raise CarveError(f"{name}: must be 0 or more MiB, got {value}")
    devices, note = _devices(args.gpus, args.reserve * MIB)
    model = open_model(args.model)
    plan = default_plan(
        model,
        devices,
        split=_split(args.split),
        ctx=args.ctx,
        kv_type=args.kv,
        prefill_chunk=args.prefill_chunk,
        cache_reserve=args.cache_reserve * MIB,
        arena=args.arena,
        prefer=args.prefer,
        model_path=args.model,
        host=_host(args.host_ram),
        **expert_settings(args),
    )
    if args.prefer == "auto" and len(plan.devices) == 1 < len(devices):
        kept = ", ".join(d.label for d in plan.devices)
        note = "\n".join(filter(None, (note, (
            f"the model fits on one GPU with this context: it stays on {kept} (a split only "
            f"adds a hop); --prefer spread splits it over all {len(devices)}"))))
    return price(plan, model), model, note


ROWS = (
    ("weights", "weights"),
    ("experts", "experts"),  # mixture-of-experts models only
    ("globals", "globals"),
    ("kv", "KV cache"),
    ("buffers", "buffers"),
    ("expert_cache", "expert cache"),  # with slots only
    ("dequant_cache", "dequant cache"),
    ("overhead", "overhead"),
    ("rounding", "rounding"),
)


def _short(name: str) -> str:
    """ "NVIDIA GeForce RTX 4090" -> "RTX 4090": the column is narrow, the brand is given."""
    return name.removeprefix("NVIDIA ").removeprefix("GeForce ")[:20]


def render(layout: Layout, model: Any, note: str) -> str:
    plan = layout.plan
    hp_layers = plan.split[-1]
    size = getattr(model, "file_size", 0)
    lines = [
        (
            f"{plan.model}: {model.arch}, {hp_layers} layers, {human(size)}; ctx {plan.ctx}, "
            f"KV {plan.kv_type}, arena {plan.arena}, prefill chunk {plan.prefill_chunk}, "
            f"cache reserve {human(plan.cache_reserve)}"
        )
    ]
    if note:
        lines.append(note)
    lines.append(f"split {','.join(map(str, plan.split))}")
    devs = layout.devices
    heads = [d.device.label for d in devs]
    names = [_short(d.device.name) for d in devs]
    table: list[tuple[str, list[str]]] = [
        ("", heads),
        ("", names),
        ("layers", [f"{d.layers[0]}-{d.layers[1] - 1}" for d in devs]),
    ]
    moe = any(d.terms.get("experts") or d.host for d in devs)
    cache = any(d.terms.get("expert_cache") for d in devs)
    table += [
        (label, [human(d.terms.get(key, 0)) for d in devs])
        for key, label in ROWS
        if (moe or key != "experts") and (cache or key != "expert_cache")
    ]
    if layout.host is not None:
        table += [("pinned on host", [human(d.host) for d in devs])]
    table += [("total", [human(d.total) for d in devs])]
    free_label = "free now" if not any(d.device.simulated for d in devs) else "free (idle card)"
    table += [(free_label, [human(d.device.free) for d in devs])]
    if any(d.device.used_by_others for d in devs):
        table += [("used by others", [human(d.device.used_by_others) for d in devs])]
    if any(d.device.reserve for d in devs):
        table += [("reserve", [human(d.device.reserve) for d in devs])]
    table += [
        ("headroom", [human(d.headroom) for d in devs]),
        ("verdict", [d.verdict for d in devs]),
    ]
    width = max(12, *(len(c) for _, row in table for c in row)) + 2
    lw = max(len(label) for label, _ in table)
    for label, row in table:
        lines.append(f"{label:<{lw}}" + "".join(f"{c:>{width}}" for c in row))
    for d in devs:
        if d.advice:
            lines.append(f"{d.device.label}: {d.advice}")
    lines += host_lines(layout, model)
    if layout.skipped_line():
        lines.append(layout.skipped_line())
    src = {d.overhead_source for d in devs}
    lines.append("overhead: " + "; ".join(sorted(src)))
    if not any(d.device.is_cpu for d in devs):
        lines.append(runner_line(plan, model))
    verdict = layout.verdict
    lines.append(
        f"fits, but tight (< {TIGHT // MIB} MiB headroom on a device)"
        if verdict == Verdict.TIGHT
        else layout.bottleneck() or str(verdict)
    )
    return "\n".join(lines)


def torch_on_gpu(plan: Any, model: Any) -> str | None:
    """Why a plan whose layers are all on GPUs loads on the torch engine rather than the
    Triton kernels, or None when it runs on them (or places layers on the CPU)."""
    from engine.planning.capability import gpu_why_not
    from engine.planning.carve import model_index

    if any(d.is_cpu for d in plan.devices):
        return None
    return gpu_why_not(plan, model_index(model).hp)


def runner_line(plan: Any, model: Any) -> str:
    """Which runner a GPU plan loads on, and why when it is not the Triton kernels."""
    why = torch_on_gpu(plan, model)
    return ("runner: Triton GPU kernels" if why is None
            else f"runner: the torch engine, on the GPU ({why})")


# how a placement line says where host experts run (Plan.host_compute)
HOST_RUN = {"gpu": "read by the GPU over PCIe when routed",
            "cpu": "computed by the CPU, in its own layouts",
            "both": "split for decode between the CPU (from the file's bytes where its native "
                    "kernel reads their types, else from layouts of its own beside them) and "
                    "the GPU (over PCIe), the share timed at load; copied to the GPU for "
                    "prefill"}


def pcie_line(device: Any, nbytes: int, split: bool = False) -> str:
    """What a decode token reads over ``device``'s PCIe link (host experts the GPU computes;
    ``split``: at most, host_compute "both", less the CPU's share timed at load), and the
    most tokens/s that allows at the share of the link the gather reaches: with experts in
    host memory, PCIe is what bounds decode."""
    if not nbytes:
        return ""
    line = (f"{device.label}: decode reads {'up to ' if split else ''}{human(nbytes)} of "
            "experts per token from host memory over PCIe"
            + (" (less the experts the CPU takes, timed at load)" if split else ""))
    if not device.pcie_gbps:
        return line + " (the link's rate is not known here)"
    rate = device.pcie_gbps * PCIE_SHARE
    return (line + f", the bottleneck: at most ~{rate * 1e9 / nbytes:.0f} tokens/s at "
            f"~{rate:.0f} GB/s ({PCIE_SHARE:.0%} of its {device.pcie_gbps:.0f} GB/s link)")


def host_lines(layout: Layout, model: Any) -> list[str]:
    """Where each GPU keeps its experts, and the host line: Carve's pinned bytes against the
    host's available RAM, with its verdict and, when it does not fit, why."""
    host = layout.host
    if host is None:
        return []
    from engine.planning.carve import model_index

    out = []
    plan = layout.plan
    from engine.planning.defaults import resident_without_reserve
    from engine.planning.stage import decode_pcie_bytes, stage_key

    idx = model_index(model)
    for i, d in enumerate(layout.devices):
        if not d.host:
            continue
        moe = len(idx.moe_layers(*d.layers))
        kept = plan.resident(i)
        out.append(
            f"{d.device.label}: experts of {kept} of its {moe} MoE layers in VRAM (its first), "
            f"{moe - kept} in host memory ({human(d.terms.get('host_experts', 0))}, and "
            f"{human(d.terms.get('host_buffers', 0))} of transfer buffers), "
            + HOST_RUN[plan.host_compute]
        )
        k = stage_key(plan, i)
        line = pcie_line(d.device, decode_pcie_bytes(idx, k), plan.host_compute == "both")
        if line:
            out.append(line)
        more = resident_without_reserve(model, plan, i)
        if more > kept:  # the reserve kept free costs this GPU resident layers: say how many
            less = decode_pcie_bytes(idx, k) - decode_pcie_bytes(idx, replace(k, resident=more))
            out.append(
                f"{d.device.label}: the cache reserve ({human(plan.cache_reserve)} kept free) "
                f"holds {more - kept} MoE layers' experts out of VRAM: --cache-reserve 0 would "
                f"keep {more} of {moe} there"
                + (f", {human(less)} less over PCIe per token" if less else ""))
    dev = host.device
    avail = "stated" if dev.simulated else "available now"
    out.append(
        f"host RAM: {human(host.pinned)} pinned of {human(dev.free - dev.reserve)} {avail}, "
        f"headroom {human(host.headroom)}: {host.verdict}"
    )
    if host.advice:
        out.append(host.advice)
    return out


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "plan":
        argv = argv[1:]
    try:
        args = _parser().parse_args(argv)
        layout, model, note = build_layout(args)
    except CarveError as exc:
        print(f"carve: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # a file we could not read, named by the OS
        print(f"carve: {exc.filename or ''}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    try:
        if args.json:
            if note:
                print(note, file=sys.stderr)
            print(json.dumps(layout.to_json()))
        else:
            print(render(layout, model, note))
        sys.stdout.flush()
    except BrokenPipeError:  # `carve plan ... | head`: the reader left, nothing to report
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0 if layout.fits else 2 if layout.verdict == Verdict.DOES_NOT_RUN else 1


if __name__ == "__main__":
    sys.exit(main())
