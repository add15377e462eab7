import ctypes, glob, os, torch
from ctypes import c_void_p, c_int, c_int32, c_int64, c_uint64, byref, sizeof
torch.zeros(1, device='cuda')
cands = glob.glob(os.path.join(os.path.dirname(torch.__file__), '..', 'nvidia', '**', 'libcublasLt.so*'), recursive=True)
lt = ctypes.CDLL(cands[0] if cands else 'libcublasLt.so.13')
print('lib', cands[:1])
h = c_void_p(); assert lt.cublasLtCreate(byref(h)) == 0
ws = torch.empty(32 << 20, dtype=torch.uint8, device='cuda')
def sa(desc, attr, val):
    assert lt.cublasLtMatmulDescSetAttribute(desc, attr, byref(val), sizeof(val)) == 0, attr
def probe(name, epi, m, n, k, ta, tb, bias=None, bias_type=None, aux=None):
    desc = c_void_p(); lt.cublasLtMatmulDescCreate(byref(desc), 68, 0)
    sa(desc, 3, c_int32(ta)); sa(desc, 4, c_int32(tb)); sa(desc, 7, c_int32(epi))
    if bias is not None: sa(desc, 8, c_void_p(bias.data_ptr()))
    if bias_type is not None: sa(desc, 26, c_int32(bias_type))
    if aux is not None: sa(desc, 11, c_void_p(aux.data_ptr())); sa(desc, 12, c_int64(m))
    L = []
    for r, c in [((k, m) if ta else (m, k)), ((n, k) if tb else (k, n)), (m, n)]:
        l = c_void_p(); lt.cublasLtMatrixLayoutCreate(byref(l), 14, c_uint64(r), c_uint64(c), c_int64(r)); L.append(l)
    pref = c_void_p(); lt.cublasLtMatmulPreferenceCreate(byref(pref))
    w = c_uint64(32 << 20); lt.cublasLtMatmulPreferenceSetAttribute(pref, 1, byref(w), 8)
    heur = (ctypes.c_byte * 96 * 8)(); cnt = c_int()
    st = lt.cublasLtMatmulAlgoGetHeuristic(h, desc, L[0], L[1], L[2], L[2], pref, 8, heur, byref(cnt))
    print(f"{name:45s} status={st} algos={cnt.value}")
    return desc, L, heur, st, cnt.value
N, C, F = 16384, 768, 3072
bf = torch.empty(F, dtype=torch.float32, device='cuda'); bb = torch.empty(F, dtype=torch.bfloat16, device='cuda')
aux = torch.empty(N, F, dtype=torch.bfloat16, device='cuda')
R32F, R16BF = 0, 14
probe('default', 1, F, N, C, 1, 0)
probe('BIAS fp32', 4, F, N, C, 1, 0, bf, R32F)
probe('BIAS bf16', 4, F, N, C, 1, 0, bb, R16BF)
probe('GELU_BIAS fp32', 36, F, N, C, 1, 0, bf, R32F)
probe('GELU_BIAS bf16', 36, F, N, C, 1, 0, bb, R16BF)
probe('GELU_AUX (no bias)', 160, F, N, C, 1, 0, aux=aux)
probe('GELU_AUX_BIAS fp32', 164, F, N, C, 1, 0, bf, R32F, aux)
probe('GELU_AUX_BIAS bf16', 164, F, N, C, 1, 0, bb, R16BF, aux)
probe('GELU_AUX_BIAS default type', 164, F, N, C, 1, 0, bb, None, aux)
probe('DGELU', 192, F, N, C, 0, 0, aux=aux)
probe('DGELU_BGRAD fp32', 208, F, N, C, 0, 0, bf, R32F, aux)
probe('DGELU_BGRAD bf16', 208, F, N, C, 0, 0, bb, R16BF, aux)
probe('BGRADB fp32 (dW with bias grad)', 512, C, F, N, 0, 1, torch.empty(F, device='cuda'), R32F)
# time the ones that have algorithms: default vs GELU_AUX_BIAS bf16 vs DGELU, DGELU_BGRAD
x = torch.randn(N, C, dtype=torch.bfloat16, device='cuda'); wt = torch.randn(F, C, dtype=torch.bfloat16, device='cuda') * 0.02
out = torch.empty(N, F, dtype=torch.bfloat16, device='cuda')
dy = torch.randn(N, C, dtype=torch.bfloat16, device='cuda'); w2 = torch.randn(C, F, dtype=torch.bfloat16, device='cuda') * 0.02
al = ctypes.c_float(1.0); be = ctypes.c_float(0.0)
stream = c_void_p(torch.cuda.current_stream().cuda_stream)
def timeit(name, epi, m, n, k, ta, tb, A, B, bias=None, bias_type=None, auxt=None):
    desc, L, heur, st, cnt = probe(name, epi, m, n, k, ta, tb, bias, bias_type, auxt)
    if cnt == 0: return
    for i in range(min(cnt, 4)):
        algo = ctypes.byref(heur[i])
        f = lambda: lt.cublasLtMatmul(h, desc, byref(al), c_void_p(A.data_ptr()), L[0], c_void_p(B.data_ptr()), L[1], byref(be), c_void_p(out.data_ptr()), L[2], c_void_p(out.data_ptr()), L[2], algo, c_void_p(ws.data_ptr()), c_uint64(32 << 20), stream)
        for _ in range(5): assert f() == 0
        torch.cuda.synchronize(); s = torch.cuda.Event(enable_timing=True); e = torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(50): f()
        e.record(); torch.cuda.synchronize()
        print(f"   algo {i}: {s.elapsed_time(e)/50*1000:7.1f} us")
timeit('T default fc fwd', 1, F, N, C, 1, 0, wt, x)
timeit('T GELU_AUX_BIAS bf16', 164, F, N, C, 1, 0, wt, x, bb, R16BF, aux)
timeit('T GELU_AUX_BIAS fp32', 164, F, N, C, 1, 0, wt, x, bf, R32F, aux)
timeit('T default dH', 1, F, N, C, 0, 0, w2, dy)
timeit('T DGELU', 192, F, N, C, 0, 0, w2, dy, auxt=aux)
timeit('T DGELU_BGRAD bf16', 208, F, N, C, 0, 0, w2, dy, bb, R16BF, aux)
timeit('T DGELU_BGRAD fp32', 208, F, N, C, 0, 0, w2, dy, bf, R32F, aux)
