//! The write side: [`ImageSink`] and [`open_sink`].

use std::path::Path;

use crate::digest::Digest;
use crate::error::OciError;
use crate::reference::ImageRef;
use crate::source::SourceOptions;
use crate::types::Descriptor;

/// A destination for an image: blobs first, then the manifest.
pub trait ImageSink: std::fmt::Debug {
    /// Store a blob from a local file; the sink re-hashes it while copying
    /// and refuses a digest or size mismatch.
    fn put_blob(&mut self, desc: &Descriptor, path: &Path) -> Result<(), OciError>;

    /// A directory on the sink's own filesystem for blob files that the
    /// caller writes and then hands over with [`adopt_blob`](Self::adopt_blob);
    /// removed with the sink unless committed. `None` (the default) when the
    /// sink has no local storage.
    fn scratch_dir(&self) -> Option<&Path> {
        None
    }

    /// Store a blob file that the caller wrote itself and hashed while
    /// writing it, so `desc.digest` is the hash of exactly those bytes. A
    /// file in [`scratch_dir`](Self::scratch_dir) is moved into the image
    /// without being copied or read again; anything else is stored as by
    /// [`put_blob`](Self::put_blob).
    fn adopt_blob(&mut self, desc: &Descriptor, path: &Path) -> Result<(), OciError> {
        self.put_blob(desc, path)
    }

    /// Store a blob from memory, verified the same way.
    fn put_blob_bytes(&mut self, desc: &Descriptor, bytes: &[u8]) -> Result<(), OciError>;

    /// Store the manifest and tag it. Only this makes the image visible
    /// under the destination name. Returns the manifest digest.
    fn commit(self: Box<Self>, manifest_bytes: &[u8], media_type: &str)
        -> Result<Digest, OciError>;
}

/// Open a destination. `oci:` and `docker://` references are supported;
/// `docker-archive:` is not.
pub fn open_sink(r: &ImageRef, opts: &SourceOptions) -> Result<Box<dyn ImageSink>, OciError> {
    match r {
        ImageRef::Oci { dir, tag } => Ok(Box::new(crate::layout::OciLayoutSink::open(
            dir,
            tag.as_deref(),
        )?)),
        ImageRef::Registry(rr) => Ok(Box::new(crate::registry::RegistrySink::open(rr, opts)?)),
        ImageRef::DockerArchive { path, .. } => Err(OciError::Unsupported(format!(
            "{r}: writing docker-archive files is not supported; write to oci:{} or a docker:// \
             registry instead",
            path.display()
        ))),
    }
}
