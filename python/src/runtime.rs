//! The process's tokio runtime: waiting on it with the GIL released (and
//! Ctrl-C heard), and values dropped inside it.

use crate::errors::RefitError;
use pyo3::prelude::*;
use std::future::Future;
use std::sync::OnceLock;
use std::time::Duration;

/// The process's tokio runtime and the process that made it.
struct Runtime {
    rt: tokio::runtime::Runtime,
    pid: u32,
}

static RUNTIME: OnceLock<Result<Runtime, String>> = OnceLock::new();

pub(crate) fn runtime() -> PyResult<&'static tokio::runtime::Runtime> {
    let made = RUNTIME.get_or_init(|| {
        let threads = std::thread::available_parallelism().map_or(2, |n| n.get()).clamp(2, 4);
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(threads)
            .thread_name("refit")
            .enable_all()
            .build()
            .map(|rt| Runtime { rt, pid: std::process::id() })
            .map_err(|e| format!("cannot start the refit runtime: {e}"))
    });
    match made {
        Ok(r) if r.pid == std::process::id() => Ok(&r.rt),
        Ok(r) => Err(RefitError::new_err(format!(
            "refit was used in process {} before it forked into this one ({}); a forked copy of its runtime does not work: \
             start worker processes with multiprocessing's 'spawn' (or 'forkserver') start method",
            r.pid,
            std::process::id()
        ))),
        Err(e) => Err(RefitError::new_err(e.clone())),
    }
}

/// Runs `fut` on the runtime and waits for it with the GIL released,
/// checking for signals every 100 ms: Ctrl-C (any Python signal handler
/// that raises) abandons the wait and raises. An abandoned refit call is
/// dropped on this side; the orchestrator actor finishes or fails that
/// refit on its own, and the next refit waits for it.
pub(crate) fn wait<T: Send + 'static>(py: Python<'_>, fut: impl Future<Output = PyResult<T>> + Send + 'static) -> PyResult<T> {
    let rt = runtime()?;
    let mut handle = rt.spawn(fut);
    loop {
        let polled = py.detach(|| rt.block_on(async { tokio::time::timeout(Duration::from_millis(100), &mut handle).await }));
        match polled {
            Ok(Ok(result)) => return result,
            Ok(Err(e)) => return Err(RefitError::new_err(format!("internal error in refit (please report): {e}"))),
            Err(_elapsed) => {
                if let Err(e) = py.check_signals() {
                    handle.abort();
                    return Err(e);
                }
            }
        }
    }
}

/// Holds `T` and drops it inside the runtime (actors, nodes and sockets
/// may spawn or deregister on drop).
pub(crate) struct InRuntime<T>(pub(crate) Option<T>);

impl<T> InRuntime<T> {
    pub(crate) fn get(&self) -> &T {
        // Only `drop` takes the value out.
        self.0.as_ref().expect("taken only on drop")
    }
}

impl<T> Drop for InRuntime<T> {
    fn drop(&mut self) {
        if let Some(value) = self.0.take() {
            match RUNTIME.get() {
                Some(Ok(r)) if r.pid == std::process::id() => {
                    let _entered = r.rt.enter();
                    drop(value);
                }
                // A forked child: the runtime's threads are not here; leak
                // rather than touch a runtime that cannot run.
                _ => std::mem::forget(value),
            }
        }
    }
}
