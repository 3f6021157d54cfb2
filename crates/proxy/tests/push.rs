//! Push mode end to end against fake P and D engines on loopback: both legs at once, exact leg
//! bodies, P's info, and every failure ending loudly with the other leg cut or P released.
//! Every test is bounded in time.

mod fake;
mod harness;

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use fake::{post_giving_up, Fake, Log};
use futures_util::StreamExt;
use handoff_proxy::{start, ProxyConfig, RunningProxy, TransferMode};
use harness::{bounded, client, completion, find, metrics, wait_until};
use serde_json::{json, Value};

fn config(ps: &[&Fake], ds: &[&Fake]) -> ProxyConfig {
    ProxyConfig {
        mode: TransferMode::Push,
        ..harness::config(ps, ds)
    }
}

async fn proxy(ps: &[&Fake], ds: &[&Fake]) -> RunningProxy {
    start(config(ps, ds)).await.unwrap()
}

async fn post(proxy: &RunningProxy, body: &Value) -> (u16, Value) {
    harness::post(proxy, "/v1/completions", body).await
}

fn position(log: &Log, event: &str) -> usize {
    log.events()
        .iter()
        .position(|e| e == event)
        .unwrap_or_else(|| panic!("no {event} in {:?}", log.events()))
}

/// The handoff id the proxy sent P in its `i`th request.
fn handoff_of(p: &Fake, i: usize) -> String {
    p.received()[i].body["kv_transfer_params"]["handoff_id"]
        .as_str()
        .unwrap()
        .to_string()
}

#[tokio::test]
async fn both_legs_go_at_once_with_exact_push_params() {
    bounded(async {
        let log = Log::default();
        let p = Fake::prefill("P1", &log).await;
        let d = Fake::decode("D1", &log).await;
        p.set_info(json!({
            "engine_id": "p-engine-7", "remote_host": "10.9.8.7", "remote_port": 7311,
            "tp_size": 4, "block_size": 32, "transfer_mode": "push", "role": "prefill"
        }));
        // P prefills for 300 ms; D waits for P's writes and answers after 500 ms.
        p.set_head_delay(Duration::from_millis(300));
        d.set_head_delay(Duration::from_millis(500));
        let proxy = proxy(&[&p], &[&d]).await;
        assert_eq!(
            p.info_requests(),
            1,
            "the first health check fetched P's info"
        );

        let body = json!({
            "model": "m", "prompt": "hello", "max_tokens": 20, "n": 2, "stream": false,
            "min_tokens": 3, "best_of": 2, "kv_transfer_params": {"client": "junk"}
        });
        let r = client()
            .post(format!("{}/v1/completions", proxy.url()))
            .header("X-Request-Id", "push-rid-1")
            .json(&body)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        assert_eq!(r.headers()["x-request-id"], "push-rid-1");
        assert_eq!(r.json::<Value>().await.unwrap()["served_by"], "D1");

        assert!(
            position(&log, "D1") < position(&log, "P1:answer"),
            "D must get its leg before P answers: {:?}",
            log.events()
        );

        let h = handoff_of(&p, 0);
        assert_eq!(h.len(), 32);
        assert!(h.bytes().all(|b| b.is_ascii_hexdigit()), "{h}");
        let p_got = &p.received()[0];
        assert_eq!(p_got.request_id(), "push-rid-1");
        assert_eq!(
            p_got.body,
            json!({
                "model": "m", "prompt": "hello", "max_tokens": 1, "n": 1, "stream": false,
                "kv_transfer_params": {
                    "do_remote_decode": true, "do_remote_prefill": false,
                    "transfer_mode": "push", "handoff_id": h
                }
            })
        );
        let d_got = &d.received()[0];
        assert_eq!(d_got.request_id(), "push-rid-1");
        let mut expected = body.clone();
        expected["kv_transfer_params"] = json!({
            "do_remote_prefill": true, "do_remote_decode": false,
            "transfer_mode": "push", "handoff_id": h,
            "remote_engine_id": "p-engine-7", "remote_host": "10.9.8.7",
            "remote_port": 7311, "tp_size": 4
        });
        assert_eq!(
            d_got.body, expected,
            "D gets the client's JSON with push params"
        );
        assert!(
            p.releases().is_empty(),
            "no release when both legs succeeded"
        );

        // A second request: a fresh handoff id, P's info from the cache.
        assert_eq!(post(&proxy, &completion()).await.0, 200);
        assert_ne!(handoff_of(&p, 1), h);
        assert_eq!(
            d.received()[1].body["kv_transfer_params"]["handoff_id"],
            handoff_of(&p, 1).as_str()
        );
        assert_eq!(p.info_requests(), 1, "P's info is cached");
        wait_until(|| find(&proxy.instances(), &p.url).in_flight == 0).await;
        assert_eq!(find(&proxy.instances(), &d.url).in_flight, 0);
        let admin: Value = client()
            .get(format!("{}/admin/instances", proxy.admin_url().unwrap()))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        assert_eq!(admin["mode"], "push");
    })
    .await
}

/// In pull mode, a P and a D whose info both say they take a layer-wise pull get the push
/// flow's two legs at once, in pull mode; when either says nothing of it (or cannot answer it,
/// as vLLM's engines), the request is pulled the classic way, P first.
#[tokio::test]
async fn a_pull_proxy_sends_a_layerwise_p_both_legs_at_once() {
    bounded(async {
        let log = Log::default();
        let p = Fake::prefill("P1", &log).await;
        let d = Fake::decode("D1", &log).await;
        p.set_info(json!({
            "engine_id": "p-engine-3", "remote_host": "10.9.8.3", "remote_port": 7303,
            "tp_size": 1, "block_size": 16, "transfer_mode": "pull", "role": "prefill",
            "layerwise_pull": true
        }));
        d.set_info(json!({
            "engine_id": "d-engine-3", "remote_host": "10.9.8.4", "remote_port": 7304,
            "tp_size": 1, "transfer_mode": "pull", "role": "decode", "layerwise_pull": true
        }));
        // P prefills for 300 ms; D reads as P saves layers and answers after 500 ms.
        p.set_head_delay(Duration::from_millis(300));
        d.set_head_delay(Duration::from_millis(500));
        let proxy = start(ProxyConfig {
            mode: TransferMode::Pull,
            ..config(&[&p], &[&d])
        })
        .await
        .unwrap();
        assert_eq!(post(&proxy, &completion()).await.0, 200);
        assert!(
            position(&log, "D1") < position(&log, "P1:answer"),
            "D must get its leg before P answers: {:?}",
            log.events()
        );
        let h = handoff_of(&p, 0);
        assert_eq!(
            p.received()[0].body["kv_transfer_params"],
            json!({
                "do_remote_decode": true, "do_remote_prefill": false,
                "transfer_mode": "pull", "layerwise": true, "handoff_id": h
            })
        );
        assert_eq!(
            d.received()[0].body["kv_transfer_params"],
            json!({
                "do_remote_prefill": true, "do_remote_decode": false,
                "transfer_mode": "pull", "layerwise": true, "handoff_id": h,
                "remote_engine_id": "p-engine-3", "remote_host": "10.9.8.3",
                "remote_port": 7303, "tp_size": 1
            })
        );
        assert!(p.releases().is_empty());

        // A D that does not say it takes one (a vLLM D admits at once: with both pools full
        // the two engines could wait on each other), then a P that does not: P first, then D
        // with P's own params.
        for (i, p_takes, d_takes) in [(1, true, false), (2, false, true)] {
            for (f, takes) in [(&p, p_takes), (&d, d_takes)] {
                f.set_info(json!({
                    "engine_id": "x", "remote_host": "10.9.8.5", "remote_port": 7305,
                    "tp_size": 1, "transfer_mode": "pull", "layerwise_pull": takes
                }));
            }
            let proxy = start(ProxyConfig {
                mode: TransferMode::Pull,
                ..config(&[&p], &[&d])
            })
            .await
            .unwrap();
            assert_eq!(post(&proxy, &completion()).await.0, 200);
            let got = &p.received()[i].body["kv_transfer_params"];
            assert!(got.get("layerwise").is_none(), "{got}");
            assert_eq!(
                d.received()[i].body["kv_transfer_params"],
                p.issued()[i],
                "D gets P's params"
            );
        }
    })
    .await
}

#[tokio::test]
async fn streaming_passthrough_in_push_mode() {
    bounded(async {
        let log = Log::default();
        let p = Fake::prefill("P1", &log).await;
        let d = Fake::decode("D1", &log).await;
        d.set_stream(4, Duration::from_millis(300));
        let proxy = proxy(&[&p], &[&d]).await;
        let mut body = completion();
        body["stream"] = json!(true);
        body["stream_options"] = json!({"include_usage": true});
        let r = client()
            .post(format!("{}/v1/completions", proxy.url()))
            .json(&body)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        assert!(r.headers()["content-type"]
            .to_str()
            .unwrap()
            .starts_with("text/event-stream"));
        let mut stream = r.bytes_stream();
        let first = stream.next().await.unwrap().unwrap();
        assert!(String::from_utf8_lossy(&first).contains("tok0"));
        assert!(
            !d.state.stream_finished.load(Ordering::SeqCst),
            "the first chunk must arrive while D is still streaming"
        );
        let mut all = first.to_vec();
        while let Some(chunk) = stream.next().await {
            all.extend_from_slice(&chunk.unwrap());
        }
        let text = String::from_utf8(all).unwrap();
        for i in 0..4 {
            assert!(text.contains(&format!("tok{i}")), "{text}");
        }
        assert!(text.ends_with("data: [DONE]\n\n"));
        assert_eq!(p.received()[0].body["stream"], false);
        assert!(p.received()[0].body.get("stream_options").is_none());
        assert_eq!(d.received()[0].body["stream"], true);
        assert_eq!(
            d.received()[0].body["kv_transfer_params"]["transfer_mode"],
            "push"
        );
        wait_until(|| find(&proxy.instances(), &d.url).in_flight == 0).await;
        wait_until(|| find(&proxy.instances(), &p.url).in_flight == 0).await;
        assert!(p.releases().is_empty());
        assert!(metrics(&proxy)
            .await
            .contains("handoff_proxy_stream_ends_total{end=\"complete\"} 1"));
    })
    .await
}

#[tokio::test]
async fn decode_refusing_releases_prefill_at_once_and_cancels_its_leg() {
    bounded(async {
        let log = Log::default();
        let p = Fake::prefill("P1", &log).await;
        let d = Fake::decode("D1", &log).await;
        // P is still prefilling when D refuses (pool full).
        p.set_head_delay(Duration::from_secs(2));
        d.set_status(503);
        let proxy = proxy(&[&p], &[&d]).await;

        let t0 = Instant::now();
        let (status, err) = post(&proxy, &completion()).await;
        assert!(t0.elapsed() < Duration::from_millis(1500), "no wait for P");
        assert_eq!(status, 503);
        let e = &err["error"];
        assert_eq!(e["role"], "decode");
        assert_eq!(e["instance"], d.url.as_str());
        assert!(e["message"].as_str().unwrap().contains(&d.url));
        assert_eq!(e["upstream_body"]["error"]["message"], "pool full");
        assert_eq!(e["prefill_released"], true);
        let h = handoff_of(&p, 0);
        assert_eq!(
            p.releases()[0],
            json!({"kv_transfer_params": {
                "do_remote_decode": true, "do_remote_prefill": false,
                "transfer_mode": "push", "handoff_id": h, "epoch": 1
            }})
        );
        // P's leg was cancelled: its connection closed before it answered.
        wait_until(|| p.state.request_dropped.load(Ordering::SeqCst)).await;
        assert!(!log.events().contains(&"P1:answer".to_string()));

        // D unreachable: the same, with the new handoff id.
        d.kill().await;
        let (status, err) = post(&proxy, &completion()).await;
        assert_eq!(status, 502, "{err}");
        assert_eq!(err["error"]["instance"], d.url.as_str());
        assert_eq!(err["error"]["type"], "upstream_unreachable");
        assert_eq!(err["error"]["prefill_released"], true);
        assert_eq!(p.releases().len(), 2);
        // P's leg may have been cancelled before it was even sent; if it was, it named the
        // released handoff.
        let h2 = p.releases()[1]["kv_transfer_params"]["handoff_id"].clone();
        assert_ne!(h2, h.as_str());
        if p.received().len() == 2 {
            assert_eq!(h2, handoff_of(&p, 1).as_str());
        }
    })
    .await
}

#[tokio::test]
async fn decode_refusing_after_prefill_answered_releases_with_p_params() {
    bounded(async {
        let log = Log::default();
        let p = Fake::prefill("P1", &log).await;
        let d = Fake::decode("D1", &log).await;
        d.set_head_delay(Duration::from_millis(300));
        d.set_status(500);
        let proxy = proxy(&[&p], &[&d]).await;
        let (status, err) = post(&proxy, &completion()).await;
        assert_eq!(status, 502);
        assert_eq!(err["error"]["role"], "decode");
        assert_eq!(err["error"]["prefill_released"], true);
        assert!(position(&log, "P1:answer") < position(&log, "P1:release"));
        assert_eq!(p.releases()[0]["kv_transfer_params"], p.issued()[0]);
        assert_eq!(p.issued()[0]["handoff_id"], handoff_of(&p, 0).as_str());
    })
    .await
}

#[tokio::test]
async fn prefill_failing_cuts_the_decode_leg() {
    bounded(async {
        let log = Log::default();
        let p = Fake::prefill("P1", &log).await;
        let d = Fake::decode("D1", &log).await;
        // D waits for KV that will never come.
        d.set_head_delay(Duration::from_secs(20));
        let mut cfg = config(&[&p], &[&d]);
        cfg.request_timeout = Duration::from_millis(800);
        let proxy = start(cfg).await.unwrap();

        // P answers 500 after 200 ms.
        p.set_head_delay(Duration::from_millis(200));
        p.set_status(500);
        let (status, err) = post(&proxy, &completion()).await;
        assert_eq!(status, 502, "{err}");
        let e = &err["error"];
        assert_eq!(e["role"], "prefill");
        assert_eq!(e["instance"], p.url.as_str());
        let msg = e["message"].as_str().unwrap();
        assert!(msg.contains("500") && msg.contains(&p.url), "{msg}");
        assert!(msg.contains("decode leg") && msg.contains(&d.url), "{msg}");
        assert_eq!(d.received().len(), 1, "D got its leg");
        wait_until(|| d.state.request_dropped.load(Ordering::SeqCst)).await;
        // P may have seen the request: told to release.
        assert_eq!(e["prefill_released"], true);
        assert_eq!(
            p.releases()[0]["kv_transfer_params"]["handoff_id"],
            handoff_of(&p, 0).as_str()
        );

        // P times out: the error names P (not the D that waited on it), D is cut.
        d.state.request_dropped.store(false, Ordering::SeqCst);
        p.set_status(200);
        p.set_head_delay(Duration::from_secs(5));
        let (status, err) = post(&proxy, &completion()).await;
        assert_eq!(status, 504, "{err}");
        assert_eq!(err["error"]["role"], "prefill");
        assert_eq!(err["error"]["instance"], p.url.as_str());
        wait_until(|| d.state.request_dropped.load(Ordering::SeqCst)).await;

        // P unreachable (its info is cached): named, never released, D cut.
        p.kill().await;
        let (status, err) = post(&proxy, &completion()).await;
        assert_eq!(status, 502, "{err}");
        assert_eq!(err["error"]["type"], "upstream_unreachable");
        assert_eq!(err["error"]["instance"], p.url.as_str());
        assert!(err["error"].get("prefill_released").is_none());
        assert_eq!(p.releases().len(), 2);
        // P is marked down: the next request fails at once, D untouched.
        let n = d.received().len();
        let (status, err) = post(&proxy, &completion()).await;
        assert_eq!(status, 503);
        assert_eq!(err["error"]["role"], "prefill");
        assert_eq!(d.received().len(), n);
        let m = metrics(&proxy).await;
        assert!(
            m.contains("handoff_proxy_requests_total{outcome=\"prefill_failed\"} 3"),
            "{m}"
        );
    })
    .await
}

#[tokio::test]
async fn prefill_failing_mid_stream_cuts_the_decode_stream_loudly() {
    bounded(async {
        let log = Log::default();
        let p = Fake::prefill("P1", &log).await;
        let d = Fake::decode("D1", &log).await;
        // D streams from the start (endless); P fails after 400 ms.
        d.set_stream(0, Duration::from_millis(100));
        p.set_head_delay(Duration::from_millis(400));
        p.set_status(500);
        let proxy = proxy(&[&p], &[&d]).await;
        let mut body = completion();
        body["stream"] = json!(true);
        let r = client()
            .post(format!("{}/v1/completions", proxy.url()))
            .json(&body)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        let mut s = r.bytes_stream();
        let mut text = String::new();
        while let Some(Ok(c)) = s.next().await {
            text.push_str(&String::from_utf8_lossy(&c));
        }
        assert!(text.contains("tok0"), "{text}");
        let last = text.trim_end().rsplit("\n\n").next().unwrap();
        let event: Value = serde_json::from_str(last.strip_prefix("data: ").unwrap()).unwrap();
        assert_eq!(event["error"]["role"], "prefill");
        assert_eq!(event["error"]["instance"], p.url.as_str());
        assert!(!text.contains("[DONE]"));
        wait_until(|| d.state.stream_dropped.load(Ordering::SeqCst)).await;
        wait_until(|| p.releases().len() == 1).await;
        assert_eq!(
            p.releases()[0]["kv_transfer_params"]["handoff_id"],
            handoff_of(&p, 0).as_str()
        );
        assert!(metrics(&proxy)
            .await
            .contains("handoff_proxy_stream_ends_total{end=\"prefill_failed\"} 1"));
        wait_until(|| find(&proxy.instances(), &d.url).in_flight == 0).await;
    })
    .await
}

#[tokio::test]
async fn client_gone_drops_both_legs_and_releases_prefill() {
    bounded(async {
        let log = Log::default();
        let p = Fake::prefill("P1", &log).await;
        let d = Fake::decode("D1", &log).await;
        p.set_head_delay(Duration::from_secs(3));
        d.set_head_delay(Duration::from_secs(3));
        let proxy = proxy(&[&p], &[&d]).await;
        let url = format!("{}/v1/completions", proxy.url());
        let gave_up = post_giving_up(&url, &completion(), Duration::from_millis(400)).await;
        assert!(gave_up, "the client gave up");
        wait_until(|| p.state.request_dropped.load(Ordering::SeqCst)).await;
        wait_until(|| d.state.request_dropped.load(Ordering::SeqCst)).await;
        wait_until(|| p.releases().len() == 1).await;
        assert_eq!(
            p.releases()[0]["kv_transfer_params"]["handoff_id"],
            handoff_of(&p, 0).as_str()
        );
        wait_until(|| find(&proxy.instances(), &p.url).in_flight == 0).await;
        wait_until(|| find(&proxy.instances(), &d.url).in_flight == 0).await;
    })
    .await
}

#[tokio::test]
async fn client_gone_while_p_is_told_to_release_after_its_failure_still_releases() {
    bounded(async {
        let log = Log::default();
        let p = Fake::prefill("P1", &log).await;
        let d = Fake::decode("D1", &log).await;
        d.set_head_delay(Duration::from_secs(20));
        p.set_status(500);
        // P answers a release after 600 ms, and applies it only then.
        p.set_release_delay(Duration::from_millis(600));
        let proxy = proxy(&[&p], &[&d]).await;
        let url = format!("{}/v1/completions", proxy.url());
        let gave_up = post_giving_up(&url, &completion(), Duration::from_millis(250)).await;
        assert!(gave_up, "the client gave up while P was being told");
        wait_until(|| p.releases().len() == 1).await;
        assert_eq!(
            p.releases()[0]["kv_transfer_params"]["handoff_id"],
            handoff_of(&p, 0).as_str()
        );
    })
    .await
}

#[tokio::test]
async fn prefill_info_is_checked_cached_and_refreshed() {
    bounded(async {
        let log = Log::default();
        let d = Fake::decode("D1", &log).await;

        // A P in pull mode cannot serve a push: unhealthy, nothing is sent anywhere.
        let pull_p = Fake::prefill("P1", &log).await;
        pull_p.set_info(json!({
            "engine_id": "e", "remote_host": "h", "remote_port": 1, "tp_size": 1,
            "block_size": 16, "transfer_mode": "pull", "role": "prefill"
        }));
        let proxy1 = proxy(&[&pull_p], &[&d]).await;
        assert!(!find(&proxy1.instances(), &pull_p.url).healthy);
        let (status, err) = post(&proxy1, &completion()).await;
        assert_eq!(status, 503);
        assert_eq!(err["error"]["role"], "prefill");
        // A decode engine listed as P, likewise.
        let proxy2 = proxy(&[&d], &[&d]).await;
        assert!(!find(&proxy2.instances(), &d.url).healthy);
        assert!(d.received().is_empty() && pull_p.received().is_empty());

        // A good P: fetched by the health check, cached, forgotten when P fails, fetched again.
        let p = Fake::prefill("P2", &log).await;
        let proxy = proxy(&[&p], &[&d]).await;
        assert_eq!(p.info_requests(), 1);
        assert_eq!(post(&proxy, &completion()).await.0, 200);
        assert_eq!(p.info_requests(), 1);
        // (D answers after P fails: a complete D answer would win over a late P failure.)
        d.set_head_delay(Duration::from_millis(300));
        p.set_status(500);
        assert_eq!(post(&proxy, &completion()).await.0, 502);
        // P "restarts" with another engine id and side channel.
        p.set_status(200);
        d.set_head_delay(Duration::ZERO);
        p.set_info(json!({
            "engine_id": "engine-P2-restarted", "remote_host": "10.0.0.99",
            "remote_port": 7999, "tp_size": 1, "block_size": 16,
            "transfer_mode": "push", "role": "both"
        }));
        assert_eq!(post(&proxy, &completion()).await.0, 200);
        assert_eq!(p.info_requests(), 2);
        let params = d.received().last().unwrap().body["kv_transfer_params"].clone();
        assert_eq!(params["remote_engine_id"], "engine-P2-restarted");
        assert_eq!(params["remote_host"], "10.0.0.99");
        assert_eq!(params["remote_port"], 7999);
        assert_eq!(params["tp_size"], 1);

        // Health checks refresh it too.
        let mut cfg = config(&[&p], &[&d]);
        cfg.health_interval = Duration::from_millis(100);
        let fast = start(cfg).await.unwrap();
        p.set_info(json!({
            "engine_id": "engine-P2-again", "remote_host": "10.0.0.98",
            "remote_port": 7998, "tp_size": 2
        }));
        let seen = p.info_requests();
        wait_until(|| p.info_requests() >= seen + 2).await;
        assert_eq!(post(&fast, &completion()).await.0, 200);
        let params = d.received().last().unwrap().body["kv_transfer_params"].clone();
        assert_eq!(params["remote_engine_id"], "engine-P2-again");
        assert_eq!(params["tp_size"], 2);

        // Info that stops answering makes P unhealthy at the next check.
        p.set_info(json!({"nonsense": true}));
        wait_until(|| !find(&fast.instances(), &p.url).healthy).await;
        let (status, _) = post(&fast, &completion()).await;
        assert_eq!(status, 503);
    })
    .await
}
