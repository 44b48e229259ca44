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
//! assert_eq!(causal.features["sliding_window"], serde_json::json!([128, 0]));
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
use super::{ScheduleOverride, ScheduleSpace, Spec, Target, Variant};
use crate::limits::MAX_DIAGNOSTICS;
use crate::op::{AxisDecl, Features, Operation};
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
    let cannot = |e: String| SpecError::single(Diagnostic::new(&file, 0, 0, "", format!("cannot read the spec: {e}")));
    let cap = crate::limits::spec_bytes().map_err(cannot)?;
    let bytes = crate::limits::read_capped(path, cap, "spec", "EJC_MAX_SPEC_BYTES").map_err(cannot)?;
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
    d.set_source(&String::from_utf8_lossy(&bytes[line_start..line_end]));
    d
}

fn decode(file: &str, text: &str, hash: String) -> Result<Spec, SpecError> {
    // A byte-order mark is not part of the first key; editors on some systems add one.
    let text = text.strip_prefix('\u{feff}').unwrap_or(text);
    let src = Source::new(file, text);
    let mut d = Decoder { src: &src, diags: Vec::new(), omitted: 0, spare: None };
    let spec = yaml::parse(&src, text, &mut d.diags).map(|root| d.spec(&root, file, hash));
    let mut diags = d.diags;
    match spec {
        Some(spec) if diags.is_empty() => Ok(spec),
        _ => {
            // Source order; the sort is stable, so problems at one position keep the
            // order they were found in.
            diags.sort_by_key(|d| (d.line, d.column));
            let omitted = d.omitted + diags.len().saturating_sub(MAX_DIAGNOSTICS);
            diags.truncate(MAX_DIAGNOSTICS);
            Err(SpecError { diagnostics: diags, omitted })
        }
    }
}

// ---- the format --------------------------------------------------------------------

/// The fields every spec has; an operation adds its own ([`Operation::fields`]).
const TOP_FIELDS: &[&str] =
    &["name", "op", "version", "description", "dtypes", "variants", "schedule", "overrides", "plans", "targets"];
pub(crate) const TARGETS: &[&str] = &[
    "ir",
    "cpu",
    "cpu:amx",
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
pub const IDENTIFIER: &str = "an identifier (a lowercase letter, then lowercase letters, digits or `_`)";

/// Spellings from other frameworks, answered with the spec's name for the dtype.
pub const DTYPE_ALIASES: &[(&str, &str)] = &[
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
pub enum Value<'n> {
    Null,
    Bool(bool),
    /// Saturated to the i64 range: every integer field has a much smaller bound, so a
    /// huge number is still reported as out of range, showing the text as written.
    Int(i64),
    Float(f64),
    Str(&'n str),
    Collection,
}

pub fn value(node: &Node) -> Value<'_> {
    match &node.kind {
        NodeKind::Null => Value::Null,
        NodeKind::Map(_) | NodeKind::Seq(_) => Value::Collection,
        NodeKind::Scalar { text, style: Style::Quoted } => Value::Str(text),
        NodeKind::Scalar { text, style: Style::Plain } => plain_value(text),
    }
}

pub fn plain_value(text: &str) -> Value<'_> {
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
pub fn describe(node: &Node) -> String {
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
pub fn quote(text: &str) -> String {
    const MAX: usize = 60;
    if text.chars().count() > MAX {
        let head: String = text.chars().take(MAX - 3).collect();
        format!("{:?}", head + "...")
    } else {
        format!("{text:?}")
    }
}

pub fn is_identifier(s: &str) -> bool {
    let mut chars = s.chars();
    chars.next().is_some_and(|c| c.is_ascii_lowercase())
        && chars.all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')
}

/// `a, b and c`.
pub fn and_list(items: &[&str]) -> String {
    match items {
        [] => String::new(),
        [one] => (*one).to_string(),
        [init @ .., last] => format!("{} and {last}", init.join(", ")),
    }
}

pub fn or_list(items: &[&str]) -> String {
    match items {
        [] => String::new(),
        [one] => (*one).to_string(),
        [init @ .., last] => format!("{} or {last}", init.join(", ")),
    }
}

// ---- the decoder -------------------------------------------------------------------

pub struct Decoder<'s> {
    src: &'s Source<'s>,
    diags: Vec<Diagnostic>,
    /// Problems found beyond the ones kept.
    omitted: usize,
    /// Where a problem beyond the cap is written (and dropped).
    spare: Option<Diagnostic>,
}

/// The entries of a mapping whose keys have been checked against the known fields.
pub struct Fields<'n> {
    pub node: &'n Node,
    pub path: String,
    entries: Vec<(&'n str, &'n Node, &'n Node)>,
}

impl<'n> Fields<'n> {
    /// `(key, value)` of a field, if present.
    pub fn get(&self, name: &str) -> Option<(&'n Node, &'n Node)> {
        self.entries.iter().find(|(k, _, _)| *k == name).map(|&(_, k, v)| (k, v))
    }

    pub fn value(&self, name: &str) -> Option<&'n Node> {
        self.get(name).map(|(_, v)| v)
    }

    pub fn path(&self, name: &str) -> String {
        if self.path == ROOT {
            name.to_string()
        } else {
            format!("{}.{name}", self.path)
        }
    }
}

impl Decoder<'_> {
    pub fn error(&mut self, node: &Node, path: &str, message: impl Into<String>) -> &mut Diagnostic {
        let d = self.src.diag(node.line, node.col, path, message);
        // Beyond the cap a problem is counted, not kept: thousands of repeated errors
        // must not hold thousands of copies of a long line.
        if self.diags.len() >= 2 * MAX_DIAGNOSTICS {
            self.omitted += 1;
            return self.spare.insert(d);
        }
        self.diags.push(d);
        let last = self.diags.len() - 1;
        &mut self.diags[last]
    }

    /// Report a value of the wrong kind or outside its domain.
    pub fn invalid(&mut self, node: &Node, path: &str, message: impl Into<String>, allowed: impl Into<String>) {
        let found = describe(node);
        let d = self.error(node, path, message);
        d.found = Some(found);
        d.allowed = Some(allowed.into());
    }

    // -- shapes --

    /// A mapping's entries, reporting non-string keys and keys not in `known`
    /// (described as a `what`, e.g. "variant field").
    pub fn fields<'n>(
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
    pub fn required<'n>(&mut self, fields: &Fields<'n>, name: &str, allowed: &str) -> Option<&'n Node> {
        let value = fields.value(name);
        if value.is_none() {
            let d = self.error(fields.node, &fields.path, format!("missing required field `{name}`"));
            d.allowed = Some(format!("`{name}`: {allowed}"));
        }
        value
    }

    /// The items of a non-empty list. A lone scalar gets a hint on how to make it a list.
    pub fn list<'n>(&mut self, node: &'n Node, path: &str, allowed: &str) -> Option<&'n [Node]> {
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
    pub fn unique_list<T: PartialEq>(
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
                // A scalar is quoted; a mapping is found equal to the first by value.
                let what = match node.kind {
                    NodeKind::Scalar { .. } => format!(" {}", source_text(node)),
                    _ => String::new(),
                };
                let message =
                    format!("duplicate {noun}{what} (first listed at line {}, column {})", first.line, first.col);
                self.error(node, &path, message).allowed = Some("each value once".into());
                continue;
            }
            out.push((v, node));
        }
        out.into_iter().map(|(v, _)| v).collect()
    }

    // -- scalars --

    pub fn string<'n>(&mut self, node: &'n Node, path: &str, allowed: &str) -> Option<&'n str> {
        match value(node) {
            Value::Str(s) => Some(s),
            _ => {
                self.invalid(node, path, "expected a string", allowed);
                None
            }
        }
    }

    pub fn bool(&mut self, node: &Node, path: &str) -> Option<bool> {
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
    pub fn int(
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
    pub fn choice<'c>(&mut self, node: &Node, path: &str, noun: &str, choices: &[&'c str]) -> Option<&'c str> {
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
            dtypes: Vec::new(),
            keys: Vec::new(),
            key_sets: Vec::new(),
            variants: Vec::new(),
            schedule: ScheduleSpace::default(),
            plans: Vec::new(),
            targets: vec![Target::Ir],
        };
        let top_allowed = "a mapping of the spec's fields (name, op, dtypes, variants, schedule, ...)";
        // The operation decides which other fields exist, so it is read first. Without
        // a known operation every operation's fields are accepted (no field is reported
        // unknown for the wrong reason), and nothing that depends on it is decoded.
        let op = match &root.kind {
            NodeKind::Map(entries) => entries
                .iter()
                .find(|(k, _)| matches!(&k.kind, NodeKind::Scalar { text, .. } if text == "op"))
                .and_then(|(_, v)| match value(v) {
                    Value::Str(s) => crate::ops::get(s),
                    _ => None,
                }),
            _ => None,
        };
        let mut known: Vec<&str> = TOP_FIELDS.to_vec();
        match op {
            Some(op) => known.extend(op.fields()),
            None => {
                for o in crate::ops::all() {
                    known.extend(o.fields().iter().filter(|f| !known.contains(f)).collect::<Vec<_>>());
                }
            }
        }
        let Some(f) = self.fields(root, ROOT, &known, "top-level field", top_allowed) else {
            return spec;
        };

        if let Some(v) = self.required(&f, "name", IDENTIFIER) {
            spec.name = self.identifier(v, "name", "name").unwrap_or_default();
        }
        let op_names: Vec<&str> = crate::ops::all().iter().map(|o| o.name()).collect();
        if let Some(v) = self.required(&f, "op", &or_list(&op_names)) {
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
        if let Some(v) = f.value("targets") {
            spec.targets = self.targets(v);
        }
        let Some(op) = op else {
            return spec;
        };
        let dtype_names: Vec<String> = op.dtypes().iter().map(|d| d.to_string()).collect();
        let dtype_names: Vec<&str> = dtype_names.iter().map(String::as_str).collect();
        let dtypes_allowed = format!("a non-empty list of {}", dtype_names.join(", "));
        if let Some(v) = self.required(&f, "dtypes", &dtypes_allowed) {
            spec.dtypes = self.dtypes(v, op, &dtype_names, &dtypes_allowed);
        }
        op.decode_fields(self, &f, &mut spec.keys, &mut spec.key_sets);
        if let Some(v) = self.required(&f, "variants", "a mapping from variant names to their features") {
            spec.variants = self.variants(v, op);
        }
        let axes = op.axes();
        let required: Vec<&str> = axes.iter().filter(|a| a.required).map(|a| a.name).collect();
        let schedule_allowed = format!("a mapping with {}", and_list(&required));
        if let Some(v) = self.required(&f, "schedule", &schedule_allowed) {
            spec.schedule = self.schedule(v, "schedule", axes, &required);
        }
        if let Some(v) = f.value("overrides") {
            spec.schedule.overrides = self.overrides(v, axes, &spec);
        }
        if let Some(v) = f.value("plans") {
            let names = op.plan_names();
            let allowed = format!("a non-empty list of {}", or_list(names));
            spec.plans = self.unique_list(v, "plans", "plan", &allowed, |d, node, path| {
                d.choice(node, path, "plan", names).map(str::to_string)
            });
        }
        spec
    }

    pub fn identifier(&mut self, node: &Node, path: &str, noun: &str) -> Option<String> {
        let s = self.string(node, path, IDENTIFIER)?;
        if is_identifier(s) {
            Some(s.to_string())
        } else {
            self.invalid(node, path, format!("`{s}` is not a valid {noun}"), IDENTIFIER);
            None
        }
    }

    fn op(&mut self, node: &Node) -> Option<String> {
        let names: Vec<&str> = crate::ops::all().iter().map(|o| o.name()).collect();
        let s = self.string(node, "op", &or_list(&names))?;
        if names.contains(&s) {
            return Some(s.to_string());
        }
        // No typo suggestion: op names one letter apart (`flash_attention_fwd`,
        // `flash_attention_bwd`) are different operations, not misspellings of each other.
        self.invalid(node, "op", format!("unknown op `{s}`"), or_list(&names));
        None
    }

    fn dtypes(&mut self, node: &Node, op: &dyn Operation, names: &[&str], list_allowed: &str) -> Vec<DType> {
        self.unique_list(node, "dtypes", "dtype", list_allowed, |d, node, path| d.dtype(node, path, op, names))
    }

    fn dtype(&mut self, node: &Node, path: &str, op: &dyn Operation, names: &[&str]) -> Option<DType> {
        let allowed = or_list(names);
        let s = self.string(node, path, &allowed)?;
        let parsed = s.parse::<DType>().ok();
        let message = match parsed {
            Some(t) if names.contains(&s) => return Some(t),
            // The IR's other element types are real dtypes, just not ones this
            // operation takes its inputs in: a "did you mean" would only mislead.
            Some(_) => format!("dtype `{s}` {}", op.dtype_refusal()),
            None => {
                let alias = DTYPE_ALIASES.iter().find(|(a, _)| a.eq_ignore_ascii_case(s));
                match (alias, suggest(s, names)) {
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

    fn variants(&mut self, node: &Node, op: &dyn Operation) -> Vec<Variant> {
        let allowed = "a mapping from variant names to their features, e.g. `causal: { causal: true }`";
        let NodeKind::Map(entries) = &node.kind else {
            self.invalid(node, "variants", "expected a mapping", allowed);
            return Vec::new();
        };
        if entries.is_empty() {
            self.invalid(node, "variants", "at least one variant is required", allowed);
            return Vec::new();
        }
        let mut known = vec!["description"];
        known.extend(op.variant_fields());
        let field_allowed = op.variant_allowed();
        let mut out = Vec::new();
        for (key, value) in entries {
            let path = join("variants", key);
            let name = self.identifier(key, &path, "variant name").unwrap_or_default();
            let Some(f) = self.fields(value, &path, &known, "variant field", field_allowed) else {
                continue;
            };
            let description = f.value("description").and_then(|v| {
                let path = f.path("description");
                self.string(v, &path, "a string").map(str::to_string)
            });
            let features: Features = op.decode_variant(self, &f);
            out.push(Variant { name, description, features });
        }
        out
    }

    /// A schedule mapping: the spec's `schedule` (`required` lists the axes it must
    /// have) or an override's (`required` empty: any subset of the axes).
    fn schedule(&mut self, node: &Node, path: &str, axes: &[AxisDecl], required: &[&str]) -> ScheduleSpace {
        let mut space = ScheduleSpace::default();
        let names: Vec<&str> = axes.iter().map(|a| a.name).collect();
        let allowed = if required.is_empty() {
            format!("a mapping with some of {}, each a list", and_list(&names))
        } else {
            format!("a mapping with {}, each a list", and_list(required))
        };
        let Some(f) = self.fields(node, path, &names, "schedule field", &allowed) else {
            return space;
        };
        for a in axes {
            let v =
                if required.contains(&a.name) { self.required(&f, a.name, a.list_allowed) } else { f.value(a.name) };
            if let Some(v) = v {
                let values = self.u32_list(v, &f.path(a.name), a.noun, a.list_allowed, a.allowed, a.check);
                space.axes.push((a.name.to_string(), values));
            }
        }
        space
    }

    /// The spec's `overrides:`: a list of `{when: {...}, schedule: {...}}`.
    fn overrides(&mut self, node: &Node, axes: &[AxisDecl], spec: &Spec) -> Vec<ScheduleOverride> {
        let allowed = "a non-empty list of `{when: {target/dtype/key: value or list}, schedule: {axis: [values]}}`";
        let Some(items) = self.list(node, "overrides", allowed) else {
            return Vec::new();
        };
        let mut out = Vec::new();
        for (i, item) in items.iter().enumerate() {
            let path = format!("overrides[{i}]");
            let Some(f) = self.fields(item, &path, &["when", "schedule"], "override field", allowed) else {
                continue;
            };
            let mut o = ScheduleOverride::default();
            if let Some(w) = self.required(&f, "when", "a mapping of conditions (target, dtype, a compile-time key)") {
                self.when(w, &f.path("when"), spec, &mut o);
            }
            if let Some(v) = self.required(&f, "schedule", "a mapping of schedule axes, each a list") {
                let sched = self.schedule(v, &f.path("schedule"), axes, &[]);
                o.axes = sched.axes;
                if o.axes.is_empty() {
                    let names: Vec<&str> = axes.iter().map(|a| a.name).collect();
                    self.invalid(v, &f.path("schedule"), "an override must set an axis", and_list(&names));
                }
            }
            out.push(o);
        }
        out
    }

    /// An override's `when`: `target`, `dtype` and the operation's compile-time keys,
    /// each one value or a list; at least one condition.
    fn when(&mut self, node: &Node, path: &str, spec: &Spec, o: &mut ScheduleOverride) {
        let mut known = vec!["target", "dtype"];
        known.extend(spec.keys.iter().map(|(k, _)| k.as_str()));
        let allowed = format!("a mapping with some of {}", and_list(&known));
        let Some(f) = self.fields(node, path, &known, "condition", &allowed) else {
            return;
        };
        if f.entries.is_empty() {
            self.invalid(
                node,
                path,
                "an override needs a condition (an empty `when` would replace the schedule)",
                allowed,
            );
        }
        if let Some(v) = f.value("target") {
            let p = f.path("target");
            o.targets = self.one_or_list(v, &p, "target", |d, node, path| {
                let s = d.string(node, path, &or_list(TARGETS))?;
                let t = parse_target(s);
                if t.is_none() {
                    d.invalid(node, path, format!("unknown target `{s}`"), or_list(TARGETS));
                }
                t
            });
        }
        if let Some(v) = f.value("dtype") {
            let names: Vec<String> = spec.dtypes.iter().map(|d| d.to_string()).collect();
            let names: Vec<&str> = names.iter().map(String::as_str).collect();
            let p = f.path("dtype");
            o.dtypes = self.one_or_list(v, &p, "dtype", |d, node, path| {
                let s = d.string(node, path, &format!("one of the spec's dtypes: {}", or_list(&names)))?;
                match spec.dtypes.iter().find(|t| t.to_string() == s) {
                    Some(t) => Some(*t),
                    None => {
                        d.invalid(node, path, format!("the spec does not build dtype `{s}`"), or_list(&names));
                        None
                    }
                }
            });
        }
        for (key, have) in &spec.keys {
            let Some(v) = f.value(key) else { continue };
            let listed = have.iter().map(|v| v.to_string()).collect::<Vec<_>>().join(", ");
            let allowed = format!("one of the spec's values: {listed}");
            let p = f.path(key);
            let vs = self.one_or_list(v, &p, key, |d, node, path| {
                let x = d.int(node, path, &allowed, |_| None)?;
                match u32::try_from(x).ok().filter(|x| have.contains(x)) {
                    Some(x) => Some(x),
                    None => {
                        d.invalid(node, path, format!("the spec does not build {key} {x}"), allowed.as_str());
                        None
                    }
                }
            });
            o.keys.push((key.clone(), vs));
        }
    }

    /// One value or a non-empty list of them, each decoded by `item`.
    fn one_or_list<T: PartialEq>(
        &mut self,
        node: &Node,
        path: &str,
        noun: &str,
        mut item: impl FnMut(&mut Self, &Node, &str) -> Option<T>,
    ) -> Vec<T> {
        match &node.kind {
            NodeKind::Seq(_) => self.unique_list(node, path, noun, &format!("a {noun} or a list of them"), item),
            _ => item(self, node, path).into_iter().collect(),
        }
    }

    pub fn u32_list(
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

pub fn node_is_quoted(node: &Node) -> bool {
    matches!(node.kind, NodeKind::Scalar { style: Style::Quoted, .. })
}

/// A scalar as written (without quotes), in backticks, for messages.
pub fn source_text(node: &Node) -> String {
    match &node.kind {
        NodeKind::Scalar { text, .. } => format!("`{text}`"),
        _ => describe(node),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::flash::{SoftCap, Window};
    use crate::op::Keys;

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

    fn features(body: &str) -> crate::flash::Features {
        let spec = load_str("t.yaml", &with_variant(body)).unwrap_or_else(|e| panic!("{e}"));
        crate::flash::Features::from_json(&spec.variants[0].features).unwrap()
    }

    #[test]
    fn defaults_fill_the_optional_fields() {
        let spec = load_str("t.yaml", MINI).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(spec.version, 1);
        assert_eq!(spec.description, None);
        assert_eq!(spec.targets, vec![Target::Ir]);
        assert_eq!(spec.file, "t.yaml");
        assert_eq!(spec.keys, vec![("head_dim".to_string(), vec![64])]);
        assert!(spec.plans.is_empty());
        assert_eq!(features("{}"), crate::flash::Features::default());
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
        assert_eq!(e[1].message, "the window size is too large: kernels take 32-bit signed sizes (at most 2147483647)");
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
    fn head_dims_may_give_v_its_own() {
        let text = with_line("head_dims:", "head_dims: [64, {qk: 192, v: 128}, 192]")
            + "overrides:\n  - when: {head_dim_v: 128}\n    schedule: {block_m: [32]}\n";
        let spec = load_str("t.yaml", &text).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(spec.keys, [("head_dim".to_string(), vec![64, 192]), ("head_dim_v".to_string(), vec![128])]);
        let sets = [(64, 64), (192, 128), (192, 192)].map(|(d, v)| crate::flash::key_set(d, v));
        assert_eq!(spec.key_points(), sets);
        assert_eq!(spec.key_terms(true), ["3 head_dim/head_dim_v pairs"]);
        assert_eq!(spec.schedule.resolve(None, DType::BF16, &sets[1]).values("block_m"), [32]);
        assert_eq!(spec.schedule.resolve(None, DType::BF16, &sets[2]).values("block_m"), [64]);
        // Equal head dims are the plain entry: listed both ways, a duplicate.
        let e = errors(&with_line(
            "head_dims:",
            "head_dims: [64, {qk: 64, v: 64}, {qk: 48, w: 1}, {v: 32}, {qk: 8, v: 32}]",
        ));
        let messages: Vec<&str> = e.iter().map(|d| d.message.as_str()).collect();
        assert_eq!(
            messages,
            [
                "duplicate head dimension (first listed at line 4, column 13)",
                "missing required field `v`",
                "unknown head dimension field `w`; did you mean `v`?",
                "missing required field `qk`",
                "head dimension is not a multiple of 16",
            ]
        );
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
    fn overrides_refine_the_schedule_per_target_dtype_and_key() {
        let text = with_line("head_dims:", "head_dims: [64, 128, 256]")
            + "overrides:\n  - when: {head_dim: [128, 256]}\n    schedule: {block_m: [128], num_warps: [8]}\n  \
               - when: {target: \"ptx:sm_90a\", head_dim: 256, dtype: bf16}\n    schedule: {block_n: [32, 64]}\n  \
               - when: {target: cpu}\n    schedule: {num_warps: [1]}\n";
        let spec = load_str("t.yaml", &text).unwrap_or_else(|e| panic!("{e}"));
        let s = &spec.schedule;
        assert_eq!(s.overrides.len(), 3);
        let keys = |d: u32| Keys::from([("head_dim".to_string(), d)]);
        let (sm90, cpu) = (Target::Ptx("sm_90a".into()), Target::Cpu(Some("avx2".into())));
        let r = s.resolve(Some(&sm90), DType::BF16, &keys(64));
        assert_eq!((r.values("block_m"), r.values("block_n"), r.values("num_warps")), (&[64][..], &[64][..], &[4][..]));
        let r = s.resolve(Some(&sm90), DType::BF16, &keys(128));
        assert_eq!(
            (r.values("block_m"), r.values("block_n"), r.values("num_warps")),
            (&[128][..], &[64][..], &[8][..])
        );
        // Every matching override applies, in file order.
        let r = s.resolve(Some(&sm90), DType::BF16, &keys(256));
        assert_eq!((r.values("block_m"), r.values("block_n")), (&[128][..], &[32, 64][..]));
        // Another dtype or target, or none: not the second override.
        assert_eq!(s.resolve(Some(&sm90), DType::F16, &keys(256)).values("block_n"), &[64]);
        assert_eq!(s.resolve(None, DType::BF16, &keys(256)).values("block_n"), &[64]);
        // `cpu` stands for every CPU ISA; later overrides win.
        assert_eq!(s.resolve(Some(&cpu), DType::BF16, &keys(128)).values("num_warps"), &[1]);
        assert!(r.overrides.is_empty());
        assert_eq!(s.all_values("block_n"), vec![64, 32]);
        assert_eq!(s.all_values("num_warps"), vec![4, 8, 1]);
    }

    #[test]
    fn overrides_are_checked_like_the_schedule() {
        let with = |o: &str| MINI.to_string() + "overrides:\n" + o;
        let messages = |o: &str| -> Vec<String> { errors(&with(o)).into_iter().map(|d| d.message).collect() };
        assert_eq!(
            messages(
                "  - when: {head_dim: 128, dtype: f16, target: ptx:sm_99, seq: 4}\n    schedule: {block_m: [48]}\n"
            ),
            [
                "the spec does not build head_dim 128",
                "the spec does not build dtype `f16`",
                "unknown target `ptx:sm_99`",
                "unknown condition `seq`",
                "block size is not a power of two",
            ]
        );
        assert_eq!(
            messages("  - when: {}\n    schedule: {}\n"),
            [
                "an override needs a condition (an empty `when` would replace the schedule)",
                "an override must set an axis"
            ]
        );
        assert_eq!(messages("  - schedule: {block_m: [64]}\n"), ["missing required field `when`"]);
        assert_eq!(
            messages("  - when: {head_dim: 64}\n    schedule: {block_k: [64]}\n"),
            ["an override must set an axis", "unknown schedule field `block_k`; did you mean `block_m`?"]
        );
        assert_eq!(messages("  when: {head_dim: 64}\n"), ["expected a list"]);
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
