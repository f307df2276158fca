//! One zstd lamina layer read whole into memory or streamed into a writer
//! (hashed on a second thread), and the bounds its bytes must meet.

use std::io::{Read, Write};
use std::sync::mpsc;

use lamina_format::index::MAX_INDEX_SIZE;
use lamina_oci::digest::Sha256;
use lamina_oci::ImageSource;

use super::*;

/// Reads a zstd-compressed lamina layer (index, metadata or boot pages) and
/// checks its uncompressed digest. Its sizes are checked against the
/// layer's limit first (metadata [`MAX_METADATA_SIZE`], index
/// [`MAX_INDEX_SIZE`], boot pages [`MAX_BOOT_PAGES_SIZE`], lookup table
/// [`MAX_LOOKUP_SIZE`]), and it is
/// decompressed as a stream that stops at the limit, so neither a lying
/// annotation nor a zstd bomb makes it allocate more.
pub fn read_compressed_layer(
    source: &dyn ImageSource,
    desc: &Descriptor,
    what: &'static str,
) -> Result<Vec<u8>, ArtifactError> {
    let (decoder, layer) = open_compressed_layer(source, desc, what)?;
    // Sized once (the annotation is bounded above), not grown by doubling:
    // the 85 MB metadata of a 1M-file image was copied over and over.
    let mut out = Vec::with_capacity(layer.size.unwrap_or(0) as usize);
    decoder
        .take(layer.limit.saturating_add(1))
        .read_to_end(&mut out)
        .map_err(|e| layer.corrupt(e.to_string()))?;
    layer.check(out.len() as u64, Digest::of_bytes(&out))?;
    Ok(out)
}

/// Bytes [`copy_compressed_layer`] decompresses at a time.
pub(super) const COPY_BLOCK: usize = 1 << 20;

/// [`read_compressed_layer`] into `out` instead of memory, for a layer to
/// be kept in a file: decompressed a block at a time, each block hashed
/// and written on a second thread while the next one is decompressed (a
/// 1M-file image's 85 MB metadata took a lazy mount 0.2 s of one core,
/// hashed after it was whole). Same bounds and checks; returns the bytes
/// written. What `out` holds is verified only when this returns `Ok`.
pub fn copy_compressed_layer(
    source: &dyn ImageSource,
    desc: &Descriptor,
    what: &'static str,
    out: &mut (dyn Write + Send),
) -> Result<u64, ArtifactError> {
    let (decoder, layer) = open_compressed_layer(source, desc, what)?;
    stream_layer(decoder, &layer, out)
}

/// [`copy_compressed_layer`]'s work on an opened layer.
pub(super) fn stream_layer(
    decoder: LayerDecoder<'_>,
    layer: &CompressedLayer,
    out: &mut (dyn Write + Send),
) -> Result<u64, ArtifactError> {
    let what = layer.what;
    let mut decoder = decoder.take(layer.limit.saturating_add(1));
    let (blocks, to_hash) = mpsc::sync_channel::<Vec<u8>>(2);
    let (give_back, spare) = mpsc::channel::<Vec<u8>>();
    let (len, hashed) = std::thread::scope(|scope| {
        let hasher = scope.spawn(move || -> std::io::Result<[u8; 32]> {
            let mut hash = Sha256::new();
            for block in to_hash {
                hash.update(&block);
                // In pieces, for a daemon that maps the file.
                lamina_sys::write_all_in_pieces(out, &block)?;
                let _ = give_back.send(block);
            }
            Ok(hash.finalize())
        });
        let mut len = 0u64;
        let read = loop {
            let mut block = spare.try_recv().unwrap_or_default();
            block.resize(COPY_BLOCK, 0);
            let n = match read_full(&mut decoder, &mut block) {
                (0, Ok(())) => break Ok(()),
                (n, Ok(())) => n,
                (_, Err(e)) => break Err(e),
            };
            block.truncate(n);
            len += n as u64;
            if blocks.send(block).is_err() {
                break Ok(()); // the writer failed: its error is reported
            }
        };
        drop(blocks);
        let hashed = hasher
            .join()
            .unwrap_or_else(|_| Err(std::io::Error::other("the hashing thread panicked")));
        (read.map(|()| len), hashed)
    });
    let len = len.map_err(|e| layer.corrupt(e.to_string()))?;
    let hashed = hashed.map_err(|e| ArtifactError::Write { what, source: e })?;
    layer.check(len, Digest::from_sha256(hashed))?;
    Ok(len)
}

/// Reads until `buf` is full, the stream ends or a read fails: the bytes
/// read (those before a failure too), and the failure.
pub(crate) fn read_full(reader: &mut impl Read, buf: &mut [u8]) -> (usize, std::io::Result<()>) {
    let mut filled = 0;
    while filled < buf.len() {
        match reader.read(&mut buf[filled..]) {
            Ok(0) => break,
            Ok(n) => filled += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return (filled, Err(e)),
        }
    }
    (filled, Ok(()))
}

/// A zstd lamina layer's decompressing reader.
type LayerDecoder<'a> =
    zstd::stream::read::Decoder<'static, std::io::BufReader<Box<dyn Read + Send + 'a>>>;

/// What a zstd lamina layer's bytes must meet.
pub(super) struct CompressedLayer {
    pub(super) what: &'static str,
    /// Most bytes it may decompress to.
    pub(super) limit: u64,
    /// Its annotated size.
    pub(super) size: Option<u64>,
    /// Its annotated content digest.
    expected: String,
}

/// Opens `desc`'s layer for decompression, after checking its annotated
/// and compressed sizes against the layer's limit.
fn open_compressed_layer<'a>(
    source: &'a dyn ImageSource,
    desc: &Descriptor,
    what: &'static str,
) -> Result<(LayerDecoder<'a>, CompressedLayer), ArtifactError> {
    let layer = CompressedLayer::of(desc, what)?;
    let raw = source.open_blob(desc)?;
    let decoder =
        zstd::stream::read::Decoder::new(raw).map_err(|e| layer.corrupt(e.to_string()))?;
    Ok((decoder, layer))
}

impl CompressedLayer {
    /// What `desc`'s layer must meet, once its annotated and compressed
    /// sizes are within the layer's limit.
    pub(super) fn of(
        desc: &Descriptor,
        what: &'static str,
    ) -> Result<CompressedLayer, ArtifactError> {
        let max = match desc.media_type.as_str() {
            MEDIA_TYPE_METADATA => MAX_METADATA_SIZE,
            MEDIA_TYPE_INDEX => MAX_INDEX_SIZE,
            MEDIA_TYPE_BOOT => MAX_BOOT_PAGES_SIZE,
            MEDIA_TYPE_LOOKUP => MAX_LOOKUP_SIZE,
            MEDIA_TYPE_TAR_INDEX => MAX_TAR_INDEX_SIZE,
            other => {
                return Err(ArtifactError::NotLamina(format!(
                    "{what}: layer type {other} is not a zstd lamina layer"
                )))
            }
        };
        let size = annotated_size(desc, what)?;
        if let Some(size) = size {
            too_large(what, size, max)?;
        }
        // Decompress no further than the annotation says, else the limit.
        let limit = size.unwrap_or(max);
        too_large(what, desc.size, compressed_limit(limit))?;
        let expected = desc
            .annotations
            .get(ANNOTATION_UNCOMPRESSED_DIGEST)
            .ok_or_else(|| ArtifactError::NotLamina(format!("{what} layer has no content digest")))?
            .clone();
        Ok(CompressedLayer {
            what,
            limit,
            size,
            expected,
        })
    }

    pub(super) fn corrupt(&self, reason: String) -> ArtifactError {
        ArtifactError::Corrupt {
            what: self.what,
            reason,
        }
    }

    /// Checks `len` bytes of digest `actual`, all the layer decompressed
    /// to (at most one byte past its limit).
    fn check(&self, len: u64, actual: Digest) -> Result<(), ArtifactError> {
        self.check_size(len)?;
        if actual.to_string() != self.expected {
            return Err(self.corrupt(format!(
                "content digest {actual} does not match {}",
                self.expected
            )));
        }
        Ok(())
    }

    /// Checks `len`, the bytes the layer decompressed to (at most one past
    /// its limit), against its limit and its annotated size.
    pub(super) fn check_size(&self, len: u64) -> Result<(), ArtifactError> {
        if len > self.limit {
            return Err(self.corrupt(format!("decompresses to more than {} bytes", self.limit)));
        }
        if let Some(size) = self.size.filter(|&s| s != len) {
            return Err(self.corrupt(format!(
                "{len} bytes uncompressed, the annotation says {size}"
            )));
        }
        Ok(())
    }
}
