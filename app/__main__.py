"""`carve` entry point: dispatch to one subcommand module; no arguments opens the window."""

from __future__ import annotations

import importlib
import sys

# subcommand -> module with `main(argv) -> int`
SUBCOMMANDS = {
    "plan": "app.cli_plan",
    "chat": "app.cli_chat",
    "tokenize": "app.cli_chat",
    "perplexity": "app.cli_chat",
    "demo": "app.cli_demo",
    "bench": "app.cli_bench",
    "gen": "app.cli_gen",
    "serve": "app.cli_serve",
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("-V", "--version"):
        print(f"carve {_version()}")
        return 0
    if argv and argv[0] in ("-h", "--help"):
        print("usage: carve [--version] [plan|chat|serve|tokenize|perplexity|demo|bench|gen] ...  "
              "(no command: the window)")
        return 0
    if argv and argv[0] in SUBCOMMANDS:
        module = importlib.import_module(SUBCOMMANDS[argv[0]])
        return module.main(argv)
    from app.window_start import main as gui_main

    return gui_main(argv)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("carve")
    except PackageNotFoundError:  # run from a checkout that was never installed
        return "(not installed)"


if __name__ == "__main__":
    sys.exit(main())
