//! The kernel on-demand path: a file-backed EROFS mount whose blob cache
//! files are filled on first read through fanotify pre-content events.
//!
//! Two processes per mount: the [`holder`] owns the fanotify group and the
//! mount and only relays events; the [`worker`] fetches, verifies and fills.
//! See the holder's docs for why the split makes crashes safe.
//!
//! The FUSE path runs the same worker behind the same relay, with the
//! FUSE daemon in the holder's place ([`filler`]).
#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod bdi;
pub mod bounds;
pub mod config;
pub mod filler;
pub mod holder;
pub mod latency;
pub mod pool;
pub mod predict;
pub mod protocol;
pub mod readahead;
mod ready;
mod relay;
mod sources;
pub use sources::miss_source;
pub mod warm;
mod windows;
pub mod worker;
