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
  ejc list specs/flash.yaml                  what the spec expands to
  ejc build specs/flash.yaml -o out          write artifacts and out/manifest.json
  ejc run specs/flash.yaml --backend interp  run every variant on random inputs against the reference

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
        after_help = "Targets: ir (tile IR text after the pass pipeline) is built; cpu, ptx:<arch> and mlir:<form> \
are not built yet and are refused with the issue that brings them. Without --target, every target the spec \
lists that this ejc can build is built, and the others are named on stderr."
    )]
    Build {
        spec: PathBuf,
        /// Output directory (created if missing).
        #[arg(short, long, default_value = "out")]
        out: PathBuf,
        /// Target to build; repeat for several (ir, cpu, cpu:avx512, ptx:sm_90a, mlir:cpu ...).
        #[arg(long = "target", value_name = "TARGET")]
        targets: Vec<String>,
        #[command(flatten)]
        filter: Filter,
        /// Print nothing but errors.
        #[arg(short, long)]
        quiet: bool,
    },
    /// Run kernels of a spec on fresh random inputs, compare each with the reference
    /// implementation, and print rel_err (||out - ref|| / ||ref||) and max_abs_err.
    /// Exits 1 when a result is outside its tolerance (f32 1e-5, f16 5e-3, bf16 1e-2).
    #[command(after_help = "Without --variant every variant of the spec runs. Inputs are N(0, 1); k and v are \
non-contiguous, bias and mask broadcast through zero strides; varlen batches have uneven lengths. The seed is \
printed: pass it back with --seed to reproduce a run.")]
    Run(RunArgs),
}

#[derive(Args)]
struct Filter {
    /// Only this variant (repeat for several).
    #[arg(long = "variant", value_name = "NAME")]
    variants: Vec<String>,
    /// Only this dtype (repeat for several).
    #[arg(long = "dtype", value_name = "DTYPE")]
    dtypes: Vec<String>,
    /// Only this head dim (repeat for several).
    #[arg(long = "head-dim", value_name = "D")]
    head_dims: Vec<usize>,
}

#[derive(Clone, Copy, ValueEnum)]
enum Backend {
    /// The tile-IR interpreter (slow, exact: f64 arithmetic).
    Interp,
    /// Native CPU code (not built yet: issue 3).
    Cpu,
    /// CUDA through PTX (not built yet: issue 4).
    Cuda,
    /// MLIR (not built yet: issue 6).
    Mlir,
}

#[derive(Args)]
struct RunArgs {
    spec: PathBuf,
    /// Where to run.
    #[arg(long, value_enum, default_value = "interp")]
    backend: Backend,
    /// Variant to run (repeat for several; default: all).
    #[arg(long = "variant", value_name = "NAME")]
    variants: Vec<String>,
    /// Input dtype: bf16, f16 or f32 (must be one of the spec's).
    #[arg(long, default_value = "bf16")]
    dtype: String,
    /// Problem size batch,seq_q,seq_k,heads_q,heads_kv,head_dim. head_dim must be one
    /// of the spec's; for varlen variants batch is the number of sequences and the
    /// sequence lengths are random up to seq_q / seq_k.
    #[arg(long, default_value = "2,77,93,4,2,64")]
    shape: String,
    /// Seed of the random inputs (default: fresh, printed).
    #[arg(long)]
    seed: Option<u64>,
    /// Tiling to run (default: the spec's first block_m and block_n).
    #[arg(long)]
    block_m: Option<u32>,
    #[arg(long)]
    block_n: Option<u32>,
    /// Sliding window left,right for variants whose window is a run-time parameter
    /// (default: seq_k/3, seq_k/5).
    #[arg(long, value_name = "LEFT,RIGHT", allow_hyphen_values = true)]
    window: Option<String>,
    /// Soft cap for variants whose cap is a run-time parameter (default 5.0).
    #[arg(long)]
    softcap: Option<f64>,
    /// Dropout probability for dropout variants (default 0.2).
    #[arg(long)]
    dropout: Option<f64>,
    /// Print one JSON object per kernel instead of text.
    #[arg(long)]
    json: bool,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let outcome = match cli.command {
        Command::Check { spec } => cli::check::run(&spec),
        Command::List { spec, json } => cli::list::run(&spec, json),
        Command::Build { spec, out, targets, filter, quiet } => cli::build::run(&cli::build::Request {
            spec,
            out,
            targets,
            variants: filter.variants,
            dtypes: filter.dtypes,
            head_dims: filter.head_dims,
            quiet,
        }),
        Command::Run(a) => cli::run::run(&cli::run::Request {
            spec: a.spec,
            backend: match a.backend {
                Backend::Interp => "interp",
                Backend::Cpu => "cpu",
                Backend::Cuda => "cuda",
                Backend::Mlir => "mlir",
            },
            variants: a.variants,
            dtype: a.dtype,
            shape: a.shape,
            seed: a.seed,
            block_m: a.block_m,
            block_n: a.block_n,
            window: a.window,
            softcap: a.softcap,
            dropout: a.dropout,
            json: a.json,
        }),
    };
    match outcome {
        Outcome::Ok => ExitCode::SUCCESS,
        Outcome::CheckFailed => ExitCode::from(1),
        Outcome::Error(msg) => {
            eprintln!("{msg}");
            ExitCode::from(2)
        }
    }
}
