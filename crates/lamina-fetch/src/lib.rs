//! The chunk store and fetcher: per-blob sparse cache files with a
//! crash-safe fill record ([`store`]) and verified, merged, retried range
//! fetches from a registry or a local layout ([`fetch`]), and chunks found
//! in other entries' cache files by digest instead of fetched ([`locator`]).
#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod fetch;
pub mod hedge;
pub mod locator;
pub mod private;
pub mod store;
