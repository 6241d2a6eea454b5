//! [`Secret`]: the shared key every node of a deployment authenticates with.

use std::fmt;
use std::path::{Path, PathBuf};

use thiserror::Error;

/// Minimum length of a secret, in bytes.
pub const MIN_SECRET_LEN: usize = 16;

/// The shared secret nodes prove knowledge of when they connect (HMAC-SHA256
/// challenge–response; see the [module docs](crate::remote)).
///
/// Its `Debug` and `Display` never show the bytes, and its errors name where
/// it came from (file, variable) but never what it contains. Leading and
/// trailing ASCII whitespace is trimmed when reading a file or variable (so a
/// trailing newline does not matter); at least [`MIN_SECRET_LEN`] bytes must
/// remain.
#[derive(Clone)]
pub struct Secret {
    bytes: Vec<u8>,
}

impl Secret {
    /// A secret from raw bytes (at least [`MIN_SECRET_LEN`]).
    pub fn from_bytes(bytes: impl Into<Vec<u8>>) -> Result<Self, SecretError> {
        Self::checked(bytes.into(), || "the given bytes".to_owned())
    }

    /// Reads a secret from a file.
    pub fn from_file(path: impl AsRef<Path>) -> Result<Self, SecretError> {
        let path = path.as_ref();
        let bytes = std::fs::read(path).map_err(|source| SecretError::File { path: path.to_owned(), source })?;
        Self::checked(trim(&bytes).to_vec(), || format!("file {}", path.display()))
    }

    /// Reads a secret from an environment variable, e.g. `REFIT_SECRET`.
    pub fn from_env(var: &str) -> Result<Self, SecretError> {
        let value = std::env::var_os(var).ok_or_else(|| SecretError::EnvMissing { var: var.to_owned() })?;
        let value = value.into_string().map_err(|_| SecretError::EnvNotUnicode { var: var.to_owned() })?;
        Self::checked(trim(value.as_bytes()).to_vec(), || format!("environment variable {var}"))
    }

    fn checked(bytes: Vec<u8>, origin: impl FnOnce() -> String) -> Result<Self, SecretError> {
        if bytes.len() < MIN_SECRET_LEN {
            return Err(SecretError::TooShort { origin: origin(), len: bytes.len(), min: MIN_SECRET_LEN });
        }
        Ok(Self { bytes })
    }

    pub(crate) fn expose(&self) -> &[u8] {
        &self.bytes
    }
}

fn trim(bytes: &[u8]) -> &[u8] {
    let start = bytes.iter().position(|b| !b.is_ascii_whitespace()).unwrap_or(bytes.len());
    let end = bytes.iter().rposition(|b| !b.is_ascii_whitespace()).map_or(start, |i| i + 1);
    bytes.get(start..end).unwrap_or(&[])
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Secret(<redacted>)")
    }
}

impl fmt::Display for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("<redacted secret>")
    }
}

/// Why a [`Secret`] could not be obtained. Names the source, never the content.
#[derive(Debug, Error)]
pub enum SecretError {
    /// The file could not be read.
    #[error("cannot read secret file {}: {source}", path.display())]
    File {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    /// The environment variable is not set.
    #[error("environment variable {var} (the shared secret) is not set")]
    EnvMissing {
        /// The variable.
        var: String,
    },
    /// The environment variable is not valid Unicode.
    #[error("environment variable {var} (the shared secret) is not valid Unicode")]
    EnvNotUnicode {
        /// The variable.
        var: String,
    },
    /// The secret is shorter than [`MIN_SECRET_LEN`] bytes (after trimming).
    #[error("the secret from {origin} is too short: {len} bytes, need at least {min}")]
    TooShort {
        /// Where it came from, e.g. `file /etc/refit/secret`.
        origin: String,
        /// Its length.
        len: usize,
        /// The minimum.
        min: usize,
    },
}
