//! The memory under a [`KvRegion`]: handoff's own allocation or an engine's KV tensors (foreign
//! memory), both written behind Rust's back. A registered
//! region is written by NIXL's DMA engine or a peer's transfer, and a region over an engine's
//! own KV tensors ([`KvRegion::from_foreign`]) by the engine's kernels too. So no Rust reference
//! to that memory lives longer than one access under its chunk's lock: a region holds raw
//! pointers and lengths ([`Chunk`]), and a slice over a chunk exists only while the lock that
//! guards it is held.

#![allow(unsafe_code)]

use std::ops::{Deref, DerefMut};
use std::ptr::NonNull;
use std::sync::Arc;

use crate::KvRegion;

/// The allocation under a region: handoff's own (freed when the region and every transfer
/// holding one of its chunks are gone) or the engine's (never freed by handoff).
#[derive(Debug)]
pub(crate) struct Backing {
    ptr: NonNull<u8>,
    len: usize,
    owned: bool,
}

// SAFETY: `Backing` is a pointer and a length; the bytes behind it are only reached through
// `Chunk`s, each behind a lock, so sharing or sending the pointer itself races nothing.
unsafe impl Send for Backing {}
// SAFETY: as above: `&Backing` gives no access to the bytes.
unsafe impl Sync for Backing {}

impl Backing {
    /// Takes ownership of `mem`; it is freed on drop.
    pub(crate) fn owned(mem: Box<[u8]>) -> Arc<Backing> {
        let len = mem.len();
        let ptr = NonNull::new(Box::into_raw(mem).cast::<u8>()).unwrap_or(NonNull::dangling());
        Arc::new(Backing {
            ptr,
            len,
            owned: true,
        })
    }

    pub(crate) fn base(&self) -> usize {
        self.ptr.as_ptr() as usize
    }

    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// The chunk `[offset, offset + len)` (in bounds: the caller splits `self.len`).
    pub(crate) fn chunk(self: &Arc<Backing>, offset: usize, len: usize) -> Chunk {
        // Checked in release builds too: the pointer arithmetic below relies on it.
        assert!(offset + len <= self.len, "chunk past its backing");
        // SAFETY: `offset + len <= self.len`, so the pointer stays inside the allocation (or is
        // `ptr` itself when both are 0).
        let ptr = unsafe { self.ptr.add(offset) };
        Chunk {
            ptr,
            len,
            _backing: self.clone(),
        }
    }
}

impl Drop for Backing {
    fn drop(&mut self) {
        if self.owned {
            let slice = std::ptr::slice_from_raw_parts_mut(self.ptr.as_ptr(), self.len);
            // SAFETY: `ptr` and `len` came from `Box::into_raw` of a `Box<[u8]>` in `owned`, and
            // this is the last owner (every chunk holds an `Arc` of this backing).
            drop(unsafe { Box::from_raw(slice) });
        }
    }
}

/// A chunk of a region: a pointer and a length, behind the chunk's lock. It derefs to a slice
/// only for as long as it is borrowed, which is as long as that lock is held.
#[derive(Debug)]
pub struct Chunk {
    ptr: NonNull<u8>,
    len: usize,
    /// Keeps the allocation alive while a transfer holds this chunk's lock.
    _backing: Arc<Backing>,
}

// SAFETY: a `Chunk` is only reached through its `RwLock`, which makes access exclusive (write)
// or shared and read-only (read); the pointer may move between threads with it.
unsafe impl Send for Chunk {}
// SAFETY: `&Chunk` only gives `&[u8]` (shared reads), under the chunk's read lock.
unsafe impl Sync for Chunk {}

impl Deref for Chunk {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        // SAFETY: `ptr..ptr + len` lies inside a live allocation (`_backing`), and the chunk's
        // lock, held by whoever borrows this `Chunk`, keeps every other handoff access out.
        // Others (DMA, the engine's kernels) touch only blocks no ledger hands handoff then.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl DerefMut for Chunk {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in `deref`, and `&mut self` means the chunk's write lock is held, so this
        // is the only slice over these bytes that handoff has.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl KvRegion {
    /// A region over memory the engine allocated itself (vLLM's KV cache tensors), split into
    /// chunks of `chunk` bytes. The memory is neither copied nor freed by handoff.
    ///
    /// # Safety
    /// `base..base + len` must be one allocation, valid for reads and writes for as long as the
    /// region or any transfer on it lives (an engine's KV cache lives as long as the engine).
    /// The engine's own kernels may write it behind Rust's back, as a NIXL DMA does: handoff
    /// moves only bytes of blocks its ledgers hold (rules 2 and 3), which the engine does not
    /// touch meanwhile, and holds no reference to them between accesses.
    pub unsafe fn from_foreign(base: usize, len: usize, chunk: usize) -> KvRegion {
        let (ptr, len) = match NonNull::new(base as *mut u8) {
            Some(p) if len > 0 => (p, len),
            _ => (NonNull::dangling(), 0),
        };
        KvRegion::over(
            Arc::new(Backing {
                ptr,
                len,
                owned: false,
            }),
            chunk,
        )
    }
}

impl KvRegion {
    /// A region over `len` bytes of `device`'s memory at `base`, which the engine allocated (a
    /// KV cache tensor on a GPU). No host slice of it is ever made: the slice-lending calls are
    /// an error on it, and its bytes move by the device's copies. Refused unless the driver says
    /// the range is one allocation of that device.
    ///
    /// # Safety
    /// The allocation must stay allocated for as long as the region or any transfer on it lives
    /// (the driver cannot tell a freed and reused range from the engine's KV cache).
    pub unsafe fn on_device(
        device: std::sync::Arc<dyn crate::device::Device>,
        base: usize,
        len: usize,
        chunk: usize,
    ) -> Result<KvRegion, crate::TransportError> {
        device.check_range(base, len)?;
        Ok(KvRegion::over_device(device, base, len, chunk))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_foreign_region_reads_and_writes_the_engines_memory_in_place() {
        let mut engine = vec![7u8; 64];
        let base = engine.as_mut_ptr() as usize;
        // SAFETY: `engine` outlives the region (dropped after it) and is not used through Rust
        // while the region is.
        let r = unsafe { KvRegion::from_foreign(base, 64, 16) };
        assert_eq!(r.base_addr(), base);
        assert_eq!(r.len(), 64);
        let mut out = [0u8; 4];
        r.read(30, &mut out).unwrap();
        assert_eq!(out, [7; 4]);
        r.write(16, &[1, 2, 3]).unwrap();
        r.read(15, &mut out).unwrap();
        assert_eq!(out, [7, 1, 2, 3]);
        drop(r);
        // The engine's memory is still the engine's, with what handoff wrote.
        assert_eq!(&engine[16..19], &[1, 2, 3]);
    }

    #[test]
    fn an_owned_region_is_freed_once_its_last_transfer_lets_go() {
        let r = KvRegion::new(64, 16);
        let held = r.lock_span_owned(0, 16).unwrap();
        let backing = Arc::downgrade(&held[0]._backing);
        drop(r);
        // A transfer still holds a chunk: the memory lives on.
        assert!(backing.upgrade().is_some());
        assert_eq!(held[0].len(), 16);
        drop(held);
        assert!(backing.upgrade().is_none(), "freed with its last chunk");
    }
}
