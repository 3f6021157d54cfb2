//! Device memory: a region's bytes may live in a GPU's memory, where the host must never take a
//! slice of them (a load from a device address is a fault, or worse, another process's page).
//!
//! A [`Device`] is what the transports need from a GPU: whether a range is one allocation of
//! it, and copies between it and host memory. [`cuda::CudaDevice`] is the CUDA driver API,
//! loaded at run time (`libcuda.so.1`, as NIXL is), so handoff builds and runs on machines
//! without CUDA and says plainly when a device region is asked for there. [`fake::FakeDevice`]
//! stands in for it on machines without a GPU: its addresses fault if the host dereferences
//! them and its bytes live in a shadow buffer, so every path that would touch device memory as
//! host memory is caught in CI.
//!
//! A region over device memory ([`crate::KvRegion::on_device`]) has no host chunks at all: the
//! calls that lend slices (`with_span*`, `lock_span*`) are an error on it, and `read`, `write`
//! and `copy_from` go through the device's copies. tcp moves it through a [`Stager`]: pinned
//! buffers and a copy stream, double-buffered against the socket.

pub mod cuda;
/// The fake device of CPU tests (feature `testing`; not in a release build).
#[cfg(any(test, feature = "testing"))]
pub mod fake;

use std::fmt::Debug;
use std::sync::Arc;

pub use handoff_proto::xfer::MemoryKind;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DeviceError {
    #[error("no CUDA driver on this machine ({0}): device memory needs one")]
    NoDriver(String),
    #[error("CUDA device {device}: {call} failed with error {code}")]
    Call {
        device: u32,
        call: &'static str,
        code: i32,
    },
    #[error("{len} bytes at {addr:#x} are not one allocation of CUDA device {device}")]
    NotDeviceMemory {
        device: u32,
        addr: usize,
        len: usize,
    },
}

/// A GPU as the transports use it. Copies are complete when they return (what was written is
/// in the destination); the connector orders them after the kernels that wrote the KV.
pub trait Device: Send + Sync + Debug {
    /// Which device this is.
    fn memory(&self) -> MemoryKind;

    /// Ok when `base..base + len` lies inside one allocation of this device.
    fn check_range(&self, base: usize, len: usize) -> Result<(), DeviceError>;

    /// Copies `dst.len()` bytes at device address `src` into `dst`.
    fn copy_to_host(&self, src: usize, dst: &mut [u8]) -> Result<(), DeviceError>;

    /// Copies `src` to device address `dst`.
    fn copy_from_host(&self, dst: usize, src: &[u8]) -> Result<(), DeviceError>;

    /// Records an event on `stream` (a `CUstream`, as `torch.cuda.current_stream().cuda_stream`
    /// gives it): it completes once the work enqueued there before it finished. Destroy it
    /// with [`Device::destroy_event`].
    fn record_event(&self, stream: u64) -> Result<u64, DeviceError>;

    /// Whether the work before `event` has finished: never blocks.
    fn event_done(&self, event: u64) -> Result<bool, DeviceError>;

    /// Frees an event [`Device::record_event`] made (nothing waits on it any more).
    fn destroy_event(&self, event: u64);

    /// Makes this device's primary context the calling thread's current one. A library that
    /// reaches device memory through CUDA on its own threads' behalf (NIXL's UCX backend)
    /// finds the device only through the caller's current context: without it, UCX turns its
    /// CUDA transports off.
    fn make_current(&self) -> Result<(), DeviceError>;

    /// Two pinned host buffers of `piece` bytes and a copy stream of their own, for a
    /// transport moving this device's memory a piece at a time.
    fn stager(self: Arc<Self>, piece: usize) -> Result<Box<dyn Stager>, DeviceError>;
}

/// How tcp moves device memory: two pinned host buffers and a copy stream of their own, so the
/// device↔host copy of one piece overlaps the socket's work on the other (double buffering).
///
/// Copies are asynchronous: `start_*` only enqueues one. Before the host touches a buffer,
/// [`Stager::buffer`] waits for that buffer's last copy; before a transfer may be reported
/// done (or failed: no copy may still write device memory then), [`Stager::wait_all`].
pub trait Stager: Send {
    /// Bytes in each of the two buffers.
    fn piece(&self) -> usize;

    /// Enqueues a copy of `len` (at most a piece) bytes at device address `src` into buffer
    /// `i` (0 or 1).
    fn start_down(&mut self, i: usize, src: usize, len: usize) -> Result<(), DeviceError>;

    /// Enqueues a copy of buffer `i`'s first `len` bytes to device address `dst`.
    fn start_up(&mut self, i: usize, dst: usize, len: usize) -> Result<(), DeviceError>;

    /// Buffer `i`, once its last copy completed: its bytes after a down copy, room to fill
    /// before an up copy.
    fn buffer(&mut self, i: usize) -> Result<&mut [u8], DeviceError>;

    /// Waits for every copy enqueued.
    fn wait_all(&mut self) -> Result<(), DeviceError>;
}
