//! What the container runs, from the image config and the command line, with
//! docker's rules. Pure (no I/O): every rule here is unit-tested without root.

use std::path::{Component, Path, PathBuf};
use std::str::FromStr;

use serde::Deserialize;

/// PATH when neither the image nor `-e` sets one (docker's default).
pub const DEFAULT_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

/// Why the image config or the flags do not describe a runnable container.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The image config is not what the OCI image spec describes.
    #[error("image config: {0}")]
    Image(String),
    /// A `-v` argument.
    #[error("bad volume {spec:?}: {why} (expected SRC:DST[:ro|rw], both absolute)")]
    Volume {
        /// The argument as given.
        spec: String,
        /// What is wrong with it.
        why: &'static str,
    },
    /// A `-e` argument or an image `Env` entry.
    #[error("bad environment variable {0:?}: the name is empty")]
    Env(String),
    /// A user name absent from the image's `/etc/passwd`.
    #[error("unable to find user {0}: no matching entries in the image's /etc/passwd")]
    UnknownUser(String),
    /// A group name absent from the image's `/etc/group`.
    #[error("unable to find group {0}: no matching entries in the image's /etc/group")]
    UnknownGroup(String),
    /// A user spec that is not `user[:group]`.
    #[error("bad user {0:?}: expected uid, uid:gid, name or name:group")]
    BadUser(String),
    /// Neither the image nor the command line names a program.
    #[error("no command: the image has no Entrypoint or Cmd and none was given after --")]
    NoCommand,
    /// A `--name` argument.
    #[error(
        "bad container name {0:?}: use 1 to 64 of [A-Za-z0-9_.-], starting with a letter or digit"
    )]
    Name(String),
    /// A `--net` argument.
    #[error("bad network {0:?}: expected host or none")]
    Network(String),
    /// A `--cap-add` argument.
    #[error("unknown capability {0:?} (e.g. NET_RAW or CAP_NET_RAW)")]
    Capability(String),
    /// A `--security-opt` argument.
    #[error(
        "bad security option {0:?}: expected no-new-privileges[=true|false] or seccomp=unconfined"
    )]
    SecurityOpt(String),
}

/// The runtime part of an OCI image config (`config` in the config JSON).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ImageConfig {
    /// `User`: empty means root.
    pub user: String,
    /// `Env`: `KEY=VALUE` entries.
    pub env: Vec<String>,
    /// `Entrypoint`.
    pub entrypoint: Vec<String>,
    /// `Cmd`.
    pub cmd: Vec<String>,
    /// `WorkingDir`: empty means `/`.
    pub working_dir: String,
}

#[derive(Deserialize)]
struct RawImage {
    #[serde(default)]
    config: Option<RawConfig>,
}

#[derive(Deserialize)]
#[serde(rename_all = "PascalCase")]
struct RawConfig {
    user: Option<String>,
    env: Option<Vec<String>>,
    entrypoint: Option<Vec<String>>,
    cmd: Option<Vec<String>>,
    working_dir: Option<String>,
}

impl ImageConfig {
    /// Reads the runtime config out of an image config document; absent or
    /// null fields take their defaults, wrongly typed ones are refused.
    pub fn from_json(doc: &serde_json::Value) -> Result<ImageConfig, ConfigError> {
        let raw = RawImage::deserialize(doc).map_err(|e| ConfigError::Image(e.to_string()))?;
        let Some(c) = raw.config else {
            return Ok(ImageConfig::default());
        };
        Ok(ImageConfig {
            user: c.user.unwrap_or_default(),
            env: c.env.unwrap_or_default(),
            entrypoint: c.entrypoint.unwrap_or_default(),
            cmd: c.cmd.unwrap_or_default(),
            working_dir: c.working_dir.unwrap_or_default(),
        })
    }

    /// The working directory: `WorkingDir`, `/` when empty; a relative one
    /// is taken from `/`, as docker does.
    pub fn cwd(&self, flag: Option<&str>) -> String {
        let dir = flag.unwrap_or(&self.working_dir);
        match dir {
            "" => "/".to_string(),
            d if d.starts_with('/') => d.to_string(),
            d => format!("/{d}"),
        }
    }
}

/// The process's argv with docker's rules: `Entrypoint` + `Cmd`; arguments
/// after `--` replace `Cmd` and keep `Entrypoint`; `--entrypoint` replaces
/// `Entrypoint` and drops the image's `Cmd` (an empty one clears it).
pub fn command(
    config: &ImageConfig,
    entrypoint: Option<&str>,
    args: &[String],
) -> Result<Vec<String>, ConfigError> {
    let (entry, image_cmd) = match entrypoint {
        Some("") => (Vec::new(), &[][..]),
        Some(e) => (vec![e.to_string()], &[][..]),
        None => (config.entrypoint.clone(), &config.cmd[..]),
    };
    let cmd = if args.is_empty() { image_cmd } else { args };
    let argv: Vec<String> = entry.into_iter().chain(cmd.iter().cloned()).collect();
    if argv.is_empty() {
        return Err(ConfigError::NoCommand);
    }
    Ok(argv)
}

/// The environment: docker's defaults (PATH, HOSTNAME, TERM with a
/// terminal), then the image's `Env`, then `-e` flags; a later entry for a
/// name replaces an earlier one in place. `-e KEY` takes KEY's value from
/// `lookup` (lamina's own environment) and is dropped when it has none.
/// HOME comes last, from the user's passwd entry, unless set already.
pub fn environment(
    image: &[String],
    flags: &[String],
    defaults: &[(&str, &str)],
    home: &str,
    lookup: impl Fn(&str) -> Option<String>,
) -> Result<Vec<String>, ConfigError> {
    let mut env: Vec<(String, String)> = Vec::new();
    let set = |env: &mut Vec<(String, String)>, key: &str, value: String| match env
        .iter_mut()
        .find(|(k, _)| k == key)
    {
        Some(slot) => slot.1 = value,
        None => env.push((key.to_string(), value)),
    };
    for (k, v) in defaults {
        set(&mut env, k, v.to_string());
    }
    for entry in image {
        // The image spec says KEY=VALUE; a bare name carries no value.
        if let Some((k, v)) = entry.split_once('=') {
            if k.is_empty() {
                return Err(ConfigError::Env(entry.clone()));
            }
            set(&mut env, k, v.to_string());
        }
    }
    for flag in flags {
        let (k, v) = match flag.split_once('=') {
            Some((k, v)) => (k, Some(v.to_string())),
            None => (flag.as_str(), lookup(flag)),
        };
        if k.is_empty() {
            return Err(ConfigError::Env(flag.clone()));
        }
        if let Some(v) = v {
            set(&mut env, k, v);
        }
    }
    if !env.iter().any(|(k, _)| k == "HOME") {
        set(&mut env, "HOME", home.to_string());
    }
    Ok(env.into_iter().map(|(k, v)| format!("{k}={v}")).collect())
}

/// The user the process runs as.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct User {
    /// uid.
    pub uid: u32,
    /// Primary gid.
    pub gid: u32,
    /// Groups of `/etc/group` that list the user by name.
    pub additional_gids: Vec<u32>,
    /// Home directory from `/etc/passwd`, `/` without an entry.
    pub home: String,
}

/// Resolves `User` (`uid`, `uid:gid`, `name`, `name:group`; empty is
/// root) against the image's `/etc/passwd` and `/etc/group` (None: the
/// image has no such file). Names must exist there; numbers need not, as
/// with docker: a uid without an entry gets gid 0 and home `/`.
pub fn resolve_user(
    spec: &str,
    passwd: Option<&str>,
    group: Option<&str>,
) -> Result<User, ConfigError> {
    let (user_part, group_part) = match spec.split_once(':') {
        Some((u, g)) => (u, Some(g)),
        None => (spec, None),
    };
    if group_part.is_some_and(|g| g.is_empty() || g.contains(':')) {
        return Err(ConfigError::BadUser(spec.to_string()));
    }
    let user_part = if user_part.is_empty() { "0" } else { user_part };
    let entries: Vec<PasswdEntry> = passwd.map(parse_passwd).unwrap_or_default();
    let groups: Vec<GroupEntry> = group.map(parse_group).unwrap_or_default();
    let entry = match user_part.parse::<u32>() {
        Ok(uid) => entries
            .iter()
            .find(|e| e.uid == uid)
            .cloned()
            .or(Some(PasswdEntry {
                name: String::new(),
                uid,
                gid: 0,
                home: "/".into(),
            })),
        Err(_) => entries.iter().find(|e| e.name == user_part).cloned(),
    }
    .ok_or_else(|| ConfigError::UnknownUser(user_part.to_string()))?;
    let gid = match group_part {
        None => entry.gid,
        Some(g) => match g.parse::<u32>() {
            Ok(gid) => gid,
            Err(_) => {
                groups
                    .iter()
                    .find(|e| e.name == g)
                    .ok_or_else(|| ConfigError::UnknownGroup(g.to_string()))?
                    .gid
            }
        },
    };
    let mut additional_gids: Vec<u32> = groups
        .iter()
        .filter(|g| !entry.name.is_empty() && g.members.contains(&entry.name))
        .map(|g| g.gid)
        .filter(|&g| g != gid)
        .collect();
    additional_gids.dedup();
    Ok(User {
        uid: entry.uid,
        gid,
        additional_gids,
        home: entry.home,
    })
}

#[derive(Debug, Clone)]
struct PasswdEntry {
    name: String,
    uid: u32,
    gid: u32,
    home: String,
}

#[derive(Debug)]
struct GroupEntry {
    name: String,
    gid: u32,
    members: Vec<String>,
}

/// `name:x:uid:gid:gecos:home:shell` lines; malformed lines are skipped,
/// as libc's getpwnam does.
fn parse_passwd(text: &str) -> Vec<PasswdEntry> {
    text.lines()
        .filter_map(|line| {
            let f: Vec<&str> = line.split(':').collect();
            if f.len() < 7 || f[0].is_empty() || line.starts_with('#') {
                return None;
            }
            Some(PasswdEntry {
                name: f[0].to_string(),
                uid: f[2].parse().ok()?,
                gid: f[3].parse().ok()?,
                home: if f[5].is_empty() { "/" } else { f[5] }.to_string(),
            })
        })
        .collect()
}

/// `name:x:gid:member,member` lines; malformed lines are skipped.
fn parse_group(text: &str) -> Vec<GroupEntry> {
    text.lines()
        .filter_map(|line| {
            let f: Vec<&str> = line.split(':').collect();
            if f.len() < 4 || f[0].is_empty() || line.starts_with('#') {
                return None;
            }
            Some(GroupEntry {
                name: f[0].to_string(),
                gid: f[2].parse().ok()?,
                members: f[3]
                    .split(',')
                    .filter(|m| !m.is_empty())
                    .map(str::to_string)
                    .collect(),
            })
        })
        .collect()
}

/// A `-v SRC:DST[:ro|rw]` bind mount.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Volume {
    /// Host path (absolute).
    pub source: PathBuf,
    /// Path in the container (absolute, not `/`).
    pub destination: String,
    /// Mounted read-only.
    pub read_only: bool,
}

impl FromStr for Volume {
    type Err = ConfigError;

    fn from_str(spec: &str) -> Result<Volume, ConfigError> {
        let bad = |why| ConfigError::Volume {
            spec: spec.to_string(),
            why,
        };
        let parts: Vec<&str> = spec.split(':').collect();
        let (src, dst, read_only) = match parts[..] {
            [src, dst] => (src, dst, false),
            [src, dst, "ro"] => (src, dst, true),
            [src, dst, "rw"] => (src, dst, false),
            [_, _, _] => return Err(bad("the only options are ro and rw")),
            [_] => return Err(bad("no destination")),
            _ => return Err(bad("too many fields")),
        };
        if !src.starts_with('/') {
            return Err(bad(
                "the source must be an absolute host path (named volumes are not supported)",
            ));
        }
        if !dst.starts_with('/') {
            return Err(bad("the destination must be absolute"));
        }
        let dst_path = Path::new(dst);
        if dst_path.components().any(|c| c == Component::ParentDir) {
            return Err(bad("the destination must not contain .."));
        }
        if dst_path.components().all(|c| c == Component::RootDir) {
            return Err(bad("the destination must not be /"));
        }
        Ok(Volume {
            source: PathBuf::from(src),
            destination: dst.to_string(),
            read_only,
        })
    }
}

/// How the container reaches the network.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Network {
    /// The host's network namespace.
    Host,
    /// A new network namespace with only loopback (the default: an
    /// untrusted image reaches no network unless asked).
    #[default]
    None,
}

/// Linux capabilities, without their `CAP_` prefix.
const CAPABILITIES: &[&str] = &[
    "CHOWN",
    "DAC_OVERRIDE",
    "DAC_READ_SEARCH",
    "FOWNER",
    "FSETID",
    "KILL",
    "SETGID",
    "SETUID",
    "SETPCAP",
    "LINUX_IMMUTABLE",
    "NET_BIND_SERVICE",
    "NET_BROADCAST",
    "NET_ADMIN",
    "NET_RAW",
    "IPC_LOCK",
    "IPC_OWNER",
    "SYS_MODULE",
    "SYS_RAWIO",
    "SYS_CHROOT",
    "SYS_PTRACE",
    "SYS_PACCT",
    "SYS_ADMIN",
    "SYS_BOOT",
    "SYS_NICE",
    "SYS_RESOURCE",
    "SYS_TIME",
    "SYS_TTY_CONFIG",
    "MKNOD",
    "LEASE",
    "AUDIT_WRITE",
    "AUDIT_CONTROL",
    "SETFCAP",
    "MAC_OVERRIDE",
    "MAC_ADMIN",
    "SYSLOG",
    "WAKE_ALARM",
    "BLOCK_SUSPEND",
    "AUDIT_READ",
    "PERFMON",
    "BPF",
    "CHECKPOINT_RESTORE",
];

/// A `--cap-add` argument (`NET_RAW`, `CAP_NET_RAW`, any case) as its
/// `CAP_` name.
pub fn parse_capability(s: &str) -> Result<String, ConfigError> {
    let upper = s.to_ascii_uppercase();
    let bare = upper.strip_prefix("CAP_").unwrap_or(&upper);
    match CAPABILITIES.contains(&bare) {
        true => Ok(format!("CAP_{bare}")),
        false => Err(ConfigError::Capability(s.to_string())),
    }
}

/// Applies a `--security-opt` argument, as docker takes it:
/// `no-new-privileges[=true|false]` or `seccomp=unconfined`.
pub fn apply_security_opt(
    opt: &str,
    security: &mut crate::spec::Security,
) -> Result<(), ConfigError> {
    match opt.split_once(['=', ':']) {
        None if opt == "no-new-privileges" => security.no_new_privileges = true,
        Some(("no-new-privileges", "true")) => security.no_new_privileges = true,
        Some(("no-new-privileges", "false")) => security.no_new_privileges = false,
        Some(("seccomp", "unconfined")) => security.seccomp = false,
        _ => return Err(ConfigError::SecurityOpt(opt.to_string())),
    }
    Ok(())
}

impl FromStr for Network {
    type Err = ConfigError;

    fn from_str(s: &str) -> Result<Network, ConfigError> {
        match s {
            "host" => Ok(Network::Host),
            "none" => Ok(Network::None),
            _ => Err(ConfigError::Network(s.to_string())),
        }
    }
}

/// Checks a `--name`: it becomes a directory name and runc's container id.
pub fn check_name(name: &str) -> Result<(), ConfigError> {
    let ok = (1..=64).contains(&name.len())
        && name.starts_with(|c: char| c.is_ascii_alphanumeric())
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "_.-".contains(c));
    if ok {
        Ok(())
    } else {
        Err(ConfigError::Name(name.to_string()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const PASSWD: &str = "root:x:0:0:root:/root:/bin/bash\n\
        # a comment\n\
        daemon:x:1:1:daemon:/usr/sbin:/usr/sbin/nologin\n\
        broken line\n\
        www-data:x:33:33:www-data:/var/www:/usr/sbin/nologin\n\
        app:x:1000:1000::/home/app:/bin/sh\n";
    const GROUP: &str = "root:x:0:\n\
        www-data:x:33:\n\
        redis:x:105:\n\
        app:x:1000:\n\
        audio:x:29:app,www-data\n\
        video:x:44:app\n";

    fn user(spec: &str) -> Result<User, ConfigError> {
        resolve_user(spec, Some(PASSWD), Some(GROUP))
    }

    #[test]
    fn empty_user_is_root() {
        let u = user("").unwrap();
        assert_eq!((u.uid, u.gid, u.home.as_str()), (0, 0, "/root"));
        assert!(u.additional_gids.is_empty());
    }

    #[test]
    fn numeric_uid_takes_its_passwd_entry() {
        let u = user("33").unwrap();
        assert_eq!((u.uid, u.gid, u.home.as_str()), (33, 33, "/var/www"));
        assert_eq!(u.additional_gids, vec![29]);
    }

    #[test]
    fn numeric_uid_without_entry_gets_gid_0_and_root_home() {
        let u = user("4242").unwrap();
        assert_eq!((u.uid, u.gid, u.home.as_str()), (4242, 0, "/"));
        let u = resolve_user("4242:7", None, None).unwrap();
        assert_eq!((u.uid, u.gid), (4242, 7));
    }

    #[test]
    fn name_and_group_names_resolve() {
        let u = user("app").unwrap();
        assert_eq!((u.uid, u.gid, u.home.as_str()), (1000, 1000, "/home/app"));
        assert_eq!(u.additional_gids, vec![29, 44]);
        let u = user("www-data:redis").unwrap();
        assert_eq!((u.uid, u.gid), (33, 105));
        let u = user("app:29").unwrap();
        assert_eq!((u.uid, u.gid), (1000, 29));
        // The primary group is not repeated among the additional ones.
        assert_eq!(u.additional_gids, vec![44]);
        let u = user("0:redis").unwrap();
        assert_eq!((u.uid, u.gid), (0, 105));
    }

    #[test]
    fn unknown_names_are_refused() {
        assert!(matches!(user("nobody"), Err(ConfigError::UnknownUser(n)) if n == "nobody"));
        assert!(matches!(user("app:wheel"), Err(ConfigError::UnknownGroup(g)) if g == "wheel"));
        // No passwd file at all: only numbers work.
        assert!(matches!(
            resolve_user("app", None, None),
            Err(ConfigError::UnknownUser(_))
        ));
        assert!(matches!(user("app:"), Err(ConfigError::BadUser(_))));
        assert!(matches!(user("a:b:c"), Err(ConfigError::BadUser(_))));
        let msg = user("nobody").unwrap_err().to_string();
        assert!(
            msg.contains("nobody") && msg.contains("/etc/passwd"),
            "{msg}"
        );
    }

    fn config(entry: &[&str], cmd: &[&str]) -> ImageConfig {
        ImageConfig {
            entrypoint: entry.iter().map(|s| s.to_string()).collect(),
            cmd: cmd.iter().map(|s| s.to_string()).collect(),
            ..ImageConfig::default()
        }
    }

    fn strings(s: &[&str]) -> Vec<String> {
        s.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn entrypoint_and_cmd_merge_as_docker_does() {
        let c = config(&["/entry", "-x"], &["default"]);
        assert_eq!(
            command(&c, None, &[]).unwrap(),
            strings(&["/entry", "-x", "default"])
        );
        // Arguments replace Cmd and keep Entrypoint.
        assert_eq!(
            command(&c, None, &strings(&["a", "b"])).unwrap(),
            strings(&["/entry", "-x", "a", "b"])
        );
        // --entrypoint drops the image's Cmd; "" clears the entrypoint.
        assert_eq!(
            command(&c, Some("/bin/sh"), &[]).unwrap(),
            strings(&["/bin/sh"])
        );
        assert_eq!(
            command(&c, Some(""), &strings(&["id"])).unwrap(),
            strings(&["id"])
        );
        let c = config(&[], &["/bin/bash"]);
        assert_eq!(command(&c, None, &[]).unwrap(), strings(&["/bin/bash"]));
        assert_eq!(
            command(&c, None, &strings(&["sh", "-c", "exit 3"])).unwrap(),
            strings(&["sh", "-c", "exit 3"])
        );
    }

    #[test]
    fn no_command_is_an_error() {
        assert!(matches!(
            command(&config(&[], &[]), None, &[]),
            Err(ConfigError::NoCommand)
        ));
        assert!(matches!(
            command(&config(&[], &["x"]), Some(""), &[]),
            Err(ConfigError::NoCommand)
        ));
    }

    #[test]
    fn environment_merges_later_wins_in_place() {
        let image = strings(&["PATH=/img/bin", "A=image", "B=image", "EMPTY="]);
        let flags = strings(&[
            "A=flag",
            "C=x=y",
            "FROM_HOST",
            "UNSET_ON_HOST",
            "B=1",
            "B=2",
        ]);
        let lookup = |k: &str| (k == "FROM_HOST").then(|| "host value".to_string());
        let env = environment(
            &image,
            &flags,
            &[("PATH", DEFAULT_PATH), ("HOSTNAME", "c1")],
            "/root",
            lookup,
        )
        .unwrap();
        assert_eq!(
            env,
            strings(&[
                "PATH=/img/bin",
                "HOSTNAME=c1",
                "A=flag",
                "B=2",
                "EMPTY=",
                "C=x=y",
                "FROM_HOST=host value",
                "HOME=/root",
            ])
        );
    }

    #[test]
    fn environment_defaults_and_home() {
        let env = environment(
            &[],
            &strings(&["HOME=/x"]),
            &[("PATH", DEFAULT_PATH)],
            "/root",
            |_| None,
        )
        .unwrap();
        assert_eq!(env, vec![format!("PATH={DEFAULT_PATH}"), "HOME=/x".into()]);
        assert!(matches!(
            environment(&[], &strings(&["=v"]), &[], "/", |_| None),
            Err(ConfigError::Env(_))
        ));
        assert!(matches!(
            environment(&strings(&["=v"]), &[], &[], "/", |_| None),
            Err(ConfigError::Env(_))
        ));
    }

    #[test]
    fn volumes_parse() {
        let v: Volume = "/host/dir:/data".parse().unwrap();
        assert_eq!(v.source, PathBuf::from("/host/dir"));
        assert_eq!((v.destination.as_str(), v.read_only), ("/data", false));
        assert!("/h:/d:ro".parse::<Volume>().unwrap().read_only);
        assert!(!"/h:/d:rw".parse::<Volume>().unwrap().read_only);
    }

    #[test]
    fn malformed_volumes_are_refused() {
        for bad in [
            "/only-source",
            "relative:/d",
            "named-volume:/d",
            "/h:relative",
            "/h:/d:rx",
            "/h:/d:ro:extra",
            "/h:/",
            "/h://",
            "/h:/a/../..",
            "",
            ":/d",
        ] {
            let err = bad.parse::<Volume>().unwrap_err();
            assert!(
                matches!(&err, ConfigError::Volume { spec, .. } if spec == bad),
                "{bad:?} gave {err:?}"
            );
        }
    }

    #[test]
    fn image_config_reads_fields_and_defaults() {
        let doc = serde_json::json!({
            "architecture": "amd64",
            "config": {
                "User": "www-data", "Env": ["A=1"], "Entrypoint": ["/e"],
                "Cmd": null, "WorkingDir": "srv", "Labels": {"x": "y"}
            }
        });
        let c = ImageConfig::from_json(&doc).unwrap();
        assert_eq!(c.user, "www-data");
        assert_eq!(c.env, vec!["A=1".to_string()]);
        assert_eq!(c.entrypoint, vec!["/e".to_string()]);
        assert!(c.cmd.is_empty());
        assert_eq!(c.cwd(None), "/srv");
        assert_eq!(c.cwd(Some("/w")), "/w");
        let c = ImageConfig::from_json(&serde_json::json!({"os": "linux"})).unwrap();
        assert_eq!((c.cwd(None).as_str(), c.user.as_str()), ("/", ""));
        assert!(ImageConfig::from_json(&serde_json::json!({"config": {"Cmd": "ls"}})).is_err());
    }

    #[test]
    fn names_and_networks() {
        for ok in ["a", "web-1", "A.b_c", &"x".repeat(64)] {
            check_name(ok).unwrap();
        }
        for bad in ["", "-a", ".a", "a/b", "a b", "ä", &"x".repeat(65)] {
            assert!(check_name(bad).is_err(), "{bad:?}");
        }
        assert_eq!("none".parse::<Network>().unwrap(), Network::None);
        assert_eq!("host".parse::<Network>().unwrap(), Network::Host);
        assert!("bridge".parse::<Network>().is_err());
        assert_eq!(Network::default(), Network::None);
    }

    #[test]
    fn capabilities_and_security_options() {
        assert_eq!(parse_capability("net_raw").unwrap(), "CAP_NET_RAW");
        assert_eq!(parse_capability("CAP_SYS_ADMIN").unwrap(), "CAP_SYS_ADMIN");
        assert!(parse_capability("NET_MAGIC").is_err());
        let mut s = crate::spec::Security::default();
        assert!(s.no_new_privileges && s.seccomp);
        apply_security_opt("no-new-privileges=false", &mut s).unwrap();
        apply_security_opt("seccomp=unconfined", &mut s).unwrap();
        assert!(!s.no_new_privileges && !s.seccomp);
        apply_security_opt("no-new-privileges", &mut s).unwrap();
        assert!(s.no_new_privileges);
        assert!(apply_security_opt("apparmor=x", &mut s).is_err());
    }
}
