//! `refit plan` on small layout files that describe huge expansions (a
//! mesh of 65,536 ranks, a tensor cut into a million pieces on each side,
//! many tensors times many ranks): every pair, each under 1 KiB, answers
//! with a plan or a refusal that names the work limit and the flag that
//! raises it, in bounded memory (the child's peak RSS, a generous bound;
//! the time and memory figures are in docs/benchmarks.md, "Planner work
//! limit").

use std::path::Path;
use std::process::Command;

const BIN: &str = env!("CARGO_BIN_EXE_refit");

fn tensor(name: &str, shape: &str, mesh: u64, placement: &str) -> String {
    format!(r#"{{"name":"{name}","dtype":"bf16","shape":{shape},"mesh":{{"shape":[{mesh}]}},"placements":["{placement}"]}}"#)
}

fn layout(ranks: u64, rpn: Option<u64>, tensors: &[String]) -> String {
    let rpn = rpn.map_or(String::new(), |r| format!(r#","ranks_per_node":{r}"#));
    format!(r#"{{"ranks":{ranks}{rpn},"tensors":[{}]}}"#, tensors.join(","))
}

/// The adversarial pairs: (name, src, dst).
fn pairs() -> Vec<(String, String, String)> {
    let mut out = Vec::new();
    for n in [1024u64, 4096, 65536] {
        let rows = format!("[{}]", n * 1024);
        // Sharded everywhere to replicated everywhere: n^2 deliveries.
        out.push((
            format!("replicated{n}"),
            layout(n, None, &[tensor("w", &rows, n, "shard(0)")]),
            layout(n, Some(8), &[tensor("w", &rows, n, "replicate")]),
        ));
        // Rows against columns: every block meets every block.
        let square = format!("[{n},{n}]");
        out.push((
            format!("rows_vs_columns{n}"),
            layout(n, None, &[tensor("w", &square, n, "shard(0)")]),
            layout(n, None, &[tensor("w", &square, n, "shard(1)")]),
        ));
        // Tiny uneven blocks: 10^6 rows over n and n - 1 ranks.
        out.push((
            format!("uneven{n}"),
            layout(n, None, &[tensor("w", "[1000000]", n, "shard(0)")]),
            layout(n, None, &[tensor("w", "[1000000]", n - 1, "shard(0)")]),
        ));
        // Many tensors times many ranks, replicated on one node.
        let many: Vec<String> = (0..4).map(|i| tensor(&format!("t{i}"), "[4]", n, "replicate")).collect();
        out.push((format!("many{n}"), layout(n, None, &many), layout(n, None, &many)));
    }
    // The most ranks a file may name, three tensors on all of them.
    let wide: Vec<String> = (0..3).map(|i| tensor(&format!("t{i}"), "[1048576]", 1 << 20, "shard(0)")).collect();
    let wide_dst: Vec<String> = (0..3).map(|i| tensor(&format!("t{i}"), "[1048576]", 1 << 20, "replicate")).collect();
    out.push(("million_ranks".into(), layout(1 << 20, None, &wide), layout(1 << 20, None, &wide_dst)));
    out
}

/// Peak RSS of the children waited for so far, in bytes.
fn children_peak_rss() -> u64 {
    // SAFETY: `getrusage` writes the struct it is given, zeroed here.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: a valid pointer to a rusage.
    let rc = unsafe { libc::getrusage(libc::RUSAGE_CHILDREN, &mut usage) };
    assert_eq!(rc, 0);
    usage.ru_maxrss as u64 * 1024
}

fn plan(dir: &Path, name: &str, src: &str, dst: &str, extra: &[&str]) -> (bool, String) {
    let (s, d) = (dir.join(format!("{name}.src.json")), dir.join(format!("{name}.dst.json")));
    std::fs::write(&s, src).unwrap();
    std::fs::write(&d, dst).unwrap();
    let out = Command::new(BIN)
        .args(["plan", "--src", s.to_str().unwrap(), "--dst", d.to_str().unwrap()])
        .args(extra)
        .output()
        .expect("refit runs");
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    (out.status.success(), text)
}

#[test]
fn small_files_describing_huge_expansions_plan_or_are_refused_naming_the_limit() {
    let dir = std::env::temp_dir().join(format!("refit-plan-bounds-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let mut refused = 0;
    for (name, src, dst) in pairs() {
        assert!(src.len() + dst.len() < 1024, "{name}: {} bytes", src.len() + dst.len());
        let (ok, text) = plan(&dir, &name, &src, &dst, &[]);
        if ok {
            assert!(text.contains("reshard") && text.contains("bytes moved"), "{name}: {text}");
        } else {
            refused += 1;
            assert!(text.starts_with("error: "), "{name}: {text}");
            assert!(text.contains("units of work") && text.contains("--max-plan-work"), "{name}: {text}");
            assert!(!text.contains("panicked"), "{name}: {text}");
        }
    }
    // The pairs are meant to be too much: most are refused.
    assert!(refused >= 8, "{refused} refused");
    // Each child stayed within a generous bound (200 MB measured at most:
    // docs/benchmarks.md); before the limit, some took gigabytes.
    let peak = children_peak_rss();
    assert!(peak < 400 << 20, "a child peaked at {peak} bytes");
    // The flag raises the limit: a pair refused by default plans with
    // more, and one that plans is refused with less, naming the number.
    let (name, src, dst) = &pairs()[0];
    let (ok, text) = plan(&dir, name, src, dst, &["--max-plan-work", "8"]);
    assert!(!ok && text.contains("more than 8 units of work"), "{text}");
    let small = layout(4, None, &[tensor("w", "[64,64]", 4, "shard(0)")]);
    let small_dst = layout(4, None, &[tensor("w", "[64,64]", 4, "shard(1)")]);
    let (ok, text) = plan(&dir, "small", &small, &small_dst, &[]);
    assert!(ok, "{text}");
    let (ok, text) = plan(&dir, "small", &small, &small_dst, &["--max-plan-work", "8"]);
    assert!(!ok && text.contains("more than 8 units of work") && text.contains("--max-plan-work"), "{text}");
    // Four tensors replicated on 1,024 ranks of one node: refused by
    // default (each rank weighs a thousand peers), planned when raised.
    let (name, src, dst) = &pairs()[3];
    assert_eq!(name, "many1024");
    let (ok, text) = plan(&dir, name, src, dst, &[]);
    assert!(!ok && text.contains("--max-plan-work"), "{text}");
    let (ok, text) = plan(&dir, name, src, dst, &["--max-plan-work", "100000000"]);
    assert!(ok, "raised: {text}");
    let _ = std::fs::remove_dir_all(&dir);
}
