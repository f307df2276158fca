//! `docker save` archives (`docker-archive:FILE[:REF]`), read in place.
//!
//! The outer tar is indexed once (member name -> offset and size); members
//! are then read by seeking, nothing is extracted.

use std::collections::HashMap;
use std::fs::File;
use std::io::{self, BufReader, Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

use serde::Deserialize;

use crate::compression::Compression;
use crate::digest::{Digest, DigestReader, VerifyingReader};
use crate::error::OciError;
use crate::reference::split_name_tag;
use crate::source::{layer_stream, ImageSource, SourceImage, MAX_CONFIG_SIZE};
use crate::types::{media_types as mt, Descriptor, Manifest};

const MAX_ARCHIVE_MANIFEST: u64 = 16 << 20;
const MAX_LINK_DEPTH: usize = 16;
/// Most members (files and links) indexed from the outer tar: `docker save`
/// writes a handful per layer, so this is far beyond any real archive and
/// bounds the index a hostile one can make.
const MAX_ARCHIVE_MEMBERS: usize = 100_000;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Member {
    offset: u64,
    size: u64,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "PascalCase")]
struct ArchiveEntry {
    config: String,
    #[serde(default)]
    repo_tags: Option<Vec<String>>,
    #[serde(default)]
    layers: Vec<String>,
}

/// An image read from a `docker save` tarball.
#[derive(Debug)]
pub struct DockerArchiveSource {
    path: PathBuf,
    image: SourceImage,
    /// Member of each layer, in layer order.
    layer_members: Vec<Member>,
    /// Every blob of the image by digest.
    blobs: HashMap<Digest, Member>,
}

/// The member table of an archive.
#[derive(Debug, Default)]
struct ArchiveIndex {
    files: HashMap<String, Member>,
    links: HashMap<String, String>,
}

fn archive_err(path: &Path, message: impl Into<String>) -> OciError {
    OciError::Archive {
        path: path.to_path_buf(),
        message: message.into(),
    }
}

/// Normalize an archive path: no leading `/` or `./`, `.` and `..` resolved.
fn normalize(name: &str) -> String {
    let mut parts: Vec<&str> = Vec::new();
    for c in name.split('/') {
        match c {
            "" | "." => {}
            ".." => {
                parts.pop();
            }
            other => parts.push(other),
        }
    }
    parts.join("/")
}

impl ArchiveIndex {
    fn build(path: &Path) -> Result<ArchiveIndex, OciError> {
        Self::build_limited(path, MAX_ARCHIVE_MEMBERS)
    }

    fn build_limited(path: &Path, max_members: usize) -> Result<ArchiveIndex, OciError> {
        let file = File::open(path).map_err(|e| OciError::io("open", path, e))?;
        let mut archive = tar::Archive::new(file);
        let bad_tar = |e: io::Error| archive_err(path, format!("reading tar: {e}"));
        let mut index = ArchiveIndex::default();
        for entry in archive.entries_with_seek().map_err(bad_tar)? {
            let entry = entry.map_err(bad_tar)?;
            let raw_name = entry.path().map_err(bad_tar)?;
            let Some(name) = raw_name.to_str().map(normalize) else {
                continue;
            };
            let kind = entry.header().entry_type();
            if index.files.len() + index.links.len() >= max_members {
                return Err(archive_err(
                    path,
                    format!("more than {max_members} members: not a `docker save` archive"),
                ));
            }
            if kind.is_file() {
                index.files.insert(
                    name,
                    Member {
                        offset: entry.raw_file_position(),
                        size: entry.size(),
                    },
                );
            } else if kind.is_symlink() || kind.is_hard_link() {
                let Some(target) = entry.link_name().map_err(bad_tar)? else {
                    continue;
                };
                let Some(target) = target.to_str() else {
                    continue;
                };
                let resolved = if kind.is_symlink() && !target.starts_with('/') {
                    let parent = name.rsplit_once('/').map_or("", |(p, _)| p);
                    normalize(&format!("{parent}/{target}"))
                } else {
                    normalize(target)
                };
                index.links.insert(name, resolved);
            }
        }
        Ok(index)
    }

    fn lookup(&self, name: &str) -> Option<(String, Member)> {
        let mut name = normalize(name);
        for _ in 0..MAX_LINK_DEPTH {
            if let Some(m) = self.files.get(&name) {
                return Some((name, *m));
            }
            name = self.links.get(&name)?.clone();
        }
        None
    }
}

/// The digest a blob path `blobs/sha256/<hex>` encodes.
fn digest_from_blob_path(name: &str) -> Option<Digest> {
    normalize(name)
        .strip_prefix("blobs/sha256/")
        .and_then(|hex| Digest::from_hex(hex).ok())
}

/// The digest a config member's name encodes: `blobs/sha256/<hex>` or
/// `<hex>.json`.
fn digest_from_name(name: &str) -> Option<Digest> {
    if let Some(d) = digest_from_blob_path(name) {
        return Some(d);
    }
    let base = name.rsplit('/').next().unwrap_or(name);
    base.strip_suffix(".json")
        .and_then(|hex| Digest::from_hex(hex).ok())
}

fn canonical_ref(r: &str) -> String {
    let (name, tag) = split_name_tag(r);
    let name = name
        .strip_prefix("docker.io/library/")
        .or_else(|| name.strip_prefix("index.docker.io/library/"))
        .or_else(|| name.strip_prefix("docker.io/"))
        .or_else(|| name.strip_prefix("library/"))
        .unwrap_or(name);
    format!("{name}:{}", tag.unwrap_or("latest"))
}

impl DockerArchiveSource {
    /// Open `path`, selecting the image by `reference` (`repo:tag` or `@N`),
    /// or the only image when `None`.
    pub fn open(path: &Path, reference: Option<&str>) -> Result<DockerArchiveSource, OciError> {
        let index = ArchiveIndex::build(path)?;
        let (_, manifest_member) = index
            .lookup("manifest.json")
            .ok_or_else(|| archive_err(path, "no manifest.json (not a docker save archive)"))?;
        let bytes =
            read_member_limited(path, manifest_member, MAX_ARCHIVE_MANIFEST, "manifest.json")?;
        let entries: Vec<ArchiveEntry> = serde_json::from_slice(&bytes)
            .map_err(|e| OciError::json(format!("{}: manifest.json", path.display()), e))?;
        let entry = select_entry(path, &entries, reference)?;

        let (config_member, config_bytes, config_digest) = read_config(path, &index, entry)?;
        let diff_ids = layer_diff_ids(path, entry, &config_bytes, &config_digest)?;

        let mut blobs = HashMap::new();
        blobs.insert(config_digest.clone(), config_member);
        let (layer_members, layers) = locate_layers(path, &index, entry, &diff_ids, &mut blobs)?;
        let manifest = Manifest {
            schema_version: 2,
            media_type: Some(mt::OCI_MANIFEST.to_string()),
            config: Descriptor::new(mt::OCI_CONFIG, config_digest, config_bytes.len() as u64),
            layers,
            annotations: Default::default(),
            artifact_type: None,
            subject: None,
        };
        let manifest_bytes =
            serde_json::to_vec(&manifest).map_err(|e| OciError::json("synthesized manifest", e))?;
        let manifest_digest = Digest::of_bytes(&manifest_bytes);
        let image =
            SourceImage::from_parts(manifest, manifest_bytes, manifest_digest, config_bytes)?;
        Ok(DockerArchiveSource {
            path: path.to_path_buf(),
            image,
            layer_members,
            blobs,
        })
    }

    fn open_member(&self, member: Member) -> Result<BufReader<io::Take<File>>, OciError> {
        open_member(&self.path, member)
    }
}

/// Reads the config `entry` names, checked against the digest its member's
/// name encodes (if any); returns its member, bytes and digest.
fn read_config(
    path: &Path,
    index: &ArchiveIndex,
    entry: &ArchiveEntry,
) -> Result<(Member, Vec<u8>, Digest), OciError> {
    let (config_name, config_member) = index.lookup(&entry.config).ok_or_else(|| {
        archive_err(
            path,
            format!(
                "config {:?} listed in manifest.json is missing",
                entry.config
            ),
        )
    })?;
    let config_bytes = read_member_limited(path, config_member, MAX_CONFIG_SIZE, &entry.config)?;
    let config_digest = Digest::of_bytes(&config_bytes);
    let named = digest_from_name(&entry.config).or_else(|| digest_from_name(&config_name));
    if let Some(expected) = named {
        if expected != config_digest {
            return Err(OciError::DigestMismatch {
                expected,
                actual: config_digest,
            });
        }
    }
    Ok((config_member, config_bytes, config_digest))
}

/// The config's `rootfs.diff_ids`, one per layer `entry` lists.
fn layer_diff_ids(
    path: &Path,
    entry: &ArchiveEntry,
    config_bytes: &[u8],
    config_digest: &Digest,
) -> Result<Vec<Digest>, OciError> {
    let config: serde_json::Value = serde_json::from_slice(config_bytes)
        .map_err(|e| OciError::json(format!("image config {config_digest}"), e))?;
    let diff_ids: Vec<Digest> = config
        .get("rootfs")
        .and_then(|r| r.get("diff_ids"))
        .and_then(|d| d.as_array())
        .map(|a| {
            a.iter()
                .filter_map(|v| v.as_str().and_then(|s| s.parse().ok()))
                .collect()
        })
        .unwrap_or_default();
    if diff_ids.len() != entry.layers.len() {
        return Err(OciError::Config {
            config: config_digest.clone(),
            message: format!(
                "rootfs.diff_ids has {} valid entries but manifest.json of {} lists {} layers",
                diff_ids.len(),
                path.display(),
                entry.layers.len()
            ),
        });
    }
    Ok(diff_ids)
}

/// Finds the member of each layer `entry` lists and its digest (named by
/// its path, else its diff_id when uncompressed, else hashed), adding each
/// to `blobs`; returns the members and descriptors in layer order.
fn locate_layers(
    path: &Path,
    index: &ArchiveIndex,
    entry: &ArchiveEntry,
    diff_ids: &[Digest],
    blobs: &mut HashMap<Digest, Member>,
) -> Result<(Vec<Member>, Vec<Descriptor>), OciError> {
    let mut layer_members = Vec::with_capacity(entry.layers.len());
    let mut layers = Vec::with_capacity(entry.layers.len());
    for (layer_name, diff_id) in entry.layers.iter().zip(diff_ids) {
        let (resolved, member) = index.lookup(layer_name).ok_or_else(|| {
            archive_err(
                path,
                format!("layer {layer_name:?} listed in manifest.json is missing"),
            )
        })?;
        let mut magic = [0u8; 4];
        let n = read_prefix(path, member, &mut magic)?;
        let compression = Compression::sniff(magic.get(..n).unwrap_or_default());
        let named = digest_from_blob_path(layer_name).or_else(|| digest_from_blob_path(&resolved));
        let digest = match named {
            Some(d) => d,
            None if compression == Compression::None => diff_id.clone(),
            None => hash_member(path, member, layer_name)?,
        };
        blobs.insert(digest.clone(), member);
        layer_members.push(member);
        layers.push(Descriptor::new(
            compression.oci_layer_media_type(),
            digest,
            member.size,
        ));
    }
    Ok((layer_members, layers))
}

fn select_entry<'a>(
    path: &Path,
    entries: &'a [ArchiveEntry],
    reference: Option<&str>,
) -> Result<&'a ArchiveEntry, OciError> {
    let location = format!("docker archive {}", path.display());
    let available = || -> Vec<String> {
        entries
            .iter()
            .enumerate()
            .map(|(i, e)| match e.repo_tags.as_deref() {
                Some(tags) if !tags.is_empty() => format!("@{i} ({})", tags.join(", ")),
                _ => format!("@{i} (untagged)"),
            })
            .collect()
    };
    match reference {
        None => match entries {
            [only] => Ok(only),
            [] => Err(archive_err(path, "manifest.json lists no images")),
            _ => Err(OciError::Ambiguous {
                location,
                available: available(),
            }),
        },
        Some(r) => {
            let found = if let Some(n) = r.strip_prefix('@') {
                n.parse::<usize>().ok().and_then(|i| entries.get(i))
            } else {
                let want = canonical_ref(r);
                entries.iter().find(|e| {
                    e.repo_tags
                        .iter()
                        .flatten()
                        .any(|t| t == r || canonical_ref(t) == want)
                })
            };
            found.ok_or_else(|| OciError::NotFound {
                location,
                wanted: r.to_string(),
                available: available(),
            })
        }
    }
}

fn open_member(path: &Path, member: Member) -> Result<BufReader<io::Take<File>>, OciError> {
    let mut file = File::open(path).map_err(|e| OciError::io("open", path, e))?;
    file.seek(SeekFrom::Start(member.offset))
        .map_err(|e| OciError::io("seek in", path, e))?;
    Ok(BufReader::new(file.take(member.size)))
}

fn read_member_limited(
    path: &Path,
    member: Member,
    limit: u64,
    what: &str,
) -> Result<Vec<u8>, OciError> {
    if member.size > limit {
        return Err(OciError::TooLarge {
            what: format!("{}: {what}", path.display()),
            size: member.size,
            limit,
        });
    }
    let mut buf = Vec::new();
    open_member(path, member)?
        .read_to_end(&mut buf)
        .map_err(|e| OciError::io("read", path, e))?;
    if buf.len() as u64 != member.size {
        return Err(archive_err(path, format!("{what}: truncated member")));
    }
    Ok(buf)
}

fn read_prefix(path: &Path, member: Member, buf: &mut [u8]) -> Result<usize, OciError> {
    let mut r = open_member(path, member)?;
    let mut filled = 0;
    while filled < buf.len() {
        let Some(rest) = buf.get_mut(filled..) else {
            break;
        };
        match r.read(rest) {
            Ok(0) => break,
            Ok(n) => filled += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(OciError::io("read", path, e)),
        }
    }
    Ok(filled)
}

fn hash_member(path: &Path, member: Member, what: &str) -> Result<Digest, OciError> {
    let mut r = DigestReader::new(open_member(path, member)?);
    io::copy(&mut r, &mut io::sink())
        .map_err(|e| archive_err(path, format!("hashing {what}: {e}")))?;
    let (_, digest, _) = r.finish();
    Ok(digest)
}

impl ImageSource for DockerArchiveSource {
    fn image(&self) -> &SourceImage {
        &self.image
    }

    fn open_layer(&self, index: usize) -> Result<Box<dyn Read + Send + '_>, OciError> {
        let layer = self.image.layer(index)?;
        let member = *self.layer_members.get(index).ok_or(OciError::LayerIndex {
            index,
            count: self.layer_members.len(),
        })?;
        layer_stream(Box::new(self.open_member(member)?), layer)
    }

    fn open_blob(&self, desc: &Descriptor) -> Result<Box<dyn Read + Send + '_>, OciError> {
        let member = *self
            .blobs
            .get(&desc.digest)
            .ok_or_else(|| OciError::BlobNotFound {
                location: format!("docker archive {}", self.path.display()),
                digest: desc.digest.clone(),
            })?;
        Ok(Box::new(VerifyingReader::new(
            self.open_member(member)?,
            desc.digest.clone(),
            Some(desc.size),
        )))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An outer tar of `n` empty files.
    fn tar_of(dir: &Path, n: usize) -> std::path::PathBuf {
        let path = dir.join("a.tar");
        let mut b = tar::Builder::new(File::create(&path).unwrap());
        for i in 0..n {
            let mut h = tar::Header::new_gnu();
            h.set_size(0);
            h.set_mode(0o644);
            h.set_cksum();
            b.append_data(&mut h, format!("f{i}"), io::empty()).unwrap();
        }
        b.finish().unwrap();
        path
    }

    #[test]
    fn the_member_index_is_bounded() {
        let dir = tempfile::tempdir().unwrap();
        let path = tar_of(dir.path(), 11);
        assert_eq!(
            ArchiveIndex::build_limited(&path, 11).unwrap().files.len(),
            11
        );
        let err = ArchiveIndex::build_limited(&path, 10).unwrap_err();
        assert!(err.to_string().contains("more than 10 members"), "{err}");
    }
}
