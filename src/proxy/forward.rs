//! Forwarding: the peer of each try, retries (DESIGN §20; the `tries` group of the context),
//! and the request as the upstream gets it (the route's edits, identity headers, a metered
//! body's length, X-Forwarded-For).

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Instant;

use pingora::http::{RequestHeader, ResponseHeader};
use pingora::prelude::*;
use pingora::upstreams::peer::{HttpPeer, Peer};

use super::metering::request::content_length;
use super::Ctx;
use crate::auth;
use crate::config::{AuthMode, PathMatch, RetryOn, Route, Target};
use crate::gateway::Gateway;
use crate::key;
use crate::upstream;

/// This request's tries of its upstream.
#[derive(Default)]
pub struct Tries {
    /// When the first try began.
    pub started: Option<Instant>,
    /// Servers tried for this request, in order; the last one is answering it.
    pub servers: Vec<SocketAddr>,
    /// The upstream's `retries` (DESIGN §20): this request's tries, counted in its budget.
    retries: Option<upstream::Tries>,
    /// A retry on the upstream's status was granted: the error that ends this try says so.
    retry_status: bool,
    /// A response header of the upstream went on to the client: no more retries.
    answered: bool,
    /// With `adaptive` (DESIGN §22): when this try began, on its gate's clock (0: no try
    /// awaiting its first response header).
    try_started_us: u64,
}

/// `upstream_peer`: the route's upstream picks a server not yet tried while another is left.
pub fn peer(ctx: &mut Ctx) -> Result<Arc<HttpPeer>> {
    let (Some(gateway), Some(route)) = (&ctx.gateway, ctx.route.id) else {
        return Err(Error::new(ErrorType::InternalError));
    };
    let Target::Upstream(upstream) = gateway.config.routes[route].target else {
        return Err(Error::new(ErrorType::InternalError));
    };
    let upstream = &gateway.upstreams[upstream];
    if ctx.tries.retries.is_none() {
        ctx.tries.retries = upstream.tries();
    }
    let (addr, peer) = upstream.peer(ctx.client.ip, &ctx.tries.servers);
    if let Some(slot) = &ctx.limits.slot {
        // Each try is a latency sample; a retry runs in the request's slot.
        ctx.tries.try_started_us = slot.gate().now_us().max(1);
    }
    ctx.tries.servers.push(addr);
    ctx.tries.started.get_or_insert_with(Instant::now);
    Ok(peer)
}

/// `fail_to_connect`: the server is reported down; the try is retried as `retries` says, or
/// without, while a server is left untried.
pub fn connect_failed(ctx: &mut Ctx, peer: &HttpPeer, mut e: Box<Error>) -> Box<Error> {
    let (Some(gateway), Some(route)) = (&ctx.gateway, ctx.route.id) else {
        return e;
    };
    if let Target::Upstream(upstream) = gateway.config.routes[route].target {
        let pool = &gateway.upstreams[upstream].pool;
        if let Some(addr) = peer.address().as_inet() {
            pool.report(*addr, false);
        }
        match &mut ctx.tries.retries {
            // `retries` decides (DESIGN §20); nothing of the request has left, so a
            // failed connect is tried again whatever the method.
            Some(tries) => e.set_retry(tries.retry(RetryOn::Connect)),
            None if ctx.tries.servers.len() < pool.servers.len() => e.set_retry(true),
            None => {}
        }
    }
    e
}

/// `error_while_proxy`. With `retries` (DESIGN §20): a retry on status granted by
/// `upstream_answered`, or, for an idempotent request (GET HEAD OPTIONS PUT DELETE) whose
/// body Pingora holds whole, a connection the upstream closed, reset or let time out before
/// any response header. Otherwise, and without `retries`, Pingora's own rule: an idempotent
/// request is retried when a reused (keep-alive) connection failed.
pub fn proxy_failed(
    ctx: &mut Ctx,
    session: &Session,
    peer: &HttpPeer,
    e: Box<Error>,
    client_reused: bool,
) -> Box<Error> {
    let mut e = e.more_context(format!("Peer: {peer}"));
    if std::mem::take(&mut ctx.tries.retry_status) {
        e.set_retry(true);
        return e;
    }
    let truncated = session.as_ref().retry_buffer_truncated();
    if let Some(tries) = &mut ctx.tries.retries {
        let reset = *e.esource() == pingora::ErrorSource::Upstream
            && !ctx.tries.answered
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

/// `upstream_response_filter`. With `retries` on 502, 503 or 504: such an answer, before any
/// of it went to the client, ends this try with an error Pingora retries (another server
/// where there is one); the last try's answer goes through as it is.
/// With `adaptive`, the try's latency (its start to this header) is a sample of its gate.
pub fn upstream_answered(ctx: &mut Ctx, session: &Session, resp: &ResponseHeader) -> Result<()> {
    let started = std::mem::take(&mut ctx.tries.try_started_us);
    if let (Some(slot), true) = (&ctx.limits.slot, started > 0) {
        let gate = slot.gate();
        gate.record(started, gate.now_us());
    }
    let Some(tries) = &mut ctx.tries.retries else {
        return Ok(());
    };
    let status = resp.status.as_u16();
    if let Some(reason) = RetryOn::of_status(status) {
        if !ctx.tries.answered
            && session.response_written().is_none()
            && retry_safe(&session.req_header().method)
            && !session.as_ref().retry_buffer_truncated()
            && tries.retry(reason)
        {
            ctx.tries.retry_status = true;
            return Error::e_explain(
                ErrorType::HTTPStatus(status),
                "the upstream's answer is retried",
            );
        }
    }
    ctx.tries.answered = true;
    Ok(())
}

/// `upstream_request_filter`: the request as its upstream gets it.
pub fn upstream_request(session: &Session, upstream: &mut RequestHeader, ctx: &Ctx) -> Result<()> {
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
fn upstream_edits(upstream: &mut RequestHeader, route: &Route, normal: Option<&str>) -> Result<()> {
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
