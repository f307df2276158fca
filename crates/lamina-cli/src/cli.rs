//! Arguments and the glue from them to library calls.

use std::io::Write;
use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::{Parser, Subcommand};
use lamina_oci::{HostsConfig, ImageRef, SourceOptions};
use lamina_snapshotter::metrics::MetricsAddress;

use crate::config::LogFormat;
use crate::size::{parse_chunk_size, parse_frame_size, parse_size};

mod apply;
mod commands;
mod show;

pub(crate) use apply::apply;
use show::{mount_metrics, status};

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
    /// Floor rate of a registry answer (bytes per second; K, M suffixes):
    /// each answer may take the request timeout plus its size at this rate,
    /// then it is ended, so a registry that drips bytes cannot hold a
    /// request (and what waits on it) for ever.
    #[arg(long, global = true, value_name = "RATE", default_value = "64K", value_parser = parse_size)]
    pub(crate) registry_min_rate: u64,
    /// What a mount does with an unmodified image's tar index that nothing
    /// this node trusts vouches for (not bound to the image, not named or
    /// pinned by digest): `enforce` refuses it (the snapshotter then gives
    /// the image overlayfs), `audit` uses it and logs a warning.
    #[arg(long, global = true, value_name = "MODE", default_value = "enforce", value_parser = ["enforce", "audit"])]
    pub(crate) index_policy: String,
    /// A tar index manifest (sha256:...) this node vouches for: mounts use
    /// it when it is listed as a referrer of the image. Repeatable.
    #[arg(long = "trust-index", global = true, value_name = "DIGEST")]
    pub(crate) trusted_indexes: Vec<String>,
    /// A cosign public key (ECDSA P-256 PEM, `cosign.pub`) whose
    /// signatures vouch for tar indexes: a referrer index signed with it
    /// (`cosign sign --key cosign.key REPO@INDEX_DIGEST`) is used. Checked
    /// offline. Repeatable.
    #[arg(long = "trust-index-key", global = true, value_name = "FILE")]
    pub(crate) index_keys: Vec<PathBuf>,
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
        /// Boot set without a recorded start: the pages every start of this
        /// program reads, known from the image (its ELF headers, symbol and
        /// relocation tables, writable data and constructors, the same of
        /// the libraries it needs, the dynamic loader; a CPython
        /// interpreter's own start-up modules). A name is searched on the
        /// image's PATH. Repeat for more; not with --prefetch.
        #[arg(long, value_name = "PROGRAM", conflicts_with = "prefetch")]
        boot_exec: Vec<String>,
        /// Bytes of metadata per zstd frame (4 KiB..64 MiB; default 1M): a
        /// lazy FUSE mount decompresses the frames as they are needed.
        #[arg(long, hide = true, value_parser = parse_frame_size)]
        metadata_frame_size: Option<u64>,
    },
    /// Index an unmodified image for lazy mounts: no conversion, no second
    /// copy. Reads each layer once and stores a small artifact (EROFS
    /// metadata pointing into the layers' tars, random-access points into
    /// their compressed streams) as an OCI referrer of the image in its own
    /// repository, bound to the image by an image index under its tag (the
    /// image's manifests are untouched); or at DST.
    Index {
        /// The image to index (its manifests stay as they are).
        src: String,
        /// Where the index goes instead: oci:DIR[:TAG] or docker://HOST/REPO[:TAG]
        /// (then name it with --index when mounting).
        dst: Option<String>,
        /// Compressed bytes between random-access points: a miss fetches
        /// about this much, and the window of a gzip point (the part of the
        /// 32 KiB of history its span reads, about 2 KiB stored, fetched only
        /// with its span). Spans grow where windows would cost more than 2%
        /// of the layer.
        #[arg(long, default_value = "64K", value_parser = parse_size)]
        span_size: u64,
        /// A trace recorded through a mount of this image's index (`lamina
        /// mount --record-trace FILE`): its spans become the boot set and
        /// the pages it read boot pages in the index.
        #[arg(long, value_name = "TRACE")]
        prefetch: Option<PathBuf>,
        /// Boot set without a recorded start, as `lamina convert
        /// --boot-exec`: the pages every start of this program reads, known
        /// from the image (read back from its layers as ranges: an oci: or
        /// docker:// source). Repeat for more; not with --prefetch.
        #[arg(long, value_name = "PROGRAM", conflicts_with = "prefetch")]
        boot_exec: Vec<String>,
        /// Leave the image's tag as it is: the index is only a referrer,
        /// which a mount uses only where the node's policy pins it
        /// (`--index REPO@DIGEST`, `[index] pinned`) or is in audit mode.
        /// By default the index is bound to the image: an image index that
        /// lists the image's manifests and the index replaces the tag, so
        /// the tag's digest covers the index (docs/index.md).
        #[arg(long)]
        no_bind: bool,
        /// Bytes of metadata per zstd frame (4 KiB..64 MiB; default 1M), as
        /// for `lamina convert`.
        #[arg(long, hide = true, value_parser = parse_frame_size)]
        metadata_frame_size: Option<u64>,
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
        /// Most processes in the container (podman's default, 2048); 0 or
        /// -1: no limit (docker's default).
        #[arg(
            long,
            value_name = "N",
            default_value = "2048",
            allow_hyphen_values = true
        )]
        pids_limit: i64,
        /// Run the container in a user namespace whose ids 0..SIZE are
        /// host ids HOST..HOST+SIZE (SIZE: 65536 by default): its root is
        /// no root on the host. The image is shown shifted through an
        /// idmapped mount (kernel path, --net none). Give each tenant a
        /// range of its own, as /etc/subuid does.
        #[arg(long, value_name = "HOST[:SIZE]", value_parser = parse_userns)]
        userns: Option<lamina_run::spec::IdRange>,
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
        /// Fetch the rest of a blob a start without a boot set reads much
        /// of, beside its misses (as `lamina mount --fetch-rests`).
        #[arg(long)]
        fetch_rests: bool,
        /// `auto`, `kernel` or `fuse`: how lamina images are mounted (as
        /// `lamina mount --mode`; auto decides once, at start).
        #[arg(long, value_name = "MODE", default_value = "auto", value_parser = MODES)]
        mode: String,
        /// Mount lamina images with `--share-files` (kernel path): every
        /// file with the same bytes in any image of a trust domain is read
        /// through one page cache.
        #[arg(long)]
        share_files: bool,
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
        /// Free space of the cache filesystem that fills no container
        /// waits for leave to the reads containers wait on (as `lamina
        /// mount --cache-reserve`; default: a tenth of it, at most 1G).
        #[arg(long, value_name = "SIZE", value_parser = parse_size)]
        cache_reserve: Option<u64>,
        /// Allocate each lamina mount's cache files whole when it mounts
        /// (as `lamina mount --reserve-space`): an image that does not fit
        /// is refused at pull time, and no image's fills can make
        /// another's reads fail for want of space.
        #[arg(long)]
        reserve_space: bool,
        /// Serve the CRI image service on the snapshotter's socket too,
        /// forwarding every call to containerd's socket SOCKET: point the
        /// kubelet's --image-service-endpoint here, and the lamina mounts
        /// of a pod's images fetch with the pull secrets the pod brought
        /// (stargz's CRI keychain). Unset: the node's credentials only.
        #[arg(long, value_name = "SOCKET")]
        cri_keychain: Option<PathBuf>,
        /// A tenant's cache dir: lamina mounts of images under PREFIX
        /// (HOST or HOST/REPO-PREFIX), or with `secret:USER@HOST` of
        /// HOST's images a pod pulled with a pull secret of USER (needs
        /// --cri-keychain), keep their cache there, not in the shared
        /// cache; bound it with a filesystem or project quota of its own.
        /// Repeatable; a secret's tenant wins, then the longest prefix.
        #[arg(long = "tenant-cache", value_name = "PREFIX=DIR")]
        tenant_caches: Vec<lamina_snapshotter::tenants::TenantCache>,
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
        /// Also list every chunk of every blob (its digest, sizes and
        /// offsets; `--json` only). Reads each blob up to its chunk table.
        #[arg(long)]
        chunks: bool,
    },
}

/// `--userns HOST[:SIZE]`: SIZE ids from host id HOST (65536 by default).
fn parse_userns(s: &str) -> std::result::Result<lamina_run::spec::IdRange, String> {
    let (host, size) = s.split_once(':').unwrap_or((s, "65536"));
    let number = |v: &str| {
        v.trim()
            .parse::<u32>()
            .map_err(|_| format!("{v:?} is no id"))
    };
    lamina_run::spec::IdRange::new(number(host)?, number(size)?)
}

#[cfg(test)]
#[test]
fn userns_ranges_are_above_root_and_fit() {
    let r = parse_userns("100000").unwrap();
    assert_eq!((r.host, r.size), (100_000, 65_536));
    let r = parse_userns("200000:1000").unwrap();
    assert_eq!((r.host, r.size), (200_000, 1_000));
    for bad in ["0:65536", "100000:0", "4294967295:2", "x", "1:y"] {
        assert!(parse_userns(bad).is_err(), "{bad}");
    }
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
    /// Share files by content with the other images mounted this way
    /// from the same trust domain: one page cache for each file with
    /// the same bytes, whatever image or layer it came in (an overlayfs
    /// of the image's metadata over content-addressed objects; Linux
    /// 6.8+). The kernel path only, for now.
    #[arg(long)]
    pub(crate) share_files: bool,
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
    /// Fetch the rest of a blob a start without a boot set reads much of,
    /// in large ranges beside its misses, once the misses in it waited as
    /// long as the rest takes at the link's rate (30 MB/s or more): fewer
    /// round trips for more bytes (docs/lazy.md, "The rest of a blob").
    #[arg(long)]
    pub(crate) fetch_rests: bool,
    /// Free space of the cache filesystem that fills no reader waits for
    /// (prefetches, reads ahead, predictions) leave to the reads readers
    /// wait on, this mount's and every other's (default: a tenth of the
    /// filesystem, at most 1G).
    #[arg(long, value_name = "SIZE", value_parser = parse_size)]
    pub(crate) cache_reserve: Option<u64>,
    /// Allocate the image's cache files whole when mounting, as an
    /// overlayfs snapshot takes its space at pull time: the mount is
    /// refused if the cache has no room, and no fill of it can later fail
    /// for want of space or take the space another mount's fills need.
    #[arg(long)]
    pub(crate) reserve_space: bool,
    /// Same as `--prefetch all`.
    #[arg(long)]
    pub(crate) prefetch_all: bool,
    /// What to fetch with no reader waiting: `none`; `pages` (the
    /// image's boot pages); `boot` (boot pages, then the boot set's whole
    /// chunks once the start is over); `all` (then, once the start is
    /// over, the rest of the image, yielding to every miss).
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

/// The node's policy for tar indexes, from `--index-policy` and
/// `--trust-index` (or the config's `[index]`).
fn index_trust(args: &Args) -> Result<lamina_mount::IndexTrust> {
    let pinned = args
        .trusted_indexes
        .iter()
        .map(|d| {
            lamina_oci::Digest::parse(d).with_context(|| format!("--trust-index {d}: not a digest"))
        })
        .collect::<Result<Vec<_>>>()?;
    let keys = args
        .index_keys
        .iter()
        .map(|path| {
            let pem = std::fs::read_to_string(path)
                .with_context(|| format!("--trust-index-key {}", path.display()))?;
            lamina_oci::cosign::TrustedKey::from_pem(&path.display().to_string(), &pem)
                .map_err(anyhow::Error::msg)
        })
        .collect::<Result<Vec<_>>>()?;
    Ok(lamina_mount::IndexTrust {
        audit: args.index_policy == "audit",
        pinned,
        keys,
    })
}

/// What `--mode` takes.
pub(crate) const MODES: [&str; 3] = ["auto", "kernel", "fuse"];

impl ServeArgs {
    /// `--share-files` where the mount can share: on the kernel path.
    pub(crate) fn share_files(
        &self,
        mode: lamina_mount::Mode,
    ) -> Result<bool, crate::config::ConfigError> {
        if self.share_files && mode != lamina_mount::Mode::Kernel {
            return Err(crate::config::ConfigError::Invalid(format!(
                "--share-files needs the kernel path (this mount would be served through \
                 {mode}): add --mode kernel"
            )));
        }
        Ok(self.share_files)
    }

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
            fetch_rests: self.fetch_rests,
            cache_reserve: self.cache_reserve,
            reserve_space: self.reserve_space,
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
        min_rate: args.registry_min_rate,
        ..SourceOptions::default()
    };
    let json = args.json;
    let trust = index_trust(&args)?;
    match args.command {
        c @ Command::Convert { .. } => commands::convert_image(c, source, json)?,
        c @ Command::Index { .. } => commands::index_image(c, source, json)?,
        c @ Command::Mount { .. } => commands::mount_image(c, (source, trust), json)?,
        c @ Command::Run { .. } => return commands::run_container(c, (source, trust), json),
        c @ Command::Rm { .. } => commands::remove_containers(c, json)?,
        c @ Command::Umount { .. } => commands::unmount(c, json)?,
        Command::Status {
            cache_dir,
            prometheus: true,
        } => std::io::stdout().write_all(mount_metrics(&absolute(&cache_dir)?).as_bytes())?,
        Command::Status { cache_dir, .. } => status(&absolute(&cache_dir)?, args.json)?,
        c @ Command::Gc { .. } => commands::collect_garbage(c, json)?,
        c @ Command::Snapshotter { .. } => commands::serve_snapshotter(c, (source, trust))?,
        Command::InternalFuse { config } => {
            lamina_fuse::serve(&lamina_fuse::load_config(&config)?)?
        }
        Command::InternalHolder { config } => lamina_daemon::holder::run_holder(&config)?,
        Command::InternalWorker { config, fd } => {
            let sock = lamina_sys::adopt_inherited_fd(fd)?;
            lamina_daemon::worker::run_worker(&config, sock)?
        }
        c @ Command::Inspect { .. } => commands::inspect_image(c, source, json)?,
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

fn print_json(value: &impl serde::Serialize) -> Result<()> {
    let mut out = std::io::stdout().lock();
    serde_json::to_writer_pretty(&mut out, value)?;
    writeln!(out)?;
    Ok(())
}
