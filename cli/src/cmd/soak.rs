//! `refit soak`: many verified refits on the multi-process path, with resource use.

use super::report::{duration, human, load, say, Failure, Progress, Table, TempLayouts};
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
            std::fs::write(dir.join("src.json"), include_str!("../../../examples/tp-to-tp/src.json")).map_err(|e| fail(e.to_string()))?;
            std::fs::write(dir.join("dst.json"), include_str!("../../../examples/tp-to-tp/dst.json")).map_err(|e| fail(e.to_string()))?;
            (dir.join("src.json"), dir.join("dst.json"))
        }
    };
    let (s, d) = (load(&sp)?, load(&dp)?);
    let config = args.config(&sp, &dp, PlanOptions::default(), "127.0.0.1:0", true)?;
    let bar = Progress::bar(refits, as_json);
    bar.phase("starting workers, then verified refits");
    let r = refit_cli::soak::run_soak(config, s, d, refits, |n| bar.set_position(n)).map_err(|e| fail(e.to_string()));
    drop(bar);
    let r = r?;
    if as_json {
        let res = |x: &refit_cli::soak::Resources| json!({"rss_bytes": x.rss_bytes, "fds": x.fds, "threads": x.threads});
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
        say!("  refit time: median {}, slowest {}; whole soak {}", duration(r.median), duration(r.slowest), duration(r.elapsed));
        let mut table = Table::new(&["launcher + workers", "RSS", "fds", "threads"]);
        for (when, x) in [("after refit 1".to_string(), &r.first), (format!("after refit {}", r.refits), &r.last)] {
            table.row(&when, [human(x.rss_bytes), x.fds.to_string(), x.threads.to_string()]);
        }
        table.print();
    }
    Ok(())
}
