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
//!    `reject` bodies, `retries`, `upstream_tls`, `adaptive`).
//! 2. `metrics`: every metric family and its rendering; each owner below primes its own series.
//! 3. `auth`: who is asking, verified: API keys by digest, JWTs against each issuer's keys
//!    (`jwks`: URL sources), consumers of the config and the admin API.
//!    `routing`: which route a request belongs to (a first-match scan, and `RouteIndex`,
//!    which answers it by hash whatever the number of routes), on the normal form of its
//!    path (`path`). `tls`: certificates by SNI, client certificates, reload.
//!    `upstream`: each upstream as one `Upstream` the proxy asks for a `peer()`: its `pool`
//!    (pingora::lb selection and passive health; `pool::health` the active checks,
//!    `pool::resolve` names re-resolved on an interval through hickory), `peer_tls` (its CAs
//!    and client certificate as Pingora's connector takes them), `retry` (its budget) and
//!    `adaptive` (its concurrency limit learnt from latency, and admission by plan share).
//! 4. `key`: the client IP and the rate key of a policy for a request.
//! 5. `limiter`: deciding a route's policies together, and settling metered charges once
//!    responses are known. `pipeline` is the one decision path, for proxied requests and
//!    RLS alike: plan the checks (keys, exemptions, missing parts, the deny cache), run them
//!    against the backend (breaker, timeout, `on_error`), apply the verdicts (shadow mode,
//!    bans, leases, charges), record them, and `settle` charges; `keyed` plans the checks a
//!    caller names (RLS). `admin` holds the admin API's operations (named keys, quotas,
//!    resets, runtime overrides, top keys); `lease` the concurrency slot a request holds.
//!    Backends only store: `backend` is what every store does (`memory`, `redis`), `fleet`
//!    what a store a fleet shares does besides (hashes, announcements, following, prefetch
//!    takes; Redis only). `redis/`: `store`, `lanes` (per-runtime connections and batching),
//!    `cluster` (requests across slots), `sentinel`, `scripts` (Lua), `pubsub`. `overrides`
//!    (config) and `runtime` (admin API) give a key its numbers; `top` the heaviest keys;
//!    `prefetch/` takes units of hot keys ahead from Redis and `prefetch/held` keeps them
//!    (DESIGN §19); `calendar` the windows of calendar periods; `deny_cache` the local
//!    over-limit cache; `identity` bans and runtime consumers; `series` its metric series;
//!    `connections` the open connections per client address.
//! 6. `response`: what sluice writes itself: rate-limit headers, problem bodies, gRPC
//!    statuses.
//! 7. `gateway`: the state built from one config (`Gateway::build`), swapped whole on reload.
//! 8. The front doors, each over the gateway and never another door: `proxy` (the Pingora
//!    phases: `mod` holds the hooks in call order and the per-request `Ctx` in groups, each
//!    owned by one file; `admit` runs admission as steps (deny, normalise, route, body size,
//!    auth, body, shed, limits); `refusal` renders every answer sluice makes itself, as HTTP or a
//!    gRPC status; `forward` picks each try's peer, decides retries and edits the upstream
//!    request; `metering/` charges from the response (`json` usage, `sse` event streams,
//!    `decode` through Content-Encoding, `request` the request body's bound); `log` ends
//!    each request; `connection` bounds each client connection), `rls` (Envoy's rate limit
//!    service: `rules` matching, `proto` messages, `decide`, `service` gRPC over HTTP/2),
//!    `admin` (/metrics, /healthz, /readyz, the `/v1/` API and the operator console).
//! 9. `server`: wiring it together and running until SIGTERM.
//! 10. `cli`: the command line, the `sluice admin` client (`cli::admin`), and the man pages
//!     and shell completions generated from it (`cli::manual`).

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
