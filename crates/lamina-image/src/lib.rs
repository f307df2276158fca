//! lamina images: building them from layer tars ([`build`]), their layout as
//! OCI artifacts ([`artifact`]), boot sets from traces ([`boot`]) and from the image
//! alone ([`static_boot`]) and the
//! whole conversion ([`convert`]); tar indexes of unmodified images
//! ([`tar_index`]) and `lamina index` ([`index`]).
#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod artifact;
pub mod boot;
pub mod build;
pub mod convert;
pub mod index;
pub mod static_boot;
pub mod tar_index;
