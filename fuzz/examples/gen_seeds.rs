//! Writes the seed corpus of the format targets into `fuzz/seeds/` from
//! lamina's own writers (the tar seeds come from `gen_tar_seeds.py`).
//!
//! Usage (from the repository root):
//! `cargo +nightly run --manifest-path fuzz/Cargo.toml --example gen_seeds`

use std::fs;
use std::path::Path;

use lamina_format::boot::{BootExtent, BootPages, BOOT_PAGE};
use lamina_format::index::{ChunkEntry, ChunkIndex, IndexBlob, CHUNK_ZSTD};

fn write(target: &str, name: &str, bytes: &[u8]) -> std::io::Result<()> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("seeds")
        .join(target);
    fs::create_dir_all(&dir)?;
    fs::write(dir.join(name), bytes)
}

fn chunk(cache: u64, comp: u64, csize: u32, size: u32, flags: u32) -> ChunkEntry {
    ChunkEntry {
        cache_offset: cache.into(),
        compressed_offset: comp.into(),
        compressed_size: csize.into(),
        size: size.into(),
        flags: flags.into(),
        reserved: 0.into(),
        digest: [cache as u8 ^ 0x5a; 32],
    }
}

fn index() -> ChunkIndex {
    ChunkIndex {
        chunk_bits: 16,
        blobs: vec![
            IndexBlob {
                digest: [1; 32],
                compressed_size: 300,
                cache_size: 3 * 4096,
                chunks: vec![
                    chunk(0, 0, 100, 5000, CHUNK_ZSTD),
                    chunk(8192, 100, 200, 200, 0),
                ],
            },
            IndexBlob {
                digest: [2; 32],
                compressed_size: 50,
                cache_size: 4096,
                chunks: vec![chunk(0, 0, 50, 4096, CHUNK_ZSTD)],
            },
        ],
        prefetch: vec![(1, 0), (0, 1)],
    }
}

fn extent(blob: u32, page: u64, pages: u32) -> BootExtent {
    BootExtent {
        cache_offset: (page * BOOT_PAGE).into(),
        blob: blob.into(),
        pages: pages.into(),
    }
}

/// The boot target's input: blob count, cache sizes, then the blob.
fn boot_input(sizes: &[u64], boot: &BootPages) -> Vec<u8> {
    let mut out = vec![sizes.len() as u8];
    for size in sizes {
        out.extend_from_slice(&size.to_le_bytes());
    }
    out.extend_from_slice(&boot.to_bytes());
    out
}

/// One fanotify event record (metadata version 3), with a range record.
fn fanotify_record(fd: i32, pid: i32, range: Option<(u64, u64)>) -> Vec<u8> {
    let len = if range.is_some() { 48u32 } else { 24 };
    let mut b = Vec::new();
    b.extend_from_slice(&len.to_ne_bytes());
    b.extend_from_slice(&[3, 0]);
    b.extend_from_slice(&24u16.to_ne_bytes());
    b.extend_from_slice(&0x0010_0000u64.to_ne_bytes()); // FAN_PRE_ACCESS
    b.extend_from_slice(&fd.to_ne_bytes());
    b.extend_from_slice(&pid.to_ne_bytes());
    if let Some((offset, count)) = range {
        b.extend_from_slice(&[6, 0]); // FAN_EVENT_INFO_TYPE_RANGE
        b.extend_from_slice(&24u16.to_ne_bytes());
        b.extend_from_slice(&0u32.to_ne_bytes());
        b.extend_from_slice(&offset.to_ne_bytes());
        b.extend_from_slice(&count.to_ne_bytes());
    }
    b
}

fn main() -> std::io::Result<()> {
    let index = index();
    write("chunk_index", "two-blobs", &index.to_bytes())?;
    let empty = ChunkIndex {
        chunk_bits: 18,
        blobs: Vec::new(),
        prefetch: Vec::new(),
    };
    write("chunk_index", "empty", &empty.to_bytes())?;

    let boot = BootPages {
        extents: vec![extent(1, 3, 2), extent(0, 0, 1)],
        data: (0..3 * BOOT_PAGE as usize)
            .map(|i| (i / 4096) as u8)
            .collect(),
    };
    write(
        "boot_pages",
        "two-blobs",
        &boot_input(&[4096, 5 * 4096], &boot),
    )?;
    write(
        "boot_pages",
        "empty",
        &boot_input(&[4096], &BootPages::default()),
    )?;

    let mut two = fanotify_record(7, 1234, Some((8192, 4096)));
    two.extend_from_slice(&fanotify_record(-1, 0, None));
    write("fanotify_events", "range-and-overflow", &two)?;

    for (name, header) in [
        (
            "bearer",
            r#"Bearer realm="https://auth.example/token",service="registry.example",scope="repository:library/debian:pull""#,
        ),
        ("basic", r#"Basic realm="Registry Realm""#),
        (
            "escapes",
            r#"Bearer realm="a\"b\\c", error=insufficient_scope , x="1,2""#,
        ),
    ] {
        write("auth_challenge", name, header.as_bytes())?;
    }
    write("erofs_reader", "small-tree", &erofs_image())?;
    Ok(())
}

/// A small image of every inode kind: a directory spanning two blocks, a
/// chunked file with a hole, symlinks inline and in a block, a device, xattrs.
fn erofs_image() -> Vec<u8> {
    use lamina_format::erofs::{write_image, ChunkAddr, Device, FileChunks};
    use lamina_tree::{DirEntry, Metadata, Node, NodeKind, Tree};
    let mut t: Tree<FileChunks> = Tree::new();
    let mut add = |dir: usize, name: &[u8], meta: Metadata, kind| {
        let id = t.add_node(Node { meta, kind });
        if let NodeKind::Directory { entries } = &mut t.nodes[dir].kind {
            entries.insert(name.to_vec(), DirEntry { node: id, layer: 0 });
        }
        id
    };
    let meta = |mode, mtime| Metadata {
        mode,
        mtime,
        ..Metadata::default()
    };
    let mut owned = meta(0o4755, 9);
    owned.uid = 70000;
    owned.xattrs.insert(b"user.empty".to_vec(), Vec::new());
    owned.xattrs.insert(b"security.capability".to_vec(), vec![1, 2, 3]);
    let chunks = vec![
        ChunkAddr::Data { device: 1, blkaddr: 3 },
        ChunkAddr::Hole,
        ChunkAddr::Data { device: 2, blkaddr: 0 },
    ];
    let file = NodeKind::Regular {
        size: 2 * 4096 + 10,
        content: FileChunks { chunk_bits: 12, chunks },
    };
    add(0, b"file", owned, file);
    let dir = NodeKind::Directory {
        entries: Default::default(),
    };
    let sub = add(0, b"sub", meta(0o755, 1), dir);
    for i in 0..300 {
        let name = format!("entry-{i:03}");
        add(sub, name.as_bytes(), meta(0o644, 1), NodeKind::Fifo);
    }
    for (name, len) in [(&b"short"[..], 4usize), (b"long", 4095)] {
        let target = vec![b'x'; len];
        add(0, name, meta(0o777, 1), NodeKind::Symlink { target });
    }
    let dev = NodeKind::CharDevice { major: 1, minor: 3 };
    add(0, b"null", meta(0o666, 1), dev);
    let devices = [
        Device { tag: "a".into(), blocks: 4 },
        Device { tag: "b".into(), blocks: 1 },
    ];
    write_image(&t, &devices).expect("the seed tree is valid").0
}
