"""Shared by the GPU tests: relative error, and result rows written for GPU_RESULTS.md."""

import json
import os

import torch


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``||out - ref|| / ||ref||`` in float32 (the denominator floored at 1e-6)."""
    return float((out.float() - ref.float()).norm() / ref.float().norm().clamp(min=1e-6))


class ResultsFile:
    """Rows gathered by one GPU test module, rewritten to the JSON file named by
    ``env_var`` (when set) after every row, so a cut-off run keeps what it measured."""

    def __init__(self, env_var: str):
        self.env_var = env_var
        self.rows = []

    def record(self, kind: str, case: str, **values) -> None:
        from fa3_spec.attention import provider_version

        self.rows.append(dict(kind=kind, case=case, **values))
        print(kind, case, values)
        path = os.environ.get(self.env_var)
        if path:
            with open(path, "w") as fh:
                json.dump(dict(fa3=provider_version(), torch=torch.__version__,
                               device=torch.cuda.get_device_name(), rows=self.rows), fh, indent=1)
