#!/usr/bin/env python3
"""Which reads of a file-backed EROFS image raise fanotify pre-content events?

Issue 44 asks whether a kernel-path lazy mount could fetch its metadata on
demand, as it fetches file data: that needs an event before the kernel
parses any metadata byte. This probe (root, Linux 6.14+ with
CONFIG_EROFS_FS_BACKED_BY_FILE; standard library, mkfs.erofs, dump.erofs)
builds an image of one directory with 300 files (its dirents need a full
block), watches the image file with FAN_PRE_ACCESS, mounts it file-backed
through mount(2) as lamina does, drops the page cache, then runs `ls -lR`
and reads every file. It prints each event's range and where the
superblock, the directory's inode, its dirent block and a file's inode
lie, and says which of them raised an event.

Usage: sudo python3 scripts/erofs-metadata-events.py
"""

import ctypes
import os
import select
import shutil
import struct
import subprocess
import sys
import tempfile
import threading

FAN_CLASS_PRE_CONTENT, FAN_CLOEXEC, FAN_MARK_ADD = 0x08, 0x01, 0x01
FAN_PRE_ACCESS, FAN_ALLOW, AT_FDCWD = 0x00100000, 0x01, -100
FAN_EVENT_INFO_TYPE_RANGE = 6
MS_RDONLY = 1
BLOCK = 4096

libc = ctypes.CDLL(None, use_errno=True)
libc.fanotify_mark.argtypes = [ctypes.c_int, ctypes.c_uint, ctypes.c_uint64, ctypes.c_int, ctypes.c_char_p]


def check(ret, what):
    if ret < 0:
        sys.exit(f"{what}: {os.strerror(ctypes.get_errno())}")
    return ret


def ranges_of(buf):
    """(offset, count) of each event in `buf`, answering every one FAN_ALLOW."""
    out, off = [], 0
    while off < len(buf):
        event_len, _, _, meta_len, _, fd, _ = struct.unpack_from("IBBHQii", buf, off)
        info, i = buf[off + meta_len:off + event_len], 0
        while i + 4 <= len(info):
            kind, _, length = struct.unpack_from("BBH", info, i)
            if kind == FAN_EVENT_INFO_TYPE_RANGE and length >= 24:
                count, offset = struct.unpack_from("QQ", info, i + 8)
                out.append((offset, count))
            i += max(length, 4)
        os.write(fan, struct.pack("iI", fd, FAN_ALLOW))
        if fd >= 0:
            os.close(fd)
        off += event_len
    return out


def listen(stop, events):
    while not stop.is_set():
        if select.select([fan], [], [], 0.1)[0]:
            events.extend(ranges_of(os.read(fan, 65536)))


def dirent_block(dump):
    """The block of /d's first extent: its full dirent block (the tail is inline after the inode)."""
    first = next(line for line in dump.splitlines() if line.strip().startswith("0:"))
    return int(first.split("|")[1].split(":")[1].split("..")[0]) // BLOCK


def nid_block(dump):
    nid = int(dump.split("NID:")[1].split()[0])
    return nid * 32 // BLOCK  # meta_blkaddr is 0 in mkfs.erofs 1.5 images this small


work = tempfile.mkdtemp(prefix="erofs-events-")
img, root, mnt = (os.path.join(work, n) for n in ("img", "root", "mnt"))
os.makedirs(os.path.join(root, "d"))
os.makedirs(mnt)
for i in range(300):
    with open(os.path.join(root, "d", f"file{i:03d}"), "w") as f:
        f.write(f"hello {i}\n")
subprocess.run(["mkfs.erofs", img, root], check=True, capture_output=True)
dir_dump = subprocess.run(["dump.erofs", "-e", "--path=/d", img], check=True, capture_output=True, text=True).stdout
file_dump = subprocess.run(["dump.erofs", "--path=/d/file150", img], check=True, capture_output=True, text=True).stdout

fan = check(libc.fanotify_init(FAN_CLASS_PRE_CONTENT | FAN_CLOEXEC, os.O_RDONLY | os.O_LARGEFILE), "fanotify_init")
check(libc.fanotify_mark(fan, FAN_MARK_ADD, FAN_PRE_ACCESS, AT_FDCWD, img.encode()), "fanotify_mark")
events, stop = [], threading.Event()
listener = threading.Thread(target=listen, args=(stop, events))
listener.start()
try:
    subprocess.run(["sync"])
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3")
    check(libc.mount(img.encode(), mnt.encode(), b"erofs", MS_RDONLY, None), "mount")
    try:
        subprocess.run(["ls", "-lR", mnt], check=True, capture_output=True)
        for name in sorted(os.listdir(os.path.join(mnt, "d"))):
            with open(os.path.join(mnt, "d", name)) as f:
                f.read()
    finally:
        subprocess.run(["umount", mnt], check=True)
finally:
    stop.set()
    listener.join()
    shutil.rmtree(work)

blocks = sorted({b for off, n in events for b in range(off // BLOCK, (off + max(n, 1) - 1) // BLOCK + 1)})
print(f"image: {os.path.basename(img)}; events: {len(events)} {[f'{o}+{n}' for o, n in events]}; blocks {blocks}")
places = {"superblock": 0, "/d's inode (its dirents' tail inline)": nid_block(dir_dump),
          "a file's inode (/d/file150, its data inline)": nid_block(file_dump),
          "/d's full dirent block": dirent_block(dir_dump)}
for what, block in places.items():
    print(f"{what}: block {block}: {'an event' if block in blocks else 'no event'}")
