//! Starting sluice: the I/O runtime, the Pingora services, reloads and draining shutdown.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use arc_swap::ArcSwap;
use async_trait::async_trait;
use pingora::apps::HttpServerOptions;
use pingora::listeners::{ListenerConfig, TcpSocketOptions};
use pingora::protocols::l4::stream::L4BufferSettings;
use pingora::server::configuration::ServerConf;
use pingora::server::{RunArgs, Server, ShutdownSignal, ShutdownSignalWatch};
use pingora::services::listening::Service;
use tokio::signal::unix::{signal, SignalKind};

use crate::admin::Admin;
use crate::clock::SystemClock;
use crate::config::Config;
use crate::gateway::{App, Gateway};
use crate::metrics::Metrics;
use crate::proxy::connection::Edge;
use crate::proxy::Proxy;

/// Serves `config` (already validated, read from `config_path`) until SIGTERM or SIGINT.
pub fn run(config_path: PathBuf, config: Config) -> anyhow::Result<()> {
    // One long-lived runtime for backend connections, health checks and reloads: Pingora's
    // per-service runtimes must not own anything that outlives a request.
    let io = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .thread_name("sluice-io")
        .enable_all()
        .build()?;
    let metrics = Arc::new(Metrics::new());
    let clock = Arc::new(SystemClock);
    let gateway = io
        .block_on(Gateway::build(
            config.clone(),
            None,
            clock.clone(),
            metrics.clone(),
        ))
        .map_err(anyhow::Error::msg)?;
    crate::gateway::return_freed_memory();
    let app = Arc::new(App {
        current: ArcSwap::from_pointee(gateway),
        metrics,
        clock,
        config_path,
        in_flight: AtomicUsize::new(0),
    });
    io.spawn(start_upstreams_when_listening(
        app.current.load_full(),
        config
            .server
            .listen
            .iter()
            .chain([&config.admin.listen])
            .copied()
            .collect(),
    ));
    let mut hangups = io.block_on(async { signal(SignalKind::hangup()) })?;
    let reloader = app.clone();
    io.spawn(async move {
        while hangups.recv().await.is_some() {
            let _ = reloader.reload().await;
        }
    });

    let grace = config.server.grace_period;
    let conf = ServerConf {
        threads: config.server.threads,
        grace_period_seconds: Some(grace.as_secs() + u64::from(grace.subsec_nanos() > 0)),
        graceful_shutdown_timeout_seconds: Some(1),
        // One runtime per thread, as nginx has one event loop per worker: measured +34%
        // proxied requests/s over the work-stealing runtime (wrk A/B on this machine).
        work_stealing: false,
        // Each worker's proxy has one pool of idle upstream connections for all its upstreams
        // (an LRU): room for every upstream's `keepalive`, so none is closed after use while
        // it will be needed again (Pingora's default, 128, turned every request past 128
        // concurrent into a new connection and a socket in TIME_WAIT).
        upstream_keepalive_pool_size: config.keepalive_pool_size(),
        ..ServerConf::default()
    };
    let mut server = Server::new_with_opt_and_conf(None, conf);
    server.bootstrap();
    // One proxy service per worker thread, each a single-threaded runtime with its own
    // listening sockets, its own HTTP proxy (so its own upstream connection pool) and, made
    // on its first decision, its own Redis connection (src/limiter/redis.rs, lanes): a
    // request never leaves the thread that accepted it, as in nginx's workers. One service of
    // N threads instead registers every socket with the reactor of the thread that made it
    // and hands connections and pooled upstream connections across threads (measured in
    // bench/results: rows 4w2 and 6w2).
    let per_ip = Arc::default();
    let workers = config.server.threads;
    if workers > 1 {
        ensure_free(config.server.listen.iter().chain(&config.server.tls_listen))?;
    }
    for worker in 0..workers {
        let mut http =
            pingora::proxy::http_proxy(&server.configuration, Proxy { app: app.clone() });
        let mut options = HttpServerOptions::default();
        // Prior-knowledge HTTP/2 on cleartext listeners; `Edge` tells the two apart by the preface.
        options.h2c = config.server.h2c;
        // An HTTP/2 connection with no stream open is idle, as a keep-alive HTTP/1.1 one is.
        options.h2_idle_timeout = Some(config.server.idle_timeout);
        http.server_options = Some(options);
        let edge = Edge {
            proxy: Arc::new(http),
            app: app.clone(),
            per_ip: Arc::clone(&per_ip),
        };
        let mut proxy = Service::new(format!("proxy-{worker}"), edge);
        proxy.threads = Some(1);
        let listener = |addr: &SocketAddr| {
            let config =
                ListenerConfig::tcp(worker_address(addr, worker)).l4_buffer(CLIENT_BUFFERS);
            if workers == 1 {
                return config;
            }
            let mut options = TcpSocketOptions::default();
            options.so_reuseport = Some(true);
            config.tcp_socket_options(options)
        };
        for addr in &config.server.listen {
            proxy.add_listener(listener(addr));
        }
        // HTTPS: every TLS listener asks the gateway's shared resolver (src/tls.rs) for
        // certificates.
        for addr in &config.server.tls_listen {
            let settings = crate::tls::settings(&config, app.current.load().tls.clone())
                .map_err(anyhow::Error::msg)?;
            proxy.add_listener(listener(addr).tls(settings));
        }
        server.add_service(proxy);
    }
    let mut admin = Service::new("admin".to_owned(), Admin { app: app.clone() });
    admin.add_tcp(&config.admin.listen.to_string());
    admin.threads = Some(1);
    server.add_service(admin);
    // Envoy's rate limit service: as many threads as the proxy, asking the same gateway.
    if let Some(rls) = &config.rls {
        // Its own per-address table: `max_connections_per_ip` applies to it as to the proxy.
        let rls_service = crate::rls::Service {
            app: app.clone(),
            per_ip: Arc::default(),
        };
        let mut service = Service::new("rls".to_owned(), rls_service);
        service.add_tcp(&rls.listen.to_string());
        service.threads = Some(workers);
        server.add_service(service);
    }
    log::info!(
        "sluice {} serving {}",
        env!("CARGO_PKG_VERSION"),
        listeners(&config)
    );
    server.run(RunArgs {
        shutdown_signal: Box::new(Drain { app, grace }),
    });
    drop(io);
    Ok(())
}

/// Starts the first config's health checks once sluice's own cleartext listeners accept
/// (Pingora binds them in `server.run`), at most 2 s after start: an upstream may be sluice
/// itself, as the quick start's is its admin listener, and its first check must not fail.
async fn start_upstreams_when_listening(first: Arc<Gateway>, own: Vec<SocketAddr>) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(2);
    for addr in own {
        let addr = match addr.ip() {
            IpAddr::V4(ip) if ip.is_unspecified() => {
                SocketAddr::new(Ipv4Addr::LOCALHOST.into(), addr.port())
            }
            IpAddr::V6(ip) if ip.is_unspecified() => {
                SocketAddr::new(Ipv6Addr::LOCALHOST.into(), addr.port())
            }
            _ => addr,
        };
        while tokio::net::TcpStream::connect(addr).await.is_err()
            && tokio::time::Instant::now() < deadline
        {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
    crate::upstream::start(&first.upstreams);
}

/// Fails when another process already listens on one of `addrs`. The workers' sockets share
/// their address through SO_REUSEPORT, which would as gladly share it with another sluice (or
/// anything else of the same user that set it) and split the traffic between them in
/// silence; a plain bind first makes that the "address in use" error one socket would give.
fn ensure_free<'a>(addrs: impl Iterator<Item = &'a SocketAddr>) -> anyhow::Result<()> {
    for addr in addrs {
        std::net::TcpListener::bind(addr)
            .map_err(|e| anyhow::anyhow!("cannot listen on {addr}: {e}"))?;
    }
    Ok(())
}

/// The address worker `worker` listens on, as text. With several workers each binds a socket
/// of its own (SO_REUSEPORT: the kernel spreads new connections over them); Pingora keys
/// listening sockets by this text, and would hand every worker the first one's, so worker
/// N writes the port with N leading zeros ("127.0.0.1:08080"), which parses the same.
fn worker_address(addr: &SocketAddr, worker: usize) -> String {
    let port = addr.port();
    match addr {
        SocketAddr::V4(a) => format!("{}:{}{port}", a.ip(), "0".repeat(worker)),
        SocketAddr::V6(a) => format!("[{}]:{}{port}", a.ip(), "0".repeat(worker)),
    }
}

/// Pingora's default gives every client connection a 64 KiB read buffer in front of the
/// HTTP parser, which reads into its own buffer anyway: without it an idle keep-alive
/// connection costs far less memory (see the README's figure and `bench/idle_memory.py`).
const CLIENT_BUFFERS: L4BufferSettings = L4BufferSettings {
    read: Some(0),
    write: None,
};

/// SIGTERM or SIGINT: stop accepting, then exit as soon as no request is in flight,
/// or when the grace period ends.
struct Drain {
    app: Arc<App>,
    grace: Duration,
}

#[async_trait]
impl ShutdownSignalWatch for Drain {
    async fn recv(&self) -> ShutdownSignal {
        let (Ok(mut term), Ok(mut int)) = (
            signal(SignalKind::terminate()),
            signal(SignalKind::interrupt()),
        ) else {
            log::error!("cannot watch SIGTERM/SIGINT; stopping");
            return ShutdownSignal::FastShutdown;
        };
        tokio::select! {
            _ = term.recv() => {},
            _ = int.recv() => {},
        }
        log::info!(
            "shutting down: draining in-flight requests (at most {:?})",
            self.grace
        );
        let app = self.app.clone();
        let deadline = Instant::now() + self.grace;
        std::thread::spawn(move || {
            while app.in_flight.load(Ordering::SeqCst) > 0 && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(5));
            }
            use std::io::Write;
            let _ = std::io::stdout().flush();
            std::process::exit(0);
        });
        ShutdownSignal::GracefulTerminate
    }
}

/// Every listener of `config`, for the start-up log: `http on [..], https on [..], admin on
/// .., rls on ..` (a kind with no address left out).
fn listeners(config: &Config) -> String {
    let server = &config.server;
    let mut kinds = Vec::new();
    if !server.listen.is_empty() {
        kinds.push(format!("http on {:?}", server.listen));
    }
    if !server.tls_listen.is_empty() {
        kinds.push(format!("https on {:?}", server.tls_listen));
    }
    kinds.push(format!("admin on {}", config.admin.listen));
    if let Some(rls) = &config.rls {
        kinds.push(format!("rls on {}", rls.listen));
    }
    kinds.join(", ")
}
