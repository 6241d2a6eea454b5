//! The layering rules of docs/ARCHITECTURE.md, checked on the sources:
//! which crate may depend on which, which parts of the command line
//! (`cli/`, the `refit-cli` crate) reach data movement only through the
//! orchestrator, and each crate's face: the names it makes public, each
//! with a user that is not a test.

use std::path::Path;

const ROOT: &str = env!("CARGO_MANIFEST_DIR");

/// The workspace crates a crate's manifest depends on (any dependency
/// section of the package: normal, dev, build, per target; the workspace
/// root's `[workspace.dependencies]` only declares them).
fn our_dependencies(krate: &str) -> Vec<&'static str> {
    let manifest = Path::new(ROOT).join(krate).join("Cargo.toml");
    let text = std::fs::read_to_string(&manifest).unwrap_or_else(|e| panic!("{}: {e}", manifest.display()));
    let mut in_dependencies = false;
    let lines: Vec<&str> = text
        .lines()
        .filter(|l| {
            let l = l.trim();
            if l.starts_with('[') {
                in_dependencies = l.ends_with("dependencies]") && !l.starts_with("[workspace");
                return false;
            }
            in_dependencies
        })
        .collect();
    ["reshard", "transport", "actors", "orchestrator", "refit", "refit-cli"]
        .into_iter()
        // (A crate's tests may depend on the crate itself, with features.)
        .filter(|dep| *dep != krate)
        .filter(|dep| {
            lines.iter().any(|l| {
                let l = l.trim_start();
                l.starts_with(&format!("{dep} ")) || l.starts_with(&format!("{dep}.")) || l.starts_with(&format!("{dep}="))
            })
        })
        .collect()
}

/// Source files under `dir` (recursively).
fn sources(dir: &Path) -> Vec<std::path::PathBuf> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display())) {
        let path = entry.expect("directory entry").path();
        if path.is_dir() {
            out.extend(sources(&path));
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
    out
}

/// Files (relative to the workspace root) that name `krate::` in code.
fn users_of(files: &[&str], krate: &str) -> Vec<String> {
    let mut out = Vec::new();
    for f in files {
        let path = Path::new(ROOT).join(f);
        let paths = if path.is_dir() { sources(&path) } else { vec![path] };
        for p in paths {
            let text = std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
            let code = text.lines().filter(|l| !l.trim_start().starts_with("//"));
            if code.into_iter().any(|l| l.contains(&format!("{krate}::")) || l.contains(&format!("use {krate}"))) {
                out.push(p.strip_prefix(ROOT).unwrap_or(&p).display().to_string());
            }
        }
    }
    out
}

#[test]
fn crates_depend_only_downwards() {
    // The planner is pure: none of our crates.
    assert_eq!(our_dependencies("reshard"), Vec::<&str>::new());
    // The actor runtime knows nothing of refits.
    assert_eq!(our_dependencies("actors"), Vec::<&str>::new());
    // The data plane knows the planner's programs, nothing above.
    assert_eq!(our_dependencies("transport"), vec!["reshard"]);
    // The orchestrator is the one place where actors meet the data plane.
    assert_eq!(our_dependencies("orchestrator"), vec!["reshard", "transport", "actors"]);
    // The library: the crates `use refit::prelude::*` brings, nothing
    // else (its examples too).
    assert_eq!(our_dependencies("."), vec!["reshard", "actors", "orchestrator"]);
    // The command line: through the orchestrator; its tests and the GPU
    // check drive the data plane too (a dev-dependency, checked below).
    assert_eq!(our_dependencies("cli"), vec!["reshard", "transport", "actors", "orchestrator"]);
}

#[test]
fn the_rl_demo_chaos_and_soak_move_weights_only_through_the_orchestrator() {
    let users = users_of(
        &[
            "cli/src/demo.rs",
            "cli/src/demo",
            "cli/src/chaos.rs",
            "cli/src/soak.rs",
            "cli/src/procs.rs",
            "examples/multiprocess_pipeline.rs",
            "examples/compose_pipeline.rs",
        ],
        "transport",
    );
    assert!(users.is_empty(), "these import the transport crate: {users:?}");
}

#[test]
fn the_python_package_reaches_the_data_plane_only_through_the_orchestrator() {
    let manifest = Path::new(ROOT).join("python").join("Cargo.toml");
    let text = std::fs::read_to_string(&manifest).unwrap_or_else(|e| panic!("{}: {e}", manifest.display()));
    let depends =
        |dep: &str| text.lines().any(|l| l.trim_start().starts_with(&format!("{dep} ")) || l.trim_start().starts_with(&format!("{dep}=")));
    assert!(depends("orchestrator") && depends("reshard"), "python/Cargo.toml no longer names its dependencies as expected");
    assert!(!depends("transport"), "python/Cargo.toml depends on the transport crate");
    assert_eq!(users_of(&["python/src"], "transport"), Vec::<String>::new());
}

/// The `[dependencies]` section of a manifest: its lines up to the next
/// section.
fn dependencies_section(manifest: &str) -> Vec<String> {
    let path = Path::new(ROOT).join(manifest);
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let mut lines = text.lines().skip_while(|l| l.trim() != "[dependencies]").skip(1);
    let section: Vec<String> = lines.by_ref().take_while(|l| !l.trim_start().starts_with('[')).map(str::to_string).collect();
    assert!(!section.is_empty(), "{manifest} has no [dependencies] section");
    section
}

/// The command line (the `refit-cli` crate) drives refits only through
/// the orchestrator: `refit run` and `refit bench` too
/// (`runner::Driver`), the cluster tooling's pattern comes from
/// `orchestrator::testkit`. Only its tests and the GPU checks (examples)
/// drive the data plane itself: `transport` is a dev-dependency.
#[test]
fn the_command_line_reaches_the_data_plane_only_through_the_orchestrator() {
    let users = users_of(&["cli/src"], "transport");
    assert!(users.is_empty(), "these command-line files import the transport crate; go through the orchestrator: {users:?}");
    let deps = dependencies_section("cli/Cargo.toml");
    let names_transport = deps.iter().any(|l| l.trim_start().starts_with("transport"));
    assert!(!names_transport, "the refit-cli crate depends on transport (a dev-dependency at most): {deps:?}");
    assert!(deps.iter().any(|l| l.trim_start().starts_with("orchestrator")), "the refit-cli crate's dependencies were not read: {deps:?}");
}

/// The library users depend on (the `refit` crate) is a short, curated
/// face: the crates behind `use refit::prelude::*` and the prelude, no
/// module of its own, no other source file; the command line and its
/// tools are the `refit-cli` crate's.
#[test]
fn the_library_is_the_prelude_and_the_crates_behind_it() {
    assert_eq!(root_exports("."), ["actors", "orchestrator", "prelude", "reshard"]);
    let files: Vec<String> =
        sources(&Path::new(ROOT).join("src")).iter().map(|p| p.strip_prefix(ROOT).unwrap_or(p).display().to_string()).collect();
    assert_eq!(files, ["src/lib.rs"], "the library grew source files (tools belong in cli/)");
    let lib = std::fs::read_to_string(Path::new(ROOT).join("src/lib.rs")).expect("src/lib.rs");
    let items: Vec<&str> = lib.lines().filter(|l| l.starts_with("pub ") && !l.starts_with("pub use ")).collect();
    assert!(items.is_empty(), "the library defines public items of its own: {items:?}");
}

/// The orchestrator's public items that name a `transport` type: only
/// re-exports, of the fabric interface's plain settings (the member
/// protocol carries them, and a run's digest; a store says where registered memory lives, and
/// takes the contract its owner implements; a
/// tweak changes a node endpoint's shared-memory directory and faults),
/// of the executor's default deadline, and of the GPU planes' record of
/// work done on the host. No other public item may, and
/// every listed line still exists.
#[test]
fn the_orchestrator_api_names_transport_types_only_where_known() {
    let known = [
        "pub use transport::DEFAULT_DEADLINE;",
        "pub use transport::fabric::{CommPlane, DataAddr, EgressCaps, Fabric, IpcFabric, NcclFabric, NodeFabric, PeerAddr};",
        // Registered memory: where it lives, and the one contract its
        // owner implements (an embedding's objects: the Python binding's).
        "pub use transport::fabric::{RegisteredMemory, RegisteredMemoryError, RegisteredVisitError, Residence};",
        "pub use transport::fabric::NodeFaults;",
        // A run's digest, which the member protocol carries.
        "pub use transport::fabric::{DigestError, RankDigest};",
        "pub use transport::Faults;",
        // What the GPU planes did on the host, for the GPU checks (the
        // Python ones too: `_refit.host_work`).
        "pub use transport::cuda::{host_work, HostWork};",
        // The verification pattern, behind the orchestrator's `testkit`.
        "pub use transport::{fill_source_rank_at, verify_destination_rank_from, Mismatch};",
    ];
    let mut found = Vec::new();
    let mut seen = Vec::new();
    for p in sources(&Path::new(ROOT).join("orchestrator").join("src")) {
        let text = std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
        for line in text.lines().map(str::trim) {
            let public = line.starts_with("pub ") && !line.starts_with("pub(crate)");
            if public && line.contains("transport::") {
                match known.contains(&line) {
                    true => seen.push(line.to_string()),
                    false => found.push(format!("{}: {line}", p.strip_prefix(ROOT).unwrap_or(&p).display())),
                }
            }
        }
    }
    assert!(found.is_empty(), "public orchestrator items that name transport types: {found:?}");
    let stale: Vec<&&str> = known.iter().filter(|k| !seen.iter().any(|s| s == *k)).collect();
    assert!(stale.is_empty(), "listed lines the orchestrator no longer has (take them off): {stale:?}");
}

/// The names a crate's `lib.rs` makes public with `pub use` (the part after
/// `as` where renamed).
fn root_exports(krate: &str) -> Vec<String> {
    exports_of(&format!("{krate}/src/lib.rs"))
}

/// The names a module file's `pub use` list exports in the default build
/// (test machinery behind the `testkit` feature is not part of the face).
fn exports_of(file: &str) -> Vec<String> {
    let path = Path::new(ROOT).join(file);
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let mut names = Vec::new();
    let mut rest = text.as_str();
    while let Some(at) = rest.find("\npub use ") {
        let testkit_only = rest[..at].lines().last().is_some_and(|l| l.starts_with("#[cfg") && l.contains("feature = \"testkit\""));
        rest = &rest[at + "\npub use ".len()..];
        let end = rest.find(';').expect("a `pub use` ends with `;`");
        if testkit_only {
            continue;
        }
        let item = &rest[..end];
        let list = match (item.find('{'), item.rfind('}')) {
            (Some(a), Some(b)) => item[a + 1..b].to_string(),
            _ => item.rsplit("::").next().unwrap_or(item).to_string(),
        };
        for name in list.split(',').map(str::trim).filter(|n| !n.is_empty()) {
            names.push(name.rsplit(" as ").next().unwrap_or(name).trim().to_string());
        }
    }
    names
}

/// The names code outside `krate/src` takes from `krate` (`krate::Name`,
/// `use krate::{A, B}`), and the names the docs write as `krate::Name`;
/// test code is not read ([`non_test_sources`]).
fn names_used_from(krate: &str) -> std::collections::BTreeSet<String> {
    names_used_through(krate, krate)
}

/// Whether a source file is test code: under a `tests` folder (a crate's
/// integration tests, a module's tests in files of their own) or a
/// `tests.rs` file.
fn is_test_file(path: &Path) -> bool {
    let relative = path.strip_prefix(ROOT).unwrap_or(path);
    relative.components().any(|c| c.as_os_str() == "tests") || relative.file_name().is_some_and(|n| n == "tests.rs")
}

/// `text` without its `#[cfg(test)]` items (test modules, helpers only
/// tests build): each up to its first `;`, or to the brace that closes its
/// first `{`.
fn without_tests(text: &str) -> String {
    let mut out = String::new();
    let mut rest = text;
    while let Some(at) = rest.find("#[cfg(test)]") {
        out.push_str(&rest[..at]);
        let item = &rest[at..];
        let end = match (item.find('{'), item.find(';')) {
            (Some(open), semi) if semi.is_none_or(|s| s > open) => {
                let mut depth = 0usize;
                let mut end = item.len();
                for (i, c) in item[open..].char_indices() {
                    match c {
                        '{' => depth += 1,
                        '}' => {
                            depth -= 1;
                            if depth == 0 {
                                end = open + i + 1;
                                break;
                            }
                        }
                        _ => {}
                    }
                }
                end
            }
            (_, Some(semi)) => semi + 1,
            _ => item.len(),
        };
        rest = &item[end..];
    }
    out.push_str(rest);
    out
}

/// The texts of the workspace's code that is not `own`'s and is not test
/// code: every crate's sources, examples (a crate's own examples are not
/// its users) and the fuzz targets, without test files and `#[cfg(test)]`
/// items. A name only tests use is no reason to be public.
fn non_test_sources(own: &str) -> Vec<String> {
    let own_dirs = ["src", "examples", "benches"].map(|d| Path::new(ROOT).join(own).join(d));
    let mut texts = Vec::new();
    for dir in ["src", "cli", "reshard", "transport", "orchestrator", "actors", "examples", "python/src", "fuzz/fuzz_targets"] {
        let path = Path::new(ROOT).join(dir);
        if path.is_dir() {
            for p in sources(&path) {
                if !own_dirs.iter().any(|d| p.starts_with(d)) && !is_test_file(&p) {
                    texts.push(without_tests(&std::fs::read_to_string(&p).unwrap_or_default()));
                }
            }
        }
    }
    texts
}

/// The names non-test code outside `own` takes through the path `prefix`
/// (`prefix::Name`, `use prefix::{A, B}`), and the names the docs write
/// so.
fn names_used_through(prefix: &str, own: &str) -> std::collections::BTreeSet<String> {
    let mut texts = non_test_sources(own);
    let docs = Path::new(ROOT).join("docs");
    for entry in std::fs::read_dir(&docs).expect("docs/").flatten() {
        if entry.path().extension().is_some_and(|e| e == "md") {
            texts.push(std::fs::read_to_string(entry.path()).unwrap_or_default());
        }
    }
    texts.push(std::fs::read_to_string(Path::new(ROOT).join("README.md")).unwrap_or_default());
    // Every path written from the crate's root on (use trees expanded:
    // `k::{a::{B, C}, D}` is `k::a::B`, `k::a::C`, `k::D`); a name is
    // used through `prefix` if a path continues `prefix::name`.
    let (root, within) = prefix.split_once("::").map_or((prefix, ""), |(r, w)| (r, w));
    let mut used = std::collections::BTreeSet::new();
    let start = format!("{root}::");
    for text in &texts {
        let mut rest = text.as_str();
        while let Some(at) = rest.find(&start) {
            let before = text.len() - rest.len() + at;
            rest = &rest[at + start.len()..];
            if text[..before].chars().next_back().is_some_and(|c| c.is_alphanumeric() || c == '_') {
                continue;
            }
            for path in use_tree_paths(rest) {
                let segments: Vec<&str> = path.split("::").collect();
                let want: Vec<&str> = if within.is_empty() { Vec::new() } else { within.split("::").collect() };
                if segments.len() > want.len() && segments[..want.len()] == want[..] {
                    used.insert(segments[want.len()].to_string());
                }
            }
        }
    }
    used
}

/// The paths a use tree (or a plain path) at the start of `text` names,
/// each as `a::b::C`; aliases (`as x`) dropped.
fn use_tree_paths(text: &str) -> Vec<String> {
    fn tree(s: &[u8], at: &mut usize) -> Vec<String> {
        let skip = |at: &mut usize| {
            while *at < s.len() && (s[*at] as char).is_whitespace() {
                *at += 1;
            }
        };
        skip(at);
        if s.get(*at) == Some(&b'{') {
            *at += 1;
            let mut out = Vec::new();
            loop {
                skip(at);
                match s.get(*at) {
                    None => return out,
                    Some(b'}') => {
                        *at += 1;
                        return out;
                    }
                    Some(b',') => *at += 1,
                    Some(_) => {
                        let before = *at;
                        out.extend(tree(s, at));
                        // Past anything else up to the next item (an alias).
                        while *at < s.len() && !matches!(s[*at], b',' | b'}') {
                            *at += 1;
                        }
                        if *at == before {
                            *at += 1;
                        }
                    }
                }
            }
        }
        let from = *at;
        while *at < s.len() && ((s[*at] as char).is_alphanumeric() || s[*at] == b'_') {
            *at += 1;
        }
        let name = String::from_utf8_lossy(&s[from..*at]).to_string();
        if name.is_empty() {
            return Vec::new();
        }
        if s[*at..].starts_with(b"::") {
            *at += 2;
            return tree(s, at).into_iter().map(|p| format!("{name}::{p}")).collect();
        }
        vec![name]
    }
    tree(text.as_bytes(), &mut 0)
}

/// The names of a list of names public for tests only that are stale: no
/// longer exported, or now used by non-test code (strike them).
fn stale_test_only<'a>(list: &[(&'a str, &str)], exported: &[String], used: &std::collections::BTreeSet<String>) -> Vec<&'a str> {
    list.iter().map(|(n, _)| *n).filter(|n| !exported.iter().any(|e| e == n) || used.contains(*n)).collect()
}

/// Public names of the planner that only tests use (today's, to be made
/// `pub(crate)` or given a user; no name may join them), each with the
/// tests that use it.
const RESHARD_USED_ONLY_BY_TESTS: &[(&str, &str)] = &[("e4m3_from_f32", "orchestrator/tests/fp8.rs, transport/tests/fp8.rs")];

/// Public because a public signature or field of an item the other crates
/// use names them (a type the caller never writes, but must be able to
/// see); each with the item that exposes it.
const RESHARD_PUBLIC_FOR_SIGNATURES: &[(&str, &str)] = &[
    ("BaselineSummary", "baseline_summary"),
    ("Holding", "Layout::holdings"),
    ("Loc", "Holding::holders"),
    ("Piece", "Plan::pieces"),
    ("Transfer", "Plan::transfers"),
    ("Iter", "Pieces::iter"),
    ("Round", "RankProgram::rounds"),
    ("Spans", "RecvPieceView::spans"),
];

/// Every public item of the planner is used by another crate's non-test
/// code, another crate's example or the docs, or is named by the signature of one that is
/// (issue 34: a deliberate face, not every module public).
#[test]
fn every_public_item_of_the_planner_is_used_outside_it() {
    let used = names_used_from("reshard");
    let exported = root_exports("reshard");
    assert!(exported.len() > 40, "reshard/src/lib.rs's `pub use` list was not read: {exported:?}");
    let listed = |n: &String| RESHARD_PUBLIC_FOR_SIGNATURES.iter().chain(RESHARD_USED_ONLY_BY_TESTS).any(|(name, _)| name == n);
    let unused: Vec<&String> = exported.iter().filter(|n| !used.contains(*n) && !listed(n)).collect();
    assert!(unused.is_empty(), "reshard exports items no non-test code outside it uses (make them pub(crate)): {unused:?}");
    let stale = stale_test_only(RESHARD_USED_ONLY_BY_TESTS, &exported, &used);
    assert!(stale.is_empty(), "RESHARD_USED_ONLY_BY_TESTS: no longer exported or now used (strike them): {stale:?}");
    let stale: Vec<&str> = RESHARD_PUBLIC_FOR_SIGNATURES.iter().map(|(n, _)| *n).filter(|n| !exported.iter().any(|e| e == n)).collect();
    assert!(stale.is_empty(), "RESHARD_PUBLIC_FOR_SIGNATURES names items reshard no longer exports: {stale:?}");
    // Every module is private: the face is the list above.
    let lib = std::fs::read_to_string(Path::new(ROOT).join("reshard/src/lib.rs")).expect("reshard/src/lib.rs");
    let public_modules: Vec<&str> = lib.lines().filter(|l| l.starts_with("pub mod ")).collect();
    assert!(public_modules.is_empty(), "public modules in reshard: {public_modules:?}");
}

/// Items of the data plane's face that nothing outside names, public
/// because a public item's signature names them (name, where).
const TRANSPORT_PUBLIC_FOR_SIGNATURES: &[(&str, &str)] = &[
    ("Congestion", "TcpConfig::congestion"),
    ("FrameHook", "TcpConfig::hook"),
    ("FrameAction", "FrameHook::data_frame"),
    ("Lent", "Payload::Lent"),
    ("SentPieces", "Payload::Pieces"),
    ("SentPiece", "SentPieces::pieces"),
    ("Waiting", "TransportError::Timeout"),
    ("DeviceExecError", "cuda::DeviceRun::prepare"),
    ("ScheduleError", "cuda::DeviceExecError::Schedule"),
    ("RankStats", "fabric::RankEnd::run"),
    ("WithAbort", "run_threads"),
    ("PieceOutOfBounds", "ExecError::OutOfBounds"),
    ("UnknownPeer", "cuda::CommExecError::UnknownPeer"),
    ("PeerMissing", "cuda::UnknownPeer::missing"),
];

/// Public names of the data plane that only tests (and its own benchmark
/// example) use: today's, to be made `pub(crate)` (or moved behind a
/// test feature) or given a user; no name may join them. Each with its
/// full path and the tests that use it.
const TRANSPORT_USED_ONLY_BY_TESTS: &[(&str, &str)] = &[
    ("transport::packed_strides", "transport/tests"),
    ("transport::StridedRef", "transport/tests"),
    ("transport::quantize_rank", "transport/tests"),
    ("transport::ExecError", "transport/tests"),
    ("transport::ExecReport", "transport/tests"),
    ("transport::local_fabric", "transport/tests"),
    ("transport::LocalTransport", "transport/tests"),
    ("transport::NodeTransportConfig", "transport/tests"),
    ("transport::ShmConfig", "transport/tests"),
    ("transport::TcpConfig", "transport/tests"),
    ("transport::TcpTransport", "transport/tests"),
    ("transport::Payload", "transport/tests"),
    ("transport::Release", "transport/tests"),
    ("transport::Segment", "transport/tests"),
    ("transport::Transport", "transport/tests"),
    ("transport::TransportError", "transport/tests"),
    ("transport::cuda::CommHandle", "transport/tests"),
    ("transport::cuda::PendingComm", "transport/tests"),
    ("transport::cuda::IpcComm", "transport/tests"),
    ("transport::cuda::run_rank_comm", "transport/tests"),
    ("transport::cuda::send_staging_bytes", "transport/tests"),
    ("transport::cuda::CommExecError", "transport/tests"),
    ("transport::cuda::CommPeers", "transport/tests"),
    ("transport::cuda::QuantPlan", "transport/tests"),
    ("transport::cuda::abandoned_staging_bytes", "transport/tests"),
    ("transport::cuda::arm", "transport/tests, orchestrator/tests"),
    ("transport::cuda::live_comms", "transport/tests, orchestrator/tests"),
    ("transport::cuda::sim_comm", "transport/tests"),
    ("transport::cuda::sim_comm_id", "transport/tests, orchestrator/tests"),
    ("transport::cuda::SimBucket", "transport/tests"),
    ("transport::cuda::SimFault", "transport/tests, orchestrator/tests"),
    ("transport::cuda::SimIpc", "transport/tests"),
    ("transport::cuda::SimMemory", "transport/tests"),
    ("transport::fabric::StagingKept", "transport/tests"),
];

/// Every name the data plane exports (its root `pub use` list and the
/// GPU plane's, `transport::cuda`) is used by another crate's non-test
/// code, another crate's example or the docs, or named by the signature of
/// one that is (or listed in [`TRANSPORT_USED_ONLY_BY_TESTS`]); every
/// module is private but `cuda` and `delta` (issue 34).
#[test]
fn every_public_item_of_the_data_plane_is_used_outside_it() {
    let mut unused = Vec::new();
    let mut stale_test_only = Vec::new();
    let mut exported_all = Vec::new();
    let faces = [
        ("transport", "transport/src/lib.rs"),
        ("transport::cuda", "transport/src/cuda/mod.rs"),
        ("transport::fabric", "transport/src/fabric/mod.rs"),
    ];
    for (face, file) in faces {
        let used = names_used_through(face, "transport");
        let exported = exports_of(file);
        assert!(exported.len() > 5, "{file}'s `pub use` list was not read: {exported:?}");
        let for_signatures = |n: &String| TRANSPORT_PUBLIC_FOR_SIGNATURES.iter().any(|(name, _)| name == n);
        let test_only = |n: &String| TRANSPORT_USED_ONLY_BY_TESTS.iter().any(|(path, _)| *path == format!("{face}::{n}"));
        unused
            .extend(exported.iter().filter(|n| !used.contains(*n) && !for_signatures(n) && !test_only(n)).map(|n| format!("{face}::{n}")));
        for (path, _) in TRANSPORT_USED_ONLY_BY_TESTS {
            let Some(name) = path.strip_prefix(&format!("{face}::")).filter(|n| !n.contains("::")) else { continue };
            if !exported.iter().any(|e| e == name) || used.contains(name) {
                stale_test_only.push(*path);
            }
        }
        exported_all.extend(exported);
    }
    assert!(unused.is_empty(), "transport exports items no non-test code outside it uses (make them pub(crate)): {unused:?}");
    assert!(stale_test_only.is_empty(), "TRANSPORT_USED_ONLY_BY_TESTS: no longer exported or now used (strike them): {stale_test_only:?}");
    let stale: Vec<&str> =
        TRANSPORT_PUBLIC_FOR_SIGNATURES.iter().map(|(n, _)| *n).filter(|n| !exported_all.iter().any(|e| e == n)).collect();
    assert!(stale.is_empty(), "TRANSPORT_PUBLIC_FOR_SIGNATURES names items transport no longer exports: {stale:?}");
    let modules = [
        ("transport/src/lib.rs", &["pub mod cuda;", "pub mod delta;", "pub mod fabric;"][..]),
        ("transport/src/cuda/mod.rs", &[][..]),
        ("transport/src/fabric/mod.rs", &[][..]),
    ];
    for (file, allowed) in modules {
        let text = std::fs::read_to_string(Path::new(ROOT).join(file)).expect(file);
        let public: Vec<&str> = text.lines().filter(|l| l.starts_with("pub mod ") && !allowed.contains(l)).collect();
        assert!(public.is_empty(), "public modules in {file}: {public:?}");
    }
}

/// The names `file` makes public at its top level: its `pub use` list and
/// its own `pub` modules and items.
fn face_of(file: &str) -> Vec<String> {
    let mut names = exports_of(file);
    let path = Path::new(ROOT).join(file);
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let ident = |s: &str| s.chars().take_while(|c| c.is_alphanumeric() || *c == '_').collect::<String>();
    for line in text.lines() {
        let Some(item) = line.strip_prefix("pub ") else { continue };
        let item = item.trim_start_matches("async ").trim_start_matches("unsafe ");
        for kind in ["mod ", "fn ", "struct ", "enum ", "trait ", "type ", "const ", "static "] {
            if let Some(name) = item.strip_prefix(kind) {
                names.push(ident(name));
            }
        }
    }
    names
}

/// Checks the face `file` gives the path `face` (`own`'s crate): every name
/// is used by non-test code outside `own` or by the docs, is in `reached`
/// (used another way), or is listed: public because a public signature
/// names it (`for_signatures`, with the item), or used only by tests
/// (`test_only`, with the tests). Every test-only name is still exported
/// and still unused (else the list is stale: strike it).
fn check_face(face: &str, own: &str, file: &str, reached: &[String], for_signatures: &[(&str, &str)], test_only: &[(&str, &str)]) {
    let mut used = names_used_through(face, own);
    used.extend(reached.iter().cloned());
    let exported = face_of(file);
    assert!(exported.len() > 5, "{file}'s public names were not read: {exported:?}");
    let listed = |n: &String| for_signatures.iter().chain(test_only).any(|(a, _)| a == n);
    let unused: Vec<&String> = exported.iter().filter(|n| !used.contains(*n) && !listed(n)).collect();
    assert!(unused.is_empty(), "{face} exports items no non-test code outside it uses (make them pub(crate)): {unused:?}");
    let stale = stale_test_only(test_only, &exported, &used);
    assert!(stale.is_empty(), "{face}: listed as used only by tests, but no longer exported or now used (strike them): {stale:?}");
    let gone: Vec<&str> = for_signatures.iter().map(|(n, _)| *n).filter(|n| !exported.iter().any(|e| e == n)).collect();
    assert!(gone.is_empty(), "{face}: listed as public for signatures, but no longer exported (strike them): {gone:?}");
}

/// Names of the actor runtime's face that no other crate's code names,
/// public because a public item's signature names them (name, where).
const ACTORS_PUBLIC_FOR_SIGNATURES: &[(&str, &str)] = &[
    ("ActorInfo", "ActorRef::info"),
    ("WeakActorRef", "Context::myself"),
    ("BroadcastError", "ActorGroup::broadcast"),
    ("TellError", "ActorRef::tell"),
    ("StopReason", "Terminated::reason"),
];

/// Public names of the actor runtime that only tests use, or nothing
/// (today's, to be made `pub(crate)` or given a user; no name may join
/// them), each with the tests that use it.
const ACTORS_USED_ONLY_BY_TESTS: &[(&str, &str)] = &[];

/// Every name the actor runtime makes public at its root (re-exports,
/// modules, items) is used by another crate's non-test code, another
/// crate's example or the docs, or is listed above.
#[test]
fn every_public_item_of_the_actor_runtime_is_used_outside_it() {
    check_face("actors", "actors", "actors/src/lib.rs", &[], ACTORS_PUBLIC_FOR_SIGNATURES, ACTORS_USED_ONLY_BY_TESTS);
}

/// Names of the orchestrator's face that no other crate's code names,
/// public because a public item's signature names them (name, where).
const ORCHESTRATOR_PUBLIC_FOR_SIGNATURES: &[(&str, &str)] = &[
    ("OrchestratorMsg", "Orchestrator::Msg"),
    ("OrchestratorReply", "Orchestrator::Reply"),
    ("ReplicaLoss", "OrchestratorConfig::replica_loss"),
    ("ReplicaPlan", "OrchestratorConfig::replica_plan"),
    ("SourceLoss", "OrchestratorConfig::source_loss"),
    ("SeedReport", "ReplicaReport::seeded"),
    ("MemberReply", "Member::Reply"),
    ("Refusal", "MemberReply::Refused"),
    ("LayoutInfo", "MemberReply::Layout"),
    ("RunStats", "MemberReply::Ran"),
    ("RankDigest", "RunStats::digest"),
    ("DigestError", "RunStats::digest"),
    ("DataAddr", "MemberReply's data-plane address"),
    ("ProgramRole", "MemberMsg::Install's seat"),
    ("RunRequest", "MemberMsg::Run"),
    ("RunDelta", "RunRequest::delta"),
    ("HostWork", "host_work"),
    ("FabricUnavailable", "fabric_available"),
];

/// Public names of the orchestrator that only tests use (today's; no name
/// may join them), each with the tests that use it.
const ORCHESTRATOR_USED_ONLY_BY_TESTS: &[(&str, &str)] = &[];

/// The names `orchestrator::prelude` brings (`use refit::prelude::*`
/// uses them all).
fn prelude_names() -> Vec<String> {
    let lib = std::fs::read_to_string(Path::new(ROOT).join("orchestrator/src/lib.rs")).expect("orchestrator/src/lib.rs");
    let start = lib.find("pub mod prelude {").expect("orchestrator has a prelude");
    let block = &lib[start..start + lib[start..].find("\n}").expect("the prelude ends")];
    let mut names = Vec::new();
    for item in block.split("pub use ").skip(1) {
        let item = &item[..item.find(';').expect("a `pub use` ends with `;`")];
        let list = match (item.find('{'), item.rfind('}')) {
            (Some(a), Some(b)) => &item[a + 1..b],
            _ => item.rsplit("::").next().unwrap_or(item),
        };
        names.extend(list.split(',').map(str::trim).filter(|n| !n.is_empty()).map(str::to_string));
    }
    assert!(names.len() > 10, "the prelude was not read: {names:?}");
    names
}

/// Every name the orchestrator makes public at its root (re-exports,
/// modules, items) is used by another crate's non-test code, another
/// crate's example or the docs, is brought by the prelude, or is listed
/// above.
#[test]
fn every_public_item_of_the_orchestrator_is_used_outside_it() {
    check_face(
        "orchestrator",
        "orchestrator",
        "orchestrator/src/lib.rs",
        &prelude_names(),
        ORCHESTRATOR_PUBLIC_FOR_SIGNATURES,
        ORCHESTRATOR_USED_ONLY_BY_TESTS,
    );
}

/// Public modules of the command line's library that the binary does not
/// name (module, who uses it).
const CLI_MODULES_NOT_THE_BINARYS: &[(&str, &str)] =
    &[("procs", "the cluster and chaos modules (`crate::procs`): could be private, nothing outside the crate names it")];

/// The command line's library (`refit_cli`) holds the binary's tools: each
/// public module is one the binary (cli/src/main.rs, cli/src/cmd) names,
/// or is listed above.
#[test]
fn every_module_of_the_command_line_serves_the_binary() {
    let lib = std::fs::read_to_string(Path::new(ROOT).join("cli/src/lib.rs")).expect("cli/src/lib.rs");
    let modules: Vec<&str> = lib.lines().filter_map(|l| l.strip_prefix("pub mod ")).map(|m| m.trim_end_matches(';')).collect();
    assert!(modules.len() > 8, "cli/src/lib.rs's modules were not read: {modules:?}");
    let mut binary = vec![Path::new(ROOT).join("cli/src/main.rs")];
    binary.extend(sources(&Path::new(ROOT).join("cli/src/cmd")));
    let texts: Vec<String> = binary.iter().map(|p| without_tests(&std::fs::read_to_string(p).unwrap_or_default())).collect();
    let named = |m: &str| texts.iter().any(|t| t.contains(&format!("refit_cli::{m}::")) || t.contains(&format!("refit_cli::{m};")));
    let listed = |m: &str| CLI_MODULES_NOT_THE_BINARYS.iter().any(|(l, _)| *l == m);
    let unnamed: Vec<&&str> = modules.iter().filter(|m| !named(m) && !listed(m)).collect();
    assert!(unnamed.is_empty(), "public modules of cli/src/lib.rs the binary does not use (make them private): {unnamed:?}");
    let stale: Vec<&str> = CLI_MODULES_NOT_THE_BINARYS.iter().map(|(m, _)| *m).filter(|m| named(m) || !modules.contains(m)).collect();
    assert!(stale.is_empty(), "CLI_MODULES_NOT_THE_BINARYS: strike {stale:?}");
}

/// Test code is told from the rest: files under `tests` folders and
/// `tests.rs` files, `#[cfg(test)]` items within a file.
#[test]
fn test_code_is_not_read_as_a_user() {
    assert!(is_test_file(&Path::new(ROOT).join("cli/tests/cli.rs")));
    assert!(is_test_file(&Path::new(ROOT).join("transport/src/shm/tests.rs")));
    assert!(!is_test_file(&Path::new(ROOT).join("cli/src/main.rs")));
    let text = "use a::B;\n#[cfg(test)]\nmod tests {\n    fn f() { let _ = c::D; }\n}\n#[cfg(test)]\nuse e::F;\nfn g() {}\n";
    assert_eq!(without_tests(text), "use a::B;\n\n\nfn g() {}\n");
}

/// The verification pattern is test and tooling machinery (`transport`'s
/// `testkit` feature, passed on by the orchestrator's): the orchestrator
/// names it only in its `testkit` module, and it, the `refit` library and
/// the Python package, which users embed, build without it.
#[test]
fn production_crates_never_use_the_verification_pattern() {
    let manifest = std::fs::read_to_string(Path::new(ROOT).join("transport/Cargo.toml")).expect("transport/Cargo.toml");
    assert!(manifest.contains("testkit = []"), "transport has no testkit feature");
    for krate in ["src", "orchestrator/src", "python/src"] {
        let mut users = Vec::new();
        for p in sources(&Path::new(ROOT).join(krate)) {
            let text = std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
            // The orchestrator's `testkit` module, behind its feature.
            let text = match (text.find("#[cfg(feature = \"testkit\")]\npub mod testkit {"), krate) {
                (Some(at), "orchestrator/src") => {
                    let end = text[at..].find("\n}\n").map_or(text.len(), |e| at + e + 3);
                    format!("{}{}", &text[..at], &text[end..])
                }
                _ => text,
            };
            let code = text.lines().filter(|l| !l.trim_start().starts_with("//")).collect::<Vec<_>>().join("\n");
            if ["pattern::", "fill_source", "verify_destination"].iter().any(|w| code.contains(w)) {
                users.push(p.strip_prefix(ROOT).unwrap_or(&p).display().to_string());
            }
        }
        assert!(users.is_empty(), "{krate} uses the verification pattern: {users:?}");
    }
    let orchestrator = std::fs::read_to_string(Path::new(ROOT).join("orchestrator/Cargo.toml")).expect("orchestrator/Cargo.toml");
    assert!(orchestrator.contains("testkit = [\"transport/testkit\"]"), "the orchestrator's testkit feature is not transport's");
    assert!(!orchestrator.contains("default = [\"testkit"), "the orchestrator turns testkit on by default");
    assert!(
        !dependencies_section("orchestrator/Cargo.toml").iter().any(|l| l.contains("testkit")),
        "the orchestrator turns transport's testkit on"
    );
    assert!(!dependencies_section("python/Cargo.toml").iter().any(|l| l.contains("testkit")), "the Python package turns testkit on");
    // The library (its examples too: `cargo tree -e features -p refit`
    // names no testkit); the command line turns it on.
    let library = std::fs::read_to_string(Path::new(ROOT).join("Cargo.toml")).expect("Cargo.toml");
    let code = library.lines().filter(|l| !l.trim_start().starts_with('#')).collect::<Vec<_>>().join("\n");
    assert!(!code.contains("testkit"), "the refit library's manifest turns testkit on");
    assert!(dependencies_section("cli/Cargo.toml").iter().any(|l| l.contains("testkit")), "the command line no longer turns testkit on");
}

/// The top-level modules of `krate/src` and, for each, the others its
/// code names (`crate::m`, `crate::{m, ..}`, or a name the crate root
/// re-exports from `m`); comments and `#[cfg(test)]` modules are not
/// read.
fn module_graph(krate: &str) -> std::collections::BTreeMap<String, std::collections::BTreeSet<String>> {
    use std::collections::{BTreeMap, BTreeSet};
    let src = Path::new(ROOT).join(krate).join("src");
    let mut modules: BTreeMap<String, Vec<std::path::PathBuf>> = BTreeMap::new();
    for entry in std::fs::read_dir(&src).expect("src/").flatten() {
        let path = entry.path();
        let name = path.file_stem().and_then(|n| n.to_str()).unwrap_or_default().to_string();
        if name == "lib" || name == "main" {
            continue;
        }
        let files = if path.is_dir() { sources(&path) } else { vec![path.clone()] };
        // A test module in a file of its own (`tests.rs`) is not code the
        // module depends on.
        let files = files.into_iter().filter(|f| f.file_name().is_none_or(|n| n != "tests.rs"));
        modules.entry(name).or_default().extend(files);
    }
    // Names the root re-exports, by the module they come from.
    let lib = std::fs::read_to_string(src.join("lib.rs")).expect("lib.rs");
    let mut reexported: BTreeMap<String, String> = BTreeMap::new();
    let mut rest = lib.as_str();
    while let Some(at) = rest.find("pub use ") {
        rest = &rest[at + "pub use ".len()..];
        let end = rest.find(';').unwrap_or(rest.len());
        let item = &rest[..end];
        let module = item.split("::").next().unwrap_or_default().trim().to_string();
        let list = match (item.find('{'), item.rfind('}')) {
            (Some(a), Some(b)) => item[a + 1..b].to_string(),
            _ => item.rsplit("::").next().unwrap_or(item).to_string(),
        };
        for name in list.split(',').map(str::trim).filter(|n| !n.is_empty()) {
            reexported.insert(name.to_string(), module.clone());
        }
    }
    let ident = |s: &str| s.chars().take_while(|c| c.is_alphanumeric() || *c == '_').collect::<String>();
    let mut graph = BTreeMap::new();
    for (name, files) in &modules {
        let mut uses = BTreeSet::new();
        for f in files {
            let text = std::fs::read_to_string(f).unwrap_or_default();
            // Code only: up to a test module, without comment lines.
            let code: String = text
                .split("#[cfg(test)]\nmod tests")
                .next()
                .unwrap_or_default()
                .lines()
                .filter(|l| !l.trim_start().starts_with("//"))
                .collect::<Vec<_>>()
                .join("\n");
            let mut rest = code.as_str();
            while let Some(at) = rest.find("crate::") {
                rest = &rest[at + "crate::".len()..];
                let names: Vec<String> = match rest.strip_prefix('{') {
                    Some(list) => list[..list.find('}').unwrap_or(list.len())].split(',').map(|n| ident(n.trim())).collect(),
                    None => vec![ident(rest)],
                };
                for n in names {
                    let target = if modules.contains_key(&n) { Some(n) } else { reexported.get(&n).cloned() };
                    if let Some(t) = target.filter(|t| t != name) {
                        uses.insert(t);
                    }
                }
            }
        }
        graph.insert(name.clone(), uses);
    }
    graph
}

/// The pairs of modules that reach each other (a circle), each once.
fn circles(graph: &std::collections::BTreeMap<String, std::collections::BTreeSet<String>>) -> Vec<(String, String)> {
    let reaches = |from: &str, to: &str| {
        let mut seen = std::collections::BTreeSet::new();
        let mut todo = vec![from.to_string()];
        while let Some(m) = todo.pop() {
            for n in graph.get(&m).into_iter().flatten() {
                if n == to {
                    return true;
                }
                if seen.insert(n.clone()) {
                    todo.push(n.clone());
                }
            }
        }
        false
    };
    let names: Vec<&String> = graph.keys().collect();
    let mut out = Vec::new();
    for (i, a) in names.iter().enumerate() {
        for b in &names[i + 1..] {
            if reaches(a, b) && reaches(b, a) {
                out.push((a.to_string(), b.to_string()));
            }
        }
    }
    out
}

/// The planner's and the data plane's top-level modules depend on each
/// other without circles (issue 34), so each can be read from the bottom
/// up; circles still there are listed and may only go.
#[test]
fn modules_of_the_planner_and_the_data_plane_form_no_circles() {
    for (krate, allowed) in [("reshard", &[][..]), ("transport", &[][..])] {
        let graph = module_graph(krate);
        assert!(graph.len() > 8, "{krate}: modules not read: {graph:?}");
        let found = circles(&graph);
        let allowed: Vec<(String, String)> = allowed.iter().map(|(a, b): &(&str, &str)| (a.to_string(), b.to_string())).collect();
        let new: Vec<&(String, String)> = found.iter().filter(|c| !allowed.contains(c)).collect();
        assert!(new.is_empty(), "{krate}: modules that reach each other: {new:?}\n{graph:#?}");
        let gone: Vec<&(String, String)> = allowed.iter().filter(|c| !found.contains(c)).collect();
        assert!(gone.is_empty(), "{krate}: circles listed as allowed are gone, strike them: {gone:?}");
    }
}

/// The circle finder finds a circle through a third module, and only it.
#[test]
fn the_circle_finder_finds_circles() {
    let graph: std::collections::BTreeMap<String, std::collections::BTreeSet<String>> =
        [("a", &["b"][..]), ("b", &["c"]), ("c", &["a"]), ("d", &["a"])]
            .into_iter()
            .map(|(m, uses)| (m.to_string(), uses.iter().map(|u| u.to_string()).collect()))
            .collect();
    let pair = |a: &str, b: &str| (a.to_string(), b.to_string());
    assert_eq!(circles(&graph), vec![pair("a", "b"), pair("a", "c"), pair("b", "c")]);
}

/// Use trees expand to every path they name.
#[test]
fn use_trees_expand_to_their_paths() {
    let got = use_tree_paths("{cuda::{A, b::C as D},\n    E, f::G}; more");
    assert_eq!(got, ["cuda::A", "cuda::b::C", "E", "f::G"]);
    assert_eq!(use_tree_paths("X::new(3)"), ["X::new"]);
    assert_eq!(use_tree_paths("cuda` and"), ["cuda"]);
}
