//! A prefill far longer than any lease (engines as processes, tcp transport): the KV still
//! streams to D layer by layer while P's heartbeats renew the grants, in push, layer-wise pull
//! and pull; and a P stopped (SIGSTOP) in the middle of such a prefill ends by the leases, with
//! every block back on both sides once it runs again. Every test is bounded in time.

mod common;

use std::process::Command;
use std::time::{Duration, Instant};

use common::{engine, Engine};
use serde_json::{json, Value};

/// D's registration grant and P's lease, in ms: the prefill below lasts five of them.
const LEASE_MS: u64 = 1_000;
const PROMPT_WORDS: usize = 2_000;
/// 2,000 tokens × 2.5 ms: a 5 s forward pass.
const US_PER_TOKEN: &str = "prefill_us_per_token=2500";

fn client() -> reqwest::blocking::Client {
    reqwest::blocking::Client::builder()
        .timeout(Duration::from_secs(60))
        .build()
        .unwrap()
}

fn prompt(seed: usize) -> String {
    (0..PROMPT_WORDS)
        .map(|i| format!("w{}", (i * 211 + seed * 17) % 4000))
        .collect::<Vec<_>>()
        .join(" ")
}

/// P and D of one flow: `mode` is the engines' mode (push or pull), P's prefill slow, every
/// lease one second.
fn pair(name: &str, mode: &str) -> (Engine, Engine) {
    let lease = format!("lease_ms={LEASE_MS}");
    let extension = format!("heartbeat_extension_ms={LEASE_MS}");
    let registration = format!("registration_lease_ms={LEASE_MS}");
    let p = engine(
        &format!("p-{name}"),
        "prefill",
        &[
            "--mode",
            mode,
            "--set",
            US_PER_TOKEN,
            "--set",
            &lease,
            "--set",
            &extension,
        ],
    );
    let d = engine(
        &format!("d-{name}"),
        "decode",
        &["--mode", mode, "--set", &registration],
    );
    (p, d)
}

fn info(c: &reqwest::blocking::Client, e: &Engine) -> Value {
    c.get(format!("{}/v1/handoff/info", e.url))
        .send()
        .unwrap()
        .json()
        .unwrap()
}

/// The sum of a metric's samples (those whose line also holds `label`).
fn metric(c: &reqwest::blocking::Client, e: &Engine, name: &str, label: &str) -> f64 {
    c.get(format!("{}/metrics", e.url))
        .send()
        .unwrap()
        .text()
        .unwrap()
        .lines()
        .filter(|l| l.starts_with(name) && l.contains(label))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

fn held(c: &reqwest::blocking::Client, e: &Engine) -> f64 {
    metric(c, e, "handoff_kv_blocks_held", "")
}

fn failed(c: &reqwest::blocking::Client, d: &Engine) -> f64 {
    metric(c, d, "handoff_requests_failed", "")
}

#[derive(Clone, Copy, Debug)]
enum Flow {
    Push,
    LayerwisePull,
    Pull,
}

/// Sends both legs of `flow` for `text` as a proxy does (push and layer-wise pull: at once;
/// pull: D's once P answered) on threads; returns D's leg, which answers (status, body).
fn send(
    flow: Flow,
    p: &Engine,
    d: &Engine,
    text: &str,
    hid: &str,
) -> std::thread::JoinHandle<(u16, Value)> {
    let c = client();
    let pi = info(&c, p);
    let (purl, durl) = (p.url.clone(), d.url.clone());
    let text = text.to_string();
    let hid = hid.to_string();
    std::thread::spawn(move || {
        let c = client();
        let post = |url: &str, body: Value| {
            let r = c
                .post(format!("{url}/v1/completions"))
                .json(&body)
                .send()
                .unwrap();
            (
                r.status().as_u16(),
                r.json::<Value>().unwrap_or(Value::Null),
            )
        };
        let remote = |extra: Value| {
            let mut kv = json!({"do_remote_prefill": true, "do_remote_decode": false,
                "remote_engine_id": pi["engine_id"], "remote_host": pi["remote_host"],
                "remote_port": pi["remote_port"], "tp_size": pi["tp_size"]});
            for (k, v) in extra.as_object().unwrap() {
                kv[k] = v.clone();
            }
            json!({"prompt": text, "max_tokens": 4, "kv_transfer_params": kv})
        };
        match flow {
            Flow::Pull => {
                let (_, pv) = post(
                    &purl,
                    json!({"prompt": text, "max_tokens": 1,
                    "kv_transfer_params": {"do_remote_decode": true, "do_remote_prefill": false}}),
                );
                let mut body = json!({"prompt": text, "max_tokens": 4});
                body["kv_transfer_params"] = pv["kv_transfer_params"].clone();
                post(&durl, body)
            }
            Flow::Push | Flow::LayerwisePull => {
                let (p_extra, d_extra) = match flow {
                    Flow::Push => (
                        json!({"transfer_mode": "push", "handoff_id": hid}),
                        json!({"transfer_mode": "push", "handoff_id": hid}),
                    ),
                    _ => (
                        json!({"transfer_mode": "pull", "layerwise": true, "handoff_id": hid}),
                        json!({"transfer_mode": "pull", "layerwise": true, "handoff_id": hid}),
                    ),
                };
                let mut p_kv = json!({"do_remote_decode": true, "do_remote_prefill": false});
                for (k, v) in p_extra.as_object().unwrap() {
                    p_kv[k] = v.clone();
                }
                let p_body = json!({"prompt": text, "max_tokens": 1, "kv_transfer_params": p_kv});
                // P's answer does not matter here (and a stopped P gives none for a while).
                std::thread::spawn(move || {
                    let _ = client()
                        .post(format!("{purl}/v1/completions"))
                        .json(&p_body)
                        .send();
                });
                post(&durl, remote(d_extra))
            }
        }
    })
}

fn wait_until(limit: Duration, what: &str, mut cond: impl FnMut() -> bool) -> Duration {
    let t0 = Instant::now();
    while !cond() {
        assert!(t0.elapsed() < limit, "{what}: not within {limit:?}");
        std::thread::sleep(Duration::from_millis(50));
    }
    t0.elapsed()
}

#[test]
fn a_prefill_five_times_the_lease_streams_every_layer_in_every_flow() {
    let c = client();
    let mono = engine("mono-long", "both", &[]);
    for (i, (flow, mode)) in [
        (Flow::Push, "push"),
        (Flow::LayerwisePull, "pull"),
        (Flow::Pull, "pull"),
    ]
    .into_iter()
    .enumerate()
    {
        let (p, d) = pair(&format!("long-{i}"), mode);
        let text = prompt(i);
        let hid = format!("{:032x}", 0x1096_0000u128 + i as u128);
        let t0 = Instant::now();
        let (status, got) = send(flow, &p, &d, &text, &hid).join().unwrap();
        let took = t0.elapsed();
        assert_eq!(status, 200, "{flow:?}: {got}");
        assert!(
            took >= Duration::from_millis(5 * LEASE_MS),
            "{flow:?}: the prefill was meant to last five leases, took {took:?}"
        );
        let want: Value = c
            .post(format!("{}/v1/completions", mono.url))
            .json(&json!({"prompt": text, "max_tokens": 4}))
            .send()
            .unwrap()
            .json()
            .unwrap();
        assert_eq!(
            got["choices"][0]["text"], want["choices"][0]["text"],
            "{flow:?}"
        );
        // The KV came from P (a recompute would answer the same text).
        assert_eq!(failed(&c, &d), 0.0, "{flow:?}: D recomputed");
        wait_until(Duration::from_secs(10), "P's handoff done", || {
            metric(&c, &p, "handoff_handoffs_ended", "reason=\"done\"") >= 1.0
        });
        wait_until(Duration::from_secs(10), "every block back", || {
            held(&c, &p) == 0.0 && held(&c, &d) == 0.0
        });
    }
}

fn signal(e: &Engine, sig: &str) {
    let ok = Command::new("kill")
        .args([sig, &e.child.id().to_string()])
        .status()
        .unwrap()
        .success();
    assert!(ok, "kill {sig}");
}

/// P stops (SIGSTOP) two leases into the forward pass, while layers stream to D: D's request
/// ends (recomputed) and its blocks come back by the leases, not by P; once P runs again, its
/// handoff ends too and both pools are whole.
#[test]
fn a_p_stopped_in_the_middle_of_a_long_prefill_ends_by_the_leases_and_leaks_nothing() {
    let c = client();
    for (i, (flow, mode)) in [(Flow::Push, "push"), (Flow::LayerwisePull, "pull")]
        .into_iter()
        .enumerate()
    {
        let (p, d) = pair(&format!("stop-{i}"), mode);
        let hid = format!("{:032x}", 0x5709_0000u128 + i as u128);
        let d_leg = send(flow, &p, &d, &prompt(10 + i), &hid);
        wait_until(Duration::from_secs(10), "D holds blocks for the KV", || {
            held(&c, &d) > 0.0
        });
        std::thread::sleep(Duration::from_millis(2 * LEASE_MS));
        signal(&p, "-STOP");
        let stopped = Instant::now();
        let (status, v) = d_leg.join().unwrap();
        eprintln!(
            "{flow:?}: D answered {:?} after P stopped",
            stopped.elapsed()
        );
        assert_eq!(status, 200, "{flow:?}: D recomputes: {v}");
        assert!(
            failed(&c, &d) >= 1.0,
            "{flow:?}: the KV cannot have come from P"
        );
        // Bounds against a leak, not timings: the lease (1 s), then the grace (push: 1.5 s;
        // pull: the read's end, with P silent past the transport's 1.5 s dead-peer limit).
        wait_until(Duration::from_secs(10), "D's blocks back", || {
            held(&c, &d) == 0.0
        });
        let d_back = stopped.elapsed();
        signal(&p, "-CONT");
        let p_back = wait_until(Duration::from_secs(15), "P's blocks back", || {
            held(&c, &p) == 0.0
        });
        eprintln!("{flow:?}: P's blocks back {p_back:?} after it ran again");
        eprintln!("{flow:?}: D's blocks back {d_back:?} after P stopped");
    }
}
