# Sourced by the bench/*.sh scripts on a GPU machine: the harness binary, the
# output folder, PyTorch's libtorch and CUDA libraries on the library path
# (the binary loads libtorch_cuda at start), and NVLink multicast off (shared hosts).
OUT=${OUT:-bench-out}; mkdir -p "$OUT"
BIN=${HARNESS_BIN:-.carry/harness}
SP=$(python3 -c 'import site; print(site.getsitepackages()[0])')
export LD_LIBRARY_PATH="$SP/torch/lib:$(ls -d "$SP"/nvidia/*/lib | tr '\n' :)${LD_LIBRARY_PATH:-}"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
