//! The flash family's features: what a variant computes, typed, and their spec /
//! manifest vocabulary (the JSON map the spine carries; [`Features::to_json`],
//! [`Features::from_json`]).
//!
//! ```
//! use ejc_ir::flash::{Features, Window};
//! let f = Features { causal: true, sliding_window: Some(Window::Fixed { left: 128, right: 0 }), ..Default::default() };
//! let json = f.to_json();
//! assert_eq!(json["sliding_window"], serde_json::json!([128, 0]));
//! assert_eq!(Features::from_json(&json).unwrap(), f);
//! ```

use serde_json::json;

use crate::op;
use crate::spec::decode::{node_is_quoted, plain_value, value, Value};
use crate::spec::yaml::{Node, NodeKind};
use crate::spec::{suggest, Decoder, Fields};

/// Attention features of one variant. Every combination is accepted except
/// `varlen` with `bias`, `mask` or `segment_ids` (the spec loader rejects those).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Features {
    /// Bottom-right aligned causal mask: query i sees key j iff j <= i + (s_k - s_q).
    pub causal: bool,
    /// Sliding window `(left, right)`, inclusive, after the causal shift.
    pub sliding_window: Option<Window>,
    /// Logit soft cap `c`: s <- c * tanh(s / c), after scale and bias, before masking.
    pub logits_soft_cap: Option<SoftCap>,
    /// Per-head attention sinks (extra logits in the softmax denominator, once).
    pub sinks: bool,
    /// Additive bias `[B|1, H|1, s_q, s_k]`.
    pub bias: bool,
    /// Boolean mask `[B|1, H|1, s_q, s_k]`, true = attend.
    pub mask: bool,
    /// Query / key segment ids `[B, s]`: equal ids attend, -1 = padding.
    pub segment_ids: bool,
    /// Packed variable-length batch through `cu_seqlens_q/k`.
    pub varlen: bool,
    /// Dropout on the attention probabilities (Philox 4x32-10).
    pub dropout: bool,
    /// Backward only (`flash_attention_bwd`): also return `dbias [B, Hq, Sq, Sk]`, the
    /// gradient of the bias (needs `bias`; docs/semantics.md). Never in a forward spec.
    pub bias_grad: bool,
}

/// A sliding window whose sizes are either kernel parameters or baked in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Window {
    /// `window_left` / `window_right` are run-time kernel parameters.
    Runtime,
    /// Compile-time window sizes (both >= 0).
    Fixed { left: u32, right: u32 },
}

/// A logit soft cap that is either a kernel parameter or baked in.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum SoftCap {
    /// `logits_soft_cap` is a run-time kernel parameter.
    Runtime,
    /// A compile-time cap (> 0, finite).
    Fixed(f64),
}

const FLAGS: [&str; 7] = ["causal", "sinks", "bias", "mask", "segment_ids", "varlen", "dropout"];

impl Features {
    /// Every feature at once (run-time window and soft cap; not causal, which takes no
    /// parameter): the variant whose kernels take every parameter, for documenting them.
    pub fn every() -> Features {
        Features {
            causal: false,
            sliding_window: Some(Window::Runtime),
            logits_soft_cap: Some(SoftCap::Runtime),
            sinks: true,
            bias: true,
            mask: true,
            segment_ids: true,
            varlen: true,
            dropout: true,
            bias_grad: true,
        }
    }

    fn flags(&self) -> [bool; 7] {
        [self.causal, self.sinks, self.bias, self.mask, self.segment_ids, self.varlen, self.dropout]
    }

    /// The spec's vocabulary: every flag, `sliding_window` (`null`, `"runtime"` or
    /// `[left, right]`) and `logits_soft_cap` (`null`, `"runtime"` or the cap).
    pub fn to_json(&self) -> op::Features {
        let mut m = op::Features::new();
        for (k, v) in FLAGS.iter().zip(self.flags()) {
            m.insert(k.to_string(), json!(v));
        }
        m.insert(
            "sliding_window".into(),
            match self.sliding_window {
                None => json!(null),
                Some(Window::Runtime) => json!("runtime"),
                Some(Window::Fixed { left, right }) => json!([left, right]),
            },
        );
        m.insert(
            "logits_soft_cap".into(),
            match self.logits_soft_cap {
                None => json!(null),
                Some(SoftCap::Runtime) => json!("runtime"),
                Some(SoftCap::Fixed(c)) => json!(c),
            },
        );
        // Only where set: the backward's, so the forward's manifests do not carry it.
        if self.bias_grad {
            m.insert("bias_grad".into(), json!(true));
        }
        m
    }

    /// Back from [`Features::to_json`]'s form (a missing flag is false).
    pub fn from_json(m: &op::Features) -> Result<Features, String> {
        for k in m.keys() {
            if !FLAGS.contains(&k.as_str()) && !matches!(k.as_str(), "sliding_window" | "logits_soft_cap" | "bias_grad")
            {
                return Err(format!("unknown flash feature `{k}`"));
            }
        }
        let flag = |k: &str| m.get(k).and_then(|v| v.as_bool()).unwrap_or(false);
        let sliding_window = match m.get("sliding_window") {
            None | Some(serde_json::Value::Null) => None,
            Some(serde_json::Value::String(s)) if s == "runtime" => Some(Window::Runtime),
            Some(serde_json::Value::Array(a)) if a.len() == 2 => {
                let n = |i: usize| a[i].as_u64().and_then(|x| u32::try_from(x).ok()).ok_or("bad sliding_window");
                Some(Window::Fixed { left: n(0)?, right: n(1)? })
            }
            Some(other) => return Err(format!("bad sliding_window: {other}")),
        };
        let logits_soft_cap = match m.get("logits_soft_cap") {
            None | Some(serde_json::Value::Null) => None,
            Some(serde_json::Value::String(s)) if s == "runtime" => Some(SoftCap::Runtime),
            Some(v) => Some(SoftCap::Fixed(v.as_f64().ok_or(format!("bad logits_soft_cap: {v}"))?)),
        };
        Ok(Features {
            causal: flag("causal"),
            sliding_window,
            logits_soft_cap,
            sinks: flag("sinks"),
            bias: flag("bias"),
            mask: flag("mask"),
            segment_ids: flag("segment_ids"),
            varlen: flag("varlen"),
            dropout: flag("dropout"),
            bias_grad: flag("bias_grad"),
        })
    }

    /// `causal + sliding_window=runtime + sinks`, or `full attention`.
    pub fn describe(&self) -> String {
        let mut parts = Vec::new();
        if self.causal {
            parts.push("causal".to_string());
        }
        match self.sliding_window {
            Some(Window::Runtime) => parts.push("sliding_window=runtime".into()),
            Some(Window::Fixed { left, right }) => parts.push(format!("sliding_window=({left}, {right})")),
            None => {}
        }
        match self.logits_soft_cap {
            Some(SoftCap::Runtime) => parts.push("logits_soft_cap=runtime".into()),
            Some(SoftCap::Fixed(c)) => parts.push(format!("logits_soft_cap={c}")),
            None => {}
        }
        for (name, on) in FLAGS.iter().zip(self.flags()).skip(1) {
            if on {
                parts.push(name.to_string());
            }
        }
        if self.bias_grad {
            parts.push("bias_grad".into());
        }
        if parts.is_empty() {
            "full attention".into()
        } else {
            parts.join(" + ")
        }
    }
}

/// The features a call asks for, with its values: a concrete window and soft cap.
/// `window` / `softcap` are None when the call has none.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct CallFeatures {
    pub causal: bool,
    pub window: Option<(i64, i64)>,
    pub softcap: Option<f64>,
    pub sinks: bool,
    pub bias: bool,
    pub mask: bool,
    pub segment_ids: bool,
    pub varlen: bool,
    pub dropout: bool,
    /// The call asks for `dbias` (backward).
    pub bias_grad: bool,
}

impl CallFeatures {
    /// As the spine carries it: the spec's vocabulary with the call's values.
    pub fn to_json(&self) -> op::Features {
        let f = Features {
            causal: self.causal,
            sliding_window: None,
            logits_soft_cap: None,
            sinks: self.sinks,
            bias: self.bias,
            mask: self.mask,
            segment_ids: self.segment_ids,
            varlen: self.varlen,
            dropout: self.dropout,
            bias_grad: self.bias_grad,
        };
        let mut m = f.to_json();
        m.insert("sliding_window".into(), self.window.map_or(json!(null), |(l, r)| json!([l, r])));
        m.insert("logits_soft_cap".into(), self.softcap.map_or(json!(null), |c| json!(c)));
        m
    }

    pub fn from_json(m: &op::Features) -> Result<CallFeatures, String> {
        let flag = |k: &str| m.get(k).and_then(|v| v.as_bool()).unwrap_or(false);
        let window = match m.get("sliding_window") {
            None | Some(serde_json::Value::Null) => None,
            Some(serde_json::Value::Array(a)) if a.len() == 2 => match (a[0].as_i64(), a[1].as_i64()) {
                (Some(l), Some(r)) => Some((l, r)),
                _ => return Err("the call's sliding_window must be [left, right]".into()),
            },
            Some(other) => return Err(format!("the call's sliding_window must be [left, right], not {other}")),
        };
        let softcap = match m.get("logits_soft_cap") {
            None | Some(serde_json::Value::Null) => None,
            Some(v) => Some(v.as_f64().ok_or(format!("the call's logits_soft_cap must be a number, not {v}"))?),
        };
        Ok(CallFeatures {
            causal: flag("causal"),
            window,
            softcap,
            sinks: flag("sinks"),
            bias: flag("bias"),
            mask: flag("mask"),
            segment_ids: flag("segment_ids"),
            varlen: flag("varlen"),
            dropout: flag("dropout"),
            bias_grad: flag("bias_grad"),
        })
    }

    /// The features of a variant's call with its run-time window and soft cap values.
    pub fn of_variant(f: &Features, window: (i64, i64), softcap: f64) -> CallFeatures {
        CallFeatures {
            causal: f.causal,
            window: f.sliding_window.map(|w| match w {
                Window::Fixed { left, right } => (i64::from(left), i64::from(right)),
                Window::Runtime => window,
            }),
            softcap: f.logits_soft_cap.map(|c| match c {
                SoftCap::Fixed(x) => x,
                SoftCap::Runtime => softcap,
            }),
            sinks: f.sinks,
            bias: f.bias,
            mask: f.mask,
            segment_ids: f.segment_ids,
            varlen: f.varlen,
            dropout: f.dropout,
            bias_grad: f.bias_grad,
        }
    }
}

/// Whether a variant computes exactly what a call asks for (a variant with a
/// compile-time window or cap serves only calls with that value).
pub fn features_match(v: &Features, call: &CallFeatures) -> bool {
    let window_ok = match (v.sliding_window, call.window) {
        (None, None) => true,
        (Some(Window::Runtime), Some(_)) => true,
        (Some(Window::Fixed { left, right }), Some((l, r))) => left as i64 == l && right as i64 == r,
        _ => false,
    };
    let softcap_ok = match (v.logits_soft_cap, call.softcap) {
        (None, None) => true,
        (Some(SoftCap::Runtime), Some(_)) => true,
        (Some(SoftCap::Fixed(c)), Some(x)) => (c as f32) == (x as f32),
        _ => false,
    };
    window_ok
        && softcap_ok
        && v.causal == call.causal
        && v.sinks == call.sinks
        && v.bias == call.bias
        && v.mask == call.mask
        && v.segment_ids == call.segment_ids
        && v.varlen == call.varlen
        && v.dropout == call.dropout
        && v.bias_grad == call.bias_grad
}

// ---- the spec: a variant's fields ---------------------------------------------------

/// The variant fields of a flash backward spec: the forward's, and `bias_grad` last.
pub const BWD_VARIANT_FIELDS: &[&str] = &[
    "causal",
    "sliding_window",
    "logits_soft_cap",
    "sinks",
    "bias",
    "mask",
    "segment_ids",
    "varlen",
    "dropout",
    "bias_grad",
];

/// The variant fields of a flash spec: the backward's without `bias_grad`.
pub const VARIANT_FIELDS: &[&str] = match BWD_VARIANT_FIELDS.split_last() {
    Some((_, forward)) => forward,
    None => &[],
};

/// Features whose dense per-row tensors a packed (`varlen`) batch cannot have.
const DENSE_FEATURES: &[&str] = &["bias", "mask", "segment_ids"];

/// Decode one variant's fields (already checked against [`VARIANT_FIELDS`]).
pub fn decode_variant(d: &mut Decoder, f: &Fields) -> Features {
    let mut features = Features::default();
    let flag = |d: &mut Decoder, name: &str| match f.value(name) {
        Some(v) => d.bool(v, &f.path(name)).unwrap_or(false),
        None => false,
    };
    features.causal = flag(d, "causal");
    features.sinks = flag(d, "sinks");
    features.bias = flag(d, "bias");
    features.mask = flag(d, "mask");
    features.segment_ids = flag(d, "segment_ids");
    features.varlen = flag(d, "varlen");
    features.dropout = flag(d, "dropout");
    features.bias_grad = flag(d, "bias_grad");
    if features.bias_grad && !features.bias {
        if let Some(v) = f.value("bias_grad") {
            let diag = d.error(
                v,
                &f.path("bias_grad"),
                "`bias_grad` asks for the gradient of a bias the variant does not have",
            );
            diag.found = Some("bias_grad: true without bias: true".into());
            diag.allowed = Some("`bias: true` beside `bias_grad: true`".into());
        }
    }
    if let Some(v) = f.value("sliding_window") {
        features.sliding_window = window(d, v, &f.path("sliding_window"), features.causal);
    }
    if let Some(v) = f.value("logits_soft_cap") {
        features.logits_soft_cap = soft_cap(d, v, &f.path("logits_soft_cap"));
    }
    if features.varlen {
        check_varlen(d, f, &features);
    }
    features
}

/// `varlen` packs sequences back to back; bias, mask and segment ids are shaped for
/// a padded batch, so a kernel taking both could not say what they mean.
fn check_varlen(d: &mut Decoder, f: &Fields<'_>, features: &Features) {
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
    let diag = d.error(varlen, &f.path("varlen"), message);
    diag.found = Some(format!(
        "varlen: true with {}",
        conflicts.iter().map(|(n, _)| format!("{n}: true")).collect::<Vec<_>>().join(", ")
    ));
    diag.allowed = Some("varlen with causal, sliding_window, logits_soft_cap, sinks or dropout".into());
}

fn window(d: &mut Decoder, node: &Node, path: &str, causal: bool) -> Option<Window> {
    let allowed = "`runtime`, a size `w` (`[w, 0]` if causal, else `[w, w]`), \
                   or `[left, right]` with sizes >= 0";
    let size_allowed = "a non-negative integer";
    let size_check = |v: i64| match v {
        v if v < 0 => Some("a window size cannot be negative"),
        v if i32::try_from(v).is_err() => {
            Some("the window size is too large: kernels take 32-bit signed sizes (at most 2147483647)")
        }
        _ => None,
    };
    match (&node.kind, value(node)) {
        (_, Value::Str("runtime")) => Some(Window::Runtime),
        (_, Value::Int(_)) => {
            let w = d.int(node, path, size_allowed, size_check)?;
            let w = u32::try_from(w).ok()?;
            Some(Window::Fixed { left: w, right: if causal { 0 } else { w } })
        }
        (NodeKind::Seq(items), _) if items.len() == 2 => {
            let left = d.int(&items[0], &format!("{path}[0]"), size_allowed, size_check);
            let right = d.int(&items[1], &format!("{path}[1]"), size_allowed, size_check);
            let (left, right) = (u32::try_from(left?).ok()?, u32::try_from(right?).ok()?);
            Some(Window::Fixed { left, right })
        }
        (NodeKind::Seq(_), _) => {
            d.invalid(node, path, "a window is `[left, right]`: exactly two sizes", allowed);
            None
        }
        (_, Value::Str(s)) => {
            let mut message = format!("unknown window `{s}`");
            if suggest(s, &["runtime"]).is_some() {
                message.push_str("; did you mean `runtime`?");
            }
            d.invalid(node, path, message, allowed);
            None
        }
        _ => {
            d.invalid(node, path, "expected a window", allowed);
            None
        }
    }
}

fn soft_cap(d: &mut Decoder, node: &Node, path: &str) -> Option<SoftCap> {
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
            d.invalid(node, path, message, allowed);
            return None;
        }
        _ => {
            d.invalid(node, path, "expected a soft cap", allowed);
            return None;
        }
    };
    let problem = if cap.is_nan() {
        Some("the soft cap is not a number")
    } else if cap <= 0.0 {
        Some("the soft cap must be positive")
    } else if cap.is_infinite() {
        Some("the soft cap must be finite (leave the field out for no cap)")
    } else if crate::limits::check_scalar(crate::types::DType::F32, cap).is_err() {
        // Kernels compute in f32: 1e39 would be infinite there and 1e-46 zero.
        Some("the soft cap is outside f32's normal range (about 1.2e-38 to 3.4e38), which kernels compute in")
    } else {
        None
    };
    match problem {
        Some(message) => {
            d.invalid(node, path, message, allowed);
            None
        }
        None => Some(SoftCap::Fixed(cap)),
    }
}
