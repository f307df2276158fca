"""A network namespace of its own whose loopback is the shaped link: a
registry and its clients run inside it (through `nsenter --net`, so their
mounts stay visible to the host), every byte between them crosses its `lo`,
shaped by a tbf qdisc, and a thread of the calling process can enter it (a
server inside is not reachable from the host's 127.0.0.1).

fleet.py joins several namespaces by a bridge instead (one per node); this
is the one-namespace case of the cold-start benchmark."""

import ctypes
import os
import threading
from pathlib import Path

from .core import log, run

CLONE_NEWNET = 0x40000000


class Namespace:
    """Created on construction (a leftover of the same name is removed
    first), its `lo` up with `mtu`; gone after `delete`."""

    def __init__(self, name, mtu=1500):
        self.name = name
        self.path = f"/run/netns/{name}"
        if Path(self.path).exists():
            log(f"removing a leftover namespace {name}")
            run(["ip", "netns", "del", name], check=False)
        run(["ip", "netns", "add", name])
        self.run(["ip", "link", "set", "lo", "mtu", mtu, "up"])

    def argv(self, cmd):
        """`cmd` run inside the namespace (for Popen and the like)."""
        return ["nsenter", f"--net={self.path}"] + [str(c) for c in cmd]

    def run(self, cmd, **kw):
        return run(cmd, netns=self.name, **kw)

    def shape(self, rate, burst, latency, dev="lo"):
        """`dev`'s egress limited to `rate` by tbf; rate None: unshaped."""
        if rate is None:
            self.run(["tc", "qdisc", "del", "dev", dev, "root"], check=False)
        else:
            self.run(["tc", "qdisc", "replace", "dev", dev, "root", "tbf", "rate", rate,
                      "burst", burst, "latency", latency])

    @staticmethod
    def tx_bytes(pid, dev="lo"):
        """Bytes sent so far on `dev` of the namespace of process `pid` (one
        running inside). Read from /proc/PID/net/dev: /sys/class/net shows
        the host's devices to a process that did not remount /sys, and a
        file read keeps the cost off the spans it is taken in."""
        with open(f"/proc/{pid}/net/dev") as f:
            for line in f:
                name, _, rest = line.partition(":")
                if name.strip() == dev:
                    return int(rest.split()[8])
        raise RuntimeError(f"no {dev} in /proc/{pid}/net/dev")

    def call(self, fn, *args):
        """fn(*args) on a short-lived thread that entered the namespace (only
        that thread moves); its result, or the OSError it raised."""
        out = []

        def body():
            try:
                enter(self.path)
                out.append(fn(*args))
            except OSError as e:
                out.append(e)
        t = threading.Thread(target=body)
        t.start()
        t.join()
        if isinstance(out[0], OSError):
            raise out[0]
        return out[0]

    def delete(self):
        if Path(self.path).exists() and run(["ip", "netns", "delete", self.name], check=False).returncode:
            log(f"warning: cannot delete network namespace {self.name}")


def enter(path):
    """Moves the calling thread (only it) into the network namespace at `path`."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(path, os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns {path}")
    finally:
        os.close(fd)
