"""Time to open a model's tokenizer: first open (empty tokenizer cache) against second open.

    python -m benchmarks.bench_tokenizer [MODEL.gguf ...]

Prints, per model, the GGUF header parse time, the tokenizer's first open (its cache pointed at
an empty temporary directory) and second open, each in wall and CPU seconds, and the vocabulary
type and size. Without a model it times the demo model (assembled into the cache if needed).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from unittest import mock

from spec.errors import CarveError


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.bench_tokenizer", description=__doc__.splitlines()[0]
    )
    ap.add_argument("models", nargs="*", type=Path, help="GGUF files (default: the demo model)")
    args = ap.parse_args(argv)
    from engine.gguf.demo import demo_model_path
    from engine.gguf.reader import GGUFModel
    from engine.text.tokenizer import Tokenizer

    try:
        for path in args.models or [demo_model_path()]:
            t0 = time.perf_counter()
            model = GGUFModel.open(path)
            t1 = time.perf_counter()
            with tempfile.TemporaryDirectory() as tmp, mock.patch(
                "engine.text.tokenizer.tokenizer_cache_dir", lambda tmp=tmp: Path(tmp)
            ):
                c1 = time.process_time()
                tok = Tokenizer.from_model(model)
                t2, c2 = time.perf_counter(), time.process_time()
                Tokenizer.from_model(model)
                t3, c3 = time.perf_counter(), time.process_time()
            n = len(tok.encode("The quick brown fox jumps over the lazy dog. " * 200))
            # CPU seconds beside wall seconds: on a shared 2-core machine the wall clock mostly
            # measures the neighbours
            print(
                f"{path.name}: GGUF header {t1 - t0:.3f} s, tokenizer first open {t2 - t1:.3f} s "
                f"({c2 - c1:.3f} s CPU), second open {t3 - t2:.3f} s ({c3 - c2:.3f} s CPU) "
                f"({tok.vocab_type}, {tok.n_vocab} tokens; {n} ids)"
            )
    except CarveError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
