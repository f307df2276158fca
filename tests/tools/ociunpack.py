#!/usr/bin/env python3
"""Reference unpacker: apply an image's layers to a directory with plain OCI
layer semantics, as a second oracle next to umoci (run as root).

Usage:
    ociunpack.py LAYOUT[:TAG] DEST               # OCI layout, TAG defaults to "latest"
    ociunpack.py --docker-archive FILE DEST      # `docker save` tarball (first image)

DEST (must be absent or empty) becomes the root filesystem itself (no
bundle/rootfs level). Handles tar, tar+gzip (multi-member) and tar+zstd
(via the zstd CLI). Verifies blob digests, sizes and diff_ids unless
--no-verify.

Semantics (OCI image-spec layer.md):
  * per layer, whiteouts (.wh.NAME) and opaque markers (.wh..wh..opq) are
    applied first and only hide lower-layer content; then all other entries
    are applied in tar order (the last entry for a path wins);
  * an existing directory is merged with a directory entry (the entry's
    metadata and xattr set replace the old ones); any other existing entry is
    removed (recursively) before the new one is created;
  * hard links share the inode with their target, which may come from this or
    a lower layer; the link header's own metadata is ignored;
  * metadata order: chown, chmod, xattrs, mtime (ns, PAX fractions kept);
    directory mtimes are re-applied after the last layer;
  * parents missing from the tar (implicit) are created 0755 0:0, mtime 0.
Refused (exit 1): '..' components, a parent path that is a symlink or not a
directory, hard links to directories or to missing paths, digest mismatches.
Leading '/' and './' are stripped.
"""

import argparse
import gzip
import hashlib
import json
import os
import shutil
import stat
import subprocess
import sys
import tarfile
import tempfile
import zlib

REF_NAME = "org.opencontainers.image.ref.name"


class Refused(Exception):
    pass


# ---------------------------------------------------------------------------
# image loading


def _read_json(path):
    with open(path, "rb") as f:
        return json.load(f)


def sha256_file(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return "sha256:" + h.hexdigest()


def load_oci(spec, verify):
    layout, sep, tag = spec.rpartition(":")
    if not sep or "/" in tag:
        layout, tag = spec, "latest"
    index = _read_json(os.path.join(layout, "index.json"))
    descs = [m for m in index.get("manifests", [])
             if m.get("annotations", {}).get(REF_NAME) == tag]
    if not descs:
        raise Refused("tag %r not found in %s" % (tag, layout))

    def blob(desc):
        algo, _, hexd = desc["digest"].partition(":")
        path = os.path.join(layout, "blobs", algo, hexd)
        if verify:
            if os.path.getsize(path) != desc["size"]:
                raise Refused("blob %s: size %d, descriptor says %d"
                              % (desc["digest"], os.path.getsize(path), desc["size"]))
            if sha256_file(path) != desc["digest"]:
                raise Refused("blob %s: content does not match its digest" % desc["digest"])
        return path

    manifest = _read_json(blob(descs[0]))
    config = _read_json(blob(manifest["config"]))
    diff_ids = config["rootfs"]["diff_ids"]
    if len(diff_ids) != len(manifest["layers"]):
        raise Refused("%d layers but %d diff_ids" % (len(manifest["layers"]), len(diff_ids)))
    return [(l["mediaType"], blob(l), d) for l, d in zip(manifest["layers"], diff_ids)]


def load_docker_archive(path, tmp, verify):
    with tarfile.open(path) as tf:
        tf.extractall(tmp, filter="data") if hasattr(tarfile, "data_filter") else tf.extractall(tmp)
    manifest = _read_json(os.path.join(tmp, "manifest.json"))[0]
    config = _read_json(os.path.join(tmp, manifest["Config"]))
    diff_ids = config["rootfs"]["diff_ids"]
    return [("application/vnd.oci.image.layer.v1.tar", os.path.join(tmp, l), d)
            for l, d in zip(manifest["Layers"], diff_ids)]


def decompress(media_type, src, dst_path, diff_id, verify):
    """Write the uncompressed tar of layer blob src to dst_path; check diff_id."""
    h = hashlib.sha256()
    with open(dst_path, "wb") as out:
        if media_type.endswith("+zstd") or media_type.endswith(".zstd"):
            proc = subprocess.Popen(["zstd", "-dc", "-q", src], stdout=subprocess.PIPE)
            stream = proc.stdout
        elif media_type.endswith("gzip"):
            proc = None
            stream = gzip.open(src, "rb")
        elif media_type.endswith(".tar"):
            proc = None
            stream = open(src, "rb")
        else:
            raise Refused("unsupported layer media type %s" % media_type)
        try:
            for chunk in iter(lambda: stream.read(1 << 20), b""):
                h.update(chunk)
                out.write(chunk)
        except (OSError, EOFError, zlib.error) as e:
            raise Refused("layer %s: decompression failed: %s" % (src, e))
        finally:
            stream.close()
            if proc and proc.wait() != 0:
                raise Refused("layer %s: zstd -d failed" % src)
    if verify and "sha256:" + h.hexdigest() != diff_id:
        raise Refused("layer %s: uncompressed sha256:%s does not match diff_id %s" % (src, h.hexdigest(), diff_id))


# ---------------------------------------------------------------------------
# extraction


def norm(name):
    parts = []
    for p in name.split("/"):
        if p in ("", "."):
            continue
        if p == "..":
            raise Refused("entry %r: '..' component" % name)
        parts.append(p)
    return "/".join(parts)


def mtime_ns(ti):
    raw = ti.pax_headers.get("mtime")
    if raw is None:
        return int(ti.mtime) * 10 ** 9
    neg = raw.startswith("-")
    sec, _, frac = raw.lstrip("-").partition(".")
    ns = int(sec or "0") * 10 ** 9 + int((frac + "000000000")[:9])
    return -ns if neg else ns


def xattrs_of(ti):
    return {k[len("SCHILY.xattr."):]: v.encode("utf-8", "surrogateescape")
            for k, v in ti.pax_headers.items() if k.startswith("SCHILY.xattr.")}


class Root:
    def __init__(self, path):
        self.path = path
        self.fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
        self.dir_mtimes = {"": 0}

    def parent(self, rel, create):
        """fd of rel's parent directory (caller closes) and the base name.
        Never follows symlinks; creates missing parents when create."""
        parts = rel.split("/")
        fd = os.dup(self.fd)
        walked = []
        try:
            for comp in parts[:-1]:
                walked.append(comp)
                try:
                    nfd = os.open(comp, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
                except FileNotFoundError:
                    if not create:
                        raise
                    os.mkdir(comp, 0o755, dir_fd=fd)
                    self.dir_mtimes["/".join(walked)] = 0
                    nfd = os.open(comp, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
                except OSError:  # ELOOP: a symlink, ENOTDIR: not a directory
                    raise Refused("%r: parent %r is a symlink or not a directory" % (rel, "/".join(walked)))
                os.close(fd)
                fd = nfd
        except BaseException:
            os.close(fd)
            raise
        return fd, parts[-1]

    def remove(self, pfd, base):
        try:
            st = os.lstat(base, dir_fd=pfd)
        except FileNotFoundError:
            return
        if stat.S_ISDIR(st.st_mode):
            dfd = os.open(base, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=pfd)
            try:
                for child in os.listdir(dfd):
                    self.remove(dfd, child)
            finally:
                os.close(dfd)
            os.rmdir(base, dir_fd=pfd)
        else:
            os.unlink(base, dir_fd=pfd)

    def whiteout(self, rel):
        """Apply a whiteout entry; a missing or non-directory parent makes it a no-op."""
        try:
            pfd, base = self.parent(rel, create=False)
        except (FileNotFoundError, Refused):
            return
        try:
            if base == ".wh..wh..opq":  # pfd is the opaque directory itself
                for child in os.listdir(pfd):
                    self.remove(pfd, child)
            else:
                self.remove(pfd, base[len(".wh."):])
        finally:
            os.close(pfd)

    def set_meta(self, pfd, base, ti, is_dir_merge=False):
        is_link = ti.issym()
        os.chown(base, ti.uid, ti.gid, dir_fd=pfd, follow_symlinks=False)
        if not is_link:
            os.chmod(base, ti.mode & 0o7777, dir_fd=pfd)
        proc = "/proc/self/fd/%d/%s" % (pfd, base) if base else "/proc/self/fd/%d" % pfd
        want = xattrs_of(ti)
        if is_dir_merge:
            for name in os.listxattr(proc, follow_symlinks=False):
                if name != "security.selinux" and name not in want:
                    os.removexattr(proc, name, follow_symlinks=False)
        for k, v in sorted(want.items()):
            os.setxattr(proc, k, v, follow_symlinks=False)
        ns = mtime_ns(ti)
        os.utime(base, ns=(ns, ns), dir_fd=pfd, follow_symlinks=False)
        return ns

    def set_root_meta(self, ti):
        os.chown(self.fd, ti.uid, ti.gid)
        os.chmod(self.fd, ti.mode & 0o7777)
        proc = "/proc/self/fd/%d" % self.fd
        want = xattrs_of(ti)
        for name in os.listxattr(proc):
            if name != "security.selinux" and name not in want:
                os.removexattr(proc, name)
        for k, v in sorted(want.items()):
            os.setxattr(proc, k, v)
        self.dir_mtimes[""] = mtime_ns(ti)

    def entry(self, tf, ti):
        rel = norm(ti.name)
        if rel == "":
            if not ti.isdir():
                raise Refused("root entry %r is not a directory" % ti.name)
            self.set_root_meta(ti)
            return
        pfd, base = self.parent(rel, create=True)
        try:
            try:
                st = os.lstat(base, dir_fd=pfd)
            except FileNotFoundError:
                st = None
            if ti.isdir():
                if st is not None and not stat.S_ISDIR(st.st_mode):
                    self.remove(pfd, base)
                    st = None
                if st is None:
                    os.mkdir(base, 0o700, dir_fd=pfd)
                self.dir_mtimes[rel] = self.set_meta(pfd, base, ti, is_dir_merge=st is not None)
                return
            if ti.islnk():
                target = norm(ti.linkname)
                if target == rel:
                    return
                tfd, tbase = self.parent(target, create=False) if target else (None, None)
                if tfd is None:
                    raise Refused("%r: hard link to the root" % rel)
                try:
                    try:
                        tst = os.lstat(tbase, dir_fd=tfd)
                    except FileNotFoundError:
                        raise Refused("%r: hard link target %r does not exist" % (rel, target))
                    if stat.S_ISDIR(tst.st_mode):
                        raise Refused("%r: hard link to directory %r" % (rel, target))
                    if st is not None:
                        self.remove(pfd, base)
                    os.link(tbase, base, src_dir_fd=tfd, dst_dir_fd=pfd, follow_symlinks=False)
                finally:
                    os.close(tfd)
                return
            if st is not None:
                self.remove(pfd, base)
            if ti.isreg():
                fd = os.open(base, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600, dir_fd=pfd)
                with os.fdopen(fd, "wb") as out:
                    src = tf.extractfile(ti)
                    for chunk in iter(lambda: src.read(1 << 20), b""):
                        out.write(chunk)
            elif ti.issym():
                os.symlink(ti.linkname, base, dir_fd=pfd)
            elif ti.ischr() or ti.isblk():
                kind = stat.S_IFCHR if ti.ischr() else stat.S_IFBLK
                os.mknod(base, kind | 0o600, os.makedev(ti.devmajor, ti.devminor), dir_fd=pfd)
            elif ti.isfifo():
                os.mkfifo(base, 0o600, dir_fd=pfd)
            else:
                raise Refused("%r: unsupported tar entry type %r" % (rel, ti.type))
            self.dir_mtimes.pop(rel, None)
            self.set_meta(pfd, base, ti)
        finally:
            os.close(pfd)

    def apply_layer(self, tar_path):
        with tarfile.open(tar_path, "r:", encoding="utf-8", errors="surrogateescape") as tf:
            members = tf.getmembers()
            for ti in members:  # pass 1: whiteouts hide lower layers only
                rel = norm(ti.name)
                base = rel.rpartition("/")[2]
                if base.startswith(".wh."):
                    self.whiteout(rel)
            for ti in members:  # pass 2: everything else, in order
                base = norm(ti.name).rpartition("/")[2]
                if not base.startswith(".wh."):
                    self.entry(tf, ti)

    def fix_dir_mtimes(self):
        for rel, ns in sorted(self.dir_mtimes.items(), key=lambda kv: -kv[0].count("/")):
            if rel == "":
                os.utime(self.fd, ns=(ns, ns))
                continue
            try:
                pfd, base = self.parent(rel, create=False)
            except (FileNotFoundError, Refused):
                continue
            try:
                st = os.lstat(base, dir_fd=pfd)
                if stat.S_ISDIR(st.st_mode):
                    os.utime(base, ns=(ns, ns), dir_fd=pfd, follow_symlinks=False)
            except FileNotFoundError:
                pass
            finally:
                os.close(pfd)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("image", help="LAYOUT[:TAG], or a docker-archive file with --docker-archive")
    ap.add_argument("dest")
    ap.add_argument("--docker-archive", action="store_true")
    ap.add_argument("--no-verify", action="store_true", help="skip digest/size/diff_id checks")
    args = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("ociunpack: must run as root (ownership, devices, trusted.* xattrs)")
    verify = not args.no_verify
    os.umask(0)
    if os.path.exists(args.dest) and os.listdir(args.dest):
        sys.exit("ociunpack: %s exists and is not empty" % args.dest)
    tmp = tempfile.mkdtemp(prefix="ociunpack.")
    try:
        if args.docker_archive:
            layers = load_docker_archive(args.image, os.path.join(tmp, "archive"), verify)
        else:
            layers = load_oci(args.image, verify)
        os.makedirs(args.dest, exist_ok=True)
        os.chmod(args.dest, 0o755)
        os.chown(args.dest, 0, 0)
        root = Root(args.dest)
        for i, (mt, blob, diff_id) in enumerate(layers):
            tar_path = os.path.join(tmp, "layer.tar")
            decompress(mt, blob, tar_path, diff_id, verify)
            root.apply_layer(tar_path)
            os.unlink(tar_path)
        root.fix_dir_mtimes()
    except Refused as e:
        print("ociunpack: refused: %s" % e, file=sys.stderr)
        return 1
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
