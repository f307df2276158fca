//! Registry-backed [`ImageSource`] and [`ImageSink`].

use std::collections::HashSet;
use std::fs::File;
use std::io::{self, Read};
use std::path::Path;

use crate::digest::{read_verified, unwrap_io, Digest, DigestReader, VerifyingReader};
use crate::error::OciError;
use crate::reference::{RegistryRef, RegistryReference};
use crate::sink::ImageSink;
use crate::source::{
    layer_stream, parse_document, select_platform, Document, ImageSource, SourceImage,
    SourceOptions, MAX_CONFIG_SIZE, MAX_INDEX_DEPTH,
};
use crate::types::{media_types as mt, Descriptor};

use super::{effective_repository, BlobBody, RegistryClient};

/// An image pulled from a registry.
#[derive(Debug)]
pub struct RegistrySource {
    client: RegistryClient,
    repository: String,
    image: SourceImage,
}

impl RegistrySource {
    /// Resolve `r` (following an index to the platform in `opts`) and fetch
    /// its manifest and config.
    pub fn open(r: &RegistryRef, opts: &SourceOptions) -> Result<RegistrySource, OciError> {
        let client = RegistryClient::new(&r.host, opts)?;
        let repository = effective_repository(&r.host, &r.repository);
        let repo = repository.as_str();
        let mut reference = r.reference.clone();
        let mut chosen_from = (Vec::new(), None);
        for _ in 0..MAX_INDEX_DEPTH {
            let fetched = client.get_manifest(repo, &reference)?;
            match parse_document(
                &fetched.bytes,
                fetched.media_type.as_deref(),
                &fetched.digest,
            )? {
                Document::Index(idx) => {
                    let desc = select_platform(&idx, &fetched.digest, &opts.platform)?;
                    let index_digest = fetched.digest.clone();
                    reference = RegistryReference::Digest(desc.digest);
                    chosen_from = (idx.manifests, Some(index_digest));
                }
                Document::Manifest(manifest) => {
                    let config_desc = manifest.config.clone();
                    let resp = small_blob_client(&client, config_desc.size)
                        .blob_response(repo, &config_desc.digest)?;
                    let config_bytes = read_verified(
                        resp,
                        &config_desc.digest,
                        config_desc.size,
                        MAX_CONFIG_SIZE,
                        &format!("config {}", config_desc.digest),
                    )?;
                    let mut image = SourceImage::from_parts(
                        *manifest,
                        fetched.bytes,
                        fetched.digest,
                        config_bytes,
                    )?;
                    (image.index_entries, image.index_digest) = chosen_from;
                    return Ok(RegistrySource {
                        client,
                        repository: repo.to_string(),
                        image,
                    });
                }
            }
        }
        Err(OciError::Registry {
            host: r.host.clone(),
            message: format!("{r}: image indexes nested deeper than {MAX_INDEX_DEPTH} levels"),
        })
    }

    /// The client, e.g. for range reads of this image's blobs.
    pub fn client(&self) -> &RegistryClient {
        &self.client
    }
}

/// Blobs this small (an image's config, a lamina image's chunk index) go
/// around a `bulk_only` host: a P2P daemon schedules each blob as a task
/// of its own (about 250 ms before the first byte, docs/dragonfly.md),
/// which costs more than the registry sending them to every node.
const SMALL_BLOB: u64 = 64 << 10;

/// The client to fetch a blob of `size` bytes with (see [`SMALL_BLOB`]).
fn small_blob_client(client: &RegistryClient, size: u64) -> RegistryClient {
    match size <= SMALL_BLOB && client.has_bulk_only_hosts() {
        true => client.for_misses(),
        false => client.clone(),
    }
}

impl ImageSource for RegistrySource {
    fn image(&self) -> &SourceImage {
        &self.image
    }

    fn open_layer(&self, index: usize) -> Result<Box<dyn Read + Send + '_>, OciError> {
        let layer = self.image.layer(index)?;
        let resp = self
            .client
            .blob_response(&self.repository, &layer.descriptor.digest)?;
        layer_stream(Box::new(resp), layer)
    }

    fn open_blob(&self, desc: &Descriptor) -> Result<Box<dyn Read + Send + '_>, OciError> {
        let resp = small_blob_client(&self.client, desc.size)
            .blob_response(&self.repository, &desc.digest)?;
        Ok(Box::new(VerifyingReader::new(
            resp,
            desc.digest.clone(),
            Some(desc.size),
        )))
    }

    fn read_blob_range(
        &self,
        desc: &Descriptor,
        offset: u64,
        len: u64,
    ) -> Result<Option<Vec<u8>>, OciError> {
        self.client
            .get_blob_range(&self.repository, &desc.digest, offset, len)
            .map(Some)
    }
}

/// Pushes an image to a registry. Blobs are uploaded as they are put; the
/// tag only appears with [`commit`](ImageSink::commit).
#[derive(Debug)]
pub struct RegistrySink {
    client: RegistryClient,
    target: RegistryRef,
    pushed: HashSet<Digest>,
}

impl RegistrySink {
    /// Prepare to push to `r`.
    pub fn open(r: &RegistryRef, opts: &SourceOptions) -> Result<RegistrySink, OciError> {
        Ok(RegistrySink {
            client: RegistryClient::new(&r.host, opts)?,
            target: RegistryRef {
                repository: effective_repository(&r.host, &r.repository),
                ..r.clone()
            },
            pushed: HashSet::new(),
        })
    }

    fn check(desc: &Descriptor, digest: Digest, size: u64) -> Result<(), OciError> {
        if digest != desc.digest {
            return Err(OciError::DigestMismatch {
                expected: desc.digest.clone(),
                actual: digest,
            });
        }
        if size != desc.size {
            return Err(OciError::SizeMismatch {
                digest: desc.digest.clone(),
                expected: desc.size,
                actual: size,
            });
        }
        Ok(())
    }
}

impl ImageSink for RegistrySink {
    fn put_blob(&mut self, desc: &Descriptor, path: &Path) -> Result<(), OciError> {
        let file = File::open(path).map_err(|e| OciError::io("open", path, e))?;
        let mut r = DigestReader::new(io::BufReader::new(file));
        io::copy(&mut r, &mut io::sink()).map_err(|e| unwrap_io(e, &path.display().to_string()))?;
        let (_, digest, size) = r.finish();
        Self::check(desc, digest, size)?;
        if self.pushed.contains(&desc.digest) {
            return Ok(());
        }
        self.client
            .put_blob(&self.target.repository, desc, BlobBody::File(path))?;
        self.pushed.insert(desc.digest.clone());
        Ok(())
    }

    fn put_blob_bytes(&mut self, desc: &Descriptor, bytes: &[u8]) -> Result<(), OciError> {
        Self::check(desc, Digest::of_bytes(bytes), bytes.len() as u64)?;
        if self.pushed.contains(&desc.digest) {
            return Ok(());
        }
        self.client
            .put_blob(&self.target.repository, desc, BlobBody::Bytes(bytes))?;
        self.pushed.insert(desc.digest.clone());
        Ok(())
    }

    fn commit(
        self: Box<Self>,
        manifest_bytes: &[u8],
        media_type: &str,
    ) -> Result<Digest, OciError> {
        if !(mt::is_manifest(media_type) || mt::is_index(media_type)) {
            return Err(OciError::UnsupportedMediaType {
                what: format!("manifest for {}", self.target),
                media_type: media_type.to_string(),
            });
        }
        self.client.put_manifest(
            &self.target.repository,
            &self.target.reference,
            manifest_bytes,
            media_type,
        )
    }
}
