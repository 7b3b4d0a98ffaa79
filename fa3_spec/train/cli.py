"""``fa3-spec train-draft``: train an EAGLE-3 head for a local Hugging Face Llama.

    fa3-spec train-draft --model DIR --out HEAD --minutes 10 --device cpu
    fa3-spec eagle --model DIR --draft-model HEAD --check-greedy

The target answers the prompts itself (self-distillation: greedy, or sampled
afresh each epoch with ``--temperature``): the checkpoint's own tokenizer
encodes them, through its chat template when it
has one. Without ``--prompts`` the built-in mix (`fa3_spec.train.prompts`)
is used; held-out figures come from a separate set. The run stops at the
first budget reached (``--minutes``, ``--tokens``) and always leaves a head
that ``fa3-spec eagle --draft-model`` loads. Exit status: 0 done, 2 invalid
input (one line, naming it).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import pathlib
import sys
import time

from ..cli.usage import UsageError, at_least, check_writable, non_negative, usage_exit
from .trainer import CPU_DEFAULTS, TrainConfig

DEFAULT_DRAFT_VOCAB = TrainConfig.draft_vocab


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value


def add_parser(sub, help: str) -> argparse.ArgumentParser:
    p = sub.add_parser("train-draft", help=help, description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, metavar="DIR",
                   help="a local Hugging Face LlamaForCausalLM checkpoint (with its tokenizer)")
    p.add_argument("--out", required=True, metavar="DIR",
                   help="where the head (config.json, model.safetensors) and the training "
                        "state go")
    p.add_argument("--minutes", type=_positive_float, default=None,
                   help="wall-clock budget (with --tokens: whichever comes first)")
    p.add_argument("--tokens", type=at_least(1), default=None,
                   help="budget of training tokens (positions scored at the first depth)")
    p.add_argument("--prompts", metavar="FILE.jsonl", default=None,
                   help="prompts to answer, one JSON string or {\"prompt\": ...} per line "
                        "(default: the built-in mix)")
    p.add_argument("--draft-vocab", type=at_least(1), default=None,
                   help=f"tokens the head scores, the target's most frequent (default "
                        f"{DEFAULT_DRAFT_VOCAB} on a GPU, {CPU_DEFAULTS['draft_vocab']} on the "
                        "CPU, or the whole vocabulary if smaller: most of a small target's "
                        "output falls in its most frequent 16K tokens, and the lm_head and "
                        "softmax shrink with it)")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                   help="auto: cuda when available (bf16), else cpu (float32)")
    p.add_argument("--resume", action="store_true",
                   help="continue from --out: the full state if it is there, else the head's "
                        "weights alone")
    p.add_argument("--ttt-steps", type=at_least(1), default=None,
                   help=f"draft steps unrolled in training (weights 0.8^k; default 7 on a GPU, "
                        f"{CPU_DEFAULTS['ttt_steps']} on the CPU)")
    p.add_argument("--batch", type=at_least(1), default=8, help="sequences per optimizer step")
    p.add_argument("--max-new-tokens", type=at_least(1), default=None,
                   help=f"length of each regenerated response (default 128 on a GPU, "
                        f"{CPU_DEFAULTS['max_new_tokens']} on the CPU)")
    p.add_argument("--temperature", type=non_negative(float), default=0.0,
                   help="regenerate responses by sampling at this temperature, a fresh one each "
                        "time a prompt comes up (default 0: greedy, each prompt answered once; "
                        "a small prompt set is then soon memorised)")
    p.add_argument("--max-len", type=at_least(3), default=512, help="tokens per sequence, at most")
    p.add_argument("--lr", type=_positive_float, default=None,
                   help=f"peak learning rate (default 3e-4 on a GPU, {CPU_DEFAULTS['lr']:g} on "
                        "the CPU)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="PATH", default=None, help="write the run's report here")
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    return p


def run(args: argparse.Namespace) -> int:
    try:
        return _run(args)
    except UsageError as exc:
        usage_exit("train-draft", exc)


def _run(args: argparse.Namespace) -> int:
    import torch

    from ..eagle.checkpoint import CheckpointError, load_target
    from ..eagle.text import CheckpointTokenizer, checkpoint_eos_ids, read_prompts
    from .prompts import builtin_prompts, heldout_prompts
    from .trainer import train_draft

    if args.minutes is None and args.tokens is None:
        raise UsageError("give a budget: --minutes, --tokens or both")
    out = pathlib.Path(args.out).expanduser()
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UsageError(f"--out {args.out!r}: {exc.strerror or exc}") from None
    if not os.access(out, os.W_OK):
        raise UsageError(f"--out {args.out!r} is not writable")
    if args.json:
        check_writable("--json", args.json)
    device = "cuda" if args.device == "auto" and torch.cuda.is_available() else args.device
    if device == "auto":
        device = "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda: no CUDA device here")
    if args.prompts is not None:
        try:
            texts = [text for text, _ in read_prompts(args.prompts)]
        except (OSError, ValueError) as exc:
            raise UsageError(f"--prompts: {exc}") from None
        if not texts:
            raise UsageError(f"--prompts {args.prompts!r} holds no prompt")
    else:
        texts = builtin_prompts()
    log = (lambda *a, **k: None) if args.quiet else (
        lambda *a, **k: print(*a, file=sys.stderr, **k))
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    try:
        target = load_target(args.model, dtype=dtype, device=device)
    except (CheckpointError, OSError) as exc:
        raise UsageError(f"--model: {exc}") from None
    vocab_size = target.shape.vocab_size
    if args.draft_vocab is not None and args.draft_vocab > vocab_size:
        raise UsageError(f"--draft-vocab {args.draft_vocab} exceeds the target's vocabulary "
                         f"of {vocab_size}")
    tokenizer = CheckpointTokenizer.load(args.model)
    if tokenizer is None:
        raise UsageError(f"--model {args.model!r}: no tokenizer there to encode the prompts "
                         "(tokenizer.json, with the 'hf' extra installed)")
    chat = tokenizer.has_chat_template
    encode = lambda text: tokenizer.encode(text, chat=chat)  # noqa: E731
    prompts = [encode(t) for t in texts]
    held = [encode(t) for t in heldout_prompts()]
    given = dict(ttt_steps=args.ttt_steps, max_new_tokens=args.max_new_tokens, lr=args.lr,
                 draft_vocab=args.draft_vocab)
    config = dataclasses.replace(TrainConfig.defaults_for(device),
                                 **{k: v for k, v in given.items() if v is not None})
    config = dataclasses.replace(config, batch_size=args.batch, max_len=args.max_len,
                                 draft_vocab=min(config.draft_vocab, vocab_size), seed=args.seed,
                                 holdout=len(held), temperature=args.temperature)
    eos = checkpoint_eos_ids(args.model)
    log(f"fa3-spec train-draft: {args.model} ({target.shape.num_layers} layers, {dtype}) on "
        f"{device}; {len(prompts)} prompts ({'chat template' if chat else 'plain text'}), "
        f"{len(held)} held out; responses "
        f"{f'sampled at T={args.temperature}' if args.temperature else 'greedy'}; draft vocabulary {config.draft_vocab}; budget "
        f"{args.minutes or '-'} min, {args.tokens or '-'} tokens", flush=True)
    last = [0.0]

    def progress(info: dict) -> None:
        now = time.perf_counter()
        if "top1" not in info and now - last[0] < 10:
            return
        last[0] = now
        top1 = " ".join(f"{a:.2f}" for a in info.get("top1", []))
        log(f"  step {info['step']}  {info['tokens']} tokens  {info['tokens_per_s']:.0f} tok/s  "
            f"loss {info['loss']:.3f}" + (f"  held-out top-1 by depth {top1}" if top1 else ""),
            flush=True)

    report = train_draft(target, prompts, out, minutes=args.minutes, tokens=args.tokens,
                         config=config, eos_ids=eos, resume=args.resume,
                         holdout_prompts=held, progress=progress)
    summary = dict(model=str(args.model), out=str(out), device=device, steps=report.steps,
                   tokens=report.tokens, seconds=round(report.seconds, 1),
                   stopped=report.stopped, initial_top1=report.initial_top1,
                   final_top1=report.final_top1, history=report.history,
                   config=vars(args) | dataclasses.asdict(config))
    log(f"  stopped ({report.stopped}) after {report.steps} steps, {report.tokens} tokens, "
        f"{report.seconds:.0f} s; held-out top-1 by depth "
        f"{' '.join(f'{a:.2f}' for a in report.initial_top1)} -> "
        f"{' '.join(f'{a:.2f}' for a in report.final_top1)}; head in {out}", flush=True)
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(summary, indent=2, default=str) + "\n")
    return 0
