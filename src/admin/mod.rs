//! The admin listener: /metrics, /healthz, /readyz, the `/v1/` API (`api`) and the operator
//! console (`console`): routing, bearer-token auth, problem+json errors and counting here, the
//! handlers in `api`, `consumers` and `summary`.

mod api;
mod console;
mod consumers;
mod summary;

use std::sync::Arc;

use async_trait::async_trait;
use http::{Method, Response};
use pingora::apps::http_app::ServeHttp;
use pingora::protocols::http::ServerSession;
use subtle::ConstantTimeEq;

use crate::gateway::App;

/// The largest `/v1/` request body read.
const MAX_BODY: usize = 64 * 1024;

pub struct Admin {
    pub app: Arc<App>,
}

fn reply(status: u16, content_type: &str, body: Vec<u8>) -> Response<Vec<u8>> {
    Response::builder()
        .status(status)
        .header("Content-Type", content_type)
        .header("Content-Length", body.len())
        .body(body)
        .unwrap_or_default()
}

/// A `/v1/` answer before it is written: a status and a JSON body (none for 204).
pub struct Answer {
    status: u16,
    body: Option<serde_json::Value>,
    problem: bool,
}

impl Answer {
    pub fn json(status: u16, body: serde_json::Value) -> Answer {
        Answer {
            status,
            body: Some(body),
            problem: false,
        }
    }

    pub fn empty() -> Answer {
        Answer {
            status: 204,
            body: None,
            problem: false,
        }
    }

    /// An RFC 9457 problem.
    pub fn problem(status: u16, title: &str, detail: impl Into<String>) -> Answer {
        Answer {
            status,
            body: Some(serde_json::json!({
                "type": "about:blank",
                "title": title,
                "status": status,
                "detail": detail.into(),
            })),
            problem: true,
        }
    }

    fn into_response(self) -> Response<Vec<u8>> {
        match self.body {
            None => Response::builder()
                .status(self.status)
                .body(Vec::new())
                .unwrap_or_default(),
            Some(body) => {
                let mut text = serde_json::to_vec_pretty(&body).unwrap_or_default();
                text.push(b'\n');
                let kind = if self.problem {
                    "application/problem+json"
                } else {
                    "application/json"
                };
                let mut r = reply(self.status, kind, text);
                if self.status == 401 {
                    r.headers_mut().insert(
                        "WWW-Authenticate",
                        http::HeaderValue::from_static("Bearer realm=\"sluice admin\""),
                    );
                }
                r
            }
        }
    }
}

/// One `/v1/` call as the handlers see it.
pub struct Call {
    pub method: Method,
    /// Path segments after `/v1/`.
    pub segments: Vec<String>,
    /// Query parameters in order (percent-decoded).
    pub query: Vec<(String, String)>,
    pub body: Vec<u8>,
    /// The caller's address, for the change log.
    pub caller: String,
}

impl Call {
    pub fn all(&self, name: &str) -> Vec<String> {
        self.query
            .iter()
            .filter(|(k, _)| k == name)
            .map(|(_, v)| v.clone())
            .collect()
    }

    pub fn first(&self, name: &str) -> Option<&str> {
        self.query
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }
}

fn decode(s: &str) -> String {
    let plus = s.replace('+', " ");
    percent_encoding::percent_decode_str(&plus)
        .decode_utf8_lossy()
        .into_owned()
}

fn parse_query(query: Option<&str>) -> Vec<(String, String)> {
    query
        .unwrap_or("")
        .split('&')
        .filter(|p| !p.is_empty())
        .map(|p| match p.split_once('=') {
            Some((k, v)) => (decode(k), decode(v)),
            None => (decode(p), String::new()),
        })
        .collect()
}

/// Whether `given` is the token, compared in constant time (the lengths aside).
fn token_matches(expected: &str, given: &str) -> bool {
    bool::from(expected.as_bytes().ct_eq(given.as_bytes()))
}

impl Admin {
    async fn v1(&self, session: &mut ServerSession, path: &str) -> Response<Vec<u8>> {
        let gateway = self.app.current.load_full();
        let req = session.req_header();
        let method = req.method.clone();
        let segments: Vec<String> = path
            .trim_start_matches("/v1/")
            .split('/')
            .map(decode)
            .collect();
        let endpoint = api::endpoint(&method, &segments);
        let authorization = req
            .headers
            .get(http::header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned);
        let query = parse_query(req.uri.query());
        let answer = match &gateway.config.admin.token {
            None => Answer::problem(
                403,
                "Forbidden",
                "the admin API is off: [admin] token_file is not set",
            ),
            Some(token) => {
                let given = authorization
                    .as_deref()
                    .and_then(|a| a.strip_prefix("Bearer "))
                    .map(str::trim);
                match given {
                    Some(given) if token_matches(&token.0, given) => {
                        let mut body = Vec::new();
                        let mut too_big = false;
                        while let Ok(Some(chunk)) = session.read_request_body().await {
                            body.extend_from_slice(&chunk);
                            if body.len() > MAX_BODY {
                                too_big = true;
                                break;
                            }
                        }
                        if too_big {
                            Answer::problem(413, "Payload Too Large", "at most 64KB")
                        } else {
                            let caller = session
                                .client_addr()
                                .map_or_else(|| "unknown".into(), |a| a.to_string());
                            let call = Call {
                                method,
                                segments,
                                query,
                                body,
                                caller,
                            };
                            match (&call.method, &call.segments[..]) {
                                (&Method::GET, [one]) if one == "summary" => {
                                    summary::summary(&self.app, &gateway)
                                }
                                _ => api::handle(&gateway, &call).await,
                            }
                        }
                    }
                    Some(_) => Answer::problem(401, "Unauthorized", "wrong bearer token"),
                    None => Answer::problem(
                        401,
                        "Unauthorized",
                        "missing `Authorization: Bearer <token>`",
                    ),
                }
            }
        };
        self.app
            .metrics
            .admin_requests
            .with_label_values(&[endpoint, &answer.status.to_string()])
            .inc();
        answer.into_response()
    }
}

#[async_trait]
impl ServeHttp for Admin {
    async fn response(&self, session: &mut ServerSession) -> Response<Vec<u8>> {
        let path = session.req_header().uri.path().to_owned();
        if path.starts_with("/v1/") {
            return self.v1(session, &path).await;
        }
        if let Some(page) = console::serve(&path) {
            return page;
        }
        match path.as_str() {
            "/metrics" => {
                // Sizes are read at scrape time rather than tracked on every change.
                let gateway = self.app.current.load_full();
                let m = &self.app.metrics;
                m.memory_keys.set(gateway.limiter.memory_keys() as i64);
                // Runtime consumers change through any instance of a fleet.
                m.consumers
                    .with_label_values(&["runtime"])
                    .set(gateway.limiter.runtime_consumers().len() as i64);
                m.deny_cache_entries
                    .set(gateway.limiter.deny_cache_entries() as i64);
                crate::upstream::publish_adaptive(&gateway.upstreams, m);
                reply(200, "text/plain; version=0.0.4", m.render())
            }
            "/healthz" => reply(200, "text/plain", b"ok\n".to_vec()),
            "/readyz" => {
                let gateway = self.app.current.load_full();
                if !gateway.auth.ready() {
                    let body = "a jwks_url has not been fetched yet\n";
                    reply(503, "text/plain", body.as_bytes().to_vec())
                } else if gateway.limiter.ready().await {
                    reply(200, "text/plain", b"ready\n".to_vec())
                } else {
                    let body = format!(
                        "limiter backend {} unreachable\n",
                        gateway.limiter.backend_name()
                    );
                    reply(503, "text/plain", body.into_bytes())
                }
            }
            _ => reply(404, "text/plain", b"not found\n".to_vec()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn queries_decode_and_tokens_compare_whole() {
        assert_eq!(
            parse_query(Some("key=203.0.113.9&key=a%20b+c&n=5")),
            vec![
                ("key".into(), "203.0.113.9".into()),
                ("key".into(), "a b c".into()),
                ("n".into(), "5".into())
            ]
        );
        assert!(token_matches("s3cret", "s3cret"));
        assert!(!token_matches("s3cret", "s3cre"));
        assert!(!token_matches("s3cret", "s3cret!"));
    }
}
