"""What every start of the cold-start benchmark runs against: the network
namespace whose `lo` is the shaped link, the registry inside it, the private
containerd, the lamina binary and the work dir; the link's shaping and
calibration, the bytes on it, `lamina convert` of the images, and the
budget of the run (its deadline)."""

import glob
import json
import os
import shutil
import statistics
import time

from ..harness.core import log, run
from .workloads import HEAVY, rate_bps

# the shaped link: tbf on the namespace's lo
TBF_BURST, TBF_LATENCY = "64kb", "50ms"
TBF = f"tbf rate RATE burst {TBF_BURST} latency {TBF_LATENCY}"


class Deadline(Exception):
    pass


class Fixture:
    def __init__(self, lamina, work, ns, registry, ctd, snapshotter_sock, id_prefix, max_seconds,
                 keep_logs=None, mount_args=(), convert_args=()):
        self.lamina = str(lamina)
        self.work = str(work)
        self.ns = ns
        self.registry = registry
        self.reg = registry.address
        self.registry_pid = registry.pid
        self.ctd = ctd
        self.snapshotter_sock = snapshotter_sock
        self.id = id_prefix
        self.keep = keep_logs
        self.mount_args = list(mount_args)
        # Per workload: the tar index with its boot pages, by digest.
        self.boot_indexes = {}
        self.static_indexes = {}
        self.convert_args = list(convert_args)
        self.seq = 0
        self.max_seconds = max_seconds
        self.deadline = time.monotonic() + max_seconds
        spec_dir = os.path.join(self.work, "spec")
        os.makedirs(spec_dir, exist_ok=True)
        run(["runc", "spec"], cwd=spec_dir)
        with open(os.path.join(spec_dir, "config.json")) as f:
            self.spec = json.load(f)

    def next_seq(self):
        self.seq += 1
        return self.seq

    def check_deadline(self):
        if time.monotonic() > self.deadline:
            raise Deadline(f"--max-seconds {self.max_seconds} reached")

    def run_dir(self, seq, what):
        return os.path.join(self.work, "runs", f"{seq:03d}-{what}")

    # -- the link ----------------------------------------------------------------------------
    def tx_bytes(self):
        """Bytes sent on the namespace's lo (requests and responses both cross it)."""
        return self.ns.tx_bytes(self.registry_pid)

    def set_link(self, rate):
        self.ns.shape(rate, TBF_BURST, TBF_LATENCY)

    def calibrate(self, rate, blob_digest, blob_size):
        """The link's payload rate (a Range GET of RATE x 1 s of a layer blob)
        and the latency of a 1-byte Range GET (median of 5)."""
        n = min(int(rate_bps(rate) / 8 * 1.0), blob_size)
        url = f"http://{self.reg}/v2/debian/blobs/{blob_digest}"
        tx0 = self.tx_bytes()
        p = self.ns.run(["curl", "-fsS", "-o", "/dev/null", "-r", f"0-{n - 1}", "-w",
                         "%{size_download} %{time_total}", url])
        size, secs = p.stdout.split()
        wire = self.tx_bytes() - tx0
        lat = []
        for _ in range(5):
            p = self.ns.run(["curl", "-fsS", "-o", "/dev/null", "-r", "0-0", "-w", "%{time_total}", url])
            lat.append(float(p.stdout) * 1000)
        out = {"bytes": int(size), "seconds": float(secs), "MBps": int(size) / float(secs) / 1e6,
               "nominal_MBps": rate_bps(rate) / 8 / 1e6, "wire_bytes": wire,
               "range_request_1byte_ms": statistics.median(lat), "range_request_1byte_ms_runs": lat}
        log(f"link {rate}: {out['MBps']:.2f} MB/s payload ({out['bytes']:,} B in {out['seconds']:.2f} s; "
            f"nominal {out['nominal_MBps']:.2f} MB/s), 1-byte Range GET {out['range_request_1byte_ms']:.1f} ms")
        return out

    # -- images ------------------------------------------------------------------------------
    def lamina_json(self, *args, timeout=600):
        return json.loads(self.ns.run([self.lamina, "--json", *args], timeout=timeout).stdout)

    def ref(self, tag, repo="debian"):
        return f"docker://{self.reg}/{repo}:{tag}"

    def pinned(self, digest, repo="debian"):
        """A reference by digest: how a tar index kept under a tag of its
        own is named with --index (a tag is not trusted to name one)."""
        return f"docker://{self.reg}/{repo}@{digest}"

    @staticmethod
    def tags(workload):
        """(source, lamina, lamina with the workload's boot set) tags of a workload's image."""
        if workload in HEAVY:
            return workload, f"{workload}-lamina", f"{workload}-lamina-boot"
        return "bookworm", "lamina", f"lamina-boot-{workload}"

    @staticmethod
    def static_tag(workload):
        """The tag of a workload's image converted with a boot set known from
        the image alone (`convert --boot-exec`, variant lamina-static)."""
        return f"{workload}-lamina-static"

    def push(self, layout_ref, dst):
        """skopeo copy of an image into the registry, digests kept."""
        self.ns.run(["skopeo", "copy", "--quiet", "--dest-tls-verify=false", "--preserve-digests",
                     layout_ref, dst])

    def convert(self, dst_tag, prefetch=None, src_tag="bookworm", boot_execs=()):
        t = time.perf_counter()
        # convert_args (COLDSTART_CONVERT_ARGS): more `lamina convert` options (to try a setting)
        args = (["convert"] + (["--prefetch", prefetch] if prefetch else [])
                + [a for e in boot_execs for a in ("--boot-exec", e)] + self.convert_args
                + [self.ref(src_tag), self.ref(dst_tag)])
        doc = self.lamina_json(*args)
        secs = time.perf_counter() - t
        blobs = doc.get("blobs") or []
        log(f"convert -> debian:{dst_tag}: {secs:.1f} s, {doc['stats']['chunks_stored']} chunks, "
            f"boot set {doc['stats'].get('boot_set_chunks', 0)} chunks")
        return {"tag": dst_tag, "seconds": secs, "manifest_digest": doc.get("manifest_digest"),
                "metadata_bytes": doc.get("metadata_bytes"),
                "metadata_compressed_bytes": doc.get("metadata_compressed_bytes"),
                "index_bytes": doc.get("index_bytes"), "blob_bytes": sum(b.get("size", 0) for b in blobs),
                "boot_pages": doc.get("boot_pages"), "stats": doc.get("stats")}

    # -- a run's files -----------------------------------------------------------------------
    def keep_logs(self, d, name):
        """With keep_logs: the snapshotter's log in `d` and its mounts' daemon
        logs (ROOT/cache/mounts/*/, or a lamina_run's cache/mounts/*/) to KEEP/name."""
        if not self.keep:
            return
        dst = os.path.join(self.keep, name)
        os.makedirs(dst, exist_ok=True)
        logs = (glob.glob(os.path.join(d, "*.log")) + glob.glob(os.path.join(d, "root", "cache", "mounts", "*", "*.log"))
                + glob.glob(os.path.join(d, "cache", "mounts", "*", "*.log")))
        for src in logs:
            shutil.copy(src, os.path.join(dst, os.path.basename(src)))
