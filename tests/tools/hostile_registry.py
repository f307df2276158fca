#!/usr/bin/env python3
"""A read-only registry that serves an OCI layout as it is, digests unchecked.

Usage:
    hostile_registry.py LAYOUT [--port-file FILE] [--log FILE] [--lifetime SECS]

Listens on 127.0.0.1 (any free port; printed on stdout as `listening PORT`
and written to --port-file) and answers the pull side of the distribution
API for every repository name from the one OCI layout LAYOUT:

    GET/HEAD /v2/                          200, `{}`
    GET/HEAD /v2/<repo>/manifests/<ref>    a tag of LAYOUT/index.json, or a
                                           digest: the blob of that name, with
                                           its mediaType as Content-Type
    GET/HEAD /v2/<repo>/blobs/<digest>     LAYOUT/blobs/<alg>/<hex>; a Range
                                           header `bytes=A-B` (or `A-`) gets a
                                           206 with Content-Range

A blob is whatever the file of that name holds: nothing here checks that it
hashes to its name. That is the point: a test puts one image's bytes under
another image's blob digest and sees what a client makes of it. Manifests
get a truthful Docker-Content-Digest (the sha256 of the bytes served), so a
client that checks it finds nothing wrong there.

Every request is appended as one JSON line (method, path, range, status,
bytes sent) to --log. The server exits after --lifetime seconds (default
600), when its parent process goes away, or on SIGTERM/SIGINT/SIGHUP.
Standard library only.
"""

import argparse
import hashlib
import json
import os
import re
import sys
import threading
from http.server import BaseHTTPRequestHandler

import bounded_server

MANIFEST = re.compile(r"^/v2/(?P<repo>.+)/manifests/(?P<ref>[^/]+)$")
BLOB = re.compile(r"^/v2/(?P<repo>.+)/blobs/(?P<alg>[a-z0-9]+):(?P<hex>[0-9a-f]{32,})$")
RANGE = re.compile(r"^bytes=(\d+)-(\d*)$")
DIGEST = re.compile(r"^([a-z0-9]+):([0-9a-f]{32,})$")
DEFAULT_MANIFEST_TYPE = "application/vnd.oci.image.manifest.v1+json"


def log(msg):
    print(f"hostile_registry: {msg}", file=sys.stderr, flush=True)


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "hostile-registry/1"

    def log_message(self, fmt, *args):  # the JSON log below replaces it
        pass

    def record(self, status, sent, rng=None):
        path = self.server.cfg.log
        if not path:
            return
        line = json.dumps(
            {
                "method": self.command,
                "path": self.path,
                "range": rng,
                "status": status,
                "bytes": sent,
            }
        )
        with self.server.log_lock, open(path, "a") as f:
            f.write(line + "\n")

    def answer(self, status, body, headers=(), rng=None):
        self.send_response(status)
        for k, v in headers:
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Docker-Distribution-API-Version", "registry/2.0")
        self.end_headers()
        sent = 0
        if self.command != "HEAD":
            self.wfile.write(body)
            sent = len(body)
        self.record(status, sent, rng)

    def not_found(self, what):
        body = json.dumps({"errors": [{"code": "NOT_FOUND", "message": what}]}).encode()
        self.answer(404, body, [("Content-Type", "application/json")])

    def blob_file(self, alg, hexdigest):
        return os.path.join(self.server.layout, "blobs", alg, hexdigest)

    def do_HEAD(self):
        self.do_GET()

    def do_GET(self):
        path = self.path.split("?", 1)[0]
        if path in ("/v2", "/v2/"):
            return self.answer(200, b"{}", [("Content-Type", "application/json")])
        m = MANIFEST.match(path)
        if m:
            return self.manifest(m.group("ref"))
        m = BLOB.match(path)
        if m:
            return self.blob(m.group("alg"), m.group("hex"))
        self.not_found(path)

    def manifest(self, ref):
        d = DIGEST.match(ref)
        if d:
            name = self.blob_file(d.group(1), d.group(2))
        else:
            try:
                with open(os.path.join(self.server.layout, "index.json"), "rb") as f:
                    index = json.load(f)
            except (OSError, ValueError) as e:
                return self.not_found(f"index.json: {e}")
            entry = next(
                (
                    m
                    for m in index.get("manifests", [])
                    if m.get("annotations", {}).get("org.opencontainers.image.ref.name") == ref
                ),
                None,
            )
            if entry is None:
                return self.not_found(f"manifest {ref}")
            alg, hexdigest = entry["digest"].split(":", 1)
            name = self.blob_file(alg, hexdigest)
        try:
            with open(name, "rb") as f:
                body = f.read()
        except OSError:
            return self.not_found(f"manifest {ref}")
        try:
            media_type = json.loads(body).get("mediaType") or DEFAULT_MANIFEST_TYPE
        except ValueError:
            media_type = DEFAULT_MANIFEST_TYPE
        digest = "sha256:" + hashlib.sha256(body).hexdigest()
        self.answer(
            200,
            body,
            [("Content-Type", media_type), ("Docker-Content-Digest", digest)],
        )

    def blob(self, alg, hexdigest):
        name = self.blob_file(alg, hexdigest)
        try:
            with open(name, "rb") as f:
                data = f.read()
        except OSError:
            return self.not_found(f"blob {alg}:{hexdigest}")
        headers = [
            ("Content-Type", "application/octet-stream"),
            ("Accept-Ranges", "bytes"),
            # What the name says, not what the bytes hash to.
            ("Docker-Content-Digest", f"{alg}:{hexdigest}"),
        ]
        rng = self.headers.get("Range")
        if rng is None:
            return self.answer(200, data, headers)
        m = RANGE.match(rng.strip())
        if not m:
            return self.answer(416, b"", [("Content-Range", f"bytes */{len(data)}")], rng)
        start = int(m.group(1))
        end = int(m.group(2)) if m.group(2) else len(data) - 1
        end = min(end, len(data) - 1)
        if start >= len(data) or start > end:
            return self.answer(416, b"", [("Content-Range", f"bytes */{len(data)}")], rng)
        headers.append(("Content-Range", f"bytes {start}-{end}/{len(data)}"))
        self.answer(206, data[start : end + 1], headers, rng)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("layout")
    ap.add_argument("--port-file")
    ap.add_argument("--log")
    ap.add_argument("--lifetime", type=float, default=600.0)
    cfg = ap.parse_args()
    if not os.path.isfile(os.path.join(cfg.layout, "index.json")):
        raise SystemExit(f"hostile_registry: {cfg.layout} is not an OCI layout (no index.json)")

    server = bounded_server.Server(("127.0.0.1", 0), Handler)
    server.cfg = cfg
    server.layout = cfg.layout
    server.log_lock = threading.Lock()

    bounded_server.serve(server, cfg.lifetime, cfg.port_file, log, f"serving {cfg.layout}")


if __name__ == "__main__":
    main()
