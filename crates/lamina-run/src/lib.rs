//! `lamina run`: a container on a lamina image without containerd.
//!
//! The image is mounted as `lamina mount` mounts it (lazily from a
//! registry), an overlayfs with a private upper dir goes on top, and runc
//! runs the image config's entrypoint, command, environment, working dir
//! and user in the foreground, with docker's rules and exit codes.
//!
//! [`config`] (image config, user, command, environment, volumes) and
//! [`spec`] (the OCI runtime spec) are pure and tested without root;
//! [`container`] does the mounts and drives runc.
#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod config;
pub mod container;
mod runc;
pub mod seccomp;
pub mod spec;

pub use config::{ConfigError, ImageConfig, Network, User, Volume};
pub use container::{remove, run, RunError, RunOptions, RunReport};
pub use runc::Failure;
pub use spec::Security;
