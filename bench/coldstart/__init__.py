"""Cold start: the time from "start" to the first useful output of a
container of the reference Debian image, pulled from a registry over a
shaped link (docs/coldstart.md; moved from scripts/coldstart.sh), with

  containerd        containerd's full pull + unpack (`ctr image pull`), then `ctr run`
  lamina            `lamina mount` (lazy) + overlayfs + `runc run`, no boot set
  lamina-boot       the same with a boot set recorded for the workload (`convert --prefetch`)
  snapshotter(-boot)  lamina snapshotter under the same containerd (`ctr-remote image
                    rpull`, then `ctr-remote run`), without and with the boot set
  run(-boot)        `lamina run`, without and with the boot set
  proxy, faults, faults-nohedge  lamina through tests/tools/faultproxy.py: spoiling
                    nothing, the demo's fault mix, the mix with --no-hedge
  local             the heavy images' limit: the start from the image unpacked on local disk
  index(-boot)      `lamina mount` of the unmodified tag through its tar index (`lamina
                    index`), without and with boot pages
  lamina-nopredict  `lamina` with `--predict-max 0` (no predicted misses), to weigh
                    what predictions cost and save in the same run
  lamina-static     `lamina` on the image converted with `--boot-exec` (the workload's programs):
                    a boot set known from the image alone, no recorded start
  index-static      `index` through a tar index made with `--boot-exec` (python only)
  lamina-boot-ra32, lamina-boot-ra128  `lamina-boot` with `--readahead 32` / `128`
                    (the boot set still recorded at 0): what readahead costs a boot-set start
  lamina-rests      `lamina` with `--fetch-rests` (the rest of a blob a start waited long
                    on, fetched beside its misses on a fast link)
  lamina-base       `lamina` mounted by another build, the binary LAMINA_BASE_BIN names
                    (main before a change), to weigh a change against it in one run
  lamina-base-boot  `lamina-boot` mounted by that build
  docker-index      dockerd (containerd image store, storage driver lamina) pulls and
                    runs the unmodified tag (python only)

per link rate and workload: python (python3 -c 'print("hello")'), nginx (first
HTTP 200), redis (first +PONG), readall (every file read, then "hello"; no
boot set, links of 100mbit and more only), datasci and node (the heavy
images of scripts/heavy-image.sh, with containerd, lamina, lamina-boot and
local only). Also the idle memory of the snapshotter with N images mounted.

Method: a network namespace whose lo (mtu 1500) is shaped by tbf at the
link's rate (burst 64kb, latency 50ms) holds a docker-registry and every
client of it (skopeo, lamina, `ctr image pull`); containerd is a private
instance on the host (its own root, state and socket in the work dir). The
page cache is dropped before every cold start; then a second container of
the same image is started and timed alike. Bytes: the namespace's lo tx and
lamina's fetched_bytes. Per link: a throughput check and the latency of a
1-byte Range GET. See images.py, starts_lamina.py, starts_containerd.py.

Options (--set KEY=VALUE; defaults as scripts/coldstart.sh had them):
  links=1gbit,100mbit,10mbit  runs=3  slow_runs=1 (containerd runs on links below
  100mbit)  workloads=python,nginx,redis,readall  readall_runs=1
  variants=containerd,lamina,lamina-boot,snapshotter,snapshotter-boot,run,run-boot,
  proxy,faults,faults-nohedge,local  idle_images=20 (0: skip)  max_minutes=60 (the
  measurements stop there: the results are written, marked incomplete, and the
  command fails; a start that fails is listed in failed_runs and the run goes
  on)  containerd=BIN (a containerd to measure: its directory goes first on
  PATH)  keep_logs=DIR (containerd at debug level, the snapshotter,
  its mounts' daemons and `lamina mount`'s at LAMINA_LOG=debug; their logs
  copied to DIR, a directory per start)
  mount_args=... / convert_args=... (more `lamina mount` / `lamina convert`
  options, to try a setting; default: $COLDSTART_MOUNT_ARGS / $COLDSTART_CONVERT_ARGS)
--quick: links=100mbit runs=1 workloads=python variants=containerd,lamina,lamina-boot
idle_images=0 max_minutes=20.

Results: `runs` holds every start (link, workload, variant, run and its
figures); beside them the set-up's raw figures (image, images, lamina_image,
setup: conversions and boot sets, links: calibration, idle); `summary`
(medians, ratios, limits) and `targets` are derived from them (summary.py),
which also reads the old driver's schema-1 files. With the default --out the
tables in docs/coldstart.md are regenerated; with --out
docs/coldstart-heavy-results.json those of docs/coldstart-heavy.md.
"""

import os
import re
import shutil
import signal
import subprocess
import types
from pathlib import Path

from ..harness import workdir
from ..harness.containerd import Containerd, use_binary
from ..harness.core import ROOT, log, run
from ..harness.measure import ANOMALIES, MachineWatch, cpu_stat, image_info, machine_info, own_cpu
from ..harness.netns import Namespace
from ..harness.registry import DEBIAN_LAYOUT, DEBIAN_TAG, Registry, debian_layout
from . import images
from .fixture import TBF, Deadline, Fixture
from .plot import plot
from .starts_containerd import DOCKER_DIR, containerd_run, docker_bins, docker_run, idle_footprint, snapshotter_run
from .starts_lamina import lamina_faults, lamina_run, lamina_run_cmd, local_run
from .summary import derive, view
from .tables import tables
from .workloads import HEAVY, HEAVY_LAYOUT, HEAVY_VARIANTS, READALL_MIN_BPS, WORKLOADS, rate_bps

VARIANTS = ("containerd", "lamina", "lamina-boot", "snapshotter", "snapshotter-boot", "run", "run-boot",
            "proxy", "faults", "faults-nohedge", "local", "index", "index-boot", "docker-index",
            "lamina-nopredict", "lamina-boot-ra32", "lamina-boot-ra128", "lamina-static", "index-static", "lamina-all", "lamina-base",
            "lamina-rests", "lamina-base-boot")
DEFAULTS = {"links": "1gbit,100mbit,10mbit", "runs": "3", "slow_runs": "1",
            "workloads": "python,nginx,redis,readall", "readall_runs": "1", "variants": ",".join(VARIANTS[:11]),
            "idle_images": "20", "max_minutes": "60", "containerd": "", "keep_logs": ""}
QUICK = {"links": "100mbit", "runs": "1", "workloads": "python", "variants": "containerd,lamina,lamina-boot",
         "idle_images": "0", "max_minutes": "20"}
BEGIN = "<!-- coldstart-tables:begin -->"
END = "<!-- coldstart-tables:end -->"


def options(quick, given):
    """The run's options: defaults, --quick, then --set KEY=VALUE; checked."""
    o = dict(DEFAULTS, mount_args=os.environ.get("COLDSTART_MOUNT_ARGS", ""),
             convert_args=os.environ.get("COLDSTART_CONVERT_ARGS", ""), **(QUICK if quick else {}))
    for key, value in given.items():
        if key not in o:
            raise SystemExit(f"bench coldstart: no option {key} (they are in bench/coldstart/__init__.py)")
        o[key] = value

    def listed(key, choices):
        items = o[key].split(",")
        if not o[key] or any(x not in choices for x in items):
            raise SystemExit(f"bench coldstart: {key}: choose from {', '.join(choices)}")
        return items
    for key in ("runs", "slow_runs", "readall_runs", "max_minutes", "idle_images"):
        if not re.fullmatch(r"[0-9]+", o[key]) or (key != "idle_images" and int(o[key]) == 0):
            raise SystemExit(f"bench coldstart: {key} wants a {'number' if key == 'idle_images' else 'positive integer'}")
    if not re.fullmatch(r"[0-9]+[kmg]bit(,[0-9]+[kmg]bit)*", o["links"]):
        raise SystemExit("bench coldstart: links wants rates like 1gbit,100mbit,10mbit")
    asked = listed("variants", VARIANTS)
    return types.SimpleNamespace(
        links=o["links"].split(","), workloads=listed("workloads", WORKLOADS),
        variants=[v for v in VARIANTS if v in asked],
        **{k: int(o[k]) for k in ("runs", "slow_runs", "readall_runs", "max_minutes", "idle_images")},
        containerd=o["containerd"], keep_logs=o["keep_logs"],
        mount_args=o["mount_args"].split(), convert_args=o["convert_args"].split())


def measure(results, lamina, work, quick, given):
    o = options(quick, given)
    if o.containerd:
        use_binary(o.containerd)
    keep = None
    if o.keep_logs:
        keep = Path(o.keep_logs).resolve()
        keep.mkdir(parents=True, exist_ok=True)
    debian_layout()
    if set(o.workloads) & set(HEAVY):
        run(["bash", ROOT / "scripts" / "heavy-image.sh", HEAVY_LAYOUT], timeout=3600)
    doc = results.doc
    doc["machine"] = machine_info(str(lamina.path), ("containerd", "runc", "docker-registry", "skopeo", "iproute2",
                                                     "curl", "stargz-snapshotter"))
    watch = MachineWatch()
    # SIGTERM as Ctrl-C: the runs and the fixtures clean up on the way out
    on_term = signal.signal(signal.SIGTERM, stop)
    fixtures = {}
    try:
        b = set_up(fixtures, lamina, Path(work), o, keep)
        measure_all(b, o, doc)
    finally:
        tear_down(fixtures, lamina, Path(work), keep)
        signal.signal(signal.SIGTERM, on_term)
    m = doc["machine"]
    watch.note_end(m)
    # busy CPU-seconds of the whole machine during the run (containerd, lamina daemons,
    # containers and everything else), and those of this driver and its direct children
    m["busy_cpu_s_during_bench"] = round(cpu_stat()[0] - watch.busy0, 1)
    m["driver_cpu_s"] = round(own_cpu() - watch.own0, 1)
    doc["anomalies"] = list(ANOMALIES)
    derive(doc)
    if doc["incomplete"]:
        log(f"stopped early: {doc['incomplete']}")


def stop(signum, _frame):
    raise SystemExit(128 + signum)


def set_up(fixtures, lamina, work, o, keep):
    """The network namespace (lo shaped later, per link), the registry in
    it, the private containerd; each in `fixtures` as soon as it exists
    (tear_down stops what is there)."""
    name = f"lamina-cs-{os.getpid()}"
    log(f"work dir {work}, network namespace {name}")
    ns = fixtures["ns"] = Namespace(name)
    # the registry and every process talking to it run in the namespace
    registry = fixtures["registry"] = Registry(work / "registry", netns=name)
    log(f"registry {registry.address} in {name} (pid {registry.pid})")
    sock = str(work / "snapshotter.sock")  # lamina snapshotter: one per run, always on this socket
    ctd = fixtures["containerd"] = Containerd(work / "containerd", sock, debug=bool(keep))
    fixtures["id"] = name  # prefix of every runc / ctr container id
    return Fixture(lamina.path, work, ns, registry, ctd, sock, name, o.max_minutes * 60, keep_logs=keep,
                   mount_args=o.mount_args, convert_args=o.convert_args)


def tear_down(fixtures, lamina, work, keep):
    """Removes everything the run made but the work dir (containers, mounts,
    containerd, registry, leftover processes, namespace), each step tried
    whatever the one before did; a second Ctrl-C does not cut it short."""
    handlers = {s: signal.signal(s, signal.SIG_IGN) for s in (signal.SIGINT, signal.SIGTERM)}
    ctd = fixtures.get("containerd")
    steps = [
        ("containerd's log", lambda: keep and ctd and shutil.copy(ctd.dir / "containerd.log", keep)),
        ("runc containers", lambda: delete_runc_containers(fixtures.get("id"))),
        ("containerd", lambda: ctd and ctd.stop()),
        ("mounts", lambda: workdir.unmount_all(work, lamina.path)),
        ("registry", lambda: "registry" in fixtures and fixtures["registry"].stop()),
        ("processes", lambda: workdir.stop_leftovers(work)),
        ("network namespace", lambda: "ns" in fixtures and fixtures["ns"].delete()),
    ]
    try:
        for what, step in steps:
            try:
                step()
            except Exception as e:  # noqa: BLE001 - the rest of the cleanup still goes
                log(f"warning: cleaning up {what}: {e}")
    finally:
        for s, h in handlers.items():
            signal.signal(s, h)
    log(f"cleaned up (containers, mounts, containerd, registry, namespace {fixtures.get('id')})")


def delete_runc_containers(prefix):
    if not prefix:
        return
    for c in run(["runc", "list", "-q"], check=False).stdout.split():
        if c.startswith(prefix + "-") and run(["runc", "delete", "--force", c], check=False).returncode:
            log(f"warning: runc delete {c} failed")


def measure_all(b, o, doc):
    """The images (unshaped), the idle footprint, then per link its
    calibration and the starts (variants in a rotating order)."""
    img = doc["image"] = image_info(DEBIAN_LAYOUT, DEBIAN_TAG)
    cd_runs = {link: (o.runs if rate_bps(link) >= 100 * 10**6 else min(o.slow_runs, o.runs)) for link in o.links}
    doc["config"].update(links=o.links, runs=o.runs, containerd_runs=cd_runs, workloads=o.workloads,
                         variants=o.variants, peers=images.peer_snapshotters(), containerd=b.ctd.version, tbf=TBF,
                         lo_mtu=1500, fill_window=images.mount_default(b.lamina, "--fill-window"),
                         ready_probe_interval_s=0.01, mount_args=o.mount_args, convert_args=o.convert_args)
    doc.update(setup={}, links={}, incomplete=None, failed_runs=[])
    if "docker-index" in o.variants and not docker_bins():
        doc["not_measured"]["docker-index"] = f"no dockerd and docker in {DOCKER_DIR} or on PATH"
    b.set_link(None)
    local = images.prepare(b, doc, DEBIAN_LAYOUT, DEBIAN_TAG, HEAVY_LAYOUT)
    if o.idle_images and any(v.startswith("snapshotter") for v in o.variants):
        doc["idle"] = idle_footprint(b, images.idle_images(b, DEBIAN_LAYOUT, DEBIAN_TAG, o.idle_images))
    try:
        for link in o.links:
            b.set_link(link)
            big = max(img["layers"], key=lambda x: x["size"])
            doc["links"][link] = b.calibrate(link, big["digest"], big["size"])
            measure_link(b, o, doc, link, cd_runs[link], local)
    except Deadline as e:
        doc["incomplete"] = str(e)
    finally:
        b.set_link(None)


def measure_link(b, o, doc, link, cd_runs, local):
    for i in range(o.runs):
        for wi, w in enumerate(o.workloads):
            k = (i + wi) % len(o.variants)
            for v in o.variants[k:] + o.variants[:k]:
                if skipped(v, w, i, link, o, cd_runs):
                    continue
                b.check_deadline()
                with open("/proc/loadavg") as f:
                    load = float(f.read().split()[0])
                try:
                    rec = start(b, v, w, local)
                except (TimeoutError, OSError, subprocess.SubprocessError) as e:
                    # One start that fails (a workload with no output in its
                    # 300 s) is a figure of the run, not the end of it.
                    doc["failed_runs"].append(dict(link=link, workload=w, variant=v, run=i + 1, error=str(e)))
                    log(f"{link} {w} {v} run {i + 1}: failed: {e}")
                    continue
                rec.update(link=link, workload=w, variant=v, run=i + 1, loadavg_1min_before=load)
                doc["runs"].append(rec)
                extra = "" if v == "containerd" else (
                    f", fetched {rec.get('fetched_bytes') or 0:,} B in "
                    f"{rec.get('requests')} requests / {rec.get('misses')} misses")
                log(f"{link} {w} {v} run {i + 1}: {rec['time_s']:.3f} s, wire {rec['wire_bytes']:,} B"
                    f"{extra}; 2nd container {rec['second']['time_s']:.3f} s")


def skipped(v, w, i, link, o, cd_runs):
    """Whether run i of variant v and workload w has no place at `link`."""
    if v == "containerd" and i >= cd_runs:
        return True
    if w == "readall" and (v.endswith("-boot") or i >= o.readall_runs or rate_bps(link) < READALL_MIN_BPS):
        return True
    if w in HEAVY and v not in HEAVY_VARIANTS:
        return True  # the heavy images run with HEAVY_VARIANTS only
    if v == "local" and w not in HEAVY:
        return True
    return v == "docker-index" and (w != "python" or not docker_bins())  # without dockerd: not_measured


def start(b, v, w, local):
    """One cold start (and its second container) of variant v: its record."""
    tag = b.tags(w)[2] if v.endswith("-boot") or v.startswith("lamina-boot-") else b.tags(w)[1]
    if v == "local":
        return local_run(b, w, local[w])
    if v == "containerd":
        return containerd_run(b, w)
    if v.startswith("snapshotter"):
        return snapshotter_run(b, tag, w)
    if v.startswith("run"):
        return lamina_run_cmd(b, tag, w)
    if v == "proxy":
        return lamina_faults(b, w, hedge=True, mode=["none"])
    if v.startswith("faults"):
        return lamina_faults(b, w, hedge=v == "faults")
    if v == "index":
        return lamina_run(b, v, w, ref=b.ref("bookworm"))
    if v == "docker-index":
        return docker_run(b, w)
    if v == "index-boot":
        return lamina_run(b, v, w, ref=b.ref("bookworm"), mount_args=["--index", b.boot_indexes[w]])
    if v == "index-static":
        return lamina_run(b, v, w, ref=b.ref("bookworm"), mount_args=["--index", b.static_indexes[w]])
    if v in ("lamina-base", "lamina-base-boot"):
        base = os.environ.get("LAMINA_BASE_BIN")
        if not base or not os.access(base, os.X_OK):
            raise SystemExit("variant lamina-base: set LAMINA_BASE_BIN to a lamina binary to compare with")
        return lamina_run(b, tag, w, binary=base)
    if v == "lamina-rests":
        return lamina_run(b, tag, w, mount_args=["--fetch-rests"])
    if v == "lamina-nopredict":
        return lamina_run(b, tag, w, mount_args=["--predict-max", "0"])
    if v == "lamina-static":
        return lamina_run(b, b.static_tag(w), w)
    if v == "lamina-all":
        return lamina_run(b, tag, w, mount_args=["--prefetch", "all"])
    if v.startswith("lamina-boot-ra"):
        return lamina_run(b, tag, w, mount_args=["--readahead", v.removeprefix("lamina-boot-ra")])
    return lamina_run(b, tag, w)


def render(doc, plot_path):
    if "medians" not in (doc.get("summary") or {}):
        derive(doc)
    r = view(doc)
    plot(r, plot_path)
    return tables(r)


BENCHMARK = {
    "out": ROOT / "docs" / "coldstart-results.json",
    "plot": ROOT / "docs" / "coldstart.png",
    "tables_in": "docs/coldstart.md",
    # the other results files whose tables a doc carries
    "tables_of": {"docs/coldstart-heavy-results.json": "docs/coldstart-heavy.md"},
    "markers": (BEGIN, END),
    "needs": ["ip", "tc", "nsenter", "containerd", "containerd-shim-runc-v2", "ctr", "ctr-remote", "runc", "skopeo",
              "docker-registry", "jq", "curl", "findmnt"],
    "measure": measure,
    "derive": derive,
    "render": render,
}
