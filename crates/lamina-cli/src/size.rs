//! Sizes as flags and the config file take them: bytes, or with a K, M, G
//! or T suffix.

/// `--metadata-frame-size`: a size (`4K`, `1M`, bytes) of 4 KiB..64 MiB.
pub(crate) fn parse_frame_size(s: &str) -> std::result::Result<u64, String> {
    let n = parse_size(s)?;
    match (4 << 10..=64 << 20).contains(&n) {
        true => Ok(n),
        false => Err(format!("{n} is not between 4 KiB and 64 MiB")),
    }
}

pub(crate) fn parse_chunk_size(s: &str) -> std::result::Result<u64, String> {
    let n = parse_size(s)?;
    if !n.is_power_of_two() || !(4096..=16 << 20).contains(&n) {
        return Err("must be a power of two between 4096 and 16777216".into());
    }
    Ok(n)
}

pub(crate) fn parse_size(s: &str) -> std::result::Result<u64, String> {
    let s = s.trim();
    let (num, mult) = match s.char_indices().last() {
        Some((i, c)) if c.is_ascii_alphabetic() => {
            let mult = match c.to_ascii_uppercase() {
                'K' => 1 << 10,
                'M' => 1 << 20,
                'G' => 1 << 30,
                'T' => 1u64 << 40,
                _ => return Err(format!("unknown size suffix in {s:?}")),
            };
            (&s[..i], mult)
        }
        _ => (s, 1),
    };
    num.parse::<u64>()
        .ok()
        .and_then(|n| n.checked_mul(mult))
        .ok_or_else(|| format!("bad size {s:?}"))
}
