"""Cold starts through containerd: its full pull (`ctr image pull
--plain-http` in the namespace, into a fresh containerd namespace whose
content store is checked to be empty, then `ctr run --rm --net-host`);
lamina snapshotter as its proxy plugin (`ctr-remote image rpull`, then
`ctr-remote run`; a fresh snapshotter per start, in the namespace so its
mounts fetch through the shaped link); Docker Engine on the same containerd
pulling the unmodified tag through its tar index (docker-index); and the
snapshotter's idle footprint with N images mounted. Each start: timed to
the first useful output, then a second container of the same image."""

import json
import os
import shutil
import subprocess
import time

from ..harness import workdir
from ..harness.containerd import start_snapshotter, stop_snapshotter, terminate
from ..harness.core import log, run
from ..harness.measure import drop_caches, proc_kib, pss_kib, run_quiet
from . import workloads
from .starts_lamina import FETCH_KEYS, STATUS_KEYS, started, stop_container, tail_of, wait_prefetch
from .workloads import NGINX_CONF_IN, free_port, wait_ready

# docker-index: Docker Engine (dockerd with the containerd image store and
# `lamina` as its storage driver, on the same containerd and a fresh lamina
# snapshotter) pulls and runs the unmodified tag, found through its index:
# `docker pull` + `docker run`, python3 only. dockerd and docker from
# DOCKER_DIR (scripts/setup.sh), else from PATH.
DOCKER_DIR = "/var/cache/lamina-test/go/dockerd-v28.5.2"


def ctr_container(b, ns, cid, ref, workload, port, d, snapshotter=None):
    """`ctr run --rm` of the workload until its first useful output; then it
    is killed and removed. Returns t_ready."""
    # The client that pulled runs the container too (as with containerd's
    # `ctr pull` + `ctr run`): ctr-remote is ctr with `rpull` added, and
    # a second, cold binary would cost the snapshotter variants alone.
    client = ["ctr-remote", "--address", b.ctd.sock] if snapshotter else b.ctd.ctr
    cmd = client + ["-n", ns, "run", "--rm", "--net-host"]
    if snapshotter:
        cmd += ["--snapshotter", snapshotter]
    if workload == "nginx":
        conf = workloads.nginx_conf(os.path.join(d, "nginx.conf"), port)
        cmd += ["--mount", f"type=bind,src={conf},dst={NGINX_CONF_IN},options=rbind:ro"]
    cmd += [ref, cid] + workloads.args(workload, port)
    proc, out, err = started(cmd, workload, os.path.join(d, f"{cid}.out"), os.path.join(d, f"{cid}.err"))
    try:
        return wait_ready(workload, proc, port)
    except Exception:
        log(f"ctr run {cid} stderr: {tail_of(os.path.join(d, f'{cid}.err'))}")
        raise
    finally:
        ctr = b.ctd.ctr + ["-n", ns]
        stop_container(proc, out, err, ctr + ["tasks", "kill", "-s", "SIGKILL", cid], 30)
        p = subprocess.run(ctr + ["containers", "ls", "-q"], capture_output=True, text=True)
        if cid in p.stdout.split():
            subprocess.run(ctr + ["tasks", "delete", "-f", cid], capture_output=True)
            subprocess.run(ctr + ["containers", "rm", cid], capture_output=True)


def containerd_run(b, workload):
    seq = b.next_seq()
    ns = f"cs{seq}"
    ref = f"{b.reg}/debian:{b.tags(workload)[0]}"
    cid = f"{b.id}-{seq}"
    d = b.run_dir(seq, f"containerd-{workload}")
    os.makedirs(d)
    port = free_port()
    left = b.ctd.content_blobs()
    if left:
        raise RuntimeError(f"containerd content store not empty before a cold run ({left} blobs)")
    rec = {}
    try:
        drop_caches()
        tx0 = b.tx_bytes()
        t0 = time.perf_counter()
        run_quiet(b.ns.argv(b.ctd.ctr + ["-n", ns, "images", "pull", "--plain-http", ref]),
                  stdin=subprocess.DEVNULL, timeout=1200)
        t_pull = time.perf_counter()
        tx_pull = b.tx_bytes()
        t_ready = ctr_container(b, ns, cid, ref, workload, port, d)
        rec.update(time_s=t_ready - t0, pull_s=t_pull - t0, container_s=t_ready - t_pull,
                   wire_bytes=b.tx_bytes() - tx0, wire_bytes_pull=tx_pull - tx0)
        tx1 = b.tx_bytes()
        t1 = time.perf_counter()
        t2 = ctr_container(b, ns, f"{cid}b", ref, workload, free_port(), d)
        rec["second"] = {"time_s": t2 - t1, "wire_bytes": b.tx_bytes() - tx1}
        return rec
    finally:
        b.ctd.forget(ns, [ref])
        shutil.rmtree(d, ignore_errors=True)


# -- lamina snapshotter under containerd ------------------------------------------------------
def snapshotter(b, root):
    """A fresh lamina snapshotter in the namespace (its mounts' daemons fetch
    through the shaped link), at debug level with keep_logs."""
    env = dict(os.environ, LAMINA_LOG="debug") if b.keep else None
    return start_snapshotter(b.lamina, b.ctd, root, b.snapshotter_sock, f"warmup-{b.next_seq()}",
                             prefix=b.ns.argv([]), env=env)


def snapshotter_status(b, root):
    """lamina status of the snapshotter's mounts: the one mount's figures."""
    p = run([b.lamina, "status", "--json", "--cache-dir", os.path.join(root, "cache")], check=False)
    mounts = json.loads(p.stdout or "[]") if p.returncode == 0 else []
    if len(mounts) != 1:
        return {"mounts": len(mounts)}
    m = mounts[0]
    return dict(m.get("status") or {}, holder_pid=m.get("holder_pid"), mounts=1)


def rpull(b, ns, ref):
    """`ctr-remote image rpull`: containerd 1.6's client with stargz's
    remote-snapshot labels, which lamina snapshotter recognises."""
    run_quiet(b.ns.argv(["ctr-remote", "-a", b.ctd.sock, "-n", ns, "image", "rpull", "--plain-http",
                         "--snapshotter", "lamina", ref]), stdin=subprocess.DEVNULL, timeout=600)


def second_snapshot_start(b, root, start, st, rec):
    """A second container of the image a start pulled (its figures in
    rec["second"]); the status after it. `start()` returns t_ready."""
    f0, tx1 = st.get("fetched_bytes") or 0, b.tx_bytes()
    t1 = time.perf_counter()
    t2 = start()
    time.sleep(0.25)
    st2 = snapshotter_status(b, root)
    rec["second"] = {"time_s": t2 - t1, "fetched_bytes": (st2.get("fetched_bytes") or 0) - f0,
                     "wire_bytes": b.tx_bytes() - tx1,
                     "misses": (st2.get("misses") or 0) - (st.get("misses") or 0)}
    return st2


def snapshotter_run(b, tag, workload):
    seq = b.next_seq()
    ns = f"cs{seq}"
    ref = f"{b.reg}/debian:{tag}"
    cid = f"{b.id}-{seq}"
    d = b.run_dir(seq, f"snapshotter-{tag}-{workload}")
    root = os.path.join(d, "root")
    port = free_port()
    proc = snapshotter(b, root)
    rec = {"tag": tag}
    try:
        drop_caches()
        tx0 = b.tx_bytes()
        t0 = time.perf_counter()
        rpull(b, ns, ref)
        t_pull = time.perf_counter()
        tx_pull = b.tx_bytes()
        t_ready = ctr_container(b, ns, cid, ref, workload, port, d, snapshotter="lamina")
        tx_ready = b.tx_bytes()
        time.sleep(0.25)  # the worker rewrites status.json every 200 ms
        st = snapshotter_status(b, root)
        if st.get("mounts") != 1:
            raise RuntimeError(f"expected one lamina mount under the snapshotter, found {st.get('mounts')}")
        rec.update(time_s=t_ready - t0, pull_s=t_pull - t0, container_s=t_ready - t_pull,
                   wire_bytes_pull=tx_pull - tx0, wire_bytes_ready=tx_ready - tx0,
                   fetched_bytes_ready=st.get("fetched_bytes"), requests_ready=st.get("requests"),
                   misses_ready=st.get("misses"), content_blobs=b.ctd.content_blobs())
        st = wait_prefetch(lambda: snapshotter_status(b, root), st)
        rec.update(wire_bytes=b.tx_bytes() - tx0, **{k: st.get(k) for k in STATUS_KEYS})
        st2 = second_snapshot_start(b, root, lambda: ctr_container(b, ns, f"{cid}b", ref, workload, free_port(), d,
                                                                   snapshotter="lamina"), st, rec)
        hw, ww, sw = (proc_kib(st2.get("holder_pid"), "VmHWM"), proc_kib(st2.get("pid"), "VmHWM"),
                      proc_kib(proc.pid, "VmHWM"))
        rec["rss_kib"] = {"holder": hw, "worker": ww, "snapshotter": sw,
                          "sum": (hw or 0) + (ww or 0) if hw and ww else None}
        return rec
    finally:
        # before the mount goes: its daemons' logs go with it
        b.keep_logs(d, os.path.basename(d))
        b.ctd.forget(ns, [ref], snapshotter="lamina")
        stop_snapshotter(b.lamina, proc, root)
        workdir.remove(d)


# -- Docker Engine through the tar index ------------------------------------------------------
def docker_bins():
    """dockerd and docker: setup.sh's build, else PATH; None when there are none."""
    for d in (DOCKER_DIR, None):
        bins = [os.path.join(d, x) if d else shutil.which(x) for x in ("dockerd", "docker")]
        if all(x and os.access(x, os.X_OK) for x in bins):
            return bins
    return None


def start_dockerd(b, d, seq):
    """dockerd in the namespace (it fetches manifests itself) on our containerd."""
    dockerd, docker = docker_bins()
    sock = os.path.join(d, "docker.sock")
    with open(os.path.join(d, "dockerd.log"), "ab") as out:
        proc = subprocess.Popen(b.ns.argv(
            [dockerd, "--containerd", b.ctd.sock, "--data-root", os.path.join(d, "docker"),
             "--exec-root", f"/run/lcs-docker-{b.id}-{seq}", "--pidfile", os.path.join(d, "docker.pid"),
             "-H", f"unix://{sock}", "--iptables=false", "--ip6tables=false", "--bridge=none",
             "--userland-proxy=false", "--storage-driver", "lamina",
             "--feature", "containerd-snapshotter=true", "--insecure-registry", b.reg]),
            stdin=subprocess.DEVNULL, stdout=out, stderr=out, start_new_session=True)
    client = [docker, "-H", f"unix://{sock}"]
    end = time.monotonic() + 60
    while run(client + ["info"], check=False).returncode != 0:
        if proc.poll() is not None or time.monotonic() > end:
            raise RuntimeError(f"dockerd did not answer (rc {proc.poll()})")
        time.sleep(0.2)
    return proc, client


def docker_container(b, client, ref, workload):
    """`docker run --rm` of the workload; returns when its first output came."""
    proc = subprocess.Popen(b.ns.argv(client + ["run", "--rm", "--network", "host", ref]
                                      + workloads.args(workload, 0)), stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        return wait_ready(workload, proc, 0)
    finally:
        proc.wait(timeout=60)
        proc.stdout.close()


def docker_run(b, workload):
    if workload != "python" or not docker_bins():
        raise RuntimeError("docker-index: python only, and needs dockerd and docker")
    seq = b.next_seq()
    ref = f"{b.reg}/debian:bookworm"
    d = b.run_dir(seq, f"docker-{workload}")
    root = os.path.join(d, "root")
    os.makedirs(d)
    snap = snapshotter(b, root)
    dockerd, client = None, None
    rec = {"tag": "bookworm"}
    try:
        dockerd, client = start_dockerd(b, d, seq)
        drop_caches()
        tx0 = b.tx_bytes()
        t0 = time.perf_counter()
        run_quiet(b.ns.argv(client + ["pull", "-q", ref]), stdin=subprocess.DEVNULL, timeout=600)
        t_pull = time.perf_counter()
        tx_pull = b.tx_bytes()
        t_ready = docker_container(b, client, ref, workload)
        tx_ready = b.tx_bytes()
        time.sleep(0.25)  # the worker rewrites status.json every 200 ms
        st = snapshotter_status(b, root)
        rec.update(time_s=t_ready - t0, pull_s=t_pull - t0, container_s=t_ready - t_pull,
                   wire_bytes_pull=tx_pull - tx0, wire_bytes_ready=tx_ready - tx0, wire_bytes=tx_ready - tx0,
                   fetched_bytes_ready=st.get("fetched_bytes"), requests_ready=st.get("requests"),
                   misses_ready=st.get("misses"), content_blobs=b.ctd.content_blobs(),
                   **{k: st.get(k) for k in FETCH_KEYS})
        second_snapshot_start(b, root, lambda: docker_container(b, client, ref, workload), st, rec)
        return rec
    finally:
        if dockerd is not None:
            terminate(dockerd)
        b.ctd.forget("moby", [f"docker.io/{ref}", ref], snapshotter="lamina")
        stop_snapshotter(b.lamina, snap, root)
        workdir.remove(d)


# -- idle footprint ---------------------------------------------------------------------------
def idle_footprint(b, refs, settle_s=10):
    """Memory of the snapshotter and of the mount daemons with the images
    `refs` pulled (each a lazy mount) and nothing reading."""
    n = len(refs)
    d = os.path.join(b.work, "idle")
    root = os.path.join(d, "root")
    proc = snapshotter(b, root)
    ns = "idle"
    try:
        for ref in refs:
            rpull(b, ns, ref)
        time.sleep(settle_s)
        mounts = json.loads(run([b.lamina, "status", "--json", "--cache-dir", os.path.join(root, "cache")]).stdout)
        pids = [x for m in mounts for x in (m.get("holder_pid"), (m.get("status") or {}).get("pid")) if x]
        out = {"images": n, "settle_s": settle_s, "mounts": len(mounts),
               "snapshotter_rss_kib": proc_kib(proc.pid, "VmRSS"),
               "snapshotter_hwm_kib": proc_kib(proc.pid, "VmHWM"),
               "snapshotter_pss_kib": pss_kib(proc.pid),
               "daemons": len(pids),
               "daemons_rss_kib": sum(proc_kib(x, "VmRSS") or 0 for x in pids),
               "daemons_pss_kib": sum(pss_kib(x) or 0 for x in pids),
               "content_blobs": b.ctd.content_blobs()}
        log(f"idle: {out['mounts']} mounts; snapshotter RSS {out['snapshotter_rss_kib'] / 1024:.1f} MiB; "
            f"{out['daemons']} daemons RSS {out['daemons_rss_kib'] / 1024:.1f} MiB, "
            f"PSS {out['daemons_pss_kib'] / 1024:.1f} MiB")
        if out["mounts"] != n:
            raise RuntimeError(f"idle: {n} images pulled but {out['mounts']} lamina mounts")
        return out
    finally:
        b.ctd.forget(ns, refs, snapshotter="lamina")
        stop_snapshotter(b.lamina, proc, root)
        workdir.remove(d)
