//! The `fp8-at-source` check: block-scaled FP8 quantized at the source on
//! the device. `examples/fp8-source-quantized/` refit through the
//! orchestrator on the IPC fabric, every member in this process on one
//! GPU: the source ranks quantize the tensors whose blocks they hold whole
//! (on the device, before their first send) and send codes and scales;
//! every byte each destination serves must equal what the host executor,
//! with the host quantizer, delivers for the same plan and values. Written
//! over a [`CommPlane`], so the same check runs on the simulated plane in
//! a test without a GPU.

use orchestrator::{CommPlane, DstStore, Fabric, IpcFabric, Member, MemberConfig, OrchestratorConfig, Role, SrcStore};
use reshard::{parse_layout, plan_reshard, BufferKey, BufferSpec, Layout, PlanOptions};
use serde_json::{json, Value};
use std::path::Path;
use std::sync::Arc;
use transport::{fill_sources, run_local, verify_destinations, ExecOptions, RankMemory};

fn load(path: &Path) -> Result<Layout, String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
    parse_layout(&text).map_err(|e| format!("{}: {e}", path.display()))
}

/// The bytes of the buffer `key` in memory laid out as `specs`.
fn buffer<'a>(specs: &[BufferSpec], memory: &'a RankMemory, key: BufferKey) -> Option<&'a [u8]> {
    specs.iter().position(|s| s.key == key).and_then(|i| memory.buffers.get(i)).map(Vec::as_slice)
}

/// The bytes checked, or the first that differs from the host
/// quantizer's (or a length that does).
fn same_bytes(what: &str, want: &[u8], got: &[u8]) -> Result<u64, String> {
    match (0..want.len().max(got.len())).find(|&i| want.get(i) != got.get(i)) {
        None => Ok(want.len() as u64),
        Some(at) => {
            Err(format!("MISMATCH: {what} byte {at} of {} differs from the host quantizer's ({} bytes served)", want.len(), got.len()))
        }
    }
}

/// Runs the check on `plane`, every member on GPU `gpu`; the layouts from
/// `root`/examples/fp8-source-quantized/.
pub(crate) fn fp8_at_source(root: &Path, plane: CommPlane, gpu: Option<usize>) -> Result<(String, Value), String> {
    use actors::{spawn, ActorGroup, SpawnConfig};
    let dir = root.join("examples/fp8-source-quantized");
    let (src, dst) = (Arc::new(load(&dir.join("src.json"))?), Arc::new(load(&dir.join("dst.json"))?));
    // The reference: the same plan and values on the host executor.
    let plan = plan_reshard(&src, &dst, &PlanOptions::default()).map_err(|e| e.to_string())?;
    let programs = plan.programs(&src, &dst).map_err(|e| e.to_string())?;
    let n_src = src.ranks() as usize;
    let at_source: Vec<String> = programs[..n_src].iter().filter(|p| !p.quantize.is_empty()).map(|p| p.endpoint.to_string()).collect();
    if at_source.is_empty() {
        return Err(format!("{}: the plan quantizes nothing at the source, so nothing is checked", dir.display()));
    }
    let mut host = RankMemory::for_programs(&programs);
    fill_sources(&src, &mut host[..n_src]);
    let inputs: Vec<RankMemory> = host[..n_src].to_vec();
    run_local(&programs, &mut host, &ExecOptions::default()).map_err(|e| format!("the host executor: {e}"))?;
    let elements = verify_destinations(&src, &dst, &host[n_src..]).map_err(|e| format!("the host executor's result: {e}"))?;

    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(4).enable_all().build().map_err(|e| e.to_string())?;
    rt.block_on(async {
        let config = OrchestratorConfig { fabric: Fabric::Ipc(IpcFabric::new(plane)), ..OrchestratorConfig::default() };
        let on_gpu = MemberConfig { gpu, ..MemberConfig::default() };
        let spawn_config = SpawnConfig::default().call_timeout(config.deadline + config.control_timeout);
        let src_stores: Vec<_> = (0..src.ranks()).map(|r| Arc::new(SrcStore::new(&src, r))).collect();
        let dst_stores: Vec<_> = (0..dst.ranks()).map(|r| Arc::new(DstStore::new(&dst, r))).collect();
        let member = |layout: &Arc<Layout>, r: u32, role: Role| spawn(Member::with_config(layout.clone(), r, role, on_gpu.clone()), spawn_config.clone());
        let srcs = src_stores.iter().enumerate().map(|(r, s)| member(&src, r as u32, Role::Src(s.clone()))).collect();
        let dsts = dst_stores.iter().enumerate().map(|(r, s)| member(&dst, r as u32, Role::Dst(s.clone()))).collect();
        let orchestrator = orchestrator::spawn_orchestrator(ActorGroup::from_refs(srcs), ActorGroup::from_refs(dsts), config);
        // The sources' weights: the host reference's values, buffer by buffer.
        let mut version = 0;
        for (r, store) in src_stores.iter().enumerate() {
            let (program, input) = (&programs[r], &inputs[r]);
            version = store
                .try_update(|b| -> Result<(), String> {
                    let specs = b.specs().to_vec();
                    let memory = b.memory_mut();
                    for (i, spec) in specs.iter().enumerate() {
                        let bytes = buffer(&program.buffers, input, spec.key).ok_or(format!("src rank {r}: no buffer '{}' in the plan", spec.name))?;
                        memory.buffers[i].copy_from_slice(bytes);
                    }
                    Ok(())
                })
                .await?
                .0;
        }
        let report = orchestrator.refit(version).await.map_err(|e| format!("refit: {e}"))?;
        let mut bytes_checked = 0u64;
        for (r, store) in dst_stores.iter().enumerate() {
            let snap = store.snapshot().ok_or(format!("dst rank {r} serves nothing"))?;
            if snap.version != version {
                return Err(format!("dst rank {r} serves version {}, not {version}", snap.version));
            }
            let program = &programs[n_src + r];
            for (spec, got) in snap.buffers.specs().iter().zip(&snap.buffers.memory().buffers) {
                let want = buffer(&program.buffers, &host[n_src + r], spec.key).ok_or(format!("dst rank {r}: no buffer '{}' in the plan", spec.name))?;
                bytes_checked += same_bytes(&format!("dst rank {r} buffer '{}'", spec.name), want, got)?;
            }
        }
        Ok((
            format!(
                "{}: {} quantized at the source, codes and scales sent; every one of the destinations' {bytes_checked} bytes equals the host \
                 quantizer's ({elements} elements), {} bytes on the wire in {:.1} ms",
                dir.file_name().unwrap_or_default().to_string_lossy(),
                at_source.join(", "),
                report.bytes,
                report.wall.as_secs_f64() * 1e3
            ),
            json!({ "quantized_at_source": at_source, "bytes_checked": bytes_checked, "elements": elements, "wire_bytes": report.bytes,
                    "wall_ms": report.wall.as_secs_f64() * 1e3 }),
        ))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The check on the simulated IPC plane (host memory, the same plane
    /// executor and the host quantizer) passes.
    #[test]
    fn fp8_at_source_passes_on_the_simulated_plane() {
        let root = &Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
        let plane = CommPlane::Simulated { world: "fp8-at-source".into() };
        let (line, fields) = fp8_at_source(root, plane, None).unwrap();
        assert!(line.contains("quantized at the source"), "{line}");
        assert!(fields["bytes_checked"].as_u64().unwrap() > 0);
        assert!(!fields["quantized_at_source"].as_array().unwrap().is_empty());
    }

    #[test]
    fn a_byte_or_a_length_that_differs_fails_naming_where() {
        assert_eq!(same_bytes("b", &[1, 2, 3], &[1, 2, 3]), Ok(3));
        let e = same_bytes("dst rank 2 buffer 'w'", &[1, 2, 3], &[1, 9, 3]).unwrap_err();
        assert_eq!(e, "MISMATCH: dst rank 2 buffer 'w' byte 1 of 3 differs from the host quantizer's (3 bytes served)");
        assert!(same_bytes("b", &[1, 2, 3], &[1, 2]).unwrap_err().contains("byte 2 of 3"));
    }

    #[test]
    fn a_root_without_the_example_is_an_error_naming_it() {
        let e = fp8_at_source(Path::new("/nonexistent"), CommPlane::Simulated { world: "fp8-missing".into() }, None).unwrap_err();
        assert!(e.contains("fp8-source-quantized/src.json"), "{e}");
    }
}
