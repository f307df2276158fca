//! The commands, one function each, as `run` hands them their arguments:
//! each calls the library and prints what it did.

use std::io::IsTerminal;
use std::path::Path;

use indicatif::{ProgressBar, ProgressStyle};
use lamina_image::build::BuildOptions;
use lamina_image::convert::{convert, ConvertOptions, Progress};
use lamina_image::index::{index, IndexOptions};
use lamina_mount::{IndexTrust, Mode, MountOptions, Privileges};

use crate::config::ConfigError;

use super::show::inspect;
use super::*;

/// `lamina convert`: converts an image and reports what it made.
pub(super) fn convert_image(command: Command, source: SourceOptions, json: bool) -> Result<()> {
    let Command::Convert {
        src,
        dst,
        chunk_size,
        zstd_level,
        pack_limit,
        format_version,
        work_dir,
        prefetch,
        boot_exec,
        metadata_frame_size,
    } = command
    else {
        unreachable!("run hands convert_image only Command::Convert");
    };
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
        boot_execs: boot_exec,
        metadata_frame_size: metadata_frame_size.map(|n| n as usize),
    };
    let (src, dst) = (parse_ref(&src)?, parse_ref(&dst)?);
    let bar = progress_bar(json);
    let report = convert(&src, &dst, &opts, &|p| report_progress(&bar, p))
        .with_context(|| format!("converting {src} to {dst}"));
    bar.finish_and_clear();
    let report = report?;
    if json {
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
    Ok(())
}

/// `lamina index`: indexes an image and reports the index.
pub(super) fn index_image(command: Command, source: SourceOptions, json: bool) -> Result<()> {
    let Command::Index {
        src,
        dst,
        span_size,
        prefetch,
        boot_exec,
        no_bind,
        metadata_frame_size,
    } = command
    else {
        unreachable!("run hands index_image only Command::Index");
    };
    let src = parse_ref(&src)?;
    let dst = dst.as_deref().map(parse_ref).transpose()?;
    let opts = IndexOptions {
        source,
        span_size,
        prefetch_trace: prefetch,
        boot_execs: boot_exec,
        bind: !no_bind,
        metadata_frame_size: metadata_frame_size.map(|n| n as usize),
    };
    let bar = progress_bar(json);
    let report = index(&src, dst.as_ref(), &opts, &|layer| {
        bar.set_message(format!("layer {}", layer + 1));
    })
    .with_context(|| format!("indexing {src}"));
    bar.finish_and_clear();
    let reports = report?;
    if json {
        print_json(&reports)?;
    }
    for report in reports.iter().filter(|_| !json) {
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
        if let Some(bound_in) = &report.bound_in {
            println!("  bound in     {bound_in} (pin or sign this digest)");
        }
        println!(
            "  size         {} bytes for {} bytes of layers ({} bytes of tar, {} inodes)",
            report.artifact_bytes, report.image_layer_bytes, report.tar_bytes, report.inodes
        );
        println!(
            "  spans        {} ({} with a window)",
            report.spans, report.windows
        );
    }
    Ok(())
}

/// `lamina mount`.
pub(super) fn mount_image(
    command: Command,
    (source, index_trust): (SourceOptions, IndexTrust),
    json: bool,
) -> Result<()> {
    let Command::Mount {
        image,
        mountpoint,
        serve,
        record_trace,
        suid,
        dev,
    } = command
    else {
        unreachable!("run hands mount_image only Command::Mount");
    };
    let image = parse_ref(&image)?;
    let opts = MountOptions {
        cache_dir: absolute(&serve.cache_dir)?,
        source,
        privileges: Privileges { suid, dev },
        index: serve.index.as_deref().map(parse_ref).transpose()?,
        index_trust,
        share_files: false,
    };
    let lazy = serve.lazy_options(&image, record_trace);
    let (mode, why) = mount_mode(&serve.mode, &opts.cache_dir, lazy.is_some())?;
    let opts = MountOptions {
        share_files: serve.share_files(mode)?,
        ..opts
    };
    tracing::info!("mounting with the {mode} path: {why}");
    let info = lamina_mount::mount(&image, &mountpoint, &opts, lazy.as_ref(), mode)
        .with_context(|| format!("mounting {image} at {}", mountpoint.display()))?;
    if json {
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
    Ok(())
}

/// `lamina run`: the container's exit code.
pub(super) fn run_container(
    command: Command,
    (source, index_trust): (SourceOptions, IndexTrust),
    json: bool,
) -> Result<u8> {
    let Command::Run {
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
        pids_limit,
        userns,
        user,
        workdir,
        entrypoint,
        tty,
        interactive,
        stop_timeout,
        state_dir,
        runtime,
    } = command
    else {
        unreachable!("run hands run_container only Command::Run");
    };
    let image = parse_ref(&image)?;
    let volumes = volumes
        .iter()
        .map(|v| v.parse::<lamina_run::Volume>())
        .collect::<Result<Vec<_>, _>>()?;
    let lazy = serve.lazy_options(&image, None);
    let cache_dir = absolute(&serve.cache_dir)?;
    let (mode, why) = mount_mode(&serve.mode, &cache_dir, lazy.is_some())?;
    tracing::info!("mounting with the {mode} path: {why}");
    let share_files = serve.share_files(mode)?;
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
            index_trust,
            share_files,
        },
        state_dir: absolute(&state_dir)?,
        runc: lamina_run::container::find_runtime(&runtime)?,
        name,
        remove: rm,
        env,
        volumes,
        network: net.parse()?,
        security: security(&cap_add, &security_opt, pids_limit)?,
        user,
        workdir,
        entrypoint,
        args: cmd,
        tty,
        interactive,
        stop_timeout: std::time::Duration::from_secs(stop_timeout),
        userns,
    };
    let report = lamina_run::run(&opts)?;
    for w in &report.cleanup_warnings {
        eprintln!("lamina: {w}");
    }
    if json {
        eprintln!("{}", serde_json::to_string(&report)?);
    }
    Ok(u8::try_from(report.exit_code).unwrap_or(125))
}

/// `lamina rm`.
pub(super) fn remove_containers(command: Command, json: bool) -> Result<()> {
    let Command::Rm {
        names,
        cache_dir,
        state_dir,
    } = command
    else {
        unreachable!("run hands remove_containers only Command::Rm");
    };
    for name in names {
        let removed = lamina_run::remove(&absolute(&state_dir)?, &absolute(&cache_dir)?, &name)?;
        if json {
            print_json(&serde_json::json!({"removed": name, "upper_dir": removed}))?;
        } else {
            println!("{name}");
        }
    }
    Ok(())
}

/// `lamina umount`: unmounts and reports what became of the daemon.
pub(super) fn unmount(command: Command, json: bool) -> Result<()> {
    let Command::Umount {
        mountpoint,
        cache_dir,
    } = command
    else {
        unreachable!("run hands unmount only Command::Umount");
    };
    let cache_dir = cache_dir_for_unmount(absolute(&cache_dir)?, &mountpoint);
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
    if json {
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
    Ok(())
}

/// The cache dir whose records describe the mount at `mountpoint`:
/// `given` when it has them, else the one the mount was made with (found
/// from the mount). Without its records an unmount of a `--share-files`
/// view would leave its holder, worker, shard and metadata view mounted.
fn cache_dir_for_unmount(given: PathBuf, mountpoint: &Path) -> PathBuf {
    if lamina_mount::run_dir(&given, mountpoint).is_dir() {
        return given;
    }
    match lamina_mount::cache_dir_of(mountpoint) {
        Some(found) => {
            tracing::info!(
                "{} was mounted with the cache dir {}",
                mountpoint.display(),
                found.display()
            );
            found
        }
        None => given,
    }
}

/// `lamina gc`.
pub(super) fn collect_garbage(command: Command, json: bool) -> Result<()> {
    let Command::Gc {
        max_size,
        cache_dir,
    } = command
    else {
        unreachable!("run hands collect_garbage only Command::Gc");
    };
    let max_size = max_size.ok_or(ConfigError::Missing(
        "gc needs --max-size SIZE (or max_size in the config file's [gc])",
    ))?;
    let cache_dir = absolute(&cache_dir)?;
    let report = lamina_mount::gc(&cache_dir, max_size)
        .with_context(|| format!("collecting {}", cache_dir.display()))?;
    if json {
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
    Ok(())
}

/// `lamina snapshotter`: serves containerd until stopped.
pub(super) fn serve_snapshotter(
    command: Command,
    (source, index_trust): (SourceOptions, IndexTrust),
) -> Result<()> {
    let Command::Snapshotter {
        root,
        address,
        timeout,
        prefetch,
        fill_ahead,
        predict_max,
        fetch_rests,
        mode,
        share_files,
        metrics_address,
        cache_max_size,
        cache_reserve,
        reserve_space,
        cri_keychain,
        tenant_caches,
    } = command
    else {
        unreachable!("run hands serve_snapshotter only Command::Snapshotter");
    };
    if share_files && mode != "kernel" {
        return Err(ConfigError::Invalid(
            "--share-files needs the kernel path: add --mode kernel".into(),
        )
        .into());
    }
    lamina_snapshotter::serve(lamina_snapshotter::Options {
        mode: match mode.as_str() {
            "kernel" => Some(Mode::Kernel),
            "fuse" => Some(Mode::Fuse),
            _ => None,
        },
        share_files,
        root: absolute(&root)?,
        address: absolute(&address)?,
        source,
        lazy: lamina_mount::LazyOptions {
            timeout: std::time::Duration::from_secs(timeout.max(1)),
            prefetch: parse_prefetch(&prefetch),
            fill_ahead,
            predict_max,
            fetch_rests,
            cache_reserve,
            reserve_space,
            ..lamina_mount::LazyOptions::default()
        },
        metrics_address,
        cache_max_size,
        index_trust,
        cri_keychain: cri_keychain.as_deref().map(absolute).transpose()?,
        tenant_caches,
    })?;
    Ok(())
}

/// `lamina inspect`.
pub(super) fn inspect_image(command: Command, source: SourceOptions, json: bool) -> Result<()> {
    let Command::Inspect { image, chunks } = command else {
        unreachable!("run hands inspect_image only Command::Inspect");
    };
    let image = parse_ref(&image)?;
    if chunks && !json {
        anyhow::bail!("inspect --chunks prints JSON only: add --json");
    }
    inspect(&image, &source, json, chunks)?;
    Ok(())
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
fn security(
    cap_add: &[String],
    opts: &[String],
    pids_limit: i64,
) -> anyhow::Result<lamina_run::Security> {
    if pids_limit < -1 {
        anyhow::bail!("--pids-limit {pids_limit}: a count, or 0 or -1 for no limit");
    }
    let mut security = lamina_run::Security {
        // As docker and podman: 0 and -1 mean no limit.
        pids_limit: u64::try_from(pids_limit).ok().filter(|n| *n > 0),
        ..lamina_run::Security::default()
    };
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
