#!/usr/bin/env bash
# Idempotent test-machine setup for lamina (fresh Debian bookworm, run as root).
#
# Usage: scripts/setup.sh
#
# - installs the Debian packages the tests need (apt-get update runs once, and
#   only when something is missing);
# - gives user nobody subordinate ids (the rootless podman test);
# - installs Rust through rustup only when `cargo` is not found (sources
#   ~/.cargo/env first, so a preinstalled rustup toolchain is reused).
# Quiet on success; on failure prints the tail of the failing command's output.
set -euo pipefail

# xfsprogs: a cache on XFS (reflinks) in the tests of chunks copied by the locator.
PACKAGES=(
    docker-registry umoci skopeo erofs-utils squashfs-tools debootstrap hyperfine
    fuse3 attr zstd jq python3 e2fsprogs util-linux iproute2 containerd runc
    stargz-snapshotter podman uidmap catatonit
    ca-certificates curl build-essential pkg-config
    clang libclang-dev protobuf-compiler libprotobuf-dev
    python3-matplotlib fio squashfuse time xfsprogs
)

log() { printf '[setup] %s\n' "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }

[ "$(id -u)" = 0 ] || die "must run as root"
command -v apt-get >/dev/null || die "apt-get not found (expects Debian bookworm)"

LOG=$(mktemp /tmp/lamina-setup.XXXXXX.log)
trap 'rm -f "$LOG"' EXIT

# run CMD... quietly; show its output and fail if it fails
run() {
    if ! "$@" >"$LOG" 2>&1; then
        log "command failed: $*"
        tail -n 40 "$LOG" >&2
        exit 1
    fi
}

export DEBIAN_FRONTEND=noninteractive

# --- Debian packages -------------------------------------------------------------
missing=()
for p in "${PACKAGES[@]}"; do
    status=$(dpkg-query -W -f='${db:Status-Status}' "$p" 2>/dev/null || true)
    [ "$status" = installed ] || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
    log "installing: ${missing[*]}"
    run apt-get update -qq
    run apt-get install -y -qq --no-install-recommends "${missing[@]}"
else
    log "all ${#PACKAGES[@]} Debian packages already installed"
fi

# The rootless podman test runs as user nobody, which needs subordinate
# uids and gids for podman's user namespace.
for f in /etc/subuid /etc/subgid; do
    if ! grep -q '^nobody:' "$f" 2>/dev/null; then
        echo 'nobody:200000:65536' >>"$f"
        log "gave nobody subordinate ids 200000-265535 in $f"
    fi
done

# Debian's docker-registry package enables a system-wide registry on :5000.
# Tests start their own instance (tests/tools/registry.sh); stop the global one
# when systemd is running so it does not hold resources.
if [ -d /run/systemd/system ] && command -v systemctl >/dev/null; then
    if systemctl is-enabled --quiet docker-registry 2>/dev/null; then
        run systemctl disable --now docker-registry
        log "disabled the system docker-registry service"
    fi
fi

# --- Rust --------------------------------------------------------------------------
# shellcheck disable=SC1091
[ -f "$HOME/.cargo/env" ] && . "$HOME/.cargo/env"
if ! command -v cargo >/dev/null 2>&1; then
    if command -v rustup >/dev/null 2>&1; then
        log "rustup present without a usable cargo: installing the stable toolchain"
        run rustup toolchain install stable --profile minimal
        run rustup default stable
    else
        log "installing Rust via rustup"
        installer=$(mktemp /tmp/rustup-init.XXXXXX.sh)
        run curl --proto '=https' --tlsv1.2 -fsSL -o "$installer" https://sh.rustup.rs
        run sh "$installer" -y --profile minimal --default-toolchain stable --no-modify-path
        rm -f "$installer"
    fi
    # shellcheck disable=SC1091
    . "$HOME/.cargo/env"
    command -v cargo >/dev/null || die "cargo still not found after installing Rust"
fi
log "cargo: $(cargo --version)"

# --- containerd 2.x (Go module) ---------------------------------------------------
# Debian ships containerd 1.6; 2.x (containerd, ctr, its runc shim) is built
# from containerd's Go module into a versioned directory, once per machine.
CONTAINERD2_VERSION=v2.4.2
CONTAINERD2_DIR=/var/cache/lamina-test/go/containerd-$CONTAINERD2_VERSION
GO=${GO:-/usr/local/go/bin/go}
if [ ! -x "$CONTAINERD2_DIR/containerd-shim-runc-v2" ]; then
    [ -x "$GO" ] || command -v "$GO" >/dev/null || die "Go not found at $GO (set GO=/path/to/go)"
    log "building containerd $CONTAINERD2_VERSION from its Go module into $CONTAINERD2_DIR"
    mkdir -p "$CONTAINERD2_DIR"
    run env GOBIN="$CONTAINERD2_DIR" GOFLAGS=-mod=mod "$GO" install \
        "github.com/containerd/containerd/v2/cmd/containerd@$CONTAINERD2_VERSION" \
        "github.com/containerd/containerd/v2/cmd/ctr@$CONTAINERD2_VERSION" \
        "github.com/containerd/containerd/v2/cmd/containerd-shim-runc-v2@$CONTAINERD2_VERSION"
fi
log "containerd 2.x: $("$CONTAINERD2_DIR/containerd" --version)"

# --- cosign (Go module) -----------------------------------------------------------
# sigstore's cosign signs tar indexes in the tests of signed indexes (lamina
# verifies its signatures on its own, offline). Built once per machine, in
# the background (about 4 min on 2 cores): the test that needs it waits for
# the build, and fails if it failed.
COSIGN_VERSION=v2.6.5
COSIGN_DIR=/var/cache/lamina-test/go/cosign-$COSIGN_VERSION
if [ -x "$COSIGN_DIR/cosign" ]; then
    log "cosign: $COSIGN_DIR/cosign"
elif [ -f "$COSIGN_DIR.building" ] && kill -0 "$(cat "$COSIGN_DIR.building")" 2>/dev/null; then
    log "cosign $COSIGN_VERSION is being built (log $COSIGN_DIR.log)"
else
    log "building cosign $COSIGN_VERSION from its Go module in the background (log $COSIGN_DIR.log)"
    mkdir -p "$COSIGN_DIR"
    setsid nice -n 10 bash -c '
        env GOBIN="$2" GOFLAGS=-mod=mod "$3" install "github.com/sigstore/cosign/v2/cmd/cosign@$1" \
            && rm -f "$2.log"
        rm -f "$2.building"' _ "$COSIGN_VERSION" "$COSIGN_DIR" "$GO" \
        >"$COSIGN_DIR.log" 2>&1 </dev/null &
    echo $! >"$COSIGN_DIR.building"
fi

# --- Docker Engine (Go modules) ------------------------------------------------------
# dockerd and the docker client, for `docker pull` through lamina snapshotter
# with the containerd image store (Debian's docker.io predates that store).
# moby and docker/cli v28 have no go.mod: their vendor.mod pins the
# dependencies, so each module's source is built with vendor.mod as go.mod.
DOCKERD_VERSION=v28.5.2
DOCKERD_DIR=/var/cache/lamina-test/go/dockerd-$DOCKERD_VERSION
build_vendored() { # MODULE PACKAGE OUTPUT
    local src work
    src=$(cd / && GOFLAGS=-mod=mod "$GO" mod download -json "$1@$DOCKERD_VERSION+incompatible" | jq -r .Dir)
    [ -d "$src" ] || die "go mod download of $1@$DOCKERD_VERSION gave no source"
    work=$(mktemp -d /tmp/lamina-moby.XXXXXX)
    cp -r "$src/." "$work/"
    chmod -R u+w "$work"
    cp "$work/vendor.mod" "$work/go.mod"
    cp "$work/vendor.sum" "$work/go.sum"
    (cd "$work" && run env GOFLAGS=-mod=mod "$GO" build -o "$3.partial" "$2")
    mv "$3.partial" "$3"
    rm -rf "$work"
}
if [ ! -x "$DOCKERD_DIR/dockerd" ] || [ ! -x "$DOCKERD_DIR/docker" ]; then
    log "building dockerd and docker $DOCKERD_VERSION from their Go modules into $DOCKERD_DIR"
    mkdir -p "$DOCKERD_DIR"
    build_vendored github.com/docker/docker ./cmd/dockerd "$DOCKERD_DIR/dockerd"
    build_vendored github.com/docker/cli ./cmd/docker "$DOCKERD_DIR/docker"
fi
log "dockerd: $("$DOCKERD_DIR/dockerd" --version)"

# --- Dragonfly (Go modules, crates.io) ---------------------------------------------------
# The P2P tests and benchmark run a real Dragonfly cluster (bench/harness/fleet.py).
# The scheduler (and the manager, for those who run one) are built from
# Dragonfly's Go module (its go.mod lists no versions through `go install`,
# so the module's source is built in place); dfdaemon from the
# dragonfly-client crate. dfdaemon is a large build (RocksDB, ~25 min on 2
# cores): it runs once per machine in the background, niced, and the P2P
# tests say they are skipped while it runs (DRAGONFLY_DIR/client-*.building
# holds its pid; its log is beside it). A build that failed is not retried
# on its own: the tests fail and print its log; remove the log to retry.
DRAGONFLY_VERSION=v2.5.1
DFDAEMON_VERSION=1.5.10
DRAGONFLY_DIR=/var/cache/lamina-test/dragonfly
if [ ! -x "$DRAGONFLY_DIR/$DRAGONFLY_VERSION/scheduler" ] || [ ! -x "$DRAGONFLY_DIR/$DRAGONFLY_VERSION/manager" ]; then
    log "building the Dragonfly scheduler and manager $DRAGONFLY_VERSION from their Go module"
    src=$(cd / && GOFLAGS=-mod=mod "$GO" mod download -json "d7y.io/dragonfly/v2@$DRAGONFLY_VERSION" | jq -r .Dir)
    [ -d "$src" ] || die "go mod download of d7y.io/dragonfly/v2@$DRAGONFLY_VERSION gave no source"
    work=$(mktemp -d /tmp/lamina-dragonfly.XXXXXX)
    cp -r "$src/." "$work/"
    chmod -R u+w "$work"
    mkdir -p "$DRAGONFLY_DIR/$DRAGONFLY_VERSION"
    for bin in scheduler manager; do
        (cd "$work" && run env GOFLAGS=-mod=mod "$GO" build -o "$DRAGONFLY_DIR/$DRAGONFLY_VERSION/$bin.partial" "./cmd/$bin")
        mv "$DRAGONFLY_DIR/$DRAGONFLY_VERSION/$bin.partial" "$DRAGONFLY_DIR/$DRAGONFLY_VERSION/$bin"
    done
    rm -rf "$work"
fi
DFDAEMON_HOME=$DRAGONFLY_DIR/client-$DFDAEMON_VERSION
if [ -x "$DFDAEMON_HOME/bin/dfdaemon" ]; then
    log "dfdaemon: $DFDAEMON_HOME/bin/dfdaemon"
elif [ -f "$DFDAEMON_HOME.building" ] && kill -0 "$(cat "$DFDAEMON_HOME.building")" 2>/dev/null; then
    log "dfdaemon $DFDAEMON_VERSION is being built (log $DFDAEMON_HOME.log)"
elif [ -f "$DFDAEMON_HOME.log" ]; then
    log "dfdaemon $DFDAEMON_VERSION: the last build failed (log $DFDAEMON_HOME.log; remove it to retry)"
else
    log "building dfdaemon $DFDAEMON_VERSION from crates.io in the background (log $DFDAEMON_HOME.log)"
    mkdir -p "$DRAGONFLY_DIR"
    setsid nice -n 19 bash -c '
        cargo install dragonfly-client --version "$1" --locked --root "$2" --bin dfdaemon --bin dfget \
            && rm -f "$2.log"
        rm -f "$2.building"' _ "$DFDAEMON_VERSION" "$DFDAEMON_HOME" \
        >"$DFDAEMON_HOME.log" 2>&1 </dev/null &
    echo $! >"$DFDAEMON_HOME.building"
fi

# --- sanity ------------------------------------------------------------------------
for tool in umoci skopeo docker-registry mkfs.erofs zstd debootstrap jq python3 curl hyperfine unsquashfs \
    containerd ctr ctr-remote runc mkfs.xfs; do
    command -v "$tool" >/dev/null || die "tool not on PATH after install: $tool"
done
log "ok"
