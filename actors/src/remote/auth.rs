//! The mutual HMAC-SHA256 challenge–response handshake and the session keys
//! it derives.

use hmac::Mac;
use serde::{Deserialize, Serialize};
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt};
use uuid::Uuid;

use super::error::RemoteError;
use super::secret::Secret;
use super::wire::{read_frame, HmacSha256, ReadError, TAG_LEN};
use crate::codec;

/// Protocol version spoken by this build.
pub const PROTOCOL_VERSION: u16 = 1;

/// Marks a refit remote connection.
const MAGIC: [u8; 8] = *b"refit-rm";

/// Largest handshake frame accepted (before authentication nothing bigger
/// is read).
pub(crate) const MAX_HANDSHAKE_FRAME: usize = 256;

/// Nonce length: two v4 UUIDs (244 random bits).
const NONCE_LEN: usize = 32;

type Nonce = [u8; NONCE_LEN];
type Tag = [u8; TAG_LEN];

/// Handshake messages, one per frame, in this order.
#[derive(Debug, Serialize, Deserialize)]
enum Handshake {
    /// Client → server.
    Hello { magic: [u8; 8], version: u16, nonce: Nonce },
    /// Server → client.
    Challenge { version: u16, nonce: Nonce },
    /// Client → server: the client's proof.
    Proof { mac: Tag },
    /// Server → client: the server's proof.
    Accepted { mac: Tag },
    /// Server → client: the client's proof did not verify.
    Rejected,
}

/// Keys for the per-frame tags of each direction.
pub(crate) struct SessionKeys {
    pub(crate) send: HmacSha256,
    pub(crate) recv: HmacSha256,
}

#[derive(Clone, Copy)]
enum Role {
    Client,
    Server,
}

impl Role {
    fn label(self) -> &'static [u8] {
        match self {
            Role::Client => b"client",
            Role::Server => b"server",
        }
    }
}

fn nonce() -> Nonce {
    let mut nonce = [0u8; NONCE_LEN];
    nonce[..16].copy_from_slice(Uuid::new_v4().as_bytes());
    nonce[16..].copy_from_slice(Uuid::new_v4().as_bytes());
    nonce
}

fn keyed(secret: &[u8]) -> HmacSha256 {
    // HMAC takes keys of any length; this cannot fail.
    HmacSha256::new_from_slice(secret).unwrap_or_else(|_| unreachable_hmac())
}

#[cold]
fn unreachable_hmac() -> HmacSha256 {
    // `new_from_slice` only rejects key lengths for fixed-key MACs.
    <HmacSha256 as Mac>::new(&Default::default())
}

/// HMAC(secret, "refit-remote/v1/" ‖ what ‖ label ‖ client nonce ‖ server nonce).
fn mac(secret: &Secret, what: &[u8], label: &[u8], client: &Nonce, server: &Nonce) -> HmacSha256 {
    let mut mac = keyed(secret.expose());
    mac.update(b"refit-remote/v1/");
    mac.update(what);
    mac.update(b"/");
    mac.update(label);
    mac.update(client);
    mac.update(server);
    mac
}

fn proof(secret: &Secret, role: Role, client: &Nonce, server: &Nonce) -> Tag {
    mac(secret, b"proof", role.label(), client, server).finalize().into_bytes().into()
}

fn verify(secret: &Secret, role: Role, client: &Nonce, server: &Nonce, received: &Tag) -> bool {
    mac(secret, b"proof", role.label(), client, server).verify_slice(received).is_ok()
}

fn session_keys(secret: &Secret, me: Role, client: &Nonce, server: &Nonce) -> SessionKeys {
    let key = |sender: Role| -> HmacSha256 {
        let key: Tag = mac(secret, b"frame-key", sender.label(), client, server).finalize().into_bytes().into();
        keyed(&key)
    };
    let other = match me {
        Role::Client => Role::Server,
        Role::Server => Role::Client,
    };
    SessionKeys { send: key(me), recv: key(other) }
}

async fn send<W: AsyncWrite + Unpin>(w: &mut W, msg: &Handshake, peer: &str) -> Result<(), RemoteError> {
    let payload = codec::encode_with_max(msg, MAX_HANDSHAKE_FRAME).map_err(|e| RemoteError::handshake(peer, e))?;
    let mut frame = Vec::new();
    codec::write_frame(&mut frame, &payload, MAX_HANDSHAKE_FRAME).map_err(|e| RemoteError::handshake(peer, e))?;
    w.write_all(&frame).await.map_err(|e| RemoteError::handshake_cut(peer, format!("write failed: {e}")))?;
    w.flush().await.map_err(|e| RemoteError::handshake_cut(peer, format!("write failed: {e}")))
}

async fn recv<R: AsyncRead + Unpin>(r: &mut R, peer: &str) -> Result<Handshake, RemoteError> {
    let payload = read_frame(r, MAX_HANDSHAKE_FRAME).await.map_err(|e| match e {
        ReadError::Eof => RemoteError::handshake_cut(peer, "connection closed during the handshake"),
        cut @ (ReadError::Truncated | ReadError::Io(_)) => RemoteError::handshake_cut(peer, cut),
        other => RemoteError::handshake(peer, other),
    })?;
    codec::decode_with_max(&payload, MAX_HANDSHAKE_FRAME)
        .map_err(|e| RemoteError::handshake(peer, format!("undecodable handshake frame: {e}")))
}

fn unexpected(peer: &str, got: &Handshake, expected: &str) -> RemoteError {
    let got = match got {
        Handshake::Hello { .. } => "Hello",
        Handshake::Challenge { .. } => "Challenge",
        Handshake::Proof { .. } => "Proof",
        Handshake::Accepted { .. } => "Accepted",
        Handshake::Rejected => "Rejected",
    };
    RemoteError::handshake(peer, format!("expected a {expected} handshake frame, got {got}"))
}

/// Runs the client side of the handshake.
pub(crate) async fn client<S: AsyncRead + AsyncWrite + Unpin>(
    stream: &mut S,
    secret: &Secret,
    peer: &str,
) -> Result<SessionKeys, RemoteError> {
    let client_nonce = nonce();
    send(stream, &Handshake::Hello { magic: MAGIC, version: PROTOCOL_VERSION, nonce: client_nonce }, peer).await?;
    let server_nonce = match recv(stream, peer).await? {
        Handshake::Challenge { version, nonce } if version == PROTOCOL_VERSION => nonce,
        Handshake::Challenge { version, .. } => {
            return Err(RemoteError::handshake(peer, format!("server speaks protocol version {version}, we speak {PROTOCOL_VERSION}")))
        }
        other => return Err(unexpected(peer, &other, "Challenge")),
    };
    let mac = proof(secret, Role::Client, &client_nonce, &server_nonce);
    send(stream, &Handshake::Proof { mac }, peer).await?;
    match recv(stream, peer).await {
        Ok(Handshake::Accepted { mac }) if verify(secret, Role::Server, &client_nonce, &server_nonce, &mac) => {
            Ok(session_keys(secret, Role::Client, &client_nonce, &server_nonce))
        }
        Ok(Handshake::Accepted { .. }) => {
            Err(RemoteError::AuthFailed { peer: peer.to_owned(), why: "the server could not prove it knows the secret".to_owned() })
        }
        Ok(Handshake::Rejected) => {
            Err(RemoteError::AuthFailed { peer: peer.to_owned(), why: "the server rejected our proof (the secrets differ)".to_owned() })
        }
        Ok(other) => Err(unexpected(peer, &other, "Accepted")),
        Err(err) => Err(err),
    }
}

/// What the server learnt from a client's `Hello`.
pub(crate) struct Hello {
    client_nonce: Nonce,
}

/// The server side's first step: reads and checks the client's `Hello`
/// (an honest client sends it right after connecting).
pub(crate) async fn server_hello<S: AsyncRead + Unpin>(stream: &mut S, peer: &str) -> Result<Hello, RemoteError> {
    match recv(stream, peer).await? {
        Handshake::Hello { magic, version, nonce } if magic == MAGIC && version == PROTOCOL_VERSION => Ok(Hello { client_nonce: nonce }),
        Handshake::Hello { magic, version, .. } if magic == MAGIC => {
            Err(RemoteError::handshake(peer, format!("client speaks protocol version {version}, we speak {PROTOCOL_VERSION}")))
        }
        Handshake::Hello { .. } => Err(RemoteError::handshake(peer, "bad magic in Hello")),
        other => Err(unexpected(peer, &other, "Hello")),
    }
}

/// The rest of the server side, after [`server_hello`]: challenge, check
/// the client's proof, prove the secret back.
pub(crate) async fn server_finish<S: AsyncRead + AsyncWrite + Unpin>(
    stream: &mut S,
    secret: &Secret,
    peer: &str,
    hello: Hello,
) -> Result<SessionKeys, RemoteError> {
    let client_nonce = hello.client_nonce;
    let server_nonce = nonce();
    send(stream, &Handshake::Challenge { version: PROTOCOL_VERSION, nonce: server_nonce }, peer).await?;
    match recv(stream, peer).await? {
        Handshake::Proof { mac } if verify(secret, Role::Client, &client_nonce, &server_nonce, &mac) => {}
        Handshake::Proof { .. } => {
            // Best effort: the client learns why; it is dropped either way.
            let _ = send(stream, &Handshake::Rejected, peer).await;
            return Err(RemoteError::AuthFailed {
                peer: peer.to_owned(),
                why: "the client's proof does not verify (wrong secret)".to_owned(),
            });
        }
        other => return Err(unexpected(peer, &other, "Proof")),
    }
    let mac = proof(secret, Role::Server, &client_nonce, &server_nonce);
    send(stream, &Handshake::Accepted { mac }, peer).await?;
    Ok(session_keys(secret, Role::Server, &client_nonce, &server_nonce))
}
