//! Staging areas for the pieces a sender converts (their wire type differs
//! from their buffer's), kept from run to run of one plan: a
//! [`StagingPool`] hands out [`StagingArea`] areas and takes each back when
//! the payload that carried it is dropped (by the receiver in process,
//! once written out over a socket), so a plan's steady state allocates
//! and faults in no staging memory: the areas of the first run serve
//! every later one. The pool keeps a receiver's buffers too
//! ([`RecvBuffers`]: where pieces read off a stream wait to be written
//! out), from run to run.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

/// Most areas a pool keeps; more are freed as they come back (smallest
/// first). A rank's sends of one round are its most at a time.
const KEPT: usize = 32;

/// Staging areas kept for the runs of one plan (cloning shares them).
#[derive(Clone, Debug, Default)]
pub(crate) struct StagingPool(Arc<Pool>);

#[derive(Debug, Default)]
struct Pool {
    free: Mutex<Vec<Vec<u8>>>,
    /// Areas made so far.
    made: AtomicUsize,
    recv: Mutex<RecvBuffers>,
}

/// A receiving rank's buffers for pieces read off a stream that cannot go
/// straight into their place ([`unpack_stream`](crate::exec)): the stage
/// short pieces are gathered in, and a buffer for one piece larger than
/// it. Their bytes are what the last read left; every byte used is read
/// first.
#[derive(Debug, Default)]
pub(crate) struct RecvBuffers {
    pub(crate) stage: Vec<u8>,
    pub(crate) large: Vec<u8>,
}

/// What a plan's staging pool keeps (`Scratch::staging_kept`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StagingKept {
    /// Areas kept now (none is out with a payload between runs).
    pub areas: usize,
    /// Their bytes.
    pub bytes: usize,
    /// Areas made since the pool was (none in a plan's steady state).
    pub made: usize,
}

impl StagingPool {
    /// An area of `len` bytes: the smallest kept one that holds them, else
    /// a new one (zeroed). A kept area's bytes are what its last use left
    /// (initialized, and this rank's own); the packer writes every byte it
    /// sends.
    pub(crate) fn take(&self, len: usize) -> StagingArea {
        let kept = {
            let mut free = self.0.free.lock().unwrap_or_else(|e| e.into_inner());
            let best = free.iter().enumerate().filter(|(_, v)| v.len() >= len).min_by_key(|(_, v)| v.len()).map(|(i, _)| i);
            best.map(|i| free.swap_remove(i))
        };
        let bytes = kept.unwrap_or_else(|| {
            self.0.made.fetch_add(1, Ordering::Relaxed);
            vec![0u8; len]
        });
        StagingArea { bytes, len, home: Some(self.clone()) }
    }

    /// The receive buffers the last run left (empty the first time): the
    /// run hands them back with [`give_recv`](Self::give_recv).
    pub(crate) fn take_recv(&self) -> RecvBuffers {
        std::mem::take(&mut *self.0.recv.lock().unwrap_or_else(|e| e.into_inner()))
    }

    /// Keeps `buffers` for the next run.
    pub(crate) fn give_recv(&self, buffers: RecvBuffers) {
        *self.0.recv.lock().unwrap_or_else(|e| e.into_inner()) = buffers;
    }

    /// What it keeps now, and how many areas it made.
    pub(crate) fn kept(&self) -> StagingKept {
        let free = self.0.free.lock().unwrap_or_else(|e| e.into_inner());
        StagingKept { areas: free.len(), bytes: free.iter().map(Vec::len).sum(), made: self.0.made.load(Ordering::Relaxed) }
    }

    fn give_back(&self, bytes: Vec<u8>) {
        if bytes.is_empty() {
            return;
        }
        let mut free = self.0.free.lock().unwrap_or_else(|e| e.into_inner());
        free.push(bytes);
        if free.len() > KEPT {
            if let Some(i) = free.iter().enumerate().min_by_key(|(_, v)| v.len()).map(|(i, _)| i) {
                free.swap_remove(i);
            }
        }
    }
}

/// One staging area: `len` bytes in use of an area at least that long;
/// back to its pool when dropped.
#[derive(Debug, Default)]
pub(crate) struct StagingArea {
    bytes: Vec<u8>,
    len: usize,
    home: Option<StagingPool>,
}

impl StagingArea {
    /// The bytes in use.
    pub(crate) fn as_slice(&self) -> &[u8] {
        &self.bytes[..self.len]
    }

    /// The bytes in use, to write.
    pub(crate) fn as_mut_slice(&mut self) -> &mut [u8] {
        &mut self.bytes[..self.len]
    }
}

impl Drop for StagingArea {
    fn drop(&mut self) {
        if let Some(pool) = self.home.take() {
            pool.give_back(std::mem::take(&mut self.bytes));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn areas_come_back_and_serve_smaller_and_equal_needs() {
        let pool = StagingPool::default();
        let mut a = pool.take(100);
        assert_eq!(a.as_slice().len(), 100);
        a.as_mut_slice().fill(7);
        let ptr = a.as_slice().as_ptr();
        drop(a);
        assert_eq!(pool.kept(), StagingKept { areas: 1, bytes: 100, made: 1 });
        // The same area, 60 of its bytes in use.
        let b = pool.take(60);
        assert_eq!((b.as_slice().len(), b.as_slice().as_ptr()), (60, ptr));
        // None kept is large enough: a new one, zeroed.
        let c = pool.take(200);
        assert!(c.as_slice().iter().all(|&x| x == 0));
        assert_ne!(c.as_slice().as_ptr(), ptr);
        drop((b, c));
        assert_eq!(pool.kept(), StagingKept { areas: 2, bytes: 300, made: 2 });
        // The smallest that holds it.
        assert_eq!(pool.take(80).as_slice().as_ptr(), ptr);
    }

    #[test]
    fn a_pool_keeps_a_bounded_number_of_areas_dropping_the_smallest() {
        let pool = StagingPool::default();
        let areas: Vec<StagingArea> = (1..=KEPT + 3).map(|n| pool.take(n)).collect();
        drop(areas);
        let StagingKept { areas: count, bytes, .. } = pool.kept();
        assert_eq!(count, KEPT);
        // The three smallest (1, 2, 3 bytes) went.
        assert_eq!(bytes, (4..=KEPT + 3).sum::<usize>());
        // An empty area is never kept; an area outliving its pool is freed.
        drop(pool.take(0));
        assert_eq!(pool.kept().areas, KEPT);
        let late = pool.take(5);
        drop(pool);
        drop(late);
    }
}
