"""Loading a Llama-3-8B-shaped checkpoint: load time against reading its files, then the loop.

    python3 benchmarks/load_checkpoint.py --reps 2 --json load_checkpoint.json   # GPU
    python3 benchmarks/load_checkpoint.py --smoke --json /tmp/load_smoke.json     # CPU, tiny

1. **Build** (skipped when ``--dir`` already holds them): transformers'
   ``LlamaForCausalLM`` with the preset's shapes (``llama3-8b``: Llama-3-8B's,
   plus Llama 3.1's llama3 RoPE scaling), random weights, made on the device
   in bf16 and written by ``save_pretrained`` (safetensors, 5 GB shards);
   and a random EAGLE-3 head in sglang's layout (draft vocabulary 32000).
2. **Read**: every weight file read into host memory, warm page cache (one
   untimed read first; best of ``--reps``), and the same plus a copy of the
   bytes to the device: the floor a loader cannot beat.
3. **Load**: `fa3_spec.eagle.from_pretrained` onto the device, in a fresh
   process per repetition (best of ``--reps``), with that process's peak
   growth of anonymous host memory (its own, sampled from /proc every 5 ms)
   over its state after importing torch and starting CUDA, against one
   layer; mapped file pages (page cache) are reported apart. Target: load
   <= 1.3x read + copy; anonymous growth about one layer (on CUDA; on CPU
   the model itself is host memory).
4. **Loop**: `EagleEngine` with scripted acceptance (the same work whatever
   the weights say; outputs are not the model's) on (a) the preset's random
   models, (b) the loaded target with a random EAGLE draft (same shapes as
   (a): tokens/s should be equal within noise) and (c) the loaded target with
   the EAGLE-3 head.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import resource
import subprocess
import sys
import threading
import time

import torch

from fa3_spec.eagle import PRESETS, from_pretrained, make_models

import runs
import workload


def hf_config(shape, num_layers: int, max_positions: int) -> dict:
    """Llama 3.1's config for ``shape`` (llama3 RoPE scaling over an original
    context of 8192, or half the table when that is shorter)."""
    rope = dict(rope_type="llama3", rope_theta=shape.rope_theta, factor=8.0, low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=min(8192, max_positions // 2))
    return dict(
        architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=shape.vocab_size,
        hidden_size=shape.hidden_size, intermediate_size=shape.intermediate_size,
        num_hidden_layers=num_layers, num_attention_heads=shape.num_heads,
        num_key_value_heads=shape.num_kv_heads, head_dim=shape.head_dim,
        rms_norm_eps=shape.rms_eps, max_position_embeddings=max_positions,
        rope_parameters=rope,
        tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=None)


def build(target_dir: pathlib.Path, head_dir: pathlib.Path, shape, num_layers: int, *,
          dtype, device, draft_vocab: int, max_positions: int) -> float:
    """Write the random target (transformers) and EAGLE-3 head; seconds taken."""
    import transformers
    from safetensors.torch import save_file

    start = time.perf_counter()
    cfg = transformers.LlamaConfig(**hf_config(shape, num_layers, max_positions))
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = transformers.LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(before)
    model.save_pretrained(target_dir, max_shard_size="5GB")
    del model
    h, i = shape.hidden_size, shape.intermediate_size
    hq, hkv = shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim
    g = torch.Generator().manual_seed(0)

    def w(*dims):
        return (torch.randn(dims, generator=g) * dims[-1] ** -0.5).to(dtype)

    aux = [1, num_layers // 2 - 1, num_layers - 4] if num_layers >= 4 else [0] * 3
    weights = {"fc.weight": w(h, 3 * h), "norm.weight": torch.ones(h, dtype=dtype),
               "lm_head.weight": w(draft_vocab, h),
               "d2t": torch.zeros(draft_vocab, dtype=torch.int64),  # the first V_d tokens
               "midlayer.self_attn.q_proj.weight": w(hq, 2 * h),
               "midlayer.self_attn.k_proj.weight": w(hkv, 2 * h),
               "midlayer.self_attn.v_proj.weight": w(hkv, 2 * h),
               "midlayer.self_attn.o_proj.weight": w(h, hq),
               "midlayer.mlp.gate_proj.weight": w(i, h), "midlayer.mlp.up_proj.weight": w(i, h),
               "midlayer.mlp.down_proj.weight": w(h, i)}
    for norm in ("input_layernorm", "hidden_norm", "post_attention_layernorm"):
        weights[f"midlayer.{norm}.weight"] = torch.ones(h, dtype=dtype)
    head_cfg = {k: v for k, v in hf_config(shape, 1, max_positions).items()}
    head_cfg.update(architectures=["LlamaForCausalLMEagle3"], draft_vocab_size=draft_vocab,
                    eagle_config={"eagle_aux_hidden_state_layer_ids": aux},
                    dtype=str(dtype).replace("torch.", ""))
    head_dir.mkdir(parents=True, exist_ok=True)
    (head_dir / "config.json").write_text(json.dumps(head_cfg, indent=1))
    save_file(weights, head_dir / "model.safetensors")
    return time.perf_counter() - start


def read_files(target_dir: pathlib.Path, device, reps: int) -> dict:
    """Best seconds to read every weight file (warm cache), and with a device copy."""
    files = sorted(target_dir.glob("*.safetensors"))
    total = sum(f.stat().st_size for f in files)
    for f in files:  # warm the page cache
        f.read_bytes()

    def once(copy: bool) -> float:
        start = time.perf_counter()
        for f in files:
            data = bytearray(f.stat().st_size)
            with open(f, "rb", buffering=0) as fh:
                fh.readinto(data)
            if copy:
                torch.frombuffer(data, dtype=torch.uint8).to(device)
        if torch.device(device).type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - start

    return dict(bytes=total, files=len(files), read_s=min(once(False) for _ in range(reps)),
                read_and_copy_s=min(once(True) for _ in range(reps)))


def _rss() -> dict:
    """Resident bytes of this process: anonymous (its own memory) and file-backed
    (mapped checkpoint pages: page cache, reclaimable), from /proc/self/status."""
    out = {}
    for line in pathlib.Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("RssAnon", "RssFile"):
            out[key] = int(value.split()[0]) * 1024
    return out


def _load_child(target_dir: str, device: str) -> None:
    """In a fresh process: the load's seconds and its peak host memory growth
    (sampled every 5 ms), printed as JSON."""
    if torch.device(device).type == "cuda":
        torch.zeros(1, device=device)  # CUDA context first: not the loader's memory
    base, peak, done = _rss(), dict(RssAnon=0, RssFile=0), threading.Event()

    def sample():
        while not done.wait(0.005):
            for k, v in _rss().items():
                peak[k] = max(peak[k], v)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    start = time.perf_counter()
    models = from_pretrained(target_dir, draft="random", device=device)
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    done.set()
    sampler.join()
    t = models.target
    layer = sum(getattr(t.layers[0], f.name).numel() * t.embed.element_size()
                for f in dataclasses.fields(t.layers[0]))
    print(json.dumps(dict(load_s=seconds, anon_growth=peak["RssAnon"] - base["RssAnon"],
                          file_mapped_peak=peak["RssFile"] - base["RssFile"],
                          maxrss=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                          layer_bytes=layer)))


def load(target_dir: pathlib.Path, device, reps: int) -> dict:
    """The best of ``reps`` loads, each in a fresh process (`_load_child`)."""
    done = []
    for _ in range(reps):
        out = subprocess.run([sys.executable, __file__, "--_load-child", str(target_dir),
                              "--device", str(device)], check=True, capture_output=True,
                             text=True, env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
        done.append(json.loads(out.stdout.strip().splitlines()[-1]))
    best = min(done, key=lambda r: r["load_s"])
    return dict(best, load_s_all=[r["load_s"] for r in done])


def loop(models, args, label: str) -> dict:
    """Tokens/s of `EagleEngine.run` over ``models`` with scripted acceptance (one bucket)."""
    lc = workload.loop_config(args.config, batch=args.batch, context=args.context,
                              max_new=args.new, pool_rows=2 * args.batch, attention_backend=args.attention_backend)
    cuda = torch.device(args.device).type == "cuda"
    eng = workload.engine(lc, models, scripted=True, max_reqs=2 * args.batch,
                          buckets=[args.batch], graphs=cuda, compile_backend=args.compile_backend,
                          device=args.device)
    if cuda:
        eng.capture()
    for prompt in workload.random_prompts(args.batch, args.context, models.vocab_size, seed=0):
        eng.submit(prompt, args.new)
    eng.step()  # admission (prefill) and the first iteration: not timed
    if cuda:
        torch.cuda.synchronize()
    start, iters = time.perf_counter(), eng.stats.iterations
    done = eng.run()
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    tokens = sum(len(o) for o in done.values())
    return dict(models=label, draft_attention=lc.draft_attention, tokens=tokens,
                iterations=eng.stats.iterations - iters,
                seconds=seconds, tokens_per_s=tokens / seconds,
                acceptance=workload.SCRIPTED)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny preset shapes, seconds")
    ap.add_argument("--dir", default=None, help="where the checkpoints are (built if absent)")
    ap.add_argument("--rebuild", action="store_true")
    ap.add_argument("--num-layers", type=int, default=None, help="override the preset's depth")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--config", default="16,4,5,8", help="P,topk,steps,N of the loop")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--context", type=int, default=512, help="prompt tokens per request")
    ap.add_argument("--new", type=int, default=256, help="new tokens per request")
    ap.add_argument("--device", default=None)
    ap.add_argument("--compile-backend", default="auto",
                    help="the engine's compile backend (auto: inductor on CUDA; none: eager "
                         "capture, minutes faster to start)")
    ap.add_argument("--json", metavar="PATH")
    ap.add_argument("--_load-child", dest="load_child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.load_child:
        _load_child(args.load_child, args.device)
        return 0
    if args.smoke:
        preset, dtype = "tiny", torch.float32
        args.device, args.attention_backend = args.device or "cpu", "torch"
        args.reps, args.batch, args.context, args.new = 1, 2, 12, 8
        args.config = "2,4,3,6"
        torch.set_num_threads(1)
    else:
        preset, dtype = "llama3-8b", torch.bfloat16
        args.device = args.device or "cuda"
        args.attention_backend = "fa3" if args.device == "cuda" else "torch"
    args.config = workload.parse_config(args.config)
    shape = PRESETS[preset]
    layers = args.num_layers or shape.num_layers
    root = pathlib.Path(args.dir or f"/tmp/fa3_spec_load_{preset}_{layers}")
    target_dir, head_dir = root / "target", root / "eagle3"
    out = dict(command=runs.command_line("load_checkpoint.py", argv), torch=torch.__version__,
               device=runs.device_name(args.device),
        preset=preset, num_layers=layers, dtype=str(dtype))
    if args.rebuild or not (target_dir / "config.json").is_file():
        out["build_s"] = build(target_dir, head_dir, shape, layers, dtype=dtype,
                               device=args.device, draft_vocab=min(32000, shape.vocab_size // 2),
                               max_positions=256 if args.smoke else 131072)

    def save():  # after every stage, so that a run cut short keeps what it measured
        if args.json:
            runs.write_json(args.json, out)

    out["read"] = read_files(target_dir, args.device, args.reps)
    out["load"] = load(target_dir, args.device, args.reps)
    out["load_over_read_and_copy"] = out["load"]["load_s"] / out["read"]["read_and_copy_s"]
    print(f"read {out['read']['bytes'] / 2**30:.2f} GiB: {out['read']['read_s']:.2f} s, "
          f"+ copy {out['read']['read_and_copy_s']:.2f} s | load {out['load']['load_s']:.2f} s "
          f"({out['load_over_read_and_copy']:.2f}x), host anonymous memory growth "
          f"{out['load']['anon_growth'] / 2**30:.2f} GiB (one layer "
          f"{out['load']['layer_bytes'] / 2**30:.2f} GiB; mapped file pages "
          f"{out['load']['file_mapped_peak'] / 2**30:.2f} GiB)", flush=True)
    save()

    rows = out["loop"] = []
    models_of = [
        ("preset random", lambda: make_models(preset, draft="random", dtype=dtype,
                                              device=args.device, num_layers=layers)),
        ("loaded + random draft", lambda: from_pretrained(target_dir, draft="random",
                                                          device=args.device)),
        ("loaded + EAGLE-3 head", lambda: from_pretrained(target_dir, head_dir,
                                                          device=args.device))]
    for label, make in models_of:
        models = make()
        rows.append(loop(models, args, label))
        del models
        if args.device == "cuda":
            torch.cuda.empty_cache()
        print(f"{label}: {rows[-1]['tokens_per_s']:.1f} tokens/s ({rows[-1]['acceptance']})",
              flush=True)
        save()
    out["loaded_over_preset_tokens_per_s"] = rows[1]["tokens_per_s"] / rows[0]["tokens_per_s"]
    save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
