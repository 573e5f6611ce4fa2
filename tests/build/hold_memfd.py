"""Hold device memory outside gpumemd, as a process with its own allocation
would on a GPU: a memfd named as the host backend names a device's memory
(gpumem-BUS), SIZE MiB committed, until the process is killed. Prints
"holding" once the memory is there. Run by check_top.sh and
check_readme.sh through a link to the interpreter, so that the process
has the link's name.
    hold_memfd.py NAME SIZE_MIB"""
import os
import signal
import sys

fd = os.memfd_create(sys.argv[1], 0)
os.posix_fallocate(fd, 0, int(sys.argv[2]) << 20)
print("holding", flush=True)
signal.pause()
