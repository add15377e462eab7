//! A fake host for native round-trip tests: tensors are `Vec<f32>` in a
//! table, a handful of ops, and a pretend collective where every other rank
//! holds ones.
#![allow(dead_code)]

use std::collections::HashMap;
use std::ffi::c_void;

use harness_sdk::abi::{self, Host, Op, OpArgs, OpResult};

pub struct FakeHost {
    pub tensors: HashMap<u64, (Vec<f32>, Vec<u64>)>,
    next: u64,
    pub world: u32,
    pub ops: Vec<Op>,
    pub logs: Vec<(u32, String)>,
    pub dropped: Vec<u64>,
    last_error: String,
    ints: Vec<i64>,
    data: Vec<f32>,
}

impl FakeHost {
    pub fn new(world: u32) -> Box<FakeHost> {
        Box::new(FakeHost {
            tensors: HashMap::new(),
            next: 100,
            world,
            ops: Vec::new(),
            logs: Vec::new(),
            dropped: Vec::new(),
            last_error: String::new(),
            ints: Vec::new(),
            data: Vec::new(),
        })
    }

    /// The table a plugin gets (points at `self`, which must not move).
    pub fn table(&mut self) -> Host {
        Host {
            abi_version: abi::ABI_VERSION,
            ctx: self as *mut FakeHost as *mut c_void,
            op: fake_op,
            drop_tensor: fake_drop,
            last_error: fake_last_error,
            log: fake_log,
        }
    }

    pub fn insert(&mut self, data: Vec<f32>) -> u64 {
        self.next += 1;
        let shape = vec![data.len() as u64];
        self.tensors.insert(self.next, (data, shape));
        self.next
    }

    pub fn data(&self, t: u64) -> &[f32] {
        &self.tensors[&t].0
    }

    fn get(&self, t: u64) -> Result<&(Vec<f32>, Vec<u64>), String> {
        self.tensors.get(&t).ok_or_else(|| format!("no tensor {t}"))
    }

    fn new_tensor(&mut self, data: Vec<f32>, shape: Vec<u64>, out: &mut OpResult) {
        self.next += 1;
        self.tensors.insert(self.next, (data, shape));
        out.tensors[0] = self.next;
    }

    fn run(&mut self, op: Op, args: &OpArgs, out: &mut OpResult) -> Result<(), String> {
        self.ops.push(op);
        // SAFETY: the SDK passes valid slices.
        let (tensors, floats, ints, data) = unsafe {
            (
                slice(args.tensors, args.n_tensors),
                slice(args.floats, args.n_floats),
                slice(args.ints, args.n_ints),
                slice(args.data, args.n_data),
            )
        };
        match op {
            Op::Shape => {
                self.ints = self.get(tensors[0])?.1.iter().map(|&d| d as i64).collect();
                out.ints = self.ints.as_ptr();
                out.n_ints = self.ints.len();
            }
            Op::Numel => out.scalar = self.get(tensors[0])?.0.len() as f64,
            Op::Dtype | Op::Device | Op::Rank => out.scalar = 0.0,
            Op::WorldSize => out.scalar = f64::from(self.world),
            Op::Assign => {
                let src = self.get(tensors[1])?.clone();
                let dst = self.tensors.get_mut(&tensors[0]).ok_or("no destination")?;
                if dst.1 != src.1 {
                    return Err(format!("shape {:?} != {:?}", dst.1, src.1));
                }
                dst.0 = src.0;
            }
            Op::Duplicate => {
                let (d, s) = self.get(tensors[0])?.clone();
                self.new_tensor(d, s, out);
            }
            Op::MulScalar => {
                let (d, s) = self.get(tensors[0])?.clone();
                self.new_tensor(d.iter().map(|x| (f64::from(*x) * floats[0]) as f32).collect(), s, out);
            }
            Op::Add => {
                let (a, s) = self.get(tensors[0])?.clone();
                let b = &self.get(tensors[1])?.0;
                let sum = a.iter().zip(b).map(|(x, y)| x + y).collect();
                self.new_tensor(sum, s, out);
            }
            Op::Sum => out.scalar = self.get(tensors[0])?.0.iter().map(|x| f64::from(*x)).sum(),
            Op::ReadF32 => {
                self.data = self.get(tensors[0])?.0.clone();
                out.data = self.data.as_ptr();
                out.n_data = self.data.len();
            }
            Op::FromF32 => {
                self.get(tensors[0])?;
                let shape: Vec<u64> = ints.iter().map(|&d| d as u64).collect();
                if shape.iter().product::<u64>() != data.len() as u64 {
                    return Err("data does not fit the shape".into());
                }
                self.new_tensor(data.to_vec(), shape, out);
            }
            Op::Topk => {
                let (d, _) = self.get(tensors[0])?.clone();
                let k = ints[0] as usize;
                let mut idx: Vec<usize> = (0..d.len()).collect();
                idx.sort_by(|a, b| d[*b].total_cmp(&d[*a]));
                idx.truncate(k);
                self.new_tensor(idx.iter().map(|&i| d[i]).collect(), vec![k as u64], out);
                let values = out.tensors[0];
                self.new_tensor(idx.iter().map(|&i| i as f32).collect(), vec![k as u64], out);
                out.tensors = [values, out.tensors[0]];
            }
            // Every other rank holds ones.
            Op::AllReduceSum => {
                let others = (self.world - 1) as f32;
                for x in &mut self.tensors.get_mut(&tensors[0]).ok_or("no tensor")?.0 {
                    *x += others;
                }
            }
            other => return Err(format!("the fake host does not run {}", other.wit_name())),
        }
        Ok(())
    }
}

/// `n` elements at `p`, an empty slice when `n` is 0 (whatever `p` is).
///
/// # Safety
/// Where `n` is not 0, `p` points at `n` initialised `T`s that live, unchanged,
/// as long as the slice is used.
unsafe fn slice<'a, T>(p: *const T, n: usize) -> &'a [T] {
    if n == 0 {
        &[]
    } else {
        // SAFETY: `n` is not 0, and the caller vouches for `p`'s `n` elements.
        unsafe { std::slice::from_raw_parts(p, n) }
    }
}

unsafe extern "C" fn fake_op(ctx: *mut c_void, op: u32, args: *const OpArgs, out: *mut OpResult) -> i32 {
    // SAFETY: `ctx` is the table's context, the `FakeHost` that made it
    // ([`FakeHost::table`]), which outlives the plugin and is not otherwise
    // borrowed while the plugin runs an op.
    let host = unsafe { &mut *(ctx as *mut FakeHost) };
    let result = match Op::from_code(op) {
        None => Err(format!("unknown op code {op}")),
        // SAFETY: the SDK passes an `OpArgs` and an `OpResult` of its own,
        // valid and unaliased for the call.
        Some(op) => host.run(op, unsafe { &*args }, unsafe { &mut *out }),
    };
    match result {
        Ok(()) => abi::STATUS_OK,
        Err(e) => {
            host.last_error = e;
            abi::STATUS_ERROR
        }
    }
}

unsafe extern "C" fn fake_drop(ctx: *mut c_void, t: u64) {
    // SAFETY: `ctx` is the `FakeHost` that made the table, as in `fake_op`.
    let host = unsafe { &mut *(ctx as *mut FakeHost) };
    assert!(host.tensors.remove(&t).is_some(), "dropped tensor {t} twice or never made");
    host.dropped.push(t);
}

unsafe extern "C" fn fake_last_error(ctx: *mut c_void, len: *mut usize) -> *const u8 {
    // SAFETY: `ctx` is the `FakeHost` that made the table, as in `fake_op`.
    let host = unsafe { &*(ctx as *mut FakeHost) };
    // SAFETY: the SDK passes a pointer to a `usize` of its own for the length.
    unsafe { *len = host.last_error.len() };
    host.last_error.as_ptr()
}

unsafe extern "C" fn fake_log(ctx: *mut c_void, level: u32, msg: *const u8, len: usize) {
    // SAFETY: `ctx` is the `FakeHost` that made the table, as in `fake_op`.
    let host = unsafe { &mut *(ctx as *mut FakeHost) };
    // SAFETY: the SDK passes its message's `len` bytes at `msg`, alive for the call.
    let msg = String::from_utf8(unsafe { slice(msg, len) }.to_vec()).unwrap();
    host.logs.push((level, msg));
}

/// The message `harness_plugin_last_error` returns.
pub fn message(ptr: *const u8, len: usize) -> String {
    // SAFETY: the caller passes what `harness_plugin_last_error` returned, the
    // plugin's message (`len` bytes at `ptr`), which lives until its next call.
    String::from_utf8(unsafe { slice(ptr, len) }.to_vec()).unwrap()
}
