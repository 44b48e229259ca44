//! Cache keys: which machine, which operation, which call, which candidates, which
//! compiler.
//!
//! ```
//! use ejc_runtime::key::{call_hash, candidates_checksum, CacheKey};
//! use serde_json::json;
//! let call = json!({"q": {"shape": [1, 1024, 8, 128], "dtype": "bf16"}, "causal": true});
//! let key = CacheKey {
//!     device: "cpu|Intel Xeon|avx512".into(),
//!     op: "flash_attention_fwd@1".into(),
//!     call: call_hash(&call),
//!     candidates: candidates_checksum(&["m64_n32".into(), "m64_n64".into()]),
//!     compiler: "0.1.0".into(),
//! };
//! assert_eq!(key.to_string().split('|').count(), 7); // the device holds two bars itself
//! ```
//!
//! The call hash is SHA-256 over canonical JSON (sorted keys, no spaces) of what the
//! call *is*: shapes, dtypes and static arguments — never array values, so a key never
//! depends on data. The candidate checksum makes a new candidate set (a new spec
//! schedule, a new build) miss old entries, and the compiler version does the same for
//! a new ejc: an old choice is never applied to code it was not measured on.

use std::fmt;

use sha2::{Digest, Sha256};

/// Hex SHA-256.
pub fn sha256_hex(bytes: &[u8]) -> String {
    Sha256::digest(bytes).iter().map(|b| format!("{b:02x}")).collect()
}

/// SHA-256 (32 hex digits kept) of the canonical JSON of a call description.
/// serde_json's maps are ordered, so `to_string` is canonical: sorted keys, compact.
pub fn call_hash(call: &serde_json::Value) -> String {
    sha256_hex(call.to_string().as_bytes())[..32].to_string()
}

/// Checksum (16 hex digits) of a candidate set, independent of its order.
pub fn candidates_checksum(ids: &[String]) -> String {
    let mut v = ids.to_vec();
    v.sort();
    v.dedup();
    sha256_hex(v.join(",").as_bytes())[..16].to_string()
}

/// Round a sequence length up to a power of two (at least 16), for operations that
/// tune per length bucket rather than per exact length.
pub fn bucket_pow2(n: usize) -> usize {
    n.max(16).next_power_of_two()
}

/// This machine as the CPU platform sees it: the CPU model and the ISA features that
/// decide which code runs.
pub fn cpu_fingerprint() -> String {
    let model = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split(':').nth(1))
                .map(|m| m.trim().to_string())
        })
        .unwrap_or_else(|| "unknown cpu".into());
    let mut feats = Vec::new();
    #[cfg(target_arch = "x86_64")]
    {
        for (name, on) in [
            ("avx2", std::is_x86_feature_detected!("avx2")),
            ("fma", std::is_x86_feature_detected!("fma")),
            ("avx512f", std::is_x86_feature_detected!("avx512f")),
            ("avx512bf16", std::is_x86_feature_detected!("avx512bf16")),
        ] {
            if on {
                feats.push(name);
            }
        }
        if ejc_ir::cpu_abi::Isa::host_max().has_amx() {
            feats.push("amx");
        }
    }
    let threads = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
    format!("cpu|{model}|{}|{threads}t", feats.join("+"))
}

/// The cache key of a call: `device`, the operation and its version, the call part the
/// operation describes ([`ejc_ir::op::Operation::cache_desc`]: sizes bucketed as it tunes
/// them, dtype, the features asked for), the candidate set and the compiler. The runtime,
/// `ejc tune` and `ejc-gpu tune` all build keys here, so a choice tuned by one serves the
/// others.
#[allow(clippy::too_many_arguments)]
pub fn call_key(
    device: &str,
    op: &dyn ejc_ir::op::Operation,
    op_version: u32,
    compiler: &str,
    wanted: &ejc_ir::op::Features,
    dtype: ejc_ir::types::DType,
    sizes: &ejc_ir::op::Sizes,
    candidate_ids: &[String],
) -> CacheKey {
    CacheKey {
        device: device.to_string(),
        op: format!("{}@{op_version}", op.name()),
        call: call_hash(&op.cache_desc(wanted, dtype, sizes)),
        candidates: candidates_checksum(candidate_ids),
        compiler: compiler.to_string(),
    }
}

/// The worker threads a CPU call runs on: `threads`, or every core for 0.
pub fn cpu_threads(threads: usize) -> usize {
    if threads == 0 {
        std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1)
    } else {
        threads
    }
}

/// A full cache key.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct CacheKey {
    pub device: String,
    /// `op@version`.
    pub op: String,
    pub call: String,
    pub candidates: String,
    pub compiler: String,
}

impl CacheKey {
    /// The key of a CPU call on `threads` worker threads (resolved: see [`cpu_threads`]):
    /// the call part gets `-<threads>t`, so a configuration tuned on one thread count is not
    /// taken for another. Keys written before the thread count was part of them simply
    /// miss (the call is tuned again); they are still read and listed.
    pub fn with_threads(mut self, threads: usize) -> CacheKey {
        self.call = format!("{}-{threads}t", self.call);
        self
    }
}

impl fmt::Display for CacheKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}|{}|{}|{}|{}", self.device, self.op, self.call, self.candidates, self.compiler)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn call_hash_is_canonical_and_ignores_nothing_it_is_given() {
        let a = json!({"b": 1, "a": [1, 2]});
        let b: serde_json::Value = serde_json::from_str(r#"{ "a": [1,2], "b": 1 }"#).unwrap();
        assert_eq!(call_hash(&a), call_hash(&b));
        assert_ne!(call_hash(&a), call_hash(&json!({"b": 2, "a": [1, 2]})));
    }

    #[test]
    fn candidate_checksum_is_order_free() {
        let x = candidates_checksum(&["m64_n32".into(), "m128_n64".into()]);
        assert_eq!(x, candidates_checksum(&["m128_n64".into(), "m64_n32".into()]));
        assert_ne!(x, candidates_checksum(&["m64_n32".into()]));
    }

    #[test]
    fn thread_count_is_part_of_a_cpu_key() {
        let k = CacheKey {
            device: "cpu|x|avx2|2t".into(),
            op: "op@1".into(),
            call: "abcd".into(),
            candidates: "c".into(),
            compiler: "0.1.0".into(),
        };
        let one = k.clone().with_threads(1);
        let two = k.clone().with_threads(2);
        assert_ne!(one.to_string(), two.to_string());
        assert_ne!(one.to_string(), k.to_string());
        assert_eq!(two.to_string(), "cpu|x|avx2|2t|op@1|abcd-2t|c|0.1.0");
        assert_eq!(cpu_threads(3), 3);
        assert!(cpu_threads(0) >= 1);
    }

    #[test]
    fn buckets() {
        assert_eq!(bucket_pow2(1), 16);
        assert_eq!(bucket_pow2(1000), 1024);
        assert_eq!(bucket_pow2(1024), 1024);
    }
}
