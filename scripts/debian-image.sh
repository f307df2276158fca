#!/usr/bin/env bash
# Build the reference Debian bookworm OCI image used by lamina's tests.
#
# Usage: scripts/debian-image.sh [OUTDIR]      (default /var/cache/lamina-test/debian-oci)
#
# Result: an OCI image layout at OUTDIR with tag "bookworm" made of two layers:
#   1. debootstrap --variant=minbase bookworm
#   2. apt-get install --no-install-recommends python3 nginx-light redis-server
# Layers are produced by umoci (init/new/unpack/repack/gc).
#
# Caching: if OUTDIR already holds tag "bookworm" and a ".complete" marker, the
# script does nothing. The image is built in OUTDIR.tmp and renamed at the end.
#
# The Debian mirror is read from the machine's apt sources at run time
# (/etc/apt/sources.list.d/*.sources "URIs:" or /etc/apt/sources.list);
# override with LAMINA_DEBIAN_MIRROR=URL.
# Must run as root (debootstrap, chroot, mounts).
set -euo pipefail

OUTDIR=${1:-/var/cache/lamina-test/debian-oci}
OUTDIR=${OUTDIR%/}
TAG=bookworm
SUITE=bookworm
PACKAGES="python3 nginx-light redis-server"

log() { printf '[debian-image] %s\n' "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }

[ "$(id -u)" = 0 ] || die "must run as root"
for tool in umoci debootstrap jq chroot mount umount; do
    command -v "$tool" >/dev/null || die "missing tool: $tool (run scripts/setup.sh)"
done

has_tag() {
    [ -f "$1/index.json" ] &&
        jq -e --arg t "$TAG" \
            '[.manifests[]? | select(.annotations["org.opencontainers.image.ref.name"] == $t)] | length > 0' \
            "$1/index.json" >/dev/null 2>&1
}

if [ -f "$OUTDIR/.complete" ] && has_tag "$OUTDIR"; then
    log "cached: $OUTDIR (tag $TAG) is complete; nothing to do"
    exit 0
fi

# --- find a Debian mirror from the apt configuration --------------------------
find_mirror() {
    if [ -n "${LAMINA_DEBIAN_MIRROR:-}" ]; then
        echo "$LAMINA_DEBIAN_MIRROR"
        return
    fi
    local f
    # deb822 sources: pick the first stanza whose Suites contains exactly $SUITE.
    for f in /etc/apt/sources.list.d/*.sources; do
        [ -f "$f" ] || continue
        awk -v suite="$SUITE" '
            function flush() {
                if (uris != "" && ok && types ~ /(^|[ \t])deb([ \t]|$)/) { split(uris, u, /[ \t]+/); print u[1]; found = 1; exit }
                uris = ""; ok = 0; types = "deb"
            }
            BEGIN { types = "deb" }
            /^[ \t]*#/ { next }
            /^[ \t]*$/ { flush(); next }
            tolower($1) == "uris:"   { sub(/^[^:]*:[ \t]*/, ""); uris = $0 }
            tolower($1) == "types:"  { sub(/^[^:]*:[ \t]*/, ""); types = $0 }
            tolower($1) == "suites:" { for (i = 2; i <= NF; i++) if ($i == suite) ok = 1 }
            END { if (!found) flush() }
        ' "$f" | head -n1
    done | head -n1 | grep . && return
    # one-line format
    for f in /etc/apt/sources.list /etc/apt/sources.list.d/*.list; do
        [ -f "$f" ] || continue
        awk -v suite="$SUITE" '
            $1 == "deb" {
                i = 2
                if ($i ~ /^\[/) { while (i <= NF && $i !~ /\]$/) i++; i++ }
                if ($(i + 1) == suite) { print $i; exit }
            }' "$f"
    done | head -n1 | grep . && return
    return 1
}

MIRROR=$(find_mirror) || die "no Debian $SUITE mirror found in /etc/apt/sources.list{,.d}; set LAMINA_DEBIAN_MIRROR"
MIRROR=${MIRROR%/}
log "mirror: $MIRROR"

TMP="$OUTDIR.tmp"
BUNDLE="$OUTDIR.bundle"
ROOTFS="$BUNDLE/rootfs"

MOUNTED=()
cleanup_mounts() {
    local i
    for ((i = ${#MOUNTED[@]} - 1; i >= 0; i--)); do
        umount "${MOUNTED[$i]}" 2>/dev/null || umount -l "${MOUNTED[$i]}" 2>/dev/null || true
    done
    MOUNTED=()
}
on_exit() {
    local rc=$?
    cleanup_mounts
    if [ $rc -ne 0 ]; then
        log "FAILED (rc=$rc); partial build left in $TMP and $BUNDLE"
    fi
}
trap on_exit EXIT

now() { date +%s.%N; }
T0=$(now)
PHASE_T=$T0
phase_done() {
    local t
    t=$(now)
    log "$(printf '%-28s %7.1fs' "$1" "$(awk "BEGIN{print $t - $PHASE_T}")")"
    PHASE_T=$t
}

# rm -rf that refuses to descend into anything still mounted (a leftover bind
# mount of /dev under an old bundle must never be emptied)
safe_rm() {
    local p m
    for p in "$@"; do
        [ -e "$p" ] || continue
        p=$(realpath "$p")
        while read -r m; do
            umount "$m" 2>/dev/null || umount -l "$m" || die "cannot unmount $m"
        done < <(awk -v p="$p/" 'index($2 "/", p) == 1 { print $2 }' /proc/self/mounts | sort -r)
        rm -rf --one-file-system "$p"
    done
}

safe_rm "$TMP" "$BUNDLE" "$BUNDLE.debootstrap.log" "$BUNDLE.apt.log"
mkdir -p "$(dirname "$OUTDIR")"
# An incomplete OUTDIR (no marker) is stale: rebuilt from scratch.
if [ -e "$OUTDIR" ]; then
    log "removing incomplete $OUTDIR"
    safe_rm "$OUTDIR"
fi

umoci init --layout "$TMP"
umoci new --image "$TMP:$TAG"
umoci config --image "$TMP:$TAG" \
    --config.cmd /bin/bash \
    --config.env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    --author lamina-tests
umoci unpack --image "$TMP:$TAG" "$BUNDLE"
phase_done "umoci init/new/unpack"

# Downloaded packages and index files do not belong in the image (they would
# make it ~3x larger); removed before every repack.
clean_apt() {
    rm -f "$ROOTFS"/var/cache/apt/archives/*.deb "$ROOTFS"/var/cache/apt/archives/partial/*
    find "$ROOTFS"/var/lib/apt/lists -mindepth 1 \( -type f -o -type l \) -delete
    rm -f "$ROOTFS"/var/cache/apt/*.bin
}

# --- layer 1: debootstrap minbase --------------------------------------------
log "debootstrap --variant=minbase $SUITE (downloads ~30 MB)"
debootstrap_log="$BUNDLE.debootstrap.log"
if ! debootstrap --variant=minbase "$SUITE" "$ROOTFS" "$MIRROR" >"$debootstrap_log" 2>&1; then
    tail -n 30 "$debootstrap_log" >&2
    [ -f "$ROOTFS/debootstrap/debootstrap.log" ] && tail -n 30 "$ROOTFS/debootstrap/debootstrap.log" >&2
    die "debootstrap failed"
fi
rm -f "$debootstrap_log"
clean_apt
phase_done "debootstrap"
umoci repack --refresh-bundle --image "$TMP:$TAG" --history.created_by "debootstrap --variant=minbase $SUITE" "$BUNDLE"
phase_done "umoci repack (layer 1)"

# --- layer 2: packages installed in a chroot ----------------------------------
chroot_mount() { # fstype source target [opts]
    mkdir -p "$3"
    if [ "$1" = bind ]; then
        mount --bind "$2" "$3"
    else
        mount -t "$1" "$2" "$3"
    fi
    MOUNTED+=("$3")
}
chroot_mount proc proc "$ROOTFS/proc"
chroot_mount sysfs sysfs "$ROOTFS/sys"
chroot_mount bind /dev "$ROOTFS/dev"
chroot_mount devpts devpts "$ROOTFS/dev/pts"

printf '#!/bin/sh\nexit 101\n' >"$ROOTFS/usr/sbin/policy-rc.d"
chmod 0755 "$ROOTFS/usr/sbin/policy-rc.d"

apt_log="$BUNDLE.apt.log"
log "apt-get install $PACKAGES (downloads ~30 MB)"
if ! chroot "$ROOTFS" /usr/bin/env -i \
    PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    DEBIAN_FRONTEND=noninteractive LC_ALL=C HOME=/root \
    sh -c "apt-get update -q && apt-get install -y -q --no-install-recommends $PACKAGES" \
    >"$apt_log" 2>&1; then
    tail -n 40 "$apt_log" >&2
    die "apt-get install in chroot failed"
fi
rm -f "$apt_log"
phase_done "apt-get install"

cleanup_mounts
# Nothing must stay mounted inside the rootfs before repacking.
if grep -q " $ROOTFS/" /proc/self/mounts; then
    die "something is still mounted under $ROOTFS"
fi
rm -f "$ROOTFS/usr/sbin/policy-rc.d"
clean_apt
umoci repack --image "$TMP:$TAG" --history.created_by "apt-get install --no-install-recommends $PACKAGES" "$BUNDLE"
phase_done "umoci repack (layer 2)"

umoci gc --layout "$TMP"
safe_rm "$BUNDLE"
chmod -R a+rX "$TMP" # umoci writes index.json 0600; tests may read it unprivileged
touch "$TMP/.complete"
mv "$TMP" "$OUTDIR"
phase_done "umoci gc + finish"

# --- summary -------------------------------------------------------------------
manifest=$(jq -r --arg t "$TAG" \
    '.manifests[] | select(.annotations["org.opencontainers.image.ref.name"] == $t) | .digest' \
    "$OUTDIR/index.json")
log "manifest $manifest"
jq -r '.layers[] | "\(.digest) \(.size) \(.mediaType)"' "$OUTDIR/blobs/sha256/${manifest#sha256:}" |
    while read -r d s m; do log "layer $d $s bytes ($m)"; done
log "$(printf 'total %.1fs' "$(awk "BEGIN{print $(now) - $T0}")")"
log "done: $OUTDIR:$TAG"
