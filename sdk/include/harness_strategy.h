/*
 * harness_strategy.h: the native plugin ABI of harness, the C mirror of the
 * WIT contract harness:strategy@0.2.0 (sdk/wit/strategy.wit).
 *
 * A native plugin is a shared library exporting the functions declared at
 * the end of this file. The host calls harness_abi_version() before any other
 * symbol and refuses a library whose version it does not speak, naming
 * both. Hosts of ABI version 2 (contract 0.2) load libraries of version 1
 * (contract 0.1) as before: the same declarations without
 * harness_compress_setup, and the host's table says version 1 to them. Native plugins are trusted code: they run unsandboxed in the host
 * process and results label them "native (unsandboxed)".
 *
 * Tensors are uint64_t handles owned by the host; 0 is no tensor. Every host
 * call goes through harness_host.op with an op code; the codes map one to one
 * onto the WIT functions, plus HARNESS_OP_DATA_PTR and HARNESS_OP_CUDA_STREAM,
 * which only native plugins get. Handles an op returns belong to the plugin,
 * which releases each with harness_host.drop_tensor.
 *
 * Rust authors do not use this header: harness-sdk's export! macro produces
 * these symbols from the same source that builds the WASM component.
 *
 * Lifetimes and threads, which the declarations alone do not say:
 *  - Strings are UTF-8 with a length, never NUL-terminated, and the host
 *    copies every string it is given before the next call into the plugin.
 *  - harness_plugin_last_error: the message of the export that just returned
 *    HARNESS_STATUS_ERROR or HARNESS_STATUS_PANIC on this instance. The host
 *    reads it at once; it must stay valid until the next call into the
 *    instance (a buffer the instance owns serves). Return NULL (len 0) for
 *    no message.
 *  - harness_plugin_info: name and version must stay valid as long as the
 *    instance (string literals serve). The host reads them once, after
 *    create.
 *  - harness_plugin_configure receives the strategy's `compressor_config`,
 *    `batch_policy_config` or `checkpoint_config` table (and any
 *    --plugin-config key=value) serialized as TOML text, e.g.
 *    "ratio = 0.01\nseed = 3\n"; empty (len 0) when the suite gives none.
 *    It is called once per instance, before any other hook, and at
 *    `harness validate`, which reports its error at the config's line.
 *  - harness_host.last_error: the host's message for the op that just
 *    returned non-zero; valid until the plugin's next call into the host.
 *  - Instances: the host creates one instance per rank and entry and calls
 *    it from one thread at a time. On the CPU, ranks are threads of one
 *    process, so several instances of one library run at the same time on
 *    different threads: keep state in the instance, and guard any global
 *    that instances share. On GPUs each rank is its own process.
 */
#ifndef HARNESS_STRATEGY_H
#define HARNESS_STRATEGY_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* major << 16 | minor of the contract (0.2). */
#define HARNESS_ABI_VERSION 2

/* Status codes of plugin exports and of harness_host.op. */
#define HARNESS_STATUS_OK 0
#define HARNESS_STATUS_ERROR 1 /* message through last_error */
#define HARNESS_STATUS_PANIC 2 /* the plugin panicked or threw */

/* harness_plugin_kind() values. */
#define HARNESS_KIND_COMPRESSOR 1
#define HARNESS_KIND_BATCH_POLICY 2
#define HARNESS_KIND_CHECKPOINT_POLICY 3

/* dtype indices (the WIT dtype enum, in order). */
#define HARNESS_DTYPE_F32 0
#define HARNESS_DTYPE_F16 1
#define HARNESS_DTYPE_BF16 2
#define HARNESS_DTYPE_F64 3
#define HARNESS_DTYPE_I64 4
#define HARNESS_DTYPE_I32 5
#define HARNESS_DTYPE_U8 6
#define HARNESS_DTYPE_BOOL 7

/* Host ops. Inputs: tensors (self first), floats, ints, data; outputs in
 * harness_op_result. "-> t" means one new tensor in tensors[0]. */
#define HARNESS_OP_SHAPE 1              /* [self] -> ints: dims */
#define HARNESS_OP_NUMEL 2              /* [self] -> scalar */
#define HARNESS_OP_DTYPE 3              /* [self] -> scalar: dtype index */
#define HARNESS_OP_DEVICE 4             /* [self] -> scalar: 0 cpu, 1 cuda */
#define HARNESS_OP_ASSIGN 5             /* [self, src]: copy src into self, in place */
#define HARNESS_OP_DUPLICATE 6          /* [self] -> t */
#define HARNESS_OP_ADD 7                /* [self, other] -> t */
#define HARNESS_OP_SUB 8                /* [self, other] -> t */
#define HARNESS_OP_MUL 9                /* [self, other] -> t */
#define HARNESS_OP_DIV 10               /* [self, other] -> t */
#define HARNESS_OP_ADD_SCALAR 11        /* [self], floats [s] -> t */
#define HARNESS_OP_MUL_SCALAR 12        /* [self], floats [s] -> t */
#define HARNESS_OP_ABS 13               /* [self] -> t */
#define HARNESS_OP_SIGN 14              /* [self] -> t */
#define HARNESS_OP_FLOOR 15             /* [self] -> t */
#define HARNESS_OP_SQRT 16              /* [self] -> t */
#define HARNESS_OP_LESS_THAN 17         /* [self, other] -> t (1.0 / 0.0) */
#define HARNESS_OP_CAST 18              /* [self], ints [dtype] -> t */
#define HARNESS_OP_RESHAPE 19           /* [self], ints: shape (-1 infers) -> t */
#define HARNESS_OP_TRANSPOSE 20         /* [self], ints [a, b] -> t */
#define HARNESS_OP_NARROW 21            /* [self], ints [dim, start, len] -> t */
#define HARNESS_OP_TOPK 22              /* [self], ints [k] -> tensors [values, i64 indices] */
#define HARNESS_OP_GATHER 23            /* [self, index] -> t */
#define HARNESS_OP_SCATTER_ADD 24       /* [self, index, src] -> t */
#define HARNESS_OP_SUM 25               /* [self] -> scalar */
#define HARNESS_OP_NORM 26              /* [self] -> scalar */
#define HARNESS_OP_MEAN_ABS 27          /* [self] -> scalar */
#define HARNESS_OP_MATMUL 28            /* [self, other] -> t */
#define HARNESS_OP_ORTHONORMALIZE 29    /* [self] -> t (Q of reduced QR) */
#define HARNESS_OP_PACK_SIGNS 30        /* [self] -> t (u8, 8 signs a byte) */
#define HARNESS_OP_READ_F32 31          /* [self] -> data (metered) */
#define HARNESS_OP_ZEROS 32             /* [like], ints [dtype, dims...] -> t */
#define HARNESS_OP_RAND_UNIFORM 33      /* [like], ints [seed, dims...] -> t */
#define HARNESS_OP_RAND_NORMAL 34       /* [like], ints [seed, dims...] -> t */
#define HARNESS_OP_RAND_INDICES 35      /* [like], ints [n, k, seed] -> t */
#define HARNESS_OP_FROM_F32 36          /* [like], data, ints: shape -> t */
#define HARNESS_OP_UNPACK_SIGNS 37      /* [packed], ints [numel] -> t */
#define HARNESS_OP_RANK 38              /* -> scalar */
#define HARNESS_OP_WORLD_SIZE 39        /* -> scalar */
#define HARNESS_OP_ALL_REDUCE_SUM 40    /* [t], in place */
#define HARNESS_OP_ALL_GATHER 41        /* [t] -> t */
#define HARNESS_OP_BROADCAST 42         /* [t], ints [root], in place */
#define HARNESS_OP_REDUCE_SCATTER_SUM 43 /* [t] -> t */
#define HARNESS_OP_DATA_PTR 44          /* [t] -> ptr (native only) */
#define HARNESS_OP_CUDA_STREAM 45       /* -> ptr: the host's CUDA stream (native only) */

typedef struct harness_op_args {
    const uint64_t *tensors;
    size_t n_tensors;
    const double *floats;
    size_t n_floats;
    const int64_t *ints;
    size_t n_ints;
    const float *data;
    size_t n_data;
} harness_op_args;

/* ints and data point into host memory valid until the next op call. */
typedef struct harness_op_result {
    uint64_t tensors[2];
    double scalar;
    const int64_t *ints;
    size_t n_ints;
    const float *data;
    size_t n_data;
    void *ptr;
} harness_op_result;

/* What the host lends a plugin instance. */
typedef struct harness_host {
    uint32_t abi_version;
    void *ctx;
    int32_t (*op)(void *ctx, uint32_t op, const harness_op_args *args, harness_op_result *out);
    void (*drop_tensor)(void *ctx, uint64_t t);
    const uint8_t *(*last_error)(void *ctx, size_t *len);
    void (*log)(void *ctx, uint32_t level, const uint8_t *msg, size_t len); /* 0 debug, 1 info, 2 warn */
} harness_host;

typedef struct harness_bucket_info {
    uint64_t step;
    uint32_t index;
    uint32_t count;
} harness_bucket_info;

/* Since ABI 2: one parameter's gradient in a bucket. Pointers are valid
 * during harness_compress_setup only: copy what you keep. */
typedef struct harness_param_slot {
    const uint8_t *name; /* e.g. "h.3.attn.qkv.weight" (UTF-8, not NUL-terminated) */
    size_t name_len;
    const uint64_t *shape;
    size_t ndim;
    uint64_t offset; /* of its first element in the bucket, in elements */
    uint64_t numel;
    uint32_t dtype;  /* HARNESS_DTYPE_* */
    uint8_t weight;  /* 1: a weight matrix (two or more dimensions) */
} harness_param_slot;

/* Since ABI 2: what a bucket holds, its parameters by ascending offset. */
typedef struct harness_bucket_layout {
    uint64_t numel;
    const harness_param_slot *params;
    size_t n_params;
} harness_bucket_layout;

typedef struct harness_batch {
    uint32_t micro_batch;
    uint32_t accum_steps;
    double lr_scale;
} harness_batch;

typedef struct harness_step_telemetry {
    uint64_t step;
    double loss;
    double step_time_s;
    double elapsed_s;
    uint64_t memory_used_bytes;
    uint64_t memory_total_bytes;
    double tokens_per_s;
    uint32_t micro_batch;
    uint32_t accum_steps;
    uint32_t world_size;
    uint8_t has_grad_sq_norm;
    uint8_t has_local_grad_sq_norm;
    uint8_t out_of_memory;
    double grad_sq_norm;
    double local_grad_sq_norm;
} harness_step_telemetry;

typedef struct harness_checkpoint_history {
    uint8_t has_last_cost_s;
    double last_cost_s;
    const uint64_t *saved;
    size_t n_saved;
    const uint64_t *failures;
    size_t n_failures;
    double since_last_s;
} harness_checkpoint_history;

/* The host points delete at room for n_saved steps; the plugin sets n_delete. */
typedef struct harness_decision {
    uint8_t save;
    uint64_t *delete_steps;
    size_t n_delete;
} harness_decision;

/* Since contract 0.1.1: the history above and the two tiers' state. */
typedef struct harness_tiered_history {
    harness_checkpoint_history base;
    const uint64_t *in_memory; /* steps of the snapshots in host memory */
    size_t n_in_memory;
    uint8_t has_persisting;
    uint64_t persisting; /* the step being persisted */
    uint8_t has_last_stall_s;
    double last_stall_s; /* seconds training stopped for the last snapshot */
    uint8_t has_last_persist_s;
    double last_persist_s; /* seconds the last persist took, until durable */
    uint8_t has_last_slowdown_s;
    double last_slowdown_s; /* extra seconds of the steps that overlapped it */
} harness_tiered_history;

/* Since contract 0.1.1: base.save takes a snapshot into host memory,
 * persist also writes it to disk. */
typedef struct harness_tiered_decision {
    harness_decision base;
    uint8_t persist;
} harness_tiered_decision;

typedef struct harness_info {
    const uint8_t *name;
    size_t name_len;
    const uint8_t *version;
    size_t version_len;
} harness_info;

typedef void (*harness_sink)(void *ctx, const uint8_t *data, size_t len);

/* Exported by every native plugin. */
uint32_t harness_abi_version(void);
uint32_t harness_plugin_kind(void);
void *harness_plugin_create(const harness_host *host); /* NULL on failure */
void harness_plugin_destroy(void *self);
void harness_plugin_info(void *self, harness_info *out);
int32_t harness_plugin_configure(void *self, const uint8_t *toml, size_t len);
const uint8_t *harness_plugin_last_error(void *self, size_t *len);
int32_t harness_plugin_state_save(void *self, harness_sink sink, void *sink_ctx);
int32_t harness_plugin_state_load(void *self, const uint8_t *data, size_t len);

/* Exported by the plugin of the matching kind. */
int32_t harness_compress(void *self, uint64_t bucket, const harness_bucket_info *info);
/* Since ABI 2, required of a compressor: the layout of its n buckets
 * (indexed by harness_bucket_info.index), once, after configure and before
 * harness_plugin_state_load and the first harness_compress. */
int32_t harness_compress_setup(void *self, const harness_bucket_layout *buckets, size_t n);
int32_t harness_batch_initial(void *self, const harness_batch *configured, harness_batch *out);
int32_t harness_batch_next(void *self, const harness_step_telemetry *t, harness_batch *out);
/* Optional (a library without it is taken to answer 0). Sets *out to 1 when
 * the policy reads grad_sq_norm / local_grad_sq_norm, else 0. Called once,
 * after configure and before harness_batch_initial. The statistics cost the
 * host a norm pass per step and the overlap of the all-reduce with the
 * backward pass; without them has_grad_sq_norm and has_local_grad_sq_norm
 * are 0. */
int32_t harness_batch_wants_gradient_stats(void *self, uint8_t *out);
int32_t harness_checkpoint_decide(void *self, const harness_step_telemetry *t, const harness_checkpoint_history *h,
                                  harness_decision *out);
/* Optional, since contract 0.1.1: preferred by the host when exported. */
int32_t harness_checkpoint_decide_tiered(void *self, const harness_step_telemetry *t, const harness_tiered_history *h,
                                         harness_tiered_decision *out);

#ifdef __cplusplus
}
#endif

#endif /* HARNESS_STRATEGY_H */
