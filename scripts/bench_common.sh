# shellcheck shell=bash
# Shared by scripts/bench_scale.sh, coldstart.sh and
# big_image.sh (sourced, not run). Expects ROOT, PY, NO_PLOT and the log/die functions;
# sets LAMINA and IMAGE_DIR: the release binary (built by cargo into
# $CARGO_TARGET_DIR, else target/; or LAMINA_BIN=PATH to
# measure a given build), matplotlib for the plot (installed if missing and
# wanted) and the reference Debian image (built once per machine).
bench_prereqs() {
    bench_binary

    if [ "$NO_PLOT" = 0 ] && ! "$PY" -c 'import matplotlib' 2>/dev/null; then
        log "installing python3-matplotlib (for the plot)"
        export DEBIAN_FRONTEND=noninteractive
        apt-get install -y -qq python3-matplotlib >/dev/null 2>&1 ||
            { apt-get update -qq >/dev/null && apt-get install -y -qq python3-matplotlib >/dev/null; } ||
            die "cannot install python3-matplotlib (use --no-plot)"
    fi

    IMAGE_DIR=/var/cache/lamina-test/debian-oci
    bash "$ROOT/scripts/debian-image.sh" "$IMAGE_DIR"
}

# Sets LAMINA: LAMINA_BIN=PATH, else the release binary, built through
# cargo into $CARGO_TARGET_DIR (else target/).
bench_binary() {
    if [ -n "${LAMINA_BIN:-}" ]; then
        # A given binary (to compare two builds side by side).
        LAMINA=$(realpath "$LAMINA_BIN")
        [ -x "$LAMINA" ] || die "LAMINA_BIN=$LAMINA_BIN is not an executable"
        log "measuring $LAMINA (LAMINA_BIN)"
    else
        LAMINA="${CARGO_TARGET_DIR:-$ROOT/target}/release/lamina"
        # Always through cargo: a binary older than the sources would
        # measure code that is gone (a no-op when it is up to date).
        log "building lamina (release)"
        # shellcheck disable=SC1091
        [ -f "$HOME/.cargo/env" ] && . "$HOME/.cargo/env"
        (cd "$ROOT" && cargo build --release -p lamina-cli)
    fi
}

# A private work dir, WORK=/tmp/PREFIX.XXXXXX, removed on exit with
# everything mounted below it: lamina's mounts through lamina (which stops
# their daemons), then anything else (EROFS, tmpfs, squashfuse), deepest
# first; left in place, with a warning, if something stays mounted.
bench_work_dir() { # prefix
    WORK=$(mktemp -d "/tmp/$1.XXXXXX")
    trap bench_cleanup EXIT
    trap 'exit 130' INT TERM
}

bench_cleanup() {
    local rc=$? m
    trap '' INT TERM # a second Ctrl-C must not cut the cleanup short
    while read -r m; do
        "$WORK/lamina" umount "$m" >/dev/null 2>&1 || true
    done < <(awk -v p="$WORK/" 'index($2, p) == 1 { print $2 }' /proc/self/mounts | sort -r)
    while read -r m; do
        umount "$m" 2>/dev/null || umount -l "$m" 2>/dev/null || log "warning: cannot unmount $m"
    done < <(awk -v p="$WORK/" 'index($2, p) == 1 { print $2 }' /proc/self/mounts | sort -r)
    # wait for any daemon still using $WORK to exit
    for _ in $(seq 100); do
        pgrep -f "$WORK/" >/dev/null || break
        sleep 0.1
    done
    if ! awk -v p="$WORK/" 'index($2, p) == 1 { found = 1 } END { exit !found }' /proc/self/mounts; then
        rm -rf --one-file-system "$WORK"
    else
        log "warning: something is still mounted under $WORK; left in place"
    fi
    [ $rc -eq 0 ] || log "FAILED (rc=$rc)"
}
