"""Building a K3Model from a checkpoint: one road for a Hugging Face release and a converted directory.

    abstract model (`abstract`) -> per item, the source's leaves (`release`: planned and materialised
    from the release; `converted`: restored from Orbax) -> assembled, on a mesh placed as they are
    made (`assemble`, `placement`)

`k3jax.from_pretrained` picks the source from the directory.
"""

from k3jax.load.abstract import abstract_model
from k3jax.load.converted import load_converted
from k3jax.load.release import load_hf_model

__all__ = ["abstract_model", "load_converted", "load_hf_model"]
