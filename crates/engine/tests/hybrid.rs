//! A hybrid model (Gemma 3's shape: a sliding window in five of every six layers) through pull
//! and push, across TP sizes: each kind of layer keeps its KV in a KV cache group of its own,
//! a handoff moves every block of the full layers and only the window's blocks of the sliding
//! ones, and D's answers equal one engine's — which reads each sliding layer's window back from
//! the blocks that moved, so a window block that did not arrive changes the answer.

mod common;

use std::time::Duration;

use common::{disaggregated, moved, post, released_within, texts};

use handoff_engine::{start, EngineConfig};
use serde_json::json;

/// The high bits of this file's push handoff ids.
const TAG: u64 = 0x6879_6272;

const WINDOW: u32 = 40;

/// Six layers: layer 5 full, layers 0–4 a window of 40 tokens.
fn hybrid(role: &str, mode: &str, tp: u32) -> EngineConfig {
    EngineConfig {
        num_layers: 6,
        sliding_window: WINDOW,
        full_attention_every: 6,
        ..common::shaped(role, mode, tp)
    }
}

fn prompt(seed: usize, n: usize) -> String {
    common::words("h", seed, n)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hybrid_model_moves_its_windows_in_pull_and_push_across_tp() {
    let c = reqwest::Client::new();
    let mono = start(hybrid("both", "pull", 1)).await.unwrap();
    // 200 tokens: 13 blocks of 16; the window's blocks are those from token 160 (block 10) on.
    let text = prompt(1, 200);
    let (s, one) = post(&c, &mono.url(), json!({"prompt": &text, "max_tokens": 8})).await;
    assert_eq!(s, 200, "{one}");
    assert_eq!(one["usage"]["prompt_tokens"], 200);
    let d = EngineConfig::default();
    // A token of one layer: K and V of every head, bf16.
    let token_layer = f64::from(2 * d.num_kv_heads * d.head_dim * 2);
    let mut id = 0;
    for mode in ["pull", "push"] {
        for (ptp, dtp) in [(1, 1), (2, 1), (1, 2)] {
            let case = format!("{mode} tp {ptp} -> {dtp}");
            let (p, d) = (
                start(hybrid("prefill", mode, ptp)).await.unwrap(),
                start(hybrid("decode", mode, dtp)).await.unwrap(),
            );
            id += 1;
            let (s, v) = disaggregated(&c, mode, (&p, &d), &text, (TAG, id)).await;
            assert_eq!(s, 200, "{case}: {v}");
            assert_eq!(texts(&v), texts(&one), "{case}");
            // The full layer's 200 tokens and each sliding layer's tokens 160..200 (its
            // blocks 10..13, moved exactly: a hybrid model's runs stop at the prompt's end).
            let want = (200.0 + 5.0 * 40.0) * token_layer;
            assert_eq!(moved(&c, mode, (&p, &d)).await, want, "{case}: bytes moved");
            released_within(&p, Duration::from_secs(1)).await;
            p.stop().await;
            d.stop().await;
        }
    }
    mono.stop().await;
}

/// A hybrid engine and one that keeps every token of every layer, or one with another window,
/// do not pair: refused at the handshake, naming both engines' groups.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn engines_with_other_kv_cache_groups_do_not_pair() {
    let c = reqwest::Client::new();
    for other in [0, WINDOW + 8] {
        let p = start(hybrid("prefill", "pull", 1)).await.unwrap();
        let d = start(EngineConfig {
            sliding_window: other,
            ..hybrid("decode", "pull", 1)
        })
        .await
        .unwrap();
        let (s, v) = common::pulled(&c, &p, &d, &prompt(2, 60), 4, 1).await;
        assert_eq!(s, 502, "{v}");
        let msg = v["error"]["message"]
            .as_str()
            .unwrap_or_default()
            .to_string();
        assert!(msg.contains("KV cache groups differ"), "{msg}");
        assert!(
            msg.contains(&format!("window {WINDOW}[0,1,2,3,4]")),
            "{msg}"
        );
        p.stop().await;
        d.stop().await;
    }
}
