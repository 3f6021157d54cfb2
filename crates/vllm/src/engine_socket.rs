//! EngineCore's local socket: what vLLM's API server process asks the connector, which lives in
//! another process (EngineCore). Three questions, each from a middleware of `handoff_vllm`:
//!
//! - **`refuse`** (D, `handoff_vllm.RefusalRelease`): vLLM's API server checks a prompt against
//!   `max_model_len` (and the sampling parameters) itself and answers 400 without telling
//!   EngineCore, so the connector never hears of the request and P would keep its blocks until
//!   the lease ends. The middleware names such a request's `kv_transfer_params` here, and the
//!   connector tells P to release through the ledger (`Connector::reject`: never while this
//!   engine reads that handoff for another request).
//! - **`info`** (P, `handoff_vllm.HandoffInfo`): what a push proxy needs to send D a push
//!   request for this P (`GET /v1/handoff/info`: engine id, side channel, tp, block size, mode).
//! - **`metrics`** (P and D, `handoff_vllm.HandoffOps`): the connector's Prometheus metrics in
//!   the text format, appended to vLLM's own `/metrics` page: the API server serves that page,
//!   the connector's registry lives in EngineCore.
//!
//! A Unix socket only this user can open; one request per connection: a verb line, then (for
//! `refuse`) the params as JSON, at most [`MAX_REQUEST`] bytes in all. Answered with `ok`,
//! `error: ...`, the JSON (`info`) or the metrics' text (`metrics`). Bounded: one connection at a time, a read timeout, a
//! size cap.

use std::io::{Read, Write};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use handoff_connector::{Connector, Hooks};
use handoff_proto::KvTransferParams;
use prometheus_client::registry::Registry;

/// Largest request accepted (the params of one request).
pub const MAX_REQUEST: usize = 64 * 1024;
const TIMEOUT: Duration = Duration::from_secs(1);
/// Largest answer read back: the info JSON is a few hundred bytes, the metrics' text a few tens
/// of KiB (histograms per label set).
const MAX_ANSWER: u64 = 4 << 20;

/// What the API server asks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verb {
    /// A request vLLM refused before admission: its params follow.
    Refuse,
    /// This engine's handoff info.
    Info,
    /// The connector's metrics, in Prometheus' text format.
    Metrics,
}

impl Verb {
    fn as_str(self) -> &'static str {
        match self {
            Verb::Refuse => "refuse",
            Verb::Info => "info",
            Verb::Metrics => "metrics",
        }
    }
}

/// Where engine `engine_id`'s socket lives: the same path in the API server and in EngineCore,
/// derived from what both read from vLLM's config.
pub fn socket_path(engine_id: &str) -> PathBuf {
    runtime_path(engine_id, "sock")
}

/// A file of engine `engine_id`'s in the runtime (temporary) directory, `suffix` telling which:
/// every process of the engine derives the same path from the engine's id.
pub(crate) fn runtime_path(engine_id: &str, suffix: &str) -> PathBuf {
    let safe: String = engine_id
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' || c == '_' {
                c
            } else {
                '_'
            }
        })
        .take(64)
        .collect();
    std::env::temp_dir().join(format!("handoff-vllm-{safe}.{suffix}"))
}

/// The listener; stops (and removes its socket) when dropped.
pub struct EngineSocket {
    path: PathBuf,
    stop: Arc<AtomicBool>,
}

impl EngineSocket {
    /// Serves `connector`'s questions, and `registry` (the connector's metrics) for `metrics`.
    pub fn start(
        path: &Path,
        connector: Arc<Connector>,
        registry: Arc<Registry>,
    ) -> std::io::Result<Self> {
        // A socket left by an engine that died is stale: nobody else uses this engine's name.
        let _ = std::fs::remove_file(path);
        let listener = UnixListener::bind(path)?;
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))?;
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        std::thread::Builder::new()
            .name("handoff-engine-socket".into())
            .spawn(move || {
                for conn in listener.incoming() {
                    if flag.load(Ordering::Relaxed) {
                        break;
                    }
                    if let Ok(conn) = conn {
                        serve(conn, &connector, &registry);
                    }
                }
            })?;
        Ok(EngineSocket {
            path: path.to_path_buf(),
            stop,
        })
    }
}

impl Drop for EngineSocket {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        // Wakes the accept loop so that it sees the flag.
        let _ = UnixStream::connect(&self.path);
        let _ = std::fs::remove_file(&self.path);
    }
}

/// Splits a request into its verb and the rest; `Err` names what is wrong.
fn parse(request: &[u8]) -> Result<(Verb, &[u8]), String> {
    let (line, rest) = match request.iter().position(|&b| b == b'\n') {
        Some(i) => (&request[..i], &request[i + 1..]),
        None => (request, &[][..]),
    };
    match line {
        b"refuse" => Ok((Verb::Refuse, rest)),
        b"info" if rest.is_empty() => Ok((Verb::Info, rest)),
        b"info" => Err("info takes no body".into()),
        b"metrics" if rest.is_empty() => Ok((Verb::Metrics, rest)),
        b"metrics" => Err("metrics takes no body".into()),
        other => Err(format!(
            "unknown request {:?} (refuse, info or metrics)",
            String::from_utf8_lossy(&other[..other.len().min(32)])
        )),
    }
}

fn answer(request: &[u8], connector: &Connector, registry: &Registry) -> String {
    let (verb, body) = match parse(request) {
        Ok(v) => v,
        Err(e) => return format!("error: {e}"),
    };
    match verb {
        Verb::Info => connector.info().to_string(),
        Verb::Metrics => {
            // The held-blocks gauges as the ledgers stand now, not as of the last refresh.
            connector.refresh_metrics();
            metrics_text(registry).unwrap_or_else(|e| format!("error: {e}"))
        }
        Verb::Refuse => match serde_json::from_slice::<KvTransferParams>(body) {
            Err(e) => format!("error: kv_transfer_params: {e}"),
            Ok(params) => match connector.reject(&params) {
                Ok(()) => {
                    tracing::info!(handoff = ?params.handoff_id, "vLLM refused the request before admission: P told to release");
                    "ok".to_string()
                }
                Err(e) => format!("error: {e}"),
            },
        },
    }
}

/// Reads a request to its end (the client's write shutdown) within `TIMEOUT` in all: the
/// connections are served one at a time, and a client that dribbles a byte now and then must not
/// hold the socket (every refusal and info request waits behind it) for longer than that.
fn read_request(conn: &mut UnixStream) -> Result<Vec<u8>, String> {
    let deadline = Instant::now() + TIMEOUT;
    let mut body = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(format!("no whole request within {TIMEOUT:?}"));
        }
        conn.set_read_timeout(Some(left))
            .map_err(|e| e.to_string())?;
        match conn.read(&mut buf) {
            Ok(0) => return Ok(body),
            Ok(n) if body.len() + n > MAX_REQUEST => {
                return Err(format!("more than {MAX_REQUEST} bytes"))
            }
            Ok(n) => body.extend_from_slice(&buf[..n]),
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e.to_string()),
        }
    }
}

/// `registry` in Prometheus' text format, to follow vLLM's own metrics on one page: without the
/// OpenMetrics `# EOF` line, which would end the page for a parser that reads it as OpenMetrics.
pub fn metrics_text(registry: &Registry) -> Result<String, std::fmt::Error> {
    let mut text = String::new();
    prometheus_client::encoding::text::encode(&mut text, registry)?;
    if let Some(kept) = text.strip_suffix("# EOF\n").map(str::len) {
        text.truncate(kept);
    }
    Ok(text)
}

fn serve(mut conn: UnixStream, connector: &Connector, registry: &Registry) {
    let _ = conn.set_write_timeout(Some(TIMEOUT));
    let answer = match read_request(&mut conn) {
        Err(e) => format!("error: {e}"),
        Ok(body) => answer(&body, connector, registry),
    };
    if answer.starts_with("error: ") {
        tracing::warn!(%answer, "engine socket request refused");
    }
    let _ = conn.write_all(answer.as_bytes());
}

/// Asks engine `engine_id`'s connector (the middleware's side): `verb`, then `body`.
pub fn ask(engine_id: &str, verb: Verb, body: &[u8]) -> std::io::Result<String> {
    let mut conn = UnixStream::connect(socket_path(engine_id))?;
    conn.set_read_timeout(Some(TIMEOUT))?;
    conn.set_write_timeout(Some(TIMEOUT))?;
    conn.write_all(verb.as_str().as_bytes())?;
    if verb == Verb::Refuse {
        conn.write_all(b"\n")?;
        conn.write_all(body)?;
    }
    conn.shutdown(std::net::Shutdown::Write)?;
    let mut answer = String::new();
    conn.take(MAX_ANSWER).read_to_string(&mut answer)?;
    Ok(answer)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A client that sends a byte every 100 ms never ends its request: it is cut once `TIMEOUT`
    /// has passed in all, not left to hold the socket for as long as it keeps dribbling.
    #[test]
    fn a_dribbling_client_is_cut_at_the_timeout() {
        let (mut server, client) = UnixStream::pair().unwrap();
        let dribbler = std::thread::spawn(move || {
            let mut client = client;
            for _ in 0..40 {
                if client.write_all(b"i").is_err() {
                    return;
                }
                std::thread::sleep(Duration::from_millis(100));
            }
        });
        let start = Instant::now();
        let r = read_request(&mut server);
        let took = start.elapsed();
        assert!(r.is_err(), "{r:?}");
        assert!(took < TIMEOUT + Duration::from_millis(500), "{took:?}");
        drop(server);
        dribbler.join().unwrap();
        // An honest request is read whole.
        let (mut server, mut client) = UnixStream::pair().unwrap();
        client.write_all(b"info").unwrap();
        client.shutdown(std::net::Shutdown::Write).unwrap();
        assert_eq!(read_request(&mut server).unwrap(), b"info");
    }

    #[test]
    fn a_request_names_its_verb_on_its_first_line() {
        assert_eq!(parse(b"info"), Ok((Verb::Info, &b""[..])));
        assert_eq!(parse(b"refuse\n{}"), Ok((Verb::Refuse, &b"{}"[..])));
        assert!(parse(b"info\n{}").is_err());
        assert_eq!(parse(b"metrics"), Ok((Verb::Metrics, &b""[..])));
        assert!(parse(b"metrics\n{}").is_err());
        // The old protocol (params alone) and anything else are refused by name.
        let e = parse(br#"{"handoff_id": "x"}"#).unwrap_err();
        assert!(e.contains("unknown request"), "{e}");
        assert!(parse(b"").is_err());
    }

    /// The metrics' text is Prometheus' text format that can follow vLLM's own page: the
    /// registry's families, no `# EOF`.
    #[test]
    fn metrics_text_follows_another_page() {
        use prometheus_client::metrics::counter::Counter;
        let mut registry = Registry::default();
        let c = Counter::<u64>::default();
        c.inc_by(3);
        registry
            .sub_registry_with_prefix("handoff")
            .register("reclaims", "Blocks given back", c);
        let text = metrics_text(&registry).unwrap();
        assert!(text.contains("# TYPE handoff_reclaims counter"), "{text}");
        assert!(text.contains("handoff_reclaims_total 3"), "{text}");
        assert!(!text.contains("# EOF"), "{text}");
        assert!(text.ends_with('\n'), "{text}");
    }
}
