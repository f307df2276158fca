//! Builds a lookup table over a synthetic tree and times it.
//!
//! `cargo run --release -p lamina-format --example lookup_bench -- --keys 1000000 [--threads N]
//! [--lambda L] [--alpha A] [--repeat R] [--table 0|1] [--lookups 0|1]`; prints one JSON line per
//! measurement. With `--repeat R` the hash function and the table are each
//! built `R` times and the median time is printed (the machine may be
//! shared); `--table 0` stops after the hash function, `--lookups 0`
//! after the table.

use std::time::Instant;

use lamina_format::lookup::mphf::{self, MphfParams};
use lamina_format::lookup::{build, BuildEntry, LookupTable};

const ROOT: u64 = 1;

/// An entry's parent nid, own nid, and whether it is a directory.
type Shape = (u64, u64, bool);

struct Args {
    keys: usize,
    threads: usize,
    params: MphfParams,
    repeat: usize,
    table: bool,
    lookups: bool,
}

fn args() -> Result<Args, String> {
    let mut out = Args {
        keys: 1_000_000,
        threads: std::thread::available_parallelism().map_or(1, |n| n.get()),
        params: MphfParams::default(),
        repeat: 1,
        table: true,
        lookups: true,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let value = it.next().ok_or(format!("{flag} needs a value"))?;
        let bad = |e: &dyn std::fmt::Display| format!("bad value for {flag}: {value}: {e}");
        match flag.as_str() {
            "--keys" => out.keys = value.parse().map_err(|e| bad(&e))?,
            "--threads" => out.threads = value.parse().map_err(|e| bad(&e))?,
            "--lambda" => out.params.lambda = value.parse().map_err(|e| bad(&e))?,
            "--alpha" => out.params.alpha = value.parse().map_err(|e| bad(&e))?,
            "--repeat" => out.repeat = value.parse::<usize>().map_err(|e| bad(&e))?.max(1),
            "--table" => out.table = value != "0",
            "--lookups" => out.lookups = value != "0",
            _ => return Err(format!("unknown flag {flag}")),
        }
    }
    Ok(out)
}

/// A tree of `n` entries, parents first: every fifth entry is a directory
/// of 50 entries (so ten subdirectories each: depth 6 at a million);
/// names like `lib-0001e240.so`. Entry `i` is nid `i + 100`.
fn synthetic(n: usize) -> (Vec<Vec<u8>>, Vec<Shape>) {
    let names = (0..n)
        .map(|i| format!("lib-{i:08x}.so").into_bytes())
        .collect();
    let shape = (0..n)
        .map(|i| {
            let parent = match i / 50 {
                0 => ROOT,
                k => ((k - 1) * 5) as u64 + 100,
            };
            (parent, i as u64 + 100, i % 5 == 0)
        })
        .collect();
    (names, shape)
}

/// The process's CPU time (user and system, all threads) in seconds, from
/// `/proc/self/stat` (0 where there is none), assuming 100 ticks a second.
fn cpu_seconds() -> f64 {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    // Fields after the command's closing parenthesis; utime and stime are
    // the 14th and 15th fields of the line.
    let after = stat.rsplit_once(')').map_or("", |(_, rest)| rest);
    let ticks: u64 = after
        .split_whitespace()
        .skip(11)
        .take(2)
        .filter_map(|f| f.parse::<u64>().ok())
        .sum();
    ticks as f64 / 100.0
}

/// The median of `repeat` timings (seconds) of `f`, the mean CPU time of
/// a call (all threads), and the last call's result.
fn median_of<T>(repeat: usize, mut f: impl FnMut() -> T) -> (f64, f64, T) {
    let mut times = Vec::with_capacity(repeat);
    let mut last = None;
    let cpu = cpu_seconds();
    for _ in 0..repeat {
        let start = Instant::now();
        last = Some(f());
        times.push(start.elapsed().as_secs_f64());
    }
    let cpu = (cpu_seconds() - cpu) / repeat as f64;
    times.sort_by(f64::total_cmp);
    (
        times[times.len() / 2],
        cpu,
        last.expect("repeat is at least 1"),
    )
}

/// Mean nanoseconds of `f` over `count` calls.
fn time_each(count: usize, mut f: impl FnMut(usize) -> bool) -> (f64, usize) {
    let start = Instant::now();
    let hits = (0..count).filter(|&i| f(i)).count();
    (start.elapsed().as_nanos() as f64 / count as f64, hits)
}

// Over 100 lines: the benchmark's steps in order, each printing its figures.
fn main() -> Result<(), String> {
    let args = args()?;
    let n = args.keys;
    let (names, shape) = synthetic(n);
    let entries = || {
        shape
            .iter()
            .zip(&names)
            .map(|(&(parent, child, is_dir), name)| BuildEntry {
                parent,
                name,
                child,
                is_dir,
            })
    };

    let start = Instant::now();
    let hashes: Vec<u64> = entries()
        .map(|e| mphf::entry_hash(0, e.parent, e.name))
        .collect();
    let hashed = start.elapsed().as_secs_f64();
    let (function_s, function_cpu_s, function) = median_of(args.repeat, || {
        mphf::build(&hashes, &args.params, args.threads)
    });
    let function = function.map_err(|e| e.to_string())?;
    let bits = |bytes: usize| bytes as f64 * 8.0 / n as f64;
    println!(
        "{{\"what\":\"hash function\",\"keys\":{n},\"repeat\":{},\"threads\":{},\"lambda\":{},\"alpha\":{},\"hash_keys_s\":{hashed:.4},\"build_s\":{function_s:.4},\"cpu_s\":{function_cpu_s:.3},\"bits_per_key\":{:.3},\"pilot_bits_per_key\":{:.3},\"remap_bits_per_key\":{:.3}}}",
        args.repeat,
        args.threads,
        args.params.lambda,
        args.params.alpha,
        bits(function.stored_bytes()),
        bits(function.pilots.len()),
        bits(function.remap.len() * 4),
    );
    if !args.table {
        return Ok(());
    }

    let (table_s, table_cpu_s, table_bytes) = median_of(args.repeat, || {
        build(ROOT, [0; 32], entries(), &args.params, args.threads)
    });
    let table_bytes = table_bytes.map_err(|e| e.to_string())?;
    let start = Instant::now();
    let table = LookupTable::parse(&table_bytes).map_err(|e| e.to_string())?;
    let parse_s = start.elapsed().as_secs_f64();
    let name_bytes: usize = names.iter().map(|n| n.len()).sum();
    println!(
        "{{\"what\":\"table\",\"keys\":{n},\"repeat\":{},\"threads\":{},\"build_s\":{table_s:.4},\"cpu_s\":{table_cpu_s:.3},\"parse_s\":{parse_s:.4},\"bytes\":{},\"bytes_per_key\":{:.2},\"name_bytes_per_key\":{:.2},\"table_digest\":\"{}\"}}",
        args.repeat,
        args.threads,
        table_bytes.len(),
        table_bytes.len() as f64 / n as f64,
        name_bytes as f64 / n as f64,
        // The table's own SHA-256 (header bytes 96..128): equal digests,
        // equal tables.
        table_bytes[96..104]
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect::<String>(),
    );

    if !args.lookups {
        return Ok(());
    }
    // Queries in a scattered order, so each one misses the cache as a
    // real workload's would.
    let count = n.min(2_000_000);
    let order: Vec<usize> = (0..count)
        .map(|i| (i as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15) as usize % n)
        .collect();
    let queries: Vec<(u64, Vec<u8>, u64)> = order
        .iter()
        .map(|&i| (shape[i].0, names[i].clone(), shape[i].1))
        .collect();
    let (hit_ns, hits) = time_each(count, |i| {
        let (parent, name, child) = &queries[i];
        table.lookup(*parent, name) == Some(*child)
    });
    let missing: Vec<(u64, Vec<u8>)> = queries
        .iter()
        .map(|(parent, name, _)| (*parent, [&name[..], b"x"].concat()))
        .collect();
    let (miss_ns, false_hits) = time_each(count, |i| {
        table.lookup(missing[i].0, &missing[i].1).is_some()
    });
    let paths: Vec<Vec<u8>> = order.iter().map(|&i| path_of(i, &names, &shape)).collect();
    let (path_hit_ns, path_hits) = time_each(count, |i| {
        table.lookup_path(&paths[i]) == Some(queries[i].2)
    });
    let missing_paths: Vec<Vec<u8>> = paths.iter().map(|p| [&p[..], b"x"].concat()).collect();
    let (path_miss_ns, path_false_hits) =
        time_each(count, |i| table.lookup_path(&missing_paths[i]).is_some());
    let mean_path: f64 = paths.iter().map(|p| p.len()).sum::<usize>() as f64 / count as f64;
    println!(
        "{{\"what\":\"lookups\",\"keys\":{n},\"queries\":{count},\"hit_ns\":{hit_ns:.1},\"miss_ns\":{miss_ns:.1},\"path_hit_ns\":{path_hit_ns:.1},\"path_miss_ns\":{path_miss_ns:.1},\"mean_path_bytes\":{mean_path:.1}}}"
    );
    if hits != count || path_hits != count || false_hits != 0 || path_false_hits != 0 {
        return Err(format!(
            "wrong answers: {hits}/{path_hits} hits, {false_hits}/{path_false_hits} false hits"
        ));
    }
    Ok(())
}

/// The `/`-joined path of entry `i`.
fn path_of(mut i: usize, names: &[Vec<u8>], shape: &[Shape]) -> Vec<u8> {
    let mut components = vec![&names[i][..]];
    while shape[i].0 != ROOT {
        i = (shape[i].0 - 100) as usize;
        components.push(&names[i]);
    }
    components.reverse();
    components.join(&b'/')
}
