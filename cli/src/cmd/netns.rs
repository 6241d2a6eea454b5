//! `refit netns --clean`: removes what launchers with `--netns` that are
//! gone left behind; `refit netns --watch` is a launcher's watchdog.

use super::report::{say, Failure};

/// `watch`: the launcher and start time to watch (the watchdog); `None`:
/// clean.
pub(crate) fn run(watch: Option<(u32, u64)>) -> Result<(), Failure> {
    if let Some((owner, start)) = watch {
        return refit_cli::netns::watch(owner, start).map_err(|e| Failure { line: format!("watchdog of launcher {owner}: {e}"), code: 1 });
    }
    let said = refit_cli::netns::clean().map_err(|e| Failure { line: e, code: 2 })?;
    if said.is_empty() {
        say!("nothing of emulated hosts to remove");
    }
    for line in said {
        say!("{line}");
    }
    Ok(())
}
