"""Loading Hugging Face checkpoints: transformers is the oracle (CPU, float64).

Tiny random Llama checkpoints are written by transformers itself
(``LlamaForCausalLM(config).save_pretrained``), every weight redrawn,
norms included (a loader that drops a norm fails), over GQA with an
explicit ``head_dim`` and llama3 RoPE scaling, and tied MHA embeddings with
odd sizes. Tolerance: logits agree with transformers' to 1e-5 absolute
(logits of magnitude ~10; transformers computes RoPE's cos/sin in float32
even for a float64 model, and `greedy_generate` hands logits out as
float32), and the greedy tokens are the same token for token.

The EAGLE heads are written in their published key layouts (sglang's
``llama_eagle.py`` / ``llama_eagle3.py``); the oracle for their forward is a
dense re-implementation in this file of the published definition, which
uses transformers' own RoPE for the head's config.
"""

import dataclasses
import json

import pytest
import torch

transformers = pytest.importorskip("transformers", minversion="5")  # rope_parameters configs
safetensors_torch = pytest.importorskip("safetensors.torch")

import fa3_spec  # noqa: E402
from fa3_spec.eagle import (  # noqa: E402
    CheckpointError, Eagle3Draft, EagleDraft, EagleEngine, LoopConfig, from_pretrained,
    greedy_generate,
)
from fa3_spec.eagle import cli  # noqa: E402
from helpers import one_prompt_prefill  # noqa: E402
from transformers.models.llama.modeling_llama import (  # noqa: E402
    LlamaRotaryEmbedding, apply_rotary_pos_emb,
)

ATOL = 1e-5

LLAMA3 = dict(rope_type="llama3", rope_theta=5000.0, factor=8.0, low_freq_factor=1.0,
              high_freq_factor=4.0, original_max_position_embeddings=32)

#: name -> LlamaConfig arguments.
CONFIGS = {
    # GQA, head_dim given (not hidden / heads), llama3 scaling that bites at
    # these positions (original context 32), odd vocabulary.
    "gqa-llama3": dict(vocab_size=101, hidden_size=40, intermediate_size=72, num_hidden_layers=4,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                       rms_norm_eps=1e-5, rope_parameters=LLAMA3, tie_word_embeddings=False),
    # Tied embeddings, MHA, odd hidden size (head_dim = 36 / 3 = 12), plain RoPE.
    "tied-mha-odd": dict(vocab_size=67, hidden_size=36, intermediate_size=50, num_hidden_layers=3,
                         num_attention_heads=3, num_key_value_heads=3, rms_norm_eps=1e-6,
                         rope_parameters=dict(rope_type="default", rope_theta=10000.0),
                         tie_word_embeddings=True),
}

PROMPTS = [[5, 7, 9], [1], list(range(20, 31))]


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    yield


def randomize_(model, seed):
    """Redraw every weight: norms around 1, matrices scaled by fan-in, so the
    logits are sharp enough that greedy decoding has no near-ties."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            x = torch.randn(p.shape, generator=g, dtype=torch.float64)
            if name.endswith("norm.weight"):
                x = 1 + 0.3 * x
            elif "embed" not in name:
                x = x * p.shape[1] ** -0.5 * (3 if "lm_head" in name else 1)
            p.copy_(x)
    return model


def hf_llama(name, seed=0, **overrides):
    cfg = transformers.LlamaConfig(max_position_embeddings=256, bos_token_id=None,
                                   eos_token_id=None, pad_token_id=None,
                                   **{**CONFIGS[name], **overrides})
    return randomize_(transformers.LlamaForCausalLM(cfg).to(torch.float64).eval(), seed)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """name -> (transformers model, directory it was saved to)."""
    out = {}
    for i, name in enumerate(CONFIGS):
        model = hf_llama(name, seed=i)
        path = tmp_path_factory.mktemp(name)
        model.save_pretrained(path)
        out[name] = (model, path)
    return out


def hf_greedy(model, prompt, steps):
    out = model.generate(torch.tensor([prompt]), max_new_tokens=steps, do_sample=False,
                         output_logits=True, return_dict_in_generate=True, pad_token_id=0)
    return out.sequences[0, len(prompt):].tolist(), [s[0].float() for s in out.logits]


# ----------------------------------------------------------------- target parity
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_loaded_target_decodes_as_transformers_does(checkpoints, name):
    hf, path = checkpoints[name]
    models = from_pretrained(path)
    assert models.dtype == torch.float64  # the checkpoint's dtype
    logits = []
    ours = greedy_generate(models, PROMPTS, [8] * len(PROMPTS), page_size=2,
                           attention_backend="torch",
                           logits_out=logits)
    for i, prompt in enumerate(PROMPTS):
        tokens, hf_logits = hf_greedy(hf, prompt, 8)
        assert ours[i] == tokens
        for step, want in enumerate(hf_logits):  # step 0: the prefill's last position
            torch.testing.assert_close(logits[step][i], want, rtol=0, atol=ATOL)


def test_tied_and_untied_heads_and_the_one_conversion(checkpoints):
    for name, (hf, path) in checkpoints.items():
        t = from_pretrained(path).target
        sd = hf.state_dict()
        assert torch.equal(t.embed, sd["model.embed_tokens.weight"])
        assert torch.equal(t.lm_head, sd["lm_head.weight"].t())  # tied: the embedding's
        assert t.lm_head.data_ptr() != t.embed.data_ptr()  # a transposed copy, not a view
        layer, pre = t.layers[1], "model.layers.1."
        want = fa3_spec.eagle.models.LayerWeights.from_projections(
            **{k: sd[pre + f"self_attn.{k}_proj.weight"] for k in "qkvo"},
            **{k: sd[pre + f"mlp.{k}_proj.weight"] for k in ("gate", "up", "down")},
            attn_norm=sd[pre + "input_layernorm.weight"],
            mlp_norm=sd[pre + "post_attention_layernorm.weight"])
        for field in dataclasses.fields(layer):
            assert torch.equal(getattr(layer, field.name), getattr(want, field.name)), field.name
        assert torch.equal(t.norm, sd["model.norm.weight"])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_weights_load_in_the_checkpoint_dtype_or_the_one_asked(tmp_path, dtype):
    hf = hf_llama("tied-mha-odd").to(dtype)
    hf.save_pretrained(tmp_path)
    t = from_pretrained(tmp_path).target
    assert t.embed.dtype == t.layers[0].wqkv.dtype == t.lm_head.dtype == dtype
    assert torch.equal(t.embed, hf.state_dict()["model.embed_tokens.weight"])
    up = from_pretrained(tmp_path, dtype=torch.float64).target
    assert torch.equal(up.norm, hf.state_dict()["model.norm.weight"].double())


# ----------------------------------------------------------------- the loop on a loaded target
def make_engine(models, *, p=2, k=4, s=3, n=6, max_bs=2, max_new=12, max_prompt=16):
    spec = fa3_spec.SpecConfig(page_size=p, topk=k, num_steps=s, num_draft_tokens=n,
                               max_bs=max_bs, max_context_len=max_prompt + max_new + n)
    spec = dataclasses.replace(spec, num_pages=spec.pool_pages(2 * max_bs, "branch"))
    return EagleEngine(LoopConfig(spec, max_new_tokens=max_new, attention_backend="torch"), models,
                       max_reqs=2 * max_bs)


def run_loop(models, prompts, news, eos=-1, **kw):
    eng = make_engine(models, **kw)
    ids = [eng.submit(p, m, eos_id=eos) for p, m in zip(prompts, news)]
    out = eng.run()
    return [out[i] for i in ids], eng.stats.mean_accept_len, eng


@pytest.mark.parametrize("draft", ["derived", "random"])
def test_eagle_loop_on_a_loaded_target_is_exact_and_leaves_it_as_loaded(checkpoints, draft):
    hf, path = checkpoints["gqa-llama3"]
    models = from_pretrained(path, draft=draft)
    before = [w.clone() for w in models.target.layers]
    news = [12, 9, 12]
    got, mean, _ = run_loop(models, PROMPTS, news)
    assert got == greedy_generate(models, PROMPTS, news, page_size=2, attention_backend="torch")
    sd = hf.state_dict()
    for i, (w, was) in enumerate(zip(models.target.layers, before)):
        assert torch.equal(w.wo, was.wo) and torch.equal(w.w_down, was.w_down)
        assert torch.equal(w.wo, sd[f"model.layers.{i}.self_attn.o_proj.weight"].t())
    print(f"{draft} draft on a loaded target: mean accept length {mean:.2f}")


# ----------------------------------------------------------------- files and errors
def test_sharded_safetensors_and_bin_checkpoints_load_the_same_weights(checkpoints, tmp_path):
    hf, path = checkpoints["gqa-llama3"]
    ref = from_pretrained(path).target
    sharded = tmp_path / "sharded"
    hf.save_pretrained(sharded, max_shard_size="20KB")
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 3
    binary = tmp_path / "bin"
    binary.mkdir()
    (binary / "config.json").write_text((path / "config.json").read_text())
    sd = hf.state_dict()
    names = sorted(sd)
    halves = {"pytorch_model-00001-of-00002.bin": names[::2],
              "pytorch_model-00002-of-00002.bin": names[1::2]}
    for file, keys in halves.items():
        torch.save({k: sd[k] for k in keys}, binary / file)
    (binary / "pytorch_model.bin.index.json").write_text(json.dumps(
        {"weight_map": {k: f for f, keys in halves.items() for k in keys}}))
    for d in (sharded, binary):
        t = from_pretrained(d).target
        assert torch.equal(t.lm_head, ref.lm_head) and torch.equal(t.embed, ref.embed)
        for a, b in zip(t.layers, ref.layers):
            assert all(torch.equal(getattr(a, f.name), getattr(b, f.name))
                       for f in dataclasses.fields(a))


def test_a_missing_shard_is_named(checkpoints, tmp_path):
    hf, _ = checkpoints["gqa-llama3"]
    hf.save_pretrained(tmp_path, max_shard_size="20KB")
    shard = sorted(tmp_path.glob("*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(CheckpointError, match=f"shard '{shard.name}', which is missing"):
        from_pretrained(tmp_path)


def test_a_non_float_tensor_is_refused_with_its_name(checkpoints, tmp_path):
    _, path = checkpoints["tied-mha-odd"]
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    sd = safetensors_torch.load_file(path / "model.safetensors")
    sd["model.layers.1.mlp.up_proj.weight"] = sd["model.layers.1.mlp.up_proj.weight"].to(torch.int8)
    safetensors_torch.save_file(sd, tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"'model.layers.1.mlp.up_proj.weight' has dtype "
                                              r"torch.int8"):
        from_pretrained(tmp_path)


def test_a_tensor_of_the_wrong_shape_is_named(checkpoints, tmp_path):
    _, path = checkpoints["tied-mha-odd"]
    config = json.loads((path / "config.json").read_text())
    config["intermediate_size"] = 51
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "model.safetensors").symlink_to(path / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"'model.layers.0.mlp.gate_proj.weight' has shape "
                                              r"\[50, 36\], the config implies \[51, 36\]"):
        from_pretrained(tmp_path)


@pytest.mark.parametrize("field, value", [
    ("architectures", ["MistralForCausalLM"]), ("attention_bias", True), ("mlp_bias", True),
    ("hidden_act", "gelu"), ("rope_parameters", dict(rope_type="yarn", factor=4.0)),
    ("quantization_config", {"quant_method": "fp8"}), ("dtype", "int8"),
])
def test_unsupported_config_fields_are_refused_by_name(checkpoints, tmp_path, field, value):
    _, path = checkpoints["tied-mha-odd"]
    config = json.loads((path / "config.json").read_text())
    config[field] = value
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=f"field '{field}'"):
        from_pretrained(tmp_path)


# ----------------------------------------------------------------- draft heads
def rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def head_config(target_cfg, **extra):
    keys = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
            "head_dim", "rms_norm_eps", "vocab_size", "max_position_embeddings")
    cfg = {k: getattr(target_cfg, k) for k in keys}
    # The older config spelling (rope_theta + rope_scaling), as published heads have it.
    rope = dict(target_cfg.rope_parameters)
    cfg["rope_theta"] = rope.pop("rope_theta")
    cfg["rope_scaling"] = rope if rope.get("rope_type") != "default" else None
    cfg.update(model_type="llama", num_hidden_layers=1, hidden_act="silu",
               tie_word_embeddings=False, torch_dtype="float64", **extra)
    return cfg


def random_head_weights(cfg, names, seed):
    """``{name: [out, in] float64}`` for the given ``name -> (out, in)``; norms ~1."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in names.items():
        x = torch.randn(shape, generator=g, dtype=torch.float64)
        out[name] = 1 + 0.3 * x if len(shape) == 1 and "norm" in name else (
            x * shape[-1] ** -0.5 if len(shape) == 2 else 0.1 * x)
    return out


def layer_names(prefix, cfg, in_features, *, input_layernorm):
    h, i = cfg["hidden_size"], cfg["intermediate_size"]
    hq = cfg["num_attention_heads"] * cfg["head_dim"]
    hkv = cfg["num_key_value_heads"] * cfg["head_dim"]
    names = {f"{prefix}.self_attn.q_proj.weight": (hq, in_features),
             f"{prefix}.self_attn.k_proj.weight": (hkv, in_features),
             f"{prefix}.self_attn.v_proj.weight": (hkv, in_features),
             f"{prefix}.self_attn.o_proj.weight": (h, hq),
             f"{prefix}.mlp.gate_proj.weight": (i, h), f"{prefix}.mlp.up_proj.weight": (i, h),
             f"{prefix}.mlp.down_proj.weight": (h, i),
             f"{prefix}.post_attention_layernorm.weight": (h,)}
    if input_layernorm:
        names[f"{prefix}.input_layernorm.weight"] = (h,)
    return names


def write_eagle3_head(path, hf_target, *, draft_vocab, seed=0, aux_ids=None, **config):
    """A head in sglang's EAGLE-3 layout (``midlayer.*``, ``d2t``, ``t2d``)."""
    tc = hf_target.config
    extra = dict(architectures=["LlamaForCausalLMEagle3"], draft_vocab_size=draft_vocab,
                 **config)
    if aux_ids is not None:
        extra["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": aux_ids}
    cfg = head_config(tc, **extra)
    h = cfg["hidden_size"]
    names = layer_names("midlayer", cfg, 2 * h, input_layernorm=True)
    names.update({"midlayer.hidden_norm.weight": (h,), "norm.weight": (h,),
                  "fc.weight": (h, 3 * h), "lm_head.weight": (draft_vocab, h)})
    w = random_head_weights(cfg, names, seed)
    g = torch.Generator().manual_seed(seed + 1)
    hot = torch.randperm(tc.vocab_size, generator=g)[:draft_vocab].sort().values
    w["d2t"] = hot - torch.arange(draft_vocab)  # target id = draft id + d2t[draft id]
    w["t2d"] = torch.zeros(tc.vocab_size, dtype=torch.bool).index_fill_(0, hot, True)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg))
    safetensors_torch.save_file(w, path / "model.safetensors")
    return cfg, w, hot


def write_eagle1_head(path, hf_target, *, seed=0):
    """A head in EAGLE-1's published layout: ``fc`` with bias, ``layers.0.*`` without
    ``input_layernorm``, no final norm, an embedding copy the head does not use;
    a ``LlamaForCausalLM`` config, as such heads often say; pytorch_model.bin."""
    cfg = head_config(hf_target.config, architectures=["LlamaForCausalLM"])
    h = cfg["hidden_size"]
    names = layer_names("layers.0", cfg, h, input_layernorm=False)
    names.update({"fc.weight": (h, 2 * h), "fc.bias": (h,),
                  "embed_tokens.weight": (cfg["vocab_size"], h)})
    w = random_head_weights(cfg, names, seed)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg))
    torch.save(w, path / "pytorch_model.bin")
    return cfg, w


def dense_attention(x, w, prefix, cfg, positions):
    """Causal GQA attention of one sequence ``x [T, in]`` with transformers' RoPE."""
    t, heads, kv, d = x.shape[0], cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]

    def proj(name, n):
        return (x @ w[f"{prefix}.self_attn.{name}_proj.weight"].t()).view(1, t, n, d).transpose(1, 2)

    q, k, v = proj("q", heads), proj("k", kv), proj("v", kv)
    rotary = LlamaRotaryEmbedding(transformers.LlamaConfig(**cfg))
    cos, sin = rotary(x.unsqueeze(0), positions.unsqueeze(0))
    q, k = apply_rotary_pos_emb(q, k, cos, sin)
    k, v = (z.repeat_interleave(heads // kv, dim=1) for z in (k, v))
    scores = (q @ k.transpose(-1, -2)) * d ** -0.5
    scores = scores.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
    out = (scores.softmax(-1) @ v).transpose(1, 2).reshape(t, heads * d)
    return out @ w[f"{prefix}.self_attn.o_proj.weight"].t()


def dense_mlp(x, w, prefix):
    gate = x @ w[f"{prefix}.mlp.gate_proj.weight"].t()
    up = x @ w[f"{prefix}.mlp.up_proj.weight"].t()
    return (torch.nn.functional.silu(gate) * up) @ w[f"{prefix}.mlp.down_proj.weight"].t()


def layer_inputs(hf, tokens):
    """Each target layer's input (the residual stream; index L: the last layer's
    output) and the post-norm last hidden state, recorded with hooks."""
    seen = []
    hooks = [layer.register_forward_pre_hook(lambda m, a, kw: seen.append(
        (a[0] if a else kw["hidden_states"])[0]), with_kwargs=True) for layer in hf.model.layers]
    hooks.append(hf.model.layers[-1].register_forward_hook(lambda m, a, o: seen.append(
        (o[0] if isinstance(o, tuple) else o)[0])))
    with torch.no_grad():
        last = hf.model(torch.tensor([tokens])).last_hidden_state[0]
    for hk in hooks:
        hk.remove()
    return seen, last


def eagle3_reference(hf, cfg, w, tokens, shifted, aux):
    """The published EAGLE-3 forward (sglang llama_eagle3.py), densely: draft logits
    over the draft vocabulary at every position."""
    eps = cfg["rms_norm_eps"]
    inputs, _ = layer_inputs(hf, tokens)
    x = torch.cat([inputs[i] for i in aux], -1) @ w["fc.weight"].t()
    e = hf.model.embed_tokens.weight[torch.tensor(shifted)].detach()
    normed = rms(x, w["midlayer.hidden_norm.weight"], eps)
    residual = normed if cfg.get("norm_before_residual") else x  # vLLM's option
    attn_in = torch.cat([rms(e, w["midlayer.input_layernorm.weight"], eps), normed], -1)
    positions = torch.arange(len(tokens))
    x = residual + dense_attention(attn_in, w, "midlayer", cfg, positions)
    x = x + dense_mlp(rms(x, w["midlayer.post_attention_layernorm.weight"], eps), w, "midlayer")
    return rms(x, w["norm.weight"], eps) @ w["lm_head.weight"].t()


def eagle1_reference(hf, cfg, w, tokens, shifted):
    """The published EAGLE-1 forward (sglang llama_eagle.py): fc with bias over
    [embed; the target's post-norm hidden], a layer without input norm, no
    final norm, the target's lm_head."""
    _, post_norm = layer_inputs(hf, tokens)
    e = hf.model.embed_tokens.weight[torch.tensor(shifted)].detach()
    x = torch.cat([e, post_norm], -1) @ w["fc.weight"].t() + w["fc.bias"]
    x = x + dense_attention(x, w, "layers.0", cfg, torch.arange(len(tokens)))
    x = x + dense_mlp(rms(x, w["layers.0.post_attention_layernorm.weight"],
                          cfg["rms_norm_eps"]), w, "layers.0")
    return x @ hf.lm_head.weight.detach().t()


def draft_prefill(models, tokens, shifted):
    """The target and then the draft over one prompt, through the public pieces
    (a page-size-1 pool, prefill metadata): draft logits at every position."""
    t = len(tokens)
    pool, slots, md = one_prompt_prefill(models, t)
    pos = torch.arange(t)
    feats = models.target_forward(torch.tensor(tokens), pos, slots, md, pool.target_kv,
                                  attention_backend="torch")
    h = models.draft_forward(torch.tensor(shifted), models.draft_input(feats), pos, slots, md,
                             pool.draft_kv, attention_backend="torch")
    return feats, h


PROMPT = [3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46]


@pytest.fixture(scope="module")
def eagle3(checkpoints, tmp_path_factory):
    hf, path = checkpoints["gqa-llama3"]
    head = tmp_path_factory.mktemp("eagle3")
    cfg, w, hot = write_eagle3_head(head, hf, draft_vocab=37)
    return hf, path, head, cfg, w, hot


def test_an_eagle3_head_computes_the_same_through_compiled_regions(eagle3):
    """The target's captures (read through the regions' unsummed
    residual) and the draft layer (its ``[embed; hidden]`` attention input, no
    attention norm) as `fa3_spec.eagle.regions` programs, bit for bit the
    inline layers' (eager regions: the same ops)."""
    _, path, head, *_ = eagle3
    models = from_pretrained(path, head)
    shifted = PROMPT[1:] + [7]
    want = draft_prefill(models, PROMPT, shifted)
    programs = fa3_spec.eagle.regions.compiled_programs()
    got = torch.compile(lambda: draft_prefill(models.with_compile_regions("eager"), PROMPT,
                                              shifted), backend="eager")()
    assert fa3_spec.eagle.regions.compiled_programs() - programs == 3  # layer 0, 1.., draft
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_an_eagle3_head_loads_and_drafts_as_its_published_definition(eagle3):
    hf, path, head, cfg, w, hot = eagle3
    models = from_pretrained(path, head)
    draft = models.draft
    assert isinstance(draft, Eagle3Draft) and draft.aux_layers == (2, 2, 1)  # L = 4
    assert draft.lm_head.shape == (40, 37) and torch.equal(draft.d2t, hot)
    shifted = PROMPT[1:] + [7]
    feats, h = draft_prefill(models, PROMPT, shifted)
    inputs, _ = layer_inputs(hf, PROMPT)
    want_feats = torch.cat([inputs[-1]] + [inputs[i] for i in (2, 2, 1)], -1)
    torch.testing.assert_close(feats, want_feats, rtol=0, atol=ATOL)
    want = eagle3_reference(hf, cfg, w, PROMPT, shifted, (2, 2, 1))
    torch.testing.assert_close(models.draft_logits(h), want, rtol=0, atol=ATOL)
    logp, ids = models.draft_topk(h, 4)
    assert torch.equal(ids, hot[want.topk(4, dim=-1).indices])  # draft ids -> target ids
    rows = torch.tensor([h.shape[0] - 1, 0])
    logp_rows, ids_rows = models.draft_topk(h, 4, rows=rows)  # as the draft extend calls it
    assert torch.equal(ids_rows, ids[rows])
    torch.testing.assert_close(logp_rows, logp[rows], rtol=0, atol=1e-12)
    torch.testing.assert_close(logp, want.float().log_softmax(-1).topk(4, dim=-1).values,
                               rtol=0, atol=1e-5)


def test_the_loop_with_an_eagle3_head_is_exact_and_drafts_target_ids(eagle3):
    _, path, head, *_, hot = eagle3
    models = from_pretrained(path, head)
    news = [12, 10, 12]
    eng = make_engine(models)
    ids = [eng.submit(p, m) for p, m in zip(PROMPTS, news)]
    eng.step()
    eng.step()
    live = eng.state["accept_len"] > 0
    drafted = eng.state["tree_tokens"][live][:, 1:]  # node 0 is the root
    assert drafted.numel() and torch.isin(drafted, hot).all()
    out = eng.run()
    assert [out[i] for i in ids] == greedy_generate(models, PROMPTS, news, page_size=2,
                                                    attention_backend="torch")


def test_an_eagle3_head_with_named_aux_layers_and_chain_drafts(checkpoints, tmp_path):
    hf, path = checkpoints["gqa-llama3"]
    cfg, w, hot = write_eagle3_head(tmp_path / "head", hf, draft_vocab=50, seed=3,
                                    aux_ids=[0, 1, 3], norm_before_residual=True)
    models = from_pretrained(path, tmp_path / "head")
    assert models.draft.aux_layers == (1, 2, 4)  # after layers 0, 1, 3: sglang adds 1
    assert models.draft.norm_before_residual
    shifted = PROMPT[1:] + [2]
    _, h = draft_prefill(models, PROMPT, shifted)
    torch.testing.assert_close(models.draft_logits(h),
                               eagle3_reference(hf, cfg, w, PROMPT, shifted, (1, 2, 4)),
                               rtol=0, atol=ATOL)
    got, _, _ = run_loop(models, PROMPTS[:2], [10, 10], k=1, s=3, n=4)
    assert got == greedy_generate(models, PROMPTS[:2], [10, 10], page_size=2,
                                  attention_backend="torch")


def test_an_eagle1_head_loads_from_bin_and_reads_the_normed_target_hidden(checkpoints, tmp_path):
    hf, path = checkpoints["tied-mha-odd"]
    cfg, w = write_eagle1_head(tmp_path / "head", hf, seed=5)
    models = from_pretrained(path, tmp_path / "head")
    d = models.draft
    assert isinstance(d, EagleDraft) and d.normed_target and d.norm is None
    assert d.layer.attn_norm is None and d.fc_bias is not None
    assert d.lm_head is models.target.lm_head and d.embed is models.target.embed
    prompt = [p % 67 for p in PROMPT]
    shifted = prompt[1:] + [4]
    _, h = draft_prefill(models, prompt, shifted)
    torch.testing.assert_close(models.draft_logits(h), eagle1_reference(hf, cfg, w, prompt,
                                                                        shifted),
                               rtol=0, atol=ATOL)
    got, _, _ = run_loop(models, PROMPTS[:2], [10, 10])
    assert got == greedy_generate(models, PROMPTS[:2], [10, 10], page_size=2,
                                  attention_backend="torch")


def test_draft_heads_that_do_not_fit_the_target_are_refused(eagle3, tmp_path):
    hf, path, head, cfg, w, _ = eagle3
    for field, value in (("num_key_value_heads", 4), ("num_hidden_layers", 2),
                         ("norm_before_fc", True)):
        bad = tmp_path / field
        bad.mkdir()
        (bad / "config.json").write_text(json.dumps({**cfg, field: value}))
        (bad / "model.safetensors").symlink_to(head / "model.safetensors")
        with pytest.raises(CheckpointError, match=f"field '{field}'"):
            from_pretrained(path, bad)


# ----------------------------------------------------------------- text in, text out
WORDS = [f"w{i}" for i in range(101)]


def add_tokenizer(path):
    """A word-level tokenizer over the target's 101 ids, with a chat template."""
    from tokenizers import Tokenizer, models as tok_models, pre_tokenizers

    tok = Tokenizer(tok_models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="w0",
        chat_template="{% for m in messages %}w1 {{ m['content'] }} w2 {% endfor %}"
                      "{% if add_generation_prompt %}w3{% endif %}")
    fast.save_pretrained(path)


def test_text_prompts_in_completions_out_exact_and_stopping_at_any_eos(eagle3, tmp_path, capsys):
    hf, path, head, *_ = eagle3
    model = tmp_path / "model"
    model.mkdir()
    for f in path.iterdir():
        (model / f.name).symlink_to(f)
    add_tokenizer(model)
    prompt = "w5 w7 w9 w11"
    models = from_pretrained(path)
    chat_ids = [1, 5, 7, 9, 11, 2, 3]
    free = greedy_generate(models, [chat_ids], [12], page_size=2, attention_backend="torch")[0]
    eos = [free[5], free[3]]  # two EOS ids: the completion stops at the first of either
    (model / "generation_config.json").unlink()
    (model / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": prompt, "max_new_tokens": 12}) + "\n"
                       + json.dumps("w20 w21") + "\n")
    out = tmp_path / "out.json"
    argv = ["--model", str(model), "--draft-model", str(head), "--prompts", str(prompts),
            "--chat", "--device", "cpu", "--attention-backend", "torch", "--batch", "2", "--page-size", "2",
            "--topk", "4", "--num-steps", "3", "--num-draft-tokens", "6", "--max-new-tokens", "8",
            "--check-greedy", "--json", str(out)]
    assert cli.main(argv) == 0
    res = json.loads(out.read_text())
    first = free[: min(free.index(t) for t in eos) + 1]
    assert len(first) < 8
    assert res["exact"] and res["outputs"][0] == first
    assert res["per_request"][0]["completion"] == " ".join(WORDS[t] for t in first)
    assert res["model"]["draft_kind"] == "eagle3" and res["model"]["tokenizer"] == "transformers"
    assert res["config"]["eos"] == eos
    for entry in res["per_request"]:
        assert entry["mean_accept_len"] >= 1 and entry["tokens_per_s"] > 0
        assert entry["greedy_tokens_per_s"] > 0
    printed = capsys.readouterr().out
    assert res["per_request"][0]["completion"] in printed and "EXACT" in printed


def _usage_exit(argv, capsys) -> str:
    """``cli.main(argv)`` must exit 2 with one line and no traceback: that line."""
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    last = err.strip().splitlines()[-1]
    assert last.startswith("fa3-spec eagle: error: ")
    return last


@pytest.mark.parametrize("extra", [["--preset", "tiny"], ["--num-layers", "2"],
                                   ["--alpha", "0.1"]])
def test_preset_options_are_refused_with_a_loaded_model(checkpoints, extra, capsys):
    _, path = checkpoints["tied-mha-odd"]
    assert extra[0] in _usage_exit(["--model", str(path), "--device", "cpu"] + extra, capsys)


@pytest.mark.parametrize("extra", [["--draft-model", "x"], ["--prompt", "hi"], ["--chat"]])
def test_text_and_head_options_need_a_loaded_model(extra, capsys):
    assert "need(s) --model" in _usage_exit(["--device", "cpu"] + extra, capsys)


def test_a_checkpoint_that_cannot_load_is_a_usage_error(checkpoints, tmp_path, capsys):
    """A `CheckpointError` (here: no config.json, then an unsupported field) is
    an invalid invocation: exit 2, one line naming the file, as any other."""
    assert "config.json: not found" in _usage_exit(
        ["--model", str(tmp_path), "--device", "cpu"], capsys)
    _, path = checkpoints["tied-mha-odd"]
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in path.iterdir():
        (bad / f.name).symlink_to(f)
    cfg = json.loads((path / "config.json").read_text())
    (bad / "config.json").unlink()
    (bad / "config.json").write_text(json.dumps(dict(cfg, hidden_act="gelu")))
    assert "'hidden_act'" in _usage_exit(["--model", str(bad), "--device", "cpu"], capsys)


def test_topk_above_an_eagle3_draft_vocabulary_is_a_usage_error(eagle3, capsys):
    """An EAGLE-3 head proposes from its reduced vocabulary (``draft_vocab_size``
    = ``V_d``, 37 here, of the target's 101)."""
    _, path, head, *_ = eagle3
    models = from_pretrained(path, head)
    assert models.draft_vocab_size == 37 and models.vocab_size == 101
    assert from_pretrained(path).draft_vocab_size == 101  # a head made here: the target's
    with pytest.raises(ValueError, match="topk=38 exceeds the draft's vocabulary of 37"):
        make_engine(models, k=38)
    line = _usage_exit(["--model", str(path), "--draft-model", str(head), "--device", "cpu",
                        "--topk", "38", "--attention-backend", "torch"], capsys)
    assert "vocabulary of 37" in line


def test_out_of_vocabulary_prompts_are_refused_with_eos_sets(eagle3):
    _, path, *_ = eagle3
    models = from_pretrained(path)
    eng = make_engine(models)
    with pytest.raises(ValueError, match=r"token 101 at position 1 .*vocab_size=101"):
        eng.submit([3, 101], 4, eos_id=[5, 7])
    with pytest.raises(ValueError, match=r"prompts\[0\]: token -2 at position 0"):
        greedy_generate(models, [[-2]], [4], eos_ids=[[5, 7]], attention_backend="torch")
    assert not eng.has_work
    rid = eng.submit([3, 4], 6, eos_id=(5, 7))  # a sequence of ids is taken as is
    eng.run()
    assert eng.request_stats()[rid]["seconds"] > 0


def test_the_configuration_line_names_the_loaded_model_and_its_draft(eagle3, monkeypatch,
                                                                     capsys):
    monkeypatch.setattr(cli, "PROGRESS_SECONDS", -1.0)  # a progress line at every chance
    _, path, head, *_ = eagle3
    argv = ["--model", str(path), "--device", "cpu", "--attention-backend", "torch", "--batch", "2",
            "--requests", "3", "--max-new-tokens", "6", "--prompt-len", "8", "--check-greedy"]
    assert cli.main(argv + ["--draft-model", str(head)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith(f"fa3-spec eagle: model {path} + eagle3 head {head} (4 layers")
    loop = [i for i, line in enumerate(lines) if line.startswith("  iteration ")]
    greedy = [i for i, line in enumerate(lines) if line.startswith("  greedy step ")]
    assert loop and greedy and max(loop) < min(greedy)
    assert cli.main(argv + ["--draft", "random", "--quiet"]) == 0
    assert cli.main(argv) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first.startswith(f"fa3-spec eagle: model {path} + draft derived (made here) (4 layers")


def test_a_model_without_tokenizer_runs_the_token_workload(checkpoints, capsys):
    _, path = checkpoints["tied-mha-odd"]
    argv = ["--model", str(path), "--prompt", "hello", "--device", "cpu", "--attention-backend",
            "torch",
            "--batch", "2", "--requests", "3", "--max-new-tokens", "6", "--prompt-len", "8",
            "--check-greedy", "--quiet"]
    assert cli.main(argv) == 0
    assert "token-id workload" in capsys.readouterr().err


def test_the_iteration_with_an_eagle3_head_compiles_fullgraph_as_eager(eagle3):
    """Captures, the [embed; hidden] layer and d2t trace with no graph break and
    no data-dependent op, and dynamo's graph equals eager. The graph runs
    under the eager backend (half the time of aot_eager): the head's own ops
    (the captures' concatenation, the ``[embed; hidden]`` layer input, the
    d2t gather) are pure, so functionalisation is not expected to change
    them, which is not checked here; test_eagle_loop's iteration test runs
    the whole iteration, with an EAGLE-1 head, under aot_eager."""
    from fa3_spec.eagle import eagle_iteration
    from fa3_spec.probes import RecordingBackend

    _, path, head, *_ = eagle3
    models = from_pretrained(path, head)
    eng = make_engine(models, k=2, s=2, n=3)  # small: compile time grows with the graph
    for p, m in zip(PROMPTS, [8, 8, 8]):
        eng.submit(p, m)
    eng.step()
    pool = eng.pool
    caches = (pool.target_kv.k, pool.target_kv.v, pool.draft_kv.k, pool.draft_kv.v)
    saved = [c.clone() for c in caches]

    def it(st):
        return eagle_iteration(eng.lc, models, pool.target_kv, pool.draft_kv, pool.req_to_token,
                               st)

    backend = RecordingBackend("eager")
    st = {k: v.clone() for k, v in eng.state.items()}
    got = torch.compile(it, fullgraph=True, backend=backend)(st)
    after = [c.clone() for c in caches]
    for c, s in zip(caches, saved):
        c.copy_(s)
    want = it(st)
    assert backend.frame_count == 1 and backend.data_dependent == []
    for key in ("seq_lens", "out_tokens", "tree_tokens", "parents", "cand_tokens", "root"):
        assert torch.equal(got[key], want[key]), key
    torch.testing.assert_close(got["draft_hidden"], want["draft_hidden"])
    for a, c in zip(after, caches):
        torch.testing.assert_close(a, c)
