//! The OCI runtime spec (`config.json` of the bundle) runc runs. Pure.
//!
//! Defaults follow docker 29 (moby's `oci.DefaultLinuxSpec`: mounts,
//! `/proc` without setuid, devices or exec, masked and read-only paths;
//! capability set, effective capabilities only for uid 0, its default
//! seccomp profile's rules: [`crate::seccomp`]), made safe for untrusted
//! images: no `CAP_NET_RAW` and `noNewPrivileges` unless asked, and
//! podman's pids limit (2048) ([`Security`]). docs/run.md lists every
//! difference from docker's defaults.

use std::path::{Path, PathBuf};

use serde_json::{json, Value};

use crate::config::{Network, User, Volume};
pub use lamina_sys::idmap::IdRange;

/// The OCI runtime spec version written (runc 1.1 reads 1.0.x).
const OCI_VERSION: &str = "1.0.2";

/// docker's default capability set without `CAP_NET_RAW` (raw sockets:
/// forged packets on the host's networks), as podman's.
pub const DEFAULT_CAPS: &[&str] = &[
    "CAP_CHOWN",
    "CAP_DAC_OVERRIDE",
    "CAP_FSETID",
    "CAP_FOWNER",
    "CAP_MKNOD",
    "CAP_SETGID",
    "CAP_SETUID",
    "CAP_SETFCAP",
    "CAP_SETPCAP",
    "CAP_NET_BIND_SERVICE",
    "CAP_SYS_CHROOT",
    "CAP_KILL",
    "CAP_AUDIT_WRITE",
];

/// moby's masked paths (docker 29).
const MASKED: &[&str] = &[
    "/proc/acpi",
    "/proc/asound",
    "/proc/interrupts",
    "/proc/kcore",
    "/proc/keys",
    "/proc/latency_stats",
    "/proc/timer_list",
    "/proc/timer_stats",
    "/proc/sched_debug",
    "/proc/scsi",
    "/sys/firmware",
    "/sys/devices/virtual/powercap",
];

const READONLY: &[&str] = &[
    "/proc/bus",
    "/proc/fs",
    "/proc/irq",
    "/proc/sys",
    "/proc/sysrq-trigger",
];

/// What the container may do beyond docker's defaults, or less.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Security {
    /// Capabilities added to [`DEFAULT_CAPS`] (`CAP_*` names).
    pub cap_add: Vec<String>,
    /// `noNewPrivileges`: execve never grants more (setuid bits, file
    /// capabilities). On unless asked.
    pub no_new_privileges: bool,
    /// The default seccomp profile ([`crate::seccomp`]). On unless asked.
    pub seccomp: bool,
    /// Most processes (tasks) in the container, `None` for no limit:
    /// [`DEFAULT_PIDS_LIMIT`] unless asked (`--pids-limit`).
    pub pids_limit: Option<u64>,
}

/// podman's default pids limit (docker sets none): a fork bomb in one
/// container cannot take the node's pids.
pub const DEFAULT_PIDS_LIMIT: u64 = 2048;

impl Default for Security {
    fn default() -> Self {
        Security {
            cap_add: Vec::new(),
            no_new_privileges: true,
            seccomp: true,
            pids_limit: Some(DEFAULT_PIDS_LIMIT),
        }
    }
}

impl Security {
    /// The capability set: the defaults and those added, each once.
    pub fn capabilities(&self) -> Vec<String> {
        let mut caps: Vec<String> = DEFAULT_CAPS.iter().map(|c| c.to_string()).collect();
        for c in &self.cap_add {
            if !caps.contains(c) {
                caps.push(c.clone());
            }
        }
        caps
    }
}

/// Everything the spec depends on.
#[derive(Debug)]
pub struct SpecInput<'a> {
    /// The container's root (the overlay), absolute.
    pub rootfs: &'a Path,
    /// argv.
    pub args: &'a [String],
    /// `KEY=VALUE` entries.
    pub env: &'a [String],
    /// Working directory, absolute.
    pub cwd: &'a str,
    /// Who runs it.
    pub user: &'a User,
    /// UTS hostname.
    pub hostname: &'a str,
    /// Give the process a terminal.
    pub terminal: bool,
    /// Network namespace.
    pub network: Network,
    /// `-v` binds.
    pub volumes: &'a [Volume],
    /// Generated files bound over `/etc/hosts` etc.: (host file, path in
    /// the container).
    pub etc_files: &'a [(PathBuf, &'static str)],
    /// Capabilities, `noNewPrivileges`, seccomp.
    pub security: &'a Security,
    /// A user namespace mapping the container's ids to this host range
    /// (`--userns`); `None`: the host's ids.
    pub userns: Option<IdRange>,
}

/// The runtime spec as JSON.
pub fn runtime_spec(input: &SpecInput) -> Value {
    let caps = input.security.capabilities();
    // As docker: a non-root user gets the bounding set only, so its
    // processes hold no capability unless a file grants one.
    let effective: &[String] = if input.user.uid == 0 { &caps } else { &[] };
    let mut namespaces = vec![
        json!({"type": "pid"}),
        json!({"type": "ipc"}),
        json!({"type": "uts"}),
        json!({"type": "mount"}),
    ];
    if input.network == Network::None {
        // A new namespace: runc brings up its loopback and nothing else.
        namespaces.push(json!({"type": "network"}));
    }
    if input.userns.is_some() {
        namespaces.push(json!({"type": "user"}));
    }
    let mut spec = json!({
        "ociVersion": OCI_VERSION,
        "process": {
            "terminal": input.terminal,
            "user": {
                "uid": input.user.uid,
                "gid": input.user.gid,
                "additionalGids": input.user.additional_gids,
            },
            "args": input.args,
            "env": input.env,
            "cwd": input.cwd,
            "capabilities": {
                "bounding": caps,
                "effective": effective,
                "permitted": effective,
            },
            "noNewPrivileges": input.security.no_new_privileges,
        },
        "root": {"path": input.rootfs, "readonly": false},
        "hostname": input.hostname,
        "mounts": mounts(input),
        "linux": {
            "namespaces": namespaces,
            "resources": {"devices": [{"allow": false, "access": "rwm"}]},
            "maskedPaths": MASKED,
            "readonlyPaths": READONLY,
        },
    });
    if input.security.seccomp {
        spec["linux"]["seccomp"] = crate::seccomp::default_profile(&caps);
    }
    if let Some(limit) = input.security.pids_limit {
        spec["linux"]["resources"]["pids"] = json!({ "limit": limit });
    }
    if let Some(range) = input.userns {
        let map = json!([{"containerID": 0, "hostID": range.host, "size": range.size}]);
        spec["linux"]["uidMappings"] = map.clone();
        spec["linux"]["gidMappings"] = map;
    }
    spec
}

fn mounts(input: &SpecInput) -> Vec<Value> {
    let mut m = vec![
        mount("/proc", "proc", "proc", &["nosuid", "noexec", "nodev"]),
        mount(
            "/dev",
            "tmpfs",
            "tmpfs",
            &["nosuid", "strictatime", "mode=755", "size=65536k"],
        ),
        mount(
            "/dev/pts",
            "devpts",
            "devpts",
            &[
                "nosuid",
                "noexec",
                "newinstance",
                "ptmxmode=0666",
                "mode=0620",
                "gid=5",
            ],
        ),
        mount(
            "/dev/shm",
            "tmpfs",
            "shm",
            &["nosuid", "noexec", "nodev", "mode=1777", "size=65536k"],
        ),
        mount(
            "/dev/mqueue",
            "mqueue",
            "mqueue",
            &["nosuid", "noexec", "nodev"],
        ),
        mount(
            "/sys",
            "sysfs",
            "sysfs",
            &["nosuid", "noexec", "nodev", "ro"],
        ),
        mount(
            "/sys/fs/cgroup",
            "cgroup",
            "cgroup",
            &["nosuid", "noexec", "nodev", "relatime", "ro"],
        ),
    ];
    for (file, dest) in input.etc_files {
        m.push(bind(file, dest, true));
    }
    for v in input.volumes {
        m.push(bind(&v.source, &v.destination, v.read_only));
    }
    m
}

fn mount(destination: &str, kind: &str, source: &str, options: &[&str]) -> Value {
    json!({"destination": destination, "type": kind, "source": source, "options": options})
}

fn bind(source: &Path, destination: &str, read_only: bool) -> Value {
    json!({
        "destination": destination,
        "type": "bind",
        "source": source,
        "options": ["rbind", "rprivate", if read_only { "ro" } else { "rw" }],
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(user: User, network: Network, volumes: &[Volume]) -> Value {
        let args = vec!["sh".to_string(), "-c".into(), "exit 3".into()];
        let env = vec!["PATH=/bin".to_string()];
        let etc = vec![(PathBuf::from("/run/x/hosts"), "/etc/hosts")];
        runtime_spec(&SpecInput {
            rootfs: Path::new("/run/x/rootfs"),
            args: &args,
            env: &env,
            cwd: "/srv",
            user: &user,
            hostname: "c1",
            terminal: false,
            network,
            volumes,
            etc_files: &etc,
            security: &Security::default(),
            userns: None,
        })
    }

    fn root() -> User {
        User {
            uid: 0,
            gid: 0,
            additional_gids: vec![],
            home: "/root".into(),
        }
    }

    #[test]
    fn userns_maps_the_containers_ids_to_the_range() {
        let args = vec!["true".to_string()];
        let user = root();
        let input = SpecInput {
            rootfs: Path::new("/run/x/userns/c1/rootfs"),
            args: &args,
            env: &[],
            cwd: "/",
            user: &user,
            hostname: "c1",
            terminal: false,
            network: Network::None,
            volumes: &[],
            etc_files: &[],
            security: &Security::default(),
            userns: Some(IdRange {
                host: 200_000,
                size: 65_536,
            }),
        };
        let s = runtime_spec(&input);
        let namespaces = s["linux"]["namespaces"].as_array().unwrap();
        assert!(namespaces.contains(&json!({"type": "user"})));
        let map = json!([{"containerID": 0, "hostID": 200_000, "size": 65_536}]);
        assert_eq!(s["linux"]["uidMappings"], map);
        assert_eq!(s["linux"]["gidMappings"], map);
        let plain = spec(root(), Network::None, &[]);
        assert!(plain["linux"].get("uidMappings").is_none());
    }

    #[test]
    fn process_fields() {
        let s = spec(root(), Network::Host, &[]);
        let p = &s["process"];
        assert_eq!(p["args"], json!(["sh", "-c", "exit 3"]));
        assert_eq!(p["env"], json!(["PATH=/bin"]));
        assert_eq!(p["cwd"], "/srv");
        assert_eq!(p["user"], json!({"uid": 0, "gid": 0, "additionalGids": []}));
        assert_eq!(p["terminal"], false);
        assert_eq!(
            s["root"],
            json!({"path": "/run/x/rootfs", "readonly": false})
        );
        assert_eq!(s["hostname"], "c1");
        assert_eq!(
            p["capabilities"]["effective"],
            p["capabilities"]["bounding"]
        );
    }

    #[test]
    fn non_root_has_no_effective_caps() {
        let user = User {
            uid: 33,
            gid: 105,
            additional_gids: vec![29],
            home: "/".into(),
        };
        let s = spec(user, Network::Host, &[]);
        let p = &s["process"];
        assert_eq!(
            p["user"],
            json!({"uid": 33, "gid": 105, "additionalGids": [29]})
        );
        assert_eq!(p["capabilities"]["effective"], json!([]));
        assert_eq!(p["capabilities"]["permitted"], json!([]));
        assert_eq!(
            p["capabilities"]["bounding"].as_array().map(Vec::len),
            Some(DEFAULT_CAPS.len())
        );
    }

    /// Point 8 of the many-tenants issue: no raw sockets, no new
    /// privileges, docker's seccomp rules, unless asked.
    #[test]
    fn untrusted_images_get_no_raw_sockets_no_new_privileges_and_seccomp() {
        let s = spec(root(), Network::None, &[]);
        let p = &s["process"];
        let bounding = p["capabilities"]["bounding"].as_array().unwrap();
        assert!(!bounding.iter().any(|c| c == "CAP_NET_RAW"));
        assert_eq!(p["noNewPrivileges"], true);
        assert_eq!(s["linux"]["seccomp"]["defaultAction"], "SCMP_ACT_ERRNO");
        assert_eq!(s["linux"]["resources"]["pids"]["limit"], DEFAULT_PIDS_LIMIT);
        assert_eq!(
            s["mounts"][0]["options"],
            json!(["nosuid", "noexec", "nodev"])
        );
        let masked = s["linux"]["maskedPaths"].as_array().unwrap();
        for path in [
            "/proc/interrupts",
            "/sys/devices/virtual/powercap",
            "/proc/kcore",
        ] {
            assert!(masked.iter().any(|m| m == path), "{path} not masked");
        }
        let asked = Security {
            cap_add: vec!["CAP_NET_RAW".into()],
            no_new_privileges: false,
            seccomp: false,
            pids_limit: None,
        };
        let caps = asked.capabilities();
        assert!(caps.iter().any(|c| c == "CAP_NET_RAW"));
        assert_eq!(caps.len(), DEFAULT_CAPS.len() + 1);
    }

    fn has_netns(s: &Value) -> bool {
        s["linux"]["namespaces"]
            .as_array()
            .unwrap()
            .iter()
            .any(|n| n["type"] == "network")
    }

    #[test]
    fn network_none_is_a_new_namespace() {
        assert!(has_netns(&spec(root(), Network::None, &[])));
        assert!(!has_netns(&spec(root(), Network::Host, &[])));
    }

    #[test]
    fn volumes_and_etc_files_are_binds() {
        let vols = vec![
            "/h/a:/data".parse::<Volume>().unwrap(),
            "/h/b:/ro:ro".parse::<Volume>().unwrap(),
        ];
        let s = spec(root(), Network::Host, &vols);
        let binds: Vec<&Value> = s["mounts"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|m| m["type"] == "bind")
            .collect();
        assert_eq!(binds.len(), 3);
        assert_eq!(binds[0]["destination"], "/etc/hosts");
        assert_eq!(binds[0]["options"][2], "ro");
        assert_eq!(binds[1]["source"], "/h/a");
        assert_eq!(binds[1]["destination"], "/data");
        assert_eq!(binds[1]["options"], json!(["rbind", "rprivate", "rw"]));
        assert_eq!(binds[2]["options"][2], "ro");
        // The standard filesystems come first, binds after them.
        assert_eq!(s["mounts"][0]["destination"], "/proc");
    }
}
