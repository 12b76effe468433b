//! The Pingora proxy: route, decide in `request_filter`, forward, count in `logging`.

mod admit;
pub mod connection;
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
use pingora::upstreams::peer::{HttpPeer, Peer};

use crate::auth;
use crate::config::RetryOn;
use crate::config::{AuthMode, PathMatch, Target};
use crate::gateway::{App, Gateway};
use crate::key;
use admit::Admitted;
use connection::ClientConn;
use metering::request::content_length;
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
    upstream_started: Option<Instant>,
    /// Servers tried for this request, in order; the last one is answering it.
    upstream_tried: Vec<std::net::SocketAddr>,
    /// The upstream's `retries` (DESIGN §20): this request's tries, counted in its budget.
    retry: Option<crate::upstream::Tries>,
    /// A retry on the upstream's status was granted: the error that ends this try says so.
    retry_status: bool,
    /// A response header of the upstream went on to the client: no more retries.
    upstream_answered: bool,
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
            upstream_started: None,
            upstream_tried: Vec::new(),
            retry: None,
            retry_status: false,
            upstream_answered: false,
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
        refusal::write(session, refusal, extra, &ctx.limits.rate_headers).await?;
        Ok(true)
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

    async fn upstream_peer(&self, _session: &mut Session, ctx: &mut Ctx) -> Result<Box<HttpPeer>> {
        let (Some(gateway), Some(route)) = (&ctx.gateway, ctx.route.id) else {
            return Err(Error::new(ErrorType::InternalError));
        };
        let Target::Upstream(upstream) = gateway.config.routes[route].target else {
            return Err(Error::new(ErrorType::InternalError));
        };
        let upstream = &gateway.upstreams[upstream];
        if ctx.retry.is_none() {
            ctx.retry = upstream.tries();
        }
        let (addr, peer) = upstream.peer(ctx.client.ip, &ctx.upstream_tried);
        ctx.upstream_tried.push(addr);
        ctx.upstream_started.get_or_insert_with(Instant::now);
        Ok(peer)
    }

    fn fail_to_connect(
        &self,
        _session: &mut Session,
        peer: &HttpPeer,
        ctx: &mut Ctx,
        mut e: Box<Error>,
    ) -> Box<Error> {
        let (Some(gateway), Some(route)) = (&ctx.gateway, ctx.route.id) else {
            return e;
        };
        if let Target::Upstream(upstream) = gateway.config.routes[route].target {
            let pool = &gateway.upstreams[upstream].pool;
            if let Some(addr) = peer.address().as_inet() {
                pool.report(*addr, false);
            }
            match &mut ctx.retry {
                // `retries` decides (DESIGN §20); nothing of the request has left, so a
                // failed connect is tried again whatever the method.
                Some(tries) => e.set_retry(tries.retry(RetryOn::Connect)),
                None if ctx.upstream_tried.len() < pool.servers.len() => e.set_retry(true),
                None => {}
            }
        }
        e
    }

    /// With `retries` (DESIGN §20): a retry on status granted by `upstream_response_filter`,
    /// or, for an idempotent request (GET HEAD OPTIONS PUT DELETE) whose body Pingora holds
    /// whole, a connection the upstream closed, reset or let time out before any response
    /// header. Otherwise, and without `retries`, Pingora's own rule: an idempotent request
    /// is retried when a reused (keep-alive) connection failed.
    fn error_while_proxy(
        &self,
        peer: &HttpPeer,
        session: &mut Session,
        e: Box<Error>,
        ctx: &mut Ctx,
        client_reused: bool,
    ) -> Box<Error> {
        let mut e = e.more_context(format!("Peer: {peer}"));
        if std::mem::take(&mut ctx.retry_status) {
            e.set_retry(true);
            return e;
        }
        let truncated = session.as_ref().retry_buffer_truncated();
        if let Some(tries) = &mut ctx.retry {
            let reset = *e.esource() == pingora::ErrorSource::Upstream
                && !ctx.upstream_answered
                && session.response_written().is_none();
            if reset
                && !truncated
                && retry_safe(&session.req_header().method)
                && tries.retry(RetryOn::Reset)
            {
                e.set_retry(true);
                return e;
            }
        }
        if !session.req_header().method.is_idempotent() || truncated {
            e.set_retry(false);
        } else {
            e.retry.decide_reuse(client_reused);
        }
        e
    }

    /// With `retries` on 502, 503 or 504: such an answer, before any of it went to the
    /// client, ends this try with an error Pingora retries (another server where there is
    /// one); the last try's answer goes through as it is.
    async fn upstream_response_filter(
        &self,
        session: &mut Session,
        resp: &mut ResponseHeader,
        ctx: &mut Ctx,
    ) -> Result<()> {
        let Some(tries) = &mut ctx.retry else {
            return Ok(());
        };
        let status = resp.status.as_u16();
        if let Some(reason) = RetryOn::of_status(status) {
            if !ctx.upstream_answered
                && session.response_written().is_none()
                && retry_safe(&session.req_header().method)
                && !session.as_ref().retry_buffer_truncated()
                && tries.retry(reason)
            {
                ctx.retry_status = true;
                return Error::e_explain(
                    ErrorType::HTTPStatus(status),
                    "the upstream's answer is retried",
                );
            }
        }
        ctx.upstream_answered = true;
        Ok(())
    }

    async fn fail_to_proxy(&self, session: &mut Session, e: &Error, ctx: &mut Ctx) -> FailToProxy {
        use pingora::ErrorSource;
        // The request is over: its concurrency slots are free before the client hears so,
        // and can retry.
        ctx.limits.leases.clear();
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

    async fn upstream_request_filter(
        &self,
        session: &mut Session,
        upstream: &mut RequestHeader,
        ctx: &mut Ctx,
    ) -> Result<()> {
        if let Some(gateway) = &ctx.gateway {
            identity_headers(upstream, gateway, ctx)?;
            if let Some(route) = ctx.route.id.map(|r| &gateway.config.routes[r]) {
                upstream_edits(upstream, route, ctx.route.path.as_deref())?;
            }
        }
        metered_request(upstream, ctx)?;
        // An absolute-form target (`GET http://host/path`) reaches the upstream in origin
        // form. Pingora keeps its raw bytes for the wire; its Uri holds only the path, and
        // it has already checked that the target's authority equals Host.
        if !matches!(upstream.raw_path().first(), Some(b'/') | Some(b'*')) {
            let origin = upstream.uri.clone();
            upstream.set_uri(origin);
        }
        // Append the TCP peer, as nginx's $proxy_add_x_forwarded_for does.
        if let Some(peer) = session.client_addr().and_then(|a| a.as_inet()) {
            let mut forwarded = Vec::with_capacity(64);
            if let Some(existing) = upstream.headers.get("x-forwarded-for") {
                forwarded.extend_from_slice(existing.as_bytes());
                forwarded.extend_from_slice(b", ");
            }
            key::push_ip(&mut forwarded, peer.ip());
            upstream.insert_header("X-Forwarded-For", forwarded)?;
        }
        Ok(())
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

    async fn logging(&self, session: &mut Session, e: Option<&Error>, ctx: &mut Ctx) {
        log::request_ended(session, e, ctx).await;
    }
}

/// What a metered request tells its upstream (DESIGN §12, §17): the length of a body read
/// whole (asked for its usage, it has grown), and where a charge waits for the response's
/// cost, `Accept-Encoding: identity` (the client's own preference is not passed on).
fn metered_request(upstream: &mut RequestHeader, ctx: &Ctx) -> Result<()> {
    if let Some(body) = &ctx.body.whole {
        if content_length(upstream) != Some(body.len() as u64) {
            upstream.insert_header(http::header::CONTENT_LENGTH, body.len().to_string())?;
        }
        // The client was told to go on and has sent it all.
        upstream.remove_header(&http::header::EXPECT);
    }
    if ctx.body.held.is_some() {
        // Sent chunked (or as HTTP/2 DATA) whatever its length turns out to be.
        upstream.remove_header(&http::header::CONTENT_LENGTH);
    }
    if ctx.metering.charges.is_empty() {
        return Ok(());
    }
    let Some(gateway) = &ctx.gateway else {
        return Ok(());
    };
    if ctx.metering.by_response(&gateway.config.policies) {
        upstream.insert_header(http::header::ACCEPT_ENCODING, "identity")?;
    }
    Ok(())
}

/// The route's changes to the upstream request: the path in its normal form (`normal`,
/// when the client spelled it otherwise: DESIGN §17) less `strip_prefix`, the query as it
/// came; then `request_headers`.
fn upstream_edits(
    upstream: &mut RequestHeader,
    route: &crate::config::Route,
    normal: Option<&str>,
) -> Result<()> {
    let uri = &upstream.uri;
    let path = normal.unwrap_or(uri.path());
    let stripped = match (route.strip_prefix, &route.path) {
        (true, PathMatch::Prefix(prefix)) => path.strip_prefix(prefix.as_str()),
        _ => None,
    };
    if normal.is_some() || stripped.is_some() {
        let rest = stripped.unwrap_or(path);
        let query = uri.query();
        let mut target = String::with_capacity(rest.len() + query.map_or(0, str::len) + 2);
        if !rest.starts_with('/') {
            target.push('/');
        }
        target.push_str(rest);
        if let Some(query) = query {
            target.push('?');
            target.push_str(query);
        }
        match target.parse::<http::Uri>() {
            Ok(uri) => upstream.set_uri(uri),
            // Never the client's own spelling instead of the one that was routed.
            Err(_) if normal.is_some() => {
                return Error::e_explain(ErrorType::InternalError, "normalised path is no URI")
            }
            Err(_) => {}
        }
    }
    let rules = &route.request_headers;
    for name in &rules.remove {
        upstream.remove_header(name);
    }
    for (name, value) in &rules.set {
        upstream.insert_header(name, value)?;
    }
    Ok(())
}

/// What the upstream is told of the consumer: the client's own copies of the identity
/// headers (and `strip_headers`) are always removed, in every spelling (DESIGN §17: case
/// ignored, `_` as `-`), the verified values set on routes with `auth`, and with
/// `hide_credentials` every copy of every credential is not passed on.
fn identity_headers(upstream: &mut RequestHeader, gateway: &Gateway, ctx: &Ctx) -> Result<()> {
    let settings = gateway.auth.settings();
    upstream.remove_header(&settings.consumer_header);
    upstream.remove_header(&settings.plan_header);
    for name in &settings.strip_headers {
        upstream.remove_header(name);
    }
    for name in auth::other_spellings(&upstream.headers, auth::identity_header_names(settings)) {
        upstream.remove_header(&name);
    }
    let Some(route) = ctx.route.id.map(|r| &gateway.config.routes[r]) else {
        return Ok(());
    };
    if route.auth == AuthMode::Off {
        return Ok(());
    }
    if let Some(consumer) = ctx.client.identity.consumer.as_deref() {
        upstream.insert_header(&settings.consumer_header, consumer)?;
    }
    if let Some(plan) = ctx.client.identity.plan.as_deref() {
        upstream.insert_header(&settings.plan_header, plan)?;
    }
    if settings.hide_credentials {
        if ctx.client.presented.bearer {
            upstream.remove_header(&http::header::AUTHORIZATION);
        }
        if ctx.client.presented.key_header {
            for name in auth::key_header_names(settings) {
                upstream.remove_header(name);
            }
            for name in auth::other_spellings(&upstream.headers, auth::key_header_names(settings)) {
                upstream.remove_header(&name);
            }
        }
        if ctx.client.presented.key_query {
            let uri = &upstream.uri;
            if let Some(query) = uri.query() {
                let path = uri.path();
                let target = match auth::query_without_keys(query, &settings.api_key) {
                    Some(rest) => format!("{path}?{rest}"),
                    None => path.to_owned(),
                };
                if let Ok(uri) = target.parse::<http::Uri>() {
                    upstream.set_uri(uri);
                }
            }
        }
    }
    Ok(())
}

/// The methods `retries` may send again once the upstream has seen them (DESIGN §20).
fn retry_safe(method: &http::Method) -> bool {
    matches!(
        *method,
        http::Method::GET
            | http::Method::HEAD
            | http::Method::OPTIONS
            | http::Method::PUT
            | http::Method::DELETE
    )
}
