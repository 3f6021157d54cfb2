//! Safe wrapper over one NIXL agent: owns every C handle it creates and frees each exactly once,
//! in the order NIXL requires.
//!
//! Threading: [`Agent`] is `Send` but not `Sync`, so at most one thread calls into a given agent
//! at a time; the agent is created with `THREAD_SYNC_NONE`, which is exactly NIXL's contract for
//! that (its own progress thread synchronises with the caller internally). [`super::NixlTransport`]
//! keeps its agent behind a mutex.

use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::ptr;
use std::sync::Arc;

use super::sys::{self, Api, Status};
use crate::device::MemoryKind;
use crate::{KvRegion, Notification, XferOp};

/// NIXL's memory type and device id for memory of `kind`: host memory is DRAM (device 0),
/// a CUDA device's is VRAM with the device's ordinal, as vLLM registers it.
pub(crate) fn nixl_memory(kind: MemoryKind) -> (sys::MemType, u64) {
    match kind {
        MemoryKind::Host => (sys::MEM_DRAM, 0),
        MemoryKind::Cuda { device } => (sys::MEM_VRAM, u64::from(device)),
    }
}

/// A non-success status of a NIXL call, with the call's name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct CallError {
    pub call: &'static str,
    pub status: Status,
}

impl std::fmt::Display for CallError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let what = match self.status {
            sys::ERROR_INVALID_PARAM => "invalid parameter",
            sys::ERROR_BACKEND => "backend error",
            sys::ERROR_INVALID_STATE => "invalid state",
            sys::ERROR_EXCEPTION => "exception",
            sys::ERROR_NOT_FOUND => "not found",
            _ => "error",
        };
        write!(
            f,
            "nixl_capi_{} returned {} ({what})",
            self.call, self.status
        )
    }
}

fn check(call: &'static str, status: Status) -> Result<(), CallError> {
    if status == sys::SUCCESS {
        Ok(())
    } else {
        Err(CallError { call, status })
    }
}

/// What an agent is created with.
#[derive(Debug, Clone)]
pub(crate) struct AgentSettings {
    pub progress_delay_us: u64,
    pub backend: String,
    /// Backend parameters (`key=value`), empty as Python passes them.
    pub backend_params: Vec<(String, String)>,
}

/// One NIXL agent with one backend and its notification map.
pub(crate) struct Agent {
    api: &'static Api,
    raw: sys::Agent,
    backend: sys::Backend,
    notifs: sys::NotifMap,
    name: String,
}

// SAFETY: a NIXL agent is a heap object with no thread affinity (no thread-locals, no
// thread-bound resources: its progress thread is its own and outlives no call). Moving the
// handle to another thread is fine. It is deliberately not `Sync`: the agent is created with
// THREAD_SYNC_NONE, so calls must not overlap, which `!Sync` (plus `&self`-only methods)
// guarantees.
unsafe impl Send for Agent {}

impl Agent {
    /// Creates an agent (progress thread on, listener off, THREAD_SYNC_NONE), its backend and its
    /// notification map. On error, the message is one line.
    pub fn new(api: &'static Api, name: &str, settings: &AgentSettings) -> Result<Agent, String> {
        let cname = CString::new(name).map_err(|_| "agent name contains a NUL byte".to_string())?;
        let cbackend = CString::new(settings.backend.as_str())
            .map_err(|_| "backend name contains a NUL byte".to_string())?;
        let cfg = sys::AgentConfig {
            enable_prog_thread: true,
            enable_listen_thread: false,
            listen_port: 0,
            thread_sync: sys::THREAD_SYNC_NONE,
            num_workers: 1,
            pthr_delay_us: settings.progress_delay_us,
            lthr_delay_us: 100_000,
            capture_telemetry: false,
        };
        let mut raw: sys::Agent = ptr::null_mut();
        // SAFETY: `cname` is a valid C string and `cfg` a valid config, both alive for the call;
        // `raw` is a valid out pointer.
        let st = unsafe { (api.create_configured_agent)(cname.as_ptr(), &cfg, &mut raw) };
        if st != sys::SUCCESS || raw.is_null() {
            return Err(format!("nixl_capi_create_configured_agent returned {st}"));
        }
        // From here on, `agent` owns `raw` (and destroys it on the error paths below).
        let mut agent = Agent {
            api,
            raw,
            backend: ptr::null_mut(),
            notifs: ptr::null_mut(),
            name: name.to_string(),
        };

        let mut params: sys::Params = ptr::null_mut();
        // SAFETY: valid out pointer.
        check("create_params", unsafe { (api.create_params)(&mut params) })
            .map_err(|e| e.to_string())?;
        let mut result = Ok(());
        for (k, v) in &settings.backend_params {
            let (Ok(k), Ok(v)) = (CString::new(k.as_str()), CString::new(v.as_str())) else {
                result = Err("backend parameter contains a NUL byte".to_string());
                break;
            };
            // SAFETY: `params` is the live list created above; `k` and `v` are C strings that
            // NIXL copies.
            if let Err(e) = check("params_add", unsafe {
                (api.params_add)(params, k.as_ptr(), v.as_ptr())
            }) {
                result = Err(e.to_string());
                break;
            }
        }
        if result.is_ok() {
            let mut backend: sys::Backend = ptr::null_mut();
            // SAFETY: live agent and params, C string backend name, valid out pointer.
            let st =
                unsafe { (api.create_backend)(agent.raw, cbackend.as_ptr(), params, &mut backend) };
            if st == sys::SUCCESS && !backend.is_null() {
                agent.backend = backend;
            } else {
                let plugins = agent.plugins().join(",");
                let params = settings
                    .backend_params
                    .iter()
                    .map(|(k, v)| format!("{k}={v}"))
                    .collect::<Vec<_>>()
                    .join(",");
                result = Err(format!(
                    "cannot create the {} backend with parameters [{params}] (nixl_capi_create_backend returned {st}; plugins found: [{plugins}])",
                    settings.backend
                ));
            }
        }
        // SAFETY: `params` was created above and is not used after this (NIXL copied it).
        unsafe { (api.destroy_params)(params) };
        result?;

        let mut map: sys::NotifMap = ptr::null_mut();
        // SAFETY: valid out pointer.
        check("create_notif_map", unsafe {
            (api.create_notif_map)(&mut map)
        })
        .map_err(|e| e.to_string())?;
        agent.notifs = map;
        Ok(agent)
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// Names of the plugins NIXL found (for error messages).
    pub fn plugins(&self) -> Vec<String> {
        let mut list: sys::StringList = ptr::null_mut();
        // SAFETY: live agent, valid out pointer.
        if unsafe { (self.api.get_available_plugins)(self.raw, &mut list) } != sys::SUCCESS
            || list.is_null()
        {
            return Vec::new();
        }
        let mut n = 0usize;
        // SAFETY: `list` is the live list just returned.
        unsafe { (self.api.string_list_size)(list, &mut n) };
        let mut out = Vec::with_capacity(n);
        for i in 0..n {
            let mut s: *const c_char = ptr::null();
            // SAFETY: `i` < size; the string is borrowed from `list`, which is alive, and copied
            // before the list is destroyed.
            if unsafe { (self.api.string_list_get)(list, i, &mut s) } == sys::SUCCESS
                && !s.is_null()
            {
                // SAFETY: NIXL returned a NUL-terminated string owned by the live list.
                let name = unsafe { CStr::from_ptr(s) };
                out.push(name.to_string_lossy().into_owned());
            }
        }
        // SAFETY: destroyed once; no borrowed string outlives this point.
        unsafe { (self.api.destroy_string_list)(list) };
        out
    }

    /// This agent's NIXL metadata (connection info and registered memory).
    pub fn local_md(&self) -> Result<Vec<u8>, CallError> {
        let mut data: *mut c_void = ptr::null_mut();
        let mut len = 0usize;
        // SAFETY: live agent, valid out pointers.
        check("get_local_md", unsafe {
            (self.api.get_local_md)(self.raw, &mut data, &mut len)
        })?;
        if data.is_null() {
            return Ok(Vec::new());
        }
        // SAFETY: on success `data` points to `len` bytes NIXL malloc'ed for us.
        let out = unsafe { std::slice::from_raw_parts(data as *const u8, len) }.to_vec();
        // SAFETY: copied out above; freed exactly once, with the allocator that made it.
        unsafe { sys::free(data) };
        Ok(out)
    }

    /// Loads a peer's NIXL metadata; returns the peer's agent name.
    pub fn load_remote_md(&self, blob: &[u8]) -> Result<String, CallError> {
        if blob.is_empty() {
            return Err(CallError {
                call: "load_remote_md",
                status: sys::ERROR_INVALID_PARAM,
            });
        }
        let mut name: *mut c_char = ptr::null_mut();
        // SAFETY: `blob` is valid for `len` bytes during the call (NIXL copies it); valid out
        // pointer.
        check("load_remote_md", unsafe {
            (self.api.load_remote_md)(
                self.raw,
                blob.as_ptr() as *const c_void,
                blob.len(),
                &mut name,
            )
        })?;
        if name.is_null() {
            return Ok(String::new());
        }
        // SAFETY: on success `name` is a NUL-terminated string NIXL strdup'ed for us.
        let out = unsafe { CStr::from_ptr(name) }
            .to_string_lossy()
            .into_owned();
        // SAFETY: copied out above; freed exactly once, with the allocator that made it.
        unsafe { sys::free(name as *mut c_void) };
        Ok(out)
    }

    pub fn invalidate_remote_md(&self, peer: &str) -> Result<(), CallError> {
        let Ok(c) = CString::new(peer) else {
            return Err(CallError {
                call: "invalidate_remote_md",
                status: sys::ERROR_INVALID_PARAM,
            });
        };
        // SAFETY: live agent, C string.
        check("invalidate_remote_md", unsafe {
            (self.api.invalidate_remote_md)(self.raw, c.as_ptr())
        })
    }

    /// Whether NIXL still holds the peer's metadata. NIXL drops it by itself when a transfer
    /// reports the peer disconnected, which is how a dead peer shows through the C API.
    pub fn has_remote_md(&self, peer: &str) -> Result<bool, CallError> {
        let Ok(c) = CString::new(peer) else {
            return Ok(false);
        };
        // SAFETY: live agent, C string; a null descriptor list asks about the agent only.
        match unsafe { (self.api.check_remote_md)(self.raw, c.as_ptr(), ptr::null_mut()) } {
            sys::SUCCESS => Ok(true),
            sys::ERROR_NOT_FOUND => Ok(false),
            status => Err(CallError {
                call: "check_remote_md",
                status,
            }),
        }
    }

    /// Registers `region` (one descriptor: its whole allocation; DRAM, or VRAM of its device)
    /// with this agent's backend. For device memory the device's context must be current on
    /// the calling thread.
    pub fn register(&self, region: Arc<KvRegion>) -> Result<Registration, CallError> {
        let (mem, dev) = nixl_memory(region.memory());
        let dlist = RegDlist::new(self.api, mem)?;
        // SAFETY: live list; the address and length describe the region's allocation (host, or
        // device memory whose range the region checked against its device), which is never
        // freed while registered: `Registration` keeps the region referenced.
        check("reg_dlist_add_desc", unsafe {
            (self.api.reg_dlist_add_desc)(
                dlist.raw,
                region.base_addr(),
                region.len(),
                dev,
                ptr::null(),
                0,
            )
        })?;
        // SAFETY: live agent and list; null opt args = every backend that handles the type.
        check("register_mem", unsafe {
            (self.api.register_mem)(self.raw, dlist.raw, ptr::null_mut())
        })?;
        Ok(Registration {
            agent: self.raw,
            dlist,
            _region: region,
        })
    }

    /// Deregisters. On error the registration is gone anyway (NIXL removes what it can).
    pub fn deregister(&self, reg: Registration) -> Result<(), CallError> {
        if reg.agent != self.raw {
            return Err(CallError {
                call: "deregister_mem",
                status: sys::ERROR_INVALID_PARAM,
            });
        }
        // SAFETY: the list is the one registered with this very agent (checked above).
        check("deregister_mem", unsafe {
            (self.api.deregister_mem)(self.raw, reg.dlist.raw, ptr::null_mut())
        })
        // `reg` drops here: its list is destroyed, then its region reference.
    }

    /// Creates a transfer request from `(addr, len)` pairs, local and remote, with an optional
    /// notification for the peer. Refused (-2) for ranges the peer did not register and for an
    /// unknown peer.
    pub fn create_xfer(
        &self,
        op: XferOp,
        local: (&[(usize, usize)], MemoryKind),
        remote: (&[(usize, usize)], MemoryKind),
        peer: &str,
        notification: Option<&[u8]>,
    ) -> Result<XferReq, CallError> {
        let cpeer = CString::new(peer).map_err(|_| CallError {
            call: "create_xfer_req",
            status: sys::ERROR_INVALID_PARAM,
        })?;
        let l = XferDlist::new(self.api, local.1, local.0)?;
        let r = XferDlist::new(self.api, remote.1, remote.0)?;
        let opt = OptArgs::new(self.api, notification)?;
        let mut req: sys::XferReq = ptr::null_mut();
        // SAFETY: live agent, lists and opt args (NIXL copies all three into the request, so
        // they may be destroyed right after); C string peer; valid out pointer.
        check("create_xfer_req", unsafe {
            (self.api.create_xfer_req)(
                self.raw,
                op_code(op),
                l.raw,
                r.raw,
                cpeer.as_ptr(),
                &mut req,
                opt.raw,
            )
        })?;
        Ok(XferReq {
            agent: self.raw,
            raw: req,
        })
    }

    /// Preps a descriptor list once, for any number of later [`Agent::make_xfer`] calls: this
    /// agent's own memory (`peer` = `None`) or a peer's (whose metadata must be loaded). Refused
    /// (-6) for a range that is not registered.
    pub fn prep_list(
        &self,
        peer: Option<&str>,
        memory: MemoryKind,
        descs: &[(usize, usize)],
    ) -> Result<PreppedList, CallError> {
        let cpeer = CString::new(peer.unwrap_or("")).map_err(|_| CallError {
            call: "prep_xfer_dlist",
            status: sys::ERROR_INVALID_PARAM,
        })?;
        let list = XferDlist::new(self.api, memory, descs)?;
        let mut h: sys::XferDlistHandle = ptr::null_mut();
        // SAFETY: live agent and list (NIXL copies the list into the handle, so it may be
        // destroyed right after); C string agent name ("" = local); valid out pointer; null opt
        // args (the agent's only backend).
        check("prep_xfer_dlist", unsafe {
            (self.api.prep_xfer_dlist)(self.raw, cpeer.as_ptr(), list.raw, &mut h, ptr::null_mut())
        })?;
        Ok(PreppedList {
            api: self.api,
            agent: self.raw,
            raw: h,
            len: descs.len(),
        })
    }

    /// Creates a transfer request from entries of two prepped lists (`local_idx[i]` with
    /// `remote_idx[i]`, equal lengths), as `create_xfer` does from plain lists but without
    /// looking each range up again. NIXL merges entries adjacent on both sides.
    pub fn make_xfer(
        &self,
        op: XferOp,
        local: &PreppedList,
        local_idx: &[c_int],
        remote: &PreppedList,
        remote_idx: &[c_int],
        notification: Option<&[u8]>,
    ) -> Result<XferReq, CallError> {
        let bad = CallError {
            call: "make_xfer_req",
            status: sys::ERROR_INVALID_PARAM,
        };
        let in_range = |idx: &[c_int], list: &PreppedList| {
            idx.iter().all(|&i| i >= 0 && (i as usize) < list.len)
        };
        if local.agent != self.raw
            || remote.agent != self.raw
            || local_idx.len() != remote_idx.len()
            || local_idx.is_empty()
            || !in_range(local_idx, local)
            || !in_range(remote_idx, remote)
        {
            return Err(bad);
        }
        let opt = OptArgs::new(self.api, notification)?;
        let mut req: sys::XferReq = ptr::null_mut();
        // SAFETY: live agent; both handles were prepped by this agent and are alive (borrowed);
        // every index is within its list (checked above) and the index slices are valid for
        // their lengths during the call; live opt args (copied into the request); valid out
        // pointer. The request copies the entries it uses, so it does not borrow the handles.
        check("make_xfer_req", unsafe {
            (self.api.make_xfer_req)(
                self.raw,
                op_code(op),
                local.raw,
                local_idx.as_ptr(),
                local_idx.len(),
                remote.raw,
                remote_idx.as_ptr(),
                remote_idx.len(),
                &mut req,
                opt.raw,
            )
        })?;
        Ok(XferReq {
            agent: self.raw,
            raw: req,
        })
    }

    /// Posts. Returns 0 (done), 1 (in progress) or a negative status. May block for the copy.
    pub fn post(&self, req: &XferReq) -> Status {
        if req.agent != self.raw {
            return sys::ERROR_INVALID_PARAM;
        }
        // SAFETY: `req` is a live request of this agent (not yet released: `release_xfer`
        // consumes it); null opt args keep the notification given at creation.
        unsafe { (self.api.post_xfer_req)(self.raw, req.raw, ptr::null_mut()) }
    }

    /// 0 (done), 1 (in progress) or a negative status.
    pub fn xfer_status(&self, req: &XferReq) -> Status {
        if req.agent != self.raw {
            return sys::ERROR_INVALID_PARAM;
        }
        // SAFETY: live request of this agent.
        unsafe { (self.api.get_xfer_status)(self.raw, req.raw) }
    }

    /// Releases (aborting it if still in progress) then destroys a request. When NIXL cannot
    /// abort it, the request is handed back, still live: try again later.
    pub fn release_xfer(&self, req: XferReq) -> Result<(), XferReq> {
        if req.agent != self.raw {
            return Err(req);
        }
        // SAFETY: live request of this agent.
        let st = unsafe { (self.api.release_xfer_req)(self.raw, req.raw) };
        if st != sys::SUCCESS {
            return Err(req);
        }
        // SAFETY: after a successful release NIXL has deleted the C++ request and nulled the
        // wrapper's pointer, so this frees only the wrapper, exactly once (`req` is forgotten
        // below, its Drop does not run).
        unsafe { (self.api.destroy_xfer_req)(req.raw) };
        std::mem::forget(req);
        Ok(())
    }

    /// Moves every notification NIXL received since the last call into `out`. NIXL's map is
    /// appended to by each `get_notifs`, so it is copied out and cleared every time.
    pub fn take_notifications(&self, out: &mut Vec<Notification>) -> Result<(), CallError> {
        // SAFETY: live agent and map; null opt args = every backend.
        let got = check("get_notifs", unsafe {
            (self.api.get_notifs)(self.raw, self.notifs, ptr::null_mut())
        });
        let mut agents = 0usize;
        // SAFETY: live map.
        unsafe { (self.api.notif_map_size)(self.notifs, &mut agents) };
        for i in 0..agents {
            let mut name: *const c_char = ptr::null();
            // SAFETY: `i` < size; the name is borrowed from the map, which is not modified
            // until `notif_map_clear` below, after the last use of the borrowed pointers.
            if unsafe { (self.api.notif_map_get_agent_at)(self.notifs, i, &mut name) }
                != sys::SUCCESS
                || name.is_null()
            {
                continue;
            }
            // SAFETY: NUL-terminated string owned by the (unmodified) map.
            let from = unsafe { CStr::from_ptr(name) }
                .to_string_lossy()
                .into_owned();
            let mut count = 0usize;
            // SAFETY: as above; `name` is still borrowed from the unmodified map.
            unsafe { (self.api.notif_map_get_notifs_size)(self.notifs, name, &mut count) };
            for j in 0..count {
                let mut data: *const c_void = ptr::null();
                let mut len = 0usize;
                // SAFETY: `j` < count; `data` is borrowed from the map and copied at once.
                if unsafe {
                    (self.api.notif_map_get_notif)(self.notifs, name, j, &mut data, &mut len)
                } != sys::SUCCESS
                {
                    continue;
                }
                let msg = if data.is_null() || len == 0 {
                    Vec::new()
                } else {
                    // SAFETY: NIXL returned `len` readable bytes at `data`, owned by the map.
                    unsafe { std::slice::from_raw_parts(data as *const u8, len) }.to_vec()
                };
                out.push(Notification {
                    from: from.clone(),
                    msg,
                });
            }
        }
        // SAFETY: live map; every borrowed pointer into it is dead by now.
        unsafe { (self.api.notif_map_clear)(self.notifs) };
        got
    }

    /// Sends a notification with no transfer.
    pub fn gen_notif(&self, peer: &str, msg: &[u8]) -> Result<(), CallError> {
        let c = CString::new(peer).map_err(|_| CallError {
            call: "gen_notif",
            status: sys::ERROR_INVALID_PARAM,
        })?;
        // SAFETY: live agent; C string; `msg` valid for its length during the call (copied).
        check("gen_notif", unsafe {
            (self.api.gen_notif)(
                self.raw,
                c.as_ptr(),
                msg.as_ptr() as *const c_void,
                msg.len(),
                ptr::null_mut(),
            )
        })
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        // SAFETY: each handle was created by this agent and is destroyed once, in NIXL's order:
        // notification map, backend wrapper (the engine itself belongs to the agent), agent.
        // Requests and registrations were released by their owner before (see NixlTransport's
        // Drop); any left over are leaked rather than touched after this.
        unsafe {
            if !self.notifs.is_null() {
                (self.api.destroy_notif_map)(self.notifs);
            }
            if !self.backend.is_null() {
                (self.api.destroy_backend)(self.backend);
            }
            (self.api.destroy_agent)(self.raw);
        }
    }
}

pub(crate) fn op_code(op: XferOp) -> sys::XferOp {
    match op {
        XferOp::Read => sys::XFER_OP_READ,
        XferOp::Write => sys::XFER_OP_WRITE,
    }
}

/// A descriptor list prepped by an agent ([`Agent::prep_list`]), released when dropped. NIXL's
/// handle points into the agent's view of the memory it lists, so its owner drops it before the
/// agent, before deregistering that memory (a local list) and before invalidating or reloading
/// that peer's metadata (a remote list). Requests made from it copy their entries and do not
/// borrow it.
pub(crate) struct PreppedList {
    api: &'static Api,
    agent: sys::Agent,
    raw: sys::XferDlistHandle,
    len: usize,
}

// SAFETY: a prepped handle is a plain heap object with no thread affinity; it is used (and
// released) only under its owner's lock, through the agent that prepped it.
unsafe impl Send for PreppedList {}

impl Drop for PreppedList {
    fn drop(&mut self) {
        // SAFETY: prepped by `agent`, which is still alive (the owner drops every list before
        // the agent, see the type's docs); released exactly once.
        unsafe { (self.api.release_xfer_dlist_handle)(self.agent, self.raw) };
    }
}

/// A registration: the region's memory stays registered with the agent until
/// [`Agent::deregister`] consumes this. It keeps the region referenced meanwhile.
pub(crate) struct Registration {
    agent: sys::Agent,
    dlist: RegDlist,
    /// Held (never read) so the registered memory is referenced while registered.
    _region: Arc<KvRegion>,
}

// SAFETY: holds a descriptor list (a plain heap object, see `RegDlist`) and the agent's address
// only as an identity to compare; nothing is called through it.
unsafe impl Send for Registration {}

/// An owned `nixl_capi_reg_dlist_t`.
struct RegDlist {
    api: &'static Api,
    raw: sys::RegDlist,
}

// SAFETY: a descriptor list is a plain C++ container with no thread affinity; it is only used by
// its owner.
unsafe impl Send for RegDlist {}

impl RegDlist {
    fn new(api: &'static Api, mem: sys::MemType) -> Result<RegDlist, CallError> {
        let mut raw: sys::RegDlist = ptr::null_mut();
        // SAFETY: valid out pointer.
        check("create_reg_dlist", unsafe {
            (api.create_reg_dlist)(mem, &mut raw)
        })?;
        Ok(RegDlist { api, raw })
    }
}

impl Drop for RegDlist {
    fn drop(&mut self) {
        // SAFETY: created by `new`, destroyed once.
        unsafe { (self.api.destroy_reg_dlist)(self.raw) };
    }
}

/// An owned `nixl_capi_xfer_dlist_t`.
pub(crate) struct XferDlist {
    api: &'static Api,
    pub(crate) raw: sys::XferDlist,
}

impl XferDlist {
    /// A list of `descs`, all in memory of `memory` (NIXL types a list, not a descriptor).
    pub(crate) fn new(
        api: &'static Api,
        memory: MemoryKind,
        descs: &[(usize, usize)],
    ) -> Result<XferDlist, CallError> {
        let (mem, dev) = nixl_memory(memory);
        let mut raw: sys::XferDlist = ptr::null_mut();
        // SAFETY: valid out pointer.
        check("create_xfer_dlist", unsafe {
            (api.create_xfer_dlist)(mem, &mut raw)
        })?;
        let list = XferDlist { api, raw };
        for &(addr, len) in descs {
            // SAFETY: live list; the descriptor is plain data (NIXL does not dereference it here).
            check("xfer_dlist_add_desc", unsafe {
                (api.xfer_dlist_add_desc)(list.raw, addr, len, dev)
            })?;
        }
        Ok(list)
    }
}

impl Drop for XferDlist {
    fn drop(&mut self) {
        // SAFETY: created by `new`, destroyed once.
        unsafe { (self.api.destroy_xfer_dlist)(self.raw) };
    }
}

/// An owned `nixl_capi_opt_args_t`.
pub(crate) struct OptArgs {
    api: &'static Api,
    pub(crate) raw: sys::OptArgs,
}

impl OptArgs {
    /// Opt args carrying `notification`, if any, for a request being created.
    pub(crate) fn new(
        api: &'static Api,
        notification: Option<&[u8]>,
    ) -> Result<OptArgs, CallError> {
        let mut raw: sys::OptArgs = ptr::null_mut();
        // SAFETY: valid out pointer.
        check("create_opt_args", unsafe {
            (api.create_opt_args)(&mut raw)
        })?;
        let opt = OptArgs { api, raw };
        if let Some(msg) = notification {
            opt.set_notification(msg)?;
        }
        Ok(opt)
    }

    fn set_notification(&self, msg: &[u8]) -> Result<(), CallError> {
        // SAFETY: live opt args; `msg` valid for its length (NIXL copies it; a zero-length
        // slice's pointer is non-null, as NIXL requires).
        check("opt_args_set_notif_msg", unsafe {
            (self.api.opt_args_set_notif_msg)(self.raw, msg.as_ptr() as *const c_void, msg.len())
        })?;
        // SAFETY: live opt args.
        check("opt_args_set_has_notif", unsafe {
            (self.api.opt_args_set_has_notif)(self.raw, true)
        })
    }
}

impl Drop for OptArgs {
    fn drop(&mut self) {
        // SAFETY: created by `new`, destroyed once.
        unsafe { (self.api.destroy_opt_args)(self.raw) };
    }
}

/// A live transfer request of one agent. Only [`Agent::release_xfer`] ends it; one dropped
/// otherwise is leaked (NIXL would refuse to destroy it unreleased, and releasing needs the
/// agent).
pub(crate) struct XferReq {
    agent: sys::Agent,
    raw: sys::XferReq,
}

// SAFETY: the request is a heap object with no thread affinity; it is only used through its
// agent, whose calls never overlap (see `Agent`).
unsafe impl Send for XferReq {}

impl Drop for XferReq {
    fn drop(&mut self) {
        tracing::warn!("nixl: a transfer request was dropped unreleased and is leaked");
    }
}
