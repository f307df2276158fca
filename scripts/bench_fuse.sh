#!/usr/bin/env bash
# lamina FUSE benchmark (issue 9, item 7): lamina's FUSE path side by side
# with kernel EROFS, lamina's kernel path, squashfuse and ext4, in one run:
#   1. `ls -lR MNT` warm and cold on the reference Debian image;
#   2. stat+open+close of the deepest files of that tree, warm and cold;
#   3. fio 4 KiB buffered reads (sequential, random) of one big file, cold;
#   4. the perfect-hash build (lookup_bench) at 1M and 10M keys;
#   5. mount time and FUSE daemon RSS for an image of --files small files,
#      against the same at 10,000 files.
# See docs/bench-fuse.md for the method.
#
# Usage: scripts/bench_fuse.sh [--quick] [--runs N] [--files N] [--no-big]
#                              [--no-mphf] [--no-fio] [--fio-mib M] [--out FILE]
#                              [--plot FILE | --no-plot]
#   --quick        development run: 1 run, 3 warm / 2 cold, 100,000 files,
#                  a 128 MiB fio file, lookup_bench at 1M keys only
#   --runs N       runs of mounts and lookup_bench (default 3; warm
#                  workloads 5*N, cold ones 3*N; fio max(N, 5))
#   --files N      files in the big image of part 5 (default 1000000)
#   --no-big       skip part 5 (slow: a 1M-file image is generated once, kept
#                  in /var/cache/lamina-test/bench-fuse, and converted each run)
#   --no-mphf      skip part 4;  --no-fio  skip part 3
#   --fio-mib M    size of the fio file (default 512)
#   --out FILE     JSON results (default docs/bench-fuse-results.json)
#   --plot FILE    chart (default: bench-fuse.png next to --out); --no-plot to skip
# With the default --out, the tables in docs/bench-fuse.md are regenerated
# (scripts/bench_fuse_report.py prints them for any result file).
#
# Must run as root (mounts, drop_caches). Builds lamina and the lookup_bench
# example through cargo (CARGO_TARGET_DIR is honoured; LAMINA_BIN=PATH
# measures a given lamina), installs fio and squashfuse with apt if missing.
# Everything runs in a temporary directory under /tmp, removed on exit with
# every mount in it. About 20 minutes with the defaults.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
RUNS=3
QUICK=0
FILES=
FIO_MIB=
NO_BIG=0
NO_MPHF=0
NO_FIO=0
OUT="$ROOT/docs/bench-fuse-results.json"
PLOT=
NO_PLOT=0
GEN_DIR=/var/cache/lamina-test/bench-fuse

log() { printf '[bench-fuse] %s\n' "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }
usage() { sed -n '2,33p' "$0" | sed 's/^# \{0,1\}//'; exit "${1:-0}"; }

while [ $# -gt 0 ]; do
    case "$1" in
    --quick) QUICK=1; shift ;;
    --runs) RUNS=${2:?}; shift 2 ;;
    --files) FILES=${2:?}; shift 2 ;;
    --fio-mib) FIO_MIB=${2:?}; shift 2 ;;
    --no-big) NO_BIG=1; shift ;;
    --no-mphf) NO_MPHF=1; shift ;;
    --no-fio) NO_FIO=1; shift ;;
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
    EXTRA+=(--warm-runs 3 --cold-runs 2 --mphf-keys 1000000 --fio-rand-mib 32 --fio-runs 1)
    : "${FILES:=100000}" "${FIO_MIB:=128}"
fi
: "${FILES:=1000000}" "${FIO_MIB:=512}"
[[ "$RUNS" =~ ^[1-9][0-9]*$ ]] || die "--runs wants a positive integer"
[[ "$FILES" =~ ^[1-9][0-9]*$ ]] || die "--files wants a positive integer"
[[ "$FIO_MIB" =~ ^[1-9][0-9]*$ ]] || die "--fio-mib wants a positive integer"
[ "$NO_BIG" = 1 ] && EXTRA+=(--no-big)
[ "$NO_MPHF" = 1 ] && EXTRA+=(--no-mphf)
[ "$NO_FIO" = 1 ] && EXTRA+=(--no-fio)
mkdir -p "$(dirname "$OUT")"
OUT=$(cd "$(dirname "$OUT")" && pwd)/$(basename "$OUT")
[ -n "$PLOT" ] || PLOT="$(dirname "$OUT")/bench-fuse.png"

[ "$(id -u)" = 0 ] || die "must run as root (mounts, drop_caches)"
PY=/usr/bin/python3
[ -x "$PY" ] || PY=$(command -v python3) || die "missing python3"
for tool in umoci mksquashfs mkfs.erofs findmnt; do
    command -v "$tool" >/dev/null || die "missing tool: $tool (run scripts/setup.sh)"
done
[ -x /usr/bin/time ] || die "missing /usr/bin/time (apt-get install time)"
for pkg in fio squashfuse; do
    if ! command -v "$pkg" >/dev/null; then
        log "installing $pkg"
        export DEBIAN_FRONTEND=noninteractive
        apt-get install -y -qq "$pkg" >/dev/null 2>&1 ||
            { apt-get update -qq >/dev/null && apt-get install -y -qq "$pkg" >/dev/null; } ||
            die "cannot install $pkg"
    fi
done

# shellcheck source=scripts/bench_common.sh
. "$ROOT/scripts/bench_common.sh"
bench_prereqs
LOOKUP_BENCH=
if [ "$NO_MPHF" = 0 ]; then
    log "building the lookup_bench example (release)"
    (cd "$ROOT" && cargo build --release -q -p lamina-format --example lookup_bench)
    LOOKUP_BENCH="${CARGO_TARGET_DIR:-$ROOT/target}/release/examples/lookup_bench"
    [ -x "$LOOKUP_BENCH" ] || die "no $LOOKUP_BENCH after the build"
fi

bench_work_dir lamina-bench-fuse

log "work dir $WORK"
# measure a private copy: a rebuild during the bench must not change it
cp "$LAMINA" "$WORK/lamina"
export LAMINA_BENCH_BINARY_SOURCE="$LAMINA"
log "umoci unpack (the tree of mkfs.erofs, mksquashfs and the ext4 reference)"
umoci unpack --image "$IMAGE_DIR:bookworm" "$WORK/bundle" >/dev/null
mkdir -p "$GEN_DIR"

"$PY" "$ROOT/scripts/bench_fuse_run.py" \
    --lamina "$WORK/lamina" ${LOOKUP_BENCH:+--lookup-bench "$LOOKUP_BENCH"} \
    --image "$IMAGE_DIR:bookworm" --rootfs "$WORK/bundle/rootfs" --work "$WORK" \
    --images-dir "$GEN_DIR" --runs "$RUNS" --files "$FILES" --fio-mib "$FIO_MIB" \
    "${EXTRA[@]}" --out "$OUT"
log "results: $OUT"

if [ "$NO_PLOT" = 0 ]; then
    "$PY" "$ROOT/scripts/bench_fuse_plot.py" "$OUT" "$PLOT"
    log "plot: $PLOT"
fi

DOC="$ROOT/docs/bench-fuse.md"
if [ "$OUT" = "$ROOT/docs/bench-fuse-results.json" ] && [ -f "$DOC" ] && grep -q 'bench-tables:begin' "$DOC"; then
    "$PY" "$ROOT/scripts/bench_fuse_report.py" "$OUT" --update "$DOC"
    log "tables updated in $DOC"
fi
