#!/usr/bin/env python3
"""A fleet on one machine: a registry, a Dragonfly cluster and N nodes, each in
a network namespace of its own, joined by a bridge (standard library only).
A fixture of the benchmark harness (`bring_up`, `bring_down`,
`registry_egress`) and a command of its own for the tests and by hand:

  fleet.py up   --dir DIR --nodes N --registry-data DATA [--no-dragonfly]
                [--uplink 100mbit] [--links 1gbit] [--net 10.201.0] [--prefix lf]
                [--policy always|auto] [--bulk-only]
  fleet.py stop-dfdaemon --dir DIR --node I     # node I's dfdaemon only
  fleet.py egress --dir DIR                     # bytes the registry sent so far
  fleet.py down --dir DIR                       # idempotent

`up` writes DIR/fleet.json: the registry's address, and per node its network
namespace, address, cache dir and hosts dir (for `lamina --hosts-dir`), then
prints it. Run a node's commands with `nsenter --net=/run/netns/NETNS ...`
(not `ip netns exec`, which gives its command a mount namespace of its own:
a lamina mount made there is seen nowhere else).

Layout (NET = 10.201.0 by default):
  bridge PREFIX-br      NET.1   in the host: the Dragonfly scheduler listens here
  netns  PREFIX-reg     NET.2   docker-registry on :5000, serving DATA (its access
                                log in DIR/registry.log); its uplink shaped to UPLINK
  netns  PREFIX-seed    NET.3   the seed peer (dfdaemon with seedPeer on)
  netns  PREFIX-nI      NET.10+I  node I: dfdaemon (proxy on 127.0.0.1:4001)
Every link but the registry's is shaped to LINKS; shaping is egress `tbf` on
the namespace's end of its veth, so the registry's uplink is the shared
bottleneck and nodes reach each other faster.

Dragonfly runs as its own docker-compose deployment does, without a manager:
schedulers are listed in each dfdaemon's dynconfig file, and the scheduler
learns the seed peer from its announcements. Node I's hosts.toml sends blob
requests to its dfdaemon as a registry mirror (containerd's setup for
Dragonfly), `X-Dragonfly-Registry` naming the plain-HTTP registry, with the
registry itself as the fallback host. Binaries: DRAGONFLY_DIR (default
/var/cache/lamina-test/dragonfly) holds v2.5.1/scheduler and
client-1.5.10/bin/dfdaemon, as scripts/setup.sh builds them.
"""

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

DRAGONFLY_DIR = Path(os.environ.get("DRAGONFLY_DIR", "/var/cache/lamina-test/dragonfly"))
SCHEDULER = DRAGONFLY_DIR / "v2.5.1" / "scheduler"
DFDAEMON = DRAGONFLY_DIR / "client-1.5.10" / "bin" / "dfdaemon"
REGISTRY_BIN = "/usr/bin/docker-registry"
REGISTRY_PORT = 5000
SCHEDULER_PORT = 8002
PROXY_PORT = 4001
START_SECONDS = 60
# The scheduler's SeedPeerRefreshInterval (scheduler/resource/standard/seed_peer.go).
SEED_REFRESH = 30


def log(msg):
    print(f"[fleet] {msg}", file=sys.stderr, flush=True)


def sh(*args, check=True, ns=None):
    cmd = (["nsenter", f"--net=/run/netns/{ns}"] if ns else []) + [str(a) for a in args]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if check and r.returncode != 0:
        raise SystemExit(f"fleet: {' '.join(cmd)}: {r.stderr.strip() or r.returncode}")
    return r


def names(prefix):
    return {"bridge": f"{prefix}-br", "reg": f"{prefix}-reg", "seed": f"{prefix}-seed"}


def pid_file(prefix):
    """Every process a fleet of this prefix started, whatever its dir: a
    fleet killed before its `down` leaves them running (a scheduler still
    bound to the bridge's address would serve the next fleet)."""
    return Path(f"/run/lamina-fleet-{prefix}.pids")


def clear_leftovers(prefix, nodes):
    """Stops processes and removes namespaces and links of this prefix that
    an earlier fleet left (a run killed before its `down`)."""
    if pid_file(prefix).exists():
        for pid in pid_file(prefix).read_text().split():
            kill(int(pid))
        pid_file(prefix).unlink()
    n = names(prefix)
    for ns in [n["reg"], n["seed"]] + [node_ns(prefix, i) for i in range(1, nodes + 9)]:
        if Path("/run/netns", ns).exists():
            log(f"removing a leftover namespace {ns}")
            sh("ip", "netns", "del", ns, check=False)
        sh("ip", "link", "del", f"{ns}-h"[-15:], check=False)
    sh("ip", "link", "del", n["bridge"], check=False)


def node_ns(prefix, i):
    return f"{prefix}-n{i}"


def add_ns(state, ns, bridge, ip, rate):
    """A namespace on the bridge at IP/24, its egress shaped to RATE."""
    host_end, ns_end = f"{ns}-h"[-15:], f"{ns}-c"[-15:]
    state["namespaces"].append(ns)
    save(Path(state["dir"]), state)
    sh("ip", "netns", "add", ns)
    sh("ip", "link", "add", host_end, "type", "veth", "peer", "name", ns_end)
    sh("ip", "link", "set", ns_end, "netns", ns)
    sh("ip", "link", "set", host_end, "master", bridge, "up")
    sh("ip", "link", "set", "lo", "up", ns=ns)
    sh("ip", "addr", "add", f"{ip}/24", "dev", ns_end, ns=ns)
    sh("ip", "link", "set", ns_end, "name", "eth0", ns=ns)
    sh("ip", "link", "set", "eth0", "up", ns=ns)
    if rate:
        sh("tc", "qdisc", "replace", "dev", "eth0", "root", "tbf", "rate", rate,
           "burst", "256kb", "latency", "100ms", ns=ns)


def spawn(state, name, cmd, ns=None, log_path=None):
    """Starts CMD (in NS) in a session of its own; its pid goes into state."""
    full = (["nsenter", f"--net=/run/netns/{ns}"] if ns else []) + [str(c) for c in cmd]
    out = open(log_path or os.devnull, "ab")
    p = subprocess.Popen(full, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                         start_new_session=True)
    state["pids"][name] = p.pid
    save(Path(state["dir"]), state)
    with open(pid_file(state["prefix"]), "a") as f:
        f.write(f"{p.pid}\n")
    return p


def wait_port(ip, port, ns, what, proc):
    deadline = time.monotonic() + START_SECONDS
    probe = f"import socket; socket.create_connection(('{ip}', {port}), 1).close()"
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"fleet: {what} exited ({proc.returncode})")
        if sh(sys.executable, "-c", probe, check=False, ns=ns).returncode == 0:
            return
        time.sleep(0.2)
    raise SystemExit(f"fleet: {what} did not listen on {ip}:{port} within {START_SECONDS} s")


def write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def registry_config(d, data):
    return write(d / "registry.yml", f"""version: 0.1
log:
  level: info
  accesslog:
    disabled: false
storage:
  filesystem:
    rootdirectory: {data}
  delete:
    enabled: true
http:
  addr: 0.0.0.0:{REGISTRY_PORT}
""")


def scheduler_config(d, ip):
    # retryBackToSourceLimit: a node's peer with no parent yet (its seed,
    # triggered by the task's first registration, not registered yet) asks
    # this many times, retryInterval apart, before it is sent to the
    # registry while the seed fetches the blob too. Three tries (0.6 s) let
    # one blob come twice in a CI run; ten allow about 2 s
    # (docs/dragonfly.md, "A node sent to the registry while its seed is
    # starting").
    write(d / "scheduler-dynconfig.yaml", """applications: []
seedPeerClusterConfig:
  loadLimit: 2000
schedulerClusterConfig:
  candidateParentLimit: 4
  filterParentLimit: 15
schedulerClusterClientConfig:
  loadLimit: 200
""")
    return write(d / "scheduler.yaml", f"""server:
  advertiseIP: {ip}
  advertisePort: {SCHEDULER_PORT}
  listenIP: {ip}
  port: {SCHEDULER_PORT}
  host: fleet-scheduler
  logDir: {d / "logs" / "scheduler"}
  pluginDir: {d / "scheduler-plugins"}
  dataDir: {d / "scheduler-data"}
scheduler:
  algorithm: default
  retryBackToSourceLimit: 10
  retryLimit: 12
  retryInterval: 200ms
job:
  enable: false
metrics:
  enable: false
console: false
pprofPort: -1
""")


def dfdaemon_config(d, name, ip, scheduler_ip, registry, seed, policy):
    home = d / name
    write(home / "dynconfig.yaml", f"scheduler:\n  addrs: ['{scheduler_ip}:{SCHEDULER_PORT}']\n")
    seed_block = "seedPeer:\n  enable: true\n  type: super\n" if seed else ""
    return write(home / "dfdaemon.yaml", f"""host:
  hostname: {name}
  ip: {ip}
server:
  pluginDir: {home / "plugins"}
  cacheDir: {home / "cache"}
download:
  protocol: tcp
  server:
    socketPath: {home / "dfdaemon.sock"}
  pieceTimeout: 30s
upload:
  server:
    port: 4000
scheduler:
  announceInterval: 5s
  scheduleTimeout: 30s
  enableBackToSource: true
storage:
  dir: {home / "storage"}
  keep: false
  server:
    tcpPort: 4005
    quicPort: 4006
proxy:
  server:
    port: {PROXY_PORT}
  rules:
    - regex: 'blobs/sha256.*'
      schedulingPolicy: {policy}
  registryMirror:
    addr: http://{registry}
  disableBackToSource: false
  prefetch: false
metrics:
  server:
    port: 4002
{seed_block}""")


def hosts_toml(node_dir, registry, dragonfly, bulk_only):
    """Node's hosts dir: its dfdaemon first (when there is one), then the
    registry; lamina falls back to the registry when the mirror fails. With
    BULK_ONLY the dfdaemon serves bulk reads only and misses go straight to
    the registry (lamina's own key, docs/dragonfly.md)."""
    bulk = "  bulk_only = true\n" if bulk_only else ""
    mirror = f"""[host."http://127.0.0.1:{PROXY_PORT}"]
  capabilities = ["pull"]
{bulk}  [host."http://127.0.0.1:{PROXY_PORT}".header]
    X-Dragonfly-Registry = "http://{registry}"
""" if dragonfly else ""
    write(node_dir / "hosts" / registry / "hosts.toml", f'server = "http://{registry}"\n\n{mirror}')
    return node_dir / "hosts"


def start_dfdaemon(state, d, name, ns, ip):
    config = Path(state["dir"]) / name / "dfdaemon.yaml"
    proc = spawn(state, f"dfdaemon-{name}", [
        DFDAEMON, "--config", config, "--dynconfig", config.parent / "dynconfig.yaml",
        "--log-dir", config.parent / "logs"], ns=ns, log_path=config.parent / "dfdaemon.out")
    wait_port("127.0.0.1", PROXY_PORT, ns, f"dfdaemon of {name}", proc)


def up(args, quiet=False):
    d = Path(args.dir).resolve()
    d.mkdir(parents=True, exist_ok=True)
    if (d / "fleet.json").exists():
        down(args)
    n = names(args.prefix)
    net = args.net
    state = {"dir": str(d), "prefix": args.prefix, "pids": {}, "namespaces": [],
             "bridge": n["bridge"], "dragonfly": not args.no_dragonfly}
    save(d, state)
    clear_leftovers(args.prefix, args.nodes)
    if state["dragonfly"] and not (SCHEDULER.exists() and DFDAEMON.exists()):
        raise SystemExit(f"fleet: Dragonfly not built ({SCHEDULER}, {DFDAEMON}): run scripts/setup.sh")
    sh("ip", "link", "add", n["bridge"], "type", "bridge")
    sh("ip", "addr", "add", f"{net}.1/24", "dev", n["bridge"])
    sh("ip", "link", "set", n["bridge"], "up")
    registry = f"{net}.2:{REGISTRY_PORT}"
    add_ns(state, n["reg"], n["bridge"], f"{net}.2", args.uplink)
    proc = spawn(state, "registry", [REGISTRY_BIN, "serve", registry_config(d, args.registry_data)],
                 ns=n["reg"], log_path=d / "registry.log")
    wait_port(f"{net}.2", REGISTRY_PORT, n["reg"], "the registry", proc)
    if state["dragonfly"]:
        sched = spawn(state, "scheduler", [SCHEDULER, "--config", scheduler_config(d, f"{net}.1"),
                                           "--dynconfig", d / "scheduler-dynconfig.yaml"],
                      log_path=d / "scheduler.out")
        started_scheduler = time.monotonic()
        wait_port(f"{net}.1", SCHEDULER_PORT, None, "the scheduler", sched)
        add_ns(state, n["seed"], n["bridge"], f"{net}.3", args.links)
        dfdaemon_config(d, "seed", f"{net}.3", f"{net}.1", registry, True, args.policy)
        start_dfdaemon(state, d, "seed", n["seed"], f"{net}.3")
        seed_ready = started_scheduler + SEED_REFRESH + 2
    nodes = []
    for i in range(1, args.nodes + 1):
        ns, ip, name = node_ns(args.prefix, i), f"{net}.{10 + i}", f"node{i}"
        add_ns(state, ns, n["bridge"], ip, args.links)
        if state["dragonfly"]:
            dfdaemon_config(d, name, ip, f"{net}.1", registry, False, args.policy)
            start_dfdaemon(state, d, name, ns, ip)
        hosts = hosts_toml(d / name, registry, state["dragonfly"], args.bulk_only)
        nodes.append({"name": name, "netns": ns, "ip": ip, "hosts_dir": str(hosts),
                      "cache": str(d / name / "lamina-cache")})
    if state["dragonfly"]:
        # The scheduler adds seed peers it has heard from to the ones it asks
        # every SEED_REFRESH s; until then each node goes back to source.
        wait = seed_ready - time.monotonic()
        if wait > 0:
            log(f"waiting {wait:.0f} s for the scheduler to take the seed peer")
            time.sleep(wait)
    state.update({"registry": registry, "nodes": nodes, "registry_ns": n["reg"],
                  "registry_log": str(d / "registry.log")})
    save(d, state)
    if not quiet:
        print(json.dumps(state, indent=2))


def save(d, state):
    tmp = d / "fleet.json.tmp"
    tmp.write_text(json.dumps(state, indent=2))
    tmp.rename(d / "fleet.json")


def load(dir_):
    path = Path(dir_).resolve() / "fleet.json"
    return json.loads(path.read_text()) if path.exists() else None


def kill(pid):
    try:
        os.killpg(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    for _ in range(50):
        try:
            os.killpg(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def stop_dfdaemon(args):
    state = load(args.dir)
    pid = state and state["pids"].get(f"dfdaemon-node{args.node}")
    if not pid:
        raise SystemExit(f"fleet: no dfdaemon of node {args.node}")
    kill(pid)
    log(f"stopped the dfdaemon of node {args.node}")


def registry_egress(state):
    """Bytes the registry's namespace has sent (its eth0's tx_bytes)."""
    # Asked through ip: /sys shows the namespace of whoever mounted it.
    stats = sh("ip", "-s", "-j", "link", "show", "eth0", ns=state["registry_ns"]).stdout
    return json.loads(stats)[0]["stats64"]["tx"]["bytes"]


def egress(args):
    print(registry_egress(load(args.dir)))


ACCESS_LINE = re.compile(r'^(\S+) \S+ \S+ \[[^]]*\] "(\w+) (\S+) [^"]*" (\d+) (\d+)')


def served_by_client(log_path, skip=0):
    """What the registry's access log says it sent, from line SKIP on, by
    client address and route: a dfdaemon's requests carry the `ns` query
    parameter, lamina's own do not. ({"CLIENT via|direct": {requests,
    bytes}}, the log's length in lines)."""
    totals, lines = {}, 0
    with open(log_path, errors="replace") as f:
        for lines, line in enumerate(f, 1):
            m = ACCESS_LINE.match(line)
            if lines <= skip or not m:
                continue
            client, _, path, _, size = m.groups()
            key = f"{client} {'via' if 'ns=' in path else 'direct'}"
            t = totals.setdefault(key, {"requests": 0, "bytes": 0})
            t["requests"] += 1
            t["bytes"] += int(size)
    return totals, lines


def served(args):
    totals, lines = served_by_client(load(args.dir)["registry_log"], args.skip)
    print(json.dumps({"lines": lines, "by_client": totals}))


def bring_up(d, nodes, data, prefix, net, flags=()):
    """`up` for a benchmark: the fleet's state (fleet.json)."""
    args = parser().parse_args(["up", "--dir", str(d), "--nodes", str(nodes), "--registry-data", str(data),
                                "--prefix", prefix, "--net", net, *flags])
    try:
        up(args, quiet=True)
    except BaseException:
        down(args)
        raise
    return load(d)


def bring_down(d):
    down(argparse.Namespace(dir=str(d)))


def down(args):
    state = load(args.dir)
    if not state:
        return
    for pid in state["pids"].values():
        kill(pid)
    for ns in state["namespaces"]:
        sh("ip", "netns", "del", ns, check=False)
    sh("ip", "link", "del", state["bridge"], check=False)
    (Path(state["dir"]) / "fleet.json").unlink(missing_ok=True)
    pid_file(state["prefix"]).unlink(missing_ok=True)
    log(f"down: {len(state['pids'])} processes, {len(state['namespaces'])} namespaces")


def parser():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    u = sub.add_parser("up")
    u.add_argument("--dir", required=True)
    u.add_argument("--nodes", type=int, default=3)
    u.add_argument("--registry-data", required=True)
    u.add_argument("--no-dragonfly", action="store_true")
    u.add_argument("--uplink", default="100mbit")
    u.add_argument("--links", default="1gbit")
    u.add_argument("--net", default="10.201.0")
    u.add_argument("--prefix", default="lf")
    u.add_argument("--bulk-only", action="store_true",
                   help="mark each node's dfdaemon bulk_only in its hosts.toml: misses go "
                        "straight to the registry")
    u.add_argument("--policy", choices=["always", "auto"], default="always",
                   help="dfdaemon's schedulingPolicy for blobs: auto sends ranges of "
                        "4 MiB or less straight to the registry (no P2P)")
    for name in ["down", "egress"]:
        sub.add_parser(name).add_argument("--dir", required=True)
    v = sub.add_parser("served", help="the registry's access log summed by client and route "
                                      "(via a dfdaemon or direct), from line --skip on")
    v.add_argument("--dir", required=True)
    v.add_argument("--skip", type=int, default=0)
    s = sub.add_parser("stop-dfdaemon")
    s.add_argument("--dir", required=True)
    s.add_argument("--node", type=int, required=True)
    return p


def main():
    args = parser().parse_args()
    if os.geteuid() != 0:
        raise SystemExit("fleet: must run as root (network namespaces)")
    if args.cmd == "up":
        try:
            up(args)
        except BaseException:
            down(args)
            raise
        return
    {"down": down, "egress": egress, "served": served, "stop-dfdaemon": stop_dfdaemon}[args.cmd](args)


if __name__ == "__main__":
    try:
        main()
    except SystemExit as e:
        if e.code not in (None, 0) and isinstance(e.code, str):
            print(e.code, file=sys.stderr)
            sys.exit(1)
        raise
