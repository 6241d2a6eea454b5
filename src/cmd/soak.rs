//! `refit soak`: many verified refits on the multi-process path, with resource use.

use super::report::{load, progress_bar, say, Failure, TempLayouts};
use crate::ClusterArgs;
use reshard::PlanOptions;
use serde_json::json;
use std::path::PathBuf;

pub(crate) fn run(src: &Option<PathBuf>, dst: &Option<PathBuf>, refits: u64, args: &ClusterArgs, as_json: bool) -> Result<(), Failure> {
    let fail = |e: String| Failure { line: e, code: 1 };
    let dir = std::env::temp_dir().join(format!("refit-soak-{}", std::process::id()));
    let _temp = TempLayouts(dir.clone());
    let (sp, dp) = match (src, dst) {
        (Some(s), Some(d)) => (s.clone(), d.clone()),
        _ => {
            std::fs::create_dir_all(&dir).map_err(|e| fail(format!("{}: {e}", dir.display())))?;
            std::fs::write(dir.join("src.json"), include_str!("../../examples/tp-to-tp/src.json")).map_err(|e| fail(e.to_string()))?;
            std::fs::write(dir.join("dst.json"), include_str!("../../examples/tp-to-tp/dst.json")).map_err(|e| fail(e.to_string()))?;
            (dir.join("src.json"), dir.join("dst.json"))
        }
    };
    let (s, d) = (load(&sp)?, load(&dp)?);
    let config = args.config(&sp, &dp, PlanOptions::default(), "127.0.0.1:0", true)?;
    let bar = progress_bar(refits, as_json);
    let r = refit::soak::run_soak(config, s, d, refits, |n| bar.set_position(n)).map_err(|e| fail(e.to_string()));
    bar.finish_and_clear();
    let r = r?;
    let mib = |b: u64| b as f64 / (1u64 << 20) as f64;
    if as_json {
        let res = |x: &refit::soak::Resources| json!({"rss_bytes": x.rss_bytes, "fds": x.fds, "threads": x.threads});
        say!(
            "{}",
            json!({
                "refits": r.refits, "workers": r.workers, "verified_elements": r.verified,
                "first": res(&r.first), "last": res(&r.last),
                "median_s": r.median.as_secs_f64(), "slowest_s": r.slowest.as_secs_f64(), "elapsed_s": r.elapsed.as_secs_f64(),
            })
        );
    } else {
        say!(
            "soak: {} refits on {} worker processes, every one verified before commit ({} elements in all)",
            r.refits,
            r.workers,
            r.verified
        );
        say!(
            "  refit time: median {:.1} ms, slowest {:.1} ms; whole soak {:.1} s",
            r.median.as_secs_f64() * 1e3,
            r.slowest.as_secs_f64() * 1e3,
            r.elapsed.as_secs_f64()
        );
        say!(
            "  after refit 1:    RSS {:>8.1} MiB  fds {:>5}  threads {:>5}  (launcher + workers)",
            mib(r.first.rss_bytes),
            r.first.fds,
            r.first.threads
        );
        say!("  after refit {:<5} RSS {:>8.1} MiB  fds {:>5}  threads {:>5}", r.refits, mib(r.last.rss_bytes), r.last.fds, r.last.threads);
    }
    Ok(())
}
