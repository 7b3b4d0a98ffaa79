"""`fa3_spec.attention.store_kv`'s fused Triton kernel against its default.

On CPU the kernel runs in Triton's interpreter, in a child process
(``TRITON_INTERPRET=1`` must be set before Triton is imported), with the
Triton the sglang parity tests use (`fa3_spec.harness.sglang_upstream`'s
cache) when none is installed. The CUDA side: test_gpu_kv_store.py.
"""

import json
import sys

import pytest

import children

CHILD = children.TRITON_INTERPRETER_PREAMBLE + r"""
from fa3_spec.attention import fused_store_applies, store_kv_fused, store_kv_index_copy

out = {"cases": [], "refused": {}}
g = torch.Generator().manual_seed(0)
L, N, P, H, D = 2, 5, 4, 3, 24  # H, D not powers of two: the block is masked
rows = L * N * P
for dtype in (torch.bfloat16, torch.float32):
    for slot_dtype in (torch.int64, torch.int32):
        kc = torch.randn(L, N, P, H, D, generator=g).to(dtype)
        vc = torch.randn(L, N, P, H, D, generator=g).to(dtype)
        qkv = torch.randn(8, (4 + 2 * H) * D, generator=g).to(dtype).view(8, 4 + 2 * H, D)
        k = qkv[:, 4:4 + H].contiguous()
        v = qkv[:, 4 + H:]  # a view with the fused output's row stride
        slots = torch.tensor([0, 5, rows - 1, 17, -1, rows, 10**6, 3], dtype=slot_dtype)
        want, got = (kc.clone(), vc.clone()), (kc.clone(), vc.clone())
        keep = (slots >= 0) & (slots < rows)
        store_kv_index_copy(*want, slots[keep].long(), k[keep], v[keep])
        store_kv_fused(*got, slots, k, v)
        out["cases"].append(dict(dtype=str(dtype), slots=str(slot_dtype),
                                 k_equal=torch.equal(want[0], got[0]),
                                 v_equal=torch.equal(want[1], got[1]),
                                 changed=int((got[0] != kc).any(-1).any(-1).sum())))
empty = torch.empty(0, H, D)
before = kc.clone()
store_kv_fused(kc, vc, torch.empty(0, dtype=torch.int64), empty.to(kc.dtype), empty.to(kc.dtype))
out["empty_untouched"] = torch.equal(before, kc)

kc, vc = torch.zeros(L, N, P, H, D), torch.zeros(L, N, P, H, D)
k, v, s = torch.ones(2, H, D), torch.ones(2, H, D), torch.tensor([1, 2])
out["applies"] = fused_store_applies(kc, vc, s, k, v)
# One token: a size-1 dimension's stride means nothing, so it is no reason to refuse.
out["applies_one_token"] = fused_store_applies(kc, vc, torch.tensor([1, 2])[::2], k[:1], v[:1])
bad = {
    "strided cache": (kc.transpose(0, 1), vc.transpose(0, 1), s, k, v),
    "mixed dtype": (kc, vc, s, k.double(), v),
    "float slots": (kc, vc, s.float(), k, v),
    "D stride 2": (kc, vc, s, torch.ones(2, H, 2 * D)[..., ::2], v),
    "slots count": (kc, vc, s[:1], k, v),
    "2-D k": (kc, vc, s, k.view(2, -1), v.view(2, -1)),
    "cache shapes": (kc, vc[:1], s, k, v),
}
for name, args in bad.items():
    out["refused"][name] = refusal(fused_store_applies, store_kv_fused, *args)
print(json.dumps(out))
"""


@pytest.mark.children(job=children.triton_interpreter_job(CHILD))
def test_the_fused_kernel_writes_what_index_copy_writes_drops_slots_out_of_range_and_refuses_odd_layouts(child):
    doc = child.result()
    if "skip" in doc:
        pytest.skip(doc["skip"])
    assert len(doc["cases"]) == 4
    for case in doc["cases"]:
        assert case["k_equal"] and case["v_equal"], case
        assert case["changed"] == 5, case  # 5 in-range slots of 8, all distinct rows
    assert doc["empty_untouched"]
    # ... and it refuses, by layout alone, what it cannot write.
    assert doc["applies"] and doc["applies_one_token"]
    for name, (refused, raised) in doc["refused"].items():
        assert refused and "store_kv_fused" in raised, name


#: A child that records every import of Triton and who asked for it (the importing
#: module's ``__name__``, for ``import`` statements and ``importlib.import_module``
#: alike, whether or not Triton is installed or already imported), imports torch and
#: its compiler front end, then the library and its EAGLE loop, then plants an import
#: in a module named as the library's to show that the record sees it.
#:
#: torch's compiler (``torch._dynamo``, which the library builds on) imports Triton
#: wherever Triton is installed, as it is with torch's CUDA builds; so what is checked
#: is the library itself: no fa3_spec module imports Triton at import, and importing
#: the library brings no Triton module that torch had not.
IMPORT_PROBE = r"""
import builtins, importlib, json, sys, types

asked = []
_import, _import_module = builtins.__import__, importlib.import_module


def _triton(name):
    return name == "triton" or name.startswith("triton.")


def recording_import(name, globals=None, locals=None, fromlist=(), level=0):
    if level == 0 and _triton(name):
        asked.append([(globals or {}).get("__name__", "?"), name])
    return _import(name, globals, locals, fromlist, level)


def recording_import_module(name, package=None):
    if _triton(name):
        asked.append([sys._getframe(1).f_globals.get("__name__", "?"), name])
    return _import_module(name, package)


def loaded():
    return sorted(m for m in sys.modules if _triton(m))


builtins.__import__, importlib.import_module = recording_import, recording_import_module
import torch
import torch._dynamo
by_torch = loaded()
mark = len(asked)
import fa3_spec, fa3_spec.eagle
out = dict(by_torch=by_torch, new=sorted(set(loaded()) - set(by_torch)),
           by_library=[a for a in asked[mark:] if a[0].split(".")[0] == "fa3_spec"])

# The planted violation: with Triton absent, then with a stand-in already imported.
planted = {"__name__": "fa3_spec.planted"}
exec("try:\n    import triton.language\nexcept ImportError:\n    pass", planted)
sys.modules.setdefault("triton", types.ModuleType("triton"))
exec("import triton", planted)
exec("importlib.import_module('triton')", {"__name__": "fa3_spec.planted", "importlib": importlib})
out["planted"] = [a for a in asked if a[0] == "fa3_spec.planted"]
print(json.dumps(out))
"""


def _import_job(tmp):
    return json.loads(children.run([sys.executable, "-c", IMPORT_PROBE], fresh=True).stdout.splitlines()[-1])


@pytest.mark.children(job=_import_job)
def test_importing_the_library_does_not_import_triton(child):
    # sglang's CPU kernels need Triton's interpreter, fixed at Triton's first import.
    doc = child.result()
    assert doc["by_library"] == [] and doc["new"] == [], doc
    # The record sees an import of Triton from the library, installed or not, new or not.
    assert doc["planted"] == [["fa3_spec.planted", "triton.language"],
                              ["fa3_spec.planted", "triton"], ["fa3_spec.planted", "triton"]]


@pytest.mark.parametrize("argv, says", [([], "needs CUDA and Triton"),
                                        (["--tokens", "0"], "--tokens must be >= 1"),
                                        (["--num-pages", "2"], "holds fewer slots")])
def test_the_benchmark_exits_2_without_cuda_or_on_bad_input(argv, says, monkeypatch, capsys):
    import pathlib

    import torch

    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))
    import kernel_bench

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert kernel_bench.main(["kv-store", *argv]) == 2
    assert says in capsys.readouterr().err
