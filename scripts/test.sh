#!/usr/bin/env bash
# Set up and run the whole test suite (this is what CI runs, through .ci/run).
# GPU tests are skipped with a message when no GPU driver is present.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
source .tools/env.sh
# Snapshots are compared, never written: a change must be reviewed by hand
# (`cargo insta review`), not accepted by the test run.
export INSTA_UPDATE=no
cargo fmt --all --check
# Lint while building, not before: clippy's driver compiles the workspace's own crates
# (the lints of `cargo clippy -- -D warnings`, on every target the tests build) and
# produces the code the tests run, so the dependencies are compiled once instead of once
# more in check mode (six minutes on 2 cores). Every cargo command below runs with it,
# so none rebuilds; the UI tests' own builds (trybuild) run without it (ejc-macros/tests/ui.rs).
RUSTC_WORKSPACE_WRAPPER="$(command -v clippy-driver || echo "$(rustc --print sysroot)/bin/clippy-driver")"
export RUSTC_WORKSPACE_WRAPPER
export CLIPPY_ARGS="-D__CLIPPY_HACKERY__warnings__CLIPPY_HACKERY__"
# One build for everything: the workspace's features are unified, and the `ejc` package
# turns on ejc-runtime's `cuda` feature, so the CUDA executor, the GPU runner (`ejc-gpu`)
# and its argument tests (tests/gpu_args.rs) are built and linted here too. They build
# without CUDA (the driver is opened at run time) and only say that there is no GPU.
# (A `-p ejc-runtime --features cuda` build would resolve fewer features for syn, serde,
# rand and the rest and compile them and ejc-ir a second time: 81 s.)
cargo test --workspace --locked --no-run
cargo test --workspace --locked
# What the CPU tests could not run on this machine (AMX kernels need an AMX CPU; the test
# above compiled them and checked their tile code either way): said here, not hidden in
# captured test output. (`--workspace`, as above: the same build, nothing recompiled.)
cargo test -q --workspace --test cpu --locked amx -- --nocapture 2>&1 | grep -E '^skipped|^seed' || true
# The runner the test build made (`cargo run -p ejc-runtime` would rebuild, as above).
"${CARGO_TARGET_DIR:-target}/debug/ejc-gpu" info
pending=$(git ls-files --others --exclude-standard | grep -E '\.snap\.new$|\.pending-snap$' || true)
if [ -n "$pending" ]; then
  echo "unreviewed snapshot files:"; echo "$pending"; exit 1
fi
echo "all tests passed"
