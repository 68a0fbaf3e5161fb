//! Cost of getting a fresh, written buffer from each memory source, against two peers measured
//! in the same run: fresh anonymous memory (`mmap(MAP_ANONYMOUS)` through memmap2, the
//! fair peer: new pages every time) and a `Vec<u8>` (malloc, which reuses warm memory; the gap
//! to it is what the caching allocator is for).
//!
//! Each cell is the median over many rounds of allocate + write every byte + drop.
//! Run: `cargo bench --bench sources` (sources missing here are listed and skipped).

use std::hint::black_box;
use std::time::{Duration, Instant};

use dmabuf_rt::source::{GemSource, HeapSource, HostSource, MemorySource, ShmemSource};
use dmabuf_rt::{Access, Result};

const SIZES: [usize; 4] = [4 << 10, 64 << 10, 1 << 20, 16 << 20];

fn rounds(size: usize) -> usize {
    ((256 << 20) / size).clamp(20, 2000)
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

fn time_vec(size: usize, data: &[u8]) -> Duration {
    median(
        (0..rounds(size))
            .map(|_| {
                let t = Instant::now();
                let mut v = Vec::<u8>::with_capacity(size);
                v.extend_from_slice(&data[..size]);
                black_box(&v);
                drop(v);
                t.elapsed()
            })
            .collect(),
    )
}

fn time_anon(size: usize, data: &[u8]) -> Duration {
    median(
        (0..rounds(size))
            .map(|_| {
                let t = Instant::now();
                let mut m = memmap2::MmapMut::map_anon(size).unwrap();
                m.copy_from_slice(&data[..size]);
                drop(black_box(m));
                t.elapsed()
            })
            .collect(),
    )
}

fn time_source(src: &dyn MemorySource, size: usize, data: &[u8]) -> Result<Duration> {
    let mut samples = Vec::with_capacity(rounds(size));
    for _ in 0..rounds(size) {
        let t = Instant::now();
        let seg = src.create_segment(size)?;
        seg.cpu_access(Access::Write)?.write(0, &data[..size])?;
        drop(black_box(seg));
        samples.push(t.elapsed());
    }
    Ok(median(samples))
}

fn main() {
    let data: Vec<u8> = (0..*SIZES.last().unwrap()).map(|i| i as u8).collect();
    let mut sources: Vec<Box<dyn MemorySource>> =
        vec![Box::new(ShmemSource::new()), Box::new(ShmemSource::new().reserve(false)), Box::new(HostSource::new())];
    let names_extra = ["", "(reserve=false)", ""];
    match ShmemSource::with_udmabuf() {
        Ok(s) => sources.push(Box::new(s)),
        Err(e) => println!("# skipped shmem+udmabuf: {e}"),
    }
    match HeapSource::open("system") {
        Ok(s) => sources.push(Box::new(s)),
        Err(e) => println!("# skipped dma-heap:system: {e}"),
    }
    match GemSource::open_first(None) {
        Ok(s) => sources.push(Box::new(s)),
        Err(e) => println!("# skipped gem: {e}"),
    }
    print!("{:<34}", "source (allocate+write+drop)");
    for s in SIZES {
        print!("{:>20}", format!("{} KiB", s >> 10));
    }
    println!();
    let warm: Vec<Duration> = SIZES.iter().map(|&s| time_vec(s, &data)).collect();
    let peer: Vec<Duration> = SIZES.iter().map(|&s| time_anon(s, &data)).collect();
    for (label, row) in [("Vec<u8> (warm malloc)", &warm), ("anon mmap (peer)", &peer)] {
        print!("{:<34}", label);
        for (k, p) in row.iter().enumerate() {
            let ratio = p.as_secs_f64() / peer[k].as_secs_f64();
            print!("{:>20}", format!("{:.1} us x{ratio:.2}", p.as_secs_f64() * 1e6));
        }
        println!();
    }
    for (i, src) in sources.iter().enumerate() {
        let label = format!("{} {}", src.name(), names_extra.get(i).copied().unwrap_or(""));
        print!("{:<34}", label.trim());
        for (k, &size) in SIZES.iter().enumerate() {
            match time_source(src.as_ref(), size, &data) {
                Ok(d) => {
                    let ratio = d.as_secs_f64() / peer[k].as_secs_f64();
                    print!("{:>20}", format!("{:.1} us x{ratio:.2}", d.as_secs_f64() * 1e6));
                }
                Err(e) => print!("{:>20}", format!("err: {e}").chars().take(19).collect::<String>()),
            }
        }
        println!();
    }
    println!("# xN = median time relative to the anon-mmap peer at the same size, same run");
}
