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

/// A blocks encoding's header (see the module doc of `transport::delta`),
/// the result named as a delta is: the payload's CRC-32C appended to the
/// base's name.
fn blocks_header(units: u64, base_crc: u32, payload: &[u8]) -> Vec<u8> {
    let mut h = vec![4u8, 1];
    h.extend_from_slice(&units.to_le_bytes());
    h.extend_from_slice(&base_crc.to_le_bytes());
    h.extend_from_slice(&crc32c::crc32c_append(base_crc, payload).to_le_bytes());
    h.extend_from_slice(&(payload.len() as u64).to_le_bytes());
    assert_eq!(h.len(), HEADER);
    h
}

/// A peer sends 1 MiB: a stream of bitmaps marking every unit of an 8 MiB
/// message changed, and none of the 8 MiB of values. Listing the units it
/// claims would take 64 MiB; the decoder checks the claims against the
/// bytes sent and refuses, allocating next to nothing (the error's text).
#[test]
fn a_delta_claiming_more_units_than_it_sent_costs_no_memory() {
    // The count sees allocations.
    assert!(allocated(|| std::hint::black_box(vec![1u8; 1 << 20])).0 >= 1 << 20);
    let len = 8u64 << 20;
    let base = vec![0x5au8; len as usize];
    let crc = crc32c::crc32c(&base);
    let stream = vec![0xffu8; (len / 8) as usize];
    let mut payload = (stream.len() as u64).to_le_bytes().to_vec();
    payload.extend_from_slice(&len.to_le_bytes());
    payload.extend_from_slice(&stream);
    let mut encoded = blocks_header(len, crc, &payload);
    encoded.extend_from_slice(&payload);
    let (bytes, result) = allocated(|| decode(Some(base), &encoded, 1, len));
    match result {
        Err(DeltaError::Malformed(m)) => assert!(m.contains("the stream and the values do not add up"), "{m}"),
        other => panic!("decoded: {:?}", other.map(|v| v.len())),
    }
    assert!(bytes < 4096, "{bytes} bytes allocated to refuse {} received", encoded.len());
}

/// Decoding allocates in proportion to the bytes received: a blocks
/// encoding patches the base in place (nothing new), a dense one is one
/// copy of its payload.
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

/// Encoding allocates one buffer, at most the message's dense form (its
/// bytes and the header), whatever changed: the changed units are counted
/// first and written in place, never listed. `len` bytes in units of
/// `unit`, `per_mille` of the units changed (spread evenly).
fn encode_allocates_at_most_the_dense_form(len: usize, unit: usize, per_mille: usize) {
    let base: Vec<u8> = (0..len).map(|i| (i * 7 % 251) as u8).collect();
    let mut new = base.clone();
    for (u, chunk) in new.chunks_exact_mut(unit).enumerate() {
        if (u * 7919) % 1000 < per_mille {
            chunk[0] ^= 0x5a;
        }
    }
    let (bytes, encoded) = allocated(|| encode(Some(&base), &new, unit));
    let form = transport::delta::form(&encoded);
    println!("{len} bytes in units of {unit}, {per_mille}/1000 changed: {form}, {} bytes, {bytes} allocated", encoded.len());
    assert!(bytes <= (len + HEADER) as u64, "{per_mille}/1000 changed: {bytes} bytes allocated to encode {len}");
    assert_eq!(bytes, encoded.capacity() as u64, "{per_mille}/1000: one buffer, sized exactly");
    assert_eq!(decode(Some(base), &encoded, unit, len as u64).unwrap(), new, "{per_mille}/1000");
}

/// A 32 MiB message of f32 with every unit changed, and with just fewer
/// changed than make the blocks form lose to dense (where the list of changed
/// units the encoder once made peaked at 7 times the message).
#[test]
fn encoding_32_mib_allocates_at_most_the_dense_form() {
    encode_allocates_at_most_the_dense_form(32 << 20, 4, 1000);
    encode_allocates_at_most_the_dense_form(32 << 20, 4, 960);
}

/// Bytes, through the sparsities where gaps and bitmaps win and the edge
/// where the blocks form stops beating dense.
#[test]
fn encoding_allocates_at_most_the_dense_form_at_any_sparsity() {
    for per_mille in [1000, 874, 800, 500, 125, 20, 1, 0] {
        encode_allocates_at_most_the_dense_form(4 << 20, 1, per_mille);
    }
    encode_allocates_at_most_the_dense_form(4 << 20, 2, 300);
}

/// An encoding longer than any encoding of the message the receiver
/// expects (its dense form: the message and the header) is refused on its
/// length alone, allocating nothing, before its header is read.
#[test]
fn an_encoding_longer_than_the_dense_form_is_refused_first() {
    let len = 4096u64;
    let base = vec![3u8; len as usize];
    // A well-formed dense encoding of a 1 MiB message, sent where 4 KiB
    // were planned.
    let big = vec![9u8; 1 << 20];
    let encoded = encode(None, &big, 1);
    let copy = base.clone();
    let (bytes, result) = allocated(|| decode(Some(copy), &encoded, 1, len));
    match result {
        Err(DeltaError::Malformed(m)) => {
            assert!(m.contains(&format!("an encoding of {} bytes for a message of 4096: at most 4122 expected", encoded.len())), "{m}")
        }
        other => panic!("decoded: {:?}", other.map(|v| v.len())),
    }
    assert!(bytes < 4096, "{bytes} bytes allocated to refuse it");
    assert!(transport::delta::check_encoded_len(len + HEADER as u64, len).is_ok());
    assert!(transport::delta::check_encoded_len(len + HEADER as u64 + 1, len).is_err());
    // The dense form itself is accepted.
    let e = encode(None, &base, 1);
    assert_eq!(e.len() as u64, len + HEADER as u64);
    assert_eq!(decode(None, &e, 1, len).unwrap(), base);
}
