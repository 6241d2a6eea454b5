//! Checks of NCCL itself: one communicator created, used and aborted
//! (`nccl`), and one whose peer never comes (`nccl-missing-peer`).

use super::{e2s, gbps, spec, Ctx};
use reshard::{DType, Endpoint};
use serde_json::{json, Value};
use std::time::{Duration, Instant};
use transport::{
    cuda::{create_comms, AbortOutcome, CommConfig, CommId, DeviceMemory, P2p},
    RankMemory,
};

pub(super) fn nccl(ctx: &Ctx) -> Result<(String, Value), String> {
    let dev = &ctx.dev;
    let abort_timeout = Duration::from_secs(10);
    let config = CommConfig { init_timeout: Duration::from_secs(60), abort_timeout, ..CommConfig::new(0, 1) };
    let bytes = 64usize << 20;
    let mut lines = Vec::new();
    let mut fields = Vec::new();
    for attempt in ["first", "new id"] {
        let id = CommId::generate().map_err(|e| e.to_string())?;
        let t = Instant::now();
        let mut comm = create_comms(&[(dev.ordinal(), 0)], id, config).remove(0).map_err(|e| format!("{attempt}: {e}"))?;
        let init = t.elapsed();
        let t = Instant::now();
        // SAFETY: an empty group names no memory.
        unsafe { comm.group(0, Vec::new(), None, Instant::now() + Duration::from_secs(30)) }
            .map_err(|e| format!("{attempt}: empty group: {e}"))?;
        let empty = t.elapsed();
        let me = Endpoint::src(0);
        let data: Vec<u8> = (0..bytes).map(|i| (i * 31 + 7) as u8).collect();
        let mut a = DeviceMemory::for_buffers(dev, me, &[spec(DType::U8, bytes as u64)]).map_err(e2s)?;
        let mut b = DeviceMemory::for_buffers(dev, me, &[spec(DType::U8, bytes as u64)]).map_err(e2s)?;
        a.upload(dev, &RankMemory { buffers: vec![data.clone()], dtypes: vec![DType::U8] }).map_err(e2s)?;
        b.zero(dev).map_err(e2s)?;
        let (pa, pb) = (a.device_addrs()[0], b.device_addrs()[0]);
        let ops = vec![P2p::Send { peer: 0, addr: pa, bytes: bytes as u64 }, P2p::Recv { peer: 0, addr: pb, bytes: bytes as u64 }];
        let t = Instant::now();
        // SAFETY: both buffers hold `bytes` bytes on this device and
        // live until after the group; if it fails they are never freed.
        if let Err(e) = unsafe { comm.group(1, ops, None, Instant::now() + Duration::from_secs(30)) } {
            std::mem::forget((a, b));
            return Err(format!("{attempt}: self send/recv: {e}"));
        }
        let sendrecv = t.elapsed();
        if b.download(dev).map_err(e2s)?.buffers[0] != data {
            return Err(format!("{attempt}: MISMATCH: received bytes differ from the sent ones"));
        }
        let t = Instant::now();
        let outcome = comm.abort();
        let aborted = t.elapsed();
        if !matches!(outcome, AbortOutcome::Aborted { .. }) || aborted > abort_timeout {
            return Err(format!("{attempt}: abort: {outcome:?} after {aborted:?} (deadline {abort_timeout:?})"));
        }
        lines.push(format!(
            "{attempt}: init {init:?}, empty group {empty:?}, 64 MiB to itself {sendrecv:?} ({:.1} GB/s) verified, abort {aborted:?}",
            gbps(bytes as u64, sendrecv)
        ));
        fields.push(json!({ "init_s": init.as_secs_f64(), "sendrecv_s": sendrecv.as_secs_f64(), "abort_s": aborted.as_secs_f64() }));
    }
    Ok((lines.join("; "), json!({ "attempts": fields })))
}

/// A communicator of two ranks of which one never comes, with a 3 s
/// creation timeout: creation fails by then, its cleanup abort either
/// finishes or its thread is counted as abandoned, and the caller is
/// answered within the timeouts.
pub(super) fn nccl_missing_peer(ctx: &Ctx) -> Result<(String, Value), String> {
    use transport::cuda::{abandoned_comm_threads, CommError};
    let (init_timeout, abort_timeout) = (Duration::from_secs(3), Duration::from_secs(5));
    let config = CommConfig { init_timeout, abort_timeout, ..CommConfig::new(0, 2) };
    let id = CommId::generate().map_err(|e| e.to_string())?;
    let t = Instant::now();
    let r = create_comms(&[(ctx.dev.ordinal(), 0)], id, config).remove(0);
    let took = t.elapsed();
    let bound = init_timeout + abort_timeout + Duration::from_secs(2);
    match r {
        Ok(_) => Err("a communicator of 2 was made with only 1 rank".into()),
        Err(e @ CommError::InitTimeout { abandoned, .. }) if took <= bound => Ok((
            format!("{e} — answered in {took:?} (bound {bound:?})"),
            json!({ "answered_s": took.as_secs_f64(), "abandoned": abandoned, "abandoned_threads": abandoned_comm_threads() }),
        )),
        Err(e) => Err(format!("after {took:?} (bound {bound:?}): {e}")),
    }
}
