//! Memory that crosses in from a foreign engine (vLLM's KV cache tensors, handed to handoff as an
//! address and a length): with the NIXL binding, the only `unsafe` in handoff.

#![allow(unsafe_code)]

use crate::KvRegion;

impl KvRegion {
    /// A region over memory the engine allocated itself (vLLM's KV cache tensors), split into
    /// chunks of `chunk` bytes. The memory is neither copied nor ever freed by handoff.
    ///
    /// # Safety
    /// `base..base + len` must be one allocation, valid for reads and writes for the rest of the
    /// process's life (an engine's KV cache is), and not reachable through any other Rust
    /// reference. The engine's own kernels may write it behind Rust's back, as a NIXL DMA does:
    /// handoff moves only bytes of blocks its ledgers hold (rules 2 and 3), which the engine
    /// does not touch meanwhile.
    pub unsafe fn from_foreign(base: usize, len: usize, chunk: usize) -> KvRegion {
        let mem: &'static mut [u8] = if len == 0 || base == 0 {
            &mut []
        } else {
            // SAFETY: the caller guarantees `base..base + len` is one allocation, valid for
            // reads and writes for the rest of the process and aliased by no Rust reference.
            unsafe { std::slice::from_raw_parts_mut(base as *mut u8, len) }
        };
        KvRegion::from_static(mem, chunk)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_foreign_region_reads_and_writes_the_engines_memory_in_place() {
        // The engine's allocation, leaked as an engine's KV cache lives for the whole process.
        let engine: &'static mut [u8] = Box::leak(vec![7u8; 64].into_boxed_slice());
        let base = engine.as_mut_ptr() as usize;
        // SAFETY: `engine` is leaked (lives forever) and no longer used through Rust.
        let r = unsafe { KvRegion::from_foreign(base, 64, 16) };
        assert_eq!(r.base_addr(), base);
        assert_eq!(r.len(), 64);
        let mut out = [0u8; 4];
        r.read(30, &mut out).unwrap();
        assert_eq!(out, [7; 4]);
        r.write(16, &[1, 2, 3]).unwrap();
        r.read(15, &mut out).unwrap();
        assert_eq!(out, [7, 1, 2, 3]);
        // SAFETY: reading the engine's memory as the engine would.
        let seen = unsafe { std::slice::from_raw_parts(base as *const u8, 64) };
        assert_eq!(&seen[16..19], &[1, 2, 3]);
    }
}
