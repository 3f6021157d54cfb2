//! Raw bindings to NIXL's C API (`libnixl_capi.so`), loaded at run time.
//!
//! Written by hand from `wrapper.h` of the crates.io crate `nixl-sys` 1.5.2, whose 104
//! `nixl_capi_*` symbols match the `nixl-cu12` 1.5.1 wheel exactly. Only the functions handoff
//! uses are bound. Every type here mirrors its C declaration: C enums are `int` on the targets
//! NIXL supports (x86_64 and aarch64 Linux), `bool` is C `_Bool` (one byte, like Rust's), and
//! `uintptr_t`/`size_t` are `usize`. The layout of [`AgentConfig`] is checked at compile time.
//!
//! Nothing here is safe to call: [`super::agent`] is the safe wrapper.

#![allow(non_camel_case_types)]

use std::ffi::{c_char, c_int, c_uint, c_void};
use std::marker::{PhantomData, PhantomPinned};

/// `nixl_capi_status_t`.
pub type Status = c_int;
pub const SUCCESS: Status = 0;
pub const IN_PROG: Status = 1;
pub const ERROR_INVALID_PARAM: Status = -1;
/// Every backend-side failure, `NIXL_ERR_REMOTE_DISCONNECT` included: the C API folds them all
/// into this one code.
pub const ERROR_BACKEND: Status = -2;
pub const ERROR_INVALID_STATE: Status = -3;
pub const ERROR_EXCEPTION: Status = -4;
#[allow(dead_code)]
pub const ERROR_NO_TELEMETRY: Status = -5;
/// Agent metadata not loaded (or invalidated), or no backend serves the request.
pub const ERROR_NOT_FOUND: Status = -6;

/// `nixl_capi_mem_type_t`.
pub type MemType = c_int;
pub const MEM_DRAM: MemType = 0;
/// GPU memory: device regions, and the raw baseline's `RawMemory::Vram`.
pub const MEM_VRAM: MemType = 1;

/// `nixl_capi_xfer_op_t`.
pub type XferOp = c_int;
pub const XFER_OP_READ: XferOp = 0;
pub const XFER_OP_WRITE: XferOp = 1;

/// `nixl_capi_thread_sync_t`.
pub type ThreadSync = c_int;
pub const THREAD_SYNC_NONE: ThreadSync = 0;
#[allow(dead_code)]
pub const THREAD_SYNC_STRICT: ThreadSync = 1;
#[allow(dead_code)]
pub const THREAD_SYNC_RW: ThreadSync = 2;

/// `nixl_capi_agent_config_t`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct AgentConfig {
    pub enable_prog_thread: bool,
    pub enable_listen_thread: bool,
    pub listen_port: c_int,
    pub thread_sync: ThreadSync,
    /// Ignored by NIXL 1.5 (the UCX backend takes `num_workers` as a backend parameter).
    pub num_workers: c_uint,
    pub pthr_delay_us: u64,
    pub lthr_delay_us: u64,
    pub capture_telemetry: bool,
}

// The C layout: bool@0, bool@1, int@4, enum@8, unsigned@12, u64@16, u64@24, bool@32, size 40.
const _: () = {
    use std::mem::{offset_of, size_of};
    assert!(offset_of!(AgentConfig, enable_prog_thread) == 0);
    assert!(offset_of!(AgentConfig, enable_listen_thread) == 1);
    assert!(offset_of!(AgentConfig, listen_port) == 4);
    assert!(offset_of!(AgentConfig, thread_sync) == 8);
    assert!(offset_of!(AgentConfig, num_workers) == 12);
    assert!(offset_of!(AgentConfig, pthr_delay_us) == 16);
    assert!(offset_of!(AgentConfig, lthr_delay_us) == 24);
    assert!(offset_of!(AgentConfig, capture_telemetry) == 32);
    assert!(size_of::<AgentConfig>() == 40);
};

macro_rules! opaque {
    ($($s:ident => $t:ident),* $(,)?) => {$(
        /// An opaque C++ object behind a C handle.
        #[repr(C)]
        pub struct $s {
            _data: [u8; 0],
            _marker: PhantomData<(*mut u8, PhantomPinned)>,
        }
        pub type $t = *mut $s;
    )*};
}

opaque! {
    nixl_capi_agent_s => Agent,
    nixl_capi_params_s => Params,
    nixl_capi_string_list_s => StringList,
    nixl_capi_backend_s => Backend,
    nixl_capi_opt_args_s => OptArgs,
    nixl_capi_xfer_dlist_s => XferDlist,
    nixl_capi_xfer_dlist_handle_s => XferDlistHandle,
    nixl_capi_reg_dlist_s => RegDlist,
    nixl_capi_xfer_req_s => XferReq,
    nixl_capi_notif_map_s => NotifMap,
}

extern "C" {
    /// libc's `free`: the blob from `get_local_md` is `malloc`ed and the name from
    /// `load_remote_md` is `strdup`ed by NIXL, both for the caller to free.
    pub fn free(ptr: *mut c_void);
}

macro_rules! api {
    ($( $(#[$doc:meta])* fn $name:ident ( $($arg:ident : $ty:ty),* $(,)? ) -> $ret:ty; )*) => {
        /// The function table of one loaded `libnixl_capi.so`. Each field is the C function
        /// `nixl_capi_<field>`.
        pub struct Api {
            $( $(#[$doc])* pub $name: unsafe extern "C" fn($($ty),*) -> $ret, )*
            _lib: libloading::Library,
        }

        impl Api {
            /// Loads the library and resolves every symbol.
            ///
            /// # Safety
            /// Loading runs the library's initialisers; `path` must be NIXL's C API library
            /// (whose symbols have the signatures declared here), not an arbitrary file.
            pub unsafe fn load(path: &std::path::Path) -> Result<Api, String> {
                // SAFETY: the caller vouches that this is libnixl_capi.so (see above).
                let lib = unsafe { libloading::Library::new(path) }
                    .map_err(|e| one_line(&e.to_string()))?;
                $(
                    // SAFETY: the symbol is looked up by its exact C name and typed with the
                    // signature wrapper.h (nixl-sys 1.5.2) declares for it; the pointer stays
                    // valid because `_lib` is kept in the table (and tables are never dropped).
                    let $name = unsafe {
                        lib.get::<unsafe extern "C" fn($($ty),*) -> $ret>(
                            concat!("nixl_capi_", stringify!($name), "\0").as_bytes(),
                        )
                    }
                    .map(|sym| *sym)
                    .map_err(|e| format!(
                        "missing symbol nixl_capi_{} (NIXL too old or not NIXL?): {}",
                        stringify!($name),
                        one_line(&e.to_string())
                    ))?;
                )*
                Ok(Api { $($name,)* _lib: lib })
            }
        }
    };
}

fn one_line(s: &str) -> String {
    s.split_whitespace().collect::<Vec<_>>().join(" ")
}

api! {
    // Agent and metadata.
    fn create_configured_agent(name: *const c_char, cfg: *const AgentConfig, agent: *mut Agent) -> Status;
    fn destroy_agent(agent: Agent) -> Status;
    /// `*data` is `malloc`ed: free it with [`free`].
    fn get_local_md(agent: Agent, data: *mut *mut c_void, len: *mut usize) -> Status;
    /// `*agent_name` is `strdup`ed: free it with [`free`].
    fn load_remote_md(agent: Agent, data: *const c_void, len: usize, agent_name: *mut *mut c_char) -> Status;
    fn invalidate_remote_md(agent: Agent, remote_agent: *const c_char) -> Status;
    /// With `descs` null: whether the peer's metadata is (still) loaded.
    fn check_remote_md(agent: Agent, remote_name: *const c_char, descs: XferDlist) -> Status;

    // Plugins, parameters, backends.
    fn get_available_plugins(agent: Agent, plugins: *mut StringList) -> Status;
    fn destroy_string_list(list: StringList) -> Status;
    fn string_list_size(list: StringList, size: *mut usize) -> Status;
    /// `*str` is borrowed from the list.
    fn string_list_get(list: StringList, index: usize, str: *mut *const c_char) -> Status;
    fn create_params(params: *mut Params) -> Status;
    fn params_add(params: Params, key: *const c_char, value: *const c_char) -> Status;
    fn destroy_params(params: Params) -> Status;
    fn create_backend(agent: Agent, plugin_name: *const c_char, params: Params, backend: *mut Backend) -> Status;
    /// Frees the C wrapper only: the engine lives until the agent is destroyed.
    fn destroy_backend(backend: Backend) -> Status;

    // Optional arguments.
    fn create_opt_args(args: *mut OptArgs) -> Status;
    fn destroy_opt_args(args: OptArgs) -> Status;
    fn opt_args_set_notif_msg(args: OptArgs, data: *const c_void, len: usize) -> Status;
    fn opt_args_set_has_notif(args: OptArgs, has_notif: bool) -> Status;

    // Registration.
    fn create_reg_dlist(mem_type: MemType, dlist: *mut RegDlist) -> Status;
    fn destroy_reg_dlist(dlist: RegDlist) -> Status;
    fn reg_dlist_add_desc(dlist: RegDlist, addr: usize, len: usize, dev_id: u64, metadata: *const c_void, metadata_len: usize) -> Status;
    fn register_mem(agent: Agent, dlist: RegDlist, opt_args: OptArgs) -> Status;
    fn deregister_mem(agent: Agent, dlist: RegDlist, opt_args: OptArgs) -> Status;

    // Transfer descriptor lists.
    fn create_xfer_dlist(mem_type: MemType, dlist: *mut XferDlist) -> Status;
    fn destroy_xfer_dlist(dlist: XferDlist) -> Status;
    fn xfer_dlist_add_desc(dlist: XferDlist, addr: usize, len: usize, dev_id: u64) -> Status;
    fn prep_xfer_dlist(agent: Agent, agent_name: *const c_char, descs: XferDlist, dlist_hndl: *mut XferDlistHandle, opt_args: OptArgs) -> Status;
    fn release_xfer_dlist_handle(agent: Agent, dlist_handle: XferDlistHandle) -> Status;

    // Transfers.
    fn create_xfer_req(agent: Agent, operation: XferOp, local_descs: XferDlist, remote_descs: XferDlist, remote_agent: *const c_char, req_hndl: *mut XferReq, opt_args: OptArgs) -> Status;
    fn make_xfer_req(agent: Agent, operation: XferOp, local_descs: XferDlistHandle, local_indices: *const c_int, local_indices_count: usize, remote_descs: XferDlistHandle, remote_indices: *const c_int, remote_indices_count: usize, req_hndl: *mut XferReq, opt_args: OptArgs) -> Status;
    /// 0 = done, 1 = in progress, < 0 = error. May copy on the caller's thread (CMA).
    fn post_xfer_req(agent: Agent, req_hndl: XferReq, opt_args: OptArgs) -> Status;
    /// 0 = done, 1 = in progress, < 0 = error.
    fn get_xfer_status(agent: Agent, req_hndl: XferReq) -> Status;
    /// Must come before `destroy_xfer_req` (which otherwise fails with -3 and leaks).
    fn release_xfer_req(agent: Agent, req: XferReq) -> Status;
    fn destroy_xfer_req(req: XferReq) -> Status;

    // Notifications.
    fn create_notif_map(notif_map: *mut NotifMap) -> Status;
    fn destroy_notif_map(notif_map: NotifMap) -> Status;
    /// Appends to `notif_map` (never clears it).
    fn get_notifs(agent: Agent, notif_map: NotifMap, opt_args: OptArgs) -> Status;
    fn notif_map_size(map: NotifMap, size: *mut usize) -> Status;
    /// `*agent_name` is borrowed from the map.
    fn notif_map_get_agent_at(map: NotifMap, index: usize, agent_name: *mut *const c_char) -> Status;
    fn notif_map_get_notifs_size(map: NotifMap, agent_name: *const c_char, size: *mut usize) -> Status;
    /// `*data` is borrowed from the map.
    fn notif_map_get_notif(map: NotifMap, agent_name: *const c_char, index: usize, data: *mut *const c_void, len: *mut usize) -> Status;
    fn notif_map_clear(map: NotifMap) -> Status;
    fn gen_notif(agent: Agent, remote_agent: *const c_char, data: *const c_void, len: usize, opt_args: OptArgs) -> Status;

    /// True for nixl-sys' stub library (no NIXL behind it).
    fn is_stub() -> bool;
}
