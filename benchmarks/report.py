"""Markdown tables from benchmarks/results/h200.json (what RESULTS.md shows).

    python3 benchmarks/report.py [benchmarks/results/h200.json]
"""

import json
import pathlib
import sys

HERE = pathlib.Path(__file__).resolve().parent / "results"


def _table(head, rows):
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    out += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(out)


def _ctx(r):
    return f"{r['context'] // 1024}K"


def metadata(rows):
    head = ["scenario", "P", "K", "S", "N", "batch", "ctx", "upstream-style host µs (IQR)",
            "compiled, eager host µs", "graph launch µs", "graph device µs (IQR)",
            "upstream / graph device", "kernels / iteration"]
    return _table(head, [
        [r["scenario"], r["page_size"], r["topk"], r["num_steps"], r["num_draft_tokens"], r["batch"],
         _ctx(r), f"{r['upstream_host_us']:.0f} ({r['upstream_host_iqr_us']:.0f})",
         f"{r['compiled_eager_host_us']:.0f}", f"{r['graph_launch_us']:.1f}",
         f"{r['graph_device_us']:.1f} ({r['graph_device_iqr_us']:.1f})",
         f"{r['upstream_over_graph_device']:.0f}×", r["kernels_per_iteration"]]
        for r in rows if r["kind"] == "metadata"])


def draft_loop(rows):
    head = ["scenario", "P", "K", "S", "batch", "ctx", "upstream-style µs (IQR)", "fa3_spec µs (IQR)",
            "floor µs (IQR)", "upstream / fa3_spec", "fa3_spec / floor − 1 (device)",
            "metadata kernels / step"]
    return _table(head, [
        [r["scenario"], r["page_size"], r["topk"], r["num_steps"], r["batch"], _ctx(r),
         f"{r['upstream_us']:.0f} ({r['upstream_iqr_us']:.0f})",
         f"{r['fa3_spec_us']:.0f} ({r['fa3_spec_iqr_us']:.0f})",
         f"{r['floor_us']:.0f} ({r['floor_iqr_us']:.0f})", f"{r['upstream_over_fa3_spec']:.2f}×",
         f"{100 * r['fa3_spec_over_floor_minus_1']:.1f}%", r["metadata_kernels_per_step"]]
        for r in rows if r["kind"] == "draft_loop"])


def verify(rows):
    head = ["config", "P", "K", "N", "batch", "ctx", "layers", "upstream-style µs (IQR)",
            "fa3_spec µs (IQR)", "floor µs (IQR)", "upstream / fa3_spec", "fa3_spec / floor − 1 (device)"]
    return _table(head, [
        [r["scenario"], r["page_size"], r["topk"], r["num_draft_tokens"], r["batch"], _ctx(r), r["layers"],
         f"{r['upstream_us']:.0f} ({r['upstream_iqr_us']:.0f})",
         f"{r['fa3_spec_us']:.0f} ({r['fa3_spec_iqr_us']:.0f})",
         f"{r['floor_us']:.0f} ({r['floor_iqr_us']:.0f})", f"{r['upstream_over_fa3_spec']:.2f}×",
         f"{100 * r['fa3_spec_over_floor_minus_1']:.1f}%"]
        for r in rows if r["kind"] == "verify"])


def compile_rows(rows):
    head = ["step", "compiles (cold / warm)", "cold capture s", "warm capture s", "slowest bucket s",
            "replay rel. err vs eager"]
    rows = [r for r in rows if r["kind"] == "compile"]
    body = [[r["mode"], f"{r['cold_compiles']} / {r['warm_compiles']}", r["cold_capture_s"],
             r["warm_capture_s"], r["max_bucket_capture_s"], f"{r['replay_rel_err']:.1e}"] for r in rows]
    body.append(["**all four**", "", f"**{sum(r['cold_capture_s'] for r in rows):.1f}**",
                 f"**{sum(r['warm_capture_s'] for r in rows):.1f}**", "", ""])
    return _table(head, body)


def main(path=HERE / "h200.json"):
    rows = json.loads(pathlib.Path(path).read_text())["rows"]
    for title, fn in (("metadata", metadata), ("draft_loop", draft_loop), ("verify", verify),
                      ("compile", compile_rows)):
        print(f"### {title}\n\n{fn(rows)}\n")


if __name__ == "__main__":
    main(*sys.argv[1:])
