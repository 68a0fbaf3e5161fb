//! The work each stage does on a frame: the producer fills it with a pattern, the transform
//! rewrites every 8-byte word, the consumer checks every word. In place on a shared block
//! (streamed through one stack chunk inside its CPU-access bracket, a [`CpuView`]: shared
//! memory is never a `&[u8]`), or on a stage's private buffer for the pipes baseline.

use dmabuf_rt::CpuView;

use super::{PipelineError, Result};

/// Frame bytes are streamed through a stack chunk of this size (it stays in L1).
const CHUNK: usize = 16 << 10;

fn pattern_word(seq: u64, word: u64) -> u64 {
    (seq.rotate_left(40) ^ word).wrapping_mul(0x9E37_79B9_7F4A_7C15)
}

fn transform_word(w: u64, seq: u64) -> u64 {
    w.rotate_left(17) ^ seq
}

pub(super) fn produce_bytes(seq: u64, first_word: u64, out: &mut [u8]) {
    for (k, w) in out.chunks_exact_mut(8).enumerate() {
        w.copy_from_slice(&pattern_word(seq, first_word + k as u64).to_le_bytes());
    }
}

pub(super) fn transform_bytes(seq: u64, buf: &mut [u8]) {
    for w in buf.chunks_exact_mut(8) {
        let v = u64::from_le_bytes(w.try_into().expect("8 bytes"));
        w.copy_from_slice(&transform_word(v, seq).to_le_bytes());
    }
}

pub(super) fn verify_bytes(seq: u64, first_word: u64, buf: &[u8]) -> Result<()> {
    for (k, w) in buf.chunks_exact(8).enumerate() {
        let found = u64::from_le_bytes(w.try_into().expect("8 bytes"));
        let word = first_word + k as u64;
        let expected = transform_word(pattern_word(seq, word), seq);
        if found != expected {
            return Err(PipelineError::Corrupt { seq, offset: word as usize * 8, expected, found });
        }
    }
    Ok(())
}

/// Writes frame `seq` into the block, chunk by chunk, inside its write access `cpu`.
pub(super) fn produce_in_place(cpu: CpuView<'_>, seq: u64, len: usize) -> Result<()> {
    let mut chunk = [0u8; CHUNK];
    for off in (0..len).step_by(CHUNK) {
        let n = CHUNK.min(len - off);
        produce_bytes(seq, (off / 8) as u64, &mut chunk[..n]);
        cpu.write(off, &chunk[..n])?;
    }
    cpu.end()?;
    Ok(())
}

/// Rewrites every word of the frame where it lies: each chunk is read, transformed and
/// written back inside one read-write access, `cpu`.
pub(super) fn transform_in_place(cpu: CpuView<'_>, seq: u64, len: usize) -> Result<()> {
    let mut chunk = [0u8; CHUNK];
    for off in (0..len).step_by(CHUNK) {
        let n = CHUNK.min(len - off);
        cpu.read(off, &mut chunk[..n])?;
        transform_bytes(seq, &mut chunk[..n]);
        cpu.write(off, &chunk[..n])?;
    }
    cpu.end()?;
    Ok(())
}

/// Checks every word of the frame inside a read access, `cpu`.
pub(super) fn verify_in_place(cpu: CpuView<'_>, seq: u64, len: usize) -> Result<()> {
    let mut chunk = [0u8; CHUNK];
    for off in (0..len).step_by(CHUNK) {
        let n = CHUNK.min(len - off);
        cpu.read(off, &mut chunk[..n])?;
        verify_bytes(seq, (off / 8) as u64, &chunk[..n])?;
    }
    cpu.end()?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn work_functions_agree_and_catch_a_wrong_word() {
        let mut buf = vec![0u8; 4096];
        produce_bytes(5, 0, &mut buf);
        transform_bytes(5, &mut buf);
        verify_bytes(5, 0, &buf).unwrap();
        assert!(verify_bytes(6, 0, &buf).is_err(), "another frame's contents must not pass");
        buf[808] ^= 1;
        match verify_bytes(5, 0, &buf) {
            Err(PipelineError::Corrupt { seq: 5, offset: 808, .. }) => {}
            other => panic!("{other:?}"),
        }
    }
}
