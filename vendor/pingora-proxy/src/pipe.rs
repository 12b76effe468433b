// sluice: the bounded pipe of tasks between the two halves of an HTTP/1 proxy session.
//
// The halves run joined in one future (`proxy_1to1`), so its two pipes can be one small
// allocation that future owns and lends to both halves. tokio's mpsc, used before, allocated
// a channel and a block of 32 slots per direction per request: four allocations written
// fresh for every request, and cold when many connections are in flight. (On the future's
// frame instead, the pipes grew every connection's task, idle ones included, by 1 KiB.)
// The behaviour the halves rely on is tokio's: `N` permits; a permit reserved is a slot
// held until it is used or dropped; `recv` is cancel safe and gives `None` once the sender
// is gone and the pipe is empty; sending fails once the receiver is gone (`is_closed`).

use std::fmt;
use std::future::poll_fn;
use std::sync::Mutex;
use std::task::{Context, Poll, Waker};

/// A pipe of at most `N` values in flight.
pub(crate) struct Pipe<T, const N: usize> {
    state: Mutex<State<T, N>>,
}

struct State<T, const N: usize> {
    slots: [Option<T>; N],
    head: usize,
    len: usize,
    /// Permits out: slots promised to a sender.
    reserved: usize,
    sender_gone: bool,
    receiver_gone: bool,
    receiver_waiting: Option<Waker>,
    sender_waiting: Option<Waker>,
}

/// The receiver is gone: nothing sent now would be read.
#[derive(Debug)]
pub(crate) struct Closed;

impl fmt::Display for Closed {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("the task pipe is closed")
    }
}

impl std::error::Error for Closed {}

impl<T, const N: usize> Pipe<T, N> {
    pub(crate) fn new() -> Self {
        Pipe {
            state: Mutex::new(State {
                slots: std::array::from_fn(|_| None),
                head: 0,
                len: 0,
                reserved: 0,
                sender_gone: false,
                receiver_gone: false,
                receiver_waiting: None,
                sender_waiting: None,
            }),
        }
    }

    /// Its two ends; each closes the pipe when dropped.
    pub(crate) fn ends(&self) -> (Sender<'_, T, N>, Receiver<'_, T, N>) {
        (Sender { pipe: self }, Receiver { pipe: self })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State<T, N>> {
        // Nothing panics while holding it; a poisoned lock still holds consistent state.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl<T, const N: usize> State<T, N> {
    /// Promises a slot to a sender (`reserve` and `try_reserve` alike).
    fn take_slot(&mut self) -> Result<(), TryReserveError> {
        if self.receiver_gone {
            return Err(TryReserveError::Closed);
        }
        if self.len + self.reserved == N {
            return Err(TryReserveError::Full);
        }
        self.reserved += 1;
        Ok(())
    }
}

fn wake(waiting: &mut Option<Waker>) {
    if let Some(w) = waiting.take() {
        w.wake();
    }
}

fn park(waiting: &mut Option<Waker>, cx: &Context<'_>) {
    match waiting {
        Some(w) if w.will_wake(cx.waker()) => {}
        _ => *waiting = Some(cx.waker().clone()),
    }
}

pub(crate) struct Sender<'a, T, const N: usize> {
    pipe: &'a Pipe<T, N>,
}

/// A slot held for one value.
pub(crate) struct Permit<'a, T, const N: usize> {
    pipe: &'a Pipe<T, N>,
}

impl<'a, T, const N: usize> Sender<'a, T, N> {
    fn poll_reserve(&self, cx: &Context<'_>) -> Poll<Result<Permit<'_, T, N>, Closed>> {
        let mut s = self.pipe.lock();
        match s.take_slot() {
            Ok(()) => Poll::Ready(Ok(Permit { pipe: self.pipe })),
            Err(TryReserveError::Closed) => Poll::Ready(Err(Closed)),
            Err(TryReserveError::Full) => {
                park(&mut s.sender_waiting, cx);
                Poll::Pending
            }
        }
    }

    /// Waits for a free slot.
    pub(crate) async fn reserve(&self) -> Result<Permit<'_, T, N>, Closed> {
        poll_fn(|cx| self.poll_reserve(cx)).await
    }

    /// A free slot now, or why not (`Closed`, or the pipe is full).
    pub(crate) fn try_reserve(&self) -> Result<Permit<'_, T, N>, TryReserveError> {
        self.pipe.lock().take_slot()?;
        Ok(Permit { pipe: self.pipe })
    }

    /// Waits for a free slot and sends `value` into it.
    pub(crate) async fn send(&self, value: T) -> Result<(), Closed> {
        self.reserve().await?.send(value);
        Ok(())
    }

    pub(crate) fn is_closed(&self) -> bool {
        self.pipe.lock().receiver_gone
    }
}

impl<T, const N: usize> Drop for Sender<'_, T, N> {
    fn drop(&mut self) {
        let mut s = self.pipe.lock();
        s.sender_gone = true;
        wake(&mut s.receiver_waiting);
    }
}

#[derive(Debug)]
pub(crate) enum TryReserveError {
    Full,
    Closed,
}

impl fmt::Display for TryReserveError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            TryReserveError::Full => f.write_str("the task pipe is full"),
            TryReserveError::Closed => f.write_str("the task pipe is closed"),
        }
    }
}

impl std::error::Error for TryReserveError {}

impl<T, const N: usize> Permit<'_, T, N> {
    pub(crate) fn send(self, value: T) {
        let mut s = self.pipe.lock();
        s.reserved -= 1;
        if s.receiver_gone {
            // Dropped unread, as tokio drops what a closed channel still holds.
            drop(s);
            drop(value);
        } else {
            let tail = (s.head + s.len) % N;
            s.slots[tail] = Some(value);
            s.len += 1;
            wake(&mut s.receiver_waiting);
            drop(s);
        }
        std::mem::forget(self);
    }
}

impl<T, const N: usize> Drop for Permit<'_, T, N> {
    fn drop(&mut self) {
        // Unused: the slot is free again.
        let mut s = self.pipe.lock();
        s.reserved -= 1;
        wake(&mut s.sender_waiting);
    }
}

impl<T, const N: usize> fmt::Debug for Permit<'_, T, N> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Permit")
    }
}

pub(crate) struct Receiver<'a, T, const N: usize> {
    pipe: &'a Pipe<T, N>,
}

impl<T, const N: usize> Receiver<'_, T, N> {
    fn poll_recv(&mut self, cx: &Context<'_>) -> Poll<Option<T>> {
        let mut s = self.pipe.lock();
        if s.len > 0 {
            let head = s.head;
            let value = s.slots[head].take();
            s.head = (head + 1) % N;
            s.len -= 1;
            wake(&mut s.sender_waiting);
            return Poll::Ready(value);
        }
        if s.sender_gone {
            return Poll::Ready(None);
        }
        park(&mut s.receiver_waiting, cx);
        Poll::Pending
    }

    /// The next value; `None` once the sender is gone and nothing is left. Cancel safe: a
    /// value is taken only by the poll that returns it.
    pub(crate) async fn recv(&mut self) -> Option<T> {
        poll_fn(|cx| self.poll_recv(cx)).await
    }
}

impl<T, const N: usize> Drop for Receiver<'_, T, N> {
    fn drop(&mut self) {
        let mut s = self.pipe.lock();
        s.receiver_gone = true;
        let left: Vec<T> = s.slots.iter_mut().filter_map(Option::take).collect();
        s.len = 0;
        wake(&mut s.sender_waiting);
        drop(s);
        // Dropped outside the lock: a task's drop runs arbitrary code.
        drop(left);
    }
}
