//! Drives a compressor exported with `harness_sdk::export!` through its C
//! entry points, the way the host's native loader does, against a fake host.
#![cfg(not(target_arch = "wasm32"))]

mod common;

use std::ffi::c_void;
use std::ptr;

use common::{message, FakeHost};
use harness_sdk::abi::{self, Op};
use harness_sdk::{log, tensor, BucketInfo, Collective, Compressor, Config, Error, Plugin, Tensor};

struct TestCompressor {
    mode: String,
    calls: u64,
    residual: Option<Tensor>,
}

impl Plugin for TestCompressor {
    const NAME: &'static str = "test-compressor";
    const VERSION: &'static str = "1.2.3";

    fn configure(config: &Config) -> Result<Self, Error> {
        let mode: String = config.get_or("mode", "avg".to_owned())?;
        if mode == "reject" {
            return Err(Error::new("mode `reject`: rejected on purpose"));
        }
        if mode == "panic-configure" {
            panic!("configure panicked");
        }
        log::info(&format!("configured mode {mode}"));
        Ok(TestCompressor { mode, calls: 0, residual: None })
    }

    fn state_save(&self) -> Vec<u8> {
        self.calls.to_le_bytes().to_vec()
    }

    fn state_load(&mut self, state: &[u8]) -> Result<(), Error> {
        let bytes: [u8; 8] = state.try_into().map_err(|_| Error::new(format!("state has {} bytes, not 8", state.len())))?;
        self.calls = u64::from_le_bytes(bytes);
        Ok(())
    }
}

impl Compressor for TestCompressor {
    fn compress(&mut self, bucket: &Tensor, comm: &Collective, info: BucketInfo) -> Result<(), Error> {
        self.calls += 1;
        assert!(!bucket.is_owned());
        match self.mode.as_str() {
            "avg" => {
                comm.all_reduce_sum(bucket);
                bucket.assign(&bucket.mul_scalar(1.0 / f64::from(comm.world_size())));
            }
            "ops" => {
                // Every temporary must be released by the time we return.
                assert_eq!(bucket.shape(), vec![4]);
                assert_eq!(bucket.numel(), 4);
                let (values, indices) = bucket.topk(2);
                assert_eq!(values.read_f32(), vec![4.0, 3.0]);
                assert_eq!(indices.read_f32(), vec![3.0, 2.0]);
                let ones = tensor::from_f32(&[1.0; 4], &[4], bucket);
                bucket.assign(&bucket.add(&ones));
                assert_eq!(bucket.sum(), 14.0);
            }
            "keep" => self.residual = Some(bucket.duplicate()),
            "panic" => panic!("boom at step {}", info.step),
            "host-error" => {
                bucket.orthonormalize();
            }
            "error" => return Err(Error::new("compress refused")),
            other => unreachable!("{other}"),
        }
        Ok(())
    }
}

harness_sdk::export!(TestCompressor as compressor);

/// One plugin instance on a fake host.
struct Fixture {
    host: *mut FakeHost,
    this: *mut c_void,
}

impl Fixture {
    fn new(world: u32) -> Fixture {
        let host = Box::into_raw(FakeHost::new(world));
        // SAFETY: `host` lives until the fixture drops.
        let table = unsafe { (*host).table() };
        // SAFETY: `table` is a live host table, read during the call only.
        let this = unsafe { harness_plugin_create(&table) };
        assert!(!this.is_null());
        Fixture { host, this }
    }
    // The fake host sits behind a raw pointer that the plugin also uses.
    #[allow(clippy::mut_from_ref)]
    fn host(&self) -> &mut FakeHost {
        // SAFETY: `host` lives until the fixture drops, and the plugin uses it
        // only inside an entry point, never while the test holds this borrow.
        unsafe { &mut *self.host }
    }
    fn configure(&self, toml: &str) -> i32 {
        // SAFETY: `this` is the fixture's live instance; `toml`'s bytes outlive the call.
        unsafe { harness_plugin_configure(self.this, toml.as_ptr(), toml.len()) }
    }
    fn compress(&self, bucket: u64, step: u64) -> i32 {
        let info = abi::BucketInfo { step, index: 0, count: 1 };
        // SAFETY: `this` is the fixture's live instance; `info` outlives the call.
        unsafe { harness_compress(self.this, bucket, &info) }
    }
    fn last_error(&self) -> String {
        let mut len = 0;
        // SAFETY: `this` is the fixture's live instance; `len` outlives the call.
        let ptr = unsafe { harness_plugin_last_error(self.this, &mut len) };
        message(ptr, len)
    }
}

impl Drop for Fixture {
    fn drop(&mut self) {
        // SAFETY: the instance is destroyed once, here, and then the host it
        // used, which `Box::into_raw` made in `new` and nothing else frees.
        unsafe {
            harness_plugin_destroy(self.this);
            drop(Box::from_raw(self.host));
        }
    }
}

#[test]
fn identity() {
    assert_eq!(harness_abi_version(), abi::ABI_VERSION);
    assert_eq!(harness_plugin_kind(), abi::KIND_COMPRESSOR);
    let f = Fixture::new(1);
    let mut info = abi::Info { name: ptr::null(), name_len: 0, version: ptr::null(), version_len: 0 };
    // SAFETY: `f.this` is a live instance; `info` outlives the call.
    unsafe { harness_plugin_info(f.this, &mut info) };
    assert_eq!(message(info.name, info.name_len), "test-compressor");
    assert_eq!(message(info.version, info.version_len), "1.2.3");
}

#[test]
fn averages_the_bucket_and_releases_temporaries() {
    let f = Fixture::new(2);
    assert_eq!(f.configure(""), abi::STATUS_OK, "{}", f.last_error());
    assert_eq!(f.host().logs, vec![(1, "configured mode avg".to_owned())]);
    let bucket = f.host().insert(vec![1.0, 2.0, 3.0]);
    assert_eq!(f.compress(bucket, 0), abi::STATUS_OK, "{}", f.last_error());
    // The other rank holds ones: (x + 1) / 2.
    assert_eq!(f.host().data(bucket), &[1.0, 1.5, 2.0]);
    assert_eq!(f.host().ops, vec![Op::AllReduceSum, Op::WorldSize, Op::MulScalar, Op::Assign]);
    assert_eq!(f.host().tensors.len(), 1, "the mul-scalar temporary was not released");
    assert_eq!(f.host().dropped.len(), 1);
}

#[test]
fn more_ops_round_trip() {
    let f = Fixture::new(1);
    assert_eq!(f.configure("mode = \"ops\""), abi::STATUS_OK);
    let bucket = f.host().insert(vec![1.0, 2.0, 3.0, 4.0]);
    assert_eq!(f.compress(bucket, 0), abi::STATUS_OK, "{}", f.last_error());
    assert_eq!(f.host().data(bucket), &[2.0, 3.0, 4.0, 5.0]);
    assert_eq!(f.host().tensors.len(), 1, "temporaries leaked: {:?}", f.host().tensors.keys());
}

#[test]
fn calls_before_configure_fail() {
    let f = Fixture::new(1);
    let bucket = f.host().insert(vec![1.0]);
    assert_eq!(f.compress(bucket, 0), abi::STATUS_ERROR);
    assert_eq!(f.last_error(), "called before a successful configure");
}

#[test]
fn a_configure_error_is_status_error_with_its_message() {
    let f = Fixture::new(1);
    assert_eq!(f.configure("mode = \"reject\""), abi::STATUS_ERROR);
    assert_eq!(f.last_error(), "mode `reject`: rejected on purpose");
    assert_eq!(f.configure("mode = "), abi::STATUS_ERROR);
    assert!(f.last_error().starts_with("config is not valid TOML"), "{}", f.last_error());
    assert_eq!(f.configure("mode = 3"), abi::STATUS_ERROR);
    assert!(f.last_error().starts_with("config key `mode`"), "{}", f.last_error());
    let bad_utf8 = [0xffu8, 0xfe];
    // SAFETY: `f.this` is a live instance; `bad_utf8`'s 2 bytes outlive the call.
    assert_eq!(unsafe { harness_plugin_configure(f.this, bad_utf8.as_ptr(), 2) }, abi::STATUS_ERROR);
    assert!(f.last_error().contains("not UTF-8"));
    // A later good configure works, and clears the message.
    assert_eq!(f.configure(""), abi::STATUS_OK);
    assert_eq!(f.last_error(), "");
}

#[test]
fn a_panic_is_status_panic_with_its_message() {
    let f = Fixture::new(1);
    assert_eq!(f.configure("mode = \"panic\""), abi::STATUS_OK);
    let bucket = f.host().insert(vec![1.0]);
    assert_eq!(f.compress(bucket, 7), abi::STATUS_PANIC);
    assert_eq!(f.last_error(), "boom at step 7");
    // The instance stays usable (the host decides what happens next).
    assert_eq!(f.compress(bucket, 8), abi::STATUS_PANIC);
    assert_eq!(f.last_error(), "boom at step 8");

    let g = Fixture::new(1);
    assert_eq!(g.configure("mode = \"panic-configure\""), abi::STATUS_PANIC);
    assert_eq!(g.last_error(), "configure panicked");
}

#[test]
fn a_failed_host_op_panics_naming_the_op_and_the_hosts_message() {
    let f = Fixture::new(1);
    assert_eq!(f.configure("mode = \"host-error\""), abi::STATUS_OK);
    let bucket = f.host().insert(vec![1.0]);
    assert_eq!(f.compress(bucket, 0), abi::STATUS_PANIC);
    assert_eq!(f.last_error(), "host op tensor.orthonormalize failed: the fake host does not run tensor.orthonormalize");
}

#[test]
fn a_plugin_error_is_status_error() {
    let f = Fixture::new(1);
    assert_eq!(f.configure("mode = \"error\""), abi::STATUS_OK);
    let bucket = f.host().insert(vec![1.0]);
    assert_eq!(f.compress(bucket, 0), abi::STATUS_ERROR);
    assert_eq!(f.last_error(), "compress refused");
    // SAFETY: `f.this` is a live instance; a null bucket info is what is tested.
    assert_eq!(unsafe { harness_compress(f.this, bucket, ptr::null()) }, abi::STATUS_ERROR);
    assert_eq!(f.last_error(), "the bucket info is null");
}

unsafe extern "C" fn collect(ctx: *mut c_void, data: *const u8, len: usize) {
    // SAFETY: `ctx` is the `Vec<u8>` the test passed to `harness_plugin_state_save`,
    // borrowed by nothing else during the call.
    let out = unsafe { &mut *(ctx as *mut Vec<u8>) };
    // SAFETY: the plugin passes `len` bytes at `data`, alive for the call.
    out.extend_from_slice(unsafe { std::slice::from_raw_parts(data, len) });
}

#[test]
fn state_round_trips() {
    let f = Fixture::new(2);
    assert_eq!(f.configure(""), abi::STATUS_OK);
    let bucket = f.host().insert(vec![1.0]);
    for step in 0..3 {
        assert_eq!(f.compress(bucket, step), abi::STATUS_OK);
    }
    let mut saved = Vec::new();
    // SAFETY: `f.this` is a live instance; `saved` outlives the call.
    assert_eq!(unsafe { harness_plugin_state_save(f.this, collect, &mut saved as *mut Vec<u8> as *mut c_void) }, abi::STATUS_OK);
    assert_eq!(saved, 3u64.to_le_bytes());

    let g = Fixture::new(2);
    assert_eq!(g.configure(""), abi::STATUS_OK);
    // SAFETY: `g.this` is a live instance; `saved`'s bytes outlive the call.
    assert_eq!(unsafe { harness_plugin_state_load(g.this, saved.as_ptr(), saved.len()) }, abi::STATUS_OK);
    let mut again = Vec::new();
    // SAFETY: `g.this` is a live instance; `again` outlives the call.
    assert_eq!(unsafe { harness_plugin_state_save(g.this, collect, &mut again as *mut Vec<u8> as *mut c_void) }, abi::STATUS_OK);
    assert_eq!(again, saved);
    // SAFETY: `g.this` is a live instance; `saved` has (more than) 3 bytes.
    assert_eq!(unsafe { harness_plugin_state_load(g.this, saved.as_ptr(), 3) }, abi::STATUS_ERROR);
    assert_eq!(g.last_error(), "state has 3 bytes, not 8");
}

#[test]
fn destroy_releases_the_tensors_the_plugin_owns() {
    let f = Fixture::new(1);
    assert_eq!(f.configure("mode = \"keep\""), abi::STATUS_OK);
    let bucket = f.host().insert(vec![1.0, 2.0]);
    assert_eq!(f.compress(bucket, 0), abi::STATUS_OK);
    assert_eq!(f.host().tensors.len(), 2, "the residual is kept");
    // Configure again: the old plugin (and its residual) goes.
    assert_eq!(f.configure("mode = \"keep\""), abi::STATUS_OK);
    assert_eq!(f.host().tensors.len(), 1);
    assert_eq!(f.compress(bucket, 1), abi::STATUS_OK);
    // SAFETY: `f.this` is a live instance, destroyed once: the fixture is
    // forgotten below, so its drop does not destroy it again.
    unsafe { harness_plugin_destroy(f.this) };
    assert_eq!(f.host().tensors.len(), 1, "destroy did not release the residual");
    std::mem::forget(f); // destroyed already; the fake host leaks, fine in a test
}

#[test]
fn create_refuses_another_abi_version() {
    let mut host = FakeHost::new(1);
    let mut table = host.table();
    table.abi_version = 999;
    // SAFETY: `table` is a live host table, read during the call only.
    let this = unsafe { harness_plugin_create(&table) };
    assert!(this.is_null());
    let mut len = 0;
    // SAFETY: the null instance asks for the process's last error; `len` outlives the call.
    let msg = message(unsafe { harness_plugin_last_error(ptr::null_mut(), &mut len) }, len);
    assert!(msg.contains("999") && msg.contains(&abi::ABI_VERSION.to_string()), "{msg}");
    // SAFETY: a null table is what is tested; the entry point refuses it.
    assert!(unsafe { harness_plugin_create(ptr::null()) }.is_null());
}
