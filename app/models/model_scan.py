"""Find GGUF files in the folders people usually keep them in (run off the GUI thread)."""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from pathlib import Path

_LATER_SHARD = re.compile(r"-(\d{5})-of-\d{5}\.gguf$")


def common_model_dirs() -> list[Path]:
    """Hugging Face hub cache, LM Studio's folders, and ~/models-style folders that exist."""
    home = Path.home()
    hf = Path(os.environ.get("HF_HUB_CACHE") or os.environ.get("HF_HOME", home / ".cache/huggingface"))
    candidates = [
        hf / "hub" if hf.name != "hub" else hf,
        home / ".lmstudio" / "models",
        home / ".cache" / "lm-studio" / "models",
        home / "models",
        home / "Models",
        home / "llm",
        home / ".cache" / "carve",
    ]
    return [p for p in candidates if p.is_dir()]


def scan(dirs: list[Path], max_depth: int = 6, limit: int = 500) -> Iterator[Path]:
    """GGUF files under ``dirs`` (first shard only for split sets), at most ``limit``."""
    found = 0
    seen: set[Path] = set()
    for root in dirs:
        root_depth = len(root.parts)
        for dirpath, dirnames, filenames in os.walk(root, followlinks=True):
            if len(Path(dirpath).parts) - root_depth >= max_depth:
                dirnames.clear()
            dirnames[:] = [d for d in dirnames if not d.startswith(".")]
            for name in sorted(filenames):
                if not name.endswith(".gguf"):
                    continue
                m = _LATER_SHARD.search(name)
                if m and m.group(1) != "00001":
                    continue
                path = Path(dirpath) / name
                try:
                    real = path.resolve()
                    if real in seen or real.stat().st_size < 1024:
                        continue
                except OSError:
                    continue
                seen.add(real)
                yield path
                found += 1
                if found >= limit:
                    return
