//! The mask algebra of block-sparse attention: the seed's mask builders (`FullMask`,
//! `CausalMask(offset)`, `LocalMask(window)`, `ChunkedCausalMask(chunk)`, `LogicalAnd`,
//! `LogicalOr`) and the sparse-transformer paper's strided pattern, as one expression
//! with a single meaning on the host ([`MaskExpr::visible`], the reference's) and in a
//! kernel ([`MaskExpr::emit`], element-wise tile IR).
//!
//! Positions are the query row `q` and key `kv` of one sequence, from 0, aligned at the
//! top left as in the seed (flash's causal mask is aligned at the bottom right; see
//! docs/semantics.md, "Block-sparse attention").
//!
//! ```
//! use ejc_ir::ops::blocksparse::mask::MaskExpr;
//! let m = MaskExpr::Or(vec![MaskExpr::Local { left: 2, right: 0 }, MaskExpr::Strided { stride: 4 }]);
//! let m = MaskExpr::And(vec![MaskExpr::Causal { offset: 0 }, m]);
//! assert!(m.visible(9, 8) && m.visible(9, 7) && !m.visible(9, 6) && m.visible(9, 5) && !m.visible(9, 10));
//! assert_eq!(MaskExpr::from_json(&m.to_json()).unwrap(), m);
//! assert_eq!(m.describe(), "causal & (local(2, 0) | strided(4))");
//! ```

use serde_json::json;

use crate::builder::KernelBuilder;
use crate::ir::{BinOp, CmpPred, Value};
use crate::spec::decode::{value, Value as YValue};
use crate::spec::yaml::{Node, NodeKind};
use crate::spec::Decoder;

/// One mask: which keys `kv` a query row `q` may see.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum MaskExpr {
    /// Every key.
    Full,
    /// `kv <= q + offset`.
    Causal { offset: i64 },
    /// `q - left <= kv <= q + right` (inclusive on both sides).
    Local { left: i64, right: i64 },
    /// `q / chunk == kv / chunk` and `kv <= q`: causal within chunks of `chunk` positions.
    ChunkedCausal { chunk: i64 },
    /// `(q - kv) mod stride == 0`: every `stride`-th key from the row's own position.
    Strided { stride: i64 },
    /// Every operand holds.
    And(Vec<MaskExpr>),
    /// Some operand holds.
    Or(Vec<MaskExpr>),
}

/// Largest offset, window side, chunk or stride a spec may give: positions are i32 in
/// kernels, and `q ± side` must stay inside it.
pub const MAX_SIZE: i64 = 1 << 30;

impl MaskExpr {
    /// Whether row `q` sees key `kv` (the reference's definition).
    pub fn visible(&self, q: i64, kv: i64) -> bool {
        match self {
            MaskExpr::Full => true,
            MaskExpr::Causal { offset } => kv <= q + offset,
            MaskExpr::Local { left, right } => q - left <= kv && kv <= q + right,
            MaskExpr::ChunkedCausal { chunk } => q / chunk == kv / chunk && kv <= q,
            MaskExpr::Strided { stride } => (q - kv).rem_euclid(*stride) == 0,
            MaskExpr::And(ms) => ms.iter().all(|m| m.visible(q, kv)),
            MaskExpr::Or(ms) => ms.iter().any(|m| m.visible(q, kv)),
        }
    }

    /// The visibility of a block of positions as an i1 tile (`q_idx` `[bm, 1]`, `kv_idx`
    /// `[1, bn]`, both i32 and non-negative), or `None` when every position is visible.
    pub fn emit(&self, b: &mut KernelBuilder, q_idx: Value, kv_idx: Value) -> Option<Value> {
        match self {
            MaskExpr::Full => None,
            MaskExpr::Causal { offset } => {
                let hi = add_const(b, q_idx, *offset);
                Some(b.cmp(CmpPred::Le, kv_idx, hi))
            }
            MaskExpr::Local { left, right } => {
                let lo = add_const(b, q_idx, -left);
                let hi = add_const(b, q_idx, *right);
                let ge = b.cmp(CmpPred::Ge, kv_idx, lo);
                let le = b.cmp(CmpPred::Le, kv_idx, hi);
                Some(b.and(ge, le))
            }
            MaskExpr::ChunkedCausal { chunk } => {
                let c = b.const_i32(*chunk);
                let qc = b.div(q_idx, c);
                let kc = b.div(kv_idx, c);
                let same = b.cmp(CmpPred::Eq, qc, kc);
                let causal = b.cmp(CmpPred::Le, kv_idx, q_idx);
                Some(b.and(same, causal))
            }
            MaskExpr::Strided { stride } => {
                // (q − kv) rem s == 0 whatever the sign (truncating rem is 0 exactly when
                // the euclidean one is).
                let s = b.const_i32(*stride);
                let d = b.sub(q_idx, kv_idx);
                let r = b.binary(BinOp::Rem, d, s);
                let zero = b.const_i32(0);
                Some(b.cmp(CmpPred::Eq, r, zero))
            }
            MaskExpr::And(ms) => {
                let mut out: Option<Value> = None;
                for m in ms {
                    if let Some(v) = m.emit(b, q_idx, kv_idx) {
                        out = Some(match out {
                            Some(o) => b.and(o, v),
                            None => v,
                        });
                    }
                }
                out
            }
            MaskExpr::Or(ms) => {
                let mut parts = Vec::new();
                for m in ms {
                    // One operand that sees everything makes the whole disjunction do so.
                    parts.push(m.emit(b, q_idx, kv_idx)?);
                }
                let mut out = parts.first().copied()?;
                for v in &parts[1..] {
                    out = b.binary(BinOp::Or, out, *v);
                }
                Some(out)
            }
        }
    }

    /// Keys `[lo, hi)` outside which no row of `[first, last]` sees any key (a bound, not
    /// necessarily tight: `None` on a side means unbounded there), on the host.
    pub fn key_range(&self, first: i64, last: i64) -> (Option<i64>, Option<i64>) {
        match self {
            MaskExpr::Full | MaskExpr::Strided { .. } => (None, None),
            MaskExpr::Causal { offset } => (None, Some(last + offset + 1)),
            MaskExpr::Local { left, right } => (Some(first - left), Some(last + right + 1)),
            MaskExpr::ChunkedCausal { chunk } => (Some(first.div_euclid(*chunk) * chunk), Some(last + 1)),
            MaskExpr::And(ms) => ms
                .iter()
                .map(|m| m.key_range(first, last))
                .fold((None, None), |(a, b), (c, d)| (max_opt(a, c), min_opt(b, d))),
            MaskExpr::Or(ms) => {
                let rs: Vec<_> = ms.iter().map(|m| m.key_range(first, last)).collect();
                let lo = rs.iter().map(|r| r.0).try_fold(i64::MAX, |acc, x| x.map(|x| acc.min(x)));
                let hi = rs.iter().map(|r| r.1).try_fold(i64::MIN, |acc, x| x.map(|x| acc.max(x)));
                (lo, hi)
            }
        }
    }

    /// [`MaskExpr::key_range`] in tile IR, for rows `[first, last]` (i32 scalars):
    /// `(lo, hi)`, `None` where unbounded.
    pub fn emit_key_range(&self, b: &mut KernelBuilder, first: Value, last: Value) -> (Option<Value>, Option<Value>) {
        match self {
            MaskExpr::Full | MaskExpr::Strided { .. } => (None, None),
            MaskExpr::Causal { offset } => (None, Some(add_const(b, last, offset + 1))),
            MaskExpr::Local { left, right } => (Some(add_const(b, first, -left)), Some(add_const(b, last, right + 1))),
            MaskExpr::ChunkedCausal { chunk } => {
                // Rows are non-negative: truncating division is the floor.
                let c = b.const_i32(*chunk);
                let q = b.div(first, c);
                (Some(b.mul(q, c)), Some(add_const(b, last, 1)))
            }
            MaskExpr::And(ms) => {
                let (mut lo, mut hi) = (None, None);
                for m in ms {
                    let (l, h) = m.emit_key_range(b, first, last);
                    lo = match (lo, l) {
                        (Some(a), Some(c)) => Some(b.max(a, c)),
                        (a, c) => a.or(c),
                    };
                    hi = match (hi, h) {
                        (Some(a), Some(c)) => Some(b.min(a, c)),
                        (a, c) => a.or(c),
                    };
                }
                (lo, hi)
            }
            MaskExpr::Or(ms) => {
                let (mut lo, mut hi) = (Some(None), Some(None));
                for m in ms {
                    let (l, h) = m.emit_key_range(b, first, last);
                    lo = match (lo, l) {
                        (Some(None), Some(x)) => Some(Some(x)),
                        (Some(Some(a)), Some(x)) => Some(Some(b.min(a, x))),
                        _ => None,
                    };
                    hi = match (hi, h) {
                        (Some(None), Some(x)) => Some(Some(x)),
                        (Some(Some(a)), Some(x)) => Some(Some(b.max(a, x))),
                        _ => None,
                    };
                }
                (lo.flatten(), hi.flatten())
            }
        }
    }

    /// The spec's and the manifest's form: `"full"`, `"causal"`, `{"causal": k}`,
    /// `{"local": [l, r]}`, `{"chunked_causal": c}`, `{"strided": s}`, `{"and": [..]}`,
    /// `{"or": [..]}`.
    pub fn to_json(&self) -> serde_json::Value {
        match self {
            MaskExpr::Full => json!("full"),
            MaskExpr::Causal { offset: 0 } => json!("causal"),
            MaskExpr::Causal { offset } => json!({ "causal": offset }),
            MaskExpr::Local { left, right } => json!({ "local": [left, right] }),
            MaskExpr::ChunkedCausal { chunk } => json!({ "chunked_causal": chunk }),
            MaskExpr::Strided { stride } => json!({ "strided": stride }),
            MaskExpr::And(ms) => json!({ "and": ms.iter().map(MaskExpr::to_json).collect::<Vec<_>>() }),
            MaskExpr::Or(ms) => json!({ "or": ms.iter().map(MaskExpr::to_json).collect::<Vec<_>>() }),
        }
    }

    /// Back from [`MaskExpr::to_json`]'s form.
    pub fn from_json(v: &serde_json::Value) -> Result<MaskExpr, String> {
        let int = |x: &serde_json::Value, what: &str, min: i64| -> Result<i64, String> {
            match x.as_i64() {
                Some(n) if (min..=MAX_SIZE).contains(&n) || (min < 0 && (-MAX_SIZE..=MAX_SIZE).contains(&n)) => Ok(n),
                _ => Err(format!("bad {what} in a mask: {x}")),
            }
        };
        match v {
            serde_json::Value::String(s) if s == "full" => Ok(MaskExpr::Full),
            serde_json::Value::String(s) if s == "causal" => Ok(MaskExpr::Causal { offset: 0 }),
            serde_json::Value::Object(m) if m.len() == 1 => {
                let (k, x) = m.iter().next().expect("one entry");
                match k.as_str() {
                    "causal" => Ok(MaskExpr::Causal { offset: int(x, "causal offset", -1)? }),
                    "local" => match x.as_array().map(Vec::as_slice) {
                        Some([l, r]) => Ok(MaskExpr::Local { left: int(l, "window", 0)?, right: int(r, "window", 0)? }),
                        _ => Err(format!("a local mask is [left, right], not {x}")),
                    },
                    "chunked_causal" => Ok(MaskExpr::ChunkedCausal { chunk: int(x, "chunk", 1)? }),
                    "strided" => Ok(MaskExpr::Strided { stride: int(x, "stride", 1)? }),
                    "and" | "or" => {
                        let items =
                            x.as_array().filter(|a| !a.is_empty()).ok_or(format!("`{k}` takes a list of masks"))?;
                        let ms = items.iter().map(MaskExpr::from_json).collect::<Result<Vec<_>, _>>()?;
                        Ok(if k == "and" { MaskExpr::And(ms) } else { MaskExpr::Or(ms) })
                    }
                    other => Err(format!("unknown mask `{other}`")),
                }
            }
            other => Err(format!("not a mask: {other}")),
        }
    }

    /// `causal & (local(128, 0) | strided(64))`.
    pub fn describe(&self) -> String {
        let group = |ms: &[MaskExpr], sep: &str| {
            ms.iter()
                .map(|m| match m {
                    MaskExpr::And(_) | MaskExpr::Or(_) => format!("({})", m.describe()),
                    _ => m.describe(),
                })
                .collect::<Vec<_>>()
                .join(sep)
        };
        match self {
            MaskExpr::Full => "full".into(),
            MaskExpr::Causal { offset: 0 } => "causal".into(),
            MaskExpr::Causal { offset } => format!("causal({offset})"),
            MaskExpr::Local { left, right } => format!("local({left}, {right})"),
            MaskExpr::ChunkedCausal { chunk } => format!("chunked_causal({chunk})"),
            MaskExpr::Strided { stride } => format!("strided({stride})"),
            MaskExpr::And(ms) => group(ms, " & "),
            MaskExpr::Or(ms) => group(ms, " | "),
        }
    }
}

fn max_opt(a: Option<i64>, b: Option<i64>) -> Option<i64> {
    match (a, b) {
        (Some(x), Some(y)) => Some(x.max(y)),
        (x, y) => x.or(y),
    }
}

fn min_opt(a: Option<i64>, b: Option<i64>) -> Option<i64> {
    match (a, b) {
        (Some(x), Some(y)) => Some(x.min(y)),
        (x, y) => x.or(y),
    }
}

fn add_const(b: &mut KernelBuilder, x: Value, c: i64) -> Value {
    if c == 0 {
        return x;
    }
    let c = b.const_i32(c);
    b.add(x, c)
}

/// What the spec's `mask` field accepts, for diagnostics.
pub const ALLOWED: &str = "`full`, `causal`, or a one-entry mapping: `causal: offset`, `local: [left, right]`, \
                           `chunked_causal: size`, `strided: stride`, `and: [masks]`, `or: [masks]`";

const WORDS: &[&str] = &["full", "causal"];
const KEYS: &[&str] = &["causal", "local", "chunked_causal", "strided", "and", "or"];

/// Decode a spec's mask expression (diagnostics located at the offending node).
pub fn decode(d: &mut Decoder, node: &Node, path: &str) -> Option<MaskExpr> {
    let size = |d: &mut Decoder, n: &Node, p: &str, min: i64, what: &'static str| {
        d.int(n, p, &format!("an integer from {min} to {MAX_SIZE}"), move |v| {
            (!(min..=MAX_SIZE).contains(&v)).then_some(what)
        })
    };
    match &node.kind {
        NodeKind::Scalar { .. } => match value(node) {
            YValue::Str("full") => Some(MaskExpr::Full),
            YValue::Str("causal") => Some(MaskExpr::Causal { offset: 0 }),
            _ => {
                d.choice(node, path, "mask", WORDS);
                None
            }
        },
        NodeKind::Map(entries) if entries.len() == 1 => {
            let (k, v) = &entries[0];
            let key = match value(k) {
                YValue::Str(s) => s.to_string(),
                _ => String::new(),
            };
            let p = format!("{path}.{key}");
            match key.as_str() {
                "causal" => d
                    .int(v, &p, "an integer offset", |x| {
                        (!(-MAX_SIZE..=MAX_SIZE).contains(&x)).then_some("the offset is too large")
                    })
                    .map(|offset| MaskExpr::Causal { offset }),
                "local" => match &v.kind {
                    NodeKind::Seq(items) if items.len() == 2 => {
                        let l = size(d, &items[0], &format!("{p}[0]"), 0, "a window side is from 0 to 2^30");
                        let r = size(d, &items[1], &format!("{p}[1]"), 0, "a window side is from 0 to 2^30");
                        Some(MaskExpr::Local { left: l?, right: r? })
                    }
                    _ => {
                        d.invalid(v, &p, "a local mask is `[left, right]`", "two sizes >= 0");
                        None
                    }
                },
                "chunked_causal" => {
                    size(d, v, &p, 1, "a chunk is from 1 to 2^30").map(|chunk| MaskExpr::ChunkedCausal { chunk })
                }
                "strided" => size(d, v, &p, 1, "a stride is from 1 to 2^30").map(|stride| MaskExpr::Strided { stride }),
                "and" | "or" => {
                    let items = d.list(v, &p, "a non-empty list of masks")?;
                    if items.is_empty() {
                        d.invalid(v, &p, format!("`{key}` needs at least one mask"), "a non-empty list of masks");
                        return None;
                    }
                    let ms: Vec<Option<MaskExpr>> =
                        items.iter().enumerate().map(|(i, n)| decode(d, n, &format!("{p}[{i}]"))).collect();
                    let ms: Option<Vec<MaskExpr>> = ms.into_iter().collect();
                    ms.map(|ms| if key == "and" { MaskExpr::And(ms) } else { MaskExpr::Or(ms) })
                }
                _ => {
                    let mut message = format!("unknown mask `{key}`");
                    if let Some(close) = crate::spec::suggest(&key, KEYS) {
                        message.push_str(&format!("; did you mean `{close}`?"));
                    }
                    d.invalid(k, path, message, ALLOWED);
                    None
                }
            }
        }
        _ => {
            d.invalid(node, path, "expected a mask", ALLOWED);
            None
        }
    }
}
