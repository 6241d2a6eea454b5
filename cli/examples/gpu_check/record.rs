//! What ran: the record every JSON file of the GPU check carries (`run`):
//! the commit the carried build came from (`BUILD_INFO.json`, written by
//! `scripts/gpu-check.sh --build` beside the program: the device machine
//! has no `.git`), the GPU and its UUID, the driver, the CUDA driver API,
//! NVRTC and NCCL versions. Each fact that cannot be had says why
//! (`unavailable: ...`), so a machine without a GPU answers too. The
//! Python checks' files get the same record through `gpu_check --record`
//! (`scripts/gpu_record.py` adds torch's versions).

use serde_json::{json, Map, Value};
use std::path::Path;

/// The file `scripts/gpu-check.sh --build` writes beside the program.
pub(crate) const BUILD_INFO: &str = "BUILD_INFO.json";

/// Where the NVIDIA kernel module says its version.
const DRIVER_VERSION_FILE: &str = "/proc/driver/nvidia/version";

/// The GPU's facts as the CUDA side found them, each a value or why not.
pub(crate) struct GpuFacts {
    pub(crate) name: Result<String, String>,
    pub(crate) uuid: Result<String, String>,
    pub(crate) cuda_driver_api: Result<String, String>,
    pub(crate) nvrtc: Result<String, String>,
    pub(crate) nccl: Result<String, String>,
}

impl GpuFacts {
    /// Every fact unavailable for one reason.
    pub(crate) fn unavailable(why: &str) -> GpuFacts {
        let no = || Err(why.to_string());
        GpuFacts { name: no(), uuid: no(), cuda_driver_api: no(), nvrtc: no(), nccl: no() }
    }
}

fn fact(r: &Result<String, String>) -> Value {
    match r {
        Ok(v) => json!(v),
        Err(e) => json!(format!("unavailable: {e}")),
    }
}

/// The record: the build (from `build_dir`/BUILD_INFO.json), the driver
/// (from the kernel module's version file), and the GPU's facts.
pub(crate) fn gather(build_dir: &Path, gpu: &GpuFacts) -> Value {
    let driver = std::fs::read_to_string(DRIVER_VERSION_FILE)
        .map_err(|e| format!("{DRIVER_VERSION_FILE}: {e}"))
        .and_then(|text| driver_version(&text).ok_or_else(|| format!("{DRIVER_VERSION_FILE}: no version in it")));
    assemble(build_info(build_dir), driver, gpu)
}

/// The record from its parts (see [`gather`]).
pub(crate) fn assemble(build: Map<String, Value>, driver: Result<String, String>, gpu: &GpuFacts) -> Value {
    let mut record = build;
    record.insert("gpu".into(), fact(&gpu.name));
    record.insert("gpu_uuid".into(), fact(&gpu.uuid));
    record.insert("driver".into(), fact(&driver));
    record.insert("cuda_driver_api".into(), fact(&gpu.cuda_driver_api));
    record.insert("nvrtc".into(), fact(&gpu.nvrtc));
    record.insert("nccl".into(), fact(&gpu.nccl));
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or_default();
    record.insert("recorded_unix_s".into(), json!(now));
    Value::Object(record)
}

/// The build's commit, whether its tree was dirty and when it was built,
/// from `dir`/BUILD_INFO.json; a `commit` that says why where the file is
/// missing or not what `--build` writes.
pub(crate) fn build_info(dir: &Path) -> Map<String, Value> {
    let path = dir.join(BUILD_INFO);
    let read = std::fs::read_to_string(&path)
        .map_err(|e| format!("{}: {e} (built without scripts/gpu-check.sh --build?)", path.display()))
        .and_then(|text| serde_json::from_str::<Value>(&text).map_err(|e| format!("{}: {e}", path.display())))
        .and_then(|v| match v {
            Value::Object(m) if m.get("commit").is_some_and(Value::is_string) => Ok(m),
            _ => Err(format!("{}: not an object with a \"commit\" string", path.display())),
        });
    let mut out = Map::new();
    match read {
        Ok(m) => {
            for key in ["commit", "dirty", "built_at"] {
                out.insert(key.into(), m.get(key).cloned().unwrap_or_else(|| json!(format!("unavailable: no \"{key}\" in {BUILD_INFO}"))));
            }
        }
        Err(e) => {
            out.insert("commit".into(), json!(format!("unknown: {e}")));
        }
    }
    out
}

/// The driver version in the NVIDIA kernel module's version text
/// (`NVRM version: NVIDIA UNIX x86_64 Kernel Module  580.159.04  ...`,
/// or `... Open Kernel Module for x86_64  580.65.06  ...`).
pub(crate) fn driver_version(text: &str) -> Option<String> {
    let line = text.lines().find(|l| l.starts_with("NVRM version:"))?;
    line.split_whitespace()
        .find(|w| {
            let parts: Vec<&str> = w.split('.').collect();
            parts.len() >= 2 && parts.iter().all(|p| !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit()))
        })
        .map(str::to_string)
}

/// The build folder of this program (where `BUILD_INFO.json` lies).
pub(crate) fn program_dir() -> std::path::PathBuf {
    std::env::current_exe().ok().and_then(|p| p.parent().map(Path::to_path_buf)).unwrap_or_else(|| ".".into())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_driver_version_is_read_from_either_kernel_module() {
        let proprietary = "NVRM version: NVIDIA UNIX x86_64 Kernel Module  580.159.04  Thu Oct  9 2025\nGCC version:  gcc version 12.2.0\n";
        let open = "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.65.06  Release Build  (dvs-builder@U16)\n";
        assert_eq!(driver_version(proprietary).as_deref(), Some("580.159.04"));
        assert_eq!(driver_version(open).as_deref(), Some("580.65.06"));
        assert_eq!(driver_version("GCC version: 12.2.0\n"), None, "only the NVRM line counts");
        assert_eq!(driver_version("NVRM version: unknown\n"), None);
    }

    #[test]
    fn the_record_says_why_each_fact_is_missing_without_a_gpu_or_a_build_info() {
        let dir = std::env::temp_dir().join(format!("gpu-record-none-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let r = assemble(build_info(&dir), Err("no /proc/driver/nvidia".into()), &GpuFacts::unavailable("no CUDA driver"));
        assert!(r["commit"].as_str().unwrap().starts_with("unknown: "), "{r}");
        assert!(r["commit"].as_str().unwrap().contains(BUILD_INFO), "{r}");
        for key in ["gpu", "gpu_uuid", "cuda_driver_api", "nvrtc", "nccl"] {
            assert_eq!(r[key], json!("unavailable: no CUDA driver"), "{key}");
        }
        assert_eq!(r["driver"], json!("unavailable: no /proc/driver/nvidia"));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn the_record_carries_the_build_and_the_gpu() {
        let dir = std::env::temp_dir().join(format!("gpu-record-build-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join(BUILD_INFO), r#"{"commit": "3273ca8", "dirty": true, "built_at": "2026-12-07T09:00:00Z"}"#).unwrap();
        let gpu = GpuFacts {
            name: Ok("NVIDIA H100 80GB HBM3".into()),
            uuid: Ok("GPU-0000".into()),
            cuda_driver_api: Ok("13.0".into()),
            nvrtc: Ok("13.0".into()),
            nccl: Err("libnccl.so: cannot open".into()),
        };
        let r = assemble(build_info(&dir), Ok("580.159.04".into()), &gpu);
        assert_eq!((&r["commit"], &r["dirty"], &r["built_at"]), (&json!("3273ca8"), &json!(true), &json!("2026-12-07T09:00:00Z")));
        assert_eq!((&r["gpu"], &r["gpu_uuid"], &r["driver"]), (&json!("NVIDIA H100 80GB HBM3"), &json!("GPU-0000"), &json!("580.159.04")));
        assert_eq!(r["nccl"], json!("unavailable: libnccl.so: cannot open"));
        // Not what --build writes: said so, not trusted.
        std::fs::write(dir.join(BUILD_INFO), r#"{"dirty": false}"#).unwrap();
        assert!(build_info(&dir)["commit"].as_str().unwrap().contains("not an object with a \"commit\" string"));
        std::fs::write(dir.join(BUILD_INFO), "{").unwrap();
        assert!(build_info(&dir)["commit"].as_str().unwrap().starts_with("unknown: "));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
