//! lamina images: building them from layer tars ([`build`]), their layout as
//! OCI artifacts ([`artifact`]), boot sets from traces ([`boot`]) and the
//! whole conversion ([`convert`]).
#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod artifact;
pub mod boot;
pub mod build;
pub mod convert;
