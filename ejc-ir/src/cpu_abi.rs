//! The C ABI of CPU kernels: what `ejc-codegen`'s CPU back end emits and what
//! `ejc-runtime`'s CPU executor calls. Both sides use these definitions, so the
//! layout is stated once.
//!
//! It also names the x86-64 ISA levels ([`Isa`]) that code is built for, so the
//! runtime can pick the library matching the machine without LLVM.
//!
//! Every CPU kernel is one exported function:
//!
//! ```c
//! typedef struct {
//!     void   *data;        /* element [0, 0, ...]                         */
//!     int64_t shape[4];    /* extents; unused axes are 1                   */
//!     int64_t strides[4];  /* in elements; any value, 0 broadcasts         */
//! } EjcTensor;             /* 72 bytes                                     */
//!
//! void entry(const EjcTensor *tensors,   /* the tensor parameters, in ABI order  */
//!            const uint64_t  *scalars,   /* the scalar parameters, in ABI order  */
//!            const int64_t   *grid,      /* [3]: the launch grid                 */
//!            int64_t begin, int64_t end, /* run programs begin..end              */
//!            void *scratch);             /* scratch_bytes (manifest), 64-aligned  */
//! ```
//!
//! A tensor of rank at most 4 is one `EjcTensor`. A tensor of higher rank (the
//! split-KV temporaries are rank 5) continues in the following descriptors, four axes
//! each: axis `a` is `shape[a % 4]` / `strides[a % 4]` of descriptor `a / 4` of the
//! tensor, and the continuation's `data` is unused ([`tensor_slots`],
//! [`descriptors`]). Kernels whose tensors all have rank 4 or less see the layout
//! above unchanged.
//!
//! Programs are numbered `p = pid0 + grid[0] * (pid1 + grid[1] * pid2)`, so a range of
//! consecutive programs walks the query blocks of one head first (they share K and V).
//! Scalars sit in the low bits of their 64-bit slot: f32 as its IEEE bits, i32/u32 as
//! their 32 bits. Each thread passes its own scratch buffer (the kernel keeps its tiles
//! there, not on the stack); `scratch_bytes` comes from the manifest.

/// One tensor argument (see the module docs). `#[repr(C)]`: the layout is the ABI.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EjcTensor {
    pub data: *mut u8,
    pub shape: [i64; 4],
    pub strides: [i64; 4],
}

/// Something that runs a CPU kernel's grid over [`EjcTensor`] descriptors: a CPU
/// library's entry (ejc-runtime), a kernel compiled by MLIR (ejc-codegen). Plans launch
/// through it (`ejc_runtime::exec::HostPlan`).
pub trait HostLaunch {
    /// # Safety
    /// `tensors` and `scalars` must match the kernel's parameters, every tensor's
    /// shape and strides must stay inside its memory, outputs must not overlap inputs.
    unsafe fn launch(
        &self,
        tensors: &[EjcTensor],
        scalars: &[u64],
        grid: [i64; 3],
        threads: usize,
    ) -> Result<(), String>;
}

/// Largest tensor rank the ABI carries.
pub const MAX_RANK: usize = 4;

/// Size of [`EjcTensor`] in bytes (asserted at compile time below).
pub const TENSOR_SIZE: usize = 72;

const _: () = assert!(std::mem::size_of::<EjcTensor>() == TENSOR_SIZE);

/// How many [`EjcTensor`] descriptors a tensor of `rank` takes: one per four axes, at
/// least one.
pub fn tensor_slots(rank: usize) -> usize {
    rank.div_ceil(MAX_RANK).max(1)
}

/// The descriptors of one tensor of any rank (see the module docs): unused axes have
/// extent 1 and stride 0; continuation descriptors repeat `data`, which kernels do not
/// read there.
///
/// ```
/// use ejc_ir::cpu_abi::descriptors;
/// let d = descriptors(std::ptr::null_mut(), &[2, 3, 4, 5, 6], &[360, 120, 30, 6, 1]);
/// assert_eq!(d.len(), 2);
/// assert_eq!(d[0].shape, [2, 3, 4, 5]);
/// assert_eq!((d[1].shape, d[1].strides), ([6, 1, 1, 1], [1, 0, 0, 0]));
/// ```
pub fn descriptors(data: *mut u8, shape: &[i64], strides: &[i64]) -> Vec<EjcTensor> {
    assert_eq!(shape.len(), strides.len(), "one stride per axis");
    (0..tensor_slots(shape.len()))
        .map(|slot| {
            let mut t = EjcTensor { data, shape: [1; MAX_RANK], strides: [0; MAX_RANK] };
            let axes = slot * MAX_RANK..shape.len().min((slot + 1) * MAX_RANK);
            for (k, a) in axes.enumerate() {
                t.shape[k] = shape[a];
                t.strides[k] = strides[a];
            }
            t
        })
        .collect()
}

/// The entry point's type.
pub type EntryFn = unsafe extern "C" fn(
    tensors: *const EjcTensor,
    scalars: *const u64,
    grid: *const i64,
    begin: i64,
    end: i64,
    scratch: *mut u8,
);

/// Alignment of the scratch buffer and of every tile in it.
pub const SCRATCH_ALIGN: usize = 64;

// ---- instruction-set levels ----

use std::fmt;
use std::str::FromStr;

/// An ISA level. Each is a superset of the next: code for `X86_64` runs everywhere.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Isa {
    /// SSE2 only (x86-64 baseline).
    X86_64,
    /// x86-64-v3: AVX2 and FMA.
    Avx2,
    /// x86-64-v4: AVX-512 F/BW/DQ/VL.
    Avx512,
    /// x86-64-v4 plus AVX512_BF16 (`vdpbf16ps`: bf16 pairs dotted into f32).
    Avx512Bf16,
    /// `Avx512Bf16` plus AMX (AMX-TILE, AMX-BF16): bf16 products on 16 × 32 tiles
    /// (`tdpbf16ps`), Intel Sapphire Rapids and later. Needs the kernel's permission to use
    /// the tile registers ([`enable_amx`]), which [`Isa::host_max`] asks for.
    Amx,
}

impl Isa {
    pub const ALL: [Isa; 5] = [Isa::Amx, Isa::Avx512Bf16, Isa::Avx512, Isa::Avx2, Isa::X86_64];

    pub fn name(self) -> &'static str {
        match self {
            Isa::X86_64 => "x86-64",
            Isa::Avx2 => "avx2",
            Isa::Avx512 => "avx512",
            Isa::Avx512Bf16 => "avx512bf16",
            Isa::Amx => "amx",
        }
    }

    /// The level ejc builds for on this machine by default: the best one it runs,
    /// except that AVX512_BF16 without AMX is used only where `vdpbf16ps` is measured
    /// faster than converting to f32 (else only when asked for, `cpu:avx512bf16`). On
    /// the Intel Xeon (Emerald Rapids) that ejc is measured on, `vdpbf16ps` issues at
    /// half the rate of two FMA pipes, so bf16 kernels run faster converted to f32
    /// unless AMX tiles take the products; on an AMD Zen 5 (family 1Ah) the same bf16
    /// kernels ran 1.7–1.9× faster with it, forward and backward (docs/perf.md has the
    /// figures). Zen 4 is not measured and keeps the conversion.
    pub fn host() -> Isa {
        match Isa::host_max() {
            Isa::Avx512Bf16 if !bf16_dot_pays() => Isa::Avx512,
            other => other,
        }
    }

    /// The best level this machine runs.
    pub fn host_max() -> Isa {
        #[cfg(target_arch = "x86_64")]
        {
            let v4 = std::is_x86_feature_detected!("avx512f")
                && std::is_x86_feature_detected!("avx512bw")
                && std::is_x86_feature_detected!("avx512dq")
                && std::is_x86_feature_detected!("avx512vl");
            if v4 && std::is_x86_feature_detected!("avx512bf16") {
                if cpuid_amx() && enable_amx().is_ok() {
                    return Isa::Amx;
                }
                return Isa::Avx512Bf16;
            }
            if v4 {
                return Isa::Avx512;
            }
            if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
                return Isa::Avx2;
            }
        }
        Isa::X86_64
    }

    /// Whether this machine can run code built for `self`.
    pub fn runs_here(self) -> bool {
        self <= Isa::host_max()
    }

    /// LLVM target CPU and features.
    pub fn llvm_cpu_features(self) -> (&'static str, &'static str) {
        match self {
            Isa::X86_64 => ("x86-64", ""),
            Isa::Avx2 => ("x86-64-v3", ""),
            Isa::Avx512 => ("x86-64-v4", ""),
            Isa::Avx512Bf16 => ("x86-64-v4", "+avx512bf16"),
            Isa::Amx => ("x86-64-v4", "+avx512bf16,+amx-tile,+amx-bf16"),
        }
    }

    /// f32 lanes of one vector register.
    pub fn lanes(self) -> usize {
        match self {
            Isa::X86_64 => 4,
            Isa::Avx2 => 8,
            Isa::Avx512 | Isa::Avx512Bf16 | Isa::Amx => 16,
        }
    }

    /// Vector registers.
    pub fn registers(self) -> usize {
        match self {
            Isa::X86_64 | Isa::Avx2 => 16,
            Isa::Avx512 | Isa::Avx512Bf16 | Isa::Amx => 32,
        }
    }

    /// `vdpbf16ps` and the native bf16 conversions.
    pub fn has_bf16_dot(self) -> bool {
        self >= Isa::Avx512Bf16
    }

    /// AMX tiles with `tdpbf16ps`.
    pub fn has_amx(self) -> bool {
        self == Isa::Amx
    }
}

impl fmt::Display for Isa {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Isa {
    type Err = String;
    fn from_str(s: &str) -> Result<Isa, String> {
        Isa::ALL
            .into_iter()
            .find(|i| i.name() == s)
            .ok_or_else(|| format!("unknown CPU ISA `{s}` (known: amx, avx512bf16, avx512, avx2, x86-64)"))
    }
}

/// Whether the CPU has AMX-TILE and AMX-BF16 (CPUID leaf 7, EDX bits 24 and 22).
/// `std::is_x86_feature_detected!` does not know them on stable Rust yet.
/// Whether `vdpbf16ps` beats converting bf16 to f32 for the products, by measurement:
/// AMD family 1Ah (Zen 5) and later.
fn bf16_dot_pays() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        let v = std::arch::x86_64::__cpuid(0);
        let amd = [v.ebx, v.edx, v.ecx] == [0x6874_7541, 0x6974_6e65, 0x444d_4163]; // "AuthenticAMD"
        let eax = std::arch::x86_64::__cpuid(1).eax;
        let base = (eax >> 8) & 0xf;
        let family = if base == 0xf { base + ((eax >> 20) & 0xff) } else { base };
        amd && family >= 0x1a
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

fn cpuid_amx() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        // Leaf 7 is valid when leaf 0 says so.
        if std::arch::x86_64::__cpuid(0).eax >= 7 {
            let edx = std::arch::x86_64::__cpuid_count(7, 0).edx;
            return edx & (1 << 24) != 0 && edx & (1 << 22) != 0;
        }
    }
    false
}

/// Ask the operating system for the AMX tile state (Linux: `arch_prctl(ARCH_REQ_XCOMP_PERM,
/// XFEATURE_XTILEDATA)`; the permission is the whole process's, every thread included).
/// Kernels built for [`Isa::Amx`] die with SIGILL without it, so the runtime asks before it
/// runs one ([`Isa::host_max`] does). Asked once; later calls return the first answer.
pub fn enable_amx() -> Result<(), String> {
    static ANSWER: std::sync::OnceLock<Result<(), String>> = std::sync::OnceLock::new();
    ANSWER.get_or_init(request_amx).clone()
}

#[cfg(all(target_os = "linux", target_arch = "x86_64"))]
fn request_amx() -> Result<(), String> {
    const ARCH_GET_XCOMP_SUPP: libc::c_long = 0x1021;
    const ARCH_REQ_XCOMP_PERM: libc::c_long = 0x1023;
    const XFEATURE_XTILEDATA: libc::c_long = 18;
    if !cpuid_amx() {
        return Err("this CPU has no AMX (CPUID leaf 7: AMX-TILE and AMX-BF16)".into());
    }
    let mut supported: u64 = 0;
    // SAFETY: arch_prctl with these codes reads no memory of ours but the one u64 it fills.
    let rc = unsafe { libc::syscall(libc::SYS_arch_prctl, ARCH_GET_XCOMP_SUPP, &mut supported as *mut u64) };
    if rc != 0 || supported & (1 << XFEATURE_XTILEDATA) == 0 {
        return Err("the kernel does not offer AMX tile state (arch_prctl ARCH_GET_XCOMP_SUPP; Linux 5.16+)".into());
    }
    // SAFETY: as above; no memory is passed.
    let rc = unsafe { libc::syscall(libc::SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) };
    if rc != 0 {
        return Err(format!(
            "the kernel refused AMX tile state (arch_prctl ARCH_REQ_XCOMP_PERM: {})",
            std::io::Error::last_os_error()
        ));
    }
    Ok(())
}

#[cfg(not(all(target_os = "linux", target_arch = "x86_64")))]
fn request_amx() -> Result<(), String> {
    Err("AMX kernels are supported on Linux x86-64 only".into())
}
