#!/usr/bin/env bash
# Remove what installer/install.sh added for this user, as its manifest lists it:
# the `carve` command, the menu entry and its icon, Carve's virtual environment, and the
# folders the install created once they are empty. Models, presets and caches that Carve wrote
# while running (~/.cache/carve, ~/.config/carve) stay: they are the user's.
set -euo pipefail

DATA=${XDG_DATA_HOME:-$HOME/.local/share}/carve
MANIFEST=$DATA/manifest
[ -f "$MANIFEST" ] || { echo "carve uninstall: no install found ($MANIFEST is missing)" >&2; exit 2; }

while read -r kind path; do
    [ -n "$path" ] || continue
    case "$kind" in
        file) rm -f -- "$path" ;;
        venv)
            # the one recursive removal: only ever Carve's own environment
            case "$path" in
                "$DATA/venv") rm -rf -- "$path" ;;
                *) echo "carve uninstall: skipping $path: not $DATA/venv" >&2 ;;
            esac ;;
        dir) ;;  # after the files, below
        *) echo "carve uninstall: skipping an unknown manifest line: $kind $path" >&2 ;;
    esac
done < "$MANIFEST"
dirs=$(sed -n 's/^dir //p' "$MANIFEST")
rm -f -- "$MANIFEST"
while IFS= read -r dir; do
    [ -n "$dir" ] && rmdir -- "$dir" 2>/dev/null || true  # kept when something else is in it
done <<< "$dirs"
echo "carve uninstall: removed"
