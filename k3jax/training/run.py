"""`finetune`: the fine-tuning loop around `Trainer.step`, for notebooks and for `k3jax finetune`.

    result = k3jax.training.finetune("path/to/Kimi-K3", "data.jsonl", "out", steps=200, lora_rank=16)

OUT holds everything the run makes and needs to go on:

    OUT/run.json         the options, the data files' sha256, the source model (checked by --resume)
    OUT/metrics.jsonl    one line per optimizer step: step (1-based), loss, lr, grad_norm, tokens, tokens/s
    OUT/checkpoints/     Orbax: trainer state + data position (the latest `keep`, and the best by loss)
    OUT/loss.png         the loss curve
    OUT/final/           the fine-tuned model as a release (`k3jax.from_pretrained` reads it)

Nothing is lost on failure: a finished step's metrics line is on disk before the next step starts,
Ctrl-C saves a checkpoint of the last finished step, and a killed run resumes (`resume=True`) from
its latest checkpoint with the same batches and RNG, so the loss curve goes on exactly.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np

from k3jax.checkpoint.names import MXFP4_SUFFIXES
from k3jax.checkpoint.release_writer import write_model_release
from k3jax.checkpoint.safetensors_index import CheckpointIndex
from k3jax.checkpoint.store import is_converted
from k3jax.config import K3Config
from k3jax.model import K3Model
from k3jax.pretrained import from_pretrained
from k3jax.tokenizer import Tokenizer, load_tokenizer
from k3jax.training.checkpointing import RunCheckpoints
from k3jax.training.data import PackedBatches, fingerprint, read_documents, split_documents
from k3jax.training.interrupt import StepBoundaryInterrupt
from k3jax.training.options import FinetuneOptions, read_recorded
from k3jax.training.progress import MetricsLog, ProgressBar, plot_losses, read_metrics
from k3jax.training.config import DEFAULT_LORA_TARGETS, EXPERT_LORA_TARGET, Batch, TrainConfig
from k3jax.training.step import Trainer
from sharding import make_mesh, parse_mesh_spec
from sharding.rules import DEFAULT_RULES

# Files of a release directory that are not weights: copied into OUT/final so it is a complete model.
TOKENIZER_FILES = ("tiktoken.model", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")


@dataclasses.dataclass(frozen=True)
class FinetuneResult:
    out: Path
    final: Path | None  # the exported model (None when interrupted)
    steps: int  # optimizer steps done, in all
    metrics: list[dict[str, Any]]  # every step's metrics line
    interrupted: bool = False


def prepare_out(out: Path, *, resume: bool) -> None:
    """OUT must not exist (a new run) or hold a run (resume): never overwrite a run by accident."""
    if resume and not (out / "run.json").is_file():
        raise ValueError(f"--resume: {out} holds no run to resume (no run.json)")
    if not resume and out.exists():
        raise ValueError(f"{out} already exists; pass --resume to continue the run in it, or choose another --out")


def _trainer_config(options: FinetuneOptions) -> TrainConfig:
    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    wanted = dict(optimizer=options.optimizer, learning_rate=options.learning_rate, warmup_steps=options.warmup_steps,
                  total_steps=options.steps, schedule=options.schedule, weight_decay=options.weight_decay,
                  grad_clip_norm=options.grad_clip_norm, grad_accum_steps=options.grad_accum_steps,
                  lora_rank=options.lora_rank, remat=options.remat)
    if options.lora_alpha is not None:
        wanted["lora_alpha"] = options.lora_alpha
    if options.lora_experts:
        wanted["lora_targets"] = (*DEFAULT_LORA_TARGETS, EXPERT_LORA_TARGET)
    return TrainConfig(**{k: v for k, v in wanted.items() if k in fields})


def _batch(arrays: dict[str, np.ndarray]) -> Batch:
    return Batch(**arrays)


@dataclasses.dataclass(frozen=True)
class RunData:
    """The training pieces and the fixed eval batches, read and checked before the model loads."""

    path: Path
    sha256: str
    pieces: list[dict[str, np.ndarray]]
    eval_batches: list[dict[str, np.ndarray]]

    @classmethod
    def read(cls, path: Path, tokenizer: Tokenizer, vocab_size: int, options: FinetuneOptions) -> "RunData":
        pieces = split_documents(read_documents(path, tokenizer, vocab_size=vocab_size), options.seq_len)
        eval_batches = []
        if options.eval_data is not None:  # one pass over the eval pieces, packed once, in a fixed order
            held_out = split_documents(read_documents(options.eval_data, tokenizer, vocab_size=vocab_size),
                                       options.seq_len)
            rows = -(-sum(len(p["input_ids"]) for p in held_out) // options.seq_len)
            stream = PackedBatches(held_out, batch_size=options.batch_size, seq_len=options.seq_len, seed=0)
            eval_batches = [next(stream) for _ in range(-(-rows // options.batch_size))]
        return cls(path, fingerprint(path), pieces, eval_batches)


class _Run:
    """One run's data, trainer, checkpoints and logs (see `finetune`)."""

    def __init__(self, model: K3Model, source: Path, data: RunData, out: Path, options: FinetuneOptions,
                 resume: bool) -> None:
        self.model, self.source, self.out, self.options = model, source, out, options
        self.stream = PackedBatches(data.pieces, batch_size=options.batch_size, seq_len=options.seq_len,
                                    seed=options.seed)
        self.eval_batches = data.eval_batches
        self.record = {"options": options.to_json(), "source": str(source), "data": str(data.path),
                       "data_sha256": data.sha256}
        if resume:
            recorded = read_recorded(out / "run.json")
            options.check_resumable(recorded["options"], out)
            if recorded.get("data_sha256") != self.record["data_sha256"]:
                raise ValueError(f"--data {data.path}: not the data the run in {out} was trained on (sha256 differs)")
        else:
            out.mkdir(parents=True)
        (out / "run.json").write_text(json.dumps(self.record, indent=1))
        mesh = None if options.mesh is None else make_mesh(options.mesh)
        self.trainer = Trainer(model, _trainer_config(options), mesh=mesh, seed=options.seed)
        self.checkpoints = RunCheckpoints(out / "checkpoints", keep=options.keep,
                                          best_metric="eval_loss" if self.eval_batches else "loss")
        self.log = MetricsLog(out / "metrics.jsonl")
        self.step = 0
        self.since_save: list[float] = []
        if resume:
            self._restore()

    def _restore(self) -> None:
        latest = self.checkpoints.latest_step()
        if latest is None:  # killed before its first checkpoint: start again from step 0
            self.log.truncate(0)
            return
        state, position = self.checkpoints.restore(latest, self.trainer.state())
        self.trainer.restore(state)
        self.stream.seek(position["data"])
        self.step = latest
        self.log.truncate(latest)

    def eval_loss(self) -> float:
        return float(np.mean([float(self.trainer.eval_loss(_batch(b))) for b in self.eval_batches]))

    def save(self) -> None:
        metrics = {"loss": float(np.mean(self.since_save)) if self.since_save else float("nan")}
        if self.eval_batches:
            metrics["eval_loss"] = self.eval_loss()
        self.checkpoints.save(self.step, self.trainer.state(), position={"data": self.stream.position()},
                              metrics=metrics)
        self.since_save = []

    def train(self) -> None:
        """Steps up to `options.steps`, checkpointing every `save_every`; Ctrl-C checkpoints and re-raises."""
        options = self.options
        bar = ProgressBar(options.steps, self.step, enabled=options.progress)
        try:
            with StepBoundaryInterrupt() as stop:
                self._steps(bar, stop)
        except KeyboardInterrupt:
            if self.step and self.checkpoints.latest_step() != self.step:
                self.save()
            raise
        finally:
            bar.close()
            self.checkpoints.wait()

    def _steps(self, bar: ProgressBar, stop: StepBoundaryInterrupt) -> None:
        """The step loop; Ctrl-C ends it only between steps (see `k3jax.training.interrupt`)."""
        options = self.options
        while self.step < options.steps:
            stop.check()
            arrays = next(self.stream)
            start = time.perf_counter()
            metrics = self.trainer.step(_batch(arrays))
            loss = float(metrics["loss"])  # waits for the step
            seconds = time.perf_counter() - start
            self.step += 1
            tokens = int((arrays["segment_ids"] > 0).sum())  # not padding
            record = {"step": self.step, "loss": loss, "lr": float(metrics["lr"]),
                      "grad_norm": float(metrics["grad_norm"]), "tokens": tokens,
                      "loss_tokens": int(metrics["tokens"]), "seconds": seconds, "tokens_per_s": tokens / seconds}
            record.update({k: float(v) for k, v in metrics.items() if k not in record and k != "tokens"})
            if self.eval_batches and self.step % options.eval_every == 0:
                record["eval_loss"] = self.eval_loss()
            self.log.write(record)
            self.since_save.append(loss)
            bar.update(loss, record["tokens_per_s"])
            if self.step % options.save_every == 0 or self.step == options.steps:
                self.save()

    def export(self) -> Path:
        """OUT/final: the trained (LoRA-merged) model as a release; routed experts MXFP4 when they were not
        trained (LoRA: packed ones byte for byte, dense ones re-encoded, which is exact for decoded MXFP4),
        else as trained, in bf16 (full fine-tuning; `lora_experts`: their adapters folded in, since
        W + s B A is not MXFP4-representable and re-encoding it would round the adapters away)."""
        final = self.out / "final"
        if final.exists():  # a resumed run that had finished exports again
            shutil.rmtree(final)
        config = json.loads((self.source / "config.json").read_text())
        write_model_release(final, config, self.trainer.merged_model(), 
                            pack_experts=self.options.lora_rank > 0 and not self.options.lora_experts)
        for name in TOKENIZER_FILES:
            if (self.source / name).is_file():
                shutil.copy2(self.source / name, final / name)
        return final

    def close(self) -> None:
        self.log.close()
        self.checkpoints.close()


def _experts(source: Path, options: FinetuneOptions) -> str | None:
    """How to load the routed experts: dense to train them all; with LoRA (experts frozen) as the
    checkpoint stores them, so MXFP4 experts stay packed (4.25 bits/weight) and export byte for byte."""
    if not options.lora_rank:
        return "bf16"
    if is_converted(source):
        return None  # as converted
    return "mxfp4" if any(n.endswith(MXFP4_SUFFIXES[0]) for n in CheckpointIndex.open(source).names()) else None


def finetune(model: str | Path | K3Model, data: str | Path, out: str | Path, *, resume: bool = False,
             source: str | Path | None = None, tokenizer: Tokenizer | None = None, **options: Any) -> FinetuneResult:
    """Fine-tune `model` (a release / converted directory, or a loaded K3Model with `source` naming the
    directory it came from: its config.json and tokenizer files go into the export) on the JSONL `data`
    (see `k3jax.training.data`), writing the run to `out`. `options` are `FinetuneOptions` fields
    (steps, learning_rate, batch_size, seq_len, lora_rank, optimizer, mesh, ...); all are checked before
    the model loads. Returns the metrics and the exported model's directory (`out`/final)."""
    opts = FinetuneOptions(**options)
    opts.check()
    out, data = Path(out).absolute(), Path(data)
    if not data.is_file():
        raise ValueError(f"--data {data}: no such file")
    prepare_out(out, resume=resume)
    if opts.mesh is not None:
        try:
            parse_mesh_spec(opts.mesh, jax.device_count())
        except ValueError as err:
            raise ValueError(f"--mesh {opts.mesh}: {err}") from None
        if opts.lora_experts and parse_mesh_spec(opts.mesh, jax.device_count()).get(DEFAULT_RULES["exp"], 1) > 1:
            raise ValueError(f"--lora-experts: the adapted routed experts do not run expert-parallel; "
                             f"use a --mesh without an expert axis (got {opts.mesh})")
    if isinstance(model, K3Model):
        if source is None:
            raise ValueError("finetune(model, ...): pass source= the directory the model was loaded from (its "
                             "config.json and tokenizer are exported with the weights)")
        source = Path(source)
    else:
        source = Path(model)
    tokenizer = tokenizer if tokenizer is not None else load_tokenizer(source)
    vocab = model.config.vocab_size if isinstance(model, K3Model) else K3Config.from_hf(source / "config.json").vocab_size
    run_data = RunData.read(data, tokenizer, vocab, opts)
    if not isinstance(model, K3Model):
        model = from_pretrained(source, dtype=opts.dtype, mesh=opts.mesh, experts=_experts(source, opts))
    run = _Run(model, source.absolute(), run_data, out, opts, resume)
    try:
        run.train()
    except KeyboardInterrupt:
        run.close()
        plot_losses(read_metrics(out / "metrics.jsonl"), out / "loss.png")
        return FinetuneResult(out, None, run.step, read_metrics(out / "metrics.jsonl"), interrupted=True)
    final = run.export()
    run.close()
    records = read_metrics(out / "metrics.jsonl")
    plot_losses(records, out / "loss.png")
    return FinetuneResult(out, final, run.step, records)
