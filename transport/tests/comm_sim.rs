//! The communicator executor (`cuda::plane::run_rank_comm`) on the
//! simulated communicator and memory (`cuda::sim`): every example layout
//! pair, reshard and baseline, lands byte for byte what the in-process
//! executor lands; and the failures a GPU job meets (a rank that never
//! joins, a group that fails or stalls, an abort that hangs) end every
//! rank within its deadline, with the error naming rank and round.

use reshard::{parse_layout, plan_baseline, plan_reshard, BufferKey, Endpoint, Layout, PlanOptions, RankProgram};
use std::sync::Arc;
use std::time::{Duration, Instant};
use transport::{
    cuda::{
        abandoned_staging_bytes, arm, comm_rank, direct_read_bytes, live_comms, run_rank_comm, send_staging_bytes, sim_comm, sim_comm_id,
        AbortOutcome, CommConfig, CommError, CommExecError, CommHandle, CommPeers, IpcComm, PendingComm, SimBucket, SimFault, SimIpc,
        SimMemory,
    },
    fill_sources, local_fabric, run_local, verify_destinations, DeltaRun, ExecOptions, RankMemory,
};

const EXAMPLES: &[&str] =
    &["tp-to-tp", "pp-to-tp", "ep-moe", "fsdp-to-tp", "fused-qkv", "mixed-2d", "fp8-block-scaled", "fp8-source-quantized"];

fn layouts(name: &str) -> (Layout, Layout) {
    let dir = format!("{}/../examples/{name}", env!("CARGO_MANIFEST_DIR"));
    let read = |f: &str| {
        let path = format!("{dir}/{f}");
        parse_layout(&std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e}"))).unwrap()
    };
    (read("src.json"), read("dst.json"))
}

fn config(nranks: u32) -> CommConfig {
    CommConfig {
        init_timeout: Duration::from_secs(5),
        abort_timeout: Duration::from_secs(2),
        poll_interval: Duration::from_millis(1),
        ..CommConfig::new(0, nranks)
    }
}

/// What one rank's run came to.
struct Ran {
    result: Result<u64, CommExecError>,
    abort: AbortOutcome,
    took: Duration,
}

/// Every program's rank of one simulated communicator of `world` (all
/// created together, as one process hosting every rank), started.
fn start_sim(world: &str, programs: &[RankProgram], config: CommConfig) -> Vec<(PendingComm, Option<Arc<SimBucket>>)> {
    let src_ranks = programs.iter().filter(|p| p.endpoint.group == reshard::Group::Src).count() as u32;
    let nranks = programs.len() as u32;
    let id = sim_comm_id();
    let pending: Vec<_> = programs
        .iter()
        .map(|p| {
            let rank = comm_rank(p.endpoint, src_ranks);
            let world = world.to_string();
            CommHandle::start(CommConfig { rank, ..config }, &id.tag(), move || Ok(sim_comm(&world, id, rank, nranks)?)).unwrap()
        })
        .collect();
    pending.into_iter().map(|p| (p, None)).collect()
}

/// Runs every program as a thread on its rank of a communicator of
/// `plane` (the simulated one in `world`, or IPC buckets) made for the
/// run (with `deltas`, one delta run per rank); each rank aborts its
/// communicator when done.
fn run_on(
    plane: Plane,
    world: &str,
    programs: &[RankProgram],
    memory: &mut [RankMemory],
    deadline: Duration,
    deltas: Option<&mut [DeltaRun]>,
) -> Vec<Ran> {
    let config = config(programs.len() as u32);
    let pending = match plane {
        Plane::Nccl => start_sim(world, programs, config),
        Plane::Ipc => start_ipc(programs, config, false),
        Plane::IpcOneDevice => start_ipc(programs, config, true),
    };
    run_ranks(programs, memory, pending, deadline, deltas, matches!(plane, Plane::IpcOneDevice))
}

/// Runs every program as a thread on its communicator rank (`pending`,
/// with the exported bucket it packs into, if any, in program order;
/// with `deltas`, one delta run per rank; with `one_device`, every rank
/// on one device, reading its peers' memory directly); each rank aborts
/// its communicator when done.
fn run_ranks(
    programs: &[RankProgram],
    memory: &mut [RankMemory],
    pending: Vec<(PendingComm, Option<Arc<SimBucket>>)>,
    deadline: Duration,
    deltas: Option<&mut [DeltaRun]>,
    one_device: bool,
) -> Vec<Ran> {
    let deltas: Vec<Option<&mut DeltaRun>> = match deltas {
        Some(d) => d.iter_mut().map(Some).collect(),
        None => programs.iter().map(|_| None).collect(),
    };
    let src_ranks = programs.iter().filter(|p| p.endpoint.group == reshard::Group::Src).count() as u32;
    let nranks = programs.len() as u32;
    let rank_of = move |e: Endpoint| Some(comm_rank(e, src_ranks)).filter(|&r| r < nranks);
    let until = Instant::now() + deadline;
    std::thread::scope(|s| {
        let threads: Vec<_> = programs
            .iter()
            .zip(memory.iter_mut())
            .zip(pending)
            .zip(deltas)
            .map(|(((program, memory), (pending, bucket)), delta)| {
                s.spawn(move || {
                    let start = Instant::now();
                    let mut comm = match pending.wait() {
                        Ok(c) => c,
                        Err(e) => return Ran { result: Err(e.into()), abort: AbortOutcome::AlreadyClosed, took: start.elapsed() },
                    };
                    let mut memory = match bucket {
                        Some(b) => SimMemory::with_bucket(memory, b),
                        None => SimMemory::new(memory),
                    };
                    let same_device = |_: Endpoint| one_device;
                    let peers = CommPeers { rank_of: &rank_of, same_device: &same_device };
                    let result = run_rank_comm(&mut memory, program, &mut comm, &peers, until, delta).map(|s| s.sent_bytes);
                    let abort = comm.abort();
                    Ran { result, abort, took: start.elapsed() }
                })
            })
            .collect();
        threads.into_iter().map(|t| t.join().unwrap()).collect()
    })
}

/// Every program's rank of an IPC communicator, started: each rank
/// exports its send bucket, maps those of the ranks it receives from
/// (with `one_device`, also of those it sends to: their done tokens), and
/// rings doorbells over in-process channels.
fn start_ipc(programs: &[RankProgram], config: CommConfig, one_device: bool) -> Vec<(PendingComm, Option<Arc<SimBucket>>)> {
    let src_ranks = programs.iter().filter(|p| p.endpoint.group == reshard::Group::Src).count() as u32;
    let nranks = programs.len() as u32;
    let endpoints: Vec<Endpoint> = programs.iter().map(|p| p.endpoint).collect();
    let rank_of = move |e: Endpoint| Some(comm_rank(e, src_ranks)).filter(|&r| r < nranks);
    let exported: Vec<(SimIpc, _, u64)> = programs
        .iter()
        .map(|p| {
            let bytes = send_staging_bytes(p);
            let (ipc, handle) = SimIpc::export(bytes);
            (ipc, handle, bytes)
        })
        .collect();
    let handles: Vec<_> = exported.iter().map(|(_, h, b)| (*h, *b)).collect();
    let pending: Vec<_> = programs
        .iter()
        .zip(exported)
        .zip(local_fabric(&endpoints))
        .map(|((p, (mut ipc, _, _)), bells)| {
            let senders = p.rounds.iter().flat_map(|r| r.recvs.iter()).map(|m| m.peer);
            let readers = p.rounds.iter().flat_map(|r| r.sends.iter()).map(|m| m.peer).filter(|_| one_device);
            for e in senders.chain(readers).collect::<std::collections::BTreeSet<_>>() {
                let peer = rank_of(e).unwrap();
                let (h, b) = handles[peer as usize];
                ipc.map_peer(peer, &h, b).unwrap();
            }
            let bucket = ipc.bucket();
            let endpoints = endpoints.clone();
            let rank = rank_of(p.endpoint).unwrap();
            let started = CommHandle::start(CommConfig { rank, ..config }, "ipc", move || Ok(IpcComm::new(endpoints, bells, ipc))).unwrap();
            (started, bucket)
        })
        .collect();
    pending.into_iter().map(|(p, b)| (p, Some(b))).collect()
}

/// Which communicator a check runs on.
#[derive(Clone, Copy, Debug)]
enum Plane {
    /// The simulated NCCL communicator.
    Nccl,
    /// The IPC communicator over simulated buckets.
    Ipc,
    /// The IPC communicator with every rank on one device: each message
    /// read straight from its sender's memory.
    IpcOneDevice,
}

/// Runs example `name` planned by `strategy` on `plane` and checks it
/// against the in-process executor.
fn check(name: &str, strategy: &str, plane: Plane) {
    let (src, dst) = layouts(name);
    let plan = match strategy {
        "reshard" => plan_reshard(&src, &dst, &PlanOptions::default()).unwrap(),
        _ => plan_baseline(&src, &dst, &PlanOptions::default()).unwrap(),
    };
    let what = format!("{name} {strategy} over {plane:?}");
    let programs = plan.programs(&src, &dst).unwrap();
    let mut expected = RankMemory::for_programs(&programs);
    fill_sources(&src, &mut expected);
    let mut memory = expected.clone();
    run_local(&programs, &mut expected, &ExecOptions::default()).unwrap();
    let read_before = direct_read_bytes();
    let ran = run_ok(&what, plane, &format!("examples/{name}/{strategy}"), &programs, &mut memory, None);
    if matches!(plane, Plane::IpcOneDevice) && plan.figures().total_bytes > 0 {
        assert!(direct_read_bytes() > read_before, "{what}: nothing was read directly");
    }
    let mut sent = 0;
    for r in &ran {
        sent += r.result.as_ref().map_or(0, |s| *s);
        assert!(matches!(r.abort, AbortOutcome::Aborted { .. }), "{what}: {:?}", r.abort);
    }
    assert_eq!(sent, plan.figures().total_bytes, "{what}: bytes sent");
    for (p, (got, want)) in programs.iter().zip(memory.iter().zip(&expected)) {
        // The rank's own buffers (the host executor never fills a scratch
        // buffer it bypasses).
        for (i, spec) in p.buffers.iter().enumerate() {
            if p.endpoint.group == reshard::Group::Dst && !matches!(spec.key, BufferKey::Scratch { .. }) {
                assert!(got.buffers[i] == want.buffers[i], "{what}: {} buffer {} differs", p.endpoint, spec.name);
            }
        }
    }
    let dst_memory: Vec<RankMemory> =
        programs.iter().zip(&memory).filter(|(p, _)| p.endpoint.group == reshard::Group::Dst).map(|(_, m)| m.clone()).collect();
    verify_destinations(&src, &dst, &dst_memory).unwrap_or_else(|m| panic!("{what}: {m:?}"));
}

/// Every example, reshard and baseline: the simulated communicator lands
/// every destination byte the in-process executor lands, and moves the
/// plan's bytes.
#[test]
fn every_example_lands_what_the_host_executor_lands() {
    for name in EXAMPLES {
        for strategy in ["reshard", "baseline"] {
            check(name, strategy, Plane::Nccl);
        }
    }
}

/// The same over the IPC communicator: doorbells and copies out of the
/// senders' exported buckets.
#[test]
fn every_example_lands_the_same_over_ipc_buckets() {
    for name in EXAMPLES {
        for strategy in ["reshard", "baseline"] {
            check(name, strategy, Plane::Ipc);
        }
    }
}

/// The same with every rank on one device: each message is an offer of
/// where its pieces lie, and the receiver copies them from the sender's
/// memory into its own, converting on the way.
#[test]
fn every_example_lands_the_same_read_directly_on_one_device() {
    for name in EXAMPLES {
        for strategy in ["reshard", "baseline"] {
            check(name, strategy, Plane::IpcOneDevice);
        }
    }
}

/// [`run_on`] within 30 s, failing on any rank's error.
fn run_ok(
    what: &str,
    plane: Plane,
    world: &str,
    programs: &[RankProgram],
    memory: &mut [RankMemory],
    deltas: Option<&mut [DeltaRun]>,
) -> Vec<Ran> {
    let ran = run_on(plane, world, programs, memory, Duration::from_secs(30), deltas);
    let failed: Vec<String> =
        programs.iter().zip(&ran).filter_map(|(p, r)| r.result.as_ref().err().map(|e| format!("{}: {e}", p.endpoint))).collect();
    assert!(failed.is_empty(), "{what}:\n{}", failed.join("\n"));
    ran
}

/// Runs `programs` on `plane` as delta refits (`deltas`, one per rank),
/// fails on any rank's error, and returns the bytes put on the wire.
fn run_delta(what: &str, plane: Plane, programs: &[RankProgram], memory: &mut [RankMemory], deltas: &mut [DeltaRun]) -> u64 {
    let ran = run_ok(what, plane, &format!("delta/{what}"), programs, memory, Some(deltas));
    ran.iter().map(|r| r.result.as_ref().map_or(0, |s| *s)).sum()
}

/// The destination ranks' own buffers of `memory` equal `want`'s.
fn same_destinations(what: &str, programs: &[RankProgram], memory: &[RankMemory], want: &[RankMemory]) {
    for (p, (got, want)) in programs.iter().zip(memory.iter().zip(want)) {
        for (i, spec) in p.buffers.iter().enumerate() {
            if p.endpoint.group == reshard::Group::Dst && !matches!(spec.key, BufferKey::Scratch { .. }) {
                assert!(got.buffers[i] == want.buffers[i], "{what}: {} buffer {} differs", p.endpoint, spec.name);
            }
        }
    }
}

/// Delta refits over a communicator: the first (no base) and a second
/// after a few source bytes changed both land every destination byte the
/// in-process executor lands; the second puts far fewer bytes on the
/// wire; a rank that lost its base fails the refit by name.
fn delta_check(name: &str, plane: Plane) {
    let (src, dst) = layouts(name);
    let plan = plan_reshard(&src, &dst, &PlanOptions::default()).unwrap();
    let what = format!("{name} delta over {plane:?}");
    let programs = plan.programs(&src, &dst).unwrap();
    let n_src = src.ranks() as usize;
    let mut expected = RankMemory::for_programs(&programs);
    fill_sources(&src, &mut expected);
    let mut memory = expected.clone();
    run_local(&programs, &mut expected, &ExecOptions::default()).unwrap();
    // Refit 1: no base, every message dense in its encoding.
    let mut deltas: Vec<DeltaRun> = programs.iter().map(|_| DeltaRun::new(None)).collect();
    let first = run_delta(&format!("{what} 1"), plane, &programs, &mut memory, &mut deltas);
    same_destinations(&format!("{what} 1"), &programs, &memory, &expected);
    assert!(first >= plan.figures().total_bytes, "{what}: {first} bytes, the plan moves {}", plan.figures().total_bytes);
    // Refit 2: a few bytes of every source's first buffer change.
    for m in memory[..n_src].iter_mut().chain(expected[..n_src].iter_mut()) {
        for b in m.buffers[0].iter_mut().take(64) {
            *b = b.wrapping_add(1);
        }
    }
    run_local(&programs, &mut expected, &ExecOptions::default()).unwrap();
    let mut next: Vec<DeltaRun> = deltas.into_iter().map(|d| DeltaRun::new(Some(d.next))).collect();
    let memos: Vec<_> = next.iter().map(|d| d.base.clone()).collect();
    let second = run_delta(&format!("{what} 2"), plane, &programs, &mut memory, &mut next);
    same_destinations(&format!("{what} 2"), &programs, &memory, &expected);
    assert!(second * 4 < first, "{what}: {second} bytes after a small change, {first} dense");
    // Refit 3 with one destination's base gone: its peers' deltas cannot
    // be rebuilt there, and that rank says so.
    let lost =
        programs.iter().position(|p| p.endpoint.group == reshard::Group::Dst && !p.rounds.iter().all(|r| r.recvs.is_empty())).unwrap();
    let mut third: Vec<DeltaRun> = memos.into_iter().enumerate().map(|(i, m)| DeltaRun::new(if i == lost { None } else { m })).collect();
    let ran = run_on(plane, &format!("delta/{what} 3"), &programs, &mut memory, Duration::from_secs(30), Some(&mut third));
    match &ran[lost].result {
        Err(CommExecError::Delta { me, error, .. }) => {
            assert!(*me == programs[lost].endpoint && error.to_string().contains("base"), "{what}: {error}")
        }
        other => panic!("{what}: rank {} without its base: {:?}", programs[lost].endpoint, other.as_ref().err()),
    }
}

/// Delta refits run on the simulated NCCL and IPC communicators alike,
/// block-scaled FP8 destinations included.
#[test]
fn delta_refits_land_every_byte_and_send_what_changed() {
    for name in ["tp-to-tp", "mixed-2d", "fp8-block-scaled", "fp8-source-quantized"] {
        for plane in [Plane::Nccl, Plane::Ipc] {
            delta_check(name, plane);
        }
    }
}

fn tp_programs() -> Vec<RankProgram> {
    let (src, dst) = layouts("tp-to-tp");
    plan_reshard(&src, &dst, &PlanOptions::default()).unwrap().programs(&src, &dst).unwrap()
}

/// Runs `programs` on the simulated communicator with `faults` armed.
fn faulted(world: &str, faults: Vec<SimFault>, deadline: Duration) -> (Vec<RankProgram>, Vec<Ran>, Duration) {
    let programs = tp_programs();
    let mut memory = RankMemory::for_programs(&programs);
    arm(world, faults);
    let start = Instant::now();
    let ran = run_on(Plane::Nccl, world, &programs, &mut memory, deadline, None);
    (programs, ran, start.elapsed())
}

#[test]
fn a_rank_that_never_joins_fails_every_creation_within_its_timeout() {
    let (_, ran, took) = faulted("never-joins", vec![SimFault::NeverJoins { rank: 1 }], Duration::from_secs(30));
    // The rank that never joined times out; the others time out too, or
    // fail as soon as it gives up.
    assert!(matches!(ran[1].result, Err(CommExecError::Comm(CommError::InitTimeout { rank: 1, abandoned: false, .. }))));
    for r in &ran {
        assert!(
            matches!(
                r.result,
                Err(CommExecError::Comm(CommError::InitTimeout { abandoned: false, .. } | CommError::InitFailed { abandoned: false, .. }))
            ),
            "{:?}",
            r.result.as_ref().err()
        );
    }
    // Creation waits its 5 s, then the cleanup its abort timeout at most.
    assert!(took < Duration::from_secs(9), "{took:?}");
    assert_eq!(live_comms("never-joins"), 0);
}

#[test]
fn a_failed_group_fails_its_peers_at_once_not_at_the_deadline() {
    let (programs, ran, took) = faulted("group-fails", vec![SimFault::GroupFails { rank: 0, group: 0 }], Duration::from_secs(60));
    match &ran[0].result {
        Err(CommExecError::Comm(CommError::GroupFailed { rank: 0, round: 0, reason, .. })) => {
            assert!(reason.to_string().contains("simulated"), "{reason}")
        }
        other => panic!("{other:?}"),
    }
    // Every rank that rank 0 exchanges with fails once it aborts, long
    // before the minute's deadline.
    let failed = ran.iter().filter(|r| r.result.is_err()).count();
    assert!(failed > 1, "only {failed} of {} ranks failed", programs.len());
    for (p, r) in programs.iter().zip(&ran) {
        if let Err(e) = &r.result {
            assert!(r.took < Duration::from_secs(10), "{}: {e} after {:?}", p.endpoint, r.took);
        }
    }
    assert!(took < Duration::from_secs(10), "{took:?}");
    // The failed groups' staging is given up, not freed.
    assert!(abandoned_staging_bytes() > 0);
}

#[test]
fn a_stalled_group_times_out_at_the_deadline() {
    let deadline = Duration::from_millis(700);
    let (_, ran, took) = faulted("group-stalls", vec![SimFault::GroupStalls { rank: 2, group: 0 }], deadline);
    assert!(
        matches!(&ran[2].result, Err(CommExecError::Comm(CommError::GroupTimeout { rank: 2, round: 0, .. }))),
        "{:?}",
        ran[2].result.as_ref().err()
    );
    assert!(took < deadline + Duration::from_secs(4), "{took:?}");
}

#[test]
fn an_abort_that_hangs_is_abandoned_within_the_abort_timeout() {
    let (_, ran, took) = faulted("abort-hangs", vec![SimFault::AbortHangs { rank: 1 }], Duration::from_secs(30));
    assert!(ran[1].result.is_ok(), "{:?}", ran[1].result.as_ref().err());
    match &ran[1].abort {
        AbortOutcome::Abandoned { waited, .. } => assert!(*waited < Duration::from_secs(3), "{waited:?}"),
        other => panic!("{other:?}"),
    }
    assert!(ran[1].abort.needs_restart());
    assert!(took < Duration::from_secs(6), "{took:?}");
}

/// Faults are armed for the next communicator of a world only: the one
/// created after a failure (a new id) runs clean.
#[test]
fn the_next_communicator_of_a_world_runs_clean() {
    let (_, ran, _) = faulted("recovers", vec![SimFault::GroupFails { rank: 0, group: 0 }], Duration::from_secs(30));
    assert!(ran[0].result.is_err());
    let (_, ran, _) = faulted("recovers", Vec::new(), Duration::from_secs(30));
    assert!(ran.iter().all(|r| r.result.is_ok()));
}

/// A peer that lies in a delta exchange: it announces an encoding longer
/// than the message could take, or sends bytes that are no encoding of
/// it. The receiver refuses both by name (the first before posting any
/// receive of that length), and its buffers keep what they held.
#[test]
fn a_peer_lying_in_a_delta_exchange_is_refused() {
    use transport::cuda::P2p;
    let src = parse_layout(
        r#"{"ranks": 1, "tensors": [{"name": "w", "dtype": "f32", "shape": [64], "mesh": {"shape": [1]}, "placements": ["replicate"]}]}"#,
    )
    .unwrap();
    let dst = src.clone();
    let programs = plan_reshard(&src, &dst, &PlanOptions::default()).unwrap().programs(&src, &dst).unwrap();
    assert_eq!(programs.len(), 2);
    for (case, announced, sent) in [("too long", u64::MAX, 0usize), ("not an encoding", 40, 40)] {
        let world = format!("liar/{case}");
        let mut pending = start_sim(&world, &programs, config(2)).into_iter();
        let (liar, honest) = (pending.next().unwrap().0, pending.next().unwrap().0);
        let mut memory = RankMemory::for_programs(&programs);
        let before = memory[1].clone();
        let until = Instant::now() + Duration::from_secs(10);
        let result = std::thread::scope(|s| {
            s.spawn(move || {
                let mut comm = liar.wait().unwrap();
                let word = announced.to_le_bytes();
                let junk = vec![0xa5u8; sent];
                // SAFETY: both buffers are this thread's, alive until the
                // groups return (the simulated communicator copies on the
                // call), and only read.
                let first = unsafe { comm.group(0, vec![P2p::Send { peer: 1, addr: word.as_ptr() as u64, bytes: 8 }], None, until) };
                if first.is_ok() && sent > 0 {
                    let ops = vec![P2p::Send { peer: 1, addr: junk.as_ptr() as u64, bytes: sent as u64 }];
                    // SAFETY: as above.
                    let _ = unsafe { comm.group(1, ops, None, until) };
                }
                comm.abort();
            });
            let rank_of = |e: Endpoint| Some(comm_rank(e, 1)).filter(|&r| r < 2);
            let mut comm = honest.wait().unwrap();
            let mut plane = SimMemory::new(&mut memory[1]);
            let mut delta = DeltaRun::new(None);
            let peers = CommPeers { rank_of: &rank_of, same_device: &|_| false };
            let r = run_rank_comm(&mut plane, &programs[1], &mut comm, &peers, until, Some(&mut delta));
            comm.abort();
            r
        });
        match result {
            Err(CommExecError::Delta { error, .. }) => {
                let want = if announced == u64::MAX { "announced" } else { "delta message" };
                assert!(error.to_string().contains(want), "{case}: {error}");
            }
            other => panic!("{case}: {other:?}"),
        }
        assert!(memory[1] == before, "{case}: the destination's buffers changed");
    }
}

/// A peer on the same device whose offer lies — bytes that decode to no
/// record, or a record naming memory nobody offered — fails the receiver's
/// run before anything is read through it; the receiver's buffers are
/// untouched.
#[test]
fn a_peer_lying_in_its_offer_is_refused_before_anything_is_read() {
    use transport::cuda::P2p;
    let src = parse_layout(
        r#"{"ranks": 1, "tensors": [{"name": "w", "dtype": "f32", "shape": [64], "mesh": {"shape": [1]}, "placements": ["replicate"]}]}"#,
    )
    .unwrap();
    let dst = src.clone();
    let programs = plan_reshard(&src, &dst, &PlanOptions::default()).unwrap().programs(&src, &dst).unwrap();
    let pieces = programs[1].rounds[0].recvs[0].pieces.len();
    // One record: a handle (64 bytes), the region's offset and bytes, the
    // span's base and 8 strides, the dtype's code.
    let record = |handle: u8, len: u64| {
        let mut r = vec![handle; 64];
        for word in [0u64, len, 0, 1, 0, 0, 0, 0, 0, 0, 0, u64::from(reshard::DType::F32.index())] {
            r.extend_from_slice(&word.to_le_bytes());
        }
        r
    };
    let cases = [
        ("junk", vec![0xa5u8; 160 * pieces], "offered piece 0"),
        ("forged", record(0x22, 256).repeat(pieces), "no member of this process offered"),
    ];
    for (case, offer, want) in cases {
        let world = format!("offer-liar/{case}");
        let mut pending = start_sim(&world, &programs, config(2)).into_iter();
        let (liar, honest) = (pending.next().unwrap().0, pending.next().unwrap().0);
        let mut memory = RankMemory::for_programs(&programs);
        let before = memory[1].clone();
        let until = Instant::now() + Duration::from_secs(10);
        let result = std::thread::scope(|s| {
            s.spawn(move || {
                let mut comm = liar.wait().unwrap();
                // SAFETY: the buffer is this thread's, alive until the group
                // returns (the simulated communicator copies on the call),
                // and only read.
                let _ = unsafe {
                    comm.group(0, vec![P2p::Send { peer: 1, addr: offer.as_ptr() as u64, bytes: offer.len() as u64 }], None, until)
                };
                comm.abort();
            });
            let rank_of = |e: Endpoint| Some(comm_rank(e, 1)).filter(|&r| r < 2);
            let mut comm = honest.wait().unwrap();
            let mut plane = SimMemory::new(&mut memory[1]);
            let peers = CommPeers { rank_of: &rank_of, same_device: &|_| true };
            let r = run_rank_comm(&mut plane, &programs[1], &mut comm, &peers, until, None);
            comm.abort();
            r
        });
        match result {
            Err(CommExecError::Direct { error, .. }) => assert!(error.to_string().contains(want), "{case}: {error}"),
            other => panic!("{case}: {other:?}"),
        }
        assert!(memory[1] == before, "{case}: the destination's buffers changed");
    }
}
