//! The schedule of a reshard whose ranks all live on one device: every
//! rank's program flattened into one ordered list of copies, each from one
//! rank's buffer to one or more places in another's (or its own). Order
//! keeps the programs' round semantics: a round's local copies, then its
//! transfers, then the next round. Running the steps in order on one stream
//! is then equivalent to running every program over a transport.
//!
//! Pure, compiled and tested without a GPU; the device executor (`exec`,
//! `cuda` feature) runs the steps with device copies.

// Pure, and tested without a GPU in every build; what runs it on a device
// needs the `cuda` feature.
#![cfg_attr(not(feature = "cuda"), allow(dead_code))]

use crate::copy::fits;
use crate::cuda::plane_error::{PeerMissing, UnknownPeer};
use crate::cursor::{Round, RoundCursor, Unexpected};
use crate::exec::PieceOutOfBounds;
use reshard::{Block, DType, Endpoint, RankProgram, Span};
use std::collections::HashMap;
use thiserror::Error;

/// Where a piece is: a rank (index into the programs), a span of one of its
/// buffers, and that buffer's element type.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Place {
    /// Index of the rank's program.
    pub rank: usize,
    /// The elements in the rank's buffer.
    pub span: Span,
    /// Element type of the buffer.
    pub dtype: DType,
}

/// One copy of a piece. Values go `from.dtype` → `wire` → each `to` dtype,
/// exactly as a sender narrows to the wire type and a receiver widens.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Step {
    /// Plan round.
    pub round: u32,
    /// The piece.
    pub block: Block,
    /// Where it is read.
    pub from: Place,
    /// Type it travels in (the destination type for a local copy).
    pub wire: DType,
    /// Where it is written.
    pub to: Vec<Place>,
    /// Whether it is a copy inside one rank (no bytes between ranks).
    pub local: bool,
}

impl Step {
    /// Whether no dtype conversion is needed (a plain byte copy).
    pub(crate) fn is_direct(&self) -> bool {
        self.from.dtype == self.wire && self.to.iter().all(|t| t.dtype == self.wire)
    }
}

/// Every rank's program as one ordered list of copies.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct Schedule {
    /// Copies, in the order to run them.
    pub steps: Vec<Step>,
    /// Bytes between ranks (wire type), as an executor over a transport reports.
    pub wire_bytes: u64,
    /// Messages between ranks.
    pub messages: u64,
}

/// Why programs do not form a consistent same-device schedule.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
pub enum ScheduleError {
    /// A rank expects a message its peer does not send.
    #[error("{me}: round {round}: expects a message from {peer}, which sends none")]
    Unmatched {
        /// Receiving rank.
        me: Endpoint,
        /// Expected sender.
        peer: Endpoint,
        /// Round.
        round: u32,
    },
    /// Sender and receiver disagree on a message's pieces.
    #[error("{me}: round {round}: message from {peer} does not match: {problem}")]
    Mismatch {
        /// Receiving rank.
        me: Endpoint,
        /// Sender.
        peer: Endpoint,
        /// Round.
        round: u32,
        /// What differs.
        problem: String,
    },
    /// A message is sent and never received.
    #[error("{me}: round {round}: message to {peer} is never received")]
    Unreceived {
        /// Sending rank.
        me: Endpoint,
        /// Intended receiver.
        peer: Endpoint,
        /// Round.
        round: u32,
    },
    /// A message names a rank with no program.
    #[error(transparent)]
    UnknownPeer(#[from] UnknownPeer),
    /// A span falls outside its buffer.
    #[error(transparent)]
    OutOfBounds(#[from] PieceOutOfBounds),
}

fn place(programs: &[RankProgram], rank: usize, span: &Span, dtype: DType, block: &Block) -> Result<Place, ScheduleError> {
    let p = &programs[rank];
    let oob = || ScheduleError::from(PieceOutOfBounds::new(p.endpoint, *block, span.buffer));
    let spec = p.buffers.get(span.buffer as usize).ok_or_else(oob)?;
    let len = spec.elems.checked_mul(spec.dtype.size()).ok_or_else(oob)?;
    if spec.dtype != dtype || !fits(block.extent(), len as usize, span.base, &span.strides, dtype) {
        return Err(oob());
    }
    Ok(Place { rank, span: *span, dtype })
}

/// Flattens `programs` (all ranks of one plan) into one ordered schedule,
/// checking that every message is sent and received with the same pieces.
/// Each program is walked by its cursor a round at a time
/// ([`RoundCursor`]), which also counts the bytes and messages.
pub(crate) fn same_device_schedule(programs: &[RankProgram]) -> Result<Schedule, ScheduleError> {
    let index: HashMap<Endpoint, usize> = programs.iter().enumerate().map(|(i, p)| (p.endpoint, i)).collect();
    let mut walks: Vec<Vec<Round<'_>>> = Vec::with_capacity(programs.len());
    let mut out = Schedule::default();
    for p in programs {
        let mut cursor = RoundCursor::new(p);
        let mut rounds = Vec::new();
        let bad = |u: Unexpected| ScheduleError::Mismatch { me: p.endpoint, peer: u.peer, round: u.round, problem: u.problem.to_string() };
        while let Some(r) = cursor.next_round().map_err(bad)? {
            rounds.push(r);
        }
        let stats = cursor.stats().unwrap_or_default();
        out.wire_bytes = out.wire_bytes.saturating_add(stats.recv_bytes);
        out.messages = out.messages.saturating_add(stats.messages);
        walks.push(rounds);
    }
    let end = walks.iter().filter_map(|w| w.last()).map(|r| r.round as u64 + 1).max().unwrap_or(0);
    // Where each rank's walk stands.
    let mut next = vec![0usize; programs.len()];
    for r in 0..end {
        let round = r as u32;
        // Each rank's work in this round, if it has any.
        let this: Vec<Option<&Round<'_>>> = walks
            .iter()
            .zip(next.iter_mut())
            .map(|(w, at)| {
                let here = w.get(*at).filter(|x| x.round == round);
                *at += usize::from(here.is_some());
                here
            })
            .collect();
        for (i, rd) in this.iter().enumerate() {
            for l in rd.and_then(|rd| rd.locals).into_iter().flat_map(|l| l.views()) {
                let block = l.block();
                let from = place(programs, i, &l.from(), l.from_dtype(), &block)?;
                let to = l.to().map(|s| place(programs, i, &s, l.to_dtype(), &block)).collect::<Result<Vec<_>, _>>()?;
                out.steps.push(Step { round, block, from, wire: l.to_dtype(), to, local: true });
            }
        }
        let mut received = 0usize;
        for (i, rd) in this.iter().enumerate() {
            for msg in rd.map_or(&[][..], |rd| rd.recvs) {
                let (me, peer) = (programs[i].endpoint, msg.peer);
                let &j = index.get(&peer).ok_or(UnknownPeer { me, peer, round, missing: PeerMissing::Program })?;
                let sent =
                    this[j].and_then(|sr| sr.sends.iter().find(|m| m.peer == me)).ok_or(ScheduleError::Unmatched { me, peer, round })?;
                let bad = |problem: String| ScheduleError::Mismatch { me, peer, round, problem };
                if sent.pieces.len() != msg.pieces.len() {
                    return Err(bad(format!("{} pieces sent, {} expected", sent.pieces.len(), msg.pieces.len())));
                }
                for (sp, rp) in sent.pieces.views().zip(msg.pieces.views()) {
                    let block = rp.block();
                    if sp.block() != block || sp.wire() != rp.wire() {
                        return Err(bad(format!("piece {} as {} sent where {block} as {} expected", sp.block(), sp.wire(), rp.wire())));
                    }
                    let from = place(programs, j, &sp.span(), sp.dtype(), &block)?;
                    let to = rp.spans().map(|s| place(programs, i, &s, rp.dtype(), &block)).collect::<Result<Vec<_>, _>>()?;
                    out.steps.push(Step { round, block, from, wire: rp.wire(), to, local: false });
                }
                received += 1;
            }
        }
        let sent: usize = this.iter().flatten().map(|rd| rd.sends.len()).sum();
        if sent != received {
            // Find a send nobody receives, to name it.
            for (i, rd) in this.iter().enumerate() {
                for m in rd.map_or(&[][..], |rd| &rd.sends[..]) {
                    let peer_expects =
                        index.get(&m.peer).and_then(|&k| this[k]).is_some_and(|rd| rd.recvs.iter().any(|x| x.peer == programs[i].endpoint));
                    if !peer_expects {
                        return Err(ScheduleError::Unreceived { me: programs[i].endpoint, peer: m.peer, round });
                    }
                }
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::copy::{copy_strided, StridedRef};
    use crate::cuda::copyplan::{plan_copies, Side};
    use crate::memory::RankMemory;
    use crate::pattern::{fill_sources, verify_destinations};
    use reshard::{parse_layout, plan_baseline, plan_reshard, Layout, PlanOptions, RecvPiece};

    const SRC: &str = r#"{"ranks": 4, "tensors": [
        {"name": "a", "dtype": "f32", "shape": [12, 10], "mesh": {"shape": [2, 2]}, "placements": ["shard(0)", "shard(1)"]},
        {"name": "b", "dtype": "bf16", "shape": [6, 7, 5], "mesh": {"shape": [4]}, "placements": ["shard(1)"]},
        {"name": "c", "dtype": "f64", "shape": [9], "mesh": {"shape": [4]}, "placements": ["replicate"]},
        {"name": "d", "dtype": "i32", "shape": [8, 3], "mesh": {"shape": [2, 2]}, "placements": ["replicate", "shard(0)"]}]}"#;
    const DST: &str = r#"{"ranks": 3, "tensors": [
        {"name": "a", "dtype": "bf16", "shape": [12, 10], "mesh": {"shape": [3]}, "placements": ["shard(1)"]},
        {"name": "b", "dtype": "f32", "shape": [6, 7, 5], "mesh": {"shape": [3]}, "placements": ["shard(2)"]},
        {"name": "c", "dtype": "f64", "shape": [9], "mesh": {"shape": [3]}, "placements": ["shard(0)"]},
        {"name": "d", "dtype": "i32", "shape": [8, 3], "mesh": {"shape": [3]}, "placements": ["replicate"]}]}"#;

    fn layouts() -> (Layout, Layout) {
        (parse_layout(SRC).unwrap(), parse_layout(DST).unwrap())
    }

    /// Runs a schedule on host memory the way the device executor does:
    /// direct steps through the copy plans, others converted on the host.
    fn run_host(steps: &[Step], memory: &mut [RankMemory]) {
        for s in steps {
            let counts = s.block.extent();
            if s.is_direct() {
                let elem = s.wire.size();
                for t in &s.to {
                    let src = memory[s.from.rank].buffers[s.from.span.buffer as usize].clone();
                    let ops = plan_copies(
                        counts,
                        &Side { base: s.from.span.base, strides: s.from.span.strides },
                        &Side { base: t.span.base, strides: t.span.strides },
                        elem,
                        1 << 31,
                    );
                    let dst = &mut memory[t.rank].buffers[t.span.buffer as usize];
                    for op in ops {
                        assert!(op.apply(&src, dst));
                    }
                }
            } else {
                let src = &memory[s.from.rank].buffers[s.from.span.buffer as usize];
                let n = s.block.numel();
                let mut wire = vec![0u8; (n * s.wire.size()) as usize];
                let packed = crate::copy::packed_strides(counts);
                // SAFETY: `src` and `wire` are borrowed or owned here and
                // outlive both views.
                let sr = unsafe { StridedRef::new(src.as_ptr(), src.len(), s.from.span.base, s.from.span.strides, s.from.dtype) };
                let wr = unsafe { StridedRef::new(wire.as_mut_ptr(), wire.len(), 0, packed, s.wire) };
                unsafe { copy_strided(counts, &sr, &wr) };
                for t in &s.to {
                    let dst = &mut memory[t.rank].buffers[t.span.buffer as usize];
                    // SAFETY: `dst` is borrowed mutably for this iteration.
                    let dr = unsafe { StridedRef::new(dst.as_mut_ptr(), dst.len(), t.span.base, t.span.strides, t.dtype) };
                    unsafe { copy_strided(counts, &wr, &dr) };
                }
            }
        }
    }

    fn run_and_verify(src: &Layout, dst: &Layout, plan: &reshard::Plan) -> Schedule {
        let programs = plan.programs(src, dst).unwrap();
        let schedule = same_device_schedule(&programs).unwrap();
        let mut memory = RankMemory::for_programs(&programs);
        let n_src = src.ranks() as usize;
        fill_sources(src, &mut memory[..n_src]);
        run_host(&schedule.steps, &mut memory);
        verify_destinations(src, dst, &memory[n_src..]).unwrap();
        // Same byte and message counts as the in-process executor.
        let mut again = RankMemory::for_programs(&programs);
        fill_sources(src, &mut again[..n_src]);
        let report = crate::run_local(&programs, &mut again, &crate::ExecOptions::default()).unwrap();
        assert_eq!((schedule.wire_bytes, schedule.messages), (report.bytes, report.messages));
        schedule
    }

    #[test]
    fn planned_reshard_runs_bit_exact_through_copy_plans() {
        let (src, dst) = layouts();
        let plan = plan_reshard(&src, &dst, &PlanOptions::default()).unwrap();
        let s = run_and_verify(&src, &dst, &plan);
        assert!(s.steps.iter().any(|s| !s.is_direct()) && s.steps.iter().any(Step::is_direct));
    }

    #[test]
    fn baseline_runs_bit_exact_through_copy_plans() {
        let (src, dst) = layouts();
        let plan = plan_baseline(&src, &dst, &PlanOptions::default()).unwrap();
        let s = run_and_verify(&src, &dst, &plan);
        assert!(s.steps.iter().any(|s| s.local));
    }

    /// Every example layout pair of the repository, reshard and baseline,
    /// through the schedule as the device runs it: every destination
    /// buffer of the layout byte for byte the host executor's (scratch
    /// buffers excepted: the host executor may bypass them, and what they
    /// hold is no weight).
    #[test]
    fn every_example_pair_runs_as_the_host_executor_does() {
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples");
        let mut pairs: Vec<_> =
            std::fs::read_dir(&root).unwrap().flatten().map(|d| d.path()).filter(|d| d.join("src.json").exists()).collect();
        pairs.sort();
        assert!(pairs.len() > 5, "{}", root.display());
        let load = |p: std::path::PathBuf| parse_layout(&std::fs::read_to_string(p).unwrap()).unwrap();
        for dir in pairs {
            let (src, dst) = (load(dir.join("src.json")), load(dir.join("dst.json")));
            let opts = PlanOptions::default();
            for (strategy, plan) in [("reshard", plan_reshard(&src, &dst, &opts)), ("baseline", plan_baseline(&src, &dst, &opts))] {
                let plan = plan.unwrap();
                let programs = plan.programs(&src, &dst).unwrap();
                let schedule = same_device_schedule(&programs).unwrap();
                let n_src = src.ranks() as usize;
                let mut device = RankMemory::for_programs(&programs);
                fill_sources(&src, &mut device[..n_src]);
                let mut host = device.clone();
                // Block-scaled FP8 ranks quantize, as the device run does:
                // sources before the copies, destinations after.
                for (p, m) in programs.iter().zip(device.iter_mut()).filter(|(p, _)| p.quantizes_first()) {
                    crate::exec::quantize_rank(p, m).unwrap();
                }
                run_host(&schedule.steps, &mut device);
                for (p, m) in programs.iter().zip(device.iter_mut()).filter(|(p, _)| !p.quantizes_first()) {
                    crate::exec::quantize_rank(p, m).unwrap();
                }
                crate::run_local(&programs, &mut host, &crate::ExecOptions::default()).unwrap();
                for (r, (a, b)) in device[n_src..].iter().zip(&host[n_src..]).enumerate() {
                    for (i, (x, y)) in a.buffers.iter().zip(&b.buffers).enumerate() {
                        let spec = &programs[n_src + r].buffers[i];
                        if matches!(spec.key, reshard::BufferKey::Scratch { .. }) {
                            continue;
                        }
                        assert!(
                            x == y,
                            "{} {strategy}: destination rank {r} buffer {i} ({}) differs from the host executor's",
                            dir.display(),
                            spec.name
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn inconsistent_programs_rejected() {
        let (src, dst) = layouts();
        let plan = plan_reshard(&src, &dst, &PlanOptions::default()).unwrap();
        let programs = plan.programs(&src, &dst).unwrap();
        // Drop one receive: its send is never received.
        let mut p = programs.clone();
        let (ri, r) =
            p.iter().enumerate().find_map(|(i, pr)| pr.rounds.iter().position(|rd| !rd.recvs.is_empty()).map(|r| (i, r))).unwrap();
        let gone = p[ri].rounds[r].recvs.remove(0);
        let err = same_device_schedule(&p).unwrap_err();
        assert_eq!(err, ScheduleError::Unreceived { me: gone.peer, peer: p[ri].endpoint, round: r as u32 });
        // Packed pieces are read-only: change the first received piece by
        // rebuilding the message's list.
        let with_first = |change: &dyn Fn(&mut RecvPiece)| {
            let mut p = programs.clone();
            let msg = &mut p[ri].rounds[r].recvs[0];
            let mut pieces: Vec<RecvPiece> = msg.pieces.iter().collect();
            change(&mut pieces[0]);
            msg.pieces = pieces.into_iter().collect();
            p
        };
        // Change a received piece's wire type.
        let p = with_first(&|piece| piece.wire = if piece.wire == DType::U8 { DType::I8 } else { DType::U8 });
        assert!(matches!(same_device_schedule(&p), Err(ScheduleError::Mismatch { .. })));
        // A span past its buffer's end.
        let p = with_first(&|piece| piece.spans[0].base += 1 << 40);
        assert!(matches!(same_device_schedule(&p), Err(ScheduleError::OutOfBounds(_))));
    }
}
