//! The config file's settings applied to the parsed arguments: each fills
//! what the command line and the environment left to its default.

use std::path::PathBuf;

use clap::parser::ValueSource;
use clap::ArgMatches;

use crate::config::{ConfigFile, IndexPolicy, NetMode, ServeSection};

use super::{Args, Command, ServeArgs};

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
    let min_rate = file.registry_min_rate.map(|r| r.0);
    m.fill(&mut args.registry_min_rate, "registry_min_rate", min_rate);
    let policy = file.index.policy.map(|p| match p {
        IndexPolicy::Enforce => "enforce".to_string(),
        IndexPolicy::Audit => "audit".to_string(),
    });
    m.fill(&mut args.index_policy, "index_policy", policy);
    m.fill(
        &mut args.trusted_indexes,
        "trusted_indexes",
        file.index.pinned.clone(),
    );
    m.fill(&mut args.index_keys, "index_keys", file.index.keys.clone());
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
            fetch_rests,
            mode,
            share_files,
            metrics_address,
            cache_max_size,
            cache_reserve,
            reserve_space,
            cri_keychain,
            tenant_caches,
        } => {
            let s = &file.snapshotter;
            m.fill(reserve_space, "reserve_space", s.reserve_space);
            m.fill(share_files, "share_files", s.share_files);
            m.fill(tenant_caches, "tenant_caches", s.tenant_caches.clone());
            let keychain = s.cri_keychain.clone().map(Some);
            m.fill(cri_keychain, "cri_keychain", keychain);
            let reserve = s.cache_reserve.map(|v| Some(v.0));
            m.fill(cache_reserve, "cache_reserve", reserve);
            let max = s.cache_max_size.map(|v| Some(v.0));
            m.fill(cache_max_size, "cache_max_size", max);
            m.fill(mode, "mode", s.mode.map(|v| v.as_str().into()));
            m.fill(root, "root", s.root.clone());
            m.fill(address, "address", s.address.clone());
            m.fill(timeout, "timeout", s.timeout);
            m.fill(prefetch, "prefetch", s.prefetch.map(|p| p.as_str().into()));
            m.fill(fill_ahead, "fill_ahead", s.fill_ahead.map(|w| w.0));
            m.fill(predict_max, "predict_max", s.predict_max.map(|w| w.0));
            m.fill(fetch_rests, "fetch_rests", s.fetch_rests);
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
    m.fill(&mut serve.fetch_rests, "fetch_rests", s.fetch_rests);
    m.fill(&mut serve.readahead, "readahead", s.readahead.map(Some));
    let reserve = s.cache_reserve.map(|v| Some(v.0));
    m.fill(&mut serve.cache_reserve, "cache_reserve", reserve);
    m.fill(&mut serve.reserve_space, "reserve_space", s.reserve_space);
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
    use crate::config::{parse, LogFormat};
    use clap::{CommandFactory, FromArgMatches};
    use lamina_snapshotter::metrics::MetricsAddress;
    use std::path::Path;

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
        fetch_rests = true
        reserve_space = true
        [snapshotter]
        mode = "kernel"
        reserve_space = true
        root = "/file/root"
        address = "/file/sock"
        fill_ahead = "2M"
        predict_max = "1M"
        fetch_rests = true
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
        assert!(serve.fetch_rests);
        assert_eq!(serve.mode, "fuse");
        assert!(serve.reserve_space);
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
        assert!(!serve.fetch_rests, "[mount] is not [run]");

        let args = parse_with(&["lamina", "snapshotter"], FILE);
        let Command::Snapshotter {
            root,
            address,
            metrics_address,
            fill_ahead,
            predict_max,
            fetch_rests,
            mode,
            reserve_space,
            ..
        } = &args.command
        else {
            panic!()
        };
        assert!(*reserve_space);
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
        assert!(*fetch_rests);
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
}
