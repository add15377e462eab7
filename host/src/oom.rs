//! Recognising libtorch's out-of-memory errors by their message.

/// Whether an error message says that memory ran out (libtorch's CUDA and
/// CPU allocators both say "out of memory").
pub fn is_oom_message(msg: &str) -> bool {
    msg.contains("out of memory")
}
