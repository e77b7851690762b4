"""`carve serve`: load a model in the engine process and answer the OpenAI API on it.

    carve serve [MODEL] [--host 127.0.0.1] [--port 8080] [--api-key KEY] [--gpus ...] [--ctx N]

The plan is built, priced and checked exactly as `carve chat` does (a plan that does not fit or
does not run is refused before the engine starts). Ctrl-C or SIGTERM stops the server and the
engine process with it.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from typing import Any

from app import cli_chat
from engine.process import protocol as p
from engine.process.client import EngineExited, EngineProcess
from spec.errors import CarveError


class _Terminated(Exception):
    """SIGTERM: end as Ctrl-C does, through the finally that closes the engine."""


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = cli_chat._Parser(prog="carve serve")
    parser.description = ("Serve a GGUF model over the OpenAI API (GET /v1/models, POST "
                          "/v1/chat/completions, POST /v1/completions). No MODEL: the demo model.")
    parser.add_argument("model", nargs="?", help="GGUF file (any shard of a split set)")
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to listen on (default: loopback only)")
    parser.add_argument("--port", type=int, default=8080, help="TCP port (0: any free one)")
    parser.add_argument("--api-key", default=None,
                        help="require 'Authorization: Bearer KEY' on every request")
    cli_chat._common(parser, None)
    args = parser.parse_args(argv[1:])
    if not 0 <= args.port < 65536:
        raise CarveError(f"--port {args.port}: use a port number from 0 to 65535")
    if args.api_key is not None and not args.api_key.strip():
        raise CarveError("--api-key is empty; pass the key clients will send")
    return args


def exposure_warning(host: str, api_key: str | None) -> str | None:
    """The line printed when the server is reachable from other machines with no key."""
    from app.serve.http import is_loopback

    if is_loopback(host) or api_key is not None:
        return None
    return (f"carve: warning: listening on {host} without --api-key: anyone who can reach this "
            "port can use the model")  # fmt: skip


def pump_events(engine: EngineProcess, turns: Any, stopping: threading.Event) -> None:
    """The engine's events to the server's turns, until the engine exits (a thread)."""
    try:
        for event in engine.events():
            turns.feed(event)
    except EngineExited as err:
        if not stopping.is_set():
            print(f"carve: {err}; requests now get 503", file=sys.stderr, flush=True)
        turns.engine_gone(f"{err}; start carve serve again")


def serve(args: argparse.Namespace) -> int:
    from app.serve.engine_turns import EngineTurns
    from app.serve.http import HttpServer, build_app
    from app.serve.openai_api import model_id

    path = cli_chat.model_path(args.model)
    plan = cli_chat.build_plan(path, args.gpus, args.ctx, args.kv, args=args)
    model = model_id(path.name)
    engine = cli_chat.engine_process(args.verbose)
    turns = EngineTurns(engine.send)
    # bound before the engine starts: a taken port is reported before minutes of loading
    server = HttpServer(build_app(turns, model, args.api_key), args.host, args.port,
                        args.verbose, on_exit=lambda: turns.close("carve serve is stopping"))
    stopping = threading.Event()
    with engine, server.sock:
        engine.wait_for(p.Ready, timeout=120)
        cli_chat.load(engine, plan)
        threading.Thread(target=pump_events, args=(engine, turns, stopping), daemon=True,
                         name="engine-events").start()  # fmt: skip
        if warning := exposure_warning(args.host, args.api_key):
            print(warning, file=sys.stderr)
        print(f"serving {model} (ctx {plan.ctx}) at {server.url}  ·  Ctrl-C stops",
              file=sys.stderr, flush=True)  # fmt: skip
        try:
            server.run()
        finally:
            stopping.set()  # the engine's exit that follows is no news
    print("carve serve: stopped", file=sys.stderr)
    return 0


def main(argv: list[str]) -> int:
    def on_term(*_: object) -> None:
        raise _Terminated

    previous = signal.signal(signal.SIGTERM, on_term)
    try:
        return serve(parse_args(argv))
    except CarveError as err:
        print(f"carve: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    except _Terminated:
        return 143
    finally:
        signal.signal(signal.SIGTERM, previous)
