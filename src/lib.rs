//! sluice: a rate-limiting reverse proxy for the edge.
//!
//! Modules depend downward only (DESIGN §6b; `make lint` checks it with
//! `scripts/check-layers.py`). From the bottom:
//!
//! 1. `clock`: the crate's one source of time (the limiter's `Clock`, Unix milliseconds).
//!    `config`: the TOML file (and the files it names: certificates, JWKS files, consumer
//!    files, envoyproxy/ratelimit YAML) validated once into plain data with located errors;
//!    one file per section (`server`, `tls`, `limiter`, `upstreams`, `policies`, `metering`,
//!    `auth`, `routes`, `rls`) over `read`, the shared reading helpers; values that several
//!    sections or one key hold have their own (`nets` address sets, `calendar` periods,
//!    `reject` bodies, `retries`, `upstream_tls`).
//! 2. `metrics`: every metric family and its rendering; each owner below primes its own series.
//! 3. `auth`: who is asking, verified: API keys by digest, JWTs against each issuer's keys
//!    (`jwks`: URL sources), consumers of the config and the admin API.
//!    `routing`: which route a request belongs to (a first-match scan, and `RouteIndex`,
//!    which answers it by hash whatever the number of routes), on the normal form of its
//!    path (`path`). `tls`: certificates by SNI, client certificates, reload.
//!    `upstream`: each upstream as one `Upstream` the proxy asks for a `peer()`: its `pool`
//!    (pingora::lb selection and passive health; `pool::health` the active checks,
//!    `pool::resolve` names re-resolved on an interval through hickory), `peer_tls` (its CAs
//!    and client certificate as Pingora's connector takes them) and `retry` (its budget).
//! 4. `key`: the client IP and the rate key of a policy for a request.
//! 5. `limiter`: deciding a route's policies together, and settling metered charges once
//!    responses are known; `memory` and `redis` backends only store; `overrides` (config)
//!    and `runtime` (admin API) give a key its numbers; `top` the heaviest keys; `pubsub`
//!    follows a Redis channel; `prefetch` takes units of hot keys ahead from Redis and
//!    `held` keeps them (DESIGN §19); `calendar` the windows of calendar periods; `keyed`
//!    decides checks the caller names (RLS); `series` its metric series; `connections` the
//!    open connections per client address.
//! 6. `response`: what sluice writes itself: rate-limit headers, problem bodies, gRPC
//!    statuses.
//! 7. `gateway`: the state built from one config (`Gateway::build`), swapped whole on reload.
//! 8. The front doors, each over the gateway and never another door: `proxy` (the Pingora
//!    phases; `connection` bounds each client connection; `usage` reads the tokens an LLM
//!    response reports, through `decode` when the upstream compressed it), `rls` (Envoy's rate limit service: `rules` matching, `proto`
//!    messages, `decide`, `service` gRPC over HTTP/2), `admin` (/metrics, /healthz,
//!    /readyz, the `/v1/` API and the operator console).
//! 9. `server`: wiring it together and running until SIGTERM.
//! 10. `cli`: the command line, and the `sluice admin` client (`cli::admin`).

pub mod admin;
pub mod auth;
pub mod cli;
pub mod clock;
pub mod config;
pub mod gateway;
pub mod key;
pub mod limiter;
pub mod metrics;
pub mod proxy;
pub mod response;
pub mod rls;
pub mod routing;
pub mod server;
pub mod tls;
pub mod upstream;
