//! Ledger scaling: the cost of one event (grant, heartbeat, pull-done, release) and of a tick on
//! which nothing expires, with N handoffs in flight. The baseline is the same measurement at the
//! smallest N, in the same process: a structure that scans every lease (vLLM's O(N) reaper,
//! #58222) shows up as a ratio near N_max / N_min instead of a small constant.

use std::hint::black_box;
use std::time::{Duration, Instant};

use anyhow::bail;
use handoff_ledger::{
    ConsumerConfig, ConsumerLedger, IncomingHandoff, PeerId, ProducerConfig, ProducerLedger,
    RequestId,
};
use handoff_proto::{
    split_heartbeat, Epoch, HandoffId, Heartbeat, HeartbeatEntry, Message, PullDone, Release,
    ReleaseReason, TransferMode,
};
use serde::Serialize;

const D: PeerId = PeerId(2);
const P: PeerId = PeerId(1);
/// Events per kind per sample: small enough to keep N steady, large enough to time.
const BATCH: usize = 1000;
const SAMPLES: usize = 7;

#[derive(Debug, Clone, Serialize)]
struct SizeResult {
    handoffs: usize,
    /// Nanoseconds per event, median of the samples.
    grant_ns: f64,
    heartbeat_ns: f64,
    pull_done_ns: f64,
    release_ns: f64,
    /// Mean of the four event costs.
    event_ns: f64,
    /// Nanoseconds per P tick + D tick on which nothing expires.
    idle_tick_ns: f64,
}

#[derive(Serialize)]
struct Report {
    bench: &'static str,
    sizes: Vec<SizeResult>,
    event_scaling_ratio: f64,
    tick_scaling_ratio: f64,
    event_scaling_limit: f64,
    tick_scaling_limit: f64,
}

fn id(n: u64) -> HandoffId {
    // Spread like random ids so hashing behaves as in production.
    HandoffId::from_bytes(u128::to_le_bytes(
        (n as u128).wrapping_mul(0x9e37_79b9_7f4a_7c15_f39c_c060_5ced_c835) | 1,
    ))
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

fn per_event(start: Instant, n: usize) -> f64 {
    start.elapsed().as_nanos() as f64 / n as f64
}

fn measure(n: usize) -> SizeResult {
    // Leases long enough that nothing expires while we measure.
    let pcfg = ProducerConfig {
        initial_lease: Duration::from_secs(3600),
        hard_cap: Duration::from_secs(7200),
        heartbeat_extension: Duration::from_secs(3600),
        ..Default::default()
    };
    let dcfg = ConsumerConfig {
        wait_deadline: Duration::from_secs(3600),
        heartbeat_interval: Duration::from_secs(3600),
        ..Default::default()
    };
    let mut p = ProducerLedger::new(pcfg);
    let mut d = ConsumerLedger::new(dcfg);
    let now = Duration::from_secs(1);
    for i in 0..n as u64 {
        p.create_handoff(id(i), vec![i as u32], TransferMode::Pull, now)
            .expect("fresh id");
        let inc = IncomingHandoff {
            handoff: id(i),
            epoch: Epoch::FIRST,
            peer: P,
            p_tp: 1,
            mode: TransferMode::Pull,
            p_blocks: vec![i as u32],
            num_tokens: 16,
        };
        d.on_request_arrived(RequestId(i), inc, now)
            .expect("fresh request");
    }
    d.handle_timeout(now);
    while d.poll_message().is_some() {}

    let mut next = n as u64;
    let (mut grant, mut hb, mut pull, mut rel, mut tick) = (vec![], vec![], vec![], vec![], vec![]);
    for s in 0..SAMPLES {
        let t = now + Duration::from_millis(s as u64 + 1);
        // grant: a new handoff is created and its grant handed out (and an old one retires, so
        // N stays put; the retirement is measured below as release).
        let ids: Vec<HandoffId> = (0..BATCH as u64).map(|k| id(next + k)).collect();
        let start = Instant::now();
        for (k, h) in ids.iter().enumerate() {
            black_box(
                p.create_handoff(*h, vec![k as u32], TransferMode::Pull, t)
                    .ok(),
            );
        }
        grant.push(per_event(start, BATCH));
        next += BATCH as u64;

        // heartbeat: a batch naming BATCH live handoffs, handled by P (grants replied).
        let entries: Vec<HeartbeatEntry> = (0..BATCH as u64)
            .map(|k| HeartbeatEntry {
                handoff: id((k * 7919 + s as u64) % n as u64),
                epoch: Epoch::FIRST,
            })
            .collect();
        let mut seq = s as u64 * 1000;
        let msgs: Vec<Heartbeat> = split_heartbeat(&entries, TransferMode::Pull, || {
            seq += 1;
            seq
        });
        let start = Instant::now();
        for m in msgs {
            p.handle_message(D, Message::Heartbeat(m), t);
        }
        while let Some(m) = p.poll_message() {
            black_box(m);
        }
        hb.push(per_event(start, BATCH));

        // pull-done: the BATCH handoffs just created are read and end.
        let start = Instant::now();
        for h in &ids[..BATCH / 2] {
            p.handle_message(
                D,
                Message::PullDone(PullDone {
                    handoff: *h,
                    epoch: Epoch::FIRST,
                    p_rank: 0,
                    consumer_rank: 0,
                    consumers: 1,
                }),
                t,
            );
        }
        while let Some(r) = p.poll_release() {
            black_box(r);
        }
        pull.push(per_event(start, BATCH / 2));

        // release: the other half is released by D.
        let start = Instant::now();
        for h in &ids[BATCH / 2..] {
            p.handle_message(
                D,
                Message::Release(Release {
                    handoff: *h,
                    epoch: Epoch::FIRST,
                    reason: ReleaseReason::Aborted,
                }),
                t,
            );
        }
        while let Some(r) = p.poll_release() {
            black_box(r);
        }
        rel.push(per_event(start, BATCH - BATCH / 2));

        // idle tick: nothing is due on either side.
        let ticks = 20_000;
        let start = Instant::now();
        for _ in 0..ticks {
            p.handle_timeout(black_box(t));
            d.handle_timeout(black_box(t));
        }
        tick.push(per_event(start, ticks));
    }
    let (grant_ns, heartbeat_ns, pull_done_ns, release_ns) =
        (median(grant), median(hb), median(pull), median(rel));
    SizeResult {
        handoffs: n,
        grant_ns,
        heartbeat_ns,
        pull_done_ns,
        release_ns,
        event_ns: (grant_ns + heartbeat_ns + pull_done_ns + release_ns) / 4.0,
        idle_tick_ns: median(tick),
    }
}

pub fn run(
    sizes: &[usize],
    json: bool,
    report_dir: Option<&std::path::Path>,
) -> anyhow::Result<()> {
    if sizes.len() < 2 || sizes.iter().any(|&n| n < BATCH) {
        bail!("give at least two sizes, each at least {BATCH}");
    }
    println!("ledger bench: P and D ledgers, tp 1, {BATCH} events per kind per sample, {SAMPLES} samples (median)");
    println!(
        "{:>9} {:>10} {:>12} {:>12} {:>10} {:>10} {:>12}",
        "handoffs",
        "grant ns",
        "heartbeat ns",
        "pull-done ns",
        "release ns",
        "event ns",
        "idle tick ns"
    );
    let mut results = Vec::new();
    for &n in sizes {
        let r = measure(n);
        println!(
            "{:>9} {:>10.0} {:>12.0} {:>12.0} {:>10.0} {:>10.0} {:>12.1}",
            r.handoffs,
            r.grant_ns,
            r.heartbeat_ns,
            r.pull_done_ns,
            r.release_ns,
            r.event_ns,
            r.idle_tick_ns
        );
        results.push(r);
    }
    let (first, last) = (&results[0], &results[results.len() - 1]);
    let report = Report {
        bench: "ledger",
        event_scaling_ratio: last.event_ns / first.event_ns,
        tick_scaling_ratio: last.idle_tick_ns / first.idle_tick_ns,
        event_scaling_limit: 4.0,
        tick_scaling_limit: 2.0,
        sizes: results,
    };
    println!(
        "event_scaling_ratio {:.2} (limit {}), tick_scaling_ratio {:.2} (limit {})",
        report.event_scaling_ratio,
        report.event_scaling_limit,
        report.tick_scaling_ratio,
        report.tick_scaling_limit
    );
    if let Some(dir) = report_dir {
        write_report(dir, &report)?;
    }
    if json {
        println!("{}", serde_json::to_string(&report)?);
    }
    Ok(())
}

/// The cost of each event kind and of an idle tick against handoffs in flight (log-log: a flat
/// line is O(1), a slope of one is a scan of every handoff).
fn write_report(dir: &std::path::Path, r: &Report) -> anyhow::Result<()> {
    let kind = |name: &str, f: fn(&SizeResult) -> f64| {
        (
            name.to_string(),
            r.sizes
                .iter()
                .map(|s| (s.handoffs as f64, f(s)))
                .collect::<Vec<_>>(),
        )
    };
    let chart = crate::report::lines(
        "Ledger cost by handoffs in flight (median ns)",
        ("handoffs in flight", "ns per event / per idle tick"),
        true,
        &[
            kind("grant", |s| s.grant_ns),
            kind("heartbeat", |s| s.heartbeat_ns),
            kind("pull-done", |s| s.pull_done_ns),
            kind("release", |s| s.release_ns),
            kind("idle tick (P + D)", |s| s.idle_tick_ns),
        ],
    )?;
    let notes = format!(
        "event_scaling_ratio {:.2} (limit {}), tick_scaling_ratio {:.2} (limit {}): the cost at \
         the largest size over the cost at the smallest, same process.",
        r.event_scaling_ratio, r.event_scaling_limit, r.tick_scaling_ratio, r.tick_scaling_limit
    );
    crate::report::write(
        dir,
        "ledger",
        "handoff bench ledger",
        &[chart],
        &notes,
        &serde_json::to_string_pretty(r)?,
    )
}
