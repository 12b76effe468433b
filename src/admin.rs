//! The admin listener: /metrics, /healthz, /readyz.

use std::sync::Arc;

use async_trait::async_trait;
use http::Response;
use pingora::apps::http_app::ServeHttp;
use pingora::protocols::http::ServerSession;

use crate::gateway::App;

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

#[async_trait]
impl ServeHttp for Admin {
    async fn response(&self, session: &mut ServerSession) -> Response<Vec<u8>> {
        let path = session.req_header().uri.path().to_owned();
        match path.as_str() {
            "/metrics" => {
                // Sizes are read at scrape time rather than tracked on every change.
                let gateway = self.app.current.load_full();
                let m = &self.app.metrics;
                m.memory_keys.set(gateway.limiter.memory_keys() as i64);
                m.deny_cache_entries
                    .set(gateway.limiter.deny_cache_entries() as i64);
                reply(200, "text/plain; version=0.0.4", m.render())
            }
            "/healthz" => reply(200, "text/plain", b"ok\n".to_vec()),
            "/readyz" => {
                let gateway = self.app.current.load_full();
                if gateway.limiter.ready().await {
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
