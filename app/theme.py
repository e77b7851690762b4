"""Light and dark looks: the style sheet from app/resources/ plus the colours the plots draw with.

Plots cannot read a style sheet, so the colours they need live here, one table per theme; the
style sheets use the same hex values.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

RESOURCES = Path(__file__).resolve().parent / "resources"  # package data: installs with app/


@dataclass(frozen=True, slots=True)
class Theme:
    name: str
    window: str
    panel: str
    text: str
    muted: str
    grid: str
    free: str  # the empty part of a VRAM bar
    others: str  # used by other processes
    terms: dict[str, str]  # our engine's terms
    verdict: dict[str, str]
    stages: tuple[str, ...]  # one colour per GPU in the split strip


_TERMS_LIGHT = {
    "weights": "#3b6fd8",
    "experts": "#7fa6ee",
    "kv": "#8a55d6",
    "buffers": "#1b9aaa",
    "expert_cache": "#b9cdf4",
    "dequant_cache": "#e0a030",
    "overhead": "#7a8699",
    "host_experts": "#5aa6a0",
}
_VERDICT = {"fits": "#2f9e55", "tight": "#d99a1e", "does not fit": "#d64545",
            "does not run here": "#d64545", "": "#8a94a6"}
_STAGES = ("#3b6fd8", "#2f9e8f", "#c2682d", "#8a55d6", "#c2417a", "#5f8f2f", "#b08a1e", "#4f6d8f")

LIGHT = Theme(
    name="light",
    window="#f4f5f7",
    panel="#ffffff",
    text="#1d2330",
    muted="#5d6678",
    grid="#dfe3ea",
    free="#e8ebf0",
    others="#9aa3b2",
    terms=_TERMS_LIGHT,
    verdict=_VERDICT,
    stages=_STAGES,
)

DARK = Theme(
    name="dark",
    window="#1b1e24",
    panel="#23272f",
    text="#e3e7ee",
    muted="#98a1b3",
    grid="#343a45",
    free="#2e333d",
    others="#5b6475",
    terms={
        "weights": "#5b8def",
        "experts": "#9bbcf5",
        "kv": "#a57ae8",
        "buffers": "#37b3c2",
        "expert_cache": "#c4d6f8",
        "dequant_cache": "#e8b04a",
        "overhead": "#8d98ab",
        "host_experts": "#6cc0b8",
    },
    verdict={"fits": "#45b86c", "tight": "#e6aa35", "does not fit": "#ec5f5f",
             "does not run here": "#ec5f5f", "": "#8d98ab"},
    stages=("#5b8def", "#3fb3a2", "#dd8448", "#a57ae8", "#dc5f95", "#7fb04a", "#cfa53a", "#7391b5"),
)

THEMES = {"light": LIGHT, "dark": DARK}


def style_sheet(theme: Theme) -> str:
    try:
        return (RESOURCES / f"{theme.name}.qss").read_text(encoding="utf-8")
    except OSError:
        return ""  # an unstyled window is better than none


def stage_color(theme: Theme, position: int) -> str:
    return theme.stages[position % len(theme.stages)]
