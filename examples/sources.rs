//! Allocates one buffer from every memory source this machine offers, writes it under the
//! CPU-access guard, reads it back through an independent second mapping, and prints what
//! each source handed out.
//!
//! Run: `cargo run --example sources`

use dmabuf_rt::source::{GemSource, HeapSource, HostSource, MemorySource, ShmemSource};
use dmabuf_rt::{Access, Result};

fn exercise(src: &dyn MemorySource) -> Result<()> {
    let seg = src.create_segment(256 << 10)?;
    let msg = format!("hello from {}", src.name());
    let cpu = seg.cpu_access(Access::Write)?;
    cpu.write(0, msg.as_bytes())?;
    cpu.end()?;
    let second = seg.map()?;
    let mut back = vec![0; msg.len()];
    {
        let _read = seg.cpu_access(Access::Read)?;
        second.read(0, &mut back)?;
    }
    assert_eq!(back, msg.as_bytes());
    println!(
        "{:<32} {:>8} bytes  {:?} {:?} dma-buf={}",
        src.name(),
        seg.len(),
        seg.kind(),
        seg.origin(),
        seg.is_dma_buf()
    );
    Ok(())
}

fn main() {
    print!("{}", dmabuf_rt::discovery::discover());
    println!();
    let mut sources: Vec<Box<dyn MemorySource>> = vec![Box::new(ShmemSource::new())];
    let host = HostSource::new();
    println!("pinned host memory: {:?}", host.backing());
    sources.push(Box::new(host));
    match ShmemSource::with_udmabuf() {
        Ok(s) => sources.push(Box::new(s)),
        Err(e) => println!("skipping shmem+udmabuf: {e}"),
    }
    match HeapSource::open("system") {
        Ok(s) => sources.push(Box::new(s)),
        Err(e) => println!("skipping dma-heap:system: {e}"),
    }
    match GemSource::open_first(None) {
        Ok(s) => sources.push(Box::new(s)),
        Err(e) => println!("skipping DRM GEM: {e}"),
    }
    for s in &sources {
        if let Err(e) = exercise(s.as_ref()) {
            println!("{:<32} failed: {e}", s.name());
        }
    }
}
