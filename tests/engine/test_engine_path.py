"""The engine process finds this checkout's packages and the libraries it depends on: the folder
holding `engine/` goes on its path, never `engine/` itself (whose `gguf` package would shadow
the gguf library the kernels read their IQ lookup tables from)."""

from __future__ import annotations

import sys

from engine.process.client import EngineProcess


def test_the_engine_imports_the_gguf_library_not_engine_gguf(tmp_path) -> None:
    probe = ("import gguf.quants, engine.gguf.reader, sys; "
             "print(gguf.quants.__file__, file=sys.stderr)")
    eng = EngineProcess(command=[sys.executable, "-c", probe])
    eng.start()
    assert eng.proc.wait(timeout=60) == 0, eng.stderr_tail()
    eng._stderr_thread.join(timeout=10)
    out = eng.stderr_tail().strip()
    assert out.endswith("quants.py") and "/engine/" not in out, out
