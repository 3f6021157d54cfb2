//! An MLA-shaped model (DeepSeek V2/V3's compressed KV: one latent vector per token, no heads,
//! the same on every tensor-parallel rank) through pull and push, across TP sizes: answers equal
//! one engine's, and each D rank receives the latent once — from one P rank, however many hold a
//! copy.

mod common;

use std::time::Duration;

use common::{disaggregated, moved, post, released_within, texts};

use handoff_engine::{start, EngineConfig};
use serde_json::json;

/// The high bits of this file's push handoff ids.
const TAG: u64 = 0x006d_6c61;

/// DeepSeek-V2's latent: 512 compressed dims and 64 rotary ones, one "head".
fn mla(role: &str, mode: &str, tp: u32) -> EngineConfig {
    EngineConfig {
        num_kv_heads: 1,
        head_dim: 576,
        block_layout: "latent".into(),
        ..common::shaped(role, mode, tp)
    }
}

fn prompt(seed: usize, n: usize) -> String {
    common::words("m", seed, n)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_mla_latent_moves_once_per_d_rank_in_pull_and_push_across_tp() {
    let c = reqwest::Client::new();
    let mono = start(mla("both", "pull", 1)).await.unwrap();
    let text = prompt(1, 120);
    let (s, one) = post(&c, &mono.url(), json!({"prompt": &text, "max_tokens": 8})).await;
    assert_eq!(s, 200, "{one}");
    let mut id = 0;
    for mode in ["pull", "push"] {
        // What a TP 1 pair moves: the latent of every prompt token of every layer, once.
        let (p, d) = (
            start(mla("prefill", mode, 1)).await.unwrap(),
            start(mla("decode", mode, 1)).await.unwrap(),
        );
        id += 1;
        let (s, v) = disaggregated(&c, mode, (&p, &d), &text, (TAG, id)).await;
        assert_eq!(s, 200, "{mode} tp 1 -> 1: {v}");
        assert_eq!(texts(&v), texts(&one), "{mode} tp 1 -> 1");
        let once = moved(&c, mode, (&p, &d)).await;
        // Every token slot of the prompt's blocks (handoff moves whole blocks) × every layer ×
        // 576 bf16 values: one plane, no V.
        let tokens = one["usage"]["prompt_tokens"].as_f64().unwrap();
        let slots = (tokens / 16.0).ceil() * 16.0;
        let layers = f64::from(EngineConfig::default().num_layers);
        assert_eq!(
            once,
            slots * layers * 576.0 * 2.0,
            "{mode}: one latent per token"
        );
        p.stop().await;
        d.stop().await;
        for (ptp, dtp) in [(2, 1), (1, 2), (2, 2)] {
            let case = format!("{mode} tp {ptp} -> {dtp}");
            let (p, d) = (
                start(mla("prefill", mode, ptp)).await.unwrap(),
                start(mla("decode", mode, dtp)).await.unwrap(),
            );
            id += 1;
            let (s, v) = disaggregated(&c, mode, (&p, &d), &text, (TAG, id)).await;
            assert_eq!(s, 200, "{case}: {v}");
            assert_eq!(texts(&v), texts(&one), "{case}");
            // Every D rank holds its own copy; P's other copies only confirm.
            let got = moved(&c, mode, (&p, &d)).await;
            assert_eq!(got, once * f64::from(dtp), "{case}: bytes moved");
            released_within(&p, Duration::from_secs(1)).await;
            p.stop().await;
            d.stop().await;
        }
    }
    mono.stop().await;
}

/// A latent pairs with a latent only: an MLA engine and a K/V engine of the same sizes are
/// refused at the handshake, naming both layouts; a latent with more than one head is refused
/// at start.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_latent_and_k_v_planes_do_not_pair() {
    let c = reqwest::Client::new();
    let p = start(mla("prefill", "pull", 1)).await.unwrap();
    let d = start(EngineConfig {
        block_layout: "token-major".into(),
        ..mla("decode", "pull", 1)
    })
    .await
    .unwrap();
    let (s, v) = common::pulled(&c, &p, &d, &prompt(2, 40), 4, 1).await;
    assert_eq!(s, 502, "{v}");
    let msg = v["error"]["message"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    assert!(
        msg.contains("Latent") && msg.contains("TokenMajor"),
        "{msg}"
    );
    p.stop().await;
    d.stop().await;
    let e = start(EngineConfig {
        num_kv_heads: 2,
        ..mla("decode", "pull", 1)
    })
    .await
    .err()
    .expect("refused");
    let e = e.to_string();
    assert!(e.contains("num_kv_heads") && e.contains("latent"), "{e}");
}
