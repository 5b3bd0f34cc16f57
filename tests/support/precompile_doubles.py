"""Stand-ins for ``precompile._build_one`` that a spawned pool process can import (tests/ is on
the path it inherits): each says which process built the kernel, and one kernel kills its
process, as a crash inside NVRTC would."""

from __future__ import annotations

import os
import time

from metrale_attn.precompile import Built

CRASH = "crash"
"""The kernel name whose build ends its process (in a pool process; here it is an error)."""


def build_saying_the_process(job) -> Built:
    """A 'build' of 50 ms whose ``why`` is ``pid <the process that built it>``."""
    arch, needed, _ = job
    if needed.name == CRASH:
        if os.getpid() != int(os.environ["PRECOMPILE_DOUBLES_PARENT"]):
            os._exit(9)
        return Built(arch, needed.name, "here", False, 0.0, None, "would have crashed its process")
    time.sleep(0.05)
    return Built(arch, needed.name, f"pid {os.getpid()}", False, 0.05, None)
