"""Plot benchmarks/results/h200.json into small PNGs (reads measured rows only).

    python3 benchmarks/plot_results.py [benchmarks/results/h200.json]
"""

import json
import pathlib
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

HERE = pathlib.Path(__file__).resolve().parent / "results"


def main(path=HERE / "h200.json"):
    data = json.loads(pathlib.Path(path).read_text())
    rows = data["rows"]

    loop = sorted((r for r in rows if r["kind"] == "draft_loop" and r["scenario"] == "seed"),
                  key=lambda r: r["batch"])
    fig, ax = plt.subplots(figsize=(4.2, 3))
    bs = [r["batch"] for r in loop]
    for key, label in (("upstream_us", "upstream-style (host metadata)"),
                       ("fa3_spec_us", "fa3_spec (one graph)"), ("floor_us", "floor (attention only)")):
        ax.plot(bs, [r[key] for r in loop], marker="o", label=label)
    ax.set(xscale="log", xlabel="batch", ylabel="µs per draft iteration",
           title="Draft loop, P=2 K=8 S=5, 4K ctx")
    ax.set_xticks(bs, [str(b) for b in bs])
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(HERE / "draft_loop_seed.png", dpi=90)

    meta = [r for r in rows if r["kind"] == "metadata"]
    labels = [f"{r['scenario']} P{r['page_size']} K{r['topk']} b{r['batch']}" for r in meta]
    fig, ax = plt.subplots(figsize=(7, 3.6))
    x = range(len(meta))
    for off, key, label in ((-0.27, "upstream_host_us", "upstream-style host"),
                            (0.0, "compiled_eager_host_us", "compiled, eager launch"),
                            (0.27, "graph_device_us", "captured graph (device)")):
        ax.bar([i + off for i in x], [r[key] for r in meta], width=0.27, label=label)
    ax.set(yscale="log", ylabel="µs per iteration", title="Metadata of one draft iteration (all steps + verify + extend)")
    ax.set_xticks(list(x), labels, fontsize=6, rotation=40, ha="right")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(HERE / "metadata_cost.png", dpi=90)


if __name__ == "__main__":
    main(*sys.argv[1:])
