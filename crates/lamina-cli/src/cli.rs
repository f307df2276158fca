//! Arguments and the glue from them to library calls.

use std::io::{IsTerminal, Write};
use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::{Parser, Subcommand};
use indicatif::{ProgressBar, ProgressStyle};
use lamina_image::artifact::{self, LaminaLayers};
use lamina_image::build::BuildOptions;
use lamina_image::convert::{convert, ConvertOptions, Progress};
use lamina_image::index::{index, IndexOptions};
use lamina_mount::{Mode, MountOptions, Privileges};
use lamina_oci::{open_source, HostsConfig, ImageRef, SourceOptions};
use lamina_snapshotter::metrics::MetricsAddress;

use crate::config::{ConfigError, LogFormat};

/// Lazy-loading container images on EROFS.
///
/// Image references: oci:DIR[:TAG], docker-archive:FILE[:REF],
/// docker://HOST[:PORT]/REPO[:TAG|@DIGEST].
#[derive(Debug, Parser)]
#[command(name = "lamina", version)]
pub struct Args {
    #[command(subcommand)]
    pub(crate) command: Command,
    /// Print a JSON document instead of human-readable text.
    #[arg(long, global = true)]
    json: bool,
    /// Config file: the flags' settings in TOML (docs/config.md). Default:
    /// /etc/lamina/config.toml if it exists. Flags and environment
    /// variables take precedence over it.
    #[arg(long, global = true, env = "LAMINA_CONFIG", value_name = "PATH")]
    pub(crate) config: Option<PathBuf>,
    /// Log format of the mount daemons and the snapshotter (levels and
    /// targets: LAMINA_LOG, a tracing filter, default info).
    #[arg(
        long,
        global = true,
        env = "LAMINA_LOG_FORMAT",
        value_enum,
        default_value = "text"
    )]
    pub(crate) log_format: LogFormat,
    /// Registry host reached over plain HTTP (loopback hosts always are).
    #[arg(long = "insecure-registry", global = true, value_name = "HOST[:PORT]")]
    pub(crate) insecure: Vec<String>,
    /// Loopback registry host reached over TLS (instead of plain HTTP).
    #[arg(long = "tls-registry", global = true, value_name = "HOST[:PORT]")]
    pub(crate) tls: Vec<String>,
    /// PEM file of CA certificates to trust for registry TLS, besides the
    /// system store.
    #[arg(long, global = true, value_name = "PATH")]
    pub(crate) ca_file: Option<PathBuf>,
    /// Registry host configuration as containerd reads it: mirrors, CAs,
    /// client certificates and headers in DIR/HOST[:PORT]/hosts.toml (or
    /// DIR/HOST_PORT_/, DIR/_default/). A missing directory configures
    /// nothing.
    #[arg(
        long,
        global = true,
        value_name = "DIR",
        default_value = lamina_oci::hosts::DEFAULT_HOSTS_DIR
    )]
    pub(crate) hosts_dir: PathBuf,
}

// One value per process, never moved in a loop: variant sizes do not matter.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Subcommand)]
pub(crate) enum Command {
    /// Convert an image into a lamina image (EROFS metadata + chunked zstd blobs).
    Convert {
        /// Source image.
        src: String,
        /// Destination: oci:DIR[:TAG] or docker://HOST/REPO[:TAG].
        dst: String,
        /// Chunk size in bytes (power of two, 4 KiB..16 MiB): the unit of
        /// dedup and of lazy fetching.
        #[arg(long, default_value = "262144", value_parser = parse_chunk_size)]
        chunk_size: u64,
        /// zstd level for data chunks.
        #[arg(long, default_value = "3")]
        zstd_level: i32,
        /// Files of at most this size are packed together into shared
        /// chunks (one fetch for neighbours); 0 gives every file its own.
        #[arg(long, default_value = "16K", value_parser = parse_size)]
        pack_limit: u64,
        /// Image format to write: 4 (a paged chunk index) or 3 (every chunk
        /// in the index, for lamina builds from before the paged index).
        #[arg(long, default_value = "4", value_parser = clap::builder::PossibleValuesParser::new(["3", "4"]))]
        format_version: String,
        /// Directory for blobs while they are built (default: system temp dir).
        #[arg(long)]
        work_dir: Option<PathBuf>,
        /// Boot set: a trace from `lamina mount --record-trace`; its chunks are
        /// fetched first, in order, when the image is mounted lazily.
        #[arg(long, value_name = "TRACE")]
        prefetch: Option<PathBuf>,
        /// Bytes of metadata per zstd frame (4 KiB..64 MiB; default 4M): a
        /// lazy FUSE mount decompresses the frames as they are needed.
        #[arg(long, hide = true, value_parser = parse_frame_size)]
        metadata_frame_size: Option<u64>,
    },
    /// Index an unmodified image for lazy mounts: no conversion, no second
    /// copy. Reads each layer once and stores a small artifact (EROFS
    /// metadata pointing into the layers' tars, random-access points into
    /// their compressed streams) as an OCI referrer of the image, in its
    /// own repository, or at DST.
    Index {
        /// The image to index (it stays as it is).
        src: String,
        /// Where the index goes instead: oci:DIR[:TAG] or docker://HOST/REPO[:TAG]
        /// (then name it with --index when mounting).
        dst: Option<String>,
        /// Compressed bytes between random-access points: a miss fetches
        /// about this much, and the window of a gzip point (32 KiB, about
        /// 16 KiB stored, fetched only with its span).
        #[arg(long, default_value = "64K", value_parser = parse_size)]
        span_size: u64,
        /// A trace recorded through a mount of this image's index (`lamina
        /// mount --record-trace FILE`): its spans become the boot set and
        /// the pages it read boot pages in the index.
        #[arg(long, value_name = "TRACE")]
        prefetch: Option<PathBuf>,
    },
    /// Mount a lamina image read-only with the kernel (file-backed EROFS),
    /// or through FUSE.
    ///
    /// Registry images mount lazily: data is fetched on first read through
    /// fanotify pre-content events, served by a background daemon. Local
    /// images are fetched whole first (use --lazy to serve them lazily too).
    /// With --mode fuse, a FUSE daemon serves the image from the same cache,
    /// lazily or eagerly alike. --mode auto (the default) takes the kernel
    /// path where this host allows it (root; Linux 6.12+, for lazy mounts
    /// 6.14+; a cache dir on ext4, xfs or btrfs) and FUSE otherwise, and
    /// logs which and why.
    Mount {
        /// The lamina image.
        image: String,
        /// Where to mount it.
        mountpoint: PathBuf,
        #[command(flatten)]
        serve: ServeArgs,
        /// Record every read the workload makes of data not yet local, in
        /// order, to FILE (for `lamina convert --prefetch FILE`).
        #[arg(long, value_name = "FILE")]
        record_trace: Option<PathBuf>,
        /// Honour the image's setuid and setgid bits. Off by default: a
        /// root mount is reachable by every local user (`nosuid`).
        #[arg(long)]
        suid: bool,
        /// Let the image's device nodes be opened. Off by default: a node
        /// such as `b 8 0` of mode 0666 would be raw disk access for every
        /// local user (`nodev`).
        #[arg(long)]
        dev: bool,
    },
    /// Run a container from a lamina image with runc (no containerd needed).
    ///
    /// The image is mounted as `lamina mount` mounts it, an overlayfs with a
    /// private upper dir goes on top, and runc runs the image's entrypoint,
    /// command, environment, working dir and user. Arguments after the image
    /// (or after `--`) replace the image's Cmd. Exit code: the container's;
    /// 125 when lamina fails, 126 when the command cannot be executed, 127
    /// when it is not found. SIGINT/SIGTERM stop the container (SIGKILL
    /// after --stop-timeout) and everything is unmounted. With --json a
    /// report goes to stderr at exit.
    Run {
        /// The lamina image.
        image: String,
        /// The command and its arguments (replace the image's Cmd).
        #[arg(
            trailing_var_arg = true,
            allow_hyphen_values = true,
            value_name = "CMD"
        )]
        args: Vec<String>,
        #[command(flatten)]
        serve: ServeArgs,
        /// Container name (default: generated); runc's id and the hostname.
        #[arg(long)]
        name: Option<String>,
        /// Remove the container's upper dir at exit (it is kept otherwise,
        /// until `lamina rm NAME`).
        #[arg(long)]
        rm: bool,
        /// Set KEY=VAL in the container; KEY alone takes lamina's value.
        #[arg(short = 'e', long = "env", value_name = "KEY[=VAL]")]
        env: Vec<String>,
        /// Bind-mount host path SRC at DST (both absolute), read-only with :ro.
        #[arg(short = 'v', long = "volume", value_name = "SRC:DST[:ro]")]
        volumes: Vec<String>,
        /// none (the default): only a loopback of its own; host: the
        /// host's network.
        #[arg(long, default_value = "none", value_name = "none|host")]
        net: String,
        /// Add a capability to docker's default set, which lamina runs
        /// without NET_RAW (e.g. --cap-add NET_RAW for ping).
        #[arg(long = "cap-add", value_name = "CAP")]
        cap_add: Vec<String>,
        /// no-new-privileges=false lets setuid binaries gain privileges
        /// (on by default); seccomp=unconfined drops the default seccomp
        /// profile (docker's rules).
        #[arg(long = "security-opt", value_name = "OPT")]
        security_opt: Vec<String>,
        /// User (uid, uid:gid, name or name:group), replacing the image's.
        #[arg(short = 'u', long)]
        user: Option<String>,
        /// Working directory, replacing the image's.
        #[arg(short = 'w', long)]
        workdir: Option<String>,
        /// Entrypoint, replacing the image's (and dropping its Cmd).
        #[arg(long)]
        entrypoint: Option<String>,
        /// Give the container a terminal.
        #[arg(short = 't', long)]
        tty: bool,
        /// Pass stdin on to the container (/dev/null otherwise).
        #[arg(short = 'i', long)]
        interactive: bool,
        /// Seconds between the stop signal and SIGKILL.
        #[arg(long, default_value = "10", value_name = "SECS")]
        stop_timeout: u64,
        /// Run state (mounts, bundle, runc's state).
        #[arg(long, env = "LAMINA_STATE_DIR", default_value = "/run/lamina")]
        state_dir: PathBuf,
        /// The OCI runtime.
        #[arg(long, default_value = "runc")]
        runtime: PathBuf,
    },
    /// Remove stopped containers' kept upper dirs (`lamina run` without --rm).
    Rm {
        /// Container names.
        #[arg(required = true)]
        names: Vec<String>,
        /// Cache directory.
        #[arg(long, env = "LAMINA_CACHE_DIR", default_value_os_t = default_cache_dir())]
        cache_dir: PathBuf,
        /// Run state.
        #[arg(long, env = "LAMINA_STATE_DIR", default_value = "/run/lamina")]
        state_dir: PathBuf,
    },
    /// Unmount a lamina mount (and stop its daemon).
    Umount {
        /// The mountpoint.
        mountpoint: PathBuf,
        /// Cache directory.
        #[arg(long, env = "LAMINA_CACHE_DIR", default_value_os_t = default_cache_dir())]
        cache_dir: PathBuf,
    },
    /// Show lazy mounts: bytes fetched and cached, misses, prefetch progress.
    Status {
        /// Cache directory.
        #[arg(long, env = "LAMINA_CACHE_DIR", default_value_os_t = default_cache_dir())]
        cache_dir: PathBuf,
        /// Print the figures as Prometheus metrics per image (OpenMetrics
        /// text, as `lamina snapshotter --metrics-address` serves them),
        /// e.g. for node_exporter's textfile collector.
        #[arg(long, conflicts_with = "json")]
        prometheus: bool,
    },
    /// Evict cache files no live mount uses, oldest first, down to a size.
    Gc {
        /// Largest cache size to keep, in bytes (suffixes K, M, G allowed);
        /// required here or as `max_size` in the config file's [gc].
        #[arg(long, value_parser = parse_size)]
        max_size: Option<u64>,
        /// Cache directory.
        #[arg(long, env = "LAMINA_CACHE_DIR", default_value_os_t = default_cache_dir())]
        cache_dir: PathBuf,
    },
    /// Serve containerd as a proxy snapshotter (snapshots gRPC on a unix
    /// socket): lamina images mount lazily, other images get overlayfs
    /// snapshots. See docs/containerd.md.
    Snapshotter {
        /// Root directory: snapshots, their state and the shared cache.
        #[arg(long, default_value = "/var/lib/lamina/snapshotter")]
        root: PathBuf,
        /// The socket containerd's `proxy_plugins` entry names.
        #[arg(long, default_value = "/run/lamina/snapshotter.sock")]
        address: PathBuf,
        /// Seconds a reader of a lamina image waits for missing data before
        /// getting EIO.
        #[arg(long, default_value_t = 60)]
        timeout: u64,
        /// What lamina mounts fetch with no reader waiting: none, pages,
        /// boot or all (as `lamina mount --prefetch`).
        #[arg(long, default_value = "boot", value_parser = ["none", "pages", "boot", "all"])]
        prefetch: String,
        /// Largest window fetched ahead of a container that reads the
        /// image in order (as `lamina mount --fill-ahead`); 0 turns it off.
        #[arg(long, default_value = "8M", value_parser = parse_size)]
        fill_ahead: u64,
        /// Largest shared library or executable fetched whole on its first
        /// miss (as `lamina mount --predict-max`); 0 predicts nothing.
        #[arg(long, value_name = "SIZE", default_value = "8M", value_parser = parse_size)]
        predict_max: u64,
        /// `auto`, `kernel` or `fuse`: how lamina images are mounted (as
        /// `lamina mount --mode`; auto decides once, at start).
        #[arg(long, value_name = "MODE", default_value = "auto", value_parser = MODES)]
        mode: String,
        /// Serve Prometheus metrics at GET /metrics on IP:PORT (e.g.
        /// 127.0.0.1:9464; port 0 picks one, logged at start) or on
        /// unix:/PATH.
        #[arg(long, value_name = "ADDR")]
        metrics_address: Option<MetricsAddress>,
        /// Keep the shared cache at most SIZE bytes (K, M, G suffixes):
        /// collected in the background, as `lamina gc` does, never what a
        /// live or starting mount uses. Unset: never collected.
        #[arg(long, value_name = "SIZE", value_parser = parse_size)]
        cache_max_size: Option<u64>,
    },
    /// Internal: the FUSE daemon of one mount.
    #[command(hide = true)]
    InternalFuse {
        /// Daemon config.
        config: PathBuf,
    },
    /// Internal: the fanotify holder of one lazy mount.
    #[command(hide = true)]
    InternalHolder {
        /// Daemon config.
        config: PathBuf,
    },
    /// Internal: the fetching worker of one lazy mount.
    #[command(hide = true)]
    InternalWorker {
        /// Daemon config.
        config: PathBuf,
        /// Inherited socket to the holder.
        fd: i32,
    },
    /// Show an image's layers, chunks, sizes and dedup ratio.
    Inspect {
        /// The image (lamina or plain OCI).
        image: String,
    },
}

/// The cache dir when none is given: `/var/lib/lamina` for the host's
/// root; for anyone else (a rootless FUSE mount, root of a user namespace
/// such as `podman unshare`'s) `$XDG_CACHE_HOME/lamina`, else
/// `~/.cache/lamina`.
fn default_cache_dir() -> PathBuf {
    if lamina_sys::is_host_root() {
        return PathBuf::from("/var/lib/lamina");
    }
    let from_env = |name: &str| {
        std::env::var_os(name)
            .map(PathBuf::from)
            .filter(|p| p.is_absolute())
    };
    from_env("XDG_CACHE_HOME")
        .or_else(|| from_env("HOME").map(|h| h.join(".cache")))
        .map_or_else(|| PathBuf::from("/var/lib/lamina"), |c| c.join("lamina"))
}

/// How an image is mounted and served: shared by `mount` and `run`.
#[derive(Debug, clap::Args)]
pub(crate) struct ServeArgs {
    /// Cache directory.
    #[arg(long, env = "LAMINA_CACHE_DIR", default_value_os_t = default_cache_dir())]
    pub(crate) cache_dir: PathBuf,
    /// Serve data on demand (default for docker:// images).
    #[arg(long, conflicts_with = "eager")]
    lazy: bool,
    /// Fetch all data before mounting (default for oci: images).
    #[arg(long)]
    eager: bool,
    /// Seconds a reader waits for missing data before getting EIO.
    #[arg(long, default_value = "60")]
    pub(crate) timeout: u64,
    /// Also fetch the chunks within this many bytes around each miss
    /// (cache-file offsets); 0 fetches only the chunks the read needs.
    #[arg(long, default_value = "0", value_parser = parse_size)]
    pub(crate) fill_window: u64,
    /// Largest window fetched ahead of a reader that reads the image in
    /// order (windows start at 512K and double); 0 turns it off.
    #[arg(long, default_value = "8M", value_parser = parse_size)]
    pub(crate) fill_ahead: u64,
    /// Never send a second copy of a slow range request (by default one
    /// goes out, on a fresh connection, when a request is slower than
    /// recent ones: their 95th percentile, 50 ms at least).
    #[arg(long)]
    pub(crate) no_hedge: bool,
    /// Largest shared library or executable fetched whole on its first
    /// miss (programs map these and touch their pages in no order a
    /// stream shows); 0 fetches only what is read. Mounts through a tar
    /// index never predict (measured slower there: docs/index.md).
    #[arg(long, value_name = "SIZE", default_value = "8M", value_parser = parse_size)]
    pub(crate) predict_max: u64,
    /// Same as `--prefetch all`.
    #[arg(long)]
    pub(crate) prefetch_all: bool,
    /// What to fetch with no reader waiting: `none`; `pages` (the
    /// image's boot pages); `boot` (boot pages, then the boot set's whole
    /// chunks once the start is over); `all` (then the rest of the image,
    /// yielding to every miss).
    #[arg(long, value_name = "MODE", default_value = "boot", value_parser = ["none", "pages", "boot", "all"])]
    pub(crate) prefetch: String,
    /// read_ahead_kb of the mount until all data is local (default: 0
    /// when recording or when the image has boot pages, else the
    /// kernel's).
    #[arg(long, value_name = "KB")]
    pub(crate) readahead: Option<u32>,
    /// `auto`, `kernel` (file-backed EROFS) or `fuse` (a FUSE daemon).
    #[arg(long, value_name = "MODE", default_value = "auto", value_parser = MODES)]
    pub(crate) mode: String,
    /// Mount an unmodified image through this tar index (`lamina index
    /// IMAGE DST`) instead of looking for one among the image's referrers;
    /// its subject must still be the image's manifest.
    #[arg(long, value_name = "REF")]
    pub(crate) index: Option<String>,
}

/// What `--mode` takes.
pub(crate) const MODES: [&str; 3] = ["auto", "kernel", "fuse"];

impl ServeArgs {
    /// Lazy settings, or None for an eager mount: lazy for docker://
    /// images and when recording, unless --eager.
    fn lazy_options(
        &self,
        image: &ImageRef,
        record_trace: Option<PathBuf>,
    ) -> Option<lamina_mount::LazyOptions> {
        let lazy = self.lazy
            || record_trace.is_some()
            || (!self.eager && matches!(image, ImageRef::Registry(_)));
        lazy.then(|| lamina_mount::LazyOptions {
            timeout: std::time::Duration::from_secs(self.timeout.max(1)),
            fill_window: self.fill_window,
            fill_ahead: self.fill_ahead,
            prefetch: match self.prefetch.as_str() {
                _ if self.prefetch_all => lamina_mount::Prefetch::All,
                p => parse_prefetch(p),
            },
            record_trace,
            readahead_kb: self.readahead,
            hedge: !self.no_hedge,
            predict_max: self.predict_max,
            ..lamina_mount::LazyOptions::default()
        })
    }
}

/// The cache dir as an absolute path: records compare paths, and the daemon
/// and the kernel (`device=`) must not depend on a working directory.
fn absolute(path: &std::path::Path) -> Result<PathBuf> {
    std::path::absolute(path).with_context(|| format!("directory {}", path.display()))
}

fn parse_prefetch(s: &str) -> lamina_mount::Prefetch {
    match s {
        "none" => lamina_mount::Prefetch::None,
        "pages" => lamina_mount::Prefetch::Pages,
        "all" => lamina_mount::Prefetch::All,
        _ => lamina_mount::Prefetch::Boot,
    }
}

/// `--metadata-frame-size`: a size (`4K`, `1M`, bytes) of 4 KiB..64 MiB.
fn parse_frame_size(s: &str) -> std::result::Result<u64, String> {
    let n = parse_size(s)?;
    match (4 << 10..=64 << 20).contains(&n) {
        true => Ok(n),
        false => Err(format!("{n} is not between 4 KiB and 64 MiB")),
    }
}

pub(crate) fn parse_chunk_size(s: &str) -> std::result::Result<u64, String> {
    let n = parse_size(s)?;
    if !n.is_power_of_two() || !(4096..=16 << 20).contains(&n) {
        return Err("must be a power of two between 4096 and 16777216".into());
    }
    Ok(n)
}

pub(crate) fn parse_size(s: &str) -> std::result::Result<u64, String> {
    let s = s.trim();
    let (num, mult) = match s.char_indices().last() {
        Some((i, c)) if c.is_ascii_alphabetic() => {
            let mult = match c.to_ascii_uppercase() {
                'K' => 1 << 10,
                'M' => 1 << 20,
                'G' => 1 << 30,
                'T' => 1u64 << 40,
                _ => return Err(format!("unknown size suffix in {s:?}")),
            };
            (&s[..i], mult)
        }
        _ => (s, 1),
    };
    num.parse::<u64>()
        .ok()
        .and_then(|n| n.checked_mul(mult))
        .ok_or_else(|| format!("bad size {s:?}"))
}

fn parse_ref(s: &str) -> Result<ImageRef> {
    s.parse::<ImageRef>()
        .with_context(|| format!("bad image reference {s:?}"))
}

/// Runs one command; the exit code on success (a container's for `run`).
pub fn run(args: Args) -> Result<u8> {
    // Absolute: a lazy mount's worker reads it long after this command ends.
    let ca_file = match &args.ca_file {
        Some(p) => {
            Some(std::path::absolute(p).with_context(|| format!("CA file {}", p.display()))?)
        }
        None => None,
    };
    let hosts_dir = std::path::absolute(&args.hosts_dir)
        .with_context(|| format!("hosts directory {}", args.hosts_dir.display()))?;
    let source = SourceOptions {
        insecure_hosts: args.insecure.clone(),
        tls_hosts: args.tls.clone(),
        ca_file,
        hosts: HostsConfig::new(hosts_dir),
        ..SourceOptions::default()
    };
    match args.command {
        Command::Convert {
            src,
            dst,
            chunk_size,
            zstd_level,
            pack_limit,
            format_version,
            work_dir,
            prefetch,
            metadata_frame_size,
        } => {
            let opts = ConvertOptions {
                build: BuildOptions {
                    chunk_bits: chunk_size.trailing_zeros() as u8,
                    zstd_level,
                    pack_limit,
                    paged: format_version == "4",
                },
                source,
                work_dir,
                prefetch_trace: prefetch,
                metadata_frame_size: metadata_frame_size.map(|n| n as usize),
            };
            let (src, dst) = (parse_ref(&src)?, parse_ref(&dst)?);
            let bar = progress_bar(args.json);
            let report = convert(&src, &dst, &opts, &|p| report_progress(&bar, p))
                .with_context(|| format!("converting {src} to {dst}"));
            bar.finish_and_clear();
            let report = report?;
            if args.json {
                print_json(&report)?;
            } else {
                let s = &report.stats;
                println!("converted {src} -> {dst} in {:.2} s", report.seconds);
                println!("  manifest     {}", report.manifest_digest);
                println!(
                    "  tree         {} entries, {} files, {} bytes",
                    s.entries, s.files, s.file_bytes
                );
                println!(
                    "  metadata     {} bytes EROFS ({} compressed), index {} bytes",
                    report.metadata_bytes, report.metadata_compressed_bytes, report.index_bytes
                );
                println!(
                    "  data         {} blobs, {} chunks stored, {} bytes -> {} compressed (source layers {})",
                    report.blobs.len(),
                    s.chunks_stored,
                    s.stored_bytes,
                    s.compressed_bytes,
                    report.source_layer_bytes
                );
                println!("  dedup ratio  {:.3}", report.dedup_ratio);
                if let Some(b) = &report.boot_pages {
                    println!(
                        "  boot pages   {} runs, {} bytes -> {} compressed",
                        b.extents, b.bytes, b.compressed_bytes
                    );
                }
                if s.confined_paths > 0 {
                    println!(
                        "  confined     {} hostile paths kept inside the image",
                        s.confined_paths
                    );
                }
            }
        }
        Command::Index {
            src,
            dst,
            span_size,
            prefetch,
        } => {
            let src = parse_ref(&src)?;
            let dst = dst.as_deref().map(parse_ref).transpose()?;
            let opts = IndexOptions {
                source,
                span_size,
                prefetch_trace: prefetch,
            };
            let bar = progress_bar(args.json);
            let report = index(&src, dst.as_ref(), &opts, &|layer| {
                bar.set_message(format!("layer {}", layer + 1));
            })
            .with_context(|| format!("indexing {src}"));
            bar.finish_and_clear();
            let reports = report?;
            if args.json {
                print_json(&reports)?;
            }
            for report in reports.iter().filter(|_| !args.json) {
                let platform = report.platform.as_deref().map(|p| format!(" ({p})"));
                println!(
                    "indexed {src}{} in {:.2} s",
                    platform.unwrap_or_default(),
                    report.seconds
                );
                println!(
                    "  index        {} -> {}",
                    report.manifest_digest, report.stored
                );
                println!(
                    "  size         {} bytes for {} bytes of layers ({} bytes of tar, {} inodes)",
                    report.artifact_bytes,
                    report.image_layer_bytes,
                    report.tar_bytes,
                    report.inodes
                );
                println!(
                    "  spans        {} ({} with a window)",
                    report.spans, report.windows
                );
            }
        }
        Command::Mount {
            image,
            mountpoint,
            serve,
            record_trace,
            suid,
            dev,
        } => {
            let image = parse_ref(&image)?;
            let opts = MountOptions {
                cache_dir: absolute(&serve.cache_dir)?,
                source,
                privileges: Privileges { suid, dev },
                index: serve.index.as_deref().map(parse_ref).transpose()?,
            };
            let lazy = serve.lazy_options(&image, record_trace);
            let (mode, why) = mount_mode(&serve.mode, &opts.cache_dir, lazy.is_some())?;
            tracing::info!("mounting with the {mode} path: {why}");
            let info = lamina_mount::mount(&image, &mountpoint, &opts, lazy.as_ref(), mode)
                .with_context(|| format!("mounting {image} at {}", mountpoint.display()))?;
            if args.json {
                let mut report = serde_json::to_value(&info)?;
                report["mode"] = serde_json::json!(mode);
                report["mode_reason"] = serde_json::json!(why);
                print_json(&report)?;
            } else {
                println!(
                    "mounted {image} at {} ({} blobs, {} bytes fetched)",
                    mountpoint.display(),
                    info.blob_paths.len(),
                    info.fetched_bytes
                );
            }
        }
        Command::Run {
            image,
            args: cmd,
            serve,
            name,
            rm,
            env,
            volumes,
            net,
            cap_add,
            security_opt,
            user,
            workdir,
            entrypoint,
            tty,
            interactive,
            stop_timeout,
            state_dir,
            runtime,
        } => {
            let image = parse_ref(&image)?;
            let volumes = volumes
                .iter()
                .map(|v| v.parse::<lamina_run::Volume>())
                .collect::<Result<Vec<_>, _>>()?;
            let lazy = serve.lazy_options(&image, None);
            let cache_dir = absolute(&serve.cache_dir)?;
            let (mode, why) = mount_mode(&serve.mode, &cache_dir, lazy.is_some())?;
            tracing::info!("mounting with the {mode} path: {why}");
            let opts = lamina_run::RunOptions {
                lazy,
                mode,
                image,
                // The image is mounted in lamina run's private (0700) state
                // dir, for runc: setuid binaries and device nodes work in
                // the container as on overlayfs.
                mount: MountOptions {
                    cache_dir,
                    source,
                    privileges: Privileges {
                        suid: true,
                        dev: true,
                    },
                    index: serve.index.as_deref().map(parse_ref).transpose()?,
                },
                state_dir: absolute(&state_dir)?,
                runc: lamina_run::container::find_runtime(&runtime)?,
                name,
                remove: rm,
                env,
                volumes,
                network: net.parse()?,
                security: security(&cap_add, &security_opt)?,
                user,
                workdir,
                entrypoint,
                args: cmd,
                tty,
                interactive,
                stop_timeout: std::time::Duration::from_secs(stop_timeout),
            };
            let report = lamina_run::run(&opts)?;
            for w in &report.cleanup_warnings {
                eprintln!("lamina: {w}");
            }
            if args.json {
                eprintln!("{}", serde_json::to_string(&report)?);
            }
            return Ok(u8::try_from(report.exit_code).unwrap_or(125));
        }
        Command::Rm {
            names,
            cache_dir,
            state_dir,
        } => {
            for name in names {
                let removed =
                    lamina_run::remove(&absolute(&state_dir)?, &absolute(&cache_dir)?, &name)?;
                if args.json {
                    print_json(&serde_json::json!({"removed": name, "upper_dir": removed}))?;
                } else {
                    println!("{name}");
                }
            }
        }
        Command::Umount {
            mountpoint,
            cache_dir,
        } => {
            let cache_dir = absolute(&cache_dir)?;
            // A holder removes its run dir (and status) as soon as it sees
            // the unmount, which may be before we look: keep what it last
            // wrote before unmounting.
            let before = lamina_mount::last_status(&cache_dir, &mountpoint);
            lamina_mount::unmount(&mountpoint)?;
            let mut done = lamina_mount::finish_unmount(&cache_dir, &mountpoint);
            if done.last_status.is_none() {
                done.last_status = before;
            }
            if let Some(pid) = done.still_serving {
                eprintln!(
                    "lamina: {} is unmounted, but the filesystem lives on (another mount or an \
                     overlay uses it); its holder (pid {pid}) serves it until the last user is gone",
                    mountpoint.display()
                );
            }
            if args.json {
                let status: serde_json::Value = done
                    .last_status
                    .and_then(|s| serde_json::from_str(&s).ok())
                    .unwrap_or(serde_json::Value::Null);
                print_json(&serde_json::json!({
                    "unmounted": mountpoint,
                    "last_status": status,
                    "holder_still_serving": done.still_serving,
                }))?;
            } else {
                println!("unmounted {}", mountpoint.display());
            }
        }
        Command::Status {
            cache_dir,
            prometheus: true,
        } => std::io::stdout().write_all(mount_metrics(&absolute(&cache_dir)?).as_bytes())?,
        Command::Status { cache_dir, .. } => status(&absolute(&cache_dir)?, args.json)?,
        Command::Gc {
            max_size,
            cache_dir,
        } => {
            let max_size = max_size.ok_or(ConfigError::Missing(
                "gc needs --max-size SIZE (or max_size in the config file's [gc])",
            ))?;
            let cache_dir = absolute(&cache_dir)?;
            let report = lamina_mount::gc(&cache_dir, max_size)
                .with_context(|| format!("collecting {}", cache_dir.display()))?;
            if args.json {
                print_json(&report)?;
            } else {
                println!(
                    "evicted {} files ({} bytes); {} bytes kept, {} files in use",
                    report.evicted.len(),
                    report.freed_bytes,
                    report.kept_bytes,
                    report.in_use
                );
            }
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
        } => lamina_snapshotter::serve(lamina_snapshotter::Options {
            mode: match mode.as_str() {
                "kernel" => Some(Mode::Kernel),
                "fuse" => Some(Mode::Fuse),
                _ => None,
            },
            root: absolute(&root)?,
            address: absolute(&address)?,
            source,
            lazy: lamina_mount::LazyOptions {
                timeout: std::time::Duration::from_secs(timeout.max(1)),
                prefetch: parse_prefetch(&prefetch),
                fill_ahead,
                predict_max,
                ..lamina_mount::LazyOptions::default()
            },
            metrics_address,
            cache_max_size,
        })?,
        Command::InternalFuse { config } => {
            lamina_fuse::serve(&lamina_fuse::load_config(&config)?)?
        }
        Command::InternalHolder { config } => lamina_daemon::holder::run_holder(&config)?,
        Command::InternalWorker { config, fd } => {
            let sock = lamina_sys::adopt_inherited_fd(fd)?;
            lamina_daemon::worker::run_worker(&config, sock)?
        }
        Command::Inspect { image } => {
            let image = parse_ref(&image)?;
            inspect(&image, &source, args.json)?;
        }
    }
    Ok(0)
}

impl Args {
    /// Whether this is a mount daemon (which reads no config file: it runs
    /// on what its mount was given).
    pub fn is_daemon(&self) -> bool {
        matches!(
            self.command,
            Command::InternalHolder { .. }
                | Command::InternalWorker { .. }
                | Command::InternalFuse { .. }
        )
    }

    /// Whether this is `lamina run` (whose failures exit with docker's
    /// codes instead of the table in the crate docs).
    pub fn is_run(&self) -> bool {
        matches!(self.command, Command::Run { .. })
    }
}

fn inspect(image: &ImageRef, source: &SourceOptions, json: bool) -> Result<()> {
    let src = open_source(image, source).with_context(|| format!("opening {image}"))?;
    let img = src.image();
    let ann = &img.manifest.annotations;
    let num = |key: &str| ann.get(key).and_then(|v| v.parse::<u64>().ok());
    let layers = match LaminaLayers::from_manifest(&img.manifest) {
        Ok(l) => l,
        Err(_) => {
            // A plain image: list its layers.
            let layers: Vec<_> = img
                .layers
                .iter()
                .map(|l| serde_json::json!({"digest": l.descriptor.digest.to_string(), "media_type": l.descriptor.media_type, "size": l.descriptor.size, "diff_id": l.diff_id.to_string()}))
                .collect();
            let doc = serde_json::json!({"image": image.to_string(), "lamina": false, "manifest_digest": img.manifest_digest.to_string(), "layers": layers});
            if json {
                print_json(&doc)?;
            } else {
                println!("{image}: not a lamina image ({} layers)", layers.len());
                for l in &img.layers {
                    println!(
                        "  {} {} {}",
                        l.descriptor.digest, l.descriptor.size, l.descriptor.media_type
                    );
                }
            }
            return Ok(());
        }
    };
    let index = artifact::read_index(src.as_ref(), &layers)?;
    let chunks: usize = index.blobs.iter().map(|b| b.chunk_count).sum();
    // Both index versions give each blob's data size (a paged one in its
    // blob table).
    let stored: u64 = index.blobs.iter().filter_map(|b| b.data_size).sum();
    let compressed: u64 = index.blobs.iter().map(|b| b.compressed_size).sum();
    let metadata_bytes = layers
        .metadata
        .annotations
        .get(artifact::ANNOTATION_UNCOMPRESSED_SIZE)
        .and_then(|v| v.parse::<u64>().ok());
    let file_bytes = num(artifact::ANNOTATION_STATS_FILE_BYTES);
    let referenced = num(artifact::ANNOTATION_STATS_REFERENCED_BYTES);
    // Boot pages: the segments' sizes summed (None when one lacks its size).
    let boot_bytes = (!layers.boot.is_empty())
        .then(|| {
            layers
                .boot
                .iter()
                .map(|b| {
                    b.annotations
                        .get(artifact::ANNOTATION_UNCOMPRESSED_SIZE)?
                        .parse::<u64>()
                        .ok()
                })
                .sum::<Option<u64>>()
        })
        .flatten();
    let boot_compressed =
        (!layers.boot.is_empty()).then(|| layers.boot.iter().map(|b| b.size).sum::<u64>());
    // Segments: the frames of the boot-pages layers (one per layer before frames).
    let boot_segments = artifact::boot_layers(&layers.boot, &index.blobs)
        .map(|l| l.iter().map(|b| b.frames.len()).sum::<usize>())
        .ok();
    let doc = serde_json::json!({
        "image": image.to_string(),
        "lamina": true,
        "manifest_digest": img.manifest_digest.to_string(),
        "source_manifest_digest": ann.get(artifact::ANNOTATION_SOURCE),
        "format": num(artifact::ANNOTATION_FORMAT),
        // Version 2: each blob ends with its chunk table.
        "paged_index": index.inline.is_empty() && !index.blobs.is_empty(),
        "chunk_size": num(artifact::ANNOTATION_CHUNK_SIZE),
        "pack_limit": num(artifact::ANNOTATION_PACK_LIMIT),
        "entries": num(artifact::ANNOTATION_STATS_ENTRIES),
        "files": num(artifact::ANNOTATION_STATS_FILES),
        "file_bytes": file_bytes,
        "metadata_bytes": metadata_bytes,
        "metadata_compressed_bytes": layers.metadata.size,
        "index_compressed_bytes": layers.index.size,
        "boot_set_chunks": index.prefetch.len(),
        "boot_pages_bytes": boot_bytes,
        "boot_pages_compressed_bytes": boot_compressed,
        "boot_pages_segments": boot_segments,
        "chunks": chunks,
        "stored_bytes": stored,
        "compressed_bytes": compressed,
        "referenced_bytes": referenced,
        "dedup_ratio": referenced.map(|f| if stored == 0 { 1.0 } else { f as f64 / stored as f64 }),
        "blobs": index.blobs.iter().zip(&layers.blobs).map(|(b, d)| serde_json::json!({
            "digest": d.digest.to_string(), "compressed_bytes": b.compressed_size,
            "cache_bytes": b.cache_size, "chunks": b.chunk_count,
        })).collect::<Vec<_>>(),
    });
    if json {
        return print_json(&doc);
    }
    println!("{image}: lamina image {}", img.manifest_digest);
    println!(
        "  tree      {} entries, {} files, {} bytes",
        doc["entries"], doc["files"], doc["file_bytes"]
    );
    println!(
        "  metadata  {} bytes EROFS ({} compressed)",
        doc["metadata_bytes"], layers.metadata.size
    );
    println!(
        "  chunks    {chunks} stored, {stored} bytes, {compressed} compressed, chunk size {}",
        doc["chunk_size"]
    );
    println!("  dedup     {}", doc["dedup_ratio"]);
    if let Some(compressed) = boot_compressed {
        println!(
            "  boot      {} chunks; boot pages {} bytes ({compressed} compressed, {} segments)",
            index.prefetch.len(),
            doc["boot_pages_bytes"],
            layers.boot.len()
        );
    }
    for (b, d) in index.blobs.iter().zip(&layers.blobs) {
        println!(
            "  blob      {} {} bytes, {} chunks, cache {} bytes",
            d.digest, b.compressed_size, b.chunk_count, b.cache_size
        );
    }
    Ok(())
}

fn status(cache_dir: &std::path::Path, json: bool) -> Result<()> {
    let mut mounts = Vec::new();
    if let Ok(dir) = std::fs::read_dir(cache_dir.join("mounts")) {
        for entry in dir.flatten() {
            let read = |name: &str| -> Option<serde_json::Value> {
                serde_json::from_slice(&std::fs::read(entry.path().join(name)).ok()?).ok()
            };
            let (Some(config), Some(ready)) = (read("config.json"), read("ready")) else {
                continue;
            };
            let alive = ready["pid"]
                .as_u64()
                .is_some_and(|p| std::path::Path::new(&format!("/proc/{p}")).exists());
            mounts.push(serde_json::json!({
                "mountpoint": config["mountpoint"],
                "image": config["image"],
                "manifest_digest": config["manifest_digest"],
                "holder_pid": ready["pid"],
                "alive": alive,
                "status": read("status.json"),
                // A FUSE daemon's counters (passthrough opens, reads served).
                "fuse": read(lamina_mount::FUSE_STATUS),
            }));
        }
    }
    if json {
        return print_json(&mounts);
    }
    if mounts.is_empty() {
        println!("no lazy mounts");
    }
    for m in &mounts {
        let s = &m["status"];
        println!(
            "{} {} ({})",
            m["mountpoint"],
            m["image"],
            if m["alive"] == true {
                "serving"
            } else {
                "holder gone"
            }
        );
        println!(
            "  cached {} / {} bytes, fetched {} bytes in {} requests, {} misses ({} failed), prefetch {}/{}",
            s["cached_bytes"], s["total_bytes"], s["fetched_bytes"], s["requests"],
            s["misses"], s["failed_misses"], s["prefetch_done"], s["prefetch_total"]
        );
    }
    Ok(())
}

/// The lazy mounts under `cache_dir` as metrics (no `# EOF`: a textfile
/// collector may concatenate files).
fn mount_metrics(cache_dir: &std::path::Path) -> String {
    let mut registry = prometheus_client::registry::Registry::default();
    registry.register_collector(Box::new(lamina_mount::metrics::MountsCollector::new(
        cache_dir.to_path_buf(),
    )));
    let mut text = String::new();
    // Writing into a String cannot fail.
    let _ = prometheus_client::encoding::text::encode_registry(&mut text, &registry);
    text
}

/// The mount path `asked` (auto, kernel or fuse) comes to on this host for
/// a cache in `cache_dir`, and why.
fn mount_mode(asked: &str, cache_dir: &std::path::Path, lazy: bool) -> Result<(Mode, String)> {
    Ok(match asked {
        "kernel" => (Mode::Kernel, "--mode kernel".into()),
        "fuse" => (Mode::Fuse, "--mode fuse".into()),
        _ => {
            // The cache dir's filesystem is part of the choice.
            lamina_fetch::private::private_dir(cache_dir)
                .with_context(|| format!("cache dir {}", cache_dir.display()))?;
            lamina_mount::choose_mode(&lamina_mount::host_facts(cache_dir), lazy)
        }
    })
}

fn print_json(value: &impl serde::Serialize) -> Result<()> {
    let mut out = std::io::stdout().lock();
    serde_json::to_writer_pretty(&mut out, value)?;
    writeln!(out)?;
    Ok(())
}

fn progress_bar(json: bool) -> ProgressBar {
    if json || !std::io::stderr().is_terminal() {
        return ProgressBar::hidden();
    }
    let bar = ProgressBar::new_spinner();
    bar.set_style(
        ProgressStyle::with_template("{spinner} {msg} {bytes} {binary_bytes_per_sec}")
            .unwrap_or_else(|_| ProgressStyle::default_spinner()),
    );
    bar
}

fn report_progress(bar: &ProgressBar, p: Progress) {
    match p {
        Progress::Layer { index, total, .. } => {
            bar.set_message(format!("layer {}/{total}", index + 1));
            bar.set_position(0);
        }
        Progress::Bytes(n) => bar.set_position(n),
        Progress::Writing => bar.set_message("writing"),
    }
}

/// `lamina run`'s `--cap-add` and `--security-opt` over the safe defaults.
fn security(cap_add: &[String], opts: &[String]) -> anyhow::Result<lamina_run::Security> {
    let mut security = lamina_run::Security::default();
    for cap in cap_add {
        security
            .cap_add
            .push(lamina_run::config::parse_capability(cap)?);
    }
    for opt in opts {
        lamina_run::config::apply_security_opt(opt, &mut security)?;
    }
    Ok(security)
}
