"""Presets, recent files and the last session, as JSON in the user's config folder.

Qt-free on purpose (no QSettings): a test points ``CARVE_CONFIG_DIR`` at a temporary folder and
round-trips everything without a QApplication. The folder is the engine's ``config_dir`` (the
calibration records live there too). Files are written whole to a temporary name and
renamed, so a crash mid-write never leaves half a JSON file behind.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

from engine.hardware.calibration import config_dir

MAX_RECENT = 10


def _read(path: Path, default: Any) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return default  # missing or damaged: start fresh rather than refuse to open the window


def _write(path: Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True), encoding="utf-8")
    os.replace(tmp, path)


def model_key(model_path: str) -> str:
    """Presets belong to a model file by name (not full path: the same quant moved to another
    folder keeps its presets); shards of a split set share the first shard's key."""
    name = Path(model_path).name
    name = re.sub(r"-\d{5}-of-\d{5}(?=\.gguf$)", "", name)
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name)


class PresetStore:
    """Named launch configurations per model, plus recent files and the last session."""

    def __init__(self, root: Path | None = None) -> None:
        self.root = root or config_dir()

    def _presets_path(self, model_path: str) -> Path:
        return self.root / "presets" / f"{model_key(model_path)}.json"

    def presets(self, model_path: str) -> dict[str, dict[str, Any]]:
        data = _read(self._presets_path(model_path), {})
        return data if isinstance(data, dict) else {}

    def save_preset(self, model_path: str, name: str, settings: dict[str, Any]) -> None:
        name = name.strip()
        if not name:
            raise ValueError("a preset needs a name")
        presets = self.presets(model_path)
        presets[name] = settings
        _write(self._presets_path(model_path), presets)

    def delete_preset(self, model_path: str, name: str) -> None:
        presets = self.presets(model_path)
        if presets.pop(name, None) is not None:
            _write(self._presets_path(model_path), presets)

    def recent_files(self) -> list[str]:
        data = _read(self.root / "recent.json", [])
        return [p for p in data if isinstance(p, str)] if isinstance(data, list) else []

    def add_recent(self, path: str) -> list[str]:
        path = str(Path(path).resolve())
        recent = [path] + [p for p in self.recent_files() if p != path]
        recent = recent[:MAX_RECENT]
        _write(self.root / "recent.json", recent)
        return recent

    def last_session(self) -> dict[str, Any]:
        """``{"model": path, "rig": text, "settings": {...}}`` saved at the last launch or quit."""
        data = _read(self.root / "last.json", {})
        return data if isinstance(data, dict) else {}

    def save_last_session(self, model_path: str, rig: str, settings: dict[str, Any]) -> None:
        _write(self.root / "last.json", {"model": model_path, "rig": rig, "settings": settings})

    def ui(self) -> dict[str, Any]:
        """Window preferences (theme); kept apart from launch settings."""
        data = _read(self.root / "ui.json", {})
        return data if isinstance(data, dict) else {}

    def set_ui(self, **values: Any) -> None:
        _write(self.root / "ui.json", {**self.ui(), **values})
