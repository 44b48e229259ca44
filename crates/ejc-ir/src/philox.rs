//! Philox 4x32-10 (placeholder module; being written).
