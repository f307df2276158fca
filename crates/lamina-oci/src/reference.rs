//! Image references in skopeo style: `oci:DIR[:TAG]`,
//! `docker-archive:FILE[:REF]` and `docker://HOST/REPO[:TAG|@DIGEST]`.

use std::fmt;
use std::path::PathBuf;
use std::str::FromStr;

use crate::digest::Digest;
use crate::error::OciError;

/// Where an image lives.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ImageRef {
    /// An OCI image layout directory, `oci:DIR[:TAG]`.
    Oci {
        /// The layout directory.
        dir: PathBuf,
        /// The `org.opencontainers.image.ref.name` to select.
        tag: Option<String>,
    },
    /// A `docker save` tarball, `docker-archive:FILE[:REF]`.
    DockerArchive {
        /// The archive.
        path: PathBuf,
        /// `repo:tag` from `RepoTags`, or `@N` (index into `manifest.json`).
        reference: Option<String>,
    },
    /// An image in a registry, `docker://HOST[:PORT]/REPO[:TAG|@DIGEST]`.
    Registry(RegistryRef),
}

/// An image in a registry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RegistryRef {
    /// `host[:port]`.
    pub host: String,
    /// Repository path, e.g. `library/busybox`.
    pub repository: String,
    /// Tag or digest.
    pub reference: RegistryReference,
}

/// A tag or a digest within a repository.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RegistryReference {
    /// A tag.
    Tag(String),
    /// A manifest digest.
    Digest(Digest),
}

impl fmt::Display for RegistryReference {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RegistryReference::Tag(t) => f.write_str(t),
            RegistryReference::Digest(d) => write!(f, "{d}"),
        }
    }
}

/// Whether `s` is a valid tag: `[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}`.
pub fn is_valid_tag(s: &str) -> bool {
    let b = s.as_bytes();
    match b.first() {
        Some(c) if c.is_ascii_alphanumeric() || *c == b'_' => {}
        _ => return false,
    }
    b.len() <= 128
        && b.iter()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, b'_' | b'.' | b'-'))
}

/// Whether `s` is a valid repository path: lowercase `/`-separated
/// components of `[a-z0-9]` joined by `.`, `_`, `__` or runs of `-`.
pub fn is_valid_repository(s: &str) -> bool {
    !s.is_empty() && s.len() <= 255 && s.split('/').all(valid_component)
}

fn valid_component(c: &str) -> bool {
    let b = c.as_bytes();
    let alnum = |x: &u8| x.is_ascii_lowercase() || x.is_ascii_digit();
    let (Some(first), Some(last)) = (b.first(), b.last()) else {
        return false;
    };
    if !alnum(first) || !alnum(last) {
        return false;
    }
    // Separators: ".", "_", "__", or one or more "-".
    let mut i = 0;
    while i < b.len() {
        let Some(&ch) = b.get(i) else { break };
        if alnum(&ch) {
            i += 1;
            continue;
        }
        let start = i;
        while b.get(i).is_some_and(|x| !alnum(x)) {
            i += 1;
        }
        let sep = b.get(start..i).unwrap_or_default();
        let ok = sep == b"." || sep == b"_" || sep == b"__" || sep.iter().all(|x| *x == b'-');
        if !ok {
            return false;
        }
    }
    true
}

fn valid_host(host: &str) -> bool {
    if host.is_empty() {
        return false;
    }
    let (name, port) = if let Some(rest) = host.strip_prefix('[') {
        // [v6]:port
        let Some((addr, after)) = rest.split_once(']') else {
            return false;
        };
        if addr.is_empty() || !addr.bytes().all(|c| c.is_ascii_hexdigit() || c == b':') {
            return false;
        }
        match after {
            "" => return true,
            p => match p.strip_prefix(':') {
                Some(port) => ("v6", Some(port)),
                None => return false,
            },
        }
    } else {
        match host.split_once(':') {
            Some((n, p)) => (n, Some(p)),
            None => (host, None),
        }
    };
    let name_ok = !name.is_empty()
        && name
            .bytes()
            .all(|c| c.is_ascii_alphanumeric() || c == b'.' || c == b'-')
        && !name.starts_with(['.', '-'])
        && !name.ends_with(['.', '-']);
    let port_ok = port.is_none_or(|p| !p.is_empty() && p.len() <= 5 && p.parse::<u16>().is_ok());
    name_ok && port_ok
}

impl RegistryRef {
    /// Parse `HOST[:PORT]/REPO[:TAG|@sha256:...]` (no `docker://` prefix).
    /// The host must contain `.` or `:` or be `localhost`; no default
    /// registry is assumed.
    pub fn parse(s: &str) -> Result<RegistryRef, OciError> {
        let bad = |reason: &str| OciError::InvalidReference {
            input: s.to_string(),
            reason: reason.to_string(),
        };
        let Some((host, rest)) = s.split_once('/') else {
            return Err(bad(
                "expected HOST/REPOSITORY[:TAG|@DIGEST]; lamina does not guess a default \
                 registry (write e.g. docker://docker.io/library/busybox)",
            ));
        };
        if !(host.contains('.') || host.contains(':') || host == "localhost") {
            return Err(bad(
                "the first path component must be a registry host (containing '.' or ':', or \
                 'localhost'); lamina does not guess a default registry",
            ));
        }
        if !valid_host(host) {
            return Err(bad("invalid registry host"));
        }
        let (name, reference) = if let Some((name, digest)) = rest.split_once('@') {
            let digest: Digest = digest.parse()?;
            if name.contains(':') {
                return Err(bad("give either a tag or a digest, not both"));
            }
            (name, RegistryReference::Digest(digest))
        } else if let Some((name, tag)) = rest.rsplit_once(':') {
            if !is_valid_tag(tag) {
                return Err(bad(&format!("invalid tag {tag:?}")));
            }
            (name, RegistryReference::Tag(tag.to_string()))
        } else {
            (rest, RegistryReference::Tag("latest".to_string()))
        };
        if !is_valid_repository(name) {
            return Err(bad(&format!(
                "invalid repository {name:?} (lowercase letters, digits and . _ - / only)"
            )));
        }
        Ok(RegistryRef {
            host: host.to_string(),
            repository: name.to_string(),
            reference,
        })
    }
}

impl FromStr for RegistryRef {
    type Err = OciError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        RegistryRef::parse(s)
    }
}

impl fmt::Display for RegistryRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.host, self.repository)?;
        match &self.reference {
            RegistryReference::Tag(t) => write!(f, ":{t}"),
            RegistryReference::Digest(d) => write!(f, "@{d}"),
        }
    }
}

impl FromStr for ImageRef {
    type Err = OciError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let bad = |reason: &str| OciError::InvalidReference {
            input: s.to_string(),
            reason: reason.to_string(),
        };
        if let Some(rest) = s.strip_prefix("oci:") {
            let (dir, tag) = match rest.rsplit_once(':') {
                Some((dir, tag)) if is_valid_tag(tag) => (dir, Some(tag.to_string())),
                Some((_, "")) => return Err(bad("empty tag after ':'")),
                _ => (rest, None),
            };
            if dir.is_empty() {
                return Err(bad("missing directory after 'oci:'"));
            }
            Ok(ImageRef::Oci {
                dir: PathBuf::from(dir),
                tag,
            })
        } else if let Some(rest) = s.strip_prefix("docker-archive:") {
            let (path, reference) = match rest.split_once(':') {
                Some((p, r)) => (p, Some(r)),
                None => (rest, None),
            };
            if path.is_empty() {
                return Err(bad("missing file after 'docker-archive:'"));
            }
            if let Some(r) = reference {
                validate_archive_ref(r).map_err(|reason| bad(&reason))?;
            }
            Ok(ImageRef::DockerArchive {
                path: PathBuf::from(path),
                reference: reference.map(str::to_string),
            })
        } else if let Some(rest) = s.strip_prefix("docker://") {
            RegistryRef::parse(rest)
                .map(ImageRef::Registry)
                .map_err(|e| match e {
                    OciError::InvalidReference { reason, .. } => bad(&reason),
                    OciError::InvalidDigest { reason, .. } => bad(reason),
                    other => other,
                })
        } else {
            Err(bad(
                "unknown transport; expected oci:DIR[:TAG], docker-archive:FILE[:REF] or \
                 docker://HOST/REPO[:TAG]",
            ))
        }
    }
}

fn validate_archive_ref(r: &str) -> Result<(), String> {
    if let Some(n) = r.strip_prefix('@') {
        return n
            .parse::<usize>()
            .map(|_| ())
            .map_err(|_| format!("invalid archive index {r:?}, expected @N"));
    }
    if r.is_empty() {
        return Err("empty reference after ':'".to_string());
    }
    let (name, tag) = split_name_tag(r);
    if let Some(tag) = tag {
        if !is_valid_tag(tag) {
            return Err(format!("invalid tag {tag:?}"));
        }
    }
    if name.is_empty() || name.contains('@') {
        return Err(format!("invalid reference {r:?}, expected REPO:TAG or @N"));
    }
    Ok(())
}

/// Split `name[:tag]` where the tag comes after the last `/`.
pub(crate) fn split_name_tag(r: &str) -> (&str, Option<&str>) {
    let slash = r.rfind('/').map_or(0, |i| i + 1);
    match r.get(slash..).and_then(|last| last.rfind(':')) {
        Some(colon) => {
            let at = slash + colon;
            (r.get(..at).unwrap_or(r), r.get(at + 1..))
        }
        None => (r, None),
    }
}

impl fmt::Display for ImageRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ImageRef::Oci { dir, tag } => {
                write!(f, "oci:{}", dir.display())?;
                if let Some(t) = tag {
                    write!(f, ":{t}")?;
                }
                Ok(())
            }
            ImageRef::DockerArchive { path, reference } => {
                write!(f, "docker-archive:{}", path.display())?;
                if let Some(r) = reference {
                    write!(f, ":{r}")?;
                }
                Ok(())
            }
            ImageRef::Registry(r) => write!(f, "docker://{r}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(s: &str) -> ImageRef {
        s.parse().unwrap_or_else(|e| panic!("{s}: {e}"))
    }

    #[test]
    fn oci_refs() {
        assert_eq!(
            parse("oci:/tmp/img"),
            ImageRef::Oci {
                dir: "/tmp/img".into(),
                tag: None
            }
        );
        assert_eq!(
            parse("oci:/tmp/img:v1.0"),
            ImageRef::Oci {
                dir: "/tmp/img".into(),
                tag: Some("v1.0".into())
            }
        );
        // What follows the last ':' contains '/', so it is part of the path.
        assert_eq!(
            parse("oci:/tmp/a:b/c"),
            ImageRef::Oci {
                dir: "/tmp/a:b/c".into(),
                tag: None
            }
        );
        assert_eq!(
            parse("oci:rel:dir:tag"),
            ImageRef::Oci {
                dir: "rel:dir".into(),
                tag: Some("tag".into())
            }
        );
        // Not a valid tag: stays in the path.
        assert_eq!(
            parse("oci:/x:-bad"),
            ImageRef::Oci {
                dir: "/x:-bad".into(),
                tag: None
            }
        );
        assert_eq!(parse("oci:/tmp/img:v1").to_string(), "oci:/tmp/img:v1");
        for bad in ["oci:", "oci::tag", "oci:/x:"] {
            assert!(bad.parse::<ImageRef>().is_err(), "accepted {bad}");
        }
    }

    #[test]
    fn archive_refs() {
        assert_eq!(
            parse("docker-archive:/tmp/a.tar"),
            ImageRef::DockerArchive {
                path: "/tmp/a.tar".into(),
                reference: None
            }
        );
        assert_eq!(
            parse("docker-archive:/tmp/a.tar:busybox:1.36"),
            ImageRef::DockerArchive {
                path: "/tmp/a.tar".into(),
                reference: Some("busybox:1.36".into())
            }
        );
        assert_eq!(
            parse("docker-archive:a.tar:@1"),
            ImageRef::DockerArchive {
                path: "a.tar".into(),
                reference: Some("@1".into())
            }
        );
        assert_eq!(
            parse("docker-archive:a.tar:localhost:5000/x/y:t").to_string(),
            "docker-archive:a.tar:localhost:5000/x/y:t"
        );
        for bad in [
            "docker-archive:",
            "docker-archive::x",
            "docker-archive:a.tar:@x",
            "docker-archive:a.tar:",
            "docker-archive:a.tar:repo:-bad",
        ] {
            assert!(bad.parse::<ImageRef>().is_err(), "accepted {bad}");
        }
    }

    #[test]
    fn registry_refs() {
        let r = parse("docker://quay.io/foo/bar");
        assert_eq!(
            r,
            ImageRef::Registry(RegistryRef {
                host: "quay.io".into(),
                repository: "foo/bar".into(),
                reference: RegistryReference::Tag("latest".into())
            })
        );
        assert_eq!(r.to_string(), "docker://quay.io/foo/bar:latest");
        let r = parse("docker://localhost:5000/a/b-c_d.e:v2");
        let ImageRef::Registry(rr) = &r else {
            panic!("not registry")
        };
        assert_eq!(rr.host, "localhost:5000");
        assert_eq!(rr.repository, "a/b-c_d.e");
        assert_eq!(rr.reference, RegistryReference::Tag("v2".into()));
        let d = Digest::of_bytes(b"x");
        let r = parse(&format!("docker://127.0.0.1:5000/img@{d}"));
        assert_eq!(r.to_string(), format!("docker://127.0.0.1:5000/img@{d}"));
        assert!(matches!(
            r,
            ImageRef::Registry(RegistryRef {
                reference: RegistryReference::Digest(_),
                ..
            })
        ));
        assert_eq!(
            parse("docker://localhost/x").to_string(),
            "docker://localhost/x:latest"
        );
        assert_eq!(
            parse("docker://[::1]:5000/x:1").to_string(),
            "docker://[::1]:5000/x:1"
        );
    }

    #[test]
    fn bad_registry_refs() {
        for bad in [
            "docker://busybox",
            "docker://library/busybox:latest",
            "docker://quay.io",
            "docker://quay.io/",
            "docker://quay.io/Foo",
            "docker://quay.io/foo//bar",
            "docker://quay.io/foo:",
            "docker://quay.io/foo:-x",
            "docker://quay.io/foo@sha256:../../x",
            "docker://quay.io/foo:tag@sha256:e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855",
            "docker://quay.io:99999/foo",
            "docker://qu ay.io/foo",
            "docker://quay.io/fo--o-/x",
            "docker://quay.io/a..b",
            "quay.io/foo",
            "foo",
            "",
        ] {
            assert!(bad.parse::<ImageRef>().is_err(), "accepted {bad}");
        }
        let err = "docker://busybox:latest"
            .parse::<ImageRef>()
            .expect_err("no host");
        assert!(err.to_string().contains("default registry"), "{err}");
    }

    #[test]
    fn tags_and_repos() {
        assert!(is_valid_tag("latest"));
        assert!(is_valid_tag("_x.y-z"));
        assert!(!is_valid_tag(".x"));
        assert!(!is_valid_tag(&"a".repeat(129)));
        assert!(is_valid_tag(&"a".repeat(128)));
        assert!(is_valid_repository("a/b__c/d---e"));
        assert!(!is_valid_repository("a/b___c"));
        assert!(!is_valid_repository("a/_b"));
        assert_eq!(split_name_tag("h:5000/x/y:t"), ("h:5000/x/y", Some("t")));
        assert_eq!(split_name_tag("h:5000/x/y"), ("h:5000/x/y", None));
    }
}
