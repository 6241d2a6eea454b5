//! Programs whose counts and extents multiply past `u64` or alias their
//! elements: the host executor refuses them with an error naming what is
//! wrong, never panics, never sizes memory by them, and never touches
//! memory outside the rank's buffers.

use reshard::{
    parse_layout, plan_reshard, Block, BufferKey, BufferSpec, DType, Endpoint, Fingerprint, Group, PlanOptions, RankProgram, MAX_DIMS,
};
use reshard::{QuantError, Quantize, Stored};
use std::time::Duration;
use transport::TcpConfig;
use transport::{fill_sources, quantize_rank, run_local, run_tcp, ExecError, ExecOptions, RankMemory};

/// 3 x 0xAAAA_AAAA_AAAA_AAAB elements: 2^65 + 1, so 1 if the product
/// wrapped.
const WRAPS: [u64; 2] = [3, 0xAAAA_AAAA_AAAA_AAAB];

/// One source rank sends a 64 x 48 tensor to one destination rank, in
/// `src` on the source and `dst` on the destination (the wire type is the
/// narrower).
fn programs(src: &str, dst: &str) -> (Vec<RankProgram>, Vec<RankMemory>) {
    let layout = |dtype: &str| {
        parse_layout(&format!(
            r#"{{"ranks": 1, "tensors": [{{"name": "w", "dtype": "{dtype}", "shape": [64, 48], "mesh": {{"shape": [1]}}, "placements": ["replicate"]}}]}}"#
        ))
        .unwrap()
    };
    let (s, d) = (layout(src), layout(dst));
    let plan = plan_reshard(&s, &d, &PlanOptions::default()).unwrap();
    let programs = plan.programs(&s, &d).unwrap();
    let mut memory = RankMemory::for_programs(&programs);
    fill_sources(&s, &mut memory[..1]);
    (programs, memory)
}

fn options() -> ExecOptions {
    ExecOptions { deadline: Duration::from_secs(10) }
}

/// Every piece of every message of `group`'s program changed by `send` or
/// `recv`.
fn edit(programs: &mut [RankProgram], send: impl Fn(&mut reshard::SendPiece), recv: impl Fn(&mut reshard::RecvPiece)) {
    for p in programs {
        for round in &mut p.rounds {
            for m in &mut round.sends {
                m.pieces = m
                    .pieces
                    .iter()
                    .map(|mut x| {
                        send(&mut x);
                        x
                    })
                    .collect();
            }
            for m in &mut round.recvs {
                m.pieces = m
                    .pieces
                    .iter()
                    .map(|mut x| {
                        recv(&mut x);
                        x
                    })
                    .collect();
            }
        }
    }
}

/// A refusal, not a panic (a panicking rank thread is reported as such).
fn refused(r: Result<transport::ExecReport, ExecError>, what: &str) -> ExecError {
    match r {
        Err(ExecError::Panicked { me }) => panic!("{what}: {me} panicked"),
        Err(e) => e,
        Ok(_) => panic!("{what}: ran"),
    }
}

#[test]
fn a_sent_piece_of_wrapping_extents_is_refused() {
    for (src, dst) in [("f32", "f32"), ("f32", "bf16")] {
        let (mut programs, mut memory) = programs(src, dst);
        edit(&mut programs, |s| s.block = Block::new(&[0, 0], &WRAPS), |_| {});
        let e = refused(run_local(&programs, &mut memory, &options()), "local");
        assert!(e.to_string().contains("does not fit"), "{src} -> {dst}: {e}");
    }
}

#[test]
fn a_received_piece_of_wrapping_extents_is_refused() {
    for (src, dst) in [("f32", "f32"), ("f32", "bf16")] {
        for tcp in [false, true] {
            let (mut programs, mut memory) = programs(src, dst);
            edit(&mut programs, |_| {}, |r| r.block = Block::new(&[0, 0], &WRAPS));
            let r = match tcp {
                false => run_local(&programs, &mut memory, &options()),
                true => run_tcp(&programs, &mut memory, &options(), &TcpConfig::default()),
            };
            let e = refused(r, "receiver");
            assert!(matches!(e, ExecError::BadMessage { .. }), "{src} -> {dst}, tcp {tcp}: {e}");
        }
    }
}

/// A piece whose strides are all zero lies "inside" a one-element buffer
/// whatever its extent; 2^40 of them converted to bf16 would need 2 TiB of
/// staging. Refused before anything is sized by it.
#[test]
fn a_piece_aliasing_its_elements_is_refused_before_staging_is_sized() {
    let (mut programs, mut memory) = programs("f32", "bf16");
    let alias = |b: &mut Block, span: &mut reshard::Span| {
        *b = Block::new(&[0, 0], &[1 << 20, 1 << 20]);
        span.strides = [0; MAX_DIMS];
    };
    edit(&mut programs, |s| alias(&mut s.block, &mut s.span), |_| {});
    let e = refused(run_local(&programs, &mut memory, &options()), "aliasing");
    assert!(matches!(e, ExecError::OutOfBounds(_)), "{e}");
}

/// The host executor's quantize step: a box whose extents wrap to one
/// element, in buffers with room for one, is refused for each region.
#[test]
fn quantize_rank_refuses_wrapping_extents() {
    let spec = |i: u32, dtype: DType, elems: u64| BufferSpec { key: BufferKey::Named(i), name: format!("b{i}"), dtype, elems };
    let huge = Block::new(&[0, 0], &WRAPS);
    let small = Block::new(&[0, 0], &[1, 1]);
    for (what, st, w, sc) in [("staged", huge, small, small), ("weight", small, huge, small), ("scale", small, small, huge)] {
        let stored = |block: Block, buffer: u32| Stored { block, buffer, at: 0 };
        let program = RankProgram {
            endpoint: Endpoint { group: Group::Dst, rank: 0 },
            fingerprint: Fingerprint(0),
            buffers: vec![spec(0, DType::F32, 16), spec(1, DType::F8E4M3, 1), spec(2, DType::F32, 1)],
            rounds: Vec::new(),
            carried: Vec::new(),
            quantize: vec![Quantize {
                tensor: "w".into(),
                shape: WRAPS.to_vec(),
                block: vec![1, 1],
                staged_dtype: DType::F32,
                staged: vec![stored(st, 0)],
                weights: vec![stored(w, 1)],
                scales: vec![stored(sc, 2)],
            }],
        };
        let mut memory = RankMemory::for_buffers(&program.buffers);
        let before = memory.clone();
        match quantize_rank(&program, &mut memory) {
            Err(ExecError::Quantize { error, .. }) => assert_eq!(error, QuantError::OutOfBounds { tensor: "w".into(), what }),
            other => panic!("{what}: {other:?}"),
        }
        assert!(memory == before, "{what}: memory written");
    }
}
