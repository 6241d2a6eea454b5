//! `refit controller-bench` at a small size: one orchestrator over 64 ->
//! 64 members of a scaled-out DeepSeek-V3 pair in this process; every
//! refit verified on every destination, and the control messages counted
//! as the protocol says. No timing is asserted.

use refit_cli::controller::{control_messages_per_refit, measure, ControllerConfig};
use refit_cli::presets::{scaled_out, Model, ScaleOut};

#[test]
fn controller_measurement_verifies_every_destination_at_64_to_64() {
    let shape = ScaleOut { src_ranks: 64, dst_ranks: 64, layers: 4 };
    let config = ControllerConfig { model: Model::DeepseekV3, scale: 1024, shape, refits: 2 };
    let figures = measure(config, |_| {}).expect("the measurement runs");
    let (_, dst) = scaled_out(Model::DeepseekV3, 1024, shape).unwrap();
    // Every element every destination rank holds, checked each refit.
    let elems: u64 = dst.buffers().iter().flatten().map(|b| b.elems).sum();
    assert!(elems > 0);
    assert_eq!(figures.refits.len(), 2);
    for r in &figures.refits {
        assert_eq!(r.verified, elems, "every destination element checked against the pattern");
        assert_eq!(r.control_messages, control_messages_per_refit(64, 64));
        assert_eq!(r.data_messages, figures.figures.messages);
    }
    // The start planned and installed every member's program.
    assert!(figures.planned.replanned);
    assert_eq!(figures.planned.installed, 128);
    // Status to every member, describe to one per group, install to every member.
    assert_eq!(figures.planned.control_messages, 128 + 2 + 128);
    // 3 dense layers and a MoE layer of 256 experts.
    assert!(figures.tensors > 3 * 256, "the model's tensors: {}", figures.tensors);
}

#[test]
fn scaled_out_pairs_refuse_rank_counts_that_do_not_split() {
    let bad = |src_ranks, dst_ranks| scaled_out(Model::KimiK2, 1024, ScaleOut { src_ranks, dst_ranks, layers: 16 }).unwrap_err();
    assert!(bad(100, 64).to_string().contains("PP16 x EP16"));
    assert!(bad(256, 40).to_string().contains("EP16"));
    assert!(scaled_out(Model::Llama3_8b, 1024, ScaleOut { src_ranks: 256, dst_ranks: 256, layers: 16 }).is_err());
}
