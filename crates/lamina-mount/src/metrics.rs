//! Lazy mounts' figures as Prometheus metrics, read from the `status.json`
//! their workers keep in `mounts/<id>/` under a cache dir, summed per image.
//! `lamina snapshotter --metrics-address` serves them with its own, and
//! `lamina status --format prometheus` prints them.
//!
//! Counters come from the workers' own counts, which start again at zero
//! when a worker is restarted: Prometheus's `rate()` takes such resets in
//! its stride. Only mounts whose holder is alive are counted.

use std::collections::BTreeMap;
use std::fmt;
use std::path::{Path, PathBuf};

use lamina_daemon::latency::{Histogram, BOUNDS};
use lamina_daemon::worker::Status;
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric, NoLabelSet};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::MetricType;

/// One lazy mount as its run directory describes it.
#[derive(Debug)]
pub struct LiveMount {
    /// The image reference it mounts.
    pub image: String,
    /// Whether its holder is alive (the mount is served).
    pub alive: bool,
    /// The worker's last figures, if it wrote any.
    pub status: Option<Status>,
}

/// The lazy mounts recorded under `cache_dir` (none if it has no `mounts/`).
pub fn live_mounts(cache_dir: &Path) -> Vec<LiveMount> {
    let Ok(dir) = std::fs::read_dir(cache_dir.join("mounts")) else {
        return Vec::new();
    };
    let mut mounts = Vec::new();
    for entry in dir.flatten() {
        let read = |name: &str| -> Option<serde_json::Value> {
            serde_json::from_slice(&std::fs::read(entry.path().join(name)).ok()?).ok()
        };
        let (Some(config), Some(ready)) = (read("config.json"), read("ready")) else {
            continue; // an eager mount's record, or one being set up
        };
        let alive = ready["pid"]
            .as_u64()
            .is_some_and(|pid| Path::new(&format!("/proc/{pid}")).exists());
        let status = std::fs::read(entry.path().join("status.json"))
            .ok()
            .and_then(|bytes| serde_json::from_slice(&bytes).ok());
        mounts.push(LiveMount {
            image: config["image"].as_str().unwrap_or_default().to_string(),
            alive,
            status,
        });
    }
    mounts
}

/// The figures of the live mounts of one image, summed.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ImageFigures {
    /// Live mounts of the image.
    pub mounts: u64,
    /// Compressed bytes fetched.
    pub fetched_bytes: u64,
    /// Range requests sent.
    pub requests: u64,
    /// Misses served (readers that waited).
    pub misses: u64,
    /// Misses that failed: the reader got EIO.
    pub failed_misses: u64,
    /// Chunks that failed verification.
    pub bad_chunks: u64,
    /// Uncompressed bytes present in the cache.
    pub cached_bytes: u64,
    /// Uncompressed bytes of the image's data.
    pub total_bytes: u64,
    /// How long readers waited.
    pub miss_latency: Histogram,
}

/// The live mounts' figures per image reference.
pub fn by_image(mounts: &[LiveMount]) -> BTreeMap<String, ImageFigures> {
    let mut images: BTreeMap<String, ImageFigures> = BTreeMap::new();
    for m in mounts.iter().filter(|m| m.alive) {
        let f = images.entry(m.image.clone()).or_default();
        f.mounts += 1;
        let Some(s) = &m.status else { continue };
        f.fetched_bytes += s.fetched_bytes;
        f.requests += s.requests;
        f.misses += s.misses;
        f.failed_misses += s.failed_misses;
        f.bad_chunks += s.bad_chunks;
        f.cached_bytes += s.cached_bytes;
        f.total_bytes += s.total_bytes;
        f.miss_latency.merge(&s.miss_latency);
    }
    for f in images.values_mut() {
        if f.miss_latency.counts.is_empty() {
            // Workers that wrote no histogram yet: the buckets, all empty.
            f.miss_latency.merge(&Histogram {
                bounds: BOUNDS.to_vec(),
                counts: vec![0; BOUNDS.len() + 1],
                sum: 0.0,
            });
        }
    }
    images
}

/// Encodes the lazy mounts under cache dirs at every scrape.
#[derive(Debug, Clone)]
pub struct MountsCollector {
    cache_dirs: Vec<PathBuf>,
}

impl MountsCollector {
    /// A collector of the mounts under `cache_dir`.
    pub fn new(cache_dir: PathBuf) -> Self {
        MountsCollector::of_dirs(vec![cache_dir])
    }

    /// A collector of the mounts under each of `cache_dirs` (a
    /// snapshotter's tenants).
    pub fn of_dirs(cache_dirs: Vec<PathBuf>) -> Self {
        MountsCollector { cache_dirs }
    }
}

impl Collector for MountsCollector {
    fn encode(&self, encoder: DescriptorEncoder) -> fmt::Result {
        let mounts: Vec<LiveMount> = self
            .cache_dirs
            .iter()
            .flat_map(|d| live_mounts(d))
            .collect();
        encode_figures(&by_image(&mounts), encoder)
    }
}

/// A per-image family: name, help, type, and the figure it shows.
type Family = (
    &'static str,
    &'static str,
    MetricType,
    fn(&ImageFigures) -> u64,
);

const FAMILIES: &[Family] = &[
    (
        "lamina_image_mounts",
        "Live lazy mounts of the image.",
        MetricType::Gauge,
        |f| f.mounts,
    ),
    (
        "lamina_fetched_bytes",
        "Compressed bytes fetched from the source.",
        MetricType::Counter,
        |f| f.fetched_bytes,
    ),
    (
        "lamina_range_requests",
        "Range requests sent to the source.",
        MetricType::Counter,
        |f| f.requests,
    ),
    (
        "lamina_misses",
        "Reads that waited for data not yet in the cache.",
        MetricType::Counter,
        |f| f.misses,
    ),
    (
        "lamina_miss_errors",
        "Misses that failed: the reader got EIO.",
        MetricType::Counter,
        |f| f.failed_misses,
    ),
    (
        "lamina_bad_chunks",
        "Chunks that failed verification and were fetched again.",
        MetricType::Counter,
        |f| f.bad_chunks,
    ),
    (
        "lamina_cache_bytes",
        "Uncompressed bytes of the image present in the cache.",
        MetricType::Gauge,
        |f| f.cached_bytes,
    ),
    (
        "lamina_image_bytes",
        "Uncompressed bytes of the image's data.",
        MetricType::Gauge,
        |f| f.total_bytes,
    ),
];

/// Writes the families for `images` (every family, even with no image, so
/// that a scrape always shows what exists).
pub fn encode_figures(
    images: &BTreeMap<String, ImageFigures>,
    mut encoder: DescriptorEncoder,
) -> fmt::Result {
    let live: u64 = images.values().map(|f| f.mounts).sum();
    ConstGauge::new(live as i64).encode(encoder.encode_descriptor(
        "lamina_mounts_live",
        "Lazy mounts whose holder is alive.",
        None,
        MetricType::Gauge,
    )?)?;
    for &(name, help, kind, figure) in FAMILIES {
        let mut family = encoder.encode_descriptor(name, help, None, kind)?;
        for (image, f) in images {
            let labels = [("image", image.as_str())];
            let value = figure(f);
            let sample = family.encode_family(&labels)?;
            match kind {
                MetricType::Counter => ConstCounter::new(value).encode(sample)?,
                _ => ConstGauge::new(i64::try_from(value).unwrap_or(i64::MAX)).encode(sample)?,
            }
        }
    }
    let mut family = encoder.encode_descriptor(
        "lamina_miss_latency_seconds",
        "How long readers waited on misses.",
        None,
        MetricType::Histogram,
    )?;
    for (image, f) in images {
        let h = &f.miss_latency;
        let labels = [("image", image.as_str())];
        family
            .encode_family(&labels)?
            .encode_histogram::<NoLabelSet>(h.sum, h.count(), &h.buckets(), None)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use lamina_daemon::latency::Recorder;
    use prometheus_client::registry::Registry;
    use std::time::Duration;

    fn write_mount(cache: &Path, id: &str, image: &str, pid: u32, status: &Status) {
        let dir = cache.join("mounts").join(id);
        std::fs::create_dir_all(&dir).unwrap();
        let config = serde_json::json!({"image": image, "mountpoint": format!("/mnt/{id}")});
        std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
        let ready = serde_json::json!({"pid": pid, "error": null});
        std::fs::write(dir.join("ready"), ready.to_string()).unwrap();
        std::fs::write(dir.join("status.json"), serde_json::to_vec(status).unwrap()).unwrap();
    }

    fn status(fetched: u64, misses: u64, waits_ms: &[u64]) -> Status {
        let latency = Recorder::default();
        for &ms in waits_ms {
            latency.observe(Duration::from_millis(ms));
        }
        Status {
            fetched_bytes: fetched,
            requests: misses,
            misses,
            failed_misses: 1,
            cached_bytes: 100,
            total_bytes: 1000,
            miss_latency: latency.snapshot(),
            ..Status::default()
        }
    }

    fn scrape(cache: &Path) -> String {
        let mut registry = Registry::default();
        registry.register_collector(Box::new(MountsCollector::new(cache.to_path_buf())));
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
        text
    }

    #[test]
    fn live_mounts_are_summed_per_image_and_dead_ones_left_out() {
        let cache = tempfile::tempdir().unwrap();
        let me = std::process::id();
        write_mount(
            cache.path(),
            "a",
            "reg/app@sha256:aa",
            me,
            &status(10, 2, &[3, 700]),
        );
        write_mount(
            cache.path(),
            "b",
            "reg/app@sha256:aa",
            me,
            &status(5, 1, &[3]),
        );
        write_mount(
            cache.path(),
            "c",
            "reg/other@sha256:cc",
            me,
            &status(7, 0, &[]),
        );
        // No process has this pid (above the kernel's pid_max limit).
        write_mount(
            cache.path(),
            "d",
            "reg/app@sha256:aa",
            0x7fff_fff0,
            &status(999, 9, &[1]),
        );
        let images = by_image(&live_mounts(cache.path()));
        assert_eq!(images.len(), 2);
        let app = &images["reg/app@sha256:aa"];
        assert_eq!((app.mounts, app.fetched_bytes, app.misses), (2, 15, 3));
        assert_eq!(
            (app.failed_misses, app.cached_bytes, app.total_bytes),
            (2, 200, 2000)
        );
        assert_eq!(app.miss_latency.count(), 3);

        let text = scrape(cache.path());
        for line in [
            "lamina_mounts_live 3",
            "# TYPE lamina_fetched_bytes counter",
            r#"lamina_fetched_bytes_total{image="reg/app@sha256:aa"} 15"#,
            r#"lamina_fetched_bytes_total{image="reg/other@sha256:cc"} 7"#,
            r#"lamina_miss_errors_total{image="reg/app@sha256:aa"} 2"#,
            r#"lamina_cache_bytes{image="reg/app@sha256:aa"} 200"#,
            r#"lamina_image_mounts{image="reg/app@sha256:aa"} 2"#,
            "# TYPE lamina_miss_latency_seconds histogram",
            r#"lamina_miss_latency_seconds_count{image="reg/app@sha256:aa"} 3"#,
            // Cumulative: two 3 ms waits by 5 ms, the 700 ms one by 1 s.
            r#"lamina_miss_latency_seconds_bucket{le="0.005",image="reg/app@sha256:aa"} 2"#,
            r#"lamina_miss_latency_seconds_bucket{le="1.0",image="reg/app@sha256:aa"} 3"#,
            r#"lamina_miss_latency_seconds_bucket{le="+Inf",image="reg/other@sha256:cc"} 0"#,
        ] {
            assert!(
                text.lines().any(|l| l == line),
                "no line {line:?} in:\n{text}"
            );
        }
        assert!(!text.contains("999"), "a dead mount was counted:\n{text}");
    }

    #[test]
    fn no_mounts_still_shows_every_family() {
        let cache = tempfile::tempdir().unwrap();
        let text = scrape(cache.path());
        assert!(text.contains("lamina_mounts_live 0\n"), "{text}");
        for (name, ..) in FAMILIES {
            assert!(
                text.contains(&format!("# TYPE {name} ")),
                "{name} in:\n{text}"
            );
        }
        assert!(text.contains("# TYPE lamina_miss_latency_seconds histogram"));
    }
}
