//! A hybrid SSM model (Granite 4's shape: a recurrent state in five of every six layers, full
//! attention in the sixth) through pull and push, across TP and block sizes: each state layer
//! keeps one block a request, a handoff moves that block (the state after every prompt token
//! but the last) and every block of the full layer, and D, which computes the last token
//! itself, answers what one engine does. The first token reads the state back and steps it
//! over the last token, so a state that did not arrive changes the answer
//! (`prompt::tests::a_state_layer_keeps_the_state_before_the_last_token_in_one_block`).

mod common;

use std::time::Duration;

use common::{disaggregated, moved, post, released_within, texts};

use handoff_engine::{start, EngineConfig};
use serde_json::json;

/// The high bits of this file's push handoff ids.
const TAG: u64 = 0x7374_6174;

/// Six layers: layer 5 full, layers 0–4 a recurrent state.
fn ssm(role: &str, mode: &str, tp: u32, block_size: u32) -> EngineConfig {
    EngineConfig {
        block_size,
        num_layers: 6,
        recurrent_state: true,
        full_attention_every: 6,
        ..common::shaped(role, mode, tp)
    }
}

fn prompt(seed: usize, n: usize) -> String {
    common::words("s", seed, n)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_state_model_moves_one_state_block_in_pull_and_push_across_tp_and_block_sizes() {
    let c = reqwest::Client::new();
    let mono = start(ssm("both", "pull", 1, 16)).await.unwrap();
    let text = prompt(1, 200);
    let (s, one) = post(&c, &mono.url(), json!({"prompt": &text, "max_tokens": 8})).await;
    assert_eq!(s, 200, "{one}");
    assert_eq!(one["usage"]["prompt_tokens"], 200);
    let d = EngineConfig::default();
    // A token slot of one layer: K and V of every head, bf16.
    let slot = f64::from(2 * d.num_kv_heads * d.head_dim * 2);
    let mut id = 0;
    for mode in ["pull", "push"] {
        for (ptp, dtp, d_bs) in [(1, 1, 16), (2, 1, 16), (1, 2, 16), (1, 1, 32)] {
            let case = format!("{mode} tp {ptp} -> {dtp}, D's blocks of {d_bs}");
            let (p, d) = (
                start(ssm("prefill", mode, ptp, 16)).await.unwrap(),
                start(ssm("decode", mode, dtp, d_bs)).await.unwrap(),
            );
            id += 1;
            let (s, v) = disaggregated(&c, mode, (&p, &d), &text, (TAG, id)).await;
            assert_eq!(s, 200, "{case}: {v}");
            assert_eq!(texts(&v), texts(&one), "{case}");
            // The full layer's 200 tokens and one slot of each state layer: a state moves
            // whole whatever the prompt's length.
            let want = (200.0 + 5.0) * slot;
            assert_eq!(moved(&c, mode, (&p, &d)).await, want, "{case}: bytes moved");
            released_within(&p, Duration::from_secs(1)).await;
            p.stop().await;
            d.stop().await;
        }
    }
    mono.stop().await;
}

/// A state model and a sliding-window one, or one that keeps every token of every layer, do
/// not pair: refused at the handshake, naming both engines' groups.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_state_model_pairs_only_with_the_same_groups() {
    let c = reqwest::Client::new();
    for window in [0, 40] {
        let p = start(ssm("prefill", "pull", 1, 16)).await.unwrap();
        let d = start(EngineConfig {
            sliding_window: window,
            recurrent_state: false,
            ..ssm("decode", "pull", 1, 16)
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
        assert!(msg.contains("state[0,1,2,3,4]"), "{msg}");
        p.stop().await;
        d.stop().await;
    }
    // A window and a state at once is refused at start-up.
    let both = EngineConfig {
        sliding_window: 40,
        ..ssm("both", "pull", 1, 16)
    };
    let e = start(both).await.err().expect("refused");
    assert!(e.to_string().contains("recurrent_state"), "{e}");
}
