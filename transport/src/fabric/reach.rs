//! Whether a fabric reaches the memory a rank's weights are registered
//! in, decided when the rank's end opens: a rank whose memory its fabric
//! cannot move is refused at `Prepare`, by name and with what to change,
//! before any peer connects or waits for it.

use super::comm::out_of_reach;
use super::error::{FabricError, RegisteredError};
use super::registered::Residence;
use super::spec::{CommPlane, Fabric};
use reshard::Endpoint;

/// Checks that `fabric` reaches memory of `residence` (a rank's registered
/// weights; `gpu` the member's GPU), saying why not.
pub(super) fn check_reach(fabric: &Fabric, residence: Residence, gpu: Option<usize>, me: Endpoint) -> Result<(), FabricError> {
    let plane = match fabric {
        Fabric::InProcess | Fabric::Node(_) if residence == Residence::Host => return Ok(()),
        Fabric::InProcess | Fabric::Node(_) => return Err(RegisteredError::OffHost { me, residence }.into()),
        Fabric::Nccl(s) => &s.plane,
        Fabric::Ipc(s) => &s.plane,
    };
    match (plane, residence) {
        (CommPlane::Simulated { .. }, Residence::Host) => Ok(()),
        (CommPlane::Cuda, Residence::Device { ordinal }) if Some(ordinal) == gpu => Ok(()),
        (plane, residence) => Err(out_of_reach(me, plane, residence)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fabric::{IpcFabric, NcclFabric, NodeFabric};
    use reshard::Group;

    #[test]
    fn each_fabric_reaches_only_the_memory_it_moves() {
        let me = Endpoint { group: Group::Src, rank: 3 };
        let (host, gpu0, gpu1) = (Residence::Host, Residence::Device { ordinal: 0 }, Residence::Device { ordinal: 1 });
        let sim = CommPlane::Simulated { world: "w".into() };
        let node = Fabric::Node(NodeFabric::default());
        assert!(check_reach(&Fabric::InProcess, host, None, me).is_ok());
        assert!(check_reach(&node, host, None, me).is_ok());
        let e = check_reach(&node, gpu0, Some(0), me).unwrap_err().to_string();
        assert!(e.contains("src rank 3") && e.contains("NCCL and IPC fabrics only"), "{e}");
        let nccl = Fabric::Nccl(NcclFabric::new(CommPlane::Cuda));
        let e = check_reach(&nccl, host, Some(0), me).unwrap_err().to_string();
        assert!(e.contains("registered host memory") && e.contains("CUDA plane does not reach"), "{e}");
        assert!(check_reach(&nccl, gpu0, Some(0), me).is_ok());
        assert!(matches!(check_reach(&nccl, gpu1, Some(0), me), Err(FabricError::OutOfReach { cuda: true, .. })));
        assert!(check_reach(&nccl, gpu1, Some(0), me).unwrap_err().to_string().contains("another device"));
        let ipc_sim = Fabric::Ipc(IpcFabric::new(sim.clone()));
        assert!(check_reach(&ipc_sim, host, None, me).is_ok());
        assert!(check_reach(&ipc_sim, gpu0, Some(0), me).is_err());
        assert!(check_reach(&Fabric::Nccl(NcclFabric::new(sim)), host, None, me).is_ok());
    }
}
