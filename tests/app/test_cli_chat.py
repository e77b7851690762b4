"""`carve chat`, `carve tokenize`, `carve perplexity`: bad input is one `carve:` line and exit 2,
app/ never imports torch, chat streams and keeps turns (against tests/fake_engine.py), Ctrl-C
stops a reply without ending the session, and `carve tokenize` prints Tokenizer.encode's ids."""

from __future__ import annotations

import json
import os
import pty
import select
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from app import cli_chat

ROOT = Path(__file__).resolve().parents[2]
FAKE = f"{sys.executable} {ROOT / 'tests' / 'fake_engine.py'}"


def _env(**extra: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), **extra}


def _carve(*args: str, stdin: str = "", **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "app", *args], input=stdin, capture_output=True,
                          text=True, cwd=ROOT, env=_env(**env), timeout=300, check=False)  # fmt: skip


@pytest.fixture(scope="module")
def tiny_model(synth_model) -> Path:
    return synth_model("qwen2")


@pytest.fixture
def text_file(tmp_path) -> Path:
    path = tmp_path / "t.txt"
    path.write_text("Hello world")
    return path


BAD = [
    (["chat", "/nonexistent/model.gguf"], "no such model file"),
    (["chat", "{model}", "--temp", "-1"], "--temp: sampling setting temperature=-1.0 is out of range"),
    (["chat", "{model}", "--temp", "nan"], "--temp: sampling setting temperature=nan is out of range"),
    (["chat", "{model}", "--top-p", "0"], "--top-p"),
    (["chat", "{model}", "--max-tokens", "0"], "--max-tokens"),
    (["chat", "{model}", "--ctx", "lots"], "invalid int value"),
    (["chat", "{model}", "--frobnicate"], "unrecognized arguments: --frobnicate"),
    (["chat", "{model}", "--gpus", "7"], "--gpus: cannot read '7': not a card name or a size"),
    (["chat", "{model}", "--gpus", "fast"], "--gpus"),
    (["chat", "{model}", "--gpus", "2x24GiB"], "--gpus: '2x24GiB' is a rig to plan for"),
    (["perplexity", "{model}", "{text}", "--gpus", "rtx4090"], "carve plan MODEL --gpus rtx4090"),
    (["chat", "{model}", "--ctx", "0"], "--ctx"),
    (["tokenize", "{model}"], "the following arguments are required: file"),
    (["tokenize", "{model}", "/nonexistent.txt"], "cannot read it"),
    (["tokenize", "{model}", "{binary}"], "not UTF-8 text (bad byte at offset 2)"),
    (["perplexity", "{model}", "{text}", "--ctx", "-5"], "--ctx"),
]


@pytest.mark.parametrize("argv, expected", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_input_is_one_line_and_exit_2(argv, expected, tiny_model, text_file, tmp_path, capsys):
    binary = tmp_path / "bin.txt"
    binary.write_bytes(b"ok\xff\xfe")
    argv = [a.format(model=tiny_model, text=text_file, binary=binary) for a in argv]
    before = signal.getsignal(signal.SIGTERM)
    assert cli_chat.main(argv) == 2
    # the command's SIGTERM handler goes with it: a caller in the same process keeps its own
    assert signal.getsignal(signal.SIGTERM) is before
    err = capsys.readouterr().err.strip()
    assert err.startswith("carve: ") and "\n" not in err and "Traceback" not in err
    assert expected in err


def test_app_never_imports_torch(tiny_model, text_file):
    # the whole CLI path in one process: parse, plan + price, spawn the (fake) engine, tokenize
    code = (
        "import sys\n"
        "from app.__main__ import main\n"
        "from app import cli_chat\n"
        "from pathlib import Path\n"
        f"cli_chat.build_plan(Path({str(tiny_model)!r}), 'auto', 64, 'f16')\n"
        "cli_chat.sampling_of(cli_chat.parse_args(['chat']))\n"
        f"rc = main(['tokenize', {str(tiny_model)!r}, {str(text_file)!r}])\n"
        "print([m for m in ('torch', 'triton', 'PySide6') if m in sys.modules], rc)\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                         env=_env(CARVE_ENGINE_CMD=FAKE), timeout=120, check=False)  # fmt: skip
    assert res.returncode == 0, res.stderr
    lines = res.stdout.strip().splitlines()
    assert json.loads(lines[0]) == [1, *b"Hello world"]  # the fake engine's ids
    assert lines[-1] == "[] 0"


def test_chat_streams_keeps_turns_and_resets(tiny_model):
    res = _carve("chat", str(tiny_model), "--ctx", "64", "--system", "Be brief.",
                 stdin="hello\nagain\n/reset\nthird\n", CARVE_ENGINE_CMD=FAKE,
                 CARVE_FAKE_TOKEN_DELAY="0")  # fmt: skip
    assert res.returncode == 0, res.stderr
    for said in ("hello", "again", "third"):
        assert f"Hello from the fake engine. You said: {said}" in res.stdout
    # the fake engine's ctx_used counts the characters of every message it was sent:
    # turn 2 carries turn 1 and its reply; after /reset only the system prompt and "third"
    used = [int(line.split("ctx ")[1].split("/")[0]) for line in res.stderr.splitlines()
            if "t/s" in line]  # fmt: skip
    reply = len("Hello from the fake engine. You said: hello ")
    assert used[0] == len("Be brief.") + len("hello") + 8
    assert used[1] == len("Be brief.") + len("hello") + reply + len("again") + 8
    assert used[2] == used[0]
    assert "[conversation reset]" in res.stderr and "loaded in" in res.stderr


def test_chat_reports_a_load_error_and_exits_2(tiny_model):
    res = _carve("chat", str(tiny_model), "--ctx", "64", stdin="hi\n", CARVE_ENGINE_CMD=FAKE,
                 CARVE_FAKE_SCENARIO="load-error")  # fmt: skip
    assert res.returncode == 2
    assert res.stderr.strip().splitlines()[-1] == (
        "carve: fake: model does not fit on GPU 0 (Fake GPU): lower the context"
    )


def test_chat_reports_an_engine_crash(tiny_model):
    res = _carve("chat", str(tiny_model), "--ctx", "64", stdin="hi\n", CARVE_ENGINE_CMD=FAKE,
                 CARVE_FAKE_SCENARIO="crash-load")  # fmt: skip
    assert res.returncode == 2
    last = res.stderr.strip().splitlines()[-1]
    assert last.startswith("carve: the engine process exited (status 3)")
    assert "crashing mid-load" in last


class Terminal:
    """The master side of a pty: `expect` waits for text after what it matched last."""

    def __init__(self, fd: int) -> None:
        self.fd, self.buf, self.pos = fd, b"", 0

    def expect(self, needle: bytes, timeout: float = 30) -> bytes:
        deadline = time.monotonic() + timeout
        while (at := self.buf.find(needle, self.pos)) < 0:
            left = deadline - time.monotonic()
            assert left > 0, f"never saw {needle!r}; got {self.buf[self.pos :][-500:]!r}"
            if select.select([self.fd], [], [], left)[0]:
                try:
                    chunk = os.read(self.fd, 4096)
                except OSError:  # EIO: the child closed the terminal
                    chunk = b""
                assert chunk, f"terminal closed before {needle!r}"
                self.buf += chunk
        seen, self.pos = self.buf[self.pos : at + len(needle)], at + len(needle)
        return seen

    def send(self, data: bytes) -> None:
        os.write(self.fd, data)


def test_ctrl_c_stops_a_reply_and_twice_at_the_prompt_quits(tiny_model):
    env = _env(CARVE_ENGINE_CMD=FAKE, CARVE_FAKE_TOKEN_DELAY="0.3")
    pid, fd = pty.fork()
    if pid == 0:  # child: the terminal is its controlling tty, so ^C becomes SIGINT
        os.chdir(ROOT)
        os.execve(sys.executable, [sys.executable, "-m", "app", "chat", str(tiny_model),
                                   "--ctx", "64"], env)  # fmt: skip
    term = Terminal(fd)
    try:
        term.expect(b"> ")
        term.send(b"hi there\r")
        term.expect(b"from ")  # the reply is streaming
        term.send(b"\x03")
        assert b"You said" not in term.expect(b"(stopped)")  # well before the reply's end
        term.expect(b"> ")
        term.send(b"again\r")  # the session survived
        term.expect(b"You said: again")
        term.expect(b"> ")
        term.send(b"\x03")
        term.expect(b"Ctrl-C again")
        term.send(b"\x03")
        deadline = time.monotonic() + 30
        while not (done := os.waitpid(pid, os.WNOHANG))[0]:
            assert time.monotonic() < deadline, f"carve chat did not exit: {term.buf[-300:]!r}"
            if select.select([fd], [], [], 0.05)[0]:
                try:
                    term.buf += os.read(fd, 4096)
                except OSError:
                    time.sleep(0.05)
        pid = 0  # reaped
        assert os.waitstatus_to_exitcode(done[1]) == 0
    finally:
        if pid:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        os.close(fd)


def test_a_ctrl_c_before_the_prompt_waits_is_not_lost(monkeypatch, capsys):
    # the pty test's race made certain: SIGINT lands after the prompt is written but before the
    # read blocks. input() sat in read() until Enter; the prompt must see the press at once.
    before = signal.getsignal(signal.SIGINT)  # SIG_IGN under a shell's background job
    r, w = os.pipe()
    monkeypatch.setattr(sys, "stdin", os.fdopen(r, "r"))
    late = threading.Timer(5, os.write, (w, b"late\n"))  # a lost press fails, never hangs
    late.start()
    try:
        with cli_chat.CtrlC() as ctrl_c:
            os.kill(os.getpid(), signal.SIGINT)  # a signal to oneself lands before kill returns
            assert ctrl_c.read_line("> ") is None and ctrl_c.presses == 1
            os.write(w, "next\nzwei 世界\n".encode())
            assert [ctrl_c.read_line("> "), ctrl_c.read_line("> ")] == ["next", "zwei 世界"]
            late.cancel()
            os.close(w)
            with pytest.raises(EOFError):
                ctrl_c.read_line("> ")
    finally:
        late.cancel()
    assert signal.getsignal(signal.SIGINT) is before  # handed back as it was
    assert capsys.readouterr().out == "> " * 4


# ------------------------------------------------------------------ with the real engine


@pytest.mark.demo
@pytest.mark.parametrize(
    "which, flags",
    [  # qwen2 adds no BOS, gemma3 does: --no-bos only changes gemma's ids
        ("demo_model_path", []),
        ("demo_model_path", ["--no-parse-special"]),
        ("gemma_model_path", []),
        ("gemma_model_path", ["--no-bos"]),
    ],
)
def test_tokenize_prints_tokenizer_encode(which, flags, request, tmp_path):
    from engine.gguf.reader import GGUFModel
    from engine.text.tokenizer import Tokenizer

    model = Path(request.getfixturevalue(which))
    text = "Hello  world!\n\tdef f(x):  return x**2  # 世界 🙂\n<|im_end|><end_of_turn> <bos>"
    path = tmp_path / "in.txt"
    path.write_text(text, encoding="utf-8")
    res = _carve("tokenize", str(model), str(path), *flags)
    assert res.returncode == 0, res.stderr
    tok = Tokenizer.from_model(GGUFModel.open(model))
    expected = tok.encode(text, add_bos=False if "--no-bos" in flags else None,
                          parse_special="--no-parse-special" not in flags)  # fmt: skip
    assert json.loads(res.stdout) == expected
    assert res.stdout.count("\n") == 1


@pytest.mark.demo
@pytest.mark.slow
def test_perplexity_prints_progress_and_the_final_estimate(demo_model_path, tmp_path):
    pytest.importorskip("engine.runtime.session", reason="engine/runtime/session.py not landed")
    text = (  # public domain: the opening of "A Tale of Two Cities"
        "It was the best of times, it was the worst of times, it was the age of wisdom, it was "
        "the age of foolishness, it was the epoch of belief, it was the epoch of incredulity, it "
        "was the season of Light, it was the season of Darkness, it was the spring of hope, it "
        "was the winter of despair, we had everything before us, we had nothing before us, we "
        "were all going direct to Heaven, we were all going direct the other way."
    )
    path = tmp_path / "dickens.txt"
    path.write_text(text)
    res = _carve("perplexity", str(demo_model_path), str(path), "--ctx", "32", "--gpus", "cpu")
    assert res.returncode == 0, res.stderr
    lines = res.stdout.strip().splitlines()
    assert lines[0].startswith("[1]") and "[2]" in lines[0] and lines[0].endswith(",")
    final = lines[-1]
    assert final.startswith("Final estimate: PPL = ")
    value, err = float(final.split()[4]), float(final.split()[6])
    # a repetitive, famous sentence: a small model predicts its second halves well
    assert 1.0 < value < 20.0 and 0 < err < value


def test_a_file_the_runner_cannot_run_is_refused_before_the_engine_starts(synth_model, capsys):
    # TQ2_0: a type neither runner has a kernel for; refused at plan time, one line, exit 2
    path = synth_model("qwen2", "tq2_0")
    assert cli_chat.main(["chat", str(path), "--gpus", "cpu"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"carve: {path.name} does not run on CPU (") and "\n" not in err
    assert "TQ2_0 (blk.0.attn_q.weight and 28 more) has no dequantizer in the CPU engine" in err
