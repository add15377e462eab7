//! `harness-sdk`: write a harness strategy plugin once, build it as a
//! sandboxed WebAssembly component and as a native library.
//!
//! A plugin is a type that implements [`Plugin`] plus the trait of its kind
//! ([`Compressor`], [`BatchPolicy`] or [`CheckpointPolicy`]), and one
//! [`export!`] line:
//!
//! ```ignore
//! use harness_sdk::{Collective, Compressor, Config, Error, Plugin, Tensor, BucketInfo};
//!
//! pub struct Average;
//!
//! impl Plugin for Average {
//!     const NAME: &'static str = "average";
//!     const VERSION: &'static str = "0.1.0";
//!     fn configure(_config: &Config) -> Result<Self, Error> {
//!         Ok(Average)
//!     }
//! }
//!
//! impl Compressor for Average {
//!     fn compress(&mut self, bucket: &Tensor, comm: &Collective, _info: BucketInfo) -> Result<(), Error> {
//!         comm.all_reduce_sum(bucket);
//!         bucket.assign(&bucket.mul_scalar(1.0 / comm.world_size() as f64));
//!         Ok(())
//!     }
//! }
//!
//! harness_sdk::export!(Average as compressor);
//! ```
//!
//! `cargo build --target wasm32-wasip2 --release` gives the component
//! (`harness:strategy@0.2.0`, world `compressor`, see `sdk/wit`);
//! `cargo build --release` gives the native library (the C ABI of
//! [`abi`] and `sdk/include/harness_strategy.h`). The code is the same: on
//! wasm32 the facade ([`Tensor`], [`Collective`], [`log`]) calls the
//! component's imports; elsewhere it calls the host table through
//! [`abi::Host::op`].
//!
//! See `docs/plugin-sdk.md` for the author's guide.
#![deny(missing_docs)]

pub mod abi;
mod collective;
mod config;
mod contract;
mod error;
pub mod log;
pub mod tensor;
mod types;

#[cfg(not(target_arch = "wasm32"))]
#[doc(hidden)]
#[path = "native_glue.rs"]
pub mod __native;
#[cfg(not(target_arch = "wasm32"))]
pub mod native;
#[cfg(not(target_arch = "wasm32"))]
mod native_backend;

#[cfg(target_arch = "wasm32")]
#[doc(hidden)]
#[path = "wasm.rs"]
pub mod __wasm;
#[cfg(target_arch = "wasm32")]
#[doc(hidden)]
#[path = "wasm_glue.rs"]
pub mod __wasm_glue;
#[cfg(target_arch = "wasm32")]
mod wasm_backend;

pub use collective::Collective;
pub use config::Config;
pub use contract::{BatchPolicy, CheckpointPolicy, Compressor, Plugin, CONTRACT_VERSION};
pub use error::Error;
pub use tensor::{Device, Dtype, Tensor};
pub use types::{Batch, BucketInfo, BucketLayout, CheckpointHistory, Decision, ParamSlot, Telemetry};

/// Exports a plugin type: `harness_sdk::export!(MyType as compressor);`
/// (or `as batch_policy`, `as checkpoint_policy`). Use it once per crate.
///
/// On wasm32 this emits the component's exports (`plugin` and the kind's
/// interface); the instance is made by `configure` and kept for the
/// component's life. Calls before a successful `configure` fail.
#[cfg(target_arch = "wasm32")]
#[macro_export]
macro_rules! export {
    ($ty:ty as compressor) => {
        $crate::__export_wasm!($ty, compressor, export_compressor, $crate::Compressor);
    };
    ($ty:ty as batch_policy) => {
        $crate::__export_wasm!($ty, batch_policy, export_batch_policy, $crate::BatchPolicy);
    };
    ($ty:ty as checkpoint_policy) => {
        $crate::__export_wasm!($ty, checkpoint_policy, export_checkpoint_policy, $crate::CheckpointPolicy);
    };
}

#[cfg(target_arch = "wasm32")]
#[doc(hidden)]
#[macro_export]
macro_rules! __export_wasm {
    ($ty:ty, $world:ident, $export:ident, $kind:path) => {
        const _: () = {
            const fn __harness_check_kind<T: $kind>() {}
            __harness_check_kind::<$ty>();
            type __HarnessPlugin = $crate::__wasm_glue::Adapter<$ty>;
    $crate::__wasm::plugin::export_plugin!(__HarnessPlugin with_types_in $crate::__wasm::plugin);
    $crate::__wasm::$world::$export!(__HarnessPlugin with_types_in $crate::__wasm::$world);
        };
    };
}

/// Exports a plugin type: `harness_sdk::export!(MyType as compressor);`
/// (or `as batch_policy`, `as checkpoint_policy`). Use it once per crate.
///
/// On native targets this emits the `harness_*` symbols of [`abi::symbols`]
/// (`extern "C"`, unmangled): `harness_abi_version`, `harness_plugin_kind`,
/// `_create`, `_destroy`, `_info`, `_configure`, `_last_error`,
/// `_state_save`, `_state_load`, and the kind's own (`harness_compress` +
/// `harness_compress_setup`,
/// `harness_batch_initial` + `harness_batch_next` +
/// `harness_batch_wants_gradient_stats`, or `harness_checkpoint_decide`). Panics are caught and returned as
/// [`abi::STATUS_PANIC`]; keep `panic = "unwind"` (the default) in the
/// profile.
#[cfg(not(target_arch = "wasm32"))]
#[macro_export]
macro_rules! export {
    ($ty:ty as compressor) => {
        $crate::__export_native_common!($ty, $crate::abi::KIND_COMPRESSOR);

        /// Native plugin export (see `harness_strategy.h`).
        ///
        /// # Safety
        /// Called by the host as the C ABI says.
        #[unsafe(no_mangle)]
        pub unsafe extern "C" fn harness_compress(
            this: *mut ::core::ffi::c_void,
            bucket: u64,
            info: *const $crate::abi::BucketInfo,
        ) -> i32 {
            unsafe { $crate::__native::compress::<$ty>(this, bucket, info) }
        }
        const _: $crate::abi::exports::Compress = harness_compress;

        /// Native plugin export (see `harness_strategy.h`).
        ///
        /// # Safety
        /// Called by the host as the C ABI says.
        #[unsafe(no_mangle)]
        pub unsafe extern "C" fn harness_compress_setup(
            this: *mut ::core::ffi::c_void,
            buckets: *const $crate::abi::BucketLayout,
            n: usize,
        ) -> i32 {
            unsafe { $crate::__native::compress_setup::<$ty>(this, buckets, n) }
        }
        const _: $crate::abi::exports::CompressSetup = harness_compress_setup;
    };
    ($ty:ty as batch_policy) => {
        $crate::__export_native_common!($ty, $crate::abi::KIND_BATCH_POLICY);

        /// Native plugin export (see `harness_strategy.h`).
        ///
        /// # Safety
        /// Called by the host as the C ABI says.
        #[unsafe(no_mangle)]
        pub unsafe extern "C" fn harness_batch_initial(
            this: *mut ::core::ffi::c_void,
            configured: *const $crate::abi::Batch,
            out: *mut $crate::abi::Batch,
        ) -> i32 {
            unsafe { $crate::__native::batch_initial::<$ty>(this, configured, out) }
        }
        const _: $crate::abi::exports::BatchInitial = harness_batch_initial;

        /// Native plugin export (see `harness_strategy.h`).
        ///
        /// # Safety
        /// Called by the host as the C ABI says.
        #[unsafe(no_mangle)]
        pub unsafe extern "C" fn harness_batch_next(
            this: *mut ::core::ffi::c_void,
            t: *const $crate::abi::StepTelemetry,
            out: *mut $crate::abi::Batch,
        ) -> i32 {
            unsafe { $crate::__native::batch_next::<$ty>(this, t, out) }
        }
        const _: $crate::abi::exports::BatchNext = harness_batch_next;

        /// Native plugin export (see `harness_strategy.h`).
        ///
        /// # Safety
        /// Called by the host as the C ABI says.
        #[unsafe(no_mangle)]
        pub unsafe extern "C" fn harness_batch_wants_gradient_stats(this: *mut ::core::ffi::c_void, out: *mut u8) -> i32 {
            unsafe { $crate::__native::batch_wants_gradient_stats::<$ty>(this, out) }
        }
        const _: $crate::abi::exports::BatchWantsGradientStats = harness_batch_wants_gradient_stats;
    };
    ($ty:ty as checkpoint_policy) => {
        $crate::__export_native_common!($ty, $crate::abi::KIND_CHECKPOINT_POLICY);

        /// Native plugin export (see `harness_strategy.h`).
        ///
        /// # Safety
        /// Called by the host as the C ABI says.
        #[unsafe(no_mangle)]
        pub unsafe extern "C" fn harness_checkpoint_decide(
            this: *mut ::core::ffi::c_void,
            t: *const $crate::abi::StepTelemetry,
            h: *const $crate::abi::CheckpointHistory,
            out: *mut $crate::abi::Decision,
        ) -> i32 {
            unsafe { $crate::__native::checkpoint_decide::<$ty>(this, t, h, out) }
        }
        const _: $crate::abi::exports::CheckpointDecide = harness_checkpoint_decide;

        /// Native plugin export (see `harness_strategy.h`).
        ///
        /// # Safety
        /// Called by the host as the C ABI says.
        #[unsafe(no_mangle)]
        pub unsafe extern "C" fn harness_checkpoint_decide_tiered(
            this: *mut ::core::ffi::c_void,
            t: *const $crate::abi::StepTelemetry,
            h: *const $crate::abi::TieredHistory,
            out: *mut $crate::abi::TieredDecision,
        ) -> i32 {
            unsafe { $crate::__native::checkpoint_decide_tiered::<$ty>(this, t, h, out) }
        }
        const _: $crate::abi::exports::CheckpointDecideTiered = harness_checkpoint_decide_tiered;
    };
}

#[cfg(not(target_arch = "wasm32"))]
#[doc(hidden)]
#[macro_export]
macro_rules! __export_native_common {
    ($ty:ty, $kind:expr) => {
        /// Native plugin export: the ABI version this plugin speaks.
        #[unsafe(no_mangle)]
        pub extern "C" fn harness_abi_version() -> u32 {
            $crate::abi::ABI_VERSION
        }
        const _: $crate::abi::exports::AbiVersion = harness_abi_version;

        /// Native plugin export: the plugin's kind.
        #[unsafe(no_mangle)]
        pub extern "C" fn harness_plugin_kind() -> u32 {
            $kind
        }
        const _: $crate::abi::exports::Kind = harness_plugin_kind;

        /// Native plugin export (see `harness_strategy.h`).
        ///
        /// # Safety
        /// Called by the host as the C ABI says.
        #[unsafe(no_mangle)]
        pub unsafe extern "C" fn harness_plugin_create(host: *const $crate::abi::Host) -> *mut ::core::ffi::c_void {
            unsafe { $crate::__native::create::<$ty>(host) }
        }
        const _: $crate::abi::exports::Create = harness_plugin_create;

        /// Native plugin export (see `harness_strategy.h`).
        ///
        /// # Safety
        /// Called by the host as the C ABI says.
        #[unsafe(no_mangle)]
        pub unsafe extern "C" fn harness_plugin_destroy(this: *mut ::core::ffi::c_void) {
            unsafe { $crate::__native::destroy::<$ty>(this) }
        }
        const _: $crate::abi::exports::Destroy = harness_plugin_destroy;

        /// Native plugin export (see `harness_strategy.h`).
        ///
        /// # Safety
        /// Called by the host as the C ABI says.
        #[unsafe(no_mangle)]
        pub unsafe extern "C" fn harness_plugin_info(this: *mut ::core::ffi::c_void, out: *mut $crate::abi::Info) {
            unsafe { $crate::__native::info::<$ty>(this, out) }
        }
        const _: $crate::abi::exports::GetInfo = harness_plugin_info;

        /// Native plugin export (see `harness_strategy.h`).
        ///
        /// # Safety
        /// Called by the host as the C ABI says.
        #[unsafe(no_mangle)]
        pub unsafe extern "C" fn harness_plugin_configure(this: *mut ::core::ffi::c_void, toml: *const u8, len: usize) -> i32 {
            unsafe { $crate::__native::configure::<$ty>(this, toml, len) }
        }
        const _: $crate::abi::exports::Configure = harness_plugin_configure;

        /// Native plugin export (see `harness_strategy.h`).
        ///
        /// # Safety
        /// Called by the host as the C ABI says.
        #[unsafe(no_mangle)]
        pub unsafe extern "C" fn harness_plugin_last_error(this: *mut ::core::ffi::c_void, len: *mut usize) -> *const u8 {
            unsafe { $crate::__native::last_error::<$ty>(this, len) }
        }
        const _: $crate::abi::exports::LastError = harness_plugin_last_error;

        /// Native plugin export (see `harness_strategy.h`).
        ///
        /// # Safety
        /// Called by the host as the C ABI says.
        #[unsafe(no_mangle)]
        pub unsafe extern "C" fn harness_plugin_state_save(
            this: *mut ::core::ffi::c_void,
            sink: $crate::abi::Sink,
            sink_ctx: *mut ::core::ffi::c_void,
        ) -> i32 {
            unsafe { $crate::__native::state_save::<$ty>(this, sink, sink_ctx) }
        }
        const _: $crate::abi::exports::StateSave = harness_plugin_state_save;

        /// Native plugin export (see `harness_strategy.h`).
        ///
        /// # Safety
        /// Called by the host as the C ABI says.
        #[unsafe(no_mangle)]
        pub unsafe extern "C" fn harness_plugin_state_load(this: *mut ::core::ffi::c_void, data: *const u8, len: usize) -> i32 {
            unsafe { $crate::__native::state_load::<$ty>(this, data, len) }
        }
        const _: $crate::abi::exports::StateLoad = harness_plugin_state_load;
    };
}
