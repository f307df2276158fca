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
# Tests run one at a time within a test binary (--test-threads=1): they mount
# file systems and convert a ~175 MB image. Two lanes take test binaries from
# one queue, the longest first (the lazy-loading binary alone is half of the
# suite's time), and run them side by side; each binary has fixtures of its
# own, and registries check the port they serve is theirs. Every binary runs
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
# One "package dir<TAB>source<TAB>executable" line per test binary, from
# the build's own messages (its diagnostics still printed as text).
binaries=$(mktemp /tmp/lamina-tests.XXXXXX)
cargo test --workspace --no-run --message-format=json-render-diagnostics |
    jq -r 'select(.reason == "compiler-artifact" and .profile.test and .executable != null)
        | [(.manifest_path | rtrimstr("/Cargo.toml")), .target.src_path, .executable] | @tsv' >"$binaries"
[ "$(grep -c . "$binaries")" -gt 20 ] || { cat "$binaries"; echo "too few test binaries listed"; exit 1; }

# Tests of several binaries use the reference Debian image: built (or found
# cached) once here, not by two lanes at once.
step "scripts/debian-image.sh (the tests' reference image)"
bash scripts/debian-image.sh

# The queue both lanes take test binaries from, the longest first (SLOW, in
# the order of their serial times: about 18, 5, 4, 3, 1.6, 1.4, 1.4, 1.3 and
# 0.8 min), then the rest, then the conformance suite; a lane takes the
# next when its last is done. Lines: package dir, what, command.
# QUIET tests (binary:filter) run alone after the lanes: what they check
# hangs on rates the worker measures (a miss rate that turns predictions on,
# a link fast enough for rests), which two lanes of debug builds on two
# cores can push under the bounds; in the lanes they are skipped.
SLOW="tests/lazy/main.rs tests/index.rs tests/containerd/main.rs tests/tenants/main.rs tests/scale.rs
tests/hosts.rs tests/fuse/main.rs tests/many.rs tests/run.rs"
QUIET="tests/lazy/main.rs:warm:: tests/containerd/main.rs:fetches_the_rest"
tab=$(printf '\t')
queue=$(mktemp /tmp/lamina-queue.XXXXXX)
quiet=$(mktemp /tmp/lamina-quiet.XXXXXX)
slow_first=$(mktemp /tmp/lamina-slow.XXXXXX)
for slow in $SLOW; do grep -F "/lamina-cli/$slow$tab" "$binaries" || true; done >"$slow_first"
# A binary's line: its command with --skip (lanes) or a filter (quiet) for
# each QUIET entry of it.
queue_line() {
    local dir=$1 src=$2 exe=$3 skips="" entry
    for entry in $QUIET; do
        if [ "$src" != "${src%/lamina-cli/"${entry%%:*}"}" ]; then
            skips="$skips --skip ${entry#*:}"
            printf '%s\t%s\t%s --test-threads=1 %s\n' "$dir" "$src (${entry#*:} alone)" "$exe" "${entry#*:}" >>"$quiet"
        fi
    done
    printf '%s\t%s\t%s --test-threads=1%s\n' "$dir" "$src" "$exe" "$skips"
}
{
    cat "$slow_first"
    grep -vFf "$slow_first" "$binaries" || true
} | while IFS=$tab read -r dir src exe; do queue_line "$dir" "$src" "$exe"; done >"$queue"
printf '%s\t%s\t%s\n' "$PWD" "scripts/snapshotter-suite.sh" "bash scripts/snapshotter-suite.sh" >>"$queue"
lines=$(($(grep -c . "$binaries") + 1))
[ "$(cut -f2 "$queue" | sort -u | grep -c .)" = "$lines" ] && [ "$(grep -c . "$queue")" = "$lines" ] ||
    { cat "$queue"; echo "the test queue is not every binary once"; exit 1; }
[ "$(grep -c . "$quiet")" = "$(echo "$QUIET" | wc -w)" ] || { cat "$quiet"; echo "a QUIET binary is missing"; exit 1; }

# Prints the next line of the queue and takes it off; nothing when empty.
take() {
    (
        flock 9
        head -n 1 "$queue"
        sed -i 1d "$queue"
    ) 9>"$queue.lock"
}

# Runs one line of the queue (in its package's directory, as cargo runs
# test binaries); says FAILED and fails if it failed.
run_line() {
    local dir what cmd
    IFS=$tab read -r dir what cmd <<<"$1"
    printf '\n     Running %s\n' "${what#"$PWD"/}"
    # shellcheck disable=SC2086 # the command and its arguments, split
    (cd "$dir" && $cmd </dev/null) || { echo "FAILED: ${what#"$PWD"/}"; return 1; }
}

# Runs lines of the queue until it is empty; fails if any failed, after all ran.
run_lane() {
    local rc=0 line
    while line=$(take) && [ -n "$line" ]; do
        run_line "$line" || rc=1
    done
    return "$rc"
}

# The fuzz step (nightly, its own target dir, one core) runs beside the
# tests instead of after them: its ~5 min are hidden in theirs. Its log is
# printed, and its exit code checked, once the tests are done.
step "scripts/fuzz.sh 20 (every fuzz target for 20 s; nightly, cargo-fuzz), in the background"
fuzz_log=$(mktemp /tmp/lamina-fuzz.XXXXXX.log)
bash scripts/fuzz.sh 20 >"$fuzz_log" 2>&1 &
fuzz_pid=$!

step "lane 1, in the background: tests from the queue"
lane1_log=$(mktemp /tmp/lamina-lane1.XXXXXX.log)
run_lane >"$lane1_log" 2>&1 &
lane1_pid=$!

step "lane 2: tests from the queue"
tests_rc=0
run_lane || tests_rc=$?

step "lane 1: its log (once its last is done)"
wait "$lane1_pid" || tests_rc=$?
cat "$lane1_log"

step "cargo test --workspace --doc"
cargo test --workspace --doc || tests_rc=$?

step "scripts/fuzz.sh 20: its log"
fuzz_rc=0
wait "$fuzz_pid" || fuzz_rc=$?
cat "$fuzz_log"

step "the QUIET tests, alone"
while IFS= read -r line; do
    IFS=$tab read -r dir what cmd <<<"$line"
    # A filter that names no test (one renamed) would pass silently.
    # shellcheck disable=SC2086 # the command and its arguments, split
    listed=$(cd "$dir" && $cmd --list </dev/null | grep -c ': test$' || true)
    [ "$listed" -gt 0 ] || { echo "FAILED: ${what#"$PWD"/}: its filter names no test"; tests_rc=1; continue; }
    run_line "$line" || tests_rc=1
done <"$quiet"
[ "$tests_rc" = 0 ] || { echo "tests failed (see FAILED above)"; exit 1; }
[ "$fuzz_rc" = 0 ] || { echo "scripts/fuzz.sh failed (exit $fuzz_rc)"; exit "$fuzz_rc"; }

# Last, so that dfdaemon's first build (setup.sh starts it in the
# background) has had the whole run: the test waits for it, and fails if it
# failed. The workspace run above lists it as ignored, never as passed.
step "cargo test --test fleet -- --ignored (P2P through Dragonfly)"
cargo test -p lamina-cli --test fleet -- --ignored --test-threads=1

printf '\n=== all checks passed in %ss\n' "$(($(date +%s) - start))"
