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
    push_forged_index(reg, image, &|metadata| make_setuid(metadata, path))
}

/// The image's true index with its EROFS metadata changed by `edit`,
/// pushed as a referrer of the manifest `image` names. Returns its digest.
pub fn push_forged_index(reg: &Registry, image: &str, edit: &dyn Fn(&mut Vec<u8>)) -> String {
    use lamina_oci::{open_source, Descriptor, ImageRef, SourceOptions};
    let image: ImageRef = reg.reference(image).parse().unwrap();
    let opts = SourceOptions::default();
    let source = open_source(&image, &opts).unwrap();
    let span = 64 << 10;
    let built = lamina_image::tar_index::build(source.as_ref(), span, &|_| {}).unwrap();
    let mut forged = built.metadata.clone();
    edit(&mut forged);
    let img = source.image();
    let subject = Descriptor::new(
        img.manifest_media_type(),
        img.manifest_digest.clone(),
        img.manifest_bytes.len() as u64,
    );
    // Built from the true metadata (the publisher's tool refuses some
    // forgeries while it builds the lookup table), then the metadata
    // layer swapped for the forged one, as a forger's own tool would.
    let (mut layers, bytes) =
        lamina_image::index::artifact(&built, None, subject, (span, None)).unwrap();
    let bytes = swap_metadata(&mut layers, &bytes, &forged);
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
        let inode = inode_at(&image, path);
        (image.inode_offset(inode.nid).unwrap(), inode.mode)
    };
    // i_mode sits at the same place in compact and extended inodes.
    let (head, _) = InodeCompact::mut_from_prefix(&mut metadata[at as usize..]).unwrap();
    head.i_mode.set(u16::try_from(mode | 0o4000).unwrap());
}

/// The inode at `path` (relative to the root) of an EROFS image.
fn inode_at<'a>(
    image: &lamina_format::erofs::Image<'a>,
    path: &str,
) -> lamina_format::erofs::Inode<'a> {
    let mut inode = image.inode(image.root_nid()).unwrap();
    for name in path.split('/') {
        let entry = image.lookup(&inode, name.as_bytes()).unwrap();
        let entry = entry.unwrap_or_else(|| panic!("no {path} in the image"));
        inode = image.inode(entry.nid).unwrap();
    }
    inode
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

/// Makes the directory `path` the root again in EROFS `metadata`: every
/// directory entry naming its inode (its name in its parent, its own `.`)
/// names the root instead, so `path/path/...` goes on for ever (a loop
/// the kernel's parser would be handed).
pub fn loop_to_root(metadata: &mut [u8], path: &str) {
    use lamina_format::erofs::Image;
    let (nid, root) = {
        let image = Image::new(metadata).unwrap();
        (inode_at(&image, path).nid, image.root_nid())
    };
    // A directory entry: nid (8 bytes, LE), name offset (2), file type (1:
    // 2 is a directory), reserved (1: zero).
    let (nid, root) = (nid.to_le_bytes(), root.to_le_bytes());
    let mut changed = 0;
    for at in 0..metadata.len().saturating_sub(12) {
        if metadata[at..at + 8] == nid && metadata[at + 10] == 2 && metadata[at + 11] == 0 {
            metadata[at..at + 8].copy_from_slice(&root);
            changed += 1;
        }
    }
    assert!(changed >= 2, "{changed} entries of {path} found");
}

/// Puts `metadata` in place of the metadata layer of an index artifact
/// (`layers`, manifest `manifest`); returns the new manifest.
fn swap_metadata(
    layers: &mut lamina_image::index::ArtifactLayers,
    manifest: &[u8],
    metadata: &[u8],
) -> Vec<u8> {
    use lamina_image::artifact::{content_annotations, MEDIA_TYPE_METADATA};
    let k = layers
        .iter()
        .position(|(d, _)| d.media_type == MEDIA_TYPE_METADATA)
        .expect("a metadata layer");
    let compressed = zstd::bulk::compress(metadata, 3).unwrap();
    let desc = lamina_oci::Descriptor {
        annotations: content_annotations(metadata),
        ..lamina_oci::Descriptor::of_bytes(MEDIA_TYPE_METADATA, &compressed)
    };
    let mut doc: serde_json::Value = serde_json::from_slice(manifest).unwrap();
    doc["layers"][k] = serde_json::to_value(&desc).unwrap();
    layers[k] = (desc, compressed);
    serde_json::to_vec(&doc).unwrap()
}
