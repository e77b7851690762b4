#!/usr/bin/env bash
# The GPU machine's one script: install the carried wheels, run the GPU tests, then `carve bench`
# on synthetic files of real shapes (written on the device), and print one table last.
#
#   BENCH="qwen2-7b" ENGINE=1 TESTS="tests/kernels" bash benchmarks/h200.sh
#
# Run from the repository root on the GPU machine. Wheels the device lacks (gguf) travel in .whl/
# (see benchmarks/README.md). Full JSON and logs go to $OUT (or /tmp/carve-out).
set -uo pipefail
out=${OUT:-/tmp/carve-out}
mkdir -p "$out"
# the device tool returns at most 8 files of $OUT (in name order): every log and JSON also goes
# into one archive whose name sorts first, written however the script ends
pack() { tar czf "$out/all-logs.tar.gz" -C "$out" --exclude all-logs.tar.gz . 2>/dev/null; }
trap pack EXIT
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site:$PWD
else
    export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1
python3 -c 'import gguf' 2>/dev/null || {
    echo "h200.sh: no gguf module here: fill .whl/ (bash benchmarks/make_whl.sh) and carry .whl" \
        "(benchmarks/README.md)"
    exit 2
}
nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv,noheader
echo "host: $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2)," \
    "$(awk '/MemTotal/ {printf "%.0f GiB", $2 / 2^20}' /proc/meminfo)"
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'

# what to run, from the environment (the device command line is short):
#   BENCH="qwen2-7b qwen2-0.5b"  synthetic shapes for `carve bench` (ENGINE=1 adds --engine);
#                                SHAPE@MIX picks a `carve gen --mix` (qwen2-7b@iq2_xxs)
#   BENCH_ARGS="--kernels"       more `carve bench` arguments for every BENCH shape (--trace:
#                                the decode step's kernels stamped from inside its graph)
#   SPLIT="qwen2-7b"             shapes also run as two stages (--compare-split)
#   TESTS="tests/engine/test_gpu_session.py ..."  pytest paths, run after the benches
#   TESTS_K="cuda or norm_router"  pytest's -k expression for TESTS (spaces kept)
#   TESTS_S=480                  the most seconds the tests may take (they compile their
#                                kernels on a fresh machine: longer than a bench step)
#   SERVE="qwen2-7b"             benchmarks.bench_serve on these synthetic shapes (carve
#                                serve through HTTP; needs starlette, uvicorn, httpx wheels)
#   PROBE="IQ2_XXS,IQ3_S"        benchmarks.t_probe on these types, with and without the shared
#                                grid (--no-smem), before the benches
#   PROBE_VARIANTS=";--bf16"     or with these ';'-separated t_probe argument sets instead
#   NCU="benchmarks.t_probe IQ3_S"  ncu (speed of light, occupancy, warp states, scheduler,
#                                launch, instruction mix, memory workload) on a module's
#                                second launch, before the benches; ';'-separated entries,
#                                each optionally "NCU FLAGS @ MODULE ARGS" (ncu's own launch
#                                filter, e.g. "--kernel-name regex:glu --launch-skip 2
#                                --launch-count 1 @ benchmarks.device_check --moe")
#   KERNELS="lowbit"             benchmarks.device_check --types (each type's GEMV against
#                                its byte floor at 7B sizes), run before the benches
#   HOST_SPLIT=1                 benchmarks.device_check --host-split (the round trip of a
#                                decode row split between GPU and CPU), before the benches
#   MOE=1                        benchmarks.device_check --moe (the mixture-of-experts
#                                kernels against their byte floors), run before the benches;
#                                MOE=MXFP4: only the shapes of those gate/up types;
#                                MOE_PREFILL=0: decode's kernels only
#   PLACE="--vram 12 --experts-resident auto;CARVE_HOST_READ=direct --vram 12 --experts-resident auto"
#                                more `carve bench` runs of the first BENCH shape's file, one per
#                                ';'-separated argument set (expert placements at a VRAM budget;
#                                leading NAME=VALUE words are its environment)
#   PLACE_SHAPES="qwen3moe-30b-a3b gpt-oss-20b"  the shapes PLACE runs on (default: the
#                                first BENCH shape)
#   BENCH_PLAIN=0                leave out the BENCH shapes' own runs (PLACE's only)
#   HOST_EXPERTS=1               benchmarks.bench_host_experts on this machine's cores, run first
#                                (before anything else loads the CPU)
#   SAMPLE=1                     benchmarks.device_check --sample (the GPU sampler's variants,
#                                greedy and default sampling, at real vocabularies)
#   MOE_HOST=1                   benchmarks.device_check --moe-host (decode's expert kernels
#                                reading pinned host memory in place), run before the benches
#   LLAMA="qwen3moe-30b-a3b"     llama-bench built from .whl/llama.cpp.tar.gz (CUDA, sm_90) on
#                                these shapes' files: pp512 and tg128, flash attention on, once
#                                per NCMOE value (--n-cpu-moe), each with its peak VRAM
#   LLAMA_ARGS="-t 8,16"         more llama-bench arguments (its thread counts, say)
#   LLAMA_FIRST=1                its benches (and build) before Carve's, so that no build
#                                shares the CPU with Carve's host experts
#   LLAMA_LATE=1                 or its build after Carve's benches (Carve's figures first,
#                                should the call run out of time)
#   NCMOE="0"                    comma-separated --n-cpu-moe values for LLAMA; a shape's own
#                                as SHAPE:VALUES (LLAMA="qwen3moe-30b-a3b:0,20 gpt-oss-20b:0,11")
#   LAUNCH="qwen2-7b"            benchmarks.bench_launch --runs 0 (cold launches, then a
#                                pre-started one) with the load's compile workers (the variants
#                                they compiled: $OUT/variants-SHAPE.jsonl, for
#                                benchmarks.bench_compile), then cold with
#                                CARVE_COMPILE_THREADS=0 (every kernel compiled in turn;
#                                LAUNCH_SERIAL=0 leaves that out)
#   SOAK="qwen2-0.5b"            benchmarks.soak through the engine process on the GPU
#   STEP_S=240                   the most seconds any one step may take
#   SYNTH_DIR=/dev/shm           where the synthetic files go (default /tmp: the disk; a file
#                                larger than the disk's free space fits in memory's tmpfs)
step=${STEP_S:-240}
synth() {  # the synthetic file of shape $1 (SHAPE or SHAPE@MIX), written once per machine
    local f=${SYNTH_DIR:-/tmp}/carve-bench-${1//@/-}.gguf mix=()
    [[ "$1" == *@* ]] && mix=(--mix "${1#*@}")
    if [ ! -s "$f" ]; then
        python3 -m engine.synth.gen --shape "${1%@*}" "${mix[@]}" -o "$f.part" >/dev/null \
            && mv "$f.part" "$f"
    fi
    echo "$f"
}
if [ "${HOST_EXPERTS:-0}" = 1 ]; then
    timeout "$step" python3 -m benchmarks.bench_host_experts --layers 6 --tokens 32 2>&1 \
        | tee "$out/host-experts.log"
fi
llama_build_start() {  # llama-bench built in the background (while the GPU benches run,
                       # unless LLAMA_LATE=1: after them, sharing the CPU with no one)
    ( [ -x /tmp/llama/llama.cpp/build/bin/llama-bench ] && exit 0  # built on this machine
      mkdir -p /tmp/llama && tar xzf .whl/llama.cpp.tar.gz -C /tmp/llama \
      && cd /tmp/llama/llama.cpp && cmake -B build -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 \
         -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
         -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF -DCMAKE_BUILD_TYPE=Release >/dev/null \
      && cmake --build build --target llama-bench -j "$(nproc)" >/dev/null ) \
        >"$out/llama-build.log" 2>&1 &
    llama_build=$!
    for spec in $LLAMA; do synth "${spec%%:*}" >/dev/null; done  # written while it builds
}
if [ -n "${LLAMA:-}" ] && [ "${LLAMA_LATE:-0}" != 1 ]; then
    llama_build_start
fi
llama_benches() {  # llama-bench on the LLAMA shapes, once its build is done
    if [ -n "${LLAMA:-}" ]; then
        wait "$llama_build" || { tail -20 "$out/llama-build.log"; echo "llama-bench build failed"; }
        lb=/tmp/llama/llama.cpp/build/bin/llama-bench
        for spec in $LLAMA; do
            s=${spec%%:*}
            f=$(synth "$s")
            values=${NCMOE:-0}
            [[ "$spec" == *:* ]] && values=${spec#*:}
            IFS=',' read -ra ns <<<"$values"
            for n in "${ns[@]}"; do
                nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 200 \
                    >"$out/llama-vram-${s//@/-}-$n.txt" &
                smi=$!
                timeout "$step" "$lb" -m "$f" -ngl 99 -fa 1 -p 512 -n 128 -r 2 -ncmoe "$n" ${LLAMA_ARGS:-} -o md \
                    2>&1 | grep -E '^\|' | tee "$out/llama-${s//@/-}-$n.md"
                kill "$smi" 2>/dev/null
                echo "llama.cpp $s --n-cpu-moe $n: peak VRAM $(sort -n "$out/llama-vram-${s//@/-}-$n.txt" \
                    | tail -1) MiB (whole GPU, nvidia-smi)"
            done
        done
    fi
}
[ "${LLAMA_FIRST:-0}" = 1 ] && llama_benches  # before the GPU benches, the build done
if [ -n "${PROBE:-}" ]; then
    IFS=';' read -ra probes <<<"${PROBE_VARIANTS:-;--no-smem}"
    i=0
    for v in "${probes[@]}"; do
        i=$((i + 1))
        # shellcheck disable=SC2086
        timeout "$step" python3 -m benchmarks.t_probe "$PROBE" $v 2>&1 | tee "$out/probe$i.log"
    done
fi
if [ -n "${NCU:-}" ]; then  # Nsight Compute on one launch of a benchmark module's kernel
    ncu_bin=$(command -v ncu || ls /usr/local/cuda*/bin/ncu /opt/nvidia/nsight-compute/*/ncu \
        2>/dev/null | head -1)
    [ -z "$ncu_bin" ] && echo "h200.sh: no ncu on this machine"
    IFS=';' read -ra ncus <<<"$NCU"
    [ -z "$ncu_bin" ] && ncus=()
    i=0
    for e in "${ncus[@]}"; do
        i=$((i + 1))
        flags="--launch-skip 1 --launch-count 1"
        if [[ "$e" == *@* ]]; then flags=${e%%@*}; e=${e#*@}; fi
        # shellcheck disable=SC2086
        timeout "$step" "$ncu_bin" $flags --section SpeedOfLight --section Occupancy \
            --section WarpStateStats --section SchedulerStats --section LaunchStats \
            --section InstructionStats --section MemoryWorkloadAnalysis python3 -m $e 2>&1 \
            | tee "$out/ncu$i.log" | grep -v "^==PROF==" | tail -160
    done
fi
if [ -n "${KERNELS:-}" ]; then
    timeout "$step" python3 -m benchmarks.device_check --types "$KERNELS" \
        --json "$out/device-check.json" 2>&1 | tee "$out/device-check.log"
fi
if [ "${SAMPLE:-0}" = 1 ]; then
    timeout "$step" python3 -m benchmarks.device_check --sample \
        --json "$out/device-check-sample.json" 2>&1 | tee "$out/device-check-sample.log"
fi
if [ "${MOE_HOST:-0}" = 1 ]; then
    timeout "$step" python3 -m benchmarks.device_check --moe-host \
        --json "$out/device-check-moe-host.json" 2>&1 | tee "$out/device-check-moe-host.log"
fi
if [ "${HOST_SPLIT:-0}" = 1 ]; then
    timeout "$step" python3 -m benchmarks.device_check --host-split \
        --json "$out/device-check-host-split.json" 2>&1 | tee "$out/device-check-host-split.log"
fi
if [ "${MOE:-0}" != 0 ]; then
    moe_types=()
    [ "$MOE" != 1 ] && moe_types=(--types "$MOE")
    [ "${MOE_PREFILL:-1}" = 0 ] && moe_types+=(--no-prefill)
    timeout "$step" python3 -m benchmarks.device_check --moe "${moe_types[@]}" \
        --json "$out/device-check-moe.json" 2>&1 | tee "$out/device-check-moe.log"
fi
for s in ${LAUNCH:-}; do
    CARVE_PRECOMPILE_DUMP="$out/variants-$s.jsonl" timeout "$step" python3 -m \
        benchmarks.bench_launch --synth "$s" --runs 0 2>&1 | tee "$out/launch-$s.log"
    [ "${LAUNCH_SERIAL:-1}" = 1 ] && CARVE_COMPILE_THREADS=0 timeout "$step" python3 -m benchmarks.bench_launch --synth "$s" \
        --runs 0 2>&1 | tee "$out/launch-serial-$s.log"
done
for s in ${SOAK:-}; do
    timeout "$step" python3 -m benchmarks.soak --synth "$s" --gpus auto --generate 1000 \
        --loads 100 --tokenize 1000 2>&1 | tee "$out/soak-$s.log" | grep -v "^ *[a-z]* *[0-9]* " \
        | tail -30
done
for s in ${BENCH:-}; do
    [ "${BENCH_PLAIN:-1}" = 0 ] && break
    extra=()
    [[ " ${SPLIT:-} " == *" $s "* ]] && extra+=(--compare-split)
    [ "${ENGINE:-0}" = 1 ] && extra+=(--engine)
    # shellcheck disable=SC2206
    extra+=(${BENCH_ARGS:-})
    f=$(synth "$s")
    n=${s//@/-}  # no '@' in the names of files that come back
    timeout "$step" python3 -m engine.runtime.bench "$f" --depths "" "${extra[@]}" \
        --json "$out/bench-$n.json" 2>&1 | tee "$out/bench-$n.log"
done
if [ -n "${PLACE:-}" ]; then
    IFS=';' read -ra places <<<"$PLACE"
    for s in ${PLACE_SHAPES:-${BENCH%% *}}; do
        f=$(synth "$s")
        i=0
        for a in "${places[@]}"; do
            i=$((i + 1))
            echo "== carve bench $s $a"
            read -ra words <<<"$a"
            envs=()
            while [[ "${words[0]:-}" == *=* && "${words[0]}" != -* ]]; do
                envs+=("${words[0]}")
                words=("${words[@]:1}")
            done
            timeout "$step" env "${envs[@]}" python3 -m engine.runtime.bench "$f" --depths "" \
                "${words[@]}" --json "$out/bench-${s//@/-}-place$i.json" 2>&1 \
                | tee "$out/bench-${s//@/-}-place$i.log"
        done
    done
fi
if [ "${LLAMA_FIRST:-0}" != 1 ]; then
    [ -n "${LLAMA:-}" ] && [ "${LLAMA_LATE:-0}" = 1 ] && llama_build_start
    llama_benches
fi
for s in ${SERVE:-}; do
    timeout "$step" python3 -m benchmarks.bench_serve --synth "$s" 2>&1 | tee "$out/serve-$s.log"
done
if [ -n "${TESTS:-}" ]; then
    kexpr=()
    [ -n "${TESTS_K:-}" ] && kexpr=(-k "$TESTS_K")
    # shellcheck disable=SC2086
    timeout "${TESTS_S:-480}" python3 -m pytest -q -p no:cacheprovider -x "${kexpr[@]}" $TESTS 2>&1 \
        | tee "$out/gpu-tests.log" | tail -15
fi
python3 - "$out" <<'PY'
import glob, json, sys
print(f"{'model':28s} {'stages':>6s} {'tg t/s':>8s} {'pp t/s':>9s} {'load GB/s':>9s} "
      f"{'priced==reserved':>16s}  greedy ids")
first = {}  # a model's first run: the ids the later runs' are held against
for f in sorted(glob.glob(sys.argv[1] + "/bench-*.json")):
    o = json.load(open(f))
    for r in o.get("runs", []):
        ref = first.setdefault(o["model"], r)
        if r is not ref and r.get("greedy64") and ref.get("greedy64") != r["greedy64"]:
            # where the ids part and by how much each run's winner led there: a lead of a
            # few hundredths of a logit is a near tie that rounding decides
            p = next(i for i, (a, b) in enumerate(zip(ref["greedy64"], r["greedy64"])) if a != b)
            print(f"{'':28s} ids part from the first run's at token {p}: lead there "
                  f"{r['greedy64_margins'][p]} (first run {ref['greedy64_margins'][p]}); "
                  f"smallest lead before it {min(ref['greedy64_margins'][:p + 1])}")
        same = all(d["priced"] == d["reserved"] for d in r["devices"])
        trials = ",".join(o.get("trials", []))
        print(f"{o['model'].rsplit('/', 1)[-1]:28s} {r['gpus']:6d} {r['tg']['tps']:8.1f} "
              f"{r['pp']['tps']:9.0f} {r['load_gbps']:9.1f} {same!s:>16s}  {r['greedy64_sha256']}"
              + (f"  trials {trials}" if trials else ""))
        if "experts" in r:
            e, tg, hit = r["experts"], r["tg"], r["tg"]["cache_hit_rate"]
            print(f"{'':28s} experts resident {e['resident'] or 'all'}, host ones on the "
                  f"{e['on']}, pinned {e['pinned'] / 2**30:.2f} GiB, slots {e['slots'] or 0}, hit "
                  f"{'n/a' if hit is None else f'{hit:.1%}'}, decode {tg['host_gbps']:.2f} GB/s "
                  f"host<->GPU, CPU {tg.get('host_cpu_ms_per_token', 0):.2f} ms/token, "
                  f"VRAM {sum(d['reserved'] for d in r['devices']) / 2**30:.2f} GiB")
    if "split_same_ids" in o:
        print(f"{'':28s} split keeps the greedy ids: {o['split_same_ids']}")
    e = o.get("engine", {}).get("summary")
    if e:
        print(f"{'':28s} engine process: greedy {e['greedy_decode_tps']:.1f} t/s, sampled "
              f"{e['sampled_decode_tps']:.1f} t/s, first/last prompt {e['first_prompt_tps']:.0f}"
              f"/{e['tenth_prompt_tps']:.0f} t/s, launch->loaded {e['launch_to_loaded_s']:.1f} s")
PY
