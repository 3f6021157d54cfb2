//! A local cluster's processes, as the demo and the benchmarks start them: `handoff engine`
//! children (on loopback or inside a network namespace), and reading their metrics.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::Context;
use serde_json::Value;

use crate::netns::Net;

/// A child engine, killed when dropped.
pub struct Engine {
    pub child: Child,
    pub url: String,
    pub id: String,
    /// Kept open: the engine prints again when it is drained (`drained {report}`), and a closed
    /// pipe would fail that write.
    stdout: BufReader<std::process::ChildStdout>,
}

impl Drop for Engine {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

pub fn spawn_engine(id: &str, role: &str, extra: &[String]) -> anyhow::Result<Engine> {
    spawn_engine_on(None, id, role, extra)
}

/// The cluster key of this run's engines, made on first use.
fn cluster_key() -> anyhow::Result<&'static str> {
    static KEY: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    if let Some(k) = KEY.get() {
        return Ok(k);
    }
    let k = handoff_connector::ClusterKey::generate()?.to_hex();
    Ok(KEY.get_or_init(|| k))
}

/// Starts an engine on loopback, or on node `id` of `net` at that node's address.
pub fn spawn_engine_on(
    net: Option<&Net>,
    id: &str,
    role: &str,
    extra: &[String],
) -> anyhow::Result<Engine> {
    let exe = std::env::current_exe().context("cannot find the handoff binary")?;
    let mut cmd = match net {
        Some(net) => {
            let mut c = net.exec(id);
            c.arg(exe).args(["engine", "--host", &net.addr(id)]);
            c
        }
        None => {
            let mut c = Command::new(exe);
            c.arg("engine");
            c
        }
    };
    let mut child = cmd
        .args(["--role", role, "--port", "0", "--engine-id", id])
        .args(extra)
        // The demo's engines prove one key made for this run (in the environment, not argv).
        .env("HANDOFF_CLUSTER_KEY", cluster_key()?)
        .env(
            "RUST_LOG",
            std::env::var("RUST_LOG").unwrap_or_else(|_| "warn".into()),
        )
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .context("cannot start an engine")?;
    let mut stdout = BufReader::new(child.stdout.take().context("no stdout")?);
    let mut line = String::new();
    stdout
        .read_line(&mut line)
        .context("engine did not start")?;
    let url = line
        .trim()
        .rsplit(' ')
        .next()
        .filter(|u| u.starts_with("http://"))
        .with_context(|| format!("engine {id} said {line:?}"))?
        .to_string();
    Ok(Engine {
        child,
        url,
        id: id.to_string(),
        stdout,
    })
}

impl Engine {
    /// Sends SIGTERM and waits (on a blocking thread) for the engine to drain and exit: its
    /// drain report, and the seconds from the signal to the exit.
    pub async fn drain(mut self) -> anyhow::Result<(Value, f64)> {
        let pid = rustix::process::Pid::from_raw(self.child.id() as i32)
            .context("engine without a process id")?;
        let t0 = Instant::now();
        rustix::process::kill_process(pid, rustix::process::Signal::TERM)
            .context("cannot send SIGTERM")?;
        tokio::task::spawn_blocking(move || {
            let mut line = String::new();
            // The engine prints `drained {json}` once drained, then exits.
            let mut report = Value::Null;
            while self.stdout.read_line(&mut line).unwrap_or(0) > 0 {
                if let Some(json) = line.trim().strip_prefix("drained ") {
                    report = serde_json::from_str(json).unwrap_or(Value::Null);
                }
                line.clear();
            }
            let status = self.child.wait().context("engine lost")?;
            anyhow::ensure!(status.success(), "drained engine exited with {status}");
            Ok((report, t0.elapsed().as_secs_f64()))
        })
        .await?
    }
}

/// Sum of a metric's samples (all label sets) in Prometheus text.
pub fn metric(text: &str, name: &str) -> f64 {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter(|l| l.split(['{', ' ']).next() == Some(name))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// Sum of a metric's samples per value of label `label`.
pub fn metric_by_label(text: &str, name: &str, label: &str) -> BTreeMap<String, f64> {
    let mut out = BTreeMap::new();
    for l in text.lines().filter(|l| !l.starts_with('#')) {
        if l.split(['{', ' ']).next() != Some(name) {
            continue;
        }
        let Some(value) = label_value(l, label) else {
            continue;
        };
        if let Some(v) = l.rsplit(' ').next().and_then(|v| v.parse::<f64>().ok()) {
            *out.entry(value.to_string()).or_default() += v;
        }
    }
    out
}

/// The value of label `key` in an OpenMetrics sample line (or its label set).
pub fn label_value<'a>(line: &'a str, key: &str) -> Option<&'a str> {
    let k = format!("{key}=\"");
    let start = line.find(&k)? + k.len();
    let rest = &line[start..];
    Some(&rest[..rest.find('"')?])
}

pub async fn get_text(client: &reqwest::Client, url: &str) -> String {
    match client.get(url).timeout(Duration::from_secs(3)).send().await {
        Ok(r) => r.text().await.unwrap_or_default(),
        Err(_) => String::new(),
    }
}
