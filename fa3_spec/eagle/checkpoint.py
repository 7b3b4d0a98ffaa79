"""Local Hugging Face checkpoints: a Llama target and an EAGLE-1/2 or EAGLE-3 draft head.

    models = from_pretrained("Llama-3.1-8B-Instruct", "EAGLE3-LLaMA3.1-Instruct-8B",
                             dtype=torch.bfloat16, device="cuda")

Reads ``config.json`` and the weights of a directory: ``*.safetensors``
(one file, or shards listed by ``model.safetensors.index.json``) or
``pytorch_model*.bin`` (``torch.load(weights_only=True, mmap=True)``; the
legacy non-zip format is read whole, as it cannot be memory-mapped). No
network: paths are local directories. Tensors are read one at a time from
memory-mapped files and converted layer by layer on ``device``
(`LayerWeights.from_projections`, the one conversion the presets use too),
so host memory holds at most one layer's raw tensors beyond what the model
keeps.

What is refused, with a `CheckpointError` naming the file and the field:
a config that is not a JSON object, a field of the wrong JSON type (the
string ``"false"`` for a boolean, ``32.0`` or ``true`` for a size, a string
for a number; transformers refuses these too) or outside its domain (a size
below 1, a non-finite number, ``rope_theta`` or a llama3 scaling factor <= 0,
``high_freq_factor <= low_freq_factor``, ``rms_norm_eps < 0``, an odd
``head_dim``), a weights file that cannot be read (truncated, or a ``.bin``
that is not a state dict), another architecture, attention or MLP biases,
an activation other than SiLU, a RoPE type other than none or
``"llama3"``, quantized weights (``quantization_config``, or a non-float
tensor), a missing shard or tensor, a tensor of the wrong shape, and draft
heads whose K/V geometry differs from the target's (the loop keeps both
caches in one pool).

Draft heads (``draft_dir``), told apart by `draft_kind`:

* **EAGLE-1/2** (``LlamaForCausalLMEagle``, or a ``LlamaForCausalLM`` config
  whose weights hold ``fc.weight`` of ``[H, 2H]``): ``fc`` (with bias) over
  ``[embed; hidden]``, one layer without ``input_layernorm``, no final
  norm; embedding and lm_head are the target's, and the head reads the
  target's hidden state after its final norm (what sglang hands over).
* **EAGLE-3** (``*Eagle3*`` architectures, ``draft_vocab_size``, or a ``d2t``
  tensor): sglang 0.5.23's ``llama_eagle3.py`` layout (``midlayer.*`` or
  ``layers.0.*``, ``fc``, ``norm``, ``lm_head`` over ``draft_vocab_size``
  tokens, ``d2t`` with ``target id = draft id + d2t[draft id]``). It reads
  the target's residual stream at the input of layers ``2, L // 2, L - 3``
  (sglang's and vLLM's default), or after layers
  ``eagle_config.eagle_aux_hidden_state_layer_ids`` when given.

``dtype=None`` is the target checkpoint's ``dtype``/``torch_dtype``; the draft
is loaded in the target's dtype.
"""

from __future__ import annotations

import json
import math
import pathlib
import pickle
import zipfile
from typing import Dict, Iterator, Optional, Tuple, Union

import torch

from .models import (
    Eagle3Draft, EagleDraft, EagleModels, LayerWeights, Llama3RopeScaling, LlamaTarget,
    ModelShape, RopeTable,
)

PathLike = Union[str, pathlib.Path]

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32,
          "float64": torch.float64}

#: safetensors' dtype names (read from a file's header, before its data).
_SAFETENSORS_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32,
                       "F64": torch.float64, "I8": torch.int8, "U8": torch.uint8,
                       "I16": torch.int16, "I32": torch.int32, "I64": torch.int64,
                       "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn,
                       "F8_E5M2": torch.float8_e5m2}


class CheckpointError(ValueError):
    """A checkpoint this loader cannot read; the message names the file and field."""


# ---------------------------------------------------------------- configs
def read_config(directory: PathLike, name: str = "config.json") -> dict:
    """``directory/name`` (``config.json`` unless told) as a dict (a `CheckpointError`
    if absent, not JSON or not a JSON object)."""
    path = pathlib.Path(directory).expanduser() / name
    if not path.is_file():
        raise CheckpointError(f"{path}: not found (a Hugging Face checkpoint directory "
                              "holds config.json)")
    return _read_json(path)


def _read_json(path: pathlib.Path) -> dict:
    try:
        value = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(value, dict):
        raise CheckpointError(f"{path}: not a JSON object (a {type(value).__name__})")
    return value


# Typed field readers: every config field is read through one of these, so a
# bad value is refused once, naming the file and the field. An absent key and
# a JSON null both mean ``default``; ``within`` names the enclosing field
# (``rope_scaling.factor``).
_REQUIRED = object()


def _default(name: str, where: pathlib.Path, default, within: str):
    if default is _REQUIRED:
        raise CheckpointError(f"{where}: field {_label(name, within)!r} is missing")
    return default


def _label(name: str, within: str) -> str:
    return f"{within}.{name}" if within else name


def _bad(where: pathlib.Path, name: str, within: str, what: str, value) -> CheckpointError:
    return CheckpointError(f"{where}: field {_label(name, within)!r} must be {what}, "
                           f"got {value!r}")


def _is_int(value, minimum: int) -> bool:
    """A JSON integer (a float such as 32.0 is not one, nor a bool, as transformers' configs
    have it) that is at least ``minimum``."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= minimum


def _int_field(config: dict, name: str, where: pathlib.Path, default=_REQUIRED, *,
               minimum: int = 1, within: str = "") -> int:
    """``config[name]``: a size or count, a JSON integer >= ``minimum``."""
    value = config.get(name)
    if value is None:
        return _default(name, where, default, within)
    if not _is_int(value, minimum):
        what = "a positive int" if minimum == 1 else f"an int >= {minimum}"
        raise _bad(where, name, within, what, value)
    return value


def _float_field(config: dict, name: str, where: pathlib.Path, default=_REQUIRED, *,
                 positive: bool = True, within: str = "") -> float:
    """``config[name]``: a finite JSON number, > 0 (``positive``) or >= 0."""
    value = config.get(name)
    if value is None:
        return _default(name, where, default, within)
    try:
        number = float(value) if _is_number(value) else math.nan
    except OverflowError:  # an int beyond float's range
        number = math.inf
    if not (math.isfinite(number) and (number > 0 if positive else number >= 0)):
        raise _bad(where, name, within, "a finite number " + ("> 0" if positive else ">= 0"),
                   value)
    return number


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _bool_field(config: dict, name: str, where: pathlib.Path, default: bool = False, *,
                within: str = "") -> bool:
    """``config[name]``: a JSON ``true``/``false`` (the string ``"false"`` is refused,
    as transformers refuses it, rather than read as true)."""
    value = config.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise _bad(where, name, within, "true or false", value)
    return value


def _str_field(config: dict, name: str, where: pathlib.Path, default=_REQUIRED, *,
               within: str = "") -> str:
    value = config.get(name)
    if value is None:
        return _default(name, where, default, within)
    if not isinstance(value, str):
        raise _bad(where, name, within, "a string", value)
    return value


def _dict_field(config: dict, name: str, where: pathlib.Path) -> dict:
    """``config[name]``: a JSON object (``{}`` when absent or null)."""
    value = config.get(name)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise _bad(where, name, "", "a JSON object", value)
    return value


def _list_field(config: dict, name: str, where: pathlib.Path, item: type, default=None, *,
                within: str = "") -> Optional[Tuple]:
    """``config[name]``: a JSON list of ``item`` (``str`` or ``int``; a bool is no int)."""
    value = config.get(name)
    if value is None:
        return default
    if not (isinstance(value, list)
            and all(isinstance(x, item) and not isinstance(x, bool) for x in value)):
        raise _bad(where, name, within, f"a list of {item.__name__}", value)
    return tuple(value)


def eos_token_ids(config: dict, where: pathlib.Path) -> Optional[Tuple[int, ...]]:
    """``config["eos_token_id"]`` (one id or a list of ids, each >= 0) as a tuple; None
    when absent or null."""
    value = config.get("eos_token_id")
    if value is None:
        return None
    ids = value if isinstance(value, list) else [value]
    if not all(_is_int(i, 0) for i in ids):
        raise _bad(where, "eos_token_id", "", "a token id >= 0 or a list of them", value)
    return tuple(ids)


def _refuse_true(config: dict, names, where: pathlib.Path, what: str) -> None:
    for name in names:
        if _bool_field(config, name, where):
            raise CheckpointError(f"{where}: field {name!r} = true: {what} are not supported")


def _rope(config: dict, where: pathlib.Path) -> Tuple[float, Optional[Llama3RopeScaling]]:
    """``rope_theta`` and the scaling, from ``rope_parameters`` (transformers 5)
    or ``rope_scaling`` + ``rope_theta`` (earlier)."""
    params = _dict_field(config, "rope_parameters", where)
    name = "rope_parameters" if params else "rope_scaling"
    spec = {**_dict_field(config, "rope_scaling", where), **params}
    theta = _float_field(spec, "rope_theta", where, None, within=name)
    if theta is None:
        theta = _float_field(config, "rope_theta", where, 10000.0)
    kind = _str_field(spec, "rope_type", where, None, within=name)
    if kind is None:
        kind = _str_field(spec, "type", where, "default", within=name)
    if kind == "default":
        return theta, None
    if kind != "llama3":
        raise CheckpointError(f"{where}: field {name!r} has rope_type {kind!r}; supported: "
                              "none/'default' and 'llama3'")
    return theta, _llama3_scaling(spec, where, name)


def _llama3_scaling(spec: dict, where: pathlib.Path, name: str) -> Llama3RopeScaling:
    """Every factor positive and finite, ``low_freq_factor < high_freq_factor`` (the
    interpolation divides by their difference; transformers warns otherwise)."""
    factors = {key: _float_field(spec, key, where, within=name)
               for key in ("factor", "low_freq_factor", "high_freq_factor")}
    if factors["high_freq_factor"] <= factors["low_freq_factor"]:
        raise _bad(where, "high_freq_factor", name,
                   f"greater than low_freq_factor ({factors['low_freq_factor']!r})",
                   factors["high_freq_factor"])
    return Llama3RopeScaling(**factors, original_max_position_embeddings=_int_field(
        spec, "original_max_position_embeddings", where, within=name))


def checkpoint_dtype(config: dict, where: pathlib.Path) -> torch.dtype:
    """The config's ``dtype`` (transformers 5) or ``torch_dtype``; float32 if neither."""
    key = "dtype" if config.get("dtype") is not None else "torch_dtype"
    name = _str_field(config, key, where, "float32")
    if name not in DTYPES:
        raise CheckpointError(f"{where}: field {key!r} = {name!r}; supported: {sorted(DTYPES)}")
    return DTYPES[name]


def _layer_shape(config: dict, where: pathlib.Path, *, vocab_size: int, num_layers: int,
                 max_positions: int) -> ModelShape:
    """The Llama numbers of ``config`` shared by targets and draft heads."""
    _refuse_true(config, ("attention_bias", "mlp_bias"), where, "biases")
    if config.get("quantization_config"):
        raise CheckpointError(f"{where}: field 'quantization_config': quantized checkpoints "
                              "are not supported")
    act = _str_field(config, "hidden_act", where, "silu")
    if act != "silu":
        raise CheckpointError(f"{where}: field 'hidden_act' = {act!r}; only 'silu' is supported")
    hidden = _int_field(config, "hidden_size", where)
    heads = _int_field(config, "num_attention_heads", where)
    kv_heads = _int_field(config, "num_key_value_heads", where, heads)
    if heads % kv_heads:
        raise _bad(where, "num_key_value_heads", "",
                   f"a divisor of num_attention_heads ({heads})", kv_heads)
    head_dim = _int_field(config, "head_dim", where, hidden // heads)
    if head_dim < 1 or head_dim % 2:  # RoPE rotates pairs of dimensions
        raise _bad(where, "head_dim", "", "a positive even int (without it: hidden_size // "
                   "num_attention_heads)", head_dim)
    theta, scaling = _rope(config, where)
    return ModelShape(
        vocab_size=vocab_size, hidden_size=hidden, num_layers=num_layers, num_heads=heads,
        num_kv_heads=kv_heads, head_dim=head_dim,
        intermediate_size=_int_field(config, "intermediate_size", where),
        rope_theta=theta, rms_eps=_float_field(config, "rms_norm_eps", where, 1e-6,
                                               positive=False),
        max_position_embeddings=max_positions, rope_scaling=scaling)


def target_shape(config: dict, where: pathlib.Path) -> ModelShape:
    """`ModelShape` of a Llama target's ``config.json`` (refusing what the model lacks)."""
    archs = _list_field(config, "architectures", where, str, ("LlamaForCausalLM",))
    model_type = _str_field(config, "model_type", where, "llama")
    if "LlamaForCausalLM" not in archs or model_type != "llama":
        raise CheckpointError(f"{where}: field 'architectures' = {list(archs)!r} (model_type "
                              f"{model_type!r}); only LlamaForCausalLM targets are supported")
    return _layer_shape(config, where, vocab_size=_int_field(config, "vocab_size", where),
                        num_layers=_int_field(config, "num_hidden_layers", where),
                        max_positions=_int_field(config, "max_position_embeddings", where, 2048))


# ---------------------------------------------------------------- weights
class WeightFiles:
    """The tensors of one checkpoint directory, read one at a time.

    safetensors files are opened with ``safe_open`` (memory-mapped; a tensor
    is read when asked for); ``.bin`` files with ``torch.load(weights_only=True,
    mmap=True)`` (the legacy non-zip format without ``mmap``). A file that cannot be
    read, or a ``.bin`` that is not a state dict, is a `CheckpointError` naming it.
    Use as a context manager.
    """

    def __init__(self, directory: PathLike):
        self.directory = pathlib.Path(directory).expanduser()
        self._where: Dict[str, pathlib.Path] = {}  # tensor name -> file
        self._open: Dict[pathlib.Path, object] = {}
        d = self.directory
        for index, pattern in (("model.safetensors.index.json", "*.safetensors"),
                               ("pytorch_model.bin.index.json", "pytorch_model*.bin")):
            if (d / index).is_file():
                self._from_index(d / index)
                return
            files = sorted(d.glob(pattern))
            if files:
                for f in files:
                    for name in self._handle(f).keys():
                        self._where[name] = f
                return
        raise CheckpointError(f"{d}: no weights found (*.safetensors, or pytorch_model*.bin)")

    def _from_index(self, index: pathlib.Path) -> None:
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            what = "missing" if weight_map is None else f"a {type(weight_map).__name__}"
            raise CheckpointError(f"{index}: field 'weight_map' is {what}; a shard index maps "
                                  "tensor names to shard files")
        for name, file in weight_map.items():
            if not isinstance(file, str):
                raise CheckpointError(f"{index}: field 'weight_map' maps {name!r} to {file!r}, "
                                      "not a shard file name")
            self._where[name] = self.directory / file
        for shard in sorted(set(self._where.values())):
            if not shard.is_file():
                raise CheckpointError(f"{index} lists shard {shard.name!r}, which is missing "
                                      f"from {self.directory}")

    def _handle(self, file: pathlib.Path):
        if file not in self._open:
            self._open[file] = (_open_safetensors(file) if file.suffix == ".safetensors"
                                else _load_bin(file))
        return self._open[file]

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def keys(self) -> Iterator[str]:
        return iter(self._where)

    def _file_holding(self, name: str):
        """``(file, handle)`` of the file that holds ``name``."""
        if name not in self._where:
            raise CheckpointError(f"{self.directory}: tensor {name!r} is missing")
        file = self._where[name]
        handle = self._handle(file)
        if name not in handle.keys():
            raise CheckpointError(f"{file}: tensor {name!r} is missing (the index says "
                                  "this shard holds it)")
        return file, handle

    def raw(self, name: str) -> torch.Tensor:
        """The tensor as stored (CPU, the file's dtype)."""
        _, handle = self._file_holding(name)
        return handle[name] if isinstance(handle, dict) else handle.get_tensor(name)

    def stored_shape(self, name: str) -> Tuple[int, ...]:
        return self._stored_dtype_and_shape(name)[1]

    def _stored_dtype_and_shape(self, name: str):
        _, handle = self._file_holding(name)
        if isinstance(handle, dict):
            return handle[name].dtype, tuple(handle[name].shape)
        piece = handle.get_slice(name)  # reads the header only
        stored = piece.get_dtype()
        return _SAFETENSORS_DTYPES.get(stored, stored), tuple(piece.get_shape())

    def get(self, name: str, shape: Tuple[int, ...], *, dtype: torch.dtype,
            device) -> torch.Tensor:
        """A float tensor of ``shape``, cast to ``dtype`` on ``device``; the
        dtype and shape are checked before it is read."""
        stored, got = self._stored_dtype_and_shape(name)
        if stored not in DTYPES.values():
            raise CheckpointError(
                f"{self._where[name]}: tensor {name!r} has dtype {stored}; only float weights "
                "(bfloat16, float16, float32, float64) are supported (quantized checkpoints "
                "are not)")
        if got != tuple(shape):
            raise CheckpointError(f"{self._where[name]}: tensor {name!r} has shape "
                                  f"{list(got)}, the config implies {list(shape)}")
        return self.raw(name).to(device=device, dtype=dtype)

    def close(self) -> None:
        self._open.clear()

    def __enter__(self) -> "WeightFiles":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _first_line(exc: Exception) -> str:
    return f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0]}"


def _open_safetensors(file: pathlib.Path):
    """``safe_open`` of ``file``, which checks its header against the file's length."""
    from safetensors import safe_open

    try:
        return safe_open(str(file), framework="pt", device="cpu")
    except Exception as exc:  # SafetensorError on a truncated or corrupt file, OSError
        raise CheckpointError(f"{file}: not a readable safetensors file "
                              f"({_first_line(exc)})") from None


def _load_bin(file: pathlib.Path) -> Dict[str, torch.Tensor]:
    """A ``.bin`` state dict, ``{name: tensor}``: memory-mapped in torch's zip format;
    the legacy (non-zip) format cannot be mapped and is read whole."""
    try:
        state = torch.load(file, map_location="cpu", weights_only=True,
                           mmap=zipfile.is_zipfile(file))
    except pickle.UnpicklingError:  # torch's message advises weights_only=False: not here
        raise CheckpointError(f"{file}: not a readable PyTorch state dict (damaged, or it "
                              "holds objects other than tensors)") from None
    except Exception as exc:  # a damaged file: RuntimeError, EOFError, KeyError, ...
        raise CheckpointError(f"{file}: not a readable PyTorch state dict "
                              f"({_first_line(exc)})") from None
    if not isinstance(state, dict):
        raise CheckpointError(f"{file}: holds a {type(state).__name__}; a state dict maps "
                              "tensor names to tensors")
    for name, value in state.items():
        if not (isinstance(name, str) and isinstance(value, torch.Tensor)):
            raise CheckpointError(f"{file}: entry {name!r} is a {type(value).__name__}; a "
                                  "state dict maps tensor names to tensors")
    return state


def _layer(files: WeightFiles, prefix: str, shape: ModelShape, *, in_features: int,
           attn_norm: bool, dtype, device) -> LayerWeights:
    """One decoder layer ``prefix.*`` in Hugging Face names, through
    `LayerWeights.from_projections`."""
    h, d, i = shape.hidden_size, shape.head_dim, shape.intermediate_size
    hq, hkv = shape.num_heads * d, shape.num_kv_heads * d

    def get(name, *dims):
        return files.get(f"{prefix}.{name}", dims, dtype=dtype, device=device)

    return LayerWeights.from_projections(
        q=get("self_attn.q_proj.weight", hq, in_features),
        k=get("self_attn.k_proj.weight", hkv, in_features),
        v=get("self_attn.v_proj.weight", hkv, in_features),
        o=get("self_attn.o_proj.weight", h, hq),
        gate=get("mlp.gate_proj.weight", i, h), up=get("mlp.up_proj.weight", i, h),
        down=get("mlp.down_proj.weight", h, i),
        attn_norm=get("input_layernorm.weight", h) if attn_norm else None,
        mlp_norm=get("post_attention_layernorm.weight", h))


def _resolve_dtype(dtype, default: torch.dtype) -> torch.dtype:
    if dtype is None:
        return default
    if isinstance(dtype, str):
        dtype = DTYPES.get(dtype.replace("torch.", ""), dtype)
    if dtype not in DTYPES.values():
        raise CheckpointError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    return dtype


def load_target(model_dir: PathLike, *, dtype=None, device="cpu") -> LlamaTarget:
    """A `LlamaTarget` from a Hugging Face Llama checkpoint directory (see the module
    docstring). A tied checkpoint (``tie_word_embeddings``) gets ``lm_head`` as a
    transposed copy of its embedding."""
    d = pathlib.Path(model_dir).expanduser()
    config = read_config(d)
    where = d / "config.json"
    shape = target_shape(config, where)
    dtype = _resolve_dtype(dtype, checkpoint_dtype(config, where))
    h, v = shape.hidden_size, shape.vocab_size
    with WeightFiles(d) as files:
        def get(name, *dims):
            return files.get(name, dims, dtype=dtype, device=device)

        embed = get("model.embed_tokens.weight", v, h)
        layers = [_layer(files, f"model.layers.{i}", shape, in_features=h, attn_norm=True,
                         dtype=dtype, device=device) for i in range(shape.num_layers)]
        norm = get("model.norm.weight", h)
        if _bool_field(config, "tie_word_embeddings", where):
            lm_head = embed.t().contiguous()
        else:
            lm_head = get("lm_head.weight", v, h).t().contiguous()
    return LlamaTarget(shape, embed, layers, norm, lm_head,
                       RopeTable.create(shape, dtype=dtype, device=device))


# ---------------------------------------------------------------- draft heads
def draft_kind(draft_dir: PathLike) -> str:
    """``"eagle3"`` or ``"eagle"`` (EAGLE-1/2) of a draft head directory: from its
    ``config.json`` (architectures, ``draft_vocab_size``), then from its weights."""
    d = pathlib.Path(draft_dir).expanduser()
    config, where = read_config(d), d / "config.json"
    if "speculators_model_type" in config or "speculators_config" in config:
        raise CheckpointError(f"{where}: field 'speculators_model_type': the speculators "
                              "format is not supported; use a head in sglang's layout "
                              "(LlamaForCausalLMEagle3)")
    archs = " ".join(_list_field(config, "architectures", where, str, ()))
    if "eagle3" in archs.lower() or config.get("draft_vocab_size") is not None:
        return "eagle3"
    if "eagle" in archs.lower():
        return "eagle"
    with WeightFiles(d) as files:
        w = _DraftWeights(files, "draft")
        if "d2t" in w or "layers.0.hidden_norm.weight" in w:
            return "eagle3"
        if "fc.weight" in w:
            hidden = _int_field(config, "hidden_size", where)
            fc_in = files.stored_shape(w.names["fc.weight"])[1]
            if fc_in == 2 * hidden:
                return "eagle"
            if fc_in % hidden == 0 and fc_in > 2 * hidden:
                return "eagle3"
    raise CheckpointError(f"{d}: cannot tell the draft head's kind from config.json "
                          f"(architectures {archs!r}) or its weights (no fc.weight / d2t)")


def _draft_shape(config: dict, where: pathlib.Path, target: LlamaTarget) -> ModelShape:
    layers = _int_field(config, "num_hidden_layers", where, 1)
    if layers != 1:
        raise CheckpointError(f"{where}: field 'num_hidden_layers' = {layers}; draft heads "
                              "of one layer are supported")
    shape = _layer_shape(config, where, vocab_size=target.shape.vocab_size, num_layers=1,
                         max_positions=target.rope.max_positions)
    t = target.shape
    for name, got, want in (("hidden_size", shape.hidden_size, t.hidden_size),
                            ("target_hidden_size",
                             _int_field(config, "target_hidden_size", where, t.hidden_size),
                             t.hidden_size),
                            ("num_key_value_heads", shape.num_kv_heads, t.num_kv_heads),
                            ("head_dim", shape.head_dim, t.head_dim)):
        if got != want:
            raise CheckpointError(f"{where}: field {name!r} = {got}, the target's is {want} "
                                  "(the draft shares the target's embedding and KV pool)")
    return shape


def _aux_layers(config: dict, where: pathlib.Path, num_layers: int) -> Tuple[int, ...]:
    """Target layer inputs an EAGLE-3 head reads (see the module docstring)."""
    ids = _list_field(_dict_field(config, "eagle_config", where),
                      "eagle_aux_hidden_state_layer_ids", where, int, within="eagle_config")
    capture = (2, num_layers // 2, num_layers - 3) if ids is None else tuple(i + 1 for i in ids)
    bad = [c for c in capture if not 0 <= c <= num_layers]
    if bad:
        field = ("eagle_config.eagle_aux_hidden_state_layer_ids" if ids is not None
                 else "num_hidden_layers (of the target)")
        raise CheckpointError(f"{where}: EAGLE-3 reads target layer inputs {list(capture)} "
                              f"(field {field}), outside 0..{num_layers}")
    return capture


class _DraftWeights:
    """A head's `WeightFiles` under canonical names: a leading ``model.`` dropped
    and sglang's legacy ``midlayer.`` read as ``layers.0.``."""

    def __init__(self, files: WeightFiles, kind: str):
        self.files, self.kind, self.directory = files, kind, files.directory
        self.names = {}
        for name in files.keys():
            canon = name[len("model."):] if name.startswith("model.") else name
            self.names[canon.replace("midlayer.", "layers.0.")] = name

    def __contains__(self, name: str) -> bool:
        return name in self.names

    def raw(self, name: str) -> torch.Tensor:
        return self.files.raw(self._stored(name))

    def get(self, name: str, shape: Tuple[int, ...], *, dtype, device) -> torch.Tensor:
        return self.files.get(self._stored(name), shape, dtype=dtype, device=device)

    def _stored(self, name: str) -> str:
        if name not in self.names:
            raise CheckpointError(f"{self.directory}: tensor {name!r} is missing "
                                  f"({self.kind} head)")
        return self.names[name]


def load_draft(draft_dir: PathLike, target: LlamaTarget, *,
               device="cpu") -> Union[EagleDraft, Eagle3Draft]:
    """A published EAGLE-1/2 or EAGLE-3 head for ``target``, in the target's dtype
    (see the module docstring)."""
    d = pathlib.Path(draft_dir).expanduser()
    kind = draft_kind(d)
    config = read_config(d)
    where = d / "config.json"
    shape = _draft_shape(config, where, target)
    dtype, h = target.embed.dtype, shape.hidden_size
    load = dict(dtype=dtype, device=device)
    with WeightFiles(d) as files:
        w = _DraftWeights(files, kind)
        fc_bias = w.get("fc.bias", (h,), **load) if "fc.bias" in w else None
        if kind == "eagle":
            return EagleDraft(shape, w.get("fc.weight", (h, 2 * h), **load).t().contiguous(),
                              _layer(w, "layers.0", shape, in_features=h, attn_norm=False,
                                     **load),
                              None, target.embed, target.lm_head,
                              RopeTable.create(shape, **load), fc_bias=fc_bias,
                              normed_target=True)
        eagle = _dict_field(config, "eagle_config", where)
        for name in ("norm_before_fc", "fc_norm", "use_aux_norm", "norm_output"):
            # the head's own field, else eagle_config's
            if _bool_field(config, name, where,
                           _bool_field(eagle, name, where, within="eagle_config")):
                raise CheckpointError(f"{where}: field {name!r} = true is not supported")
        if not _bool_field(eagle, "use_aux_hidden_state", where, True, within="eagle_config"):
            raise CheckpointError(f"{where}: field 'eagle_config.use_aux_hidden_state' = "
                                  "False is not supported")
        aux = _aux_layers(config, where, target.shape.num_layers)
        lm_head, d2t = _eagle3_vocab(config, where, w, target, shape, device)
        return Eagle3Draft(
            shape, w.get("fc.weight", (h, len(aux) * h), **load).t().contiguous(),
            w.get("layers.0.input_layernorm.weight", (h,), **load),
            w.get("layers.0.hidden_norm.weight", (h,), **load),
            _layer(w, "layers.0", shape, in_features=2 * h, attn_norm=False, **load),
            w.get("norm.weight", (h,), **load), lm_head, d2t, target.embed,
            RopeTable.create(shape, **load), aux, fc_bias=fc_bias,
            norm_before_residual=_bool_field(config, "norm_before_residual", where))


def _eagle3_vocab(config: dict, where: pathlib.Path, w: _DraftWeights, target: LlamaTarget,
                  shape: ModelShape, device) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(lm_head [H, V_d], d2t int64 [V_d])`` of an EAGLE-3 head. Without
    ``draft_vocab_size`` (or tied) the head uses the target's vocabulary
    (sglang: the target's lm_head, or the embedding when tied)."""
    v, h = target.shape.vocab_size, shape.hidden_size
    vd = _int_field(config, "draft_vocab_size", where, None)
    if _bool_field(config, "tie_word_embeddings", where):
        return target.embed.t().contiguous(), torch.arange(v, device=device)
    if vd is None:
        return target.lm_head, torch.arange(v, device=device)
    lm_head = w.get("lm_head.weight", (vd, h), dtype=target.embed.dtype,
                    device=device).t().contiguous()
    offsets = w.raw("d2t")
    if tuple(offsets.shape) != (vd,) or offsets.is_floating_point():
        raise CheckpointError(f"{w.directory}: tensor 'd2t' has dtype {offsets.dtype} and "
                              f"shape {list(offsets.shape)}; an integer [{vd}] "
                              "(draft_vocab_size) tensor is expected")
    d2t = offsets.to(torch.int64) + torch.arange(vd)  # target id = draft id + d2t[draft id]
    if int(d2t.min()) < 0 or int(d2t.max()) >= v:
        raise CheckpointError(f"{w.directory}: tensor 'd2t' maps draft tokens outside the "
                              f"target vocabulary [0, {v})")
    return lm_head, d2t.to(device)


def from_pretrained(model_dir: PathLike, draft_dir: Optional[PathLike] = None, *,
                    draft: str = "derived", dtype=None, device="cpu") -> EagleModels:
    """`EagleModels` from a local Llama checkpoint and, optionally, an EAGLE head.

    Args:
        model_dir: a Hugging Face ``LlamaForCausalLM`` checkpoint directory.
        draft_dir: an EAGLE-1/2 or EAGLE-3 head directory (see the module
            docstring), or None for a head made from the target: ``draft``.
        draft: without ``draft_dir``, ``"derived"`` (a copy of target layer 0
            reading the token embedding; the target is left as loaded) or
            ``"random"``. Ignored when ``draft_dir`` is given.
        dtype: torch dtype or its name; None: the target checkpoint's.
        device: where the weights go (converted there, layer by layer).
    """
    if draft not in ("derived", "random"):
        raise ValueError(f"draft must be 'derived' or 'random', got {draft!r}")
    target = load_target(model_dir, dtype=dtype, device=device)
    if draft_dir is not None:
        return EagleModels(target, load_draft(draft_dir, target, device=device))
    if draft == "random":
        return EagleModels(target, EagleDraft.random(target))
    return EagleModels(target, EagleDraft.derived(target))
