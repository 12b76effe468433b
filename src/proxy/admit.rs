//! Admission: the steps a request passes before it is forwarded (client, deny, normalise,
//! route, body size, auth, body, shed (an adaptive upstream's slot), limits, the route's own
//! answer); each refuses or goes on.
//! Owns the `route`, `client` and `limits` groups of the per-request context.

use std::borrow::Cow;
use std::net::{IpAddr, Ipv4Addr};
use std::time::Duration;

use bytes::Bytes;
use pingora::http::RequestHeader;
use pingora::prelude::*;

use super::metering::request::{
    ask_for_usage, content_length, read_body, request_bound, BodyNeeds, RequestBody,
};
use super::refusal::{Denied, Refusal};
use super::Ctx;
use crate::auth::{self, Identity, Presented};
use crate::config::{AuthMode, Config, RedirectTo, Route, Scheme, Target, AUTH_FAILURES};
use crate::gateway::Gateway;
use crate::key::{self, RequestFacts};
use crate::limiter::{Denial, Lease, Outcome, PolicyOutcome};
use crate::response::{self, AuthRefusal};
use crate::routing;
use crate::upstream::{self, Shed};

/// The request goes on to its route's upstream.
pub struct Admitted;

/// The route a request matched, and its path in normal form.
#[derive(Default)]
pub struct Routed {
    /// An index into the config's routes.
    pub id: Option<usize>,
    /// The request's path in its normal form (DESIGN §17), when the client spelled it
    /// otherwise: the upstream gets it (the access log keeps the path as sent).
    pub path: Option<String>,
}

/// Who is asking.
pub struct Client {
    /// The client's address, through trusted proxies.
    pub ip: IpAddr,
    /// Anonymous unless a credential checked out, and which credentials were presented
    /// (for `hide_credentials`).
    pub identity: Identity,
    pub presented: Presented,
    /// `[server] request_id`: this request's id (under the config's header name).
    pub request_id: Option<http::HeaderValue>,
}

impl Client {
    pub fn new() -> Client {
        Client {
            ip: IpAddr::V4(Ipv4Addr::UNSPECIFIED),
            identity: Identity::anonymous(),
            presented: Presented::default(),
            request_id: None,
        }
    }
}

/// What the route's policies decided.
#[derive(Default)]
pub struct Limits {
    pub decisions: Vec<PolicyOutcome>,
    pub rate_headers: Vec<(&'static str, String)>,
    /// Concurrency slots, released when the request ends (dropped with the context).
    pub leases: Vec<Lease>,
    /// Its place among its adaptive upstream's requests in flight (DESIGN §22), given
    /// back when the request ends, however it ends.
    pub slot: Option<upstream::Slot>,
}

/// What a request asks for, as routes and keys read it.
struct Asked {
    host: String,
    /// In its normal form.
    path: String,
    method: String,
    scheme: Scheme,
}

/// Runs the steps of admission in order; the first refusal ends it.
pub async fn admit<'g>(
    session: &mut Session,
    ctx: &mut Ctx,
    gateway: &'g Gateway,
) -> Result<Admitted, Refusal<'g>> {
    let config = &gateway.config;
    identify(session, ctx, config)?;
    deny(ctx, config)?;
    let asked = normalise(session, ctx, config)?;
    let route_id = route(ctx, gateway, &asked)?;
    let route = &config.routes[route_id];
    body_size(session, ctx, config, route)?;
    if route.auth != AuthMode::Off {
        // Boxed: its future is the largest of admission's, and Pingora copies the whole
        // request filter's future into a box of its own on every request, auth or not.
        Box::pin(authenticate(session, ctx, gateway, route_id)).await?;
    }
    let needs = BodyNeeds::of(config, route);
    let request_bound = match needs.bound.is_some() || needs.usage {
        true => body(session, ctx, needs).await?,
        false => None,
    };
    shed(ctx, gateway, route).await?;
    // The decision is awaited here, not in a step of its own: one future less to build.
    let client_cert = crate::tls::client_cert_id(session.digest());
    let facts = facts(
        session,
        ctx,
        route,
        &asked,
        client_cert.as_deref(),
        request_bound,
    );
    let policies = &config.policies;
    let outcome = gateway
        .limiter
        .decide(route_id, policies, &route.policies, &facts)
        .await;
    let wait_ms = decided(ctx, config, outcome)?;
    if wait_ms > 0 {
        tokio::time::sleep(Duration::from_millis(wait_ms)).await;
    }
    answer(session, route, &asked.host)
}

/// The client's address and, with `[server] request_id`, the request's id, set on it.
fn identify(session: &mut Session, ctx: &mut Ctx, config: &Config) -> Result<(), Refusal<'static>> {
    let peer = session
        .client_addr()
        .and_then(|a| a.as_inet())
        .map_or(IpAddr::V4(Ipv4Addr::UNSPECIFIED), |a| a.ip());
    let server = &config.server;
    let req = session.req_header();
    ctx.client.ip = key::client_ip(
        peer,
        &req.headers,
        &server.client_ip_header,
        &server.trusted_proxies,
    );
    if let Some(name) = &server.request_id {
        let id = request_id(&req.headers, name, peer, &server.trusted_proxies);
        session.req_header_mut().insert_header(name, &id)?;
        ctx.client.request_id = Some(id);
    }
    Ok(())
}

/// `[server] deny` (DESIGN §20): before anything else, auth and policies included.
fn deny(ctx: &Ctx, config: &Config) -> Result<(), Refusal<'static>> {
    if config.server.deny.contains(ctx.client.ip) {
        ctx.app.metrics.requests_denied.inc();
        return Err(Refusal::DeniedClient);
    }
    Ok(())
}

/// A usable Host, and one path, one spelling (DESIGN §17): routes, keys and the upstream
/// see the normal form of the path; one that has none is refused.
fn normalise(session: &Session, ctx: &mut Ctx, config: &Config) -> Result<Asked, Refusal<'static>> {
    let req = session.req_header();
    if let Some(problem) = host_problem(req) {
        return Err(Refusal::BadHost(problem));
    }
    let raw_host = req
        .uri
        .host()
        .or_else(|| {
            req.headers
                .get(http::header::HOST)
                .and_then(|h| h.to_str().ok())
        })
        .unwrap_or("");
    let host = routing::normalize_host(raw_host);
    let server = &config.server;
    let path = req.uri.path();
    let path = match routing::normalize_path(path, server.merge_slashes, server.escaped_slashes) {
        Ok(Cow::Borrowed(path)) => path.to_owned(),
        Ok(Cow::Owned(normal)) => ctx.route.path.insert(normal).clone(),
        Err(why) => return Err(Refusal::BadPath(why.detail())),
    };
    let scheme = if session.digest().is_some_and(|d| d.ssl_digest.is_some()) {
        Scheme::Https
    } else {
        Scheme::Http
    };
    Ok(Asked {
        host,
        path,
        method: req.method.as_str().to_owned(),
        scheme,
    })
}

fn route(ctx: &mut Ctx, gateway: &Gateway, asked: &Asked) -> Result<usize, Refusal<'static>> {
    let routes = &gateway.config.routes;
    let (host, path, method) = (&asked.host, &asked.path, &asked.method);
    let found = gateway
        .routes
        .find(routes, host, path, method, asked.scheme, ctx.client.ip);
    let id = found.ok_or(Refusal::NoRoute)?;
    ctx.route.id = Some(id);
    Ok(id)
}

/// The route's `max_request_body` against a declared length: refused before any policy is
/// charged; the unread body is not drained.
fn body_size(
    session: &Session,
    ctx: &mut Ctx,
    config: &Config,
    route: &Route,
) -> Result<(), Refusal<'static>> {
    ctx.body.limit = route
        .max_request_body
        .unwrap_or(config.server.max_request_body);
    let length = content_length(session.req_header());
    if ctx.body.limit > 0 && length.is_some_and(|n| n > ctx.body.limit) {
        return Err(Refusal::BodyTooLarge);
    }
    Ok(())
}

/// Who is asking (DESIGN §11): a banned address is refused before any credential is
/// looked at; an invalid credential counts against `max_failures`. Verified, the identity
/// is the client's.
async fn authenticate<'g>(
    session: &Session,
    ctx: &mut Ctx,
    gateway: &'g Gateway,
    route_id: usize,
) -> Result<(), Refusal<'g>> {
    let failures = gateway.auth.failures_policy();
    if let Some(policy) = failures {
        banned(ctx, gateway, route_id, policy)?;
    }
    let req = session.req_header();
    let route = &gateway.config.routes[route_id];
    let outcome = gateway
        .auth
        .authenticate(route.auth, &req.headers, req.uri.query());
    gateway.auth.count(route_id, outcome.label());
    let refusal = match outcome {
        auth::Outcome::Verified(identity, presented) => {
            ctx.client.identity = identity;
            ctx.client.presented = presented;
            return Ok(());
        }
        auth::Outcome::Anonymous => return Ok(()),
        auth::Outcome::Missing => AuthRefusal::Missing,
        auth::Outcome::Unavailable(why) => AuthRefusal::Unavailable(why),
        auth::Outcome::Invalid(why) => {
            if let Some(policy) = failures {
                count_failure(session, ctx, gateway, route_id, policy).await;
            }
            AuthRefusal::Invalid(why)
        }
    };
    Err(Refusal::Auth(Box::new(refusal)))
}

/// `max_failures`: an address banned after repeated invalid credentials is refused as the
/// policy refuses.
fn banned(
    ctx: &Ctx,
    gateway: &Gateway,
    route_id: usize,
    policy: usize,
) -> Result<(), Refusal<'static>> {
    let policy = &gateway.config.policies[policy];
    let Some(ms) = gateway.limiter.auth_banned(policy, ctx.client.ip) else {
        return Ok(());
    };
    gateway.auth.count(route_id, "banned");
    let denial = Denial::Limited {
        status: policy.status,
        retry_after_ms: ms,
        violated: vec![AUTH_FAILURES.to_owned()],
    };
    let denied = Denied {
        denial,
        reject: None,
    };
    Err(Refusal::Denied(Box::new(denied)))
}

/// An invalid credential counts against `max_failures`; enough of them ban the address.
async fn count_failure(
    session: &Session,
    ctx: &Ctx,
    gateway: &Gateway,
    route_id: usize,
    policy: usize,
) {
    let req = session.req_header();
    let facts = RequestFacts {
        client_ip: ctx.client.ip,
        method: req.method.as_str(),
        host: "",
        path: req.uri.path(),
        query: req.uri.query(),
        headers: &req.headers,
        route: &gateway.config.routes[route_id].name,
        client_cert: None,
        identity: &ctx.client.identity,
        request_bound: None,
    };
    let policies = &gateway.config.policies;
    if let Some(ms) = gateway.limiter.auth_failed(policies, policy, &facts).await {
        log::info!(
            "max_failures: {} banned for {}s after repeated invalid credentials",
            ctx.client.ip,
            ms.div_ceil(1000)
        );
    }
}

/// What the route's policies need of the body before the decision, read (DESIGN §12,
/// §17, §21): its bound, if they reserve by it, with an output bound written into a body
/// that sets none; a body of unknown length cannot be bounded, and is refused.
async fn body<'g>(
    session: &mut Session,
    ctx: &mut Ctx,
    needs: BodyNeeds,
) -> Result<Option<u64>, Refusal<'g>> {
    let mut bound = None;
    match read_body(session).await? {
        RequestBody::Whole(mut body) => {
            if let Some(written) = needs.bound {
                let bounded =
                    request_bound(&body, written).map_err(|bad| Refusal::BadBound(bad.0))?;
                if let Some(bounded) = bounded {
                    bound = Some(bounded.bound);
                    body = bounded.body.map_or(body, Bytes::from);
                }
            }
            let asked = needs.usage.then(|| ask_for_usage(&body)).flatten();
            ctx.body.whole = Some(asked.map_or(body, Bytes::from));
        }
        // Its bound cannot be read before it is sent (DESIGN §21).
        RequestBody::Unknown if needs.bound.is_some() => return Err(Refusal::LengthRequired),
        RequestBody::Unknown if needs.usage => ctx.body.held = Some(Vec::new()),
        RequestBody::Unknown | RequestBody::Empty => {}
        RequestBody::TooLarge => return Err(Refusal::MeteredBodyTooLarge),
    }
    Ok(bound)
}

/// The plan label of `sluice_shed_total` for a consumer without a plan.
const NO_PLAN: &str = "none";

/// `adaptive` of the route's upstream (DESIGN §22): a slot within the share of the limit
/// the request's plan may use, now or within `queue`, or shed before any policy is charged.
async fn shed<'g>(ctx: &mut Ctx, gateway: &'g Gateway, route: &Route) -> Result<(), Refusal<'g>> {
    let Target::Upstream(u) = route.target else {
        return Ok(());
    };
    let Some(gate) = &gateway.upstreams[u].adaptive else {
        return Ok(());
    };
    let plan = ctx.client.identity.plan.as_deref();
    let share = plan.map_or(1.0, |p| gate.config().share(p));
    match gate.admit(share).await {
        Ok(slot) => {
            ctx.limits.slot = Some(slot);
            Ok(())
        }
        Err(Shed) => {
            let name = &gateway.config.upstreams[u].name;
            ctx.app
                .metrics
                .shed
                .with_label_values(&[name.as_str(), plan.unwrap_or(NO_PLAN)])
                .inc();
            Err(Refusal::Shed(name))
        }
    }
}

/// What the route's policies key and decide on.
fn facts<'a>(
    session: &'a Session,
    ctx: &'a Ctx,
    route: &'a Route,
    asked: &'a Asked,
    client_cert: Option<&'a str>,
    request_bound: Option<u64>,
) -> RequestFacts<'a> {
    let req = session.req_header();
    RequestFacts {
        client_ip: ctx.client.ip,
        method: &asked.method,
        host: &asked.host,
        path: &asked.path,
        query: req.uri.query(),
        headers: &req.headers,
        route: &route.name,
        client_cert,
        identity: &ctx.client.identity,
        request_bound,
    }
}

/// What the route's policies decided, kept for the response and the log; a denial is
/// refused with its rate headers, an allowed request held for the milliseconds returned.
fn decided<'g>(ctx: &mut Ctx, config: &'g Config, outcome: Outcome) -> Result<u64, Refusal<'g>> {
    let policies = &config.policies;
    let limits = &mut ctx.limits;
    limits.rate_headers =
        response::rate_limit_headers(config.server.headers, policies, &outcome.policies);
    limits.decisions = outcome.policies;
    limits.leases = outcome.leases;
    ctx.metering.charges = outcome.charges;
    if let Some(denial) = outcome.denial {
        let reject = response::reject_body(policies, &ctx.limits.decisions, &denial);
        return Err(Refusal::Denied(Box::new(Denied { denial, reject })));
    }
    Ok(outcome.wait_ms)
}

/// The route's own answer (`respond`, `redirect`), or on to its upstream.
fn answer<'g>(session: &Session, route: &'g Route, host: &str) -> Result<Admitted, Refusal<'g>> {
    match &route.target {
        Target::Respond {
            status,
            body,
            content_type,
        } => Err(Refusal::Respond {
            status: *status,
            content_type,
            body,
        }),
        Target::Redirect { to, status } => {
            let location = match to {
                RedirectTo::Location(l) => l.clone(),
                RedirectTo::Scheme(s) => {
                    let scheme = if *s == Scheme::Https { "https" } else { "http" };
                    let target = target_as_received(session.req_header());
                    format!("{scheme}://{host}{target}")
                }
            };
            Err(Refusal::Redirect {
                status: *status,
                location,
            })
        }
        Target::Upstream(_) => Ok(Admitted),
    }
}

/// The request target as the client sent it (path and query, byte for byte), for a
/// redirect that keeps both.
fn target_as_received(req: &RequestHeader) -> String {
    let raw = String::from_utf8_lossy(req.raw_path());
    if raw.starts_with('/') {
        raw.into_owned()
    } else {
        // Absolute form: the path and query of the URI.
        req.uri
            .path_and_query()
            .map_or("/", |p| p.as_str())
            .to_owned()
    }
}

/// Why an HTTP/1.1 request's Host is unusable (RFC 9112 §3.2: missing or repeated).
fn host_problem(req: &RequestHeader) -> Option<&'static str> {
    let hosts = req.headers.get_all(http::header::HOST).iter().count();
    match hosts {
        0 if req.version == http::Version::HTTP_11 => Some("missing Host header"),
        2.. => Some("more than one Host header"),
        _ => None,
    }
}

/// `[server] request_id` (DESIGN §14): a trusted proxy's id is kept; anyone else's is
/// replaced by a new random 128-bit id (32 hex digits).
fn request_id(
    headers: &http::HeaderMap,
    name: &http::HeaderName,
    peer: IpAddr,
    trusted: &[ipnet::IpNet],
) -> http::HeaderValue {
    let peer = match peer {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(peer, IpAddr::V4),
        v4 => v4,
    };
    if trusted.iter().any(|net| net.contains(&peer)) {
        if let Some(id) = headers
            .get(name)
            .filter(|v| !v.is_empty() && v.len() <= 200)
        {
            return id.clone();
        }
    }
    let id = crate::auth::consumers::hex(&rand::random::<[u8; 16]>());
    http::HeaderValue::from_str(&id).unwrap_or_else(|_| http::HeaderValue::from_static("-"))
}
