//! Joining a rendezvous (`Joined`): a process serves its ranks' members
//! over its stores.

use crate::dst_store::PyDstStore;
use crate::errors::{join_err, seconds, JoinError};
use crate::runtime::{runtime, wait, InRuntime};
use crate::src_store::PySrcStore;
use orchestrator::rendezvous::ControlConfig;
use orchestrator::{JoinConfig, Joined, Role};
use pyo3::prelude::*;
use std::sync::Arc;

fn join_config(rendezvous: Option<String>, secret: Option<String>) -> PyResult<JoinConfig> {
    use std::net::ToSocketAddrs;
    let rendezvous = match rendezvous {
        Some(text) => text
            .to_socket_addrs()
            .ok()
            .and_then(|mut a| a.next())
            .ok_or_else(|| JoinError::new_err(format!("rendezvous address '{text}': not host:port")))?,
        None => JoinConfig::from_env().map_err(join_err)?.rendezvous,
    };
    let secret = match secret {
        Some(s) => actors::Secret::from_bytes(s.into_bytes()).map_err(|e| JoinError::new_err(format!("secret: {e}")))?,
        None => actors::Secret::from_env(orchestrator::rendezvous::SECRET_ENV)
            .map_err(|e| JoinError::new_err(format!("{}: {e}", orchestrator::rendezvous::SECRET_ENV)))?,
    };
    Ok(JoinConfig { rendezvous, secret, control: ControlConfig::default() })
}

/// A process's membership of a rendezvous: serves its ranks' members.
#[pyclass(module = "refit._refit", name = "Joined", frozen)]
pub(crate) struct PyJoined {
    inner: InRuntime<Arc<Joined>>,
}

#[pymethods]
impl PyJoined {
    /// Joins the rendezvous at `rendezvous` (`host:port`) with `secret`;
    /// either missing is read from the environment (`REFIT_RENDEZVOUS`, or
    /// `MASTER_ADDR` with `REFIT_PORT`; `REFIT_SECRET`).
    #[new]
    #[pyo3(signature = (rendezvous=None, secret=None))]
    fn new(py: Python<'_>, rendezvous: Option<String>, secret: Option<String>) -> PyResult<Self> {
        let config = join_config(rendezvous, secret)?;
        let joined = wait(py, async move { orchestrator::join(&config).await.map_err(join_err) })?;
        Ok(PyJoined { inner: InRuntime(Some(Arc::new(joined))) })
    }

    /// Serves the refit member of a training rank over `store` (`gpu`: the
    /// CUDA device it uses on the NCCL and IPC fabrics).
    #[pyo3(signature = (store, gpu=None))]
    fn serve_src(&self, py: Python<'_>, store: PyRef<'_, PySrcStore>, gpu: Option<usize>) -> PyResult<()> {
        let (joined, layout, rank, role) =
            (self.inner.get().clone(), store.as_super().layout.clone(), store.inner.rank(), Role::Src(store.inner.clone()));
        let config = orchestrator::MemberConfig { gpu, ..joined.member_config() };
        wait(py, async move { joined.serve_member_with(layout, rank, role, config).await.map(drop).map_err(join_err) })
    }

    /// Serves the refit member of an inference rank over `store` (`gpu`: as
    /// for `serve_src`).
    /// With `replica`, the member of rank `rank` of a new replica of that
    /// name (its store laid out as one replica) that the orchestrator adds
    /// with `add_replica(replica)`.
    #[pyo3(signature = (store, gpu=None, replica=None))]
    fn serve_dst(&self, py: Python<'_>, store: PyRef<'_, PyDstStore>, gpu: Option<usize>, replica: Option<String>) -> PyResult<()> {
        let (joined, layout, rank) = (self.inner.get().clone(), store.as_super().layout.clone(), store.inner.rank());
        let config = orchestrator::MemberConfig { gpu, ..joined.member_config() };
        let store = store.inner.clone();
        wait(py, async move {
            let served = match replica {
                Some(name) => joined.serve_replica_member(&name, layout, rank, store, config).await,
                None => joined.serve_member_with(layout, rank, Role::Dst(store), config).await,
            };
            served.map(drop).map_err(join_err)
        })
    }

    /// Waits until the rendezvous goes away (returns why), or `timeout`
    /// seconds (returns None).
    #[pyo3(signature = (timeout=None))]
    fn wait_closed(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<Option<String>> {
        let joined = self.inner.get().clone();
        let timeout = timeout.map(|t| seconds("timeout", t)).transpose()?;
        wait(py, async move {
            Ok(match timeout {
                Some(t) => tokio::time::timeout(t, joined.closed()).await.ok(),
                None => Some(joined.closed().await),
            })
        })
    }

    /// Closes this process's control node (its members stop being
    /// reachable).
    fn shutdown(&self) {
        let Ok(rt) = runtime() else { return };
        let _entered = rt.enter();
        self.inner.get().shutdown();
    }
}
