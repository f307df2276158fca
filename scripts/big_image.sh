#!/usr/bin/env bash
# lamina big image (issue 10: "A 20 GB image (files > 4 GiB, blobs > 4 GiB,
# offsets beyond 32 bits everywhere) converts, mounts lazily, and reads
# correctly; overlay on top works"), end to end, in one run:
#   1. an OCI layout with one uncompressed tar layer (so the source blob is
#      bigger than 4 GiB) holding four large files of distinct pseudo-random
#      data (AES-CTR from openssl) totalling --size, one of them over 8 GiB
#      at the default size, plus a few small files; sha256s while streaming;
#   2. a local registry (tests/tools/registry.sh) in the work dir;
#   3. lamina convert --chunk-size 16M into it (1,024 chunks per data blob:
#      a blob of up to 16 GiB, so cache and compressed offsets past 2^32):
#      wall time, peak RSS, blob sizes; one blob must be over 4 GiB;
#   4. lazy mounts (--mode kernel, then fuse; --prefetch none): pread checks
#      past 4 GiB, every file read whole against its sha256, lamina status,
#      fsck.erofs, an overlay on top (a write, a read, no copy-up);
#   5. the results JSON. See docs/big-image.md for the method.
# Any mismatch fails the run (exit 1, the check named); no results then.
#
# Usage: scripts/big_image.sh [--size BYTES] [--out FILE]
#   --size BYTES   file data in the image (default 21474836480 = 20 GiB;
#                  suffixes K, M, G, T, e.g. 1GiB for a trial)
#   --out FILE     JSON results (default docs/big-image-results.json); with
#                  the default, the tables in docs/big-image.md are regenerated
#                  (scripts/big_image_report.py prints them for any result file)
#
# Must run as root (mounts, overlayfs, drop_caches). Needs about 3.2 x
# --size bytes free in /tmp, where the work dir lives: the source
# tar, convert's staged blobs and the registry's copy exist at once; then
# the registry and one mode's cache. Builds lamina through cargo, or
# LAMINA_BIN=PATH measures a given lamina; either way a private copy runs.
# Everything runs in a temporary directory, removed on exit with every
# mount in it (the registry is stopped first).
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
SIZE=21474836480
OUT="$ROOT/docs/big-image-results.json"
NO_PLOT=1 # read by bench_common.sh: no chart here
export PYTHONDONTWRITEBYTECODE=1 # nothing written into the checkout

log() { printf '[big-image] %s\n' "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }
usage() { sed -n '2,32p' "$0" | sed 's/^# \{0,1\}//'; exit "${1:-0}"; }

while [ $# -gt 0 ]; do
    case "$1" in
    --size) SIZE=${2:?}; shift 2 ;;
    --out) OUT=${2:?}; shift 2 ;;
    -h | --help) usage 0 ;;
    *) log "unknown argument: $1"; usage 2 ;;
    esac
done
# BYTES or N[K|M|G|T][iB]
if [[ "$SIZE" =~ ^([0-9]+)([KkMmGgTt]?)(i?B)?$ ]]; then
    n=${BASH_REMATCH[1]}
    case "${BASH_REMATCH[2]^^}" in
    K) n=$((n << 10)) ;; M) n=$((n << 20)) ;; G) n=$((n << 30)) ;; T) n=$((n << 40)) ;;
    esac
    SIZE=$n
else
    die "--size wants BYTES or N with K/M/G/T (e.g. 20GiB), not $SIZE"
fi
[ "$SIZE" -ge $((64 << 20)) ] || die "--size must be at least 64 MiB"
mkdir -p "$(dirname "$OUT")"
OUT=$(cd "$(dirname "$OUT")" && pwd)/$(basename "$OUT")

[ "$(id -u)" = 0 ] || die "must run as root (mounts, overlayfs, drop_caches)"
PY=/usr/bin/python3
[ -x "$PY" ] || PY=$(command -v python3) || die "missing python3"
for tool in openssl fsck.erofs docker-registry findmnt mount umount curl; do
    command -v "$tool" >/dev/null || die "missing tool: $tool (run scripts/setup.sh)"
done
[ -x /usr/bin/time ] || die "missing /usr/bin/time (apt-get install time)"

# Disk first: nothing is built or written when it cannot fit.
TMP_BASE=/tmp # bench_work_dir's mktemp -d /tmp/...
NEED=$((SIZE * 32 / 10))
AVAIL=$(df --output=avail -B1 "$TMP_BASE" | tail -n 1 | tr -d ' ')
if [ "$AVAIL" -lt "$NEED" ]; then
    die "$TMP_BASE has $AVAIL bytes free; --size $SIZE needs about $NEED (3.2 x: the source tar, convert's staged blobs and the registry's copy exist at once)"
fi

# shellcheck source=scripts/bench_common.sh
. "$ROOT/scripts/bench_common.sh"

# The binary only: this script does not use bench_prereqs' Debian image.
bench_binary

bench_work_dir lamina-big-image
# the registry lives in $WORK: stop it before bench_cleanup removes $WORK
big_cleanup() {
    local rc=$?
    set +e
    bash "$ROOT/tests/tools/registry.sh" stop "$WORK/registry" >/dev/null 2>&1
    (exit "$rc") # bench_cleanup reads the exit status from $?
    bench_cleanup
}
trap big_cleanup EXIT

log "work dir $WORK ($AVAIL bytes free, $NEED needed)"
# a private copy: a rebuild during the run must not change it
cp "$LAMINA" "$WORK/lamina"
export LAMINA_BENCH_BINARY_SOURCE="$LAMINA"

"$PY" "$ROOT/scripts/big_image_run.py" --lamina "$WORK/lamina" --work "$WORK" --size "$SIZE" --out "$OUT"
log "results: $OUT"

DOC="$ROOT/docs/big-image.md"
if [ "$OUT" = "$ROOT/docs/big-image-results.json" ] && [ -f "$DOC" ] && grep -q 'big-image-tables:begin' "$DOC"; then
    "$PY" "$ROOT/scripts/big_image_report.py" "$OUT" --update "$DOC"
    log "tables updated in $DOC"
fi
