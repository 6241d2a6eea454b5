//! A message left on its byte stream for the receiving executor to read
//! straight into its destination spans ([`Payload::Stream`]): no frame
//! buffer, no second copy. Any transport whose messages arrive on a
//! stream with a file descriptor (TCP today) hands them on this way; the
//! executor knows only this type, not the transport.
//!
//! [`Payload::Stream`]: crate::Payload::Stream

use std::io;
use std::os::fd::RawFd;
use std::sync::Arc;

/// A stream a frame is read from: one with a file descriptor, read
/// through a shared reference (as `&TcpStream` is).
pub(crate) trait FrameStream: Send + Sync {
    /// Fills `buf` from the stream.
    fn read_exact(&self, buf: &mut [u8]) -> io::Result<()>;
    /// The stream's descriptor, for `readv`.
    fn raw_fd(&self) -> RawFd;
}

impl FrameStream for std::net::TcpStream {
    fn read_exact(&self, buf: &mut [u8]) -> io::Result<()> {
        io::Read::read_exact(&mut &*self, buf)
    }

    fn raw_fd(&self) -> RawFd {
        std::os::fd::AsRawFd::as_raw_fd(self)
    }
}

/// Most runs one `readv` takes.
const IOV_BATCH: usize = 512;

/// A data frame left on its stream for the receiving executor to read
/// straight into its destination spans. The stream's reader thread waits until the
/// frame is dropped, then skips whatever was not read, so frames after it
/// on that stream (later rounds: a sender's frames travel in round order)
/// wait too, held back by TCP's own flow control. Frames with checksums
/// are never left on the stream: they are checked before any byte of
/// them reaches a destination.
pub struct StreamFrame {
    stream: Arc<dyn FrameStream>,
    len: u64,
    read: u64,
    done: Option<std::sync::mpsc::SyncSender<u64>>,
}

impl std::fmt::Debug for StreamFrame {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StreamFrame").field("len", &self.len).field("read", &self.read).finish()
    }
}

impl StreamFrame {
    /// A frame of `len` bytes next on `stream`; when dropped it reports on
    /// `done` how many bytes were read (the stream's reader skips the rest).
    pub(crate) fn new(stream: Arc<dyn FrameStream>, len: u64, done: std::sync::mpsc::SyncSender<u64>) -> StreamFrame {
        StreamFrame { stream, len, read: 0, done: Some(done) }
    }

    /// Bytes of the frame's payload.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Whether the payload is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Bytes not read yet.
    pub fn left(&self) -> u64 {
        self.len - self.read
    }

    /// Fills `buf` with the next bytes of the payload.
    pub fn read_exact(&mut self, buf: &mut [u8]) -> io::Result<()> {
        if buf.len() as u64 > self.left() {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, "read past the end of the frame"));
        }
        self.stream.read_exact(buf)?;
        self.read += buf.len() as u64;
        Ok(())
    }

    /// Reads the next bytes of the payload into the `(pointer, length)`
    /// runs of `runs`, in order (gathered by `readv`).
    ///
    /// # Safety
    /// Every run must be valid for writes of its length, and nothing else
    /// may access those bytes during the call.
    pub(crate) unsafe fn read_runs(&mut self, runs: &mut [libc::iovec]) -> io::Result<()> {
        let total: u64 = runs.iter().map(|v| v.iov_len as u64).sum();
        if total > self.left() {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, "read past the end of the frame"));
        }
        let fd = self.stream.raw_fd();
        let mut first = 0;
        while first < runs.len() {
            let n = runs.len() - first;
            // SAFETY: the iovecs name memory valid for writes (the caller's
            // contract); `fd` is this frame's open stream.
            let got = unsafe { libc::readv(fd, runs[first..].as_ptr(), n.min(IOV_BATCH) as libc::c_int) };
            if got < 0 {
                let e = io::Error::last_os_error();
                if e.kind() == io::ErrorKind::Interrupted {
                    continue;
                }
                return Err(e);
            }
            if got == 0 {
                return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "connection closed in a frame"));
            }
            let mut got = got as usize;
            self.read += got as u64;
            while got > 0 && first < runs.len() {
                let v = &mut runs[first];
                if got >= v.iov_len {
                    got -= v.iov_len;
                    first += 1;
                } else {
                    // SAFETY: still inside the run.
                    v.iov_base = unsafe { (v.iov_base as *mut u8).add(got) } as *mut libc::c_void;
                    v.iov_len -= got;
                    got = 0;
                }
            }
            while first < runs.len() && runs[first].iov_len == 0 {
                first += 1;
            }
        }
        Ok(())
    }
}

impl Drop for StreamFrame {
    /// Hands the stream back to its reader, which skips what was not read.
    fn drop(&mut self) {
        if let Some(done) = self.done.take() {
            let _ = done.send(self.read);
        }
    }
}
