//! `lamina`: parse arguments, call the library, print the result.
//!
//! Exit codes: 0 success, 1 failure not covered below, 2 usage error, bad
//! image reference or bad hosts.toml, 3 image content refused (digest or
//! diff_id mismatch, corrupt or hostile data), 4 image or blob not found, 5
//! registry or network error, 6 the kernel refused a mount or unmount.
#![forbid(unsafe_code)]

mod cli;
mod exit;

use std::process::ExitCode;

fn main() -> ExitCode {
    let args = <cli::Args as clap::Parser>::parse();
    match cli::run(args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            if exit::is_broken_pipe(&err) {
                return ExitCode::SUCCESS;
            }
            eprintln!("lamina: {}", exit::render(&err));
            ExitCode::from(exit::code_for(&err))
        }
    }
}
