//! The config file: the flags' settings in TOML, so that a machine's
//! registries, cache and snapshotter are set once (docs/config.md).
//!
//! Read from `--config PATH` or `LAMINA_CONFIG`, which must exist, else
//! from `/etc/lamina/config.toml` if it exists. Precedence: command-line
//! flag > environment variable > config file > built-in default. A list
//! given on the command line replaces the file's list. Unknown keys and
//! bad values are errors naming the key, the file, the line and column.
//!
//! Format (every key optional):
//!
//! ```toml
//! insecure_registries = ["registry.lan:5000"]  # --insecure-registry
//! tls_registries = ["127.0.0.1:5443"]          # --tls-registry
//! ca_file = "/etc/lamina/ca.pem"               # --ca-file
//! hosts_dir = "/etc/containerd/certs.d"        # --hosts-dir
//! cache_dir = "/var/lib/lamina"                # --cache-dir (mount, run, rm, umount, status, gc)
//! state_dir = "/run/lamina"                    # --state-dir (run, rm)
//! log = "info"                                 # LAMINA_LOG (a tracing filter)
//! log_format = "text"                          # --log-format: text | json
//!
//! [mount]                 # lamina mount
//! timeout = 60            # seconds
//! fill_window = "1M"      # bytes, or with K, M, G
//! hedge = true            # false: --no-hedge
//! cache_reserve = "1G"    # free space prefetches leave to reads readers wait on
//! reserve_space = false   # true: allocate the image's cache files whole at mount
//! fill_ahead = "8M"       # largest window fetched ahead of an in-order reader; 0: off
//! predict_max = "8M"      # largest library fetched whole on a first miss; 0: no predictions
//! fetch_rests = false     # true: --fetch-rests (the rest of a blob a start reads much of)
//! prefetch = "boot"       # none | pages | boot | all
//! readahead = 0           # KiB
//!
//! [run]                   # lamina run: [mount]'s keys, and
//! runtime = "runc"
//! stop_timeout = 10       # seconds
//! net = "none"            # none | host
//!
//! [snapshotter]
//! root = "/var/lib/lamina/snapshotter"
//! address = "/run/lamina/snapshotter.sock"
//! timeout = 60
//! prefetch = "boot"
//! fill_ahead = "8M"
//! predict_max = "8M"
//! fetch_rests = false
//! metrics_address = "127.0.0.1:9464"   # or "unix:/run/lamina/metrics.sock"
//! cache_max_size = "50G"  # the shared cache, collected in the background
//! cache_reserve = "1G"
//! reserve_space = true    # each mount's cache files allocated whole at mount
//! share_files = true      # files shared by content across images (mode "kernel")
//! cri_keychain = "/run/containerd/containerd.sock"  # pods' pull secrets (docs/containerd.md)
//! tenant_caches = ["registry.example.com/team-a=/srv/lamina/team-a"]  # a tenant's own cache dir
//!
//! [convert]
//! chunk_size = "256K"
//! zstd_level = 3
//! work_dir = "/var/tmp"
//!
//! [gc]
//! max_size = "10G"
//! ```
//!
//! The cache and state dirs are global keys, not per command: `mount`,
//! `umount`, `status` and `gc` must agree on them to work together.

use std::fmt;
use std::path::{Path, PathBuf};
use std::str::FromStr;

use lamina_snapshotter::metrics::MetricsAddress;
use serde::{Deserialize, Deserializer};

use crate::size::{parse_chunk_size, parse_size};

/// Read when neither `--config` nor `LAMINA_CONFIG` names a file.
pub const DEFAULT_PATH: &str = "/etc/lamina/config.toml";

/// A config file that could not be used (exit code 2).
#[derive(Debug)]
pub enum ConfigError {
    /// The file named by `--config` or `LAMINA_CONFIG` could not be read.
    Read(PathBuf, std::io::Error),
    /// Bad TOML, an unknown key or a bad value (the message has the key,
    /// line and column).
    Parse(PathBuf, String),
    /// A setting needed and given neither as a flag nor in the file.
    Missing(&'static str),
    /// Flags that do not go together.
    Invalid(String),
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ConfigError::Read(p, e) => write!(f, "config file {}: {e}", p.display()),
            ConfigError::Parse(p, e) => write!(f, "config file {}: {}", p.display(), e.trim()),
            ConfigError::Missing(what) => write!(f, "{what}"),
            ConfigError::Invalid(why) => write!(f, "{why}"),
        }
    }
}

impl std::error::Error for ConfigError {}

/// The log format, as `--log-format` and the file name it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    /// One human-readable line per event.
    Text,
    /// One JSON object per event.
    Json,
}

/// What the prefetch flags accept.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum PrefetchMode {
    /// Nothing.
    None,
    /// The boot pages.
    Pages,
    /// The boot pages, then the boot set's chunks.
    Boot,
    /// Then everything.
    All,
}

impl PrefetchMode {
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            PrefetchMode::None => "none",
            PrefetchMode::Pages => "pages",
            PrefetchMode::Boot => "boot",
            PrefetchMode::All => "all",
        }
    }
}

/// What `mode` (`--mode`) accepts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum MountMode {
    /// The kernel path where the host allows it, else FUSE.
    Auto,
    /// File-backed EROFS.
    Kernel,
    /// A FUSE daemon.
    Fuse,
}

impl MountMode {
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            MountMode::Auto => "auto",
            MountMode::Kernel => "kernel",
            MountMode::Fuse => "fuse",
        }
    }
}

/// `lamina run --net`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum NetMode {
    /// The host's network.
    Host,
    /// A loopback of its own.
    None,
}

/// The whole file.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ConfigFile {
    pub(crate) insecure_registries: Option<Vec<String>>,
    pub(crate) tls_registries: Option<Vec<String>>,
    pub(crate) ca_file: Option<PathBuf>,
    pub(crate) hosts_dir: Option<PathBuf>,
    pub(crate) registry_min_rate: Option<Size>,
    pub(crate) cache_dir: Option<PathBuf>,
    pub(crate) state_dir: Option<PathBuf>,
    /// `LAMINA_LOG`'s default.
    pub log: Option<String>,
    pub(crate) log_format: Option<LogFormat>,
    #[serde(default)]
    pub(crate) mount: ServeSection,
    #[serde(default)]
    pub(crate) run: RunSection,
    #[serde(default)]
    pub(crate) snapshotter: SnapshotterSection,
    #[serde(default)]
    pub(crate) convert: ConvertSection,
    #[serde(default)]
    pub(crate) gc: GcSection,
    #[serde(default)]
    pub(crate) index: IndexSection,
}

/// `[index]`: which tar indexes mounts and the snapshotter use.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct IndexSection {
    /// `enforce` (the default) or `audit`.
    pub(crate) policy: Option<IndexPolicy>,
    /// Tar index manifests the node vouches for, by digest.
    pub(crate) pinned: Option<Vec<String>>,
    /// cosign public keys whose signatures vouch for tar indexes.
    pub(crate) keys: Option<Vec<PathBuf>>,
}

/// `[index] policy`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub(crate) enum IndexPolicy {
    /// Refuse an index nothing vouches for.
    Enforce,
    /// Use it, with a warning.
    Audit,
}

/// `[mount]`.
#[derive(Debug, Default, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct ServeSection {
    pub(crate) mode: Option<MountMode>,
    pub(crate) timeout: Option<u64>,
    pub(crate) fill_window: Option<Size>,
    pub(crate) fill_ahead: Option<Size>,
    pub(crate) predict_max: Option<Size>,
    pub(crate) fetch_rests: Option<bool>,
    pub(crate) prefetch: Option<PrefetchMode>,
    pub(crate) readahead: Option<u32>,
    pub(crate) hedge: Option<bool>,
    pub(crate) cache_reserve: Option<Size>,
    pub(crate) reserve_space: Option<bool>,
}

/// `[run]`: `[mount]`'s keys and run's own (serde cannot flatten a
/// section that denies unknown keys).
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RunSection {
    pub(crate) mode: Option<MountMode>,
    pub(crate) timeout: Option<u64>,
    pub(crate) fill_window: Option<Size>,
    pub(crate) fill_ahead: Option<Size>,
    pub(crate) predict_max: Option<Size>,
    pub(crate) fetch_rests: Option<bool>,
    pub(crate) prefetch: Option<PrefetchMode>,
    pub(crate) readahead: Option<u32>,
    pub(crate) hedge: Option<bool>,
    pub(crate) cache_reserve: Option<Size>,
    pub(crate) reserve_space: Option<bool>,
    pub(crate) runtime: Option<PathBuf>,
    pub(crate) stop_timeout: Option<u64>,
    pub(crate) net: Option<NetMode>,
}

impl RunSection {
    pub(crate) fn serve(&self) -> ServeSection {
        ServeSection {
            mode: self.mode,
            timeout: self.timeout,
            fill_window: self.fill_window,
            fill_ahead: self.fill_ahead,
            predict_max: self.predict_max,
            fetch_rests: self.fetch_rests,
            prefetch: self.prefetch,
            readahead: self.readahead,
            hedge: self.hedge,
            cache_reserve: self.cache_reserve,
            reserve_space: self.reserve_space,
        }
    }
}

/// `[snapshotter]`.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct SnapshotterSection {
    pub(crate) root: Option<PathBuf>,
    pub(crate) address: Option<PathBuf>,
    pub(crate) timeout: Option<u64>,
    pub(crate) prefetch: Option<PrefetchMode>,
    pub(crate) fill_ahead: Option<Size>,
    pub(crate) predict_max: Option<Size>,
    pub(crate) fetch_rests: Option<bool>,
    pub(crate) mode: Option<MountMode>,
    #[serde(default, deserialize_with = "parsed")]
    pub(crate) metrics_address: Option<MetricsAddress>,
    pub(crate) cache_max_size: Option<Size>,
    pub(crate) cache_reserve: Option<Size>,
    pub(crate) reserve_space: Option<bool>,
    pub(crate) share_files: Option<bool>,
    pub(crate) cri_keychain: Option<PathBuf>,
    #[serde(default, deserialize_with = "parsed_list")]
    pub(crate) tenant_caches: Option<Vec<lamina_snapshotter::tenants::TenantCache>>,
}

/// `[convert]`.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct ConvertSection {
    pub(crate) chunk_size: Option<ChunkSize>,
    pub(crate) zstd_level: Option<i32>,
    pub(crate) work_dir: Option<PathBuf>,
}

/// `[gc]`.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct GcSection {
    pub(crate) max_size: Option<Size>,
}

/// A size in bytes: an integer, or a string with a K, M, G or T suffix.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Size(pub(crate) u64);

/// A chunk size: a [`Size`] that is a power of two in 4 KiB..16 MiB.
#[derive(Debug, Clone, Copy)]
pub(crate) struct ChunkSize(pub(crate) u64);

impl<'de> Deserialize<'de> for Size {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        size(d, parse_size).map(Size)
    }
}

impl<'de> Deserialize<'de> for ChunkSize {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        size(d, parse_chunk_size).map(ChunkSize)
    }
}

/// An integer or a string, checked by the flag's own parser.
fn size<'de, D: Deserializer<'de>>(
    d: D,
    parse: fn(&str) -> Result<u64, String>,
) -> Result<u64, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Raw {
        Int(u64),
        Text(String),
    }
    let text = match Raw::deserialize(d)
        .map_err(|_| serde::de::Error::custom("expected a size: bytes, or a string like \"10G\""))?
    {
        Raw::Int(n) => n.to_string(),
        Raw::Text(s) => s,
    };
    parse(&text).map_err(serde::de::Error::custom)
}

/// A string parsed by the type's `FromStr`, as its flag parses it.
fn parsed<'de, D, T>(d: D) -> Result<Option<T>, D::Error>
where
    D: Deserializer<'de>,
    T: FromStr<Err = String>,
{
    String::deserialize(d)?
        .parse()
        .map(Some)
        .map_err(serde::de::Error::custom)
}

/// A list of strings, each parsed (`T: FromStr`).
fn parsed_list<'de, D, T>(d: D) -> Result<Option<Vec<T>>, D::Error>
where
    D: Deserializer<'de>,
    T: FromStr<Err = String>,
{
    Vec::<String>::deserialize(d)?
        .iter()
        .map(|s| s.parse().map_err(serde::de::Error::custom))
        .collect::<Result<Vec<T>, _>>()
        .map(Some)
}

/// Parses a config file's text.
pub fn parse(text: &str) -> Result<ConfigFile, toml::de::Error> {
    toml::from_str(text)
}

/// Reads the file `explicit` names (it must exist), else the default one if
/// it exists, else nothing.
pub fn load(explicit: Option<&Path>) -> Result<ConfigFile, ConfigError> {
    let path = explicit.unwrap_or(Path::new(DEFAULT_PATH));
    let text = match std::fs::read_to_string(path) {
        Ok(text) => text,
        Err(e) if explicit.is_none() && e.kind() == std::io::ErrorKind::NotFound => {
            return Ok(ConfigFile::default())
        }
        Err(e) => return Err(ConfigError::Read(path.to_path_buf(), e)),
    };
    parse(&text).map_err(|e| ConfigError::Parse(path.to_path_buf(), e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unknown_keys_and_bad_values_name_the_key_and_place() {
        let cases = [
            ("[mount]\ntimout = 5\n", "timout", "line 2"),
            (
                "cache_dir = \"/c\"\n[snapshotter]\nprefetch = \"most\"\n",
                "most",
                "line 3",
            ),
            ("[convert]\nchunk_size = 1000\n", "power of two", "line 2"),
            (
                "[snapshotter]\ntenant_caches = [\"h/x=relative\"]\n",
                "PREFIX=DIR",
                "line 2",
            ),
            ("[gc]\nmax_size = \"10Q\"\n", "suffix", "line 2"),
            (
                "[snapshotter]\nmetrics_address = \"localhost\"\n",
                "IP:PORT",
                "line 2",
            ),
            ("[mount]\ntimeout = \"soon\"\n", "timeout", "line 2"),
            ("cache_dir = \n", "", "line 1"),
            ("[nope]\n", "nope", "line 1"),
        ];
        for (toml, names, place) in cases {
            let err = parse(toml).expect_err(toml).to_string();
            assert!(
                err.contains(names) && err.contains(place),
                "{toml:?}: {err}"
            );
        }
    }

    #[test]
    fn a_named_file_must_exist_and_the_default_may_not() {
        let dir = tempfile::tempdir().unwrap();
        let missing = dir.path().join("none.toml");
        let err = load(Some(&missing)).unwrap_err();
        assert!(matches!(err, ConfigError::Read(..)), "{err}");
        assert!(err.to_string().contains("none.toml"), "{err}");
        let bad = dir.path().join("bad.toml");
        std::fs::write(&bad, "[gc]\nmax = 1\n").unwrap();
        let err = load(Some(&bad)).unwrap_err().to_string();
        assert!(
            err.contains("bad.toml") && err.contains("max") && err.contains("line 2"),
            "{err}"
        );
    }

    #[test]
    fn the_example_files_parse() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
        let shipped = std::fs::read_to_string(root.join("contrib/config.toml")).unwrap();
        parse(&shipped).unwrap();
        // Every key in docs/config.md.
        let doc = std::fs::read_to_string(root.join("docs/config.md")).unwrap();
        let start = doc.find("```toml\n").unwrap() + 8;
        let end = start + doc[start..].find("```\n").unwrap();
        parse(&doc[start..end]).unwrap_or_else(|e| panic!("docs/config.md: {e}"));
        // The format in this module's docs.
        let doc = include_str!("config.rs");
        let start = doc.find("//! ```toml\n").unwrap() + 12;
        let end = start + doc[start..].find("//! ```\n").unwrap();
        let text: String = doc[start..end]
            .lines()
            .map(|l| format!("{}\n", l.trim_start_matches("//!").trim_start_matches(' ')))
            .collect();
        parse(&text).unwrap_or_else(|e| panic!("{e}\n{text}"));
    }
}
