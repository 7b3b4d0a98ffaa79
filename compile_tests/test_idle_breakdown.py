"""benchmarks/gpu_trace.py: the split of a trace's GPU span, on synthetic traces.

The profile (``loop.py idle``) needs CUDA; on CPU it exits 2. What is checked
here is the accounting every GPU figure of the profile rests on: busy time is
the union of the ops (overlaps counted once), a gap between two ops of one
``cudaGraphLaunch`` is idle inside the graph, any other gap is idle between
launches, and the three add up to the span.
"""

import pathlib
import sys

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import gpu_trace  # noqa: E402
import loop  # noqa: E402


def _launch(corr, name="cudaGraphLaunch"):
    return dict(cat="cuda_runtime", name=name, ts=0, dur=1, args=dict(correlation=corr))


def _op(name, ts, dur, corr, cat="kernel"):
    return dict(cat=cat, name=name, ts=ts, dur=dur, args=dict(correlation=corr))


def test_gaps_inside_a_graph_and_between_launches_add_up_to_the_span():
    events = [
        _launch(1), _launch(2), _launch(3, "cudaLaunchKernel"),
        _op("nvjet_tst_gemm", 100, 50, 1),
        _op("triton_red_fused_norm", 140, 20, 1),   # overlaps the GEMM: busy 100-160
        _op("flash_fwd_kernel", 165, 10, 1),        # 5 us inside graph 1
        _op("Memcpy DtoD", 180, 4, 1, cat="gpu_memcpy"),  # 5 us inside graph 1
        _op("nvjet_tst_gemm", 200, 30, 2),          # 16 us: the next launch
        _op("elementwise_kernel", 240, 5, 3),       # 10 us: an eager op
    ]
    r = gpu_trace.breakdown(events, top=2)
    assert r["span_us"] == 145.0
    assert r["busy_us"] == 60 + 10 + 4 + 30 + 5
    assert r["idle_in_graph_us"] == 10.0
    assert r["idle_between_launches_us"] == 26.0
    assert r["busy_us"] + r["idle_in_graph_us"] + r["idle_between_launches_us"] == r["span_us"]
    assert abs(r["busy_frac"] + r["idle_in_graph_frac"] + r["idle_between_launches_frac"] - 1) < 1e-3
    assert r["graph_launches"] == 2 and r["ops"] == 6
    assert r["by_category_us"] == {"attention": 10.0, "copy": 4.0, "gemm": 80.0, "other": 5.0,
                                   "triton": 20.0}
    assert [(g["gap_us"], g["kind"]) for g in r["largest_gaps"]] == [(16.0, "between"),
                                                                     (10.0, "between")]
    assert r["largest_gaps"][0]["before"] == "Memcpy DtoD"
    assert [(k["name"], k["count"], k["total_us"]) for k in r["kernels"][:2]] == [
        ("nvjet_tst_gemm", 2, 80.0), ("triton_red_fused_norm", 1, 20.0)]
    assert sum(k["total_us"] for k in r["kernels"]) == sum(r["by_category_us"].values())


def test_the_kernel_list_is_cut_to_top_kernels_or_kept_whole_where_it_is_none():
    events = [_launch(1)] + [_op(f"k{i}", 10 * i, i + 1, 1) for i in range(40)]
    assert [k["name"] for k in gpu_trace.breakdown(events, top_kernels=2)["kernels"]] == ["k39", "k38"]
    assert len(gpu_trace.breakdown(events)["kernels"]) == 30
    assert len(gpu_trace.breakdown(events, top_kernels=None)["kernels"]) == 40


def test_kernel_names_keep_only_their_leading_template_names():
    name = gpu_trace.kernel_name
    assert name("void flash::FlashAttnFwdSm90<Shape<_64>, true>(Params)") == \
        "void flash::FlashAttnFwdSm90<Shape<_64>>"
    assert name("void cutlass::device_kernel<flash::FlashAttnFwdCombine<X<1>>>(P)") != \
        name("void cutlass::device_kernel<flash::FlashAttnFwdSm90<X<1>>>(P)")
    assert name("void k<a<b<c<d>>>>()") == "void k<a<b<c>>>"  # depth 3
    assert name("void at::native::vectorized_elementwise_kernel<4, at::native::Add, A>(int)") != \
        name("void at::native::vectorized_elementwise_kernel<4, at::native::Mul, A>(int)")
    assert name("void at::native::(anonymous namespace)::CatArrayBatchedCopy<T, 1>(T*)") == \
        "void at::native::CatArrayBatchedCopy<T>"
    assert name("void at::native::index_elementwise_kernel<128, 4>(int)") == \
        "void at::native::index_elementwise_kernel"  # numbers only: no name
    assert name("triton_poi_fused_add_0") == "triton_poi_fused_add_0"
    assert len(name("x" * 500)) == 96


def test_a_gap_between_two_eager_launches_of_one_correlation_is_not_a_graphs():
    events = [_launch(7, "cudaLaunchKernel"), _op("a", 0, 5, 7), _op("b", 8, 2, 7)]
    r = gpu_trace.breakdown(events)
    assert r["idle_in_graph_us"] == 0.0 and r["idle_between_launches_us"] == 3.0


def test_a_trace_without_gpu_ops_is_all_zeros():
    r = gpu_trace.breakdown([_launch(1), dict(cat="cpu_op", name="aten::mm", ts=0, dur=9)])
    assert r["span_us"] == 0.0 and r["ops"] == 0 and r["largest_gaps"] == []


@pytest.mark.parametrize("argv", [[], ["--configs", "2,8,5"]])
def test_the_profile_exits_2_without_cuda_or_with_a_bad_config(argv, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert loop.main(["idle", *argv]) == 2
    err = capsys.readouterr().err
    assert ("--configs" in err) if argv else ("needs CUDA" in err)


def test_the_library_s_own_kernels_count_in_their_category_by_exact_name():
    kinds = {n: gpu_trace.category(_op(n, 0, 1, 1)) for n in (
        "skinny_mm_kernel", "sum_partials_kernel", "expand_attention_kernel",
        "rope_store_kv_kernel", "triton_red_fused__to_copy_add_mean_rsqrt_skinny_mm_0",
        "triton_poi_fused_mul_silu_skinny_mm_split_5")}
    assert kinds == {"skinny_mm_kernel": "gemm", "sum_partials_kernel": "gemm",
                     "expand_attention_kernel": "attention", "rope_store_kv_kernel": "copy",
                     # inductor names a fused kernel after the op it feeds: not a GEMM
                     "triton_red_fused__to_copy_add_mean_rsqrt_skinny_mm_0": "triton",
                     "triton_poi_fused_mul_silu_skinny_mm_split_5": "triton"}
