"""Training an EAGLE-3 head (CPU): the draft vocabulary's maps, the training-time
test forward against the loop's own drafts, the exported layout and its round
trip through the loader and the loop, training that raises held-out
acceptance, budgets, resume and refusals."""

import dataclasses
import json
import pathlib

import pytest
import torch
from safetensors.torch import load_file

import fa3_spec
from fa3_spec.eagle import EagleEngine, EagleModels, LoopConfig, greedy_generate, make_models
from fa3_spec.eagle.checkpoint import load_draft
from fa3_spec.train.export import ARCHITECTURE, save_head
from fa3_spec.train.features import target_features
from fa3_spec.train.head import Eagle3Head, default_aux_layers
from fa3_spec.train.objective import ttt_loss
from fa3_spec.train.trainer import STATE_FILE, TrainConfig, train_draft
from fa3_spec.train.vocab import DraftVocab, draft_vocab_from_counts


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    yield


ROOT = pathlib.Path(__file__).resolve().parents[1]
_TARGETS = {}


def target(dtype=torch.float32):
    if dtype not in _TARGETS:
        _TARGETS[dtype] = make_models("tiny", seed=0, num_layers=8, dtype=dtype).target
    return _TARGETS[dtype]


def perturbed_head(t, vocab, scale=0.5, seed=3):
    head = Eagle3Head(t, vocab, seed=seed)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in head.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale)
    return head


def random_prompts(n, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 512, (int(torch.randint(4, 12, (1,), generator=g)),),
                          generator=g).tolist() for _ in range(n)]


# ---------------------------------------------------------------- vocabulary
def test_the_draft_vocabulary_keeps_the_most_frequent_tokens_and_its_maps_agree():
    counts = torch.zeros(50, dtype=torch.int64)
    counts[[7, 3, 40, 12]] = torch.tensor([5, 9, 9, 1])
    vocab = draft_vocab_from_counts(counts, 6)
    assert vocab.ids.tolist() == [0, 1, 3, 7, 12, 40]  # 3 and 40 (9), 7, 12, then unseen 0, 1
    vocab.check()
    assert torch.equal(torch.arange(6) + vocab.d2t, vocab.ids)  # draft id + d2t lands on ids
    assert torch.equal(vocab.t2d.nonzero().flatten(), vocab.ids)
    broken = DraftVocab(vocab.ids, vocab.d2t + 1, vocab.t2d)
    with pytest.raises(ValueError, match="d2t and t2d disagree"):
        broken.check()
    for bad in (0, 51, 2.0, True):
        with pytest.raises(ValueError, match="size \\(the draft vocabulary\\)"):
            draft_vocab_from_counts(counts, bad)


def test_the_default_auxiliary_layers_are_the_loaders_convention():
    assert default_aux_layers(32) == (2, 16, 29)
    with pytest.raises(ValueError, match="pass aux_layers"):
        default_aux_layers(6)


# ------------------------------------------------------- training-time test forward
def test_the_unrolled_forward_predicts_what_the_loop_drafts(tmp_path):
    """Step k of the training-time test at position L - 1 + k, fed the loop's
    own chain, predicts the loop's draft at depth k + 1: the head trains on
    the computation it serves with (the exported head, loaded by the loader)."""
    t = target()
    vocab = draft_vocab_from_counts(torch.randint(0, 50, (512,), generator=torch.Generator()
                                                  .manual_seed(0)), 256)
    head = perturbed_head(t, vocab)
    save_head(head, tmp_path, dtype=torch.float32)
    models = EagleModels(t, load_draft(tmp_path, t))
    steps = 4
    spec = fa3_spec.SpecConfig(page_size=2, topk=1, num_steps=steps, num_draft_tokens=steps + 1,
                               max_bs=2, max_context_len=64)
    spec = dataclasses.replace(spec, num_pages=spec.pool_pages(4, "ancestors"))
    for prompt in ([5, 9, 2, 7, 11, 3], list(range(1, 12))):
        eng = EagleEngine(LoopConfig(spec, max_new_tokens=16, attention_backend="torch"), models,
                          max_reqs=4)
        eng.submit(prompt, 16)
        eng.admit()
        eng.launch(1)
        chain = eng.state["tree_tokens"][0].tolist()  # root, then the drafts of depth 1..
        batch = target_features(t, [prompt + chain], head.aux_layers, vocab.ids,
                                attention_backend="torch")
        with torch.no_grad():
            logits = head(batch.tokens, batch.features, steps)
        n = len(prompt)
        predicted = [int(vocab.ids[logits[k][0, n - 1 + k].argmax()]) for k in range(steps)]
        assert predicted == chain[1:]
        assert len(set(chain[1:])) > 1  # a chain that says something


# ---------------------------------------------------------------------- export
def test_the_export_is_the_published_layout_and_runs_exactly_in_the_loop(tmp_path):
    t32 = target()
    vocab = draft_vocab_from_counts(torch.arange(512), 128)
    head = perturbed_head(t32, vocab, scale=0.05)
    save_head(head, tmp_path)  # bf16, as published
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == [ARCHITECTURE] and config["draft_vocab_size"] == 128
    assert config["tie_word_embeddings"] is False and config["num_hidden_layers"] == 1
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]
    assert config["max_position_embeddings"] == t32.shape.max_position_embeddings
    tensors = load_file(str(tmp_path / "model.safetensors"))
    h = t32.shape.hidden_size
    assert not any("embed_tokens" in name for name in tensors)
    assert tensors["fc.weight"].shape == (h, 3 * h)
    assert tensors["midlayer.self_attn.q_proj.weight"].shape[1] == 2 * h
    assert tensors["lm_head.weight"].shape == (128, h) and tensors["lm_head.weight"].dtype == \
        torch.bfloat16
    assert tensors["d2t"].dtype == torch.int64 and tensors["t2d"].dtype == torch.bool
    assert torch.equal(torch.arange(128) + tensors["d2t"], tensors["t2d"].nonzero().flatten())
    # Loaded into a float64 target, the loop stays exact to greedy decoding.
    t64 = target(torch.float64)
    models = EagleModels(t64, load_draft(tmp_path, t64))
    assert torch.equal(models.draft.d2t, vocab.ids)
    spec = fa3_spec.SpecConfig(page_size=2, topk=4, num_steps=3, num_draft_tokens=6, max_bs=2,
                               max_context_len=64)
    spec = dataclasses.replace(spec, num_pages=spec.pool_pages(4, "ancestors"))
    eng = EagleEngine(LoopConfig(spec, max_new_tokens=20, attention_backend="torch"), models,
                      max_reqs=4)
    prompts = [[3, 1, 4, 1, 5], [9, 2, 6]]
    ids = [eng.submit(p, 20) for p in prompts]
    out = eng.run()
    assert [out[i] for i in ids] == greedy_generate(models, prompts, [20, 20],
                                                    attention_backend="torch")


def test_only_the_response_is_scored_never_the_prompt():
    # Step k at position p predicts token p + 2; the loop drafts from the token
    # after the target's own first one, so p starts at the last prompt position.
    t = target()
    vocab = draft_vocab_from_counts(torch.ones(t.shape.vocab_size, dtype=torch.int64), 256)
    head = Eagle3Head(t, vocab)
    seqs = random_prompts(3, seed=7)
    starts = [0, 2, len(seqs[2]) - 2]
    batch = target_features(t, seqs, head.aux_layers, vocab.ids, starts=starts,
                            attention_backend="torch")
    with torch.no_grad():
        scores = ttt_loss(head(batch.tokens, batch.features, 3, batch.lengths), batch, vocab.ids)
    want = [sum(max(0, len(q) - 2 - max(k, st) + 1) for q, st in zip(seqs, starts))
            for k in range(3)]
    assert scores.positions == want
    with pytest.raises(ValueError, match="starts"):
        target_features(t, seqs, head.aux_layers, vocab.ids, starts=[0, -1, 0])


# -------------------------------------------------------------------- training
CONFIG = TrainConfig(ttt_steps=2, batch_size=8, max_new_tokens=24, draft_vocab=256, eval_every=50,
                     holdout=8, lr=5e-3, warmup_steps=10, decay_steps=200)


#: The learning run, in a child process beside the in-process tests (it trains
#: for about 20 s on one core): the report's fields and what it left behind.
LEARN_CHILD = r"""
import json, pathlib, sys
sys.path.insert(0, {tests!r})
import torch
from test_train_draft import CONFIG, random_prompts, target
from fa3_spec.eagle.checkpoint import load_draft
from fa3_spec.train.trainer import STATE_FILE, train_draft

out = pathlib.Path(sys.argv[1])
# 400 prompts, each answered once: too few distinct responses and the head
# memorises them instead of learning the target.
report = train_draft(target(), random_prompts(400), out, tokens=30000, config=CONFIG,
                     attention_backend="torch")
load_draft(out, target())  # what a budget leaves behind loads
print(json.dumps(dict(stopped=report.stopped, tokens=report.tokens, steps=report.steps,
                      initial_top1=list(report.initial_top1), final_top1=list(report.final_top1),
                      history=[h["step"] for h in report.history],
                      files=[(out / "model.safetensors").is_file(), (out / STATE_FILE).is_file()])))
"""


def _learn(tmp):
    import sys

    import children

    code = LEARN_CHILD.format(tests=str(pathlib.Path(__file__).resolve().parent))
    done = children.run([sys.executable, "-c", code, str(tmp)])
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.children(job=_learn, heavy=True)
def test_training_raises_held_out_first_depth_acceptance(child):
    report = child.result()
    assert report["stopped"] == "tokens" and report["tokens"] >= 30000
    gain = report["final_top1"][0] - report["initial_top1"][0]
    assert gain >= 0.2, (report["initial_top1"], report["final_top1"])
    evaluated = list(range(50, report["steps"] + 1, 50))
    assert report["history"] == evaluated + [report["steps"]] * (evaluated[-1] != report["steps"])
    assert report["files"] == [True, True]


def test_resume_continues_the_full_state_or_the_weights_alone(tmp_path):
    cfg = dataclasses.replace(CONFIG, eval_every=5)
    first = train_draft(target(), random_prompts(24), tmp_path, tokens=2000, config=cfg,
                        attention_backend="torch")
    again = train_draft(target(), random_prompts(24), tmp_path, tokens=4000, config=cfg,
                        attention_backend="torch", resume=True)
    assert again.steps > first.steps and again.initial_top1 == first.initial_top1
    assert again.tokens >= 4000
    # Across machines only the head travels: its weights come back as they were.
    weights = load_file(str(tmp_path / "model.safetensors"))
    (tmp_path / STATE_FILE).unlink()
    seen = []
    train_draft(target(), random_prompts(24), tmp_path, tokens=1, config=cfg,
                attention_backend="torch", resume=True,
                progress=lambda info: seen.append(info["step"]))
    assert seen == [1]  # a fresh optimizer: the count starts again
    assert torch.equal(load_file(str(tmp_path / "model.safetensors"))["d2t"], weights["d2t"])


def test_sampled_regeneration_draws_a_fresh_response_each_epoch_and_resumes(tmp_path,
                                                                              monkeypatch):
    """``temperature > 0``: a prompt that comes up again is answered anew (each
    draw its own seed), the held-out responses stay greedy, and a resume
    continues the draw count and the answered-but-untrained sequences."""
    import fa3_spec.train.trainer as trainer_module

    calls = []
    real = trainer_module.regenerate

    def recording(target_, prompts, *args, temperature=0.0, seeds=None, **kw):
        out = real(target_, prompts, *args, temperature=temperature, seeds=seeds, **kw)
        calls.append((temperature, seeds, [tuple(p) for p in prompts], out))
        return out

    monkeypatch.setattr(trainer_module, "regenerate", recording)
    cfg = dataclasses.replace(CONFIG, temperature=1.0, regen_batch=16, eval_every=2)
    prompts = random_prompts(24)
    report = train_draft(target(), prompts, tmp_path, tokens=1200, config=cfg,
                         attention_backend="torch")
    assert calls[0][0] == 0.0 and calls[0][1] is None  # the held-out split, greedy
    sampled = calls[1:]
    assert all(t == 1.0 for t, *_ in sampled) and len(sampled) >= 2
    seeds = [sd for _, s, _, _ in sampled for sd in s]
    assert len(seeds) == len(set(seeds))  # every draw its own seed
    answers = {}
    for _, _, ps, outs in sampled:
        for pr, out in zip(ps, outs):
            answers.setdefault(pr, []).append(tuple(out))
    again = [a for a in answers.values() if len(a) > 1]
    assert again and any(len(set(a)) > 1 for a in again)  # a prompt seen twice, answered anew
    state = torch.load(tmp_path / STATE_FILE, weights_only=False)
    assert state["draws"] == len(seeds)
    calls.clear()
    resumed = train_draft(target(), prompts, tmp_path, tokens=report.tokens + 300, config=cfg,
                          attention_backend="torch", resume=True)
    assert resumed.steps > report.steps
    later = [sd for _, s, _, _ in calls[1:] for sd in (s or [])]
    assert all(sd not in seeds for sd in later)  # the count went on, no draw repeated


@pytest.mark.parametrize("kwargs, match", [
    (dict(), "give a budget"),
    (dict(minutes=0), "minutes must be a finite number > 0"),
    (dict(tokens=float("nan")), "tokens must be a finite number > 0"),
    (dict(tokens=10, config=dataclasses.replace(CONFIG, draft_vocab=513)), "exceeds the target"),
    (dict(tokens=10, prompts=random_prompts(8)), "more than config.holdout=8"),
])
def test_bad_runs_are_refused_by_name(tmp_path, kwargs, match):
    kwargs.setdefault("config", CONFIG)
    prompts = kwargs.pop("prompts", random_prompts(24))
    with pytest.raises(ValueError, match=match):
        train_draft(target(), prompts, tmp_path, **kwargs)


@pytest.mark.parametrize("field, value", [("ttt_steps", 0), ("lr", float("inf")),
                                          ("batch_size", 2.0), ("holdout", -1),
                                          ("temperature", -0.5), ("temperature", float("nan")),
                                          ("regen_batch", 0)])
def test_a_config_out_of_its_domain_is_refused(field, value):
    with pytest.raises(ValueError, match=field):
        dataclasses.replace(CONFIG, **{field: value})


# ------------------------------------------------------------------ the command
@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    """A tiny Hugging Face Llama (8 layers) with a word-level tokenizer and chat template."""
    pytest.importorskip("transformers", minversion="5")
    from test_checkpoint import add_tokenizer, hf_llama

    path = tmp_path_factory.mktemp("llama")
    hf_llama("gqa-llama3", num_hidden_layers=8).save_pretrained(path)
    add_tokenizer(path)
    return path


def test_the_command_trains_a_head_that_the_eagle_command_loads(llama_dir, tmp_path, capsys):
    from fa3_spec.cli import main

    out, report = tmp_path / "head", tmp_path / "report.json"
    argv = ["train-draft", "--model", str(llama_dir), "--out", str(out), "--tokens", "300",
            "--device", "cpu", "--batch", "4", "--max-new-tokens", "8", "--ttt-steps", "2",
            "--draft-vocab", "64", "--json", str(report)]
    assert main(argv) == 0
    res = json.loads(report.read_text())
    assert res["stopped"] == "tokens" and res["tokens"] >= 300 and len(res["final_top1"]) == 2
    assert json.loads((out / "config.json").read_text())["draft_vocab_size"] == 64
    assert main(["eagle", "--model", str(llama_dir), "--draft-model", str(out), "--device", "cpu",
                 "--attention-backend", "torch", "--batch", "2", "--requests", "2",
                 "--max-new-tokens", "6", "--prompt-len", "5", "--check-greedy", "--quiet"]) == 0


@pytest.mark.parametrize("extra, match", [
    ([], "give a budget"),
    (["--tokens", "0"], "--tokens"),
    (["--minutes", "nan"], "--minutes"),
    (["--tokens", "5", "--draft-vocab", "102"], "exceeds the target's vocabulary of 101"),
    (["--tokens", "5", "--prompts", "EMPTY"], "holds no prompt"),
])
def test_the_command_refuses_bad_input_in_one_line(llama_dir, tmp_path, capsys, extra, match):
    from fa3_spec.cli import main

    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    extra = [str(empty) if a == "EMPTY" else a for a in extra]
    with pytest.raises(SystemExit) as exc:
        main(["train-draft", "--model", str(llama_dir), "--out", str(tmp_path / "h"),
              "--device", "cpu", *extra])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) >= 1 and match in err[-1] and "Traceback" not in "\n".join(err)


def test_the_command_refuses_a_checkpoint_that_is_not_a_llama(llama_dir, tmp_path, capsys):
    from fa3_spec.cli import main

    bad = tmp_path / "gpt"
    bad.mkdir()
    config = json.loads((llama_dir / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(SystemExit) as exc:
        main(["train-draft", "--model", str(bad), "--out", str(tmp_path / "h"), "--tokens", "5",
              "--device", "cpu"])
    assert exc.value.code == 2 and "architectures" in capsys.readouterr().err


# ------------------------------------------------- sglang's own EAGLE-3 loader
#: The parameters of sglang 0.5.23's ``LlamaForCausalLMEagle3`` that a head
#: provides (the embedding is the target's), with their fused shard ids.
SGLANG_PARAMS = {
    "model.fc.weight": None, "model.norm.weight": None, "lm_head.weight": None,
    "model.layers.0.input_layernorm.weight": None, "model.layers.0.hidden_norm.weight": None,
    "model.layers.0.post_attention_layernorm.weight": None,
    "model.layers.0.self_attn.qkv_proj.weight": ("q", "k", "v"),
    "model.layers.0.self_attn.o_proj.weight": None,
    "model.layers.0.mlp.gate_up_proj.weight": (0, 1),
    "model.layers.0.mlp.down_proj.weight": None,
}


def sglang_load_weights():
    """sglang's ``LlamaForCausalLMEagle3.load_weights``, taken from its wheel and
    run on its own: its weight-name mapping, not a copy of it."""
    import ast

    from fa3_spec.harness import sglang_upstream as up

    try:
        path = up.upstream_file(up.EAGLE3_MODEL_FILE)
    except up.UpstreamUnavailable as exc:
        pytest.skip(str(exc))
    tree = ast.parse(path.read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef)
               and n.name == "LlamaForCausalLMEagle3")
    fn = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "load_weights")
    fn.decorator_list = []
    module = ast.Module(body=[fn], type_ignores=[])
    loaded = []

    def default_weight_loader(param, weight, shard=None):
        loaded.append((param.name, shard, tuple(weight.shape), weight.dtype))

    import typing

    namespace = dict(torch=torch, default_weight_loader=default_weight_loader,
                     Iterable=typing.Iterable, Tuple=typing.Tuple)
    exec(compile(module, str(path), "exec"), namespace)
    return namespace["load_weights"], loaded


def test_sglangs_eagle3_loader_takes_every_exported_tensor(tmp_path):
    load_weights, loaded = sglang_load_weights()

    class Param:
        def __init__(self, name):
            self.name = name

    class Model:
        def named_parameters(self):
            return [(name, Param(name)) for name in SGLANG_PARAMS]

    t = target()
    vocab = draft_vocab_from_counts(torch.arange(512), 128)
    save_head(Eagle3Head(t, vocab), tmp_path)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    model = Model()
    load_weights(model, tensors.items())
    s = t.shape
    h, d = s.hidden_size, s.head_dim
    got = {(name, shard): shape for name, shard, shape, _ in loaded}
    want = {("model.fc.weight", None): (h, 3 * h), ("model.norm.weight", None): (h,),
            ("lm_head.weight", None): (128, h),
            ("model.layers.0.input_layernorm.weight", None): (h,),
            ("model.layers.0.hidden_norm.weight", None): (h,),
            ("model.layers.0.post_attention_layernorm.weight", None): (h,),
            ("model.layers.0.self_attn.qkv_proj.weight", "q"): (s.num_heads * d, 2 * h),
            ("model.layers.0.self_attn.qkv_proj.weight", "k"): (s.num_kv_heads * d, 2 * h),
            ("model.layers.0.self_attn.qkv_proj.weight", "v"): (s.num_kv_heads * d, 2 * h),
            ("model.layers.0.self_attn.o_proj.weight", None): (h, s.num_heads * d),
            ("model.layers.0.mlp.gate_up_proj.weight", 0): (s.intermediate_size, h),
            ("model.layers.0.mlp.gate_up_proj.weight", 1): (s.intermediate_size, h),
            ("model.layers.0.mlp.down_proj.weight", None): (h, s.intermediate_size)}
    assert got == want
    # Every exported tensor went somewhere: the 13 weights, d2t into the hot
    # token ids (draft id -> target id) and t2d, which sglang skips.
    assert len(loaded) == len(tensors) - 2
    assert torch.equal(model.hot_token_id, vocab.ids)


#: A tiny Hugging Face Llama and a head trained on it for a few steps, made in
#: a child process (the benchmark below then reads both from disk).
ACCEPT_CHILD = r"""
import dataclasses, pathlib, sys
sys.path.insert(0, {tests!r})
from test_checkpoint import add_tokenizer, hf_llama
from test_train_draft import CONFIG, random_prompts
from fa3_spec.eagle.checkpoint import load_target
from fa3_spec.train.trainer import train_draft

tmp = pathlib.Path(sys.argv[1])
hf_llama("gqa-llama3", num_hidden_layers=8).save_pretrained(tmp / "llama")
add_tokenizer(tmp / "llama")
train_draft(load_target(tmp / "llama"), [[t % 101 for t in p] for p in random_prompts(16)],
            tmp / "head", tokens=200, config=dataclasses.replace(CONFIG, draft_vocab=64, holdout=2),
            attention_backend="torch")
"""


def _accept_rows(tmp):
    """benchmarks/draft_heads.py accept on CPU over a trained head and the
    derived draft: ``(head path, the JSON it wrote)``, or ``{"skip": ...}``."""
    import importlib.metadata
    import sys

    import children

    try:
        if int(importlib.metadata.version("transformers").split(".")[0]) < 5:
            return {"skip": "needs transformers >= 5"}
    except importlib.metadata.PackageNotFoundError:
        return {"skip": "needs transformers"}
    children.run([sys.executable, "-c",
                  ACCEPT_CHILD.format(tests=str(pathlib.Path(__file__).resolve().parent)),
                  str(tmp)])
    out, head = tmp / "rows.json", tmp / "head"
    children.run(
        [sys.executable, "benchmarks/draft_heads.py", "accept", "--model", str(tmp / "llama"),
         "--head", str(head), "--head", "derived", "--device", "cpu", "--dtype", "float64",
         "--attention-backend", "torch", "--shapes", "1,3,4", "4,2,4", "--temperatures", "0", "0.7",
         "--prompts", "2", "--max-new-tokens", "6", "--batch", "2", "--strict",
         "--timed", "4,2,4", "--iters", "2", "--json", str(out)], cwd=ROOT)
    return {"head": str(head), "doc": json.loads(out.read_text())}


@pytest.mark.children(job=_accept_rows, heavy=True)
def test_the_acceptance_benchmark_measures_a_trained_head_against_the_derived_draft(child):
    # benchmarks/draft_heads.py accept on CPU: every temperature-0 row exact in
    # float64 (--strict), per-depth rates recorded, the timed rows' ratio.
    result = child.result()
    if "skip" in result:
        pytest.skip(result["skip"])
    head, doc = result["head"], result["doc"]
    assert doc["heads"] == [head, "derived"] and len(doc["rows"]) == 2 * 2 * 2 * 2
    greedy = [r for r in doc["rows"] if r["temperature"] == 0]
    assert all(r["greedy_ok"] and r["identical_requests"] == 2 for r in greedy)
    assert all(r["mean_accept_len"] >= 1 and r["acceptance_by_depth_and_rank"] for r in doc["rows"])
    assert [t["head"] for t in doc["timed"]] == [head, "derived"]
    assert all(t["a_over_c"] > 0 and t["c_tokens_per_s"] > 0 for t in doc["timed"])


def test_the_eagle_command_warns_that_a_draft_made_here_is_not_trained(llama_dir, capsys):
    from fa3_spec.cli import main

    assert main(["eagle", "--model", str(llama_dir), "--device", "cpu", "--attention-backend",
                 "torch", "--batch", "2", "--requests", "2", "--max-new-tokens", "4",
                 "--prompt-len", "5", "--check-greedy"]) == 0
    captured = capsys.readouterr()
    assert "--draft derived drafts with the target's layer 0, not a trained head" in captured.err
    assert "fa3-spec train-draft --model" in captured.err
    assert "plain greedy:" in captured.out and "the loop:" in captured.out


def test_a_minutes_budget_counts_wall_time_from_the_start_of_the_run(tmp_path):
    report = train_draft(target(), random_prompts(24), tmp_path, minutes=0.05, config=CONFIG,
                         attention_backend="torch")
    assert report.stopped == "minutes" and 3 <= report.seconds < 60
