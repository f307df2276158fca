#!/usr/bin/env bash
# Runs containerd's snapshotter conformance suite
# (github.com/containerd/containerd/v2/core/snapshots/testsuite, from its Go
# module) against `lamina snapshotter`, through containerd's proxy client:
# tests/snapshotter-suite starts one snapshotter per test root.
#
# Usage: scripts/snapshotter-suite.sh [LAMINA_BIN]   (as root: the suite mounts)
#        LAMINA_BIN defaults to $CARGO_TARGET_DIR/debug/lamina, else
#        target/debug/lamina (built when missing).
set -euo pipefail

cd "$(dirname "$0")/.."

log() { printf '[snapshotter-suite] %s\n' "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }

[ "$(id -u)" = 0 ] || die "must run as root (the suite mounts what the snapshotter returns)"
GO=${GO:-/usr/local/go/bin/go}
[ -x "$GO" ] || command -v "$GO" >/dev/null || die "Go not found at $GO (set GO=/path/to/go)"

bin=${1:-${CARGO_TARGET_DIR:-target}/debug/lamina}
if [ ! -x "$bin" ]; then
    # shellcheck disable=SC1091
    if [ -f "$HOME/.cargo/env" ]; then . "$HOME/.cargo/env"; fi
    cargo build -p lamina-cli
fi
bin=$(realpath "$bin")

log "building the suite (containerd's Go module, see tests/snapshotter-suite/go.mod)"
(cd tests/snapshotter-suite && GOFLAGS=-mod=mod "$GO" test -c -o suite.test .)

log "running it against $bin"
out=$(mktemp /tmp/snapshotter-suite.XXXXXX.log)
rc=0
(cd /tmp && LAMINA_BIN="$bin" timeout 600 "$OLDPWD/tests/snapshotter-suite/suite.test" -test.v) >"$out" 2>&1 || rc=$?
grep -E '^\s*--- (PASS|FAIL|SKIP)' "$out" || true
pass=$(grep -cE '^\s+--- PASS' "$out" || true)
fail=$(grep -cE '^\s+--- FAIL' "$out" || true)
skip=$(grep -cE '^\s+--- SKIP' "$out" || true)
printf 'snapshotter suite: %d passed, %d failed, %d skipped (log %s)\n' "$pass" "$fail" "$skip" "$out"
if [ "$rc" != 0 ] || [ "$fail" != 0 ] || [ "$pass" = 0 ]; then
    tail -n 60 "$out" >&2
    die "the conformance suite failed (exit $rc)"
fi
