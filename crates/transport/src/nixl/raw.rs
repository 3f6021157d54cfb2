//! A bare-C-API baseline: moves blocks between two NIXL agents of this process the way a
//! hand-written NIXL program would (prepped descriptor lists, `make_xfer_req`, post, poll,
//! release), with the same agent settings as [`super::NixlTransport`] (progress thread with the
//! configured delay, THREAD_SYNC_NONE, the configured backend). `handoff bench transfer` runs it
//! beside the transport on the same blocks to report `nixl_vs_raw_nixl`.
//!
//! Block mapping ([`scattered_pairs`]): block `i` goes from local slot `2i` to remote slot
//! `2(n-1-i)+1` of regions of `2n` slots, so no two descriptors are adjacent on either side and
//! NIXL cannot merge them (adjacent 4 KiB blocks would otherwise move as one large copy).
//! Use the same mapping on the transport side to compare like with like.

use std::ffi::{c_char, c_int, c_void, CString};
use std::ptr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use super::sys::{self, Api};
use super::{load_api, locate, NixlConfig};
use crate::{TransportError, XferOp};

/// What to move.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RawSpec {
    pub op: XferOp,
    pub block_size: usize,
    pub blocks: usize,
    /// Timed transfers (after one untimed warm-up that also checks the bytes).
    pub iters: usize,
    /// One notification per transfer, as the transport's users send.
    pub notify: bool,
    /// Sleep between status polls while a transfer runs; zero spins. Pollers that sleep leave
    /// the cores to NIXL's own threads (its progress thread, and the UCX backend's worker threads
    /// when `num_threads` is set), so a comparison polls both sides the same way.
    pub poll: Duration,
    /// Where both agents' buffers live.
    pub memory: RawMemory,
}

/// Host memory, or GPU 0's memory (allocated through the CUDA driver, loaded at run time).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum RawMemory {
    #[default]
    Dram,
    Vram,
}

impl RawMemory {
    fn nixl(self) -> sys::MemType {
        match self {
            RawMemory::Dram => sys::MEM_DRAM,
            RawMemory::Vram => sys::MEM_VRAM,
        }
    }
}

/// An agent's buffer: host bytes, or a device allocation filled from them.
enum Buffer {
    Host(Vec<u8>),
    Device(super::cuda::DeviceBuffer),
}

impl Buffer {
    fn addr(&self) -> usize {
        match self {
            Buffer::Host(v) => v.as_ptr() as usize,
            Buffer::Device(d) => d.addr(),
        }
    }

    fn len(&self) -> usize {
        match self {
            Buffer::Host(v) => v.len(),
            Buffer::Device(d) => d.len(),
        }
    }

    /// The bytes, as the host sees them now (a device buffer is copied out).
    fn bytes(&self) -> Result<std::borrow::Cow<'_, [u8]>, TransportError> {
        match self {
            Buffer::Host(v) => Ok(std::borrow::Cow::Borrowed(v)),
            Buffer::Device(d) => Ok(std::borrow::Cow::Owned(d.to_host()?)),
        }
    }
}

/// What was measured: each transfer timed from request creation to release.
#[derive(Debug, Clone, PartialEq)]
pub struct RawReport {
    pub bytes_per_xfer: u64,
    /// Seconds per timed transfer, in order.
    pub secs: Vec<f64>,
    /// Median throughput, 1e9 bytes per second.
    pub gbps: f64,
}

/// Length of each region for `blocks` blocks of `block_size` bytes (two slots per block).
pub fn region_len(blocks: usize, block_size: usize) -> usize {
    2 * blocks * block_size
}

/// `(local offset, remote offset)` of each block; see the module docs.
pub fn scattered_pairs(blocks: usize, block_size: usize) -> Vec<(u64, u64)> {
    (0..blocks)
        .map(|i| {
            let l = 2 * i;
            let r = 2 * (blocks - 1 - i) + 1;
            ((l * block_size) as u64, (r * block_size) as u64)
        })
        .collect()
}

/// Median throughput of `bytes` moved in each of `secs`, in GB/s.
pub fn median_gbps(bytes: u64, secs: &[f64]) -> f64 {
    if secs.is_empty() {
        return 0.0;
    }
    let mut s = secs.to_vec();
    s.sort_by(|a, b| a.total_cmp(b));
    let mid = if s.len() % 2 == 1 {
        s[s.len() / 2]
    } else {
        (s[s.len() / 2 - 1] + s[s.len() / 2]) / 2.0
    };
    bytes as f64 / mid / 1e9
}

fn fail(what: &str, st: sys::Status) -> TransportError {
    TransportError::Io(format!("raw nixl: nixl_capi_{what} returned {st}"))
}

fn ok(what: &str, st: sys::Status) -> Result<(), TransportError> {
    if st == sys::SUCCESS {
        Ok(())
    } else {
        Err(fail(what, st))
    }
}

/// One bare agent with a backend, a registered buffer and a notification map; torn down in
/// NIXL's order on drop, whatever step failed.
struct RawAgent {
    api: &'static Api,
    agent: sys::Agent,
    backend: sys::Backend,
    reg: sys::RegDlist,
    registered: bool,
    notifs: sys::NotifMap,
    name: CString,
    memory: RawMemory,
    // Declared last: freed after the registration (Drop deregisters first).
    buf: Buffer,
}

impl RawAgent {
    fn new(
        api: &'static Api,
        name: String,
        cfg: &NixlConfig,
        len: usize,
        fill: Option<fn(&mut [u8])>,
        memory: RawMemory,
    ) -> Result<Self, TransportError> {
        let name = CString::new(name).map_err(|e| TransportError::Io(e.to_string()))?;
        let backend_name =
            CString::new(cfg.backend.as_str()).map_err(|e| TransportError::Io(e.to_string()))?;
        let conf = sys::AgentConfig {
            enable_prog_thread: true,
            enable_listen_thread: false,
            listen_port: 0,
            thread_sync: sys::THREAD_SYNC_NONE,
            num_workers: 1,
            pthr_delay_us: cfg.progress_delay_us,
            lthr_delay_us: 100_000,
            capture_telemetry: false,
        };
        let mut a = RawAgent {
            api,
            agent: ptr::null_mut(),
            backend: ptr::null_mut(),
            reg: ptr::null_mut(),
            registered: false,
            notifs: ptr::null_mut(),
            name,
            // Every page is written (faulted in) before it is registered, as the transport's
            // regions are when the engine fills them.
            memory,
            buf: {
                let host = match fill {
                    Some(f) => {
                        let mut v = vec![0u8; len];
                        f(&mut v);
                        v
                    }
                    None => vec![0x5a; len],
                };
                match memory {
                    RawMemory::Dram => Buffer::Host(host),
                    RawMemory::Vram => Buffer::Device(super::cuda::DeviceBuffer::new(&host)?),
                }
            },
        };
        // SAFETY: C string name, valid config and out pointer.
        ok("create_configured_agent", unsafe {
            (api.create_configured_agent)(a.name.as_ptr(), &conf, &mut a.agent)
        })?;
        let mut params: sys::Params = ptr::null_mut();
        // SAFETY: valid out pointer.
        ok("create_params", unsafe { (api.create_params)(&mut params) })?;
        let mut st = sys::SUCCESS;
        for (k, v) in &cfg.backend_params {
            let (Ok(k), Ok(v)) = (CString::new(k.as_str()), CString::new(v.as_str())) else {
                // SAFETY: `params` is not used after this.
                unsafe { (api.destroy_params)(params) };
                return Err(TransportError::Io(
                    "backend parameter contains a NUL byte".into(),
                ));
            };
            // SAFETY: live params list; C strings that NIXL copies.
            st = unsafe { (api.params_add)(params, k.as_ptr(), v.as_ptr()) };
            if st != sys::SUCCESS {
                break;
            }
        }
        if st == sys::SUCCESS {
            // SAFETY: live agent and params, C string, valid out pointer.
            st = unsafe {
                (api.create_backend)(a.agent, backend_name.as_ptr(), params, &mut a.backend)
            };
        }
        // SAFETY: `params` is not used after this.
        unsafe { (api.destroy_params)(params) };
        ok("create_backend", st)?;
        // SAFETY: valid out pointers; the buffer is owned by `a` and outlives the registration
        // (deregistered in Drop before `buf` is freed).
        unsafe {
            ok("create_notif_map", (api.create_notif_map)(&mut a.notifs))?;
            ok(
                "create_reg_dlist",
                (api.create_reg_dlist)(a.memory.nixl(), &mut a.reg),
            )?;
            ok(
                "reg_dlist_add_desc",
                (api.reg_dlist_add_desc)(
                    a.reg,
                    a.buf.addr(),
                    a.buf.len(),
                    // The device id (GPU 0; ignored for host memory).
                    0,
                    ptr::null(),
                    0,
                ),
            )?;
            ok(
                "register_mem",
                (api.register_mem)(a.agent, a.reg, ptr::null_mut()),
            )?;
        }
        a.registered = true;
        Ok(a)
    }

    fn local_md(&self) -> Result<Vec<u8>, TransportError> {
        let mut data: *mut c_void = ptr::null_mut();
        let mut len = 0usize;
        // SAFETY: live agent, valid out pointers; the malloc'ed blob is copied then freed once.
        unsafe {
            ok(
                "get_local_md",
                (self.api.get_local_md)(self.agent, &mut data, &mut len),
            )?;
            let v = std::slice::from_raw_parts(data as *const u8, len).to_vec();
            sys::free(data);
            Ok(v)
        }
    }

    fn load(&self, md: &[u8]) -> Result<(), TransportError> {
        let mut name: *mut c_char = ptr::null_mut();
        // SAFETY: live agent, `md` valid for its length, valid out pointer; the strdup'ed name
        // is freed once.
        unsafe {
            ok(
                "load_remote_md",
                (self.api.load_remote_md)(
                    self.agent,
                    md.as_ptr() as *const c_void,
                    md.len(),
                    &mut name,
                ),
            )?;
            sys::free(name as *mut c_void);
        }
        Ok(())
    }

    /// Number of notifications received (the map is cleared).
    fn drain_notifs(&self) -> usize {
        let mut n = 0usize;
        // SAFETY: live agent and map; names are borrowed from the map until it is cleared.
        unsafe {
            (self.api.get_notifs)(self.agent, self.notifs, ptr::null_mut());
            let mut agents = 0usize;
            (self.api.notif_map_size)(self.notifs, &mut agents);
            for i in 0..agents {
                let mut name: *const c_char = ptr::null();
                if (self.api.notif_map_get_agent_at)(self.notifs, i, &mut name) == sys::SUCCESS {
                    let mut k = 0usize;
                    (self.api.notif_map_get_notifs_size)(self.notifs, name, &mut k);
                    n += k;
                }
            }
            (self.api.notif_map_clear)(self.notifs);
        }
        n
    }
}

impl Drop for RawAgent {
    fn drop(&mut self) {
        // SAFETY: each handle was created by this agent (or is null, skipped) and is destroyed
        // once, in NIXL's order: registration, lists, map, backend wrapper, agent.
        unsafe {
            if self.registered {
                (self.api.deregister_mem)(self.agent, self.reg, ptr::null_mut());
            }
            if !self.reg.is_null() {
                (self.api.destroy_reg_dlist)(self.reg);
            }
            if !self.notifs.is_null() {
                (self.api.destroy_notif_map)(self.notifs);
            }
            if !self.backend.is_null() {
                (self.api.destroy_backend)(self.backend);
            }
            if !self.agent.is_null() {
                (self.api.destroy_agent)(self.agent);
            }
        }
    }
}

/// A prepped descriptor-list handle, released on drop (declared before its agent wherever both
/// are fields, so it drops first).
struct Prepped {
    api: &'static Api,
    agent: sys::Agent,
    raw: sys::XferDlistHandle,
}

impl Drop for Prepped {
    fn drop(&mut self) {
        // SAFETY: prepped by `agent`, which outlives this handle (see the field order of
        // RawSession), released once.
        unsafe { (self.api.release_xfer_dlist_handle)(self.agent, self.raw) };
    }
}

fn prep(
    owner: &RawAgent,
    agent_name: &CString,
    descs: &[(usize, usize)],
) -> Result<Prepped, TransportError> {
    let api = owner.api;
    let mut list: sys::XferDlist = ptr::null_mut();
    // SAFETY: valid out pointer; the list is filled with plain descriptors, prepped by a live
    // agent (which copies it) and destroyed once.
    unsafe {
        ok(
            "create_xfer_dlist",
            (api.create_xfer_dlist)(owner.memory.nixl(), &mut list),
        )?;
        for &(addr, len) in descs {
            let st = (api.xfer_dlist_add_desc)(list, addr, len, 0);
            if st != sys::SUCCESS {
                (api.destroy_xfer_dlist)(list);
                return Err(fail("xfer_dlist_add_desc", st));
            }
        }
        let mut h: sys::XferDlistHandle = ptr::null_mut();
        let st = (api.prep_xfer_dlist)(
            owner.agent,
            agent_name.as_ptr(),
            list,
            &mut h,
            ptr::null_mut(),
        );
        (api.destroy_xfer_dlist)(list);
        ok("prep_xfer_dlist", st)?;
        Ok(Prepped {
            api,
            agent: owner.agent,
            raw: h,
        })
    }
}

/// Two agents of this process with prepped lists for `spec`'s blocks, ready to time one transfer
/// at a time, so a caller can interleave them with the transport's repetitions.
pub struct RawSession {
    // Field order is drop order: the prepped handles go before the agents that prepped them.
    lh: Prepped,
    rh: Prepped,
    a: RawAgent,
    b: RawAgent,
    api: &'static Api,
    spec: RawSpec,
    pairs: Vec<(u64, u64)>,
    idx: Vec<c_int>,
    opt: sys::OptArgs,
    posted: usize,
}

impl RawSession {
    /// Sets up both agents, fills the source with a pattern (the destination with a constant)
    /// and preps the descriptor lists.
    pub fn new(cfg: &NixlConfig, spec: &RawSpec) -> Result<Self, TransportError> {
        static SEQ: AtomicU64 = AtomicU64::new(0);
        if spec.blocks == 0 || spec.block_size == 0 || spec.blocks > c_int::MAX as usize {
            return Err(TransportError::Io(
                "raw nixl: empty or too large spec".into(),
            ));
        }
        let api = load_api(&locate(cfg)?)?;
        let len = region_len(spec.blocks, spec.block_size);
        let seq = SEQ.fetch_add(1, Ordering::Relaxed);
        let pid = std::process::id();
        let pattern: fn(&mut [u8]) = |buf| {
            let period: Vec<u8> = (0..251u8).collect();
            for piece in buf.chunks_mut(period.len()) {
                piece.copy_from_slice(&period[..piece.len()]);
            }
        };
        let src_is_a = spec.op == XferOp::Write;
        let a = RawAgent::new(
            api,
            format!("raw-a-{pid}-{seq}"),
            cfg,
            len,
            src_is_a.then_some(pattern),
            spec.memory,
        )?;
        let b = RawAgent::new(
            api,
            format!("raw-b-{pid}-{seq}"),
            cfg,
            len,
            (!src_is_a).then_some(pattern),
            spec.memory,
        )?;
        a.load(&b.local_md()?)?;
        b.load(&a.local_md()?)?;
        let pairs = scattered_pairs(spec.blocks, spec.block_size);
        let abase = a.buf.addr();
        let bbase = b.buf.addr();
        let local: Vec<(usize, usize)> = pairs
            .iter()
            .map(|&(l, _)| (abase + l as usize, spec.block_size))
            .collect();
        let remote: Vec<(usize, usize)> = pairs
            .iter()
            .map(|&(_, r)| (bbase + r as usize, spec.block_size))
            .collect();
        let init = CString::new("").expect("no NUL");
        let lh = prep(&a, &init, &local)?;
        let rh = prep(&a, &b.name, &remote)?;
        let mut opt: sys::OptArgs = ptr::null_mut();
        if spec.notify {
            // SAFETY: valid out pointer; the message is copied by NIXL; destroyed once in Drop.
            unsafe {
                ok("create_opt_args", (api.create_opt_args)(&mut opt))?;
                let msg = b"raw";
                (api.opt_args_set_notif_msg)(opt, msg.as_ptr() as *const c_void, msg.len());
                (api.opt_args_set_has_notif)(opt, true);
            }
        }
        Ok(RawSession {
            lh,
            rh,
            a,
            b,
            api,
            spec: spec.clone(),
            pairs,
            idx: (0..spec.blocks as c_int).collect(),
            opt,
            posted: 0,
        })
    }

    /// Bytes one transfer moves.
    pub fn bytes(&self) -> u64 {
        (self.spec.blocks * self.spec.block_size) as u64
    }

    /// One transfer, timed from request creation to release, in seconds.
    pub fn once(&mut self) -> Result<f64, TransportError> {
        let api = self.api;
        let op = super::agent::op_code(self.spec.op);
        let t0 = Instant::now();
        let mut req: sys::XferReq = ptr::null_mut();
        self.posted += 1;
        // SAFETY: live agent, prepped handles of that agent, indices valid for both lists
        // (`blocks` entries each), valid out pointer, live (or null) opt args. The request is
        // polled, released, then destroyed once.
        unsafe {
            ok(
                "make_xfer_req",
                (api.make_xfer_req)(
                    self.a.agent,
                    op,
                    self.lh.raw,
                    self.idx.as_ptr(),
                    self.idx.len(),
                    self.rh.raw,
                    self.idx.as_ptr(),
                    self.idx.len(),
                    &mut req,
                    self.opt,
                ),
            )?;
            let mut st = (api.post_xfer_req)(self.a.agent, req, ptr::null_mut());
            let deadline = Instant::now() + Duration::from_secs(30);
            while st == sys::IN_PROG && Instant::now() < deadline {
                if !self.spec.poll.is_zero() {
                    std::thread::sleep(self.spec.poll);
                }
                st = (api.get_xfer_status)(self.a.agent, req);
            }
            let rel = (api.release_xfer_req)(self.a.agent, req);
            if rel == sys::SUCCESS {
                (api.destroy_xfer_req)(req);
            }
            ok("post_xfer_req/get_xfer_status", st)?;
        }
        Ok(t0.elapsed().as_secs_f64())
    }

    /// Checks that every destination block equals its source block (after a transfer).
    pub fn check(&self) -> Result<(), TransportError> {
        let src_is_a = self.spec.op == XferOp::Write;
        let (src, dst) = if src_is_a {
            (self.a.buf.bytes()?, self.b.buf.bytes()?)
        } else {
            (self.b.buf.bytes()?, self.a.buf.bytes()?)
        };
        let bs = self.spec.block_size;
        for &(l, r) in &self.pairs {
            let (s_off, d_off) = if src_is_a { (l, r) } else { (r, l) };
            let (s_off, d_off) = (s_off as usize, d_off as usize);
            // Every transfer is complete and released: nothing writes these buffers any more.
            if src[s_off..s_off + bs] != dst[d_off..d_off + bs] {
                return Err(TransportError::Io(
                    "raw nixl: bytes differ after a transfer".into(),
                ));
            }
        }
        Ok(())
    }

    /// With notifications on: waits (bounded) until every posted transfer's arrived.
    pub fn wait_notifications(&self) -> Result<(), TransportError> {
        if !self.spec.notify {
            return Ok(());
        }
        let want = self.posted;
        let mut got = 0;
        let deadline = Instant::now() + Duration::from_secs(5);
        while got < want && Instant::now() < deadline {
            got += self.b.drain_notifs();
            if got < want {
                std::thread::sleep(Duration::from_micros(200));
            }
        }
        if got != want {
            return Err(TransportError::Io(format!(
                "raw nixl: {got} of {want} notifications arrived"
            )));
        }
        Ok(())
    }
}

impl Drop for RawSession {
    fn drop(&mut self) {
        if !self.opt.is_null() {
            // SAFETY: created in new, destroyed once, no request uses it any more (every
            // request is released before `once` returns).
            unsafe { (self.api.destroy_opt_args)(self.opt) };
        }
    }
}

/// Moves `spec.blocks` blocks of `spec.block_size` between two fresh agents of this process,
/// `spec.iters` times after one checked warm-up, and reports the throughput.
pub fn measure(cfg: &NixlConfig, spec: &RawSpec) -> Result<RawReport, TransportError> {
    let mut s = RawSession::new(cfg, spec)?;
    s.once()?;
    s.check()?;
    let secs = (0..spec.iters)
        .map(|_| s.once())
        .collect::<Result<Vec<f64>, _>>()?;
    s.wait_notifications()?;
    let bytes = s.bytes();
    Ok(RawReport {
        bytes_per_xfer: bytes,
        gbps: median_gbps(bytes, &secs),
        secs,
    })
}
