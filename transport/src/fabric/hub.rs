//! This process's in-process channels of refits in progress, by session:
//! made for every rank at once, each rank takes its own end.

use crate::{local_fabric, LocalTransport, Transport as _};
use reshard::Endpoint;
use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};

type Sessions = HashMap<String, HashMap<Endpoint, LocalTransport>>;

fn sessions() -> std::sync::MutexGuard<'static, Sessions> {
    static HUB: OnceLock<Mutex<Sessions>> = OnceLock::new();
    HUB.get_or_init(Default::default).lock().unwrap_or_else(|e| e.into_inner())
}

/// Makes the in-process channels of refit `session` between `endpoints`
/// and leaves them in this process for each rank to take
/// ([`RankEnd::open`](super::RankEnd::open) with
/// [`Fabric::InProcess`](super::Fabric::InProcess)).
pub fn open_in_process(session: &str, endpoints: &[Endpoint]) {
    let ends = local_fabric(endpoints).into_iter().map(|t| (t.me(), t)).collect();
    sessions().insert(session.to_string(), ends);
}

/// A rank's end, once.
pub(super) fn take(session: &str, me: Endpoint) -> Option<LocalTransport> {
    sessions().get_mut(session)?.remove(&me)
}

/// Drops whatever of refit `session`'s channels no rank took (the refit
/// is over).
pub fn close_in_process(session: &str) {
    let left = sessions().remove(session);
    drop(left);
}
