//! The RLS listener is bounded (DESIGN §17), through the real binary: at most 100 concurrent
//! streams per connection (the 101st is refused, written as raw HTTP/2 frames, since a
//! client library would queue it), a request message of at most 64 KiB (a larger one, or a
//! gRPC prefix announcing one, is RESOURCE_EXHAUSTED at once), and `max_connections_per_ip`
//! closes an address's connections beyond the cap, as on the proxy listener.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;
#[path = "common/rls.rs"]
mod rls;

use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use rls::{framed, one, raw_call, RESOURCE_EXHAUSTED};
use sluice::rls::proto::{encode_request, Code, Response};

const RULES: &str = "domain: bounds
descriptors:
  - key: k
    rate_limit: {name: per_k, unit: year, requests_per_unit: 1000}
";

const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
const DATA: u8 = 0x0;
const HEADERS: u8 = 0x1;
const RST_STREAM: u8 = 0x3;
const SETTINGS: u8 = 0x4;
const GOAWAY: u8 = 0x7;
const END_STREAM: u8 = 0x1;
const END_HEADERS: u8 = 0x4;
const ACK: u8 = 0x1;
const SETTINGS_MAX_CONCURRENT_STREAMS: u16 = 0x3;
const REFUSED_STREAM: u32 = 0x7;

/// One HTTP/2 frame: its type, flags, stream and payload.
struct Frame {
    kind: u8,
    flags: u8,
    stream: u32,
    payload: Vec<u8>,
}

fn frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
    let len = payload.len() as u32;
    let mut out = len.to_be_bytes()[1..].to_vec();
    out.extend_from_slice(&[kind, flags]);
    out.extend_from_slice(&stream.to_be_bytes());
    out.extend_from_slice(payload);
    out
}

/// The request headers of a ShouldRateLimit call, as HPACK literals without indexing (so the
/// block means the same whatever was sent before it).
fn call_headers(stream: u32) -> Vec<u8> {
    let mut block = Vec::new();
    for (name, value) in [
        (":method", "POST"),
        (":scheme", "http"),
        (":path", rls::METHOD),
        (":authority", "rls"),
        ("content-type", "application/grpc"),
        ("te", "trailers"),
    ] {
        block.push(0);
        block.push(name.len() as u8);
        block.extend_from_slice(name.as_bytes());
        block.push(value.len() as u8);
        block.extend_from_slice(value.as_bytes());
    }
    frame(HEADERS, END_HEADERS, stream, &block)
}

/// A connection speaking HTTP/2 frame by frame.
struct Raw {
    tcp: TcpStream,
    /// The server's MAX_CONCURRENT_STREAMS, as its first SETTINGS said.
    max_streams: Option<u32>,
}

impl Raw {
    /// Connects, sends the preface and empty SETTINGS, and acknowledges the server's.
    fn open(addr: SocketAddr) -> Raw {
        let mut tcp = TcpStream::connect(addr).expect("connect");
        tcp.set_read_timeout(Some(Duration::from_secs(3)))
            .expect("timeout");
        tcp.write_all(PREFACE).expect("preface");
        tcp.write_all(&frame(SETTINGS, 0, 0, &[]))
            .expect("settings");
        let mut raw = Raw {
            tcp,
            max_streams: None,
        };
        loop {
            let f = raw.read().expect("the server's SETTINGS");
            if f.kind == SETTINGS && f.flags & ACK == 0 {
                for entry in f.payload.chunks_exact(6) {
                    let id = u16::from_be_bytes([entry[0], entry[1]]);
                    if id == SETTINGS_MAX_CONCURRENT_STREAMS {
                        raw.max_streams =
                            Some(u32::from_be_bytes([entry[2], entry[3], entry[4], entry[5]]));
                    }
                }
                raw.send(&frame(SETTINGS, ACK, 0, &[]));
                return raw;
            }
        }
    }

    fn send(&mut self, bytes: &[u8]) {
        self.tcp.write_all(bytes).expect("write");
    }

    /// The next frame; an error when the connection ends or nothing comes in time.
    fn read(&mut self) -> std::io::Result<Frame> {
        let mut head = [0u8; 9];
        self.tcp.read_exact(&mut head)?;
        let len = u32::from_be_bytes([0, head[0], head[1], head[2]]) as usize;
        let mut payload = vec![0; len];
        self.tcp.read_exact(&mut payload)?;
        Ok(Frame {
            kind: head[3],
            flags: head[4],
            stream: u32::from_be_bytes([head[5], head[6], head[7], head[8]]) & 0x7fff_ffff,
            payload,
        })
    }

    /// Reads frames until `wanted` says yes (that frame), or the connection fails.
    fn until(&mut self, mut wanted: impl FnMut(&Frame) -> bool) -> Frame {
        loop {
            let f = self.read().expect("the frame looked for");
            assert_ne!(
                f.kind,
                GOAWAY,
                "GOAWAY {:?} while waiting",
                f.payload.get(4..8)
            );
            if wanted(&f) {
                return f;
            }
        }
    }

    /// Sends a whole call's message on `stream` (opened) and ends it; returns when the
    /// answer's headers arrive.
    fn finish(&mut self, stream: u32, message: &[u8]) {
        self.send(&frame(DATA, END_STREAM, stream, &framed(message)));
        self.until(|f| f.kind == HEADERS && f.stream == stream);
    }
}

fn memory(server: &str) -> rls::RlsSluice {
    rls::start("backend = \"memory\"", server, RULES)
}

#[test]
fn the_101st_concurrent_stream_of_a_connection_is_refused() {
    let s = memory("body_timeout = \"10s\"");
    let mut c = Raw::open(s.rls);
    // 101 calls opened at once, none of them sending its message yet.
    let opened: Vec<u8> = (0..101u32).flat_map(|i| call_headers(1 + 2 * i)).collect();
    c.send(&opened);
    let refused = c.until(|f| f.kind == RST_STREAM);
    assert_eq!(refused.stream, 201, "the first stream refused");
    assert_eq!(
        u32::from_be_bytes(refused.payload[..4].try_into().expect("error code")),
        REFUSED_STREAM
    );
    // The connection goes on: the open calls are answered, and once one has ended another
    // stream may open.
    let message = encode_request(&one("bounds", "k", "a", None));
    c.finish(1, &message);
    c.send(&call_headers(203));
    c.finish(203, &message);
    assert!(s.sluice.child_alive());
    assert_eq!(c.max_streams, Some(100), "SETTINGS_MAX_CONCURRENT_STREAMS");
}

/// A request message of `len` bytes: a valid request, padded with an unknown field.
fn message_of(len: usize) -> Vec<u8> {
    let mut m = encode_request(&one("bounds", "k", "big", None));
    let pad = len - m.len() - 4;
    assert!((1 << 14..1 << 21).contains(&pad), "a 3-byte length");
    m.push((15 << 3) | 2);
    m.extend_from_slice(&[
        (pad as u8) | 0x80,
        ((pad >> 7) as u8) | 0x80,
        (pad >> 14) as u8,
    ]);
    m.resize(len, b'x');
    m
}

#[test]
fn a_message_over_64_kib_is_resource_exhausted_without_waiting_for_it() {
    let s = memory("body_timeout = \"3s\"");
    // 64 KiB exactly is a request like any other.
    let (code, answer) = raw_call(s.rls, framed(&message_of(64 * 1024)), true);
    assert_eq!(code, 0);
    let answer = Response::decode(&answer.expect("a message")).expect("an answer");
    assert_eq!(answer.overall_code, Code::Ok);
    // One byte more, sent whole.
    let (code, _) = raw_call(s.rls, framed(&message_of(64 * 1024 + 1)), true);
    assert_eq!(code, RESOURCE_EXHAUSTED);
    let (code, _) = raw_call(s.rls, framed(&message_of(65 * 1024)), true);
    assert_eq!(code, RESOURCE_EXHAUSTED);
    // Only the prefix of a 65 KiB message, the stream left open: refused on the prefix,
    // not after waiting for bytes that would not be kept.
    let started = Instant::now();
    let mut prefix = vec![0];
    prefix.extend_from_slice(&(65u32 * 1024).to_be_bytes());
    let (code, _) = raw_call(s.rls, prefix, false);
    assert_eq!(code, RESOURCE_EXHAUSTED);
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "waited for the body"
    );
    // Still serving.
    let (code, _) = raw_call(s.rls, framed(&message_of(1 << 15)), true);
    assert_eq!(code, 0);
}

/// Whether the server closes a new connection without a frame (within a second).
fn closed_at_once(addr: SocketAddr) -> bool {
    let mut tcp = TcpStream::connect(addr).expect("connect");
    tcp.set_read_timeout(Some(Duration::from_secs(1)))
        .expect("timeout");
    let _ = tcp.write_all(PREFACE);
    let _ = tcp.write_all(&frame(SETTINGS, 0, 0, &[]));
    let mut buf = [0u8; 64];
    match tcp.read(&mut buf) {
        Ok(0) => true,
        Ok(_) => false,
        Err(e) => matches!(
            e.kind(),
            ErrorKind::ConnectionReset | ErrorKind::ConnectionAborted | ErrorKind::BrokenPipe
        ),
    }
}

#[test]
fn connections_beyond_max_connections_per_ip_are_closed_and_counted() {
    let s = memory("max_connections_per_ip = 2");
    let mut held = vec![Raw::open(s.rls), Raw::open(s.rls)];
    assert!(closed_at_once(s.rls), "a third connection was served");
    assert_eq!(
        s.sluice
            .metric(r#"sluice_connections_rejected_total{reason="per_ip"}"#),
        1.0
    );
    // The held connections still work; closing one frees its slot.
    let message = encode_request(&one("bounds", "k", "c", None));
    held[0].send(&call_headers(1));
    held[0].finish(1, &message);
    drop(held.pop());
    assert!(
        s.sluice
            .wait_for(Duration::from_secs(2), || !closed_at_once(s.rls)),
        "the closed connection's slot was not freed"
    );
}
