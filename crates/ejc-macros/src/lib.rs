//! ejc-macros (being written)
