#!/usr/bin/env bash
# The GPU machine's one script: install the carried wheels, run the GPU tests, then `carve bench`
# on synthetic files of real shapes (written on the device), and print one table last.
#
#   bash benchmarks/h200.sh [--tests] [--bench SHAPE ...] [--split SHAPE]
#
# Run from the repository root on the GPU machine. Wheels the device lacks (gguf) travel in .whl/
# (see benchmarks/README.md). Full JSON and logs go to $OUT (or /tmp/carve-out).
set -uo pipefail
out=${OUT:-/tmp/carve-out}
mkdir -p "$out"
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site:$PWD
else
    export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv,noheader
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'

tests=0 shapes=() split=()
while [ $# -gt 0 ]; do
    case "$1" in
        --tests) tests=1 ;;
        --bench) shift; while [ $# -gt 0 ] && [ "${1#--}" = "$1" ]; do shapes+=("$1"); shift; done; continue ;;
        --split) shift; split+=("$1") ;;
        *) echo "h200.sh: unknown argument $1" >&2; exit 2 ;;
    esac
    shift
done

if [ "$tests" = 1 ]; then
    python3 -m pytest -q -p no:cacheprovider -m gpu --ignore=tests/app tests 2>&1 | tee "$out/gpu-tests.log" | tail -15
fi
for s in "${shapes[@]}" "${split[@]}"; do
    extra=()
    for t in "${split[@]}"; do [ "$t" = "$s" ] && extra=(--compare-split); done
    python3 -m engine.runtime.bench --synth "$s" --depths "" "${extra[@]}" --json "$out/bench-$s.json" \
        2>&1 | tee "$out/bench-$s.log"
done
python3 - "$out" <<'PY'
import glob, json, sys
print(f"{'model':28s} {'stages':>6s} {'tg t/s':>8s} {'pp t/s':>9s} {'load GB/s':>9s} "
      f"{'priced==reserved':>16s}  greedy ids")
for f in sorted(glob.glob(sys.argv[1] + "/bench-*.json")):
    o = json.load(open(f))
    for r in o.get("runs", []):
        same = all(d["priced"] == d["reserved"] for d in r["devices"])
        print(f"{o['model'].rsplit('/', 1)[-1]:28s} {r['gpus']:6d} {r['tg']['tps']:8.1f} "
              f"{r['pp']['tps']:9.0f} {r['load_gbps']:9.1f} {same!s:>16s}  {r['greedy64_sha256']}")
    if "split_same_ids" in o:
        print(f"{'':28s} split keeps the greedy ids: {o['split_same_ids']}")
PY
