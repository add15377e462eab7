//! A child that extends its parent's type with an inherent impl is part of
//! the parent's own items.
mod dp;
