//! `handoff demo`: a P/D cluster on loopback under a mixed, faulty workload, and a report.
//!
//! Starts 1 prefill and 2 decode engines and a monolithic engine (child processes, free ports)
//! and the proxy (in this process); drives prompts of 16–4096 tokens, some with n=4, some that D
//! rejects before admission, some whose client disconnects mid-stream; kills one decode engine
//! with SIGKILL mid-run; then checks every successful output against the monolithic engine and
//! every block against the pools. Exit status 1 when a block leaked or an output differs.
//!
//! One file, over 800 lines: the demo's scenario and the report it prints, side by side, so what a
//! user reads and what it measured stay together.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use clap::Args;
use futures_util::StreamExt;
use indicatif::{ProgressBar, ProgressStyle};
use rand::{rngs::StdRng, Rng, SeedableRng};
use serde::Serialize;
use serde_json::{json, Value};
use tokio::sync::{Mutex, Semaphore};

use handoff_bench::cluster::{get_text, metric, metric_by_label, spawn_engine_on, Engine};
use handoff_bench::netns::Net;

#[derive(Args, Debug, Clone)]
pub struct DemoArgs {
    /// Print the report as one JSON object on the last line.
    #[arg(long)]
    pub json: bool,
    /// Requests to send.
    #[arg(long, default_value_t = 140)]
    pub requests: usize,
    /// Requests in flight at once.
    #[arg(long, default_value_t = 8)]
    pub concurrency: usize,
    /// Seed of the workload.
    #[arg(long, default_value_t = 7)]
    pub seed: u64,
    /// Transport between engines: tcp or nixl.
    #[arg(long, default_value = "tcp")]
    pub transport: String,
    #[arg(long, default_value_t = 1)]
    pub prefill_tp: u32,
    #[arg(long, default_value_t = 1)]
    pub decode_tp: u32,
    #[arg(long, default_value_t = 16)]
    pub prefill_block_size: u32,
    #[arg(long, default_value_t = 16)]
    pub decode_block_size: u32,
    /// KV pool layout of P and D: layers-outermost, blocks-outermost, heads-outermost, or auto
    /// (heads-outermost when P and D differ in TP or block size, so descriptors do not grow with
    /// the prompt; otherwise layers-outermost, a descriptor per layer for a layer-wise pull).
    #[arg(long, default_value = "auto")]
    pub kv_pool_layout: String,
    /// The model's KV on every engine: gqa (the engine's default: KV heads split across TP
    /// ranks, K and V planes), mla (DeepSeek V2/V3's multi-head latent attention: one latent of 576 dims per
    /// token, which every TP rank holds, so a D rank reads each block once from one P rank) or
    /// hybrid (Gemma 3's shape: a sliding window of 512 tokens in five of every six layers, each
    /// kind of layer in a KV cache group of its own; a handoff moves the windows' blocks only)
    /// or ssm (Granite 4's shape: a recurrent state in three of every four layers, one block a
    /// request; a handoff moves the state after every prompt token but the last, D computes
    /// the last).
    #[arg(long, default_value = "gqa", value_parser = ["gqa", "mla", "hybrid", "ssm"])]
    pub model_shape: String,
    /// Skip killing a decode engine.
    #[arg(long)]
    pub no_kill: bool,
    /// pull (D reads P's blocks) or push (P writes into blocks D reserved, layer by layer).
    #[arg(long, default_value = "pull")]
    pub mode: String,
    /// Also write DIR/demo.html (TTFT and end-to-end latency CDFs, drawn, and this report) and
    /// DIR/demo.json.
    #[arg(long, value_name = "DIR")]
    pub report: Option<std::path::PathBuf>,
    /// Every engine in a network namespace of its own, with its own address, as separate hosts
    /// (root only); one decode engine is partitioned mid-run (its link cut: no FIN, no RST)
    /// instead of killed, and healed once P took its blocks back.
    #[arg(long)]
    pub netns: bool,
    /// Two prefill engines; one is drained mid-load (SIGTERM: it stops taking prefills and
    /// serves the reads of every handoff it holds, then exits) instead of a decode engine
    /// killed. The report gives the drain time and what the drain recomputed (0).
    #[arg(long, conflicts_with = "netns")]
    pub drain: bool,
    /// Every engine records its connector core's inputs to DIR/ENGINE.jsonl (`handoff replay`
    /// reads them back).
    #[arg(long, value_name = "DIR")]
    pub record: Option<std::path::PathBuf>,
    /// Set by `--netns` when it runs the demo inside the namespaces it made: `PREFIX:SUBNET`.
    #[arg(long, hide = true)]
    pub netns_inside: Option<String>,
}

/// The hosts of `demo --netns`; the demo itself (load and proxy) runs on `client`.
const NETNS_NODES: [&str; 5] = ["prefill-0", "decode-1", "decode-2", "mono", "client"];

#[derive(Debug, Clone)]
struct Job {
    idx: usize,
    prompt: String,
    max_tokens: u32,
    n: u32,
    /// What the client does.
    fate: Fate,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fate {
    Normal,
    /// max_tokens beyond D's limit: D refuses before admission.
    RejectedByD,
    /// Reads two chunks, then hangs up.
    Disconnect,
}

#[derive(Debug, Clone)]
struct Outcome {
    ok: bool,
    reason: String,
    texts: Vec<String>,
    ttft: Option<Duration>,
    e2e: Duration,
}

#[derive(Serialize, Default)]
struct Report {
    /// Each successful request's TTFT and end-to-end time (ms), for `--report`'s CDFs.
    #[serde(skip)]
    ttft_samples_ms: Vec<f64>,
    #[serde(skip)]
    e2e_samples_ms: Vec<f64>,
    requests_ok: usize,
    requests_failed: usize,
    requests_disconnected: usize,
    failed_reasons: BTreeMap<String, usize>,
    /// Requests D served from a local prefill because their KV transfer failed, and why: a
    /// fallback is never silent.
    requests_recomputed: f64,
    requests_recomputed_reasons: BTreeMap<String, f64>,
    ttft_p50_ms: f64,
    ttft_p99_ms: f64,
    e2e_p50_ms: f64,
    e2e_p99_ms: f64,
    kv_bytes_moved: f64,
    kv_gb_per_s: f64,
    handoffs_ended: BTreeMap<String, f64>,
    descriptors: f64,
    descriptors_per_handoff: f64,
    kv_pool_layout: String,
    killed_engine: Option<String>,
    blocks_held_by_killed_engine_at_kill: usize,
    reclaim_after_kill_s: Option<f64>,
    /// `--netns`: the decode engine whose link was cut instead of killed, and the seconds from
    /// the cut to P holding none of its blocks.
    partitioned_engine: Option<String>,
    reclaim_after_partition_s: Option<f64>,
    /// `--drain`: the prefill engine drained mid-load, the seconds from SIGTERM to its exit,
    /// and its own report (time, and blocks left when it stopped: 0 for a clean drain).
    drained_engine: Option<String>,
    blocks_held_by_drained_engine_at_drain: usize,
    drain_s: Option<f64>,
    drain_report: Option<Value>,
    netns: bool,
    leaked_blocks: usize,
    outputs_compared: usize,
    output_mismatches: usize,
    prefill_tp: u32,
    decode_tp: u32,
    prefill_block_size: u32,
    decode_block_size: u32,
    transport: String,
    mode: String,
    cost_model: String,
    kv_shape: String,
    /// `--model-shape`: gqa or mla.
    model_shape: String,
    wall_s: f64,
}

fn words(rng: &mut StdRng, n: usize) -> String {
    (0..n)
        .map(|_| format!("t{}", rng.gen_range(0..20_000)))
        .collect::<Vec<_>>()
        .join(" ")
}

fn percentile(v: &mut [f64], p: f64) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.sort_by(|a, b| a.total_cmp(b));
    let i = ((v.len() as f64 - 1.0) * p).round() as usize;
    v[i.min(v.len() - 1)]
}

async fn run_job(client: reqwest::Client, proxy: String, job: Job) -> Outcome {
    let start = Instant::now();
    let body = json!({"model": "handoff", "prompt": job.prompt, "max_tokens": job.max_tokens, "n": job.n, "stream": true});
    let fail = |reason: String| Outcome {
        ok: false,
        reason,
        texts: vec![],
        ttft: None,
        e2e: start.elapsed(),
    };
    let resp = match client
        .post(format!("{proxy}/v1/completions"))
        .json(&body)
        .timeout(Duration::from_secs(120))
        .send()
        .await
    {
        Ok(r) => r,
        Err(e) => return fail(format!("proxy unreachable: {e}")),
    };
    if !resp.status().is_success() {
        let status = resp.status().as_u16();
        let text = resp.text().await.unwrap_or_default();
        let reason = if text.contains("max_model_len") {
            "rejected by decode before admission".to_string()
        } else if status == 502 || status == 503 || status == 504 {
            format!("decode unavailable ({status})")
        } else {
            format!("http {status}")
        };
        return fail(reason);
    }
    let mut texts = vec![String::new(); job.n as usize];
    let mut ttft = None;
    let mut chunks = 0;
    let mut buf = Vec::new();
    let mut stream = resp.bytes_stream();
    let mut done = false;
    while let Some(item) = stream.next().await {
        let Ok(bytes) = item else {
            return fail("stream broken (decode engine died)".into());
        };
        buf.extend_from_slice(&bytes);
        while let Some(pos) = buf.windows(2).position(|w| w == b"\n\n") {
            let event: Vec<u8> = buf.drain(..pos + 2).collect();
            let text = String::from_utf8_lossy(&event);
            for line in text.lines() {
                let Some(data) = line.strip_prefix("data: ") else {
                    continue;
                };
                if data.trim() == "[DONE]" {
                    done = true;
                    continue;
                }
                let Ok(v) = serde_json::from_str::<Value>(data) else {
                    continue;
                };
                if v.get("error").is_some() {
                    return fail(format!("error in stream: {}", v["error"]["message"]));
                }
                for c in v["choices"].as_array().into_iter().flatten() {
                    let i = c["index"].as_u64().unwrap_or(0) as usize;
                    if let (Some(t), Some(s)) = (texts.get_mut(i), c["text"].as_str()) {
                        if !s.is_empty() && ttft.is_none() {
                            ttft = Some(start.elapsed());
                        }
                        t.push_str(s);
                    }
                }
                chunks += 1;
            }
        }
        if job.fate == Fate::Disconnect && chunks >= 2 {
            // Hang up mid-stream: the proxy and D must release everything.
            return Outcome {
                ok: false,
                reason: "client disconnected".into(),
                texts: vec![],
                ttft,
                e2e: start.elapsed(),
            };
        }
    }
    if !done {
        return fail("stream ended early (decode engine died)".into());
    }
    Outcome {
        ok: true,
        reason: String::new(),
        texts,
        ttft,
        e2e: start.elapsed(),
    }
}

async fn monolithic_texts(
    client: &reqwest::Client,
    url: &str,
    job: &Job,
) -> anyhow::Result<Vec<String>> {
    let body = json!({"prompt": job.prompt, "max_tokens": job.max_tokens, "n": job.n});
    let v: Value = client
        .post(format!("{url}/v1/completions"))
        .json(&body)
        .timeout(Duration::from_secs(120))
        .send()
        .await?
        .json()
        .await?;
    Ok(v["choices"]
        .as_array()
        .context("no choices")?
        .iter()
        .map(|c| c["text"].as_str().unwrap_or_default().to_string())
        .collect())
}

pub fn run(args: DemoArgs) -> anyhow::Result<()> {
    if args.model_shape == "hybrid" && args.prefill_block_size != args.decode_block_size {
        bail!(
            "--model-shape hybrid needs equal block sizes on P and D (a sliding window's blocks \
             start at another token otherwise): --prefill-block-size {} --decode-block-size {}",
            args.prefill_block_size,
            args.decode_block_size
        );
    }
    if args.netns && args.netns_inside.is_none() {
        return run_in_namespaces();
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let report = rt.block_on(demo(args.clone()))?;
    let text = report_text(&report);
    print!("{text}");
    if let Some(dir) = &args.report {
        write_report(dir, &report, &text)?;
    }
    if args.json {
        println!("{}", serde_json::to_string(&report)?);
    }
    if report.leaked_blocks > 0 || report.output_mismatches > 0 {
        bail!(
            "{} leaked blocks, {} mismatched outputs",
            report.leaked_blocks,
            report.output_mismatches
        );
    }
    Ok(())
}

/// `--report DIR`: the latency CDFs of the successful requests, the text report below them.
fn write_report(dir: &std::path::Path, r: &Report, text: &str) -> anyhow::Result<()> {
    let chart = handoff_bench::report::cdf(
        "Latency of the successful requests",
        &[
            ("TTFT".to_string(), r.ttft_samples_ms.clone()),
            ("end to end".to_string(), r.e2e_samples_ms.clone()),
        ],
    )?;
    handoff_bench::report::write(
        dir,
        "demo",
        "handoff demo",
        &[chart],
        text,
        &serde_json::to_string_pretty(r)?,
    )
}

/// `demo --netns`: makes the hosts, runs this same demo inside them (on `client`), removes
/// them (also when the demo fails), and exits as the demo did.
fn run_in_namespaces() -> anyhow::Result<()> {
    if let Some(why) = handoff_bench::netns::unavailable() {
        bail!("handoff demo --netns needs network namespaces (root and iproute2): {why}");
    }
    let net = Net::create(&NETNS_NODES)?;
    eprintln!(
        "network namespaces {}*: {}",
        net.prefix,
        NETNS_NODES
            .iter()
            .map(|n| format!("{n} {}", net.addr(n)))
            .collect::<Vec<_>>()
            .join(", ")
    );
    let status = net
        .rerun_inside("client")
        .context("cannot run the demo inside the namespaces")?;
    drop(net);
    if !status.success() {
        bail!("the demo inside the namespaces failed ({status})");
    }
    Ok(())
}

/// What `--model-shape` sets on every engine, and its KV in words.
struct ModelShape {
    settings: &'static [&'static str],
    kv: String,
}

fn model_shape(name: &str) -> ModelShape {
    match name {
        // DeepSeek V2/V3: 512 compressed dims and 64 rotary ones.
        "mla" => ModelShape {
            settings: &["num_kv_heads=1", "head_dim=576", "block_layout=latent"],
            kv: "one latent of 576 dims per token (MLA), on every rank".into(),
        },
        "hybrid" => ModelShape {
            settings: &["sliding_window=512", "full_attention_every=6"],
            kv: "a sliding window of 512 tokens in five of every six layers, the sixth full \
                 (Gemma 3), each kind in a KV cache group of its own"
                .into(),
        },
        "ssm" => ModelShape {
            settings: &["recurrent_state=true", "full_attention_every=4"],
            kv: "a recurrent state in three of every four layers (one block a request), the \
                 fourth full attention (Granite 4's shape), each kind in a KV cache group of its \
                 own"
            .into(),
        },
        _ => {
            let d = handoff_engine::EngineConfig::default();
            ModelShape {
                settings: &[],
                kv: format!(
                    "{} KV heads, head dim {}, K and V",
                    d.num_kv_heads, d.head_dim
                ),
            }
        }
    }
}

/// The pool layout the demo's P and D engines use.
fn pool_layout(args: &DemoArgs) -> anyhow::Result<String> {
    Ok(match args.kv_pool_layout.as_str() {
        // A latent has no heads to keep together: one run of tokens per block and layer pairs
        // across TP (every rank holds it) and across block sizes alike.
        "auto" if args.model_shape == "mla" => "layers-outermost".into(),
        "auto"
            if args.prefill_tp != args.decode_tp
                || args.prefill_block_size != args.decode_block_size =>
        {
            "heads-outermost".into()
        }
        "auto" => "layers-outermost".into(),
        other @ ("layers-outermost" | "blocks-outermost" | "heads-outermost") => other.into(),
        other => bail!(
            "--kv-pool-layout {other:?}: expected auto, layers-outermost, blocks-outermost or \
             heads-outermost"
        ),
    })
}

async fn demo(args: DemoArgs) -> anyhow::Result<Report> {
    let wall = Instant::now();
    let net = match &args.netns_inside {
        Some(at) => {
            let (prefix, subnet) = at
                .split_once(':')
                .and_then(|(p, s)| Some((p, s.parse().ok()?)))
                .context("--netns-inside PREFIX:SUBNET")?;
            Some(Net::attach(prefix, subnet, &NETNS_NODES))
        }
        None => None,
    };
    let net = net.as_ref();
    if let Some(dir) = &args.record {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    let spawn_engine = |id: &str, role: &str, extra: &[String]| {
        let mut extra = extra.to_vec();
        if let Some(dir) = &args.record {
            let path = dir.join(format!("{id}.jsonl"));
            extra.extend([
                "--set".to_string(),
                format!("record_trace={}", path.display()),
            ]);
        }
        spawn_engine_on(net, id, role, &extra)
    };
    let pool = pool_layout(&args)?;
    let shape = model_shape(&args.model_shape);
    let common = |tp: u32, bs: u32| -> Vec<String> {
        let mut v: Vec<String> = shape
            .settings
            .iter()
            .flat_map(|kv| ["--set".to_string(), kv.to_string()])
            .collect();
        v.extend([
            "--set".into(),
            format!("kv_pool_layout={pool}"),
            "--transport".into(),
            args.transport.clone(),
            "--mode".into(),
            args.mode.clone(),
            "--tp".into(),
            tp.to_string(),
            "--block-size".into(),
            bs.to_string(),
            "--num-blocks".into(),
            (32768 / bs).to_string(),
        ]);
        v
    };
    eprintln!("starting 1 prefill, 2 decode and 1 monolithic engine, and the proxy ...");
    let p = spawn_engine(
        "prefill-0",
        "prefill",
        &common(args.prefill_tp, args.prefill_block_size),
    )?;
    // --drain: a second P, drained mid-load while this one takes over.
    let mut p_args = common(args.prefill_tp, args.prefill_block_size);
    // Readiness false for a second before it refuses: the proxy checks every 200 ms.
    p_args.extend(["--set".to_string(), "drain_grace_ms=1000".to_string()]);
    let mut draining_p = match args.drain {
        true => Some(spawn_engine("prefill-1", "prefill", &p_args)?),
        false => None,
    };
    let d1 = spawn_engine(
        "decode-1",
        "decode",
        &common(args.decode_tp, args.decode_block_size),
    )?;
    // decode-2 is busy (a small pool): requests wait in its queue, heartbeating, while P holds
    // their blocks — the case where a crash strands memory in other systems.
    let mut busy = common(args.decode_tp, args.decode_block_size);
    if let Some(i) = busy.iter().position(|a| a == "--num-blocks") {
        busy[i + 1] = (4096 / args.decode_block_size).to_string();
    }
    busy.extend(["--set".to_string(), "max_batch=4".to_string()]);
    let d2 = spawn_engine("decode-2", "decode", &busy)?;
    let mut mono_args = common(1, 16);
    if let Some(i) = mono_args.iter().position(|a| a == "--mode") {
        mono_args[i + 1] = "pull".into();
    }
    let mono = spawn_engine("mono", "both", &mono_args)?;
    let bind = match net {
        Some(net) => format!("{}:0", net.addr("client")),
        None => "127.0.0.1:0".into(),
    };
    let proxy = handoff_proxy::start(handoff_proxy::ProxyConfig {
        bind: bind.parse()?,
        prefill: std::iter::once(p.url.clone())
            .chain(draining_p.as_ref().map(|e| e.url.clone()))
            .collect(),
        decode: vec![d1.url.clone(), d2.url.clone()],
        mode: match args.mode.as_str() {
            "push" => handoff_proxy::TransferMode::Push,
            "pull" => handoff_proxy::TransferMode::Pull,
            other => bail!("--mode {other:?}: expected pull or push"),
        },
        health_interval: Duration::from_millis(200),
        ..Default::default()
    })
    .await?;
    let client = reqwest::Client::builder()
        .pool_max_idle_per_host(64)
        .build()?;

    let mut rng = StdRng::seed_from_u64(args.seed);
    let jobs: Vec<Job> = (0..args.requests)
        .map(|idx| {
            // Log-uniform prompt lengths 16..4096: mostly short, some long.
            let len = (16.0 * (256f64).powf(rng.gen::<f64>())) as usize;
            let roll = rng.gen_range(0..100);
            let fate = match roll {
                0..=4 => Fate::RejectedByD,
                5..=9 => Fate::Disconnect,
                _ => Fate::Normal,
            };
            Job {
                idx,
                prompt: words(&mut rng, len.clamp(16, 4096)),
                max_tokens: if fate == Fate::RejectedByD {
                    8192
                } else {
                    rng.gen_range(8..48)
                },
                n: if rng.gen_range(0..10) == 0 { 4 } else { 1 },
                fate,
            }
        })
        .collect();

    let bar = ProgressBar::new(jobs.len() as u64);
    bar.set_style(
        ProgressStyle::with_template("{spinner} [{elapsed_precise}] {bar:40} {pos}/{len} {msg}")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    let sem = Arc::new(Semaphore::new(args.concurrency.max(1)));
    let results: Arc<Mutex<Vec<(Job, Outcome)>>> = Arc::new(Mutex::new(Vec::new()));
    let kill_at = if args.no_kill || args.drain {
        usize::MAX
    } else {
        jobs.len() * 2 / 5
    };
    let mut report = Report::default();
    let mut handles = Vec::new();
    let mut d2 = Some(d2);
    let mut d2_metrics = String::new();
    let mut kill_check = None;
    let mut partitioned: Option<Engine> = None;
    let mut drain_check = None;
    let drain_at = jobs.len() * 2 / 5;
    for job in jobs {
        if job.idx == drain_at {
            if let Some(e) = draining_p.take() {
                // Drained the moment it holds blocks that a D has not read yet: watched while
                // the load goes on (up to 20 s), so the drain has handoffs to serve.
                report.drained_engine = Some(e.id.clone());
                let (client, bar) = (client.clone(), bar.clone());
                drain_check = Some(tokio::spawn(async move {
                    let wait = Instant::now();
                    let mut at_drain = 0;
                    while wait.elapsed() < Duration::from_secs(20) {
                        let v: Value = match client.get(format!("{}/health", e.url)).send().await {
                            Ok(r) => r.json().await.unwrap_or_default(),
                            Err(_) => Value::Null,
                        };
                        at_drain = v["held_blocks"]["prefill"].as_u64().unwrap_or(0);
                        if at_drain > 0 {
                            break;
                        }
                        tokio::time::sleep(Duration::from_millis(1)).await;
                    }
                    bar.set_message(format!("draining {} (SIGTERM)", e.id));
                    let (report, secs) = e.drain().await?;
                    anyhow::Ok((report, secs, at_drain as usize))
                }));
            }
        }
        if job.idx == kill_at {
            if let Some(mut e) = d2.take() {
                // Kill it while P holds blocks for it (wait up to 5 s for that moment).
                let wait = Instant::now();
                while wait.elapsed() < Duration::from_secs(5) {
                    let v: Value = match client.get(format!("{}/health", p.url)).send().await {
                        Ok(r) => r.json().await.unwrap_or_default(),
                        Err(_) => Value::Null,
                    };
                    if v["prefill_blocks_held_for"][&e.id].as_u64().unwrap_or(0) > 0 {
                        break;
                    }
                    tokio::time::sleep(Duration::from_millis(2)).await;
                }
                let held: Value = client
                    .get(format!("{}/health", p.url))
                    .send()
                    .await?
                    .json()
                    .await
                    .unwrap_or_default();
                report.blocks_held_by_killed_engine_at_kill =
                    held["prefill_blocks_held_for"][&e.id].as_u64().unwrap_or(0) as usize;
                d2_metrics = get_text(&client, &format!("{}/metrics", e.url)).await;
                let (client, purl, id) = (client.clone(), p.url.clone(), e.id.clone());
                let cut_or_kill = Instant::now();
                match net {
                    // Across hosts: the link goes down, nothing tells P; it learns from silence.
                    Some(net) => {
                        bar.set_message(format!("partitioning {}: its link is cut", e.id));
                        net.cut(&e.id)?;
                        report.partitioned_engine = Some(e.id.clone());
                    }
                    None => {
                        bar.set_message(format!("killing {} with SIGKILL", e.id));
                        let _ = e.child.kill();
                        report.killed_engine = Some(e.id.clone());
                    }
                }
                let heal = net.map(|n| Net::attach(&n.prefix, n.subnet, &NETNS_NODES));
                // Time until P no longer holds a single block for that engine; a partitioned
                // one's link heals then.
                kill_check = Some(tokio::spawn(async move {
                    let mut took = None;
                    loop {
                        let v: Value = match client.get(format!("{purl}/health")).send().await {
                            Ok(r) => r.json().await.unwrap_or_default(),
                            Err(_) => Value::Null,
                        };
                        if v["prefill_blocks_held_for"][&id].as_u64().unwrap_or(0) == 0 {
                            took = Some(cut_or_kill.elapsed().as_secs_f64());
                            break;
                        }
                        if cut_or_kill.elapsed() > Duration::from_secs(60) {
                            break;
                        }
                        tokio::time::sleep(Duration::from_millis(5)).await;
                    }
                    if let Some(net) = heal {
                        let _ = net.heal(&id);
                    }
                    took
                }));
                // A killed engine goes now; a partitioned one lives on and must end whole.
                if net.is_some() {
                    partitioned = Some(e);
                }
            }
        }
        let permit = sem.clone().acquire_owned().await?;
        let (client, url, results, bar) =
            (client.clone(), proxy.url(), results.clone(), bar.clone());
        handles.push(tokio::spawn(async move {
            let out = run_job(client, url, job.clone()).await;
            results.lock().await.push((job, out));
            bar.inc(1);
            drop(permit);
        }));
    }
    for h in handles {
        let _ = h.await;
    }
    bar.finish_with_message("workload done");
    if let Some(k) = kill_check {
        let took = k.await.ok().flatten();
        if report.partitioned_engine.is_some() {
            report.reclaim_after_partition_s = took;
        } else {
            report.reclaim_after_kill_s = took;
        }
    }

    if let Some(d) = drain_check {
        let (engine_report, secs, held) = d.await??;
        report.blocks_held_by_drained_engine_at_drain = held;
        // What the drained engine still held when it stopped counts as leaked.
        report.drain_s = Some(secs);
        report.drain_report = Some(engine_report);
    }

    // Let in-flight releases land, then look for blocks still out of the pools.
    let settle = Instant::now();
    // A partitioned engine is back (healed) and must be whole too.
    let mut engines = vec![&p, &d1];
    if args.drain {
        engines.extend(d2.as_ref());
    }
    engines.extend(partitioned.as_ref());
    loop {
        let mut held = 0usize;
        for e in &engines {
            let m = get_text(&client, &format!("{}/metrics", e.url)).await;
            held += metric(&m, "handoff_kv_blocks_held") as usize
                + metric(&m, "engine_kv_blocks_used") as usize;
        }
        let drained_left = report.drain_report.as_ref().map_or(0, |r| {
            r["handoff_blocks_left"].as_u64().unwrap_or(0)
                + r["pool_blocks_left"].as_u64().unwrap_or(0)
        });
        report.leaked_blocks = held + drained_left as usize;
        if held == 0 || settle.elapsed() > Duration::from_secs(5) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    let results = results.lock().await.clone();
    let mut ttft = Vec::new();
    let mut e2e = Vec::new();
    let mut to_compare = Vec::new();
    for (job, out) in &results {
        if out.ok {
            report.requests_ok += 1;
            e2e.push(out.e2e.as_secs_f64() * 1000.0);
            if let Some(t) = out.ttft {
                ttft.push(t.as_secs_f64() * 1000.0);
            }
            to_compare.push((job.clone(), out.texts.clone()));
        } else if out.reason == "client disconnected" {
            report.requests_disconnected += 1;
        } else {
            report.requests_failed += 1;
            *report.failed_reasons.entry(out.reason.clone()).or_default() += 1;
        }
    }
    // Every successful output against a monolithic engine given the same prompt.
    let compared = futures_util::stream::iter(to_compare.into_iter().map(|(job, texts)| {
        let (client, url) = (client.clone(), mono.url.clone());
        async move {
            match monolithic_texts(&client, &url, &job).await {
                Ok(t) => Some(t == texts),
                Err(e) => {
                    eprintln!("monolithic engine failed on request {}: {e}", job.idx);
                    None
                }
            }
        }
    }))
    .buffer_unordered(8)
    .collect::<Vec<_>>()
    .await;
    for same in compared.into_iter().flatten() {
        report.outputs_compared += 1;
        if !same {
            report.output_mismatches += 1;
        }
    }
    report.ttft_samples_ms = ttft.clone();
    report.e2e_samples_ms = e2e.clone();
    report.ttft_p50_ms = percentile(&mut ttft, 0.5);
    report.ttft_p99_ms = percentile(&mut ttft, 0.99);
    report.e2e_p50_ms = percentile(&mut e2e, 0.5);
    report.e2e_p99_ms = percentile(&mut e2e, 0.99);
    let pm = get_text(&client, &format!("{}/metrics", p.url)).await;
    report.handoffs_ended = metric_by_label(&pm, "handoff_handoffs_ended_total", "reason");
    let dm = get_text(&client, &format!("{}/metrics", d1.url)).await;
    // A partitioned decode engine lived on: its counters are read at the end, like the others'.
    // So did one never killed (--no-kill, --drain).
    if let Some(e) = partitioned.as_ref().or(d2.as_ref()) {
        d2_metrics = get_text(&client, &format!("{}/metrics", e.url)).await;
    }
    // Pull: D posts the READs; push: P posts the WRITEs. Each side counts what it posted.
    let dm = format!("{dm}\n{pm}");
    for m in [&dm, &d2_metrics] {
        for (reason, n) in metric_by_label(m, "handoff_requests_failed_total", "reason") {
            *report
                .requests_recomputed_reasons
                .entry(reason)
                .or_default() += n;
            report.requests_recomputed += n;
        }
        report.kv_bytes_moved += metric(m, "handoff_transfer_bytes_total");
        report.descriptors += metric(m, "handoff_transfer_descriptors_sum");
    }
    let secs = metric(&dm, "handoff_transfer_duration_seconds_sum")
        + metric(&d2_metrics, "handoff_transfer_duration_seconds_sum");
    let transfers = metric(&dm, "handoff_transfer_duration_seconds_count")
        + metric(&d2_metrics, "handoff_transfer_duration_seconds_count");
    report.kv_gb_per_s = if secs > 0.0 {
        report.kv_bytes_moved / secs / 1e9
    } else {
        0.0
    };
    // A pull transfer is one handoff; a push transfer is one D rank's share of one.
    let handoffs_moved = if args.mode == "push" {
        transfers / f64::from(args.decode_tp)
    } else {
        transfers
    };
    report.descriptors_per_handoff = if handoffs_moved > 0.0 {
        report.descriptors / handoffs_moved
    } else {
        0.0
    };
    report.prefill_tp = args.prefill_tp;
    report.netns = net.is_some();
    report.kv_pool_layout = pool.clone();
    report.decode_tp = args.decode_tp;
    report.prefill_block_size = args.prefill_block_size;
    report.decode_block_size = args.decode_block_size;
    report.transport = args.transport.clone();
    report.mode = args.mode.clone();
    let d = handoff_engine::EngineConfig::default();
    report.cost_model = format!(
        "prefill {} us/token, decode {} ms/step + {} us/seq",
        d.prefill_us_per_token, d.decode_step_ms, d.decode_us_per_seq
    );
    report.model_shape = args.model_shape.clone();
    report.kv_shape = format!("{} layers, {}, {}", d.num_layers, shape.kv, d.dtype);
    report.wall_s = wall.elapsed().as_secs_f64();
    proxy.shutdown().await.ok();
    drop((p, d1, d2, mono));
    Ok(report)
}

/// The report as text (printed, and the notes of `--report`'s page).
fn report_text(r: &Report) -> String {
    use std::fmt::Write;
    let mut out = String::new();
    let o = &mut out;
    let _ = writeln!(o);
    let _ = writeln!(
        o,
        "handoff demo — {} mode, {} transport, P tp {} / block {}, D tp {} / block {}",
        r.mode, r.transport, r.prefill_tp, r.prefill_block_size, r.decode_tp, r.decode_block_size
    );
    let _ = writeln!(o, "  model: {}; cost model: {}", r.kv_shape, r.cost_model);
    let _ = writeln!(
        o,
        "  requests ok {}, failed {}, client disconnects {}",
        r.requests_ok, r.requests_failed, r.requests_disconnected
    );
    for (reason, n) in &r.failed_reasons {
        let _ = writeln!(o, "    failed: {n} × {reason}");
    }
    let _ = writeln!(
        o,
        "  recomputed on D because a transfer failed: {}",
        r.requests_recomputed
    );
    for (reason, n) in &r.requests_recomputed_reasons {
        let _ = writeln!(o, "    recomputed: {n} × {reason}");
    }
    let _ = writeln!(
        o,
        "  TTFT p50 {:.1} ms, p99 {:.1} ms; end to end p50 {:.1} ms, p99 {:.1} ms",
        r.ttft_p50_ms, r.ttft_p99_ms, r.e2e_p50_ms, r.e2e_p99_ms
    );
    let _ = writeln!(
        o,
        "  KV moved {:.1} MiB at {:.2} GB/s; {:.1} descriptors per handoff ({} pool)",
        r.kv_bytes_moved / (1 << 20) as f64,
        r.kv_gb_per_s,
        r.descriptors_per_handoff,
        r.kv_pool_layout
    );
    let ended: Vec<String> = r
        .handoffs_ended
        .iter()
        .map(|(k, v)| format!("{k} {v}"))
        .collect();
    let _ = writeln!(o, "  handoffs ended on P: {}", ended.join(", "));
    if let Some(e) = &r.partitioned_engine {
        let _ = match r.reclaim_after_partition_s {
            Some(s) => writeln!(o,
                "  partitioned {e} (link cut, no FIN) holding {} P blocks: all back in P's pool {s:.3} s after the cut",
                r.blocks_held_by_killed_engine_at_kill
            ),
            None => writeln!(o, "  partitioned {e}: its blocks were NOT all reclaimed"),
        };
    }
    let _ = match (&r.killed_engine, r.reclaim_after_kill_s) {
        (Some(e), Some(s)) => writeln!(
            o,
            "  killed {e} holding {} P blocks: all back in P's pool {:.3} s after the kill",
            r.blocks_held_by_killed_engine_at_kill, s
        ),
        (Some(e), None) => writeln!(o, "  killed {e}: its blocks were NOT all reclaimed"),
        _ if r.partitioned_engine.is_some() || r.drained_engine.is_some() => Ok(()),
        _ => writeln!(o, "  no engine killed"),
    };
    if let (Some(e), Some(s)) = (&r.drained_engine, r.drain_s) {
        let rep = r.drain_report.clone().unwrap_or_default();
        let _ = writeln!(
            o,
            "  drained {e} mid-load (SIGTERM) holding {} blocks of handoffs: exited {s:.3} s \
             later, {}; blocks left at its exit: {} of handoffs, {} of its pool",
            r.blocks_held_by_drained_engine_at_drain,
            if rep["timed_out"] == json!(false) {
                "nothing in flight left"
            } else {
                "at its deadline"
            },
            rep["handoff_blocks_left"],
            rep["pool_blocks_left"]
        );
    }
    let _ = writeln!(o, "  blocks still held at the end: {}", r.leaked_blocks);
    let _ = writeln!(
        o,
        "  outputs compared with a monolithic engine: {}, mismatches: {}",
        r.outputs_compared, r.output_mismatches
    );
    let _ = writeln!(o, "  wall time {:.1} s", r.wall_s);
    out
}
