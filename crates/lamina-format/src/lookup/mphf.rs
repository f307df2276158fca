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

const P0: u64 = 0xa076_1d64_78bd_642f;
const P1: u64 = 0xe703_7ed1_a0b4_28db;
const P2: u64 = 0x8ebc_6af0_9c88_c6e3;
const PILOT_MULTIPLIER: u64 = 0x517c_c1b7_2722_0a95;
/// A remap entry for a slot no key occupies.
const NO_SLOT: u32 = u32::MAX;

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

/// `x % d` for a fixed `d`, by two multiplications instead of a division
/// (Lemire, Kaser and Kurz, "Faster remainder by direct computation"):
/// exact for every 32-bit `x` and `d`. The builder computes many slots.
#[derive(Debug, Clone, Copy)]
struct FastMod {
    d: u32,
    m: u64,
}

impl FastMod {
    fn new(d: u32) -> FastMod {
        FastMod {
            d,
            m: (u64::MAX / u64::from(d.max(1))).wrapping_add(1),
        }
    }

    fn slot(&self, hash: u64, pilot: u8) -> u32 {
        self.reduce(hash as u32 ^ pilot_hash(pilot))
    }

    /// `x % d`.
    fn reduce(&self, x: u32) -> u32 {
        mul_high(self.m.wrapping_mul(u64::from(x)), u64::from(self.d)) as u32
    }
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

/// The shape every part shares, derived from `n` and the parameters.
#[derive(Debug, Clone, Copy)]
struct Shape {
    parts: u32,
    buckets_per_part: u32,
}

impl Shape {
    fn new(n: usize, params: &MphfParams) -> Result<Shape, MphfError> {
        let too_many = MphfError::TooManyKeys(n);
        let sane = params.lambda >= 1.0
            && params.lambda <= 16.0
            && params.alpha > 0.5
            && params.alpha <= 1.0
            && params.keys_per_part > 0;
        if !sane || u32::try_from(n).map_or(true, |n| n > MAX_KEYS) {
            return Err(too_many);
        }
        let parts = n.div_ceil(params.keys_per_part).max(1);
        let keys_per_part = n as f64 / parts as f64;
        // The skewed bucket function makes its first buckets hold about
        // sqrt(2 * lambda * keys) keys: in a small part they no longer fit,
        // so small parts get a bucket per key (their size hardly matters).
        let lambda = if keys_per_part < SMALL_PART {
            1.0
        } else {
            params.lambda
        };
        let buckets = (keys_per_part / lambda).ceil() as u64 + 3;
        Ok(Shape {
            parts: u32::try_from(parts).map_err(|_| too_many)?,
            buckets_per_part: u32::try_from(buckets).map_err(|_| too_many)?,
        })
    }
}

/// Parts with fewer keys than this on average get a bucket per key.
const SMALL_PART: f64 = 16384.0;

/// Most keys a function holds: slots (up to `2n`) and buckets still fit
/// `u32`.
pub const MAX_KEYS: u32 = 1 << 30;

/// Slots for a part of `keys` keys: `keys / alpha` rounded up, and at least
/// `sqrt(keys)` spare (a small part with one or two free slots often cannot
/// be finished); never a power of two (then `% slots` would read only low
/// bits, and the pilot's xor could not separate keys that share them).
fn part_slots(keys: usize, alpha: f64) -> u32 {
    if keys == 0 {
        return 0;
    }
    let spare = (keys as f64).sqrt().ceil() as u32;
    let slots = ((keys as f64 / alpha).ceil() as u32).max(keys as u32 + spare);
    if slots.is_power_of_two() {
        slots + 1
    } else {
        slots
    }
}

/// Builds the function for `hashes` (distinct) on up to `threads` threads;
/// the result does not depend on `threads`, nor on the order of `hashes`.
pub fn build(hashes: &[u64], params: &MphfParams, threads: usize) -> Result<BuiltMphf, MphfError> {
    let n = hashes.len();
    if n == 0 {
        return Ok(BuiltMphf {
            n: 0,
            buckets_per_part: 0,
            slot_starts: Vec::new(),
            pilots: Vec::new(),
            remap: Vec::new(),
        });
    }
    let shape = Shape::new(n, params)?;
    let (by_part, key_starts) = scatter_by_part(hashes, shape.parts);
    let mut slot_starts = Vec::with_capacity(shape.parts as usize + 1);
    let mut total = 0u32;
    for keys in key_starts.windows(2) {
        slot_starts.push(U32::new(total));
        total += part_slots(keys[1] - keys[0], params.alpha);
    }
    slot_starts.push(U32::new(total));
    let parts: Vec<PartJob<'_>> = key_starts
        .windows(2)
        .enumerate()
        .map(|(index, keys)| {
            let slots = slot_starts[index + 1].get() - slot_starts[index].get();
            (index as u32, slots, &by_part[keys[0]..keys[1]])
        })
        .collect();
    let built = build_parts(parts, shape, threads)?;
    let mut pilots = Vec::with_capacity(shape.parts as usize * shape.buckets_per_part as usize);
    for part in &built {
        pilots.extend_from_slice(&part.pilots);
    }
    let remap = remap(&built, &slot_starts, n as u32);
    Ok(BuiltMphf {
        n: n as u32,
        buckets_per_part: shape.buckets_per_part,
        slot_starts,
        pilots,
        remap,
    })
}

/// The hashes grouped by part (a counting sort), and where each part's
/// group starts (`parts + 1` offsets).
fn scatter_by_part(hashes: &[u64], parts: u32) -> (Vec<u64>, Vec<usize>) {
    let mut starts = vec![0usize; parts as usize + 1];
    for &h in hashes {
        starts[part_of(h, parts).0 as usize + 1] += 1;
    }
    for i in 1..starts.len() {
        starts[i] += starts[i - 1];
    }
    let mut next = starts.clone();
    let mut grouped = vec![0u64; hashes.len()];
    for &h in hashes {
        let part = part_of(h, parts).0 as usize;
        grouped[next[part]] = h;
        next[part] += 1;
    }
    (grouped, starts)
}

/// One part's pilots and which of its slots hold a key.
#[derive(Debug)]
struct BuiltPart {
    pilots: Vec<u8>,
    /// A bit per slot, set where a key is (see [`Placer::taken`]).
    taken: Vec<u64>,
}

/// A part's index, slot count and keys.
type PartJob<'h> = (u32, u32, &'h [u64]);

/// Builds the parts on up to `threads` threads, each taking the next part
/// not yet taken, and returns them in part order (each depends only on its
/// own keys), or the error of the lowest failing part.
fn build_parts(
    parts: Vec<PartJob<'_>>,
    shape: Shape,
    threads: usize,
) -> Result<Vec<BuiltPart>, MphfError> {
    use std::sync::atomic::{AtomicU32, Ordering};
    let threads = threads.clamp(1, parts.len().max(1));
    let queue = std::sync::Mutex::new(parts.into_iter());
    // Parts are taken in order, so once part `f` has failed, a thread that
    // takes a later part can stop: every part before `f` is still built.
    let failed = AtomicU32::new(u32::MAX);
    let work = || -> Vec<(u32, Result<BuiltPart, MphfError>)> {
        let mut placer = Placer::default();
        let mut done = Vec::new();
        loop {
            let job = queue
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .next();
            let Some((index, slots, keys)) = job else {
                break;
            };
            if index > failed.load(Ordering::Relaxed) {
                break;
            }
            let result = placer.build_part(index, keys, shape, slots);
            if result.is_err() {
                failed.fetch_min(index, Ordering::Relaxed);
            }
            done.push((index, result));
        }
        done
    };
    let mut done = if threads == 1 {
        work()
    } else {
        std::thread::scope(|scope| {
            let handles: Vec<_> = (1..threads).map(|_| scope.spawn(work)).collect();
            let mut done = work();
            for handle in handles {
                done.extend(
                    handle
                        .join()
                        .unwrap_or_else(|e| std::panic::resume_unwind(e)),
                );
            }
            done
        })
    };
    done.sort_unstable_by_key(|(index, _)| *index);
    done.into_iter().map(|(_, part)| part).collect()
}

/// Pairs every taken slot `>= n` with a free slot `< n`, both in order.
fn remap(parts: &[BuiltPart], slot_starts: &[U32], n: u32) -> Vec<U32> {
    let total = slot_starts.last().map_or(0, |s| s.get());
    let mut remap = vec![U32::new(NO_SLOT); (total - n) as usize];
    let mut free = Vec::new();
    let mut over = Vec::new();
    for (part, bounds) in parts.iter().zip(slot_starts.windows(2)) {
        let (start, end) = (bounds[0].get(), bounds[1].get());
        if end <= n {
            // Only the free slots matter here: a word at a time.
            for (w, &word) in part.taken.iter().enumerate() {
                let mut bits = !word;
                while bits != 0 {
                    let slot = start + w as u32 * 64 + bits.trailing_zeros();
                    if slot >= end {
                        break;
                    }
                    free.push(slot);
                    bits &= bits - 1;
                }
            }
            continue;
        }
        for slot in start..end {
            let i = slot - start;
            let taken = part.taken[(i / 64) as usize] & (1 << (i % 64)) != 0;
            match (slot < n, taken) {
                (true, false) => free.push(slot),
                (false, true) => over.push(slot),
                _ => {}
            }
        }
    }
    for (slot, free) in over.into_iter().zip(free) {
        remap[(slot - n) as usize] = U32::new(free);
    }
    remap
}

const NO_BUCKET: u32 = u32::MAX;
/// Pilots the search tries at once (dividing 256).
const BATCH: usize = 8;
/// Buckets whose eviction is refused while placing, so that two buckets do
/// not evict each other forever.
const RECENT: usize = 16;

/// Pilot search state for one part at a time; a thread keeps one and
/// reuses its buffers for every part it builds.
#[derive(Default)]
struct Placer {
    index: u32,
    /// The part's keys grouped by bucket, each bucket's sorted.
    keys: Vec<u64>,
    /// Bucket `b` holds `keys[starts[b]..starts[b + 1]]`.
    starts: Vec<u32>,
    slots: FastMod,
    /// A bit per slot, set where a key is: what the pilot search reads, a
    /// bit per slot so that a part's (8 KiB) stays in the L1 cache.
    taken: Vec<u64>,
    /// The bucket in each slot (where `taken` is set).
    owner: Vec<u32>,
    pilots: Vec<u8>,
    /// Each key's bucket (while grouping), then the buckets to place.
    order: Vec<u32>,
    /// Buckets evicted and not yet placed again, largest first.
    pending: std::collections::BinaryHeap<(u32, u32)>,
    scratch: Vec<u32>,
    sorted: Vec<u32>,
    evicted: Vec<u32>,
    rng: u64,
}

impl std::fmt::Debug for Placer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Placer")
            .field("index", &self.index)
            .finish()
    }
}

impl Default for FastMod {
    fn default() -> Self {
        FastMod::new(1)
    }
}

impl Placer {
    /// Builds part `index` over `keys`, into `slots` slots.
    fn build_part(
        &mut self,
        index: u32,
        keys: &[u64],
        shape: Shape,
        slots: u32,
    ) -> Result<BuiltPart, MphfError> {
        self.index = index;
        self.rng = u64::from(index) ^ P0;
        self.slots = FastMod::new(slots);
        self.group(keys, shape)?;
        self.taken.clear();
        self.taken.resize((slots as usize).div_ceil(64), 0);
        self.owner.clear();
        self.owner.resize(slots as usize, NO_BUCKET);
        self.pilots = vec![0; shape.buckets_per_part as usize];
        self.largest_first();
        let order = std::mem::take(&mut self.order);
        let placed = order.iter().try_for_each(|&bucket| self.place(bucket));
        self.order = order;
        placed?;
        Ok(BuiltPart {
            pilots: std::mem::take(&mut self.pilots),
            taken: self.taken.clone(),
        })
    }

    /// Groups `keys` by bucket into `self.keys` (a counting sort: buckets
    /// are increasing in the hash), sorts each bucket, and refuses equal
    /// hashes (which share a bucket), reporting the least.
    fn group(&mut self, keys: &[u64], shape: Shape) -> Result<(), MphfError> {
        let buckets = shape.buckets_per_part as usize;
        self.starts.clear();
        self.starts.resize(buckets + 1, 0);
        self.order.clear();
        for &h in keys {
            // Buckets stay below `buckets`: the fraction is below 1.
            let fraction = part_of(h, shape.parts).1;
            let bucket = bucket_in_part(fraction, shape.buckets_per_part) as u32;
            self.order.push(bucket);
            self.starts[bucket as usize + 1] += 1;
        }
        for i in 1..self.starts.len() {
            self.starts[i] += self.starts[i - 1];
        }
        self.keys.clear();
        self.keys.resize(keys.len(), 0);
        // `starts[b]` advances past bucket `b`'s keys as they are placed,
        // ending where `starts[b + 1]` began; shifted back below.
        for (&h, &bucket) in keys.iter().zip(&self.order) {
            let at = &mut self.starts[bucket as usize];
            self.keys[*at as usize] = h;
            *at += 1;
        }
        self.starts.copy_within(0..buckets, 1);
        self.starts[0] = 0;
        for bucket in self.starts.windows(2) {
            let keys = &mut self.keys[bucket[0] as usize..bucket[1] as usize];
            if keys.len() > 1 {
                keys.sort_unstable();
                if let Some(pair) = keys.windows(2).find(|pair| pair[0] == pair[1]) {
                    return Err(MphfError::DuplicateHash(pair[0]));
                }
            }
        }
        Ok(())
    }

    fn bucket_len(&self, bucket: u32) -> u32 {
        self.starts[bucket as usize + 1] - self.starts[bucket as usize]
    }

    fn bucket_keys(&self, bucket: u32) -> &[u64] {
        &self.keys[self.starts[bucket as usize] as usize..self.starts[bucket as usize + 1] as usize]
    }

    fn is_taken(&self, slot: u32) -> bool {
        self.taken[(slot / 64) as usize] & (1 << (slot % 64)) != 0
    }

    /// Non-empty buckets by decreasing size, ties by index, into
    /// `self.order` (a counting sort).
    fn largest_first(&mut self) {
        let buckets = self.starts.len() - 1;
        let max = (0..buckets as u32)
            .map(|b| self.bucket_len(b))
            .max()
            .unwrap_or(0) as usize;
        // `at[s]`: where the next bucket of size `s` goes.
        let mut at = vec![0u32; max + 2];
        for b in 0..buckets as u32 {
            at[self.bucket_len(b) as usize] += 1;
        }
        let mut next = 0;
        for size in (1..=max).rev() {
            let count = at[size];
            at[size] = next;
            next += count;
        }
        self.order.clear();
        self.order.resize(next as usize, 0);
        for b in 0..buckets as u32 {
            let size = self.bucket_len(b) as usize;
            if size > 0 {
                self.order[at[size] as usize] = b;
                at[size] += 1;
            }
        }
    }

    /// Slots of `bucket`'s keys with `pilot` into `scratch`; false if two
    /// of them coincide.
    fn fill_scratch(&mut self, bucket: u32, pilot: u8) -> bool {
        let slots = self.slots;
        let mut scratch = std::mem::take(&mut self.scratch);
        scratch.clear();
        scratch.extend(
            self.bucket_keys(bucket)
                .iter()
                .map(|&h| slots.slot(h, pilot)),
        );
        let distinct = match scratch.len() {
            0..=8 => (1..scratch.len()).all(|i| !scratch[..i].contains(&scratch[i])),
            _ => {
                self.sorted.clear();
                self.sorted.extend_from_slice(&scratch);
                self.sorted.sort_unstable();
                self.sorted.windows(2).all(|w| w[0] != w[1])
            }
        };
        self.scratch = scratch;
        distinct
    }

    /// The first pilot whose slots are all free and distinct. Pilots are
    /// tried [`BATCH`] at a time without a branch per slot: a failed try
    /// costs a mispredicted branch otherwise, more than its slot's
    /// arithmetic.
    fn free_pilot(&mut self, bucket: u32) -> Option<u8> {
        let (start, end) = (
            self.starts[bucket as usize] as usize,
            self.starts[bucket as usize + 1] as usize,
        );
        for base in (0..=u8::MAX).step_by(BATCH) {
            let hashes: [u32; BATCH] = std::array::from_fn(|j| pilot_hash(base + j as u8));
            let mut free = (1u32 << BATCH) - 1;
            for &h in &self.keys[start..end] {
                for (j, &pilot_hash) in hashes.iter().enumerate() {
                    let slot = self.slots.reduce(h as u32 ^ pilot_hash);
                    free &= !(u32::from(self.is_taken(slot)) << j);
                }
                if free == 0 {
                    break;
                }
            }
            while free != 0 {
                let pilot = base + free.trailing_zeros() as u8;
                if self.fill_scratch(bucket, pilot) {
                    return Some(pilot);
                }
                free &= free - 1;
            }
        }
        None
    }

    fn set_pilot(&mut self, bucket: u32, pilot: u8) {
        self.pilots[bucket as usize] = pilot;
        for i in self.starts[bucket as usize]..self.starts[bucket as usize + 1] {
            let slot = self.slots.slot(self.keys[i as usize], pilot);
            self.taken[(slot / 64) as usize] |= 1 << (slot % 64);
            self.owner[slot as usize] = bucket;
        }
    }

    fn clear(&mut self, bucket: u32) {
        let pilot = self.pilots[bucket as usize];
        for i in self.starts[bucket as usize]..self.starts[bucket as usize + 1] {
            let slot = self.slots.slot(self.keys[i as usize], pilot);
            self.taken[(slot / 64) as usize] &= !(1 << (slot % 64));
            self.owner[slot as usize] = NO_BUCKET;
        }
    }

    /// The bucket in `slot`, or [`NO_BUCKET`].
    fn occupant(&self, slot: u32) -> u32 {
        if self.is_taken(slot) {
            self.owner[slot as usize]
        } else {
            NO_BUCKET
        }
    }

    /// Places `first`, evicting and re-placing other buckets as needed.
    fn place(&mut self, first: u32) -> Result<(), MphfError> {
        if let Some(pilot) = self.free_pilot(first) {
            self.set_pilot(first, pilot);
            return Ok(());
        }
        self.pending.clear();
        self.pending.push((self.bucket_len(first), first));
        let mut recent = [NO_BUCKET; RECENT];
        recent[0] = first;
        let mut evictions = 0usize;
        let mut next_recent = 0;
        while let Some((_, bucket)) = self.pending.pop() {
            if let Some(pilot) = self.free_pilot(bucket) {
                self.set_pilot(bucket, pilot);
                continue;
            }
            evictions += 1;
            if evictions > 10 * self.slots.d as usize {
                return Err(MphfError::NoPilots(self.index));
            }
            // In a small part the recent buckets may be all the others.
            let pilot = self
                .least_evicting_pilot(bucket, &recent)
                .or_else(|| self.least_evicting_pilot(bucket, &[bucket; RECENT]))
                .ok_or(MphfError::NoPilots(self.index))?;
            self.fill_scratch(bucket, pilot);
            let mut evicted = std::mem::take(&mut self.evicted);
            evicted.clear();
            evicted.extend(
                self.scratch
                    .iter()
                    .map(|&s| self.occupant(s))
                    .filter(|&b| b != NO_BUCKET),
            );
            // A bucket owning two of these slots is evicted once.
            evicted.sort_unstable();
            evicted.dedup();
            for &b in &evicted {
                self.clear(b);
                self.pending.push((self.bucket_len(b), b));
            }
            self.evicted = evicted;
            self.set_pilot(bucket, pilot);
            next_recent = (next_recent + 1) % RECENT;
            recent[next_recent] = bucket;
        }
        Ok(())
    }

    /// The pilot with distinct slots whose occupants (none of them recent)
    /// weigh least, by the sum of their squared sizes; the scan starts at a
    /// pseudo-random pilot so that repeated attempts try others first.
    fn least_evicting_pilot(&mut self, bucket: u32, recent: &[u32; RECENT]) -> Option<u8> {
        self.rng ^= self.rng << 13;
        self.rng ^= self.rng >> 7;
        self.rng ^= self.rng << 17;
        let start = self.rng as u8;
        let floor = (self.bucket_len(bucket) as usize).pow(2);
        let mut best: Option<(usize, u8)> = None;
        'pilots: for delta in 0..=u8::MAX {
            let pilot = start.wrapping_add(delta);
            let mut cost = 0;
            for &h in self.bucket_keys(bucket) {
                let occupant = self.occupant(self.slots.slot(h, pilot));
                if occupant == NO_BUCKET {
                    continue;
                }
                if recent.contains(&occupant) {
                    continue 'pilots;
                }
                cost += (self.bucket_len(occupant) as usize).pow(2);
                if best.is_some_and(|(c, _)| cost >= c) {
                    continue 'pilots;
                }
            }
            if self.fill_scratch(bucket, pilot) {
                best = Some((cost, pilot));
                if cost <= floor {
                    break;
                }
            }
        }
        best.map(|(_, pilot)| pilot)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn random_hashes(n: usize, mut state: u64) -> Vec<u64> {
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

    /// The builder's remainder is the query's.
    #[test]
    fn fast_mod_is_exact() {
        let hashes = random_hashes(2000, 5);
        for d in [1, 2, 3, 7, 1000, 65_537, 1 << 31, u32::MAX - 1, u32::MAX] {
            let fast = FastMod::new(d);
            for (&h, pilot) in hashes.iter().zip((0..=u8::MAX).cycle()) {
                assert_eq!(fast.slot(h, pilot), slot_in_part(h, pilot, d), "{d}");
            }
        }
    }

    /// Grouping by bucket (a counting sort, then each bucket sorted) sorts
    /// keys by bucket and hash (within one part: by hash, since buckets
    /// increase with it).
    #[test]
    fn grouping_sorts_like_std_sort() {
        for (n, parts) in [(0, 1), (1, 1), (1000, 1), (70_000, 1), (70_000, 4)] {
            let hashes = random_hashes(n, 11);
            let params = MphfParams::default();
            let shape = Shape::new(n.max(1), &params).unwrap();
            let shape = Shape { parts, ..shape };
            let mut placer = Placer::default();
            placer.group(&hashes, shape).unwrap();
            let mut want = hashes.clone();
            want.sort_unstable_by_key(|&h| {
                let bucket = bucket_in_part(part_of(h, parts).1, shape.buckets_per_part);
                (bucket, h)
            });
            if parts == 1 {
                assert!(want.is_sorted());
            }
            assert!(placer.keys == want, "{n} keys, {parts} parts");
            assert_eq!(placer.starts.len(), shape.buckets_per_part as usize + 1);
            assert_eq!(placer.starts.last().copied(), Some(n as u32));
        }
    }

    /// The batched pilot search finds the first pilot a plain search does.
    #[test]
    fn batched_pilot_search_is_the_plain_one() {
        let hashes = random_hashes(20_000, 17);
        let shape = Shape::new(hashes.len(), &MphfParams::default()).unwrap();
        let slots = part_slots(hashes.len(), 0.99);
        let mut placer = Placer::default();
        placer.group(&hashes, shape).unwrap();
        placer.slots = FastMod::new(slots);
        placer.taken = vec![0; (slots as usize).div_ceil(64)];
        placer.owner = vec![NO_BUCKET; slots as usize];
        // Slots about 60%, then 90%, taken.
        for (round, &h) in random_hashes(slots as usize * 3, 19).iter().enumerate() {
            let slot = (h % u64::from(slots)) as u32;
            placer.taken[(slot / 64) as usize] |= 1 << (slot % 64);
            if round != slots as usize && round != slots as usize * 3 - 1 {
                continue;
            }
            let mut found = 0;
            for bucket in 0..shape.buckets_per_part {
                let plain = (0..=u8::MAX).find(|&pilot| {
                    let slots: Vec<u32> = placer
                        .bucket_keys(bucket)
                        .iter()
                        .map(|&h| slot_in_part(h, pilot, slots))
                        .collect();
                    let distinct = (1..slots.len()).all(|i| !slots[..i].contains(&slots[i]));
                    distinct && slots.iter().all(|&s| !placer.is_taken(s))
                });
                assert_eq!(placer.free_pilot(bucket), plain, "bucket {bucket}");
                found += usize::from(plain.is_some());
            }
            assert!(found > 100, "{found}");
        }
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
