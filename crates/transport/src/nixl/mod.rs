//! The nixl backend: NIXL's C API (`libnixl_capi.so` from the `nixl-cu12` wheel), loaded at run
//! time so handoff builds and runs where NIXL is absent.
//!
//! - Installing: `scripts/install-nixl` puts the wheel in the project-local venv `.venv-nixl/`,
//!   where [`NixlTransport::open`] finds it (see [`locate`] for the search order), or set
//!   `HANDOFF_NIXL_LIB`. When NIXL is absent, `open` returns [`TransportError::Unavailable`]
//!   with a one-line reason.
//! - Layers: `sys` is the raw function table (hand-written from `nixl-sys` 1.5.2's `wrapper.h`),
//!   `library` finds and loads it, `agent` is the safe owner of every C handle, `config` and
//!   `metadata` hold what needs no NIXL call (the settings, the metadata codec), this module is
//!   the [`Transport`] on top, and [`raw`] a bare-C-API baseline for benchmarks. Every `unsafe`
//!   block carries a `SAFETY:` comment (clippy's `undocumented_unsafe_blocks`, denied
//!   workspace-wide).
//!
//! # Behaviour
//!
//! - **One agent, one lock.** The agent is created with `THREAD_SYNC_NONE` and every NIXL call
//!   goes through one mutex, so calls from several threads are serialised (NIXL's own progress
//!   thread runs beside them, as NIXL intends).
//! - **Posting blocks.** On the default UCX path between processes of one host the copy is a
//!   CMA `process_vm_readv/writev` that runs inside `post_xfer_req`, under the lock (about
//!   12 ms for 64 MiB on one thread). The UCX backend's thread pool ([`UCX_DEFAULT_PARAMS`])
//!   copies a list of `num_threads × split_batch_size` descriptors or more on all its threads
//!   at once (NIXL cuts lists by count, not bytes), and the post waits for every part. A post of
//!   fewer, large descriptors (a contiguous run of blocks is one descriptor) is cut into that
//!   many pieces first, when it moves at least [`MIN_SPREAD_TOTAL`] and each piece stays at
//!   least [`MIN_SPREAD_PIECE`] (see [`Spread`]).
//!   Async callers must post from a blocking thread (`spawn_blocking`); other calls on this
//!   transport wait for the copy meanwhile.
//! - **Local memory is locked while NIXL may touch it.** A posted transfer holds the owned chunk
//!   locks of its local span — write locks on the destination of a READ, read locks on the
//!   source of a WRITE — until [`Transport::release`]. A post whose local span overlaps a chunk
//!   that an unreleased transfer of this transport holds incompatibly (a D rank's READs of one
//!   block's heads from two P ranks) is accepted and deferred instead of waiting (the same
//!   thread may be the one that would release the other): it reports `InProgress` and is posted
//!   by its first status check after the chunk is free. Remote memory is not locked: the
//!   peer's ledger fences cover it. Device memory has no host chunk locks; the claims still
//!   order this transport's own transfers.
//! - **Notifications of transfers leave from status checks.** NIXL's UCX backend sends the
//!   notification of a transfer that was not complete at post time from the initiator's next
//!   status check of it, so the initiator must keep calling [`Transport::status`] (or
//!   `drain_notifications` / `drain_dead_peers`, which check every transfer in progress) until
//!   the transfer is done; one released while still in progress never notifies.
//! - **Release** of a transfer still in progress asks NIXL to abort it; its locks go when NIXL
//!   accepts, and until then (NIXL may refuse while the backend still runs it) the transfer is
//!   kept aside and retried on every later call.
//! - **Registrations** keep their `Arc<KvRegion>`; a region deregistered while a posted transfer
//!   still uses it stays registered with NIXL until that transfer is released.
//! - **Metadata** is NIXL's agent metadata plus a small header listing this agent's regions
//!   (id → address, length), so `post` translates `XferDesc`s to remote addresses and
//!   bounds-checks them locally; NIXL also refuses ranges missing from the peer's metadata as
//!   loaded (not as the peer has it now: reload after the peer deregisters). A checksum keeps
//!   damaged bytes from reaching NIXL, which can be left unable to reload a peer after failing
//!   on a damaged blob of that peer.
//! - **Dead peers.** The C API folds `NIXL_ERR_REMOTE_DISCONNECT` into the generic -2, and
//!   NIXL 1.5 keeps a dead peer's metadata (`check_remote_md` still succeeds). So after any
//!   failed post, status or create, the transport probes the peer's connection with a small
//!   reserved notification (`gen_notif` fails at once on a disconnected UCX endpoint; a live
//!   handoff peer drops the probe); a failed `send_notification` counts as the same proof. A
//!   dead peer is reported once by [`Transport::drain_dead_peers`], its NIXL metadata is
//!   invalidated, and posts to it fail with [`TransportError::PeerDead`] until it is loaded
//!   again. A peer that dies while idle is noticed at the next transfer or notification to it:
//!   NIXL has no liveness probe of its own, and leases cover that case.
//! - **Progress thread delay** ([`NixlConfig::progress_delay_us`], default 100 µs): 0 (Python's
//!   default) makes each agent's progress thread busy-spin on a core, which halves throughput on
//!   a 2-core host.
//!
//! One file, over 800 lines: the transport, every function of which calls NIXL under the same
//! invariants (the agent's life, the table of posted requests, the transfers NIXL could not
//! abort); the pieces that do not share them are submodules.

#![allow(unsafe_code)]

mod agent;
// GPU memory for the raw baseline only.
mod config;
#[cfg(any(test, feature = "testing"))]
mod cuda;
mod library;
mod metadata;
/// The bare-C-API baseline the benchmarks compare with (feature `testing`; not API).
#[cfg(any(test, feature = "testing"))]
pub mod raw;
mod sys;
#[cfg(test)]
mod tests;

use std::collections::HashMap;
use std::ffi::c_int;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use crate::device::{Device, MemoryKind};
use crate::{
    check_bounds, KvRegion, Notification, OwnedReadGuard, OwnedWriteGuard, RegionId, Transport,
    TransportError, XferDesc, XferId, XferOp, XferStatus, MAX_NOTIFICATION_BYTES,
};
use agent::{Agent, AgentSettings, CallError, PreppedList, Registration, XferReq};

pub use config::{
    parse_backend_params, NixlConfig, Spread, MIN_SPREAD_PIECE, MIN_SPREAD_TOTAL,
    UCX_DEFAULT_PARAMS,
};
use library::{load_api, unavailable};
pub use library::{locate, LIB_NAME, VENV_DIR};
pub use metadata::MAX_METADATA_BYTES;
use metadata::{decode_md, encode_md, MdBody, MAX_NAME_BYTES};

const BACKEND: &str = "nixl";

/// The notification `check_peer` sends to learn whether a peer's connection is still up;
/// receivers drop it.
const PROBE: &[u8] = b"\0handoff/nixl/probe\0";

/// A handoff transport over one NIXL agent. See the module docs for its behaviour.
pub struct NixlTransport {
    name: String,
    lib_path: PathBuf,
    config: NixlConfig,
    /// The thread pool's split rule, read once from `config` (see [`Spread`]).
    spread: Option<Spread>,
    inner: Mutex<Inner>,
}

impl std::fmt::Debug for NixlTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NixlTransport")
            .field("name", &self.name)
            .field("lib_path", &self.lib_path)
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

impl NixlTransport {
    /// Loads NIXL and creates the agent `name` with its backend (progress thread on, no
    /// listener: metadata travels through [`Transport::local_metadata`]). When NIXL is absent or
    /// unusable: [`TransportError::Unavailable`] with a one-line reason.
    pub fn open(name: &str, cfg: NixlConfig) -> Result<Arc<NixlTransport>, TransportError> {
        if name.is_empty() || name.contains('\0') || name.len() > MAX_NAME_BYTES {
            return Err(TransportError::Io(format!(
                "invalid agent name {name:?} (1 to {MAX_NAME_BYTES} bytes, no NUL)"
            )));
        }
        let path = locate(&cfg)?;
        let api = load_api(&path)?;
        let settings = AgentSettings {
            progress_delay_us: cfg.progress_delay_us,
            backend: cfg.backend.clone(),
            backend_params: cfg.backend_params.clone(),
        };
        let agent = Agent::new(api, name, &settings)
            .map_err(|e| unavailable(format!("{e} (library {})", path.display())))?;
        Ok(Arc::new(NixlTransport {
            name: name.to_string(),
            lib_path: path,
            spread: Spread::of(&cfg),
            config: cfg,
            inner: Mutex::new(Inner::new(agent)),
        }))
    }

    /// How many transfers were made from prepped lists (every descriptor one whole chunk on
    /// both sides) rather than from scratch.
    pub fn prepped_transfers(&self) -> u64 {
        self.lock().made_from_prepped
    }

    /// How many posts were cut into more descriptors so that every thread of the UCX backend's
    /// pool copies a part (see [`Spread`]).
    pub fn spread_posts(&self) -> u64 {
        self.lock().spread_posts
    }

    /// The library this transport runs on.
    pub fn lib_path(&self) -> &Path {
        &self.lib_path
    }

    pub fn config(&self) -> &NixlConfig {
        &self.config
    }

    /// Posts as transfer `id` (the transport's [`Transport::post`], with its id chosen), or
    /// answers [`Posted::Busy`] having claimed nothing when a local chunk it writes (or reads)
    /// is held by another unreleased transfer of this agent: the post is then deferred.
    fn post_as(
        &self,
        id: XferId,
        op: XferOp,
        peer: &str,
        descs: &[XferDesc],
        notification: Option<&[u8]>,
    ) -> Result<Posted, TransportError> {
        if let Some(msg) = notification {
            if msg.len() > MAX_NOTIFICATION_BYTES {
                return Err(TransportError::NotificationTooLarge {
                    len: msg.len(),
                    max: MAX_NOTIFICATION_BYTES,
                });
            }
        }
        let write = op == XferOp::Read; // a READ writes into local memory
        let mut local = Vec::with_capacity(descs.len());
        let mut remote = Vec::with_capacity(descs.len());

        // Phase 1, under the lock: check every descriptor, translate it, claim the chunks.
        let (claim, spans, mut by_chunk, memory) = {
            let mut g = self.lock();
            g.reap_zombies();
            let p = g
                .peers
                .get(peer)
                .ok_or_else(|| TransportError::UnknownPeer(peer.to_string()))?;
            if p.dead {
                return Err(TransportError::PeerDead(peer.to_string()));
            }
            // Descriptors nearly always name one or two regions: remember the last lookups
            // instead of hashing per descriptor (a post may carry tens of thousands).
            let mut regions: Vec<Arc<KvRegion>> = Vec::new();
            let mut regs: Vec<u64> = Vec::new();
            let mut spans: Vec<(usize, usize, usize)> = Vec::with_capacity(descs.len());
            let mut last_local: Option<(RegionId, usize, u64)> = None;
            let mut last_remote: Option<(RegionId, u64, u64, u64)> = None;
            // While every descriptor is one whole chunk on both sides, of one local and one
            // remote region: the chunk indices, for the prepped lists (see `Prep`).
            let mut by_chunk: Option<ChunkIndices> = Some(ChunkIndices::default());
            // NIXL types a whole descriptor list: each side of a post is in one kind of memory.
            let mut local_mem: Option<MemoryKind> = None;
            let mut remote_mem: Option<MemoryKind> = None;
            let one_kind = |seen: &mut Option<MemoryKind>, m: MemoryKind, side: &str| match *seen {
                Some(s) if s != m => Err(TransportError::Io(format!(
                    "a post's {side} descriptors are in {s} and in {m}: post each kind of \
                         memory on its own"
                ))),
                _ => {
                    *seen = Some(m);
                    Ok(())
                }
            };
            for d in descs {
                let (idx, uid) = match last_local {
                    Some((id, idx, uid)) if id == d.local_region => (idx, uid),
                    _ => {
                        let uid =
                            *g.by_id
                                .get(&d.local_region)
                                .ok_or(TransportError::UnknownRegion {
                                    region: d.local_region,
                                })?;
                        let region = &g.regs[&uid].region;
                        one_kind(&mut local_mem, region.memory(), "local")?;
                        let idx = match regions.iter().position(|r| Arc::ptr_eq(r, region)) {
                            Some(i) => i,
                            None => {
                                regions.push(region.clone());
                                regions.len() - 1
                            }
                        };
                        if !regs.contains(&uid) {
                            regs.push(uid);
                        }
                        last_local = Some((d.local_region, idx, uid));
                        (idx, uid)
                    }
                };
                let region = &regions[idx];
                check_bounds(d.local_region, d.local_offset, d.len, region.len() as u64)?;
                let (raddr, rlen, rchunk) = match last_remote {
                    Some((id, a, l, c)) if id == d.remote_region => (a, l, c),
                    _ => {
                        let &(a, l, c) = p.regions.get(&d.remote_region).ok_or(
                            TransportError::UnknownRegion {
                                region: d.remote_region,
                            },
                        )?;
                        let m = p.memory.get(&d.remote_region).copied().unwrap_or_default();
                        one_kind(&mut remote_mem, m, "remote")?;
                        last_remote = Some((d.remote_region, a, l, c));
                        (a, l, c)
                    }
                };
                check_bounds(d.remote_region, d.remote_offset, d.len, rlen)?;
                if d.len == 0 {
                    continue;
                }
                let off = to_usize(d.local_offset)?;
                let len = to_usize(d.len)?;
                local.push((region.base_addr() + off, len));
                remote.push((to_usize(raddr + d.remote_offset)?, len));
                let cs = region.chunk_size();
                spans.push((idx, off / cs, (off + len - 1) / cs));
                if let Some(ci) = by_chunk.as_mut() {
                    let whole = |off: u64, len: u64, chunk: u64, total: u64| {
                        (off % chunk == 0 && len == chunk.min(total - off)).then(|| off / chunk)
                    };
                    let l = whole(d.local_offset, d.len, cs as u64, region.len() as u64);
                    let r = whole(d.remote_offset, d.len, rchunk, rlen);
                    let same = ci.regions.map_or(true, |x| x == (uid, d.remote_region));
                    match (l, r) {
                        (Some(l), Some(r))
                            if same && l <= c_int::MAX as u64 && r <= c_int::MAX as u64 =>
                        {
                            ci.regions = Some((uid, d.remote_region));
                            ci.local.push(l as c_int);
                            ci.remote.push(r as c_int);
                        }
                        _ => by_chunk = None,
                    }
                }
            }
            let spans: Vec<(Arc<KvRegion>, usize, usize)> = chunk_spans(&mut spans)
                .into_iter()
                .map(|(idx, first, last)| (regions[idx].clone(), first, last))
                .collect();
            let claimed: Vec<ChunkSpan> = spans
                .iter()
                .map(|(r, first, last)| (Arc::as_ptr(r) as usize, *first, *last))
                .collect();
            for (r, &(rp, first, last)) in spans.iter().map(|s| &s.0).zip(&claimed) {
                let Some(ch) = g.held.get(&rp) else { continue };
                for c in first..=last {
                    let h = ch.holds.get(c).copied().unwrap_or_default();
                    if h.writer || (write && h.readers > 0) {
                        // Another transfer of this agent holds the chunk (the READs of two
                        // sources into the heads of one block): post this one once it is
                        // released. Nothing is claimed yet.
                        tracing::debug!(
                            agent = %self.name,
                            "nixl: local chunk {c} (bytes {}..) is held by an unreleased transfer; deferring the post",
                            c * r.chunk_size()
                        );
                        return Ok(Posted::Busy);
                    }
                }
            }
            for (r, &(rp, first, last)) in spans.iter().map(|s| &s.0).zip(&claimed) {
                let ch = g.held.entry(rp).or_insert_with(|| ChunkHolds {
                    holds: vec![Hold::default(); r.len().div_ceil(r.chunk_size())],
                    active: 0,
                });
                for h in ch.holds.get_mut(first..=last).into_iter().flatten() {
                    if !h.writer && h.readers == 0 {
                        ch.active += 1;
                    }
                    if write {
                        h.writer = true;
                    } else {
                        h.readers += 1;
                    }
                }
            }
            for uid in &regs {
                if let Some(r) = g.regs.get_mut(uid) {
                    r.users += 1;
                }
            }
            (
                Claim {
                    write,
                    spans: claimed,
                    regs,
                },
                spans,
                by_chunk.filter(|ci| ci.regions.is_some()),
                (
                    local_mem.unwrap_or_default(),
                    remote_mem.unwrap_or_default(),
                ),
            )
        };

        // Few large descriptors: cut them so the copy runs on every pool thread (this takes
        // precedence over the prepped lists, which hold one entry per chunk).
        let cut = self.spread.and_then(|s| s.cut(&local, &remote));
        let spread = cut.is_some();
        if let Some((l, r)) = cut {
            (local, remote) = (l, r);
            by_chunk = None;
        }

        // Phase 2, without the transport lock: take the chunk locks, in address order. Only the
        // engine's own short accesses can make this wait (our transfers were excluded above).
        let mut guards = Vec::with_capacity(spans.len());
        for (r, first, last) in &spans {
            if r.device().is_some() {
                // Device memory has no host chunks to lock: the host never touches it through
                // Rust, and the kernels that do are ordered by the connector (CUDA events). The
                // claim above still keeps this agent's own transfers apart.
                continue;
            }
            let cs = r.chunk_size();
            let start = first * cs;
            let end = ((last + 1) * cs).min(r.len());
            let got = if write {
                r.lock_span_mut_owned(start, end - start).map(Guards::Write)
            } else {
                r.lock_span_owned(start, end - start).map(Guards::Read)
            };
            match got {
                Ok(gd) => guards.push(gd),
                Err(e) => {
                    drop(guards);
                    self.lock().unclaim(&claim);
                    return Err(e);
                }
            }
        }

        // Phase 3, under the lock: create and post (the copy may run here, see module docs).
        let mut g = self.lock();
        let mut x = Xfer {
            id,
            req: None,
            peer: peer.to_string(),
            state: XferStatus::InProgress,
            claim,
            guards,
        };
        if local.is_empty() {
            if let Some(msg) = notification {
                if let Err(e) = g.agent.gen_notif(peer, msg) {
                    let dead = g.check_peer(peer);
                    g.finish(x);
                    return Err(if dead {
                        TransportError::PeerDead(peer.to_string())
                    } else {
                        nixl_err(e)
                    });
                }
            }
            x.state = XferStatus::Done;
            g.xfers.insert(id, x);
            return Ok(Posted::Yes);
        }
        if spread {
            g.spread_posts += 1;
        }
        let prepped = by_chunk.and_then(|ci| g.prepped_xfer(op, peer, &ci, memory, notification));
        let made = match prepped {
            Some(made) => made,
            None => g.agent.create_xfer(
                op,
                (&local, memory.0),
                (&remote, memory.1),
                peer,
                notification,
            ),
        };
        let req = match made {
            Ok(req) => req,
            Err(e) => {
                let dead = g.check_peer(peer);
                g.finish(x);
                return Err(if dead {
                    TransportError::PeerDead(peer.to_string())
                } else if g.peers.contains_key(peer) {
                    TransportError::Io(format!(
                        "NIXL refused the transfer ({e}): a range the peer did not register, or stale metadata"
                    ))
                } else {
                    TransportError::UnknownPeer(peer.to_string())
                });
            }
        };
        let st = g.agent.post(&req);
        x.req = Some(req);
        match st {
            sys::SUCCESS => x.state = XferStatus::Done,
            sys::IN_PROG => {}
            _ => {
                let dead = g.check_peer(peer);
                g.finish(x);
                return Err(if dead {
                    TransportError::PeerDead(peer.to_string())
                } else {
                    TransportError::Io(format!("nixl_capi_post_xfer_req returned {st}"))
                });
            }
        }
        g.xfers.insert(id, x);
        Ok(Posted::Yes)
    }

    /// A deferred post's state, posting it now if its chunks are free: `None` when `id` is not
    /// deferred (any more), so the caller asks NIXL.
    fn retry_deferred(&self, id: XferId) -> Option<XferStatus> {
        let d = {
            let mut g = self.lock();
            let d = g.deferred.get_mut(&id)?;
            if d.retrying {
                return Some(XferStatus::InProgress);
            }
            d.retrying = true;
            d.clone()
        };
        let posted = self.post_as(id, d.op, &d.peer, &d.descs, d.notification.as_deref());
        let mut g = self.lock();
        let released = g.deferred.remove(&id).is_none();
        match posted {
            Ok(Posted::Busy) => {
                if !released {
                    g.deferred.insert(
                        id,
                        Deferred {
                            retrying: false,
                            ..d
                        },
                    );
                }
                Some(XferStatus::InProgress)
            }
            Ok(Posted::Yes) if released => {
                // Released while it was being posted: end it at once.
                if let Some(x) = g.xfers.remove(&id) {
                    g.finish(x);
                }
                Some(XferStatus::Failed("released".into()))
            }
            Ok(Posted::Yes) => None,
            Err(e) => {
                let state = XferStatus::Failed(e.to_string());
                if !released {
                    // Kept as a failed transfer until released, as any other.
                    g.xfers.insert(
                        id,
                        Xfer {
                            id,
                            req: None,
                            peer: d.peer,
                            state: state.clone(),
                            claim: Claim {
                                write: d.op == XferOp::Read,
                                spans: Vec::new(),
                                regs: Vec::new(),
                            },
                            guards: Vec::new(),
                        },
                    );
                }
                Some(state)
            }
        }
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        // A panic while the lock was held cannot leave NIXL half-called (no NIXL call panics),
        // so the state is still consistent.
        let g = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        // Every NIXL call below runs on this thread: with device memory registered, UCX finds
        // the device through the thread's current context (vLLM sets it on its handshake
        // thread for the same reason). Cheap, and the engine may have changed it meanwhile.
        if let Some(d) = &g.device {
            if let Err(e) = d.make_current() {
                tracing::warn!(agent = %self.name, "nixl: cannot make {} current: {e}", d.memory());
            }
        }
        g
    }
}

// ---------------------------------------------------------------------------------------------
// State behind the lock.

/// One registration and the in-flight transfers using it.
struct Reg {
    /// Dropped before `nixl` is deregistered (see [`Inner::drop_reg`]).
    prepped: Prep,
    /// `None` for an empty region (nothing for NIXL to register).
    nixl: Option<Registration>,
    region: Arc<KvRegion>,
    users: usize,
    /// Deregistered by the user; NIXL's registration ends with its last user.
    retired: bool,
}

#[derive(Default, Clone, Copy)]
struct Hold {
    readers: u32,
    writer: bool,
}

/// How this agent's transfers hold the chunks of one region (keyed in [`Inner::held`] by the
/// region's address): one entry per chunk, and how many chunks are held at all (the entry goes
/// when that drops to 0).
struct ChunkHolds {
    holds: Vec<Hold>,
    active: usize,
}

/// Chunks `first..=last` of the region at address `rp`.
type ChunkSpan = (usize, usize, usize);

enum Guards {
    Read(#[allow(dead_code)] Vec<OwnedReadGuard>),
    Write(#[allow(dead_code)] Vec<OwnedWriteGuard>),
}

/// What an accepted post reserves: the chunks it holds, the registrations it uses.
struct Claim {
    write: bool,
    spans: Vec<ChunkSpan>,
    regs: Vec<u64>,
}

struct Xfer {
    id: XferId,
    /// `None` for a transfer with no bytes (done at once).
    req: Option<XferReq>,
    peer: String,
    state: XferStatus,
    claim: Claim,
    guards: Vec<Guards>,
}

struct Peer {
    /// Region id → (base address, length, lock chunk size).
    regions: HashMap<RegionId, (u64, u64, u64)>,
    /// Where each region's bytes live (absent: host memory).
    memory: HashMap<RegionId, MemoryKind>,
    /// Lists of the peer's regions, prepped chunk by chunk on first use.
    prepped: HashMap<RegionId, Prep>,
    dead: bool,
}

/// A region's descriptor list prepped once, one entry per lock chunk: a post whose descriptors
/// are each one whole chunk on both sides (a fragmented allocation of blocks, one chunk per
/// block) then costs `make_xfer_req` with indices instead of `create_xfer_req`, which looks
/// every range up again (~0.5 µs per descriptor), as raw NIXL programs and vLLM do.
enum Prep {
    Untried,
    Ready(PreppedList),
    /// Too many chunks, or NIXL refused (e.g. a range the peer did not register): every post
    /// uses `create_xfer_req`, which reports the refusal properly.
    Unusable,
}

/// Whether [`NixlTransport::post_as`] posted.
enum Posted {
    Yes,
    /// A local chunk is held by another unreleased transfer of this agent; nothing claimed.
    Busy,
}

/// A post waiting for local chunks another transfer of this agent holds (see
/// [`NixlTransport::post_as`]); posted by the first status check after they are free.
#[derive(Clone)]
struct Deferred {
    op: XferOp,
    peer: String,
    descs: Vec<XferDesc>,
    notification: Option<Vec<u8>>,
    /// A status check is posting it right now (without the lock).
    retrying: bool,
}

/// A post's descriptors as chunk indices into one local and one remote region's prepped lists.
#[derive(Default)]
struct ChunkIndices {
    /// (local registration uid, remote region id).
    regions: Option<(u64, RegionId)>,
    local: Vec<c_int>,
    remote: Vec<c_int>,
}

/// Largest list prepped per region (a 4 KiB-chunk region of 1 GiB has 262,144 chunks).
const MAX_PREPPED_ENTRIES: usize = 1 << 18;

/// `(address, length)` of each chunk of `len` bytes at `base` in chunks of `chunk`, or `None` when
/// there are more than [`MAX_PREPPED_ENTRIES`].
fn chunk_grid(base: usize, len: usize, chunk: usize) -> Option<Vec<(usize, usize)>> {
    let n = len.div_ceil(chunk.max(1));
    if n == 0 || n > MAX_PREPPED_ENTRIES {
        return None;
    }
    Some(
        (0..n)
            .map(|i| (base + i * chunk, chunk.min(len - i * chunk)))
            .collect(),
    )
}

struct Inner {
    next_reg: u64,
    regs: HashMap<u64, Reg>,
    by_id: HashMap<RegionId, u64>,
    peers: HashMap<String, Peer>,
    next_xfer: u64,
    xfers: HashMap<XferId, Xfer>,
    /// Released by the user while NIXL could not abort them yet: retried on every call.
    zombies: Vec<Xfer>,
    /// Posts waiting for chunks held by this agent's other transfers.
    deferred: HashMap<XferId, Deferred>,
    held: HashMap<usize, ChunkHolds>,
    dead_pending: Vec<String>,
    /// Requests made from prepped lists (the rest went through `create_xfer_req`).
    made_from_prepped: u64,
    /// Posts cut into more descriptors to reach every pool thread (see [`Spread`]).
    spread_posts: u64,
    /// The device whose memory is registered, if any (one per transport, as one rank's KV
    /// lives on one device): its context is made current on every thread that calls NIXL.
    device: Option<Arc<dyn Device>>,
    /// Last field: dropped after everything that refers to it.
    agent: Agent,
}

impl Inner {
    fn new(agent: Agent) -> Self {
        Inner {
            next_reg: 0,
            regs: HashMap::new(),
            by_id: HashMap::new(),
            peers: HashMap::new(),
            next_xfer: 0,
            xfers: HashMap::new(),
            zombies: Vec::new(),
            deferred: HashMap::new(),
            held: HashMap::new(),
            dead_pending: Vec::new(),
            made_from_prepped: 0,
            spread_posts: 0,
            device: None,
            agent,
        }
    }

    /// After a failed NIXL call involving `peer`: is the peer dead? The C API reports a
    /// disconnect as a generic -2 and NIXL 1.5 keeps the dead peer's metadata, so this asks the
    /// connection itself with a probe notification, which fails at once on a disconnected
    /// endpoint (a live peer drops the probe in `drain_notifications`).
    fn check_peer(&mut self, peer: &str) -> bool {
        match self.peers.get(peer) {
            None => false,
            Some(p) if p.dead => true,
            Some(_) => match self.agent.gen_notif(peer, PROBE) {
                Ok(()) => false,
                Err(e) => {
                    tracing::info!(
                        agent = self.agent.name(),
                        peer,
                        "nixl: peer unreachable ({e})"
                    );
                    self.mark_dead(peer);
                    true
                }
            },
        }
    }

    fn mark_dead(&mut self, peer: &str) {
        if let Some(p) = self.peers.get_mut(peer) {
            if !p.dead {
                p.dead = true;
                // Prepped lists point into the metadata invalidated below: release them first.
                p.prepped.clear();
                self.dead_pending.push(peer.to_string());
                // Drop NIXL's connection and metadata, so a restarted peer can be loaded afresh.
                let _ = self.agent.invalidate_remote_md(peer);
            }
        }
    }

    /// Undoes a claim: chunk holds and registration users (deregistering retired ones).
    fn unclaim(&mut self, claim: &Claim) {
        for &(rp, first, last) in &claim.spans {
            let Some(ch) = self.held.get_mut(&rp) else {
                continue;
            };
            for h in ch.holds.get_mut(first..=last).into_iter().flatten() {
                let was = h.writer || h.readers > 0;
                if claim.write {
                    h.writer = false;
                } else {
                    h.readers = h.readers.saturating_sub(1);
                }
                if was && !h.writer && h.readers == 0 {
                    ch.active -= 1;
                }
            }
            if ch.active == 0 {
                self.held.remove(&rp);
            }
        }
        for uid in &claim.regs {
            let done = match self.regs.get_mut(uid) {
                Some(r) => {
                    r.users = r.users.saturating_sub(1);
                    r.retired && r.users == 0
                }
                None => false,
            };
            if done {
                self.drop_reg(*uid);
            }
        }
    }

    fn drop_reg(&mut self, uid: u64) {
        if let Some(reg) = self.regs.remove(&uid) {
            // The prepped list points into the registration: release it first.
            drop(reg.prepped);
            if let Some(nixl) = reg.nixl {
                if let Err(e) = self.agent.deregister(nixl) {
                    tracing::warn!("nixl: {e}");
                }
            }
        }
    }

    /// Ends a transfer: releases its request (handing it to the zombies if NIXL cannot abort
    /// it yet), then its locks and claims.
    fn finish(&mut self, mut x: Xfer) {
        if let Some(req) = x.req.take() {
            if let Err(req) = self.agent.release_xfer(req) {
                x.req = Some(req);
                self.zombies.push(x);
                return;
            }
        }
        x.guards.clear();
        self.unclaim(&x.claim);
    }

    /// A request made from the prepped lists of the two regions `ci` names (prepping them on
    /// first use), or `None` when either cannot be prepped: the caller then uses
    /// `create_xfer_req`.
    fn prepped_xfer(
        &mut self,
        op: XferOp,
        peer: &str,
        ci: &ChunkIndices,
        (local_mem, remote_mem): (MemoryKind, MemoryKind),
        notification: Option<&[u8]>,
    ) -> Option<Result<XferReq, CallError>> {
        let (uid, remote_region) = ci.regions?;
        let agent = &self.agent;
        let reg = self.regs.get_mut(&uid)?;
        if matches!(reg.prepped, Prep::Untried) {
            let r = &reg.region;
            reg.prepped = chunk_grid(r.base_addr(), r.len(), r.chunk_size())
                .and_then(|grid| agent.prep_list(None, local_mem, &grid).ok())
                .map_or(Prep::Unusable, Prep::Ready);
        }
        let Prep::Ready(local) = &reg.prepped else {
            return None;
        };
        let p = self.peers.get_mut(peer)?;
        let &(addr, len, chunk) = p.regions.get(&remote_region)?;
        let remote = p.prepped.entry(remote_region).or_insert_with(|| {
            let grid = usize::try_from(addr).ok().and_then(|a| {
                chunk_grid(a, usize::try_from(len).ok()?, usize::try_from(chunk).ok()?)
            });
            grid.and_then(|g| agent.prep_list(Some(peer), remote_mem, &g).ok())
                .map_or(Prep::Unusable, Prep::Ready)
        });
        let Prep::Ready(remote) = remote else {
            return None;
        };
        let made = agent.make_xfer(op, local, &ci.local, remote, &ci.remote, notification);
        if made.is_ok() {
            self.made_from_prepped += 1;
        }
        Some(made)
    }

    fn reap_zombies(&mut self) {
        if self.zombies.is_empty() {
            return;
        }
        for x in std::mem::take(&mut self.zombies) {
            self.finish(x);
        }
    }

    /// Checks every transfer still in progress. Besides updating their state, this is what
    /// sends their notifications: NIXL's UCX backend defers the notification of a transfer that
    /// was not done at post time to the initiator's next status check of it.
    fn progress_all(&mut self) {
        let pending: Vec<XferId> = self
            .xfers
            .iter()
            .filter(|(_, x)| x.state == XferStatus::InProgress)
            .map(|(id, _)| *id)
            .collect();
        for id in pending {
            let _ = self.status_of(id);
        }
    }

    fn status_of(&mut self, id: XferId) -> Result<XferStatus, TransportError> {
        let x = self
            .xfers
            .get_mut(&id)
            .ok_or(TransportError::UnknownXfer(id))?;
        if x.state != XferStatus::InProgress {
            return Ok(x.state.clone());
        }
        let Some(req) = &x.req else {
            x.state = XferStatus::Done;
            return Ok(XferStatus::Done);
        };
        let st = self.agent.xfer_status(req);
        let state = match st {
            sys::SUCCESS => XferStatus::Done,
            sys::IN_PROG => XferStatus::InProgress,
            _ => {
                let peer = x.peer.clone();
                let dead = self.check_peer(&peer);
                XferStatus::Failed(if dead {
                    format!("peer {peer:?} disconnected (nixl_capi_get_xfer_status returned {st})")
                } else {
                    format!("nixl_capi_get_xfer_status returned {st}")
                })
            }
        };
        if let Some(x) = self.xfers.get_mut(&id) {
            x.state = state.clone();
        }
        Ok(state)
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        // Order: transfers (released, waiting a little for NIXL to let go of the running ones),
        // then registrations, then the agent (its own Drop: notification map, backend, agent).
        let mut all: Vec<Xfer> = self.xfers.drain().map(|(_, x)| x).collect();
        all.append(&mut self.zombies);
        for x in all {
            self.finish(x);
        }
        let deadline = Instant::now() + Duration::from_secs(2);
        while !self.zombies.is_empty() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(1));
            self.reap_zombies();
        }
        for x in std::mem::take(&mut self.zombies) {
            // NIXL still runs it: leak the request and keep its chunks locked forever rather than
            // let Rust touch memory a DMA may still write.
            tracing::warn!(
                peer = x.peer,
                "nixl: leaking a transfer NIXL could not abort"
            );
            std::mem::forget(x);
        }
        let uids: Vec<u64> = self.regs.keys().copied().collect();
        for uid in uids {
            if self.regs[&uid].users == 0 {
                self.drop_reg(uid);
            } else if let Some(reg) = self.regs.remove(&uid) {
                // Used by a leaked transfer: stays registered (the memory is never freed).
                std::mem::forget(reg);
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The transport.

fn nixl_err(e: CallError) -> TransportError {
    TransportError::Io(e.to_string())
}

fn to_usize(v: u64) -> Result<usize, TransportError> {
    usize::try_from(v).map_err(|_| TransportError::Io(format!("{v} does not fit in usize")))
}

/// Local chunks a post touches, per region, merged: (region, first chunk, last chunk).
/// Sorts `(region index, first chunk, last chunk)` spans and merges overlapping or adjacent
/// ones of the same region.
fn chunk_spans(spans: &mut [(usize, usize, usize)]) -> Vec<(usize, usize, usize)> {
    spans.sort_unstable();
    let mut out: Vec<(usize, usize, usize)> = Vec::new();
    for &(r, first, last) in spans.iter() {
        if let Some((pr, _, plast)) = out.last_mut() {
            if *pr == r && first <= *plast + 1 {
                *plast = (*plast).max(last);
                continue;
            }
        }
        out.push((r, first, last));
    }
    out
}

impl Transport for NixlTransport {
    fn name(&self) -> &str {
        &self.name
    }

    fn backend(&self) -> &'static str {
        BACKEND
    }

    fn register(&self, id: RegionId, region: Arc<KvRegion>) -> Result<(), TransportError> {
        let mut g = self.lock();
        if g.by_id.contains_key(&id) {
            return Err(TransportError::AlreadyRegistered(id));
        }
        if let Some(device) = region.device() {
            if let Some(d) = g.device.as_ref().filter(|d| d.memory() != device.memory()) {
                return Err(TransportError::Io(format!(
                    "region {id} is {}, and this NIXL agent registered {} already: one agent \
                     moves one device's memory (one rank's KV lives on one device)",
                    region.memory(),
                    d.memory()
                )));
            }
            // Before NIXL sees the region: UCX looks the range up in the current context.
            device.make_current()?;
        }
        let nixl = if region.is_empty() {
            None
        } else {
            Some(g.agent.register(region.clone()).map_err(|e| {
                if region.device().is_some() {
                    TransportError::Io(format!(
                        "NIXL did not register {} as VRAM ({e}): its backend needs CUDA \
                         support (UCX built with CUDA, a driver, the device visible)",
                        region.memory()
                    ))
                } else {
                    nixl_err(e)
                }
            })?)
        };
        if let Some(device) = region.device() {
            g.device.get_or_insert_with(|| device.clone());
        }
        let uid = g.next_reg;
        g.next_reg += 1;
        g.regs.insert(
            uid,
            Reg {
                prepped: Prep::Untried,
                nixl,
                region,
                users: 0,
                retired: false,
            },
        );
        g.by_id.insert(id, uid);
        Ok(())
    }

    fn deregister(&self, id: RegionId) -> Result<(), TransportError> {
        let mut g = self.lock();
        let uid = g
            .by_id
            .remove(&id)
            .ok_or(TransportError::UnknownRegion { region: id })?;
        let in_use = match g.regs.get_mut(&uid) {
            Some(r) => {
                r.retired = true;
                r.users > 0
            }
            None => false,
        };
        if !in_use {
            g.drop_reg(uid);
        }
        Ok(())
    }

    fn local_metadata(&self) -> Result<Vec<u8>, TransportError> {
        let g = self.lock();
        let nixl = g.agent.local_md().map_err(nixl_err)?;
        let mut regions: Vec<(RegionId, u64, u64, u64)> = g
            .by_id
            .iter()
            .map(|(&id, uid)| {
                let r = &g.regs[uid].region;
                (
                    id,
                    r.base_addr() as u64,
                    r.len() as u64,
                    r.chunk_size() as u64,
                )
            })
            .collect();
        regions.sort_unstable();
        let mut devices: Vec<(RegionId, MemoryKind)> = g
            .by_id
            .iter()
            .map(|(&id, uid)| (id, g.regs[uid].region.memory()))
            .filter(|(_, m)| *m != MemoryKind::Host)
            .collect();
        devices.sort_unstable_by_key(|(id, _)| *id);
        encode_md(&MdBody {
            name: self.name.clone(),
            regions,
            nixl,
            devices,
        })
    }

    fn load_remote(&self, metadata: &[u8]) -> Result<String, TransportError> {
        let body = decode_md(metadata)?;
        if body.name == self.name {
            return Err(TransportError::BadMetadata(format!(
                "metadata of this agent itself ({:?})",
                self.name
            )));
        }
        let mut g = self.lock();
        g.reap_zombies();
        // Loading replaces what NIXL holds for the peer; lists prepped against the old metadata
        // are released first (and, below, those of whichever agent NIXL says it loaded).
        if let Some(p) = g.peers.get_mut(&body.name) {
            p.prepped.clear();
        }
        let loaded = g.agent.load_remote_md(&body.nixl);
        if let Ok(name) = &loaded {
            if let Some(p) = g.peers.get_mut(name) {
                p.prepped.clear();
            }
        }
        let name = match loaded {
            Ok(name) => name,
            Err(e) => {
                // A failed load may have dropped what NIXL held for that peer.
                if g.peers.contains_key(&body.name)
                    && !g.agent.has_remote_md(&body.name).unwrap_or(false)
                {
                    g.peers.remove(&body.name);
                }
                return Err(TransportError::BadMetadata(format!(
                    "NIXL refused the agent metadata of {:?}: {e}",
                    body.name
                )));
            }
        };
        if name != body.name {
            // Leave a peer we already knew loaded; forget one this call introduced.
            if !g.peers.contains_key(&name) {
                let _ = g.agent.invalidate_remote_md(&name);
            }
            return Err(TransportError::BadMetadata(format!(
                "header names agent {:?} but NIXL's metadata names {name:?}",
                body.name
            )));
        }
        // A death reported but not yet drained stays reported: it was the old incarnation.
        g.peers.insert(
            name.clone(),
            Peer {
                regions: body
                    .regions
                    .iter()
                    .map(|&(id, addr, len, chunk)| (id, (addr, len, chunk)))
                    .collect(),
                memory: body.devices.iter().copied().collect(),
                prepped: HashMap::new(),
                dead: false,
            },
        );
        Ok(name)
    }

    fn forget_remote(&self, peer: &str) {
        let mut g = self.lock();
        if g.peers.remove(peer).is_some() {
            let _ = g.agent.invalidate_remote_md(peer);
        }
        g.dead_pending.retain(|p| p != peer);
    }

    fn post(
        &self,
        op: XferOp,
        peer: &str,
        descs: &[XferDesc],
        notification: Option<&[u8]>,
    ) -> Result<XferId, TransportError> {
        let id = {
            let mut g = self.lock();
            let id = XferId(g.next_xfer);
            g.next_xfer += 1;
            id
        };
        if let Posted::Busy = self.post_as(id, op, peer, descs, notification)? {
            self.lock().deferred.insert(
                id,
                Deferred {
                    op,
                    peer: peer.to_string(),
                    descs: descs.to_vec(),
                    notification: notification.map(<[u8]>::to_vec),
                    retrying: false,
                },
            );
        }
        Ok(id)
    }

    fn status(&self, id: XferId) -> Result<XferStatus, TransportError> {
        if let Some(state) = self.retry_deferred(id) {
            return Ok(state);
        }
        let mut g = self.lock();
        g.reap_zombies();
        g.status_of(id)
    }

    fn release(&self, id: XferId) -> Result<(), TransportError> {
        let mut g = self.lock();
        if g.deferred.remove(&id).is_some() {
            // Never posted: nothing of NIXL's to release.
            return Ok(());
        }
        let x = g.xfers.remove(&id).ok_or(TransportError::UnknownXfer(id))?;
        g.finish(x);
        g.reap_zombies();
        Ok(())
    }

    fn still_running(&self, id: XferId) -> bool {
        let mut g = self.lock();
        g.reap_zombies();
        g.zombies.iter().any(|x| x.id == id)
    }

    fn send_notification(&self, peer: &str, msg: &[u8]) -> Result<(), TransportError> {
        if msg.len() > MAX_NOTIFICATION_BYTES {
            return Err(TransportError::NotificationTooLarge {
                len: msg.len(),
                max: MAX_NOTIFICATION_BYTES,
            });
        }
        let mut g = self.lock();
        match g.peers.get(peer) {
            None => return Err(TransportError::UnknownPeer(peer.to_string())),
            Some(p) if p.dead => return Err(TransportError::PeerDead(peer.to_string())),
            Some(_) => {}
        }
        match g.agent.gen_notif(peer, msg) {
            Ok(()) => Ok(()),
            Err(e) => {
                // With the peer's metadata loaded, a notification fails only when the connection
                // does (NIXL_ERR_REMOTE_DISCONNECT, folded into -2).
                tracing::info!(peer, "nixl: {e}; the peer is gone");
                g.mark_dead(peer);
                Err(TransportError::PeerDead(peer.to_string()))
            }
        }
    }

    fn drain_notifications(&self) -> Vec<Notification> {
        let mut g = self.lock();
        g.progress_all();
        let mut out = Vec::new();
        if let Err(e) = g.agent.take_notifications(&mut out) {
            tracing::debug!("nixl: {e}");
        }
        out.retain(|n| n.msg != PROBE);
        out
    }

    fn drain_dead_peers(&self) -> Vec<String> {
        let mut g = self.lock();
        g.reap_zombies();
        g.progress_all();
        std::mem::take(&mut g.dead_pending)
    }
}
