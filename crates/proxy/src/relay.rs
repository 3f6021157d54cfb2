//! Relays a streamed D answer to the client chunk by chunk (in push mode, while watching P's leg).

use std::io;
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use axum::body::Bytes;
use futures_util::stream::{BoxStream, Stream, StreamExt};
use serde_json::json;

use crate::error::chain;
use crate::metrics::StreamEnd;
use crate::pool::InFlight;
use crate::prefill_leg::{PrefillFailure, PrefillLeg};
use crate::Shared;

/// When a request reached the proxy and when it was sent to D: the first chunk relayed closes
/// the proxy's `decode_first_chunk` and `first_chunk` phases.
#[derive(Clone, Copy)]
pub(crate) struct Marks {
    pub(crate) received: Instant,
    pub(crate) decode_sent: Instant,
}

struct Relay {
    body: BoxStream<'static, reqwest::Result<Bytes>>,
    shared: Arc<Shared>,
    // Counts the request in flight to D until the stream ends or is dropped.
    guard: InFlight,
    request_id: String,
    sse: bool,
    idle: Duration,
    /// Push: P's leg while its answer is still to come. If it fails, D's stream is cut: D would
    /// wait for KV that never comes (or decode from KV whose writer failed).
    prefill: Option<PrefillLeg>,
    /// `None` while running; how it ended otherwise.
    end: Option<StreamEnd>,
    /// Until the first chunk went out.
    marks: Option<Marks>,
}

enum Next {
    Prefill(Result<serde_json::Value, PrefillFailure>),
    Decode(Result<Option<reqwest::Result<Bytes>>, tokio::time::error::Elapsed>),
}

impl Relay {
    fn fail(&mut self, end: StreamEnd, reason: String) -> Option<Result<Bytes, io::Error>> {
        let url = &self.guard.instance().url;
        tracing::warn!(request_id = %self.request_id, decode = %url, %reason, "decode stream broke");
        self.end = Some(end);
        let message = format!("decode instance {url} stream broke: {reason}");
        if self.sse {
            // Tell an SSE client in-band why its stream stops, as vLLM and OpenAI do (OpenAI
            // clients raise on an `error` event), and send no `[DONE]`. Aborting the connection
            // after it would be louder but loses the event: hyper drops its unflushed buffer.
            let event = json!({"error": {
                "message": message,
                "type": "upstream_stream_error",
                "role": "decode",
                "instance": url,
                "request_id": self.request_id,
            }});
            Some(Ok(Bytes::from(format!("data: {event}\n\n"))))
        } else {
            // Not SSE: abort the connection, so the client sees a truncated body, not a short one.
            Some(Err(io::Error::other(message)))
        }
    }

    /// P's leg failed mid-stream: cut D (by ending this stream, which drops D's response) and
    /// tell the client, naming P; P is told to release unless it never got the request.
    fn fail_prefill(
        &mut self,
        leg: PrefillLeg,
        f: PrefillFailure,
    ) -> Option<Result<Bytes, io::Error>> {
        let decode = &self.guard.instance().url;
        tracing::warn!(
            request_id = %self.request_id, prefill = %leg.url(), %decode,
            "prefill leg failed; cutting the decode stream: {}", f.error.message
        );
        self.end = Some(StreamEnd::PrefillFailed);
        if let Some(release) = leg.after_failure(&f) {
            tokio::spawn(release);
        }
        let message = format!(
            "{}; the decode stream from {decode} was cut",
            f.error.message
        );
        if self.sse {
            let event = json!({"error": {
                "message": message,
                "type": f.error.kind.as_str(),
                "role": "prefill",
                "instance": leg.url(),
                "request_id": self.request_id,
            }});
            Some(Ok(Bytes::from(format!("data: {event}\n\n"))))
        } else {
            Some(Err(io::Error::other(message)))
        }
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        // Dropping `body` here closes the connection to D: D sees the disconnect and aborts.
        let end = self.end.unwrap_or(StreamEnd::ClientDisconnect);
        if end == StreamEnd::ClientDisconnect {
            tracing::info!(
                request_id = %self.request_id,
                decode = %self.guard.instance().url,
                "client went away mid-stream; closing the decode stream"
            );
        }
        self.shared.metrics.stream_end(end);
    }
}

/// The client-facing body for D's streamed answer. Nothing is buffered: each chunk is passed on
/// as D sends it, and when the client goes away hyper drops this stream, which drops D's response
/// and with it the connection to D (and P's leg, if still running).
pub(crate) fn relay(
    resp: reqwest::Response,
    shared: Arc<Shared>,
    guard: InFlight,
    request_id: &str,
    sse: bool,
    prefill: Option<PrefillLeg>,
    marks: Marks,
) -> impl Stream<Item = Result<Bytes, io::Error>> + Send + 'static {
    let idle = shared.cfg.stream_idle_timeout;
    let state = Relay {
        body: resp.bytes_stream().boxed(),
        shared,
        guard,
        request_id: request_id.to_string(),
        sse,
        idle,
        prefill,
        end: None,
        marks: Some(marks),
    };
    futures_util::stream::unfold(state, |mut st| async move {
        if st.end.is_some() {
            return None;
        }
        let deadline = tokio::time::Instant::now() + st.idle;
        let item = loop {
            let next = match st.prefill.as_mut() {
                // P first: once it failed, no chunk of D's is worth passing on.
                Some(leg) => tokio::select! {
                    biased;
                    r = leg => Next::Prefill(r),
                    c = tokio::time::timeout_at(deadline, st.body.next()) => Next::Decode(c),
                },
                None => Next::Decode(tokio::time::timeout_at(deadline, st.body.next()).await),
            };
            match next {
                Next::Prefill(Ok(_)) => st.prefill = None,
                Next::Prefill(Err(f)) => {
                    let leg = st.prefill.take().expect("watched leg");
                    break st.fail_prefill(leg, f);
                }
                Next::Decode(Ok(Some(Ok(chunk)))) => {
                    if let Some(m) = st.marks.take() {
                        let metrics = &st.shared.metrics;
                        metrics.phase("decode_first_chunk", m.decode_sent.elapsed());
                        metrics.phase("first_chunk", m.received.elapsed());
                    }
                    break Some(Ok(chunk));
                }
                Next::Decode(Ok(None)) => {
                    st.end = Some(StreamEnd::Complete);
                    if let Some(leg) = st.prefill.take() {
                        leg.detach();
                    }
                    break None;
                }
                Next::Decode(Ok(Some(Err(e)))) => {
                    break st.fail(StreamEnd::UpstreamError, chain(&e))
                }
                Next::Decode(Err(_)) => {
                    let idle = st.idle;
                    break st.fail(StreamEnd::IdleTimeout, format!("no data for {idle:?}"));
                }
            }
        };
        item.map(|i| (i, st))
    })
}
