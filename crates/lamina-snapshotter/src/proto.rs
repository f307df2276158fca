//! containerd's snapshots gRPC messages (`containerd.services.snapshots.v1`
//! and `containerd.types.Mount`), written with prost's derive from the field
//! numbers of containerd's API. This is the one place the wire format is
//! defined; `build.rs` describes the service that carries them.
#![allow(missing_docs)]

use std::collections::HashMap;

use prost_types::{FieldMask, Timestamp};

/// A mount for the caller to perform (`containerd.types.Mount`).
#[derive(Clone, PartialEq, prost::Message)]
pub struct Mount {
    #[prost(string, tag = "1")]
    pub r#type: String,
    #[prost(string, tag = "2")]
    pub source: String,
    #[prost(string, tag = "3")]
    pub target: String,
    #[prost(string, repeated, tag = "4")]
    pub options: Vec<String>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct PrepareSnapshotRequest {
    #[prost(string, tag = "1")]
    pub snapshotter: String,
    #[prost(string, tag = "2")]
    pub key: String,
    #[prost(string, tag = "3")]
    pub parent: String,
    #[prost(map = "string, string", tag = "4")]
    pub labels: HashMap<String, String>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct PrepareSnapshotResponse {
    #[prost(message, repeated, tag = "1")]
    pub mounts: Vec<Mount>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct ViewSnapshotRequest {
    #[prost(string, tag = "1")]
    pub snapshotter: String,
    #[prost(string, tag = "2")]
    pub key: String,
    #[prost(string, tag = "3")]
    pub parent: String,
    #[prost(map = "string, string", tag = "4")]
    pub labels: HashMap<String, String>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct ViewSnapshotResponse {
    #[prost(message, repeated, tag = "1")]
    pub mounts: Vec<Mount>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct MountsRequest {
    #[prost(string, tag = "1")]
    pub snapshotter: String,
    #[prost(string, tag = "2")]
    pub key: String,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct MountsResponse {
    #[prost(message, repeated, tag = "1")]
    pub mounts: Vec<Mount>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct RemoveSnapshotRequest {
    #[prost(string, tag = "1")]
    pub snapshotter: String,
    #[prost(string, tag = "2")]
    pub key: String,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct CommitSnapshotRequest {
    #[prost(string, tag = "1")]
    pub snapshotter: String,
    #[prost(string, tag = "2")]
    pub name: String,
    #[prost(string, tag = "3")]
    pub key: String,
    #[prost(map = "string, string", tag = "4")]
    pub labels: HashMap<String, String>,
    /// containerd 2.x: the parent the commit rebases onto (unsupported here).
    #[prost(string, tag = "5")]
    pub parent: String,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct StatSnapshotRequest {
    #[prost(string, tag = "1")]
    pub snapshotter: String,
    #[prost(string, tag = "2")]
    pub key: String,
}

/// Kind of a snapshot.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, prost::Enumeration)]
#[repr(i32)]
pub enum Kind {
    Unknown = 0,
    View = 1,
    Active = 2,
    Committed = 3,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct Info {
    #[prost(string, tag = "1")]
    pub name: String,
    #[prost(string, tag = "2")]
    pub parent: String,
    #[prost(enumeration = "Kind", tag = "3")]
    pub kind: i32,
    #[prost(message, optional, tag = "4")]
    pub created_at: Option<Timestamp>,
    #[prost(message, optional, tag = "5")]
    pub updated_at: Option<Timestamp>,
    #[prost(map = "string, string", tag = "6")]
    pub labels: HashMap<String, String>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct StatSnapshotResponse {
    #[prost(message, optional, tag = "1")]
    pub info: Option<Info>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct UpdateSnapshotRequest {
    #[prost(string, tag = "1")]
    pub snapshotter: String,
    #[prost(message, optional, tag = "2")]
    pub info: Option<Info>,
    #[prost(message, optional, tag = "3")]
    pub update_mask: Option<FieldMask>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct UpdateSnapshotResponse {
    #[prost(message, optional, tag = "1")]
    pub info: Option<Info>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct ListSnapshotsRequest {
    #[prost(string, tag = "1")]
    pub snapshotter: String,
    #[prost(string, repeated, tag = "2")]
    pub filters: Vec<String>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct ListSnapshotsResponse {
    #[prost(message, repeated, tag = "1")]
    pub info: Vec<Info>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct UsageRequest {
    #[prost(string, tag = "1")]
    pub snapshotter: String,
    #[prost(string, tag = "2")]
    pub key: String,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct UsageResponse {
    #[prost(int64, tag = "1")]
    pub size: i64,
    #[prost(int64, tag = "2")]
    pub inodes: i64,
}

/// `google.protobuf.Empty`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Empty {}

#[derive(Clone, PartialEq, prost::Message)]
pub struct CleanupRequest {
    #[prost(string, tag = "1")]
    pub snapshotter: String,
}

include!(concat!(
    env!("OUT_DIR"),
    "/containerd.services.snapshots.v1.Snapshots.rs"
));
include!(concat!(env!("OUT_DIR"), "/runtime.v1.ImageService.rs"));
