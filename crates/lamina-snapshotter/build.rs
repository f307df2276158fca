//! Generates the gRPC server (and a client) for containerd's snapshots service from a
//! service description written here (tonic-build's manual mode): no .proto
//! file and no protoc. The messages are in src/proto.rs.

use tonic_build::manual::{Builder, Method, Service};

/// (rust name, route name, request, response, server-streaming)
const METHODS: &[(&str, &str, &str, &str, bool)] = &[
    (
        "prepare",
        "Prepare",
        "PrepareSnapshotRequest",
        "PrepareSnapshotResponse",
        false,
    ),
    (
        "view",
        "View",
        "ViewSnapshotRequest",
        "ViewSnapshotResponse",
        false,
    ),
    ("mounts", "Mounts", "MountsRequest", "MountsResponse", false),
    ("commit", "Commit", "CommitSnapshotRequest", "Empty", false),
    ("remove", "Remove", "RemoveSnapshotRequest", "Empty", false),
    (
        "stat",
        "Stat",
        "StatSnapshotRequest",
        "StatSnapshotResponse",
        false,
    ),
    (
        "update",
        "Update",
        "UpdateSnapshotRequest",
        "UpdateSnapshotResponse",
        false,
    ),
    (
        "list",
        "List",
        "ListSnapshotsRequest",
        "ListSnapshotsResponse",
        true,
    ),
    ("usage", "Usage", "UsageRequest", "UsageResponse", false),
    ("cleanup", "Cleanup", "CleanupRequest", "Empty", false),
];

fn main() {
    let mut service = Service::builder()
        .name("Snapshots")
        .package("containerd.services.snapshots.v1");
    for &(name, route, input, output, streaming) in METHODS {
        let ty = |t: &str| format!("crate::proto::{t}");
        let mut method = Method::builder()
            .name(name)
            .route_name(route)
            .input_type(ty(input))
            .output_type(ty(output))
            .codec_path("tonic_prost::ProstCodec");
        if streaming {
            method = method.server_streaming();
        }
        service = service.method(method.build());
    }
    // The client is for tests that call a running snapshotter.
    Builder::new()
        .build_client(true)
        .compile(&[service.build()]);
}
