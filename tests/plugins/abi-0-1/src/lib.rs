//! A native compressor of plugin ABI version 1 (contract 0.1), written by
//! hand (without `harness_sdk::export!`, which now emits version 2): the
//! symbols a library built against SDK 0.1 exports, and nothing of 0.2 (no
//! `harness_compress_setup`). It averages each bucket over the ranks, as the
//! built-in all-reduce does, and refuses a host table that does not say
//! version 1, as SDK 0.1's libraries do. A host of contract 0.2 must load it
//! and train with it exactly as with the built-in all-reduce.
//!
//! Only the types of `harness_sdk::abi` are used: their layout is the same
//! in both versions.
#![cfg(not(target_arch = "wasm32"))]
#![allow(clippy::missing_safety_doc)]

use std::ffi::c_void;

use harness_sdk::abi::{BucketInfo, Host, Info, Op, OpArgs, OpResult, Sink, KIND_COMPRESSOR, STATUS_ERROR, STATUS_OK};

const VERSION_0_1: u32 = 1;
const NAME: &str = "abi-0-1";
const PLUGIN_VERSION: &str = "0.1.0";

struct Instance {
    host: Host,
    error: String,
}

#[unsafe(no_mangle)]
pub extern "C" fn harness_abi_version() -> u32 {
    VERSION_0_1
}

#[unsafe(no_mangle)]
pub extern "C" fn harness_plugin_kind() -> u32 {
    KIND_COMPRESSOR
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn harness_plugin_create(host: *const Host) -> *mut c_void {
    // SAFETY: the host passes its table.
    let Some(host) = (unsafe { host.as_ref() }) else { return std::ptr::null_mut() };
    if host.abi_version != VERSION_0_1 {
        return std::ptr::null_mut();
    }
    Box::into_raw(Box::new(Instance { host: *host, error: String::new() })) as *mut c_void
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn harness_plugin_destroy(this: *mut c_void) {
    if !this.is_null() {
        // SAFETY: made by create.
        drop(unsafe { Box::from_raw(this as *mut Instance) });
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn harness_plugin_info(_this: *mut c_void, out: *mut Info) {
    // SAFETY: a valid out pointer; literals live forever.
    unsafe {
        *out = Info { name: NAME.as_ptr(), name_len: NAME.len(), version: PLUGIN_VERSION.as_ptr(), version_len: PLUGIN_VERSION.len() }
    };
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn harness_plugin_configure(this: *mut c_void, _toml: *const u8, len: usize) -> i32 {
    // SAFETY: a live instance.
    let i = unsafe { &mut *(this as *mut Instance) };
    if len == 0 {
        return STATUS_OK;
    }
    i.error = format!("{NAME} takes no configuration");
    STATUS_ERROR
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn harness_plugin_last_error(this: *mut c_void, len: *mut usize) -> *const u8 {
    // SAFETY: a live instance (or null) and a valid out pointer.
    let msg = unsafe { (this as *const Instance).as_ref() }.map_or("", |i| i.error.as_str());
    unsafe { *len = msg.len() };
    msg.as_ptr()
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn harness_plugin_state_save(_this: *mut c_void, _sink: Sink, _ctx: *mut c_void) -> i32 {
    STATUS_OK
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn harness_plugin_state_load(_this: *mut c_void, _data: *const u8, _len: usize) -> i32 {
    STATUS_OK
}

/// One host op on `tensors` and `floats`.
unsafe fn op(i: &mut Instance, code: Op, tensors: &[u64], floats: &[f64]) -> Result<OpResult, ()> {
    let args = OpArgs {
        tensors: tensors.as_ptr(),
        n_tensors: tensors.len(),
        floats: floats.as_ptr(),
        n_floats: floats.len(),
        ints: std::ptr::null(),
        n_ints: 0,
        data: std::ptr::null(),
        n_data: 0,
    };
    let mut out = OpResult::default();
    // SAFETY: the host's table, called as the ABI says.
    match unsafe { (i.host.op)(i.host.ctx, code as u32, &args, &mut out) } {
        STATUS_OK => Ok(out),
        _ => {
            i.error = format!("host op {code:?} failed");
            Err(())
        }
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn harness_compress(this: *mut c_void, bucket: u64, _info: *const BucketInfo) -> i32 {
    // SAFETY: a live instance; the bucket is lent for the call.
    let i = unsafe { &mut *(this as *mut Instance) };
    let run = |i: &mut Instance| -> Result<(), ()> {
        unsafe {
            op(i, Op::AllReduceSum, &[bucket], &[])?;
            let world = op(i, Op::WorldSize, &[], &[])?.scalar;
            let mean = op(i, Op::MulScalar, &[bucket], &[1.0 / world])?.tensors[0];
            let r = op(i, Op::Assign, &[bucket, mean], &[]);
            (i.host.drop_tensor)(i.host.ctx, mean);
            r.map(drop)
        }
    };
    match run(i) {
        Ok(()) => STATUS_OK,
        Err(()) => STATUS_ERROR,
    }
}
