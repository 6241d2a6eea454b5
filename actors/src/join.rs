//! Polling many futures concurrently on the current task (a minimal
//! `join_all`/`try_join_all`, since `futures` is not a dependency).

use std::convert::Infallible;
use std::future::{poll_fn, Future};
use std::pin::Pin;
use std::task::Poll;

/// Awaits all futures concurrently; outputs are in input order. Returns the
/// first error as soon as it occurs (in completion order), dropping (thus
/// cancelling) the futures still pending.
pub(crate) async fn try_join_all<F, T, E>(futures: impl IntoIterator<Item = F>) -> Result<Vec<T>, E>
where
    F: Future<Output = Result<T, E>>,
{
    let mut pending: Vec<Option<Pin<Box<F>>>> = futures.into_iter().map(|f| Some(Box::pin(f))).collect();
    let mut outputs: Vec<Option<T>> = pending.iter().map(|_| None).collect();
    let mut remaining = pending.len();
    poll_fn(move |cx| {
        for (slot, output) in pending.iter_mut().zip(outputs.iter_mut()) {
            let Some(future) = slot else { continue };
            if let Poll::Ready(result) = future.as_mut().poll(cx) {
                *slot = None;
                remaining -= 1;
                match result {
                    Ok(value) => *output = Some(value),
                    Err(err) => return Poll::Ready(Err(err)),
                }
            }
        }
        if remaining == 0 {
            // Every slot is `Some` here, so this keeps all outputs, in order.
            Poll::Ready(Ok(outputs.iter_mut().filter_map(Option::take).collect()))
        } else {
            Poll::Pending
        }
    })
    .await
}

/// Awaits all futures concurrently; outputs are in input order.
pub async fn join_all<F: Future>(futures: impl IntoIterator<Item = F>) -> Vec<F::Output> {
    let infallible = futures.into_iter().map(|f| async move { Ok::<_, Infallible>(f.await) });
    match try_join_all(infallible).await {
        Ok(outputs) => outputs,
        Err(never) => match never {},
    }
}
