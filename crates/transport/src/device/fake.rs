//! A device for machines without a GPU: what CI runs every device path against.
//!
//! Its addresses are non-canonical on x86-64 (and above any user address on aarch64), so a
//! host load or store through one faults at once instead of reading some other memory: a path
//! that treats device memory as host memory crashes in CI rather than passing. Its bytes live
//! in a shadow buffer the fake's copies reach.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;

use super::{Device, DeviceError, MemoryKind, Stager};

/// Where every fake device's allocations start: no host pointer can be here.
const FAKE_BASE: usize = 0xdead_0000_0000_0000;
/// Address space apart between two fake devices.
const DEVICE_SPAN: usize = 1 << 40;

/// Where a fake allocation's bytes are.
#[derive(Debug)]
enum Backing {
    /// The fake's own shadow buffer.
    Owned(Vec<u8>),
    /// Host memory someone else owns (an engine's KV tensor), reached only by the copies.
    Adopted { ptr: usize, len: usize },
}

impl Backing {
    fn len(&self) -> usize {
        match self {
            Backing::Owned(v) => v.len(),
            Backing::Adopted { len, .. } => *len,
        }
    }
}

#[derive(Debug)]
pub struct FakeDevice {
    device: u32,
    /// Allocations: (base address, bytes), in address order, never freed (a test's lifetime).
    allocations: Mutex<Vec<(usize, Backing)>>,
    /// Streams: the completion flag of every kernel enqueued on each, in order.
    streams: Mutex<HashMap<u64, Vec<Arc<AtomicBool>>>>,
    /// Events: the kernels each waits for.
    events: Mutex<HashMap<u64, Vec<Arc<AtomicBool>>>>,
    next_event: std::sync::atomic::AtomicU64,
    /// Threads that made this device's context current ([`Device::make_current`]).
    bound: Mutex<Vec<std::thread::ThreadId>>,
}

impl FakeDevice {
    pub fn new(device: u32) -> Arc<FakeDevice> {
        Arc::new(FakeDevice {
            device,
            allocations: Mutex::new(Vec::new()),
            streams: Mutex::new(HashMap::new()),
            events: Mutex::new(HashMap::new()),
            next_event: std::sync::atomic::AtomicU64::new(1),
            bound: Mutex::new(Vec::new()),
        })
    }

    /// A "kernel" enqueued on `stream` that writes `bytes` at `dst` after `delay`, as a GPU
    /// finishes work the host enqueued earlier (an event recorded on that stream after this
    /// call completes only once it ran).
    pub fn late_kernel(self: &Arc<Self>, stream: u64, dst: usize, bytes: Vec<u8>, delay: Duration) {
        let done = Arc::new(AtomicBool::new(false));
        self.streams
            .lock()
            .entry(stream)
            .or_default()
            .push(done.clone());
        let me = self.clone();
        std::thread::spawn(move || {
            std::thread::sleep(delay);
            // A test's own allocation: a write outside it is the test's bug, seen as zeros.
            let _ = me.copy_from_host(dst, &bytes);
            done.store(true, Ordering::Release);
        });
    }

    /// Events recorded and not destroyed.
    /// Whether the calling thread made this device's context current.
    pub fn is_current_here(&self) -> bool {
        self.bound.lock().contains(&std::thread::current().id())
    }

    pub fn live_events(&self) -> usize {
        self.events.lock().len()
    }

    /// Allocates `len` zeroed bytes: its address follows the previous allocation's end with a
    /// gap of a page, so a range straddling two allocations is never one.
    pub fn alloc(&self, len: usize) -> usize {
        let mut a = self.allocations.lock();
        let base = Self::next_base(self.device, &a);
        a.push((base, Backing::Owned(vec![0; len])));
        base
    }

    fn next_base(device: u32, a: &[(usize, Backing)]) -> usize {
        match a.last() {
            Some((b, m)) => b + m.len() + 4096,
            None => FAKE_BASE + device as usize * DEVICE_SPAN,
        }
    }

    /// Makes `len` bytes of host memory at `ptr` an allocation of this device: the address
    /// returned reaches them through the device's copies only (the host faults on it). How a
    /// test runs an engine's whole KV path (vLLM's, on host tensors) as if its KV were on a GPU.
    ///
    /// # Safety
    /// `ptr..ptr + len` is host memory that stays allocated as long as this device lives, and
    /// is read and written by others only as an engine's KV is: never a block a transfer is
    /// moving at the time (the rules handoff keeps for foreign memory, `KvRegion::from_foreign`).
    #[allow(unsafe_code)]
    pub unsafe fn adopt(&self, ptr: usize, len: usize) -> usize {
        let mut a = self.allocations.lock();
        let base = Self::next_base(self.device, &a);
        a.push((base, Backing::Adopted { ptr, len }));
        base
    }

    /// A region over a fresh allocation of `len` bytes, locked in chunks of `chunk`. Safe: a
    /// fake device never frees its memory, so the region cannot outlive it.
    pub fn region(self: &Arc<Self>, len: usize, chunk: usize) -> crate::KvRegion {
        let base = self.alloc(len);
        crate::KvRegion::over_device(self.clone(), base, len, chunk)
    }

    /// Runs `f` on the allocation holding `addr..addr + len` at its offset.
    fn with<R>(
        &self,
        addr: usize,
        len: usize,
        f: impl FnOnce(&mut [u8]) -> R,
    ) -> Result<R, DeviceError> {
        let mut a = self.allocations.lock();
        let not_ours = DeviceError::NotDeviceMemory {
            device: self.device,
            addr,
            len,
        };
        let (base, mem) = a
            .iter_mut()
            .rev()
            .find(|(b, _)| *b <= addr)
            .ok_or(not_ours.clone())?;
        let at = addr - *base;
        match (at.checked_add(len), mem) {
            (Some(end), Backing::Owned(m)) if end <= m.len() => Ok(f(&mut m[at..end])),
            (Some(end), Backing::Adopted { ptr, len: total }) if end <= *total => {
                // SAFETY: inside memory `adopt`'s caller keeps allocated and does not touch
                // while a transfer moves it; the slice lives for this copy only.
                #[allow(unsafe_code)]
                let m = unsafe { std::slice::from_raw_parts_mut((*ptr + at) as *mut u8, len) };
                Ok(f(m))
            }
            _ => Err(not_ours),
        }
    }
}

impl Device for FakeDevice {
    fn memory(&self) -> MemoryKind {
        MemoryKind::Cuda {
            device: self.device,
        }
    }

    fn check_range(&self, base: usize, len: usize) -> Result<(), DeviceError> {
        self.with(base, len, |_| ())
    }

    fn copy_to_host(&self, src: usize, dst: &mut [u8]) -> Result<(), DeviceError> {
        self.with(src, dst.len(), |m| dst.copy_from_slice(m))
    }

    fn copy_from_host(&self, dst: usize, src: &[u8]) -> Result<(), DeviceError> {
        self.with(dst, src.len(), |m| m.copy_from_slice(src))
    }

    fn record_event(&self, stream: u64) -> Result<u64, DeviceError> {
        let before = self
            .streams
            .lock()
            .get(&stream)
            .cloned()
            .unwrap_or_default();
        let id = self.next_event.fetch_add(1, Ordering::Relaxed);
        self.events.lock().insert(id, before);
        Ok(id)
    }

    fn event_done(&self, event: u64) -> Result<bool, DeviceError> {
        match self.events.lock().get(&event) {
            Some(work) => Ok(work.iter().all(|k| k.load(Ordering::Acquire))),
            // CUDA_ERROR_INVALID_HANDLE, as the driver answers an unknown event.
            None => Err(DeviceError::Call {
                device: self.device,
                call: "cuEventQuery",
                code: 400,
            }),
        }
    }

    fn destroy_event(&self, event: u64) {
        self.events.lock().remove(&event);
    }

    fn make_current(&self) -> Result<(), DeviceError> {
        let me = std::thread::current().id();
        let mut bound = self.bound.lock();
        if !bound.contains(&me) {
            bound.push(me);
        }
        Ok(())
    }

    fn stager(self: Arc<Self>, piece: usize) -> Result<Box<dyn Stager>, DeviceError> {
        Ok(Box::new(FakeStager {
            device: self,
            buffers: [vec![0; piece], vec![0; piece]],
            queued: [None, None],
        }))
    }
}

/// A copy enqueued on the fake's copy stream.
#[derive(Debug, Clone, Copy)]
enum Queued {
    Down { src: usize, len: usize },
    Up { dst: usize, len: usize },
}

/// The fake's stager: an enqueued copy runs only when something waits for it, so a transport
/// that reports a transfer done without waiting leaves the bytes short (in CI, not by chance).
struct FakeStager {
    device: Arc<FakeDevice>,
    buffers: [Vec<u8>; 2],
    queued: [Option<Queued>; 2],
}

impl FakeStager {
    fn run(&mut self, i: usize) -> Result<(), DeviceError> {
        match self.queued[i].take() {
            None => Ok(()),
            Some(Queued::Down { src, len }) => {
                self.device.copy_to_host(src, &mut self.buffers[i][..len])
            }
            Some(Queued::Up { dst, len }) => {
                self.device.copy_from_host(dst, &self.buffers[i][..len])
            }
        }
    }

    fn enqueue(&mut self, i: usize, copy: Queued, len: usize) -> Result<(), DeviceError> {
        if i > 1 || len > self.buffers[i].len() {
            return Err(DeviceError::Call {
                device: self.device.device,
                call: "cuMemcpyAsync",
                code: 1,
            });
        }
        // One stream: the buffer's earlier copy runs first.
        self.run(i)?;
        self.queued[i] = Some(copy);
        Ok(())
    }
}

impl Stager for FakeStager {
    fn piece(&self) -> usize {
        self.buffers[0].len()
    }

    fn start_down(&mut self, i: usize, src: usize, len: usize) -> Result<(), DeviceError> {
        self.enqueue(i, Queued::Down { src, len }, len)
    }

    fn start_up(&mut self, i: usize, dst: usize, len: usize) -> Result<(), DeviceError> {
        self.enqueue(i, Queued::Up { dst, len }, len)
    }

    fn buffer(&mut self, i: usize) -> Result<&mut [u8], DeviceError> {
        self.run(i)?;
        Ok(&mut self.buffers[i])
    }

    fn wait_all(&mut self) -> Result<(), DeviceError> {
        self.run(0)?;
        self.run(1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn copies_reach_the_shadow_and_nothing_outside_an_allocation() {
        let d = FakeDevice::new(1);
        let a = d.alloc(100);
        let b = d.alloc(10);
        assert!(b >= a + 100);
        d.copy_from_host(a + 10, &[1, 2, 3]).unwrap();
        let mut out = [0u8; 5];
        d.copy_to_host(a + 9, &mut out).unwrap();
        assert_eq!(out, [0, 1, 2, 3, 0]);
        // Past the end of an allocation, below the first one, straddling two: refused.
        assert!(d.check_range(a + 98, 3).is_err());
        assert!(d.check_range(a - 1, 1).is_err());
        assert!(d.check_range(a + 99, b - a).is_err());
        assert_eq!(d.memory(), MemoryKind::Cuda { device: 1 });
    }

    #[test]
    fn adopted_host_memory_is_reached_through_the_copies_only() {
        let d = FakeDevice::new(0);
        let mut host = vec![5u8; 64];
        // SAFETY: `host` outlives `d` and is not touched while the copies run.
        #[allow(unsafe_code)]
        let a = unsafe { d.adopt(host.as_mut_ptr() as usize, host.len()) };
        assert!(a >= FAKE_BASE, "an address the host faults on");
        d.copy_from_host(a + 8, &[1, 2]).unwrap();
        let mut out = [0u8; 4];
        d.copy_to_host(a + 7, &mut out).unwrap();
        assert_eq!(out, [5, 1, 2, 5]);
        assert!(d.check_range(a + 60, 5).is_err(), "past the adopted bytes");
        drop(d);
        assert_eq!(
            &host[7..11],
            &[5, 1, 2, 5],
            "the copies reached the host memory"
        );
    }

    #[test]
    fn a_staged_copy_lands_only_once_waited_for() {
        let d = FakeDevice::new(0);
        let a = d.alloc(8);
        let mut st = d.clone().stager(4).unwrap();
        st.buffer(1).unwrap()[..4].copy_from_slice(&[1, 2, 3, 4]);
        st.start_up(1, a + 2, 4).unwrap();
        let mut out = [9u8; 8];
        d.copy_to_host(a, &mut out).unwrap();
        assert_eq!(out, [0; 8], "enqueued, not run");
        st.wait_all().unwrap();
        d.copy_to_host(a, &mut out).unwrap();
        assert_eq!(out, [0, 0, 1, 2, 3, 4, 0, 0]);
        st.start_down(0, a + 3, 3).unwrap();
        assert_eq!(&st.buffer(0).unwrap()[..3], &[2, 3, 4]);
        assert!(st.start_down(0, a + 3, 5).is_err(), "more than a piece");
    }

    #[test]
    fn an_event_completes_once_the_kernels_before_it_on_its_stream_ran() {
        let d = FakeDevice::new(0);
        let a = d.alloc(4);
        let quiet = d.record_event(7).unwrap();
        d.late_kernel(7, a, vec![9; 4], Duration::from_millis(100));
        let after = d.record_event(7).unwrap();
        let other_stream = d.record_event(8).unwrap();
        assert!(d.event_done(quiet).unwrap(), "recorded before the kernel");
        assert!(d.event_done(other_stream).unwrap(), "another stream");
        assert!(!d.event_done(after).unwrap());
        let mut out = [0u8; 4];
        d.copy_to_host(a, &mut out).unwrap();
        assert_eq!(out, [0; 4], "not written yet");
        while !d.event_done(after).unwrap() {
            std::thread::sleep(Duration::from_millis(5));
        }
        d.copy_to_host(a, &mut out).unwrap();
        assert_eq!(out, [9; 4]);
        d.destroy_event(after);
        assert!(
            d.event_done(after).is_err(),
            "a destroyed event is an error"
        );
    }
}
