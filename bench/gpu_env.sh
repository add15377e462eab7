# Sourced by the bench/*.sh scripts on a GPU machine, from the checkout's
# root: the harness binary, the output folder, PyTorch's libtorch and CUDA
# libraries on the library path (the binary loads libtorch_cuda at start),
# NVLink multicast off (shared hosts), and the plugins: suites name them
# under target/plugins, and on a GPU machine they come in .carry/plugins.
OUT=${OUT:-bench-out}; mkdir -p "$OUT"
BIN=${HARNESS_BIN:-.carry/harness}
SP=$(python3 -c 'import site; print(site.getsitepackages()[0])')
export LD_LIBRARY_PATH="$SP/torch/lib:$(ls -d "$SP"/nvidia/*/lib | tr '\n' :)${LD_LIBRARY_PATH:-}"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
[ -e target/plugins ] || [ ! -d .carry/plugins ] || { mkdir -p target && ln -s ../.carry/plugins target/plugins; }
