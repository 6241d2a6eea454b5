//! Times the delta codec on one message: `base` and `new` are its bytes in
//! two refits (files of equal length), encoded in units of `unit` bytes
//! (the smallest element size: 2 for bf16). Prints one JSON object: the
//! message's bytes, the encoding's bytes and form, and the best of `reps`
//! rates of encoding, decoding and a plain copy of the same bytes into a
//! buffer already allocated (memcpy), in GB/s of message bytes, on one
//! core; `exact` says the decoded message equals `new`. The codec runs as
//! a delta refit runs it: on a base kept with its name (`encode_kept`,
//! `decode_kept`), which is not read again to name it.
//!
//! ```text
//! cargo run --release -p transport --example delta_codec -- BASE NEW [UNIT] [REPS]
//! ```
//!
//! `benchmarks/real_deltas.py` runs it on the bf16 weights of real
//! training steps.

use std::process::ExitCode;
use std::time::{Duration, Instant};
use transport::delta::{decode_kept, encode_kept, form, KeptMessage};

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (Some(base), Some(new)) = (args.first(), args.get(1)) else {
        eprintln!("usage: delta_codec BASE NEW [UNIT] [REPS]");
        return ExitCode::from(2);
    };
    let number =
        |i: usize, default: usize| args.get(i).map_or(Ok(default), |a| a.parse::<usize>().map_err(|e| format!("argument {a}: {e}")));
    let (unit, reps) = match (number(2, 2), number(3, 5)) {
        (Ok(u), Ok(r)) => (u, r.max(1)),
        (Err(e), _) | (_, Err(e)) => {
            eprintln!("{e}");
            return ExitCode::from(2);
        }
    };
    let read = |p: &str| std::fs::read(p).map_err(|e| format!("{p}: {e}"));
    let (base, new) = match (read(base), read(new)) {
        (Ok(b), Ok(n)) if b.len() == n.len() => (b, n),
        (Ok(b), Ok(n)) => {
            eprintln!("the files differ in length: {} and {} bytes", b.len(), n.len());
            return ExitCode::from(2);
        }
        (Err(e), _) | (_, Err(e)) => {
            eprintln!("{e}");
            return ExitCode::from(2);
        }
    };
    let best = |f: &mut dyn FnMut() -> Duration| (0..reps).map(|_| f()).min().unwrap_or_default();
    // The base as a delta run keeps it: with its name (a dense message's:
    // its CRC-32C).
    let base = KeptMessage::new(base);
    let mut encoded = Vec::new();
    // The previous rep's result is freed before the clock starts: the
    // time is the codec's, not the system's unmapping of the last result.
    let encode_time = best(&mut || {
        encoded = Vec::new();
        let t = Instant::now();
        encoded = encode_kept(Some(&base), &new, unit).0;
        t.elapsed()
    });
    let mut decoded = Ok(KeptMessage::default());
    let decode_time = best(&mut || {
        let b = base.clone();
        decoded = Ok(KeptMessage::default());
        let t = Instant::now();
        decoded = decode_kept(Some(b), &encoded, unit, new.len() as u64);
        t.elapsed()
    });
    let mut copy = vec![0u8; new.len()];
    let copy_time = best(&mut || {
        let t = Instant::now();
        copy.copy_from_slice(std::hint::black_box(&new));
        std::hint::black_box(&copy);
        t.elapsed()
    });
    let exact = matches!(&decoded, Ok(d) if d.bytes() == new);
    let rate = |d: Duration| new.len() as f64 / d.as_secs_f64().max(1e-9) / 1e9;
    println!(
        "{{\"bytes\": {}, \"encoded_bytes\": {}, \"form\": \"{}\", \"encode_gbps\": {:.3}, \"decode_gbps\": {:.3}, \"copy_gbps\": {:.3}, \"exact\": {exact}}}",
        new.len(),
        encoded.len(),
        form(&encoded),
        rate(encode_time),
        rate(decode_time),
        rate(copy_time)
    );
    if exact {
        ExitCode::SUCCESS
    } else {
        eprintln!("decoded wrong: {:?}", decoded.err());
        ExitCode::FAILURE
    }
}
