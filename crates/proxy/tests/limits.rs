//! Trust boundaries of the proxy's HTTP side, against fake engines on loopback: the admin API on
//! its own listener behind a bearer token, instance URLs validated, no redirects followed, and
//! bounded serving (slowloris, oversized bodies, connection floods, endless upstream bodies).
//! Every test is bounded in time and checks that the counter in /metrics moved.

mod fake;
mod harness;

use std::future::Future;
use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use fake::{Fake, Log};
use handoff_http::probe::{hold_connections, read_until_closed, slowloris, status_of};
use handoff_http::Limits;
use handoff_proxy::{start, AdminToken, ProxyConfig, RunningProxy};
use harness::{bounded, client, completion, metrics};
use serde_json::{json, Value};

const TOKEN: &str = "test-admin-token-0123456789";

fn config(ps: &[&Fake], ds: &[&Fake]) -> ProxyConfig {
    ProxyConfig {
        admin_token: Some(AdminToken::new(TOKEN).unwrap()),
        ..harness::config(ps, ds)
    }
}

async fn complete(proxy: &RunningProxy) -> (u16, Value) {
    harness::post(proxy, "/v1/completions", &completion()).await
}

fn admin(proxy: &RunningProxy) -> String {
    format!("{}/admin/instances", proxy.admin_url().unwrap())
}

/// The value of the sample `name{labels}` (exactly as exposed), 0 when absent.
fn sample(text: &str, series: &str) -> f64 {
    text.lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' '))
        .map(|v| v.trim().parse().unwrap())
        .unwrap_or(0.0)
}

fn limit_hits(text: &str, listener: &str, limit: &str) -> f64 {
    sample(
        text,
        &format!(
            "handoff_proxy_http_limit_hits_total{{listener=\"{listener}\",limit=\"{limit}\"}}"
        ),
    )
}

fn admin_requests(text: &str, outcome: &str) -> f64 {
    sample(
        text,
        &format!("handoff_proxy_admin_requests_total{{outcome=\"{outcome}\"}}"),
    )
}

#[tokio::test]
async fn admin_api_is_not_on_the_public_listener() {
    bounded(async {
        let log = Log::default();
        let p = Fake::prefill("P1", &log).await;
        let d = Fake::decode("D1", &log).await;
        let proxy = start(config(&[&p], &[&d])).await.unwrap();
        let admin_addr = proxy.admin_addr().unwrap();
        assert!(admin_addr.ip().is_loopback());
        assert_ne!(admin_addr, proxy.local_addr());
        let c = client();
        let public = format!("{}/admin/instances", proxy.url());
        let body = json!({"role": "decode", "url": "http://127.0.0.1:9"});
        for req in [
            c.get(&public),
            c.post(&public).json(&body),
            c.delete(&public).json(&body),
        ] {
            let r = req.bearer_auth(TOKEN).send().await.unwrap();
            assert_eq!(r.status(), 404);
        }
        // Nothing was added, and the admin listener saw nothing.
        assert_eq!(proxy.instances().len(), 2);
        let m = metrics(&proxy).await;
        assert_eq!(admin_requests(&m, "ok"), 0.0);
        assert_eq!(admin_requests(&m, "unauthorized"), 0.0);
        // The admin listener does not serve the public API either.
        let r = c
            .post(format!("{}/v1/completions", proxy.admin_url().unwrap()))
            .bearer_auth(TOKEN)
            .json(&completion())
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 404);
    })
    .await
}

#[tokio::test]
async fn admin_api_needs_the_bearer_token() {
    bounded(async {
        let log = Log::default();
        let p = Fake::prefill("P1", &log).await;
        let d = Fake::decode("D1", &log).await;
        let d2 = Fake::decode("D2", &log).await;
        let proxy = start(config(&[&p], &[&d])).await.unwrap();
        let c = client();
        let add = json!({"role": "decode", "url": d2.url});

        let refused = [
            c.get(admin(&proxy)),
            c.post(admin(&proxy)).json(&add),
            c.post(admin(&proxy))
                .json(&add)
                .bearer_auth("wrong-token-0123456789abc"),
            c.post(admin(&proxy))
                .json(&add)
                .bearer_auth(&TOKEN[..TOKEN.len() - 1]),
            c.delete(admin(&proxy))
                .json(&add)
                .basic_auth("admin", Some(TOKEN)),
            c.get(admin(&proxy)).header("authorization", TOKEN),
        ];
        let n_refused = refused.len();
        for req in refused {
            let r = req.send().await.unwrap();
            assert_eq!(r.status(), 401);
            assert!(r.headers()["www-authenticate"]
                .to_str()
                .unwrap()
                .starts_with("Bearer"));
            let e: Value = r.json().await.unwrap();
            assert_eq!(e["error"]["type"], "unauthorized", "{e}");
        }
        assert_eq!(proxy.instances().len(), 2, "nothing was added");

        let r = c
            .post(admin(&proxy))
            .bearer_auth(TOKEN)
            .json(&add)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 201);
        let r = c
            .get(admin(&proxy))
            .header("authorization", format!("bearer {TOKEN}"))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        let list: Value = r.json().await.unwrap();
        assert_eq!(list["decode"].as_array().unwrap().len(), 2);

        let m = metrics(&proxy).await;
        assert_eq!(admin_requests(&m, "unauthorized"), n_refused as f64);
        assert_eq!(admin_requests(&m, "ok"), 2.0);
    })
    .await
}

#[tokio::test]
async fn a_reachable_admin_listener_without_a_token_is_refused_at_start() {
    bounded(async {
        let cfg = ProxyConfig {
            admin_bind: Some(SocketAddr::from(([0, 0, 0, 0], 0))),
            admin_token: None,
            ..config(&[], &[])
        };
        let e = start(cfg).await.err().expect("refused").to_string();
        assert!(e.contains("not a loopback address"), "{e}");
        assert!(e.contains("token"), "{e}");
        assert!(AdminToken::new("short").is_err());
        assert!(AdminToken::new("has a space in it, long enough").is_err());
        assert_eq!(
            format!("{:?}", AdminToken::new(TOKEN).unwrap()),
            "AdminToken(<redacted>)"
        );
    })
    .await
}

#[tokio::test]
async fn bad_instance_urls_are_refused_with_400_naming_the_problem() {
    bounded(async {
        let log = Log::default();
        let p = Fake::prefill("P1", &log).await;
        let d = Fake::decode("D1", &log).await;
        let proxy = start(config(&[&p], &[&d])).await.unwrap();
        let c = client();
        let cases = [
            ("https://127.0.0.1:8100", "only http://"),
            ("file:///etc/passwd", "only http://"),
            ("http://127.0.0.1", "no port"),
            ("http://user:secret@127.0.0.1:8100", "user info"),
            ("http://127.0.0.1:8100/v1", "has a path"),
            ("http://127.0.0.1:8100?x=1", "has a query"),
            ("http://127.0.0.1:8100#x", "has a fragment"),
            ("http://:8100", "no host"),
            ("http://127.0.0.1:70000", "not 1..=65535"),
            ("127.0.0.1:8100", "not of the form http://host:port"),
        ];
        for (url, why) in cases {
            let r = c
                .post(admin(&proxy))
                .bearer_auth(TOKEN)
                .json(&json!({"role": "prefill", "url": url}))
                .send()
                .await
                .unwrap();
            assert_eq!(r.status(), 400, "{url}");
            let e: Value = r.json().await.unwrap();
            let msg = e["error"]["message"].as_str().unwrap();
            assert!(msg.contains(why), "{url}: {msg}");
        }
        assert_eq!(proxy.instances().len(), 2, "nothing was added");
        let m = metrics(&proxy).await;
        assert_eq!(admin_requests(&m, "bad_request"), cases.len() as f64);
        // The same checks hold for the instances given at start.
        let e = start(ProxyConfig {
            prefill: vec!["http://u:p@127.0.0.1:1".into()],
            ..config(&[], &[])
        })
        .await
        .err()
        .expect("refused")
        .to_string();
        assert!(e.contains("user info"), "{e}");
    })
    .await
}

#[tokio::test]
async fn redirects_from_an_instance_are_not_followed() {
    bounded(async {
        let log = Log::default();
        let p = Fake::prefill("P1", &log).await;
        let elsewhere = Fake::prefill("ELSEWHERE", &log).await;
        let d = Fake::decode("D1", &log).await;
        p.redirect_to(&elsewhere.url, false);
        let proxy = start(config(&[&p], &[&d])).await.unwrap();
        let (status, e) = complete(&proxy).await;
        assert_eq!(status, 502, "{e}");
        assert_eq!(e["error"]["upstream_status"], 307, "{e}");
        assert!(elsewhere.received().is_empty(), "the redirect was followed");
        assert!(d.received().is_empty());
        let m = metrics(&proxy).await;
        assert_eq!(
            sample(
                &m,
                "handoff_proxy_requests_total{outcome=\"prefill_failed\"}"
            ),
            1.0
        );

        // An instance whose health check redirects (even to a healthy one) is not healthy.
        let sly = Fake::decode("SLY", &log).await;
        sly.redirect_to(&d.url, true);
        let r = client()
            .post(admin(&proxy))
            .bearer_auth(TOKEN)
            .json(&json!({"role": "decode", "url": sly.url}))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 201);
        let added: Value = r.json().await.unwrap();
        assert_eq!(added["instance"]["healthy"], false, "{added}");
    })
    .await
}

/// Slowloris against one listener while a legitimate request is served on it.
async fn slowloris_is_cut(
    proxy: &RunningProxy,
    addr: SocketAddr,
    listener: &str,
    legit: impl Future<Output = u16>,
) {
    let attack = tokio::spawn(slowloris(
        addr,
        "/health",
        Duration::from_secs(1),
        Duration::from_secs(10),
    ));
    tokio::time::sleep(Duration::from_millis(300)).await;
    let t = Instant::now();
    assert_eq!(legit.await, 200);
    assert!(t.elapsed() < Duration::from_secs(1), "{:?}", t.elapsed());
    let s = attack.await.unwrap().unwrap();
    assert!(s.closed, "{listener}: the slow client was not cut: {s:?}");
    assert_eq!(s.status(), Some(408), "{listener}: {s:?}");
    // Header timeout 2.5 s; a byte every second kept arriving all along.
    assert!(s.held >= Duration::from_millis(2400), "{listener}: {s:?}");
    assert!(s.held < Duration::from_secs(5), "{listener}: {s:?}");
    assert!(s.bytes_sent >= 2, "{listener}: {s:?}");
    let m = metrics(proxy).await;
    assert_eq!(
        limit_hits(&m, listener, "header_timeout"),
        1.0,
        "{listener}"
    );
}

#[tokio::test]
async fn slowloris_is_cut_at_the_header_timeout_on_both_listeners() {
    bounded(async {
        let log = Log::default();
        let p = Fake::prefill("P1", &log).await;
        let d = Fake::decode("D1", &log).await;
        let limits = Limits {
            header_read_timeout: Duration::from_millis(2500),
            ..Limits::default()
        };
        let proxy = start(ProxyConfig {
            http: limits.clone(),
            admin_http: limits,
            ..config(&[&p], &[&d])
        })
        .await
        .unwrap();
        slowloris_is_cut(&proxy, proxy.local_addr(), "public", async {
            complete(&proxy).await.0
        })
        .await;
        slowloris_is_cut(&proxy, proxy.admin_addr().unwrap(), "admin", async {
            let r = client()
                .get(admin(&proxy))
                .bearer_auth(TOKEN)
                .send()
                .await
                .unwrap();
            r.status().as_u16()
        })
        .await;
    })
    .await
}

#[tokio::test]
async fn bodies_over_the_limit_get_413() {
    bounded(async {
        let log = Log::default();
        let p = Fake::prefill("P1", &log).await;
        let d = Fake::decode("D1", &log).await;
        let proxy = start(ProxyConfig {
            http: Limits {
                max_body_bytes: 64 << 10,
                ..Limits::default()
            },
            ..config(&[&p], &[&d])
        })
        .await
        .unwrap();
        let big = json!({"model": "m", "prompt": "x".repeat(100 << 10), "max_tokens": 8});
        let r = client()
            .post(format!("{}/v1/completions", proxy.url()))
            .json(&big)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 413);
        let e: Value = r.json().await.unwrap();
        assert!(
            e["error"]["message"].as_str().unwrap().contains("65536"),
            "{e}"
        );
        assert!(p.received().is_empty(), "nothing reached P");
        // The admin listener's own limit (64 KiB by default) holds too.
        let r = client()
            .post(admin(&proxy))
            .bearer_auth(TOKEN)
            .json(&json!({"role": "decode", "url": "x".repeat(100 << 10)}))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 413);
        assert_eq!(complete(&proxy).await.0, 200);
        let m = metrics(&proxy).await;
        assert_eq!(limit_hits(&m, "public", "body_too_large"), 1.0);
        assert_eq!(limit_hits(&m, "admin", "body_too_large"), 1.0);
    })
    .await
}

#[tokio::test]
async fn a_connection_flood_beyond_the_cap_is_refused_and_counted() {
    bounded(async {
        let log = Log::default();
        let p = Fake::prefill("P1", &log).await;
        let d = Fake::decode("D1", &log).await;
        let proxy = start(ProxyConfig {
            http: Limits {
                max_connections: 8,
                idle_timeout: Duration::from_secs(1),
                ..Limits::default()
            },
            ..config(&[&p], &[&d])
        })
        .await
        .unwrap();
        let addr = proxy.local_addr();
        // The flood: connections that send nothing, as many as the cap, then more.
        let _held = hold_connections(addr, 8).await.unwrap();
        tokio::time::sleep(Duration::from_millis(200)).await;
        let mut extra = hold_connections(addr, 5).await.unwrap();
        for c in &mut extra {
            let got = read_until_closed(c, Duration::from_secs(3)).await;
            assert_eq!(
                status_of(&got),
                Some(503),
                "{}",
                String::from_utf8_lossy(&got)
            );
            assert!(String::from_utf8_lossy(&got).contains("at most 8 connections"));
        }
        // The held connections send nothing: the idle timeout frees their slots, though the
        // flooder keeps its end open, and a legitimate request gets through.
        tokio::time::sleep(Duration::from_millis(1500)).await;
        assert_eq!(complete(&proxy).await.0, 200);
        let m = metrics(&proxy).await;
        assert_eq!(limit_hits(&m, "public", "connections"), 5.0);
        assert!(limit_hits(&m, "public", "idle_timeout") >= 8.0);
    })
    .await
}

#[tokio::test]
async fn an_endless_prefill_body_is_cut_with_502_and_bounded_reading() {
    bounded(async {
        let log = Log::default();
        let p = Fake::prefill("P1", &log).await;
        let d = Fake::decode("D1", &log).await;
        p.set_endless_body();
        let cap = 1 << 20;
        let proxy = start(ProxyConfig {
            max_upstream_body_bytes: cap,
            ..config(&[&p], &[&d])
        })
        .await
        .unwrap();
        let t = Instant::now();
        let (status, e) = complete(&proxy).await;
        assert_eq!(status, 502, "{e}");
        assert_eq!(e["error"]["type"], "upstream_body_too_large", "{e}");
        assert_eq!(e["error"]["role"], "prefill", "{e}");
        assert!(t.elapsed() < Duration::from_secs(3), "{:?}", t.elapsed());
        assert!(d.received().is_empty(), "D is never called");
        // The proxy dropped the connection: P's body stops being pulled, a few socket buffers
        // past the cap (an unbounded reader would pull it for as long as the test runs).
        let st = &p.state;
        while !st.endless_dropped.load(Ordering::SeqCst) {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let sent = st.endless_bytes.load(Ordering::SeqCst);
        assert!(sent < (cap as u64) + (32 << 20), "{sent} bytes pulled");
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert_eq!(st.endless_bytes.load(Ordering::SeqCst), sent);
        let m = metrics(&proxy).await;
        assert_eq!(
            sample(
                &m,
                "handoff_proxy_upstream_body_too_large_total{role=\"prefill\"}"
            ),
            1.0
        );
        // A normal P afterwards is served as usual.
        st.endless_body.store(false, Ordering::SeqCst);
        assert_eq!(complete(&proxy).await.0, 200);
    })
    .await
}
