//! Block-sparse attention's backward as an [`Operation`]: `blocksparse_attention_bwd`,
//! built from its own spec file (`specs/blocksparse_bwd.yaml`, the forward's vocabulary).
//! A call gives the forward's inputs, its `out` and `lse`, and `dout`; it returns `dq`,
//! `dk`, `dv` (and `dsinks`). docs/semantics.md ("Block-sparse attention", its backward)
//! defines it; [`super::backward`] has the kernels.
//!
//! ```
//! let op = ejc_ir::ops::get("blocksparse_attention_bwd").unwrap();
//! assert_eq!(op.plan_names(), ["layout"]);
//! use ejc_ir::ops::blocksparse::reference::BsFeatures;
//! let f = BsFeatures { sinks: true, ..Default::default() };
//! assert_eq!(op.outputs(&f.to_json()), ["dq", "dk", "dv", "dsinks"]);
//! ```

use std::collections::BTreeMap;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::backward::{build_bwd, bwd_param_docs, BwdRole};
use super::kernels::{param_docs, LAYOUT_TENSORS};
use super::op::{expect_shape, features, inputs_of, scale_and_cap, BlockSparse, AXES};
use super::reference::{reference, reference_bwd};
use crate::flash::op::head_dim_v;
use crate::ir::Kernel;
use crate::manifest::{Launch, Temporary};
use crate::op::{
    self, AxisDecl, CallView, Config, DimDecl, HostCall, KernelInstance, Keys, Operation, PlanDecl, RoleDecl,
    ScalarDecl, Sizes, Work,
};
use crate::spec::{Decoder, Fields, Spec};
use crate::tensor::HostTensor;
use crate::types::DType;

/// The operation (registered in [`crate::ops`]).
pub struct BlockSparseBwd;

const FWD: BlockSparse = BlockSparse;

/// Above this many multiply-adds (`b · h · sq · sk · d`) a timing call skips the f64
/// reference forward (as the flash backward's).
pub const REFERENCE_FOR_TIMING: u64 = 1 << 28;

impl BlockSparseBwd {
    /// A random backward call: the forward's inputs (with `scalars` in place of the random
    /// ones it names), `dout`, and the forward's `out` and `lse` from the reference with
    /// those scalars (`exact`, or while it is cheap), else stand-ins.
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
        let mut call = FWD.random_call(f, dtype, dims, seed)?;
        set_scalars(&mut call, scalars);
        let x = inputs_of(&call)?;
        let mut rng = StdRng::seed_from_u64(seed ^ 0xb10c_5ba5_u64.rotate_left(23));
        let [b, h, sq, d] = [0, 1, 2, 3].map(|i| x.query.shape[i]);
        let sk = x.key.shape[2];
        let work = [h, sq, sk, d].iter().fold(b as u64, |a, &n| a.saturating_mul(n as u64));
        let (scale, cap) = scale_and_cap(&ff, &call)?;
        let round = |t: &HostTensor, d: DType| {
            HostTensor::from_vec(d, &t.shape, t.to_vec().into_iter().map(|x| d.round(x)).collect())
        };
        let (out, lse) = if exact || work <= REFERENCE_FOR_TIMING {
            let (out, lse) = reference(&ff, &x, scale, cap)?;
            (round(&out, dtype), round(&lse, DType::F32))
        } else {
            let dv = x.value.shape[3];
            let n = b * h * sq * dv;
            let out = HostTensor::from_vec(
                dtype,
                &[b, h, sq, dv],
                (0..n).map(|_| dtype.round(rng.random_range(-1.0..1.0))).collect(),
            );
            (out, HostTensor::full(DType::F32, &[b, h, sq], DType::F32.round((sk.max(1) as f64).ln())))
        };
        let dout = HostTensor::from_vec(
            dtype,
            &out.shape,
            (0..out.numel()).map(|_| dtype.round(rng.random_range(-1.0..1.0))).collect(),
        );
        let nan = |t: &HostTensor| HostTensor::full(t.dtype, &t.shape, f64::NAN);
        call.tensors.insert("dq".into(), nan(&x.query));
        call.tensors.insert("dk".into(), nan(&x.key));
        call.tensors.insert("dv".into(), nan(&x.value));
        if let Some(s) = &x.sinks {
            call.tensors.insert("dsinks".into(), HostTensor::full(DType::F32, &s.shape, f64::NAN));
        }
        if ff.bias_grad {
            call.tensors.insert("dbias".into(), HostTensor::full(dtype, &[b, h, sq, sk], f64::NAN));
        }
        call.tensors.insert("out".into(), out);
        call.tensors.insert("lse".into(), lse);
        call.tensors.insert("dout".into(), dout);
        Ok(call)
    }
}

/// The call's scalars that `scalars` names take its values.
fn set_scalars(call: &mut HostCall, scalars: &op::Scalars) {
    for (k, v) in call.scalars.iter_mut() {
        if let Some(x) = scalars.get(k) {
            *v = *x;
        }
    }
}

impl Operation for BlockSparseBwd {
    fn name(&self) -> &'static str {
        "blocksparse_attention_bwd"
    }

    fn summary(&self) -> &'static str {
        "block-sparse attention backward: dq, dk, dv (and dsinks) over the forward's block layout and its transpose \
         (deterministic)"
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
        FWD.variant_fields()
    }

    fn variant_allowed(&self) -> &'static str {
        FWD.variant_allowed()
    }

    fn decode_variant(&self, d: &mut Decoder, f: &Fields) -> op::Features {
        super::op::decode_variant_of(d, f, true)
    }

    fn describe(&self, f: &op::Features) -> String {
        FWD.describe(f)
    }

    fn axes(&self) -> &'static [AxisDecl] {
        AXES
    }

    fn plan_names(&self) -> &'static [&'static str] {
        &["layout"]
    }

    fn plans(&self, _spec: &Spec, f: &op::Features) -> Vec<PlanDecl> {
        let Ok(ff) = features(f) else { return Vec::new() };
        let temp = |name: &str, dtype: &str, shape: &[&str], fill: &str| Temporary {
            name: name.into(),
            dtype: dtype.into(),
            shape: shape.iter().map(|s| s.to_string()).collect(),
            fill: fill.into(),
            given: false,
        };
        let (nq, nk) = ("cdiv(seq_q, block_m)", "cdiv(seq_k, block_n)");
        // The forward's lists and each block's class may be given by the call (built by
        // `host_layout_classes`): the layout kernel is then skipped.
        let given = |t: Temporary| Temporary { given: true, ..t };
        let mut temporaries: Vec<Temporary> = LAYOUT_TENSORS
            .iter()
            .zip(["2", nk])
            .map(|((name, _), last)| given(temp(name, "i32", &["layout_batch", "layout_heads", nq, last], "none")))
            .collect();
        // Blocks the layout kernel does not visit are skipped: class 0 from the fill.
        temporaries.push(given(temp("block_class", "i32", &["layout_batch", "layout_heads", nq, nk], "zero")));
        temporaries.push(temp("kv_count", "i32", &["layout_batch", "layout_kv_heads", nk, "2"], "none"));
        temporaries.push(temp("kv_idx", "i32", &["layout_batch", "layout_heads", nk, nq], "none"));
        temporaries.push(temp("delta", "f32", &["batch", "heads_q", "seq_q"], "none"));
        let roles: Vec<RoleDecl> = BwdRole::roles(&ff)
            .into_iter()
            .map(|r| {
                let (tile_axes, fixed) = match r {
                    BwdRole::Preprocess => (vec!["block_m"], Config::new()),
                    // A fixed row count and no tile axis: it pairs with every tiling.
                    BwdRole::Dsinks => (vec![], Config::new()),
                    _ => (vec!["block_m", "block_n"], Config::new()),
                };
                RoleDecl { name: r.name(), tile_axes, fixed }
            })
            .collect();
        let produced: Vec<String> = temporaries.iter().filter(|t| t.given).map(|t| t.name.clone()).collect();
        let launches = roles
            .iter()
            .map(|r| match r.name {
                "layout" => Launch { produces: produced.clone(), ..Launch::of(r.name) },
                _ => Launch::of(r.name),
            })
            .collect();
        vec![PlanDecl {
            name: "layout",
            roles,
            temporaries,
            launches,
            runtime_axes: vec![],
            // The lists are per tiling: every kernel that reads them shares it.
            shared_axes: vec!["block_m", "block_n"],
        }]
    }

    fn kernel_id(&self, spec_name: &str, k: &KernelInstance) -> String {
        let hd = k.keys.get("head_dim").copied().unwrap_or(0);
        let dv = k.keys.get("head_dim_v").map(|v| format!("v{v}")).unwrap_or_default();
        let base = format!("{spec_name}_{}_{}_d{hd}{dv}_{}", k.variant.name, k.dtype, k.role);
        let (m, n) = (k.tile.get("block_m").copied().unwrap_or(0), k.tile.get("block_n").copied().unwrap_or(0));
        match k.role {
            "preprocess" => format!("{base}_m{m}"),
            "dsinks" => base,
            _ => format!("{base}_m{m}_n{n}"),
        }
    }

    fn build(&self, spec: &Spec, k: &KernelInstance) -> Result<Kernel, String> {
        let f = features(&k.variant.features)?;
        let role =
            BwdRole::from_name(k.role).ok_or_else(|| format!("blocksparse_attention_bwd has no role `{}`", k.role))?;
        let hd = *k.keys.get("head_dim").ok_or("the instance has no head_dim")? as usize;
        let dv = head_dim_v(&k.keys).unwrap_or(hd as u32) as usize;
        let tile = |n: &str| k.tile.get(n).copied().map(|v| v as usize);
        let bm = tile("block_m").unwrap_or(super::backward::DSINKS_ROWS);
        let bn = tile("block_n").unwrap_or(bm);
        let mut kernel = build_bwd(&k.id, role, &f, k.dtype, (hd, dv), (bm, bn)).map_err(|e| e.to_string())?;
        kernel.attrs = vec![
            ("op".into(), spec.op.clone()),
            ("variant".into(), k.variant.name.clone()),
            ("dtype".into(), k.dtype.to_string()),
            ("head_dim".into(), hd.to_string()),
            ("role".into(), k.role.to_string()),
        ];
        for (n, v) in &k.tile {
            kernel.attrs.push((n.clone(), v.to_string()));
        }
        if dv != hd {
            kernel.attrs.push(("head_dim_v".into(), dv.to_string()));
        }
        Ok(kernel)
    }

    fn param_doc(&self, name: &str) -> &'static str {
        bwd_param_docs().iter().chain(param_docs()).find(|(n, _)| *n == name).map(|(_, d)| *d).unwrap_or("")
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
        // The forward's checks (its out and lse are inputs here), then the backward's.
        let mut sizes = FWD.validate(f, dtype, keys, call)?;
        let ff = features(f)?;
        let shape = |n: &str| call.tensor(n).map(|t| t.shape).ok_or_else(|| format!("argument `{n}` is missing"));
        let (q, k, v, out) = (shape("query")?, shape("key")?, shape("value")?, shape("out")?);
        expect_shape(call, "dout", &out, dtype)?;
        expect_shape(call, "dq", &q, dtype)?;
        expect_shape(call, "dk", &k, dtype)?;
        expect_shape(call, "dv", &v, dtype)?;
        if ff.sinks {
            let s = shape("sinks")?;
            expect_shape(call, "dsinks", &s, DType::F32)?;
            sizes.insert("n_sinks".into(), s[1] as i64);
        }
        if ff.bias_grad {
            let (b, h, sq, sk) = (q[0], q[1], q[2], k[2]);
            expect_shape(call, "dbias", &[b, h, sq, sk], dtype)?;
        }
        let hkv = sizes.get("heads_kv").copied().unwrap_or(1);
        sizes.insert("layout_kv_heads".into(), if ff.per_head() { hkv } else { 1 });
        Ok(sizes)
    }

    fn cache_desc(&self, wanted: &op::Features, dtype: DType, sizes: &Sizes) -> serde_json::Value {
        FWD.cache_desc(wanted, dtype, sizes)
    }

    fn random_call(&self, f: &op::Features, dtype: DType, dims: &Sizes, seed: u64) -> Result<HostCall, String> {
        self.call_of(f, dtype, dims, seed, &op::Scalars::new(), true)
    }

    /// `out` and `lse` come from the forward with the given scalars.
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

    /// For timing alone, above [`REFERENCE_FOR_TIMING`] products `out` and `lse` are
    /// stand-ins (random `out`, `lse = ln sk`): a kernel's speed does not depend on them.
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
        // The forward's tensors and as many again (dout, dq, dk, dv, delta).
        let fwd = FWD.call_elements(f, dims)?;
        let mut counts = vec![fwd, fwd];
        if features(f)?.bias_grad {
            let s = super::op::shape_of(dims)?;
            counts.push(op::elements(&[s.batch, s.heads_q, s.seq_q, s.seq_k])?);
        }
        op::total_elements(&counts)
    }

    fn reference(&self, f: &op::Features, call: &HostCall) -> Result<BTreeMap<String, HostTensor>, String> {
        let ff = features(f)?;
        let x = inputs_of(call)?;
        let (scale, cap) = scale_and_cap(&ff, call)?;
        let dout = call.tensors.get("dout").ok_or("the call has no `dout`")?;
        let g = reference_bwd(&ff, &x, scale, cap, dout)?;
        let mut out = BTreeMap::from([("dq".to_string(), g.dq), ("dk".to_string(), g.dk), ("dv".to_string(), g.dv)]);
        if let Some(s) = g.dsinks {
            out.insert("dsinks".into(), s);
        }
        if let Some(t) = g.dbias {
            out.insert("dbias".into(), t);
        }
        Ok(out)
    }

    fn outputs(&self, f: &op::Features) -> Vec<&'static str> {
        let mut v = vec!["dq", "dk", "dv"];
        if features(f).is_ok_and(|f| f.sinks) {
            v.push("dsinks");
        }
        if features(f).is_ok_and(|f| f.bias_grad) {
            v.push("dbias");
        }
        v
    }

    fn small_dims(&self, sizes: &Sizes) -> Sizes {
        FWD.small_dims(sizes)
    }

    /// The forward's awkward cases, with three query rows where the forward has one: a
    /// causal row that sees a single key has gradients of exactly 0 (P = 1, dP = delta),
    /// which no relative error can judge.
    fn check_dims(&self, keys: &Keys) -> Vec<Sizes> {
        let mut dims = FWD.check_dims(keys);
        for d in &mut dims {
            if d.get("seq_q") == Some(&1) {
                d.insert("seq_q".into(), 3);
            }
        }
        dims
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
