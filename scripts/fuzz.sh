#!/usr/bin/env bash
# Runs lamina's fuzz targets (fuzz/, cargo-fuzz + libFuzzer) one after
# another, each for SECONDS_PER_TARGET, and fails if any of them crashed.
#
# Usage: scripts/fuzz.sh [SECONDS_PER_TARGET] [TARGET...]
#        (default 30 s; every target in fuzz/fuzz_targets/ unless named)
#
# Installs what it needs when missing: the nightly toolchain (rustup, minimal
# profile) and cargo-fuzz (crates.io, pinned version). Each target starts from
# its checked-in seeds (fuzz/seeds/TARGET, read only) plus the inputs earlier
# runs found (fuzz/corpus/TARGET); crashing inputs land in
# fuzz/artifacts/TARGET and libFuzzer's output in fuzz/logs/TARGET.log.
# Prints one line per target (runs, coverage) and a final line.
set -euo pipefail

cd "$(dirname "$0")/.."

CARGO_FUZZ_VERSION=0.13.2
# Overflow checks on (-a: debug assertions in the optimised build); no
# sanitizer: the code under test is safe Rust (`forbid(unsafe_code)`, and
# lamina-sys's parser touches no fd), so ASan would only slow it down.
# 16 codegen units: cargo-fuzz's default of 1 makes the cold build (reqwest
# and rustls come in with lamina-oci) several times slower.
FUZZ_FLAGS=(--sanitizer none --debug-assertions --codegen-units 16)

log() { printf '[fuzz] %s\n' "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }

secs=${1:-30}
[[ $secs =~ ^[1-9][0-9]*$ ]] || die "SECONDS_PER_TARGET must be a positive integer, got '$secs'"
shift $(($# > 0 ? 1 : 0))

# shellcheck disable=SC1091
if [ -f "$HOME/.cargo/env" ]; then . "$HOME/.cargo/env"; fi
command -v rustup >/dev/null || die "rustup not found (scripts/setup.sh installs Rust through it)"
if ! rustup run nightly rustc --version >/dev/null 2>&1; then
    log "installing the nightly toolchain"
    rustup toolchain install nightly --profile minimal
fi
if ! cargo fuzz --version >/dev/null 2>&1; then
    log "installing cargo-fuzz $CARGO_FUZZ_VERSION"
    cargo install cargo-fuzz --locked --version "$CARGO_FUZZ_VERSION"
fi

if [ $# -gt 0 ]; then
    targets=("$@")
else
    mapfile -t targets < <(cargo +nightly fuzz list)
fi
[ ${#targets[@]} -gt 0 ] || die "no fuzz targets found"

start=$(date +%s)
log "building ${#targets[@]} targets ($(cargo fuzz --version), $(rustup run nightly rustc --version))"
mkdir -p fuzz/logs
if ! cargo +nightly fuzz build "${FUZZ_FLAGS[@]}" >fuzz/logs/build.log 2>&1; then
    tail -n 40 fuzz/logs/build.log >&2
    die "build failed (fuzz/logs/build.log)"
fi
log "built in $(($(date +%s) - start))s; running each target for ${secs}s"

crashed=0
for t in "${targets[@]}"; do
    mkdir -p "fuzz/corpus/$t" "fuzz/seeds/$t"
    out="fuzz/logs/$t.log"
    rc=0
    cargo +nightly fuzz run "${FUZZ_FLAGS[@]}" "$t" "fuzz/corpus/$t" "fuzz/seeds/$t" -- \
        -max_total_time="$secs" -timeout=10 -print_final_stats=1 >"$out" 2>&1 || rc=$?
    runs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$out" | tail -n 1)
    last=$(grep -E '^#[0-9]+[[:space:]].*cov: ' "$out" | tail -n 1 || true)
    cov=$(sed -n 's/.* cov: \([0-9]*\).*/\1/p' <<<"$last")
    ft=$(sed -n 's/.* ft: \([0-9]*\).*/\1/p' <<<"$last")
    corp=$(sed -n 's/.* corp: \([0-9]*\).*/\1/p' <<<"$last")
    if [ "$rc" = 0 ]; then
        result=ok
    else
        crashed=$((crashed + 1))
        artifact=$(sed -n 's/.*Test unit written to \(.*\)/\1/p' "$out" | tail -n 1)
        result="CRASH (exit $rc; input ${artifact:-none written}; log $out)"
        grep -m 1 -E "panicked at|ERROR: libFuzzer" "$out" >&2 || tail -n 20 "$out" >&2
    fi
    printf 'fuzz %-16s %4ss  runs %-10s cov %-5s ft %-6s corpus %-5s %s\n' \
        "$t" "$secs" "${runs:-?}" "${cov:-?}" "${ft:-?}" "${corp:-?}" "$result"
done

printf 'fuzz: %d targets, %d crashed, %ss per target, %ss in all\n' \
    "${#targets[@]}" "$crashed" "$secs" "$(($(date +%s) - start))"
[ "$crashed" = 0 ]
