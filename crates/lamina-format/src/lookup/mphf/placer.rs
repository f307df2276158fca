//! The pilot search: one part's buckets placed largest first, eight pilots
//! tried at a time, and buckets evicted and placed again when no pilot
//! finds free slots.

use super::builder::{BuiltPart, Shape};
use super::*;

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

const NO_BUCKET: u32 = u32::MAX;
/// Pilots the search tries at once (dividing 256).
const BATCH: usize = 8;
/// Buckets whose eviction is refused while placing, so that two buckets do
/// not evict each other forever.
const RECENT: usize = 16;

/// Pilot search state for one part at a time; a thread keeps one and
/// reuses its buffers for every part it builds.
#[derive(Default)]
pub(super) struct Placer {
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
    pub(super) fn build_part(
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
    use super::super::builder::part_slots;
    use super::super::tests::random_hashes;
    use super::*;

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
}
