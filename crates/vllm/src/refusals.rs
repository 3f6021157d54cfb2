//! D: requests vLLM refuses before any connector hook runs. vLLM's API server checks a prompt
//! against `max_model_len` (and the sampling parameters) itself and answers 400 without telling
//! EngineCore, so the connector never hears of the request and P would keep its blocks until
//! the lease ends. The API server's middleware (`handoff_vllm.RefusalRelease`) names such a
//! request's `kv_transfer_params` here, on a Unix socket only this user can open, and the
//! connector tells P to release through the ledger (`Connector::reject`: never while this
//! engine reads that handoff for another request).
//!
//! One request per connection: the params as JSON (at most [`MAX_REQUEST`] bytes), answered with
//! `ok` or `error: ...`. Bounded: one connection at a time, a read timeout, a size cap.

use std::io::{Read, Write};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use handoff_connector::Connector;
use handoff_proto::KvTransferParams;

/// Largest request accepted (the params of one request).
pub const MAX_REQUEST: usize = 64 * 1024;
const READ_TIMEOUT: Duration = Duration::from_secs(1);

/// Where engine `engine_id`'s refusal socket lives: the same path in the API server and in
/// EngineCore, derived from what both read from vLLM's config.
pub fn socket_path(engine_id: &str) -> PathBuf {
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
    std::env::temp_dir().join(format!("handoff-vllm-{safe}.sock"))
}

/// The listener; stops (and removes its socket) when dropped.
pub struct RefusalListener {
    path: PathBuf,
    stop: Arc<AtomicBool>,
}

impl RefusalListener {
    pub fn start(path: &Path, connector: Arc<Connector>) -> std::io::Result<Self> {
        // A socket left by an engine that died is stale: nobody else uses this engine's name.
        let _ = std::fs::remove_file(path);
        let listener = UnixListener::bind(path)?;
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))?;
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        std::thread::Builder::new()
            .name("handoff-refusals".into())
            .spawn(move || {
                for conn in listener.incoming() {
                    if flag.load(Ordering::Relaxed) {
                        break;
                    }
                    if let Ok(conn) = conn {
                        serve(conn, &connector);
                    }
                }
            })?;
        Ok(RefusalListener {
            path: path.to_path_buf(),
            stop,
        })
    }
}

impl Drop for RefusalListener {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        // Wakes the accept loop so that it sees the flag.
        let _ = UnixStream::connect(&self.path);
        let _ = std::fs::remove_file(&self.path);
    }
}

fn serve(mut conn: UnixStream, connector: &Connector) {
    let _ = conn.set_read_timeout(Some(READ_TIMEOUT));
    let _ = conn.set_write_timeout(Some(READ_TIMEOUT));
    let mut body = Vec::new();
    let answer = match (&mut conn)
        .take(MAX_REQUEST as u64 + 1)
        .read_to_end(&mut body)
    {
        Err(e) => format!("error: {e}"),
        Ok(_) if body.len() > MAX_REQUEST => format!("error: more than {MAX_REQUEST} bytes"),
        Ok(_) => match serde_json::from_slice::<KvTransferParams>(&body) {
            Err(e) => format!("error: kv_transfer_params: {e}"),
            Ok(params) => match connector.reject(&params) {
                Ok(()) => {
                    tracing::info!(handoff = ?params.handoff_id, "vLLM refused the request before admission: P told to release");
                    "ok".to_string()
                }
                Err(e) => format!("error: {e}"),
            },
        },
    };
    if answer != "ok" {
        tracing::warn!(%answer, "refusal not passed on");
    }
    let _ = conn.write_all(answer.as_bytes());
}

/// Names a refused request's params to engine `engine_id`'s connector (the middleware's side).
pub fn tell(engine_id: &str, params_json: &[u8]) -> std::io::Result<String> {
    let mut conn = UnixStream::connect(socket_path(engine_id))?;
    conn.set_read_timeout(Some(READ_TIMEOUT))?;
    conn.set_write_timeout(Some(READ_TIMEOUT))?;
    conn.write_all(params_json)?;
    conn.shutdown(std::net::Shutdown::Write)?;
    let mut answer = String::new();
    conn.take(1024).read_to_string(&mut answer)?;
    Ok(answer)
}
