//! A refit's result written out for anyone to check: every destination
//! rank's buffers as raw files (`refit run --dump-dst DIR`).
//!
//! Layout of `DIR`: one folder per destination rank, `rank<r>/`, holding
//! one file per buffer of that rank (its raw little-endian bytes in the
//! buffer's dtype, named after the buffer: characters other than ASCII
//! letters, digits, `_`, `-` and a `.` that does not start the name are
//! written `%XX`, byte by byte) and `index.json`:
//!
//! ```json
//! {"rank": 0, "buffers": [{"name": "w", "file": "w.bin", "dtype": "bf16", "bytes": 64}]}
//! ```
//!
//! Only the buffers the destination layout gives the rank are written.

use reshard::Layout;
use serde_json::json;
use std::path::{Path, PathBuf};

/// Writing a dump failed.
#[derive(Debug, thiserror::Error)]
pub enum DumpError {
    /// A file or folder could not be written.
    #[error("{path}: {error}")]
    Io {
        /// What was being written.
        path: PathBuf,
        /// Why it failed.
        error: std::io::Error,
    },
    /// The memory given is not the destination layout's.
    #[error("destination rank {rank}: {problem}")]
    Mismatch {
        /// The rank.
        rank: u32,
        /// What does not match.
        problem: String,
    },
}

/// The file name a buffer is written to (without `.bin`).
pub fn file_stem(name: &str) -> String {
    let mut out = String::with_capacity(name.len());
    for (i, b) in name.bytes().enumerate() {
        let keep = b.is_ascii_alphanumeric() || b == b'_' || b == b'-' || (b == b'.' && i > 0);
        if keep {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    if out.is_empty() {
        out.push('%');
    }
    out
}

/// Writes every destination rank's buffers (`memory[r]` is rank `r`'s,
/// in the layout's buffer order) under `dir`; returns the bytes written.
pub fn dump_destinations(dir: &Path, dst: &Layout, memory: &[&[Vec<u8>]]) -> Result<u64, DumpError> {
    if memory.len() != dst.ranks() as usize {
        return Err(DumpError::Mismatch { rank: 0, problem: format!("{} ranks of memory for a layout of {}", memory.len(), dst.ranks()) });
    }
    let io = |path: &Path| {
        let path = path.to_path_buf();
        move |error| DumpError::Io { path, error }
    };
    let mut total = 0u64;
    for (rank, mem) in memory.iter().enumerate() {
        let rank = rank as u32;
        let folder = dir.join(format!("rank{rank}"));
        std::fs::create_dir_all(&folder).map_err(io(&folder))?;
        let specs = dst.rank_buffers(rank);
        if mem.len() < specs.len() {
            return Err(DumpError::Mismatch {
                rank,
                problem: format!("{} buffers in memory, the layout gives {}", mem.len(), specs.len()),
            });
        }
        let mut index = Vec::with_capacity(specs.len());
        for (spec, bytes) in specs.iter().zip(mem.iter()) {
            let want = spec.elems * spec.dtype.size();
            if bytes.len() as u64 != want {
                return Err(DumpError::Mismatch {
                    rank,
                    problem: format!("buffer '{}' holds {} bytes, the layout gives it {want}", spec.name, bytes.len()),
                });
            }
            let file = format!("{}.bin", file_stem(&spec.name));
            let path = folder.join(&file);
            std::fs::write(&path, bytes).map_err(io(&path))?;
            total += want;
            index.push(json!({"name": spec.name, "file": file, "dtype": spec.dtype.to_string(), "bytes": want}));
        }
        let path = folder.join("index.json");
        let text = json!({"rank": rank, "buffers": index}).to_string();
        std::fs::write(&path, text + "\n").map_err(io(&path))?;
    }
    Ok(total)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn file_names_are_safe_and_distinct() {
        let cases = [
            ("model.layers.0.qkv_proj.weight", "model.layers.0.qkv_proj.weight"),
            ("a/b", "a%2Fb"),
            ("..", "%2E."),
            (".hidden", "%2Ehidden"),
            ("50%", "50%25"),
            ("", "%"),
            ("é", "%C3%A9"),
        ];
        for (name, stem) in cases {
            assert_eq!(file_stem(name), stem, "{name:?}");
        }
        // Escaping is one to one: '%' itself is escaped.
        assert_ne!(file_stem("a%2Fb"), file_stem("a/b"));
    }
}
