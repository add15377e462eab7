import ctypes, glob, os, torch
from ctypes import c_void_p, c_int, c_int32, c_int64, c_uint64, byref, sizeof
torch.zeros(1, device='cuda')
cands = glob.glob(os.path.join(os.path.dirname(torch.__file__), '..', 'nvidia', '**', 'libcublasLt.so*'), recursive=True)
lt = ctypes.CDLL(cands[0])
h = c_void_p(); assert lt.cublasLtCreate(byref(h)) == 0
ws = torch.empty(32 << 20, dtype=torch.uint8, device='cuda')
def sa(desc, attr, val):
    assert lt.cublasLtMatmulDescSetAttribute(desc, attr, byref(val), sizeof(val)) == 0, attr
al = ctypes.c_float(1.0); be = ctypes.c_float(0.0)
stream = c_void_p(torch.cuda.current_stream().cuda_stream)
def run(name, epi, m, n, k, ta, tb, A, B, D, dtype_d, bias=None, bias_type=None):
    desc = c_void_p(); lt.cublasLtMatmulDescCreate(byref(desc), 68, 0)
    sa(desc, 3, c_int32(ta)); sa(desc, 4, c_int32(tb)); sa(desc, 7, c_int32(epi))
    if bias is not None: sa(desc, 8, c_void_p(bias.data_ptr()))
    if bias_type is not None: sa(desc, 26, c_int32(bias_type))
    L = []
    for (r, c), ty in [(((k, m) if ta else (m, k)), 14), (((n, k) if tb else (k, n)), 14), ((m, n), dtype_d)]:
        l = c_void_p(); lt.cublasLtMatrixLayoutCreate(byref(l), ty, c_uint64(r), c_uint64(c), c_int64(r)); L.append(l)
    pref = c_void_p(); lt.cublasLtMatmulPreferenceCreate(byref(pref))
    w = c_uint64(32 << 20); lt.cublasLtMatmulPreferenceSetAttribute(pref, 1, byref(w), 8)
    heur = (ctypes.c_byte * 96 * 8)(); cnt = c_int()
    st = lt.cublasLtMatmulAlgoGetHeuristic(h, desc, L[0], L[1], L[2], L[2], pref, 8, heur, byref(cnt))
    best = None
    for i in range(cnt.value):
        f = lambda: lt.cublasLtMatmul(h, desc, byref(al), c_void_p(A.data_ptr()), L[0], c_void_p(B.data_ptr()), L[1], byref(be), c_void_p(D.data_ptr()), L[2], c_void_p(D.data_ptr()), L[2], byref(heur[i]), c_void_p(ws.data_ptr()), c_uint64(32 << 20), stream)
        if f() != 0: continue
        torch.cuda.synchronize(); s = torch.cuda.Event(enable_timing=True); e = torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(20): f()
        e.record(); torch.cuda.synchronize()
        t = s.elapsed_time(e)/20*1000
        best = t if best is None else min(best, t)
    print(f"{name:50s} status={st} algos={cnt.value} best={best}")
N = 16384
for (C, F, nm) in [(768, 3072, 'fc'), (768, 2304, 'c_attn'), (2048, 8192, 'fc 1.3b')]:
    n = N if nm != 'fc 1.3b' else 8192
    x = torch.randn(n, C, dtype=torch.bfloat16, device='cuda'); dpre = torch.randn(n, F, dtype=torch.bfloat16, device='cuda')
    D = torch.empty(F, C, dtype=torch.float32, device='cuda'); db = torch.empty(F, dtype=torch.float32, device='cuda'); dbb = torch.empty(F, dtype=torch.bfloat16, device='cuda')
    # row-major dW [F, C] = dpre^T x  -> col-major D [C, F] = A (x as [C, n]) * op(B = dpre as [F, n], T)
    run(f'{nm} dW plain fp32', 1, C, F, n, 0, 1, x, dpre, D, 0)
    run(f'{nm} dW BGRADB fp32 bias default', 512, C, F, n, 0, 1, x, dpre, D, 0, db)
    run(f'{nm} dW BGRADB fp32 bias R32F', 512, C, F, n, 0, 1, x, dpre, D, 0, db, 0)
    run(f'{nm} dW BGRADB bias bf16', 512, C, F, n, 0, 1, x, dpre, D, 0, dbb, 14)
    ref = dpre.float().sum(0)
    print('   db err', ((db - ref).abs().max() / ref.abs().max()).item())
    t0 = torch.cuda.Event(enable_timing=True); t1 = torch.cuda.Event(enable_timing=True)
    t0.record()
    for _ in range(20): dpre.sum(0, dtype=torch.float32)
    t1.record(); torch.cuda.synchronize(); print(f'   torch col sum {t0.elapsed_time(t1)/20*1000:.1f} us')
