//! The shared fixture: the Debian image as a lamina image, a plain one, a
//! pause image and the original tag with its index, in a registry's storage.

use std::ffi::OsStr;
use std::fs;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::time::Duration;

use crate::common::*;
use crate::{HOSTILE_IMAGE, LAMINA_IMAGE, ORIG_IMAGE, PAUSE_IMAGE, PLAIN_IMAGE, SRC_TAG};
use serde_json::Value;

/// The Debian image as a lamina image and as a plain one, in a registry's
/// storage (copied by every test), plus facts about it.
#[derive(Debug)]
pub(crate) struct Images {
    pub(crate) registry_data: PathBuf,
    /// The source layout (for the plain image's reference content).
    pub(crate) source: PathBuf,
    /// Digests of the lamina image's data blobs.
    pub(crate) blob_digests: Vec<String>,
    /// Their compressed bytes in all.
    pub(crate) blob_bytes: u64,
    /// The original image's layer digests and their bytes in all.
    pub(crate) orig_layers: Vec<String>,
    pub(crate) orig_bytes: u64,
}

pub(crate) fn images() -> &'static Images {
    static I: OnceLock<Images> = OnceLock::new();
    I.get_or_init(build_images)
}

// Over 100 lines: the images the tests share, built and pushed once, in order.
fn build_images() -> Images {
    let source = debian_source();
    let reg = Registry::start();
    lamina_timeout(
        [
            "convert",
            &oci_ref(&source, SRC_TAG),
            &reg.reference(LAMINA_IMAGE),
        ],
        Duration::from_secs(1200),
    )
    .ok();
    let mut c = command(
        tool("skopeo"),
        [
            "copy".to_string(),
            "--dest-tls-verify=false".into(),
            oci_ref(&source, SRC_TAG),
            reg.reference(PLAIN_IMAGE),
        ],
    );
    run(&mut c, TIMEOUT).ok();
    // The pod sandbox image: the plain image, made to sleep.
    let pause = fixtures().join("containerd-pause-oci");
    let _ = fs::remove_dir_all(&pause);
    run(
        &mut command(
            "cp",
            [OsStr::new("-a"), source.as_os_str(), pause.as_os_str()],
        ),
        TIMEOUT,
    )
    .ok();
    let mut c = command(
        tool("umoci"),
        [
            "config".to_string(),
            "--image".into(),
            format!("{}:{SRC_TAG}", pause.display()),
            "--tag".into(),
            "pause".into(),
            "--config.cmd".into(),
            "sleep".into(),
            "--config.cmd".into(),
            "infinity".into(),
        ],
    );
    run(&mut c, TIMEOUT).ok();
    let mut c = command(
        tool("skopeo"),
        [
            "copy".to_string(),
            "--dest-tls-verify=false".into(),
            oci_ref(&pause, "pause"),
            reg.reference(PAUSE_IMAGE),
        ],
    );
    run(&mut c, TIMEOUT).ok();
    reg.push(&source, SRC_TAG, ORIG_IMAGE);
    let index = lamina(["index", "--json", &reg.reference(ORIG_IMAGE)])
        .ok()
        .json();
    let orig_bytes = index[0]["image_layer_bytes"]
        .as_u64()
        .unwrap_or_else(|| panic!("no image_layer_bytes in {index}"));
    let orig_layers = source_layer_digests(&source);
    reg.push(&source, SRC_TAG, HOSTILE_IMAGE);
    push_setuid_index(&reg, HOSTILE_IMAGE, PYTHON);
    let inspect = lamina(["inspect", "--json", &reg.reference(LAMINA_IMAGE)])
        .ok()
        .json();
    let blobs = inspect["blobs"]
        .as_array()
        .unwrap_or_else(|| panic!("no blobs in {inspect}"));
    let blob_digests = blobs
        .iter()
        .map(|b| b["digest"].as_str().expect("blob digest").to_string())
        .collect();
    let blob_bytes = blobs
        .iter()
        .map(|b| {
            b["compressed_bytes"]
                .as_u64()
                .expect("blob compressed_bytes")
        })
        .sum();
    reg.stop();
    let registry_data = fixtures().join("containerd-registry-data");
    let _ = fs::remove_dir_all(&registry_data);
    let mut c = command(
        "cp",
        [
            OsStr::new("-a"),
            reg.dir().join("data").as_os_str(),
            registry_data.as_os_str(),
        ],
    );
    run(&mut c, TIMEOUT).ok();
    Images {
        registry_data,
        source,
        blob_digests,
        blob_bytes,
        orig_layers,
        orig_bytes,
    }
}

/// The layer digests of the source layout's image, from its manifest.
fn source_layer_digests(layout: &Path) -> Vec<String> {
    let blob = |digest: &str| -> Value {
        let path = layout
            .join("blobs/sha256")
            .join(digest.trim_start_matches("sha256:"));
        serde_json::from_slice(&fs::read(&path).unwrap()).unwrap()
    };
    let index: Value =
        serde_json::from_slice(&fs::read(layout.join("index.json")).unwrap()).unwrap();
    let top = index["manifests"]
        .as_array()
        .unwrap()
        .iter()
        .find(|m| m["annotations"]["org.opencontainers.image.ref.name"] == SRC_TAG)
        .unwrap_or_else(|| panic!("no {SRC_TAG} in {index}"));
    let manifest = blob(top["digest"].as_str().unwrap());
    manifest["layers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|l| l["digest"].as_str().unwrap().to_string())
        .collect()
}
