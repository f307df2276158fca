//! The boot pages' frames after the first, as one stream: one range
//! request for the frames that lie end to end in the boot layer, each
//! frame verified against its digest and applied as soon as its last byte
//! is in. A request per frame paid the registry's answer time 73 times for
//! the Node.js start's 10 MB (21-26 ms a frame, four at once, at 1 Gbit/s);
//! a stream pays it once and delivers the frames in read order at the
//! link's rate, on a slow link as soon as four parallel requests would.
//!
//! A stream is one try, not retried or hedged: what it did not bring (an
//! error, a frame that does not verify, no frame for two hedge bounds) is
//! fetched frame by frame, as ranges retried and hedged like a miss's.

use super::boot::FrameJob;
use super::*;
use lamina_fetch::hedge::STALLED_AFTER_BOUNDS;
use std::io::Read;

/// A frame read from the stream and verified against its digest.
pub(super) struct StreamedFrame {
    pub(super) bytes: Vec<u8>,
    /// From the end of the frame before it (or the request) to its end.
    pub(super) took: Duration,
}

/// What the stream's reader and the appliers share.
struct Progress {
    /// Per frame: taken by the stream or by an applier (each frame once).
    claimed: Vec<AtomicBool>,
    /// Frames applied, or failed.
    done: AtomicUsize,
    /// The stream has ended or was given up: appliers take what is left.
    over: AtomicBool,
    /// When the stream last brought a frame (or was opened), in ms on
    /// `clock`.
    last_ms: AtomicU64,
    clock: Instant,
}

impl Progress {
    fn new(frames: usize) -> Self {
        Progress {
            claimed: (0..frames).map(|_| AtomicBool::new(false)).collect(),
            done: AtomicUsize::new(0),
            over: AtomicBool::new(false),
            last_ms: AtomicU64::new(0),
            clock: Instant::now(),
        }
    }

    /// Takes frame `i`; false when it was taken already.
    fn claim(&self, i: usize) -> bool {
        !self.claimed[i].swap(true, Ordering::SeqCst)
    }

    fn now_ms(&self) -> u64 {
        u64::try_from(self.clock.elapsed().as_millis()).unwrap_or(u64::MAX)
    }

    fn touch(&self) {
        self.last_ms.store(self.now_ms(), Ordering::SeqCst);
    }

    fn since_last(&self) -> Duration {
        let last = self.last_ms.load(Ordering::SeqCst);
        Duration::from_millis(self.now_ms().saturating_sub(last))
    }

    fn all_done(&self) -> bool {
        self.done.load(Ordering::SeqCst) >= self.claimed.len()
    }
}

/// The frames of `rest` to stream: from the first without a cached copy,
/// the run that lies end to end in its layer (cached copies are read from
/// disk instead).
fn stream_plan(rest: &[FrameJob]) -> std::ops::Range<usize> {
    let uncached = |(k, spec, _): &FrameJob| !spec.frame_path(*k).exists();
    let Some(start) = rest.iter().position(uncached) else {
        return 0..0;
    };
    let mut end = start + 1;
    while let Some(job) = rest.get(end) {
        let (_, spec, frame) = job;
        let (_, before_spec, before) = &rest[end - 1];
        let adjacent = std::ptr::eq(*spec, *before_spec)
            && before.offset.checked_add(before.compressed_size) == Some(frame.offset);
        if !adjacent || !uncached(job) {
            break;
        }
        end += 1;
    }
    start..end
}

/// Reads the planned frames from one stream, in order, on a thread of its
/// own (a stalled stream is left to its read timeout without holding the
/// frames that come as ranges meanwhile).
struct FrameReader {
    source: Arc<dyn RangeSource>,
    layer: Digest,
    offset: u64,
    /// Per frame: its number among the frames after the first, its size,
    /// its digest; end to end from `offset`.
    frames: Vec<(usize, u64, Digest)>,
}

impl FrameReader {
    fn new(
        source: &Arc<dyn RangeSource>,
        rest: &[FrameJob],
        plan: std::ops::Range<usize>,
    ) -> io::Result<Self> {
        let (_, spec, first) = &rest[plan.start];
        let mut frames = Vec::with_capacity(plan.len());
        for i in plan {
            let frame = &rest[i].2;
            let digest = Digest::parse(&frame.digest).map_err(io::Error::other)?;
            frames.push((i, frame.compressed_size, digest));
        }
        Ok(FrameReader {
            source: Arc::clone(source),
            layer: Digest::parse(&spec.layer_digest).map_err(io::Error::other)?,
            offset: first.offset,
            frames,
        })
    }

    fn len(&self) -> u64 {
        self.frames.iter().map(|f| f.1).sum()
    }

    fn run(self, progress: Arc<Progress>, to: mpsc::Sender<(usize, StreamedFrame)>) {
        if let Err(e) = self.read_all(&progress, &to) {
            tracing::info!("boot pages stream: {e}; the frames it did not bring come as ranges");
        }
        progress.over.store(true, Ordering::SeqCst);
    }

    fn read_all(
        &self,
        progress: &Progress,
        to: &mpsc::Sender<(usize, StreamedFrame)>,
    ) -> io::Result<()> {
        let asked = Instant::now();
        let mut body = self
            .source
            .stream_range(&self.layer, self.offset, self.len())?
            .ok_or_else(|| io::Error::other("this source reads whole ranges only"))?;
        let answered = asked.elapsed();
        let mut since = Instant::now();
        for (i, size, digest) in &self.frames {
            // Bounded like a range's buffer: the size is the image's word.
            let mut bytes = Vec::with_capacity((*size).min(4 << 20) as usize);
            (&mut body).take(*size).read_to_end(&mut bytes)?;
            if bytes.len() as u64 != *size {
                return Err(io::Error::other(format!(
                    "the answer ended {} bytes into a frame of {size}",
                    bytes.len()
                )));
            }
            if Digest::of_bytes(&bytes) != *digest {
                return Err(io::Error::other(format!(
                    "a frame does not match its digest {digest}"
                )));
            }
            // Taken by an applier: the stream was given up as stalled.
            if !progress.claim(*i) {
                return Ok(());
            }
            progress.touch();
            let took = since.elapsed();
            to.send((*i, StreamedFrame { bytes, took }))
                .map_err(|_| io::Error::other("no one applies frames"))?;
            since = Instant::now();
        }
        tracing::debug!(
            "boot pages stream: {} frames, {} bytes, answered in {:.1} ms, read in {:.1} ms",
            self.frames.len(),
            self.len(),
            answered.as_secs_f64() * 1e3,
            (asked.elapsed() - answered).as_secs_f64() * 1e3
        );
        Ok(())
    }
}

impl Shared {
    /// Loads the frames after the first: those end to end in the layer as
    /// one stream when the source streams, the rest (and whatever the
    /// stream does not bring) as ranges, [`BOOT_STREAMS`] applied at once.
    pub(super) fn load_frames_streamed(&self, rest: &[FrameJob]) {
        let progress = Arc::new(Progress::new(rest.len()));
        let (to, from) = mpsc::channel();
        let plan = stream_plan(rest);
        let reader = (plan.len() >= 2)
            .then(|| FrameReader::new(&self.source, rest, plan.clone()))
            .transpose()
            .unwrap_or_else(|e| {
                tracing::warn!("boot pages not streamed: {e}");
                None
            });
        let stall = match reader {
            Some(reader) => {
                let largest = reader.frames.iter().map(|f| f.1).max().unwrap_or(0);
                self.stats.requests.fetch_add(1, Ordering::Relaxed);
                let progress = Arc::clone(&progress);
                std::thread::spawn(move || reader.run(progress, to));
                let bound = self.hedging.bound(largest) * STALLED_AFTER_BOUNDS;
                self.config.hedge.then_some(bound)
            }
            None => {
                progress.over.store(true, Ordering::SeqCst);
                None
            }
        };
        let from = Mutex::new(from);
        std::thread::scope(|scope| {
            for _ in 0..BOOT_STREAMS.min(rest.len()) {
                scope.spawn(|| self.apply_frames(rest, &progress, &from, &plan));
            }
            if let Some(limit) = stall {
                watch_stream(&progress, limit);
            }
        });
    }

    /// One applier: frames from the stream as they come; meanwhile frames
    /// outside it, and once it is over, any left, as ranges.
    fn apply_frames(
        &self,
        rest: &[FrameJob],
        progress: &Progress,
        from: &Mutex<mpsc::Receiver<(usize, StreamedFrame)>>,
        streamed: &std::ops::Range<usize>,
    ) {
        while !progress.all_done() {
            let next = from
                .lock()
                .map_err(|_| mpsc::RecvTimeoutError::Disconnected)
                .and_then(|r| r.recv_timeout(Duration::from_millis(5)));
            let job = match next {
                Ok((i, frame)) => {
                    let len = frame.bytes.len() as u64;
                    self.stats.bytes.fetch_add(len, Ordering::Relaxed);
                    Some((i, Some(frame)))
                }
                Err(gone) => {
                    let over = progress.over.load(Ordering::SeqCst);
                    let free = (0..rest.len())
                        .find(|&i| (over || !streamed.contains(&i)) && progress.claim(i));
                    if free.is_none() && gone == mpsc::RecvTimeoutError::Disconnected {
                        std::thread::sleep(Duration::from_millis(2));
                    }
                    free.map(|i| (i, None))
                }
            };
            if let Some((i, frame)) = job {
                self.apply_frame_job(&rest[i], frame);
                progress.done.fetch_add(1, Ordering::SeqCst);
            }
        }
    }
}

/// Gives the stream up once it has brought no frame for `limit`: its
/// frames left then come as ranges, hedged.
fn watch_stream(progress: &Progress, limit: Duration) {
    while !progress.over.load(Ordering::SeqCst) && !progress.all_done() {
        if progress.since_last() > limit {
            progress.over.store(true, Ordering::SeqCst);
            tracing::info!(
                "boot pages stream: no frame for {} ms; the frames left come as ranges",
                limit.as_millis()
            );
            return;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(dir: &Path, frames: &[(u64, u64)]) -> BootPagesSpec {
        BootPagesSpec {
            layer_digest: Digest::of_bytes(b"layer").to_string(),
            layer_size: 1 << 20,
            digest: Digest::of_bytes(b"pages").to_string(),
            size: 1 << 20,
            path: dir.join("boot"),
            frames: frames
                .iter()
                .map(|&(offset, compressed_size)| BootFrameSpec {
                    offset,
                    compressed_size,
                    size: 4096,
                    digest: Digest::of_bytes(&offset.to_le_bytes()).to_string(),
                })
                .collect(),
            from_image: false,
        }
    }

    fn jobs(spec: &BootPagesSpec) -> Vec<FrameJob<'_>> {
        spec.frames()
            .into_iter()
            .enumerate()
            .map(|(k, f)| (k, spec, f))
            .collect()
    }

    /// The stream covers the frames end to end from the first without a
    /// cached copy; a gap or a cached frame ends it.
    #[test]
    fn the_stream_takes_the_uncached_frames_end_to_end() {
        let dir = tempfile::tempdir().unwrap();
        let s = spec(dir.path(), &[(0, 10), (10, 20), (30, 5), (40, 5), (45, 5)]);
        let all = jobs(&s);
        assert_eq!(stream_plan(&all[1..]), 0..2, "frames 1 and 2; a gap at 35");
        std::fs::write(s.frame_path(1), b"cached").unwrap();
        assert_eq!(stream_plan(&all[1..]), 1..2, "frame 1 is on disk");
        std::fs::write(s.frame_path(3), b"cached").unwrap();
        assert_eq!(stream_plan(&all[1..]), 1..2);
        assert_eq!(stream_plan(&all[3..]), 1..2, "frame 4 alone after 3");
        let other = spec(dir.path(), &[(0, 10)]);
        let mixed = vec![all[4].clone(), jobs(&other)[0].clone()];
        assert_eq!(stream_plan(&mixed), 0..1, "another layer's frame");
    }
}
