#!/usr/bin/env python3
"""Which pages of which files a recorded start read, split by ELF segment.

usage: trace-segments.py ROOTFS TRACE [CHUNK_SIZE]

ROOTFS: the image unpacked (umoci unpack); TRACE: `lamina mount
--record-trace` of a start on a conversion with `--pack-limit 0` (a packed
file's lines name its pack, which this script cannot place). Prints, per
file in first-read order, the pages read of the file's pages, and for an
ELF file the same per PT_LOAD segment (flags R, RE, RW) from `readelf -lW`.
The static boot set's rules (docs/lazy.md, "Boot sets known from the
image") came from this on python3, data science and Node.js starts.
"""

import collections
import hashlib
import os
import re
import subprocess
import sys

PAGE = 4096
LOAD = re.compile(r"^\s+LOAD\s+(0x[0-9a-f]+)\s+\S+\s+\S+\s+(0x[0-9a-f]+)\s+\S+\s+([RWE ]+?)\s+0x", re.M)


def chunk_owners(root, chunk_size):
    """sha256 of each chunk of each regular file -> (path in the image, chunk number)."""
    owners = {}
    for d, _dirs, files in os.walk(root):
        for name in files:
            p = os.path.join(d, name)
            if os.path.islink(p) or not os.path.isfile(p):
                continue
            with open(p, "rb") as f:
                for i, data in enumerate(iter(lambda: f.read(chunk_size), b"")):
                    owners.setdefault(hashlib.sha256(data).hexdigest(), (p[len(root):], i))
    return owners


def segments(path, pages):
    """'FLAGS:read/all' per PT_LOAD segment of an ELF file, else ''."""
    with open(path, "rb") as f:
        if f.read(4) != b"\x7fELF":
            return ""
    out = subprocess.run(["readelf", "-lW", path], capture_output=True, text=True).stdout
    parts = []
    for m in LOAD.finditer(out):
        offset, size, flags = int(m[1], 16), int(m[2], 16), m[3].replace(" ", "")
        lo, hi = offset // PAGE, (offset + size + PAGE - 1) // PAGE
        parts.append(f"{flags}:{sum(lo <= p < hi for p in pages)}/{hi - lo}")
    return " ".join(parts)


def main():
    root, trace = sys.argv[1].rstrip("/"), sys.argv[2]
    chunk_size = int(sys.argv[3]) if len(sys.argv) > 3 else 1 << 18
    owners = chunk_owners(root, chunk_size)
    pages, order, unknown = collections.defaultdict(set), [], 0
    with open(trace) as f:
        for line in f:
            fields = line.split()
            if len(fields) != 3:
                continue
            owner = owners.get(fields[0])
            if owner is None:
                unknown += 1
                continue
            path, i = owner
            start, length = i * chunk_size + int(fields[1]), int(fields[2])
            pages[path].update(range(start // PAGE, (start + length + PAGE - 1) // PAGE))
            if path not in order:
                order.append(path)
    for path in order:
        size = os.path.getsize(root + path)
        print(f"{path}: {len(pages[path])} pages of {(size + PAGE - 1) // PAGE}  "
              f"{segments(root + path, pages[path])}")
    total = sum(len(p) for p in pages.values())
    print(f"total {total} pages; {unknown} trace lines name no chunk of the rootfs")


if __name__ == "__main__":
    main()
