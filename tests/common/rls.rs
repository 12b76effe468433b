//! A sluice serving Envoy's rate limit service (DESIGN §13) on given rules, and a raw gRPC
//! client for it (h2 and `sluice::rls::proto`). Not a module of `common`: the tests that need
//! it include it by path (`#[path = "common/rls.rs"] mod rls;`), beside `mod common;`.
#![allow(dead_code)]

use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use bytes::Bytes;
use sluice::rls::proto::{encode_request, Descriptor, Request, Response};

use crate::common::{free_port, Sluice, TempDir};

pub const METHOD: &str = "/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit";

/// gRPC status codes the tests look for.
pub const INVALID_ARGUMENT: u32 = 3;
pub const DEADLINE_EXCEEDED: u32 = 4;
pub const RESOURCE_EXHAUSTED: u32 = 8;

/// A sluice with `[rls]` on its ratelimit YAML files; the admin token is `t0ken`.
pub struct RlsSluice {
    pub sluice: Sluice,
    pub rls: SocketAddr,
    /// The directory of the YAML files (`[rls] config` reads `*.yaml` there) and the token.
    pub rules: TempDir,
}

/// Starts sluice with `limiter` as its `[limiter]` table, `server` as extra `[server]` lines
/// and `rules` as its one ratelimit YAML file; waits until the RLS listener accepts.
pub fn start(limiter: &str, server: &str, rules: &str) -> RlsSluice {
    start_with(limiter, server, &[("rules.yaml", rules)])
}

/// `start` with several YAML files, each (file name, text).
pub fn start_with(limiter: &str, server: &str, files: &[(&str, &str)]) -> RlsSluice {
    let dir = TempDir::new();
    for (name, text) in files {
        std::fs::write(dir.0.join(name), text).expect("write rules");
    }
    std::fs::write(dir.0.join("token"), "t0ken\n").expect("write token");
    let rls: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().expect("addr");
    let template = format!(
        "[server]\nlisten = [\"{{listen}}\"]\nthreads = 1\naccess_log = \"off\"\n{server}\n\
         [admin]\nlisten = \"{{admin}}\"\ntoken_file = \"{0}/token\"\n\
         [limiter]\n{limiter}\n[rls]\nlisten = \"{rls}\"\nconfig = [\"{0}/*.yaml\"]\n\
         [[routes]]\nname = \"hello\"\npath = \"/hello\"\nrespond = {{ status = 200 }}\n",
        dir.0.display()
    );
    let sluice = Sluice::start(&template);
    let deadline = Instant::now() + Duration::from_secs(10);
    while TcpStream::connect(rls).is_err() {
        assert!(Instant::now() < deadline, "the rls listener did not open");
        std::thread::sleep(Duration::from_millis(20));
    }
    RlsSluice {
        sluice,
        rls,
        rules: dir,
    }
}

/// A request of `domain` with one descriptor `key=value` and its own `hits_addend`.
pub fn one(domain: &str, key: &str, value: &str, hits: Option<u64>) -> Request {
    Request {
        domain: domain.into(),
        descriptors: vec![Descriptor {
            entries: vec![(key.into(), value.into())],
            limit: None,
            hits_addend: hits,
        }],
        hits_addend: 0,
    }
}

/// A gRPC frame: the uncompressed flag, the length, the message.
pub fn framed(message: &[u8]) -> Vec<u8> {
    let mut out = vec![0];
    out.extend_from_slice(&(message.len() as u32).to_be_bytes());
    out.extend_from_slice(message);
    out
}

/// One unary call sending `body` (framed or not) and then ending the stream, or leaving it
/// open when `end` is false: the gRPC status and the message, if any.
pub fn raw_call(addr: SocketAddr, body: Vec<u8>, end: bool) -> (u32, Option<Vec<u8>>) {
    raw_call_to(addr, METHOD, body, end)
}

/// `raw_call` to the gRPC method `path`.
pub fn raw_call_to(
    addr: SocketAddr,
    path: &str,
    body: Vec<u8>,
    end: bool,
) -> (u32, Option<Vec<u8>>) {
    let path = path.to_owned();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(async move {
        let tcp = connect(addr).await;
        let (mut client, conn) = h2::client::handshake(tcp).await.expect("h2 handshake");
        tokio::spawn(conn);
        let req = ::http::Request::builder()
            .method("POST")
            .uri(format!("http://{addr}{path}"))
            .header("content-type", "application/grpc")
            .header("te", "trailers")
            .body(())
            .expect("request");
        let (resp, mut send) = client.send_request(req, false).expect("send");
        send.send_data(Bytes::from(body), end).expect("body");
        let resp = resp.await.expect("response");
        let status_of = |h: &::http::HeaderMap| {
            h.get("grpc-status")
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.parse::<u32>().ok())
        };
        if let Some(code) = status_of(resp.headers()) {
            return (code, None);
        }
        let mut body = resp.into_body();
        let mut bytes = Vec::new();
        while let Some(chunk) = body.data().await {
            let chunk = chunk.expect("data");
            let _ = body.flow_control().release_capacity(chunk.len());
            bytes.extend_from_slice(&chunk);
        }
        let trailers = body
            .trailers()
            .await
            .expect("trailers")
            .expect("grpc-status");
        let code = status_of(&trailers).expect("grpc-status");
        assert!(bytes.len() >= 5, "a framed message");
        drop(send);
        (code, Some(bytes[5..].to_vec()))
    })
}

/// A connection to `addr`, tried again for up to 5 s: after thousands of short calls the
/// machine can run out of ports, and nothing is sent before it connects.
async fn connect(addr: SocketAddr) -> tokio::net::TcpStream {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        match tokio::net::TcpStream::connect(addr).await {
            Ok(tcp) => return tcp,
            Err(_) if Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(25)).await;
            }
            Err(e) => panic!("connect to {addr}: {e}"),
        }
    }
}

/// ShouldRateLimit with the message `message`: the answer, or the gRPC status it failed with.
pub fn call_bytes(addr: SocketAddr, message: &[u8]) -> Result<Response, u32> {
    match raw_call(addr, framed(message), true) {
        (0, Some(bytes)) => Ok(Response::decode(&bytes).expect("a valid answer")),
        (code, _) => Err(code),
    }
}

/// ShouldRateLimit: the answer, or the gRPC status it failed with.
pub fn call(addr: SocketAddr, req: &Request) -> Result<Response, u32> {
    call_bytes(addr, &encode_request(req))
}
