#!/usr/bin/env python3
"""Fault-injecting HTTP/1.1 reverse proxy in front of a local registry.

Usage:
    faultproxy.py LISTEN_PORT UPSTREAM_PORT MODE [--every N] [--stall SECS]
                  [--blob DIGEST] [--whole] [--lifetime SECS]
                  [--port-file FILE] [--stats FILE]

Listens on 127.0.0.1:LISTEN_PORT (0: any free port; it is printed on stdout as
`listening PORT` and written to --port-file) and forwards every request to
http://127.0.0.1:UPSTREAM_PORT. Only blob range reads are tampered with:
GET /v2/<repo>/blobs/<digest> requests carrying a Range header ("eligible"
requests), of blob DIGEST alone with --blob. Manifests, the full-blob GETs
lamina uses for its index and metadata, HEADs and uploads pass through
untouched. With --whole, full-blob GETs (no Range header) are eligible too
(with --blob: a data blob's, the whole-blob prefetch through a P2P mirror).

MODE says what happens to an eligible request that is faulted:

    none      nothing (a plain proxy)
    flip      the body is forwarded with one byte flipped in every 512-byte
              block (same length, so only a digest check notices)
    flipall   every byte of the body flipped
    truncate  headers announce the full length, half of the body is sent,
              then the connection is closed
    reset     the connection is reset (RST) without an answer
    500, 503  that HTTP status with a small error body
    stall     the answer is held back --stall seconds, then sent intact
    stallmid  headers and half of the body at once, the other half --stall
              seconds later (a P2P daemon whose next piece waits for a parent)
    mix       cycles through flip, truncate, reset, 500, 503, stall
    A,B,...   a schedule: the k-th faulted request gets entry k (cyclic);
              entries are the modes above (`ok` = none), e.g. flip,ok,reset

--drip-referrers SECS answers the referrers call (/v2/<repo>/referrers/...)
and the referrers fallback tag (/v2/<repo>/manifests/sha256-<hex>) itself,
whatever the mode: 200, an empty OCI image index, headers at once and the
body one byte every SECS (a registry front that stalls without ever timing
out a read). Counted as `dripping` (answers under way) and `dripped`.

--large-rate BYTES_PER_S sends the body of every blob GET answer (range or
whole) of --large-at bytes or more (default 1 MiB) at that rate, whatever
the mode, after the first --large-after such answers (default 0), while
smaller answers go at once (a link that is slow for large requests only, as a
shared link is when other traffic takes it); counted as `slow_answers`, and
the bytes sent before the client hung up or the body ended as
`slow_bytes`.

--min-range BYTES makes only range reads asking for at least BYTES
eligible (a link or front that fails large requests only).

--repo REPO makes only requests in that repository eligible (two tenants'
repositories behind one host: one trust domain, one of them failing).

--basic-auth USER:PASSWORD answers every request without those Basic
credentials 401 with a Basic challenge (a registry only a tenant's pull
secret opens), counted as `unauthorized`; the others as `authorized`, and
their blob range reads as `authorized_ranges`.

--every N faults the N-th, 2N-th, ... eligible request (default 1: all of
them). Counters (requests, eligible, faults per kind, upstream errors, bytes
of answer bodies sent) are rewritten as JSON to --stats after every request.

The proxy bounds its own life: it exits after --lifetime seconds (default
600), when its parent process goes away, or on SIGTERM/SIGINT.
Standard library only.
"""

import argparse
import base64
import http.client
import itertools
import json
import os
import re
import socket
import struct
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler

import bounded_server

FAULTS = ("flip", "flipall", "truncate", "reset", "500", "503", "stall", "stallmid")
MIX = ("flip", "truncate", "reset", "500", "503", "stall")
BLOB_PATH = re.compile(r"^/v2/.+/blobs/[a-z0-9]+:[0-9a-f]{32,}$")
REFERRERS_PATH = re.compile(r"^/v2/.+/(referrers/[a-z0-9]+:[0-9a-f]{32,}|manifests/sha256-[0-9a-f]{64})$")
EMPTY_INDEX = b'{"schemaVersion":2,"mediaType":"application/vnd.oci.image.index.v1+json","manifests":[]}'
HOP_BY_HOP = {
    "connection",
    "keep-alive",
    "proxy-authenticate",
    "proxy-authorization",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
    "content-length",
}


def range_length(range_hdr):
    """The bytes a `bytes=A-B` Range header asks for; 0 for any other."""
    m = re.fullmatch(r"bytes=(\d+)-(\d+)", (range_hdr or "").strip())
    return int(m.group(2)) - int(m.group(1)) + 1 if m else 0


class Plan:
    """Decides, thread-safely, which eligible request gets which fault."""

    def __init__(self, mode, every, stats_path):
        self.lock = threading.Lock()
        self.every = every
        self.stats_path = stats_path
        if mode == "mix":
            schedule = list(MIX)
        elif mode in ("none", "ok"):
            schedule = []
        else:
            schedule = [m.strip() for m in mode.split(",") if m.strip()]
        for m in schedule:
            if m not in FAULTS and m not in ("ok", "none"):
                raise SystemExit(f"faultproxy: unknown mode {m!r} (one of none, {', '.join(FAULTS)}, mix, or a comma list)")
        self.schedule = itertools.cycle(schedule) if schedule else None
        self.stats = {
            "requests": 0,
            "eligible": 0,
            "faulted": 0,
            "faults": {k: 0 for k in FAULTS},
            "upstream_errors": 0,
            "body_bytes": 0,
            "dripping": 0,
            "dripped": 0,
            "authorized": 0,
            "unauthorized": 0,
            "authorized_ranges": 0,
            "large_answers": 0,
            "slow_answers": 0,
            "slow_bytes": 0,
            # The first 1,000 requests, in order: "METHOD PATH [RANGE]".
            "log": [],
        }

    def next_fault(self, eligible, line=""):
        with self.lock:
            self.stats["requests"] += 1
            if line and len(self.stats["log"]) < 1000:
                self.stats["log"].append(line)
            if not eligible:
                return None
            self.stats["eligible"] += 1
            if self.schedule is None or self.stats["eligible"] % self.every != 0:
                return None
            fault = next(self.schedule)
            if fault in ("ok", "none"):
                return None
            self.stats["faulted"] += 1
            self.stats["faults"][fault] += 1
            return fault

    def count(self, key, n=1):
        with self.lock:
            self.stats[key] += n

    def write(self):
        if not self.stats_path:
            return
        with self.lock:
            data = json.dumps(self.stats, sort_keys=True)
        tmp = f"{self.stats_path}.tmp-{threading.get_ident()}"
        with open(tmp, "w") as f:
            f.write(data + "\n")
        os.replace(tmp, self.stats_path)


def log(msg):
    sys.stderr.write(f"faultproxy: {msg}\n")
    sys.stderr.flush()


def flip(body, every):
    b = bytearray(body)
    if every == 1:
        for i in range(len(b)):
            b[i] ^= 0xFF
    else:
        for block in range(0, len(b), every):
            i = block + (block // every * 37) % every
            b[min(i, len(b) - 1)] ^= 0x20
    return bytes(b)


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    timeout = 120  # idle keep-alive connections do not live forever
    server_version = "faultproxy"

    def log_message(self, fmt, *args):  # quiet; faults are logged by proxy()
        pass

    def do_GET(self):
        self.proxy()

    do_HEAD = do_PUT = do_POST = do_PATCH = do_DELETE = do_GET

    def reset(self):
        """Abortive close: the peer sees ECONNRESET."""
        try:
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        except OSError:
            pass
        self.close_connection = True
        try:
            self.connection.close()
        except OSError:
            pass

    def reply(self, status, headers, body, send_body=True, length=None):
        self.send_response_only(status)
        for k, v in headers:
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body) if length is None else length))
        self.end_headers()
        if send_body:
            self.wfile.write(body)
            self.server.plan.count("body_bytes", len(body))
        self.wfile.flush()

    def drip(self, secs):
        """An empty index, its body one byte every `secs` seconds."""
        plan = self.server.plan
        plan.count("dripping")
        self.send_response_only(200)
        self.send_header("Content-Type", "application/vnd.oci.image.index.v1+json")
        self.send_header("Content-Length", str(len(EMPTY_INDEX)))
        self.end_headers()
        self.wfile.flush()
        plan.write()
        try:
            for b in EMPTY_INDEX:
                self.wfile.write(bytes([b]))
                self.wfile.flush()
                time.sleep(secs)
        except OSError:
            self.close_connection = True
        plan.count("dripping", -1)
        plan.count("dripped")
        plan.write()

    def proxy(self):
        plan = self.server.plan
        cfg = self.server.cfg
        path = self.path.split("?", 1)[0]
        if cfg.drip_referrers and self.command == "GET" and REFERRERS_PATH.match(path):
            log(f"{self.command} {self.path}: dripping")
            self.drip(cfg.drip_referrers)
            return
        range_hdr = self.headers.get("Range")
        if cfg.basic_auth and not self.authorized(cfg, path, range_hdr):
            return
        wanted = range_hdr is not None or cfg.whole
        eligible = self.command == "GET" and wanted and BLOB_PATH.match(path) is not None
        if cfg.blob:
            eligible = eligible and path.endswith("/" + cfg.blob)
        if cfg.repo:
            eligible = eligible and path.startswith(f"/v2/{cfg.repo}/blobs/")
        if cfg.min_range:
            eligible = eligible and range_length(range_hdr) >= cfg.min_range
        fault = plan.next_fault(eligible, f"{self.command} {path} {range_hdr or ''}".strip())
        if fault:
            log(f"{self.command} {self.path} {range_hdr}: {fault}")
        try:
            self.forward(fault, cfg)
        finally:
            plan.write()

    def authorized(self, cfg, path, range_hdr):
        """Whether the request carries the Basic credentials; if not, it
        is answered 401 here."""
        plan = self.server.plan
        want = "Basic " + base64.b64encode(cfg.basic_auth.encode()).decode()
        if self.headers.get("Authorization", "") == want:
            plan.count("authorized")
            if range_hdr and BLOB_PATH.match(path):
                plan.count("authorized_ranges")
            return True
        plan.count("unauthorized")
        length = self.headers.get("Content-Length")
        if length:
            self.rfile.read(int(length))
        body = json.dumps({"errors": [{"code": "UNAUTHORIZED", "message": "authentication required"}]}).encode()
        headers = [("Content-Type", "application/json"), ("WWW-Authenticate", 'Basic realm="faultproxy"')]
        self.reply(401, headers, body, send_body=self.command != "HEAD")
        plan.write()
        return False

    def forward(self, fault, cfg):
        if self.headers.get("Transfer-Encoding"):
            self.reply(501, [("Content-Type", "text/plain")], b"chunked request bodies are not supported\n")
            return
        body = b""
        length = self.headers.get("Content-Length")
        if length:
            body = self.rfile.read(int(length))
        if fault == "reset":
            self.reset()
            return
        if fault in ("500", "503"):
            msg = json.dumps({"errors": [{"code": "UNAVAILABLE", "message": f"faultproxy: injected {fault}"}]}).encode()
            self.reply(int(fault), [("Content-Type", "application/json")], msg)
            return
        if fault == "stall":
            time.sleep(cfg.stall)
        headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP_BY_HOP and k.lower() != "host"}
        headers["Host"] = f"127.0.0.1:{cfg.upstream}"
        if body:
            headers["Content-Length"] = str(len(body))
        try:
            up = http.client.HTTPConnection("127.0.0.1", cfg.upstream, timeout=60)
            up.request(self.command, self.path, body=body or None, headers=headers)
            resp = up.getresponse()
            data = resp.read()
            up_headers = resp.getheaders()
            status = resp.status
            up.close()
        except (OSError, http.client.HTTPException) as e:
            self.server.plan.count("upstream_errors")
            log(f"{self.command} {self.path}: upstream error: {e}")
            self.reply(502, [("Content-Type", "text/plain")], f"faultproxy: upstream: {e}\n".encode())
            return
        out_headers = [(k, v) for k, v in up_headers if k.lower() not in HOP_BY_HOP]
        if self.command == "HEAD":
            announced = resp.getheader("Content-Length")
            self.reply(status, out_headers, b"", send_body=False, length=int(announced) if announced else 0)
            return
        if fault == "flip" and data:
            data = flip(data, 512)
        elif fault == "flipall" and data:
            data = flip(data, 1)
        elif fault == "truncate" and len(data) > 1:
            self.reply(status, out_headers, data[: len(data) // 2], length=len(data))
            self.close_connection = True
            try:
                self.connection.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            return
        elif fault == "stallmid" and len(data) > 1:
            half = len(data) // 2
            self.reply(status, out_headers, data[:half], length=len(data))
            self.server.plan.write()  # the stats say so during the stall
            time.sleep(cfg.stall)
            try:
                self.wfile.write(data[half:])
                self.wfile.flush()
                self.server.plan.count("body_bytes", len(data) - half)
            except OSError:
                pass
            return
        large = self.command == "GET" and status in (200, 206) and len(data) >= cfg.large_at
        if cfg.large_rate and large and BLOB_PATH.match(self.path.split("?", 1)[0]):
            self.server.plan.count("large_answers")
            if self.server.plan.stats["large_answers"] > cfg.large_after:
                self.send_slowly(status, out_headers, data, cfg.large_rate)
                return
        self.reply(status, out_headers, data)

    def send_slowly(self, status, headers, body, rate):
        """`body` at `rate` bytes a second, in 16 KiB pieces."""
        plan = self.server.plan
        plan.count("slow_answers")
        self.send_response_only(status)
        for k, v in headers:
            if k.lower() != "content-length":
                self.send_header(k, v)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        piece = 16 << 10
        try:
            for at in range(0, len(body), piece):
                self.wfile.write(body[at:at + piece])
                self.wfile.flush()
                plan.count("slow_bytes", len(body[at:at + piece]))
                time.sleep(piece / rate)
        except OSError:
            self.close_connection = True
        plan.write()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("listen_port", type=int)
    ap.add_argument("upstream_port", type=int)
    ap.add_argument("mode")
    ap.add_argument("--every", type=int, default=1)
    ap.add_argument("--stall", type=float, default=2.0)
    ap.add_argument("--drip-referrers", type=float, default=0.0, metavar="SECS")
    ap.add_argument("--blob", default="", help="fault range reads of this blob (sha256:...) only")
    ap.add_argument("--repo", default="", help="fault range reads in this repository only")
    ap.add_argument("--min-range", type=int, default=0, metavar="BYTES", help="fault range reads of at least BYTES only")
    ap.add_argument("--whole", action="store_true", help="fault full-blob GETs too, not only range reads")
    ap.add_argument("--large-rate", type=float, default=0.0, metavar="BYTES_PER_S")
    ap.add_argument("--large-at", type=int, default=1 << 20, metavar="BYTES")
    ap.add_argument("--large-after", type=int, default=0, metavar="N")
    ap.add_argument("--basic-auth", default="", metavar="USER:PASSWORD")
    ap.add_argument("--lifetime", type=float, default=600.0)
    ap.add_argument("--port-file")
    ap.add_argument("--stats")
    cfg = ap.parse_args()
    if cfg.every < 1:
        raise SystemExit("faultproxy: --every must be >= 1")
    cfg.upstream = cfg.upstream_port

    plan = Plan(cfg.mode, cfg.every, cfg.stats)
    server = bounded_server.Server(("127.0.0.1", cfg.listen_port), Handler)
    server.plan = plan
    server.cfg = cfg
    plan.write()

    what = f"-> 127.0.0.1:{cfg.upstream}, mode {cfg.mode}, every {cfg.every}"
    bounded_server.serve(server, cfg.lifetime, cfg.port_file, log, what)


if __name__ == "__main__":
    main()
