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
//! fill_ahead = "8M"       # largest window fetched ahead of an in-order reader; 0: off
//! predict_max = "8M"      # largest library fetched whole on a first miss; 0: no predictions
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
//! metrics_address = "127.0.0.1:9464"   # or "unix:/run/lamina/metrics.sock"
//! cache_max_size = "50G"  # the shared cache, collected in the background
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

use clap::parser::ValueSource;
use clap::ArgMatches;
use lamina_snapshotter::metrics::MetricsAddress;
use serde::{Deserialize, Deserializer};

use crate::cli::{Args, Command, ServeArgs};

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
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ConfigError::Read(p, e) => write!(f, "config file {}: {e}", p.display()),
            ConfigError::Parse(p, e) => write!(f, "config file {}: {}", p.display(), e.trim()),
            ConfigError::Missing(what) => write!(f, "{what}"),
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
    fn as_str(self) -> &'static str {
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
    fn as_str(self) -> &'static str {
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
    insecure_registries: Option<Vec<String>>,
    tls_registries: Option<Vec<String>>,
    ca_file: Option<PathBuf>,
    hosts_dir: Option<PathBuf>,
    cache_dir: Option<PathBuf>,
    state_dir: Option<PathBuf>,
    /// `LAMINA_LOG`'s default.
    pub log: Option<String>,
    log_format: Option<LogFormat>,
    #[serde(default)]
    mount: ServeSection,
    #[serde(default)]
    run: RunSection,
    #[serde(default)]
    snapshotter: SnapshotterSection,
    #[serde(default)]
    convert: ConvertSection,
    #[serde(default)]
    gc: GcSection,
}

/// `[mount]`.
#[derive(Debug, Default, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
struct ServeSection {
    mode: Option<MountMode>,
    timeout: Option<u64>,
    fill_window: Option<Size>,
    fill_ahead: Option<Size>,
    predict_max: Option<Size>,
    prefetch: Option<PrefetchMode>,
    readahead: Option<u32>,
    hedge: Option<bool>,
}

/// `[run]`: `[mount]`'s keys and run's own (serde cannot flatten a
/// section that denies unknown keys).
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RunSection {
    mode: Option<MountMode>,
    timeout: Option<u64>,
    fill_window: Option<Size>,
    fill_ahead: Option<Size>,
    predict_max: Option<Size>,
    prefetch: Option<PrefetchMode>,
    readahead: Option<u32>,
    hedge: Option<bool>,
    runtime: Option<PathBuf>,
    stop_timeout: Option<u64>,
    net: Option<NetMode>,
}

impl RunSection {
    fn serve(&self) -> ServeSection {
        ServeSection {
            mode: self.mode,
            timeout: self.timeout,
            fill_window: self.fill_window,
            fill_ahead: self.fill_ahead,
            predict_max: self.predict_max,
            prefetch: self.prefetch,
            readahead: self.readahead,
            hedge: self.hedge,
        }
    }
}

/// `[snapshotter]`.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct SnapshotterSection {
    root: Option<PathBuf>,
    address: Option<PathBuf>,
    timeout: Option<u64>,
    prefetch: Option<PrefetchMode>,
    fill_ahead: Option<Size>,
    predict_max: Option<Size>,
    mode: Option<MountMode>,
    #[serde(default, deserialize_with = "parsed")]
    metrics_address: Option<MetricsAddress>,
    cache_max_size: Option<Size>,
}

/// `[convert]`.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct ConvertSection {
    chunk_size: Option<ChunkSize>,
    zstd_level: Option<i32>,
    work_dir: Option<PathBuf>,
}

/// `[gc]`.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct GcSection {
    max_size: Option<Size>,
}

/// A size in bytes: an integer, or a string with a K, M, G or T suffix.
#[derive(Debug, Clone, Copy)]
struct Size(u64);

/// A chunk size: a [`Size`] that is a power of two in 4 KiB..16 MiB.
#[derive(Debug, Clone, Copy)]
struct ChunkSize(u64);

impl<'de> Deserialize<'de> for Size {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        size(d, crate::cli::parse_size).map(Size)
    }
}

impl<'de> Deserialize<'de> for ChunkSize {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        size(d, crate::cli::parse_chunk_size).map(ChunkSize)
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

/// Where a parsed command's values came from.
struct Sources<'a>(&'a ArgMatches);

impl Sources<'_> {
    /// Whether `id` came from the command line or the environment (which
    /// the file does not override).
    fn given(&self, id: &str) -> bool {
        matches!(
            self.0.value_source(id),
            Some(ValueSource::CommandLine | ValueSource::EnvVariable)
        )
    }

    /// Sets `slot` from the file unless the flag or its variable was given.
    fn fill<T>(&self, slot: &mut T, id: &str, from_file: Option<T>) {
        if let Some(value) = from_file.filter(|_| !self.given(id)) {
            *slot = value;
        }
    }
}

/// Fills what the command line and the environment left to their defaults
/// from `file`.
pub fn apply(args: &mut Args, matches: &ArgMatches, file: &ConfigFile) {
    // Global flags are propagated to the subcommand's matches, wherever
    // they were written on the line.
    let m = Sources(matches.subcommand().map_or(matches, |(_, sub)| sub));
    m.fill(
        &mut args.insecure,
        "insecure",
        file.insecure_registries.clone(),
    );
    m.fill(&mut args.tls, "tls", file.tls_registries.clone());
    m.fill(&mut args.ca_file, "ca_file", file.ca_file.clone().map(Some));
    m.fill(&mut args.hosts_dir, "hosts_dir", file.hosts_dir.clone());
    m.fill(&mut args.log_format, "log_format", file.log_format);
    let cache_dir = || file.cache_dir.clone();
    let state_dir = || file.state_dir.clone();
    match &mut args.command {
        Command::Convert {
            chunk_size,
            zstd_level,
            work_dir,
            ..
        } => {
            let c = &file.convert;
            m.fill(chunk_size, "chunk_size", c.chunk_size.map(|s| s.0));
            m.fill(zstd_level, "zstd_level", c.zstd_level);
            m.fill(work_dir, "work_dir", c.work_dir.clone().map(Some));
        }
        // Nothing of `lamina index` is in the config file yet.
        Command::Index { .. } => {}
        Command::Mount { serve, .. } => fill_serve(&m, serve, cache_dir(), &file.mount),
        Command::Run {
            serve,
            net,
            stop_timeout,
            state_dir: state,
            runtime,
            ..
        } => {
            let r = &file.run;
            fill_serve(&m, serve, cache_dir(), &r.serve());
            let net_name = |n: NetMode| if n == NetMode::Host { "host" } else { "none" };
            m.fill(net, "net", r.net.map(|n| net_name(n).to_string()));
            m.fill(stop_timeout, "stop_timeout", r.stop_timeout);
            m.fill(state, "state_dir", state_dir());
            m.fill(runtime, "runtime", r.runtime.clone());
        }
        Command::Rm {
            cache_dir: cache,
            state_dir: state,
            ..
        } => {
            m.fill(cache, "cache_dir", cache_dir());
            m.fill(state, "state_dir", state_dir());
        }
        Command::Umount { cache_dir: c, .. } | Command::Status { cache_dir: c, .. } => {
            m.fill(c, "cache_dir", cache_dir());
        }
        Command::Gc {
            max_size,
            cache_dir: cache,
        } => {
            m.fill(max_size, "max_size", file.gc.max_size.map(|s| Some(s.0)));
            m.fill(cache, "cache_dir", cache_dir());
        }
        Command::Snapshotter {
            root,
            address,
            timeout,
            prefetch,
            fill_ahead,
            predict_max,
            mode,
            metrics_address,
            cache_max_size,
        } => {
            let s = &file.snapshotter;
            let max = s.cache_max_size.map(|v| Some(v.0));
            m.fill(cache_max_size, "cache_max_size", max);
            m.fill(mode, "mode", s.mode.map(|v| v.as_str().into()));
            m.fill(root, "root", s.root.clone());
            m.fill(address, "address", s.address.clone());
            m.fill(timeout, "timeout", s.timeout);
            m.fill(prefetch, "prefetch", s.prefetch.map(|p| p.as_str().into()));
            m.fill(fill_ahead, "fill_ahead", s.fill_ahead.map(|w| w.0));
            m.fill(predict_max, "predict_max", s.predict_max.map(|w| w.0));
            let metrics = s.metrics_address.clone().map(Some);
            m.fill(metrics_address, "metrics_address", metrics);
        }
        Command::InternalHolder { .. }
        | Command::InternalFuse { .. }
        | Command::InternalWorker { .. }
        | Command::Inspect { .. } => {}
    }
}

fn fill_serve(m: &Sources, serve: &mut ServeArgs, cache_dir: Option<PathBuf>, s: &ServeSection) {
    m.fill(&mut serve.cache_dir, "cache_dir", cache_dir);
    m.fill(&mut serve.mode, "mode", s.mode.map(|v| v.as_str().into()));
    m.fill(&mut serve.timeout, "timeout", s.timeout);
    m.fill(
        &mut serve.fill_window,
        "fill_window",
        s.fill_window.map(|w| w.0),
    );
    m.fill(
        &mut serve.fill_ahead,
        "fill_ahead",
        s.fill_ahead.map(|w| w.0),
    );
    m.fill(
        &mut serve.predict_max,
        "predict_max",
        s.predict_max.map(|w| w.0),
    );
    m.fill(&mut serve.readahead, "readahead", s.readahead.map(Some));
    m.fill(&mut serve.no_hedge, "no_hedge", s.hedge.map(|h| !h));
    // --prefetch-all on the line is a --prefetch given.
    if !m.given("prefetch_all") {
        m.fill(
            &mut serve.prefetch,
            "prefetch",
            s.prefetch.map(|p| p.as_str().into()),
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::{CommandFactory, FromArgMatches};

    /// Parses `line` as the binary does, with `toml` as the config file.
    fn parse_with(line: &[&str], toml: &str) -> Args {
        let matches = Args::command().try_get_matches_from(line).unwrap();
        let mut args = Args::from_arg_matches(&matches).unwrap();
        apply(&mut args, &matches, &parse(toml).unwrap());
        args
    }

    const FILE: &str = r#"
        hosts_dir = "/file/certs.d"
        insecure_registries = ["file.lan:5000"]
        cache_dir = "/file/cache"
        log_format = "json"
        [mount]
        mode = "fuse"
        timeout = 7
        fill_window = "1M"
        fill_ahead = "16M"
        prefetch = "all"
        hedge = false
        predict_max = "2M"
        [snapshotter]
        mode = "kernel"
        root = "/file/root"
        address = "/file/sock"
        fill_ahead = "2M"
        predict_max = "1M"
        metrics_address = "unix:/file/metrics.sock"
        [convert]
        chunk_size = "1M"
        [gc]
        max_size = "10G"
    "#;

    #[test]
    fn the_file_fills_what_the_line_leaves_to_defaults() {
        let args = parse_with(&["lamina", "mount", "docker://h/r:t", "/mnt"], FILE);
        assert_eq!(args.hosts_dir, Path::new("/file/certs.d"));
        assert_eq!(args.insecure, ["file.lan:5000"]);
        assert_eq!(args.log_format, LogFormat::Json);
        let Command::Mount { serve, .. } = &args.command else {
            panic!()
        };
        assert_eq!(serve.cache_dir, Path::new("/file/cache"));
        assert_eq!((serve.timeout, serve.fill_window), (7, 1 << 20));
        assert_eq!(serve.fill_ahead, 16 << 20);
        assert_eq!(serve.prefetch, "all");
        assert!(serve.no_hedge, "hedge = false is --no-hedge");
        assert_eq!(serve.predict_max, 2 << 20);
        assert_eq!(serve.mode, "fuse");
        let args = parse_with(&["lamina", "mount", "--mode", "auto", "oci:x", "/m"], FILE);
        let Command::Mount { serve, .. } = &args.command else {
            panic!()
        };
        assert_eq!(serve.mode, "auto", "the flag beats the file");
        let args = parse_with(&["lamina", "run", "oci:x"], FILE);
        let Command::Run { serve, .. } = &args.command else {
            panic!()
        };
        assert_eq!(serve.mode, "auto", "[mount] is not [run]");

        let args = parse_with(&["lamina", "snapshotter"], FILE);
        let Command::Snapshotter {
            root,
            address,
            metrics_address,
            fill_ahead,
            predict_max,
            mode,
            ..
        } = &args.command
        else {
            panic!()
        };
        assert_eq!(
            (root.as_path(), address.as_path()),
            (Path::new("/file/root"), Path::new("/file/sock"))
        );
        assert_eq!(
            metrics_address,
            &Some(MetricsAddress::Unix("/file/metrics.sock".into()))
        );
        assert_eq!(*fill_ahead, 2 << 20);
        assert_eq!(*predict_max, 1 << 20);
        assert_eq!(mode, "kernel");
        assert!(parse("[snapshotter]\nmode = \"both\"\n").is_err());

        let args = parse_with(&["lamina", "gc"], FILE);
        let Command::Gc { max_size, .. } = args.command else {
            panic!()
        };
        assert_eq!(max_size, Some(10 << 30));
        let args = parse_with(&["lamina", "convert", "oci:a", "oci:b"], FILE);
        let Command::Convert {
            chunk_size,
            zstd_level,
            ..
        } = args.command
        else {
            panic!()
        };
        assert_eq!(
            (chunk_size, zstd_level),
            (1 << 20, 3),
            "the default where the file says nothing"
        );
    }

    #[test]
    fn flags_beat_the_file_wherever_they_are_written() {
        let line = [
            "lamina",
            "--hosts-dir",
            "/line/certs.d",
            "mount",
            "--timeout",
            "9",
            "--insecure-registry",
            "line.lan",
            "--prefetch-all",
            "docker://h/r:t",
            "/mnt",
            "--cache-dir",
            "/line/cache",
        ];
        let args = parse_with(&line, FILE);
        assert_eq!(args.hosts_dir, Path::new("/line/certs.d"));
        assert_eq!(
            args.insecure,
            ["line.lan"],
            "a list on the line replaces the file's"
        );
        let Command::Mount { serve, .. } = &args.command else {
            panic!()
        };
        assert_eq!(serve.cache_dir, Path::new("/line/cache"));
        assert_eq!((serve.timeout, serve.fill_window), (9, 1 << 20));
        assert!(serve.prefetch_all);
        // A global flag after the subcommand counts as given too.
        let args = parse_with(&["lamina", "status", "--hosts-dir", "/after"], FILE);
        assert_eq!(args.hosts_dir, Path::new("/after"));
    }

    #[test]
    fn the_environment_beats_the_file() {
        // The only test that sets this variable; clap reads it at parse time.
        std::env::set_var("LAMINA_STATE_DIR", "/env/state");
        let args = parse_with(
            &["lamina", "rm", "x"],
            "state_dir = \"/file/state\"\ncache_dir = \"/file/cache\"",
        );
        std::env::remove_var("LAMINA_STATE_DIR");
        let Command::Rm {
            state_dir,
            cache_dir,
            ..
        } = args.command
        else {
            panic!()
        };
        assert_eq!(state_dir, Path::new("/env/state"));
        assert_eq!(cache_dir, Path::new("/file/cache"));
    }

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
