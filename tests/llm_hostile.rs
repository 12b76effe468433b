//! LLM token budgets against a client that wants around them (DESIGN §17, §12), through the
//! real binary, in front of an upstream that behaves as OpenAI does: usage in a stream only
//! when the request asks for it (`stream_options.include_usage`), and a gzipped answer when
//! the request accepts gzip. The client hangs up mid-stream, asks for gzip, leaves usage
//! out, and sends large bodies; the upstream also compresses when nobody asked. Requests are
//! raw bytes, answers are read as bytes.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::http::Listening;
use common::{Sluice, TempDir};
use serde_json::Value;

const TOKEN: &str = "t0ken-for-llm-hostile";

/// One request as the upstream read it (a Content-Length or chunked body).
#[derive(Debug, Clone)]
struct Seen {
    headers: Vec<(String, String)>,
    body: Vec<u8>,
}

impl Seen {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }
}

/// An OpenAI-like upstream. The request steers it:
/// - `"stream": true` in the JSON body: an SSE stream of `x-words` content chunks (default
///   4), with the usage chunk (`choices: []`) only when `stream_options.include_usage` is
///   true, then `data: [DONE]`; else a whole `chat.completion` with its usage;
/// - `x-tokens: N`: the usage it reports (`total_tokens`);
/// - `x-gap-ms: M`: the pause between the chunks it writes (default 5);
/// - `Accept-Encoding` listing gzip: the answer is gzipped, as OpenAI's edge does;
///   `x-encode: gzip|deflate|raw-deflate|br|zstd`: encoded so whatever was asked.
///
/// Every answer says what it sent: `x-sent-fnv`, the FNV-1a hash of its body's bytes as
/// written (encoded, before chunked framing).
struct OpenAi {
    addr: SocketAddr,
    seen: Arc<Mutex<Vec<Seen>>>,
    _listening: Listening,
}

impl OpenAi {
    fn start() -> OpenAi {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let seen = Arc::new(Mutex::new(Vec::new()));
        let log = seen.clone();
        let listening = Listening::serve(listener, move |conn| {
            let mut reader = BufReader::new(conn.try_clone().unwrap());
            let mut conn = conn;
            while let Some(req) = read_request(&mut reader) {
                log.lock().unwrap().push(req.clone());
                if !answer(&mut conn, &req) || req.header("connection") == Some("close") {
                    return;
                }
            }
        });
        OpenAi {
            addr: listening.addr,
            seen,
            _listening: listening,
        }
    }

    fn seen(&self) -> Vec<Seen> {
        self.seen.lock().unwrap().clone()
    }

    fn last(&self) -> Seen {
        self.seen().pop().expect("the upstream got a request")
    }
}

fn read_request(reader: &mut impl BufRead) -> Option<Seen> {
    let mut line = String::new();
    if reader.read_line(&mut line).ok()? == 0 {
        return None;
    }
    let mut headers = Vec::new();
    loop {
        let mut h = String::new();
        if reader.read_line(&mut h).ok()? == 0 {
            return None;
        }
        let h = h.trim_end();
        if h.is_empty() {
            break;
        }
        let (k, v) = h.split_once(':')?;
        headers.push((k.trim().to_ascii_lowercase(), v.trim().to_owned()));
    }
    let find = |name: &str| {
        headers
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.clone())
    };
    let mut body = Vec::new();
    if find("transfer-encoding").is_some_and(|t| t.contains("chunked")) {
        loop {
            let mut size = String::new();
            reader.read_line(&mut size).ok()?;
            let n = usize::from_str_radix(size.trim(), 16).ok()?;
            let mut chunk = vec![0; n + 2];
            reader.read_exact(&mut chunk).ok()?;
            if n == 0 {
                break;
            }
            body.extend_from_slice(&chunk[..n]);
        }
    } else if let Some(n) = find("content-length") {
        body = vec![0; n.parse().ok()?];
        reader.read_exact(&mut body).ok()?;
    }
    Some(Seen { headers, body })
}

fn answer(conn: &mut TcpStream, req: &Seen) -> bool {
    let json: Value = serde_json::from_slice(&req.body).unwrap_or(Value::Null);
    let stream = json.get("stream") == Some(&Value::Bool(true));
    let include_usage = json.pointer("/stream_options/include_usage") == Some(&Value::Bool(true));
    let tokens: u64 = req.header("x-tokens").map_or(0, |t| t.parse().unwrap());
    let words: usize = req.header("x-words").map_or(4, |w| w.parse().unwrap());
    let gap = Duration::from_millis(req.header("x-gap-ms").map_or(5, |g| g.parse().unwrap()));
    let accepts_gzip = req
        .header("accept-encoding")
        .is_some_and(|a| a.contains("gzip"));
    let coding = req.header("x-encode").or(accepts_gzip.then_some("gzip"));
    let (prompt, completion) = (tokens / 4, tokens - tokens / 4);
    let usage = format!(
        r#"{{"prompt_tokens":{prompt},"completion_tokens":{completion},"total_tokens":{tokens}}}"#
    );
    let (content_type, events) = if stream {
        let mut events: Vec<String> = (0..words)
            .map(|i| {
                let usage_null = if include_usage { r#","usage":null"# } else { "" };
                format!(
                    "data: {{\"id\":\"c\",\"object\":\"chat.completion.chunk\",\"choices\":[{{\"index\":0,\"delta\":{{\"content\":\"word{i} \"}}}}]{usage_null}}}\n\n"
                )
            })
            .collect();
        if include_usage {
            events.push(format!(
                "data: {{\"id\":\"c\",\"object\":\"chat.completion.chunk\",\"choices\":[],\"usage\":{usage}}}\n\n"
            ));
        }
        events.push("data: [DONE]\n\n".into());
        ("text/event-stream", events)
    } else {
        let whole = format!(
            r#"{{"id":"c","object":"chat.completion","choices":[{{"index":0,"message":{{"role":"assistant","content":"Hello \"usage\" there"}}}}],"usage":{usage}}}"#
        );
        ("application/json", vec![whole])
    };
    let mut head = format!("HTTP/1.1 200 OK\r\nContent-Type: {content_type}\r\n");
    // What is written: each event as it comes, or the encoded whole in three pieces.
    let pieces: Vec<Vec<u8>> = match coding {
        None => events.into_iter().map(String::into_bytes).collect(),
        Some(coding) => {
            let encoded = encode(events.concat().as_bytes(), coding);
            let name = if coding == "raw-deflate" {
                "deflate"
            } else {
                coding
            };
            head.push_str(&format!("Content-Encoding: {name}\r\n"));
            let (a, b) = (encoded.len() / 3, encoded.len() * 2 / 3);
            vec![
                encoded[..a].to_vec(),
                encoded[a..b].to_vec(),
                encoded[b..].to_vec(),
            ]
        }
    };
    head.push_str(&format!("x-sent-fnv: {}\r\n", fnv(&pieces.concat())));
    if !stream {
        let body = pieces.concat();
        head.push_str(&format!("Content-Length: {}\r\n\r\n", body.len()));
        return conn.write_all(head.as_bytes()).is_ok() && conn.write_all(&body).is_ok();
    }
    head.push_str("Transfer-Encoding: chunked\r\n\r\n");
    if conn.write_all(head.as_bytes()).is_err() {
        return false;
    }
    for piece in pieces.iter().filter(|p| !p.is_empty()) {
        std::thread::sleep(gap);
        let mut chunk = format!("{:x}\r\n", piece.len()).into_bytes();
        chunk.extend_from_slice(piece);
        chunk.extend_from_slice(b"\r\n");
        if conn.write_all(&chunk).is_err() {
            return false;
        }
    }
    conn.write_all(b"0\r\n\r\n").is_ok()
}

fn encode(text: &[u8], coding: &str) -> Vec<u8> {
    use flate2::write::{DeflateEncoder, GzEncoder, ZlibEncoder};
    use flate2::Compression;
    match coding {
        "gzip" => {
            let mut e = GzEncoder::new(Vec::new(), Compression::default());
            e.write_all(text).unwrap();
            e.finish().unwrap()
        }
        "deflate" => {
            let mut e = ZlibEncoder::new(Vec::new(), Compression::default());
            e.write_all(text).unwrap();
            e.finish().unwrap()
        }
        "raw-deflate" => {
            let mut e = DeflateEncoder::new(Vec::new(), Compression::default());
            e.write_all(text).unwrap();
            e.finish().unwrap()
        }
        "br" => {
            let mut out = Vec::new();
            {
                let mut w = brotli::CompressorWriter::new(&mut out, 4096, 5, 22);
                w.write_all(text).unwrap();
            }
            out
        }
        "zstd" => zstd::stream::encode_all(text, 3).unwrap(),
        other => panic!("no coding {other}"),
    }
}

fn fnv(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf29ce484222325, |h, &b| {
        (h ^ b as u64).wrapping_mul(0x100000001b3)
    })
}

/// An answer as bytes: status, lower-case headers, the body de-chunked.
struct Reply {
    status: u16,
    headers: Vec<(String, String)>,
    body: Vec<u8>,
}

impl Reply {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }

    fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }
}

fn parse_reply(raw: &[u8]) -> Reply {
    let end = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .unwrap_or_else(|| panic!("no header end in {:?}", String::from_utf8_lossy(raw)));
    let head = String::from_utf8_lossy(&raw[..end]).into_owned();
    let mut lines = head.lines();
    let status = lines
        .next()
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let headers: Vec<(String, String)> = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_owned()))
        .collect();
    let mut rest = &raw[end + 4..];
    let chunked = headers
        .iter()
        .any(|(k, v)| k == "transfer-encoding" && v.contains("chunked"));
    let body = if chunked {
        let mut body = Vec::new();
        loop {
            let line_end = rest.windows(2).position(|w| w == b"\r\n").unwrap();
            let size = std::str::from_utf8(&rest[..line_end]).unwrap();
            let n = usize::from_str_radix(size.trim(), 16).unwrap();
            if n == 0 {
                break;
            }
            body.extend_from_slice(&rest[line_end + 2..line_end + 2 + n]);
            rest = &rest[line_end + 2 + n + 2..];
        }
        body
    } else {
        rest.to_vec()
    };
    Reply {
        status,
        headers,
        body,
    }
}

/// Sends `raw` (a request that closes) and reads the whole answer.
fn exchange(addr: SocketAddr, raw: &[u8]) -> Reply {
    let mut conn = TcpStream::connect(addr).unwrap();
    conn.set_read_timeout(Some(Duration::from_secs(15)))
        .unwrap();
    conn.write_all(raw).unwrap();
    let mut out = Vec::new();
    conn.read_to_end(&mut out).unwrap();
    parse_reply(&out)
}

/// A POST of `body` with a Content-Length, for `x-customer: acme`, closing.
fn post_raw(path: &str, headers: &[(&str, &str)], body: &[u8]) -> Vec<u8> {
    let mut raw = format!("POST {path} HTTP/1.1\r\nHost: llm.example\r\nx-customer: acme\r\n");
    for (k, v) in headers {
        raw.push_str(&format!("{k}: {v}\r\n"));
    }
    raw.push_str(&format!(
        "Content-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    ));
    let mut raw = raw.into_bytes();
    raw.extend_from_slice(body);
    raw
}

fn post(addr: SocketAddr, path: &str, headers: &[(&str, &str)], body: &[u8]) -> Reply {
    exchange(addr, &post_raw(path, headers, body))
}

/// 100 tokens an hour per customer, 30 held per request (`/v1/`); and a large budget that
/// holds each request's own bound (`/bounded/`, `reserve = "request"`).
fn config(upstream: SocketAddr, token_file: &str) -> String {
    format!(
        "[server]\nlisten = [\"{{listen}}\"]\nh2c = true\naccess_log = \"off\"\n\
         [admin]\nlisten = \"{{admin}}\"\ntoken_file = \"{token_file}\"\n\
         [limiter]\nbackend = \"memory\"\n\
         [upstreams.llm]\nservers = [\"{upstream}\"]\n\
         [policies.tokens]\nalgorithm = \"token_bucket\"\nlimit = 100\nperiod = \"1h\"\n\
         key = [\"header:x-customer\"]\ncost = {{ usage = \"openai\" }}\nreserve = 30\n\
         [policies.bounded]\nalgorithm = \"token_bucket\"\nlimit = 1000000\nperiod = \"1h\"\n\
         key = [\"header:x-customer\"]\ncost = {{ usage = \"openai\" }}\nreserve = \"request\"\nmax_reserve = 500\n\
         [[routes]]\nname = \"chat\"\npath_prefix = \"/v1/\"\nupstream = \"llm\"\npolicies = [\"tokens\"]\n\
         [[routes]]\nname = \"bounded\"\npath_prefix = \"/bounded/\"\nupstream = \"llm\"\npolicies = [\"bounded\"]\n"
    )
}

struct Setup {
    llm: OpenAi,
    s: Sluice,
    _dir: TempDir,
}

fn setup() -> Setup {
    let llm = OpenAi::start();
    let dir = TempDir::new();
    let token_file = dir.0.join("token");
    std::fs::write(&token_file, format!("{TOKEN}\n")).unwrap();
    let s = Sluice::start(&config(llm.addr, &token_file.display().to_string()));
    Setup { llm, s, _dir: dir }
}

const CHAT: &str = "/v1/chat/completions";

/// `remaining` of `policy`'s key `acme`, read through the admin API (no charge).
fn remaining(s: &Sluice, policy: &str) -> u64 {
    let auth = format!("Bearer {TOKEN}");
    let r = common::http::get(
        s.admin,
        &format!("/v1/quota/{policy}?key=acme"),
        &[("Authorization", &auth)],
    );
    assert_eq!(r.status, 200, "{}", r.body);
    let quota: Value = serde_json::from_str(&r.body).unwrap();
    quota["remaining"].as_u64().unwrap()
}

fn units(s: &Sluice, policy: &str, route: &str, kind: &str) -> f64 {
    s.metric(&format!(
        "sluice_policy_units_total{{kind=\"{kind}\",policy=\"{policy}\",route=\"{route}\"}}"
    ))
}

/// Waits until `n` responses of `/v1/` have been settled (each reserves 30).
fn settled(s: &Sluice, n: u64) {
    assert!(
        s.wait_for(Duration::from_secs(5), || units(
            s, "tokens", "chat", "reserved"
        ) == (30 * n) as f64),
        "{} settled, not {n}",
        units(s, "tokens", "chat", "reserved") / 30.0
    );
}

fn chat_body(stream: bool, extra: &str) -> String {
    format!(
        r#"{{"model":"gpt-4o-mini","stream":{stream}{extra},"messages":[{{"role":"user","content":"hi"}}]}}"#
    )
}

#[test]
fn a_client_that_hangs_up_after_the_first_event_keeps_the_reservation() {
    let Setup { s, _dir, llm: _llm } = setup();
    assert_eq!(remaining(&s, "tokens"), 100);
    let body = chat_body(true, r#","stream_options":{"include_usage":true}"#);
    let mut conn = TcpStream::connect(s.addr).unwrap();
    conn.set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    conn.write_all(&post_raw(
        CHAT,
        &[("x-tokens", "40"), ("x-gap-ms", "200"), ("x-words", "20")],
        body.as_bytes(),
    ))
    .unwrap();
    let mut reader = BufReader::new(conn);
    let mut line = String::new();
    let mut status = String::new();
    reader.read_line(&mut status).unwrap();
    assert!(status.starts_with("HTTP/1.1 200"), "{status}");
    while !line.starts_with("data: ") {
        line.clear();
        assert!(reader.read_line(&mut line).unwrap() > 0, "no event came");
    }
    // The first event is in; the client goes away while the upstream goes on.
    drop(reader);
    settled(&s, 1);
    assert_eq!(units(&s, "tokens", "chat", "charged"), 30.0);
    assert_eq!(units(&s, "tokens", "chat", "refunded"), 0.0);
    assert_eq!(
        remaining(&s, "tokens"),
        70,
        "the 30 held stay charged: the upstream answered 200 and kept generating"
    );
}

#[test]
fn a_client_that_asks_for_gzip_cannot_hide_its_usage() {
    let Setup { llm, s, _dir } = setup();
    for (n, stream) in [(1, false), (2, true)] {
        let extra = if stream {
            r#","stream_options":{"include_usage":true}"#
        } else {
            ""
        };
        let r = post(
            s.addr,
            CHAT,
            &[("x-tokens", "40"), ("Accept-Encoding", "gzip, br;q=0.9")],
            chat_body(stream, extra).as_bytes(),
        );
        assert_eq!(r.status, 200, "{}", r.text());
        let seen = llm.last();
        assert_eq!(
            seen.header("accept-encoding"),
            Some("identity"),
            "the upstream is asked for an unencoded answer: {:?}",
            seen.headers
        );
        assert_eq!(r.header("content-encoding"), None);
        assert!(r.text().contains("\"total_tokens\":40"), "{}", r.text());
        settled(&s, n);
        assert_eq!(
            units(&s, "tokens", "chat", "charged"),
            40.0 * n as f64,
            "stream={stream}"
        );
    }
    assert!(llm
        .seen()
        .iter()
        .all(|r| r.header("accept-encoding") == Some("identity")));
}

#[test]
fn an_upstream_that_encodes_anyway_is_read_through_its_encoding() {
    let Setup { s, _dir, llm: _llm } = setup();
    let mut n = 0;
    let mut charged = 0;
    for coding in ["gzip", "deflate", "raw-deflate", "br", "zstd"] {
        // Whole, streamed, and streamed long enough that the usage lies past 64 KiB of text.
        for (stream, words, tokens) in [(false, 4, 11), (true, 4, 12), (true, 3000, 13)] {
            let extra = if stream {
                r#","stream_options":{"include_usage":true}"#
            } else {
                ""
            };
            let words = words.to_string();
            let tokens_text = tokens.to_string();
            let r = post(
                s.addr,
                CHAT,
                &[
                    ("x-tokens", &tokens_text),
                    ("x-encode", coding),
                    ("x-words", &words),
                    ("x-gap-ms", "1"),
                ],
                chat_body(stream, extra).as_bytes(),
            );
            let what = format!("{coding} stream={stream} words={words}");
            assert_eq!(r.status, 200, "{what}");
            let name = if coding == "raw-deflate" {
                "deflate"
            } else {
                coding
            };
            assert_eq!(r.header("content-encoding"), Some(name), "{what}");
            assert_eq!(
                r.header("x-sent-fnv"),
                Some(fnv(&r.body).to_string().as_str()),
                "{what}: the client gets the bytes the upstream sent"
            );
            n += 1;
            charged += tokens;
            // Each is settled before the next is sent: 30 held by each would not fit.
            settled(&s, n);
            assert_eq!(
                units(&s, "tokens", "chat", "charged"),
                charged as f64,
                "{what}: its usage is charged exactly"
            );
            // Give the key its tokens back for the next one.
            reset(&s, "tokens");
        }
    }
}

fn reset(s: &Sluice, policy: &str) {
    let auth = format!("Bearer {TOKEN}");
    let r = common::http::request(
        s.admin,
        "DELETE",
        &format!("/v1/quota/{policy}?key=acme"),
        &[("Authorization", &auth)],
        "",
    );
    assert_eq!(r.status, 204, "{}", r.body);
}

#[test]
fn a_stream_that_does_not_ask_for_usage_is_sent_asking_for_it() {
    let Setup { llm, s, _dir } = setup();
    let bodies = [
        // No stream_options at all.
        chat_body(true, ""),
        // Asked, but not for usage; its other option is kept.
        chat_body(true, r#","stream_options":{"include_obfuscation":false}"#),
        chat_body(true, r#","stream_options":{"include_usage":false}"#),
        chat_body(true, r#","stream_options":null"#),
        // The last of two keys is the one a server reads.
        chat_body(
            true,
            r#","stream_options":{"include_usage":true},"stream_options":{"include_usage":false}"#,
        ),
        // "stream" spelled with an escape, after a false one.
        r#"{"stream":false,"model":"m","str\u0065am":true,"messages":[]}"#.to_owned(),
        // Whitespace everywhere JSON allows it.
        " \r\n\t{ \"stream\" :\ttrue , \"model\" : \"m\" , \"messages\" : [ ] } \n".to_owned(),
    ];
    for (i, body) in bodies.iter().enumerate() {
        let r = post(s.addr, CHAT, &[("x-tokens", "40")], body.as_bytes());
        assert_eq!(r.status, 200, "{body}: {}", r.text());
        let text = r.text();
        assert!(
            text.contains(r#""choices":[],"usage":{"prompt_tokens":10,"completion_tokens":30,"total_tokens":40}"#),
            "{body}: the usage chunk reaches the client as sent: {text}"
        );
        assert!(text.ends_with("data: [DONE]\n\n"), "{text}");
        let seen: Value = serde_json::from_slice(&llm.last().body).unwrap();
        assert_eq!(
            seen.pointer("/stream_options/include_usage"),
            Some(&Value::Bool(true)),
            "{body}"
        );
        if i == 1 {
            assert_eq!(
                seen.pointer("/stream_options/include_obfuscation"),
                Some(&Value::Bool(false))
            );
        }
        // Everything else arrives as the client sent it (the last of repeated keys, as
        // the upstream reads them).
        let sent: Value = serde_json::from_str(body).unwrap();
        for (key, value) in sent.as_object().unwrap() {
            if key != "stream_options" {
                assert_eq!(&seen[key], value, "{body}: {key}");
            }
        }
        settled(&s, i as u64 + 1);
        assert_eq!(
            units(&s, "tokens", "chat", "charged"),
            40.0 * (i + 1) as f64,
            "{body}: charged its real usage"
        );
        reset(&s, "tokens");
    }
    // A chunked body (its length unknown until it ends) is asked for usage too.
    let body = chat_body(true, "");
    let (a, b) = body.split_at(body.len() / 2);
    let raw = format!(
        "POST {CHAT} HTTP/1.1\r\nHost: llm.example\r\nx-customer: acme\r\nx-tokens: 40\r\n\
         Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n\
         {:x}\r\n{a}\r\n{:x}\r\n{b}\r\n0\r\n\r\n",
        a.len(),
        b.len()
    );
    let r = exchange(s.addr, raw.as_bytes());
    assert_eq!(r.status, 200, "{}", r.text());
    assert!(r.text().contains("\"total_tokens\":40"), "{}", r.text());
    let seen: Value = serde_json::from_slice(&llm.last().body).unwrap();
    assert_eq!(
        seen.pointer("/stream_options/include_usage"),
        Some(&Value::Bool(true))
    );
    settled(&s, bodies.len() as u64 + 1);
    assert_eq!(
        units(&s, "tokens", "chat", "charged"),
        40.0 * (bodies.len() + 1) as f64
    );
}

#[test]
fn bodies_that_need_nothing_added_reach_the_upstream_byte_for_byte() {
    let Setup { llm, s, _dir } = setup();
    let bodies: [&[u8]; 5] = [
        br#"{"model":"m","stream":false,"messages":[]}"#,
        br#"{"model":"m","stream":true,"stream_options":{"include_usage":true},"messages":[]}"#,
        b"model=m&stream=true",
        b"{\"stream\":true, \"broken\": ",
        b"[{\"stream\":true}]",
    ];
    for body in bodies {
        let r = post(s.addr, CHAT, &[("x-tokens", "5")], body);
        assert_eq!(r.status, 200);
        let seen = llm.last();
        assert_eq!(seen.body, body, "{}", String::from_utf8_lossy(body));
        assert_eq!(
            seen.header("content-length"),
            Some(body.len().to_string().as_str())
        );
    }
}

/// An empty chunked body on a metered route is held until it ends (DESIGN §17) and then
/// framed once (§21): one last-chunk, never a second that a keep-alive upstream would read
/// as the start of another request.
#[test]
fn an_empty_chunked_body_reaches_the_upstream_with_one_last_chunk() {
    let Setup { llm, s, _dir } = setup();
    for (path, chunks) in [(CHAT, "0\r\n\r\n"), (CHAT, "2\r\n{}\r\n0\r\n\r\n")] {
        let before = llm.seen().len();
        let raw = format!(
            "POST {path} HTTP/1.1\r\nHost: llm.example\r\nx-customer: acme\r\nx-tokens: 1\r\n\
             Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\
             Connection: close\r\n\r\n{chunks}"
        );
        let r = exchange(s.addr, raw.as_bytes());
        assert_eq!(r.status, 200, "{path} {chunks:?}");
        std::thread::sleep(Duration::from_millis(300));
        let seen = llm.seen();
        assert_eq!(
            seen.len(),
            before + 1,
            "{path} {chunks:?}: the upstream read {} requests: {:?}",
            seen.len() - before,
            &seen[before..]
        );
    }
    // Where the body's bound is reserved, one of unknown length is refused (DESIGN §21).
    let before = llm.seen().len();
    let raw = "POST /bounded/x HTTP/1.1\r\nHost: llm.example\r\nx-customer: acme\r\n\
               Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n0\r\n\r\n";
    assert_eq!(exchange(s.addr, raw.as_bytes()).status, 411);
    assert_eq!(llm.seen().len(), before);
}

#[test]
fn a_200_kib_body_is_read_for_its_bound_and_sent_on_whole() {
    let Setup { llm, s, _dir } = setup();
    let content = "lorem ipsum ".repeat(200 * 1024 / 12);
    let body = format!(
        r#"{{"model":"m","max_tokens":300,"messages":[{{"role":"user","content":"{content}"}}]}}"#
    );
    assert!(body.len() > 200 * 1024);
    let r = post(
        s.addr,
        "/bounded/v1/chat/completions",
        &[("x-tokens", "7")],
        body.as_bytes(),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    let held = body.len() as u64 / 4 + 300;
    let ratelimit = r.header("ratelimit").unwrap();
    assert!(
        ratelimit.contains(&format!("r={}", 1_000_000 - held)),
        "the body's own bound ({held}) is held: {ratelimit}"
    );
    let seen = llm.last();
    assert_eq!(seen.body.len(), body.len());
    assert!(
        seen.body == body.as_bytes(),
        "the upstream got the body as sent"
    );

    // The same size streamed without include_usage: read whole, re-framed with the option.
    let body = format!(
        r#"{{"model":"m","stream":true,"max_tokens":300,"messages":[{{"role":"user","content":"{content}"}}]}}"#
    );
    let r = post(
        s.addr,
        "/bounded/v1/chat/completions",
        &[("x-tokens", "9")],
        body.as_bytes(),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    assert!(r.text().contains("\"total_tokens\":9"), "{}", r.text());
    let seen = llm.last();
    assert_eq!(
        seen.header("content-length"),
        Some(seen.body.len().to_string().as_str())
    );
    let json: Value = serde_json::from_slice(&seen.body).unwrap();
    assert_eq!(json["messages"][0]["content"], content.as_str());
    assert_eq!(
        json.pointer("/stream_options/include_usage"),
        Some(&Value::Bool(true))
    );
    assert!(s.wait_for(Duration::from_secs(5), || units(
        &s, "bounded", "bounded", "charged"
    ) == 16.0));

    // Two such requests on one connection: each body ends where its length says.
    let mut conn = TcpStream::connect(s.addr).unwrap();
    conn.set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    let mut raw = post_raw(
        "/bounded/v1/chat/completions",
        &[("x-tokens", "1")],
        body.as_bytes(),
    );
    let keep =
        String::from_utf8_lossy(&raw).replacen("Connection: close", "Connection: keep-alive", 1);
    raw = keep.into_bytes();
    raw.extend_from_slice(&post_raw(
        "/bounded/v1/chat/completions",
        &[("x-tokens", "2")],
        br#"{"model":"m","max_tokens":3,"messages":[]}"#,
    ));
    conn.write_all(&raw).unwrap();
    let mut out = Vec::new();
    conn.read_to_end(&mut out).unwrap();
    let text = String::from_utf8_lossy(&out);
    assert_eq!(text.matches("HTTP/1.1 200 OK").count(), 2, "{text}");
    assert!(text.contains("\"total_tokens\":2"), "{text}");
    let last = llm.last();
    assert_eq!(last.body, br#"{"model":"m","max_tokens":3,"messages":[]}"#);
}

/// curl over h2c (prior knowledge) posting `body` from a file (`Content-Length` sent) or
/// from stdin (no length: HTTP/2 DATA frames until END_STREAM). Answers the response text.
fn curl_h2(s: &Sluice, path: &str, tokens: &str, body: &[u8], with_length: bool) -> String {
    use std::process::{Command, Stdio};
    let dir = TempDir::new();
    let file = dir.0.join("body.json");
    std::fs::write(&file, body).unwrap();
    // `--data-binary @file` sends the file's length; `-T -` streams stdin without one.
    let (flag, data) = if with_length {
        ("--data-binary", format!("@{}", file.display()))
    } else {
        ("-T", "-".to_owned())
    };
    let mut curl = Command::new("curl")
        .args(["-s", "-i", "--max-time", "10", "--http2-prior-knowledge"])
        .args([
            "-H",
            "x-customer: acme",
            "-H",
            "content-type: application/json",
        ])
        .args([
            "-X",
            "POST",
            "-H",
            &format!("x-tokens: {tokens}"),
            flag,
            &data,
        ])
        .arg(format!("http://{}{path}", s.addr))
        .stdin(if with_length {
            Stdio::null()
        } else {
            Stdio::piped()
        })
        .stdout(Stdio::piped())
        .spawn()
        .expect("curl with HTTP/2 is needed: apt-get install curl");
    if let Some(mut stdin) = curl.stdin.take() {
        stdin.write_all(body).unwrap();
    }
    let out = curl.wait_with_output().unwrap();
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[test]
fn over_http2_a_body_is_read_whole_with_or_without_its_length() {
    let Setup { llm, s, _dir } = setup();
    let content = "lorem ipsum ".repeat(200 * 1024 / 12);
    let body = format!(
        r#"{{"model":"m","max_tokens":300,"messages":[{{"role":"user","content":"{content}"}}]}}"#
    );
    let text = curl_h2(
        &s,
        "/bounded/v1/chat/completions",
        "7",
        body.as_bytes(),
        true,
    );
    assert!(text.starts_with("HTTP/2 200"), "{text}");
    let held = body.len() as u64 / 4 + 300;
    assert!(
        text.contains(&format!("r={}", 1_000_000 - held)),
        "the body's own bound ({held}) is held: {text}"
    );
    let seen = llm.last();
    assert_eq!(
        seen.header("content-length"),
        Some(body.len().to_string().as_str())
    );
    assert!(seen.body == body.as_bytes(), "sent on as it came");

    // Without a length, a stream request is held until it ends, then asked for usage.
    let body = chat_body(true, "");
    let text = curl_h2(&s, CHAT, "40", body.as_bytes(), false);
    assert!(text.starts_with("HTTP/2 200"), "{text}");
    assert!(text.contains("\"total_tokens\":40"), "{text}");
    let seen = llm.last();
    assert_eq!(
        seen.header("transfer-encoding"),
        Some("chunked"),
        "{:?}",
        seen.headers
    );
    let json: Value = serde_json::from_slice(&seen.body).unwrap();
    assert_eq!(
        json.pointer("/stream_options/include_usage"),
        Some(&Value::Bool(true))
    );
    settled(&s, 1);
    assert_eq!(units(&s, "tokens", "chat", "charged"), 40.0);
}

#[test]
fn a_client_that_expects_100_continue_is_told_to_send_its_body() {
    let Setup { llm, s, _dir } = setup();
    let body = chat_body(true, "");
    let raw = format!(
        "POST {CHAT} HTTP/1.1\r\nHost: llm.example\r\nx-customer: acme\r\nx-tokens: 40\r\n\
         Expect: 100-continue\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    let mut conn = TcpStream::connect(s.addr).unwrap();
    conn.set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    conn.write_all(raw.as_bytes()).unwrap();
    // The body is read by sluice (to ask for usage): sluice says to go on.
    let mut head = Vec::new();
    let mut byte = [0u8];
    while !head.ends_with(b"\r\n\r\n") {
        conn.read_exact(&mut byte).expect("a 100 Continue");
        head.push(byte[0]);
    }
    assert!(head.starts_with(b"HTTP/1.1 100"), "{head:?}");
    conn.write_all(body.as_bytes()).unwrap();
    let mut rest = Vec::new();
    conn.read_to_end(&mut rest).unwrap();
    let r = parse_reply(&rest);
    assert_eq!(r.status, 200, "{}", r.text());
    assert!(r.text().contains("\"total_tokens\":40"), "{}", r.text());
    assert_eq!(llm.last().header("expect"), None, "the body has come whole");
}

#[test]
fn a_body_over_1_mib_is_refused_before_the_upstream() {
    let Setup { llm, s, _dir } = setup();
    // Padding past what is read cannot hide a stream from being asked for usage. (Its
    // head and first bytes: sluice answers without reading the rest.)
    let raw = format!(
        "POST {CHAT} HTTP/1.1\r\nHost: llm.example\r\nx-customer: acme\r\nx-tokens: 40\r\n\
         Content-Length: {}\r\n\r\n{{\"model\":\"m\",\"stream\":true,    ",
        (1 << 20) + 1
    );
    let r = exchange(s.addr, raw.as_bytes());
    assert_eq!(r.status, 413, "{}", r.text());
    assert!(llm.seen().is_empty(), "refused before the upstream");
    assert_eq!(
        units(&s, "tokens", "chat", "reserved"),
        0.0,
        "and before any charge"
    );
}
