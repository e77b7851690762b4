"""`carve demo [--gemma] [--check]`: assemble and verify a bundled model, print its path."""

from __future__ import annotations

import argparse
import sys

from engine.gguf.demo import demo_model_path, gemma_model_path
from spec.errors import CarveError


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="carve demo",
        description="Assemble the bundled model into the cache, verify its sha256, print its path.",
    )
    parser.add_argument("--gemma", action="store_true", help="Gemma 3 270M instead of the demo model")
    parser.add_argument(
        "--check", action="store_true", help="only print the path of an already verified file"
    )
    args = parser.parse_args(argv[1:] if argv and argv[0] == "demo" else argv)
    try:
        if args.gemma:
            path = gemma_model_path(assemble=not args.check)
        else:
            path = demo_model_path(assemble=not args.check, on_progress=_progress())
    except CarveError as err:
        print(f"carve: {err}", file=sys.stderr)
        return 2
    print(path)
    return 0


def _progress():  # -> Callable[[int, int], None]
    """Percent on stderr, only when a person is watching (stdout stays just the path)."""
    if not sys.stderr.isatty():
        return None
    last = [-1]

    def report(done: int, total: int) -> None:
        pct = done * 100 // max(total, 1)
        if pct != last[0]:
            last[0] = pct
            end = "\n" if done >= total else ""
            print(f"\rassembling the demo model: {pct:3d} %", end=end, file=sys.stderr, flush=True)

    return report
