//! The instances the proxy routes to, one pool per role, and the policies that pick one.

use std::fmt;
use std::str::FromStr;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock};

use prometheus_client::metrics::gauge::Gauge;
use serde::{Deserialize, Serialize};

use crate::info::EngineInfo;
use crate::metrics::{InstanceLabels, Metrics};

/// Which leg an instance serves.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    Prefill,
    Decode,
}

impl Role {
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Prefill => "prefill",
            Role::Decode => "decode",
        }
    }
}

impl fmt::Display for Role {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for Role {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.to_ascii_lowercase().as_str() {
            "prefill" | "p" => Ok(Role::Prefill),
            "decode" | "d" => Ok(Role::Decode),
            _ => Err(format!("unknown role {s:?}: expected prefill or decode")),
        }
    }
}

/// How the proxy picks one of the healthy instances of a role for each request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Policy {
    /// Each healthy instance in turn.
    #[default]
    RoundRobin,
    /// The healthy instance with the fewest requests this proxy has in flight to it (ties broken
    /// in turn, so that idle instances share the load).
    LeastLoaded,
}

impl Policy {
    pub fn as_str(self) -> &'static str {
        match self {
            Policy::RoundRobin => "round_robin",
            Policy::LeastLoaded => "least_loaded",
        }
    }
}

impl FromStr for Policy {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.to_ascii_lowercase().replace('-', "_").as_str() {
            "round_robin" | "rr" => Ok(Policy::RoundRobin),
            "least_loaded" | "ll" => Ok(Policy::LeastLoaded),
            _ => Err(format!(
                "unknown policy {s:?}: expected round-robin or least-loaded"
            )),
        }
    }
}

/// One instance as the admin API and [`crate::RunningProxy::instances`] show it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct InstanceInfo {
    pub role: Role,
    pub url: String,
    pub healthy: bool,
    /// Requests this proxy has in flight to the instance (a D stream counts until it ends).
    pub in_flight: usize,
}

/// An instance URL [`normalize_url`] refused: the URL as given (trimmed) and what is wrong.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("instance URL {url:?} {why}")]
pub struct BadInstanceUrl {
    pub url: String,
    pub why: String,
}

/// Checks and normalises an instance base URL: `http://host:port`, nothing else. The error says
/// what is wrong, naming the URL.
///
/// - only `http` (the proxy is built without TLS: an `https` URL would fail on every request);
/// - a host (a name, an IPv4 address, or an IPv6 address in brackets) and an explicit port;
/// - no user info (`user:pass@`), path, query or fragment: an instance is a base URL, and
///   credentials in it would end up in logs and metrics. One trailing `/` is dropped.
pub fn normalize_url(url: &str) -> Result<String, BadInstanceUrl> {
    let raw = url.trim();
    let bad = |why: &str| {
        Err(BadInstanceUrl {
            url: raw.to_string(),
            why: why.to_string(),
        })
    };
    if raw.chars().any(|c| c.is_whitespace() || c.is_control()) {
        return bad("contains whitespace or control characters");
    }
    let Some((scheme, rest)) = raw.split_once("://") else {
        return bad("is not of the form http://host:port");
    };
    if !scheme.eq_ignore_ascii_case("http") {
        return bad(&format!(
            "has scheme {scheme:?}: only http:// is supported (the proxy speaks plain HTTP)"
        ));
    }
    let cut = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    let (authority, tail) = rest.split_at(cut);
    if authority.is_empty() {
        return bad("has no host");
    }
    if authority.contains('@') {
        return bad("has user info (user@host): credentials do not belong in an instance URL");
    }
    match tail {
        "" | "/" => {}
        t if t.starts_with('?') => return bad("has a query: give the base URL, http://host:port"),
        t if t.starts_with('#') => {
            return bad("has a fragment: give the base URL, http://host:port")
        }
        t if t.contains('?') => {
            return bad("has a path and a query: give the base URL, http://host:port")
        }
        _ => return bad("has a path: give the base URL, http://host:port"),
    }
    let (host, port) = if let Some(inner) = authority.strip_prefix('[') {
        let Some((v6, after)) = inner.split_once(']') else {
            return bad("has an unclosed [ in its host");
        };
        if v6.parse::<std::net::Ipv6Addr>().is_err() {
            return bad(&format!(
                "has {v6:?} in brackets, which is not an IPv6 address"
            ));
        }
        match after.strip_prefix(':') {
            Some(port) => (v6, port),
            None if after.is_empty() => return bad("has no port: write http://host:port"),
            None => return bad("has junk after its host"),
        }
    } else {
        match authority.rsplit_once(':') {
            Some((h, _)) if h.contains(':') => {
                return bad("has an IPv6 host without brackets: write http://[addr]:port")
            }
            Some((h, p)) => (h, p),
            None => return bad("has no port: write http://host:port"),
        }
    };
    if host.is_empty() {
        return bad("has no host");
    }
    let bracketed = authority.starts_with('[');
    if !bracketed
        && !host
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '-' | '_'))
    {
        return bad(&format!(
            "has host {host:?}, which is not a name or an address"
        ));
    }
    if port.is_empty() {
        return bad("has no port: write http://host:port");
    }
    match port.parse::<u16>() {
        Ok(p) if p > 0 && port.bytes().all(|b| b.is_ascii_digit()) => {}
        _ => return bad(&format!("has port {port:?}, which is not 1..=65535")),
    }
    Ok(format!("http://{authority}"))
}

pub(crate) struct Instance {
    pub(crate) url: String,
    pub(crate) role: Role,
    // Instances start unhealthy: nothing is sent to one until a health check has passed.
    healthy: AtomicBool,
    /// Health checks in a row that got no answer in time (see `ProxyConfig::health_timeouts_to_fail`).
    late_checks: AtomicU32,
    in_flight: AtomicUsize,
    in_flight_gauge: Gauge,
    healthy_gauge: Gauge,
    /// Push mode, P only: its `GET /v1/handoff/info`, cached; refreshed by every health check,
    /// dropped when a request through it fails (it may have restarted with another engine id).
    handoff_info: Mutex<Option<Arc<EngineInfo>>>,
}

impl Instance {
    pub(crate) fn is_healthy(&self) -> bool {
        self.healthy.load(Ordering::Relaxed)
    }

    /// Records a health verdict; returns the previous one so the caller can log transitions.
    pub(crate) fn set_healthy(&self, healthy: bool) -> bool {
        self.late_checks.store(0, Ordering::Relaxed);
        self.healthy_gauge.set(i64::from(healthy));
        self.healthy.swap(healthy, Ordering::Relaxed)
    }

    /// One more health check in a row got no answer in time; returns how many now.
    pub(crate) fn late_check(&self) -> u32 {
        self.late_checks.fetch_add(1, Ordering::Relaxed) + 1
    }

    pub(crate) fn in_flight(&self) -> usize {
        self.in_flight.load(Ordering::Relaxed)
    }

    pub(crate) fn handoff_info(&self) -> Option<Arc<EngineInfo>> {
        self.handoff_info
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Stores (or with `None` forgets) the instance's handoff info; returns the previous one.
    pub(crate) fn set_handoff_info(
        &self,
        info: Option<Arc<EngineInfo>>,
    ) -> Option<Arc<EngineInfo>> {
        std::mem::replace(
            &mut *self.handoff_info.lock().unwrap_or_else(|e| e.into_inner()),
            info,
        )
    }

    pub(crate) fn info(&self) -> InstanceInfo {
        InstanceInfo {
            role: self.role,
            url: self.url.clone(),
            healthy: self.is_healthy(),
            in_flight: self.in_flight(),
        }
    }
}

/// Counts one request in flight to an instance for as long as it lives. For a streamed D answer
/// it lives inside the response body, so the count ends when the stream ends or is dropped.
pub(crate) struct InFlight(Arc<Instance>);

impl InFlight {
    pub(crate) fn new(inst: Arc<Instance>) -> Self {
        inst.in_flight.fetch_add(1, Ordering::Relaxed);
        inst.in_flight_gauge.inc();
        InFlight(inst)
    }

    pub(crate) fn instance(&self) -> &Arc<Instance> {
        &self.0
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::Relaxed);
        self.0.in_flight_gauge.dec();
    }
}

pub(crate) struct Pool {
    role: Role,
    instances: RwLock<Vec<Arc<Instance>>>,
    next: AtomicUsize,
}

impl Pool {
    pub(crate) fn new(role: Role) -> Self {
        Pool {
            role,
            instances: RwLock::new(Vec::new()),
            next: AtomicUsize::new(0),
        }
    }

    fn read(&self) -> std::sync::RwLockReadGuard<'_, Vec<Arc<Instance>>> {
        // A panic while holding this lock cannot leave the list half-changed (push/retain), so a
        // poisoned lock is still a valid list.
        self.instances.read().unwrap_or_else(|e| e.into_inner())
    }

    /// Adds an instance (unhealthy until checked). Returns it, or `None` when the URL is already
    /// in the pool: adding is idempotent.
    pub(crate) fn add(&self, url: String, metrics: &Metrics) -> Option<Arc<Instance>> {
        let mut list = self.instances.write().unwrap_or_else(|e| e.into_inner());
        if list.iter().any(|i| i.url == url) {
            return None;
        }
        let labels = InstanceLabels {
            role: self.role.as_str(),
            url: url.clone(),
        };
        let healthy_gauge = metrics.instance_healthy.get_or_create(&labels).clone();
        healthy_gauge.set(0);
        let inst = Arc::new(Instance {
            url,
            role: self.role,
            healthy: AtomicBool::new(false),
            late_checks: AtomicU32::new(0),
            in_flight: AtomicUsize::new(0),
            in_flight_gauge: metrics.in_flight.get_or_create(&labels).clone(),
            healthy_gauge,
            handoff_info: Mutex::new(None),
        });
        list.push(inst.clone());
        Some(inst)
    }

    /// Removes an instance: it gets no new requests; those in flight to it run to their end.
    pub(crate) fn remove(&self, url: &str, metrics: &Metrics) -> bool {
        let mut list = self.instances.write().unwrap_or_else(|e| e.into_inner());
        let before = list.len();
        list.retain(|i| i.url != url);
        let removed = list.len() != before;
        if removed {
            let labels = InstanceLabels {
                role: self.role.as_str(),
                url: url.to_string(),
            };
            metrics.instance_healthy.remove(&labels);
            metrics.in_flight.remove(&labels);
        }
        removed
    }

    pub(crate) fn snapshot(&self) -> Vec<Arc<Instance>> {
        self.read().clone()
    }

    pub(crate) fn healthy(&self) -> Vec<Arc<Instance>> {
        self.read()
            .iter()
            .filter(|i| i.is_healthy())
            .cloned()
            .collect()
    }

    pub(crate) fn healthy_count(&self) -> usize {
        self.read().iter().filter(|i| i.is_healthy()).count()
    }

    /// Picks a healthy instance by `policy` and counts the request in flight to it at once, so
    /// that the next least-loaded pick already sees it.
    pub(crate) fn pick(&self, policy: Policy) -> Option<InFlight> {
        self.pick_where(policy, |_| true)
    }

    /// [`Pool::pick`] among the healthy instances `ok` accepts.
    pub(crate) fn pick_where(
        &self,
        policy: Policy,
        ok: impl Fn(&Instance) -> bool,
    ) -> Option<InFlight> {
        let list = self.read();
        let healthy: Vec<&Arc<Instance>> =
            list.iter().filter(|i| i.is_healthy() && ok(i)).collect();
        if healthy.is_empty() {
            return None;
        }
        let n = healthy.len();
        let start = self.next.fetch_add(1, Ordering::Relaxed) % n;
        let chosen = match policy {
            Policy::RoundRobin => healthy[start],
            Policy::LeastLoaded => {
                // Scan from a rotating start so that ties go to each instance in turn.
                let mut best = healthy[start];
                for k in 1..n {
                    let cand = healthy[(start + k) % n];
                    if cand.in_flight() < best.in_flight() {
                        best = cand;
                    }
                }
                best
            }
        };
        Some(InFlight::new(chosen.clone()))
    }
}

/// Whether a P and a D can exchange KV, by the compatibility keys their `/v1/handoff/info`
/// gave (`handoff_compat_info`). An instance that has not said (no info yet, or an engine
/// without a key, such as vLLM) pairs with any: its handshake still refuses a mismatch.
pub(crate) fn compatible(p: &Instance, d: &Instance) -> Result<(), String> {
    let key = |i: &Instance| i.handoff_info().and_then(|info| info.compat_key.clone());
    match (key(p), key(d)) {
        (Some(a), Some(b)) if a != b => Err(format!(
            "prefill {} has compatibility key {a}, decode {} has {b}",
            p.url, d.url
        )),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pool_with(urls: &[&str], metrics: &Metrics) -> Pool {
        let pool = Pool::new(Role::Decode);
        for u in urls {
            pool.add(u.to_string(), metrics).unwrap().set_healthy(true);
        }
        pool
    }

    #[test]
    fn url_normalisation() {
        assert_eq!(normalize_url("http://a:1/").unwrap(), "http://a:1");
        assert_eq!(
            normalize_url(" HTTP://a-b.c:80 ").unwrap(),
            "http://a-b.c:80"
        );
        assert_eq!(
            normalize_url("http://[::1]:8100").unwrap(),
            "http://[::1]:8100"
        );
        for (url, why) in [
            ("https://a:1", "only http://"),
            ("ftp://a:1", "only http://"),
            ("a:1", "not of the form"),
            ("http://", "no host"),
            ("http://:1", "no host"),
            ("http://a", "no port"),
            ("http://a:", "no port"),
            ("http://a:0", "not 1..=65535"),
            ("http://a:99999", "not 1..=65535"),
            ("http://a:+1", "not 1..=65535"),
            ("http://u:p@a:1", "user info"),
            ("http://u@a:1", "user info"),
            ("http://a:1/x", "has a path"),
            ("http://a:1/x?y=1", "a path and a query"),
            ("http://a:1?y=1", "has a query"),
            ("http://a:1#f", "has a fragment"),
            ("http://::1:80", "without brackets"),
            ("http://[zz]:80", "not an IPv6 address"),
            ("http://[::1]", "no port"),
            ("http://a b:1", "whitespace"),
            ("http://a%2f:1", "not a name or an address"),
        ] {
            let e = normalize_url(url).unwrap_err();
            assert!(e.why.contains(why), "{url}: {e}");
            assert_eq!(e.url, url.trim(), "{url}: {e}");
        }
    }

    #[test]
    fn round_robin_skips_unhealthy() {
        let m = Metrics::new();
        let pool = pool_with(&["http://a", "http://b", "http://c"], &m);
        pool.snapshot()[1].set_healthy(false);
        let picks: Vec<String> = (0..4)
            .map(|_| {
                pool.pick(Policy::RoundRobin)
                    .unwrap()
                    .instance()
                    .url
                    .clone()
            })
            .collect();
        assert!(!picks.contains(&"http://b".to_string()));
        assert_ne!(picks[0], picks[1]);
        assert_eq!(picks[0], picks[2]);
    }

    #[test]
    fn least_loaded_prefers_idle_and_counts_guards() {
        let m = Metrics::new();
        let pool = pool_with(&["http://a", "http://b"], &m);
        let held = pool.pick(Policy::LeastLoaded).unwrap();
        let busy = held.instance().url.clone();
        for _ in 0..5 {
            let g = pool.pick(Policy::LeastLoaded).unwrap();
            assert_ne!(g.instance().url, busy);
        }
        drop(held);
        assert!(pool.snapshot().iter().all(|i| i.in_flight() == 0));
    }

    #[test]
    fn add_is_idempotent_and_remove_works() {
        let m = Metrics::new();
        let pool = pool_with(&["http://a"], &m);
        assert!(pool.add("http://a".into(), &m).is_none());
        assert!(pool.remove("http://a", &m));
        assert!(!pool.remove("http://a", &m));
        assert!(pool.pick(Policy::RoundRobin).is_none());
    }

    #[test]
    fn parse_policy_and_role() {
        assert_eq!(
            "least-loaded".parse::<Policy>().unwrap(),
            Policy::LeastLoaded
        );
        assert_eq!("round_robin".parse::<Policy>().unwrap(), Policy::RoundRobin);
        assert_eq!("Decode".parse::<Role>().unwrap(), Role::Decode);
        assert!("x".parse::<Policy>().is_err());
    }
}
