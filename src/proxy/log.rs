//! The end of every request (Pingora's `logging`, refused ones too): the connection's
//! accounting, unsettled charges, the request metrics, the upstream's health, the access log.

use std::time::Duration;

use pingora::prelude::*;

use super::connection::ClientConn;
use super::metering::request::content_length;
use super::Ctx;
use crate::config::{AccessLog, Target};
use crate::gateway::Gateway;
use crate::limiter::Decision;
use crate::routing::UNMATCHED;
use crate::upstream;

/// `logging`: the request is over, answered or not (`e`: why not).
pub async fn request_ended(session: &mut Session, e: Option<&Error>, ctx: &mut Ctx) {
    if let Some(conn) = ClientConn::of(session.stream()) {
        conn.request_finished(wire_length(session));
    }
    let status = status(session, e);
    if !ctx.metering.charges.is_empty() {
        // Not settled by an upstream's response: sluice's own answer, a failed
        // upstream, or a client that went away (status 499, or none written).
        // Going away from an upstream's 2xx is no refund (DESIGN §17): the response
        // settles by that status, as a cut stream does.
        let sent = match status {
            0 | 499 => ctx
                .metering
                .upstream_status
                .filter(|s| (200..300).contains(s)),
            s => Some(s),
        };
        let gateway = ctx.gateway.as_deref();
        ctx.metering
            .settle(gateway, ctx.route.id, sent, None, true)
            .await;
    }
    let elapsed = ctx.started.elapsed();
    count(session, ctx, status, elapsed);
    let Some(gateway) = &ctx.gateway else { return };
    upstream_ended(ctx, gateway, e);
    let format = gateway.config.server.access_log;
    if format != AccessLog::Off {
        access_log(format, session, ctx, gateway, status, elapsed);
    }
}

/// The status the request is logged and counted with: the one written, 499 for a client
/// that went away (nginx's), 502 for a failure with nothing written, else 0.
fn status(session: &Session, e: Option<&Error>) -> u16 {
    match e {
        // nginx's 499: the client went away before the response was complete,
        // whatever part of it was already written.
        Some(e) if client_went_away(e) => 499,
        _ => session
            .response_written()
            .map(|r| r.status.as_u16())
            .unwrap_or(if e.is_some() { 502 } else { 0 }),
    }
}

/// The request's metrics: its count by protocol, route and status, and its duration.
fn count(session: &Session, ctx: &Ctx, status: u16, elapsed: Duration) {
    let label = ctx.route_label();
    let m = &ctx.app.metrics;
    let protocol = if session.is_http2() { "h2" } else { "http1" };
    let code = http::StatusCode::from_u16(status).ok();
    m.http_requests
        .with_label_values(&[protocol, label, code.as_ref().map_or("0", |c| c.as_str())])
        .inc();
    m.http_duration
        .with_label_values(&[label])
        .observe(elapsed.as_secs_f64());
}

/// The answering server's passive health, and the upstream's duration.
fn upstream_ended(ctx: &Ctx, gateway: &Gateway, e: Option<&Error>) {
    let (Some(at), Some(r)) = (ctx.tries.started, ctx.route.id) else {
        return;
    };
    if let Target::Upstream(u) = gateway.config.routes[r].target {
        if let (Some(addr), Some(ok)) = (ctx.tries.servers.last(), upstream::outcome(e)) {
            gateway.upstreams[u].pool.report(*addr, ok);
        }
        ctx.app
            .metrics
            .upstream_duration
            .with_label_values(&[&gateway.config.upstreams[u].name])
            .observe(at.elapsed().as_secs_f64());
    }
}

impl Ctx {
    fn route_name(&self) -> &str {
        match (&self.gateway, self.route.id) {
            (Some(g), Some(i)) => &g.config.routes[i].name,
            _ => UNMATCHED,
        }
    }

    /// The `route` label of this request's metrics (its route's `metrics_as`, if set).
    fn route_label(&self) -> &str {
        match (&self.gateway, self.route.id) {
            (Some(g), Some(i)) => g.config.routes[i].label(),
            _ => UNMATCHED,
        }
    }
}

/// Whether `e` is the client closing or breaking its connection before the response
/// was complete (Pingora: "Downstream ConnectionClosed ... Prematurely before response
/// header is sent", a failed read or write on the client side, or an HTTP/2 stream the
/// client reset: "Client closed H2").
pub fn client_went_away(e: &Error) -> bool {
    e.esource() == &pingora::ErrorSource::Downstream
        && matches!(
            e.etype(),
            ErrorType::WriteError
                | ErrorType::ReadError
                | ErrorType::ConnectionClosed
                | ErrorType::H2Error
        )
}

/// How many bytes an HTTP/1 request took on the wire, when that is known exactly: its
/// header plus a Content-Length body (Pingora reads or drains exactly that much before
/// it reuses the connection). Chunked bodies: unknown.
fn wire_length(session: &Session) -> Option<u64> {
    let pingora::protocols::http::ServerSession::H1(h1) = session.as_downstream() else {
        return None;
    };
    let req = h1.req_header();
    if req.headers.contains_key(http::header::TRANSFER_ENCODING) {
        return None;
    }
    Some(h1.get_headers_raw_bytes().len() as u64 + content_length(req).unwrap_or(0))
}

/// Whether a policy's decision refuses the request.
fn refuses(decision: Decision) -> bool {
    matches!(
        decision,
        Decision::Rejected | Decision::Banned | Decision::ErrorDenied
    )
}

/// A policy's word in the access log: its decision, except that a request one policy
/// refused charged none of the others (all or nothing, DESIGN §3), so a policy that would
/// have let it pass is `not_charged` there, not `allowed` (#43 item 10).
fn logged(decision: Decision, refused: bool) -> &'static str {
    match decision {
        Decision::Allowed | Decision::Delayed if refused => "not_charged",
        _ => decision.label(),
    }
}

/// One line on stdout per request, as JSON or as text (`[server] access_log`).
fn access_log(
    format: AccessLog,
    session: &Session,
    ctx: &Ctx,
    gateway: &Gateway,
    status: u16,
    elapsed: Duration,
) {
    use std::io::Write;
    let route = ctx.route_name();
    let req = session.req_header();
    let outcomes = &ctx.limits.decisions;
    let refused = outcomes.iter().any(|d| refuses(d.decision));
    let decisions: serde_json::Map<String, serde_json::Value> = outcomes
        .iter()
        .map(|d| {
            (
                gateway.config.policies[d.policy].name.clone(),
                logged(d.decision, refused).into(),
            )
        })
        .collect();
    let line = match format {
        AccessLog::Json => serde_json::json!({
            "ts": crate::clock::unix_secs(),
            "client_ip": ctx.client.ip.to_string(),
            "protocol": if session.is_http2() { "h2" } else { "http1" },
            "method": req.method.as_str(),
            "path": req.uri.path(),
            "route": route,
            "consumer": ctx.client.identity.consumer.as_deref(),
            "request_id": ctx.client.request_id.as_ref().and_then(|id| id.to_str().ok()),
            "status": status,
            "duration_ms": elapsed.as_secs_f64() * 1000.0,
            "decisions": decisions,
        })
        .to_string(),
        _ => {
            let d: Vec<String> = decisions
                .iter()
                .map(|(k, v)| format!("{k}={}", v.as_str().unwrap_or("")))
                .collect();
            format!(
                "{} {} {} route={route} consumer={} request_id={} status={status} duration_ms={:.3} decisions={}",
                ctx.client.ip,
                req.method,
                req.uri.path(),
                ctx.client.identity.consumer.as_deref().unwrap_or("-"),
                ctx.client.request_id.as_ref().and_then(|id| id.to_str().ok()).unwrap_or("-"),
                elapsed.as_secs_f64() * 1000.0,
                d.join(",")
            )
        }
    };
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{line}");
}
