//! Which numbers a request is counted with (DESIGN §9.1): the first matching config
//! override, else the policy's own. Resolved before the backend is called, so backends and
//! Lua scripts only ever see plain numbers; the state key never depends on them.

use std::net::IpAddr;

use ipnet::IpNet;

use crate::config::{Condition, KeyPart, Numbers, Policy, Values};
use crate::key::{self, RequestFacts};

/// The first of `policy`'s overrides whose `when` all holds for `req`, else the policy's
/// own numbers. (A runtime override for the exact key comes first; the limiter asks for
/// it before calling this, see `Limiter::runtime_override`.)
pub fn resolve(policy: &Policy, req: &RequestFacts) -> Numbers {
    policy
        .overrides
        .iter()
        .find(|o| o.when.iter().all(|c| holds(c, req)))
        .map_or_else(|| policy.numbers(), |o| o.numbers)
}

/// Whether one `when` entry holds; a part the request does not have never matches.
pub fn holds(condition: &Condition, req: &RequestFacts) -> bool {
    match (&condition.values, &condition.part) {
        (Values::Nets(nets), KeyPart::ClientIp) => {
            nets.iter().any(|net| net.contains(&req.client_ip))
        }
        // The client's /N network lies inside one of the networks.
        (Values::Nets(nets), KeyPart::ClientNet(bits)) => {
            let Some(own) = network(req.client_ip, *bits) else {
                return false;
            };
            nets.iter().any(|net| net.contains(&own))
        }
        (Values::Caseless(values), KeyPart::Host) => {
            values.iter().any(|v| v.eq_ignore_ascii_case(req.host))
        }
        (Values::Caseless(values), KeyPart::Method) => {
            values.iter().any(|v| v.eq_ignore_ascii_case(req.method))
        }
        (values, part) => {
            // The value exactly as the part would enter a key.
            let Some(got) = key::key_value(std::slice::from_ref(part), req) else {
                return false;
            };
            let candidates = match values {
                Values::Exact(v) | Values::Caseless(v) => v,
                Values::Nets(_) => return false,
            };
            candidates.iter().any(|v| v.as_bytes() == got.as_slice())
        }
    }
}

fn network(ip: IpAddr, bits: u8) -> Option<IpNet> {
    let most = if ip.is_ipv4() { 32 } else { 128 };
    IpNet::new(ip, bits.min(most)).ok().map(|n| n.trunc())
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::{HeaderMap, HeaderValue};

    static ANONYMOUS: std::sync::LazyLock<crate::auth::Identity> =
        std::sync::LazyLock::new(crate::auth::Identity::anonymous);

    fn facts<'a>(headers: &'a HeaderMap, ip: &str) -> RequestFacts<'a> {
        RequestFacts {
            client_ip: ip.parse().expect("test IP"),
            method: "GET",
            host: "api.example.com",
            path: "/v1/x",
            query: Some("plan=gold"),
            headers,
            route: "api",
            client_cert: None,
            identity: &ANONYMOUS,
            request_bound: None,
        }
    }

    fn cond(part: KeyPart, values: Values) -> Condition {
        Condition { part, values }
    }

    fn exact(v: &[&str]) -> Values {
        Values::Exact(v.iter().map(|s| s.to_string()).collect())
    }

    fn nets(v: &[&str]) -> Values {
        Values::Nets(v.iter().map(|s| s.parse().expect("test CIDR")).collect())
    }

    #[test]
    fn conditions_match_exactly_caselessly_or_by_network() {
        let mut headers = HeaderMap::new();
        headers.insert("x-plan", HeaderValue::from_static("gold"));
        let req = facts(&headers, "10.1.2.3");
        let header = |v: &[&str]| cond(KeyPart::Header("x-plan".into()), exact(v));
        assert!(holds(&header(&["gold"]), &req));
        assert!(holds(&header(&["silver", "gold"]), &req));
        assert!(
            !holds(&header(&["Gold"]), &req),
            "header values are case-sensitive"
        );
        let absent = cond(KeyPart::Header("x-other".into()), exact(&[""]));
        assert!(!holds(&absent, &req), "an absent part never matches");
        let host = cond(
            KeyPart::Host,
            Values::Caseless(vec!["api.example.com".into()]),
        );
        assert!(holds(&host, &req));
        let method = cond(KeyPart::Method, Values::Caseless(vec!["get".into()]));
        assert!(holds(&method, &req));
        assert!(holds(
            &cond(KeyPart::Query("plan".into()), exact(&["gold"])),
            &req
        ));
        assert!(holds(&cond(KeyPart::ClientIp, nets(&["10.0.0.0/8"])), &req));
        assert!(!holds(
            &cond(KeyPart::ClientIp, nets(&["10.2.0.0/16"])),
            &req
        ));
        assert!(!holds(&cond(KeyPart::ClientIp, nets(&["::/0"])), &req));
        assert!(holds(
            &cond(KeyPart::ClientNet(24), nets(&["10.1.0.0/16"])),
            &req
        ));
        // The client's /16 is wider than a /24: not inside it.
        assert!(!holds(
            &cond(KeyPart::ClientNet(16), nets(&["10.1.2.0/24"])),
            &req
        ));
        assert!(!holds(&cond(KeyPart::ClientCert, exact(&["ab"])), &req));
    }
}
