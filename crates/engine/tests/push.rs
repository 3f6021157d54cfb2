//! Push mode end to end in one process (mem transport): D reserves and registers its blocks,
//! P writes its KV layer by layer while its prefill runs, and the output equals a monolithic
//! engine's, whichever leg arrives first.

mod common;

use std::time::Duration;

use common::{released_within, texts};

use handoff_engine::{start, EngineConfig, RunningEngine};
use serde_json::{json, Value};

fn cfg(role: &str, tp: u32) -> EngineConfig {
    EngineConfig {
        role: role.into(),
        port: 0,
        transport: "mem".into(),
        mode: "push".into(),
        tp,
        num_blocks: 512,
        prefill_us_per_token: 20.0,
        decode_step_ms: 0.2,
        decode_us_per_seq: 0.0,
        ..EngineConfig::default()
    }
}

fn prompt(seed: usize, words: usize) -> String {
    (0..words)
        .map(|i| format!("p{}", (i * 131 + seed * 71) % 4000))
        .collect::<Vec<_>>()
        .join(" ")
}

fn handoff_id(n: u64) -> String {
    format!(
        "{:032x}",
        0x7075_7368_0000_0000_0000_0000_0000_0000u128 | n as u128
    )
}

/// Both legs as the push proxy sends them; `d_first` delays the P leg.
async fn push(
    c: &reqwest::Client,
    p: &RunningEngine,
    d: &RunningEngine,
    text: &str,
    n: u32,
    id: u64,
    d_first: bool,
) -> (u16, Value) {
    common::pushed(c, (p, d), text, n, &handoff_id(id), d_first).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn push_output_equals_monolithic_in_both_orders() {
    let c = reqwest::Client::new();
    let mono = start(EngineConfig {
        mode: "pull".into(),
        ..cfg("both", 1)
    })
    .await
    .unwrap();
    let mut id = 0;
    // The last case streams layer by layer between heads-outermost pools (and a different
    // block size on D), the layout for heterogeneous pairs.
    for (ptp, dtp, pool, d_bs) in [
        (1, 1, "blocks-outermost", 16),
        (1, 2, "blocks-outermost", 16),
        (2, 1, "blocks-outermost", 16),
        (1, 2, "heads-outermost", 32),
    ] {
        let p = start(EngineConfig {
            kv_pool_layout: pool.into(),
            ..cfg("prefill", ptp)
        })
        .await
        .unwrap();
        let d = start(EngineConfig {
            kv_pool_layout: pool.into(),
            block_size: d_bs,
            ..cfg("decode", dtp)
        })
        .await
        .unwrap();
        for (i, words) in [7usize, 16, 200, 900].into_iter().enumerate() {
            for d_first in [true, false] {
                for n in [1, 3] {
                    id += 1;
                    let text = prompt(i * 10 + ptp as usize, words);
                    let m: Value = c
                        .post(format!("{}/v1/completions", mono.url()))
                        .json(&json!({"prompt": text, "max_tokens": 8, "n": n}))
                        .send()
                        .await
                        .unwrap()
                        .json()
                        .await
                        .unwrap();
                    let (s, v) = push(&c, &p, &d, &text, n, id, d_first).await;
                    assert_eq!(s, 200, "{v}");
                    assert_eq!(
                        texts(&v),
                        texts(&m),
                        "P tp {ptp} D tp {dtp} {pool}, {words} words, d_first {d_first}"
                    );
                }
            }
        }
        // A bound against leaks, not a timing assertion: on a starved host a late heartbeat
        // can send a handoff through its grace periods before the blocks come back.
        released_within(&p, Duration::from_secs(10)).await;
        released_within(&d, Duration::from_secs(10)).await;
        let (_, ended) = common::producer_stats(&p);
        assert_eq!(ended.get("done").copied().unwrap_or(0), 16, "{ended:?}");
        p.stop().await;
        d.stop().await;
    }
    mono.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn push_d_pool_full_answers_at_once_and_releases_p() {
    let c = reqwest::Client::new();
    let p = start(cfg("prefill", 1)).await.unwrap();
    let d = start(EngineConfig {
        num_blocks: 30,
        decode_step_ms: 20.0,
        ..cfg("decode", 1)
    })
    .await
    .unwrap();
    // A long local request holds most of D's pool.
    let hog = c
        .post(format!("{}/v1/completions", d.url()))
        .json(&json!({"prompt": prompt(2, 100), "max_tokens": 300, "stream": true}))
        .send()
        .await
        .unwrap();
    assert_eq!(hog.status(), 200);
    let start_t = std::time::Instant::now();
    let (s, v) = push(&c, &p, &d, &prompt(1, 400), 1, 999, true).await;
    assert_eq!(s, 503, "{v}");
    assert!(start_t.elapsed() < Duration::from_secs(5));
    let held = p.connector.as_ref().unwrap().held_blocks().unwrap();
    released_within(&p, Duration::from_secs(2)).await;
    let (_, ended) = common::producer_stats(&p);
    assert_eq!(ended.get("rejected"), Some(&1), "{ended:?} (held {held:?})");
    drop(hog);
    p.stop().await;
    d.stop().await;
}
