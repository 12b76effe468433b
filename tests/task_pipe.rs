//! The vendored pingora-proxy's task pipe (vendor/pingora-proxy/src/pipe.rs), which carries
//! every HTTP/1 proxied request's body and response between the two halves: tokio mpsc's
//! behaviour, which those halves rely on (bounded permits, in order, closed by either end,
//! cancel-safe waits). Compiled here from the same file, since the vendored crate's own tests
//! are not built.

#![allow(dead_code)]

#[path = "../vendor/pingora-proxy/src/pipe.rs"]
mod pipe;

use std::time::Duration;

use futures_util::FutureExt;
use pipe::{Pipe, TryReserveError};

#[test]
fn in_order_bounded_and_closed_by_either_end() {
    let pipe: Pipe<u32, 2> = Pipe::new();
    let (tx, mut rx) = pipe.ends();
    let a = tx.try_reserve().expect("a free slot");
    let b = tx.try_reserve().expect("the second slot");
    assert!(matches!(tx.try_reserve(), Err(TryReserveError::Full)));
    assert!(tx.reserve().now_or_never().is_none(), "full: reserve waits");
    b.send(1);
    drop(a); // an unused permit frees its slot
    assert!(matches!(tx.send(2).now_or_never(), Some(Ok(()))));
    assert!(tx.try_reserve().is_err());
    assert_eq!(rx.recv().now_or_never(), Some(Some(1)));
    assert_eq!(rx.recv().now_or_never(), Some(Some(2)));
    assert_eq!(rx.recv().now_or_never(), None, "empty: recv waits");
    assert!(matches!(tx.send(3).now_or_never(), Some(Ok(()))));
    drop(tx);
    assert_eq!(
        rx.recv().now_or_never(),
        Some(Some(3)),
        "what was sent is still read"
    );
    assert_eq!(
        rx.recv().now_or_never(),
        Some(None),
        "then the sender's end is seen"
    );

    let pipe: Pipe<u32, 2> = Pipe::new();
    let (tx, rx) = pipe.ends();
    assert!(matches!(tx.send(1).now_or_never(), Some(Ok(()))));
    assert!(!tx.is_closed());
    drop(rx);
    assert!(tx.is_closed());
    assert!(matches!(tx.send(2).now_or_never(), Some(Err(_))));
    assert!(matches!(tx.try_reserve(), Err(TryReserveError::Closed)));
}

/// Two pipes between two halves joined in one task, as in proxy_h1: every value arrives, in
/// order, through waits on both sides (a full pipe, an empty one, a timer), and a send
/// cancelled by the other branch of a select loses nothing.
#[tokio::test]
async fn joined_halves_wake_each_other() {
    const N: u32 = 5_000;
    let there: Pipe<u32, 4> = Pipe::new();
    let back: Pipe<u32, 4> = Pipe::new();
    let (tx, mut rx) = there.ends();
    let (tx_back, mut rx_back) = back.ends();
    let sending = async move {
        let (mut next, mut acked) = (0u32, 0u32);
        let mut tx = Some(tx);
        loop {
            tokio::select! {
                sent = async { tx.as_ref().expect("sender").send(next).await }, if tx.is_some() => {
                    sent.expect("receiver alive");
                    next += 1;
                    if next == N {
                        tx = None;
                    }
                }
                ack = rx_back.recv() => match ack {
                    Some(v) => acked += v,
                    None => break,
                },
            }
        }
        acked
    };
    let echoing = async move {
        let mut expected = 0u32;
        while let Some(v) = rx.recv().await {
            assert_eq!(v, expected);
            expected += 1;
            if expected.is_multiple_of(500) {
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
            tx_back.reserve().await.expect("receiver alive").send(1);
        }
        expected
    };
    let (acked, echoed) = tokio::time::timeout(Duration::from_secs(30), async {
        tokio::join!(sending, echoing)
    })
    .await
    .expect("no deadlock");
    assert_eq!((acked, echoed), (N, N));
}
