//! GPU memory for the raw NIXL baseline (`raw::RawMemory::Vram`): the CUDA driver API
//! (`libcuda.so.1`, loaded at run time like NIXL itself, so nothing needs CUDA to build) for
//! device allocations and the copies that fill and check them. Only what a GPU run of
//! `handoff bench descriptors --memory vram` needs: a primary context on one device, `cuMemAlloc`,
//! `cuMemFree`, and host↔device copies.

use std::ffi::{c_int, c_uint, c_void};
use std::sync::OnceLock;

use crate::TransportError;

type CuResult = c_int;
type CuDevice = c_int;
type CuContext = *mut c_void;
type CuDevicePtr = u64;

struct Driver {
    _lib: libloading::Library,
    mem_alloc: unsafe extern "C" fn(*mut CuDevicePtr, usize) -> CuResult,
    mem_free: unsafe extern "C" fn(CuDevicePtr) -> CuResult,
    htod: unsafe extern "C" fn(CuDevicePtr, *const c_void, usize) -> CuResult,
    dtoh: unsafe extern "C" fn(*mut c_void, CuDevicePtr, usize) -> CuResult,
    ctx_set_current: unsafe extern "C" fn(CuContext) -> CuResult,
    ctx: CuContext,
}

// SAFETY: the driver's entry points are thread-safe; the context handle is only passed back to
// the driver (`cuCtxSetCurrent` from whichever thread allocates or copies).
unsafe impl Send for Driver {}
// SAFETY: as for Send: nothing in `Driver` is mutated after loading.
unsafe impl Sync for Driver {}

fn err(what: &str, r: CuResult) -> TransportError {
    TransportError::Io(format!("cuda: {what} returned {r}"))
}

/// The driver with device 0's primary context, loaded once.
fn driver() -> Result<&'static Driver, TransportError> {
    static DRIVER: OnceLock<Result<Driver, String>> = OnceLock::new();
    DRIVER
        .get_or_init(|| load().map_err(|e| e.to_string()))
        .as_ref()
        .map_err(|e| TransportError::Io(e.clone()))
}

fn load() -> Result<Driver, TransportError> {
    // SAFETY: loading the CUDA driver runs its initialisers, which have no preconditions.
    let lib = unsafe { libloading::Library::new("libcuda.so.1") }
        .map_err(|e| TransportError::Io(format!("cuda: cannot load libcuda.so.1: {e}")))?;
    macro_rules! sym {
        ($name:literal, $ty:ty) => {
            // SAFETY: the symbol has this C signature in the CUDA driver API (cuda.h, v2 ABI).
            *unsafe { lib.get::<$ty>($name) }
                .map_err(|e| TransportError::Io(format!("cuda: no symbol: {e}")))?
        };
    }
    let init = sym!(b"cuInit\0", unsafe extern "C" fn(c_uint) -> CuResult);
    let device_get = sym!(
        b"cuDeviceGet\0",
        unsafe extern "C" fn(*mut CuDevice, c_int) -> CuResult
    );
    let retain = sym!(
        b"cuDevicePrimaryCtxRetain\0",
        unsafe extern "C" fn(*mut CuContext, CuDevice) -> CuResult
    );
    let ctx_set_current = sym!(
        b"cuCtxSetCurrent\0",
        unsafe extern "C" fn(CuContext) -> CuResult
    );
    let mem_alloc = sym!(
        b"cuMemAlloc_v2\0",
        unsafe extern "C" fn(*mut CuDevicePtr, usize) -> CuResult
    );
    let mem_free = sym!(
        b"cuMemFree_v2\0",
        unsafe extern "C" fn(CuDevicePtr) -> CuResult
    );
    let htod = sym!(
        b"cuMemcpyHtoD_v2\0",
        unsafe extern "C" fn(CuDevicePtr, *const c_void, usize) -> CuResult
    );
    let dtoh = sym!(
        b"cuMemcpyDtoH_v2\0",
        unsafe extern "C" fn(*mut c_void, CuDevicePtr, usize) -> CuResult
    );
    let mut dev: CuDevice = 0;
    let mut ctx: CuContext = std::ptr::null_mut();
    // SAFETY: valid out pointers; flags 0 as the API requires.
    unsafe {
        let r = init(0);
        if r != 0 {
            return Err(err("cuInit", r));
        }
        let r = device_get(&mut dev, 0);
        if r != 0 {
            return Err(err("cuDeviceGet", r));
        }
        let r = retain(&mut ctx, dev);
        if r != 0 {
            return Err(err("cuDevicePrimaryCtxRetain", r));
        }
    }
    Ok(Driver {
        _lib: lib,
        mem_alloc,
        mem_free,
        htod,
        dtoh,
        ctx_set_current,
        ctx,
    })
}

/// A device allocation on GPU 0, freed on drop.
pub(crate) struct DeviceBuffer {
    driver: &'static Driver,
    ptr: CuDevicePtr,
    len: usize,
}

impl DeviceBuffer {
    /// `len` bytes of device memory, filled from `init` (which must be `len` long).
    pub(crate) fn new(init: &[u8]) -> Result<Self, TransportError> {
        let driver = driver()?;
        let mut ptr: CuDevicePtr = 0;
        // SAFETY: the context is the device's primary one (retained for the process); valid out
        // pointer; the copy reads `init.len()` bytes of a live slice into the fresh allocation of
        // that size.
        unsafe {
            let r = (driver.ctx_set_current)(driver.ctx);
            if r != 0 {
                return Err(err("cuCtxSetCurrent", r));
            }
            let r = (driver.mem_alloc)(&mut ptr, init.len().max(1));
            if r != 0 {
                return Err(err("cuMemAlloc", r));
            }
        }
        let buf = DeviceBuffer {
            driver,
            ptr,
            len: init.len(),
        };
        // SAFETY: as above; the allocation is `len` bytes.
        let r = unsafe { (driver.htod)(buf.ptr, init.as_ptr() as *const c_void, init.len()) };
        if r != 0 {
            return Err(err("cuMemcpyHtoD", r));
        }
        Ok(buf)
    }

    pub(crate) fn addr(&self) -> usize {
        self.ptr as usize
    }

    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// A host copy of the whole buffer (synchronous: after every transfer into it is done).
    pub(crate) fn to_host(&self) -> Result<Vec<u8>, TransportError> {
        let mut out = vec![0u8; self.len];
        // SAFETY: the context is current-able from any thread; the copy writes `len` bytes into
        // a live vector of that length from the allocation of that size.
        unsafe {
            let r = (self.driver.ctx_set_current)(self.driver.ctx);
            if r != 0 {
                return Err(err("cuCtxSetCurrent", r));
            }
            let r = (self.driver.dtoh)(out.as_mut_ptr() as *mut c_void, self.ptr, self.len);
            if r != 0 {
                return Err(err("cuMemcpyDtoH", r));
            }
        }
        Ok(out)
    }
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        // SAFETY: allocated by `new`, freed once; NIXL deregistered it before (the owner drops
        // its registration first).
        unsafe {
            (self.driver.ctx_set_current)(self.driver.ctx);
            (self.driver.mem_free)(self.ptr);
        }
    }
}
