//! Layer compression detection and the verifying decompression stream.

use std::io::{self, BufReader, Read};

use crate::digest::Sha256;
use flate2::read::MultiGzDecoder;

use crate::digest::{Digest, VerifyingReader};
use crate::error::OciError;
use crate::types::{media_types as mt, Descriptor};

/// Compression of a layer blob.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Compression {
    /// Plain tar.
    None,
    /// gzip (possibly several members).
    Gzip,
    /// zstd (possibly several frames).
    Zstd,
}

impl Compression {
    /// The compression implied by a layer media type; `None` (the Option)
    /// for media types that are not known layer types.
    pub fn from_media_type(media_type: &str) -> Option<Compression> {
        match media_type {
            mt::OCI_LAYER_TAR
            | mt::OCI_LAYER_NONDIST_TAR
            | mt::DOCKER_LAYER_TAR
            | mt::DOCKER_FOREIGN_LAYER_TAR => Some(Compression::None),
            mt::OCI_LAYER_GZIP
            | mt::OCI_LAYER_NONDIST_GZIP
            | mt::DOCKER_LAYER_GZIP
            | mt::DOCKER_FOREIGN_LAYER_GZIP => Some(Compression::Gzip),
            mt::OCI_LAYER_ZSTD | mt::OCI_LAYER_NONDIST_ZSTD | mt::DOCKER_LAYER_ZSTD => {
                Some(Compression::Zstd)
            }
            _ => None,
        }
    }

    /// Guess the compression from the first bytes of a blob: gzip magic
    /// `1f 8b`, zstd magic `28 b5 2f fd`, anything else is taken as tar.
    pub fn sniff(prefix: &[u8]) -> Compression {
        if prefix.starts_with(&[0x1f, 0x8b]) {
            Compression::Gzip
        } else if prefix.starts_with(&[0x28, 0xb5, 0x2f, 0xfd]) {
            Compression::Zstd
        } else {
            Compression::None
        }
    }

    /// Short name: "none", "gzip", "zstd".
    pub fn name(self) -> &'static str {
        match self {
            Compression::None => "none",
            Compression::Gzip => "gzip",
            Compression::Zstd => "zstd",
        }
    }

    /// The OCI layer media type for this compression.
    pub fn oci_layer_media_type(self) -> &'static str {
        match self {
            Compression::None => mt::OCI_LAYER_TAR,
            Compression::Gzip => mt::OCI_LAYER_GZIP,
            Compression::Zstd => mt::OCI_LAYER_ZSTD,
        }
    }
}

type Raw<'a> = Box<dyn Read + Send + 'a>;

enum Decoder<'a> {
    Plain(Box<VerifyingReader<Raw<'a>>>),
    Gzip(Box<MultiGzDecoder<VerifyingReader<Raw<'a>>>>),
    Zstd(Box<zstd::stream::read::Decoder<'static, BufReader<VerifyingReader<Raw<'a>>>>>),
}

impl<'a> Decoder<'a> {
    fn compressed(&mut self) -> &mut VerifyingReader<Raw<'a>> {
        match self {
            Decoder::Plain(r) => r,
            Decoder::Gzip(d) => d.get_mut(),
            Decoder::Zstd(d) => d.get_mut().get_mut(),
        }
    }

    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            Decoder::Plain(r) => r.read(buf),
            Decoder::Gzip(d) => d.read(buf),
            Decoder::Zstd(d) => d.read(buf),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    Reading,
    Done,
    Failed,
}

/// The uncompressed tar stream of a layer, verified on the way.
///
/// The compressed bytes are checked against the descriptor's digest and size,
/// the uncompressed bytes against the diff_id. Any mismatch, and any corrupt
/// or truncated compressed data, is reported as an `io::Error` of kind
/// `InvalidData` carrying an [`OciError`], at the latest by the read that
/// would otherwise return end-of-stream. After the decompressor finishes, the
/// rest of the compressed blob (trailing bytes) is still read and hashed.
pub struct LayerReader<'a> {
    decoder: Decoder<'a>,
    compression: Compression,
    blob: Digest,
    diff_id: Digest,
    hasher: Sha256,
    state: State,
}

impl std::fmt::Debug for LayerReader<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LayerReader")
            .field("blob", &self.blob)
            .field("compression", &self.compression)
            .field("diff_id", &self.diff_id)
            .field("state", &self.state)
            .finish_non_exhaustive()
    }
}

impl<'a> LayerReader<'a> {
    /// Wrap the raw blob stream `raw` of the layer described by `desc`.
    pub fn new(
        raw: Raw<'a>,
        desc: &Descriptor,
        compression: Compression,
        diff_id: Digest,
    ) -> Result<LayerReader<'a>, OciError> {
        let verifying = VerifyingReader::new(raw, desc.digest.clone(), Some(desc.size));
        let decoder = match compression {
            Compression::None => Decoder::Plain(Box::new(verifying)),
            Compression::Gzip => Decoder::Gzip(Box::new(MultiGzDecoder::new(verifying))),
            Compression::Zstd => Decoder::Zstd(Box::new(
                zstd::stream::read::Decoder::new(verifying).map_err(|source| {
                    OciError::Decompress {
                        blob: desc.digest.clone(),
                        compression: "zstd",
                        source,
                    }
                })?,
            )),
        };
        Ok(LayerReader {
            decoder,
            compression,
            blob: desc.digest.clone(),
            diff_id,
            hasher: Sha256::new(),
            state: State::Reading,
        })
    }

    fn fail(&mut self, err: io::Error) -> io::Error {
        self.state = State::Failed;
        err
    }

    /// Read the rest of the compressed blob so that it is verified.
    fn drain_compressed(&mut self) -> io::Result<()> {
        let compressed = self.decoder.compressed();
        if compressed.is_verified() {
            return Ok(());
        }
        io::copy(compressed, &mut io::sink())?;
        Ok(())
    }

    fn finish(&mut self) -> io::Result<usize> {
        if let Err(e) = self.drain_compressed() {
            return Err(self.fail(e));
        }
        let actual = Digest::from_sha256(self.hasher.clone().finalize());
        if actual != self.diff_id {
            let err = OciError::DiffIdMismatch {
                blob: self.blob.clone(),
                expected: self.diff_id.clone(),
                actual,
            };
            return Err(self.fail(err.into_io()));
        }
        self.state = State::Done;
        Ok(0)
    }

    fn decoder_error(&mut self, e: io::Error) -> io::Error {
        if OciError::from_io(&e).is_some() || self.decoder.compressed().has_failed() {
            // From the raw stream (verification or transport): pass through.
            return self.fail(e);
        }
        // A decompression error. A wrong blob is the better explanation if
        // the compressed digest does not match, so check that first.
        if let Err(drain_err) = self.drain_compressed() {
            if OciError::from_io(&drain_err).is_some() {
                return self.fail(drain_err);
            }
        }
        let err = OciError::Decompress {
            blob: self.blob.clone(),
            compression: self.compression.name(),
            source: e,
        };
        self.fail(err.into_io())
    }
}

impl Read for LayerReader<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self.state {
            State::Done => return Ok(0),
            State::Failed => {
                return Err(OciError::StreamFailed {
                    object: format!("layer {}", self.blob),
                }
                .into_io())
            }
            State::Reading => {}
        }
        if buf.is_empty() {
            return Ok(0);
        }
        match self.decoder.read(buf) {
            Ok(0) => self.finish(),
            Ok(n) => {
                if let Some(got) = buf.get(..n) {
                    self.hasher.update(got);
                }
                Ok(n)
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => Err(e),
            Err(e) => Err(self.decoder_error(e)),
        }
    }
}
