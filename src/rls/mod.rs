//! Envoy's rate limit service (DESIGN §13): a second front door to the same limiter.
//!
//! `rules` reads envoyproxy/ratelimit's YAML and matches descriptors to its rules; `proto`
//! is the wire format of the five messages; `decide` turns one call into the limiter's
//! checks and its verdicts into the answer; `service` serves gRPC over cleartext HTTP/2.

pub mod decide;
pub mod proto;
pub mod rules;
mod service;

pub use service::Service;
