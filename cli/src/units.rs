//! How the command line and the traffic drawings write quantities for
//! people: bytes in binary units, durations in the unit that reads at a
//! glance, transfer rates in GiB/s, counts with their noun.

use std::time::Duration;

pub use reshard::human;

/// A duration for people: under a second in milliseconds to three
/// significant digits (`0.0201 ms`, `0.759 ms`, `81.9 ms`, `241 ms`), then
/// `1.234 s` under 10 s, `12.3 s` under a minute, and `4m 01s` from there.
pub fn duration(d: Duration) -> String {
    let s = d.as_secs_f64();
    // Each bound is where the shorter form would round up to the next unit.
    match s * 1e3 {
        0.0 => "0 ms".into(),
        ms if ms < 0.9995 => {
            let decimals = (2 - ms.log10().floor() as i32).clamp(3, 9) as usize;
            format!("{ms:.decimals$} ms")
        }
        ms if ms < 9.995 => format!("{ms:.2} ms"),
        ms if ms < 99.95 => format!("{ms:.1} ms"),
        ms if ms < 999.5 => format!("{ms:.0} ms"),
        _ if s < 9.9995 => format!("{s:.3} s"),
        _ if s < 59.95 => format!("{s:.1} s"),
        _ => {
            let whole = s.round() as u64;
            format!("{}m {:02}s", whole / 60, whole % 60)
        }
    }
}

/// [`duration`] of a modelled or derived number of seconds; `-` where it is
/// not a time (NaN, infinite, or beyond `Duration`'s range).
pub fn seconds(s: f64) -> String {
    match Duration::try_from_secs_f64(s.max(0.0)) {
        Ok(d) if !s.is_nan() => duration(d),
        _ => "-".into(),
    }
}

/// `1 node`, `2 nodes`.
pub fn plural(n: impl Into<u64>, word: &str) -> String {
    match n.into() {
        1 => format!("1 {word}"),
        n => format!("{n} {word}s"),
    }
}

/// A transfer rate in GiB/s (2^30 bytes per second), as every command prints it.
pub fn rate(bytes: u64, d: Duration) -> String {
    format!("{:.2} GiB/s", bytes as f64 / d.as_secs_f64().max(1e-12) / (1u64 << 30) as f64)
}

#[cfg(test)]
mod tests {
    use super::{duration, seconds};
    use std::time::Duration;

    #[test]
    fn durations_read_at_a_glance() {
        let cases = [
            (0.0, "0 ms"),
            (0.000_000_3, "0.000300 ms"),
            (0.000_012, "0.0120 ms"),
            (0.000_020_14, "0.0201 ms"),
            (0.000_759, "0.759 ms"),
            (0.003_21, "3.21 ms"),
            (0.081_94, "81.9 ms"),
            (0.240_967, "241 ms"),
            (0.999_4, "999 ms"),
            (0.999_6, "1.000 s"),
            (1.234_4, "1.234 s"),
            (9.999_6, "10.0 s"),
            (12.34, "12.3 s"),
            (59.94, "59.9 s"),
            (59.96, "1m 00s"),
            (240.967_065, "4m 01s"),
            (600.0, "10m 00s"),
            (725.4, "12m 05s"),
            (3_725.0, "62m 05s"),
        ];
        for (secs, want) in cases {
            assert_eq!(duration(Duration::from_secs_f64(secs)), want, "{secs} s");
            assert_eq!(seconds(secs), want, "{secs} s");
        }
        for bad in [f64::NAN, f64::INFINITY, 1e300] {
            assert_eq!(seconds(bad), "-", "{bad}");
        }
        assert_eq!(seconds(-1.0), "0 ms");
    }
}
