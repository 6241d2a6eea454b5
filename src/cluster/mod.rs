//! Multi-process refits. A launcher ([`Cluster`]) opens a rendezvous
//! socket; worker processes ([`run_worker`], `refit worker`) join it, each
//! hosting one rank or every rank of one node. The launcher plans once and
//! ships each worker its ranks' programs, then drives refits step by step
//! (prepare, connect, start, commit), each over a fresh TCP data plane among
//! exactly the ranks that exchange data. On a cluster the user's launcher
//! (srun, a Kubernetes job) starts `refit worker` with the same rendezvous
//! address; see `docs/multiprocess.md`.
//!
//! Control messages travel as length-prefixed frames of `actors::codec`.

mod launcher;
mod wire;
mod worker;

pub use launcher::{Cluster, ClusterConfig, ClusterError, PerProcess, RefitOutcome};
pub use worker::{run_worker, Hosted, WorkerConfig};
