//! A C entry point into the CPU executor, for programs that are not Rust.
//!
//! ```c
//! // libejc_runtime_capi.so (cargo build --release -p ejc-runtime-capi)
//! int32_t ejc_cpu_launch(void (*entry)(...),           // a kernel's entry symbol
//!                        const EjcTensor *tensors, const uint64_t *scalars,
//!                        const int64_t grid[3], uint64_t scratch_bytes, uint32_t threads);
//! ```
//!
//! It runs the grid on the same thread pool as `ejc bench` (0 = all cores) and returns
//! 0, or a negative number when the arguments are unusable (null entry, negative grid,
//! no threads). The tensors are not checked: the caller guarantees they match the
//! kernel's ABI (docs/abi.md), as with any C function.

use ejc_ir::cpu_abi::{EjcTensor, EntryFn};

use ejc_runtime::cpu::CpuKernel;

/// # Safety
/// `tensors`, `scalars` and `grid` must point to arrays as long as the kernel's ABI
/// says; the tensors' memory must match their shapes and strides.
#[no_mangle]
pub unsafe extern "C" fn ejc_cpu_launch(
    entry: Option<EntryFn>,
    tensors: *const EjcTensor,
    scalars: *const u64,
    grid: *const i64,
    scratch_bytes: u64,
    threads: u32,
) -> i32 {
    let Some(entry) = entry else { return -1 };
    if grid.is_null() {
        return -2;
    }
    let g = [*grid, *grid.add(1), *grid.add(2)];
    let kernel = CpuKernel { entry, scratch_bytes: scratch_bytes as usize };
    match kernel.launch_raw(tensors, scalars, g, threads as usize) {
        Ok(()) => 0,
        Err(_) => -3,
    }
}
