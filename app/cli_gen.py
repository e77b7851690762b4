"""`carve gen --shape qwen2-7b --mix q4_k_m -o FILE [--split N]`: write a synthetic GGUF.

The generator is pure numpy (no torch), so it runs in this process rather than a child.
"""

from __future__ import annotations

from engine.synth.gen import main as synth_main


def main(argv: list[str]) -> int:
    args = argv[1:] if argv and argv[0] == "gen" else argv
    return synth_main(args, prog="carve gen")
