"""Training an EAGLE-3 head against its target, in one process.

`train_draft` is the whole job: the target regenerates responses to the
prompts itself (self-distillation), its features are captured online
(`fa3_spec.train.features`), and the head (`fa3_spec.train.head`) learns the
training-time test objective (`fa3_spec.train.objective`) with AdamW, linear
warmup then cosine decay, and gradient clipping. It stops when either budget
(minutes, training tokens) runs out and always leaves a loadable head.

Regeneration is greedy by default: each prompt is answered once and its
response reused every epoch, so a small prompt set is soon memorised.
``TrainConfig.temperature > 0`` samples a fresh response each time a prompt
comes up (`fa3_spec.eagle.greedy.greedy_generate` with sampling, seeded by the
run's seed and the draw's index), so every epoch brings new sequences; the
labels are still the target's whole distribution at each position.
Responses are generated ``regen_batch`` at a time: on a GPU a plain decode
step costs about the same for one row as for hundreds (256 by default); on
the CPU its cost grows with the rows past a few dozen (64 by default).

Checkpoints: ``OUT/`` holds the exported head (`fa3_spec.train.export`) and
``OUT/trainer_state.pt``, the full state (weights, optimizer, schedule, data
position, random state). ``resume=True`` continues from the full state when
it is there, else from the head's weights alone (a head that travelled
without its optimizer, whose state is several times the head's size).
"""

from __future__ import annotations

import dataclasses
import math
import os
import pathlib
import random
import time
from typing import Callable, List, Optional, Sequence

import torch

from ..eagle.greedy import greedy_generate
from ..eagle.models import EagleDraft, EagleModels, LlamaTarget
from ..eagle.sampling import RequestSampling, SamplingParams
from .export import EXPORTED_NAMES, save_head
from .features import target_features
from .head import Eagle3Head
from .objective import ttt_loss
from .vocab import DraftVocab, draft_vocab_from_counts

__all__ = ["TrainConfig", "TrainReport", "train_draft"]

#: File of the full training state inside the output directory.
STATE_FILE = "trainer_state.pt"


#: What a CPU run changes from the defaults. A CPU optimizer step takes
#: seconds (a 135M target's forward over a batch dominates), so a run of
#: minutes makes tens of steps: two unrolled steps, a 4K vocabulary, short
#: responses and a high learning rate learn the most in that many
#: (benchmarks/RESULTS.md); a GPU run of the same minutes makes thousands.
CPU_DEFAULTS = dict(ttt_steps=2, draft_vocab=4096, max_new_tokens=64, lr=2e-3)


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """What a run does besides its budgets.

    ``ttt_steps`` unrolled draft steps (EAGLE-3 trains 7) weighted
    ``step_decay ** k``; ``batch_size`` sequences per optimizer step, each cut
    to ``max_len`` tokens; ``max_new_tokens`` of each regenerated response;
    ``lr`` peak learning rate after ``warmup_steps``, cosine decay to 10% of
    it over ``decay_steps``; ``clip`` the gradient norm bound;
    ``draft_vocab`` tokens the head scores; ``eval_every`` optimizer steps
    between held-out evaluations (and checkpoints); ``holdout`` prompts kept
    for evaluation (never trained on); ``temperature`` of the regenerated
    responses (0: greedy, answered once; the held-out responses are always
    greedy, as the figures are measured at temperature 0); ``regen_batch``
    prompts answered together (None: 256 on a GPU, 64 on the CPU).
    """

    ttt_steps: int = 7
    step_decay: float = 0.8
    batch_size: int = 8
    max_len: int = 512
    max_new_tokens: int = 128
    lr: float = 3e-4
    warmup_steps: int = 20
    decay_steps: int = 2000
    weight_decay: float = 0.0
    clip: float = 0.5
    draft_vocab: int = 16384
    eval_every: int = 50
    holdout: int = 8
    seed: int = 0
    temperature: float = 0.0
    regen_batch: Optional[int] = None

    def __post_init__(self):
        for name in ("ttt_steps", "batch_size", "max_len", "max_new_tokens", "draft_vocab",
                     "eval_every", "decay_steps", "regen_batch"):
            value = getattr(self, name)
            if name == "regen_batch" and value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        for name in ("warmup_steps", "holdout"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an int >= 0, got {value!r}")
        for name in ("lr", "clip", "step_decay"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and 0 < value < math.inf):
                raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 <= t < math.inf:
            raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {t!r}")

    @classmethod
    def defaults_for(cls, device) -> "TrainConfig":
        """The defaults for a run on ``device``: these on a GPU; on the CPU,
        `CPU_DEFAULTS` over them."""
        if torch.device(device).type == "cpu":
            return cls(**CPU_DEFAULTS)
        return cls()

    def learning_rate(self, step: int) -> float:
        """Linear warmup over ``warmup_steps``, then cosine to 10% at ``decay_steps``."""
        if step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        frac = min(1.0, (step - self.warmup_steps) / max(1, self.decay_steps - self.warmup_steps))
        return self.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * frac)))


@dataclasses.dataclass
class TrainReport:
    """What a run did: optimizer ``steps``, training ``tokens`` (scored
    positions of step 0), ``seconds``, why it stopped, and the held-out
    per-depth top-1 acceptance before training (``initial_top1``) and at
    each evaluation (``history``: dicts of step, tokens, loss, top1)."""

    steps: int = 0
    tokens: int = 0
    seconds: float = 0.0
    stopped: str = ""
    initial_top1: List[float] = dataclasses.field(default_factory=list)
    history: List[dict] = dataclasses.field(default_factory=list)

    @property
    def final_top1(self) -> List[float]:
        return self.history[-1]["top1"] if self.history else self.initial_top1


def _check_budget(name: str, value) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
        raise ValueError(f"{name} must be a finite number > 0 (or None), got {value!r}")


def regenerate(models: EagleModels, prompts: Sequence[Sequence[int]], max_new_tokens: int,
               eos_ids: Sequence[int], attention_backend: str, *, temperature: float = 0.0,
               seeds: Optional[Sequence[int]] = None) -> List[List[int]]:
    """Each prompt followed by the target's own response (self-distillation):
    greedy, or sampled at ``temperature`` with one seed per prompt. ``models``:
    the target as `greedy_generate` takes it (`answering_models`)."""
    device = models.target.embed.device
    sampling = None
    if temperature > 0:
        if seeds is None or len(seeds) != len(prompts):
            raise ValueError("seeds must give one seed per prompt when temperature > 0")
        sampling = SamplingParams.stack([RequestSampling.create(temperature, seed=int(sd))
                                         for sd in seeds], device)
    out = greedy_generate(models, prompts, [max_new_tokens] * len(prompts),
                          eos_ids=[list(eos_ids) or -1] * len(prompts),
                          attention_backend=attention_backend, device=device,
                          sampling=sampling)
    return [list(p) + o for p, o in zip(prompts, out)]


def train_draft(target: LlamaTarget, prompts: Sequence[Sequence[int]], out_dir: os.PathLike, *,
                minutes: Optional[float] = None, tokens: Optional[int] = None,
                config: TrainConfig = TrainConfig(), eos_ids: Sequence[int] = (),
                resume: bool = False, attention_backend: str = "auto",
                holdout_prompts: Optional[Sequence[Sequence[int]]] = None,
                export_dtype: Optional[torch.dtype] = None,
                progress: Optional[Callable[[dict], None]] = None) -> TrainReport:
    """Train an EAGLE-3 head for ``target`` and write it to ``out_dir``.

    Args:
        target: the frozen target (its device and dtype are the run's: bf16
            on a GPU, float32 on the CPU are the intended ones).
        prompts: token lists the target answers; the first
            ``config.holdout`` are held out unless ``holdout_prompts`` is given.
        out_dir: where the head and the training state go.
        minutes, tokens: budgets (at least one); the run stops at the first
            one reached, after a whole optimizer step.
        eos_ids: where a regenerated response stops.
        resume: continue from ``out_dir`` (module docstring).
        progress: called after each optimizer step with a dict of step,
            tokens, tokens_per_s, loss, lr (and top1 after an evaluation).

    Raises `ValueError` naming the argument: no budget, a budget <= 0, fewer
    prompts than the held-out split needs, a draft vocabulary larger than
    the target's.
    """
    _check_budget("minutes", minutes)
    _check_budget("tokens", tokens)
    if minutes is None and tokens is None:
        raise ValueError("give a budget: minutes, tokens or both")
    prompts = [list(p) for p in prompts]
    if holdout_prompts is None:
        if len(prompts) <= config.holdout:
            raise ValueError(f"prompts: {len(prompts)} given, more than config.holdout="
                             f"{config.holdout} are needed (the held-out split comes first)")
        holdout_prompts, prompts = prompts[:config.holdout], prompts[config.holdout:]
    if not prompts or any(len(p) < 1 for p in prompts):
        raise ValueError("prompts must be non-empty token lists")
    if config.draft_vocab > target.shape.vocab_size:
        raise ValueError(f"config.draft_vocab={config.draft_vocab} exceeds the target's "
                         f"vocabulary of {target.shape.vocab_size}")
    out = pathlib.Path(out_dir).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    began = time.perf_counter()
    device = target.embed.device
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    export_dtype = export_dtype or (torch.float32 if dtype == torch.float32 else torch.bfloat16)
    rng = random.Random(config.seed)
    torch.manual_seed(config.seed)

    def cut(pairs):
        """``(sequence, start)`` pairs cut to ``max_len`` that keep a scored
        position (`TargetFeatures.starts`: the response, never the prompt)."""
        pairs = [(seq[: config.max_len], start) for seq, start in pairs]
        return [(seq, start) for seq, start in pairs if len(seq) >= max(3, start + 2)]

    regen_batch = config.regen_batch or (256 if device.type == "cuda" else 64)
    answering = answering_models(target)

    def answered_by_target(some_prompts, temperature=0.0, seeds=None):
        seqs = regenerate(answering, some_prompts, config.max_new_tokens, eos_ids, attention_backend,
                          temperature=temperature, seeds=seeds)
        return [(seq, max(len(p) - 1, 0)) for seq, p in zip(seqs, some_prompts)]

    # Greedy responses are deterministic: each prompt is answered once and its
    # sequence reused every epoch (a few hundred KB of token ids). Sampled
    # ones are drawn afresh, each with the seed of its draw's index.
    answered: dict = {}
    draws = [0]

    def answers(indices) -> List[tuple]:
        indices = list(indices)
        if config.temperature > 0:
            seeds = [config.seed * 1_000_003 + draws[0] + j for j in range(len(indices))]
            draws[0] += len(indices)
            return cut(answered_by_target([prompts[i] for i in indices], config.temperature,
                                          seeds))
        missing = [i for i in indices if i not in answered]
        if missing:
            answered.update(zip(missing, answered_by_target([prompts[i] for i in missing])))
        return cut([answered[i] for i in indices])

    def features(pairs):
        return target_features(target, [seq for seq, _ in pairs], head.aux_layers, head.ids,
                               starts=[start for _, start in pairs],
                               attention_backend=attention_backend)

    held = cut(answered_by_target(holdout_prompts)) if holdout_prompts else []
    state_path = out / STATE_FILE
    state = torch.load(state_path, weights_only=False) if resume and state_path.is_file() else None
    exported = out / "model.safetensors"
    if state is not None:
        vocab = DraftVocab(*(t.to("cpu") for t in state["vocab"]))
    elif resume and exported.is_file():
        from safetensors.torch import load_file
        vocab = DraftVocab.from_ids(load_file(str(exported))["t2d"].nonzero().flatten(),
                                    target.shape.vocab_size)
    else:
        # The draft vocabulary from the tokens the target emits on the training prompts.
        first = answers(range(min(len(prompts), max(config.batch_size * 4,
                                                    regen_batch))))
        counts = torch.zeros(target.shape.vocab_size, dtype=torch.int64)
        for seq, start in first:  # the response tokens, as the loop drafts them
            counts += torch.bincount(torch.tensor(seq[start + 1:]),
                                     minlength=target.shape.vocab_size)
        vocab = draft_vocab_from_counts(counts, config.draft_vocab)
    head = Eagle3Head(target, vocab, seed=config.seed, dtype=torch.float32)
    opt = torch.optim.AdamW(head.parameters(), lr=config.lr, weight_decay=config.weight_decay,
                            betas=(0.9, 0.95))
    report = TrainReport()
    order = list(range(len(prompts)))
    cursor = 0
    pending: List[tuple] = []  # (sequence, start) pairs answered, not yet trained on
    if state is not None:
        head.load_state_dict(state["head"])
        opt.load_state_dict(state["optimizer"])
        report = TrainReport(**state["report"])
        order, cursor = state["order"], state["cursor"]
        pending, draws[0] = [tuple(p) for p in state.get("pending", [])], state.get("draws", 0)
        rng.setstate(state["rng"])
    elif resume and exported.is_file():
        _load_exported(head, out)
    else:
        rng.shuffle(order)

    def evaluate() -> dict:
        if not held:
            return dict(loss=float("nan"), top1=[])
        head.eval()
        with torch.no_grad(), _autocast(device, dtype):
            batch = features(held)
            scores = ttt_loss(head(batch.tokens, batch.features, config.ttt_steps, batch.lengths),
                              batch, head.ids, config.step_decay)
        head.train()
        return dict(loss=float(scores.loss), top1=scores.top1)

    def checkpoint() -> None:
        save_head(head, out, dtype=export_dtype)
        tmp = out / (STATE_FILE + ".tmp")
        torch.save(dict(head=head.state_dict(), optimizer=opt.state_dict(),
                        report=dataclasses.asdict(report), order=order, cursor=cursor,
                        pending=pending, draws=draws[0], rng=rng.getstate(), vocab=tuple(vocab),
                        config=dataclasses.asdict(config)),
                   tmp)
        os.replace(tmp, state_path)

    if not report.initial_top1:
        report.initial_top1 = evaluate()["top1"]
    elapsed0 = report.seconds

    def out_of_budget() -> str:
        if tokens is not None and report.tokens >= tokens:
            return "tokens"
        if minutes is not None and elapsed0 + time.perf_counter() - began >= 60 * minutes:
            return "minutes"
        return ""

    while not (stop := out_of_budget()):
        while len(pending) < config.batch_size:
            if cursor >= len(order):
                rng.shuffle(order)
                cursor = 0
            take = order[cursor: cursor + max(config.batch_size, regen_batch)]
            cursor += len(take)
            pending += answers(take)
        seqs, pending = pending[: config.batch_size], pending[config.batch_size:]
        lr = config.learning_rate(report.steps)
        for group in opt.param_groups:
            group["lr"] = lr
        batch = features(seqs)
        with _autocast(device, dtype):
            scores = ttt_loss(head(batch.tokens, batch.features, config.ttt_steps, batch.lengths),
                              batch, head.ids, config.step_decay)
        opt.zero_grad(set_to_none=True)
        scores.loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), config.clip)
        opt.step()
        report.steps += 1
        report.tokens += scores.positions[0]
        report.seconds = elapsed0 + time.perf_counter() - began
        info = dict(step=report.steps, tokens=report.tokens, loss=float(scores.loss.detach()),
                    lr=lr, tokens_per_s=report.tokens / max(report.seconds, 1e-9))
        if report.steps % config.eval_every == 0:
            ev = evaluate()
            report.history.append(dict(step=report.steps, tokens=report.tokens, **ev))
            info["top1"] = ev["top1"]
            checkpoint()
        if progress is not None:
            progress(info)
    report.stopped = stop
    report.seconds = elapsed0 + time.perf_counter() - began
    if not report.history or report.history[-1]["step"] != report.steps:
        report.history.append(dict(step=report.steps, tokens=report.tokens, **evaluate()))
    checkpoint()
    return report


def answering_models(target: LlamaTarget) -> EagleModels:
    """``target`` as the loop's models, for plain decoding only (the draft,
    a copy of layer 0, is never run); built once per run."""
    return EagleModels(target, EagleDraft.derived(target))


def _autocast(device: torch.device, dtype: torch.dtype):
    """bf16 autocast on CUDA (the head's master weights stay float32); nothing on the CPU."""
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=dtype)
    return torch.autocast("cpu", enabled=False)


def _load_exported(head: Eagle3Head, directory: pathlib.Path) -> None:
    """The exported weights of a head into ``head`` (same vocabulary and shape),
    for a resume that travelled without its optimizer state."""
    from safetensors.torch import load_file

    tensors = load_file(str(directory / "model.safetensors"))
    with torch.no_grad():
        for attr, name in EXPORTED_NAMES.items():
            getattr(head, attr).copy_(tensors[name].to(getattr(head, attr).dtype))
        if not torch.equal(tensors["d2t"].to(head.d2t.device), head.d2t):
            raise ValueError(f"{directory}: the exported head's draft vocabulary differs from "
                             "this run's; resume from the full state or start afresh")
