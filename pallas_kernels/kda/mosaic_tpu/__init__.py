"""KDA kernels in Mosaic TPU (TPU interpret mode on CPU): the chunked forward and the decode step.
Not yet run on TPU hardware, so they run only when asked for by name."""
