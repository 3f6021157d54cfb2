//! End-to-end tests of one request's flow through the proxy in pull mode against fake P and D
//! engines on loopback: the two legs and their parameters, streaming, and every way a leg fails
//! or a client leaves (with P told to release). Which instance a request goes to is `pool.rs`;
//! push mode is `push.rs`; HTTP limits are `limits.rs`. Every test is bounded in time.

mod fake;
mod harness;

use std::sync::atomic::Ordering;
use std::time::Duration;

use fake::{post_giving_up, Fake, Log};
use futures_util::StreamExt;
use handoff_proxy::start;
use harness::{bounded, client, completion, config, find, post, proxy, wait_until};
use serde_json::{json, Value};

#[tokio::test]
async fn pull_flow_transforms_prefill_leg_and_forwards_params() {
    bounded(async {
        let log = Log::default();
        let p = Fake::prefill("P1", &log).await;
        let d = Fake::decode("D1", &log).await;
        let proxy = proxy(&[&p], &[&d]).await;
        let body = json!({
            "model": "m", "prompt": "hello", "max_tokens": 20, "n": 2, "stream": false,
            "min_tokens": 3, "stream_options": {"include_usage": true}, "best_of": 2,
            "kv_transfer_params": {"client": "junk"}
        });
        let r = client()
            .post(format!("{}/v1/completions", proxy.url()))
            .header("X-Request-Id", "client-rid-1")
            .json(&body)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        assert_eq!(r.headers()["x-request-id"], "client-rid-1");
        let answer: Value = r.json().await.unwrap();
        assert_eq!(answer["served_by"], "D1");

        let p_got = p.received();
        assert_eq!(p_got.len(), 1);
        assert_eq!(p_got[0].path, "/v1/completions");
        assert_eq!(p_got[0].request_id(), "client-rid-1");
        assert_eq!(
            p_got[0].body,
            json!({
                "model": "m", "prompt": "hello", "max_tokens": 1, "n": 1, "stream": false,
                "kv_transfer_params": {
                    "do_remote_decode": true, "do_remote_prefill": false,
                    "remote_engine_id": null, "remote_block_ids": null,
                    "remote_host": null, "remote_port": null
                }
            })
        );

        let d_got = d.received();
        assert_eq!(d_got.len(), 1);
        assert_eq!(d_got[0].path, "/v1/completions");
        assert_eq!(d_got[0].request_id(), "client-rid-1");
        let mut expected = body.clone();
        expected["kv_transfer_params"] = p.issued()[0].clone();
        assert_eq!(
            d_got[0].body, expected,
            "D gets the client's JSON with P's params"
        );
        assert!(p.releases().is_empty(), "no release when D accepted");
        proxy.shutdown().await.unwrap();
    })
    .await
}

#[tokio::test]
async fn chat_completions_generated_request_id_and_max_completion_tokens() {
    bounded(async {
        let log = Log::default();
        let p = Fake::prefill("P1", &log).await;
        let d = Fake::decode("D1", &log).await;
        let proxy = proxy(&[&p], &[&d]).await;
        let body = json!({
            "model": "m", "messages": [{"role": "user", "content": "hi"}],
            "max_completion_tokens": 100
        });
        let r = client()
            .post(format!("{}/v1/chat/completions", proxy.url()))
            .json(&body)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        let rid = r.headers()["x-request-id"].to_str().unwrap().to_string();
        assert_eq!(rid.len(), 36, "uuid-like: {rid}");
        let p_got = &p.received()[0];
        let d_got = &d.received()[0];
        assert_eq!(p_got.path, "/v1/chat/completions");
        assert_eq!(d_got.path, "/v1/chat/completions");
        assert_eq!(p_got.request_id(), rid);
        assert_eq!(d_got.request_id(), rid);
        assert_eq!(p_got.body["max_completion_tokens"], 1);
        assert_eq!(p_got.body["max_tokens"], 1);
        assert_eq!(d_got.body["max_completion_tokens"], 100);
        assert!(d_got.body.get("max_tokens").is_none());
    })
    .await
}

#[tokio::test]
async fn streaming_passthrough_delivers_chunks_as_they_come() {
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
        assert!(d.state.stream_finished.load(Ordering::SeqCst));
        // P was asked for no stream; D for the client's stream.
        assert_eq!(p.received()[0].body["stream"], false);
        assert!(p.received()[0].body.get("stream_options").is_none());
        assert_eq!(d.received()[0].body["stream"], true);
        assert_eq!(
            d.received()[0].body["stream_options"]["include_usage"],
            true
        );
        let infos = proxy.instances();
        wait_until(|| find(&proxy.instances(), &d.url).in_flight == 0).await;
        assert_eq!(find(&infos, &p.url).in_flight, 0);
    })
    .await
}

#[tokio::test]
async fn decode_refusing_fails_loudly_and_releases_prefill() {
    bounded(async {
        let log = Log::default();
        let p = Fake::prefill("P1", &log).await;
        let d = Fake::decode("D1", &log).await;
        d.set_status(503);
        let proxy = proxy(&[&p], &[&d]).await;

        let (status, err) = post(&proxy, "/v1/completions", &completion()).await;
        assert_eq!(status, 503);
        let e = &err["error"];
        assert_eq!(e["role"], "decode");
        assert_eq!(e["instance"], d.url.as_str());
        assert!(e["message"].as_str().unwrap().contains(&d.url));
        assert!(e["message"].as_str().unwrap().contains("503"));
        assert_eq!(e["upstream_body"]["error"]["message"], "pool full");
        assert_eq!(e["prefill_released"], true);
        let releases = p.releases();
        assert_eq!(releases.len(), 1);
        let issued = &p.issued()[0];
        assert_eq!(
            releases[0]["kv_transfer_params"]["handoff_id"],
            issued["handoff_id"]
        );
        assert_eq!(releases[0]["kv_transfer_params"], *issued);

        // Any other 5xx: 502, released as well.
        d.set_status(500);
        let (status, err) = post(&proxy, "/v1/completions", &completion()).await;
        assert_eq!(status, 502);
        assert_eq!(err["error"]["instance"], d.url.as_str());
        assert_eq!(p.releases().len(), 2);
        assert_eq!(
            p.releases()[1]["kv_transfer_params"]["handoff_id"],
            p.issued()[1]["handoff_id"]
        );

        let metrics = client()
            .get(format!("{}/metrics", proxy.url()))
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        assert!(
            metrics.contains("handoff_proxy_releases_total{result=\"ok\"} 2"),
            "{metrics}"
        );
        assert!(metrics.contains("handoff_proxy_requests_total{outcome=\"decode_failed\"} 2"));
    })
    .await
}

#[tokio::test]
async fn decode_unreachable_fails_loudly_and_releases_prefill() {
    bounded(async {
        let log = Log::default();
        let p = Fake::prefill("P1", &log).await;
        let d = Fake::decode("D1", &log).await;
        let proxy = proxy(&[&p], &[&d]).await;
        assert!(find(&proxy.instances(), &d.url).healthy);
        d.kill().await;

        let (status, err) = post(&proxy, "/v1/completions", &completion()).await;
        assert_eq!(status, 502, "{err}");
        assert_eq!(err["error"]["instance"], d.url.as_str());
        assert_eq!(err["error"]["type"], "upstream_unreachable");
        assert_eq!(err["error"]["prefill_released"], true);
        assert_eq!(p.releases().len(), 1);
        assert_eq!(
            p.releases()[0]["kv_transfer_params"]["handoff_id"],
            p.issued()[0]["handoff_id"]
        );
        // A refused connection marks D down at once: the next request fails fast, P untouched.
        assert!(!find(&proxy.instances(), &d.url).healthy);
        let (status, err) = post(&proxy, "/v1/completions", &completion()).await;
        assert_eq!(status, 503);
        assert_eq!(err["error"]["type"], "no_healthy_instance");
        assert_eq!(p.received().len(), 1);
    })
    .await
}

#[tokio::test]
async fn decode_timeout_before_head_releases_prefill() {
    bounded(async {
        let log = Log::default();
        let p = Fake::prefill("P1", &log).await;
        let d = Fake::decode("D1", &log).await;
        d.set_head_delay(Duration::from_secs(3));
        let mut cfg = config(&[&p], &[&d]);
        cfg.request_timeout = Duration::from_millis(400);
        let proxy = start(cfg).await.unwrap();
        let mut body = completion();
        body["stream"] = json!(true);
        let (status, err) = post(&proxy, "/v1/completions", &body).await;
        assert_eq!(status, 504);
        assert_eq!(err["error"]["instance"], d.url.as_str());
        assert_eq!(err["error"]["prefill_released"], true);
        assert_eq!(
            p.releases()[0]["kv_transfer_params"]["handoff_id"],
            p.issued()[0]["handoff_id"]
        );
    })
    .await
}

#[tokio::test]
async fn client_gone_before_decode_answers_releases_prefill() {
    bounded(async {
        let log = Log::default();
        let p = Fake::prefill("P1", &log).await;
        let d = Fake::decode("D1", &log).await;
        d.set_head_delay(Duration::from_secs(3));
        let proxy = proxy(&[&p], &[&d]).await;
        let url = format!("{}/v1/completions", proxy.url());
        let gave_up = post_giving_up(&url, &completion(), Duration::from_millis(500)).await;
        assert!(gave_up, "the client gave up");
        assert_eq!(d.received().len(), 1);
        wait_until(|| p.releases().len() == 1).await;
        assert_eq!(
            p.releases()[0]["kv_transfer_params"]["handoff_id"],
            p.issued()[0]["handoff_id"]
        );
    })
    .await
}

#[tokio::test]
async fn client_gone_while_p_is_told_to_release_still_releases() {
    bounded(async {
        let log = Log::default();
        let p = Fake::prefill("P1", &log).await;
        let d = Fake::decode("D1", &log).await;
        d.set_status(503);
        // P answers a release after 600 ms, and applies it only then.
        p.set_release_delay(Duration::from_millis(600));
        let proxy = proxy(&[&p], &[&d]).await;
        let url = format!("{}/v1/completions", proxy.url());
        let gave_up = post_giving_up(&url, &completion(), Duration::from_millis(250)).await;
        assert!(gave_up, "the client gave up while P was being told");
        assert_eq!(d.received().len(), 1, "D refused its leg");
        wait_until(|| p.releases().len() == 1).await;
        assert_eq!(
            p.releases()[0]["kv_transfer_params"]["handoff_id"],
            p.issued()[0]["handoff_id"]
        );
    })
    .await
}

#[tokio::test]
async fn prefill_failure_fails_loudly_and_never_calls_decode() {
    bounded(async {
        let log = Log::default();
        let p = Fake::prefill("P1", &log).await;
        let d = Fake::decode("D1", &log).await;
        let mut cfg = config(&[&p], &[&d]);
        cfg.request_timeout = Duration::from_millis(400);
        let proxy = start(cfg).await.unwrap();

        // 5xx.
        p.set_status(500);
        let (status, err) = post(&proxy, "/v1/completions", &completion()).await;
        assert_eq!(status, 502);
        assert_eq!(err["error"]["role"], "prefill");
        assert_eq!(err["error"]["instance"], p.url.as_str());
        assert!(err["error"]["message"].as_str().unwrap().contains("500"));

        // 503 stays 503.
        p.set_status(503);
        let (status, _) = post(&proxy, "/v1/completions", &completion()).await;
        assert_eq!(status, 503);

        // Timeout.
        p.set_status(200);
        p.set_head_delay(Duration::from_secs(2));
        let (status, err) = post(&proxy, "/v1/completions", &completion()).await;
        assert_eq!(status, 504);
        assert_eq!(err["error"]["instance"], p.url.as_str());
        assert!(err["error"]["message"]
            .as_str()
            .unwrap()
            .contains("timed out"));

        // Unreachable.
        p.kill().await;
        let (status, err) = post(&proxy, "/v1/completions", &completion()).await;
        assert_eq!(status, 502);
        assert_eq!(err["error"]["instance"], p.url.as_str());
        assert_eq!(err["error"]["type"], "upstream_unreachable");

        // P is now marked down: 503 at once.
        let (status, err) = post(&proxy, "/v1/completions", &completion()).await;
        assert_eq!(status, 503);
        assert_eq!(err["error"]["role"], "prefill");

        assert!(
            d.received().is_empty(),
            "D must never be called when P failed"
        );
    })
    .await
}

#[tokio::test]
async fn prefill_without_params_is_an_error() {
    bounded(async {
        let log = Log::default();
        let p = Fake::prefill("P1", &log).await;
        let d = Fake::decode("D1", &log).await;
        // A D answers like an engine that kept no KV: 200 without kv_transfer_params.
        let proxy = proxy(&[&d], &[&d]).await;
        let (status, err) = post(&proxy, "/v1/completions", &completion()).await;
        assert_eq!(status, 502);
        assert!(err["error"]["message"]
            .as_str()
            .unwrap()
            .contains("kv_transfer_params"));
        assert!(p.received().is_empty());
        assert_eq!(d.received().len(), 1, "only the prefill leg ran");
    })
    .await
}

#[tokio::test]
async fn client_disconnect_mid_stream_closes_the_decode_stream() {
    bounded(async {
        let log = Log::default();
        let p = Fake::prefill("P1", &log).await;
        let d = Fake::decode("D1", &log).await;
        d.set_stream(0, Duration::from_millis(50));
        let proxy = proxy(&[&p], &[&d]).await;
        let mut body = completion();
        body["stream"] = json!(true);
        let r = client()
            .post(format!("{}/v1/completions", proxy.url()))
            .json(&body)
            .send()
            .await
            .unwrap();
        let mut s = r.bytes_stream();
        s.next().await.unwrap().unwrap();
        s.next().await.unwrap().unwrap();
        assert!(!d.state.stream_dropped.load(Ordering::SeqCst));
        drop(s);

        wait_until(|| d.state.stream_dropped.load(Ordering::SeqCst)).await;
        wait_until(|| find(&proxy.instances(), &d.url).in_flight == 0).await;
        let metrics = client()
            .get(format!("{}/metrics", proxy.url()))
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        assert!(
            metrics.contains("handoff_proxy_stream_ends_total{end=\"client_disconnect\"} 1"),
            "{metrics}"
        );
        assert!(
            p.releases().is_empty(),
            "D owned the handoff: the proxy does not release"
        );
    })
    .await
}

#[tokio::test]
async fn models_health_and_metrics_endpoints() {
    bounded(async {
        let log = Log::default();
        let p = Fake::prefill("P1", &log).await;
        let d = Fake::decode("D1", &log).await;
        let proxy = proxy(&[&p], &[&d]).await;
        let c = client();

        let models: Value = c
            .get(format!("{}/v1/models", proxy.url()))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        assert_eq!(models["data"][0]["owned_by"], "D1");

        let h = c
            .get(format!("{}/health", proxy.url()))
            .send()
            .await
            .unwrap();
        assert_eq!(h.status(), 200);

        assert_eq!(post(&proxy, "/v1/completions", &completion()).await.0, 200);
        let (status, _) = {
            let r = c
                .post(format!("{}/v1/completions", proxy.url()))
                .body("not json")
                .send()
                .await
                .unwrap();
            (r.status().as_u16(), ())
        };
        assert_eq!(status, 400);

        let m = c
            .get(format!("{}/metrics", proxy.url()))
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        assert!(
            m.contains("handoff_proxy_requests_total{outcome=\"ok\"} 1"),
            "{m}"
        );
        assert!(m.contains("handoff_proxy_requests_total{outcome=\"bad_request\"} 1"));
        assert!(m.contains(&format!(
            "handoff_proxy_in_flight{{role=\"decode\",url=\"{}\"}} 0",
            d.url
        )));
        assert!(m.contains(&format!(
            "handoff_proxy_instance_healthy{{role=\"decode\",url=\"{}\"}} 1",
            d.url
        )));
        assert!(m.contains("# TYPE handoff_proxy_releases counter"));
        // The one request's timeline (not streamed: no first chunk relayed).
        for phase in ["to_decode", "prefill_leg", "decode_head"] {
            assert!(
                m.contains(&format!(
                    "handoff_proxy_phase_seconds_count{{phase=\"{phase}\"}} 1"
                )),
                "{phase}: {m}"
            );
        }
        assert!(!m.contains("phase=\"first_chunk\""), "{m}");
    })
    .await
}

#[tokio::test]
async fn a_stalled_decode_stream_is_cut_loudly() {
    bounded(async {
        let log = Log::default();
        let p = Fake::prefill("P1", &log).await;
        let d = Fake::decode("D1", &log).await;
        d.set_stream(3, Duration::from_secs(3));
        let mut cfg = config(&[&p], &[&d]);
        cfg.stream_idle_timeout = Duration::from_millis(300);
        let proxy = start(cfg).await.unwrap();
        let mut body = completion();
        body["stream"] = json!(true);
        let r = client()
            .post(format!("{}/v1/completions", proxy.url()))
            .json(&body)
            .send()
            .await
            .unwrap();
        let mut s = r.bytes_stream();
        let mut text = String::new();
        while let Some(Ok(c)) = s.next().await {
            text.push_str(&String::from_utf8_lossy(&c));
        }
        assert!(text.contains("tok0"));
        assert!(text.contains("upstream_stream_error"), "{text}");
        assert!(text.contains(&d.url));
        assert!(!text.contains("[DONE]"));
        wait_until(|| d.state.stream_dropped.load(Ordering::SeqCst)).await;
    })
    .await
}
