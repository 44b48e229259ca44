//! A call of any operation: named tensors (inputs and outputs, on the host or on a GPU)
//! and named scalars — the generic form every executor binds from the manifest.
//!
//! ```
//! use ejc_runtime::call::{Call, Tensor};
//! use ejc_runtime::cpu::HostBuffer;
//! use ejc_ir::tensor::HostTensor;
//! use ejc_ir::types::DType;
//! let x = HostBuffer::from_host(&HostTensor::full(DType::F32, &[1, 8, 2, 16], 1.0));
//! let mut call = Call::default();
//! call.tensors.insert("x".into(), Tensor::Host(x));
//! call.scalars.insert("chunk_size".into(), 4.0);
//! assert!(call.on_host());
//! ```

use std::collections::BTreeMap;

use ejc_ir::op::{CallView, HostCall, Scalars, TensorInfo};

use crate::cpu::HostBuffer;

/// A tensor of a call.
pub enum Tensor {
    Host(HostBuffer),
    /// In GPU memory (feature `cuda`).
    #[cfg(feature = "cuda")]
    Cuda(crate::cuda::DeviceBuffer),
}

impl Tensor {
    pub fn info(&self) -> TensorInfo {
        match self {
            Tensor::Host(b) => TensorInfo { dtype: b.dtype, shape: b.shape.clone(), strides: b.strides.clone() },
            #[cfg(feature = "cuda")]
            Tensor::Cuda(b) => TensorInfo { dtype: b.dtype, shape: b.shape.clone(), strides: b.strides.clone() },
        }
    }

    pub fn host(&self) -> Option<&HostBuffer> {
        match self {
            Tensor::Host(b) => Some(b),
            #[cfg(feature = "cuda")]
            Tensor::Cuda(_) => None,
        }
    }

    pub fn host_mut(&mut self) -> Option<&mut HostBuffer> {
        match self {
            Tensor::Host(b) => Some(b),
            #[cfg(feature = "cuda")]
            Tensor::Cuda(_) => None,
        }
    }
}

/// Named tensors and scalars.
#[derive(Default)]
pub struct Call {
    pub tensors: BTreeMap<String, Tensor>,
    pub scalars: Scalars,
    /// The GPU that device tensors live on (to copy small index tensors back).
    #[cfg(feature = "cuda")]
    pub cuda: Option<std::sync::Arc<crate::cuda::Cuda>>,
}

impl Call {
    /// A call on the host from a host call (the tensors converted to their device
    /// representation).
    pub fn from_host(c: &HostCall) -> Call {
        Call {
            tensors: c.tensors.iter().map(|(k, t)| (k.clone(), Tensor::Host(HostBuffer::from_host(t)))).collect(),
            scalars: c.scalars.clone(),
            #[cfg(feature = "cuda")]
            cuda: None,
        }
    }

    /// Every tensor is on the host.
    pub fn on_host(&self) -> bool {
        self.tensors.values().all(|t| matches!(t, Tensor::Host(_)))
    }

    /// Every tensor is on a GPU.
    pub fn on_device(&self) -> bool {
        !self.tensors.is_empty() && self.tensors.values().all(|t| !matches!(t, Tensor::Host(_)))
    }

    /// The host tensor `name`, as a host tensor (f64 elements).
    pub fn host_tensor(&self, name: &str) -> Option<ejc_ir::tensor::HostTensor> {
        self.tensors.get(name).and_then(|t| t.host()).map(|b| b.to_host())
    }
}

impl CallView for Call {
    fn tensor(&self, name: &str) -> Option<TensorInfo> {
        self.tensors.get(name).map(Tensor::info)
    }

    fn int_values(&self, name: &str) -> Result<Vec<i64>, String> {
        match self.tensors.get(name) {
            None => Err(format!("the call has no `{name}`")),
            Some(Tensor::Host(b)) => Ok(b.to_host().to_vec().into_iter().map(|x| x as i64).collect()),
            #[cfg(feature = "cuda")]
            Some(Tensor::Cuda(d)) => {
                let cuda = self.cuda.as_ref().ok_or("the call has device tensors but no GPU handle")?;
                let h = cuda.download(d).map_err(|e| e.to_string())?;
                Ok(h.to_host().to_vec().into_iter().map(|x| x as i64).collect())
            }
        }
    }

    fn scalar(&self, name: &str) -> Option<f64> {
        self.scalars.get(name).copied()
    }
}
