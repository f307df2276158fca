//! Layer tars (with PAX and GNU records) applied in a row by
//! `lamina_tree::apply_layer`: never panics, and a tree that every layer
//! applied to is written by the EROFS writer without panic, as
//! `lamina-image`'s build does.
//!
//! Input: one byte whose low two bits are the layer count minus one; each
//! layer but the last is a little-endian u32 length and that many bytes
//! (cut short at the end of the input); the last layer is the rest.
#![no_main]

use std::io::{self, Read};

use lamina_format::erofs::{self, ChunkAddr, Device, FileChunks};
use lamina_tree::{apply_layer, Tree};
use libfuzzer_sys::fuzz_target;

/// Chunk size of the fuzzed images: one block, so small files get chunks.
const CHUNK_BITS: u8 = 12;

fn layers(data: &[u8]) -> Vec<&[u8]> {
    let Some((&control, mut rest)) = data.split_first() else {
        return Vec::new();
    };
    let count = usize::from(control & 3) + 1;
    let mut out = Vec::with_capacity(count);
    for _ in 1..count {
        let Some((len, tail)) = rest.split_first_chunk::<4>() else {
            break;
        };
        let len = (u32::from_le_bytes(*len) as usize).min(tail.len());
        let (layer, tail) = tail.split_at(len);
        out.push(layer);
        rest = tail;
    }
    out.push(rest);
    out
}

/// Cuts a file into chunks the way the image builder does (all-zero chunks
/// are holes, others get the next block of the one data device).
fn store(reader: &mut dyn Read, size: u64, next_block: &mut u32) -> io::Result<FileChunks> {
    let mut chunks = Vec::new();
    let mut buf = [0u8; 1 << CHUNK_BITS];
    let mut remaining = size;
    while remaining > 0 {
        let want = remaining.min(buf.len() as u64) as usize;
        reader.read_exact(&mut buf[..want])?;
        remaining -= want as u64;
        if buf[..want].iter().all(|&b| b == 0) {
            chunks.push(ChunkAddr::Hole);
        } else {
            chunks.push(ChunkAddr::Data {
                device: 1,
                blkaddr: *next_block,
            });
            *next_block += 1;
        }
    }
    Ok(FileChunks {
        chunk_bits: CHUNK_BITS,
        chunks,
    })
}

fuzz_target!(|data: &[u8]| {
    let mut tree: Tree<FileChunks> = Tree::new();
    let mut next_block = 0u32;
    for (i, layer) in layers(data).into_iter().enumerate() {
        let applied = apply_layer(&mut tree, i as u32, layer, |_, reader, size, _| {
            store(reader, size, &mut next_block)
        });
        if applied.is_err() {
            return; // the build stops at a bad layer
        }
    }
    let devices = if next_block > 0 {
        vec![Device {
            tag: "0".repeat(64),
            blocks: next_block,
        }]
    } else {
        Vec::new()
    };
    if let Ok((image, stats)) = erofs::write_image(&tree, &devices) {
        assert_eq!(image.len(), stats.blocks as usize * 4096);
    }
});
