//! The snapshotter's metadata: every snapshot's name, kind, parent, labels,
//! times and what backs it. Kept in one JSON file under the root, replaced
//! atomically (temp file, fsync, rename) after every change, so a restart
//! or a crash finds either the old or the new state, never a mix. Snapshot
//! directories are created before the state names them and removed after
//! it no longer does; `Cleanup` removes directories the state does not name.

use std::collections::BTreeMap;
use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::SystemTime;

use serde::{Deserialize, Serialize};

/// A snapshot's kind, as containerd defines it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Kind {
    /// Read-only view of a parent.
    View,
    /// Writable, not yet committed.
    Active,
    /// Immutable, may have children.
    Committed,
}

impl Kind {
    /// containerd's name for the kind (filters use it).
    pub fn as_str(self) -> &'static str {
        match self {
            Kind::View => "view",
            Kind::Active => "active",
            Kind::Committed => "committed",
        }
    }
}

/// What a snapshot's directory holds.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "type")]
pub enum Backing {
    /// An ordinary overlayfs layer: `fs/` is its content (or upper dir).
    Overlay,
    /// A layer of a lamina image below its top: no content of its own; the
    /// image's top snapshot mounts the whole image.
    LaminaLayer {
        /// The layer's digest.
        layer: String,
    },
    /// The top layer of a lamina image: the whole image, mounted lazily at
    /// `lamina/` in the snapshot's directory.
    LaminaImage {
        /// What was mounted: `HOST/REPO@DIGEST`, pinned to the manifest.
        image: String,
    },
}

/// One snapshot.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Snapshot {
    /// Names the snapshot's directory, `snapshots/ID`; never reused.
    pub id: u64,
    /// Kind.
    pub kind: Kind,
    /// Parent's name, "" for none.
    pub parent: String,
    /// Labels.
    pub labels: BTreeMap<String, String>,
    /// Creation time.
    pub created: SystemTime,
    /// Last update (labels, commit).
    pub updated: SystemTime,
    /// What backs it.
    pub backing: Backing,
    /// Disk usage when committed: (bytes, inodes).
    #[serde(default)]
    pub usage: Option<(i64, i64)>,
}

/// All snapshots, by name.
#[derive(Debug, Default, Serialize, Deserialize)]
pub struct State {
    /// The next snapshot id.
    pub next_id: u64,
    /// Snapshots by name.
    pub snapshots: BTreeMap<String, Snapshot>,
}

const STATE_FILE: &str = "state.json";

impl State {
    /// Loads the state under `root`; a root without one starts empty.
    pub fn load(root: &Path) -> std::io::Result<State> {
        match fs::read(root.join(STATE_FILE)) {
            Ok(bytes) => serde_json::from_slice(&bytes).map_err(|e| {
                std::io::Error::other(format!("{}: {e}", root.join(STATE_FILE).display()))
            }),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(State {
                next_id: 1,
                ..State::default()
            }),
            Err(e) => Err(e),
        }
    }

    /// Replaces the state file under `root` atomically and durably.
    pub fn save(&self, root: &Path) -> std::io::Result<()> {
        let bytes = serde_json::to_vec(self).map_err(std::io::Error::other)?;
        let tmp = root.join(format!(".{STATE_FILE}.{}", std::process::id()));
        let mut f = fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .open(&tmp)?;
        f.write_all(&bytes)?;
        f.sync_all()?;
        fs::rename(&tmp, root.join(STATE_FILE))?;
        fs::File::open(root)?.sync_all()
    }

    /// Takes a fresh id.
    pub fn take_id(&mut self) -> u64 {
        let id = self.next_id.max(1);
        self.next_id = id + 1;
        id
    }

    /// Names of the snapshots whose parent is `name`.
    pub fn children<'a>(&'a self, name: &'a str) -> impl Iterator<Item = &'a str> + 'a {
        self.snapshots
            .iter()
            .filter(move |(_, s)| s.parent == name)
            .map(|(n, _)| n.as_str())
    }
}

/// Directory of snapshot `id` under `root`.
pub fn snapshot_dir(root: &Path, id: u64) -> PathBuf {
    root.join("snapshots").join(id.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn state_round_trips_and_ids_are_not_reused() {
        let dir = tempfile::tempdir().unwrap();
        let mut st = State::load(dir.path()).unwrap();
        let now = SystemTime::now();
        let id = st.take_id();
        st.snapshots.insert(
            "a".into(),
            Snapshot {
                id,
                kind: Kind::Committed,
                parent: String::new(),
                labels: [("l".to_string(), "1".to_string())].into(),
                created: now,
                updated: now,
                backing: Backing::LaminaImage {
                    image: "127.0.0.1:5000/x@sha256:00".into(),
                },
                usage: Some((4096, 1)),
            },
        );
        st.save(dir.path()).unwrap();
        let mut back = State::load(dir.path()).unwrap();
        assert_eq!(back.snapshots, st.snapshots);
        assert_ne!(back.take_id(), id);
        // No temp file left behind.
        let names: Vec<_> = fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, vec![std::ffi::OsString::from(STATE_FILE)]);
    }

    #[test]
    fn a_corrupt_state_file_is_an_error_not_an_empty_state() {
        let dir = tempfile::tempdir().unwrap();
        fs::write(dir.path().join(STATE_FILE), b"{not json").unwrap();
        let err = State::load(dir.path()).unwrap_err().to_string();
        assert!(err.contains(STATE_FILE), "{err}");
    }
}
