//! `WWW-Authenticate` challenge parsing: never panics, and a parsed challenge
//! written back out (values quoted and escaped) parses to the same value.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let header = String::from_utf8_lossy(data);
    let Some((scheme, params)) = lamina_oci::fuzz_parse_challenge(&header) else {
        return;
    };
    assert!(!scheme.is_empty() && !scheme.contains(char::is_whitespace));
    let mut rendered = scheme.clone();
    for (i, (key, value)) in params.iter().enumerate() {
        assert!(!key.is_empty() && !key.contains(['=', ',']));
        assert_eq!(*key, key.to_ascii_lowercase());
        let quoted = value.replace('\\', "\\\\").replace('"', "\\\"");
        rendered.push_str(if i == 0 { " " } else { ", " });
        rendered.push_str(&format!("{key}=\"{quoted}\""));
    }
    let again = lamina_oci::fuzz_parse_challenge(&rendered).expect("a rendered challenge parses");
    assert_eq!(again, (scheme, params), "{rendered:?}");
});
