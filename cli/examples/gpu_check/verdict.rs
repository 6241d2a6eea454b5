//! A check's verdict on the work its process did on the host
//! (`transport::cuda::host_work`): any host fallback — a piece converted
//! through host memory, or block-scaled FP8 tensors quantized on the host,
//! where the device has a path for it — fails the check, naming each; the
//! dtype pairs no device kernel converts (f64) are listed, not failed.

use serde_json::{json, Value};
use transport::cuda::HostWork;

fn described(w: &HostWork) -> String {
    format!("{} {} on the host x{} ({})", w.rank, w.what, w.times, w.why)
}

/// Adds the host work to the check's result `v` (`host_fallbacks`: how
/// many, `host_fallback_work`: each kind, `host_work_without_kernel`:
/// the by-design ones) and fails a passing check that fell back.
pub(crate) fn judge_host_work(v: &mut Value, work: &[HostWork]) {
    let (fallbacks, by_design): (Vec<&HostWork>, Vec<&HostWork>) = work.iter().partition(|w| w.fallback);
    let list = |ws: &[&HostWork]| json!(ws.iter().map(|w| described(w)).collect::<Vec<_>>());
    v["host_fallbacks"] = json!(fallbacks.iter().map(|w| w.times).sum::<u64>());
    v["host_fallback_work"] = list(&fallbacks);
    v["host_work_without_kernel"] = list(&by_design);
    if !fallbacks.is_empty() && v["ok"] == json!(true) {
        v["ok"] = json!(false);
        v["line"] = json!(format!(
            "{} — but it ran work on the host instead of the GPU: {}",
            v["line"].as_str().unwrap_or_default(),
            fallbacks.iter().map(|w| described(w)).collect::<Vec<_>>().join("; ")
        ));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn work(what: &str, why: &str, fallback: bool) -> HostWork {
        HostWork { rank: "dst rank 1".into(), what: what.into(), why: why.into(), times: 2, fallback }
    }

    #[test]
    fn any_host_fallback_fails_a_passing_check_and_names_it() {
        let mut v = json!({ "check": "layouts", "ok": true, "line": "7 pairs" });
        let fp8 = work("quantized its block-scaled tensors", "the quantize kernels did not load: x", true);
        judge_host_work(&mut v, &[fp8]);
        assert_eq!(v["ok"], json!(false));
        assert_eq!(v["host_fallbacks"], json!(2));
        let line = v["line"].as_str().unwrap();
        assert!(line.starts_with("7 pairs — but it ran work on the host"), "{line}");
        assert!(
            line.contains("dst rank 1 quantized its block-scaled tensors on the host x2 (the quantize kernels did not load: x)"),
            "{line}"
        );

        let mut v = json!({ "check": "ipc", "ok": true, "line": "ok" });
        judge_host_work(&mut v, &[work("converted a piece", "the cast kernels did not load: y", true)]);
        assert_eq!(v["ok"], json!(false));
        assert!(v["line"].as_str().unwrap().contains("converted a piece on the host x2"));
    }

    #[test]
    fn dtype_pairs_without_a_kernel_are_listed_but_do_not_fail() {
        let mut v = json!({ "check": "layouts", "ok": true, "line": "7 pairs" });
        judge_host_work(&mut v, &[work("converted a piece", "no device kernel converts f32 -> f64", false)]);
        assert_eq!(v["ok"], json!(true));
        assert_eq!(v["host_fallbacks"], json!(0));
        assert_eq!(
            v["host_work_without_kernel"],
            json!(["dst rank 1 converted a piece on the host x2 (no device kernel converts f32 -> f64)"])
        );
        assert_eq!(v["line"], json!("7 pairs"));
    }

    #[test]
    fn a_failed_or_skipped_check_keeps_its_own_verdict() {
        let mut v = json!({ "check": "nccl", "ok": false, "line": "abort hung" });
        judge_host_work(&mut v, &[work("converted a piece", "z", true)]);
        assert_eq!((&v["ok"], &v["line"]), (&json!(false), &json!("abort hung")));
        let mut v = json!({ "check": "orchestrator", "skipped": "needs 2 GPUs" });
        judge_host_work(&mut v, &[]);
        assert_eq!(v.get("ok"), None);
        assert_eq!(v["host_fallbacks"], json!(0));
    }
}
