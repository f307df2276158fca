#!/usr/bin/env bash
# lamina cold-start benchmark: time from "start" to the first useful output of a
# container of the reference Debian image, pulled over a shaped link, with
#   - containerd 1.6 (full pull + unpack, then `ctr run`),
#   - lamina (lazy mount + overlayfs + `runc run`), without a boot set,
#   - lamina with a boot set recorded for the workload (`convert --prefetch`),
#   - lamina snapshotter under the same containerd (`ctr-remote image rpull`,
#     then `ctr-remote run`), with and without the boot set,
#   - `lamina run`, with and without the boot set,
# at several link rates, for python3 / nginx / redis-server; and the idle
# memory of the snapshotter with 20 images mounted. See docs/coldstart.md for
# the method.
#
# Usage: scripts/coldstart.sh [--links 1gbit,100mbit,10mbit] [--runs N]
#                             [--workloads python,nginx,redis] [--out FILE]
#                             [--variants V,...] [--idle-images N] [--readall-runs N]
#                             [--slow-runs M] [--plot FILE | --no-plot]
#                             [--max-minutes T] [--containerd BIN] [--keep-logs DIR]
#   --links L      tc rates of the shaped link (tbf on the namespace's lo)
#   --runs N       runs per link, workload and variant (default 3)
#   --slow-runs M  containerd runs on links slower than 100mbit (default 1: a
#                  75 MB pull at 10mbit takes over a minute)
#   --workloads W  python (python3 -c 'print("hello")'), nginx (first HTTP 200),
#                  redis (first +PONG), readall (every file read, then "hello";
#                  no boot set, links of 100mbit and more only)
#                  datasci, node: the heavy images of scripts/heavy-image.sh
#                  (built or reused here): a Python data-science start
#                  (imports numpy, pandas, scipy, scikit-learn, pyarrow,
#                  statsmodels, matplotlib) and a Node.js start that requires
#                  8 npm packages; with variants containerd, lamina,
#                  lamina-boot and local only (local: the same start from the
#                  image unpacked on local disk, page cache dropped)
#   --readall-runs N  runs of readall per link and variant (default 1)
#   --variants V   of containerd, lamina, lamina-boot, snapshotter,
#                  snapshotter-boot, run, run-boot, proxy, faults,
#                  faults-nohedge, index, index-boot (default: all but the index ones;
#                  faults: lamina mount through the demo's fault mix, with
#                  hedging and with --no-hedge; proxy: through the same
#                  proxy, spoiling nothing; index: `lamina mount` of the
#                  unmodified image's own tag through its tar index, made by
#                  `lamina index` beside it; index-boot: the same through an
#                  index with boot pages from a trace of the workload;
#                  docker-index: dockerd (containerd image store, storage
#                  driver lamina) pulls and runs the unmodified tag, python only)
#   --idle-images N  images mounted for the idle footprint (default 20; 0: skip)
#   --out FILE     JSON results (default docs/coldstart-results.json)
#   --plot FILE    chart (default: coldstart.png next to --out); --no-plot to skip
#   --max-minutes  hard limit for the measurements (default 45); the script
#                  cleans up and fails when it is reached
#   --containerd BIN  the containerd to measure (default: containerd on PATH,
#                  Debian's 1.6); its directory goes first on PATH, so its own
#                  ctr and shim are used too (e.g. a 2.x built by setup.sh)
#   --keep-logs DIR   containerd at debug level and every snapshotter (with its
#                  mounts' daemons) at LAMINA_LOG=debug; their logs are copied
#                  to DIR, one sub-directory per snapshotter run
# To try a setting: COLDSTART_MOUNT_ARGS (more `lamina mount` options for the
# lamina variants) and COLDSTART_CONVERT_ARGS (more `lamina convert` options),
# e.g. COLDSTART_CONVERT_ARGS="--chunk-size 64K".
# With the default --out, the tables in docs/coldstart.md are regenerated too
# (scripts/coldstart_report.py prints them for any result file).
#
# Must run as root. Creates the network namespace lamina-cs-$$ (lo with mtu
# 1500 and a tbf qdisc at the link rate) and runs a docker-registry in it, as
# well as every client of that registry (skopeo, lamina, `ctr image pull`);
# containerd itself is a private instance on the host (its own
# root/state/socket under the work dir). Everything (containers,
# mounts, lamina daemons, containerd, registry, namespace, work dir under /tmp)
# is removed on exit, also on failure or Ctrl-C. Takes ~35 minutes with
# the defaults. Drops the page cache before every run.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
LINKS=1gbit,100mbit,10mbit
RUNS=3
SLOW_RUNS=1
WORKLOADS=python,nginx,redis,readall
READALL_RUNS=1
OUT="$ROOT/docs/coldstart-results.json"
PLOT=
NO_PLOT=0
MAX_MINUTES=60
VARIANTS=containerd,lamina,lamina-boot,snapshotter,snapshotter-boot,run,run-boot,proxy,faults,faults-nohedge,local
IDLE_IMAGES=20
CONTAINERD_BIN=
KEEP_LOGS=

log() { printf '[coldstart] %s\n' "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }
usage() { sed -n '2,44p' "$0" | sed 's/^# \{0,1\}//'; exit "${1:-0}"; }

while [ $# -gt 0 ]; do
    case "$1" in
    --links) LINKS=${2:?}; shift 2 ;;
    --runs) RUNS=${2:?}; shift 2 ;;
    --slow-runs) SLOW_RUNS=${2:?}; shift 2 ;;
    --workloads) WORKLOADS=${2:?}; shift 2 ;;
    --out) OUT=${2:?}; shift 2 ;;
    --variants) VARIANTS=${2:?}; shift 2 ;;
    --readall-runs) READALL_RUNS=${2:?}; shift 2 ;;
    --idle-images) IDLE_IMAGES=${2:?}; shift 2 ;;
    --plot) PLOT=${2:?}; shift 2 ;;
    --no-plot) NO_PLOT=1; shift ;;
    --max-minutes) MAX_MINUTES=${2:?}; shift 2 ;;
    --containerd) CONTAINERD_BIN=${2:?}; shift 2 ;;
    --keep-logs) KEEP_LOGS=${2:?}; shift 2 ;;
    -h | --help) usage 0 ;;
    *) log "unknown argument: $1"; usage 2 ;;
    esac
done
[[ "$RUNS" =~ ^[1-9][0-9]*$ ]] || die "--runs wants a positive integer"
[[ "$SLOW_RUNS" =~ ^[1-9][0-9]*$ ]] || die "--slow-runs wants a positive integer"
[[ "$MAX_MINUTES" =~ ^[1-9][0-9]*$ ]] || die "--max-minutes wants a positive integer"
[[ "$LINKS" =~ ^[0-9]+[kmg]bit(,[0-9]+[kmg]bit)*$ ]] || die "--links wants rates like 1gbit,100mbit,10mbit"
[[ "$IDLE_IMAGES" =~ ^[0-9]+$ ]] || die "--idle-images wants a number"
V='(containerd|lamina|lamina-boot|snapshotter|snapshotter-boot|run|run-boot|proxy|faults|faults-nohedge|local|index|index-boot|docker-index)'
[[ "$VARIANTS" =~ ^$V(,$V)*$ ]] ||
    die "--variants: containerd, lamina, lamina-boot, snapshotter, snapshotter-boot, run, run-boot, proxy, faults, faults-nohedge, local, index, index-boot, docker-index"
W='(python|nginx|redis|readall|datasci|node)'
[[ "$WORKLOADS" =~ ^$W(,$W)*$ ]] || die "--workloads: python, nginx, redis, readall, datasci, node"
[[ "$READALL_RUNS" =~ ^[1-9][0-9]*$ ]] || die "--readall-runs wants a positive integer"
mkdir -p "$(dirname "$OUT")"
OUT=$(cd "$(dirname "$OUT")" && pwd)/$(basename "$OUT")
[ -n "$PLOT" ] || PLOT="$(dirname "$OUT")/coldstart.png"

if [ -n "$CONTAINERD_BIN" ]; then
    [ -x "$CONTAINERD_BIN" ] || die "--containerd: $CONTAINERD_BIN is not an executable"
    PATH="$(cd "$(dirname "$CONTAINERD_BIN")" && pwd):$PATH"
    [ "$(command -v containerd)" -ef "$CONTAINERD_BIN" ] || die "--containerd: the binary must be named containerd"
fi
if [ -n "$KEEP_LOGS" ]; then
    mkdir -p "$KEEP_LOGS"
    KEEP_LOGS=$(cd "$KEEP_LOGS" && pwd)
fi
[ "$(id -u)" = 0 ] || die "must run as root (namespaces, mounts, containers, drop_caches)"
PY=/usr/bin/python3
[ -x "$PY" ] || PY=$(command -v python3) || die "missing python3"
for tool in ip tc nsenter containerd ctr ctr-remote runc skopeo docker-registry jq curl findmnt; do
    command -v "$tool" >/dev/null || die "missing tool: $tool (run scripts/setup.sh)"
done
command -v containerd-shim-runc-v2 >/dev/null || die "missing containerd-shim-runc-v2 (Debian package containerd)"

# shellcheck source=scripts/bench_common.sh
. "$ROOT/scripts/bench_common.sh"
bench_prereqs

NS=lamina-cs-$$
NSPATH=/run/netns/$NS
ID=lamina-cs-$$ # prefix of every runc / ctr container id
WORK=$(mktemp -d /tmp/lamina-coldstart.XXXXXX)
REG="$WORK/registry"
CTD="$WORK/containerd"
CTD_SOCK="$CTD/containerd.sock"
SNAP_SOCK="$WORK/snapshotter.sock" # lamina snapshotter: one per run, always on this socket
CTD_PID=
DRIVER_PID=

# wait (up to $1 tenths of a second) until pid $2 has exited
wait_pid_gone() {
    local i
    for ((i = 0; i < $1; i++)); do
        [ -e "/proc/$2" ] || return 0
        sleep 0.1
    done
    return 1
}

cleanup() {
    local rc=$? m c n pids
    trap '' INT TERM # a second Ctrl-C must not cut the cleanup short
    set +e
    [ -n "$KEEP_LOGS" ] && [ -f "$CTD/containerd.log" ] && cp "$CTD/containerd.log" "$KEEP_LOGS/"
    # the measurement driver first (it cleans up its own run on SIGTERM)
    if [ -n "$DRIVER_PID" ] && [ -e "/proc/$DRIVER_PID" ]; then
        kill -TERM "$DRIVER_PID" 2>/dev/null
        wait_pid_gone 150 "$DRIVER_PID" || kill -KILL "$DRIVER_PID" 2>/dev/null
    fi
    # runc containers of this run
    for c in $(runc list -q 2>/dev/null | grep "^$ID-"); do
        runc delete --force "$c" >/dev/null 2>&1 || log "warning: runc delete $c failed"
    done
    # containerd: kill every task, remove containers, then stop the daemon
    if [ -n "$CTD_PID" ] && [ -e "/proc/$CTD_PID" ]; then
        for n in $(ctr --address "$CTD_SOCK" namespaces ls -q 2>/dev/null); do
            for c in $(ctr --address "$CTD_SOCK" -n "$n" tasks ls -q 2>/dev/null); do
                ctr --address "$CTD_SOCK" -n "$n" tasks kill -s SIGKILL "$c" >/dev/null 2>&1
                timeout 20 ctr --address "$CTD_SOCK" -n "$n" tasks delete -f "$c" >/dev/null 2>&1
            done
            for c in $(ctr --address "$CTD_SOCK" -n "$n" containers ls -q 2>/dev/null); do
                timeout 20 ctr --address "$CTD_SOCK" -n "$n" containers rm "$c" >/dev/null 2>&1
            done
        done
        kill -TERM "$CTD_PID" 2>/dev/null
        wait_pid_gone 100 "$CTD_PID" || kill -KILL "$CTD_PID" 2>/dev/null
    fi
    # overlays, then lamina mounts through lamina (stops their daemons), then
    # whatever else is mounted below $WORK, deepest first
    while read -r m; do
        umount "$m" 2>/dev/null || umount -l "$m" 2>/dev/null
    done < <(awk -v p="$WORK/" 'index($2, p) == 1 && $3 == "overlay" { print $2 }' /proc/self/mounts | sort -r)
    while read -r m; do
        "$WORK/lamina" umount "$m" >/dev/null 2>&1 || umount -l "$m" 2>/dev/null
    done < <(awk -v p="$WORK/" 'index($2, p) == 1 && $3 == "erofs" { print $2 }' /proc/self/mounts | sort -r)
    while read -r m; do
        umount "$m" 2>/dev/null || umount -l "$m" 2>/dev/null || log "warning: cannot unmount $m"
    done < <(awk -v p="$WORK/" 'index($2, p) == 1 { print $2 }' /proc/self/mounts | sort -r)
    [ -d "$REG" ] && bash "$ROOT/tests/tools/registry.sh" stop "$REG"
    # lamina daemons (they run the private copy $WORK/lamina) and shims of our containerd
    for _ in $(seq 100); do
        pgrep -f "$WORK/" >/dev/null || break
        sleep 0.1
    done
    pids=$(pgrep -f "$WORK/")
    if [ -n "$pids" ]; then
        log "warning: killing leftover processes: $pids"
        for p in $pids; do kill -KILL "$p" 2>/dev/null; done
    fi
    if [ -e "$NSPATH" ]; then
        ip netns delete "$NS" || log "warning: cannot delete network namespace $NS"
    fi
    if awk -v p="$WORK/" 'index($2, p) == 1 { found = 1 } END { exit !found }' /proc/self/mounts; then
        log "warning: something is still mounted under $WORK; left in place"
    else
        rm -rf --one-file-system "$WORK"
    fi
    if [ $rc -eq 0 ]; then
        log "cleaned up (containers, mounts, containerd, registry, namespace $NS, $WORK)"
    else
        log "FAILED (rc=$rc); cleaned up"
    fi
}
trap cleanup EXIT
trap 'exit 130' INT TERM

log "work dir $WORK, network namespace $NS"
# measure a private copy: a rebuild of target/release/lamina during the run
# must not change the binary under test (the daemons re-exec it)
cp "$LAMINA" "$WORK/lamina"
export LAMINA_BENCH_BINARY_SOURCE="$LAMINA"

# ---- network namespace and registry -------------------------------------------------
ip netns add "$NS"
nsenter --net="$NSPATH" ip link set lo mtu 1500 up
# the registry and every process talking to it run in the namespace: started
# through nsenter, registry.sh picks its port and checks it from inside
PORT=$(nsenter --net="$NSPATH" bash "$ROOT/tests/tools/registry.sh" start "$REG")
REG_PID=$(cat "$REG/pid")
log "registry 127.0.0.1:$PORT in $NS (pid $REG_PID)"

# ---- private containerd (host network namespace) -----------------------------------
mkdir -p "$CTD"
# A minimal config of containerd's own version (2 for 1.x, 3 for 2.x): no
# CRI, everything under $CTD, lamina as a proxy snapshotter.
if containerd --version | grep -q " v2\."; then CTD_CONFIG_VERSION=3; else CTD_CONFIG_VERSION=2; fi
cat >"$CTD/config.toml" <<EOF
version = $CTD_CONFIG_VERSION
root = "$CTD/root"
state = "$CTD/state"
disabled_plugins = ["io.containerd.grpc.v1.cri"]

[grpc]
  address = "$CTD_SOCK"

[ttrpc]
  address = "$CTD_SOCK.ttrpc"

[debug]
  level = "$([ -n "$KEEP_LOGS" ] && echo debug || echo info)"

[plugins."io.containerd.internal.v1.opt"]
  path = "$CTD/opt"

[proxy_plugins.lamina]
  type = "snapshot"
  address = "$SNAP_SOCK"
EOF
setsid containerd --config "$CTD/config.toml" >"$CTD/containerd.log" 2>&1 </dev/null &
CTD_PID=$!
for _ in $(seq 100); do
    ctr --address "$CTD_SOCK" version >/dev/null 2>&1 && break
    [ -e "/proc/$CTD_PID" ] || { tail -n 20 "$CTD/containerd.log" >&2; die "containerd exited"; }
    sleep 0.1
done
ctr --address "$CTD_SOCK" version >/dev/null 2>&1 || die "containerd did not answer on $CTD_SOCK"
log "containerd $(containerd --version | awk '{print $3}') on $CTD_SOCK (pid $CTD_PID)"

HEAVY_DIR=/var/cache/lamina-test/heavy-oci
if [[ ",$WORKLOADS," =~ ,(datasci|node), ]]; then
    bash "$ROOT/scripts/heavy-image.sh" "$HEAVY_DIR"
fi

# ---- measurements --------------------------------------------------------------------
"$PY" "$ROOT/scripts/coldstart_run.py" \
    --lamina "$WORK/lamina" --image "$IMAGE_DIR:bookworm" --heavy "$HEAVY_DIR" --work "$WORK" --id "$ID" \
    --netns "$NSPATH" --registry "127.0.0.1:$PORT" --registry-pid "$REG_PID" \
    --containerd-sock "$CTD_SOCK" --containerd-root "$CTD/root" --snapshotter-sock "$SNAP_SOCK" \
    --variants "$VARIANTS" --idle-images "$IDLE_IMAGES" --readall-runs "$READALL_RUNS" \
    --links "$LINKS" --runs "$RUNS" --slow-runs "$SLOW_RUNS" --workloads "$WORKLOADS" \
    --max-seconds $((MAX_MINUTES * 60)) --out "$OUT" ${KEEP_LOGS:+--keep-logs "$KEEP_LOGS"} &
DRIVER_PID=$!
wait "$DRIVER_PID"
DRIVER_PID=
log "results: $OUT"

if [ "$NO_PLOT" = 0 ]; then
    "$PY" "$ROOT/scripts/coldstart_plot.py" "$OUT" "$PLOT"
    log "plot: $PLOT"
fi

# results written to the default place: refresh the tables in docs/coldstart.md
DOC="$ROOT/docs/coldstart.md"
if [ "$OUT" = "$ROOT/docs/coldstart-results.json" ] && [ -f "$DOC" ] && grep -q 'coldstart-tables:begin' "$DOC"; then
    "$PY" "$ROOT/scripts/coldstart_report.py" "$OUT" --update "$DOC"
    log "tables updated in $DOC"
fi
