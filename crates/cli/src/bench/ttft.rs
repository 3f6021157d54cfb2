//! `handoff bench ttft`: time to first token through pull, through push, and on one monolithic
//! engine, for the same workload in one run — the price of disaggregation, and what push buys.
//!
//! Engines are child processes on loopback (tcp transport) with a real 8B-class KV shape and the
//! default cost model; clusters run one after the other so that only two engines hold memory at
//! a time. Clients stream and time the first token.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use anyhow::Context;
use futures_util::StreamExt;
use serde::Serialize;
use serde_json::json;

use crate::demo::spawn_engine;

const LENGTHS: [usize; 3] = [512, 2048, 8192];
const CONCURRENCY: [usize; 2] = [1, 8];

#[derive(Serialize, Clone)]
struct Case {
    path: &'static str,
    prompt_tokens: usize,
    concurrency: usize,
    requests: usize,
    ttft_p50_ms: f64,
    ttft_p99_ms: f64,
    failed: usize,
}

#[derive(Serialize)]
struct Report {
    bench: &'static str,
    kv_shape: String,
    cost_model: String,
    cases: Vec<Case>,
    push_vs_pull_ttft_p50: f64,
    pull_vs_single_ttft_p50: f64,
    push_vs_single_ttft_p50: f64,
    /// Per path: requests D served from a local prefill because their transfer failed, per
    /// reason (a fallback is its own outcome, never hidden in the TTFT).
    requests_recomputed: BTreeMap<&'static str, BTreeMap<String, f64>>,
    targets: BTreeMap<&'static str, f64>,
}

fn engine_args(mode: &str) -> Vec<String> {
    [
        "--transport",
        "tcp",
        "--mode",
        mode,
        "--num-blocks",
        "1536",
        "--set",
        "num_layers=32",
        "--set",
        "num_kv_heads=8",
        "--set",
        "head_dim=128",
        "--set",
        "max_model_len=16384",
        "--set",
        "max_waiting=1024",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect()
}

fn prompt(seed: usize, tokens: usize) -> String {
    (0..tokens)
        .map(|i| format!("b{}", (i * 7919 + seed * 104_729) % 30_000))
        .collect::<Vec<_>>()
        .join(" ")
}

fn percentile(v: &mut [f64], p: f64) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(|a, b| a.total_cmp(b));
    v[(((v.len() - 1) as f64) * p).round() as usize]
}

/// Streams one request and returns its time to first token.
async fn ttft(client: &reqwest::Client, url: &str, text: String) -> Option<Duration> {
    let start = Instant::now();
    let resp = client
        .post(format!("{url}/v1/completions"))
        .json(&json!({"prompt": text, "max_tokens": 2, "stream": true}))
        .timeout(Duration::from_secs(120))
        .send()
        .await
        .ok()?;
    if !resp.status().is_success() {
        return None;
    }
    let mut stream = resp.bytes_stream();
    while let Some(Ok(chunk)) = stream.next().await {
        if String::from_utf8_lossy(&chunk).contains("\"text\":\" ") {
            let t = start.elapsed();
            // Drain the rest so the engine is not told the client left.
            while stream.next().await.is_some() {}
            return Some(t);
        }
    }
    None
}

async fn run_cases(path: &'static str, url: &str, seed_base: usize) -> Vec<Case> {
    let client = reqwest::Client::new();
    // Warm up: handshakes and connections are set up once per pair, not per request.
    let _ = ttft(&client, url, prompt(999_999, 64)).await;
    let mut out = Vec::new();
    for &len in &LENGTHS {
        for &conc in &CONCURRENCY {
            let n = if conc == 1 {
                3
            } else {
                if len >= 8192 {
                    8
                } else {
                    16
                }
            };
            let mut times = Vec::new();
            let mut failed = 0;
            let mut next = 0;
            let mut inflight = futures_util::stream::FuturesUnordered::new();
            while next < n || !inflight.is_empty() {
                while next < n && inflight.len() < conc {
                    let (c, u) = (client.clone(), url.to_string());
                    let text = prompt(seed_base + len * 100 + next, len);
                    inflight.push(async move { ttft(&c, &u, text).await });
                    next += 1;
                }
                match inflight.next().await {
                    Some(Some(t)) => times.push(t.as_secs_f64() * 1000.0),
                    Some(None) => failed += 1,
                    None => {}
                }
            }
            let case = Case {
                path,
                prompt_tokens: len,
                concurrency: conc,
                requests: n,
                ttft_p50_ms: percentile(&mut times.clone(), 0.5),
                ttft_p99_ms: percentile(&mut times, 0.99),
                failed,
            };
            eprintln!(
                "  {path:>6} {len:>5} tokens, concurrency {conc}: TTFT p50 {:.1} ms, p99 {:.1} ms{}",
                case.ttft_p50_ms,
                case.ttft_p99_ms,
                if failed > 0 { format!(", {failed} failed") } else { String::new() }
            );
            out.push(case);
        }
    }
    out
}

async fn cluster(mode: &'static str) -> anyhow::Result<(Vec<Case>, BTreeMap<String, f64>)> {
    let p = spawn_engine(&format!("bench-p-{mode}"), "prefill", &engine_args(mode))?;
    // Push reserves D's blocks on arrival (a full pool answers 503 at once): D gets room for
    // every request in flight (8 × 8192 tokens), as a push deployment must provision.
    let mut d_args = engine_args(mode);
    if mode == "push" {
        if let Some(i) = d_args.iter().position(|a| a == "--num-blocks") {
            d_args[i + 1] = "4200".into();
        }
    }
    let d = spawn_engine(&format!("bench-d-{mode}"), "decode", &d_args)?;
    let proxy = handoff_proxy::start(handoff_proxy::ProxyConfig {
        bind: "127.0.0.1:0".parse()?,
        prefill: vec![p.url.clone()],
        decode: vec![d.url.clone()],
        mode: if mode == "push" {
            handoff_proxy::TransferMode::Push
        } else {
            handoff_proxy::TransferMode::Pull
        },
        ..Default::default()
    })
    .await
    .context("proxy")?;
    let cases = run_cases(mode, &proxy.url(), 1).await;
    let m = crate::demo::get_text(&reqwest::Client::new(), &format!("{}/metrics", d.url)).await;
    let recomputed = crate::demo::metric_by_label(&m, "handoff_requests_failed_total", "reason");
    proxy.shutdown().await.ok();
    drop((p, d));
    Ok((cases, recomputed))
}

pub fn run(json_out: bool) -> anyhow::Result<()> {
    let d = handoff_engine::EngineConfig::default();
    let kv_shape = "32 layers, 8 KV heads, head dim 128, bf16, 16-token blocks (128 KiB per token)"
        .to_string();
    let cost_model = format!(
        "prefill {} us/token, decode {} ms/step + {} us/seq",
        d.prefill_us_per_token, d.decode_step_ms, d.decode_us_per_seq
    );
    println!("ttft bench: {kv_shape}; {cost_model}; tcp transport; prompts {LENGTHS:?}, concurrency {CONCURRENCY:?}");
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let mut requests_recomputed = BTreeMap::new();
    let cases = rt.block_on(async {
        let mut all = Vec::new();
        let single = spawn_engine("bench-single", "both", &engine_args("pull"))?;
        all.extend(run_cases("single", &single.url, 1).await);
        drop(single);
        for mode in ["pull", "push"] {
            let (cases, recomputed) = cluster(mode).await?;
            all.extend(cases);
            let n: f64 = recomputed.values().sum();
            println!(
                "  {mode}: {n} request(s) recomputed on D because a transfer failed {recomputed:?}"
            );
            requests_recomputed.insert(mode, recomputed);
        }
        anyhow::Ok(all)
    })?;
    let p50 = |path: &str| {
        cases
            .iter()
            .find(|c| c.path == path && c.prompt_tokens == 2048 && c.concurrency == 1)
            .map_or(f64::NAN, |c| c.ttft_p50_ms)
    };
    println!(
        "{:>7} {:>7} {:>5} {:>10} {:>10}",
        "path", "tokens", "conc", "p50 ms", "p99 ms"
    );
    for c in &cases {
        println!(
            "{:>7} {:>7} {:>5} {:>10.1} {:>10.1}",
            c.path, c.prompt_tokens, c.concurrency, c.ttft_p50_ms, c.ttft_p99_ms
        );
    }
    let report = Report {
        bench: "ttft",
        kv_shape,
        cost_model,
        push_vs_pull_ttft_p50: p50("push") / p50("pull"),
        pull_vs_single_ttft_p50: p50("pull") / p50("single"),
        push_vs_single_ttft_p50: p50("push") / p50("single"),
        requests_recomputed,
        targets: BTreeMap::from([
            ("push_vs_pull_ttft_p50_max", 0.75),
            ("push_vs_single_ttft_p50_max", 1.5),
        ]),
        cases,
    };
    println!(
        "push_vs_pull_ttft_p50 {:.2} (target ≤ 0.75), pull_vs_single {:.2}, push_vs_single {:.2} (target ≤ 1.5)  [2048 tokens, concurrency 1]",
        report.push_vs_pull_ttft_p50, report.pull_vs_single_ttft_p50, report.push_vs_single_ttft_p50
    );
    if json_out {
        println!("{}", serde_json::to_string(&report)?);
    }
    Ok(())
}
