"""The lamina binary under test and its mounts, in the host's network
namespace or a fleet node's."""

import json
import os
import subprocess
import time
from pathlib import Path

from .core import ROOT, log, run


def binary():
    """LAMINA_BIN when set (to compare two builds), else the release build,
    made through cargo first: a binary older than the sources would measure
    code that is gone (a no-op when it is up to date)."""
    given = os.environ.get("LAMINA_BIN")
    if given:
        path = Path(given).resolve()
        if not os.access(path, os.X_OK):
            raise SystemExit(f"LAMINA_BIN={given} is not an executable")
        log(f"measuring {path} (LAMINA_BIN)")
        return path
    log("building lamina (release)")
    cargo_env = Path.home() / ".cargo" / "env"
    prefix = f". {cargo_env} && " if cargo_env.exists() else ""
    subprocess.run(["bash", "-c", f"{prefix}cargo build --release -q -p lamina-cli"], cwd=ROOT, check=True)
    target = Path(os.environ.get("CARGO_TARGET_DIR", ROOT / "target"))
    return (target / "release" / "lamina").resolve()


class Lamina:
    def __init__(self, path):
        self.path = Path(path)
        self.mounts = []

    def __call__(self, *args, netns=None, timeout=1200):
        return run([self.path, *args], timeout=timeout, netns=netns)

    def json(self, *args, netns=None, timeout=1200):
        return json.loads(self(*args, "--json", netns=netns, timeout=timeout).stdout)

    def mount(self, image, mnt, cache, *extra, netns=None):
        """A lazy mount; its `--json` report."""
        Path(mnt).mkdir(parents=True, exist_ok=True)
        info = self.json("mount", "--lazy", *extra, image, mnt, "--cache-dir", cache, netns=netns, timeout=300)
        self.mounts.append(str(mnt))
        return info

    def status(self, cache):
        """The live mounts of `cache`, as `lamina status --json` lists them."""
        return self.json("status", "--cache-dir", cache, timeout=60)

    def figures(self, cache, mnt):
        """The worker's figures of the mount at `mnt` (`status` of `lamina
        status --json`)."""
        for m in self.status(cache):
            if m.get("mountpoint") == str(mnt):
                return m.get("status") or {}
        raise RuntimeError(f"no live mount at {mnt} in {cache}")

    def umount(self, mnt):
        run([self.path, "umount", mnt], timeout=120, check=False)
        if str(mnt) in self.mounts:
            self.mounts.remove(str(mnt))

    def umount_all(self):
        for m in reversed(list(self.mounts)):
            self.umount(m)

    def wait_complete(self, cache, limit=600):
        """Waits until every mount of `cache` holds all its blobs (`lamina
        status`: every blob complete); the seconds it took."""
        started = time.monotonic()
        while time.monotonic() - started < limit:
            mounts = [m.get("status") or {} for m in self.status(cache)]
            if mounts and all(m.get("blobs") and all(b["complete"] for b in m["blobs"]) for m in mounts):
                return time.monotonic() - started
            time.sleep(0.2)
        raise RuntimeError(f"{cache}: prefetch not over after {limit} s")
