//! [`Retry`]: attempts again, with backoff, what a crowded or restarting
//! peer may refuse once.

use std::future::Future;
use std::time::Duration;

use tokio::time::Instant;

use super::error::RemoteError;

/// Default [`Retry::timeout`].
pub const DEFAULT_RETRY_TIMEOUT: Duration = Duration::from_secs(60);

/// How an operation on a peer is retried after a failure another attempt
/// may not meet ([`RemoteError::is_transient`]): the first wait is
/// `first_backoff`, each next one twice the last, at most `max_backoff`,
/// each scaled by a random factor in [0.5, 1.5) (so clients dropped
/// together do not come back together), and no attempt starts after
/// `timeout` from the first. There is always a first attempt.
#[derive(Debug, Clone)]
pub struct Retry {
    /// No attempt starts after this long from the first (default 60 s).
    pub timeout: Duration,
    /// Wait before the second attempt (default 50 ms).
    pub first_backoff: Duration,
    /// Longest wait between attempts (default 2 s).
    pub max_backoff: Duration,
}

impl Default for Retry {
    fn default() -> Self {
        Retry { timeout: DEFAULT_RETRY_TIMEOUT, first_backoff: Duration::from_millis(50), max_backoff: Duration::from_secs(2) }
    }
}

impl Retry {
    /// These settings with `timeout` instead.
    pub fn within(&self, timeout: Duration) -> Retry {
        Retry { timeout, ..self.clone() }
    }

    /// Runs `attempt` until it succeeds, fails for good (returned as is
    /// when it is the first attempt, else as [`RemoteError::GaveUp`]), or
    /// the time is up ([`RemoteError::GaveUp`] with the last error). `peer`
    /// names the peer in logs and errors.
    pub async fn run<T, F, Fut>(&self, peer: &str, mut attempt: F) -> Result<T, RemoteError>
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = Result<T, RemoteError>>,
    {
        let started = Instant::now();
        let until = started + self.timeout;
        let mut backoff = self.first_backoff;
        let mut attempts = 0u32;
        loop {
            attempts += 1;
            let err = match attempt().await {
                Ok(done) => return Ok(done),
                Err(err) => err,
            };
            let wait = backoff.mul_f64(0.5 + unit_random());
            let gave_up = |last| RemoteError::GaveUp { peer: peer.to_owned(), attempts, elapsed: started.elapsed(), last: Box::new(last) };
            if !err.is_transient() {
                return Err(if attempts == 1 { err } else { gave_up(err) });
            }
            if Instant::now() + wait > until {
                return Err(gave_up(err));
            }
            tracing::warn!(%peer, attempt = attempts, error = %err, ?wait, "retrying after a transient failure");
            tokio::time::sleep(wait).await;
            backoff = (backoff * 2).min(self.max_backoff);
        }
    }
}

/// Uniform in [0, 1) (48 bits), from the OS's generator: the leading 48
/// bits of a v4 UUID are all random.
fn unit_random() -> f64 {
    (uuid::Uuid::new_v4().as_u128() >> 80) as f64 / (1u64 << 48) as f64
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::Cell;

    fn cut() -> RemoteError {
        RemoteError::HandshakeCut { peer: "p".into(), problem: "connection closed during the handshake".into() }
    }

    #[tokio::test(start_paused = true)]
    async fn transient_failures_are_retried_until_one_succeeds() {
        let tries = Cell::new(0);
        let got = Retry::default()
            .run("p", || {
                tries.set(tries.get() + 1);
                let n = tries.get();
                async move {
                    if n < 4 {
                        Err(cut())
                    } else {
                        Ok(n)
                    }
                }
            })
            .await;
        assert_eq!(got.unwrap(), 4);
    }

    #[tokio::test(start_paused = true)]
    async fn a_failure_retrying_cannot_help_comes_back_at_once() {
        let tries = Cell::new(0);
        let got: Result<(), _> = Retry::default()
            .run("p", || {
                tries.set(tries.get() + 1);
                async { Err(RemoteError::AuthFailed { peer: "p".into(), why: "the secrets differ".into() }) }
            })
            .await;
        assert!(got.unwrap_err().is_auth_failure());
        assert_eq!(tries.get(), 1);
    }

    #[tokio::test(start_paused = true)]
    async fn retries_stop_at_the_timeout_with_the_last_error() {
        let retry =
            Retry { timeout: Duration::from_secs(5), first_backoff: Duration::from_millis(100), max_backoff: Duration::from_secs(1) };
        let started = Instant::now();
        let got: Result<(), _> = retry.run("p", || async { Err(cut()) }).await;
        let err = got.unwrap_err();
        assert!(started.elapsed() <= Duration::from_secs(5), "{:?}", started.elapsed());
        match &err {
            RemoteError::GaveUp { attempts, last, .. } => {
                // 100 ms doubling to 1 s (±50%): several attempts in 5 s.
                assert!(*attempts >= 4, "{err}");
                assert!(matches!(**last, RemoteError::HandshakeCut { .. }), "{err}");
            }
            other => panic!("expected GaveUp, got {other:?}"),
        }
        assert!(err.to_string().starts_with("gave up on p after "), "{err}");
    }
}
