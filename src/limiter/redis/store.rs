//! The store every call but decisions goes on: the one server's connection, the Sentinel
//! master's or the cluster's (each call a task on the I/O runtime).

use redis::aio::{ConnectionLike, ConnectionManager};
use redis::cluster_async::ClusterConnection;
use redis::{RedisError, RedisFuture, Value};
use std::sync::Arc;

use super::backend_error;
use super::cluster::by_slot;
use super::scripts::{self, Mode};
use super::sentinel::SentinelStore;
use crate::auth::consumers::{Changed, ConsumerChange};
use crate::limiter::algorithm::Verdict;
use crate::limiter::backend::{Adjustment, BackendError, Check};

#[derive(Clone)]
pub(super) enum Store {
    Single(ConnectionManager),
    Cluster(ClusterConnection),
    Sentinel(Arc<SentinelStore>),
}

/// The connection a store's calls go on: the one server's or the Sentinel master's
/// (managed, reconnecting), or the cluster's.
pub(super) enum Conn {
    Managed(ConnectionManager),
    Cluster(ClusterConnection),
}

impl ConnectionLike for Conn {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a redis::Cmd) -> RedisFuture<'a, Value> {
        match self {
            Conn::Managed(m) => m.req_packed_command(cmd),
            Conn::Cluster(c) => c.req_packed_command(cmd),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a redis::Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        match self {
            Conn::Managed(m) => m.req_packed_commands(pipeline, offset, count),
            Conn::Cluster(c) => c.req_packed_commands(pipeline, offset, count),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            Conn::Managed(m) => m.get_db(),
            Conn::Cluster(c) => c.get_db(),
        }
    }
}

impl Store {
    /// The connection to call on now (Sentinel: the current master's).
    pub(super) fn conn(&self) -> Result<Conn, BackendError> {
        match self {
            Store::Single(m) => Ok(Conn::Managed(m.clone())),
            Store::Cluster(c) => Ok(Conn::Cluster(c.clone())),
            Store::Sentinel(s) => s.current().map(Conn::Managed),
        }
    }

    /// A call's result as the backend reports it; with Sentinel, an error that says the
    /// master moved or went away also starts a new look-up.
    pub(super) fn checked<T>(&self, result: Result<T, RedisError>) -> Result<T, BackendError> {
        if let Store::Sentinel(s) = self {
            s.check(&result);
        }
        result.map_err(|e| backend_error(&e))
    }

    pub(super) async fn load_script(&self) -> Result<(), BackendError> {
        if let Store::Sentinel(s) = self {
            s.resolve().await?;
        }
        let result = scripts::load(&mut self.conn()?).await;
        self.checked(result)
    }

    /// Settles adjustments: one call per cluster slot (each key's adjustment is atomic on
    /// its own; a response's adjustments need not land together).
    pub(super) async fn adjust(
        self,
        adjustments: Vec<Adjustment>,
        now: Option<u64>,
    ) -> Result<(), BackendError> {
        let groups: Vec<Vec<usize>> = match self {
            Store::Cluster(_) => by_slot(adjustments.iter().map(|a| a.check.key.as_str())),
            _ => vec![(0..adjustments.len()).collect()],
        };
        for group in groups {
            let call = scripts::adjust_invocation(group.iter().map(|&i| &adjustments[i]), now);
            let result = call.invoke::<Vec<i64>>(&mut self.conn()?).await;
            self.checked(result)?;
        }
        Ok(())
    }

    pub(super) async fn release(self, key: String, lease: u64) -> Result<(), BackendError> {
        let release = scripts::release_invocation(&key, lease);
        let result = release.invoke::<Vec<i64>>(&mut self.conn()?).await;
        self.checked(result).map(|_| ())
    }

    pub(super) async fn renew(
        self,
        key: String,
        lease: u64,
        lease_ms: u64,
        now: Option<u64>,
    ) -> Result<bool, BackendError> {
        let renew = scripts::renew_invocation(&key, lease, lease_ms, now);
        let result = renew.invoke::<Vec<i64>>(&mut self.conn()?).await;
        match self.checked(result)?[..] {
            [_, held] => Ok(held == 1),
            ref other => Err(BackendError::Script(format!(
                "renew: expected 2 integers, got {}",
                other.len()
            ))),
        }
    }

    /// Evaluates checks without charging: every slot's group on its own (a peek sets nothing,
    /// so there is nothing to make atomic across slots).
    pub(super) async fn peek(
        self,
        checks: Vec<Check>,
        now: Option<u64>,
    ) -> Result<Vec<Verdict>, BackendError> {
        let mut verdicts = Vec::with_capacity(checks.len());
        for check in &checks {
            let one = std::slice::from_ref(check);
            let result = call(&mut self.conn()?, Mode::Peek, one, now).await;
            let values = self.checked(result)?;
            verdicts.extend(scripts::decode(&values, Mode::Peek, &enforce_flags(one))?.verdicts);
        }
        Ok(verdicts)
    }

    /// One change to the runtime consumers: `lua/consumer.lua`, run whole by Redis.
    pub(super) async fn change_consumer(
        self,
        hash: String,
        change: ConsumerChange,
    ) -> Result<Changed, BackendError> {
        let call = scripts::consumer_invocation(&hash, &change);
        let result = call.invoke_async::<(i64, String)>(&mut self.conn()?).await;
        let (status, consumer) = self.checked(result)?;
        scripts::decode_consumer(status, &consumer)
    }

    /// Runs one command on the store (the master for Sentinel).
    pub(super) async fn query<T: redis::FromRedisValue + Send>(
        self,
        cmd: redis::Cmd,
    ) -> Result<T, BackendError> {
        let result = cmd.query_async(&mut self.conn()?).await;
        self.checked(result)
    }

    pub(super) async fn ping(self) -> bool {
        self.query::<String>(redis::cmd("PING")).await.is_ok()
    }
}

/// One script call.
async fn call<'c>(
    conn: &mut impl ConnectionLike,
    mode: Mode,
    checks: impl IntoIterator<Item = &'c Check>,
    now: Option<u64>,
) -> Result<Vec<i64>, RedisError> {
    scripts::invocation(mode, checks, now)
        .invoke::<scripts::Integers>(conn)
        .await
        .map(|integers| integers.0)
}

pub(super) fn enforce_flags(checks: &[Check]) -> Vec<bool> {
    checks.iter().map(|c| c.enforce).collect()
}
