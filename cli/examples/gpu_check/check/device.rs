//! Checks of the device itself: the driver, NCCL and NVRTC versions
//! (`environment`), the cast kernels against the host conversion
//! (`kernels`), and registered device memory the driver's checks refuse
//! (`registered-lies`).

use super::{e2s, spec, Ctx};
use reshard::convert_slice;
use reshard::{DType, Endpoint};
use serde_json::{json, Value};
use transport::cuda::{DeviceMemory, GpuDevice};
use transport::RankMemory;

/// Host bytes through a device cast kernel and back.
pub(super) fn device_cast(dev: &GpuDevice, from: DType, bytes: &[u8], to: DType) -> Result<Vec<u8>, String> {
    let n = bytes.len() as u64 / from.size();
    let me = Endpoint::src(0);
    let mut a = DeviceMemory::for_buffers(dev, me, &[spec(from, n)]).map_err(e2s)?;
    let mut b = DeviceMemory::for_buffers(dev, me, &[spec(to, n)]).map_err(e2s)?;
    a.upload(dev, &RankMemory { buffers: vec![bytes.to_vec()], dtypes: vec![from] }).map_err(e2s)?;
    a.cast_into(dev, 0, &mut b, 0).map_err(e2s)?;
    Ok(b.download(dev).map_err(e2s)?.buffers.remove(0))
}

pub(super) fn kernels(ctx: &Ctx) -> Result<(String, Value), String> {
    let dev = &ctx.dev;
    let origin = dev.kernels().map_err(|e| e.to_string())?.origin().to_string();
    let all16: Vec<u8> = (0..=u16::MAX).flat_map(u16::to_le_bytes).collect();
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    let f32s: Vec<u8> = (0..1_000_000)
        .flat_map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x as u32).to_le_bytes()
        })
        .collect();
    let mut checked = 0u64;
    for (from, to, input) in [
        (DType::BF16, DType::F32, &all16),
        (DType::F16, DType::F32, &all16),
        (DType::F32, DType::BF16, &f32s),
        (DType::F32, DType::F16, &f32s),
        (DType::BF16, DType::F16, &all16),
        (DType::F16, DType::BF16, &all16),
    ] {
        let got = device_cast(dev, from, input, to)?;
        let mut want = vec![0u8; got.len()];
        convert_slice(from, input, to, &mut want);
        // NaN payloads: both sides keep NaN with its sign; compare bits.
        if let Some(i) =
            (0..got.len()).step_by(to.size() as usize).find(|&i| got[i..i + to.size() as usize] != want[i..i + to.size() as usize])
        {
            return Err(format!("{from} -> {to}: element {} differs from the host conversion", i as u64 / to.size()));
        }
        checked += input.len() as u64 / from.size();
    }
    Ok((format!("{checked} values bit-exact against the host conversion ({origin})"), json!({ "values": checked, "origin": origin })))
}

/// The driver, NCCL and NVRTC versions, the device, and where the
/// cast kernels came from: passes when they are the shipped code (a
/// device on which only NVRTC's load would run slower paths silently
/// elsewhere). NVRTC is reported, not required.
pub(super) fn environment(ctx: &Ctx) -> Result<(String, Value), String> {
    let dev = &ctx.dev;
    // The versions as every file's record has them (one place gathers them).
    let facts = super::gpu_facts(Ok(dev));
    let driver = facts.cuda_driver_api.clone()?;
    let uuid = facts.uuid.clone()?;
    let nccl = facts.nccl.clone();
    let (major, minor) = dev.context().compute_capability().map_err(e2s)?;
    let nvrtc = facts.nvrtc.clone();
    // NVRTC's own build of the kernels, for this device, loads too.
    let nvrtc_kernels = dev.check_nvrtc_kernels();
    let kernels = dev.kernels().map_err(|e| e.to_string())?;
    let fields = json!({
        "device": dev.name(), "uuid": uuid, "compute_capability": format!("{major}.{minor}"), "driver_cuda": driver,
        "nccl": nccl.clone().unwrap_or_else(|e| format!("unavailable: {e}")),
        "nvrtc": nvrtc.clone().unwrap_or_else(|e| format!("unavailable: {e}")),
        "nvrtc_kernels_load": nvrtc_kernels.clone().map(|o| format!("yes: {o}")).unwrap_or_else(|e| e.to_string()),
        "kernels": kernels.origin(), "ptx_isa": transport::cuda::shipped_ptx_isa(),
    });
    let line = format!(
        "{} (sm_{major}{minor}, {uuid}), driver CUDA {driver}, NCCL {}, NVRTC {}; kernels: {}; NVRTC's build loads: {}",
        dev.name(),
        fields["nccl"].as_str().unwrap_or_default(),
        fields["nvrtc"].as_str().unwrap_or_default(),
        kernels.origin(),
        fields["nvrtc_kernels_load"].as_str().unwrap_or_default()
    );
    if !kernels.shipped() {
        return Err(format!("{line} — the shipped PTX did not load"));
    }
    nccl.map_err(|e| format!("{line} — NCCL: {e}"))?;
    Ok((line, fields))
}

/// Registered device memory that lies: a region past the end of its
/// allocation, one in host memory, and one offset into the middle of
/// an allocation running past its end are refused by the driver's
/// checks (`DeviceMemory::register`), naming what is wrong; an honest
/// region inside the allocation is taken.
pub(super) fn registered_lies(ctx: &Ctx) -> Result<(String, Value), String> {
    let dev = &ctx.dev;
    let me = Endpoint::dst(0);
    let n: u64 = 1 << 20;
    let mem = DeviceMemory::for_buffers(dev, me, &[spec(DType::U8, n)]).map_err(e2s)?;
    let base = mem.device_addrs()[0];
    let host = vec![0u8; n as usize];
    let try_region = |addr: u64, len: u64| {
        // SAFETY: `register` only reads the addresses' attributes from
        // the driver and records them; the result is dropped here
        // unused, so no byte at them is read or written whatever the
        // check decides.
        unsafe { DeviceMemory::register(dev, me, &[spec(DType::U8, len)], &[(addr, len as usize)]) }.map(drop).map_err(e2s)
    };
    try_region(base, n).map_err(|e| format!("an honest region was refused: {e}"))?;
    try_region(base + 4096, n - 4096).map_err(|e| format!("an honest region was refused: {e}"))?;
    let mut refusals = Vec::new();
    for (what, addr, len) in [
        ("one byte past the allocation", base, n + 1),
        ("from the middle past the end", base + n / 2, n),
        ("host memory", host.as_ptr() as u64, n),
    ] {
        match try_region(addr, len) {
            Ok(()) => return Err(format!("a region {what} was taken")),
            Err(e) => refusals.push(format!("{what}: {e}")),
        }
    }
    drop(host);
    Ok((format!("an honest region taken; refused: {}", refusals.join("; ")), json!({ "refusals": refusals })))
}
