pub(crate) mod body;
pub(crate) mod dummy;
pub mod server;
