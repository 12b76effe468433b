//! A set of networks (`[server] deny`, a route's `client_ips`, DESIGN §20) that answers
//! "is this address in one of them?" at a cost that does not grow with the list: one hash
//! lookup per distinct prefix length (a short list is simply scanned).

use std::collections::HashSet;
use std::net::IpAddr;

use ipnet::IpNet;

/// Lists up to this long are scanned; longer ones are looked up by prefix length.
const SCAN_UP_TO: usize = 8;

#[derive(Debug, Clone, Default)]
pub struct NetSet {
    /// As written (host bits cleared, IPv4-mapped IPv6 networks as IPv4).
    nets: Vec<IpNet>,
    /// `(prefix length, network)` of each IPv4 network, and the distinct lengths ascending.
    v4: HashSet<(u8, u32)>,
    v4_lengths: Vec<u8>,
    v6: HashSet<(u8, u128)>,
    v6_lengths: Vec<u8>,
}

impl NetSet {
    pub fn new(nets: Vec<IpNet>) -> NetSet {
        let mut set = NetSet {
            nets: nets.into_iter().map(canonical_net).collect(),
            ..NetSet::default()
        };
        if set.nets.len() > SCAN_UP_TO {
            for net in &set.nets {
                let len = net.prefix_len();
                match net {
                    IpNet::V4(n) => {
                        set.v4.insert((len, u32::from(n.network())));
                        insert_sorted(&mut set.v4_lengths, len);
                    }
                    IpNet::V6(n) => {
                        set.v6.insert((len, u128::from(n.network())));
                        insert_sorted(&mut set.v6_lengths, len);
                    }
                }
            }
        }
        set
    }

    pub fn is_empty(&self) -> bool {
        self.nets.is_empty()
    }

    /// The networks, as configured.
    pub fn nets(&self) -> &[IpNet] {
        &self.nets
    }

    /// Whether `ip` (canonical: an IPv4-mapped IPv6 address given as IPv4) is in a network
    /// of the set.
    pub fn contains(&self, ip: IpAddr) -> bool {
        if self.nets.len() <= SCAN_UP_TO {
            return self.nets.iter().any(|n| n.contains(&ip));
        }
        match ip {
            IpAddr::V4(a) => {
                let a = u32::from(a);
                self.v4_lengths
                    .iter()
                    .any(|&len| self.v4.contains(&(len, a & mask32(len))))
            }
            IpAddr::V6(a) => {
                let a = u128::from(a);
                self.v6_lengths
                    .iter()
                    .any(|&len| self.v6.contains(&(len, a & mask128(len))))
            }
        }
    }
}

fn insert_sorted(lengths: &mut Vec<u8>, len: u8) {
    if let Err(at) = lengths.binary_search(&len) {
        lengths.insert(at, len);
    }
}

fn mask32(len: u8) -> u32 {
    u32::MAX.checked_shl(32 - u32::from(len)).unwrap_or(0)
}

fn mask128(len: u8) -> u128 {
    u128::MAX.checked_shl(128 - u32::from(len)).unwrap_or(0)
}

/// Host bits cleared; `::ffff:10.0.0.0/104` is `10.0.0.0/8`, as client addresses are.
fn canonical_net(net: IpNet) -> IpNet {
    if let IpNet::V6(n) = net {
        if let (Some(v4), true) = (n.network().to_ipv4_mapped(), n.prefix_len() >= 96) {
            if let Ok(n4) = ipnet::Ipv4Net::new(v4, n.prefix_len() - 96) {
                return IpNet::V4(n4.trunc());
            }
        }
    }
    net.trunc()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn set(nets: &[&str]) -> NetSet {
        NetSet::new(nets.iter().map(|n| n.parse().expect("test CIDR")).collect())
    }

    fn ip(s: &str) -> IpAddr {
        s.parse().expect("test address")
    }

    #[test]
    fn short_and_long_lists_answer_alike() {
        let nets = [
            "203.0.113.0/24",
            "198.51.100.7/32",
            "10.1.2.3/8",
            "2001:db8::/32",
            "::1/128",
            "0.0.0.0/0",
        ];
        let filler: Vec<String> = (0..20).map(|i| format!("192.0.2.{i}/32")).collect();
        let addrs = [
            "203.0.113.9",
            "203.0.114.1",
            "198.51.100.7",
            "198.51.100.8",
            "10.200.0.1",
            "2001:db8:1::1",
            "2001:db9::1",
            "::1",
            "::2",
            "192.0.2.5",
            "192.0.2.50",
        ];
        for take in 0..=nets.len() {
            let mut long: Vec<&str> = filler.iter().map(String::as_str).collect();
            long.extend(&nets[..take]);
            let short = set(&nets[..take]);
            let long = set(&long);
            for a in addrs {
                let expected = nets[..take].iter().any(|n| {
                    n.parse::<IpNet>()
                        .expect("test CIDR")
                        .trunc()
                        .contains(&ip(a))
                });
                assert_eq!(short.contains(ip(a)), expected, "{take} {a}");
                let in_filler = a.starts_with("192.0.2.") && a != "192.0.2.50";
                assert_eq!(long.contains(ip(a)), expected || in_filler, "{take} {a}");
            }
        }
    }

    #[test]
    fn mapped_networks_are_ipv4() {
        let s = set(&["::ffff:10.0.0.0/104"]);
        assert!(s.contains(ip("10.9.9.9")));
        assert!(!s.contains(ip("11.0.0.1")));
        assert!(set(&[]).is_empty());
        assert!(!set(&[]).contains(ip("10.0.0.1")));
    }
}
