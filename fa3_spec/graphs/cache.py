"""Cold start: PyTorch's compile caches in one file.

`save_compile_cache` writes the process's compile artifacts (inductor FX
graphs, AOTAutograd, autotuning) after a capture; `load_compile_cache` loads
them before the next process compiles, so a restart skips most of inductor's
work. A `fa3_spec.graphs.CUDAGraphRunner` given ``cache_path=`` does both;
`fa3_spec.eagle.EagleEngine` does both once around all its runners.

Save once per process, after every compile the file should cover. Each
``torch.compiler.save_cache_artifacts`` appends the artifacts new since the
last save, one list per kind (inductor, AOTAutograd, ...), to what it
returns, and ``load_cache_artifacts`` keeps only the last list of each kind:
a file written after a second save, with new compiles between, loads as the
second save's compiles alone. Several runners sharing one file therefore
leave the loading and saving to their owner.
"""

from __future__ import annotations

import os

import torch


def save_compile_cache(path: str) -> bool:
    """Write this process's compile-cache artifacts (inductor FX graphs,
    AOTAutograd, autotuning: ``torch.compiler.save_cache_artifacts``) to
    ``path``; False (nothing written) when there are none, e.g. with a
    non-inductor backend."""
    saved = torch.compiler.save_cache_artifacts()
    if saved is None:
        return False
    artifacts, _info = saved
    tmp = f"{path}.tmp"
    with open(tmp, "wb") as fh:
        fh.write(artifacts)
    os.replace(tmp, path)  # a reader never sees half a file
    return True


def load_compile_cache(path: str) -> bool:
    """Load artifacts written by `save_compile_cache` into PyTorch's caches
    (``torch.compiler.load_cache_artifacts``) before compiling.

    Returns True when artifacts were loaded; False when ``path`` is not a
    file or holds no artifacts torch can read (an empty, truncated or
    foreign file: torch logs why; `CUDAGraphRunner.capture` then compiles
    from scratch and overwrites the file). Artifacts from another torch
    version, device or configuration load but are simply not hit.
    """
    if not os.path.isfile(path):
        return False
    with open(path, "rb") as fh:
        data = fh.read()
    return torch.compiler.load_cache_artifacts(data) is not None
