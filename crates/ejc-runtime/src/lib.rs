//! ejc-runtime (being written)
