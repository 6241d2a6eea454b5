//! `refit emit`: write a model preset's layouts as layout files.

use super::report::{preset, say, write_layouts, Failure, Progress};
use refit::presets::Model;
use std::path::Path;

pub(crate) fn run(model: Model, scale: u64, ep: Option<u32>, out: &Path) -> Result<(), Failure> {
    let progress = Progress::spinner(false);
    progress.phase(format!("building the {model} layouts"));
    let (src, dst) = preset(model, scale, ep)?;
    progress.phase(format!("writing {}", out.display()));
    write_layouts(&src, &dst, out)?;
    drop(progress);
    say!("wrote {}/src.json and dst.json ({} tensors)", out.display(), dst.tensors().len());
    Ok(())
}
