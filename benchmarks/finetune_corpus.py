"""Fine-tune the packaged tiny K3 on a real text corpus, offline, and write the loss curve.

The corpus is Debian's `fortunes` package (`apt-get install fortunes`): plain-text files of
quotations, poems and literature excerpts under /usr/share/games/fortunes, one record per `%`-separated
entry. Nothing is downloaded at run time. Every 20th record is held out for the eval loss.

The tiny model (vocab 512, byte-level tokenizer, 13 layers, hidden 128) starts from its random
weights, so the curve shows the whole training loop learning English bytes: from about ln(512) = 6.2
nats/token towards the corpus's byte entropy.

    PYTHONPATH=. python benchmarks/finetune_corpus.py --out corpus_run --steps 150
    PYTHONPATH=. python benchmarks/finetune_corpus.py --out corpus_run --lora-rank 8 --lr 3e-3

Writes `--out`/curve.json (per step: step, loss, eval_loss where measured; summary) and
`--out`/loss.png, and prints a markdown table of the curve every tenth of the run.
"""

from __future__ import annotations

import argparse
import json
import os
import random
from pathlib import Path

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import jax  # noqa: E402

from k3jax.assets import tiny_checkpoint  # noqa: E402
from k3jax.training.run import finetune  # noqa: E402

CORPUS_DIR = Path("/usr/share/games/fortunes")
FILES = ("literature", "songs-poems", "wisdom", "love")


def corpus_records(directory: Path, files: tuple[str, ...]) -> list[str]:
    """The non-empty `%`-separated entries of the given fortune files, in file order."""
    records = []
    for name in files:
        path = directory / name
        if not path.is_file():
            raise SystemExit(f"{path}: missing; install Debian's `fortunes` package (apt-get install fortunes)")
        text = path.read_text(encoding="utf-8", errors="replace")
        records += [entry.strip() for entry in text.split("\n%\n") if entry.strip()]
    return records


def write_jsonl(path: Path, texts: list[str]) -> Path:
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--corpus-dir", type=Path, default=CORPUS_DIR)
    parser.add_argument("--files", default=",".join(FILES), help="fortune files to read")
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--warmup-steps", type=int, default=10)
    parser.add_argument("--lora-rank", type=int, default=0)
    parser.add_argument("--optimizer", default="adamw")
    parser.add_argument("--eval-every", type=int, default=25)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    texts = corpus_records(args.corpus_dir, tuple(args.files.split(",")))
    random.Random(args.seed).shuffle(texts)
    held_out, train = texts[::20], [t for i, t in enumerate(texts) if i % 20]
    args.out.mkdir(parents=True, exist_ok=True)
    train_file = write_jsonl(args.out / "train.jsonl", train)
    eval_file = write_jsonl(args.out / "eval.jsonl", held_out)
    run = args.out / "run"
    result = finetune(tiny_checkpoint(), train_file, run, steps=args.steps, batch_size=args.batch_size,
                      seq_len=args.seq_len, learning_rate=args.lr, warmup_steps=args.warmup_steps,
                      lora_rank=args.lora_rank, optimizer=args.optimizer, eval_data=str(eval_file),
                      eval_every=args.eval_every, save_every=max(args.eval_every, args.steps // 4), seed=args.seed)
    curve = [{k: r[k] for k in ("step", "loss", "eval_loss", "tokens_per_s") if k in r} for r in result.metrics]
    evals = [r for r in curve if "eval_loss" in r]
    summary = {
        "corpus": f"Debian fortunes: {args.files} ({len(train)} train / {len(held_out)} eval records, "
                  f"{sum(map(len, train))} train characters)",
        "model": "k3jax tiny K3 (packaged assets/tiny checkpoint, byte tokenizer, vocab 512)",
        "device": f"{jax.device_count()} x {jax.devices()[0].platform}",
        "steps": result.steps, "batch_size": args.batch_size, "seq_len": args.seq_len, "lr": args.lr,
        "lora_rank": args.lora_rank, "optimizer": args.optimizer,
        "first_loss": curve[0]["loss"], "last_loss": curve[-1]["loss"],
        "first_eval_loss": evals[0]["eval_loss"] if evals else None,
        "last_eval_loss": evals[-1]["eval_loss"] if evals else None,
        "seconds": sum(r["seconds"] for r in result.metrics),
    }
    (args.out / "curve.json").write_text(json.dumps({"summary": summary, "curve": curve}, indent=1))
    (args.out / "loss.png").write_bytes((run / "loss.png").read_bytes())
    print("| step | train loss | eval loss |\n|---:|---:|---:|")
    every = max(1, len(curve) // 10)
    for r in curve:
        if r["step"] == 1 or r["step"] % every == 0 or "eval_loss" in r:
            print(f"| {r['step']} | {r['loss']:.4f} | {r.get('eval_loss', float('nan')):.4f} |")
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
