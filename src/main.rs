//! The `ejc` command line. Each subcommand lives in `ejc::cli`; this file only parses
//! arguments and maps outcomes to exit codes:
//!
//! * 0 — success;
//! * 1 — a check failed (a kernel's result is outside the tolerance);
//! * 2 — the input is wrong (bad spec, bad flag value) or asks for something this
//!   build cannot do (a back end that is not built yet).

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Args, Parser, Subcommand, ValueEnum};
use ejc::cli::{self, Outcome};

const AFTER_HELP: &str = "\
Examples:
  ejc check specs/flash.yaml                 validate a spec and every kernel it declares
  ejc list specs/mean_pooling.yaml           what a spec expands to (any operation: the spec names it)
  ejc build specs/flash.yaml -o out          write artifacts and out/manifest.json
  ejc run specs/flash.yaml --backend interp  run every variant on random inputs against the reference
  ejc run specs/mean_pooling.yaml --backend cpu --size batch=2,seq=300,chunk_size=32
  ejc run specs/page_attention.yaml --backend cpu --size num_seqs=8,page_size=16,max_context=1000
  ejc run specs/blocksparse.yaml --backend cpu --variant document --size seq_q=1000,seq_k=1000
  ejc run specs/blocksparse_bwd.yaml --backend cpu --variant strided --size seq_q=500,seq_k=500
  ejc bench specs/flash.yaml --variant causal --dtype f32 --shape 1,2048,2048,8,8,128
  ejc tune specs/flash.yaml --variant causal --dtype bf16 --size batch=1,seq_q=2048,seq_k=2048,heads_q=8,heads_kv=8,head_dim=128
  ejc cache ls                               what this machine's tuning cache holds

Sizes: every operation names its sizes. Give them as --size NAME=N,... (any subset: the
rest keep their defaults) or positionally, in this order, as --shape N,N,... (the shorthand):
  flash (fwd, bwd)   batch, seq_q, seq_k, heads_q, heads_kv, head_dim[, head_dim_v]
  mean_pooling       batch, seq, heads, head_dim, chunk_size
  page_attention     num_seqs, heads_q, heads_kv, head_dim, page_size, max_context
                     [, min_context, num_pages]
  ragged_decode_attention
                     batch, seq, heads_q, heads_kv, head_dim[, min_len]
  ragged_page_attention, ragged_page_attention_v3
                     num_seqs, heads_q, heads_kv, head_dim, page_size, max_context,
                     max_q_len[, num_pages, min_context, prefill_seqs]
  blocksparse_attention (and _bwd)
                     batch, heads_q, heads_kv, seq_q, seq_k, head_dim[, head_dim_v,
                     doc_len, mask_heads]
(head_dim_v: where v's head dim differs from q's.)

Exit status: 0 success, 1 a result outside its tolerance, 2 bad input or an unsupported request.
Docs: docs/spec.md (spec format), docs/semantics.md (what each feature means), docs/abi.md (manifest).";

/// ejc: attention kernels declared once in a tiling DSL, compiled to tile IR and
/// from there to GPU and CPU code, checked against a reference and tuned.
#[derive(Parser)]
#[command(name = "ejc", version, about, long_about = None, after_help = AFTER_HELP)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Validate a spec: parse it, build the tile IR of every kernel, run the pass
    /// pipeline and verify the result. Prints a one-line summary, or diagnostics
    /// with file:line:column (exit 2).
    Check {
        /// The spec file (YAML), e.g. specs/flash.yaml.
        spec: PathBuf,
    },
    /// List the kernels a spec expands to (variant x dtype x head_dim x tiling) and
    /// the candidate configurations (num_warps x num_stages) of each.
    List {
        spec: PathBuf,
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Compile a spec: write one artifact per kernel x configuration x target, and
    /// DIR/manifest.json describing each (entry symbol, parameter ABI, launch grid).
    #[command(
        after_help = "Targets: ir (tile IR text after the pass pipeline); cpu[:isa] (one .so per ISA); ptx:<arch> \
(sm_80, sm_86, sm_89, sm_90, sm_90a; `ptx` = sm_80 and sm_90a): one .ptx per kernel x num_warps x num_stages \
(sm_90a: x mma.sync/wgmma), bf16/f16 only, each file with a general entry and an aligned one that launchers call \
when the tensors are aligned (docs/abi.md). mlir:cpu writes each kernel's verified MLIR module (func/scf/arith/math/vector/memref); mlir:gpu \
writes the gpu-dialect module and its PTX from MLIR's NVVM pipeline (`mlir` = both; docs/mlir.md). Without --target, \
every target the spec lists that this ejc can build is built, and the others are named on stderr. \
--report runs ptxas on every PTX file (registers, spills, shared memory; one line per entry); with \
--drop-spilling the candidates that spill are left out of the build (a tuned configuration must not spill). \
Compiled code (PTX, CPU objects, MLIR's output) is cached on disk, keyed by each kernel's tile IR, the target \
and the compiler (and --report's ptxas reports, keyed by the PTX and ptxas's version), so a second build of an unchanged spec takes seconds and an edited variant recompiles only its \
own kernels (the cache directory is the tuning cache's, see `ejc cache`; --no-cache compiles everything). A progress \
bar shows counts and an ETA on a terminal. A build that fails removes the files and directories it created (what was there before stays), and writes no \
manifest.\n\nFor looking inside: EJC_DUMP_IR=<dir> writes the tile IR after every pass; EJC_DUMP_SCHEDULE=<dir> each PTX \
entry's schedule (product paths and operands, the loops' copies, ping-pong, every wgmma wait) with its tile IR, ops \
numbered; EJC_DUMP_LLVM=<dir> each PTX configuration's LLVM IR as emitted and as optimised (no cache then); \
EJC_DUMP_MLIR=<dir> the MLIR module after every stage."
    )]
    Build {
        spec: PathBuf,
        /// Output directory (created if missing).
        #[arg(short, long, default_value = "out")]
        out: PathBuf,
        /// Target to build; repeat for several (ir, cpu, cpu:avx512, ptx:sm_90a, mlir:cpu, mlir ...).
        #[arg(long = "target", value_name = "TARGET")]
        targets: Vec<String>,
        #[command(flatten)]
        filter: Filter,
        /// Only this value of a compile-time key (repeat for several), e.g. head_dim=128;
        /// head_dim_v=128 selects the kernels whose v has a head dim of its own.
        #[arg(long = "key", value_name = "NAME=N")]
        keys: Vec<String>,
        /// Only this value of a schedule axis (repeat for several), e.g. block_m=64 or
        /// num_splits=8; an axis not named keeps all of the spec's values.
        #[arg(long = "config", value_name = "NAME=N")]
        config: Vec<String>,
        /// Only this block_m (shorthand for --config block_m=N; repeat for several).
        #[arg(long = "block-m", value_name = "N")]
        block_m: Vec<u32>,
        /// Only this block_n (shorthand for --config block_n=N; repeat for several).
        #[arg(long = "block-n", value_name = "N")]
        block_n: Vec<u32>,
        /// GPU targets: only this num_warps (shorthand for --config num_warps=N).
        #[arg(long = "num-warps", value_name = "N")]
        num_warps: Vec<u32>,
        /// GPU targets: only this num_stages (shorthand for --config num_stages=N).
        #[arg(long = "num-stages", value_name = "N")]
        num_stages: Vec<u32>,
        /// Only this plan (repeat for several): the operation's names, e.g. single, split_kv.
        #[arg(long = "plan", value_name = "PLAN")]
        plans: Vec<String>,
        /// PTX targets: only this code path (repeat for several): mma (mma.sync), wgmma
        /// (sm_90a), ws (sm_90a, warp-specialised: a producer warpgroup with TMA copies).
        /// Kernels without a product (a plan's layout or pack step) have one path and stay.
        #[arg(long = "path", value_name = "PATH", value_parser = ["mma", "wgmma", "ws"])]
        paths: Vec<String>,
        /// Assemble every PTX file with ptxas and print registers, spills and shared
        /// memory per entry point (ptxas from $EJC_PTXAS, .tools/ or the PATH; the report
        /// of PTX ptxas has seen before comes from the compiled-code cache).
        #[arg(long)]
        report: bool,
        /// With --report: leave out every PTX candidate one of whose entry points spills
        /// registers (file and manifest entry), so that no tuned configuration spills.
        #[arg(long, requires = "report")]
        drop_spilling: bool,
        /// Compile everything, neither reading nor writing the compiled-code cache
        /// (same as EJC_CODE_CACHE=off).
        #[arg(long)]
        no_cache: bool,
        /// Print nothing but errors.
        #[arg(short, long)]
        quiet: bool,
    },
    /// Run kernels of a spec on fresh random inputs, compare each with the operation's
    /// reference, and print rel_err (||out - ref|| / ||ref||) and max_abs_err of the first
    /// output and <name>_rel_err of the others. Exits 1 when a result is outside its
    /// tolerance (f32 1e-5, f16 5e-3, bf16 1e-2).
    #[command(after_help = "Without --variant every variant of the spec runs, each through its first plan (--plan \
names another: split_kv runs flash's two-kernel split-KV plan). Inputs are N(0, 1) and never zero, laid out to \
catch stride bugs (flash: k and v non-contiguous, bias and mask broadcast through zero strides); varlen batches \
have uneven lengths. The seed is printed: pass it back with --seed to reproduce a run.\n\nExamples:\n  \
ejc run specs/flash.yaml --backend cpu --dtype f32 --shape 1,300,300,8,2,128\n  \
ejc run specs/flash.yaml --backend cpu --dtype f32 --size batch=1,seq_q=300,seq_k=300,heads_q=8,heads_kv=2,head_dim=128\n  \
ejc run specs/mean_pooling.yaml --backend mlir --size seq=300,chunk_size=7\n  \
ejc run specs/flash_decode.yaml --backend cpu --plan split_kv --config num_splits=4 --size seq_q=1,seq_k=1000")]
    Run(RunArgs),
    /// Time one variant on fresh random inputs: median time and GFLOP/s (flash: FLOPs =
    /// 4*b*h*s_q*s_k*d, halved for causal) or GB/s (memory-bound operations such as
    /// mean_pooling). Benchmarks are not tests: nothing is asserted.
    #[command(
        after_help = "Example: ejc bench specs/flash.yaml --variant causal --dtype f32 --shape 1,4096,4096,8,8,128 --threads 2\n\
Every plan and configuration of the spec is timed (listed on stderr) and the fastest is reported, unless \
--plan / --config / --block-m / --block-n narrow them."
    )]
    Bench(BenchArgs),
    /// Autotune one call: compile every candidate of the spec (every plan and
    /// configuration) for this CPU or the GPU at hand, check each against the reference
    /// on a small case, time the rest on fresh random inputs, and store the winner (with
    /// every timing) in this device's tuning cache.
    #[command(
        after_help = "Examples:\n  ejc tune specs/flash.yaml --variant causal --dtype bf16 --shape 1,2048,2048,8,8,128 --threads 2\n  \
ejc tune specs/flash_decode.yaml --backend cuda --variant causal --size batch=4,seq_q=1,seq_k=8192,heads_q=32,heads_kv=8,head_dim=128\n\
The cache lives in $EJC_CACHE_DIR, else $XDG_CACHE_HOME/ejc, else ~/.cache/ejc (see `ejc cache`; with none of \
them set, in memory only), one file per device (a CPU, a GPU). A call tuned here is found by ejc_runtime's calls \
(`Runtime::call`, `flash_attention`, `ejc-gpu call`) for the same size bucket, features, build and CPU thread count, \
on the same device."
    )]
    Tune(TuneArgs),
    /// Inspect or clear this machine's tuning cache (and, with `clear --code`, the
    /// compiled-code cache `ejc build` keeps beside it).
    Cache {
        #[command(subcommand)]
        action: CacheAction,
        /// The cache directory (default: $EJC_CACHE_DIR, else $XDG_CACHE_HOME/ejc, else ~/.cache/ejc).
        /// `ls` and `show` only read: they create and move nothing.
        #[arg(long, global = true)]
        cache_dir: Option<PathBuf>,
    },
}

#[derive(Subcommand)]
enum CacheAction {
    /// One line per tuned call: the chosen configuration and the call; then the
    /// compiled-code cache's size per back end.
    Ls,
    /// Everything about entries (all, or those whose key or call contains FILTER, or
    /// the entry numbered FILTER in `ls`): key parts, every candidate's time and status.
    Show { filter: Option<String> },
    /// Remove every tuning entry.
    Clear {
        /// Remove the compiled code instead (PTX, CPU objects, MLIR output: the next
        /// build compiles everything again); tuning entries stay.
        #[arg(long)]
        code: bool,
    },
}

#[derive(Args)]
struct TuneArgs {
    #[command(flatten)]
    problem: ProblemArgs,
    /// Where to tune: cpu, or cuda (the GPU at hand; its own cache file).
    #[arg(long, value_enum, default_value = "cpu")]
    backend: Backend,
    /// Worker threads (0 = all cores; at most 4 x the cores, at least 64: EJC_MAX_THREADS raises it).
    #[arg(long, default_value_t = 0)]
    threads: usize,
    /// Timed runs per candidate (the median is kept).
    #[arg(long, default_value_t = 7)]
    reps: usize,
    /// The cache directory (default: $EJC_CACHE_DIR, else $XDG_CACHE_HOME/ejc, else ~/.cache/ejc).
    #[arg(long)]
    cache_dir: Option<PathBuf>,
    /// Tune again even if the cache already has this call.
    #[arg(long)]
    force: bool,
    /// Only plans that give the same bits on every run (the flash backward's two_pass, not
    /// its atomic): what a call with `CallOptions::deterministic` gets, cached apart.
    #[arg(long)]
    deterministic: bool,
}

#[derive(Args)]
struct Filter {
    /// Only this variant (repeat for several).
    #[arg(long = "variant", value_name = "NAME")]
    variants: Vec<String>,
    /// Only this dtype (repeat for several).
    #[arg(long = "dtype", value_name = "DTYPE")]
    dtypes: Vec<String>,
    /// Only this head dim (shorthand for --key head_dim=D; repeat for several).
    #[arg(long = "head-dim", value_name = "D")]
    head_dims: Vec<u32>,
}

#[derive(Clone, Copy, ValueEnum)]
enum Backend {
    /// The tile-IR interpreter (slow, exact: f64 arithmetic).
    Interp,
    /// Native CPU code, compiled in-process (JIT) for the host ISA.
    Cpu,
    /// CUDA: PTX compiled in this process for the GPU at hand (sm_90a on Hopper), run
    /// through the driver; says "skipped" and exits 0 where there is no driver. On a GPU
    /// machine without LLVM, `ejc-gpu` runs prebuilt artifacts instead (docs/gpu.md).
    Cuda,
    /// Through MLIR: upstream dialects, MLIR's pass pipelines, its ExecutionEngine
    /// (compiled code is cached on disk: docs/mlir.md).
    Mlir,
}

impl Backend {
    fn name(self) -> &'static str {
        match self {
            Backend::Interp => "interp",
            Backend::Cpu => "cpu",
            Backend::Cuda => "cuda",
            Backend::Mlir => "mlir",
        }
    }
}

/// The problem to run: which kernels, which sizes, which run-time scalars.
#[derive(Args)]
struct ProblemArgs {
    spec: PathBuf,
    /// Variant (repeat for several; `run` defaults to all).
    #[arg(long = "variant", value_name = "NAME")]
    variants: Vec<String>,
    /// Input dtype: bf16, f16 or f32 (must be one of the spec's).
    #[arg(long, default_value = "bf16")]
    dtype: String,
    /// Sizes, positionally in the operation's order (`ejc --help` lists every operation's), e.g. flash
    /// batch,seq_q,seq_k,heads_q,heads_kv,head_dim[,head_dim_v]. Compile-time sizes (head_dim) must be the spec's;
    /// for varlen variants batch is the number of sequences and the lengths are random up to the sizes.
    #[arg(long)]
    shape: Option<String>,
    /// Sizes by name, NAME=N,... (repeatable; the rest keep their defaults), e.g.
    /// --size batch=2,seq_q=300.
    #[arg(long = "size", value_name = "NAME=N,...")]
    sizes: Vec<String>,
    /// Schedule values, NAME=N,... (repeatable): a tiling (block_m=64,block_n=32), a run-time axis
    /// (num_splits=8). `run` takes the spec's first value of every axis not given; `bench` times them all.
    #[arg(long = "config", value_name = "NAME=N,...")]
    config: Vec<String>,
    /// Tiling shorthands (--config block_m=N / block_n=N).
    #[arg(long)]
    block_m: Option<u32>,
    #[arg(long)]
    block_n: Option<u32>,
    /// The plan: `run` runs the operation's first unless given; `bench`/`tune` time every plan unless given.
    #[arg(long)]
    plan: Option<String>,
    /// A run-time scalar, NAME=V (repeatable), e.g. softmax_scale=0.1; default: the operation's test values.
    #[arg(long = "scalar", value_name = "NAME=V")]
    scalars: Vec<String>,
    /// Attention shorthand: sliding window left,right (window_left/window_right; default seq_k/3, seq_k/5).
    #[arg(long, value_name = "LEFT,RIGHT", allow_hyphen_values = true)]
    window: Option<String>,
    /// Attention shorthand: soft cap (logits_soft_cap; default 5.0).
    #[arg(long)]
    softcap: Option<f64>,
    /// Attention shorthand: dropout probability (dropout_p; default 0.2).
    #[arg(long)]
    dropout: Option<f64>,
    /// CPU ISA to compile for: amx, avx512bf16, avx512, avx2, x86-64 (default: the host's
    /// best; AVX512_BF16 without AMX only on AMD Zen 5, where it is measured faster).
    #[arg(long)]
    isa: Option<String>,
    /// The most host memory a call's tensors may take, e.g. 64G, 512M or `none`
    /// (default: $EJC_MEMORY_LIMIT, else 3/4 of this machine's memory). Sizes that need
    /// more are refused before anything is allocated.
    #[arg(long, value_name = "SIZE")]
    memory_limit: Option<String>,
}

impl ProblemArgs {
    fn flags(self) -> cli::common::ProblemFlags {
        cli::common::ProblemFlags {
            spec: self.spec,
            variants: self.variants,
            dtype: self.dtype,
            shape: self.shape,
            sizes: self.sizes,
            config: self.config,
            block_m: self.block_m,
            block_n: self.block_n,
            plan: self.plan,
            scalars: self.scalars,
            window: self.window,
            softcap: self.softcap,
            dropout: self.dropout,
            isa: self.isa,
            memory_limit: self.memory_limit,
        }
    }
}

#[derive(Args)]
struct RunArgs {
    #[command(flatten)]
    problem: ProblemArgs,
    /// Where to run.
    #[arg(long, value_enum, default_value = "interp")]
    backend: Backend,
    /// Seed of the random inputs (default: fresh, printed).
    #[arg(long)]
    seed: Option<u64>,
    /// Worker threads for the cpu backend (0 = all cores; at most 4 x the cores, at least 64:
    /// EJC_MAX_THREADS raises it).
    #[arg(long, default_value_t = 0)]
    threads: usize,
    /// Print one JSON object per kernel instead of text.
    #[arg(long)]
    json: bool,
}

#[derive(Args)]
struct BenchArgs {
    #[command(flatten)]
    problem: ProblemArgs,
    /// Where to run: cpu, mlir, or cuda (PTX compiled here for the GPU at hand).
    #[arg(long, value_enum, default_value = "cpu")]
    backend: Backend,
    /// Worker threads (0 = all cores; at most 4 x the cores, at least 64: EJC_MAX_THREADS raises it).
    #[arg(long, default_value_t = 0)]
    threads: usize,
    /// Timed runs (the median is reported).
    #[arg(long, default_value_t = 10)]
    reps: usize,
    /// Untimed runs first.
    #[arg(long, default_value_t = 2)]
    warmup: usize,
    /// Print one JSON object.
    #[arg(long)]
    json: bool,
}

fn main() -> ExitCode {
    // Rust ignores SIGPIPE, so printing into a closed pipe (`ejc list | head`) would
    // panic; the default action ends the process quietly, as other CLI tools do.
    #[cfg(unix)]
    // Safety: called first thing, before any thread exists; SIG_DFL is a valid action.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
    let cli = Cli::parse();
    let outcome = match cli.command {
        Command::Check { spec } => cli::check::run(&spec),
        Command::List { spec, json } => cli::list::run(&spec, json),
        Command::Build {
            spec,
            out,
            targets,
            filter,
            keys,
            config,
            block_m,
            block_n,
            num_warps,
            num_stages,
            plans,
            paths,
            report,
            drop_spilling,
            no_cache,
            quiet,
        } => {
            if no_cache {
                ejc_codegen::cache::disable();
            }
            let named = |flag: &str, items: &[String]| -> Result<Vec<(String, u32)>, String> {
                let mut out = Vec::new();
                for item in items {
                    for part in item.split(',').map(str::trim).filter(|p| !p.is_empty()) {
                        let (k, v) = part.split_once('=').ok_or(format!("{flag}: `{part}` is not NAME=N"))?;
                        let v = v.trim().parse().map_err(|_| format!("{flag}: `{part}`: not a number"))?;
                        out.push((k.trim().to_string(), v));
                    }
                }
                Ok(out)
            };
            match (named("--key", &keys), named("--config", &config)) {
                (Ok(mut keys), Ok(mut axes)) => {
                    keys.extend(filter.head_dims.iter().map(|d| ("head_dim".to_string(), *d)));
                    for (name, vs) in [
                        ("block_m", &block_m),
                        ("block_n", &block_n),
                        ("num_warps", &num_warps),
                        ("num_stages", &num_stages),
                    ] {
                        axes.extend(vs.iter().map(|v| (name.to_string(), *v)));
                    }
                    cli::build::run(&cli::build::Request {
                        spec,
                        out,
                        targets,
                        variants: filter.variants,
                        dtypes: filter.dtypes,
                        keys,
                        axes,
                        plans,
                        ptx_paths: paths,
                        report,
                        drop_spilling,
                        quiet,
                    })
                }
                (Err(e), _) | (_, Err(e)) => Outcome::Error(format!("error: {e}")),
            }
        }
        Command::Run(a) => cli::run::run(&cli::run::Request {
            backend: a.backend.name(),
            seed: a.seed,
            threads: a.threads,
            json: a.json,
            problem: a.problem.flags(),
        }),
        Command::Tune(a) => cli::tune::run(&cli::tune::Request {
            backend: a.backend.name(),
            threads: a.threads,
            cache_dir: a.cache_dir,
            force: a.force,
            deterministic: a.deterministic,
            reps: a.reps,
            problem: a.problem.flags(),
        }),
        Command::Cache { action, cache_dir } => cli::cache::run(
            match action {
                CacheAction::Ls => cli::cache::Action::Ls,
                CacheAction::Show { filter } => cli::cache::Action::Show(filter.unwrap_or_default()),
                CacheAction::Clear { code: false } => cli::cache::Action::Clear,
                CacheAction::Clear { code: true } => cli::cache::Action::ClearCode,
            },
            cache_dir,
        ),
        Command::Bench(a) => cli::bench::run(&cli::bench::Request {
            backend: a.backend.name(),
            threads: a.threads,
            reps: a.reps,
            warmup: a.warmup,
            json: a.json,
            problem: a.problem.flags(),
        }),
    };
    match outcome {
        Outcome::Ok => ExitCode::SUCCESS,
        Outcome::CheckFailed => ExitCode::from(1),
        Outcome::Error(msg) => {
            // Names and values from a spec or a flag may hold control characters: they
            // are shown escaped, never sent to the terminal raw.
            eprintln!("{}", ejc_ir::limits::escape_controls(&msg));
            ExitCode::from(2)
        }
        Outcome::Skipped(msg) => {
            println!("{msg}");
            ExitCode::SUCCESS
        }
    }
}
