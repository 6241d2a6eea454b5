//! The layering rules of docs/ARCHITECTURE.md, checked on the sources:
//! which crate may depend on which, and which parts of the command line
//! reach data movement only through the orchestrator.

use std::path::Path;

const ROOT: &str = env!("CARGO_MANIFEST_DIR");

/// The workspace crates a crate's manifest depends on (any section).
fn our_dependencies(krate: &str) -> Vec<&'static str> {
    let manifest = Path::new(ROOT).join(krate).join("Cargo.toml");
    let text = std::fs::read_to_string(&manifest).unwrap_or_else(|e| panic!("{}: {e}", manifest.display()));
    ["reshard", "transport", "actors", "orchestrator"]
        .into_iter()
        .filter(|dep| {
            text.lines().any(|l| {
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
}

#[test]
fn the_rl_demo_chaos_and_soak_move_weights_only_through_the_orchestrator() {
    let users = users_of(
        &[
            "src/demo.rs",
            "src/chaos.rs",
            "src/soak.rs",
            "src/procs.rs",
            "examples/multiprocess_pipeline.rs",
            "examples/compose_pipeline.rs",
        ],
        "transport",
    );
    assert!(users.is_empty(), "these import the transport crate: {users:?}");
}
