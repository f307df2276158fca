//! `lamina_format::erofs::Image` (the FUSE path's EROFS reader) on arbitrary
//! bytes: the whole image is walked from the root (every inode, listing,
//! lookup of each listed name, symlink target, xattr list and chunk table)
//! and nothing panics. Besides: a listed name that a lookup finds is the
//! listed entry, a symlink target is as long as its inode says, and a chunk
//! table has an entry for every index below its length. And the check a
//! kernel mount waits for (`Image::check_tree`) ends without a panic.
#![no_main]

use std::collections::HashSet;

use lamina_format::erofs::{Image, Kind};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(img) = Image::new(data) else {
        return;
    };
    let _ = img.check_tree();
    let mut stack = vec![img.root_nid()];
    let mut seen = HashSet::new();
    while let Some(nid) = stack.pop() {
        // Bounded: a corrupt image may name any nid.
        if seen.len() > 2000 || !seen.insert(nid) {
            continue;
        }
        let Ok(inode) = img.inode(nid) else { continue };
        let _ = img.xattrs(&inode);
        match inode.kind() {
            Some(Kind::Directory) => {
                let Ok(entries) = img.entries(&inode) else { continue };
                for e in entries.iter().take(500) {
                    if let Ok(Some(found)) = img.lookup(&inode, e.name) {
                        assert_eq!(found.name, e.name);
                    }
                    stack.push(e.nid);
                }
            }
            Some(Kind::Symlink) => {
                if let Ok(target) = img.symlink_target(&inode) {
                    assert_eq!(target.len() as u64, inode.size);
                }
            }
            Some(Kind::Regular) => {
                if let Ok(chunks) = img.chunks(&inode) {
                    for i in 0..chunks.len().min(10_000) {
                        assert!(chunks.get(i).is_some());
                    }
                    assert!(chunks.get(chunks.len()).is_none());
                }
            }
            _ => {
                let _ = inode.rdev();
            }
        }
    }
});
