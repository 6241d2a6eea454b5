//! CUDA IPC between processes of one node: a rank's buffers live in one
//! device allocation (its **bucket**), exported once per refit epoch as one
//! 64-byte handle (`cuIpcGetMemHandle`), not one handle per tensor; another
//! process on the node maps the bucket (`cuIpcOpenMemHandle`) and reaches
//! every buffer of the rank at the same offsets, which both sides derive
//! from the rank's buffer list ([`BucketLayout`]). A bucket that is
//! reallocated (its buffers moved) gets a new handle; a mapping is closed
//! when dropped.
//!
//! This module is the part that needs no GPU: the handle as bytes for
//! messages, the bucket's layout, and the process's table of mappings
//! ([`Mappings`]). Exporting and mapping are `DeviceMemory::export_ipc` /
//! `DeviceMemory::import_ipc` (`cuda` feature).

// Pure, and tested without a GPU in every build; what runs it on a device
// needs the `cuda` feature.
#![cfg_attr(not(feature = "cuda"), allow(dead_code))]

use crate::cuda::copyplan::packed_offsets;
use reshard::BufferSpec;
use std::collections::HashMap;
use std::fmt;
use std::sync::Mutex;
use thiserror::Error;

/// Bytes in a CUDA IPC memory handle (`CU_IPC_HANDLE_SIZE`).
pub(crate) const IPC_HANDLE_BYTES: usize = 64;

/// Where each buffer of a bucket starts: buffers are placed back to back in
/// the rank's buffer order, each at a 256-byte boundary (CUDA's allocation
/// alignment, so every dtype's elements stay aligned).
pub(crate) const BUCKET_ALIGN: u64 = 256;

/// A CUDA IPC memory handle: opaque bytes made by the exporting process.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct IpcHandle([u8; IPC_HANDLE_BYTES]);

impl fmt::Debug for IpcHandle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // The first bytes tell handles apart in logs; the rest is noise.
        let head: String = self.0[..8].iter().map(|b| format!("{b:02x}")).collect();
        write!(f, "IpcHandle({head}…)")
    }
}

/// Why a rank's buffers do not lay out as one bucket ([`BucketLayout::of`]).
#[derive(Clone, Debug, PartialEq, Eq, Error)]
#[cfg_attr(not(feature = "cuda"), allow(unreachable_pub))] // reached through the device's errors
pub enum LayoutError {
    /// One buffer's bytes pass `u64`.
    #[error("buffer {index} '{name}': {elems} elements of {dtype} pass u64 bytes")]
    Buffer {
        /// Its place in the rank's buffers.
        index: usize,
        /// Its name.
        name: String,
        /// Its elements.
        elems: u64,
        /// Its dtype.
        dtype: reshard::DType,
    },
    /// The buffers together pass `u64` bytes.
    #[error("the buffers together pass u64 bytes")]
    Total,
}

/// Why bytes claimed at an address do not lie inside the allocation the
/// driver reports for it ([`within_allocation`]).
#[derive(Clone, Debug, PartialEq, Eq, Error)]
#[cfg_attr(not(feature = "cuda"), allow(unreachable_pub))] // reached through the device's errors
pub enum AllocationError {
    /// More bytes than the allocation holds from the address.
    #[error("{bytes} bytes claimed at {base:#x}, but its allocation holds {room} from there")]
    TooLong {
        /// Bytes claimed.
        bytes: u64,
        /// The address.
        base: u64,
        /// Bytes from there to the allocation's end.
        room: u64,
    },
    /// The address is outside the allocation.
    #[error("{base:#x} is outside the allocation {range_base:#x}..+{range_size} the driver reports")]
    Outside {
        /// The address.
        base: u64,
        /// The allocation's start.
        range_base: u64,
        /// Its bytes.
        range_size: u64,
    },
}

/// Byte offsets of a rank's buffers in its bucket and the bucket's length.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct BucketLayout {
    /// Byte offset of each buffer, in the rank's buffer order.
    pub offsets: Vec<u64>,
    /// Byte length of each buffer.
    pub lens: Vec<u64>,
    /// Bytes of the whole bucket (at least 1).
    pub bytes: u64,
}

impl BucketLayout {
    /// The layout of a rank's buffers (`RankProgram::buffers`); an error
    /// naming the buffer where their sizes pass `u64` bytes (a program from
    /// the wire may claim any), so no buffer lies outside the bucket.
    pub(crate) fn of(specs: &[BufferSpec]) -> Result<BucketLayout, LayoutError> {
        let lens = specs
            .iter()
            .enumerate()
            .map(|(index, b)| {
                b.elems.checked_mul(b.dtype.size()).ok_or_else(|| LayoutError::Buffer {
                    index,
                    name: b.name.clone(),
                    elems: b.elems,
                    dtype: b.dtype,
                })
            })
            .collect::<Result<Vec<u64>, LayoutError>>()?;
        let (offsets, bytes) = packed_offsets(&lens, BUCKET_ALIGN).ok_or(LayoutError::Total)?;
        Ok(BucketLayout { offsets, lens, bytes: bytes.max(1) })
    }
}

/// Checks that `bytes` from `base` lie inside the allocation
/// `[range_base, range_base + range_size)` the driver reports for `base`:
/// the size of a peer's bucket comes from the peer, the allocation from
/// the driver, and only the second is believed. Checked arithmetic: a
/// size past the address space is refused, never wrapped.
pub(crate) fn within_allocation(base: u64, bytes: u64, range_base: u64, range_size: u64) -> Result<(), AllocationError> {
    let inside = base.checked_sub(range_base).filter(|&skip| skip <= range_size).map(|skip| range_size - skip);
    match inside {
        Some(room) if bytes <= room => Ok(()),
        Some(room) => Err(AllocationError::TooLong { bytes, base, room }),
        None => Err(AllocationError::Outside { base, range_base, range_size }),
    }
}

/// How an import of a handle reaches the memory ([`Mappings::acquire`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Mapped<V> {
    /// Through the process's one mapping of the handle, shared and counted.
    Opened(V),
    /// The handle was exported by this process: its own allocation, never
    /// mapped (CUDA refuses to open a handle in the process that made it).
    Exported(V),
}

impl<V: Copy> Mapped<V> {
    /// Where the memory starts, either way.
    pub(crate) fn base(self) -> V {
        match self {
            Mapped::Opened(v) | Mapped::Exported(v) => v,
        }
    }
}

/// One process's CUDA IPC mappings. CUDA maps a handle at most once per
/// process (a second `cuIpcOpenMemHandle` of it fails: "already mapped"),
/// and never in the process that exported it, while several members of
/// one process (ranks of an in-process group) import the same peer bucket.
/// So every import of a handle goes through this table: the first opens
/// the mapping, later ones share it, and the last release closes it; a
/// handle this process exported resolves to the exporter's own allocation.
/// The table holds its lock across `open` and `close`, so no import can
/// see a mapping that is being closed, nor open one twice. `V` is the
/// mapping (a device address); tests use any value.
pub(crate) struct Mappings<V> {
    inner: Mutex<MappingsInner<V>>,
}

struct MappingsInner<V> {
    /// Handles opened here: the mapping and how many imports share it.
    opened: HashMap<IpcHandle, (V, usize)>,
    /// Handles this process exported: its own allocation.
    exported: HashMap<IpcHandle, V>,
}

impl<V: Copy + PartialEq> Default for Mappings<V> {
    fn default() -> Self {
        Mappings { inner: Mutex::new(MappingsInner { opened: HashMap::new(), exported: HashMap::new() }) }
    }
}

impl<V: Copy + PartialEq> Mappings<V> {
    fn lock(&self) -> std::sync::MutexGuard<'_, MappingsInner<V>> {
        // A panic while the lock was held left no half-updated entry (each
        // update is one insert or remove), so a poisoned table is usable.
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Records that this process exported `handle` for its allocation at
    /// `base` (imports of it in this process use `base`).
    pub(crate) fn exported(&self, handle: IpcHandle, base: V) {
        self.lock().exported.insert(handle, base);
    }

    /// Forgets every handle exported for the allocation at `base` (it is
    /// being freed).
    pub(crate) fn unexported(&self, base: V) {
        self.lock().exported.retain(|_, b| *b != base);
    }

    /// The memory of `handle`: this process's own if it exported it, the
    /// shared mapping if one is open, else the one `open` makes (an error
    /// from `open` leaves no entry). Every `Ok` must be matched by one
    /// [`release`](Mappings::release).
    pub(crate) fn acquire<E>(&self, handle: &IpcHandle, open: impl FnOnce() -> Result<V, E>) -> Result<Mapped<V>, E> {
        let mut inner = self.lock();
        if let Some(&base) = inner.exported.get(handle) {
            return Ok(Mapped::Exported(base));
        }
        if let Some((base, users)) = inner.opened.get_mut(handle) {
            *users += 1;
            return Ok(Mapped::Opened(*base));
        }
        let base = open()?;
        inner.opened.insert(*handle, (base, 1));
        Ok(Mapped::Opened(base))
    }

    /// Ends one [`acquire`](Mappings::acquire) that returned `mapped`: the
    /// last user of an opened mapping closes it (`close`); an export of
    /// this process is left alone.
    pub(crate) fn release(&self, handle: &IpcHandle, mapped: Mapped<V>, close: impl FnOnce(V)) {
        let Mapped::Opened(_) = mapped else { return };
        let mut inner = self.lock();
        let last = match inner.opened.get_mut(handle) {
            Some((_, users)) if *users > 1 => {
                *users -= 1;
                false
            }
            Some(_) => true,
            None => false,
        };
        if last {
            if let Some((base, _)) = inner.opened.remove(handle) {
                close(base);
            }
        }
    }

    /// Imports sharing the mapping of `handle` (0: not opened here).
    #[cfg(test)]
    pub(crate) fn users(&self, handle: &IpcHandle) -> usize {
        self.lock().opened.get(handle).map_or(0, |&(_, n)| n)
    }
}

crate::cuda::id::opaque_id!(IpcHandle, IpcHandleError, IPC_HANDLE_BYTES, "CUDA IPC handle", never "exported");

#[cfg(test)]
mod tests {
    use super::*;
    use reshard::{BufferKey, DType};

    #[test]
    fn handles_round_trip_and_bad_bytes_are_rejected() {
        let mut raw = [0u8; IPC_HANDLE_BYTES];
        raw[3] = 9;
        let h = IpcHandle::from_bytes(&raw).unwrap();
        assert_eq!(IpcHandle::from_bytes(&h.to_vec()).unwrap(), h);
        assert_eq!(IpcHandle::from_bytes(&raw[..10]), Err(IpcHandleError::Length { got: 10 }));
        assert_eq!(IpcHandle::from_bytes(&[0u8; IPC_HANDLE_BYTES]), Err(IpcHandleError::Zero));
        assert!(format!("{h:?}").starts_with("IpcHandle(00000009"));
    }

    #[test]
    fn buckets_align_every_buffer() {
        let spec = |elems, dtype| BufferSpec { name: "b".into(), key: BufferKey::Named(0), dtype, elems };
        let l = BucketLayout::of(&[spec(3, DType::BF16), spec(10, DType::F32), spec(0, DType::F64), spec(1, DType::U8)]).unwrap();
        assert_eq!(l.offsets, vec![0, 256, 512, 512]);
        assert_eq!(l.lens, vec![6, 40, 0, 1]);
        assert_eq!(l.bytes, 513);
        assert!(l.offsets.iter().all(|o| o % BUCKET_ALIGN == 0));
        assert_eq!(BucketLayout::of(&[]).unwrap().bytes, 1);
        // Sizes past u64, alone or together, are refused.
        let e = BucketLayout::of(&[spec(1, DType::F32), spec(u64::MAX / 2, DType::F32)]).unwrap_err();
        assert!(e.to_string().contains("buffer 1 'b'"), "{e}");
        assert!(BucketLayout::of(&[spec(u64::MAX - 8, DType::U8), spec(u64::MAX - 8, DType::U8)]).is_err());
    }

    fn handle(n: u8) -> IpcHandle {
        IpcHandle::from_bytes(&[n; IPC_HANDLE_BYTES]).expect("a handle")
    }

    #[test]
    fn a_handle_is_opened_once_per_process_and_closed_by_its_last_user() {
        let table = Mappings::<u64>::default();
        let (opens, closes) = (std::cell::Cell::new(0), std::cell::RefCell::new(Vec::new()));
        let open = || -> Result<u64, String> {
            opens.set(opens.get() + 1);
            Ok(0x1000 * opens.get())
        };
        let a = table.acquire(&handle(1), open).unwrap();
        let b = table.acquire(&handle(1), open).unwrap();
        let c = table.acquire(&handle(2), open).unwrap();
        assert_eq!((a, b, c), (Mapped::Opened(0x1000), Mapped::Opened(0x1000), Mapped::Opened(0x2000)));
        assert_eq!(opens.get(), 2, "one open per handle");
        assert_eq!(table.users(&handle(1)), 2);
        table.release(&handle(1), a, |base| closes.borrow_mut().push(base));
        assert!(closes.borrow().is_empty(), "a mapping still in use stays open");
        table.release(&handle(1), b, |base| closes.borrow_mut().push(base));
        assert_eq!(*closes.borrow(), vec![0x1000]);
        assert_eq!(table.users(&handle(1)), 0);
        // Opened again after the close: a fresh mapping.
        let d = table.acquire(&handle(1), open).unwrap();
        assert_eq!(d, Mapped::Opened(0x3000));
        table.release(&handle(1), d, |base| closes.borrow_mut().push(base));
        table.release(&handle(2), c, |base| closes.borrow_mut().push(base));
        assert_eq!(*closes.borrow(), vec![0x1000, 0x3000, 0x2000]);
    }

    #[test]
    fn a_handle_this_process_exported_is_its_own_memory_never_opened() {
        let table = Mappings::<u64>::default();
        table.exported(handle(7), 0x7000);
        let m = table.acquire(&handle(7), || -> Result<u64, String> { panic!("opened an own export") }).unwrap();
        assert_eq!(m, Mapped::Exported(0x7000));
        table.release(&handle(7), m, |_| panic!("closed an own export"));
        // Once the allocation is freed, the handle is a stranger's again.
        table.unexported(0x7000);
        let m = table.acquire(&handle(7), || Ok::<u64, String>(0x9000)).unwrap();
        assert_eq!(m, Mapped::Opened(0x9000));
    }

    #[test]
    fn a_failed_open_leaves_nothing_behind() {
        let table = Mappings::<u64>::default();
        assert_eq!(table.acquire(&handle(3), || Err::<u64, _>("invalid handle")), Err("invalid handle"));
        assert_eq!(table.users(&handle(3)), 0);
        assert_eq!(table.acquire(&handle(3), || Ok::<u64, &str>(0x3000)), Ok(Mapped::Opened(0x3000)));
        // A release of a handle nobody opened closes nothing.
        table.release(&handle(4), Mapped::Opened(0x4000), |_| panic!("closed a mapping never opened"));
    }

    #[test]
    fn threads_importing_one_handle_share_one_mapping() {
        let table = std::sync::Arc::new(Mappings::<u64>::default());
        let opens = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let threads: Vec<_> = (0..8)
            .map(|_| {
                let (table, opens) = (table.clone(), opens.clone());
                std::thread::spawn(move || {
                    table
                        .acquire(&handle(5), || {
                            opens.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                            std::thread::sleep(std::time::Duration::from_millis(5));
                            Ok::<u64, String>(0x5000)
                        })
                        .unwrap()
                })
            })
            .collect();
        let got: Vec<_> = threads.into_iter().map(|t| t.join().unwrap()).collect();
        assert!(got.iter().all(|&m| m == Mapped::Opened(0x5000)));
        assert_eq!(opens.load(std::sync::atomic::Ordering::SeqCst), 1);
        assert_eq!(table.users(&handle(5)), 8);
        let closes = std::sync::atomic::AtomicUsize::new(0);
        for m in got {
            table.release(&handle(5), m, |_| {
                closes.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            });
        }
        assert_eq!(closes.load(std::sync::atomic::Ordering::SeqCst), 1);
    }

    #[test]
    fn a_bucket_larger_than_its_allocation_is_refused() {
        assert_eq!(within_allocation(0x1000, 0x100, 0x1000, 0x100), Ok(()));
        assert_eq!(within_allocation(0x1080, 0x80, 0x1000, 0x100), Ok(()));
        assert!(within_allocation(0x1000, 0x101, 0x1000, 0x100).unwrap_err().to_string().contains("holds 256"));
        assert!(within_allocation(0x1080, 0x81, 0x1000, 0x100).is_err());
        assert!(within_allocation(0xfff, 1, 0x1000, 0x100).unwrap_err().to_string().contains("outside"));
        assert!(within_allocation(0x1101, 0, 0x1000, 0x100).is_err());
        // A size past the address space, or a range that wraps, never passes.
        assert!(within_allocation(0x1000, u64::MAX, 0x1000, 0x100).is_err());
        assert!(within_allocation(u64::MAX, 1, u64::MAX - 1, 1).is_err());
    }
}
