//! Tensors read as memory: their bytes, whether they are dense, and a
//! finiteness scan straight from a CPU tensor's memory.

use tch::{Device, Kind, Tensor};

/// The bytes of `t`'s elements (its numel times its element size).
pub fn nbytes(t: &Tensor) -> u64 {
    (t.numel() * t.kind().elt_size_in_bytes()) as u64
}

/// Whether `t`'s elements fill `numel` consecutive elements of memory from
/// its data pointer, each once, in some order of its dimensions (a
/// contiguous tensor, or one in channels-last layout): what a library that
/// takes a pointer and a count (NCCL, a copy) may use in place when every
/// side has the same layout.
pub fn is_dense(t: &Tensor) -> bool {
    is_dense_layout(&t.size(), &t.stride())
}

/// [`is_dense`] of a tensor of `size` with `stride`: sorted by stride, each
/// stride (of a dimension longer than 1) is the product of the sizes below.
pub fn is_dense_layout(size: &[i64], stride: &[i64]) -> bool {
    let mut dims: Vec<(i64, i64)> = size.iter().zip(stride).filter(|(&n, _)| n != 1).map(|(&n, &s)| (s, n)).collect();
    dims.sort_unstable();
    let mut next = 1;
    for (s, n) in dims {
        if s != next {
            return false;
        }
        next *= n;
    }
    true
}

/// Whether every element of a contiguous CPU tensor of floats (f32, bf16,
/// f16) is finite, read straight from its memory in one vectorised pass with
/// no libtorch dispatch or thread-pool start; `None` for tensors on a device,
/// non-contiguous ones and other kinds.
pub fn cpu_all_finite(t: &Tensor) -> Option<bool> {
    if t.device() != Device::Cpu || !t.is_contiguous() {
        return None;
    }
    let n = t.numel();
    if n == 0 {
        return Some(true);
    }
    let p = t.data_ptr();
    // SAFETY: a contiguous CPU tensor of `n` elements of the matched kind
    // starts at `p`; the slice lives only for this call, while `t` holds it.
    unsafe {
        match t.kind() {
            Kind::Float => Some(finite::all32(std::slice::from_raw_parts(p as *const i32, n))),
            Kind::BFloat16 => Some(finite::all16(std::slice::from_raw_parts(p as *const i16, n), 0x7f7f)),
            Kind::Half => Some(finite::all16(std::slice::from_raw_parts(p as *const i16, n), 0x7bff)),
            _ => None,
        }
    }
}

/// The scans of [`cpu_all_finite`]. An element is NaN or infinite exactly
/// when its bits without the sign exceed those of the largest finite value;
/// the comparisons are signed (the masked bits are non-negative), which
/// every x86-64 vector unit has. AVX2 where the CPU has it.
mod finite {
    #[inline(always)]
    fn scan32(xs: &[i32]) -> bool {
        xs.chunks(4096).all(|c| !c.iter().fold(false, |bad, &x| bad | ((x & 0x7fff_ffff) > 0x7f7f_ffff)))
    }

    #[inline(always)]
    fn scan16(xs: &[i16], max_finite: i16) -> bool {
        xs.chunks(8192).all(|c| !c.iter().fold(false, |bad, &x| bad | ((x & 0x7fff) > max_finite)))
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2")]
    fn scan32_avx2(xs: &[i32]) -> bool {
        scan32(xs)
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2")]
    fn scan16_avx2(xs: &[i16], max_finite: i16) -> bool {
        scan16(xs, max_finite)
    }

    pub fn all32(xs: &[i32]) -> bool {
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("avx2") {
            // SAFETY: the CPU has AVX2.
            return unsafe { scan32_avx2(xs) };
        }
        scan32(xs)
    }

    pub fn all16(xs: &[i16], max_finite: i16) -> bool {
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("avx2") {
            // SAFETY: the CPU has AVX2.
            return unsafe { scan16_avx2(xs, max_finite) };
        }
        scan16(xs, max_finite)
    }
}
