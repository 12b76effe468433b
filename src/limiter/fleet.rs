//! What a store shared by a fleet of instances does besides deciding: the runtime
//! overrides' and consumers' hashes, announcements on the fleet's channel and following
//! them, prefetch's takes (DESIGN §9, §11, §19). Only the Redis backend is one.

use std::sync::Arc;

use async_trait::async_trait;

use super::backend::{BackendError, Check};
use super::prefetch::held::Taken;
use crate::auth::consumers::{Changed, ConsumerChange};

/// A store the instances of a fleet share; `Limiter` holds one beside its `Backend` (the
/// same store) when there is a fleet, and then keeps runtime overrides and consumers in it.
#[async_trait]
pub(crate) trait Fleet: Send + Sync {
    /// Every field and value of the hash `hash`.
    async fn hash_read(&self, hash: &str) -> Result<Vec<(String, String)>, BackendError>;

    /// Sets (`Some`) or deletes (`None`) `field` of the hash `hash`.
    async fn hash_write(
        &self,
        hash: &str,
        field: &str,
        value: Option<&str>,
    ) -> Result<(), BackendError>;

    /// Makes `change` to the runtime consumers kept in the hash `hash`, atomically against
    /// every other change from any instance (compare-and-set).
    async fn change_consumer(
        &self,
        hash: &str,
        change: &ConsumerChange,
    ) -> Result<Changed, BackendError>;

    /// Publishes `message` to every instance following `channel`.
    async fn announce(&self, channel: &str, message: &str) -> Result<(), BackendError>;

    /// Starts a task handing `listener` every message announced on `channel`, catching it
    /// up after every (re)connection, until the listener is no longer wanted or the task is
    /// aborted.
    fn follow(&self, channel: &str, listener: Arc<dyn Listener>) -> tokio::task::AbortHandle;

    /// Prefetch: takes up to `want` units of `check`'s key ahead and gives back `back` units
    /// of the take made at `back_at` (the store's clock), in one atomic call.
    async fn take(
        &self,
        check: &Check,
        want: u64,
        back: u64,
        back_at: u64,
        now_ms: u64,
    ) -> Result<Taken, BackendError>;
}

/// Whoever follows a channel of a shared store.
#[async_trait]
pub(crate) trait Listener: Send + Sync {
    /// Whether the follower is still needed; when not, following ends.
    fn wanted(&self) -> bool;

    /// After every (re)subscription: catch up on what may have been announced unheard.
    /// An error makes the follower subscribe again.
    async fn subscribed(&self) -> Result<(), String>;

    /// One announcement.
    async fn message(&self, text: &str);

    /// While subscribed, every few seconds (a quiet channel's safety net).
    async fn probed(&self) {}
}
