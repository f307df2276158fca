use std::os::unix::fs::PermissionsExt;
use std::time::Instant;

use super::*;

fn basic(u: &str, p: &str) -> Option<Credentials> {
    Some(Credentials::Basic {
        username: u.to_string(),
        password: p.to_string(),
    })
}

fn env_with(auth: Option<&str>, config: Option<&Path>, path: Option<&Path>) -> CredEnv {
    CredEnv {
        auth: auth.map(OsString::from),
        config: config.map(|p| (p.to_path_buf(), true)),
        path: path.map(|p| p.as_os_str().to_owned()),
        helper_timeout: Duration::from_secs(1),
    }
}

fn load(host: &str, env: &CredEnv) -> Option<Credentials> {
    load_credentials(host, env).expect("load")
}

#[test]
fn env_credentials_go_only_to_their_host() {
    let env = env_with(Some("127.0.0.1:5000=alice:pa:ss=word"), None, None);
    assert_eq!(load("127.0.0.1:5000", &env), basic("alice", "pa:ss=word"));
    assert_eq!(load("127.0.0.1:5001", &env), None);
    assert_eq!(load("127.0.0.1", &env), None);
    assert_eq!(load("reg.example.com", &env), None);

    let env = env_with(Some("Reg.Example.com=bob:pw"), None, None);
    assert_eq!(load("reg.example.com", &env), basic("bob", "pw"));
    assert_eq!(load("reg.example.com:443", &env), None);
    let env = env_with(Some("[::1]:5000=carol:pw"), None, None);
    assert_eq!(load("[::1]:5000", &env), basic("carol", "pw"));
}

#[test]
fn env_old_form_is_refused() {
    for value in [
        "alice:s3cret",
        "alice:s3=cret",
        "=alice:s3cret",
        "reg.example.com=alice",
        "reg.example.com=:s3cret",
        "reg/x=alice:s3cret",
        "https://reg.example.com=alice:s3cret",
    ] {
        let env = env_with(Some(value), None, None);
        let err = load_credentials("reg.example.com", &env).expect_err(value);
        let msg = err.to_string();
        assert!(msg.contains("HOST[:PORT]=USER:PASSWORD"), "{value}: {msg}");
        assert!(!msg.contains("s3"), "the password leaks into {msg}");
    }
}

#[test]
fn auths_key_forms() {
    let dir = tempfile::tempdir().expect("tmp");
    let path = dir.path().join("config.json");
    let b64 = |s: &str| base64::engine::general_purpose::STANDARD.encode(s);
    let config = serde_json::json!({"auths": {
        "https://reg.example.com/v1/": {"auth": b64("alice:s3cr:et")},
        "other.example.com:5000": {"username": "bob", "password": "pw"},
        "http://plain.example.com:8080": {"auth": b64("carol:pw")},
        "https://index.docker.io/v1/": {"auth": b64("dave:pw")},
        "idp.example.com": {"identitytoken": "refresh-me"},
        "empty.example.com": {},
    }});
    std::fs::write(&path, config.to_string()).expect("write");
    let env = env_with(None, Some(&path), None);
    assert_eq!(load("reg.example.com", &env), basic("alice", "s3cr:et"));
    assert_eq!(load("REG.example.com", &env), basic("alice", "s3cr:et"));
    assert_eq!(load("other.example.com:5000", &env), basic("bob", "pw"));
    assert_eq!(load("other.example.com", &env), None);
    assert_eq!(load("plain.example.com:8080", &env), basic("carol", "pw"));
    assert_eq!(load("docker.io", &env), basic("dave", "pw"));
    assert_eq!(
        load("idp.example.com", &env),
        Some(Credentials::IdentityToken("refresh-me".into()))
    );
    assert_eq!(load("empty.example.com", &env), None);
    assert_eq!(load("none.example.com", &env), None);
    // The env form wins for its host only.
    let env = env_with(Some("reg.example.com=eve:pw"), Some(&path), None);
    assert_eq!(load("reg.example.com", &env), basic("eve", "pw"));
    assert_eq!(load("other.example.com:5000", &env), basic("bob", "pw"));
    assert_eq!(
        helper_server_url("index.docker.io"),
        "https://index.docker.io/v1/"
    );
    assert_eq!(helper_server_url("h:5000"), "h:5000");
}

/// Fake `docker-credential-*` helpers, written before any of them runs (a
/// script still open for writing in a forked child cannot be executed).
fn write_helpers(dir: &Path) {
    let good = r#"#!/bin/sh
PATH=/usr/bin:/bin
read -r url
case "$url" in
reg.example.com|store.example.com) printf '{"ServerURL":"%s","Username":"alice","Secret":"pw"}' "$url" ;;
tok.example.com) printf '{"ServerURL":"%s","Username":"<token>","Secret":"refresh"}' "$url" ;;
*) echo "credentials not found in native keychain"; exit 1 ;;
esac
"#;
    let scripts = [
        ("good", good),
        (
            "broken",
            "#!/bin/sh\necho 'keyring is locked' >&2\nexit 3\n",
        ),
        // Leaves a child behind, and says which.
        (
            "hang",
            "#!/bin/sh\n/bin/sleep 30 &\necho $! > \"$(dirname \"$0\")/hang.child\"\nexec /bin/sleep 30\n",
        ),
        ("big", "#!/bin/sh\nexec /usr/bin/head -c 200000 /dev/zero\n"),
        ("notjson", "#!/bin/sh\necho hello\n"),
    ];
    for (name, text) in scripts {
        let p = dir.join(format!("docker-credential-{name}"));
        std::fs::write(&p, text).expect("write helper");
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    }
}

fn write_config(path: &Path, store: &str) {
    let b64 = base64::engine::general_purpose::STANDARD.encode("bob:inline");
    let config = serde_json::json!({
        "credsStore": store,
        "credHelpers": {
            "reg.example.com": "good",
            "tok.example.com": "good",
            "missing.example.com": "good",
            "broken.example.com": "broken",
            "hang.example.com": "hang",
            "big.example.com": "big",
            "notjson.example.com": "notjson",
            "bad.example.com": "../x",
        },
        "auths": {"inline.example.com": {"auth": b64}, "missing.example.com": {}},
    });
    std::fs::write(path, config.to_string()).expect("write config");
}

fn helper_err(host: &str, env: &CredEnv) -> String {
    load_credentials(host, env).expect_err(host).to_string()
}

#[test]
fn credential_helpers() {
    let dir = tempfile::tempdir().expect("tmp");
    let bin = dir.path().join("bin");
    std::fs::create_dir(&bin).expect("mkdir");
    write_helpers(&bin);
    let path = dir.path().join("config.json");
    write_config(&path, "good");
    let env = env_with(None, Some(&path), Some(&bin));

    // Found, by the per-host helper and by the default store.
    assert_eq!(load("reg.example.com", &env), basic("alice", "pw"));
    assert_eq!(load("store.example.com", &env), basic("alice", "pw"));
    assert_eq!(
        load("tok.example.com", &env),
        Some(Credentials::IdentityToken("refresh".into()))
    );
    // Not found: anonymous, or the inline auths entry when there is one.
    assert_eq!(load("missing.example.com", &env), None);
    assert_eq!(load("inline.example.com", &env), basic("bob", "inline"));

    // Failing, hanging, oversize, garbled: errors naming the helper.
    let msg = helper_err("broken.example.com", &env);
    assert!(msg.contains("docker-credential-broken get failed"), "{msg}");
    assert!(msg.contains("keyring is locked"), "{msg}");
    assert!(msg.contains("credHelpers"), "{msg}");
    let start = Instant::now();
    let msg = helper_err("hang.example.com", &env);
    assert!(
        msg.contains("docker-credential-hang did not answer within 1"),
        "{msg}"
    );
    assert!(
        start.elapsed() < Duration::from_secs(10),
        "{:?}",
        start.elapsed()
    );
    // The child it left went with it.
    let child = std::fs::read_to_string(bin.join("hang.child")).expect("hang.child");
    let proc = Path::new("/proc").join(child.trim());
    let gone = (0..100).any(|_| {
        let state = std::fs::read_to_string(proc.join("stat")).unwrap_or_default();
        let dead = state.is_empty() || state.contains(") Z");
        if !dead {
            std::thread::sleep(Duration::from_millis(20));
        }
        dead
    });
    assert!(
        gone,
        "the hanging helper's child {} outlived it",
        child.trim()
    );
    let msg = helper_err("big.example.com", &env);
    assert!(
        msg.contains("docker-credential-big wrote more than"),
        "{msg}"
    );
    let msg = helper_err("notjson.example.com", &env);
    assert!(msg.contains("invalid JSON"), "{msg}");
    let msg = helper_err("bad.example.com", &env);
    assert!(msg.contains("invalid credential helper name"), "{msg}");

    // A store that is not installed.
    write_config(&path, "absent");
    let msg = helper_err("store.example.com", &env);
    assert!(
        msg.contains("docker-credential-absent not found on PATH"),
        "{msg}"
    );
    assert!(msg.contains("credsStore"), "{msg}");
    assert_eq!(load("reg.example.com", &env), basic("alice", "pw"));
}

/// Issue 42 point 3: mounts with other credentials are other trust
/// domains; the identity names no secret.
#[test]
fn credentials_identity_tells_credentials_apart_and_names_no_secret() {
    let env = |auth: Option<&str>, config: &str| env_with(auth, Some(Path::new(config)), None);
    let a = identity_of(&env(Some("h:5000=alice:secret-a"), "/a/config.json"));
    let b = identity_of(&env(Some("h:5000=bob:secret-b"), "/a/config.json"));
    let c = identity_of(&env(Some("h:5000=alice:secret-a"), "/c/config.json"));
    let none = identity_of(&env(None, "/a/config.json"));
    let all = [&a, &b, &c, &none];
    for (i, x) in all.iter().enumerate() {
        assert!(!x.contains("secret") && !x.contains("alice"), "{x}");
        for y in &all[i + 1..] {
            assert_ne!(x, y);
        }
    }
    let again = identity_of(&env(Some("h:5000=alice:secret-a"), "/a/config.json"));
    assert_eq!(a, again);
}

#[test]
fn a_named_config_file_is_the_only_credentials() {
    let value = || Some(OsString::from("h:5000=node:secret"));
    let plain = SourceOptions::default();
    assert_eq!(env_auth(&plain, value()), value());
    assert_eq!(env_auth(&plain, Some(OsString::new())), None);
    let named = SourceOptions {
        docker_config: Some(PathBuf::from("/run/lamina/credentials/x.json")),
        ..SourceOptions::default()
    };
    assert_eq!(env_auth(&named, value()), None);
}
