//! Framed writes: one data frame on a TCP stream, its runs gathered by
//! `writev` straight from the sender's memory (short runs and column
//! slices packed into a per-rank stage), paced and checksummed.

use crate::copy::{copy_strided_unfenced, for_each_run, packed_strides, StridedRef};
use crate::frame::{for_payload_items, for_payload_runs, header, payload_len, Item, DATA, SHORT_RUN};
use crate::link::{TokenBucket, PACE_CHUNK};
use crate::transport::Payload;
use std::io::{self, BufWriter, Write};
use std::net::TcpStream;

/// Writes one data frame on a TCP stream: header, runs gathered by writev
/// straight from the sender's memory (short runs copied into `stage` and
/// written with their neighbours as one slice), checksum trailer.
pub(super) fn write_tcp(
    w: &mut BufWriter<TcpStream>,
    stage: &mut Vec<u8>,
    round: u32,
    payload: &Payload,
    checksum: bool,
    corrupt: bool,
    mut bucket: Option<&mut TokenBucket>,
) -> io::Result<()> {
    let len = payload_len(payload);
    if matches!(payload, Payload::Pieces(sent) if sent.leaves_conversion()) {
        // (Never sent here: `converts_on_send` says no for a TCP stream.)
        return Err(io::Error::new(io::ErrorKind::InvalidInput, "pieces left to convert cannot go out as bytes"));
    }
    if corrupt {
        // Fault injection: gather, sum, then flip a byte (or the sum).
        let mut bytes = Vec::with_capacity(len as usize);
        // SAFETY: the executor's contract (see `Transport::send`).
        unsafe { for_payload_runs(payload, |r| bytes.extend_from_slice(r))? };
        let mut sum = crc32c::crc32c(&bytes);
        match bytes.get_mut(len as usize / 2) {
            Some(b) => *b ^= 0x40,
            None => sum ^= 1,
        }
        w.write_all(&header(DATA, round, len))?;
        w.write_all(&bytes)?;
        if checksum {
            w.write_all(&sum.to_le_bytes())?;
        }
        return w.flush();
    }
    // Whatever `w` buffered goes first (usually nothing: no system call);
    // the header then travels in the payload's first `writev`, not in a
    // segment of its own.
    w.flush()?;
    let stream = w.get_mut();
    let piece = if bucket.is_some() { PACE_CHUNK as usize } else { usize::MAX };
    let mut gather = Gather::new(stage);
    gather.stage_bytes(&header(DATA, round, len));
    let mut sum = 0u32;
    let mut result = Ok(());
    let mut write = |g: &mut Gather<'_, '_>| {
        if let Some(b) = bucket.as_deref_mut() {
            b.pace(g.bytes as u64);
        }
        g.write(stream)
    };
    // Runs go to the socket as they lie in memory, gathered by writev (no
    // copy into a user-space buffer), except short ones: a writev slice
    // costs the kernel about as much as copying a few hundred bytes, so
    // runs under `COPY_RUN` are copied into the stage first, and a piece
    // of rows a few elements wide (a column slice) is packed into it by
    // one strided copy.
    // SAFETY: the executor's contract: the sender's memory is not written
    // while it sends, and the slices do not outlive this call.
    unsafe {
        for_payload_items(payload, SHORT_RUN, |item| {
            if result.is_err() {
                return;
            }
            match item {
                Item::Run(run) => {
                    for part in run.chunks(piece) {
                        if checksum {
                            sum = crc32c::crc32c_append(sum, part);
                        }
                        result = gather.add(part, piece, &mut write);
                        if result.is_err() {
                            return;
                        }
                    }
                }
                // SAFETY: an `Item::Short` view is in bounds of the
                // sender's memory, unwritten while it sends.
                Item::Short { counts, view } => {
                    result = gather.add_short(counts, &view, piece, &mut write, |packed| {
                        if checksum {
                            sum = crc32c::crc32c_append(sum, packed);
                        }
                    })
                }
                // (Refused above.)
                Item::Convert { .. } => {
                    result = Err(io::Error::new(io::ErrorKind::InvalidInput, "pieces left to convert cannot go out as bytes"))
                }
            }
        })?
    };
    result?;
    // The trailer goes with the last slices.
    if checksum {
        if gather.stage.len() + 4 > STAGE_BYTES {
            write(&mut gather)?;
        }
        gather.stage_bytes(&sum.to_le_bytes());
    }
    write(&mut gather)
}

/// Slices per `writev` call (below every system's IOV_MAX).
pub(super) const IOV_BATCH: usize = 512;

/// Runs shorter than this are copied into the sender's stage rather than
/// handed to `writev` one slice each (at 512 bytes and more the slice is
/// cheaper than the copy: Llama 3 8B / 8's rows of 512 bytes went 10%
/// slower staged).
const COPY_RUN: usize = SHORT_RUN as usize;

/// Size of a sender's stage (one per rank, reused by every frame).
const STAGE_BYTES: usize = 256 << 10;

/// The slices of one `writev`: runs of the sender's memory and ranges of
/// its stage, in wire order.
struct Gather<'s, 'a> {
    stage: &'s mut Vec<u8>,
    parts: Vec<Part<'a>>,
    /// Bytes gathered since the last write.
    bytes: usize,
}

enum Part<'a> {
    /// Bytes `from..to` of the stage.
    Staged(usize, usize),
    Mem(&'a [u8]),
}

impl<'s, 'a> Gather<'s, 'a> {
    fn new(stage: &'s mut Vec<u8>) -> Self {
        stage.clear();
        if stage.capacity() < STAGE_BYTES {
            stage.reserve_exact(STAGE_BYTES);
        }
        Gather { stage, parts: Vec::with_capacity(IOV_BATCH), bytes: 0 }
    }

    /// Adds `run`, calling `write` first if the stage has no room for it,
    /// and after if the batch is full or holds `flush_at` bytes.
    fn add(&mut self, run: &'a [u8], flush_at: usize, write: &mut impl FnMut(&mut Self) -> io::Result<()>) -> io::Result<()> {
        if run.len() < COPY_RUN && self.stage.len() + run.len() > STAGE_BYTES {
            write(self)?;
        }
        self.push(run);
        if self.parts.len() == IOV_BATCH || self.bytes >= flush_at {
            write(self)?;
        }
        Ok(())
    }

    /// Adds the elements of a piece of short runs (`counts` elements of
    /// `view`), packed into the stage by one strided copy, and shows `seen`
    /// the packed bytes; a piece larger than the stage goes run by run.
    ///
    /// # Safety
    /// `view` must be in bounds ([`crate::copy::in_bounds`]) of memory
    /// valid for reads and unwritten during the call.
    unsafe fn add_short(
        &mut self,
        counts: &[u64],
        view: &StridedRef,
        flush_at: usize,
        write: &mut impl FnMut(&mut Self) -> io::Result<()>,
        mut seen: impl FnMut(&[u8]),
    ) -> io::Result<()> {
        let len = (counts.iter().product::<u64>() * view.dtype.size()) as usize;
        if len > STAGE_BYTES {
            let mut result = Ok(());
            // SAFETY: the view is in bounds and its memory valid and
            // unwritten during the call (the caller's contract); each run
            // is copied into the stage before this call returns.
            unsafe {
                for_each_run(counts, view, |run| {
                    // Runs are shorter than `SHORT_RUN`, far below the stage.
                    if result.is_err() {
                        return;
                    }
                    seen(run);
                    if self.stage.len() + run.len() > STAGE_BYTES {
                        result = write(self);
                        if result.is_err() {
                            return;
                        }
                    }
                    self.bytes += run.len();
                    self.stage_bytes(run);
                    if self.parts.len() == IOV_BATCH || self.bytes >= flush_at {
                        result = write(self);
                    }
                })
            };
            return result;
        }
        if self.stage.len() + len > STAGE_BYTES {
            write(self)?;
        }
        let from = self.stage.len();
        debug_assert!(self.stage.capacity() - from >= len);
        // SAFETY: the stage has room for `len` more bytes (its capacity is
        // `STAGE_BYTES`, checked above), which the packed view covers
        // exactly; `view` is in bounds and unwritten during the call (the
        // caller's contract) and does not overlap the stage. Every byte is
        // written before the length covers it.
        unsafe {
            let to = StridedRef::new(self.stage.as_mut_ptr().add(from), len, 0, packed_strides(counts), view.dtype);
            copy_strided_unfenced(counts, view, &to);
            self.stage.set_len(from + len);
        }
        seen(&self.stage[from..]);
        self.bytes += len;
        self.note_staged(from);
        if self.parts.len() == IOV_BATCH || self.bytes >= flush_at {
            write(self)?;
        }
        Ok(())
    }

    /// Copies `run` to the end of the stage (which has room for it).
    fn stage_bytes(&mut self, run: &[u8]) {
        let from = self.stage.len();
        self.stage.extend_from_slice(run);
        self.note_staged(from);
    }

    /// Records that the stage grew from `from` to its length.
    fn note_staged(&mut self, from: usize) {
        match self.parts.last_mut() {
            Some(Part::Staged(_, to)) if *to == from => *to = self.stage.len(),
            _ => self.parts.push(Part::Staged(from, self.stage.len())),
        }
    }

    fn push(&mut self, run: &'a [u8]) {
        self.bytes += run.len();
        if run.len() >= COPY_RUN {
            self.parts.push(Part::Mem(run));
            return;
        }
        self.stage_bytes(run);
    }

    /// Writes what was gathered and starts over.
    fn write(&mut self, stream: &mut TcpStream) -> io::Result<()> {
        let mut slices: Vec<io::IoSlice<'_>> = self
            .parts
            .iter()
            .map(|p| match *p {
                Part::Staged(from, to) => io::IoSlice::new(&self.stage[from..to]),
                Part::Mem(m) => io::IoSlice::new(m),
            })
            .collect();
        let result = write_all_vectored(stream, &mut slices);
        self.parts.clear();
        self.stage.clear();
        self.bytes = 0;
        result
    }
}

/// Writes every slice, however many calls it takes.
fn write_all_vectored(stream: &mut TcpStream, bufs: &mut [io::IoSlice<'_>]) -> io::Result<()> {
    let mut bufs = bufs;
    io::IoSlice::advance_slices(&mut bufs, 0);
    while !bufs.is_empty() {
        match stream.write_vectored(bufs) {
            Ok(0) => return Err(io::Error::new(io::ErrorKind::WriteZero, "connection closed while sending")),
            Ok(n) => io::IoSlice::advance_slices(&mut bufs, n),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read;
    use std::net::TcpListener;

    /// A connected loopback stream, and the thread that reads everything
    /// sent on it until it closes.
    fn loopback() -> (TcpStream, std::thread::JoinHandle<Vec<u8>>) {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let reader = std::thread::spawn(move || {
            let (mut s, _) = listener.accept().unwrap();
            let mut got = Vec::new();
            s.read_to_end(&mut got).unwrap();
            got
        });
        (TcpStream::connect(addr).unwrap(), reader)
    }

    /// Short and long runs, staged and not, with writes forced by the
    /// stage, the batch and the byte limit: the stream carries exactly
    /// their bytes in order.
    #[test]
    fn gathered_runs_arrive_in_order() {
        let mut runs: Vec<Vec<u8>> = Vec::new();
        let lens = [1usize, 7, COPY_RUN - 1, COPY_RUN, 5, 3 * STAGE_BYTES, 2, 100];
        for k in 0..3000 {
            let len = lens[k % lens.len()] + k % 3;
            runs.push((0..len).map(|i| (i * 31 + k * 7) as u8).collect());
        }
        let want: Vec<u8> = runs.concat();
        let (mut stream, reader) = loopback();
        let mut stage = Vec::new();
        let mut writes = 0;
        for flush_at in [usize::MAX, 64 << 10] {
            let mut gather = Gather::new(&mut stage);
            let mut write = |g: &mut Gather<'_, '_>| {
                writes += 1;
                g.write(&mut stream)
            };
            for r in &runs {
                gather.add(r, flush_at, &mut write).unwrap();
            }
            write(&mut gather).unwrap();
        }
        drop(stream);
        let got = reader.join().unwrap();
        assert!(writes > 10, "{writes} writes");
        assert_eq!(got.len(), 2 * want.len());
        assert!(got[..want.len()] == want[..] && got[want.len()..] == want[..]);
    }

    /// Column slices of a row-major matrix packed by `add_short`, one
    /// that fits the stage and one larger than it, between plain runs:
    /// the stream carries the columns' elements row by row, and `seen`
    /// is shown exactly those bytes.
    #[test]
    fn short_pieces_are_packed_in_order() {
        let (rows, cols) = (70_000u64, 32u64);
        let matrix: Vec<u8> = (0..rows * cols * 2).map(|i| (i * 7 % 251) as u8).collect();
        let column_slice = |first: u64, width: u64, n_rows: u64| -> Vec<u8> {
            let mut v = Vec::new();
            for r in 0..n_rows {
                let at = ((r * cols + first) * 2) as usize;
                v.extend_from_slice(&matrix[at..at + (width * 2) as usize]);
            }
            v
        };
        // SAFETY: `matrix` outlives the views and is never written.
        let view = |first: u64| unsafe {
            let mut strides = [0u64; reshard::MAX_DIMS];
            strides[0] = cols;
            strides[1] = 1;
            StridedRef::new(matrix.as_ptr(), matrix.len(), first, strides, reshard::DType::BF16)
        };
        let head: Vec<u8> = vec![9; 10];
        let (mut stream, reader) = loopback();
        let mut stage = Vec::new();
        let mut seen = Vec::new();
        let mut gather = Gather::new(&mut stage);
        let mut write = |g: &mut Gather<'_, '_>| g.write(&mut stream);
        gather.add(&head, usize::MAX, &mut write).unwrap();
        // SAFETY (both): the views lie inside `matrix` (rows 0..500 and
        // 0..rows, columns 5..8 and 30..32), which nothing writes.
        unsafe { gather.add_short(&[500, 3], &view(5), usize::MAX, &mut write, |b| seen.extend_from_slice(b)) }.unwrap();
        gather.add(&head, usize::MAX, &mut write).unwrap();
        unsafe { gather.add_short(&[rows, 2], &view(30), 64 << 10, &mut write, |b| seen.extend_from_slice(b)) }.unwrap();
        write(&mut gather).unwrap();
        drop(stream);
        let got = reader.join().unwrap();
        let (small, large) = (column_slice(5, 3, 500), column_slice(30, 2, rows));
        assert!(large.len() > STAGE_BYTES);
        assert_eq!(seen, [&small[..], &large[..]].concat());
        assert_eq!(got, [&head[..], &small[..], &head[..], &large[..]].concat());
    }
}
