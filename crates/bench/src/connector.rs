//! Connector core scaling: the cost of carrying one request through a P core and a D core (P
//! creates the handoff, D tracks the request, its first heartbeat is granted, D admits it, its
//! READ is posted and lands, P learns it was read and frees the blocks) and of an idle timeout,
//! with N other handoffs in flight on both cores. The two `ConnectorCore`s run in this process;
//! their side channel and workers are this benchmark's loops, so only the core's own work is
//! timed. The baseline is the same measurement at the smallest N, in the same run.
//!
//! It also prices the KV digest (`handoff_connector::digest`) a worker computes on each side of
//! a checked pull: one 2048-token handoff of an 8-layer model (64 MiB), digested by rows and as
//! whole blocks, against a memcpy of the same bytes (one thread), interleaved in this process.

use std::hint::black_box;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use handoff_connector::{
    Answer, ConnectorCore, ConnectorEvent, CoreConfig, Input, Ready, Role, WorkerHello, WorkerOp,
    WorkerReport,
};
use handoff_ledger::{ConsumerConfig, ProducerConfig};
use handoff_plan::testing::tiny_spec;
use handoff_plan::{BlockLayout, KvGroups, KvSpec, ModelShape, RankLayout};
use handoff_proto::{HandoffId, KvTransferParams, Message, TransferMode};
use serde::Serialize;

/// Requests per sample.
const BATCH: usize = 500;
const SAMPLES: usize = 7;
const P_CONN: u64 = 1;
const D_CONN: u64 = 2;

#[derive(Debug, Clone, Serialize)]
struct SizeResult {
    handoffs: usize,
    /// Nanoseconds per request carried through both cores, median of the samples.
    request_ns: f64,
    /// Nanoseconds per timeout call on both cores when nothing is due.
    idle_tick_ns: f64,
    /// Inputs both cores took per request (hooks, frames, worker reports, timeouts).
    inputs_per_request: f64,
    /// `request_ns` over `inputs_per_request`: what one `ConnectorCore::handle` costs.
    input_ns: f64,
}

#[derive(Serialize)]
struct Report {
    bench: &'static str,
    sizes: Vec<SizeResult>,
    step_scaling_ratio: f64,
    tick_scaling_ratio: f64,
    step_scaling_limit: f64,
    digest: DigestCost,
}

#[derive(Debug, Clone, Serialize)]
struct DigestCost {
    handoff_bytes: u64,
    memcpy_ms: f64,
    digest_rows_ms: f64,
    digest_whole_blocks_ms: f64,
    /// Digest time over memcpy time (rows: the layout handoff's own engine and FlashAttention
    /// use).
    digest_vs_memcpy: f64,
}

/// Times the KV digest of one handoff against a memcpy of its bytes (medians, interleaved).
fn digest_cost() -> anyhow::Result<DigestCost> {
    use handoff_connector::digest::{rank_digest, DigestOf};
    use handoff_transport::KvRegion;
    use std::sync::Arc;
    let spec = KvSpec {
        shape: ModelShape {
            num_layers: 8,
            num_kv_heads: 8,
            head_dim: 128,
            dtype_size: 2,
        },
        tp: 1,
        block_size: 16,
        block_layout: BlockLayout::HeadMajor,
    };
    let tokens = 2048u32;
    let blocks: Vec<u32> = (0..tokens / spec.block_size).collect();
    let layout = RankLayout::per_layer(spec, 0, blocks.len() as u32, 0)?;
    let regions: Vec<(u32, Arc<KvRegion>)> = layout
        .regions
        .iter()
        .map(|r| (r.id, Arc::new(KvRegion::new(r.len as usize, 1 << 20))))
        .collect();
    let total: u64 = layout.regions.iter().map(|r| r.len).sum();
    for (i, (_, r)) in regions.iter().enumerate() {
        let fill: Vec<u8> = (0..r.len()).map(|b| (b * 31 + i) as u8).collect();
        r.write(0, &fill)?;
    }
    let src: Vec<u8> = vec![7; total as usize];
    let mut dst: Vec<u8> = vec![0; total as usize];
    let (mut copy, mut rows, mut whole) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..SAMPLES {
        let t = Instant::now();
        dst.copy_from_slice(black_box(&src));
        black_box(&dst);
        copy.push(t.elapsed().as_secs_f64() * 1e3);
        for (whole_blocks, out) in [(false, &mut rows), (true, &mut whole)] {
            let of = DigestOf {
                num_tokens: tokens,
                whole_blocks,
            };
            let t = Instant::now();
            black_box(rank_digest(
                &layout,
                &KvGroups::single(),
                &regions,
                &blocks,
                of,
            )?);
            out.push(t.elapsed().as_secs_f64() * 1e3);
        }
    }
    let (memcpy_ms, digest_rows_ms) = (median(copy), median(rows));
    Ok(DigestCost {
        handoff_bytes: total,
        memcpy_ms,
        digest_rows_ms,
        digest_whole_blocks_ms: median(whole),
        digest_vs_memcpy: digest_rows_ms / memcpy_ms,
    })
}

fn spec() -> KvSpec {
    tiny_spec(2)
}

fn core(engine: &str, role: Role, blocks: u32) -> anyhow::Result<ConnectorCore> {
    // Leases and heartbeats long enough that nothing expires or ticks while we measure.
    let producer = ProducerConfig {
        initial_lease: Duration::from_secs(3600),
        hard_cap: Duration::from_secs(7200),
        heartbeat_extension: Duration::from_secs(3600),
        tombstone_capacity: 4096,
        ..Default::default()
    };
    let consumer = ConsumerConfig {
        wait_deadline: Duration::from_secs(3600),
        heartbeat_interval: Duration::from_secs(3600),
        read_timeout: Duration::from_secs(3600),
        tombstone_capacity: 4096,
        ..Default::default()
    };
    let layout = RankLayout::cross_layer(spec(), 0, blocks, 0)?;
    ConnectorCore::new(
        CoreConfig {
            engine_id: engine.into(),
            role,
            mode: TransferMode::Pull,
            model: "bench".into(),
            dtype: "bf16".into(),
            advertise_host: "127.0.0.1".into(),
            side_channel_port: 1,
            producer,
            consumer,
            opaque_blocks: false,
            kv_digest: false,
            peer_hosts: Vec::new(),
            protocol_version: handoff_proto::PROTOCOL_VERSION,
            layerwise_pull: false,
            layer_reports: Default::default(),
        },
        vec![WorkerHello {
            rank: 0,
            layout,
            agent: format!("{engine}-r0"),
            metadata: vec![],
            memory: Default::default(),
            groups: Default::default(),
        }],
    )
    .context("core")
}

fn id(n: u64) -> HandoffId {
    HandoffId::from_bytes(
        (n as u128)
            .wrapping_mul(0x9e37_79b9_7f4a_7c15_f39c_c060_5ced_c835)
            .to_le_bytes(),
    )
}

/// A core and the number of inputs it was given (the cost per input is the cost per request
/// over the inputs a request takes).
struct Core {
    core: ConnectorCore,
    inputs: u64,
}

impl Core {
    /// An input the bench expects the core to take (timeouts, frames, reports never fail).
    fn input(&mut self, input: Input, now: Duration) {
        if let Err(e) = self.try_input(input, now) {
            tracing::error!(error = %e, "the core refused a bench input");
        }
    }

    fn try_input(&mut self, input: Input, now: Duration) -> anyhow::Result<Answer> {
        self.inputs += 1;
        Ok(self.core.handle(input, now)?)
    }

    fn prefill(
        &mut self,
        n: u64,
        blocks: Vec<u32>,
        now: Duration,
    ) -> anyhow::Result<KvTransferParams> {
        // The engine's two events of a pull's prefill: started, then ended.
        self.try_input(
            Input::PrefillStarted {
                request_id: "r".into(),
                params: KvTransferParams::for_prefill_leg(),
                handoff: id(n),
                blocks,
                num_tokens: 16,
            },
            now,
        )?;
        let ended = Input::PrefillEnded {
            request_id: "r".into(),
            outcome: handoff_core::PrefillOutcome::Finished,
        };
        match self.try_input(ended, now)? {
            Answer::Ended {
                params: Some(p), ..
            } => Ok(*p),
            other => bail!("P answered a prefill with {other:?}"),
        }
    }

    fn arrive(&mut self, n: u64, params: KvTransferParams, now: Duration) -> anyhow::Result<()> {
        self.try_input(
            Input::RequestArrived {
                request: n,
                params,
                prompt_tokens: 16,
            },
            now,
        )?;
        Ok(())
    }

    fn ready(&mut self) -> Ready {
        self.core.ready()
    }

    fn advance(&mut self, r: Ready) {
        self.core.advance(r)
    }

    fn poll_timeout(&self) -> Option<Duration> {
        self.core.poll_timeout()
    }
}

/// The two cores and what travels between them.
struct Pair {
    p: Core,
    d: Core,
    ready_on_d: usize,
    freed_on_p: usize,
}

impl Pair {
    /// Carries out both cores' batches until neither has anything left: messages cross, D's
    /// READs land at once and their completions reach P as notifications.
    fn settle(&mut self, now: Duration) {
        loop {
            // What the executor does: timers due now (a new request's first heartbeat is one).
            for core in [&mut self.p, &mut self.d] {
                if core.poll_timeout().is_some_and(|t| t <= now) {
                    core.input(Input::Timeout, now);
                }
            }
            let mut moved = false;
            let rp = self.p.ready();
            moved |= !rp.is_empty();
            let to_d: Vec<Message> = self.carry(&rp, true);
            // P's worker puts each grant in force at once (P names blocks only after that).
            let granted: Vec<_> = rp
                .worker_ops
                .iter()
                .filter_map(|(_, op)| match op {
                    WorkerOp::Grant { grant, .. } => Some((*grant, true)),
                    _ => None,
                })
                .collect();
            self.p.advance(rp);
            if !granted.is_empty() {
                self.p.input(
                    Input::WorkerReport(WorkerReport {
                        rank: 0,
                        granted,
                        ..Default::default()
                    }),
                    now,
                );
            }
            for m in to_d {
                self.d.input(
                    Input::Frame {
                        conn: D_CONN,
                        msg: m,
                    },
                    now,
                );
            }
            let rd = self.d.ready();
            moved |= !rd.is_empty();
            let mut notes = Vec::new();
            let mut ended = Vec::new();
            for (_, job) in &rd.transfers_to_post {
                ended.push((job.job, true));
                for part in &job.parts {
                    if let Some(n) = &part.notification {
                        notes.push(("d-r0".to_string(), n.clone()));
                    }
                }
            }
            let to_p = self.carry(&rd, false);
            self.d.advance(rd);
            for m in to_p {
                self.p.input(
                    Input::Frame {
                        conn: P_CONN,
                        msg: m,
                    },
                    now,
                );
            }
            if !ended.is_empty() {
                self.d.input(
                    Input::WorkerReport(WorkerReport {
                        rank: 0,
                        ended,
                        ..Default::default()
                    }),
                    now,
                );
            }
            if !notes.is_empty() {
                self.p.input(
                    Input::WorkerReport(WorkerReport {
                        rank: 0,
                        notifications: notes,
                        ..Default::default()
                    }),
                    now,
                );
            }
            if !moved {
                break;
            }
        }
    }

    fn carry(&mut self, r: &Ready, from_p: bool) -> Vec<Message> {
        for ev in &r.events {
            match ev {
                ConnectorEvent::Ready { .. } => self.ready_on_d += 1,
                ConnectorEvent::BlocksReleased { .. } if from_p => self.freed_on_p += 1,
                _ => {}
            }
        }
        r.messages.iter().map(|(_, m)| m.clone()).collect()
    }

    /// Opens the side channel: D dials P, P accepts, D gets the reply.
    fn connect(&mut self, now: Duration) -> anyhow::Result<()> {
        let rd = self.d.ready();
        let hello = rd.connects.first().map(|c| c.hello.clone());
        self.d.advance(rd);
        let hello = hello.context("D did not dial P")?;
        self.p.input(
            Input::Accepted {
                conn: P_CONN,
                msg: hello,
                proven: None,
            },
            now,
        );
        let rp = self.p.ready();
        let reply = rp.messages.first().map(|(_, m)| m.clone());
        self.p.advance(rp);
        let reply = reply.context("P did not answer")?;
        self.d.input(
            Input::Connected {
                engine: "p".into(),
                attempt: 1,
                conn: D_CONN,
                reply,
            },
            now,
        );
        // The agent loads are the workers' business; nothing to do here.
        let rd = self.d.ready();
        let loads = rd
            .worker_ops
            .iter()
            .filter(|(_, op)| matches!(op, WorkerOp::LoadRemote { .. }))
            .count();
        let msgs: Vec<Message> = rd.messages.iter().map(|(_, m)| m.clone()).collect();
        self.d.advance(rd);
        if loads == 0 {
            bail!("D loaded no agent of P");
        }
        for m in msgs {
            self.p.input(
                Input::Frame {
                    conn: P_CONN,
                    msg: m,
                },
                now,
            );
        }
        Ok(())
    }

    /// One request through both cores.
    fn request(&mut self, n: u64, now: Duration) -> anyhow::Result<()> {
        let block = (n % 1000) as u32;
        let params = self.p.prefill(n, vec![block], now)?;
        self.d.arrive(n, params, now)?;
        self.settle(now);
        self.d.try_input(
            Input::BlocksAllocated {
                request: n,
                cached: Vec::new(),
                blocks: vec![block],
            },
            now,
        )?;
        self.settle(now);
        Ok(())
    }
}

fn measure(n: usize) -> anyhow::Result<SizeResult> {
    let mut pair = Pair {
        p: Core {
            core: core("p", Role::Prefill, 1000)?,
            inputs: 0,
        },
        d: Core {
            core: core("d", Role::Decode, 1000)?,
            inputs: 0,
        },
        ready_on_d: 0,
        freed_on_p: 0,
    };
    let now = Duration::from_secs(1);
    // N handoffs in flight: created on P, tracked on D, waiting for admission.
    let params = pair.p.prefill(0, vec![0], now)?;
    pair.d.arrive(0, params, now)?;
    pair.connect(now)?;
    for i in 1..n as u64 {
        let params = pair.p.prefill(i, vec![0], now)?;
        pair.d.arrive(i, params, now)?;
    }
    pair.settle(now);
    let mut next = n as u64;
    let (mut req, mut tick) = (Vec::new(), Vec::new());
    let mut inputs_per_request = 0.0;
    for s in 0..SAMPLES {
        let t = now + Duration::from_millis(s as u64 + 1);
        let before = pair.ready_on_d;
        let inputs_before = pair.p.inputs + pair.d.inputs;
        let start = Instant::now();
        for k in 0..BATCH as u64 {
            pair.request(next + k, t)?;
        }
        req.push(start.elapsed().as_nanos() as f64 / BATCH as f64);
        inputs_per_request = (pair.p.inputs + pair.d.inputs - inputs_before) as f64 / BATCH as f64;
        next += BATCH as u64;
        if pair.ready_on_d - before != BATCH {
            bail!(
                "{} of {BATCH} requests became ready on D",
                pair.ready_on_d - before
            );
        }
        let ticks = 20_000;
        let start = Instant::now();
        for _ in 0..ticks {
            pair.p.input(Input::Timeout, black_box(t));
            pair.d.input(Input::Timeout, black_box(t));
        }
        tick.push(start.elapsed().as_nanos() as f64 / ticks as f64);
    }
    if pair.freed_on_p < SAMPLES * BATCH {
        bail!(
            "P freed {} handoffs, expected {}",
            pair.freed_on_p,
            SAMPLES * BATCH
        );
    }
    let request_ns = median(req);
    Ok(SizeResult {
        handoffs: n,
        request_ns,
        idle_tick_ns: median(tick),
        inputs_per_request,
        input_ns: request_ns / inputs_per_request.max(1.0),
    })
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

pub fn run(sizes: &[usize], json: bool) -> anyhow::Result<()> {
    if sizes.len() < 2 || sizes.iter().any(|&n| n < 1) {
        bail!("give at least two sizes");
    }
    println!(
        "connector bench: a P and a D ConnectorCore in one process, tp 1, {BATCH} requests per sample, {SAMPLES} samples (median)"
    );
    println!(
        "{:>9} {:>12} {:>14} {:>16} {:>10}",
        "handoffs", "request ns", "idle tick ns", "inputs/request", "input ns"
    );
    let mut results = Vec::new();
    for &n in sizes {
        let r = measure(n)?;
        println!(
            "{:>9} {:>12.0} {:>14.1} {:>16.1} {:>10.0}",
            r.handoffs, r.request_ns, r.idle_tick_ns, r.inputs_per_request, r.input_ns
        );
        results.push(r);
    }
    let digest = digest_cost()?;
    println!(
        "kv digest of one {} MiB handoff: rows {:.1} ms, whole blocks {:.1} ms, memcpy {:.1} ms: digest_vs_memcpy {:.2}",
        digest.handoff_bytes >> 20,
        digest.digest_rows_ms,
        digest.digest_whole_blocks_ms,
        digest.memcpy_ms,
        digest.digest_vs_memcpy
    );
    let (first, last) = (&results[0], &results[results.len() - 1]);
    let report = Report {
        digest,
        bench: "connector",
        step_scaling_ratio: last.request_ns / first.request_ns,
        tick_scaling_ratio: last.idle_tick_ns / first.idle_tick_ns,
        step_scaling_limit: 4.0,
        sizes: results,
    };
    println!(
        "step_scaling_ratio {:.2} (limit {}), tick_scaling_ratio {:.2}",
        report.step_scaling_ratio, report.step_scaling_limit, report.tick_scaling_ratio
    );
    if json {
        println!("{}", serde_json::to_string(&report)?);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The bench carries every request to D and frees it on P (it once stopped doing so when P
    /// started waiting for its workers' grants, and printed nothing useful).
    #[test]
    fn every_request_is_carried_through_both_cores() {
        let r = measure(10).unwrap();
        assert!(r.request_ns > 0.0);
        let d = digest_cost().unwrap();
        assert!(d.digest_rows_ms > 0.0 && d.memcpy_ms > 0.0);
    }
}
