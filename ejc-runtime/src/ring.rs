//! Ring attention: flash attention over a sequence split across ranks (GPUs, or threads
//! in a simulation), keys and values travelling around the ring while each rank
//! attends with the blocks it holds (docs/semantics.md, "Ring attention"; the schedule
//! is [`ejc_ir::flash::ring`]).
//!
//! Every block is an ordinary flash launch through [`Runtime::call`] (tuned, cached),
//! so the ring runs whatever `flash_attention_fwd` / `flash_attention_bwd` kernels are
//! loaded, on the CPU or the GPU. What the ring adds is done by a [`Glue`]:
//!
//! - forward: each block's output and log-sum-exp merged into f32 accumulators (the
//!   online softmax over blocks), then the sinks added once and the output rounded;
//! - backward: the forward's final `out` and `lse` given to every block (P is
//!   recomputed), dQ summed locally in f32, and dK/dV summed in f32 accumulators that
//!   travel around the ring behind the keys and come home after the last step; dsinks
//!   from `lse` and `rowsum(dout ∘ out)`, summed over the ranks.
//!
//! Communication goes through a [`Communicator`]: [`LocalRing`] (threads of one
//! process, the simulation the tests run on the CPU) or, with feature `cuda`, NCCL
//! ([`crate::ring_cuda::NcclComm`]). A step's send of the next keys is started before
//! its launches and waited for after them, so it overlaps the compute.
//!
//! ```no_run
//! use ejc_runtime::ring::{simulate, RingInputs, RingOptions};
//! use ejc_ir::flash::ring::RingLayout;
//! # fn demo(rt: &[ejc_runtime::api::Runtime], q: ejc_runtime::cpu::HostBuffer, k: ejc_runtime::cpu::HostBuffer, v: ejc_runtime::cpu::HostBuffer) {
//! let opts = RingOptions { causal: true, layout: RingLayout::ZigZag, ..Default::default() };
//! // Four ranks as threads: the global tensors are dealt out, run, and gathered back.
//! let r = simulate(4, &RingInputs::new(&q, &k, &v), &opts, None).unwrap();
//! println!("{:?}", r.out.shape);
//! # }
//! ```

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::ops::Range;
use std::sync::mpsc::{channel, Receiver, Sender};

use ejc_ir::flash::op::scalars_of;
use ejc_ir::flash::ring::{self, RingLayout, RingMask};
use ejc_ir::flash::{CallFeatures, Features, FlashRuntime, SoftCap, Window};
use ejc_ir::types::DType;

use crate::api::{ApiError, CallOptions, PlatformChoice, Runtime, RuntimeOptions};
use crate::call::{Call, Tensor};
use crate::cpu::HostBuffer;
use crate::registry::Config;

fn err(m: impl Into<String>) -> ApiError {
    ApiError::Call(m.into())
}

/// The options of a ring-attention call (the same on every rank).
#[derive(Clone, Debug)]
pub struct RingOptions {
    pub layout: RingLayout,
    pub causal: bool,
    /// `(left, right)`, both `>= 0`, in global token positions.
    pub window: Option<(i64, i64)>,
    pub logits_soft_cap: Option<f64>,
    /// Default `1/sqrt(head_dim)`.
    pub softmax_scale: Option<f64>,
    /// Backward blocks that give the same bits on every run (`two_pass`).
    pub deterministic: bool,
    /// CPU worker threads per rank (0 = all cores).
    pub threads: usize,
    /// Explicit configurations of the blocks, by kind (`fwd:full`, `fwd:band`,
    /// `bwd:full`, `bwd:band`) or by kind and size (`fwd:band:2048x2048`, which wins):
    /// used as given, never tuned. Blocks without one are tuned by the
    /// runtime (and cached) like any call. A long ring tunes once at a smaller size and
    /// passes what it chose ([`RingForward::configs`]).
    pub configs: BTreeMap<String, Config>,
}

impl Default for RingOptions {
    fn default() -> Self {
        RingOptions {
            layout: RingLayout::ZigZag,
            causal: false,
            window: None,
            logits_soft_cap: None,
            softmax_scale: None,
            deterministic: false,
            threads: 0,
            configs: BTreeMap::new(),
        }
    }
}

impl RingOptions {
    fn mask(&self) -> RingMask {
        RingMask { causal: self.causal, window: self.window }
    }
}

/// A rank's tensors (its shard, in local-row order: [`ejc_ir::flash::ring::pieces`]).
/// q `[B, L, Hq, D]`, k `[B, L, Hkv, D]`, v `[B, L, Hkv, Dv]`, segment ids `[B, L]`
/// (i32), sinks `[Hq, n]` (f32, the same on every rank).
#[derive(Clone, Copy)]
pub struct RingInputs<'a, T> {
    pub q: &'a T,
    pub k: &'a T,
    pub v: &'a T,
    pub q_segment_ids: Option<&'a T>,
    pub kv_segment_ids: Option<&'a T>,
    pub sinks: Option<&'a T>,
}

impl<'a, T> RingInputs<'a, T> {
    pub fn new(q: &'a T, k: &'a T, v: &'a T) -> Self {
        RingInputs { q, k, v, q_segment_ids: None, kv_segment_ids: None, sinks: None }
    }
}

/// A rank's forward results: `out [B, L, Hq, Dv]` (q's dtype), `lse [B, Hq, L]` (f32).
pub struct RingForward {
    pub out: Tensor,
    pub lse: Tensor,
    /// Flash launches this rank ran.
    pub launches: usize,
    /// The configuration each kind of block ran with, by kind (the last) and by kind
    /// and size (`fwd:full`, `fwd:full:2048x4096`).
    pub configs: BTreeMap<String, Config>,
    /// Host seconds of each step: see [`StepTime`].
    pub steps: Vec<StepTime>,
}

/// Where a step's time went, on the host: `blocks_s` from the step's start to its last
/// block's end (each call waits for its kernel; with `EJC_RING_ASYNC=1`, only until it is
/// queued), `wait_s` from there to its transfers' end. The transfers are waited for on the
/// GPU, so `wait_s` is measured only where `EJC_RING_TRACE=1` makes the host wait for the
/// blocks and then the transfers (else 0; a probe that serialises the ring, not a timing).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct StepTime {
    pub blocks_s: f64,
    pub wait_s: f64,
}

/// Whether `EJC_RING_ASYNC=1` asks for calls that return once queued on a GPU
/// (`CallOptions::asynchronous`; not yet measured on GPUs, so off by default).
fn async_calls() -> bool {
    std::env::var("EJC_RING_ASYNC").is_ok_and(|v| v == "1")
}

/// Whether `EJC_RING_TRACE` asks for the transfers' wait on the host ([`StepTime`]).
fn tracing() -> bool {
    std::env::var("EJC_RING_TRACE").is_ok_and(|v| !v.is_empty() && v != "0")
}

/// A rank's gradients (`dsinks` summed over every rank).
pub struct RingGrads {
    pub dq: Tensor,
    pub dk: Tensor,
    pub dv: Tensor,
    pub dsinks: Option<Tensor>,
    pub launches: usize,
    /// The configuration each kind of block ran with (`bwd:full`, `bwd:full:2048x4096`).
    pub configs: BTreeMap<String, Config>,
}

/// Sends to the next rank and receives from the previous one. `start` begins moving
/// `send` (this rank's buffers) to rank `+1` and `recv` from rank `−1` (same shapes and
/// dtypes, in order); `wait` returns once `recv` holds them. Two exchanges with
/// different tags may be in flight at once.
pub trait Communicator {
    fn rank(&self) -> usize;
    fn size(&self) -> usize;
    fn start(&mut self, tag: u8, send: &[&Tensor], recv: &[&Tensor]) -> Result<(), ApiError>;
    fn wait(&mut self, tag: u8, recv: &mut [&mut Tensor]) -> Result<(), ApiError>;
    /// Sum an f32 tensor over every rank, in place (every rank gets the same bits).
    fn all_reduce_sum(&mut self, t: &mut Tensor) -> Result<(), ApiError>;
}

/// What the ring does between flash launches, on the platform the tensors live on.
/// Accumulators are contiguous f32; `rows` tensors are contiguous `[B, L, H, D]`.
pub trait Glue {
    fn alloc(&self, dtype: DType, shape: &[usize]) -> Result<Tensor, ApiError>;
    fn fill(&self, t: &mut Tensor, x: f32) -> Result<(), ApiError>;
    /// Merge a block's `o [B, Lb, H, D]` / `lse [B, H, Lb]` into `acc [B, L, H, D]` /
    /// `acc_lse [B, H, L]` at row `off`.
    fn merge(
        &self,
        acc: &mut Tensor,
        acc_lse: &mut Tensor,
        o: &Tensor,
        lse: &Tensor,
        off: usize,
    ) -> Result<(), ApiError>;
    /// `acc[:, off + i] += x[:, i]` (`acc` f32 `[B, L, H, D]`, `x` any float `[B, Lx, H, D]`).
    fn accumulate(&self, acc: &mut Tensor, x: &Tensor, off: usize) -> Result<(), ApiError>;
    /// `out = acc · exp(acc_lse − lse)`, `lse = logaddexp(acc_lse, logsumexp(sinks[h]))`.
    fn finalize(
        &self,
        acc: &Tensor,
        acc_lse: &Tensor,
        sinks: Option<&Tensor>,
        out: &mut Tensor,
        lse: &mut Tensor,
    ) -> Result<(), ApiError>;
    /// `out = acc` rounded to `out`'s dtype.
    fn convert(&self, acc: &Tensor, out: &mut Tensor) -> Result<(), ApiError>;
    /// `dsinks[h, t] = −Σ_{b,i} exp(sinks[h,t] − lse[b,h,i]) · Σ_d dout·out` (f32 `[Hq, n]`).
    fn dsinks(&self, sinks: &Tensor, lse: &Tensor, out: &Tensor, dout: &Tensor) -> Result<Tensor, ApiError>;
    /// Rows `r` of axis `axis`: a view where the platform has them (the GPU), else a copy.
    fn rows(&self, t: &Tensor, axis: usize, r: Range<usize>) -> Result<Tensor, ApiError>;
    /// Wait on the host for the work queued so far (the step trace's; the host glue's
    /// work is done when it returns).
    fn sync(&self) -> Result<(), ApiError> {
        Ok(())
    }
}

fn info(t: &Tensor) -> (DType, Vec<usize>) {
    let i = t.info();
    (i.dtype, i.shape)
}

/// The flash features and run-time scalars of one block.
fn block_call(
    o: &RingOptions,
    band: Option<(i64, i64)>,
    segments: bool,
    head_dim: usize,
) -> (ejc_ir::op::Features, ejc_ir::op::Scalars) {
    let wanted = CallFeatures { window: band, softcap: o.logits_soft_cap, segment_ids: segments, ..Default::default() };
    let features = Features {
        sliding_window: band.map(|_| Window::Runtime),
        logits_soft_cap: o.logits_soft_cap.map(|_| SoftCap::Runtime),
        segment_ids: segments,
        ..Default::default()
    };
    let rt = FlashRuntime {
        softmax_scale: o.softmax_scale.unwrap_or(1.0 / (head_dim as f64).sqrt()),
        window: band.unwrap_or((0, 0)),
        softcap: o.logits_soft_cap.unwrap_or(1.0),
        dropout_p: 0.0,
        seed: 0,
    };
    (wanted.to_json(), scalars_of(&features, &rt))
}

/// Check a rank's inputs against each other and the ring; returns (B, L, Hq, Hkv, D, Dv).
fn check_inputs(
    a: &RingInputs<Tensor>,
    o: &RingOptions,
    n: usize,
) -> Result<(usize, usize, usize, usize, usize, usize), ApiError> {
    let (dt, q) = info(a.q);
    let (dk, k) = info(a.k);
    let (dv, v) = info(a.v);
    let arg = |arg: &'static str, m: String| ApiError::Argument { arg, message: m };
    if !matches!(dt, DType::BF16 | DType::F16 | DType::F32) {
        return Err(arg("q", format!("dtype {dt}: ring attention takes bf16, f16 or f32")));
    }
    if dk != dt || dv != dt {
        return Err(arg("k", format!("k ({dk}) and v ({dv}) must have q's dtype {dt}")));
    }
    for (name, s) in [("q", &q), ("k", &k), ("v", &v)] {
        if s.len() != 4 {
            return Err(arg(name, format!("shape {s:?} is not [batch, local_seq, heads, head_dim]")));
        }
    }
    if k[0] != q[0] || k[1] != q[1] || k[3] != q[3] || v[..3] != k[..3] {
        return Err(arg(
            "k",
            format!("shapes q {q:?}, k {k:?}, v {v:?} disagree (every rank holds as many keys as queries)"),
        ));
    }
    if k[2] == 0 || q[2] % k[2] != 0 {
        return Err(arg("k", format!("heads_q ({}) must be a multiple of heads_kv ({})", q[2], k[2])));
    }
    if a.q_segment_ids.is_some() != a.kv_segment_ids.is_some() {
        return Err(arg("q_segment_ids", "segment ids need both q_segment_ids and kv_segment_ids".into()));
    }
    for (name, t) in [("q_segment_ids", a.q_segment_ids), ("kv_segment_ids", a.kv_segment_ids)] {
        if let Some(t) = t {
            let (d, s) = info(t);
            if d != DType::I32 || s != [q[0], q[1]] {
                return Err(arg(name, format!("{d} {s:?}, expected i32 [{}, {}]", q[0], q[1])));
            }
        }
    }
    if let Some(s) = a.sinks {
        let (d, s) = info(s);
        if d != DType::F32 || s.len() != 2 || s[0] != q[2] {
            return Err(arg("sinks", format!("{d} {s:?}, expected f32 [{}, n_sinks]", q[2])));
        }
    }
    if let Some(c) = o.logits_soft_cap {
        if !(c > 0.0 && (c as f32).is_finite()) {
            return Err(arg("logits_soft_cap", format!("{c} must be a positive finite number")));
        }
    }
    ring::check(o.layout, n, q[1], o.mask()).map_err(|m| arg("q", m))?;
    Ok((q[0], q[1], q[2], k[2], q[3], v[3]))
}

/// A contiguous `[B, rows, H, D]` (or `[B, H, rows]`) view of the first rows of a
/// scratch buffer.
fn scratch_view(g: &dyn Glue, t: &Tensor, shape: &[usize], axis: usize) -> Result<Tensor, ApiError> {
    let full = info(t).1;
    if full[axis] == shape[axis] {
        return g.rows(t, axis, 0..shape[axis]);
    }
    // A prefix of a contiguous buffer, contiguous in the smaller shape.
    match t {
        Tensor::Host(_) => g.alloc(info(t).0, shape),
        #[cfg(feature = "cuda")]
        Tensor::Cuda(d) => {
            let mut d = d.clone();
            d.shape = shape.to_vec();
            d.strides = ejc_ir::tensor::HostTensor::contiguous_strides(shape);
            Ok(Tensor::Cuda(d))
        }
    }
}

fn view_of(t: &Tensor) -> Tensor {
    match t {
        Tensor::Host(b) => Tensor::Host(b.clone()),
        #[cfg(feature = "cuda")]
        Tensor::Cuda(d) => Tensor::Cuda(d.clone()),
    }
}

/// A block's kind (`fwd:band`) and its kind at its size (`fwd:band:64x128`): the keys of
/// [`RingOptions::configs`].
fn block_kind(pass: &str, band: Option<(i64, i64)>, lq: usize, lk: usize) -> (String, String) {
    let kind = format!("{pass}:{}", if band.is_some() { "band" } else { "full" });
    let sized = format!("{kind}:{lq}x{lk}");
    (kind, sized)
}

/// The configuration for a block: the one given for its kind at its size, else for its
/// kind, else none (the runtime tunes).
fn call_opts(o: &RingOptions, on_device: bool, (kind, sized): &(String, String)) -> CallOptions {
    CallOptions {
        platform: if on_device { PlatformChoice::Cuda } else { PlatformChoice::Cpu },
        config: o.configs.get(sized).or_else(|| o.configs.get(kind)).cloned(),
        threads: o.threads,
        deterministic: o.deterministic,
        // A step's launches, merges and transfers are ordered on the GPU's streams, so the
        // host could queue the next block while this one runs; opt-in until measured on GPUs.
        asynchronous: on_device && async_calls(),
    }
}

/// The keys (and values, and key segment ids) a rank holds, passed around the ring:
/// tag 0 of the communicator. They arrive only in buffers of the ring's own, two used in
/// turn, never in the caller's: a GPU view shares its memory, and receiving there would
/// overwrite the rank's own keys, which the backward reads again.
struct KeyRing {
    /// The keys held now (the caller's at step 0).
    cur: Vec<Tensor>,
    /// Where the next ones arrive.
    next: Vec<Tensor>,
    /// The second buffer, until step 1 needs it.
    spare: Vec<Tensor>,
}

impl KeyRing {
    fn new(glue: &dyn Glue, a: &RingInputs<Tensor>) -> Result<KeyRing, ApiError> {
        let mut cur: Vec<Tensor> = vec![view_of(a.k), view_of(a.v)];
        if let Some(s) = a.kv_segment_ids {
            cur.push(view_of(s));
        }
        let own = || cur.iter().map(|t| glue.alloc(info(t).0, &info(t).1)).collect::<Result<Vec<_>, _>>();
        let (next, spare) = (own()?, own()?);
        Ok(KeyRing { cur, next, spare })
    }

    /// Send the keys held to the next rank, receive the previous rank's (not after the
    /// last step).
    fn start(&mut self, comm: &mut dyn Communicator, step: usize) -> Result<(), ApiError> {
        if step + 1 < comm.size() {
            comm.start(0, &self.cur.iter().collect::<Vec<_>>(), &self.next.iter().collect::<Vec<_>>())?;
        }
        Ok(())
    }

    /// Wait for the keys of the next step and hold them.
    fn finish(&mut self, comm: &mut dyn Communicator, step: usize) -> Result<(), ApiError> {
        if step + 1 < comm.size() {
            comm.wait(0, &mut self.next.iter_mut().collect::<Vec<_>>())?;
            let used = std::mem::replace(&mut self.cur, std::mem::take(&mut self.next));
            // The keys just used are ours to receive into again, except the caller's.
            self.next = if step == 0 { std::mem::take(&mut self.spare) } else { used };
        }
        Ok(())
    }
}

/// One flash launch of a ring step: the block's query rows of `a` and key rows of the
/// keys held (`cur`: k, v, and the key segment ids where there are some), plus the
/// pass's own tensors (`extra`: outputs, and the backward's out/dout/lse rows), run
/// through `Runtime::call` with the configuration for its kind; the call comes back with
/// its outputs, and the kind's configuration is recorded.
#[allow(clippy::too_many_arguments)]
fn run_block(
    rt: &mut Runtime,
    glue: &dyn Glue,
    a: &RingInputs<Tensor>,
    cur: &[&Tensor],
    blk: &ring::RingLaunch,
    o: &RingOptions,
    pass: &str,
    extra: Vec<(&str, Tensor)>,
    configs: &mut BTreeMap<String, Config>,
) -> Result<Call, ApiError> {
    let on_device = !matches!(a.q, Tensor::Host(_));
    let (features, scalars) = block_call(o, blk.band, a.q_segment_ids.is_some(), info(a.q).1[3]);
    let mut call = Call { scalars, ..Call::default() };
    call.tensors.insert("q".into(), glue.rows(a.q, 1, blk.q.clone())?);
    call.tensors.insert("k".into(), glue.rows(cur[0], 1, blk.kv.clone())?);
    call.tensors.insert("v".into(), glue.rows(cur[1], 1, blk.kv.clone())?);
    if let (Some(qs), Some(ks)) = (a.q_segment_ids, cur.get(2)) {
        call.tensors.insert("q_segment_ids".into(), glue.rows(qs, 1, blk.q.clone())?);
        call.tensors.insert("kv_segment_ids".into(), glue.rows(ks, 1, blk.kv.clone())?);
    }
    for (name, t) in extra {
        call.tensors.insert(name.into(), t);
    }
    #[cfg(feature = "cuda")]
    if on_device {
        call.cuda = Some(rt.cuda()?);
    }
    let kind = block_kind(pass, blk.band, blk.q.len(), blk.kv.len());
    let r = rt.call(&format!("flash_attention_{pass}"), &features, &mut call, &call_opts(o, on_device, &kind))?;
    configs.insert(kind.0, r.config.clone());
    configs.insert(kind.1, r.config);
    Ok(call)
}

/// An output the call filled, taken out of it.
fn take(call: &mut Call, n: &str) -> Result<Tensor, ApiError> {
    call.tensors.remove(n).ok_or_else(|| err(format!("the call lost `{n}`")))
}

/// The ring forward on one rank: its shard's output and log-sum-exp.
pub fn forward(
    rt: &mut Runtime,
    comm: &mut dyn Communicator,
    glue: &dyn Glue,
    a: &RingInputs<Tensor>,
    o: &RingOptions,
) -> Result<RingForward, ApiError> {
    let (n, rank) = (comm.size(), comm.rank());
    let (b, l, hq, _, _, dv) = check_inputs(a, o, n)?;
    let dtype = info(a.q).0;
    let mut launches = 0;
    let mut configs = BTreeMap::new();
    let mut run = |rt: &mut Runtime,
                   cur: &[&Tensor],
                   blk: &ring::RingLaunch,
                   out: Tensor,
                   lse: Tensor|
     -> Result<(Tensor, Tensor), ApiError> {
        let mut call = run_block(rt, glue, a, cur, blk, o, "fwd", vec![("out", out), ("lse", lse)], &mut configs)?;
        launches += 1;
        Ok((take(&mut call, "out")?, take(&mut call, "lse")?))
    };
    // A ring of one whose mask is one launch (and no sinks to join): that launch alone,
    // straight into the outputs (the same bits as through the merge, which would copy it).
    if n == 1 && a.sinks.is_none() {
        let blks = ring::launches(o.layout, n, l, rank, rank, o.mask()).map_err(err)?;
        if let [blk] = &blks[..] {
            if blk.q == (0..l) {
                let out = glue.alloc(dtype, &[b, l, hq, dv])?;
                let lse = glue.alloc(DType::F32, &[b, hq, l])?;
                let cur: Vec<&Tensor> = [a.k, a.v].into_iter().chain(a.kv_segment_ids).collect();
                let t = std::time::Instant::now();
                let (out, lse) = run(rt, &cur, blk, out, lse)?;
                let steps = vec![StepTime { blocks_s: t.elapsed().as_secs_f64(), wait_s: 0.0 }];
                return Ok(RingForward { out, lse, launches, configs, steps });
            }
        }
    }
    let mut acc = glue.alloc(DType::F32, &[b, l, hq, dv])?;
    glue.fill(&mut acc, 0.0)?;
    let mut acc_lse = glue.alloc(DType::F32, &[b, hq, l])?;
    glue.fill(&mut acc_lse, f32::NEG_INFINITY)?;
    let o_block = glue.alloc(dtype, &[b, l, hq, dv])?;
    let lse_block = glue.alloc(DType::F32, &[b, hq, l])?;
    let mut keys = KeyRing::new(glue, a)?;
    let (trace, mut steps) = (tracing(), Vec::with_capacity(n));
    for step in 0..n {
        let t0 = std::time::Instant::now();
        keys.start(comm, step)?;
        let src = ring::source(n, rank, step);
        for blk in ring::launches(o.layout, n, l, rank, src, o.mask()).map_err(err)? {
            let lq = blk.q.len();
            let (out, lse) = run(
                rt,
                &keys.cur.iter().collect::<Vec<_>>(),
                &blk,
                scratch_view(glue, &o_block, &[b, lq, hq, dv], 1)?,
                scratch_view(glue, &lse_block, &[b, hq, lq], 2)?,
            )?;
            glue.merge(&mut acc, &mut acc_lse, &out, &lse, blk.q.start)?;
        }
        if trace {
            glue.sync()?;
        }
        let t1 = std::time::Instant::now();
        keys.finish(comm, step)?;
        if trace {
            glue.sync()?;
        }
        steps.push(StepTime {
            blocks_s: (t1 - t0).as_secs_f64(),
            wait_s: if trace { t1.elapsed().as_secs_f64() } else { 0.0 },
        });
    }
    let mut out = glue.alloc(dtype, &[b, l, hq, dv])?;
    let mut lse = glue.alloc(DType::F32, &[b, hq, l])?;
    glue.finalize(&acc, &acc_lse, a.sinks, &mut out, &mut lse)?;
    Ok(RingForward { out, lse, launches, configs, steps })
}

/// The ring backward on one rank: gradients of its shard, from the forward's `out` and
/// `lse` (this rank's) and the output gradient `dout`.
pub fn backward(
    rt: &mut Runtime,
    comm: &mut dyn Communicator,
    glue: &dyn Glue,
    a: &RingInputs<Tensor>,
    (out, lse, dout): (&Tensor, &Tensor, &Tensor),
    o: &RingOptions,
) -> Result<RingGrads, ApiError> {
    let (n, rank) = (comm.size(), comm.rank());
    let (b, l, hq, hkv, d, dv) = check_inputs(a, o, n)?;
    let dtype = info(a.q).0;
    let mut dq_acc = glue.alloc(DType::F32, &[b, l, hq, d])?;
    glue.fill(&mut dq_acc, 0.0)?;
    // This step's dK/dV contributions (f32), and the accumulators that travel.
    let mut part = vec![glue.alloc(DType::F32, &[b, l, hkv, d])?, glue.alloc(DType::F32, &[b, l, hkv, dv])?];
    let mut acc_in = vec![glue.alloc(DType::F32, &[b, l, hkv, d])?, glue.alloc(DType::F32, &[b, l, hkv, dv])?];
    let mut acc_out = vec![glue.alloc(DType::F32, &[b, l, hkv, d])?, glue.alloc(DType::F32, &[b, l, hkv, dv])?];
    let blk_dq = glue.alloc(dtype, &[b, l, hq, d])?;
    let blk_dk = glue.alloc(dtype, &[b, l, hkv, d])?;
    let blk_dv = glue.alloc(dtype, &[b, l, hkv, dv])?;
    let mut keys = KeyRing::new(glue, a)?;
    let mut launches = 0;
    let mut configs = BTreeMap::new();
    for step in 0..n {
        keys.start(comm, step)?;
        for p in part.iter_mut() {
            glue.fill(p, 0.0)?;
        }
        let src = ring::source(n, rank, step);
        for blk in ring::launches(o.layout, n, l, rank, src, o.mask()).map_err(err)? {
            let (lq, lk) = (blk.q.len(), blk.kv.len());
            let q_rows = |t: &Tensor| glue.rows(t, 1, blk.q.clone());
            let extra = vec![
                ("out", q_rows(out)?),
                ("dout", q_rows(dout)?),
                ("lse", glue.rows(lse, 2, blk.q.clone())?),
                ("dq", scratch_view(glue, &blk_dq, &[b, lq, hq, d], 1)?),
                ("dk", scratch_view(glue, &blk_dk, &[b, lk, hkv, d], 1)?),
                ("dv", scratch_view(glue, &blk_dv, &[b, lk, hkv, dv], 1)?),
            ];
            let cur: Vec<&Tensor> = keys.cur.iter().collect();
            let mut call = run_block(rt, glue, a, &cur, &blk, o, "bwd", extra, &mut configs)?;
            glue.accumulate(&mut dq_acc, &take(&mut call, "dq")?, blk.q.start)?;
            glue.accumulate(&mut part[0], &take(&mut call, "dk")?, blk.kv.start)?;
            glue.accumulate(&mut part[1], &take(&mut call, "dv")?, blk.kv.start)?;
            launches += 1;
        }
        // The accumulators of the keys held now: zero at step 0 (our own keys), else
        // what the previous rank sent after its step.
        if step == 0 {
            for t in acc_in.iter_mut() {
                glue.fill(t, 0.0)?;
            }
        } else {
            comm.wait(1, &mut acc_in.iter_mut().collect::<Vec<_>>())?;
        }
        for (acc, p) in acc_in.iter_mut().zip(&part) {
            glue.accumulate(acc, p, 0)?;
        }
        if n > 1 && step + 1 < n {
            // On to the next rank.
            std::mem::swap(&mut acc_in, &mut acc_out);
            comm.start(1, &acc_out.iter().collect::<Vec<_>>(), &acc_in.iter().collect::<Vec<_>>())?;
        }
        keys.finish(comm, step)?;
    }
    let mut dk = glue.alloc(dtype, &[b, l, hkv, d])?;
    let mut dv_t = glue.alloc(dtype, &[b, l, hkv, dv])?;
    // What goes home: alive until the wait below (the transfer reads it on its own stream).
    let mut home = Vec::new();
    if n > 1 {
        // After the last step the sums are complete: rounded here and sent home in the
        // output dtype (the same bits as rounding at home, half the bytes of f32 on the
        // one transfer nothing is left to hide), while dQ is rounded.
        home = vec![glue.alloc(dtype, &[b, l, hkv, d])?, glue.alloc(dtype, &[b, l, hkv, dv])?];
        for (acc, h) in acc_in.iter().zip(home.iter_mut()) {
            glue.convert(acc, h)?;
        }
        comm.start(1, &home.iter().collect::<Vec<_>>(), &[&dk, &dv_t])?;
    } else {
        glue.convert(&acc_in[0], &mut dk)?;
        glue.convert(&acc_in[1], &mut dv_t)?;
    }
    let mut dq = glue.alloc(dtype, &[b, l, hq, d])?;
    glue.convert(&dq_acc, &mut dq)?;
    if n > 1 {
        comm.wait(1, &mut [&mut dk, &mut dv_t])?;
    }
    drop(home);
    let dsinks = match a.sinks {
        Some(s) => {
            let mut t = glue.dsinks(s, lse, out, dout)?;
            comm.all_reduce_sum(&mut t)?;
            Some(t)
        }
        None => None,
    };
    Ok(RingGrads { dq, dk, dv: dv_t, dsinks, launches, configs })
}

// ---------------------------------------------------------------------------------
// The host: glue in plain Rust, ranks as threads.

/// f32 elements of a contiguous host buffer.
pub(crate) fn f32s(t: &Tensor) -> Result<Vec<f32>, ApiError> {
    match t {
        Tensor::Host(h) if h.dtype == DType::F32 => {
            Ok(h.bytes.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect())
        }
        Tensor::Host(h) => Ok(h.to_host().to_vec().into_iter().map(|x| x as f32).collect()),
        #[cfg(feature = "cuda")]
        Tensor::Cuda(_) => Err(err("host glue given a GPU tensor")),
    }
}

pub(crate) fn put_f32s(t: &mut Tensor, xs: &[f32]) -> Result<(), ApiError> {
    match t {
        Tensor::Host(h) if h.dtype == DType::F32 => {
            for (c, x) in h.bytes.chunks_exact_mut(4).zip(xs) {
                c.copy_from_slice(&x.to_le_bytes());
            }
            Ok(())
        }
        Tensor::Host(h) => {
            let shape = h.shape.clone();
            let ht = ejc_ir::tensor::HostTensor::from_vec(h.dtype, &shape, xs.iter().map(|x| *x as f64).collect());
            *h = HostBuffer::from_host(&ht);
            Ok(())
        }
        #[cfg(feature = "cuda")]
        Tensor::Cuda(_) => Err(err("host glue given a GPU tensor")),
    }
}

/// [`Glue`] for host tensors.
pub struct HostGlue;

impl Glue for HostGlue {
    fn alloc(&self, dtype: DType, shape: &[usize]) -> Result<Tensor, ApiError> {
        HostBuffer::try_zeros(dtype, shape).map(Tensor::Host).map_err(err)
    }

    fn fill(&self, t: &mut Tensor, x: f32) -> Result<(), ApiError> {
        let n = info(t).1.iter().product::<usize>();
        put_f32s(t, &vec![x; n])
    }

    fn merge(
        &self,
        acc: &mut Tensor,
        acc_lse: &mut Tensor,
        o: &Tensor,
        lse: &Tensor,
        off: usize,
    ) -> Result<(), ApiError> {
        let (_, s) = info(acc);
        let (bsz, l, h, d) = (s[0], s[1], s[2], s[3]);
        let lb = info(o).1[1];
        let (mut a, mut al) = (f32s(acc)?, f32s(acc_lse)?);
        let (ob, lb_) = (f32s(o)?, f32s(lse)?);
        for b in 0..bsz {
            for i in 0..lb {
                for hh in 0..h {
                    let l2 = lb_[(b * h + hh) * lb + i];
                    let ia = (b * h + hh) * l + off + i;
                    let l1 = al[ia];
                    let m = l1.max(l2);
                    if m == f32::NEG_INFINITY {
                        continue;
                    }
                    let (w1, w2) = ((l1 - m).exp(), (l2 - m).exp());
                    let sum = w1 + w2;
                    let (a1, a2) = (w1 / sum, w2 / sum);
                    al[ia] = m + sum.ln();
                    let pa = ((b * l + off + i) * h + hh) * d;
                    let po = ((b * lb + i) * h + hh) * d;
                    for e in 0..d {
                        a[pa + e] = a1 * a[pa + e] + a2 * ob[po + e];
                    }
                }
            }
        }
        put_f32s(acc, &a)?;
        put_f32s(acc_lse, &al)
    }

    fn accumulate(&self, acc: &mut Tensor, x: &Tensor, off: usize) -> Result<(), ApiError> {
        let (_, s) = info(acc);
        let (bsz, l, inner) = (s[0], s[1], s[2] * s[3]);
        let lx = info(x).1[1];
        let mut a = f32s(acc)?;
        let xs = f32s(x)?;
        for b in 0..bsz {
            for i in 0..lx {
                let (pa, px) = (((b * l) + off + i) * inner, (b * lx + i) * inner);
                for e in 0..inner {
                    a[pa + e] += xs[px + e];
                }
            }
        }
        put_f32s(acc, &a)
    }

    fn finalize(
        &self,
        acc: &Tensor,
        acc_lse: &Tensor,
        sinks: Option<&Tensor>,
        out: &mut Tensor,
        lse: &mut Tensor,
    ) -> Result<(), ApiError> {
        let (_, s) = info(acc);
        let (bsz, l, h, d) = (s[0], s[1], s[2], s[3]);
        let (mut a, mut al) = (f32s(acc)?, f32s(acc_lse)?);
        let sink_lse: Vec<f32> = match sinks {
            None => vec![f32::NEG_INFINITY; h],
            Some(t) => {
                let (_, ss) = info(t);
                let v = t.host().ok_or_else(|| err("host glue given a GPU tensor"))?.to_host();
                (0..h)
                    .map(|hh| {
                        let xs: Vec<f32> = (0..ss[1]).map(|j| v.get(&[hh, j]) as f32).collect();
                        let m = xs.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                        if m == f32::NEG_INFINITY {
                            m
                        } else {
                            m + xs.iter().map(|x| (x - m).exp()).sum::<f32>().ln()
                        }
                    })
                    .collect()
            }
        };
        for b in 0..bsz {
            for (hh, &l2) in sink_lse.iter().enumerate() {
                for i in 0..l {
                    let ia = (b * h + hh) * l + i;
                    let l1 = al[ia];
                    let m = l1.max(l2);
                    let (lf, scale) = if m == f32::NEG_INFINITY {
                        (m, 0.0)
                    } else {
                        let lf = m + ((l1 - m).exp() + (l2 - m).exp()).ln();
                        (lf, (l1 - lf).exp())
                    };
                    al[ia] = lf;
                    let pa = ((b * l + i) * h + hh) * d;
                    for e in 0..d {
                        a[pa + e] *= scale;
                    }
                }
            }
        }
        put_f32s(out, &a)?;
        put_f32s(lse, &al)
    }

    fn convert(&self, acc: &Tensor, out: &mut Tensor) -> Result<(), ApiError> {
        put_f32s(out, &f32s(acc)?)
    }

    fn dsinks(&self, sinks: &Tensor, lse: &Tensor, out: &Tensor, dout: &Tensor) -> Result<Tensor, ApiError> {
        let (_, ss) = info(sinks);
        let (_, s) = info(out);
        let (bsz, l, h, d) = (s[0], s[1], s[2], s[3]);
        let sk = f32s(sinks)?;
        let (ls, o, g) = (f32s(lse)?, f32s(out)?, f32s(dout)?);
        let mut ds = vec![0f32; h * ss[1]];
        for hh in 0..h {
            for t in 0..ss[1] {
                let mut sum = 0f32;
                for b in 0..bsz {
                    for i in 0..l {
                        let p = ((b * l + i) * h + hh) * d;
                        let delta: f32 = (0..d).map(|e| o[p + e] * g[p + e]).sum();
                        sum += (sk[hh * ss[1] + t] - ls[(b * h + hh) * l + i]).exp() * delta;
                    }
                }
                ds[hh * ss[1] + t] = -sum;
            }
        }
        let mut t = self.alloc(DType::F32, &[h, ss[1]])?;
        put_f32s(&mut t, &ds)?;
        Ok(t)
    }

    fn rows(&self, t: &Tensor, axis: usize, r: Range<usize>) -> Result<Tensor, ApiError> {
        let h = t.host().ok_or_else(|| err("host glue given a GPU tensor"))?;
        if r.end > h.shape[axis] {
            return Err(err(format!("rows {r:?} of axis {axis} outside {:?}", h.shape)));
        }
        let mut shape = h.shape.clone();
        shape[axis] = r.len();
        let mut out = HostBuffer::try_zeros(h.dtype, &shape).map_err(err)?;
        let es = h.dtype.size_bytes();
        let n: usize = shape.iter().product();
        let mut idx = vec![0usize; shape.len()];
        for k in 0..n {
            let mut src = h.offset as isize;
            for (a, i) in idx.iter().enumerate() {
                let i = if a == axis { i + r.start } else { *i };
                src += i as isize * h.strides[a];
            }
            let src = src as usize * es;
            out.bytes[k * es..(k + 1) * es].copy_from_slice(&h.bytes[src..src + es]);
            for a in (0..shape.len()).rev() {
                idx[a] += 1;
                if idx[a] < shape[a] {
                    break;
                }
                idx[a] = 0;
            }
        }
        Ok(Tensor::Host(out))
    }
}

type Message = (u8, Vec<Tensor>);

/// One rank of a ring of threads in this process: [`LocalRing::new`] makes all of them.
/// Host tensors travel as copies; GPU tensors (one GPU shared by every rank: the
/// simulation of a multi-GPU ring on one device) as device-to-device copies.
pub struct LocalRing {
    rank: usize,
    size: usize,
    to_next: Sender<Message>,
    from_prev: Receiver<Message>,
    /// Messages that arrived for another tag than the one waited for.
    pending: HashMap<u8, VecDeque<Vec<Tensor>>>,
    #[cfg(feature = "cuda")]
    cuda: Option<std::sync::Arc<crate::cuda::Cuda>>,
}

impl LocalRing {
    /// The `n` ranks of a ring of host tensors, to be moved one to a thread.
    pub fn new(n: usize) -> Vec<LocalRing> {
        let (senders, receivers): (Vec<_>, Vec<_>) = (0..n).map(|_| channel::<Message>()).unzip();
        // Rank r receives on channel r; rank r − 1 holds its sender.
        let mut senders: Vec<Option<Sender<Message>>> = senders.into_iter().map(Some).collect();
        receivers
            .into_iter()
            .enumerate()
            .map(|(rank, from_prev)| LocalRing {
                rank,
                size: n,
                to_next: senders[(rank + 1) % n].take().unwrap_or_else(|| unreachable!("each sender taken once")),
                from_prev,
                pending: HashMap::new(),
                #[cfg(feature = "cuda")]
                cuda: None,
            })
            .collect()
    }

    /// The `n` ranks of a ring of tensors on one GPU.
    #[cfg(feature = "cuda")]
    pub fn on_gpu(n: usize, cuda: std::sync::Arc<crate::cuda::Cuda>) -> Vec<LocalRing> {
        let mut v = Self::new(n);
        for r in &mut v {
            r.cuda = Some(cuda.clone());
        }
        v
    }

    fn receive(&mut self, tag: u8) -> Result<Vec<Tensor>, ApiError> {
        if let Some(m) = self.pending.get_mut(&tag).and_then(|q| q.pop_front()) {
            return Ok(m);
        }
        loop {
            let (t, m) =
                self.from_prev.recv().map_err(|_| err(format!("rank {}: the previous rank hung up", self.rank)))?;
            if t == tag {
                return Ok(m);
            }
            self.pending.entry(t).or_default().push_back(m);
        }
    }

    /// A copy that stays valid while the sender reuses its buffer.
    fn snapshot(&self, t: &Tensor) -> Result<Tensor, ApiError> {
        match t {
            Tensor::Host(h) => Ok(Tensor::Host(h.clone())),
            #[cfg(feature = "cuda")]
            Tensor::Cuda(d) => {
                let cuda = self.cuda.as_ref().ok_or_else(|| err("a local ring of GPU tensors needs its GPU"))?;
                cuda.duplicate(d).map(Tensor::Cuda).map_err(|e| err(e.to_string()))
            }
        }
    }

    fn deliver(&self, from: Tensor, to: &mut Tensor) -> Result<(), ApiError> {
        match (from, to) {
            (Tensor::Host(f), Tensor::Host(t)) => {
                if f.bytes.len() != t.bytes.len() {
                    return Err(err(format!(
                        "rank {}: a buffer of {} bytes arrived for {}",
                        self.rank,
                        f.bytes.len(),
                        t.bytes.len()
                    )));
                }
                t.bytes = f.bytes;
                Ok(())
            }
            #[cfg(feature = "cuda")]
            (Tensor::Cuda(f), Tensor::Cuda(t)) => {
                let cuda = self.cuda.as_ref().ok_or_else(|| err("a local ring of GPU tensors needs its GPU"))?;
                cuda.copy(&f, t).map_err(|e| err(e.to_string()))
            }
            #[cfg(feature = "cuda")]
            _ => Err(err("a local ring moves host to host or GPU to GPU")),
        }
    }
}

impl Communicator for LocalRing {
    fn rank(&self) -> usize {
        self.rank
    }
    fn size(&self) -> usize {
        self.size
    }
    fn start(&mut self, tag: u8, send: &[&Tensor], _recv: &[&Tensor]) -> Result<(), ApiError> {
        let m = send.iter().map(|t| self.snapshot(t)).collect::<Result<_, _>>()?;
        self.to_next.send((tag, m)).map_err(|_| err(format!("rank {}: the next rank hung up", self.rank)))
    }
    fn wait(&mut self, tag: u8, recv: &mut [&mut Tensor]) -> Result<(), ApiError> {
        let m = self.receive(tag)?;
        if m.len() != recv.len() {
            return Err(err(format!("rank {}: {} buffers arrived, {} expected", self.rank, m.len(), recv.len())));
        }
        for (t, from) in recv.iter_mut().zip(m) {
            self.deliver(from, t)?;
        }
        Ok(())
    }
    fn all_reduce_sum(&mut self, t: &mut Tensor) -> Result<(), ApiError> {
        // Pass every rank's tensor around once, then sum in rank order on the host:
        // every rank gets the same bits, and the NCCL ring's all-reduce the same again.
        let mine = self.snapshot(t)?;
        let mut all: Vec<Option<Tensor>> = (0..self.size).map(|_| None).collect();
        let mut carry = self.snapshot(&mine)?;
        all[self.rank] = Some(mine);
        for k in 1..self.size {
            self.to_next.send((2, vec![carry])).map_err(|_| err("the next rank hung up"))?;
            let mut m = self.receive(2)?;
            let got = m.pop().ok_or_else(|| err("an empty all-reduce message"))?;
            carry = self.snapshot(&got)?;
            all[(self.rank + self.size - k) % self.size] = Some(got);
        }
        let host: Vec<Vec<f32>> = all
            .into_iter()
            .map(|x| x.ok_or_else(|| err("an all-reduce part is missing")).and_then(|x| self.host_f32s(&x)))
            .collect::<Result<_, _>>()?;
        let sum = sum_in_rank_order(&host);
        self.put_host_f32s(t, &sum)
    }
}

/// Element-wise sum of every rank's values, rank 0 first (f32, from 0).
pub fn sum_in_rank_order(parts: &[Vec<f32>]) -> Vec<f32> {
    let mut sum = vec![0f32; parts.first().map_or(0, |p| p.len())];
    for p in parts {
        for (s, x) in sum.iter_mut().zip(p) {
            *s += x;
        }
    }
    sum
}

impl LocalRing {
    fn host_f32s(&self, t: &Tensor) -> Result<Vec<f32>, ApiError> {
        match t {
            Tensor::Host(_) => f32s(t),
            #[cfg(feature = "cuda")]
            Tensor::Cuda(d) => {
                let cuda = self.cuda.as_ref().ok_or_else(|| err("a local ring of GPU tensors needs its GPU"))?;
                f32s(&Tensor::Host(cuda.download(d).map_err(|e| err(e.to_string()))?))
            }
        }
    }

    fn put_host_f32s(&self, t: &mut Tensor, xs: &[f32]) -> Result<(), ApiError> {
        match t {
            Tensor::Host(_) => put_f32s(t, xs),
            #[cfg(feature = "cuda")]
            Tensor::Cuda(d) => {
                let cuda = self.cuda.as_ref().ok_or_else(|| err("a local ring of GPU tensors needs its GPU"))?;
                let mut h = Tensor::Host(HostBuffer::try_zeros(DType::F32, &d.shape).map_err(err)?);
                put_f32s(&mut h, xs)?;
                let up = cuda.upload(h.host().expect("host")).map_err(|e| err(e.to_string()))?;
                cuda.copy(&up, d).map_err(|e| err(e.to_string()))
            }
        }
    }
}

/// Rank `rank`'s rows (axis 1, the sequence) of a global host tensor `[B, n·L, …]`, in
/// its local order ([`ejc_ir::flash::ring::pieces`]).
pub fn deal(g: &HostBuffer, layout: RingLayout, n: usize, rank: usize) -> Result<HostBuffer, ApiError> {
    let l = g.shape[1] / n;
    let mut parts = Vec::new();
    for p in ring::pieces(layout, n, l, rank) {
        parts.push(HostGlue.rows(&Tensor::Host(g.clone()), 1, p.global..p.global + p.len)?);
    }
    host(concat(&parts, 1)?)
}

fn host(t: Tensor) -> Result<HostBuffer, ApiError> {
    match t {
        Tensor::Host(h) => Ok(h),
        #[cfg(feature = "cuda")]
        Tensor::Cuda(_) => Err(err("expected a host tensor")),
    }
}

fn concat(parts: &[Tensor], axis: usize) -> Result<Tensor, ApiError> {
    let hs: Vec<&HostBuffer> =
        parts.iter().map(|t| t.host().ok_or_else(|| err("host tensors only"))).collect::<Result<_, _>>()?;
    let mut shape = hs[0].shape.clone();
    shape[axis] = hs.iter().map(|h| h.shape[axis]).sum();
    let outer: usize = shape[..axis].iter().product();
    let es = hs[0].dtype.size_bytes();
    let mut out = HostBuffer::try_zeros(hs[0].dtype, &shape).map_err(err)?;
    let mut w = 0;
    for o in 0..outer {
        for h in &hs {
            let chunk = h.shape[axis..].iter().product::<usize>() * es;
            out.bytes[w..w + chunk].copy_from_slice(&h.bytes[o * chunk..(o + 1) * chunk]);
            w += chunk;
        }
    }
    Ok(Tensor::Host(out))
}

/// Every rank's rows (axis `axis`: 1 for `[B, L, …]`, 2 for the LSE's `[B, H, L]`) back
/// in global order: the inverse of [`deal`].
pub fn gather(shards: &[HostBuffer], layout: RingLayout, axis: usize) -> Result<HostBuffer, ApiError> {
    let n = shards.len();
    let l = shards[0].shape[axis];
    let mut parts: Vec<(usize, Tensor)> = Vec::new();
    for (rank, s) in shards.iter().enumerate() {
        for p in ring::pieces(layout, n, l, rank) {
            parts.push((p.global, HostGlue.rows(&Tensor::Host(s.clone()), axis, p.local..p.local + p.len)?));
        }
    }
    parts.sort_by_key(|p| p.0);
    let ts: Vec<Tensor> = parts.into_iter().map(|p| p.1).collect();
    host(concat(&ts, axis)?)
}

/// Results of a ring, gathered in global order: `out`, `lse` and, with a gradient,
/// `dq`, `dk`, `dv`, `dsinks`.
pub struct Simulated {
    pub out: HostBuffer,
    pub lse: HostBuffer,
    pub grads: Option<(HostBuffer, HostBuffer, HostBuffer, Option<HostBuffer>)>,
    /// Flash launches of each rank, forward (and backward).
    pub launches: Vec<(usize, usize)>,
    /// What the blocks ran with (rank 0's), forward and backward.
    pub configs: BTreeMap<String, Config>,
}

/// One rank's results, in host memory.
pub struct RankResult {
    pub out: HostBuffer,
    pub lse: HostBuffer,
    pub grads: Option<(HostBuffer, HostBuffer, HostBuffer, Option<HostBuffer>)>,
    pub launches: (usize, usize),
    pub configs: BTreeMap<String, Config>,
}

/// Where a rank's tensors live: the host, or (feature `cuda`) a GPU.
pub trait RankDevice: Sync {
    fn glue(&self) -> Result<Box<dyn Glue + '_>, ApiError>;
    fn upload(&self, h: &HostBuffer) -> Result<Tensor, ApiError>;
    fn download(&self, t: &Tensor) -> Result<HostBuffer, ApiError>;
    /// Point a rank's runtime at this device.
    fn attach(&self, rt: &mut Runtime) -> Result<(), ApiError>;
}

/// The CPU.
pub struct HostDevice;

impl RankDevice for HostDevice {
    fn glue(&self) -> Result<Box<dyn Glue + '_>, ApiError> {
        Ok(Box::new(HostGlue))
    }
    fn upload(&self, h: &HostBuffer) -> Result<Tensor, ApiError> {
        Ok(Tensor::Host(h.clone()))
    }
    fn download(&self, t: &Tensor) -> Result<HostBuffer, ApiError> {
        t.host().cloned().ok_or_else(|| err("a host rank was given a GPU tensor"))
    }
    fn attach(&self, _rt: &mut Runtime) -> Result<(), ApiError> {
        Ok(())
    }
}

/// Run one rank: deal its shard of the global host tensors, run [`forward`] (and
/// [`backward`] with `dout`) through `comm`, and bring the results back to the host.
pub fn run_rank(
    rt: &mut Runtime,
    comm: &mut dyn Communicator,
    device: &dyn RankDevice,
    a: &RingInputs<HostBuffer>,
    opts: &RingOptions,
    dout: Option<&HostBuffer>,
) -> Result<RankResult, ApiError> {
    let (n, rank) = (comm.size(), comm.rank());
    let glue = device.glue()?;
    let deal_up = |t: &HostBuffer| -> Result<Tensor, ApiError> { device.upload(&deal(t, opts.layout, n, rank)?) };
    let q = deal_up(a.q)?;
    let k = deal_up(a.k)?;
    let v = deal_up(a.v)?;
    let qs = a.q_segment_ids.map(deal_up).transpose()?;
    let ks = a.kv_segment_ids.map(deal_up).transpose()?;
    let sinks = a.sinks.map(|t| device.upload(t)).transpose()?;
    let inputs = RingInputs {
        q: &q,
        k: &k,
        v: &v,
        q_segment_ids: qs.as_ref(),
        kv_segment_ids: ks.as_ref(),
        sinks: sinks.as_ref(),
    };
    let f = forward(rt, comm, glue.as_ref(), &inputs, opts)?;
    let mut configs = f.configs.clone();
    let (grads, nb) = match dout {
        Some(d) => {
            let d = deal_up(d)?;
            let g = backward(rt, comm, glue.as_ref(), &inputs, (&f.out, &f.lse, &d), opts)?;
            configs.extend(g.configs.clone());
            let ds = g.dsinks.as_ref().map(|t| device.download(t)).transpose()?;
            (Some((device.download(&g.dq)?, device.download(&g.dk)?, device.download(&g.dv)?, ds)), g.launches)
        }
        None => (None, 0),
    };
    Ok(RankResult {
        out: device.download(&f.out)?,
        lse: device.download(&f.lse)?,
        grads,
        launches: (f.launches, nb),
        configs,
    })
}

/// Put every rank's results back in global order.
pub fn gather_results(ranks: Vec<RankResult>, layout: RingLayout) -> Result<Simulated, ApiError> {
    let out = gather(&ranks.iter().map(|r| r.out.clone()).collect::<Vec<_>>(), layout, 1)?;
    let lse = gather(&ranks.iter().map(|r| r.lse.clone()).collect::<Vec<_>>(), layout, 2)?;
    let launches = ranks.iter().map(|r| r.launches).collect();
    let configs = ranks.first().map(|r| r.configs.clone()).unwrap_or_default();
    let grads = if ranks.iter().all(|r| r.grads.is_some()) && !ranks.is_empty() {
        let gs: Vec<_> = ranks.into_iter().filter_map(|r| r.grads).collect();
        let col = |i: usize| -> Vec<HostBuffer> { gs.iter().map(|g| [&g.0, &g.1, &g.2][i].clone()).collect() };
        let (dq, dk, dv) = (gather(&col(0), layout, 1)?, gather(&col(1), layout, 1)?, gather(&col(2), layout, 1)?);
        Some((dq, dk, dv, gs[0].3.clone()))
    } else {
        None
    };
    Ok(Simulated { out, lse, grads, launches, configs })
}

/// Run a ring of `n` ranks as threads of this process on the CPU: the global host
/// tensors (`[B, n·L, …]`) are dealt out by `opts.layout`, every rank runs
/// [`forward`] (and [`backward`] with `dout`), and the results are gathered. Each rank
/// has its own runtime from the environment's options.
pub fn simulate(
    n: usize,
    a: &RingInputs<HostBuffer>,
    opts: &RingOptions,
    dout: Option<&HostBuffer>,
) -> Result<Simulated, ApiError> {
    simulate_with(n, a, opts, dout, &RuntimeOptions::default())
}

/// [`simulate`] with the options each rank's runtime is made from.
pub fn simulate_with(
    n: usize,
    a: &RingInputs<HostBuffer>,
    opts: &RingOptions,
    dout: Option<&HostBuffer>,
    runtime: &RuntimeOptions,
) -> Result<Simulated, ApiError> {
    simulate_on(&HostDevice, LocalRing::new(n), a, opts, dout, runtime)
}

/// The simulation on any device, with the ranks `comms` (one thread each).
pub fn simulate_on(
    device: &dyn RankDevice,
    comms: Vec<LocalRing>,
    a: &RingInputs<HostBuffer>,
    opts: &RingOptions,
    dout: Option<&HostBuffer>,
    runtime: &RuntimeOptions,
) -> Result<Simulated, ApiError> {
    let n = comms.len();
    check_global(n, a, opts)?;
    let results: Vec<Result<RankResult, ApiError>> = std::thread::scope(|scope| {
        let handles: Vec<_> = comms
            .into_iter()
            .map(|mut comm| {
                let runtime = runtime.clone();
                scope.spawn(move || -> Result<RankResult, ApiError> {
                    let mut rt = Runtime::new(runtime)?;
                    device.attach(&mut rt)?;
                    run_rank(&mut rt, &mut comm, device, a, opts, dout)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap_or_else(|_| Err(err("a rank's thread panicked")))).collect()
    });
    gather_results(results.into_iter().collect::<Result<Vec<_>, _>>()?, opts.layout)
}

/// The global sequence splits over `n` ranks in `opts.layout`.
pub fn check_global(n: usize, a: &RingInputs<HostBuffer>, opts: &RingOptions) -> Result<(), ApiError> {
    if n == 0 {
        return Err(err("a ring needs at least one rank"));
    }
    let s = a.q.shape.get(1).copied().unwrap_or(0);
    if s % n != 0 {
        return Err(ApiError::Argument {
            arg: "q",
            message: format!("a sequence of {s} tokens does not split over {n} ranks (pad it to a multiple)"),
        });
    }
    ring::check(opts.layout, n, s / n, opts.mask()).map_err(|m| ApiError::Argument { arg: "q", message: m })
}

/// Visible (query, key) pairs of one head of a sequence of `s` tokens under `mask`:
/// the work a ring of any size does, for FLOP counts (O(s)).
pub fn visible_pairs(mask: RingMask, s: usize) -> u64 {
    let s = s as i64;
    (0..s)
        .map(|i| {
            let mut lo = 0i64;
            let mut hi = s - 1;
            if mask.causal {
                hi = hi.min(i);
            }
            if let Some((l, r)) = mask.window {
                lo = lo.max(i - l);
                hi = hi.min(i + r);
            }
            (hi - lo + 1).max(0) as u64
        })
        .sum()
}
