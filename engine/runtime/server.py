"""`carve-engine`: the engine process. JSON Lines requests on stdin, events on stdout
(engine/process/protocol.py); logs on stderr.

Threads: a reader turns stdin bytes into requests (answering bad lines at once and marking
stop/unload/shutdown as cancelling everything received before them), the main thread runs one
request at a time, a watchdog ends the process when its parent dies so no orphan holds VRAM,
and a heartbeat sends `alive` while a request runs and says nothing else, so a client can tell
a long step (a kernel compile, a big prefill) from a stopped or frozen process.

Cancellation is by sequence number, not a flag: each request gets the number of its arrival and
`stop` (also unload, shutdown, and a new load) cancels every request numbered below it. So a
stop sent right after a generate cancels that generate even if the worker has not started it
yet, and never a later one.
"""

from __future__ import annotations

import os

# CUDA must number GPUs the way NVML and the Plan do; this has to be set before torch loads.
os.environ["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"

import dataclasses
import gc
import importlib
import logging
import queue
import sys
import threading
import time
import traceback
from typing import IO, Any

from engine.process import protocol as p
from engine.runtime import timeline
from engine.runtime.options import RunnerOptions
from engine.runtime.replies import (
    ContextOverflow,
    TokenWriter,
    check_messages,
    is_fatal,
    one_line,
    plan_ctx,
    rate,
)
from spec.errors import CarveError

log = logging.getLogger("carve.engine")
# what every load imports, imported right after Ready (Engine.preload)
PRELOAD = ("torch", "engine.runtime.session", "engine.runtime.gpu.session", "engine.runtime.sampling",
           "engine.text.tokenizer", "engine.text.chat_template")
PROGRESS_INTERVAL = 0.1  # seconds between load progress events; the last one always goes
PARENT_POLL = 0.5  # seconds
EXIT_GRACE = 10.0  # seconds a shutdown may wait for a request that does not notice cancellation


def _profiled(path: str, fn: Any, *args: Any) -> None:
    """``fn(*args)`` under cProfile, the profile written to ``path`` however it ends
    (CARVE_PROFILE_LOAD: the load; CARVE_PROFILE_REPLY: the first reply)."""
    import cProfile

    prof = cProfile.Profile()
    try:
        prof.runcall(fn, *args)
    finally:
        prof.dump_stats(path)


class Engine:
    def __init__(self, out: IO[bytes], options: RunnerOptions = RunnerOptions()) -> None:
        self._out = out
        self.options = options  # how every model this process loads runs
        self._out_lock = threading.Lock()
        self._requests: queue.Queue[tuple[int, Any]] = queue.Queue()
        self._seq = 0  # number of the last request received (reader thread only writes it)
        self._cancel_below = 0  # requests numbered below this are cancelled
        self._exiting = threading.Event()
        self._served = threading.Event()  # serve() has returned
        self.session: Any = None
        self._tok: tuple[Any, Any] = (None, None)  # (session, its tokenizer)
        self._preloaded = threading.Event()  # set: no import is under way in another thread
        self._preloaded.set()
        self._busy = False  # a request is being handled (the heartbeat speaks only then)
        self._last_emit = time.monotonic()
        self._reply_profiled = False  # CARVE_PROFILE_REPLY's one profile was taken

    def start_preload(self) -> None:
        self._preloaded.clear()
        threading.Thread(target=self.preload, daemon=True, name="preload").start()

    def preload(self) -> None:
        """Import the engine's torch half (torch, Triton, the kernels, the runners) while the
        process waits for its first request: a launcher that starts the engine ahead of
        Launch (the window does, when a model is opened) then pays only for the load itself.
        Requests wait for it (`handle`), so no module is ever imported from two threads."""
        try:
            for name in PRELOAD:
                importlib.import_module(name)
        except Exception:  # noqa: BLE001 - the request that needs the module reports it
            log.debug("preload failed:\n%s", traceback.format_exc())
        finally:
            self._preloaded.set()

    # ------------------------------------------------------------ output

    def emit(self, msg: p.Message) -> None:
        try:
            with self._out_lock:
                self._out.write(p.encode(msg))
                self._out.flush()
                self._last_emit = time.monotonic()
        except (OSError, ValueError):  # reader gone (broken pipe, closed): nobody to serve
            self.request_exit("stdout closed")

    def emit_many(self, msgs: list[p.Message]) -> None:
        """Several events in one write and one flush."""
        try:
            with self._out_lock:
                self._out.write(b"".join(p.encode(m) for m in msgs))
                self._out.flush()
                self._last_emit = time.monotonic()
        except (OSError, ValueError):
            self.request_exit("stdout closed")

    # ------------------------------------------------------------ input (reader thread)

    def read_requests(self, fd: int) -> None:
        decoder = p.LineDecoder(p.REQUESTS)
        while True:
            try:
                chunk = os.read(fd, 1 << 16)
            except OSError:
                chunk = b""
            for item in decoder.feed(chunk) if chunk else decoder.finish():
                self._seq += 1
                if isinstance(item, p.ProtocolError):
                    log.warning("bad request %s: %s", item.excerpt, item.message)
                    self.emit(p.Error(f"bad request: {item.message}"))
                    continue
                if isinstance(item, (p.Stop, p.Unload, p.Shutdown, p.Load)):
                    self._cancel_below = self._seq  # a new load supersedes whatever runs
                if not isinstance(item, p.Stop):
                    self._requests.put((self._seq, item))
            if not chunk:
                self.request_exit("stdin closed")
                return

    def request_exit(self, why: str) -> None:
        """Cancel everything and stop serving; a request that ignores cancellation gets
        EXIT_GRACE seconds before the process ends anyway."""
        if self._exiting.is_set():
            return
        self._exiting.set()
        log.info("exiting: %s", why)
        self._cancel_below = sys.maxsize
        self._requests.put((sys.maxsize, p.Shutdown()))

        def force() -> None:
            if self._served.wait(EXIT_GRACE):
                return  # serve() ended in time
            log.error("a request did not finish %.0f s after %s; exiting anyway", EXIT_GRACE, why)
            os._exit(1)

        threading.Thread(target=force, daemon=True).start()

    def watch_parent(self) -> None:
        parent = os.getppid()
        while parent > 1:
            time.sleep(PARENT_POLL)
            if os.getppid() != parent:
                self.request_exit(f"parent process {parent} is gone")
                return

    def heartbeat(self, interval: float = p.HEARTBEAT) -> None:
        """`alive` every `interval` seconds while a request runs and nothing else went out."""
        while not self._exiting.wait(interval / 4):
            if self._busy and time.monotonic() - self._last_emit >= interval:
                self.emit(p.Alive())

    # ------------------------------------------------------------ worker (main thread)

    def serve(self) -> int:
        try:
            return self._serve()
        finally:
            self._served.set()

    def _serve(self) -> int:
        while True:
            seq, req = self._requests.get()
            if isinstance(req, p.Shutdown):
                break

            def cancelled(seq: int = seq) -> bool:
                return seq < self._cancel_below or self._exiting.is_set()

            self._busy = True
            try:
                self.handle(req, cancelled)
            except Exception as err:  # noqa: BLE001 - any failure is one error event, then serve on
                if not isinstance(err, CarveError):
                    log.error("request %s failed:\n%s", req.TYPE, traceback.format_exc())
                fatal = is_fatal(err)
                self.emit(p.Error(one_line(err), fatal=fatal, request=getattr(req, "id", ""),
                                  code=getattr(err, "code", "")))
                if fatal:  # the CUDA context is poisoned: only a new process can use the GPU
                    return 1
            finally:
                self._busy = False
        self.release()
        return 0

    def handle(self, req: p.Request, cancelled: Any) -> None:
        self._preloaded.wait()
        if isinstance(req, p.Load):
            self.load(req, cancelled)
        elif isinstance(req, p.Unload):
            self.release()
            self.emit(p.Unloaded())
        elif isinstance(req, p.Generate):
            path = os.environ.get("CARVE_PROFILE_REPLY")
            if path and not self._reply_profiled:
                # the first reply after the process started: what it pays that later ones do not
                self._reply_profiled = True
                _profiled(path, self.generate, req, cancelled)
            else:
                self.generate(req, cancelled)
        elif isinstance(req, p.Tokenize):
            self.tokenize(req)
        elif isinstance(req, p.Perplexity):
            self.perplexity(req, cancelled)

    def release(self) -> None:
        """Free the loaded model, every allocation with it."""
        session, self.session = self.session, None
        self._tok = (None, None)
        if session is not None:
            session.close()
        del session
        gc.collect()
        # torch half-imported by the preload thread has no CUDA state to hand back yet
        torch = sys.modules.get("torch") if self._preloaded.is_set() else None
        if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.empty_cache()

    def load(self, req: p.Load, cancelled: Any) -> None:
        path = os.environ.get("CARVE_PROFILE_LOAD")
        if path:
            _profiled(path, self._load, req, cancelled)
        else:
            self._load(req, cancelled)

    def _load(self, req: p.Load, cancelled: Any) -> None:
        timeline.reset()
        from engine.planning.plan import Plan
        from engine.runtime.session import Session

        timeline.mark("imports")
        self.release()  # one model at a time: free the old one before pricing memory for the new
        plan = Plan.from_json(req.plan)
        last = {"t": 0.0, "stage": ""}

        def on_progress(stage: str, done: int, total: int, rate: float) -> None:
            now = time.monotonic()
            if stage != last["stage"] or done >= total or now - last["t"] >= PROGRESS_INTERVAL:
                last.update(t=now, stage=stage)
                self.emit(p.Progress(stage, int(done), int(total), float(rate)))

        try:
            session = Session.load(plan, on_progress=on_progress, cancelled=cancelled,
                                   options=self.options)
        except Exception:
            self.release()  # whatever the loader allocated before failing goes now
            if cancelled():
                self.emit(p.Unloaded())
                return
            raise
        if cancelled():  # the loader finished (or ignored it) but nobody wants this model now
            if session is not None:
                session.close()
            self.release()
            self.emit(p.Unloaded())
            return
        self.session = session
        on_progress(p.TOKENIZER, 0, 1, 0.0)
        self._tokenizer(session)  # built now, not on the first reply
        on_progress(p.TOKENIZER, 1, 1, 0.0)
        timeline.mark("tokenizer")
        report = list(session.memory_report())
        for d in report:
            if d.get("overhead_measured") is not None:  # the GPU runner measured its overhead
                log.info("GPU %s: priced %d B, reserved %d B, NVML used %s -> %s B, runtime "
                         "overhead %d B (priced %d B)", d["index"], d["priced"], d["allocated"],
                         d.get("nvml_before"), d.get("nvml_used"), d["overhead_measured"],
                         d.get("overhead_priced", 0))
        timeline.mark("loaded")
        self.emit(p.Loaded(report, timeline.marks()))

    def _require_session(self, what: str) -> Any:
        if self.session is None:
            raise CarveError(f"{what}: no model is loaded; send a load request first")
        return self.session

    def _tokenizer(self, session: Any) -> Any:
        from engine.text.tokenizer import Tokenizer

        if self._tok[0] is not session:  # built once per loaded model, not per turn
            self._tok = (session, Tokenizer.from_model(session.model))
        return self._tok[1]

    def generate(self, req: p.Generate, cancelled: Any) -> None:
        session = self._require_session("generate")
        from engine.runtime.sampling import SamplingParams
        from engine.text.chat_template import render_chat

        if req.prompt is None:
            messages = check_messages(req.messages)
        elif not req.prompt:
            raise CarveError("generate: the prompt is empty; send some text")
        params = SamplingParams.from_dict(req.sampling)
        if req.max_tokens is not None:
            params = dataclasses.replace(params, max_tokens=req.max_tokens)
        tok = self._tokenizer(session)
        if req.prompt is None:
            text, note = render_chat(session.model, messages)
            if note:
                self.emit(p.Note(note))
        else:
            text = req.prompt
        ids = tok.encode(text, parse_special=True)
        if len(ids) >= 2 and ids[0] == ids[1] == tok.bos_id:
            ids = ids[
                1:
            ]  # the template wrote BOS and the tokenizer added one (llama.cpp drops it too)
        ctx = plan_ctx(session)
        if len(ids) >= ctx:
            what, shorter = (("conversation", "start over (/reset)") if req.prompt is None
                             else ("prompt", "shorten it"))
            raise ContextOverflow(
                f"the {what} is {len(ids)} tokens but the context holds {ctx}: "
                f"{shorter} or load the model with a larger --ctx"
            )
        if params.max_tokens > ctx - len(ids):
            if req.exact_max_tokens:
                raise ContextOverflow(
                    f"the prompt is {len(ids)} tokens and max_tokens is {params.max_tokens}: "
                    f"{len(ids) + params.max_tokens} tokens do not fit the context of {ctx}; "
                    f"ask for at most {ctx - len(ids)} tokens or load the model with a larger --ctx"
                )
            params = dataclasses.replace(params, max_tokens=ctx - len(ids))
        stop_ids = set(tok.eot_ids) | ({tok.eos_id} if tok.eos_id is not None else set())
        writer = TokenWriter(self, tok.stream_decoder())

        def on_token(token_id: int) -> bool:
            writer.put(token_id)
            return not cancelled()

        try:
            stats = session.generate(ids, params, stop_ids, on_token)
        finally:
            writer.close()  # every token event is written before Done (or the error)
        reason = "cancelled" if cancelled() and stats.reason != "length" else stats.reason
        self.emit(
            p.Done(
                reason=reason,
                prompt_tokens=stats.prompt_tokens,
                completion_tokens=stats.completion_tokens,
                prefill_tps=getattr(
                    stats, "prefill_tps", rate(stats.prompt_tokens, stats.prefill_s)
                ),
                decode_tps=getattr(
                    stats, "decode_tps", rate(stats.completion_tokens, stats.decode_s)
                ),
                ctx_used=stats.prompt_tokens + stats.completion_tokens,
                request=req.id,
            )
        )

    def tokenize(self, req: p.Tokenize) -> None:
        if req.model:
            from engine.gguf.reader import GGUFModel
            from engine.text.tokenizer import Tokenizer

            tok = Tokenizer.from_model(GGUFModel.open(req.model))
        else:
            tok = self._tokenizer(self._require_session("tokenize"))
        ids = tok.encode(req.text, add_bos=req.add_bos, parse_special=req.parse_special)
        self.emit(p.Tokens([int(i) for i in ids]))

    def perplexity(self, req: p.Perplexity, cancelled: Any) -> None:
        session = self._require_session("perplexity")
        tok = self._tokenizer(session)
        from engine.runtime.perplexity import perplexity

        def on_chunk(chunks: int, total: int, value: float, err: float) -> None:
            self.emit(p.PerplexityResult(value, err, chunks, total))
            if cancelled():
                raise CarveError(f"perplexity: stopped after {chunks} of {total} chunks")

        ids = tok.encode(req.text, parse_special=False)  # llama-perplexity: specials as text
        perplexity(session, ids, req.ctx, tok.bos_id if tok.add_bos else None, on_chunk)


def take_stdout() -> IO[bytes]:
    """A private handle on the real stdout for protocol lines; fd 1 and sys.stdout then point at
    stderr, so a stray print (ours, a library's, or C code's) can never corrupt the stream."""
    sys.stdout.flush()
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return out


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(
        stream=sys.stderr,
        level=os.environ.get("CARVE_LOG", "INFO").upper(),
        format="carve-engine %(levelname).1s %(message)s",
    )
    try:
        options = RunnerOptions.from_env(os.environ)
        options.apply()
    except CarveError as err:
        print(f"carve-engine: {err}", file=sys.stderr, flush=True)
        return 2
    engine = Engine(take_stdout(), options)
    engine.emit(p.Ready(pid=os.getpid()))  # before the reader can answer a bad line
    engine.start_preload()
    threading.Thread(target=engine.read_requests, args=(0,), daemon=True, name="stdin").start()
    threading.Thread(target=engine.watch_parent, daemon=True, name="parent").start()
    threading.Thread(target=engine.heartbeat, daemon=True, name="heartbeat").start()
    try:
        code = engine.serve()
    except KeyboardInterrupt:
        code = 130
    if code == 0:
        engine.release()
    return code


if __name__ == "__main__":
    sys.exit(main())
