//! Checks through the orchestrator: refits on the NCCL fabric over
//! several GPUs (`orchestrator`), colocated refits on the CUDA IPC fabric
//! between a child process and this one (`orchestrator-ipc`, in place or
//! not), delta refits on the IPC fabric in this process
//! (`orchestrator-ipc-delta`, in `crate::delta`), and two ranks of one communicator on one
//! GPU refused (`nccl-same-device`).

use super::{e2s, Ctx};
use crate::ipc_layouts::{checked_w, ipc_value, IPC_DST, IPC_SRC};
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
            let read_before = transport::cuda::direct_read_bytes();
            let report = orchestrator.refit(1).await.map_err(|e| format!("refit: {e}"))?;
            // Sources and destinations share the GPU: every piece is read
            // straight from the sources' memory (docs/gpu.md, "Direct reads
            // on one device"), none through a bucket.
            let read_directly = transport::cuda::direct_read_bytes() - read_before;
            if read_directly == 0 {
                return Err("the destinations read nothing directly from the sources on their GPU".into());
            }
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
                    "2 sources in process {} → 2 destinations here{}, one GPU: {checked} elements checked, {read_directly} bytes read directly, {:.1} ms (commit {:.1} ms)",
                    child.id(),
                    if served == Served::InPlace { " (registered device buffers)" } else { "" },
                    report.wall.as_secs_f64() * 1e3,
                    report.commit_time.as_secs_f64() * 1e3
                ),
                json!({ "elements": checked, "read_directly": read_directly, "wall_ms": report.wall.as_secs_f64() * 1e3, "commit_ms": report.commit_time.as_secs_f64() * 1e3, "bytes": report.bytes }),
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

/// The `orchestrator-ipc-delta` check on the CUDA IPC plane, every member
/// on this GPU.
pub(super) fn ipc_delta(ctx: &Ctx) -> Result<(String, Value), String> {
    crate::delta::ipc_delta(orchestrator::CommPlane::Cuda, Some(ctx.dev.ordinal()))
}

/// The NCCL orchestrator check where there are GPUs for it.
pub(super) fn orchestrated_on_gpus(_ctx: &Ctx) -> Result<(String, Value), String> {
    match transport::cuda::device_count() {
        Ok(gpus) if gpus >= 2 => orchestrated(gpus),
        Ok(gpus) => Err(format!("SKIP: needs 2 GPUs (one NCCL rank per GPU), found {gpus}")),
        Err(e) => Err(format!("counting GPUs: {e}")),
    }
}
