"""Malformed checkpoints: each ends in one `CheckpointError` naming the file and the field.

The checkpoints are tiny Llama targets and EAGLE-3 heads written here with
safetensors (no transformers), from a well-formed config; a test then
spoils one field of ``config.json`` (or one file) and loads.
"""

import json
import re
import zipfile

import pytest
import torch
from safetensors.torch import save_file

from fa3_spec.eagle import CheckpointError, Eagle3Draft, cli, from_pretrained
from fa3_spec.eagle.text import checkpoint_eos_ids

INF, NAN = float("inf"), float("nan")

#: A well-formed target: GQA, explicit head_dim, three layers (an EAGLE-3 head
#: reads layers 2, L // 2 and L - 3 of it).
TARGET = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=16,
              hidden_size=8, intermediate_size=12, num_hidden_layers=3, num_attention_heads=2,
              num_key_value_heads=1, head_dim=4, rms_norm_eps=1e-5, rope_theta=10000.0,
              max_position_embeddings=64, tie_word_embeddings=False, torch_dtype="float32")

LLAMA3 = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
              original_max_position_embeddings=16)

DRAFT_VOCAB = 8


def layer_weights(prefix, cfg, in_features, *, input_layernorm=True):
    """``{name: shape}`` of one Llama decoder layer in Hugging Face names."""
    h, i, d = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    hq, hkv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d
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


def random_weights(names, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=g) for n, s in names.items()}


def target_weights(cfg=TARGET, seed=0):
    h, v = cfg["hidden_size"], cfg["vocab_size"]
    names = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,),
             "lm_head.weight": (v, h)}
    for i in range(cfg["num_hidden_layers"]):
        names.update(layer_weights(f"model.layers.{i}", cfg, h))
    return random_weights(names, seed)


def write_config(path, cfg, drop=()):
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({k: v for k, v in cfg.items()
                                                  if k not in drop}))


def write_target(path, drop=(), weights=TARGET, **fields):
    """A target directory: ``TARGET`` updated with ``fields``, less ``drop``; the
    weights are those of the config ``weights``."""
    write_config(path, {**TARGET, **fields}, drop)
    save_file(target_weights(weights), path / "model.safetensors")
    return path


def write_eagle3(path, drop=(), **fields):
    """An EAGLE-3 head for ``TARGET`` in sglang's layout (``midlayer.*``, ``d2t``)."""
    cfg = {**TARGET, "architectures": ["LlamaForCausalLMEagle3"], "num_hidden_layers": 1,
           "draft_vocab_size": DRAFT_VOCAB}
    h = cfg["hidden_size"]
    names = layer_weights("midlayer", cfg, 2 * h)
    names.update({"midlayer.hidden_norm.weight": (h,), "norm.weight": (h,),
                  "fc.weight": (h, 3 * h), "lm_head.weight": (DRAFT_VOCAB, h)})
    w = random_weights(names, seed=1)
    w["d2t"] = torch.arange(DRAFT_VOCAB, dtype=torch.int64)  # draft id i -> target id 2 i
    write_config(path, {**cfg, **fields}, drop)
    save_file(w, path / "model.safetensors")
    return path


def refused(path, field, *load_args):
    """``from_pretrained(*load_args)`` must raise one `CheckpointError` naming the
    file ``path`` and ``field``."""
    pattern = rf"{re.escape(str(path))}: field '{re.escape(field)}'"
    with pytest.raises(CheckpointError, match=pattern):
        from_pretrained(*load_args)


@pytest.fixture
def target(tmp_path):
    return write_target(tmp_path / "target")


# ----------------------------------------------------------------- booleans
@pytest.mark.parametrize("field, value", [("tie_word_embeddings", "false"),
                                          ("tie_word_embeddings", 0),
                                          ("attention_bias", "false")])
def test_a_target_boolean_that_is_not_a_json_bool_is_refused(tmp_path, field, value):
    d = write_target(tmp_path, **{field: value})
    refused(d / "config.json", field, d)


@pytest.mark.parametrize("field, value", [("norm_before_residual", "false"),
                                          ("norm_before_residual", 1),
                                          ("norm_before_fc", "false")])
def test_an_eagle3_boolean_that_is_not_a_json_bool_is_refused(target, tmp_path, field, value):
    head = write_eagle3(tmp_path / "head", **{field: value})
    refused(head / "config.json", field, target, head)


def test_untied_embeddings_keep_the_stored_lm_head(target):
    t = from_pretrained(target).target
    assert torch.equal(t.lm_head, target_weights()["lm_head.weight"].t())


# ----------------------------------------------------------------- domains
@pytest.mark.parametrize("field, value", [
    ("rms_norm_eps", -1e-6), ("rms_norm_eps", INF), ("rms_norm_eps", NAN),
    ("rope_theta", 0.0), ("rope_theta", -10000.0), ("rope_theta", INF), ("rope_theta", NAN),
    pytest.param("rope_theta", 10 ** 400, id="rope_theta-int-beyond-float"),
])
def test_float_fields_outside_their_domain_are_refused(tmp_path, field, value):
    d = write_target(tmp_path, **{field: value})
    refused(d / "config.json", field, d)


LLAMA3_DOMAIN = [("factor", 0.0), ("factor", -2.0), ("factor", INF), ("factor", NAN),
                 ("low_freq_factor", 0.0), ("low_freq_factor", -1.0),
                 ("high_freq_factor", NAN), ("high_freq_factor", 1.0),  # = low_freq_factor
                 ("high_freq_factor", 0.5),  # < low_freq_factor
                 ("original_max_position_embeddings", 0),
                 ("original_max_position_embeddings", -16),
                 ("original_max_position_embeddings", 16.5)]


@pytest.mark.parametrize("key", ["rope_scaling", "rope_parameters"])
@pytest.mark.parametrize("field, value", LLAMA3_DOMAIN)
def test_llama3_rope_scaling_outside_its_domain_is_refused(tmp_path, key, field, value):
    d = write_target(tmp_path, **{key: {**LLAMA3, field: value}})
    refused(d / "config.json", f"{key}.{field}", d)


def test_a_well_formed_llama3_scaling_loads(tmp_path):
    d = write_target(tmp_path, rope_scaling=LLAMA3)
    scaling = from_pretrained(d).target.shape.rope_scaling
    assert (scaling.factor, scaling.low_freq_factor, scaling.high_freq_factor,
            scaling.original_max_position_embeddings) == (8.0, 1.0, 4.0, 16)


# ----------------------------------------------------------------- malformed files and fields
def test_a_config_json_that_is_not_an_object_is_refused(tmp_path):
    tmp_path.joinpath("config.json").write_text(json.dumps([TARGET]))
    with pytest.raises(CheckpointError, match=rf"{re.escape(str(tmp_path))}/config\.json: "
                                              r"not a JSON object"):
        from_pretrained(tmp_path)


def test_an_eagle_config_that_is_not_an_object_is_refused(target, tmp_path):
    head = write_eagle3(tmp_path / "head", eagle_config=[{"use_aux_hidden_state": True}])
    refused(head / "config.json", "eagle_config", target, head)


@pytest.mark.parametrize("field, value", [("hidden_size", INF), ("vocab_size", NAN),
                                          ("intermediate_size", 1e999)])
def test_non_finite_sizes_are_refused(tmp_path, field, value):
    d = write_target(tmp_path, **{field: value})
    refused(d / "config.json", field, d)


@pytest.mark.parametrize("eos", [1e999, "2", [1, "2"], -1, True, {"id": 2}])
def test_a_malformed_eos_token_id_is_refused(target, eos):
    path = target / "generation_config.json"
    path.write_text(json.dumps({"eos_token_id": eos}))
    with pytest.raises(CheckpointError, match=rf"{re.escape(str(path))}: field 'eos_token_id'"):
        checkpoint_eos_ids(target)


def test_eos_token_ids_are_read_from_the_generation_config_then_the_config(target):
    assert checkpoint_eos_ids(target) == ()
    write_config(target, {**TARGET, "eos_token_id": 3})
    assert checkpoint_eos_ids(target) == (3,)
    (target / "generation_config.json").write_text(json.dumps({"eos_token_id": [5, 7]}))
    assert checkpoint_eos_ids(target) == (5, 7)


def test_a_generation_config_that_is_not_an_object_is_refused(target):
    path = target / "generation_config.json"
    path.write_text("[2]")
    with pytest.raises(CheckpointError, match=rf"{re.escape(str(path))}: not a JSON object"):
        checkpoint_eos_ids(target)


def test_zero_heads_without_head_dim_are_refused(tmp_path):
    d = write_target(tmp_path, drop=("head_dim",), num_attention_heads=0)
    refused(d / "config.json", "num_attention_heads", d)


@pytest.mark.parametrize("field, value", [("num_hidden_layers", 0),
                                          ("max_position_embeddings", -5),
                                          ("max_position_embeddings", 0),
                                          ("vocab_size", 0), ("intermediate_size", -12)])
def test_sizes_below_one_are_refused(tmp_path, field, value):
    d = write_target(tmp_path, **{field: value})
    refused(d / "config.json", field, d)


def test_a_truncated_safetensors_file_is_refused_by_name(target):
    path = target / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=rf"{re.escape(str(path))}: "):
        from_pretrained(target)


def test_a_truncated_shard_of_an_index_is_refused_by_name(target):
    path = target / "model.safetensors"
    (target / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {name: path.name for name in target_weights()}}))
    path.write_bytes(path.read_bytes()[:100])
    with pytest.raises(CheckpointError, match=rf"{re.escape(str(path))}: "):
        from_pretrained(target)


def _bin_target(path, obj, **save):
    write_config(path, TARGET)
    torch.save(obj, path / "pytorch_model.bin", **save)
    return path / "pytorch_model.bin"


@pytest.mark.parametrize("obj", [[torch.zeros(2)], {"model.norm.weight": 3},
                                 {0: torch.zeros(2)}])
def test_a_bin_file_that_is_not_a_dict_of_named_tensors_is_refused(tmp_path, obj):
    path = _bin_target(tmp_path, obj)
    with pytest.raises(CheckpointError, match=rf"{re.escape(str(path))}: "):
        from_pretrained(tmp_path)


def test_a_truncated_bin_file_is_refused_by_name(tmp_path):
    path = _bin_target(tmp_path, target_weights())
    path.write_bytes(path.read_bytes()[:200])
    with pytest.raises(CheckpointError, match=rf"{re.escape(str(path))}: "):
        from_pretrained(tmp_path)


@pytest.mark.parametrize("index", [{"weight_map": ["model.safetensors"]}, ["weight_map"],
                                   {"weight_map": {"model.norm.weight": 3}}, {}])
def test_a_malformed_shard_index_is_refused_by_name(target, index):
    path = target / "model.safetensors.index.json"
    path.write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=rf"{re.escape(str(path))}: "):
        from_pretrained(target)


def test_a_zero_draft_vocabulary_is_refused(target, tmp_path):
    head = write_eagle3(tmp_path / "head", draft_vocab_size=0)
    refused(head / "config.json", "draft_vocab_size", target, head)


def test_a_legacy_non_zip_bin_file_loads_the_same_weights(tmp_path):
    path = _bin_target(tmp_path, target_weights(), _use_new_zipfile_serialization=False)
    assert not zipfile.is_zipfile(path)
    t = from_pretrained(tmp_path).target
    want = target_weights()
    assert torch.equal(t.embed, want["model.embed_tokens.weight"])
    assert torch.equal(t.lm_head, want["lm_head.weight"].t())
    assert torch.equal(t.norm, want["model.norm.weight"])


# ----------------------------------------------------------------- integer sizes
@pytest.mark.parametrize("field, value", [("hidden_size", 8.7), ("hidden_size", 8.0),
                                          ("hidden_size", True), ("hidden_size", "8"),
                                          ("num_attention_heads", 2.0),
                                          ("num_hidden_layers", 3.5),
                                          ("vocab_size", "16"), ("head_dim", 4.0),
                                          ("max_position_embeddings", 64.0)])
def test_sizes_must_be_json_integers(tmp_path, field, value):
    d = write_target(tmp_path, **{field: value})
    refused(d / "config.json", field, d)


# ----------------------------------------------------------------- no silent defaults
MHA = {**TARGET, "num_key_value_heads": 2}  # the weights a defaulted num_key_value_heads reads


@pytest.mark.parametrize("field, value", [("head_dim", 0), ("head_dim", -4),
                                          ("num_key_value_heads", 0),
                                          ("num_key_value_heads", -1)])
def test_zero_or_negative_head_counts_are_refused_not_defaulted(tmp_path, field, value):
    """The weights are those the default (hidden // heads, or MHA) implies."""
    d = write_target(tmp_path, weights=MHA, **{"num_key_value_heads": 2, field: value})
    refused(d / "config.json", field, d)


@pytest.mark.parametrize("drop, fields, field", [
    ((), dict(head_dim=5), "head_dim"),  # RoPE rotates pairs of dimensions
    (("head_dim",), dict(num_attention_heads=8, num_key_value_heads=8), "head_dim"),  # 8 // 8
    (("head_dim",), dict(num_attention_heads=16, num_key_value_heads=16), "head_dim"),  # 8 // 16
    ((), dict(num_key_value_heads=3), "num_key_value_heads"),  # 2 heads: no GQA groups of 3
])
def test_head_geometry_that_attention_cannot_run_is_refused(tmp_path, drop, fields, field):
    d = write_target(tmp_path, drop=drop, **fields)
    refused(d / "config.json", field, d)


def test_absent_or_null_optional_fields_keep_their_defaults(tmp_path):
    """head_dim: hidden // heads; num_key_value_heads: the heads (MHA)."""
    cfg = MHA
    write_config(tmp_path, cfg)
    save_file(target_weights(cfg), tmp_path / "model.safetensors")
    optional = ("head_dim", "num_key_value_heads", "rms_norm_eps", "rope_theta")
    for null in (True, False):
        if null:
            write_config(tmp_path, {**cfg, **dict.fromkeys(optional)})
        else:
            write_config(tmp_path, cfg, drop=optional)
        shape = from_pretrained(tmp_path).target.shape
        assert (shape.head_dim, shape.num_kv_heads) == (4, 2)
        assert (shape.rms_eps, shape.rope_theta) == (1e-6, 10000.0)


# ----------------------------------------------------------------- field types
@pytest.mark.parametrize("field, value", [("rope_theta", "x"), ("rms_norm_eps", "1e-5"),
                                          ("rope_theta", True), ("rope_scaling", 3),
                                          ("rope_parameters", [1]), ("torch_dtype", ["float32"]),
                                          ("hidden_act", 3), ("model_type", ["llama"])])
def test_a_field_of_the_wrong_type_is_refused_by_name(tmp_path, field, value):
    d = write_target(tmp_path, **{field: value})
    refused(d / "config.json", field, d)


@pytest.mark.parametrize("field, value", [("rope_type", 3), ("rope_theta", "500000")])
def test_a_rope_scaling_entry_of_the_wrong_type_is_refused_by_name(tmp_path, field, value):
    d = write_target(tmp_path, rope_scaling={**LLAMA3, field: value})
    refused(d / "config.json", f"rope_scaling.{field}", d)


@pytest.mark.parametrize("ids", ["0,1,2", [0, "1", 2], [0, 1.0, 2], 2])
def test_malformed_eagle3_aux_layer_ids_are_refused(target, tmp_path, ids):
    head = write_eagle3(tmp_path / "head",
                        eagle_config={"eagle_aux_hidden_state_layer_ids": ids})
    refused(head / "config.json", "eagle_config.eagle_aux_hidden_state_layer_ids", target, head)


def test_a_well_formed_eagle3_head_loads(target, tmp_path):
    head = write_eagle3(tmp_path / "head", norm_before_residual=True,
                        eagle_config={"eagle_aux_hidden_state_layer_ids": [0, 1, 2]})
    draft = from_pretrained(target, head).draft
    assert isinstance(draft, Eagle3Draft) and draft.norm_before_residual
    assert draft.aux_layers == (1, 2, 3)
    assert torch.equal(draft.d2t, 2 * torch.arange(DRAFT_VOCAB))


# ----------------------------------------------------------------- architectures
@pytest.mark.parametrize("archs", ["LlamaForCausalLM", "NotLlamaForCausalLMX",
                                   ["LlamaForCausalLM", 3], {"LlamaForCausalLM": 1}])
def test_target_architectures_must_be_a_list_of_strings(tmp_path, archs):
    d = write_target(tmp_path, architectures=archs)
    refused(d / "config.json", "architectures", d)


def test_an_architecture_that_only_contains_llama_is_refused(tmp_path):
    d = write_target(tmp_path, architectures=["NotLlamaForCausalLMX"])
    refused(d / "config.json", "architectures", d)


@pytest.mark.parametrize("archs", ["LlamaForCausalLMEagle3", [["LlamaForCausalLMEagle3"]]])
def test_head_architectures_must_be_a_list_of_strings(target, tmp_path, archs):
    head = write_eagle3(tmp_path / "head", architectures=archs)
    refused(head / "config.json", "architectures", target, head)


# ----------------------------------------------------------------- the command
@pytest.mark.parametrize("spoil", ["hidden_size", "eos_token_id"])
def test_a_malformed_checkpoint_is_a_one_line_usage_error(target, spoil, capsys):
    if spoil == "hidden_size":
        write_config(target, {**TARGET, "hidden_size": INF})
        path = target / "config.json"
    else:
        path = target / "generation_config.json"
        path.write_text(json.dumps({"eos_token_id": 1e999}))
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--model", str(target), "--device", "cpu", "--attention-backend", "torch"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert f"{path}: field '{spoil}'" in err.strip().splitlines()[-1]

