//! Structure-aware mutation of seed inputs, shared by the CI fuzz suite (`tests/fuzz.rs`)
//! and the cargo-fuzz targets (`fuzz/`, as their custom mutator).
//!
//! A mutation is a stack of one to four edits of a seed, each chosen from: bit flips and
//! byte sets, truncation, deleting, duplicating or repeating a range, line edits (delete,
//! duplicate, swap, re-indent, splice in a line of another seed), crossing over with
//! another seed, inserting a token of the input's language (YAML, tile IR, JSON, CLI
//! flag values), replacing a number by an extreme one (2^64, -2^63-1, 1e309, NaN...),
//! replacing a word by another word of the seeds, inserting control characters or bytes
//! that are not UTF-8, and deep nesting. Everything is deterministic in the seed of the
//! [`Rng`]: a failure is replayed from it.
#![allow(dead_code)]

/// SplitMix64: small, fast, and good enough to choose mutations.
#[derive(Clone, Debug)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed ^ 0x5851_f42d_4c95_7f2d)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n` (0 when `n == 0`).
    pub fn below(&mut self, n: usize) -> usize {
        if n == 0 {
            0
        } else {
            (self.next_u64() % n as u64) as usize
        }
    }

    /// True with probability `num / den`.
    pub fn chance(&mut self, num: usize, den: usize) -> bool {
        self.below(den) < num
    }

    pub fn pick<'a, T>(&mut self, xs: &'a [T]) -> &'a T {
        &xs[self.below(xs.len())]
    }
}

/// The language of a target's input: which tokens are worth inserting.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Dialect {
    /// Spec files.
    Yaml,
    /// Tile-IR text.
    Ir,
    /// Manifests and tuning caches.
    Json,
    /// `--shape`, `--size`, `--config`, `--scalar`, `--window` values.
    Flags,
}

const YAML_TOKENS: &[&str] = &[
    ": ",
    "- ",
    "-",
    "[",
    "]",
    "{",
    "}",
    ", ",
    ",",
    "&a ",
    "*a",
    "<<: *a",
    "!!str ",
    "!!int ",
    "!!float ",
    "!!binary ",
    "!!map ",
    "!!seq ",
    "!tag ",
    "!<tag:yaml.org,2002:str> ",
    "---\n",
    "...\n",
    "|\n",
    "|-\n",
    ">\n",
    "'",
    "''",
    "\"",
    "\\",
    "\\u0000",
    "\\x",
    "# ",
    "#",
    "\t",
    "\n",
    "\n  ",
    "    ",
    "null",
    "~",
    "true",
    "false",
    "yes",
    "no",
    "on",
    "off",
    "? ",
    "%YAML 1.2\n",
    "%TAG ! tag:x:\n",
    "@",
    "`",
    "name",
    "op",
    "version",
    "description",
    "dtypes",
    "head_dims",
    "{qk: 192, v: 128}",
    "qk",
    "v",
    "head_dim_v",
    "layout",
    "variants",
    "schedule",
    "overrides",
    "when",
    "target",
    "dtype",
    "head_dim",
    "plans",
    "targets",
    "block_m",
    "block_n",
    "block_h",
    "num_warps",
    "num_stages",
    "num_splits",
    "causal",
    "sliding_window",
    "runtime",
    "logits_soft_cap",
    "sinks",
    "bias",
    "mask",
    "dropout",
    "varlen",
    "segment_ids",
    "backward",
    "single",
    "split_kv",
    "flash_attention_fwd",
    "mean_pooling",
    "bshd",
    "bf16",
    "f16",
    "f32",
    "fp8",
    "ir",
    "cpu",
    "cpu:avx2",
    "cpu:avx512",
    "ptx:sm_80",
    "ptx:sm_90a",
    "mlir:cpu",
    "mlir:gpu",
    "full: {}\n",
    "[64, 128]",
    "[]",
    "{}",
    "[[[[",
    "{a: {b: {c: ",
    "0x40",
    "0o100",
    "6.4e1",
    "64.0",
    ".inf",
    ".nan",
    "-.inf",
];

const IR_TOKENS: &[&str] = &[
    "%",
    "%0",
    "%1",
    "%x",
    "%99999999999999999999",
    "@",
    "@k",
    "kernel ",
    "kernel @k() grid(1, 1, 1) {\n",
    "grid(",
    "(",
    ")",
    "{",
    "}",
    "[",
    "]",
    "<",
    ">",
    ":",
    ", ",
    ",",
    " = ",
    "=",
    "+:",
    "x",
    "?x",
    "?",
    "tile<",
    "tensor<",
    "tile<16x64xf32>",
    "tensor<?x?xbf16>",
    "tile<0xf32>",
    "tile<>",
    "i1",
    "i32",
    "i64",
    "f16",
    "bf16",
    "f32",
    "f64",
    "attrs ",
    "{axis = 0}",
    "{axis = 9}",
    "{shape = [16, 64]}",
    "{to = f32}",
    "{pad = 0.0}",
    "scf.for ",
    "scf.if ",
    "scf.yield",
    " to ",
    " step ",
    "iter_args(",
    "const ",
    "const 0 : i32",
    "const 1.5 : f32",
    "arith.add ",
    "arith.div ",
    "arith.cast ",
    "arith.cmp ",
    "arith.select ",
    "tile.load ",
    "tile.store ",
    "tile.dot ",
    "tile.reduce ",
    "tile.splat ",
    "tile.broadcast ",
    "tile.iota ",
    "program.id ",
    "program.dim ",
    "cdiv(",
    "mul(",
    "add(",
    "max(",
    "batch",
    "heads_q",
    "\"",
    "\\\"",
    "\n",
    "\n  ",
    "  ",
    "\t",
    "#",
    "//",
    "-",
    "-0",
    "0.0",
    "1e309",
    "nan",
    "inf",
];

const JSON_TOKENS: &[&str] = &[
    "{",
    "}",
    "[",
    "]",
    ":",
    ",",
    "\"",
    "\\",
    "\\u0000",
    "\\ud800",
    "\\uDFFF",
    "\\n",
    "null",
    "true",
    "false",
    "{}",
    "[]",
    "\"\"",
    "[[[[",
    "{\"a\":{\"b\":",
    "\"format\"",
    "\"ejc-manifest/1\"",
    "\"ejc-manifest/2\"",
    "\"ejc-tuning-cache/1\"",
    "\"machine\"",
    "\"entries\"",
    "\"compiler\"",
    "\"spec\"",
    "\"plans\"",
    "\"artifacts\"",
    "\"instance\"",
    "\"features\"",
    "\"launches\"",
    "\"temporaries\"",
    "\"bind\"",
    "\"axes\"",
    "\"grid\"",
    "\"block\"",
    "\"config\"",
    "\"params\"",
    "\"aligned\"",
    "\"tensor_maps\"",
    "\"box\"",
    "\"target\"",
    "\"file\"",
    "\"sha256\"",
    "\"caller\"",
    "\"cdiv(seq_q, 64)\"",
    "\"mul(batch, heads_q)\"",
    "\"max(num_splits, 1)\"",
    "\"cdiv(cdiv(cdiv(",
    "\"ir\"",
    "\"cpu:avx2\"",
    "\"cpu:avx512\"",
    "\"cpu:bogus\"",
    "\"ptx:sm_90a\"",
    "\"ptx:sm_80\"",
    "\"mlir:cpu\"",
    "\"mlir:gpu\"",
    "\"mlir:gpu:sm_90\"",
    "\"../x\"",
    "\"/etc/passwd\"",
    "\"timings\"",
    "\"median_ms\"",
    "\"status\"",
    "\"created\"",
    "\"config_id\"",
    "0",
    "-0",
    "-1",
    "1e999",
    "-1e999",
    "1.5",
    "NaN",
    "Infinity",
    "\n",
    "  ",
    "\t",
];

const FLAG_TOKENS: &[&str] = &[
    ",",
    ",,",
    "=",
    "==",
    " ",
    "\t",
    "+",
    "-",
    "batch",
    "seq_q",
    "seq_k",
    "heads_q",
    "heads_kv",
    "head_dim",
    "head_dim_v",
    "seq",
    "heads",
    "chunk_size",
    "block_m",
    "block_n",
    "block_h",
    "num_warps",
    "num_stages",
    "num_splits",
    "softmax_scale",
    "window_left",
    "window_right",
    "logits_soft_cap",
    "dropout_p",
    "seed_lo",
    "seed_hi",
    "split_kv",
    "single",
    "bf16",
    "f16",
    "f32",
    "0x10",
    "1_000",
    "+5",
    "٣",
    "１",
    "NaN",
    "inf",
    "-inf",
    "infinity",
    "1e400",
    "--shape ",
    "--size ",
    "--config ",
    "--scalar ",
    "--window ",
    "--softcap ",
    "--dropout ",
    "--dtype ",
    "--variant ",
    "--plan ",
    "--spec ",
    "--memory-limit ",
    "KiB",
    "MiB",
    "GiB",
    "TiB",
    "k",
    "M",
    "G",
    "T",
    "\n",
];

/// Numbers at the edges of every integer and float type the loaders read.
pub const NUMBERS: &[&str] = &[
    "0",
    "-0",
    "-1",
    "1",
    "7",
    "255",
    "256",
    "65535",
    "65536",
    "2147483647",
    "2147483648",
    "-2147483649",
    "4294967295",
    "4294967296",
    "9007199254740993",
    "9223372036854775807",
    "9223372036854775808",
    "-9223372036854775808",
    "-9223372036854775809",
    "18446744073709551615",
    "18446744073709551616",
    "340282366920938463463374607431768211456",
    "99999999999999999999999999999999999999999999999999",
    "1e308",
    "1e309",
    "-1e309",
    "1e-400",
    "4.9e-324",
    "0.5",
    "NaN",
    "nan",
    "inf",
    "-inf",
    ".inf",
    ".nan",
    "0x10",
    "0o17",
    "0b11",
    "1_000",
    "00012",
    "+64",
];

/// Control characters, odd Unicode and byte sequences that are not UTF-8.
pub const WEIRD: &[&[u8]] = &[
    b"\0",
    b"\x1b[2J",
    b"\r",
    b"\r\n",
    b"\x0b",
    b"\x0c",
    b"\x7f",
    b"\t",
    "\u{feff}".as_bytes(),
    "\u{2028}".as_bytes(),
    "\u{200b}".as_bytes(),
    "\u{202e}".as_bytes(),
    "\u{85}".as_bytes(),
    "é".as_bytes(),
    "e\u{301}".as_bytes(),
    "𝕏".as_bytes(),
    "漢字".as_bytes(),
    b"\xff",
    b"\xfe\xff",
    b"\xc3",
    b"\xe2\x82",
    b"\xed\xa0\x80",
    b"\xf4\x90\x80\x80",
    b"\xc0\x80",
    b"\x80",
];

/// Openers that nest when repeated.
const NESTS: &[&str] = &["[", "{", "- ", "{a: ", "[[", "(", "cdiv(", "max(", "\"a\":{", "  "];

pub fn tokens(d: Dialect) -> &'static [&'static str] {
    match d {
        Dialect::Yaml => YAML_TOKENS,
        Dialect::Ir => IR_TOKENS,
        Dialect::Json => JSON_TOKENS,
        Dialect::Flags => FLAG_TOKENS,
    }
}

/// A mutation of `input` (one of `seeds`, or anything): one to four stacked edits, the
/// result at most `max_len` bytes.
pub fn mutate(input: &[u8], seeds: &[Vec<u8>], dialect: Dialect, rng: &mut Rng, max_len: usize) -> Vec<u8> {
    let mut out = input.to_vec();
    let edits = 1 + rng.below(4);
    for _ in 0..edits {
        edit(&mut out, seeds, dialect, rng, max_len);
        out.truncate(max_len);
    }
    out
}

/// A position in `data`, biased to the start of a token (after a space, punctuation or a
/// line break) half the time.
fn position(data: &[u8], rng: &mut Rng) -> usize {
    let p = rng.below(data.len() + 1);
    if rng.chance(1, 2) {
        return p;
    }
    let boundary = |b: u8| b.is_ascii_whitespace() || b.is_ascii_punctuation();
    (p..data.len()).find(|&i| i == 0 || boundary(data[i - 1])).unwrap_or(data.len())
}

/// Byte ranges of the runs of `data` for which `is` holds.
fn runs(data: &[u8], is: impl Fn(u8) -> bool) -> Vec<(usize, usize)> {
    let mut out = Vec::new();
    let mut i = 0;
    while i < data.len() {
        if is(data[i]) {
            let start = i;
            while i < data.len() && is(data[i]) {
                i += 1;
            }
            out.push((start, i));
        } else {
            i += 1;
        }
    }
    out
}

fn is_word(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b == b'_' || b == b'.' || b == b':'
}

fn lines(data: &[u8]) -> Vec<Vec<u8>> {
    data.split_inclusive(|&b| b == b'\n').map(<[u8]>::to_vec).collect()
}

fn splice_range(data: &mut Vec<u8>, start: usize, end: usize, with: &[u8]) {
    data.splice(start..end, with.iter().copied());
}

fn edit(data: &mut Vec<u8>, seeds: &[Vec<u8>], dialect: Dialect, rng: &mut Rng, max_len: usize) {
    let other: &[u8] = if seeds.is_empty() { &[] } else { rng.pick(seeds).as_slice() };
    match rng.below(16) {
        // Flip a bit.
        0 if !data.is_empty() => {
            let i = rng.below(data.len());
            data[i] ^= 1 << rng.below(8);
        }
        // Set a byte to an interesting value.
        1 if !data.is_empty() => {
            let i = rng.below(data.len());
            data[i] = *rng.pick(&[0u8, 0xff, 0x80, b'\n', b':', b'-', b' ', b'"', b'\'', b'%', b'{', b'[', b'9']);
        }
        // Truncate.
        2 => {
            let n = rng.below(data.len() + 1);
            data.truncate(n);
        }
        // Delete a range.
        3 if !data.is_empty() => {
            let start = rng.below(data.len());
            let end = (start + 1 + rng.below(32)).min(data.len());
            data.drain(start..end);
        }
        // Duplicate a range elsewhere.
        4 if !data.is_empty() => {
            let start = rng.below(data.len());
            let end = (start + 1 + rng.below(64)).min(data.len());
            let chunk = data[start..end].to_vec();
            let at = position(data, rng);
            splice_range(data, at, at, &chunk);
        }
        // Line edits: delete, duplicate, swap, re-indent, or splice in another seed's line.
        5 | 6 => {
            let mut ls = lines(data);
            if ls.is_empty() {
                ls.push(Vec::new());
            }
            let i = rng.below(ls.len());
            match rng.below(6) {
                0 => {
                    ls.remove(i);
                }
                1 => {
                    let l = ls[i].clone();
                    ls.insert(i, l);
                }
                2 => {
                    let j = rng.below(ls.len());
                    ls.swap(i, j);
                }
                3 => {
                    let indent = *rng.pick(&["", " ", "  ", "    ", "\t", "        "]);
                    let body: Vec<u8> = ls[i].iter().copied().skip_while(|b| *b == b' ' || *b == b'\t').collect();
                    ls[i] = [indent.as_bytes(), &body].concat();
                }
                _ => {
                    let theirs = lines(other);
                    if !theirs.is_empty() {
                        let l = rng.pick(&theirs).clone();
                        if rng.chance(1, 2) {
                            ls[i] = l;
                        } else {
                            ls.insert(i, l);
                        }
                    }
                }
            }
            *data = ls.concat();
        }
        // Cross over: a prefix of this, a suffix of another seed.
        7 => {
            let a = position(data, rng);
            let b = rng.below(other.len() + 1);
            data.truncate(a);
            data.extend_from_slice(&other[b..]);
        }
        // Insert a token of the language.
        8 | 9 => {
            let t = *rng.pick(tokens(dialect));
            let at = position(data, rng);
            splice_range(data, at, at, t.as_bytes());
        }
        // Replace a number by an extreme one.
        10 => {
            let nums = runs(data, |b| b.is_ascii_digit());
            let n = *rng.pick(NUMBERS);
            if nums.is_empty() {
                let at = position(data, rng);
                splice_range(data, at, at, n.as_bytes());
            } else {
                let (s, e) = *rng.pick(&nums);
                splice_range(data, s, e, n.as_bytes());
            }
        }
        // Replace a word by a word of another seed or of the language.
        11 => {
            let words = runs(data, is_word);
            if !words.is_empty() {
                let (s, e) = *rng.pick(&words);
                let theirs = runs(other, is_word);
                let w: Vec<u8> = if !theirs.is_empty() && rng.chance(1, 2) {
                    let (a, b) = *rng.pick(&theirs);
                    other[a..b].to_vec()
                } else {
                    rng.pick(tokens(dialect)).as_bytes().to_vec()
                };
                splice_range(data, s, e, &w);
            }
        }
        // Control characters, odd Unicode, bytes that are not UTF-8.
        12 => {
            let w = *rng.pick(WEIRD);
            let at = rng.below(data.len() + 1);
            if rng.chance(1, 3) && at < data.len() {
                splice_range(data, at, at + 1, w);
            } else {
                splice_range(data, at, at, w);
            }
        }
        // Deep nesting.
        13 => {
            let opener = *rng.pick(NESTS);
            let depth = *rng.pick(&[8usize, 64, 200, 1000, 5000, 20000]);
            let room = max_len.saturating_sub(data.len()) / opener.len().max(1);
            let at = position(data, rng);
            let nest = opener.repeat(depth.min(room));
            splice_range(data, at, at, nest.as_bytes());
        }
        // Repeat a small chunk (long lists, long names, many keys).
        14 if !data.is_empty() => {
            let start = rng.below(data.len());
            let end = (start + 1 + rng.below(24)).min(data.len());
            let chunk = data[start..end].to_vec();
            let times = *rng.pick(&[2usize, 16, 100, 1000]);
            let room = max_len.saturating_sub(data.len()) / chunk.len();
            let rep = chunk.repeat(times.min(room));
            splice_range(data, end, end, &rep);
        }
        // Replace a quoted or bracketed value by a random token.
        _ => {
            let t = *rng.pick(tokens(dialect));
            if data.is_empty() {
                data.extend_from_slice(t.as_bytes());
            } else {
                let s = rng.below(data.len());
                let e = (s + rng.below(16)).min(data.len());
                splice_range(data, s, e, t.as_bytes());
            }
        }
    }
}
