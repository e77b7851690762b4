"""installer/install.sh and uninstall.sh, run for real into a temporary HOME: the `carve` command
on the user's PATH starts from Carve's own virtual environment, the menu entry validates, a
second run upgrades in place, and the uninstaller leaves the HOME as it found it.

To stay fast and offline the venv sees this Python's packages (torch among them) and pip takes
nothing from an index (--system-site-packages --offline --torch keep --no-demo); everything
else is the path a user's install takes."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
INSTALL = ROOT / "installer" / "install.sh"
UNINSTALL = ROOT / "installer" / "uninstall.sh"
OPTIONS = ["--system-site-packages", "--offline", "--torch", "keep", "--no-demo",
           "--python", sys.executable]


def _run(cmd: list[str], env: dict[str, str], timeout: int = 300) -> subprocess.CompletedProcess:
    out = subprocess.run(cmd, check=False, capture_output=True, text=True, env=env,
                         timeout=timeout, cwd=env["HOME"])
    assert out.returncode == 0, f"{cmd[0]}: {out.stdout}\n{out.stderr}"
    return out


def _tree(home: Path) -> list[str]:
    return sorted(str(p.relative_to(home)) for p in home.rglob("*"))


@pytest.mark.slow
def test_install_run_upgrade_uninstall(tmp_path, synth_model):
    home = tmp_path / "home"
    (home / "Documents").mkdir(parents=True)  # a user's own folder: it must survive
    before = _tree(home)
    elsewhere = tmp_path / "elsewhere"  # pip's cache, and what carve itself writes while running
    keep = ("PATH", "LANG", "LC_ALL", "PIP_FIND_LINKS", "PIP_CONSTRAINT", "PIP_CERT")
    env = {k: os.environ[k] for k in keep if k in os.environ}
    env |= {"HOME": str(home), "XDG_CACHE_HOME": str(elsewhere / "cache"),
            "CARVE_CONFIG_DIR": str(elsewhere / "config"), "QT_QPA_PLATFORM": "offscreen"}
    # toolchain proxies on PATH (rustup's, which the wheel build wakes) keep their state in HOME:
    # point them at their real homes, so that only what the installer adds lands in this one
    for var, folder in (("RUSTUP_HOME", ".rustup"), ("CARGO_HOME", ".cargo")):
        env[var] = os.environ.get(var) or str(Path.home() / folder)

    first = _run(["bash", str(INSTALL), *OPTIONS], env)
    assert "done in" in first.stdout, first.stdout
    data = home / ".local" / "share" / "carve"
    carve = home / ".local" / "bin" / "carve"
    assert carve.is_symlink() and carve.resolve() == (data / "venv" / "bin" / "carve").resolve()

    # the installed command runs the installed package, not this checkout
    version = _run([str(carve), "--version"], env)
    assert version.stdout.strip() == "carve 0.1.0"
    where = _run([str(data / "venv" / "bin" / "python"), "-c",
                  "import app.theme as t; print(t.__file__); print(len(t.style_sheet(t.LIGHT)))"],
                 env)
    module, sheet = where.stdout.split()
    assert module.startswith(str(data / "venv")) and int(sheet) > 0  # the style sheets installed
    png = tmp_path / "window.png"
    _run([str(carve), "--snapshot", str(png), "--model", str(synth_model("qwen2")),
          "--gpus", "2x24GiB"], env, timeout=180)
    from PySide6.QtGui import QImage

    assert (QImage(str(png)).width(), QImage(str(png)).height()) == (1280, 800)

    entry = home / ".local" / "share" / "applications" / "carve.desktop"
    icon = home / ".local" / "share" / "icons" / "hicolor" / "scalable" / "apps" / "carve.svg"
    text = entry.read_text()
    assert f"Exec={data / 'venv' / 'bin' / 'carve'}\n" in text and "Icon=carve\n" in text
    assert "StartupWMClass=Carve\n" in text  # the window's WM_CLASS is ("carve", "Carve")
    assert icon.read_bytes() == (ROOT / "app" / "resources" / "carve.svg").read_bytes()
    if shutil.which("desktop-file-validate"):  # desktop-file-utils
        check = subprocess.run(["desktop-file-validate", str(entry)], capture_output=True,
                               text=True, check=False)
        assert check.returncode == 0 and not check.stdout.strip(), check.stdout + check.stderr

    # a second run upgrades the same venv in place and lists the same things
    manifest = (data / "manifest").read_text()
    again = _run(["bash", str(INSTALL), *OPTIONS], env)
    assert "upgrading the existing install" in again.stdout
    assert (data / "manifest").read_text() == manifest
    assert _run([str(carve), "--version"], env).stdout.strip() == "carve 0.1.0"

    _run(["bash", str(UNINSTALL)], env)
    assert _tree(home) == before  # exactly what was added is gone; the user's folder stays


def test_bad_options_say_so_in_one_line(tmp_path):
    env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path)}
    for args, words in ((["--torch", "rocm"], "--torch rocm"), (["--frobnicate"], "--frobnicate"),
                        (["--python", "/nonexistent/python3"], "/nonexistent/python3")):
        out = subprocess.run(["bash", str(INSTALL), *args], capture_output=True, text=True,
                             env=env, check=False, timeout=30)
        assert out.returncode == 2 and words in out.stderr, out.stderr
        assert out.stderr.count("\n") == 1 and out.stderr.startswith("carve install: ")
    assert list(tmp_path.iterdir()) == []  # nothing was installed
    other = tmp_path / ".local" / "bin" / "carve"  # a `carve` that is not this install's
    other.parent.mkdir(parents=True)
    other.write_text("#!/bin/sh\necho another carve\n")
    out = subprocess.run(["bash", str(INSTALL), "--python", sys.executable], capture_output=True,
                         text=True, env=env, check=False, timeout=30)
    assert out.returncode == 2 and "is not this install's" in out.stderr, out.stderr
    assert other.read_text() == "#!/bin/sh\necho another carve\n"
    assert not (tmp_path / ".local" / "share").exists()
    shutil.rmtree(tmp_path / ".local")
    out = subprocess.run(["bash", str(UNINSTALL)], capture_output=True, text=True, env=env,
                         check=False, timeout=30)
    assert out.returncode == 2 and "no install found" in out.stderr
