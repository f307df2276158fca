# shellcheck shell=bash
# Shared by scripts/bench.sh, scripts/bench_fuse.sh and scripts/coldstart.sh
# (sourced, not run). Expects ROOT, PY, NO_PLOT and the log/die functions;
# sets LAMINA and IMAGE_DIR: the release binary (built by cargo into
# $CARGO_TARGET_DIR, else target/; or LAMINA_BIN=PATH to
# measure a given build), matplotlib for the plot (installed if missing and
# wanted) and the reference Debian image (built once per machine).
bench_prereqs() {
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
