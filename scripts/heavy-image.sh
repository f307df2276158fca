#!/usr/bin/env bash
# Build the heavy images of the cold-start benchmark (issue 29) on top of the
# reference Debian image (scripts/debian-image.sh), as tags of one OCI layout:
#   datasci  + one layer: large Python packages from PyPI (numpy, pandas,
#            scipy, scikit-learn, matplotlib, pyarrow, sympy, statsmodels and
#            what they need), wheels for the image's python3.11 unpacked into
#            /usr/local/lib/python3.11/dist-packages
#   node     + one layer: this machine's Node.js (/opt/node, with the two
#            C++ runtime libraries it links, /opt/node/lib) and packages from
#            the npm registry with thousands of small files (/opt/app)
#
# Usage: scripts/heavy-image.sh [OUTDIR]   (default /var/cache/lamina-test/heavy-oci)
#
# Versions are pinned here. Caching as debian-image.sh: a complete OUTDIR
# (".complete" marker) is left alone; the layout is built in OUTDIR.tmp and
# renamed at the end. Must run as root (the base image's build).
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
OUTDIR=${1:-/var/cache/lamina-test/heavy-oci}
OUTDIR=${OUTDIR%/}
BASE=/var/cache/lamina-test/debian-oci
# Every wheel, pinned (the packages and what pip resolved for them).
WHEELS="numpy==1.26.4 pandas==2.2.2 scipy==1.13.1 scikit-learn==1.5.0 matplotlib==3.9.0 pyarrow==16.1.0
sympy==1.12.1 statsmodels==0.14.2 contourpy==1.3.3 cycler==0.12.1 fonttools==4.68.0 joblib==1.6.0
kiwisolver==1.5.1 mpmath==1.3.0 packaging==26.4 patsy==1.0.3 pillow==13.0.0 pyparsing==3.3.3
python-dateutil==4.0.0 pytz==2026.6 threadpoolctl==3.8.0 tzdata==2026.6 cloudpickle==3.1.3"
NPM_PACKAGES='{"express": "4.21.2", "lodash": "4.17.21", "moment": "2.30.1", "axios": "1.7.9",
"@babel/core": "7.26.0", "rxjs": "7.8.1", "date-fns": "4.1.0", "typescript": "5.7.2"}'

log() { printf '[heavy-image] %s\n' "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }

[ "$(id -u)" = 0 ] || die "must run as root"
for tool in umoci jq pip3 npm node tar; do
    command -v "$tool" >/dev/null || die "missing tool: $tool (run scripts/setup.sh)"
done
if [ -f "$OUTDIR/.complete" ]; then
    log "cached: $OUTDIR is complete; nothing to do"
    exit 0
fi
bash "$ROOT/scripts/debian-image.sh" "$BASE"

TMP=$(mktemp -d /tmp/lamina-heavy.XXXXXX)
trap 'rm -rf "$TMP" "$OUTDIR.tmp"' EXIT
rm -rf "$OUTDIR.tmp"
cp -a "$BASE" "$OUTDIR.tmp"
rm -f "$OUTDIR.tmp/.complete"

# A layer from a staged tree: root-owned, one fixed mtime, sorted.
layer() {
    tar --sort=name --owner=0 --group=0 --numeric-owner --mtime=@1700000000 -C "$1" -cf "$2" .
}

log "datasci: downloading wheels for python 3.11"
# shellcheck disable=SC2086 # one argument per pinned wheel
pip3 download --quiet --no-deps --only-binary=:all: --python-version 3.11 --implementation cp \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 \
    --platform any -d "$TMP/wheels" $WHEELS
python3 - "$TMP/wheels" "$TMP/datasci/usr/local/lib/python3.11/dist-packages" <<'EOF'
import os, sys, zipfile
src, dst = sys.argv[1], sys.argv[2]
os.makedirs(dst)
for name in sorted(os.listdir(src)):
    with zipfile.ZipFile(os.path.join(src, name)) as z:
        for info in z.infolist():
            # A wheel's .data/ (scripts, headers) is not importable code.
            top = info.filename.split("/", 1)[0]
            if top.endswith(".data") or info.filename.startswith("/") or ".." in info.filename.split("/"):
                continue
            z.extract(info, dst)
            mode = (info.external_attr >> 16) & 0o777
            path = os.path.join(dst, info.filename)
            if not info.is_dir():
                os.chmod(path, 0o755 if mode & 0o111 else 0o644)
EOF
chmod -R u+rwX,go+rX "$TMP/datasci"
layer "$TMP/datasci" "$TMP/datasci.tar"
umoci raw add-layer --image "$OUTDIR.tmp:bookworm" --tag datasci "$TMP/datasci.tar"

log "node: $(node --version) and npm packages"
NODE=$(readlink -f "$(command -v node)")
mkdir -p "$TMP/node/opt/node/bin" "$TMP/node/opt/node/lib" "$TMP/node/opt/app"
cp "$NODE" "$TMP/node/opt/node/bin/node"
for lib in libstdc++.so.6 libgcc_s.so.1; do
    cp -L "$(ldd "$NODE" | awk -v l="$lib" '$1 == l { print $3 }')" "$TMP/node/opt/node/lib/$lib"
done
jq -n --argjson deps "$NPM_PACKAGES" '{name: "heavy", version: "1.0.0", private: true, dependencies: $deps}' \
    >"$TMP/node/opt/app/package.json"
(cd "$TMP/node/opt/app" && npm install --silent --no-audit --no-fund --ignore-scripts --omit=dev >/dev/null)
chmod -R u+rwX,go+rX "$TMP/node"
layer "$TMP/node" "$TMP/node.tar"
umoci raw add-layer --image "$OUTDIR.tmp:bookworm" --tag node "$TMP/node.tar"
log "node: $(find "$TMP/node/opt/app/node_modules" -type f | wc -l) files in node_modules"

umoci gc --layout "$OUTDIR.tmp"
touch "$OUTDIR.tmp/.complete"
rm -rf "$OUTDIR"
mv "$OUTDIR.tmp" "$OUTDIR"
log "done: $OUTDIR (tags bookworm, datasci, node)"
