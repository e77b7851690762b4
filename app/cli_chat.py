"""`carve chat`, `carve tokenize`, `carve perplexity`: terminal commands that run the model in
the engine process (engine/runtime/server.py) through engine/process/client.py.

Never imports torch: the plan is built and priced here (pure Python), the engine loads it.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import signal
import sys
import time
from pathlib import Path
from typing import Any, NoReturn, Self

from app.cli_plan import add_expert_args, expert_settings
from app.models.load_progress import LoadProgress
from engine.planning.rules import KvType, Verdict
from engine.process import protocol as p
from engine.process.client import EngineProcess
from engine.process.sampling_params import SamplingParams
from spec.errors import CarveError

MB = 1_000_000


class _Parser(argparse.ArgumentParser):
    """argparse that reports bad input as a CarveError (one line, exit 2) instead of usage text."""

    def error(self, message: str) -> NoReturn:
        raise CarveError(f"{self.prog}: {message} (see: {self.prog} --help)")


def _common(parser: argparse.ArgumentParser, ctx_default: int | None) -> None:
    parser.add_argument(
        "--gpus",
        default="auto",
        help='"auto" (every GPU here, else the CPU) or "cpu"; the rig syntax of carve plan, '
        'whose simulated rigs ("4x24GiB") only plan',
    )
    parser.add_argument("--ctx", type=int, default=ctx_default, help="context length in tokens")
    parser.add_argument("--kv", default=str(KvType.F16), choices=[str(k) for k in KvType],
                        help="KV cache type")
    add_expert_args(parser)
    parser.add_argument("-v", "--verbose", action="store_true", help="show the engine's log")


def parse_args(argv: list[str]) -> argparse.Namespace:
    command, rest = argv[0], argv[1:]
    parser = _Parser(prog=f"carve {command}")
    if command == "chat":
        parser.description = "Chat with a GGUF model in the terminal (no MODEL: the demo model)."
        parser.add_argument("model", nargs="?", help="GGUF file (any shard of a split set)")
        _common(parser, None)
        parser.add_argument("--system", default="", help="system prompt")
        parser.add_argument("--temp", type=float, default=0.7, help="temperature (0 = greedy)")
        parser.add_argument("--top-k", type=int, default=40)
        parser.add_argument("--top-p", type=float, default=0.95)
        parser.add_argument("--min-p", type=float, default=0.05)
        parser.add_argument("--repeat-penalty", type=float, default=1.1)
        parser.add_argument("--seed", type=int, default=None)
        parser.add_argument("--max-tokens", type=int, default=512, help="longest reply")
    elif command == "tokenize":
        parser.description = "Print the token ids of a text file as one JSON list."
        parser.add_argument("model")
        parser.add_argument("file", help='text file ("-" = stdin)')
        parser.add_argument("--no-bos", action="store_true", help="never add BOS")
        parser.add_argument(
            "--no-parse-special", action="store_true", help="treat special-token text as plain text"
        )
        parser.add_argument("-v", "--verbose", action="store_true", help="show the engine's log")
    elif command == "perplexity":
        parser.description = "Perplexity of a text the way llama-perplexity computes it."
        parser.add_argument("model")
        parser.add_argument("file", help='text file ("-" = stdin)')
        _common(parser, 512)
    else:
        raise CarveError(f"unknown command {command!r}: use chat, tokenize or perplexity")
    return parser.parse_args(rest)


# ---------------------------------------------------------------- plan


def model_path(arg: str | None) -> Path:
    if arg is None:
        from engine.gguf.demo import demo_model_path

        def on_progress(done: int, total: int) -> None:  # first run: ~0.5 GB assembled
            if sys.stderr.isatty():
                sys.stderr.write(
                    f"\rassembling the demo model: {done / MB:,.0f}/{total / MB:,.0f} MB"
                )
                sys.stderr.flush()

        path = Path(demo_model_path(on_progress=on_progress))
        if sys.stderr.isatty():
            sys.stderr.write("\r\x1b[K")
        return path
    path = Path(arg).expanduser()
    if not path.is_file():
        raise CarveError(f"{arg}: no such model file; pass the path of a .gguf file")
    return path


def read_text(arg: str) -> str:
    try:
        data = sys.stdin.buffer.read() if arg == "-" else Path(arg).read_bytes()
    except OSError as err:
        raise CarveError(f"{arg}: cannot read it ({err.strerror or err})") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise CarveError(f"{arg}: not UTF-8 text (bad byte at offset {err.start})") from None


def pick_devices(gpus: str) -> list[Any]:
    """The devices a command runs on, from a --gpus rig (engine.hardware.rigs.parse_rig, the
    syntax every command takes): "auto" is every GPU here (CUDA_VISIBLE_DEVICES picks which),
    else the CPU; "cpu" the CPU. A rig of cards to plan for ("4x24GiB") cannot run here."""
    from engine.hardware.rigs import parse_rig

    devices = parse_rig(gpus)
    if any(d.simulated for d in devices):
        raise CarveError(
            f"--gpus: {gpus!r} is a rig to plan for, not the devices here; use auto or cpu "
            f"(carve plan MODEL --gpus {gpus} prices that rig)"
        )
    return devices or parse_rig("cpu")


def build_plan(path: Path, gpus: str, ctx: int | None, kv: str, logits_rows: int = 1,
               args: argparse.Namespace | None = None) -> Any:
    """A priced Plan for the devices here (engine.planning.defaults.default_plan); CarveError
    naming the device when it does not fit or its runner has no kernel for a tensor type.
    ``args``: the command's flags, for the expert placement (`add_expert_args`)."""
    from engine.gguf.reader import GGUFModel
    from engine.planning.defaults import default_plan
    from engine.planning.price import price

    path = Path(path)
    model = GGUFModel.open(path)
    devices = pick_devices(gpus)
    experts = expert_settings(args) if args is not None else {}
    plan = default_plan(
        model, devices, ctx=ctx, kv_type=kv, logits_rows=logits_rows, model_path=str(path),
        **experts,
    )
    layout = price(plan, model)
    if layout.host is not None and not layout.host.verdict.runs:
        raise CarveError(f"{path.name}: {layout.host.advice}")
    for dev in layout.devices:
        if dev.verdict == Verdict.DOES_NOT_RUN:
            raise CarveError(
                f"{path.name} does not run on {dev.device.label} ({dev.device.name}): {dev.advice}"
            )
        if dev.verdict == Verdict.DOES_NOT_FIT:
            advice = f": {dev.advice}" if dev.advice else ""
            raise CarveError(
                f"{path.name} does not fit on {dev.device.label} ({dev.device.name}) "
                f"with --ctx {plan.ctx}{advice}"
            )
    return plan


# ---------------------------------------------------------------- engine I/O


def engine_process(verbose: bool) -> EngineProcess:
    """The engine, not yet started: `with engine_process(v) as engine` starts it and always
    ends it, whatever happens in between."""
    return EngineProcess(echo_stderr=verbose)


def device_label(report: dict[str, Any]) -> str:
    index = report.get("index", 0)
    return "CPU" if index < 0 else f"GPU {index}"


def load(engine: EngineProcess, plan: Any) -> None:
    """Send the plan; show progress on a terminal; return once loaded (error event: raise)."""
    engine.send(p.Load(plan.to_json()))
    tty = sys.stderr.isatty()
    progress = LoadProgress()
    start = time.monotonic()
    while True:
        ev = engine.wait_for(p.Progress, p.Loaded, p.Unloaded)
        if isinstance(ev, p.Progress) and tty:
            progress.update(ev.stage, ev.done, ev.total, ev.rate)
            sys.stderr.write(f"\rloading: {progress.text()}    ")
            sys.stderr.flush()
        elif isinstance(ev, p.Unloaded):
            raise CarveError("loading was cancelled")
        elif isinstance(ev, p.Loaded):
            where = ", ".join(f"{device_label(d)}: {d.get('allocated', 0) / MB:,.0f} MB"
                              for d in ev.devices)  # fmt: skip
            clear = "\r\x1b[K" if tty else ""
            sys.stderr.write(f"{clear}loaded in {time.monotonic() - start:.1f} s ({where})\n")
            return


class CtrlC:
    """Ctrl-C (SIGINT) as presses to count, never a KeyboardInterrupt, and a prompt no press misses.

    input() loses a Ctrl-C that lands between writing its prompt and blocking in read(): the
    C-level handler only sets a flag that nobody checks until read() returns, i.e. after Enter.
    Here every SIGINT also writes a byte to a self-pipe (signal.set_wakeup_fd) and the prompt
    waits on stdin and that pipe together, so a press at any moment, even one made before the
    wait began, wakes it. Counting the pipe's bytes (not a Python handler's calls) keeps this
    independent of when the interpreter gets round to running handlers. Main thread only.
    """

    def __enter__(self) -> Self:
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)  # the C handler must never block on it
        self._old_wakeup = signal.set_wakeup_fd(self._wake_w)
        self._old_handler = signal.signal(signal.SIGINT, lambda *_: None)
        self._pending = b""  # typed-ahead bytes after the line read_line returned
        self.presses = 0  # Ctrl-C presses that ended the last read_line
        return self

    def __exit__(self, *exc: object) -> None:
        signal.signal(signal.SIGINT, self._old_handler)
        signal.set_wakeup_fd(self._old_wakeup)
        os.close(self._wake_r)
        os.close(self._wake_w)

    def take(self) -> int:
        """Ctrl-C presses since the last call (never blocks)."""
        data = b""
        while True:
            try:
                chunk = os.read(self._wake_r, 256)
            except BlockingIOError:
                break
            data += chunk
        return data.count(signal.SIGINT)

    def read_line(self, prompt: str) -> str | None:
        """The next line from stdin without its newline, or None once Ctrl-C is pressed (then
        `presses` says how often; the line being typed is dropped, as a shell does); EOFError
        on end of input (Ctrl-D)."""
        sys.stdout.write(prompt)
        sys.stdout.flush()
        fd = sys.stdin.fileno()
        while b"\n" not in self._pending:
            if self._wake_r in select.select([fd, self._wake_r], [], [])[0]:
                self.presses = self.take()
                if self.presses:
                    self._pending = b""
                    return None
                continue  # another signal's byte
            chunk = os.read(fd, 4096)
            if not chunk:  # EOF, or Ctrl-D after some text: that text is the last line
                if not self._pending:
                    raise EOFError
                self._pending += b"\n"
            self._pending += chunk
        line, self._pending = self._pending.split(b"\n", 1)
        return line.decode(sys.stdin.encoding or "utf-8", "replace")


def stream_reply(
    engine: EngineProcess, request: p.Generate, out: Any = None, ctrl_c: CtrlC | None = None
) -> tuple[str, Any]:
    """Send `request`, print tokens as they come; Ctrl-C sends stop and keeps waiting for the
    engine's done. Returns (reply text, done event or None after an error event)."""
    if ctrl_c is None:
        with CtrlC() as own:
            return stream_reply(engine, request, out, own)
    out = out or sys.stdout
    # Counted presses, not KeyboardInterrupt: the signal may land anywhere (mid-write), and the
    # reply must end through the engine's done so the next turn starts from a known state.
    engine.send(request)
    parts: list[str] = []
    stopping = False
    while True:
        if ctrl_c.take() and not stopping:
            engine.send(p.Stop())
            stopping = True
        ev = engine.next_event(timeout=0.1)
        if isinstance(ev, p.Token):
            parts.append(ev.text)
            out.write(ev.text)
            out.flush()
        elif isinstance(ev, p.Note):
            print(f"[{ev.message}]", file=sys.stderr)
        elif isinstance(ev, p.Done):
            return "".join(parts), ev
        elif isinstance(ev, p.Error):
            print(f"carve: {ev.message}", file=sys.stderr)
            if ev.fatal:
                raise CarveError(ev.message)
            return "".join(parts), None
        elif isinstance(ev, p.ProtocolError):
            print(f"carve: engine sent a bad line: {ev.message}", file=sys.stderr)


# ---------------------------------------------------------------- commands


# option -> SamplingParams field; a typo must fail before a model loads (the engine checks again)
_SAMPLING_OPTIONS = {
    "--temp": "temperature", "--top-k": "top_k", "--top-p": "top_p", "--min-p": "min_p",
    "--repeat-penalty": "repeat_penalty", "--seed": "seed", "--max-tokens": "max_tokens",
}  # fmt: skip


def sampling_of(args: argparse.Namespace) -> dict[str, Any]:
    settings = {name: getattr(args, opt[2:].replace("-", "_")) for opt, name in _SAMPLING_OPTIONS.items()}
    try:
        return SamplingParams(**settings).to_dict()
    except CarveError as err:
        named = (o for o, n in _SAMPLING_OPTIONS.items() if f"setting {n}=" in str(err))
        raise CarveError(f"{next(named, 'sampling')}: {err}") from None


def chat(args: argparse.Namespace) -> int:
    sampling = sampling_of(args)
    path = model_path(args.model)
    plan = build_plan(path, args.gpus, args.ctx, args.kv, args=args)
    with engine_process(args.verbose) as engine:
        engine.wait_for(p.Ready, timeout=120)
        load(engine, plan)
        print(f"{path.name}, ctx {plan.ctx}. /reset starts over, Ctrl-C stops a reply, "
              "Ctrl-C twice or Ctrl-D quits.", file=sys.stderr)  # fmt: skip
        system = [{"role": "system", "content": args.system}] if args.system else []
        with CtrlC() as ctrl_c:
            return _converse(engine, plan, sampling, system, ctrl_c)


def _converse(engine: EngineProcess, plan: Any, sampling: dict[str, Any],
              system: list[dict[str, str]], ctrl_c: CtrlC) -> int:  # fmt: skip
    """The prompt loop of `carve chat`; returns the exit status."""
    history: list[dict[str, str]] = []
    interrupted = False
    turn = 0
    while True:
        try:
            line = ctrl_c.read_line("> ")
        except EOFError:
            print(file=sys.stderr)
            return 0
        if line is None:
            # two presses quit, however fast the second follows (even before the next prompt)
            if ctrl_c.presses + interrupted >= 2:
                print(file=sys.stderr)
                return 0
            interrupted = True
            print("\n(Ctrl-C again or Ctrl-D to quit)", file=sys.stderr)
            continue
        interrupted = False
        text = line.strip()
        if not text:
            continue
        if text in ("/reset", "/clear"):
            history.clear()
            print("[conversation reset]", file=sys.stderr)
            continue
        if text in ("/exit", "/quit"):
            return 0
        history.append({"role": "user", "content": line})
        turn += 1
        request = p.Generate(system + history, f"turn{turn}", sampling)
        reply, done = stream_reply(engine, request, ctrl_c=ctrl_c)
        print()
        if done is None:
            history.pop()  # the engine refused this turn: keep the conversation as it was
            continue
        history.append({"role": "assistant", "content": reply})
        tail = " (stopped)" if done.reason == "cancelled" else ""
        print(f"[{done.completion_tokens} tokens{tail} · prefill {done.prefill_tps:.1f} t/s · "
              f"decode {done.decode_tps:.1f} t/s · ctx {done.ctx_used}/{plan.ctx}]",
              file=sys.stderr)  # fmt: skip


def tokenize(args: argparse.Namespace) -> int:
    path = model_path(args.model)
    text = read_text(args.file)
    with engine_process(args.verbose) as engine:
        engine.wait_for(p.Ready, timeout=120)
        engine.send(p.Tokenize(text, add_bos=False if args.no_bos else None,
                               parse_special=not args.no_parse_special, model=str(path)))  # fmt: skip
        ev = engine.wait_for(p.Tokens)
    print(json.dumps(ev.ids))
    return 0


def perplexity(args: argparse.Namespace) -> int:
    path = model_path(args.model)
    text = read_text(args.file)
    plan = build_plan(path, args.gpus, args.ctx, args.kv, logits_rows=args.ctx, args=args)
    with engine_process(args.verbose) as engine:
        engine.wait_for(p.Ready, timeout=120)
        load(engine, plan)
        engine.send(p.Perplexity(text, args.ctx))
        print(f"perplexity: {path.name}, --ctx {args.ctx}", file=sys.stderr)
        while True:
            ev = engine.wait_for(p.PerplexityResult)
            print(f"[{ev.chunks}]{ev.value:.4f},", end="", flush=True)
            if ev.chunks >= ev.total:
                break
    print(f"\nFinal estimate: PPL = {ev.value:.4f} +/- {ev.stderr:.5f}")
    return 0


def _exit_on_sigterm() -> Any:
    """SIGTERM (a logout, `kill`, a service manager) ends the command the way Ctrl-D does:
    SystemExit unwinds through `with engine_process()`, whose exit shuts the engine down and
    waits for it, so no engine is left holding memory; exit status 143 (128 + SIGTERM).
    Returns the handler it replaced (``main`` puts it back when the command ends)."""

    def on_sigterm(signum: int, _frame: object) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a second one ends us at once
        print("\ncarve: SIGTERM: stopping the engine", file=sys.stderr, flush=True)
        raise SystemExit(128 + signum)

    return signal.signal(signal.SIGTERM, on_sigterm)


def main(argv: list[str]) -> int:
    old = _exit_on_sigterm()
    try:
        args = parse_args(argv)
        return {"chat": chat, "tokenize": tokenize, "perplexity": perplexity}[argv[0]](args)
    except CarveError as err:
        print(f"carve: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    finally:  # a caller in the same process (the tests, a script) keeps its own handler
        signal.signal(signal.SIGTERM, old)
