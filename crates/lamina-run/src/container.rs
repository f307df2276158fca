//! One container's life: claim the name, mount the image (as `lamina mount`
//! does), put an overlay with a private upper dir on it, run runc in the
//! foreground, stop it on SIGINT/SIGTERM, and tear everything down.
//!
//! Layout (all directories 0700):
//! ```text
//! STATE/containers/NAME/   config.json (the bundle), lower/ (the lamina mount),
//!                          rootfs/ (the overlay), runc.log, hosts, hostname, resolv.conf
//! STATE/runc/              runc's --root, shared by lamina's containers
//! CACHE/containers/NAME/   upper/, work/ (kept without --rm)
//! ```
//!
//! With `--userns HOST:SIZE` the container's root is host uid HOST, which
//! must reach its root filesystem: STATE and STATE/userns/ are 0711 (passed
//! through, never listed), and the container's rootfs/, hosts, hostname and
//! resolv.conf are in `STATE/userns/NAME/`, 0700 and owned by HOST. The
//! overlay's lower is then `STATE/containers/NAME/lower-ids/`, an idmapped
//! mount of lower/ whose files show owned by HOST + their ids.

use std::fs;
use std::io::Read;
use std::os::unix::fs::{DirBuilderExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use lamina_mount::{LazyOptions, MountError, MountOptions};
use lamina_oci::{open_source, ImageRef, OciError};
use rustix::fs::{Mode, OFlags, ResolveFlags};
use rustix::mount::{MountFlags, UnmountFlags};
use signal_hook::consts::{SIGHUP, SIGINT, SIGQUIT, SIGTERM};
use signal_hook::iterator::Signals;

use crate::config::{self, ConfigError, ImageConfig, Network, Volume};
use crate::runc::{self, Runc, Stdio3};
use crate::spec::{runtime_spec, SpecInput};

/// Largest `/etc/passwd` or `/etc/group` read from an image.
const MAX_ACCOUNT_FILE: u64 = 4 << 20;

/// How often the wait loop looks at runc and at pending signals.
const POLL: Duration = Duration::from_millis(20);

/// Everything `lamina run` was asked for.
#[derive(Debug, Clone)]
pub struct RunOptions {
    /// The lamina image.
    pub image: ImageRef,
    /// Cache dir and registry settings, as for `lamina mount`.
    pub mount: MountOptions,
    /// Serve the image lazily with these settings; None fetches it first.
    pub lazy: Option<LazyOptions>,
    /// Kernel or FUSE, as `lamina mount --mode` decided.
    pub mode: lamina_mount::Mode,
    /// Root of lamina's run state (`/run/lamina`).
    pub state_dir: PathBuf,
    /// The runc binary.
    pub runc: PathBuf,
    /// Container name (also runc's id and the hostname); None picks one.
    pub name: Option<String>,
    /// Remove the upper dir at exit.
    pub remove: bool,
    /// `-e` flags in order.
    pub env: Vec<String>,
    /// `-v` binds.
    pub volumes: Vec<Volume>,
    /// `--net`.
    pub network: Network,
    /// Capabilities, `noNewPrivileges`, seccomp (`--cap-add`,
    /// `--security-opt`).
    pub security: crate::spec::Security,
    /// `--user`, replacing the image's `User`.
    pub user: Option<String>,
    /// `--workdir`, replacing the image's `WorkingDir`.
    pub workdir: Option<String>,
    /// `--entrypoint`, replacing the image's `Entrypoint` (and its `Cmd`).
    pub entrypoint: Option<String>,
    /// Arguments after `--`, replacing the image's `Cmd`.
    pub args: Vec<String>,
    /// `-t`: a terminal.
    pub tty: bool,
    /// `-i`: stdin passed on.
    pub interactive: bool,
    /// After a stop signal, how long the container has before SIGKILL.
    pub stop_timeout: Duration,
    /// `--userns`: the container's ids are this host range (its root is
    /// no host root); `None`: the host's ids, as docker's default.
    pub userns: Option<crate::spec::IdRange>,
}

/// Why `lamina run` failed (its exit code: [`RunError::exit_code`]).
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    /// The image config or the flags.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// Opening the image.
    #[error(transparent)]
    Oci(#[from] OciError),
    /// Mounting or unmounting the image.
    #[error(transparent)]
    Mount(#[from] MountError),
    /// Mounts and runc need root.
    #[error("lamina run needs root (it mounts filesystems and runs runc)")]
    NotRoot,
    /// Another container has the name (or left its upper dir behind).
    #[error("container name {name:?} is in use ({path} exists); remove it with `lamina rm {name}` or pick another --name")]
    NameInUse {
        /// The name.
        name: String,
        /// What exists.
        path: PathBuf,
    },
    /// A `-v` source that is not there.
    #[error("bind source {0} does not exist")]
    VolumeSource(PathBuf),
    /// A path the overlay's option string cannot carry.
    #[error("{0} contains ',', ':' or '\\\\', which overlayfs options cannot carry; choose another --cache-dir or --state-dir")]
    BadPath(PathBuf),
    /// Local I/O.
    #[error("{what} {path}: {source}")]
    Io {
        /// What was being done.
        what: &'static str,
        /// On what.
        path: PathBuf,
        /// The error.
        source: std::io::Error,
    },
    /// runc could not start the container (also: the command was not
    /// found or could not be executed).
    #[error("{}", .0.message)]
    Runc(runc::Failure),
    /// A signal arrived before the container started.
    #[error("interrupted by signal {0} before the container started")]
    Interrupted(i32),
    /// `--userns` with what it cannot work with.
    #[error("--userns: {0}")]
    Userns(String),
}

impl RunError {
    /// docker's codes: 125 for lamina's own failures, 126 when the
    /// command cannot be executed, 127 when it is not found, 128+N when
    /// signal N stopped the start.
    pub fn exit_code(&self) -> u8 {
        match self {
            RunError::Runc(f) => f.code,
            RunError::Interrupted(sig) => u8::try_from(128 + sig).unwrap_or(125),
            _ => 125,
        }
    }
}

fn io<'a>(what: &'static str, path: &'a Path) -> impl FnOnce(std::io::Error) -> RunError + 'a {
    move |source| RunError::Io {
        what,
        path: path.to_path_buf(),
        source,
    }
}

/// How a run went.
#[derive(Debug, Clone, serde::Serialize)]
pub struct RunReport {
    /// Container name.
    pub name: String,
    /// The image.
    pub image: String,
    /// Its manifest digest.
    pub manifest_digest: String,
    /// The container's exit code (lamina's too).
    pub exit_code: i32,
    /// The signal that stopped the container, if one did.
    pub stopped_by_signal: Option<i32>,
    /// Seconds until the image was mounted.
    pub mount_seconds: f64,
    /// Seconds from start to the container's exit.
    pub run_seconds: f64,
    /// The upper dir, when kept (no `--rm`).
    pub upper_dir: Option<PathBuf>,
    /// Problems met while tearing down (left-overs are named here).
    pub cleanup_warnings: Vec<String>,
}

/// Runs the container to its end and tears it down.
pub fn run(opts: &RunOptions) -> Result<RunReport, RunError> {
    let started = Instant::now();
    if !rustix::process::geteuid().is_root() {
        return Err(RunError::NotRoot);
    }
    let name = match &opts.name {
        Some(n) => n.clone(),
        None => generated_name(),
    };
    config::check_name(&name)?;
    for v in &opts.volumes {
        if !v.source.exists() {
            return Err(RunError::VolumeSource(v.source.clone()));
        }
    }
    check_userns(opts)?;
    // Before any mount: a Ctrl-C from now on is ours to handle, so nothing
    // is left half set up.
    let mut signals = Signals::new([SIGINT, SIGTERM, SIGHUP, SIGQUIT])
        .map_err(io("installing signal handlers", Path::new("-")))?;
    let mut c = Container::claim(opts, name)?;
    let result = c.start_and_wait(opts, &mut signals, started);
    let warnings = c.teardown();
    let mut report = result?;
    report.run_seconds = started.elapsed().as_secs_f64();
    report.cleanup_warnings = warnings;
    Ok(report)
}

/// What `--userns` cannot work with, refused before anything is set up.
fn check_userns(opts: &RunOptions) -> Result<(), RunError> {
    let Some(range) = opts.userns else {
        return Ok(());
    };
    crate::spec::IdRange::new(range.host, range.size).map_err(RunError::Userns)?;
    if opts.network == Network::Host {
        // As docker: sysfs is mounted only by the owner of the network
        // namespace, and the host's is not the container's.
        return Err(RunError::Userns(
            "a user namespace needs the container's own network (--net none)".into(),
        ));
    }
    if opts.mode != lamina_mount::Mode::Kernel {
        return Err(RunError::Userns(
            "the image is shifted by an idmapped mount of its EROFS: run with --mode kernel".into(),
        ));
    }
    passable_above(&opts.state_dir, range)
}

/// runc's init runs as the range's root and must pass through every
/// directory above the state dir (which is made 0711 itself) to reach the
/// container's root filesystem: one that others may not pass through (a
/// 0700 temp dir) would fail the start deep in runc with EACCES.
fn passable_above(state_dir: &Path, range: crate::spec::IdRange) -> Result<(), RunError> {
    for dir in state_dir.ancestors().skip(1) {
        let Ok(meta) = fs::metadata(dir) else {
            continue; // not made yet: it will be, 0711
        };
        let mode = meta.mode();
        let passable = mode & 0o001 != 0
            || (meta.uid() == range.host && mode & 0o100 != 0)
            || (meta.gid() == range.host && mode & 0o010 != 0);
        if !passable {
            return Err(RunError::Userns(format!(
                "{} (mode {:04o}) above the state dir cannot be passed through by the \
                 container's root (host uid {}): choose a --state-dir whose parents others may \
                 pass through, such as the default /run/lamina",
                dir.display(),
                mode & 0o7777,
                range.host
            )));
        }
    }
    Ok(())
}

fn generated_name() -> String {
    let seed = format!("{}-{:?}", std::process::id(), std::time::SystemTime::now());
    format!(
        "lamina-{}",
        lamina_oci::Digest::of_bytes(seed.as_bytes())
            .hex()
            .get(..12)
            .unwrap_or("0")
    )
}

/// A claimed container and what of it is set up, so that teardown undoes
/// exactly that (also when setup fails halfway).
#[derive(Debug)]
struct Container {
    name: String,
    state: PathBuf,
    /// Where runc finds the rootfs and the files bound into the container:
    /// `state`, or with `--userns` a dir its root may reach.
    exposed: PathBuf,
    userns: Option<crate::spec::IdRange>,
    keep: PathBuf,
    runc: Runc,
    cache_dir: PathBuf,
    remove: bool,
    lower_mounted: bool,
    /// The idmapped clone of the lower (`--userns`).
    ids_mounted: bool,
    overlay_mounted: bool,
    runc_started: bool,
    torn_down: bool,
}

impl Container {
    fn claim(opts: &RunOptions, name: String) -> Result<Container, RunError> {
        let containers = opts.state_dir.join("containers");
        let keep_root = opts.mount.cache_dir.join("containers");
        let userns_root = opts.state_dir.join("userns");
        // Once traversable (another --userns container may be starting),
        // the state dir stays so.
        if opts.userns.is_some() || lamina_fetch::private::is_traversable(&opts.state_dir) {
            for dir in [&opts.state_dir, &userns_root] {
                lamina_fetch::private::traversable_dir(dir).map_err(io("creating", dir))?;
            }
        } else {
            let dir = &opts.state_dir;
            lamina_fetch::private::private_dir(dir).map_err(io("creating", dir))?;
        }
        for dir in [&containers, &keep_root] {
            lamina_fetch::private::private_dir(dir).map_err(io("creating", dir))?;
        }
        let runc_root = opts.state_dir.join("runc");
        lamina_fetch::private::private_dir(&runc_root).map_err(io("creating", &runc_root))?;
        let state = containers.join(&name);
        let keep = keep_root.join(&name);
        let runc = Runc {
            bin: opts.runc.clone(),
            root: runc_root,
        };
        // A kept upper dir or a runc container of that name also holds it.
        for taken in [&keep, &runc.root.join(&name)] {
            if taken.exists() {
                return Err(RunError::NameInUse {
                    name,
                    path: taken.to_path_buf(),
                });
            }
        }
        // mkdir claims the name atomically against a concurrent run.
        match fs::DirBuilder::new().mode(0o700).create(&state) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
                return Err(RunError::NameInUse { name, path: state })
            }
            Err(e) => return Err(io("creating", &state)(e)),
        }
        let exposed = match opts.userns {
            Some(range) => expose_to(&userns_root.join(&name), range)?,
            None => state.clone(),
        };
        let c = Container {
            name,
            state,
            exposed,
            userns: opts.userns,
            keep,
            runc,
            cache_dir: opts.mount.cache_dir.clone(),
            remove: opts.remove,
            lower_mounted: false,
            ids_mounted: false,
            overlay_mounted: false,
            runc_started: false,
            torn_down: false,
        };
        fs::DirBuilder::new()
            .mode(0o700)
            .create(&c.keep)
            .map_err(io("creating", &c.keep))?;
        Ok(c)
    }

    fn lower(&self) -> PathBuf {
        self.state.join("lower")
    }

    fn rootfs(&self) -> PathBuf {
        self.exposed.join("rootfs")
    }

    /// The idmapped clone of [`lower`](Self::lower) (`--userns`).
    fn lower_ids(&self) -> PathBuf {
        self.state.join("lower-ids")
    }

    /// The overlay's lower: the image, shifted into the range with
    /// `--userns`.
    fn overlay_lower(&mut self) -> Result<PathBuf, RunError> {
        let Some(range) = self.userns else {
            return Ok(self.lower());
        };
        let (lower, ids) = (self.lower(), self.lower_ids());
        fs::DirBuilder::new()
            .mode(0o700)
            .create(&ids)
            .map_err(io("creating", &ids))?;
        let userns = lamina_sys::idmap::user_namespace(range)
            .map_err(|e| RunError::Userns(format!("a user namespace for the mount: {e}")))?;
        lamina_sys::idmap::mount_idmapped(&lower, &ids, &userns).map_err(|e| {
            RunError::Userns(format!(
                "an idmapped mount of the image at {}: {e} (the kernel must allow idmapped \
                 EROFS mounts: Linux 6.x)",
                ids.display()
            ))
        })?;
        self.ids_mounted = true;
        Ok(ids)
    }

    fn start_and_wait(
        &mut self,
        opts: &RunOptions,
        signals: &mut Signals,
        started: Instant,
    ) -> Result<RunReport, RunError> {
        let interrupted = |signals: &mut Signals| match signals.pending().next() {
            Some(sig) => Err(RunError::Interrupted(sig)),
            None => Ok(()),
        };
        let image_config = read_image_config(opts)?;
        let argv = config::command(&image_config, opts.entrypoint.as_deref(), &opts.args)?;
        interrupted(signals)?;
        let info = self.mount_lower(opts)?;
        let mount_seconds = started.elapsed().as_secs_f64();
        interrupted(signals)?;
        let user_spec = opts.user.as_deref().unwrap_or(&image_config.user);
        let passwd = read_in_image(&self.lower(), "etc/passwd")?;
        let group = read_in_image(&self.lower(), "etc/group")?;
        let user = config::resolve_user(user_spec, passwd.as_deref(), group.as_deref())?;
        let mut defaults = vec![
            ("PATH", config::DEFAULT_PATH),
            ("HOSTNAME", self.name.as_str()),
        ];
        if opts.tty {
            defaults.push(("TERM", "xterm"));
        }
        let env = config::environment(&image_config.env, &opts.env, &defaults, &user.home, |k| {
            std::env::var(k).ok()
        })?;
        let lower = self.overlay_lower()?;
        self.mount_overlay(&lower)?;
        let etc_files = self.write_etc_files(opts.network)?;
        let cwd = image_config.cwd(opts.workdir.as_deref());
        let rootfs = self.rootfs();
        let spec = runtime_spec(&SpecInput {
            rootfs: &rootfs,
            args: &argv,
            env: &env,
            cwd: &cwd,
            user: &user,
            hostname: &self.name,
            terminal: opts.tty,
            network: opts.network,
            volumes: &opts.volumes,
            etc_files: &etc_files,
            security: &opts.security,
            userns: opts.userns,
        });
        let bundle_config = self.state.join("config.json");
        let bytes = serde_json::to_vec_pretty(&spec).map_err(|e| RunError::Io {
            what: "writing",
            path: bundle_config.clone(),
            source: e.into(),
        })?;
        lamina_fetch::private::write_atomic(&bundle_config, &bytes, false)
            .map_err(io("writing", &bundle_config))?;
        interrupted(signals)?;
        let (exit_code, stopped_by_signal) = self.run_runc(opts, signals)?;
        Ok(RunReport {
            name: self.name.clone(),
            image: opts.image.to_string(),
            manifest_digest: info.manifest_digest,
            exit_code,
            stopped_by_signal,
            mount_seconds,
            run_seconds: 0.0,
            upper_dir: (!self.remove).then(|| self.keep.join("upper")),
            cleanup_warnings: Vec::new(),
        })
    }

    /// The lamina mount, exactly as `lamina mount` makes it.
    fn mount_lower(&mut self, opts: &RunOptions) -> Result<lamina_mount::MountInfo, RunError> {
        let lower = self.lower();
        fs::DirBuilder::new()
            .mode(0o700)
            .create(&lower)
            .map_err(io("creating", &lower))?;
        let info = lamina_mount::mount(
            &opts.image,
            &lower,
            &opts.mount,
            opts.lazy.as_ref(),
            opts.mode,
        )?;
        self.lower_mounted = true;
        Ok(info)
    }

    /// overlayfs: the lamina mount (`lower`) below, the container's upper
    /// dir above.
    fn mount_overlay(&mut self, lower: &Path) -> Result<(), RunError> {
        let rootfs = self.rootfs();
        let (upper, work) = (self.keep.join("upper"), self.keep.join("work"));
        for dir in [&upper, &work, &rootfs] {
            fs::DirBuilder::new()
                .mode(0o700)
                .create(dir)
                .map_err(io("creating", dir))?;
        }
        // The overlay's root takes the upper dir's mode and owner: give it
        // the image root's, or `/` would be 0700 in the container. Privacy
        // comes from the 0700 directory above it.
        let root = fs::metadata(lower).map_err(io("reading", lower))?;
        std::os::unix::fs::chown(&upper, Some(root.uid()), Some(root.gid()))
            .map_err(io("chown", &upper))?;
        fs::set_permissions(&upper, fs::Permissions::from_mode(root.mode() & 0o7777))
            .map_err(io("chmod", &upper))?;
        let mut data = String::new();
        for (key, path) in [
            ("lowerdir", lower),
            ("upperdir", &upper),
            ("workdir", &work),
        ] {
            let s = path
                .to_str()
                .ok_or_else(|| RunError::BadPath(path.to_path_buf()))?;
            if s.contains([',', ':', '\\']) {
                return Err(RunError::BadPath(path.to_path_buf()));
            }
            data.push_str(&format!(
                "{}{key}={s}",
                if data.is_empty() { "" } else { "," }
            ));
        }
        let data = std::ffi::CString::new(data).map_err(|_| RunError::BadPath(rootfs.clone()))?;
        rustix::mount::mount(
            "overlay",
            &rootfs,
            "overlay",
            MountFlags::empty(),
            data.as_c_str(),
        )
        .map_err(|e| io("mounting overlay at", &rootfs)(e.into()))?;
        self.overlay_mounted = true;
        Ok(())
    }

    /// `/etc/hostname`, `/etc/hosts` and (with the host's network)
    /// `/etc/resolv.conf`, bound read-only over the image's.
    fn write_etc_files(&self, network: Network) -> Result<Vec<(PathBuf, &'static str)>, RunError> {
        let mut files = vec![(
            self.exposed.join("hostname"),
            "/etc/hostname",
            format!("{}\n", self.name),
        )];
        let hosts = match network {
            Network::Host => fs::read_to_string("/etc/hosts").unwrap_or_default(),
            Network::None => String::new(),
        };
        files.push((
            self.exposed.join("hosts"),
            "/etc/hosts",
            format!("{hosts}127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n127.0.1.1\t{}\n", self.name),
        ));
        if network == Network::Host {
            if let Ok(resolv) = fs::read_to_string("/etc/resolv.conf") {
                files.push((self.exposed.join("resolv.conf"), "/etc/resolv.conf", resolv));
            }
        }
        let mut out = Vec::new();
        for (path, dest, text) in files {
            fs::write(&path, text).map_err(io("writing", &path))?;
            fs::set_permissions(&path, fs::Permissions::from_mode(0o644))
                .map_err(io("chmod", &path))?;
            out.push((path, dest));
        }
        Ok(out)
    }

    /// Runs runc to the container's end; a stop signal is passed on with
    /// `runc kill`, and SIGKILL follows after the stop timeout.
    fn run_runc(
        &mut self,
        opts: &RunOptions,
        signals: &mut Signals,
    ) -> Result<(i32, Option<i32>), RunError> {
        let log = self.state.join("runc.log");
        let io3 = Stdio3 {
            stdin: opts.interactive,
            own_group: !opts.interactive && !opts.tty,
        };
        self.runc_started = true;
        let mut child = self
            .runc
            .spawn_run(&self.state, &self.name, &log, io3)
            .map_err(io("starting", &self.runc.bin))?;
        let mut stop: Option<(i32, Instant)> = None;
        let mut delivered = false;
        let mut last_kill: Option<Instant> = None;
        let status = loop {
            if let Some(status) = child
                .try_wait()
                .map_err(io("waiting for", &self.runc.bin))?
            {
                break status;
            }
            if let Some(sig) = signals.pending().last() {
                stop.get_or_insert((sig, Instant::now()));
                delivered = false;
            }
            if let Some((sig, since)) = stop {
                // Retried until runc takes it: the container may not exist
                // yet when the signal comes.
                if !delivered {
                    delivered = self.runc.kill(&self.name, &sig.to_string());
                }
                let due = last_kill.is_none_or(|t| t.elapsed() >= Duration::from_secs(1));
                if since.elapsed() >= opts.stop_timeout && due {
                    self.runc.kill(&self.name, "KILL");
                    last_kill = Some(Instant::now());
                }
            }
            std::thread::sleep(POLL);
        };
        let code = runc::exit_code(status);
        if code != 0 && stop.is_none() {
            if let Some(failure) = runc::failure(&log) {
                return Err(RunError::Runc(failure));
            }
        }
        Ok((code, stop.map(|(sig, _)| sig)))
    }

    /// Undoes what was set up, in reverse; returns what could not be undone.
    fn teardown(&mut self) -> Vec<String> {
        if std::mem::replace(&mut self.torn_down, true) {
            return Vec::new();
        }
        let mut warnings = Vec::new();
        if self.runc_started && self.runc.exists(&self.name) && !self.runc.delete(&self.name) {
            warnings.push(format!("runc delete --force {} failed", self.name));
        }
        if self.overlay_mounted {
            match unmount(&self.rootfs()) {
                Ok(()) => self.overlay_mounted = false,
                Err(e) => warnings.push(e),
            }
        }
        if self.ids_mounted && !self.overlay_mounted {
            match unmount(&self.lower_ids()) {
                Ok(()) => self.ids_mounted = false,
                Err(e) => warnings.push(e),
            }
        }
        if self.lower_mounted && !self.overlay_mounted && !self.ids_mounted {
            let lower = self.lower();
            match lamina_mount::unmount(&lower) {
                Ok(()) => {
                    self.lower_mounted = false;
                    let done = lamina_mount::finish_unmount(&self.cache_dir, &lower);
                    if let Some(pid) = done.still_serving {
                        warnings.push(format!(
                            "the lamina mount's holder (pid {pid}) still serves"
                        ));
                    }
                }
                Err(e) => warnings.push(e.to_string()),
            }
        }
        if self.overlay_mounted || self.ids_mounted || self.lower_mounted {
            warnings.push(format!(
                "left {} in place: still mounted",
                self.state.display()
            ));
            return warnings;
        }
        // Known entries one by one: a remove_dir_all would walk into a mount.
        for f in [
            "config.json",
            "runc.log",
            "hosts",
            "hostname",
            "resolv.conf",
        ] {
            let _ = fs::remove_file(self.state.join(f));
            let _ = fs::remove_file(self.exposed.join(f));
        }
        let dirs = [
            self.rootfs(),
            self.exposed.clone(),
            self.lower_ids(),
            self.lower(),
            self.state.clone(),
        ];
        for d in dirs {
            if let Err(e) = fs::remove_dir(&d) {
                if e.kind() != std::io::ErrorKind::NotFound {
                    warnings.push(format!("removing {}: {e}", d.display()));
                }
            }
        }
        // A container that never ran has nothing worth keeping.
        if self.remove || !self.runc_started {
            if let Err(e) = fs::remove_dir_all(&self.keep) {
                warnings.push(format!("removing {}: {e}", self.keep.display()));
            }
        }
        warnings
    }
}

impl Drop for Container {
    fn drop(&mut self) {
        for w in self.teardown() {
            eprintln!("lamina: {w}");
        }
    }
}

/// `dir`, made 0700 and owned by the range's root: the container's root
/// reaches what is inside, no other user does.
fn expose_to(dir: &Path, range: crate::spec::IdRange) -> Result<PathBuf, RunError> {
    match fs::DirBuilder::new().mode(0o700).create(dir) {
        Ok(()) => {}
        // A name is claimed under STATE/containers first: a dir left here
        // by a crashed run of that name is taken over.
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(io("creating", dir)(e)),
    }
    let meta = fs::symlink_metadata(dir).map_err(io("reading", dir))?;
    if !meta.is_dir() {
        return Err(io("creating", dir)(
            std::io::ErrorKind::AlreadyExists.into(),
        ));
    }
    std::os::unix::fs::chown(dir, Some(range.host), Some(range.host)).map_err(io("chown", dir))?;
    fs::set_permissions(dir, fs::Permissions::from_mode(0o700)).map_err(io("chmod", dir))?;
    Ok(dir.to_path_buf())
}

/// Unmounts, and detaches when the mount is busy (a process that escaped
/// the container may still hold it).
fn unmount(path: &Path) -> Result<(), String> {
    match rustix::mount::unmount(path, UnmountFlags::empty()) {
        Ok(()) => Ok(()),
        Err(rustix::io::Errno::BUSY) => rustix::mount::unmount(path, UnmountFlags::DETACH)
            .map_err(|e| format!("umount {}: {e}", path.display())),
        Err(e) => Err(format!("umount {}: {e}", path.display())),
    }
}

/// The image's runtime config, from the lamina image's config blob (the
/// source image's config, kept by `lamina convert`).
fn read_image_config(opts: &RunOptions) -> Result<ImageConfig, RunError> {
    let source = open_source(&opts.image, &opts.mount.source)?;
    Ok(ImageConfig::from_json(&source.image().config)?)
}

/// A file of the image, resolved inside the image root (an absolute
/// symlink such as `/etc/passwd -> /etc/shadow` must not reach the
/// host's), bounded in size; None when the image has none.
fn read_in_image(root: &Path, rel: &str) -> Result<Option<String>, RunError> {
    let path = root.join(rel);
    let dir = rustix::fs::open(
        root,
        OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC,
        Mode::empty(),
    )
    .map_err(|e| io("opening", root)(e.into()))?;
    let fd = match rustix::fs::openat2(
        &dir,
        rel,
        OFlags::RDONLY | OFlags::CLOEXEC | OFlags::NOCTTY | OFlags::NONBLOCK,
        Mode::empty(),
        ResolveFlags::IN_ROOT | ResolveFlags::NO_MAGICLINKS,
    ) {
        Ok(fd) => fd,
        Err(rustix::io::Errno::NOENT) => return Ok(None),
        Err(e) => return Err(io("opening", &path)(e.into())),
    };
    let file = fs::File::from(fd);
    if !file.metadata().map_err(io("reading", &path))?.is_file() {
        return Ok(None);
    }
    let mut bytes = Vec::new();
    file.take(MAX_ACCOUNT_FILE)
        .read_to_end(&mut bytes)
        .map_err(io("reading", &path))?;
    Ok(Some(String::from_utf8_lossy(&bytes).into_owned()))
}

/// The OCI runtime's path: `name` itself when it has a slash, else found on
/// PATH or in the sbin directories (where Debian puts runc and which a
/// non-login PATH may lack).
pub fn find_runtime(name: &Path) -> Result<PathBuf, RunError> {
    let not_found = || RunError::Io {
        what: "finding the OCI runtime",
        path: name.to_path_buf(),
        source: std::io::ErrorKind::NotFound.into(),
    };
    if name.components().count() > 1 {
        return name
            .is_file()
            .then(|| name.to_path_buf())
            .ok_or_else(not_found);
    }
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain(["/usr/local/sbin", "/usr/sbin", "/sbin"].map(PathBuf::from))
        .map(|d| d.join(name))
        .find(|p| fs::metadata(p).is_ok_and(|m| m.is_file() && m.mode() & 0o111 != 0))
        .ok_or_else(not_found)
}

/// `lamina rm NAME`: removes a stopped container's kept upper dir.
pub fn remove(state_dir: &Path, cache_dir: &Path, name: &str) -> Result<PathBuf, RunError> {
    config::check_name(name)?;
    let state = state_dir.join("containers").join(name);
    if state.exists() {
        return Err(RunError::NameInUse {
            name: name.to_string(),
            path: state,
        });
    }
    let keep = cache_dir.join("containers").join(name);
    fs::remove_dir_all(&keep).map_err(io("removing", &keep))?;
    Ok(keep)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn image_files_resolve_inside_the_root() {
        let t = tempfile::tempdir().unwrap();
        let root = t.path().join("root");
        fs::create_dir_all(root.join("etc")).unwrap();
        fs::write(t.path().join("host-secret"), "secret").unwrap();
        fs::write(root.join("host-secret"), "image file").unwrap();
        // Absolute and escaping symlinks stay inside the image root.
        std::os::unix::fs::symlink("/host-secret", root.join("etc/passwd")).unwrap();
        std::os::unix::fs::symlink("../../../../host-secret", root.join("etc/group")).unwrap();
        assert_eq!(
            read_in_image(&root, "etc/passwd").unwrap().as_deref(),
            Some("image file")
        );
        assert_eq!(
            read_in_image(&root, "etc/group").unwrap().as_deref(),
            Some("image file")
        );
        assert_eq!(read_in_image(&root, "etc/shadow").unwrap(), None);
        fs::create_dir(root.join("etc/dir")).unwrap();
        assert_eq!(read_in_image(&root, "etc/dir").unwrap(), None);
    }

    #[test]
    fn exit_codes_follow_docker() {
        assert_eq!(RunError::NotRoot.exit_code(), 125);
        assert_eq!(RunError::Config(ConfigError::NoCommand).exit_code(), 125);
        assert_eq!(RunError::Interrupted(15).exit_code(), 143);
        let f = runc::Failure {
            code: 127,
            message: "x".into(),
        };
        assert_eq!(RunError::Runc(f).exit_code(), 127);
    }
}
