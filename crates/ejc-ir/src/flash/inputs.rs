//! Random inputs (being written).
