//! The admin API's operations on the limiter (DESIGN §9): keys named by their values, quota
//! reads without charging, resets, runtime overrides (announced to the fleet), the
//! heavy-hitter sketches and readiness. The request path is `pipeline`'s.

use std::time::Duration;

use super::algorithm::Rule;
use super::backend::{BackendError, Check};
use super::deny_cache::DenyCache;
use super::{rule_of, runtime, top, Limiter, Sketch};
use crate::config::Policy;
use crate::key;

/// A key as the admin API names it: the policy's storage key and the values.
#[derive(Debug, Clone)]
pub struct NamedKey {
    pub storage: String,
    pub values: Vec<String>,
}

/// A key's quota read without charging (`GET /v1/quota`).
#[derive(Debug, Clone, serde::Serialize)]
pub struct Quota {
    pub policy: String,
    pub key: Vec<String>,
    pub limit: u64,
    pub period_seconds: f64,
    pub burst: u64,
    pub remaining: u64,
    pub reset_seconds: f64,
    pub retry_after_seconds: f64,
    pub banned_seconds: f64,
    #[serde(rename = "override")]
    pub runtime_override: Option<runtime::RuntimeOverride>,
}

impl Limiter {
    /// Whether the backend answers within the decision timeout.
    pub async fn ready(&self) -> bool {
        tokio::time::timeout(
            self.settings.timeout.max(Duration::from_millis(250)),
            self.backend.ping(),
        )
        .await
        .unwrap_or(false)
    }

    /// How long an admin call may wait for the backend: never less than a readiness probe.
    pub(super) fn admin_timeout(&self) -> Duration {
        self.settings.timeout.max(Duration::from_millis(250))
    }

    pub(super) async fn bounded<T>(
        &self,
        work: impl std::future::Future<Output = Result<T, BackendError>>,
    ) -> Result<T, BackendError> {
        tokio::time::timeout(self.admin_timeout(), work)
            .await
            .unwrap_or(Err(BackendError::Timeout))
    }

    /// The key of `policy` with these values (one per key part, in order), as a request
    /// with them would be counted. Err: why the values cannot name a key.
    pub fn named_key(&self, policy: &Policy, values: &[String]) -> Result<NamedKey, String> {
        if values.len() != policy.key.len() {
            return Err(format!(
                "policy {} has {} key part(s) ({}), got {} key value(s)",
                policy.name,
                policy.key.len(),
                policy
                    .key
                    .iter()
                    .map(key::part_name)
                    .collect::<Vec<_>>()
                    .join(", "),
                values.len()
            ));
        }
        let shown = policy
            .key
            .iter()
            .zip(values)
            .map(|(part, value)| key::canonical_part(part, value))
            .collect::<Result<Vec<_>, _>>()?;
        let joined = key::join(shown.iter().map(String::as_bytes));
        Ok(NamedKey {
            storage: self.storage_key(policy, &joined),
            values: shown,
        })
    }

    /// The numbers `key` is counted with when only its values are known: its runtime
    /// override, else the policy's own (config overrides may match on parts outside the key).
    fn admin_rule(&self, policy: &Policy, key: &NamedKey) -> Rule {
        rule_of(
            policy,
            self.shared
                .numbers(&key.storage)
                .unwrap_or_else(|| policy.numbers()),
        )
    }

    /// `key`'s quota now, read without charging it (the algorithm run in peek mode).
    pub async fn quota(&self, policy: &Policy, key: &NamedKey) -> Result<Quota, BackendError> {
        let rule = self.admin_rule(policy, key);
        let check = Check {
            key: key.storage.clone(),
            rule,
            cost: policy.cost.max(1),
            enforce: true,
            lease: 0,
            ban_ms: (policy.ban.as_millis() as u64).max(1),
        };
        let now = self.clock.now_ms();
        let verdict = self
            .bounded(self.backend.peek(std::slice::from_ref(&check), now))
            .await?
            .into_iter()
            .next()
            .unwrap_or_default();
        let seconds = |ms: u64| ms as f64 / 1000.0;
        // A peek answers for one more request: what is left now includes its cost.
        let remaining = if verdict.allowed {
            verdict.remaining + check.cost
        } else {
            verdict.remaining
        };
        Ok(Quota {
            policy: policy.name.clone(),
            key: key.values.clone(),
            limit: rule.limit,
            period_seconds: seconds(rule.period_ms),
            burst: rule.burst,
            remaining,
            reset_seconds: seconds(verdict.reset_ms),
            retry_after_seconds: seconds(verdict.retry_after_ms),
            banned_seconds: if verdict.banned {
                seconds(verdict.retry_after_ms)
            } else {
                0.0
            },
            runtime_override: self.shared.get(&key.storage),
        })
    }

    /// Deletes `key`'s state and ban, here and (shared backend) for the fleet, whose deny
    /// caches are told to forget it.
    pub async fn reset(&self, key: &NamedKey) -> Result<(), BackendError> {
        self.bounded(self.backend.reset(&key.storage)).await?;
        self.local.reset_now(&key.storage);
        self.shared.forget(&key.storage);
        self.announce(&format!("{}{}", runtime::RESET, key.storage))
            .await
    }

    /// Sets `key`'s runtime override, here and (shared backend) for the fleet.
    pub async fn set_override(
        &self,
        key: &NamedKey,
        o: runtime::RuntimeOverride,
    ) -> Result<(), BackendError> {
        if let Some(fleet) = &self.fleet {
            let value =
                serde_json::to_string(&o).map_err(|e| BackendError::Script(e.to_string()))?;
            let hash = runtime::hash_name(&self.settings.key_prefix);
            self.bounded(fleet.hash_write(&hash, &key.storage, Some(&value)))
                .await?;
        }
        self.shared.set(&key.storage, o);
        self.announce(runtime::CHANGED).await
    }

    /// Deletes `key`'s runtime override; whether there was one.
    pub async fn delete_override(&self, key: &NamedKey) -> Result<bool, BackendError> {
        if let Some(fleet) = &self.fleet {
            let hash = runtime::hash_name(&self.settings.key_prefix);
            self.bounded(fleet.hash_write(&hash, &key.storage, None))
                .await?;
        }
        let had = self.shared.remove(&key.storage);
        self.announce(runtime::CHANGED).await?;
        Ok(had)
    }

    /// Tells every instance following the fleet's channel (`runtime`'s messages); nothing
    /// to tell without a shared backend.
    pub(super) async fn announce(&self, message: &str) -> Result<(), BackendError> {
        let Some(fleet) = &self.fleet else {
            return Ok(());
        };
        let channel = runtime::channel_name(&self.settings.key_prefix);
        self.bounded(fleet.announce(&channel, message)).await
    }

    /// The live runtime overrides of `policy`.
    pub fn overrides(&self, policy: &Policy) -> Vec<runtime::RuntimeOverride> {
        self.shared.of_policy(&policy.name)
    }

    /// `policy`'s `n` heaviest keys on this instance; None when `top_keys` is 0.
    pub fn top(&self, policy: &Policy, n: usize) -> Option<Vec<top::Entry>> {
        self.sketch(&policy.name).map(|s| s.lock().top(n))
    }

    pub(super) fn sketch(&self, policy: &str) -> Option<&Sketch> {
        self.top
            .iter()
            .find(|(name, _)| name == policy)
            .map(|(_, s)| s)
    }

    /// Keys the memory backend (the store, or the `local` fallback) holds now.
    pub fn memory_keys(&self) -> usize {
        self.local.len()
    }

    /// Entries in the deny cache now (0 without one).
    pub fn deny_cache_entries(&self) -> usize {
        self.deny_cache.as_ref().map_or(0, DenyCache::len)
    }
}
