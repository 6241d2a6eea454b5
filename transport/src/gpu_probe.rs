//! Whether the GPU data plane can run in this process: built with the
//! `cuda` feature, and the CUDA driver and NCCL libraries loadable. Always
//! compiled, so the CLI can ask in every build.

/// `Ok(())` if the GPU data plane can run here; otherwise why not, as one
/// line (print it as `CUDA transport unavailable: {reason}`).
///
/// Without the `cuda` feature this is always
/// `Err("built without the cuda feature")`. With it, it checks that the
/// CUDA driver library (`libcuda.so`) and NCCL are loadable and that the
/// driver initialises, without panicking: cudarc panics when a library is
/// missing, so presence is checked first and a panic is caught as a second
/// line of defence. It does not open a device.
pub fn cuda_available() -> Result<(), String> {
    #[cfg(feature = "cuda")]
    {
        crate::cuda::device::probe()
    }
    #[cfg(not(feature = "cuda"))]
    {
        Err("built without the cuda feature".to_string())
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn never_panics_and_explains() {
        match super::cuda_available() {
            Ok(()) => {}
            Err(e) => {
                assert!(!e.is_empty());
                #[cfg(not(feature = "cuda"))]
                assert_eq!(e, "built without the cuda feature");
            }
        }
    }
}
