#!/usr/bin/env bash
# lamina end to end, on a fresh Debian bookworm machine, as root:
#
#   1. scripts/setup.sh (Debian packages, Rust), cargo build --release -p lamina-cli
#   2. the reference Debian image (scripts/debian-image.sh; cached per machine)
#   3. a throw-away registry on 127.0.0.1, the image pushed into it with skopeo
#   4. lamina convert  docker://127.0.0.1:PORT/debian:bookworm
#                      docker://127.0.0.1:PORT/debian:bookworm-lamina   (pull, convert, push)
#   5. lamina mount    docker://127.0.0.1:PORT/debian:bookworm-lamina MNT  (fresh cache dir;
#                      registry images mount lazily: chunks are fetched on first read)
#   6. runc runs `python3 -c 'print("hello from a lamina container")'` in a container
#      whose rootfs is an overlayfs: lowerdir = the lamina mount, upper/work in a temp dir
#      (a first miss in a module fetches its directory's modules along, one in a shared
#      library the whole library: predicted misses)
#   7. boot pages: the same start recorded (`lamina mount --record-trace`), the image
#      converted again with `--prefetch TRACE` (tag bookworm-boot), mounted with a fresh
#      cache and started again: it fetches the pages it reads, in the order it reads
#      them, as frames of one layer (four in flight), each written as it lands
#      and read into the mount's page cache (warmed), so the start finds its
#      pages there and raises next to no pre-content event
#      Then without a recording: `lamina convert --boot-exec python3` (tag
#      bookworm-static) takes the pages every python3 start reads from the
#      image's ELF headers (the loader, libraries' tables and data, python3's
#      first modules), and the same start runs on it
#   8. faults: the same start through a proxy (tests/tools/faultproxy.py) that spoils
#      every fifth range request in turn (flipped bytes, truncated body, reset, 500, 503,
#      3 s stall): the container starts anyway, with the image's bytes; a stalled
#      answer costs a hedge (a second copy on a fresh connection once a request is
#      slower than recent ones), not a timeout
#   9. containerd: a private containerd 2.x (built by setup.sh) with `lamina snapshotter`
#      as its proxy snapshotter pulls the boot image (`ctr image pull --snapshotter
#      lamina`: no data layer is downloaded) and runs the same container (`ctr run`)
#  10. every file of the image read in path order from a fresh lazy mount: the worker
#      sees the stream and fetches ahead of it in a few large requests (fill-ahead)
#  11. FUSE: the same image with its cache dir on a tmpfs, where the kernel path cannot
#      serve; `lamina mount` (--mode auto) says so and serves it lazily through FUSE
#      (the same worker fetches and verifies what is read), and the hello container
#      runs on an overlay over that mount
#  12. rootless podman: user nobody (subordinate ids from setup.sh) mounts the image
#      lazily inside podman's user namespace (`podman unshare lamina mount`: FUSE, the
#      cache in nobody's home) and `podman run --rootfs MNT:O` runs the hello command
#      from it without root (skipped, and said so, when podman is not installed)
#  13. the unmodified image: `lamina index --boot-exec python3 docker://127.0.0.1:PORT/debian:bookworm`
#      stores a small index beside it (about 3% of the layers: windows narrowed to what
#      each span reads, and the boot pages every python3 start reads, found in the image
#      with no recorded start, issue 44) and binds it to the image (the tag becomes an image index
#      listing the unchanged manifest and the index, so the tag's digest covers it);
#      `lamina mount` of the image's own tag finds it and mounts the image lazily: the
#      hello container runs on it while only the spans of the tars it reads are fetched
#      from the original gzip layers. A mount of the manifest's own digest, which the
#      binding does not cover, finds the index only as a referrer, which anyone who may
#      push can list: nothing vouches for it, and it is refused (issue 42). The same tag
#      mounted through FUSE fetches only the index's first metadata frame; the daemon
#      fetches the others by range (`lamina status`, issue 44)
#  14. trust: the index signed by its publisher (cosign) mounts by digest; `lamina run
#      --userns` runs a container whose root is an unprivileged host uid
#  15. density: the image converted again with 128 KiB chunks (the same files in other
#      blobs, as a rebuild has them); both mounted eagerly through FUSE on one cache:
#      python3.11 is passed through to one object for both images (kept by content)
#  16. one page cache across images on the kernel path: the image converted again with
#      --pack-limit 0 (other blobs, other packing); both mounted `--share-files` on one
#      cache (each an overlayfs of its metadata over shards of objects named by content);
#      python3.11 of both is one object, and reading every file of the second image after
#      the first adds only its metadata to the page cache; the second mount borrows the
#      chunks the first's cache files hold (no second copy on disk)
#
# Prints the time of every step and the bytes fetched (at mount time, and on
# demand while the container ran, from `lamina status`). Everything (container,
# mounts, registry, temp dir) is removed on exit, also on failure or Ctrl-C.
#
# Usage: bash scripts/demo.sh [--no-build]
#   --no-build   skip setup.sh and cargo build and use the existing
#                target/release/lamina (for machines already set up)
set -euo pipefail

BUILD=1
case "${1:-}" in
"") ;;
--no-build) BUILD=0 ;;
-h | --help) sed -n '2,20p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
*) echo "usage: $0 [--no-build]" >&2; exit 2 ;;
esac

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"

log() { printf '\033[1m[demo]\033[0m %s\n' "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }
now() { date +%s.%N; }
secs() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.2f", b - a }'; }
human() { numfmt --to=iec-i --suffix=B --format='%.1f' "$1" 2>/dev/null || echo "$1 B"; }

[ "$(id -u)" = 0 ] || die "must run as root"

declare -a STEP_NAMES=() STEP_SECS=()
step() { # name start end
    STEP_NAMES+=("$1")
    STEP_SECS+=("$(secs "$2" "$3")")
    log "$(printf '%-34s %8ss' "$1" "$(secs "$2" "$3")")"
}

# ---- 1. setup and build ----------------------------------------------------------
LAMINA="$ROOT/target/release/lamina"
if [ "$BUILD" = 1 ]; then
    t=$(now)
    bash scripts/setup.sh
    # shellcheck disable=SC1091
    [ -f "$HOME/.cargo/env" ] && . "$HOME/.cargo/env"
    step "setup.sh" "$t" "$(now)"

    t=$(now)
    log "cargo build --release -p lamina-cli"
    cargo build --release -p lamina-cli
    step "cargo build" "$t" "$(now)"
else
    log "--no-build: using the existing $LAMINA"
    for tool in runc skopeo jq umoci docker-registry; do
        command -v "$tool" >/dev/null || die "missing tool: $tool (run without --no-build)"
    done
fi
[ -x "$LAMINA" ] || die "no $LAMINA"

# ---- 2. source image ----------------------------------------------------------------
t=$(now)
IMAGE_DIR=/var/cache/lamina-test/debian-oci
bash scripts/debian-image.sh "$IMAGE_DIR"
step "Debian image (build or cache)" "$t" "$(now)"

# ---- temp dir and cleanup ----------------------------------------------------------
TMP=$(mktemp -d /tmp/lamina-demo.XXXXXX)
REG="$TMP/registry"
MNT="$TMP/lamina-mnt"
CACHE="$TMP/cache"
BUNDLE="$TMP/bundle"
OVL="$TMP/overlay"
CID="lamina-demo-$$"
RUNC_STARTED=0
CTD_PID="" SNAP_PID=""
ROOTLESS="" FUSE_DEV_MODE=""
CONTAINERD2_DIR=/var/cache/lamina-test/go/containerd-v2.4.2
ctr() { "$CONTAINERD2_DIR/ctr" -a "$TMP/containerd/containerd.sock" "$@"; }

# wait (up to 10 s) until the given pids have exited
wait_gone() {
    local p i
    for p in "$@"; do
        for ((i = 0; i < 200; i++)); do
            [ -e "/proc/$p" ] || break
            sleep 0.05
        done
        [ -e "/proc/$p" ] && log "warning: lamina daemon pid $p still running"
    done
    return 0
}

cleanup() {
    local rc=$? m
    trap '' INT TERM # a second Ctrl-C must not cut the cleanup short
    set +e
    if [ "$RUNC_STARTED" = 1 ]; then
        runc delete --force "$CID" >/dev/null 2>&1
    fi
    if [ -n "$CTD_PID" ]; then
        ctr task kill -s KILL demo-ctd >/dev/null 2>&1 && sleep 0.3
        ctr task delete -f demo-ctd >/dev/null 2>&1
        ctr container delete demo-ctd >/dev/null 2>&1
        kill "$CTD_PID" 2>/dev/null
        wait_gone "$CTD_PID"
    fi
    [ -n "$SNAP_PID" ] && kill "$SNAP_PID" 2>/dev/null
    if [ -n "$ROOTLESS" ]; then
        # podman's namespace goes with its pause process; lamina's daemons
        # serving from nobody's cache with it
        as_nobody podman system migrate >/dev/null 2>&1
        pkill -f "$ROOTLESS" 2>/dev/null
        rm -rf --one-file-system "$ROOTLESS"
    fi
    [ -n "$FUSE_DEV_MODE" ] && chmod "$FUSE_DEV_MODE" /dev/fuse
    # the overlay first, then the lamina mount through lamina (stops its lazy daemon)
    mountpoint -q "$BUNDLE/rootfs" 2>/dev/null && umount "$BUNDLE/rootfs"
    if mountpoint -q "$MNT" 2>/dev/null; then
        local pids
        pids=$("$LAMINA" status --json --cache-dir "$CACHE" 2>/dev/null |
            jq -r --arg m "$MNT" '.[] | select(.mountpoint == $m) | .holder_pid, .status.pid // empty' 2>/dev/null)
        "$LAMINA" umount "$MNT" >/dev/null || log "warning: lamina umount $MNT failed"
        wait_gone $pids
    fi
    # anything else still mounted below $TMP, deepest first
    while read -r m; do
        umount "$m" 2>/dev/null || umount -l "$m" 2>/dev/null || log "warning: cannot unmount $m"
    done < <(awk -v p="$TMP/" 'index($2, p) == 1 { print $2 }' /proc/self/mounts | sort -r)
    [ -d "$REG" ] && tests/tools/registry.sh stop "$REG"
    if awk -v p="$TMP/" 'index($2, p) == 1 { found = 1 } END { exit !found }' /proc/self/mounts; then
        log "warning: something is still mounted under $TMP; left in place"
    else
        rm -rf --one-file-system "$TMP"
    fi
    if [ $rc -eq 0 ]; then
        log "cleaned up (container, mounts, registry, $TMP)"
    else
        log "FAILED (rc=$rc); cleaned up"
    fi
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# ---- 3. registry + push ---------------------------------------------------------------
t=$(now)
PORT=$(tests/tools/registry.sh start "$REG")
R="127.0.0.1:$PORT"
step "registry start ($R)" "$t" "$(now)"

t=$(now)
log "skopeo copy oci:$IMAGE_DIR:bookworm docker://$R/debian:bookworm"
skopeo copy --quiet --dest-tls-verify=false --preserve-digests \
    "oci:$IMAGE_DIR:bookworm" "docker://$R/debian:bookworm"
step "skopeo push (source image)" "$t" "$(now)"

# ---- 4. convert -------------------------------------------------------------------------
t=$(now)
log "lamina convert docker://$R/debian:bookworm docker://$R/debian:bookworm-lamina"
"$LAMINA" convert --json "docker://$R/debian:bookworm" "docker://$R/debian:bookworm-lamina" >"$TMP/convert.json"
step "lamina convert (pull+convert+push)" "$t" "$(now)"
jq -r '"  source layers \(.source_layer_bytes) B -> metadata \(.metadata_bytes) B (zstd \(.metadata_compressed_bytes) B), chunk index \(.index_bytes) B, \(.blobs | length) blobs \([.blobs[].size] | add) B; \(.stats.entries) entries, \(.stats.chunks_stored) chunks (\(.stats.packed_files) small files packed into \(.stats.packs) of them), dedup \(.dedup_ratio * 1000 | round / 1000)"' \
    "$TMP/convert.json" >&2

# ---- 5. mount ------------------------------------------------------------------------------
mkdir -p "$MNT"
t=$(now)
log "lamina mount docker://$R/debian:bookworm-lamina $MNT --cache-dir $CACHE"
"$LAMINA" mount --json "docker://$R/debian:bookworm-lamina" "$MNT" --cache-dir "$CACHE" >"$TMP/mount.json"
step "lamina mount (fresh cache)" "$t" "$(now)"
MOUNT_FETCHED=$(jq -r '.fetched_bytes' "$TMP/mount.json")
log "  fetched $MOUNT_FETCHED bytes at mount time; cache uses $(du -s --block-size=1 "$CACHE" | cut -f1) bytes on disk"
grep -F " $MNT " /proc/self/mounts | sed 's/^/  /' >&2
# registry images mount lazily: a daemon fetches chunks on first read
lazy_status() { "$LAMINA" status --json --cache-dir "$CACHE" | jq --arg m "$MNT" '.[] | select(.mountpoint == $m) | .status'; }
# the worker rewrites its status every 200 ms: wait for a fresh one
settled_status() { sleep 0.3; lazy_status; }
LAZY=0
if "$LAMINA" status --help >/dev/null 2>&1 && [ -n "$(lazy_status 2>/dev/null)" ]; then
    LAZY=1
    lazy_status | jq -r '"  lazy mount: \(.cached_bytes) of \(.total_bytes) bytes cached"' >&2
fi

# ---- 6. container on overlayfs(lower = lamina mount) -----------------------------------------
mkdir -p "$OVL/upper" "$OVL/work" "$BUNDLE/rootfs"
t=$(now)
mount -t overlay overlay -o "lowerdir=$MNT,upperdir=$OVL/upper,workdir=$OVL/work" "$BUNDLE/rootfs"
step "overlay mount" "$t" "$(now)"

(cd "$BUNDLE" && runc spec)
jq --arg root "$BUNDLE/rootfs" '
    .root.path = $root
    | .root.readonly = false
    | .process.terminal = false
    | .process.args = ["python3", "-c", "print(\"hello from a lamina container\")"]' \
    "$BUNDLE/config.json" >"$BUNDLE/config.json.new"
mv "$BUNDLE/config.json.new" "$BUNDLE/config.json"

log "runc run --bundle $BUNDLE $CID"
t=$(now)
RUNC_STARTED=1
set +e
runc run --bundle "$BUNDLE" "$CID" </dev/null | tee "$TMP/container.out"
RC=${PIPESTATUS[0]}
set -e
step "runc run (container)" "$t" "$(now)"
[ "$RC" = 0 ] || die "container exited with $RC"
FETCHED=$MOUNT_FETCHED
if [ "$LAZY" = 1 ]; then
    settled_status >"$TMP/status.json"
    FETCHED=$(jq -r '.fetched_bytes' "$TMP/status.json")
    jq -r '"  lazy fetches for the container: \(.fetched_bytes) bytes in \(.requests) requests (\(.misses) misses, \(.failed_misses) failed; \(.predictions) first misses fetched their module directory or library along, \(.predicted_fetched_bytes) bytes); \(.cached_bytes) of \(.total_bytes) bytes now cached"' \
        "$TMP/status.json" >&2
fi
grep -qx "hello from a lamina container" "$TMP/container.out" || die "unexpected container output"
runc delete --force "$CID" >/dev/null 2>&1 || true
RUNC_STARTED=0
# Counted now: the rounds below start each container on a fresh upper dir.
WRITTEN=$(find "$OVL/upper" -mindepth 1 | wc -l)

# ---- 7. boot pages: record the start, bake the pages it read into the image, start again ------
teardown() { # the overlay and the lamina mount of the round before
    mountpoint -q "$BUNDLE/rootfs" && umount "$BUNDLE/rootfs"
    if mountpoint -q "$MNT"; then "$LAMINA" umount "$MNT" >/dev/null; fi
    rm -rf "$OVL"
    mkdir -p "$OVL/upper" "$OVL/work"
}
run_container() { # label: the hello container on an overlay over $MNT
    mount -t overlay overlay -o "lowerdir=$MNT,upperdir=$OVL/upper,workdir=$OVL/work" "$BUNDLE/rootfs"
    CID="lamina-demo-$$-$1"
    local t
    t=$(now)
    RUNC_STARTED=1
    runc run --bundle "$BUNDLE" "$CID" </dev/null >"$TMP/container-$1.out"
    step "runc run ($1)" "$t" "$(now)"
    runc delete --force "$CID" >/dev/null 2>&1 || true
    RUNC_STARTED=0
    grep -qx "hello from a lamina container" "$TMP/container-$1.out" || die "unexpected container output ($1)"
}
BOOT=0
if [ "$LAZY" = 1 ]; then
    BOOT=1
    teardown
    CACHE="$TMP/cache-record"
    log "lamina mount --record-trace $TMP/trace.txt docker://$R/debian:bookworm-lamina (fresh cache)"
    "$LAMINA" mount --record-trace "$TMP/trace.txt" "docker://$R/debian:bookworm-lamina" "$MNT" \
        --cache-dir "$CACHE" >/dev/null
    run_container record
    teardown
    log "  trace: $(wc -l <"$TMP/trace.txt") reads of data not yet local"

    t=$(now)
    log "lamina convert --prefetch $TMP/trace.txt docker://$R/debian:bookworm docker://$R/debian:bookworm-boot"
    "$LAMINA" convert --json --prefetch "$TMP/trace.txt" "docker://$R/debian:bookworm" \
        "docker://$R/debian:bookworm-boot" >"$TMP/convert-boot.json"
    step "lamina convert --prefetch" "$t" "$(now)"
    jq -r '"  boot pages: \(.boot_pages.extents) runs, \(.boot_pages.bytes) B -> \(.boot_pages.compressed_bytes) B compressed"' \
        "$TMP/convert-boot.json" >&2

    CACHE="$TMP/cache-boot"
    t=$(now)
    log "lamina mount docker://$R/debian:bookworm-boot $MNT (fresh cache)"
    "$LAMINA" mount "docker://$R/debian:bookworm-boot" "$MNT" --cache-dir "$CACHE" >/dev/null
    step "lamina mount (boot image)" "$t" "$(now)"
    run_container boot
    settled_status >"$TMP/status-boot.json"
    jq -r '"  fetched for the start: \(.fetched_bytes) bytes in \(.requests) requests (boot pages in \(.boot_frames) frames, streamed in read order; \(.miss_fetched_bytes) bytes of chunks for readers), \(.misses) misses; \(.warmed_bytes // 0) bytes of boot pages read into the page cache as they landed, \(.ready_events // 0) reads answered by the holder"' \
        "$TMP/status-boot.json" >&2

    # No recording: the pages every python3 start reads, found in the image's
    # ELF headers (the loader, libraries' tables and data, python3's first
    # modules; docs/lazy.md, "Boot sets known from the image").
    teardown
    t=$(now)
    log "lamina convert --boot-exec python3 docker://$R/debian:bookworm docker://$R/debian:bookworm-static"
    "$LAMINA" convert --json --boot-exec python3 "docker://$R/debian:bookworm" \
        "docker://$R/debian:bookworm-static" >"$TMP/convert-static.json"
    step "lamina convert --boot-exec python3" "$t" "$(now)"
    jq -r '"  boot pages from the image: \(.boot_pages.extents) runs, \(.boot_pages.bytes) B -> \(.boot_pages.compressed_bytes) B compressed, \(.stats.boot_set_chunks) chunks"' \
        "$TMP/convert-static.json" >&2
    CACHE="$TMP/cache-static"
    t=$(now)
    log "lamina mount docker://$R/debian:bookworm-static $MNT (fresh cache)"
    "$LAMINA" mount "docker://$R/debian:bookworm-static" "$MNT" --cache-dir "$CACHE" >/dev/null
    step "lamina mount (boot pages from the image)" "$t" "$(now)"
    run_container static
    settled_status >"$TMP/status-static.json"
    jq -r '"  fetched for the start: \(.fetched_bytes) bytes in \(.requests) requests, \(.miss_requests) of them for misses (\(.boot_frames) boot frames)"' \
        "$TMP/status-static.json" >&2
fi

# ---- 8. faults: the same start through a proxy that spoils every fifth range request --------
FAULTS=0
if [ "$LAZY" = 1 ]; then
    FAULTS=1
    teardown
    python3 "$ROOT/tests/tools/faultproxy.py" 0 "$PORT" mix --every 5 --stall 3 --lifetime 600 \
        --port-file "$TMP/proxy.port" --stats "$TMP/proxy.json" >"$TMP/proxy.log" 2>&1 &
    for _ in $(seq 100); do [ -s "$TMP/proxy.port" ] && break; sleep 0.05; done
    [ -s "$TMP/proxy.port" ] || die "the fault proxy did not start: $(cat "$TMP/proxy.log")"
    P="127.0.0.1:$(cat "$TMP/proxy.port")"
    CACHE="$TMP/cache-faults"
    t=$(now)
    log "lamina mount docker://$P/debian:bookworm-lamina $MNT (through the fault proxy, fresh cache)"
    "$LAMINA" mount --prefetch none "docker://$P/debian:bookworm-lamina" "$MNT" --cache-dir "$CACHE" >/dev/null
    step "lamina mount (through faults)" "$t" "$(now)"
    run_container faults
    settled_status >"$TMP/status-faults.json"
    jq -r '"  through the proxy: \(.fetched_bytes) bytes in \(.requests) requests, \(.bad_chunks) corrupt chunks fetched again, \(.failed_misses) failed reads, \(.hedges) slow requests hedged (\(.hedge_wins) hedges answered first, bound \(.hedge_bound_ms) ms)"' \
        "$TMP/status-faults.json" >&2
    jq -r '"  the proxy spoilt \(.faulted) of \(.eligible) range requests: \(.faults)"' "$TMP/proxy.json" >&2
fi

# ---- 9. containerd 2.x: the boot image pulled and run through lamina snapshotter ------------
CTD=0
if [ "$BOOT" = 1 ] && [ -x "$CONTAINERD2_DIR/containerd" ]; then
    CTD=1
    teardown
    D="$TMP/containerd"
    mkdir -p "$D"
    "$LAMINA" snapshotter --root "$TMP/snapshotter" --address "$D/lamina.sock" >"$TMP/snapshotter.log" 2>&1 &
    SNAP_PID=$!
    cat >"$D/config.toml" <<EOF
version = 3
root = "$D/root"
state = "$D/state"
disabled_plugins = ["io.containerd.grpc.v1.cri", "io.containerd.cri.v1.images", "io.containerd.cri.v1.runtime"]
[grpc]
  address = "$D/containerd.sock"
[ttrpc]
  address = "$D/containerd.sock.ttrpc"
[proxy_plugins.lamina]
  type = "snapshot"
  address = "$D/lamina.sock"
  [proxy_plugins.lamina.exports]
    enable_remote_snapshot_annotations = "true"
[plugins."io.containerd.transfer.v1.local"]
  [[plugins."io.containerd.transfer.v1.local".unpack_config]]
    platform = "linux/amd64"
    snapshotter = "lamina"
EOF
    PATH="$CONTAINERD2_DIR:$PATH" "$CONTAINERD2_DIR/containerd" --config "$D/config.toml" >"$TMP/containerd.log" 2>&1 &
    CTD_PID=$!
    for _ in $(seq 300); do ctr version >/dev/null 2>&1 && [ -S "$D/lamina.sock" ] && break; sleep 0.1; done
    ctr version >/dev/null 2>&1 || die "containerd did not start: $(tail -5 "$TMP/containerd.log")"
    log "containerd $("$CONTAINERD2_DIR/containerd" --version | awk '{print $3}') with lamina snapshotter ($D)"
    t=$(now)
    log "ctr image pull --snapshotter lamina $R/debian:bookworm-boot"
    ctr image pull --plain-http --snapshotter lamina "$R/debian:bookworm-boot" >/dev/null
    step "ctr image pull (lamina)" "$t" "$(now)"
    t=$(now)
    ctr run --rm --snapshotter lamina "$R/debian:bookworm-boot" demo-ctd \
        python3 -c 'print("hello from a lamina container")' </dev/null >"$TMP/container-ctd.out"
    step "ctr run (containerd 2.x)" "$t" "$(now)"
    grep -qx "hello from a lamina container" "$TMP/container-ctd.out" || die "unexpected output from the containerd container"
    "$LAMINA" status --json --cache-dir "$TMP/snapshotter/cache" | jq '.[0].status' >"$TMP/status-ctd.json"
    BLOBS=$(jq -r '.blobs[].digest' "$TMP/convert-boot.json")
    CTD_DATA=$(ctr content ls -q | grep -cFx "$BLOBS" || true)
    log "  containerd's content store holds $CTD_DATA of the image's $(wc -l <<<"$BLOBS") data blobs"
    jq -r '"  lamina fetched \(.fetched_bytes) bytes for the pull and start, in \(.requests) requests"' "$TMP/status-ctd.json" >&2
fi

# ---- 10. the whole image read in path order: fetched ahead in a few large requests --------------
READALL=0
if [ "$LAZY" = 1 ]; then
    READALL=1
    teardown
    CACHE="$TMP/cache-readall"
    log "lamina mount docker://$R/debian:bookworm-lamina $MNT (fresh cache), then every file read (find -exec cat)"
    "$LAMINA" mount --prefetch none "docker://$R/debian:bookworm-lamina" "$MNT" --cache-dir "$CACHE" >/dev/null
    t=$(now)
    find "$MNT" -xdev -type f -exec cat {} + >/dev/null
    step "read every file (lazy, fill-ahead)" "$t" "$(now)"
    settled_status >"$TMP/status-readall.json"
    jq -r '"  \(.fetched_bytes) bytes in \(.requests) requests (\(.ahead_requests) fetched ahead of the reader), \(.failed_misses) failed reads"' \
        "$TMP/status-readall.json" >&2
fi

# ---- 11. FUSE where the kernel path cannot serve: the cache dir on a tmpfs -------------------------
teardown
mkdir -p "$TMP/tmpfs"
mount -t tmpfs -o mode=0700 tmpfs "$TMP/tmpfs"
CACHE="$TMP/tmpfs/cache"
log "lamina mount docker://$R/debian:bookworm-lamina $MNT --cache-dir $CACHE (tmpfs: --mode auto picks FUSE)"
t=$(now)
"$LAMINA" mount --json "docker://$R/debian:bookworm-lamina" "$MNT" --cache-dir "$CACHE" 2>/dev/null >"$TMP/mount-fuse.json"
step "lamina mount (FUSE, lazy)" "$t" "$(now)"
FUSE_MODE=$(jq -r '"\(.mode): \(.mode_reason)"' "$TMP/mount-fuse.json")
log "  $FUSE_MODE"
[ "$(jq -r .mode "$TMP/mount-fuse.json")" = fuse ] || die "--mode auto did not pick FUSE with the cache on tmpfs"
run_container fuse
FUSE_FETCHED=$(settled_status | jq -r '"\(.fetched_bytes) bytes in \(.requests) requests for \(.misses) misses"')
log "  through FUSE, the container's reads fetched $FUSE_FETCHED"
# The mount fetched only the metadata's first frame (the manifest lists the
# frames and their digests); the daemon fetched the others by range (issue
# 44), as `lamina status` shows.
metadata_frames() { # the FUSE daemon's metadata frames at $MNT, once all written
    local f
    for _ in $(seq 150); do
        f=$("$LAMINA" status --json --cache-dir "$CACHE" |
            jq -c --arg m "$MNT" '.[] | select(.mountpoint == $m) | .fuse.metadata_frames')
        [ "$(jq -r '.complete' <<<"$f" 2>/dev/null)" = true ] && break
        sleep 0.1
    done
    [ "$(jq -r '.complete' <<<"$f" 2>/dev/null)" = true ] ||
        die "the FUSE daemon never wrote the whole metadata: $f"
    [ "$(jq -r '.fetched_bytes' <<<"$f")" -gt 0 ] || die "the metadata was fetched whole before the mount: $f"
    jq -r '"  metadata: the mount fetched its first frame, the daemon the other \(.frames - 1) by range (\(.fetched_bytes) bytes in \(.requests) requests; lamina status)"' <<<"$f" >&2
}
metadata_frames

# ---- 12. rootless podman from a lamina mount ---------------------------------------------------
# podman runs as nobody in its user namespace; the image is mounted in that
# namespace, where its files belong to the container's users.
as_nobody() {
    setpriv --reuid=65534 --regid=65534 --clear-groups env -u LAMINA_CACHE_DIR \
        HOME="$ROOTLESS/home" XDG_RUNTIME_DIR="$ROOTLESS/home/run" \
        XDG_CONFIG_HOME="$ROOTLESS/home/config" XDG_DATA_HOME="$ROOTLESS/home/data" \
        XDG_CACHE_HOME="$ROOTLESS/home/cache" "$@"
}
PODMAN_SAID="skipped: podman or nobody's subordinate ids missing (scripts/setup.sh installs them)"
if command -v podman >/dev/null && grep -q '^nobody:' /etc/subuid 2>/dev/null; then
    # short: with an XDG_RUNTIME_DIR of 40 characters or more, podman 4.3's
    # exit command refuses the runroot and podman run waits 20 s (docs/fuse.md)
    ROOTLESS=$(mktemp -d /tmp/lamina-rl.XXXXXX)
    chmod 755 "$ROOTLESS"
    mkdir -p "$ROOTLESS/home/run" "$ROOTLESS/mnt"
    chmod 700 "$ROOTLESS/home/run"
    chown -R 65534:65534 "$ROOTLESS/home" "$ROOTLESS/mnt"
    # a normal host's /dev/fuse is 0666; open it up for the demo if it is not
    mode=$(stat -c %a /dev/fuse)
    if [ "$mode" != 666 ]; then FUSE_DEV_MODE=$mode; chmod 666 /dev/fuse; fi
    log "as nobody: podman unshare lamina mount docker://$R/debian:bookworm-lamina $ROOTLESS/mnt"
    t=$(now)
    as_nobody podman unshare "$LAMINA" mount --json "docker://$R/debian:bookworm-lamina" "$ROOTLESS/mnt" \
        2>/dev/null >"$TMP/mount-rootless.json"
    step "lamina mount (rootless, podman ns)" "$t" "$(now)"
    log "  $(jq -r '"\(.mode): \(.mode_reason)"' "$TMP/mount-rootless.json")"
    t=$(now)
    as_nobody podman --cgroup-manager=cgroupfs run --rm --network none --ulimit host \
        --rootfs "$ROOTLESS/mnt:O" python3 -c 'print("hello from rootless podman on lamina")' \
        2>/dev/null >"$TMP/podman.out"
    step "podman run --rootfs (rootless)" "$t" "$(now)"
    grep -qx "hello from rootless podman on lamina" "$TMP/podman.out" || die "unexpected podman output"
    as_nobody podman unshare "$LAMINA" umount "$ROOTLESS/mnt" >/dev/null 2>&1
    PODMAN_SAID=$(cat "$TMP/podman.out")
fi

# ---- 13. the unmodified image, through a tar index ---------------------------------------------
teardown
CACHE="$TMP/cache-index"
log "lamina index docker://$R/debian:bookworm (no conversion: an index bound to the image under its tag)"
t=$(now)
"$LAMINA" index --json --boot-exec python3 "docker://$R/debian:bookworm" >"$TMP/index.json"
step "lamina index --boot-exec python3" "$t" "$(now)"
jq -r '.[0] | "  index \(.artifact_bytes) bytes (\(.window_bytes) of them narrowed windows, fetched with their spans; \(.boot_pages.compressed_bytes) of boot pages from the image, \(.boot_pages.bytes) raw; \(.spans) spans), \(.artifact_bytes * 10000 / .image_layer_bytes | round / 100)% of \(.image_layer_bytes) bytes of layers: \(.stored)"' "$TMP/index.json" >&2
[ "$(jq -r '.[0].boot_pages.bytes // 0' "$TMP/index.json")" -gt 0 ] || die "lamina index --boot-exec python3 made no boot pages"
log "lamina mount docker://$R/debian:bookworm $MNT (the image as it is, found through its index)"
t=$(now)
"$LAMINA" mount --json "docker://$R/debian:bookworm" "$MNT" --cache-dir "$CACHE" 2>/dev/null >"$TMP/mount-index.json"
step "lamina mount (through its index)" "$t" "$(now)"
run_container index
settled_status >"$TMP/status-index.json"
jq -r '"  fetched \(.fetched_bytes) bytes (boot pages, spans and their windows) in \(.requests) range requests of the original layers (\(.boot_page_bytes) bytes of boot pages applied), \(.cached_bytes) of \(.total_bytes) tar bytes cached"' \
    "$TMP/status-index.json" >&2
teardown
# Through FUSE, the index's metadata comes as the mount's own does (issue 44).
log "lamina mount --mode fuse docker://$R/debian:bookworm $MNT (through its index, a fresh cache)"
CACHE="$TMP/cache-index-fuse"
t=$(now)
"$LAMINA" mount --mode fuse "docker://$R/debian:bookworm" "$MNT" --cache-dir "$CACHE" >/dev/null 2>&1 ||
    die "the FUSE mount through the index failed"
step "lamina mount (FUSE, through its index)" "$t" "$(now)"
run_container index-fuse
metadata_frames
teardown
CACHE="$TMP/cache-index"
SUBJECT=$(jq -r '.[0].subject' "$TMP/index.json")
log "lamina mount docker://$R/debian@$SUBJECT (the manifest's digest: its index is only a referrer there)"
if "$LAMINA" mount "docker://$R/debian@$SUBJECT" "$MNT" --cache-dir "$CACHE" 2>"$TMP/refused.err"; then
    die "a referrer nothing vouches for was mounted"
fi
sed 's/^/  /' "$TMP/refused.err" | cut -c1-200 >&2

# ---- 14. trust: the index signed by its publisher, a container in a user namespace ------------
COSIGN_DIR=/var/cache/lamina-test/go/cosign-v2.6.5
while [ ! -x "$COSIGN_DIR/cosign" ] && [ -f "$COSIGN_DIR.building" ]; do
    sleep 2 # setup.sh builds it in the background
done
[ -x "$COSIGN_DIR/cosign" ] || die "no cosign at $COSIGN_DIR (setup.sh builds it; log $COSIGN_DIR.log)"
INDEX=$(jq -r '.[0].manifest_digest' "$TMP/index.json")
log "cosign sign --key cosign.key $R/debian@$INDEX (the publisher signs its index; offline, no transparency log)"
(cd "$TMP" && COSIGN_PASSWORD='' "$COSIGN_DIR/cosign" generate-key-pair >/dev/null 2>&1 &&
    COSIGN_PASSWORD='' "$COSIGN_DIR/cosign" sign --key cosign.key --tlog-upload=false --yes \
        --allow-insecure-registry --allow-http-registry "$R/debian@$INDEX" >/dev/null 2>&1) ||
    die "cosign could not sign the index"
log "lamina mount --trust-index-key cosign.pub docker://$R/debian@$SUBJECT (the same digest: its index is signed now)"
t=$(now)
"$LAMINA" mount --trust-index-key "$TMP/cosign.pub" "docker://$R/debian@$SUBJECT" "$MNT" --cache-dir "$CACHE" \
    >/dev/null 2>"$TMP/signed.err" || die "the signed index was refused: $(cat "$TMP/signed.err")"
step "lamina mount (signed index)" "$t" "$(now)"
SIGNED_SAID="python3 is $(stat -c '%A' "$MNT/usr/bin/python3.11")"
teardown
log "lamina run --userns 200000 --reserve-space docker://$R/debian:bookworm (the container's root is host uid 200000; the image's cache space is taken at mount)"
# Its root must pass through the state dir's parents: not the demo's 0700 temp dir.
USERNS_STATE=/run/lamina-demo-userns.$$
t=$(now)
USERNS_SAID=$("$LAMINA" run --rm --userns 200000 --reserve-space --mode kernel --cache-dir "$CACHE" --state-dir "$USERNS_STATE" \
    "docker://$R/debian:bookworm" -- sh -c 'echo "uid $(id -u), uid_map $(cat /proc/self/uid_map)"' 2>"$TMP/userns.err" |
    tr -s ' ') || die "lamina run --userns failed: $(cat "$TMP/userns.err")"
step "lamina run --userns" "$t" "$(now)"
rm -rf "$USERNS_STATE"

# ---- 15. density: the same files in two images, one passthrough object ------------------------
OBJ_CACHE="$TMP/cache-objects"
log "lamina convert --chunk-size 131072 docker://$R/debian:bookworm docker://$R/debian:bookworm-lamina-128k (the same files in other blobs, as a rebuild has them)"
t=$(now)
"$LAMINA" convert --chunk-size 131072 "docker://$R/debian:bookworm" "docker://$R/debian:bookworm-lamina-128k" \
    >/dev/null 2>"$TMP/convert-128k.err" || die "lamina convert --chunk-size failed: $(cat "$TMP/convert-128k.err")"
step "lamina convert (128 KiB chunks)" "$t" "$(now)"
for tag in bookworm-lamina bookworm-lamina-128k; do
    log "lamina mount --eager --mode fuse docker://$R/debian:$tag (both on $OBJ_CACHE)"
    mkdir -p "$TMP/objects-$tag"
    "$LAMINA" mount --eager --mode fuse "docker://$R/debian:$tag" "$TMP/objects-$tag" --cache-dir "$OBJ_CACHE" \
        >/dev/null 2>"$TMP/objects.err" || die "eager FUSE mount of $tag failed: $(cat "$TMP/objects.err")"
    # The first open is served by the daemon while the file's object is made.
    cat "$TMP/objects-$tag/usr/bin/python3.11" >/dev/null
done
PY_SHA=$(sha256sum "$TMP/objects-bookworm-lamina/usr/bin/python3.11" | cut -d' ' -f1)
OBJECT_LINKS=0
for _ in $(seq 100); do # the objects are made in the background
    OBJECT_LINKS=$(stat -c %h "$OBJ_CACHE"/objects/content/*/"$PY_SHA" 2>/dev/null || echo 0)
    [ "$OBJECT_LINKS" = 3 ] && break
    sleep 0.2
done
[ "$OBJECT_LINKS" = 3 ] || die "python3.11 of the two images is not one object (links: $OBJECT_LINKS)"
OBJECTS_SAID="python3.11 of both images is one object (content + 2 images: $OBJECT_LINKS links)"
log "  $OBJECTS_SAID"
for tag in bookworm-lamina bookworm-lamina-128k; do "$LAMINA" umount "$TMP/objects-$tag" >/dev/null; done

# ---- 16. density on the kernel path: one page cache for both images -------------------------
SHARE_CACHE="$TMP/cache-shared"
SHARED_DISK=()
log "lamina convert --pack-limit 0 docker://$R/debian:bookworm docker://$R/debian:bookworm-lamina-unpacked (other blobs)"
t=$(now)
"$LAMINA" convert --pack-limit 0 "docker://$R/debian:bookworm" "docker://$R/debian:bookworm-lamina-unpacked" \
    >/dev/null 2>"$TMP/convert-unpacked.err" || die "lamina convert --pack-limit 0 failed: $(cat "$TMP/convert-unpacked.err")"
step "lamina convert (no packing)" "$t" "$(now)"
t=$(now)
for tag in bookworm-lamina bookworm-lamina-unpacked; do
    log "lamina mount --eager --mode kernel --share-files docker://$R/debian:$tag (both on $SHARE_CACHE)"
    mkdir -p "$TMP/shared-$tag"
    "$LAMINA" mount --eager --mode kernel --share-files "docker://$R/debian:$tag" "$TMP/shared-$tag" \
        --cache-dir "$SHARE_CACHE" >/dev/null 2>"$TMP/shared.err" || die "--share-files mount of $tag failed: $(cat "$TMP/shared.err")"
    # Disk the cache files take: the second image borrows the chunks the first holds.
    SHARED_DISK+=("$(du -s --block-size=1 "$SHARE_CACHE/blobs" | cut -f1)")
done
step "lamina mount --share-files (x2)" "$t" "$(now)"
[ "${#SHARED_DISK[@]}" = 2 ] || die "no disk figures for the --share-files mounts"
# Where each view takes python3.11's data from: the redirect its metadata view carries.
redirect_of() {
    local view
    view=$(findmnt -n -o OPTIONS "$1" | tr ',' '\n' | sed -n 's/^lowerdir+=//p')
    python3 -c 'import os, sys; print(os.getxattr(sys.argv[1], "trusted.overlay.redirect").decode())' \
        "$view/usr/bin/python3.11"
}
[ "$(redirect_of "$TMP/shared-bookworm-lamina")" = "$(redirect_of "$TMP/shared-bookworm-lamina-unpacked")" ] ||
    die "python3.11 of the two images is not one object"
cached_kib() { awk '/^Cached:/ {print $2}' /proc/meminfo; }
sync
echo 3 >/proc/sys/vm/drop_caches
c0=$(cached_kib)
find "$TMP/shared-bookworm-lamina" -xdev -type f -exec cat {} + >/dev/null
c1=$(cached_kib)
find "$TMP/shared-bookworm-lamina-unpacked" -xdev -type f -exec cat {} + >/dev/null
c2=$(cached_kib)
SHARED_SAID="python3.11 is one object; every file of the first image: $(((c1 - c0) / 1024)) MiB of page cache, then the second's added $(((c2 - c1) / 1024)) MiB; cache files on disk: $((SHARED_DISK[0] >> 20)) MiB for the first, the second added $(((SHARED_DISK[1] - SHARED_DISK[0]) >> 20)) MiB"
log "  $SHARED_SAID"
for tag in bookworm-lamina bookworm-lamina-unpacked; do "$LAMINA" umount "$TMP/shared-$tag" --cache-dir "$SHARE_CACHE" >/dev/null; done

# ---- summary ----------------------------------------------------------------------------------
echo
echo "lamina demo: $(uname -r), $(nproc) CPUs, $(date -u +%FT%TZ)"
for i in "${!STEP_NAMES[@]}"; do
    printf '  %-36s %8s s\n' "${STEP_NAMES[$i]}" "${STEP_SECS[$i]}"
done
printf '  %-36s %8s\n' "source layers (gzip)" "$(human "$(jq -r .source_layer_bytes "$TMP/convert.json")")"
printf '  %-36s %8s\n' "lamina blobs pushed (zstd)" "$(human "$(jq -r '[.blobs[].size] | add' "$TMP/convert.json")")"
if [ "$LAZY" = 1 ]; then
    printf '  %-36s %8s\n' "fetched at mount (lazy)" "$(human "$MOUNT_FETCHED")"
    printf '  %-36s %8s  (%s of %s cached)\n' "fetched on demand, total" "$(human "$FETCHED")" \
        "$(human "$(jq -r .cached_bytes "$TMP/status.json")")" "$(human "$(jq -r .total_bytes "$TMP/status.json")")"
else
    printf '  %-36s %8s\n' "bytes fetched by mount" "$(human "$FETCHED")"
fi
if [ "$BOOT" = 1 ]; then
    printf '  %-36s %8s\n' "boot pages (zstd)" "$(human "$(jq -r .boot_pages.compressed_bytes "$TMP/convert-boot.json")")"
    printf '  %-36s %8s  (chunks for readers: %s)\n' "fetched for the boot-image start" \
        "$(human "$(jq -r .fetched_bytes "$TMP/status-boot.json")")" \
        "$(human "$(jq -r .miss_fetched_bytes "$TMP/status-boot.json")")"
    printf '  %-36s %8s  (%s requests; boot pages %s, from the image)\n' "fetched, boot set without recording" \
        "$(human "$(jq -r .fetched_bytes "$TMP/status-static.json")")" \
        "$(jq -r .requests "$TMP/status-static.json")" \
        "$(human "$(jq -r .boot_pages.compressed_bytes "$TMP/convert-static.json")")"
fi
if [ "$FAULTS" = 1 ]; then
    printf '  %-36s %8s  (%s corrupt chunks refetched, %s failed reads, %s hedged)\n' "range requests spoilt by the proxy" \
        "$(jq -r '"\(.faulted)/\(.eligible)"' "$TMP/proxy.json")" \
        "$(jq -r .bad_chunks "$TMP/status-faults.json")" "$(jq -r .failed_misses "$TMP/status-faults.json")" \
        "$(jq -r .hedges "$TMP/status-faults.json")"
fi
if [ "$CTD" = 1 ]; then
    printf '  %-36s %8s  (data blobs in containerd: %s)\n' "fetched for the containerd start" \
        "$(human "$(jq -r .fetched_bytes "$TMP/status-ctd.json")")" "$CTD_DATA"
fi
if [ "$READALL" = 1 ]; then
    printf '  %-36s %8s  (in %s range requests)\n' "fetched reading every file" \
        "$(human "$(jq -r .fetched_bytes "$TMP/status-readall.json")")" "$(jq -r .requests "$TMP/status-readall.json")"
fi
printf '  %-36s %s\n' "cache on tmpfs: mount path" "$FUSE_MODE"
printf '  %-36s %s\n' "cache on tmpfs: fetched on demand" "$FUSE_FETCHED"
printf '  %-36s %s\n' "rootless podman" "$PODMAN_SAID"
printf '  %-36s %8s  (for %s of layers; windows stored beside it: %s, fetched with their spans)\n' \
    "index of the unmodified image" \
    "$(human "$(jq -r ".[0].artifact_bytes - .[0].window_bytes" "$TMP/index.json")")" \
    "$(human "$(jq -r ".[0].image_layer_bytes" "$TMP/index.json")")" "$(human "$(jq -r ".[0].window_bytes" "$TMP/index.json")")"
printf '  %-36s %8s  (in %s range requests of the original layers)\n' "fetched for the start through it" \
    "$(human "$(jq -r .fetched_bytes "$TMP/status-index.json")")" "$(jq -r .requests "$TMP/status-index.json")"
printf '  %-36s %8s\n' "files written by the container" "$WRITTEN"
printf '  %-36s %s\n' "signed index (trusted key)" "$SIGNED_SAID"
printf '  %-36s %s\n' "lamina run --userns 200000" "$USERNS_SAID"
printf '  %-36s %s\n' "FUSE objects by content" "$OBJECTS_SAID"
printf '  %-36s %s\n' "kernel path, --share-files" "$SHARED_SAID"
echo "  container said: $(cat "$TMP/container.out")"
