//! What the limiter does for authentication (DESIGN §11): `max_failures` bans by address,
//! counted by the `auth_failures` policy in the backend and remembered here so a banned
//! address costs one lookup; and the runtime consumers, stored and announced like runtime
//! overrides.

use std::net::IpAddr;
use std::sync::Arc;

use super::{runtime, Limiter};
use crate::auth::consumers::RuntimeConsumers;
use crate::clock::unix_ms;
use crate::config::Policy;
use crate::key::{self, RequestFacts};

impl Limiter {
    pub fn runtime_consumers(&self) -> Arc<RuntimeConsumers> {
        self.shared.consumers.clone()
    }

    /// The key of `client_ip`'s failures: its address, or an IPv6 address's network
    /// (`[server] ipv6_prefix`, DESIGN §21), so the rest of a /64 is banned with it.
    fn failure_key(&self, policy: &Policy, client_ip: IpAddr) -> String {
        let mut ip = Vec::with_capacity(40);
        key::push_ip(&mut ip, key::client_network(client_ip, self.ipv6_prefix));
        self.storage_key(policy, &ip)
    }

    /// Milliseconds left of a `max_failures` ban on `client_ip`: one lookup, before any
    /// credential is looked at.
    pub fn auth_banned(&self, policy: &Policy, client_ip: IpAddr) -> Option<u64> {
        if !self.shared.any_auth_ban() {
            return None;
        }
        let key = self.failure_key(policy, client_ip);
        self.shared.auth_banned(&key, unix_ms())
    }

    /// Counts one invalid credential from the request's address against `policies[id]`
    /// (the `auth_failures` policy). When that was the last the window allows, the address
    /// is banned now, on every instance: returns the ban's length in ms.
    pub async fn auth_failed(
        &self,
        policies: &[Policy],
        id: usize,
        req: &RequestFacts<'_>,
    ) -> Option<u64> {
        let policy = &policies[id];
        // Counted by the client's network: the policy's `client_ip` key reads this address.
        let req = &RequestFacts {
            client_ip: key::client_network(req.client_ip, self.ipv6_prefix),
            ..*req
        };
        // Route usize::MAX: counted in sluice_auth_total, not under any route's decisions.
        let first = self.decide(usize::MAX, policies, &[id], req).await;
        let verdict = first.policies.first().and_then(|p| p.verdict)?;
        let ban_ms = if verdict.allowed {
            if verdict.remaining > 0 {
                return None;
            }
            // The window is full: one more charge is refused, which sets the ban (in the
            // same atomic call, fleet-wide with Redis).
            let second = self.decide(usize::MAX, policies, &[id], req).await;
            let v = second.policies.first().and_then(|p| p.verdict)?;
            if v.allowed {
                return None;
            }
            v.retry_after_ms.max(1)
        } else {
            verdict.retry_after_ms.max(1)
        };
        let key = self.failure_key(policy, req.client_ip);
        let until = unix_ms() + ban_ms;
        self.shared.auth_ban(&key, until);
        let message = format!("{}{until} {key}", runtime::BAN);
        if let Err(e) = self.announce(&message).await {
            log::warn!(
                "max_failures: announcing the ban of {} failed: {e}",
                req.client_ip
            );
        }
        Some(ban_ms)
    }
}
