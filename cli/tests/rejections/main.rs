//! Every way a layout file or a layout pair must be rejected, table-driven:
//! each case is an input and the fragments its error message must contain
//! (the field path, tensor, rank or buffer it is about, and the problem).
//!
//! `check_single` runs `parse_layout` on one file; `check_pair` parses both
//! files (which must be valid on their own) and runs both planners. A few
//! accept cases pin down valid edge cases; they are planned, executed on the
//! in-process transport and verified element by element.
//!

mod accepts;
mod block_scales;
mod known_defects;
mod mesh;
mod pairs;
mod shards;
mod tensor_fields;
mod top_level;

use refit_cli::runner::{Driver, DriverConfig};
use reshard::{parse_layout, plan_baseline, plan_reshard, Layout, PlanOptions, Strategy};

/// A one-tensor layout on 4 ranks.
fn one(tensor: &str) -> String {
    format!(r#"{{"ranks": 4, "tensors": [{tensor}]}}"#)
}

/// Asserts that `json` is rejected by `parse_layout` with a message holding
/// every fragment of `expect` (and that the parser's fast path and its
/// reference walker agree on it); returns a description of what went wrong.
fn single_failure(json: &str, expect: &[&str]) -> Option<String> {
    if let Err(e) = reshard::cross_check(json) {
        return Some(e);
    }
    match parse_layout(json) {
        Ok(_) => Some("accepted".to_string()),
        Err(e) => {
            let msg = e.to_string();
            let missing: Vec<&&str> = expect.iter().filter(|f| !msg.contains(**f)).collect();
            if !missing.is_empty() {
                return Some(format!("message {msg:?} lacks {missing:?}"));
            }
            if msg.contains('\n') {
                return Some(format!("message {msg:?} spans several lines"));
            }
            None
        }
    }
}

fn check_single(json: &str, expect: &[&str]) {
    if let Some(f) = single_failure(json, expect) {
        panic!("{json}\n  {f}");
    }
}

/// Runs a table of single-file cases and reports every failing case at once.
fn run_single_table(cases: &[(&str, String, &[&str])]) {
    let failures: Vec<String> = cases
        .iter()
        .filter_map(|(name, json, expect)| single_failure(json, expect).map(|f| format!("{name}: {f}\n    input: {json}")))
        .collect();
    assert!(failures.is_empty(), "{} of {} cases failed:\n{}", failures.len(), cases.len(), failures.join("\n"));
}

fn parse_ok(what: &str, json: &str) -> Result<Layout, String> {
    reshard::cross_check(json).map_err(|e| format!("{what} layout: {e}"))?;
    parse_layout(json).map_err(|e| format!("{what} layout rejected: {e}"))
}

/// Asserts that both layouts parse and that both `plan_reshard` and
/// `plan_baseline` reject the pair with every fragment of `expect`; returns
/// a description of what went wrong.
fn pair_failure(src: &str, dst: &str, expect: &[&str]) -> Option<String> {
    let (s, d) = match (parse_ok("source", src), parse_ok("destination", dst)) {
        (Ok(s), Ok(d)) => (s, d),
        (Err(e), _) | (_, Err(e)) => return Some(e),
    };
    let opts = PlanOptions::default();
    let results = [("plan_reshard", plan_reshard(&s, &d, &opts).map(|_| ())), ("plan_baseline", plan_baseline(&s, &d, &opts).map(|_| ()))];
    for (planner, r) in results {
        match r {
            Ok(()) => return Some(format!("{planner} accepted the pair")),
            Err(e) => {
                let msg = e.to_string();
                let missing: Vec<&&str> = expect.iter().filter(|f| !msg.contains(**f)).collect();
                if !missing.is_empty() {
                    return Some(format!("{planner}: message {msg:?} lacks {missing:?}"));
                }
            }
        }
    }
    None
}

fn check_pair(src: &str, dst: &str, expect: &[&str]) {
    if let Some(f) = pair_failure(src, dst, expect) {
        panic!("src: {src}\ndst: {dst}\n  {f}");
    }
}

fn run_pair_table(cases: &[(&str, String, String, &[&str])]) {
    let failures: Vec<String> = cases
        .iter()
        .filter_map(|(name, src, dst, expect)| {
            pair_failure(src, dst, expect).map(|f| format!("{name}: {f}\n    src: {src}\n    dst: {dst}"))
        })
        .collect();
    assert!(failures.is_empty(), "{} of {} cases failed:\n{}", failures.len(), cases.len(), failures.join("\n"));
}

/// Plans, executes and verifies a pair with both strategies.
fn accept_failure(src: &str, dst: &str) -> Option<String> {
    let (s, d) = match (parse_ok("source", src), parse_ok("destination", dst)) {
        (Ok(s), Ok(d)) => (s, d),
        (Err(e), _) | (_, Err(e)) => return Some(e),
    };
    for strategy in [Strategy::Reshard, Strategy::Baseline] {
        let config = DriverConfig { strategy, options: PlanOptions::default(), ..DriverConfig::default() };
        let mut p = match Driver::start(&s, &d, config, |_| {}) {
            Ok(p) => p,
            Err(e) => return Some(format!("{strategy}: {e}")),
        };
        if let Err(e) = p.refit(None) {
            return Some(format!("{strategy}: refit: {e}"));
        }
        if let Err(e) = p.verify(None) {
            return Some(format!("{strategy}: verify: {e}"));
        }
    }
    None
}

fn run_accept_table(cases: &[(&str, String, String)]) {
    let failures: Vec<String> = cases
        .iter()
        .filter_map(|(name, src, dst)| accept_failure(src, dst).map(|f| format!("{name}: {f}\n    src: {src}\n    dst: {dst}")))
        .collect();
    assert!(failures.is_empty(), "{} of {} cases failed:\n{}", failures.len(), cases.len(), failures.join("\n"));
}

fn mesh_layout(ranks: u32, name: &str, dtype: &str, shape: &str, mesh: &str, placements: &str) -> String {
    format!(
        r#"{{"ranks": {ranks}, "tensors": [{{"name": "{name}", "dtype": "{dtype}", "shape": {shape}, "mesh": {{"shape": {mesh}}}, "placements": {placements}}}]}}"#
    )
}
