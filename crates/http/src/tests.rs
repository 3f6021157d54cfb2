use std::net::SocketAddr;
use std::time::Duration;

use axum::routing::{get, post};
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;

use super::*;
use crate::probe::{raw_request, read_until_closed, status_of};

fn limits() -> Limits {
    Limits {
        header_read_timeout: Duration::from_millis(400),
        body_read_timeout: Duration::from_millis(400),
        idle_timeout: Duration::from_millis(400),
        write_stall_timeout: Duration::from_millis(400),
        max_connections: 4,
        max_body_bytes: 1000,
        max_header_bytes: 8 << 10,
    }
}

struct Server {
    addr: SocketAddr,
    metrics: ListenerMetrics,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<io::Result<()>>,
}

async fn server(limits: Limits) -> Server {
    let router = Router::new()
        .route("/ok", get(|| async { "ok" }))
        .route("/echo", post(|b: Bytes| async move { b }))
        .route(
            "/slow",
            get(|| async {
                tokio::time::sleep(Duration::from_millis(900)).await;
                "slow"
            }),
        );
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let metrics = ListenerMetrics::unregistered("test");
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(serve(listener, router, limits, metrics.clone(), async {
        let _ = rx.await;
    }));
    Server {
        addr,
        metrics,
        stop: Some(tx),
        task,
    }
}

async fn bounded<F: Future>(f: F) -> F::Output {
    tokio::time::timeout(Duration::from_secs(20), f)
        .await
        .expect("test took longer than 20 s")
}

const GET_OK: &[u8] = b"GET /ok HTTP/1.1\r\nhost: t\r\nconnection: close\r\n\r\n";

#[tokio::test]
async fn idle_connections_are_closed_and_counted_requests_in_progress_are_not() {
    bounded(async {
        let s = server(limits()).await;
        let t = Instant::now();
        let mut idle = TcpStream::connect(s.addr).await.unwrap();
        let got = read_until_closed(&mut idle, Duration::from_secs(5)).await;
        assert!(
            got.is_empty(),
            "an idle connection is closed without an answer"
        );
        let held = t.elapsed();
        assert!(held >= Duration::from_millis(400), "{held:?}");
        assert!(held < Duration::from_secs(3), "{held:?}");
        assert_eq!(s.metrics.hits(Limit::IdleTimeout), 1);

        // A handler slower than every timeout is not cut: timeouts bound clients, not handlers.
        let got = raw_request(
            s.addr,
            b"GET /slow HTTP/1.1\r\nhost: t\r\nconnection: close\r\n\r\n",
            Duration::from_secs(5),
        )
        .await
        .unwrap();
        assert_eq!(status_of(&got), Some(200));
        assert_eq!(s.metrics.hits(Limit::HeaderTimeout), 0);
        assert_eq!(s.metrics.hits(Limit::IdleTimeout), 1);
    })
    .await
}

#[tokio::test]
async fn keep_alive_serves_several_requests_then_idles_out() {
    bounded(async {
        let s = server(limits()).await;
        let mut c = TcpStream::connect(s.addr).await.unwrap();
        for _ in 0..3 {
            c.write_all(b"GET /ok HTTP/1.1\r\nhost: t\r\n\r\n")
                .await
                .unwrap();
            let mut buf = [0u8; 1024];
            let n = tokio::io::AsyncReadExt::read(&mut c, &mut buf)
                .await
                .unwrap();
            assert_eq!(status_of(&buf[..n]), Some(200));
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        let rest = read_until_closed(&mut c, Duration::from_secs(5)).await;
        assert!(rest.is_empty());
        assert_eq!(s.metrics.hits(Limit::IdleTimeout), 1);
    })
    .await
}

#[tokio::test]
async fn bodies_over_the_limit_get_413_slow_bodies_408() {
    bounded(async {
        let s = server(limits()).await;
        // Said by Content-Length: refused before reading.
        let got = raw_request(
            s.addr,
            b"POST /echo HTTP/1.1\r\nhost: t\r\ncontent-length: 5000\r\n\r\n",
            Duration::from_secs(5),
        )
        .await
        .unwrap();
        assert_eq!(status_of(&got), Some(413), "{}", String::from_utf8_lossy(&got));
        // Chunked, growing past the limit.
        let mut req = b"POST /echo HTTP/1.1\r\nhost: t\r\ntransfer-encoding: chunked\r\n\r\n".to_vec();
        for _ in 0..3 {
            req.extend_from_slice(b"258\r\n");
            req.extend_from_slice(&[b'x'; 600]);
            req.extend_from_slice(b"\r\n");
        }
        let got = raw_request(s.addr, &req, Duration::from_secs(5))
            .await
            .unwrap();
        assert_eq!(status_of(&got), Some(413));
        assert_eq!(s.metrics.hits(Limit::BodyTooLarge), 2);
        // Within the limit.
        let got = raw_request(
            s.addr,
            b"POST /echo HTTP/1.1\r\nhost: t\r\ncontent-length: 5\r\nconnection: close\r\n\r\nhello",
            Duration::from_secs(5),
        )
        .await
        .unwrap();
        assert_eq!(status_of(&got), Some(200));
        assert!(got.ends_with(b"hello"));
        // A body that never ends.
        let mut c = TcpStream::connect(s.addr).await.unwrap();
        c.write_all(b"POST /echo HTTP/1.1\r\nhost: t\r\ncontent-length: 10\r\n\r\nab")
            .await
            .unwrap();
        let got = read_until_closed(&mut c, Duration::from_secs(5)).await;
        assert_eq!(status_of(&got), Some(408));
        assert_eq!(s.metrics.hits(Limit::BodyTimeout), 1);
    })
    .await
}

#[tokio::test]
async fn oversized_heads_get_431() {
    bounded(async {
        let s = server(limits()).await;
        let mut req = b"GET /ok HTTP/1.1\r\nhost: t\r\nx-big: ".to_vec();
        req.extend_from_slice(&[b'a'; 20 << 10]);
        req.extend_from_slice(b"\r\n\r\n");
        let got = raw_request(s.addr, &req, Duration::from_secs(5))
            .await
            .unwrap();
        assert_eq!(status_of(&got), Some(431));
        assert_eq!(s.metrics.hits(Limit::HeaderTooLarge), 1);
        let got = raw_request(s.addr, GET_OK, Duration::from_secs(5))
            .await
            .unwrap();
        assert_eq!(status_of(&got), Some(200));
    })
    .await
}

#[tokio::test]
async fn shutdown_finishes_requests_in_progress_and_closes_idle_connections() {
    bounded(async {
        let mut s = server(Limits {
            idle_timeout: Duration::from_secs(30),
            ..limits()
        })
        .await;
        let _idle = TcpStream::connect(s.addr).await.unwrap();
        let addr = s.addr;
        let slow = tokio::spawn(async move {
            raw_request(
                addr,
                b"GET /slow HTTP/1.1\r\nhost: t\r\n\r\n",
                Duration::from_secs(5),
            )
            .await
            .unwrap()
        });
        tokio::time::sleep(Duration::from_millis(200)).await;
        let t = Instant::now();
        s.stop.take().unwrap().send(()).unwrap();
        (&mut s.task).await.unwrap().unwrap();
        assert!(t.elapsed() < Duration::from_secs(3));
        assert_eq!(status_of(&slow.await.unwrap()), Some(200));
        assert!(
            TcpStream::connect(s.addr).await.is_err(),
            "no longer listening"
        );
    })
    .await
}

#[test]
fn limits_are_validated() {
    Limits::default().validate().unwrap();
    let e = Limits {
        max_connections: 0,
        ..Limits::default()
    }
    .validate()
    .unwrap_err();
    assert_eq!(e.field, "max_connections", "{e}");
    let e = Limits {
        body_read_timeout: Duration::ZERO,
        ..Limits::default()
    }
    .validate()
    .unwrap_err();
    assert_eq!(e.to_string(), "body_read_timeout must be greater than zero");
}

/// An answer that never ends, 64 KiB at a time; `dropped` is set when the server lets it go.
struct Endless(Arc<std::sync::atomic::AtomicBool>);

impl http_body::Body for Endless {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        self: Pin<&mut Self>,
        _cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Bytes>, Infallible>>> {
        Poll::Ready(Some(Ok(http_body::Frame::data(Bytes::from(vec![
            b'x';
            64 << 10
        ])))))
    }
}

impl Drop for Endless {
    fn drop(&mut self) {
        self.0.store(true, Ordering::SeqCst);
    }
}

/// A client that stops reading a streamed answer loses the connection once nothing of the
/// answer went out for `write_stall_timeout`, and the answer is dropped (the handler learns its
/// client is gone); one that reads, however long the answer, keeps it.
#[tokio::test]
async fn a_client_that_stops_reading_its_answer_is_cut() {
    bounded(async {
        let dropped = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let d = dropped.clone();
        let router = Router::new().route(
            "/endless",
            get(move || {
                let d = d.clone();
                async move { Body::new(Endless(d)) }
            }),
        );
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let metrics = ListenerMetrics::unregistered("test");
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let task = tokio::spawn(serve(listener, router, limits(), metrics.clone(), async {
            let _ = rx.await;
        }));
        let mut c = TcpStream::connect(addr).await.unwrap();
        c.write_all(b"GET /endless HTTP/1.1\r\nhost: t\r\n\r\n")
            .await
            .unwrap();
        // Read for a while, slower than the server writes but never stalling it for long.
        let mut buf = vec![0u8; 64 << 10];
        let t = Instant::now();
        while t.elapsed() < Duration::from_millis(900) {
            let n = tokio::io::AsyncReadExt::read(&mut c, &mut buf)
                .await
                .unwrap();
            assert!(n > 0);
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        assert_eq!(
            metrics.hits(Limit::WriteStall),
            0,
            "a reading client was cut"
        );
        assert!(!dropped.load(Ordering::SeqCst));
        // Stop reading: the socket's buffers fill, then nothing moves.
        let t = Instant::now();
        while !dropped.load(Ordering::SeqCst) {
            assert!(
                t.elapsed() < Duration::from_secs(10),
                "a stalled answer was never cut"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert_eq!(metrics.hits(Limit::WriteStall), 1);
        let _ = tx.send(());
        let _ = task.await;
    })
    .await
}
