//! Memory soak: many short requests through the proxy into a P and a D engine (child
//! processes), a share of whose clients walk away mid-stream, while the engines' resident memory
//! is sampled. Every per-request table in handoff either empties when its request ends or has a
//! stated bound (the ledgers' tombstones: `tombstone_capacity` entries for at most
//! `tombstone_ttl_ms`; staging; heartbeat replies awaited); once those bounds have filled, the
//! memory of an engine must stop growing with the number of requests it served. The report is
//! the growth per 1,000 requests over the second half of the run, by least squares, on P and on
//! D, and every block back in its pool at the end. Not part of the test suite: it takes minutes.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use clap::Args;
use futures_util::StreamExt;
use indicatif::{ProgressBar, ProgressStyle};
use serde::Serialize;
use serde_json::json;

use crate::cluster::spawn_engine;

#[derive(Args, Debug, Clone)]
pub struct SoakArgs {
    /// Print the report as one JSON object on the last line.
    #[arg(long)]
    pub json: bool,
    /// Requests to send in all.
    #[arg(long, default_value_t = 200_000)]
    pub requests: u64,
    /// Clients sending at once.
    #[arg(long, default_value_t = 16)]
    pub clients: usize,
    /// Share of streams (in %) the client abandons after the first chunk.
    #[arg(long, default_value_t = 30)]
    pub abandon_pct: u64,
    /// The ledgers' tombstone bound on both engines (small, so the bound fills early in the run).
    #[arg(long, default_value_t = 8192)]
    pub tombstones: usize,
}

#[derive(Serialize)]
struct Report {
    bench: &'static str,
    requests: u64,
    ok: u64,
    abandoned: u64,
    failed: u64,
    tombstone_capacity: usize,
    /// (requests done, P RSS KiB, D RSS KiB)
    samples: Vec<(u64, u64, u64)>,
    p_growth_kib_per_1000: f64,
    d_growth_kib_per_1000: f64,
    goal_kib_per_1000: f64,
    blocks_held_at_end: (f64, f64),
}

fn rss_kib(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmRSS:"))
                .and_then(|l| l.split_whitespace().nth(1)?.parse().ok())
        })
        .unwrap_or(0)
}

/// Least-squares slope of y over x.
fn slope(points: &[(f64, f64)]) -> f64 {
    let n = points.len() as f64;
    if n < 2.0 {
        return 0.0;
    }
    let mx = points.iter().map(|p| p.0).sum::<f64>() / n;
    let my = points.iter().map(|p| p.1).sum::<f64>() / n;
    let num: f64 = points.iter().map(|p| (p.0 - mx) * (p.1 - my)).sum();
    let den: f64 = points.iter().map(|p| (p.0 - mx).powi(2)).sum();
    if den == 0.0 {
        0.0
    } else {
        num / den
    }
}

async fn held_blocks(client: &reqwest::Client, url: &str) -> f64 {
    let text = match client.get(format!("{url}/metrics")).send().await {
        Ok(r) => r.text().await.unwrap_or_default(),
        Err(_) => return f64::NAN,
    };
    text.lines()
        .filter(|l| l.starts_with("handoff_kv_blocks_held"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

pub fn run(args: SoakArgs) -> anyhow::Result<()> {
    if args.clients == 0 || args.requests < 1000 {
        bail!("give at least one client and 1000 requests");
    }
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?
        .block_on(soak(args))
}

async fn soak(args: SoakArgs) -> anyhow::Result<()> {
    let engine_args: Vec<String> = [
        "--transport".to_string(),
        "tcp".into(),
        "--set".into(),
        format!("tombstone_capacity={}", args.tombstones),
        "--set".into(),
        "prefill_us_per_token=0".into(),
        "--set".into(),
        "decode_step_ms=0.5".into(),
        "--set".into(),
        "max_waiting=4096".into(),
    ]
    .into();
    println!(
        "soak bench: {} requests, {} clients, {}% of streams abandoned; P and D tcp engines, tombstones {}",
        args.requests, args.clients, args.abandon_pct, args.tombstones
    );
    let p = spawn_engine("soak-p", "prefill", &engine_args)?;
    let d = spawn_engine("soak-d", "decode", &engine_args)?;
    let (p_pid, d_pid) = (p.child.id(), d.child.id());
    let proxy = handoff_proxy::start(handoff_proxy::ProxyConfig {
        bind: "127.0.0.1:0".parse()?,
        prefill: vec![p.url.clone()],
        decode: vec![d.url.clone()],
        ..Default::default()
    })
    .await
    .context("proxy")?;
    let url = proxy.url();
    let next = Arc::new(AtomicU64::new(0));
    let done = Arc::new(AtomicU64::new(0));
    let ok = Arc::new(AtomicU64::new(0));
    let abandoned = Arc::new(AtomicU64::new(0));
    let failed = Arc::new(AtomicU64::new(0));
    let bar = ProgressBar::new(args.requests);
    bar.set_style(
        ProgressStyle::with_template("{bar:40} {pos}/{len} requests, {per_sec} ({eta} left)")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    let mut clients = Vec::new();
    for _ in 0..args.clients {
        let (next, done, ok, abandoned, failed) = (
            next.clone(),
            done.clone(),
            ok.clone(),
            abandoned.clone(),
            failed.clone(),
        );
        let (url, total, abandon_pct, bar) =
            (url.clone(), args.requests, args.abandon_pct, bar.clone());
        clients.push(tokio::spawn(async move {
            let client = reqwest::Client::new();
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= total {
                    break;
                }
                let abandon = (i * 7919) % 100 < abandon_pct;
                let body = json!({
                    "prompt": format!("soak {} tokens of a short prompt {}", i % 97, i),
                    "max_tokens": 4,
                    "stream": true,
                });
                let sent = client
                    .post(format!("{url}/v1/completions"))
                    .json(&body)
                    .timeout(Duration::from_secs(60))
                    .send()
                    .await;
                match sent {
                    Ok(r) if r.status().is_success() => {
                        let mut stream = r.bytes_stream();
                        if abandon {
                            let _ = stream.next().await;
                            drop(stream);
                            abandoned.fetch_add(1, Ordering::Relaxed);
                        } else {
                            while stream.next().await.is_some() {}
                            ok.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                    _ => {
                        failed.fetch_add(1, Ordering::Relaxed);
                    }
                }
                done.fetch_add(1, Ordering::Relaxed);
                bar.inc(1);
            }
        }));
    }
    let step = (args.requests / 100).max(100);
    let mut samples = Vec::new();
    let mut mark = 0;
    let started = Instant::now();
    while done.load(Ordering::Relaxed) < args.requests {
        tokio::time::sleep(Duration::from_millis(50)).await;
        let n = done.load(Ordering::Relaxed);
        if n >= mark {
            samples.push((n, rss_kib(p_pid), rss_kib(d_pid)));
            mark = n + step;
        }
        if clients.iter().all(|c| c.is_finished()) {
            break;
        }
    }
    for c in clients {
        c.await?;
    }
    bar.finish_and_clear();
    let n = done.load(Ordering::Relaxed);
    samples.push((n, rss_kib(p_pid), rss_kib(d_pid)));
    // Every block back: the ledgers' gauges read zero once the last lease or fence ended.
    let client = reqwest::Client::new();
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut held = (f64::NAN, f64::NAN);
    while Instant::now() < deadline {
        held = (
            held_blocks(&client, &p.url).await,
            held_blocks(&client, &d.url).await,
        );
        if held == (0.0, 0.0) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    proxy.shutdown().await.ok();
    drop((p, d));
    let half: Vec<&(u64, u64, u64)> = samples.iter().filter(|s| s.0 >= n / 2).collect();
    let growth = |f: fn(&(u64, u64, u64)) -> u64| {
        let pts: Vec<(f64, f64)> = half.iter().map(|s| (s.0 as f64, f(s) as f64)).collect();
        slope(&pts) * 1000.0
    };
    let report = Report {
        bench: "soak",
        requests: n,
        ok: ok.load(Ordering::Relaxed),
        abandoned: abandoned.load(Ordering::Relaxed),
        failed: failed.load(Ordering::Relaxed),
        tombstone_capacity: args.tombstones,
        p_growth_kib_per_1000: growth(|s| s.1),
        d_growth_kib_per_1000: growth(|s| s.2),
        goal_kib_per_1000: 1.0,
        blocks_held_at_end: held,
        samples,
    };
    println!(
        "{} requests in {:.0} s: {} ok, {} abandoned, {} failed",
        report.requests,
        started.elapsed().as_secs_f64(),
        report.ok,
        report.abandoned,
        report.failed
    );
    for (n, p, d) in report
        .samples
        .iter()
        .step_by((report.samples.len() / 10).max(1))
    {
        println!("  after {n:>7} requests: P {p:>7} KiB, D {d:>7} KiB");
    }
    println!(
        "RSS growth over the second half, per 1,000 requests: P {:.2} KiB, D {:.2} KiB (goal < {} KiB); blocks held at the end: P {}, D {}",
        report.p_growth_kib_per_1000,
        report.d_growth_kib_per_1000,
        report.goal_kib_per_1000,
        report.blocks_held_at_end.0,
        report.blocks_held_at_end.1
    );
    if args.json {
        println!("{}", serde_json::to_string(&report)?);
    }
    Ok(())
}
