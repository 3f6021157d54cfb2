//! Relays a streamed D answer to the client chunk by chunk.

use std::io;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Bytes;
use futures_util::stream::{BoxStream, Stream, StreamExt};
use serde_json::json;

use crate::error::chain;
use crate::metrics::StreamEnd;
use crate::pool::InFlight;
use crate::Shared;

struct Relay {
    body: BoxStream<'static, reqwest::Result<Bytes>>,
    shared: Arc<Shared>,
    // Counts the request in flight to D until the stream ends or is dropped.
    guard: InFlight,
    request_id: String,
    sse: bool,
    idle: Duration,
    /// `None` while running; how it ended otherwise.
    end: Option<StreamEnd>,
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
/// and with it the connection to D.
pub(crate) fn relay(
    resp: reqwest::Response,
    shared: Arc<Shared>,
    guard: InFlight,
    request_id: String,
    sse: bool,
) -> impl Stream<Item = Result<Bytes, io::Error>> + Send + 'static {
    let idle = shared.cfg.stream_idle_timeout;
    let state = Relay {
        body: resp.bytes_stream().boxed(),
        shared,
        guard,
        request_id,
        sse,
        idle,
        end: None,
    };
    futures_util::stream::unfold(state, |mut st| async move {
        if st.end.is_some() {
            return None;
        }
        let item = match tokio::time::timeout(st.idle, st.body.next()).await {
            Ok(Some(Ok(chunk))) => Some(Ok(chunk)),
            Ok(None) => {
                st.end = Some(StreamEnd::Complete);
                None
            }
            Ok(Some(Err(e))) => st.fail(StreamEnd::UpstreamError, chain(&e)),
            Err(_) => {
                let idle = st.idle;
                st.fail(StreamEnd::IdleTimeout, format!("no data for {idle:?}"))
            }
        };
        item.map(|i| (i, st))
    })
}
