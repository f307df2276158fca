"""A private containerd for a benchmark: its own root, state and socket
under a work dir, no CRI, in the host's network namespace, with lamina
snapshotter as its proxy plugin `lamina`; `ctr` against it, forgetting an
image with all it stored, and its teardown. Also a lamina snapshotter
started for it, and stopped.

The containerd measured is the one on PATH (Debian's 1.6), or a given
binary (`use_binary`: e.g. a 2.x that scripts/setup.sh built), whose
directory then goes first on PATH so that its own ctr and shim are used."""

import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

from .core import log, run
from .measure import is_mountpoint, lamina_umount, sys_umount

START_SECONDS = 10


def use_binary(path):
    """Measures the containerd at `path` (named containerd): its directory
    first on PATH, for this process and everything it starts."""
    path = Path(path)
    if not (path.is_file() and os.access(path, os.X_OK)):
        raise SystemExit(f"containerd: {path} is not an executable")
    os.environ["PATH"] = f"{path.resolve().parent}:{os.environ['PATH']}"
    found = shutil.which("containerd")
    if not (found and Path(found).samefile(path)):
        raise SystemExit(f"containerd: the binary must be named containerd ({path})")


def terminate(proc, timeout=30):
    """SIGTERM, then SIGKILL after `timeout` seconds; reaped either way."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class Containerd:
    """Started on construction (DIR/containerd.log its log); `stop` removes
    every task and container it runs, then stops it."""

    def __init__(self, directory, snapshotter_sock, debug=False):
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.sock = str(self.dir / "containerd.sock")
        self.root = self.dir / "root"
        self.ctr = ["ctr", "--address", self.sock]
        self.version = run(["containerd", "--version"]).stdout.strip()
        config = self.config(snapshotter_sock, "debug" if debug else "info")
        with open(self.dir / "containerd.log", "wb") as out:
            self.proc = subprocess.Popen(["containerd", "--config", config], stdin=subprocess.DEVNULL,
                                         stdout=out, stderr=out, start_new_session=True)
        end = time.monotonic() + START_SECONDS
        while run(self.ctr + ["version"], check=False).returncode != 0:
            if self.proc.poll() is not None or time.monotonic() > end:
                tail = (self.dir / "containerd.log").read_text(errors="replace")[-2000:]
                self.stop()
                raise RuntimeError(f"containerd did not answer on {self.sock}:\n{tail}")
            time.sleep(0.1)
        log(f"containerd {self.version.split()[2]} on {self.sock} (pid {self.proc.pid})")

    def config(self, snapshotter_sock, level):
        """A minimal config of containerd's own version (2 for 1.x, 3 for
        2.x): no CRI, everything under DIR, lamina as a proxy snapshotter."""
        version = 3 if " v2." in self.version else 2
        path = self.dir / "config.toml"
        path.write_text(f"""version = {version}
root = "{self.root}"
state = "{self.dir / 'state'}"
disabled_plugins = ["io.containerd.grpc.v1.cri"]

[grpc]
  address = "{self.sock}"

[ttrpc]
  address = "{self.sock}.ttrpc"

[debug]
  level = "{level}"

[plugins."io.containerd.internal.v1.opt"]
  path = "{self.dir / 'opt'}"

[proxy_plugins.lamina]
  type = "snapshot"
  address = "{snapshotter_sock}"
""")
        return path

    def content_blobs(self):
        """Blobs in the content store (0 before a cold pull)."""
        d = self.root / "io.containerd.content.v1.content" / "blobs" / "sha256"
        return len(os.listdir(d)) if d.is_dir() else 0

    def forget(self, ns, refs, snapshotter=None):
        """Removes the images of namespace `ns` (their content and snapshots
        with them), then the namespace."""
        snap = ["--snapshotter", snapshotter] if snapshotter else []
        for ref in refs:
            run(self.ctr + ["-n", ns, "images", "rm", "--sync", ref], check=False, timeout=300)
        p = run(self.ctr + ["-n", ns, "content", "ls", "-q"], check=False)
        for dg in p.stdout.split():
            run(self.ctr + ["-n", ns, "content", "rm", dg], check=False)
        # children before parents: the newest first
        p = run(self.ctr + ["-n", ns, "snapshots"] + snap + ["ls"], check=False)
        for line in reversed(p.stdout.splitlines()[1:]):
            if line.split():
                run(self.ctr + ["-n", ns, "snapshots"] + snap + ["rm", line.split()[0]], check=False)
        run(self.ctr + ["namespaces", "rm", ns], check=False)

    def stop(self):
        """Kills every task, removes every container, then stops the daemon."""
        def ctr(*args):
            try:
                return run(self.ctr + list(args), check=False, timeout=20).stdout.split()
            except subprocess.TimeoutExpired:
                log(f"warning: ctr {' '.join(args)}: no answer in 20 s")
                return []
        if self.proc.poll() is None:
            for ns in ctr("namespaces", "ls", "-q"):
                for c in ctr("-n", ns, "tasks", "ls", "-q"):
                    ctr("-n", ns, "tasks", "kill", "-s", "SIGKILL", c)
                    ctr("-n", ns, "tasks", "delete", "-f", c)
                for c in ctr("-n", ns, "containers", "ls", "-q"):
                    ctr("-n", ns, "containers", "rm", c)
        terminate(self.proc, timeout=10)


def start_snapshotter(lamina, ctd, root, sock, warmup_key, prefix=(), env=None, args=()):
    """A fresh `lamina snapshotter` (under `prefix`, e.g. nsenter into the
    namespace its mounts fetch through; with `args` more) on the socket
    `sock` that containerd `ctd`'s proxy plugin names; its log beside
    `root`. Returns its Popen once containerd reaches it."""
    if os.path.exists(sock):
        os.unlink(sock)
    os.makedirs(root, exist_ok=True)
    with open(os.path.join(os.path.dirname(root), "snapshotter.log"), "ab") as out:
        proc = subprocess.Popen(list(prefix) + [str(lamina), "snapshotter", "--root", root, "--address", sock] + list(args),
                                stdin=subprocess.DEVNULL, stdout=out, stderr=out, start_new_session=True, env=env)
    end = time.monotonic() + 30
    while True:
        try:
            with socket.socket(socket.AF_UNIX) as c:
                c.connect(sock)
            break
        except OSError:
            if proc.poll() is not None or time.monotonic() > end:
                raise RuntimeError(f"lamina snapshotter did not listen on {sock} (rc {proc.poll()})")
            time.sleep(0.05)
    # containerd's proxy client fails calls fast while it backs off from
    # the previous snapshotter's socket (up to 3 s in 1.6): one call that
    # reaches the snapshotter (`ls` is answered from containerd's own
    # metadata), untimed, so a measured pull does not meet that backoff
    snap = ctd.ctr + ["-n", "warmup", "snapshots", "--snapshotter", "lamina"]
    while run(snap + ["prepare", warmup_key], check=False, timeout=60).returncode != 0:
        if proc.poll() is not None or time.monotonic() > end:
            raise RuntimeError(f"containerd did not reach lamina snapshotter on {sock}")
        time.sleep(0.2)
    run(snap + ["rm", warmup_key], timeout=60)
    return proc


def stop_snapshotter(lamina, proc, root):
    """Stops the snapshotter, then unmounts whatever mounts it left."""
    terminate(proc)
    snaps = os.path.join(root, "snapshots")
    for name in os.listdir(snaps) if os.path.isdir(snaps) else []:
        for sub in ("merged", "lamina"):
            mnt = os.path.join(snaps, name, sub)
            if is_mountpoint(mnt):
                log(f"warning: {mnt} still mounted after the snapshots were removed")
                if sub == "lamina":
                    lamina_umount(str(lamina), mnt, os.path.join(root, "cache"))
                else:
                    sys_umount(mnt)
