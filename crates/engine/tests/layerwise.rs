//! Layer-wise pull end to end in one process (mem transport): both legs sent at once, as the
//! proxy does for a P and a D whose info say `layerwise_pull`. D asks P for the blocks before P's
//! prefill starts, reads each layer once P saved it, and the output equals a monolithic
//! engine's, whichever leg arrives first and across TP sizes.

mod common;

use std::time::Duration;

use common::{both_legs, info, metric, metrics_text, post, post_later, released_within, texts};

use handoff_engine::{start, EngineConfig, RunningEngine};
use serde_json::{json, Value};

fn cfg(role: &str, tp: u32) -> EngineConfig {
    EngineConfig {
        role: role.into(),
        port: 0,
        transport: "mem".into(),
        mode: "pull".into(),
        tp,
        num_blocks: 512,
        // Slow enough that a prefill of a few hundred tokens spans many READ stages.
        prefill_us_per_token: 40.0,
        decode_step_ms: 0.2,
        decode_us_per_seq: 0.0,
        ..EngineConfig::default()
    }
}

fn prompt(seed: usize, words: usize) -> String {
    (0..words)
        .map(|i| format!("l{}", (i * 389 + seed * 97) % 4000))
        .collect::<Vec<_>>()
        .join(" ")
}

/// Both legs as the proxy sends them for a layer-wise pull; `d_first` delays the P leg.
async fn layerwise(
    c: &reqwest::Client,
    p: &RunningEngine,
    d: &RunningEngine,
    text: &str,
    n: u32,
    id: u64,
    d_first: bool,
) -> (u16, Value) {
    let pi = info(c, p).await;
    let hid = format!(
        "{:032x}",
        0x6c61_7965_0000_0000_0000_0000_0000_0000u128 | id as u128
    );
    let p_body = json!({"prompt": text, "max_tokens": 1, "kv_transfer_params": {
        "do_remote_decode": true, "do_remote_prefill": false, "transfer_mode": "pull",
        "layerwise": true, "handoff_id": hid}});
    let d_body = json!({"prompt": text, "max_tokens": 8, "n": n, "kv_transfer_params": {
        "do_remote_prefill": true, "do_remote_decode": false, "transfer_mode": "pull",
        "layerwise": true, "handoff_id": hid, "remote_engine_id": pi["engine_id"],
        "remote_host": pi["remote_host"], "remote_port": pi["remote_port"],
        "tp_size": pi["tp_size"]}});
    let ((ps, pv), d_answer) = both_legs(c, (p, p_body), (d, d_body), d_first).await;
    assert_eq!(ps, 200, "{pv}");
    assert_eq!(pv["kv_transfer_params"]["layerwise"], true, "{pv}");
    assert_eq!(pv["kv_transfer_params"]["handoff_id"], hid, "{pv}");
    d_answer
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn layerwise_pull_output_equals_monolithic_and_reads_during_the_prefill() {
    let c = reqwest::Client::new();
    let mono = start(cfg("both", 1)).await.unwrap();
    let mut id = 0;
    for (ptp, dtp) in [(1, 1), (1, 2), (2, 1)] {
        let p = start(cfg("prefill", ptp)).await.unwrap();
        let d = start(cfg("decode", dtp)).await.unwrap();
        assert_eq!(info(&c, &p).await["layerwise_pull"], true);
        // D takes part too: it admits such a request only once P's prefill started.
        assert_eq!(info(&c, &d).await["layerwise_pull"], true);
        let mut handoffs = 0;
        for (i, words) in [9usize, 300, 1500].into_iter().enumerate() {
            for d_first in [true, false] {
                for n in [1, 2] {
                    id += 1;
                    handoffs += 1;
                    let text = prompt(i * 10 + ptp as usize, words);
                    let (_, m) = post(
                        &c,
                        &mono.url(),
                        json!({"prompt": text, "max_tokens": 8, "n": n}),
                    )
                    .await;
                    let (s, v) = layerwise(&c, &p, &d, &text, n, id, d_first).await;
                    assert_eq!(s, 200, "{v}");
                    assert_eq!(
                        texts(&v),
                        texts(&m),
                        "P tp {ptp} D tp {dtp}, {words} words, d_first {d_first}, n {n}"
                    );
                }
            }
        }
        // Every handoff was read, and some in several stages: D read layers while P's prefill
        // was still saving the next ones (one stage each would be a classic pull).
        let stages = metric(&metrics_text(&c, &d).await, "handoff_read_stages_total");
        assert!(
            stages > handoffs as f64,
            "{stages} READ stages for {handoffs} handoffs: no read overlapped a prefill"
        );
        // A bound against leaks, not a timing assertion.
        released_within(&p, Duration::from_secs(10)).await;
        released_within(&d, Duration::from_secs(10)).await;
        let (_, ended) = common::producer_stats(&p);
        assert_eq!(
            ended.get("done").copied().unwrap_or(0),
            handoffs,
            "{ended:?}"
        );
        p.stop().await;
        d.stop().await;
    }
    mono.stop().await;
}

/// D refuses the request (its pool cannot hold it) while P's prefill runs: P is told at once and
/// frees the blocks once its forward pass is done with them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_layerwise_pull_d_refuses_frees_p_after_its_prefill() {
    let c = reqwest::Client::new();
    let p = start(cfg("prefill", 1)).await.unwrap();
    let d = start(EngineConfig {
        num_blocks: 8,
        ..cfg("decode", 1)
    })
    .await
    .unwrap();
    let (s, v) = layerwise(&c, &p, &d, &prompt(3, 600), 1, 900, false).await;
    assert_eq!(s, 400, "{v}");
    released_within(&p, Duration::from_secs(5)).await;
    let (_, ended) = common::producer_stats(&p);
    assert_eq!(ended.get("rejected"), Some(&1), "{ended:?}");
    p.stop().await;
    d.stop().await;
}

/// Both pools hold two prompts, and four requests reach P and D in opposite orders: D's first
/// two are P's last two. Were D to admit (hold blocks for) requests P has not started, D would
/// hold blocks for the two P cannot start while P holds its blocks for the two D cannot admit —
/// until D's wait deadline recomputed them. D admits a layer-wise pull once P's prefill started,
/// so every request is decoded from P's KV.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn opposite_orders_at_p_and_d_with_full_pools_do_not_deadlock() {
    let c = reqwest::Client::new();
    let mono = start(cfg("both", 1)).await.unwrap();
    // 300 words: 19 blocks of prompt + 1 for the token(s); 48 blocks hold two such requests.
    let small = |role: &str| EngineConfig {
        num_blocks: 48,
        prefill_us_per_token: 100.0,
        wait_deadline_ms: 20_000,
        ..cfg(role, 1)
    };
    let p = start(small("prefill")).await.unwrap();
    let d = start(small("decode")).await.unwrap();
    let pi = info(&c, &p).await;
    let texts_mono = {
        let mut out = Vec::new();
        for i in 0..4 {
            let body = json!({"prompt": prompt(40 + i, 300), "max_tokens": 4});
            let (_, m) = post(&c, &mono.url(), body).await;
            out.push(texts(&m));
        }
        out
    };
    let started = std::time::Instant::now();
    // D's legs in order 0..4, 20 ms apart, then P's in the opposite order.
    let hid = |i: usize| {
        format!(
            "{:032x}",
            0xdead_0000_0000_0000_0000_0000_0000_0000u128 | i as u128
        )
    };
    let gap = |i: usize| Duration::from_millis(20 * i as u64);
    let d_legs: Vec<_> = (0..4)
        .map(|i| {
            let body = json!({"prompt": prompt(40 + i, 300), "max_tokens": 4,
                "kv_transfer_params": {"do_remote_prefill": true, "transfer_mode": "pull",
                "layerwise": true, "handoff_id": hid(i), "remote_engine_id": pi["engine_id"],
                "remote_host": pi["remote_host"], "remote_port": pi["remote_port"],
                "tp_size": 1}});
            post_later(&c, d.url(), body, gap(i))
        })
        .collect();
    let p_legs: Vec<_> = (0..4)
        .rev()
        .map(|i| {
            let body = json!({"prompt": prompt(40 + i, 300), "max_tokens": 1,
                "kv_transfer_params": {"do_remote_decode": true, "transfer_mode": "pull",
                "layerwise": true, "handoff_id": hid(i)}});
            post_later(&c, p.url(), body, gap(4 + 3 - i))
        })
        .collect();
    for (i, leg) in d_legs.into_iter().enumerate() {
        let (s, v) = leg.await.unwrap();
        assert_eq!(s, 200, "{v}");
        assert_eq!(texts(&v), texts_mono[i], "request {i}");
    }
    for leg in p_legs {
        assert_eq!(leg.await.unwrap().0, 200);
    }
    let page = metrics_text(&c, &d).await;
    assert_eq!(
        common::metric_with(&page, "engine_requests_total", "recomputed"),
        0.0,
        "requests recomputed after {:?}: the engines waited on each other",
        started.elapsed()
    );
    released_within(&p, Duration::from_secs(10)).await;
    released_within(&d, Duration::from_secs(10)).await;
    p.stop().await;
    d.stop().await;
    mono.stop().await;
}

/// An engine set with `layerwise_pull = false` does not say it takes one: a proxy pulls it the
/// classic way.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn layerwise_pull_can_be_turned_off() {
    let c = reqwest::Client::new();
    let p = start(EngineConfig {
        layerwise_pull: false,
        ..cfg("prefill", 1)
    })
    .await
    .unwrap();
    assert_eq!(info(&c, &p).await["layerwise_pull"], false);
    p.stop().await;
}
