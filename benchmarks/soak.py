"""Long use of one engine process: generate/stop cycles, load/unload cycles and tokenize calls,
with the engine's resident memory (and, on a GPU machine, NVML used memory per GPU) sampled
along the way and the slope of each printed: a leak shows as a slope above noise.

    python -m benchmarks.soak MODEL | --synth SHAPE [--gpus cpu|auto] [--ctx 512]
        [--generate 1000] [--loads 100] [--tokenize 1000] [--max-tokens 64] [--every 50]
        [--seed 0]

Each generate cycle asks for up to --max-tokens tokens and sends stop after a random number of them
(0..max-1), as a user pressing Stop does; each load cycle unloads and loads the plan again.
Prints one line per sample (phase, cycle, RSS MiB, GPU MiB) and per phase the Theil-Sen
slope in KiB per cycle over the second half of the phase (the first half is warm-up: caches,
allocator pools and lazily built kernels grow there legitimately).
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
from pathlib import Path

import psutil

from engine.process import protocol as p
from engine.process.client import EngineProcess
from spec.errors import CarveError

USER = [{"role": "user", "content": "Write a short poem about memory."}]


def gpu_used_mib() -> list[float]:
    try:
        from engine.hardware import devices

        return [d.used / 2**20 for d in devices.snapshot() if d.used is not None]
    except Exception:  # noqa: BLE001 - no NVML here: the CPU figures stand alone
        return []


def file_holds(pid: int, path: str) -> int:
    """Open descriptors plus memory maps of ``path`` in process ``pid`` (Linux /proc): a loaded
    model holds one descriptor; a model an unload failed to free holds its own too."""
    n = 0
    fds = f"/proc/{pid}/fd"
    for fd in os.listdir(fds):
        try:
            n += os.readlink(f"{fds}/{fd}") == path
        except OSError:  # closed meanwhile
            pass
    with open(f"/proc/{pid}/maps") as f:
        n += sum(1 for line in f if line.rstrip().endswith(path))
    return n


def slope(points: list[tuple[int, float]]) -> float:
    """Theil-Sen slope of y on x over the second half of the points (y units per x): the median
    of the slopes between every pair of samples. A leak raises every pair, so it shows; one
    sample the allocator happened to catch high or low moves a least-squares fit of a dozen
    points by several KiB a cycle, and this one not at all."""
    pts = points[len(points) // 2:]
    pairs = sorted((y2 - y1) / (x2 - x1) for i, (x1, y1) in enumerate(pts)
                   for x2, y2 in pts[i + 1:] if x2 != x1)
    if not pairs:
        return 0.0
    mid = len(pairs) // 2
    return pairs[mid] if len(pairs) % 2 else (pairs[mid - 1] + pairs[mid]) / 2


class Soak:
    def __init__(self, engine: EngineProcess, plan: dict, every: int, seed: int,
                 out=sys.stdout, max_tokens: int = 64,
                 mappings_of: Path | None = None) -> None:  # fmt: skip
        self.engine, self.plan, self.every = engine, plan, every
        self.mappings_of = str(Path(mappings_of).resolve()) if mappings_of else None
        self.max_tokens = max_tokens
        self.rng = random.Random(seed)
        self.out = out
        self.samples: dict[str, list[tuple[int, float]]] = {}

    def sample(self, phase: str, cycle: int) -> None:
        rss = psutil.Process(self.engine.pid).memory_info().rss / 2**20
        gpu = gpu_used_mib()
        self.samples.setdefault(phase, []).append((cycle, rss))
        gpus = " ".join(f"{g:.0f}" for g in gpu)
        holds = ""
        if self.mappings_of:  # the engine's descriptors and memory maps of the model file
            holds = f"  holds {file_holds(self.engine.pid, self.mappings_of)}"
        print(f"{phase:9s} {cycle:6d}  rss {rss:8.1f} MiB" + (f"  gpu {gpus} MiB" if gpu else "")
              + holds, file=self.out, flush=True)

    def load(self) -> None:
        self.engine.send(p.Load(self.plan))
        self.engine.wait_for(p.Loaded, p.Unloaded, timeout=600)

    def generate(self, n: int) -> None:
        for i in range(n):
            stop_at = self.rng.randrange(self.max_tokens)
            self.engine.send(p.Generate(USER, f"s{i}", {"seed": i, "temperature": 1.0},
                                        self.max_tokens))
            got = 0
            while True:
                ev = self.engine.wait_for(p.Token, p.Done, timeout=600)
                if isinstance(ev, p.Done):
                    break
                got += 1
                if got == stop_at + 1:
                    self.engine.send(p.Stop())
            if i % self.every == 0 or i == n - 1:
                self.sample("generate", i)

    def loads(self, n: int) -> None:
        for i in range(n):
            self.engine.send(p.Unload())
            self.engine.wait_for(p.Unloaded, timeout=600)
            self.load()
            if i % max(1, self.every // 10) == 0 or i == n - 1:
                self.sample("load", i)

    def tokenize(self, n: int) -> None:
        # texts drawn from a pool: the tokenizer's word cache is bounded (10,000 words) but fills
        # for thousands of calls on ever-new random words, which reads as a leak over a short soak
        pool = ["".join(self.rng.choice("abc def ghi 日本 😀\n") for _ in range(200))
                for _ in range(16)]
        for i in range(n):
            text = self.rng.choice(pool)
            self.engine.send(p.Tokenize(text))
            self.engine.wait_for(p.Tokens, timeout=600)
            if i % self.every == 0 or i == n - 1:
                self.sample("tokenize", i)

    def slopes(self) -> dict[str, float]:
        """KiB per cycle, per phase."""
        return {phase: slope(pts) * 1024 for phase, pts in self.samples.items()}


def run(model: Path, gpus: str, ctx: int, generate: int, loads: int, tokenize: int, every: int,
        seed: int, out=sys.stdout, max_tokens: int = 64,
        mappings_of: Path | None = None) -> dict[str, float]:  # fmt: skip
    """The soak; ``mappings_of``: a file whose mappings in the engine are counted per sample
    (Linux: /proc/PID/fd and maps), the model's own to see that unloads free it."""
    from app.cli_chat import build_plan

    plan = build_plan(model, gpus, ctx, "f16").to_json()
    with EngineProcess() as engine:
        engine.wait_for(p.Ready, timeout=120)
        soak = Soak(engine, plan, every, seed, out, max_tokens, mappings_of)
        soak.load()
        soak.sample("start", 0)
        soak.generate(generate)
        soak.loads(loads)
        soak.tokenize(tokenize)
        result = soak.slopes()
    for phase, kib in result.items():
        print(f"slope {phase:9s} {kib:+9.2f} KiB/cycle", file=out, flush=True)
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.soak", description=__doc__.split("\n")[0])
    ap.add_argument("model", nargs="?", help="a GGUF model")
    ap.add_argument("--synth", help="a synthetic shape (engine.synth) instead of a model")
    ap.add_argument("--gpus", default="cpu", help='"cpu" (default) or a rig such as "auto"')
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--generate", type=int, default=1000)
    ap.add_argument("--loads", type=int, default=100)
    ap.add_argument("--tokenize", type=int, default=1000)
    ap.add_argument("--max-tokens", type=int, default=64, help="tokens a generate asks for")
    ap.add_argument("--every", type=int, default=50, help="cycles between samples")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    try:
        if args.synth:
            from engine.synth.gen import write_model

            folder = tempfile.mkdtemp(prefix="carve-soak-")
            model = write_model(Path(folder) / f"{args.synth}.gguf", args.synth, "q4_k_m", 1)[0]
        elif args.model:
            model = Path(args.model)
        else:
            ap.error("give a MODEL or --synth SHAPE")
        run(Path(model), args.gpus, args.ctx, args.generate, args.loads, args.tokenize,
            max(1, args.every), args.seed, max_tokens=max(1, args.max_tokens),
            mappings_of=Path(model) if Path("/proc/self/maps").exists() else None)
    except CarveError as err:
        print(f"soak: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
