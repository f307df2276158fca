//! Logs: `tracing` events to stderr, filtered by `LAMINA_LOG` (a tracing
//! `EnvFilter`, default `info`), as text or JSON lines. The mount daemons'
//! stderr is their log file in the mount's run dir; the snapshotter's is
//! wherever its service manager puts it.

use std::io::IsTerminal;

use tracing_subscriber::EnvFilter;

use crate::config::LogFormat;

/// The variable with the filter.
pub const FILTER_VAR: &str = "LAMINA_LOG";
/// The variable with the format (`--log-format`'s).
pub const FORMAT_VAR: &str = "LAMINA_LOG_FORMAT";

/// Installs the subscriber for this process. A bad filter is reported and
/// replaced by `info`: a typo must not silence a daemon.
pub fn init(filter: &str, format: LogFormat) {
    let filter = EnvFilter::try_new(filter).unwrap_or_else(|e| {
        eprintln!("lamina: {FILTER_VAR}={filter:?}: {e}; logging at info");
        EnvFilter::new("info")
    });
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal());
    // Only fails if a subscriber is already set, which main does once.
    let _ = match format {
        LogFormat::Text => builder.try_init(),
        LogFormat::Json => builder.json().try_init(),
    };
}

/// Hands the resolved settings to the daemons this process starts (a
/// lazy mount's holder, which starts its workers): they inherit the
/// environment. Called before any thread is started.
pub fn export(filter: &str, format: LogFormat) {
    let format = match format {
        LogFormat::Text => "text",
        LogFormat::Json => "json",
    };
    std::env::set_var(FILTER_VAR, filter);
    std::env::set_var(FORMAT_VAR, format);
}
