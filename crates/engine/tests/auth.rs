//! The cluster key, end to end over the tcp transport on loopback: engines with the same key
//! pair and move KV; an engine with another key, or none, is refused at the handshake (counted
//! on P), its requests are recomputed, and no block is held on either side afterwards.

mod common;

use std::time::Duration;

use common::{keyed_tcp, metric, metrics_until, pool_whole_within, post, released_within, texts};
use handoff_connector::ClusterKey;
use handoff_engine::{start, RunningEngine};
use serde_json::{json, Value};

const PROMPT: &str = "the lease is a capability and the fence is its end";

async fn p_leg(client: &reqwest::Client, p: &RunningEngine) -> Value {
    let (s, pr) = post(
        client,
        &p.url(),
        json!({"prompt": PROMPT, "max_tokens": 1,
               "kv_transfer_params": {"do_remote_decode": true}}),
    )
    .await;
    assert_eq!(s, 200, "{pr}");
    pr["kv_transfer_params"].clone()
}

/// D's answer for the prompt, through P, and D's `/metrics` afterwards.
async fn through(client: &reqwest::Client, p: &RunningEngine, d: &RunningEngine) -> Vec<String> {
    let params = p_leg(client, p).await;
    let (s, dr) = post(
        client,
        &d.url(),
        json!({"prompt": PROMPT, "max_tokens": 8, "kv_transfer_params": params}),
    )
    .await;
    assert_eq!(s, 200, "{dr}");
    texts(&dr)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_engines_with_the_cluster_key_pair() {
    let key = ClusterKey::generate().unwrap();
    let client = reqwest::Client::new();
    let mono = start(keyed_tcp("both", None)).await.unwrap();
    let (s, m) = post(
        &client,
        &mono.url(),
        json!({"prompt": PROMPT, "max_tokens": 8}),
    )
    .await;
    assert_eq!(s, 200);
    let expected = texts(&m);

    let p = start(keyed_tcp("prefill", Some(&key))).await.unwrap();
    let member = start(keyed_tcp("decode", Some(&key))).await.unwrap();
    assert_eq!(through(&client, &p, &member).await, expected);
    let page = metrics_until(
        &client,
        &member,
        Duration::from_secs(5),
        "a ready transfer",
        |m| metric(m, "handoff_transfer_bytes_total") > 0.0,
    )
    .await;
    assert_eq!(
        metric(&page, "handoff_requests_failed_total"),
        0.0,
        "{page}"
    );

    // Another key, and no key: the handshake fails, the request is recomputed (same output),
    // P counts the refusal, and nothing stays held.
    let other = ClusterKey::generate().unwrap();
    for (n, outsider) in [Some(&other), None].into_iter().enumerate() {
        let d = start(keyed_tcp("decode", outsider)).await.unwrap();
        assert_eq!(through(&client, &p, &d).await, expected);
        let page = metrics_until(
            &client,
            &d,
            Duration::from_secs(5),
            "a failed transfer",
            |m| metric(m, "handoff_requests_failed_total") >= 1.0,
        )
        .await;
        assert_eq!(metric(&page, "handoff_transfer_bytes_total"), 0.0, "{page}");
        metrics_until(
            &client,
            &p,
            Duration::from_secs(5),
            "P counts the refusals",
            |m| metric(m, "handoff_side_connections_refused_total") >= (n + 1) as f64,
        )
        .await;
        released_within(&d, Duration::from_secs(5)).await;
        pool_whole_within(&client, &d, Duration::from_secs(5)).await;
        d.stop().await;
    }
    // P's blocks of the refused requests came back (the D that never paired never read them;
    // the lease ran out, or D's release reached it), and the member still works.
    released_within(&p, Duration::from_secs(15)).await;
    assert_eq!(through(&client, &p, &member).await, expected);
    for e in [p, member, mono] {
        e.stop().await;
    }
}
