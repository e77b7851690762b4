#!/usr/bin/env bash
# Install Carve as a desktop application for this user (Linux). Re-running upgrades in place.
#
#   installer/install.sh [--no-demo] [--torch auto|cuda|cpu|keep] [--python PYTHON]
#                        [--system-site-packages] [--offline]
#
# What it adds, and nothing else (installer/uninstall.sh removes exactly these, from the
# manifest written last):
#   $DATA/venv                 Carve's own virtual environment, DATA=${XDG_DATA_HOME:-~/.local/share}/carve
#   $DATA/manifest             what was added, one a line (and the folders made for it)
#   ~/.local/bin/carve         the command (a link into the venv)
#   $XDG_DATA_HOME/applications/carve.desktop           the application menu entry
#   $XDG_DATA_HOME/icons/hicolor/scalable/apps/carve.svg its icon
#
# torch comes from pip's own configuration, or from the index in CARVE_TORCH_INDEX_URL when that
# is set. pip's default torch wheel on Linux is the CUDA build, right where `nvidia-smi` sees a
# GPU; on a machine without one point the variable at PyTorch's CPU-only wheel index for a
# download a fraction of the size (the script says so when it finds the CUDA build there).
#   --torch keep               install no torch: use one the venv already sees
#   --system-site-packages     the venv also sees PYTHON's own packages (an installed torch)
#   --offline                  install from what is already here: no package index, no build
#                              isolation, PYTHON's own pip and setuptools (with
#                              --system-site-packages; what CI's test uses)
#   --no-demo                  skip the demo model's packages (about 490 MB)
# Environment: CARVE_BIN_DIR (default ~/.local/bin), XDG_DATA_HOME, CARVE_TORCH_INDEX_URL.
set -euo pipefail

die() { echo "carve install: $*" >&2; exit 2; }

# All of it in one function, read whole before it runs: a checkout updated while an install
# runs (a `git pull` in another terminal) cannot change the script under the running shell.
main() {

    SRC=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
    PYTHON=python3
    TORCH=auto
    DEMO=1
    SYSTEM_SITE=0
    OFFLINE=0
    while [ $# -gt 0 ]; do
        case "$1" in
            --no-demo) DEMO=0 ;;
            --torch) [ $# -ge 2 ] || die "--torch needs auto, cuda, cpu or keep"; TORCH=$2; shift ;;
            --python) [ $# -ge 2 ] || die "--python needs a Python 3.11+ interpreter"; PYTHON=$2; shift ;;
            --system-site-packages) SYSTEM_SITE=1 ;;
            --offline) OFFLINE=1 ;;
            -h|--help) awk 'NR > 1 && !/^#/ { exit } NR > 1 { sub(/^# ?/, ""); print }' "$0"; exit 0 ;;
            *) die "unknown option $1 (see installer/install.sh --help)" ;;
        esac
        shift
    done
    case "$TORCH" in auto|cuda|cpu|keep) ;; *) die "--torch $TORCH: use auto, cuda, cpu or keep" ;; esac
    [ "$OFFLINE" = 0 ] || [ "$SYSTEM_SITE" = 1 ] || die "--offline needs --system-site-packages (the packages it installs from)"
    [ -f "$SRC/pyproject.toml" ] || die "$SRC is not a Carve checkout (no pyproject.toml)"
    command -v "$PYTHON" >/dev/null || die "$PYTHON not found; install Python 3.11 or newer, or pass --python"
    "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))' \
        || die "$PYTHON is Python $("$PYTHON" -c 'import platform; print(platform.python_version())'); Carve needs 3.11 or newer"

    SHARE=${XDG_DATA_HOME:-$HOME/.local/share}
    DATA=$SHARE/carve
    VENV=$DATA/venv
    BIN_DIR=${CARVE_BIN_DIR:-$HOME/.local/bin}
    APPS=$SHARE/applications
    ICONS=$SHARE/icons/hicolor/scalable/apps
    START=$(date +%s)

    # Folders this install creates (every missing one up to an existing parent) go in the manifest,
    # so that the uninstall removes them again when it leaves them empty.
    missing() { local d=$1; while [ ! -d "$d" ]; do echo "$d"; d=$(dirname "$d"); done; }
    CREATED=$(for d in "$DATA" "$BIN_DIR" "$APPS" "$ICONS"; do missing "$d"; done)

    if [ "$TORCH" = auto ]; then
        if nvidia-smi -L 2>/dev/null | grep -q '^GPU '; then TORCH=cuda; else TORCH=cpu; fi
    fi
    if { [ -e "$BIN_DIR/carve" ] || [ -L "$BIN_DIR/carve" ]; } \
            && [ "$(readlink "$BIN_DIR/carve")" != "$VENV/bin/carve" ]; then
        die "$BIN_DIR/carve exists and is not this install's; move it away or set CARVE_BIN_DIR"
    fi
    echo "carve install: from $SRC into $VENV (torch: $TORCH)"

    # An existing venv is upgraded in place; one made by another Python (or broken) is made anew.
    if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
        echo "carve install: upgrading the existing install"
    else
        rm -rf "$VENV"
        mkdir -p "$DATA"
        venv_args=()
        [ "$SYSTEM_SITE" = 1 ] && venv_args+=(--system-site-packages)
        # offline, the venv's own pip and setuptools (ensurepip's, older) could not build Carve:
        # PYTHON's, seen through its site-packages, install into the venv instead
        [ "$SYSTEM_SITE" = 1 ] && [ "$OFFLINE" = 1 ] && venv_args+=(--without-pip)
        "$PYTHON" -m venv "${venv_args[@]}" "$VENV" || die "could not create a virtual environment with $PYTHON (on Debian/Ubuntu: apt install python3-venv)"
    fi
    PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)
    PIP_OFFLINE=()
    if [ "$OFFLINE" = 1 ]; then PIP_OFFLINE=(--no-index --no-build-isolation); fi

    if [ "$TORCH" != keep ]; then
        torch_index=()
        [ -n "${CARVE_TORCH_INDEX_URL:-}" ] && torch_index=(--index-url "$CARVE_TORCH_INDEX_URL")
        "${PIP[@]}" install --upgrade "${PIP_OFFLINE[@]}" "${torch_index[@]}" torch \
            || die "could not install torch (set CARVE_TORCH_INDEX_URL to the index to take it from)"
        built=$("$VENV/bin/python" -W ignore -c 'import torch; print(torch.version.cuda or "cpu")' 2>/dev/null)
        if [ "$TORCH" = cpu ] && [ "$built" != cpu ]; then
            echo "carve install: note: no NVIDIA GPU here, but pip gave the CUDA $built build of torch;" \
                 "set CARVE_TORCH_INDEX_URL to PyTorch's CPU-only index and re-run for a smaller install"
        fi
    fi

    target="$SRC"
    [ "$DEMO" = 1 ] && target="$SRC[demo]"
    "${PIP[@]}" install --upgrade "${PIP_OFFLINE[@]}" "$target" || die "could not install Carve from $SRC"
    [ -x "$VENV/bin/carve" ] || die "the install left no $VENV/bin/carve"

    mkdir -p "$BIN_DIR" "$APPS" "$ICONS"
    ln -sfn "$VENV/bin/carve" "$BIN_DIR/carve"
    install -m 644 "$SRC/app/resources/carve.svg" "$ICONS/carve.svg"
    cat > "$APPS/carve.desktop.tmp" <<EOF
[Desktop Entry]
Type=Application
Name=Carve
GenericName=GGUF model launcher
Comment=Plan, launch and chat with large GGUF models on your GPUs
Exec=$VENV/bin/carve
Icon=carve
Terminal=false
Categories=Development;
Keywords=LLM;GGUF;GPU;chat;
StartupWMClass=Carve
EOF
    mv "$APPS/carve.desktop.tmp" "$APPS/carve.desktop"

    # The manifest: what uninstall.sh removes, in order. "file" lines are files or links, "venv"
    # the environment, "dir" a folder this install (or an earlier run of it) created, deepest first,
    # removed only when empty.
    {
        echo "file $BIN_DIR/carve"
        echo "file $APPS/carve.desktop"
        echo "file $ICONS/carve.svg"
        echo "venv $VENV"
        {
            [ -f "$DATA/manifest" ] && sed -n 's/^dir //p' "$DATA/manifest"
            [ -n "$CREATED" ] && echo "$CREATED"
            echo "$DATA"
        } | awk '!seen[$0]++ { print gsub("/", "/") " dir " $0 }' | sort -k1,1nr -k3 | cut -d' ' -f2-
    } > "$DATA/manifest.new"
    mv "$DATA/manifest.new" "$DATA/manifest"

    size=$(du -sh "$VENV" | cut -f1)
    echo "carve install: done in $(( $(date +%s) - START )) s; $size in $VENV"
    case ":$PATH:" in
        *":$BIN_DIR:"*) echo "carve install: run \`carve\`, or Carve in the application menu" ;;
        *) echo "carve install: $BIN_DIR is not on PATH; add it (or run $BIN_DIR/carve)" ;;
    esac
}

main "$@"
