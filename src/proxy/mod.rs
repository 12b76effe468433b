//! The Pingora proxy: its hooks in the order Pingora calls them, each handing its phase to
//! the file that owns it (`admit` and `refusal`, `forward`, `metering`, `log`).

mod admit;
pub mod connection;
mod forward;
mod log;
pub mod metering;
mod refusal;

use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use bytes::Bytes;
use pingora::http::{RequestHeader, ResponseHeader};
use pingora::modules::http::HttpModules;
use pingora::prelude::*;
use pingora::proxy::FailToProxy;
use pingora::upstreams::peer::HttpPeer;

use crate::gateway::{App, Gateway};
use admit::Admitted;
use connection::ClientConn;
use refusal::Extra;

pub struct Proxy {
    pub app: Arc<App>,
}

/// Per-request state carried between Pingora's phases.
pub struct Ctx {
    app: Arc<App>,
    started: Instant,
    gateway: Option<Arc<Gateway>>,
    route: admit::Routed,
    client: admit::Client,
    limits: admit::Limits,
    metering: metering::Metering,
    body: metering::request::Body,
    tries: forward::Tries,
}

impl Drop for Ctx {
    fn drop(&mut self) {
        self.app.request_ended();
    }
}

#[async_trait]
impl ProxyHttp for Proxy {
    type CTX = Ctx;

    /// None: sluice does not compress. Pingora's default registers a disabled compression
    /// module, which still gives every request a boxed context and a call in each phase.
    fn init_downstream_modules(&self, _modules: &mut HttpModules) {}

    fn new_ctx(&self) -> Ctx {
        self.app.request_started();
        Ctx {
            app: self.app.clone(),
            started: Instant::now(),
            gateway: None,
            route: admit::Routed::default(),
            client: admit::Client::new(),
            limits: admit::Limits::default(),
            metering: metering::Metering::default(),
            body: metering::request::Body::default(),
            tries: forward::Tries::default(),
        }
    }

    async fn early_request_filter(&self, session: &mut Session, ctx: &mut Ctx) -> Result<()> {
        let gateway = self.app.current.load_full();
        let server = &gateway.config.server;
        if let Some(conn) = ClientConn::of(session.stream()) {
            conn.request_started();
        }
        // Pingora's read timeout bounds each body read: the longest pause allowed.
        session.set_read_timeout(Some(server.body_timeout));
        // Pingora's per-read keep-alive timer must not cut in before `idle_timeout`
        // (which `ClientConn` enforces); a connection that will close stays closing.
        if session.get_keepalive().is_some() {
            session.set_keepalive(Some(server.idle_timeout.as_secs().max(1) + 1));
        }
        session.set_pipelining_enabled(true);
        ctx.gateway = Some(gateway);
        Ok(())
    }

    async fn request_filter(&self, session: &mut Session, ctx: &mut Ctx) -> Result<bool> {
        let Some(gateway) = ctx.gateway.clone() else {
            return Err(Error::new(ErrorType::InternalError));
        };
        let refusal = match admit::admit(session, ctx, &gateway).await {
            Ok(Admitted) => return Ok(false),
            Err(refusal) => refusal,
        };
        let extra = Extra::of(ctx, &gateway);
        // Boxed: a refusal is the cold path; inline, its future would make every request's
        // (which Pingora boxes and copies) larger.
        Box::pin(refusal::write(
            session,
            refusal,
            extra,
            &ctx.limits.rate_headers,
        ))
        .await?;
        Ok(true)
    }

    /// Pingora's boxed form, which its proxy no longer calls: `shared_upstream_peer` answers.
    async fn upstream_peer(&self, _session: &mut Session, ctx: &mut Ctx) -> Result<Box<HttpPeer>> {
        forward::peer(ctx).map(|peer| Box::new(HttpPeer::clone(&peer)))
    }

    fn shared_upstream_peer(
        &self,
        _session: &mut Session,
        ctx: &mut Ctx,
    ) -> Option<Result<Arc<HttpPeer>>> {
        Some(forward::peer(ctx))
    }

    fn fail_to_connect(
        &self,
        _session: &mut Session,
        peer: &HttpPeer,
        ctx: &mut Ctx,
        e: Box<Error>,
    ) -> Box<Error> {
        forward::connect_failed(ctx, peer, e)
    }

    async fn upstream_request_filter(
        &self,
        session: &mut Session,
        upstream: &mut RequestHeader,
        ctx: &mut Ctx,
    ) -> Result<()> {
        forward::upstream_request(session, upstream, ctx)
    }

    async fn request_body_filter(
        &self,
        _session: &mut Session,
        body: &mut Option<Bytes>,
        end_of_stream: bool,
        ctx: &mut Ctx,
    ) -> Result<()> {
        ctx.body.filter(body, end_of_stream)
    }

    /// With `retries`, a 502, 503 or 504 not yet sent on may end the try instead.
    async fn upstream_response_filter(
        &self,
        session: &mut Session,
        resp: &mut ResponseHeader,
        ctx: &mut Ctx,
    ) -> Result<()> {
        forward::upstream_answered(ctx, session, resp)
    }

    async fn response_filter(
        &self,
        session: &mut Session,
        resp: &mut ResponseHeader,
        ctx: &mut Ctx,
    ) -> Result<()> {
        // An accepted upgrade (WebSocket): bytes now flow both ways until either side
        // closes. A client that only listens is not stalled, so `body_timeout` no longer
        // bounds its reads; the upstream's `read_timeout` still closes a session on which
        // the upstream sends nothing (nginx's proxy_read_timeout rule). The request keeps
        // its policies' decision and its concurrency leases, renewed, until it ends.
        if resp.status == http::StatusCode::SWITCHING_PROTOCOLS
            && session.is_upgrade(resp) == Some(true)
        {
            session.set_read_timeout(None);
        }
        // An informational response (100 Continue) settles nothing: the final one follows.
        let interim = resp.status.is_informational() && resp.status.as_u16() != 101;
        if !ctx.metering.charges.is_empty() && !interim {
            let gateway = ctx.gateway.as_deref();
            ctx.metering
                .response_started(gateway, ctx.route.id, resp)
                .await;
        }
        if let Some(gateway) = &ctx.gateway {
            let extra = Extra::of(ctx, gateway);
            extra.apply_rules(resp)?;
            for (name, value) in &ctx.limits.rate_headers {
                resp.insert_header(*name, value.as_str())?;
            }
            return extra.apply_request_id(resp);
        }
        for (name, value) in &ctx.limits.rate_headers {
            resp.insert_header(*name, value.as_str())?;
        }
        Ok(())
    }

    fn upstream_response_body_filter(
        &self,
        _session: &mut Session,
        body: &mut Option<Bytes>,
        end_of_stream: bool,
        ctx: &mut Ctx,
    ) -> Result<Option<Duration>> {
        ctx.metering.body(body, end_of_stream);
        Ok(None)
    }

    /// Whether the try is retried (`retries`, or Pingora's own rule).
    fn error_while_proxy(
        &self,
        peer: &HttpPeer,
        session: &mut Session,
        e: Box<Error>,
        ctx: &mut Ctx,
        client_reused: bool,
    ) -> Box<Error> {
        forward::proxy_failed(ctx, session, peer, e, client_reused)
    }

    async fn fail_to_proxy(&self, session: &mut Session, e: &Error, ctx: &mut Ctx) -> FailToProxy {
        use pingora::ErrorSource;
        // The request is over: its concurrency slots are free before the client hears so,
        // and can retry.
        ctx.limits.leases.clear();
        ctx.limits.slot = None;
        let code = match (e.esource(), e.etype()) {
            (_, ErrorType::HTTPStatus(code)) => *code,
            (ErrorSource::Upstream, _) => 502,
            // A stalled request body: Pingora's read timeout is `body_timeout`.
            (ErrorSource::Downstream, ErrorType::ReadTimedout) => {
                self.app
                    .metrics
                    .connections_rejected
                    .with_label_values(&["body_timeout"])
                    .inc();
                408
            }
            _ if log::client_went_away(e) => 0, // nobody to answer; counted as 499
            (ErrorSource::Downstream, _) => 400,
            _ => 500,
        };
        let extra = match &ctx.gateway {
            Some(gateway) => Extra::of(ctx, gateway),
            None => Extra::default(),
        };
        refusal::write_failure(session, code, extra).await;
        FailToProxy {
            error_code: code,
            can_reuse_downstream: false,
        }
    }

    async fn logging(&self, session: &mut Session, e: Option<&Error>, ctx: &mut Ctx) {
        log::request_ended(session, e, ctx).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The per-request context before it was grouped (25 fields), to hold `Ctx` to its size.
    #[allow(dead_code)]
    struct Flat {
        app: Arc<App>,
        started: Instant,
        gateway: Option<Arc<Gateway>>,
        route: Option<usize>,
        client_ip: std::net::IpAddr,
        decisions: Vec<crate::limiter::PolicyOutcome>,
        rate_headers: Vec<(&'static str, String)>,
        leases: Vec<crate::limiter::Lease>,
        charges: Vec<crate::limiter::Charge>,
        usage: Option<metering::decode::BodyMeter>,
        body_ended: bool,
        upstream_status: Option<u16>,
        request_body: Option<Bytes>,
        held_body: Option<Vec<u8>>,
        upstream_started: Option<Instant>,
        upstream_tried: Vec<std::net::SocketAddr>,
        retry: Option<crate::upstream::Tries>,
        retry_status: bool,
        upstream_answered: bool,
        body_limit: u64,
        body_seen: u64,
        identity: crate::auth::Identity,
        presented: crate::auth::Presented,
        request_id: Option<(http::HeaderName, http::HeaderValue)>,
        path: Option<String>,
    }

    #[test]
    fn grouping_the_context_made_it_no_larger() {
        let (grouped, flat) = (size_of::<Ctx>(), size_of::<Flat>());
        assert!(
            grouped <= flat,
            "Ctx is {grouped} bytes, the flat one {flat}"
        );
    }
}
