//! `lamina`: parse arguments, call the library, print the result.
//!
//! Exit codes: 0 success, 1 failure not covered below, 2 usage error (a bad
//! config file included), bad image reference or bad hosts.toml, 3 image
//! content refused (digest or diff_id mismatch, corrupt or hostile data), 4
//! image or blob not found, 5 registry or network error, 6 the kernel
//! refused a mount or unmount.
//!
//! `lamina run` exits as `docker run` does: with the container's code; 125
//! when lamina itself fails (usage errors included), 126 when the command
//! cannot be executed, 127 when it is not found.
#![forbid(unsafe_code)]

mod cli;
mod config;
mod exit;
mod logging;
mod size;

use std::process::ExitCode;

use clap::{CommandFactory, FromArgMatches};

fn main() -> ExitCode {
    let parsed = cli::Args::command()
        .try_get_matches()
        .and_then(|m| cli::Args::from_arg_matches(&m).map(|args| (args, m)));
    let (mut args, matches) = match parsed {
        Ok(parsed) => parsed,
        Err(e) => {
            let _ = e.print();
            return ExitCode::from(match e.exit_code() {
                0 => 0,
                _ if exit::is_run_invocation() => exit::RUN_FAILED,
                code => u8::try_from(code).unwrap_or(2),
            });
        }
    };
    let is_run = args.is_run();
    let fail = |err: anyhow::Error| {
        if exit::is_broken_pipe(&err) && !is_run {
            return ExitCode::SUCCESS;
        }
        eprintln!("lamina: {}", exit::render(&err));
        ExitCode::from(if is_run {
            exit::run_code_for(&err)
        } else {
            exit::code_for(&err)
        })
    };
    // The daemons run on what their mount was given, logging included
    // (inherited in the environment): no config file.
    let file = if args.is_daemon() {
        // Fetch buffers of big chunks go back to the kernel when done.
        if let Err(e) = lamina_sys::unmap_big_allocations_on_free() {
            eprintln!("lamina: {e}");
        }
        config::ConfigFile::default()
    } else {
        match config::load(args.config.as_deref()) {
            Ok(file) => file,
            Err(e) => return fail(e.into()),
        }
    };
    cli::apply(&mut args, &matches, &file);
    let filter = std::env::var(logging::FILTER_VAR)
        .ok()
        .or_else(|| file.log.clone())
        .unwrap_or_else(|| "info".into());
    logging::export(&filter, args.log_format);
    logging::init(&filter, args.log_format);
    match cli::run(args) {
        Ok(code) => ExitCode::from(code),
        Err(err) => fail(err),
    }
}
