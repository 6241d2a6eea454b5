//! Catching panics of user code (handlers and hooks) without a task per call.

use std::any::Any;
use std::future::Future;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::pin::Pin;
use std::task::{Context, Poll};

/// A panic payload, as produced by `catch_unwind`.
pub(crate) type Payload = Box<dyn Any + Send + 'static>;

/// Polls the inner future inside `catch_unwind`, turning a panic in any poll
/// into `Err(payload)`. Only for `Unpin` futures (the boxed futures that
/// `async_trait` produces), so no pin projection is needed.
///
/// `AssertUnwindSafe` is sound here in the sense that matters: after a panic
/// the actor is stopped, and its possibly inconsistent state is only shown to
/// its own `stopped` hook before being dropped.
pub(crate) struct CatchUnwind<F>(pub(crate) F);

impl<F: Future + Unpin> Future for CatchUnwind<F> {
    type Output = Result<F::Output, Payload>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let inner = &mut self.0;
        match catch_unwind(AssertUnwindSafe(|| Pin::new(inner).poll(cx))) {
            Ok(Poll::Pending) => Poll::Pending,
            Ok(Poll::Ready(out)) => Poll::Ready(Ok(out)),
            Err(payload) => Poll::Ready(Err(payload)),
        }
    }
}

/// The message of a panic payload (`panic!` produces `&str` or `String`).
pub(crate) fn panic_message(payload: &(dyn Any + Send)) -> String {
    if let Some(msg) = payload.downcast_ref::<&'static str>() {
        (*msg).to_owned()
    } else if let Some(msg) = payload.downcast_ref::<String>() {
        msg.clone()
    } else {
        "panic with a non-string payload".to_owned()
    }
}

/// Runs `f`, returning its panic message if it panics.
pub(crate) fn catch_sync(f: impl FnOnce()) -> Result<(), String> {
    catch_unwind(AssertUnwindSafe(f)).map_err(|payload| panic_message(&*payload))
}
