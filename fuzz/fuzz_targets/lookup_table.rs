//! The FUSE daemon's lookup table (`lamina_format::lookup`) on arbitrary
//! bytes, two ways:
//! - as a table: `LookupTable::parse_without_digest` (the digest check of
//!   `parse` would stop nearly every input before the counts and regions),
//!   then lookups by name and by path taken from the input: nothing panics
//!   or reads out of bounds, and whatever `parse` accepts the other does;
//! - as an EROFS image: a table `build_from_image` makes parses for that
//!   image (`parse_for`), and finds every entry of the root directory by
//!   name and (unless its name holds a '/') by path, with the nid the image
//!   lists.
//!
//! Seeds: the `erofs_reader` image and the table `build_from_image` made of
//! it.
#![no_main]

use lamina_format::erofs::Image;
use lamina_format::lookup::{build_from_image, LookupTable};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    as_table(data);
    as_image(data);
});

fn as_table(data: &[u8]) {
    if LookupTable::parse(data).is_ok() {
        assert!(LookupTable::parse_without_digest(data).is_ok());
    }
    let Ok(table) = LookupTable::parse_without_digest(data) else {
        return;
    };
    assert_eq!(table.lookup_path(b""), Some(table.root_nid()));
    // Names and paths out of the input itself, at a few cuts.
    for cut in [1usize, 7, 64, 255].into_iter().filter(|&c| c <= data.len()) {
        let piece = &data[data.len() - cut..];
        let _ = table.lookup(table.root_nid(), piece);
        let _ = table.lookup(u64::from(piece[0]), piece);
        let _ = table.lookup_path(piece);
    }
}

fn as_image(data: &[u8]) {
    let Ok(bytes) = build_from_image(data) else {
        return;
    };
    let table = LookupTable::parse_for(&bytes, data).expect("a built table parses for its image");
    let img = Image::new(data).expect("the builder read this image");
    assert_eq!(table.root_nid(), img.root_nid());
    let root = img.inode(img.root_nid()).expect("the builder read the root");
    let entries = img.entries(&root).expect("the builder listed the root");
    for e in entries.iter().filter(|e| e.name != b"." && e.name != b"..") {
        assert_eq!(table.lookup(img.root_nid(), e.name), Some(e.nid));
        // A path is names joined by '/': a name with one in it (a hostile
        // image's; the kernel never asks for it) is found by name only.
        if !e.name.contains(&b'/') {
            assert_eq!(table.lookup_path(e.name), Some(e.nid));
        }
    }
}
