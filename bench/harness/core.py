"""What every benchmark shares: logging, commands, timing, the machine and
one results schema.

A results file is one JSON document:

    {"schema": "lamina-bench/1", "benchmark": NAME, "quick": bool,
     "machine": {...}, "commit": SHA, "date": ISO-8601, "config": {...},
     "runs": [{...raw figures of one measurement...}, ...],
     "summary": {...}, "targets": [{"name", "value", "bound", "op", "met"}],
     "not_measured": {WHAT: WHY}, "seconds": total}

`runs` keeps every raw figure; `summary` and `targets` are derived from them
(report.py renders both). A benchmark may add `anomalies`: what went wrong
during the run and was worked around. It is written atomically: a run that fails
leaves the previous file in place.
"""

import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCHEMA = "lamina-bench/1"


def log(msg):
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


def run(cmd, timeout=600, check=True, netns=None, **kw):
    """Runs `cmd` (in network namespace `netns` when given, through nsenter
    --net so mounts stay visible to the host); its CompletedProcess, text."""
    argv = [str(a) for a in cmd]
    if netns:
        argv = ["nsenter", f"--net=/run/netns/{netns}"] + argv
    r = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, **kw)
    if check and r.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} exited {r.returncode}: {r.stderr.strip()[-2000:]}")
    return r


def timed(fn, *args, **kw):
    """(seconds, result) of fn(*args, **kw), wall clock."""
    t = time.perf_counter()
    result = fn(*args, **kw)
    return time.perf_counter() - t, result


def stats(values):
    """Median, min and max of a list of numbers (None when empty)."""
    if not values:
        return None
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def machine():
    """Where the figures were measured."""
    info = {
        "nproc": os.cpu_count(),
        "kernel": platform.release(),
        "arch": platform.machine(),
    }
    for path, key, field in (("/proc/cpuinfo", "model name", "cpu"), ("/proc/meminfo", "MemTotal:", "mem_total")):
        try:
            for line in Path(path).read_text().splitlines():
                if line.startswith(key):
                    info[field] = line.split(":", 1)[1].strip()
                    break
        except OSError:
            pass
    try:
        info["loadavg_at_start"] = Path("/proc/loadavg").read_text().split()[:3]
    except OSError:
        pass
    return info


def commit():
    r = subprocess.run(["git", "-C", str(ROOT), "describe", "--always", "--dirty", "--abbrev=40"],
                       capture_output=True, text=True)
    return r.stdout.strip() or "unknown"


class Results:
    """One benchmark's results document, built up run by run."""

    def __init__(self, benchmark, config, quick=False):
        self.started = time.monotonic()
        self.doc = {
            "schema": SCHEMA,
            "benchmark": benchmark,
            "quick": quick,
            "machine": machine(),
            "commit": commit(),
            "date": datetime.datetime.now(datetime.timezone.utc).replace(microsecond=0).isoformat(),
            "config": config,
            "runs": [],
            "summary": {},
            "targets": [],
            "not_measured": {},
        }

    @classmethod
    def of(cls, doc):
        """The results of a document already written (to derive its
        summary and targets again from its raw runs)."""
        results = cls.__new__(cls)
        results.started = time.monotonic()
        results.doc = doc
        return results

    def add_run(self, **figures):
        self.doc["runs"].append(figures)

    def target(self, name, value, op, bound):
        met = None if value is None else (value <= bound if op == "<=" else value >= bound)
        self.doc["targets"].append({"name": name, "value": value, "op": op, "bound": bound, "met": met})

    def write(self, path):
        self.doc["seconds"] = round(time.monotonic() - self.started, 1)
        path = Path(path)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(self.doc, indent=1, sort_keys=False) + "\n")
        tmp.rename(path)
        log(f"results in {path}")
