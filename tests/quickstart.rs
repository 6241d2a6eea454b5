//! The README's library quickstart, as a new user meets it: its
//! `Cargo.toml` lines and its program, built as a crate of its own outside
//! this workspace (with only the dependencies the README names) and run.

use std::path::{Path, PathBuf};
use std::process::Command;

/// The first fenced block of `lang` after the heading `section` in `text`.
fn block<'a>(text: &'a str, section: &str, lang: &str) -> &'a str {
    let from = text.find(section).unwrap_or_else(|| panic!("README has no section '{section}'"));
    let rest = &text[from..];
    let fence = format!("```{lang}\n");
    let start = rest.find(&fence).unwrap_or_else(|| panic!("no ```{lang} block under '{section}'")) + fence.len();
    let len = rest[start..].find("```").unwrap_or_else(|| panic!("unterminated ```{lang} block under '{section}'"));
    &rest[start..start + len]
}

/// The README's dependency lines, with the path to this repository made
/// absolute (it says `../refit`, relative to the user's crate).
fn dependencies(toml: &str, repo: &Path) -> String {
    let lines: Vec<String> = toml
        .lines()
        .map(|l| match l.strip_prefix("refit = ") {
            Some(_) => format!("refit = {{ path = {:?} }}", repo.display().to_string()),
            None => l.to_string(),
        })
        .collect();
    assert!(lines.iter().any(|l| l.starts_with("refit = ")), "the README's Cargo.toml lines do not name the refit crate");
    lines.join("\n")
}

#[test]
fn slow_readme_quickstart_builds_and_runs() {
    let repo = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let readme = std::fs::read_to_string(repo.join("README.md")).expect("README.md");
    let section = "## Use it as a library";
    let toml = block(&readme, section, "toml");
    let program = block(&readme, section, "rust");
    assert!(program.lines().count() <= 40, "the quickstart grew past 40 lines");
    // Kept between runs (under target/, ignored by git) so that the second
    // build is incremental.
    let dir = repo.join("target").join("quickstart");
    let krate = dir.join("crate");
    std::fs::create_dir_all(krate.join("src")).expect("create the crate");
    // An empty [workspace]: the crate is its own, not a member of ours.
    let manifest = format!(
        "[package]\nname = \"quickstart\"\nversion = \"0.0.0\"\nedition = \"2021\"\npublish = false\n\n[workspace]\n\n{}\n",
        dependencies(toml, &repo)
    );
    std::fs::write(krate.join("Cargo.toml"), manifest).expect("write Cargo.toml");
    std::fs::write(krate.join("src").join("main.rs"), program).expect("write main.rs");
    // The versions this workspace is built and tested with.
    std::fs::copy(repo.join("Cargo.lock"), krate.join("Cargo.lock")).expect("copy Cargo.lock");
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let out = Command::new(cargo)
        .args(["run", "--quiet", "--offline"])
        .current_dir(&krate)
        .env("CARGO_TARGET_DIR", dir.join("target"))
        .output()
        .expect("run cargo");
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "the quickstart failed ({}):\n{stdout}\n{stderr}", out.status);
    for step in 1..=3 {
        let line = format!("step {step}: version {step} served everywhere, ");
        assert!(stdout.contains(&line), "missing '{line}' in:\n{stdout}");
    }
}
