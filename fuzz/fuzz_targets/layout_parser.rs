//! Arbitrary bytes into the layout-file parser, as the CLI feeds it: bytes
//! that are not UTF-8 never reach the parser (`read_to_string` refuses them),
//! so they are decoded lossily here to still exercise it.
//!
//! Oracle: no panic, and every accepted layout survives a round trip through
//! `layout_to_json` unchanged.
#![no_main]

use libfuzzer_sys::fuzz_target;
use reshard::{layout_to_json, parse_layout};

fuzz_target!(|data: &[u8]| {
    let text = String::from_utf8_lossy(data);
    if let Ok(layout) = parse_layout(&text) {
        let again = parse_layout(&layout_to_json(&layout).to_string()).expect("a written layout parses");
        assert_eq!(again, layout, "layout_to_json round trip");
    }
});
