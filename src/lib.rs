//! sluice: a rate-limiting reverse proxy for the edge.
//!
//! - `cli`: the command line.
//! - `config`: the TOML file, validated once into a typed model with located errors.
//! - `routing`: which route a request belongs to: the first-match rule as a plain scan,
//!   and `RouteIndex`, which answers it by hash whatever the number of routes.
//! - `auth`: who is asking, verified: API keys by digest, JWTs against each issuer's keys
//!   (`jwks`: files and URLs), consumers of the config and the admin API.
//! - `key`: the client IP and the rate key of a policy for a request.
//! - `limiter`: deciding a route's policies together, and settling metered charges once
//!   responses are known (`Limiter::settle`, `Backend::adjust`); `memory` and `redis`
//!   backends only store; `overrides` (config) and `runtime` (admin API) give a key its
//!   numbers; `top` the heaviest keys; `pubsub` follows a Redis channel (Sentinel
//!   switches, the fleet's runtime changes); `keyed` decides checks the caller names (RLS).
//! - `proxy`: the Pingora proxy phases; `connection` bounds each client connection
//!   (deadlines, per-address cap); `upstream` pools (pingora::lb selection, active and
//!   passive health); responses; `usage` reads the tokens an LLM response reports, and a
//!   request's own bound for `reserve = "request"`.
//! - `gateway`: the state built from one config, swapped whole on reload.
//! - `tls`: TLS termination: certificates by SNI, client certificates, reload.
//! - `admin`: /metrics, /healthz, /readyz, the `/v1/` API (`api`, `consumers`, `summary`)
//!   and the operator console (`console`: one page compiled in). `metrics`: every metric
//!   family.
//! - `rls`: Envoy's rate limit service: envoyproxy/ratelimit's YAML (`rules`), its
//!   messages (`proto`), descriptors decided by the same limiter (`decide`, over
//!   `limiter::keyed`), gRPC over cleartext HTTP/2 (`service`).
//! - `server`: wiring it together and running until SIGTERM.

pub mod admin;
pub mod auth;
pub mod cli;
pub mod config;
pub mod gateway;
pub mod key;
pub mod limiter;
pub mod metrics;
pub mod proxy;
pub mod rls;
pub mod routing;
pub mod server;
pub mod tls;
