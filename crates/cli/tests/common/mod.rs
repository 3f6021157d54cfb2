//! What the cli's integration tests share: the `handoff` binary's engine as a child process.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};

/// A `handoff engine` child process, killed when dropped.
pub struct Engine {
    pub child: Child,
    pub url: String,
}

impl Drop for Engine {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Starts `handoff engine` (tcp transport, a fast cost model) and waits for its URL.
pub fn engine(id: &str, role: &str, extra: &[&str]) -> Engine {
    let mut child = Command::new(env!("CARGO_BIN_EXE_handoff"))
        .args([
            "engine",
            "--role",
            role,
            "--port",
            "0",
            "--engine-id",
            id,
            "--transport",
            "tcp",
        ])
        .args([
            "--set",
            "prefill_us_per_token=2",
            "--set",
            "decode_step_ms=1",
        ])
        .args(extra)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn engine");
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .expect("engine banner");
    let url = line.trim().rsplit(' ').next().unwrap().to_string();
    assert!(url.starts_with("http://"), "engine said {line:?}");
    Engine { child, url }
}
