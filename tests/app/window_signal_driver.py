"""The real window (`app.window_start.main`, the code `carve` runs), driven as a person would for
tests/app/test_window_signals.py: it opens MODEL on the CPU, presses Launch, and with WHEN
"reply" sends a chat message once loaded. It prints one line per step on stdout:

    engine PID        the engine process started
    trigger STATE     the moment to signal the window: WHEN "load" at the load's first
                      progress event (or half a second into it), "reply" at the reply's first
                      token, "start" a second after the engine process started
    closed STATE      the window's close began (STATE: the engine client's state then)
    after-close R     the window's close returned; R: the engine process "running" or "stopped"

    python tests/app/window_signal_driver.py MODEL load|reply|start [ENGINE_PROGRAM...]

ENGINE_PROGRAM: an engine command instead of the real `carve-engine` (a fake engine scenario).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import app.window_main as wm  # noqa: E402
import app.window_start as start  # noqa: E402


def main() -> int:
    model, when, program = sys.argv[1], sys.argv[2], sys.argv[3:] or None
    real_init, real_close = wm.MainWindow.__init__, wm.MainWindow.closeEvent
    fired = []

    def say(line: str) -> None:
        print(line, flush=True)

    def trigger(window) -> None:
        if not fired:
            fired.append(1)
            say(f"trigger {window.client.state}")

    def init(self, *args, **kwargs) -> None:
        if program:
            kwargs["engine_program"] = program
        kwargs["remember"] = False
        real_init(self, *args, **kwargs)
        c = self.client

        def on_state(state: str) -> None:
            if state == "starting":
                c._proc.started.connect(lambda: say(f"engine {c._proc.processId()}"))
                if when == "start":
                    c._proc.started.connect(lambda: start.QTimer.singleShot(1000,
                                                                         lambda: trigger(self)))
            elif state == "loading" and when == "load":
                start.QTimer.singleShot(500, lambda: trigger(self))

        c.state_changed.connect(on_state)
        if when == "load":
            c.progress.connect(lambda *_: trigger(self))
        elif when == "reply":
            c.token.connect(lambda *_: trigger(self))

            def ask(*_: object) -> None:
                self.chat.input.setPlainText("Tell me a long story.")
                self.chat.send()

            c.loaded.connect(ask)

    def close_event(self, event) -> None:
        say(f"closed {self.client.state}")
        real_close(self, event)
        say(f"after-close {'running' if self.client.is_running() else 'stopped'}")

    real_restore = wm.MainWindow.restore

    def restore(self, *args, **kwargs):
        out = real_restore(self, *args, **kwargs)
        start.QTimer.singleShot(0, self.launch_bar.launch_button.click)
        return out

    wm.MainWindow.__init__ = init
    wm.MainWindow.closeEvent = close_event
    wm.MainWindow.restore = restore
    return start.main(["--model", model, "--gpus", "cpu"])


if __name__ == "__main__":
    sys.exit(main())
