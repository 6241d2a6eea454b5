//! Times one refit over the data planes of this crate, side by side with a
//! raw loopback socket copy of the same bytes (one stream per destination
//! rank, 4 MiB writes, a reader thread each, as `refit bench` does):
//!
//! ```sh
//! cargo run --release -p transport --example transport_bench -- [MiB] [reps] [emulation scale]
//! ```
//!
//! The workload: `MiB` of bf16 weights (default 256) in 2048 x 2048
//! tensors; 8 source ranks (4 per node) sharding rows; 4 destination
//! ranks (2 per node) sharding columns in pairs that replicate, so each
//! destination node's leader fans out to its neighbour. Every rank is a
//! thread of this process; connection setup is not timed. Fresh fabrics
//! are connected for every run, except the `warm` rows, which reuse one
//! fabric for every run (as a trainer refitting every step would). Prints
//! the median of `reps` runs (default 5) of each, interleaved. With a third
//! argument, first times a warm node fabric under
//! `LinkEmulation::dgx_h100(scale)` against the bound the caps imply.

use reshard::{parse_layout, plan_reshard, Endpoint, Layout, PlanOptions};
use std::io::{Read, Write};
use std::time::{Duration, Instant};
use transport::{fill_sources, node_fabric, run_threads, verify_destinations, ExecOptions, NodeTransportConfig, RankMemory};
use transport::{tcp_fabric, TcpConfig};

type Res<T> = Result<T, Box<dyn std::error::Error>>;

fn layouts(mib: usize) -> Res<(Layout, Layout)> {
    let n = (mib / 8).max(1); // 8 MiB per tensor
    let tensors = |mesh: &str, placements: &str| {
        (0..n)
            .map(|i| {
                format!(
                    r#"{{"name": "t{i}", "dtype": "bf16", "shape": [2048, 2048], "mesh": {{"shape": {mesh}}}, "placements": {placements}}}"#
                )
            })
            .collect::<Vec<_>>()
            .join(",")
    };
    let src = format!(r#"{{"ranks": 8, "ranks_per_node": 4, "tensors": [{}]}}"#, tensors("[8]", r#"["shard(0)"]"#));
    let dst = format!(r#"{{"ranks": 4, "ranks_per_node": 2, "tensors": [{}]}}"#, tensors("[2, 2]", r#"["shard(1)", "replicate"]"#));
    Ok((parse_layout(&src)?, parse_layout(&dst)?))
}

/// One raw copy of `src` to every buffer of `dst` (allocated once by the
/// caller and reused, like the refit's memory).
fn socket_copy(src: &[u8], dst: &mut [Vec<u8>]) -> std::io::Result<Duration> {
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
            handles.push(s.spawn(move || src.chunks(4 << 20).try_for_each(|c| out.write_all(c))));
            handles.push(s.spawn(move || inc.read_exact(buf)));
        }
        handles.into_iter().map(|h| h.join().unwrap_or_else(|_| Err(std::io::Error::other("copy thread panicked")))).collect()
    });
    results.into_iter().collect::<std::io::Result<()>>()?;
    Ok(t.elapsed())
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

fn main() -> Res<()> {
    let args: Vec<usize> = std::env::args()
        .skip(1)
        .enumerate()
        .map(|(i, a)| a.parse().map_err(|e| format!("argument {} ({a:?}): expected a whole number: {e}", i + 1)))
        .collect::<Result<_, _>>()?;
    let (mib, reps) = (args.first().copied().unwrap_or(256).max(1), args.get(1).copied().unwrap_or(5).max(1));
    let (src, dst) = layouts(mib)?;
    let plan = plan_reshard(&src, &dst, &PlanOptions::default())?;
    let programs = plan.programs(&src, &dst)?;
    let endpoints: Vec<Endpoint> = programs.iter().map(|p| p.endpoint).collect();
    let mut memory = RankMemory::for_programs(&programs);
    fill_sources(&src, &mut memory[..8]);
    let bytes = plan.figures().total_bytes as usize;
    let opts = ExecOptions::default();
    let per = bytes.div_ceil(dst.ranks() as usize);
    let copy_src = vec![7u8; per];
    let mut copy_dst: Vec<Vec<u8>> = (0..dst.ranks()).map(|_| vec![0u8; per]).collect();
    let tcp_sum = TcpConfig { checksum: true, ..TcpConfig::default() };
    let node = NodeTransportConfig::default();
    let node_sum = NodeTransportConfig { tcp: tcp_sum.clone(), ..NodeTransportConfig::default() };
    let names = [
        "socket copy",
        "tcp",
        "tcp + crc32c",
        "node (shm+tcp)",
        "node + crc32c",
        "tcp, warm",
        "node, warm",
        "tcp, warm, no pool",
        "tcp + crc32c, warm",
        "node + crc32c, warm",
    ];
    // Fabrics kept from one refit to the next (as a trainer would).
    let mut warm_tcp = tcp_fabric(&endpoints, &TcpConfig::default())?;
    let mut warm_node = node_fabric(&endpoints, |e| plan.node_of(e), &node)?;
    let mut warm_tcp_sum = tcp_fabric(&endpoints, &tcp_sum)?;
    let mut warm_node_sum = node_fabric(&endpoints, |e| plan.node_of(e), &node_sum)?;
    // Without reusable frame buffers: what the TCP receiver did before.
    let mut warm_nopool = tcp_fabric(&endpoints, &TcpConfig { frame_pool_bytes: 0, ..TcpConfig::default() })?;
    let mut times: Vec<Vec<Duration>> = vec![Vec::new(); names.len()];
    for rep in 0..=reps {
        let mut t = vec![socket_copy(&copy_src, &mut copy_dst)?];
        for config in [&TcpConfig::default(), &tcp_sum] {
            let fabric = tcp_fabric(&endpoints, config)?;
            t.push(run_threads(&programs, &mut memory, &opts, fabric)?.elapsed);
        }
        for config in [&node, &node_sum] {
            let fabric = node_fabric(&endpoints, |e| plan.node_of(e), config)?;
            t.push(run_threads(&programs, &mut memory, &opts, fabric)?.elapsed);
        }
        t.push(run_threads(&programs, &mut memory, &opts, warm_tcp.iter_mut().collect())?.elapsed);
        t.push(run_threads(&programs, &mut memory, &opts, warm_node.iter_mut().collect())?.elapsed);
        t.push(run_threads(&programs, &mut memory, &opts, warm_nopool.iter_mut().collect())?.elapsed);
        t.push(run_threads(&programs, &mut memory, &opts, warm_tcp_sum.iter_mut().collect())?.elapsed);
        t.push(run_threads(&programs, &mut memory, &opts, warm_node_sum.iter_mut().collect())?.elapsed);
        verify_destinations(&src, &dst, &memory[8..])?;
        if rep > 0 {
            // The first round warms up.
            for (all, d) in times.iter_mut().zip(t) {
                all.push(d);
            }
        }
    }
    if let Some(&scale) = args.get(2) {
        // Link emulation: DGX H100 links slowed `scale` times. The bound:
        // the busiest rank's egress over each of its two buckets.
        let emu = transport::LinkEmulation::dgx_h100(scale as f64);
        let config = NodeTransportConfig { tcp: TcpConfig { emulation: emu, ..TcpConfig::default() }, ..NodeTransportConfig::default() };
        let mut fabric = node_fabric(&endpoints, |e| plan.node_of(e), &config)?;
        let bound = programs
            .iter()
            .map(|p| {
                let (mut inter, mut intra) = (0u64, 0u64);
                for m in p.rounds.iter().flat_map(|r| &r.sends) {
                    if plan.node_of(m.peer) == plan.node_of(p.endpoint) {
                        intra += m.wire_bytes();
                    } else {
                        inter += m.wire_bytes();
                    }
                }
                inter as f64 / emu.inter_node_bytes_per_s.unwrap_or(u64::MAX) as f64
                    + intra as f64 / emu.intra_node_bytes_per_s.unwrap_or(u64::MAX) as f64
            })
            .fold(0.0, f64::max);
        let runs: Vec<Duration> = (0..reps)
            .map(|_| run_threads(&programs, &mut memory, &opts, fabric.iter_mut().collect()).map(|r| r.elapsed))
            .collect::<Result<_, _>>()?;
        println!(
            "emulated DGX H100 / {scale}: median {:.1} ms; busiest rank's egress at the capped rates: {:.1} ms",
            median(runs).as_secs_f64() * 1e3,
            bound * 1e3
        );
    }
    println!("{} MiB moved per refit, {} runs each (median):", bytes >> 20, reps);
    let socket = median(times[0].clone());
    for (name, t) in names.iter().zip(times) {
        let m = median(t);
        println!(
            "  {name:20} {:8.1} ms  {:6.2} GiB/s  socket copy / this = {:.2}",
            m.as_secs_f64() * 1e3,
            bytes as f64 / m.as_secs_f64() / (1u64 << 30) as f64,
            socket.as_secs_f64() / m.as_secs_f64()
        );
    }
    Ok(())
}
