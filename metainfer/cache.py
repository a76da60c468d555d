"""The compile cache: what optimize() compiled, kept for the next process.

    metainfer.cache.directory()    # the root in use: cache_dir=, $METAINFER_CACHE_DIR or ~/.cache/metainfer
    metainfer.cache.info()         # files and bytes held
    metainfer.cache.clear()        # remove it all (also: `metainfer cache clear`)

The layout and keys are described in metainfer.lowering.compile_cache.
"""

from metainfer.lowering.compile_cache import cache_dir as directory
from metainfer.lowering.compile_cache import clear, info

__all__ = ["directory", "info", "clear"]
