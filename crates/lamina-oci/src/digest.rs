//! Content digests (`sha256:<hex>`) and hashing/verifying stream adapters.

use std::fmt;
use std::io::{self, Read, Write};
use std::str::FromStr;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::error::OciError;

/// Incremental SHA-256. ring's implementation (already linked for TLS)
/// runs about twice as fast as the pure-Rust `sha2` crate on CPUs without
/// SHA extensions, and hashing is most of convert's and the fetcher's CPU.
#[derive(Clone)]
pub struct Sha256(ring::digest::Context);

impl Sha256 {
    /// An empty hasher.
    pub fn new() -> Sha256 {
        Sha256(ring::digest::Context::new(&ring::digest::SHA256))
    }

    /// Hash more bytes.
    pub fn update(&mut self, data: &[u8]) {
        self.0.update(data);
    }

    /// The 32-byte hash of everything given.
    pub fn finalize(self) -> [u8; 32] {
        let mut out = [0u8; 32];
        out.copy_from_slice(self.0.finish().as_ref());
        out
    }
}

impl Default for Sha256 {
    fn default() -> Self {
        Sha256::new()
    }
}

impl fmt::Debug for Sha256 {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Sha256")
    }
}

/// The SHA-256 hash of `data`.
pub fn sha256(data: &[u8]) -> [u8; 32] {
    let mut out = [0u8; 32];
    out.copy_from_slice(ring::digest::digest(&ring::digest::SHA256, data).as_ref());
    out
}

/// A validated content digest, always `sha256:` followed by 64 lowercase
/// hex digits. Because it is validated on construction, its [`hex`](Self::hex)
/// part is safe to use as a file name.
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Digest {
    full: String,
}

const PREFIX: &str = "sha256:";

impl Digest {
    /// The digest of a byte slice.
    pub fn of_bytes(bytes: &[u8]) -> Digest {
        Digest::from_sha256(sha256(bytes))
    }

    /// Build from a raw 32-byte sha256 hash.
    pub fn from_sha256(hash: [u8; 32]) -> Digest {
        Digest {
            full: format!("{PREFIX}{}", hex::encode(hash)),
        }
    }

    /// Parse `sha256:<64 lowercase hex>`; same as `FromStr`.
    pub fn parse(s: &str) -> Result<Digest, OciError> {
        s.parse()
    }

    /// Build from the 64-digit hex part alone.
    pub fn from_hex(hex: &str) -> Result<Digest, OciError> {
        format!("{PREFIX}{hex}").parse()
    }

    /// The algorithm name, always `"sha256"`.
    pub fn algorithm(&self) -> &str {
        "sha256"
    }

    /// The 64 lowercase hex digits.
    pub fn hex(&self) -> &str {
        &self.full[PREFIX.len()..]
    }

    /// The 32 bytes of the hash.
    pub fn to_sha256(&self) -> [u8; 32] {
        let mut bytes = [0; 32];
        // Parsing checked 64 lowercase hex digits.
        hex::decode_to_slice(self.hex(), &mut bytes).expect("a parsed digest is hex");
        bytes
    }

    /// The full `sha256:<hex>` string.
    pub fn as_str(&self) -> &str {
        &self.full
    }
}

impl FromStr for Digest {
    type Err = OciError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let bad = |reason| OciError::InvalidDigest {
            value: s.chars().take(100).collect(),
            reason,
        };
        let Some((alg, hex)) = s.split_once(':') else {
            return Err(bad("expected <algorithm>:<hex>"));
        };
        if alg != "sha256" {
            return Err(bad("only sha256 digests are supported"));
        }
        if hex.len() != 64 {
            return Err(bad("sha256 digest must have exactly 64 hex digits"));
        }
        if !hex.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')) {
            return Err(bad("digest must be lowercase hex"));
        }
        Ok(Digest {
            full: s.to_string(),
        })
    }
}

impl fmt::Display for Digest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.full)
    }
}

impl fmt::Debug for Digest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Digest({})", self.full)
    }
}

impl Serialize for Digest {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.full)
    }
}

impl<'de> Deserialize<'de> for Digest {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

/// A writer adapter that hashes (sha256) and counts everything written
/// through it.
#[derive(Debug)]
pub struct DigestWriter<W> {
    inner: W,
    hasher: Sha256,
    count: u64,
}

impl<W: Write> DigestWriter<W> {
    /// Wrap `inner`.
    pub fn new(inner: W) -> Self {
        DigestWriter {
            inner,
            hasher: Sha256::new(),
            count: 0,
        }
    }

    /// Return the inner writer, the digest and the number of bytes written.
    pub fn finish(self) -> (W, Digest, u64) {
        (
            self.inner,
            Digest::from_sha256(self.hasher.finalize()),
            self.count,
        )
    }
}

impl<W: Write> Write for DigestWriter<W> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let n = self.inner.write(buf)?;
        let written = buf.get(..n).unwrap_or(buf);
        self.hasher.update(written);
        self.count += n as u64;
        Ok(n)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.inner.flush()
    }
}

/// A reader adapter that hashes (sha256) and counts everything read through
/// it.
#[derive(Debug)]
pub struct DigestReader<R> {
    inner: R,
    hasher: Sha256,
    count: u64,
}

impl<R: Read> DigestReader<R> {
    /// Wrap `inner`.
    pub fn new(inner: R) -> Self {
        DigestReader {
            inner,
            hasher: Sha256::new(),
            count: 0,
        }
    }

    /// Return the inner reader, the digest and the number of bytes read.
    pub fn finish(self) -> (R, Digest, u64) {
        (
            self.inner,
            Digest::from_sha256(self.hasher.finalize()),
            self.count,
        )
    }

    /// The digest of the bytes read so far (does not consume the reader).
    pub fn digest_so_far(&self) -> Digest {
        Digest::from_sha256(self.hasher.clone().finalize())
    }

    /// Number of bytes read so far.
    pub fn bytes_read(&self) -> u64 {
        self.count
    }

    /// Mutable access to the wrapped reader.
    pub fn get_mut(&mut self) -> &mut R {
        &mut self.inner
    }
}

impl<R: Read> Read for DigestReader<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.inner.read(buf)?;
        let got = buf.get(..n).unwrap_or(buf);
        self.hasher.update(got);
        self.count += n as u64;
        Ok(n)
    }
}

/// A reader that checks a blob's digest and (optionally) size.
///
/// Reading more bytes than `size` fails at once; at end of stream the size
/// and digest are compared and a mismatch is returned as an `io::Error` of
/// kind `InvalidData` carrying an [`OciError`]. Only after a successful check
/// does it return end-of-stream (`Ok(0)`).
#[derive(Debug)]
pub struct VerifyingReader<R> {
    inner: DigestReader<R>,
    expected: Digest,
    size: Option<u64>,
    state: VerifyState,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum VerifyState {
    Reading,
    Verified,
    Failed,
}

impl<R: Read> VerifyingReader<R> {
    /// Verify `inner` against `expected` and, if given, `size`.
    pub fn new(inner: R, expected: Digest, size: Option<u64>) -> Self {
        VerifyingReader {
            inner: DigestReader::new(inner),
            expected,
            size,
            state: VerifyState::Reading,
        }
    }

    /// Whether end-of-stream was reached and the content verified.
    pub fn is_verified(&self) -> bool {
        self.state == VerifyState::Verified
    }

    /// Whether a read failed (verification or an error of the inner reader).
    pub fn has_failed(&self) -> bool {
        self.state == VerifyState::Failed
    }

    /// Number of bytes read so far.
    pub fn bytes_read(&self) -> u64 {
        self.inner.bytes_read()
    }

    /// The digest being verified against.
    pub fn expected(&self) -> &Digest {
        &self.expected
    }

    fn fail(&mut self, err: OciError) -> io::Error {
        self.state = VerifyState::Failed;
        err.into_io()
    }
}

impl<R: Read> Read for VerifyingReader<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self.state {
            VerifyState::Verified => return Ok(0),
            VerifyState::Failed => {
                return Err(OciError::StreamFailed {
                    object: format!("blob {}", self.expected),
                }
                .into_io())
            }
            VerifyState::Reading => {}
        }
        if buf.is_empty() {
            return Ok(0);
        }
        let n = match self.inner.read(buf) {
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => return Err(e),
            Err(e) => {
                self.state = VerifyState::Failed;
                return Err(e);
            }
        };
        let count = self.inner.bytes_read();
        if let Some(size) = self.size {
            if count > size {
                let digest = self.expected.clone();
                return Err(self.fail(OciError::SizeMismatch {
                    digest,
                    expected: size,
                    actual: count,
                }));
            }
        }
        if n > 0 {
            return Ok(n);
        }
        if let Some(size) = self.size {
            if count != size {
                let digest = self.expected.clone();
                return Err(self.fail(OciError::SizeMismatch {
                    digest,
                    expected: size,
                    actual: count,
                }));
            }
        }
        let actual = self.inner.digest_so_far();
        if actual != self.expected {
            let expected = self.expected.clone();
            return Err(self.fail(OciError::DigestMismatch { expected, actual }));
        }
        self.state = VerifyState::Verified;
        Ok(0)
    }
}

/// Read a whole blob into memory, checking size and digest, refusing blobs
/// larger than `limit`.
pub(crate) fn read_verified<R: Read>(
    reader: R,
    expected: &Digest,
    size: u64,
    limit: u64,
    what: &str,
) -> Result<Vec<u8>, OciError> {
    if size > limit {
        return Err(OciError::TooLarge {
            what: what.to_string(),
            size,
            limit,
        });
    }
    let mut verifying = VerifyingReader::new(reader, expected.clone(), Some(size));
    let mut buf = Vec::with_capacity(usize::try_from(size).unwrap_or(0));
    match verifying.read_to_end(&mut buf) {
        Ok(_) => Ok(buf),
        Err(e) => Err(unwrap_io(e, what)),
    }
}

/// Turn an `io::Error` from a verifying stream back into an [`OciError`]:
/// the carried error if there is one, else an I/O error naming `what`.
pub(crate) fn unwrap_io(e: io::Error, what: &str) -> OciError {
    if OciError::from_io(&e).is_some() {
        match e.into_inner().map(|b| b.downcast::<OciError>()) {
            Some(Ok(inner)) => *inner,
            Some(Err(other)) => OciError::io("read", what, io::Error::other(other)),
            None => OciError::Unsupported(format!("{what}: read failed")),
        }
    } else {
        OciError::io("read", what, e)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const EMPTY: &str = "sha256:e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855";

    #[test]
    fn parses_valid_digest() {
        let d: Digest = EMPTY.parse().expect("valid");
        assert_eq!(d.algorithm(), "sha256");
        assert_eq!(d.hex().len(), 64);
        assert_eq!(d.to_string(), EMPTY);
        assert_eq!(Digest::of_bytes(b""), d);
        assert_eq!(Digest::from_hex(d.hex()).expect("hex"), d);
    }

    #[test]
    fn rejects_bad_digests() {
        for bad in [
            "sha256:../../x",
            "sha256:../../../../../../../../../../../../../../../../../etc/passwd",
            "sha256:",
            "sha256",
            "",
            "md5:d41d8cd98f00b204e9800998ecf8427e",
            "sha512:e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855",
            "sha256:E3B0C44298FC1C149AFBF4C8996FB92427AE41E4649B934CA495991B7852B855",
            "sha256:e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b85",
            "sha256:e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b8555",
            "sha256:e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b85/",
            "sha256:e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b85\u{e9}",
        ] {
            assert!(bad.parse::<Digest>().is_err(), "accepted {bad:?}");
        }
        assert!(serde_json::from_str::<Digest>("\"sha256:../../x\"").is_err());
    }

    #[test]
    fn serde_round_trip() {
        let d = Digest::of_bytes(b"hello");
        let json = serde_json::to_string(&d).expect("ser");
        assert_eq!(json, format!("\"{d}\""));
        let back: Digest = serde_json::from_str(&json).expect("de");
        assert_eq!(back, d);
    }

    #[test]
    fn writer_and_reader_hash() {
        let mut w = DigestWriter::new(Vec::new());
        w.write_all(b"hello world").expect("write");
        let (buf, d, n) = w.finish();
        assert_eq!(n, 11);
        assert_eq!(d, Digest::of_bytes(b"hello world"));
        let mut r = DigestReader::new(&buf[..]);
        io::copy(&mut r, &mut io::sink()).expect("copy");
        let (_, d2, n2) = r.finish();
        assert_eq!((d2, n2), (d, 11));
    }

    /// A size over the limit is refused before the reader is touched or
    /// anything is allocated for it.
    #[test]
    fn read_verified_checks_the_limit_first() {
        struct Unreadable;
        impl Read for Unreadable {
            fn read(&mut self, _: &mut [u8]) -> io::Result<usize> {
                Err(io::Error::other("must not be read"))
            }
        }
        let d = Digest::of_bytes(b"");
        for size in [1025, u64::MAX] {
            let err = read_verified(Unreadable, &d, size, 1024, "blob").expect_err("size");
            assert!(matches!(err, OciError::TooLarge { .. }), "{err}");
        }
        // A lying (small) size: the stream is cut there.
        let err = read_verified(&[0u8; 4096][..], &d, 10, 1024, "blob").expect_err("lie");
        assert!(matches!(err, OciError::SizeMismatch { .. }), "{err}");
    }

    #[test]
    fn verifying_reader_checks() {
        let data = b"some blob".to_vec();
        let good = Digest::of_bytes(&data);
        let mut out = Vec::new();
        VerifyingReader::new(&data[..], good.clone(), Some(9))
            .read_to_end(&mut out)
            .expect("ok");
        assert_eq!(out, data);

        let err = VerifyingReader::new(&data[..], Digest::of_bytes(b"x"), Some(9))
            .read_to_end(&mut Vec::new())
            .expect_err("digest");
        assert_eq!(err.kind(), io::ErrorKind::InvalidData);
        assert!(matches!(
            OciError::from_io(&err),
            Some(OciError::DigestMismatch { .. })
        ));

        for size in [8, 10] {
            let err = VerifyingReader::new(&data[..], good.clone(), Some(size))
                .read_to_end(&mut Vec::new())
                .expect_err("size");
            assert!(matches!(
                OciError::from_io(&err),
                Some(OciError::SizeMismatch { .. })
            ));
        }
    }
}
