//! Placeholder until the Redis backend lands (being written now).

use async_trait::async_trait;

use super::algorithm::Verdict;
use super::backend::{Backend, BackendError, Check};

pub struct RedisBackend;

impl RedisBackend {
    pub async fn connect(_cfg: &crate::config::Limiter) -> Result<RedisBackend, BackendError> {
        Err(BackendError::Connection("redis backend not built yet".into()))
    }
}

#[async_trait]
impl Backend for RedisBackend {
    fn name(&self) -> &'static str {
        "redis"
    }
    async fn decide(&self, _checks: &[Check], _now_ms: u64) -> Result<Vec<Verdict>, BackendError> {
        Err(BackendError::Connection("not built".into()))
    }
    async fn release(&self, _key: &str, _lease: u64) -> Result<(), BackendError> {
        Ok(())
    }
    async fn ping(&self) -> bool {
        false
    }
}
