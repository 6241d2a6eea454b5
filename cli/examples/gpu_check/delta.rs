//! The `orchestrator-ipc-delta` check: delta refits on the IPC fabric,
//! every member in one process on one GPU. Written over a [`CommPlane`],
//! so the same check runs on the simulated plane in a test without a GPU.

use crate::ipc_layouts::{checked_w, ipc_value, IPC_DST, IPC_SRC};
use orchestrator::{spawn_orchestrator, CommPlane, DstStore, Fabric, IpcFabric, Member, MemberConfig, OrchestratorConfig, Role, SrcStore};
use reshard::parse_layout;
use serde_json::{json, Value};
use std::sync::Arc;

/// Delta refits on the IPC fabric of `plane`, every member in this process
/// on GPU `gpu`: the first refit dense in its encodings, then two after a
/// few hundred elements changed, each checked element by element, the
/// later ones sending a small fraction of the bytes (each message read
/// from the device, encoded on the host, and written back).
pub(crate) fn ipc_delta(plane: CommPlane, gpu: Option<usize>) -> Result<(String, Value), String> {
    use actors::{spawn, ActorGroup, SpawnConfig};
    let (src, dst) =
        (Arc::new(parse_layout(IPC_SRC).map_err(|e| e.to_string())?), Arc::new(parse_layout(IPC_DST).map_err(|e| e.to_string())?));
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(4).enable_all().build().map_err(|e| e.to_string())?;
    rt.block_on(async {
        let config = OrchestratorConfig { fabric: Fabric::Ipc(IpcFabric::new(plane)), delta: true, ..OrchestratorConfig::default() };
        let on_gpu = MemberConfig { gpu, ..MemberConfig::default() };
        let spawn_config = SpawnConfig::default().call_timeout(config.deadline + config.control_timeout);
        let src_stores: Vec<_> = (0..src.ranks()).map(|r| Arc::new(SrcStore::new(&src, r))).collect();
        let dst_stores: Vec<_> = (0..dst.ranks()).map(|r| Arc::new(DstStore::new(&dst, r))).collect();
        let member = |layout: &Arc<reshard::Layout>, r: u32, role: Role| {
            spawn(Member::with_config(layout.clone(), r, role, on_gpu.clone()), spawn_config.clone())
        };
        let srcs = src_stores.iter().enumerate().map(|(r, s)| member(&src, r as u32, Role::Src(s.clone()))).collect();
        let dsts = dst_stores.iter().enumerate().map(|(r, s)| member(&dst, r as u32, Role::Dst(s.clone()))).collect();
        let orchestrator = spawn_orchestrator(ActorGroup::from_refs(srcs), ActorGroup::from_refs(dsts), config);
        // Step k changes the first 300 elements of each source's rows.
        let value = |at: &[u64], k: u64| if at[1] < 300 && at[0].is_multiple_of(512) { ipc_value(at) + k as f32 } else { ipc_value(at) };
        let (mut bytes, mut checked) = (Vec::new(), 0u64);
        for k in 1..=3u64 {
            let mut version = 0;
            for s in &src_stores {
                version = s.try_update(|b| b.tensor_mut("w")?.map_f32(|at, _| value(at, k))).await.map_err(|e| e.to_string())?.0;
            }
            let report = orchestrator.refit(version).await.map_err(|e| format!("refit {k}: {e}"))?;
            for (r, store) in dst_stores.iter().enumerate() {
                let snap = store.snapshot().ok_or(format!("refit {k}: dst[{r}] serves nothing"))?;
                if snap.version != version {
                    return Err(format!("refit {k}: dst[{r}] serves version {}, not {version}", snap.version));
                }
                checked += checked_w(&snap.buffers, |at| value(at, k)).map_err(|e| format!("refit {k}: dst[{r}]: {e}"))?;
            }
            bytes.push(report.bytes);
        }
        if bytes[1] * 4 > bytes[0] || bytes[2] * 4 > bytes[0] {
            return Err(format!("delta refits sent {bytes:?} bytes: the later ones should be a small fraction of the first"));
        }
        Ok((
            format!("3 delta refits on the IPC fabric, one GPU: {bytes:?} bytes on the wire, {checked} elements checked"),
            json!({ "bytes": bytes, "elements": checked }),
        ))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The check on the simulated IPC plane (the same delta exchange over
    /// host memory) passes: every element, and the later refits small.
    #[test]
    fn ipc_delta_passes_on_the_simulated_plane() {
        let (line, fields) = ipc_delta(CommPlane::Simulated { world: "gpu-check-delta".into() }, None).unwrap();
        assert!(line.contains("3 delta refits"), "{line}");
        let bytes: Vec<u64> = fields["bytes"].as_array().unwrap().iter().map(|b| b.as_u64().unwrap()).collect();
        assert!(bytes[1] * 4 <= bytes[0] && bytes[2] * 4 <= bytes[0], "{bytes:?}");
        assert_eq!(fields["elements"], json!(3 * 2048 * 1024));
    }
}
