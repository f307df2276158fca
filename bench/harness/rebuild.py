"""A rebuilt image: an OCI layout's image with a few files changed, every
layer written again (other layer and blob digests, mostly identical files),
as a new release of the same application on a patched base would be."""

import gzip
import hashlib
import io
import json
import tarfile
from pathlib import Path

from .core import log


def _blob(layout, digest):
    return Path(layout) / "blobs" / "sha256" / digest.split(":", 1)[1]


def _put(layout, data):
    digest = hashlib.sha256(data).hexdigest()
    path = Path(layout) / "blobs" / "sha256" / digest
    if not path.exists():
        tmp = path.with_suffix(".tmp")
        tmp.write_bytes(data)
        tmp.rename(path)
    return f"sha256:{digest}", len(data)


def _changed(name, every):
    """Whether the rebuild changes this file: one in `every`, by its name's hash."""
    return int(hashlib.sha256(name.encode()).hexdigest()[:8], 16) % every == 0


def _rewrite_layer(data, every):
    """The layer's tar again with one regular file in `every` changed (same
    size, its first byte flipped); (gzip bytes, diff_id, files changed,
    bytes in them)."""
    out = io.BytesIO()
    changed = changed_bytes = 0
    with tarfile.open(fileobj=io.BytesIO(gzip.decompress(data))) as src, \
            tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as dst:
        for member in src:
            body = src.extractfile(member).read() if member.isreg() else None
            if body and _changed(member.name, every):
                body = bytes([body[0] ^ 0xFF]) + body[1:]
                changed += 1
                changed_bytes += len(body)
            dst.addfile(member, io.BytesIO(body) if body is not None else None)
    tar = out.getvalue()
    return gzip.compress(tar, compresslevel=6, mtime=1), f"sha256:{hashlib.sha256(tar).hexdigest()}", \
        changed, changed_bytes


def rebuild(layout, tag, new_tag, every=50):
    """Adds `new_tag` to `layout`: `tag`'s image with one regular file in
    `every` changed; what changed, as a dict."""
    index_path = Path(layout) / "index.json"
    index = json.loads(index_path.read_text())
    entry = next(m for m in index["manifests"]
                 if m.get("annotations", {}).get("org.opencontainers.image.ref.name") == tag)
    manifest = json.loads(_blob(layout, entry["digest"]).read_bytes())
    config = json.loads(_blob(layout, manifest["config"]["digest"]).read_bytes())
    files = nbytes = 0
    diff_ids = []
    for layer in manifest["layers"]:
        gz, diff_id, n, b = _rewrite_layer(_blob(layout, layer["digest"]).read_bytes(), every)
        layer["digest"], layer["size"] = _put(layout, gz)
        diff_ids.append(diff_id)
        files, nbytes = files + n, nbytes + b
    config["rootfs"]["diff_ids"] = diff_ids
    manifest["config"]["digest"], manifest["config"]["size"] = _put(layout, json.dumps(config).encode())
    digest, size = _put(layout, json.dumps(manifest).encode())
    index["manifests"] = [m for m in index["manifests"]
                          if m.get("annotations", {}).get("org.opencontainers.image.ref.name") != new_tag]
    index["manifests"].append({"mediaType": entry["mediaType"], "digest": digest, "size": size,
                               "annotations": {"org.opencontainers.image.ref.name": new_tag}})
    tmp = index_path.with_suffix(".tmp")
    tmp.write_text(json.dumps(index))
    tmp.rename(index_path)
    log(f"{layout}:{new_tag}: {files} files changed ({nbytes} bytes)")
    return {"files_changed": files, "bytes_in_changed_files": nbytes}
