//! The CUDA driver API, loaded at run time from `libcuda.so.1` (nothing needs CUDA to build,
//! and a machine without a driver gets [`DeviceError::NoDriver`] the first time device memory
//! is asked for). Every call runs with the device's primary context current on the calling
//! thread: the context vLLM's PyTorch uses, so the KV tensors' addresses are valid in it.

#![allow(unsafe_code)]

use std::ffi::{c_int, c_uint, c_void};
use std::sync::{Arc, OnceLock};

use super::{Device, DeviceError, MemoryKind, Stager};

type CuResult = c_int;
type CuDevice = c_int;
type CuContext = *mut c_void;
type CuDevicePtr = u64;

// `CUpointer_attribute` values (cuda.h).
const ATTR_MEMORY_TYPE: c_int = 2;
const ATTR_DEVICE_ORDINAL: c_int = 9;
const ATTR_RANGE_START_ADDR: c_int = 11;
const ATTR_RANGE_SIZE: c_int = 12;
/// `CU_MEMORYTYPE_DEVICE`.
const MEMORYTYPE_DEVICE: c_uint = 2;

struct Driver {
    _lib: libloading::Library,
    device_get: unsafe extern "C" fn(*mut CuDevice, c_int) -> CuResult,
    retain: unsafe extern "C" fn(*mut CuContext, CuDevice) -> CuResult,
    ctx_set_current: unsafe extern "C" fn(CuContext) -> CuResult,
    pointer_attr: unsafe extern "C" fn(*mut c_void, c_int, CuDevicePtr) -> CuResult,
    mem_alloc: unsafe extern "C" fn(*mut CuDevicePtr, usize) -> CuResult,
    mem_free: unsafe extern "C" fn(CuDevicePtr) -> CuResult,
    htod: unsafe extern "C" fn(CuDevicePtr, *const c_void, usize) -> CuResult,
    dtoh: unsafe extern "C" fn(*mut c_void, CuDevicePtr, usize) -> CuResult,
    event_create: unsafe extern "C" fn(*mut *mut c_void, c_uint) -> CuResult,
    event_record: unsafe extern "C" fn(*mut c_void, *mut c_void) -> CuResult,
    event_query: unsafe extern "C" fn(*mut c_void) -> CuResult,
    event_destroy: unsafe extern "C" fn(*mut c_void) -> CuResult,
    stream_sync: unsafe extern "C" fn(*mut c_void) -> CuResult,
    stream_create: unsafe extern "C" fn(*mut *mut c_void, c_uint) -> CuResult,
    stream_destroy: unsafe extern "C" fn(*mut c_void) -> CuResult,
    host_alloc: unsafe extern "C" fn(*mut *mut c_void, usize, c_uint) -> CuResult,
    host_free: unsafe extern "C" fn(*mut c_void) -> CuResult,
    dtoh_async: unsafe extern "C" fn(*mut c_void, CuDevicePtr, usize, *mut c_void) -> CuResult,
    htod_async: unsafe extern "C" fn(CuDevicePtr, *const c_void, usize, *mut c_void) -> CuResult,
    event_sync: unsafe extern "C" fn(*mut c_void) -> CuResult,
}

/// `CU_EVENT_DISABLE_TIMING`: the cheapest event, for ordering only.
const EVENT_DISABLE_TIMING: c_uint = 2;

/// `CU_STREAM_NON_BLOCKING`: the copy stream does not wait for the legacy default stream.
const STREAM_NON_BLOCKING: c_uint = 1;

/// `CUDA_ERROR_NOT_READY`: the event's work is still running.
const NOT_READY: CuResult = 600;

/// The driver, loaded and initialised once per process.
fn driver() -> Result<&'static Driver, DeviceError> {
    static DRIVER: OnceLock<Result<Driver, String>> = OnceLock::new();
    DRIVER
        .get_or_init(load)
        .as_ref()
        .map_err(|e| DeviceError::NoDriver(e.clone()))
}

fn load() -> Result<Driver, String> {
    // SAFETY: loading the CUDA driver runs its initialisers, which have no preconditions.
    let lib = unsafe { libloading::Library::new("libcuda.so.1") }
        .map_err(|e| format!("cannot load libcuda.so.1: {e}"))?;
    macro_rules! sym {
        ($name:literal, $ty:ty) => {
            // SAFETY: the symbol has this C signature in the CUDA driver API (cuda.h, v2 ABI).
            *unsafe { lib.get::<$ty>($name) }.map_err(|e| format!("libcuda.so.1: {e}"))?
        };
    }
    let init = sym!(b"cuInit\0", unsafe extern "C" fn(c_uint) -> CuResult);
    let driver = Driver {
        device_get: sym!(
            b"cuDeviceGet\0",
            unsafe extern "C" fn(*mut CuDevice, c_int) -> CuResult
        ),
        retain: sym!(
            b"cuDevicePrimaryCtxRetain\0",
            unsafe extern "C" fn(*mut CuContext, CuDevice) -> CuResult
        ),
        ctx_set_current: sym!(
            b"cuCtxSetCurrent\0",
            unsafe extern "C" fn(CuContext) -> CuResult
        ),
        pointer_attr: sym!(
            b"cuPointerGetAttribute\0",
            unsafe extern "C" fn(*mut c_void, c_int, CuDevicePtr) -> CuResult
        ),
        mem_alloc: sym!(
            b"cuMemAlloc_v2\0",
            unsafe extern "C" fn(*mut CuDevicePtr, usize) -> CuResult
        ),
        mem_free: sym!(
            b"cuMemFree_v2\0",
            unsafe extern "C" fn(CuDevicePtr) -> CuResult
        ),
        htod: sym!(
            b"cuMemcpyHtoD_v2\0",
            unsafe extern "C" fn(CuDevicePtr, *const c_void, usize) -> CuResult
        ),
        dtoh: sym!(
            b"cuMemcpyDtoH_v2\0",
            unsafe extern "C" fn(*mut c_void, CuDevicePtr, usize) -> CuResult
        ),
        event_create: sym!(
            b"cuEventCreate\0",
            unsafe extern "C" fn(*mut *mut c_void, c_uint) -> CuResult
        ),
        event_record: sym!(
            b"cuEventRecord\0",
            unsafe extern "C" fn(*mut c_void, *mut c_void) -> CuResult
        ),
        event_query: sym!(
            b"cuEventQuery\0",
            unsafe extern "C" fn(*mut c_void) -> CuResult
        ),
        event_destroy: sym!(
            b"cuEventDestroy_v2\0",
            unsafe extern "C" fn(*mut c_void) -> CuResult
        ),
        stream_sync: sym!(
            b"cuStreamSynchronize\0",
            unsafe extern "C" fn(*mut c_void) -> CuResult
        ),
        stream_create: sym!(
            b"cuStreamCreate\0",
            unsafe extern "C" fn(*mut *mut c_void, c_uint) -> CuResult
        ),
        stream_destroy: sym!(
            b"cuStreamDestroy_v2\0",
            unsafe extern "C" fn(*mut c_void) -> CuResult
        ),
        host_alloc: sym!(
            b"cuMemHostAlloc\0",
            unsafe extern "C" fn(*mut *mut c_void, usize, c_uint) -> CuResult
        ),
        host_free: sym!(
            b"cuMemFreeHost\0",
            unsafe extern "C" fn(*mut c_void) -> CuResult
        ),
        dtoh_async: sym!(
            b"cuMemcpyDtoHAsync_v2\0",
            unsafe extern "C" fn(*mut c_void, CuDevicePtr, usize, *mut c_void) -> CuResult
        ),
        htod_async: sym!(
            b"cuMemcpyHtoDAsync_v2\0",
            unsafe extern "C" fn(CuDevicePtr, *const c_void, usize, *mut c_void) -> CuResult
        ),
        event_sync: sym!(
            b"cuEventSynchronize\0",
            unsafe extern "C" fn(*mut c_void) -> CuResult
        ),
        _lib: lib,
    };
    // SAFETY: flags 0 as the API requires.
    let r = unsafe { init(0) };
    if r != 0 {
        return Err(format!("cuInit failed with error {r}"));
    }
    Ok(driver)
}

/// One CUDA device, through its primary context.
#[derive(Debug)]
pub struct CudaDevice {
    device: u32,
    ctx: usize,
}

impl CudaDevice {
    /// Device `ordinal` (as `CUDA_VISIBLE_DEVICES` numbers them), its primary context retained
    /// for the life of the process.
    pub fn open(ordinal: u32) -> Result<Arc<CudaDevice>, DeviceError> {
        let d = driver()?;
        let call = |call, code| DeviceError::Call {
            device: ordinal,
            call,
            code,
        };
        let mut dev: CuDevice = 0;
        let mut ctx: CuContext = std::ptr::null_mut();
        // SAFETY: valid out pointers; the ordinal is checked by the driver.
        unsafe {
            let r = (d.device_get)(&mut dev, ordinal as c_int);
            if r != 0 {
                return Err(call("cuDeviceGet", r));
            }
            let r = (d.retain)(&mut ctx, dev);
            if r != 0 {
                return Err(call("cuDevicePrimaryCtxRetain", r));
            }
        }
        Ok(Arc::new(CudaDevice {
            device: ordinal,
            ctx: ctx as usize,
        }))
    }

    fn call(&self, call: &'static str, code: CuResult) -> Result<(), DeviceError> {
        match code {
            0 => Ok(()),
            code => Err(DeviceError::Call {
                device: self.device,
                call,
                code,
            }),
        }
    }

    /// The driver, with this device's primary context current on the calling thread (NIXL's
    /// threads need it too: without it UCX finds no CUDA context and turns CUDA off).
    pub fn bind_context(&self) -> Result<(), DeviceError> {
        let d = driver()?;
        // SAFETY: the context was retained in `open` and is never released.
        let r = unsafe { (d.ctx_set_current)(self.ctx as CuContext) };
        self.call("cuCtxSetCurrent", r)
    }

    fn attr<T: Default>(&self, attr: c_int, ptr: usize) -> Result<T, DeviceError> {
        let d = driver()?;
        let mut out = T::default();
        // SAFETY: `out` has the type the driver writes for `attr` (callers pair them).
        let r = unsafe { (d.pointer_attr)(&mut out as *mut T as *mut c_void, attr, ptr as u64) };
        self.call("cuPointerGetAttribute", r)?;
        Ok(out)
    }

    /// `len` bytes of this device's memory (for checks and benchmarks; an engine allocates its
    /// own KV cache).
    pub fn alloc(&self, len: usize) -> Result<usize, DeviceError> {
        self.bind_context()?;
        let mut ptr: CuDevicePtr = 0;
        // SAFETY: valid out pointer; the context is current.
        let r = unsafe { (driver()?.mem_alloc)(&mut ptr, len.max(1)) };
        self.call("cuMemAlloc", r)?;
        Ok(ptr as usize)
    }

    /// Frees what [`CudaDevice::alloc`] returned.
    ///
    /// # Safety
    /// `addr` came from `alloc` on this device, is freed once, and no region or transfer uses
    /// it any more.
    pub unsafe fn free(&self, addr: usize) -> Result<(), DeviceError> {
        self.bind_context()?;
        // SAFETY: per the contract above.
        let r = unsafe { (driver()?.mem_free)(addr as u64) };
        self.call("cuMemFree", r)
    }
}

impl Device for CudaDevice {
    fn memory(&self) -> MemoryKind {
        MemoryKind::Cuda {
            device: self.device,
        }
    }

    fn check_range(&self, base: usize, len: usize) -> Result<(), DeviceError> {
        self.bind_context()?;
        let not_ours = DeviceError::NotDeviceMemory {
            device: self.device,
            addr: base,
            len,
        };
        let kind: c_uint = self
            .attr(ATTR_MEMORY_TYPE, base)
            .map_err(|_| not_ours.clone())?;
        let ordinal: c_int = self.attr(ATTR_DEVICE_ORDINAL, base)?;
        let start: u64 = self.attr(ATTR_RANGE_START_ADDR, base)?;
        let size: usize = self.attr(ATTR_RANGE_SIZE, base)?;
        let end = (start as usize).checked_add(size);
        let inside = end.is_some_and(|end| base.checked_add(len).is_some_and(|e| e <= end));
        if kind != MEMORYTYPE_DEVICE || ordinal as u32 != self.device || !inside {
            return Err(not_ours);
        }
        Ok(())
    }

    fn copy_to_host(&self, src: usize, dst: &mut [u8]) -> Result<(), DeviceError> {
        self.bind_context()?;
        // SAFETY: `dst` is a live host buffer of `dst.len()` bytes; the driver checks that the
        // device range is valid (a region checked it at creation) and returns when it is copied.
        let r = unsafe { (driver()?.dtoh)(dst.as_mut_ptr() as *mut c_void, src as u64, dst.len()) };
        self.call("cuMemcpyDtoH", r)
    }

    fn copy_from_host(&self, dst: usize, src: &[u8]) -> Result<(), DeviceError> {
        self.bind_context()?;
        let d = driver()?;
        // SAFETY: `src` is a live host buffer of `src.len()` bytes; as in `copy_to_host`.
        let r = unsafe { (d.htod)(dst as u64, src.as_ptr() as *const c_void, src.len()) };
        self.call("cuMemcpyHtoD", r)?;
        // From pageable memory the driver returns once `src` is staged, before the DMA into
        // device memory ended (cuda.h, "API synchronization behavior"): a transfer reported
        // landed would let the engine's kernels read bytes still arriving. The copy runs on the
        // legacy default stream; waiting for that stream waits for the DMA.
        // SAFETY: the null stream is always valid in the current context.
        let r = unsafe { (d.stream_sync)(std::ptr::null_mut()) };
        self.call("cuStreamSynchronize", r)
    }

    fn record_event(&self, stream: u64) -> Result<u64, DeviceError> {
        self.bind_context()?;
        let d = driver()?;
        let mut event: *mut c_void = std::ptr::null_mut();
        // SAFETY: valid out pointer; the context is current.
        let r = unsafe { (d.event_create)(&mut event, EVENT_DISABLE_TIMING) };
        self.call("cuEventCreate", r)?;
        // SAFETY: a fresh event; `stream` is the engine's live stream handle (0: the legacy
        // default stream), which the driver checks.
        let r = unsafe { (d.event_record)(event, stream as usize as *mut c_void) };
        if let Err(e) = self.call("cuEventRecord", r) {
            self.destroy_event(event as usize as u64);
            return Err(e);
        }
        Ok(event as usize as u64)
    }

    fn event_done(&self, event: u64) -> Result<bool, DeviceError> {
        self.bind_context()?;
        // SAFETY: `event` came from `record_event` and is not destroyed yet (the caller's
        // duty); a query does not block.
        let r = unsafe { (driver()?.event_query)(event as usize as *mut c_void) };
        match r {
            NOT_READY => Ok(false),
            r => self.call("cuEventQuery", r).map(|()| true),
        }
    }

    fn destroy_event(&self, event: u64) {
        if self.bind_context().is_err() {
            return;
        }
        if let Ok(d) = driver() {
            // SAFETY: `event` came from `record_event` and is destroyed once.
            unsafe { (d.event_destroy)(event as usize as *mut c_void) };
        }
    }

    fn make_current(&self) -> Result<(), DeviceError> {
        self.bind_context()
    }

    fn stager(self: Arc<Self>, piece: usize) -> Result<Box<dyn Stager>, DeviceError> {
        self.bind_context()?;
        let d = driver()?;
        let mut st = CudaStager {
            device: self,
            piece: piece.max(1),
            buffers: [0, 0],
            events: [0, 0],
            stream: 0,
        };
        // Each handle is stored as soon as it exists: a failure half-way frees what was made
        // (Drop skips the zeros).
        for i in 0..2 {
            let mut p: *mut c_void = std::ptr::null_mut();
            // SAFETY: valid out pointer; flags 0 (portable pinned memory of this context).
            let r = unsafe { (d.host_alloc)(&mut p, st.piece, 0) };
            st.device.call("cuMemHostAlloc", r)?;
            st.buffers[i] = p as usize;
            let mut e: *mut c_void = std::ptr::null_mut();
            // SAFETY: valid out pointer.
            let r = unsafe { (d.event_create)(&mut e, EVENT_DISABLE_TIMING) };
            st.device.call("cuEventCreate", r)?;
            st.events[i] = e as usize;
        }
        let mut s: *mut c_void = std::ptr::null_mut();
        // SAFETY: valid out pointer.
        let r = unsafe { (d.stream_create)(&mut s, STREAM_NON_BLOCKING) };
        st.device.call("cuStreamCreate", r)?;
        st.stream = s as usize;
        Ok(Box::new(st))
    }
}

/// Two pinned buffers, an event after each one's last copy, and a non-blocking copy stream.
struct CudaStager {
    device: Arc<CudaDevice>,
    piece: usize,
    buffers: [usize; 2],
    events: [usize; 2],
    stream: usize,
}

impl CudaStager {
    fn check(&self, i: usize, len: usize) -> Result<(), DeviceError> {
        if i > 1 || len > self.piece {
            return Err(DeviceError::Call {
                device: self.device.device,
                call: "cuMemcpyAsync",
                // CUDA_ERROR_INVALID_VALUE
                code: 1,
            });
        }
        self.device.bind_context()
    }

    fn record(&self, i: usize) -> Result<(), DeviceError> {
        // SAFETY: the event and stream are this stager's, alive until Drop.
        let r = unsafe {
            (driver()?.event_record)(self.events[i] as *mut c_void, self.stream as *mut c_void)
        };
        self.device.call("cuEventRecord", r)
    }
}

impl Stager for CudaStager {
    fn piece(&self) -> usize {
        self.piece
    }

    fn start_down(&mut self, i: usize, src: usize, len: usize) -> Result<(), DeviceError> {
        self.check(i, len)?;
        // SAFETY: the buffer is this stager's pinned memory of `piece` ≥ `len` bytes, not lent
        // until `buffer(i)` waited for this copy; the device range was checked by the region.
        let r = unsafe {
            (driver()?.dtoh_async)(
                self.buffers[i] as *mut c_void,
                src as u64,
                len,
                self.stream as *mut c_void,
            )
        };
        self.device.call("cuMemcpyDtoHAsync", r)?;
        self.record(i)
    }

    fn start_up(&mut self, i: usize, dst: usize, len: usize) -> Result<(), DeviceError> {
        self.check(i, len)?;
        // SAFETY: as in `start_down`; the host writes the buffer again only after `buffer(i)`
        // waited for this copy.
        let r = unsafe {
            (driver()?.htod_async)(
                dst as u64,
                self.buffers[i] as *const c_void,
                len,
                self.stream as *mut c_void,
            )
        };
        self.device.call("cuMemcpyHtoDAsync", r)?;
        self.record(i)
    }

    fn buffer(&mut self, i: usize) -> Result<&mut [u8], DeviceError> {
        self.check(i, 0)?;
        // SAFETY: this stager's event (an event never recorded completes at once).
        let r = unsafe { (driver()?.event_sync)(self.events[i] as *mut c_void) };
        self.device.call("cuEventSynchronize", r)?;
        // SAFETY: pinned memory of `piece` bytes owned by this stager; no copy uses it now
        // (its last one completed above) and `&mut self` keeps another from starting while
        // the slice lives.
        Ok(unsafe { std::slice::from_raw_parts_mut(self.buffers[i] as *mut u8, self.piece) })
    }

    fn wait_all(&mut self) -> Result<(), DeviceError> {
        self.device.bind_context()?;
        // SAFETY: this stager's stream.
        let r = unsafe { (driver()?.stream_sync)(self.stream as *mut c_void) };
        self.device.call("cuStreamSynchronize", r)
    }
}

impl Drop for CudaStager {
    fn drop(&mut self) {
        let Ok(d) = driver() else { return };
        if self.device.bind_context().is_err() {
            return;
        }
        // SAFETY: every handle is this stager's and freed once, after its copies finished.
        unsafe {
            if self.stream != 0 {
                (d.stream_sync)(self.stream as *mut c_void);
                (d.stream_destroy)(self.stream as *mut c_void);
            }
            for i in 0..2 {
                if self.events[i] != 0 {
                    (d.event_destroy)(self.events[i] as *mut c_void);
                }
                if self.buffers[i] != 0 {
                    (d.host_free)(self.buffers[i] as *mut c_void);
                }
            }
        }
    }
}
