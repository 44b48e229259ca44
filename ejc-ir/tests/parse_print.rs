//! The text form: `print(parse(print(k))) == print(k)` for every kernel of
//! `specs/flash.yaml` (before and after the default pipeline), parse errors with exact
//! `line:column` positions, and a fuzz test: thousands of random mutations of a
//! printed kernel must give `Ok` or `Err`, never a panic.

mod common;

use ejc_ir::ir::Kernel;
use ejc_ir::parse::parse_kernel;
use ejc_ir::passes::{default_pipeline, run_pipeline};
use ejc_ir::print::print_kernel;
use ejc_ir::spec;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

fn spec() -> spec::Spec {
    spec::load_file(concat!(env!("CARGO_MANIFEST_DIR"), "/../specs/flash.yaml")).expect("specs/flash.yaml loads")
}

fn assert_round_trips(k: &Kernel, what: &str) {
    let text = print_kernel(k);
    let parsed = parse_kernel(&text).unwrap_or_else(|e| panic!("{what}: printed IR does not parse: {e}\n{text}"));
    let again = print_kernel(&parsed);
    assert!(again == text, "{what}: print(parse(print(k))) != print(k)\n--- printed\n{text}\n--- reprinted\n{again}");
    // Same structure, not only the same text: same op count, params, grid, attrs.
    assert_eq!(parsed.op_count(), k.op_count(), "{what}");
    assert_eq!(parsed.params, {
        // Parameter value ids may be renumbered; compare names and types.
        let mut p = k.params.clone();
        for (a, b) in p.iter_mut().zip(&parsed.params) {
            a.value = b.value;
        }
        p
    });
    assert_eq!(parsed.grid, k.grid, "{what}");
}

#[test]
fn every_spec_kernel_round_trips_before_and_after_the_pipeline() {
    let spec = spec();
    let mut n = 0;
    for v in &spec.variants {
        for &dtype in &spec.dtypes {
            for keys in spec.key_points() {
                let head_dim = keys["head_dim"] as usize;
                let dims =
                    ejc_ir::flash::HeadDims { qk: head_dim, v: ejc_ir::flash::head_dim_v(&keys).unwrap() as usize };
                let k = ejc_ir::flash::main_kernel(&spec, v, dtype, dims, 64, 32)
                    .unwrap_or_else(|e| panic!("{} {dtype} d{head_dim}: {e}", v.name));
                assert_round_trips(&k, &k.name);
                let opt = run_pipeline(&k, &default_pipeline()).unwrap_or_else(|e| panic!("{}: {e}", k.name));
                assert_round_trips(&opt, &format!("{} after the pipeline", k.name));
                n += 1;
            }
        }
    }
    assert_eq!(n, spec.variants.len() * spec.dtypes.len() * spec.key_points().len());
    assert_eq!(n, 270, "15 variants x 3 dtypes x 6 head dims (192/128 among them)");
}

#[test]
fn every_backward_kernel_round_trips_atomic_adds_included() {
    use ejc_ir::flash::backward::{build_bwd_kernel, Role};
    use ejc_ir::flash::Features;
    let mut atomics = 0;
    for f in [Features::default(), Features::every()] {
        for role in Role::ALL.into_iter().filter(|r| r.applies(&f)) {
            let k = build_bwd_kernel(role.name(), role, &f, ejc_ir::types::DType::BF16, 64.into(), 64, 32).unwrap();
            let text = print_kernel(&k);
            atomics += text.matches("tile.atomic_add").count();
            assert_round_trips(&k, &k.name);
            let opt = run_pipeline(&k, &default_pipeline()).unwrap_or_else(|e| panic!("{}: {e}", k.name));
            assert_round_trips(&opt, &format!("{} after the pipeline", k.name));
        }
    }
    // dkdv_dq: dq_accum without sinks; dq_accum and pdp with every feature.
    assert_eq!(atomics, 3);
}

#[test]
fn hand_written_names_are_only_labels() {
    // Any `%identifier` works; the printer renumbers, and the renumbered text is a
    // fixed point.
    let text = "kernel @k(%x: tensor<?xf32>, %n: i32) grid(cdiv(mul(n, 2), 16), 1, 1) attrs {b = \"2\", a = \"q\\\"uote\"} {\n  \
                %zero = const 0 : i32\n  %v.1 = tile.load %x[%zero +: 16 < %n] {pad = -inf} : tile<16xf32>\n  \
                // a comment\n  %s = reduce.max %v.1 {axis = 0} : f32\n  tile.store %x[%zero], %s\n}\n";
    let k = parse_kernel(text).unwrap();
    let printed = print_kernel(&k);
    assert_eq!(
        printed,
        "kernel @k(%x: tensor<?xf32>, %n: i32) grid(cdiv(mul(n, 2), 16), 1, 1) attrs {a = \"q\\\"uote\", b = \"2\"} {\n  \
         %0 = const 0 : i32\n  %1 = tile.load %x[%0 +: 16 < %n] {pad = -inf} : tile<16xf32>\n  \
         %2 = reduce.max %1 {axis = 0} : f32\n  tile.store %x[%0], %2\n}\n"
    );
    assert_eq!(print_kernel(&parse_kernel(&printed).unwrap()), printed);
}

/// `(name, text, expected error)`: each text is a small kernel with one defect.
const MALFORMED: &[(&str, &str, &str)] = &[
    (
        "a parameter named by a number (the printer's numbers would clash with it)",
        "kernel @k(%a: i32, %18: i32) grid(1, 1, 1) {\n}\n",
        "1:20: parameter `%18` is named by a number; parameters need a name (`%q`): the printer numbers the body's values",
    ),
    ("unknown op", "kernel @k() grid(1, 1, 1) {\n  %0 = arith.frob : i32\n}\n", "2:8: unknown op `arith.frob`"),
    (
        "undefined value",
        "kernel @k(%n: i32) grid(1, 1, 1) {\n  %0 = arith.add %n, %m : i32\n}\n",
        "2:22: use of undefined value `%m`",
    ),
    (
        "duplicate definition",
        "kernel @k() grid(1, 1, 1) {\n  %a = const 1 : i32\n  %a = const 2 : i32\n}\n",
        "3:3: value `%a` is defined twice",
    ),
    (
        "duplicate result name",
        "kernel @k(%n: i32) grid(1, 1, 1) {\n  %a, %a = mask.kv_range %n, %n {terms = [col_le_row], block = [4, 4]} : i32, i32\n}\n",
        "2:7: value `%a` is defined twice",
    ),
    (
        "loop variable reusing a name",
        "kernel @k(%n: i32) grid(1, 1, 1) {\n  scf.for %n = %n to %n step %n {\n    scf.yield\n  }\n}\n",
        "2:11: value `%n` is defined twice",
    ),
    (
        "duplicate parameter",
        "kernel @k(%n: i32, %n: f32) grid(1, 1, 1) {\n}\n",
        "1:20: value `%n` is defined twice",
    ),
    (
        "unknown dtype",
        "kernel @k() grid(1, 1, 1) {\n  %0 = const 1 : i33\n}\n",
        "2:18: unknown dtype `i33` (known: i1, i32, u32, f16, bf16, f32, f64)",
    ),
    (
        "bad tile type",
        "kernel @k() grid(1, 1, 1) {\n  %0 = tile.arange {len = 4} : tile<4x?xi32>\n}\n",
        "2:32: bad tile dimension `?` in `tile<4x?xi32>`",
    ),
    (
        "tensor with a static dim",
        "kernel @k(%x: tensor<4xf32>) grid(1, 1, 1) {\n}\n",
        "1:15: tensor dims must be `?` (run-time), found `tensor<4xf32>`",
    ),
    (
        "missing closing brace",
        "kernel @k(%n: i32) grid(1, 1, 1) {\n  %0 = arith.add %n, %n : i32\n",
        "3:1: expected `}` before the end of input",
    ),
    (
        "missing closing brace of a region",
        "kernel @k(%n: i32) grid(1, 1, 1) {\n  %c = cmp.lt %n, %n : i1\n  scf.if %c {\n    scf.yield\n  } else {\n    scf.yield\n}\n",
        "8:1: expected `}` before the end of input",
    ),
    (
        "wrong result count",
        "kernel @k(%n: i32) grid(1, 1, 1) {\n  %0 = arith.add %n, %n : i32, i32\n}\n",
        "2:8: `arith.add` has 1 result(s); found 1 name(s) and 2 type(s)",
    ),
    (
        "wrong result count of a multi-result op",
        "kernel @k(%n: i32) grid(1, 1, 1) {\n  %lo = mask.kv_range %n, %n {terms = [col_le_row], block = [4, 4]} : i32\n}\n",
        "2:9: `mask.kv_range` has 2 result(s); found 1 name(s) and 1 type(s)",
    ),
    (
        "bad attribute value",
        "kernel @k() grid(1, 1, 1) {\n  %0 = program.id {axis = x} : i32\n}\n",
        "2:8: `program.id`: attribute `axis` must be an integer",
    ),
    (
        "bad cast target",
        "kernel @k(%n: i32) grid(1, 1, 1) {\n  %0 = arith.cast %n {to = 3} : f32\n}\n",
        "2:8: `arith.cast`: attribute `to` must be a dtype",
    ),
    (
        "unknown attribute",
        "kernel @k() grid(1, 1, 1) {\n  %0 = program.id {axes = 0} : i32\n}\n",
        "2:8: `program.id`: unknown attribute `axes` (allowed: axis)",
    ),
    (
        "unknown mask term",
        "kernel @k(%n: i32) grid(1, 1, 1) {\n  %0 = mask.block_full %n, %n, %n {terms = [kv_lq], block = [4, 4]} : i1\n}\n",
        "2:8: `mask.block_full`: unknown mask term `kv_lq` (known: col_le_row, col_ge_row, col_lt, row_lt)",
    ),
    (
        "unterminated string",
        "kernel @k() grid(1, 1, 1) attrs {variant = \"causal} {\n}\n",
        "1:44: unterminated string",
    ),
    ("unexpected character", "kernel @k() grid(1, 1, 1) {\n  $0 = const 1 : i32\n}\n", "2:3: unexpected character `$`"),
    ("missing kernel name", "kernel k() grid(1, 1, 1) {\n}\n", "1:8: expected the kernel name `@name`, found `k`"),
    (
        "truncated grid",
        "kernel @k() grid(1, 1, ",
        "1:24: expected a grid expression, found end of input",
    ),
    ("truncated kernel name", "kernel", "1:7: expected the kernel name `@name`, found end of input"),
    (
        "missing else",
        "kernel @k(%c: i1) grid(1, 1, 1) {\n  scf.if %c {\n    scf.yield\n  }\n}\n",
        "5:1: expected `else`, found `}`",
    ),
    (
        "trailing text",
        "kernel @k() grid(1, 1, 1) {\n}\n}\n",
        "3:1: unexpected `}` after the kernel",
    ),
    (
        "store with results",
        "kernel @k(%x: tensor<?xi32>, %n: i32) grid(1, 1, 1) {\n  %0 = tile.store %x[%n], %n\n}\n",
        "2:8: `tile.store` has no results",
    ),
];

#[test]
fn malformed_inputs_give_exact_line_column_errors() {
    let mut wrong = Vec::new();
    for (name, text, want) in MALFORMED {
        match parse_kernel(text) {
            Ok(_) => wrong.push(format!("{name}: parsed, expected `{want}`")),
            Err(e) if e.to_string() != *want => wrong.push(format!("{name}:\n  got  `{e}`\n  want `{want}`")),
            Err(_) => {}
        }
    }
    assert!(wrong.is_empty(), "{} of {} cases wrong:\n{}", wrong.len(), MALFORMED.len(), wrong.join("\n"));
}

#[test]
fn type_errors_found_after_parsing_name_the_op() {
    // The parser verifies what it read; the verifier's errors have no line:column but
    // name the op's place in the tree.
    let e = parse_kernel("kernel @k() grid(1, 1, 1) {\n  %0 = const 1.5 : i32\n}\n").unwrap_err();
    assert_eq!(
        e.to_string(),
        "invalid IR in kernel `k` at op 0 (const): `const`: integer constant 1.5 is not an integer"
    );
    assert_eq!((e.line, e.column), (0, 0));
}

#[test]
fn attribute_strings_with_escapes_round_trip() {
    // The printer writes strings as `{:?}` does (`\t`, `\r`, `\0`, `\'`, `\u{202e}`...);
    // the parser read only `\"`, `\\` and `\n` back (found by tests/fuzz.rs).
    let raw = "kernel @k(%n: i32) grid(1, 1, 1) attrs {a = \"x\u{202e}\t\r\0\u{7f}'y\", \
               b = \"\\t\\r\\0\\'\\u{202e}\\u{1F600}\\\\\\\"\\n\"} {\n  %0 = arith.add %n, %n : i32\n}\n";
    let k = parse_kernel(raw).unwrap();
    let want = "x\u{202e}\t\r\0\u{7f}'y";
    assert_eq!(k.attrs, vec![("a".into(), want.into()), ("b".into(), "\t\r\0'\u{202e}\u{1F600}\\\"\n".into())]);
    let printed = print_kernel(&k);
    assert_eq!(parse_kernel(&printed).map(|k| print_kernel(&k)), Ok(printed));
    for (bad, why) in
        [("\\u{110000}", "bad `\\u{...}` escape"), ("\\u{}", "bad `\\u{...}` escape"), ("\\q", "unknown escape")]
    {
        let text = format!("kernel @k() grid(1, 1, 1) attrs {{a = \"{bad}\"}} {{\n}}\n");
        let e = parse_kernel(&text).unwrap_err();
        assert!(e.message.contains(why), "{bad}: {e}");
    }
}

#[test]
fn deep_nesting_is_an_error_not_a_stack_overflow() {
    // 20,000 nested attribute lists overflowed the parser's stack (found by tests/fuzz.rs);
    // grid formulas and regions recurse the same way.
    let n = 20_000;
    let nest = |open: &str, inner: &str, close: &str| format!("{}{inner}{}", open.repeat(n), close.repeat(n));
    let cases = [
        format!(
            "kernel @k(%n: i32) grid(1, 1, 1) {{\n  %0 = program.id {{axis = {}}} : i32\n}}\n",
            nest("[", "0", "]")
        ),
        format!("kernel @k(%n: i32) grid({}, 1, 1) {{\n}}\n", nest("cdiv(", "n", ", 2)")),
        format!("kernel @k(%c: i1) grid(1, 1, 1) {{\n{}}}\n", nest("scf.if %c {\n", "", "}\n")),
    ];
    for text in &cases {
        let e = parse_kernel(text).unwrap_err();
        assert!(e.message.contains("nested more than 64 levels deep"), "{e}");
    }
    // 64 levels of attribute lists is fine (the op then refuses the value).
    let ok = format!(
        "kernel @k() grid(1, 1, 1) {{\n  %0 = program.id {{axis = {}0{}}} : i32\n}}\n",
        "[".repeat(63),
        "]".repeat(63)
    );
    assert!(!parse_kernel(&ok).unwrap_err().message.contains("nested"));
    let formula = format!("{}n{}", "cdiv(".repeat(n), ", 2)".repeat(n));
    assert!(ejc_ir::ir::GridExpr::parse(&formula).unwrap_err().contains("nested more than 64 calls deep"));
}

// ---- fuzzing ----------------------------------------------------------------------

/// A mid-sized printed kernel with every construct: loops, ifs, loads with limits,
/// multi-result ops, mask ops, attrs.
fn fuzz_base() -> String {
    let f = ejc_ir::flash::Features {
        varlen: true,
        causal: true,
        sliding_window: Some(ejc_ir::flash::Window::Runtime),
        ..Default::default()
    };
    let k = ejc_ir::flash::build_flash_kernel("fuzz", &f, ejc_ir::types::DType::BF16, 16, 16, 16).unwrap();
    let k = run_pipeline(&k, &[Box::new(ejc_ir::passes::Canonicalize), Box::new(ejc_ir::passes::ClassifyMaskBlocks)])
        .unwrap();
    let mut k = k;
    k.attrs = vec![("variant".into(), "fuzz \"quoted\"".into())];
    print_kernel(&k)
}

/// Split into tokens, keeping the separators, so tokens can be deleted, duplicated
/// or swapped and the rest stays readable.
fn tokens(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut cur = String::new();
    for c in text.chars() {
        let sep = c.is_whitespace() || "(){}[]<>,:=".contains(c);
        if sep {
            if !cur.is_empty() {
                out.push(std::mem::take(&mut cur));
            }
            out.push(c.to_string());
        } else {
            cur.push(c);
        }
    }
    if !cur.is_empty() {
        out.push(cur);
    }
    out
}

fn mutate(base: &str, rng: &mut StdRng) -> String {
    const ALPHABET: &[char] = &[
        '%', '@', '{', '}', '(', ')', '[', ']', '<', '>', ',', ':', '=', '"', '\\', '-', '+', 'x', '?', '0', '9', ' ',
        '\n', 'é',
    ];
    let mut toks = tokens(base);
    for _ in 0..rng.random_range(1..=3) {
        let n = toks.len();
        let i = rng.random_range(0..n);
        match rng.random_range(0..7) {
            0 => {
                toks.remove(i);
            }
            1 => {
                let t = toks[i].clone();
                toks.insert(i, t);
            }
            2 => {
                let j = rng.random_range(0..n);
                toks.swap(i, j);
            }
            3 => {
                // A token copied from elsewhere (a value name, a number, an op name).
                let t = toks[rng.random_range(0..n)].clone();
                toks[i] = t;
            }
            _ => {
                // Character-level edits inside a token.
                let mut chars: Vec<char> = toks[i].chars().collect();
                let k = rng.random_range(0..=chars.len());
                match rng.random_range(0..4) {
                    0 if k < chars.len() => {
                        chars.remove(k);
                    }
                    1 if k < chars.len() => {
                        let c = chars[k];
                        chars.insert(k, c);
                    }
                    2 if k + 1 < chars.len() => chars.swap(k, k + 1),
                    _ => chars.insert(k, ALPHABET[rng.random_range(0..ALPHABET.len())]),
                }
                toks[i] = chars.into_iter().collect();
            }
        }
    }
    toks.concat()
}

#[test]
fn random_mutations_never_panic_the_parser() {
    let base = fuzz_base();
    assert!(parse_kernel(&base).is_ok());
    let seed = common::seed();
    let mut rng = StdRng::seed_from_u64(seed);
    let (mut ok, mut err) = (0, 0);
    for n in 0..3000 {
        let text = mutate(&base, &mut rng);
        let result = std::panic::catch_unwind(|| {
            let parsed = parse_kernel(&text);
            // What parses must print, and the print must be a fixed point.
            if let Ok(k) = &parsed {
                let printed = print_kernel(k);
                let again = parse_kernel(&printed).map(|k| print_kernel(&k));
                assert_eq!(again.as_ref(), Ok(&printed), "a parsed mutation does not round-trip");
            }
            parsed.is_ok()
        });
        match result {
            Ok(true) => ok += 1,
            Ok(false) => err += 1,
            Err(_) => panic!("seed {seed}, mutation {n}: the parser panicked on\n{text}"),
        }
    }
    // Most mutations break the kernel; some (a duplicated blank, a swapped pair of
    // equal tokens) do not.
    assert!(err > ok && ok > 0, "ok {ok}, err {err}");
}
