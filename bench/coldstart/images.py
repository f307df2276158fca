"""The images of the cold-start benchmark, made on the unshaped link before
anything is timed: the source image pushed into the registry (skopeo),
converted there by `lamina convert` (tag `lamina`), its tar index (`lamina
index`) for the index variants, the heavy images, and per workload a boot
set (`lamina mount --record-trace` of `lamina`, two starts to their first
useful output) and the conversion with it (`--prefetch TRACE`, tag
`lamina-boot-WORKLOAD`); the N distinct images of the idle footprint."""

import gzip
import hashlib
import io
import json
import os
import shutil
import subprocess
import tarfile
import time

from ..harness.core import log, run
from ..harness.measure import image_info
from .starts_containerd import DOCKER_DIR, docker_bins
from .starts_lamina import lamina_run
from .workloads import HEAVY, workload_programs


def prepare(b, doc, layout, tag, heavy_layout):
    """Pushes, converts and records what the variants of `doc["config"]`
    start; the setup's figures go into doc ("setup", "lamina_image",
    "images"). Returns the heavy images unpacked on local disk (variant
    local): {workload: rootfs}."""
    cfg, setup = doc["config"], doc["setup"]
    variants, wls = cfg["variants"], cfg["workloads"]
    t = time.perf_counter()
    b.push(f"oci:{layout}:{tag}", b.ref("bookworm"))
    setup["push_source_s"] = time.perf_counter() - t
    if "docker-index" in variants and not docker_bins():
        log(f"docker-index: no dockerd and docker in {DOCKER_DIR} or on PATH: not measured")
    if {"index", "index-boot", "index-static", "docker-index"} & set(variants):
        t = time.perf_counter()
        report = b.lamina_json("index", b.ref("bookworm"))
        setup["index"] = dict(report[0], wall_s=time.perf_counter() - t)
    setup["convert"] = {"lamina": b.convert("lamina")}
    insp = b.lamina_json("inspect", b.ref("lamina"))
    cfg["chunk_size"] = insp.get("chunk_size")
    doc["lamina_image"] = {k: insp.get(k) for k in ("chunk_size", "chunks", "stored_bytes", "compressed_bytes",
                                                    "referenced_bytes", "dedup_ratio")}
    p = b.ns.run(["skopeo", "inspect", "--raw", "--tls-verify=false", b.ref("lamina")])
    doc["lamina_image"]["manifest_layers"] = [
        {"mediaType": x.get("mediaType"), "size": x.get("size")} for x in json.loads(p.stdout).get("layers", [])]
    setup["traces"] = {}
    chunk_size = int(insp.get("chunk_size") or 1 << 18)
    source = chunk_owners(doc["image"], chunk_size) if any(w not in HEAVY for w in wls) else {}
    owners = {w: source for w in wls if w not in HEAVY}
    doc["images"], local = {}, {}
    for w in [w for w in wls if w in HEAVY]:
        owners[w], local[w] = heavy_image(b, doc, heavy_layout, w, chunk_size, "local" in variants)
    for w in [w for w in wls if w != "readall"]:
        boot_set(b, doc, w, owners[w], "index-boot" in variants and w not in HEAVY)
        if "lamina-static" in variants:
            setup["convert"][b.static_tag(w)] = b.convert(b.static_tag(w), src_tag=b.tags(w)[0],
                                                          boot_execs=workload_programs(w))
        if "index-static" in variants and w not in HEAVY:
            args = [a for p in workload_programs(w) for a in ("--boot-exec", p)]
            report = b.lamina_json("index", *args, b.ref("bookworm"), b.ref(f"index-static-{w}"))
            setup.setdefault("index_static", {})[w] = report[0]
            b.static_indexes[w] = b.pinned(report[0]["manifest_digest"])
    return local


def heavy_image(b, doc, layout, w, chunk_size, unpack):
    """A heavy image pushed and converted; its chunks' owners, and its
    rootfs unpacked on local disk when `unpack`."""
    himg = doc["images"][w] = image_info(layout, w)
    b.push(f"oci:{layout}:{w}", b.ref(w))
    doc["setup"]["convert"][b.tags(w)[1]] = b.convert(b.tags(w)[1], src_tag=w)
    rootfs = None
    if unpack:
        rootfs = os.path.join(b.work, f"local-{w}")
        run(["umoci", "unpack", "--image", f"{layout}:{w}", rootfs], timeout=1200)
        rootfs = os.path.join(rootfs, "rootfs")
    return chunk_owners(himg, chunk_size), rootfs


def boot_set(b, doc, w, owners, through_index):
    """Records workload w's boot set and converts with it (with
    `through_index`, also the tar index's boot pages)."""
    setup = doc["setup"]
    trace = os.path.join(b.work, f"trace-{w}.txt")
    _, plain_tag, boot_tag = b.tags(w)
    # Two recorded starts, appended to one trace: a start under runc can
    # read a few pages another start did not; the boot pages get both.
    rec = lamina_run(b, plain_tag, w, record_trace=trace, second=False)
    lamina_run(b, plain_tag, w, record_trace=trace, second=False)
    # lines: CHUNK_DIGEST OFFSET LEN, one per read of data not yet local
    with open(trace) as f:
        reads = [x.split() for x in f.read().splitlines() if x.strip()]
    lines = [r[0] for r in reads]
    files = trace_files(lines, owners)
    setup["traces"][w] = {"reads": len(lines), "distinct_chunks": len(set(lines)),
                          "bytes_read": sum(int(r[2]) for r in reads if len(r) == 3),
                          "bytes": sum(e["bytes"] for e in files), "files": files, "record_run": rec}
    log(f"boot set {w}: {len(lines)} reads in {len(set(lines))} chunks recorded ({rec['fetched_bytes']:,} bytes "
        f"fetched, {rec['time_s']:.2f} s unshaped)")
    setup["convert"][boot_tag] = b.convert(boot_tag, prefetch=trace, src_tag=b.tags(w)[0])
    if through_index:
        orig = b.ref("bookworm")
        itrace = os.path.join(b.work, f"trace-index-{w}.txt")
        for _ in range(2):
            lamina_run(b, "index", w, record_trace=itrace, second=False, ref=orig)
        report = b.lamina_json("index", "--prefetch", itrace, orig, b.ref(f"index-boot-{w}"))
        setup.setdefault("index_boot", {})[w] = report[0]
        b.boot_indexes[w] = b.pinned(report[0]["manifest_digest"])


def chunk_owners(image, chunk_size):
    """sha256 of every chunk of every regular file of the merged source image ->
    [(path, chunk number, bytes)], chunked the way lamina chunks (each file
    starts a new chunk). For reading traces: which files a boot set holds."""
    owners, files = {}, {}
    for layer in image["layers"]:
        path = os.path.join(image["ref"][4:].rsplit(":", 1)[0], "blobs", *layer["digest"].split(":", 1))
        with tarfile.open(path, "r|*") as tar:
            for m in tar:
                name = "/" + os.path.normpath(m.name).lstrip("./")
                base = os.path.basename(name)
                if base.startswith(".wh."):
                    gone = os.path.join(os.path.dirname(name), base[4:])
                    for k in [k for k in files if k == gone or k.startswith(gone + "/")]:
                        del files[k]
                    continue
                if not m.isreg():
                    continue
                f = tar.extractfile(m)
                chunks = []
                while True:
                    data = f.read(chunk_size)
                    if not data:
                        break
                    chunks.append((hashlib.sha256(data).hexdigest(), len(data)))
                files[name] = chunks
    for name, chunks in files.items():
        for i, (dg, n) in enumerate(chunks):
            owners.setdefault(dg, []).append((name, i, n))
    return owners


def trace_files(digests, owners):
    """Files of a trace: [{path, chunks, bytes}], largest first."""
    per = {}
    for dg in dict.fromkeys(digests):
        found = owners.get(dg, [("?", 0, 0)])
        # one chunk can belong to several files (hardlinks, equal files): name them all
        name = " = ".join(sorted({o[0] for o in found}))
        e = per.setdefault(name, {"path": name, "chunks": 0, "bytes": 0})
        e["chunks"] += 1
        e["bytes"] += found[0][2]
    return sorted(per.values(), key=lambda e: -e["bytes"])


def idle_images(b, layout, tag, n):
    """n distinct images: the source image plus a one-file layer naming each,
    pushed and converted (tags idleI:lamina). Returns their references."""
    t = time.perf_counter()
    src = os.path.join(b.work, "idle-oci")
    blobs = os.path.join(src, "blobs", "sha256")
    os.makedirs(blobs, exist_ok=True)
    with open(os.path.join(src, "oci-layout"), "w") as f:
        json.dump({"imageLayoutVersion": "1.0.0"}, f)
    img = image_info(layout, tag)
    with open(os.path.join(layout, "blobs", *img["manifest_digest"].split(":", 1))) as f:
        manifest = json.load(f)
    with open(os.path.join(layout, "blobs", *manifest["config"]["digest"].split(":", 1))) as f:
        config = json.load(f)
    for layer in manifest["layers"]:
        link = os.path.join(blobs, layer["digest"].split(":", 1)[1])
        if not os.path.exists(link):
            os.symlink(os.path.join(layout, "blobs", *layer["digest"].split(":", 1)), link)

    def put(data):
        dg = hashlib.sha256(data).hexdigest()
        with open(os.path.join(blobs, dg), "wb") as f:
            f.write(data)
        return f"sha256:{dg}", len(data)
    index = {"schemaVersion": 2, "manifests": []}
    for i in range(n):
        tar_bytes = io.BytesIO()
        with tarfile.open(fileobj=tar_bytes, mode="w") as t_:
            body = f"idle image {i}\n".encode()
            info = tarfile.TarInfo("etc/lamina-idle-id")
            info.size, info.mtime = len(body), 0
            t_.addfile(info, io.BytesIO(body))
        raw = tar_bytes.getvalue()
        layer_dg, layer_size = put(gzip.compress(raw, mtime=0))
        cfg = json.loads(json.dumps(config))
        cfg["rootfs"]["diff_ids"].append("sha256:" + hashlib.sha256(raw).hexdigest())
        cfg.setdefault("history", []).append({"created_by": f"coldstart idle image {i}"})
        cfg_dg, cfg_size = put(json.dumps(cfg).encode())
        man = json.loads(json.dumps(manifest))
        man["config"].update(digest=cfg_dg, size=cfg_size)
        man["layers"].append({"mediaType": "application/vnd.oci.image.layer.v1.tar+gzip",
                              "digest": layer_dg, "size": layer_size})
        man_dg, man_size = put(json.dumps(man).encode())
        index["manifests"].append({"mediaType": "application/vnd.oci.image.manifest.v1+json",
                                   "digest": man_dg, "size": man_size,
                                   "annotations": {"org.opencontainers.image.ref.name": f"idle{i}"}})
    with open(os.path.join(src, "index.json"), "w") as f:
        json.dump(index, f)
    refs = []
    for i in range(n):
        b.ns.run(["skopeo", "copy", "--quiet", "--dest-tls-verify=false", f"oci:{src}:idle{i}",
                  b.ref("src", f"idle{i}")])
        b.lamina_json("convert", b.ref("src", f"idle{i}"), b.ref("lamina", f"idle{i}"))
        refs.append(f"{b.reg}/idle{i}:lamina")
    log(f"idle: {n} images pushed and converted in {time.perf_counter() - t:.0f} s")
    return refs


def peer_snapshotters():
    """Other lazy-pulling snapshotters found on PATH. None has a variant here
    yet; the results say which were there to be compared."""
    names = ("containerd-stargz-grpc", "containerd-nydus-grpc", "nydusd")
    return {n: shutil.which(n) for n in names}


def mount_default(lamina, flag):
    """The [default: N] of a `lamina mount` option, from its --help."""
    text = subprocess.run([lamina, "mount", "--help"], capture_output=True, text=True).stdout
    at = text.find(flag)
    if at < 0:
        return None
    part = text[at:].split("[default: ", 1)
    return part[1].split("]", 1)[0] if len(part) == 2 else None
