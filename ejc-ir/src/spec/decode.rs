//! Turning spec text into a validated [`Spec`], collecting every problem on the way.
//!
//! ```
//! let text = "
//! name: tiny
//! op: flash_attention_fwd
//! dtypes: [bf16]
//! head_dims: [64]
//! variants:
//!   causal: { causal: true, sliding_window: 128 }
//! schedule: { block_m: [64], block_n: [64], num_warps: [4], num_stages: [2] }
//! ";
//! let spec = ejc_ir::spec::load_str("tiny.yaml", text).unwrap();
//! let causal = spec.variant("causal").unwrap();
//! // A single window size on a causal variant looks back only.
//! assert_eq!(
//!     causal.features.sliding_window,
//!     Some(ejc_ir::spec::Window::Fixed { left: 128, right: 0 })
//! );
//! assert_eq!(spec.targets, vec![ejc_ir::spec::Target::Ir]);
//! ```
//!
//! Decoding never stops at the first problem: each field is checked on its own, a bad
//! value is replaced by a stand-in so its siblings can still be checked, and the spec is
//! returned only when no diagnostic was produced. The format is documented in
//! `docs/spec.md`; keep the two in step.

use std::path::Path;

use sha2::{Digest, Sha256};

use super::diag::{suggest, Diagnostic, Source, SpecError, ROOT};
use super::yaml::{self, join, Node, NodeKind, Style};
use super::{Features, Layout, ScheduleSpace, SoftCap, Spec, Target, Variant, Window};
use crate::types::DType;

/// Load and validate a spec file. Diagnostics name the file as `path.display()`.
///
/// # Errors
///
/// Every problem found: the file cannot be read or is not UTF-8 (one diagnostic), or
/// is not a valid spec (all diagnostics, in source order).
pub fn load_file(path: impl AsRef<Path>) -> Result<Spec, SpecError> {
    let path = path.as_ref();
    let file = path.display().to_string();
    let bytes = std::fs::read(path)
        .map_err(|e| SpecError::single(Diagnostic::new(&file, 0, 0, "", format!("cannot read the spec: {e}"))))?;
    match std::str::from_utf8(&bytes) {
        Ok(text) => decode(&file, text, sha256_hex(&bytes)),
        Err(e) => Err(SpecError::single(not_utf8(&file, &bytes, e.valid_up_to()))),
    }
}

/// Load and validate spec text; `file` names it in diagnostics.
///
/// # Errors
///
/// Every problem with the spec, in source order.
pub fn load_str(file: &str, text: &str) -> Result<Spec, SpecError> {
    decode(file, text, sha256_hex(text.as_bytes()))
}

fn sha256_hex(bytes: &[u8]) -> String {
    use std::fmt::Write;
    Sha256::digest(bytes).iter().fold(String::with_capacity(64), |mut hex, b| {
        let _ = write!(hex, "{b:02x}"); // writing to a String cannot fail
        hex
    })
}

/// A diagnostic at the first byte that is not UTF-8, with the line shown up to there.
fn not_utf8(file: &str, bytes: &[u8], valid_up_to: usize) -> Diagnostic {
    let valid = bytes.get(..valid_up_to).unwrap_or_default();
    let line_start = valid.iter().rposition(|&b| b == b'\n').map_or(0, |i| i + 1);
    let line = valid.iter().filter(|&&b| b == b'\n').count() + 1;
    let line_end = bytes[line_start..].iter().position(|&b| b == b'\n').map_or(bytes.len(), |i| line_start + i);
    // The prefix is valid UTF-8 by construction, so the column counts characters.
    let column = String::from_utf8_lossy(&valid[line_start..]).chars().count() + 1;
    let byte = bytes.get(valid_up_to).copied().unwrap_or_default();
    let mut d = Diagnostic::new(file, line, column, "", "the spec is not valid UTF-8 text")
        .with_found(format!("the byte 0x{byte:02x}"))
        .with_allowed("UTF-8 text");
    d.source_line = Some(String::from_utf8_lossy(&bytes[line_start..line_end]).into_owned());
    d
}

fn decode(file: &str, text: &str, hash: String) -> Result<Spec, SpecError> {
    // A byte-order mark is not part of the first key; editors on some systems add one.
    let text = text.strip_prefix('\u{feff}').unwrap_or(text);
    let src = Source::new(file, text);
    let mut d = Decoder { src: &src, diags: Vec::new() };
    let spec = yaml::parse(&src, text, &mut d.diags).map(|root| d.spec(&root, file, hash));
    let mut diags = d.diags;
    match spec {
        Some(spec) if diags.is_empty() => Ok(spec),
        _ => {
            // Source order; the sort is stable, so problems at one position keep the
            // order they were found in.
            diags.sort_by_key(|d| (d.line, d.column));
            Err(SpecError { diagnostics: diags })
        }
    }
}

// ---- the format --------------------------------------------------------------------

const TOP_FIELDS: &[&str] =
    &["name", "op", "version", "description", "layout", "dtypes", "head_dims", "variants", "schedule", "targets"];
const VARIANT_FIELDS: &[&str] = &[
    "description",
    "causal",
    "sliding_window",
    "logits_soft_cap",
    "sinks",
    "bias",
    "mask",
    "segment_ids",
    "varlen",
    "dropout",
];
const SCHEDULE_FIELDS: &[&str] = &["block_m", "block_n", "num_warps", "num_stages"];
const OPS: &[&str] = &["flash_attention_fwd"];
const DTYPES: &[&str] = &["bf16", "f16", "f32"];
pub(crate) const TARGETS: &[&str] = &[
    "ir",
    "cpu",
    "cpu:avx512bf16",
    "cpu:avx512",
    "cpu:avx2",
    "cpu:x86-64",
    "ptx:sm_80",
    "ptx:sm_86",
    "ptx:sm_89",
    "ptx:sm_90",
    "ptx:sm_90a",
    "mlir:cpu",
    "mlir:gpu",
];
const WARPS: &[i64] = &[1, 2, 4, 8, 16];
/// Features whose dense per-row tensors a packed (`varlen`) batch cannot have.
const DENSE_FEATURES: &[&str] = &["bias", "mask", "segment_ids"];

const IDENTIFIER: &str = "an identifier (a lowercase letter, then lowercase letters, digits or `_`)";

/// Spellings from other frameworks, answered with the spec's name for the dtype.
const DTYPE_ALIASES: &[(&str, &str)] = &[
    ("bfloat16", "bf16"),
    ("fp16", "f16"),
    ("half", "f16"),
    ("float16", "f16"),
    ("fp32", "f32"),
    ("float", "f32"),
    ("float32", "f32"),
];

// ---- scalars -----------------------------------------------------------------------

/// What a scalar means under the (JSON-like) subset of the YAML core schema a spec uses.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Value<'n> {
    Null,
    Bool(bool),
    /// Saturated to the i64 range: every integer field has a much smaller bound, so a
    /// huge number is still reported as out of range, showing the text as written.
    Int(i64),
    Float(f64),
    Str(&'n str),
    Collection,
}

fn value(node: &Node) -> Value<'_> {
    match &node.kind {
        NodeKind::Null => Value::Null,
        NodeKind::Map(_) | NodeKind::Seq(_) => Value::Collection,
        NodeKind::Scalar { text, style: Style::Quoted } => Value::Str(text),
        NodeKind::Scalar { text, style: Style::Plain } => plain_value(text),
    }
}

fn plain_value(text: &str) -> Value<'_> {
    match text {
        "true" => return Value::Bool(true),
        "false" => return Value::Bool(false),
        ".inf" | ".Inf" | ".INF" | "+.inf" | "+.Inf" | "+.INF" => return Value::Float(f64::INFINITY),
        "-.inf" | "-.Inf" | "-.INF" => return Value::Float(f64::NEG_INFINITY),
        ".nan" | ".NaN" | ".NAN" => return Value::Float(f64::NAN),
        _ => {}
    }
    let unsigned = text.strip_prefix(['-', '+']).unwrap_or(text);
    if !unsigned.is_empty() && unsigned.bytes().all(|b| b.is_ascii_digit()) {
        let negative = text.starts_with('-');
        let magnitude =
            unsigned.bytes().fold(0i64, |acc, b| acc.saturating_mul(10).saturating_add(i64::from(b - b'0')));
        return Value::Int(if negative { -magnitude } else { magnitude });
    }
    if is_decimal_float(text) {
        // The shape check above is stricter than Rust's float syntax (no `inf`, `nan`),
        // so a failed parse cannot happen; a string is the safe answer if it does.
        return text.parse().map_or(Value::Str(text), Value::Float);
    }
    Value::Str(text)
}

/// `[-+]? ( . digits | digits [. digits?] ) ( [eE] [-+]? digits )?` (the core schema's
/// float, minus the forms handled separately).
fn is_decimal_float(text: &str) -> bool {
    let s = text.strip_prefix(['-', '+']).unwrap_or(text);
    let (mantissa, exponent) = match s.find(['e', 'E']) {
        Some(i) => (&s[..i], Some(&s[i + 1..])),
        None => (s, None),
    };
    let (int, frac) = match mantissa.split_once('.') {
        Some((i, f)) => (i, Some(f)),
        None => (mantissa, None),
    };
    let digits = |p: &str| p.bytes().all(|b| b.is_ascii_digit());
    let mantissa_ok =
        digits(int) && frac.is_none_or(digits) && (!int.is_empty() || frac.is_some_and(|f| !f.is_empty()));
    let exponent_ok = exponent.is_none_or(|e| {
        let e = e.strip_prefix(['-', '+']).unwrap_or(e);
        !e.is_empty() && digits(e)
    });
    mantissa_ok && exponent_ok
}

/// What a node is, in YAML terms, for `found:` lines.
fn describe(node: &Node) -> String {
    match &node.kind {
        NodeKind::Null => "nothing (null)".to_string(),
        NodeKind::Map(entries) if entries.is_empty() => "an empty mapping `{}`".to_string(),
        NodeKind::Map(_) => "a mapping".to_string(),
        NodeKind::Seq(items) if items.is_empty() => "an empty list `[]`".to_string(),
        NodeKind::Seq(items) if items.len() == 1 => "a list of 1 item".to_string(),
        NodeKind::Seq(items) => format!("a list of {} items", items.len()),
        NodeKind::Scalar { text, style } => match (style, value(node)) {
            (Style::Plain, Value::Bool(_) | Value::Int(_) | Value::Float(_)) => text.clone(),
            _ => format!("a string {}", quote(text)),
        },
    }
}

/// `"text"`, escaped, shortened when long (a stray paragraph helps nobody).
fn quote(text: &str) -> String {
    const MAX: usize = 60;
    if text.chars().count() > MAX {
        let head: String = text.chars().take(MAX - 3).collect();
        format!("{:?}", head + "...")
    } else {
        format!("{text:?}")
    }
}

fn is_identifier(s: &str) -> bool {
    let mut chars = s.chars();
    chars.next().is_some_and(|c| c.is_ascii_lowercase())
        && chars.all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')
}

fn or_list(items: &[&str]) -> String {
    match items {
        [] => String::new(),
        [one] => (*one).to_string(),
        [init @ .., last] => format!("{} or {last}", init.join(", ")),
    }
}

// ---- the decoder -------------------------------------------------------------------

struct Decoder<'s> {
    src: &'s Source<'s>,
    diags: Vec<Diagnostic>,
}

/// The entries of a mapping whose keys have been checked against the known fields.
struct Fields<'n> {
    node: &'n Node,
    path: String,
    entries: Vec<(&'n str, &'n Node, &'n Node)>,
}

impl<'n> Fields<'n> {
    /// `(key, value)` of a field, if present.
    fn get(&self, name: &str) -> Option<(&'n Node, &'n Node)> {
        self.entries.iter().find(|(k, _, _)| *k == name).map(|&(_, k, v)| (k, v))
    }

    fn value(&self, name: &str) -> Option<&'n Node> {
        self.get(name).map(|(_, v)| v)
    }

    fn path(&self, name: &str) -> String {
        if self.path == ROOT {
            name.to_string()
        } else {
            format!("{}.{name}", self.path)
        }
    }
}

impl Decoder<'_> {
    fn error(&mut self, node: &Node, path: &str, message: impl Into<String>) -> &mut Diagnostic {
        self.diags.push(self.src.diag(node.line, node.col, path, message));
        let last = self.diags.len() - 1;
        &mut self.diags[last]
    }

    /// Report a value of the wrong kind or outside its domain.
    fn invalid(&mut self, node: &Node, path: &str, message: impl Into<String>, allowed: impl Into<String>) {
        let found = describe(node);
        let d = self.error(node, path, message);
        d.found = Some(found);
        d.allowed = Some(allowed.into());
    }

    // -- shapes --

    /// A mapping's entries, reporting non-string keys and keys not in `known`
    /// (described as a `what`, e.g. "variant field").
    fn fields<'n>(
        &mut self,
        node: &'n Node,
        path: &str,
        known: &[&str],
        what: &str,
        allowed: &str,
    ) -> Option<Fields<'n>> {
        let NodeKind::Map(entries) = &node.kind else {
            self.invalid(node, path, "expected a mapping", allowed);
            return None;
        };
        let mut fields = Fields { node, path: path.to_string(), entries: Vec::new() };
        for (key, value) in entries {
            let NodeKind::Scalar { text, .. } = &key.kind else {
                self.invalid(key, path, "a field name must be a string", format!("one of: {}", known.join(", ")));
                continue;
            };
            if !known.contains(&text.as_str()) {
                let mut message = format!("unknown {what} `{text}`");
                if let Some(close) = suggest(text, known) {
                    message.push_str(&format!("; did you mean `{close}`?"));
                }
                let d = self.error(key, &join(path, key), message);
                d.allowed = Some(known.join(", "));
                continue;
            }
            fields.entries.push((text.as_str(), key, value));
        }
        Some(fields)
    }

    /// A field that must be present; reported at the mapping when it is not.
    fn required<'n>(&mut self, fields: &Fields<'n>, name: &str, allowed: &str) -> Option<&'n Node> {
        let value = fields.value(name);
        if value.is_none() {
            let d = self.error(fields.node, &fields.path, format!("missing required field `{name}`"));
            d.allowed = Some(format!("`{name}`: {allowed}"));
        }
        value
    }

    /// The items of a non-empty list. A lone scalar gets a hint on how to make it a list.
    fn list<'n>(&mut self, node: &'n Node, path: &str, allowed: &str) -> Option<&'n [Node]> {
        match &node.kind {
            NodeKind::Seq(items) if !items.is_empty() => Some(items),
            NodeKind::Seq(_) => {
                self.invalid(node, path, "the list is empty", allowed);
                None
            }
            NodeKind::Scalar { text, .. } => {
                let hint = format!("expected a list (write `[{text}]` for a single value)");
                self.invalid(node, path, hint, allowed);
                None
            }
            _ => {
                self.invalid(node, path, "expected a list", allowed);
                None
            }
        }
    }

    /// A non-empty list whose items each decode with `item`; a repeated item is an
    /// error at its second occurrence. Items that fail are left out.
    fn unique_list<T: PartialEq>(
        &mut self,
        node: &Node,
        path: &str,
        noun: &str,
        allowed: &str,
        mut item: impl FnMut(&mut Self, &Node, &str) -> Option<T>,
    ) -> Vec<T> {
        let Some(items) = self.list(node, path, allowed) else {
            return Vec::new();
        };
        let mut out: Vec<(T, &Node)> = Vec::new();
        for (i, node) in items.iter().enumerate() {
            let path = format!("{path}[{i}]");
            let Some(v) = item(self, node, &path) else {
                continue;
            };
            if let Some((_, first)) = out.iter().find(|(seen, _)| *seen == v) {
                let message = format!(
                    "duplicate {noun} {} (first listed at line {}, column {})",
                    source_text(node),
                    first.line,
                    first.col
                );
                self.error(node, &path, message).allowed = Some("each value once".into());
                continue;
            }
            out.push((v, node));
        }
        out.into_iter().map(|(v, _)| v).collect()
    }

    // -- scalars --

    fn string<'n>(&mut self, node: &'n Node, path: &str, allowed: &str) -> Option<&'n str> {
        match value(node) {
            Value::Str(s) => Some(s),
            _ => {
                self.invalid(node, path, "expected a string", allowed);
                None
            }
        }
    }

    fn bool(&mut self, node: &Node, path: &str) -> Option<bool> {
        match value(node) {
            Value::Bool(b) => Some(b),
            // YAML 1.1 read these as booleans and many files still use them: say why
            // they are strings here instead of only that they are.
            Value::Str(s) if !node_is_quoted(node) => {
                let message = match s {
                    "yes" | "Yes" | "YES" | "on" | "On" | "ON" | "y" | "Y" => {
                        "expected a boolean; `yes`/`on` are strings in YAML 1.2 (write `true`)"
                    }
                    "no" | "No" | "NO" | "off" | "Off" | "OFF" | "n" | "N" => {
                        "expected a boolean; `no`/`off` are strings in YAML 1.2 (write `false`)"
                    }
                    "True" | "TRUE" | "False" | "FALSE" => "expected a boolean; write it in lowercase",
                    _ => "expected a boolean",
                };
                self.invalid(node, path, message, "`true` or `false`");
                None
            }
            _ => {
                self.invalid(node, path, "expected a boolean", "`true` or `false`");
                None
            }
        }
    }

    /// An integer in `domain`, which also phrases the rule: `check` gives the message
    /// for a value out of the domain, or `None` when the value is fine.
    fn int(
        &mut self,
        node: &Node,
        path: &str,
        allowed: &str,
        check: impl Fn(i64) -> Option<&'static str>,
    ) -> Option<i64> {
        match value(node) {
            Value::Int(v) => match check(v) {
                None => Some(v),
                Some(message) => {
                    self.invalid(node, path, message, allowed);
                    None
                }
            },
            Value::Str(s) if node_is_quoted(node) && matches!(plain_value(s), Value::Int(_)) => {
                let message = format!("expected an integer; quotes make this a string (write {s} without them)");
                self.invalid(node, path, message, allowed);
                None
            }
            _ => {
                self.invalid(node, path, "expected an integer", allowed);
                None
            }
        }
    }

    /// A string naming one of `choices`, with a typo suggestion.
    fn choice<'c>(&mut self, node: &Node, path: &str, noun: &str, choices: &[&'c str]) -> Option<&'c str> {
        let s = self.string(node, path, &or_list(choices))?;
        if let Some(c) = choices.iter().find(|c| **c == s) {
            return Some(c);
        }
        let mut message = format!("unknown {noun} `{s}`");
        if let Some(close) = suggest(s, choices) {
            message.push_str(&format!("; did you mean `{close}`?"));
        }
        self.invalid(node, path, message, or_list(choices));
        None
    }

    // -- the spec --

    fn spec(&mut self, root: &Node, file: &str, hash: String) -> Spec {
        let mut spec = Spec {
            file: file.to_string(),
            hash,
            name: String::new(),
            op: String::new(),
            version: 1,
            description: None,
            layout: Layout::Bshd,
            dtypes: Vec::new(),
            head_dims: Vec::new(),
            variants: Vec::new(),
            schedule: ScheduleSpace {
                block_m: Vec::new(),
                block_n: Vec::new(),
                num_warps: Vec::new(),
                num_stages: Vec::new(),
            },
            targets: vec![Target::Ir],
        };
        let top_allowed = "a mapping of the spec's fields (name, op, dtypes, head_dims, variants, schedule, ...)";
        let Some(f) = self.fields(root, ROOT, TOP_FIELDS, "top-level field", top_allowed) else {
            return spec;
        };

        if let Some(v) = self.required(&f, "name", IDENTIFIER) {
            spec.name = self.identifier(v, "name", "name").unwrap_or_default();
        }
        if let Some(v) = self.required(&f, "op", &or_list(OPS)) {
            spec.op = self.op(v).unwrap_or_default();
        }
        if let Some(v) = f.value("version") {
            let allowed = "a non-negative integer (default 1)";
            let check =
                |v: i64| (u32::try_from(v).is_err()).then_some("the version must be a non-negative 32-bit integer");
            spec.version = self.int(v, "version", allowed, check).and_then(|v| u32::try_from(v).ok()).unwrap_or(1);
        }
        if let Some(v) = f.value("description") {
            spec.description = self.string(v, "description", "a string").map(str::to_string);
        }
        if let Some(v) = f.value("layout") {
            self.choice(v, "layout", "layout", &["bshd"]);
        }
        if let Some(v) = self.required(&f, "dtypes", "a non-empty list of bf16, f16, f32") {
            spec.dtypes = self.dtypes(v);
        }
        if let Some(v) = self.required(&f, "head_dims", "a non-empty list of multiples of 16 from 16 to 256") {
            spec.head_dims = self.head_dims(v);
        }
        if let Some(v) = self.required(&f, "variants", "a mapping from variant names to their features") {
            spec.variants = self.variants(v);
        }
        if let Some(v) = self.required(&f, "schedule", "a mapping with block_m, block_n, num_warps and num_stages") {
            spec.schedule = self.schedule(v);
        }
        if let Some(v) = f.value("targets") {
            spec.targets = self.targets(v);
        }
        spec
    }

    fn identifier(&mut self, node: &Node, path: &str, noun: &str) -> Option<String> {
        let s = self.string(node, path, IDENTIFIER)?;
        if is_identifier(s) {
            Some(s.to_string())
        } else {
            self.invalid(node, path, format!("`{s}` is not a valid {noun}"), IDENTIFIER);
            None
        }
    }

    fn op(&mut self, node: &Node) -> Option<String> {
        let s = self.string(node, "op", &or_list(OPS))?;
        if OPS.contains(&s) {
            return Some(s.to_string());
        }
        // No typo suggestion: `flash_attention_bwd` is one letter from the forward op
        // but is a different operation, not a misspelling of it.
        self.invalid(node, "op", format!("unknown op `{s}`"), format!("{} (the only op today)", or_list(OPS)));
        None
    }

    fn dtypes(&mut self, node: &Node) -> Vec<DType> {
        let list_allowed = "a non-empty list of bf16, f16, f32";
        self.unique_list(node, "dtypes", "dtype", list_allowed, Self::dtype)
    }

    fn dtype(&mut self, node: &Node, path: &str) -> Option<DType> {
        let allowed = or_list(DTYPES);
        let s = self.string(node, path, &allowed)?;
        let parsed = s.parse::<DType>().ok();
        let message = match parsed {
            Some(t) if DTYPES.contains(&s) => return Some(t),
            // The IR's other element types are real dtypes, just not ones attention
            // takes its inputs in: a "did you mean" would only mislead.
            Some(_) => format!("dtype `{s}` cannot be an attention input"),
            None => {
                let alias = DTYPE_ALIASES.iter().find(|(a, _)| a.eq_ignore_ascii_case(s));
                match (alias, suggest(s, DTYPES)) {
                    (Some((_, name)), _) => {
                        format!("unknown dtype `{s}`; the spec calls it `{name}`")
                    }
                    (None, Some(close)) => format!("unknown dtype `{s}`; did you mean `{close}`?"),
                    (None, None) => format!("unknown dtype `{s}`"),
                }
            }
        };
        self.invalid(node, path, message, allowed);
        None
    }

    fn head_dims(&mut self, node: &Node) -> Vec<usize> {
        let allowed = "a multiple of 16 from 16 to 256";
        let list_allowed = "a non-empty list of multiples of 16 from 16 to 256";
        self.unique_list(node, "head_dims", "head dimension", list_allowed, |d, node, path| {
            let v = d.int(node, path, allowed, |v| {
                if v % 16 != 0 {
                    Some("head dimension is not a multiple of 16")
                } else if !(16..=256).contains(&v) {
                    Some("head dimension is out of range")
                } else {
                    None
                }
            })?;
            usize::try_from(v).ok()
        })
    }

    fn variants(&mut self, node: &Node) -> Vec<Variant> {
        let allowed = "a mapping from variant names to their features, e.g. `causal: { causal: true }`";
        let NodeKind::Map(entries) = &node.kind else {
            self.invalid(node, "variants", "expected a mapping", allowed);
            return Vec::new();
        };
        if entries.is_empty() {
            self.invalid(node, "variants", "at least one variant is required", allowed);
            return Vec::new();
        }
        let mut out = Vec::new();
        for (key, value) in entries {
            let path = join("variants", key);
            let name = self.identifier(key, &path, "variant name").unwrap_or_default();
            if let Some(features) = self.features(value, &path) {
                let (description, features) = features;
                out.push(Variant { name, description, features });
            }
        }
        out
    }

    fn features(&mut self, node: &Node, path: &str) -> Option<(Option<String>, Features)> {
        let allowed = "a mapping of features such as `causal: true`; `{}` for plain full attention";
        let f = self.fields(node, path, VARIANT_FIELDS, "variant field", allowed)?;
        let mut features = Features::default();
        let flag = |d: &mut Self, name: &str| match f.value(name) {
            Some(v) => d.bool(v, &f.path(name)).unwrap_or(false),
            None => false,
        };
        features.causal = flag(self, "causal");
        features.sinks = flag(self, "sinks");
        features.bias = flag(self, "bias");
        features.mask = flag(self, "mask");
        features.segment_ids = flag(self, "segment_ids");
        features.varlen = flag(self, "varlen");
        features.dropout = flag(self, "dropout");
        let description = f.value("description").and_then(|v| {
            let path = f.path("description");
            self.string(v, &path, "a string").map(str::to_string)
        });
        if let Some(v) = f.value("sliding_window") {
            features.sliding_window = self.window(v, &f.path("sliding_window"), features.causal);
        }
        if let Some(v) = f.value("logits_soft_cap") {
            features.logits_soft_cap = self.soft_cap(v, &f.path("logits_soft_cap"));
        }
        if features.varlen {
            self.check_varlen(&f, &features);
        }
        Some((description, features))
    }

    /// `varlen` packs sequences back to back; bias, mask and segment ids are shaped for
    /// a padded batch, so a kernel taking both could not say what they mean.
    fn check_varlen(&mut self, f: &Fields<'_>, features: &Features) {
        let on = [features.bias, features.mask, features.segment_ids];
        let conflicts: Vec<(&str, usize)> = DENSE_FEATURES
            .iter()
            .zip(on)
            .filter(|&(_, on)| on)
            .filter_map(|(name, _)| f.get(name).map(|(key, _)| (*name, key.line)))
            .collect();
        let Some(varlen) = f.value("varlen") else {
            return;
        };
        if conflicts.is_empty() {
            return;
        }
        let named: Vec<String> = conflicts.iter().map(|(n, line)| format!("`{n}` (line {line})")).collect();
        let shapes = if conflicts.iter().all(|(n, _)| *n == "segment_ids") {
            "dense `[B, S]` segment ids have"
        } else {
            "dense `[B, H, Sq, Sk]` tensors have"
        };
        let message =
            format!("`varlen` cannot be combined with {}: {shapes} no meaning for a packed batch", named.join(" and "));
        let d = self.error(varlen, &f.path("varlen"), message);
        d.found = Some(format!(
            "varlen: true with {}",
            conflicts.iter().map(|(n, _)| format!("{n}: true")).collect::<Vec<_>>().join(", ")
        ));
        d.allowed = Some("varlen with causal, sliding_window, logits_soft_cap, sinks or dropout".into());
    }

    fn window(&mut self, node: &Node, path: &str, causal: bool) -> Option<Window> {
        let allowed = "`runtime`, a size `w` (`[w, 0]` if causal, else `[w, w]`), \
                       or `[left, right]` with sizes >= 0";
        let size_allowed = "a non-negative integer";
        let size_check = |v: i64| match v {
            v if v < 0 => Some("a window size cannot be negative"),
            v if u32::try_from(v).is_err() => Some("the window size is too large"),
            _ => None,
        };
        match (&node.kind, value(node)) {
            (_, Value::Str("runtime")) => Some(Window::Runtime),
            (_, Value::Int(_)) => {
                let w = self.int(node, path, size_allowed, size_check)?;
                let w = u32::try_from(w).ok()?;
                Some(Window::Fixed { left: w, right: if causal { 0 } else { w } })
            }
            (NodeKind::Seq(items), _) if items.len() == 2 => {
                let left = self.int(&items[0], &format!("{path}[0]"), size_allowed, size_check);
                let right = self.int(&items[1], &format!("{path}[1]"), size_allowed, size_check);
                let (left, right) = (u32::try_from(left?).ok()?, u32::try_from(right?).ok()?);
                Some(Window::Fixed { left, right })
            }
            (NodeKind::Seq(_), _) => {
                self.invalid(node, path, "a window is `[left, right]`: exactly two sizes", allowed);
                None
            }
            (_, Value::Str(s)) => {
                let mut message = format!("unknown window `{s}`");
                if suggest(s, &["runtime"]).is_some() {
                    message.push_str("; did you mean `runtime`?");
                }
                self.invalid(node, path, message, allowed);
                None
            }
            _ => {
                self.invalid(node, path, "expected a window", allowed);
                None
            }
        }
    }

    fn soft_cap(&mut self, node: &Node, path: &str) -> Option<SoftCap> {
        let allowed = "`runtime` or a positive number such as 50.0";
        let cap = match value(node) {
            Value::Str("runtime") => return Some(SoftCap::Runtime),
            Value::Int(v) => v as f64,
            Value::Float(v) => v,
            Value::Str(s) => {
                let mut message = format!("unknown soft cap `{s}`");
                if suggest(s, &["runtime"]).is_some() {
                    message.push_str("; did you mean `runtime`?");
                } else if node_is_quoted(node) && matches!(plain_value(s), Value::Int(_) | Value::Float(_)) {
                    message = format!("expected a number; quotes make this a string (write {s} without them)");
                }
                self.invalid(node, path, message, allowed);
                return None;
            }
            _ => {
                self.invalid(node, path, "expected a soft cap", allowed);
                return None;
            }
        };
        let problem = if cap.is_nan() {
            Some("the soft cap is not a number")
        } else if cap <= 0.0 {
            Some("the soft cap must be positive")
        } else if cap.is_infinite() {
            Some("the soft cap must be finite (leave the field out for no cap)")
        } else {
            None
        };
        match problem {
            Some(message) => {
                self.invalid(node, path, message, allowed);
                None
            }
            None => Some(SoftCap::Fixed(cap)),
        }
    }

    fn schedule(&mut self, node: &Node) -> ScheduleSpace {
        let mut space =
            ScheduleSpace { block_m: Vec::new(), block_n: Vec::new(), num_warps: Vec::new(), num_stages: Vec::new() };
        let allowed = "a mapping with block_m, block_n, num_warps and num_stages, each a list";
        let Some(f) = self.fields(node, "schedule", SCHEDULE_FIELDS, "schedule field", allowed) else {
            return space;
        };
        let block = "a power of two from 16 to 256";
        let block_list = "a non-empty list of powers of two from 16 to 256";
        let block_check = |v: i64| {
            if v <= 0 || v & (v - 1) != 0 {
                Some("block size is not a power of two")
            } else if !(16..=256).contains(&v) {
                Some("block size is out of range")
            } else {
                None
            }
        };
        if let Some(v) = self.required(&f, "block_m", block_list) {
            space.block_m = self.u32_list(v, &f.path("block_m"), "block size", block_list, block, block_check);
        }
        if let Some(v) = self.required(&f, "block_n", block_list) {
            space.block_n = self.u32_list(v, &f.path("block_n"), "block size", block_list, block, block_check);
        }
        let warps = or_list(&["1", "2", "4", "8", "16"]);
        let warps_list = format!("a non-empty list of warp counts from {warps}");
        if let Some(v) = self.required(&f, "num_warps", &warps_list) {
            let check = |v: i64| (!WARPS.contains(&v)).then_some("unsupported warp count");
            space.num_warps = self.u32_list(v, &f.path("num_warps"), "warp count", &warps_list, &warps, check);
        }
        let stages = "an integer from 1 to 8";
        let stages_list = "a non-empty list of stage counts from 1 to 8";
        if let Some(v) = self.required(&f, "num_stages", stages_list) {
            let check = |v: i64| (!(1..=8).contains(&v)).then_some("pipeline stage count is out of range");
            space.num_stages = self.u32_list(v, &f.path("num_stages"), "stage count", stages_list, stages, check);
        }
        space
    }

    fn u32_list(
        &mut self,
        node: &Node,
        path: &str,
        noun: &str,
        list_allowed: &str,
        allowed: &str,
        check: impl Fn(i64) -> Option<&'static str>,
    ) -> Vec<u32> {
        self.unique_list(node, path, noun, list_allowed, |d, node, path| {
            d.int(node, path, allowed, &check).and_then(|v| u32::try_from(v).ok())
        })
    }

    fn targets(&mut self, node: &Node) -> Vec<Target> {
        let list_allowed = format!("a non-empty list of targets from {}", TARGETS.join(", "));
        self.unique_list(node, "targets", "target", &list_allowed, |d, node, path| {
            let s = d.string(node, path, &or_list(TARGETS))?;
            if let Some(t) = parse_target(s) {
                return Some(t);
            }
            let message = match s.split_once(':') {
                Some(("ptx", arch)) => {
                    format!("unsupported PTX architecture `{arch}` (ejc targets sm_80 and newer)")
                }
                Some(("cpu", isa)) => format!("unsupported CPU ISA `{isa}`"),
                Some(("mlir", kind)) => format!("unknown MLIR form `{kind}`"),
                _ => format!("unknown target `{s}`"),
            };
            d.invalid(node, path, message, or_list(TARGETS));
            None
        })
    }
}

pub(crate) fn parse_target(s: &str) -> Option<Target> {
    if !TARGETS.contains(&s) {
        return None;
    }
    Some(match s.split_once(':') {
        None if s == "ir" => Target::Ir,
        None => Target::Cpu(None),
        Some(("cpu", isa)) => Target::Cpu(Some(isa.to_string())),
        Some(("ptx", arch)) => Target::Ptx(arch.to_string()),
        Some((_, kind)) => Target::Mlir(kind.to_string()),
    })
}

fn node_is_quoted(node: &Node) -> bool {
    matches!(node.kind, NodeKind::Scalar { style: Style::Quoted, .. })
}

/// A scalar as written (without quotes), in backticks, for messages.
fn source_text(node: &Node) -> String {
    match &node.kind {
        NodeKind::Scalar { text, .. } => format!("`{text}`"),
        _ => describe(node),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MINI: &str = "\
name: mini
op: flash_attention_fwd
dtypes: [bf16]
head_dims: [64]
variants:
  v: {}
schedule:
  block_m: [64]
  block_n: [64]
  num_warps: [4]
  num_stages: [2]
";

    /// MINI with one line replaced (the first line starting with `prefix`).
    fn with_line(prefix: &str, replacement: &str) -> String {
        MINI.lines()
            .map(|l| if l.starts_with(prefix) { replacement } else { l })
            .fold(String::new(), |acc, l| acc + l + "\n")
    }

    fn with_variant(body: &str) -> String {
        with_line("  v: {}", &format!("  v: {body}"))
    }

    fn errors(text: &str) -> Vec<Diagnostic> {
        match load_str("t.yaml", text) {
            Ok(spec) => panic!("expected errors, loaded {spec:?}"),
            Err(e) => e.diagnostics,
        }
    }

    fn features(body: &str) -> Features {
        let spec = load_str("t.yaml", &with_variant(body)).unwrap_or_else(|e| panic!("{e}"));
        spec.variants[0].features.clone()
    }

    #[test]
    fn defaults_fill_the_optional_fields() {
        let spec = load_str("t.yaml", MINI).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(spec.version, 1);
        assert_eq!(spec.layout, Layout::Bshd);
        assert_eq!(spec.description, None);
        assert_eq!(spec.targets, vec![Target::Ir]);
        assert_eq!(spec.file, "t.yaml");
        assert_eq!(spec.variants[0].features, Features::default());
    }

    #[test]
    fn hash_is_sha256_of_the_bytes() {
        assert_eq!(sha256_hex(b"abc"), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
        let spec = load_str("t.yaml", MINI).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(spec.hash, sha256_hex(MINI.as_bytes()));
    }

    #[test]
    fn windows() {
        assert_eq!(features("{ sliding_window: runtime }").sliding_window, Some(Window::Runtime));
        assert_eq!(features("{ sliding_window: \"runtime\" }").sliding_window, Some(Window::Runtime));
        assert_eq!(features("{ sliding_window: 64 }").sliding_window, Some(Window::Fixed { left: 64, right: 64 }));
        // The causal flag applies wherever it is written.
        assert_eq!(
            features("{ sliding_window: 64, causal: true }").sliding_window,
            Some(Window::Fixed { left: 64, right: 0 })
        );
        assert_eq!(features("{ sliding_window: [0, 7] }").sliding_window, Some(Window::Fixed { left: 0, right: 7 }));
        let e = errors(&with_variant("{ sliding_window: [1.5, 99999999999999999999999] }"));
        assert_eq!(e.len(), 2, "{e:?}");
        assert_eq!(e[0].message, "expected an integer");
        assert_eq!(e[1].message, "the window size is too large");
        assert_eq!(e[1].found.as_deref(), Some("99999999999999999999999"));
        let e = errors(&with_variant("{ sliding_window: true }"));
        assert_eq!(e[0].message, "expected a window");
    }

    #[test]
    fn soft_caps() {
        assert_eq!(features("{ logits_soft_cap: runtime }").logits_soft_cap, Some(SoftCap::Runtime));
        assert_eq!(features("{ logits_soft_cap: 30 }").logits_soft_cap, Some(SoftCap::Fixed(30.0)));
        assert_eq!(features("{ logits_soft_cap: 2.5e1 }").logits_soft_cap, Some(SoftCap::Fixed(25.0)));
        for (text, message) in [
            ("0", "the soft cap must be positive"),
            (".inf", "the soft cap must be finite (leave the field out for no cap)"),
            (".nan", "the soft cap is not a number"),
            ("'50'", "expected a number; quotes make this a string (write 50 without them)"),
            ("[50]", "expected a soft cap"),
        ] {
            let e = errors(&with_variant(&format!("{{ logits_soft_cap: {text} }}")));
            assert_eq!(e.len(), 1, "{text}: {e:?}");
            assert_eq!(e[0].message, message, "{text}");
        }
    }

    #[test]
    fn varlen_conflicts_name_every_dense_feature() {
        let e = errors(&with_variant("{ varlen: true, mask: true, segment_ids: true }"));
        assert_eq!(e.len(), 1);
        assert_eq!(e[0].path, "variants.v.varlen");
        assert_eq!(
            e[0].message,
            "`varlen` cannot be combined with `mask` (line 6) and `segment_ids` (line 6): \
             dense `[B, H, Sq, Sk]` tensors have no meaning for a packed batch"
        );
        let e = errors(&with_variant("{ varlen: true, segment_ids: true }"));
        assert!(e[0].message.contains("dense `[B, S]` segment ids"), "{}", e[0].message);
        // Features off are no conflict.
        assert!(features("{ varlen: true, bias: false, causal: true }").varlen);
    }

    #[test]
    fn yaml_1_1_booleans_get_a_hint() {
        let e = errors(&with_variant("{ causal: no }"));
        assert!(e[0].message.contains("strings in YAML 1.2"), "{}", e[0].message);
        let e = errors(&with_variant("{ causal: True }"));
        assert_eq!(e[0].message, "expected a boolean; write it in lowercase");
        let e = errors(&with_variant("{ causal: \"true\" }"));
        assert_eq!(e[0].message, "expected a boolean");
        assert_eq!(e[0].found.as_deref(), Some("a string \"true\""));
    }

    #[test]
    fn found_is_described_in_yaml_terms() {
        let cases = [
            ("name: [a]", "a list of 1 item"),
            ("name: {a: 1}", "a mapping"),
            ("name: {}", "an empty mapping `{}`"),
            ("name: 7", "7"),
            ("name: true", "true"),
            ("name: ~", "nothing (null)"),
            ("name:", "nothing (null)"),
        ];
        for (line, found) in cases {
            let e = errors(&with_line("name:", line));
            assert_eq!(e.len(), 1, "{line}: {e:?}");
            assert_eq!(e[0].path, "name");
            assert_eq!(e[0].found.as_deref(), Some(found), "{line}");
            // An empty value is reported at its key, not at the next line's token.
            assert_eq!((e[0].line, e[0].column), (1, if line == "name:" { 1 } else { 7 }), "{line}");
        }
        let long = "X".repeat(100);
        let e = errors(&with_line("name:", &format!("name: {long}")));
        assert_eq!(e[0].found.as_deref(), Some(format!("a string \"{}...\"", "X".repeat(57)).as_str()));
    }

    #[test]
    fn dtypes_are_the_three_float_types_only() {
        let e = errors(&with_line("dtypes:", "dtypes: [i32, fp16, bf16, f64]"));
        let messages: Vec<&str> = e.iter().map(|d| d.message.as_str()).collect();
        assert_eq!(
            messages,
            [
                "dtype `i32` cannot be an attention input",
                "unknown dtype `fp16`; the spec calls it `f16`",
                "dtype `f64` cannot be an attention input",
            ]
        );
        assert_eq!(e[1].path, "dtypes[1]");
        assert_eq!(e[2].path, "dtypes[3]");
    }

    #[test]
    fn lists_must_be_non_empty_and_unique() {
        let e = errors(&with_line("head_dims:", "head_dims: []"));
        assert_eq!(e[0].message, "the list is empty");
        assert_eq!(e[0].found.as_deref(), Some("an empty list `[]`"));
        let e = errors(&with_line("head_dims:", "head_dims: [64, 272, 64, 0x40]"));
        let messages: Vec<&str> = e.iter().map(|d| d.message.as_str()).collect();
        assert_eq!(
            messages,
            [
                "head dimension is out of range",
                "duplicate head dimension `64` (first listed at line 4, column 13)",
                "expected an integer",
            ]
        );
        let e = errors(&with_line("variants:", "variants: {}\nx:"));
        assert_eq!(e[0].message, "at least one variant is required");
    }

    #[test]
    fn targets() {
        let text = MINI.to_string() + "targets: [ir, cpu:avx2, ptx:sm_90a, 'mlir:gpu']\n";
        let spec = load_str("t.yaml", &text).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(
            spec.targets,
            vec![
                Target::Ir,
                Target::Cpu(Some("avx2".into())),
                Target::Ptx("sm_90a".into()),
                Target::Mlir("gpu".into())
            ]
        );
        let text = MINI.to_string() + "targets: [cpu:neon, cuda, ir, ir]\n";
        let messages: Vec<String> = errors(&text).into_iter().map(|d| d.message).collect();
        assert_eq!(
            messages,
            [
                "unsupported CPU ISA `neon`",
                "unknown target `cuda`",
                "duplicate target `ir` (first listed at line 12, column 27)",
            ]
        );
    }

    #[test]
    fn names_and_keys() {
        let e = errors(&with_line("  v: {}", "  V2: {}\n  ? [x]\n  : {}"));
        assert_eq!(e.len(), 2, "{e:?}");
        assert_eq!(e[0].message, "`V2` is not a valid variant name");
        assert_eq!(e[0].path, "variants.V2");
        assert_eq!(e[1].message, "expected a string");
        assert_eq!(e[1].found.as_deref(), Some("a list of 1 item"));
        let e = errors(&with_line("schedule:", "schedule:\n  [a]: 1"));
        assert!(e.iter().any(|d| d.message == "a field name must be a string"), "{e:?}");
    }

    #[test]
    fn version_and_layout() {
        let spec =
            load_str("t.yaml", &(MINI.to_string() + "version: 3\nlayout: bshd\n")).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(spec.version, 3);
        let e = errors(&(MINI.to_string() + "version: 4294967296\nlayout: bhsd\n"));
        assert_eq!(e[0].message, "the version must be a non-negative 32-bit integer");
        assert_eq!(e[1].message, "unknown layout `bhsd`; did you mean `bshd`?");
    }

    #[test]
    fn byte_order_mark_and_crlf() {
        let text = format!("\u{feff}{}", MINI.replace('\n', "\r\n"));
        assert!(load_str("t.yaml", &text).is_ok());
        let text = with_line("head_dims:", "head_dims: [7]").replace('\n', "\r\n");
        let e = errors(&text);
        assert_eq!((e[0].line, e[0].column), (4, 13));
        assert_eq!(e[0].source_line.as_deref(), Some("head_dims: [7]"));
    }

    #[test]
    fn binary_garbage_is_an_error_not_a_panic() {
        let garbage: String =
            (0u32..512).map(|i| char::from_u32(i.wrapping_mul(2654435761) % 0x2ff).unwrap_or('?')).collect();
        let e = load_str("garbage.bin", &garbage).unwrap_err();
        assert!(!e.diagnostics.is_empty());
        let _ = e.to_string();
        for text in ["\0\0\0", "\u{1}\u{2}: \u{7f}", "\u{fffd}\u{fffd}", "[", "{", "-", ":", "&", "*", "!"] {
            let e = load_str("g", text).unwrap_err();
            let _ = e.to_string();
        }
    }

    #[test]
    fn not_utf8_points_at_the_bad_byte() {
        let d = not_utf8("f", b"a: 1\nb: \xff\xfe\n", 8);
        assert_eq!((d.line, d.column), (2, 4));
        assert_eq!(d.found.as_deref(), Some("the byte 0xff"));
        assert_eq!(d.source_line.as_deref(), Some("b: \u{fffd}\u{fffd}"));
    }

    #[test]
    fn short_random_documents_never_panic() {
        // Tiny inputs over YAML's punctuation reach parser states that mutations of a
        // well-formed file rarely do.
        const ALPHABET: &[&str] = &[
            "a", "1", "-1", ":", ": ", "- ", "[", "]", "{", "}", ",", "\n", "  ", "\t", "#", "'", "\"", "&x ", "*x",
            "!!str ", "? ", "|", ">", "---", "...", "~", "%", "\r", "\\",
        ];
        let mut state = 0x2545_f491_4f6c_dd1du64;
        let mut next = || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        for _ in 0..3000 {
            let len = (next() % 24) as usize;
            let text: String = (0..len).map(|_| ALPHABET[(next() % ALPHABET.len() as u64) as usize]).collect();
            if let Err(e) = load_str("r", &text) {
                assert!(!e.diagnostics.is_empty());
                let _ = e.to_string();
            }
        }
    }
}
