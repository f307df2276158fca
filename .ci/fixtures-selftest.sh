#!/usr/bin/env bash
# Self-test of the test infrastructure (no Rust involved). Run as root.
#
# Usage: .ci/fixtures-selftest.sh [WORKDIR]     (default: a fresh mktemp dir, removed on success)
#
# Checks:
#  * mkimage.py all is deterministic (two runs, identical bytes);
#  * umoci 0.4.7 refuses tar+zstd (edge) and unpacks edge-gz;
#  * the reference unpacker (tests/tools/ociunpack.py) on edge, edge-gz and
#    edge.docker.tar gives the same tree, equal to umoci's except the known
#    umoci quirk (empty xattr values dropped);
#  * treecmp finds nothing comparing a tree with itself and reports injected
#    changes (mode, xattr, owner, hard link, content);
#  * hostile images: the reference unpacker's outcome is in each tag's
#    "acceptable" list and nothing named lamina-escape* appears outside the
#    unpack roots;
#  * registry.sh start/stop, and a byte-exact skopeo push/pull of edge.
set -euo pipefail

here=$(cd "$(dirname "$0")/.." && pwd)
mk="python3 $here/tests/fixtures/mkimage.py"
unpack="python3 $here/tests/tools/ociunpack.py"
treecmp="python3 $here/tests/tools/treecmp.py"
registry="$here/tests/tools/registry.sh"

[ "$(id -u)" = 0 ] || { echo "must run as root" >&2; exit 1; }

if [ $# -ge 1 ]; then
    W=$1
    rm -rf "$W"
    mkdir -p "$W"
    keep=1
else
    W=$(mktemp -d /tmp/lamina-selftest.XXXXXX)
    keep=0
fi
fail=0
ok() { printf 'ok   %s\n' "$*"; }
bad() { printf 'FAIL %s\n' "$*"; fail=1; }
cleanup() {
    "$registry" stop "$W/reg" >/dev/null 2>&1 || true
    if [ $fail = 0 ] && [ $keep = 0 ]; then rm -rf "$W"; else echo "work dir kept: $W"; fi
}
trap cleanup EXIT

# --- fixtures + determinism
$mk all "$W/fx" >"$W/fx.json"
$mk all "$W/fx2" >/dev/null
if diff <(cd "$W/fx" && find . -type f | sort | xargs sha256sum) \
        <(cd "$W/fx2" && find . -type f | sort | xargs sha256sum) >/dev/null; then
    ok "mkimage.py is deterministic"
else
    bad "mkimage.py output differs between two runs"
fi
rm -rf "$W/fx2"

# --- umoci
if umoci unpack --image "$W/fx/edge:edge" "$W/umoci-zstd" >/dev/null 2>"$W/umoci-zstd.err"; then
    ok "umoci unpacks tar+zstd (newer umoci?): edge-gz no longer required"
else
    grep -q 'not correct mediatype' "$W/umoci-zstd.err" && ok "umoci refuses tar+zstd as expected (edge-gz is the umoci variant)" \
        || bad "umoci failed on edge for an unexpected reason: $(tail -c 300 "$W/umoci-zstd.err")"
fi
umoci unpack --image "$W/fx/edge:edge-gz" "$W/umoci" >/dev/null 2>&1 && ok "umoci unpack edge-gz" || bad "umoci unpack edge-gz"

# --- reference unpacker
$unpack "$W/fx/edge:edge" "$W/ref" && ok "ociunpack edge" || bad "ociunpack edge"
$unpack "$W/fx/edge:edge-gz" "$W/ref-gz" && ok "ociunpack edge-gz" || bad "ociunpack edge-gz"
$unpack --docker-archive "$W/fx/edge/edge.docker.tar" "$W/ref-docker" && ok "ociunpack edge.docker.tar" || bad "ociunpack docker archive"

expect_equal() { # label A B [treecmp options]
    local label=$1 a=$2 b=$3
    shift 3
    if out=$($treecmp "$@" "$a" "$b" 2>&1); then ok "$label: ${out##*$'\n'}"; else bad "$label"; echo "$out" | head -20; fi
}
expect_equal "treecmp self" "$W/ref" "$W/ref"
expect_equal "edge == edge-gz" "$W/ref" "$W/ref-gz"
expect_equal "edge == docker archive" "$W/ref" "$W/ref-docker"
expect_equal "reference == umoci (minus empty xattr quirk)" "$W/ref" "$W/umoci/rootfs" --ignore-xattr user.empty --ignore-xattr trusted.empty

# --- treecmp must see injected changes
cp -a "$W/ref" "$W/perturbed"
chmod 0600 "$W/perturbed/files/small"
setfattr -n user.test -v changed "$W/perturbed/xattrs/user"
chown 1:1 "$W/perturbed/owners/user"
ln "$W/perturbed/files/empty" "$W/perturbed/files/new-hardlink"
printf 'edgE\n' >"$W/perturbed/etc/hostname"  # same size, same inode, mtime restored
touch -d @1700000000 "$W/perturbed/etc/hostname"
out=$($treecmp "$W/ref" "$W/perturbed" || true)
for want in "files/small: mode: A=0644 B=0600" "xattrs/user: xattr user.test" "owners/user: uid: A=1000 B=1" \
    "files/new-hardlink: only in B" "files/empty: hardlinks" "etc/hostname: content"; do
    grep -qF "$want" <<<"$out" && ok "treecmp reports '$want'" || { bad "treecmp missed '$want'"; echo "$out"; }
done

# --- hostile
mkdir -p "$W/hostile-run"
for tag in $(jq -r '.hostile.images[].tag' "$W/fx.json"); do
    acceptable=$(jq -r --arg t "$tag" '.hostile.images[] | select(.tag == $t) | .acceptable | join(",")' "$W/fx.json")
    mkdir -p "$W/hostile-run/$tag/a/b"
    if $unpack "$W/fx/hostile:$tag" "$W/hostile-run/$tag/a/b/root" 2>"$W/hostile-run/$tag.err"; then
        res=confine
    else
        res=refuse
    fi
    case ",$acceptable," in
    *",$res,"*) ok "hostile $tag: acceptable=$acceptable reference unpacker: $res" ;;
    *) bad "hostile $tag: reference unpacker did '$res', acceptable: $acceptable" ;;
    esac
    (cd "$W/fx/hostile" && umoci unpack --image "$W/fx/hostile:$tag" "$W/hostile-run/$tag/a/b/umoci" >/dev/null 2>&1) || true
done
escaped=$( (find "$W" \( -name 'lamina-escape*' -o -name 'escape-traversal*' \) \
    -not -path "$W/hostile-run/*/a/b/root/*" -not -path "$W/hostile-run/*/a/b/umoci/rootfs/*";
    ls -d /lamina-escape* /escape-traversal* /tmp/lamina-escape* /tmp/escape-traversal* /etc/lamina-escape*) 2>/dev/null || true)
[ -z "$escaped" ] && ok "no hostile file escaped" || bad "escaped files: $escaped"

# --- registry round trip
if port=$("$registry" start "$W/reg"); then
    ok "registry on 127.0.0.1:$port"
    want=$(jq -r '.manifests[] | select(.annotations["org.opencontainers.image.ref.name"] == "edge") | .digest' "$W/fx/edge/index.json")
    skopeo copy -q --preserve-digests --dest-tls-verify=false "oci:$W/fx/edge:edge" "docker://127.0.0.1:$port/edge:latest"
    got=$(skopeo inspect --tls-verify=false "docker://127.0.0.1:$port/edge:latest" | jq -r .Digest)
    [ "$got" = "$want" ] && ok "skopeo push keeps manifest digest $want" || bad "pushed digest $got != $want"
    "$registry" stop "$W/reg"
    "$registry" status "$W/reg" >/dev/null && bad "registry still running after stop" || ok "registry stopped"
else
    bad "registry start"
fi

[ $fail = 0 ] && echo "selftest: all passed" || echo "selftest: FAILURES"
exit $fail
