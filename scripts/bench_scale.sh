#!/usr/bin/env bash
# lamina scale benchmark (issue 10, item 6): images of 10,000, 100,000 and
# 1,000,000 small files, lamina against mkfs.erofs, in one run:
#   1. convert time and peak RSS (lamina convert vs mkfs.erofs of the tree);
#   2. bytes fetched before the first read (lamina's metadata layers) against
#      the metadata of mkfs.erofs (a chunked image with its data in a blob);
#   3. lazy mount time, bytes and requests for reading one small file, and
#      the daemons' RSS (kernel path and FUSE);
#   4. `ls -lR` warm and cold against mkfs.erofs's image mounted file-backed;
#   5. python3 start on the Debian image converted with --pack-limit 0 and
#      with the default (16K): bytes and requests fetched.
# See docs/bench-scale.md for the method.
#
# Usage: scripts/bench_scale.sh [--quick] [--runs N] [--sizes N,N,...]
#                               [--py-runs P] [--no-python] [--out FILE]
#                               [--plot FILE | --no-plot]
#   --quick        development run: 10,000 and 100,000 files, 1 run
#                  (3 warm / 2 cold ls -lR), 3 python3 starts per variant
#   --runs N       runs of convert and mounts (default 3; ls -lR warm 3*N, cold 2*N)
#   --sizes LIST   image sizes (default 10000,100000,1000000)
#   --py-runs P    python3 starts per variant (default 5)
#   --no-python    skip part 5
#   --out FILE     JSON results (default docs/bench-scale-results.json)
#   --plot FILE    chart (default: bench-scale.png next to --out); --no-plot to skip
# With the default --out, the tables in docs/bench-scale.md are regenerated
# (scripts/bench_scale_report.py prints them for any result file).
#
# Must run as root (mounts, tmpfs, chroot, drop_caches). Builds lamina
# through cargo (CARGO_TARGET_DIR is honoured; LAMINA_BIN=PATH measures a
# given lamina). Generated images are kept in /var/cache/lamina-test/bench-fuse
# (shared with python3 -m bench fuse). Everything else runs in a temporary directory
# under /tmp, removed on exit with every mount in it; the unpacked trees live
# in a tmpfs (1M files: about 3 GB of RAM).
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
RUNS=3
QUICK=0
SIZES=
PY_RUNS=
NO_PYTHON=0
OUT="$ROOT/docs/bench-scale-results.json"
PLOT=
NO_PLOT=0
GEN_DIR=/var/cache/lamina-test/bench-fuse

log() { printf '[bench-scale] %s\n' "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }
usage() { sed -n '2,32p' "$0" | sed 's/^# \{0,1\}//'; exit "${1:-0}"; }

while [ $# -gt 0 ]; do
    case "$1" in
    --quick) QUICK=1; shift ;;
    --runs) RUNS=${2:?}; shift 2 ;;
    --sizes) SIZES=${2:?}; shift 2 ;;
    --py-runs) PY_RUNS=${2:?}; shift 2 ;;
    --no-python) NO_PYTHON=1; shift ;;
    --out) OUT=${2:?}; shift 2 ;;
    --plot) PLOT=${2:?}; shift 2 ;;
    --no-plot) NO_PLOT=1; shift ;;
    -h | --help) usage 0 ;;
    *) log "unknown argument: $1"; usage 2 ;;
    esac
done
EXTRA=()
if [ "$QUICK" = 1 ]; then
    RUNS=1
    EXTRA+=(--quick)
    : "${SIZES:=10000,100000}" "${PY_RUNS:=3}"
fi
: "${SIZES:=10000,100000,1000000}" "${PY_RUNS:=5}"
[[ "$RUNS" =~ ^[1-9][0-9]*$ ]] || die "--runs wants a positive integer"
[[ "$PY_RUNS" =~ ^[1-9][0-9]*$ ]] || die "--py-runs wants a positive integer"
[[ "$SIZES" =~ ^[1-9][0-9]*(,[1-9][0-9]*)*$ ]] || die "--sizes wants a comma-separated list of integers"
[ "$NO_PYTHON" = 1 ] && EXTRA+=(--no-python)
mkdir -p "$(dirname "$OUT")"
OUT=$(cd "$(dirname "$OUT")" && pwd)/$(basename "$OUT")
[ -n "$PLOT" ] || PLOT="$(dirname "$OUT")/bench-scale.png"

[ "$(id -u)" = 0 ] || die "must run as root (mounts, drop_caches)"
PY=/usr/bin/python3
[ -x "$PY" ] || PY=$(command -v python3) || die "missing python3"
for tool in mkfs.erofs findmnt tar chroot skopeo docker-registry; do
    command -v "$tool" >/dev/null || die "missing tool: $tool (run scripts/setup.sh)"
done
[ -x /usr/bin/time ] || die "missing /usr/bin/time (apt-get install time)"

# shellcheck source=scripts/bench_common.sh
. "$ROOT/scripts/bench_common.sh"
bench_prereqs

bench_work_dir lamina-bench-scale

log "work dir $WORK"
# measure a private copy: a rebuild during the bench must not change it
cp "$LAMINA" "$WORK/lamina"
export LAMINA_BENCH_BINARY_SOURCE="$LAMINA"
mkdir -p "$GEN_DIR"

"$PY" "$ROOT/scripts/bench_scale_run.py" \
    --lamina "$WORK/lamina" --work "$WORK" --images-dir "$GEN_DIR" --sizes "$SIZES" \
    --debian "$IMAGE_DIR:bookworm" --runs "$RUNS" --py-runs "$PY_RUNS" "${EXTRA[@]}" --out "$OUT"
log "results: $OUT"

if [ "$NO_PLOT" = 0 ]; then
    "$PY" "$ROOT/scripts/bench_scale_plot.py" "$OUT" "$PLOT"
    log "plot: $PLOT"
fi

DOC="$ROOT/docs/bench-scale.md"
if [ "$OUT" = "$ROOT/docs/bench-scale-results.json" ] && [ -f "$DOC" ] && grep -q 'bench-tables:begin' "$DOC"; then
    "$PY" "$ROOT/scripts/bench_scale_report.py" "$OUT" --update "$DOC"
    log "tables updated in $DOC"
fi
