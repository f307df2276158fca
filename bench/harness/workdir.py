"""What a benchmark leaves in its work dir when it stops, having succeeded or
not: mounts below it (overlays first, then lamina's through `lamina umount`,
which stops their daemons, then anything else, deepest first), processes
still running from it (lamina daemons run the private copy WORK/lamina), and
the dir itself, removed unless something stays mounted below it."""

import os
import shutil
import signal
import subprocess
import time

from .core import log
from .measure import procs_of, sys_umount


def mounts_under(d, fstype=None):
    """Mount points below `d` (of type `fstype` when given), deepest first."""
    prefix = str(d).rstrip("/") + "/"
    found = []
    with open("/proc/self/mounts") as f:
        for line in f:
            _, mnt, kind = line.split()[:3]
            if mnt.startswith(prefix) and fstype in (None, kind):
                found.append(mnt)
    return sorted(found, reverse=True)


def unmount_all(d, lamina):
    """Unmounts everything below `d`; lamina's EROFS mounts through `lamina
    umount` (`lamina` the binary), so their daemons stop."""
    for m in mounts_under(d, "overlay"):
        sys_umount(m)
    for m in mounts_under(d, "erofs"):
        if subprocess.run([str(lamina), "umount", m], capture_output=True).returncode != 0:
            sys_umount(m)
    for m in mounts_under(d):
        sys_umount(m)


def ancestors():
    """This process and those it descends from (their command lines may name
    the work dir: they are not leftovers)."""
    pids, pid = set(), os.getpid()
    while pid > 1 and pid not in pids:
        pids.add(pid)
        try:
            with open(f"/proc/{pid}/stat") as f:
                pid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            break
    return pids


def running_from(d):
    """Pids of the processes whose command line names `d` or something below it."""
    mine = ancestors()
    return [pid for pid in procs_of(d) if pid not in mine]


def stop_leftovers(d, wait=10):
    """Waits up to `wait` s for the processes running from `d` to exit (lamina
    daemons, shims), then kills those left."""
    end = time.monotonic() + wait
    while running_from(d) and time.monotonic() < end:
        time.sleep(0.1)
    pids = running_from(d)
    if pids:
        log(f"warning: killing leftover processes: {pids}")
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def remove(d):
    """Removes `d`, unless something is still mounted below it (said)."""
    if mounts_under(d):
        log(f"warning: something is still mounted under {d}; left in place")
    else:
        shutil.rmtree(d, ignore_errors=True)
