"""Where a CUDA load's time goes, in one process: ``python -m bench.cuda_profile FILE.safetensors``.

Times CUDA context creation, pinning, host-to-device copies, page-cache reads,
then ``load_tensors(device="cuda")`` over ring sizes and reader threads (a
first call and a repeat each), then a cProfile of one load. Results of a run:
bench/results/gpu/NOTES.md.
"""
import os, sys, time, json, threading
from concurrent.futures import ThreadPoolExecutor
t0 = time.perf_counter()
import torch
import materialize as mz
import materialize.io.engine as engine
print(f"import {time.perf_counter()-t0:.2f}s", flush=True)
path = sys.argv[1]
t = time.perf_counter(); torch.empty(1, device="cuda"); torch.cuda.synchronize(); print(f"cuda init {time.perf_counter()-t:.3f}s")
t = time.perf_counter(); p = torch.empty(256 << 20, dtype=torch.uint8, pin_memory=True); print(f"pin 256MiB {time.perf_counter()-t:.3f}s")
t = time.perf_counter(); ps = [torch.empty(32 << 20, dtype=torch.uint8, pin_memory=True) for _ in range(8)]; print(f"pin 8x32MiB {time.perf_counter()-t:.3f}s")
d = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
for _ in range(3):
    torch.cuda.synchronize(); t = time.perf_counter(); d.copy_(p, non_blocking=True); torch.cuda.synchronize(); dt = time.perf_counter()-t
print(f"H2D pinned 256MiB {dt*1e3:.1f} ms = {0.268/dt:.1f} GB/s")
q = torch.empty(256 << 20, dtype=torch.uint8); q.fill_(1)
torch.cuda.synchronize(); t = time.perf_counter(); d.copy_(q); torch.cuda.synchronize(); dt = time.perf_counter()-t
print(f"H2D pageable 256MiB {dt*1e3:.1f} ms = {0.268/dt:.1f} GB/s")
del d
# read limit into pinned ring-size buffer reuse: all bytes of the file via preadv with N threads
size = os.path.getsize(path)
for threads in (8, 16):
    fd = os.open(path, os.O_RDONLY)
    chunk = 32 << 20
    bufs = [torch.empty(chunk, dtype=torch.uint8) for _ in range(threads)]
    for b in bufs: b.fill_(0)
    local = threading.local(); ids = iter(range(threads)); lock = threading.Lock()
    def rd(start):
        if not hasattr(local, "b"):
            with lock: local.b = memoryview(bufs[next(ids)].numpy())
        n = min(chunk, size - start); os.preadv(fd, [local.b[:n]], start)
    t = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool: list(pool.map(rd, range(0, size, chunk)))
    dt = time.perf_counter() - t; os.close(fd)
    print(f"page-cache read into reused buffers, {threads} threads: {dt:.3f}s = {size/dt/1e9:.1f} GB/s")
def run(label, **kw):
    torch.cuda.synchronize(); t = time.perf_counter()
    tensors, _ = mz.load_tensors(path, device="cuda", **kw); torch.cuda.synchronize()
    dt = time.perf_counter() - t
    print(f"{label}: {dt:.3f}s = {size/dt/1e9:.1f} GB/s", flush=True)
    del tensors
for threads in (8, 16):
    engine.default_reader_threads = lambda n=threads: n
    for staging in (64 << 20, 256 << 20, 1024 << 20):
        run(f"load_tensors threads={threads} staging={staging>>20}MiB", staging_bytes=staging)
        run(f"load_tensors threads={threads} staging={staging>>20}MiB again", staging_bytes=staging)
engine.default_reader_threads = lambda: 8
import cProfile, pstats
pr = cProfile.Profile(); pr.enable(); run("profiled default"); pr.disable()
pstats.Stats(pr).sort_stats("cumulative").print_stats(18)
pstats.Stats(pr).sort_stats("tottime").print_stats(12)
