//! The orchestrator as Python sees it (`Orchestrator`): over a rendezvous
//! that member processes join, or over members in this process
//! (`spawn_local`); refits, recovery and their reports.

use crate::dst_store::PyDstStore;
use crate::errors::{join_err, refit_err, seconds, JoinError, RefitError};
use crate::layout::PyLayout;
use crate::runtime::{runtime, wait, InRuntime};
use crate::src_store::PySrcStore;
use crate::store_core::StoreCore;
use actors::ActorGroup;
use orchestrator::rendezvous::ControlConfig;
use orchestrator::{
    DstStore, Fabric, Member, NodeFabric, OrchestratorConfig, OrchestratorHandle, PlanReport, RefitReport, RefitSystem, Rendezvous,
    ReplicaReport, Role,
};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyDict;
use reshard::{Endpoint, Group};
use std::sync::{Arc, Mutex};

fn report_dict<'py>(py: Python<'py>, r: &RefitReport) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("version", r.version)?;
    d.set_item("bytes", r.bytes)?;
    d.set_item("seconds", r.wall.as_secs_f64())?;
    let phases = [
        ("plan_seconds", r.plan_time),
        ("connect_seconds", r.connect_time),
        ("transfer_seconds", r.transfer_time),
        ("commit_seconds", r.commit_time),
        ("verify_seconds", r.verify_time),
    ];
    for (key, time) in phases {
        d.set_item(key, time.as_secs_f64())?;
    }
    d.set_item("verified_ranks", r.verified_ranks)?;
    d.set_item("unverified_ranks", r.unverified_ranks)?;
    d.set_item("already_served", r.already_served)?;
    d.set_item("replanned", r.replanned)?;
    d.set_item("fingerprint", r.fingerprint.map(|f| f.to_string()))?;
    d.set_item("mode", r.mode.to_string())?;
    d.set_item("dropped_replicas", r.dropped_replicas.clone())?;
    Ok(d)
}

fn replica_dict<'py>(py: Python<'py>, r: &ReplicaReport) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("replicas", r.replicas)?;
    let seeded = match &r.seeded {
        Some(s) => {
            let e = PyDict::new(py);
            e.set_item("version", s.version)?;
            e.set_item("from_replica", s.from_replica)?;
            e.set_item("bytes", s.bytes)?;
            e.set_item("seconds", s.wall.as_secs_f64())?;
            e.set_item("fingerprint", s.fingerprint.to_string())?;
            Some(e)
        }
        None => None,
    };
    d.set_item("seeded", seeded)?;
    Ok(d)
}

fn plan_dict<'py>(py: Python<'py>, r: &PlanReport) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("fingerprint", r.fingerprint.to_string())?;
    d.set_item("bytes", r.bytes)?;
    d.set_item("replanned", r.replanned)?;
    d.set_item("mode", r.mode.to_string())?;
    Ok(d)
}

/// The groups of members the orchestrator runs over: sources, destinations.
type Groups = (ActorGroup<Member>, ActorGroup<Member>);

/// What the orchestrator runs over.
#[derive(Clone)]
enum Over {
    /// Members in other processes, found through this rendezvous; their
    /// groups once `connect` found them (replaced members put in by
    /// `recover`).
    Rendezvous(Arc<Rendezvous>, Arc<tokio::sync::Mutex<Option<Groups>>>),
    /// Every member and store in this process.
    Local(Arc<tokio::sync::Mutex<RefitSystem>>),
}

/// The orchestrator: over a rendezvous that member processes join
/// (`Orchestrator(secret, bind)` then `connect`), or over members in this
/// process (`spawn_local`).
#[pyclass(module = "refit._refit", name = "Orchestrator", frozen)]
pub(crate) struct PyOrchestrator {
    over: InRuntime<Mutex<Over>>,
    handle: InRuntime<Mutex<Option<OrchestratorHandle>>>,
    config: OrchestratorConfig,
}

impl PyOrchestrator {
    fn handle(&self) -> PyResult<OrchestratorHandle> {
        let h = self.handle.get().lock().unwrap_or_else(|e| e.into_inner()).clone();
        h.ok_or_else(|| RefitError::new_err("the orchestrator has no members yet: call connect(src_ranks, dst_ranks) first"))
    }

    /// What a refit runs on: the handle, and a future that first puts
    /// back every member whose control connection broke while its
    /// process lives (found again as itself through the rendezvous,
    /// within the control timeout), so that a live member lost to a busy
    /// host is not lost for good.
    fn before_refit(&self) -> PyResult<(OrchestratorHandle, impl std::future::Future<Output = ()> + Send + 'static)> {
        let h = self.handle()?;
        let over = self.over.get().lock().unwrap_or_else(|e| e.into_inner()).clone();
        let (handle, within) = (h.clone(), self.config.control_timeout);
        let reattach = async move {
            let Over::Rendezvous(rendezvous, groups) = over else { return };
            let mut groups = groups.lock().await;
            let Some((src, dst)) = groups.as_mut() else { return };
            if src.iter().chain(dst.iter()).all(|(_, m)| m.is_alive()) {
                return;
            }
            // One not put back (logged) fails the refit, which names it.
            rendezvous.reattach(&handle, src, dst, within).await;
        };
        Ok((h, reattach))
    }
}

/// The fabric named `name`; `local`: every member is in this process.
fn fabric(name: &str, local: bool) -> PyResult<Fabric> {
    use orchestrator::{CommPlane, IpcFabric, NcclFabric};
    Ok(match name {
        "in_process" if local => Fabric::InProcess,
        "node" => Fabric::Node(NodeFabric::default()),
        // The node fabric without shared memory: TCP between every pair
        // (for comparison).
        "tcp" => Fabric::Node(NodeFabric { shared_memory: false, ..NodeFabric::default() }),
        "nccl" => Fabric::Nccl(NcclFabric::new(CommPlane::Cuda)),
        "ipc" => Fabric::Ipc(IpcFabric::new(CommPlane::Cuda)),
        // Host memory standing in for the GPUs, every member in this
        // process: pipelines tested without a GPU.
        "simulated-nccl" => Fabric::Nccl(NcclFabric::new(CommPlane::Simulated { world: "python".into() })),
        "simulated-ipc" => Fabric::Ipc(IpcFabric::new(CommPlane::Simulated { world: "python".into() })),
        _ => {
            let known = if local {
                "'in_process', 'node', 'tcp', 'nccl', 'ipc', 'simulated-nccl' or 'simulated-ipc'"
            } else {
                "'node', 'tcp', 'nccl', 'ipc', 'simulated-nccl' or 'simulated-ipc'"
            };
            return Err(PyValueError::new_err(format!("fabric '{name}': expected {known}")));
        }
    })
}

/// The orchestrator's settings a Python caller chooses, given to both
/// entry points (`Orchestrator(secret, bind, settings)`,
/// `spawn_local(src, dst, settings)`); checked when one of them uses it.
#[pyclass(module = "refit._refit", name = "Settings", frozen)]
pub(crate) struct PySettings {
    deadline: f64,
    control_timeout: f64,
    fabric: String,
    delta: bool,
    digest_check: bool,
    replica: Option<Py<PyLayout>>,
}

#[pymethods]
impl PySettings {
    #[new]
    #[pyo3(signature = (*, fabric, deadline=60.0, control_timeout=10.0, delta=false, replica=None, digest_check=true))]
    fn new(fabric: String, deadline: f64, control_timeout: f64, delta: bool, replica: Option<Py<PyLayout>>, digest_check: bool) -> Self {
        PySettings { deadline, control_timeout, fabric, delta, digest_check, replica }
    }
}

impl PySettings {
    /// The orchestrator's configuration; `local`: every member is in
    /// this process.
    fn config(&self, local: bool) -> PyResult<OrchestratorConfig> {
        Ok(OrchestratorConfig {
            fabric: fabric(&self.fabric, local)?,
            delta: self.delta,
            digest_check: self.digest_check,
            replica: self.replica.as_ref().map(|l| l.get().inner.clone()),
            deadline: seconds("deadline", self.deadline)?,
            control_timeout: seconds("control_timeout", self.control_timeout)?,
            ..OrchestratorConfig::default()
        })
    }
}

#[pymethods]
impl PyOrchestrator {
    /// Opens a rendezvous at `bind` (port 0: any) that member processes
    /// join with `secret` (16 bytes or more).
    #[new]
    fn new(py: Python<'_>, secret: String, bind: &str, settings: PyRef<'_, PySettings>) -> PyResult<Self> {
        let config = settings.config(false)?;
        let secret = actors::Secret::from_bytes(secret.into_bytes()).map_err(|e| JoinError::new_err(format!("secret: {e}")))?;
        let bind: std::net::SocketAddr = bind.parse().map_err(|_| JoinError::new_err(format!("bind address '{bind}': not ip:port")))?;
        let rendezvous = wait(py, async move { Rendezvous::bind(secret, bind, &ControlConfig::default()).await.map_err(join_err) })?;
        Ok(PyOrchestrator {
            over: InRuntime(Some(Mutex::new(Over::Rendezvous(Arc::new(rendezvous), Arc::default())))),
            handle: InRuntime(Some(Mutex::new(None))),
            config,
        })
    }

    /// The rendezvous address member processes join (`host:port`); None
    /// for a local system.
    #[getter]
    fn address(&self) -> Option<String> {
        match &*self.over.get().lock().unwrap_or_else(|e| e.into_inner()) {
            Over::Rendezvous(r, _) => Some(r.addr().to_string()),
            Over::Local(_) => None,
        }
    }

    /// Waits up to `timeout` seconds for the members of source ranks
    /// `0..src_ranks` and destination ranks `0..dst_ranks` to join, starts
    /// the orchestrator over them, plans and installs every member's
    /// program. Returns the plan report (dict).
    #[pyo3(signature = (src_ranks, dst_ranks, timeout=60.0))]
    fn connect<'py>(&self, py: Python<'py>, src_ranks: u32, dst_ranks: u32, timeout: f64) -> PyResult<Bound<'py, PyDict>> {
        let within = seconds("timeout", timeout)?;
        let (rendezvous, groups) = match &*self.over.get().lock().unwrap_or_else(|e| e.into_inner()) {
            Over::Rendezvous(r, g) => (r.clone(), g.clone()),
            Over::Local(_) => return Err(RefitError::new_err("a local system is connected already")),
        };
        let config = self.config.clone();
        let (handle, plan) = wait(py, async move {
            let src = rendezvous.members(Group::Src, src_ranks, within).await.map_err(join_err)?;
            let dst = rendezvous.members(Group::Dst, dst_ranks, within).await.map_err(join_err)?;
            let handle = orchestrator::spawn_orchestrator(src.clone(), dst.clone(), config);
            *groups.lock().await = Some((src, dst));
            let plan = handle.plan().await.map_err(refit_err)?;
            Ok((handle, plan))
        })?;
        let old = self.handle.get().lock().unwrap_or_else(|e| e.into_inner()).replace(handle);
        drop(InRuntime(old));
        plan_dict(py, &plan)
    }

    /// Refits exactly `version`, which every source must hold.
    fn refit<'py>(&self, py: Python<'py>, version: u64) -> PyResult<Bound<'py, PyDict>> {
        let (h, reattach) = self.before_refit()?;
        let r = wait(py, async move {
            reattach.await;
            h.refit(version).await.map_err(refit_err)
        })?;
        report_dict(py, &r)
    }

    /// Refits the newest version every source holds.
    fn refit_latest<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let (h, reattach) = self.before_refit()?;
        let r = wait(py, async move {
            reattach.await;
            h.refit_latest().await.map_err(refit_err)
        })?;
        report_dict(py, &r)
    }

    /// A subset refit of `version` (None: the newest every source holds)
    /// for the destination tensors `only` (see
    /// `OrchestratorHandle::refit_only`).
    #[pyo3(signature = (only, version=None))]
    fn refit_only<'py>(&self, py: Python<'py>, only: Vec<String>, version: Option<u64>) -> PyResult<Bound<'py, PyDict>> {
        let (h, reattach) = self.before_refit()?;
        let target = version.map_or(orchestrator::RefitTarget::Latest, orchestrator::RefitTarget::Version);
        let r = wait(py, async move {
            reattach.await;
            h.refit_only(target, orchestrator::TensorSubset::new(only)).await.map_err(refit_err)
        })?;
        report_dict(py, &r)
    }

    /// Puts a new member in the place of every member whose process died
    /// (or went silent past the heartbeat timeout): the process that joins
    /// under the dead one's rank within `timeout` seconds, in all. Returns
    /// the ranks replaced as `(group, rank)`, `group` `"src"` or `"dst"`
    /// (empty: every member is alive). On a local system a stopped member
    /// is restarted over its store. A rank whose replacement does not join
    /// in time raises `JoinError` naming it; ranks replaced before it stay
    /// replaced.
    #[pyo3(signature = (timeout=60.0))]
    fn recover(&self, py: Python<'_>, timeout: f64) -> PyResult<Vec<(String, u32)>> {
        let within = seconds("timeout", timeout)?;
        let h = self.handle()?;
        // Cloned out, so that nothing waits on the lock while this waits.
        let over = self.over.get().lock().unwrap_or_else(|e| e.into_inner()).clone();
        let replaced = match over {
            Over::Rendezvous(rendezvous, groups) => wait(py, async move {
                let mut groups = groups.lock().await;
                let Some((src, dst)) = groups.as_mut() else { return Ok(Vec::new()) };
                rendezvous.recover(&h, src, dst, within).await.map_err(join_err)
            }),
            Over::Local(system) => wait(py, async move {
                let mut system = system.lock().await;
                let gone: Vec<Endpoint> = [(Group::Src, &system.src_members), (Group::Dst, &system.dst_members)]
                    .into_iter()
                    .flat_map(|(g, m)| m.iter().filter(|(_, a)| !a.is_alive()).map(move |(r, _)| Endpoint { group: g, rank: r as u32 }))
                    .collect();
                for &e in &gone {
                    system.replace_member(e).await.map_err(refit_err)?;
                }
                Ok(gone)
            }),
        }?;
        Ok(replaced.into_iter().map(|e| (e.group.to_string(), e.rank)).collect())
    }

    /// Adds a replica to a destination group of replicas (`replica` given
    /// at construction). Over a rendezvous: the members that joined as
    /// replica `name` (`serve_dst(..., replica=name)`), waited for up to
    /// `timeout` seconds. On a local system (`name` None): a store and a
    /// member per rank of one replica, made here. Returns the report
    /// (dict) and the new stores (local only).
    #[pyo3(signature = (name=None, timeout=60.0))]
    fn add_replica<'py>(&self, py: Python<'py>, name: Option<String>, timeout: f64) -> PyResult<(Bound<'py, PyDict>, Vec<Py<PyDstStore>>)> {
        let within = seconds("timeout", timeout)?;
        let h = self.handle()?;
        let Some(one) = self.config.replica.clone() else {
            return Err(RefitError::new_err("this orchestrator was made without a replica layout (replica=...)"));
        };
        let over = self.over.get().lock().unwrap_or_else(|e| e.into_inner()).clone();
        let (report, stores) = match (over, name) {
            (Over::Rendezvous(rendezvous, groups), Some(name)) => {
                let ranks = one.ranks();
                wait(py, async move {
                    let members = rendezvous.replica_members(&name, ranks, within).await.map_err(join_err)?;
                    let report = h.add_replica(members.clone()).await.map_err(refit_err)?;
                    if let Some((_, dst)) = groups.lock().await.as_mut() {
                        *dst = ActorGroup::from_refs([dst.refs(), members.refs()].concat());
                    }
                    Ok((report, Vec::new()))
                })?
            }
            (Over::Local(_), None) => {
                let o = one.clone();
                wait(py, async move {
                    let stores: Vec<Arc<DstStore>> = (0..o.ranks()).map(|j| Arc::new(DstStore::new(&o, j))).collect();
                    let spawn = actors::SpawnConfig::default().name("replica");
                    let members =
                        actors::spawn_group(stores.len(), spawn, |j| Member::new(o.clone(), j as u32, Role::Dst(stores[j].clone())));
                    let report = h.add_replica(members).await.map_err(refit_err)?;
                    Ok((report, stores))
                })?
            }
            (Over::Rendezvous(..), None) => {
                return Err(PyValueError::new_err("add_replica(name): the name the replica's members joined with"))
            }
            (Over::Local(_), Some(_)) => return Err(PyValueError::new_err("add_replica() takes no name on a local system")),
        };
        let stores =
            stores.into_iter().map(|st| Py::new(py, PyDstStore::class(StoreCore::owned(st, one.clone())))).collect::<PyResult<_>>()?;
        Ok((replica_dict(py, &report)?, stores))
    }

    /// Removes replica `index` from a destination group of replicas.
    fn remove_replica<'py>(&self, py: Python<'py>, index: u32) -> PyResult<Bound<'py, PyDict>> {
        let h = self.handle()?;
        let k = self.config.replica.as_ref().map_or(1, |one| one.ranks() as usize);
        let over = self.over.get().lock().unwrap_or_else(|e| e.into_inner()).clone();
        let report = wait(py, async move {
            let report = h.remove_replica(index).await.map_err(refit_err)?;
            if let Over::Rendezvous(_, groups) = over {
                if let Some((_, dst)) = groups.lock().await.as_mut() {
                    let mut refs = dst.refs().to_vec();
                    let r = index as usize * k;
                    refs.drain(r.min(refs.len())..(r + k).min(refs.len()));
                    *dst = ActorGroup::from_refs(refs);
                }
            }
            Ok(report)
        })?;
        replica_dict(py, &report)
    }

    /// Checks both groups' layouts, plans and installs now.
    fn plan<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let h = self.handle()?;
        let r = wait(py, async move { h.plan().await.map_err(refit_err) })?;
        plan_dict(py, &r)
    }

    /// `"reshard"` or `"baseline"` (gather on one rank and broadcast).
    fn set_mode(&self, py: Python<'_>, mode: &str) -> PyResult<()> {
        let mode = match mode {
            "reshard" => reshard::Strategy::Reshard,
            "baseline" => reshard::Strategy::Baseline,
            other => return Err(RefitError::new_err(format!("mode '{other}': expected 'reshard' or 'baseline'"))),
        };
        let h = self.handle()?;
        wait(py, async move { h.set_mode(mode).await.map_err(refit_err) })
    }

    /// Stops the orchestrator and closes the rendezvous: member processes
    /// see it go (`Joined.wait_closed` returns).
    fn close(&self) {
        let Ok(rt) = runtime() else { return };
        let _entered = rt.enter();
        drop(self.handle.get().lock().unwrap_or_else(|e| e.into_inner()).take());
        if let Over::Rendezvous(r, _) = &*self.over.get().lock().unwrap_or_else(|e| e.into_inner()) {
            r.node().shutdown();
        }
    }
}

/// What `spawn_local` returns: the orchestrator and every rank's store.
type LocalSystem = (PyOrchestrator, Vec<Py<PySrcStore>>, Vec<Py<PyDstStore>>);

/// Spawns one store and one member per rank of both layouts in this
/// process and an orchestrator over them, and plans. Returns
/// `(orchestrator, [SrcStore], [DstStore])`.
#[pyfunction]
pub(crate) fn spawn_local(
    py: Python<'_>,
    src: PyRef<'_, PyLayout>,
    dst: PyRef<'_, PyLayout>,
    settings: PyRef<'_, PySettings>,
) -> PyResult<LocalSystem> {
    let config = settings.config(true)?;
    let (s, d, c) = (src.inner.clone(), dst.inner.clone(), config.clone());
    let system = wait(py, async move { orchestrator::spawn_refit(&s, &d, c).await.map_err(refit_err) })?;
    let srcs = system
        .src_stores
        .iter()
        .map(|st| Py::new(py, PySrcStore::class(StoreCore::owned(st.clone(), src.inner.clone()))))
        .collect::<PyResult<_>>()?;
    let dsts = system
        .dst_stores
        .iter()
        .map(|st| Py::new(py, PyDstStore::class(StoreCore::owned(st.clone(), dst.inner.clone()))))
        .collect::<PyResult<_>>()?;
    let handle = system.orchestrator.clone();
    let orchestrator = PyOrchestrator {
        over: InRuntime(Some(Mutex::new(Over::Local(Arc::new(tokio::sync::Mutex::new(system)))))),
        handle: InRuntime(Some(Mutex::new(Some(handle)))),
        config,
    };
    Ok((orchestrator, srcs, dsts))
}
