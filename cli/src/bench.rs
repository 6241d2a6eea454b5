//! Benchmarks measured side by side in one run: reshard, the gather-broadcast
//! baseline and a plain multi-threaded memcpy of the same bytes; and plan
//! time and peak memory on model-sized layouts. Every refit goes through
//! the orchestrator ([`crate::runner::Driver`], or worker processes for
//! [`cluster_bench`]) and is timed as its report measures it.

use crate::runner::{DataPlane, Driver, DriverConfig, RunError};
use reshard::{Layout, PlanOptions, Strategy};
use std::time::{Duration, Instant};

/// Medians of one side-by-side benchmark.
#[derive(Clone, Debug)]
pub struct ExecBench {
    /// The data plane measured.
    pub transport: BenchTransport,
    /// Bytes the reshard moves between ranks.
    pub reshard_bytes: u64,
    /// Bytes the baseline moves between ranks.
    pub baseline_bytes: u64,
    /// Median reshard time.
    pub reshard: Duration,
    /// Median baseline time.
    pub baseline: Duration,
    /// Median time of the reference copy of `reshard_bytes`: a plain
    /// multi-threaded memcpy (local) or a raw socket copy (tcp).
    pub memcpy: Duration,
    /// Threads (local) or streams (tcp) used by the reference copy.
    pub memcpy_threads: usize,
    /// Repetitions measured (after one warm-up).
    pub reps: usize,
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

/// The data plane a benchmark runs on, and its reference copy.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum BenchTransport {
    /// Every rank's member in this process, in-process channels;
    /// compared with a plain multi-threaded memcpy.
    Local,
    /// Every rank's member in this process, the node fabric over loopback
    /// TCP (no shared memory); compared with a raw socket copy of the same
    /// bytes over one stream per destination rank.
    Tcp,
    /// Worker processes, as `refit launch` starts them (see
    /// [`cluster_bench`]).
    Process,
}

/// Sends `src` over loopback TCP, one stream per destination buffer (each
/// gets a copy of its share; 4 MiB writes, a reader thread per stream),
/// once. Connection setup is not timed.
fn socket_copy_once(src: &[u8], dst: &mut [Vec<u8>]) -> std::io::Result<Duration> {
    use std::io::{Read, Write};
    let listener = std::net::TcpListener::bind("127.0.0.1:0")?;
    let addr = listener.local_addr()?;
    let mut pairs = Vec::new();
    for _ in 0..dst.len() {
        let out = std::net::TcpStream::connect(addr)?;
        let (inc, _) = listener.accept()?;
        out.set_nodelay(true)?;
        pairs.push((out, inc));
    }
    let t = Instant::now();
    let results: Vec<std::io::Result<()>> = std::thread::scope(|s| {
        let mut handles = Vec::new();
        for ((mut out, mut inc), buf) in pairs.into_iter().zip(dst.iter_mut()) {
            let n = buf.len();
            handles.push(s.spawn(move || src[..n].chunks(4 << 20).try_for_each(|c| out.write_all(c))));
            handles.push(s.spawn(move || inc.read_exact(buf)));
        }
        handles.into_iter().map(|h| h.join().unwrap_or_else(|_| Err(std::io::Error::other("copy thread panicked")))).collect()
    });
    results.into_iter().collect::<std::io::Result<()>>()?;
    Ok(t.elapsed())
}

/// Copies `total` bytes with `threads` threads (each its own slice), once.
fn memcpy_once(src: &[Vec<u8>], dst: &mut [Vec<u8>]) -> Duration {
    let t = Instant::now();
    std::thread::scope(|s| {
        for (a, b) in src.iter().zip(dst.iter_mut()) {
            s.spawn(move || b.copy_from_slice(a));
        }
    });
    t.elapsed()
}

/// What a repetition of a benchmark is doing, for a progress display:
/// `warm-up reshard`, `rep 3/9 baseline`.
fn rep_phase(i: usize, reps: usize, what: &str) -> String {
    if i == 0 {
        format!("warm-up {what}")
    } else {
        format!("rep {i}/{reps} {what}")
    }
}

/// Runs reshard, baseline and the reference copy alternately, `reps`
/// times after a warm-up, on one refit system in this process (every
/// refit a new weights version; the time is the orchestrator's transfer
/// time), verifying the warm-up's reshard and baseline bit-exact; `phase`
/// is told what starts ("rep 3/9 reshard").
pub fn exec_bench(
    src: &Layout,
    dst: &Layout,
    options: &PlanOptions,
    reps: usize,
    transport: BenchTransport,
    digest_check: bool,
    mut phase: impl FnMut(&str),
) -> Result<ExecBench, RunError> {
    let reps = reps.max(1);
    // Reference copy: as many threads as cores (memcpy), or one stream per
    // destination rank (socket copy, like the reshard's receivers).
    let (plane, threads) = match transport {
        BenchTransport::Local => (DataPlane::Local, std::thread::available_parallelism().map_or(2, |n| n.get())),
        BenchTransport::Tcp => (DataPlane::Tcp, dst.ranks().max(1) as usize),
        BenchTransport::Process => return Err(RunError::Setup("worker processes are benchmarked by cluster_bench".into())),
    };
    // Over TCP, the members keep each strategy's connections across
    // repetitions (as a training job keeps its connections between
    // steps); connecting is not timed, as for the raw socket copy.
    let config = DriverConfig { plane, options: options.clone(), digest_check, ..DriverConfig::default() };
    let mut driver = Driver::start(src, dst, config, &mut phase)?;
    let bytes = driver.figures().total_bytes as usize;
    let mut baseline_bytes = 0;
    let per = bytes.div_ceil(threads);
    let msrc: Vec<Vec<u8>> = (0..threads).map(|i| vec![(i + 1) as u8; per]).collect();
    let mut mdst: Vec<Vec<u8>> = (0..threads).map(|_| vec![0u8; per]).collect();
    let (mut tr, mut tb, mut tm) = (Vec::new(), Vec::new(), Vec::new());
    let reference = match transport {
        BenchTransport::Local => "memcpy",
        _ => "socket copy",
    };
    for i in 0..=reps {
        let mut times = [Duration::ZERO; 2];
        for (k, strategy) in [Strategy::Reshard, Strategy::Baseline].into_iter().enumerate() {
            phase(&rep_phase(i, reps, &strategy.to_string()));
            driver.set_strategy(strategy)?;
            driver.step()?;
            let report = driver.refit(None)?;
            times[k] = report.transfer_time;
            if strategy == Strategy::Baseline {
                baseline_bytes = report.bytes;
            }
            if i == 0 {
                phase(&format!("verifying the warm-up: {strategy}"));
                driver.verify(None)?;
            }
        }
        phase(&rep_phase(i, reps, reference));
        let m = match transport {
            BenchTransport::Local => memcpy_once(&msrc, &mut mdst),
            _ => socket_copy_once(&msrc[0], &mut mdst).map_err(|e| RunError::Setup(format!("the socket copy: {e}")))?,
        };
        if i == 0 {
            continue;
        }
        tr.push(times[0]);
        tb.push(times[1]);
        tm.push(m);
    }
    Ok(ExecBench {
        transport,
        reshard_bytes: bytes as u64,
        baseline_bytes,
        reshard: median(tr),
        baseline: median(tb),
        memcpy: median(tm),
        memcpy_threads: threads,
        reps,
    })
}

/// What [`digest_bench`] measured: refits with the orchestrator's digest
/// check before the commit and without it, every repetition's time.
#[derive(Clone, Debug, PartialEq)]
pub struct DigestBench {
    /// Bytes a refit moves (the plan's).
    pub bytes: u64,
    /// Transfer times with the check (members read back what they moved).
    pub checked: Vec<Duration>,
    /// Transfer times without it.
    pub unchecked: Vec<Duration>,
    /// The reports' `verify_time` of the checked refits.
    pub verify: Vec<Duration>,
    /// Destination ranks the check compared whole, of how many.
    pub verified_ranks: (u64, u64),
}

/// Refits with the digest check against refits without it, of the same
/// plan on one data plane: two refit systems in this process, one with
/// `OrchestratorConfig::digest_check` off; after a warm-up each (checked
/// against the pattern), `reps` times a step of both and a refit in each,
/// alternating which goes first.
pub fn digest_bench(
    src: &Layout,
    dst: &Layout,
    options: &PlanOptions,
    reps: usize,
    transport: BenchTransport,
    mut phase: impl FnMut(&str),
) -> Result<DigestBench, RunError> {
    let plane = match transport {
        BenchTransport::Local => DataPlane::Local,
        BenchTransport::Tcp => DataPlane::Tcp,
        BenchTransport::Process => return Err(RunError::Setup("the digest check's cost is measured in process (local or tcp)".into())),
    };
    let config = |digest_check| DriverConfig { plane, options: options.clone(), digest_check, ..DriverConfig::default() };
    let mut on = Driver::start(src, dst, config(true), &mut phase)?;
    let mut off = Driver::start(src, dst, config(false), &mut phase)?;
    phase("the warm-up refits");
    let first = on.refit(None)?;
    on.verify(None)?;
    off.refit(None)?;
    off.verify(None)?;
    let mut b = DigestBench {
        bytes: on.figures().total_bytes,
        checked: Vec::new(),
        unchecked: Vec::new(),
        verify: Vec::new(),
        verified_ranks: (first.verified_ranks, first.verified_ranks + first.unverified_ranks),
    };
    for i in 0..reps.max(1) {
        phase(&rep_phase(i + 1, reps.max(1), "with and without the digest check"));
        on.step()?;
        off.step()?;
        let mut checked = |b: &mut DigestBench| -> Result<(), RunError> {
            let r = on.refit(None)?;
            b.checked.push(r.transfer_time);
            b.verify.push(r.verify_time);
            Ok(())
        };
        if i % 2 == 0 {
            checked(&mut b)?;
            b.unchecked.push(off.refit(None)?.transfer_time);
        } else {
            b.unchecked.push(off.refit(None)?.transfer_time);
            checked(&mut b)?;
        }
    }
    Ok(b)
}

/// What [`delta_bench`] measured.
#[derive(Clone, Debug, PartialEq)]
pub struct DeltaBench {
    /// Fraction of source elements changed between refits.
    pub fraction: f64,
    /// Bytes a dense refit moves (the plan's).
    pub dense_bytes: u64,
    /// Bytes a delta refit put on the wire (median over repetitions).
    pub delta_bytes: u64,
    /// Median time of a dense refit.
    pub dense: Duration,
    /// Median time of a delta refit.
    pub delta: Duration,
    /// Repetitions.
    pub reps: usize,
}

/// Changes `fraction` of source rank `rank`'s elements in `buffers` (a
/// mantissa bit that survives narrowing to bf16), chosen by a hash of the
/// element and `step`.
fn change_source(rank: u32, buffers: &mut orchestrator::Buffers, fraction: f64, step: u64) {
    let threshold = (fraction.clamp(0.0, 1.0) * u64::MAX as f64) as u64;
    let m = buffers.memory_mut();
    for (b, (buf, dtype)) in m.buffers.iter_mut().zip(&m.dtypes).enumerate() {
        let size = dtype.size() as usize;
        let at = size.saturating_sub(2);
        for (i, e) in buf.chunks_exact_mut(size).enumerate() {
            // SplitMix64 of (step, rank, buffer, element).
            let mut z = (step << 48 ^ u64::from(rank) << 32 ^ (b as u64) << 24 ^ i as u64).wrapping_add(0x9e37_79b9_7f4a_7c15);
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            if z ^ (z >> 31) < threshold {
                e[at] ^= 0x40;
            }
        }
    }
}

/// What every destination rank of `driver` serves, byte for byte.
fn served_bytes(driver: &Driver) -> Result<Vec<Vec<Vec<u8>>>, RunError> {
    Ok(driver.served()?.iter().map(|s| s.buffers.memory().buffers.clone()).collect())
}

/// Delta refits against dense ones of the same plan, in process: two
/// refit systems, one of them refitting by delta; one base refit each,
/// then `reps` times the same change of `fraction` of the source elements
/// in both followed by a refit in each (alternating which goes first);
/// after the first, the delta system's destinations are checked equal to
/// the dense one's, byte for byte.
pub fn delta_bench(
    src: &Layout,
    dst: &Layout,
    options: &PlanOptions,
    fraction: f64,
    reps: usize,
    mut phase: impl FnMut(&str),
) -> Result<DeltaBench, RunError> {
    let reps = reps.max(1);
    let config = |delta| DriverConfig { options: options.clone(), delta, ..DriverConfig::default() };
    let mut dense = Driver::start(src, dst, config(false), &mut phase)?;
    let mut delta = Driver::start(src, dst, config(true), &mut phase)?;
    let dense_bytes = dense.figures().total_bytes;
    phase("the base refits");
    dense.refit(None)?;
    delta.refit(None)?;
    delta.verify(None)?;
    let (mut td, mut tx, mut bytes) = (Vec::new(), Vec::new(), Vec::new());
    for i in 0..reps {
        phase(&rep_phase(i + 1, reps, "delta and dense"));
        let step = i as u64 + 1;
        for d in [&mut dense, &mut delta] {
            d.step_with(|rank, b| change_source(rank, b, fraction, step))?;
        }
        let mut by_delta = || -> Result<(), RunError> {
            let r = delta.refit(None)?;
            td.push(r.transfer_time);
            bytes.push(r.bytes);
            Ok(())
        };
        if i % 2 == 0 {
            by_delta()?;
            tx.push(dense.refit(None)?.transfer_time);
        } else {
            tx.push(dense.refit(None)?.transfer_time);
            by_delta()?;
        }
        if i == 0 && served_bytes(&delta)? != served_bytes(&dense)? {
            return Err(RunError::Setup("the delta refit's destinations differ from the dense refit's".into()));
        }
    }
    bytes.sort_unstable();
    Ok(DeltaBench { fraction, dense_bytes, delta_bytes: bytes[bytes.len() / 2], dense: median(tx), delta: median(td), reps })
}

/// `dst` with every float tensor of two or more dimensions block-scaled to
/// `f8e4m3` in blocks of `block` per dimension, the way DeepSeek-V3
/// checkpoints store their linear weights: each gets an f32 scale tensor
/// `<name>_scale_inv` whose every rank holds the scales of exactly the
/// blocks its elements of the tensor touch (as serving engines shard a
/// block-quantized weight's scales with it). Other tensors stay as they
/// are.
pub fn fp8_destination(dst: &Layout, block: u64) -> Result<Layout, reshard::LayoutError> {
    use reshard::{BlockScale, DType, Placement, Region, ShardSpec, Storage, TensorLayout};
    let block = block.max(1);
    let mut tensors: Vec<TensorLayout> = Vec::with_capacity(dst.tensors().len() * 2);
    for (i, t) in dst.tensors().iter().enumerate() {
        if t.shape.len() < 2 || !t.dtype.is_convertible_float() {
            tensors.push(t.clone());
            continue;
        }
        let scale_name = format!("{}_scale_inv", t.name);
        let block_shape = vec![block; t.shape.len()];
        let scale_shape: Vec<u64> = t.shape.iter().map(|&n| n.div_ceil(block)).collect();
        let scaled = TensorLayout {
            dtype: DType::F8E4M3,
            scale: Some(BlockScale { tensor: scale_name.clone(), block: block_shape.clone() }),
            ..t.clone()
        };
        // Placed like the tensor on its mesh, where each rank's chunk of
        // the scales is exactly the blocks its chunk of the tensor touches
        // (shards that are whole blocks); else by explicit shards.
        if let Placement::Mesh(m) = &t.placement {
            let mesh = TensorLayout {
                name: scale_name.clone(),
                dtype: DType::F32,
                shape: scale_shape.clone(),
                placement: Placement::Mesh(reshard::MeshPlacement { storage: Storage::Own, ..m.clone() }),
                scale: None,
            };
            let alone = Layout::new(dst.ranks(), Some(dst.ranks_per_node()), vec![mesh.clone()])?;
            let aligned = m.ranks.iter().all(|&r| {
                let want: Vec<_> = dst.rank_holdings(i as u32, r).iter().map(|(b, _)| reshard::grid_of(b, &block_shape)).collect();
                let got: Vec<_> = alone.rank_holdings(0, r).iter().map(|(b, _)| *b).collect();
                want == got
            });
            if aligned {
                tensors.push(scaled);
                tensors.push(mesh);
                continue;
            }
            // Every rank's chunk touching every block (a tensor smaller
            // than a block, as in small-scale presets): the whole scale
            // tensor replicated on the mesh, not a shard per rank.
            let grid = reshard::Block::new(&vec![0; scale_shape.len()], &scale_shape);
            if m.ranks.iter().all(|&r| dst.rank_holdings(i as u32, r).iter().all(|(b, _)| reshard::grid_of(b, &block_shape) == grid)) {
                let dims = vec![reshard::MeshDim::Replicate; m.dims.len()];
                let placement = Placement::Mesh(reshard::MeshPlacement { storage: Storage::Own, dims, ..m.clone() });
                tensors.push(scaled);
                tensors.push(TensorLayout { placement, ..mesh });
                continue;
            }
        }
        let mut shards: Vec<ShardSpec> = Vec::new();
        let mut seen = std::collections::HashSet::new();
        for h in dst.holdings(i as u32) {
            let g = reshard::grid_of(&h.block, &block_shape);
            for l in &h.holders {
                if seen.insert((l.rank, g)) {
                    let region = Region::Block { offset: g.offset().to_vec(), extent: g.extent().to_vec() };
                    shards.push(ShardSpec { rank: l.rank, region, storage: Storage::Own });
                }
            }
        }
        tensors.push(scaled);
        tensors.push(TensorLayout {
            name: scale_name,
            dtype: DType::F32,
            shape: scale_shape,
            placement: Placement::Shards(shards),
            scale: None,
        });
    }
    Layout::new(dst.ranks(), Some(dst.ranks_per_node()), tensors)
}

/// What [`fp8_bench`] measured.
#[derive(Clone, Debug, PartialEq)]
pub struct Fp8Bench {
    /// Bytes the refit to the destination as given moves.
    pub dense_bytes: u64,
    /// Bytes the refit to its block-scaled FP8 version moves.
    pub fp8_bytes: u64,
    /// What the FP8 destinations hold: codes and scales, over all ranks.
    pub fp8_held_bytes: u64,
    /// Median time of the refit to the destination as given.
    pub dense: Duration,
    /// Median time of the FP8 refit (its quantization included).
    pub fp8: Duration,
    /// Elements the FP8 refit's check compared.
    pub verified: u64,
    /// Repetitions.
    pub reps: usize,
}

/// The reshard of `src` into `dst` against the same into `fp8` (e.g.
/// [`fp8_destination`] of `dst`), in process, alternating which goes
/// first; the FP8 destinations are checked against the pattern quantized
/// as `reshard::quantize` says after the first pair.
pub fn fp8_bench(
    src: &Layout,
    dst: &Layout,
    fp8: &Layout,
    options: &PlanOptions,
    reps: usize,
    mut phase: impl FnMut(&str),
) -> Result<Fp8Bench, RunError> {
    let reps = reps.max(1);
    let config = DriverConfig { options: options.clone(), ..DriverConfig::default() };
    let mut dense = Driver::start(src, dst, config.clone(), &mut phase)?;
    let mut quant = Driver::start(src, fp8, config, &mut phase)?;
    let fp8_held_bytes = fp8.buffers().iter().flatten().map(|b| b.elems * b.dtype.size()).sum::<u64>();
    let (mut td, mut tq, mut verified) = (Vec::new(), Vec::new(), 0);
    for i in 0..reps {
        phase(&rep_phase(i + 1, reps, "dense and FP8"));
        if i > 0 {
            dense.step()?;
            quant.step()?;
        }
        if i % 2 == 0 {
            td.push(dense.refit(None)?.transfer_time);
            tq.push(quant.refit(None)?.transfer_time);
        } else {
            tq.push(quant.refit(None)?.transfer_time);
            td.push(dense.refit(None)?.transfer_time);
        }
        if i == 0 {
            phase("verifying both");
            dense.verify(None)?;
            verified = quant.verify(None)?;
        }
    }
    Ok(Fp8Bench {
        dense_bytes: dense.figures().total_bytes,
        fp8_bytes: quant.figures().total_bytes,
        fp8_held_bytes,
        dense: median(td),
        fp8: median(tq),
        verified,
        reps,
    })
}

/// Peak resident memory of this process so far (Linux `VmHWM`), in bytes.
pub fn peak_rss_bytes() -> Option<u64> {
    crate::procs::peak_rss_of("self")
}

/// Bytes a plan puts on each kind of link: between nodes (network) and
/// inside a node (the NVLink analogue), in total and on the busiest rank.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LinkLoads {
    /// Bytes crossing between nodes.
    pub inter_node_bytes: u64,
    /// Bytes moved between ranks of one node.
    pub intra_node_bytes: u64,
    /// Most network bytes one rank sends.
    pub max_nic_out: u64,
    /// Most network bytes one rank receives.
    pub max_nic_in: u64,
    /// Most intra-node bytes one rank sends.
    pub max_intra_out: u64,
    /// Bytes per node pair (sender node, receiver node) with traffic,
    /// nodes named `sN<i>` / `dN<i>`.
    pub node_pairs: Vec<(String, String, u64)>,
    /// Every node of both groups (sources first): what crosses its link.
    pub nodes: Vec<NodeLoad>,
}

/// What crosses one node's network link under a plan.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NodeLoad {
    /// Its group.
    pub group: reshard::Group,
    /// Its index within the group.
    pub node: u32,
    /// Ranks on it.
    pub ranks: u32,
    /// Bytes its ranks send to other nodes.
    pub out_bytes: u64,
    /// Bytes its ranks receive from other nodes.
    pub in_bytes: u64,
}

impl NodeLoad {
    /// `src node 0`, `dst node 3`.
    pub fn name(&self) -> String {
        format!("{} node {}", if self.group == reshard::Group::Src { "src" } else { "dst" }, self.node)
    }
}

/// The least time a plan's traffic needs on node links (a lower bound on
/// its refit time), and the link that sets it.
#[derive(Clone, Debug, PartialEq)]
pub struct LinkBound {
    /// Seconds.
    pub seconds: f64,
    /// The busiest link: `dst node 1 in`, `src node 0 out`, or
    /// `intra-node` (the busiest rank's shared-memory egress).
    pub busiest: String,
}

/// The lower bound on `loads` when each node's network link carries its
/// ranks × `rank_bytes_per_s` in each direction (every node's bytes out,
/// and in, over its link's rate; the busiest wins), and each rank's
/// intra-node egress is capped at `intra_bytes_per_s` (if it is).
pub fn node_link_bound(loads: &LinkLoads, rank_bytes_per_s: u64, intra_bytes_per_s: Option<u64>) -> LinkBound {
    let mut best = LinkBound { seconds: 0.0, busiest: "none".into() };
    for n in &loads.nodes {
        let rate = rank_bytes_per_s.max(1) as f64 * f64::from(n.ranks.max(1));
        for (bytes, way) in [(n.out_bytes, "out"), (n.in_bytes, "in")] {
            let t = bytes as f64 / rate;
            if t > best.seconds {
                best = LinkBound { seconds: t, busiest: format!("{} {way}", n.name()) };
            }
        }
    }
    if let Some(intra) = intra_bytes_per_s {
        let t = loads.max_intra_out as f64 / intra.max(1) as f64;
        if t > best.seconds {
            best = LinkBound { seconds: t, busiest: "intra-node".into() };
        }
    }
    best
}

/// The link loads of `plan`.
pub fn link_loads(plan: &reshard::Plan) -> LinkLoads {
    use reshard::Group;
    use std::collections::BTreeMap;
    let ns = plan.src_ranks() as usize;
    let n = ns + plan.dst_ranks() as usize;
    let idx = |e: reshard::Endpoint| if e.group == Group::Src { e.rank as usize } else { ns + e.rank as usize };
    let (mut out, mut inn, mut intra) = (vec![0u64; n], vec![0u64; n], vec![0u64; n]);
    type Node = (Group, u32);
    let mut pairs: BTreeMap<(Node, Node), u64> = BTreeMap::new();
    let mut l = LinkLoads::default();
    // Every node, with its ranks; its traffic is added below.
    let mut nodes: BTreeMap<Node, NodeLoad> = BTreeMap::new();
    let ranks = (0..plan.src_ranks()).map(reshard::Endpoint::src).chain((0..plan.dst_ranks()).map(reshard::Endpoint::dst));
    for e in ranks {
        let (group, node) = plan.node_of(e);
        nodes.entry((group, node)).or_insert(NodeLoad { group, node, ranks: 0, out_bytes: 0, in_bytes: 0 }).ranks += 1;
    }
    for t in plan.transfers().iter().filter(|t| t.from != t.to) {
        let b = plan.wire_bytes(t);
        let (a, z) = (plan.node_of(t.from), plan.node_of(t.to));
        if a == z {
            l.intra_node_bytes += b;
            intra[idx(t.from)] += b;
        } else {
            l.inter_node_bytes += b;
            out[idx(t.from)] += b;
            inn[idx(t.to)] += b;
            if let Some(x) = nodes.get_mut(&a) {
                x.out_bytes += b;
            }
            if let Some(x) = nodes.get_mut(&z) {
                x.in_bytes += b;
            }
        }
        *pairs.entry((a, z)).or_default() += b;
    }
    l.max_nic_out = out.into_iter().max().unwrap_or(0);
    l.max_nic_in = inn.into_iter().max().unwrap_or(0);
    l.max_intra_out = intra.into_iter().max().unwrap_or(0);
    let name = |(g, i): (Group, u32)| format!("{}N{i}", if g == Group::Src { "s" } else { "d" });
    l.node_pairs = pairs.into_iter().map(|((a, z), b)| (name(a), name(z), b)).collect();
    // Sources first (`Group::Src` orders first), each group by node.
    l.nodes = nodes.into_values().collect();
    l
}

/// Medians of one side-by-side multi-process benchmark.
#[derive(Clone, Debug)]
pub struct ClusterBench {
    /// Worker processes.
    pub workers: usize,
    /// Repetitions measured (after one verified warm-up of each).
    pub reps: usize,
    /// Median wall time of a reshard refit (start to last report).
    pub reshard: Duration,
    /// Median wall time of a baseline refit.
    pub baseline: Duration,
    /// Every reshard time, in run order.
    pub reshard_times: Vec<Duration>,
    /// Every baseline time, in run order.
    pub baseline_times: Vec<Duration>,
    /// Bytes the reshard moves between ranks (the plan's bytes moved, as
    /// the orchestrator reports it).
    pub reshard_bytes: u64,
    /// Bytes the baseline moves.
    pub baseline_bytes: u64,
}

/// Runs reshard and baseline refits alternately on `cluster`, `reps` times
/// after one warm-up of each that is verified element by element (and
/// committed); every refit is a new weights version. `phase` is told what
/// starts ("rep 3/9 reshard").
pub fn cluster_bench(
    cluster: &mut crate::cluster::Cluster,
    reps: usize,
    mut phase: impl FnMut(&str),
) -> Result<ClusterBench, crate::cluster::ClusterError> {
    let reps = reps.max(1);
    let (mut tr, mut tb) = (Vec::new(), Vec::new());
    let (mut rb, mut bb) = (0, 0);
    let mut version = 0;
    for i in 0..=reps {
        for strategy in [Strategy::Reshard, Strategy::Baseline] {
            phase(&rep_phase(i, reps, &strategy.to_string()));
            version += 1;
            cluster.set_strategy(strategy)?;
            let o = cluster.refit(version, i == 0)?;
            if i == 0 {
                continue;
            }
            // The data plane's epoch: open, connect, move (plans are cached).
            let (t, bytes) = (o.report.transfer_time, o.report.bytes);
            match strategy {
                Strategy::Reshard => {
                    tr.push(t);
                    rb = bytes;
                }
                Strategy::Baseline => {
                    tb.push(t);
                    bb = bytes;
                }
            }
        }
    }
    Ok(ClusterBench {
        workers: cluster.workers().len(),
        reps,
        reshard: median(tr.clone()),
        baseline: median(tb.clone()),
        reshard_times: tr,
        baseline_times: tb,
        reshard_bytes: rb,
        baseline_bytes: bb,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn example(name: &str) -> (Layout, Layout) {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples").join(name);
        let read = |f: &str| reshard::parse_layout(&std::fs::read_to_string(dir.join(f)).expect("example file")).expect("example layout");
        (read("src.json"), read("dst.json"))
    }

    /// Every node is listed with its ranks; each cross-node byte leaves
    /// one node and enters another.
    #[test]
    fn node_loads_add_up() {
        for name in ["tp-to-tp", "mixed-2d", "ep-moe"] {
            let (src, dst) = example(name);
            let plan = reshard::plan_reshard(&src, &dst, &reshard::PlanOptions::default()).expect("plan");
            let l = link_loads(&plan);
            assert_eq!(l.nodes.len() as u32, src.nodes() + dst.nodes(), "{name}");
            assert_eq!(l.nodes.iter().map(|n| n.ranks).sum::<u32>(), src.ranks() + dst.ranks(), "{name}");
            assert_eq!(l.nodes.iter().map(|n| n.out_bytes).sum::<u64>(), l.inter_node_bytes, "{name}");
            assert_eq!(l.nodes.iter().map(|n| n.in_bytes).sum::<u64>(), l.inter_node_bytes, "{name}");
            assert_eq!(l.nodes[0].name(), "src node 0");
        }
    }

    /// The bound is the busiest node link in either direction, or the
    /// busiest rank's intra-node egress when that is slower.
    #[test]
    fn node_link_bound_takes_the_busiest_link() {
        let node = |group, node, ranks, out_bytes, in_bytes| NodeLoad { group, node, ranks, out_bytes, in_bytes };
        let loads = LinkLoads {
            nodes: vec![node(reshard::Group::Src, 0, 4, 400, 0), node(reshard::Group::Dst, 0, 1, 0, 300)],
            max_intra_out: 50,
            ..LinkLoads::default()
        };
        assert_eq!(node_link_bound(&loads, 10, None), LinkBound { seconds: 30.0, busiest: "dst node 0 in".into() });
        assert_eq!(node_link_bound(&loads, 10, Some(1)), LinkBound { seconds: 50.0, busiest: "intra-node".into() });
        assert_eq!(node_link_bound(&LinkLoads::default(), 10, None).seconds, 0.0);
    }
}
