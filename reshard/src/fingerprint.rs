//! Stable 64-bit fingerprints of layouts and plan options, so that ranks can
//! prove they computed the same plan.

use std::fmt;
use std::hash::{Hash, Hasher};

/// A fingerprint of both layouts and the plan options.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize, serde::Deserialize)]
pub struct Fingerprint(pub u64);

impl fmt::Display for Fingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:016x}", self.0)
    }
}

/// A stable 64-bit hasher: FNV-1a's constants applied a little-endian word
/// at a time (8x faster than byte-wise FNV on the large rank lists of model
/// layouts). Stable across runs, processes and platforms, unlike std's
/// `DefaultHasher`, whose algorithm may change between Rust releases.
#[derive(Clone, Debug)]
pub(crate) struct Fnv64(u64);

impl Default for Fnv64 {
    fn default() -> Self {
        Fnv64(0xcbf2_9ce4_8422_2325)
    }
}

impl Fnv64 {
    fn mix(&mut self, w: u64) {
        self.0 = (self.0 ^ w).wrapping_mul(0x0100_0000_01b3).rotate_left(29);
    }
}

impl Hasher for Fnv64 {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        let mut chunks = bytes.chunks_exact(8);
        for c in &mut chunks {
            let w = u64::from_le_bytes([c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]]);
            self.mix(w);
        }
        let rest = chunks.remainder();
        if !rest.is_empty() {
            let mut w = [0u8; 8];
            w[..rest.len()].copy_from_slice(rest);
            self.mix(u64::from_le_bytes(w) ^ ((rest.len() as u64) << 56));
        }
    }

    // Fixed-width, little-endian integer encodings so the value does not
    // depend on the platform's pointer width or endianness.
    fn write_usize(&mut self, i: usize) {
        self.write(&(i as u64).to_le_bytes());
    }

    fn write_u64(&mut self, i: u64) {
        self.write(&i.to_le_bytes());
    }

    fn write_u32(&mut self, i: u32) {
        self.write(&i.to_le_bytes());
    }
}

/// A map hashed with [`Fnv64`]: a few multiplies per small key where std's
/// SipHash costs tens of cycles, for the maps of small integer keys that
/// deriving thousands of rank programs fills and reads (keys that follow
/// from validated layouts, not chosen to collide).
pub(crate) type FnvMap<K, V> = std::collections::HashMap<K, V, std::hash::BuildHasherDefault<Fnv64>>;

/// Hashes any `Hash` value with a stable 64-bit hasher (FNV-1a's constants, a
/// word at a time): the same value gives the same hash on every machine.
pub fn fnv64<T: Hash + ?Sized>(value: &T) -> u64 {
    let mut h = Fnv64::default();
    value.hash(&mut h);
    h.finish()
}
