//! `lamina`: parse arguments, call the library, print the result.
//!
//! Exit codes: 0 success, 1 failure not covered below, 2 usage error, bad
//! image reference or bad hosts.toml, 3 image content refused (digest or
//! diff_id mismatch, corrupt or hostile data), 4 image or blob not found, 5
//! registry or network error, 6 the kernel refused a mount or unmount.
//!
//! `lamina run` exits as `docker run` does: with the container's code; 125
//! when lamina itself fails (usage errors included), 126 when the command
//! cannot be executed, 127 when it is not found.
#![forbid(unsafe_code)]

mod cli;
mod exit;

use std::process::ExitCode;

fn main() -> ExitCode {
    let args = match <cli::Args as clap::Parser>::try_parse() {
        Ok(args) => args,
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
    match cli::run(args) {
        Ok(code) => ExitCode::from(code),
        Err(err) => {
            if exit::is_broken_pipe(&err) && !is_run {
                return ExitCode::SUCCESS;
            }
            eprintln!("lamina: {}", exit::render(&err));
            ExitCode::from(if is_run {
                exit::run_code_for(&err)
            } else {
                exit::code_for(&err)
            })
        }
    }
}
