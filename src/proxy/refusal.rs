//! What sluice answers itself instead of forwarding: every refusal of admission and a route's
//! own `respond`/`redirect` answer, rendered in one place as HTTP or as a gRPC status.

use bytes::Bytes;
use pingora::http::ResponseHeader;
use pingora::prelude::*;

use super::Ctx;
use crate::config::HeaderRules;
use crate::gateway::Gateway;
use crate::limiter::Denial;
use crate::response::{self, AuthRefusal, GrpcStatus};

/// Why a request is not forwarded, and what it is answered.
pub enum Refusal<'g> {
    /// `[server] deny` (DESIGN §20): 403, or gRPC PERMISSION_DENIED.
    DeniedClient,
    /// A missing or repeated Host (RFC 9112 §3.2): 400 as HTTP whatever the request, without
    /// the request id; the connection closes.
    BadHost(&'static str),
    /// A path with no normal form (DESIGN §17): 400, or INVALID_ARGUMENT.
    BadPath(&'static str),
    /// A metered request's output bound or multiplier (this field) that is not a plain
    /// non-negative integer, or is written twice (DESIGN §21): 400, or INVALID_ARGUMENT.
    BadBound(&'static str),
    /// No route matches: 404 `no route`, or UNIMPLEMENTED.
    NoRoute,
    /// A declared length over `max_request_body`: 413 as HTTP; the connection closes.
    BodyTooLarge,
    /// A metered body that cannot be read whole (DESIGN §12, §17): 413 as HTTP; the
    /// connection closes.
    MeteredBodyTooLarge,
    /// A body of unknown length on a route that reserves by the request's bound (DESIGN
    /// §21): it cannot be read for its bound before it is sent, so it is 411 as HTTP; the
    /// connection closes.
    LengthRequired,
    /// Authentication refused (DESIGN §11): 401 or 503, or UNAUTHENTICATED or UNAVAILABLE.
    Auth(Box<AuthRefusal>),
    /// A policy's denial (or `max_failures`' ban): its status with `Retry-After`, the rate
    /// headers and the `reject` body, or RESOURCE_EXHAUSTED or UNAVAILABLE.
    Denied(Box<Denied<'g>>),
    /// The route's adaptive upstream (this one) has no slot for the request within `queue`
    /// (DESIGN §22): 503 with `Retry-After: 1`, or UNAVAILABLE.
    Shed(&'g str),
    /// The route answers itself (`respond`), with the rate headers.
    Respond {
        status: u16,
        content_type: &'g str,
        body: &'g str,
    },
    /// The route redirects (`redirect`), with the rate headers.
    Redirect { status: u16, location: String },
    /// Pingora's own error: nothing is written here, `request_filter` returns it.
    Failed(Box<Error>),
}

/// A denial and the `reject` body of the policy it reports (its bytes and content type).
pub struct Denied<'g> {
    pub denial: Denial,
    pub reject: Option<(Vec<u8>, &'g str)>,
}

impl From<Box<Error>> for Refusal<'_> {
    fn from(e: Box<Error>) -> Self {
        Refusal::Failed(e)
    }
}

impl Refusal<'_> {
    /// Whether the client's connection is closed after the answer (its body is not read).
    fn closes(&self) -> bool {
        matches!(
            self,
            Refusal::BadHost(_)
                | Refusal::BodyTooLarge
                | Refusal::MeteredBodyTooLarge
                | Refusal::LengthRequired
        )
    }
}

/// What every answer of sluice's own carries besides its own headers (DESIGN §14): the
/// route's `response_headers` rules and the request id.
#[derive(Clone, Copy, Default)]
pub struct Extra<'a> {
    pub rules: Option<&'a HeaderRules>,
    pub request_id: Option<(&'a http::HeaderName, &'a http::HeaderValue)>,
}

impl<'a> Extra<'a> {
    pub fn of(ctx: &'a Ctx, gateway: &'a Gateway) -> Extra<'a> {
        Extra {
            rules: ctx
                .route
                .id
                .map(|r| &gateway.config.routes[r].response_headers)
                .filter(|r| !r.is_empty()),
            request_id: gateway
                .config
                .server
                .request_id
                .as_ref()
                .zip(ctx.client.request_id.as_ref()),
        }
    }

    /// The route's rules first, so sluice's own headers (RateLimit, Retry-After, ...) set
    /// after them always survive.
    pub fn apply_rules(&self, resp: &mut ResponseHeader) -> Result<()> {
        if let Some(rules) = self.rules {
            for name in &rules.remove {
                resp.remove_header(name);
            }
            for (name, value) in &rules.set {
                resp.insert_header(name, value)?;
            }
        }
        Ok(())
    }

    pub fn apply_request_id(&self, resp: &mut ResponseHeader) -> Result<()> {
        if let Some((name, value)) = self.request_id {
            resp.insert_header(name, value)?;
        }
        Ok(())
    }
}

/// An answer as it goes on the wire.
pub struct Rendered {
    pub header: ResponseHeader,
    pub body: Bytes,
    /// A gRPC trailers-only answer: its header ends the stream.
    pub grpc: bool,
}

/// Writes `refusal` to the client: the one place a refusal goes out. `rate_headers`: the
/// request's rate-limit headers, sent with denials and a route's own answers.
pub async fn write(
    session: &mut Session,
    refusal: Refusal<'_>,
    extra: Extra<'_>,
    rate_headers: &[(&'static str, String)],
) -> Result<()> {
    if let Refusal::Failed(e) = refusal {
        return Err(e);
    }
    if refusal.closes() {
        session.set_keepalive(None);
    }
    let grpc = response::is_grpc(&session.req_header().headers);
    let rendered = render(refusal, grpc, session.is_http2(), extra, rate_headers)?;
    send(session, rendered).await
}

/// `refusal` as the response header and body it is written as, for a gRPC request (`grpc`)
/// or not, over HTTP/2 (`h2`) or HTTP/1.
pub fn render(
    refusal: Refusal<'_>,
    grpc: bool,
    h2: bool,
    extra: Extra<'_>,
    rate_headers: &[(&'static str, String)],
) -> Result<Rendered> {
    if grpc {
        if let Some(headers) = grpc_headers(&refusal, rate_headers) {
            return grpc_answer(&headers, h2, extra);
        }
    }
    let rate = rate_headers.iter().map(|(n, v)| (*n, v.as_str()));
    match refusal {
        Refusal::DeniedClient => problem(403, response::denied_client(), extra),
        Refusal::BadHost(why) => {
            let body = response::problem(400, "Bad Request", why);
            problem(400, body, Extra::default())
        }
        Refusal::BadPath(why) => problem(400, response::problem(400, "Bad Request", why), extra),
        Refusal::BadBound(field) => {
            let body = response::problem(400, "Bad Request", &bad_bound(field));
            problem(400, body, extra)
        }
        Refusal::NoRoute => {
            let body = Bytes::from_static(b"no route\n");
            answer(404, "text/plain", body, std::iter::empty(), extra)
        }
        Refusal::BodyTooLarge => problem(413, response::body_too_large(), extra),
        Refusal::MeteredBodyTooLarge => {
            let why = "a metered request's body is read for its bound, up to 1 MiB";
            problem(413, response::problem(413, "Content Too Large", why), extra)
        }
        Refusal::LengthRequired => {
            let why = "a request that reserves by its bound is read whole before it is sent: send its Content-Length";
            problem(411, response::problem(411, "Length Required", why), extra)
        }
        Refusal::Auth(refusal) => {
            let (status, headers, body) = response::auth_refusal(&refusal);
            let headers = headers.iter().map(|(n, v)| (*n, v.as_str()));
            answer(status, response::PROBLEM, body.into(), headers, extra)
        }
        Refusal::Denied(denied) => {
            let Denied { denial, reject } = *denied;
            let (status, more, problem) = response::denial(&denial);
            let more = more.iter().map(|(n, v)| (*n, v.as_str()));
            let (body, content_type) = match reject {
                Some((body, content_type)) => (Bytes::from(body), content_type),
                None => (Bytes::from(problem), response::PROBLEM),
            };
            answer(status, content_type, body, rate.chain(more), extra)
        }
        Refusal::Shed(upstream) => {
            let body = response::problem(503, "Service Unavailable", &overloaded(upstream));
            let retry = std::iter::once(("Retry-After", "1"));
            answer(503, response::PROBLEM, body.into(), retry, extra)
        }
        Refusal::Respond {
            status,
            content_type,
            body,
        } => {
            let body = Bytes::copy_from_slice(body.as_bytes());
            answer(status, content_type, body, rate, extra)
        }
        Refusal::Redirect { status, location } => {
            let headers = rate.chain(std::iter::once(("Location", location.as_str())));
            answer(status, "text/plain", Bytes::new(), headers, extra)
        }
        Refusal::Failed(_) => Error::e_explain(ErrorType::InternalError, "a failure is no answer"),
    }
}

/// The `grpc-status` and `grpc-message` (and the headers that go with them) of a refusal a
/// gRPC client is told as gRPC; None: it is answered as HTTP whatever the request.
fn grpc_headers(
    refusal: &Refusal<'_>,
    rate_headers: &[(&'static str, String)],
) -> Option<Vec<(&'static str, String)>> {
    Some(match refusal {
        Refusal::DeniedClient => {
            response::grpc_status(GrpcStatus::PermissionDenied, "client address denied")
        }
        Refusal::BadPath(why) => response::grpc_status(GrpcStatus::InvalidArgument, why),
        Refusal::BadBound(field) => {
            response::grpc_status(GrpcStatus::InvalidArgument, &bad_bound(field))
        }
        Refusal::NoRoute => response::grpc_status(GrpcStatus::Unimplemented, "no route"),
        Refusal::Auth(refusal) => response::grpc_auth_refusal(refusal),
        Refusal::Shed(upstream) => {
            response::grpc_status(GrpcStatus::Unavailable, &overloaded(upstream))
        }
        Refusal::Denied(denied) => {
            let mut headers = response::grpc_denial(&denied.denial);
            headers.extend(rate_headers.iter().cloned());
            headers
        }
        _ => return None,
    })
}

/// The detail of `Refusal::Shed`.
fn overloaded(upstream: &str) -> String {
    format!("upstream \"{upstream}\" is overloaded: no slot within its adaptive concurrency limit; retry later")
}

/// The detail of `Refusal::BadBound`.
fn bad_bound(field: &str) -> String {
    format!("`{field}` must be a plain non-negative integer, written once: it bounds what the request may cost")
}

/// A problem+json answer with no headers of its own.
fn problem(status: u16, body: String, extra: Extra<'_>) -> Result<Rendered> {
    answer(
        status,
        response::PROBLEM,
        body.into(),
        std::iter::empty(),
        extra,
    )
}

/// An HTTP answer: the route's rules, its content type and length, `headers`, the request id.
fn answer<'h>(
    status: u16,
    content_type: &str,
    body: Bytes,
    headers: impl Iterator<Item = (&'static str, &'h str)>,
    extra: Extra<'_>,
) -> Result<Rendered> {
    let mut header = ResponseHeader::build(status, Some(headers.size_hint().0 + 2))?;
    extra.apply_rules(&mut header)?;
    header.insert_header("Content-Type", content_type)?;
    header.insert_header("Content-Length", body.len().to_string())?;
    for (name, value) in headers {
        header.insert_header(name, value)?;
    }
    extra.apply_request_id(&mut header)?;
    Ok(Rendered {
        header,
        body,
        grpc: false,
    })
}

/// A gRPC answer of sluice's own (DESIGN §8): HTTP 200, trailers-only. `headers` carry
/// `grpc-status`, `grpc-message` and the rate-limit headers, all in one HEADERS frame
/// with END_STREAM.
pub fn grpc_answer(
    headers: &[(&'static str, String)],
    h2: bool,
    extra: Extra<'_>,
) -> Result<Rendered> {
    let mut header = ResponseHeader::build(200, Some(headers.len() + 2))?;
    extra.apply_rules(&mut header)?;
    header.insert_header("Content-Type", response::GRPC)?;
    if !h2 {
        // HTTP/1.1 has no trailers-only form; this at least ends the response cleanly.
        header.insert_header("Content-Length", "0")?;
    }
    for (name, value) in headers {
        header.insert_header(*name, value.as_str())?;
    }
    extra.apply_request_id(&mut header)?;
    Ok(Rendered {
        header,
        body: Bytes::new(),
        grpc: true,
    })
}

/// Sends a rendered answer: a gRPC one ends the stream with its header; an HTTP one has no
/// body for HEAD (its Content-Length stays).
pub async fn send(session: &mut Session, rendered: Rendered) -> Result<()> {
    let Rendered { header, body, grpc } = rendered;
    if grpc {
        return match session.as_downstream_mut() {
            // Pingora's `Session::write_response_header` never sets END_STREAM on h2 (an
            // empty DATA frame ends the stream later, or a reset when the session is dropped
            // after a failure); the h2 session itself can end the stream with the HEADERS
            // frame.
            pingora::protocols::http::ServerSession::H2(h2) => {
                h2.write_response_header(Box::new(header), true)
            }
            _ => session.write_response_header(Box::new(header), true).await,
        };
    }
    let head = session.req_header().method == http::Method::HEAD;
    session
        .write_response_header(Box::new(header), head || body.is_empty())
        .await?;
    if !head && !body.is_empty() {
        session.write_response_body(Some(body), true).await?;
    }
    Ok(())
}

/// The answer of a request that failed after admission (`fail_to_proxy`'s `code`; 0: the
/// client went away): a gRPC client that has heard nothing yet is told UNAVAILABLE for a
/// 5xx; otherwise a problem body for 408 and 413, Pingora's own answer for the rest.
pub async fn write_failure(session: &mut Session, code: u16, extra: Extra<'_>) {
    let grpc = response::is_grpc(&session.req_header().headers);
    if grpc && code >= 500 && session.response_written().is_none() {
        // The upstream could not be reached or failed before answering.
        let status = response::grpc_status(GrpcStatus::Unavailable, "upstream unavailable");
        let written = match grpc_answer(&status, session.is_http2(), extra) {
            Ok(rendered) => send(session, rendered).await,
            Err(e) => Err(e),
        };
        if let Err(e) = written {
            log::debug!("could not answer gRPC {code}: {e}");
        }
    } else if code > 0 {
        let answer = match code {
            408 => Some(response::problem(
                408,
                "Request Timeout",
                "request body stalled",
            )),
            413 => Some(response::body_too_large()),
            _ => None,
        };
        let written = match answer {
            Some(body) => match ResponseHeader::build(code, Some(2)) {
                Ok(mut resp) => {
                    let _ = resp.insert_header("Content-Type", response::PROBLEM);
                    let _ = resp.insert_header("Content-Length", body.len().to_string());
                    session.write_error_response(resp, body.into()).await
                }
                Err(e) => Err(e),
            },
            None => session.respond_error(code).await,
        };
        if let Err(e) = written {
            log::debug!("could not answer {code}: {e}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Status, headers in order (names as written), body.
    fn http(
        refusal: Refusal<'_>,
        grpc: bool,
        extra: Extra<'_>,
    ) -> (u16, Vec<(String, String)>, String) {
        let rate = [("RateLimit", "\"p\";r=0;t=1".to_owned())];
        let rendered = render(refusal, grpc, false, extra, &rate).expect("rendered");
        assert!(!rendered.grpc);
        let headers = rendered
            .header
            .headers
            .iter()
            .map(|(n, v)| (n.as_str().to_owned(), v.to_str().expect("ascii").to_owned()))
            .collect();
        let body = String::from_utf8(rendered.body.to_vec()).expect("utf-8");
        (rendered.header.status.as_u16(), headers, body)
    }

    /// The headers of a gRPC answer over h2 (no Content-Length) or HTTP/1.
    fn grpc(refusal: Refusal<'_>, h2: bool) -> Vec<(String, String)> {
        let rate = [("RateLimit", "\"p\";r=0;t=1".to_owned())];
        let rendered = render(refusal, true, h2, Extra::default(), &rate).expect("rendered");
        assert!(rendered.grpc);
        assert_eq!(rendered.header.status.as_u16(), 200);
        assert!(rendered.body.is_empty());
        rendered
            .header
            .headers
            .iter()
            .map(|(n, v)| (n.as_str().to_owned(), v.to_str().expect("ascii").to_owned()))
            .collect()
    }

    fn pairs(expected: &[(&str, &str)]) -> Vec<(String, String)> {
        expected
            .iter()
            .map(|(n, v)| (n.to_string(), v.to_string()))
            .collect()
    }

    fn problem_headers(body: &str) -> Vec<(String, String)> {
        let length = body.len().to_string();
        pairs(&[
            ("content-type", response::PROBLEM),
            ("content-length", &length),
        ])
    }

    fn limited() -> Denial {
        Denial::Limited {
            status: 429,
            retry_after_ms: 1500,
            violated: vec!["per_ip".into()],
        }
    }

    #[test]
    fn a_denied_client_gets_403_or_permission_denied() {
        let (status, headers, body) = http(Refusal::DeniedClient, false, Extra::default());
        assert_eq!(status, 403);
        assert_eq!(body, response::denied_client());
        assert_eq!(headers, problem_headers(&body));
        assert_eq!(
            grpc(Refusal::DeniedClient, true),
            pairs(&[
                ("content-type", "application/grpc"),
                ("grpc-status", "7"),
                ("grpc-message", "client address denied"),
            ])
        );
    }

    #[test]
    fn a_bad_host_is_400_as_http_without_the_request_id_and_closes() {
        let name = http::HeaderName::from_static("x-request-id");
        let id = http::HeaderValue::from_static("abc");
        let extra = Extra {
            rules: None,
            request_id: Some((&name, &id)),
        };
        for grpc in [false, true] {
            let (status, headers, body) =
                http(Refusal::BadHost("missing Host header"), grpc, extra);
            assert_eq!(status, 400);
            assert_eq!(
                body,
                r#"{"detail":"missing Host header","status":400,"title":"Bad Request","type":"about:blank"}"#
            );
            assert_eq!(headers, problem_headers(&body));
        }
        assert!(Refusal::BadHost("x").closes());
        assert!(Refusal::BodyTooLarge.closes());
        assert!(Refusal::MeteredBodyTooLarge.closes());
        assert!(Refusal::LengthRequired.closes());
        assert!(!Refusal::NoRoute.closes());
    }

    #[test]
    fn a_body_of_unknown_length_that_must_be_bounded_is_411_as_http() {
        for grpc in [false, true] {
            let (status, headers, body) = http(Refusal::LengthRequired, grpc, Extra::default());
            assert_eq!(status, 411);
            assert!(body.contains("Content-Length"), "{body}");
            assert_eq!(headers, problem_headers(&body));
        }
    }

    #[test]
    fn a_bad_bound_is_400_or_invalid_argument_naming_the_field() {
        let (status, headers, body) = http(Refusal::BadBound("n"), false, Extra::default());
        assert_eq!(status, 400);
        assert!(
            body.contains("`n` must be a plain non-negative integer"),
            "{body}"
        );
        assert_eq!(headers, problem_headers(&body));
        let grpc = grpc(Refusal::BadBound("max_tokens"), true);
        assert!(
            grpc.contains(&("grpc-status".into(), "3".into())),
            "{grpc:?}"
        );
    }

    #[test]
    fn a_bad_path_is_400_or_invalid_argument() {
        let why = "the path climbs above the root with `..`";
        let (status, headers, body) = http(Refusal::BadPath(why), false, Extra::default());
        assert_eq!(status, 400);
        assert_eq!(body, response::problem(400, "Bad Request", why));
        assert_eq!(headers, problem_headers(&body));
        assert_eq!(
            grpc(Refusal::BadPath(why), false),
            pairs(&[
                ("content-type", "application/grpc"),
                ("content-length", "0"),
                ("grpc-status", "3"),
                ("grpc-message", "the path climbs above the root with `..`"),
            ])
        );
    }

    #[test]
    fn no_route_is_404_text_or_unimplemented() {
        let (status, headers, body) = http(Refusal::NoRoute, false, Extra::default());
        assert_eq!(status, 404);
        assert_eq!(body, "no route\n");
        assert_eq!(
            headers,
            pairs(&[("content-type", "text/plain"), ("content-length", "9")])
        );
        assert_eq!(
            grpc(Refusal::NoRoute, true),
            pairs(&[
                ("content-type", "application/grpc"),
                ("grpc-status", "12"),
                ("grpc-message", "no route"),
            ])
        );
    }

    #[test]
    fn bodies_too_large_are_413_as_http_for_grpc_too() {
        for grpc in [false, true] {
            let (status, headers, body) = http(Refusal::BodyTooLarge, grpc, Extra::default());
            assert_eq!(status, 413);
            assert_eq!(body, response::body_too_large());
            assert_eq!(headers, problem_headers(&body));
            let (status, headers, body) =
                http(Refusal::MeteredBodyTooLarge, grpc, Extra::default());
            assert_eq!(status, 413);
            assert_eq!(
                body,
                r#"{"detail":"a metered request's body is read for its bound, up to 1 MiB","status":413,"title":"Content Too Large","type":"about:blank"}"#
            );
            assert_eq!(headers, problem_headers(&body));
        }
    }

    #[test]
    fn auth_refusals_are_401_or_503_or_their_grpc_statuses() {
        let auth = |r: AuthRefusal| Refusal::Auth(Box::new(r));
        let (status, headers, body) = http(auth(AuthRefusal::Missing), false, Extra::default());
        assert_eq!(status, 401);
        assert_eq!(
            body,
            response::problem(
                401,
                "Unauthorized",
                "no credentials: send an API key or a bearer token"
            )
        );
        let mut expected = problem_headers(&body);
        expected.push(("www-authenticate".into(), "Bearer realm=\"sluice\"".into()));
        assert_eq!(headers, expected);

        let invalid = || auth(AuthRefusal::Invalid("bad signature".into()));
        let (status, headers, body) = http(invalid(), false, Extra::default());
        assert_eq!(status, 401);
        assert_eq!(
            body,
            response::problem(401, "Unauthorized", "bad signature")
        );
        let mut expected = problem_headers(&body);
        expected.push((
            "www-authenticate".into(),
            "Bearer realm=\"sluice\", error=\"invalid_token\"".into(),
        ));
        assert_eq!(headers, expected);

        let unavailable = || auth(AuthRefusal::Unavailable("no keys".into()));
        let (status, headers, body) = http(unavailable(), false, Extra::default());
        assert_eq!(status, 503);
        assert_eq!(
            body,
            response::problem(503, "Service Unavailable", "no keys")
        );
        assert_eq!(headers, problem_headers(&body));

        let status_of = |r: Refusal<'_>| {
            let h = grpc(r, true);
            (h[1].1.clone(), h[2].1.clone())
        };
        assert_eq!(
            status_of(auth(AuthRefusal::Missing)),
            ("16".into(), "no credentials".into())
        );
        assert_eq!(status_of(invalid()), ("16".into(), "bad signature".into()));
        assert_eq!(status_of(unavailable()), ("14".into(), "no keys".into()));
    }

    #[test]
    fn a_denial_has_its_status_retry_after_rate_headers_and_body() {
        let denied = |denial, reject| Refusal::Denied(Box::new(Denied { denial, reject }));
        let (status, headers, body) = http(denied(limited(), None), false, Extra::default());
        assert_eq!(status, 429);
        assert_eq!(
            body,
            r#"{"type":"https://iana.org/assignments/http-problem-types#quota-exceeded","title":"Too Many Requests","status":429,"violated-policies":["per_ip"]}"#
        );
        let length = body.len().to_string();
        assert_eq!(
            headers,
            pairs(&[
                ("content-type", response::PROBLEM),
                ("content-length", &length),
                ("ratelimit", "\"p\";r=0;t=1"),
                ("retry-after", "2"),
            ])
        );

        let reject = Some((b"slow down".to_vec(), "text/plain"));
        let (status, headers, body) = http(denied(limited(), reject), false, Extra::default());
        assert_eq!((status, body.as_str()), (429, "slow down"));
        assert_eq!(headers[0], ("content-type".into(), "text/plain".into()));
        assert_eq!(headers[1], ("content-length".into(), "9".into()));

        let (status, headers, body) =
            http(denied(Denial::BackendDown, None), false, Extra::default());
        assert_eq!(status, 503);
        assert_eq!(
            body,
            r#"{"type":"about:blank","title":"Service Unavailable","status":503,"detail":"rate limiter backend unavailable"}"#
        );
        let length = body.len().to_string();
        assert_eq!(
            headers,
            pairs(&[
                ("content-type", response::PROBLEM),
                ("content-length", &length),
                ("ratelimit", "\"p\";r=0;t=1"),
            ])
        );

        assert_eq!(
            grpc(denied(limited(), None), true),
            pairs(&[
                ("content-type", "application/grpc"),
                ("grpc-status", "8"),
                ("grpc-message", "rate limited: per_ip"),
                ("retry-after", "2"),
                ("ratelimit", "\"p\";r=0;t=1"),
            ])
        );
        let h = grpc(denied(Denial::BackendDown, None), true);
        assert_eq!(
            h[1..3],
            pairs(&[
                ("grpc-status", "14"),
                ("grpc-message", "rate limiter unavailable")
            ])
        );
    }

    #[test]
    fn a_routes_own_answers_carry_the_rate_headers() {
        let respond = Refusal::Respond {
            status: 200,
            content_type: "application/json",
            body: "{}",
        };
        for grpc in [false, true] {
            let (status, headers, body) = http(respond_again(&respond), grpc, Extra::default());
            assert_eq!((status, body.as_str()), (200, "{}"));
            assert_eq!(
                headers,
                pairs(&[
                    ("content-type", "application/json"),
                    ("content-length", "2"),
                    ("ratelimit", "\"p\";r=0;t=1"),
                ])
            );
        }
        let redirect = Refusal::Redirect {
            status: 301,
            location: "https://example.com/a?b".into(),
        };
        let (status, headers, body) = http(redirect, false, Extra::default());
        assert_eq!((status, body.as_str()), (301, ""));
        assert_eq!(
            headers,
            pairs(&[
                ("content-type", "text/plain"),
                ("content-length", "0"),
                ("ratelimit", "\"p\";r=0;t=1"),
                ("location", "https://example.com/a?b"),
            ])
        );
    }

    fn respond_again<'g>(r: &Refusal<'g>) -> Refusal<'g> {
        match r {
            Refusal::Respond {
                status,
                content_type,
                body,
            } => Refusal::Respond {
                status: *status,
                content_type,
                body,
            },
            _ => unreachable!("a respond"),
        }
    }

    #[test]
    fn the_routes_rules_come_first_and_the_request_id_last() {
        let rules = HeaderRules {
            set: vec![
                (
                    http::HeaderName::from_static("x-edge"),
                    http::HeaderValue::from_static("1"),
                ),
                (
                    http::HeaderName::from_static("retry-after"),
                    http::HeaderValue::from_static("99"),
                ),
            ],
            remove: vec![],
        };
        let name = http::HeaderName::from_static("x-request-id");
        let id = http::HeaderValue::from_static("abc");
        let extra = Extra {
            rules: Some(&rules),
            request_id: Some((&name, &id)),
        };
        let denied = Refusal::Denied(Box::new(Denied {
            denial: limited(),
            reject: None,
        }));
        let (_, headers, _) = http(denied, false, extra);
        let names: Vec<&str> = headers.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(
            names,
            [
                "x-edge",
                "retry-after",
                "content-type",
                "content-length",
                "ratelimit",
                "x-request-id"
            ]
        );
        // sluice's own Retry-After replaces the rule's.
        assert_eq!(headers[1].1, "2");
        let rendered = render(Refusal::NoRoute, true, true, extra, &[]).expect("rendered");
        let names: Vec<&str> = rendered.header.headers.keys().map(|n| n.as_str()).collect();
        assert_eq!(
            names,
            [
                "x-edge",
                "retry-after",
                "content-type",
                "grpc-status",
                "grpc-message",
                "x-request-id"
            ]
        );
    }

    #[test]
    fn a_failure_is_not_rendered() {
        let failed = Refusal::from(Error::new(ErrorType::InternalError));
        assert!(render(failed, false, false, Extra::default(), &[]).is_err());
    }
}
