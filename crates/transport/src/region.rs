//! [`KvRegion`]: registered memory that remote transfers and the engine share without `unsafe`.
//!
//! The region is one contiguous allocation (so NIXL can register it as one range and adjacent
//! blocks stay adjacent for the DMA engine), split into fixed-size chunks, each behind its own
//! lock. A transfer locks only the chunks it touches, for as long as it touches them; the TCP
//! backend reads from the socket straight into a locked chunk (no staging copy).
//!
//! Others write a region's memory behind Rust's back (DMA, a peer's transfer, the engine's
//! kernels), so a region holds it as raw pointers (`crate::backing::Chunk`) and makes a slice
//! over a chunk only while it holds that chunk's lock. Its own allocation is freed once the
//! region and every transfer holding one of its chunks are gone. A region may also cover memory
//! the engine allocated ([`KvRegion::from_foreign`], vLLM's KV tensors). The `unsafe` of both
//! is in `crate::foreign`.

use std::ops::Range;
use std::sync::Arc;

use parking_lot::lock_api::{ArcRwLockReadGuard, ArcRwLockWriteGuard};
use parking_lot::{RawRwLock, RwLock, RwLockReadGuard, RwLockWriteGuard};

use crate::backing::{Backing, Chunk};
use crate::device::{Device, MemoryKind};
use crate::TransportError;

/// A chunk's write lock held by a transfer in flight (derefs to the chunk's bytes).
pub type OwnedWriteGuard = ArcRwLockWriteGuard<RawRwLock, Chunk>;
/// A chunk's read lock held by a transfer in flight.
pub type OwnedReadGuard = ArcRwLockReadGuard<RawRwLock, Chunk>;

/// A checked span of a device region: its device and the span's device address.
pub struct DeviceSpan<'a> {
    pub device: &'a Arc<dyn Device>,
    pub addr: usize,
}

/// Largest piece [`KvRegion::copy_from`] stages through the host when it writes device memory.
const BOUNCE_BYTES: usize = 1 << 20;

/// Most pieces [`KvRegion::with_span_batched`] groups (well under the kernel's `IOV_MAX`).
pub const MAX_BATCH_PIECES: usize = 64;

#[derive(Debug)]
pub struct KvRegion {
    len: usize,
    chunk: usize,
    base: usize,
    /// Host memory's chunks; none for device memory (no slice of it may ever exist).
    chunks: Vec<Arc<RwLock<Chunk>>>,
    /// The GPU whose memory this is (`None`: host memory).
    device: Option<Arc<dyn Device>>,
}

impl KvRegion {
    /// A zeroed region of `len` bytes, locked in chunks of `chunk` bytes (the last may be
    /// shorter). A chunk of one KV block is a good choice.
    pub fn new(len: usize, chunk: usize) -> Self {
        let mut mem = vec![0u8; len].into_boxed_slice();
        // Fault every page in now (a zeroed allocation is mapped lazily): a transfer into pages
        // the process never touched runs measurably slower, even after they were first written
        // (NIXL's in-process copies ran at ~0.85× of the same copies between touched buffers).
        // `black_box` hides that the value is 0, so the stores over zeroed memory stay.
        const PAGE: usize = 4096;
        for i in (0..len).step_by(PAGE) {
            mem[i] = std::hint::black_box(0);
        }
        KvRegion::over(Backing::owned(mem), chunk)
    }

    /// A region over `backing`: its own allocation ([`KvRegion::new`]) or the engine's
    /// ([`KvRegion::from_foreign`], in `crate::foreign`).
    pub(crate) fn over(backing: Arc<Backing>, chunk: usize) -> Self {
        let chunk = chunk.max(1);
        let (len, base) = (backing.len(), backing.base());
        let chunks = (0..len)
            .step_by(chunk)
            .map(|at| Arc::new(RwLock::new(backing.chunk(at, chunk.min(len - at)))))
            .collect();
        KvRegion {
            len,
            chunk,
            base,
            chunks,
            device: None,
        }
    }

    /// A region over `len` bytes of `device`'s memory at `base` (checked in `crate::foreign`).
    pub(crate) fn over_device(
        device: Arc<dyn Device>,
        base: usize,
        len: usize,
        chunk: usize,
    ) -> Self {
        KvRegion {
            len,
            chunk: chunk.max(1),
            base,
            chunks: Vec::new(),
            device: Some(device),
        }
    }

    /// Where the bytes live.
    pub fn memory(&self) -> MemoryKind {
        self.device
            .as_ref()
            .map_or(MemoryKind::Host, |d| d.memory())
    }

    /// The device whose memory this is, if any.
    pub fn device(&self) -> Option<&Arc<dyn Device>> {
        self.device.as_ref()
    }

    /// Ok for host memory; for device memory the error every slice-lending call returns.
    pub fn host(&self) -> Result<(), TransportError> {
        match &self.device {
            None => Ok(()),
            Some(d) => Err(TransportError::NotHostMemory { memory: d.memory() }),
        }
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn chunk_size(&self) -> usize {
        self.chunk
    }

    /// Address of the first byte, for registration with a DMA-capable backend.
    pub fn base_addr(&self) -> usize {
        self.base
    }

    fn check(&self, offset: usize, len: usize) -> Result<(), TransportError> {
        crate::check_bounds(0, offset as u64, len as u64, self.len as u64)
    }

    /// The pieces of an in-bounds span, one per chunk it touches: (chunk index, byte range inside
    /// that chunk), in order.
    fn pieces(
        &self,
        offset: usize,
        len: usize,
    ) -> impl Iterator<Item = (usize, Range<usize>)> + '_ {
        let end = offset + len;
        let mut pos = offset;
        std::iter::from_fn(move || {
            (pos < end).then(|| {
                let idx = pos / self.chunk;
                let in_chunk = pos - idx * self.chunk;
                let take = (self.chunk - in_chunk).min(end - pos);
                pos += take;
                (idx, in_chunk..in_chunk + take)
            })
        })
    }

    /// The chunk indices a span touches, after checking its bounds.
    fn chunks_of(&self, offset: usize, len: usize) -> Result<Range<usize>, TransportError> {
        self.check(offset, len)?;
        if len == 0 {
            return Ok(0..0);
        }
        Ok(offset / self.chunk..(offset + len - 1) / self.chunk + 1)
    }

    /// Calls `f` on each piece of `[offset, offset + len)` in order, each under its chunk's
    /// write lock.
    pub fn with_span_mut<E>(
        &self,
        offset: usize,
        len: usize,
        mut f: impl FnMut(&mut [u8]) -> Result<(), E>,
    ) -> Result<Result<(), E>, TransportError> {
        self.host()?;
        self.check(offset, len)?;
        for (idx, piece) in self.pieces(offset, len) {
            if let Err(e) = f(&mut self.write_chunk(idx)[piece]) {
                return Ok(Err(e));
            }
        }
        Ok(Ok(()))
    }

    /// Calls `f` on each piece of `[offset, offset + len)` in order, each under its chunk's read
    /// lock.
    pub fn with_span<E>(
        &self,
        offset: usize,
        len: usize,
        mut f: impl FnMut(&[u8]) -> Result<(), E>,
    ) -> Result<Result<(), E>, TransportError> {
        self.host()?;
        self.check(offset, len)?;
        for (idx, piece) in self.pieces(offset, len) {
            if let Err(e) = f(&self.read_chunk(idx)[piece]) {
                return Ok(Err(e));
            }
        }
        Ok(Ok(()))
    }

    /// The span's pieces grouped for one vectored call each: consecutive pieces up to `max_bytes`
    /// (at least one piece) and at most [`MAX_BATCH_PIECES`].
    fn batches(
        &self,
        offset: usize,
        len: usize,
        max_bytes: usize,
    ) -> impl Iterator<Item = Vec<(usize, Range<usize>)>> + '_ {
        let mut pieces = self.pieces(offset, len).peekable();
        std::iter::from_fn(move || {
            let first = pieces.next()?;
            let mut bytes = first.1.len();
            let mut batch = vec![first];
            while batch.len() < MAX_BATCH_PIECES {
                match pieces.next_if(|(_, r)| bytes + r.len() <= max_bytes) {
                    Some(p) => {
                        bytes += p.1.len();
                        batch.push(p);
                    }
                    None => break,
                }
            }
            Some(batch)
        })
    }

    /// Like [`KvRegion::with_span`], but `f` gets consecutive pieces of up to `max_bytes`
    /// together, each group under its chunks' read locks: a backend moves a group with one
    /// vectored call, so fine-grained locks (a chunk per layer of a block) cost no extra
    /// system calls.
    pub fn with_span_batched<E>(
        &self,
        offset: usize,
        len: usize,
        max_bytes: usize,
        mut f: impl FnMut(&[&[u8]]) -> Result<(), E>,
    ) -> Result<Result<(), E>, TransportError> {
        self.host()?;
        self.check(offset, len)?;
        for batch in self.batches(offset, len, max_bytes) {
            let guards: Vec<_> = batch.iter().map(|(i, _)| self.read_chunk(*i)).collect();
            let slices: Vec<&[u8]> = guards
                .iter()
                .zip(&batch)
                .map(|(g, (_, r))| &g[r.clone()])
                .collect();
            if let Err(e) = f(&slices) {
                return Ok(Err(e));
            }
        }
        Ok(Ok(()))
    }

    /// Like [`KvRegion::with_span_mut`], in groups as [`KvRegion::with_span_batched`].
    pub fn with_span_mut_batched<E>(
        &self,
        offset: usize,
        len: usize,
        max_bytes: usize,
        mut f: impl FnMut(&mut [&mut [u8]]) -> Result<(), E>,
    ) -> Result<Result<(), E>, TransportError> {
        self.host()?;
        self.check(offset, len)?;
        for batch in self.batches(offset, len, max_bytes) {
            let mut guards: Vec<_> = batch.iter().map(|(i, _)| self.write_chunk(*i)).collect();
            let mut slices: Vec<&mut [u8]> = guards
                .iter_mut()
                .zip(&batch)
                .map(|(g, (_, r))| &mut g[r.clone()])
                .collect();
            if let Err(e) = f(&mut slices) {
                return Ok(Err(e));
            }
        }
        Ok(Ok(()))
    }

    /// For device memory, its device and the address of `len` bytes at `offset` (checked to be
    /// inside the region); `None` for host memory.
    pub fn device_span(
        &self,
        offset: usize,
        len: usize,
    ) -> Result<Option<DeviceSpan<'_>>, TransportError> {
        match &self.device {
            None => Ok(None),
            Some(device) => {
                self.check(offset, len)?;
                Ok(Some(DeviceSpan {
                    device,
                    addr: self.base + offset,
                }))
            }
        }
    }

    /// Copies `src` into the region at `offset` (device memory: by the device's copy).
    pub fn write(&self, offset: usize, src: &[u8]) -> Result<(), TransportError> {
        if let Some(d) = &self.device {
            self.check(offset, src.len())?;
            return Ok(d.copy_from_host(self.base + offset, src)?);
        }
        let mut at = 0;
        self.with_span_mut(offset, src.len(), |piece| {
            piece.copy_from_slice(&src[at..at + piece.len()]);
            at += piece.len();
            Ok::<(), ()>(())
        })?
        .map_err(|_| TransportError::Io("copy".into()))
    }

    /// Copies the region at `offset` into `dst` (device memory: by the device's copy).
    pub fn read(&self, offset: usize, dst: &mut [u8]) -> Result<(), TransportError> {
        if let Some(d) = &self.device {
            self.check(offset, dst.len())?;
            return Ok(d.copy_to_host(self.base + offset, dst)?);
        }
        let mut at = 0;
        self.with_span(offset, dst.len(), |piece| {
            dst[at..at + piece.len()].copy_from_slice(piece);
            at += piece.len();
            Ok::<(), ()>(())
        })?
        .map_err(|_| TransportError::Io("copy".into()))
    }

    /// Copies between two regions (or within one, for disjoint ranges in different chunks).
    pub fn copy_from(
        &self,
        dst_offset: usize,
        src: &KvRegion,
        src_offset: usize,
        len: usize,
    ) -> Result<(), TransportError> {
        src.check(src_offset, len)?;
        self.check(dst_offset, len)?;
        if self.device.is_some() {
            // Into device memory: through a host bounce buffer, a piece at a time.
            let mut bounce = vec![0u8; len.min(BOUNCE_BYTES)];
            let mut at = 0;
            while at < len {
                let n = (len - at).min(bounce.len());
                src.read(src_offset + at, &mut bounce[..n])?;
                self.write(dst_offset + at, &bounce[..n])?;
                at += n;
            }
            return Ok(());
        }
        let mut s = src_offset;
        self.with_span_mut(dst_offset, len, |piece| {
            let n = piece.len();
            let r = src.read(s, piece);
            s += n;
            r
        })?
    }

    /// Owned write locks of every chunk the span touches, for a transfer that outlives the call
    /// that posted it (a DMA write into this region runs until the backend reports it done), so
    /// that memory another agent writes behind Rust's back is never accessed meanwhile.
    pub fn lock_span_mut_owned(
        &self,
        offset: usize,
        len: usize,
    ) -> Result<Vec<OwnedWriteGuard>, TransportError> {
        self.host()?;
        Ok(self
            .chunks_of(offset, len)?
            .map(|i| self.chunks[i].write_arc())
            .collect())
    }

    /// Owned read locks of every chunk the span touches (the source of a DMA transfer).
    ///
    /// A chunk another transfer already reads is shared at once, even while a writer waits for
    /// it: that writer (the engine filling the block's next layer while a push WRITE of the
    /// previous one is in flight) waits for the transfer, whose release may be up to the very
    /// thread that asks here, so queueing behind it would deadlock. Only a writer that holds a
    /// chunk (a short engine access) makes this wait.
    pub fn lock_span_owned(
        &self,
        offset: usize,
        len: usize,
    ) -> Result<Vec<OwnedReadGuard>, TransportError> {
        self.host()?;
        Ok(self
            .chunks_of(offset, len)?
            .map(|i| loop {
                if let Some(g) = self.chunks[i].try_read_recursive_arc() {
                    break g;
                }
                std::thread::sleep(std::time::Duration::from_micros(20));
            })
            .collect())
    }

    fn write_chunk(&self, idx: usize) -> RwLockWriteGuard<'_, Chunk> {
        self.chunks[idx].write()
    }

    fn read_chunk(&self, idx: usize) -> RwLockReadGuard<'_, Chunk> {
        self.chunks[idx].read()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn writes_and_reads_across_chunks() {
        let r = KvRegion::new(100, 7);
        let data: Vec<u8> = (0..50).collect();
        r.write(13, &data).unwrap();
        let mut out = vec![0; 50];
        r.read(13, &mut out).unwrap();
        assert_eq!(out, data);
        let mut before = [9u8; 13];
        r.read(0, &mut before).unwrap();
        assert_eq!(before, [0; 13]);
    }

    #[test]
    fn a_waiting_writer_does_not_block_a_second_transfer_reading_the_same_chunk() {
        let r = Arc::new(KvRegion::new(64, 16));
        let first = r.lock_span_owned(0, 16).unwrap();
        let writer = {
            let r = r.clone();
            std::thread::spawn(move || r.write(0, &[1; 16]).unwrap())
        };
        // Let the writer queue up behind the first transfer's read lock.
        std::thread::sleep(std::time::Duration::from_millis(100));
        assert!(!writer.is_finished());
        // With a plain read lock this would wait for the writer, which waits for `first`.
        let (tx, rx) = std::sync::mpsc::channel();
        let r2 = r.clone();
        std::thread::spawn(move || tx.send(r2.lock_span_owned(0, 16).map(|g| g.len())));
        let second = rx.recv_timeout(std::time::Duration::from_secs(5));
        drop(first);
        assert!(
            matches!(second, Ok(Ok(1))),
            "second read lock waited behind the writer"
        );
        writer.join().unwrap();
    }

    #[test]
    fn batches_cover_a_span_in_order_within_their_limits() {
        let r = KvRegion::new(1000, 10);
        let data: Vec<u8> = (0..=255).cycle().take(1000).collect();
        r.write(0, &data).unwrap();
        let mut seen = Vec::new();
        let mut sizes = Vec::new();
        r.with_span_batched(5, 990, 64, |pieces| {
            sizes.push((pieces.len(), pieces.iter().map(|p| p.len()).sum::<usize>()));
            pieces.iter().for_each(|p| seen.extend_from_slice(p));
            Ok::<(), ()>(())
        })
        .unwrap()
        .unwrap();
        assert_eq!(seen, &data[5..995]);
        assert!(sizes.iter().all(|&(n, b)| n >= 1 && b <= 64), "{sizes:?}");
        // 990 bytes in groups of at most 64: 60 + 6×60 + ... never one piece per call.
        assert!(sizes.len() < 990 / 10, "{sizes:?}");
        let tiny = KvRegion::new(10_000, 1);
        let mut most = 0;
        tiny.with_span_mut_batched(0, 10_000, 1 << 20, |pieces| {
            most = most.max(pieces.len());
            pieces.iter_mut().for_each(|p| p.fill(3));
            Ok::<(), ()>(())
        })
        .unwrap()
        .unwrap();
        assert_eq!(most, MAX_BATCH_PIECES);
        let mut out = vec![0; 10_000];
        tiny.read(0, &mut out).unwrap();
        assert!(out.iter().all(|&b| b == 3));
    }

    #[test]
    fn out_of_bounds_is_an_error() {
        let r = KvRegion::new(10, 4);
        assert!(r.write(8, &[1, 2, 3]).is_err());
        assert!(r.read(usize::MAX, &mut [0]).is_err());
        assert!(r.lock_span_mut_owned(0, 11).is_err());
        assert!(r.lock_span_owned(0, 11).is_err());
    }

    #[test]
    fn copies_between_regions() {
        let a = KvRegion::new(64, 16);
        let b = KvRegion::new(64, 5);
        a.write(0, &[7; 64]).unwrap();
        b.copy_from(3, &a, 10, 40).unwrap();
        let mut out = vec![0; 64];
        b.read(0, &mut out).unwrap();
        assert_eq!(&out[..3], &[0; 3]);
        assert_eq!(&out[3..43], &[7; 40][..]);
        assert_eq!(&out[43..], &[0; 21][..]);
    }
}
