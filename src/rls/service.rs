//! `envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit` over cleartext HTTP/2 (gRPC),
//! on the `h2` crate Pingora already builds: one task per stream, so the calls Envoy
//! multiplexes on one connection wait on the backend side by side.
//!
//! Bounded as a listener anyone may reach (DESIGN §17): `[server] max_connections_per_ip`
//! as on the proxy listener, at most `MAX_STREAMS` calls at once per connection (h2 refuses
//! the next with REFUSED_STREAM), and a message of at most `MAX_MESSAGE` bytes, refused with
//! RESOURCE_EXHAUSTED as soon as its gRPC prefix or its bytes say it is larger.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use async_trait::async_trait;
use bytes::{Bytes, BytesMut};
use h2::server::SendResponse;
use h2::RecvStream;
use http::{HeaderMap, HeaderValue};
use pingora::apps::ServerApp;
use pingora::protocols::Stream;
use pingora::server::ShutdownWatch;

use super::decide;
use super::proto::{Malformed, Request};
use crate::gateway::App;
use crate::limiter::connections::PerIp;
use crate::response::{grpc_status, GrpcStatus};

const PATH: &str = "/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit";
/// A request is a domain and a few descriptors; anything larger than this is not one.
const MAX_MESSAGE: usize = 64 * 1024;
/// Calls in flight on one connection (Envoy multiplexes a few dozen at most).
const MAX_STREAMS: u32 = 100;

pub struct Service {
    pub app: Arc<App>,
    /// This listener's open connections per address (`max_connections_per_ip`).
    pub per_ip: Arc<PerIp>,
}

#[async_trait]
impl ServerApp for Service {
    async fn process_new(
        self: &Arc<Self>,
        stream: Stream,
        shutdown: &ShutdownWatch,
    ) -> Option<Stream> {
        let slot = {
            let gateway = self.app.current.load();
            self.per_ip
                .admit(&stream, &gateway.config.server, &self.app.metrics)
        };
        // Over the address's cap: closed at once, as the proxy listener does.
        let Ok(_slot) = slot else {
            return None;
        };
        let mut conn = match h2::server::Builder::new()
            .max_concurrent_streams(MAX_STREAMS)
            .handshake::<_, Bytes>(stream)
            .await
        {
            Ok(conn) => conn,
            Err(e) => {
                log::debug!("rls: HTTP/2 handshake failed: {e}");
                return None;
            }
        };
        let mut shutdown = shutdown.clone();
        let mut closing = false;
        loop {
            tokio::select! {
                next = conn.accept() => match next {
                    Some(Ok((req, respond))) => {
                        let me = self.clone();
                        tokio::spawn(async move { me.serve(req, respond).await });
                    }
                    Some(Err(e)) => {
                        log::debug!("rls: connection error: {e}");
                        break;
                    }
                    None => break,
                },
                _ = shutdown.changed(), if !closing => {
                    closing = true;
                    conn.graceful_shutdown();
                }
            }
        }
        None
    }
}

/// Counts a call as in flight (SIGTERM drains it) until dropped.
struct InFlight<'a>(&'a App);

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::SeqCst);
    }
}

impl Service {
    async fn serve(&self, req: http::Request<RecvStream>, respond: SendResponse<Bytes>) {
        self.app.in_flight.fetch_add(1, Ordering::SeqCst);
        let _in_flight = InFlight(&self.app);
        let (parts, mut body) = req.into_parts();
        if parts.uri.path() != PATH {
            return refuse(respond, GrpcStatus::Unimplemented, "unknown method");
        }
        // A call's message must arrive within `[server] body_timeout`, as a proxied body must.
        let deadline = self.app.current.load().config.server.body_timeout;
        let read = async {
            let too_large = Some((GrpcStatus::ResourceExhausted, "message larger than 64 KiB"));
            let mut buf = BytesMut::new();
            while let Some(chunk) = body.data().await {
                let chunk = chunk.map_err(|_| None)?;
                let _ = body.flow_control().release_capacity(chunk.len());
                if buf.len() + chunk.len() > MAX_MESSAGE + 5 {
                    return Err(too_large);
                }
                buf.extend_from_slice(&chunk);
                // The prefix gives the length: a message too large is refused on it, and its
                // bytes are neither awaited nor kept.
                if declared(&buf).is_some_and(|len| len > MAX_MESSAGE) {
                    return Err(too_large);
                }
            }
            Ok(buf)
        };
        let buf = match tokio::time::timeout(deadline, read).await {
            Ok(Ok(buf)) => buf,
            Ok(Err(Some((code, why)))) => return refuse(respond, code, why),
            Ok(Err(None)) => return,
            Err(_) => {
                return refuse(
                    respond,
                    GrpcStatus::DeadlineExceeded,
                    "the message did not arrive in time",
                )
            }
        };
        let message = match unframe(&buf) {
            Ok(m) => m,
            Err((code, why)) => return refuse(respond, code, why),
        };
        let request = match Request::decode(message) {
            Ok(r) => r,
            Err(Malformed(why)) => return refuse(respond, GrpcStatus::InvalidArgument, why),
        };
        let gateway = self.app.current.load_full();
        match decide::should_rate_limit(&gateway, &request).await {
            Ok(answer) => reply(respond, &answer.encode()),
            Err(why) => refuse(respond, GrpcStatus::InvalidArgument, &why),
        }
    }
}

/// The message length a call's gRPC prefix declares, once its 5 bytes have arrived.
fn declared(buf: &[u8]) -> Option<usize> {
    let (prefix, _) = buf.split_first_chunk::<5>()?;
    Some(u32::from_be_bytes([prefix[1], prefix[2], prefix[3], prefix[4]]) as usize)
}

/// The one message of a unary call: a 5-byte prefix (compressed flag, length) and its bytes.
fn unframe(buf: &[u8]) -> Result<&[u8], (GrpcStatus, &'static str)> {
    let Some((prefix, message)) = buf.split_first_chunk::<5>() else {
        return Err((
            GrpcStatus::InvalidArgument,
            "malformed gRPC frame: short prefix",
        ));
    };
    if prefix[0] != 0 {
        return Err((
            GrpcStatus::Unimplemented,
            "compressed messages are not supported",
        ));
    }
    let len = u32::from_be_bytes([prefix[1], prefix[2], prefix[3], prefix[4]]) as usize;
    if len != message.len() {
        return Err((
            GrpcStatus::InvalidArgument,
            "malformed gRPC frame: length does not match, or more than one message",
        ));
    }
    Ok(message)
}

fn headers() -> http::Response<()> {
    let mut resp = http::Response::new(());
    resp.headers_mut().insert(
        http::header::CONTENT_TYPE,
        HeaderValue::from_static("application/grpc"),
    );
    resp
}

fn reply(mut respond: SendResponse<Bytes>, message: &[u8]) {
    let Ok(mut stream) = respond.send_response(headers(), false) else {
        return;
    };
    let mut framed = Vec::with_capacity(5 + message.len());
    framed.push(0);
    framed.extend_from_slice(&(message.len() as u32).to_be_bytes());
    framed.extend_from_slice(message);
    if stream.send_data(Bytes::from(framed), false).is_err() {
        return;
    }
    let mut trailers = HeaderMap::new();
    trailers.insert("grpc-status", HeaderValue::from_static("0"));
    let _ = stream.send_trailers(trailers);
}

/// A trailers-only answer: the status in the response headers, no message.
fn refuse(mut respond: SendResponse<Bytes>, status: GrpcStatus, why: &str) {
    let mut resp = headers();
    let h = resp.headers_mut();
    for (name, value) in grpc_status(status, why) {
        if let Ok(v) = HeaderValue::from_str(&value) {
            h.insert(name, v);
        }
    }
    let _ = respond.send_response(resp, true);
}
