//! What the proxy's end-to-end test files share: a bound on every test, the proxy's test
//! configuration in front of fake engines, and an HTTP client and its requests.

#![allow(dead_code)]

use std::future::Future;
use std::net::SocketAddr;
use std::time::Duration;

use handoff_proxy::{start, InstanceInfo, ProxyConfig, RunningProxy};
use serde_json::{json, Value};

use crate::fake::Fake;

/// `f`, or a panic after 30 s: every test is bounded in time.
pub async fn bounded<F: Future>(f: F) -> F::Output {
    tokio::time::timeout(Duration::from_secs(30), f)
        .await
        .expect("test took longer than 30 s")
}

/// A pull proxy on loopback in front of `ps` and `ds`, with short timeouts.
pub fn config(ps: &[&Fake], ds: &[&Fake]) -> ProxyConfig {
    ProxyConfig {
        bind: SocketAddr::from(([127, 0, 0, 1], 0)),
        prefill: ps.iter().map(|f| f.url.clone()).collect(),
        decode: ds.iter().map(|f| f.url.clone()).collect(),
        // Long by default so that health checks do not interfere; health tests shorten it.
        health_interval: Duration::from_secs(60),
        health_timeout: Duration::from_millis(500),
        connect_timeout: Duration::from_secs(1),
        request_timeout: Duration::from_secs(5),
        stream_idle_timeout: Duration::from_secs(5),
        release_timeout: Duration::from_secs(1),
        ..ProxyConfig::default()
    }
}

pub async fn proxy(ps: &[&Fake], ds: &[&Fake]) -> RunningProxy {
    start(config(ps, ds)).await.unwrap()
}

pub fn client() -> reqwest::Client {
    reqwest::Client::builder().no_proxy().build().unwrap()
}

/// POSTs `body` to the proxy's `path`: the status and the JSON answer.
pub async fn post(proxy: &RunningProxy, path: &str, body: &Value) -> (u16, Value) {
    let r = client()
        .post(format!("{}{}", proxy.url(), path))
        .json(body)
        .send()
        .await
        .unwrap();
    let status = r.status().as_u16();
    (status, r.json().await.unwrap())
}

pub fn completion() -> Value {
    json!({"model": "m", "prompt": "hello", "max_tokens": 8})
}

/// The proxy's `/metrics` text.
pub async fn metrics(proxy: &RunningProxy) -> String {
    client()
        .get(format!("{}/metrics", proxy.url()))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap()
}

pub fn find<'a>(list: &'a [InstanceInfo], url: &str) -> &'a InstanceInfo {
    list.iter().find(|i| i.url == url).expect("instance listed")
}

pub async fn wait_until(mut cond: impl FnMut() -> bool) {
    while !cond() {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
