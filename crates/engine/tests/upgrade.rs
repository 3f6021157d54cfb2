//! Rolling upgrades: an engine of this release and one of the previous release's protocol
//! (version 7) move KV in both directions, pull and push, over tcp, and nothing is recomputed.
//! The previous release is stood in for by an engine pinned to version 7 (`protocol_version`):
//! it refuses a newer hello as a build of version 7 does (closed without a reply), and says
//! every frame in version 7, whose bytes `handoff-proto`'s `versions.rs` checks against frames
//! the previous release's own encoder wrote.

mod common;

use std::time::Duration;

use common::{
    both_legs, info, metric, metric_with, metrics_text, post, pulled, released_within, texts,
};

use handoff_engine::{start, EngineConfig, RunningEngine};
use serde_json::{json, Value};

const PREVIOUS: u8 = handoff_proto::OLDEST_PROTOCOL_VERSION;
const THIS: u8 = handoff_proto::PROTOCOL_VERSION;

fn cfg(role: &str, mode: &str, protocol_version: u8) -> EngineConfig {
    EngineConfig {
        role: role.into(),
        port: 0,
        transport: "tcp".into(),
        mode: mode.into(),
        protocol_version,
        num_blocks: 256,
        prefill_us_per_token: 1.0,
        decode_step_ms: 0.2,
        decode_us_per_seq: 0.0,
        ..EngineConfig::default()
    }
}

fn prompt(seed: usize) -> String {
    (0..90)
        .map(|i| format!("u{}", (i * 37 + seed * 113) % 3000))
        .collect::<Vec<_>>()
        .join(" ")
}

/// One request through P and D in `mode`: D's answer.
async fn through(
    c: &reqwest::Client,
    p: &RunningEngine,
    d: &RunningEngine,
    mode: &str,
    text: &str,
    id: u64,
) -> (u16, Value) {
    if mode == "pull" {
        return pulled(c, p, d, text, 8, 1).await;
    }
    let pi = info(c, p).await;
    let hid = format!("{:032x}", 0x7570_6772_6164_6500_u128 << 64 | u128::from(id));
    let p_body = json!({"prompt": text, "max_tokens": 1, "kv_transfer_params": {
        "do_remote_decode": true, "do_remote_prefill": false, "transfer_mode": "push", "handoff_id": hid}});
    let d_body = json!({"prompt": text, "max_tokens": 8, "kv_transfer_params": {
        "do_remote_prefill": true, "do_remote_decode": false, "transfer_mode": "push", "handoff_id": hid,
        "remote_engine_id": pi["engine_id"], "remote_host": pi["remote_host"], "remote_port": pi["remote_port"],
        "tp_size": pi["tp_size"]}});
    let ((ps, pv), d_answer) = both_legs(c, (p, p_body), (d, d_body), true).await;
    assert_eq!(ps, 200, "{pv}");
    d_answer
}

/// P speaks `p_version` at most, D `d_version`: two requests, each decoded from KV that moved
/// (D read or was written bytes, failed nothing), equal to a monolithic engine's answer, and P
/// holds nothing afterwards.
async fn pair(mode: &str, p_version: u8, d_version: u8) {
    let c = reqwest::Client::new();
    let mono = start(cfg("both", "pull", THIS)).await.unwrap();
    let p = start(cfg("prefill", mode, p_version)).await.unwrap();
    let d = start(cfg("decode", mode, d_version)).await.unwrap();
    // Routers pair by the compatibility key: old and new must show the same.
    assert_eq!(
        info(&c, &p).await["compat_key"],
        info(&c, &d).await["compat_key"]
    );
    for i in 0..2 {
        let text = prompt(i);
        let (s, want) = post(&c, &mono.url(), json!({"prompt": text, "max_tokens": 8})).await;
        assert_eq!(s, 200, "{want}");
        let (s, got) = through(&c, &p, &d, mode, &text, i as u64 + 1).await;
        assert_eq!(s, 200, "{got}");
        assert_eq!(
            texts(&got),
            texts(&want),
            "request {i}: P/D equals one engine"
        );
    }
    let dm = metrics_text(&c, &d).await;
    let pm = metrics_text(&c, &p).await;
    // The side that posts the transfers counts its bytes: D reads (pull), P writes (push).
    let moved =
        metric(&dm, "handoff_transfer_bytes_total") + metric(&pm, "handoff_transfer_bytes_total");
    assert!(moved > 0.0, "KV moved: {dm}\n{pm}");
    assert_eq!(
        metric(&dm, "handoff_requests_failed_total"),
        0.0,
        "nothing recomputed: {dm}"
    );
    let refused = metric_with(
        &pm,
        "handoff_side_connections_refused_total",
        "reason=\"handshake\"",
    );
    if p_version < d_version {
        // The power of the test: D's first hello, in this release's version, was closed
        // without a reply as the previous release closes it, and D said it again in the
        // previous version.
        assert!(
            refused >= 1.0,
            "P pinned to {p_version} refused the newer hello: {pm}"
        );
    } else {
        assert_eq!(refused, 0.0, "{pm}");
    }
    assert_eq!(metric(&pm, "handoff_handshakes_refused_total"), 0.0, "{pm}");
    assert_eq!(
        metric_with(&pm, "handoff_handoffs_ended_total", "expired"),
        0.0,
        "{pm}"
    );
    released_within(&p, Duration::from_secs(2)).await;
    for e in [p, d, mono] {
        e.stop().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_previous_release_p_serves_this_release_s_d_pull() {
    pair("pull", PREVIOUS, THIS).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn this_release_s_p_serves_a_previous_release_d_pull() {
    pair("pull", THIS, PREVIOUS).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_previous_release_p_serves_this_release_s_d_push() {
    pair("push", PREVIOUS, THIS).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn this_release_s_p_serves_a_previous_release_d_push() {
    pair("push", THIS, PREVIOUS).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_version_this_build_does_not_speak_is_refused_at_start() {
    let e = start(cfg("prefill", "pull", PREVIOUS - 1)).await;
    let err = e.err().expect("refused").to_string();
    assert!(err.contains("protocol_version"), "{err}");
}
