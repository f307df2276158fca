#!/usr/bin/env python3
"""Writes the seed corpus of the tar_layers fuzz target into seeds/tar_layers/.

Each seed is the target's input: one control byte (layer count - 1), then
for every layer but the last a little-endian u32 length and the layer, then
the last layer. Tars come from Python's tarfile (an independent writer), with
the trailing zero padding past the end-of-archive marker cut off.

Usage: python3 fuzz/gen_tar_seeds.py
"""

import io
import os
import struct
import tarfile

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "seeds", "tar_layers")


def tar(entries, fmt=tarfile.PAX_FORMAT):
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=fmt) as t:
        for info, data in entries:
            if data is not None:
                info.size = len(data)
                t.addfile(info, io.BytesIO(data))
            else:
                t.addfile(info)
    raw = buf.getvalue()
    # Keep everything up to the last non-zero block plus the two zero blocks.
    end = len(raw)
    while end >= 512 and raw[end - 512 : end] == bytes(512):
        end -= 512
    return raw[: end + 1024]


def entry(name, kind=tarfile.REGTYPE, **kw):
    info = tarfile.TarInfo(name)
    info.type = kind
    info.mode = kw.pop("mode", 0o755 if kind == tarfile.DIRTYPE else 0o644)
    info.mtime = kw.pop("mtime", 1)
    for k, v in kw.items():
        setattr(info, k, v)
    return info


def seed(name, layers):
    data = bytes([len(layers) - 1])
    for layer in layers[:-1]:
        data += struct.pack("<I", len(layer)) + layer
    data += layers[-1]
    with open(os.path.join(OUT, name), "wb") as f:
        f.write(data)


def main():
    os.makedirs(OUT, exist_ok=True)
    content = b"lamina\n" + bytes(8192) + b"tail"  # two blocks, the second a hole
    long_dir = "d/" + "x" * 120
    pax = tar(
        [
            (entry("d", tarfile.DIRTYPE), None),
            (entry("d/file", pax_headers={"SCHILY.xattr.user.note": "a\nb"}), content),
            (entry("d/empty"), b""),
            (entry("d/link", tarfile.SYMTYPE, linkname="file"), None),
            (entry("d/hard", tarfile.LNKTYPE, linkname="d/file"), None),
            (entry("d/null", tarfile.CHRTYPE, devmajor=1, devminor=3), None),
            (entry("d/fifo", tarfile.FIFOTYPE), None),
            (entry(long_dir, tarfile.DIRTYPE, uid=3_000_000, mtime=1.5), None),
            (entry(long_dir + "/f", mode=0o4755), b"x"),
        ]
    )
    seed("pax", [pax])

    gnu = tar(
        [
            (entry("g/" + "y" * 150), b"long name"),
            (entry("g/sym", tarfile.SYMTYPE, linkname="/" + "z" * 150), None),
        ],
        fmt=tarfile.GNU_FORMAT,
    )
    seed("gnu", [gnu])

    lower = tar(
        [
            (entry("etc", tarfile.DIRTYPE), None),
            (entry("etc/a"), b"a"),
            (entry("etc/b"), b"b"),
            (entry("opt/keep"), b"k"),
        ]
    )
    middle = tar(
        [
            (entry("etc/.wh.a"), b""),
            (entry("opt/.wh..wh..opq"), b""),
            (entry("opt/new"), b"n"),
            (entry("lnk", tarfile.SYMTYPE, linkname="../../etc"), None),
        ]
    )
    upper = tar(
        [
            (entry("lnk/c"), b"through the symlink"),
            (entry("/abs/../x"), b"confined"),
            (entry("./", tarfile.DIRTYPE, mode=0o700), None),
        ]
    )
    seed("three-layers", [lower, middle, upper])


if __name__ == "__main__":
    main()
