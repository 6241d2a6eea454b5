//! Checks through the orchestrator: refits on the NCCL fabric over
//! several GPUs (`orchestrator`), colocated refits on the CUDA IPC fabric
//! between a child process and this one (`orchestrator-ipc`, in place or
//! not), delta refits on the IPC fabric in this process
//! (`orchestrator-ipc-delta`), and two ranks of one communicator on one
//! GPU refused (`nccl-same-device`).

use super::{e2s, Ctx};
use reshard::{parse_layout, Endpoint};
use serde_json::{json, Value};
use std::process::Command;
use std::time::{Duration, Instant};
use transport::cuda::{DeviceMemory, GpuDevice};

/// Refits through the orchestrator on the NCCL fabric over `gpus` GPUs.
fn orchestrated(gpus: usize) -> Result<(String, Value), String> {
    use orchestrator::{spawn_refit, CommPlane, Fabric, NcclFabric, OrchestratorConfig};
    let dst_ranks = (gpus - 1).min(7);
    let (rows, cols) = (4096u64, 4096u64);
    let src = format!(
        r#"{{"ranks": 1, "tensors": [{{"name": "w", "dtype": "f32", "shape": [{rows}, {cols}], "shards": [
                {{"rank": 0, "offset": [0, 0], "extent": [{rows}, {cols}], "buffer": "params", "at": 0}}]}}]}}"#
    );
    let dst = format!(
        r#"{{"ranks": {dst_ranks}, "tensors": [{{"name": "w", "dtype": "bf16", "shape": [{rows}, {cols}],
                "mesh": {{"shape": [{dst_ranks}]}}, "placements": ["shard(0)"]}}]}}"#
    );
    let (src, dst) = (parse_layout(&src).map_err(e2s)?, parse_layout(&dst).map_err(e2s)?);
    // Integers below 256: exact in bf16.
    let value = |i: u64, k: u64| ((i % 100) + k) as f32;
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(4).enable_all().build().map_err(e2s)?;
    rt.block_on(async {
        let config = OrchestratorConfig {
            fabric: Fabric::Nccl(NcclFabric::new(CommPlane::Cuda)),
            deadline: Duration::from_secs(60),
            ..OrchestratorConfig::default()
        };
        let sys = spawn_refit(&src, &dst, config).await.map_err(e2s)?;
        let mut lines = Vec::new();
        let mut checked = 0u64;
        for k in 1..=3u64 {
            let (v, _) =
                sys.src_stores[0].try_update(|b| b.tensor_mut("w")?.map_f32(|at, _| value(at[0] * cols + at[1], k))).await.map_err(e2s)?;
            let report = sys.orchestrator.refit(v).await.map_err(|e| format!("refit {k}: {e}"))?;
            for (r, store) in sys.dst_stores.iter().enumerate() {
                let snap = store.snapshot().ok_or(format!("refit {k}: dst[{r}] serves nothing"))?;
                checked +=
                    checked_w(&snap.buffers, |at| value(at[0] * cols + at[1], k)).map_err(|e| format!("refit {k}: dst[{r}]: {e}"))?;
            }
            lines.push(format!("v{v}: {:.1} ms{}", report.wall.as_secs_f64() * 1e3, if report.resumed { " (kept)" } else { "" }));
        }
        Ok((
            format!("1 source + {dst_ranks} destinations on {} GPUs, {checked} elements checked; {}", dst_ranks + 1, lines.join(", ")),
            json!({ "gpus": dst_ranks + 1, "elements": checked, "refits": lines }),
        ))
    })
}

/// Checks every element of tensor `w` in `buffers` against `want(coords)`:
/// the elements checked, or the first that differs (or why the tensor
/// could not be read).
fn checked_w(buffers: &orchestrator::Buffers, want: impl Fn(&[u64]) -> f32) -> Result<u64, String> {
    let view = buffers.tensor("w").map_err(e2s)?;
    let got = view.to_f32().map_err(e2s)?;
    let mut bad = None;
    view.for_each_index(|i, at| {
        if bad.is_none() && got[i] != want(at) {
            bad = Some(format!("MISMATCH: element {at:?}"));
        }
    });
    bad.map_or(Ok(got.len() as u64), Err)
}

/// The layouts of the `orchestrator-ipc` check and its values.
const IPC_SRC: &str = r#"{"ranks": 2, "tensors": [{"name": "w", "dtype": "f32", "shape": [2048, 1024], "shards": [
        {"rank": 0, "offset": [0, 0], "extent": [1024, 1024], "buffer": "params", "at": 0},
        {"rank": 1, "offset": [1024, 0], "extent": [1024, 1024], "buffer": "params", "at": 0}]}]}"#;
const IPC_DST: &str = r#"{"ranks": 2, "tensors": [{"name": "w", "dtype": "bf16", "shape": [2048, 1024],
        "mesh": {"shape": [2]}, "placements": ["shard(1)"]}]}"#;

/// Integers below 256: exact in bf16.
fn ipc_value(at: &[u64]) -> f32 {
    ((at[0] * 1024 + at[1]) % 251) as f32
}

/// The `orchestrator-ipc` check's child: serves both source members on
/// GPU 0 with version 1 written, until the rendezvous closes.
pub(super) fn ipc_members() -> Result<(), String> {
    use orchestrator::{join, JoinConfig, MemberConfig, Role, SrcStore};
    use std::sync::Arc;
    let src = Arc::new(parse_layout(IPC_SRC).map_err(e2s)?);
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().map_err(e2s)?;
    rt.block_on(async {
        let joined = join(&JoinConfig::from_env().map_err(e2s)?).await.map_err(e2s)?;
        for rank in 0..src.ranks() {
            let store = Arc::new(SrcStore::new(&src, rank));
            store.try_update(|b| b.tensor_mut("w")?.map_f32(|at, _| ipc_value(at))).await.map_err(e2s)?;
            let config = MemberConfig { gpu: Some(0), ..joined.member_config() };
            joined.serve_member_with(src.clone(), rank, Role::Src(store), config).await.map_err(e2s)?;
        }
        joined.closed().await;
        joined.shutdown();
        Ok(())
    })
}

/// Where the `orchestrator-ipc` checks' destinations serve their
/// weights.
#[derive(Clone, Copy, PartialEq)]
enum Served {
    /// In their stores (host memory).
    Stores,
    /// In device buffers of this process registered in place
    /// (`DstStore::registered`): the refit's commit copies into them.
    InPlace,
}

pub(super) fn orchestrated_ipc(ctx: &Ctx) -> Result<(String, Value), String> {
    orchestrated_ipc_into(&ctx.dev, Served::Stores)
}

pub(super) fn orchestrated_ipc_in_place(ctx: &Ctx) -> Result<(String, Value), String> {
    orchestrated_ipc_into(&ctx.dev, Served::InPlace)
}

/// A colocated refit through the orchestrator on the CUDA IPC fabric,
/// between a child process (sources) and this one (destinations), on
/// one GPU.
fn orchestrated_ipc_into(dev: &GpuDevice, served: Served) -> Result<(String, Value), String> {
    use actors::{spawn, ActorGroup, Secret, SpawnConfig};
    use orchestrator::rendezvous::{ControlConfig, RENDEZVOUS_ENV, SECRET_ENV};
    use orchestrator::{
        spawn_orchestrator, CommPlane, DstStore, Fabric, IpcFabric, Member, MemberConfig, OrchestratorConfig, Rendezvous, Role,
    };
    use orchestrator::{Buffers, Registered, Residence};
    use reshard::Group;
    use std::sync::Arc;
    let (src, dst) = (parse_layout(IPC_SRC).map_err(e2s)?, Arc::new(parse_layout(IPC_DST).map_err(e2s)?));
    let wait = Duration::from_secs(60);
    // The destinations' own device buffers (in place): declared before
    // the runtime, so they outlive every store and member that names
    // them.
    let mut device = Vec::new();
    if served == Served::InPlace {
        for r in 0..dst.ranks() {
            let mem = DeviceMemory::for_buffers(dev, Endpoint::dst(r), &dst.rank_buffers(r)).map_err(e2s)?;
            device.push(mem);
        }
    }
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(4).enable_all().build().map_err(e2s)?;
    rt.block_on(async {
        let secret_text = format!("{}{}", uuid::Uuid::new_v4().simple(), uuid::Uuid::new_v4().simple());
        let secret = Secret::from_bytes(secret_text.as_bytes().to_vec()).map_err(e2s)?;
        // Destination members here prove the job's secret too.
        let member_config = MemberConfig { gpu: Some(0), secret: Some(secret.clone()), ..MemberConfig::default() };
        let rendezvous = Rendezvous::bind(secret, "127.0.0.1:0".parse().map_err(e2s)?, &ControlConfig::default()).await.map_err(e2s)?;
        let exe = std::env::current_exe().map_err(e2s)?;
        let mut child = Command::new(exe)
            .arg("--ipc-members")
            .env(RENDEZVOUS_ENV, rendezvous.addr().to_string())
            .env(SECRET_ENV, &secret_text)
            .spawn()
            .map_err(|e| format!("starting the source process: {e}"))?;
        let result = async {
            let src_members = rendezvous.members(Group::Src, src.ranks(), wait).await.map_err(e2s)?;
            let mut stores: Vec<Arc<DstStore>> = Vec::new();
            for r in 0..dst.ranks() {
                stores.push(Arc::new(match device.get(r as usize) {
                    None => DstStore::new(&dst, r),
                    Some(mem) => {
                        let regions = mem.device_addrs().iter().copied().zip(mem.buffer_lens().iter().copied()).collect();
                        // SAFETY: `device` is this process's allocation on
                        // GPU 0, alive until after the runtime (and so
                        // every store) is gone; read below only inside
                        // `serve`.
                        let reg = unsafe { Registered::new(&dst, r, Residence::Device { ordinal: 0 }, regions) }.map_err(e2s)?;
                        DstStore::registered(&dst, r, reg)
                    }
                }));
            }
            let config = OrchestratorConfig { fabric: Fabric::Ipc(IpcFabric::new(CommPlane::Cuda)), ..OrchestratorConfig::default() };
            let members = stores
                .iter()
                .enumerate()
                .map(|(r, s)| {
                    let member = Member::with_config(dst.clone(), r as u32, Role::Dst(s.clone()), member_config.clone());
                    spawn(member, SpawnConfig::default().call_timeout(config.deadline + config.control_timeout))
                })
                .collect();
            let orchestrator = spawn_orchestrator(src_members, ActorGroup::from_refs(members), config);
            let report = orchestrator.refit(1).await.map_err(|e| format!("refit: {e}"))?;
            let mut checked = 0u64;
            for (r, store) in stores.iter().enumerate() {
                let serving = store.serve().await;
                if serving.version() != Some(1) {
                    return Err(format!("dst[{r}] serves {:?}, not version 1", serving.version()));
                }
                let snap = store.snapshot().ok_or(format!("dst[{r}] serves nothing"))?;
                let mut copied = Buffers::new(&dst, r as u32);
                let buffers = match device.get(r) {
                    None => &snap.buffers,
                    Some(mem) => {
                        *copied.memory_mut() = mem.download(dev).map_err(e2s)?;
                        &copied
                    }
                };
                drop(serving);
                checked += checked_w(buffers, ipc_value).map_err(|e| format!("dst[{r}]: {e}"))?;
            }
            Ok((
                format!(
                    "2 sources in process {} → 2 destinations here{}, one GPU: {checked} elements checked, {:.1} ms (commit {:.1} ms)",
                    child.id(),
                    if served == Served::InPlace { " (registered device buffers)" } else { "" },
                    report.wall.as_secs_f64() * 1e3,
                    report.commit_time.as_secs_f64() * 1e3
                ),
                json!({ "elements": checked, "wall_ms": report.wall.as_secs_f64() * 1e3, "commit_ms": report.commit_time.as_secs_f64() * 1e3, "bytes": report.bytes }),
            ))
        }
        .await;
        drop(rendezvous);
        let _ = child.kill();
        let _ = child.wait();
        result
    })
}

/// Two ranks of one communicator on this one GPU (a trainer and an
/// engine colocated) through the orchestrator: refused before any
/// communicator is made, within seconds.
pub(super) fn nccl_same_device(_ctx: &Ctx) -> Result<(String, Value), String> {
    use actors::{spawn, ActorGroup, SpawnConfig};
    use orchestrator::{
        spawn_orchestrator, CommPlane, DstStore, Fabric, Member, MemberConfig, NcclFabric, OrchestratorConfig, Role, SrcStore,
    };
    use std::sync::Arc;
    let (src, dst) = (Arc::new(parse_layout(IPC_SRC).map_err(e2s)?), Arc::new(parse_layout(IPC_DST).map_err(e2s)?));
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().map_err(e2s)?;
    rt.block_on(async {
        let config = OrchestratorConfig { fabric: Fabric::Nccl(NcclFabric::new(CommPlane::Cuda)), ..OrchestratorConfig::default() };
        let on_gpu0 = MemberConfig { gpu: Some(0), ..MemberConfig::default() };
        let spawn_config = SpawnConfig::default().call_timeout(config.deadline + config.control_timeout);
        let src_stores: Vec<_> = (0..src.ranks()).map(|r| Arc::new(SrcStore::new(&src, r))).collect();
        let srcs = (0..src.ranks())
            .map(|r| {
                spawn(Member::with_config(src.clone(), r, Role::Src(src_stores[r as usize].clone()), on_gpu0.clone()), spawn_config.clone())
            })
            .collect();
        let dsts = (0..dst.ranks())
            .map(|r| {
                spawn(
                    Member::with_config(dst.clone(), r, Role::Dst(Arc::new(DstStore::new(&dst, r))), on_gpu0.clone()),
                    spawn_config.clone(),
                )
            })
            .collect();
        let orchestrator = spawn_orchestrator(ActorGroup::from_refs(srcs), ActorGroup::from_refs(dsts), config);
        let mut version = 0;
        for s in &src_stores {
            version = s.try_update(|b| b.tensor_mut("w")?.map_f32(|at, _| ipc_value(at))).await.map_err(e2s)?.0;
        }
        let t = Instant::now();
        let r = orchestrator.refit(version).await;
        let took = t.elapsed();
        match r {
            Ok(_) => Err("4 ranks on one GPU: the refit ran (NCCL should never have been asked)".into()),
            Err(e) if e.to_string().contains("on one GPU") && took < Duration::from_secs(10) => Ok((
                format!("refused in {took:?}: {e}"),
                json!({ "refused_s": took.as_secs_f64(), "abandoned_threads": transport::cuda::abandoned_comm_threads() }),
            )),
            Err(e) => Err(format!("after {took:?}, not the same-device refusal: {e}")),
        }
    })
}

/// Delta refits on the CUDA IPC fabric, every member in this process on
/// this GPU: the first refit dense in its encodings, then two after a
/// few hundred elements changed, each checked element by element, the
/// later ones sending a small fraction of the bytes (each message read
/// from the device, encoded on the host, and written back).
pub(super) fn ipc_delta(_ctx: &Ctx) -> Result<(String, Value), String> {
    use actors::{spawn, ActorGroup, SpawnConfig};
    use orchestrator::{
        spawn_orchestrator, CommPlane, DstStore, Fabric, IpcFabric, Member, MemberConfig, OrchestratorConfig, Role, SrcStore,
    };
    use std::sync::Arc;
    let (src, dst) = (Arc::new(parse_layout(IPC_SRC).map_err(e2s)?), Arc::new(parse_layout(IPC_DST).map_err(e2s)?));
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(4).enable_all().build().map_err(e2s)?;
    rt.block_on(async {
        let config =
            OrchestratorConfig { fabric: Fabric::Ipc(IpcFabric::new(CommPlane::Cuda)), delta: true, ..OrchestratorConfig::default() };
        let on_gpu0 = MemberConfig { gpu: Some(0), ..MemberConfig::default() };
        let spawn_config = SpawnConfig::default().call_timeout(config.deadline + config.control_timeout);
        let src_stores: Vec<_> = (0..src.ranks()).map(|r| Arc::new(SrcStore::new(&src, r))).collect();
        let dst_stores: Vec<_> = (0..dst.ranks()).map(|r| Arc::new(DstStore::new(&dst, r))).collect();
        let member = |layout: &Arc<reshard::Layout>, r: u32, role: Role| {
            spawn(Member::with_config(layout.clone(), r, role, on_gpu0.clone()), spawn_config.clone())
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
                version = s.try_update(|b| b.tensor_mut("w")?.map_f32(|at, _| value(at, k))).await.map_err(e2s)?.0;
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

/// The NCCL orchestrator check where there are GPUs for it.
pub(super) fn orchestrated_on_gpus(_ctx: &Ctx) -> Result<(String, Value), String> {
    match transport::cuda::device_count() {
        Ok(gpus) if gpus >= 2 => orchestrated(gpus),
        Ok(gpus) => Err(format!("SKIP: needs 2 GPUs (one NCCL rank per GPU), found {gpus}")),
        Err(e) => Err(format!("counting GPUs: {e}")),
    }
}
