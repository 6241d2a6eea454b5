//! `refit emit`: write a model preset's layouts as layout files.

use super::report::{parse_setup, preset_with, say, write_layouts, Failure, Progress};
use refit_cli::presets::{Model, PresetOptions};
use std::path::Path;

/// Writes the layouts of `model` at `scale`, with inference expert
/// parallelism `ep` or the anchor's setup named `setup`, if given.
pub(crate) fn run(model: Model, scale: u64, ep: Option<u32>, setup: Option<&str>, out: &Path) -> Result<(), Failure> {
    let options = PresetOptions { ep, setup: setup.map(|name| parse_setup(Some(model), name)).transpose()? };
    let progress = Progress::spinner(false);
    progress.phase(format!("building the {model} layouts"));
    let (src, dst) = preset_with(model, scale, options)?;
    progress.phase(format!("writing {}", out.display()));
    write_layouts(&src, &dst, out)?;
    drop(progress);
    say!("wrote {}/src.json and dst.json ({} tensors)", out.display(), dst.tensors().len());
    Ok(())
}
