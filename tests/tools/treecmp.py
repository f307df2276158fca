#!/usr/bin/env python3
"""Compare two directory trees entry by entry.

Usage: treecmp.py [options] A B

Walks both trees without following symlinks (the roots themselves included,
reported as ".") and compares, per relative path:
  type, mode (all 12 permission bits: setuid/setgid/sticky too), uid, gid,
  size (not for directories), content sha256 (regular files), symlink target,
  rdev major/minor (char/block devices), xattrs (every namespace, read with
  follow_symlinks=False; security.selinux ignored), mtime in ns (symlinks too),
  hard links: the set of paths sharing an inode must be the same in A and B,
  and st_nlink must match (non-directories).

Exit status: 0 equal, 1 differences (at most --max are listed, plus a count),
2 usage / I/O error. The last line is always
  treecmp: N entries compared, M differences
"""

import argparse
import errno
import hashlib
import os
import stat
import sys

IGNORED_XATTRS = {"security.selinux"}
FIELDS = ["type", "mode", "uid", "gid", "size", "content", "target", "rdev", "xattrs", "mtime",
          "hardlinks", "nlink"]

TYPES = [
    (stat.S_ISDIR, "dir"), (stat.S_ISREG, "file"), (stat.S_ISLNK, "symlink"),
    (stat.S_ISCHR, "char"), (stat.S_ISBLK, "block"), (stat.S_ISFIFO, "fifo"),
    (stat.S_ISSOCK, "socket"),
]


def ftype(mode):
    for test, name in TYPES:
        if test(mode):
            return name
    return "unknown"


def show(path):
    """Printable form of a path (names may contain any byte but '/' and NUL)."""
    b = os.fsencode(path)
    s = b.decode("utf-8", "backslashreplace")
    if any(c in s for c in "\n\t\r") or s != s.strip():
        return repr(s)
    return s


def short(v, limit=120):
    s = repr(v) if not isinstance(v, str) else v
    return s if len(s) <= limit else s[:limit] + "...(%d chars)" % len(s)


def sha256_file(full):
    h = hashlib.sha256()
    fd = os.open(full, os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_NOATIME", 0))
    try:
        with os.fdopen(fd, "rb", closefd=False) as f:
            while True:
                chunk = f.read(1 << 20)
                if not chunk:
                    break
                h.update(chunk)
    except PermissionError:
        # O_NOATIME needs ownership unless root; retry without it
        os.close(fd)
        fd = os.open(full, os.O_RDONLY | os.O_NOFOLLOW)
        with os.fdopen(fd, "rb", closefd=False) as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
    finally:
        os.close(fd)
    return h.hexdigest()


def read_xattrs(full, errors):
    out = {}
    try:
        names = os.listxattr(full, follow_symlinks=False)
    except OSError as e:
        if e.errno in (errno.EOPNOTSUPP, errno.ENOTSUP):  # filesystem without xattrs
            return out
        errors.append("%s: listxattr: %s" % (show(full), e))
        return out
    for name in names:
        if name in IGNORED_XATTRS:
            continue
        try:
            out[name] = os.getxattr(full, name, follow_symlinks=False)
        except OSError as e:
            errors.append("%s: getxattr %s: %s" % (show(full), name, e))
    return out


class Tree:
    def __init__(self, root, excludes, want, errors):
        self.root = root
        self.entries = {}  # rel -> dict
        self.inodes = {}  # (dev, ino) -> [rel]
        self.excludes = excludes
        self.want = want
        self.errors = errors
        st = os.lstat(root)
        if not stat.S_ISDIR(st.st_mode):
            raise SystemExit("treecmp: %s is not a directory" % root)
        self._walk(".", root)

    def _excluded(self, rel):
        return rel in self.excludes

    def _record(self, rel, full):
        st = os.lstat(full)
        t = ftype(st.st_mode)
        e = {"type": t, "mode": stat.S_IMODE(st.st_mode), "uid": st.st_uid, "gid": st.st_gid,
             "mtime": st.st_mtime_ns}
        if t != "dir":
            e["size"] = st.st_size
            e["nlink"] = st.st_nlink
            self.inodes.setdefault((st.st_dev, st.st_ino), []).append(rel)
            e["ino"] = (st.st_dev, st.st_ino)
        if t == "file" and "content" in self.want:
            e["content"] = sha256_file(full)
        if t == "symlink":
            e["target"] = os.readlink(full)
        if t in ("char", "block"):
            e["rdev"] = "%d:%d" % (os.major(st.st_rdev), os.minor(st.st_rdev))
        if "xattrs" in self.want:
            e["xattrs"] = read_xattrs(full, self.errors)
        self.entries[rel] = e
        return t

    def _walk(self, rel, full):
        t = self._record(rel, full)
        if t != "dir":
            return
        try:
            names = sorted(os.listdir(full))
        except OSError as err:
            self.errors.append("%s: listdir: %s" % (show(full), err))
            return
        for name in names:
            crel = name if rel == "." else rel + "/" + name
            if self._excluded(crel):
                continue
            self._walk(crel, os.path.join(full, name))

    def group(self, rel):
        e = self.entries[rel]
        return frozenset(self.inodes[e["ino"]])


def fmt_val(field, v):
    if v is None:
        return "<absent>"
    if field == "mode":
        return "%04o" % v
    if field == "mtime":
        return "%d.%09d" % divmod(v, 10 ** 9)
    if field == "target":
        return short(os.fsencode(v).decode("utf-8", "backslashreplace"))
    if field == "content":
        return v[:16]
    if isinstance(v, bytes):
        return short(v)
    return short(v)


def compare(a, b, opts):
    diffs = []
    paths = sorted(set(a.entries) | set(b.entries))
    seen_groups = set()
    for p in paths:
        ea, eb = a.entries.get(p), b.entries.get(p)
        if ea is None:
            diffs.append("%s: only in B (%s)" % (show(p), eb["type"]))
            continue
        if eb is None:
            diffs.append("%s: only in A (%s)" % (show(p), ea["type"]))
            continue
        if ea["type"] != eb["type"]:
            diffs.append("%s: type: A=%s B=%s" % (show(p), ea["type"], eb["type"]))
            continue
        for field in ("mode", "uid", "gid", "size", "nlink", "content", "target", "rdev", "mtime"):
            if field in opts.ignore:
                continue
            if field == "mtime" and ea["type"] == "dir" and opts.ignore_mtime_dirs:
                continue
            va, vb = ea.get(field), eb.get(field)
            if field == "content" and ea.get("size") != eb.get("size") and "size" not in opts.ignore:
                continue  # already reported as a size difference
            if va != vb:
                diffs.append("%s: %s: A=%s B=%s" % (show(p), field, fmt_val(field, va), fmt_val(field, vb)))
        if "xattrs" not in opts.ignore:
            xa = {k: v for k, v in ea["xattrs"].items() if k not in opts.ignore_xattr}
            xb = {k: v for k, v in eb["xattrs"].items() if k not in opts.ignore_xattr}
            for k in sorted(set(xa) | set(xb)):
                if xa.get(k) != xb.get(k):
                    diffs.append("%s: xattr %s: A=%s B=%s" % (show(p), k, fmt_val("x", xa.get(k)),
                                                              fmt_val("x", xb.get(k))))
        if ea["type"] != "dir" and "hardlinks" not in opts.ignore:
            ga, gb = a.group(p), b.group(p)
            if ga != gb:
                key = (ga, gb)
                if key not in seen_groups:
                    seen_groups.add(key)
                    diffs.append("%s: hardlinks: A={%s} B={%s}" % (
                        show(p), ", ".join(show(x) for x in sorted(ga)),
                        ", ".join(show(x) for x in sorted(gb))))
    return len(paths), diffs


def norm_rel(p):
    p = p.strip("/")
    while p.startswith("./"):
        p = p[2:].lstrip("/")
    return p or "."


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("a")
    ap.add_argument("b")
    ap.add_argument("--ignore-mtime-dirs", action="store_true", help="do not compare mtimes of directories")
    ap.add_argument("--exclude", action="append", default=[], metavar="PATH",
                    help="relative path to skip (with its subtree) in both trees; repeatable")
    ap.add_argument("--ignore", action="append", default=[], choices=FIELDS, metavar="FIELD",
                    help="do not compare FIELD (one of: %s); repeatable" % ", ".join(FIELDS))
    ap.add_argument("--ignore-xattr", action="append", default=[], metavar="NAME",
                    help="do not compare this xattr (security.selinux always ignored); repeatable")
    ap.add_argument("--max", type=int, default=50, help="differences to list (default 50)")
    opts = ap.parse_args()
    opts.ignore = set(opts.ignore)
    opts.ignore_xattr = set(opts.ignore_xattr)
    if "type" in opts.ignore:
        ap.error("type cannot be ignored")
    excludes = {norm_rel(p) for p in opts.exclude}
    want = {"content", "xattrs"} - opts.ignore
    errors = []
    try:
        ta = Tree(opts.a, excludes, want, errors)
        tb = Tree(opts.b, excludes, want, errors)
    except OSError as e:
        print("treecmp: error: %s" % e, file=sys.stderr)
        return 2
    n, diffs = compare(ta, tb, opts)
    for e in errors:
        print("treecmp: warning: %s" % e, file=sys.stderr)
    for d in diffs[:opts.max]:
        print(d)
    if len(diffs) > opts.max:
        print("... and %d more differences" % (len(diffs) - opts.max))
    print("treecmp: %d entries compared, %d differences" % (n, len(diffs)))
    return 1 if diffs else 0


if __name__ == "__main__":
    sys.exit(main())
