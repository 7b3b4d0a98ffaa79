"""``fa3-spec eagle``: run the EAGLE loop on a synthetic workload, optionally check it.

    fa3-spec eagle --preset tiny --device cpu --check-greedy
    python3 -m fa3_spec.eagle.cli --preset tiny --topk 8 --page-size 2 --json out.json
    fa3-spec eagle --model Llama-3.1-8B-Instruct --draft-model EAGLE3-LLaMA3.1-Instruct-8B \
        --prompt "Why is the sky blue?" --chat --check-greedy

The workload: ``--requests`` prompts of random tokens (default twice
``--batch``, so requests join as others finish), lengths cycling through page
boundaries (1, P-1, P, P+1, 2P, ...) and random ones, each with its own
``max_new_tokens`` (between half and all of ``--max-new-tokens``). With
``--check-greedy`` the same prompts are decoded by plain greedy decoding of
the target and compared token for token. A request that differs is a
mismatch (exit status 1) unless its first differing token is a near tie in
greedy's logits there: ``|logit(greedy's token) - logit(this run's token)|
<= 0.02 * max(1, |top-1 logit|)`` (bf16 runs round differently in the
verify forward and in one-token decoding; float64 runs are identical).
``--strict`` makes any difference a mismatch.
``--scripted`` forces the accepted length of each iteration (benchmarks with
random weights): its output is not the model's and cannot be checked.

``--model DIR`` loads a local Hugging Face Llama checkpoint instead of a
preset (``--draft-model DIR``: a published EAGLE-1/2 or EAGLE-3 head; without
it ``--draft`` makes one from the target), tokenizes ``--prompt`` (repeatable)
or ``--prompts FILE.jsonl`` (one prompt a line: ``"text"`` or ``{"prompt": ...,
"max_new_tokens": N}``, N a positive integer) with the checkpoint's own
tokenizer (``--chat``: through its chat template; needs transformers), stops
at the checkpoint's EOS ids, and prints each completion. Without tokenizer
files or prompts it runs the token-id workload above on the loaded model.

Sampling: ``--temperature T`` (> 0 builds the loop with lossless speculative
sampling, docs/semantics.md), ``--top-p P``, ``--sampling-top-k K`` and
``--sampling-seed S`` (request ``i`` gets seed ``S + i``) apply to every
request. ``--topk`` is the draft tree's branching and ``--seed`` the
workload's seed (prompts, weights, page shuffle), not sampling parameters.

It prints its configuration first (the preset, or the loaded model and its
draft head), then progress through both phases (the loop, then the greedy
reference), then the result.

Exit status: 0 when the run finished (and, with ``--check-greedy``, matched
greedy decoding up to near ties, or exactly with ``--strict``); 1 when
``--check-greedy`` found a mismatch; 2 for an invalid invocation or
configuration, with one line naming the problem and no traceback (a size
below 1, ``--alpha`` outside [0, 1], a negative or non-finite ``--noise``,
``--num-draft-tokens 1``, a tree that cannot fill ``--num-draft-tokens``,
``--topk`` above the vocabulary, ``--device cuda`` or ``--graphs`` without
CUDA, ``--check-greedy`` with ``--scripted``, preset options with
``--model`` or text options without it, a checkpoint that cannot be
loaded, prompts longer than the model's positions, ``--check-greedy`` or
``--scripted`` with ``--temperature > 0``, a sampling value out of range, a
``--prompts`` file with no prompt or a line whose ``max_new_tokens`` is not
a positive integer, ``--strict`` without ``--check-greedy``).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import pathlib
import random
import sys
import time
from typing import List, Optional, Tuple

import torch

from ..cli.usage import UsageError, at_least, check_writable, non_negative, usage_exit
from ..config import DRAFT_ATTENTION, SpecConfig
from .checkpoint import draft_kind, from_pretrained
from ..graphs import COMPILE_BACKENDS, check_buckets
from .acceptance import scripted_acceptance
from .engine import EagleEngine, default_buckets, draft_vocab_size
from .greedy import greedy_generate
from .greedy_check import NEAR_TIE, NEAR_TIE_RULE, compare_with_greedy
from .prefill import eos_set
from .sync_probe import HostSyncProbe
from .kernels import parse_kernels, select_kernels, selected_kernels
from .iteration import DEFAULT_SCRIPT, LoopConfig
from .models import make_models
from .policy import AcceptanceProfile, CostProfile, choose_shapes, shape_key
from .text import CheckpointTokenizer, checkpoint_eos_ids, read_prompts

#: ``--alpha``'s default (presets only).
DEFAULT_ALPHA = 0.05

DTYPES = {"float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16,
          "float16": torch.float16}


_positive = at_least(1)


def _unit_interval(text: str) -> float:
    """argparse type: a float in [0, 1]."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"must be in [0, 1], got {text}")
    return value


def _top_p(text: str) -> float:
    """argparse type: a float in (0, 1]."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text}")
    return value


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", default=None, choices=["tiny", "llama3-8b"],
                   help="random-weight model (default tiny; not with --model)")
    p.add_argument("--device", default="auto", help="cpu, cuda or auto")
    p.add_argument("--batch", type=_positive, default=8, help="batch rows (max_bs)")
    p.add_argument("--requests", type=_positive, default=None, help="requests (default 2 * batch)")
    p.add_argument("--page-size", type=_positive, default=2)
    p.add_argument("--topk", type=_positive, default=4,
                   help="the draft's branching (tree width); not the sampling top-k "
                        "(--sampling-top-k)")
    p.add_argument("--num-steps", type=_positive, default=5)
    p.add_argument("--num-draft-tokens", type=_positive, default=8)
    p.add_argument("--draft-attention", choices=list(DRAFT_ATTENTION),
                   default=LoopConfig.draft_attention,
                   help="what a tree draft's leaf attends besides the prefix: its true "
                        "ancestors, or its branch's slots (sglang's semantics); default "
                        f"{LoopConfig.draft_attention}")
    p.add_argument("--max-new-tokens", type=_positive, default=32)
    p.add_argument("--prompt-len", type=_positive, default=40, help="longest prompt")
    p.add_argument("--seed", type=int, default=0,
                   help="the workload's seed (prompts, weights, page shuffle); not the "
                        "sampling seed (--sampling-seed)")
    p.add_argument("--dtype", default=None, choices=sorted(DTYPES),
                   help="default float64 on CPU, bfloat16 on CUDA")
    p.add_argument("--draft", default="derived", choices=["derived", "random"],
                   help="derived: agrees with the target mostly; random: mostly rejected")
    p.add_argument("--alpha", type=_unit_interval, default=None,
                   help="residual scale of target layers 1.., in [0, 1] (derived draft of a "
                        f"preset; default {DEFAULT_ALPHA}; 1: the random target untouched; "
                        "smaller: more agreement)")
    p.add_argument("--noise", type=non_negative(float), default=0.0,
                   help="relative noise on the derived draft, finite and >= 0")
    p.add_argument("--num-layers", type=_positive, default=None,
                   help="override the preset's depth")
    p.add_argument("--eos", type=int, default=-1, help="EOS token id (-1: none)")
    p.add_argument("--attention-backend", default="auto", choices=["auto", "fa3", "torch"],
                   help="attention: FA3, pure PyTorch, or 'auto' (FA3 on CUDA when it loads)")
    p.add_argument("--buckets", type=_positive, nargs="+", default=None, metavar="B",
                   help="batch sizes to capture, the largest equal to --batch (default: the "
                        "powers of two up to 256 below --batch, plus --batch); a batch runs in "
                        "the smallest bucket that holds it. Under inductor bucket 1 is a frame "
                        "of its own: leaving it out saves compile time and costs batch 1 some "
                        "speed")
    p.add_argument("--graphs", action=argparse.BooleanOptionalAction, default=None,
                   help="capture one CUDA graph per bucket (default: on with CUDA)")
    p.add_argument("--compile-backend", default="auto", choices=list(COMPILE_BACKENDS),
                   help="torch.compile backend of the iteration; 'none': no compile (with graphs: "
                        "eager capture, for debugging); default 'auto': inductor on CUDA, none on CPU")
    p.add_argument("--compile-cache", metavar="PATH", default=None,
                   help="file of PyTorch's compile caches: loaded before compiling, written after "
                        "capture (a restart skips most of inductor's work)")
    p.add_argument("--kernels", nargs="+", default=[], metavar="NAME=VALUE",
                   help="the ops' CUDA kernels for this run (fa3_spec.eagle.kernels.Kernels), "
                        "e.g. expand_attention=fa3 (a tree's expand calls on FA3 instead of the "
                        "Triton kernel) or gemm=cublas pdl=off; default: the library's")
    p.add_argument("--scripted", default=None, nargs="?", const=",".join(map(str, DEFAULT_SCRIPT)),
                   help="force emitted tokens per iteration from this sequence "
                        f"(default {','.join(map(str, DEFAULT_SCRIPT))}, mean 3.5); output is not the model's")
    p.add_argument("--check-greedy", action="store_true",
                   help="also decode greedily without speculation and compare token for token; "
                        "a request that differs passes only if its first differing token is a "
                        "near tie in greedy's logits there: |logit(greedy's token) - "
                        f"logit(this run's token)| <= {NEAR_TIE} * max(1, |top-1 logit|) "
                        "(bf16 rounding); the summary and --json give the count of near ties "
                        "and the worst gap")
    p.add_argument("--strict", action="store_true",
                   help="with --check-greedy: any difference is a mismatch, near tie or not")
    p.add_argument("--count-syncs", action=argparse.BooleanOptionalAction, default=True,
                   help="count host syncs per iteration launch (CUDA; adds host time to each "
                        "launch: --no-count-syncs for timings)")
    p.add_argument("--temperature", type=non_negative(float), default=0.0,
                   help="sampling temperature of every request (0: greedy; > 0: lossless "
                        "speculative sampling)")
    p.add_argument("--top-p", type=_top_p, default=1.0, help="sampling top-p, in (0, 1] (1: off)")
    p.add_argument("--sampling-top-k", type=non_negative(int), default=0,
                   help="sampling top-k (0: off); not --topk, the draft's branching")
    p.add_argument("--sampling-seed", type=int, default=None,
                   help="request i samples with seed S + i (default: fresh seeds, not "
                        "reproducible); not --seed, the workload's seed")
    g = p.add_argument_group(
        "speculation per batch bucket",
        "Pick each bucket's tree shape, or plain decoding, with the most expected tokens/s "
        "(fa3_spec.eagle.policy.choose_shapes) from a cost profile measured once per machine "
        "(python3 benchmarks/loop.py costs) and an acceptance profile (per draft depth and "
        "sibling rank; --acceptance-out writes one from a run). Without them every bucket runs "
        "--topk/--num-steps/--num-draft-tokens.")
    g.add_argument("--cost-profile", metavar="FILE.json", default=None,
                   help="ms per iteration of candidate shapes and of plain decoding, per bucket")
    g.add_argument("--acceptance-profile", metavar="FILE.json", default=None,
                   help="acceptance rates per draft depth and sibling rank")
    g.add_argument("--max-shapes", type=_positive, default=None, metavar="K",
                   help="use at most K shapes over all the buckets, plain decoding counting as "
                        "one (each is compiled and captured of its own): fewer shapes, a shorter "
                        "cold start (default: no bound)")
    g.add_argument("--acceptance-out", metavar="FILE.json", default=None,
                   help="write this run's measured acceptance profile here")
    p.add_argument("--json", metavar="PATH", help="write the result as JSON")
    p.add_argument("--quiet", action="store_true")
    add_model_arguments(p)


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    """``--model`` and the text options (see the module docstring)."""
    g = p.add_argument_group("your own model (local Hugging Face checkpoints)")
    g.add_argument("--model", metavar="DIR", help="Llama checkpoint directory (instead of --preset)")
    g.add_argument("--draft-model", metavar="DIR", help="EAGLE-1/2 or EAGLE-3 head directory")
    prompts = g.add_mutually_exclusive_group()
    prompts.add_argument("--prompt", metavar="TEXT", action="append",
                         help="a prompt (repeat for several)")
    prompts.add_argument("--prompts", metavar="FILE.jsonl",
                         help='one prompt a line: "text" or {"prompt": ..., "max_new_tokens": N}, '
                              "N a positive integer (default --max-new-tokens)")
    g.add_argument("--chat", action="store_true",
                   help="apply the checkpoint's chat template (needs transformers)")


def add_parser(subparsers, help: Optional[str] = None) -> argparse.ArgumentParser:
    """Register ``eagle`` on the ``fa3-spec`` command's subparsers."""
    p = subparsers.add_parser("eagle", help=help, description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    p.set_defaults(func=run)
    return p


def workload(n: int, *, page_size: int, max_prompt: int, max_new: int, vocab: int,
             seed: int, min_new: Optional[int] = None) -> tuple:
    """``(prompts, max_new_tokens)``: page-boundary and random prompt lengths;
    new tokens drawn from ``[min_new, max_new]`` (default ``min_new = max_new / 2``)."""
    rng = random.Random(seed)
    p = page_size
    special = [x for x in (1, p - 1, p, p + 1, 2 * p, 2 * p + 1, 3 * p - 1) if 1 <= x <= max_prompt]
    prompts, news = [], []
    for i in range(n):
        length = special[i // 2 % len(special)] if i % 2 == 0 else rng.randint(1, max_prompt)
        prompts.append([rng.randrange(vocab) for _ in range(length)])
        low = (max_new + 1) // 2 if min_new is None else min(min_new, max_new)
        news.append(max(1, rng.randint(low, max_new)))
    return prompts, news


def _resolve_device(name: str) -> str:
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        kind = torch.device(name).type
    except RuntimeError:
        kind = None
    if kind not in ("cpu", "cuda"):
        raise UsageError(f"--device must be cpu, cuda, cuda:N or auto, got {name!r}")
    if kind == "cuda" and not torch.cuda.is_available():
        raise UsageError(f"--device {name}: no CUDA device is available")
    return name


@dataclasses.dataclass
class LoadedModel:
    """What ``--model`` brings: the models, the checkpoint's EOS ids, and the
    text prompts (empty: the token-id workload) with their tokenizer."""

    models: object
    eos: Tuple[int, ...]
    texts: List[str]
    prompts: List[List[int]]
    news: List[int]
    tokenizer: Optional[CheckpointTokenizer]
    info: dict


def prompt_file(path: str) -> List[Tuple[str, Optional[int]]]:
    """``--prompts FILE``: `read_prompts`'s ``(text, max_new_tokens or None)``
    per line, refusing what it would coerce (a ``max_new_tokens`` that is not a
    positive int: a float, a bool, 0) and a file with no prompt.

    Raises:
        UsageError: naming the file, and the line and field where one is at fault.
    """
    try:
        lines = pathlib.Path(path).expanduser().read_text().splitlines()
    except (OSError, ValueError) as exc:
        raise UsageError(f"--prompts: {exc}") from None
    for n, line in enumerate(lines, 1):
        try:
            item = json.loads(line) if line.strip() else None
        except json.JSONDecodeError:
            continue  # read_prompts names the line
        new = item.get("max_new_tokens") if isinstance(item, dict) else None
        if new is not None and (isinstance(new, bool) or not isinstance(new, int) or new < 1):
            raise UsageError(f"--prompts {path}:{n}: max_new_tokens must be a positive integer, "
                             f"got {json.dumps(new)}")
    try:
        items = read_prompts(path)
    except (OSError, ValueError) as exc:
        raise UsageError(f"--prompts: {exc}") from None
    if not items:
        raise UsageError(f"--prompts {path}: no prompt (the file is empty or only blank lines)")
    return items


def load_model(args: argparse.Namespace, device: str, dtype) -> LoadedModel:
    """``--model`` / ``--draft-model`` and the prompts (read first), tokenized."""
    items = ([(t, None) for t in args.prompt] if args.prompt else
             prompt_file(args.prompts) if args.prompts else [])
    models = from_pretrained(args.model, args.draft_model, draft=args.draft, dtype=dtype,
                             device=device)
    tok = CheckpointTokenizer.load(args.model) if items else None
    if args.chat and (tok is None or not tok.transformers):
        raise UsageError("--chat needs transformers and the checkpoint's tokenizer files "
                         "(pip install 'fa3-spec[hf]')")
    if items and tok is None:
        print(f"fa3-spec eagle: no tokenizer for {args.model} (tokenizer files, and "
              "transformers or tokenizers): running the token-id workload", file=sys.stderr)
    texts, prompts, news = [], [], []
    if tok is not None:
        for text, new in items:
            texts.append(text)
            prompts.append(tok.encode(text, chat=args.chat))
            news.append(args.max_new_tokens if new is None else new)
    kind = draft_kind(args.draft_model) if args.draft_model else f"{args.draft} (made here)"
    info = dict(path=str(args.model), draft_path=args.draft_model and str(args.draft_model),
                draft_kind=kind, tokenizer=None if tok is None else (
                    "transformers" if tok.transformers else "tokenizers"),
                chat=args.chat)
    return LoadedModel(models, checkpoint_eos_ids(args.model), texts, prompts, news, tok, info)


def _scripted(args: argparse.Namespace) -> Optional[tuple]:
    if args.scripted is None:
        return None
    try:
        scripted = tuple(int(x) for x in args.scripted.split(","))
        if not scripted or min(scripted) < 1:
            raise ValueError
    except ValueError:
        raise UsageError(f"--scripted must be comma-separated integers >= 1, got "
                         f"{args.scripted!r}") from None
    if args.check_greedy:
        raise UsageError("--check-greedy cannot check a --scripted run: its emitted tokens "
                         "are forced, not the model's")
    return scripted


def _describe(c: dict, scripted: Optional[tuple], model: Optional[dict] = None) -> str:
    """The configuration line printed first: the preset, or the loaded model
    (``model``: `LoadedModel.info`) and its draft head's kind."""
    label = (f" [SCRIPTED: emitted tokens per iteration forced to {list(scripted)}]"
             if scripted else "")
    if c["temperature"] > 0:
        label += (f", sampling T={c['temperature']} top-k={c['sampling_top_k']} "
                  f"top-p={c['top_p']}")
    if model is None:
        name = f"preset {c['preset']}"
    elif model["draft_path"]:
        name = f"model {model['path']} + {model['draft_kind']} head {model['draft_path']}"
    else:
        name = f"model {model['path']} + draft {model['draft_kind']}"
    shape = (f"topk={c['topk']} steps={c['num_steps']} N={c['num_draft_tokens']}"
             if c["topk"] is not None else "a shape per bucket (below),")
    return (f"fa3-spec eagle: {name} ({c['num_layers']} layers, {c['dtype']}) on "
            f"{c['device']}, batch {c['batch']}, {c['requests']} requests, P={c['page_size']} "
            f"{shape} draft attention {c['draft_attention']}, "
            f"max_new_tokens={c['max_new_tokens']}, attention {c['attention_backend']}, "
            f"buckets {c['buckets']}, graphs {'on' if c['graphs'] else 'off'}{label}")


#: Seconds between two progress lines.
PROGRESS_SECONDS = 2.0


class _Every:
    """Calls ``log(text())`` at most every `PROGRESS_SECONDS` (progress lines)."""

    def __init__(self, log):
        self.log, self.last = log, time.perf_counter()

    def __call__(self, text) -> None:
        now = time.perf_counter()
        if now - self.last > PROGRESS_SECONDS:
            self.last = now
            self.log(text(), flush=True)


def run_eagle(args: argparse.Namespace, *, log=print) -> dict:
    """Run the loop as ``args`` says; return the result dictionary (see `run`).

    Prints (through ``log``) the configuration first, then progress lines
    through the loop and the greedy reference.

    Raises:
        UsageError: an invalid invocation or configuration (options that do
            not go together, a checkpoint that cannot be loaded, prompts that
            do not fit), found before anything runs.
    """
    problem = usage_error(args)
    if problem is not None:
        raise UsageError(problem)
    if not args.kernels:  # the process's own choice stands
        return _run_loop(args, log)
    # The ops' kernels for this run (usage_error parsed them), put back after it.
    previous = select_kernels(parse_kernels(args.kernels))
    try:
        return _run_loop(args, log)
    finally:
        select_kernels(previous)


def _run_loop(args: argparse.Namespace, log) -> dict:
    """`run_eagle` once its options are checked and its kernels selected."""
    device = _resolve_device(args.device)
    scripted = _scripted(args)
    dtype = DTYPES[args.dtype] if args.dtype else None
    n_req = args.requests if args.requests is not None else 2 * args.batch
    n = args.num_draft_tokens
    graphs = args.graphs if args.graphs is not None else device == "cuda"
    if graphs and torch.device(device).type != "cuda":
        raise UsageError("--graphs captures CUDA graphs and needs --device cuda")
    loaded = None
    try:  # every configuration error surfaces here, before the run (CheckpointError too)
        if args.model:
            loaded = load_model(args, device, dtype)
            models = loaded.models
            if not args.draft_model:
                print(untrained_draft_warning(args.draft, args.model), file=sys.stderr)
        else:
            models = make_models(args.preset or "tiny", draft=args.draft,
                                 alpha=DEFAULT_ALPHA if args.alpha is None else args.alpha,
                                 noise=args.noise, seed=args.seed, dtype=dtype, device=device,
                                 num_layers=args.num_layers)
        prompts, news = workload(n_req, page_size=args.page_size, max_prompt=args.prompt_len,
                                 max_new=args.max_new_tokens, vocab=models.vocab_size,
                                 seed=args.seed)
        eos = eos_set(args.eos)
        if loaded is not None:
            eos = eos_set(loaded.eos + eos)
            if loaded.prompts:
                prompts, news, n_req = loaded.prompts, loaded.news, len(loaded.prompts)
        buckets = check_buckets(args.buckets or default_buckets(args.batch), args.batch)
        speculation = _speculation(args, buckets)
        shapes = None if speculation is None else {b: c.shape for b, c in speculation.items()}
        chosen = [s for s in (shapes or {}).values() if s]
        vocab = draft_vocab_size(models)
        wide = sorted(b for b, s in (shapes or {}).items() if s and s[0] > vocab)
        if wide:  # refused by the flag the shapes came from, not as the engine's lc
            raise UsageError(f"--cost-profile: the shapes chosen for buckets {wide} draw more "
                             f"children per node (topk) than the draft's vocabulary of {vocab} "
                             "tokens")
        # The loop's own shape: the widest chosen one (every bucket off: the flags').
        base = max(chosen, key=lambda s: s[2]) if chosen else (args.topk, args.num_steps, n)
        tree_shapes = [base] + chosen
        widest = max(s[2] for s in tree_shapes)
        max_new = max([args.max_new_tokens] + news)
        context = max([args.prompt_len] + [len(p) for p in prompts]) + max_new + widest
        if context > models.max_positions:
            raise UsageError(f"prompts + max_new_tokens + num_draft_tokens = {context} "
                             f"positions exceed the model's RoPE table ({models.max_positions})")
        spec = SpecConfig(page_size=args.page_size, topk=base[0], num_steps=base[1],
                          num_draft_tokens=base[2], max_bs=args.batch, max_context_len=context)
        max_reqs = 2 * args.batch
        # Enough pages for every row's largest reservation under any shape,
        # plus the reserved page 0.
        pages = max(spec.with_shape(*shape).pool_pages(max_reqs, args.draft_attention)
                    for shape in tree_shapes)
        spec = dataclasses.replace(spec, num_pages=pages)
        lc = LoopConfig(spec, max_new_tokens=max_new, attention_backend=args.attention_backend,
                        max_eos=max(4, len(eos)), sampling=args.temperature > 0,
                        draft_attention=args.draft_attention)
        engine = EagleEngine(lc, models, max_reqs=max_reqs, buckets=buckets, graphs=graphs,
                             compile_backend=args.compile_backend, cache_path=args.compile_cache,
                             device=device, seed=args.seed,
                             acceptance=scripted_acceptance(scripted) if scripted else None,
                             shapes=shapes)
        for i, (prompt, m) in enumerate(zip(prompts, news)):
            seed = None if args.sampling_seed is None else args.sampling_seed + i
            engine.submit(prompt, m, eos_id=eos, temperature=args.temperature,
                          top_k=args.sampling_top_k, top_p=args.top_p, seed=seed)
    except (ValueError, TypeError) as exc:  # UsageError and CheckpointError are ValueErrors
        raise UsageError(str(exc)) from exc
    config = dict(preset=None if loaded else args.preset or "tiny", device=device,
                  dtype=str(models.dtype).replace("torch.", ""),
                  batch=args.batch, requests=n_req, page_size=args.page_size,
                  # With a cost profile each bucket runs its own shape (``speculation``).
                  topk=args.topk if speculation is None else None,
                  num_steps=args.num_steps if speculation is None else None,
                  num_draft_tokens=n if speculation is None else None,
                  draft_attention=args.draft_attention,
                  max_new_tokens=args.max_new_tokens, prompt_len=args.prompt_len,
                  seed=args.seed, draft=args.draft,
                  alpha=None if loaded else DEFAULT_ALPHA if args.alpha is None else args.alpha,
                  noise=args.noise, num_layers=models.num_target_layers, eos=list(eos),
                  attention_backend=args.attention_backend, buckets=engine.buckets, graphs=graphs,
                  compile_backend=engine.policy.compile_backend or "none",
                  compile_regions=engine.policy.regions,
                  scripted=list(scripted) if scripted else None,
                  temperature=args.temperature, top_p=args.top_p,
                  sampling_top_k=args.sampling_top_k, sampling_seed=args.sampling_seed,
                  cost_profile=args.cost_profile, acceptance_profile=args.acceptance_profile,
                  max_shapes=args.max_shapes, kernels=dataclasses.asdict(selected_kernels()))
    log(_describe(config, scripted, loaded.info if loaded else None), flush=True)
    if speculation is not None:
        for line in describe_speculation(speculation):
            log("  " + line, flush=True)

    capture_s = None
    if graphs:
        log("  capturing one CUDA graph per bucket ...", flush=True)
        t0 = time.perf_counter()
        engine.capture()
        capture_s = time.perf_counter() - t0
    log(f"  EAGLE loop: {n_req} requests ...", flush=True)
    every = _Every(log)

    def progress(eng, host):
        st = eng.stats
        every(lambda: f"  iteration {st.iterations}: {st.finished}/{n_req} "
                      f"done, mean accept {st.mean_accept_len:.2f}")

    if device == "cuda":
        torch.cuda.synchronize()
    probe = HostSyncProbe(engine) if args.count_syncs else contextlib.nullcontext()
    start = time.perf_counter()
    with probe:
        outputs = engine.run(progress)
    if device == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    got = [outputs[i] for i in range(n_req)]
    tokens = sum(len(o) for o in got)
    stats = engine.stats
    syncs = probe.counts if args.count_syncs else []
    result = dict(
        greedy_check=None,
        exact=None,
        mismatches=None,
        tokens=tokens,
        iterations=stats.iterations,
        mean_accept_len=stats.mean_accept_len if stats.row_iterations else None,
        accept_len_histogram={str(a): c for a, c in enumerate(stats.accept_hist.tolist())  # ok-host
                              if c},
        acceptance_by_depth_and_rank=stats.as_dict()["acceptance_rates"][1:],
        host_syncs_per_iteration=(max(syncs) if syncs else None),
        host_syncs_measured_iterations=len(syncs),
        tokens_per_s=tokens / seconds if seconds > 0 else None,
        seconds=seconds,
        ms_per_iteration=1e3 * seconds / max(stats.iterations, 1),
        host_launch_ms_per_iteration=1e3 * stats.launch_seconds / max(stats.iterations, 1),
        capture_s=capture_s,
        captured_graphs=(sum(len(r.buckets) for r in engine.shape_runners.values())
                         if graphs else 0),
        speculation=None if speculation is None else speculation_rows(speculation),
        scripted_acceptance=(f"SCRIPTED: emitted tokens per iteration forced to {list(scripted)}; "
                             "outputs are not the model's" if scripted else None),
        config=config,
        outputs=got,
        model=loaded.info if loaded else None,
    )
    if args.acceptance_out:
        if int(stats.offered.sum()):
            AcceptanceProfile.from_stats(stats).save(args.acceptance_out)
            unseen = (stats.offered[1:] == 0).nonzero().tolist()  # ok-host: host counts
            if unseen:  # written as 0: a policy reading the file will not count on them
                cells = ", ".join(f"({d + 1}, {r})" for d, r in unseen)
                print(f"fa3-spec eagle: --acceptance-out {args.acceptance_out}: no draft node "
                      f"at (depth, rank) {cells} was offered in this run; written as rate 0",
                      file=sys.stderr)
        else:  # an all-zero profile would turn speculation off for good
            print(f"fa3-spec eagle: --acceptance-out {args.acceptance_out}: no draft was offered "
                  "in this run (every iteration decoded plainly); nothing written",
                  file=sys.stderr)
    result["per_request"] = per_request = []
    for rid, st in sorted(engine.request_stats().items()):
        a, sec = st["accept_lens"], st["seconds"]
        per_request.append(dict(tokens=len(got[rid]),
                                mean_accept_len=sum(a) / len(a) if a else None,
                                tokens_per_s=len(got[rid]) / sec if sec > 0 else None))
    if loaded is not None and loaded.tokenizer is not None:
        for entry, text, out in zip(per_request, loaded.texts, got):
            entry.update(prompt=text, completion=loaded.tokenizer.decode(out))
    if args.check_greedy:  # never with --scripted (`_scripted` refuses it)
        logits: list = []
        log(f"  greedy reference: {n_req} requests, up to {max(news)} tokens each ...", flush=True)
        every = _Every(log)
        greedy_start = time.perf_counter()
        ref = greedy_generate(models, prompts, news, eos_ids=[eos] * n_req,
                              page_size=args.page_size, attention_backend=args.attention_backend, device=device,
                              logits_out=logits,
                              on_step=lambda i, steps: every(
                                  lambda: f"  greedy step {i}/{steps}"))
        greedy_s = time.perf_counter() - greedy_start
        result["greedy_tokens_per_s"] = sum(map(len, ref)) / greedy_s if greedy_s > 0 else None
        if loaded is not None and loaded.prompts:  # per prompt, each decoded alone
            for r, (entry, prompt, m) in enumerate(zip(per_request, prompts, news)):
                one = time.perf_counter()
                alone = greedy_generate(
                    models, [prompt], [m], eos_ids=[eos], page_size=args.page_size,
                    attention_backend=args.attention_backend, device=device,
                    on_step=lambda i, steps, r=r: every(
                        lambda: f"  greedy step {i}/{steps} (request {r} alone)"))[0]
                entry["greedy_tokens_per_s"] = len(alone) / (time.perf_counter() - one)
        result.update(_greedy_check(compare_with_greedy(got, ref, logits), strict=args.strict))
    return result


def _speculation(args: argparse.Namespace, buckets):
    """Each bucket's `BucketChoice` from ``--cost-profile`` and
    ``--acceptance-profile``, or None without them."""
    if args.cost_profile is None:
        return None
    try:
        costs = CostProfile.load(args.cost_profile)
    except ValueError as exc:
        raise UsageError(f"--cost-profile: {exc}") from None
    try:
        profile = AcceptanceProfile.load(args.acceptance_profile)
    except ValueError as exc:
        raise UsageError(f"--acceptance-profile: {exc}") from None
    missing = [b for b in buckets if b not in costs.plain]
    if missing:
        raise UsageError(f"--cost-profile {args.cost_profile!r} has no measurement for "
                         f"bucket(s) {missing} (it has {sorted(costs.plain)}); measure them or "
                         "pass --buckets")
    try:
        return choose_shapes(costs, profile, buckets, max_shapes=args.max_shapes)
    except ValueError as exc:  # the only argument left to refuse: the others were checked
        raise UsageError(f"--max-shapes: {exc}") from None


def speculation_rows(choices) -> List[dict]:
    """The per-bucket choice as JSON rows: ``shape`` ``"topk,steps,N"`` or
    ``"off"``, expected accept length, expected tokens/s per row of the shape
    and of plain decoding, and their ratio."""
    return [dict(bucket=b, shape=shape_key(c.shape) if c.shape else "off",
                 expected_accept_length=round(c.expected_accept_length, 4),
                 tokens_per_s_per_row=round(c.tokens_per_s, 2),
                 plain_tokens_per_s_per_row=round(c.plain_tokens_per_s, 2),
                 speedup=round(c.speedup, 4))
            for b, c in sorted(choices.items())]


def describe_speculation(choices) -> List[str]:
    """One line per bucket: its shape (or plain decoding) and why."""
    lines = ["speculation per bucket (expected, from the cost and acceptance profiles):"]
    for row in speculation_rows(choices):
        what = ("plain decoding (no shape beats it)" if row["shape"] == "off" else
                f"topk,steps,N = {row['shape']}, accept length {row['expected_accept_length']:.2f}")
        lines.append(f"  bucket {row['bucket']:>3}: {what}; {row['tokens_per_s_per_row']:.1f} "
                     f"tokens/s per row against plain {row['plain_tokens_per_s_per_row']:.1f} "
                     f"({row['speedup']:.2f}x)")
    return lines


def untrained_draft_warning(draft: str, model) -> str:
    """The line ``--model`` without ``--draft-model`` prints: such a draft was
    made here, not trained, so it rarely agrees with a real target."""
    what = "the target's layer 0" if draft == "derived" else "random weights"
    return (f"fa3-spec eagle: warning: --draft {draft} drafts with {what}, not a trained "
            "head: on a real model expect a mean accept length near 1 and a loop slower "
            f"than plain decoding. Train one with `fa3-spec train-draft --model {model} "
            "--out HEAD` and pass --draft-model HEAD")


def _greedy_check(found: list, *, strict: bool) -> dict:
    """The ``--check-greedy`` part of the result, from `compare_with_greedy`'s
    divergences: ``greedy_check`` is ``"exact"``, ``"near ties"`` (every
    divergence starts at a near tie; not with ``strict``) or ``"mismatch"``."""
    gaps = [d.gap for d in found if d.gap is not None]
    if not found:
        verdict = "exact"
    elif not strict and all(d.near_tie for d in found):
        verdict = "near ties"
    else:
        verdict = "mismatch"
    return dict(
        greedy_check=verdict, strict=strict, exact=not found, mismatches=len(found),
        near_tie_divergences=sum(d.near_tie for d in found),
        worst_gap=max(gaps, key=abs) if gaps else None, near_tie_rule=NEAR_TIE_RULE,
        divergences=[dict(request=d.request, first_divergence=d.position, spec_len=d.run_len,
                          greedy_len=d.greedy_len,
                          spec_token=None if d.tokens is None else d.tokens[0],
                          greedy_token=None if d.tokens is None else d.tokens[1],
                          gap=d.gap, bound=d.bound, near_tie=d.near_tie) for d in found])


def usage_error(args: argparse.Namespace) -> Optional[str]:
    """What makes this combination of options meaningless, or None."""
    if args.json:
        try:
            check_writable("--json", args.json)
        except UsageError as exc:
            return str(exc)
    if args.buckets is not None and max(args.buckets) != args.batch:
        return (f"--buckets: the largest must be --batch ({args.batch}), none above it, so "
                f"that every batch has a bucket; got {sorted(set(args.buckets))}")
    if (args.cost_profile is None) != (args.acceptance_profile is None):
        return "--cost-profile and --acceptance-profile go together (costs and acceptance " \
               "choose each bucket's shape)"
    if args.max_shapes is not None and args.cost_profile is None:
        return "--max-shapes bounds the shapes --cost-profile and --acceptance-profile choose: " \
               "give them too"
    for flag, path in (("--acceptance-out", args.acceptance_out),
                       ("--compile-cache", args.compile_cache)):
        if path:
            try:
                check_writable(flag, path)
            except UsageError as exc:
                return str(exc)
    try:
        parse_kernels(args.kernels)
    except ValueError as exc:
        return f"--kernels: {exc}"
    if args.strict and not args.check_greedy:
        return "--strict goes with --check-greedy (it says what a greedy mismatch is)"
    if args.temperature > 0 and args.check_greedy:
        return "--check-greedy compares with greedy decoding: it needs --temperature 0"
    if args.temperature > 0 and args.scripted:
        return "--scripted forces acceptance and ignores sampling: it needs --temperature 0"
    if args.model:
        given = [f for f, v in (("--preset", args.preset), ("--num-layers", args.num_layers),
                                ("--alpha", args.alpha)) if v is not None]
        if given:
            return f"{', '.join(given)} do(es) not apply to a loaded model (--model)"
    else:
        given = [f for f, v in (("--draft-model", args.draft_model), ("--prompt", args.prompt),
                                ("--prompts", args.prompts), ("--chat", args.chat)) if v]
        if given:
            return f"{', '.join(given)} need(s) --model"
    return None


def run(args: argparse.Namespace) -> int:
    """Entry point of ``fa3-spec eagle``: 0 done (with ``--check-greedy``: equal
    to greedy decoding up to near ties, exactly with ``--strict``), 1 when
    ``--check-greedy`` finds a mismatch; an invalid invocation or
    configuration (options that do not go together, a checkpoint that cannot
    be loaded) exits with status 2 (`usage_exit`)."""
    log = (lambda *a, **k: None) if args.quiet else print
    try:
        res = run_eagle(args, log=log)
    except UsageError as exc:
        usage_exit("eagle", exc)
    c = res["config"]
    model = res["model"]
    syncs = res["host_syncs_per_iteration"]
    log(f"  {res['tokens']} tokens in {res['iterations']} iterations, mean accept length "
        f"{res['mean_accept_len'] or 0:.2f}, {res['tokens_per_s'] or 0:.1f} tokens/s, "
        f"{res['ms_per_iteration']:.2f} ms/iteration, host syncs per iteration: "
        f"{'not measured' if syncs is None else syncs}")
    if res["exact"] is not None:
        log(_greedy_summary(res, c["requests"]))
    if res.get("greedy_tokens_per_s") is not None:
        loop, plain = res["tokens_per_s"] or 0.0, res["greedy_tokens_per_s"]
        log(f"  plain greedy: {plain:.1f} tokens/s (the reference: eager, not captured); "
            f"the loop: {loop:.1f} tokens/s ({loop / plain:.2f}x) at mean accept length "
            f"{res['mean_accept_len'] or 0:.2f}")
    for i, entry in enumerate(res["per_request"] if model else []):
        greedy = entry.get("greedy_tokens_per_s")
        log(f"--- request {i}: {entry['tokens']} tokens, mean accept length "
            f"{entry['mean_accept_len'] or 0:.2f}, {entry['tokens_per_s'] or 0:.1f} tokens/s"
            + (f" (plain greedy alone: {greedy:.1f} tokens/s)" if greedy else ""))
        if "completion" in entry:
            log(f"prompt: {entry['prompt']}")
            print(entry["completion"], flush=True)  # the output itself, even with --quiet
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(res, fh, indent=1)
        log(f"  wrote {args.json}")
    return 1 if res["greedy_check"] == "mismatch" else 0


def _greedy_summary(res: dict, requests: int) -> str:
    """The greedy check's line: the verdict, how many requests differ, how many
    of those first at a near tie, and the worst gap."""
    verdict = {"exact": "EXACT", "near ties": "EQUAL UP TO NEAR TIES",
               "mismatch": "MISMATCH"}[res["greedy_check"]]
    text = f"  greedy check: {verdict} ({res['mismatches']} of {requests} requests differ"
    if res["mismatches"]:
        text += f", {res['near_tie_divergences']} of them first at a near tie"
        if res["worst_gap"] is not None:
            text += f"; worst gap {res['worst_gap']:.3g}"
        text += "; --strict: any difference is a mismatch" if res["strict"] else (
            f"; near tie: {NEAR_TIE_RULE}")
    return text + ")"


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="fa3-spec eagle", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
