//! The key hash and the minimal perfect hash function (MPHF) of the lookup
//! table, in the manner of PtrHash (Groot Koerkamp, 2025): keys are hashed
//! once to 64 bits; the high bits choose a part and, through a skewed
//! function, a bucket in that part; each bucket stores a one-byte pilot, and
//! a key's slot in its part is `(low 32 bits of its hash ^ hash(pilot)) %
//! slots in the part`. Slots number about `n / alpha`; the few keys that land
//! on a slot `>= n` are sent by the remap array to a slot `< n` left free,
//! so the function is minimal: `n` keys onto `0..n`.
//!
//! The builder places buckets largest first and, when no pilot finds free
//! slots, takes the pilot whose evicted buckets are smallest (sum of squared
//! sizes) and places those again, as PtrHash does. It is deterministic:
//! parts are independent, built in any order on any number of threads, and
//! the output depends only on the set of hashes.
//!
//! Where its time goes: nearly all of it in trying pilots for the last,
//! small buckets of a part, when few slots are free. So a part's keys are
//! grouped by bucket with a counting sort (buckets increase with the hash),
//! the search reads a bit per slot (8 KiB a part, in the L1 cache; the
//! owning bucket, needed only to evict, is kept apart), and it tries eight
//! pilots at a time with no branch per slot, since a failed try would
//! otherwise cost a mispredicted branch. Threads take parts from a queue
//! and reuse their buffers.
//!
//! Everything here that a query evaluates ([`key_hash`], the bucket
//! function, the pilot hash, the slot reduction) is part of the on-disk
//! format and must never change.

use zerocopy::little_endian::U32;
use zerocopy::IntoBytes;

mod builder;
mod placer;

pub use builder::build;

const P0: u64 = 0xa076_1d64_78bd_642f;
const P1: u64 = 0xe703_7ed1_a0b4_28db;
const P2: u64 = 0x8ebc_6af0_9c88_c6e3;
const PILOT_MULTIPLIER: u64 = 0x517c_c1b7_2722_0a95;

/// Multiplies and folds the 128-bit product, keeping the inputs in the
/// result so a zero factor cannot erase the state (wyhash's "condom" mix).
fn fold(a: u64, b: u64) -> u64 {
    let product = u128::from(a) * u128::from(b);
    (product as u64) ^ ((product >> 64) as u64) ^ a ^ b
}

/// MurmurHash3's 64-bit finalizer: every output bit depends on every input
/// bit, which the slot reduction (low 32 bits) needs.
fn finalize(mut x: u64) -> u64 {
    x ^= x >> 33;
    x = x.wrapping_mul(0xff51_afd7_ed55_8ccd);
    x ^= x >> 33;
    x = x.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    x ^ (x >> 33)
}

fn le64(bytes: &[u8]) -> u64 {
    let mut word = [0u8; 8];
    word[..bytes.len().min(8)].copy_from_slice(&bytes[..bytes.len().min(8)]);
    u64::from_le_bytes(word)
}

/// The 64-bit key hash (on-disk format): the length folded into `seed`,
/// then each 16-byte block (the last one zero-padded, always present)
/// folded in as two little-endian words, then [`finalize`]d. Not
/// collision-resistant against chosen inputs; a collision only costs the
/// builder another seed.
pub fn key_hash(seed: u64, bytes: &[u8]) -> u64 {
    let mut state = fold(seed ^ P0, bytes.len() as u64 ^ P1);
    let mut blocks = bytes.chunks_exact(16);
    for block in &mut blocks {
        state = fold(le64(&block[..8]) ^ state ^ P1, le64(&block[8..]) ^ P2);
    }
    let tail = blocks.remainder();
    let (low, high) = tail.split_at(tail.len().min(8));
    state = fold(le64(low) ^ state ^ P1, le64(high) ^ P2);
    finalize(state)
}

/// The hash of a (parent nid, name) key under `seed`.
pub fn entry_hash(seed: u64, parent: u64, name: &[u8]) -> u64 {
    key_hash(fold(seed ^ P2, parent ^ P0), name)
}

/// The hash state of the root for paths under `seed`; a path's hash is
/// [`key_hash`] of its last component seeded with its parent's hash, so
/// `a/b` hashes as `key_hash(key_hash(path_root(seed), "a"), "b")`.
pub fn path_root(seed: u64) -> u64 {
    fold(seed ^ P1, P2)
}

/// The hash of a `/`-joined path under `seed` (see [`path_root`]).
pub fn path_hash(seed: u64, path: &[u8]) -> u64 {
    path.split(|&b| b == b'/')
        .fold(path_root(seed), |state, component| {
            key_hash(state, component)
        })
}

fn mul_high(a: u64, b: u64) -> u64 {
    ((u128::from(a) * u128::from(b)) >> 64) as u64
}

/// The part of a hash and the bits left for its bucket: `h * parts` as a
/// 64.64 fixed-point number, integer part and fraction.
fn part_of(hash: u64, parts: u32) -> (u64, u64) {
    let product = u128::from(hash) * u128::from(parts);
    ((product >> 64) as u64, product as u64)
}

/// PtrHash's `CubicEps` bucket function on the fraction `x` (a 0.64
/// fixed-point number): `(x^3 + x^2) / 2 * 255/256 + x/256`, scaled to
/// `buckets`. Skewed so that few buckets take many keys (they are placed
/// first, into an empty table), and monotone, so sorting hashes sorts
/// buckets.
fn bucket_in_part(x: u64, buckets: u32) -> u64 {
    let skewed = mul_high(mul_high(x, x), (x >> 1) | (1 << 63)) / 256 * 255 + x / 256;
    mul_high(skewed, u64::from(buckets))
}

fn pilot_hash(pilot: u8) -> u32 {
    (PILOT_MULTIPLIER.wrapping_mul(u64::from(pilot) + 1) >> 32) as u32
}

/// The slot in a part of `slots` slots (not 0) for `hash` with `pilot`.
fn slot_in_part(hash: u64, pilot: u8, slots: u32) -> u32 {
    (hash as u32 ^ pilot_hash(pilot)) % slots
}

/// An MPHF over borrowed (little-endian) arrays. A query never panics and
/// never reads out of bounds whatever the arrays hold: on arrays that do not
/// fit together it answers `None` or some index below `n`.
#[derive(Debug, Clone, Copy)]
pub struct Mphf<'a> {
    /// Number of keys.
    pub n: u32,
    /// Buckets in every part.
    pub buckets_per_part: u32,
    /// First global slot of each part, and the total slot count last.
    pub slot_starts: &'a [U32],
    /// One pilot per bucket, part after part.
    pub pilots: &'a [u8],
    /// For global slot `n + i`, the free slot below `n` it stands for.
    pub remap: &'a [U32],
}

impl Mphf<'_> {
    /// The index in `0..n` of the key hashed to `hash`: distinct for every
    /// key the function was built on; some index or `None` for others.
    pub fn index(&self, hash: u64) -> Option<u32> {
        let parts = u32::try_from(self.slot_starts.len().checked_sub(1)?).ok()?;
        let (part, fraction) = part_of(hash, parts);
        let part = usize::try_from(part).ok()?;
        let bucket = u64::try_from(part)
            .ok()?
            .checked_mul(u64::from(self.buckets_per_part))?
            .checked_add(bucket_in_part(fraction, self.buckets_per_part))?;
        let pilot = *self.pilots.get(usize::try_from(bucket).ok()?)?;
        let start = self.slot_starts.get(part)?.get();
        let slots = self.slot_starts.get(part + 1)?.get().checked_sub(start)?;
        if slots == 0 {
            return None;
        }
        let slot = start.checked_add(slot_in_part(hash, pilot, slots))?;
        let index = match slot.checked_sub(self.n) {
            None => slot,
            Some(over) => self.remap.get(usize::try_from(over).ok()?)?.get(),
        };
        (index < self.n).then_some(index)
    }
}

/// Builder parameters. None is stored: a query needs only the arrays.
#[derive(Debug, Clone, Copy)]
pub struct MphfParams {
    /// Mean keys per bucket: larger means fewer pilots (fewer bits per key)
    /// and a longer pilot search.
    pub lambda: f64,
    /// Keys per slot: closer to 1 means a smaller remap array and a longer
    /// search for the last keys of each part.
    pub alpha: f64,
    /// Mean keys per part: a part's slots should stay in cache while it is
    /// built, and parts are what threads share out.
    pub keys_per_part: usize,
}

/// `lambda` 3.0 (PtrHash's fast setting; 3.5 takes about a third longer
/// to build, for 2.6 bits per key instead of 3.0) and `alpha` 0.99.
impl Default for MphfParams {
    fn default() -> Self {
        MphfParams {
            lambda: 3.0,
            alpha: 0.99,
            keys_per_part: 1 << 16,
        }
    }
}

/// Why a function could not be built for a set of hashes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum MphfError {
    /// Two keys have the same hash; another seed may separate them.
    #[error("two keys hash to {0:#018x}")]
    DuplicateHash(u64),
    /// A part could not be placed (two keys of one bucket that no pilot
    /// separates, or an eviction chain too long); another seed may do.
    #[error("no pilots found for part {0}")]
    NoPilots(u32),
    /// More keys than the format counts (`u32`), or parameters out of range.
    #[error("{0} keys with these parameters do not fit the format")]
    TooManyKeys(usize),
}

/// A built function: the arrays an [`Mphf`] borrows.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BuiltMphf {
    /// Number of keys.
    pub n: u32,
    /// Buckets in every part.
    pub buckets_per_part: u32,
    /// See [`Mphf::slot_starts`].
    pub slot_starts: Vec<U32>,
    /// See [`Mphf::pilots`].
    pub pilots: Vec<u8>,
    /// See [`Mphf::remap`].
    pub remap: Vec<U32>,
}

impl BuiltMphf {
    /// The function over these arrays.
    pub fn view(&self) -> Mphf<'_> {
        Mphf {
            n: self.n,
            buckets_per_part: self.buckets_per_part,
            slot_starts: &self.slot_starts,
            pilots: &self.pilots,
            remap: &self.remap,
        }
    }

    /// Bytes of pilots and remap (what a bits-per-key figure counts), plus
    /// the part table.
    pub fn stored_bytes(&self) -> usize {
        self.slot_starts.as_bytes().len() + self.pilots.len() + self.remap.as_bytes().len()
    }
}

/// Most keys a function holds: slots (up to `2n`) and buckets still fit
/// `u32`.
pub const MAX_KEYS: u32 = 1 << 30;

#[cfg(test)]
mod tests {
    use super::*;

    pub(super) fn random_hashes(n: usize, mut state: u64) -> Vec<u64> {
        (0..n)
            .map(|_| {
                state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
                finalize(state)
            })
            .collect()
    }

    /// Every key gets its own index in `0..n`.
    fn assert_bijection(hashes: &[u64], built: &BuiltMphf) {
        let mphf = built.view();
        let mut seen = vec![false; hashes.len()];
        for &h in hashes {
            let index = mphf.index(h).expect("every key has an index") as usize;
            assert!(!seen[index], "index {index} given twice");
            seen[index] = true;
        }
    }

    #[test]
    fn bijection_onto_0_to_n() {
        let hashes = random_hashes(100_000, 1);
        let built = build(&hashes, &MphfParams::default(), 1).unwrap();
        assert_bijection(&hashes, &built);
        let bits = built.stored_bytes() as f64 * 8.0 / hashes.len() as f64;
        assert!(bits < 3.5, "{bits} bits per key");
    }

    #[test]
    fn small_sets() {
        for n in (0..3000)
            .step_by(7)
            .chain([4095, 4096, 10_000, 16_383, 16_384, 30_000, 65_537])
        {
            let hashes = random_hashes(n, n as u64);
            let built = build(&hashes, &MphfParams::default(), 1).unwrap();
            assert_bijection(&hashes, &built);
        }
    }

    #[test]
    fn threads_do_not_change_the_output() {
        let hashes = random_hashes(300_000, 7);
        let one = build(&hashes, &MphfParams::default(), 1).unwrap();
        let three = build(&hashes, &MphfParams::default(), 3).unwrap();
        assert_eq!(one, three);
        let mut shuffled = hashes.clone();
        shuffled.reverse();
        assert_eq!(build(&shuffled, &MphfParams::default(), 2).unwrap(), one);
    }

    /// The least duplicate is reported, and the lowest failing part,
    /// whatever the thread count.
    #[test]
    fn the_least_duplicate_is_reported() {
        let mut hashes = random_hashes(300_000, 13);
        let mut twice: Vec<u64> = hashes.iter().step_by(20_000).copied().collect();
        hashes.extend_from_slice(&twice);
        twice.sort_unstable();
        for threads in [1, 2, 3] {
            assert_eq!(
                build(&hashes, &MphfParams::default(), threads),
                Err(MphfError::DuplicateHash(twice[0])),
                "{threads} threads"
            );
        }
    }

    #[test]
    fn duplicates_are_refused() {
        let mut hashes = random_hashes(1000, 3);
        hashes.push(hashes[500]);
        assert_eq!(
            build(&hashes, &MphfParams::default(), 1),
            Err(MphfError::DuplicateHash(hashes[500]))
        );
    }

    /// The key hash is part of the format: these values must never change.
    #[test]
    fn key_hash_test_vectors() {
        let vectors: [(u64, &[u8], u64); 4] = [
            (0, b"", 0x7f39_c05e_7aee_daf1),
            (0, b"a", 0x4cec_424d_5049_90a8),
            (1, b"hello, lamina", 0x7c44_2ca1_ed41_454c),
            (
                0,
                b"0123456789abcdef0123456789abcdef!",
                0x3cf0_fbdb_b203_cb14,
            ),
        ];
        for (seed, bytes, want) in vectors {
            assert_eq!(key_hash(seed, bytes), want, "{bytes:?}");
        }
    }
}
