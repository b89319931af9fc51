"""The package's C++ (the compiled decoding step), built by torch's extension API on first use
for the CPU at hand and cached in ``~/.cache/torch_extensions`` (named by the CPU's flags and the source's path, so a
machine or checkout builds its own); where it cannot be built, one warning and None: the callers' eager path runs."""
import hashlib
import logging
import platform
import time
import warnings
from pathlib import Path

logger = logging.getLogger(__name__)
_built = {}  # by source: the module, or None where it could not be built


def build(source: Path, prefix: str):
    """The extension compiled from ``source`` (``prefix``: its name's start), or None."""
    if source not in _built:
        try:
            from torch.utils.cpp_extension import _get_build_directory, load
            cpu = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else platform.processor()
            flags = next((line for line in cpu.splitlines() if line.startswith("flags")), cpu)
            name = f"{prefix}_" + hashlib.sha256((flags + str(source)).encode()).hexdigest()[:8]
            logger.info("%s: %s (compiled on its first load on a machine)", source.name, name)
            lock = Path(_get_build_directory(name, verbose=False)) / "lock"
            if lock.exists() and time.time() - lock.stat().st_mtime > 600:  # left by a build that was killed
                logger.warning("removing %s, left by a build of %s that did not finish", lock, source.name)
                lock.unlink(missing_ok=True)
            _built[source] = load(name, [str(source)], extra_cflags=["-O3", "-march=native"])
        except Exception as e:  # no compiler, no ninja, no headers
            warnings.warn(f"{source.name} could not be compiled ({type(e).__name__}: {e}); decoding steps run "
                          "torch's operators")
            _built[source] = None
    return _built[source]
