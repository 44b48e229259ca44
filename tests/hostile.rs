//! The hostile suite: every class of defect found by trying ejc as a careless or hostile
//! user would (issue 21) is pinned here, one module per class. Each test failed before its
//! fix. The fuzz targets (tests/fuzz.rs in CI, fuzz/ for long runs) are beside it.

#[path = "hostile/common.rs"]
mod common;

#[path = "hostile/resources.rs"]
mod resources;

#[path = "hostile/nonsense.rs"]
mod nonsense;

#[path = "hostile/caches.rs"]
mod caches;
