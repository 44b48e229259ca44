//! ejc-codegen (being written)
