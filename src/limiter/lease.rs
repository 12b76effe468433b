//! A concurrency slot held for a request's whole life: renewed while held, released when
//! dropped.

use std::sync::Arc;
use std::time::Duration;

use super::backend::Backend;
use crate::clock::Clock;

/// A concurrency slot this request holds until it ends.
///
/// The slot is held for the request's whole life, however long (a WebSocket, a long
/// download): while the lease is held, a task renews it every third of `lease`, so the
/// backend's expiry only ever reclaims the slots of an instance that died without
/// releasing them. Dropping the lease stops the renewals and releases the slot.
pub struct Lease {
    key: String,
    id: u64,
    backend: Arc<dyn Backend>,
    renewal: Option<tokio::task::AbortHandle>,
}

impl Lease {
    pub(super) fn hold(
        key: String,
        id: u64,
        lease_ms: u64,
        backend: Arc<dyn Backend>,
        clock: Arc<dyn Clock>,
    ) -> Lease {
        let renewal = tokio::runtime::Handle::try_current().ok().map(|handle| {
            let (key, backend) = (key.clone(), backend.clone());
            handle
                .spawn(renew_while_held(key, id, lease_ms, backend, clock))
                .abort_handle()
        });
        Lease {
            key,
            id,
            backend,
            renewal,
        }
    }
}

/// Renews lease `id` every third of `lease_ms` until aborted. A failed renewal is tried
/// again at the next tick (two more chances before the lease would expire); a lease found
/// already gone (expired while the backend was unreachable, or the store was emptied) is not
/// taken back, as its slot may be another request's by now.
async fn renew_while_held(
    key: String,
    id: u64,
    lease_ms: u64,
    backend: Arc<dyn Backend>,
    clock: Arc<dyn Clock>,
) {
    let every = Duration::from_millis((lease_ms / 3).max(1));
    let mut ticks = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        ticks.tick().await;
        let renewed =
            tokio::time::timeout(every, backend.renew(&key, id, lease_ms, clock.now_ms())).await;
        match renewed {
            Ok(Ok(true)) => {}
            Ok(Ok(false)) => {
                log::warn!(
                    "concurrency lease on {key} expired before it was renewed; \
                     the request goes on without its slot"
                );
                return;
            }
            Ok(Err(e)) => log::debug!("renewing concurrency lease on {key} failed: {e}"),
            Err(_) => log::debug!("renewing concurrency lease on {key} timed out"),
        }
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        if let Some(renewal) = self.renewal.take() {
            renewal.abort();
        }
        if self.backend.release_in_place(&self.key, self.id) {
            return;
        }
        let (key, id, backend) = (std::mem::take(&mut self.key), self.id, self.backend.clone());
        if let Ok(handle) = tokio::runtime::Handle::try_current() {
            handle.spawn(async move {
                let _ = backend.release(&key, id).await;
            });
        }
    }
}
