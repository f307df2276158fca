//! Generates the gRPC server (and a client) for containerd's snapshots service
//! and the CRI image service from service descriptions written here
//! (tonic-build's manual mode): no .proto file and no protoc. The messages are
//! in src/proto.rs and src/cri.rs.

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

/// The CRI image service (`runtime.v1.ImageService`), forwarded to
/// containerd as raw bytes (src/cri.rs): (rust name, route, streaming).
const CRI_IMAGE_METHODS: &[(&str, &str, bool)] = &[
    ("list_images", "ListImages", false),
    ("stream_images", "StreamImages", true),
    ("image_status", "ImageStatus", false),
    ("pull_image", "PullImage", false),
    ("remove_image", "RemoveImage", false),
    ("image_fs_info", "ImageFsInfo", false),
];

fn cri_image_service() -> Service {
    let mut service = Service::builder()
        .name("ImageService")
        .package("runtime.v1");
    for &(name, route, streaming) in CRI_IMAGE_METHODS {
        let mut method = Method::builder()
            .name(name)
            .route_name(route)
            .input_type("crate::cri::Raw")
            .output_type("crate::cri::Raw")
            .codec_path("crate::cri::RawCodec");
        if streaming {
            method = method.server_streaming();
        }
        service = service.method(method.build());
    }
    service.build()
}

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
        .compile(&[service.build(), cri_image_service()]);
}
