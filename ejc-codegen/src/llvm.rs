//! A thin layer over LLVM's C API for emitting instructions on values whose shape
//! (scalar or vector) is only known at run time of the code generator.
//!
//! inkwell's typed builder distinguishes `FloatValue`, `VectorValue`, `IntValue` at
//! compile time of ejc, which is what ejc's tile code generator cannot know: the same
//! expression is emitted as a 16-lane vector in the body of a loop and as a scalar in
//! its tail. This layer works on `LLVMValueRef`s (the C API is uniform over scalars and
//! vectors) and keeps the unsafe code in one place. The context, the module and the
//! target machine still come from inkwell.

use std::ffi::CString;

use llvm_sys::core::*;
use llvm_sys::prelude::*;
use llvm_sys::{LLVMIntPredicate, LLVMRealPredicate, LLVMTypeKind};

pub type V = LLVMValueRef;
pub type T = LLVMTypeRef;
pub type B = LLVMBasicBlockRef;

fn c(name: &str) -> CString {
    CString::new(name).unwrap_or_default()
}

/// Instruction emission into one function.
pub struct Ir {
    pub ctx: LLVMContextRef,
    pub module: LLVMModuleRef,
    pub b: LLVMBuilderRef,
    pub func: V,
}

impl Drop for Ir {
    fn drop(&mut self) {
        unsafe { LLVMDisposeBuilder(self.b) }
    }
}

#[allow(clippy::missing_safety_doc)]
impl Ir {
    /// # Safety
    /// `ctx` and `module` must be live and belong together; `func` must be a function of
    /// `module`.
    pub unsafe fn new(ctx: LLVMContextRef, module: LLVMModuleRef, func: V) -> Ir {
        Ir { ctx, module, b: LLVMCreateBuilderInContext(ctx), func }
    }

    // ---- types ----
    pub fn f32(&self) -> T {
        unsafe { LLVMFloatTypeInContext(self.ctx) }
    }
    pub fn f16(&self) -> T {
        unsafe { LLVMHalfTypeInContext(self.ctx) }
    }
    pub fn bf16(&self) -> T {
        unsafe { LLVMBFloatTypeInContext(self.ctx) }
    }
    pub fn i1(&self) -> T {
        unsafe { LLVMInt1TypeInContext(self.ctx) }
    }
    pub fn i8(&self) -> T {
        unsafe { LLVMInt8TypeInContext(self.ctx) }
    }
    pub fn i16(&self) -> T {
        unsafe { LLVMInt16TypeInContext(self.ctx) }
    }
    pub fn i32(&self) -> T {
        unsafe { LLVMInt32TypeInContext(self.ctx) }
    }
    pub fn i64(&self) -> T {
        unsafe { LLVMInt64TypeInContext(self.ctx) }
    }
    pub fn ptr(&self) -> T {
        unsafe { LLVMPointerTypeInContext(self.ctx, 0) }
    }
    /// A pointer in an address space (NVPTX: 1 global, 3 shared).
    pub fn ptr_in(&self, addrspace: u32) -> T {
        unsafe { LLVMPointerTypeInContext(self.ctx, addrspace) }
    }
    pub fn void(&self) -> T {
        unsafe { LLVMVoidTypeInContext(self.ctx) }
    }
    /// `<n x t>`, or `t` itself when n == 1.
    pub fn vec(&self, t: T, n: usize) -> T {
        if n == 1 {
            t
        } else {
            unsafe { LLVMVectorType(t, n as u32) }
        }
    }
    pub fn type_of(&self, v: V) -> T {
        unsafe { LLVMTypeOf(v) }
    }
    /// Lanes of a vector value (1 for a scalar).
    pub fn lanes(&self, v: V) -> usize {
        let t = self.type_of(v);
        unsafe {
            if LLVMGetTypeKind(t) == LLVMTypeKind::LLVMVectorTypeKind {
                LLVMGetVectorSize(t) as usize
            } else {
                1
            }
        }
    }
    /// The element type of a vector type (the type itself for scalars).
    pub fn elem(&self, t: T) -> T {
        unsafe {
            if LLVMGetTypeKind(t) == LLVMTypeKind::LLVMVectorTypeKind {
                LLVMGetElementType(t)
            } else {
                t
            }
        }
    }
    pub fn is_float_ty(&self, t: T) -> bool {
        matches!(
            unsafe { LLVMGetTypeKind(self.elem(t)) },
            LLVMTypeKind::LLVMFloatTypeKind | LLVMTypeKind::LLVMHalfTypeKind | LLVMTypeKind::LLVMBFloatTypeKind
        )
    }

    // ---- constants ----
    pub fn cf32(&self, x: f64) -> V {
        unsafe { LLVMConstReal(self.f32(), x) }
    }
    pub fn cfloat(&self, t: T, x: f64) -> V {
        unsafe { LLVMConstReal(t, x) }
    }
    pub fn ci32(&self, x: i64) -> V {
        unsafe { LLVMConstInt(self.i32(), x as u64, 1) }
    }
    pub fn ci64(&self, x: i64) -> V {
        unsafe { LLVMConstInt(self.i64(), x as u64, 1) }
    }
    pub fn cint(&self, t: T, x: i64) -> V {
        unsafe { LLVMConstInt(t, x as u64, 1) }
    }
    pub fn ctrue(&self) -> V {
        unsafe { LLVMConstInt(self.i1(), 1, 0) }
    }
    /// Whether `v` is the constant `true` (an i1 the builder folded).
    pub fn is_true(&self, v: V) -> bool {
        unsafe { !llvm_sys::core::LLVMIsAConstantInt(v).is_null() && llvm_sys::core::LLVMConstIntGetZExtValue(v) == 1 }
    }
    pub fn cfalse(&self) -> V {
        unsafe { LLVMConstInt(self.i1(), 0, 0) }
    }
    /// `<0, 1, ..., n-1>` as i64 (n > 1) or 0.
    pub fn iota64(&self, n: usize) -> V {
        if n == 1 {
            return self.ci64(0);
        }
        let mut elems: Vec<V> = (0..n).map(|i| self.ci64(i as i64)).collect();
        unsafe { LLVMConstVector(elems.as_mut_ptr(), n as u32) }
    }
    pub fn undef(&self, t: T) -> V {
        unsafe { LLVMGetUndef(t) }
    }
    pub fn poison(&self, t: T) -> V {
        unsafe { LLVMGetPoison(t) }
    }

    // ---- blocks and control ----
    pub fn block(&self, name: &str) -> B {
        unsafe { LLVMAppendBasicBlockInContext(self.ctx, self.func, c(name).as_ptr()) }
    }
    pub fn at_end(&self, bb: B) {
        unsafe { LLVMPositionBuilderAtEnd(self.b, bb) }
    }
    pub fn current(&self) -> B {
        unsafe { LLVMGetInsertBlock(self.b) }
    }
    pub fn br(&self, bb: B) {
        unsafe {
            LLVMBuildBr(self.b, bb);
        }
    }
    pub fn cond_br(&self, c: V, t: B, f: B) {
        unsafe {
            LLVMBuildCondBr(self.b, c, t, f);
        }
    }
    pub fn ret_void(&self) {
        unsafe {
            LLVMBuildRetVoid(self.b);
        }
    }
    pub fn phi(&self, t: T) -> V {
        unsafe { LLVMBuildPhi(self.b, t, c("").as_ptr()) }
    }
    pub fn add_incoming(&self, phi: V, v: V, bb: B) {
        let mut vs = [v];
        let mut bbs = [bb];
        unsafe { LLVMAddIncoming(phi, vs.as_mut_ptr(), bbs.as_mut_ptr(), 1) }
    }
    pub fn param(&self, i: u32) -> V {
        unsafe { LLVMGetParam(self.func, i) }
    }

    // ---- memory ----
    pub fn load(&self, t: T, ptr: V, align: u32) -> V {
        unsafe {
            let v = LLVMBuildLoad2(self.b, t, ptr, c("").as_ptr());
            LLVMSetAlignment(v, align);
            v
        }
    }
    pub fn store(&self, v: V, ptr: V, align: u32) {
        unsafe {
            let s = LLVMBuildStore(self.b, v, ptr);
            LLVMSetAlignment(s, align);
        }
    }
    /// `*ptr += v` atomically (relaxed ordering, result unused: `red.add` on NVPTX, a
    /// `lock`-prefixed compare-exchange loop on x86).
    pub fn atomic_fadd(&self, v: V, ptr: V) {
        unsafe {
            LLVMBuildAtomicRMW(
                self.b,
                llvm_sys::LLVMAtomicRMWBinOp::LLVMAtomicRMWBinOpFAdd,
                ptr,
                v,
                llvm_sys::LLVMAtomicOrdering::LLVMAtomicOrderingMonotonic,
                0,
            );
        }
    }
    /// A plain store (`accumulate` false) or an atomic add (true) of `v` at `ptr`.
    pub fn store_or_add(&self, v: V, ptr: V, align: u32, accumulate: bool) {
        if accumulate {
            self.atomic_fadd(v, ptr)
        } else {
            self.store(v, ptr, align)
        }
    }
    /// `ptr + idx * sizeof(t)` (idx: i64).
    pub fn gep(&self, t: T, ptr: V, idx: V) -> V {
        let mut ix = [idx];
        unsafe { LLVMBuildGEP2(self.b, t, ptr, ix.as_mut_ptr(), 1, c("").as_ptr()) }
    }
    pub fn gep_const(&self, t: T, ptr: V, idx: i64) -> V {
        self.gep(t, ptr, self.ci64(idx))
    }

    // ---- arithmetic (scalars or vectors alike) ----
    pub fn fadd(&self, a: V, b: V) -> V {
        unsafe { LLVMBuildFAdd(self.b, a, b, c("").as_ptr()) }
    }
    pub fn fsub(&self, a: V, b: V) -> V {
        unsafe { LLVMBuildFSub(self.b, a, b, c("").as_ptr()) }
    }
    pub fn fmul(&self, a: V, b: V) -> V {
        unsafe { LLVMBuildFMul(self.b, a, b, c("").as_ptr()) }
    }
    pub fn fdiv(&self, a: V, b: V) -> V {
        unsafe { LLVMBuildFDiv(self.b, a, b, c("").as_ptr()) }
    }
    pub fn fneg(&self, a: V) -> V {
        unsafe { LLVMBuildFNeg(self.b, a, c("").as_ptr()) }
    }
    pub fn add(&self, a: V, b: V) -> V {
        unsafe { LLVMBuildAdd(self.b, a, b, c("").as_ptr()) }
    }
    pub fn sub(&self, a: V, b: V) -> V {
        unsafe { LLVMBuildSub(self.b, a, b, c("").as_ptr()) }
    }
    pub fn mul(&self, a: V, b: V) -> V {
        unsafe { LLVMBuildMul(self.b, a, b, c("").as_ptr()) }
    }
    pub fn sdiv(&self, a: V, b: V) -> V {
        unsafe { LLVMBuildSDiv(self.b, a, b, c("").as_ptr()) }
    }
    pub fn udiv(&self, a: V, b: V) -> V {
        unsafe { LLVMBuildUDiv(self.b, a, b, c("").as_ptr()) }
    }
    pub fn srem(&self, a: V, b: V) -> V {
        unsafe { LLVMBuildSRem(self.b, a, b, c("").as_ptr()) }
    }
    pub fn urem(&self, a: V, b: V) -> V {
        unsafe { LLVMBuildURem(self.b, a, b, c("").as_ptr()) }
    }
    pub fn and(&self, a: V, b: V) -> V {
        unsafe { LLVMBuildAnd(self.b, a, b, c("").as_ptr()) }
    }
    pub fn or(&self, a: V, b: V) -> V {
        unsafe { LLVMBuildOr(self.b, a, b, c("").as_ptr()) }
    }
    pub fn xor(&self, a: V, b: V) -> V {
        unsafe { LLVMBuildXor(self.b, a, b, c("").as_ptr()) }
    }
    pub fn shl(&self, a: V, b: V) -> V {
        unsafe { LLVMBuildShl(self.b, a, b, c("").as_ptr()) }
    }
    pub fn lshr(&self, a: V, b: V) -> V {
        unsafe { LLVMBuildLShr(self.b, a, b, c("").as_ptr()) }
    }
    pub fn ashr(&self, a: V, b: V) -> V {
        unsafe { LLVMBuildAShr(self.b, a, b, c("").as_ptr()) }
    }
    pub fn not(&self, a: V) -> V {
        unsafe { LLVMBuildNot(self.b, a, c("").as_ptr()) }
    }
    pub fn icmp(&self, p: LLVMIntPredicate, a: V, b: V) -> V {
        unsafe { LLVMBuildICmp(self.b, p, a, b, c("").as_ptr()) }
    }
    pub fn fcmp(&self, p: LLVMRealPredicate, a: V, b: V) -> V {
        unsafe { LLVMBuildFCmp(self.b, p, a, b, c("").as_ptr()) }
    }
    pub fn select(&self, cond: V, a: V, b: V) -> V {
        unsafe { LLVMBuildSelect(self.b, cond, a, b, c("").as_ptr()) }
    }

    // ---- conversions ----
    pub fn zext(&self, v: V, t: T) -> V {
        unsafe { LLVMBuildZExt(self.b, v, t, c("").as_ptr()) }
    }
    pub fn sext(&self, v: V, t: T) -> V {
        unsafe { LLVMBuildSExt(self.b, v, t, c("").as_ptr()) }
    }
    pub fn trunc(&self, v: V, t: T) -> V {
        unsafe { LLVMBuildTrunc(self.b, v, t, c("").as_ptr()) }
    }
    pub fn fpext(&self, v: V, t: T) -> V {
        unsafe { LLVMBuildFPExt(self.b, v, t, c("").as_ptr()) }
    }
    pub fn fptrunc(&self, v: V, t: T) -> V {
        unsafe { LLVMBuildFPTrunc(self.b, v, t, c("").as_ptr()) }
    }
    pub fn sitofp(&self, v: V, t: T) -> V {
        unsafe { LLVMBuildSIToFP(self.b, v, t, c("").as_ptr()) }
    }
    pub fn uitofp(&self, v: V, t: T) -> V {
        unsafe { LLVMBuildUIToFP(self.b, v, t, c("").as_ptr()) }
    }
    pub fn fptosi(&self, v: V, t: T) -> V {
        unsafe { LLVMBuildFPToSI(self.b, v, t, c("").as_ptr()) }
    }
    pub fn bitcast(&self, v: V, t: T) -> V {
        unsafe { LLVMBuildBitCast(self.b, v, t, c("").as_ptr()) }
    }

    // ---- vectors ----
    /// A vector of `n` copies of scalar `v` (`v` itself when n == 1).
    pub fn splat(&self, v: V, n: usize) -> V {
        if n == 1 {
            return v;
        }
        unsafe {
            let t = self.vec(self.type_of(v), n);
            let one = LLVMBuildInsertElement(self.b, self.poison(t), v, self.ci32(0), c("").as_ptr());
            let mut zeros: Vec<V> = (0..n).map(|_| self.ci32(0)).collect();
            let mask = LLVMConstVector(zeros.as_mut_ptr(), n as u32);
            LLVMBuildShuffleVector(self.b, one, self.poison(t), mask, c("").as_ptr())
        }
    }
    /// Make `v` have `n` lanes (splat a scalar; a vector must already have n).
    pub fn widen(&self, v: V, n: usize) -> V {
        if self.lanes(v) == n {
            v
        } else {
            self.splat(v, n)
        }
    }
    pub fn extract(&self, v: V, i: usize) -> V {
        unsafe { LLVMBuildExtractElement(self.b, v, self.ci32(i as i64), c("").as_ptr()) }
    }
    pub fn insert(&self, v: V, x: V, i: usize) -> V {
        unsafe { LLVMBuildInsertElement(self.b, v, x, self.ci32(i as i64), c("").as_ptr()) }
    }
    pub fn shuffle(&self, a: V, b: V, mask: &[usize]) -> V {
        let mut m: Vec<V> = mask.iter().map(|i| self.ci32(*i as i64)).collect();
        unsafe {
            let mv = LLVMConstVector(m.as_mut_ptr(), m.len() as u32);
            LLVMBuildShuffleVector(self.b, a, b, mv, c("").as_ptr())
        }
    }

    /// Field `i` of an aggregate (an intrinsic's struct result).
    pub fn extract_value(&self, v: V, i: u32) -> V {
        unsafe { LLVMBuildExtractValue(self.b, v, i, c("").as_ptr()) }
    }
    /// Convert between pointer address spaces.
    pub fn addrspace_cast(&self, v: V, t: T) -> V {
        unsafe { LLVMBuildAddrSpaceCast(self.b, v, t, c("").as_ptr()) }
    }
    pub fn ptr_to_int(&self, v: V, t: T) -> V {
        unsafe { LLVMBuildPtrToInt(self.b, v, t, c("").as_ptr()) }
    }

    /// A struct type of `fields` (an inline-asm statement's results).
    pub fn struct_ty(&self, fields: &[T]) -> T {
        let mut f = fields.to_vec();
        unsafe { LLVMStructTypeInContext(self.ctx, f.as_mut_ptr(), f.len() as u32, 0) }
    }

    /// Call inline assembly (with side effects: never removed or merged) returning
    /// `ret`; `constraints` in LLVM's syntax (`=f,0,r,l,...`).
    pub fn inline_asm(&self, ret: T, args: &[V], asm: &str, constraints: &str) -> V {
        unsafe {
            let mut tys: Vec<T> = args.iter().map(|a| LLVMTypeOf(*a)).collect();
            let fty = LLVMFunctionType(ret, tys.as_mut_ptr(), tys.len() as u32, 0);
            let f = LLVMGetInlineAsm(
                fty,
                asm.as_ptr() as *const _,
                asm.len(),
                constraints.as_ptr() as *const _,
                constraints.len(),
                1,
                0,
                llvm_sys::LLVMInlineAsmDialect::LLVMInlineAsmDialectATT,
                0,
            );
            let mut a = args.to_vec();
            LLVMBuildCall2(self.b, fty, f, a.as_mut_ptr(), a.len() as u32, c("").as_ptr())
        }
    }

    // ---- intrinsics ----
    /// Call an overloaded intrinsic, e.g. `call_intrinsic("llvm.fma", &[vty], &[a, b, c])`.
    pub fn call_intrinsic(&self, name: &str, overloads: &[T], args: &[V]) -> V {
        unsafe {
            let id = LLVMLookupIntrinsicID(name.as_ptr() as *const _, name.len());
            assert!(id != 0, "unknown LLVM intrinsic {name}");
            let mut tys = overloads.to_vec();
            let decl = LLVMGetIntrinsicDeclaration(self.module, id, tys.as_mut_ptr(), tys.len());
            let fty = LLVMIntrinsicGetType(self.ctx, id, tys.as_mut_ptr(), tys.len());
            let mut a = args.to_vec();
            LLVMBuildCall2(self.b, fty, decl, a.as_mut_ptr(), a.len() as u32, c("").as_ptr())
        }
    }
    /// Copy `bytes` (a constant) inline: LLVM expands it into vector moves instead of
    /// calling `memcpy`, whose call overhead is large for a tile row.
    pub fn memcpy_inline(&self, dst: V, src: V, bytes: usize) {
        let (p, i64t) = (self.ptr(), self.i64());
        self.call_intrinsic("llvm.memcpy.inline", &[p, p, i64t], &[dst, src, self.ci64(bytes as i64), self.cfalse()]);
    }

    pub fn fma(&self, a: V, b: V, acc: V) -> V {
        self.call_intrinsic("llvm.fma", &[self.type_of(a)], &[a, b, acc])
    }
    pub fn maxnum(&self, a: V, b: V) -> V {
        self.call_intrinsic("llvm.maxnum", &[self.type_of(a)], &[a, b])
    }
    pub fn minnum(&self, a: V, b: V) -> V {
        self.call_intrinsic("llvm.minnum", &[self.type_of(a)], &[a, b])
    }
    pub fn fmaximum(&self, a: V, b: V) -> V {
        self.call_intrinsic("llvm.maximum", &[self.type_of(a)], &[a, b])
    }
    pub fn fminimum(&self, a: V, b: V) -> V {
        self.call_intrinsic("llvm.minimum", &[self.type_of(a)], &[a, b])
    }
    pub fn fabs(&self, a: V) -> V {
        self.call_intrinsic("llvm.fabs", &[self.type_of(a)], &[a])
    }
    /// |a| with the sign of `sign`.
    pub fn copysign(&self, a: V, sign: V) -> V {
        self.call_intrinsic("llvm.copysign", &[self.type_of(a)], &[a, sign])
    }
    pub fn sqrt(&self, a: V) -> V {
        self.call_intrinsic("llvm.sqrt", &[self.type_of(a)], &[a])
    }
    /// Horizontal reduction of a float vector with maxnum (scalars pass through).
    pub fn reduce_fmax(&self, v: V) -> V {
        if self.lanes(v) == 1 {
            return v;
        }
        self.call_intrinsic("llvm.vector.reduce.fmax", &[self.type_of(v)], &[v])
    }
    /// Horizontal sum of a float vector (ordered from `start`).
    pub fn reduce_fadd(&self, start: V, v: V) -> V {
        if self.lanes(v) == 1 {
            return self.fadd(start, v);
        }
        let r = self.call_intrinsic("llvm.vector.reduce.fadd", &[self.type_of(v)], &[start, v]);
        // Allow a tree reduction: the order of a row sum is not part of the semantics.
        unsafe { LLVMSetFastMathFlags(r, llvm_sys::LLVMFastMathAllowReassoc) };
        r
    }
}
