"""Load progress as the engine reports it: GB loaded, GB/s and time left, ready to print."""

from __future__ import annotations

from dataclasses import dataclass

from engine.process.protocol import STEP_STAGES

GB = 1e9


@dataclass(slots=True)
class LoadProgress:
    stage: str = ""
    done: int = 0
    total: int = 0
    rate: float = 0.0  # bytes/s, the engine's figure

    def update(self, stage: str, done: int, total: int, rate: float) -> None:
        self.stage, self.done, self.total, self.rate = stage, int(done), int(total), float(rate)

    @property
    def fraction(self) -> float:
        return min(1.0, self.done / self.total) if self.total > 0 else 0.0

    @property
    def seconds_left(self) -> float | None:
        if self.rate <= 0 or self.total <= 0:
            return None
        return max(0.0, (self.total - self.done) / self.rate)

    def text(self) -> str:
        # steps, not bytes (the GPU runner's; the CPU loader fills its dequant cache in bytes
        # and says so with a rate)
        if self.stage in STEP_STAGES and self.rate <= 0:
            return f"{self.stage}: step {min(self.done + 1, self.total)} of {self.total}"
        parts = [f"{self.stage}: " if self.stage else ""]
        parts.append(f"{self.done / GB:.2f} of {self.total / GB:.2f} GB")
        if self.rate > 0:
            parts.append(f" · {self.rate / GB:.2f} GB/s")
        left = self.seconds_left
        if left is not None:
            parts.append(f" · {format_seconds(left)} left")
        return "".join(parts)


def format_seconds(s: float) -> str:
    s = round(s)
    if s < 60:
        return f"{s} s"
    m, s = divmod(s, 60)
    if m < 60:
        return f"{m} min {s:02d} s"
    h, m = divmod(m, 60)
    return f"{h} h {m:02d} min"
