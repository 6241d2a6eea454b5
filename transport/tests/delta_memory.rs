//! What decoding a delta message costs in memory: no more than the bytes
//! received, whatever the encoding claims ([`transport::delta::decode`]).
//! A test binary of its own, for its counting allocator.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use transport::delta::{decode, encode, DeltaError, HEADER};

/// The system allocator, counting the bytes each thread allocates.
struct Counting;

thread_local! {
    static ALLOCATED: Cell<u64> = const { Cell::new(0) };
}

// SAFETY: every call is passed to the system allocator unchanged; the
// count is a thread-local without a destructor, which allocates nothing.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let _ = ALLOCATED.try_with(|a| a.set(a.get() + layout.size() as u64));
        // SAFETY: the caller's contract, passed on.
        unsafe { System.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: the caller's contract, passed on.
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let _ = ALLOCATED.try_with(|a| a.set(a.get() + new_size as u64));
        // SAFETY: the caller's contract, passed on.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static COUNTING: Counting = Counting;

/// Bytes this thread allocates while `f` runs, and its result.
fn allocated<T>(f: impl FnOnce() -> T) -> (u64, T) {
    let before = ALLOCATED.with(Cell::get);
    let out = f();
    (ALLOCATED.with(Cell::get) - before, out)
}

/// A bitmap encoding's header (see the module doc of `transport::delta`).
fn bitmap_header(units: u64, base_crc: u32, payload: u64) -> Vec<u8> {
    let mut h = vec![1u8, 1];
    h.extend_from_slice(&units.to_le_bytes());
    h.extend_from_slice(&base_crc.to_le_bytes());
    h.extend_from_slice(&0u32.to_le_bytes());
    h.extend_from_slice(&payload.to_le_bytes());
    assert_eq!(h.len(), HEADER);
    h
}

/// A peer sends 1 MiB: a bitmap marking every unit of an 8 MiB message
/// changed, and none of the 8 MiB of values. Listing the units it claims
/// would take 64 MiB; the decoder counts the bits against the values sent
/// and refuses, allocating next to nothing (the error's text).
#[test]
fn a_delta_claiming_more_units_than_it_sent_costs_no_memory() {
    // The count sees allocations.
    assert!(allocated(|| std::hint::black_box(vec![1u8; 1 << 20])).0 >= 1 << 20);
    let len = 8u64 << 20;
    let base = vec![0x5au8; len as usize];
    let crc = crc32c::crc32c(&base);
    let mut encoded = bitmap_header(len, crc, len / 8);
    encoded.resize(HEADER + (len / 8) as usize, 0xff);
    let (bytes, result) = allocated(|| decode(Some(base), &encoded, 1, len));
    match result {
        Err(DeltaError::Malformed(m)) => assert!(m.contains("8388608 changed units, 0 bytes of values"), "{m}"),
        other => panic!("decoded: {:?}", other.map(|v| v.len())),
    }
    assert!(bytes < 4096, "{bytes} bytes allocated to refuse {} received", encoded.len());
}

/// Decoding allocates in proportion to the bytes received: a bitmap or
/// index encoding patches the base in place (nothing new), a dense one is
/// one copy of its payload.
#[test]
fn decoding_allocates_no_more_than_it_received() {
    let len = 1usize << 20;
    let base: Vec<u8> = (0..len).map(|i| (i * 7 % 251) as u8).collect();
    for every in [1usize, 9, 1000] {
        let mut new = base.clone();
        for i in (0..len).step_by(every) {
            new[i] ^= 0x21;
        }
        let encoded = encode(Some(&base), &new, 1);
        let (bytes, result) = allocated(|| decode(Some(base.clone()), &encoded, 1, len as u64));
        // (The clone of the base is the caller's: `len` bytes.)
        assert_eq!(result.unwrap(), new);
        let received = (encoded.len() - HEADER) as u64;
        let form = transport::delta::form(&encoded);
        assert!(bytes <= len as u64 + if form == "dense" { received } else { 0 }, "{form}: {bytes} allocated for {received} received");
    }
}
