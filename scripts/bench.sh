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

WORK=$(mktemp -d /tmp/lamina-bench.XXXXXX)
cleanup() {
    local rc=$? m
    trap '' INT TERM # a second Ctrl-C must not cut the cleanup short
    # lamina mounts through lamina (stops a lazy mount's daemon), then wait for
    # any process still using $WORK (such a daemon) to exit
    for m in "$WORK/mnt/lamina" "$WORK/mnt/lamina-lazy"; do
        if mountpoint -q "$m" 2>/dev/null; then
            "$WORK/lamina" umount "$m" >/dev/null 2>&1 || log "warning: lamina umount $m failed"
        fi
    done
    for _ in $(seq 100); do
        pgrep -f "$WORK/" >/dev/null || break
        sleep 0.1
    done
    # unmount everything below $WORK (deepest first), then remove it
    while read -r m; do
        umount "$m" 2>/dev/null || umount -l "$m" 2>/dev/null || log "warning: cannot unmount $m"
    done < <(awk -v p="$WORK/" 'index($2, p) == 1 { print $2 }' /proc/self/mounts | sort -r)
    if ! awk -v p="$WORK/" 'index($2, p) == 1 { found = 1 } END { exit !found }' /proc/self/mounts; then
        rm -rf --one-file-system "$WORK"
    else
        log "warning: something is still mounted under $WORK; left in place"
    fi
    [ $rc -eq 0 ] || log "FAILED (rc=$rc)"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

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
