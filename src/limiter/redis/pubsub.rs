//! Following a Redis Pub/Sub channel for as long as someone needs it: subscribe (trying
//! each target in turn), let the listener catch up on what it may have missed, hand it
//! every message, probe a quiet connection with PING, and subscribe again with a growing
//! pause when the connection fails. Used for Sentinel's `+switch-master` and for the
//! fleet's runtime overrides and resets.

use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt;
use redis::aio::PubSub;
use redis::{Client, ConnectionInfo, RedisError};

use crate::limiter::fleet::Listener;

/// Pauses between two rounds of attempts: doubling from the first to the last, so a
/// server that is down costs one connection attempt every few seconds.
const PAUSE_FIRST: Duration = Duration::from_millis(100);
const PAUSE_LAST: Duration = Duration::from_secs(5);

/// How often a quiet subscription is checked with PING (and the listener told, so it can
/// re-read what it follows): a connection that died without a word (a host gone, a
/// partition) is then noticed and replaced within this and `io_timeout`.
pub const PROBE: Duration = Duration::from_secs(5);

/// Follows `channel` until the listener is no longer wanted. `targets` names the servers
/// to subscribe to now, in order of preference; it is asked again before every attempt
/// (a Sentinel master moves). `what` names the follower in logs.
pub async fn follow(
    what: &str,
    channel: &str,
    targets: impl Fn() -> Vec<ConnectionInfo>,
    listener: Arc<dyn Listener>,
    io_timeout: Duration,
) {
    let mut pause = PAUSE_FIRST;
    let mut complained = false;
    while listener.wanted() {
        match subscribe(&targets(), channel, io_timeout).await {
            Ok((pubsub, at)) => {
                log::debug!("{what}: following {channel} on {at}");
                pause = PAUSE_FIRST;
                complained = false;
                match listen(listener.as_ref(), pubsub, io_timeout).await {
                    Some(why) => {
                        log::warn!("{what}: lost {channel} on {at} ({why}); subscribing again")
                    }
                    None => return,
                }
            }
            Err(e) if !complained => {
                complained = true;
                log::warn!("{what}: cannot follow {channel} ({e}); will keep trying");
            }
            Err(_) => {}
        }
        tokio::time::sleep(pause).await;
        pause = (pause * 2).min(PAUSE_LAST);
    }
}

/// A connection subscribed to `channel` on the first target that accepts within
/// `io_timeout`, and that target's address.
async fn subscribe(
    targets: &[ConnectionInfo],
    channel: &str,
    io_timeout: Duration,
) -> Result<(PubSub, String), String> {
    let mut why = String::from("no server to subscribe to yet");
    for target in targets {
        let at = target.addr().to_string();
        let subscribed = async {
            let mut pubsub = Client::open(target.clone())?.get_async_pubsub().await?;
            pubsub.subscribe(channel).await?;
            Ok::<_, RedisError>(pubsub)
        };
        match tokio::time::timeout(io_timeout, subscribed).await {
            Ok(Ok(pubsub)) => return Ok((pubsub, at)),
            Ok(Err(e)) => why = format!("{at}: {e}"),
            Err(_) => why = format!("{at}: no answer within {io_timeout:?}"),
        }
    }
    Err(why)
}

/// Catches the listener up, then hands it every message until the connection fails
/// (returns why) or the listener is no longer wanted (returns None).
async fn listen(listener: &dyn Listener, pubsub: PubSub, io_timeout: Duration) -> Option<String> {
    // Subscribed first, then caught up: whatever changed in between is in the catch-up
    // or in a message.
    if let Err(e) = listener.subscribed().await {
        return Some(e);
    }
    let (mut sink, mut messages) = pubsub.split();
    let mut probe = tokio::time::interval(PROBE);
    probe.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    probe.tick().await;
    loop {
        tokio::select! {
            message = messages.next() => {
                let Some(message) = message else {
                    return Some("the server closed the connection".into());
                };
                if !listener.wanted() {
                    return None;
                }
                match message.get_payload::<String>() {
                    Ok(text) => listener.message(&text).await,
                    Err(e) => log::warn!("unreadable message on {}: {e}", message.get_channel_name()),
                }
            }
            _ = probe.tick() => {
                if !listener.wanted() {
                    return None;
                }
                match tokio::time::timeout(io_timeout, sink.ping::<redis::Value>()).await {
                    Ok(Ok(_)) => {}
                    Ok(Err(e)) => return Some(e.to_string()),
                    Err(_) => return Some(format!("no answer to PING within {io_timeout:?}")),
                }
                listener.probed().await;
            }
        }
    }
}
