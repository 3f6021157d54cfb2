//! Measurements: one transfer through a transport, and each baseline (raw TCP, memcpy, raw
//! NIXL) run on the same cases and memory, repetitions interleaved with the backend's.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::bail;
use handoff_transport::conformance::to_hex;
use handoff_transport::nixl::{raw, NixlConfig, NixlTransport};
use handoff_transport::{KvRegion, RegionId, Transport, XferDesc, XferOp, XferStatus};

use super::cases::{fill, fill_slice, hash_ranges, local_hash, Case};
use super::peer::{open_transport, Peer};
use super::{local_host, TransferArgs, POLL_US, XFER_DEADLINE};

/// One transfer through a transport, from post to done and released.
fn time_xfer(t: &dyn Transport, peer: &str, op: XferOp, descs: &[XferDesc]) -> anyhow::Result<f64> {
    let poll = Duration::from_micros(POLL_US.load(std::sync::atomic::Ordering::Relaxed));
    let t0 = Instant::now();
    let id = t.post(op, peer, descs, None)?;
    loop {
        match t.status(id)? {
            XferStatus::Done => break,
            XferStatus::InProgress if t0.elapsed() < XFER_DEADLINE => std::thread::sleep(poll),
            XferStatus::InProgress => bail!("transfer still in progress after {XFER_DEADLINE:?}"),
            XferStatus::Failed(e) => bail!("transfer failed: {e}"),
        }
    }
    t.release(id)?;
    Ok(t0.elapsed().as_secs_f64())
}

/// Raw TCP, initiator side (see [`serve_raw_tcp`]).
fn raw_tcp_xfer(
    s: &mut TcpStream,
    idx: usize,
    case: &Case,
    op: XferOp,
    local: &KvRegion,
) -> anyhow::Result<f64> {
    let t0 = Instant::now();
    let read = op == XferOp::Read;
    for (stage, descs) in case.stage_descs().enumerate() {
        s.write_all(&[u8::from(!read), idx as u8, stage as u8])?;
        for d in descs {
            let (off, len) = (d.local_offset as usize, d.len as usize);
            if read {
                local.with_span_mut(off, len, |p| s.read_exact(p))??;
            } else {
                local.with_span(off, len, |p| s.write_all(p))??;
            }
        }
        if !read {
            let mut ack = [0u8; 1];
            s.read_exact(&mut ack)?;
        }
    }
    Ok(t0.elapsed().as_secs_f64())
}

/// The two-process runs: the peer process, this side's transport and regions.
pub(super) struct TwoProc<'a> {
    pub(super) peer: Peer,
    pub(super) t: Arc<dyn Transport>,
    pub(super) peer_name: String,
    pub(super) local: &'a [Arc<KvRegion>],
    pub(super) seed: u64,
}

impl<'a> TwoProc<'a> {
    pub(super) fn start(
        backend: &str,
        args: &TransferArgs,
        cfg: &NixlConfig,
        local: &'a [Arc<KvRegion>],
    ) -> anyhow::Result<Self> {
        let peer = Peer::spawn(backend, args.total_mib, cfg.progress_delay_us)?;
        let name = format!("bench-{backend}-{}", std::process::id());
        let t = open_transport(backend, &name, cfg, local_host())?;
        for (i, r) in local.iter().enumerate() {
            t.register(i as RegionId, r.clone())?;
        }
        let peer_name = t.load_remote(&peer.md)?;
        let mut tp = TwoProc {
            peer,
            t,
            peer_name,
            local,
            seed: 1,
        };
        let md = tp.t.local_metadata()?;
        tp.peer.cmd(&format!("LOAD {}", to_hex(&md)))?;
        Ok(tp)
    }

    /// Fresh bytes on this side, so the warm-up's check proves the bytes moved.
    fn refill(&mut self, case: &Case) -> anyhow::Result<()> {
        self.seed += 1;
        fill(&self.local[case.class], self.seed)
    }

    pub(super) fn check(&mut self, idx: usize, case: &Case, what: &str) -> anyhow::Result<()> {
        let mine = local_hash(&self.local[case.class], case)?;
        if mine != self.peer.hash(idx)? {
            bail!("{what} {}: the bytes differ after the warm-up", case.label);
        }
        Ok(())
    }

    pub(super) fn xfer(&self, case: &Case, op: XferOp) -> anyhow::Result<f64> {
        case.stage_descs()
            .map(|descs| time_xfer(&*self.t, &self.peer_name, op, descs))
            .sum()
    }

    pub(super) fn warm(&mut self, idx: usize, case: &Case, op: XferOp) -> anyhow::Result<()> {
        self.refill(case)?;
        self.xfer(case, op)?;
        self.check(idx, case, self.t.backend())
    }

    pub(super) fn raw_tcp(
        &self,
        s: &mut TcpStream,
        idx: usize,
        case: &Case,
        op: XferOp,
    ) -> anyhow::Result<f64> {
        raw_tcp_xfer(s, idx, case, op, &self.local[case.class])
    }

    pub(super) fn warm_raw_tcp(
        &mut self,
        s: &mut TcpStream,
        idx: usize,
        case: &Case,
        op: XferOp,
    ) -> anyhow::Result<()> {
        self.refill(case)?;
        self.raw_tcp(s, idx, case, op)?;
        self.check(idx, case, "raw tcp")
    }
}

/// Single-thread memcpy of a case's blocks between two buffers of this process.
pub(super) struct Memcpy {
    pub(super) src: Vec<u8>,
    pub(super) dst: Vec<u8>,
}

impl Memcpy {
    pub(super) fn new(len: usize) -> Memcpy {
        let (mut src, mut dst) = (vec![0u8; len], vec![0u8; len]);
        fill_slice(&mut src, 3);
        fill_slice(&mut dst, 4);
        Memcpy { src, dst }
    }

    pub(super) fn once(&mut self, case: &Case) -> f64 {
        let t0 = Instant::now();
        for d in &case.descs {
            let (l, r, n) = (
                d.local_offset as usize,
                d.remote_offset as usize,
                d.len as usize,
            );
            self.dst[l..l + n].copy_from_slice(&self.src[r..r + n]);
        }
        std::hint::black_box(&mut self.dst);
        t0.elapsed().as_secs_f64()
    }
}

/// Runs `a` and `b` alternately (ABBA...), `reps` times each, so that a slow drift of the host
/// weighs on both alike.
pub(super) fn interleaved(
    reps: usize,
    mut a: impl FnMut() -> anyhow::Result<f64>,
    mut b: impl FnMut() -> anyhow::Result<f64>,
) -> anyhow::Result<(Vec<f64>, Vec<f64>)> {
    let (mut sa, mut sb) = (Vec::with_capacity(reps), Vec::with_capacity(reps));
    for rep in 0..reps {
        if rep % 2 == 0 {
            sa.push(a()?);
            sb.push(b()?);
        } else {
            sb.push(b()?);
            sa.push(a()?);
        }
    }
    Ok((sa, sb))
}

/// The nixl transport the way raw NIXL runs: two transports of this process, raw's block
/// mapping, ready to time one transfer at a time (so its repetitions interleave with raw's).
pub(super) struct NixlInProcess {
    pub(super) a: Arc<NixlTransport>,
    // Kept alive: the peer of `a`.
    pub(super) _b: Arc<NixlTransport>,
    pub(super) b_name: String,
    pub(super) descs: Vec<XferDesc>,
    pub(super) op: XferOp,
    /// Posts per repetition (the same descriptors each time, as raw's iterations).
    pub(super) stages: usize,
}

impl NixlInProcess {
    /// Sets both transports up and runs one untimed transfer whose bytes are checked.
    pub(super) fn new(
        cfg: &NixlConfig,
        case: &Case,
        regions: &(Arc<KvRegion>, Arc<KvRegion>),
        op: XferOp,
        seed: &mut u64,
    ) -> anyhow::Result<Self> {
        let pid = std::process::id();
        *seed += 1;
        let a = NixlTransport::open(&format!("bench-ia-{pid}-{seed}"), cfg.clone())?;
        let b = NixlTransport::open(&format!("bench-ib-{pid}-{seed}"), cfg.clone())?;
        a.register(0, regions.0.clone())?;
        b.register(0, regions.1.clone())?;
        let b_name = a.load_remote(&b.local_metadata()?)?;
        b.load_remote(&a.local_metadata()?)?;
        let (block, blocks) = case.raw;
        let descs: Vec<XferDesc> = raw::scattered_pairs(blocks, block)
            .into_iter()
            .map(|(l, r)| XferDesc {
                local_region: 0,
                local_offset: l,
                remote_region: 0,
                remote_offset: r,
                len: block as u64,
            })
            .collect();
        // Fresh bytes at the source only: the destination still holds older ones, so the check
        // below proves the bytes moved.
        let src = if op == XferOp::Read {
            &regions.1
        } else {
            &regions.0
        };
        fill(src, *seed)?;
        time_xfer(&*a, &b_name, op, &descs)?;
        let mine = hash_ranges(&regions.0, descs.iter().map(|d| (d.local_offset, d.len)))?;
        let theirs = hash_ranges(&regions.1, descs.iter().map(|d| (d.remote_offset, d.len)))?;
        if mine != theirs {
            bail!(
                "nixl (one process) {}: bytes differ after the warm-up",
                case.label
            );
        }
        Ok(NixlInProcess {
            a,
            _b: b,
            b_name,
            descs,
            op,
            stages: case.stages.max(1),
        })
    }

    pub(super) fn once(&self) -> anyhow::Result<f64> {
        (0..self.stages)
            .map(|_| time_xfer(&*self.a, &self.b_name, self.op, &self.descs))
            .sum()
    }
}
