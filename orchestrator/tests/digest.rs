//! The digest check before every commit (`OrchestratorConfig::digest_check`): a
//! byte of a destination flipped after its run and before the commit
//! (`testkit::Corrupt`) fails the refit, naming the destination rank,
//! with nothing committed anywhere — every destination serves its last
//! version, bit for bit — and the next refit succeeds. On staged host
//! stores, registered stores (staged, then copied in) and stores written in
//! place; the sources send f32 that the destinations hold as bf16; over
//! the in-process and the node fabric, dense and delta; and a destination
//! that widens (bf16 sent, f32 held), whose flipped low byte no narrowing
//! would see. With the check off, the same flip is committed: what the
//! check stands between.

use orchestrator::testkit::Corrupt;
use orchestrator::{
    spawn_orchestrator, DstStore, Fabric, HeldVersion, Member, MemberConfig, NodeFabric, OrchestratorConfig, OrchestratorError,
    OrchestratorHandle, RefitError, Registered, Residence, Role, SrcStore,
};
use reshard::{parse_layout, Endpoint, Group, Layout};
use std::sync::Arc;
use std::time::Duration;

mod common;

/// Where a destination keeps what it serves.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    /// `DstStore::new`: staging swapped in on commit.
    Staged,
    /// `DstStore::registered`: the user's memory, staging copied in on
    /// commit.
    Registered,
    /// `DstStore::registered_direct`: the user's memory, written in place
    /// by the run.
    InPlace,
}

struct System {
    orchestrator: OrchestratorHandle,
    src: Vec<Arc<SrcStore>>,
    dst: Vec<Arc<DstStore>>,
    /// Each destination rank's flip, armed by the test.
    corrupt: Vec<Arc<Corrupt>>,
    /// Registered destinations' own memory (boxed: never moves), per rank
    /// and buffer.
    memory: Vec<Vec<Box<[u8]>>>,
}

fn system(src: Layout, dst: Layout, kind: Kind, config: OrchestratorConfig) -> System {
    let (src, dst) = (Arc::new(src), Arc::new(dst));
    let spawn = actors::SpawnConfig::default().call_timeout(config.deadline + config.control_timeout);
    let src_stores: Vec<Arc<SrcStore>> = (0..src.ranks()).map(|r| Arc::new(SrcStore::new(&src, r))).collect();
    let src_members =
        src_stores.iter().enumerate().map(|(r, s)| actors::spawn(Member::new(src.clone(), r as u32, Role::Src(s.clone())), spawn.clone()));
    let src_members: Vec<_> = src_members.collect();
    let (mut dst_stores, mut dst_members, mut corrupt, mut memory) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for r in 0..dst.ranks() {
        let store = match kind {
            Kind::Staged => DstStore::new(&dst, r),
            Kind::Registered | Kind::InPlace => {
                let mut buffers: Vec<Box<[u8]>> =
                    dst.rank_buffers(r).iter().map(|b| vec![0xa5; (b.elems * b.dtype.size()) as usize].into_boxed_slice()).collect();
                let regions = buffers.iter_mut().map(|b| (b.as_mut_ptr() as u64, b.len())).collect();
                // SAFETY: each buffer lives in `System::memory` until the
                // test ends and never moves (boxed); the test reads it only
                // while no refit is in progress.
                let reg = unsafe { Registered::new(&dst, r, Residence::Host, regions) }.unwrap();
                memory.push(buffers);
                match kind {
                    Kind::Registered => DstStore::registered(&dst, r, reg),
                    _ => DstStore::registered_direct(&dst, r, reg),
                }
            }
        };
        let store = Arc::new(store);
        let flip = Arc::new(Corrupt::default());
        let config = MemberConfig { corrupt: Some(flip.clone()), ..MemberConfig::default() };
        dst_members.push(actors::spawn(Member::with_config(dst.clone(), r, Role::Dst(store.clone()), config), spawn.clone()));
        dst_stores.push(store);
        corrupt.push(flip);
    }
    let orchestrator = spawn_orchestrator(actors::ActorGroup::from_refs(src_members), actors::ActorGroup::from_refs(dst_members), config);
    System { orchestrator, src: src_stores, dst: dst_stores, corrupt, memory }
}

fn config(fabric: Fabric, delta: bool) -> OrchestratorConfig {
    OrchestratorConfig {
        fabric,
        delta,
        deadline: Duration::from_secs(10),
        control_timeout: Duration::from_secs(5),
        ..OrchestratorConfig::default()
    }
}

impl System {
    /// A step: every source element (one f32 buffer, "params") a value of
    /// `seed`, each exact in bf16 and each element different.
    async fn step(&self, seed: f32) -> u64 {
        let mut version = 0;
        for (r, s) in self.src.iter().enumerate() {
            let step = |b: &mut orchestrator::Buffers| {
                let values: Vec<f32> = (0..b.specs()[0].elems as usize).map(|i| seed + (r * 64 + i) as f32 * 0.25).collect();
                b.write_buffer_f32("params", &values)
            };
            version = s.try_update(step).await.unwrap().0;
        }
        version
    }

    /// What every destination serves: its version (if it serves a whole
    /// one) and the bytes of every buffer.
    async fn served(&self) -> Vec<(HeldVersion, Vec<Vec<u8>>)> {
        let mut all = Vec::new();
        for (r, store) in self.dst.iter().enumerate() {
            let bytes = match self.memory.get(r) {
                // No refit is in progress: the member writes none of it.
                Some(buffers) => buffers.iter().map(|b| b.to_vec()).collect(),
                None => store.snapshot().map(|s| s.buffers.memory().buffers.clone()).unwrap_or_default(),
            };
            all.push((store.weights(), bytes));
        }
        all
    }
}

/// The refit fails naming destination rank `rank` and a source it holds
/// pieces of.
fn names_rank(e: &RefitError, rank: u32) -> bool {
    matches!(
        e,
        RefitError::Refit(OrchestratorError::DigestMismatch { rank: r, .. }) if *r == Endpoint { group: Group::Dst, rank }
    )
}

/// Refits `v1` (and, for delta, `v2` on the first one's base), then a
/// refit whose destination rank 2 finds a byte flipped before its digest:
/// it fails naming rank 2, nothing is committed, and the next refit
/// serves its version.
async fn flipped_byte_is_caught(kind: Kind, fabric: Fabric, delta: bool) {
    let (src, dst) = common::layouts();
    let sys = system(src, dst, kind, config(fabric.clone(), delta));
    let case = format!("{kind:?}, {fabric:?}, delta {delta}");
    let mut v = 0;
    for seed in [1.0, 2.0] {
        v = sys.step(seed).await;
        let report = sys.orchestrator.refit(v).await.unwrap_or_else(|e| panic!("{case}: {e}"));
        assert_eq!((report.verified_ranks, report.unverified_ranks), (4, 0), "{case}");
        assert!(report.verify_time > Duration::ZERO, "{case}");
    }
    let before = sys.served().await;
    assert!(before.iter().all(|(w, _)| *w == HeldVersion::Version(v)), "{case}");
    // Byte 1 of destination rank 2's first buffer: the high byte of its
    // first bf16 element.
    sys.corrupt[2].arm(0, 1);
    let bad = sys.step(3.0).await;
    let e = sys.orchestrator.refit(bad).await.expect_err(&case);
    assert!(names_rank(&e, 2), "{case}: {e}");
    assert!(e.to_string().contains("nothing was committed"), "{case}: {e}");
    assert!(!sys.corrupt[2].armed(), "{case}: the flip was never made");
    let after = sys.served().await;
    for (r, ((w0, b0), (w1, b1))) in before.iter().zip(&after).enumerate() {
        match kind {
            // Written where it is served: torn, never the new version.
            Kind::InPlace => assert!(matches!(w1, HeldVersion::Torn { .. }), "{case}: rank {r} {w1}"),
            // Every destination serves its last version, bit for bit.
            _ => assert!(w1 == w0 && b1 == b0, "{case}: rank {r} serves {w1}, or other bytes of it"),
        }
    }
    // The next refit (the flip is spent) commits everywhere.
    let next = sys.step(4.0).await;
    let report = sys.orchestrator.refit(next).await.unwrap_or_else(|e| panic!("{case}: {e}"));
    assert_eq!(report.verified_ranks, 4, "{case}");
    let now = sys.served().await;
    assert!(now.iter().all(|(w, _)| *w == HeldVersion::Version(next)), "{case}");
    // Every rank of a data-parallel pair holds the same bytes.
    assert!(now[0].1 == now[2].1 && now[1].1 == now[3].1, "{case}");
    assert!(now[0].1 != before[0].1, "{case}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_byte_flipped_before_the_commit_fails_the_refit_in_process() {
    for kind in [Kind::Staged, Kind::Registered, Kind::InPlace] {
        flipped_byte_is_caught(kind, Fabric::InProcess, false).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_byte_flipped_before_the_commit_fails_a_delta_refit_in_process() {
    for kind in [Kind::Staged, Kind::Registered, Kind::InPlace] {
        flipped_byte_is_caught(kind, Fabric::InProcess, true).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_byte_flipped_before_the_commit_fails_the_refit_on_the_node_fabric() {
    for (kind, delta) in [(Kind::Staged, true), (Kind::InPlace, false), (Kind::Registered, true)] {
        flipped_byte_is_caught(kind, Fabric::Node(NodeFabric::default()), delta).await;
    }
}

/// Sources in bf16, destinations in f32: the destinations widen on
/// receipt. Their lowest byte flipped narrows back to the same bf16, so
/// only the check that every element is a widened wire value sees it.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_widening_destination_is_read_back_exactly() {
    let src = common::SRC.replace("\"f32\"", "\"bf16\"");
    let dst = common::DST.replace("\"bf16\"", "\"f32\"");
    let (src, dst) = (parse_layout(&src).unwrap(), parse_layout(&dst).unwrap());
    let sys = system(src, dst, Kind::Staged, config(Fabric::InProcess, false));
    let mut version = 0;
    for (seed, flip) in [(1.0, false), (2.0, true), (3.0, false)] {
        for s in &sys.src {
            let step = |b: &mut orchestrator::Buffers| {
                let bf16 = |i: usize| (((seed + i as f32 * 0.25).to_bits() >> 16) as u16).to_le_bytes();
                let values: Vec<u8> = (0..b.specs()[0].elems as usize).flat_map(bf16).collect();
                b.buffer_mut("params").map(|p| p.copy_from_slice(&values))
            };
            version = s.try_update(step).await.unwrap().0;
        }
        if flip {
            // The lowest byte of rank 1's first f32 element.
            sys.corrupt[1].arm(0, 0);
            let e = sys.orchestrator.refit(version).await.unwrap_err();
            assert!(names_rank(&e, 1) && e.to_string().contains("widened"), "{e}");
            assert!(sys.served().await.iter().all(|(w, _)| *w == HeldVersion::Version(version - 1)));
        } else {
            let report = sys.orchestrator.refit(version).await.unwrap();
            assert_eq!(report.verified_ranks, 4);
        }
    }
}

/// With the check off, the same flip is committed and served: nothing
/// else stands between a corrupted byte and the served weights.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn with_the_check_off_a_flipped_byte_is_served() {
    let (src, dst) = common::layouts();
    let sys = system(src, dst, Kind::Staged, OrchestratorConfig { digest_check: false, ..config(Fabric::InProcess, false) });
    let v = sys.step(1.0).await;
    sys.corrupt[2].arm(0, 1);
    let report = sys.orchestrator.refit(v).await.unwrap();
    assert_eq!((report.verify_time, report.verified_ranks, report.unverified_ranks), (Duration::ZERO, 0, 0));
    assert!(!sys.corrupt[2].armed());
    // Rank 2 serves the flipped byte: it differs from rank 0, which holds
    // the same elements.
    let served = sys.served().await;
    assert!(served.iter().all(|(w, _)| *w == orchestrator::HeldVersion::Version(v)));
    assert!(served[0].1 != served[2].1);
    let mut unflipped = served[2].1.clone();
    unflipped[0][1] ^= 0xff;
    assert_eq!(unflipped, served[0].1);
}
