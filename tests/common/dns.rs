//! A tiny DNS server on loopback (UDP) for `resolve` tests: it answers A queries for the
//! names a test sets, with the TTL the test chooses, counts them per name, and can be
//! switched to answer SERVFAIL. Other query types get an empty NOERROR answer.

use std::collections::HashMap;
use std::net::{Ipv4Addr, SocketAddr, UdpSocket};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::Duration;

#[derive(Default)]
struct State {
    /// name (lower case, no trailing dot) -> (addresses, TTL seconds)
    answers: HashMap<String, (Vec<Ipv4Addr>, u32)>,
    /// A queries seen per name.
    asked: HashMap<String, usize>,
    failing: bool,
}

pub struct DnsServer {
    pub addr: SocketAddr,
    state: Arc<Mutex<State>>,
    stop: Arc<AtomicBool>,
}

impl DnsServer {
    pub fn start() -> DnsServer {
        let socket = UdpSocket::bind("127.0.0.1:0").expect("bind DNS socket");
        socket
            .set_read_timeout(Some(Duration::from_millis(50)))
            .expect("read timeout");
        let addr = socket.local_addr().expect("DNS address");
        let state = Arc::new(Mutex::new(State::default()));
        let stop = Arc::new(AtomicBool::new(false));
        let (st, sp) = (state.clone(), stop.clone());
        thread::spawn(move || {
            let mut buf = [0u8; 1500];
            while !sp.load(Ordering::SeqCst) {
                let Ok((n, from)) = socket.recv_from(&mut buf) else {
                    continue;
                };
                if let Some(reply) = answer(&buf[..n], &st) {
                    let _ = socket.send_to(&reply, from);
                }
            }
        });
        DnsServer { addr, state, stop }
    }

    /// `name` now resolves to `addrs` with this TTL.
    pub fn set(&self, name: &str, addrs: &[Ipv4Addr], ttl: u32) {
        self.lock()
            .answers
            .insert(name.to_ascii_lowercase(), (addrs.to_vec(), ttl));
    }

    /// Every query is answered SERVFAIL while `on`.
    pub fn fail(&self, on: bool) {
        self.lock().failing = on;
    }

    /// A queries for `name` so far.
    pub fn asked(&self, name: &str) -> usize {
        self.lock()
            .asked
            .get(&name.to_ascii_lowercase())
            .copied()
            .unwrap_or(0)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl Drop for DnsServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
    }
}

/// The reply to one query: its question echoed, then the answers.
fn answer(query: &[u8], state: &Mutex<State>) -> Option<Vec<u8>> {
    if query.len() < 12 || u16::from_be_bytes([query[4], query[5]]) != 1 {
        return None;
    }
    // The question: labels, then QTYPE and QCLASS.
    let mut at = 12;
    let mut labels = Vec::new();
    loop {
        let len = usize::from(*query.get(at)?);
        at += 1;
        if len == 0 {
            break;
        }
        labels.push(String::from_utf8_lossy(query.get(at..at + len)?).to_ascii_lowercase());
        at += len;
    }
    let qtype = u16::from_be_bytes([*query.get(at)?, *query.get(at + 1)?]);
    let question_end = at + 4;
    let question = query.get(12..question_end)?;
    let name = labels.join(".");
    let mut state = state.lock().unwrap_or_else(|e| e.into_inner());
    let (rcode, records) = if qtype == 1 {
        *state.asked.entry(name.clone()).or_default() += 1;
        match (state.failing, state.answers.get(&name)) {
            (true, _) => (2, Vec::new()),
            (false, Some((addrs, ttl))) => (0, addrs.iter().map(|a| (*a, *ttl)).collect()),
            (false, None) => (3, Vec::new()),
        }
    } else {
        (if state.failing { 2 } else { 0 }, Vec::new())
    };
    let mut reply = Vec::with_capacity(512);
    reply.extend_from_slice(&query[..2]); // id
                                          // QR, the query's opcode and RD, RA, and the rcode
    reply.push(0x80 | (query[2] & 0x79));
    reply.push(0x80 | rcode);
    reply.extend_from_slice(&1u16.to_be_bytes());
    reply.extend_from_slice(&(records.len() as u16).to_be_bytes());
    reply.extend_from_slice(&[0, 0, 0, 0]);
    reply.extend_from_slice(question);
    for (addr, ttl) in records {
        reply.extend_from_slice(&[0xc0, 12, 0, 1, 0, 1]); // the question's name, A, IN
        reply.extend_from_slice(&ttl.to_be_bytes());
        reply.extend_from_slice(&4u16.to_be_bytes());
        reply.extend_from_slice(&addr.octets());
    }
    Some(reply)
}
