#!/usr/bin/env bash
# Throw-away local OCI registry (Debian's docker-registry) for tests.
#
# Usage:
#   tests/tools/registry.sh start DIR [PORT]  # prints the port; DIR/port, DIR/pid, DIR/config.yml, DIR/registry.log
#   tests/tools/registry.sh stop DIR    # stops it (idempotent), keeps DIR/data
#   tests/tools/registry.sh status DIR  # exit 0 and print the port if running
#
# The registry listens on 127.0.0.1:<free port> (or PORT when given, e.g. to
# restart it where clients expect it after a stop), plain HTTP (use
# --dest-tls-verify=false / --src-tls-verify=false with skopeo), stores blobs in
# DIR/data and allows deletes. `start` is idempotent: when the registry of DIR
# already answers, it just prints the port.
#
# With PULL_THROUGH_OF=http://127.0.0.1:PORT in the environment (not a
# REGISTRY_ name: docker-registry reads those as configuration) the
# registry is a pull-through cache of that registry (distribution's `proxy`
# mode), and its access log goes to DIR/registry.log: tests read it to see
# that the cache was really asked.
#
# Example:
#   port=$(tests/tools/registry.sh start /tmp/reg)
#   skopeo copy --preserve-digests --dest-tls-verify=false oci:/tmp/fx/edge:edge docker://127.0.0.1:$port/edge:latest
#   (without --preserve-digests skopeo gzips uncompressed layers: other manifest digest)
#   tests/tools/registry.sh stop /tmp/reg
set -euo pipefail

REGISTRY_BIN=${REGISTRY_BIN:-/usr/bin/docker-registry}
WAIT_SECONDS=20

die() { printf 'registry.sh: %s\n' "$*" >&2; exit 1; }
usage() { die "usage: $0 start DIR [PORT] | stop DIR | status DIR"; }

[ $# -eq 2 ] || { [ $# -eq 3 ] && [ "$1" = start ]; } || usage
cmd=$1
dir=$2
want_port=${3:-}
if [ -n "$want_port" ]; then
    [[ $want_port =~ ^[0-9]+$ ]] && [ "$want_port" -ge 1 ] && [ "$want_port" -le 65535 ] ||
        die "bad port: $want_port"
fi
mkdir -p "$dir"
dir=$(cd "$dir" && pwd)

# pid of our registry if it is running (checks the pid really is docker-registry with our config)
running_pid() {
    local pid
    [ -f "$dir/pid" ] || return 1
    pid=$(cat "$dir/pid")
    [ -n "$pid" ] && [ -r "/proc/$pid/cmdline" ] || return 1
    tr '\0' ' ' <"/proc/$pid/cmdline" | grep -qF "$dir/config.yml" || return 1
    echo "$pid"
}

answers() {
    curl -fsS -o /dev/null --max-time 2 "http://127.0.0.1:$1/v2/" 2>/dev/null
}

free_port() {
    python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

start() {
    local pid port attempt
    if pid=$(running_pid) && port=$(cat "$dir/port" 2>/dev/null) && answers "$port"; then
        [ -z "$want_port" ] || [ "$port" = "$want_port" ] ||
            die "already running on port $port, not $want_port"
        echo "$port"
        return 0
    fi
    [ -x "$REGISTRY_BIN" ] || die "$REGISTRY_BIN not found (apt-get install docker-registry)"
    stop_quiet
    mkdir -p "$dir/data"
    # A free port can be taken by another process (tests run in parallel)
    # before the registry binds it: it then exits, and another port is tried.
    for ((attempt = 1; attempt <= 5; attempt++)); do
        port=${want_port:-$(free_port)}
        if serve_on "$port"; then
            echo "$port"
            return 0
        fi
        log_tail
        [ -z "$want_port" ] || break
    done
    die "docker-registry exited during startup (port ${want_port:-taken five times})"
}

log_tail() { tail -n 20 "$dir/registry.log" >&2 || true; }

# Whether process $1 listens on 127.0.0.1:$2 itself (not another process
# that took the port).
listens() {
    ss -Hltnp "sport = :$2" 2>/dev/null | grep -q "pid=$1,"
}

# Starts the registry on port $1 and waits until it answers there itself;
# fails if it exits first (the port was taken).
serve_on() {
    local port=$1 pid i
    local accesslog_disabled=true
    [ -z "${PULL_THROUGH_OF:-}" ] || accesslog_disabled=false
    cat >"$dir/config.yml" <<EOF
version: 0.1
log:
  level: warn
  accesslog:
    disabled: $accesslog_disabled
storage:
  filesystem:
    rootdirectory: $dir/data
  delete:
    enabled: true
http:
  addr: 127.0.0.1:$port
EOF
    if [ -n "${PULL_THROUGH_OF:-}" ]; then
        printf 'proxy:\n  remoteurl: %s\n' "$PULL_THROUGH_OF" >>"$dir/config.yml"
    fi
    # own session: survives the caller's job control, no terminal signals
    setsid "$REGISTRY_BIN" serve "$dir/config.yml" >"$dir/registry.log" 2>&1 </dev/null &
    pid=$!
    echo "$pid" >"$dir/pid"
    echo "$port" >"$dir/port"
    for ((i = 0; i < WAIT_SECONDS * 10; i++)); do
        if listens "$pid" "$port" && answers "$port"; then
            return 0
        fi
        if ! kill -0 "$pid" 2>/dev/null; then
            rm -f "$dir/pid" "$dir/port"
            return 1
        fi
        sleep 0.1
    done
    log_tail
    stop_quiet
    die "docker-registry did not answer on 127.0.0.1:$port within ${WAIT_SECONDS}s"
}

stop_quiet() {
    local pid i
    if pid=$(running_pid); then
        kill -TERM "$pid" 2>/dev/null || true
        for ((i = 0; i < 50; i++)); do
            kill -0 "$pid" 2>/dev/null || break
            sleep 0.1
        done
        kill -KILL "$pid" 2>/dev/null || true
    fi
    rm -f "$dir/pid" "$dir/port"
}

case "$cmd" in
start) start ;;
stop) stop_quiet ;;
status)
    if running_pid >/dev/null && port=$(cat "$dir/port" 2>/dev/null) && answers "$port"; then
        echo "$port"
    else
        exit 1
    fi
    ;;
*) usage ;;
esac
