//! Building a policy's rate key from a request: the client IP, then each key part.

use std::net::IpAddr;

use http::HeaderMap;
use ipnet::IpNet;

use crate::auth::Identity;
use crate::config::KeyPart;

/// What key parts can be read from; borrowed from the request for the decision only.
pub struct RequestFacts<'a> {
    pub client_ip: IpAddr,
    pub method: &'a str,
    /// Lower-case host without port.
    pub host: &'a str,
    pub path: &'a str,
    pub query: Option<&'a str>,
    pub headers: &'a HeaderMap,
    pub route: &'a str,
    /// Lower-case hex SHA-256 of the client's leaf certificate; `None` without mutual TLS.
    pub client_cert: Option<&'a str>,
    /// Who is asking, verified (anonymous unless a credential checked out).
    pub identity: &'a Identity,
    /// `reserve = "request"`: the units the request's body bounds its cost by, if it does.
    pub request_bound: Option<u64>,
}

/// The client address: the TCP peer, unless the peer is a trusted proxy; then the
/// right-most address in `header` that is not itself trusted.
pub fn client_ip(peer: IpAddr, headers: &HeaderMap, header: &str, trusted: &[IpNet]) -> IpAddr {
    let peer = canonical(peer);
    if !is_trusted(peer, trusted) {
        return peer;
    }
    let mut candidate = peer;
    // Several header lines count as one list, in order.
    let values: Vec<&[u8]> = headers
        .get_all(header)
        .iter()
        .map(|v| v.as_bytes())
        .collect();
    for value in values.iter().rev() {
        let Ok(text) = std::str::from_utf8(value) else {
            return candidate;
        };
        for item in text.rsplit(',') {
            match parse_forwarded_ip(item.trim()) {
                Some(ip) => {
                    candidate = ip;
                    if !is_trusted(ip, trusted) {
                        return ip;
                    }
                }
                // A malformed entry ends the chain we can believe.
                None => return candidate,
            }
        }
    }
    candidate
}

fn is_trusted(ip: IpAddr, trusted: &[IpNet]) -> bool {
    trusted.iter().any(|net| net.contains(&ip))
}

/// IPv4-mapped IPv6 addresses count as IPv4.
fn canonical(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(ip, IpAddr::V4),
        v4 => v4,
    }
}

/// The address a client is counted as where one address is not one client (DESIGN §21:
/// `max_failures` bans, `max_connections_per_ip`): an IPv6 address by its network of
/// `v6_prefix` bits (host bits zeroed), an IPv4 address (or an IPv4-mapped one) as itself.
pub fn client_network(ip: IpAddr, v6_prefix: u8) -> IpAddr {
    match canonical(ip) {
        IpAddr::V6(v6) if v6_prefix < 128 => {
            let mask = u128::MAX
                .checked_shl(128 - u32::from(v6_prefix))
                .unwrap_or(0);
            IpAddr::V6((u128::from(v6) & mask).into())
        }
        ip => ip,
    }
}

/// "1.2.3.4", "1.2.3.4:5678", "2001:db8::1", "[2001:db8::1]:443".
fn parse_forwarded_ip(s: &str) -> Option<IpAddr> {
    if let Ok(ip) = s.parse::<IpAddr>() {
        return Some(canonical(ip));
    }
    if let Ok(sock) = s.parse::<std::net::SocketAddr>() {
        return Some(canonical(sock.ip()));
    }
    None
}

/// How a key part is written in the config (`client_ip/24`, `header:x-api-key`).
pub fn part_name(part: &KeyPart) -> String {
    match part {
        KeyPart::ClientIp => "client_ip".into(),
        KeyPart::ClientNet(bits) => format!("client_ip/{bits}"),
        KeyPart::Header(n) => format!("header:{n}"),
        KeyPart::Query(n) => format!("query:{n}"),
        KeyPart::Cookie(n) => format!("cookie:{n}"),
        KeyPart::Path => "path".into(),
        KeyPart::Method => "method".into(),
        KeyPart::Host => "host".into(),
        KeyPart::Route => "route".into(),
        KeyPart::ClientCert => "client_cert".into(),
        KeyPart::Consumer => "consumer".into(),
        KeyPart::Plan => "plan".into(),
        KeyPart::Claim(n) => format!("claim:{n}"),
    }
}

/// A key part's value given by an operator (admin API) as a request with it would put it
/// in the key: addresses in canonical form, `client_ip/N` as its network, hosts and
/// certificate hashes lower-case.
pub fn canonical_part(part: &KeyPart, value: &str) -> Result<String, String> {
    let address = || {
        value
            .parse::<IpAddr>()
            .map(canonical)
            .map_err(|_| format!("{value:?} is not an IP address ({})", part_name(part)))
    };
    Ok(match part {
        KeyPart::ClientIp => address()?.to_string(),
        KeyPart::ClientNet(bits) => {
            // Any address of the network, or the network itself.
            let ip = match value.split_once('/') {
                Some((ip, _)) => ip
                    .parse::<IpAddr>()
                    .map(canonical)
                    .map_err(|_| format!("{value:?} is not an IP address ({})", part_name(part)))?,
                None => address()?,
            };
            let most = if ip.is_ipv4() { 32 } else { 128 };
            IpNet::new(ip, (*bits).min(most))
                .map_err(|e| e.to_string())?
                .trunc()
                .to_string()
        }
        KeyPart::Host | KeyPart::ClientCert => value.to_ascii_lowercase(),
        _ => value.to_owned(),
    })
}

/// The joined value of `parts` for this request, or `None` when a part is absent.
pub fn key_value(parts: &[KeyPart], req: &RequestFacts) -> Option<Vec<u8>> {
    let mut out = Vec::with_capacity(64);
    let framed = parts.len() > 1;
    for part in parts {
        let at = open_part(&mut out, framed);
        push_part(&mut out, part, req)?;
        close_part(&mut out, at, framed);
    }
    Some(out)
}

/// `key_value`, with every absent part replaced by the client IP (`on_missing =
/// "client_ip"`): anonymous clients counted per address. Consumer names are never IP
/// addresses, so the two cannot share a bucket.
pub fn key_value_or_ip(parts: &[KeyPart], req: &RequestFacts) -> Vec<u8> {
    let mut out = Vec::with_capacity(64);
    let framed = parts.len() > 1;
    for part in parts {
        let at = open_part(&mut out, framed);
        if push_part(&mut out, part, req).is_none() {
            out.truncate(at);
            push_ip(&mut out, req.client_ip);
        }
        close_part(&mut out, at, framed);
    }
    out
}

/// Key values joined as requests join them: an operator's (admin API) or a descriptor's
/// (RLS).
pub fn join<'a>(values: impl ExactSizeIterator<Item = &'a [u8]>) -> Vec<u8> {
    let mut out = Vec::with_capacity(64);
    let framed = values.len() > 1;
    for value in values {
        let at = open_part(&mut out, framed);
        out.extend_from_slice(value);
        close_part(&mut out, at, framed);
    }
    out
}

/// The parts of a joined key value, for showing it (heavy hitters).
pub fn parts(joined: &[u8]) -> Vec<String> {
    let mut parts = Vec::new();
    let mut rest = joined;
    while let [a, b, c, d, tail @ ..] = rest {
        let len = u32::from_be_bytes([*a, *b, *c, *d]) as usize;
        let Some(value) = tail.get(..len) else { break };
        parts.push(String::from_utf8_lossy(value).into_owned());
        rest = &tail[len..];
    }
    if !rest.is_empty() || parts.len() < 2 {
        return vec![String::from_utf8_lossy(joined).into_owned()];
    }
    parts
}

/// Where the part about to be written starts, its length's place kept when the key has
/// more than one part (DESIGN §21): each part is written after its length (4 bytes,
/// big-endian), so no value, NUL included, can imitate two (a claim `a\0b` then `c` is not
/// `a` then `b\0c`). A one-part key is its value as it is: one value cannot imitate two,
/// and most keys (and the overrides and counts stored under them) keep their names.
fn open_part(out: &mut Vec<u8>, framed: bool) -> usize {
    if framed {
        out.extend_from_slice(&[0; 4]);
    }
    out.len()
}

fn close_part(out: &mut [u8], at: usize, framed: bool) {
    if framed {
        let len = u32::try_from(out.len() - at).unwrap_or(u32::MAX);
        out[at - 4..at].copy_from_slice(&len.to_be_bytes());
    }
}

fn push_part(out: &mut Vec<u8>, part: &KeyPart, req: &RequestFacts) -> Option<()> {
    match part {
        KeyPart::ClientIp => push_ip(out, req.client_ip),
        KeyPart::ClientNet(bits) => {
            let net = match req.client_ip {
                IpAddr::V4(v4) => IpNet::new(IpAddr::V4(v4), (*bits).min(32)),
                IpAddr::V6(v6) => IpNet::new(IpAddr::V6(v6), (*bits).min(128)),
            }
            .ok()?
            .trunc();
            out.extend_from_slice(net.to_string().as_bytes());
        }
        KeyPart::Header(name) => {
            let mut values = req.headers.get_all(name.as_str()).iter().peekable();
            values.peek()?;
            for (j, v) in values.enumerate() {
                if j > 0 {
                    out.push(b',');
                }
                out.extend_from_slice(v.as_bytes());
            }
        }
        KeyPart::Query(name) => out.extend_from_slice(query_param(req.query?, name)?.as_bytes()),
        KeyPart::Cookie(name) => out.extend_from_slice(cookie(req.headers, name)?),
        // As routes read it (DESIGN §21): `/login;jsessionid=N` is `/login`'s key.
        KeyPart::Path => {
            out.extend_from_slice(crate::routing::match_form(req.path, false).as_bytes())
        }
        KeyPart::Method => out.extend_from_slice(req.method.as_bytes()),
        KeyPart::Host => out.extend_from_slice(req.host.as_bytes()),
        KeyPart::Route => out.extend_from_slice(req.route.as_bytes()),
        KeyPart::ClientCert => out.extend_from_slice(req.client_cert?.as_bytes()),
        KeyPart::Consumer => out.extend_from_slice(req.identity.consumer.as_deref()?.as_bytes()),
        KeyPart::Plan => out.extend_from_slice(req.identity.plan.as_deref()?.as_bytes()),
        KeyPart::Claim(name) => out.extend_from_slice(req.identity.claim(name)?.as_bytes()),
    }
    Some(())
}

/// The first value of query parameter `name`, undecoded (so every spelling is distinct).
fn query_param<'a>(query: &'a str, name: &str) -> Option<&'a str> {
    query.split('&').find_map(|pair| {
        let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
        (k == name).then_some(v)
    })
}

fn cookie<'a>(headers: &'a HeaderMap, name: &str) -> Option<&'a [u8]> {
    headers
        .get_all(http::header::COOKIE)
        .iter()
        .find_map(|line| {
            line.as_bytes().split(|b| *b == b';').find_map(|pair| {
                let pair = pair.trim_ascii();
                let eq = pair.iter().position(|b| *b == b'=')?;
                (&pair[..eq] == name.as_bytes()).then(|| &pair[eq + 1..])
            })
        })
}

/// Appends a fixed-length (32 hex digits) hash of a key value to `out`: long or binary
/// values never reach storage.
pub fn push_hash(out: &mut String, value: &[u8]) {
    let digest = blake3::hash(value);
    for b in &digest.as_bytes()[..16] {
        out.push(char::from(b"0123456789abcdef"[(b >> 4) as usize]));
        out.push(char::from(b"0123456789abcdef"[(b & 15) as usize]));
    }
}

/// Appends the text form of `ip` (as its `Display`): IPv4, the common case, without the
/// `fmt` machinery, which cost more than the rest of a key (callgrind).
pub fn push_ip(out: &mut Vec<u8>, ip: IpAddr) {
    match ip {
        IpAddr::V4(v4) => {
            for (i, octet) in v4.octets().into_iter().enumerate() {
                if i > 0 {
                    out.push(b'.');
                }
                out.extend_from_slice(itoa::Buffer::new().format(octet).as_bytes());
            }
        }
        IpAddr::V6(v6) => {
            use std::io::Write as _;
            let _ = write!(out, "{v6}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_ipv6_client_counts_by_its_network() {
        let net = |ip: &str, bits| client_network(ip.parse().expect("ip"), bits).to_string();
        assert_eq!(net("2001:db8:1:2:3:4:5:6", 64), "2001:db8:1:2::");
        assert_eq!(net("2001:db8:1:2:3:4:5:6", 48), "2001:db8:1::");
        assert_eq!(net("2001:db8:1:2:3:4:5:6", 128), "2001:db8:1:2:3:4:5:6");
        assert_eq!(net("203.0.113.9", 64), "203.0.113.9");
        assert_eq!(net("::ffff:203.0.113.9", 64), "203.0.113.9");
    }
    use http::HeaderValue;

    fn nets(list: &[&str]) -> Vec<IpNet> {
        list.iter().map(|s| s.parse().expect("test CIDR")).collect()
    }

    fn xff(values: &[&str]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for v in values {
            h.append(
                "x-forwarded-for",
                HeaderValue::from_str(v).expect("test header"),
            );
        }
        h
    }

    fn ip(s: &str) -> IpAddr {
        s.parse().expect("test IP")
    }

    #[test]
    fn untrusted_peer_header_is_ignored() {
        let h = xff(&["1.1.1.1"]);
        assert_eq!(
            client_ip(ip("9.9.9.9"), &h, "x-forwarded-for", &nets(&["10.0.0.0/8"])),
            ip("9.9.9.9")
        );
    }

    #[test]
    fn right_most_untrusted_address_wins() {
        let trusted = nets(&["10.0.0.0/8"]);
        let h = xff(&["6.6.6.6, 2.2.2.2, 10.0.0.5"]);
        assert_eq!(
            client_ip(ip("10.0.0.1"), &h, "x-forwarded-for", &trusted),
            ip("2.2.2.2")
        );
        let h = xff(&["6.6.6.6", "2.2.2.2"]);
        assert_eq!(
            client_ip(ip("10.0.0.1"), &h, "x-forwarded-for", &trusted),
            ip("2.2.2.2")
        );
        let h = xff(&["garbage, 10.0.0.7"]);
        assert_eq!(
            client_ip(ip("10.0.0.1"), &h, "x-forwarded-for", &trusted),
            ip("10.0.0.7")
        );
        assert_eq!(
            client_ip(
                ip("10.0.0.1"),
                &HeaderMap::new(),
                "x-forwarded-for",
                &trusted
            ),
            ip("10.0.0.1")
        );
    }

    #[test]
    fn key_parts() {
        let mut headers = xff(&[]);
        headers.insert("x-api-key", HeaderValue::from_static("k1"));
        headers.insert("cookie", HeaderValue::from_static("a=1; session=s9; b=2"));
        let req = RequestFacts {
            client_ip: ip("2001:db8:1:2:3::9"),
            method: "GET",
            host: "api.example.com",
            path: "/v1/x",
            query: Some("user=u7&x"),
            headers: &headers,
            route: "api",
            client_cert: None,
            identity: &Identity::anonymous(),
            request_bound: None,
        };
        let one =
            |p: KeyPart| key_value(&[p], &req).map(|v| String::from_utf8_lossy(&v).into_owned());
        assert_eq!(
            one(KeyPart::ClientNet(64)).as_deref(),
            Some("2001:db8:1:2::/64")
        );
        assert_eq!(
            one(KeyPart::Header("x-api-key".into())).as_deref(),
            Some("k1")
        );
        assert_eq!(one(KeyPart::Header("x-missing".into())), None);
        assert_eq!(one(KeyPart::Query("user".into())).as_deref(), Some("u7"));
        assert_eq!(one(KeyPart::Query("x".into())).as_deref(), Some(""));
        assert_eq!(one(KeyPart::Query("y".into())), None);
        assert_eq!(
            one(KeyPart::Cookie("session".into())).as_deref(),
            Some("s9")
        );
        assert_eq!(one(KeyPart::Cookie("sess".into())), None);
        assert_eq!(one(KeyPart::ClientCert), None);
        let with_cert = RequestFacts {
            client_cert: Some("ab01"),
            ..req
        };
        assert_eq!(
            key_value(&[KeyPart::ClientCert], &with_cert),
            Some(b"ab01".to_vec())
        );
        assert_eq!(key_value(&[], &req), Some(Vec::new()));
        let hash = |value: &[u8]| {
            let mut out = String::new();
            push_hash(&mut out, value);
            out
        };
        assert_eq!(hash(b"x").len(), 32);
        for ip in [
            "203.0.113.9",
            "0.0.0.0",
            "255.255.255.255",
            "10.0.20.3",
            "2001:db8::1",
            "::ffff:1.2.3.4",
        ] {
            let ip: IpAddr = ip.parse().expect("test address");
            let mut out = Vec::new();
            push_ip(&mut out, ip);
            assert_eq!(out, ip.to_string().into_bytes());
        }
        assert_ne!(hash(b"a\0b"), hash(b"a\0c"));
    }

    #[test]
    fn no_value_imitates_two_parts() {
        let two = |a: &[u8], b: &[u8]| join([a, b].into_iter());
        assert_ne!(two(b"a\0b", b"c"), two(b"a", b"b\0c"));
        assert_ne!(two(b"", b"ab"), two(b"a", b"b"));
        assert_eq!(parts(&two(b"a\0b", b"c")), ["a\0b", "c"]);
        assert_eq!(parts(&two(b"", b"")), ["", ""]);
        // One part is its value as it is, as before.
        assert_eq!(join([&b"acme"[..]].into_iter()), b"acme");
        assert_eq!(parts(b"acme"), ["acme"]);
        let mut headers = HeaderMap::new();
        headers.insert("x-a", HeaderValue::from_static("1"));
        let req = RequestFacts {
            client_ip: ip("192.0.2.1"),
            method: "GET",
            host: "h",
            path: "/",
            query: None,
            headers: &headers,
            route: "r",
            client_cert: None,
            identity: &Identity::anonymous(),
            request_bound: None,
        };
        let parts_of = [KeyPart::Header("x-a".into()), KeyPart::Method];
        assert_eq!(key_value(&parts_of, &req), Some(two(b"1", b"GET")));
        let missing = [KeyPart::Header("x-b".into()), KeyPart::Method];
        assert_eq!(key_value_or_ip(&missing, &req), two(b"192.0.2.1", b"GET"));
    }
}
