#!/usr/bin/env bash
# Seed the cargo-fuzz corpora (fuzz/corpus/<target>/) with what the CI suite starts from
# (tests/fuzz.rs): every spec of specs/ and tests/specs/broken/, the printed IR of every
# kernel of specs/*.yaml and the IR snapshots, the manifest, tuning-cache and CLI seeds
# of tests/fuzz/seeds/, and every regression input of tests/fuzz/regressions/<target>/.
# Existing corpus files are kept (libFuzzer adds what it finds next to them).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
corpus="$root/fuzz/corpus"
mkdir -p "$corpus"/{spec,ir,manifest,cache,cli}

cp "$root"/specs/*.yaml "$root"/tests/specs/broken/*.yaml "$corpus/spec/"
for t in manifest cache cli; do
    cp "$root/tests/fuzz/seeds/$t/"* "$corpus/$t/"
done
for t in spec ir manifest cache cli; do
    if [ -d "$root/tests/fuzz/regressions/$t" ]; then
        cp "$root/tests/fuzz/regressions/$t/"* "$corpus/$t/" 2>/dev/null || true
    fi
done

# IR: the body of every snapshot that holds a kernel, and every kernel `ejc build` prints.
for snap in "$root"/snapshots/*.snap; do
    body=$(awk 'n >= 2 { print } /^---$/ { n++ }' "$snap")
    case "$body" in
        "kernel @"*) printf '%s\n' "$body" > "$corpus/ir/$(basename "$snap" .snap).tir" ;;
    esac
done
ejc="${EJC:-$root/target/debug/ejc}"
if [ ! -x "$ejc" ]; then
    (cd "$root" && cargo build -q --bin ejc)
fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
for spec in "$root"/specs/*.yaml; do
    EJC_CACHE_DIR="$tmp/cache" "$ejc" build "$spec" --target ir -o "$tmp/$(basename "$spec" .yaml)" > /dev/null 2>&1
done
cp "$tmp"/*/ir/*.tir "$corpus/ir/"

for t in spec ir manifest cache cli; do
    echo "fuzz/corpus/$t: $(ls "$corpus/$t" | wc -l) inputs"
done
