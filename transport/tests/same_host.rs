//! Both groups on one host: the node fabric's ranks that report one host
//! ([`PeerAddr::host`]) talk through shared memory whatever their group
//! and node ([`NodeFabric::same_host`]); ranks of other hosts, or with the
//! setting off, talk TCP. Which link a pair took shows in the sources'
//! staging: pieces converted on their way (f32 to bf16) into shared
//! memory need none, over TCP they are converted into staging first.

use reshard::{parse_layout, plan_reshard, Endpoint, Layout, PlanOptions, RankProgram};
use std::net::{IpAddr, Ipv4Addr};
use std::time::Duration;
use transport::fabric::{
    this_host, Connecting, Fabric, Host, NodeFabric, NodeFaults, PeerAddr, RankEnd, RankRunError, RunMemory, RunOptions, Scratch, Site,
    StagingKept,
};
use transport::{fill_sources, verify_destinations, HelloKey, RankMemory};

/// Training TP2 in f32, inference TP2 the other way in bf16, every rank a
/// node of its own: no two ranks share a node.
fn layouts() -> (Layout, Layout) {
    let src = r#"{"ranks": 2, "ranks_per_node": 1, "tensors": [
      {"name": "w", "dtype": "f32", "shape": [1024, 256], "mesh": {"shape": [2]}, "placements": ["shard(0)"]}]}"#;
    let dst = r#"{"ranks": 2, "ranks_per_node": 1, "tensors": [
      {"name": "w", "dtype": "bf16", "shape": [1024, 256], "mesh": {"shape": [2]}, "placements": ["shard(1)"]}]}"#;
    (parse_layout(src).unwrap(), parse_layout(dst).unwrap())
}

/// One refit over the node fabric on loopback, every rank on a thread of
/// its own, sources reporting host `src_host` and destinations
/// `dst_host` (and `crowd` more ranks on the sources' host). Ok, with every
/// destination element checked, with whether each source rank sent
/// through shared memory (it made no staging area), or the first rank's
/// error.
fn refit(same_host: bool, src_host: Host, dst_host: Host, crowd: u32, session: &str) -> Result<Vec<bool>, RankRunError> {
    Ok(refit_in(same_host, src_host, dst_host, crowd, session)?[..2].iter().map(|kept| kept.made == 0).collect())
}

/// As [`refit`]: what each rank's scratch kept of staging areas, in
/// program order.
fn refit_in(same_host: bool, src_host: Host, dst_host: Host, crowd: u32, session: &str) -> Result<Vec<StagingKept>, RankRunError> {
    let (src, dst) = layouts();
    let plan = plan_reshard(&src, &dst, &PlanOptions::default()).unwrap();
    let programs: Vec<RankProgram> = plan.programs(&src, &dst).unwrap();
    let settings = NodeFabric { connect_timeout: Duration::from_secs(10), same_host, ..NodeFabric::default() };
    let site = Site { data_ip: IpAddr::V4(Ipv4Addr::LOCALHOST), gpu: None, registered: None };
    let mut ends = Vec::new();
    let mut table = Vec::new();
    for p in &programs {
        let (end, addr) = RankEnd::open(Fabric::Node(settings.clone()), p, site, session).unwrap();
        let e: Endpoint = p.endpoint;
        let host = if e.group == reshard::Group::Src { src_host } else { dst_host };
        table.push(PeerAddr { endpoint: e, node: e.rank, addr, host });
        ends.push(end);
    }
    // Other ranks of the refit on the sources' host, that these do not
    // talk to.
    for r in 0..crowd {
        table.push(PeerAddr {
            endpoint: Endpoint::dst(100 + r),
            node: 100 + r,
            addr: transport::fabric::DataAddr::Node("127.0.0.1:9".parse().unwrap()),
            host: src_host,
        });
    }
    let mut memory = RankMemory::for_programs(&programs);
    fill_sources(&src, &mut memory[..2]);
    let results: Vec<Result<StagingKept, RankRunError>> = std::thread::scope(|s| {
        let handles: Vec<_> = ends
            .into_iter()
            .zip(&programs)
            .zip(memory.iter_mut())
            .map(|((end, program), memory)| {
                let table = &table;
                s.spawn(move || {
                    let tweak = |_: &mut NodeFaults| {};
                    let key = HelloKey([7; 32]);
                    let mut end = end.connect(program, table, Connecting { key, tweak: &tweak }).map_err(RankRunError::from)?;
                    let mut scratch = Scratch::default();
                    let options = RunOptions { deadline: Duration::from_secs(10), delta: None, scratch: &mut scratch };
                    end.run(program, RunMemory::Host(memory), options)?;
                    Ok(scratch.staging_kept())
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let kept = results.into_iter().collect::<Result<Vec<StagingKept>, RankRunError>>()?;
    verify_destinations(&src, &dst, &memory[2..]).unwrap();
    Ok(kept)
}

#[test]
fn ranks_of_one_host_share_memory_across_groups_only_when_asked() {
    let here = this_host();
    assert_ne!(here.machine, 0);
    // One host with the setting off, two hosts, unknown hosts, one host
    // with the groups run by two users: TCP between the groups, bit-exact.
    assert_eq!(refit(false, here, here, 0, "samehost-off").unwrap(), [false, false]);
    let there = Host { machine: here.machine ^ 2, ..here };
    assert_eq!(refit(true, here, there, 0, "samehost-two").unwrap(), [false, false]);
    assert_eq!(refit(true, Host::UNKNOWN, Host::UNKNOWN, 0, "samehost-unknown").unwrap(), [false, false]);
    let other_user = Host { user: here.user + 1, ..here };
    assert_eq!(refit(true, here, other_user, 0, "samehost-users").unwrap(), [false, false]);
    // A host of more than 16 of the refit's ranks shares memory only
    // within nodes.
    assert_eq!(refit(true, here, here, 13, "samehost-crowd").unwrap(), [false, false]);
    // One host, the setting on: the groups' pairs share memory.
    assert_eq!(refit(true, here, here, 12, "samehost-on").unwrap(), [true, true]);
}

/// Pieces that convert (f32 to bf16) on their way to a rank that shares
/// memory are converted straight into the region the sender lends: the
/// senders make no staging area, and every element arrives bit-exact.
/// Over TCP the same senders convert into staging first.
#[test]
fn pieces_converted_into_shared_memory_need_no_staging() {
    let here = this_host();
    let shared = refit_in(true, here, here, 0, "samehost-convert").unwrap();
    for (rank, kept) in shared[..2].iter().enumerate() {
        assert_eq!(kept.made, 0, "source rank {rank} made staging areas: {kept:?}");
    }
    let tcp = refit_in(false, here, here, 0, "samehost-convert-tcp").unwrap();
    for (rank, kept) in tcp[..2].iter().enumerate() {
        assert!(kept.made > 0, "source rank {rank} converted over TCP without staging: {kept:?}");
    }
}
