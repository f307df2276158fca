#!/usr/bin/env bash
# lamina benchmark: convert time, ls -lR and full-read times (warm and cold),
# metadata and blob sizes, side by side with mksquashfs / mkfs.erofs on the
# reference Debian image. See docs/benchmarks.md for the method.
#
# Usage: scripts/bench.sh [--runs N] [--cold-runs C] [--warm-runs W] [--out FILE]
#                         [--plot FILE | --no-plot]
#   --runs N       runs of every convert and mount measurement (default 3)
#   --cold-runs C  runs of every cold-cache measurement (default 3*N; they are short)
#   --warm-runs W  runs of every warm-cache measurement (default 5*N)
#   --out FILE     JSON results (default docs/bench-results.json)
#   --plot FILE    bar chart (default: bench.png next to --out); --no-plot to skip
# With the default --out, the tables in docs/benchmarks.md are regenerated too
# (scripts/bench_report.py; prints Markdown tables for any result file).
#
# Must run as root (mounts, drop_caches). Takes a few minutes. Builds/reuses the
# Debian image via scripts/debian-image.sh, builds lamina through cargo (or
# measures LAMINA_BIN=PATH), installs python3-matplotlib if needed for the plot.
# Everything is done in a temporary directory under /tmp, removed on exit
# (mounts included).
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
RUNS=3
WARM_RUNS=
COLD_RUNS=
OUT="$ROOT/docs/bench-results.json"
PLOT=
NO_PLOT=0

log() { printf '[bench] %s\n' "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }
usage() { sed -n '2,20p' "$0" | sed 's/^# \{0,1\}//'; exit "${1:-0}"; }

while [ $# -gt 0 ]; do
    case "$1" in
    --runs) RUNS=${2:?}; shift 2 ;;
    --warm-runs) WARM_RUNS=${2:?}; shift 2 ;;
    --cold-runs) COLD_RUNS=${2:?}; shift 2 ;;
    --out) OUT=${2:?}; shift 2 ;;
    --plot) PLOT=${2:?}; shift 2 ;;
    --no-plot) NO_PLOT=1; shift ;;
    -h | --help) usage 0 ;;
    *) log "unknown argument: $1"; usage 2 ;;
    esac
done
[[ "$RUNS" =~ ^[1-9][0-9]*$ ]] || die "--runs wants a positive integer"
[ -z "$WARM_RUNS" ] || [[ "$WARM_RUNS" =~ ^[1-9][0-9]*$ ]] || die "--warm-runs wants a positive integer"
[ -z "$COLD_RUNS" ] || [[ "$COLD_RUNS" =~ ^[1-9][0-9]*$ ]] || die "--cold-runs wants a positive integer"
mkdir -p "$(dirname "$OUT")"
OUT=$(cd "$(dirname "$OUT")" && pwd)/$(basename "$OUT")
[ -n "$PLOT" ] || PLOT="$(dirname "$OUT")/bench.png"

[ "$(id -u)" = 0 ] || die "must run as root (mounts, drop_caches)"
# Debian's python3 (python3-matplotlib is installed for it), not a pyenv/venv shim
PY=/usr/bin/python3
[ -x "$PY" ] || PY=$(command -v python3) || die "missing python3"
for tool in umoci mksquashfs mkfs.erofs jq findmnt; do
    command -v "$tool" >/dev/null || die "missing tool: $tool (run scripts/setup.sh)"
done

# shellcheck source=scripts/bench_common.sh
. "$ROOT/scripts/bench_common.sh"
bench_prereqs

bench_work_dir lamina-bench

log "work dir $WORK"
# measure a private copy: a rebuild of target/release/lamina during the bench
# must not change the binary under test
cp "$LAMINA" "$WORK/lamina"
export LAMINA_BENCH_BINARY_SOURCE="$LAMINA"
log "umoci unpack (the tree mksquashfs/mkfs.erofs read, and the ext4 reference)"
umoci unpack --image "$IMAGE_DIR:bookworm" "$WORK/bundle" >/dev/null

"$PY" "$ROOT/scripts/bench_run.py" \
    --lamina "$WORK/lamina" --image "$IMAGE_DIR:bookworm" --rootfs "$WORK/bundle/rootfs" \
    --work "$WORK" --runs "$RUNS" \
    ${WARM_RUNS:+--warm-runs "$WARM_RUNS"} ${COLD_RUNS:+--cold-runs "$COLD_RUNS"} --out "$OUT"
log "results: $OUT"

if [ "$NO_PLOT" = 0 ]; then
    "$PY" "$ROOT/scripts/bench_plot.py" "$OUT" "$PLOT"
    log "plot: $PLOT"
fi

# results written to the default place: refresh the tables in docs/benchmarks.md
DOC="$ROOT/docs/benchmarks.md"
if [ "$OUT" = "$ROOT/docs/bench-results.json" ] && [ -f "$DOC" ] && grep -q 'bench-tables:begin' "$DOC"; then
    "$PY" "$ROOT/scripts/bench_report.py" "$OUT" --update "$DOC"
    log "tables updated in $DOC"
fi
