"""Train the paper's attention-only models offline on CPython's docs and stdlib sources.

    python -m pycircuits_widgets.train --layers 2 --out runs/2l --steps 4000
    python -m pycircuits_widgets.train --layers 2 --out runs/2l --steps 4000 --resume   # continue
    python -m pycircuits_widgets.train --layers 2 --out runs/2l --steps 4000 --resume --ship

The shipped models: ``--layers 0 --steps 4000``, ``--layers 1 --steps 4000``, ``--layers 2
--steps 9000 --repeat-fraction 0.6 --seed 1``, all other options at their defaults. One thread
by default: on a shared 2-core machine two threads ran several times slower than one (oversubscription).

Seeded and deterministic (the batch of step ``s`` depends only on ``seed`` and ``s``), so a
resumed run reproduces an uninterrupted one. Every ``--checkpoint-every`` steps ``OUT`` gets
``model.safetensors`` + ``model.json`` (config, step, corpus hash, losses) and
``optimizer.safetensors``. ``--ship`` exports float16 weights to
``pycircuits_widgets/checkpoints/attn-only-{L}l.{safetensors,json}``.
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from .models.attn_only import AttnOnlyTransformer, attn_only_config
from .models.checkpoints import CheckpointError, load_json, load_tensors, save_json, save_tensors
from .models.corpus import corpus_documents, corpus_sha256
from .models.tokenizer import Tokenizer

CHECKPOINT_DIR = Path(__file__).parent / "checkpoints"
TOKENIZER_PATH = CHECKPOINT_DIR / "tokenizer.json"
ARCH_ARGS = ("layers", "heads", "d_model", "d_head", "n_ctx", "pos_scale")
VAL_FRACTION = 0.02


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m pycircuits_widgets.train", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, required=True, help="number of attention layers (0, 1, 2, ...)")
    p.add_argument("--out", type=Path, required=True, help="run directory (checkpoints land here)")
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--d-head", type=int, default=16)
    p.add_argument("--n-ctx", type=int, default=128)
    p.add_argument("--pos-scale", type=float, default=1.5, help="amplitude of the sinusoidal position table")
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--repeat-fraction", type=float, default=0.5,
                   help="fraction of training windows that repeat a corpus snippet (induction curriculum)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--checkpoint-every", type=int, default=100)
    p.add_argument("--corpus", choices=("pydoc", "stdlib", "all"), default="all")
    p.add_argument("--tokenizer", type=Path, default=TOKENIZER_PATH,
                   help="tokenizer JSON; trained on the corpus (vocab --vocab) if the file does not exist")
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--stop-at", type=int, default=None,
                   help="checkpoint and stop after this step (time-boxed runs; continue with --resume)")
    p.add_argument("--resume", action="store_true", help="continue from OUT's last checkpoint")
    p.add_argument("--ship", action="store_true", help="export float16 weights into the package checkpoints")
    return p.parse_args(argv)


def corpus_tokens(tokenizer: Tokenizer, source: str) -> tuple[torch.Tensor, str]:
    """The corpus as one stream of ids, documents separated by ``<|endoftext|>``; and its sha256."""
    docs = corpus_documents(source)
    eot = tokenizer.end_of_text_id
    ids: list[int] = []
    for doc_ids in tokenizer.encode_batch(docs):
        ids += doc_ids + [eot]
    return torch.tensor(ids, dtype=torch.long), corpus_sha256(docs)


def split(data: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Train slice and the held-out validation slice (the last ``VAL_FRACTION`` of the stream)."""
    n_val = int(len(data) * VAL_FRACTION)
    return data[:-n_val], data[-n_val:]


def batch_at(data: torch.Tensor, step: int, seed: int, batch: int, n_ctx: int,
             repeat_fraction: float = 0.0) -> torch.Tensor:
    """``[batch, n_ctx + 1]`` random windows of the corpus; a pure function of ``(seed, step)``.

    A ``repeat_fraction`` of the windows are a corpus snippet of random length in
    ``[n_ctx // 4, n_ctx // 2]`` repeated to fill the window: a curriculum that makes induction
    heads form within a CPU budget (code repeats itself too, just less densely).
    """
    gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
    starts = torch.randint(0, len(data) - n_ctx - 1, (batch,), generator=gen)
    periods = torch.randint(max(1, n_ctx // 4), max(2, n_ctx // 2 + 1), (batch,), generator=gen)
    repeated = torch.rand(batch, generator=gen) < repeat_fraction
    offsets = torch.arange(n_ctx + 1).expand(batch, n_ctx + 1)
    offsets = torch.where(repeated[:, None], offsets % periods[:, None], offsets)
    return data[starts[:, None] + offsets]


def lr_at(step: int, lr: float, warmup: int, steps: int) -> float:
    """Linear warmup, then cosine decay to 10% of ``lr``."""
    if step < warmup:
        return lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def next_token_loss(model, windows: torch.Tensor) -> torch.Tensor:
    logits = model(windows[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), windows[:, 1:].reshape(-1))


@torch.no_grad()
def validation_loss(model, val: torch.Tensor, n_ctx: int, max_windows: int = 256, batch: int = 32) -> float:
    """Mean next-token loss over consecutive non-overlapping windows of the held-out slice."""
    n = min(max_windows, (len(val) - 1) // n_ctx)
    windows = torch.stack([val[i * n_ctx: i * n_ctx + n_ctx + 1] for i in range(n)])
    losses = [next_token_loss(model, windows[i:i + batch]) * len(windows[i:i + batch]) for i in range(0, n, batch)]
    return float(torch.stack(losses).sum() / n)


def _optimizer_tensors(opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    return {f"state.{idx}.{key}": value for idx, state in opt.state_dict()["state"].items()
            for key, value in state.items()}


def _restore_optimizer(opt: torch.optim.Optimizer, tensors: dict[str, torch.Tensor]) -> None:
    state: dict[int, dict] = {}
    for name, value in tensors.items():
        _, idx, key = name.split(".", 2)
        state.setdefault(int(idx), {})[key] = value
    opt.load_state_dict({"state": state, "param_groups": opt.state_dict()["param_groups"]})


def model_shapes(model: torch.nn.Module) -> dict[str, tuple[int, ...]]:
    return {name: tuple(p.shape) for name, p in model.named_parameters()}


def save_run(out: Path, model, opt, meta: dict) -> None:
    save_tensors(out / "model.safetensors", dict(model.named_parameters()))
    save_tensors(out / "optimizer.safetensors", _optimizer_tensors(opt))
    save_json(out / "model.json", meta)


def export_checkpoint(model: AttnOnlyTransformer, meta: dict, dest: Path = CHECKPOINT_DIR) -> Path:
    """Write float16 weights + JSON metadata as ``dest/{cfg.name}.*``; returns the weights path."""
    path = dest / f"{model.cfg.name}.safetensors"
    save_tensors(path, dict(model.named_parameters()), dtype=torch.float16)
    save_json(dest / f"{model.cfg.name}.json", meta)
    return path


def train(args: argparse.Namespace) -> dict:
    """Run (or resume) training; returns the final metadata written to ``OUT/model.json``."""
    torch.set_num_threads(args.threads)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.tokenizer.exists():
        tokenizer = Tokenizer.load(args.tokenizer)
    else:
        tokenizer = Tokenizer.train(corpus_documents(args.corpus), vocab_size=args.vocab)
        tokenizer.save(args.tokenizer)
    data, sha = corpus_tokens(tokenizer, args.corpus)
    train_data, val_data = split(data)

    cfg = attn_only_config(args.layers, n_heads=args.heads, d_model=args.d_model, d_head=args.d_head,
                           d_vocab=tokenizer.vocab_size, n_ctx=args.n_ctx, pos_scale=args.pos_scale)
    model = AttnOnlyTransformer(cfg, seed=args.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.98), weight_decay=args.weight_decay)
    start, base_seconds, segments = 0, 0.0, []
    if args.resume:
        saved = load_json(args.out / "model.json")
        for key in ARCH_ARGS + ("seed", "corpus", "batch", "repeat_fraction"):
            if saved["train_args"][key] != getattr(args, key):
                raise CheckpointError(f"--resume: {args.out / 'model.json'} was trained with {key}="
                                      f"{saved['train_args'][key]!r}, this run asks for {getattr(args, key)!r}")
        weights = load_tensors(args.out / "model.safetensors", model_shapes(model))
        model.load_state_dict(weights, strict=False)
        _restore_optimizer(opt, load_tensors(args.out / "optimizer.safetensors"))
        start = saved["step"]
        base_seconds = saved.get("train_seconds", 0.0)
        segments = saved.get("segments", [])

    meta = {
        "config": cfg.to_dict(),
        "train_args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()
                       if k not in ("out", "resume", "ship", "tokenizer", "threads", "stop_at")},
        "corpus": args.corpus, "corpus_sha256": sha, "corpus_tokens": len(data),
        "python_version": __import__("platform").python_version(),
        "tokenizer_fingerprint": tokenizer.fingerprint(), "torch_version": torch.__version__,
        # one entry per run: a resume with a larger --steps restarts the cosine schedule from there
        "segments": segments + [{"from_step": start, "steps": args.steps, "lr": args.lr}],
    }
    tokens_per_step = args.batch * args.n_ctx
    stop = args.steps if args.stop_at is None else min(args.stop_at, args.steps)
    bar = tqdm(range(start, stop), initial=start, total=args.steps, mininterval=5.0,
               desc=f"attn-only-{args.layers}l")
    run_start = t0 = time.perf_counter()
    loss = float("nan")
    for step in bar:
        for group in opt.param_groups:
            group["lr"] = lr_at(step, args.lr, args.warmup, args.steps)
        loss_t = next_token_loss(model, batch_at(train_data, step, args.seed, args.batch, args.n_ctx, args.repeat_fraction))
        opt.zero_grad(set_to_none=True)
        loss_t.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        loss = loss_t.item()
        done = step + 1
        bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{(done - start) * tokens_per_step / (time.perf_counter() - t0):.0f}")
        if done % args.checkpoint_every == 0 or done == stop:
            meta.update(step=done, train_loss=loss, train_seconds=base_seconds + time.perf_counter() - run_start)
            t0_ckpt = time.perf_counter()
            if done == args.steps:
                meta["val_loss"] = validation_loss(model, val_data, args.n_ctx)
            save_run(args.out, model, opt, meta)
            t0 += time.perf_counter() - t0_ckpt
    if args.ship:
        meta = dict(load_json(args.out / "model.json"))
        path = export_checkpoint(model, {}, CHECKPOINT_DIR)
        half = AttnOnlyTransformer(cfg)
        half.load_state_dict(load_tensors(path, model_shapes(half)), strict=False)
        meta["val_loss_float16"] = validation_loss(half, val_data, args.n_ctx)
        export_checkpoint(model, meta, CHECKPOINT_DIR)
    return meta


def main(argv=None) -> None:
    meta = train(parse_args(argv))
    print({k: meta.get(k) for k in ("step", "train_loss", "val_loss", "val_loss_float16", "train_seconds")})


if __name__ == "__main__":
    main()
