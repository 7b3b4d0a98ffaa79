"""Plot benchmarks/results/h200.json into small PNGs (reads measured rows only).

    python3 benchmarks/plot_results.py [benchmarks/results/h200.json]

Writes ``metadata_cost.png`` (bench.py's TABLE scenarios) and ``scaling.png``
(draft loop and metadata against batch, context and topk around the "seed"
scenario's point P = 2, topk = 8, 5 steps, 4K context, batch 8). A point missing
from the JSON is missing from the plot.
"""

import json
import pathlib
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

HERE = pathlib.Path(__file__).resolve().parent / "results"
SEED = dict(page_size=2, topk=8, num_steps=5, batch=8, context=4096)
AXES = (("batch", "scale-batch"), ("context", "scale-context"), ("topk", "scale-topk"))
LOOP = (("upstream_us", "upstream-style"), ("fa3_spec_us", "fa3_spec, one graph"),
        ("floor_us", "floor (attention only)"))
META = (("upstream_host_us", "upstream-style host"), ("graph_device_us", "fa3_spec graph, device"))


def _curve(rows, kind, axis, scenario):
    """Rows of ``scenario`` plus the "seed" point, along ``axis`` (others at its values)."""
    fixed = {k: v for k, v in SEED.items() if k != axis}
    pts = [r for r in rows if r["kind"] == kind and r["scenario"] in (scenario, "seed")
           and all(r[k] == v for k, v in fixed.items())]
    return sorted(pts, key=lambda r: r[axis])


def scaling(rows):
    fig, axes = plt.subplots(2, 3, figsize=(9, 5.2))
    for col, (axis, scenario) in enumerate(AXES):
        for row, (kind, series, ylabel) in enumerate((
                ("draft_loop", LOOP, "draft loop µs / iteration"),
                ("metadata", META, "metadata µs / iteration"))):
            ax = axes[row][col]
            pts = _curve(rows, kind, axis, scenario)
            xs = [r[axis] for r in pts]
            for key, label in series:
                ax.plot(xs, [r[key] for r in pts], marker="o", ms=3, label=label)
            ax.set(xscale="log" if axis != "topk" else "linear", yscale="log", xlabel=axis)
            if col == 0:
                ax.set_ylabel(ylabel)
            if xs:
                ax.set_xticks(xs, [f"{x // 1024}K" if axis == "context" else str(x) for x in xs],
                              fontsize=7)
            ax.minorticks_off()
            if col == 0:
                ax.legend(fontsize=6)
    fig.suptitle("H200, FA3: P=2, topk=8, 5 steps; one parameter varied from batch 8 / 4K / topk 8",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(HERE / "scaling.png", dpi=80)


def metadata_cost(rows):
    meta = [r for r in rows if r["kind"] == "metadata" and not r["scenario"].startswith("scale")]
    labels = [f"{r['scenario']} P{r['page_size']} K{r['topk']} b{r['batch']}" for r in meta]
    fig, ax = plt.subplots(figsize=(7, 3.4))
    x = range(len(meta))
    for off, key, label in ((-0.27, "upstream_host_us", "upstream-style host"),
                            (0.0, "compiled_eager_host_us", "compiled, eager launch"),
                            (0.27, "graph_device_us", "captured graph (device)")):
        ax.bar([i + off for i in x], [r[key] for r in meta], width=0.27, label=label)
    ax.set(yscale="log", ylabel="µs per iteration",
           title="Metadata of one draft iteration (all steps + verify + extend)")
    ax.set_xticks(list(x), labels, fontsize=6, rotation=40, ha="right")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(HERE / "metadata_cost.png", dpi=80)


def main(path=HERE / "h200.json"):
    rows = json.loads(pathlib.Path(path).read_text())["rows"]
    scaling(rows)
    metadata_cost(rows)


if __name__ == "__main__":
    main(*sys.argv[1:])
