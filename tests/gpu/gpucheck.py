"""What the Python GPU checks share: gpumemd started on a socket, and the
CUDA driver (through ctypes) with device 0's primary context current and
its free-memory figure, the one every check is judged by."""
import ctypes
import os
import subprocess
import time


def start_gpumemd(argv, sock, log, env=None):
    """Start gpumemd (argv, which names sock) with its stderr in the file
    log; wait up to 10 s for the socket, or for the daemon to end."""
    daemon = subprocess.Popen(argv, env=env, stderr=open(log, "w"))
    end = time.monotonic() + 10
    while not os.path.exists(sock) and time.monotonic() < end and daemon.poll() is None:
        time.sleep(0.05)
    return daemon


def cuda_context():
    """The CUDA driver, initialized, with device 0's primary context current
    on this thread."""
    cuda = ctypes.CDLL("libcuda.so.1")
    cuda.cuInit(0)
    dev, ctx = ctypes.c_int(), ctypes.c_void_p()
    cuda.cuDeviceGet(ctypes.byref(dev), 0)
    cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev)
    cuda.cuCtxSetCurrent(ctx)
    return cuda


def driver_free(cuda):
    """The driver's free memory on the current context's device."""
    f, t = ctypes.c_size_t(), ctypes.c_size_t()
    cuda.cuMemGetInfo_v2(ctypes.byref(f), ctypes.byref(t))
    return f.value
