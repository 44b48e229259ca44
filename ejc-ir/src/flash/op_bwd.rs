//! The flash-attention backward as an [`Operation`]: `flash_attention_bwd`, built from
//! its own spec file (`specs/flash_bwd.yaml`, the forward's vocabulary: variants, dtypes,
//! head dims). A call gives the forward's inputs, its `out` and `lse`, and `dout`; it
//! returns `dq`, `dk`, `dv` (and `dsinks`; `dbias` for `bias_grad` variants). docs/semantics.md, "Flash-attention
//! backward", defines it; [`super::backward`] has the kernels.
//!
//! ```
//! let op = ejc_ir::ops::get("flash_attention_bwd").unwrap();
//! assert_eq!(op.plan_names(), ["two_pass", "atomic"]);
//! let f = ejc_ir::flash::Features { causal: true, sinks: true, ..Default::default() };
//! assert_eq!(op.outputs(&f.to_json()), ["dq", "dk", "dv", "dsinks"]);
//! ```
//!
//! Two plans ([`super::backward::Plan`]), both candidates of the tuner:
//!
//! - `two_pass` (deterministic): `preprocess` (`delta = rowsum(dout ∘ out)` into an f32
//!   temporary), `dkdv` (one program per key block), `dq` (one program per query block,
//!   the scores computed a second time), and for sinks variants `dsinks`. No atomics:
//!   every sum is taken in one order.
//! - `atomic`: `preprocess_dq` (delta, and the f32 temporary `dq_accum` zeroed),
//!   `dkdv_dq` (dK, dV, and dQ added into `dq_accum` by atomic adds), `dq_convert`, and
//!   `dsinks` reading the atomically summed `pdp`. Not reproducible bit for bit; a call
//!   that asks for `deterministic` gets `two_pass` only.

use std::collections::BTreeMap;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::backward::{build_bwd_kernel, bwd_params, Plan, Role};
use super::features::Features;
use super::frontend::HeadDims;
use super::op::{expect_shape, features, head_dim_v, inputs_of, kernel_attrs, runtime_of, FlashAttentionFwd, AXES};
use crate::ir::Kernel;
use crate::manifest::{Launch, Temporary};
use crate::op::{
    self, AxisDecl, CallView, Config, DimDecl, HostCall, KernelInstance, Keys, Operation, PlanDecl, RoleDecl,
    ScalarDecl, Sizes, Work,
};
use crate::spec::{Decoder, Fields, Spec};
use crate::tensor::HostTensor;
use crate::types::{DType, Type};

/// The operation (registered in [`crate::ops`]).
pub struct FlashAttentionBwd;

/// Rows per program of the dsinks kernel, and its warps.
const DSINKS_BLOCK_M: u32 = 64;
const DSINKS_WARPS: u32 = 4;

const FWD: FlashAttentionFwd = FlashAttentionFwd;

/// Above this many multiply-adds (`b · hq · sq · sk · d`) a timing call skips the f64
/// reference forward.
pub const REFERENCE_FOR_TIMING: u64 = 1 << 28;

impl FlashAttentionBwd {
    /// A random backward call: the forward's inputs, `dout`, and the forward's `out` and
    /// `lse` from the reference (`exact`, or while the reference is cheap) or stand-ins.
    fn call_of(
        &self,
        f: &op::Features,
        dtype: DType,
        dims: &Sizes,
        seed: u64,
        scalars: &op::Scalars,
        exact: bool,
    ) -> Result<HostCall, String> {
        let ff = features(f)?;
        let mut call = FWD.random_call_with(f, dtype, dims, seed, scalars)?;
        let inputs = inputs_of(&call)?;
        let round = |t: &HostTensor, d: DType| {
            HostTensor::from_vec(d, &t.shape, t.to_vec().into_iter().map(|x| d.round(x)).collect())
        };
        let mut rng = StdRng::seed_from_u64(seed ^ 0x5eed_d007_u64.rotate_left(17));
        let [b, sq, hq, d] = [0, 1, 2, 3].map(|i| inputs.q.shape[i] as u64);
        let sk = inputs.k.shape[1];
        let work = b.saturating_mul(hq).saturating_mul(sq).saturating_mul(sk as u64).saturating_mul(d);
        let (out, lse) = if exact || work <= REFERENCE_FOR_TIMING {
            // The forward's out and lse, from the reference (rounded as a kernel stores them).
            let rt = runtime_of(&call.scalars, inputs.q.shape[3]);
            let y = super::reference::reference(&ff, &rt, &inputs)?;
            (round(&y.out, dtype), round(&y.lse, DType::F32))
        } else {
            let dv = inputs.v.shape[3];
            let shape = [inputs.q.shape[0], inputs.q.shape[1], inputs.q.shape[2], dv];
            let n: usize = shape.iter().product();
            let out =
                HostTensor::from_vec(dtype, &shape, (0..n).map(|_| dtype.round(rng.random_range(-1.0..1.0))).collect());
            let lse_shape = [inputs.q.shape[0], inputs.q.shape[2], inputs.q.shape[1]];
            (out, HostTensor::full(DType::F32, &lse_shape, DType::F32.round((sk.max(1) as f64).ln())))
        };
        let n = out.numel();
        let dout =
            HostTensor::from_vec(dtype, &out.shape, (0..n).map(|_| dtype.round(rng.random_range(-1.0..1.0))).collect());
        let nan = |t: &HostTensor| HostTensor::full(t.dtype, &t.shape, f64::NAN);
        call.tensors.insert("out".into(), out);
        call.tensors.insert("lse".into(), lse);
        call.tensors.insert("dout".into(), dout);
        call.tensors.insert("dq".into(), nan(&inputs.q));
        call.tensors.insert("dk".into(), nan(&inputs.k));
        call.tensors.insert("dv".into(), nan(&inputs.v));
        if let Some(s) = &inputs.sinks {
            call.tensors.insert("dsinks".into(), HostTensor::full(DType::F32, &s.shape, f64::NAN));
        }
        if let (true, Some(bias)) = (ff.bias_grad, &inputs.bias) {
            call.tensors.insert("dbias".into(), HostTensor::full(dtype, &bias.shape, f64::NAN));
        }
        Ok(call)
    }
}

impl Operation for FlashAttentionBwd {
    fn name(&self) -> &'static str {
        "flash_attention_bwd"
    }

    fn summary(&self) -> &'static str {
        "flash-attention backward: dq, dk, dv (and dsinks, dbias) of every forward variant (dQ by atomics, or deterministic)"
    }

    fn dtypes(&self) -> &'static [DType] {
        FWD.dtypes()
    }

    fn dtype_refusal(&self) -> &'static str {
        FWD.dtype_refusal()
    }

    fn fields(&self) -> &'static [&'static str] {
        FWD.fields()
    }

    fn decode_fields(&self, d: &mut Decoder, f: &Fields, keys: &mut Vec<(String, Vec<u32>)>, sets: &mut Vec<Keys>) {
        FWD.decode_fields(d, f, keys, sets)
    }

    fn variant_fields(&self) -> &'static [&'static str] {
        super::features::BWD_VARIANT_FIELDS
    }

    fn variant_allowed(&self) -> &'static str {
        FWD.variant_allowed()
    }

    fn decode_variant(&self, d: &mut Decoder, f: &Fields) -> op::Features {
        FWD.decode_variant(d, f)
    }

    fn describe(&self, f: &op::Features) -> String {
        FWD.describe(f)
    }

    fn axes(&self) -> &'static [AxisDecl] {
        // The forward's, without split-KV's `num_splits`.
        &AXES[..4]
    }

    fn plan_names(&self) -> &'static [&'static str] {
        &["two_pass", "atomic"]
    }

    fn nondeterministic_plans(&self) -> &'static [&'static str] {
        &["atomic"]
    }

    fn plans(&self, _spec: &Spec, f: &op::Features) -> Vec<PlanDecl> {
        let Ok(ff) = features(f) else { return Vec::new() };
        let temp = |name: &str, shape: &[&str]| Temporary {
            name: name.into(),
            dtype: "f32".into(),
            shape: shape.iter().map(|s| s.to_string()).collect(),
            fill: "none".into(),
            given: false,
        };
        let stats = ["batch", "heads_q", "seq_q"];
        Plan::ALL
            .into_iter()
            .map(|plan| {
                let roles: Vec<RoleDecl> = plan
                    .roles(&ff)
                    .into_iter()
                    .map(|r| {
                        let (tile_axes, fixed) = match r {
                            Role::Preprocess | Role::PreprocessDq | Role::DqConvert => (vec!["block_m"], Config::new()),
                            Role::DkDv | Role::DkDvDq | Role::Dq => (vec!["block_m", "block_n"], Config::new()),
                            Role::Dsinks => (
                                vec![],
                                Config::from([
                                    ("block_m".to_string(), DSINKS_BLOCK_M),
                                    ("num_warps".to_string(), DSINKS_WARPS),
                                ]),
                            ),
                        };
                        RoleDecl { name: r.name(), tile_axes, fixed }
                    })
                    .collect();
                let mut temporaries = vec![temp("delta", &stats)];
                let mut launches: Vec<Launch> = roles.iter().map(|r| Launch::of(r.name)).collect();
                if plan == Plan::Atomic {
                    temporaries.push(temp("dq_accum", &["batch", "seq_q", "heads_q", "head_dim"]));
                    if ff.sinks {
                        temporaries.push(temp("pdp", &stats));
                        let last = launches.last_mut().expect("dsinks");
                        last.bind.insert("delta".into(), "pdp".into());
                    }
                }
                PlanDecl { name: plan.name(), roles, temporaries, launches, runtime_axes: vec![], shared_axes: vec![] }
            })
            .collect()
    }

    fn kernel_id(&self, spec_name: &str, k: &KernelInstance) -> String {
        let hd = k.keys.get("head_dim").copied().unwrap_or(0);
        let dv = k.keys.get("head_dim_v").map(|v| format!("v{v}")).unwrap_or_default();
        let base = format!("{spec_name}_{}_{}_d{hd}{dv}_{}", k.variant.name, k.dtype, k.role);
        let (m, n) = (k.tile.get("block_m").copied().unwrap_or(0), k.tile.get("block_n").copied().unwrap_or(0));
        match k.role {
            "preprocess" | "preprocess_dq" | "dq_convert" => format!("{base}_m{m}"),
            "dsinks" => base,
            _ => format!("{base}_m{m}_n{n}"),
        }
    }

    fn build(&self, spec: &Spec, k: &KernelInstance) -> Result<Kernel, String> {
        let f = features(&k.variant.features)?;
        let role = Role::from_name(k.role).ok_or_else(|| format!("flash_attention_bwd has no role `{}`", k.role))?;
        let hd = *k.keys.get("head_dim").ok_or("the instance has no head_dim")? as usize;
        let dv = head_dim_v(&k.keys).unwrap_or(hd as u32) as usize;
        let tile = |n: &str| k.tile.get(n).copied().map(|v| v as usize);
        let bm = tile("block_m").ok_or(format!("no `block_m` for {}", k.id))?;
        let bn = tile("block_n").unwrap_or(bm);
        let mut kernel = build_bwd_kernel(&k.id, role, &f, k.dtype, HeadDims { qk: hd, v: dv }, bm, bn)
            .map_err(|e| e.to_string())?;
        let mut attrs = kernel_attrs(spec, k, hd, dv);
        attrs.push(("role".into(), k.role.into()));
        kernel.attrs = attrs;
        Ok(kernel)
    }

    fn param_doc(&self, name: &str) -> &'static str {
        let all = Features::every();
        Role::ALL
            .into_iter()
            .flat_map(|r| bwd_params(r, &all, DType::F32))
            .find(|p| p.name == name)
            .map(|p| p.meaning)
            .unwrap_or("")
    }

    fn dims(&self) -> &'static [DimDecl] {
        FWD.dims()
    }

    fn call_dtype(&self, call: &dyn CallView) -> Result<DType, String> {
        FWD.call_dtype(call)
    }

    fn keys_of(&self, dims: &Sizes) -> Keys {
        FWD.keys_of(dims)
    }

    fn call_keys(&self, call: &dyn CallView) -> Result<Keys, String> {
        FWD.call_keys(call)
    }

    fn dims_of(&self, sizes: &Sizes) -> Sizes {
        FWD.dims_of(sizes)
    }

    fn scalars(&self, f: &op::Features) -> Vec<ScalarDecl> {
        FWD.scalars(f)
    }

    fn validate(&self, f: &op::Features, dtype: DType, keys: &Keys, call: &dyn CallView) -> Result<Sizes, String> {
        // The forward's inputs, its out and lse (now inputs), and the scalars: the
        // forward's checks; then what the backward adds.
        let mut sizes = FWD.validate(f, dtype, keys, call)?;
        let ff = features(f)?;
        for role in Role::ALL.into_iter().filter(|r| r.applies(&ff)) {
            for p in bwd_params(role, &ff, dtype) {
                if matches!(p.name, "delta" | "dq_accum" | "pdp") {
                    continue; // the plans' temporaries
                }
                if let Type::Tensor(d, rank) = p.ty {
                    let t = call.tensor(p.name).ok_or_else(|| {
                        format!(
                            "the kernel needs argument `{}` ({}), which the call does not provide",
                            p.name, p.meaning
                        )
                    })?;
                    if t.dtype != d || t.shape.len() != rank {
                        return Err(format!(
                            "argument `{}` is {} of rank {}, the kernel takes {d} of rank {rank}",
                            p.name,
                            t.dtype,
                            t.shape.len()
                        ));
                    }
                }
            }
        }
        let shape = |n: &str| call.tensor(n).map(|t| t.shape).ok_or_else(|| format!("argument `{n}` is missing"));
        let (q, k, v, out) = (shape("q")?, shape("k")?, shape("v")?, shape("out")?);
        expect_shape(call, "dout", &out)?;
        expect_shape(call, "dq", &q)?;
        expect_shape(call, "dk", &k)?;
        expect_shape(call, "dv", &v)?;
        if ff.bias_grad {
            let bias = shape("bias")?;
            expect_shape(call, "dbias", &bias)?;
        }
        if ff.sinks {
            let s = shape("sinks")?;
            expect_shape(call, "dsinks", &s)?;
            sizes.insert("n_sinks".into(), s[1] as i64);
        }
        Ok(sizes)
    }

    fn matches(&self, variant: &op::Features, wanted: &op::Features) -> bool {
        FWD.matches(variant, wanted)
    }

    fn wanted(&self, f: &op::Features, call: &dyn CallView) -> op::Features {
        FWD.wanted(f, call)
    }

    fn cache_desc(&self, wanted: &op::Features, dtype: DType, sizes: &Sizes) -> serde_json::Value {
        FWD.cache_desc(wanted, dtype, sizes)
    }

    fn random_call(&self, f: &op::Features, dtype: DType, dims: &Sizes, seed: u64) -> Result<HostCall, String> {
        self.random_call_with(f, dtype, dims, seed, &op::Scalars::new())
    }

    /// `out` and `lse` come from the forward with the given scalars (a window or soft cap
    /// other than the random one changes them).
    fn random_call_with(
        &self,
        f: &op::Features,
        dtype: DType,
        dims: &Sizes,
        seed: u64,
        scalars: &op::Scalars,
    ) -> Result<HostCall, String> {
        self.call_of(f, dtype, dims, seed, scalars, true)
    }

    /// For timing alone, above [`REFERENCE_FOR_TIMING`] products the forward's `out` and
    /// `lse` are stand-ins (random `out` in [-1, 1), `lse = ln sk`): the f64 reference of
    /// a 16k-token call takes the better part of an hour on one core, and a kernel's
    /// speed does not depend on the values.
    fn timing_call(
        &self,
        f: &op::Features,
        dtype: DType,
        dims: &Sizes,
        seed: u64,
        scalars: &op::Scalars,
    ) -> Result<HostCall, String> {
        self.call_of(f, dtype, dims, seed, scalars, false)
    }

    fn call_elements(&self, f: &op::Features, dims: &Sizes) -> Result<u64, String> {
        // Every tensor of the forward's call, and as many again (dout, dq, dk, dv, delta).
        let fwd = FWD.call_elements(f, dims)?;
        let fwd = fwd.checked_mul(2).ok_or_else(|| "the call's element count overflows 64 bits".to_string())?;
        if !features(f)?.bias_grad {
            return Ok(fwd);
        }
        // dbias: a [B, Hq, Sq, Sk] output.
        let s = super::op::shape_of(dims)?;
        let dbias = op::elements(&[s.batch, s.heads_q, s.seq_q, s.seq_k])?;
        fwd.checked_add(dbias).ok_or_else(|| "the call's element count overflows 64 bits".to_string())
    }

    fn reference(&self, f: &op::Features, call: &HostCall) -> Result<BTreeMap<String, HostTensor>, String> {
        let ff = features(f)?;
        let inputs = inputs_of(call)?;
        let rt = runtime_of(&call.scalars, inputs.q.shape[3]);
        let dout = call.tensors.get("dout").ok_or("the call has no `dout`")?;
        let g = super::reference::reference_bwd(&ff, &rt, &inputs, dout)?;
        let mut out = BTreeMap::from([("dq".to_string(), g.dq), ("dk".to_string(), g.dk), ("dv".to_string(), g.dv)]);
        if let Some(s) = g.dsinks {
            out.insert("dsinks".into(), s);
        }
        if let (true, Some(d)) = (ff.bias_grad, g.dbias) {
            out.insert("dbias".into(), d);
        }
        Ok(out)
    }

    fn outputs(&self, f: &op::Features) -> Vec<&'static str> {
        let f = features(f).unwrap_or_default();
        let mut v = vec!["dq", "dk", "dv"];
        if f.sinks {
            v.push("dsinks");
        }
        if f.bias_grad {
            v.push("dbias");
        }
        v
    }

    fn small_dims(&self, sizes: &Sizes) -> Sizes {
        FWD.small_dims(sizes)
    }

    fn check_dims(&self, keys: &Keys) -> Vec<Sizes> {
        FWD.check_dims(keys)
    }

    fn work(&self, f: &op::Features, dtype: DType, sizes: &Sizes) -> Work {
        // FlashAttention's convention: the backward is 2.5 forwards' FLOPs.
        let w = FWD.work(f, dtype, sizes);
        Work { flops: 2.5 * w.flops, bytes: 2.0 * w.bytes }
    }

    fn heuristic(&self, configs: &[Config]) -> Option<usize> {
        FWD.heuristic(configs)
    }
}

#[cfg(test)]
mod timing_tests {
    use super::*;

    fn dims(s: i64, h: i64, d: i64) -> Sizes {
        [("batch", 1), ("seq_q", s), ("seq_k", s), ("heads_q", h), ("heads_kv", 1), ("head_dim", d)]
            .into_iter()
            .map(|(k, v)| (k.to_string(), v))
            .collect()
    }

    #[test]
    fn timing_calls_skip_the_reference_only_where_it_is_slow() {
        let f = op::Features::new();
        let none = op::Scalars::new();
        // Small: the same call as the checked one (out and lse from the reference).
        let small = dims(37, 2, 16);
        let a = FlashAttentionBwd.random_call_with(&f, DType::F32, &small, 5, &none).unwrap();
        let b = FlashAttentionBwd.timing_call(&f, DType::F32, &small, 5, &none).unwrap();
        for n in ["q", "k", "v", "out", "lse", "dout"] {
            assert_eq!(a.tensors[n].to_vec(), b.tensors[n].to_vec(), "{n}");
        }
        // Large (a reference of minutes): stand-ins, at once; lse = ln sk on every row.
        let large = dims(4096, 4, 64);
        let t = std::time::Instant::now();
        let c = FlashAttentionBwd.timing_call(&f, DType::BF16, &large, 5, &none).unwrap();
        assert!(t.elapsed().as_secs() < 60, "{:?}", t.elapsed());
        let lse = c.tensors["lse"].to_vec();
        assert_eq!(c.tensors["lse"].shape, vec![1, 4, 4096]);
        assert!(lse.iter().all(|x| (*x - (4096f64).ln()).abs() < 1e-6), "{:?}", &lse[..4]);
        assert_eq!(c.tensors["out"].shape, vec![1, 4096, 4, 64]);
        assert!(c.tensors["out"].to_vec().iter().all(|x| x.abs() <= 1.0));
    }
}
