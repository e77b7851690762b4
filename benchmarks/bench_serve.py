"""`carve serve` as its clients see it: time to first token and tokens/s through HTTP (SSE
streaming), one client alone and N at once (they queue for the one engine).

    python -m benchmarks.bench_serve MODEL | --synth SHAPE [--gpus auto] [--ctx 2048]
        [--clients 4] [--tokens 128] [--prompt 256]

--synth writes a synthetic GGUF of that shape (engine.synth.gen) into a temporary folder first.
Replies are greedy and run to --tokens (stop strings off; a synthetic model may still end early
on its end-of-turn token: the counts printed are the tokens that came). Needs starlette, uvicorn
and httpx (the test extras) besides the engine's own packages.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.bench_serve",
                                 description=__doc__.split("\n\n")[0])  # fmt: skip
    ap.add_argument("model", nargs="?", help="GGUF file")
    ap.add_argument("--synth", help="a synthetic shape instead of a file (e.g. qwen2-7b)")
    ap.add_argument("--gpus", default="auto", help='the rig to serve on ("auto", "cpu")')
    ap.add_argument("--ctx", type=int, default=2048)
    ap.add_argument("--clients", type=int, default=4, help="clients at once in the second run")
    ap.add_argument("--tokens", type=int, default=128, help="max_tokens of each reply")
    ap.add_argument("--prompt", type=int, default=256, help="prompt length, in words")
    args = ap.parse_args(argv)
    if not args.model and not args.synth:
        ap.error("give a MODEL file or --synth SHAPE")
    return args


class Server:
    def __init__(self, model: Path, gpus: str, ctx: int) -> None:
        cmd = [sys.executable, "-m", "app", "serve", str(model), "--gpus", gpus, "--ctx",
               str(ctx), "--port", "0"]  # fmt: skip
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            filter(None, [str(ROOT), os.environ.get("PYTHONPATH", "")]))}  # fmt: skip
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True)
        self.start = time.monotonic()
        for line in self.proc.stderr:
            sys.stderr.write(line)
            if m := re.search(r"serving (\S+) .* at (http://\S+/v1)", line):
                self.model, self.url = m.group(1), m.group(2)
                break
        else:
            raise SystemExit("carve serve ended before it served (see above)")
        self.ready_s = time.monotonic() - self.start
        threading.Thread(target=lambda: [None for _ in self.proc.stderr], daemon=True).start()

    def close(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(timeout=60)


def one_reply(url: str, model: str, prompt: str, tokens: int) -> dict[str, float]:
    import httpx

    body = {"model": model, "prompt": prompt, "max_tokens": tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    start = time.monotonic()
    first = last = 0.0
    usage: dict = {}
    with httpx.stream("POST", url + "/completions", json=body, timeout=600) as res:
        res.raise_for_status()
        for line in res.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            elif chunk["choices"] and chunk["choices"][0]["text"]:
                last = time.monotonic() - start
                first = first or last
    n = usage.get("completion_tokens", 0)
    return {"ttft": first, "total": last, "tokens": n, "prompt": usage.get("prompt_tokens", 0),
            "tps": (n - 1) / (last - first) if n > 1 and last > first else 0.0}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(args.model) if args.model else None
        if args.synth:
            from engine.synth.gen import write_model

            path = write_model(Path(tmp) / f"{args.synth}.gguf", args.synth, "q4_k_m", 1)[0]
        server = Server(path, args.gpus, args.ctx)
        try:
            words = " ".join(f"w{i % 97}" for i in range(args.prompt))
            print(f"{server.model}: serving {server.ready_s:.1f} s after start, {server.url}")
            one_reply(server.url, server.model, "warm up", 4)
            alone = one_reply(server.url, server.model, words, args.tokens)
            print(f"alone      : prompt {alone['prompt']} tokens, first token "
                  f"{alone['ttft'] * 1e3:7.1f} ms, {alone['tokens']} tokens at "
                  f"{alone['tps']:7.1f} t/s (client side, SSE)")  # fmt: skip
            start = time.monotonic()
            with ThreadPoolExecutor(args.clients) as pool:
                runs = list(pool.map(lambda i: one_reply(server.url, server.model,
                                                         f"c{i} " + words, args.tokens),
                                     range(args.clients)))  # fmt: skip
            wall = time.monotonic() - start
            total = sum(r["tokens"] for r in runs)
            ttfts = sorted(r["ttft"] for r in runs)
            print(f"{args.clients} at once: {total} tokens in {wall:.2f} s = {total / wall:7.1f} "
                  f"t/s overall; first token median {statistics.median(ttfts):.2f} s, last "
                  f"{ttfts[-1]:.2f} s (queued); each streams at "
                  f"{statistics.median(r['tps'] for r in runs):7.1f} t/s")  # fmt: skip
        finally:
            server.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
