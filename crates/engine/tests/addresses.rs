//! Addresses come from the configuration: every listener binds `host`, peers dial the advertised
//! address, and a pull over the tcp transport moves the KV between engines bound to IPv6
//! loopback (nothing falls back to 127.0.0.1). An unspecified bind without an advertised address
//! is refused at start, naming the field.

mod common;

use common::{metric, metrics_text, post, texts};
use handoff_engine::{start, EngineConfig};
use serde_json::json;

fn cfg(role: &str, host: &str) -> EngineConfig {
    EngineConfig {
        role: role.into(),
        host: host.into(),
        port: 0,
        transport: "tcp".into(),
        num_blocks: 256,
        prefill_us_per_token: 1.0,
        decode_step_ms: 0.2,
        decode_us_per_seq: 0.0,
        ..EngineConfig::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pull_between_ipv6_engines_moves_the_kv() {
    let p = start(cfg("prefill", "::1")).await.unwrap();
    let d = start(cfg("decode", "::1")).await.unwrap();
    let mono = start(cfg("both", "::1")).await.unwrap();
    assert!(p.addr.is_ipv6(), "{}", p.addr);
    let c = reqwest::Client::new();
    let text = "the kv cache of a prompt crosses an ipv6 link";
    let (s, pr) = post(
        &c,
        &p.url(),
        json!({"prompt": text, "max_tokens": 1,
               "kv_transfer_params": {"do_remote_decode": true, "do_remote_prefill": false}}),
    )
    .await;
    assert_eq!(s, 200, "{pr}");
    let params = pr["kv_transfer_params"].clone();
    assert_eq!(
        params["remote_host"], "::1",
        "P advertises where it listens: {params}"
    );
    let (s, dr) = post(
        &c,
        &d.url(),
        json!({"prompt": text, "max_tokens": 8, "kv_transfer_params": params}),
    )
    .await;
    assert_eq!(s, 200, "{dr}");
    let (s, mr) = post(&c, &mono.url(), json!({"prompt": text, "max_tokens": 8})).await;
    assert_eq!(s, 200);
    assert_eq!(texts(&dr), texts(&mr));
    // The KV moved; nothing was recomputed.
    let m = metrics_text(&c, &d).await;
    assert!(metric(&m, "handoff_transfer_bytes_total") > 0.0, "{m}");
    assert_eq!(metric(&m, "handoff_requests_failed_total"), 0.0, "{m}");
    for e in [p, d, mono] {
        e.stop().await;
    }
}

/// Off loopback, peers must prove the cluster key: without one (and without `insecure`) the
/// engine does not start, and says what to do.
#[tokio::test]
async fn a_bind_off_loopback_needs_a_cluster_key() {
    for host in ["0.0.0.0", "10.0.0.1"] {
        let err = match start(EngineConfig {
            advertise_host: "10.0.0.1".into(),
            ..cfg("prefill", host)
        })
        .await
        {
            Ok(_) => panic!("{host} without a cluster key must be refused"),
            Err(e) => format!("{e:#}"),
        };
        assert!(
            err.contains("cluster_key_file") && err.contains("keygen"),
            "{host}: {err}"
        );
    }
}

#[tokio::test]
async fn an_unspecified_bind_needs_an_advertised_address() {
    let key = handoff_connector::ClusterKey::generate().unwrap().to_hex();
    let cfg = |role: &str, host: &str| EngineConfig {
        cluster_key: key.clone(),
        ..cfg(role, host)
    };
    for host in ["0.0.0.0", "::"] {
        let err = match start(cfg("prefill", host)).await {
            Ok(_) => panic!("{host} without advertise_host must be refused"),
            Err(e) => e.to_string(),
        };
        assert!(err.contains("advertise_host"), "{host}: {err}");
    }
    // With one, it starts and advertises it.
    let p = start(EngineConfig {
        advertise_host: "127.0.0.1".into(),
        ..cfg("prefill", "0.0.0.0")
    })
    .await
    .unwrap();
    let info: serde_json::Value = reqwest::get(format!(
        "http://127.0.0.1:{}/v1/handoff/info",
        p.addr.port()
    ))
    .await
    .unwrap()
    .json()
    .await
    .unwrap();
    assert_eq!(info["remote_host"], "127.0.0.1", "{info}");
    p.stop().await;
}
