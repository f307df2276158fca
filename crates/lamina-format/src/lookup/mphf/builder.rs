//! Building a function: its shape from the key count, the keys split by
//! part, the parts placed on threads (each by a [`Placer`]), and the remap
//! of the slots past `n`.

use super::placer::Placer;
use super::*;

/// A remap entry for a slot no key occupies.
const NO_SLOT: u32 = u32::MAX;

/// The shape every part shares, derived from `n` and the parameters.
#[derive(Debug, Clone, Copy)]
pub(super) struct Shape {
    pub(super) parts: u32,
    pub(super) buckets_per_part: u32,
}

impl Shape {
    pub(super) fn new(n: usize, params: &MphfParams) -> Result<Shape, MphfError> {
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

/// Slots for a part of `keys` keys: `keys / alpha` rounded up, and at least
/// `sqrt(keys)` spare (a small part with one or two free slots often cannot
/// be finished); never a power of two (then `% slots` would read only low
/// bits, and the pilot's xor could not separate keys that share them).
pub(super) fn part_slots(keys: usize, alpha: f64) -> u32 {
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
pub(super) struct BuiltPart {
    pub(super) pilots: Vec<u8>,
    /// A bit per slot, set where a key is (see [`Placer::taken`]).
    pub(super) taken: Vec<u64>,
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
