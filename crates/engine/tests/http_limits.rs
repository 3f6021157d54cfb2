//! The engine's HTTP API is bounded: a slowloris client is cut at the header timeout, an
//! oversized body gets 413, a connection flood beyond the cap is refused with 503, while
//! legitimate requests on the same listener are served. Each hit is counted in /metrics
//! (`engine_http_limit_hits_total{listener="api",limit}`). Loopback, mem transport, bounded.

mod common;

use std::future::Future;
use std::time::{Duration, Instant};

use common::{metrics_text, post};
use handoff_engine::{start, EngineConfig, RunningEngine};
use handoff_http::probe::{hold_connections, read_until_closed, slowloris, status_of};
use serde_json::json;

async fn bounded<F: Future>(f: F) -> F::Output {
    tokio::time::timeout(Duration::from_secs(30), f)
        .await
        .expect("test took longer than 30 s")
}

fn cfg() -> EngineConfig {
    EngineConfig {
        role: "both".into(),
        port: 0,
        transport: "mem".into(),
        num_blocks: 128,
        prefill_us_per_token: 1.0,
        decode_step_ms: 0.2,
        decode_us_per_seq: 0.0,
        ..EngineConfig::default()
    }
}

fn limit_hits(text: &str, limit: &str) -> f64 {
    let series = format!("engine_http_limit_hits_total{{listener=\"api\",limit=\"{limit}\"}} ");
    text.lines()
        .find_map(|l| l.strip_prefix(series.as_str()))
        .map(|v| v.trim().parse().unwrap())
        .unwrap_or(0.0)
}

async fn legit(c: &reqwest::Client, e: &RunningEngine) -> u16 {
    post(c, &e.url(), json!({"prompt": "a b c d", "max_tokens": 4}))
        .await
        .0
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slowloris_is_cut_at_the_header_timeout_while_others_are_served() {
    bounded(async {
        let e = start(EngineConfig {
            http_header_read_timeout_ms: 2500,
            ..cfg()
        })
        .await
        .unwrap();
        let c = reqwest::Client::new();
        let attack = tokio::spawn(slowloris(
            e.addr,
            "/health",
            Duration::from_secs(1),
            Duration::from_secs(10),
        ));
        tokio::time::sleep(Duration::from_millis(300)).await;
        let t = Instant::now();
        assert_eq!(legit(&c, &e).await, 200);
        assert!(t.elapsed() < Duration::from_secs(2), "{:?}", t.elapsed());
        let s = attack.await.unwrap().unwrap();
        assert!(s.closed, "the slow client was not cut: {s:?}");
        assert_eq!(s.status(), Some(408), "{s:?}");
        assert!(s.held >= Duration::from_millis(2400), "{s:?}");
        assert!(s.held < Duration::from_secs(5), "{s:?}");
        assert!(s.bytes_sent >= 2, "{s:?}");
        let m = metrics_text(&c, &e).await;
        assert_eq!(limit_hits(&m, "header_timeout"), 1.0, "{m}");
        e.stop().await;
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bodies_over_the_limit_get_413() {
    bounded(async {
        let e = start(EngineConfig {
            http_max_body_bytes: 64 << 10,
            ..cfg()
        })
        .await
        .unwrap();
        let c = reqwest::Client::new();
        let (status, body) = post(
            &c,
            &e.url(),
            json!({"prompt": "w ".repeat(50 << 10), "max_tokens": 4}),
        )
        .await;
        assert_eq!(status, 413, "{body}");
        assert!(
            body["error"]["message"].as_str().unwrap().contains("65536"),
            "{body}"
        );
        assert_eq!(legit(&c, &e).await, 200);
        let m = metrics_text(&c, &e).await;
        assert_eq!(limit_hits(&m, "body_too_large"), 1.0, "{m}");
        e.stop().await;
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_flood_beyond_the_cap_is_refused_and_counted() {
    bounded(async {
        let e = start(EngineConfig {
            http_max_connections: 8,
            http_idle_timeout_ms: 1000,
            ..cfg()
        })
        .await
        .unwrap();
        let _held = hold_connections(e.addr, 8).await.unwrap();
        tokio::time::sleep(Duration::from_millis(200)).await;
        let mut extra = hold_connections(e.addr, 5).await.unwrap();
        for s in &mut extra {
            let got = read_until_closed(s, Duration::from_secs(3)).await;
            assert_eq!(
                status_of(&got),
                Some(503),
                "{}",
                String::from_utf8_lossy(&got)
            );
        }
        // The idle timeout frees the flood's slots though the flooder keeps its ends open.
        tokio::time::sleep(Duration::from_millis(1500)).await;
        let c = reqwest::Client::new();
        assert_eq!(legit(&c, &e).await, 200);
        let m = metrics_text(&c, &e).await;
        assert_eq!(limit_hits(&m, "connections"), 5.0, "{m}");
        assert!(limit_hits(&m, "idle_timeout") >= 8.0, "{m}");
        e.stop().await;
    })
    .await
}
