//! The Pingora proxy: route, decide in `request_filter`, forward, count in `logging`.

mod admit;
pub mod connection;
pub mod decode;
mod log;
mod refusal;
pub mod usage;

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
use crate::config::{AuthMode, Metering, PathMatch, Target};
use crate::gateway::{App, Gateway};
use crate::key;
use crate::limiter::{Charge, Settled};
use admit::Admitted;
use connection::ClientConn;
use decode::BodyMeter;
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
    /// Charges of metered policies the response settles (DESIGN §12).
    charges: Vec<Charge>,
    /// `cost = { usage = … }`: the upstream's body read as it passes (through its
    /// Content-Encoding), and whether it ended whole (a cut stream has no usable cost).
    usage: Option<BodyMeter>,
    body_ended: bool,
    /// The upstream's status once its response header came: a client that goes away
    /// from a 2xx keeps its charges (DESIGN §17).
    upstream_status: Option<u16>,
    /// A metered request's body, read whole before the decision and sent on as this
    /// (DESIGN §12, §17): what Pingora replays of it from its retry buffer is replaced.
    request_body: Option<Bytes>,
    /// A body of unknown length on a `usage = "openai"` route, held until it ends to be
    /// asked for its usage (DESIGN §17).
    held_body: Option<Vec<u8>>,
    upstream_started: Option<Instant>,
    /// Servers tried for this request, in order; the last one is answering it.
    upstream_tried: Vec<std::net::SocketAddr>,
    /// The upstream's `retries` (DESIGN §20): this request's tries, counted in its budget.
    retry: Option<crate::upstream::Tries>,
    /// A retry on the upstream's status was granted: the error that ends this try says so.
    retry_status: bool,
    /// A response header of the upstream went on to the client: no more retries.
    upstream_answered: bool,
    /// The route's `max_request_body` (0 = unlimited) and the body bytes seen so far.
    body_limit: u64,
    body_seen: u64,
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
            charges: Vec::new(),
            usage: None,
            body_ended: false,
            upstream_status: None,
            request_body: None,
            held_body: None,
            upstream_started: None,
            upstream_tried: Vec::new(),
            retry: None,
            retry_status: false,
            upstream_answered: false,
            body_limit: 0,
            body_seen: 0,
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
        if let Some(whole) = &ctx.request_body {
            // Read before the decision: what Pingora replays (the last 64 KiB or less of
            // it, once per upstream tried) is the end of this; the whole goes instead.
            if body.is_some() {
                *body = Some(whole.clone());
            }
            return Ok(());
        }
        // A chunked (or HTTP/2) body has no length up front: stop it at the limit.
        if let (Some(chunk), 1..) = (body.as_ref(), ctx.body_limit) {
            ctx.body_seen += chunk.len() as u64;
            if ctx.body_seen > ctx.body_limit {
                return Error::e_explain(ErrorType::HTTPStatus(413), "max_request_body exceeded");
            }
        }
        if let Some(held) = &mut ctx.held_body {
            hold_body(held, body, end_of_stream)?;
        }
        Ok(())
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
        if !ctx.charges.is_empty() && !interim {
            ctx.upstream_status = Some(resp.status.as_u16());
            ctx.usage = usage_meter(ctx, resp);
            settle(ctx, Some(resp.status.as_u16()), Some(&resp.headers), false).await;
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
        if let Some(meter) = &mut ctx.usage {
            if let Some(bytes) = body {
                meter.feed(bytes);
            }
            if end_of_stream && !ctx.body_ended {
                meter.finish();
                ctx.body_ended = true;
            }
        }
        Ok(None)
    }

    async fn logging(&self, session: &mut Session, e: Option<&Error>, ctx: &mut Ctx) {
        log::request_ended(session, e, ctx).await;
    }
}

/// Settles the request's metered charges (DESIGN §12) by the response's status (None:
/// the client went away before one was sent), from an upstream its header, and once the
/// response has `ended`, its body's usage; until then charges by usage stay pending.
async fn settle(
    ctx: &mut Ctx,
    status: Option<u16>,
    upstream: Option<&http::HeaderMap>,
    ended: bool,
) {
    let (Some(gateway), Some(route)) = (ctx.gateway.clone(), ctx.route.id) else {
        return;
    };
    let policies = &gateway.config.policies;
    let success = status.is_some_and(|s| (200..300).contains(&s));
    let usage = ctx.usage.as_ref().filter(|_| ctx.body_ended);
    let mut pending = Vec::new();
    let mut settled = Vec::with_capacity(ctx.charges.len());
    for charge in std::mem::take(&mut ctx.charges) {
        let how = match (&policies[charge.policy].metering, status) {
            (Some(Metering::Usage(_)), _) if !ended => {
                pending.push(charge);
                continue;
            }
            (Some(Metering::Usage(format)), _) => usage
                .and_then(|meter| meter.cost(*format))
                .map_or(Settled::Missing { kept: success }, Settled::Cost),
            (Some(m @ Metering::Status(_)), Some(s)) if !m.counts(s) => Settled::Refunded,
            (Some(Metering::Status(_)), _) => Settled::Kept,
            (Some(Metering::Header(name)), _) => upstream
                .and_then(|h| h.get(name))
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.trim().parse::<u64>().ok())
                .map_or(Settled::Missing { kept: success }, Settled::Cost),
            _ => Settled::Missing { kept: success },
        };
        settled.push((charge, how));
    }
    ctx.charges = pending;
    if !settled.is_empty() {
        gateway.limiter.settle(route, policies, settled).await;
    }
}

/// A meter for the upstream's body when a charge waits for its usage, and the body can be
/// read: as it is, or through a coding sluice decodes (DESIGN §17); another coding's usage
/// is unreadable, so it is charged as missing.
fn usage_meter(ctx: &Ctx, resp: &ResponseHeader) -> Option<BodyMeter> {
    let gateway = ctx.gateway.as_ref()?;
    let policies = &gateway.config.policies;
    let waits = ctx
        .charges
        .iter()
        .any(|c| matches!(policies[c.policy].metering, Some(Metering::Usage(_))));
    if !waits {
        return None;
    }
    let headers = &resp.headers;
    BodyMeter::new(
        headers
            .get(http::header::CONTENT_TYPE)
            .map(|t| t.as_bytes()),
        headers
            .get_all(http::header::CONTENT_ENCODING)
            .iter()
            .map(|e| e.as_bytes()),
    )
}

/// What a metered request tells its upstream (DESIGN §12, §17): the length of a body read
/// whole (asked for its usage, it has grown), and where a charge waits for the response's
/// cost, `Accept-Encoding: identity` (the client's own preference is not passed on).
fn metered_request(upstream: &mut RequestHeader, ctx: &Ctx) -> Result<()> {
    if let Some(body) = &ctx.request_body {
        if content_length(upstream) != Some(body.len() as u64) {
            upstream.insert_header(http::header::CONTENT_LENGTH, body.len().to_string())?;
        }
        // The client was told to go on and has sent it all.
        upstream.remove_header(&http::header::EXPECT);
    }
    if ctx.held_body.is_some() {
        // Sent chunked (or as HTTP/2 DATA) whatever its length turns out to be.
        upstream.remove_header(&http::header::CONTENT_LENGTH);
    }
    if ctx.charges.is_empty() {
        return Ok(());
    }
    let Some(gateway) = &ctx.gateway else {
        return Ok(());
    };
    let policies = &gateway.config.policies;
    let by_response = ctx.charges.iter().any(|c| {
        matches!(
            policies[c.policy].metering,
            Some(Metering::Usage(_) | Metering::Header(_))
        )
    });
    if by_response {
        upstream.insert_header(http::header::ACCEPT_ENCODING, "identity")?;
    }
    Ok(())
}

/// What a route's policies need of a request's body before it is sent on.
struct BodyNeeds {
    /// `reserve = "request"`: its bound, before the decision (DESIGN §12).
    bound: bool,
    /// `usage = "openai"`: a stream asked for its usage (DESIGN §17).
    usage: bool,
}

impl BodyNeeds {
    fn of(config: &crate::config::Config, route: &crate::config::Route) -> BodyNeeds {
        let mut needs = BodyNeeds {
            bound: false,
            usage: false,
        };
        for &id in &route.policies {
            let policy = &config.policies[id];
            needs.bound |= policy.reserve_request.is_some();
            needs.usage |= matches!(
                policy.metering,
                Some(Metering::Usage(crate::config::UsageFormat::OpenAi))
            );
        }
        needs
    }
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

/// The most of a metered body read whole (DESIGN §12, §17); a larger one gets 413.
const BOUND_BODY_LIMIT: u64 = 1 << 20;
/// The most of a body read before the upstream request that Pingora sends on to it (its
/// retry buffer).
const REPLAYED_BODY_LIMIT: u64 = 64 * 1024;

/// A metered request's body, as read before the decision.
enum RequestBody {
    Whole(Bytes),
    Empty,
    /// Of a length not known up front (chunked, or HTTP/2 without content-length): not
    /// read before the decision (see `read_body`).
    Unknown,
    /// Over 1 MiB, or one that could not be sent on once read: 413.
    TooLarge,
}

/// Reads a metered request's body whole, up to 1 MiB, before the decision (DESIGN §12,
/// §17); `request_body_filter` sends it on.
///
/// Pingora sends on what was read before the upstream request from its retry buffer, which
/// holds 64 KiB, and only when it holds everything read since it was enabled. So it is
/// enabled once at most 64 KiB of the body are left: it then holds the body's end, the
/// one chunk Pingora sends, which `request_body_filter` replaces with the whole. (Each read
/// takes at most 64 KiB; only the bytes that came with a header larger than that could end
/// the body in the first read: that body cannot be sent on, and gets 413.) A body of
/// unknown length cannot be read so: its end is known only once read.
async fn read_body(session: &mut Session) -> Result<RequestBody> {
    let req = session.req_header();
    if req.headers.contains_key(http::header::TRANSFER_ENCODING) {
        return Ok(RequestBody::Unknown);
    }
    let Some(length) = content_length(req) else {
        // HTTP/1.1 without either header has no body; HTTP/2 may send one without.
        return Ok(match session.is_body_empty() {
            true => RequestBody::Empty,
            false => RequestBody::Unknown,
        });
    };
    if length > BOUND_BODY_LIMIT {
        return Ok(RequestBody::TooLarge);
    }
    if length == 0 {
        return Ok(RequestBody::Empty);
    }
    let expects = req.headers.get(http::header::EXPECT);
    if expects.is_some_and(|e| e.as_bytes().eq_ignore_ascii_case(b"100-continue")) {
        // The body is read here, not by the upstream: the client is told to send it.
        session.write_continue_response().await?;
    }
    let mut body = Vec::with_capacity(length as usize);
    let mut buffering = false;
    loop {
        if !buffering && length - body.len() as u64 <= REPLAYED_BODY_LIMIT {
            session.enable_retry_buffering();
            buffering = true;
        }
        match session.read_request_body().await? {
            Some(chunk) => body.extend_from_slice(&chunk),
            None => break,
        }
        if body.len() as u64 > length {
            return Ok(RequestBody::TooLarge);
        }
    }
    if body.len() as u64 != length || session.get_retry_buffer().is_none() {
        return Ok(RequestBody::TooLarge);
    }
    Ok(RequestBody::Whole(Bytes::from(body)))
}

/// Holds a body of unknown length on a `usage = "openai"` route until it ends, then sends
/// it whole, asked for its usage (DESIGN §17); over 1 MiB it is refused as a metered body.
fn hold_body(held: &mut Vec<u8>, body: &mut Option<Bytes>, end_of_stream: bool) -> Result<()> {
    if let Some(chunk) = body.take() {
        if (held.len() + chunk.len()) as u64 > BOUND_BODY_LIMIT {
            return Error::e_explain(ErrorType::HTTPStatus(413), "metered body over 1 MiB");
        }
        held.extend_from_slice(&chunk);
    }
    if !end_of_stream {
        // Nothing to send yet (None would end the upstream's body).
        *body = Some(Bytes::new());
        return Ok(());
    }
    // Taken, not dropped: a retried upstream is sent the replayed body, asked again.
    let whole = std::mem::take(held);
    *body = Some(match usage::ask_for_usage(&whole) {
        Some(asked) => Bytes::from(asked),
        None => Bytes::from(whole),
    });
    Ok(())
}

/// The declared body length, if any (Pingora has already rejected malformed values).
fn content_length(req: &RequestHeader) -> Option<u64> {
    req.headers
        .get(http::header::CONTENT_LENGTH)?
        .to_str()
        .ok()?
        .trim()
        .parse()
        .ok()
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
