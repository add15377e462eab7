"""{{name}}: top-k sparsification with error feedback, 5% of each bucket,
written from `harness plugin new compressor --lang python` by
bench/rank_flows.sh. topk.rs beside it is the same algorithm in Rust, op
for op: the two builds must train bit for bit alike.
"""

import struct
import tomllib
from contextlib import ExitStack

from componentize_py_types import Err
from wit_world import exports
from wit_world.exports import plugin
from wit_world.imports import collective, tensor
from wit_world.imports.types import Dtype

residuals = {}  # bucket index -> host tensor
saved = {}  # bucket index -> floats from state_load


class Plugin(exports.Plugin):
    def info(self) -> plugin.PluginInfo:
        return plugin.PluginInfo(name="{{name}}", version="0.1.0")

    def configure(self, config: str) -> None:
        try:
            keys = tomllib.loads(config)
        except tomllib.TOMLDecodeError as e:
            raise Err(f"{{name}}: the configuration is not TOML: {e}")
        if keys:
            raise Err(f"{{name}} takes no configuration, got: {config.strip()}")

    def state_save(self) -> bytes:
        # Per bucket, in index order: u32 index, u64 n, n x f32 (little-endian).
        out = b""
        for i in sorted(residuals):
            data = residuals[i].read_f32()
            out += struct.pack(f"<IQ{len(data)}f", i, len(data), *data)
        return out

    def state_load(self, state: bytes) -> None:
        for t in residuals.values():
            t.__exit__(None, None, None)
        residuals.clear()
        saved.clear()
        at = 0
        while at < len(state):
            if len(state) - at < 12:
                raise Err("{{name}}: a truncated state")
            i, n = struct.unpack_from("<IQ", state, at)
            at += 12
            if len(state) - at < 4 * n:
                raise Err("{{name}}: a truncated state")
            saved[i] = list(struct.unpack_from(f"<{n}f", state, at))
            at += 4 * n


class GradientCompression(exports.GradientCompression):
    def compress(self, bucket, info) -> None:
        n = bucket.numel()
        world = float(collective.world_size())
        with ExitStack() as s:
            keep = s.enter_context
            flat = keep(bucket.reshape([-1]))
            if info.index in saved:
                data = saved.pop(info.index)
                residual = tensor.from_f32(data, [len(data)], bucket)
            else:
                residual = residuals.pop(info.index, None)
            if residual is None:
                acc = keep(flat.duplicate())
            else:
                keep(residual)
                if residual.numel() != n:
                    raise Err(f"bucket {info.index} has {n} elements, its residual {residual.numel()}")
                acc = keep(flat.add(residual))
            k = (n + 19) // 20
            top, idx = keep(acc.abs()).topk(k)
            keep(top)
            keep(idx)
            vals = keep(acc.gather(idx))
            all_vals = keep(collective.all_gather(vals))
            all_idx = keep(keep(collective.all_gather(keep(idx.cast(Dtype.I32)))).cast(Dtype.I64))
            zeros = keep(tensor.zeros([n], acc.dtype(), bucket))
            total = keep(zeros.scatter_add(all_idx, all_vals))
            mine = keep(zeros.scatter_add(idx, vals))
            residuals[info.index] = acc.sub(mine)
            shape = [int(d) for d in bucket.shape()]
            bucket.assign(keep(keep(total.mul_scalar(1.0 / world)).reshape(shape)))
