#!/usr/bin/env bash
# One GPU session in one command: the GPU test tier, the benchmarks, a compute-sanitizer pass.
# Logs and result files go under $OUT (default ./gpu-out), also bundled into $OUT/session.tgz; a
# short summary is printed last.
#
#   bench/gpu_session.sh [tests] [decode] [prefill] [serving] [tuning] [sanitize] [versions]
#
# (default: all but versions). `versions` times the template folders bench/versions.sh exported
# (bench/.versions/*, carried to the device) and the working tree, one process each, on bf16
# d128 4k against torch's flash backend. Each stage has its own time limit (seconds,
# environment): TESTS_S=480 DECODE_S=240 PREFILL_S=240 SERVING_S=180 TUNING_S=240 SANITIZE_S=120
# VERSION_S=120
# (per version), so a subset fits one 10-minute device command. Expects
# kernelgen and its dependencies importable (e.g. PYTHONPATH=$PWD plus a pydantic wheel).
set -u
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT/results"
stages=("$@")
[ ${#stages[@]} -eq 0 ] && stages=(tests decode prefill serving tuning sanitize)
summary=()

note() { summary+=("$(printf '%-9s %s' "$1" "$2")"); }

run_stage() {  # name, limit, log, command...
    local name=$1 limit=$2 log=$3
    shift 3
    local start=$SECONDS
    timeout --signal=INT "$limit" "$@" >"$OUT/$log" 2>&1
    local rc=$?
    note "$name" "rc=$rc in $((SECONDS - start)) s ($log: $(tail -n 1 "$OUT/$log" | cut -c1-90))"
}

nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv \
    >"$OUT/gpu.txt" 2>&1
# a fresh tuning database, outside $OUT: its many small files would crowd out the results
export KERNELGEN_CACHE_DIR=${KERNELGEN_CACHE_DIR:-$(mktemp -d)/kernelgen-cache}

for stage in "${stages[@]}"; do
    case $stage in
    tests)
        run_stage tests "${TESTS_S:-480}" pytest-gpu.log \
            python3 -m pytest -m gpu -q -p no:cacheprovider -x --junitxml="$OUT/pytest-gpu.xml"
        ;;
    decode)
        run_stage decode "${DECODE_S:-240}" bench-decode.log \
            python3 -m bench.decode --quick --sweep-splits --out "$OUT/results"
        ;;
    prefill)
        run_stage prefill "${PREFILL_S:-240}" bench-prefill.log \
            python3 -m bench.attention --quick --out "$OUT/results"
        ;;
    serving)
        run_stage serving "${SERVING_S:-180}" bench-serving.log \
            python3 -m bench.serving --quick --out "$OUT/results"
        ;;
    tuning)
        run_stage tuning "${TUNING_S:-240}" bench-tuning.log \
            python3 -m bench.tuning --quick --out "$OUT/results"
        ;;
    sanitize)
        # memcheck and racecheck of one split-KV decode call and one prefill call (small
        # shapes: the tools slow kernels down by orders of magnitude)
        for tool in memcheck racecheck; do
            run_stage "$tool" "${SANITIZE_S:-120}" "sanitize-$tool.log" \
                compute-sanitizer --tool "$tool" --error-exitcode 3 \
                python3 -m kernelgen.selfcheck
        done
        ;;
    versions)
        for dir in bench/.versions/*/ "$PWD/templates/"; do
            [ -d "$dir" ] || continue
            label=$(basename "$dir")
            [ "$label" = templates ] && label=tree
            run_stage "v-$label" "${VERSION_S:-120}" "bench-version-$label.log" \
                env KERNELGEN_TEMPLATE_DIR="$dir" python3 -m bench.attention \
                --peers torch-flash,kg-tc-v2 --dtype bf16 --head-dim 128 --seqlen 4096 \
                --budget-ms 200 --tag "version-$label" --out "$OUT/results"
        done
        ;;
    *)
        echo "gpu_session: unknown stage $stage (tests, decode, prefill, serving, tuning, sanitize," \
            "versions)" >&2
        exit 2
        ;;
    esac
done

echo
cat "$OUT/gpu.txt"
for f in "$OUT"/results/*-decode*.md "$OUT"/results/*-tuning*.md; do
    [ -f "$f" ] && grep -E "^(- )?(PASS|MISS|not measured)|target" "$f" | head -n 12
done
printf '%s\n' "${summary[@]}"
tar czf "$OUT/session.tgz" -C "$OUT" --exclude session.tgz . 2>/dev/null && echo "bundled: $OUT/session.tgz"
