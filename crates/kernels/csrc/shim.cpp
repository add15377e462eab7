// The libtorch entry points that tch 0.24 does not wrap. Each function takes
// tch's tensor handles (`at::Tensor*`), catches every C++ exception and
// returns it as a heap string (NULL on success) that Rust frees with
// hx_free_error. Nothing here synchronises the device.
#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/csrc/autograd/profiler_kineto.h>
#include <ATen/record_function.h>
#include <c10/core/CachingDeviceAllocator.h>
#include <c10/core/Event.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <optional>
#include <vector>

typedef at::Tensor *tensor;

static char *hx_err(const char *msg) { return strdup(msg); }

#define HX_TRY(body)                                                           \
  try {                                                                        \
    body;                                                                      \
    return nullptr;                                                            \
  } catch (const std::exception &e) {                                          \
    return hx_err(e.what());                                                   \
  } catch (...) {                                                              \
    return hx_err("unknown C++ exception");                                    \
  }

static std::vector<at::Tensor> hx_list(tensor *ts, int n) {
  std::vector<at::Tensor> out;
  out.reserve(n);
  for (int i = 0; i < n; i++) out.push_back(*ts[i]);
  return out;
}

static at::DeviceType hx_device_type(int device_type) {
  return device_type == 1 ? at::kCUDA : at::kCPU;
}

extern "C" {

void hx_free_error(char *err) { free(err); }

// Turns autocast on or off for one device type with the given compute dtype
// (a c10::ScalarType code: 5 = Half, 15 = BFloat16), as torch.autocast does.
char *hx_autocast_set(int device_type, int enabled, int dtype) {
  HX_TRY({
    auto dt = hx_device_type(device_type);
    at::autocast::set_autocast_dtype(dt, static_cast<at::ScalarType>(dtype));
    at::autocast::set_autocast_enabled(dt, enabled != 0);
    at::autocast::clear_cache();
  })
}

// Turns autocast on or off for a device type, its dtype and cache kept (the
// training step turns it off around the backward pass, as torch.autocast's
// context covers only the forward pass).
char *hx_autocast_enable(int device_type, int enabled) {
  HX_TRY(at::autocast::set_autocast_enabled(hx_device_type(device_type), enabled != 0))
}

// Clears the cast-weight cache that autocast keeps inside one forward pass.
// torch.autocast does this when its context exits; with autocast left on for
// a whole run the caller must do it after every forward, or the next forward
// would reuse bf16 copies of weights the optimizer has since updated.
char *hx_autocast_clear_cache() { HX_TRY(at::autocast::clear_cache()) }

// Backpropagates a given gradient from a non-scalar tensor: out.backward(grad).
char *hx_backward(tensor out, tensor grad) { HX_TRY(out->backward(*grad)) }

// Sets every tensor's .grad to None (set_to_none=True in PyTorch), so the next
// backward pass writes fresh gradients instead of adding into zeros.
char *hx_grads_to_none(tensor *params, int n) {
  HX_TRY({
    for (int i = 0; i < n; i++) params[i]->mutable_grad().reset();
  })
}

// Makes grad the .grad of param, as `param.grad = grad` in Python: the same
// tensor, not a copy, so a view into a larger buffer stays one. Backward
// passes run with grad mode off then add into it in place (AccumulateGrad),
// so gradients land in the buffer. A NULL grad resets .grad to None.
char *hx_set_grad(tensor param, tensor grad) {
  HX_TRY({
    if (grad == nullptr) {
      param->mutable_grad().reset();
    } else {
      TORCH_CHECK(grad->sizes() == param->sizes(), "set_grad: gradient of shape ", grad->sizes(),
                  " for a parameter of shape ", param->sizes());
      TORCH_CHECK(grad->scalar_type() == param->scalar_type() && grad->device() == param->device(),
                  "set_grad: gradient of type ", grad->toString(), " on ", grad->device(),
                  " for a parameter of type ", param->toString(), " on ", param->device());
      param->mutable_grad() = *grad;
    }
  })
}

// Fills out[i] with params[i].grad (an undefined tensor where there is none).
char *hx_grads(tensor *params, int n, tensor *out) {
  HX_TRY({
    for (int i = 0; i < n; i++) out[i] = new at::Tensor(params[i]->grad());
  })
}

// Total 2-norm of the gradients, one multi-tensor pass, no host sync. If
// max_norm > 0 the gradients are scaled by min(1, max_norm / (norm + 1e-6)),
// as torch.nn.utils.clip_grad_norm_ does. Writes the norm (a 0-d float32
// tensor on the gradients' device) to *norm_out.
char *hx_clip_grad_norm(tensor *grads, int n, double max_norm, tensor *norm_out) {
  HX_TRY({
    auto gs = hx_list(grads, n);
    auto norms = at::_foreach_norm(gs, 2);
    auto total = at::linalg_vector_norm(at::stack(norms).to(at::kFloat), 2);
    if (max_norm > 0) {
      auto coef = at::clamp_max(max_norm / (total + 1e-6), 1.0);
      at::_foreach_mul_(gs, coef);
    }
    *norm_out = new at::Tensor(total);
  })
}

// Unscales gradients in place by inv_scale and sets found_inf to 1 when any
// element is inf or NaN (the first half of torch.amp.GradScaler.step).
char *hx_unscale_check(tensor *grads, int n, tensor found_inf, tensor inv_scale) {
  HX_TRY({
    auto gs = hx_list(grads, n);
    at::_amp_foreach_non_finite_check_and_unscale_(gs, *found_inf, *inv_scale);
  })
}

// One AdamW step over all parameters with the fused multi-tensor kernel that
// torch.optim.AdamW(fused=True) uses. found_inf may be NULL; when it is
// nonzero the kernel skips the step (fp16 loss scaling). grad_scale may be
// NULL; else the kernel divides each gradient by it as it reads it (and
// writes the quotient back).
//
// lr_t may be NULL; else the learning rate is read from it (a float scalar on
// the parameters' device) when the kernel runs, not fixed when it is queued:
// the overload a captured CUDA graph needs, as the schedule changes lr.
char *hx_fused_adamw(tensor *params, tensor *grads, tensor *exp_avg, tensor *exp_avg_sq,
                     tensor *steps, int n, double lr, tensor lr_t, double beta1, double beta2,
                     double weight_decay, double eps, tensor found_inf, tensor grad_scale) {
  HX_TRY({
    std::optional<at::Tensor> fi;
    std::optional<at::Tensor> gs;
    if (found_inf) fi = *found_inf;
    if (grad_scale) gs = *grad_scale;
    auto st = hx_list(steps, n);
    // As torch.optim's _fused_adamw: the kernel reads the already-incremented
    // step count; a skipped (overflowed) step takes the increment back.
    at::_foreach_add_(st, 1);
    // The two overloads differ only in the learning rate's type.
    auto step = [&](const auto &rate) {
      at::_fused_adamw_(hx_list(params, n), hx_list(grads, n), hx_list(exp_avg, n),
                        hx_list(exp_avg_sq, n), {}, st, rate, beta1, beta2,
                        weight_decay, eps, false, false, gs, fi);
    };
    if (lr_t) {
      step(*lr_t);
    } else {
      step(lr);
    }
    if (found_inf) at::_foreach_sub_(st, std::vector<at::Tensor>(st.size(), *found_inf));
  })
}

// A pinned (page-locked) copy of a CPU tensor, from libtorch's caching host
// allocator. tch's pin_memory passes the deprecated device argument, which
// makes libtorch print a warning on every call.
char *hx_pin_memory(tensor t, tensor *out) { HX_TRY(*out = new at::Tensor(t->pin_memory())) }

// A hash of each tensor's bytes (int64, stacked): a fingerprint of a
// replica's parameters that replicas compare. The bytes are read as words
// of the element's width (int32 for f32, int16 for f16 and bf16), sign
// extended to int64, and summed, wrapping, with a weight for each position:
// the word at row r, column c of rows of HASH_ROW words weighs
// row[r] * col[c], odd numbers from a fixed splitmix64 sequence (the same
// on every rank). Any change of a word changes the hash unless the
// weighted differences cancel modulo 2^64 (about one chance in 2^32 for a
// sign flipped in a slice, whatever its signs); norms, in contrast, do not
// see a sign. Each tensor costs a few kernels over its words, in chunks of
// HASH_CHUNK_ROWS rows (int64 intermediates of 32 MiB at most).
static const int64_t HASH_ROW = 1024;
static const int64_t HASH_CHUNK_ROWS = 4096;

static uint64_t hx_splitmix(uint64_t &state) {
  uint64_t z = (state += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

// n odd weights from the splitmix64 sequence seeded with `seed`, on `device`.
static at::Tensor hx_hash_weights(int64_t n, uint64_t seed, const at::Device &device) {
  auto w = at::empty({n}, at::kLong);
  auto *p = w.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; i++) p[i] = static_cast<int64_t>(hx_splitmix(seed) | 1);
  return w.to(device);
}

static at::ScalarType hx_word_type(int64_t width) {
  switch (width) {
    case 8: return at::kLong;
    case 4: return at::kInt;
    case 2: return at::kShort;
    default: return at::kChar;
  }
}

static at::Tensor hx_hashes(const std::vector<at::Tensor> &ps) {
  {
    at::NoGradGuard no_grad;
    std::vector<at::Tensor> hashes;
    int64_t max_rows = 1;
    for (auto &p : ps) max_rows = std::max(max_rows, p.numel() / HASH_ROW + 1);
    at::Tensor col, row;
    for (auto &p : ps) {
      if (!col.defined() || col.device() != p.device()) {
        col = hx_hash_weights(HASH_ROW, 1, p.device());
        row = hx_hash_weights(max_rows, 2, p.device());
      }
      auto words = p.detach().reshape({-1}).view(hx_word_type(p.element_size()));
      const int64_t len = words.numel(), rows = len / HASH_ROW, tail = len % HASH_ROW;
      auto sums = at::empty({rows + (tail > 0 ? 1 : 0)}, words.options().dtype(at::kLong));
      for (int64_t r0 = 0; r0 < rows; r0 += HASH_CHUNK_ROWS) {
        const int64_t r = std::min(HASH_CHUNK_ROWS, rows - r0);
        auto x = words.narrow(0, r0 * HASH_ROW, r * HASH_ROW).view({r, HASH_ROW}).to(at::kLong);
        x.mul_(col);
        auto part = sums.narrow(0, r0, r);
        at::sum_out(part, x, {1});
      }
      if (tail > 0) {
        auto x = words.narrow(0, rows * HASH_ROW, tail).to(at::kLong);
        x.mul_(col.narrow(0, 0, tail));
        auto part = sums.narrow(0, rows, 1);
        at::sum_out(part, x, {0}, true);
      }
      hashes.push_back(sums.mul_(row.narrow(0, 0, sums.numel())).sum().reshape({1}));
    }
    return hashes.empty() ? at::empty({0}, at::kLong) : at::cat(hashes, 0);
  }
}

char *hx_param_hashes(tensor *params, int n, tensor *out) { HX_TRY(*out = new at::Tensor(hx_hashes(hx_list(params, n)))) }

// The storage a tensor keeps alive: its size in bytes and an identity (the
// storage's address) to count storages shared by views once.
char *hx_storage_info(tensor t, uint64_t *nbytes, uint64_t *key) {
  HX_TRY({
    if (t->has_storage()) {
      const auto &st = t->storage();
      *nbytes = st.nbytes();
      *key = reinterpret_cast<uint64_t>(st.unsafeGetStorageImpl());
    } else {
      *nbytes = t->numel() * t->element_size();
      *key = reinterpret_cast<uint64_t>(t->unsafeGetTensorImpl());
    }
  })
}

// Gives the CUDA caching allocator's unused cached blocks back to the driver
// (torch.cuda.empty_cache()); blocks of captured graphs' pools stay. Waits
// for the device.
char *hx_cuda_empty_cache() { HX_TRY(c10::getDeviceAllocator(at::kCUDA)->emptyCache()) }

// The CUDA caching allocator's statistics for one device, in bytes:
// out = {allocated now, allocated peak, reserved now, reserved peak}.
char *hx_cuda_memory(int device, int64_t *out) {
  HX_TRY({
    auto *alloc = c10::getDeviceAllocator(at::kCUDA);
    auto stats = alloc->getDeviceStats(static_cast<c10::DeviceIndex>(device));
    auto agg = static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE);
    out[0] = stats.allocated_bytes[agg].current;
    out[1] = stats.allocated_bytes[agg].peak;
    out[2] = stats.reserved_bytes[agg].current;
    out[3] = stats.reserved_bytes[agg].peak;
  })
}

// Resets the peaks that hx_cuda_memory reports.
char *hx_cuda_reset_peak(int device) {
  HX_TRY(c10::getDeviceAllocator(at::kCUDA)->resetPeakStats(static_cast<c10::DeviceIndex>(device)))
}

// Seeded random numbers for plugins from a private generator (a clone of the
// device's default generator, then reseeded), so the same seed gives the same
// numbers and training's own random stream is left alone. kind: 0 uniform
// [0, 1) f32, 1 standard normal f32, 2 a random permutation of sizes[0] (i64).
char *hx_rand_seeded(int kind, const int64_t *sizes, int ndim, uint64_t seed, int device_type, int device_index, tensor *out) {
  HX_TRY({
    at::Device dev(hx_device_type(device_type), static_cast<c10::DeviceIndex>(device_type == 1 ? device_index : -1));
    at::Generator gen = at::globalContext().defaultGenerator(dev).clone();
    {
      std::lock_guard<std::mutex> lock(gen.mutex());
      gen.set_current_seed(seed);
    }
    auto opts = at::TensorOptions().device(dev);
    at::IntArrayRef sz(sizes, ndim);
    at::Tensor t;
    if (kind == 0) t = at::rand(sz, gen, opts.dtype(at::kFloat));
    else if (kind == 1) t = at::randn(sz, gen, opts.dtype(at::kFloat));
    else t = at::randperm(sizes[0], gen, opts.dtype(at::kLong));
    *out = new at::Tensor(t);
  })
}

// Calls cb(ctx, idx) each time autograd has accumulated a gradient into the
// leaf `param` (a post-accumulate-grad hook, as PyTorch's
// register_post_accumulate_grad_hook). It runs on the autograd engine's
// thread for the parameter's device. cb == NULL removes the hook.
struct HxGradReady : torch::autograd::PostAccumulateGradHook {
  void (*cb)(void *, int64_t);
  void *ctx;
  int64_t idx;
  HxGradReady(void (*cb_)(void *, int64_t), void *ctx_, int64_t idx_) : cb(cb_), ctx(ctx_), idx(idx_) {}
  void operator()(const torch::autograd::Variable &) override { cb(ctx, idx); }
};

char *hx_set_grad_ready_hook(tensor param, void (*cb)(void *, int64_t), void *ctx, int64_t idx) {
  HX_TRY({
    if (cb) {
      torch::autograd::impl::set_post_acc_grad_hooks(*param, std::make_unique<HxGradReady>(cb, ctx, idx));
    } else {
      torch::autograd::impl::set_post_acc_grad_hooks(*param, nullptr);
    }
  })
}

// Calls cb(ctx, idx) each time a backward pass hands autograd a gradient for
// the leaf `param`, before autograd accumulates it (a tensor hook, as
// PyTorch's register_hook); a layer that adds into the parameter's gradient
// itself hands none, and the hook stays silent. *handle: the hook's number,
// for hx_remove_hook.
char *hx_set_grad_arrival_hook(tensor param, void (*cb)(void *, int64_t), void *ctx, int64_t idx, int64_t *handle) {
  HX_TRY({
    *handle = static_cast<int64_t>(param->register_hook([cb, ctx, idx](const at::Tensor &g) {
      if (g.defined()) cb(ctx, idx);
    }));
  })
}

// Removes the tensor hook numbered `handle` from `param`.
char *hx_remove_hook(tensor param, int64_t handle) { HX_TRY(param->remove_hook(static_cast<unsigned>(handle))) }

}  // extern "C"

// The state of libtorch's default generator of a device (device < 0: the CPU
// one), as a uint8 tensor: what dropout and torch.rand draw from.
static at::Generator hx_generator(int device) {
  return device < 0 ? at::detail::getDefaultCPUGenerator()
                    : at::globalContext().defaultGenerator(at::Device(at::kCUDA, device));
}

extern "C" {

char *hx_rng_get_state(int device, tensor *out) {
  HX_TRY({
    auto gen = hx_generator(device);
    std::lock_guard<std::mutex> lock(gen.mutex());
    *out = new at::Tensor(gen.get_state());
  })
}

char *hx_rng_set_state(int device, tensor state) {
  HX_TRY({
    auto gen = hx_generator(device);
    std::lock_guard<std::mutex> lock(gen.mutex());
    gen.set_state(*state);
  })
}


// Copies src[i] into dst[i] without waiting: a device-to-host copy into
// pinned memory is queued on the current stream and the call returns; the
// data is there once an event recorded after it (hx_event_record) completes.
char *hx_copy_nonblocking(tensor *dst, tensor *src, int n) {
  HX_TRY({
    for (int i = 0; i < n; i++) dst[i]->copy_(*src[i], /*non_blocking=*/true);
  })
}

// An event recorded on the current stream of CUDA device `device`: it
// completes when everything queued there so far has run.
char *hx_event_record(int device, void **out) {
  HX_TRY({
    auto *ev = new c10::Event(c10::DeviceType::CUDA);
    c10::Device dev(c10::DeviceType::CUDA, static_cast<c10::DeviceIndex>(device));
    ev->record(c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA)->getStream(dev));
    *out = ev;
  })
}

// Waits, on the calling thread, until the event completed.
char *hx_event_synchronize(void *ev) { HX_TRY(static_cast<c10::Event *>(ev)->synchronize()) }

void hx_event_free(void *ev) { delete static_cast<c10::Event *>(ev); }

}  // extern "C"

// Activation recomputation, as torch.utils.checkpoint's reentrant variant
// does it: the forward pass of a block runs without recording a graph and
// keeps only its input; the backward pass runs the block again with the
// graph recorded (same autocast state, same random numbers) and
// back-propagates through it, accumulating the parameters' gradients as a
// plain backward pass would.
//
// The block is a Rust closure behind `ctx`: `run(ctx, in, &out, err, len)`
// takes ownership of the tensor `in` and sets `*out` to a new tensor, or
// leaves it NULL and writes a message into `err`. `drop(ctx)` frees the
// closure once the graph no longer needs it.
typedef void (*hx_block_fn)(void *ctx, tensor in, tensor *out, char *err, size_t err_len);
typedef void (*hx_block_drop)(void *ctx);

struct HxBlock : torch::CustomClassHolder {
  hx_block_fn run;
  hx_block_drop drop;
  void *ctx;
  bool autocast;
  at::ScalarType autocast_dtype;
  at::DeviceType device_type;
  bool rng;  // restore the random state of the forward pass (dropout)
  at::Tensor cpu_rng, cuda_rng;
  int cuda_index = -1;
  HxBlock(hx_block_fn r, hx_block_drop d, void *c) : run(r), drop(d), ctx(c) {}
  ~HxBlock() override {
    if (drop) drop(ctx);
  }
  at::Tensor call(const at::Tensor &x) {
    char err[2048];
    err[0] = 0;
    tensor out = nullptr;
    run(ctx, new at::Tensor(x), &out, err, sizeof err);
    if (!out) throw std::runtime_error(err[0] ? err : "the recomputed block failed");
    at::Tensor y = *out;
    delete out;
    return y;
  }
};

static void hx_swap_rng(HxBlock &b, at::Tensor &cpu, at::Tensor &cuda) {
  // Sets the generators to (cpu, cuda) and hands back their former states.
  auto swap = [](at::Generator gen, at::Tensor &state) {
    std::lock_guard<std::mutex> lock(gen.mutex());
    at::Tensor old = gen.get_state();
    gen.set_state(state);
    state = old;
  };
  swap(hx_generator(-1), cpu);
  if (b.cuda_index >= 0) swap(hx_generator(b.cuda_index), cuda);
}

struct HxRecompute : torch::autograd::Function<HxRecompute> {
  static at::Tensor forward(torch::autograd::AutogradContext *ctx, const at::Tensor &x, c10::intrusive_ptr<HxBlock> block) {
    ctx->save_for_backward({x});
    ctx->saved_data["block"] = c10::IValue::make_capsule(block);
    return block->call(x);
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext *ctx, torch::autograd::variable_list grads) {
    auto block = c10::static_intrusive_pointer_cast<HxBlock>(ctx->saved_data["block"].toCapsule());
    at::Tensor x = ctx->get_saved_variables()[0].detach();
    x.requires_grad_(true);
    at::Tensor y;
    {
      at::AutoGradMode grad_on(true);
      bool was = at::autocast::is_autocast_enabled(block->device_type);
      at::ScalarType was_dtype = at::autocast::get_autocast_dtype(block->device_type);
      at::autocast::set_autocast_enabled(block->device_type, block->autocast);
      at::autocast::set_autocast_dtype(block->device_type, block->autocast_dtype);
      at::Tensor cpu = block->cpu_rng, cuda = block->cuda_rng;
      if (block->rng) hx_swap_rng(*block, cpu, cuda);
      auto restore = [&] {
        if (block->rng) hx_swap_rng(*block, cpu, cuda);
        at::autocast::set_autocast_enabled(block->device_type, was);
        at::autocast::set_autocast_dtype(block->device_type, was_dtype);
        if (block->autocast) at::autocast::clear_cache();
      };
      try {
        y = block->call(x);
      } catch (...) {
        restore();
        throw;
      }
      restore();
    }
    torch::autograd::backward({y}, {grads[0]});
    return {x.grad(), at::Tensor()};
  }
};

extern "C" {

// y = block(x), recomputed in the backward pass (see HxBlock). With grad
// mode off, or no block, the block just runs. `rng`: restore the random
// state (the block draws random numbers: dropout).
char *hx_recompute(tensor x, hx_block_fn run, hx_block_drop drop, void *ctx, int rng, tensor *out) {
  auto block = c10::make_intrusive<HxBlock>(run, drop, ctx);
  HX_TRY({
    if (!at::GradMode::is_enabled()) {
      *out = new at::Tensor(block->call(*x));
      return nullptr;
    }
    at::DeviceType dt = x->device().type();
    block->device_type = dt;
    block->autocast = at::autocast::is_autocast_enabled(dt);
    block->autocast_dtype = at::autocast::get_autocast_dtype(dt);
    block->rng = rng != 0;
    if (block->rng) {
      auto state = [](at::Generator gen) {
        std::lock_guard<std::mutex> lock(gen.mutex());
        return gen.get_state();
      };
      block->cpu_rng = state(hx_generator(-1));
      if (dt == at::kCUDA) {
        block->cuda_index = x->device().index();
        block->cuda_rng = state(hx_generator(block->cuda_index));
      }
    }
    // A block whose input needs no gradient (the encoder's first layer
    // reads the data) still has parameters that do: give the function an
    // input that requires grad, or autograd would not record it.
    at::Tensor in = x->requires_grad() ? *x : x->detach().requires_grad_(true);
    *out = new at::Tensor(HxRecompute::apply(in, block));
  })
}

}  // extern "C"

// A differentiable operation whose forward and backward passes are Rust
// callbacks (the fused kernels of kernels/): `fwd(ctx, in, n_in, out,
// &n_out, saved, &n_saved, err, len)` reads the inputs and sets up to
// HX_OP_MAX outputs and tensors to keep for the backward pass; `bwd(ctx,
// saved, n_saved, grads, n_grads, in_grads, n_in, err, len)` gets the
// outputs' gradients (NULL where none flowed) and sets the inputs'
// (NULL for none). Every tensor handed across is a new at::Tensor that the
// receiver owns. The kept tensors go through save_for_backward, so an output
// kept for the backward pass makes no reference cycle.
#define HX_OP_MAX 8
typedef void (*hx_op_fwd)(void *ctx, tensor *in, int n_in, tensor *out, int *n_out, tensor *saved, int *n_saved, char *err,
                          size_t err_len);
typedef void (*hx_op_bwd)(void *ctx, tensor *saved, int n_saved, tensor *grads, int n_grads, tensor *in_grads, int n_in,
                          char *err, size_t err_len);

struct HxOp : torch::CustomClassHolder {
  hx_op_fwd fwd;
  hx_op_bwd bwd;
  hx_block_drop drop;
  void *ctx;
  HxOp(hx_op_fwd f, hx_op_bwd b, hx_block_drop d, void *c) : fwd(f), bwd(b), drop(d), ctx(c) {}
  ~HxOp() override {
    if (drop) drop(ctx);
  }
};

static void hx_take(tensor *ts, int n, std::vector<at::Tensor> &out) {
  for (int i = 0; i < n; i++) {
    out.push_back(ts[i] ? *ts[i] : at::Tensor());
    delete ts[i];
  }
}

static std::vector<at::Tensor> hx_op_forward(HxOp &op, at::TensorList in, std::vector<at::Tensor> &saved) {
  std::vector<tensor> ins;
  for (const auto &t : in) ins.push_back(new at::Tensor(t));
  tensor outs[HX_OP_MAX] = {nullptr}, keep[HX_OP_MAX] = {nullptr};
  int n_out = 0, n_keep = 0;
  char err[2048];
  err[0] = 0;
  op.fwd(op.ctx, ins.data(), (int)ins.size(), outs, &n_out, keep, &n_keep, err, sizeof err);
  std::vector<at::Tensor> result;
  hx_take(outs, n_out, result);
  hx_take(keep, n_keep, saved);
  if (err[0] || n_out == 0) throw std::runtime_error(err[0] ? err : "a fused operation returned nothing");
  return result;
}

struct HxCustom : torch::autograd::Function<HxCustom> {
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext *ctx, at::TensorList in,
                                                c10::intrusive_ptr<HxOp> op) {
    std::vector<at::Tensor> saved;
    auto out = hx_op_forward(*op, in, saved);
    ctx->set_materialize_grads(false);
    ctx->save_for_backward(saved);
    ctx->saved_data["op"] = c10::IValue::make_capsule(op);
    ctx->saved_data["n_in"] = (int64_t)in.size();
    return out;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext *ctx, torch::autograd::variable_list grads) {
    auto op = c10::static_intrusive_pointer_cast<HxOp>(ctx->saved_data["op"].toCapsule());
    int n_in = (int)ctx->saved_data["n_in"].toInt();
    auto saved = ctx->get_saved_variables();
    std::vector<tensor> s, g;
    for (const auto &t : saved) s.push_back(new at::Tensor(t));
    for (const auto &t : grads) g.push_back(t.defined() ? new at::Tensor(t) : nullptr);
    std::vector<tensor> in_grads(n_in, nullptr);
    char err[2048];
    err[0] = 0;
    op->bwd(op->ctx, s.data(), (int)s.size(), g.data(), (int)g.size(), in_grads.data(), n_in, err, sizeof err);
    std::vector<at::Tensor> result;
    hx_take(in_grads.data(), n_in, result);
    if (err[0]) throw std::runtime_error(err);
    result.push_back(at::Tensor());  // the op itself
    return result;
  }
};

extern "C" {

// outs = op(in) (see HxOp); without grad mode the forward callback just runs.
// Takes ownership of ctx (freed through drop, also on failure).
char *hx_custom_op(tensor *in, int n_in, hx_op_fwd fwd, hx_op_bwd bwd, hx_block_drop drop, void *ctx, tensor *out,
                   int *n_out) {
  auto op = c10::make_intrusive<HxOp>(fwd, bwd, drop, ctx);
  HX_TRY({
    std::vector<at::Tensor> ins = hx_list(in, n_in);
    std::vector<at::Tensor> result;
    if (!at::GradMode::is_enabled()) {
      std::vector<at::Tensor> saved;
      result = hx_op_forward(*op, ins, saved);
    } else {
      result = HxCustom::apply(at::TensorList(ins), op);
    }
    *n_out = (int)result.size();
    for (size_t i = 0; i < result.size() && i < HX_OP_MAX; i++) out[i] = new at::Tensor(result[i]);
  })
}

}  // extern "C"

// The profiler behind `harness run --trace`: libtorch's Kineto profiler, as
// torch.profiler drives it, recording operators on the CPU and, with
// `cuda`, kernels and memory copies through CUPTI. Ranges name what
// harness does (phases, plugin calls) on the same timeline.
namespace {
struct HxRange {
  std::string name;
  at::RecordFunction rf{at::RecordScope::USER_SCOPE};
  explicit HxRange(const char *n) : name(n) {
    if (rf.isActive()) {
      rf.before(std::string_view(name), c10::ArrayRef<const c10::IValue>{});
    }
  }
};
}  // namespace

extern "C" {

char *hx_profiler_start(int cuda) {
  HX_TRY({
    using namespace torch::profiler::impl;
    ProfilerConfig cfg(ProfilerState::KINETO, /*report_input_shapes=*/true);
    std::set<ActivityType> acts{ActivityType::CPU};
    if (cuda) {
      acts.insert(ActivityType::CUDA);
    }
    torch::autograd::profiler::prepareProfiler(cfg, acts);
    torch::autograd::profiler::enableProfiler(cfg, acts);
  })
}

// Stops the profiler and writes its Chrome trace (JSON) to `path`.
char *hx_profiler_stop(const char *path) {
  HX_TRY({
    auto result = torch::autograd::profiler::disableProfiler();
    if (result) {
      result->save(path);
    }
  })
}

// A named range on the trace's timeline, ended by hx_range_pop on the same
// thread. Costs an allocation; harness opens ranges only while tracing.
void *hx_range_push(const char *name) {
  try {
    return new HxRange(name);
  } catch (...) {
    return nullptr;
  }
}

void hx_range_pop(void *range) { delete static_cast<HxRange *>(range); }

}  // extern "C"

// CUDA graphs of the training step, and libtorch's current CUDA stream (the
// stream harness's own kernels launch on, so that they join a capture).
// Built when libtorch has CUDA (HX_CUDA); otherwise every entry point says so.
#ifdef HX_CUDA
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

// The stream graphs are captured on, one per device for the process: cuBLAS
// and cuDNN keep a workspace per stream they meet (about 80 MB on Hopper,
// allocated through the caching allocator and never freed), so a new pool
// stream for every graph would leave another set behind at every entry.
static c10::cuda::CUDAStream hx_side_stream() {
  static std::mutex lock;
  static std::vector<std::optional<c10::cuda::CUDAStream>> per_device;
  std::lock_guard<std::mutex> held(lock);
  auto device = c10::cuda::current_device();
  if (per_device.size() <= static_cast<size_t>(device)) per_device.resize(device + 1);
  if (!per_device[device]) per_device[device] = c10::cuda::getStreamFromPool(false, device);
  return *per_device[device];
}

// A captured graph and the side stream it is captured on (capture needs a
// stream other than the default one). `guard` holds the side stream current
// between hx_graph_enter and hx_graph_leave.
struct hx_graph {
  at::cuda::CUDAGraph graph;
  c10::cuda::CUDAStream side;
  std::optional<c10::cuda::CUDAStreamGuard> guard;
  // The graph's private memory pool, named up front so that a failed
  // capture can end the allocator's routing of the side stream into it.
  c10::MempoolId_t pool;
  c10::DeviceIndex device;
  hx_graph()
      : side(hx_side_stream()), pool(at::cuda::graph_pool_handle()),
        device(c10::cuda::current_device()) {}
};

// From ATen/cuda/CUDAContextLight.h, declared here: that header includes
// the cuSPARSE and fp16 headers, which need CUDA toolkit headers that a
// PyTorch installation lacks.
struct cublasLtContext;
namespace at::cuda {
cublasLtContext *getCurrentCUDABlasLtHandle();
size_t getCUDABlasLtWorkspaceSize();
void *getCUDABlasLtWorkspace();
}  // namespace at::cuda

extern "C" {

int hx_has_cuda_graphs() { return 1; }

// libtorch's current stream on the current device (NULL: the legacy
// default stream). A capture's stream while one runs on this thread, or on
// the autograd thread running a captured backward pass.
char *hx_cuda_current_stream(void **out) { HX_TRY(*out = at::cuda::getCurrentCUDAStream().stream()) }

// libtorch's cuBLASLt handle for this thread and device, and its workspace
// for the current stream (allocated by libtorch on first use), so that
// harness's own cuBLASLt calls share them instead of keeping their own.
char *hx_cublaslt(void **handle, void **workspace, size_t *bytes) {
  HX_TRY({
    *handle = (void *)at::cuda::getCurrentCUDABlasLtHandle();
    *workspace = at::cuda::getCUDABlasLtWorkspace();
    *bytes = at::cuda::getCUDABlasLtWorkspaceSize();
  })
}

char *hx_graph_new(hx_graph **out) { HX_TRY(*out = new hx_graph()) }

// Makes `waiter` wait for the work queued on `on` so far.
static void hx_stream_wait(cudaStream_t waiter, cudaStream_t on) {
  cudaEvent_t ev;
  C10_CUDA_CHECK(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
  cudaError_t rec = cudaEventRecord(ev, on);
  cudaError_t wait = rec == cudaSuccess ? cudaStreamWaitEvent(waiter, ev, 0) : rec;
  // Destroying an event with a wait pending is allowed: the wait holds.
  (void)cudaEventDestroy(ev);
  C10_CUDA_CHECK(wait);
}

// Makes the side stream current, after it waits for what the current stream
// has queued (the batch's upload).
char *hx_graph_enter(hx_graph *g) {
  HX_TRY({
    TORCH_CHECK(!g->guard.has_value(), "the graph's stream is already current");
    hx_stream_wait(g->side.stream(), at::cuda::getCurrentCUDAStream().stream());
    g->guard.emplace(g->side);
  })
}

// Makes the stream that was current before hx_graph_enter current again; it
// waits for what the side stream has queued.
char *hx_graph_leave(hx_graph *g) {
  HX_TRY({
    if (!g->guard.has_value()) return nullptr;
    g->guard.reset();
    hx_stream_wait(at::cuda::getCurrentCUDAStream().stream(), g->side.stream());
  })
}

// Starts capturing the side stream (current). Thread-local mode: other host
// threads (the data workers) may keep using CUDA meanwhile; work queued on
// the side stream from any thread (the autograd engine's) is captured.
char *hx_graph_capture_begin(hx_graph *g) {
  HX_TRY(g->graph.capture_begin(g->pool, cudaStreamCaptureModeThreadLocal))
}

char *hx_graph_capture_end(hx_graph *g) { HX_TRY(g->graph.capture_end()) }

// Ends a capture that failed part way and discards what was captured, so
// that the stream is usable again. Errors are ignored: the capture may have
// been invalidated already.
void hx_graph_abort(hx_graph *g) {
  cudaGraph_t partial = nullptr;
  cudaStreamCaptureStatus status;
  if (cudaStreamIsCapturing(g->side.stream(), &status) == cudaSuccess && status != cudaStreamCaptureStatusNone) {
    (void)cudaStreamEndCapture(g->side.stream(), &partial);
    if (partial) (void)cudaGraphDestroy(partial);
  }
  try {
    c10::cuda::CUDACachingAllocator::endAllocateToPool(g->device, g->pool);
  } catch (...) {
  }
  (void)cudaGetLastError();
}

// Launches the captured work on the current stream.
char *hx_graph_replay(hx_graph *g) { HX_TRY(g->graph.replay()) }

void hx_graph_free(hx_graph *g) {
  if (g) {
    g->guard.reset();
    delete g;
  }
}

}  // extern "C"
#else
struct hx_graph;
extern "C" {
int hx_has_cuda_graphs() { return 0; }
static char *hx_no_cuda() { return hx_err("this build of harness has no CUDA support in its libtorch shim"); }
char *hx_cuda_current_stream(void **out) {
  *out = nullptr;
  return nullptr;
}
char *hx_cublaslt(void **, void **, size_t *) { return hx_no_cuda(); }
char *hx_graph_new(hx_graph **out) { return hx_no_cuda(); }
char *hx_graph_enter(hx_graph *) { return hx_no_cuda(); }
char *hx_graph_leave(hx_graph *) { return hx_no_cuda(); }
char *hx_graph_capture_begin(hx_graph *) { return hx_no_cuda(); }
char *hx_graph_capture_end(hx_graph *) { return hx_no_cuda(); }
void hx_graph_abort(hx_graph *) {}
char *hx_graph_replay(hx_graph *) { return hx_no_cuda(); }
void hx_graph_free(hx_graph *) {}
}  // extern "C"
#endif
