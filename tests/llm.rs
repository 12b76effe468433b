//! LLM token budgets (DESIGN §12 `cost = { usage = … }`) through the real binary, against
//! upstreams written for the test that answer as OpenAI, Anthropic and Gemini do: whole
//! JSON bodies and Server-Sent-Events streams with events spaced in time, one that cuts
//! its stream before the usage, one that fails with 5xx. The tokens a response reports
//! are charged exactly; a stream reaches the client event by event; a fleet on Redis never
//! grants more than the limit.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use common::http::{self, Request, Scripted};
use common::redis::{RedisCluster, RedisServer};
use common::Sluice;

/// An LLM-style upstream (`llm()`). The request says what to answer:
/// - the path picks the format: `…/openai/…`, `…/anthropic/…`, `…/gemini/…`;
/// - `"stream": true` in the JSON body (or `alt=sse` for Gemini) asks for SSE;
/// - `x-tokens: N`: the usage to report (input 1/4 of it, output the rest);
/// - `x-cached: C` (Anthropic): C more input tokens, half written to the prompt cache and
///   half read from it (`cache_creation_input_tokens`, `cache_read_input_tokens`);
/// - `x-gap-ms: M`: the pause between events (default 20);
/// - `x-cut: 1`: the stream stops before its usage, the connection closed mid-body;
/// - `x-linger-ms: M`: after the last event, SSE comments every 50 ms for M ms before the
///   body ends (an upstream slow to end a stream the client has already read whole);
/// - `x-fail: 1`: a 503 with an error body and no usage.
///
/// It honours the body's output bound and `n` as the real ones do: no more output than
/// `n` x the bound (`max_completion_tokens`, `max_tokens`, `max_output_tokens`,
/// `generationConfig.maxOutputTokens`), and says which bound it read in `x-bound`.
///
/// Every whole answer says what body it got: `x-body-sum`, the sum of its bytes.
fn llm() -> Scripted {
    Scripted::start(answer)
}

/// Answers one request; false when the connection must end.
fn answer(conn: &mut TcpStream, req: &Request) -> bool {
    let tokens: u64 = req.header("x-tokens").map_or(0, |t| t.parse().unwrap());
    let gap = Duration::from_millis(req.header("x-gap-ms").map_or(20, |g| g.parse().unwrap()));
    let body = String::from_utf8_lossy(&req.body);
    let stream = body.contains("\"stream\":true") || req.target.contains("alt=sse");
    if req.header("x-fail").is_some() {
        let error = r#"{"error":{"message":"overloaded","type":"server_error"}}"#;
        let resp = format!(
            "HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{error}",
            error.len()
        );
        return conn.write_all(resp.as_bytes()).is_ok();
    }
    let (input, output) = (tokens / 4, tokens - tokens / 4);
    let (bound, n) = bound_and_n(&req.body);
    let output = bound.map_or(output, |b| output.min(b * n));
    let tokens = input + output;
    let bound = bound.map_or("none".to_owned(), |b| b.to_string());
    let cached: u64 = req.header("x-cached").map_or(0, |c| c.parse().unwrap());
    let cache = format!(
        "\"cache_creation_input_tokens\":{},\"cache_read_input_tokens\":{},",
        cached / 2,
        cached - cached / 2
    );
    let format = ["openai", "anthropic", "gemini"]
        .into_iter()
        .find(|f| req.target.contains(&format!("/{f}/")))
        .unwrap_or("");
    let sum = body_sum(&req.body);
    if !stream {
        let whole = match format {
            "openai" => format!(
                r#"{{"id":"c","object":"chat.completion","choices":[{{"index":0,"message":{{"role":"assistant","content":"Hello \"usage\" there"}}}}],"usage":{{"prompt_tokens":{input},"completion_tokens":{output},"total_tokens":{tokens}}}}}"#
            ),
            "anthropic" => format!(
                r#"{{"id":"m","type":"message","content":[{{"type":"text","text":"Hello"}}],"usage":{{"input_tokens":{input},{cache}"output_tokens":{output}}}}}"#
            ),
            _ => format!(
                r#"{{"candidates":[{{"content":{{"parts":[{{"text":"Hello"}}]}}}}],"usageMetadata":{{"promptTokenCount":{input},"candidatesTokenCount":{output},"totalTokenCount":{tokens}}}}}"#
            ),
        };
        let resp = format!(
            "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nx-body-sum: {sum}\r\nx-bound: {bound}\r\nContent-Length: {}\r\n\r\n{whole}",
            whole.len()
        );
        return conn.write_all(resp.as_bytes()).is_ok();
    }
    let mut events: Vec<String> = Vec::new();
    match format {
        "openai" => {
            for word in ["Hel", "lo", " wor", "ld"] {
                events.push(format!(
                    "data: {{\"choices\":[{{\"delta\":{{\"content\":\"{word}\"}}}}],\"usage\":null}}\n\n"
                ));
            }
            events.push(format!(
                "data: {{\"choices\":[],\"usage\":{{\"prompt_tokens\":{input},\"completion_tokens\":{output},\"total_tokens\":{tokens}}}}}\n\n"
            ));
            events.push("data: [DONE]\n\n".into());
        }
        "anthropic" => {
            events.push(format!(
                "event: message_start\ndata: {{\"type\":\"message_start\",\"message\":{{\"id\":\"m\",\"usage\":{{\"input_tokens\":{input},{cache}\"output_tokens\":1}}}}}}\n\n"
            ));
            for word in ["Hel", "lo"] {
                events.push(format!(
                    "event: content_block_delta\ndata: {{\"type\":\"content_block_delta\",\"delta\":{{\"type\":\"text_delta\",\"text\":\"{word}\"}}}}\n\n"
                ));
            }
            // output_tokens is cumulative: the last one is the total.
            for part in [output / 2, output] {
                events.push(format!(
                    "event: message_delta\ndata: {{\"type\":\"message_delta\",\"usage\":{{\"output_tokens\":{part}}}}}\n\n"
                ));
            }
            events.push("event: message_stop\ndata: {\"type\":\"message_stop\"}\n\n".into());
        }
        _ => {
            // Gemini repeats usageMetadata; the last one counts.
            for (word, total) in [("Hel", tokens / 2), ("lo", tokens)] {
                events.push(format!(
                    "data: {{\"candidates\":[{{\"content\":{{\"parts\":[{{\"text\":\"{word}\"}}]}}}}],\"usageMetadata\":{{\"totalTokenCount\":{total}}}}}\r\n\r\n"
                ));
            }
        }
    }
    let cut = req.header("x-cut").is_some();
    if cut {
        // Only the first events: the usage never comes.
        events.truncate(2);
    }
    let head = "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-cache\r\nTransfer-Encoding: chunked\r\n\r\n";
    if conn.write_all(head.as_bytes()).is_err() {
        return false;
    }
    for event in &events {
        std::thread::sleep(gap);
        let chunk = format!("{:x}\r\n{event}\r\n", event.len());
        if conn.write_all(chunk.as_bytes()).is_err() {
            return false;
        }
    }
    if cut {
        // Closed without the last chunk: the body did not end.
        let _ = conn.shutdown(std::net::Shutdown::Both);
        return false;
    }
    let linger: u64 = req.header("x-linger-ms").map_or(0, |m| m.parse().unwrap());
    for _ in 0..linger / 50 {
        std::thread::sleep(Duration::from_millis(50));
        if conn.write_all(b"c\r\n: keep-alive\r\n\r\n").is_err() {
            return false;
        }
    }
    conn.write_all(b"0\r\n\r\n").is_ok()
}

/// The output bound a request's JSON body sets, in any format's field, and its `n`.
fn bound_and_n(body: &[u8]) -> (Option<u64>, u64) {
    let json: serde_json::Value = serde_json::from_slice(body).unwrap_or_default();
    let bound = [
        "/max_completion_tokens",
        "/max_tokens",
        "/max_output_tokens",
        "/generationConfig/maxOutputTokens",
    ]
    .iter()
    .find_map(|p| json.pointer(p).and_then(serde_json::Value::as_u64));
    let n = json
        .get("n")
        .and_then(serde_json::Value::as_u64)
        .unwrap_or(1);
    (bound, n)
}

fn body_sum(body: &[u8]) -> u64 {
    body.iter().map(|&b| b as u64).sum()
}

/// Token budgets per customer: 1000 tokens an hour, 100 held per request.
fn config(upstream: SocketAddr, backend: &str) -> String {
    let mut c = format!(
        "[server]\nlisten = [\"{{listen}}\"]\n[admin]\nlisten = \"{{admin}}\"\n\
         [limiter]\n{backend}\n\
         [upstreams.llm]\nservers = [\"{upstream}\"]\n"
    );
    // Holds what the request's body allows it to cost.
    c.push_str(
        "[policies.bounded_tokens]\nalgorithm = \"token_bucket\"\nlimit = 1000\nperiod = \"1h\"\n\
         key = [\"header:x-customer\"]\ncost = { usage = \"openai\" }\nreserve = \"request\"\nmax_reserve = 500\n\
         [[routes]]\nname = \"bounded\"\npath_prefix = \"/bounded\"\nupstream = \"llm\"\npolicies = [\"bounded_tokens\"]\n",
    );
    // Anthropic's cache tokens weighed (DESIGN §21).
    c.push_str(
        "[policies.weighted_tokens]\nalgorithm = \"token_bucket\"\nlimit = 100000\nperiod = \"1h\"\n\
         key = [\"header:x-customer\"]\n\
         cost = { usage = \"anthropic\", weights = { cache_read = 0.1, cache_write = 1.25 } }\n\
         [[routes]]\nname = \"weighted\"\npath_prefix = \"/weighted\"\nupstream = \"llm\"\npolicies = [\"weighted_tokens\"]\n",
    );
    for format in ["openai", "anthropic", "gemini"] {
        c.push_str(&format!(
            "[policies.{format}_tokens]\nalgorithm = \"token_bucket\"\nlimit = 1000\nperiod = \"1h\"\n\
             key = [\"header:x-customer\"]\ncost = {{ usage = \"{format}\" }}\nreserve = 100\n\
             [[routes]]\nname = \"{format}\"\npath_prefix = \"/{format}\"\nupstream = \"llm\"\npolicies = [\"{format}_tokens\"]\n"
        ));
    }
    c
}

/// POSTs a chat request for `customer` to `path`; `headers` steer the upstream.
fn chat(
    addr: SocketAddr,
    path: &str,
    customer: &str,
    stream: bool,
    headers: &[(&str, &str)],
) -> http::Response {
    let body = format!(
        r#"{{"model":"m","stream":{stream},"messages":[{{"role":"user","content":"hi"}}]}}"#
    );
    let mut all = vec![
        ("x-customer", customer),
        ("content-type", "application/json"),
    ];
    all.extend_from_slice(headers);
    http::request(addr, "POST", path, &all, &body)
}

fn path(format: &str, stream: bool) -> &'static str {
    match (format, stream) {
        ("openai", _) => "/openai/v1/chat/completions",
        ("anthropic", _) => "/anthropic/v1/messages",
        (_, false) => "/gemini/v1beta/models/m:generateContent",
        (_, true) => "/gemini/v1beta/models/m:streamGenerateContent?alt=sse",
    }
}

/// `r` of the RateLimit header: what the key has left after this request's reservation.
fn remaining(r: &http::Response) -> u64 {
    let header = r.header("ratelimit").expect("a RateLimit header");
    let r = header.split(';').find_map(|p| p.strip_prefix("r="));
    r.and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no remaining in {header}"))
}

fn units(s: &Sluice, format: &str, kind: &str) -> f64 {
    s.metric(&format!(
        "sluice_policy_units_total{{kind=\"{kind}\",policy=\"{format}_tokens\",route=\"{format}\"}}"
    ))
}

#[test]
fn tokens_each_format_reports_are_charged_exactly_whole_and_streamed() {
    let llm = llm();
    let s = Sluice::start(&config(llm.addr, "backend = \"memory\""));
    for format in ["openai", "anthropic", "gemini"] {
        let mut spent = 0;
        for (stream, tokens) in [(false, 120), (true, 200), (false, 8), (true, 300)] {
            let r = chat(
                s.addr,
                path(format, stream),
                "acme",
                stream,
                &[("x-tokens", &tokens.to_string())],
            );
            assert_eq!(r.status, 200, "{format} stream={stream}: {}", r.body);
            if stream {
                assert!(r.body.contains("data: "), "{format}: {}", r.body);
            }
            spent += tokens;
        }
        assert_eq!(units(&s, format, "charged"), spent as f64, "{format}");
        assert_eq!(units(&s, format, "reserved"), 400.0, "{format}");
        // 628 of 1000 spent: the next request holds 100 and sees the rest.
        let r = chat(
            s.addr,
            path(format, false),
            "acme",
            false,
            &[("x-tokens", "100")],
        );
        assert_eq!(remaining(&r), 272, "{format}: {:?}", r.headers);
    }
    assert_eq!(llm.hits(), 15);
}

/// A client that reads the whole stream, usage and `[DONE]` included, and closes at once is
/// charged the usage it was sent, not its reservation (DESIGN §21), though the upstream's
/// body had not ended.
#[test]
fn a_client_that_closes_after_done_is_charged_its_usage() {
    let llm = llm();
    let s = Sluice::start(&config(llm.addr, "backend = \"memory\""));
    for round in 1..=3u64 {
        let body =
            r#"{"model":"m","stream":true,"stream_options":{"include_usage":true},"messages":[]}"#;
        let raw = format!(
            "POST {} HTTP/1.1\r\nHost: x\r\nx-customer: acme\r\nx-tokens: 40\r\nx-linger-ms: 1000\r\n\
             content-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
            path("openai", true),
            body.len()
        );
        let mut conn = std::net::TcpStream::connect(s.addr).unwrap();
        conn.set_read_timeout(Some(Duration::from_secs(10)))
            .unwrap();
        conn.write_all(raw.as_bytes()).unwrap();
        let mut seen = Vec::new();
        let mut buf = [0u8; 4096];
        while !String::from_utf8_lossy(&seen).contains("[DONE]") {
            let n = std::io::Read::read(&mut conn, &mut buf).unwrap();
            assert!(n > 0, "the stream ended before [DONE]");
            seen.extend_from_slice(&buf[..n]);
        }
        drop(conn);
        assert!(
            s.wait_for(Duration::from_secs(5), || units(&s, "openai", "charged")
                == (40 * round) as f64),
            "round {round}: charged {} (its usage is 40 a request, its reservation 100)",
            units(&s, "openai", "charged")
        );
    }
}

/// Anthropic's prompt cache: tokens written to it and read from it are input tokens, charged
/// like the rest (DESIGN §21), whole and streamed.
#[test]
fn anthropic_cached_prompt_tokens_are_charged() {
    let llm = llm();
    let s = Sluice::start(&config(llm.addr, "backend = \"memory\""));
    for (stream, cached) in [(false, 600), (true, 200)] {
        let headers = [
            ("x-tokens", "100"),
            ("x-cached", &cached.to_string() as &str),
        ];
        let r = chat(s.addr, path("anthropic", stream), "acme", stream, &headers);
        assert_eq!(r.status, 200, "stream={stream}: {}", r.body);
    }
    assert_eq!(units(&s, "anthropic", "charged"), 1000.0);
    // The budget is spent: the next request's reservation is refused.
    let r = chat(
        s.addr,
        path("anthropic", false),
        "acme",
        false,
        &[("x-tokens", "1")],
    );
    assert_eq!(r.status, 429, "{}", r.body);
    // Weighed: 300 read from the cache at 0.1 and 300 written at 1.25, rounded up, plus
    // the 100 uncached tokens.
    let headers = [("x-tokens", "100"), ("x-cached", "600")];
    for stream in [false, true] {
        let path = format!("/weighted{}", path("anthropic", stream));
        let r = chat(s.addr, &path, "acme", stream, &headers);
        assert_eq!(r.status, 200, "{}", r.body);
    }
    let charged =
        "sluice_policy_units_total{kind=\"charged\",policy=\"weighted_tokens\",route=\"weighted\"}";
    assert!(s.wait_for(Duration::from_secs(5), || s.metric(charged) >= 1010.0));
    assert_eq!(s.metric(charged), 2.0 * (100.0 + 30.0 + 375.0));
}

#[test]
fn a_debt_from_a_long_answer_delays_the_next_requests() {
    let llm = llm();
    let s = Sluice::start(&config(llm.addr, "backend = \"memory\""));
    // 100 held, 1500 spent: 500 past the budget.
    let r = chat(
        s.addr,
        path("anthropic", true),
        "acme",
        true,
        &[("x-tokens", "1500")],
    );
    assert_eq!(r.status, 200);
    let r = chat(
        s.addr,
        path("anthropic", true),
        "acme",
        true,
        &[("x-tokens", "10")],
    );
    assert_eq!(r.status, 429, "the debt must be paid first");
    // 600 tokens to refill (the debt and the 100 to hold) at 1000 an hour: 36 minutes.
    let retry: u64 = r.header("retry-after").unwrap().parse().unwrap();
    assert!((2_150..=2_160).contains(&retry), "retry-after {retry}");
    assert_eq!(
        chat(
            s.addr,
            path("anthropic", true),
            "other",
            true,
            &[("x-tokens", "10")]
        )
        .status,
        200
    );
}

#[test]
fn a_cut_stream_is_charged_its_reservation_and_a_5xx_refunded() {
    let llm = llm();
    let s = Sluice::start(&config(llm.addr, "backend = \"memory\""));
    let r = chat(
        s.addr,
        path("openai", true),
        "acme",
        true,
        &[("x-tokens", "400"), ("x-cut", "1")],
    );
    assert_eq!(r.status, 200, "the stream started");
    assert!(!r.body.contains("total_tokens"));
    let r = chat(
        s.addr,
        path("openai", false),
        "acme",
        false,
        &[("x-fail", "1")],
    );
    assert_eq!(r.status, 503);
    assert!(s.wait_for(Duration::from_secs(5), || {
        s.metric("sluice_response_cost_missing_total{policy=\"openai_tokens\",route=\"openai\"}")
            == 2.0
    }));
    assert_eq!(
        units(&s, "openai", "charged"),
        100.0,
        "the cut stream keeps its 100"
    );
    assert_eq!(
        units(&s, "openai", "refunded"),
        100.0,
        "the 503 gives its 100 back"
    );
    let r = chat(
        s.addr,
        path("openai", false),
        "acme",
        false,
        &[("x-tokens", "1")],
    );
    assert_eq!(remaining(&r), 800);
}

#[test]
fn a_stream_reaches_the_client_event_by_event() {
    let llm = llm();
    let s = Sluice::start(&config(llm.addr, "backend = \"memory\""));
    let mut conn = TcpStream::connect(s.addr).unwrap();
    conn.set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    let body = r#"{"model":"m","stream":true,"messages":[]}"#;
    let started = Instant::now();
    write!(
        conn,
        "POST /openai/v1/chat/completions HTTP/1.1\r\nHost: x\r\nx-customer: acme\r\nx-tokens: 50\r\n\
         x-gap-ms: 300\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut reader = BufReader::new(conn);
    let mut arrivals = Vec::new();
    let mut line = String::new();
    while reader.read_line(&mut line).unwrap_or(0) > 0 {
        if line.starts_with("data: ") {
            arrivals.push((started.elapsed(), line.clone()));
        }
        line.clear();
    }
    let mut rest = String::new();
    let _ = reader.read_to_string(&mut rest);
    assert_eq!(arrivals.len(), 6, "{arrivals:?}");
    let (first, last) = (arrivals[0].0, arrivals[5].0);
    assert!(
        first < Duration::from_millis(1_000),
        "first event at {first:?}"
    );
    assert!(
        last - first >= Duration::from_millis(1_200),
        "events arrived together: {arrivals:?}"
    );
    assert!(arrivals[4].1.contains("\"total_tokens\":50"));
    assert!(
        s.wait_for(Duration::from_secs(5), || units(&s, "openai", "charged")
            == 50.0)
    );
}

/// Three instances on one Redis: 30 requests at once, each holding 100 of the customer's
/// 1000 and spending exactly that; ten pass, twenty are refused, whatever instance
/// answered, and the fleet's charges add up to the limit.
fn fleet_never_grants_more_than_the_limit(backend: &str) {
    let llm = llm();
    let fleet: Vec<Sluice> = (0..3)
        .map(|_| Sluice::start(&config(llm.addr, backend)))
        .collect();
    let addrs: Vec<SocketAddr> = fleet.iter().map(|s| s.addr).collect();
    let answers: Vec<u16> = (0..30)
        .map(|i| {
            let addr = addrs[i % 3];
            std::thread::spawn(move || {
                chat(
                    addr,
                    path("openai", true),
                    "acme",
                    true,
                    &[("x-tokens", "100"), ("x-gap-ms", "50")],
                )
                .status
            })
        })
        .collect::<Vec<_>>()
        .into_iter()
        .map(|t| t.join().unwrap())
        .collect();
    assert_eq!(
        answers.iter().filter(|&&a| a == 200).count(),
        10,
        "{answers:?}"
    );
    assert_eq!(
        answers.iter().filter(|&&a| a == 429).count(),
        20,
        "{answers:?}"
    );
    assert_eq!(llm.hits(), 10);
    let charged: f64 = fleet.iter().map(|s| units(s, "openai", "charged")).sum();
    assert_eq!(charged, 1000.0);
    for s in &fleet {
        assert_eq!(
            chat(
                s.addr,
                path("openai", false),
                "acme",
                false,
                &[("x-tokens", "1")]
            )
            .status,
            429
        );
    }
}

#[test]
fn a_fleet_on_redis_never_grants_more_than_the_limit() {
    let redis = RedisServer::start();
    fleet_never_grants_more_than_the_limit(&format!(
        "backend = \"redis\"\nurl = \"{}\"\ntimeout = \"500ms\"",
        redis.url()
    ));
}

#[test]
fn a_fleet_on_a_redis_cluster_never_grants_more_than_the_limit() {
    let cluster = RedisCluster::start();
    let seeds: Vec<String> = cluster.seeds().iter().map(|s| format!("\"{s}\"")).collect();
    fleet_never_grants_more_than_the_limit(&format!(
        "backend = \"redis\"\ncluster = [{}]\ntimeout = \"500ms\"",
        seeds.join(", ")
    ));
}

#[test]
fn reserve_request_holds_the_bodys_own_bound_and_sends_the_body_on_unchanged() {
    let llm = llm();
    let s = Sluice::start(&config(llm.addr, "backend = \"memory\""));
    let send = |body: &str, tokens: &str| {
        let headers = [
            ("x-customer", "acme"),
            ("content-type", "application/json"),
            ("x-tokens", tokens),
        ];
        http::request(
            s.addr,
            "POST",
            "/bounded/openai/v1/chat/completions",
            &headers,
            body,
        )
    };
    // Bounded by max_tokens: its bytes / 4 + 200 held, then 30 charged.
    let body = format!(
        r#"{{"model":"m","max_tokens":200,"messages":[{{"role":"user","content":"{}"}}]}}"#,
        "hello ".repeat(100)
    );
    let held = body.len() as u64 / 4 + 200;
    let r = send(&body, "30");
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(remaining(&r), 1000 - held);
    assert_eq!(
        r.header("x-body-sum"),
        Some(body_sum(body.as_bytes()).to_string().as_str()),
        "the upstream got the body as sent"
    );
    assert!(s.wait_for(Duration::from_secs(5), || {
        s.metric("sluice_policy_units_total{kind=\"charged\",policy=\"bounded_tokens\",route=\"bounded\"}")
            == 30.0
    }));
    // No output bound in the body: max_reserve (500) is written into it as its bound.
    let unbounded = r#"{"model":"m","messages":[]}"#;
    let r = send(unbounded, "20");
    assert_eq!(r.status, 200);
    assert_eq!(
        remaining(&r),
        1000 - 30 - (unbounded.len() as u64 / 4 + 500)
    );
    assert_eq!(r.header("x-bound"), Some("500"));
    // A body over 1 MiB is refused before anything is charged or sent.
    let hits = llm.hits();
    // (Its head and first bytes: sluice answers without reading the rest.)
    let raw = format!(
        "POST /bounded/openai/v1/chat/completions HTTP/1.1\r\nHost: x\r\nx-customer: acme\r\n\
         Content-Length: {}\r\n\r\n{{\"max_tokens\":1,\"pad\":\"xxxx",
        (1 << 20) + 1
    );
    let r = http::parse(&http::send_raw(s.addr, raw.as_bytes()).unwrap());
    assert_eq!(r.status, 413);
    assert_eq!(llm.hits(), hits);
    // An upper bound over what is left is refused: 950 spent of 1000 once both settle.
    assert!(s.wait_for(Duration::from_secs(5), || {
        s.metric("sluice_policy_units_total{kind=\"charged\",policy=\"bounded_tokens\",route=\"bounded\"}")
            == 50.0
    }));
    let r = send(r#"{"model":"m","max_tokens":960,"messages":[]}"#, "1");
    assert_eq!(r.status, 429, "{}", r.body);
}

/// The bound held is the bound the upstream gets (DESIGN §21): a request that sets none is
/// sent with `max_reserve` as its output bound, so an upstream that would write 5,000
/// tokens writes no more than was held; one whose length is unknown before it ends cannot
/// be bounded before it is sent, and is refused with 411 before the upstream.
#[test]
fn a_request_without_a_bound_is_sent_with_the_one_it_holds() {
    let llm = llm();
    let s = Sluice::start(&config(llm.addr, "backend = \"memory\""));
    let body = r#"{"model":"m","messages":[{"role":"user","content":"write a lot"}]}"#;
    let headers = [
        ("x-customer", "acme"),
        ("content-type", "application/json"),
        ("x-tokens", "5000"),
    ];
    let path = "/bounded/openai/v1/chat/completions";
    let r = http::request(s.addr, "POST", path, &headers, body);
    assert_eq!(r.status, 200, "{}", r.body);
    let held = body.len() as u64 / 4 + 500;
    assert_eq!(remaining(&r), 1000 - held);
    assert_eq!(r.header("x-bound"), Some("500"), "the bound written");
    let charged =
        "sluice_policy_units_total{kind=\"charged\",policy=\"bounded_tokens\",route=\"bounded\"}";
    assert!(s.wait_for(Duration::from_secs(5), || s.metric(charged) > 0.0));
    // The upstream wrote what the bound allowed: 1,250 input + 500, not 5,000.
    assert_eq!(s.metric(charged), 1250.0 + 500.0);
    // Two answers of up to 500 each: 1,000 and more held, past what is left.
    let two = r#"{"model":"m","n":2,"messages":[]}"#;
    let r = http::request(s.addr, "POST", path, &headers, two);
    assert_eq!(r.status, 429, "{}", r.body);
    // A body whose length is known only at its end is refused before the upstream.
    let hits = llm.hits();
    let raw = format!(
        "POST {path} HTTP/1.1\r\nHost: x\r\nx-customer: acme\r\nx-tokens: 1\r\n\
         Transfer-Encoding: chunked\r\n\r\n{:x}\r\n{body}\r\n0\r\n\r\n",
        body.len()
    );
    let r = http::parse(&http::send_raw(s.addr, raw.as_bytes()).unwrap());
    assert_eq!(r.status, 411, "{}", r.body);
    assert!(r.body.contains("Content-Length"), "{}", r.body);
    assert_eq!(llm.hits(), hits);
}

/// Every output the request asks for is held (DESIGN §21): `n`, `best_of` and Gemini's
/// `candidateCount` multiply its bound; a bound or multiplier spelled as a lenient upstream
/// would still read it (`"40000"`, `4e4`, `40000.0`, twice) is 400 naming the field, and
/// nothing is charged or sent.
#[test]
fn reserve_request_holds_every_output_and_refuses_a_loose_bound() {
    let llm = llm();
    let s = Sluice::start(&config(llm.addr, "backend = \"memory\""));
    let send = |body: &str| {
        let headers = [
            ("x-customer", "acme"),
            ("content-type", "application/json"),
            ("x-tokens", "1"),
        ];
        http::request(
            s.addr,
            "POST",
            "/bounded/openai/v1/chat/completions",
            &headers,
            body,
        )
    };
    // 50 answers of up to 400 tokens: 20,000 and more, past the budget of 1,000.
    let r = send(r#"{"model":"m","n":50,"max_tokens":400,"stream":true,"messages":[]}"#);
    assert_eq!(r.status, 429, "{}", r.body);
    let r = send(r#"{"model":"m","best_of":3,"max_tokens":400,"messages":[]}"#);
    assert_eq!(r.status, 429, "{}", r.body);
    // One answer of 400 fits.
    let r = send(r#"{"model":"m","n":1,"max_tokens":400,"messages":[]}"#);
    assert_eq!(r.status, 200, "{}", r.body);
    let hits = llm.hits();
    for (body, field) in [
        (
            r#"{"model":"m","max_tokens":"40000","messages":[]}"#,
            "max_tokens",
        ),
        (
            r#"{"model":"m","max_tokens":4e4,"messages":[]}"#,
            "max_tokens",
        ),
        (
            r#"{"model":"m","max_tokens":40000.0,"messages":[]}"#,
            "max_tokens",
        ),
        (
            r#"{"model":"m","max_tokens":1,"max_tokens":40000,"messages":[]}"#,
            "max_tokens",
        ),
        (
            r#"{"model":"m","n":"50","max_tokens":1,"messages":[]}"#,
            "n",
        ),
    ] {
        let r = send(body);
        assert_eq!(r.status, 400, "{body}: {}", r.body);
        assert_eq!(r.header("content-type"), Some("application/problem+json"));
        assert!(r.body.contains(&format!("`{field}`")), "{body}: {}", r.body);
    }
    assert_eq!(llm.hits(), hits, "a refused body reached the upstream");
}
