//! End-to-end tests of the proxy's instance pool against fake P and D engines on loopback:
//! which instance a request goes to (policies, health, readiness, draining, compatibility
//! keys) and instances added and removed at run time. Every test is bounded in time.

mod fake;
mod harness;

use std::sync::atomic::Ordering;
use std::time::Duration;

use fake::{Fake, Log};
use futures_util::StreamExt;
use handoff_proxy::{start, Policy, RunningProxy};
use harness::{bounded, client, completion, config, find, post, proxy, wait_until};
use serde_json::{json, Value};

async fn admin_list(proxy: &RunningProxy) -> Value {
    client()
        .get(format!("{}/admin/instances", proxy.admin_url().unwrap()))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap()
}

/// Names of the completion events of one role, in order ("P1", "P2", ...).
fn order(log: &Log, prefix: char) -> Vec<String> {
    log.events()
        .into_iter()
        .filter(|e| e.starts_with(prefix) && !e.contains(':'))
        .collect()
}

#[tokio::test]
async fn no_healthy_instance_is_503_at_once() {
    bounded(async {
        let log = Log::default();
        let p = Fake::prefill("P1", &log).await;
        let d = Fake::decode("D1", &log).await;

        let no_d = proxy(&[&p], &[]).await;
        let (status, err) = post(&no_d, "/v1/completions", &completion()).await;
        assert_eq!(status, 503);
        assert_eq!(err["error"]["role"], "decode");
        assert!(
            p.received().is_empty(),
            "P is not called when no D can decode"
        );
        let h = client()
            .get(format!("{}/health", no_d.url()))
            .send()
            .await
            .unwrap();
        assert_eq!(h.status(), 503);

        let no_p = proxy(&[], &[&d]).await;
        let (status, err) = post(&no_p, "/v1/chat/completions", &completion()).await;
        assert_eq!(status, 503);
        assert_eq!(err["error"]["role"], "prefill");
        assert!(d.received().is_empty());

        // An unhealthy-only pool is the same as an empty one.
        d.set_health(500);
        let down = proxy(&[&p], &[&d]).await;
        let (status, _) = post(&down, "/v1/completions", &completion()).await;
        assert_eq!(status, 503);
        assert!(p.received().is_empty());
    })
    .await
}

#[tokio::test]
async fn round_robin_alternates_between_two_ps_and_two_ds() {
    bounded(async {
        let log = Log::default();
        let p1 = Fake::prefill("P1", &log).await;
        let p2 = Fake::prefill("P2", &log).await;
        let d1 = Fake::decode("D1", &log).await;
        let d2 = Fake::decode("D2", &log).await;
        let proxy = proxy(&[&p1, &p2], &[&d1, &d2]).await;
        for _ in 0..6 {
            let (status, _) = post(&proxy, "/v1/completions", &completion()).await;
            assert_eq!(status, 200);
        }
        for (role, seq) in [('P', order(&log, 'P')), ('D', order(&log, 'D'))] {
            assert_eq!(seq.len(), 6);
            for w in seq.windows(2) {
                assert_ne!(w[0], w[1], "{role} legs must alternate: {seq:?}");
            }
        }
        assert_eq!(p1.received().len(), 3);
        assert_eq!(d2.received().len(), 3);
    })
    .await
}

#[tokio::test]
async fn least_loaded_prefers_the_idle_instance() {
    bounded(async {
        let log = Log::default();
        let p = Fake::prefill("P1", &log).await;
        let d1 = Fake::decode("D1", &log).await;
        let d2 = Fake::decode("D2", &log).await;
        d1.set_stream(0, Duration::from_millis(50));
        d2.set_stream(0, Duration::from_millis(50));
        let mut cfg = config(&[&p], &[&d1, &d2]);
        cfg.policy = Policy::LeastLoaded;
        let proxy = start(cfg).await.unwrap();

        // One long stream holds one D busy.
        let mut body = completion();
        body["stream"] = json!(true);
        let r = client()
            .post(format!("{}/v1/completions", proxy.url()))
            .json(&body)
            .send()
            .await
            .unwrap();
        let mut held = r.bytes_stream();
        held.next().await.unwrap().unwrap();
        let (busy, idle) = if d1.received().len() == 1 {
            (&d1, &d2)
        } else {
            (&d2, &d1)
        };
        let infos = proxy.instances();
        assert_eq!(find(&infos, &busy.url).in_flight, 1);
        assert_eq!(find(&infos, &idle.url).in_flight, 0);

        for _ in 0..4 {
            let (status, _) = post(&proxy, "/v1/completions", &completion()).await;
            assert_eq!(status, 200);
        }
        assert_eq!(busy.received().len(), 1, "the busy D got nothing more");
        assert_eq!(idle.received().len(), 4);
        drop(held);
    })
    .await
}

#[tokio::test]
async fn instances_are_added_and_removed_at_run_time() {
    bounded(async {
        let log = Log::default();
        let p = Fake::prefill("P1", &log).await;
        let d1 = Fake::decode("D1", &log).await;
        let d2 = Fake::decode("D2", &log).await;
        let proxy = proxy(&[&p], &[&d1]).await;
        let c = client();
        let admin = format!("{}/admin/instances", proxy.admin_url().unwrap());

        let r = c
            .post(&admin)
            .json(&json!({"role": "decode", "url": format!("{}/", d2.url)}))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 201);
        let added: Value = r.json().await.unwrap();
        assert_eq!(added["added"], true);
        assert_eq!(added["instance"]["healthy"], true);
        assert_eq!(added["instance"]["url"], d2.url.as_str());

        // Adding again is idempotent.
        let r = c
            .post(&admin)
            .json(&json!({"role": "decode", "url": d2.url}))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        assert_eq!(r.json::<Value>().await.unwrap()["added"], false);

        for _ in 0..2 {
            assert_eq!(post(&proxy, "/v1/completions", &completion()).await.0, 200);
        }
        assert_eq!(d1.received().len(), 1);
        assert_eq!(d2.received().len(), 1);

        let r = c
            .delete(&admin)
            .json(&json!({"role": "decode", "url": d1.url}))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        for _ in 0..3 {
            assert_eq!(post(&proxy, "/v1/completions", &completion()).await.0, 200);
        }
        assert_eq!(d1.received().len(), 1, "a removed D gets no traffic");
        assert_eq!(d2.received().len(), 4);

        let list = admin_list(&proxy).await;
        let decode = list["decode"].as_array().unwrap();
        assert_eq!(decode.len(), 1);
        assert_eq!(decode[0]["url"], d2.url.as_str());
        assert_eq!(decode[0]["healthy"], true);
        assert_eq!(decode[0]["in_flight"], 0);
        assert_eq!(list["prefill"][0]["url"], p.url.as_str());

        // Removing an unknown instance, bad roles and https URLs are refused.
        let r = c
            .delete(&admin)
            .json(&json!({"role": "decode", "url": d1.url}))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 404);
        let r = c
            .post(&admin)
            .json(&json!({"role": "router", "url": d1.url}))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 400);
        let r = c
            .post(&admin)
            .json(&json!({"role": "prefill", "url": "https://x:1"}))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 400);

        // An added instance that fails its first check is listed unhealthy and gets nothing.
        let sick = Fake::prefill("P9", &log).await;
        sick.set_health(503);
        let (added, info) = proxy
            .add_instance(handoff_proxy::Role::Prefill, &sick.url)
            .await
            .unwrap();
        assert!(added);
        assert!(!info.healthy);
        for _ in 0..2 {
            assert_eq!(post(&proxy, "/v1/completions", &completion()).await.0, 200);
        }
        assert!(sick.received().is_empty());
    })
    .await
}

#[tokio::test]
async fn an_instance_failing_health_checks_gets_no_traffic() {
    bounded(async {
        let log = Log::default();
        let p1 = Fake::prefill("P1", &log).await;
        let p2 = Fake::prefill("P2", &log).await;
        let d = Fake::decode("D1", &log).await;
        let mut cfg = config(&[&p1, &p2], &[&d]);
        cfg.health_interval = Duration::from_millis(100);
        let proxy = start(cfg).await.unwrap();

        p2.set_health(503);
        wait_until(|| !find(&proxy.instances(), &p2.url).healthy).await;
        for _ in 0..4 {
            assert_eq!(post(&proxy, "/v1/completions", &completion()).await.0, 200);
        }
        assert!(p2.received().is_empty(), "an unhealthy P gets no requests");
        assert_eq!(p1.received().len(), 4);
        let metrics = client()
            .get(format!("{}/metrics", proxy.url()))
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        let line = format!(
            "handoff_proxy_instance_healthy{{role=\"prefill\",url=\"{}\"}} 0",
            p2.url
        );
        assert!(metrics.contains(&line), "{metrics}");

        // Healthy again: traffic comes back.
        p2.set_health(200);
        wait_until(|| find(&proxy.instances(), &p2.url).healthy).await;
        for _ in 0..2 {
            assert_eq!(post(&proxy, "/v1/completions", &completion()).await.0, 200);
        }
        assert_eq!(p2.received().len(), 1);
    })
    .await
}

/// A busy engine answers its health checks late; a dead or failing one refuses them or answers
/// an error. A healthy D whose `/health` answers after the timeout keeps its traffic through
/// `health_timeouts_to_fail - 1` late checks in a row (answering clients 503 while it serves
/// would be the proxy's own outage), is taken out at the limit, and is back at its first answer
/// in time; an error status still takes it out at the next check.
#[tokio::test]
async fn late_health_answers_take_an_instance_out_only_after_several_in_a_row() {
    bounded(async {
        let log = Log::default();
        let p = Fake::prefill("P1", &log).await;
        let d = Fake::decode("D1", &log).await;
        let mut cfg = config(&[&p], &[&d]);
        cfg.health_interval = Duration::from_millis(50);
        cfg.health_timeout = Duration::from_millis(800);
        cfg.health_timeouts_to_fail = 3;
        let proxy = start(cfg).await.unwrap();
        let healthy = |proxy: &RunningProxy| find(&proxy.instances(), &d.url).healthy;

        d.set_health_delay(Duration::from_millis(1600));
        let late_from = d.health_checks();
        // The third late check has started: two answered late already.
        wait_until(|| d.health_checks() >= late_from + 3).await;
        assert!(healthy(&proxy), "taken out after two late answers");
        assert_eq!(post(&proxy, "/v1/completions", &completion()).await.0, 200);
        wait_until(|| !healthy(&proxy)).await;
        assert!(d.health_checks() >= late_from + 3);

        // In time again: back.
        d.set_health_delay(Duration::ZERO);
        wait_until(|| healthy(&proxy)).await;
        assert_eq!(post(&proxy, "/v1/completions", &completion()).await.0, 200);

        // An error status is no late answer: out at the next check.
        let failing_from = d.health_checks();
        d.set_health(500);
        wait_until(|| !healthy(&proxy)).await;
        assert!(
            d.health_checks() <= failing_from + 2,
            "an error status was tolerated"
        );
    })
    .await
}

/// A host that stopped answering altogether (a lost node, a partition: its SYNs go unanswered)
/// is no busy engine: its health check fails at connect, and it is taken out at once, however
/// many late answers a busy one is allowed (here: any number; the test's 30 s bound fails it
/// otherwise). Played by a D whose listener stops
/// accepting, with its accept queue filled so that the kernel answers no new SYN.
#[tokio::test]
async fn a_host_that_no_longer_connects_is_taken_out_without_waiting_for_late_answers() {
    use std::sync::atomic::AtomicBool;
    use std::sync::Arc;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    bounded(async {
        let log = Log::default();
        let p = Fake::prefill("P1", &log).await;
        let socket = tokio::net::TcpSocket::new_v4().unwrap();
        socket.bind("127.0.0.1:0".parse().unwrap()).unwrap();
        let addr = socket.local_addr().unwrap();
        let listener = socket.listen(1).unwrap();
        let gone = Arc::new(AtomicBool::new(false));
        let serving = gone.clone();
        // Answers every request 200 (health, ready, info) until the host is "gone".
        tokio::spawn(async move {
            while !serving.load(Ordering::SeqCst) {
                let Ok(Ok((mut s, _))) =
                    tokio::time::timeout(Duration::from_millis(20), listener.accept()).await
                else {
                    continue;
                };
                tokio::spawn(async move {
                    let mut buf = [0u8; 4096];
                    let _ = s.read(&mut buf).await;
                    let _ = s
                        .write_all(
                            b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\nconnection: close\r\n\r\n",
                        )
                        .await;
                });
            }
            // Never accepts again; the listener stays open with a full queue.
            std::future::pending::<()>().await;
            drop(listener);
        });
        let d_url = format!("http://{addr}");
        let mut cfg = config(&[&p], &[]);
        cfg.decode = vec![d_url.clone()];
        cfg.health_interval = Duration::from_millis(100);
        cfg.health_timeout = Duration::from_millis(800);
        // Late answers alone would never take it out: only a failure to connect can.
        cfg.health_timeouts_to_fail = u32::MAX;
        let proxy = start(cfg).await.unwrap();
        wait_until(|| find(&proxy.instances(), &d_url).healthy).await;

        gone.store(true, Ordering::SeqCst);
        tokio::time::sleep(Duration::from_millis(50)).await;
        // Fill the accept queue (backlog 1): later SYNs get no answer.
        let mut fillers = Vec::new();
        for _ in 0..4 {
            if let Ok(Ok(c)) = tokio::time::timeout(
                Duration::from_millis(200),
                tokio::net::TcpStream::connect(addr),
            )
            .await
            {
                fillers.push(c);
            }
        }
        wait_until(|| !find(&proxy.instances(), &d_url).healthy).await;
        drop(fillers);
    })
    .await
}

fn info_with_key(name: &str, role: &str, key: &str) -> Value {
    json!({
        "engine_id": format!("engine-{name}"), "remote_host": "10.1.2.3", "remote_port": 7100,
        "tp_size": 1, "block_size": 16, "transfer_mode": "pull", "role": role,
        "compat_key": key
    })
}

/// The proxy pairs a P and a D only when their compatibility keys (`/v1/handoff/info`) are
/// equal: a P whose key no D shares gets no request, and when no pair is compatible the client
/// gets a 503 naming the keys before anything is sent to either engine.
#[tokio::test]
async fn p_and_d_with_different_compatibility_keys_are_never_paired() {
    bounded(async {
        let log = Log::default();
        let p1 = Fake::prefill("P1", &log).await;
        let p2 = Fake::prefill("P2", &log).await;
        let d = Fake::decode("D1", &log).await;
        p1.set_info(info_with_key("P1", "prefill", "aaaaaaaaaaaa"));
        p2.set_info(info_with_key("P2", "prefill", "bbbbbbbbbbbb"));
        d.set_info(info_with_key("D1", "decode", "bbbbbbbbbbbb"));
        let paired = proxy(&[&p1, &p2], &[&d]).await;
        for _ in 0..4 {
            let (s, body) = post(&paired, "/v1/completions", &completion()).await;
            assert_eq!(s, 200, "{body}");
        }
        assert!(
            p1.received().is_empty(),
            "P1 (another key) was sent a request"
        );
        assert_eq!(p2.received().len(), 4);
        paired.shutdown().await.unwrap();

        // No compatible pair at all: refused before any leg is sent.
        let log = Log::default();
        let p = Fake::prefill("P3", &log).await;
        let d = Fake::decode("D3", &log).await;
        p.set_info(info_with_key("P3", "prefill", "aaaaaaaaaaaa"));
        d.set_info(info_with_key("D3", "decode", "cccccccccccc"));
        let refusing = proxy(&[&p], &[&d]).await;
        let (s, body) = post(&refusing, "/v1/completions", &completion()).await;
        assert_eq!(s, 503, "{body}");
        assert_eq!(body["error"]["type"], "no_compatible_pair", "{body}");
        let msg = body["error"]["message"].as_str().unwrap_or_default();
        assert!(
            msg.contains("aaaaaaaaaaaa") && msg.contains("cccccccccccc"),
            "{msg}"
        );
        assert!(p.received().is_empty() && d.received().is_empty());
        refusing.shutdown().await.unwrap();
    })
    .await
}

/// Readiness: an instance that answers `/health` but says it is not ready (`/ready` 503) gets
/// no new request, and the proxy's own `/ready` is 503 (with the reason) when no P can be
/// paired with a D, 200 when one can.
#[tokio::test]
async fn a_request_refused_by_a_draining_prefill_goes_to_another() {
    bounded(async {
        let log = Log::default();
        let p1 = Fake::prefill("P1", &log).await;
        let p2 = Fake::prefill("P2", &log).await;
        let d = Fake::decode("D1", &log).await;
        // Draining, and the proxy has not seen its readiness change yet.
        p1.set_draining();
        let px = proxy(&[&p1, &p2], &[&d]).await;
        for _ in 0..4 {
            let (s, body) = post(&px, "/v1/completions", &completion()).await;
            assert_eq!(s, 200, "{body}");
        }
        assert!(!p1.received().is_empty(), "P1 was tried");
        assert_eq!(p2.received().len(), 4, "P2 served every request");
        px.shutdown().await.unwrap();
    })
    .await
}

#[tokio::test]
async fn an_engine_that_is_not_ready_gets_no_request() {
    bounded(async {
        let log = Log::default();
        let p1 = Fake::prefill("P1", &log).await;
        let p2 = Fake::prefill("P2", &log).await;
        let d = Fake::decode("D1", &log).await;
        p1.set_ready(503);
        let paired = proxy(&[&p1, &p2], &[&d]).await;
        for _ in 0..4 {
            let (s, body) = post(&paired, "/v1/completions", &completion()).await;
            assert_eq!(s, 200, "{body}");
        }
        assert!(
            p1.received().is_empty(),
            "a P that is not ready was sent a request"
        );
        let ready = client()
            .get(format!("{}/ready", paired.url()))
            .send()
            .await
            .unwrap();
        assert_eq!(ready.status(), 200);
        paired.shutdown().await.unwrap();

        d.set_ready(503);
        let alone = proxy(&[&p2], &[&d]).await;
        let r = client()
            .get(format!("{}/ready", alone.url()))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 503);
        let body: Value = r.json().await.unwrap();
        assert!(
            body["reason"]
                .as_str()
                .unwrap_or_default()
                .contains("decode"),
            "{body}"
        );
        alone.shutdown().await.unwrap();
    })
    .await
}
