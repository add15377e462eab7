#!/usr/bin/env bash
# Sourced by ./x: makes the libtorch environment that `tch` 0.24 builds and runs
# against (PyTorch 2.11.0 from PyPI: tch 0.24 needs exactly this libtorch) and exports the
# variables cargo needs. The environment lives outside the clone, in
# $HARNESS_CACHE (default ~/.cache/harness), so repeat runs reuse it.

TORCH_VERSION=2.11.0
HARNESS_CACHE=${HARNESS_CACHE:-$HOME/.cache/harness}
VENV="$HARNESS_CACHE/torch-$TORCH_VERSION"
if [ ! -x "$VENV/bin/python" ] || ! "$VENV/bin/python" -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '$TORCH_VERSION')" 2>/dev/null; then
  echo "harness: installing torch==$TORCH_VERSION into $VENV (once; about 4.6 GB)" >&2
  rm -rf "$VENV"
  mkdir -p "$HARNESS_CACHE"
  python3 -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check "torch==$TORCH_VERSION" numpy
fi
SP=$("$VENV/bin/python" -c 'import site; print(site.getsitepackages()[0])')
# The CUDA runtime's headers come with torch's wheels, all but the `crt/`
# ones they include; the libtorch shim's CUDA graph part compiles against
# them (134 kB, once). Without them it is built without CUDA graphs.
CRT_VERSION=13.0.88
if [ -d "$SP/nvidia/cu13/include" ] && [ ! -f "$SP/nvidia/cu13/include/crt/host_defines.h" ]; then
  echo "harness: installing nvidia-cuda-crt==$CRT_VERSION (the CUDA headers torch's wheels lack)" >&2
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-deps "nvidia-cuda-crt==$CRT_VERSION" ||
    echo "harness: could not install nvidia-cuda-crt; building without CUDA graphs" >&2
fi
export PATH="$VENV/bin:$PATH"
export LIBTORCH_USE_PYTORCH=1
export LIBTORCH_BYPASS_VERSION_CHECK=${LIBTORCH_BYPASS_VERSION_CHECK:-0}
# libtorch's folders, joined by `:` with no empty entry (an empty entry
# would make the current folder a library search path); `./x install`
# writes them into its wrapper.
NV_LIBS=$(ls -d "$SP"/nvidia/*/lib 2>/dev/null | paste -sd: - || true)
TORCH_LIBS="$SP/torch/lib${NV_LIBS:+:$NV_LIBS}"
export LD_LIBRARY_PATH="$TORCH_LIBS${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
