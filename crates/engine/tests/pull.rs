//! P/D pull end to end inside one process (mem transport): the reference engine's output through
//! a prefill engine and a decode engine equals a monolithic engine's, for n=1 and n=4.

mod common;

use handoff_connector::Hooks;
use std::time::Duration;

use common::{
    metric, metrics_text, metrics_until, pool_whole_within, post, released_within, texts,
};

use handoff_engine::{start, EngineConfig, RunningEngine};
use serde_json::{json, Value};

fn cfg(role: &str) -> EngineConfig {
    EngineConfig {
        role: role.into(),
        port: 0,
        transport: "mem".into(),
        num_blocks: 512,
        // Fast cost model: the tests check behaviour, not speed.
        prefill_us_per_token: 1.0,
        decode_step_ms: 0.2,
        decode_us_per_seq: 0.0,
        ..EngineConfig::default()
    }
}

fn prompt(seed: usize, words: usize) -> String {
    (0..words)
        .map(|i| format!("w{}", (i * 7919 + seed * 104_729) % 5000))
        .collect::<Vec<_>>()
        .join(" ")
}

/// What the proxy does: P with max_tokens 1 and do_remote_decode, then D with P's params.
async fn disaggregated(
    client: &reqwest::Client,
    p: &RunningEngine,
    d: &RunningEngine,
    text: &str,
    n: u32,
) -> Value {
    let (s, pr) = post(
        client,
        &p.url(),
        json!({"prompt": text, "max_tokens": 1, "stream": false,
               "kv_transfer_params": {"do_remote_decode": true, "do_remote_prefill": false,
                 "remote_engine_id": null, "remote_block_ids": null, "remote_host": null, "remote_port": null}}),
    )
    .await;
    assert_eq!(s, 200, "{pr}");
    let params = pr["kv_transfer_params"].clone();
    assert_eq!(params["do_remote_prefill"], true);
    let (s, dr) = post(
        client,
        &d.url(),
        json!({"prompt": text, "max_tokens": 12, "n": n, "kv_transfer_params": params}),
    )
    .await;
    assert_eq!(s, 200, "{dr}");
    dr
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn disaggregated_output_equals_monolithic() {
    let p = start(cfg("prefill")).await.unwrap();
    let d = start(cfg("decode")).await.unwrap();
    let mono = start(cfg("both")).await.unwrap();
    let client = reqwest::Client::new();
    for (i, words) in [5usize, 16, 17, 100, 700].into_iter().enumerate() {
        let text = prompt(i, words);
        for n in [1u32, 4] {
            let (s, m) = post(
                &client,
                &mono.url(),
                json!({"prompt": text, "max_tokens": 12, "n": n}),
            )
            .await;
            assert_eq!(s, 200);
            let dis = disaggregated(&client, &p, &d, &text, n).await;
            assert_eq!(texts(&dis), texts(&m), "prompt of {words} words, n={n}");
            assert_eq!(texts(&m).len(), n as usize);
        }
    }
    // Siblings differ from each other (n>1 is not n copies of one answer).
    let (_, m) = post(
        &client,
        &mono.url(),
        json!({"prompt": prompt(9, 30), "max_tokens": 8, "n": 4}),
    )
    .await;
    let t = texts(&m);
    assert!(t.iter().skip(1).any(|x| *x != t[0]));
    released_within(&p, Duration::from_secs(5)).await;
    released_within(&d, Duration::from_secs(5)).await;
    // Every handoff ended because D read it, not by a lease.
    let (live, ended) = common::producer_stats(&p);
    assert_eq!(live, 0);
    assert_eq!(ended.get("done"), Some(&10), "{ended:?}");
    for e in [p, d, mono] {
        e.stop().await;
    }
}

/// vllm-router and vLLM's toy proxy pass the client's `n` to P unchanged. P prefills once and
/// holds one handoff (its answer has n choices); D, given the same n and P's params, reads once
/// and fans out: the output equals the monolithic engine's, and P's blocks go back when D's
/// READ ends, not at lease end. (P used to answer 400 to n>1.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_p_leg_with_n_2_prefills_once_and_d_fans_out() {
    let p = start(cfg("prefill")).await.unwrap();
    let d = start(cfg("decode")).await.unwrap();
    let mono = start(cfg("both")).await.unwrap();
    let client = reqwest::Client::new();
    let text = prompt(41, 300);
    let body = |n: u32| {
        json!({"prompt": text, "max_tokens": 1, "n": n, "stream": false,
               "kv_transfer_params": {"do_remote_decode": true, "do_remote_prefill": false,
                 "remote_engine_id": null, "remote_block_ids": null, "remote_host": null, "remote_port": null}})
    };
    // What one handoff of this prompt holds on P.
    let (s, one) = post(&client, &p.url(), body(1)).await;
    assert_eq!(s, 200, "{one}");
    let held_by_one = p.connector.as_ref().unwrap().held_blocks().unwrap().0;
    assert!(held_by_one > 0);
    p.connector
        .as_ref()
        .unwrap()
        .release_from_proxy(
            &handoff_proto::KvTransferParams::from_json(&one["kv_transfer_params"]).unwrap(),
        )
        .unwrap();
    released_within(&p, Duration::from_secs(5)).await;

    let (s, pr) = post(&client, &p.url(), body(2)).await;
    assert_eq!(s, 200, "{pr}");
    assert_eq!(pr["choices"].as_array().map(Vec::len), Some(2), "{pr}");
    assert_eq!(pr["usage"]["completion_tokens"], 2, "{pr}");
    assert_eq!(
        p.connector.as_ref().unwrap().held_blocks().unwrap().0,
        held_by_one,
        "P holds more than one handoff's blocks for one n=2 request"
    );
    let (s, dr) = post(
        &client,
        &d.url(),
        json!({"prompt": text, "max_tokens": 12, "n": 2, "kv_transfer_params": pr["kv_transfer_params"]}),
    )
    .await;
    assert_eq!(s, 200, "{dr}");
    let (_, m) = post(
        &client,
        &mono.url(),
        json!({"prompt": text, "max_tokens": 12, "n": 2}),
    )
    .await;
    assert_eq!(texts(&dr), texts(&m));
    released_within(&p, Duration::from_secs(2)).await;
    released_within(&d, Duration::from_secs(2)).await;
    let (live, ended) = common::producer_stats(&p);
    assert_eq!(live, 0);
    assert_eq!(ended.get("done"), Some(&1), "{ended:?}");
    for e in [p, d, mono] {
        e.stop().await;
    }
}

async fn p_leg(client: &reqwest::Client, p: &RunningEngine, text: &str) -> Value {
    let (s, pr) = post(
        client,
        &p.url(),
        json!({"prompt": text, "max_tokens": 1, "stream": false,
               "kv_transfer_params": {"do_remote_decode": true, "do_remote_prefill": false,
                 "remote_engine_id": null, "remote_block_ids": null, "remote_host": null, "remote_port": null}}),
    )
    .await;
    assert_eq!(s, 200, "{pr}");
    pr["kv_transfer_params"].clone()
}

/// A P leg asked as a stream carries its `kv_transfer_params` too (in a chunk of their own), so
/// the caller can hand them to D: the KV is pulled and the output is the monolithic engine's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_streamed_p_leg_carries_its_kv_transfer_params() {
    let p = start(cfg("prefill")).await.unwrap();
    let d = start(cfg("decode")).await.unwrap();
    let mono = start(cfg("both")).await.unwrap();
    let client = reqwest::Client::new();
    let text = prompt(3, 60);
    let sse = client
        .post(format!("{}/v1/completions", p.url()))
        .json(&json!({"prompt": text, "max_tokens": 1, "stream": true,
               "kv_transfer_params": {"do_remote_decode": true, "do_remote_prefill": false}}))
        .timeout(Duration::from_secs(30))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let params: Vec<Value> = sse
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter_map(|d| serde_json::from_str::<Value>(d).ok())
        .filter_map(|v| v.get("kv_transfer_params").cloned())
        .collect();
    assert_eq!(params.len(), 1, "{sse}");
    assert_eq!(params[0]["do_remote_prefill"], true, "{sse}");
    let (s, dr) = post(
        &client,
        &d.url(),
        json!({"prompt": text, "max_tokens": 6, "kv_transfer_params": params[0]}),
    )
    .await;
    assert_eq!(s, 200, "{dr}");
    let (_, m) = post(
        &client,
        &mono.url(),
        json!({"prompt": text, "max_tokens": 6}),
    )
    .await;
    assert_eq!(texts(&dr), texts(&m));
    released_within(&p, Duration::from_secs(5)).await;
    let (_, ended) = common::producer_stats(&p);
    assert_eq!(
        ended.get("done"),
        Some(&1),
        "read by D, not ended by its lease: {ended:?}"
    );
    for e in [p, d, mono] {
        e.stop().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rejection_before_admission_releases_p_at_once() {
    let p = start(cfg("prefill")).await.unwrap();
    let d = start(EngineConfig {
        max_model_len: 256,
        ..cfg("decode")
    })
    .await
    .unwrap();
    let client = reqwest::Client::new();
    // Oversized for D (prompt + max_tokens > D's max_model_len), fine for P.
    let text = prompt(1, 200);
    let params = p_leg(&client, &p, &text).await;
    let (s, body) = post(
        &client,
        &d.url(),
        json!({"prompt": text, "max_tokens": 100, "kv_transfer_params": params}),
    )
    .await;
    assert_eq!(s, 400, "{body}");
    assert!(body["error"]["message"]
        .as_str()
        .unwrap()
        .contains("max_model_len"));
    // The lease is 10 s: a release within a second can only be the rejection's.
    released_within(&p, Duration::from_secs(1)).await;
    // Invalid params (a handoff id that is not one) are refused too, and name the problem.
    let mut bad = p_leg(&client, &p, &text).await;
    bad["remote_block_ids"] = json!("many");
    let (s, body) = post(
        &client,
        &d.url(),
        json!({"prompt": text, "max_tokens": 4, "kv_transfer_params": bad}),
    )
    .await;
    assert_eq!(s, 400, "{body}");
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("kv_transfer_params"),
        "{body}"
    );
    released_within(&p, Duration::from_secs(1)).await;
    let (_, ended) = common::producer_stats(&p);
    assert_eq!(ended.get("rejected"), Some(&2), "{ended:?}");
    for e in [p, d] {
        e.stop().await;
    }
}

/// A client (the proxy) that leaves while P prefills never sees the params, so no D ever will:
/// P keeps no handoff for it, and its blocks are back as soon as the prefill ends, not at lease
/// end (10 s here).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_leaving_during_the_p_leg_releases_p_at_once() {
    let p = start(EngineConfig {
        prefill_us_per_token: 1000.0,
        ..cfg("prefill")
    })
    .await
    .unwrap();
    let client = reqwest::Client::new();
    let text = prompt(11, 400);
    let gone = client
        .post(format!("{}/v1/completions", p.url()))
        .json(&json!({"prompt": text, "max_tokens": 1,
            "kv_transfer_params": {"do_remote_decode": true, "do_remote_prefill": false}}))
        .timeout(Duration::from_millis(100))
        .send()
        .await;
    assert!(
        gone.is_err(),
        "the prefill takes ~400 ms; the client gave up at 100 ms"
    );
    // The prefill runs on after the client left; once it ended, nothing is held.
    metrics_until(
        &client,
        &p,
        Duration::from_secs(5),
        "the prefill's end",
        |m| m.contains("outcome=\"aborted\"") || m.contains("outcome=\"prefilled_for_remote\""),
    )
    .await;
    released_within(&p, Duration::from_secs(2)).await;
    pool_whole_within(&client, &p, Duration::from_secs(2)).await;
    let (live, ended) = common::producer_stats(&p);
    assert_eq!(
        (live, ended.values().sum::<u64>()),
        (0, 0),
        "no handoff was made for a prompt whose client left: {ended:?}"
    );
    p.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_disconnect_mid_stream_releases_everything() {
    let p = start(cfg("prefill")).await.unwrap();
    let d = start(EngineConfig {
        decode_step_ms: 20.0,
        ..cfg("decode")
    })
    .await
    .unwrap();
    let client = reqwest::Client::new();
    let text = prompt(2, 300);
    let params = p_leg(&client, &p, &text).await;
    let resp = client
        .post(format!("{}/v1/completions", d.url()))
        .json(&json!({"prompt": text, "max_tokens": 200, "stream": true, "kv_transfer_params": params}))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let mut stream = resp.bytes_stream();
    use futures_util::StreamExt;
    let first = stream.next().await.unwrap().unwrap();
    assert!(String::from_utf8_lossy(&first).contains("data:"));
    drop(stream);
    released_within(&p, Duration::from_secs(2)).await;
    // D's pool is whole again once the abandoned sequence is reaped.
    metrics_until(
        &client,
        &d,
        Duration::from_secs(5),
        "D still holds blocks",
        |m| metric(m, "engine_kv_blocks_used") == 0.0 && metric(m, "handoff_kv_blocks_held") == 0.0,
    )
    .await;
    for e in [p, d] {
        e.stop().await;
    }
}

/// The JSON vLLM's toy proxy (tests/v1/kv_connector/nixl_integration/toy_proxy_server.py)
/// sends, byte for byte in its keys, drives a handoff P and D: wire compatibility.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vllm_toy_proxy_json_drives_p_and_d() {
    let p = start(cfg("prefill")).await.unwrap();
    let d = start(cfg("decode")).await.unwrap();
    let mono = start(cfg("both")).await.unwrap();
    let client = reqwest::Client::new();
    let messages = json!([{"role": "user", "content": prompt(3, 64)}]);
    // Leg 1, as the toy proxy builds it from the client's request.
    let req_id = "0b9c1e0e-6f7a-4d3b-9a51-2f4f1c7e8d21";
    let p_req = json!({
        "model": "handoff-synthetic-8b", "messages": messages, "max_tokens": 1,
        "max_completion_tokens": 1, "stream": false,
        "kv_transfer_params": {"do_remote_decode": true, "do_remote_prefill": false,
            "remote_engine_id": null, "remote_block_ids": null, "remote_host": null, "remote_port": null}
    });
    let pr: Value = client
        .post(format!("{}/v1/chat/completions", p.url()))
        .header("X-Request-Id", req_id)
        .json(&p_req)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let params = pr["kv_transfer_params"].clone();
    for key in [
        "do_remote_prefill",
        "do_remote_decode",
        "remote_engine_id",
        "remote_block_ids",
        "remote_host",
        "remote_port",
        "tp_size",
        "remote_request_id",
    ] {
        assert!(
            params.get(key).is_some(),
            "P's params lack vLLM key {key}: {params}"
        );
    }
    assert_eq!(params["remote_request_id"], req_id);
    // Leg 2: the client's request, streamed, with P's params.
    let d_req = json!({"model": "handoff-synthetic-8b", "messages": messages, "max_tokens": 10, "stream": true, "kv_transfer_params": params});
    let body = client
        .post(format!("{}/v1/chat/completions", d.url()))
        .header("X-Request-Id", req_id)
        .json(&d_req)
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let mut text = String::new();
    for line in body.lines().filter_map(|l| l.strip_prefix("data: ")) {
        if line == "[DONE]" {
            continue;
        }
        let v: Value = serde_json::from_str(line).unwrap();
        assert_eq!(v["object"], "chat.completion.chunk");
        text.push_str(v["choices"][0]["delta"]["content"].as_str().unwrap_or(""));
    }
    assert!(body.trim_end().ends_with("data: [DONE]"));
    let m: Value = client
        .post(format!("{}/v1/chat/completions", mono.url()))
        .json(&json!({"messages": messages, "max_tokens": 10}))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(
        text,
        m["choices"][0]["message"]["content"].as_str().unwrap()
    );
    released_within(&p, Duration::from_secs(2)).await;
    for e in [p, d, mono] {
        e.stop().await;
    }
}

/// Checks the exposition format: every sample is `name{labels} value` with a declared family.
fn assert_prometheus_text(text: &str) {
    assert!(text.trim_end().ends_with("# EOF"), "missing # EOF");
    let mut families = std::collections::HashSet::new();
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            families.insert(rest.split(' ').next().unwrap().to_string());
            continue;
        }
        if line.starts_with('#') || line.is_empty() {
            continue;
        }
        let (name_labels, value) = line
            .rsplit_once(' ')
            .unwrap_or_else(|| panic!("bad line {line:?}"));
        assert!(value.parse::<f64>().is_ok(), "bad value in {line:?}");
        let name = name_labels.split('{').next().unwrap();
        if name_labels.contains('{') {
            assert!(name_labels.ends_with('}'), "bad labels in {line:?}");
        }
        let family = ["_total", "_bucket", "_sum", "_count", "_created"]
            .iter()
            .find_map(|s| name.strip_suffix(s))
            .unwrap_or(name);
        assert!(
            families.contains(family) || families.contains(name),
            "sample {name} has no # TYPE"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_parse_and_held_gauge_returns_to_zero() {
    let p = start(cfg("prefill")).await.unwrap();
    let d = start(cfg("decode")).await.unwrap();
    let client = reqwest::Client::new();
    let text = prompt(4, 120);
    let params = p_leg(&client, &p, &text).await;
    let held = metrics_text(&client, &p).await;
    assert_prometheus_text(&held);
    assert!(
        metric(&held, "handoff_kv_blocks_held") > 0.0,
        "P holds the handoff's blocks while D has not read:\n{held}"
    );
    let (s, _) = post(
        &client,
        &d.url(),
        json!({"prompt": text, "max_tokens": 3, "kv_transfer_params": params}),
    )
    .await;
    assert_eq!(s, 200);
    released_within(&p, Duration::from_secs(2)).await;
    tokio::time::sleep(Duration::from_millis(20)).await;
    for e in [&p, &d] {
        let m = metrics_text(&client, e).await;
        assert_prometheus_text(&m);
        assert_eq!(metric(&m, "handoff_kv_blocks_held"), 0.0, "{m}");
    }
    let dm = metrics_text(&client, &d).await;
    assert!(metric(&dm, "handoff_transfer_bytes_total") > 0.0);
    // The request's timeline: each engine observed its phases once.
    let phase = |m: &str, phase: &str| {
        let key = format!("engine_phase_seconds_count{{phase=\"{phase}\"}}");
        m.lines()
            .find(|l| l.starts_with(&key))
            .and_then(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
    };
    let pm = metrics_text(&client, &p).await;
    assert_eq!(phase(&pm, "prefill"), Some(1.0), "{pm}");
    assert_eq!(phase(&pm, "kv_wait"), None, "P waits for no KV");
    for ph in ["queued", "kv_wait", "first_token"] {
        assert_eq!(phase(&dm, ph), Some(1.0), "D's {ph}:\n{dm}");
    }
    assert_eq!(phase(&dm, "prefill"), None, "D prefilled nothing");
    assert!(metric(&dm, "handoff_heartbeats_total") > 0.0);
    let pm = metrics_text(&client, &p).await;
    assert_eq!(
        pm.lines()
            .find(|l| l.starts_with("handoff_handoffs_ended_total{reason=\"done\"}"))
            .map(|l| l.rsplit(' ').next().unwrap().to_string()),
        Some("1".to_string())
    );
    for e in [p, d] {
        e.stop().await;
    }
}

/// Every engine publishes a compatibility key (in `/v1/handoff/info` and as
/// `handoff_compat_info` on `/metrics`) that a router pairs P and D by: the same for engines
/// that can exchange KV whatever their role or block size, different when a setting both must
/// share differs (here the KV digest).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn engines_publish_a_compatibility_key_that_differs_when_they_cannot_pair() {
    let a = start(cfg("prefill")).await.unwrap();
    let b = start(EngineConfig {
        block_size: 32,
        ..cfg("decode")
    })
    .await
    .unwrap();
    let c = start(EngineConfig {
        kv_digest: true,
        ..cfg("decode")
    })
    .await
    .unwrap();
    let client = reqwest::Client::new();
    let mut keys = Vec::new();
    for e in [&a, &b, &c] {
        let i = common::info(&client, e).await;
        keys.push(i["compat_key"].as_str().unwrap_or_default().to_string());
    }
    assert_eq!(keys[0].len(), 12, "{keys:?}");
    assert_eq!(keys[0], keys[1], "role and block size may differ");
    assert_ne!(
        keys[0], keys[2],
        "a P and a D that disagree on the digest cannot pair"
    );
    let m = metrics_text(&client, &a).await;
    let line = format!("handoff_compat_info{{key=\"{}\"}} 1", keys[0]);
    assert!(m.contains(&line), "no {line} in /metrics");
    for e in [a, b, c] {
        e.stop().await;
    }
}

/// `/ready` says the engine takes work (its scheduler and connector run); `/health` that it
/// answers at all.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_running_engine_is_ready() {
    let p = start(cfg("prefill")).await.unwrap();
    let client = reqwest::Client::new();
    let r = client
        .get(format!("{}/ready", p.url()))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let body: Value = r.json().await.unwrap();
    assert_eq!(body["ready"], true, "{body}");
    assert_eq!(body["connector"], true, "{body}");
    p.stop().await;
}
