//! Client connections: the per-address cap, header and idle deadlines, the connection gauge.
//!
//! Pingora bounds each socket read, not the whole request header, so a client trickling a
//! byte a second holds a connection forever (slowloris). `Edge` wraps every accepted stream
//! in a `ClientConn` whose reads carry the deadline of the phase the connection is in:
//! the request header must be complete within `header_timeout` of its first byte (of the
//! accept, for a new connection), and a keep-alive connection waiting for its next request
//! is closed after `idle_timeout`. The proxy moves the phase on (`request_started`,
//! `request_finished`); body reads are bounded by Pingora's own read timeout.
//!
//! HTTP/2 (ALPN h2, or with `h2c` a cleartext connection whose first bytes are the HTTP/2
//! preface, read here under the header deadline) goes to Pingora's own HTTP/2 handling,
//! bounded by `h2_idle_timeout`; `sluice_connections` counts it under `protocol="h2"`.

use std::fmt;
use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use async_trait::async_trait;
use pingora::apps::{HttpPersistentSettings, ServerApp};
use pingora::protocols::http::ServerSession;
use pingora::protocols::raw_connect::ProxyDigest;
use pingora::protocols::tls::SslDigest;
use pingora::protocols::tls::TlsRef;
use pingora::protocols::{
    GetProxyDigest, GetSocketDigest, GetTimingDigest, Peek, Shutdown, SocketDigest, Ssl, Stream,
    TimingDigest, UniqueID, UniqueIDType, ALPN,
};
use pingora::proxy::HttpProxy;
use pingora::server::ShutdownWatch;
use prometheus::IntGauge;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, ReadBuf};
use tokio::time::{Instant, Sleep};

use crate::gateway::App;
use crate::proxy::Proxy;

/// Accepts client connections for the proxy: applies the per-address cap, then hands the
/// stream, wrapped in a `ClientConn`, to Pingora's HTTP machinery.
pub struct Edge {
    pub proxy: Arc<HttpProxy<Proxy>>,
    pub app: Arc<App>,
    pub per_ip: Arc<PerIp>,
}

#[async_trait]
impl ServerApp for Edge {
    async fn process_new(
        self: &Arc<Self>,
        stream: Stream,
        shutdown: &ShutdownWatch,
    ) -> Option<Stream> {
        let conn = {
            let gateway = self.app.current.load();
            let server = &gateway.config.server;
            let Ok(slot) = self.per_ip.admit(&stream, server, &self.app.metrics) else {
                return None;
            };
            ClientConn::new(
                stream,
                server.header_timeout,
                server.idle_timeout,
                &self.app,
                slot,
            )
        };
        let mut conn = Box::new(conn);
        let h2c = self.proxy.server_options.as_ref().is_some_and(|o| o.h2c);
        if h2c && conn.phase.load(Ordering::Relaxed) == HEADER {
            // Cleartext with h2c on: the client's first bytes say which protocol it speaks.
            match conn.read_h2_preface(shutdown).await {
                None => return None,
                Some(true) => conn.become_h2(),
                Some(false) => {}
            }
        }
        if conn.phase.load(Ordering::Relaxed) == OFF {
            // HTTP/2 (ALPN h2, or the h2c preface): Pingora's own connection handling.
            return ServerApp::process_new(&self.proxy, conn, shutdown).await;
        }
        // HTTP/1.x: Pingora's own keep-alive loop, except that the wait for each request's
        // first bytes happens here, in a small future, rather than inside Pingora's request
        // future, which is much larger: an idle connection then costs a few KiB.
        let mut settings: Option<HttpPersistentSettings> = None;
        loop {
            if conn.stash.is_empty()
                && conn.next_request_unread()
                && !conn.wait_for_request(shutdown).await
            {
                return None;
            }
            // Boxed here, as Pingora's proxy session holds it: passed by value, it would be
            // written once more into the request future.
            let mut session = Box::new(ServerSession::new_http1(conn));
            match settings.take() {
                Some(s) => s.apply_to_session(&mut session),
                None if *shutdown.borrow() => session.set_keepalive(None),
                None => session.set_keepalive(Some(60)),
            }
            let reused = self
                .proxy
                .process_new_http_unboxed(session, shutdown)
                .await?;
            let (stream, next) = reused.consume();
            settings = next;
            conn = stream.into_any().downcast::<ClientConn>().ok()?;
        }
    }

    async fn cleanup(&self) {
        ServerApp::cleanup(&*self.proxy).await;
    }
}

/// Open connections per client address, for `max_connections_per_ip`: the limiter's, so
/// the RLS listener admits by the same rule.
pub use crate::limiter::connections::{IpSlot, PerIp};

/// Where a connection is between requests; each phase has its own read deadline.
const HEADER: u8 = 0;
const BUSY: u8 = 1;
const IDLE: u8 = 2;
/// No deadlines: HTTP/2 (streams are bounded by `h2_idle_timeout` = `idle_timeout`, and
/// read timeouts).
const OFF: u8 = 3;

/// Read-ahead for a request's first bytes: API requests fit in one read of this; longer
/// headers are read on by Pingora.
const STASH_SIZE: usize = 1024;

/// What a prior-knowledge HTTP/2 client sends first (RFC 9113 §3.4).
const H2_PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

const RESPONSE_408: &[u8] =
    b"HTTP/1.1 408 Request Timeout\r\nContent-Length: 0\r\nConnection: close\r\n\r\n";

/// A client stream whose reads time out by phase (see the module comment).
pub struct ClientConn {
    inner: Stream,
    /// Set by the proxy from the same task that reads, so relaxed ordering suffices.
    phase: AtomicU8,
    /// The phase `deadline` was last armed for.
    armed: u8,
    deadline: Pin<Box<Sleep>>,
    /// Bytes of the current request header have arrived (a timeout then answers 408).
    header_started: bool,
    timed_out: bool,
    /// Bytes of the next request read ahead by `wait_for_request`, served to reads first.
    stash: Vec<u8>,
    stash_read: usize,
    /// Bytes handed to Pingora, and the request bytes it has answered (see
    /// `next_request_unread`); the proxy updates the latter through `&self`.
    bytes_in: u64,
    bytes_consumed: AtomicU64,
    consumed_unknown: AtomicBool,
    header_timeout: Duration,
    idle_timeout: Duration,
    app: Arc<App>,
    open: IntGauge,
    _slot: Option<IpSlot>,
}

impl ClientConn {
    fn new(
        inner: Stream,
        header_timeout: Duration,
        idle_timeout: Duration,
        app: &Arc<App>,
        slot: Option<IpSlot>,
    ) -> ClientConn {
        let h2 = matches!(inner.selected_alpn_proto(), Some(ALPN::H2));
        let open = app
            .metrics
            .connections
            .with_label_values(&[if h2 { "h2" } else { "http1" }]);
        open.inc();
        ClientConn {
            inner,
            phase: AtomicU8::new(if h2 { OFF } else { HEADER }),
            armed: HEADER,
            deadline: Box::pin(tokio::time::sleep(header_timeout)),
            header_started: false,
            timed_out: false,
            stash: Vec::new(),
            stash_read: 0,
            bytes_in: 0,
            bytes_consumed: AtomicU64::new(0),
            consumed_unknown: AtomicBool::new(false),
            header_timeout,
            idle_timeout,
            app: app.clone(),
            open,
            _slot: slot,
        }
    }

    /// The connection under a proxied session, if it is one of ours (HTTP/1).
    pub fn of(stream: Option<&Stream>) -> Option<&ClientConn> {
        stream?.as_any().downcast_ref::<ClientConn>()
    }

    /// Whether every byte read so far belongs to requests already answered, so the next
    /// request has not been read yet (Pingora keeps pipelined bytes it read too early).
    fn next_request_unread(&self) -> bool {
        !self.consumed_unknown.load(Ordering::Relaxed)
            && self.bytes_in == self.bytes_consumed.load(Ordering::Relaxed)
    }

    /// Waits for the next request's first bytes, which are kept for Pingora's parser.
    /// False when the connection should close: the deadline passed (idle, or header for a
    /// new connection), the client closed, or the server is shutting down.
    async fn wait_for_request(&mut self, shutdown: &ShutdownWatch) -> bool {
        if *shutdown.borrow() {
            return false;
        }
        let phase = self.phase.load(Ordering::Relaxed);
        if phase != self.armed {
            self.arm(phase);
        }
        // Read into this future, not the heap: an idle connection then holds no buffer of
        // its own. Its bytes overlap the request future's in the connection's, which the
        // connection's first request has already touched.
        let mut first = [0u8; STASH_SIZE];
        let deadline = self.deadline.deadline();
        let mut stopping = shutdown.clone();
        let read = tokio::select! {
            read = tokio::time::timeout_at(deadline, self.inner.read(&mut first)) => read,
            _ = stopping.changed() => return false,
        };
        match read {
            Ok(Ok(n)) if n > 0 => {
                self.stash = first[..n].to_vec();
                if phase == IDLE {
                    self.phase.store(HEADER, Ordering::Relaxed);
                    self.arm(HEADER);
                }
                self.header_started = true;
                true
            }
            Ok(_) => false,
            Err(_) => {
                if phase == HEADER {
                    self.app
                        .metrics
                        .connections_rejected
                        .with_label_values(&["header_timeout"])
                        .inc();
                }
                false
            }
        }
    }

    /// Reads the client's first bytes, within the header deadline, until they show whether
    /// they are the HTTP/2 preface; they are kept for the parser. Pingora's own check reads
    /// the preface's 24 bytes without a deadline, which a short or trickled HTTP/1 request
    /// would stall; here any byte that differs decides at once. `None`: close the connection.
    async fn read_h2_preface(&mut self, shutdown: &ShutdownWatch) -> Option<bool> {
        let deadline = self.deadline.deadline();
        let mut stopping = shutdown.clone();
        let mut stash = Vec::with_capacity(STASH_SIZE);
        let h2 = loop {
            let n = stash.len().min(H2_PREFACE.len());
            if stash[..n] != H2_PREFACE[..n] {
                break false;
            }
            if n == H2_PREFACE.len() {
                break true;
            }
            let read = tokio::select! {
                read = tokio::time::timeout_at(deadline, self.inner.read_buf(&mut stash)) => read,
                _ = stopping.changed() => return None,
            };
            match read {
                Ok(Ok(n)) if n > 0 => {}
                Ok(_) => return None,
                // Nothing, or a stalled preface (no HTTP/1 method starts "PRI"): closed.
                Err(_) if stash.is_empty() || stash.starts_with(b"PRI") => {
                    self.app
                        .metrics
                        .connections_rejected
                        .with_label_values(&["header_timeout"])
                        .inc();
                    return None;
                }
                // A partial HTTP/1 header: its path answers 408 (the deadline has passed).
                Err(_) => break false,
            }
        };
        self.header_started = true;
        self.stash = stash;
        Some(h2)
    }

    /// The connection turned out to be prior-knowledge HTTP/2 (h2c): no HTTP/1 deadlines,
    /// and counted under `protocol="h2"`.
    fn become_h2(&mut self) {
        self.open.dec();
        self.open = self.app.metrics.connections.with_label_values(&["h2"]);
        self.open.inc();
        self.phase.store(OFF, Ordering::Relaxed);
    }

    /// The request header is complete: no deadline until the response is done.
    pub fn request_started(&self) {
        if self.phase.load(Ordering::Relaxed) != OFF {
            self.phase.store(BUSY, Ordering::Relaxed);
        }
    }

    /// The response is done: the connection waits at most `idle_timeout` for the next one.
    /// `consumed` is the request's length on the wire (header and body), when known.
    pub fn request_finished(&self, consumed: Option<u64>) {
        if self.phase.load(Ordering::Relaxed) == BUSY {
            self.phase.store(IDLE, Ordering::Relaxed);
        }
        match consumed {
            Some(n) => {
                self.bytes_consumed.fetch_add(n, Ordering::Relaxed);
            }
            None => self.consumed_unknown.store(true, Ordering::Relaxed),
        }
    }

    fn arm(&mut self, phase: u8) {
        self.armed = phase;
        let timeout = match phase {
            HEADER => self.header_timeout,
            IDLE => {
                self.header_started = false;
                self.idle_timeout
            }
            _ => return,
        };
        self.deadline.as_mut().reset(Instant::now() + timeout);
    }

    /// Called when a read would block: has this phase's deadline passed?
    fn poll_deadline(&mut self, cx: &mut Context<'_>, phase: u8) -> Poll<io::Result<()>> {
        if !matches!(phase, HEADER | IDLE) || self.deadline.as_mut().poll(cx).is_pending() {
            return Poll::Pending;
        }
        self.timed_out = true;
        if phase == IDLE {
            // End of stream: Pingora closes an idle keep-alive connection quietly.
            return Poll::Ready(Ok(()));
        }
        self.app
            .metrics
            .connections_rejected
            .with_label_values(&["header_timeout"])
            .inc();
        if !self.header_started {
            return Poll::Ready(Ok(()));
        }
        // Best effort: the send buffer is empty between requests, so this small write
        // lands at once; Pingora flushes it when it shuts the connection down.
        let _ = Pin::new(&mut self.inner).poll_write(cx, RESPONSE_408);
        let _ = Pin::new(&mut self.inner).poll_flush(cx);
        Poll::Ready(Err(io::Error::new(
            io::ErrorKind::TimedOut,
            "request header timeout",
        )))
    }
}

impl Drop for ClientConn {
    fn drop(&mut self) {
        self.open.dec();
    }
}

impl fmt::Debug for ClientConn {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ClientConn")
            .field("inner", &self.inner)
            .field("phase", &self.phase)
            .finish()
    }
}

impl AsyncRead for ClientConn {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if this.stash_read < this.stash.len() {
            let rest = &this.stash[this.stash_read..];
            let n = rest.len().min(buf.remaining());
            buf.put_slice(&rest[..n]);
            this.stash_read += n;
            this.bytes_in += n as u64;
            if this.stash_read == this.stash.len() {
                this.stash = Vec::new();
                this.stash_read = 0;
            }
            return Poll::Ready(Ok(()));
        }
        if this.timed_out {
            return Poll::Ready(Err(io::ErrorKind::TimedOut.into()));
        }
        let mut phase = this.phase.load(Ordering::Relaxed);
        if phase != this.armed {
            this.arm(phase);
        }
        let before = buf.filled().len();
        match Pin::new(&mut this.inner).poll_read(cx, buf) {
            Poll::Ready(Ok(())) if buf.filled().len() > before => {
                this.bytes_in += (buf.filled().len() - before) as u64;
                if phase == IDLE {
                    // The next request's first bytes: its header is now on the clock.
                    phase = HEADER;
                    this.phase.store(HEADER, Ordering::Relaxed);
                    this.arm(HEADER);
                }
                if phase == HEADER {
                    this.header_started = true;
                }
                Poll::Ready(Ok(()))
            }
            Poll::Pending => this.poll_deadline(cx, phase),
            other => other,
        }
    }
}

impl AsyncWrite for ClientConn {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write(cx, buf)
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }
}

#[async_trait]
impl Shutdown for ClientConn {
    async fn shutdown(&mut self) {
        self.inner.shutdown().await;
    }
}

impl UniqueID for ClientConn {
    fn id(&self) -> UniqueIDType {
        self.inner.id()
    }
}

impl Ssl for ClientConn {
    fn get_ssl(&self) -> Option<&TlsRef> {
        self.inner.get_ssl()
    }

    fn get_ssl_digest(&self) -> Option<Arc<SslDigest>> {
        self.inner.get_ssl_digest()
    }

    fn selected_alpn_proto(&self) -> Option<ALPN> {
        self.inner.selected_alpn_proto()
    }
}

impl GetTimingDigest for ClientConn {
    fn get_timing_digest(&self) -> Vec<Option<TimingDigest>> {
        self.inner.get_timing_digest()
    }

    fn get_read_pending_time(&self) -> Duration {
        self.inner.get_read_pending_time()
    }

    fn get_write_pending_time(&self) -> Duration {
        self.inner.get_write_pending_time()
    }
}

impl GetProxyDigest for ClientConn {
    fn get_proxy_digest(&self) -> Option<Arc<ProxyDigest>> {
        self.inner.get_proxy_digest()
    }

    fn set_proxy_digest(&mut self, digest: ProxyDigest) {
        self.inner.set_proxy_digest(digest);
    }
}

impl GetSocketDigest for ClientConn {
    fn get_socket_digest(&self) -> Option<Arc<SocketDigest>> {
        self.inner.get_socket_digest()
    }

    fn set_socket_digest(&mut self, digest: SocketDigest) {
        self.inner.set_socket_digest(digest);
    }
}

#[async_trait]
impl Peek for ClientConn {
    async fn try_peek(&mut self, buf: &mut [u8]) -> io::Result<bool> {
        let rest = &self.stash[self.stash_read..];
        if rest.len() >= buf.len() {
            buf.copy_from_slice(&rest[..buf.len()]);
            return Ok(true);
        }
        if !rest.is_empty() {
            // A peek cannot span the stash and the socket: report peeking unsupported.
            return Ok(false);
        }
        self.inner.try_peek(buf).await
    }
}
