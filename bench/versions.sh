#!/usr/bin/env bash
# Export the templates/ of earlier commits, so that one GPU session can time several versions of
# the kernels side by side (bench/NOTES.md: each version's prediction needs its outcome).
#
#   bench/versions.sh COMMIT...      e.g. bench/versions.sh a9d30a0 8f7efcf
#
# Writes bench/.versions/<short sha>/ (git-ignored: hand it to the device with `carry`). Each
# export must render and compile offline, from today's Python and specs, for every tensor-core
# spec before it is kept; `bench/gpu_session.sh versions` then times each folder and the working
# tree with KERNELGEN_TEMPLATE_DIR, one process per version, on the same shapes.
set -euo pipefail
cd "$(dirname "$0")/.."
[ $# -gt 0 ] || { echo "usage: bench/versions.sh COMMIT..." >&2; exit 2; }
kernelgen=${KERNELGEN:-kernelgen}
command -v "$kernelgen" >/dev/null || kernelgen=.venv/bin/kernelgen
mkdir -p bench/.versions
for commit in "$@"; do
    sha=$(git rev-parse --short --verify -q "$commit^{commit}") ||
        { echo "versions: $commit: not a commit of this repository" >&2; exit 2; }
    dest=bench/.versions/$sha
    tmp=$(mktemp -d)
    git archive "$sha" templates | tar -x -C "$tmp"
    if ! KERNELGEN_TEMPLATE_DIR="$tmp/templates" "$kernelgen" build specs/v2_tc_*.yaml \
        -o "$tmp/generated" >"$tmp/build.log" 2>&1; then
        echo "versions: $sha: its templates do not build with today's kernelgen:" >&2
        tail -n 5 "$tmp/build.log" >&2
        rm -rf "$tmp"
        exit 1
    fi
    rm -rf "$dest"
    mv "$tmp/templates" "$dest"
    rm -rf "$tmp"
    echo "versions: $dest (templates of $(git log -1 --format='%h %s' "$sha" | cut -c1-70))"
done
