//! P/D pull end to end inside one process (mem transport): the reference engine's output through
//! a prefill engine and a decode engine equals a monolithic engine's, for n=1 and n=4.

use std::time::Duration;

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

async fn post(client: &reqwest::Client, url: &str, body: Value) -> (u16, Value) {
    let r = client
        .post(format!("{url}/v1/completions"))
        .json(&body)
        .timeout(Duration::from_secs(30))
        .send()
        .await
        .expect("request");
    let status = r.status().as_u16();
    (status, r.json().await.unwrap_or(Value::Null))
}

/// What the proxy does: P with max_tokens 1 and do_remote_decode, then D with P's params.
async fn disaggregated(client: &reqwest::Client, p: &RunningEngine, d: &RunningEngine, text: &str, n: u32) -> Value {
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
    let (s, dr) = post(client, &d.url(), json!({"prompt": text, "max_tokens": 12, "n": n, "kv_transfer_params": params})).await;
    assert_eq!(s, 200, "{dr}");
    dr
}

fn texts(v: &Value) -> Vec<String> {
    v["choices"]
        .as_array()
        .expect("choices")
        .iter()
        .map(|c| c["text"].as_str().unwrap_or_default().to_string())
        .collect()
}

async fn wait_released(e: &RunningEngine) {
    let c = e.connector.as_ref().expect("connector");
    for _ in 0..500 {
        if c.held_blocks() == (0, 0) {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("{} still holds {:?}", e.engine_id, c.held_blocks());
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
            let (s, m) = post(&client, &mono.url(), json!({"prompt": text, "max_tokens": 12, "n": n})).await;
            assert_eq!(s, 200);
            let dis = disaggregated(&client, &p, &d, &text, n).await;
            assert_eq!(texts(&dis), texts(&m), "prompt of {words} words, n={n}");
            assert_eq!(texts(&m).len(), n as usize);
        }
    }
    // Siblings differ from each other (n>1 is not n copies of one answer).
    let (_, m) = post(&client, &mono.url(), json!({"prompt": prompt(9, 30), "max_tokens": 8, "n": 4})).await;
    let t = texts(&m);
    assert!(t.iter().skip(1).any(|x| *x != t[0]));
    wait_released(&p).await;
    wait_released(&d).await;
    // Every handoff ended because D read it, not by a lease.
    let (live, ended) = p.connector.as_ref().unwrap().producer_stats().unwrap();
    assert_eq!(live, 0);
    assert_eq!(ended.get("done"), Some(&10), "{ended:?}");
    for e in [p, d, mono] {
        e.stop().await;
    }
}
