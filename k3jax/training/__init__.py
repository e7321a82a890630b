"""Fine-tuning K3 models: the loss, the optimizer groups, LoRA, router balancing and the jitted step.

    trainer = Trainer(model, TrainConfig(learning_rate=1e-5, lora_rank=16), mesh=mesh)
    metrics = trainer.step(Batch(input_ids, targets, loss_mask, segment_ids))
    ckpt = trainer.state()        # an Orbax-saveable pytree; trainer.restore(ckpt) resumes exactly
    model = trainer.merged_model()
"""

from k3jax.training.balance import load_imbalance, quantile_balance, sign_balance_update
from k3jax.training.config import (DEFAULT_LORA_TARGETS, EXPERT_LORA_TARGET, LORA_TARGETABLE, REMAT_POLICIES, Batch,
                                   TrainConfig)
from k3jax.training.lora import LoRALinear, LoRARoutedExperts, add_lora, merge_lora
from k3jax.training.loss import LossSums, chunked_cross_entropy, naive_cross_entropy
from k3jax.training.optim import GROUPS, labels, learning_rate_schedule, make_optimizer, param_group
from k3jax.training.step import Trainer

__all__ = [
    "DEFAULT_LORA_TARGETS", "EXPERT_LORA_TARGET", "GROUPS", "LORA_TARGETABLE", "REMAT_POLICIES", "Batch",
    "LoRALinear", "LoRARoutedExperts", "LossSums", "TrainConfig", "Trainer", "add_lora", "chunked_cross_entropy",
    "labels", "learning_rate_schedule", "load_imbalance", "make_optimizer", "merge_lora", "naive_cross_entropy",
    "param_group", "quantile_balance", "sign_balance_update",
]
