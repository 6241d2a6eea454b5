//! Checks of CUDA IPC between processes: a colocated refit into buckets
//! another process exports (`ipc`), and a rank that gives up while its copy
//! from a peer's bucket runs (`ipc-abort-in-flight`); the exporting
//! children's side.

use super::device::device_cast;
use super::{e2s, load, spec, Ctx};
use reshard::convert_slice;
use reshard::{plan_reshard, DType, Endpoint, PlanOptions};
use serde_json::{json, Value};
use std::io::{BufRead, Write};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Instant;
use transport::{
    cuda::{DeviceMemory, DeviceRun, GpuDevice, IpcHandle},
    fill_sources, verify_destinations, RankMemory,
};

/// The IPC pair: the child's side. Prints one handle (hex) per source
/// rank, then waits for a line on stdin before freeing its buckets.
pub(super) fn ipc_exporter(dir: &Path) -> Result<(), String> {
    let (src, dst) = (load(&dir.join("src.json"))?, load(&dir.join("dst.json"))?);
    let plan = plan_reshard(&src, &dst, &PlanOptions::default()).map_err(e2s)?;
    let programs = plan.programs(&src, &dst).map_err(e2s)?;
    let dev = GpuDevice::open(0).map_err(e2s)?;
    let n_src = src.ranks() as usize;
    let mut host = RankMemory::for_programs(&programs[..n_src]);
    fill_sources(&src, &mut host);
    let mut buckets = Vec::new();
    for (p, h) in programs[..n_src].iter().zip(&host) {
        let mut m = DeviceMemory::for_buffers(&dev, p.endpoint, &p.buffers).map_err(e2s)?;
        m.upload(&dev, h).map_err(e2s)?;
        buckets.push(m);
    }
    publish(&dev, &buckets)
}

/// An exporting child's part: prints each bucket's IPC handle (hex, a
/// line each) and keeps the buckets until a line arrives on stdin.
fn publish(dev: &GpuDevice, buckets: &[DeviceMemory]) -> Result<(), String> {
    let mut out = std::io::stdout().lock();
    for m in buckets {
        writeln!(out, "{}", m.export_ipc(dev).map_err(e2s)?.to_hex()).map_err(e2s)?;
    }
    out.flush().map_err(e2s)?;
    drop(out);
    let mut line = String::new();
    std::io::stdin().read_line(&mut line).map_err(e2s)?;
    Ok(())
}

/// A child process of this program that exports IPC handles
/// ([`publish`]) and keeps their memory until [`Exporter::finish`].
struct Exporter {
    child: std::process::Child,
    lines: std::io::Lines<std::io::BufReader<std::process::ChildStdout>>,
}

impl Exporter {
    fn start(args: &[&std::ffi::OsStr]) -> Result<Exporter, String> {
        let exe = std::env::current_exe().map_err(e2s)?;
        let mut child = Command::new(exe)
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .map_err(|e| format!("starting the exporting process: {e}"))?;
        let out = child.stdout.take().ok_or("no child stdout")?;
        Ok(Exporter { child, lines: std::io::BufReader::new(out).lines() })
    }

    /// The next handle the child exported.
    fn handle(&mut self) -> Result<IpcHandle, String> {
        let hex = self.lines.next().ok_or("the exporting process ended before sending its handles")?.map_err(e2s)?;
        IpcHandle::from_hex(&hex).map_err(|e| format!("the exporting process's handle: {e}"))
    }

    /// Lets the child free its memory and end; whether it ended well.
    fn finish(mut self) -> Result<(), String> {
        if let Some(mut stdin) = self.child.stdin.take() {
            let _ = writeln!(stdin, "done");
        }
        let status = self.child.wait().map_err(e2s)?;
        if status.success() {
            Ok(())
        } else {
            Err(format!("the exporting process failed: {status}"))
        }
    }
}

pub(super) fn ipc(ctx: &Ctx) -> Result<(String, Value), String> {
    let dev = &ctx.dev;
    let dir = ctx.root.join("examples/mixed-2d");
    let (src, dst) = (load(&dir.join("src.json"))?, load(&dir.join("dst.json"))?);
    let plan = plan_reshard(&src, &dst, &PlanOptions::default()).map_err(e2s)?;
    let programs = plan.programs(&src, &dst).map_err(e2s)?;
    let n_src = src.ranks() as usize;
    let mut exporter = Exporter::start(&["--ipc-exporter".as_ref(), dir.as_os_str()])?;
    let result = (|| -> Result<(String, Value), String> {
        let mut memory = Vec::new();
        for p in &programs[..n_src] {
            let handle = exporter.handle()?;
            // SAFETY: the child keeps its buckets until we write to its
            // stdin (after the refit and the mappings are dropped), and
            // does not touch them meanwhile.
            memory.push(unsafe { DeviceMemory::import_ipc(dev, p.endpoint, &p.buffers, &handle) }.map_err(e2s)?);
        }
        for p in &programs[n_src..] {
            let mut m = DeviceMemory::for_buffers(dev, p.endpoint, &p.buffers).map_err(e2s)?;
            m.zero(dev).map_err(e2s)?;
            memory.push(m);
        }
        let report = DeviceRun::prepare(dev, &programs, &mut memory).map_err(e2s)?.execute().map_err(e2s)?;
        let back = memory[n_src..].iter().map(|m| m.download(dev)).collect::<Result<Vec<_>, _>>().map_err(e2s)?;
        drop(memory);
        let checked = verify_destinations(&src, &dst, &back).map_err(|e| format!("MISMATCH: {e}"))?;
        Ok((
            format!(
                "{} source ranks in another process, one IPC handle each; {checked} destination elements verified, {} bytes in {:?}",
                n_src, report.wire_bytes, report.elapsed
            ),
            json!({ "handles": n_src, "elements": checked, "bytes": report.wire_bytes, "seconds": report.elapsed.as_secs_f64() }),
        ))
    })();
    let finished = exporter.finish();
    let r = result?;
    finished?;
    Ok(r)
}

/// The `ipc-abort-in-flight` check's child: exports one bucket of
/// `bytes` on GPU 0, prints its handle, and keeps it until a line
/// arrives on stdin.
pub(super) fn ipc_bucket(bytes: &str) -> Result<(), String> {
    let bytes: u64 = bytes.parse().map_err(|e| format!("bucket size {bytes}: {e}"))?;
    let dev = GpuDevice::open(0).map_err(e2s)?;
    let mut m = DeviceMemory::for_buffers(&dev, Endpoint::src(0), &[spec(DType::U8, bytes)]).map_err(e2s)?;
    m.zero(&dev).map_err(e2s)?;
    publish(&dev, &[m])
}

/// An IPC rank that gives up while its copy from a peer's bucket (in
/// another process) is still running: the peer's mapping must stay
/// (closing it under the copy faults the context that the framework's
/// own work shares). Afterwards this process's context still copies,
/// casts and allocates.
pub(super) fn ipc_abort_in_flight(ctx: &Ctx) -> Result<(String, Value), String> {
    use transport::cuda::Progress;
    use transport::cuda::{GpuIpc, IpcMemory};
    let dev = &ctx.dev;
    let bytes: u64 = 8 << 30;
    let size = bytes.to_string();
    let mut exporter = Exporter::start(&["--ipc-bucket".as_ref(), size.as_ref()])?;
    let result = (|| -> Result<(String, Value), String> {
        let handle = exporter.handle()?;
        let me = Endpoint::dst(0);
        let (mut rank, _) = GpuIpc::export(0, me, 1 << 20).map_err(|e| e.to_string())?;
        rank.map_peer(0, Endpoint::src(0), &handle, bytes).map_err(|e| e.to_string())?;
        // Never freed: the copy into it may outlive any early return
        // below (this process ends soon after the check).
        let target = std::mem::ManuallyDrop::new(DeviceMemory::for_buffers(dev, me, &[spec(DType::U8, bytes)]).map_err(e2s)?);
        let t = Instant::now();
        // SAFETY: `target` holds `bytes` bytes of this process and is
        // never freed (ManuallyDrop above), on every path out of here.
        unsafe { rank.pull(0, 0, target.device_addrs()[0], bytes) }.map_err(|e| e.to_string())?;
        let in_flight = rank.pulled().map_err(|e| e.to_string())? == Progress::Pending;
        rank.abandon();
        drop(rank);
        // The copy ends on its own; the context must still be usable.
        dev.context().synchronize().map_err(|e| format!("the context after the abort: {e}"))?;
        let copied = t.elapsed();
        let sample: Vec<u8> = (0..4096u32).map(|i| (i * 7 + 3) as u8).collect();
        let mut m = DeviceMemory::for_buffers(dev, me, &[spec(DType::U8, sample.len() as u64)]).map_err(e2s)?;
        m.upload(dev, &RankMemory { buffers: vec![sample.clone()], dtypes: vec![DType::U8] }).map_err(e2s)?;
        if m.download(dev).map_err(e2s)?.buffers[0] != sample {
            return Err("after the abort, bytes uploaded to the device came back different".into());
        }
        let f = [1.5f32, -2.25, 3.0e-3].iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
        let mut want = vec![0u8; 6];
        convert_slice(DType::F32, &f, DType::BF16, &mut want);
        if device_cast(dev, DType::F32, &f, DType::BF16)? != want {
            return Err("after the abort, the cast kernel returned other bytes".into());
        }
        if !in_flight {
            return Err(format!("the {bytes}-byte copy was done before the abort ({copied:?}): nothing was tested"));
        }
        Ok((
            format!("aborted with an {} GiB copy from another process's bucket in flight; it finished in {copied:?}, the context then copied and cast correctly", bytes >> 30),
            json!({ "bytes": bytes, "in_flight_at_abort": in_flight, "copy_s": copied.as_secs_f64() }),
        ))
    })();
    let finished = exporter.finish();
    let r = result?;
    finished?;
    Ok(r)
}
