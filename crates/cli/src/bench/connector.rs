//! Connector core scaling: the cost of carrying one request through a P core and a D core (P
//! creates the handoff, D tracks the request, its first heartbeat is granted, D admits it, its
//! READ is posted and lands, P learns it was read and frees the blocks) and of an idle timeout,
//! with N other handoffs in flight on both cores. The two `ConnectorCore`s run in this process;
//! their side channel and workers are this benchmark's loops, so only the core's own work is
//! timed. The baseline is the same measurement at the smallest N, in the same run.

use std::hint::black_box;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use handoff_connector::{
    ConnectorCore, ConnectorEvent, CoreConfig, Ready, Role, WorkerHello, WorkerOp, WorkerReport,
};
use handoff_ledger::{ConsumerConfig, ProducerConfig};
use handoff_plan::{BlockLayout, KvSpec, ModelShape, RankLayout};
use handoff_proto::{HandoffId, Message, TransferMode};
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
}

#[derive(Serialize)]
struct Report {
    bench: &'static str,
    sizes: Vec<SizeResult>,
    step_scaling_ratio: f64,
    tick_scaling_ratio: f64,
    step_scaling_limit: f64,
}

fn spec() -> KvSpec {
    KvSpec {
        shape: ModelShape {
            num_layers: 2,
            num_kv_heads: 2,
            head_dim: 8,
            dtype_size: 2,
        },
        tp: 1,
        block_size: 16,
        block_layout: BlockLayout::HeadMajor,
    }
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
        },
        vec![WorkerHello {
            rank: 0,
            layout,
            agent: format!("{engine}-r0"),
            metadata: vec![],
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

/// The two cores and what travels between them.
struct Pair {
    p: ConnectorCore,
    d: ConnectorCore,
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
                    core.handle_timeout(now);
                }
            }
            let mut moved = false;
            let rp = self.p.ready();
            moved |= !rp.is_empty();
            let to_d: Vec<Message> = self.carry(&rp, true);
            self.p.advance(rp);
            for m in to_d {
                self.d.handle_frame(D_CONN, m, now);
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
                self.p.handle_frame(P_CONN, m, now);
            }
            if !ended.is_empty() {
                self.d.handle_worker_report(
                    WorkerReport {
                        rank: 0,
                        ended,
                        ..Default::default()
                    },
                    now,
                );
            }
            if !notes.is_empty() {
                self.p.handle_worker_report(
                    WorkerReport {
                        rank: 0,
                        notifications: notes,
                        ..Default::default()
                    },
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
        self.p.handle_accepted(P_CONN, hello, None, now);
        let rp = self.p.ready();
        let reply = rp.messages.first().map(|(_, m)| m.clone());
        self.p.advance(rp);
        self.d
            .handle_connected("p", 1, D_CONN, reply.context("P did not answer")?, now);
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
            self.p.handle_frame(P_CONN, m, now);
        }
        Ok(())
    }

    /// One request through both cores.
    fn request(&mut self, n: u64, now: Duration) -> anyhow::Result<()> {
        let block = (n % 1000) as u32;
        let params = self
            .p
            .on_prefill_finished("r", id(n), vec![block], 16, now)?;
        self.d.on_request_arrived(n, &params, 16, now)?;
        self.settle(now);
        self.d.on_blocks_allocated(n, vec![block], now)?;
        self.settle(now);
        Ok(())
    }
}

fn measure(n: usize) -> anyhow::Result<SizeResult> {
    let mut pair = Pair {
        p: core("p", Role::Prefill, 1000)?,
        d: core("d", Role::Decode, 1000)?,
        ready_on_d: 0,
        freed_on_p: 0,
    };
    let now = Duration::from_secs(1);
    // N handoffs in flight: created on P, tracked on D, waiting for admission.
    let params = pair.p.on_prefill_finished("r", id(0), vec![0], 16, now)?;
    pair.d.on_request_arrived(0, &params, 16, now)?;
    pair.connect(now)?;
    for i in 1..n as u64 {
        let params = pair.p.on_prefill_finished("r", id(i), vec![0], 16, now)?;
        pair.d.on_request_arrived(i, &params, 16, now)?;
    }
    pair.settle(now);
    let mut next = n as u64;
    let (mut req, mut tick) = (Vec::new(), Vec::new());
    for s in 0..SAMPLES {
        let t = now + Duration::from_millis(s as u64 + 1);
        let before = pair.ready_on_d;
        let start = Instant::now();
        for k in 0..BATCH as u64 {
            pair.request(next + k, t)?;
        }
        req.push(start.elapsed().as_nanos() as f64 / BATCH as f64);
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
            pair.p.handle_timeout(black_box(t));
            pair.d.handle_timeout(black_box(t));
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
    Ok(SizeResult {
        handoffs: n,
        request_ns: median(req),
        idle_tick_ns: median(tick),
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
        "{:>9} {:>12} {:>14}",
        "handoffs", "request ns", "idle tick ns"
    );
    let mut results = Vec::new();
    for &n in sizes {
        let r = measure(n)?;
        println!(
            "{:>9} {:>12.0} {:>14.1}",
            r.handoffs, r.request_ns, r.idle_tick_ns
        );
        results.push(r);
    }
    let (first, last) = (&results[0], &results[results.len() - 1]);
    let report = Report {
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
