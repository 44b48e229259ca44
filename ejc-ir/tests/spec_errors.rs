//! The spec loader's diagnostics, pinned by snapshots, and the real spec loading.
//!
//! Every `tests/specs/broken/*.yaml` must fail to load; the full rendering of its error
//! is snapshotted under `snapshots/spec_error__<stem>.snap`. To add a case, drop a
//! fixture in that folder, run
//! `INSTA_UPDATE=always cargo test -p ejc-ir --test spec_errors`, and read the new
//! snapshot: it must point at the offending token and say what is wrong.

use std::path::{Path, PathBuf};

use ejc_ir::flash::{Features, SoftCap, Window};
use ejc_ir::spec::{load_file, load_str, Target};
use ejc_ir::types::DType;

const REPO: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/..");

/// The broken fixtures, sorted, as paths relative to the repository root (the label
/// diagnostics use, so snapshots do not depend on where the checkout lives).
fn fixtures() -> Vec<String> {
    let dir = Path::new(REPO).join("tests/specs/broken");
    let mut names: Vec<String> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("cannot list {}: {e}", dir.display()))
        .map(|entry| entry.expect("directory entry").file_name().to_string_lossy().into_owned())
        .filter(|name| name.ends_with(".yaml"))
        .map(|name| format!("tests/specs/broken/{name}"))
        .collect();
    names.sort();
    names
}

fn repo_path(relative: &str) -> PathBuf {
    Path::new(REPO).join(relative)
}

#[test]
fn broken_specs_fail_with_the_snapshotted_diagnostics() {
    let fixtures = fixtures();
    assert!(fixtures.len() >= 20, "expected the broken fixtures, found {fixtures:?}");
    for relative in fixtures {
        let bytes = std::fs::read(repo_path(&relative)).expect("fixture readable");
        let text = String::from_utf8(bytes).expect("fixtures are UTF-8");
        let err = match load_str(&relative, &text) {
            Ok(_) => panic!("{relative} loaded, but every broken fixture must fail"),
            Err(err) => err,
        };
        assert!(!err.diagnostics.is_empty(), "{relative}: an error with no diagnostics");
        let stem = relative.trim_start_matches("tests/specs/broken/").trim_end_matches(".yaml");
        let name = format!("spec_error__{stem}");
        insta::with_settings!({
            snapshot_path => concat!(env!("CARGO_MANIFEST_DIR"), "/../snapshots"),
            prepend_module_to_snapshot => false,
            description => relative.clone(),
        }, {
            insta::assert_snapshot!(name, err.to_string());
        });
    }
}

#[test]
fn several_errors_are_all_reported_in_source_order() {
    let relative = "tests/specs/broken/several_errors.yaml";
    let text = std::fs::read_to_string(repo_path(relative)).expect("fixture readable");
    let err = load_str(relative, &text).unwrap_err();
    assert!(err.diagnostics.len() >= 3, "{err}");
    let positions: Vec<_> = err.diagnostics.iter().map(|d| (d.line, d.column)).collect();
    let mut sorted = positions.clone();
    sorted.sort();
    assert_eq!(positions, sorted);
}

#[test]
fn the_flash_spec_loads() {
    let spec = load_file(repo_path("specs/flash.yaml")).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(spec.name, "flash");
    assert_eq!(spec.op, "flash_attention_fwd");
    assert_eq!(spec.version, 1);
    assert_eq!(spec.variants.len(), 15);
    assert_eq!(spec.dtypes, vec![DType::BF16, DType::F16, DType::F32]);
    assert_eq!(spec.key_values("head_dim"), [64, 96, 128, 192, 256]);
    assert_eq!(spec.schedule.values("block_m"), [64, 128]);
    assert_eq!(spec.schedule.overrides.len(), 3);
    assert_eq!(spec.schedule.all_values("block_m"), [64, 128, 192]);
    assert_eq!(spec.schedule.values("block_n"), [32, 64, 128]);
    assert_eq!(spec.schedule.values("num_warps"), [4, 8]);
    assert_eq!(spec.schedule.values("num_stages"), [2, 3]);
    assert!(spec.schedule.values("num_splits").is_empty(), "split-KV lives in specs/flash_decode.yaml");
    assert_eq!(
        spec.targets,
        vec![
            Target::Ir,
            Target::Cpu(None),
            Target::Ptx("sm_80".into()),
            Target::Ptx("sm_90a".into()),
            Target::Mlir("cpu".into()),
            Target::Mlir("gpu".into()),
        ]
    );
    assert_eq!(spec.hash.len(), 64);
    assert!(spec.hash.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)));

    let gemma2 = spec.variant("gemma2").expect("gemma2");
    assert!(gemma2.description.as_deref().is_some_and(|d| d.starts_with("Gemma-2")));
    let f = &fx(&gemma2.features);
    assert!(f.causal);
    assert_eq!(f.sliding_window, Some(Window::Runtime));
    assert_eq!(f.logits_soft_cap, Some(SoftCap::Fixed(50.0)));
    assert!(!f.sinks && !f.bias && !f.mask && !f.segment_ids && !f.varlen && !f.dropout);

    let gpt_oss = &fx(&spec.variant("gpt_oss").expect("gpt_oss").features);
    assert!(gpt_oss.causal && gpt_oss.sinks);
    assert_eq!(gpt_oss.sliding_window, Some(Window::Fixed { left: 128, right: 0 }));
    assert_eq!(gpt_oss.logits_soft_cap, None);
    assert!(!gpt_oss.bias && !gpt_oss.mask && !gpt_oss.varlen && !gpt_oss.dropout);

    assert_eq!(fx(&spec.variant("full").expect("full").features), Features::default());
    let varlen_causal = &fx(&spec.variant("varlen_causal").expect("varlen_causal").features);
    assert!(varlen_causal.varlen && varlen_causal.causal);
}

/// Hopper's three-warpgroup tile: block_m 192 with 12 warps loads (docs/spec.md); 192
/// is no key-column width, and 96 no tile at all.
#[test]
fn block_m_192_and_12_warps_load() {
    let text = std::fs::read_to_string(repo_path("specs/flash.yaml")).expect("readable");
    let hopper = text
        .replace("  block_m: [64, 128]", "  block_m: [64, 128, 192]")
        .replace("  num_warps: [4, 8]", "  num_warps: [4, 8, 12]");
    let spec = load_str("hopper.yaml", &hopper).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(spec.schedule.values("block_m"), [64, 128, 192]);
    assert_eq!(spec.schedule.values("num_warps"), [4, 8, 12]);
    for (from, to, why) in [
        ("  block_m: [64, 128]", "  block_m: [64, 96]", "block size is not a power of two"),
        ("  block_n: [32, 64, 128]", "  block_n: [32, 192]", "block size is not a power of two"),
        ("  num_warps: [4, 8]", "  num_warps: [4, 6]", "unsupported warp count"),
    ] {
        let e = load_str("bad.yaml", &text.replace(from, to)).unwrap_err().to_string();
        assert!(e.contains(why), "{to}: {e}");
    }
}

#[test]
fn the_documented_example_loads() {
    let doc = std::fs::read_to_string(repo_path("docs/spec.md")).expect("docs/spec.md readable");
    let example = doc
        .split("```yaml\n")
        .nth(1)
        .and_then(|rest| rest.split("```").next())
        .expect("docs/spec.md has a yaml example");
    let spec = load_str("docs/spec.md", example).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(spec.variants.len(), 5);
    let gpt_oss = &fx(&spec.variant("gpt_oss").expect("gpt_oss").features);
    assert_eq!(gpt_oss.sliding_window, Some(Window::Fixed { left: 128, right: 0 }));
}

#[test]
fn load_file_and_load_str_agree() {
    let path = repo_path("specs/flash.yaml");
    let text = std::fs::read_to_string(&path).expect("readable");
    let from_file = load_file(&path).expect("loads");
    let from_str = load_str(&path.display().to_string(), &text).expect("loads");
    assert_eq!(from_file, from_str);
}

#[test]
fn unreadable_and_non_utf8_files_are_diagnostics() {
    let missing = load_file("/nonexistent/spec.yaml").unwrap_err();
    let d = &missing.diagnostics[0];
    assert_eq!((d.line, d.column), (0, 0));
    assert!(d.message.starts_with("cannot read the spec: "), "{d}");

    let dir = std::env::temp_dir().join(format!("ejc-spec-errors-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let path = dir.join("latin1.yaml");
    std::fs::write(&path, b"name: flash\ndescription: caf\xe9\n").expect("write");
    let err = load_file(&path).unwrap_err();
    let _ = std::fs::remove_dir_all(&dir);
    let d = &err.diagnostics[0];
    assert_eq!((d.line, d.column), (2, 17), "{d}");
    assert_eq!(d.found.as_deref(), Some("the byte 0xe9"));
    assert_eq!(d.source_line.as_deref(), Some("description: caf\u{fffd}"));
}

/// A small deterministic generator: the test must reproduce exactly when it fails.
struct XorShift(u64);

impl XorShift {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
}

/// Mutate the real spec in ways that reach every corner of the loader: truncation,
/// deleted, duplicated and swapped lines, and bytes replaced by YAML punctuation.
fn mutate(base: &str, rng: &mut XorShift) -> String {
    const NOISE: &[&str] = &[
        ":",
        "-",
        "[",
        "]",
        "{",
        "}",
        ",",
        "&a",
        "*a",
        "!!str ",
        "'",
        "\"",
        "#",
        "\t",
        "\n",
        " ",
        "?",
        "|",
        ">",
        "---\n",
        "...",
        "%YAML 1.2\n",
        "~",
        "0x1f",
        "-1",
        "1e999",
        ".nan",
        "true",
        "\u{feff}",
        "é",
        "\r",
        "\0",
    ];
    let mut text = base.to_string();
    for _ in 0..1 + rng.below(4) {
        let lines: Vec<&str> = text.split('\n').collect();
        text = match rng.below(6) {
            0 => {
                let mut cut = rng.below(text.len());
                while !text.is_char_boundary(cut) {
                    cut -= 1;
                }
                text[..cut].to_string()
            }
            1 => {
                let i = rng.below(lines.len());
                let mut l = lines.clone();
                l.remove(i);
                l.join("\n")
            }
            2 => {
                let i = rng.below(lines.len());
                let mut l = lines.clone();
                l.insert(i, lines[i]);
                l.join("\n")
            }
            3 => {
                let (i, j) = (rng.below(lines.len()), rng.below(lines.len()));
                let mut l = lines.clone();
                l.swap(i, j);
                l.join("\n")
            }
            _ => {
                let mut at = rng.below(text.len());
                while !text.is_char_boundary(at) {
                    at -= 1;
                }
                let mut end = (at + rng.below(3)).min(text.len());
                while !text.is_char_boundary(end) {
                    end -= 1;
                }
                let noise = NOISE[rng.below(NOISE.len())];
                format!("{}{noise}{}", &text[..at], &text[end..])
            }
        };
    }
    text
}

/// A `u64` from the environment, for longer fuzzing runs than CI's
/// (`EJC_FUZZ=100000 EJC_FUZZ_SEED=7 cargo test -p ejc-ir --test spec_errors mutated`).
fn env_u64(name: &str, default: u64) -> u64 {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

#[test]
fn mutated_specs_never_panic() {
    let base = std::fs::read_to_string(repo_path("specs/flash.yaml")).expect("readable");
    // xorshift is stuck at zero forever; any other seed works.
    let mut rng = XorShift(env_u64("EJC_FUZZ_SEED", 0x9e37_79b9_7f4a_7c15).max(1));
    let (mut ok, mut failed) = (0, 0);
    for _ in 0..env_u64("EJC_FUZZ", 400) {
        let text = mutate(&base, &mut rng);
        match load_str("mutant.yaml", &text) {
            Ok(_) => ok += 1,
            Err(e) => {
                assert!(!e.diagnostics.is_empty());
                // Rendering must not panic either (carets past the end of a line, tabs).
                let _ = e.to_string();
                failed += 1;
            }
        }
    }
    // Both outcomes occur, so the mutations exercise the decoder, not only the parser.
    assert!(ok > 0 && failed > 0, "ok={ok} failed={failed}");
}

/// A flash variant's features, typed.
fn fx(f: &ejc_ir::op::Features) -> Features {
    Features::from_json(f).expect("flash features")
}
