//! WebSocket through the real binary: messages both ways after the upstream's 101, and a
//! `concurrency` slot held for a session's whole life (renewed past `lease`), on the memory
//! and Redis backends, and reclaimed after `lease` when the instance holding it dies.
//!
//! The upstream is Debian's python3-websockets (`tests/ws_upstream.py`); the client is a
//! small RFC 6455 client over a plain TcpStream, below: masked text frames, pings, close.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::process::{Child, Command};
use std::time::{Duration, Instant};

use base64::Engine;
use common::redis::RedisServer;
use common::{Sluice, TempDir};

/// The WebSocket upstream, killed on drop.
struct Upstream {
    child: Child,
    port: u16,
    _dir: TempDir,
}

impl Upstream {
    fn start() -> Upstream {
        let dir = TempDir::new();
        let portfile = dir.0.join("port");
        let mut child = Command::new(common::python_with_websockets("the WebSocket upstream"))
            .arg(concat!(env!("CARGO_MANIFEST_DIR"), "/tests/ws_upstream.py"))
            .arg(&portfile)
            .spawn()
            .expect("python3 for the WebSocket upstream");
        let deadline = Instant::now() + Duration::from_secs(10);
        while !portfile.exists() {
            if let Ok(Some(status)) = child.try_wait() {
                panic!("tests/ws_upstream.py exited ({status})");
            }
            assert!(
                Instant::now() < deadline,
                "WebSocket upstream did not start"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        let port = std::fs::read_to_string(&portfile)
            .expect("port file")
            .trim()
            .parse()
            .expect("a port number");
        Upstream {
            child,
            port,
            _dir: dir,
        }
    }
}

impl Drop for Upstream {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// What the handshake came back with when it was not a 101.
#[derive(Debug)]
struct Refused {
    status: u16,
    head: String,
    body: String,
}

/// One client session (RFC 6455), after a successful handshake.
struct Session {
    reader: BufReader<TcpStream>,
    stream: TcpStream,
}

const GUID: &str = "258EAFA5-E914-47DA-95CA-C5AB0DC85B11";

impl Session {
    /// Opens a session on `path` as user `user` (the `x-user` header the policy keys on).
    fn open(addr: SocketAddr, path: &str, user: &str) -> Result<Session, Refused> {
        let stream = TcpStream::connect(addr).expect("connect to sluice");
        stream
            .set_read_timeout(Some(Duration::from_secs(10)))
            .expect("read timeout");
        let key = base64::engine::general_purpose::STANDARD.encode(rand_bytes());
        let request = format!(
            "GET {path} HTTP/1.1\r\nHost: ws.test\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\
             Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\nx-user: {user}\r\n\r\n"
        );
        (&stream)
            .write_all(request.as_bytes())
            .expect("send handshake");
        let mut reader = BufReader::new(stream.try_clone().expect("clone stream"));
        let mut head = String::new();
        loop {
            let mut line = String::new();
            let n = reader.read_line(&mut line).expect("read response head");
            assert!(n > 0, "connection closed during the handshake: {head:?}");
            head.push_str(&line);
            if line == "\r\n" {
                break;
            }
        }
        let status: u16 = head
            .split_whitespace()
            .nth(1)
            .and_then(|s| s.parse().ok())
            .expect("a status line");
        let header = |name: &str| {
            head.lines().find_map(|l| {
                let (n, v) = l.split_once(':')?;
                n.trim()
                    .eq_ignore_ascii_case(name)
                    .then(|| v.trim().to_owned())
            })
        };
        if status != 101 {
            let length: usize = header("content-length").map_or(0, |v| v.parse().unwrap_or(0));
            let mut body = vec![0; length];
            reader.read_exact(&mut body).expect("read refusal body");
            return Err(Refused {
                status,
                head,
                body: String::from_utf8_lossy(&body).into_owned(),
            });
        }
        let mut sha = sha1_smol::Sha1::new();
        sha.update(format!("{key}{GUID}").as_bytes());
        let accept = base64::engine::general_purpose::STANDARD.encode(sha.digest().bytes());
        assert_eq!(
            header("sec-websocket-accept").as_deref(),
            Some(accept.as_str()),
            "the upstream's handshake answer reaches the client intact: {head}"
        );
        Ok(Session { reader, stream })
    }

    /// Sends one masked frame (client frames are always masked).
    fn send_frame(&mut self, opcode: u8, payload: &[u8]) {
        let mut frame = vec![0x80 | opcode];
        match payload.len() {
            n @ 0..=125 => frame.push(0x80 | n as u8),
            n @ 126..=0xffff => {
                frame.push(0x80 | 126);
                frame.extend_from_slice(&(n as u16).to_be_bytes());
            }
            n => {
                frame.push(0x80 | 127);
                frame.extend_from_slice(&(n as u64).to_be_bytes());
            }
        }
        let mask = rand_bytes();
        frame.extend_from_slice(&mask[..4]);
        frame.extend(payload.iter().enumerate().map(|(i, b)| b ^ mask[i % 4]));
        self.stream.write_all(&frame).expect("send frame");
    }

    fn send_text(&mut self, text: &str) {
        self.send_frame(0x1, text.as_bytes());
    }

    /// The next frame: (opcode, payload). Server frames are never masked.
    fn read_frame(&mut self) -> std::io::Result<(u8, Vec<u8>)> {
        let mut head = [0u8; 2];
        self.reader.read_exact(&mut head)?;
        assert_eq!(head[0] & 0x80, 0x80, "unfragmented frames only");
        assert_eq!(head[1] & 0x80, 0, "a server frame is not masked");
        let len = match head[1] & 0x7f {
            126 => {
                let mut n = [0u8; 2];
                self.reader.read_exact(&mut n)?;
                u16::from_be_bytes(n) as usize
            }
            127 => {
                let mut n = [0u8; 8];
                self.reader.read_exact(&mut n)?;
                u64::from_be_bytes(n) as usize
            }
            n => n as usize,
        };
        let mut payload = vec![0; len];
        self.reader.read_exact(&mut payload)?;
        Ok((head[0] & 0x0f, payload))
    }

    /// The next text message (answering pings on the way).
    fn recv_text(&mut self) -> String {
        loop {
            let (opcode, payload) = self.read_frame().expect("a frame from the upstream");
            match opcode {
                0x1 => return String::from_utf8(payload).expect("utf-8 text"),
                0x9 => self.send_frame(0xA, &payload),
                0xA => {}
                other => panic!("unexpected frame opcode {other:#x}: {payload:?}"),
            }
        }
    }

    /// Sends `text` and expects the upstream's echo.
    fn round_trip(&mut self, text: &str) {
        self.send_text(text);
        assert_eq!(self.recv_text(), format!("echo {text}"));
    }

    /// The closing handshake: our close frame, then the upstream's, then EOF.
    fn close(mut self) {
        self.send_frame(0x8, &1000u16.to_be_bytes());
        loop {
            match self.read_frame() {
                Ok((0x8, payload)) => {
                    assert_eq!(payload.get(..2), Some(&1000u16.to_be_bytes()[..]));
                    break;
                }
                Ok(_) => continue,
                Err(e) => panic!("no close frame back: {e}"),
            }
        }
        let mut rest = Vec::new();
        let _ = self.reader.read_to_end(&mut rest);
        assert!(rest.is_empty(), "bytes after the close frame: {rest:?}");
    }
}

fn rand_bytes() -> [u8; 16] {
    let mut out = [0u8; 16];
    let seed = Instant::now().elapsed().as_nanos() as u64
        ^ std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64);
    let mut x = seed | 1;
    for b in &mut out {
        // xorshift: unpredictability does not matter here, only varying bytes.
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        *b = x as u8;
    }
    out
}

/// sluice with one route `/ws` to the WebSocket upstream under `policies`.
fn config(upstream: &Upstream, limiter: &str, server_extra: &str, policies: &str) -> String {
    format!(
        "[server]\nlisten = [\"{{listen}}\"]\naccess_log = \"off\"\n{server_extra}\n\
         [admin]\nlisten = \"{{admin}}\"\n[limiter]\n{limiter}\n\
         [upstreams.ws]\nservers = [\"127.0.0.1:{port}\"]\n{policies}\n\
         [[routes]]\nname = \"ws\"\npath_prefix = \"/ws\"\nupstream = \"ws\"\npolicies = [\"sessions\"]\n",
        port = upstream.port
    )
}

/// At most two sessions per user; a slot is reclaimed `lease` after its last renewal.
fn sessions_policy(lease: &str) -> String {
    format!(
        "[policies.sessions]\nalgorithm = \"concurrency\"\nlimit = 2\nkey = [\"header:x-user\"]\n\
         lease = \"{lease}\"\n"
    )
}

#[test]
fn messages_flow_both_ways_and_an_idle_session_outlives_body_timeout() {
    let upstream = Upstream::start();
    let sluice = Sluice::start(&config(
        &upstream,
        "backend = \"memory\"",
        "body_timeout = \"1s\"",
        &sessions_policy("60s"),
    ));
    let mut ws = Session::open(sluice.addr, "/ws/chat", "ann").expect("101");
    // Upstream to client, unprompted.
    assert_eq!(ws.recv_text(), "hello /ws/chat");
    for i in 0..5 {
        ws.round_trip(&format!("message {i}"));
    }
    // Frames with 16-bit and 64-bit lengths, split across many reads.
    ws.round_trip(&"x".repeat(300));
    ws.round_trip(&"y".repeat(100_000));
    // Quiet past body_timeout: an open session is not a stalled request body.
    std::thread::sleep(Duration::from_millis(2_500));
    ws.round_trip("still there");
    ws.close();
    // A plain request on the same route is still an ordinary request (the upstream
    // refuses it: it is no WebSocket handshake).
    let plain = sluice.get("/ws/chat");
    assert!(plain.status >= 400, "{}", plain.status);
}

/// Two sessions per user held far past `lease`, a third refused, a slot freed by a close.
fn sessions_hold_their_slots(limiter: &str) {
    let upstream = Upstream::start();
    let sluice = Sluice::start(&config(&upstream, limiter, "", &sessions_policy("1s")));
    let mut a = Session::open(sluice.addr, "/ws/a", "ann").expect("first session");
    let mut b = Session::open(sluice.addr, "/ws/b", "ann").expect("second session");
    assert_eq!(a.recv_text(), "hello /ws/a");
    assert_eq!(b.recv_text(), "hello /ws/b");
    // Another user has slots of their own.
    let other = Session::open(sluice.addr, "/ws/c", "bob").expect("another user's session");
    other.close();
    // Three leases long, quiet: the slots stay held because sluice renews them.
    std::thread::sleep(Duration::from_millis(3_500));
    let refused = Session::open(sluice.addr, "/ws/c", "ann")
        .err()
        .expect("a third session is refused while two are open past lease");
    assert_eq!(refused.status, 429, "{refused:?}");
    assert!(
        refused
            .body
            .contains("\"violated-policies\":[\"sessions\"]"),
        "{refused:?}"
    );
    assert!(
        refused
            .head
            .to_ascii_lowercase()
            .contains("ratelimit: \"sessions\";r=0;t=0"),
        "{refused:?}"
    );
    a.round_trip("a after the refusal");
    b.round_trip("b after the refusal");
    // Closing one session frees its slot (released when the request ends, not at expiry).
    a.close();
    let deadline = Instant::now() + Duration::from_millis(500);
    let mut c = loop {
        match Session::open(sluice.addr, "/ws/c", "ann") {
            Ok(c) => break c,
            Err(r) if r.status == 429 && Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(25))
            }
            Err(r) => panic!("the freed slot was not given to a new session: {r:?}"),
        }
    };
    assert_eq!(c.recv_text(), "hello /ws/c");
    c.round_trip("c");
    b.round_trip("b");
    assert_eq!(
        Session::open(sluice.addr, "/ws/d", "ann")
            .err()
            .map(|r| r.status),
        Some(429),
        "b and c hold both slots"
    );
    b.close();
    c.close();
}

#[test]
fn sessions_hold_their_slots_on_memory() {
    sessions_hold_their_slots("backend = \"memory\"");
}

#[test]
fn sessions_hold_their_slots_on_redis() {
    let redis = RedisServer::start();
    sessions_hold_their_slots(&format!("backend = \"redis\"\nurl = \"{}\"", redis.url()));
}

/// An instance that dies holding slots cannot release them: the fleet's other instances
/// see them taken until `lease` after the last renewal, then free.
#[test]
fn a_dead_instance_s_slots_are_reclaimed_after_lease() {
    let redis = RedisServer::start();
    let upstream = Upstream::start();
    let template = config(
        &upstream,
        &format!("backend = \"redis\"\nurl = \"{}\"", redis.url()),
        "",
        &sessions_policy("2s"),
    );
    let first = Sluice::start(&template);
    let a = Session::open(first.addr, "/ws/a", "ann").expect("first session");
    let b = Session::open(first.addr, "/ws/b", "ann").expect("second session");
    std::thread::sleep(Duration::from_millis(2_500));
    first.signal("KILL");
    let killed = Instant::now();
    drop((a, b));
    let second = Sluice::start(&template);
    let early = Session::open(second.addr, "/ws/c", "ann")
        .err()
        .map(|r| r.status);
    if killed.elapsed() < Duration::from_millis(1_200) {
        assert_eq!(
            early,
            Some(429),
            "the dead instance's slots are taken until they expire"
        );
    }
    let deadline = killed + Duration::from_millis(4_000);
    let mut c = loop {
        match Session::open(second.addr, "/ws/c", "ann") {
            Ok(c) => break c,
            Err(r) if r.status == 429 && Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(100))
            }
            Err(r) => {
                panic!("the dead instance's slots were not reclaimed within 2 × lease: {r:?}")
            }
        }
    };
    assert!(
        killed.elapsed() >= Duration::from_millis(600),
        "reclaimed after {:?}: sooner than a renewed lease can expire",
        killed.elapsed()
    );
    assert_eq!(c.recv_text(), "hello /ws/c");
    c.round_trip("after the crash");
    c.close();
}
