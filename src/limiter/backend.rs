//! What a limiter backend does: store state and decide a batch of checks atomically.

use async_trait::async_trait;

use super::algorithm::{Rule, Verdict};

/// One policy's question for one request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Check {
    /// The full storage key: `<key_prefix>{<hash>}:<policy>:<algorithm>`.
    pub key: String,
    pub rule: Rule,
    pub cost: u64,
    /// A shadow policy does not block the batch; it is still charged when it allows.
    pub enforce: bool,
    /// concurrency: the lease id this request holds if admitted (never 0).
    pub lease: u64,
    /// `ban` in ms (0: none; always 0 for a shadow check): once the check is denied, its key
    /// is denied for this long without asking the algorithm. Set and read in the same
    /// atomic decision as the check.
    pub ban_ms: u64,
}

/// A charge settled when the response is known (DESIGN §12): `amount` more units for
/// `check`'s key, charged now whatever the limit; or, when negative, that many taken back
/// from the charge its decision made at `charged_at`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Adjustment {
    pub check: Check,
    pub charged_at: u64,
    pub amount: i64,
}

/// Every `kind` label value of `sluice_backend_errors_total` (`BackendError::kind`).
pub const BACKEND_ERROR_KINDS: [&str; 4] = ["timeout", "connection", "script", "circuit_open"];

#[derive(Debug, Clone, thiserror::Error, PartialEq, Eq)]
pub enum BackendError {
    #[error("timed out")]
    Timeout,
    #[error("connection failed: {0}")]
    Connection(String),
    #[error("script failed: {0}")]
    Script(String),
    #[error("circuit open")]
    CircuitOpen,
}

impl BackendError {
    /// The `kind` label of `sluice_backend_errors_total`.
    pub fn kind(&self) -> &'static str {
        match self {
            BackendError::Timeout => "timeout",
            BackendError::Connection(_) => "connection",
            BackendError::Script(_) => "script",
            BackendError::CircuitOpen => "circuit_open",
        }
    }
}

/// A store of limiter state. Backends only store and decide; keys, shadow mode, the deny
/// cache, timeouts and fallbacks live in the limiter layer above them, and what a store
/// shared by a fleet does besides is `fleet::Fleet`'s.
#[async_trait]
pub trait Backend: Send + Sync {
    /// The `backend` metric label: "memory" or "redis".
    fn name(&self) -> &'static str;

    /// Decides every check at `now_ms` (a backend with its own clock may ignore it), all or
    /// nothing: when every `enforce` check allows, each allowing check is charged; otherwise
    /// none is. Returns one verdict per check, in order.
    async fn decide(&self, checks: &[Check], now_ms: u64) -> Result<Vec<Verdict>, BackendError>;

    /// Applies every adjustment at `now_ms` (a backend with its own clock may ignore it),
    /// atomically per key. Bans are neither read nor set.
    async fn adjust(&self, adjustments: &[Adjustment], now_ms: u64) -> Result<(), BackendError>;

    /// concurrency: frees the slot held by `lease` under `key`.
    async fn release(&self, key: &str, lease: u64) -> Result<(), BackendError>;

    /// `decide` at once when that needs no I/O (an in-process store): no boxed future and
    /// no timer on the request's path. None: use `decide`.
    fn decide_in_place(&self, _checks: &[Check], _now_ms: u64) -> Option<Vec<Verdict>> {
        None
    }

    /// concurrency: frees the slot at once when that needs no I/O (an in-process store),
    /// so a client that retries right after its response finds the slot free. False: use
    /// `release`.
    fn release_in_place(&self, _key: &str, _lease: u64) -> bool {
        false
    }

    /// concurrency: `lease` under `key`, if still held, now expires `lease_ms` after
    /// `now_ms` (a backend with its own clock may ignore it). A released or expired lease
    /// is not brought back. Returns whether the lease was held.
    async fn renew(
        &self,
        key: &str,
        lease: u64,
        lease_ms: u64,
        now_ms: u64,
    ) -> Result<bool, BackendError>;

    /// Whether the backend answers now (for `/readyz` and the circuit breaker's probe).
    async fn ping(&self) -> bool;

    /// Evaluates every check at `now_ms` as `decide` would, charging nothing and banning
    /// nobody (the admin API's quota read; a banning check reads its ban).
    async fn peek(&self, checks: &[Check], now_ms: u64) -> Result<Vec<Verdict>, BackendError>;

    /// Forgets `key`'s state and its ban.
    async fn reset(&self, key: &str) -> Result<(), BackendError>;
}
