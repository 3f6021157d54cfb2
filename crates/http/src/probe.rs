//! Clients that misbehave on purpose, for the tests of listeners served by [`crate::serve`] (the
//! engine's and the proxy's tests use them). Loopback only; every call is bounded in time.

use std::io;
use std::net::SocketAddr;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::time::Instant;

/// What a slowloris client saw.
#[derive(Debug)]
pub struct Slowloris {
    /// From connecting until the server closed the connection (or `max`).
    pub held: Duration,
    /// Whether the server closed the connection (false: `max` passed first).
    pub closed: bool,
    /// What the server sent back.
    pub answer: Vec<u8>,
    /// Header bytes sent after the first chunk.
    pub bytes_sent: usize,
}

impl Slowloris {
    pub fn status(&self) -> Option<u16> {
        status_of(&self.answer)
    }
}

/// The status code of a raw HTTP/1 answer.
pub fn status_of(answer: &[u8]) -> Option<u16> {
    let line = answer.split(|b| *b == b'\n').next()?;
    let line = std::str::from_utf8(line).ok()?;
    let mut parts = line.split_whitespace();
    parts.next().filter(|v| v.starts_with("HTTP/1"))?;
    parts.next()?.parse().ok()
}

/// Connects, sends the start of `GET {path}` and then one more header byte every `every`, never
/// ending the head, until the server closes the connection or `max` passes.
pub async fn slowloris(
    addr: SocketAddr,
    path: &str,
    every: Duration,
    max: Duration,
) -> io::Result<Slowloris> {
    let start = Instant::now();
    let mut s = TcpStream::connect(addr).await?;
    s.write_all(format!("GET {path} HTTP/1.1\r\nhost: probe\r\nx-slow: ").as_bytes())
        .await?;
    let mut answer = Vec::new();
    let mut buf = [0u8; 4096];
    let mut bytes_sent = 0;
    let mut tick = tokio::time::interval_at(start + every, every);
    let deadline = start + max;
    let closed = loop {
        tokio::select! {
            r = s.read(&mut buf) => match r {
                Ok(0) | Err(_) => break true,
                Ok(n) => answer.extend_from_slice(&buf[..n]),
            },
            _ = tick.tick() => {
                if s.write_all(b"a").await.is_ok() {
                    bytes_sent += 1;
                }
            }
            _ = tokio::time::sleep_until(deadline) => break false,
        }
    };
    Ok(Slowloris {
        held: start.elapsed(),
        closed,
        answer,
        bytes_sent,
    })
}

/// Sends `request` as is and reads the answer until the server closes the connection or
/// `within` passes.
pub async fn raw_request(
    addr: SocketAddr,
    request: &[u8],
    within: Duration,
) -> io::Result<Vec<u8>> {
    let mut s = TcpStream::connect(addr).await?;
    s.write_all(request).await?;
    Ok(read_until_closed(&mut s, within).await)
}

/// Reads until the peer closes the connection (or resets it) or `within` passes.
pub async fn read_until_closed(s: &mut TcpStream, within: Duration) -> Vec<u8> {
    let mut out = Vec::new();
    let mut buf = [0u8; 4096];
    let deadline = Instant::now() + within;
    loop {
        match tokio::time::timeout_at(deadline, s.read(&mut buf)).await {
            Ok(Ok(n)) if n > 0 => out.extend_from_slice(&buf[..n]),
            _ => return out,
        }
    }
}

/// Opens `n` connections that send nothing.
pub async fn hold_connections(addr: SocketAddr, n: usize) -> io::Result<Vec<TcpStream>> {
    let mut v = Vec::with_capacity(n);
    for _ in 0..n {
        v.push(TcpStream::connect(addr).await?);
    }
    Ok(v)
}
