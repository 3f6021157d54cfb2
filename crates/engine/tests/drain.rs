//! Drain (issue 33): a P told to leave serves the reads of every handoff it holds, refuses new
//! prefills with 503 `draining`, and stops with every block back; with a deadline shorter than
//! the reads, D recomputes what was cut off and nothing hangs or leaks. A draining D refuses new
//! requests and tells their P to release at once. The admin listener drains only for its token.

mod common;

use std::time::Duration;

use common::{
    info, metric, metrics_text, pool_whole_within, post, post_later, released_within, texts,
};
use handoff_engine::{start, EngineConfig, RunningEngine};
use serde_json::{json, Value};

fn cfg(role: &str) -> EngineConfig {
    EngineConfig {
        role: role.into(),
        port: 0,
        transport: "tcp".into(),
        num_blocks: 512,
        prefill_us_per_token: 1.0,
        decode_step_ms: 0.2,
        decode_us_per_seq: 0.0,
        drain_grace_ms: 100,
        drain_timeout_ms: 15_000,
        ..EngineConfig::default()
    }
}

/// A D whose pool takes one request at a time (a prompt is 19 blocks), decoding it slowly: the
/// others wait in its queue (heartbeating) while P holds their KV, unread.
fn busy_decode() -> EngineConfig {
    EngineConfig {
        num_blocks: 30,
        max_batch: 1,
        decode_step_ms: 25.0,
        ..cfg("decode")
    }
}

fn prompt(i: usize) -> String {
    (0..300)
        .map(|w| format!("d{}", (w * 31 + i * 977) % 1500))
        .collect::<Vec<_>>()
        .join(" ")
}

const MAX_TOKENS: u32 = 16;

/// P legs for `n` prompts, then their D legs all at once (in tasks); the D answers' handles.
async fn handoffs_waiting_on_d(
    c: &reqwest::Client,
    p: &RunningEngine,
    d: &RunningEngine,
    n: usize,
) -> Vec<tokio::task::JoinHandle<(u16, Value)>> {
    let mut legs = Vec::new();
    for i in 0..n {
        let (s, pr) = post(
            c,
            &p.url(),
            json!({"prompt": prompt(i), "max_tokens": 1,
                "kv_transfer_params": {"do_remote_decode": true}}),
        )
        .await;
        assert_eq!(s, 200, "{pr}");
        let body = json!({"prompt": prompt(i), "max_tokens": MAX_TOKENS,
            "kv_transfer_params": pr["kv_transfer_params"]});
        legs.push(post_later(c, d.url(), body, Duration::ZERO));
    }
    legs
}

async fn single_engine_texts(
    c: &reqwest::Client,
    mono: &RunningEngine,
    n: usize,
) -> Vec<Vec<String>> {
    let mut out = Vec::new();
    for i in 0..n {
        let (s, v) = post(
            c,
            &mono.url(),
            json!({"prompt": prompt(i), "max_tokens": MAX_TOKENS}),
        )
        .await;
        assert_eq!(s, 200, "{v}");
        out.push(texts(&v));
    }
    out
}

async fn ready_status(c: &reqwest::Client, e: &RunningEngine) -> (u16, Value) {
    let r = c.get(format!("{}/ready", e.url())).send().await.unwrap();
    (r.status().as_u16(), r.json().await.unwrap_or(Value::Null))
}

const N: usize = 4;

/// Every D leg answered 200 with the single engine's text for its prompt.
async fn each_answers_like_the_single_engine(
    legs: Vec<tokio::task::JoinHandle<(u16, Value)>>,
    want: &[Vec<String>],
    what: &str,
) {
    for (i, leg) in legs.into_iter().enumerate() {
        let (s, v) = leg.await.unwrap();
        assert_eq!(s, 200, "{v}");
        assert_eq!(texts(&v), want[i], "request {i}: {what}");
    }
}

/// D recomputed nothing (every request decoded the KV that came from P), gives every block
/// back, and stops with the single engine.
async fn none_recomputed_then_stop(c: &reqwest::Client, d: RunningEngine, mono: RunningEngine) {
    let dm = metrics_text(c, &d).await;
    assert_eq!(
        metric(&dm, "handoff_requests_failed_total"),
        0.0,
        "none recomputed:\n{dm}"
    );
    released_within(&d, Duration::from_secs(5)).await;
    pool_whole_within(c, &d, Duration::from_secs(5)).await;
    d.stop().await;
    mono.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_draining_prefill_serves_every_handoff_it_holds_then_stops() {
    let c = reqwest::Client::new();
    let p = start(cfg("prefill")).await.unwrap();
    let d = start(busy_decode()).await.unwrap();
    let mono = start(cfg("both")).await.unwrap();
    let want = single_engine_texts(&c, &mono, N).await;

    let legs = handoffs_waiting_on_d(&c, &p, &d, N).await;
    // D has taken the requests; all but the one it decodes wait for blocks, their KV unread.
    common::metrics_until(
        &c,
        &d,
        Duration::from_secs(5),
        "requests queued on D",
        |m| metric(m, "engine_requests_waiting") >= (N - 1) as f64,
    )
    .await;
    let held_at_drain = p.connector.as_ref().unwrap().held_blocks().unwrap().0;
    assert!(
        held_at_drain > 0,
        "P holds the handoffs' blocks when the drain starts"
    );
    let drain = async { p.drain().await };
    let probe = async {
        // Grace: not ready, still taking requests; then refusing, with Retry-After.
        let (s, v) = ready_status(&c, &p).await;
        assert_eq!((s, v["draining"].clone()), (503, json!(true)), "{v}");
        tokio::time::sleep(Duration::from_millis(300)).await;
        let r = c
            .post(format!("{}/v1/completions", p.url()))
            .json(&json!({"prompt": prompt(99), "max_tokens": 1,
                "kv_transfer_params": {"do_remote_decode": true}}))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status().as_u16(), 503);
        assert_eq!(r.headers().get("retry-after").unwrap(), "1");
        let v: Value = r.json().await.unwrap();
        assert_eq!(v["error"]["type"], "draining", "{v}");
    };
    let (report, ()) = tokio::join!(drain, probe);
    assert!(!report.timed_out, "{report:?}");
    assert_eq!(
        (report.handoff_blocks_left, report.pool_blocks_left),
        (0, 0)
    );
    // As `handoff engine` does once drained: P is gone before D's answers are read.
    p.stop().await;

    each_answers_like_the_single_engine(legs, &want, "decodes P's KV as a single engine would")
        .await;
    none_recomputed_then_stop(&c, d, mono).await;
}

/// Push: a draining P finishes the prefills it took and the writes D granted it. P prefills
/// slowly (0.6 s per prompt, one after another), so when the drain starts most prefills, and
/// all their writes, are still ahead; every request decodes the single engine's text, none
/// recomputed, and P's drain ends clean.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_draining_push_prefill_finishes_the_writes_it_was_granted() {
    let c = reqwest::Client::new();
    let p = start(EngineConfig {
        mode: "push".into(),
        prefill_us_per_token: 2_000.0,
        ..cfg("prefill")
    })
    .await
    .unwrap();
    let d = start(EngineConfig {
        mode: "push".into(),
        ..cfg("decode")
    })
    .await
    .unwrap();
    let mono = start(cfg("both")).await.unwrap();
    let want = single_engine_texts(&c, &mono, N).await;
    let pi = info(&c, &p).await;
    let mut legs = Vec::new();
    for i in 0..N {
        let hid = format!("{:032x}", 0xd0a1_0000u128 + i as u128);
        let p_body = json!({"prompt": prompt(i), "max_tokens": 1, "kv_transfer_params": {
            "do_remote_decode": true, "transfer_mode": "push", "handoff_id": hid}});
        let d_body = json!({"prompt": prompt(i), "max_tokens": MAX_TOKENS, "kv_transfer_params": {
            "do_remote_prefill": true, "transfer_mode": "push", "handoff_id": hid,
            "remote_engine_id": pi["engine_id"], "remote_host": pi["remote_host"],
            "remote_port": pi["remote_port"], "tp_size": pi["tp_size"]}});
        legs.push((
            post_later(&c, p.url(), p_body, Duration::ZERO),
            post_later(&c, d.url(), d_body, Duration::ZERO),
        ));
    }
    // D has registered every request's blocks with P (they wait for P's writes).
    common::metrics_until(
        &c,
        &d,
        Duration::from_secs(5),
        "D waits for P's writes",
        |m| metric(m, "engine_requests_awaiting_kv") >= N as f64,
    )
    .await;
    let report = p.drain().await;
    assert!(!report.timed_out, "{report:?}");
    assert_eq!(
        (report.handoff_blocks_left, report.pool_blocks_left),
        (0, 0)
    );
    p.stop().await;
    for (i, (pl, dl)) in legs.into_iter().enumerate() {
        let (ps, pv) = pl.await.unwrap();
        assert_eq!(ps, 200, "{pv}");
        let (s, v) = dl.await.unwrap();
        assert_eq!(s, 200, "{v}");
        assert_eq!(texts(&v), want[i], "request {i} decodes the KV P wrote");
    }
    none_recomputed_then_stop(&c, d, mono).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drain_deadline_shorter_than_the_reads_recomputes_the_rest_and_leaks_nothing() {
    let c = reqwest::Client::new();
    let p = start(EngineConfig {
        drain_grace_ms: 50,
        drain_timeout_ms: 300,
        ..cfg("prefill")
    })
    .await
    .unwrap();
    let d = start(busy_decode()).await.unwrap();
    let mono = start(cfg("both")).await.unwrap();
    let want = single_engine_texts(&c, &mono, N).await;

    let legs = handoffs_waiting_on_d(&c, &p, &d, N).await;
    let report = p.drain().await;
    // Each D request takes ~0.4 s and they go one at a time: 0.3 s cannot cover four.
    assert!(report.timed_out, "{report:?}");
    assert!(report.handoff_blocks_left > 0, "{report:?}");
    p.stop().await;

    each_answers_like_the_single_engine(legs, &want, "read or recomputed, the same text").await;
    let dm = metrics_text(&c, &d).await;
    assert!(
        metric(&dm, "handoff_requests_failed_total") > 0.0,
        "what the drain cut off was recomputed, and counted:\n{dm}"
    );
    released_within(&d, Duration::from_secs(5)).await;
    pool_whole_within(&c, &d, Duration::from_secs(5)).await;
    d.stop().await;
    mono.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_draining_decode_refuses_new_requests_and_releases_their_prefill_at_once() {
    let c = reqwest::Client::new();
    let p = start(EngineConfig {
        // A refusal that did not release would hold P's blocks for this long.
        lease_ms: 30_000,
        ..cfg("prefill")
    })
    .await
    .unwrap();
    let d = start(EngineConfig {
        drain_grace_ms: 50,
        ..busy_decode()
    })
    .await
    .unwrap();
    // One request decoding on D when it starts to drain: it finishes.
    let legs = handoffs_waiting_on_d(&c, &p, &d, 1).await;
    let drain = async { d.drain().await };
    let late = async {
        tokio::time::sleep(Duration::from_millis(150)).await;
        let (s, pr) = post(
            &c,
            &p.url(),
            json!({"prompt": prompt(7), "max_tokens": 1,
                "kv_transfer_params": {"do_remote_decode": true}}),
        )
        .await;
        assert_eq!(s, 200, "{pr}");
        let (s, v) = post(
            &c,
            &d.url(),
            json!({"prompt": prompt(7), "max_tokens": 4,
                "kv_transfer_params": pr["kv_transfer_params"]}),
        )
        .await;
        assert_eq!(
            (s, v["error"]["type"].clone()),
            (503, json!("draining")),
            "{v}"
        );
    };
    let (report, ()) = tokio::join!(drain, late);
    assert!(!report.timed_out, "{report:?}");
    for leg in legs {
        let (s, v) = leg.await.unwrap();
        assert_eq!(s, 200, "the request D was decoding finished: {v}");
    }
    // The refused request's blocks came back long before its 30 s lease.
    released_within(&p, Duration::from_secs(3)).await;
    pool_whole_within(&c, &p, Duration::from_secs(3)).await;
    d.stop().await;
    p.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_admin_listener_drains_only_for_its_token() {
    let token = "preStop-token-0123456789";
    let e = start(cfg("prefill")).await.unwrap();
    assert!(
        e.admin_addr.is_none(),
        "no admin listener unless admin_token is set"
    );
    e.stop().await;
    let short = EngineConfig {
        admin_token: "short".into(),
        ..cfg("prefill")
    };
    assert_eq!(short.validate().unwrap_err().field, "admin_token");

    let e = start(EngineConfig {
        admin_token: token.into(),
        ..cfg("prefill")
    })
    .await
    .unwrap();
    let admin = format!("http://{}", e.admin_addr.unwrap());
    let c = reqwest::Client::new();
    for bad in [None, Some("Bearer wrong-token-0123456789"), Some(token)] {
        let mut r = c.post(format!("{admin}/drain"));
        if let Some(h) = bad {
            r = r.header("authorization", h);
        }
        let s = r.send().await.unwrap().status().as_u16();
        assert_eq!(s, 401, "header {bad:?}");
    }
    assert_eq!(
        ready_status(&c, &e).await.0,
        200,
        "refused calls changed nothing"
    );
    let r = c
        .post(format!("{admin}/drain?wait=true"))
        .header("authorization", format!("Bearer {token}"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 200);
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["drained"], true, "{v}");
    assert_eq!(ready_status(&c, &e).await.0, 503);
    e.stop().await;
}
