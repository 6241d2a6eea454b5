//! Bytes written for people, the one way every crate writes them (the
//! command line, reports, and the data plane's error texts).

/// Bytes in binary units: `512 B`, `13.50 KiB`, `16.00 MiB`, `1.25 GiB`.
pub fn human(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = bytes as f64;
    let mut u = 0;
    while v >= 1024.0 && u < UNITS.len() - 1 {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{bytes} B")
    } else {
        format!("{v:.2} {}", UNITS[u])
    }
}

#[cfg(test)]
mod tests {
    use super::human;

    #[test]
    fn bytes_in_binary_units() {
        for (bytes, want) in
            [(0, "0 B"), (1023, "1023 B"), (1024, "1.00 KiB"), (13_824, "13.50 KiB"), (16 << 20, "16.00 MiB"), (5 << 40, "5.00 TiB")]
        {
            assert_eq!(human(bytes), want);
        }
    }
}
