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

    /// Reads a secret from a file (see [`read_secret_file`]).
    pub fn from_file(path: impl AsRef<Path>) -> Result<Self, SecretError> {
        let path = path.as_ref();
        let bytes = Wiped(read_secret_file(path)?);
        Self::checked(trim(&bytes.0).to_vec(), || format!("file {}", path.display()))
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

    /// A 32-byte key for another use of this secret, named by `label`
    /// (HMAC-SHA256 of the label under the secret): e.g. the data plane's
    /// handshake key of one session. Keys for different labels tell nothing
    /// about each other or the secret.
    pub fn derive(&self, label: &[u8]) -> [u8; 32] {
        use hmac::Mac;
        let mut mac = <hmac::Hmac<sha2::Sha256> as hmac::digest::KeyInit>::new_from_slice(&self.bytes)
            .unwrap_or_else(|_| unreachable!("HMAC takes any key length"));
        mac.update(b"refit-remote/v1/derive/");
        mac.update(label);
        mac.finalize().into_bytes().into()
    }

    /// A fresh random secret (256 bits from the operating system's
    /// generator), e.g. for members that all live in one process.
    pub fn random() -> Result<Self, SecretError> {
        let mut bytes = vec![0u8; 32];
        std::fs::File::open("/dev/urandom")
            .and_then(|mut f| std::io::Read::read_exact(&mut f, &mut bytes))
            .map_err(|source| SecretError::File { path: PathBuf::from("/dev/urandom"), source })?;
        Ok(Self { bytes })
    }
}

impl Drop for Secret {
    fn drop(&mut self) {
        wipe(&mut self.bytes);
    }
}

/// Overwrites `bytes` with zeros before they are freed (best effort: copies
/// made while the bytes were read are not reached).
pub fn wipe(bytes: &mut [u8]) {
    bytes.fill(0);
    // Keeps the writes: the compiler may not drop stores to memory that is
    // read afterwards.
    std::hint::black_box(&*bytes);
}

/// Bytes wiped when dropped.
struct Wiped(Vec<u8>);

impl Drop for Wiped {
    fn drop(&mut self) {
        wipe(&mut self.0);
    }
}

/// Reads a secret file's bytes, refusing a file that other users may read
/// or write (mode bits `0o077`, as ssh does for private keys) or that is
/// not a regular file; the error names the file and its mode, never the
/// content.
pub fn read_secret_file(path: &Path) -> Result<Vec<u8>, SecretError> {
    use std::os::unix::fs::PermissionsExt;
    let file = |source| SecretError::File { path: path.to_owned(), source };
    let meta = std::fs::metadata(path).map_err(file)?;
    if !meta.is_file() {
        return Err(SecretError::NotAFile { path: path.to_owned() });
    }
    let mode = meta.permissions().mode() & 0o777;
    if mode & 0o077 != 0 {
        return Err(SecretError::Exposed { path: path.to_owned(), mode });
    }
    std::fs::read(path).map_err(file)
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
    /// The file is not a regular file.
    #[error("secret file {} is not a regular file", path.display())]
    NotAFile {
        /// The file.
        path: PathBuf,
    },
    /// Other users may read or write the file.
    #[error("secret file {} is open to other users (mode {mode:03o}): make it readable by its owner only (chmod 600)", path.display())]
    Exposed {
        /// The file.
        path: PathBuf,
        /// Its permission bits.
        mode: u32,
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
