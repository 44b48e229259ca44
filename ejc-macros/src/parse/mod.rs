//! Reading an `#[ej_kernel]` item: the attribute's arguments ([`attr`]), the
//! function's signature ([`signature`]) and its body in the tile DSL ([`body`]).
//! Everything outside the DSL is rejected here, with a span on the offending token.

pub mod attr;
pub mod body;
pub mod signature;
