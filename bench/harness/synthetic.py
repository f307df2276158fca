#!/usr/bin/env python3
"""Synthetic one-layer OCI images for the benchmarks (`bench/fuse.py`,
scripts/bench_scale.sh; standard library only; run as a script).

Usage: synthetic.py small-files --files N --out LAYOUT [--tag TAG] [--seed S] [--metadata varied]
       synthetic.py big-file --mib M --out LAYOUT [--tag TAG] [--seed S]

small-files: N regular files of 100-3,000 bytes (uniform, seeded), 1,000 per
  directory (d000000/f000.bin, ...); every file starts with its own index, the
  rest is a slice of a 64 KiB random pool, so no two files are equal (lamina
  dedups identical chunks) while gzip still finds some repeats. Every file
  has the same mtime, and every directory the same 1,000 names: metadata
  that compresses about 12x. `--metadata varied` gives each file a name of
  its own (`NNN-` and 6-14 seeded random lowercase letters, one of 8
  extensions) and an mtime spread over a year, as files built at different
  times have: metadata that repeats less (issue 44 found a check's
  1M-file image sent twice the bytes before its first read). LAYOUT/probe
  then names the file at the place of d{N/2000}/f500.bin.
big-file: one file data/random.bin of M MiB of seeded random bytes
  (incompressible, so zstd and gzip cannot shortcut the reads).

The tar layer is written by tarfile in streaming mode straight into a gzip
(level 1) compressor, hashing both streams on the way, so memory stays small
at any N. Then the layout is written by hand: blobs/sha256/*, the config
(rootfs.diff_ids = sha256 of the uncompressed tar), the manifest, index.json
(tag as org.opencontainers.image.ref.name) and oci-layout. The layout is
written to LAYOUT.tmp and renamed, and a file LAYOUT/bench-params.json records
the parameters: a benchmark reuses a layout whose parameters match.
"""

import argparse
import hashlib
import json
import os
import random
import shutil
import sys
import tarfile
import zlib

MTIME = 1_700_000_000


class GzipHashWriter:
    """File-like sink: hashes what it is given (the tar), gzips it to `path`, hashes that."""

    def __init__(self, path):
        self.f = open(path, "wb")
        self.raw = hashlib.sha256()
        self.gz = hashlib.sha256()
        self.z = zlib.compressobj(1, zlib.DEFLATED, 31)  # 31: gzip header
        self.size = 0

    def _out(self, b):
        if b:
            self.gz.update(b)
            self.f.write(b)
            self.size += len(b)

    def write(self, b):
        self.raw.update(b)
        self._out(self.z.compress(b))
        return len(b)

    def close(self):
        self._out(self.z.flush())
        self.f.close()


class RandomReader:
    """A file-like of `n` seeded random bytes."""

    def __init__(self, n, seed):
        self.left = n
        self.rng = random.Random(seed)

    def read(self, size=-1):
        if size < 0 or size > self.left:
            size = self.left
        self.left -= size
        return self.rng.randbytes(size)


def tarinfo(name, size=0, is_dir=False):
    ti = tarfile.TarInfo(name)
    ti.mtime = MTIME
    ti.uid = ti.gid = 0
    ti.uname = ti.gname = "root"
    if is_dir:
        ti.type = tarfile.DIRTYPE
        ti.mode = 0o755
    else:
        ti.size = size
        ti.mode = 0o644
    return ti


EXTENSIONS = ("py", "pyc", "so", "h", "js", "json", "txt", "md")


def varied_name(rng, k):
    """A name of its own: `NNN-` (unique in the directory) and a random stem."""
    stem = "".join(rng.choices("abcdefghijklmnopqrstuvwxyz", k=rng.randint(6, 14)))
    return f"{k:03d}-{stem}.{rng.choice(EXTENSIONS)}"


def write_small_files(tf, n, seed, varied=False):
    """Returns the path of the file at the place of d{n/2000}/f500.bin."""
    rng = random.Random(seed)
    names = random.Random(seed + 1)  # its own stream: the regular image's bytes stay as they were
    pool = rng.randbytes(65536)
    per_dir = 1000
    probe = None
    for d in range((n + per_dir - 1) // per_dir):
        tf.addfile(tarinfo(f"d{d:06d}", is_dir=True))
        for k in range(min(per_dir, n - d * per_dir)):
            i = d * per_dir + k
            size = rng.randint(100, 3000)
            off = rng.randrange(0, len(pool) - size)
            head = i.to_bytes(8, "little")
            data = head + pool[off:off + size - len(head)]
            ti = tarinfo(f"d{d:06d}/{varied_name(names, k) if varied else f'f{k:03d}.bin'}", size)
            if varied:
                ti.mtime = MTIME - names.randrange(365 * 86400)
            if d == n // 2000 and k == 500:
                probe = ti.name
            tf.addfile(ti, _Bytes(data))
        if d % 100 == 99:
            print(f"[image] {(d + 1) * per_dir} files", file=sys.stderr, flush=True)
    return probe


class _Bytes:
    def __init__(self, b):
        self.b = b

    def read(self, size=-1):
        b, self.b = (self.b, b"") if size < 0 else (self.b[:size], self.b[size:])
        return b


def write_big_file(tf, mib, seed):
    tf.addfile(tarinfo("data", is_dir=True))
    n = mib << 20
    tf.addfile(tarinfo("data/random.bin", n), RandomReader(n, seed))


def blob(layout, data):
    d = hashlib.sha256(data).hexdigest()
    with open(os.path.join(layout, "blobs", "sha256", d), "wb") as f:
        f.write(data)
    return f"sha256:{d}", len(data)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("kind", choices=["small-files", "big-file"])
    ap.add_argument("--files", type=int, default=1_000_000)
    ap.add_argument("--mib", type=int, default=512)
    ap.add_argument("--out", required=True)
    ap.add_argument("--tag", default="bench")
    ap.add_argument("--seed", type=int, default=9)
    ap.add_argument("--metadata", choices=["regular", "varied"], default="regular")
    a = ap.parse_args()
    params = {"kind": a.kind, "tag": a.tag, "seed": a.seed, "version": 1,
              **({"files": a.files} if a.kind == "small-files" else {"mib": a.mib}),
              **({"metadata": "varied"} if a.metadata == "varied" else {})}
    out = os.path.abspath(a.out)
    pfile = os.path.join(out, "bench-params.json")
    try:
        with open(pfile) as f:
            if json.load(f) == params:
                print(f"[image] reusing {out}", file=sys.stderr)
                return
    except (OSError, ValueError):
        pass
    tmp = out + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(os.path.join(tmp, "blobs", "sha256"))
    layer_tmp = os.path.join(tmp, "layer.tmp")
    w = GzipHashWriter(layer_tmp)
    with tarfile.open(fileobj=w, mode="w|", format=tarfile.GNU_FORMAT) as tf:
        if a.kind == "small-files":
            probe = write_small_files(tf, a.files, a.seed, a.metadata == "varied")
            if probe:
                with open(os.path.join(tmp, "probe"), "w") as f:
                    f.write(probe)
        else:
            write_big_file(tf, a.mib, a.seed)
    w.close()
    layer_digest = f"sha256:{w.gz.hexdigest()}"
    os.rename(layer_tmp, os.path.join(tmp, "blobs", "sha256", w.gz.hexdigest()))
    config = {"architecture": "amd64", "os": "linux", "config": {},
              "rootfs": {"type": "layers", "diff_ids": [f"sha256:{w.raw.hexdigest()}"]}}
    cdig, csize = blob(tmp, json.dumps(config, sort_keys=True).encode())
    manifest = {
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": cdig, "size": csize},
        "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar+gzip",
                    "digest": layer_digest, "size": w.size}],
    }
    mdig, msize = blob(tmp, json.dumps(manifest, sort_keys=True).encode())
    index = {"schemaVersion": 2, "manifests": [{
        "mediaType": "application/vnd.oci.image.manifest.v1+json", "digest": mdig, "size": msize,
        "annotations": {"org.opencontainers.image.ref.name": a.tag}}]}
    with open(os.path.join(tmp, "index.json"), "w") as f:
        json.dump(index, f)
    with open(os.path.join(tmp, "oci-layout"), "w") as f:
        json.dump({"imageLayoutVersion": "1.0.0"}, f)
    with open(os.path.join(tmp, "bench-params.json"), "w") as f:
        json.dump(params, f)
    shutil.rmtree(out, ignore_errors=True)
    os.rename(tmp, out)
    print(f"[image] wrote {out} ({w.size:,} bytes of gzip layer)", file=sys.stderr)


if __name__ == "__main__":
    main()
