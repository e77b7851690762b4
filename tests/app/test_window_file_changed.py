"""The model file changed on disk after the window opened it: Launch re-plans for the file as it
is now (keeping the settings that still apply) and says so, instead of sending the engine a
plan made for other bytes; the next Launch loads."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

from app.theme import LIGHT
from app.window_main import MainWindow
from engine.gguf.reader import GGUFModel

FAKE = str(Path(__file__).resolve().parents[1] / "fake_engine.py")


def test_a_model_file_changed_on_disk_is_replanned_not_launched(qtbot, synth_model, tmp_path):
    path = tmp_path / "m.gguf"
    shutil.copy(synth_model("qwen2"), path)
    w = MainWindow(LIGHT, engine_program=[sys.executable, FAKE, "normal"], live_poll=False)
    qtbot.addWidget(w)
    try:
        w.restore(str(path), "cpu")
        w.show()
        w.plan.set_ctx(256)
        assert w.plan.gguf.arch == "qwen2"
        shutil.copy(synth_model("llama"), path.with_suffix(".new"))
        path.with_suffix(".new").replace(path)  # another model has the name now
        w.launch_bar.launch_button.click()
        assert w.client.state not in ("loading", "loaded")  # nothing was sent to load
        assert w.launch_bar.status.text().startswith(
            "⚠ m.gguf changed on disk since it was opened: re-planned for the file as it is now")
        assert w.plan.gguf.arch == "llama" and w.plan.ctx == 256
        assert w.plan.plan().identity == GGUFModel.open(path).stamps
        with qtbot.waitSignal(w.client.loaded, timeout=15_000):
            w.launch_bar.launch_button.click()
    finally:
        w.close()
