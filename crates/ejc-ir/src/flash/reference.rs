//! Reference semantics (being written).
