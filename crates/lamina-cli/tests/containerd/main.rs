//! `lamina snapshotter` under real containerd: Debian's 1.6 (images pulled
//! with `ctr-remote image rpull`, which passes stargz's remote-snapshot
//! labels) and 2.x built from its Go module by scripts/setup.sh (images
//! pulled with `ctr image pull` through the transfer service, which passes
//! the CRI labels when the proxy plugin exports
//! `enable_remote_snapshot_annotations`). Each test runs a private
//! containerd (its own root, state and sockets), a private snapshotter, the
//! local registry and runc.

#[path = "../common/mod.rs"]
mod common;

mod fixture;
mod node;

mod clients;
mod pulls;
mod shared;
mod snapshotter;

const LAMINA_IMAGE: &str = "deb:lamina";
const PLAIN_IMAGE: &str = "deb:plain";
/// The source image as it is (digests preserved), with a tar index beside
/// it (`lamina index`), in a repository of its own.
const ORIG_IMAGE: &str = "orig:bookworm";
const SRC_TAG: &str = "bookworm";
/// The source image as it is, in a repository of its own, with a forged tar
/// index (python3.11 setuid) listed as a referrer and nothing bound.
const HOSTILE_IMAGE: &str = "hostile:bookworm";
/// A plain image whose command sleeps: the pod sandbox ("pause") image.
const PAUSE_IMAGE: &str = "pause:1";

/// Where scripts/setup.sh installs containerd 2.x (containerd, ctr and the
/// runc shim, built from containerd's Go module).
const CONTAINERD2_DIR: &str = "/var/cache/lamina-test/go/containerd-v2.4.2";

/// Where scripts/setup.sh installs dockerd and the docker client (built from
/// moby's and docker/cli's Go modules).
const DOCKER_DIR: &str = "/var/cache/lamina-test/go/dockerd-v28.5.2";

#[derive(Debug, Clone, Copy, PartialEq)]
enum Version {
    /// Debian's containerd 1.6.
    V16,
    /// containerd 2.x from its Go module.
    V2,
}
