//! OCI image layout directories (`oci:DIR[:TAG]`): source and atomic sink.

use std::collections::BTreeSet;
use std::fs::{self, File};
use std::io::{self, Read, Write};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::digest::{read_verified, Digest, DigestWriter, VerifyingReader};
use crate::error::OciError;
use crate::source::{
    layer_stream, parse_document, select_platform, Document, ImageSource, SourceImage,
    SourceOptions, MAX_CONFIG_SIZE, MAX_INDEX_DEPTH, MAX_MANIFEST_SIZE,
};
use crate::types::{Descriptor, ImageIndex, ANNOTATION_REF_NAME};

const LAYOUT_FILE: &str = "oci-layout";
const INDEX_FILE: &str = "index.json";
const LAYOUT_VERSION: &str = "1.0.0";
const MAX_INDEX_JSON: u64 = 16 << 20;
const STAGING_PREFIX: &str = ".lamina-staging-";
/// Tag used by the sink when the reference has none.
pub const DEFAULT_TAG: &str = "latest";

#[derive(Debug, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
struct LayoutFile {
    image_layout_version: String,
}

/// Path of a blob inside a layout. The digest is validated hex, so the
/// result always stays inside `dir`.
pub fn blob_path(dir: &Path, digest: &Digest) -> PathBuf {
    dir.join("blobs")
        .join(digest.algorithm())
        .join(digest.hex())
}

fn layout_err(dir: &Path, message: impl Into<String>) -> OciError {
    OciError::Layout {
        dir: dir.to_path_buf(),
        message: message.into(),
    }
}

fn read_small(path: &Path, limit: u64) -> Result<Vec<u8>, OciError> {
    let file = File::open(path).map_err(|e| OciError::io("open", path, e))?;
    let mut buf = Vec::new();
    file.take(limit + 1)
        .read_to_end(&mut buf)
        .map_err(|e| OciError::io("read", path, e))?;
    if buf.len() as u64 > limit {
        return Err(OciError::TooLarge {
            what: path.display().to_string(),
            size: buf.len() as u64,
            limit,
        });
    }
    Ok(buf)
}

fn check_layout_file(dir: &Path) -> Result<(), OciError> {
    let path = dir.join(LAYOUT_FILE);
    let bytes = match read_small(&path, 64 << 10) {
        Ok(b) => b,
        Err(OciError::Io { source, .. }) if source.kind() == io::ErrorKind::NotFound => {
            if !dir.exists() {
                return Err(OciError::NotFound {
                    location: dir.display().to_string(),
                    wanted: "an OCI image layout".to_string(),
                    available: Vec::new(),
                });
            }
            return Err(layout_err(
                dir,
                "no oci-layout file (not an OCI image layout)",
            ));
        }
        Err(e) => return Err(e),
    };
    let layout: LayoutFile = serde_json::from_slice(&bytes)
        .map_err(|e| OciError::json(path.display().to_string(), e))?;
    if !layout.image_layout_version.starts_with("1.") {
        return Err(layout_err(
            dir,
            format!(
                "unsupported imageLayoutVersion {:?} (expected 1.x)",
                layout.image_layout_version
            ),
        ));
    }
    Ok(())
}

/// The descriptor `tag` names in the layout's `index.json` (the only
/// entry when `tag` is `None`).
fn top_descriptor(dir: &Path, tag: Option<&str>) -> Result<Descriptor, OciError> {
    check_layout_file(dir)?;
    let index = read_index(dir)?;
    let location = format!("OCI layout {}", dir.display());
    Ok(match tag {
        Some(t) => index
            .manifests
            .iter()
            .find(|d| d.ref_name() == Some(t))
            .cloned()
            .ok_or_else(|| OciError::NotFound {
                location: location.clone(),
                wanted: format!("tag {t:?}"),
                available: index.manifests.iter().map(entry_name).collect(),
            })?,
        None => match index.manifests.as_slice() {
            [only] => only.clone(),
            [] => {
                return Err(OciError::NotFound {
                    location,
                    wanted: "an image".to_string(),
                    available: Vec::new(),
                })
            }
            many => {
                return Err(OciError::Ambiguous {
                    location,
                    available: many.iter().map(entry_name).collect(),
                })
            }
        },
    })
}

/// The document `tag` names in the layout: its bytes, media type and
/// digest (an image index or a manifest).
pub(crate) fn top_document(
    dir: &Path,
    tag: Option<&str>,
) -> Result<(Vec<u8>, Option<String>, Digest), OciError> {
    let desc = top_descriptor(dir, tag)?;
    let bytes = read_blob_to_vec(dir, &desc, MAX_MANIFEST_SIZE, "manifest")?;
    Ok((bytes, Some(desc.media_type), desc.digest))
}

fn read_index(dir: &Path) -> Result<ImageIndex, OciError> {
    let path = dir.join(INDEX_FILE);
    let bytes = read_small(&path, MAX_INDEX_JSON)?;
    serde_json::from_slice(&bytes).map_err(|e| OciError::json(path.display().to_string(), e))
}

fn entry_name(d: &Descriptor) -> String {
    d.ref_name()
        .map(str::to_string)
        .unwrap_or_else(|| format!("(untagged {})", d.digest))
}

/// An image read from an OCI layout directory.
#[derive(Debug)]
pub struct OciLayoutSource {
    dir: PathBuf,
    image: SourceImage,
}

impl OciLayoutSource {
    /// Open the image tagged `tag` (or the only image when `tag` is `None`).
    pub fn open(
        dir: &Path,
        tag: Option<&str>,
        opts: &SourceOptions,
    ) -> Result<OciLayoutSource, OciError> {
        let mut desc = top_descriptor(dir, tag)?;
        let mut chosen_from = (Vec::new(), None);
        for _ in 0..MAX_INDEX_DEPTH {
            let bytes = read_blob_to_vec(dir, &desc, MAX_MANIFEST_SIZE, "manifest")?;
            match parse_document(&bytes, Some(&desc.media_type), &desc.digest)? {
                Document::Index(idx) => {
                    let index_digest = desc.digest.clone();
                    desc = select_platform(&idx, &desc.digest, &opts.platform)?;
                    chosen_from = (idx.manifests, Some(index_digest));
                }
                Document::Manifest(manifest) => {
                    let config_bytes =
                        read_blob_to_vec(dir, &manifest.config, MAX_CONFIG_SIZE, "config")?;
                    let mut image = SourceImage::from_parts(
                        *manifest,
                        bytes,
                        desc.digest.clone(),
                        config_bytes,
                    )?;
                    (image.index_entries, image.index_digest) = chosen_from;
                    return Ok(OciLayoutSource {
                        dir: dir.to_path_buf(),
                        image,
                    });
                }
            }
        }
        Err(layout_err(
            dir,
            format!("image indexes nested deeper than {MAX_INDEX_DEPTH} levels"),
        ))
    }

    fn open_raw(&self, digest: &Digest) -> Result<File, OciError> {
        open_blob_file(&self.dir, digest)
    }
}

fn open_blob_file(dir: &Path, digest: &Digest) -> Result<File, OciError> {
    let path = blob_path(dir, digest);
    File::open(&path).map_err(|e| {
        if e.kind() == io::ErrorKind::NotFound {
            OciError::BlobNotFound {
                location: format!("OCI layout {}", dir.display()),
                digest: digest.clone(),
            }
        } else {
            OciError::io("open blob", path, e)
        }
    })
}

fn read_blob_to_vec(
    dir: &Path,
    desc: &Descriptor,
    limit: u64,
    what: &str,
) -> Result<Vec<u8>, OciError> {
    let file = open_blob_file(dir, &desc.digest)?;
    read_verified(
        file,
        &desc.digest,
        desc.size,
        limit,
        &format!("{what} {}", desc.digest),
    )
}

impl ImageSource for OciLayoutSource {
    fn image(&self) -> &SourceImage {
        &self.image
    }

    fn open_layer(&self, index: usize) -> Result<Box<dyn Read + Send + '_>, OciError> {
        let layer = self.image.layer(index)?;
        let file = self.open_raw(&layer.descriptor.digest)?;
        layer_stream(Box::new(io::BufReader::new(file)), layer)
    }

    fn open_blob(&self, desc: &Descriptor) -> Result<Box<dyn Read + Send + '_>, OciError> {
        let file = self.open_raw(&desc.digest)?;
        Ok(Box::new(VerifyingReader::new(
            io::BufReader::new(file),
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
        let path = blob_path(&self.dir, &desc.digest);
        // Bounded by the descriptor before anything is allocated.
        if offset.checked_add(len).is_none_or(|end| end > desc.size) {
            let why = io::Error::other(format!(
                "range {offset}+{len} beyond the blob's {} bytes",
                desc.size
            ));
            return Err(OciError::io("read", path, why));
        }
        let file = self.open_raw(&desc.digest)?;
        let mut bytes = vec![0; len as usize];
        std::os::unix::fs::FileExt::read_exact_at(&file, &mut bytes, offset)
            .map_err(|e| OciError::io("read", path, e))?;
        Ok(Some(bytes))
    }
}

/// An atomic writer into an OCI layout directory.
///
/// Blobs go to a staging directory inside the layout and are moved into
/// `blobs/sha256/` only by [`commit`](crate::ImageSink::commit), which then
/// rewrites `index.json` atomically. Dropping the sink without committing
/// removes the staging directory (and the layout directory itself if the
/// sink created it and it is otherwise empty).
#[derive(Debug)]
pub struct OciLayoutSink {
    dir: PathBuf,
    tag: String,
    staging: Option<tempfile::TempDir>,
    staged: BTreeSet<Digest>,
    created_dir: bool,
}

impl OciLayoutSink {
    /// Prepare to write an image tagged `tag` (default `latest`) into `dir`,
    /// which must be an OCI layout, empty, or absent.
    pub fn open(dir: &Path, tag: Option<&str>) -> Result<OciLayoutSink, OciError> {
        let tag = tag.unwrap_or(DEFAULT_TAG).to_string();
        let mut created_dir = false;
        match fs::metadata(dir) {
            Ok(m) if !m.is_dir() => return Err(layout_err(dir, "exists and is not a directory")),
            Ok(_) => {
                remove_stale_staging(dir);
                if dir.join(LAYOUT_FILE).exists() {
                    check_layout_file(dir)?;
                } else {
                    let mut entries =
                        fs::read_dir(dir).map_err(|e| OciError::io("read directory", dir, e))?;
                    if entries.next().is_some() {
                        return Err(layout_err(
                            dir,
                            "directory is not empty and has no oci-layout file; refusing to write into it",
                        ));
                    }
                }
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                fs::create_dir_all(dir).map_err(|e| OciError::io("create directory", dir, e))?;
                created_dir = true;
            }
            Err(e) => return Err(OciError::io("stat", dir, e)),
        }
        let mut sink = OciLayoutSink {
            dir: dir.to_path_buf(),
            tag,
            staging: None,
            staged: BTreeSet::new(),
            created_dir,
        };
        let staging = tempfile::Builder::new()
            .prefix(&format!("{STAGING_PREFIX}{}-", std::process::id()))
            .tempdir_in(dir)
            .map_err(|e| OciError::io("create staging directory in", dir, e))?;
        sink.staging = Some(staging);
        Ok(sink)
    }

    fn staging_dir(&self) -> Result<&Path, OciError> {
        self.staging
            .as_ref()
            .map(|t| t.path())
            .ok_or_else(|| layout_err(&self.dir, "sink has no staging directory"))
    }

    /// Copy `src` into staging as blob `desc`, hashing on the way.
    fn stage(&mut self, desc: &Descriptor, mut src: impl Read) -> Result<(), OciError> {
        let final_path = blob_path(&self.dir, &desc.digest);
        let (digest, size) = if final_path.exists() && !self.staged.contains(&desc.digest) {
            // Already in the layout: only check that the input is what it claims.
            let mut w = DigestWriter::new(io::sink());
            io::copy(&mut src, &mut w)
                .map_err(|e| OciError::io("read blob source for", final_path.clone(), e))?;
            let (_, d, n) = w.finish();
            (d, n)
        } else {
            let staging = self.staging_dir()?;
            let partial = staging.join(format!("{}.partial", desc.digest.hex()));
            let staged = staging.join(desc.digest.hex());
            let file = File::create(&partial).map_err(|e| OciError::io("create", &partial, e))?;
            let mut w = DigestWriter::new(io::BufWriter::new(file));
            io::copy(&mut src, &mut w).map_err(|e| OciError::io("write", &partial, e))?;
            let (buf, d, n) = w.finish();
            let file = buf
                .into_inner()
                .map_err(|e| OciError::io("write", &partial, e.into_error()))?;
            if d != desc.digest || n != desc.size {
                drop(file);
                let _ = fs::remove_file(&partial);
            } else {
                file.sync_all()
                    .map_err(|e| OciError::io("sync", &partial, e))?;
                fs::rename(&partial, &staged)
                    .map_err(|e| OciError::io("rename into staging", &partial, e))?;
                self.staged.insert(desc.digest.clone());
            }
            (d, n)
        };
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

    fn has_blob(&self, digest: &Digest) -> bool {
        self.staged.contains(digest) || blob_path(&self.dir, digest).is_file()
    }

    fn check_references(
        &self,
        manifest_bytes: &[u8],
        media_type: &str,
        digest: &Digest,
    ) -> Result<(), OciError> {
        let referenced: Vec<Digest> =
            match parse_document(manifest_bytes, Some(media_type), digest)? {
                Document::Manifest(m) => std::iter::once(m.config.digest)
                    .chain(m.layers.into_iter().map(|l| l.digest))
                    .collect(),
                Document::Index(i) => i.manifests.into_iter().map(|d| d.digest).collect(),
            };
        for d in referenced {
            if !self.has_blob(&d) {
                return Err(OciError::Sink {
                    location: format!("OCI layout {}", self.dir.display()),
                    message: format!(
                        "manifest {digest} references blob {d}, which was neither put to the sink nor present"
                    ),
                });
            }
        }
        Ok(())
    }

    fn write_atomic(&self, name: &str, bytes: &[u8]) -> Result<(), OciError> {
        let target = self.dir.join(name);
        let mut tmp = tempfile::Builder::new()
            .prefix(&format!(".{name}.tmp-"))
            .tempfile_in(&self.dir)
            .map_err(|e| OciError::io("create temporary file in", &self.dir, e))?;
        tmp.write_all(bytes)
            .and_then(|()| tmp.as_file().sync_all())
            .map_err(|e| OciError::io("write", tmp.path().to_path_buf(), e))?;
        tmp.persist(&target)
            .map_err(|e| OciError::io("replace", &target, e.error))?;
        Ok(())
    }

    fn do_commit(&mut self, manifest_bytes: &[u8], media_type: &str) -> Result<Digest, OciError> {
        let desc = Descriptor::of_bytes(media_type, manifest_bytes);
        self.check_references(manifest_bytes, media_type, &desc.digest)?;
        // Read index.json before moving anything, so a broken one stops us early.
        let mut index = if self.dir.join(INDEX_FILE).exists() {
            read_index(&self.dir)?
        } else {
            ImageIndex::default()
        };
        self.stage(&desc, manifest_bytes)?;

        let blobs = self.dir.join("blobs").join(desc.digest.algorithm());
        fs::create_dir_all(&blobs).map_err(|e| OciError::io("create directory", &blobs, e))?;
        let staging = self.staging_dir()?.to_path_buf();
        for d in &self.staged {
            let target = blob_path(&self.dir, d);
            if target.exists() {
                continue;
            }
            let from = staging.join(d.hex());
            fs::rename(&from, &target).map_err(|e| OciError::io("move blob into", &target, e))?;
        }
        if let Ok(f) = File::open(&blobs) {
            let _ = f.sync_all();
        }

        if !self.dir.join(LAYOUT_FILE).exists() {
            let layout = LayoutFile {
                image_layout_version: LAYOUT_VERSION.to_string(),
            };
            let bytes = serde_json::to_vec(&layout)
                .map_err(|e| OciError::json(LAYOUT_FILE.to_string(), e))?;
            self.write_atomic(LAYOUT_FILE, &bytes)?;
        }

        index
            .manifests
            .retain(|d| d.ref_name() != Some(self.tag.as_str()));
        let mut entry = desc.clone();
        entry
            .annotations
            .insert(ANNOTATION_REF_NAME.to_string(), self.tag.clone());
        index.manifests.push(entry);
        if index.media_type.is_none() {
            index.media_type = Some(crate::types::media_types::OCI_INDEX.to_string());
        }
        let bytes = serde_json::to_vec_pretty(&index)
            .map_err(|e| OciError::json(INDEX_FILE.to_string(), e))?;
        self.write_atomic(INDEX_FILE, &bytes)?;
        if let Ok(f) = File::open(&self.dir) {
            let _ = f.sync_all();
        }
        Ok(desc.digest)
    }
}

/// Remove staging directories left by sinks of processes that no longer
/// exist (killed before their `Drop` ran). Only where `/proc` tells.
fn remove_stale_staging(dir: &Path) {
    if !Path::new("/proc/self").exists() {
        return;
    }
    let Ok(entries) = fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(rest) = name.to_str().and_then(|n| n.strip_prefix(STAGING_PREFIX)) else {
            continue;
        };
        let Some((pid, _)) = rest.split_once('-') else {
            continue;
        };
        if pid.parse::<u32>().is_err() || Path::new("/proc").join(pid).exists() {
            continue;
        }
        let _ = fs::remove_dir_all(entry.path());
    }
}

impl crate::sink::ImageSink for OciLayoutSink {
    fn put_blob(&mut self, desc: &Descriptor, path: &Path) -> Result<(), OciError> {
        let file = File::open(path).map_err(|e| OciError::io("open", path, e))?;
        self.stage(desc, io::BufReader::new(file))
    }

    fn put_blob_bytes(&mut self, desc: &Descriptor, bytes: &[u8]) -> Result<(), OciError> {
        self.stage(desc, bytes)
    }

    fn scratch_dir(&self) -> Option<&Path> {
        self.staging.as_ref().map(|t| t.path())
    }

    fn adopt_blob(&mut self, desc: &Descriptor, path: &Path) -> Result<(), OciError> {
        let staging = self.staging_dir()?;
        if !path.starts_with(staging) {
            return self.put_blob(desc, path);
        }
        let size = fs::metadata(path)
            .map_err(|e| OciError::io("stat", path, e))?
            .len();
        if size != desc.size {
            return Err(OciError::SizeMismatch {
                digest: desc.digest.clone(),
                expected: desc.size,
                actual: size,
            });
        }
        if self.has_blob(&desc.digest) {
            return Ok(());
        }
        let staged = staging.join(desc.digest.hex());
        fs::rename(path, &staged).map_err(|e| OciError::io("rename into staging", path, e))?;
        self.staged.insert(desc.digest.clone());
        Ok(())
    }

    fn commit(
        mut self: Box<Self>,
        manifest_bytes: &[u8],
        media_type: &str,
    ) -> Result<Digest, OciError> {
        self.do_commit(manifest_bytes, media_type)
    }
}

impl Drop for OciLayoutSink {
    fn drop(&mut self) {
        if let Some(staging) = self.staging.take() {
            let _ = staging.close();
        }
        if self.created_dir {
            let empty = fs::read_dir(&self.dir).is_ok_and(|mut e| e.next().is_none());
            if empty {
                let _ = fs::remove_dir(&self.dir);
            }
        }
    }
}
