#!/usr/bin/env bash
# One GPU session in one command. The plan (stages, budgets, priorities) lives in bench/session.py:
#
#   bench/gpu_session.sh [STAGE ...]     # = python3 -m bench.session [--out $OUT] [STAGE ...]
#   bench/gpu_session.sh versions        # times bench/.versions/* (bench/versions.sh) and the tree
#
# Expects kernelgen and its dependencies importable (e.g. PYTHONPATH=$PWD plus a pydantic wheel).
set -u
OUT=${OUT:-$PWD/gpu-out}
if [ "${1:-}" != versions ]; then
    exec python3 -m bench.session --out "$OUT" "$@"
fi
mkdir -p "$OUT/results"
for dir in bench/.versions/*/ "$PWD/templates/"; do
    [ -d "$dir" ] || continue
    label=$(basename "$dir")
    [ "$label" = templates ] && label=tree
    start=$SECONDS
    timeout --signal=INT "${VERSION_S:-120}" env KERNELGEN_TEMPLATE_DIR="$dir" \
        python3 -m bench.attention --peers torch-flash,kg-tc-v2 --dtype bf16 --head-dim 128 \
        --seqlen 4096 --budget-ms 200 --tag "version-$label" --out "$OUT/results" \
        >"$OUT/bench-version-$label.log" 2>&1
    echo "v-$label rc=$? in $((SECONDS - start)) s"
done
tar czf "$OUT/session.tgz" -C "$OUT" --exclude session.tgz . 2>/dev/null && echo "bundled: $OUT/session.tgz"
