#!/usr/bin/env bash
# lamina's full check: formatting, lints, and every test (unit tests and the
# end-to-end tests in crates/lamina-cli/tests, which mount images with the
# kernel and need root, umoci, skopeo, docker-registry, erofs-utils, ...).
#
# Usage: scripts/test.sh        (as root on Debian bookworm)
#
# The end-to-end tests fail when root or a tool is missing; set
# LAMINA_SKIP_PRIVILEGED=1 to have them print "skipped: ..." instead.
# containerd's snapshotter conformance suite runs after the cargo tests
# (scripts/snapshotter-suite.sh; Go from /usr/local/go/bin).
# The fuzz step runs beside the tests (scripts/fuzz.sh installs nightly and
# cargo-fuzz when missing) and fails the run on any crash.
# Tests run one at a time (--test-threads=1): they mount file systems and the
# Debian one converts a ~175 MB image. --no-fail-fast: every test binary runs
# even when an earlier one failed, so one run shows all failures.
set -euo pipefail

cd "$(dirname "$0")/.."

start=$(date +%s)
step() { printf '\n=== %s\n' "$*"; }
# A full disk shows up as odd failures (the linker dies with SIGBUS), so
# every run says how much room it had, at the start and on the way out.
disk() { df -h / /tmp "$(pwd)" 2>/dev/null | awk 'NR == 1 || !seen[$0]++'; }
trap 'step "disk at exit"; disk' EXIT
step "disk at start"
disk

# CI builds from a clean checkout: incremental state would only take disk.
export CARGO_INCREMENTAL=0

step "setup (apt packages, Rust)"
bash scripts/setup.sh

# shellcheck disable=SC1091
if [ -f "$HOME/.cargo/env" ]; then . "$HOME/.cargo/env"; fi

step "cargo fmt --all --check"
cargo fmt --all --check

step "cargo clippy --workspace --all-targets -- -D warnings"
cargo clippy --workspace --all-targets -- -D warnings

step "bench/: the harness imports and renders its committed results"
for pair in fleet:docs/fleet-results.json fuse:docs/bench-fuse-results.json image:docs/bench-results.json \
    scale:docs/bench-scale-results.json big_image:docs/big-image-results.json \
    coldstart:docs/coldstart-results.json coldstart:docs/coldstart-heavy-results.json \
    coldstart:docs/coldstart-index-results.json coldstart:docs/coldstart-index-predictions-results.json \
    density:docs/density-results.json density:docs/density-onecopy-results.json \
    density:docs/density-fuse-min1-results.json density:docs/density-xfs-results.json \
    density_designs:docs/density-designs-results.json \
    density_containers:docs/density-containers-results.json; do
    /usr/bin/python3 -m bench "${pair%%:*}" --report "${pair#*:}" >/dev/null
done

step "cargo test --workspace --no-run (build the tests first)"
cargo test --workspace --no-run

# The fuzz step (nightly, its own target dir, one core) runs beside the
# tests instead of after them: its ~5 min are hidden in theirs. Its log is
# printed, and its exit code checked, once the tests are done.
step "scripts/fuzz.sh 20 (every fuzz target for 20 s; nightly, cargo-fuzz), in the background"
fuzz_log=$(mktemp /tmp/lamina-fuzz.XXXXXX.log)
bash scripts/fuzz.sh 20 >"$fuzz_log" 2>&1 &
fuzz_pid=$!

step "cargo test --workspace --no-fail-fast -- --test-threads=1"
tests_rc=0
cargo test --workspace --no-fail-fast -- --test-threads=1 || tests_rc=$?

step "scripts/fuzz.sh 20: its log"
fuzz_rc=0
wait "$fuzz_pid" || fuzz_rc=$?
cat "$fuzz_log"
[ "$tests_rc" = 0 ] || { echo "cargo test failed (exit $tests_rc)"; exit "$tests_rc"; }
[ "$fuzz_rc" = 0 ] || { echo "scripts/fuzz.sh failed (exit $fuzz_rc)"; exit "$fuzz_rc"; }

step "scripts/snapshotter-suite.sh (containerd's snapshotter conformance suite)"
bash scripts/snapshotter-suite.sh

# Last, so that dfdaemon's first build (setup.sh starts it in the
# background) has had the whole run: the test waits for it, and fails if it
# failed. The workspace run above lists it as ignored, never as passed.
step "cargo test --test fleet -- --ignored (P2P through Dragonfly)"
cargo test -p lamina-cli --test fleet -- --ignored --test-threads=1

printf '\n=== all checks passed in %ss\n' "$(($(date +%s) - start))"
